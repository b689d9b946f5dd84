//! Pulls leave unpacked layer snapshots: mounted, they equal the image's tree; removing the image
//! frees them, and layers shared with another image stay.

use minicri_proto::runtime::v1 as cri;
use minicri_snapshotter::{Backend, LocalSnapshotter, Options, Snapshotter};
use minicri_tests::daemon::{Daemon, HostsDir};
use minicri_tests::images::{self, MULTI_FILES};
use minicri_tests::registry::Registry;

fn spec(image: &str) -> Option<cri::ImageSpec> {
    Some(cri::ImageSpec {
        image: image.to_string(),
        ..Default::default()
    })
}

async fn chain_id(d: &Daemon, image: &str) -> String {
    let mut c = d.images().await.unwrap();
    let st = c
        .image_status(cri::ImageStatusRequest {
            image: spec(image),
            verbose: true,
        })
        .await
        .unwrap()
        .into_inner();
    let info: serde_json::Value = serde_json::from_str(&st.info["info"]).unwrap();
    info["chainID"]
        .as_str()
        .expect("image is unpacked")
        .to_string()
}

/// The daemon holds its snapshotter's lock: open it only while the daemon is stopped.
fn open_snapshots(d: &Daemon) -> LocalSnapshotter {
    LocalSnapshotter::open(
        d.root().join("snapshots"),
        Backend::Overlay,
        Options::default(),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn pulled_layers_mount_as_the_image_tree_and_go_with_the_image() {
    let registry = Registry::start();
    let set = images::push_standard_set(&registry.addr(), None)
        .await
        .unwrap();
    let hosts = HostsDir::new();
    let mut d = Daemon::start(hosts.path()).await.unwrap();
    let mut c = d.images().await.unwrap();
    for img in [&set.multi, &set.shared_a, &set.shared_b] {
        c.pull_image(cri::PullImageRequest {
            image: spec(&img.reference),
            auth: None,
            sandbox_config: None,
        })
        .await
        .unwrap();
    }
    let multi_chain = chain_id(&d, &set.multi.reference).await;
    let b_chain = chain_id(&d, &set.shared_b.reference).await;
    drop(c);
    d.stop().unwrap();

    {
        let snaps = open_snapshots(&d);
        let mnt = tempfile::tempdir().unwrap();
        let view = snaps.view("test-view", Some(&multi_chain)).unwrap();
        view.mount_at(mnt.path()).unwrap();
        let check = || {
            for (path, want) in MULTI_FILES {
                let p = mnt.path().join(path.trim_start_matches('/'));
                match want {
                    Some(text) => assert_eq!(
                        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{path}: {e}")),
                        *text,
                        "{path}"
                    ),
                    None => assert!(!p.exists(), "{path} was deleted by a whiteout"),
                }
            }
            assert!(
                mnt.path().join("bin/busybox").is_file(),
                "base layer present"
            );
        };
        let r = std::panic::catch_unwind(check);
        minicri_snapshotter::unmount(mnt.path()).unwrap();
        snaps.remove("test-view").unwrap();
        r.unwrap();
    }

    d.restart().await.unwrap();
    let mut c = d.images().await.unwrap();
    c.remove_image(cri::RemoveImageRequest {
        image: spec(&set.multi.reference),
    })
    .await
    .unwrap();
    c.remove_image(cri::RemoveImageRequest {
        image: spec(&set.shared_a.reference),
    })
    .await
    .unwrap();
    drop(c);
    d.stop().unwrap();
    {
        let snaps = open_snapshots(&d);
        let keys: Vec<String> = snaps.list().unwrap().into_iter().map(|i| i.key).collect();
        assert!(
            !keys.contains(&multi_chain),
            "multi's top layer freed: {keys:?}"
        );
        assert!(
            keys.contains(&b_chain),
            "shared-b keeps its layers: {keys:?}"
        );
        // Only shared-b's two layers remain.
        assert_eq!(keys.len(), set.shared_b.layers.len(), "{keys:?}");
    }
    d.restart().await.unwrap();
    let mut c = d.images().await.unwrap();
    c.remove_image(cri::RemoveImageRequest {
        image: spec(&set.shared_b.reference),
    })
    .await
    .unwrap();
    drop(c);
    d.stop().unwrap();
    assert!(
        open_snapshots(&d).list().unwrap().is_empty(),
        "every snapshot freed"
    );
}

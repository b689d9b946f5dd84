//! Pulls leave unpacked layer snapshots: mounted, they equal the image's tree; removing the image
//! frees them, and layers shared with another image stay.

use std::time::Duration;

use minicri_proto::runtime::v1 as cri;
use minicri_snapshotter::{Backend, LocalSnapshotter, Options, Snapshotter};
use minicri_tests::daemon::{Daemon, HostsDir};
use minicri_tests::images::{self, MULTI_FILES};
use minicri_tests::proxy::{Proxy, Target};
use minicri_tests::pull_env::{spawn_pull, unpacking_ahead, wait_until};
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

/// Mounts a view of `chain` (the multi image's top chain) from the stopped daemon's snapshots and
/// asserts it holds [`MULTI_FILES`] and the base layer.
fn assert_multi_tree(d: &Daemon, chain: &str) {
    let snaps = open_snapshots(d);
    let mnt = tempfile::tempdir().unwrap();
    let view = snaps.view("test-view", Some(chain)).unwrap();
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

    assert_multi_tree(&d, &multi_chain);

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

/// Layers unpack at once, and one that turns out to depend on the layer below is applied again
/// on top of it: with the download of multi's middle layer stalled, its top layer (which whites
/// out a file of the middle one) unpacks first; released, the pull applies the top layer again on
/// the committed middle one, and the image's tree has the whiteout in force.
#[tokio::test(flavor = "multi_thread")]
async fn a_layer_unpacked_ahead_that_depends_on_the_one_below_is_applied_again_on_it() {
    let registry = Registry::start();
    let set = images::push_standard_set(&registry.addr(), None)
        .await
        .unwrap();
    let proxy = Proxy::start(&registry.addr()).unwrap();
    let hosts = HostsDir::new();
    let mut d = Daemon::start(hosts.path()).await.unwrap();
    let middle = &set.multi.layers[set.multi.layers.len() - 2];
    proxy
        .faults()
        .stall_after(Target::Blob(middle.digest.clone()), 0);
    let reference = format!("{}/{}:latest", proxy.addr(), set.multi.repository);
    let call = spawn_pull(&d, &reference, None).await;
    assert!(
        proxy
            .faults()
            .wait_stalled(1, Duration::from_secs(20))
            .await,
        "the middle layer stalls"
    );
    // The top layer's own file, written by its apply ahead of the middle layer.
    let root = d.root();
    wait_until(
        "the top layer to be unpacked ahead",
        Duration::from_secs(20),
        || unpacking_ahead(&root, "data/b.txt").is_some(),
    )
    .await;
    proxy.faults().release_stall();
    call.await.unwrap().unwrap();
    let log = d.log();
    let again = log
        .lines()
        .find(|l| l.contains("applying the layer again on top of its parent"))
        .unwrap_or_else(|| panic!("no re-apply in the log:\n{log}"));
    assert!(again.contains("data/removed.txt"), "{again}");
    let chain = chain_id(&d, &reference).await;
    d.stop().unwrap();
    assert_multi_tree(&d, &chain);
}

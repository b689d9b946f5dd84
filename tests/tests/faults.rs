//! Faults: the daemon killed (SIGKILL) in the middle of an operation leaves a state the next
//! start finishes or undoes, with nothing half-done ever used. More of the matrix (SIGKILL during
//! pull: tests/tests/pulls.rs and kubelet_release.rs; a failing CNI plugin:
//! pod_rollback.rs) lives with the feature it exercises.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::Path;
use std::time::{Duration, Instant};

use minicri_proto::runtime::v1 as cri;
use minicri_tests::daemon::{Daemon, HostsDir};
use minicri_tests::images::{Compression, ImageBuilder, LayerBuilder, RegistryClient};
use minicri_tests::registry::Registry;

fn spec(image: &str) -> Option<cri::ImageSpec> {
    Some(cri::ImageSpec {
        image: image.into(),
        ..Default::default()
    })
}

fn names(dir: &Path) -> BTreeSet<OsString> {
    std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default()
}

fn blobs(root: &Path) -> BTreeSet<String> {
    names(&root.join("content/blobs/sha256"))
        .into_iter()
        .map(|n| format!("sha256:{}", n.to_string_lossy()))
        .collect()
}

async fn pull(d: &Daemon, image: &str) -> String {
    d.images()
        .await
        .unwrap()
        .pull_image(cri::PullImageRequest {
            image: spec(image),
            auth: None,
            sandbox_config: None,
        })
        .await
        .unwrap_or_else(|e| panic!("pull {image}: {e:?}"))
        .into_inner()
        .image_ref
}

/// RemoveImage returns once the record is gone and removes the snapshots and blobs in the
/// background; SIGKILL right then, and the next start finishes the removal: the image's
/// snapshots and blobs go, nothing is left in the snapshotter's tmp, and pulling the image again
/// unpacks it afresh.
#[tokio::test(flavor = "multi_thread")]
async fn sigkill_during_remove_image_is_finished_at_the_next_start() {
    let registry = Registry::start();
    let hosts = HostsDir::new();
    let mut d = Daemon::start(hosts.path()).await.expect("minicri");
    let client = RegistryClient::new(&registry.addr());
    // Four layers of 4,096 files: their removal takes long enough to be interrupted.
    let layers = (0..4).map(|l| {
        let mut b = LayerBuilder::new().dir(&format!("l{l}"), 0o755);
        for f in 0..4096 {
            b = b.file(&format!("l{l}/f{f}"), format!("{l}/{f}\n"), 0o644);
        }
        b.build(Compression::Gzip).unwrap()
    });
    let pushed = ImageBuilder::busybox()
        .layers(layers)
        .push(&client, "faults/many:1")
        .await
        .expect("push");
    let image = format!("{}/faults/many:1", registry.addr());
    let root = d.root();
    let snapshots = root.join("snapshots/snapshots");
    assert_eq!(pull(&d, &image).await, pushed.config_digest);
    let own_snapshots = names(&snapshots);
    let own_blobs: BTreeSet<String> = pushed.blob_digests().into_iter().collect();
    assert_eq!(own_snapshots.len(), 5, "{own_snapshots:?}");
    assert!(own_blobs.is_subset(&blobs(&root)));

    d.images()
        .await
        .unwrap()
        .remove_image(cri::RemoveImageRequest {
            image: spec(&image),
        })
        .await
        .expect("RemoveImage");
    d.kill();
    // The kill came before the background work was done (else this test shows nothing).
    let snapshots_left = names(&snapshots).intersection(&own_snapshots).count();
    let blobs_left = blobs(&root).intersection(&own_blobs).count();
    let tmp_left = names(&root.join("snapshots/tmp")).len();
    eprintln!(
        "killed with {snapshots_left} snapshots, {blobs_left} blobs and {tmp_left} trees in tmp left"
    );
    assert!(
        snapshots_left + blobs_left + tmp_left > 0,
        "the removal had finished before the kill"
    );

    d.restart().await.expect("restart");
    let mut c = d.images().await.unwrap();
    let listed = c
        .list_images(cri::ListImagesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .images;
    assert!(
        listed.iter().all(|i| i.id != pushed.config_digest),
        "the removed image is listed again"
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = names(&snapshots).intersection(&own_snapshots).count();
        let b = blobs(&root).intersection(&own_blobs).count();
        let t = names(&root.join("snapshots/tmp")).len();
        if s + b + t == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after the restart, still {s} snapshots, {b} blobs and {t} trees in tmp"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Pulled again: a fresh unpack, whole.
    assert_eq!(pull(&d, &image).await, pushed.config_digest);
    let again = names(&snapshots);
    assert_eq!(again.len(), 5, "{again:?}");
    let files: usize = again.iter().map(|s| walk_count(&snapshots.join(s))).sum();
    assert!(files >= 4 * 4096, "only {files} entries unpacked");
}

fn walk_count(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        1 + walk_count(&e.path())
                    } else {
                        1
                    }
                })
                .sum()
        })
        .unwrap_or(0)
}

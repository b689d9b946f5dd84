//! An image costs its unpacked size on disk: a layer's compressed blob is deleted once the layer
//! is unpacked and its image recorded (unless `--keep-layer-blobs`), and nothing that needed the
//! blob breaks: a later pull of the image (or of one sharing its lower layers) downloads nothing
//! for the unpacked layers, a blob another running pull still reads stays until that pull ends,
//! and a daemon started without the setting deletes the blobs kept before.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use minicri_proto::runtime::v1 as cri;
use minicri_tests::images::{Compression, ImageBuilder, Layer, LayerBuilder, RegistryClient};
use minicri_tests::proxy::Target;
use minicri_tests::pull_env::{Env, env, pull, spawn_pull, wait_until};

/// A layer of `files` text files of about 4 KiB each (compressible, as real layers are).
fn text_layer(tag: &str, files: usize) -> Layer {
    let mut b = LayerBuilder::new().dir(tag, 0o755);
    for f in 0..files {
        let line = format!("{tag} file {f}: the quick brown fox jumps over the lazy dog\n");
        b = b.file(
            &format!("{tag}/f{f}.txt"),
            line.repeat(4096 / line.len()),
            0o644,
        );
    }
    b.build(Compression::Gzip).expect("layer")
}

/// The committed blobs under a daemon root, by digest.
fn stored_blobs(root: &Path) -> BTreeSet<String> {
    std::fs::read_dir(root.join("content/blobs/sha256"))
        .map(|rd| {
            rd.flatten()
                .map(|e| format!("sha256:{}", e.file_name().to_string_lossy()))
                .collect()
        })
        .unwrap_or_default()
}

/// Bytes of the committed blobs under a daemon root.
fn stored_blob_bytes(root: &Path) -> u64 {
    stored_blobs(root)
        .iter()
        .map(|d| {
            std::fs::metadata(root.join("content/blobs/sha256").join(&d[7..]))
                .map_or(0, |m| m.len())
        })
        .sum()
}

async fn listed_size(e: &Env, id: &str) -> u64 {
    let mut c = e.daemon.images().await.unwrap();
    let images = c
        .list_images(cri::ListImagesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .images;
    images.iter().find(|i| i.id == id).expect("listed").size
}

async fn push(
    e: &Env,
    name: &str,
    layers: &[Layer],
) -> (minicri_tests::images::PushedImage, String) {
    let client = RegistryClient::new(e.proxy.upstream());
    let pushed = ImageBuilder::new()
        .layers(layers.iter().cloned())
        .push(&client, &format!("minicri-test/{name}:1"))
        .await
        .expect("push");
    let via_proxy = format!("{}/minicri-test/{name}:1", e.proxy.addr());
    (pushed, via_proxy)
}

/// With the default settings the content store keeps the manifest and the config only, and
/// ListImages gives the unpacked size; with `--keep-layer-blobs true` the compressed layers
/// stay beside the snapshots and the size is the compressed one.
#[tokio::test(flavor = "multi_thread")]
async fn an_image_costs_its_unpacked_size_on_disk() {
    let layers: Vec<Layer> = (0..3).map(|l| text_layer(&format!("l{l}"), 400)).collect();
    let compressed: u64 = layers.iter().map(|l| l.size).sum();
    let unpacked: u64 = layers.iter().map(|l| l.tar_size).sum();
    assert!(unpacked > 10 * compressed, "{unpacked} vs {compressed}");

    let e = env(&[]).await;
    let (img, image) = push(&e, "cost", &layers).await;
    assert_eq!(
        pull(&e.daemon, &image, None).await.unwrap(),
        img.config_digest
    );
    let root = e.daemon.root();
    // Only the manifest and the config, once the pull's record is written.
    let metadata: BTreeSet<String> =
        [img.manifest_digest.clone(), img.config_digest.clone()].into();
    assert_eq!(stored_blobs(&root), metadata);
    assert_eq!(
        stored_blob_bytes(&root),
        img.manifest_size + img.config_size
    );
    assert_eq!(
        listed_size(&e, &img.config_digest).await,
        img.manifest_size + img.config_size + unpacked
    );

    let kept = env(&["--keep-layer-blobs", "true"]).await;
    let (img, image) = push(&kept, "cost", &layers).await;
    assert_eq!(
        pull(&kept.daemon, &image, None).await.unwrap(),
        img.config_digest
    );
    let root = kept.daemon.root();
    assert_eq!(
        stored_blob_bytes(&root),
        img.manifest_size + img.config_size + compressed
    );
    assert_eq!(
        listed_size(&kept, &img.config_digest).await,
        img.manifest_size + img.config_size + compressed
    );
}

/// Pulled again (the kubelet's pull policy Always), an image whose layers are unpacked costs a
/// manifest request and nothing else; an image sharing its two lower layers downloads only its
/// own top layer; a removed image's layers are downloaded again.
#[tokio::test(flavor = "multi_thread")]
async fn a_pull_of_unpacked_layers_downloads_nothing_for_them() {
    let e = env(&[]).await;
    let base = [text_layer("base0", 50), text_layer("base1", 50)];
    let (img, image) = push(&e, "again", &base).await;
    let top = text_layer("top", 50);
    let (over, over_image) =
        push(&e, "over", &[base[0].clone(), base[1].clone(), top.clone()]).await;

    pull(&e.daemon, &image, None).await.unwrap();
    let first = e.proxy.total_blob_bytes();
    assert_eq!(first, img.config_size + base[0].size + base[1].size);

    assert_eq!(
        pull(&e.daemon, &image, None).await.unwrap(),
        img.config_digest
    );
    assert_eq!(
        e.proxy.total_blob_bytes(),
        first,
        "nothing downloaded again"
    );

    assert_eq!(
        pull(&e.daemon, &over_image, None).await.unwrap(),
        over.config_digest
    );
    assert_eq!(
        e.proxy.total_blob_bytes(),
        first + over.config_size + top.size,
        "only the new config and the top layer"
    );
    for l in &base {
        assert_eq!(
            e.proxy.bytes_served(&l.digest),
            l.size,
            "{} served once",
            l.digest
        );
    }
    assert!(
        stored_blobs(&e.daemon.root()).iter().all(|d| ![
            &base[0].digest,
            &base[1].digest,
            &top.digest
        ]
        .contains(&d)),
        "no layer blob stays"
    );

    // Both images removed, their snapshots go, and the next pull downloads the layers again.
    let mut c = e.daemon.images().await.unwrap();
    for name in [&image, &over_image] {
        c.remove_image(cri::RemoveImageRequest {
            image: Some(cri::ImageSpec {
                image: name.to_string(),
                ..Default::default()
            }),
        })
        .await
        .unwrap();
    }
    let snapshots = e.daemon.root().join("snapshots/snapshots");
    wait_until("the snapshots to go", Duration::from_secs(30), || {
        std::fs::read_dir(&snapshots).map_or(0, |d| d.count()) == 0
    })
    .await;
    let before = e.proxy.total_blob_bytes();
    pull(&e.daemon, &image, None).await.unwrap();
    assert_eq!(
        e.proxy.total_blob_bytes() - before,
        img.config_size + base[0].size + base[1].size
    );
}

/// A layer blob another running pull still needs (the same layer above a different parent, so
/// another chain) is not deleted when the first image's pull ends: that pull deletes it when it
/// ends itself, and the blob is downloaded once. The copy snapshotter applies a layer only once
/// its parent is committed, so the second pull reads the blob after the first pull has ended.
#[tokio::test(flavor = "multi_thread")]
async fn a_blob_a_running_pull_needs_stays_until_that_pull_ends() {
    let e = env(&["--snapshotter", "copy"]).await;
    let shared = text_layer("shared", 50);
    let (a, a_image) = push(&e, "first", &[text_layer("a", 20), shared.clone()]).await;
    let slow = text_layer("slow", 20);
    let (b, b_image) = push(&e, "second", &[slow.clone(), shared.clone()]).await;

    // The second pull downloads the shared layer, then waits on its bottom layer.
    e.proxy
        .faults()
        .stall_after(Target::Blob(slow.digest.clone()), 0);
    let second = spawn_pull(&e.daemon, &b_image, None).await;
    wait_until(
        "the shared layer to be stored",
        Duration::from_secs(30),
        || stored_blobs(&e.daemon.root()).contains(&shared.digest),
    )
    .await;
    assert!(
        e.proxy
            .faults()
            .wait_stalled(1, Duration::from_secs(30))
            .await
    );

    // The first image's pull finds the shared blob stored, unpacks it and ends: the blob stays.
    assert_eq!(
        pull(&e.daemon, &a_image, None).await.unwrap(),
        a.config_digest
    );
    assert!(stored_blobs(&e.daemon.root()).contains(&shared.digest));

    e.proxy.faults().release_stall();
    let done = second.await.unwrap().expect("second pull");
    assert_eq!(done.into_inner().image_ref, b.config_digest);
    assert_eq!(
        e.proxy.bytes_served(&shared.digest),
        shared.size,
        "downloaded once"
    );
    assert!(!stored_blobs(&e.daemon.root()).contains(&shared.digest));
}

/// Blobs kept while `--keep-layer-blobs` was on go when the daemon starts without it; the image
/// stays whole (listed with its unpacked size, and pulled again with no layer download).
#[tokio::test(flavor = "multi_thread")]
async fn blobs_kept_before_go_at_the_next_start_without_the_setting() {
    let mut e = env(&["--keep-layer-blobs", "true"]).await;
    let layers = [text_layer("k0", 50), text_layer("k1", 50)];
    let (img, image) = push(&e, "kept", &layers).await;
    pull(&e.daemon, &image, None).await.unwrap();
    let root = e.daemon.root();
    assert!(
        layers
            .iter()
            .all(|l| stored_blobs(&root).contains(&l.digest))
    );

    e.daemon
        .restart_with(&["--ingest-min-free", "0"])
        .await
        .unwrap();
    let metadata: BTreeSet<String> =
        [img.manifest_digest.clone(), img.config_digest.clone()].into();
    assert_eq!(stored_blobs(&root), metadata);
    assert_eq!(
        listed_size(&e, &img.config_digest).await,
        img.manifest_size + img.config_size + layers.iter().map(|l| l.tar_size).sum::<u64>()
    );
    let before = e.proxy.total_blob_bytes();
    assert_eq!(
        pull(&e.daemon, &image, None).await.unwrap(),
        img.config_digest
    );
    assert_eq!(e.proxy.total_blob_bytes(), before);
}

//! Black-box tests of what hostile images and registries can make the daemon do (issue 10,
//! docs/hardening.md): a registry trickling bytes, layers over the unpack limits or with an
//! oversized extension header, a layer aiming the directory-time restore at a host directory, and
//! a registry name that only looks like loopback.

use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use minicri_tests::images::{self, Compression, ImageBuilder, Layer, LayerBuilder};
use minicri_tests::pull_env::*;
use tonic::Code;

/// Pushes a one-layer image made of `tar` (gzip) straight to the registry; returns its
/// reference through the proxy.
async fn push_tar(e: &Env, name: &str, tar: &[u8]) -> String {
    let layer = Layer::from_tar(tar, Compression::Gzip, "hostile layer").unwrap();
    let client = images::RegistryClient::new(e.proxy.upstream());
    ImageBuilder::new()
        .layer(layer)
        .push(&client, &format!("minicri-test/{name}:latest"))
        .await
        .unwrap();
    format!("{}/minicri-test/{name}:latest", e.proxy.addr())
}

/// PullImage, failing the test if it has not returned within `limit`.
async fn pull_within(e: &Env, image: &str, limit: Duration) -> Result<String, tonic::Status> {
    tokio::time::timeout(limit, pull(&e.daemon, image, None))
        .await
        .unwrap_or_else(|_| panic!("PullImage of {image} still running after {limit:?}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_trickling_registry_cannot_hold_a_pull() {
    let e = env(&["--pull-progress-timeout", "2", "--pull-min-speed", "4096"]).await;
    let (_img, r) = big(&e, "trickle", 1, 1, 7).await;
    // 64 bytes/s: bytes keep arriving (no read timeout, no "no progress" rule), far too slowly.
    e.proxy.faults().set_rate_limit(Some(64));
    let start = Instant::now();
    let err = pull_within(&e, &r, Duration::from_secs(30))
        .await
        .unwrap_err();
    assert!(err.message().contains("pull.min_speed"), "{err:?}");
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
    // At a normal speed the same pull goes through.
    e.proxy.faults().set_rate_limit(None);
    pull_within(&e, &r, Duration::from_secs(60)).await.unwrap();
}

/// A ustar header of `typeflag` whose size field says `size`.
fn raw_header(name: &str, typeflag: u8, size: u64) -> Vec<u8> {
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(tar::EntryType::new(typeflag));
    h.set_path(name).unwrap();
    h.set_size(size);
    h.set_mode(0o644);
    h.set_cksum();
    h.as_bytes().to_vec()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_layer_with_a_100_mib_pax_header_fails_the_pull() {
    let e = env(&[]).await;
    let mut tar = raw_header("PaxHeader", b'x', 100 << 20);
    tar.resize(tar.len() + (100 << 20), b'a');
    tar.extend(raw_header("f", b'0', 0));
    tar.extend(std::iter::repeat_n(0u8, 1024));
    let r = push_tar(&e, "pax100", &tar).await;
    drop(tar);
    let err = pull_within(&e, &r, Duration::from_secs(60))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("PAX extended header size"),
        "{err:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn layers_over_the_entry_or_byte_caps_fail_the_pull() {
    let e = env(&["--max-layer-entries", "50", "--max-layer-bytes", "4194304"]).await;
    let mut many = LayerBuilder::new();
    for i in 0..60 {
        many = many.file(&format!("f{i}"), format!("{i}"), 0o644);
    }
    let r = push_tar(&e, "many", &many.tar().unwrap()).await;
    let err = pull_within(&e, &r, Duration::from_secs(60))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("snapshotter.max_layer_entries"),
        "{err:?}"
    );
    assert!(err.message().contains("layer sha256:"), "{err:?}");

    // 8 MiB of zeros: a tiny gzip, twice the byte cap unpacked.
    let bomb = LayerBuilder::new().file("zeros", vec![0u8; 8 << 20], 0o644);
    let r = push_tar(&e, "bomb", &bomb.tar().unwrap()).await;
    let err = pull_within(&e, &r, Duration::from_secs(60))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("snapshotter.max_layer_bytes"),
        "{err:?}"
    );

    // Within both caps: fine.
    let ok = LayerBuilder::new().file("small", vec![1u8; 1 << 20], 0o644);
    let r = push_tar(&e, "ok", &ok.tar().unwrap()).await;
    pull_within(&e, &r, Duration::from_secs(60)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_layer_cannot_set_the_time_of_a_host_directory() {
    let e = env(&[]).await;
    let host = tempfile::tempdir().unwrap();
    let target = host.path().join("etc");
    std::fs::create_dir_all(target.join("ssl")).unwrap();
    let before = std::fs::metadata(target.join("ssl")).unwrap();
    // `a/ssl/` gets its time at the end of the layer; by then `a` is a symlink to the host dir.
    let layer = LayerBuilder::new()
        .dir("a", 0o755)
        .dir("a/ssl", 0o755)
        .symlink("a", target.to_str().unwrap());
    let r = push_tar(&e, "dirtimes", &layer.tar().unwrap()).await;
    pull_within(&e, &r, Duration::from_secs(60)).await.unwrap();
    let after = std::fs::metadata(target.join("ssl")).unwrap();
    assert_eq!(
        (after.mtime(), after.mtime_nsec()),
        (before.mtime(), before.mtime_nsec()),
        "the pull changed the time of a host directory"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_image_config_over_the_cap_fails_the_pull() {
    let e = env(&[]).await;
    // store::pull::MAX_CONFIG_BYTES is 8 MiB: a label makes the config just over it.
    let pad = "x".repeat((8 << 20) + 1024);
    let layer = LayerBuilder::new()
        .file("f", "f", 0o644)
        .build(Compression::Gzip)
        .unwrap();
    let client = images::RegistryClient::new(e.proxy.upstream());
    let img = ImageBuilder::new()
        .layer(layer)
        .label("pad", &pad)
        .push(&client, "minicri-test/bigconfig:latest")
        .await
        .unwrap();
    assert!(img.config_size > 8 << 20, "{}", img.config_size);
    let r = format!("{}/minicri-test/bigconfig:latest", e.proxy.addr());
    let err = pull_within(&e, &r, Duration::from_secs(60))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("image config"), "{err:?}");
    assert!(err.message().contains("exceeds the limit"), "{err:?}");
    // Refused from its descriptor: not one byte of it was downloaded.
    assert_eq!(e.proxy.bytes_served(&img.config_digest), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_name_starting_with_127_is_not_loopback() {
    let e = env(&["--registry-request-timeout", "5"]).await;
    let err = pull_within(&e, "127.evil.example:1/app:v1", Duration::from_secs(60))
        .await
        .unwrap_err();
    assert!(
        err.message().contains("https://127.evil.example:1"),
        "{err:?}"
    );
    assert!(
        !err.message().contains("http://127.evil.example"),
        "{err:?}"
    );
    // An IP literal on loopback still gets plain http.
    let err = pull_within(&e, "127.0.0.1:1/app:v1", Duration::from_secs(60))
        .await
        .unwrap_err();
    assert!(err.message().contains("http://127.0.0.1:1"), "{err:?}");
}

/// Pushes an image written by hand: `layer` (pushed once) listed `times` times in the manifest
/// with the size `layer_size`, and `diff_ids` and `user` as the config's; returns its reference
/// through the proxy.
async fn push_by_hand(
    e: &Env,
    name: &str,
    layer: &Layer,
    layer_size: u64,
    times: usize,
    diff_ids: Vec<String>,
    user: &str,
) -> String {
    let client = images::RegistryClient::new(e.proxy.upstream());
    let repo = format!("minicri-test/{name}");
    client.push_layer(&repo, layer).await.unwrap();
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "rootfs": { "type": "layers", "diff_ids": diff_ids },
        "config": { "Labels": { "name": name }, "User": user },
    }))
    .unwrap();
    let config_digest = images::sha256_digest(&config);
    client
        .push_blob_bytes(&repo, &config_digest, config.clone().into())
        .await
        .unwrap();
    let media_type = "application/vnd.oci.image.manifest.v1+json";
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": media_type,
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config.len(),
        },
        "layers": (0..times).map(|_| serde_json::json!({
            "mediaType": layer.media_type(images::Format::Oci),
            "digest": layer.digest,
            "size": layer_size,
        })).collect::<Vec<_>>(),
    }))
    .unwrap();
    client
        .put_manifest(&repo, "latest", media_type, manifest.into())
        .await
        .unwrap();
    format!("{}/{repo}:latest", e.proxy.addr())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_malformed_diff_id_or_too_many_layers_is_a_failed_precondition() {
    let e = env(&[]).await;
    let layer = LayerBuilder::new()
        .file("f", b"x".to_vec(), 0o644)
        .build(Compression::Gzip)
        .unwrap();
    // A diff_id in upper case: the image is wrong, not the node (it used to be INTERNAL).
    let upper = format!("sha256:{}", layer.diff_id[7..].to_uppercase());
    let r = push_by_hand(&e, "upperdiff", &layer, layer.size, 1, vec![upper], "").await;
    let err = pull_within(&e, &r, Duration::from_secs(60))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("diff_id"), "{}", err.message());
    // 501 layers (one tiny blob, listed again and again): refused from the manifest, before a
    // snapshot is made for any of them.
    let r = push_by_hand(
        &e,
        "deep",
        &layer,
        layer.size,
        501,
        vec![layer.diff_id.clone(); 501],
        "",
    )
    .await;
    let err = pull_within(&e, &r, Duration::from_secs(60))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("501 layers"), "{}", err.message());
    // 500 are pulled.
    let r = push_by_hand(
        &e,
        "deep500",
        &layer,
        layer.size,
        500,
        vec![layer.diff_id.clone(); 500],
        "",
    )
    .await;
    pull_within(&e, &r, Duration::from_secs(300)).await.unwrap();
    // A layer claiming 2^63 - 1 bytes: refused from the manifest. The download planned its
    // ranges from the claimed size, allocating until the kernel killed something.
    let r = push_by_hand(
        &e,
        "huge",
        &layer,
        i64::MAX as u64,
        1,
        vec![layer.diff_id.clone()],
        "",
    )
    .await;
    let err = pull_within(&e, &r, Duration::from_secs(60))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("a blob may have"),
        "{}",
        err.message()
    );
    // A User of 1 MiB: it would be in every ListImages answer (a few such images and those
    // exceed the kubelet's 16 MiB cap); refused before any layer is fetched.
    let unfetched = LayerBuilder::new()
        .file("g", b"y".to_vec(), 0o644)
        .build(Compression::Gzip)
        .unwrap();
    let diff_ids = vec![unfetched.diff_id.clone()];
    let long = "u".repeat(1 << 20);
    let r = push_by_hand(
        &e,
        "longuser",
        &unfetched,
        unfetched.size,
        1,
        diff_ids,
        &long,
    )
    .await;
    let err = pull_within(&e, &r, Duration::from_secs(60))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("User"), "{}", err.message());
    assert_eq!(
        e.proxy.bytes_served(&unfetched.digest),
        0,
        "a layer was fetched for an image refused by its config"
    );
}

/// Two images giving one layer different sizes: downloads are keyed by digest and size, so the
/// right one neither joins nor waits for the wrong one's running download (the wrong one would
/// decide its result): it downloads the blob itself and succeeds while the other still runs;
/// the wrong one then fails on its own, and once the blob is in the store its size settles which
/// descriptor is wrong without a byte downloaded. (The blob stays in the store with
/// `--keep-layer-blobs`; by default it is deleted once unpacked, and a later image naming the
/// same layer chain in its config uses the committed snapshot, whatever its descriptor says of
/// the compressed blob.)
#[tokio::test(flavor = "multi_thread")]
async fn images_giving_one_blob_different_sizes_do_not_share_its_download() {
    let e = env(&["--keep-layer-blobs", "true"]).await;
    let layer = images::random_layer(8, Compression::Gzip, 41).unwrap();
    let diff_ids = vec![layer.diff_id.clone()];
    let wrong = push_by_hand(
        &e,
        "wrongsize",
        &layer,
        layer.size - 4096,
        1,
        diff_ids.clone(),
        "",
    )
    .await;
    let right = push_by_hand(&e, "rightsize", &layer, layer.size, 1, diff_ids, "").await;
    e.proxy.faults().set_rate_limit(Some(MIB));
    let first = spawn_pull(&e.daemon, &wrong, pod(1)).await;
    wait_until(
        "the first bytes of the layer",
        Duration::from_secs(30),
        || e.proxy.bytes_served(&layer.digest) > 0,
    )
    .await;
    // Its own download, at the proxy's 1 MiB/s: about 8 s, not bound to the other one's.
    pull_within(&e, &right, Duration::from_secs(60))
        .await
        .expect("the right one pulls while the wrong one's download runs");
    let err = first.await.unwrap().unwrap_err();
    assert_eq!(err.code(), Code::DataLoss, "{err:?}");
    e.proxy.faults().set_rate_limit(None);

    // The wrong one is refused from the stored blob's size.
    e.proxy.reset_stats();
    let err = pull_within(&e, &wrong, Duration::from_secs(60))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DataLoss, "{err:?}");
    let says = format!(
        "has {} bytes, its descriptor says {}",
        layer.size,
        layer.size - 4096
    );
    assert!(err.message().contains(&says), "{err:?}");
    assert_eq!(e.proxy.bytes_served(&layer.digest), 0);
}

/// A layer whose bytes match its digest but do not decode (not a tar; gzip of something that is
/// not a tar; a gzip stream cut short) is the image's fault: FAILED_PRECONDITION naming the
/// layer, as for any broken image, not UNAVAILABLE (which tells the caller to try again).
#[tokio::test(flavor = "multi_thread")]
async fn a_layer_that_matches_its_digest_but_does_not_decode_is_a_failed_precondition() {
    let e = env(&[]).await;
    let garbage = b"this is not a tar stream at all ".repeat(64);
    let good = LayerBuilder::new()
        .file("f", b"x".repeat(100_000), 0o644)
        .build(Compression::Gzip)
        .unwrap();
    let gzip = good.data().unwrap();
    // `from_tar` with no compression stores the bytes as they are.
    for (name, layer) in [
        ("nottar", Layer::from_tar(&garbage, Compression::None, "x")),
        (
            "gzipnottar",
            Layer::from_tar(&garbage, Compression::Gzip, "x"),
        ),
        (
            "truncatedgzip",
            Layer::from_tar(&gzip[..gzip.len() / 2], Compression::None, "x"),
        ),
    ] {
        let layer = layer.unwrap();
        let diff_ids = vec![layer.diff_id.clone()];
        let r = push_by_hand(&e, name, &layer, layer.size, 1, diff_ids, "").await;
        let err = pull_within(&e, &r, Duration::from_secs(60))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::FailedPrecondition, "{name}: {err:?}");
        assert!(err.message().contains(&layer.digest), "{name}: {err:?}");
    }
}

//! Tests of the test-image builder (`minicri_tests::images`): the standard set round-trips
//! through a real registry with the digests, media types and contents it claims.

use std::collections::{BTreeMap, HashSet};
use std::io::Read;

use minicri_tests::images::*;
use minicri_tests::registry::Registry;
use serde_json::Value;

/// Path → (entry type, mode, link target, contents) of a tar.
fn tar_entries(tar: &[u8]) -> BTreeMap<String, (tar::EntryType, u32, Option<String>, Vec<u8>)> {
    let mut archive = tar::Archive::new(tar);
    let mut out = BTreeMap::new();
    for entry in archive.entries().unwrap() {
        let mut entry = entry.unwrap();
        let path = entry.path().unwrap().to_string_lossy().to_string();
        let header = entry.header().clone();
        let link = entry
            .link_name()
            .unwrap()
            .map(|l| l.to_string_lossy().to_string());
        let mut data = Vec::new();
        entry.read_to_end(&mut data).unwrap();
        out.insert(
            path,
            (header.entry_type(), header.mode().unwrap(), link, data),
        );
    }
    out
}

fn decompress(data: &[u8], media_type: &str) -> Vec<u8> {
    let mut out = Vec::new();
    if media_type.ends_with("gzip") {
        flate2::read::GzDecoder::new(data)
            .read_to_end(&mut out)
            .unwrap();
    } else if media_type.ends_with("zstd") {
        zstd::stream::read::Decoder::new(data)
            .unwrap()
            .read_to_end(&mut out)
            .unwrap();
    } else {
        out.extend_from_slice(data);
    }
    out
}

/// Fetches an image back and checks everything `PushedImage` claims.
/// Layers whose bytes were checked once are not downloaded and unpacked again (`seen`).
async fn check_image(
    client: &RegistryClient,
    image: &PushedImage,
    reference: &str,
    seen: &mut HashSet<String>,
) {
    let manifest = client
        .get_manifest(&image.repository, reference)
        .await
        .unwrap();
    assert_eq!(manifest.digest(), image.manifest_digest, "{reference}");
    assert_eq!(
        manifest.digest_header.as_deref(),
        Some(image.manifest_digest.as_str())
    );
    assert_eq!(manifest.media_type, image.manifest_media_type);
    let json = manifest.json().unwrap();
    assert_eq!(json["schemaVersion"], 2);
    assert_eq!(json["mediaType"], image.manifest_media_type);
    assert_eq!(json["config"]["digest"], image.config_digest);
    assert_eq!(json["config"]["mediaType"], image.config_media_type);

    let config = client
        .get_blob(&image.repository, &image.config_digest)
        .await
        .unwrap();
    assert_eq!(sha256_digest(&config), image.config_digest);
    let config: Value = serde_json::from_slice(&config).unwrap();
    assert_eq!(config["architecture"], image.platform.architecture);
    assert_eq!(config["os"], "linux");
    assert_eq!(config["created"], CREATED);
    assert_eq!(config["rootfs"]["type"], "layers");
    assert_eq!(
        config["config"]["User"].as_str(),
        image.user.as_deref(),
        "{reference}"
    );
    let diff_ids = config["rootfs"]["diff_ids"].as_array().unwrap();
    assert_eq!(diff_ids.len(), image.layers.len());
    assert_eq!(
        config["history"].as_array().unwrap().len(),
        image.layers.len()
    );

    for (i, layer) in image.layers.iter().enumerate() {
        assert_eq!(json["layers"][i]["digest"], layer.digest);
        assert_eq!(json["layers"][i]["mediaType"], layer.media_type);
        assert_eq!(json["layers"][i]["size"], layer.size);
        assert_eq!(diff_ids[i], layer.diff_id);
        if !seen.insert(layer.digest.clone()) {
            continue;
        }
        let blob = client
            .get_blob(&image.repository, &layer.digest)
            .await
            .unwrap();
        assert_eq!(blob.len() as u64, layer.size);
        assert_eq!(sha256_digest(&blob), layer.digest);
        let tar = decompress(&blob, &layer.media_type);
        assert_eq!(
            sha256_digest(&tar),
            layer.diff_id,
            "diff_id of {reference} layer {i}"
        );
    }
}

#[tokio::test]
async fn standard_set_round_trips() {
    let registry = Registry::start();
    let client = registry.client();
    let set = push_standard_set(&registry.addr(), None).await.unwrap();
    assert_eq!(set.registry, registry.addr());
    assert_eq!(set.references().len(), 12);
    let mut seen = HashSet::new();

    for image in set.images() {
        check_image(&client, image, image.tag.as_deref().unwrap(), &mut seen).await;
    }
    for index in set.indexes() {
        let manifest = client
            .get_manifest(&index.repository, "latest")
            .await
            .unwrap();
        assert_eq!(manifest.digest(), index.digest);
        assert_eq!(manifest.media_type, index.media_type);
        let json = manifest.json().unwrap();
        let entries = json["manifests"].as_array().unwrap();
        assert_eq!(entries.len(), 2);
        for (entry, image) in entries.iter().zip(&index.manifests) {
            assert_eq!(entry["digest"], image.manifest_digest);
            assert_eq!(
                entry["platform"]["architecture"],
                image.platform.architecture
            );
            check_image(&client, image, &image.manifest_digest, &mut seen).await;
            // The marker layer says which platform this is.
            let marker = client
                .get_blob(&image.repository, &image.layers[1].digest)
                .await
                .unwrap();
            let files = tar_entries(&decompress(&marker, &image.layers[1].media_type));
            assert_eq!(
                files["platform"].3,
                format!("{}\n", image.platform).into_bytes()
            );
        }
        assert!(index.for_arch("amd64").is_some() && index.for_arch("arm64").is_some());
        assert_ne!(
            index.for_arch("amd64").unwrap().config_digest,
            index.for_arch("arm64").unwrap().config_digest
        );
    }

    // Formats and media types.
    assert_eq!(set.busybox_oci.manifest_media_type, MEDIA_OCI_MANIFEST);
    assert_eq!(set.busybox_oci.layers[0].media_type, MEDIA_OCI_LAYER_GZIP);
    assert_eq!(
        set.busybox_docker.manifest_media_type,
        MEDIA_DOCKER_MANIFEST
    );
    assert_eq!(set.busybox_docker.config_media_type, MEDIA_DOCKER_CONFIG);
    assert_eq!(
        set.busybox_docker.layers[0].media_type,
        MEDIA_DOCKER_LAYER_GZIP
    );
    assert_eq!(set.zstd.layers[0].media_type, MEDIA_OCI_LAYER_ZSTD);
    assert_eq!(set.plain.layers[0].media_type, MEDIA_OCI_LAYER_TAR);
    assert_eq!(set.index.media_type, MEDIA_OCI_INDEX);
    assert_eq!(set.list.media_type, MEDIA_DOCKER_LIST);
    assert_eq!(
        set.list.manifests[0].manifest_media_type,
        MEDIA_DOCKER_MANIFEST
    );
    assert_eq!(set.multi.layers.len(), 3);
    assert_eq!(set.user_uid.user.as_deref(), Some("1000"));
    assert_eq!(set.user_name.user.as_deref(), Some("minicri"));
    assert_eq!(set.user_uidgid.user.as_deref(), Some("1000:1001"));

    // The same rootfs in every compression has the same diff_id.
    let base = &set.busybox_oci.layers[0];
    assert_eq!(set.busybox_docker.layers[0].digest, base.digest);
    assert_eq!(set.zstd.layers[0].diff_id, base.diff_id);
    assert_eq!(set.plain.layers[0].diff_id, base.diff_id);
    assert_ne!(set.zstd.layers[0].digest, base.digest);

    // Shared base, distinct tops, distinct image IDs everywhere.
    assert_eq!(set.shared_a.layers[0], set.shared_b.layers[0]);
    assert_ne!(set.shared_a.layers[1].digest, set.shared_b.layers[1].digest);
    let mut ids: Vec<&str> = set.images().iter().map(|i| i.image_id()).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), set.images().len(), "image IDs are distinct");

    // Pushing again is idempotent and reproducible.
    let again = push_standard_set(&registry.addr(), None).await.unwrap();
    assert_eq!(again.multi.manifest_digest, set.multi.manifest_digest);
    assert_eq!(again.index.digest, set.index.digest);
}

#[test]
fn busybox_rootfs_has_the_expected_entries() {
    let layer = busybox_layer(Compression::Gzip).unwrap();
    let tar = layer.tar().unwrap();
    assert_eq!(sha256_digest(&tar), layer.diff_id);
    let files = tar_entries(&tar);
    let (ty, mode, _, data) = &files["bin/busybox"];
    assert!(ty.is_file());
    assert_eq!(*mode, 0o755);
    assert_eq!(data, &std::fs::read(BUSYBOX_BIN).unwrap());
    for applet in ["sh", "ls", "cat", "id", "sleep"] {
        let (ty, _, link, _) = &files[&format!("bin/{applet}")];
        assert!(ty.is_symlink(), "bin/{applet}");
        assert_eq!(link.as_deref(), Some("busybox"));
    }
    assert_eq!(files["etc/passwd"].3, ETC_PASSWD.as_bytes());
    assert_eq!(files["etc/group"].3, ETC_GROUP.as_bytes());
    assert!(files["tmp/"].0.is_dir());
    assert_eq!(files["tmp/"].1, 0o1777);
    assert_eq!(files["root/"].1, 0o700);

    // Reproducible.
    let again = busybox_rootfs().unwrap().build(Compression::Gzip).unwrap();
    assert_eq!(again.digest, layer.digest);
}

#[test]
fn layer_builder_whiteouts_and_links() {
    let tar = LayerBuilder::new()
        .dir("/data", 0o755)
        .file("/data/x", "x", 0o600)
        .whiteout("/data/gone")
        .opaque("/data/sub")
        .symlink("/data/l", "x")
        .hardlink("/data/h", "/data/x")
        .whiteout("top")
        .tar()
        .unwrap();
    let files = tar_entries(&tar);
    assert!(files.contains_key("data/.wh.gone"));
    assert!(files.contains_key("data/sub/.wh..wh..opq"));
    assert!(files.contains_key(".wh.top"));
    assert_eq!(files["data/x"].1, 0o600);
    assert_eq!(files["data/l"].2.as_deref(), Some("x"));
    assert_eq!(files["data/h"].0, tar::EntryType::Link);
    assert_eq!(files["data/h"].2.as_deref(), Some("data/x"));
}

#[test]
fn random_layer_is_streamed_to_a_file_and_incompressible() {
    let layer = random_layer(3, Compression::Gzip, 7).unwrap();
    let path = layer.path().unwrap().to_path_buf();
    assert!(path.exists());
    assert!(
        layer.size > 3 * 1024 * 1024,
        "random data does not compress"
    );
    assert_eq!(std::fs::metadata(&path).unwrap().len(), layer.size);
    let data = layer.data().unwrap();
    assert_eq!(sha256_digest(&data), layer.digest);
    let tar = layer.tar().unwrap();
    assert_eq!(sha256_digest(&tar), layer.diff_id);
    let files = tar_entries(&tar);
    assert_eq!(files["data/random-7.bin"].3.len(), 3 * 1024 * 1024);
    // Same seed, same layer; other seed, other layer.
    assert_eq!(
        random_layer(3, Compression::Gzip, 7).unwrap().digest,
        layer.digest
    );
    assert_ne!(
        random_layer(1, Compression::None, 8).unwrap().diff_id,
        layer.diff_id
    );
    drop(layer);
    assert!(!path.exists(), "the temporary file goes with the layer");
}

#[tokio::test]
async fn big_image_pushes_from_files() {
    let registry = Registry::start();
    let client = registry.client();
    let image = push_big_image(&client, "minicri-test/big:v1", 2, 2, Compression::Zstd, 100)
        .await
        .unwrap();
    assert_eq!(image.layers.len(), 3);
    assert_eq!(
        image.reference,
        format!("{}/minicri-test/big:v1", registry.addr())
    );
    check_image(&client, &image, "v1", &mut HashSet::new()).await;
}

#[test]
fn references_split() {
    let c = RegistryClient::new("127.0.0.1:5000");
    let split = |r: &str| c.split_reference(r).unwrap();
    assert_eq!(split("a/b:t"), ("a/b".into(), Some("t".into())));
    assert_eq!(split("a/b"), ("a/b".into(), Some("latest".into())));
    assert_eq!(
        split("127.0.0.1:5000/a/b:t"),
        ("a/b".into(), Some("t".into()))
    );
    let digest = format!("sha256:{}", "0".repeat(64));
    assert_eq!(split(&format!("a/b@{digest}")), ("a/b".into(), None));
}

//! Black-box tests of minicri's ImageService: the real `minicri` binary on a temporary socket and
//! root, a real `docker-registry` holding the standard test images, driven through the CRI client.

use std::path::Path;
use std::time::Duration;

use minicri_proto::runtime::v1 as cri;
use minicri_proto::runtime::v1::image_service_client::ImageServiceClient;
use minicri_tests::daemon::{Daemon, HostsDir};
use minicri_tests::images::{self, StandardSet};
use minicri_tests::registry::Registry;
use tonic::Code;
use tonic::transport::Channel;

type Images = ImageServiceClient<Channel>;

struct Env {
    registry: Registry,
    set: StandardSet,
    hosts: HostsDir,
    daemon: Daemon,
}

async fn env() -> Env {
    env_with(&[]).await
}

async fn env_with(args: &[&str]) -> Env {
    let registry = Registry::start();
    let set = images::push_standard_set(&registry.addr(), None)
        .await
        .expect("push standard set");
    let hosts = HostsDir::new();
    let daemon = Daemon::start_with(hosts.path(), args)
        .await
        .expect("start minicri");
    Env {
        registry,
        set,
        hosts,
        daemon,
    }
}

fn spec(image: &str) -> Option<cri::ImageSpec> {
    Some(cri::ImageSpec {
        image: image.to_string(),
        ..Default::default()
    })
}

async fn pull(c: &mut Images, image: &str) -> Result<String, tonic::Status> {
    pull_auth(c, image, None).await
}

async fn pull_auth(
    c: &mut Images,
    image: &str,
    auth: Option<cri::AuthConfig>,
) -> Result<String, tonic::Status> {
    let r = c
        .pull_image(cri::PullImageRequest {
            image: spec(image),
            auth,
            sandbox_config: None,
        })
        .await?;
    Ok(r.into_inner().image_ref)
}

async fn status(c: &mut Images, image: &str) -> Option<cri::Image> {
    c.image_status(cri::ImageStatusRequest {
        image: spec(image),
        verbose: false,
    })
    .await
    .unwrap()
    .into_inner()
    .image
}

async fn list(c: &mut Images) -> Vec<cri::Image> {
    c.list_images(cri::ListImagesRequest { filter: None })
        .await
        .unwrap()
        .into_inner()
        .images
}

async fn remove(c: &mut Images, image: &str) {
    c.remove_image(cri::RemoveImageRequest { image: spec(image) })
        .await
        .unwrap();
}

/// The blob files once a removal's background deletion has settled: polls until `done` holds for
/// them (up to 10 s), then returns them.
async fn blob_files_when(root: &Path, done: impl Fn(&[String]) -> bool) -> Vec<String> {
    let start = std::time::Instant::now();
    loop {
        let files = blob_files(root);
        if done(&files) || start.elapsed() > Duration::from_secs(10) {
            return files;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn blob_files(root: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(root.join("content/blobs/sha256"))
        .map(|rd| {
            rd.flatten()
                .map(|e| format!("sha256:{}", e.file_name().to_string_lossy()))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread")]
async fn pull_by_tag_reports_config_digest_and_names() {
    let e = env().await;
    let mut c = e.daemon.images().await.unwrap();
    for img in [
        &e.set.busybox_oci,
        &e.set.busybox_docker,
        &e.set.multi,
        &e.set.zstd,
        &e.set.plain,
    ] {
        let image_ref = pull(&mut c, &img.reference)
            .await
            .unwrap_or_else(|s| panic!("pull {}: {s:?}", img.reference));
        assert_eq!(
            image_ref, img.config_digest,
            "image_ref of {} is its config digest",
            img.reference
        );
        let st = status(&mut c, &img.reference)
            .await
            .expect("status after pull");
        assert_eq!(st.id, image_ref);
        assert!(
            st.repo_tags.contains(&img.reference),
            "{:?} lacks {}",
            st.repo_tags,
            img.reference
        );
        assert!(
            st.repo_digests.contains(&img.digest_reference()),
            "{:?} lacks {}",
            st.repo_digests,
            img.digest_reference()
        );
        assert!(
            st.size >= img.layers_size() + img.config_size,
            "size {} counts layers and config",
            st.size
        );
        assert_eq!(st.spec.unwrap().image, image_ref);
        // The same image by id, by bare hex and by digest reference.
        for name in [
            image_ref.clone(),
            image_ref[7..].to_string(),
            img.digest_reference(),
        ] {
            assert_eq!(
                status(&mut c, &name).await.map(|i| i.id),
                Some(image_ref.clone()),
                "lookup by {name}"
            );
        }
    }
    let ids: Vec<String> = list(&mut c).await.into_iter().map(|i| i.id).collect();
    for img in [&e.set.busybox_oci, &e.set.multi, &e.set.zstd, &e.set.plain] {
        assert!(ids.contains(&img.config_digest));
    }
    let filtered = c
        .list_images(cri::ListImagesRequest {
            filter: Some(cri::ImageFilter {
                image: spec(&e.set.multi.reference),
            }),
        })
        .await
        .unwrap()
        .into_inner()
        .images;
    assert_eq!(filtered.len(), 1);
    assert_eq!(filtered[0].id, e.set.multi.config_digest);
}

#[tokio::test(flavor = "multi_thread")]
async fn pull_by_digest_has_no_tag() {
    let e = env().await;
    let mut c = e.daemon.images().await.unwrap();
    let img = &e.set.multi;
    let id = pull(&mut c, &img.digest_reference()).await.unwrap();
    assert_eq!(id, img.config_digest);
    let st = status(&mut c, &img.digest_reference()).await.unwrap();
    assert!(
        st.repo_tags.is_empty(),
        "pulled by digest only: {:?}",
        st.repo_tags
    );
    assert_eq!(st.repo_digests, vec![img.digest_reference()]);
    assert!(
        status(&mut c, &img.reference).await.is_none(),
        "the tag was never pulled"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn index_and_manifest_list_select_the_platform() {
    let e = env().await;
    let mut c = e.daemon.images().await.unwrap();
    for idx in [&e.set.index, &e.set.list] {
        let amd64 = idx.for_arch("amd64").unwrap();
        let id = pull(&mut c, &idx.reference).await.unwrap();
        assert_eq!(
            id, amd64.config_digest,
            "{} resolves to linux/amd64",
            idx.reference
        );
        let st = status(&mut c, &idx.reference).await.unwrap();
        // The repo digest is the index's: that is what the tag resolved to.
        assert!(
            st.repo_digests.contains(&idx.digest_reference()),
            "{:?}",
            st.repo_digests
        );
    }

    let arm = Daemon::start_with(e.hosts.path(), &["--platform", "linux/arm64"])
        .await
        .unwrap();
    let mut c = arm.images().await.unwrap();
    let id = pull(&mut c, &e.set.index.reference).await.unwrap();
    assert_eq!(id, e.set.index.for_arch("arm64").unwrap().config_digest);

    let riscv = Daemon::start_with(e.hosts.path(), &["--platform", "linux/riscv64"])
        .await
        .unwrap();
    let mut c = riscv.images().await.unwrap();
    let err = pull(&mut c, &e.set.index.reference).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(
        err.message().contains("linux/riscv64") && err.message().contains("linux/amd64"),
        "{}",
        err.message()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn user_becomes_uid_or_username() {
    let e = env().await;
    let mut c = e.daemon.images().await.unwrap();
    for (img, uid, name) in [
        (&e.set.user_uid, Some(1002), ""),
        (&e.set.user_uidgid, Some(1002), ""),
        (&e.set.user_name, None, "www-data"),
        (&e.set.busybox_oci, None, ""),
    ] {
        pull(&mut c, &img.reference).await.unwrap();
        let st = status(&mut c, &img.reference).await.unwrap();
        let want_uid = img
            .user
            .as_deref()
            .and_then(|u| u.split(':').next())
            .and_then(|u| u.parse::<i64>().ok());
        assert_eq!(
            st.uid.map(|u| u.value),
            want_uid,
            "uid of {} (User {:?})",
            img.reference,
            img.user
        );
        let want_name = img
            .user
            .as_deref()
            .and_then(|u| u.split(':').next())
            .filter(|u| u.parse::<i64>().is_err());
        assert_eq!(
            st.username,
            want_name.unwrap_or(""),
            "username of {}",
            img.reference
        );
        let _ = (uid, name);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn basic_auth_credentials() {
    let registry = Registry::start_with_auth("tester", "s3cret");
    let set = images::push_standard_set(&registry.addr(), Some(("tester", "s3cret")))
        .await
        .unwrap();
    let hosts = HostsDir::new();
    let daemon = Daemon::start(hosts.path()).await.unwrap();
    let mut c = daemon.images().await.unwrap();
    let r = &set.busybox_oci.reference;

    let err = pull(&mut c, r).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "anonymous: {err:?}");
    let wrong = cri::AuthConfig {
        username: "tester".into(),
        password: "nope".into(),
        ..Default::default()
    };
    let err = pull_auth(&mut c, r, Some(wrong)).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated, "wrong password: {err:?}");
    assert!(
        err.message().contains(&registry.addr()),
        "names the registry: {}",
        err.message()
    );
    assert!(list(&mut c).await.is_empty());

    let good = cri::AuthConfig {
        username: "tester".into(),
        password: "s3cret".into(),
        ..Default::default()
    };
    assert_eq!(
        pull_auth(&mut c, r, Some(good)).await.unwrap(),
        set.busybox_oci.config_digest
    );

    use base64::Engine as _;
    let encoded = base64::engine::general_purpose::STANDARD.encode("tester:s3cret");
    let auth_field = cri::AuthConfig {
        auth: encoded,
        ..Default::default()
    };
    assert_eq!(
        pull_auth(&mut c, &set.multi.reference, Some(auth_field))
            .await
            .unwrap(),
        set.multi.config_digest
    );

    let bad_b64 = cri::AuthConfig {
        auth: "%%%".into(),
        ..Default::default()
    };
    let err = pull_auth(&mut c, &set.zstd.reference, Some(bad_b64))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    assert!(err.message().contains("base64"), "{}", err.message());
}

#[tokio::test(flavor = "multi_thread")]
async fn mirror_that_is_down_falls_back_to_the_next() {
    let e = env().await;
    // A port nothing listens on: bind one, then close it.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    e.hosts.mirror("docker.io", &[&dead, &e.registry.addr()]);
    e.hosts.mirror("registry.example.test", &[&dead]);
    let mut c = e.daemon.images().await.unwrap();

    // `minicri-test/busybox:oci` is docker.io/minicri-test/busybox:oci, served by the mirror.
    let id = pull(&mut c, "minicri-test/busybox:oci").await.unwrap();
    assert_eq!(id, e.set.busybox_oci.config_digest);
    let st = status(&mut c, "docker.io/minicri-test/busybox:oci")
        .await
        .unwrap();
    assert!(
        st.repo_tags
            .contains(&"docker.io/minicri-test/busybox:oci".to_string()),
        "{:?}",
        st.repo_tags
    );

    // Every endpoint down: UNAVAILABLE, naming what was tried.
    let err = pull(&mut c, "registry.example.test/x/y:z")
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(err.message().contains(&dead), "{}", err.message());
}

#[tokio::test(flavor = "multi_thread")]
async fn remove_by_any_name_removes_image_and_unshared_blobs() {
    // Layer blobs kept, so that a layer blob shared by two images is stored (with them
    // discarded, the images share the layer's snapshot: see the layer_blobs tests).
    let e = env_with(&["--keep-layer-blobs", "true"]).await;
    let mut c = e.daemon.images().await.unwrap();
    let root = e.daemon.root();
    let (a, b) = (&e.set.shared_a, &e.set.shared_b);
    pull(&mut c, &a.reference).await.unwrap();
    pull(&mut c, &a.digest_reference()).await.unwrap();
    pull(&mut c, &b.reference).await.unwrap();
    let st = status(&mut c, &a.reference).await.unwrap();
    assert_eq!(st.repo_tags.len(), 1);
    assert_eq!(st.repo_digests.len(), 1);

    // Removing by the digest name removes the image with its tag too.
    remove(&mut c, &a.digest_reference()).await;
    assert!(status(&mut c, &a.reference).await.is_none());
    assert!(status(&mut c, &a.config_digest).await.is_none());
    // b is untouched, and keeps the layer it shares with a.
    assert_eq!(
        status(&mut c, &b.reference).await.unwrap().id,
        b.config_digest
    );
    let a_only: Vec<String> = a
        .blob_digests()
        .into_iter()
        .filter(|d| !b.blob_digests().contains(d))
        .collect();
    assert!(!a_only.is_empty());
    // The blobs go in the background once the record is gone.
    let files = blob_files_when(&root, |f| a_only.iter().all(|d| !f.contains(d))).await;
    for d in b.blob_digests() {
        assert!(
            files.contains(&d),
            "blob {d} of the remaining image was deleted"
        );
    }
    for d in &a_only {
        assert!(!files.contains(d), "blob {d} only a used is still stored");
    }

    // Idempotent: again, and an image never pulled, succeed.
    remove(&mut c, &a.reference).await;
    remove(&mut c, "docker.io/library/never-pulled:1").await;
    remove(&mut c, &b.config_digest).await;
    assert!(list(&mut c).await.is_empty());
    let left = blob_files_when(&root, |f| f.is_empty()).await;
    assert!(left.is_empty(), "blobs left: {left:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn images_survive_a_restart() {
    let mut e = env().await;
    let mut c = e.daemon.images().await.unwrap();
    for img in [&e.set.busybox_oci, &e.set.multi] {
        pull(&mut c, &img.reference).await.unwrap();
    }
    let before = list(&mut c).await;
    drop(c);
    let status_code = e.daemon.stop().unwrap();
    assert!(
        status_code.success(),
        "SIGTERM exits cleanly: {status_code}"
    );
    assert!(!e.daemon.socket().exists(), "socket removed on shutdown");
    e.daemon.restart().await.unwrap();
    let mut c = e.daemon.images().await.unwrap();
    assert_eq!(list(&mut c).await, before);

    // After SIGKILL too, and the images are usable: pulling again needs nothing new.
    e.daemon.kill();
    e.daemon.restart().await.unwrap();
    let mut c = e.daemon.images().await.unwrap();
    assert_eq!(list(&mut c).await, before);
    assert_eq!(
        pull(&mut c, &e.set.multi.reference).await.unwrap(),
        e.set.multi.config_digest
    );
    let verbose = c
        .image_status(cri::ImageStatusRequest {
            image: spec(&e.set.multi.reference),
            verbose: true,
        })
        .await
        .unwrap()
        .into_inner();
    let info: serde_json::Value = serde_json::from_str(&verbose.info["info"]).unwrap();
    assert_eq!(
        info["imageSpec"]["rootfs"]["diff_ids"]
            .as_array()
            .unwrap()
            .len(),
        e.set.multi.layers.len()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_and_unknown_references() {
    let e = env().await;
    let mut c = e.daemon.images().await.unwrap();
    for bad in [
        "",
        "Busybox",
        "busybox:",
        "a b",
        "busybox@sha256:1234",
        "-x/y",
    ] {
        let err = pull(&mut c, bad).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{bad:?}: {err:?}");
        if !bad.is_empty() {
            assert!(
                err.message().contains(bad),
                "message names {bad:?}: {}",
                err.message()
            );
        }
    }
    let missing = format!("{}/minicri-test/busybox:nope", e.registry.addr());
    let err = pull(&mut c, &missing).await.unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    assert!(err.message().contains(&missing), "{}", err.message());
    let err = pull(
        &mut c,
        &format!("{}/minicri-test/nothing-here:1", e.registry.addr()),
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");

    // ImageStatus of an unknown image is an empty answer, not an error.
    assert!(
        status(&mut c, "docker.io/library/unknown:1")
            .await
            .is_none()
    );
    assert!(
        status(&mut c, &format!("sha256:{}", "0".repeat(64)))
            .await
            .is_none()
    );
    let err = c
        .image_status(cri::ImageStatusRequest {
            image: spec(""),
            verbose: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(list(&mut c).await.is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn corrupt_blob_fails_the_pull_and_stores_nothing() {
    let e = env().await;
    let img = &e.set.multi;
    let top = img.layers.last().unwrap().digest.clone();
    e.registry.corrupt_blob(&top).unwrap();
    let mut c = e.daemon.images().await.unwrap();
    let err = pull(&mut c, &img.reference).await.unwrap_err();
    assert_eq!(err.code(), Code::DataLoss, "{err:?}");
    assert!(
        err.message().contains(&top),
        "error names the blob: {}",
        err.message()
    );
    assert!(list(&mut c).await.is_empty());
    assert!(status(&mut c, &img.reference).await.is_none());
    let root = e.daemon.root();
    assert!(
        !blob_files(&root).contains(&top),
        "the corrupt blob was committed"
    );
    // Other layers' partial downloads may stay for a later resume; the bad one is discarded.
    assert!(
        minicri_tests::pull_env::ingest_dir(&root, &top).is_none(),
        "the bad partial is discarded"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn one_millisecond_deadline() {
    let e = env().await;
    let mut c = e.daemon.images().await.unwrap();
    // A client that leaves the deadline to the server, to see what the daemon answers.
    let mut raw = e.daemon.raw_images().await.unwrap();
    let mut req = tonic::Request::new(cri::PullImageRequest {
        image: spec(&e.set.multi.reference),
        auth: None,
        sandbox_config: None,
    });
    req.metadata_mut()
        .insert("grpc-timeout", "1m".parse().unwrap());
    let err = raw.pull_image(req).await.unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    assert!(err.message().contains("deadline"), "{}", err.message());

    // A tonic channel enforces the deadline itself as well (and calls it CANCELLED); either way the
    // store stays consistent.
    let mut req = tonic::Request::new(cri::PullImageRequest {
        image: spec(&e.set.multi.reference),
        auth: None,
        sandbox_config: None,
    });
    req.set_timeout(Duration::from_millis(1));
    let err = c.pull_image(req).await.unwrap_err();
    assert!(
        matches!(err.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{err:?}"
    );
    assert!(
        list(&mut c).await.is_empty(),
        "a half-pulled image is never visible"
    );
    // The store is consistent: the same pull then succeeds and the image is whole.
    assert_eq!(
        pull(&mut c, &e.set.multi.reference).await.unwrap(),
        e.set.multi.config_digest
    );
    // Whole: its config stored, its layers unpacked (their compressed blobs then discarded).
    let files = blob_files(&e.daemon.root());
    assert!(files.contains(&e.set.multi.config_digest));
    for l in &e.set.multi.layers {
        assert!(
            !files.contains(&l.digest),
            "{} kept after its unpack",
            l.digest
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn image_fs_info_reports_the_root() {
    let e = env().await;
    let mut c = e.daemon.images().await.unwrap();
    let empty = c
        .image_fs_info(cri::ImageFsInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    let fs0 = &empty.image_filesystems[0];
    assert_eq!(
        fs0.fs_id.as_ref().unwrap().mountpoint,
        e.daemon.root().display().to_string()
    );
    pull(&mut c, &e.set.multi.reference).await.unwrap();
    // The figures are served from the last measure and refreshed in the background once it is
    // older than a few seconds: the pull shows within that, with a newer timestamp.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let fs1 = loop {
        let after = c
            .image_fs_info(cri::ImageFsInfoRequest {})
            .await
            .unwrap()
            .into_inner();
        let fs1 = after.image_filesystems[0].clone();
        let grew = fs1
            .used_bytes
            .as_ref()
            .unwrap()
            .value
            .saturating_sub(fs0.used_bytes.as_ref().unwrap().value);
        if grew >= e.set.multi.layers_size() {
            break fs1;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "used bytes grew by only {grew} in 20 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    assert!(fs1.inodes_used.as_ref().unwrap().value > fs0.inodes_used.as_ref().unwrap().value);
    assert!(
        fs1.timestamp > fs0.timestamp,
        "the timestamp is the measure's"
    );
}

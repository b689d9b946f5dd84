//! Tests of the test-support registry (`minicri_tests::registry`) and the hack/ registry
//! scripts: start, readiness, basic auth, blob paths on disk, cleanup.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use minicri_tests::images::{BUSYBOX_OCI, ImageBuilder, RegistryClient, sha256_digest};
use minicri_tests::registry::Registry;

fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| !s.contains(") Z "))
            .unwrap_or(false)
}

async fn status(url: &str, auth: Option<(&str, &str)>) -> u16 {
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let mut req = client.get(url);
    if let Some((u, p)) = auth {
        req = req.basic_auth(u, Some(p));
    }
    req.send().await.unwrap().status().as_u16()
}

#[tokio::test]
async fn registry_starts_answers_and_cleans_up() {
    let registry = Registry::start();
    assert!(registry.addr().starts_with("127.0.0.1:"));
    assert_eq!(registry.url(), format!("http://{}", registry.addr()));
    assert_eq!(status(&format!("{}/v2/", registry.url()), None).await, 200);
    let pid = registry.pid();
    let dir = registry.dir().to_path_buf();
    assert!(alive(pid));
    assert!(dir.join("config.yml").exists());
    let config = std::fs::read_to_string(dir.join("config.yml")).unwrap();
    assert!(config.contains(&format!("addr: {}", registry.addr())));
    assert!(config.contains("enabled: true"), "deletes are enabled");
    drop(registry);
    assert!(!alive(pid), "docker-registry {pid} still runs after drop");
    assert!(!dir.exists(), "{} still exists after drop", dir.display());
}

#[tokio::test]
async fn two_registries_run_side_by_side() {
    let a = Registry::start();
    let b = Registry::start();
    assert_ne!(a.port(), b.port());
    assert_eq!(status(&format!("{}/v2/", a.url()), None).await, 200);
    assert_eq!(status(&format!("{}/v2/", b.url()), None).await, 200);
}

#[tokio::test]
async fn htpasswd_registry_rejects_anonymous_and_accepts_the_credential() {
    let registry = Registry::start_with_auth("tester", "s3cret");
    assert_eq!(registry.credentials(), Some(("tester", "s3cret")));
    let v2 = format!("{}/v2/", registry.url());
    assert_eq!(status(&v2, None).await, 401);
    assert_eq!(status(&v2, Some(("tester", "wrong"))).await, 401);
    assert_eq!(status(&v2, Some(("other", "s3cret"))).await, 401);
    assert_eq!(status(&v2, Some(("tester", "s3cret"))).await, 200);

    // Pushing needs the credential too.
    let anonymous = RegistryClient::new(&registry.addr());
    let err = ImageBuilder::busybox()
        .push(&anonymous, BUSYBOX_OCI)
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains("401"), "{err:#}");
    let pushed = ImageBuilder::busybox()
        .push(&registry.client(), BUSYBOX_OCI)
        .await
        .unwrap();
    let manifest = registry
        .client()
        .get_manifest("minicri-test/busybox", "oci")
        .await
        .unwrap();
    assert_eq!(manifest.digest(), pushed.manifest_digest);
    assert_eq!(
        status(
            &format!("{}/v2/minicri-test/busybox/manifests/oci", registry.url()),
            None
        )
        .await,
        401
    );
}

#[tokio::test]
async fn blob_path_finds_stored_blobs_and_corrupt_blob_damages_them() {
    let registry = Registry::start();
    let client = registry.client();
    let pushed = ImageBuilder::busybox()
        .push(&client, BUSYBOX_OCI)
        .await
        .unwrap();
    let layer = &pushed.layers[0];
    let path = registry.blob_path(&layer.digest);
    assert!(path.starts_with(registry.storage_dir()));
    let hex = layer.digest.strip_prefix("sha256:").unwrap();
    assert!(path.ends_with(format!("blobs/sha256/{}/{hex}/data", &hex[..2])));
    let on_disk = std::fs::read(&path).unwrap();
    assert_eq!(on_disk.len() as u64, layer.size);
    assert_eq!(sha256_digest(&on_disk), layer.digest);
    assert!(registry.blob_path(&pushed.config_digest).exists());

    registry.corrupt_blob(&layer.digest).unwrap();
    let served = client
        .get_blob("minicri-test/busybox", &layer.digest)
        .await
        .unwrap();
    assert_eq!(served.len() as u64, layer.size, "same size");
    assert_ne!(sha256_digest(&served), layer.digest, "different bytes");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn hack(script: &str, args: &[&str]) -> std::process::Output {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../hack")
        .join(script);
    let out = Command::new("bash").arg(&path).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{script} {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

#[tokio::test]
async fn hack_scripts_start_and_stop_a_registry() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("registry");
    let state_s = state.to_str().unwrap();
    let port = free_port().to_string();
    let args = ["--port", &port, "--dir", state_s, "--htpasswd", "u:pw"];
    hack("start-registry.sh", &args);
    let pid: u32 = std::fs::read_to_string(state.join("registry.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let result = std::panic::AssertUnwindSafe(async {
        assert!(alive(pid));
        // Rerunning is a no-op while it runs.
        let again = hack("start-registry.sh", &args);
        assert!(String::from_utf8_lossy(&again.stdout).contains("already running"));
        let v2 = format!("http://127.0.0.1:{port}/v2/");
        assert_eq!(status(&v2, None).await, 401);
        assert_eq!(status(&v2, Some(("u", "pw"))).await, 200);
        let config = std::fs::read_to_string(state.join("config.yml")).unwrap();
        assert!(config.contains(&format!("addr: 127.0.0.1:{port}")));
        assert!(config.contains(&format!("rootdirectory: {state_s}/storage")));
    });
    let outcome = futures::FutureExt::catch_unwind(result).await;
    hack("stop-registry.sh", &["--dir", state_s, "--purge"]);
    for _ in 0..50 {
        if !alive(pid) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!alive(pid), "pid {pid} survived stop-registry.sh");
    assert!(!state.exists());
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

//! What the pull tests share: a registry behind the fault-injecting proxy with a daemon pulling
//! through it ([`Env`]), big incompressible test images, PullImage helpers, byte accounting per
//! blob, and host-network pod sandboxes on real runc ([`Sandboxes`]) cleaned up on drop.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use minicri_proto::runtime::v1 as cri;

use crate::daemon::{Daemon, HostsDir};
use crate::images::{self, Compression, PushedImage};
pub use crate::pod_env::runc_skip_reason as sandboxes_skip_reason;
use crate::proxy::Proxy;
use crate::registry::Registry;

pub const MIB: u64 = 1024 * 1024;

pub struct Env {
    pub registry: Registry,
    pub proxy: Proxy,
    pub hosts: HostsDir,
    pub daemon: Daemon,
}

pub async fn env(args: &[&str]) -> Env {
    let registry = Registry::start();
    let proxy = Proxy::start(&registry.addr()).expect("proxy");
    let hosts = HostsDir::new();
    // Partial data must survive for the resume assertions whatever this machine's free space:
    // the low-space collection of young ingests is off here (its own unit tests cover it).
    let mut args = args.to_vec();
    args.extend(["--ingest-min-free", "0"]);
    let daemon = Daemon::start_with(hosts.path(), &args)
        .await
        .expect("minicri");
    Env {
        registry,
        proxy,
        hosts,
        daemon,
    }
}

/// An image of `layers` incompressible layers of `mib` MiB, pushed straight to the registry and
/// referenced through the proxy.
pub async fn big(e: &Env, name: &str, layers: u64, mib: u64, seed: u64) -> (PushedImage, String) {
    let client = images::RegistryClient::new(e.proxy.upstream());
    let img = images::push_big_image(
        &client,
        &format!("minicri-test/{name}:latest"),
        layers,
        mib,
        Compression::None,
        seed,
    )
    .await
    .expect("push big image");
    let via_proxy = format!("{}/minicri-test/{name}:latest", e.proxy.addr());
    (img, via_proxy)
}

pub fn pod(i: usize) -> Option<cri::PodSandboxConfig> {
    Some(cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: format!("pod-{i}"),
            uid: format!("uid-{i}"),
            namespace: "pulls".into(),
            attempt: 0,
        }),
        ..Default::default()
    })
}

pub fn pull_req(image: &str, sandbox: Option<cri::PodSandboxConfig>) -> cri::PullImageRequest {
    cri::PullImageRequest {
        image: Some(cri::ImageSpec {
            image: image.into(),
            ..Default::default()
        }),
        auth: None,
        sandbox_config: sandbox,
    }
}

pub async fn pull(
    d: &Daemon,
    image: &str,
    sandbox: Option<cri::PodSandboxConfig>,
) -> Result<String, tonic::Status> {
    let mut c = d.images().await.unwrap();
    Ok(c.pull_image(pull_req(image, sandbox))
        .await?
        .into_inner()
        .image_ref)
}

pub type PullCall =
    tokio::task::JoinHandle<Result<tonic::Response<cri::PullImageResponse>, tonic::Status>>;

/// Starts PullImage of `image` for `sandbox` on its own task, to be awaited later.
pub async fn spawn_pull(
    d: &Daemon,
    image: &str,
    sandbox: Option<cri::PodSandboxConfig>,
) -> PullCall {
    let mut c = d.images().await.unwrap();
    let req = pull_req(image, sandbox);
    tokio::spawn(async move { c.pull_image(req).await })
}

pub fn ingest_bytes(root: &Path) -> u64 {
    let dir = root.join("content/ingest");
    std::fs::read_dir(dir)
        .map(|rd| rd.flatten().map(|e| ingest_dir_bytes(&e.path())).sum())
        .unwrap_or(0)
}

/// Bytes of the blob that one ingest directory keeps for a resume: what its `ranges.json`
/// records when it has one (a blob fetched over several ranged requests: its file has holes, and
/// bytes written after the last record are fetched again), else its file's length.
fn ingest_dir_bytes(dir: &Path) -> u64 {
    #[derive(serde::Deserialize)]
    struct Ranges {
        prefix: u64,
        beyond: Vec<(u64, u64)>,
    }
    let len = std::fs::metadata(dir.join("data")).map_or(0, |m| m.len());
    match std::fs::read(dir.join("ranges.json")) {
        Ok(b) => {
            let r: Ranges = serde_json::from_slice(&b).expect("ranges.json parses");
            let recorded = r.prefix + r.beyond.iter().map(|(s, e)| e - s).sum::<u64>();
            // What is recorded is on disk: never more than the file holds.
            assert!(
                r.beyond.last().map_or(r.prefix, |&(_, e)| e) <= len,
                "{} records bytes past its file's end ({len})",
                dir.display()
            );
            recorded
        }
        Err(_) => len,
    }
}

/// The ingest directory of blob `digest` (`sha256:<hex>`) under a daemon's root, whatever size
/// its descriptor gave (`content/ingest/<hex>-<size>`), if there is one.
pub fn ingest_dir(root: &Path, digest: &str) -> Option<PathBuf> {
    let prefix = format!("{}-", digest.trim_start_matches("sha256:"));
    std::fs::read_dir(root.join("content/ingest"))
        .ok()?
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .map(|e| e.path())
}

/// The record of the pieces on disk of one blob's ingest (`sha256:<hex>`), or "" if none.
pub fn ingest_ranges(root: &Path, digest: &str) -> String {
    ingest_dir(root, digest)
        .and_then(|d| std::fs::read_to_string(d.join("ranges.json")).ok())
        .unwrap_or_default()
}

/// The metadata of `rel` (a path inside a layer) in a layer the daemon rooted at `root` is
/// unpacking ahead of its parent, in its snapshotter's scratch directory (`snapshots/tmp/*/fs`).
pub fn unpacking_ahead(root: &Path, rel: &str) -> Option<std::fs::Metadata> {
    std::fs::read_dir(root.join("snapshots/tmp"))
        .into_iter()
        .flatten()
        .flatten()
        .find_map(|d| std::fs::metadata(d.path().join("fs").join(rel)).ok())
}

pub async fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

pub fn assert_each_blob_served_once(proxy: &Proxy, img: &PushedImage) {
    for d in img.blob_digests() {
        let size = if d == img.config_digest {
            img.config_size
        } else {
            img.layers.iter().find(|l| l.digest == d).unwrap().size
        };
        assert_eq!(
            proxy.bytes_served(&d),
            size,
            "blob {d} ({size} bytes) served once: {:?}",
            proxy.blob_requests(&d)
        );
    }
}

/// Pod sandboxes for the tests below: host network (no CNI needed), run by the real daemon
/// through runc. Dropping it removes them (also when a test fails half-way).
pub struct Sandboxes {
    /// The daemon's state directory.
    state: PathBuf,
    ids: Vec<String>,
}

/// Runs the sandbox of `pod(i)` with the host's network; returns its id.
async fn run_host_network_sandbox(daemon: &Daemon, i: usize) -> String {
    let mut config = pod(i).unwrap();
    config.linux = Some(cri::LinuxPodSandboxConfig {
        security_context: Some(cri::LinuxSandboxSecurityContext {
            namespace_options: Some(cri::NamespaceOption {
                network: cri::NamespaceMode::Node as i32,
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    });
    let mut c = daemon.runtime().await.unwrap();
    c.run_pod_sandbox(cri::RunPodSandboxRequest {
        config: Some(config),
        runtime_handler: String::new(),
    })
    .await
    .expect("RunPodSandbox")
    .into_inner()
    .pod_sandbox_id
}

impl Sandboxes {
    pub fn new(daemon: &Daemon) -> Self {
        Sandboxes {
            state: daemon.root().parent().unwrap().join("state"),
            ids: Vec::new(),
        }
    }

    /// Runs the sandbox of `pod(i)`; returns its id.
    pub async fn run(&mut self, daemon: &Daemon, i: usize) -> String {
        let id = run_host_network_sandbox(daemon, i).await;
        self.ids.push(id.clone());
        id
    }

    /// Runs the sandboxes of `pod(i)` for every `i` in `range` at once; returns their ids.
    pub async fn run_parallel(
        &mut self,
        daemon: &Daemon,
        range: std::ops::Range<usize>,
    ) -> Vec<String> {
        let ids =
            futures::future::join_all(range.map(|i| run_host_network_sandbox(daemon, i))).await;
        self.ids.extend(ids.iter().cloned());
        ids
    }

    pub async fn stop(&self, daemon: &Daemon, id: &str) -> Result<(), tonic::Status> {
        let mut c = daemon.runtime().await.unwrap();
        c.stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: id.into(),
        })
        .await
        .map(|_| ())
    }

    pub async fn remove_all(&mut self, daemon: &Daemon) {
        let mut c = daemon.runtime().await.unwrap();
        for id in std::mem::take(&mut self.ids) {
            c.remove_pod_sandbox(cri::RemovePodSandboxRequest { pod_sandbox_id: id })
                .await
                .expect("RemovePodSandbox");
        }
    }
}

impl Drop for Sandboxes {
    fn drop(&mut self) {
        // Only after a failure: kill what the daemon started for the sandboxes left, unmount
        // what it mounted for them.
        if self.ids.is_empty() {
            return;
        }
        let state = &self.state;
        for id in &self.ids {
            let _ = std::process::Command::new("runc")
                .arg("--root")
                .arg(state.join("runc"))
                .args(["delete", "--force", id])
                .output();
        }
        let _ = std::process::Command::new("pkill")
            .args(["-KILL", "-f", &state.to_string_lossy()])
            .output();
        // The sandboxes' /dev/shm mounts (the daemon's directory is removed with its harness).
        for m in crate::pod_env::mounts_under(state) {
            let _ = nix::mount::umount2(m.as_str(), nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

/// `GET /metrics` over plain HTTP/1.1.
pub async fn scrape(addr: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr)
        .await
        .expect("metrics port");
    s.write_all(
        format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out
}

pub fn sample(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no sample {name} in\n{text}"))
}

/// A free loopback address for `--metrics-address`.
pub fn free_metrics_address() -> String {
    let port = crate::server::free_port().expect("a free port");
    format!("127.0.0.1:{port}")
}

//! Black-box tests of pod sandboxes and containers: the real daemon, runc, Debian's CNI plugins
//! and a busybox test image from a local registry.
//!
//! Root only (they print why and pass elsewhere). Each test has its own bridge, a /28 inside
//! 10.199.0.0/16 and no masquerading; [`Leftovers`] removes whatever a failed test leaves (runc
//! containers, shims, mounts, the bridge) when it is dropped.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use minicri_proto::runtime::v1 as cri;
use minicri_proto::runtime::v1::runtime_service_client::RuntimeServiceClient;
use minicri_tests::daemon::{Daemon, HostsDir};
use minicri_tests::images;
use minicri_tests::registry::Registry;
use tonic::Code;
use tonic::transport::Channel;

const CNI_BIN: &str = "/usr/lib/cni";

fn skip_reason() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("not root".into());
    }
    if !Path::new(CNI_BIN).join("bridge").exists() {
        return Some(format!("no CNI plugins in {CNI_BIN}"));
    }
    if Command::new("runc").arg("--version").output().is_err() {
        return Some("no runc".into());
    }
    None
}

/// 8 hex digits, different per test process and call.
fn unique_hex() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let x = (std::process::id().wrapping_mul(2_654_435_761))
        ^ N.fetch_add(1, Ordering::SeqCst).wrapping_mul(40503)
        ^ nanos;
    format!("{x:08x}")
}

/// A /28 inside 10.199.0.0/16 that no host address or route uses: (network address, CIDR).
fn free_subnet() -> (String, String) {
    let out = |args: &[&str]| {
        String::from_utf8_lossy(&Command::new("ip").args(args).output().unwrap().stdout)
            .into_owned()
    };
    let in_use = out(&["-4", "-o", "addr", "show"]) + &out(&["-4", "route"]);
    for _ in 0..200 {
        let idx = u32::from_str_radix(&unique_hex(), 16).unwrap() % 4096;
        let (a, b) = (idx / 16, (idx % 16) * 16);
        let net = format!("10.199.{a}.{b}");
        if !(b..b + 16).any(|h| in_use.contains(&format!("10.199.{a}.{h}/"))) {
            return (net.clone(), format!("{net}/28"));
        }
    }
    panic!("no free /28 in 10.199.0.0/16");
}

/// Cleans up after a test, also a failed one: runc containers under the daemon's state, shims,
/// mounts under the daemon's directory, the bridge.
struct Leftovers {
    dir: PathBuf,
    bridge: String,
}

fn mounts_under(dir: &Path) -> Vec<String> {
    let prefix = dir.to_string_lossy().into_owned();
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut v: Vec<String> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| m.starts_with(&prefix))
        .map(String::from)
        .collect();
    v.sort_by_key(|m| std::cmp::Reverse(m.len()));
    v
}

/// Pids of processes whose command line mentions `needle`.
fn processes_mentioning(needle: &str) -> Vec<i32> {
    let mut pids = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(needle) {
            pids.push(pid);
        }
    }
    pids
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        let runc_root = self.dir.join("state/runc");
        if let Ok(out) = Command::new("runc")
            .arg("--root")
            .arg(&runc_root)
            .args(["list", "-q"])
            .output()
        {
            for id in String::from_utf8_lossy(&out.stdout).lines() {
                let _ = Command::new("runc")
                    .arg("--root")
                    .arg(&runc_root)
                    .args(["delete", "--force", id])
                    .output();
            }
        }
        for pid in processes_mentioning(&self.dir.join("state").to_string_lossy()) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        for m in mounts_under(&self.dir) {
            let _ = nix::mount::umount2(m.as_str(), nix::mount::MntFlags::MNT_DETACH);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = Command::new("ip")
            .args(["link", "del", &self.bridge])
            .output();
    }
}

struct Env {
    _registry: Registry,
    set: images::StandardSet,
    _hosts: HostsDir,
    daemon: Daemon,
    subnet_base: String,
    logs: tempfile::TempDir,
    // Dropped last: after the daemon is gone.
    _leftovers: Leftovers,
}

impl Env {
    async fn new() -> Env {
        let registry = Registry::start();
        let set = images::push_standard_set(&registry.addr(), None)
            .await
            .expect("push standard set");
        let hosts = HostsDir::new();
        let daemon = Daemon::start(hosts.path()).await.expect("start minicri");
        let dir = daemon.root().parent().unwrap().to_path_buf();
        let hex = unique_hex();
        let (subnet_base, subnet) = free_subnet();
        let leftovers = Leftovers {
            dir: dir.clone(),
            bridge: format!("mcp{hex}"),
        };
        // The daemon reads its CNI configuration directory at every operation.
        let conf_dir = dir.join("cni");
        std::fs::create_dir_all(&conf_dir).unwrap();
        let list = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": format!("mcpnet-{hex}"),
            "plugins": [{
                "type": "bridge",
                "bridge": leftovers.bridge,
                "isGateway": true,
                "ipMasq": false,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{ "subnet": subnet }]],
                    "dataDir": dir.join("ipam"),
                }
            }]
        });
        std::fs::write(
            conf_dir.join("10-test.conflist"),
            serde_json::to_vec_pretty(&list).unwrap(),
        )
        .unwrap();
        Env {
            _registry: registry,
            set,
            _hosts: hosts,
            daemon,
            subnet_base,
            logs: tempfile::tempdir().unwrap(),
            _leftovers: leftovers,
        }
    }

    async fn runtime(&self) -> RuntimeServiceClient<Channel> {
        self.daemon.runtime().await.unwrap()
    }

    async fn pull_busybox(&self) -> String {
        let mut c = self.daemon.images().await.unwrap();
        c.pull_image(cri::PullImageRequest {
            image: Some(cri::ImageSpec {
                image: self.set.busybox_oci.reference.clone(),
                ..Default::default()
            }),
            auth: None,
            sandbox_config: None,
        })
        .await
        .unwrap()
        .into_inner()
        .image_ref
    }

    fn state(&self) -> PathBuf {
        self.daemon.root().parent().unwrap().join("state")
    }
}

fn pod_config(name: &str, log_dir: &Path) -> cri::PodSandboxConfig {
    cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: name.into(),
            namespace: "pods-test".into(),
            uid: format!("uid-{name}"),
            attempt: 1,
        }),
        hostname: name.into(),
        log_directory: log_dir.display().to_string(),
        labels: [("app".to_string(), name.to_string())].into(),
        annotations: [("note".to_string(), "a b\nc=d".to_string())].into(),
        ..Default::default()
    }
}

fn container_config(image: &str, args: &[&str]) -> cri::ContainerConfig {
    cri::ContainerConfig {
        metadata: Some(cri::ContainerMetadata {
            name: "main".into(),
            attempt: 0,
        }),
        image: Some(cri::ImageSpec {
            image: image.into(),
            ..Default::default()
        }),
        command: args.iter().map(|s| s.to_string()).collect(),
        log_path: "main/0.log".into(),
        labels: [(
            "io.kubernetes.container.hash".to_string(),
            "1234".to_string(),
        )]
        .into(),
        ..Default::default()
    }
}

async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..500 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting for {what}");
}

async fn container_state(c: &mut RuntimeServiceClient<Channel>, id: &str) -> cri::ContainerStatus {
    c.container_status(cri::ContainerStatusRequest {
        container_id: id.into(),
        verbose: false,
    })
    .await
    .unwrap()
    .into_inner()
    .status
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn pod_and_container_lifecycle() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let env = Env::new().await;
    let image_id = env.pull_busybox().await;
    let mut c = env.runtime().await;

    // Metadata is required.
    let mut bad = pod_config("bad", env.logs.path());
    bad.metadata.as_mut().unwrap().uid.clear();
    let err = c
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(bad),
            runtime_handler: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("uid"), "{err:?}");

    // Run a pod.
    let config = pod_config("web", env.logs.path());
    let sb = c
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .pod_sandbox_id;
    assert_eq!(sb.len(), 64);
    let dup = c
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(dup.code(), Code::AlreadyExists);

    let st = c
        .pod_sandbox_status(cri::PodSandboxStatusRequest {
            pod_sandbox_id: sb.clone(),
            verbose: false,
        })
        .await
        .unwrap()
        .into_inner()
        .status
        .unwrap();
    assert_eq!(st.state, cri::PodSandboxState::SandboxReady as i32);
    assert_eq!(st.labels, config.labels);
    assert_eq!(st.annotations, config.annotations);
    assert_eq!(st.metadata, config.metadata);
    let ip = st.network.unwrap().ip;
    let prefix = env.subnet_base.rsplit_once('.').unwrap().0;
    assert!(
        ip.starts_with(prefix),
        "pod ip {ip} not in {}",
        env.subnet_base
    );
    let netns = env.state().join("netns").join(&sb);
    assert!(netns.exists());

    // A container writing to its CRI log.
    let cid = c
        .create_container(cri::CreateContainerRequest {
            pod_sandbox_id: sb.clone(),
            config: Some(container_config(
                &env.set.busybox_oci.reference,
                &["sh", "-c", "echo hello; sleep 1000"],
            )),
            sandbox_config: Some(config.clone()),
        })
        .await
        .unwrap()
        .into_inner()
        .container_id;
    let created = container_state(&mut c, &cid).await;
    assert_eq!(created.state, cri::ContainerState::ContainerCreated as i32);
    assert_eq!(created.image_ref, image_id);
    c.start_container(cri::StartContainerRequest {
        container_id: cid.clone(),
    })
    .await
    .unwrap();
    let log = env.logs.path().join("main/0.log");
    eventually("the log line", || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains(" stdout F hello\n")
    })
    .await;
    let running = container_state(&mut c, &cid).await;
    assert_eq!(running.state, cri::ContainerState::ContainerRunning as i32);
    assert!(running.started_at > 0);
    assert_eq!(running.log_path, log.display().to_string());
    let listed = c
        .list_containers(cri::ListContainersRequest {
            filter: Some(cri::ContainerFilter {
                pod_sandbox_id: sb.clone(),
                ..Default::default()
            }),
        })
        .await
        .unwrap()
        .into_inner()
        .containers;
    assert_eq!(listed.len(), 1);
    let shims = processes_mentioning(&cid);
    assert!(!shims.is_empty(), "a shim for the container");

    // ExecSync.
    let out = c
        .exec_sync(cri::ExecSyncRequest {
            container_id: cid.clone(),
            cmd: vec![
                "sh".into(),
                "-c".into(),
                "echo out; echo err >&2; exit 3".into(),
            ],
            timeout: 10,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (out.exit_code, out.stdout.as_slice(), out.stderr.as_slice()),
        (3, &b"out\n"[..], &b"err\n"[..])
    );

    // Stop: sh is PID 1 of its PID namespace and ignores SIGTERM, so SIGKILL after 1 s.
    c.stop_container(cri::StopContainerRequest {
        container_id: cid.clone(),
        timeout: 1,
    })
    .await
    .unwrap();
    let exited = container_state(&mut c, &cid).await;
    assert_eq!(exited.state, cri::ContainerState::ContainerExited as i32);
    assert_eq!((exited.exit_code, exited.reason.as_str()), (137, "Error"));
    c.stop_container(cri::StopContainerRequest {
        container_id: cid.clone(),
        timeout: 0,
    })
    .await
    .expect("stop is idempotent");
    for _ in 0..2 {
        c.remove_container(cri::RemoveContainerRequest {
            container_id: cid.clone(),
        })
        .await
        .expect("remove (twice)");
    }
    let gone = c
        .container_status(cri::ContainerStatusRequest {
            container_id: cid.clone(),
            verbose: false,
        })
        .await
        .unwrap_err();
    assert_eq!(gone.code(), Code::NotFound);

    // Stop and remove the pod, twice each.
    for _ in 0..2 {
        c.stop_pod_sandbox(cri::StopPodSandboxRequest {
            pod_sandbox_id: sb.clone(),
        })
        .await
        .unwrap();
    }
    let st = c
        .pod_sandbox_status(cri::PodSandboxStatusRequest {
            pod_sandbox_id: sb.clone(),
            verbose: false,
        })
        .await
        .unwrap()
        .into_inner()
        .status
        .unwrap();
    assert_eq!(st.state, cri::PodSandboxState::SandboxNotready as i32);
    assert!(!netns.exists(), "netns removed at stop");
    let infra_shims = processes_mentioning(&sb);
    for _ in 0..2 {
        c.remove_pod_sandbox(cri::RemovePodSandboxRequest {
            pod_sandbox_id: sb.clone(),
        })
        .await
        .unwrap();
    }
    let items = c
        .list_pod_sandbox(cri::ListPodSandboxRequest { filter: None })
        .await
        .unwrap()
        .into_inner()
        .items;
    assert!(items.is_empty(), "{items:?}");

    // Nothing left: no mounts but the netns directory's own, no shims.
    let dir = env.daemon.root().parent().unwrap().to_path_buf();
    let netns_dir = env.state().join("netns").display().to_string();
    let mounts: Vec<String> = mounts_under(&dir)
        .into_iter()
        .filter(|m| *m != netns_dir)
        .collect();
    assert!(mounts.is_empty(), "mounts left: {mounts:?}");
    eventually("shims to exit", || {
        shims
            .iter()
            .chain(&infra_shims)
            .all(|p| !Path::new(&format!("/proc/{p}")).exists())
    })
    .await;
    assert!(processes_mentioning(&sb).is_empty());
    assert!(processes_mentioning(&cid).is_empty());
}

/// A daemon restart keeps running containers: the new daemon re-attaches to their shims.
#[tokio::test(flavor = "multi_thread")]
async fn running_containers_survive_a_daemon_restart() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let mut env = Env::new().await;
    env.pull_busybox().await;
    let mut c = env.runtime().await;
    let config = pod_config("restart", env.logs.path());
    let sb = c
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .pod_sandbox_id;
    let cid = c
        .create_container(cri::CreateContainerRequest {
            pod_sandbox_id: sb.clone(),
            config: Some(container_config(
                &env.set.busybox_oci.reference,
                &["sleep", "1000"],
            )),
            sandbox_config: Some(config),
        })
        .await
        .unwrap()
        .into_inner()
        .container_id;
    c.start_container(cri::StartContainerRequest {
        container_id: cid.clone(),
    })
    .await
    .unwrap();

    env.daemon.kill();
    env.daemon.restart().await.unwrap();
    let mut c = env.runtime().await;
    let st = container_state(&mut c, &cid).await;
    assert_eq!(st.state, cri::ContainerState::ContainerRunning as i32);
    c.stop_container(cri::StopContainerRequest {
        container_id: cid.clone(),
        timeout: 0,
    })
    .await
    .unwrap();
    let st = container_state(&mut c, &cid).await;
    assert_eq!(
        (st.state, st.exit_code),
        (cri::ContainerState::ContainerExited as i32, 137)
    );
    c.remove_pod_sandbox(cri::RemovePodSandboxRequest {
        pod_sandbox_id: sb.clone(),
    })
    .await
    .unwrap();
    assert!(
        processes_mentioning(&cid).is_empty() || {
            tokio::time::sleep(Duration::from_secs(1)).await;
            processes_mentioning(&cid).is_empty()
        }
    );
}

//! A pod test environment: a registry with the standard test images, a minicri daemon, a CNI
//! bridge network of its own and the cleanup of whatever a failed test leaves behind.
//!
//! For tests that run pod sandboxes and containers (root, runc, Debian's CNI plugins in
//! `/usr/lib/cni`): [`skip_reason`] says why a test cannot run here. Each [`PodEnv`] has its own
//! bridge and a /28 inside 10.199.0.0/16 without masquerading; its [`Leftovers`] removes runc
//! containers, shims, mounts, the bridge and the cgroup parents the test asked for
//! ([`PodEnv::cgroup_parent`]) when it is dropped, after the daemon.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use minicri_proto::runtime::v1 as cri;
use minicri_proto::runtime::v1::runtime_service_client::RuntimeServiceClient;
use tonic::transport::Channel;

use crate::daemon::{Daemon, HostsDir};
use crate::images;
use crate::registry::Registry;

/// The CNI plugins the environment's network uses.
pub const CNI_BIN: &str = "/usr/lib/cni";

/// Why pod tests cannot run here (`None`: they can); a failure instead when CI must run them
/// ([`crate::prereq`]).
pub fn skip_reason() -> Option<String> {
    crate::prereq::missing(runc_skip_reason().or_else(|| {
        (!Path::new(CNI_BIN).join("bridge").exists())
            .then(|| format!("no CNI plugins in {CNI_BIN}"))
    }))
}

/// The start of most pod tests: a [`PodEnv`] with the OCI busybox pulled, busybox's reference
/// and a runtime client; `None`, having said why, where pod tests cannot run ([`skip_reason`]).
pub async fn with_busybox() -> Option<(PodEnv, String, RuntimeServiceClient<Channel>)> {
    with_busybox_args(&[]).await
}

/// [`with_busybox`], the daemon started with `extra_args` as well.
pub async fn with_busybox_args(
    extra_args: &[&str],
) -> Option<(PodEnv, String, RuntimeServiceClient<Channel>)> {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return None;
    }
    let env = PodEnv::with_args(extra_args).await;
    env.pull_busybox().await;
    let image = env.set.busybox_oci.reference.clone();
    let c = env.runtime().await;
    Some((env, image, c))
}

/// Why tests of host-network pods cannot run here (`None`: they can): they need root and runc,
/// not the CNI plugins. A failure instead when CI must run them ([`crate::prereq`]).
pub fn runc_skip_reason() -> Option<String> {
    crate::prereq::missing(if !nix::unistd::geteuid().is_root() {
        Some("not root".into())
    } else if Command::new("runc").arg("--version").output().is_err() {
        Some("no runc".into())
    } else {
        None
    })
}

/// 8 hex digits, different per test process and call.
pub fn unique_hex() -> String {
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
pub fn free_subnet() -> (String, String) {
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

/// Mount points under `dir`, deepest first.
pub fn mounts_under(dir: &Path) -> Vec<String> {
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
pub fn processes_mentioning(needle: &str) -> Vec<i32> {
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

/// The lines `cmd` prints on stdout (none when it cannot run).
pub fn output_lines(cmd: &mut Command) -> Vec<String> {
    let out = cmd.output().map(|o| o.stdout).unwrap_or_default();
    String::from_utf8_lossy(&out)
        .lines()
        .map(String::from)
        .collect()
}

/// Interfaces enslaved to `bridge` (`ip link show master`).
pub fn ports_of(bridge: &str) -> Vec<String> {
    output_lines(Command::new("ip").args(["-o", "link", "show", "master", bridge]))
}

/// Writes `text` to `path` as an executable (mode 0755): the runc wrappers and fake CNI plugins
/// tests put in the daemon's way.
pub fn write_executable(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// The ids `runc list` shows under the runtime root `root`, one per line.
pub fn runc_list(root: &Path) -> String {
    let out = Command::new("runc")
        .arg("--root")
        .arg(root)
        .args(["list", "-q"])
        .output()
        .expect("runc list");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Cleans up after a test, also a failed one: runc containers under the daemon's state, shims,
/// mounts under the daemon's directory, the bridge, cgroup parents.
pub struct Leftovers {
    dir: PathBuf,
    bridge: String,
    /// Cgroup parents (cgroupfs paths, e.g. `/minicri-test-1234`) to remove from every hierarchy.
    cgroups: Mutex<Vec<String>>,
}

/// Removes the cgroup directory `dir` and its children, deepest first (rmdir: a cgroup still
/// holding processes stays).
fn remove_cgroup_tree(dir: &Path) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            remove_cgroup_tree(&e.path());
        }
    }
    let _ = std::fs::remove_dir(dir);
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        // The runc handler's root, and those of other handlers (all runc-compatible).
        let roots = std::fs::read_dir(self.dir.join("state/runtimes"))
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .chain([self.dir.join("state/runc")]);
        for runc_root in roots {
            let Ok(out) = Command::new("runc")
                .arg("--root")
                .arg(&runc_root)
                .args(["list", "-q"])
                .output()
            else {
                continue;
            };
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
        let cgroups = self.cgroups.lock().unwrap_or_else(|p| p.into_inner());
        for parent in cgroups.iter() {
            let rel = parent.trim_start_matches('/');
            // Every v1 hierarchy (/sys/fs/cgroup/<controller>/…) and the v2 root.
            let hierarchies = std::fs::read_dir("/sys/fs/cgroup")
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .chain([PathBuf::from("/sys/fs/cgroup")]);
            for h in hierarchies {
                let d = h.join(rel);
                if d.is_dir() {
                    remove_cgroup_tree(&d);
                }
            }
        }
    }
}

/// A registry with the standard image set, a daemon, and a CNI network of the test's own.
pub struct PodEnv {
    _registry: Registry,
    pub set: images::StandardSet,
    _hosts: HostsDir,
    pub daemon: Daemon,
    /// The network address of the pod subnet (a /28); `.1` is the bridge (gateway).
    pub subnet_base: String,
    /// A directory for the pods' `log_directory`.
    pub logs: tempfile::TempDir,
    // Dropped last: after the daemon is gone.
    leftovers: Leftovers,
}

impl PodEnv {
    /// Starts the registry (with the standard images pushed), the daemon, and writes the CNI
    /// configuration of a fresh bridge and /28.
    pub async fn new() -> PodEnv {
        PodEnv::with_args(&[]).await
    }

    /// As [`PodEnv::new`], the daemon started with `extra_args` as well.
    pub async fn with_args(extra_args: &[&str]) -> PodEnv {
        let registry = Registry::start();
        let set = images::push_standard_set(&registry.addr(), None)
            .await
            .expect("push standard set");
        let hosts = HostsDir::new();
        let daemon = Daemon::start_with(hosts.path(), extra_args)
            .await
            .expect("start minicri");
        let dir = daemon.root().parent().unwrap().to_path_buf();
        let hex = unique_hex();
        let (subnet_base, subnet) = free_subnet();
        let leftovers = Leftovers {
            dir: dir.clone(),
            bridge: format!("mcp{hex}"),
            cgroups: Mutex::new(Vec::new()),
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
        PodEnv {
            _registry: registry,
            set,
            _hosts: hosts,
            daemon,
            subnet_base,
            logs: tempfile::tempdir().unwrap(),
            leftovers,
        }
    }

    /// A RuntimeService client connected to the daemon.
    pub async fn runtime(&self) -> RuntimeServiceClient<Channel> {
        self.daemon.runtime().await.unwrap()
    }

    /// Pulls the OCI busybox test image; returns its image ref.
    pub async fn pull_busybox(&self) -> String {
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

    /// The daemon's state directory.
    pub fn state(&self) -> PathBuf {
        self.daemon.root().parent().unwrap().join("state")
    }

    /// What pods left under the daemon's state directory: mounts (but the netns directory
    /// itself, which stays a shared self-bound mount point for the daemon's lifetime, as `ip
    /// netns` keeps /run/netns), pinned network namespaces, and processes other than the daemon
    /// whose command line names the state directory (monitors, infra). Empty when all is clean.
    pub fn stray_state(&self) -> Vec<String> {
        let state = self.state();
        let mut out: Vec<String> = mounts_under(&state)
            .into_iter()
            .filter(|m| Path::new(m) != state.join("netns"))
            .map(|m| format!("mount {m}"))
            .collect();
        out.extend(
            std::fs::read_dir(state.join("netns"))
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| format!("netns {}", e.path().display())),
        );
        let daemon = self.daemon.pid().map(|p| p as i32);
        out.extend(
            processes_mentioning(&state.to_string_lossy())
                .into_iter()
                .filter(|p| Some(*p) != daemon)
                .map(|p| format!("process {p}")),
        );
        out
    }

    /// [`pod_config`] named `name` under a fresh cgroup parent of its own
    /// ([`PodEnv::cgroup_parent`]): the config and the parent.
    pub fn pod_with_own_cgroup(&self, name: &str) -> (cri::PodSandboxConfig, String) {
        let parent = self.cgroup_parent();
        let mut pod = pod_config(name, self.logs.path());
        pod.linux = Some(cri::LinuxPodSandboxConfig {
            cgroup_parent: parent.clone(),
            ..Default::default()
        });
        (pod, parent)
    }

    /// A fresh cgroupfs cgroup parent (`/minicri-test-<hex>`), removed from every hierarchy
    /// when the environment is dropped.
    pub fn cgroup_parent(&self) -> String {
        let p = format!("/minicri-test-{}", unique_hex());
        self.leftovers
            .cgroups
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(p.clone());
        p
    }
}

/// A pod sandbox config in namespace `pods-test` with uid `uid-<name>`, attempt 1, label
/// `app=<name>` and an annotation with spaces, a newline and `=`.
pub fn pod_config(name: &str, log_dir: &Path) -> cri::PodSandboxConfig {
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

/// `pod` with the node's network namespace (no CNI: quicker to make).
pub fn host_network(mut pod: cri::PodSandboxConfig) -> cri::PodSandboxConfig {
    let linux = pod.linux.get_or_insert_with(Default::default);
    let ctx = linux.security_context.get_or_insert_with(Default::default);
    ctx.namespace_options
        .get_or_insert_with(Default::default)
        .network = cri::NamespaceMode::Node as i32;
    pod
}

/// Polls `f` every 20 ms for up to 10 s.
pub async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..500 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting for {what}");
}

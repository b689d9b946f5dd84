//! The environment of tests that drive the daemon with the kubelet simulator: a registry behind
//! the rate-limiting proxy, a daemon, test images named through the proxy, a check for what pods
//! leave behind, and helpers to read the simulator's events. Dropping it kills and unmounts what
//! a failed test left (host-network sandboxes on runc: root and runc are needed).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use minicri_proto::runtime::v1 as cri;

use crate::daemon::{Daemon, HostsDir};
use crate::images::{self, Compression, ImageBuilder, PushedImage, RegistryClient};
use crate::kubelet_sim::{EventKind, KubeletSim, Puller, SimConfig, SimEvent};
pub use crate::pod_env::runc_skip_reason as skip_reason;
use crate::pod_env::{mounts_under, processes_mentioning};
use crate::proxy::Proxy;
pub use crate::pull_env::MIB;
use crate::registry::Registry;

pub const LONG: Duration = Duration::from_secs(60);

/// Kills and unmounts what the daemon started for the pods, for a test that fails before the
/// simulator terminated them (a passing test checks that nothing is left instead).
pub struct Cleanup {
    state: PathBuf,
    daemon_pid: Option<i32>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let runc_root = self.state.join("runc");
        if let Ok(out) = std::process::Command::new("runc")
            .arg("--root")
            .arg(&runc_root)
            .args(["list", "-q"])
            .output()
        {
            for id in String::from_utf8_lossy(&out.stdout).lines() {
                let _ = std::process::Command::new("runc")
                    .arg("--root")
                    .arg(&runc_root)
                    .args(["delete", "--force", id])
                    .output();
            }
        }
        for pid in processes_mentioning(&self.state.to_string_lossy()) {
            if Some(pid) != self.daemon_pid {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        for m in mounts_under(&self.state) {
            let _ = nix::mount::umount2(m.as_str(), nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

pub struct Env {
    pub registry: Registry,
    pub proxy: Proxy,
    pub hosts: HostsDir,
    // Before the daemon: dropped while it still runs, before its directory is removed.
    _cleanup: Cleanup,
    pub daemon: Daemon,
}

pub async fn env() -> Env {
    env_with(&[]).await
}

/// [`env`] with extra daemon flags.
pub async fn env_with(args: &[&str]) -> Env {
    let registry = Registry::start();
    let proxy = Proxy::start(&registry.addr()).expect("proxy");
    let hosts = HostsDir::new();
    let daemon = Daemon::start_with(hosts.path(), args)
        .await
        .expect("minicri");
    Env {
        registry,
        proxy,
        hosts,
        _cleanup: Cleanup {
            state: daemon.root().parent().unwrap().join("state"),
            daemon_pid: daemon.pid().map(|p| p as i32),
        },
        daemon,
    }
}

impl Env {
    /// A small busybox image, pushed straight to the registry and named through the proxy.
    pub async fn busybox(&self, name: &str) -> (PushedImage, String) {
        let client = RegistryClient::new(self.proxy.upstream());
        let img = ImageBuilder::busybox()
            .label("org.minicri.test.image", name)
            .push(&client, &format!("kubesim/{name}:1"))
            .await
            .expect("push busybox");
        (img, format!("{}/kubesim/{name}:1", self.proxy.addr()))
    }

    /// The busybox base and one incompressible layer of `mib` MiB, named through the proxy.
    pub async fn big(&self, name: &str, mib: u64, seed: u64) -> (PushedImage, String) {
        let client = RegistryClient::new(self.proxy.upstream());
        let img = images::push_big_image(
            &client,
            &format!("kubesim/{name}:1"),
            1,
            mib,
            Compression::None,
            seed,
        )
        .await
        .expect("push big image");
        (img, format!("{}/kubesim/{name}:1", self.proxy.addr()))
    }

    pub async fn sandboxes(&self) -> Vec<cri::PodSandbox> {
        let mut c = self.daemon.runtime().await.unwrap();
        c.list_pod_sandbox(cri::ListPodSandboxRequest { filter: None })
            .await
            .expect("ListPodSandbox")
            .into_inner()
            .items
    }

    pub async fn containers(&self) -> Vec<cri::Container> {
        let mut c = self.daemon.runtime().await.unwrap();
        c.list_containers(cri::ListContainersRequest { filter: None })
            .await
            .expect("ListContainers")
            .into_inner()
            .containers
    }

    /// Mounts and processes the pods left under the daemon's state directory (its own netns
    /// directory mount and the daemon itself aside).
    pub fn stray_state(&self) -> Vec<String> {
        let state = self.daemon.root().parent().unwrap().join("state");
        let mut out: Vec<String> = mounts_under(&state)
            .into_iter()
            .filter(|m| *m != state.join("netns").to_string_lossy())
            .map(|m| format!("mount {m}"))
            .collect();
        let daemon = self.daemon.pid().map(|p| p as i32);
        out.extend(
            processes_mentioning(&state.to_string_lossy())
                .into_iter()
                .filter(|p| Some(*p) != daemon)
                .map(|p| format!("process {p}")),
        );
        out
    }

    /// PullImage calls the daemon logged for images whose name contains `needle`.
    pub fn pull_calls_logged(&self, needle: &str) -> usize {
        self.calls_logged("PullImage", needle)
    }

    /// Calls of `method` the daemon logged for objects whose name contains `needle`.
    pub fn calls_logged(&self, method: &str, needle: &str) -> usize {
        self.daemon
            .log()
            .lines()
            .filter(|l| l.contains(method) && l.contains(needle) && l.contains("code="))
            .count()
    }
}

pub fn fast(puller: Puller) -> SimConfig {
    SimConfig {
        backoff_base: Duration::from_millis(400),
        backoff_max: Duration::from_millis(1600),
        requeue: Duration::from_millis(100),
        grace_period_secs: 0,
        puller,
        on_delete: None,
        api: None,
    }
}

/// The first event matching `f`; panics with the pod's timeline if there is none.
pub fn first(sim: &KubeletSim, uid: &str, what: &str, f: impl Fn(&EventKind) -> bool) -> SimEvent {
    sim.events(uid)
        .into_iter()
        .find(|e| f(&e.kind))
        .unwrap_or_else(|| panic!("pod {uid}: no {what}\n{}", sim.timeline(uid)))
}

pub fn count(sim: &KubeletSim, uid: &str, f: impl Fn(&EventKind) -> bool) -> usize {
    sim.events(uid).iter().filter(|e| f(&e.kind)).count()
}

pub fn is_pull_started(k: &EventKind) -> bool {
    matches!(k, EventKind::PullStarted(_))
}

pub fn is_pull_returned(k: &EventKind) -> bool {
    matches!(k, EventKind::PullReturned { .. })
}

/// (PullQueued, PullStarted, PullReturned) of a pod's only pull.
pub fn pull_times(sim: &KubeletSim, uid: &str) -> (Instant, Instant, Instant) {
    let q = first(sim, uid, "PullQueued", |k| {
        matches!(k, EventKind::PullQueued(_))
    });
    let s = first(sim, uid, "PullStarted", is_pull_started);
    let r = first(sim, uid, "PullReturned", is_pull_returned);
    (q.at, s.at, r.at)
}

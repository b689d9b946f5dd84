//! Pod sandboxes and containers: the state behind the CRI RuntimeService's pod and container
//! RPCs.
//!
//! - [`store`]: sandbox and container records, in memory and as JSON files under
//!   `<state>/pods/`, and name reservations;
//! - [`sandbox`]: RunPodSandbox, StopPodSandbox, RemovePodSandbox, status and list;
//! - [`container`]: CreateContainer … RemoveContainer, status, list, ReopenContainerLog;
//! - [`checkpoint`]: CheckpointContainer (CRIU, `crate::checkpoint`), and the restore of a
//!   container created from a checkpoint archive;
//! - [`exits`]: a container's exit watched, recorded and deleted from its runtime; the teardown
//!   RemoveContainer leaves to the background;
//! - [`exec`]: ExecSync and streaming exec (the Exec RPC's check, the process with piped stdio);
//! - [`imagevol`]: image volumes (mounts that name an image), their snapshots and mounts;
//! - [`cgroups`]: what the kernel says about a container's or pod's cgroup (OOM kills, CPU,
//!   memory and process counters);
//! - [`stats`]: ContainerStats, ListContainerStats, PodSandboxStats, ListPodSandboxStats;
//! - [`metrics`]: ListMetricDescriptors, ListPodSandboxMetrics (cAdvisor's metrics, from the
//!   stats' readers);
//! - [`metadata`]: the bounds on labels and annotations, per object and for the node;
//! - [`resize`]: UpdateContainerResources and UpdatePodSandboxResources (the pod's cgroup,
//!   undone on failure);
//! - [`stopping`]: the SIGKILL deadlines of containers being stopped, shared by their stops;
//! - [`streaming`]: exec and attach for the streaming server (its `ExecBackend`);
//! - [`undo`]: multi-step operations, their undo steps and the on-disk journal of them.
//!
//! The service reaches processes through two seams: each runtime handler's
//! [`crate::oci::OciRuntime`] and the container monitors ([`crate::shim::Monitors`]). Its unit
//! tests (`tests.rs`) put a recording fake behind both (`fake.rs`) and run without root.
//!
//! Layout under the state directory: `pods/` (records; `pods/inflight/` the undo journals), `sandboxes/<id>/` (hostname, resolv.conf,
//! hosts, shm), `containers/<id>/rootfs` (the mounted writable snapshot), `containers/<id>/volumes/`
//! (its image volumes, see [`imagevol`]), `b/<id[..32]>/` (OCI
//! bundles with the shim's files: the full id would make the shim's socket path too long),
//! `netns/<id>` (pinned network namespaces), `infra/` (the infra rootfs), `runc/` (the OCI
//! runtime's root), `idmap/<id>/` (idmapped layers and volumes of containers in pod user
//! namespaces, see `crate::spec::userns`).
//!
//! Invariants:
//! - a multi-step operation that fails half-way undoes every step it took, and one the daemon
//!   was killed in is undone at the next start ([`undo`]: the steps are journaled on disk);
//! - stop and remove are idempotent (CRI: success when already stopped or gone);
//! - operations that change one object are serialised by [`store::Store::op_lock`]; they run in
//!   a spawned task, so a client that hangs up does not leave a step half-done;
//! - a container's exit is recorded by a task waiting on its shim, started by StartContainer or
//!   by [`PodService::open`] after a daemon restart.

pub mod cgroups;
pub mod checkpoint;
pub mod container;
pub mod exec;
pub mod exits;
pub mod imagevol;
pub mod inspect;
pub mod metadata;
pub mod metrics;
pub mod resize;
pub mod sandbox;
pub mod stats;
pub mod stopping;
pub mod store;
pub mod streaming;
pub mod undo;

#[cfg(test)]
mod fake;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::cni::CniManager;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::images::ImageAccess;
use crate::oci::{
    CgroupDriver, Handler, HandlerFeatures, Handlers, HostInfo, OciRuntime, ProbeEnv,
};
use crate::shim::{Monitors, ShimHandle, Shims};
pub use metadata::{DEFAULT_NODE_METADATA_BYTES, MAX_METADATA_BYTES};
pub(crate) use metadata::{Listed, validate_labels_and_annotations};
use store::{ContainerState, Store};
pub(crate) use undo::{Journal, Operation, Undo};

/// The pod and container service; one per daemon, shared as `Arc<PodService>`.
pub struct PodService {
    store: Store,
    cni: Arc<CniManager>,
    /// The OCI runtimes pods run under, by handler name.
    handlers: Handlers,
    /// The containers' monitors (shims).
    monitors: Arc<dyn Monitors>,
    /// Host facts; what a runtime supports is in its handler's features.
    host: HostInfo,
    cgroup_driver: CgroupDriver,
    /// Which pod annotations reach the OCI spec.
    annotations: crate::oci::annotations::AnnotationPolicy,
    /// minicri's own paths, which container mounts and devices may not reach.
    own_paths: crate::spec::own_paths::OwnPaths,
    state_dir: PathBuf,
    shim_binary: PathBuf,
    /// The image side: images, their snapshots, volume holds, the pulls of a pod.
    images: Arc<dyn ImageAccess>,
    /// Samples the stats RPCs keep between calls.
    stats: Arc<stats::StatsState>,
    /// Deadlines of the containers being stopped, which later stops can bring forward.
    stop_deadlines: stopping::StopDeadlines,
    infra: Mutex<Option<crate::pause::InfraRootfs>>,
    /// Label and annotation bytes of the pods and containers being created, not recorded yet.
    metadata_claims: Mutex<metadata::Claimed>,
    /// Most bytes of labels and annotations of the node's pods, and of its containers.
    node_metadata_budget: usize,
    /// Whether CRIU works here (`criu check`, run at the first checkpoint).
    criu: crate::checkpoint::criu::CriuCheck,
    /// `runtime.checkpoint_restore_dirs`: where archives to restore from may lie.
    restore_dirs: Vec<PathBuf>,
    /// The layer limits (`[snapshotter]`) that bound unpacking an archive and its rootfs diff.
    unpack_limits: minicri_snapshotter::Options,
}

/// The service's process seams: each runtime handler's OCI runtime and the containers'
/// monitors. [`PodService::open`] makes the real ones (runc-compatible binaries, shims); the
/// unit tests put a fake behind both ([`PodService::open_with`]).
pub struct Seams {
    pub handlers: Handlers,
    pub monitors: Arc<dyn Monitors>,
}

/// Nanoseconds since the epoch.
pub fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

type Strings = std::collections::HashMap<String, String>;

/// Whether `labels` carry every pair of a list filter's `selector` (CRI: an empty selector
/// matches everything).
pub(crate) fn labels_match(selector: &Strings, labels: &Strings) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// Runs blocking work on tokio's blocking pool.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Internal(format!("blocking task failed: {e}")))?
}

impl PodService {
    /// Opens the records under `<state>/pods` and re-attaches to the shims of running
    /// containers (their exits are recorded as they happen); containers whose shim is gone get
    /// the exit status the shim left, or `Unknown`.
    pub fn open(config: &Config, images: Arc<dyn ImageAccess>) -> anyhow::Result<Arc<PodService>> {
        let seams = |host: &HostInfo| {
            let handlers = Handlers::new(
                &config.runtime.handler_configs(),
                &config.runtime.default_runtime,
                &config.daemon.state,
                config.runtime.cgroup_driver == CgroupDriver::Systemd,
                |runtime| HandlerFeatures {
                    recursive_read_only_mounts: host.recursive_read_only
                        && runtime.supports_mount_option("rro"),
                    user_namespaces: host.user_namespaces,
                },
            )?;
            let monitors: Arc<dyn Monitors> = Arc::new(Shims);
            Ok(Seams { handlers, monitors })
        };
        Self::open_with(config, images, seams)
    }

    /// [`PodService::open`] with the process seams `seams` makes for the detected host.
    pub fn open_with(
        config: &Config,
        images: Arc<dyn ImageAccess>,
        seams: impl FnOnce(&HostInfo) -> anyhow::Result<Seams>,
    ) -> anyhow::Result<Arc<PodService>> {
        let state = config.daemon.state.clone();
        let cni = CniManager::new(config.cni.options(&state));
        let mut host = HostInfo::detect();
        if host.user_namespaces {
            // A pod user namespace's root is an unprivileged host uid: it must be able to pass
            // through every directory above the state directory to reach its rootfs.
            if let Some(closed) = crate::fsutil::closed_ancestor(&state) {
                tracing::warn!(
                    state = %state.display(),
                    directory = %closed.display(),
                    "pod user namespaces are reported unsupported: the directory above the state \
                     directory is not searchable by other users (mode o+x), so a pod's \
                     unprivileged root could not reach its rootfs"
                );
                host.user_namespaces = false;
            }
        }
        if host.apparmor.enabled {
            let dir = state.join("apparmor");
            match crate::spec::apparmor::load_default_profile(&dir) {
                Ok(()) => host.apparmor.default_profile = true,
                Err(e) => tracing::warn!(
                    error = %e,
                    "AppArmor is enabled but minicri's default profile could not be loaded: \
                     containers asking for the runtime default run without an AppArmor profile"
                ),
            }
        }
        let Seams { handlers, monitors } = seams(&host)?;
        let store = Store::open(&state.join("pods"))?;
        std::fs::create_dir_all(state.join("pods/inflight"))?;
        let stats = Arc::new(stats::StatsState::new(
            config.daemon.root.clone(),
            images.clone(),
        ));
        let svc = Arc::new(PodService {
            store,
            cni: Arc::new(cni),
            handlers,
            monitors,
            host,
            cgroup_driver: config.runtime.cgroup_driver,
            annotations: config
                .runtime
                .annotation_policy()
                .map_err(|e| anyhow::anyhow!(e))?,
            own_paths: crate::spec::own_paths::OwnPaths::new(
                &config.daemon.root,
                &state,
                &config.daemon.socket,
                config.runtime.allow_own_path_mounts.clone(),
            ),
            shim_binary: std::env::current_exe()?,
            state_dir: state,
            images,
            stats,
            stop_deadlines: Default::default(),
            infra: Mutex::new(None),
            metadata_claims: Mutex::new(metadata::Claimed::default()),
            node_metadata_budget: config.daemon.node_metadata_budget as usize,
            criu: crate::checkpoint::criu::CriuCheck::new("criu"),
            restore_dirs: config.runtime.checkpoint_restore_dirs.clone(),
            unpack_limits: config.snapshotter.options(None),
        });
        svc.recover();
        Ok(svc)
    }

    /// The runtime handlers pods choose by name (the Status RPC reports their probes).
    pub fn handlers(&self) -> &Handlers {
        &self.handlers
    }

    /// The CNI networks pods are attached to (NetworkReady, the pod CIDR the kubelet sets).
    pub fn cni(&self) -> &CniManager {
        &self.cni
    }

    /// The statuses of sandbox `id`'s containers (those still recorded).
    pub fn container_statuses_of(
        &self,
        id: &str,
    ) -> Vec<minicri_proto::runtime::v1::ContainerStatus> {
        self.store
            .containers_of(id)
            .iter()
            .filter_map(|c| self.container_status(&c.id).ok())
            .collect()
    }

    /// Container lifecycle events as they are recorded (GetContainerEvents).
    pub fn container_events(&self) -> tokio::sync::broadcast::Receiver<store::ContainerEvent> {
        self.store.subscribe()
    }

    /// The id of the sandbox that runs the pod `uid` at `attempt` (PullImage names pods, not
    /// sandboxes).
    pub fn sandbox_of_pod(&self, uid: &str, attempt: u32) -> Option<String> {
        self.store.sandboxes().into_iter().find_map(|r| {
            let m = r.summary().metadata?;
            (m.uid == uid && m.attempt == attempt).then_some(r.id)
        })
    }

    /// Whether the sandbox `id` exists and is ready (a detached download may go on for it).
    pub fn sandbox_is_ready(&self, id: &str) -> bool {
        self.store
            .sandbox(id)
            .is_some_and(|r| r.state == store::SandboxState::Ready)
    }

    fn recover(self: &Arc<Self>) {
        let (mut running, mut exited) = (0, 0);
        for c in self.store.containers() {
            if c.state != ContainerState::Running {
                continue;
            }
            let Some(shim) = c.shim.clone() else { continue };
            match self.monitors.exit_record(&shim) {
                Ok(Some(exit)) => {
                    exited += 1;
                    // Before serving: the blocking query is fine here.
                    let parent = self.cgroup_parent(&c);
                    let oom =
                        cgroups::oom_killed_after_exit(self.cgroup_driver, &parent, &c.id, &exit);
                    self.record_exit_as(&c.id, &exit, oom);
                }
                _ if self.monitors.is_alive(&shim) => {
                    running += 1;
                    if tokio::runtime::Handle::try_current().is_ok() {
                        self.watch_exit(c.id.clone(), shim);
                    }
                }
                _ => {
                    exited += 1;
                    let _ = self.store.update_container(&c.id, |r| {
                        r.state = ContainerState::Exited;
                        r.exit_code = 255;
                        r.finished_at = now_ns();
                        r.reason = "Unknown".into();
                        r.message =
                            "the container's monitor is gone and left no exit status".into();
                    });
                }
            }
        }
        // Exited containers still known to their OCI runtime go from it now, as a running daemon
        // does after each exit: one whose shim was killed while the daemon was down may still
        // be running, unmonitored, and `delete --force` kills it (StopContainer would not: its
        // record says exited).
        if tokio::runtime::Handle::try_current().is_ok() {
            for c in self.store.containers() {
                if c.state == ContainerState::Exited && !c.runtime_deleted {
                    let svc = self.clone();
                    tokio::spawn(async move { svc.delete_exited(&c.id).await });
                }
            }
        }
        for s in self.store.sandboxes() {
            if s.state == store::SandboxState::Ready
                && !s.shim.as_ref().is_some_and(|h| self.monitors.is_alive(h))
            {
                let _ = self
                    .store
                    .update_sandbox(&s.id, |r| r.state = store::SandboxState::NotReady);
            } else if s.state == store::SandboxState::Ready
                && let Some(h) = s.shim.clone()
                && tokio::runtime::Handle::try_current().is_ok()
            {
                self.watch_infra(s.id.clone(), h);
            }
        }
        // Before the CRI is served: RemoveImage must find the images volumes use.
        self.restore_image_volume_users();
        // Containers removed before a crash, whose teardown did not finish.
        if !self.store.removals().is_empty() && tokio::runtime::Handle::try_current().is_ok() {
            let svc = self.clone();
            tokio::spawn(async move {
                if let Err(e) = svc.finish_teardowns(None).await {
                    tracing::warn!(error = %e, "finishing the teardown of removed containers failed");
                }
            });
        }
        // Stopped sandboxes refuse pulls across restarts too (the marks live in memory).
        for s in self.store.sandboxes() {
            if s.state == store::SandboxState::NotReady
                && let Some(m) = s.summary().metadata
            {
                self.images.close_pod(
                    &m.uid,
                    m.attempt,
                    &format!(
                        "pod sandbox {} ({}/{}) is not ready",
                        s.id, m.namespace, m.name
                    ),
                );
            }
        }
        tracing::info!(
            sandboxes = self.store.sandboxes().len(),
            containers = self.store.containers().len(),
            running,
            exited,
            "pod records loaded"
        );
    }

    /// The infra rootfs, prepared on first use.
    pub(crate) fn infra_rootfs(&self) -> Result<crate::pause::InfraRootfs> {
        let mut g = self.infra.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = g.as_ref() {
            return Ok(r.clone());
        }
        let r =
            crate::pause::prepare_infra_rootfs(&self.state_dir.join("infra"), &self.shim_binary)?;
        *g = Some(r.clone());
        Ok(r)
    }

    /// What the runtime handlers' availability probes need.
    fn probe_env(&self) -> Result<ProbeEnv> {
        Ok(ProbeEnv {
            dir: self.state_dir.join("probe"),
            infra: self.infra_rootfs()?,
            cgroup_driver: self.cgroup_driver,
            timeout: crate::oci::handlers::PROBE_TIMEOUT,
        })
    }

    /// The handler a new pod asked for (`""`: the default), known and working here.
    pub(crate) async fn handler_for_new_pod(&self, name: &str) -> Result<&Arc<Handler>> {
        // The first call (or every call while it keeps failing) sets up the infra rootfs on disk.
        let env = minicri_store::fsutil::off_async(|| self.probe_env())?;
        Ok(self.handlers.for_new_pod(name, &env).await?)
    }

    /// Probes every runtime handler at once and logs which ones pods can use (at start, before
    /// the CRI is served; Status then reads the outcomes).
    pub async fn probe_handlers(&self) {
        let env = match self.probe_env() {
            Ok(env) => env,
            Err(e) => {
                tracing::error!(error = %e, "cannot probe the runtime handlers");
                return;
            }
        };
        let probes = self.handlers.all().map(|h| {
            let env = &env;
            async move { (h, h.availability(env).await) }
        });
        for (h, result) in futures::future::join_all(probes).await {
            let default = h.name == self.handlers.default_name();
            match result {
                Ok(()) => tracing::info!(
                    handler = %h.name, binary = %h.runtime.command().binary.display(), default,
                    "runtime handler available"
                ),
                Err(reason) => tracing::warn!(
                    handler = %h.name, binary = %h.runtime.command().binary.display(), default, %reason,
                    "runtime handler unavailable: pods naming it are refused"
                ),
            }
        }
    }

    /// The OCI runtime of a sandbox or container recorded with `handler`.
    pub(crate) fn runtime(&self, handler: &str) -> Result<&dyn OciRuntime> {
        Ok(self.handlers.get(handler)?.runtime.as_ref())
    }

    /// The record of container `id`; NOT_FOUND naming it.
    pub(crate) fn container_record(&self, id: &str) -> Result<store::ContainerRecord> {
        self.store
            .container(id)
            .ok_or_else(|| Error::NotFound(format!("container {id} not found")))
    }

    /// The record of pod sandbox `id`; NOT_FOUND naming it.
    pub(crate) fn sandbox_record(&self, id: &str) -> Result<store::SandboxRecord> {
        self.store
            .sandbox(id)
            .ok_or_else(|| Error::NotFound(format!("pod sandbox {id} not found")))
    }

    /// The record of pod sandbox `id` if it is ready: NOT_FOUND or FAILED_PRECONDITION naming it.
    pub(crate) fn ready_sandbox(&self, id: &str) -> Result<store::SandboxRecord> {
        let sb = self.sandbox_record(id)?;
        if sb.state != store::SandboxState::Ready {
            return Err(Error::FailedPrecondition(format!(
                "pod sandbox {id} is not ready"
            )));
        }
        Ok(sb)
    }

    /// The OCI runtime of the container `id`.
    pub(crate) fn container_runtime(&self, id: &str) -> Result<&dyn OciRuntime> {
        self.runtime(&self.container_record(id)?.runtime_handler)
    }

    /// Gives a shim whose container is gone a moment to exit by itself, then kills it.
    pub(crate) async fn reap_shim(&self, s: &ShimHandle) {
        for _ in 0..50 {
            if !self.monitors.is_alive(s) {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        self.monitors.kill_shim(s);
    }

    /// The host facts as a pod under `handler` sees them (what its runtime supports).
    pub(crate) fn host_for(&self, handler: &Handler) -> HostInfo {
        let mut host = self.host;
        host.recursive_read_only = handler.features.recursive_read_only_mounts;
        host.user_namespaces = handler.features.user_namespaces;
        host
    }

    pub(crate) fn netns_dir(&self) -> PathBuf {
        self.state_dir.join("netns")
    }

    pub(crate) fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.state_dir.join("sandboxes").join(id)
    }

    pub(crate) fn container_dir(&self, id: &str) -> PathBuf {
        self.state_dir.join("containers").join(id)
    }

    /// The bundle directory of a sandbox's infra or a container (short: see the module docs).
    pub(crate) fn bundle_dir(&self, id: &str) -> PathBuf {
        self.state_dir.join("b").join(&id[..id.len().min(32)])
    }

    /// A fresh id whose bundle directory is free.
    pub(crate) fn new_id(&self) -> Result<String> {
        loop {
            let id = crate::ids::object_id()?;
            if !self.store.id_in_use(&id) && !self.bundle_dir(&id).exists() {
                return Ok(id);
            }
        }
    }
}

/// Removes a directory tree; a missing one is fine.
pub(crate) fn remove_dir(d: &Path) -> Result<()> {
    match std::fs::remove_dir_all(d) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(Error::Internal(format!("removing {}: {e}", d.display())))
        }
        _ => Ok(()),
    }
}

/// Unmounts everything stacked on `p` (idempotent).
pub(crate) fn unmount_all(p: &Path) -> Result<()> {
    while crate::spec::propagation::is_mountpoint(p) {
        nix::mount::umount2(p, nix::mount::MntFlags::MNT_DETACH)
            .map_err(|e| Error::Internal(format!("unmounting {}: {e}", p.display())))?;
    }
    Ok(())
}

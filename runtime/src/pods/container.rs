//! Container operations: create, start, stop, remove, status, list, ReopenContainerLog.
//!
//! CreateContainer prepares the writable snapshot (key: the container id, parent: the image's
//! top layer chain id), mounts it at `<state>/containers/<id>/rootfs`, mounts the image volumes
//! ([`super::imagevol`]) and writes the bundle;
//! StartContainer starts the shim (which creates the container through runc and writes its CRI
//! log) and then `runc start`s it (a container made from a checkpoint archive is restored by its
//! shim instead, [`super::checkpoint`]); a task waits for the exit and records it ([`super::exits`]).
//! ExecSync is with the other exec paths ([`super::exec`]), UpdateContainerResources with the
//! pod resize ([`super::resize`]).

mod create;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use minicri_proto::runtime::v1 as cri;
use minicri_store::text::bounded_to;

use super::store::{ContainerRecord, ContainerState, SandboxState};
use super::{Journal, Operation, PodService, Undo, blocking, now_ns};
use crate::error::{Error, Result};
use crate::shim::{LogTarget, ShimConfig};

/// How long StopContainer waits for the exit after SIGKILL.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// CRI `ContainerUser`: the identity of the container's first process, its supplementary
/// groups sorted as the kernel keeps them.
fn container_user(u: &oci_spec::runtime::User) -> cri::ContainerUser {
    let mut groups: Vec<i64> = u
        .additional_gids()
        .iter()
        .flatten()
        .map(|g| i64::from(*g))
        .collect();
    groups.sort_unstable();
    groups.dedup();
    cri::ContainerUser {
        linux: Some(cri::LinuxContainerUser {
            uid: i64::from(u.uid()),
            gid: i64::from(u.gid()),
            supplemental_groups: groups,
        }),
    }
}

impl PodService {
    /// Where the idmapped mounts of container `id` go (only in a pod user namespace).
    pub(crate) fn idmap_dir(&self, id: &str) -> PathBuf {
        self.state_dir.join("idmap").join(id)
    }

    /// The PID namespace a container asks to join (`namespace_options.pid` TARGET): that of a
    /// running container of the same pod. Another pod's container is refused, since its
    /// processes (and, in a host-PID pod, the host's) would become visible and signalable.
    /// Checked at CreateContainer and again at StartContainer, when the OCI runtime opens the
    /// namespace by the target's pid.
    fn target_pid_namespace(
        &self,
        sandbox_id: &str,
        config: &cri::ContainerConfig,
    ) -> Result<Option<PathBuf>> {
        let Some(o) = config
            .linux
            .as_ref()
            .and_then(|l| l.security_context.as_ref())
            .and_then(|s| s.namespace_options.as_ref())
            .filter(|o| o.pid == cri::NamespaceMode::Target as i32)
        else {
            return Ok(None);
        };
        if o.target_id.is_empty() {
            return Err(Error::InvalidArgument(
                "pid namespace TARGET needs a target_id".into(),
            ));
        }
        // The container asking is there; what it names is not: a failed precondition, at
        // CreateContainer and StartContainer alike.
        let t = self.store.container(&o.target_id).ok_or_else(|| {
            Error::FailedPrecondition(format!(
                "target container {:?} of the PID namespace does not exist",
                o.target_id
            ))
        })?;
        if t.sandbox_id != sandbox_id {
            return Err(Error::InvalidArgument(format!(
                "target container {} of the PID namespace is in pod sandbox {}, not in {sandbox_id}",
                o.target_id, t.sandbox_id
            )));
        }
        if t.state != ContainerState::Running {
            return Err(Error::FailedPrecondition(format!(
                "target container {} of the PID namespace is not running",
                o.target_id
            )));
        }
        Ok(Some(PathBuf::from(format!("/proc/{}/ns/pid", t.pid))))
    }

    /// Where the container's CRI log goes, with the directories between the pod's log
    /// directory and the log made, none of them a symlink (crate::logs::create_log_dirs). The
    /// log directory is the kubelet's, on whatever filesystem it chose: off the async workers.
    async fn prepare_log(&self, rec: &ContainerRecord) -> Result<Option<LogTarget>> {
        let log = match (&rec.log_path, self.store.sandbox(&rec.sandbox_id)) {
            (Some(path), Some(sb)) => Some(LogTarget {
                dir: PathBuf::from(sb.config().log_directory),
                path: path.clone(),
            }),
            _ => None,
        };
        if let Some(log) = log.clone() {
            blocking(move || {
                crate::logs::create_log_dirs(&log.dir, &log.path).map_err(|e| {
                    let what = format!("creating the directories of {}", log.path.display());
                    if e.raw_os_error() == Some(libc::ELOOP) {
                        Error::FailedPrecondition(format!(
                            "{what}: a directory below {} is a symlink",
                            log.dir.display()
                        ))
                    } else {
                        Error::Internal(format!("{what}: {e}"))
                    }
                })
            })
            .await?;
        }
        Ok(log)
    }

    /// StartContainer: only a created container can be started.
    /// A start the daemon is killed in is undone at the next start: the container is created
    /// again, not running.
    pub async fn start_container(self: &Arc<Self>, id: String) -> Result<()> {
        self.undoable(Operation::StartContainer, move |svc, undo| {
            Box::pin(async move { svc.start_steps(&id, undo).await })
        })
        .await
    }

    async fn start_steps(self: &Arc<Self>, id: &str, undo: &mut Journal) -> Result<()> {
        let _guard = self.store.op_lock(id).await;
        let rec = self.container_record(id)?;
        if rec.state != ContainerState::Created {
            return Err(Error::FailedPrecondition(format!(
                "container {id} is {:?}, not created",
                rec.state
            )));
        }
        match self.store.sandbox(&rec.sandbox_id) {
            Some(s) if s.state == SandboxState::Ready => {}
            _ => {
                return Err(Error::FailedPrecondition(format!(
                    "pod sandbox {} of container {id} is not ready",
                    rec.sandbox_id
                )));
            }
        }
        // The bundle names the PID namespace of a target container by its pid: if the target
        // exited since CreateContainer, that pid may be another process's by now.
        let config = rec.config();
        self.target_pid_namespace(&rec.sandbox_id, &config)?;
        let log = self.prepare_log(&rec).await?;
        let runtime = self.runtime(&rec.runtime_handler)?;
        let mut cfg = ShimConfig::new(id, &rec.bundle, runtime.command(), &self.shim_binary);
        cfg.log = log;
        cfg.stdin = config.stdin;
        cfg.stdin_once = config.stdin_once;
        cfg.tty = config.tty;
        cfg.restore_from = rec.restore_from.clone();
        // From here on the runtime may know the id; undone, the container is created again
        // (when the start failed, it is also recorded as exited below).
        undo.subject(id)?;
        undo.push(Undo::DeleteContainer {
            id: id.to_string(),
            shim: None,
            handler: rec.runtime_handler.clone(),
        })?;
        let started = async {
            let restore = cfg.restore_from.is_some();
            let shim = self.monitors.spawn(cfg).await?;
            // A restored container runs as soon as its shim reports it ready.
            if !restore {
                runtime.start(id).await?;
            }
            Ok::<_, crate::oci::OciError>(shim)
        }
        .await;
        let started = match started {
            // CRIU's own reason is in its log, not in runc's message.
            Err(e) if rec.restore_from.is_some() => {
                let (bundle, id) = (rec.bundle.clone(), id.to_string());
                let msg =
                    blocking(move || Ok(super::checkpoint::restore_failure(&id, &bundle, &e)))
                        .await?;
                Err(crate::oci::OciError::Other(msg))
            }
            other => other,
        };
        let shim = match started {
            Ok(s) => s,
            Err(e) => {
                let msg = bounded_to(e.to_string(), crate::error::MAX_STATUS_CHARS);
                self.store.update_container(id, |r| {
                    r.state = ContainerState::Exited;
                    r.exit_code = 128;
                    r.finished_at = now_ns();
                    r.reason = "StartError".into();
                    r.message = msg;
                })?;
                return Err(e.into());
            }
        };
        self.store.update_container(id, |r| {
            r.state = ContainerState::Running;
            r.pid = shim.init_pid;
            r.started_at = now_ns();
            r.shim = Some(shim.clone());
            r.restore_from = None;
        })?;
        if rec.restore_from.is_some() {
            self.settle_restored(&rec, shim.init_pid).await?;
        }
        self.watch_exit(id.to_string(), shim);
        Ok(())
    }

    /// StopContainer: the stop signal, `timeout` seconds, then SIGKILL to every process of the
    /// container. Idempotent; an unknown id is success (CRI).
    pub async fn stop_container(self: &Arc<Self>, id: String, timeout: i64) -> Result<()> {
        let svc = self.clone();
        tokio::spawn(async move { svc.stop_container_inner(&id, timeout).await })
            .await
            .map_err(|e| Error::Internal(format!("StopContainer task: {e}")))?
    }

    /// The stop signal, then SIGKILL at the earliest deadline of all stops of the container
    /// under way: a stop waiting out a long grace period holds the container's lock, and a later
    /// one with a shorter timeout brings its SIGKILL forward rather than waiting behind it.
    pub(crate) async fn stop_container_inner(&self, id: &str, timeout: i64) -> Result<()> {
        let mut stop = self
            .stop_deadlines
            .join(id, super::stopping::deadline_after(timeout));
        let _guard = self.store.op_lock(id).await;
        let Some(rec) = self.store.container(id) else {
            return Ok(());
        };
        if rec.state != ContainerState::Running {
            return Ok(());
        }
        let Some(shim) = rec.shim.clone() else {
            return Ok(());
        };
        let runtime = self.runtime(&rec.runtime_handler)?;
        if !stop.expired() {
            if let Err(e) = runtime.kill(id, rec.stop_signal, false).await {
                tracing::debug!(container = %id, error = %e, "stop signal");
            }
            tokio::select! {
                exit = self.monitors.wait(&shim) => {
                    if let Ok(exit) = exit {
                        self.record_exit(id, &exit).await;
                        return Ok(());
                    }
                }
                () = stop.reached() => {}
            }
        }
        // In the pod's shared PID namespace other processes outlive the init: kill them all.
        if let Err(e) = runtime.kill(id, libc::SIGKILL, true).await {
            tracing::debug!(container = %id, error = %e, "SIGKILL");
        }
        match tokio::time::timeout(KILL_WAIT, self.monitors.wait(&shim)).await {
            Ok(Ok(exit)) => self.record_exit(id, &exit).await,
            Ok(Err(e)) => self.record_lost(id, &e.to_string()),
            Err(_) => {
                return Err(Error::Internal(format!(
                    "container {id} did not exit within {KILL_WAIT:?} of SIGKILL"
                )));
            }
        }
        Ok(())
    }

    /// RemoveContainer: stops it, takes its record out (durably: it is gone from every listing
    /// and status, and its name is free, when the call returns), then tears it down in the
    /// background: deleted from the runtime, its rootfs unmounted, its snapshot and files
    /// removed. A teardown that fails is retried by RemovePodSandbox and at the next start.
    /// Idempotent.
    pub async fn remove_container(self: &Arc<Self>, id: String) -> Result<()> {
        let svc = self.clone();
        tokio::spawn(async move { svc.remove_container_inner(&id).await })
            .await
            .map_err(|e| Error::Internal(format!("RemoveContainer task: {e}")))?
    }

    pub(crate) async fn remove_container_inner(self: &Arc<Self>, id: &str) -> Result<()> {
        let Some(rec) = self.store.container(id) else {
            return Ok(());
        };
        // An exited container needs no stop, and its runtime delete may be under way (holding
        // its operation lock, see `delete_exited`): the teardown waits for that, not the call.
        // Anything else is stopped, and its record taken out under the lock, so that no start
        // or stop runs half-way meanwhile.
        let _guard = if rec.state == ContainerState::Exited {
            None
        } else {
            self.stop_container_inner(id, 0).await?;
            Some(self.store.op_lock(id).await)
        };
        if self.store.begin_removal(id)?.is_none() {
            return Ok(());
        }
        let svc = self.clone();
        let id = id.to_string();
        tokio::spawn(async move {
            if let Err(e) = svc.teardown_container(&id).await {
                tracing::warn!(
                    container = %id,
                    error = %e,
                    "tearing down a removed container failed; RemovePodSandbox and the next start retry"
                );
            }
        });
        Ok(())
    }

    pub fn container_status(&self, id: &str) -> Result<cri::ContainerStatus> {
        let r = self.container_record(id)?;
        let c = r.config();
        Ok(cri::ContainerStatus {
            id: r.id.clone(),
            metadata: c.metadata.clone(),
            state: r.state.to_cri() as i32,
            created_at: r.created_at,
            started_at: r.started_at,
            finished_at: r.finished_at,
            exit_code: r.exit_code,
            image: Some(cri::ImageSpec {
                image: r.image.clone(),
                ..Default::default()
            }),
            image_ref: r.image_id.clone(),
            reason: r.reason.clone(),
            message: r.message.clone(),
            labels: c.labels,
            annotations: c.annotations,
            mounts: super::imagevol::status_mounts(c.mounts, &r.image_volumes),
            log_path: r
                .log_path
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            image_id: r.image_id.clone(),
            user: r.user.as_ref().map(container_user),
            ..Default::default()
        })
    }

    pub fn list_containers(&self, filter: Option<cri::ContainerFilter>) -> Vec<cri::Container> {
        let f = filter.unwrap_or_default();
        let mut out: Vec<cri::Container> = self
            .store
            .containers()
            .into_iter()
            .filter(|r| f.id.is_empty() || r.id.starts_with(&f.id))
            .filter(|r| f.pod_sandbox_id.is_empty() || r.sandbox_id.starts_with(&f.pod_sandbox_id))
            .filter(|r| {
                f.state
                    .as_ref()
                    .is_none_or(|s| s.state == r.state.to_cri() as i32)
            })
            .map(|r| {
                let c = r.summary();
                cri::Container {
                    id: r.id.clone(),
                    pod_sandbox_id: r.sandbox_id.clone(),
                    metadata: c.metadata,
                    image: Some(cri::ImageSpec {
                        image: r.image.clone(),
                        ..Default::default()
                    }),
                    image_ref: r.image_id.clone(),
                    state: r.state.to_cri() as i32,
                    created_at: r.created_at,
                    labels: c.labels,
                    annotations: c.annotations,
                    image_id: r.image_id.clone(),
                }
            })
            .filter(|c| super::labels_match(&f.label_selector, &c.labels))
            .collect();
        out.sort_by_key(|c| c.created_at);
        out
    }

    /// The record of container `id` if it is running: NOT_FOUND or FAILED_PRECONDITION naming it.
    pub(super) fn running(&self, id: &str) -> Result<ContainerRecord> {
        let r = self.container_record(id)?;
        if r.state != ContainerState::Running {
            return Err(Error::FailedPrecondition(format!(
                "container {id} is not running"
            )));
        }
        Ok(r)
    }

    /// ReopenContainerLog: the shim reopens the log file (after the kubelet rotated it).
    pub async fn reopen_container_log(&self, id: &str) -> Result<()> {
        let r = self.running(id)?;
        if r.log_path.is_none() {
            return Err(Error::FailedPrecondition(format!(
                "container {id} has no log file (its log_path is empty)"
            )));
        }
        let shim = r
            .shim
            .ok_or_else(|| Error::FailedPrecondition(format!("container {id} is not running")))?;
        Ok(self.monitors.reopen_log(&shim).await?)
    }
}

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

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use minicri_proto::runtime::v1 as cri;
use minicri_store::text::bounded_to;
use prost::Message;

use super::store::{ContainerRecord, ContainerState, SandboxState};
use super::{Journal, Operation, PodService, Undo, blocking, now_ns};
use crate::error::{Error, Result};
use crate::shim::{LogTarget, ShimConfig};
use crate::spec::{ContainerSpecParams, ImageConfig, SandboxFiles, SandboxNamespaces};

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

    /// CreateContainer: returns the new container's id.
    pub async fn create_container(
        self: &Arc<Self>,
        sandbox_id: String,
        config: cri::ContainerConfig,
        sandbox_config: Option<cri::PodSandboxConfig>,
    ) -> Result<String> {
        self.undoable(Operation::CreateContainer, move |svc, undo| {
            Box::pin(async move {
                svc.create_steps(&sandbox_id, config, sandbox_config, undo)
                    .await
            })
        })
        .await
    }

    async fn create_steps(
        self: &Arc<Self>,
        sandbox_id: &str,
        mut config: cri::ContainerConfig,
        _sandbox_config: Option<cri::PodSandboxConfig>,
        undo: &mut Journal,
    ) -> Result<String> {
        let sb = self.ready_sandbox(sandbox_id)?;
        let sb_config = sb.config();
        // Containers run under their pod's runtime handler.
        let host = self.host_for(self.handlers.get(&sb.runtime_handler)?);
        let meta = config.metadata.clone().ok_or_else(|| {
            Error::InvalidArgument("container config metadata is required".into())
        })?;
        if meta.name.is_empty() {
            return Err(Error::InvalidArgument(
                "container config metadata.name is required".into(),
            ));
        }
        // The name is in every ListContainers, stats and event answer, and in logs: a long one
        // (Kubernetes' are DNS labels, at most 63) would push relists past the kubelet's 16 MiB.
        if meta.name.len() > 253
            || meta
                .name
                .chars()
                .any(|c| c.is_whitespace() || c.is_control() || c == '/')
        {
            return Err(Error::InvalidArgument(format!(
                "container config metadata.name {:?} is not a Kubernetes name (at most 253 characters, none of whitespace, control characters, '/')",
                meta.name
            )));
        }
        super::validate_labels_and_annotations(
            "container config",
            &config.labels,
            &config.annotations,
        )?;
        let _claim = self.check_node_metadata(
            super::Listed::Containers,
            &config.labels,
            &config.annotations,
        )?;
        let image_name = config
            .image
            .as_ref()
            .map(|i| i.image.clone())
            .unwrap_or_default();
        if image_name.is_empty() {
            return Err(Error::InvalidArgument(
                "container config image is required".into(),
            ));
        }
        // An image naming a checkpoint archive: the container is made from the archive's image
        // and process, then its files (super::checkpoint).
        let restore = self.restore_source(&mut config).await?;
        let rootfs_image = restore.as_ref().map_or(&image_name, |(_, i)| i);
        let image = self
            .images
            .get(rootfs_image)?
            .ok_or_else(|| Error::NotFound(format!("image {image_name:?} not found")))?;
        let chain_id = image.chain_id.clone().ok_or_else(|| {
            Error::FailedPrecondition(format!("image {image_name:?} is not unpacked"))
        })?;
        let image_config = minicri_store::fsutil::off_async(|| self.content.read(&image.config))?;
        let image_config = ImageConfig::from_document(&image_config)?;
        // Mounts are checked before anything is done on the host for them (their sources may
        // be made shared below, which is not undone).
        let pod_userns = crate::spec::userns::pod_userns(&sb_config)?;
        crate::spec::container::validate_mounts(&config.mounts, &host)?;
        // Nor may they reach minicri's own files (a lookup per path component).
        minicri_store::fsutil::off_async(|| self.own_paths.check(&config.mounts, &config.devices))?;
        crate::spec::userns::check_volume_mappings(&config.mounts, pod_userns.as_ref())?;
        // CRI: the log is <sandbox log_directory>/<container log_path>.
        let log_path = crate::logs::container_log_path(&sb_config.log_directory, &config.log_path)
            .map_err(Error::InvalidArgument)?;
        let target_pid_ns = self.target_pid_namespace(sandbox_id, &config)?;

        let id = self.new_id()?;
        undo.subject(&id)?;
        let sm = sb_config.metadata.clone().unwrap_or_default();
        let name = format!(
            "{}_{}_{}_{}_{}",
            meta.name, sm.name, sm.namespace, sm.uid, meta.attempt
        );
        self.store.reserve(&name, &id)?;
        undo.push(Undo::ReleaseName {
            name: name.clone(),
            id: id.clone(),
        })?;

        // The writable snapshot, mounted; in a pod with its own user namespace, on idmapped
        // layers (crate::spec::userns).
        let userns_path =
            pod_userns.map(|_| PathBuf::from(format!("/proc/{}/ns/user", sb.infra_pid)));
        let userns = pod_userns
            .zip(userns_path.clone())
            .map(|(u, path)| (path, (u.uid.host_id(), u.gid.host_id())));
        let volume_userns = userns.clone();
        let dir = self.container_dir(&id);
        let rootfs = dir.join("rootfs");
        // Idmapped mounts stay out of `dir`, which undo removes recursively (crate::spec::userns).
        let idmap = self.idmap_dir(&id);
        undo.push(Undo::RemoveDir(dir.clone()))?;
        undo.push(Undo::RemoveSnapshot(id.clone()))?;
        undo.push(Undo::Unmount(rootfs.clone()))?;
        undo.push(Undo::RemoveIdmapped(idmap.clone()))?;
        {
            let snap = self.snapshotter.clone();
            let (key, rootfs, layers) = (id.clone(), rootfs.clone(), idmap.join("layers"));
            let dir = dir.clone();
            blocking(move || {
                let m = snap.prepare(&key, Some(&chain_id))?;
                // The mounted rootfs holds the image's setuid files and device nodes: its
                // directory is root's alone, or the pod user namespace root's (who must reach
                // it from inside).
                crate::fsutil::private_dir(&dir, userns.as_ref().map(|(_, root)| *root))
                    .and_then(|()| std::fs::create_dir_all(&rootfs))
                    .map_err(|e| Error::Internal(format!("creating {}: {e}", rootfs.display())))?;
                match userns {
                    Some((ns, root)) => {
                        crate::spec::userns::mount_rootfs(&m, &rootfs, &layers, &ns, root)?;
                    }
                    None => m.mount_at(&rootfs)?,
                }
                Ok(())
            })
            .await?;
        }

        // A restore's files: the archive unpacked beside the rootfs, its changes applied.
        let restore_from = match restore {
            Some((archive, _)) => Some(
                self.unpack_restore(archive, dir.clone(), rootfs.clone())
                    .await?,
            ),
            None => None,
        };

        // Image volumes, mounted in the container's directory (private by now).
        let image_volumes = self
            .mount_image_volumes(&id, &config.mounts, volume_userns.as_ref(), undo)
            .await?;
        // The mounts as the spec binds them: image volumes from where they were mounted.
        let bound = super::imagevol::spec_mounts(&config.mounts, &image_volumes);

        // The spec.
        let namespaces = SandboxNamespaces::of_infra(sb.infra_pid, &sb_config);
        let files_dir = self.sandbox_dir(sandbox_id).join("files");
        let shm = files_dir.join("shm");
        // Reads the node's whole mount table: off the async workers.
        let shm =
            blocking(move || Ok(crate::spec::propagation::is_mountpoint(&shm).then_some(shm)))
                .await?;
        let files = SandboxFiles {
            hostname: Some(files_dir.join("hostname")),
            resolv_conf: Some(files_dir.join("resolv.conf")),
            hosts: Some(files_dir.join("hosts")),
            shm,
        };
        // The spec first: building it checks all the rest of the request and changes nothing
        // on the host, so a refused request leaves no bind source made or made shared. It reads
        // the image's /etc/passwd and /etc/group, device nodes and seccomp profiles: file work
        // kept off the async workers. In a pod user namespace, the spec binds the idmapped
        // mounts made below.
        let volumes = idmap.join("volumes");
        let spec_config = cri::ContainerConfig {
            mounts: match &userns_path {
                Some(_) => crate::spec::userns::idmapped_mounts(&bound, &volumes),
                None => bound.clone(),
            },
            ..config.clone()
        };
        let spec = minicri_store::fsutil::off_async(|| {
            crate::spec::container_spec(&ContainerSpecParams {
                id: &id,
                sandbox_id,
                config: &spec_config,
                sandbox_config: &sb_config,
                image: &image_config,
                rootfs: &rootfs,
                namespaces: &namespaces,
                files: &files,
                target_pid_ns: target_pid_ns.as_deref(),
                cgroup_driver: self.cgroup_driver,
                host: &host,
                annotations: &self.annotations,
            })
        })?;
        // Bind sources: created when missing, made shared when their propagation needs it;
        // in a pod user namespace, idmapped when the kubelet asks.
        let mounts = bound;
        blocking(move || {
            crate::spec::propagation::prepare_bind_sources(&mounts)?;
            if let Some(ns) = &userns_path {
                crate::spec::userns::idmap_volumes(&mounts, pod_userns.as_ref(), ns, &volumes)?;
            }
            Ok(())
        })
        .await?;
        let bundle = self.bundle_dir(&id);
        undo.push(Undo::RemoveDir(bundle.clone()))?;
        minicri_store::fsutil::off_async(|| crate::spec::write_bundle(&bundle, &spec))?;

        let rec = ContainerRecord {
            id: id.clone(),
            sandbox_id: sandbox_id.to_string(),
            name,
            config: config.encode_to_vec().into(),
            image: image_name,
            image_id: image.id.to_string(),
            created_at: now_ns(),
            started_at: 0,
            finished_at: 0,
            exit_code: 0,
            reason: String::new(),
            message: String::new(),
            state: ContainerState::Created,
            log_path,
            rootfs,
            bundle,
            stop_signal: image_config.stop_signal_number().unwrap_or(libc::SIGTERM),
            shim: None,
            pid: 0,
            user: spec.process().as_ref().map(|p| p.user().clone()),
            runtime_handler: sb.runtime_handler.clone(),
            runtime_deleted: false,
            image_volumes,
            restore_from,
        };
        self.store.put_container(rec)?;
        tracing::info!(container = %id, sandbox = %sandbox_id, name = %meta.name, "container created");
        Ok(id)
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
        // The directories between the pod's log directory and the log, none of them a symlink
        // (crate::logs::create_log_dirs). The log directory is the kubelet's, on whatever
        // filesystem it chose: off the async workers.
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
            // The restored processes into the container's own cgroup (super::checkpoint).
            let (driver, parent) = (self.cgroup_driver, self.cgroup_parent(&rec));
            let (cid, pid) = (id.to_string(), shim.init_pid);
            let adopted = blocking(move || {
                Ok(super::checkpoint::adopt_restored(
                    driver, &parent, &cid, pid,
                ))
            })
            .await?;
            match adopted {
                Ok(Some((from, to))) => {
                    tracing::info!(container = %id, from = %from.display(), to = %to.display(), "restored processes moved to the container's cgroup")
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(container = %id, error = %e, "the restored processes stay in the cgroup CRIU put them in")
                }
            }
            // CRIU is done with the images: they need not take the space until the teardown.
            let unpacked = self.container_dir(id).join(super::checkpoint::RESTORE_DIR);
            tokio::task::spawn_blocking(move || std::fs::remove_dir_all(unpacked));
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

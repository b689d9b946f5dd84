//! CheckpointContainer, and the restore of a container created from a checkpoint archive.
//!
//! A checkpoint dumps a running container with CRIU (`runc checkpoint --leave-running`: it goes
//! on running) into a staging directory `<state>/checkpoints/<id>.<n>/` laid out as the archive
//! ([`crate::checkpoint::archive`]), with its spec, metadata and the changes of its writable
//! layer (the overlay's upper directory), then writes the archive where the request says. CRIU
//! is checked first (`criu check`, once): a host where it cannot run gets its reason as
//! FAILED_PRECONDITION and the container is not touched.
//!
//! A restore is a CreateContainer whose image names an archive
//! ([`crate::checkpoint::archive::archive_path`]): the container is created from the archive's
//! image (`rootfsImageName`, else `rootfsImageRef`, which must be present) with the process of
//! its `spec.dump`, in the new pod as any container; its rootfs diff and deleted files are
//! applied to its fresh writable layer, and the archive is unpacked in its directory.
//! StartContainer then has its shim run `runc restore --detach` instead of `create` + `start`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use minicri_proto::runtime::v1 as cri;

use super::store::ContainerState;
use super::{PodService, blocking, now_ns};
use crate::checkpoint::archive::{self, ConfigDump};
use crate::error::{Error, Result};

/// How long a checkpoint may take when the request gives no timeout.
pub const DEFAULT_CHECKPOINT_TIMEOUT: Duration = Duration::from_secs(300);

/// Where a restored container's archive is unpacked, in its directory.
pub(super) const RESTORE_DIR: &str = "restore";

/// The message of a failed restore of container `id`: the runtime's error, and CRIU's reason
/// from its log (`restore.log` in the bundle, the restore's work directory).
pub(super) fn restore_failure(id: &str, bundle: &Path, e: &crate::oci::OciError) -> String {
    let criu = crate::checkpoint::criu::log_reason(&bundle.join("restore.log"))
        .map(|r| format!("; CRIU: {r}"))
        .unwrap_or_default();
    format!("restoring container {id} from its checkpoint: {e}{criu}")
}

/// How many times [`adopt_restored`] moves what is left in the old cgroup.
const MOVE_PASSES: usize = 20;

/// Moves a restored container's processes into its own cgroup, and returns where they were.
///
/// runc 1.1 does not tell CRIU the new cgroup on cgroup v2, so CRIU puts the restored processes
/// back at the checkpointed container's cgroup path (made again when it was gone): the new
/// container's cgroup, which `runc kill --all`, the stats and the OOM count read, would be empty
/// (and the systemd driver's scope, left empty once CRIU exits, is gone). The processes are
/// moved to it (the directory made when missing) and the old path removed. `Ok(None)`: they are
/// where they belong already, or the host is cgroup v1 (where runc maps the paths itself).
pub(super) fn adopt_restored(
    driver: crate::oci::CgroupDriver,
    parent: &str,
    id: &str,
    init_pid: i32,
) -> std::result::Result<Option<(PathBuf, PathBuf)>, String> {
    let super::cgroups::Hierarchy::V2 { root } = super::cgroups::Hierarchy::host() else {
        return Ok(None);
    };
    let own = std::fs::read_to_string(format!("/proc/{init_pid}/cgroup"))
        .map_err(|e| format!("reading the cgroup of pid {init_pid}: {e}"))?;
    let Some(have) = own.lines().find_map(|l| l.strip_prefix("0::")) else {
        return Ok(None);
    };
    let have = root.join(have.trim_start_matches('/'));
    let want = super::cgroups::container_cgroup(driver, parent, id)
        .map(|rel| root.join(rel))
        .ok_or_else(|| format!("no cgroup for container {id} under {parent:?}"))?;
    if have == want {
        return Ok(None);
    }
    match std::fs::create_dir(&want) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            return Err(format!("creating {}: {e}", want.display()));
        }
        _ => {}
    }
    // The processes run meanwhile: one that exits is no error, and one forked by a process not
    // moved yet lands in the old cgroup, so pass again until it is empty.
    for _ in 0..MOVE_PASSES {
        let procs = std::fs::read_to_string(have.join("cgroup.procs"))
            .map_err(|e| format!("reading {}/cgroup.procs: {e}", have.display()))?;
        if procs.trim().is_empty() {
            break;
        }
        for pid in procs.split_whitespace() {
            // One pid per write: cgroup.procs takes one.
            match std::fs::write(want.join("cgroup.procs"), pid) {
                Err(e) if e.raw_os_error() != Some(libc::ESRCH) => {
                    return Err(format!("moving pid {pid} to {}: {e}", want.display()));
                }
                _ => {}
            }
        }
    }
    let _ = std::fs::remove_dir(&have);
    Ok(Some((have, want)))
}

/// Removes a checkpoint's staging directories however the checkpoint ends.
struct Staging(Vec<PathBuf>);

impl Drop for Staging {
    fn drop(&mut self) {
        let dirs = std::mem::take(&mut self.0);
        let remove = move || {
            for d in &dirs {
                let _ = std::fs::remove_dir_all(d);
            }
        };
        // CRIU's images can be large: removed off the async workers.
        match tokio::runtime::Handle::try_current() {
            Ok(h) => drop(h.spawn_blocking(remove)),
            Err(_) => remove(),
        }
    }
}

/// The overlay upper directory (the container's own changes) of a snapshot's mount.
fn upper_dir(m: &minicri_snapshotter::Mount) -> Option<PathBuf> {
    (m.fstype == "overlay")
        .then(|| {
            m.options
                .iter()
                .find_map(|o| o.strip_prefix("upperdir=").map(PathBuf::from))
        })
        .flatten()
}

impl PodService {
    /// After the shim of restored container `rec` reported it running (as `pid`): its
    /// processes moved into the container's own cgroup ([`adopt_restored`]; logged either
    /// way), and the unpacked CRIU images removed in the background (CRIU is done with them:
    /// they need not take the space until the teardown).
    pub(super) async fn settle_restored(
        &self,
        rec: &super::store::ContainerRecord,
        pid: i32,
    ) -> Result<()> {
        let id = rec.id.clone();
        let (driver, parent) = (self.cgroup_driver, self.cgroup_parent(rec));
        let cid = id.clone();
        let adopted = blocking(move || Ok(adopt_restored(driver, &parent, &cid, pid))).await?;
        match adopted {
            Ok(Some((from, to))) => {
                tracing::info!(container = %id, from = %from.display(), to = %to.display(), "restored processes moved to the container's cgroup")
            }
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(container = %id, error = %e, "the restored processes stay in the cgroup CRIU put them in")
            }
        }
        let unpacked = self.container_dir(&id).join(RESTORE_DIR);
        tokio::task::spawn_blocking(move || std::fs::remove_dir_all(unpacked));
        Ok(())
    }
    /// CheckpointContainer: `location` is where the archive goes (an absolute path whose
    /// directory exists; `crictl checkpoint --export`); `timeout` in seconds, 0 for
    /// [`DEFAULT_CHECKPOINT_TIMEOUT`]. Runs in a task of its own: a client that hangs up does
    /// not cut a dump short.
    pub async fn checkpoint_container(
        self: &Arc<Self>,
        id: String,
        location: String,
        timeout: i64,
    ) -> Result<()> {
        let svc = self.clone();
        tokio::spawn(async move { svc.checkpoint_inner(&id, &location, timeout).await })
            .await
            .map_err(|e| Error::Internal(format!("CheckpointContainer task: {e}")))?
    }

    /// CheckpointContainer's request checked before the container is touched: the archive's
    /// path (absolute, in a directory), the timeout (0: the default), the container running,
    /// CRIU working here, and the writable layer's directory the rootfs diff is taken from.
    async fn checkpoint_request(
        &self,
        id: &str,
        location: &str,
        timeout: i64,
    ) -> Result<(PathBuf, Duration, PathBuf)> {
        let out = PathBuf::from(location);
        if location.is_empty() || !out.is_absolute() || out.file_name().is_none() {
            return Err(Error::InvalidArgument(format!(
                "CheckpointContainer location {location:?} must be an absolute path to the \
                 archive to write (crictl checkpoint --export=FILE)"
            )));
        }
        let timeout = match timeout {
            t if t < 0 => {
                return Err(Error::InvalidArgument(format!(
                    "CheckpointContainer timeout {t} is negative"
                )));
            }
            0 => DEFAULT_CHECKPOINT_TIMEOUT,
            t => Duration::from_secs(t as u64),
        };
        let rec = self.container_record(id)?;
        if rec.state != ContainerState::Running {
            return Err(Error::FailedPrecondition(format!(
                "container {id} is {:?}, not running: only a running container can be \
                 checkpointed",
                rec.state
            )));
        }
        if let Err(reason) = self.criu.ready().await {
            return Err(Error::FailedPrecondition(format!(
                "cannot checkpoint container {id}: CRIU does not work on this host: {reason}; \
                 the container was not touched"
            )));
        }
        // The writable layer's changes go into the archive: with the copy backend there is no
        // layer apart from the image's files to take them from.
        let upper = self
            .images
            .mounts(id)
            .ok()
            .as_ref()
            .and_then(upper_dir)
            .ok_or_else(|| {
                Error::FailedPrecondition(format!(
                    "cannot checkpoint container {id}: its rootfs is not an overlay (the \
                     snapshotter's copy backend), so its changes cannot be told apart from its \
                     image's files; the container was not touched"
                ))
            })?;
        // The kubelet's filesystem, whatever it is: off the async workers.
        let parent = out.parent().unwrap_or(Path::new("/")).to_path_buf();
        let p = parent.clone();
        if !blocking(move || Ok(p.is_dir())).await? {
            return Err(Error::InvalidArgument(format!(
                "CheckpointContainer location {location:?}: {} is not a directory",
                parent.display()
            )));
        }
        Ok((out, timeout, upper))
    }

    async fn checkpoint_inner(
        self: &Arc<Self>,
        id: &str,
        location: &str,
        timeout: i64,
    ) -> Result<()> {
        let (out, timeout, upper) = self.checkpoint_request(id, location, timeout).await?;

        let _guard = self.store.op_lock(id).await;
        let rec = self.container_record(id)?;
        if rec.state != ContainerState::Running {
            return Err(Error::FailedPrecondition(format!(
                "container {id} is {:?}, not running",
                rec.state
            )));
        }
        let base = self
            .state_dir
            .join("checkpoints")
            .join(format!("{id}.{}", now_ns()));
        let (staging, work) = (base.join("archive"), base.join("work"));
        let _cleanup = Staging(vec![base.clone()]);
        let images = staging.join(archive::CHECKPOINT_DIR);
        let dirs = [images.clone(), work.clone()];
        blocking(move || {
            for d in &dirs {
                std::fs::create_dir_all(d)
                    .map_err(|e| Error::Internal(format!("creating {}: {e}", d.display())))?;
            }
            Ok(())
        })
        .await?;
        let runtime = self.runtime(&rec.runtime_handler)?;
        match tokio::time::timeout(timeout, runtime.checkpoint(id, &images, &work)).await {
            Err(_) => {
                return Err(Error::DeadlineExceeded(format!(
                    "checkpoint of container {id} did not finish within {timeout:?}; it was \
                     cancelled and the container goes on running"
                )));
            }
            Ok(Err(e)) => {
                let criu = crate::checkpoint::criu::log_reason(&work.join(archive::DUMP_LOG))
                    .map(|r| format!("; CRIU: {r}"))
                    .unwrap_or_default();
                return Err(Error::Internal(format!(
                    "checkpoint of container {id}: {e}{criu}"
                )));
            }
            Ok(Ok(())) => {}
        }
        let config = rec.config();
        let meta = ConfigDump {
            id: id.to_string(),
            name: config.metadata.map(|m| m.name).unwrap_or_default(),
            rootfs_image: rec.image_id.clone(),
            rootfs_image_ref: rec.image_id.clone(),
            rootfs_image_name: rec.image.clone(),
            oci_runtime: runtime
                .command()
                .binary
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            created_time: archive::rfc3339(rec.created_at),
            checkpointed_at: archive::rfc3339(now_ns()),
            restored_at: archive::zero_time(),
            restored: false,
        };
        let bundle = rec.bundle.clone();
        blocking(move || {
            let io = |what: &str, e: std::io::Error| Error::Internal(format!("{what}: {e}"));
            std::fs::copy(bundle.join("config.json"), staging.join(archive::SPEC_DUMP))
                .map_err(|e| io("copying the container's spec", e))?;
            let meta = serde_json::to_vec_pretty(&meta)
                .map_err(|e| Error::Internal(format!("config.dump: {e}")))?;
            std::fs::write(staging.join(archive::CONFIG_DUMP), meta)
                .map_err(|e| io("writing config.dump", e))?;
            let deleted = archive::write_rootfs_diff(&upper, &staging.join(archive::ROOTFS_DIFF))
                .map_err(|e| io("writing the rootfs diff", e))?;
            let deleted = serde_json::to_vec(&deleted)
                .map_err(|e| Error::Internal(format!("deleted.files: {e}")))?;
            std::fs::write(staging.join(archive::DELETED_FILES), deleted)
                .map_err(|e| io("writing deleted.files", e))?;
            let _ = std::fs::copy(
                work.join(archive::DUMP_LOG),
                staging.join(archive::DUMP_LOG),
            );
            archive::write_archive(&staging, &out)
                .map_err(|e| io(&format!("writing the archive {}", out.display()), e))
        })
        .await?;
        tracing::info!(container = %id, archive = %location, "container checkpointed");
        Ok(())
    }

    /// For CreateContainer: when `config`'s image names a checkpoint archive, the archive's
    /// path, the image to create the container from, and `config` with the checkpointed
    /// process (command, environment, working directory, terminal) of its `spec.dump`.
    pub(super) async fn restore_source(
        &self,
        config: &mut cri::ContainerConfig,
    ) -> Result<Option<(PathBuf, String)>> {
        let image = config
            .image
            .as_ref()
            .map(|i| i.image.clone())
            .unwrap_or_default();
        let dirs = self.restore_dirs.clone();
        let found = blocking(move || Ok(archive::archive_path(&image, &dirs))).await?;
        let Some(path) = found else {
            return Ok(None);
        };
        let p = path.clone();
        let md = blocking(move || {
            archive::read_metadata(&p).map_err(|e| Error::InvalidArgument(e.to_string()))
        })
        .await?;
        let image = [&md.config.rootfs_image_name, &md.config.rootfs_image_ref]
            .into_iter()
            .find(|n| !n.is_empty() && self.images.image(n).ok().flatten().is_some())
            .cloned()
            .ok_or_else(|| {
                Error::NotFound(format!(
                    "the image of checkpoint archive {} ({:?}, {:?}) is not on this node: pull it \
                     first",
                    path.display(),
                    md.config.rootfs_image_name,
                    md.config.rootfs_image_ref
                ))
            })?;
        if let Some(p) = md.spec.process() {
            config.command = p.args().clone().unwrap_or_default();
            config.args = Vec::new();
            config.envs = p
                .env()
                .iter()
                .flatten()
                .map(|kv| {
                    let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                    cri::KeyValue {
                        key: k.into(),
                        value: v.into(),
                    }
                })
                .collect();
            config.working_dir = p.cwd().display().to_string();
            config.tty = p.terminal().unwrap_or(false);
        }
        Ok(Some((path, image)))
    }

    /// For CreateContainer of a restore: unpacks the archive into the container's directory
    /// `dir` and applies its rootfs changes to the mounted `rootfs`. Returns the CRIU images'
    /// directory. `dir` is removed by the create's undo.
    pub(super) async fn unpack_restore(
        &self,
        archive_path: PathBuf,
        dir: PathBuf,
        rootfs: PathBuf,
    ) -> Result<PathBuf> {
        let limits = self.unpack_limits.clone();
        blocking(move || {
            let un = dir.join(RESTORE_DIR);
            std::fs::create_dir_all(&un)
                .map_err(|e| Error::Internal(format!("creating {}: {e}", un.display())))?;
            let bad = |e: archive::ArchiveError| Error::InvalidArgument(e.to_string());
            archive::unpack(&archive_path, &un, &limits).map_err(bad)?;
            archive::apply_rootfs_changes(&archive_path, &un, &rootfs, &limits).map_err(bad)?;
            Ok(un.join(archive::CHECKPOINT_DIR))
        })
        .await
    }
}

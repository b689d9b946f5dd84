//! What follows a container's exit: the task that waits on its shim ([`PodService::watch_exit`],
//! started by StartContainer or, after a restart, by [`PodService::open`]), the exit recorded
//! once (OOMKilled, Completed or Error, judged from the cgroup's counters), the container deleted
//! from its OCI runtime at once, and the teardown of what RemoveContainer leaves in the
//! background (snapshot, mounts, bundle, logs stay the kubelet's).

use std::sync::Arc;

use super::store::{ContainerRecord, ContainerState};
use super::{PodService, blocking, now_ns};
use crate::error::{Error, Result};
use crate::shim::{ExitRecord, ShimHandle};

impl PodService {
    /// Records the exit of a container when its shim reports it.
    pub(crate) fn watch_exit(self: &Arc<Self>, id: String, shim: ShimHandle) {
        let svc = self.clone();
        tokio::spawn(async move {
            let exit = svc.monitors.wait(&shim).await;
            {
                // After a stop that is recording the same exit (it holds the lock while it
                // waits), so the exit is judged once.
                let _guard = svc.store.op_lock(&id).await;
                match exit {
                    Ok(exit) => svc.record_exit(&id, &exit).await,
                    Err(e) => svc.record_lost(&id, &e.to_string()),
                }
            }
            svc.delete_exited(&id).await;
        });
    }

    /// Deletes an exited container from its OCI runtime at once (its state directory and
    /// cgroup go; the record, logs and rootfs stay until RemoveContainer), so that RemoveContainer
    /// has no runtime call to wait for. A failure leaves it to RemoveContainer.
    pub(crate) async fn delete_exited(&self, id: &str) {
        let _guard = self.store.op_lock(id).await;
        let Some(rec) = self.store.container(id) else {
            return;
        };
        if rec.state != ContainerState::Exited || rec.runtime_deleted {
            return;
        }
        let deleted = match self.runtime(&rec.runtime_handler) {
            Ok(runtime) => runtime.delete(id, true).await.map_err(Error::from),
            Err(e) => Err(e),
        };
        match deleted {
            Ok(()) => {
                if let Err(e) = self
                    .store
                    .update_container(id, |r| r.runtime_deleted = true)
                {
                    tracing::debug!(container = %id, error = %e, "recording the runtime delete");
                }
            }
            Err(e) => {
                tracing::debug!(container = %id, error = %e, "delete after exit; RemoveContainer retries")
            }
        }
    }

    /// Marks a container exited with `exit` (once; later calls change nothing), finding out off
    /// the async workers whether the OOM killer ended it
    /// ([`super::cgroups::oom_killed_after_exit`]).
    pub(crate) async fn record_exit(&self, id: &str, exit: &ExitRecord) {
        // Recorded already (a stop and the exit watch both report it), or removed since:
        // nothing to ask.
        let Some(c) = self
            .store
            .container(id)
            .filter(|c| c.state != ContainerState::Exited)
        else {
            return;
        };
        let (driver, parent, e) = (self.cgroup_driver, self.cgroup_parent(&c), exit.clone());
        let oom = tokio::task::spawn_blocking(move || {
            super::cgroups::oom_killed_after_exit(driver, &parent, &c.id, &e)
        })
        .await
        .unwrap_or(false);
        self.record_exit_as(id, exit, oom);
    }

    /// The cgroup parent of the container's sandbox ("" when the sandbox names none or is gone).
    pub(crate) fn cgroup_parent(&self, c: &ContainerRecord) -> String {
        self.store
            .sandbox(&c.sandbox_id)
            .and_then(|s| s.config().linux)
            .map(|l| l.cgroup_parent)
            .unwrap_or_default()
    }

    pub(crate) fn record_exit_as(&self, id: &str, exit: &ExitRecord, oom: bool) {
        let r = self.store.update_container(id, |r| {
            if r.state == ContainerState::Exited {
                return;
            }
            r.state = ContainerState::Exited;
            r.exit_code = exit.exit_code;
            r.finished_at = exit.exited_at_ns;
            r.reason = if oom {
                "OOMKilled"
            } else if exit.exit_code == 0 {
                "Completed"
            } else {
                "Error"
            }
            .into();
        });
        if let Err(e) = r {
            tracing::warn!(container = %id, error = %e, "cannot record the exit");
        }
    }

    pub(super) fn record_lost(&self, id: &str, why: &str) {
        let _ = self.store.update_container(id, |r| {
            if r.state == ContainerState::Exited {
                return;
            }
            r.state = ContainerState::Exited;
            r.exit_code = 255;
            r.finished_at = now_ns();
            r.reason = "Unknown".into();
            r.message = why.to_string();
        });
    }

    /// Tears down a removed container ([`Store::begin_removal`]): deletes it from its runtime,
    /// lets its shim go, unmounts its rootfs and image volumes, removes its snapshots and
    /// directories, lets go of the images its volumes use, then removes its record. Every step is idempotent, so a teardown cut short is simply run again; one that
    /// another caller finished meanwhile is nothing to do.
    pub(crate) async fn teardown_container(&self, id: &str) -> Result<()> {
        let _guard = self.store.op_lock(id).await;
        let Some(rec) = self.store.removal(id) else {
            return Ok(());
        };
        if !rec.runtime_deleted {
            self.runtime(&rec.runtime_handler)?.delete(id, true).await?;
        }
        if let Some(shim) = &rec.shim {
            self.reap_shim(shim).await;
        }
        let images = self.images.clone();
        let (rootfs, key) = (rec.rootfs.clone(), id.to_string());
        let idmap = self.idmap_dir(id);
        let (dir, bundle) = (self.container_dir(id), rec.bundle.clone());
        let volumes = rec.image_volumes.clone();
        blocking(move || {
            super::unmount_all(&rootfs)?;
            // Before the directory holding them is removed: it is removed recursively.
            super::imagevol::unmount(&volumes)?;
            crate::spec::userns::remove_idmapped(&idmap)?;
            images.remove_snapshot(&key)?;
            super::remove_dir(&dir)?;
            super::remove_dir(&bundle)
        })
        .await?;
        self.release_image_volumes(id, &rec.image_volumes).await?;
        self.store.finish_removal(id)
    }

    /// Finishes the teardown of every removed container of sandbox `sandbox_id` (all of them
    /// when `None`), in the background ones' stead if they are still running.
    pub(crate) async fn finish_teardowns(&self, sandbox_id: Option<&str>) -> Result<()> {
        for rec in self.store.removals() {
            if sandbox_id.is_none_or(|s| s == rec.sandbox_id) {
                self.teardown_container(&rec.id).await?;
            }
        }
        Ok(())
    }
}

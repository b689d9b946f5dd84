//! Multi-step operations (RunPodSandbox, CreateContainer, StartContainer) and how they are
//! undone: each step is recorded as an [`Undo`] *before* it is taken, in a [`Journal`] kept on
//! disk under `<state>/pods/inflight/`. When a later step fails, the recorded steps are undone
//! in reverse order; when the daemon is killed half-way, the next start finds the journal and
//! undoes them then ([`PodService::finish_interrupted`]), so a sandbox or container is either
//! whole and recorded or gone, with nothing of it left (mounts, network namespaces, CNI
//! attachments, shims, OCI runtime containers, snapshots, directories).
//!
//! Every undo step is idempotent and succeeds when its step was never taken (the journal is
//! written ahead of the step). A journal whose operation finished (its record is there and says
//! so) is discarded unread: the record is written first, the journal removed after it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{PodService, blocking, remove_dir, unmount_all};
use crate::cni::PodNetwork;
use crate::error::{Error, Result};
use crate::shim::ShimHandle;

/// One step of a multi-step operation, undone in reverse order when a later step fails or the
/// daemon dies before the operation ends.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum Undo {
    ReleaseName {
        name: String,
        id: String,
    },
    RemoveNetns(PathBuf),
    CniTeardown(PodNetwork),
    SandboxFiles(PathBuf),
    RemoveDir(PathBuf),
    /// The container's shim killed (with a `create` it may still be running), then `runtime
    /// delete --force`. Without a handle, the shim is found from the bundle's `shim.pid`.
    DeleteContainer {
        id: String,
        shim: Option<ShimHandle>,
        /// The runtime handler it was created with (journals from before handlers: the
        /// default).
        #[serde(default)]
        handler: String,
    },
    Unmount(PathBuf),
    RemoveSnapshot(String),
    /// Idmapped mounts of a container in a pod user namespace, and their directory
    /// (`crate::spec::userns::remove_idmapped`: never a recursive removal).
    RemoveIdmapped(PathBuf),
    /// The container no longer uses the image as a volume (`super::imagevol`).
    ReleaseImageVolume {
        image: minicri_store::Digest,
        container: String,
    },
    /// A cgroup file of a pod's cgroup gets back the value it had (`super::resize`).
    RestoreCgroupFile {
        path: PathBuf,
        value: String,
    },
    /// The sandbox record gets back the resources it recorded (`super::resize`).
    SandboxResources {
        id: String,
        #[serde(with = "super::store::hex_bytes")]
        old: std::sync::Arc<[u8]>,
    },
}

/// Which operation a journal belongs to, and the object it makes (once its id is chosen).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Operation {
    RunPodSandbox,
    CreateContainer,
    StartContainer,
    UpdatePodSandboxResources,
}

impl Operation {
    fn name(self) -> &'static str {
        match self {
            Operation::RunPodSandbox => "RunPodSandbox",
            Operation::CreateContainer => "CreateContainer",
            Operation::StartContainer => "StartContainer",
            Operation::UpdatePodSandboxResources => "UpdatePodSandboxResources",
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct JournalFile {
    operation: Operation,
    /// The sandbox or container the operation makes or starts.
    subject: Option<String>,
    steps: Vec<Undo>,
}

/// The undo steps of one operation in flight, mirrored to `<state>/pods/inflight/<n>.json`
/// (written atomically and fsynced at each step, removed when the operation ends).
pub(crate) struct Journal {
    path: PathBuf,
    file: JournalFile,
}

impl Journal {
    fn new(dir: &Path, operation: Operation) -> Result<Journal> {
        Ok(Journal {
            path: dir.join(format!("{}.json", crate::ids::random_hex::<8>()?)),
            file: JournalFile {
                operation,
                subject: None,
                steps: Vec::new(),
            },
        })
    }

    /// Names the sandbox or container the operation makes (before any step that touches it).
    pub(crate) fn subject(&mut self, id: &str) -> Result<()> {
        self.file.subject = Some(id.to_string());
        self.write()
    }

    /// Records `step` before it is taken.
    pub(crate) fn push(&mut self, step: Undo) -> Result<()> {
        self.file.steps.push(step);
        self.write()
    }

    fn write(&self) -> Result<()> {
        let bytes = serde_json::to_vec(&self.file)
            .map_err(|e| Error::Internal(format!("encoding the undo journal: {e}")))?;
        minicri_store::fsutil::off_async(|| {
            minicri_snapshotter::write_atomic(&self.path, &bytes, 0o600)
        })
        .map_err(|e| Error::Internal(format!("writing {}: {e}", self.path.display())))
    }

    /// The operation ended (done, or undone): the file goes.
    fn close(self) {
        match minicri_store::fsutil::off_async(|| std::fs::remove_file(&self.path)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot remove an undo journal");
            }
            _ => {}
        }
    }
}

/// How long the undo of one interrupted operation may take at start (see
/// [`PodService::finish_interrupted`]).
pub const STARTUP_UNDO_LIMIT: std::time::Duration = std::time::Duration::from_secs(120);

/// How often networks of sandboxes that were never recorded are tried again.
pub const NETWORK_SWEEP_INTERVAL: std::time::Duration = std::time::Duration::from_secs(300);

impl PodService {
    fn journal_dir(&self) -> PathBuf {
        self.state_dir.join("pods/inflight")
    }

    /// Runs a multi-step operation in its own task, so that a client hanging up does not stop it
    /// half-way. `steps` records how to undo each step in the journal before taking it; when it
    /// fails, those run in reverse and its error is returned.
    pub(crate) async fn undoable<T, F>(
        self: &Arc<Self>,
        operation: Operation,
        steps: F,
    ) -> Result<T>
    where
        T: Send + 'static,
        F: for<'a> FnOnce(
                Arc<PodService>,
                &'a mut Journal,
            ) -> futures::future::BoxFuture<'a, Result<T>>
            + Send
            + 'static,
    {
        let svc = self.clone();
        let dir = self.journal_dir();
        tokio::spawn(async move {
            let mut journal = Journal::new(&dir, operation)?;
            let result = steps(svc.clone(), &mut journal).await;
            if result.is_err() {
                svc.undo(std::mem::take(&mut journal.file.steps)).await;
            }
            journal.close();
            result
        })
        .await
        .map_err(|e| Error::Internal(format!("{} task: {e}", operation.name())))?
    }

    /// Undoes steps, last first; failures are logged (the original error is what the caller
    /// reports).
    pub(crate) async fn undo(&self, steps: Vec<Undo>) {
        for step in steps.into_iter().rev() {
            if let Err(e) = self.undo_one(step).await {
                tracing::warn!(error = %e, "rollback step failed");
            }
        }
    }

    async fn undo_one(&self, step: Undo) -> Result<()> {
        match step {
            Undo::ReleaseName { name, id } => self.store.release(&name, &id),
            Undo::RemoveNetns(p) => blocking(move || Ok(crate::netns::remove(&p)?)).await?,
            Undo::CniTeardown(pod) => {
                let cni = self.cni.clone();
                tokio::spawn(async move { cni.teardown(&pod).await })
                    .await
                    .map_err(|e| Error::Internal(e.to_string()))??
            }
            // Mount tables are read and trees removed: off the async workers, as every step
            // of an undo that touches files.
            Undo::SandboxFiles(dir) => {
                blocking(move || Ok(crate::spec::SandboxFiles::cleanup(&dir)?)).await?
            }
            Undo::RemoveDir(d) => blocking(move || remove_dir(&d)).await?,
            Undo::DeleteContainer { id, shim, handler } => {
                let shim = shim.or_else(|| self.monitors.load(&id, &self.bundle_dir(&id)).ok());
                if let Some(s) = &shim {
                    // A shim whose `create` has not returned takes the runtime process with it.
                    self.monitors.kill_group(s);
                }
                self.runtime(&handler)?.delete(&id, true).await?;
                if let Some(s) = shim {
                    self.reap_shim(&s).await;
                }
            }
            Undo::Unmount(p) => blocking(move || unmount_all(&p)).await?,
            Undo::RemoveIdmapped(p) => {
                blocking(move || Ok(crate::spec::userns::remove_idmapped(&p)?)).await?
            }
            Undo::ReleaseImageVolume { image, container } => {
                let images = self.images.clone();
                blocking(move || images.release_volume(&image, &container)).await?
            }
            Undo::RestoreCgroupFile { path, value } => {
                blocking(move || match super::cgroups::write_file(&path, &value) {
                    // The cgroup went with its pod.
                    Err(_) if !path.exists() => Ok(()),
                    r => r,
                })
                .await?
            }
            Undo::SandboxResources { id, old } => {
                let store = &self.store;
                let _ = store
                    .update_sandbox(&id, |r| r.resources = old)
                    .map_err(|e| {
                        Error::Internal(format!("restoring the resources of {id}: {e}"))
                    })?;
            }
            Undo::RemoveSnapshot(key) => {
                let images = self.images.clone();
                blocking(move || images.remove_snapshot(&key)).await?
            }
        }
        Ok(())
    }

    /// Keeps tearing down, now and every [`NETWORK_SWEEP_INTERVAL`], the networks CNI added for
    /// sandboxes that were never recorded and whose undo could not remove them
    /// ([`crate::cni::CniManager::sweep`]).
    pub fn sweep_networks(self: &Arc<Self>) {
        let svc = self.clone();
        tokio::spawn(async move {
            loop {
                let store = &svc.store;
                svc.cni.sweep(|id| store.knows_sandbox(id)).await;
                tokio::time::sleep(NETWORK_SWEEP_INTERVAL).await;
            }
        });
    }

    /// Undoes the operations a killed daemon left half-done (their journals), at start, before
    /// the CRI is served. An operation whose record says it finished is left as it is. An undo
    /// that takes longer than [`STARTUP_UNDO_LIMIT`] (a runtime call that hangs) is left to the
    /// next start, its journal kept: the node's runtime must not stay down for it.
    pub async fn finish_interrupted(self: &Arc<Self>) {
        self.finish_interrupted_within(STARTUP_UNDO_LIMIT).await
    }

    /// [`Self::finish_interrupted`], each undo given at most `limit`.
    pub(crate) async fn finish_interrupted_within(self: &Arc<Self>, limit: std::time::Duration) {
        let dir = self.journal_dir();
        let entries = match std::fs::read_dir(&dir) {
            Ok(rd) => rd.flatten().map(|e| e.path()).collect::<Vec<_>>(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot read the undo journals");
                return;
            }
        };
        for path in entries {
            if path.extension().is_none_or(|x| x != "json") {
                // A temporary file of a write the kill interrupted.
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let file: JournalFile = match std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
            {
                Ok(f) => f,
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "unreadable undo journal left as it is");
                    continue;
                }
            };
            let finished = file
                .subject
                .as_deref()
                .is_some_and(|id| match file.operation {
                    Operation::RunPodSandbox => self.store.sandbox(id).is_some(),
                    Operation::CreateContainer => self.store.container(id).is_some(),
                    Operation::StartContainer => self
                        .store
                        .container(id)
                        .is_none_or(|c| c.state != super::store::ContainerState::Created),
                    // Its journal is removed once the record says the new resources: one left
                    // behind is an update cut short, whose files and record go back.
                    Operation::UpdatePodSandboxResources => false,
                });
            if !finished {
                tracing::warn!(
                    operation = file.operation.name(),
                    subject = file.subject.as_deref().unwrap_or("-"),
                    steps = file.steps.len(),
                    "undoing an operation the daemon was stopped in"
                );
                if tokio::time::timeout(limit, self.undo(file.steps))
                    .await
                    .is_err()
                {
                    tracing::error!(
                        operation = file.operation.name(),
                        subject = file.subject.as_deref().unwrap_or("-"),
                        path = %path.display(),
                        "undoing an interrupted operation took longer than {limit:?}: serving \
                         anyway; the journal stays for the next start"
                    );
                    continue;
                }
            }
            if let Err(e) = std::fs::remove_file(&path) {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove an undo journal");
            }
        }
    }
}

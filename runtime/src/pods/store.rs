//! Records of pod sandboxes and containers: kept in memory for the kubelet's relists (every
//! second, so they must be cheap) and persisted as one JSON file per object under
//! `<state>/pods/{sandboxes,containers}/<id>.json`, each written by atomic rename.
//!
//! Invariants:
//! - the in-memory map and the file agree after every successful [`Store::put_sandbox`] /
//!   [`Store::put_container`]; a record is only in memory once its file is written;
//! - a name (`<name>_<namespace>_<uid>_<attempt>` for sandboxes, `<name>_<sandbox name>_<sandbox
//!   namespace>_<sandbox uid>_<attempt>` for containers) is reserved by at most one id, from
//!   [`Store::reserve`] until [`Store::release`] (CRI: a duplicate name is an error until the old
//!   object is removed);
//! - the CRI configs are kept as their protobuf encoding (hex in the JSON), so labels and
//!   annotations round-trip exactly; in memory the encoding is shared (copying a record copies
//!   no config), and lists decode only the metadata, labels and annotations of it
//!   ([`ContainerSummary`], [`SandboxSummary`]): a config's envs and mounts can be megabytes;
//! - a removed container's record moves (one rename) to `<state>/pods/removing/` while its
//!   files, mounts and runtime state are torn down in the background, and is deleted from there
//!   once they are gone ([`Store::begin_removal`], [`Store::finish_removal`]); a teardown cut
//!   short by a crash is found there at the next start. The record has left every listing and
//!   its name is free from the rename on.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use minicri_proto::runtime::v1 as cri;
use prost::Message;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::shim::ShimHandle;
use minicri_snapshotter::{sync_dir, write_atomic};
use minicri_store::Digest;
use minicri_store::fsutil::off_async;

/// `SANDBOX_READY` / `SANDBOX_NOTREADY`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SandboxState {
    Ready,
    NotReady,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub id: String,
    /// The reserved name.
    pub name: String,
    #[serde(with = "hex_bytes")]
    pub config: Arc<[u8]>,
    pub runtime_handler: String,
    pub created_at: i64,
    pub state: SandboxState,
    /// The pinned network namespace (`None` with host network, or once removed).
    pub netns: Option<PathBuf>,
    /// The pod IPs from the CNI result, primary first.
    pub ips: Vec<String>,
    /// The infra process's shim (`None` once it is deleted).
    pub shim: Option<ShimHandle>,
    /// The infra process's pid, kept after stop for namespace paths in status.
    pub infra_pid: i32,
    /// Whether the CNI ADD succeeded and no DEL has yet.
    pub network_attached: bool,
    /// The last UpdatePodSandboxResources request applied to the pod's cgroup (encoded, without
    /// its id); empty before any (`super::resize`).
    #[serde(default, with = "hex_bytes")]
    pub resources: Arc<[u8]>,
}

impl SandboxRecord {
    pub fn config(&self) -> cri::PodSandboxConfig {
        cri::PodSandboxConfig::decode(&*self.config).unwrap_or_default()
    }

    /// The config's metadata, labels and annotations, without decoding the rest.
    pub fn summary(&self) -> SandboxSummary {
        SandboxSummary::decode(&*self.config).unwrap_or_default()
    }
}

/// The fields of a `PodSandboxConfig` that lists, lookups and container stats read; decoding it
/// skips the other fields' bytes. Tags as in the CRI's `api.proto`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SandboxSummary {
    #[prost(message, optional, tag = "1")]
    pub metadata: Option<cri::PodSandboxMetadata>,
    #[prost(map = "string, string", tag = "6")]
    pub labels: HashMap<String, String>,
    #[prost(map = "string, string", tag = "7")]
    pub annotations: HashMap<String, String>,
    #[prost(message, optional, tag = "8")]
    pub linux: Option<LinuxSandboxSummary>,
}

/// Of a `LinuxPodSandboxConfig`: its `cgroup_parent`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LinuxSandboxSummary {
    #[prost(string, tag = "1")]
    pub cgroup_parent: String,
}

/// `CONTAINER_CREATED` / `RUNNING` / `EXITED` / `UNKNOWN`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ContainerState {
    Created,
    Running,
    Exited,
    Unknown,
}

impl ContainerState {
    pub fn to_cri(self) -> cri::ContainerState {
        match self {
            ContainerState::Created => cri::ContainerState::ContainerCreated,
            ContainerState::Running => cri::ContainerState::ContainerRunning,
            ContainerState::Exited => cri::ContainerState::ContainerExited,
            ContainerState::Unknown => cri::ContainerState::ContainerUnknown,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ContainerRecord {
    pub id: String,
    pub sandbox_id: String,
    pub name: String,
    #[serde(with = "hex_bytes")]
    pub config: Arc<[u8]>,
    /// The image as the request named it.
    pub image: String,
    /// The image id (config digest).
    pub image_id: String,
    pub created_at: i64,
    pub started_at: i64,
    pub finished_at: i64,
    pub exit_code: i32,
    pub reason: String,
    pub message: String,
    pub state: ContainerState,
    pub log_path: Option<PathBuf>,
    pub rootfs: PathBuf,
    pub bundle: PathBuf,
    /// Signal StopContainer sends first (the image's StopSignal, else SIGTERM).
    pub stop_signal: i32,
    pub shim: Option<ShimHandle>,
    pub pid: i32,
    /// uid, gid and supplementary groups of the container's process (ContainerStatus `user`);
    /// absent in records written before it existed.
    #[serde(default)]
    pub user: Option<oci_spec::runtime::User>,
    /// Its pod's runtime handler (`""`: the default; records written before handlers existed
    /// have none, and ran under the default).
    #[serde(default)]
    pub runtime_handler: String,
    /// The OCI runtime's container was deleted once it exited (RemoveContainer then has no
    /// runtime call left to make).
    #[serde(default)]
    pub runtime_deleted: bool,
    /// The images it mounts as volumes, mounted and held until its teardown.
    #[serde(default)]
    pub image_volumes: Vec<ImageVolume>,
    /// A container created from a checkpoint archive: the CRIU images StartContainer restores
    /// it from (`runc restore` instead of `create` + `start`); cleared once it ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_from: Option<PathBuf>,
}

/// An image a container mounts as a volume, as the container's record keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageVolume {
    /// The mount's index in the container config's `mounts`.
    pub mount: usize,
    /// The image's id (`sha256:…`).
    pub image_id: Digest,
    /// The view snapshot of the image's top layer.
    pub snapshot: String,
    /// Where the view is mounted on the host.
    pub root: PathBuf,
    /// What the container binds: `root`, or the bind mount of the `image_sub_path`.
    pub source: PathBuf,
}

impl ContainerRecord {
    pub fn config(&self) -> cri::ContainerConfig {
        cri::ContainerConfig::decode(&*self.config).unwrap_or_default()
    }

    /// The config's metadata, labels and annotations, without decoding the rest.
    pub fn summary(&self) -> ContainerSummary {
        ContainerSummary::decode(&*self.config).unwrap_or_default()
    }
}

/// The fields of a `ContainerConfig` that lists and stats read; decoding it skips the other
/// fields' bytes. Tags as in the CRI's `api.proto`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerSummary {
    #[prost(message, optional, tag = "1")]
    pub metadata: Option<cri::ContainerMetadata>,
    #[prost(map = "string, string", tag = "9")]
    pub labels: HashMap<String, String>,
    #[prost(map = "string, string", tag = "10")]
    pub annotations: HashMap<String, String>,
}

pub(crate) mod hex_bytes {
    use std::sync::Arc;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
        let mut out = String::with_capacity(b.len() * 2);
        for x in b {
            out.push_str(&format!("{x:02x}"));
        }
        s.serialize_str(&out)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Arc<[u8]>, D::Error> {
        let s = String::deserialize(d)?;
        if s.len() % 2 != 0 || !s.is_ascii() {
            return Err(serde::de::Error::custom("not hex: odd length or not ASCII"));
        }
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(serde::de::Error::custom))
            .collect()
    }
}

#[derive(Default)]
struct Inner {
    sandboxes: HashMap<String, SandboxRecord>,
    containers: HashMap<String, ContainerRecord>,
    /// Reserved name → id.
    names: HashMap<String, String>,
    /// Removed containers whose teardown has not finished, by id.
    removing: HashMap<String, ContainerRecord>,
}

/// A container lifecycle change, as GetContainerEvents reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContainerEventKind {
    Created,
    Started,
    Stopped,
    Deleted,
}

/// Emitted by the store as records change, so that every path (RPCs, exit watchers, restart
/// recovery) reports its transitions.
#[derive(Debug, Clone)]
pub struct ContainerEvent {
    pub container_id: String,
    pub sandbox_id: String,
    pub kind: ContainerEventKind,
    /// Nanoseconds since the epoch.
    pub at: i64,
}

/// Events kept for subscribers that fall behind; older ones are dropped (they are told so).
const EVENT_BUFFER: usize = 1024;

/// The records, in memory and on disk.
pub struct Store {
    dir: PathBuf,
    inner: Mutex<Inner>,
    /// Held while a record changes on disk (see [`Store::update_sandbox`]).
    writes: Mutex<()>,
    events: tokio::sync::broadcast::Sender<ContainerEvent>,
    /// One lock per object id with a state-changing operation under way.
    ops: minicri_store::keyed::KeyedLocks<String>,
}

/// The directory of records whose containers are being torn down.
const REMOVING: &str = "removing";

/// The records in `dir`. Temporary files of writes a crash interrupted (`<id>.json.tmp`, which
/// hold container configs and environments) are deleted: the record they were to replace, or
/// none, is what stands.
fn read_dir_json<T: for<'de> Deserialize<'de>>(dir: &Path) -> Vec<T> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.extension().and_then(|x| x.to_str()) == Some("tmp") {
            if let Err(e) = std::fs::remove_file(&p) {
                tracing::warn!(path = %p.display(), error = %e, "cannot delete an interrupted record write");
            }
            continue;
        }
        if p.extension().and_then(|x| x.to_str()) != Some("json") {
            continue;
        }
        match std::fs::read(&p).map(|b| serde_json::from_slice::<T>(&b)) {
            Ok(Ok(r)) => out.push(r),
            Ok(Err(e)) => tracing::warn!(path = %p.display(), error = %e, "unreadable pod record"),
            Err(e) => tracing::warn!(path = %p.display(), error = %e, "unreadable pod record"),
        }
    }
    out
}

impl Store {
    /// Opens `<dir>` (creating it), loading every record there.
    pub fn open(dir: &Path) -> std::io::Result<Store> {
        std::fs::create_dir_all(dir.join("sandboxes"))?;
        std::fs::create_dir_all(dir.join("containers"))?;
        std::fs::create_dir_all(dir.join(REMOVING))?;
        let mut inner = Inner::default();
        for s in read_dir_json::<SandboxRecord>(&dir.join("sandboxes")) {
            inner.names.insert(s.name.clone(), s.id.clone());
            inner.sandboxes.insert(s.id.clone(), s);
        }
        for c in read_dir_json::<ContainerRecord>(&dir.join(REMOVING)) {
            inner.removing.insert(c.id.clone(), c);
        }
        for c in read_dir_json::<ContainerRecord>(&dir.join("containers")) {
            if inner.removing.contains_key(&c.id) {
                // Removed before the crash: a record of the same id left here is stale, and its
                // name may belong to a container created since.
                let _ = std::fs::remove_file(dir.join("containers").join(format!("{}.json", c.id)));
                continue;
            }
            inner.names.insert(c.name.clone(), c.id.clone());
            inner.containers.insert(c.id.clone(), c);
        }
        Ok(Store {
            dir: dir.to_path_buf(),
            inner: Mutex::new(inner),
            writes: Mutex::new(()),
            ops: minicri_store::keyed::KeyedLocks::new(),
            events: tokio::sync::broadcast::Sender::new(EVENT_BUFFER),
        })
    }

    /// Container events from now on.
    pub fn subscribe(&self) -> tokio::sync::broadcast::Receiver<ContainerEvent> {
        self.events.subscribe()
    }

    fn emit(&self, rec: &ContainerRecord, kind: ContainerEventKind) {
        // No subscriber is not an error.
        let _ = self.events.send(ContainerEvent {
            container_id: rec.id.clone(),
            sandbox_id: rec.sandbox_id.clone(),
            kind,
            at: super::now_ns(),
        });
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Serialises state-changing operations on one object.
    pub async fn op_lock(&self, id: &str) -> tokio::sync::OwnedMutexGuard<()> {
        self.ops.lock(&id.to_string()).await
    }

    /// Reserves `name` for `id`; ALREADY_EXISTS when another id holds it.
    pub fn reserve(&self, name: &str, id: &str) -> Result<()> {
        let mut g = self.lock();
        match g.names.get(name) {
            Some(other) if other != id => Err(Error::AlreadyExists(format!(
                "name {name:?} is reserved for {other}; remove it first"
            ))),
            _ => {
                g.names.insert(name.to_string(), id.to_string());
                Ok(())
            }
        }
    }

    pub fn release(&self, name: &str, id: &str) {
        let mut g = self.lock();
        if g.names.get(name).is_some_and(|i| i == id) {
            g.names.remove(name);
        }
    }

    /// Whether `id` names any object (or a reservation).
    pub fn id_in_use(&self, id: &str) -> bool {
        let g = self.lock();
        g.sandboxes.contains_key(id)
            || g.containers.contains_key(id)
            || g.removing.contains_key(id)
            || g.names.values().any(|v| v == id)
    }

    fn path(&self, kind: &str, id: &str) -> PathBuf {
        self.dir.join(kind).join(format!("{id}.json"))
    }

    /// Serialises record changes; held across a change's file work, never by readers.
    /// Waits for the writers' lock off the async workers: its holder may be in an fsync.
    fn writes(&self) -> std::sync::MutexGuard<'_, ()> {
        off_async(|| self.writes.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Writes a record's file (under [`Store::writes`], outside the records lock).
    fn write<T: Serialize>(&self, kind: &str, id: &str, rec: &T) -> Result<()> {
        let bytes = serde_json::to_vec(rec)
            .map_err(|e| Error::Internal(format!("encoding record {id}: {e}")))?;
        let p = self.path(kind, id);
        // Records hold the pods' and containers' configs (environments): root only.
        off_async(|| write_atomic(&p, &bytes, 0o600))
            .map_err(|e| Error::Internal(format!("writing {}: {e}", p.display())))
    }

    fn delete_file(&self, kind: &str, id: &str) -> Result<()> {
        let p = self.path(kind, id);
        match off_async(|| std::fs::remove_file(&p)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(Error::Internal(format!("removing {}: {e}", p.display())))
            }
            _ => Ok(()),
        }
    }

    pub fn put_sandbox(&self, rec: SandboxRecord) -> Result<()> {
        let _w = self.writes();
        self.write("sandboxes", &rec.id, &rec)?;
        self.lock().sandboxes.insert(rec.id.clone(), rec);
        Ok(())
    }

    /// Whether `id` is a sandbox's, recorded or with its name reserved (being created).
    pub fn knows_sandbox(&self, id: &str) -> bool {
        let g = self.lock();
        g.sandboxes.contains_key(id) || g.names.values().any(|v| v == id)
    }

    pub fn sandbox(&self, id: &str) -> Option<SandboxRecord> {
        self.lock().sandboxes.get(id).cloned()
    }

    pub fn sandboxes(&self) -> Vec<SandboxRecord> {
        self.lock().sandboxes.values().cloned().collect()
    }

    /// Changes a sandbox record in place and persists it; `None` if it does not exist.
    pub fn update_sandbox(
        &self,
        id: &str,
        f: impl FnOnce(&mut SandboxRecord),
    ) -> Result<Option<SandboxRecord>> {
        // Readers (the kubelet's relists) never wait for the file: the records lock is only
        // taken to read the record and to install the new one.
        let _w = self.writes();
        let Some(mut new) = self.lock().sandboxes.get(id).cloned() else {
            return Ok(None);
        };
        f(&mut new);
        self.write("sandboxes", id, &new)?;
        self.lock().sandboxes.insert(id.to_string(), new.clone());
        Ok(Some(new))
    }

    pub fn delete_sandbox(&self, id: &str) -> Result<()> {
        let _w = self.writes();
        self.delete_file("sandboxes", id)?;
        let mut g = self.lock();
        if let Some(r) = g.sandboxes.remove(id)
            && g.names.get(&r.name).is_some_and(|i| i == id)
        {
            g.names.remove(&r.name);
        }
        Ok(())
    }

    pub fn put_container(&self, rec: ContainerRecord) -> Result<()> {
        let _w = self.writes();
        self.write("containers", &rec.id, &rec)?;
        let mut g = self.lock();
        let new = !g.containers.contains_key(&rec.id);
        if new {
            self.emit(&rec, ContainerEventKind::Created);
        }
        g.containers.insert(rec.id.clone(), rec);
        Ok(())
    }

    pub fn container(&self, id: &str) -> Option<ContainerRecord> {
        self.lock().containers.get(id).cloned()
    }

    pub fn containers(&self) -> Vec<ContainerRecord> {
        self.lock().containers.values().cloned().collect()
    }

    pub fn containers_of(&self, sandbox_id: &str) -> Vec<ContainerRecord> {
        self.lock()
            .containers
            .values()
            .filter(|c| c.sandbox_id == sandbox_id)
            .cloned()
            .collect()
    }

    pub fn update_container(
        &self,
        id: &str,
        f: impl FnOnce(&mut ContainerRecord),
    ) -> Result<Option<ContainerRecord>> {
        let _w = self.writes();
        let current = self.lock().containers.get(id).cloned();
        let Some(mut new) = current else {
            // Removed and being torn down: the teardown reads the change (a runtime delete
            // that finished meanwhile), the file need not (every teardown step may be redone).
            if let Some(r) = self.lock().removing.get_mut(id) {
                f(r);
            }
            return Ok(None);
        };
        let was = new.state;
        f(&mut new);
        self.write("containers", id, &new)?;
        self.lock().containers.insert(id.to_string(), new.clone());
        match (was, new.state) {
            (ContainerState::Created, ContainerState::Running) => {
                self.emit(&new, ContainerEventKind::Started)
            }
            (ContainerState::Created | ContainerState::Running, ContainerState::Exited) => {
                self.emit(&new, ContainerEventKind::Stopped)
            }
            _ => {}
        }
        Ok(Some(new))
    }

    /// Takes a container out of the records for its removal: its record file moves to
    /// `removing/` (durably), it leaves every listing and its name is released. Returns the
    /// record, which the caller tears down and then passes to [`Store::finish_removal`]; `None`
    /// when there is no such container.
    pub fn begin_removal(&self, id: &str) -> Result<Option<ContainerRecord>> {
        let _w = self.writes();
        if !self.lock().containers.contains_key(id) {
            return Ok(None);
        }
        let (from, to) = (self.path("containers", id), self.path(REMOVING, id));
        off_async(|| {
            std::fs::rename(&from, &to)?;
            sync_dir(to.parent().unwrap_or(Path::new(".")))?;
            sync_dir(from.parent().unwrap_or(Path::new(".")))
        })
        .map_err(|e| {
            Error::Internal(format!(
                "moving {} to {}: {e}",
                from.display(),
                to.display()
            ))
        })?;
        let mut g = self.lock();
        let Some(r) = g.containers.remove(id) else {
            return Ok(None);
        };
        self.emit(&r, ContainerEventKind::Deleted);
        if g.names.get(&r.name).is_some_and(|i| i == id) {
            g.names.remove(&r.name);
        }
        g.removing.insert(id.to_string(), r.clone());
        Ok(Some(r))
    }

    /// The container `id`'s teardown is done: its record goes for good.
    pub fn finish_removal(&self, id: &str) -> Result<()> {
        let _w = self.writes();
        self.delete_file(REMOVING, id)?;
        self.lock().removing.remove(id);
        Ok(())
    }

    /// The record of container `id` if its teardown has not finished.
    pub fn removal(&self, id: &str) -> Option<ContainerRecord> {
        self.lock().removing.get(id).cloned()
    }

    /// Containers removed whose teardown has not finished (this run's, or a crashed run's).
    pub fn removals(&self) -> Vec<ContainerRecord> {
        self.lock().removing.values().cloned().collect()
    }
}

#[cfg(test)]
mod tests;

//! [`LocalSnapshotter`]: the [`Snapshotter`] implementation for both backends. Owns the root
//! directory, the records, reference counting, and the commit protocol.
//!
//! On-disk layout under the root:
//! ```text
//! lock                   flock'ed while a snapshotter has the root open (one process per root)
//! backend                "overlay" or "copy", written on first use; a root never changes backend
//! meta/<id>.json         one record per snapshot (see meta.rs)
//! snapshots/<id>/fs      the snapshot's files (layer, upper directory or full tree)
//! snapshots/<id>/work    overlayfs workdir of an active overlay snapshot
//! tmp/                   layers being applied and snapshots being created or deleted; emptied on open
//! ```
//!
//! Invariants:
//! - every new snapshot is built in `tmp/` and moved into `snapshots/` by one rename before its record
//!   is written, so a layer half-applied when the daemon died is never used, only swept from `tmp/`;
//! - at most one apply per chain id runs at a time in this process (single flight); later callers wait
//!   and then find the chain committed, or apply it themselves if the first one failed;
//! - a layer applied ahead of its parent ([`Snapshotter::apply_layer_early`]) is built in `tmp/`
//!   without it and installed only after its parent is committed and the layer rebased onto it;
//! - a snapshot that is the parent of an apply or prepare in progress is pinned and not collected;
//! - the state lock is held for record changes and renames only, never while a layer is applied.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::backend;
use crate::compression::Compression;
use crate::digest::{chain_id, validate_digest};
use crate::error::{Error, IoContext, Result};
use crate::meta::{Record, Records, now};
use crate::mount::Mount;
use crate::pipeline;
use crate::snapshotter::{
    Backend, Info, Kind, LayerApplied, LayerSpec, Released, Snapshotter, SpaceCheck, Usage,
};

/// Tuning for a [`LocalSnapshotter`].
#[derive(Clone)]
pub struct Options {
    /// Flush the filesystem (`syncfs`) before committing a layer, so a committed layer survives a
    /// power loss, not just a daemon crash. Default true.
    pub sync_on_commit: bool,
    /// Most bytes one layer may unpack to: its uncompressed tar stream plus the holes of its sparse
    /// files. Bounds what a decompression bomb can make the daemon read and write. Default 64 GiB.
    pub max_layer_bytes: u64,
    /// Most entries one layer may have (every file, directory, link and whiteout). Bounds the
    /// inodes and the applier's bookkeeping. Default 2^20 (1,048,576).
    pub max_layer_entries: u64,
    /// Asked before a layer's uncompressed bytes are written (see [`SpaceCheck`]). Default none.
    /// The copy backend's copy of the parent tree is not asked: it is seen by the first claim
    /// that measures the filesystem after it.
    pub space: Option<Arc<dyn SpaceCheck>>,
}

impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Options")
            .field("sync_on_commit", &self.sync_on_commit)
            .field("max_layer_bytes", &self.max_layer_bytes)
            .field("max_layer_entries", &self.max_layer_entries)
            .field("space", &self.space.is_some())
            .finish()
    }
}

/// Default for [`Options::max_layer_bytes`]: 64 GiB.
pub const DEFAULT_MAX_LAYER_BYTES: u64 = 64 << 30;
/// Default for [`Options::max_layer_entries`]: 2^20.
pub const DEFAULT_MAX_LAYER_ENTRIES: u64 = 1 << 20;

impl Default for Options {
    fn default() -> Self {
        Options {
            sync_on_commit: true,
            max_layer_bytes: DEFAULT_MAX_LAYER_BYTES,
            max_layer_entries: DEFAULT_MAX_LAYER_ENTRIES,
            space: None,
        }
    }
}

struct State {
    records: Records,
    /// Snapshots in use as the parent of work in progress.
    pins: HashMap<String, usize>,
}

/// A flight: one apply of a chain id that others wait for.
#[derive(Default)]
struct Flight {
    done: Mutex<bool>,
    cv: Condvar,
}

impl Flight {
    /// Blocks until the flight has landed (committed or failed); false, at once, if `stop` is
    /// set meanwhile (looked at every [`STOP_CHECK`]).
    fn wait(&self, stop: Option<&AtomicBool>) -> bool {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        while !*done {
            if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
                return false;
            }
            done = self
                .cv
                .wait_timeout(done, STOP_CHECK)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }
}

/// A flight's key: the chain id, and where its bytes come from.
type FlightKey = (String, Option<String>);

/// How often an apply waiting for another apply of its layer looks whether its caller stopped.
const STOP_CHECK: std::time::Duration = std::time::Duration::from_millis(200);

/// Snapshots on the local filesystem, with the overlayfs or the copy backend.
pub struct LocalSnapshotter {
    root: PathBuf,
    backend: Backend,
    options: Options,
    state: Mutex<State>,
    /// The applies under way, by chain id and source ([`LayerSpec::source`]).
    flights: Mutex<HashMap<FlightKey, Arc<Flight>>>,
    tmp_seq: AtomicU64,
    _lock: nix::fcntl::Flock<File>,
}

impl LocalSnapshotter {
    /// Opens (creating if needed) a snapshotter rooted at `root`. Fails if another process has the
    /// root open, if the root was used with the other backend, or (overlay) if overlayfs is unusable
    /// there. Sweeps `tmp/` and data directories without records.
    pub fn open(root: impl AsRef<Path>, backend: Backend, options: Options) -> Result<Self> {
        let root = std::path::absolute(root.as_ref())
            .ctx(|| format!("root {}", root.as_ref().display()))?;
        for d in ["meta", "snapshots", "tmp"] {
            fs::create_dir_all(root.join(d))
                .ctx(|| format!("creating {}", root.join(d).display()))?;
        }
        let lock_path = root.join("lock");
        let lock_file =
            File::create(&lock_path).ctx(|| format!("creating {}", lock_path.display()))?;
        let lock = nix::fcntl::Flock::lock(lock_file, nix::fcntl::FlockArg::LockExclusiveNonblock)
            .map_err(|(_, e)| {
                Error::io(
                    format!(
                        "locking {} (is another daemon using it?)",
                        lock_path.display()
                    ),
                    e.into(),
                )
            })?;
        backend::check_marker(&root, backend)?;
        crate::tree::remove_all(&root.join("tmp")).ctx(|| "clearing tmp".into())?;
        fs::create_dir(root.join("tmp")).ctx(|| "creating tmp".into())?;
        if backend == Backend::Overlay {
            backend::overlay::check_support(&root.join("tmp"))?;
        }
        let (records, stray) = Records::load(&root.join("meta"), &root.join("snapshots"))?;
        for id in stray {
            tracing::info!(id, "removing snapshot directory without a record");
            let dir = root.join("snapshots").join(id.to_string());
            crate::tree::remove_all(&dir).ctx(|| format!("removing {}", dir.display()))?;
        }
        Ok(LocalSnapshotter {
            root,
            backend,
            options,
            state: Mutex::new(State {
                records,
                pins: HashMap::new(),
            }),
            flights: Mutex::new(HashMap::new()),
            tmp_seq: AtomicU64::new(0),
            _lock: lock,
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn snapshot_dir(&self, id: u64) -> PathBuf {
        self.root.join("snapshots").join(id.to_string())
    }

    /// A fresh directory under `tmp/`.
    fn tmp_dir(&self, what: &str) -> Result<PathBuf> {
        let n = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        let dir = self.root.join("tmp").join(format!("{what}-{n}"));
        fs::create_dir(&dir).ctx(|| format!("creating {}", dir.display()))?;
        Ok(dir)
    }

    /// Layer directories of `key`'s chain, topmost first.
    fn layer_dirs(&self, st: &State, key: Option<&str>) -> Vec<PathBuf> {
        match key {
            None => Vec::new(),
            Some(k) => st
                .records
                .chain(k)
                .iter()
                .map(|r| self.snapshot_dir(r.id).join("fs"))
                .collect(),
        }
    }

    /// Pins the committed snapshot `key` (if any) and returns its chain's layer directories.
    fn pin_parent(&self, key: Option<&str>) -> Result<(Pin<'_>, Vec<PathBuf>)> {
        let mut st = self.lock();
        if let Some(k) = key {
            match st.records.get(k) {
                None => return Err(Error::NotFound { key: k.into() }),
                Some(r) if r.kind != Kind::Committed => {
                    return Err(Error::InvalidArgument(format!(
                        "parent {k:?} is {}, not committed",
                        r.kind
                    )));
                }
                Some(_) => *st.pins.entry(k.to_string()).or_default() += 1,
            }
        }
        let dirs = self.layer_dirs(&st, key);
        Ok((
            Pin {
                s: self,
                key: key.map(str::to_string),
            },
            dirs,
        ))
    }

    /// Moves the finished directory `tmp` into place as a new snapshot and writes its record.
    /// If `rec.key` exists already (lost a race), discards `tmp` and returns false.
    fn install(&self, tmp: &Path, mut rec: Record) -> Result<bool> {
        let mut st = self.lock();
        if st.records.get(&rec.key).is_some() {
            drop(st);
            let _ = crate::tree::remove_all(tmp);
            return Ok(false);
        }
        rec.id = st.records.alloc_id();
        let dir = self.snapshot_dir(rec.id);
        fs::rename(tmp, &dir).ctx(|| format!("renaming {} to {}", tmp.display(), dir.display()))?;
        if let Err(e) = st.records.put(rec, None) {
            let _ = fs::rename(&dir, tmp);
            return Err(e);
        }
        Ok(true)
    }

    /// Returns the existing committed snapshot `chain` (adding `user`), if there is one.
    fn existing_layer(&self, chain: &str, user: Option<&str>) -> Result<Option<LayerApplied>> {
        let mut st = self.lock();
        let Some(rec) = st.records.get(chain) else {
            return Ok(None);
        };
        if rec.kind != Kind::Committed {
            return Err(Error::AlreadyExists { key: chain.into() });
        }
        if let Some(u) = user
            && !rec.users.contains(u)
        {
            let mut rec = rec.clone();
            rec.users.insert(u.to_string());
            st.records.put(rec, None)?;
        }
        Ok(Some(LayerApplied {
            chain_id: chain.to_string(),
            unpacked: false,
            size: 0,
        }))
    }

    /// Joins the flight for `chain` from `source`: Ok(guard) if this caller leads, Err(flight)
    /// to wait on.
    fn join_flight(
        &self,
        chain: &str,
        source: Option<&str>,
    ) -> std::result::Result<FlightGuard<'_>, Arc<Flight>> {
        let key = (chain.to_string(), source.map(str::to_string));
        let mut flights = self.flights.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = flights.get(&key) {
            return Err(f.clone());
        }
        let f = Arc::new(Flight::default());
        flights.insert(key.clone(), f.clone());
        Ok(FlightGuard {
            s: self,
            key,
            flight: f,
        })
    }

    /// Applies `layer` through `unpack` (given its chain id and codec) unless its chain is
    /// committed already, as the only apply of that chain from that source in this process: a
    /// caller finding another one under way waits for it (or for its own stop), then looks again.
    /// Applies of one chain from different sources run side by side; the first commit wins
    /// ([`Self::install`] throws the others' work away).
    fn in_flight(
        &self,
        layer: &LayerSpec<'_>,
        mut unpack: impl FnMut(&str, Compression) -> Result<LayerApplied>,
    ) -> Result<LayerApplied> {
        validate_digest(layer.diff_id)?;
        if let Some(p) = layer.parent {
            validate_digest(p)?;
        }
        let codec = Compression::from_media_type(layer.media_type)?;
        let chain = chain_id(layer.parent, layer.diff_id);
        loop {
            if let Some(done) = self.existing_layer(&chain, layer.user)? {
                return Ok(done);
            }
            match self.join_flight(&chain, layer.source) {
                Ok(_guard) => {
                    // Another flight may have committed between the check and the join.
                    if let Some(done) = self.existing_layer(&chain, layer.user)? {
                        return Ok(done);
                    }
                    return unpack(&chain, codec);
                }
                Err(flight) => {
                    if !flight.wait(layer.stop) {
                        return Err(Error::Cancelled { chain });
                    }
                }
            }
        }
    }

    fn limits(&self) -> crate::apply::Limits {
        crate::apply::Limits {
            max_bytes: self.options.max_layer_bytes,
            max_entries: self.options.max_layer_entries,
        }
    }

    /// Fails unless the stream hashed to the layer's diff_id.
    fn check_diff_id(layer: &LayerSpec<'_>, diff_id: String) -> Result<()> {
        if diff_id != layer.diff_id {
            return Err(Error::DiffIdMismatch {
                expected: layer.diff_id.to_string(),
                actual: diff_id,
            });
        }
        Ok(())
    }

    /// Flushes the new layer in `tmp` to disk, if configured.
    fn sync(&self, tmp: &Path) -> Result<()> {
        if self.options.sync_on_commit {
            let f = File::open(tmp).ctx(|| format!("opening {}", tmp.display()))?;
            nix::unistd::syncfs(&f).ctx(|| "syncfs".into())?;
        }
        Ok(())
    }

    fn unpack(
        &self,
        layer: &LayerSpec<'_>,
        chain: &str,
        codec: Compression,
        stream: &mut (dyn Read + Send),
    ) -> Result<LayerApplied> {
        let (_pin, lowers) = self.pin_parent(layer.parent)?;
        let tmp = self.tmp_dir("apply")?;
        let result = (|| {
            backend::populate(self.backend, Kind::Committed, &tmp, &lowers)?;
            let space = self.options.space.as_deref();
            let (diff_id, size) = pipeline::decode_and_apply(codec, stream, space, |tar| {
                backend::apply(
                    self.backend,
                    &tmp,
                    &lowers,
                    tar,
                    self.limits(),
                    self.options.sync_on_commit,
                )
            })?;
            Self::check_diff_id(layer, diff_id)?;
            self.sync(&tmp)?;
            Ok(size)
        })();
        self.commit_layer(layer, chain, &tmp, result)
    }

    /// [`Snapshotter::apply_layer_early`] for the overlay backend, once this caller leads the
    /// chain's flight: apply detached, wait for the parent, rebase onto it, commit.
    fn unpack_early(
        &self,
        layer: &LayerSpec<'_>,
        parent: &str,
        chain: &str,
        codec: Compression,
        stream: &mut (dyn Read + Send),
        parent_ready: &dyn Fn() -> bool,
    ) -> Result<LayerApplied> {
        let tmp = self.tmp_dir("apply")?;
        let mut pin = None;
        let result = (|| {
            backend::populate(self.backend, Kind::Committed, &tmp, &[])?;
            let mut detached = None;
            let space = self.options.space.as_deref();
            let (diff_id, size) = pipeline::decode_and_apply(codec, stream, space, |tar| {
                detached = Some(backend::apply_detached(
                    &tmp,
                    tar,
                    self.limits(),
                    self.options.sync_on_commit,
                )?);
                Ok(())
            })
            .map_err(|e| match e {
                // What the bytes are does not depend on the parent.
                Error::DiffIdMismatch { .. }
                | Error::LayerStream { .. }
                | Error::LayerLimit { .. } => e,
                // Whatever else failed, the apply on top of the parent has the last word.
                other => Error::NeedsParent {
                    reason: other.to_string(),
                },
            })?;
            let detached = detached.expect("set by a successful apply");
            // Before waiting for the parent: wrong bytes are wrong whatever it holds.
            Self::check_diff_id(layer, diff_id)?;
            if !parent_ready() {
                return Err(Error::NotFound { key: parent.into() });
            }
            let (p, lowers) = self.pin_parent(Some(parent))?;
            pin = Some(p);
            let fs_dir = tmp.join("fs");
            crate::apply::rebase(&fs_dir, &detached, &lowers)
                .ctx(|| format!("rebasing {} onto {parent}", fs_dir.display()))?
                .map_err(|reason| Error::NeedsParent { reason })?;
            if !detached.lists_root() {
                backend::copy_root_meta(&fs_dir, &lowers)?;
            }
            self.sync(&tmp)?;
            Ok(size)
        })();
        let applied = self.commit_layer(layer, chain, &tmp, result);
        drop(pin);
        applied
    }

    /// Commits the layer applied into `tmp` (`result`: its uncompressed size) under `chain`, or
    /// throws `tmp` away if the apply failed.
    fn commit_layer(
        &self,
        layer: &LayerSpec<'_>,
        chain: &str,
        tmp: &Path,
        result: Result<u64>,
    ) -> Result<LayerApplied> {
        let size = match result {
            Ok(a) => a,
            Err(e) => {
                let _ = crate::tree::remove_all(tmp);
                return Err(e);
            }
        };
        let rec = Record {
            id: 0,
            key: chain.to_string(),
            kind: Kind::Committed,
            parent: layer.parent.map(str::to_string),
            users: layer.user.iter().map(|u| u.to_string()).collect(),
            created: now(),
            layer_size: Some(size),
        };
        let unpacked = self.install(tmp, rec)?;
        if !unpacked {
            return Ok(self
                .existing_layer(chain, layer.user)?
                .expect("found by install"));
        }
        Ok(LayerApplied {
            chain_id: chain.to_string(),
            unpacked,
            size,
        })
    }

    fn create(&self, kind: Kind, key: &str, parent: Option<&str>) -> Result<Mount> {
        if key.is_empty() {
            return Err(Error::InvalidArgument("empty snapshot key".into()));
        }
        if self.lock().records.get(key).is_some() {
            return Err(Error::AlreadyExists { key: key.into() });
        }
        let (_pin, lowers) = self.pin_parent(parent)?;
        let tmp = self.tmp_dir("prepare")?;
        if let Err(e) = backend::populate(self.backend, kind, &tmp, &lowers) {
            let _ = crate::tree::remove_all(&tmp);
            return Err(e);
        }
        let rec = Record {
            id: 0,
            key: key.to_string(),
            kind,
            parent: parent.map(str::to_string),
            users: Default::default(),
            created: now(),
            layer_size: None,
        };
        if !self.install(&tmp, rec)? {
            return Err(Error::AlreadyExists { key: key.into() });
        }
        self.mounts(key)
    }

    /// Removes `key` if nothing holds it, then its ancestors that nothing holds; returns the data
    /// directories to delete (moved into tmp/) and the keys removed.
    fn collect(
        &self,
        st: &mut State,
        key: &str,
        removed: &mut Vec<String>,
        trash: &mut Vec<PathBuf>,
    ) -> Result<()> {
        let mut next = Some(key.to_string());
        while let Some(k) = next.take() {
            let Some(rec) = st.records.get(&k) else { break };
            let free =
                rec.users.is_empty() && !st.records.has_children(&k) && !st.pins.contains_key(&k);
            // Ancestors go only if they are layers; active snapshots and views go only when asked.
            if !free || (k != key && rec.kind != Kind::Committed) {
                break;
            }
            let rec = st.records.delete(&k)?;
            let dir = self.snapshot_dir(rec.id);
            let gone = self.root.join("tmp").join(format!("remove-{}", rec.id));
            match fs::rename(&dir, &gone) {
                Ok(()) => trash.push(gone),
                Err(e) => {
                    tracing::warn!(dir = %dir.display(), error = %e, "cannot move snapshot away; left for the next start")
                }
            }
            removed.push(k);
            next = rec.parent;
        }
        Ok(())
    }
}

struct Pin<'a> {
    s: &'a LocalSnapshotter,
    key: Option<String>,
}

impl Drop for Pin<'_> {
    fn drop(&mut self) {
        if let Some(k) = &self.key {
            let mut st = self.s.lock();
            if let Some(n) = st.pins.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    st.pins.remove(k);
                }
            }
        }
    }
}

struct FlightGuard<'a> {
    s: &'a LocalSnapshotter,
    key: FlightKey,
    flight: Arc<Flight>,
}

impl Drop for FlightGuard<'_> {
    fn drop(&mut self) {
        self.s
            .flights
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.key);
        *self.flight.done.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.flight.cv.notify_all();
    }
}

impl Snapshotter for LocalSnapshotter {
    fn backend(&self) -> Backend {
        self.backend
    }

    fn root(&self) -> &Path {
        &self.root
    }

    fn apply_layer(
        &self,
        layer: &LayerSpec<'_>,
        stream: &mut (dyn Read + Send),
    ) -> Result<LayerApplied> {
        self.in_flight(layer, |chain, codec| {
            self.unpack(layer, chain, codec, stream)
        })
    }

    fn apply_layer_early(
        &self,
        layer: &LayerSpec<'_>,
        stream: &mut (dyn Read + Send),
        parent_ready: &dyn Fn() -> bool,
    ) -> Result<LayerApplied> {
        let Some(parent) = layer.parent else {
            return self.apply_layer(layer, stream);
        };
        let committed = self
            .lock()
            .records
            .get(parent)
            .is_some_and(|r| r.kind == Kind::Committed);
        if committed || self.backend != Backend::Overlay {
            if !committed && !parent_ready() {
                return Err(Error::NotFound { key: parent.into() });
            }
            return self.apply_layer(layer, stream);
        }
        self.in_flight(layer, |chain, codec| {
            self.unpack_early(layer, parent, chain, codec, stream, parent_ready)
        })
    }

    fn prepare(&self, key: &str, parent: Option<&str>) -> Result<Mount> {
        self.create(Kind::Active, key, parent)
    }

    fn view(&self, key: &str, parent: Option<&str>) -> Result<Mount> {
        self.create(Kind::View, key, parent)
    }

    fn commit(&self, name: &str, key: &str) -> Result<()> {
        let mut st = self.lock();
        let rec = st
            .records
            .get(key)
            .ok_or_else(|| Error::NotFound { key: key.into() })?
            .clone();
        if rec.kind != Kind::Active {
            return Err(Error::InvalidArgument(format!(
                "{key:?} is {}, only active snapshots commit",
                rec.kind
            )));
        }
        if st.records.get(name).is_some() {
            return Err(Error::AlreadyExists { key: name.into() });
        }
        if st.records.has_children(key) {
            return Err(Error::InUse {
                key: key.into(),
                reason: "has children".into(),
            });
        }
        let id = rec.id;
        let new = Record {
            key: name.to_string(),
            kind: Kind::Committed,
            ..rec
        };
        st.records.put(new, Some(key))?;
        drop(st);
        if self.backend == Backend::Overlay {
            let work = self.snapshot_dir(id).join("work");
            crate::tree::remove_all(&work).ctx(|| format!("removing {}", work.display()))?;
        }
        Ok(())
    }

    fn mounts(&self, key: &str) -> Result<Mount> {
        let st = self.lock();
        let rec = st
            .records
            .get(key)
            .ok_or_else(|| Error::NotFound { key: key.into() })?;
        let lowers = self.layer_dirs(&st, rec.parent.as_deref());
        backend::mount(self.backend, rec.kind, &self.snapshot_dir(rec.id), &lowers)
    }

    fn remove(&self, key: &str) -> Result<Vec<String>> {
        let mut removed = Vec::new();
        let mut trash = Vec::new();
        {
            let mut st = self.lock();
            let rec = st
                .records
                .get(key)
                .ok_or_else(|| Error::NotFound { key: key.into() })?;
            let busy = if st.records.has_children(key) {
                Some("has children".to_string())
            } else if !rec.users.is_empty() {
                Some(format!("held by {:?}", rec.users))
            } else if st.pins.contains_key(key) {
                Some("a layer is being applied on it".to_string())
            } else {
                None
            };
            if let Some(reason) = busy {
                return Err(Error::InUse {
                    key: key.into(),
                    reason,
                });
            }
            self.collect(&mut st, key, &mut removed, &mut trash)?;
        }
        crate::tree::empty_trash(trash);
        Ok(removed)
    }

    fn stat(&self, key: &str) -> Result<Info> {
        let st = self.lock();
        st.records
            .get(key)
            .map(Record::info)
            .ok_or_else(|| Error::NotFound { key: key.into() })
    }

    fn list(&self) -> Result<Vec<Info>> {
        let mut all: Vec<Info> = self.lock().records.all().map(Record::info).collect();
        all.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(all)
    }

    fn usage(&self, key: &str) -> Result<Usage> {
        let id = self
            .lock()
            .records
            .get(key)
            .map(|r| r.id)
            .ok_or_else(|| Error::NotFound { key: key.into() })?;
        let dir = self.snapshot_dir(id).join("fs");
        let (bytes, inodes) =
            crate::tree::disk_usage(&dir).ctx(|| format!("measuring {}", dir.display()))?;
        Ok(Usage { bytes, inodes })
    }

    fn total_usage(&self) -> Result<Usage> {
        let dir = self.root.join("snapshots");
        let (bytes, inodes) =
            crate::tree::disk_usage(&dir).ctx(|| format!("measuring {}", dir.display()))?;
        Ok(Usage { bytes, inodes })
    }

    fn add_user(&self, key: &str, user: &str) -> Result<()> {
        let mut st = self.lock();
        let rec = st
            .records
            .get(key)
            .ok_or_else(|| Error::NotFound { key: key.into() })?;
        if rec.users.contains(user) {
            return Ok(());
        }
        let mut rec = rec.clone();
        rec.users.insert(user.to_string());
        st.records.put(rec, None)
    }

    fn release(&self, user: &str) -> Result<Released> {
        let mut removed = Vec::new();
        let mut trash = Vec::new();
        {
            let mut st = self.lock();
            let held: Vec<Record> = st
                .records
                .all()
                .filter(|r| r.users.contains(user))
                .cloned()
                .collect();
            for mut rec in held.iter().cloned() {
                rec.users.remove(user);
                st.records.put(rec, None)?;
            }
            for rec in held {
                self.collect(&mut st, &rec.key, &mut removed, &mut trash)?;
            }
        }
        Ok(Released::new(removed, trash))
    }
}
/// Unpacks the uncompressed layer `tar` into the existing directory `dir` the way the copy
/// backend applies a layer (whiteouts delete), within `options`' layer limits. For tools and for
/// fuzzing the applier; snapshots go through [`crate::Snapshotter::apply_layer`].
pub fn unpack_into(dir: &Path, tar: impl Read, options: &Options) -> Result<(), Error> {
    let mut target = crate::apply::CopyTarget::new(dir.to_path_buf());
    let limits = crate::apply::Limits {
        max_bytes: options.max_layer_bytes,
        max_entries: options.max_layer_entries,
    };
    crate::apply::apply_tar(&mut target, tar, limits, false)
}

//! The content store: immutable, content-addressed blobs and the ingest area that feeds them.
//!
//! Layout under the store root:
//! - `blobs/sha256/<hex>`: committed blobs. A file exists here only after its bytes were verified
//!   against its digest and size; it is written under a temporary name and renamed into place.
//! - `ingest/<hex>-<size>/data`: a blob being downloaded, each byte at its offset in the blob,
//!   keyed by digest **and** size ([`BlobKey`]): a descriptor giving a popular blob's digest with
//!   another size downloads into an ingest of its own, so it can neither share nor block (nor
//!   discard) the partial data of the right one. A later download of the same blob continues
//!   from what is there: it re-hashes the contiguous prefix and fetches only the missing ranges.
//!   `meta.json` records the expected size and when
//!   the download started, and the endpoints (registries, mirrors) that wrote its bytes: a later
//!   pull of the same digest resumes them whichever registry it asks, and the digest check at
//!   the end decides whether they were right.
//! - `ingest/<hex>-<size>/ranges.json`: written before the first byte lands beyond the contiguous prefix
//!   (a blob fetched over several ranged requests at once), and then after every
//!   [`CHECKPOINT_BYTES`] written and when the writer stops. While it exists it says what is on
//!   disk (a lower bound: bytes written after the last checkpoint are fetched again after a crash);
//!   without it the file is written only at its end, so its length is the prefix.
//!
//! Ingests of earlier versions, named `ingest/<hex>`, are renamed to their key when the store
//! opens.
//!
//! One writer per ingest is enforced by [`ContentStore::lock_ingest`]; committed blobs are never
//! modified, only deleted when no image uses them.
//!
//! Disk bounds: an ingest never writes past the descriptor's size, claims its bytes from the
//! filesystem's [`SpaceBudget`] before writing them (a download stops before free space falls
//! under the reserve), and refuses to start when the blob's missing bytes plainly cannot fit. The
//! bytes of every ingest on disk are kept in memory ([`ContentStore::ingest_usage`]), so metrics
//! and listings never walk the ingest area.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::digest::Digest;
use crate::error::{IoContext, Result, StoreError};
use crate::space::SpaceBudget;

/// Largest manifest or config minicri reads into memory (the distribution spec suggests 4 MiB).
pub const MAX_METADATA_BLOB: u64 = 16 * 1024 * 1024;

/// Bytes an ingest writes between two updates of its `ranges.json` (once it has one): at most
/// this much is fetched again after a crash.
pub const CHECKPOINT_BYTES: u64 = 1024 * 1024;

/// A blob as a descriptor names it: its digest and its size. Downloads and their partial data
/// are keyed by both (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlobKey {
    pub digest: Digest,
    pub size: u64,
}

impl BlobKey {
    pub fn new(digest: Digest, size: u64) -> BlobKey {
        BlobKey { digest, size }
    }

    /// The ingest directory's name: `<hex>-<size>`.
    fn dir_name(&self) -> String {
        format!("{}-{}", self.digest.hex(), self.size)
    }

    /// The key an ingest directory's name gives (`<hex>-<size>`).
    fn from_dir_name(name: &str) -> Option<BlobKey> {
        let (hex, size) = name.rsplit_once('-')?;
        Some(BlobKey {
            digest: Digest::parse(&format!("sha256:{hex}")).ok()?,
            size: size.parse().ok()?,
        })
    }
}

impl std::fmt::Display for BlobKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({} bytes)", self.digest, self.size)
    }
}

/// Root of the content store.
#[derive(Debug)]
pub struct ContentStore {
    root: PathBuf,
    ingest_locks: crate::keyed::KeyedLocks<BlobKey>,
    /// The filesystem's reserve that downloads keep free (`None`: no reserve).
    space: Option<Arc<SpaceBudget>>,
    /// Every ingest on disk, with its bytes: counted at open, then kept by the writers.
    ingests: Mutex<HashMap<BlobKey, Arc<IngestAccount>>>,
}

/// The bytes on disk of one ingest and whether a writer has it open.
#[derive(Debug, Default)]
struct IngestAccount {
    bytes: AtomicU64,
    writing: AtomicBool,
}

/// Partial downloads on disk: those a download is writing now (active) and those kept for a
/// resume (idle), with their bytes of the blobs.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct IngestUsage {
    pub active: u64,
    pub active_bytes: u64,
    pub idle: u64,
    pub idle_bytes: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct IngestMeta {
    expected_size: u64,
    started_at: chrono::DateTime<chrono::Utc>,
    /// The endpoints whose bytes are on disk, the one that began writing last at the end (at
    /// most [`MAX_WRITERS`]; the earliest are forgotten first).
    #[serde(default)]
    written_by: Vec<String>,
}

/// Endpoints an ingest remembers as writers of its bytes.
const MAX_WRITERS: usize = 8;

/// What `ranges.json` records: the contiguous prefix and the ranges written beyond it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct IngestRanges {
    prefix: u64,
    /// `[start, end)` ranges beyond the prefix, sorted and disjoint.
    beyond: Vec<(u64, u64)>,
}

impl IngestRanges {
    fn read(dir: &Path) -> Option<IngestRanges> {
        fs::read(dir.join("ranges.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
    }

    /// Whether these ranges can describe a file of `len` bytes of a blob of `size`.
    fn fits(&self, len: u64, size: u64) -> bool {
        let limit = len.min(size);
        let mut at = self.prefix;
        self.prefix <= limit
            && self.beyond.iter().all(|&(s, e)| {
                let ok = s > at && s < e && e <= limit;
                at = e;
                ok
            })
    }

    fn bytes(&self) -> u64 {
        self.prefix + self.beyond.iter().map(|(s, e)| e - s).sum::<u64>()
    }
}

/// A partial download found in the ingest area.
#[derive(Debug, Clone)]
pub struct IngestStatus {
    pub key: BlobKey,
    /// Bytes of the blob on disk.
    pub offset: u64,
    pub updated_at: std::time::SystemTime,
    /// The endpoints that wrote its bytes, the one that wrote last at the end.
    pub written_by: Vec<String>,
}

impl ContentStore {
    /// Opens (creating if needed) a content store at `root`.
    pub fn open(root: &Path) -> Result<ContentStore> {
        for dir in [
            root.join("blobs/sha256"),
            root.join("ingest"),
            root.join("tmp"),
        ] {
            fs::create_dir_all(&dir).ctx(|| format!("creating {}", dir.display()))?;
        }
        // Leftovers of interrupted small writes: never referenced by anything.
        if let Ok(entries) = fs::read_dir(root.join("tmp")) {
            for e in entries.flatten() {
                let _ = fs::remove_file(e.path());
            }
        }
        let store = ContentStore {
            root: root.to_path_buf(),
            ingest_locks: crate::keyed::KeyedLocks::new(),
            space: None,
            ingests: Mutex::new(HashMap::new()),
        };
        store.rename_old_ingests();
        // The one walk of the ingest area outside the collector's: its bytes from here on are
        // kept by the writers.
        for i in store.list_ingests()? {
            store
                .account(&i.key)
                .bytes
                .store(i.offset, Ordering::Relaxed);
        }
        Ok(store)
    }

    /// Downloads claim their bytes from `space` (the budget of this store's filesystem) and
    /// stop before free space falls under its reserve.
    pub fn with_space(mut self, space: Arc<SpaceBudget>) -> ContentStore {
        self.space = Some(space);
        self
    }

    pub fn space(&self) -> Option<&Arc<SpaceBudget>> {
        self.space.as_ref()
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Ingests of earlier versions (`ingest/<hex>`) get their key's name, from the size their
    /// `meta.json` records; one without a readable record cannot be resumed and goes.
    fn rename_old_ingests(&self) {
        let Ok(entries) = fs::read_dir(self.root.join("ingest")) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Ok(digest) = Digest::parse(&format!("sha256:{name}")) else {
                continue;
            };
            let meta: Option<IngestMeta> = fs::read(e.path().join("meta.json"))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            let done = match meta {
                Some(m) => fs::rename(
                    e.path(),
                    self.ingest_dir(&BlobKey::new(digest, m.expected_size)),
                ),
                None => fs::remove_dir_all(e.path()),
            };
            if let Err(err) = done {
                tracing::warn!(ingest = %e.path().display(), error = %err, "cannot rename a partial download of an earlier version");
            }
        }
    }

    fn account(&self, d: &BlobKey) -> Arc<IngestAccount> {
        self.ingests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(d.clone())
            .or_default()
            .clone()
    }

    fn forget_ingest(&self, d: &BlobKey) {
        self.ingests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(d);
    }

    /// Partial downloads on disk, from memory (no walk).
    pub fn ingest_usage(&self) -> IngestUsage {
        let mut u = IngestUsage::default();
        for a in self
            .ingests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
        {
            let bytes = a.bytes.load(Ordering::Relaxed);
            if a.writing.load(Ordering::Relaxed) {
                u.active += 1;
                u.active_bytes += bytes;
            } else {
                u.idle += 1;
                u.idle_bytes += bytes;
            }
        }
        u
    }

    /// Bytes of blob `d` in its ingest (0 if none), from memory.
    pub fn ingest_bytes(&self, d: &BlobKey) -> u64 {
        self.ingests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(d)
            .map_or(0, |a| a.bytes.load(Ordering::Relaxed))
    }

    /// Fails if `missing` more bytes, for `what`, plainly cannot fit above the reserve now.
    pub fn check_fits(&self, missing: u64, what: impl FnOnce() -> String) -> Result<()> {
        match &self.space {
            Some(space) => {
                space
                    .check_fits(missing)
                    .map_err(|shortfall| StoreError::ImageFsReserve {
                        what: what(),
                        shortfall,
                    })
            }
            None => Ok(()),
        }
    }

    /// Where a committed blob lives.
    pub fn blob_path(&self, d: &Digest) -> PathBuf {
        self.root.join("blobs/sha256").join(d.hex())
    }

    fn ingest_dir(&self, d: &BlobKey) -> PathBuf {
        self.root.join("ingest").join(d.dir_name())
    }

    /// The file a download of `d` is writing (it may not exist).
    pub fn ingest_data_path(&self, d: &BlobKey) -> PathBuf {
        self.ingest_dir(d).join("data")
    }

    /// Size of a committed blob, if present.
    pub fn size(&self, d: &Digest) -> Option<u64> {
        fs::metadata(self.blob_path(d)).ok().map(|m| m.len())
    }

    /// Reads a small committed blob (manifest, index, config) into memory.
    pub fn read(&self, d: &Digest) -> Result<Vec<u8>> {
        let path = self.blob_path(d);
        let f = File::open(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => StoreError::BlobNotFound(d.to_string()),
            _ => StoreError::io(format!("opening {}", path.display()), e),
        })?;
        let mut buf = Vec::new();
        f.take(MAX_METADATA_BLOB)
            .read_to_end(&mut buf)
            .ctx(|| format!("reading {}", path.display()))?;
        Ok(buf)
    }

    /// Stores a small blob held in memory after checking it hashes to `d`.
    pub fn write(&self, d: &Digest, data: &[u8]) -> Result<()> {
        let actual = Digest::of(data);
        if &actual != d {
            return Err(StoreError::DigestMismatch {
                expected: d.to_string(),
                actual: actual.to_string(),
                size: data.len() as u64,
            });
        }
        // A file written and fsynced: called from async code (a pull's manifests), so kept off the
        // async workers.
        crate::fsutil::off_async(|| {
            if self.size(d) == Some(data.len() as u64) {
                return Ok(());
            }
            // A name of its own: two pulls may write the same manifest at once.
            let tmp = self.tmp_path("writing", d);
            let dst = self.blob_path(d);
            let written = write_synced(&tmp, data).and_then(|()| {
                fs::rename(&tmp, &dst).ctx(|| format!("committing {}", dst.display()))
            });
            if written.is_err() {
                // A name of its own is never written over: do not leave it to fill the disk.
                let _ = fs::remove_file(&tmp);
            }
            written
        })
    }

    /// A fresh path in `tmp/` (emptied at every start) for work on `d`: unique in this process.
    fn tmp_path(&self, what: &str, d: &Digest) -> PathBuf {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        self.root.join("tmp").join(format!(
            "{what}-{}-{}-{}",
            d.hex(),
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ))
    }

    /// Takes a committed blob out of the store at once (a rename into `tmp/`, emptied at every
    /// start) and returns where it went, for the caller to delete when it suits; `None` when the
    /// blob is not there.
    pub fn take_out(&self, d: &Digest) -> Result<Option<PathBuf>> {
        let p = self.blob_path(d);
        let gone = self.tmp_path("removing", d);
        match fs::rename(&p, &gone) {
            Ok(()) => Ok(Some(gone)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::io(format!("removing {}", p.display()), e)),
        }
    }

    /// Deletes a committed blob; missing blobs are fine.
    pub fn delete(&self, d: &Digest) -> Result<()> {
        let p = self.blob_path(d);
        match fs::remove_file(&p) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::io(format!("deleting {}", p.display()), e)),
        }
    }

    /// All committed blobs.
    pub fn list(&self) -> Result<Vec<Digest>> {
        let dir = self.root.join("blobs/sha256");
        let mut out = Vec::new();
        for e in fs::read_dir(&dir).ctx(|| format!("listing {}", dir.display()))? {
            let e = e.ctx(|| format!("listing {}", dir.display()))?;
            if let Ok(d) = Digest::parse(&format!("sha256:{}", e.file_name().to_string_lossy())) {
                out.push(d);
            }
        }
        Ok(out)
    }

    /// Takes the one-writer lock of a blob's ingest. Held across the whole download of that blob.
    pub async fn lock_ingest(&self, d: &BlobKey) -> tokio::sync::OwnedMutexGuard<()> {
        self.ingest_locks.lock(d).await
    }

    /// [`Self::lock_ingest`] if nobody holds it now (for the collector: a held ingest is in use).
    pub fn try_lock_ingest(&self, d: &BlobKey) -> Option<tokio::sync::OwnedMutexGuard<()>> {
        self.ingest_locks.try_lock(d)
    }

    /// Opens the ingest of blob `d` for writing, resuming from the bytes already there.
    /// Blocking (re-hashes the existing prefix); call under the blob's ingest lock.
    pub fn open_ingest(&self, d: &BlobKey) -> Result<Ingest> {
        let expected_size = d.size;
        let dir = self.ingest_dir(d);
        fs::create_dir_all(&dir).ctx(|| format!("creating {}", dir.display()))?;
        let meta_path = dir.join("meta.json");
        let meta = match fs::read(&meta_path)
            .ok()
            .and_then(|b| serde_json::from_slice::<IngestMeta>(&b).ok())
        {
            Some(m) => m,
            None => {
                let meta = IngestMeta {
                    expected_size,
                    started_at: chrono::Utc::now(),
                    written_by: Vec::new(),
                };
                write_synced(
                    &meta_path,
                    &serde_json::to_vec(&meta).expect("serialisable"),
                )?;
                meta
            }
        };
        let data = dir.join("data");
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&data)
            .ctx(|| format!("opening {}", data.display()))?;
        let len = file
            .metadata()
            .ctx(|| format!("stat {}", data.display()))?
            .len();
        let recorded = IngestRanges::read(&dir);
        let valid = matches!(&recorded, Some(r) if r.fits(len, expected_size));
        let ranges = match &recorded {
            Some(r) if r.fits(len, expected_size) => r.clone(),
            // Without a record the file was written only at its end; more bytes than the blob
            // has (or a record that cannot be right) is not a part of it.
            None if len <= expected_size => IngestRanges {
                prefix: len,
                beyond: Vec::new(),
            },
            _ => {
                let _ = fs::remove_file(dir.join("ranges.json"));
                file.set_len(0)
                    .ctx(|| format!("truncating {}", data.display()))?;
                IngestRanges::default()
            }
        };
        // Before any byte is fetched (or the prefix re-hashed): the missing bytes must fit.
        let have = ranges.bytes();
        if let Err(e) = self.check_fits(expected_size - have, || {
            describe_download(&d.digest, expected_size, have)
        }) {
            if have == 0 {
                // Nothing to keep for a resume: do not leave an empty ingest behind.
                drop(file);
                let _ = fs::remove_dir_all(&dir);
                self.forget_ingest(d);
            }
            return Err(e);
        }
        let account = self.account(d);
        account.bytes.store(have, Ordering::Relaxed);
        account.writing.store(true, Ordering::Relaxed);
        let mut ingest = Ingest {
            key: d.clone(),
            digest: d.digest.clone(),
            expected_size,
            dir,
            file: Some(file),
            offset: 0,
            hasher: Sha256::new(),
            beyond: ranges.beyond,
            recorded: valid,
            unrecorded: 0,
            meta,
            space: self.space.clone(),
            account,
        };
        ingest.hash_from_file(ranges.prefix)?;
        Ok(ingest)
    }

    /// Partial downloads in the ingest area.
    pub fn list_ingests(&self) -> Result<Vec<IngestStatus>> {
        let dir = self.root.join("ingest");
        let mut out = Vec::new();
        for e in fs::read_dir(&dir)
            .ctx(|| format!("listing {}", dir.display()))?
            .flatten()
        {
            let Some(key) = BlobKey::from_dir_name(&e.file_name().to_string_lossy()) else {
                continue;
            };
            let data = e.path().join("data");
            let meta: Option<IngestMeta> = fs::read(e.path().join("meta.json"))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            let (len, updated_at) = match fs::metadata(&data) {
                Ok(m) => (m.len(), m.modified().unwrap_or(std::time::UNIX_EPOCH)),
                Err(_) => (0, std::time::UNIX_EPOCH),
            };
            let offset = IngestRanges::read(&e.path()).map_or(len, |r| r.bytes().min(len));
            let written_by = meta.map_or(Vec::new(), |m| m.written_by);
            out.push(IngestStatus {
                key,
                offset,
                updated_at,
                written_by,
            });
        }
        Ok(out)
    }

    /// Drops a partial download.
    pub fn remove_ingest(&self, d: &BlobKey) -> Result<()> {
        let dir = self.ingest_dir(d);
        match fs::remove_dir_all(&dir) {
            Ok(()) => {
                self.forget_ingest(d);
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.forget_ingest(d);
                Ok(())
            }
            Err(e) => Err(StoreError::io(format!("removing {}", dir.display()), e)),
        }
    }

    /// Bytes and inodes used by committed blobs and ingests.
    pub fn usage(&self) -> (u64, u64) {
        let mut bytes = 0;
        let mut inodes = 0;
        for sub in ["blobs/sha256", "ingest"] {
            walk_usage(&self.root.join(sub), &mut bytes, &mut inodes);
        }
        (bytes, inodes)
    }
}

fn walk_usage(dir: &Path, bytes: &mut u64, inodes: &mut u64) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let Ok(m) = e.metadata() else { continue };
        *inodes += 1;
        *bytes += m.blocks() * 512;
        if m.is_dir() {
            walk_usage(&e.path(), bytes, inodes);
        }
    }
}

/// What a download is, for messages: the blob, its size, and what of it is on disk (kept for a
/// resume when the download stops).
fn describe_download(d: &Digest, size: u64, on_disk: u64) -> String {
    use crate::text::human_bytes;
    format!(
        "download of blob {d} ({}, {} on disk, kept for a resume)",
        human_bytes(size as f64),
        human_bytes(on_disk as f64)
    )
}

/// Writes `data` to `path` and fsyncs it.
pub(crate) fn write_synced(path: &Path, data: &[u8]) -> Result<()> {
    let mut f = File::options()
        .write(true)
        .create_new(true)
        .open(path)
        .ctx(|| format!("creating {}", path.display()))?;
    f.write_all(data)
        .ctx(|| format!("writing {}", path.display()))?;
    f.sync_all().ctx(|| format!("syncing {}", path.display()))
}

/// An open partial download of one blob. Blocking I/O: drive it from a blocking thread.
#[derive(Debug)]
pub struct Ingest {
    key: BlobKey,
    digest: Digest,
    expected_size: u64,
    dir: PathBuf,
    file: Option<File>,
    /// The contiguous prefix on disk, all of it hashed.
    offset: u64,
    hasher: Sha256,
    /// `[start, end)` ranges on disk beyond the prefix, sorted, disjoint, none touching it.
    beyond: Vec<(u64, u64)>,
    /// Whether `ranges.json` exists (then it says what is on disk).
    recorded: bool,
    /// Bytes written since `ranges.json` was last written.
    unrecorded: u64,
    meta: IngestMeta,
    /// Where bytes are claimed before they are written.
    space: Option<Arc<SpaceBudget>>,
    /// This ingest's entry in the store's in-memory usage.
    account: Arc<IngestAccount>,
}

impl Ingest {
    pub fn digest(&self) -> &Digest {
        &self.digest
    }

    /// The contiguous prefix on disk: what a reader following the download may read.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Bytes of the blob on disk, the prefix and the ranges beyond it.
    pub fn on_disk(&self) -> u64 {
        self.offset + self.beyond.iter().map(|(s, e)| e - s).sum::<u64>()
    }

    /// The `[start, end)` ranges still to fetch, in order.
    pub fn missing(&self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        let mut at = self.offset;
        for &(s, e) in &self.beyond {
            if s > at {
                out.push((at, s));
            }
            at = e;
        }
        if at < self.expected_size {
            out.push((at, self.expected_size));
        }
        out
    }

    pub fn expected_size(&self) -> u64 {
        self.expected_size
    }

    /// The endpoints whose bytes are on disk (the one that wrote last at the end).
    pub fn written_by(&self) -> &[String] {
        &self.meta.written_by
    }

    /// Records that `endpoint` writes bytes from now on (`meta.json`, written when the list
    /// changes): it moves to the end of the list, the writer of the latest bytes last.
    pub fn record_writer(&mut self, endpoint: &str) -> Result<()> {
        if self.meta.written_by.last().is_some_and(|w| w == endpoint) {
            return Ok(());
        }
        self.meta.written_by.retain(|w| w != endpoint);
        if self.meta.written_by.len() >= MAX_WRITERS {
            self.meta.written_by.remove(0);
        }
        self.meta.written_by.push(endpoint.to_string());
        self.write_meta()
    }

    fn write_meta(&self) -> Result<()> {
        let tmp = self.dir.join("meta.json.tmp");
        fs::write(&tmp, serde_json::to_vec(&self.meta).expect("serialisable"))
            .ctx(|| format!("writing {}", tmp.display()))?;
        let dst = self.dir.join("meta.json");
        fs::rename(&tmp, &dst).ctx(|| format!("writing {}", dst.display()))
    }

    /// Appends downloaded bytes at the end of the prefix.
    pub fn append(&mut self, data: &[u8]) -> Result<()> {
        self.write_at(self.offset, data)
    }

    /// Writes downloaded bytes at `pos` of the blob. Fails if they reach past the descriptor's
    /// size. Bytes that extend the prefix are hashed now, with any ranges beyond that it reaches
    /// (read back from the file); bytes already in the prefix are skipped.
    pub fn write_at(&mut self, pos: u64, data: &[u8]) -> Result<()> {
        let end = pos + data.len() as u64;
        if end > self.expected_size {
            return Err(StoreError::SizeMismatch {
                digest: self.digest.to_string(),
                expected: self.expected_size,
                actual: end,
            });
        }
        let skip = self.offset.saturating_sub(pos).min(data.len() as u64) as usize;
        let (pos, data) = (pos + skip as u64, &data[skip..]);
        if data.is_empty() {
            return Ok(());
        }
        if pos > self.offset && !self.recorded {
            // From now on the file's length is no longer the prefix: record what is.
            self.checkpoint()?;
        }
        let n = data.len() as u64;
        if let Some(space) = &self.space {
            space
                .claim(n)
                .map_err(|shortfall| StoreError::ImageFsReserve {
                    what: describe_download(&self.digest, self.expected_size, self.on_disk()),
                    shortfall,
                })?;
        }
        let written = self
            .file
            .as_ref()
            .expect("open ingest")
            .write_all_at(data, pos)
            .ctx(|| format!("writing ingest of {}", self.digest));
        if let Some(space) = &self.space {
            space.settle(n);
        }
        written?;
        if pos == self.offset {
            self.hasher.update(data);
            self.offset = end;
            let reached: Vec<(u64, u64)> = {
                let n = self.beyond.iter().take_while(|(s, _)| *s <= end).count();
                self.beyond.drain(..n).collect()
            };
            if let Some(last) = reached.iter().map(|&(_, e)| e).max().filter(|&e| e > end) {
                self.hash_from_file(last)?;
            }
        } else {
            self.add_beyond(pos, end);
        }
        self.account.bytes.store(self.on_disk(), Ordering::Relaxed);
        if self.recorded {
            self.unrecorded += data.len() as u64;
            if self.unrecorded >= CHECKPOINT_BYTES {
                self.checkpoint()?;
            }
        }
        Ok(())
    }

    /// Merges `[start, end)` (beyond the prefix) into the recorded ranges.
    fn add_beyond(&mut self, start: u64, end: u64) {
        let (mut s, mut e) = (start, end);
        self.beyond.retain(|&(rs, re)| {
            let touches = rs <= e && re >= s;
            if touches {
                s = s.min(rs);
                e = e.max(re);
            }
            !touches
        });
        let at = self.beyond.partition_point(|&(rs, _)| rs < s);
        self.beyond.insert(at, (s, e));
    }

    /// Hashes the file from the prefix's end to `to`, extending the prefix.
    fn hash_from_file(&mut self, to: u64) -> Result<()> {
        let file = self.file.as_ref().expect("open ingest");
        let mut buf = vec![0u8; (to - self.offset).min(1 << 20) as usize];
        while self.offset < to {
            let want = buf.len().min((to - self.offset) as usize);
            file.read_exact_at(&mut buf[..want], self.offset)
                .ctx(|| format!("reading ingest of {}", self.digest))?;
            self.hasher.update(&buf[..want]);
            self.offset += want as u64;
        }
        Ok(())
    }

    /// Writes `ranges.json` (under a temporary name, then renamed): what is on disk now.
    pub fn checkpoint(&mut self) -> Result<()> {
        let ranges = IngestRanges {
            prefix: self.offset,
            beyond: self.beyond.clone(),
        };
        let tmp = self.dir.join("ranges.json.tmp");
        fs::write(&tmp, serde_json::to_vec(&ranges).expect("serialisable"))
            .ctx(|| format!("writing {}", tmp.display()))?;
        let dst = self.dir.join("ranges.json");
        fs::rename(&tmp, &dst).ctx(|| format!("writing {}", dst.display()))?;
        self.recorded = true;
        self.unrecorded = 0;
        Ok(())
    }

    /// Forgets the bytes on disk (the registry sent the whole blob instead of the range asked for).
    pub fn restart(&mut self) -> Result<()> {
        if self.recorded {
            let ranges = self.dir.join("ranges.json");
            match fs::remove_file(&ranges) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(StoreError::io(format!("removing {}", ranges.display()), e));
                }
                _ => self.recorded = false,
            }
        }
        let file = self.file.as_mut().expect("open ingest");
        file.set_len(0)
            .ctx(|| format!("truncating ingest of {}", self.digest))?;
        self.offset = 0;
        self.beyond.clear();
        self.unrecorded = 0;
        self.hasher = Sha256::new();
        self.account.bytes.store(0, Ordering::Relaxed);
        // What comes next is the whole blob from the endpoint that wrote last (recorded as it
        // began to answer); the others' bytes are gone.
        let current = self.meta.written_by.pop();
        self.meta.written_by = current.into_iter().collect();
        self.write_meta()
    }

    /// Verifies size and digest and moves the blob into `blobs/`. On a digest mismatch the partial
    /// data is discarded (it can never become the right blob) and the error is returned.
    pub fn commit(mut self, store: &ContentStore) -> Result<()> {
        if self.offset != self.expected_size {
            return Err(StoreError::SizeMismatch {
                digest: self.digest.to_string(),
                expected: self.expected_size,
                actual: self.on_disk(),
            });
        }
        // Whatever happens next, ranges.json has nothing more to record.
        self.unrecorded = 0;
        let file = self.file.take().expect("open ingest");
        file.sync_all()
            .ctx(|| format!("syncing ingest of {}", self.digest))?;
        drop(file);
        let actual = Digest::from_hasher(std::mem::take(&mut self.hasher));
        if actual != self.digest {
            let _ = fs::remove_dir_all(&self.dir);
            store.forget_ingest(&self.key);
            return Err(StoreError::DigestMismatch {
                expected: self.digest.to_string(),
                actual: actual.to_string(),
                size: self.offset,
            });
        }
        let dst = store.blob_path(&self.digest);
        fs::rename(self.dir.join("data"), &dst).ctx(|| format!("committing {}", dst.display()))?;
        store.forget_ingest(&self.key);
        let _ = fs::remove_dir_all(&self.dir);
        Ok(())
    }
}

impl Drop for Ingest {
    /// A writer that stops (cancelled, failed, or the daemon shutting down) records what it wrote
    /// since the last checkpoint, so a resumed download fetches none of it again.
    fn drop(&mut self) {
        self.account.writing.store(false, Ordering::Relaxed);
        if self.recorded
            && self.unrecorded > 0
            && self.file.is_some()
            && let Err(e) = self.checkpoint()
        {
            tracing::warn!(blob = %self.digest, error = %e, "recording an ingest's ranges");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two pulls storing the same manifest at once: each writes a temporary file of its own, so
    /// neither renames the other's half-written file or finds its own gone.
    #[test]
    fn concurrent_writes_of_one_blob_all_succeed() {
        let dir = tempfile::tempdir().unwrap();
        let store = ContentStore::open(dir.path()).unwrap();
        for round in 0..50u32 {
            let data: Vec<u8> = (0..64 * 1024u32).map(|i| (i ^ round) as u8).collect();
            let d = Digest::of(&data);
            std::thread::scope(|s| {
                for _ in 0..4 {
                    s.spawn(|| store.write(&d, &data).unwrap());
                }
            });
            assert_eq!(store.read(&d).unwrap(), data);
        }
        assert_eq!(fs::read_dir(dir.path().join("tmp")).unwrap().count(), 0);
    }

    #[test]
    fn ingest_resumes_and_verifies() {
        let dir = tempfile::tempdir().unwrap();
        let store = ContentStore::open(dir.path()).unwrap();
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        let d = Digest::of(&data);

        let mut ing = store
            .open_ingest(&BlobKey::new(d.clone(), data.len() as u64))
            .unwrap();
        ing.append(&data[..40_000]).unwrap();
        drop(ing);

        let mut ing = store
            .open_ingest(&BlobKey::new(d.clone(), data.len() as u64))
            .unwrap();
        assert_eq!(ing.offset(), 40_000);
        ing.append(&data[40_000..]).unwrap();
        ing.commit(&store).unwrap();
        assert_eq!(store.read(&d).unwrap(), data);
        assert!(store.list_ingests().unwrap().is_empty());
    }

    /// Pieces written out of order: the prefix grows (hashing what it reaches) only when the
    /// bytes before it are there; a reopened ingest knows every range from its ranges.json and
    /// asks only for the gaps; the committed blob is verified whole.
    #[test]
    fn ranged_pieces_resume_from_their_record_and_verify() {
        let dir = tempfile::tempdir().unwrap();
        let store = ContentStore::open(dir.path()).unwrap();
        let data: Vec<u8> = (0..5_000_000u32).map(|i| (i * 31 + i / 7) as u8).collect();
        let size = data.len() as u64;
        let d = Digest::of(&data);
        let mb = 1_000_000usize;

        let mut ing = store.open_ingest(&BlobKey::new(d.clone(), size)).unwrap();
        assert_eq!(ing.missing(), vec![(0, size)]);
        ing.write_at(2 * mb as u64, &data[2 * mb..3 * mb]).unwrap();
        ing.write_at(4 * mb as u64, &data[4 * mb..4 * mb + 500])
            .unwrap();
        ing.append(&data[..mb / 2]).unwrap();
        assert_eq!(ing.offset(), mb as u64 / 2, "a gap holds the prefix back");
        assert_eq!(ing.on_disk(), mb as u64 / 2 + mb as u64 + 500);
        drop(ing);

        let mut ing = store.open_ingest(&BlobKey::new(d.clone(), size)).unwrap();
        assert_eq!(ing.offset(), mb as u64 / 2);
        assert_eq!(
            ing.missing(),
            vec![
                (mb as u64 / 2, 2 * mb as u64),
                (3 * mb as u64, 4 * mb as u64),
                (4 * mb as u64 + 500, size)
            ]
        );
        // Bytes overlapping what is there are fine (a resent piece).
        ing.write_at(mb as u64 / 4, &data[mb / 4..2 * mb]).unwrap();
        assert_eq!(
            ing.offset(),
            3 * mb as u64,
            "the prefix reached the piece beyond"
        );
        ing.write_at(4 * mb as u64 + 500, &data[4 * mb + 500..])
            .unwrap();
        ing.write_at(3 * mb as u64, &data[3 * mb..4 * mb]).unwrap();
        assert_eq!(ing.offset(), size);
        assert!(ing.missing().is_empty());
        ing.commit(&store).unwrap();
        assert_eq!(std::fs::read(store.blob_path(&d)).unwrap(), data);
        assert!(store.list_ingests().unwrap().is_empty());
    }

    /// A ranges.json that cannot describe the file (say, from a file truncated by hand) is not
    /// trusted: the ingest starts over rather than hashing holes.
    #[test]
    fn an_impossible_record_starts_the_ingest_over() {
        let dir = tempfile::tempdir().unwrap();
        let store = ContentStore::open(dir.path()).unwrap();
        let data = vec![7u8; 10_000];
        let d = Digest::of(&data);
        let mut ing = store.open_ingest(&BlobKey::new(d.clone(), 10_000)).unwrap();
        ing.write_at(5_000, &data[5_000..]).unwrap();
        drop(ing);
        let path = store.ingest_data_path(&BlobKey::new(d.clone(), 10_000));
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(6_000)
            .unwrap();
        let ing = store.open_ingest(&BlobKey::new(d.clone(), 10_000)).unwrap();
        assert_eq!((ing.offset(), ing.on_disk()), (0, 0));
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
    }

    /// The registry ignored a range: restart forgets every piece and the record with them.
    #[test]
    fn restart_forgets_pieces_and_their_record() {
        let dir = tempfile::tempdir().unwrap();
        let store = ContentStore::open(dir.path()).unwrap();
        let data = vec![9u8; 10_000];
        let d = Digest::of(&data);
        let mut ing = store.open_ingest(&BlobKey::new(d.clone(), 10_000)).unwrap();
        ing.write_at(5_000, &data[5_000..]).unwrap();
        ing.restart().unwrap();
        assert_eq!(ing.missing(), vec![(0, 10_000)]);
        ing.append(&data[..3_000]).unwrap();
        drop(ing);
        let ing = store.open_ingest(&BlobKey::new(d.clone(), 10_000)).unwrap();
        assert_eq!((ing.offset(), ing.on_disk()), (3_000, 3_000));
        assert_eq!(store.list_ingests().unwrap()[0].offset, 3_000);
    }

    /// Which endpoints wrote an ingest's bytes survives the writer (a later pull, from any
    /// registry, learns whose bytes it resumes); a restart keeps only the endpoint writing now.
    #[test]
    fn an_ingest_remembers_who_wrote_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let store = ContentStore::open(dir.path()).unwrap();
        let data = vec![7u8; 10_000];
        let d = Digest::of(&data);
        let mut ing = store.open_ingest(&BlobKey::new(d.clone(), 10_000)).unwrap();
        ing.record_writer("https://a.example").unwrap();
        ing.append(&data[..1_000]).unwrap();
        ing.record_writer("https://b.example").unwrap();
        ing.record_writer("https://a.example").unwrap();
        ing.append(&data[1_000..2_000]).unwrap();
        drop(ing);
        let mut ing = store.open_ingest(&BlobKey::new(d.clone(), 10_000)).unwrap();
        assert_eq!(ing.written_by(), ["https://b.example", "https://a.example"]);
        assert_eq!(
            store.list_ingests().unwrap()[0].written_by,
            ["https://b.example", "https://a.example"]
        );
        ing.restart().unwrap();
        assert_eq!(ing.written_by(), ["https://a.example"]);
        for i in 0..2 * MAX_WRITERS {
            ing.record_writer(&format!("https://m{i}.example")).unwrap();
        }
        assert_eq!(ing.written_by().len(), MAX_WRITERS);
        assert_eq!(
            ing.written_by()[0],
            format!("https://m{}.example", MAX_WRITERS)
        );
    }

    #[test]
    fn corrupt_ingest_is_discarded() {
        let dir = tempfile::tempdir().unwrap();
        let store = ContentStore::open(dir.path()).unwrap();
        let d = Digest::of(b"hello");
        let mut ing = store.open_ingest(&BlobKey::new(d.clone(), 5)).unwrap();
        ing.append(b"hellO").unwrap();
        assert!(matches!(
            ing.commit(&store),
            Err(StoreError::DigestMismatch { .. })
        ));
        assert!(store.size(&d).is_none());
        assert!(store.list_ingests().unwrap().is_empty());
        assert!(
            store
                .open_ingest(&BlobKey::new(d.clone(), 5))
                .unwrap()
                .append(b"hello!")
                .is_err()
        );
    }

    /// A filesystem of `cap` bytes whose only contents are the ingest files under `root`.
    struct IngestFs {
        root: PathBuf,
        cap: u64,
    }

    impl crate::space::Measure for IngestFs {
        fn measure(&self) -> std::io::Result<crate::space::FsSpace> {
            let used: u64 = fs::read_dir(self.root.join("ingest"))?
                .flatten()
                .filter_map(|e| fs::metadata(e.path().join("data")).ok())
                .map(|m| m.len())
                .sum();
            Ok(crate::space::FsSpace {
                available: self.cap - used,
                total: self.cap,
            })
        }
    }

    fn store_on(dir: &Path, cap: u64, reserve: crate::space::Reserve) -> ContentStore {
        let budget = SpaceBudget::with_measure(
            dir,
            reserve,
            Box::new(IngestFs {
                root: dir.to_path_buf(),
                cap,
            }),
        );
        ContentStore::open(dir)
            .unwrap()
            .with_space(Arc::new(budget))
    }

    /// A download that would cross the reserve stops before the byte that would, with
    /// RESOURCE_EXHAUSTED naming the blob and the reserve; the reserve stays free; what was
    /// written stays for a resume, which goes on once there is room.
    #[test]
    fn a_download_stops_at_the_reserve_and_keeps_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let mib = 1u64 << 20;
        // 20 MiB, 25% reserved: 15 MiB may be written.
        let store = store_on(dir.path(), 20 * mib, crate::space::Reserve::Percent(25.0));
        let data: Vec<u8> = (0..12 * mib as u32).map(|i| (i % 251) as u8).collect();
        let d = Digest::of(&data);
        let other = vec![1u8; 8 * mib as usize];
        let o = BlobKey::new(Digest::of(&other), other.len() as u64);
        // Both fit alone (each start checks); together they do not.
        let mut a = store
            .open_ingest(&BlobKey::new(d.clone(), data.len() as u64))
            .unwrap();
        let mut b = store.open_ingest(&o).unwrap();
        b.append(&other).unwrap();
        let mut stopped = None;
        for (i, chunk) in data.chunks(64 << 10).enumerate() {
            if let Err(e) = a.append(chunk) {
                stopped = Some((i, e));
                break;
            }
        }
        let (i, e) = stopped.expect("the download stopped");
        assert_eq!(e.kind(), crate::error::ErrorKind::ResourceExhausted, "{e}");
        let text = e.to_string();
        for part in [
            d.as_str(),
            "image_fs_reserve = 25% of 20.0 MiB",
            "kept for a resume",
        ] {
            assert!(text.contains(part), "{part:?} not in {text}");
        }
        assert_eq!(a.offset(), i as u64 * (64 << 10));
        assert!(a.offset() + 8 * mib <= 15 * mib, "the reserve stays free");
        assert!(
            a.offset() + 8 * mib > 15 * mib - (64 << 10),
            "stopped at it, not before"
        );
        let usage = store.ingest_usage();
        assert_eq!(
            (usage.active, usage.active_bytes),
            (2, a.offset() + 8 * mib)
        );
        let kept = a.offset();
        drop(a);
        drop(b);
        store.remove_ingest(&o).unwrap();
        let mut a = store
            .open_ingest(&BlobKey::new(d.clone(), data.len() as u64))
            .unwrap();
        assert_eq!(a.offset(), kept, "resumed where it stopped");
        a.append(&data[kept as usize..]).unwrap();
        a.commit(&store).unwrap();
        assert_eq!(store.read(&d).unwrap(), data);
    }

    /// A download whose missing bytes plainly cannot fit above the reserve is refused when it
    /// opens, before a byte is fetched: nothing is left behind for a blob with nothing on disk,
    /// and the bytes of one with a partial download stay.
    #[test]
    fn a_download_that_cannot_fit_is_refused_before_its_first_byte() {
        let dir = tempfile::tempdir().unwrap();
        let mib = 1u64 << 20;
        let store = store_on(dir.path(), 20 * mib, crate::space::Reserve::Bytes(5 * mib));
        let d = Digest::of(b"a large blob");
        let e = store
            .open_ingest(&BlobKey::new(d.clone(), 15 * mib + 1))
            .unwrap_err();
        assert!(matches!(e, StoreError::ImageFsReserve { .. }), "{e}");
        assert!(
            !store
                .ingest_dir(&BlobKey::new(d.clone(), 15 * mib + 1))
                .exists()
        );
        assert_eq!(store.ingest_usage(), IngestUsage::default());
        let mut ing = store
            .open_ingest(&BlobKey::new(d.clone(), 15 * mib))
            .unwrap();
        ing.append(&vec![3u8; mib as usize]).unwrap();
        drop(ing);
        // The blob grew by a byte (another descriptor): 15 MiB + 1 missing, less the 1 on disk.
        let other = Digest::of(b"another");
        let other = BlobKey::new(other, 4 * mib);
        fs::create_dir_all(store.ingest_dir(&other)).unwrap();
        fs::write(store.ingest_data_path(&other), vec![0u8; 2 * mib as usize]).unwrap();
        let e = store
            .open_ingest(&BlobKey::new(d.clone(), 15 * mib))
            .unwrap_err();
        assert!(matches!(e, StoreError::ImageFsReserve { .. }), "{e}");
        assert_eq!(
            fs::metadata(store.ingest_data_path(&BlobKey::new(d, 15 * mib)))
                .unwrap()
                .len(),
            mib
        );
    }

    /// The ingest usage is kept in memory: counted at open, moved by every write, restart,
    /// commit and removal, split by whether a writer has the ingest open.
    #[test]
    fn ingest_usage_follows_the_writers_without_a_walk() {
        let dir = tempfile::tempdir().unwrap();
        let store = ContentStore::open(dir.path()).unwrap();
        let data = vec![5u8; 10_000];
        let d = Digest::of(&data);
        let mut ing = store.open_ingest(&BlobKey::new(d.clone(), 10_000)).unwrap();
        ing.write_at(6_000, &data[6_000..8_000]).unwrap();
        ing.append(&data[..1_000]).unwrap();
        assert_eq!(
            store.ingest_usage(),
            IngestUsage {
                active: 1,
                active_bytes: 3_000,
                ..Default::default()
            }
        );
        assert_eq!(store.ingest_bytes(&BlobKey::new(d.clone(), 10_000)), 3_000);
        drop(ing);
        let idle = IngestUsage {
            idle: 1,
            idle_bytes: 3_000,
            ..Default::default()
        };
        assert_eq!(store.ingest_usage(), idle);
        // A new store (a restart) counts what is on disk once.
        let store = ContentStore::open(dir.path()).unwrap();
        assert_eq!(store.ingest_usage(), idle);
        let mut ing = store.open_ingest(&BlobKey::new(d.clone(), 10_000)).unwrap();
        ing.restart().unwrap();
        assert_eq!(store.ingest_usage().active_bytes, 0);
        ing.append(&data).unwrap();
        ing.commit(&store).unwrap();
        assert_eq!(store.ingest_usage(), IngestUsage::default());
        let o = BlobKey::new(Digest::of(b"other"), 5);
        store.open_ingest(&o).unwrap().append(b"ot").unwrap();
        assert_eq!(store.ingest_usage().idle_bytes, 2);
        store.remove_ingest(&o).unwrap();
        assert_eq!(store.ingest_usage(), IngestUsage::default());
    }

    /// Bytes past the descriptor's size never reach the disk: the write that would put them
    /// there writes nothing, whether it extends the prefix or lands beyond it.
    #[test]
    fn nothing_past_the_size_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let store = ContentStore::open(dir.path()).unwrap();
        let d = Digest::of(b"0123456789");
        let mut ing = store.open_ingest(&BlobKey::new(d.clone(), 10)).unwrap();
        ing.append(b"01234").unwrap();
        let e = ing.append(b"56789-and-more").unwrap_err();
        assert!(matches!(e, StoreError::SizeMismatch { .. }), "{e}");
        assert!(ing.write_at(8, b"89!").is_err());
        assert_eq!(
            fs::metadata(store.ingest_data_path(&BlobKey::new(d, 10)))
                .unwrap()
                .len(),
            5
        );
        assert_eq!(ing.on_disk(), 5);
    }

    #[test]
    fn write_checks_digest() {
        let dir = tempfile::tempdir().unwrap();
        let store = ContentStore::open(dir.path()).unwrap();
        let d = Digest::of(b"abc");
        assert!(store.write(&d, b"abd").is_err());
        store.write(&d, b"abc").unwrap();
        assert_eq!(store.read(&d).unwrap(), b"abc");
        store.delete(&d).unwrap();
        store.delete(&d).unwrap();
        assert!(matches!(store.read(&d), Err(StoreError::BlobNotFound(_))));
    }
}

//! The content store: immutable, content-addressed blobs and the ingest area that feeds them.
//!
//! Layout under the store root:
//! - `blobs/sha256/<hex>`: committed blobs. A file exists here only after its bytes were verified
//!   against its digest and size; it is written under a temporary name and renamed into place.
//! - `ingest/<hex>/data`: a blob being downloaded. Its length is the resume offset: a later download of
//!   the same blob continues from there (after re-hashing the bytes already on disk).
//!   `ingest/<hex>/meta.json` records the expected size and when the download started.
//!
//! One writer per ingest is enforced by [`ContentStore::lock_ingest`]; committed blobs are never
//! modified, only deleted when no image uses them.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::digest::Digest;
use crate::error::{IoContext, Result, StoreError};

/// Largest manifest or config minicri reads into memory (the distribution spec suggests 4 MiB).
pub const MAX_METADATA_BLOB: u64 = 16 * 1024 * 1024;

/// Root of the content store.
#[derive(Debug)]
pub struct ContentStore {
    root: PathBuf,
    ingest_locks: crate::keyed::KeyedLocks<Digest>,
}

#[derive(Debug, Serialize, Deserialize)]
struct IngestMeta {
    expected_size: u64,
    started_at: chrono::DateTime<chrono::Utc>,
}

/// A partial download found in the ingest area.
#[derive(Debug, Clone)]
pub struct IngestStatus {
    pub digest: Digest,
    pub offset: u64,
    pub expected_size: u64,
    pub updated_at: std::time::SystemTime,
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
        Ok(ContentStore {
            root: root.to_path_buf(),
            ingest_locks: crate::keyed::KeyedLocks::new(),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where a committed blob lives.
    pub fn blob_path(&self, d: &Digest) -> PathBuf {
        self.root.join("blobs/sha256").join(d.hex())
    }

    fn ingest_dir(&self, d: &Digest) -> PathBuf {
        self.root.join("ingest").join(d.hex())
    }

    /// The file a download of `d` is writing (it may not exist).
    pub fn ingest_data_path(&self, d: &Digest) -> PathBuf {
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
        if self.size(d) == Some(data.len() as u64) {
            return Ok(());
        }
        let tmp = self
            .root
            .join("tmp")
            .join(format!("{}.{}", d.hex(), std::process::id()));
        write_synced(&tmp, data)?;
        let dst = self.blob_path(d);
        fs::rename(&tmp, &dst).ctx(|| format!("committing {}", dst.display()))
    }

    /// Takes a committed blob out of the store at once (a rename into `tmp/`, emptied at every
    /// start) and returns where it went, for the caller to delete when it suits; `None` when the
    /// blob is not there.
    pub fn take_out(&self, d: &Digest) -> Result<Option<PathBuf>> {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N: AtomicU64 = AtomicU64::new(0);
        let p = self.blob_path(d);
        let gone = self.root.join("tmp").join(format!(
            "removing-{}-{}-{}",
            d.hex(),
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
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
    pub async fn lock_ingest(&self, d: &Digest) -> tokio::sync::OwnedMutexGuard<()> {
        self.ingest_locks.lock(d).await
    }

    /// Opens the ingest of blob `d` for writing, resuming from the bytes already there.
    /// Blocking (re-hashes the existing prefix); call under the blob's ingest lock.
    pub fn open_ingest(&self, d: &Digest, expected_size: u64) -> Result<Ingest> {
        let dir = self.ingest_dir(d);
        fs::create_dir_all(&dir).ctx(|| format!("creating {}", dir.display()))?;
        let meta_path = dir.join("meta.json");
        if !meta_path.exists() {
            let meta = IngestMeta {
                expected_size,
                started_at: chrono::Utc::now(),
            };
            write_synced(
                &meta_path,
                &serde_json::to_vec(&meta).expect("serialisable"),
            )?;
        }
        let data = dir.join("data");
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&data)
            .ctx(|| format!("opening {}", data.display()))?;
        let mut ingest = Ingest {
            digest: d.clone(),
            expected_size,
            dir,
            file: None,
            offset: 0,
            hasher: Sha256::new(),
        };
        let len = file
            .metadata()
            .ctx(|| format!("stat {}", data.display()))?
            .len();
        if len > expected_size {
            // More bytes than the blob has: not a prefix of it.
            file.set_len(0)
                .ctx(|| format!("truncating {}", data.display()))?;
        } else if len > 0 {
            let mut buf = vec![0u8; 1 << 20];
            let mut f = File::open(&data).ctx(|| format!("opening {}", data.display()))?;
            loop {
                let n = f
                    .read(&mut buf)
                    .ctx(|| format!("reading {}", data.display()))?;
                if n == 0 {
                    break;
                }
                ingest.hasher.update(&buf[..n]);
                ingest.offset += n as u64;
            }
        }
        file.flush().ok();
        ingest.file = Some(file);
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
            let Ok(digest) = Digest::parse(&format!("sha256:{}", e.file_name().to_string_lossy()))
            else {
                continue;
            };
            let data = e.path().join("data");
            let meta: Option<IngestMeta> = fs::read(e.path().join("meta.json"))
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            let (offset, updated_at) = match fs::metadata(&data) {
                Ok(m) => (m.len(), m.modified().unwrap_or(std::time::UNIX_EPOCH)),
                Err(_) => (0, std::time::UNIX_EPOCH),
            };
            out.push(IngestStatus {
                digest,
                offset,
                expected_size: meta.map(|m| m.expected_size).unwrap_or(0),
                updated_at,
            });
        }
        Ok(out)
    }

    /// Drops a partial download.
    pub fn remove_ingest(&self, d: &Digest) -> Result<()> {
        let dir = self.ingest_dir(d);
        match fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
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

/// Writes `data` to `path` and fsyncs it.
pub(crate) fn write_synced(path: &Path, data: &[u8]) -> Result<()> {
    let mut f = File::create(path).ctx(|| format!("creating {}", path.display()))?;
    f.write_all(data)
        .ctx(|| format!("writing {}", path.display()))?;
    f.sync_all().ctx(|| format!("syncing {}", path.display()))
}

/// An open partial download of one blob. Blocking I/O: drive it from a blocking thread.
#[derive(Debug)]
pub struct Ingest {
    digest: Digest,
    expected_size: u64,
    dir: PathBuf,
    file: Option<File>,
    offset: u64,
    hasher: Sha256,
}

impl Ingest {
    pub fn digest(&self) -> &Digest {
        &self.digest
    }

    /// Bytes already on disk: where the download resumes.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    pub fn expected_size(&self) -> u64 {
        self.expected_size
    }

    /// Appends downloaded bytes. Fails if the blob would grow past its descriptor's size.
    pub fn append(&mut self, data: &[u8]) -> Result<()> {
        if self.offset + data.len() as u64 > self.expected_size {
            return Err(StoreError::SizeMismatch {
                digest: self.digest.to_string(),
                expected: self.expected_size,
                actual: self.offset + data.len() as u64,
            });
        }
        let file = self.file.as_mut().expect("open ingest");
        file.write_all(data)
            .ctx(|| format!("writing ingest of {}", self.digest))?;
        self.hasher.update(data);
        self.offset += data.len() as u64;
        Ok(())
    }

    /// Forgets the bytes on disk (the registry sent the whole blob instead of the range asked for).
    pub fn restart(&mut self) -> Result<()> {
        let file = self.file.as_mut().expect("open ingest");
        file.set_len(0)
            .ctx(|| format!("truncating ingest of {}", self.digest))?;
        self.offset = 0;
        self.hasher = Sha256::new();
        Ok(())
    }

    /// Verifies size and digest and moves the blob into `blobs/`. On a digest mismatch the partial
    /// data is discarded (it can never become the right blob) and the error is returned.
    pub fn commit(mut self, store: &ContentStore) -> Result<()> {
        if self.offset != self.expected_size {
            return Err(StoreError::SizeMismatch {
                digest: self.digest.to_string(),
                expected: self.expected_size,
                actual: self.offset,
            });
        }
        let file = self.file.take().expect("open ingest");
        file.sync_all()
            .ctx(|| format!("syncing ingest of {}", self.digest))?;
        drop(file);
        let actual = Digest::from_hasher(std::mem::take(&mut self.hasher));
        if actual != self.digest {
            let _ = fs::remove_dir_all(&self.dir);
            return Err(StoreError::DigestMismatch {
                expected: self.digest.to_string(),
                actual: actual.to_string(),
                size: self.offset,
            });
        }
        let dst = store.blob_path(&self.digest);
        fs::rename(self.dir.join("data"), &dst).ctx(|| format!("committing {}", dst.display()))?;
        let _ = fs::remove_dir_all(&self.dir);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ingest_resumes_and_verifies() {
        let dir = tempfile::tempdir().unwrap();
        let store = ContentStore::open(dir.path()).unwrap();
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        let d = Digest::of(&data);

        let mut ing = store.open_ingest(&d, data.len() as u64).unwrap();
        ing.append(&data[..40_000]).unwrap();
        drop(ing);

        let mut ing = store.open_ingest(&d, data.len() as u64).unwrap();
        assert_eq!(ing.offset(), 40_000);
        ing.append(&data[40_000..]).unwrap();
        ing.commit(&store).unwrap();
        assert_eq!(store.read(&d).unwrap(), data);
        assert!(store.list_ingests().unwrap().is_empty());
    }

    #[test]
    fn corrupt_ingest_is_discarded() {
        let dir = tempfile::tempdir().unwrap();
        let store = ContentStore::open(dir.path()).unwrap();
        let d = Digest::of(b"hello");
        let mut ing = store.open_ingest(&d, 5).unwrap();
        ing.append(b"hellO").unwrap();
        assert!(matches!(
            ing.commit(&store),
            Err(StoreError::DigestMismatch { .. })
        ));
        assert!(store.size(&d).is_none());
        assert!(store.list_ingests().unwrap().is_empty());
        assert!(store.open_ingest(&d, 5).unwrap().append(b"hello!").is_err());
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

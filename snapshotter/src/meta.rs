//! Persistent snapshot records: one JSON file per snapshot in `<root>/meta/<id>.json`, written by
//! atomic rename, and the in-memory index built from them.
//!
//! Invariants:
//! - a snapshot exists exactly when its record file does. The record is written *after* its data
//!   directory `<root>/snapshots/<id>` is in place and deleted *before* that directory goes, so a crash
//!   leaves at worst a data directory without a record, which [`Records::load`] reports for removal;
//! - ids are never reused within a root (the next id is past every id on disk), so a late deletion of
//!   an old data directory cannot hit a new snapshot;
//! - a record's parent, if any, is itself a record (loading drops records whose parent went missing).

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, IoContext, Result};
use crate::snapshotter::{Info, Kind};

/// What is persisted about one snapshot.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Record {
    /// Names the data directory `<root>/snapshots/<id>`.
    pub(crate) id: u64,
    pub(crate) key: String,
    pub(crate) kind: Kind,
    pub(crate) parent: Option<String>,
    #[serde(default)]
    pub(crate) users: BTreeSet<String>,
    pub(crate) created: u64,
    #[serde(default)]
    pub(crate) layer_size: Option<u64>,
}

impl Record {
    pub(crate) fn info(&self) -> Info {
        Info {
            key: self.key.clone(),
            kind: self.kind,
            parent: self.parent.clone(),
            users: self.users.clone(),
            created: self.created,
            layer_size: self.layer_size,
        }
    }
}

/// The record index of one snapshotter root.
pub(crate) struct Records {
    dir: PathBuf,
    by_key: HashMap<String, Record>,
    next_id: u64,
}

/// Seconds since the epoch, for `created`.
pub(crate) fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl Records {
    /// Loads every record from `meta_dir`. `data_dir` holds the snapshots' directories; returns the
    /// ids of data directories that have no usable record (to delete).
    pub(crate) fn load(meta_dir: &Path, data_dir: &Path) -> Result<(Self, Vec<u64>)> {
        let mut by_key = HashMap::new();
        let mut max_id = 0;
        for e in fs::read_dir(meta_dir).ctx(|| format!("reading {}", meta_dir.display()))? {
            let path = e.ctx(|| format!("reading {}", meta_dir.display()))?.path();
            if path.extension().and_then(|x| x.to_str()) != Some("json") {
                // A leftover `.tmp` from a write the daemon did not finish.
                let _ = fs::remove_file(&path);
                continue;
            }
            let bytes = fs::read(&path).ctx(|| format!("reading {}", path.display()))?;
            let rec: Record = serde_json::from_slice(&bytes).map_err(|source| Error::Record {
                path: path.clone(),
                source,
            })?;
            max_id = max_id.max(rec.id);
            if !data_dir.join(rec.id.to_string()).is_dir() {
                tracing::warn!(key = %rec.key, id = rec.id, "snapshot data missing; dropping record");
                let _ = fs::remove_file(&path);
                continue;
            }
            by_key.insert(rec.key.clone(), rec);
        }
        // Drop records whose parent is gone, repeatedly (their chain cannot be mounted).
        loop {
            let orphans: Vec<String> = by_key
                .values()
                .filter(|r| r.parent.as_ref().is_some_and(|p| !by_key.contains_key(p)))
                .map(|r| r.key.clone())
                .collect();
            if orphans.is_empty() {
                break;
            }
            for key in orphans {
                let rec = by_key.remove(&key).expect("listed above");
                tracing::warn!(key = %rec.key, "snapshot parent missing; dropping record");
                let _ = fs::remove_file(meta_dir.join(format!("{}.json", rec.id)));
            }
        }
        let live: BTreeSet<u64> = by_key.values().map(|r| r.id).collect();
        let mut stray = Vec::new();
        for e in fs::read_dir(data_dir).ctx(|| format!("reading {}", data_dir.display()))? {
            let name = e
                .ctx(|| format!("reading {}", data_dir.display()))?
                .file_name();
            match name.to_str().and_then(|n| n.parse::<u64>().ok()) {
                Some(id) => {
                    max_id = max_id.max(id);
                    if !live.contains(&id) {
                        stray.push(id);
                    }
                }
                None => tracing::warn!(?name, "unexpected entry in snapshot directory"),
            }
        }
        let records = Records {
            dir: meta_dir.to_path_buf(),
            by_key,
            next_id: max_id + 1,
        };
        Ok((records, stray))
    }

    pub(crate) fn get(&self, key: &str) -> Option<&Record> {
        self.by_key.get(key)
    }

    pub(crate) fn all(&self) -> impl Iterator<Item = &Record> {
        self.by_key.values()
    }

    pub(crate) fn has_children(&self, key: &str) -> bool {
        self.by_key
            .values()
            .any(|r| r.parent.as_deref() == Some(key))
    }

    /// `key` and its ancestors, `key` first.
    pub(crate) fn chain(&self, key: &str) -> Vec<&Record> {
        let mut out = Vec::new();
        let mut next = self.by_key.get(key);
        while let Some(r) = next {
            out.push(r);
            next = r.parent.as_deref().and_then(|p| self.by_key.get(p));
        }
        out
    }

    pub(crate) fn alloc_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// Writes `rec` to disk and indexes it, replacing the record under `old_key` if given (a commit
    /// renames a snapshot).
    pub(crate) fn put(&mut self, rec: Record, old_key: Option<&str>) -> Result<()> {
        let path = self.dir.join(format!("{}.json", rec.id));
        let bytes = serde_json::to_vec_pretty(&rec).map_err(|source| Error::Record {
            path: path.clone(),
            source,
        })?;
        crate::fsutil::write_atomic(&path, &bytes, 0o644)
            .ctx(|| format!("writing {}", path.display()))?;
        if let Some(old) = old_key {
            self.by_key.remove(old);
        }
        self.by_key.insert(rec.key.clone(), rec);
        Ok(())
    }

    /// Deletes the record of `key` from disk and the index.
    pub(crate) fn delete(&mut self, key: &str) -> Result<Record> {
        let rec = self
            .by_key
            .get(key)
            .ok_or_else(|| Error::NotFound { key: key.into() })?;
        let path = self.dir.join(format!("{}.json", rec.id));
        fs::remove_file(&path).ctx(|| format!("removing {}", path.display()))?;
        Ok(self.by_key.remove(key).expect("checked above"))
    }
}

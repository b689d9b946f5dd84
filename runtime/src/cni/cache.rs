//! The per-sandbox CNI cache: `<state>/cni/cache/<container-id>.json`.
//!
//! Owns what DEL and CHECK need to repeat an ADD faithfully after the configuration files changed
//! or the daemon restarted: the network configuration list that was used, the `CNI_ARGS`, the
//! capability arguments and the final result (spec: DEL and CHECK get the result of the previous
//! ADD as `prevResult`; the runtime must delete the cached result on a successful DEL).
//!
//! Invariants: an entry is written (with `result: null`) before the first plugin's ADD runs, so a
//! crash half-way still leaves the configuration that DEL must use; it is completed after the last
//! plugin succeeds; it is removed only after a DEL of the whole list succeeded. Writes are atomic
//! (temporary file, then rename).

use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::CniError;

const KIND: &str = "minicri-cni-cache/v1";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CacheEntry {
    pub kind: String,
    pub container_id: String,
    pub if_name: String,
    pub netns: PathBuf,
    pub cni_args: String,
    /// The network configuration list, in list form (see `NetworkConfigList::to_value`).
    pub config: Value,
    pub config_source: Option<PathBuf>,
    pub capability_args: Map<String, Value>,
    /// The last plugin's ADD result; `None` while ADD is under way (or failed half-way).
    pub result: Option<Value>,
}

impl CacheEntry {
    pub fn new(
        container_id: &str,
        if_name: &str,
        netns: &Path,
        cni_args: String,
        config: Value,
        config_source: Option<PathBuf>,
        capability_args: Map<String, Value>,
    ) -> Self {
        CacheEntry {
            kind: KIND.into(),
            container_id: container_id.into(),
            if_name: if_name.into(),
            netns: netns.into(),
            cni_args,
            config,
            config_source,
            capability_args,
            result: None,
        }
    }
}

/// The cache directory and its files.
#[derive(Debug, Clone)]
pub struct Cache {
    dir: PathBuf,
}

impl Cache {
    pub fn new(dir: PathBuf) -> Self {
        Cache { dir }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file of `id` (a validated container id, so a plain file name).
    pub fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    fn io_err(&self, id: &str) -> impl FnOnce(io::Error) -> CniError {
        let path = self.path(id);
        move |source| CniError::Cache { path, source }
    }

    /// The ids that have an entry.
    pub fn ids(&self) -> Vec<String> {
        std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                name.strip_suffix(".json").map(str::to_string)
            })
            .collect()
    }

    /// The entry of `id`; `None` when there is none, or it is unreadable (logged: DEL then falls
    /// back to the current configuration).
    pub fn read(&self, id: &str) -> Option<CacheEntry> {
        let path = self.path(id);
        let bytes = match minicri_store::fsutil::off_async(|| std::fs::read(&path)) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot read the CNI cache");
                return None;
            }
        };
        match serde_json::from_slice::<CacheEntry>(&bytes) {
            Ok(e) if e.kind == KIND => Some(e),
            Ok(e) => {
                tracing::warn!(path = %path.display(), kind = %e.kind, "unknown CNI cache format");
                None
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "corrupt CNI cache");
                None
            }
        }
    }

    /// Writes the entry atomically (two fsyncs: off the async workers).
    pub fn write(&self, entry: &CacheEntry) -> Result<(), CniError> {
        let id = &entry.container_id;
        let path = self.path(id);
        let bytes = serde_json::to_vec_pretty(entry).expect("plain data serialises");
        minicri_store::fsutil::off_async(|| {
            std::fs::create_dir_all(&self.dir)?;
            minicri_snapshotter::write_atomic(&path, &bytes, 0o600)
        })
        .map_err(self.io_err(id))
    }

    /// Removes the entry of `id`; fine when there is none.
    pub fn remove(&self, id: &str) -> Result<(), CniError> {
        match minicri_store::fsutil::off_async(|| std::fs::remove_file(self.path(id))) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(self.io_err(id)(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_remove() {
        let d = tempfile::tempdir().unwrap();
        let cache = Cache::new(d.path().join("cache"));
        assert!(cache.read("c1").is_none());
        cache.remove("c1").unwrap();
        let mut e = CacheEntry::new(
            "c1",
            "eth0",
            Path::new("/n"),
            "A=1".into(),
            serde_json::json!({"name": "x"}),
            None,
            Map::new(),
        );
        cache.write(&e).unwrap();
        assert_eq!(cache.read("c1").unwrap(), e);
        e.result = Some(serde_json::json!({"cniVersion": "1.0.0"}));
        cache.write(&e).unwrap();
        assert_eq!(cache.read("c1").unwrap().result, e.result);
        cache.remove("c1").unwrap();
        assert!(cache.read("c1").is_none());
        std::fs::write(cache.path("bad"), "{").unwrap();
        assert!(cache.read("bad").is_none());
    }
}

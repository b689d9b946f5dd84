//! Image records: what the CRI calls images, keyed by image id (the config digest).
//!
//! One JSON file per image under `<root>/images/<hex>.json`, written by atomic rename, and an in-memory
//! index from every name (tag and digest reference) to its image. A name points to one image: pulling a
//! tag that moved takes it off the old image, and an image left with no name is removed.
//!
//! Blob lifetime: a record lists every blob it holds (index, manifest, config, layers). Adding a record
//! checks those blobs are present; removing one deletes the blobs no remaining record holds. Both happen
//! under the same lock, so a blob is never deleted out from under an image being recorded.

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::content::{ContentStore, write_synced};
use crate::digest::Digest;
use crate::error::{IoContext, Result, StoreError};
use crate::reference::Reference;

/// A layer as the manifest describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerRecord {
    pub digest: Digest,
    pub size: u64,
    pub media_type: String,
}

/// A pulled image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRecord {
    /// The image id: the digest of its config.
    pub id: Digest,
    /// `domain/path:tag` names.
    pub repo_tags: Vec<String>,
    /// `domain/path@digest` names; the digest is the one the registry resolved (an index's, if any).
    pub repo_digests: Vec<String>,
    /// The platform manifest the image was pulled from.
    pub manifest: Digest,
    pub config: Digest,
    pub layers: Vec<LayerRecord>,
    /// Uncompressed layer digests from the config's rootfs.
    pub diff_ids: Vec<String>,
    /// Bytes of the image's blobs (manifest, config, compressed layers).
    pub size: u64,
    /// From the config's `User` when it is numeric.
    pub uid: Option<i64>,
    /// From the config's `User` when it is a name.
    pub username: String,
    /// Pinned images are kept by the runtime (its own sandbox image).
    pub pinned: bool,
    /// `os/arch[/variant]`.
    pub platform: String,
    /// Every blob this record keeps alive.
    pub blobs: BTreeSet<Digest>,
    /// Chain id of the image's top layer snapshot, once unpacked (the image id is its user).
    #[serde(default)]
    pub chain_id: Option<String>,
    pub pulled_at: chrono::DateTime<chrono::Utc>,
}

impl ImageRecord {
    fn names(&self) -> impl Iterator<Item = &String> {
        self.repo_tags.iter().chain(self.repo_digests.iter())
    }
}

/// What a removal freed.
#[derive(Debug, Default)]
pub struct Removed {
    pub images: Vec<ImageRecord>,
    pub deleted_blobs: Vec<Digest>,
}

#[derive(Default)]
struct State {
    images: HashMap<Digest, ImageRecord>,
    names: HashMap<String, Digest>,
}

/// The image records of one minicri root.
pub struct ImageStore {
    dir: PathBuf,
    state: Mutex<State>,
}

impl ImageStore {
    /// Loads every record under `<root>/images`. Records whose config blob is missing are dropped
    /// with a warning: they cannot be used.
    pub fn open(root: &Path, content: &ContentStore) -> Result<ImageStore> {
        let dir = root.join("images");
        fs::create_dir_all(&dir).ctx(|| format!("creating {}", dir.display()))?;
        let mut state = State::default();
        for e in fs::read_dir(&dir)
            .ctx(|| format!("listing {}", dir.display()))?
            .flatten()
        {
            let path = e.path();
            if path.extension().is_none_or(|x| x != "json") {
                let _ = fs::remove_file(&path); // an interrupted write's temporary file
                continue;
            }
            let rec: ImageRecord = match fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
            {
                Ok(r) => r,
                Err(err) => {
                    tracing::warn!(path = %path.display(), %err, "ignoring unreadable image record");
                    continue;
                }
            };
            if let Some(missing) = rec.blobs.iter().find(|d| content.size(d).is_none()) {
                tracing::warn!(image = %rec.id, blob = %missing, "dropping image record whose content is missing");
                let _ = fs::remove_file(&path);
                continue;
            }
            for n in rec.names() {
                state.names.insert(n.clone(), rec.id.clone());
            }
            state.images.insert(rec.id.clone(), rec);
        }
        Ok(ImageStore {
            dir,
            state: Mutex::new(state),
        })
    }

    fn record_path(&self, id: &Digest) -> PathBuf {
        self.dir.join(format!("{}.json", id.hex()))
    }

    fn persist(&self, rec: &ImageRecord) -> Result<()> {
        let tmp = self.dir.join(format!("{}.tmp", rec.id.hex()));
        write_synced(&tmp, &serde_json::to_vec_pretty(rec).expect("serialisable"))?;
        let dst = self.record_path(&rec.id);
        fs::rename(&tmp, &dst).ctx(|| format!("committing {}", dst.display()))
    }

    /// Records a pulled image, merging names into an existing record of the same id and moving names
    /// off other images. Fails if one of its blobs is not in `content` (removed concurrently).
    /// Returns the stored record and what was freed by names moving away.
    pub fn add(&self, rec: ImageRecord, content: &ContentStore) -> Result<(ImageRecord, Removed)> {
        let mut st = self.state.lock().unwrap();
        if let Some(missing) = rec.blobs.iter().find(|d| content.size(d).is_none()) {
            return Err(StoreError::BlobNotFound(missing.to_string()));
        }
        let mut merged = match st.images.get(&rec.id) {
            Some(old) => {
                let mut m = old.clone();
                for t in &rec.repo_tags {
                    if !m.repo_tags.contains(t) {
                        m.repo_tags.push(t.clone());
                    }
                }
                for d in &rec.repo_digests {
                    if !m.repo_digests.contains(d) {
                        m.repo_digests.push(d.clone());
                    }
                }
                m.blobs.extend(rec.blobs.iter().cloned());
                if rec.chain_id.is_some() {
                    m.chain_id = rec.chain_id.clone();
                }
                m.pinned |= rec.pinned;
                m
            }
            None => rec,
        };
        merged.repo_tags.sort();
        merged.repo_digests.sort();
        // Names move to the new image; images left without names go.
        let mut emptied = Vec::new();
        for name in merged.names() {
            if let Some(prev) = st.names.get(name).filter(|p| **p != merged.id).cloned() {
                let old = st.images.get_mut(&prev).expect("index consistent");
                old.repo_tags.retain(|n| n != name);
                old.repo_digests.retain(|n| n != name);
                if old.repo_tags.is_empty() && old.repo_digests.is_empty() && !old.pinned {
                    emptied.push(prev);
                } else {
                    let old = old.clone();
                    self.persist(&old)?;
                }
            }
        }
        self.persist(&merged)?;
        for n in merged.names() {
            st.names.insert(n.clone(), merged.id.clone());
        }
        st.images.insert(merged.id.clone(), merged.clone());
        let mut removed = Removed::default();
        for id in emptied {
            self.remove_locked(&mut st, &id, content, &mut removed)?;
        }
        Ok((merged, removed))
    }

    /// Finds an image by id (`sha256:<hex>`, the bare hex, or an unambiguous hex prefix of at least 12),
    /// by name (`busybox`, `repo:tag`) or by digest reference (`repo@sha256:…`).
    pub fn get(&self, name_or_id: &str) -> Result<Option<ImageRecord>> {
        let st = self.state.lock().unwrap();
        Ok(Self::resolve(&st, name_or_id)?.and_then(|id| st.images.get(&id).cloned()))
    }

    fn resolve(st: &State, s: &str) -> Result<Option<Digest>> {
        if let Ok(d) = Digest::parse(s) {
            return Ok(st.images.contains_key(&d).then_some(d));
        }
        let is_hex = s.len() >= 12 && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_hexdigit());
        let by_name = match Reference::parse(s) {
            Ok(r) => {
                let key = match (&r.digest, r.tagged()) {
                    (Some(d), _) => r.with_digest(d),
                    (None, Some(t)) => t,
                    (None, None) => unreachable!("normalised references have a tag or digest"),
                };
                st.names.get(&key).cloned()
            }
            Err(e) if !is_hex => return Err(e),
            Err(_) => None,
        };
        if by_name.is_some() || !is_hex {
            return Ok(by_name);
        }
        let mut matches = st
            .images
            .keys()
            .filter(|d| d.hex().starts_with(&s.to_ascii_lowercase()));
        match (matches.next(), matches.next()) {
            (Some(d), None) => Ok(Some(d.clone())),
            _ => Ok(None),
        }
    }

    /// Every image, in a stable order.
    pub fn list(&self) -> Vec<ImageRecord> {
        let st = self.state.lock().unwrap();
        let mut v: Vec<_> = st.images.values().cloned().collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    /// Removes the image `name_or_id` names, with all its names, and deletes the blobs no other image
    /// holds. Removing an unknown image is not an error (`Removed` is empty).
    pub fn remove(&self, name_or_id: &str, content: &ContentStore) -> Result<Removed> {
        let mut st = self.state.lock().unwrap();
        let mut removed = Removed::default();
        if let Some(id) = Self::resolve(&st, name_or_id)? {
            self.remove_locked(&mut st, &id, content, &mut removed)?;
        }
        Ok(removed)
    }

    fn remove_locked(
        &self,
        st: &mut State,
        id: &Digest,
        content: &ContentStore,
        out: &mut Removed,
    ) -> Result<()> {
        let Some(rec) = st.images.remove(id) else {
            return Ok(());
        };
        let path = self.record_path(id);
        if let Err(e) = fs::remove_file(&path)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            st.images.insert(id.clone(), rec);
            return Err(StoreError::io(format!("removing {}", path.display()), e));
        }
        st.names.retain(|_, v| v != id);
        let still_used: BTreeSet<&Digest> =
            st.images.values().flat_map(|r| r.blobs.iter()).collect();
        for b in rec.blobs.iter().filter(|b| !still_used.contains(b)) {
            content.delete(b)?;
            out.deleted_blobs.push(b.clone());
        }
        out.images.push(rec);
        Ok(())
    }
}

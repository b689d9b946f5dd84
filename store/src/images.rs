//! Image records: what the CRI calls images, keyed by image id (the config digest).
//!
//! One JSON file per image under `<root>/images/<hex>.json`, written by atomic rename, and an in-memory
//! index from every name (tag and digest reference) to its image. A name points to one image: pulling a
//! tag that moved takes it off the old image, and an image left with no name is removed.
//!
//! Blob lifetime: a record lists every blob it holds (index, manifest, config, layers). Adding a record
//! checks those blobs are present; removing one deletes the blobs no remaining record holds. Both happen
//! under the same operation lock, so a blob is never deleted out from under an image being recorded.
//!
//! Never stalling readers: the kubelet lists images and asks for their status every second, while
//! pulls record images and its garbage collector removes them. Changes are serialised by an
//! operation lock held across their file work; the index readers use is locked only to read it and
//! to install a change already on disk. A removal takes the record away at once (journaled under
//! `images/removing/`); the blobs it frees are deleted afterwards by [`ImageStore::finish_removal`],
//! off the caller's path. A removal interrupted by a crash is finished at the next open, and a
//! blob being deleted is never visible to a new record: it is taken out of the store first.
//!
//! Images in use as volumes: a container that mounts an image as a volume (CRI `Mount.image`)
//! is recorded as a *volume user* of it ([`ImageStore::add_volume_user`]) until it is torn
//! down. While an image has volume users, [`ImageStore::remove`] refuses it (naming them), and a
//! pull that moves its last name elsewhere keeps it as an image without names instead of
//! removing it; it goes with its last volume user then. Volume users live in memory only: the
//! runtime restores them from its container records at start, before the CRI is served, then
//! drops the nameless images nobody uses any more ([`ImageStore::remove_unused_nameless`]).

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::content::ContentStore;
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

/// What a removal took away: the records, and the blobs no other record held, to delete with
/// [`ImageStore::finish_removal`].
#[derive(Debug, Default)]
pub struct Removed {
    pub images: Vec<ImageRecord>,
    pub freed_blobs: Vec<Digest>,
    /// The removal journals to drop once the blobs are gone.
    journals: Vec<PathBuf>,
}

impl Removed {
    pub fn is_empty(&self) -> bool {
        self.images.is_empty()
    }
}

/// A removal in progress, as journaled: the blobs to delete.
#[derive(Serialize, Deserialize)]
struct Journal {
    id: Digest,
    blobs: Vec<Digest>,
    /// When the removal began: a record of the image pulled again later is not removed with it.
    at: chrono::DateTime<chrono::Utc>,
}

#[derive(Default, Clone)]
struct State {
    images: HashMap<Digest, ImageRecord>,
    names: HashMap<String, Digest>,
    /// The containers whose image volumes use each image (only images with at least one).
    volume_users: HashMap<Digest, BTreeSet<String>>,
}

/// How many containers an "in use" refusal names; the rest are counted.
const NAMED_VOLUME_USERS: usize = 5;

/// The image records of one minicri root.
pub struct ImageStore {
    dir: PathBuf,
    state: Mutex<State>,
    /// Serialises changes (records and blob deletions); readers never take it.
    ops: Mutex<()>,
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
        let store = ImageStore {
            dir,
            state: Mutex::new(state),
            ops: Mutex::new(()),
        };
        store.finish_interrupted_removals(content);
        Ok(store)
    }

    fn journal_dir(&self) -> PathBuf {
        self.dir.join("removing")
    }

    /// Removals a crash interrupted: their records are gone; their blobs go now.
    fn finish_interrupted_removals(&self, content: &ContentStore) {
        let Ok(entries) = fs::read_dir(self.journal_dir()) else {
            return;
        };
        let mut removed = Removed::default();
        for e in entries.flatten() {
            let path = e.path();
            match fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice::<Journal>(&b).ok())
            {
                Some(j) => {
                    tracing::info!(image = %j.id, blobs = j.blobs.len(), "finishing an interrupted image removal");
                    // Killed between the journal and the record's removal: the record goes now.
                    let mut st = self.state.lock().unwrap().clone();
                    if st.images.get(&j.id).is_some_and(|r| r.pulled_at <= j.at) {
                        let mut again = Removed::default();
                        if self.remove_record(&mut st, &j.id, &mut again).is_ok() {
                            *self.state.lock().unwrap() = st;
                            removed.images.extend(again.images);
                            removed.freed_blobs.extend(again.freed_blobs);
                            removed.journals.extend(again.journals);
                        }
                    }
                    removed.freed_blobs.extend(j.blobs);
                    removed.journals.push(path);
                }
                None => {
                    let _ = fs::remove_file(&path);
                }
            }
        }
        if let Err(e) = self.finish_removal(&removed, content) {
            tracing::warn!(error = %e, "cannot finish interrupted image removals");
        }
    }

    fn ops(&self) -> std::sync::MutexGuard<'_, ()> {
        self.ops.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn record_path(&self, id: &Digest) -> PathBuf {
        self.dir.join(format!("{}.json", id.hex()))
    }

    fn persist(&self, rec: &ImageRecord) -> Result<()> {
        let dst = self.record_path(&rec.id);
        let bytes = serde_json::to_vec_pretty(rec).expect("serialisable");
        crate::fsutil::off_async(|| minicri_snapshotter::write_atomic(&dst, &bytes, 0o600))
            .ctx(|| format!("writing {}", dst.display()))
    }

    /// Records a pulled image, merging names into an existing record of the same id and moving names
    /// off other images. Fails if one of its blobs is not in `content` (removed concurrently).
    /// Returns the stored record and what was freed by names moving away.
    pub fn add(&self, rec: ImageRecord, content: &ContentStore) -> Result<(ImageRecord, Removed)> {
        let _ops = self.ops();
        if let Some(missing) = rec.blobs.iter().find(|d| content.size(d).is_none()) {
            return Err(StoreError::BlobNotFound(missing.to_string()));
        }
        // Work on a copy of the index; readers keep the old one until the files are written.
        let mut st = self.state.lock().unwrap().clone();
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
                // An image a container's volume uses stays, without names, until it is torn down.
                if old.repo_tags.is_empty()
                    && old.repo_digests.is_empty()
                    && !old.pinned
                    && !st.volume_users.contains_key(&prev)
                {
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
            self.remove_record(&mut st, &id, &mut removed)?;
        }
        *self.state.lock().unwrap() = st;
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

    /// Removes the image `name_or_id` names, with all its names: its record goes at once; the
    /// blobs no other image holds are returned, to delete with [`ImageStore::finish_removal`].
    /// Removing an unknown image is not an error (`Removed` is empty). An image that containers'
    /// volumes use is refused ([`StoreError::ImageInUse`], naming them).
    pub fn remove(&self, name_or_id: &str) -> Result<Removed> {
        let _ops = self.ops();
        let mut removed = Removed::default();
        let id = Self::resolve(&self.state.lock().unwrap(), name_or_id)?;
        if let Some(id) = id {
            if let Some(users) = self.state.lock().unwrap().volume_users.get(&id) {
                return Err(in_use(&id, users));
            }
            let mut st = self.state.lock().unwrap().clone();
            self.remove_record(&mut st, &id, &mut removed)?;
            *self.state.lock().unwrap() = st;
        }
        Ok(removed)
    }

    /// Records container `container` as using image `id` (`sha256:…`) as a volume: the image is
    /// not removed until [`ImageStore::remove_volume_user`]. NOT_FOUND when the image is not
    /// there (removed since it was looked up). Idempotent.
    pub fn add_volume_user(&self, id: &Digest, container: &str) -> Result<()> {
        let _ops = self.ops();
        let mut st = self.state.lock().unwrap();
        if !st.images.contains_key(id) {
            return Err(StoreError::ImageNotFound(id.to_string()));
        }
        st.volume_users
            .entry(id.clone())
            .or_default()
            .insert(container.to_string());
        Ok(())
    }

    /// Container `container` no longer uses image `id` as a volume. An image left without
    /// names (a pull moved them elsewhere meanwhile) and without volume users is removed; what
    /// that frees is returned, for [`ImageStore::finish_removal`]. Idempotent.
    pub fn remove_volume_user(&self, id: &Digest, container: &str) -> Result<Removed> {
        let _ops = self.ops();
        let mut removed = Removed::default();
        let mut st = self.state.lock().unwrap().clone();
        let Some(users) = st.volume_users.get_mut(id) else {
            return Ok(removed);
        };
        users.remove(container);
        if users.is_empty() {
            st.volume_users.remove(id);
            if st.images.get(id).is_some_and(is_unused_nameless) {
                self.remove_record(&mut st, id, &mut removed)?;
            }
        }
        *self.state.lock().unwrap() = st;
        Ok(removed)
    }

    /// The containers whose volumes use image `id`, sorted.
    pub fn volume_users(&self, id: &Digest) -> Vec<String> {
        let st = self.state.lock().unwrap();
        st.volume_users
            .get(id)
            .map(|u| u.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// Removes the images without names, not pinned, that no container's volume uses: those a
    /// pull took the last name of while a volume used them, whose users went while the daemon
    /// was down. Called once the volume users are restored at start.
    pub fn remove_unused_nameless(&self) -> Result<Removed> {
        let _ops = self.ops();
        let mut removed = Removed::default();
        let mut st = self.state.lock().unwrap().clone();
        let unused: Vec<Digest> = st
            .images
            .values()
            .filter(|r| is_unused_nameless(r) && !st.volume_users.contains_key(&r.id))
            .map(|r| r.id.clone())
            .collect();
        for id in unused {
            self.remove_record(&mut st, &id, &mut removed)?;
        }
        *self.state.lock().unwrap() = st;
        Ok(removed)
    }

    /// Takes the record `id` out of `st` and off disk, journaling the blobs it frees (under the
    /// operation lock).
    fn remove_record(&self, st: &mut State, id: &Digest, out: &mut Removed) -> Result<()> {
        let Some(rec) = st.images.remove(id) else {
            return Ok(());
        };
        st.names.retain(|_, v| v != id);
        let still_used: BTreeSet<&Digest> =
            st.images.values().flat_map(|r| r.blobs.iter()).collect();
        let freed: Vec<Digest> = rec
            .blobs
            .iter()
            .filter(|b| !still_used.contains(b))
            .cloned()
            .collect();
        // The journal first: a crash after the record's removal still frees the blobs.
        let journal = self.journal_dir().join(format!("{}.json", id.hex()));
        let bytes = serde_json::to_vec(&Journal {
            id: id.clone(),
            blobs: freed.clone(),
            at: chrono::Utc::now(),
        })
        .expect("serialisable");
        let path = self.record_path(id);
        crate::fsutil::off_async(|| -> std::io::Result<()> {
            fs::create_dir_all(self.journal_dir())?;
            minicri_snapshotter::write_atomic(&journal, &bytes, 0o600)?;
            match fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                _ => minicri_snapshotter::sync_dir(&self.dir),
            }
        })
        .ctx(|| format!("removing image record {}", path.display()))?;
        out.freed_blobs.extend(freed);
        out.journals.push(journal);
        out.images.push(rec);
        Ok(())
    }

    /// Deletes the blobs a removal freed, unless an image recorded since holds them, and drops
    /// its journals. Blocking: run it off the caller's path.
    pub fn finish_removal(&self, removed: &Removed, content: &ContentStore) -> Result<()> {
        let mut gone = Vec::new();
        {
            // Records change only under `ops`, so what is unused now stays unused while the
            // blobs are renamed away; `state` is let go first, for ListImages and ImageStatus.
            let _ops = self.ops();
            let unused: Vec<&Digest> = {
                let st = self.state.lock().unwrap();
                let used: BTreeSet<&Digest> =
                    st.images.values().flat_map(|r| r.blobs.iter()).collect();
                removed
                    .freed_blobs
                    .iter()
                    .filter(|b| !used.contains(b))
                    .collect()
            };
            for b in unused {
                #[cfg(test)]
                tests::BEFORE_TAKE_OUT.with(|h| h.borrow_mut().as_mut().map(|f| f()));
                gone.extend(content.take_out(b)?);
            }
        }
        for p in gone {
            if let Err(e) = fs::remove_file(&p) {
                tracing::warn!(file = %p.display(), error = %e, "cannot delete a removed blob (the next start does)");
            }
        }
        for j in &removed.journals {
            let _ = fs::remove_file(j);
        }
        Ok(())
    }
}

impl ImageStore {
    /// Deletes those of `candidates` (compressed layer blobs whose layers are unpacked) that
    /// no record holds and `pinned` does not keep (a running pull that may still read them).
    /// Under the operation lock, so no record that holds one is added meanwhile; the files are
    /// deleted after it. Returns the digests deleted. Blocking.
    pub fn discard_unheld(
        &self,
        candidates: &[Digest],
        content: &ContentStore,
        pinned: impl Fn(&Digest) -> bool,
    ) -> Result<Vec<Digest>> {
        let mut gone = Vec::new();
        let mut discarded = Vec::new();
        {
            let _ops = self.ops();
            let held: BTreeSet<Digest> = {
                let st = self.state.lock().unwrap();
                st.images
                    .values()
                    .flat_map(|r| r.blobs.iter().cloned())
                    .collect()
            };
            let mut seen = BTreeSet::new();
            for d in candidates {
                if !seen.insert(d) || held.contains(d) || pinned(d) {
                    continue;
                }
                if let Some(p) = content.take_out(d)? {
                    gone.push(p);
                    discarded.push(d.clone());
                }
            }
        }
        for p in gone {
            if let Err(e) = fs::remove_file(&p) {
                tracing::warn!(file = %p.display(), error = %e, "cannot delete a discarded layer blob (the next start does)");
            }
        }
        Ok(discarded)
    }

    /// For every record whose layers are unpacked (`unpacked_size` gives their unpacked bytes,
    /// `None` when not unpacked): its compressed layer blobs are no longer held by it, and its
    /// size counts the unpacked layers instead (the record is rewritten if it held them, as
    /// records written with `pull.keep_layer_blobs` on do). Returns the layer digests of those
    /// records, for [`ImageStore::discard_unheld`]. Blocking; called at start.
    pub fn unhold_layer_blobs(
        &self,
        unpacked_size: impl Fn(&ImageRecord) -> Option<u64>,
    ) -> Result<Vec<Digest>> {
        let _ops = self.ops();
        let mut st = self.state.lock().unwrap().clone();
        let mut layers = Vec::new();
        let mut changed = Vec::new();
        for rec in st.images.values_mut() {
            let Some(unpacked) = unpacked_size(rec) else {
                continue;
            };
            let before = rec.blobs.len();
            for l in &rec.layers {
                rec.blobs.remove(&l.digest);
                layers.push(l.digest.clone());
            }
            if rec.blobs.len() != before {
                let compressed: u64 = rec.layers.iter().map(|l| l.size).sum();
                rec.size = rec.size.saturating_sub(compressed) + unpacked;
                changed.push(rec.clone());
            }
        }
        for rec in &changed {
            self.persist(rec)?;
        }
        *self.state.lock().unwrap() = st;
        Ok(layers)
    }
}

/// Whether `r` has no name and is not pinned: kept only for volume users.
fn is_unused_nameless(r: &ImageRecord) -> bool {
    r.repo_tags.is_empty() && r.repo_digests.is_empty() && !r.pinned
}

/// The refusal to remove image `id` that `users` mount as volumes.
fn in_use(id: &Digest, users: &BTreeSet<String>) -> StoreError {
    let mut named: Vec<&str> = users
        .iter()
        .take(NAMED_VOLUME_USERS)
        .map(String::as_str)
        .collect();
    let more = users.len().saturating_sub(NAMED_VOLUME_USERS);
    let more = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    named.sort_unstable();
    StoreError::ImageInUse {
        image: id.to_string(),
        containers: format!("{}{more}", named.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blob(content: &ContentStore, data: &[u8]) -> Digest {
        let d = Digest::of(data);
        content.write(&d, data).unwrap();
        d
    }

    fn record(id: &Digest, tag: &str, blobs: &[&Digest]) -> ImageRecord {
        ImageRecord {
            id: id.clone(),
            repo_tags: vec![tag.to_string()],
            repo_digests: vec![],
            manifest: blobs[0].clone(),
            config: id.clone(),
            layers: vec![],
            diff_ids: vec![],
            size: 0,
            uid: None,
            username: String::new(),
            pinned: false,
            platform: "linux/amd64".into(),
            blobs: blobs.iter().map(|d| (*d).clone()).collect(),
            chain_id: None,
            pulled_at: chrono::Utc::now(),
        }
    }

    struct Fixture {
        dir: tempfile::TempDir,
        content: ContentStore,
        config: Digest,
        shared: Digest,
        own: Digest,
    }

    fn fixture() -> (Fixture, ImageStore) {
        let dir = tempfile::tempdir().unwrap();
        let content = ContentStore::open(&dir.path().join("content")).unwrap();
        let config = blob(&content, b"config a");
        let shared = blob(&content, b"shared layer");
        let own = blob(&content, b"own layer");
        let images = ImageStore::open(dir.path(), &content).unwrap();
        (
            Fixture {
                dir,
                content,
                config,
                shared,
                own,
            },
            images,
        )
    }

    #[test]
    fn removal_takes_the_record_at_once_and_the_blobs_later() {
        let (f, images) = fixture();
        let other = blob(&f.content, b"config b");
        images
            .add(
                record(&f.config, "x.io/a:1", &[&f.config, &f.shared, &f.own]),
                &f.content,
            )
            .unwrap();
        images
            .add(record(&other, "x.io/b:1", &[&other, &f.shared]), &f.content)
            .unwrap();
        let removed = images.remove("x.io/a:1").unwrap();
        assert_eq!(removed.images.len(), 1);
        assert!(images.get("x.io/a:1").unwrap().is_none());
        let mut freed = removed.freed_blobs.clone();
        freed.sort();
        let mut want = vec![f.config.clone(), f.own.clone()];
        want.sort();
        assert_eq!(freed, want, "the shared layer is not freed");
        // Until finished, the blobs are there; then only the freed ones go.
        assert!(f.content.size(&f.own).is_some());
        images.finish_removal(&removed, &f.content).unwrap();
        assert!(f.content.size(&f.own).is_none());
        assert!(f.content.size(&f.config).is_none());
        assert!(f.content.size(&f.shared).is_some());
        assert_eq!(
            fs::read_dir(f.dir.path().join("images/removing"))
                .unwrap()
                .count(),
            0,
            "journal dropped"
        );
    }

    #[test]
    fn an_image_a_volume_uses_is_not_removed_until_its_last_user_goes() {
        let (f, images) = fixture();
        images
            .add(
                record(&f.config, "x.io/a:1", &[&f.config, &f.own]),
                &f.content,
            )
            .unwrap();
        images.add_volume_user(&f.config, "ctr-1").unwrap();
        images.add_volume_user(&f.config, "ctr-2").unwrap();
        images.add_volume_user(&f.config, "ctr-2").unwrap();
        let err = images.remove("x.io/a:1").unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::FailedPrecondition);
        let msg = err.to_string();
        assert!(
            msg.contains(f.config.as_str()) && msg.contains("ctr-1, ctr-2"),
            "{msg}"
        );
        assert!(images.get("x.io/a:1").unwrap().is_some(), "still there");
        assert_eq!(images.volume_users(&f.config), ["ctr-1", "ctr-2"]);
        // Letting go of a named image leaves it as it is; then it can be removed.
        assert!(
            images
                .remove_volume_user(&f.config, "ctr-1")
                .unwrap()
                .is_empty()
        );
        assert!(images.remove(&f.config.to_string()).is_err());
        assert!(
            images
                .remove_volume_user(&f.config, "ctr-2")
                .unwrap()
                .is_empty()
        );
        assert!(images.get("x.io/a:1").unwrap().is_some());
        assert_eq!(images.remove("x.io/a:1").unwrap().images.len(), 1);
    }

    #[test]
    fn a_name_moving_off_an_image_a_volume_uses_leaves_it_without_names_until_then() {
        let (f, images) = fixture();
        let newer = blob(&f.content, b"config b");
        images
            .add(
                record(&f.config, "x.io/a:1", &[&f.config, &f.own]),
                &f.content,
            )
            .unwrap();
        images.add_volume_user(&f.config, "ctr-1").unwrap();
        // The tag moves to another image: the old one stays, nameless, for its volume.
        let (_, freed) = images
            .add(record(&newer, "x.io/a:1", &[&newer]), &f.content)
            .unwrap();
        assert!(freed.is_empty());
        let old = images.get(f.config.as_str()).unwrap().expect("kept");
        assert!(old.repo_tags.is_empty() && old.repo_digests.is_empty());
        assert_eq!(images.list().len(), 2, "both listed");
        // Across a restart (volume users are the runtime's to restore) it is still there.
        drop(images);
        let images = ImageStore::open(f.dir.path(), &f.content).unwrap();
        assert!(images.get(f.config.as_str()).unwrap().is_some());
        images.add_volume_user(&f.config, "ctr-1").unwrap();
        assert!(images.remove_unused_nameless().unwrap().is_empty());
        // Its last volume user gone, it goes, with the blobs only it held.
        let removed = images.remove_volume_user(&f.config, "ctr-1").unwrap();
        assert_eq!(removed.images.len(), 1);
        images.finish_removal(&removed, &f.content).unwrap();
        assert!(images.get(f.config.as_str()).unwrap().is_none());
        assert!(f.content.size(&f.own).is_none());
        assert!(images.get("x.io/a:1").unwrap().is_some(), "the newer one");
    }

    #[test]
    fn nameless_images_whose_volume_users_went_while_down_are_removed_at_start() {
        let (f, images) = fixture();
        let newer = blob(&f.content, b"config b");
        images
            .add(record(&f.config, "x.io/a:1", &[&f.config]), &f.content)
            .unwrap();
        images.add_volume_user(&f.config, "ctr-1").unwrap();
        images
            .add(record(&newer, "x.io/a:1", &[&newer]), &f.content)
            .unwrap();
        drop(images);
        let images = ImageStore::open(f.dir.path(), &f.content).unwrap();
        // No container restored as its user.
        let removed = images.remove_unused_nameless().unwrap();
        assert_eq!(removed.images.len(), 1);
        assert_eq!(removed.images[0].id, f.config);
        assert_eq!(images.list().len(), 1);
    }

    #[test]
    fn a_volume_user_of_an_image_that_is_gone_is_not_found() {
        let (f, images) = fixture();
        let err = images.add_volume_user(&f.config, "ctr-1").unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::NotFound);
        // Nothing was recorded: a later image of that id is removable.
        images
            .add(record(&f.config, "x.io/a:1", &[&f.config]), &f.content)
            .unwrap();
        assert_eq!(images.remove("x.io/a:1").unwrap().images.len(), 1);
    }

    thread_local! {
        /// Run by `finish_removal` before each blob it renames away.
        pub(super) static BEFORE_TAKE_OUT: std::cell::RefCell<Option<Box<dyn FnMut()>>> =
            const { std::cell::RefCell::new(None) };
    }

    #[test]
    fn listing_images_does_not_wait_for_freed_blobs_to_be_taken_out() {
        let (f, images) = fixture();
        let images = std::sync::Arc::new(images);
        let other = blob(&f.content, b"config b");
        images
            .add(
                record(&f.config, "x.io/a:1", &[&f.config, &f.own]),
                &f.content,
            )
            .unwrap();
        images
            .add(record(&other, "x.io/b:1", &[&other]), &f.content)
            .unwrap();
        let removed = images.remove("x.io/a:1").unwrap();
        let seen = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
        let (lister, sink) = (images.clone(), seen.clone());
        BEFORE_TAKE_OUT.with(|h| {
            *h.borrow_mut() = Some(Box::new(move || {
                // While a blob is being taken out, another thread lists the images (ListImages).
                let (tx, rx) = std::sync::mpsc::channel();
                let lister = lister.clone();
                std::thread::spawn(move || tx.send(lister.list().len()));
                let answer = rx.recv_timeout(std::time::Duration::from_secs(5));
                sink.borrow_mut().push(answer);
            }))
        });
        images.finish_removal(&removed, &f.content).unwrap();
        BEFORE_TAKE_OUT.with(|h| h.borrow_mut().take());
        let seen = seen.borrow();
        assert_eq!(seen.len(), 2, "one listing per freed blob: {seen:?}");
        assert!(
            seen.iter().all(|r| *r == Ok(1)),
            "ListImages waited on the removal (or saw the removed image): {seen:?}"
        );
        assert!(f.content.size(&f.own).is_none());
        assert!(f.content.size(&other).is_some());
    }

    #[test]
    fn an_image_recorded_again_before_the_removal_finishes_keeps_its_blobs() {
        let (f, images) = fixture();
        let rec = record(&f.config, "x.io/a:1", &[&f.config, &f.own]);
        images.add(rec.clone(), &f.content).unwrap();
        let removed = images.remove(&f.config.to_string()).unwrap();
        images.add(rec, &f.content).unwrap();
        images.finish_removal(&removed, &f.content).unwrap();
        assert!(f.content.size(&f.own).is_some());
        assert!(f.content.size(&f.config).is_some());
        assert!(images.get("x.io/a:1").unwrap().is_some());
    }

    #[test]
    fn a_removal_interrupted_after_the_record_went_is_finished_at_open() {
        let (f, images) = fixture();
        images
            .add(
                record(&f.config, "x.io/a:1", &[&f.config, &f.own]),
                &f.content,
            )
            .unwrap();
        let removed = images.remove("x.io/a:1").unwrap();
        assert_eq!(removed.images.len(), 1);
        drop(images); // killed before finish_removal
        let images = ImageStore::open(f.dir.path(), &f.content).unwrap();
        assert!(images.list().is_empty());
        assert!(f.content.size(&f.own).is_none());
        assert!(f.content.size(&f.config).is_none());
        assert_eq!(
            fs::read_dir(f.dir.path().join("images/removing"))
                .unwrap()
                .count(),
            0
        );
    }

    #[test]
    fn a_removal_interrupted_before_the_record_went_is_finished_at_open() {
        let (f, images) = fixture();
        images
            .add(
                record(&f.config, "x.io/a:1", &[&f.config, &f.own]),
                &f.content,
            )
            .unwrap();
        drop(images);
        // Killed between the journal's write and the record's removal.
        let dir = f.dir.path().join("images/removing");
        fs::create_dir_all(&dir).unwrap();
        let j = Journal {
            id: f.config.clone(),
            blobs: vec![f.config.clone(), f.own.clone()],
            at: chrono::Utc::now(),
        };
        fs::write(
            dir.join(format!("{}.json", f.config.hex())),
            serde_json::to_vec(&j).unwrap(),
        )
        .unwrap();
        let images = ImageStore::open(f.dir.path(), &f.content).unwrap();
        assert!(images.list().is_empty(), "the removal was finished");
        assert!(f.content.size(&f.own).is_none());
    }
}

//! The [`Snapshotter`] trait the rest of minicri programs against, and the types it speaks.
//!
//! Model (containerd's, reduced to what a CRI runtime needs):
//! - a *committed* snapshot is a read-only layer stack, keyed by the chain id of its top layer; layers
//!   enter only through [`Snapshotter::apply_layer`] (or [`Snapshotter::commit`] of an active one);
//! - an *active* snapshot is a container's writable filesystem on top of a committed parent;
//! - a *view* is a read-only filesystem of a committed parent;
//! - snapshots form a tree through their parent; a snapshot is kept while it has a *user* (an image or
//!   container id recorded with [`Snapshotter::add_user`] or by `apply_layer`) or a child. Dropping the
//!   last user ([`Snapshotter::release`]) or removing a child removes every snapshot left with neither.
//!
//! All methods block (filesystem work, sometimes long): async callers run them under
//! `spawn_blocking`. Implementations are safe to share between threads.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::mount::Mount;

/// What a snapshot is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Committed,
    Active,
    View,
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Kind::Committed => "committed",
            Kind::Active => "active",
            Kind::View => "view",
        })
    }
}

/// Which storage backend a snapshotter uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Each layer is a directory; stacks are overlayfs mounts. The default.
    Overlay,
    /// Each snapshot is a full copy of its tree; for filesystems overlayfs cannot use.
    Copy,
}

/// A snapshot as [`Snapshotter::stat`] and [`Snapshotter::list`] report it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Info {
    pub key: String,
    pub kind: Kind,
    pub parent: Option<String>,
    /// Image and container ids holding the snapshot.
    pub users: BTreeSet<String>,
    /// Seconds since the epoch.
    pub created: u64,
    /// For layers applied from a tar stream: the uncompressed tar size.
    pub layer_size: Option<u64>,
}

/// Space a snapshot's own directory takes (the layer's files for overlay, the whole tree for copy).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Allocated bytes (st_blocks × 512), hardlinks counted once.
    pub bytes: u64,
    /// Inodes, hardlinks counted once.
    pub inodes: u64,
}

/// What [`Snapshotter::release`] removed: the keys whose records are gone, and their data,
/// already moved aside (into the snapshotter's `tmp/`, swept at the next open if the daemon dies
/// first) and deleted when this is dropped. Deleting a large image's trees takes seconds: drop it
/// after releasing any lock that others wait on.
#[must_use = "dropping it deletes the released trees; drop it outside locks"]
#[derive(Debug, Default)]
pub struct Released {
    pub keys: Vec<String>,
    trash: Vec<PathBuf>,
}

impl Released {
    pub(crate) fn new(keys: Vec<String>, trash: Vec<PathBuf>) -> Released {
        Released { keys, trash }
    }
}

impl Drop for Released {
    fn drop(&mut self) {
        crate::tree::empty_trash(std::mem::take(&mut self.trash));
    }
}

/// One layer to apply.
#[derive(Debug, Clone, Copy, Default)]
pub struct LayerSpec<'a> {
    /// The layer descriptor's media type (OCI or Docker; gzip, zstd or uncompressed).
    pub media_type: &'a str,
    /// The layer's `rootfs.diff_ids` entry: `sha256:<hex>` of the uncompressed tar.
    pub diff_id: &'a str,
    /// Chain id of the layers below; None for the bottom layer.
    pub parent: Option<&'a str>,
    /// Image id to record as a user of the resulting snapshot (and of every layer's snapshot the
    /// image's pull applies), so a concurrent removal of another image cannot take it away.
    pub user: Option<&'a str>,
    /// Where the bytes come from (a blob's digest and size, say). Applies of one chain from one
    /// source share one apply (later ones wait for it); from another source they run side by
    /// side and the first to commit wins, so an apply never waits for a slower download of
    /// other bytes that happen to unpack to the same layer. None: every apply of the chain is
    /// one source.
    pub source: Option<&'a str>,
    /// Set when the apply's caller gives up: a wait for another apply of the chain ends then
    /// (looked at every 200 ms) with [`crate::Error::Cancelled`].
    pub stop: Option<&'a std::sync::atomic::AtomicBool>,
}

/// What [`Snapshotter::apply_layer`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerApplied {
    /// The chain id, the key of the committed snapshot.
    pub chain_id: String,
    /// False when the chain was committed already and the stream was not read.
    pub unpacked: bool,
    /// Uncompressed bytes read (0 when not unpacked).
    pub size: u64,
}

/// Asked before each piece of a layer's uncompressed stream reaches the applier, which writes it
/// to disk: lets the owner of the filesystem stop an unpack before it writes past a bound of its
/// own (minicri's image filesystem reserve). Counted on the uncompressed side because that is what
/// lands on disk: a compressed layer can unpack to a thousand times its size.
pub trait SpaceCheck: Send + Sync {
    /// `bytes` are about to be written. An error stops the apply (as [`crate::Error::LayerStream`]
    /// carrying it) before they are; nothing is committed.
    fn claim(&self, bytes: u64) -> std::io::Result<()>;

    /// Bytes of an earlier claim are written, or will not be (the apply ended).
    fn settle(&self, bytes: u64);
}

/// A snapshotter: turns layers into committed snapshots and hands out container filesystems.
pub trait Snapshotter: Send + Sync {
    /// The backend behind this snapshotter.
    fn backend(&self) -> Backend;

    /// The directory the snapshotter keeps its state in.
    fn root(&self) -> &Path;

    /// Applies one layer read from `stream` (compressed bytes as they download) on top of the chain
    /// `layer.parent`, checks its diff_id while decompressing, and commits it under its chain id.
    /// Returns at once, without reading the stream, if that chain is committed already; if another
    /// thread is applying the same chain, waits for it. On any error nothing is committed.
    fn apply_layer(
        &self,
        layer: &LayerSpec<'_>,
        stream: &mut (dyn Read + Send),
    ) -> Result<LayerApplied>;

    /// Applies a layer whose parent chain (`layer.parent`) another thread may still be applying,
    /// so that the layers of an image unpack at once. `parent_ready` blocks until that apply has
    /// ended and says whether the parent is committed.
    ///
    /// The overlay backend unpacks the layer into a directory of its own right away, then waits
    /// for the parent and commits if nothing the layer did depended on the parent's content beyond
    /// the metadata of directories it writes into (taken from the parent then, as a copy-up does).
    /// Otherwise (whiteouts of the parent's files, hardlinks to them, paths through its symlinks)
    /// it returns [`crate::Error::NeedsParent`], and the caller applies the layer again with
    /// [`Snapshotter::apply_layer`]. The copy backend waits for the parent, then applies.
    /// `parent_ready` returning false fails the apply with NOT_FOUND for the parent.
    fn apply_layer_early(
        &self,
        layer: &LayerSpec<'_>,
        stream: &mut (dyn Read + Send),
        parent_ready: &dyn Fn() -> bool,
    ) -> Result<LayerApplied>;

    /// Creates the writable snapshot `key` on top of the committed `parent` and returns its mount.
    fn prepare(&self, key: &str, parent: Option<&str>) -> Result<Mount>;

    /// Creates the read-only snapshot `key` of the committed `parent` and returns its mount.
    fn view(&self, key: &str, parent: Option<&str>) -> Result<Mount>;

    /// Turns the active snapshot `key` into the committed snapshot `name`.
    fn commit(&self, name: &str, key: &str) -> Result<()>;

    /// The mount of an active snapshot or view.
    fn mounts(&self, key: &str) -> Result<Mount>;

    /// Removes the snapshot `key`, which must have no children and no users, then every ancestor left
    /// without users and children. Returns the keys removed. The caller unmounts it first.
    fn remove(&self, key: &str) -> Result<Vec<String>>;

    fn stat(&self, key: &str) -> Result<Info>;

    fn list(&self) -> Result<Vec<Info>>;

    /// Disk usage of one snapshot's own directory.
    fn usage(&self, key: &str) -> Result<Usage>;

    /// Disk usage of everything under the snapshotter root (for ImageFsInfo).
    fn total_usage(&self) -> Result<Usage>;

    /// Records `user` (an image or container id) as holding `key`. Idempotent.
    fn add_user(&self, key: &str, user: &str) -> Result<()>;

    /// Drops `user` from every snapshot, then removes every snapshot left without users and children
    /// (walking up the parents). The records go at once; the trees when the result is dropped.
    fn release(&self, user: &str) -> Result<Released>;
}

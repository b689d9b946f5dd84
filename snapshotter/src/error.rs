//! The crate's one error type.
//!
//! Every variant carries the context the daemon needs to answer a CRI call: which snapshot, which layer
//! entry, which digest. The store's error kinds (`minicri_store::error`) say which gRPC status each
//! variant becomes, in the one place the daemon maps errors, without matching on message text.

use std::io;
use std::path::PathBuf;

/// Result alias used throughout the crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the snapshotter.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No snapshot has this key (or chain id).
    #[error("snapshot {key:?} not found")]
    NotFound { key: String },

    /// A snapshot with this key exists already.
    #[error("snapshot {key:?} already exists")]
    AlreadyExists { key: String },

    /// The snapshot still has children or users.
    #[error("snapshot {key:?} is in use: {reason}")]
    InUse { key: String, reason: String },

    /// The caller asked for something that does not fit the snapshot (wrong kind, bad key, bad digest).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// The layer's media type is not one this crate can decompress.
    #[error("unsupported layer media type {0:?}")]
    UnsupportedMediaType(String),

    /// A layer entry would be written (or linked to) outside the snapshot. Nothing is committed.
    #[error("layer entry {entry:?} would land outside the snapshot: {reason}")]
    UnsafePath { entry: String, reason: String },

    /// A layer entry cannot be applied (unknown type, parent is not a directory, link to a missing file).
    #[error("layer entry {entry:?} is invalid: {reason}")]
    InvalidEntry { entry: String, reason: String },

    /// Reading or decompressing the layer stream failed, or the tar stream is malformed.
    #[error("reading layer stream: {source}")]
    LayerStream {
        #[source]
        source: io::Error,
    },

    /// The layer goes past one of the unpack limits (`snapshotter.max_layer_bytes`,
    /// `snapshotter.max_layer_entries`, or a
    /// fixed cap on extension headers and sparse maps). Nothing is committed.
    #[error("layer exceeds the {limit} limit of {max}: {detail}")]
    LayerLimit {
        limit: &'static str,
        max: u64,
        detail: String,
    },

    /// The uncompressed layer does not hash to the diff_id the image config names.
    #[error("layer diff_id mismatch: expected {expected}, computed {actual}")]
    DiffIdMismatch { expected: String, actual: String },

    /// A layer applied before its parent ([`crate::Snapshotter::apply_layer_early`]) turned out to
    /// depend on what the parent has; nothing is committed. Apply it again with
    /// [`crate::Snapshotter::apply_layer`] once the parent is committed.
    #[error("the layer must be applied on top of its parent: {reason}")]
    NeedsParent { reason: String },

    /// The caller gave up ([`crate::LayerSpec::stop`]) while the apply waited for another
    /// apply of the same layer; nothing was applied.
    #[error("stopped while waiting for another apply of layer {chain}")]
    Cancelled { chain: String },

    /// overlayfs cannot be used on this host or root directory.
    #[error("overlayfs unavailable: {0}")]
    OverlayUnsupported(String),

    /// A persisted snapshot record cannot be read or written.
    #[error("snapshot record {path}: {source}")]
    Record {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },

    /// A filesystem or mount operation failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
}

impl Error {
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source,
        }
    }
}

/// Adds context to `io::Result`s.
pub(crate) trait IoContext<T> {
    fn ctx(self, f: impl FnOnce() -> String) -> Result<T>;
}

impl<T> IoContext<T> for io::Result<T> {
    fn ctx(self, f: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::io(f(), e))
    }
}

impl<T> IoContext<T> for nix::Result<T> {
    fn ctx(self, f: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::io(f(), io::Error::from(e)))
    }
}

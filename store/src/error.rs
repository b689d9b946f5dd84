//! The store's one error type.
//!
//! Every variant says what went wrong with which object; [`StoreError::kind`] classifies it so the
//! daemon can turn it into a gRPC status in one place without matching on messages.

use std::path::PathBuf;

/// What kind of failure an error is, for callers that map errors onto protocol status codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The caller's input is malformed (a bad reference, a bad digest).
    InvalidArgument,
    /// The thing asked for does not exist (locally or at the registry).
    NotFound,
    /// The registry refused the credentials (or their absence).
    Unauthenticated,
    /// The registry could not be reached or kept failing.
    Unavailable,
    /// The registry sent something we cannot use (unsupported media type, no matching platform).
    FailedPrecondition,
    /// Content did not match its digest or size.
    DataLoss,
    /// The operation was abandoned by its caller.
    Cancelled,
    /// The call returned while the work it asked for carries on in the background (a pull
    /// detached after its window); the caller is expected to ask again later.
    Detached,
    /// The disk holding the store is full (or a quota is used up): nothing to retry until room
    /// is made.
    ResourceExhausted,
    /// Anything else: a local I/O failure or a bug.
    Internal,
}

/// Errors of the content store, the image records and image pulls.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("invalid image reference {reference:?}: {reason}")]
    InvalidReference { reference: String, reason: String },

    #[error("invalid digest {digest:?}: {reason}")]
    InvalidDigest { digest: String, reason: String },

    #[error("image {0:?} not found")]
    ImageNotFound(String),

    /// RemoveImage of an image containers mount as volumes (CRI `Mount.image`).
    #[error("image {image} is in use as a volume by container(s) {containers}: remove them first")]
    ImageInUse { image: String, containers: String },

    #[error("blob {0} not found in the content store")]
    BlobNotFound(String),

    #[error("{what} of {reference} not found at {registry}")]
    RemoteNotFound {
        reference: String,
        what: String,
        registry: String,
    },

    #[error("registry {registry} refused access to {reference}: {reason}")]
    Unauthenticated {
        reference: String,
        registry: String,
        reason: String,
    },

    #[error("cannot pull {reference}: {reason}")]
    Unavailable { reference: String, reason: String },

    /// The registry sent the pull somewhere minicri does not go (a redirect or token realm on
    /// the node itself, down to plain http).
    #[error("cannot pull {reference}: {reason}")]
    Refused { reference: String, reason: String },

    #[error("unsupported media type {media_type:?} in {reference}")]
    UnsupportedMediaType {
        reference: String,
        media_type: String,
    },

    #[error("image {reference} has no manifest for platform {platform} (available: {available})")]
    NoMatchingPlatform {
        reference: String,
        platform: String,
        available: String,
    },

    #[error("malformed {what} for {reference}: {reason}")]
    Malformed {
        reference: String,
        what: String,
        reason: String,
    },

    #[error("blob {expected} failed verification: got {actual} ({size} bytes)")]
    DigestMismatch {
        expected: String,
        actual: String,
        size: u64,
    },

    #[error("blob {digest} has {actual} bytes, its descriptor says {expected}")]
    SizeMismatch {
        digest: String,
        expected: u64,
        actual: u64,
    },

    /// A download or an unpack stopped (or was refused) before free space on the image
    /// filesystem fell under its reserve (`pull.image_fs_reserve`).
    #[error("{what} stopped: {shortfall}")]
    ImageFsReserve {
        what: String,
        shortfall: crate::space::Shortfall,
    },

    /// A descriptor claims a blob larger than this node takes (`pull.max_blob_size`).
    #[error(
        "blob {digest} of {reference} claims {size} bytes, more than pull.max_blob_size allows ({max} bytes); no byte of it was fetched"
    )]
    BlobTooLarge {
        reference: String,
        digest: String,
        size: u64,
        max: u64,
    },

    #[error("registry hosts configuration {path}: {reason}")]
    HostsConfig { path: PathBuf, reason: String },

    #[error("{0}")]
    Cancelled(String),

    /// A pull call that returned after its detach window; the download continues for the
    /// call's pod sandbox. The message is for the person reading the pod's events.
    #[error("{0}")]
    Detached(String),

    /// A pull for a requester whose pod sandbox is stopped.
    #[error("{0}")]
    SandboxStopped(String),

    #[error("cannot unpack layer {layer} of {reference}: {source}")]
    Unpack {
        reference: String,
        layer: String,
        #[source]
        source: minicri_snapshotter::Error,
    },

    #[error("snapshotter: {0}")]
    Snapshotter(#[from] minicri_snapshotter::Error),

    /// One failure reported to several waiters (every requester of a shared pull).
    #[error("{0}")]
    Shared(std::sync::Arc<StoreError>),

    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },

    #[error("{context}: {source}")]
    Json {
        context: String,
        #[source]
        source: serde_json::Error,
    },
}

impl StoreError {
    /// The class of this error, for mapping onto protocol status codes.
    pub fn kind(&self) -> ErrorKind {
        use StoreError::*;
        if self.is_disk_full() {
            return ErrorKind::ResourceExhausted;
        }
        match self {
            InvalidReference { .. } | InvalidDigest { .. } => ErrorKind::InvalidArgument,
            ImageNotFound(_) | BlobNotFound(_) | RemoteNotFound { .. } => ErrorKind::NotFound,
            Unauthenticated { .. } => ErrorKind::Unauthenticated,
            Unavailable { .. } => ErrorKind::Unavailable,
            UnsupportedMediaType { .. }
            | NoMatchingPlatform { .. }
            | Malformed { .. }
            | Refused { .. } => ErrorKind::FailedPrecondition,
            SandboxStopped(_) | ImageInUse { .. } => ErrorKind::FailedPrecondition,
            DigestMismatch { .. } | SizeMismatch { .. } => ErrorKind::DataLoss,
            Cancelled(_) => ErrorKind::Cancelled,
            // A bound of this node, not a fault of the request: another node (or this one with
            // room made) takes the same pull.
            ImageFsReserve { .. } | BlobTooLarge { .. } => ErrorKind::ResourceExhausted,
            Detached(_) => ErrorKind::Detached,
            Shared(inner) => inner.kind(),
            // An unpack reads a blob already checked against its digest: a stream that does not
            // decode is the image's fault, and retrying cannot help. Only a local read error
            // (an OS error) says otherwise.
            Unpack {
                source: minicri_snapshotter::Error::LayerStream { source },
                ..
            } if source.raw_os_error().is_none() => ErrorKind::FailedPrecondition,
            Unpack { source, .. } | Snapshotter(source) => match source {
                minicri_snapshotter::Error::DiffIdMismatch { .. } => ErrorKind::DataLoss,
                minicri_snapshotter::Error::UnsafePath { .. }
                | minicri_snapshotter::Error::InvalidEntry { .. }
                | minicri_snapshotter::Error::LayerLimit { .. }
                | minicri_snapshotter::Error::UnsupportedMediaType(_) => {
                    ErrorKind::FailedPrecondition
                }
                minicri_snapshotter::Error::NotFound { .. } => ErrorKind::NotFound,
                minicri_snapshotter::Error::LayerStream { .. } => ErrorKind::Unavailable,
                _ => ErrorKind::Internal,
            },
            HostsConfig { .. } | Io { .. } | Json { .. } => ErrorKind::Internal,
        }
    }

    /// Whether a full disk (ENOSPC) or an exhausted quota (EDQUOT) caused this error, at any
    /// depth of its sources.
    pub fn is_disk_full(&self) -> bool {
        if let StoreError::Shared(inner) = self {
            return inner.is_disk_full();
        }
        let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(self);
        while let Some(e) = cur {
            if let Some(io) = e.downcast_ref::<std::io::Error>() {
                if matches!(
                    io.kind(),
                    std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
                ) {
                    return true;
                }
                // An io::Error wrapping another error hides it from `source`.
                if let Some(inner) = io.get_ref() {
                    cur = Some(inner);
                    continue;
                }
            }
            cur = e.source();
        }
        false
    }

    /// Wraps an I/O error with what was being done.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        StoreError::Io {
            context: context.into(),
            source,
        }
    }
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Adds context to I/O results: `fs::read(p).ctx(|| format!("reading {}", p.display()))`.
pub trait IoContext<T> {
    fn ctx<F: FnOnce() -> String>(self, f: F) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn ctx<F: FnOnce() -> String>(self, f: F) -> Result<T> {
        self.map_err(|e| StoreError::io(f(), e))
    }
}

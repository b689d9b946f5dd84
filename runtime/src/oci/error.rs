//! The error type of the OCI layer (spec building and the runtime CLI).

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum OciError {
    /// The OCI runtime binary ran and failed; `message` is what it said on stderr (or its JSON
    /// log), trimmed.
    #[error("{binary} {op} {id}: {message}")]
    Runtime {
        binary: String,
        op: &'static str,
        id: String,
        message: String,
    },
    /// The runtime says the container does not exist.
    #[error("container {0} does not exist in the OCI runtime")]
    NotFound(String),
    /// The container's process (and its shim) is gone: what was asked needs it running.
    #[error("{0}")]
    NotRunning(String),
    /// The CRI request or the image config cannot be turned into a spec.
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// RunPodSandbox named a runtime handler that is not configured.
    #[error("unknown runtime handler {name:?}; configured: {}", known.join(", "))]
    UnknownHandler { name: String, known: Vec<String> },
    /// The handler is configured but does not work on this host.
    #[error("runtime handler {name:?} is unavailable on this host: {reason}")]
    HandlerUnavailable { name: String, reason: String },
    /// The request asks for something this host cannot do (an AppArmor profile where AppArmor
    /// is off or the profile is not loaded).
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    Other(String),
}

pub type Result<T, E = OciError> = std::result::Result<T, E>;

impl OciError {
    pub fn io(what: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        OciError::Io {
            what,
            path: path.into(),
            source,
        }
    }

    pub fn invalid(msg: impl Into<String>) -> Self {
        OciError::InvalidArgument(msg.into())
    }

    pub fn is_not_found(&self) -> bool {
        matches!(self, OciError::NotFound(_))
    }
}

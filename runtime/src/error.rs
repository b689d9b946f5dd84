//! The daemon's error type and the one place where errors become gRPC statuses.

use minicri_store::text::bounded_to;
use minicri_store::{ErrorKind, StoreError};
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    DeadlineExceeded(String),
    #[error("{0}")]
    Internal(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    ResourceExhausted(String),
    /// An RPC minicri does not implement, saying which and why.
    #[error("{0}")]
    Unimplemented(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn code(&self) -> Code {
        match self {
            Error::InvalidArgument(_) => Code::InvalidArgument,
            Error::DeadlineExceeded(_) => Code::DeadlineExceeded,
            Error::Internal(_) => Code::Internal,
            Error::NotFound(_) => Code::NotFound,
            Error::AlreadyExists(_) => Code::AlreadyExists,
            Error::FailedPrecondition(_) => Code::FailedPrecondition,
            Error::Unavailable(_) => Code::Unavailable,
            Error::ResourceExhausted(_) => Code::ResourceExhausted,
            Error::Unimplemented(_) => Code::Unimplemented,
            Error::Store(e) => match e.kind() {
                ErrorKind::InvalidArgument => Code::InvalidArgument,
                ErrorKind::NotFound => Code::NotFound,
                ErrorKind::Unauthenticated => Code::Unauthenticated,
                ErrorKind::Unavailable => Code::Unavailable,
                ErrorKind::FailedPrecondition => Code::FailedPrecondition,
                ErrorKind::DataLoss => Code::DataLoss,
                ErrorKind::Cancelled => Code::Cancelled,
                // UNKNOWN is the one code whose message the kubelet's CRI client passes on as
                // written (it strips the `rpc error: code = … desc = …` wrapper only for it), so
                // the pod's "Failed to pull image" event reads "… is still downloading in the
                // background: 45% …". Every code makes the kubelet back off and retry alike.
                ErrorKind::Detached => Code::Unknown,
                ErrorKind::ResourceExhausted => Code::ResourceExhausted,
                ErrorKind::Internal => Code::Internal,
            },
        }
    }
}

impl From<crate::oci::OciError> for Error {
    fn from(e: crate::oci::OciError) -> Error {
        use crate::oci::OciError as O;
        match e {
            O::InvalidArgument(m) => Error::InvalidArgument(m),
            O::UnknownHandler { .. } => Error::InvalidArgument(e.to_string()),
            O::HandlerUnavailable { .. } | O::Unsupported(_) | O::NotRunning(_) => {
                Error::FailedPrecondition(e.to_string())
            }
            O::NotFound(_) => Error::NotFound(e.to_string()),
            other => Error::Internal(other.to_string()),
        }
    }
}

impl From<crate::cni::CniError> for Error {
    fn from(e: crate::cni::CniError) -> Error {
        use crate::cni::CniError as C;
        match e {
            C::NotReady(_) => Error::FailedPrecondition(e.to_string()),
            C::InvalidArgument(_) => Error::InvalidArgument(e.to_string()),
            // The node's network setup is missing a plugin, or its configuration is one the
            // plugin rejects (CNI error code 7): nothing a retry changes until it is fixed.
            C::PluginNotFound { .. } | C::Plugin { code: Some(7), .. } => {
                Error::FailedPrecondition(e.to_string())
            }
            C::Timeout { .. } => Error::DeadlineExceeded(e.to_string()),
            // CNI error code 11: "try again later".
            C::Plugin { code: Some(11), .. } => Error::Unavailable(e.to_string()),
            other => Error::Internal(other.to_string()),
        }
    }
}

impl From<crate::netns::NetnsError> for Error {
    fn from(e: crate::netns::NetnsError) -> Error {
        Error::Internal(e.to_string())
    }
}

impl From<minicri_snapshotter::Error> for Error {
    fn from(e: minicri_snapshotter::Error) -> Error {
        Error::Store(StoreError::from(e))
    }
}

/// Most characters of a gRPC status message. Messages quote what pod specs and images hold (env
/// entries, command lines, paths, references), and the kubelet copies a failed call's message
/// into the pod's status and its events: a message of megabytes would make those updates fail.
pub const MAX_STATUS_CHARS: usize = 4096;

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        Status::new(e.code(), bounded_to(e.to_string(), MAX_STATUS_CHARS))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cni::{CniError, Command};

    /// A CNI failure keeps its kind up to the gRPC status, and its message names the plugin.
    #[test]
    fn cni_errors_map_by_kind() {
        let plugin = |code| CniError::Plugin {
            plugin: "bridge".into(),
            command: Command::Add,
            message: "boom".into(),
            code,
        };
        for (e, code) in [
            (
                CniError::Timeout {
                    plugin: "slow-ipam".into(),
                    command: Command::Add,
                    timeout: std::time::Duration::from_secs(55),
                },
                Code::DeadlineExceeded,
            ),
            (
                CniError::PluginNotFound {
                    plugin: "slow-ipam".into(),
                    dirs: "/opt/cni/bin".into(),
                },
                Code::FailedPrecondition,
            ),
            (plugin(Some(11)), Code::Unavailable),
            (plugin(Some(7)), Code::FailedPrecondition),
            (plugin(None), Code::Internal),
            (
                CniError::NotReady("no conflist".into()),
                Code::FailedPrecondition,
            ),
        ] {
            let text = e.to_string();
            let status = Status::from(Error::from(e));
            assert_eq!(status.code(), code, "{text}");
            assert_eq!(status.message(), text);
        }
        let status = Status::from(Error::from(CniError::Timeout {
            plugin: "slow-ipam".into(),
            command: Command::Add,
            timeout: std::time::Duration::from_secs(55),
        }));
        assert!(status.message().contains("slow-ipam"), "{status:?}");
    }

    /// A status quotes at most [`MAX_STATUS_CHARS`] of what the error says, however much an
    /// image or pod spec made it say.
    #[test]
    fn status_messages_are_bounded() {
        let e = Error::InvalidArgument(format!("the image's Env entry {:?}", "x".repeat(5 << 20)));
        let s: Status = e.into();
        assert_eq!(s.code(), Code::InvalidArgument);
        assert!(s.message().starts_with("the image's Env entry \"xxx"));
        assert!(s.message().ends_with("… (cut)"), "{}", &s.message()[4000..]);
        assert!(s.message().chars().count() <= MAX_STATUS_CHARS + 8);
        let short: Status = Error::NotFound("container abc not found".into()).into();
        assert_eq!(short.message(), "container abc not found");
    }
}

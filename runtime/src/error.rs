//! The daemon's error type and the one place where errors become gRPC statuses.

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
            O::HandlerUnavailable { .. } => Error::FailedPrecondition(e.to_string()),
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

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        Status::new(e.code(), e.to_string())
    }
}

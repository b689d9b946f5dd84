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
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn code(&self) -> Code {
        match self {
            Error::InvalidArgument(_) => Code::InvalidArgument,
            Error::DeadlineExceeded(_) => Code::DeadlineExceeded,
            Error::Internal(_) => Code::Internal,
            Error::Store(e) => match e.kind() {
                ErrorKind::InvalidArgument => Code::InvalidArgument,
                ErrorKind::NotFound => Code::NotFound,
                ErrorKind::Unauthenticated => Code::Unauthenticated,
                ErrorKind::Unavailable => Code::Unavailable,
                ErrorKind::FailedPrecondition => Code::FailedPrecondition,
                ErrorKind::DataLoss => Code::DataLoss,
                ErrorKind::Cancelled => Code::Cancelled,
                ErrorKind::Internal => Code::Internal,
            },
        }
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Status {
        Status::new(e.code(), e.to_string())
    }
}

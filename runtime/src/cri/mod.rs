//! The CRI gRPC services. Handlers stay thin: validate the request, call the daemon's services,
//! convert the result; every handler runs inside [`crate::rpc::call`].

pub mod image;
pub mod pods;
pub mod runtime;

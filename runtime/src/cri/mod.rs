//! The CRI gRPC services. Handlers stay thin: validate the request, call the daemon's services,
//! convert the result; every unary handler runs inside [`crate::rpc::call`] (the GetContainerEvents
//! stream, [`events`], logs its subscribers itself).

pub mod events;
pub mod image;
pub mod pods;
pub mod runtime;
pub mod stats;
pub mod streaming;

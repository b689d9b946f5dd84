//! The CRI gRPC services, one module per service: [`runtime`] (RuntimeService) and [`image`]
//! (ImageService) hold every RPC's handler. Handlers stay thin: validate the request, call the
//! daemon's services, convert the result; every unary handler runs inside [`crate::rpc::call`]
//! (the GetContainerEvents stream, [`events`], logs its subscribers itself), and so do the
//! streamed lists ([`stream`], through [`crate::rpc::call_batched`]).

pub mod events;
pub mod image;
pub mod runtime;
pub mod stream;

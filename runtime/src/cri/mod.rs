//! The CRI gRPC services. [`runtime`] and [`image`] are the tonic services; RuntimeService's
//! RPCs are handled by group: [`status`] (Version, Status, RuntimeConfig, UpdateRuntimeConfig),
//! [`sandboxes`], [`containers`], [`streaming`] (ExecSync, Exec, Attach, PortForward), [`stats`]
//! (stats and metrics) and [`events`] (GetContainerEvents); ImageService's are all in [`image`].
//!
//! Handlers stay thin: check what the request must carry, convert, call the daemon's services
//! ([`crate::pods::PodService`], [`crate::stream`], the store), convert back. Every unary handler
//! runs inside [`crate::rpc::call`], which logs and maps errors to a status in one place; the
//! streamed lists (Stream*, CRI v0.36) inside [`crate::rpc::call_batched`], from the same
//! function as their list RPC. The GetContainerEvents stream logs its subscribers itself.
//! The kubelet polls the status, list and stats RPCs, so their successes log at debug level
//! ([`crate::rpc::Verbosity::Poll`]).

use std::collections::HashMap;

use tonic::codegen::BoxStream;
use tonic::{Response, Status};

use crate::error::Error;
use crate::pods::inspect::INFO_KEY;

pub mod containers;
pub mod events;
pub mod image;
pub mod runtime;
pub mod sandboxes;
pub mod stats;
pub mod status;
pub mod streaming;

type Reply<T> = Result<Response<T>, Status>;
type Streamed<T> = Result<Response<BoxStream<T>>, Status>;

/// The `info` map of a status reply: the object's JSON under [`INFO_KEY`] when `verbose`.
fn info(
    verbose: bool,
    json: impl FnOnce() -> Result<String, Error>,
) -> Result<HashMap<String, String>, Error> {
    Ok(match verbose {
        true => HashMap::from([(INFO_KEY.to_string(), json()?)]),
        false => HashMap::new(),
    })
}

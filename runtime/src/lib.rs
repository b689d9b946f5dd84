//! minicri's daemon, as a library the `minicri` binary runs.
//!
//! - [`config`]: embedded defaults, the TOML file and the flags;
//! - [`server`]: the unix socket, the single-instance lock, serving and shutdown;
//! - [`rpc`]: per-call deadline, logging and error-to-status mapping;
//! - [`cri`]: the CRI handlers (thin);
//! - [`daemon`]: the services and state the handlers share.

pub mod config;
pub mod cri;
pub mod daemon;
pub mod error;
pub mod rpc;
pub mod server;

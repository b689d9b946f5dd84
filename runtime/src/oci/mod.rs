//! Driving the OCI runtime (runc, crun, youki), and what the specs it is given depend on.
//!
//! - [`runtime`]: the [`OciRuntime`] trait, the seam between minicri and runc / crun / youki;
//! - [`runc`]: [`Runc`], its implementation for runc-compatible command lines;
//! - [`handlers`]: the runtime handlers pods choose by name (RuntimeClass), each probed at start;
//! - [`host`]: host facts ([`HostInfo`]: oom_score_adj clamp, capabilities, cgroup version,
//!   AppArmor) and cgroups paths per driver;
//! - [`annotations`]: which pod annotations reach the runtime's spec (runc, crun and systemd read
//!   some as instructions);
//! - [`settings`]: the `[runtime]` section of the configuration;
//! - [`error`]: the error type, [`OciError`], of this and of spec building.
//!
//! The specs themselves are built from CRI requests in the `spec` module, which depends on this
//! one (its errors, host facts and annotation policy), never the other way round.

pub mod annotations;
pub mod error;
pub mod handlers;
pub mod host;
pub mod runc;
pub mod runtime;
pub mod settings;

pub use error::{OciError, Result};
pub use handlers::{Handler, HandlerConfig, HandlerFeatures, Handlers};
pub use host::{CgroupDriver, HostInfo, cgroups_path, systemd_slice};
pub use runc::Runc;
pub use runtime::{
    CreateIo, CreateOpts, ExecOpts, ExecOutput, ExecProcess, OciRuntime, OciState, ProbeEnv,
    RuntimeCommand,
};

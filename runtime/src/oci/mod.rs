//! The OCI layer: turning CRI requests into OCI runtime specs, and driving the OCI runtime.
//!
//! - [`runtime`]: the [`OciRuntime`] trait, the seam between minicri and runc / crun / youki;
//! - [`runc`]: [`Runc`], its implementation for runc-compatible command lines;
//! - [`handlers`]: the runtime handlers pods choose by name (RuntimeClass), each probed at start;
//! - [`spec`]: [`container_spec`], the spec of a CRI container;
//! - [`sandbox`]: [`sandbox_spec`] for the infra process, the namespaces containers join and the
//!   files (hostname, resolv.conf, hosts, shm) a sandbox shares;
//! - [`user`]: uid, gid and groups from the security context, the image and `/etc/passwd`;
//! - [`userns`]: pods in their own user namespace: validation, idmapped rootfs layers;
//! - [`namespaces`]: the pod's namespace options and OCI namespace entries;
//! - [`annotations`]: which pod annotations reach the OCI spec (an allowlist);
//! - [`own_paths`]: container mounts and devices kept away from minicri's own root, state
//!   directory and socket;
//! - [`defaults`]: default capabilities, mounts, masked paths and device rules;
//! - [`seccomp`]: the `RuntimeDefault` profile and `Localhost` profiles;
//! - [`apparmor`]: the AppArmor profile of a container's process, minicri's `RuntimeDefault`
//!   profile;
//! - [`host`]: host facts ([`HostInfo`]: oom_score_adj clamp, capabilities, cgroup version)
//!   and cgroups paths per driver;
//! - [`image_config`]: the image config fields that matter for running;
//! - [`propagation`]: host-side preparation of bind mount sources (created when missing, made
//!   shared for `rshared` / `rslave` propagation) and mountinfo parsing;
//! - [`error`]: the error type, [`OciError`].
//!
//! Spec building reads files (the rootfs's passwd, device nodes, seccomp profiles) but changes
//! nothing; only [`SandboxFiles::prepare`], [`propagation::prepare_bind_sources`] and the
//! runtime calls have effects.

pub mod annotations;
pub mod apparmor;
pub mod defaults;
pub mod error;
pub mod handlers;
pub mod host;
pub mod image_config;
pub mod namespaces;
pub mod own_paths;
pub mod propagation;
pub mod runc;
pub mod runtime;
pub mod sandbox;
pub mod seccomp;
pub mod settings;
pub mod spec;
pub mod user;
pub mod userns;

#[cfg(test)]
mod sandbox_tests;
#[cfg(test)]
mod spec_tests;

pub use error::{OciError, Result};
pub use handlers::{Handler, HandlerConfig, HandlerFeatures, Handlers, ProbeEnv};
pub use host::{CgroupDriver, HostInfo, cgroups_path, systemd_slice};
pub use image_config::ImageConfig;
pub use runc::Runc;
pub use runtime::{
    CreateIo, CreateOpts, ExecOpts, ExecOutput, ExecProcess, OciRuntime, OciState, RuntimeCommand,
};
pub use sandbox::{SandboxFiles, SandboxNamespaces, SandboxSpecParams, sandbox_spec};
pub use spec::{ContainerSpecParams, container_spec};
pub use user::{ResolvedUser, UserRequest, resolve_user};

/// Writes `spec` as `<bundle>/config.json` (creating the bundle directory).
pub fn write_bundle(bundle: &std::path::Path, spec: &oci_spec::runtime::Spec) -> Result<()> {
    std::fs::create_dir_all(bundle).map_err(|e| OciError::io("create", bundle, e))?;
    let json = serde_json::to_vec_pretty(spec)
        .map_err(|e| OciError::Other(format!("config.json: {e}")))?;
    // The container's environment is in there: readable by root only.
    crate::fsutil::write_atomic(&bundle.join("config.json"), &json, 0o600)
        .map_err(|e| OciError::io("write", bundle.join("config.json"), e))
}

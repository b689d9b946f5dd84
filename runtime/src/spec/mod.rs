//! OCI runtime specs built from CRI requests: the container's and the infra process's
//! `config.json`.
//!
//! - [`container`]: [`container_spec`], the spec of a CRI container;
//! - [`sandbox`]: [`sandbox_spec`] for the infra process, the namespaces containers join and the
//!   files (hostname, resolv.conf, hosts, shm) a sandbox shares;
//! - [`user`]: uid, gid and groups from the security context, the image and `/etc/passwd`;
//! - [`userns`]: pods in their own user namespace: validation, idmapped rootfs layers;
//! - [`namespaces`]: the pod's namespace options and OCI namespace entries;
//! - [`own_paths`]: container mounts and devices kept away from minicri's own root, state
//!   directory and socket;
//! - [`defaults`]: default capabilities, mounts, masked paths and device rules;
//! - [`seccomp`]: the `RuntimeDefault` profile and `Localhost` profiles;
//! - [`apparmor`]: the AppArmor profile of a container's process, minicri's `RuntimeDefault`
//!   profile;
//! - [`image_config`]: the image config fields that matter for running;
//! - [`propagation`]: host-side preparation of bind mount sources (created when missing, made
//!   shared for `rshared` / `rslave` propagation) and mountinfo parsing.
//!
//! Spec building reads files (the rootfs's passwd, device nodes, seccomp profiles) but changes
//! nothing; only [`SandboxFiles::prepare`], [`propagation::prepare_bind_sources`] and
//! [`write_bundle`] have effects. What the host can do ([`crate::oci::HostInfo`]), the error
//! type ([`crate::oci::OciError`]) and which pod annotations reach a spec
//! ([`crate::oci::annotations`]) come from [`crate::oci`].

pub mod apparmor;
pub mod container;
pub mod defaults;
pub mod image_config;
pub mod namespaces;
pub mod own_paths;
pub mod propagation;
pub mod sandbox;
pub mod seccomp;
pub mod user;
pub mod userns;

#[cfg(test)]
mod tests;

use crate::oci::{OciError, Result};

pub use container::{ContainerSpecParams, container_spec};
pub use image_config::ImageConfig;
pub use sandbox::{SandboxFiles, SandboxNamespaces, SandboxSpecParams, sandbox_spec};
pub use user::{ResolvedUser, UserRequest, resolve_user};

/// Writes `spec` as `<bundle>/config.json` (creating the bundle directory).
pub fn write_bundle(bundle: &std::path::Path, spec: &oci_spec::runtime::Spec) -> Result<()> {
    std::fs::create_dir_all(bundle).map_err(|e| OciError::io("create", bundle, e))?;
    let json = serde_json::to_vec_pretty(spec)
        .map_err(|e| OciError::Other(format!("config.json: {e}")))?;
    // The container's environment is in there: readable by root only.
    minicri_snapshotter::write_atomic(&bundle.join("config.json"), &json, 0o600)
        .map_err(|e| OciError::io("write", bundle.join("config.json"), e))
}

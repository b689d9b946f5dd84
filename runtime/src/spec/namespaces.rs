//! Namespaces in specs: the pod's namespace options from its CRI config, and OCI namespace
//! entries (a new namespace, or one to join by path).

use std::path::Path;

use minicri_proto::runtime::v1 as cri;
use oci_spec::runtime::{LinuxNamespace, LinuxNamespaceType};

/// The sandbox's namespace options (defaults: everything `POD`).
pub fn namespace_options(config: &cri::PodSandboxConfig) -> Option<&cri::NamespaceOption> {
    config
        .linux
        .as_ref()?
        .security_context
        .as_ref()?
        .namespace_options
        .as_ref()
}

pub fn namespace(typ: LinuxNamespaceType, path: Option<&Path>) -> LinuxNamespace {
    let mut n = LinuxNamespace::default();
    n.set_typ(typ);
    n.set_path(path.map(Path::to_path_buf));
    n
}

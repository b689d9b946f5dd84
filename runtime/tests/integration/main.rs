//! The runtime library's integration tests, as one test binary: the CNI manager with fake and
//! with Debian's real plugins, pinned network namespaces, sandboxes and containers through
//! shim + runc, and the API-server pod watch against the test API server. Each module was a
//! test binary of its own that built and linked the crate and its dependencies again; as
//! modules of one binary they are built and linked once.
//!
//! The shared fixtures are declared here once: `cni_common` (for the `cni_*` modules; its
//! `require_root!` and `require_plugins!` are exported at this crate's root) and `oci_support`
//! (for the `oci_*` modules).
//!
//! cargo-nextest runs each test in a process of its own; plain `cargo test` runs them as
//! threads of one process. `oci_shim::the_shim_survives_its_spawner` runs this binary again
//! for one test by its full name (`oci_shim::spawner_helper`).

mod cni_bridge;
mod cni_common;
mod cni_fake;
mod cni_netns;
mod kube_watch;
mod oci_lifecycle;
mod oci_shim;
mod oci_support;

//! The snapshotter's integration tests, as one test binary: the suite of filesystem semantics,
//! the snapshot lifecycle, malicious and hostile layers, and the property test against a model
//! of OCI layer semantics, each against both backends with real mounts (root). Each module was
//! a test binary of its own that built and linked the crate and its dependencies again; as
//! modules of one binary they are built and linked once.
//!
//! `common` (layer builders, trees, `both_backends!`) is declared here once for all of them.
//! The property test's saved failure seeds stay next to it, in `props.proptest-regressions`
//! (see `props.rs` for why it names that file itself).
//!
//! cargo-nextest runs each test in a process of its own; plain `cargo test` runs them as
//! threads of one process (they keep no process-wide state: each has its own root).

mod common;
mod hostile;
mod lifecycle;
mod malicious;
mod props;
mod suite;

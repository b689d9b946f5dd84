//! minicri's black-box tests, as one test binary: the real `minicri` daemon (its CRI services,
//! its command line, its Debian package) against real registries, fault-injecting proxies,
//! runc, CNI plugins and the test API server, and the tests of that test support itself
//! (`support_*`). Each module below was a test binary of its own, and each linked the whole
//! dependency tree (tonic, rustls, the store, the snapshotter, ...) again; as modules of one
//! binary they are built and linked once. What they share is the `minicri_tests` library
//! (tests/src/), so nothing is declared here but the modules.
//!
//! The daemon they start is `target/<profile>/minicri` (or `$MINICRI_BIN`): build it first
//! (`cargo build --bins`, as hack/test.sh does). One module's tests:
//! `cargo nextest run -p minicri-tests -E 'test(/^pulls::/)'`.
//!
//! cargo-nextest runs each test in a process of its own. Plain `cargo test` (hack/test.sh's
//! fallback without nextest) runs the tests of all modules as threads of this one process, as
//! many at a time as there are cores: a test then runs beside tests of other modules, not only
//! of its own file. The tests keep nothing process-wide but what tests/src shares on purpose
//! (the server-spawner thread, cached test layers); `stall` (call latencies) and `load` (the
//! daemon's memory and descriptors), which ran alone under `cargo test` before, now have a
//! neighbour there, as they always have under nextest.

mod checkpoint;
mod daemon_cli;
mod detach_race;
mod disk;
mod fair_pulls;
mod faults;
mod fleet;
mod hostile;
mod image_service;
mod image_volumes;
mod kube_watch;
mod kubelet_release;
mod kubelet_sim;
mod layer_blobs;
mod load;
mod package;
mod pod_attach;
mod pod_exec;
mod pod_inspect;
mod pod_lifecycle;
mod pod_metrics;
mod pod_portforward;
mod pod_resize;
mod pod_rollback;
mod pod_sandbox_files;
mod pod_security;
mod pod_stats;
mod pod_tty;
mod pod_websocket;
mod pods;
mod pulls;
mod runtime_handlers;
mod ssrf;
mod stall;
mod streamed_lists;
mod support_apiserver;
mod support_images;
mod support_proxy;
mod support_registry;
mod unpack;

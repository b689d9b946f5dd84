//! The pod service's logic through the fake runtime and monitors ([`super::fake`]), without
//! root: rollback of RunPodSandbox at each failing step, idempotent stop and remove, the
//! sandbox's state transitions, recovery after a restart, and handler selection. Host-network,
//! host-IPC pods need no namespace, mount or CNI plugin; what the kernel does is tested end to
//! end in `tests/tests/e2e/pod*.rs` with runc. The node and the calls every test makes are here;
//! the tests are in [`sandboxes`] and [`containers`].

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use minicri_proto::runtime::v1 as cri;

use super::fake::Fake;
use super::store::SandboxState;
use super::{PodService, Seams};
use crate::config::Config;
use crate::error::Error;
use crate::images::ImageAccess;
use crate::images::fake::FakeImages;
use crate::oci::{HandlerFeatures, Handlers, HostInfo, OciRuntime};
use crate::shim::Monitors;

mod containers;
mod sandboxes;

/// One node's state directory, its fake runtime and its image side. A second
/// [`Node::service`] is a restart of the pod service: the fake outlives it, as the runtime and
/// the shims outlive a daemon, and so does the image side, which holds the snapshotter's lock.
pub(super) struct Node {
    pub(super) dir: tempfile::TempDir,
    pub(super) fake: Arc<Fake>,
    pub(super) images: Arc<FakeImages>,
}

impl Node {
    pub(super) fn new() -> Node {
        let dir = tempfile::tempdir().unwrap();
        let images = Arc::new(FakeImages::new(&dir.path().join("root/snapshots")));
        Node {
            dir,
            fake: Fake::new(),
            images,
        }
    }

    /// A pod service over this node's state directory.
    pub(super) fn service(&self) -> Arc<PodService> {
        let none = self.dir.path().join("no-cni");
        let mut config = Config::default();
        config.daemon.root = self.dir.path().join("root");
        config.daemon.state = self.state();
        config.cni.conf_dirs = vec![none.clone()];
        config.cni.bin_dirs = vec![none];
        let seams = |_: &HostInfo| {
            let runtime: Arc<dyn OciRuntime> = self.fake.clone();
            let features = HandlerFeatures::default();
            let handlers = Handlers::from_runtimes("fake", [("fake".into(), runtime, features)]);
            let monitors: Arc<dyn Monitors> = self.fake.clone();
            Ok(Seams { handlers, monitors })
        };
        PodService::open_with(&config, self.images.clone(), seams).unwrap()
    }

    pub(super) fn state(&self) -> std::path::PathBuf {
        self.dir.path().join("state")
    }
}

/// A pod on the host's network and IPC namespaces: nothing of it needs root.
pub(super) fn host_pod(name: &str) -> cri::PodSandboxConfig {
    cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: name.into(),
            namespace: "default".into(),
            uid: format!("uid-{name}"),
            attempt: 0,
        }),
        hostname: name.into(),
        linux: Some(cri::LinuxPodSandboxConfig {
            security_context: Some(cri::LinuxSandboxSecurityContext {
                namespace_options: Some(cri::NamespaceOption {
                    network: cri::NamespaceMode::Node as i32,
                    ipc: cri::NamespaceMode::Node as i32,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Entries of `dir` (none when it does not exist).
pub(super) fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// What a sandbox leaves on disk and in the records: nothing once it is undone or removed.
pub(super) fn assert_nothing_left(node: &Node, svc: &PodService) {
    let state = node.state();
    assert!(svc.store.sandboxes().is_empty(), "sandbox records remain");
    for d in ["b", "sandboxes", "pods/inflight"] {
        assert_eq!(entries(&state.join(d)), Vec::<String>::new(), "{d}");
    }
}

/// Runs a host pod named `name` through the default handler; its sandbox id.
pub(super) async fn run(svc: &Arc<PodService>, name: &str) -> String {
    svc.run_pod_sandbox(host_pod(name), String::new())
        .await
        .unwrap()
}

pub(super) async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

//! The pod service's logic through the fake runtime and monitors ([`super::fake`]), without
//! root: rollback of RunPodSandbox at each failing step, idempotent stop and remove, the
//! sandbox's state transitions, recovery after a restart, and handler selection. Host-network,
//! host-IPC pods need no namespace, mount or CNI plugin; what the kernel does is tested end to
//! end in `runtime/tests/pod*.rs` with runc.

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

/// One node's state directory, its fake runtime and its image side. A second
/// [`Node::service`] is a restart of the pod service: the fake outlives it, as the runtime and
/// the shims outlive a daemon, and so does the image side, which holds the snapshotter's lock.
struct Node {
    dir: tempfile::TempDir,
    fake: Arc<Fake>,
    images: Arc<FakeImages>,
}

impl Node {
    fn new() -> Node {
        let dir = tempfile::tempdir().unwrap();
        let images = Arc::new(FakeImages::new(&dir.path().join("root/snapshots")));
        Node {
            dir,
            fake: Fake::new(),
            images,
        }
    }

    /// A pod service over this node's state directory.
    fn service(&self) -> Arc<PodService> {
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

    fn state(&self) -> std::path::PathBuf {
        self.dir.path().join("state")
    }
}

/// A pod on the host's network and IPC namespaces: nothing of it needs root.
fn host_pod(name: &str) -> cri::PodSandboxConfig {
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
fn entries(dir: &Path) -> Vec<String> {
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
fn assert_nothing_left(node: &Node, svc: &PodService) {
    let state = node.state();
    assert!(svc.store.sandboxes().is_empty(), "sandbox records remain");
    for d in ["b", "sandboxes", "pods/inflight"] {
        assert_eq!(entries(&state.join(d)), Vec::<String>::new(), "{d}");
    }
}

/// Runs a host pod named `name` through the default handler; its sandbox id.
async fn run(svc: &Arc<PodService>, name: &str) -> String {
    svc.run_pod_sandbox(host_pod(name), String::new())
        .await
        .unwrap()
}

async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_pod_runs_through_its_handler_and_is_ready() {
    let node = Node::new();
    let svc = node.service();
    let id = run(&svc, "web").await;
    let calls = node.fake.calls();
    let (spawn, start) = (format!("spawn {id}"), format!("start {id}"));
    let pos = |c: &str| {
        calls
            .iter()
            .position(|x| x == c)
            .unwrap_or_else(|| panic!("no {c:?} in {calls:?}"))
    };
    assert!(pos("probe fake") < pos(&spawn), "{calls:?}");
    assert!(pos(&spawn) < pos(&start), "{calls:?}");
    assert_eq!(node.fake.status(&id).as_deref(), Some("running"));
    let status = svc.pod_sandbox_status(&id).unwrap();
    assert_eq!(status.state, cri::PodSandboxState::SandboxReady as i32);
    assert_eq!(svc.list_pod_sandbox(None).len(), 1);
    assert!(
        node.state()
            .join("b")
            .join(&id[..32])
            .join("config.json")
            .is_file()
    );
    // Its journal is gone once the operation is done.
    assert_eq!(
        entries(&node.state().join("pods/inflight")),
        Vec::<String>::new()
    );
}

/// RunPodSandbox fails at each step of the runtime in turn; every time, every step before it
/// is undone: the runtime's container deleted, the monitor killed, the bundle and the sandbox
/// files removed, the journal gone, and the name free for the kubelet's retry.
#[tokio::test]
async fn a_run_that_fails_at_any_runtime_step_is_undone() {
    for op in ["spawn", "start"] {
        let node = Node::new();
        let svc = node.service();
        node.fake.fail(op, "boom");
        let e = svc
            .run_pod_sandbox(host_pod("web"), String::new())
            .await
            .unwrap_err();
        assert!(e.to_string().contains("boom"), "{op}: {e}");
        let calls = node.fake.calls();
        let id = calls
            .iter()
            .find_map(|c| c.strip_prefix("spawn "))
            .unwrap()
            .to_string();
        assert!(node.fake.called(&format!("delete {id}")), "{op}: {calls:?}");
        assert_eq!(node.fake.status(&id), None, "{op}: the container remains");
        assert!(
            !node.fake.monitor_alive(&id),
            "{op}: the monitor still runs"
        );
        assert_nothing_left(&node, &svc);
        // The name is free again.
        node.fake.release(op);
        node.fake.with_no_failures();
        run(&svc, "web").await;
    }
}

#[tokio::test]
async fn stop_and_remove_are_idempotent() {
    let node = Node::new();
    let svc = node.service();
    let id = run(&svc, "web").await;
    let closed = || node.images.closed.lock().unwrap().clone();
    assert!(closed().is_empty(), "a running pod's pulls are open");
    for _ in 0..2 {
        svc.stop_pod_sandbox(id.clone()).await.unwrap();
        // First of all, the pod's pulls are closed: its PullImage calls return at once.
        assert_eq!(closed(), ["uid-web/0".to_string()].into());
        let status = svc.pod_sandbox_status(&id).unwrap();
        assert_eq!(status.state, cri::PodSandboxState::SandboxNotready as i32);
        assert_eq!(
            node.fake.status(&id),
            None,
            "the infra is deleted from the runtime"
        );
        assert!(!node.fake.monitor_alive(&id));
    }
    // Killed and deleted once: the second stop found nothing to do.
    let count = |c: &str| node.fake.calls().iter().filter(|x| *x == c).count();
    assert_eq!(count(&format!("kill {id}")), 1);
    assert_eq!(count(&format!("delete {id}")), 1);
    for _ in 0..2 {
        svc.remove_pod_sandbox(id.clone()).await.unwrap();
        assert!(matches!(
            svc.pod_sandbox_status(&id),
            Err(Error::NotFound(_))
        ));
    }
    assert_nothing_left(&node, &svc);
    // Unknown ids are success for both (CRI).
    svc.stop_pod_sandbox("0".repeat(64)).await.unwrap();
    svc.remove_pod_sandbox("0".repeat(64)).await.unwrap();
    // A removed pod's name can be used again, and its pulls are open again.
    run(&svc, "web").await;
    assert!(closed().is_empty(), "{:?}", closed());
}

/// A stop whose runtime `delete` fails keeps the sandbox's monitor reference, so the kubelet's
/// retry finishes it.
#[tokio::test]
async fn a_failed_stop_is_finished_by_the_retry() {
    let node = Node::new();
    let svc = node.service();
    let id = run(&svc, "web").await;
    node.fake.fail("delete", "device busy");
    let e = svc.stop_pod_sandbox(id.clone()).await.unwrap_err();
    assert!(e.to_string().contains("device busy"), "{e}");
    assert!(svc.store.sandbox(&id).unwrap().shim.is_some());
    node.fake.with_no_failures();
    svc.stop_pod_sandbox(id.clone()).await.unwrap();
    assert_eq!(node.fake.status(&id), None);
    assert!(svc.store.sandbox(&id).unwrap().shim.is_none());
}

#[tokio::test]
async fn a_pod_whose_infra_exits_becomes_not_ready() {
    let node = Node::new();
    let svc = node.service();
    let id = run(&svc, "web").await;
    node.fake.exit(&id, 2);
    wait_for("the sandbox is not ready", || {
        svc.pod_sandbox_status(&id).unwrap().state == cri::PodSandboxState::SandboxNotready as i32
    })
    .await;
}

/// After a restart: a pod whose monitor died meanwhile is NotReady; one whose monitor runs is
/// Ready and watched again (its infra's later exit is noticed).
#[tokio::test]
async fn a_restart_reattaches_to_live_monitors_and_marks_lost_ones() {
    let node = Node::new();
    let (live, lost) = {
        let svc = node.service();
        let live = run(&svc, "live").await;
        let lost = run(&svc, "lost").await;
        (live, lost)
    };
    node.fake.lose_monitor(&lost);
    let svc = node.service();
    let state = |id: &str| svc.store.sandbox(id).unwrap().state;
    assert_eq!(state(&lost), SandboxState::NotReady);
    assert_eq!(state(&live), SandboxState::Ready);
    node.fake.exit(&live, 0);
    wait_for("the live sandbox's exit is noticed", || {
        state(&live) == SandboxState::NotReady
    })
    .await;
}

/// A daemon (a service of `node`) killed in the middle of RunPodSandbox, while its monitor
/// creates the container: the operation never goes on (its monitor call stays hung) and its
/// journal is left. Returns the sandbox id.
async fn crash_while_spawning(node: &Node) -> String {
    let first = node.service();
    node.fake.hang("spawn");
    let run = tokio::spawn({
        let first = first.clone();
        async move { first.run_pod_sandbox(host_pod("web"), String::new()).await }
    });
    wait_for("the monitor is being spawned", || {
        node.fake.calls().iter().any(|c| c.starts_with("spawn "))
    })
    .await;
    let id = node
        .fake
        .calls()
        .iter()
        .find_map(|c| c.strip_prefix("spawn "))
        .unwrap()
        .to_string();
    assert_eq!(entries(&node.state().join("pods/inflight")).len(), 1);
    run.abort();
    id
}

/// A daemon killed in the middle of RunPodSandbox (here: while its monitor creates the
/// container) leaves a journal; the next start undoes its steps.
#[tokio::test]
async fn a_run_interrupted_by_a_crash_is_undone_at_the_next_start() {
    let node = Node::new();
    let id = crash_while_spawning(&node).await;
    let svc = node.service();
    svc.finish_interrupted().await;
    assert!(
        node.fake.called(&format!("delete {id}")),
        "{:?}",
        node.fake.calls()
    );
    assert_nothing_left(&node, &svc);
}

#[tokio::test]
async fn handlers_are_chosen_by_name_and_refused_with_their_reason() {
    let node = Node::new();
    let svc = node.service();
    let e = svc
        .run_pod_sandbox(host_pod("web"), "gvisor".into())
        .await
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument(_) | Error::NotFound(_)),
        "{e:?}"
    );
    assert!(e.to_string().contains("\"gvisor\""), "{e}");
    let node = Node::new();
    node.fake
        .unavailable("cgroup v2 is mounted beside v1 controllers");
    let svc = node.service();
    let e = svc
        .run_pod_sandbox(host_pod("web"), "fake".into())
        .await
        .unwrap_err();
    assert!(e.to_string().contains("beside v1 controllers"), "{e}");
    assert!(!node.fake.calls().iter().any(|c| c.starts_with("spawn ")));
    assert_nothing_left(&node, &svc);
}

/// A stats call never walks a writable layer (a tree the container fills as it likes): the
/// first answers with nothing and queues the layer; the background measurer fills in the figures,
/// once however often it is asked meanwhile, and stops when nothing waits.
#[tokio::test]
async fn a_writable_layer_is_measured_in_the_background() {
    let node = Node::new();
    let svc = node.service();
    let m = node.images.prepare("c1", None).unwrap();
    let upper = std::path::PathBuf::from(&m.source);
    for i in 0..2000 {
        std::fs::write(upper.join(format!("f{i}")), b"x").unwrap();
    }
    assert!(
        svc.writable_layer("c1").is_none(),
        "measured inside the call"
    );
    for _ in 0..10 {
        assert!(
            svc.writable_layer("c1")
                .is_none_or(|u| u.inodes_used.is_some())
        );
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let u = loop {
        if let Some(u) = svc.writable_layer("c1") {
            break u;
        }
        assert!(std::time::Instant::now() < deadline, "never measured");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(u.inodes_used.is_some_and(|v| v.value >= 2000), "{u:?}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !svc.stats.queue().is_idle() {
        assert!(
            std::time::Instant::now() < deadline,
            "the measurer never ended"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Once stale, the last figures are served while the layer is measured again; a layer that
    // is gone is forgotten.
    node.images.remove_snapshot("c1").unwrap();
    tokio::time::sleep(super::stats::SNAPSHOT_USAGE_TTL).await;
    assert!(
        svc.writable_layer("c1").is_some(),
        "stale figures are served"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while svc.writable_layer("c1").is_some() {
        assert!(
            std::time::Instant::now() < deadline,
            "a removed layer stays measured"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// At start, the undo of an interrupted RunPodSandbox hangs in the runtime's delete: the daemon
/// goes on (to serve the CRI) after the limit, keeping the journal; the next start finishes it.
#[tokio::test]
async fn an_undo_that_hangs_at_start_does_not_keep_the_daemon_from_serving() {
    let node = Node::new();
    crash_while_spawning(&node).await;
    node.fake.hang("delete");
    let svc = node.service();
    let t = std::time::Instant::now();
    svc.finish_interrupted_within(Duration::from_millis(300))
        .await;
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(
        entries(&node.state().join("pods/inflight")).len(),
        1,
        "the journal stays for the next start"
    );
    node.fake.release("delete");
    let svc = node.service();
    svc.finish_interrupted().await;
    assert_nothing_left(&node, &svc);
}

/// A pod "web" and, in it, the container `id` as CreateContainer leaves it (recorded as created,
/// with a bundle holding a default spec): returns the bundle's config.json.
async fn created_container(node: &Node, svc: &Arc<PodService>, id: &str) -> std::path::PathBuf {
    use super::store::{ContainerRecord, ContainerState};
    let sandbox_id = run(svc, "web").await;
    let bundle = node.dir.path().join(format!("bundle-{id}"));
    std::fs::create_dir_all(&bundle).unwrap();
    let config = bundle.join("config.json");
    oci_spec::runtime::Spec::default().save(&config).unwrap();
    let mut rec = ContainerRecord::exited(id, &format!("{id}_web"));
    rec.sandbox_id = sandbox_id;
    rec.state = ContainerState::Created;
    rec.bundle = bundle;
    svc.store.put_container(rec).unwrap();
    config
}

/// UpdateContainerResources of a container that StartContainer is starting waits for the start
/// (the container's op lock): the update then goes to the running container through the
/// runtime, instead of into a bundle the runtime has already read, where it would be lost.
#[tokio::test]
async fn an_update_during_a_start_waits_for_it_and_reaches_the_running_container() {
    let node = Node::new();
    let svc = node.service();
    let config = created_container(&node, &svc, "c1").await;
    let written = std::fs::read(&config).unwrap();

    node.fake.hang("start");
    let start = tokio::spawn({
        let svc = svc.clone();
        async move { svc.start_container("c1".into()).await }
    });
    wait_for("the runtime is starting c1", || {
        node.fake.called("start c1")
    })
    .await;
    let update = tokio::spawn({
        let svc = svc.clone();
        let resources = cri::LinuxContainerResources {
            memory_limit_in_bytes: 64 << 20,
            ..Default::default()
        };
        async move { svc.update_container_resources("c1", Some(resources)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!update.is_finished(), "the update waits for the start");
    assert_eq!(std::fs::read(&config).unwrap(), written, "bundle rewritten");

    node.fake.release("start");
    start.await.unwrap().unwrap();
    update.await.unwrap().unwrap();
    assert!(node.fake.called("update c1"), "{:?}", node.fake.calls());
    assert_eq!(std::fs::read(&config).unwrap(), written, "bundle rewritten");
}

/// A runtime's start error goes into the container's record (ContainerStatus' message, and the
/// kubelet's events) cut to what a status carries: runc quotes the command it could not find,
/// which a pod spec or an image config can make megabytes long.
#[tokio::test]
async fn a_start_error_is_recorded_cut_to_a_status_message() {
    let node = Node::new();
    let svc = node.service();
    created_container(&node, &svc, "c1").await;
    let huge = format!(
        "exec: \"{}\": executable file not found",
        "x".repeat(4 << 20)
    );
    node.fake.fail("start", &huge);
    svc.start_container("c1".into()).await.unwrap_err();
    let rec = svc.store.container("c1").unwrap();
    assert_eq!(rec.reason, "StartError");
    assert!(
        rec.message.contains("exec: \"xxx"),
        "{}",
        &rec.message[..64]
    );
    let chars = rec.message.chars().count();
    assert!(
        chars <= crate::error::MAX_STATUS_CHARS + 16,
        "{chars} characters"
    );
}

/// Names and commands a relist or an exec would carry to every caller are bounded and refused
/// by name before anything is looked up or created.
#[tokio::test]
async fn long_container_names_and_exec_commands_are_refused() {
    let node = Node::new();
    let svc = node.service();
    let sb = run(&svc, "names").await;
    for name in ["x".repeat(254), "a b".into(), "a/b".into(), "tab\t".into()] {
        let config = cri::ContainerConfig {
            metadata: Some(cri::ContainerMetadata {
                name: name.clone(),
                attempt: 0,
            }),
            ..Default::default()
        };
        let e = svc
            .create_container(sb.clone(), config, None)
            .await
            .unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("metadata.name")),
            "{name:?}: {e:?}"
        );
    }
    let huge = vec!["x".repeat(1 << 16); 5];
    for (cmd, says) in [
        (vec![], "required"),
        (huge, "more than"),
        (vec!["sh".into(), "a\0b".into()], "cmd[1]"),
    ] {
        let e = super::exec::check_cmd(&cmd).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains(says)),
            "{says}: {e:?}"
        );
    }
    super::exec::check_cmd(&vec!["x".repeat(1 << 16); 3]).unwrap();
}

/// A host-network pod with labels and annotations just under the per-object cap each.
fn big_pod(name: &str) -> cri::PodSandboxConfig {
    let mut c = host_pod(name);
    let near_cap = "x".repeat(super::MAX_METADATA_BYTES - 16);
    c.labels.insert("note".into(), near_cap.clone());
    c.annotations.insert("note".into(), near_cap);
    c
}

/// How many [`big_pod`]s the node's budget holds.
const PODS_AT_THE_CAP: usize = super::DEFAULT_NODE_METADATA_BYTES / (2 * super::MAX_METADATA_BYTES);

/// Pods created side by side (a scale-up onto one node) share the budget too: each claims its
/// bytes at its check, so the ones past the budget are refused although none is recorded yet.
#[tokio::test]
async fn pods_created_at_once_cannot_all_take_the_same_room() {
    let node = Node::new();
    let svc = node.service();
    let runs = (0..PODS_AT_THE_CAP + 4)
        .map(|i| svc.run_pod_sandbox(big_pod(&format!("p{i}")), String::new()));
    let results = futures::future::join_all(runs).await;
    let refused: Vec<_> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert_eq!(
        results.len() - refused.len(),
        PODS_AT_THE_CAP,
        "{refused:?}"
    );
    assert!(
        refused
            .iter()
            .all(|e| e.code() == tonic::Code::ResourceExhausted),
        "{refused:?}"
    );
    // The claims of the refused and of the recorded ones are all given back: only recorded
    // pods hold room now.
    assert_eq!(svc.metadata_claims.lock().unwrap().pods, 0);
}

/// The labels and annotations of all the node's pods stay within the node's budget: past it a new pod is refused (RESOURCE_EXHAUSTED, naming the budget), and
/// room comes back when a pod is removed.
#[tokio::test]
async fn the_pods_of_a_node_share_a_metadata_budget() {
    let node = Node::new();
    let svc = node.service();
    let big = big_pod;
    let mut ids = Vec::new();
    for i in 0..PODS_AT_THE_CAP {
        let id = svc
            .run_pod_sandbox(big(&format!("p{i}")), String::new())
            .await
            .unwrap();
        ids.push(id);
    }
    let err = svc
        .run_pod_sandbox(big("one-more"), String::new())
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err}");
    let budget = format!(
        "past the node's budget of {} (daemon.node_metadata_budget)",
        super::DEFAULT_NODE_METADATA_BYTES
    );
    assert!(err.to_string().contains(&budget), "{err}");
    // A small pod still fits.
    let small = svc.run_pod_sandbox(host_pod("small"), String::new()).await;
    small.unwrap();
    svc.stop_pod_sandbox(ids[0].clone()).await.unwrap();
    svc.remove_pod_sandbox(ids[0].clone()).await.unwrap();
    svc.run_pod_sandbox(big("one-more"), String::new())
        .await
        .unwrap();
}

/// UpdatePodSandboxResources on a cgroup v2 layout (a temporary directory laid out as the
/// unified hierarchy: this host is cgroup v1): the files get the new values; a write that fails
/// part way puts back the ones written before it.
#[tokio::test]
async fn a_pod_resize_on_cgroup_v2_is_written_and_undone_on_failure() {
    use super::resize::pod_total;
    use std::path::PathBuf;
    let node = Node::new();
    let svc = node.service();
    let cg = tempfile::tempdir().unwrap();
    let rel = PathBuf::from("kubepods.slice/kubepods-pod1.slice");
    let dir = cg.path().join(&rel);
    std::fs::create_dir_all(&dir).unwrap();
    let files = [
        ("memory.max", "max"),
        ("cpu.weight", "100"),
        ("cpu.max", "max 100000"),
        ("cpuset.cpus", ""),
    ];
    for (f, v) in files {
        std::fs::write(dir.join(f), format!("{v}\n")).unwrap();
    }
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
    let h = super::cgroups::Hierarchy::V2 {
        root: cg.path().into(),
    };
    let resize = |total: cri::LinuxContainerResources| {
        let (h, rel) = (h.clone(), rel.clone());
        svc.undoable(
            super::Operation::UpdatePodSandboxResources,
            move |svc, j| Box::pin(async move { svc.write_pod_cgroup(h, rel, total, j).await }),
        )
    };
    let grow = cri::LinuxContainerResources {
        cpu_shares: 2048,
        cpu_quota: 150_000,
        memory_limit_in_bytes: 256 << 20,
        ..Default::default()
    };
    resize(pod_total(None, Some(&grow))).await.unwrap();
    assert_eq!(read("memory.max"), (256u64 << 20).to_string());
    assert_eq!(read("cpu.weight"), "79");
    assert_eq!(read("cpu.max"), "150000 100000");
    // The cpuset cannot be written (here: it is a directory, as a refused value would be
    // refused by the kernel): memory and CPU go back to the grown values.
    std::fs::remove_file(dir.join("cpuset.cpus")).unwrap();
    std::fs::create_dir(dir.join("cpuset.cpus")).unwrap();
    let shrink = cri::LinuxContainerResources {
        cpu_shares: 512,
        cpu_quota: 50_000,
        memory_limit_in_bytes: 64 << 20,
        cpuset_cpus: "0".into(),
        ..Default::default()
    };
    let err = resize(pod_total(None, Some(&shrink))).await.unwrap_err();
    assert!(err.to_string().contains("cpuset.cpus"), "{err}");
    assert_eq!(read("memory.max"), (256u64 << 20).to_string());
    assert_eq!(read("cpu.weight"), "79");
    assert_eq!(read("cpu.max"), "150000 100000");
    // No journal is left behind.
    let journals = std::fs::read_dir(node.state().join("pods/inflight")).unwrap();
    assert_eq!(journals.count(), 0);
}

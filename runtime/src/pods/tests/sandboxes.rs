//! RunPodSandbox's undo at each failing step and after a crash, idempotent stop and remove, the
//! sandbox's state transitions, recovery after a restart, handler selection, and the node's
//! budget for pods' labels and annotations.

use std::time::Duration;

use minicri_proto::runtime::v1 as cri;

use super::*;

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

/// A host-network pod with labels and annotations just under the per-object cap each.
fn big_pod(name: &str) -> cri::PodSandboxConfig {
    let mut c = host_pod(name);
    let near_cap = "x".repeat(crate::pods::MAX_METADATA_BYTES - 16);
    c.labels.insert("note".into(), near_cap.clone());
    c.annotations.insert("note".into(), near_cap);
    c
}

/// How many [`big_pod`]s the node's budget holds.
const PODS_AT_THE_CAP: usize =
    crate::pods::DEFAULT_NODE_METADATA_BYTES / (2 * crate::pods::MAX_METADATA_BYTES);

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
        crate::pods::DEFAULT_NODE_METADATA_BYTES
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

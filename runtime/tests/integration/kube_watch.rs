//! Tests of the API server pod watcher (`minicri::kube_watch`) against the
//! test API server of `minicri_tests::apiserver`: deletions of this node's pods are reported
//! once, other nodes' never, and reporting goes on across outages, resyncs and 410 Gone.

use std::sync::Arc;
use std::time::Duration;

use minicri::kube_watch::{self, DeletedPod, DeletionCause, WatchConfig};
use minicri_tests::apiserver::{ApiServer, ApiServerOptions};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const NODE: &str = "node-a";
/// How soon a deletion must be reported once the watch is open (what the feature is for).
const PROMPTLY: Duration = Duration::from_secs(1);
/// The same, where the test is about something else (slack for a loaded machine).
const SOON: Duration = Duration::from_secs(5);

/// A running `kube_watch::run` and the pods it reported.
struct Watcher {
    reports: mpsc::UnboundedReceiver<DeletedPod>,
    shutdown: CancellationToken,
    task: JoinHandle<anyhow::Result<()>>,
    _dir: tempfile::TempDir,
}

impl Watcher {
    fn start(server: &ApiServer) -> Watcher {
        let _ = tracing_subscriber::fmt()
            .with_env_filter("minicri=debug,kube_runtime=debug")
            .with_test_writer()
            .try_init();
        let dir = tempfile::tempdir().unwrap();
        let kubeconfig = server.write_kubeconfig(dir.path()).unwrap();
        let (tx, reports) = mpsc::unbounded_channel();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(kube_watch::run(
            WatchConfig {
                kubeconfig: Some(kubeconfig),
                search: vec![],
                node_name: Some(NODE.to_string()),
            },
            Arc::new(kube_watch::WatchState::new(true)),
            Arc::new(move |p: &DeletedPod| {
                let _ = tx.send(p.clone());
            }),
            shutdown.clone(),
        ));
        Watcher {
            reports,
            shutdown,
            task,
            _dir: dir,
        }
    }

    /// The next report, which must come within `within`.
    async fn report(&mut self, within: Duration) -> DeletedPod {
        match tokio::time::timeout(within, self.reports.recv()).await {
            Ok(Some(p)) => p,
            Ok(None) => panic!("the watcher ended"),
            Err(_) => panic!("no pod reported within {within:?}"),
        }
    }

    /// Asserts nothing is reported for `wait`.
    async fn no_report(&mut self, wait: Duration) {
        if let Ok(Some(p)) = tokio::time::timeout(wait, self.reports.recv()).await {
            panic!("unexpected report {p:?}");
        }
    }

    /// Cancels the watcher, which must then end with Ok promptly.
    async fn stop(self) {
        self.shutdown.cancel();
        let result = tokio::time::timeout(Duration::from_secs(5), self.task)
            .await
            .expect("the watcher did not stop")
            .expect("the watcher panicked");
        result.expect("the watcher failed");
    }
}

fn deleted(uid: &str, name: &str, cause: DeletionCause) -> DeletedPod {
    DeletedPod {
        uid: uid.to_string(),
        namespace: "ns".to_string(),
        name: name.to_string(),
        cause,
    }
}

/// Waits until `cond` holds (at most 15 s).
async fn until(what: &str, cond: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the watcher has listed and has a watch open.
async fn watching(server: &ApiServer) {
    until("a watch open", || server.open_watches() >= 1).await;
}

#[tokio::test]
async fn deletion_of_a_pod_of_this_node_is_reported_once() {
    let server = ApiServer::start().unwrap();
    server.add_pod("ns", "a", "uid-a", NODE);
    server.add_pod("ns", "b", "uid-b", NODE);
    let mut watcher = Watcher::start(&server);
    watching(&server).await;

    server.mark_deleted("uid-a");
    let report = watcher.report(PROMPTLY).await;
    assert_eq!(
        report,
        deleted("uid-a", "a", DeletionCause::DeletionTimestamp)
    );
    // The removal that follows is not reported again.
    server.remove_pod("uid-a");
    // A pod removed without a graceful deletion first is reported by its DELETED event.
    server.remove_pod("uid-b");
    let report = watcher.report(PROMPTLY).await;
    assert_eq!(report, deleted("uid-b", "b", DeletionCause::Deleted));
    // A pod added later is followed too.
    server.add_pod("ns", "c", "uid-c", NODE);
    server.mark_deleted("uid-c");
    let report = watcher.report(PROMPTLY).await;
    assert_eq!(
        report,
        deleted("uid-c", "c", DeletionCause::DeletionTimestamp)
    );
    watcher.no_report(Duration::from_millis(500)).await;

    // What kube-rs asked for: a list, then a watch, both for this node's pods.
    let requests = server.requests();
    assert_eq!(server.list_calls(), 1, "{requests:#?}");
    assert!(
        requests[0]
            .query
            .contains("fieldSelector=spec.nodeName%3Dnode-a"),
        "{requests:#?}"
    );
    let watch = requests.iter().find(|r| r.watch).unwrap();
    assert!(
        watch.query.contains("fieldSelector=spec.nodeName%3Dnode-a"),
        "{requests:#?}"
    );
    assert!(
        watch.query.contains("allowWatchBookmarks=true"),
        "{requests:#?}"
    );
    watcher.stop().await;
}

#[tokio::test]
async fn pods_of_other_nodes_are_never_reported() {
    // A server that ignores field selectors: the watcher's own node check must hold.
    let server = ApiServer::start_with(ApiServerOptions {
        ignore_field_selectors: true,
        ..Default::default()
    })
    .unwrap();
    server.add_pod("ns", "other", "uid-other", "node-b");
    server.add_pod("ns", "gone", "uid-gone", "node-b");
    server.add_pod("ns", "mine", "uid-mine", NODE);
    let mut watcher = Watcher::start(&server);
    watching(&server).await;

    server.mark_deleted("uid-other");
    server.remove_pod("uid-gone");
    server.add_pod("ns", "late", "uid-late", "node-b");
    server.mark_deleted("uid-late");
    // Events come in order: once this node's pod is reported, the others were seen and dropped.
    server.mark_deleted("uid-mine");
    let report = watcher.report(SOON).await;
    assert_eq!(
        report,
        deleted("uid-mine", "mine", DeletionCause::DeletionTimestamp)
    );
    // Nor at a resync: an outage with a pod of another node removed meanwhile, and the history
    // lost, so that the watcher relists.
    server.stop();
    server.remove_pod("uid-other");
    server.compact();
    server.restart().unwrap();
    until("a relist", || server.list_calls() >= 2).await;
    watching(&server).await;
    watcher.no_report(Duration::from_millis(500)).await;
    watcher.stop().await;
}

#[tokio::test]
async fn reporting_goes_on_after_an_api_server_outage() {
    let server = ApiServer::start().unwrap();
    server.add_pod("ns", "a", "uid-a", NODE);
    let mut watcher = Watcher::start(&server);
    watching(&server).await;
    let watches = server.watch_calls();

    server.stop();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    server.restart().unwrap();
    until("a new watch", || server.watch_calls() > watches).await;
    server.mark_deleted("uid-a");
    let report = watcher.report(SOON).await;
    assert_eq!(
        report,
        deleted("uid-a", "a", DeletionCause::DeletionTimestamp)
    );
    // The history survived the outage: the watch resumed without a relist.
    assert_eq!(server.list_calls(), 1, "{:#?}", server.requests());
    watcher.stop().await;
}

#[tokio::test]
async fn a_pod_removed_during_an_outage_is_reported_at_the_resync() {
    let server = ApiServer::start().unwrap();
    server.add_pod("ns", "a", "uid-a", NODE);
    server.add_pod("ns", "b", "uid-b", NODE);
    let mut watcher = Watcher::start(&server);
    watching(&server).await;

    server.stop();
    server.remove_pod("uid-a");
    // The server comes back without the history of the outage (as a restarted API server's
    // watch cache): the watch cannot resume, the watcher relists.
    server.compact();
    server.restart().unwrap();
    let report = watcher.report(Duration::from_secs(15)).await;
    assert_eq!(report, deleted("uid-a", "a", DeletionCause::GoneAtResync));
    assert_eq!(server.list_calls(), 2, "{:#?}", server.requests());
    // b is still followed.
    watching(&server).await;
    server.remove_pod("uid-b");
    let report = watcher.report(SOON).await;
    assert_eq!(report, deleted("uid-b", "b", DeletionCause::Deleted));
    watcher.no_report(Duration::from_millis(300)).await;
    watcher.stop().await;
}

#[tokio::test]
async fn a_410_gone_makes_the_watcher_relist_and_go_on() {
    // No bookmarks: the watcher's resourceVersion moves only with its own node's events.
    let server = ApiServer::start_with(ApiServerOptions {
        bookmark_interval: Duration::from_secs(3600),
        ..Default::default()
    })
    .unwrap();
    server.add_pod("ns", "a", "uid-a", NODE);
    let mut watcher = Watcher::start(&server);
    watching(&server).await;
    assert_eq!(server.list_calls(), 1);

    // A change the watcher does not see, then the history is compacted and its watch closed:
    // it resumes from its last version, older than the history, gets the 410 and relists.
    server.add_pod("ns", "b", "uid-b", "node-b");
    server.compact();
    server.close_watches();
    until("a relist", || server.list_calls() >= 2).await;
    let requests = server.requests();
    let watches: Vec<_> = requests.iter().filter(|r| r.watch).collect();
    assert!(watches.len() >= 2, "{requests:#?}");
    assert_eq!(
        watches[0].query, watches[1].query,
        "the second watch resumed from the same version: {requests:#?}"
    );

    // And it keeps following: the relisted pod and new ones.
    watching(&server).await;
    server.mark_deleted("uid-a");
    let report = watcher.report(SOON).await;
    assert_eq!(
        report,
        deleted("uid-a", "a", DeletionCause::DeletionTimestamp)
    );
    server.add_pod("ns", "c", "uid-c", NODE);
    server.remove_pod("uid-c");
    let report = watcher.report(SOON).await;
    assert_eq!(report, deleted("uid-c", "c", DeletionCause::Deleted));
    watcher.stop().await;
}

#[tokio::test]
async fn an_unreachable_api_server_at_start_is_retried() {
    let server = ApiServer::start().unwrap();
    server.add_pod("ns", "a", "uid-a", NODE);
    server.stop();
    let mut watcher = Watcher::start(&server);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!watcher.task.is_finished());
    server.restart().unwrap();
    watching(&server).await;
    server.mark_deleted("uid-a");
    let report = watcher.report(SOON).await;
    assert_eq!(
        report,
        deleted("uid-a", "a", DeletionCause::DeletionTimestamp)
    );
    watcher.stop().await;
}

#[tokio::test]
async fn an_empty_node_name_is_refused() {
    let run = kube_watch::run(
        WatchConfig {
            kubeconfig: Some("/nonexistent".into()),
            search: vec![],
            node_name: Some(String::new()),
        },
        Arc::new(kube_watch::WatchState::new(true)),
        Arc::new(|_: &DeletedPod| {}),
        CancellationToken::new(),
    );
    let result = tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .expect("run() went on without a node name");
    assert!(result.is_err());
}

//! Owns the API server pod watcher: it lists and watches the pods bound to this node
//! (`fieldSelector=spec.nodeName=<node>`) with kube-rs's `watcher`, and reports each pod once
//! when it is being deleted, so the daemon can drop the pod's pull references at once instead of
//! waiting for a kubelet that never cancels a `PullImage`.
//!
//! It uses the kubelet's own credentials ([`discovery`]): a kubeconfig given, or the first of a
//! search list that exists (looked for again every [`DISCOVERY_INTERVAL`] until one does: a
//! node's kubelet may bootstrap its credentials after minicri started). The node is the one
//! given, or the one the client certificate names, or the hostname.
//!
//! A pod is reported ([`DeletedPod`]) the first time it is seen with a
//! `metadata.deletionTimestamp` ([`DeletionCause::DeletionTimestamp`]), or when a `DELETED` event
//! arrives ([`DeletionCause::Deleted`]), or when a relist (after an outage with a compacted
//! history, a 410 Gone) no longer contains a pod seen before ([`DeletionCause::GoneAtResync`]).
//! Pods never seen in the API (static pods) are never reported; objects of other nodes, or
//! without a uid, are ignored. The watcher remembers only the pods currently on the node: a pod
//! is forgotten once it is gone.
//!
//! Nothing here is fatal once the node name is given: an unreadable kubeconfig, an unreachable
//! API server, failed lists and watches are logged and retried with an exponential backoff
//! (0.5 s doubling up to 30 s, with jitter) until the shutdown token is cancelled.

pub mod discovery;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::config::KubeConfigOptions;
use kube::runtime::watcher;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// The first retry delay after an error.
const BACKOFF_MIN: Duration = Duration::from_millis(500);
/// The longest retry delay.
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A failure this long after the previous one starts the backoff over.
const BACKOFF_RESET_AFTER: Duration = Duration::from_secs(60);
/// `timeoutSeconds` of each watch call: the server ends the watch after this long and the
/// watcher starts a new one from the last resourceVersion; a connection that went silent is
/// noticed after this plus kube-rs's 5 s margin.
const WATCH_TIMEOUT_SECS: u32 = 120;
/// How often the search list is looked at while no kubeconfig is found.
pub const DISCOVERY_INTERVAL: Duration = Duration::from_secs(10);

/// What [`run`] watches.
#[derive(Debug, Clone)]
pub struct WatchConfig {
    /// A kubeconfig file whose current context reaches the API server (the kubelet's); `None`:
    /// the first of `search` that exists.
    pub kubeconfig: Option<PathBuf>,
    /// Where the kubeconfig is looked for, in order, when none is given.
    pub search: Vec<PathBuf>,
    /// The node whose pods are watched (`spec.nodeName`); `None`: the client certificate's
    /// `CN=system:node:<name>`, else the hostname.
    pub node_name: Option<String>,
}

impl From<crate::config::KubeWatch> for WatchConfig {
    fn from(w: crate::config::KubeWatch) -> WatchConfig {
        WatchConfig {
            kubeconfig: w.kubeconfig,
            search: w.search,
            node_name: w.node_name,
        }
    }
}

/// A pod of this node being deleted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeletedPod {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    pub cause: DeletionCause,
}

/// How a pod's deletion was seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeletionCause {
    /// The pod got a `metadata.deletionTimestamp` (graceful deletion started).
    DeletionTimestamp,
    /// A `DELETED` watch event.
    Deleted,
    /// A relist no longer contained the pod: it was deleted while the watch was down.
    GoneAtResync,
}

impl std::fmt::Display for DeletionCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeletionCause::DeletionTimestamp => "deletionTimestamp",
            DeletionCause::Deleted => "deleted",
            DeletionCause::GoneAtResync => "gone at resync",
        })
    }
}

/// Called once per deleted pod uid.
pub type OnDeleted = Arc<dyn Fn(&DeletedPod) + Send + Sync>;

/// Runs until `shutdown` is cancelled: finds the kubeconfig, watches the pods bound to the node
/// and calls `on_deleted` once per pod uid (see the module docs). Fails only on an empty node
/// name; everything else is retried.
pub async fn run(
    cfg: WatchConfig,
    on_deleted: OnDeleted,
    shutdown: CancellationToken,
) -> Result<()> {
    if cfg
        .node_name
        .as_deref()
        .is_some_and(|n| n.trim().is_empty())
    {
        bail!("the pod watcher needs a node name");
    }
    let Some(kubeconfig) = find_kubeconfig(&cfg, &shutdown).await else {
        return Ok(());
    };
    let mut backoff = Backoff::default();
    let (client, node_name) = loop {
        let attempt = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            c = client(&kubeconfig, cfg.node_name.as_deref()) => c,
        };
        match attempt {
            Ok(client) => break client,
            Err(e) => {
                let delay = backoff.next_delay();
                warn!(
                    kubeconfig = %kubeconfig.display(),
                    error = format!("{e:#}"),
                    retry_in = ?delay,
                    "pod watcher: cannot set up the API server client"
                );
                if sleep_or_shutdown(delay, &shutdown).await {
                    return Ok(());
                }
            }
        }
    };
    let cfg = ResolvedConfig {
        kubeconfig,
        node_name,
    };

    let api: Api<Pod> = Api::all(client);
    let selector = format!("spec.nodeName={}", cfg.node_name);
    let config = watcher::Config::default()
        .fields(&selector)
        .timeout(WATCH_TIMEOUT_SECS);
    let stream = watcher(api, config);
    futures::pin_mut!(stream);
    let mut tracker = Tracker::new(cfg.node_name.clone(), on_deleted);
    let mut failures: u32 = 0;
    let mut last_gone: Option<Instant> = None;
    info!(node = %cfg.node_name, kubeconfig = %cfg.kubeconfig.display(), "pod watcher: starting");
    loop {
        let next = tokio::select! {
            _ = shutdown.cancelled() => break,
            next = stream.next() => next,
        };
        match next {
            Some(Ok(event)) => {
                // `Init` comes before the list is even tried: it proves nothing.
                if !matches!(event, watcher::Event::Init) {
                    if failures > 0 {
                        info!(failures, "pod watcher: API server reachable again");
                        failures = 0;
                    }
                    backoff.reset();
                }
                tracker.handle(event);
            }
            // The watch cannot resume from its resourceVersion (410 Gone): the watcher relists
            // at its next step. That is routine, so no backoff, unless it keeps happening.
            Some(Err(watcher::Error::WatchError(status)))
                if status.code == 410
                    && last_gone.is_none_or(|t| t.elapsed() > BACKOFF_MIN * 2) =>
            {
                last_gone = Some(Instant::now());
                info!(
                    message = %status.message,
                    "pod watcher: watch history expired (410 Gone), relisting"
                );
            }
            Some(Err(e)) => {
                failures += 1;
                let delay = backoff.next_delay();
                warn!(
                    error = format!("{:#}", anyhow::Error::new(e)),
                    retry_in = ?delay,
                    "pod watcher: list/watch failed"
                );
                if sleep_or_shutdown(delay, &shutdown).await {
                    break;
                }
            }
            // kube-rs's watcher never ends; should it, there is nothing left to watch.
            None => bail!("the pod watch stream ended"),
        }
    }
    info!("pod watcher: stopped");
    Ok(())
}

/// Where the watch is connected once its credentials are found.
struct ResolvedConfig {
    kubeconfig: PathBuf,
    node_name: String,
}

/// The kubeconfig given, or the first of the search list that exists, looked for until one does
/// (`None`: shutdown first).
async fn find_kubeconfig(cfg: &WatchConfig, shutdown: &CancellationToken) -> Option<PathBuf> {
    if let Some(k) = &cfg.kubeconfig {
        return Some(k.clone());
    }
    let mut said = false;
    loop {
        let search = cfg.search.clone();
        let found = crate::fsutil::off_async(|| discovery::find_kubeconfig(&search));
        if let Some(path) = found {
            info!(kubeconfig = %path.display(), "pod watcher: found the kubelet's kubeconfig");
            return Some(path);
        }
        if !said {
            info!(
                searched = ?cfg.search,
                "no kubeconfig found: running without the API-server watch (pulls detach after \
                 pull_detach_after); looking again every 10s"
            );
            said = true;
        }
        if sleep_or_shutdown(DISCOVERY_INTERVAL, shutdown).await {
            return None;
        }
    }
}

/// The client for the kubeconfig's current context, and the node it watches: `node` if given,
/// else the client certificate's, else the hostname.
async fn client(
    kubeconfig: &std::path::Path,
    node: Option<&str>,
) -> Result<(kube::Client, String)> {
    let loaded = crate::fsutil::off_async(|| discovery::load(kubeconfig))
        .with_context(|| format!("reading kubeconfig {}", kubeconfig.display()))?;
    let node = match (node, &loaded.node_from_cert) {
        (Some(n), _) => n.to_string(),
        (None, Some(n)) => n.clone(),
        (None, None) => hostname()?,
    };
    let config =
        kube::Config::from_custom_kubeconfig(loaded.kubeconfig, &KubeConfigOptions::default())
            .await
            .with_context(|| format!("loading kubeconfig {}", kubeconfig.display()))?;
    let url = config.cluster_url.to_string();
    let client =
        kube::Client::try_from(config).with_context(|| format!("creating a client for {url}"))?;
    debug!(%url, %node, "pod watcher: API server client ready");
    Ok((client, node))
}

/// The kubelet's default node name: the hostname, lower-cased.
fn hostname() -> Result<String> {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .filter(|h| !h.is_empty())
        .map(|h| h.to_lowercase())
        .context("no node name given, none in the client certificate, and no hostname")
}

/// Sleeps `delay`; true if `shutdown` came first.
async fn sleep_or_shutdown(delay: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => true,
        _ = tokio::time::sleep(delay) => false,
    }
}

/// Exponential backoff with jitter, started over by success or a long quiet spell.
#[derive(Debug, Default)]
struct Backoff {
    current: Option<Duration>,
    last_failure: Option<Instant>,
}

impl Backoff {
    fn next_delay(&mut self) -> Duration {
        if self
            .last_failure
            .is_some_and(|t| t.elapsed() > BACKOFF_RESET_AFTER)
        {
            self.current = None;
        }
        self.last_failure = Some(Instant::now());
        let base = match self.current {
            None => BACKOFF_MIN,
            Some(d) => (d * 2).min(BACKOFF_MAX),
        };
        self.current = Some(base);
        // Up to +25%, so the nodes of a cluster do not all come back at the same instant.
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        base + base / 4 * (nanos % 1000) / 1000
    }

    fn reset(&mut self) {
        self.current = None;
    }
}

/// What is remembered of a pod of this node.
#[derive(Debug)]
struct Known {
    namespace: String,
    name: String,
    /// Reported already (its deletionTimestamp was seen).
    reported: bool,
}

/// The pods of this node seen in the API, and the reporting rules; fed the watcher's events.
struct Tracker {
    node: String,
    on_deleted: OnDeleted,
    known: HashMap<String, Known>,
    /// The uids listed so far while a (re)list is under way.
    listing: Option<HashSet<String>>,
    /// A first list completed: later lists are resyncs.
    listed_once: bool,
}

/// The fields of a pod the tracker uses, checked.
struct PodRef {
    uid: String,
    namespace: String,
    name: String,
    deleting: bool,
}

impl Tracker {
    fn new(node: String, on_deleted: OnDeleted) -> Tracker {
        Tracker {
            node,
            on_deleted,
            known: HashMap::new(),
            listing: None,
            listed_once: false,
        }
    }

    fn handle(&mut self, event: watcher::Event<Pod>) {
        match event {
            watcher::Event::Init => {
                if self.listed_once {
                    info!(node = %self.node, "pod watcher: resync, listing the node's pods again");
                } else {
                    debug!(node = %self.node, "pod watcher: listing the node's pods");
                }
                self.listing = Some(HashSet::new());
            }
            watcher::Event::InitApply(pod) => {
                let Some(pod) = self.check(&pod) else { return };
                if let Some(listing) = &mut self.listing {
                    listing.insert(pod.uid.clone());
                }
                self.apply(pod);
            }
            watcher::Event::InitDone => self.list_done(),
            watcher::Event::Apply(pod) => {
                if let Some(pod) = self.check(&pod) {
                    self.apply(pod);
                }
            }
            watcher::Event::Delete(pod) => {
                let Some(pod) = self.check(&pod) else { return };
                let known = self.known.remove(&pod.uid);
                if !known.is_some_and(|k| k.reported) {
                    self.report(&pod.uid, &pod.namespace, &pod.name, DeletionCause::Deleted);
                }
            }
        }
    }

    /// The pod's fields, if it is a pod of this node with a uid; logs why not otherwise.
    fn check(&self, pod: &Pod) -> Option<PodRef> {
        let meta = &pod.metadata;
        let namespace = meta.namespace.clone().unwrap_or_default();
        let name = meta.name.clone().unwrap_or_default();
        let Some(uid) = meta.uid.clone().filter(|u| !u.is_empty()) else {
            warn!(%namespace, %name, "pod watcher: ignoring a pod without a uid");
            return None;
        };
        let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
        if node != Some(self.node.as_str()) {
            warn!(
                %namespace, %name, %uid, node = node.unwrap_or(""),
                "pod watcher: ignoring a pod of another node"
            );
            return None;
        }
        Some(PodRef {
            uid,
            namespace,
            name,
            deleting: meta.deletion_timestamp.is_some(),
        })
    }

    /// A pod seen alive or being deleted (listed, added, modified).
    fn apply(&mut self, pod: PodRef) {
        let known = self.known.entry(pod.uid.clone()).or_insert_with(|| Known {
            namespace: pod.namespace.clone(),
            name: pod.name.clone(),
            reported: false,
        });
        if pod.deleting && !known.reported {
            known.reported = true;
            self.report(
                &pod.uid,
                &pod.namespace,
                &pod.name,
                DeletionCause::DeletionTimestamp,
            );
        }
    }

    /// A (re)list completed: the pods known before and not listed now were deleted meanwhile.
    fn list_done(&mut self) {
        let Some(listed) = self.listing.take() else {
            return;
        };
        let mut gone: Vec<String> = self
            .known
            .keys()
            .filter(|uid| !listed.contains(*uid))
            .cloned()
            .collect();
        gone.sort();
        for uid in &gone {
            if let Some(k) = self.known.remove(uid)
                && !k.reported
            {
                self.report(uid, &k.namespace, &k.name, DeletionCause::GoneAtResync);
            }
        }
        if self.listed_once {
            info!(
                node = %self.node, pods = listed.len(), gone = gone.len(),
                "pod watcher: resync done"
            );
        } else {
            info!(node = %self.node, pods = listed.len(), "pod watcher: initial list done");
        }
        self.listed_once = true;
    }

    fn report(&self, uid: &str, namespace: &str, name: &str, cause: DeletionCause) {
        info!(%namespace, %name, %uid, %cause, "pod watcher: pod deletion seen");
        (self.on_deleted)(&DeletedPod {
            uid: uid.to_string(),
            namespace: namespace.to_string(),
            name: name.to_string(),
            cause,
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use k8s_openapi::api::core::v1::PodSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    use super::*;

    fn pod(uid: &str, node: &str, deleting: bool) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(format!("pod-{uid}")),
                namespace: Some("ns".into()),
                uid: Some(uid.into()),
                deletion_timestamp: deleting.then(|| Time(Default::default())),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some(node.into()),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// The (uid, cause) pairs reported.
    type Seen = Arc<Mutex<Vec<(String, DeletionCause)>>>;

    fn tracker() -> (Tracker, Seen) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        let on_deleted: OnDeleted = Arc::new(move |p: &DeletedPod| {
            sink.lock().unwrap().push((p.uid.clone(), p.cause));
        });
        (Tracker::new("node-a".into(), on_deleted), seen)
    }

    #[test]
    fn reports_each_pod_once_and_forgets_it() {
        use watcher::Event::*;
        let (mut t, seen) = tracker();
        t.handle(Init);
        t.handle(InitApply(pod("a", "node-a", false)));
        t.handle(InitApply(pod("b", "node-a", false)));
        t.handle(InitApply(pod("x", "node-b", true)));
        t.handle(InitDone);
        t.handle(Apply(pod("a", "node-a", true)));
        t.handle(Apply(pod("a", "node-a", true)));
        t.handle(Delete(pod("a", "node-a", true)));
        t.handle(Delete(pod("x", "node-b", true)));
        t.handle(Apply(pod("c", "node-a", false)));
        // A relist without b and c: both gone.
        t.handle(Init);
        t.handle(InitApply(pod("d", "node-a", true)));
        t.handle(InitDone);
        assert_eq!(
            *seen.lock().unwrap(),
            vec![
                ("a".into(), DeletionCause::DeletionTimestamp),
                ("d".into(), DeletionCause::DeletionTimestamp),
                ("b".into(), DeletionCause::GoneAtResync),
                ("c".into(), DeletionCause::GoneAtResync),
            ]
        );
        assert_eq!(t.known.keys().collect::<Vec<_>>(), vec!["d"]);
    }

    #[test]
    fn backoff_grows_to_the_cap() {
        let mut b = Backoff::default();
        let first = b.next_delay();
        assert!(first >= BACKOFF_MIN && first <= BACKOFF_MIN * 5 / 4);
        for _ in 0..20 {
            assert!(b.next_delay() <= BACKOFF_MAX * 5 / 4);
        }
        assert!(b.next_delay() >= BACKOFF_MAX);
        b.reset();
        assert!(b.next_delay() <= BACKOFF_MIN * 5 / 4);
    }
}

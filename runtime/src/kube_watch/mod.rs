//! Owns the API-server watch of this node's pods: it lists and watches the pods bound to the
//! node (`fieldSelector=spec.nodeName=<node>`), keeps what it learns in a [`PodCache`] and
//! reports each pod once when it is being deleted ([`tracker`]), so the daemon can drop the pod's
//! pull references at once instead of waiting for a kubelet that never cancels a `PullImage`.
//! Whether it is connected and synced is in [`WatchStatus`] ([`status`]). While it is, a pod's
//! PullImage may wait past its detach window ([`hold`]), and its download's progress shows in
//! its events ([`events`]).
//!
//! It uses the kubelet's own credentials ([`discovery`]): a kubeconfig given, or the first of a
//! search list that exists (looked for again every [`DISCOVERY_INTERVAL`] until one does: a
//! node's kubelet may bootstrap its credentials after minicri started). The node is the one
//! given, or the one the client certificate names, or the hostname.
//!
//! **Credentials change.** The kubelet rotates its client certificate by moving a symlink to a
//! new file. Every [`RELOAD_CHECK`] the watch re-reads the kubeconfig and the files it names;
//! when they changed, and after any failed request, it builds a new client from them and
//! resumes the watch from the last resourceVersion it saw. Nothing is missed: the server replays
//! what happened since, or answers 410 Gone and the watch lists again, and a pod missing from
//! that list is reported gone.
//!
//! **The protocol.** A list (no resourceVersion: a consistent read, so a stale cache cannot
//! make a pod look gone), then watches from the list's resourceVersion with bookmarks and
//! `timeoutSeconds`, each resumed from the last version seen when it ends; 410 Gone (as an
//! ERROR event or a status) relists. A watch silent for longer than its timeout and a margin is
//! taken for a dead connection.
//!
//! Nothing here is fatal once the node name is given: an unreadable kubeconfig, an unreachable
//! API server, failed lists and watches are logged and retried with an exponential backoff
//! (0.5 s doubling up to 30 s, with jitter) until the shutdown token is cancelled.

pub mod discovery;
pub mod events;
pub mod hold;
pub mod status;
pub mod tracker;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, anyhow, bail};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use kube::config::KubeConfigOptions;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

pub use status::WatchStatus;
use tracker::Tracker;
pub use tracker::{PodCache, PodInfo};

/// The first retry delay after an error.
const BACKOFF_MIN: Duration = Duration::from_millis(500);
/// The longest retry delay.
const BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A failure this long after the previous one starts the backoff over.
const BACKOFF_RESET_AFTER: Duration = Duration::from_secs(60);
/// `timeoutSeconds` of each watch call: the server ends the watch after this long and a new one
/// starts from the last resourceVersion.
const WATCH_TIMEOUT_SECS: u32 = 120;
/// A watch that sends nothing (not even its end) for this long is a dead connection.
const WATCH_SILENCE: Duration = Duration::from_secs(WATCH_TIMEOUT_SECS as u64 + 15);
/// Pods asked for per list page.
const LIST_PAGE: u32 = 500;
/// How often the search list is looked at while no kubeconfig is found.
pub const DISCOVERY_INTERVAL: Duration = Duration::from_secs(10);
/// How often the kubeconfig and the files it names are read again for changes.
pub const RELOAD_CHECK: Duration = Duration::from_secs(5);

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

/// What the watch shares with the rest of the daemon.
pub struct WatchState {
    pub status: WatchStatus,
    pub pods: Arc<PodCache>,
    pub events: events::EventCounters,
    /// The client of the current credentials and the node it watches.
    connection: std::sync::RwLock<Option<(kube::Client, String)>>,
}

impl std::fmt::Debug for WatchState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WatchState")
            .field("status", &self.status)
            .field("pods", &self.pods.len())
            .finish()
    }
}

impl WatchState {
    /// `on`: the watch runs (`daemon.kube_watch` is not off).
    pub fn new(on: bool) -> WatchState {
        WatchState {
            status: WatchStatus::new(on),
            pods: Arc::new(PodCache::default()),
            events: events::EventCounters::default(),
            connection: std::sync::RwLock::new(None),
        }
    }

    /// The client of the current credentials and the node it watches, once connected.
    pub fn connection(&self) -> Option<(kube::Client, String)> {
        self.connection
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn set_connection(&self, c: Option<(kube::Client, String)>) {
        *self.connection.write().unwrap_or_else(|p| p.into_inner()) = c;
    }

    /// Connected and synced: a deletion of any pod of the node would be seen at once.
    pub fn synced(&self) -> bool {
        self.status.synced()
    }

    /// What verbose Status shows.
    pub fn to_json(&self) -> serde_json::Value {
        self.status.to_json(self.pods.len())
    }
}

/// Runs until `shutdown` is cancelled: finds the kubeconfig, watches the pods bound to the node
/// into `state` and calls `on_deleted` once per pod uid (see the module docs). Fails only on an
/// empty node name; everything else is retried.
pub async fn run(
    cfg: WatchConfig,
    state: Arc<WatchState>,
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
    let status = &state.status;
    let Some(kubeconfig) = find_kubeconfig(&cfg, status, &shutdown).await else {
        status.stopped();
        return Ok(());
    };
    let mut tracker: Option<Tracker> = None;
    let mut backoff = Backoff::default();
    // Where the next watch resumes; `None`: list first.
    let mut version: Option<String> = None;
    loop {
        let attempt = tokio::select! {
            _ = shutdown.cancelled() => break,
            c = connect(&kubeconfig, cfg.node_name.as_deref()) => c,
        };
        let creds = match attempt {
            Ok(c) => c,
            Err(e) => {
                let error = format!("{e:#}");
                status.failed(&error);
                let delay = backoff.next_delay();
                warn!(kubeconfig = %kubeconfig.display(), %error, retry_in = ?delay, "pod watcher: cannot set up the API server client");
                if sleep_or_shutdown(delay, &shutdown).await {
                    break;
                }
                continue;
            }
        };
        let tracker = match &mut tracker {
            Some(t) if t.node() == creds.node => t,
            Some(t) => {
                warn!(from = %t.node(), to = %creds.node, "pod watcher: the credentials name another node; following its pods");
                t.reset(creds.node.clone());
                version = None;
                t
            }
            None => {
                info!(node = %creds.node, kubeconfig = %kubeconfig.display(), "pod watcher: starting");
                tracker.insert(Tracker::new(
                    creds.node.clone(),
                    state.pods.clone(),
                    on_deleted.clone(),
                ))
            }
        };
        status.credentials(&kubeconfig, &creds.node);
        state.set_connection(Some((creds.client.clone(), creds.node.clone())));
        let ended = tokio::select! {
            _ = shutdown.cancelled() => break,
            e = session(&creds, tracker, &mut version, status, &mut backoff) => e,
        };
        match ended {
            Ended::CredentialsChanged => {
                state
                    .status
                    .credential_reloads
                    .fetch_add(1, Ordering::Relaxed);
                info!(kubeconfig = %kubeconfig.display(), "pod watcher: the credentials changed; reconnecting with them");
            }
            Ended::Failed(e) => {
                let error = format!("{e:#}");
                status.down(&error);
                let delay = backoff.next_delay();
                warn!(%error, retry_in = ?delay, "pod watcher: list/watch failed");
                if sleep_or_shutdown(delay, &shutdown).await {
                    break;
                }
            }
        }
    }
    state.set_connection(None);
    status.stopped();
    info!("pod watcher: stopped");
    Ok(())
}

/// A client and the node it watches, built from credentials read at one moment.
struct Connection {
    client: kube::Client,
    node: String,
    /// The files the credentials came from, and the fingerprint of what was read.
    files: Vec<PathBuf>,
    fingerprint: u64,
}

impl Connection {
    /// Whether the credentials on disk differ from the ones this connection was built with.
    async fn changed(&self) -> bool {
        let files = self.files.clone();
        let now = tokio::task::spawn_blocking(move || discovery::fingerprint(&files))
            .await
            .ok()
            .flatten();
        now != Some(self.fingerprint)
    }
}

/// Why a session ended.
enum Ended {
    CredentialsChanged,
    Failed(anyhow::Error),
}

/// Lists (when there is no version to resume from) and watches with one connection until a
/// request fails or the credentials change. `version` is kept across sessions.
async fn session(
    conn: &Connection,
    tracker: &mut Tracker,
    version: &mut Option<String>,
    status: &WatchStatus,
    backoff: &mut Backoff,
) -> Ended {
    let api: Api<Pod> = Api::all(conn.client.clone());
    let selector = format!("spec.nodeName={}", conn.node);
    let mut reload =
        tokio::time::interval_at(tokio::time::Instant::now() + RELOAD_CHECK, RELOAD_CHECK);
    reload.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_gone: Option<Instant> = None;
    loop {
        let from = match version.clone() {
            Some(v) => v,
            None => match list(&api, &selector).await {
                Ok((pods, v)) => {
                    tracker.relist(&pods);
                    status.up(true);
                    backoff.reset();
                    *version = Some(v.clone());
                    v
                }
                Err(e) => return Ended::Failed(e),
            },
        };
        let params = WatchParams::default()
            .fields(&selector)
            .timeout(WATCH_TIMEOUT_SECS);
        let stream = match api.watch(&params, &from).await {
            Ok(s) => s,
            Err(kube::Error::Api(s)) if s.code == 410 => {
                if gone_again(&mut last_gone) {
                    return Ended::Failed(anyhow!("410 Gone right after a relist: {}", s.message));
                }
                info!(message = %s.message, "pod watcher: watch history expired (410 Gone), relisting");
                *version = None;
                continue;
            }
            Err(e) => return Ended::Failed(anyhow::Error::new(e).context("watching pods")),
        };
        // The tracker holds every pod as of `from`, and the watch replays what came after.
        status.up(tracker.listed_once());
        backoff.reset();
        futures::pin_mut!(stream);
        loop {
            let next = tokio::select! {
                _ = reload.tick() => {
                    if conn.changed().await {
                        return Ended::CredentialsChanged;
                    }
                    continue;
                }
                n = tokio::time::timeout(WATCH_SILENCE, stream.next()) => n,
            };
            let event = match next {
                Err(_) => {
                    return Ended::Failed(anyhow!(
                        "the watch sent nothing for {WATCH_SILENCE:?}: taken for a dead connection"
                    ));
                }
                // The server ended the watch (its timeout): resume from where it was.
                Ok(None) => break,
                Ok(Some(Err(e))) => {
                    return Ended::Failed(anyhow::Error::new(e).context("reading the pod watch"));
                }
                Ok(Some(Ok(event))) => event,
            };
            match event {
                WatchEvent::Added(pod) | WatchEvent::Modified(pod) => {
                    tracker.apply(&pod);
                    advance(version, &pod);
                }
                WatchEvent::Deleted(pod) => {
                    tracker.delete(&pod);
                    advance(version, &pod);
                }
                WatchEvent::Bookmark(b) => *version = Some(b.metadata.resource_version),
                WatchEvent::Error(s) if s.code == 410 => {
                    if gone_again(&mut last_gone) {
                        return Ended::Failed(anyhow!(
                            "410 Gone right after a relist: {}",
                            s.message
                        ));
                    }
                    info!(message = %s.message, "pod watcher: watch history expired (410 Gone), relisting");
                    status.up(false);
                    *version = None;
                    break;
                }
                WatchEvent::Error(s) => {
                    return Ended::Failed(anyhow!(
                        "the pod watch failed: {} ({})",
                        s.message,
                        s.code
                    ));
                }
            }
        }
    }
}

/// Whether a 410 comes right after the previous one (then it is an error, and backs off).
fn gone_again(last: &mut Option<Instant>) -> bool {
    let again = last.is_some_and(|t| t.elapsed() < BACKOFF_MIN * 2);
    *last = Some(Instant::now());
    again
}

/// The watch resumes after `pod`'s resourceVersion.
fn advance(version: &mut Option<String>, pod: &Pod) {
    if let Some(v) = &pod.metadata.resource_version {
        *version = Some(v.clone());
    }
}

/// Every pod of the node, and the resourceVersion of the list.
async fn list(api: &Api<Pod>, selector: &str) -> Result<(Vec<Pod>, String)> {
    let mut pods = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let mut params = ListParams::default().fields(selector).limit(LIST_PAGE);
        if let Some(t) = &token {
            params = params.continue_token(t);
        }
        let page = api.list(&params).await.context("listing pods")?;
        pods.extend(page.items);
        token = page.metadata.continue_.filter(|t| !t.is_empty());
        if token.is_none() {
            let version = page
                .metadata
                .resource_version
                .filter(|v| !v.is_empty())
                .ok_or_else(|| anyhow!("the pod list has no resourceVersion"))?;
            if pods.len() > tracker::MAX_PODS * 2 {
                warn!(
                    pods = pods.len(),
                    "pod watcher: the API server lists far more pods than a node runs"
                );
            }
            return Ok((pods, version));
        }
    }
}

/// The kubeconfig given, or the first of the search list that exists, looked for until one does
/// (`None`: shutdown first).
async fn find_kubeconfig(
    cfg: &WatchConfig,
    status: &WatchStatus,
    shutdown: &CancellationToken,
) -> Option<PathBuf> {
    if let Some(k) = &cfg.kubeconfig {
        return Some(k.clone());
    }
    status.searching();
    let mut said = false;
    loop {
        let search = cfg.search.clone();
        let found = minicri_store::fsutil::off_async(|| discovery::find_kubeconfig(&search));
        if let Some(path) = found {
            info!(kubeconfig = %path.display(), "pod watcher: found the kubelet's kubeconfig");
            return Some(path);
        }
        if !said {
            info!(
                searched = ?cfg.search,
                "no kubeconfig found: running without the API-server watch (pulls detach after \
                 pull.detach_after); looking again every 10s"
            );
            said = true;
        }
        if sleep_or_shutdown(DISCOVERY_INTERVAL, shutdown).await {
            return None;
        }
    }
}

/// A client for the kubeconfig's current context, and the node it watches: `node` if given,
/// else the client certificate's, else the hostname.
async fn connect(kubeconfig: &Path, node: Option<&str>) -> Result<Connection> {
    let path = kubeconfig.to_path_buf();
    let loaded = tokio::task::spawn_blocking(move || discovery::load(&path))
        .await
        .context("the kubeconfig reader panicked")?
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
    Ok(Connection {
        client,
        node,
        files: loaded.files,
        fingerprint: loaded.fingerprint,
    })
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

#[cfg(test)]
mod tests {
    use super::*;

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

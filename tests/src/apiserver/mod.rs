//! Owns [`ApiServer`]: a minimal Kubernetes API server for tests, serving pods (and recording
//! events), just enough for a list+watch client (kube-rs's `kube::runtime::watcher`, client-go's reflector) to work
//! against it as against the real one, and switches to disturb it (outages, compaction, dropped
//! watches).
//!
//! It speaks plain HTTP/1.1 on 127.0.0.1 (a free port) and answers:
//! - `GET /api/v1/pods` and `GET /api/v1/namespaces/{ns}/pods`: a `PodList` of the current pods
//!   at the current resourceVersion. `fieldSelector` supports `spec.nodeName`,
//!   `metadata.name` and `metadata.namespace` with `=`, `==` and `!=` (anything else is a 400,
//!   as the real server answers for unsupported field labels); a non-empty `labelSelector` is
//!   refused (pods here have no labels); `limit` is ignored, consistently: the whole list comes
//!   back with no `continue` token (a `continue` parameter is refused). `resourceVersion` /
//!   `resourceVersionMatch`: unset, `0` and `NotOlderThan` serve the current state;
//!   `NotOlderThan` or unset with a version newer than the current one is a 504 "Too large
//!   resource version"; `Exact` serves only the current version (an older one is a 410
//!   `Expired`, since no past states are kept).
//! - the same with `watch=true|1`: a chunked stream of one JSON event per line,
//!   `{"type":"ADDED"|"MODIFIED"|"DELETED"|"BOOKMARK"|"ERROR","object":...}`. A watch from
//!   `resourceVersion` N replays the recorded events after N, then follows live events; one from
//!   unset or `0` first sends the current pods as `ADDED`. A version older than the compacted
//!   history gets an `ERROR` event with a `Status` 410 `Expired` ("too old resource version")
//!   and the stream ends, as the real watch cache answers. `allowWatchBookmarks=true` adds a
//!   `BOOKMARK` with the watcher's current resourceVersion every bookmark interval;
//!   `sendInitialEvents=true` (streaming lists, which needs `resourceVersionMatch=NotOlderThan`
//!   and bookmarks, as on the real server) sends the current pods as `ADDED`, then a `BOOKMARK`
//!   annotated `k8s.io/initial-events-end: "true"`. `timeoutSeconds` ends the stream (cleanly)
//!   after that long. Field selectors filter watch events too.
//! - `GET /api/v1/namespaces/{ns}/pods/{name}`: one pod, or a 404 `Status`.
//! - core/v1 Events: create, merge-patch, get and list ([`events`], every write recorded:
//!   [`ApiServer::event_writes`]).
//! - With [`ApiServerOptions::tls`]: HTTPS, client certificates required (`tls`), each request's
//!   recorded, revocable ([`ApiServer::revoke`]).
//!
//! The resourceVersion is one global counter (a string of an integer) bumped by every change.
//! The state (pods, event history, counter) outlives [`ApiServer::stop`]: a
//! [`ApiServer::restart`] listens again on the same port with the same state, as an API server
//! that was unreachable for a while. [`ApiServer::compact`] compacts the event history, so a
//! watch resuming from an older version gets the 410.
//!
//! Tests drive it through Rust methods (no HTTP): [`ApiServer::add_pod`],
//! [`ApiServer::mark_deleted`], [`ApiServer::remove_pod`], and read back every request
//! ([`ApiServer::requests`], [`ApiServer::list_calls`], [`ApiServer::watch_calls`]).
//!
//! The server runs on its own tokio runtime (one worker thread), so it keeps serving whatever
//! the test's thread does; the control methods are plain blocking calls, usable from sync and
//! async tests alike. Dropping the [`ApiServer`] stops it.

mod events;
mod tls;

pub use events::EventWrite;
pub use tls::{fingerprint_der, fingerprint_pem};

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::time::Duration;

use anyhow::{Context, Result};
use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::sync::mpsc as tmpsc;
use tokio_util::sync::CancellationToken;

type Body = UnsyncBoxBody<Bytes, Infallible>;

/// The first resourceVersion handed out (real clusters are well past 0, and "0" means "any").
const FIRST_RESOURCE_VERSION: u64 = 1000;
/// A watch without `timeoutSeconds` ends after this long.
const DEFAULT_WATCH_TIMEOUT: Duration = Duration::from_secs(1800);
/// How long [`ApiServer::stop`] waits for the serving task to close everything.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// How to start an [`ApiServer`].
#[derive(Debug, Clone)]
pub struct ApiServerOptions {
    /// How often a watch with `allowWatchBookmarks=true` gets a `BOOKMARK`.
    pub bookmark_interval: Duration,
    /// Misbehave: answer every list and watch as if it had no field selector (still refusing
    /// unsupported ones), as a broken server or proxy might, so that a client's own checks on
    /// the objects it gets can be tested.
    pub ignore_field_selectors: bool,
    /// Serve HTTPS with this PKI's server certificate, and require client certificates signed
    /// by its CA (as a real API server authenticates a kubelet).
    pub tls: Option<crate::pki::TestPki>,
}

impl Default for ApiServerOptions {
    fn default() -> Self {
        ApiServerOptions {
            bookmark_interval: Duration::from_secs(1),
            ignore_field_selectors: false,
            tls: None,
        }
    }
}

/// The credentials a kubeconfig written by [`ApiServer::write_kubeconfig_at`] carries.
#[derive(Debug, Clone)]
pub enum KubeUser {
    /// A dummy bearer token.
    Token,
    /// A client certificate and key (files; they may be one file, as the kubelet's are).
    ClientCert { cert: PathBuf, key: PathBuf },
}

/// One request the server answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    pub method: String,
    pub path: String,
    /// The raw query string ("" if none).
    pub query: String,
    /// `watch=true|1` was asked for.
    pub watch: bool,
    /// The HTTP status answered (a watch that later sends an `ERROR` event is still 200).
    pub status: u16,
    /// With TLS: the fingerprint of the client certificate of the connection
    /// ([`fingerprint_der`]).
    pub client_cert: Option<String>,
}

/// A pod as the server keeps it.
#[derive(Debug, Clone)]
struct Pod {
    namespace: String,
    name: String,
    uid: String,
    node: String,
    resource_version: u64,
    creation: String,
    deletion: Option<String>,
    /// One container per image (`c0`, `c1`, …).
    images: Vec<String>,
}

impl Pod {
    fn to_json(&self) -> Value {
        let mut metadata = json!({
            "name": self.name,
            "namespace": self.namespace,
            "uid": self.uid,
            "resourceVersion": self.resource_version.to_string(),
            "creationTimestamp": self.creation,
        });
        if let Some(ts) = &self.deletion {
            metadata["deletionTimestamp"] = json!(ts);
            metadata["deletionGracePeriodSeconds"] = json!(30);
        }
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": metadata,
            "spec": {
                "nodeName": self.node,
                "containers": self.images.iter().enumerate()
                    .map(|(i, image)| json!({ "name": format!("c{i}"), "image": image }))
                    .collect::<Vec<_>>(),
            },
            "status": { "phase": "Running" },
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One recorded change: the pod as it was right after it.
#[derive(Debug, Clone)]
struct Event {
    rv: u64,
    kind: EventType,
    pod: Pod,
}

#[derive(Debug)]
struct State {
    rv: u64,
    /// Pods by uid.
    pods: BTreeMap<String, Pod>,
    /// Every change, oldest first (ascending `rv`). Watches may start only after `compacted`.
    history: Vec<Event>,
    /// A watch from a version below this one gets a 410.
    compacted: u64,
}

impl State {
    fn bump(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    fn record(&mut self, kind: EventType, pod: Pod) {
        self.history.push(Event {
            rv: pod.resource_version,
            kind,
            pod,
        });
    }

    /// The current pods that `sel` selects, by namespace and name.
    fn selected(&self, sel: &Selection) -> Vec<&Pod> {
        let mut pods: Vec<&Pod> = self.pods.values().filter(|p| sel.matches(p)).collect();
        pods.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        pods
    }
}

/// The serving task of one listening period (between a start and a stop).
struct Epoch {
    cancel: CancellationToken,
    done: mpsc::Receiver<()>,
}

struct Shared {
    opts: ApiServerOptions,
    state: Mutex<State>,
    /// The current resourceVersion, for watches to wait on.
    rv_tx: tokio::sync::watch::Sender<u64>,
    /// Cancelled (and replaced) by [`ApiServer::close_watches`].
    watch_close: Mutex<CancellationToken>,
    requests: Mutex<Vec<RequestRecord>>,
    open_watches: Mutex<usize>,
    /// Client certificate fingerprints refused with 401.
    revoked: Mutex<BTreeSet<String>>,
    /// Events, and the resourceVersions given to them (their own counter: pods' history and
    /// watches are not disturbed by event writes).
    events: Mutex<(events::Events, u64)>,
    tls: Option<tokio_rustls::TlsAcceptor>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    fn notify(&self, rv: u64) {
        self.rv_tx.send_replace(rv);
    }
}

/// A running test API server; see the module docs.
pub struct ApiServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    runtime: Option<tokio::runtime::Runtime>,
    epoch: Mutex<Option<Epoch>>,
}

impl std::fmt::Debug for ApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiServer")
            .field("addr", &self.addr)
            .field("running", &self.is_running())
            .finish()
    }
}

impl ApiServer {
    /// Starts a server with bookmarks every second.
    pub fn start() -> io::Result<ApiServer> {
        ApiServer::start_with(ApiServerOptions::default())
    }

    /// Starts a server with these options.
    pub fn start_with(opts: ApiServerOptions) -> io::Result<ApiServer> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name(format!("apiserver-{}", addr.port()))
            .enable_all()
            .build()?;
        let (rv_tx, _) = tokio::sync::watch::channel(FIRST_RESOURCE_VERSION);
        let tls = match &opts.tls {
            Some(pki) => Some(tls::acceptor(pki).map_err(io::Error::other)?),
            None => None,
        };
        let shared = Arc::new(Shared {
            tls,
            revoked: Mutex::new(BTreeSet::new()),
            events: Mutex::new((events::Events::default(), 1_000_000)),
            opts,
            state: Mutex::new(State {
                rv: FIRST_RESOURCE_VERSION,
                pods: BTreeMap::new(),
                history: Vec::new(),
                compacted: FIRST_RESOURCE_VERSION,
            }),
            rv_tx,
            watch_close: Mutex::new(CancellationToken::new()),
            requests: Mutex::new(Vec::new()),
            open_watches: Mutex::new(0),
        });
        let server = ApiServer {
            addr,
            shared,
            runtime: Some(runtime),
            epoch: Mutex::new(None),
        };
        server.serve(listener)?;
        Ok(server)
    }

    fn serve(&self, listener: std::net::TcpListener) -> io::Result<()> {
        listener.set_nonblocking(true)?;
        let Some(runtime) = &self.runtime else {
            return Err(io::Error::other("the API server's runtime is gone"));
        };
        let cancel = CancellationToken::new();
        let (done_tx, done) = mpsc::channel();
        runtime.spawn(serve(
            listener,
            self.shared.clone(),
            cancel.clone(),
            done_tx,
        ));
        *lock(&self.epoch) = Some(Epoch { cancel, done });
        Ok(())
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`, or `https://` with TLS.
    pub fn url(&self) -> String {
        let scheme = if self.shared.tls.is_some() {
            "https"
        } else {
            "http"
        };
        format!("{scheme}://{}", self.addr)
    }

    /// From now on, requests made with this client certificate ([`fingerprint_der`]) get 401
    /// Unauthorized, as after a certificate's revocation or expiry.
    pub fn revoke(&self, fingerprint: &str) {
        lock(&self.shared.revoked).insert(fingerprint.to_string());
    }

    /// Whether it is listening (started, or restarted after a stop).
    pub fn is_running(&self) -> bool {
        lock(&self.epoch).is_some()
    }

    /// Writes `<dir>/kubeconfig`: one cluster (this server, plain HTTP), one user with a dummy
    /// bearer token (never checked), one context, made current. Returns its path.
    pub fn write_kubeconfig(&self, dir: &Path) -> Result<PathBuf> {
        let path = dir.join("kubeconfig");
        self.write_kubeconfig_at(&path, &KubeUser::Token)?;
        Ok(path)
    }

    /// Writes a kubeconfig at `path` for this server, with `user`'s credentials.
    pub fn write_kubeconfig_at(&self, path: &Path, user: &KubeUser) -> Result<()> {
        let user = match user {
            KubeUser::Token => "    token: minicri-test-token\n".to_string(),
            KubeUser::ClientCert { cert, key } => format!(
                "    client-certificate: {}\n    client-key: {}\n",
                cert.display(),
                key.display()
            ),
        };
        let ca = match &self.shared.opts.tls {
            Some(pki) => format!("    certificate-authority: {}\n", pki.ca.display()),
            None => String::new(),
        };
        let text = format!(
            "apiVersion: v1
kind: Config
clusters:
- name: minicri-test
  cluster:
    server: {url}
{ca}users:
- name: minicri-test
  user:
{user}contexts:
- name: minicri-test
  context:
    cluster: minicri-test
    user: minicri-test
    namespace: default
current-context: minicri-test
",
            url = self.url()
        );
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
    }

    /// Creates a pod bound to `node` (an `ADDED` event) with one container of image
    /// `registry.test/app:1`. Returns its resourceVersion.
    ///
    /// Panics if a pod with this uid exists: that is a mistake in the test.
    pub fn add_pod(&self, namespace: &str, name: &str, uid: &str, node: &str) -> u64 {
        self.add_pod_with_images(namespace, name, uid, node, &["registry.test/app:1".into()])
    }

    /// Creates a pod bound to `node` (an `ADDED` event) with a container per image (`c0`, `c1`,
    /// …). Returns its resourceVersion. Panics if a pod with this uid exists.
    pub fn add_pod_with_images(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
        node: &str,
        images: &[String],
    ) -> u64 {
        let rv = {
            let mut st = self.shared.state();
            assert!(!st.pods.contains_key(uid), "a pod with uid {uid} exists");
            let rv = st.bump();
            let pod = Pod {
                namespace: namespace.to_string(),
                name: name.to_string(),
                uid: uid.to_string(),
                node: node.to_string(),
                resource_version: rv,
                creation: now(),
                deletion: None,
                images: images.to_vec(),
            };
            st.pods.insert(uid.to_string(), pod.clone());
            st.record(EventType::Added, pod);
            rv
        };
        self.shared.notify(rv);
        rv
    }

    /// Sets the pod's `deletionTimestamp` (a `MODIFIED` event), as a graceful delete does.
    /// Returns false (and changes nothing) if there is no such pod or it was already marked.
    pub fn mark_deleted(&self, uid: &str) -> bool {
        let rv = {
            let mut st = self.shared.state();
            match st.pods.get(uid) {
                Some(pod) if pod.deletion.is_none() => {}
                _ => return false,
            }
            let rv = st.bump();
            let Some(pod) = st.pods.get_mut(uid) else {
                return false;
            };
            pod.deletion = Some(now());
            pod.resource_version = rv;
            let pod = pod.clone();
            st.record(EventType::Modified, pod);
            rv
        };
        self.shared.notify(rv);
        true
    }

    /// Removes the pod (a `DELETED` event carrying its last state at a new resourceVersion).
    /// Returns false if there is no such pod.
    pub fn remove_pod(&self, uid: &str) -> bool {
        let rv = {
            let mut st = self.shared.state();
            let Some(mut pod) = st.pods.remove(uid) else {
                return false;
            };
            let rv = st.bump();
            pod.resource_version = rv;
            st.record(EventType::Deleted, pod);
            rv
        };
        self.shared.notify(rv);
        true
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.state().rv
    }

    /// The uids of the current pods.
    pub fn pod_uids(&self) -> Vec<String> {
        self.shared.state().pods.keys().cloned().collect()
    }

    /// Compacts the event history: from now on a watch from any version older than the current
    /// one gets a 410 `Expired`. Open watches go on undisturbed (as on the real server, whose
    /// watch cache already holds what they have yet to send); the events stay in memory for
    /// them, which is fine at a test's scale.
    pub fn compact(&self) {
        let mut st = self.shared.state();
        st.compacted = st.rv;
    }

    /// Ends every open watch stream (cleanly, as a server-side timeout does) without stopping
    /// the server.
    pub fn close_watches(&self) {
        let old = std::mem::take(&mut *lock(&self.shared.watch_close));
        old.cancel();
    }

    /// Stops listening and drops every connection, open watches included (clients see their
    /// streams cut and connections refused), keeping the state. Waits until all are closed.
    /// Does nothing if stopped already.
    pub fn stop(&self) {
        let Some(epoch) = lock(&self.epoch).take() else {
            return;
        };
        epoch.cancel.cancel();
        let _ = epoch.done.recv_timeout(STOP_TIMEOUT);
        // The watch streams' tasks end at the cancellation too, a moment later.
        let deadline = std::time::Instant::now() + STOP_TIMEOUT;
        while self.open_watches() > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Listens again on the same port, with the same pods, history and resourceVersion.
    /// Does nothing if running.
    pub fn restart(&self) -> io::Result<()> {
        if self.is_running() {
            return Ok(());
        }
        let listener = std::net::TcpListener::bind(self.addr)?;
        self.serve(listener)
    }

    /// Every request answered so far, in order.
    pub fn requests(&self) -> Vec<RequestRecord> {
        lock(&self.shared.requests).clone()
    }

    /// How many pod list requests (collection GETs without `watch`) were answered.
    pub fn list_calls(&self) -> usize {
        lock(&self.shared.requests)
            .iter()
            .filter(|r| !r.watch && r.path.ends_with("/pods"))
            .count()
    }

    /// How many watch requests were answered.
    pub fn watch_calls(&self) -> usize {
        lock(&self.shared.requests)
            .iter()
            .filter(|r| r.watch)
            .count()
    }

    /// The events written so far (core/v1 `Event` objects as stored).
    pub fn events(&self) -> Vec<Value> {
        lock(&self.shared.events).0.all()
    }

    /// Every event write (create or patch) answered, in order, refused ones included.
    pub fn event_writes(&self) -> Vec<EventWrite> {
        lock(&self.shared.events).0.writes.clone()
    }

    /// How many watch streams are open now.
    pub fn open_watches(&self) -> usize {
        *lock(&self.shared.open_watches)
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        if let Some(epoch) = lock(&self.epoch).take() {
            epoch.cancel.cancel();
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
}

/// Accepts connections until `cancel`, then drops the listener and every connection and says
/// so on `done`.
async fn serve(
    listener: std::net::TcpListener,
    shared: Arc<Shared>,
    cancel: CancellationToken,
    done: mpsc::Sender<()>,
) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("apiserver: cannot listen: {e}");
            let _ = done.send(());
            return;
        }
    };
    let mut connections = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => break,
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                let shared = shared.clone();
                let cancel = cancel.clone();
                connections.spawn(async move {
                    let Some(tls) = shared.tls.clone() else {
                        serve_connection(stream, shared, cancel, None).await;
                        return;
                    };
                    let Ok(stream) = tls.accept(stream).await else { return };
                    let cert = stream
                        .get_ref()
                        .1
                        .peer_certificates()
                        .and_then(|c| c.first())
                        .map(|c| tls::fingerprint_der(c));
                    serve_connection(stream, shared, cancel, cert).await;
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    connections.abort_all();
    while connections.join_next().await.is_some() {}
    let _ = done.send(());
}

/// Serves HTTP/1.1 on one connection; `client_cert`: its client certificate's fingerprint.
async fn serve_connection<S>(
    stream: S,
    shared: Arc<Shared>,
    cancel: CancellationToken,
    client_cert: Option<String>,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req| {
        let shared = shared.clone();
        let cancel = cancel.clone();
        let cert = client_cert.clone();
        async move { Ok::<_, Infallible>(handle(&shared, &cancel, req, cert).await) }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(stream), service)
        .await;
}

/// A request's query parameters; the last of repeated ones counts.
struct Params(Vec<(String, String)>);

impl Params {
    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The query parameters, percent-decoded, in order.
fn parse_query(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A field selector's requirement on one field.
#[derive(Debug, Clone)]
struct Requirement {
    field: Field,
    value: String,
    equal: bool,
}

#[derive(Debug, Clone, Copy)]
enum Field {
    NodeName,
    Name,
    Namespace,
}

/// Which pods a request is about: its namespace (from the path) and field selector.
#[derive(Debug, Clone, Default)]
struct Selection {
    namespace: Option<String>,
    fields: Vec<Requirement>,
}

impl Selection {
    fn matches(&self, pod: &Pod) -> bool {
        if let Some(ns) = &self.namespace
            && &pod.namespace != ns
        {
            return false;
        }
        self.fields.iter().all(|r| {
            let actual = match r.field {
                Field::NodeName => &pod.node,
                Field::Name => &pod.name,
                Field::Namespace => &pod.namespace,
            };
            (actual == &r.value) == r.equal
        })
    }
}

/// Parses a field selector (`a=b,c!=d`; `==` is `=`). The error is the 400's message.
fn parse_field_selector(selector: &str) -> Result<Vec<Requirement>, String> {
    let mut reqs = Vec::new();
    for term in selector.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        let (key, value, equal) = if let Some((k, v)) = term.split_once("!=") {
            (k, v, false)
        } else if let Some((k, v)) = term.split_once("==") {
            (k, v, true)
        } else if let Some((k, v)) = term.split_once('=') {
            (k, v, true)
        } else {
            return Err(format!(
                "invalid selector: '{selector}'; can't understand '{term}'"
            ));
        };
        let field = match key.trim() {
            "spec.nodeName" => Field::NodeName,
            "metadata.name" => Field::Name,
            "metadata.namespace" => Field::Namespace,
            other => return Err(format!("field label not supported: {other}")),
        };
        reqs.push(Requirement {
            field,
            value: value.trim().to_string(),
            equal,
        });
    }
    Ok(reqs)
}

fn status_json(code: u16, reason: &str, message: &str) -> Value {
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    })
}

fn json_response(status: StatusCode, body: &Value) -> Response<Body> {
    let mut resp = Response::new(Full::new(Bytes::from(body.to_string())).boxed_unsync());
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

fn error_response(status: StatusCode, reason: &str, message: &str) -> Response<Body> {
    json_response(status, &status_json(status.as_u16(), reason, message))
}

fn bad_request(message: &str) -> Response<Body> {
    error_response(StatusCode::BAD_REQUEST, "BadRequest", message)
}

/// What a request's path names.
enum Target {
    /// The pods of one namespace (`Some`) or all.
    Collection(Option<String>),
    /// One pod.
    Pod(String, String),
}

fn parse_path(path: &str) -> Option<Target> {
    let rest = path.strip_prefix("/api/v1/")?;
    let parts: Vec<&str> = rest.trim_end_matches('/').split('/').collect();
    match parts.as_slice() {
        ["pods"] => Some(Target::Collection(None)),
        ["namespaces", ns, "pods"] if !ns.is_empty() => {
            Some(Target::Collection(Some(ns.to_string())))
        }
        ["namespaces", ns, "pods", name] if !ns.is_empty() && !name.is_empty() => {
            Some(Target::Pod(ns.to_string(), name.to_string()))
        }
        _ => None,
    }
}

async fn handle(
    shared: &Arc<Shared>,
    cancel: &CancellationToken,
    req: Request<Incoming>,
    client_cert: Option<String>,
) -> Response<Body> {
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let params = Params(parse_query(&query));
    let watch = matches!(params.get("watch"), Some("true" | "1"));
    let revoked = client_cert
        .as_ref()
        .is_some_and(|c| lock(&shared.revoked).contains(c));
    let method = req.method().clone();
    let resp = if revoked {
        error_response(StatusCode::UNAUTHORIZED, "Unauthorized", "Unauthorized")
    } else if let Some(target) = parse_events_path(&path) {
        let content_type = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        match http_body_util::Limited::new(req.into_body(), events::MAX_BODY)
            .collect()
            .await
        {
            Ok(body) => events_route(shared, &method, target, &content_type, &body.to_bytes()),
            Err(_) => error_response(
                StatusCode::PAYLOAD_TOO_LARGE,
                "RequestEntityTooLarge",
                "the request body is too large",
            ),
        }
    } else {
        route(shared, cancel, &method, &path, &params, watch)
    };
    lock(&shared.requests).push(RequestRecord {
        method: method.to_string(),
        path,
        query,
        watch,
        status: resp.status().as_u16(),
        client_cert,
    });
    resp
}

/// What an events path names.
enum EventsTarget {
    /// The events of one namespace (`Some`) or all.
    Collection(Option<String>),
    One(String, String),
}

fn parse_events_path(path: &str) -> Option<EventsTarget> {
    let rest = path.strip_prefix("/api/v1/")?;
    let parts: Vec<&str> = rest.trim_end_matches('/').split('/').collect();
    match parts.as_slice() {
        ["events"] => Some(EventsTarget::Collection(None)),
        ["namespaces", ns, "events"] if !ns.is_empty() => {
            Some(EventsTarget::Collection(Some(ns.to_string())))
        }
        ["namespaces", ns, "events", name] if !ns.is_empty() && !name.is_empty() => {
            Some(EventsTarget::One(ns.to_string(), name.to_string()))
        }
        _ => None,
    }
}

fn events_route(
    shared: &Shared,
    method: &Method,
    target: EventsTarget,
    content_type: &str,
    body: &[u8],
) -> Response<Body> {
    let mut guard = lock(&shared.events);
    let (events, rv) = &mut *guard;
    *rv += 1;
    let (status, value) = match (method, target) {
        (&Method::GET, EventsTarget::Collection(ns)) => {
            (StatusCode::OK, events.list(ns.as_deref(), *rv))
        }
        (&Method::GET, EventsTarget::One(ns, name)) => events.get(&ns, &name),
        (&Method::POST, EventsTarget::Collection(Some(ns))) => events.create(&ns, body, *rv),
        (&Method::PATCH, EventsTarget::One(ns, name)) => {
            events.patch(&ns, &name, content_type, body, *rv)
        }
        (m, _) => {
            return error_response(
                StatusCode::METHOD_NOT_ALLOWED,
                "MethodNotAllowed",
                &format!("this test server does not allow {m} on the requested events"),
            );
        }
    };
    json_response(status, &value)
}

fn route(
    shared: &Arc<Shared>,
    cancel: &CancellationToken,
    method: &Method,
    path: &str,
    params: &Params,
    watch: bool,
) -> Response<Body> {
    let Some(target) = parse_path(path) else {
        return error_response(
            StatusCode::NOT_FOUND,
            "NotFound",
            "the server could not find the requested resource",
        );
    };
    if method != Method::GET {
        return error_response(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            &format!("the server does not allow this method on the requested resource: {method}"),
        );
    }
    let namespace = match target {
        Target::Pod(ns, name) => return get_pod(shared, &ns, &name),
        Target::Collection(ns) => ns,
    };
    let fields = match parse_field_selector(params.get("fieldSelector").unwrap_or("")) {
        Ok(f) => f,
        Err(message) => return bad_request(&message),
    };
    if !params.get("labelSelector").unwrap_or("").trim().is_empty() {
        return bad_request("label selectors are not supported by this test server");
    }
    let fields = if shared.opts.ignore_field_selectors {
        Vec::new()
    } else {
        fields
    };
    let sel = Selection { namespace, fields };
    let rv = params.get("resourceVersion").filter(|v| !v.is_empty());
    let rv = match rv.map(str::parse::<u64>) {
        None => None,
        Some(Ok(n)) => Some(n),
        Some(Err(_)) => {
            return bad_request(&format!(
                "invalid resource version: {}",
                rv.unwrap_or_default()
            ));
        }
    };
    let rv_match = params.get("resourceVersionMatch").filter(|v| !v.is_empty());
    if let Some(m) = rv_match {
        if m != "NotOlderThan" && m != "Exact" {
            return bad_request(&format!(
                "resourceVersionMatch: Unsupported value: \"{m}\": supported values: \"Exact\", \"NotOlderThan\""
            ));
        }
        if rv.is_none() && !(watch && m == "NotOlderThan") {
            return bad_request(
                "resourceVersionMatch: Forbidden: resourceVersionMatch is forbidden unless resourceVersion is provided",
            );
        }
    }
    if watch {
        start_watch(shared, cancel, sel, rv, rv_match, params)
    } else {
        list(shared, &sel, rv, rv_match, params)
    }
}

fn get_pod(shared: &Shared, ns: &str, name: &str) -> Response<Body> {
    let st = shared.state();
    match st
        .pods
        .values()
        .find(|p| p.namespace == ns && p.name == name)
    {
        Some(pod) => json_response(StatusCode::OK, &pod.to_json()),
        None => error_response(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("pods \"{name}\" not found"),
        ),
    }
}

fn list(
    shared: &Shared,
    sel: &Selection,
    rv: Option<u64>,
    rv_match: Option<&str>,
    params: &Params,
) -> Response<Body> {
    if params.get("continue").is_some_and(|c| !c.is_empty()) {
        return error_response(
            StatusCode::GONE,
            "Expired",
            "The provided continue parameter is too old to display a consistent list result. \
             This test server never hands out continue tokens.",
        );
    }
    let st = shared.state();
    match (rv, rv_match) {
        (Some(n), Some("Exact")) if n != st.rv => {
            return error_response(
                StatusCode::GONE,
                "Expired",
                &format!("too old resource version: {n} ({})", st.rv),
            );
        }
        (Some(n), _) if n > st.rv => {
            return error_response(
                StatusCode::GATEWAY_TIMEOUT,
                "Timeout",
                &format!("Too large resource version: {n}, current: {}", st.rv),
            );
        }
        _ => {}
    }
    let items: Vec<Value> = st.selected(sel).iter().map(|p| p.to_json()).collect();
    let body = json!({
        "apiVersion": "v1",
        "kind": "PodList",
        "metadata": { "resourceVersion": st.rv.to_string() },
        "items": items,
    });
    json_response(StatusCode::OK, &body)
}

/// A watch's parameters, checked.
struct WatchSpec {
    sel: Selection,
    /// Replay from this version; `None`: start with the current pods as ADDED.
    from: Option<u64>,
    bookmarks: bool,
    initial_events: bool,
    timeout: Duration,
}

fn start_watch(
    shared: &Arc<Shared>,
    cancel: &CancellationToken,
    sel: Selection,
    rv: Option<u64>,
    rv_match: Option<&str>,
    params: &Params,
) -> Response<Body> {
    let bookmarks = matches!(params.get("allowWatchBookmarks"), Some("true" | "1"));
    let initial_events = match params.get("sendInitialEvents") {
        None | Some("") | Some("false") | Some("0") => false,
        Some("true") | Some("1") => true,
        Some(other) => return bad_request(&format!("invalid sendInitialEvents: {other}")),
    };
    if initial_events && rv_match != Some("NotOlderThan") {
        return bad_request(
            "resourceVersionMatch: Forbidden: sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
        );
    }
    if initial_events && !bookmarks {
        return bad_request(
            "allowWatchBookmarks: Required value: sendInitialEvents requires allowWatchBookmarks=true",
        );
    }
    if !initial_events && rv_match.is_some() {
        return bad_request(
            "resourceVersionMatch: Forbidden: resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided",
        );
    }
    let timeout = match params.get("timeoutSeconds").filter(|t| !t.is_empty()) {
        None => DEFAULT_WATCH_TIMEOUT,
        Some(t) => match t.parse::<u64>() {
            Ok(secs) => Duration::from_secs(secs),
            Err(_) => return bad_request(&format!("invalid timeoutSeconds: {t}")),
        },
    };
    let spec = WatchSpec {
        sel,
        from: rv.filter(|n| *n != 0),
        bookmarks,
        initial_events,
        timeout,
    };
    // The watch starts now, not when its task first runs: what a compaction right after the
    // response headers does to it is settled.
    let (first, cursor) = watch_start(&shared.state(), &spec);
    let started = Started {
        first,
        cursor,
        open: OpenWatch::new(shared.clone()),
    };
    let (tx, rx) = tmpsc::channel::<Result<Frame<Bytes>, Infallible>>(64);
    let close = lock(&shared.watch_close).clone();
    tokio::spawn(run_watch(
        shared.clone(),
        spec,
        started,
        tx,
        close,
        cancel.clone(),
    ));
    let body = StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    let mut resp = Response::new(BodyExt::boxed_unsync(body));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

fn event_line(kind: &str, object: Value) -> Bytes {
    let mut line = json!({ "type": kind, "object": object }).to_string();
    line.push('\n');
    Bytes::from(line)
}

fn bookmark_line(rv: u64, initial_events_end: bool) -> Bytes {
    let mut metadata = json!({ "resourceVersion": rv.to_string() });
    if initial_events_end {
        metadata["annotations"] = json!({ "k8s.io/initial-events-end": "true" });
    }
    event_line(
        "BOOKMARK",
        json!({ "apiVersion": "v1", "kind": "Pod", "metadata": metadata }),
    )
}

fn expired_line(rv: u64, oldest: u64) -> Bytes {
    event_line(
        "ERROR",
        status_json(
            410,
            "Expired",
            &format!("too old resource version: {rv} ({oldest})"),
        ),
    )
}

/// Counts an open watch for as long as it lives.
struct OpenWatch(Arc<Shared>);

impl OpenWatch {
    fn new(shared: Arc<Shared>) -> OpenWatch {
        *lock(&shared.open_watches) += 1;
        OpenWatch(shared)
    }
}

impl Drop for OpenWatch {
    fn drop(&mut self) {
        let mut n = lock(&self.0.open_watches);
        *n = n.saturating_sub(1);
    }
}

/// What a watch sends next, worked out under the state lock.
enum Catchup {
    Lines(Vec<Bytes>),
    Expired(Bytes),
}

/// A watch as its request started it.
struct Started {
    first: Catchup,
    cursor: u64,
    open: OpenWatch,
}

/// A watch's first lines and the version it continues from: the current pods, or nothing
/// (the history after the given version follows), or the 410 if that version is compacted.
fn watch_start(st: &State, spec: &WatchSpec) -> (Catchup, u64) {
    match spec.from {
        Some(n) if !spec.initial_events => {
            if n < st.compacted {
                (Catchup::Expired(expired_line(n, st.compacted)), n)
            } else {
                (Catchup::Lines(Vec::new()), n)
            }
        }
        _ => {
            let mut lines: Vec<Bytes> = st
                .selected(&spec.sel)
                .iter()
                .map(|p| event_line("ADDED", p.to_json()))
                .collect();
            if spec.initial_events {
                lines.push(bookmark_line(st.rv, true));
            }
            (Catchup::Lines(lines), st.rv)
        }
    }
}

/// Produces one watch stream's lines into `tx` until the client goes away, the timeout, a
/// [`ApiServer::close_watches`] or a stop.
async fn run_watch(
    shared: Arc<Shared>,
    spec: WatchSpec,
    started: Started,
    tx: tmpsc::Sender<Result<Frame<Bytes>, Infallible>>,
    close: CancellationToken,
    stop: CancellationToken,
) {
    let Started {
        first,
        mut cursor,
        open: _open,
    } = started;
    let deadline = tokio::time::sleep(spec.timeout);
    tokio::pin!(deadline);
    let mut rv_rx = shared.rv_tx.subscribe();
    rv_rx.borrow_and_update();

    let send = |line: Bytes| {
        let tx = tx.clone();
        async move { tx.send(Ok(Frame::data(line))).await.is_ok() }
    };

    match first {
        Catchup::Expired(line) => {
            send(line).await;
            return;
        }
        Catchup::Lines(lines) => {
            for line in lines {
                if !send(line).await {
                    return;
                }
            }
        }
    }

    let mut ticker = tokio::time::interval(shared.opts.bookmark_interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    loop {
        rv_rx.borrow_and_update();
        let lines: Vec<Bytes> = {
            let st = shared.state();
            let start = st.history.partition_point(|e| e.rv <= cursor);
            cursor = cursor.max(st.rv);
            st.history[start..]
                .iter()
                .filter(|e| spec.sel.matches(&e.pod))
                .map(|e| event_line(e.kind.as_str(), e.pod.to_json()))
                .collect()
        };
        for line in lines {
            if !send(line).await {
                return;
            }
        }
        tokio::select! {
            changed = rv_rx.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            _ = ticker.tick(), if spec.bookmarks => {
                if !send(bookmark_line(cursor, false)).await {
                    return;
                }
            }
            _ = &mut deadline => return,
            _ = close.cancelled() => return,
            _ = stop.cancelled() => return,
            _ = tx.closed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_decoding() {
        let q = parse_query("fieldSelector=spec.nodeName%3Dnode-a&watch=true&x=a+b&y=%zz");
        assert_eq!(
            q,
            vec![
                ("fieldSelector".into(), "spec.nodeName=node-a".into()),
                ("watch".into(), "true".into()),
                ("x".into(), "a b".into()),
                ("y".into(), "%zz".into()),
            ]
        );
        assert_eq!(percent_decode("%"), "%");
        assert_eq!(percent_decode("a%4"), "a%4");
    }

    #[test]
    fn field_selectors() {
        let pod = Pod {
            namespace: "ns".into(),
            name: "p".into(),
            uid: "u".into(),
            node: "node-a".into(),
            resource_version: 1,
            creation: now(),
            deletion: None,
            images: vec![],
        };
        let sel = |s: &str| Selection {
            namespace: None,
            fields: parse_field_selector(s).unwrap(),
        };
        assert!(sel("spec.nodeName=node-a").matches(&pod));
        assert!(sel("spec.nodeName==node-a").matches(&pod));
        assert!(!sel("spec.nodeName=node-b").matches(&pod));
        assert!(sel("spec.nodeName!=node-b,metadata.namespace=ns").matches(&pod));
        assert!(sel("").matches(&pod));
        assert!(parse_field_selector("status.phase=Running").is_err());
        assert!(parse_field_selector("spec.nodeName").is_err());
    }
}

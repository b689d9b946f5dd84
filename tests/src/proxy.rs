//! Owns [`Proxy`]: a fault-injecting HTTP/1.1 reverse proxy (hyper server and client) to put in
//! front of a test registry, so pull tests can see and disturb what goes over the wire.
//!
//! It listens on 127.0.0.1 (a free port), or on a listener the test made (in another network
//! namespace, say: [`Proxy::start_on`]), over plain http or over https with a test PKI's server
//! certificate, and forwards every request to the upstream registry
//! (method, path, query and headers, `Authorization` and `Range` included; `Location` headers
//! that point at the upstream are rewritten to point at the proxy), and streams bodies through
//! without buffering them. It records every request ([`RequestRecord`]) and counts the body
//! bytes it served per blob digest ([`Proxy::bytes_served`]).
//!
//! Faults are switched at run time through [`Faults`] (cloneable, usable from any thread):
//! rate limit, cut a connection after N body bytes, stall until released, ignore `Range`,
//! corrupt a byte, fail with an HTTP status N times, answer with a canned response (a redirect
//! elsewhere, an auth challenge, a hostile error body), refuse requests without a header (a mirror
//! that wants its own key), serve the API under another root than `/v2` (a mirror behind a
//! path; the root is rewritten to `/v2` upstream), send bytes past the end of a body (a
//! registry serving a blob longer than it is, or endless bytes). A blob GET is
//! `GET /v2/<name>/blobs/sha256:<hex>`; the body faults count bytes of each response body
//! (a `Range` response body starts at 0 too).
//!
//! The proxy runs on its own thread with its own tokio runtime, so it keeps serving whatever
//! the test's thread does (blocking waits included). Dropping the [`Proxy`] stops it and drops
//! its connections.

use std::collections::HashMap;
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::sync::{Notify, oneshot};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

/// Which requests a fault applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// Every blob GET (`GET /v2/<name>/blobs/<digest>`; not HEAD, not uploads).
    AnyBlob,
    /// GETs of this one blob (`sha256:<hex>`).
    Blob(String),
    /// GETs of any of these blobs.
    Blobs(Vec<String>),
    /// GET and HEAD of manifests (`/v2/<name>/manifests/<reference>`).
    Manifests,
    /// Every request.
    Any,
}

/// How many times a fault fires before it is used up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Times {
    Once,
    N(u32),
    Always,
}

impl Times {
    fn remaining(self) -> Option<u32> {
        match self {
            Times::Once => Some(1),
            Times::N(n) => Some(n),
            Times::Always => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Kind {
    Blob(String),
    Manifest,
    Upload,
    Other,
}

/// What a fault needs to know about a request.
#[derive(Debug, Clone)]
struct ReqInfo {
    method: Method,
    kind: Kind,
}

impl ReqInfo {
    fn new(method: &Method, path: &str) -> ReqInfo {
        let kind = if let Some(i) = path.rfind("/blobs/") {
            let rest = &path[i + "/blobs/".len()..];
            if rest.starts_with("uploads") {
                Kind::Upload
            } else {
                Kind::Blob(rest.to_string())
            }
        } else if path.contains("/manifests/") {
            Kind::Manifest
        } else {
            Kind::Other
        };
        ReqInfo {
            method: method.clone(),
            kind,
        }
    }

    fn blob_get(&self) -> Option<&str> {
        match &self.kind {
            Kind::Blob(digest) if self.method == Method::GET => Some(digest),
            _ => None,
        }
    }

    fn matches(&self, target: &Target) -> bool {
        match target {
            Target::Any => true,
            Target::AnyBlob => self.blob_get().is_some(),
            Target::Blob(d) => self.blob_get() == Some(d.as_str()),
            Target::Blobs(ds) => self.blob_get().is_some_and(|g| ds.iter().any(|d| d == g)),
            Target::Manifests => {
                self.kind == Kind::Manifest
                    && (self.method == Method::GET || self.method == Method::HEAD)
            }
        }
    }
}

#[derive(Debug)]
struct Rule<T> {
    target: Target,
    remaining: Option<u32>,
    value: T,
}

impl<T> Rule<T> {
    fn live(&self) -> bool {
        self.remaining != Some(0)
    }
    fn consume(&mut self) {
        if let Some(n) = &mut self.remaining {
            *n = n.saturating_sub(1);
        }
    }
}

/// The value of the first live rule matching `info`, consuming one of its times.
fn take_rule<T: Clone>(rules: &mut [Rule<T>], info: &ReqInfo) -> Option<T> {
    let rule = rules
        .iter_mut()
        .find(|r| r.live() && info.matches(&r.target))?;
    rule.consume();
    Some(rule.value.clone())
}

/// A response the proxy gives instead of asking the upstream.
#[derive(Debug, Clone)]
struct Canned {
    status: u16,
    headers: Vec<(String, String)>,
    body: Bytes,
    /// Redirect to this base URL followed by the request's path and query.
    redirect_base: Option<String>,
    /// The fault's name in [`RequestRecord::faults`].
    fault: &'static str,
}

#[derive(Debug, Default)]
struct FaultState {
    rate_limit: Option<u64>,
    /// Bytes/s shared by every blob body (a slow link), and when the link is next free.
    link_rate: Option<u64>,
    link_free_at: Option<Instant>,
    ignore_range: bool,
    cuts: Vec<Rule<u64>>,
    corrupts: Vec<Rule<u64>>,
    failures: Vec<Rule<Canned>>,
    overlong: Vec<Rule<u64>>,
    stall: Option<(Target, u64)>,
    stalled_now: usize,
    stall_hits: u64,
    /// Requests without this header (name lower-case, value) are refused with 403.
    required_header: Option<(String, String)>,
    /// The API root served instead of `/v2`.
    api_root: Option<String>,
}

#[derive(Debug, Default)]
struct FaultsInner {
    state: Mutex<FaultState>,
    release: Notify,
}

/// The run-time switches of a [`Proxy`]. Clones share the same state.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    inner: Arc<FaultsInner>,
}

/// What a body stream does next.
enum Step {
    Stall,
    Cut,
    Send {
        len: usize,
        flips: Vec<usize>,
        rate: Option<u64>,
        /// When the shared link has sent this piece (with a link rate).
        link_due: Option<Instant>,
    },
}

impl Faults {
    fn state(&self) -> std::sync::MutexGuard<'_, FaultState> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Limits every blob GET body to `bytes_per_sec` (each response on its own); `None` lifts it.
    /// Takes effect on running transfers too.
    pub fn set_rate_limit(&self, bytes_per_sec: Option<u64>) {
        self.state().rate_limit = bytes_per_sec.filter(|r| *r > 0);
    }

    /// Limits all blob GET bodies together to `bytes_per_sec`, however many connections carry
    /// them (a node's slow link, where [`Faults::set_rate_limit`] is a cap per connection);
    /// `None` lifts it. Takes effect on running transfers too.
    pub fn set_link_rate(&self, bytes_per_sec: Option<u64>) {
        let mut st = self.state();
        st.link_rate = bytes_per_sec.filter(|r| *r > 0);
        st.link_free_at = None;
    }

    /// Drops `Range` (and `If-Range`) from blob GETs, so the upstream answers 200 with the
    /// whole blob.
    pub fn set_ignore_range(&self, on: bool) {
        self.state().ignore_range = on;
    }

    /// Cuts the connection of a matching response after it sent `bytes` body bytes (the
    /// client gets a truncated body and a closed connection). Used up when it fires.
    pub fn cut_after(&self, target: Target, bytes: u64, times: Times) {
        self.state().cuts.push(Rule {
            target,
            remaining: times.remaining(),
            value: bytes,
        });
    }

    /// Flips all bits of the byte at `offset` of a matching response body (length unchanged).
    /// Used up when it fires.
    pub fn corrupt_at(&self, target: Target, offset: u64, times: Times) {
        self.state().corrupts.push(Rule {
            target,
            remaining: times.remaining(),
            value: offset,
        });
    }

    /// Answers matching requests with `status` (e.g. 500, 503) without asking the upstream.
    pub fn fail(&self, target: Target, status: u16, times: Times) {
        let body = format!(
            "{{\"errors\":[{{\"code\":\"UNAVAILABLE\",\"message\":\"minicri test proxy: injected {status}\"}}]}}"
        );
        self.can(
            target,
            times,
            Canned {
                status,
                headers: vec![("content-type".into(), "application/json".into())],
                body: body.into(),
                redirect_base: None,
                fault: "fail",
            },
        );
    }

    /// Answers matching requests with `status`, `headers` and `body` without asking the upstream:
    /// an auth challenge naming a realm, a redirect to a fixed URL, a hostile error page.
    pub fn answer(
        &self,
        target: Target,
        status: u16,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
        times: Times,
    ) {
        self.can(
            target,
            times,
            Canned {
                status,
                headers: headers
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                body: body.into(),
                redirect_base: None,
                fault: "answer",
            },
        );
    }

    /// Redirects matching requests (307) to `base` (`scheme://host:port`) followed by the
    /// request's own path and query, without asking the upstream.
    pub fn redirect(&self, target: Target, base: &str, times: Times) {
        self.can(
            target,
            times,
            Canned {
                status: 307,
                headers: Vec::new(),
                body: Bytes::new(),
                redirect_base: Some(base.trim_end_matches('/').to_string()),
                fault: "redirect",
            },
        );
    }

    fn can(&self, target: Target, times: Times, canned: Canned) {
        self.state().failures.push(Rule {
            target,
            remaining: times.remaining(),
            value: canned,
        });
    }

    /// Sends `extra` bytes (0xee) after the end of a matching successful response body, with no
    /// Content-Length (a chunked body): a registry serving a blob longer than it is, or, with a
    /// large `extra`, endless bytes. The body's last 100 bytes and the first 100 extra ones go
    /// out in one small chunk, so a reader gets bytes past the end in the same read as the
    /// body's last ones. Used up when it fires.
    pub fn append_after_body(&self, target: Target, extra: u64, times: Times) {
        self.state().overlong.push(Rule {
            target,
            remaining: times.remaining(),
            value: extra,
        });
    }

    /// Matching response bodies stop after `bytes` body bytes until [`Faults::release_stall`].
    /// Replaces an earlier stall.
    pub fn stall_after(&self, target: Target, bytes: u64) {
        self.state().stall = Some((target, bytes));
    }

    /// Ends the stall: stalled transfers go on.
    pub fn release_stall(&self) {
        self.state().stall = None;
        self.inner.release.notify_waiters();
    }

    /// How many transfers are stalled right now.
    pub fn stalled(&self) -> usize {
        self.state().stalled_now
    }

    /// How many times a transfer got stalled so far.
    pub fn stall_hits(&self) -> u64 {
        self.state().stall_hits
    }

    /// Waits (async) until at least `n` transfers are stalled; false on timeout.
    pub async fn wait_stalled(&self, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.stalled() < n {
            if Instant::now() > deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }

    /// Waits (blocking the thread) until at least `n` transfers are stalled; false on timeout.
    pub fn wait_stalled_blocking(&self, n: usize, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.stalled() < n {
            if Instant::now() > deadline {
                return false;
            }
            thread::sleep(Duration::from_millis(10));
        }
        true
    }

    /// Refuses every request that does not carry header `name` with `value` (403, DENIED), as a
    /// mirror that wants its own key does.
    pub fn require_header(&self, name: &str, value: &str) {
        self.state().required_header = Some((name.to_ascii_lowercase(), value.to_string()));
    }

    /// Serves the registry API under `root` (e.g. `/mirror/api`) instead of `/v2`: a request
    /// under `root` goes upstream under `/v2`; any other path gets 404.
    pub fn serve_under(&self, root: &str) {
        self.state().api_root = Some(root.trim_end_matches('/').to_string());
    }

    /// Removes every fault and releases a stall.
    pub fn clear(&self) {
        {
            let mut st = self.state();
            st.rate_limit = None;
            st.link_rate = None;
            st.ignore_range = false;
            st.cuts.clear();
            st.corrupts.clear();
            st.failures.clear();
            st.overlong.clear();
            st.stall = None;
            st.required_header = None;
            st.api_root = None;
        }
        self.inner.release.notify_waiters();
    }

    /// Takes a canned answer for this request, if one matches.
    fn take_failure(&self, info: &ReqInfo) -> Option<Canned> {
        take_rule(&mut self.state().failures, info)
    }

    /// Takes an append-after-body rule for this request, if one matches.
    fn take_overlong(&self, info: &ReqInfo) -> Option<u64> {
        take_rule(&mut self.state().overlong, info)
    }

    fn ignore_range(&self, info: &ReqInfo) -> bool {
        info.blob_get().is_some() && self.state().ignore_range
    }

    /// Decides what a body stream that sent `sent` bytes does with the next `available` bytes,
    /// consuming the rules that fire.
    fn step(&self, info: &ReqInfo, sent: u64, available: usize) -> Step {
        let mut st = self.state();
        if let Some((target, at)) = &st.stall
            && info.matches(target)
            && sent >= *at
        {
            return Step::Stall;
        }
        if let Some(rule) = st
            .cuts
            .iter_mut()
            .find(|r| r.live() && info.matches(&r.target) && r.value <= sent)
        {
            rule.consume();
            return Step::Cut;
        }
        let mut len = available as u64;
        for rule in st
            .cuts
            .iter()
            .filter(|r| r.live() && info.matches(&r.target))
        {
            len = len.min(rule.value - sent);
        }
        if let Some((target, at)) = &st.stall
            && info.matches(target)
        {
            len = len.min(at - sent);
        }
        let rate = if info.blob_get().is_some() {
            st.rate_limit
        } else {
            None
        };
        let link = info.blob_get().and(st.link_rate);
        for r in rate.iter().chain(link.iter()) {
            // Small pieces keep a limited transfer smooth.
            len = len.min((r / 20).clamp(1, 64 * 1024));
        }
        let len = len.max(1) as usize;
        // The shared link sends pieces one after the other, in the order they were asked for.
        let link_due = link.map(|r| {
            let now = Instant::now();
            let start = st.link_free_at.filter(|t| *t > now).unwrap_or(now);
            let due = start + Duration::from_secs_f64(len as f64 / r as f64);
            st.link_free_at = Some(due);
            due
        });
        let mut flips = Vec::new();
        for rule in st.corrupts.iter_mut() {
            if rule.live()
                && info.matches(&rule.target)
                && rule.value >= sent
                && rule.value < sent + len as u64
            {
                rule.consume();
                flips.push((rule.value - sent) as usize);
            }
        }
        Step::Send {
            len,
            flips,
            rate,
            link_due,
        }
    }

    fn stall_begins(&self) {
        let mut st = self.state();
        st.stalled_now += 1;
        st.stall_hits += 1;
    }

    fn stall_ends(&self) {
        self.state().stalled_now -= 1;
    }
}

/// One request the proxy answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    pub method: String,
    /// Path and query as the client sent them.
    pub path: String,
    /// The client's `Range` header.
    pub range: Option<String>,
    /// Whether the client sent `Authorization`.
    pub authorization: bool,
    /// The status the client got.
    pub status: u16,
    /// Body bytes sent to the client.
    pub bytes_sent: u64,
    /// The blob digest for blob requests.
    pub digest: Option<String>,
    /// Whether the whole body went out.
    pub completed: bool,
    /// Faults that hit this request: "fail", "answer", "redirect", "range-ignored", "stall",
    /// "corrupt", "cut", "rate-limit", "link-rate", "upstream-error", "overlong".
    pub faults: Vec<String>,
}

#[derive(Debug, Default)]
struct Stats {
    records: Vec<RequestRecord>,
    blob_bytes: HashMap<String, u64>,
    /// Per blob (and under "" for all blobs): bodies being sent now, and the most at once.
    open_bodies: HashMap<String, (usize, usize)>,
}

#[derive(Clone, Default)]
struct SharedStats(Arc<Mutex<Stats>>);

impl SharedStats {
    fn lock(&self) -> std::sync::MutexGuard<'_, Stats> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn push(&self, record: RequestRecord) -> usize {
        let mut st = self.lock();
        st.records.push(record);
        st.records.len() - 1
    }
    fn add_bytes(&self, idx: usize, blob: Option<&str>, n: u64) {
        let mut st = self.lock();
        if let Some(r) = st.records.get_mut(idx) {
            r.bytes_sent += n;
        }
        if let Some(digest) = blob {
            *st.blob_bytes.entry(digest.to_string()).or_default() += n;
        }
    }
    fn note(&self, idx: usize, fault: &str) {
        if let Some(r) = self.lock().records.get_mut(idx)
            && !r.faults.iter().any(|f| f == fault)
        {
            r.faults.push(fault.to_string());
        }
    }
    fn body_opened(&self, blob: &str) {
        let mut st = self.lock();
        for key in [blob, ""] {
            let (now, peak) = st.open_bodies.entry(key.to_string()).or_default();
            *now += 1;
            *peak = (*peak).max(*now);
        }
    }
    fn body_closed(&self, blob: &str) {
        let mut st = self.lock();
        for key in [blob, ""] {
            if let Some((now, _)) = st.open_bodies.get_mut(key) {
                *now = now.saturating_sub(1);
            }
        }
    }
    fn complete(&self, idx: usize) {
        if let Some(r) = self.lock().records.get_mut(idx) {
            r.completed = true;
        }
    }
}

struct Shared {
    upstream: String,
    /// `http://ADDR` or `https://ADDR`.
    proxy_url: String,
    client: Client<HttpConnector, Incoming>,
    faults: Faults,
    stats: SharedStats,
}

/// A running proxy; see the module docs.
pub struct Proxy {
    addr: SocketAddr,
    tls: bool,
    upstream: String,
    faults: Faults,
    stats: SharedStats,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("addr", &self.addr)
            .field("upstream", &self.upstream)
            .finish()
    }
}

impl Proxy {
    /// Starts a proxy to `upstream` ("127.0.0.1:PORT", as [`crate::registry::Registry::addr`]).
    pub fn start(upstream: &str) -> io::Result<Proxy> {
        Self::start_on(upstream, std::net::TcpListener::bind("127.0.0.1:0")?, None)
    }

    /// Starts a proxy to `upstream` serving `listener`, over https with `tls`'s server
    /// certificate when given (its upstream connections are made from the test's network
    /// namespace, whatever namespace `listener` is in).
    pub fn start_on(
        upstream: &str,
        listener: std::net::TcpListener,
        tls: Option<&crate::pki::TestPki>,
    ) -> io::Result<Proxy> {
        let upstream = upstream
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_string();
        let acceptor = tls.map(tls_acceptor).transpose()?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let scheme = if acceptor.is_some() { "https" } else { "http" };
        let faults = Faults::default();
        let stats = SharedStats::default();
        let (shutdown_tx, shutdown_rx) = oneshot::channel();
        let shared = Shared {
            upstream: upstream.clone(),
            proxy_url: format!("{scheme}://{addr}"),
            client: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
            faults: faults.clone(),
            stats: stats.clone(),
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let thread = thread::Builder::new()
            .name(format!("proxy-{}", addr.port()))
            .spawn(move || {
                runtime.block_on(serve(listener, acceptor, Arc::new(shared), shutdown_rx));
                runtime.shutdown_timeout(Duration::from_secs(1));
            })?;
        Ok(Proxy {
            addr,
            tls: tls.is_some(),
            upstream,
            faults,
            stats,
            shutdown: Some(shutdown_tx),
            thread: Some(thread),
        })
    }

    /// `127.0.0.1:PORT` of the proxy (or the address of its listener): use it as the registry
    /// host of image references.
    pub fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// `http://127.0.0.1:PORT` (`https://` with TLS).
    pub fn url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// The upstream `host:port`.
    pub fn upstream(&self) -> &str {
        &self.upstream
    }

    /// The fault switches (clone it to keep it around).
    pub fn faults(&self) -> &Faults {
        &self.faults
    }

    /// Every request answered so far, in the order their responses started.
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.stats.lock().records.clone()
    }

    /// The GET requests of one blob (`sha256:<hex>`).
    pub fn blob_requests(&self, digest: &str) -> Vec<RequestRecord> {
        self.stats
            .lock()
            .records
            .iter()
            .filter(|r| r.method == "GET" && r.digest.as_deref() == Some(digest))
            .cloned()
            .collect()
    }

    /// Body bytes served for GETs of one blob, over all requests.
    pub fn bytes_served(&self, digest: &str) -> u64 {
        self.stats
            .lock()
            .blob_bytes
            .get(digest)
            .copied()
            .unwrap_or(0)
    }

    /// Body bytes served per blob digest.
    pub fn bytes_served_by_blob(&self) -> HashMap<String, u64> {
        self.stats.lock().blob_bytes.clone()
    }

    /// Body bytes served for all blob GETs.
    pub fn total_blob_bytes(&self) -> u64 {
        self.stats.lock().blob_bytes.values().sum()
    }

    /// The most bodies of one blob that were being sent at once (since the last reset).
    pub fn peak_concurrent_bodies(&self, digest: &str) -> usize {
        self.stats
            .lock()
            .open_bodies
            .get(digest)
            .map_or(0, |(_, peak)| *peak)
    }

    /// The most blob bodies, of any blob, that were being sent at once (since the last reset).
    pub fn peak_concurrent_blob_bodies(&self) -> usize {
        self.peak_concurrent_bodies("")
    }

    /// Forgets the recorded requests and byte counts.
    pub fn reset_stats(&self) {
        let mut st = self.stats.lock();
        st.records.clear();
        st.blob_bytes.clear();
        for (now, peak) in st.open_bodies.values_mut() {
            *peak = *now;
        }
    }
}

/// A dropped proxy goes away the way a registry host does: its connections are cut where they
/// stand. Stalled transfers are not released first (released, one could finish the blob before the
/// connections are aborted, and a test of a registry dying mid-blob would see it served whole).
impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.faults.release_stall();
    }
}

/// A TLS acceptor with `pki`'s server certificate (HTTP/1.1, no client certificate).
fn tls_acceptor(pki: &crate::pki::TestPki) -> io::Result<tokio_rustls::TlsAcceptor> {
    use tokio_rustls::rustls::pki_types::pem::PemObject as _;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_file_iter(&pki.server_cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(io::Error::other)?;
    let key = PrivateKeyDer::from_pem_file(&pki.server_key).map_err(io::Error::other)?;
    let config = tokio_rustls::rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(io::Error::other)?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

async fn serve(
    listener: std::net::TcpListener,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    shared: Arc<Shared>,
    mut shutdown: oneshot::Receiver<()>,
) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("proxy: cannot listen: {e}");
            return;
        }
    };
    let mut connections = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                let shared = shared.clone();
                let acceptor = acceptor.clone();
                connections.spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let shared = shared.clone();
                        async move { Ok::<_, Infallible>(handle(shared, req).await) }
                    });
                    let http = hyper::server::conn::http1::Builder::new();
                    let _ = match acceptor {
                        None => http.serve_connection(TokioIo::new(stream), service).await,
                        Some(acceptor) => match acceptor.accept(stream).await {
                            Ok(tls) => http.serve_connection(TokioIo::new(tls), service).await,
                            Err(_) => return,
                        },
                    };
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    connections.abort_all();
}

/// Hop-by-hop headers are not forwarded.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    for name in [
        header::CONNECTION,
        header::TRANSFER_ENCODING,
        header::UPGRADE,
        header::TE,
        header::TRAILER,
        header::PROXY_AUTHORIZATION,
        header::PROXY_AUTHENTICATE,
    ] {
        headers.remove(name);
    }
    headers.remove("keep-alive");
}

fn full(status: StatusCode, body: impl Into<Bytes>) -> Response<ProxyBody> {
    let mut resp = Response::new(
        Full::new(body.into())
            .map_err(|never| match never {})
            .boxed_unsync(),
    );
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Response<ProxyBody> {
    let path = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    let (required, api_root) = {
        let st = shared.faults.state();
        (st.required_header.clone(), st.api_root.clone())
    };
    // The path upstream: a root served instead of /v2 is rewritten to it.
    let upstream_path = match &api_root {
        None => path.clone(),
        Some(root) => match path.strip_prefix(root.as_str()) {
            Some(rest) if rest.is_empty() || rest.starts_with('/') => format!("/v2{rest}"),
            _ => {
                shared.stats.push(RequestRecord {
                    method: req.method().to_string(),
                    path: path.clone(),
                    range: None,
                    authorization: req.headers().contains_key(header::AUTHORIZATION),
                    status: 404,
                    bytes_sent: 0,
                    digest: None,
                    completed: true,
                    faults: vec!["outside-root".into()],
                });
                return full(StatusCode::NOT_FOUND, "{}");
            }
        },
    };
    let info = ReqInfo::new(
        req.method(),
        upstream_path.split('?').next().unwrap_or_default(),
    );
    let header_str = |name: header::HeaderName| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(String::from)
    };
    let mut record = RequestRecord {
        method: req.method().to_string(),
        path: path.clone(),
        range: header_str(header::RANGE),
        authorization: req.headers().contains_key(header::AUTHORIZATION),
        status: 0,
        bytes_sent: 0,
        digest: match &info.kind {
            Kind::Blob(d) => Some(d.clone()),
            _ => None,
        },
        completed: false,
        faults: Vec::new(),
    };

    if let Some((name, value)) = &required
        && req
            .headers()
            .get(name.as_str())
            .and_then(|v| v.to_str().ok())
            != Some(value.as_str())
    {
        let body = format!(
            "{{\"errors\":[{{\"code\":\"DENIED\",\"message\":\"minicri test proxy: header {name} missing or wrong\"}}]}}"
        );
        record.status = 403;
        record.bytes_sent = body.len() as u64;
        record.completed = true;
        record.faults.push("missing-header".into());
        shared.stats.push(record);
        return full(StatusCode::FORBIDDEN, body);
    }

    if let Some(canned) = shared.faults.take_failure(&info) {
        let status = StatusCode::from_u16(canned.status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
        record.status = status.as_u16();
        record.bytes_sent = canned.body.len() as u64;
        record.completed = true;
        record.faults.push(canned.fault.into());
        shared.stats.push(record);
        let mut resp = full(status, canned.body);
        resp.headers_mut().remove(header::CONTENT_TYPE);
        let location = canned.redirect_base.map(|base| format!("{base}{path}"));
        let headers = canned
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .chain(location.as_deref().map(|l| ("location", l)));
        for (name, value) in headers {
            if let (Ok(n), Ok(v)) = (
                header::HeaderName::from_bytes(name.as_bytes()),
                HeaderValue::from_str(value),
            ) {
                resp.headers_mut().append(n, v);
            }
        }
        return resp;
    }

    let (mut parts, body) = req.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    if let Ok(host) = HeaderValue::from_str(&shared.upstream) {
        parts.headers.insert(header::HOST, host);
    }
    if shared.faults.ignore_range(&info) && parts.headers.contains_key(header::RANGE) {
        parts.headers.remove(header::RANGE);
        parts.headers.remove(header::IF_RANGE);
        record.faults.push("range-ignored".into());
    }
    parts.uri = match format!("http://{}{}", shared.upstream, upstream_path).parse() {
        Ok(uri) => uri,
        Err(e) => {
            record.status = 400;
            shared.stats.push(record);
            return full(StatusCode::BAD_REQUEST, format!("bad uri: {e}"));
        }
    };

    let resp = match shared
        .client
        .request(Request::from_parts(parts, body))
        .await
    {
        Ok(resp) => resp,
        Err(e) => {
            record.status = 502;
            record.faults.push("upstream-error".into());
            shared.stats.push(record);
            return full(StatusCode::BAD_GATEWAY, format!("upstream: {e}"));
        }
    };

    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    let upstream_prefix = format!("http://{}", shared.upstream);
    if let Some(location) = parts
        .headers
        .get(header::LOCATION)
        .and_then(|v| v.to_str().ok())
        && let Some(rest) = location.strip_prefix(&upstream_prefix)
        && let Ok(v) = HeaderValue::from_str(&format!("{}{}", shared.proxy_url, rest))
    {
        parts.headers.insert(header::LOCATION, v);
    }
    record.status = parts.status.as_u16();
    let faultable = parts.status.is_success();
    let overlong = if faultable {
        shared.faults.take_overlong(&info).unwrap_or(0)
    } else {
        0
    };
    if overlong > 0 {
        // The body's end is where the stream ends: hyper sends it chunked.
        parts.headers.remove(header::CONTENT_LENGTH);
        record.faults.push("overlong".into());
    }
    let blob = info
        .blob_get()
        .filter(|_| parts.status.is_success())
        .map(String::from);
    let idx = shared.stats.push(record);
    // Whether the whole body went out is known once Content-Length bytes were sent (the client
    // may be done before the end of the stream is polled).
    let expected_len = if info.method == Method::HEAD {
        None
    } else {
        parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
    };
    if expected_len == Some(0) {
        shared.stats.complete(idx);
    }
    if let Some(b) = &blob {
        shared.stats.body_opened(b);
    }

    let state = BodyState {
        body,
        pending: Bytes::new(),
        sent: 0,
        done: false,
        faultable,
        info,
        blob,
        faults: shared.faults.clone(),
        stats: shared.stats.clone(),
        idx,
        expected_len,
        rate_window: None,
        overlong,
        tail: None,
    };
    let stream = futures::stream::unfold(state, |mut st| async move {
        let item = st.next_frame().await?;
        Some((item, st))
    });
    Response::from_parts(parts, StreamBody::new(stream).boxed_unsync())
}

impl Drop for BodyState {
    fn drop(&mut self) {
        if let Some(b) = &self.blob {
            self.stats.body_closed(b);
        }
    }
}

/// A response body on its way to the client.
struct BodyState {
    body: Incoming,
    pending: Bytes,
    sent: u64,
    done: bool,
    /// Whether faults may touch it (2xx responses).
    faultable: bool,
    info: ReqInfo,
    /// The digest whose byte count this body adds to (successful blob GETs).
    blob: Option<String>,
    faults: Faults,
    stats: SharedStats,
    idx: usize,
    /// The response's Content-Length.
    expected_len: Option<u64>,
    /// (rate, start, bytes sent since start) of the current rate-limited stretch.
    rate_window: Option<(u64, Instant, u64)>,
    /// Bytes still to send after the upstream body's end ([`Faults::append_after_body`]).
    overlong: u64,
    /// The body's last bytes with the first extra ones, sent after `pending`.
    tail: Option<Bytes>,
}

/// Bytes of the body, and of the extra bytes, that [`Faults::append_after_body`] sends in one
/// chunk.
const OVERLONG_TAIL: u64 = 100;

impl BodyState {
    async fn next_frame(&mut self) -> Option<Result<Frame<Bytes>, BoxError>> {
        if self.done {
            return None;
        }
        loop {
            if self.pending.is_empty()
                && let Some(tail) = self.tail.take()
            {
                self.pending = tail;
                continue;
            }
            if self.pending.is_empty() {
                match self.body.frame().await {
                    None if self.overlong > 0 => {
                        let n = self.overlong.min(64 * 1024);
                        self.overlong -= n;
                        self.pending = Bytes::from(vec![0xee; n as usize]);
                    }
                    None => {
                        self.done = true;
                        self.stats.complete(self.idx);
                        return None;
                    }
                    Some(Err(e)) => {
                        self.done = true;
                        return Some(Err(Box::new(e)));
                    }
                    Some(Ok(frame)) => match frame.into_data() {
                        Ok(data)
                            if self.overlong > 0
                                && hyper::body::Body::is_end_stream(&self.body) =>
                        {
                            // The last bytes of the body with the first extra ones, in a frame
                            // of their own.
                            let keep = data.len().saturating_sub(OVERLONG_TAIL as usize);
                            let n = self.overlong.min(OVERLONG_TAIL);
                            self.overlong -= n;
                            let mut tail = BytesMut::from(&data[keep..]);
                            tail.extend(std::iter::repeat_n(0xee, n as usize));
                            self.tail = Some(tail.freeze());
                            self.pending = data.slice(..keep);
                        }
                        Ok(data) => self.pending = data,
                        // Trailers are not forwarded (registries send none).
                        Err(_) => continue,
                    },
                }
                continue;
            }
            if !self.faultable {
                let data = std::mem::take(&mut self.pending);
                self.account(data.len());
                return Some(Ok(Frame::data(data)));
            }

            // Arm the release notification before looking at the stall, so a release between
            // the look and the wait is not missed.
            let faults = self.faults.clone();
            let release = faults.inner.release.notified();
            tokio::pin!(release);
            release.as_mut().enable();
            match faults.step(&self.info, self.sent, self.pending.len()) {
                Step::Stall => {
                    self.stats.note(self.idx, "stall");
                    self.faults.stall_begins();
                    release.await;
                    self.faults.stall_ends();
                    continue;
                }
                Step::Cut => {
                    self.stats.note(self.idx, "cut");
                    self.done = true;
                    // Let hyper flush what was sent before the connection goes down.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    return Some(Err("minicri test proxy: injected connection cut".into()));
                }
                Step::Send {
                    len,
                    flips,
                    rate,
                    link_due,
                } => {
                    let mut piece = self.pending.split_to(len.min(self.pending.len()));
                    if let Some(rate) = rate {
                        self.stats.note(self.idx, "rate-limit");
                        self.throttle(rate, piece.len() as u64).await;
                    } else {
                        self.rate_window = None;
                    }
                    if let Some(due) = link_due {
                        self.stats.note(self.idx, "link-rate");
                        tokio::time::sleep_until(due.into()).await;
                    }
                    if !flips.is_empty() {
                        self.stats.note(self.idx, "corrupt");
                        let mut bytes = BytesMut::from(&piece[..]);
                        for i in flips {
                            bytes[i] ^= 0xff;
                        }
                        piece = bytes.freeze();
                    }
                    self.account(piece.len());
                    return Some(Ok(Frame::data(piece)));
                }
            }
        }
    }

    fn account(&mut self, n: usize) {
        self.sent += n as u64;
        self.stats
            .add_bytes(self.idx, self.blob.as_deref(), n as u64);
        if self.expected_len == Some(self.sent) {
            self.stats.complete(self.idx);
        }
    }

    /// Sleeps so that this stretch of the body goes at no more than `rate` bytes/s.
    async fn throttle(&mut self, rate: u64, len: u64) {
        let (start, before) = match self.rate_window {
            Some((r, start, bytes)) if r == rate => (start, bytes),
            _ => (Instant::now(), 0),
        };
        let total = before + len;
        self.rate_window = Some((rate, start, total));
        let due = start + Duration::from_secs_f64(total as f64 / rate as f64);
        tokio::time::sleep_until(due.into()).await;
    }
}

//! Registry access: one [`Session`] per pull, over the endpoints the hosts configuration lists.
//!
//! minicri speaks the distribution protocol itself ([`http`], [`auth`]): manifest and blob
//! requests (blobs always as HTTP Range requests), the `401` challenge and its token, redirects.
//! On top of that it does what a node runtime needs: mirrors tried in order with fallback, every
//! hosts.toml setting of a host applied to the requests that go to it (CA, client certificate,
//! `skip_verify`, headers, API root, dial timeout), the CRI's credential forms, and errors
//! classified so the caller can tell "not found" from "refused" from "unreachable". Each session
//! holds its own authorization per endpoint, so a token obtained with one requester's
//! credentials is never used for another's; the HTTP clients (TLS roots, connection pools) are
//! shared per endpoint setting.
//!
//! What a registry (or anyone in its place) can make a pull do is bounded (docs/hardening.md
//! has the whole list):
//! - each manifest request, the authentication it triggers included, has a total deadline
//!   ([`REQUEST_DEADLINE`], `registry.request_timeout`) on top of the per-read timeout; a blob
//!   request has it until its response headers, and blob bodies are held to a minimum speed by
//!   the pull's watchdog (`pull.min_speed`) and to their descriptor's size by the ingest;
//! - manifests are read up to [`MAX_MANIFEST_BYTES`], token responses up to [`MAX_TOKEN_BYTES`]
//!   and error bodies up to 64 KiB, each refused as soon as it goes past, while it is read;
//! - error messages built from a registry's answer are cut to [`crate::text::MAX_MESSAGE_CHARS`], and what
//!   they quote of an error body to a short excerpt ([`MAX_EXCERPT_CHARS`], [`excerpt`]), with
//!   no control characters: they reach the pod's events;
//! - redirects and token realms reach the node's own addresses only where [`dest`] allows.

pub mod auth;
pub mod dest;
mod http;
pub mod settings;
pub use settings::RegistrySettings;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt as _;
use futures::stream::BoxStream;
use reqwest::header::{self, HeaderMap, HeaderValue};
use reqwest::{StatusCode, Url};

pub use auth::{Credentials, MAX_TOKEN_BYTES, realm_may_be_asked, realm_may_get_credentials};

use crate::digest::Digest;
use crate::error::{Result, StoreError};
use crate::hosts::{Endpoint, RegistryHosts};
use crate::reference::Reference;
use crate::text::{MAX_MESSAGE_CHARS, bounded, excerpt};
use auth::EndpointCreds;

/// Largest manifest or index accepted: 4 MiB, the size the OCI distribution spec asks registries
/// to accept at least. Refused while it is read, as soon as it goes past.
pub const MAX_MANIFEST_BYTES: u64 = 4 << 20;
/// Default total time authentication with one endpoint, or one manifest request, may take, body
/// included; for a blob request, the time until its response headers
/// ([`Registry::with_request_deadline`]).
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(60);
/// Most characters of a registry's error body quoted in an error message (which reaches the
/// pod's events): enough for the distribution spec's error codes and messages, or the first
/// line of an error page, too little to carry much of whatever a service answered.
pub const MAX_EXCERPT_CHARS: usize = 200;

/// Manifest media types minicri accepts, best first.
pub const MANIFEST_MEDIA_TYPES: &[&str] = &[
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
];

/// How a remote operation failed, before it is tied to a reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteKind {
    NotFound,
    Unauthenticated,
    Unavailable,
    Corrupt,
    /// The registry sent more than a limit allows (a manifest over [`MAX_MANIFEST_BYTES`], a
    /// token response over [`MAX_TOKEN_BYTES`]).
    TooLarge,
    /// The registry sent the daemon somewhere it does not go: a redirect or token realm on the
    /// node itself ([`dest`]), down to plain http, or to another scheme.
    Refused,
}

/// A failure at one endpoint.
#[derive(Debug, Clone)]
pub struct RemoteError {
    pub kind: RemoteKind,
    pub endpoint: String,
    pub message: String,
}

impl std::fmt::Display for RemoteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.endpoint, self.message)
    }
}

/// A reqwest error with its causes (reqwest hides "connection refused" or "timed out" in its
/// source chain).
fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        msg = format!("{msg}: {s}");
        src = s.source();
    }
    msg
}

/// Clients are cached per endpoint TLS setting: building one loads the TLS roots, which takes
/// long enough (~0.2 s here) to matter per pull. A client holds no credentials (sessions hold
/// their own authorization), so sharing one is sharing connection pools only. The key holds the
/// certificates' contents, not their paths: the files are read at every session, so a rotated
/// client certificate or CA is used from the next pull on.
#[derive(Clone, PartialEq, Eq, Hash)]
struct ClientKey {
    host: String,
    plain_http: bool,
    skip_verify: bool,
    /// sha256 of the CA certificates and the client certificate and key.
    tls: [u8; 32],
    dial_timeout: Option<Duration>,
    /// The client for destinations the session does not trust ([`dest::Route::Guarded`]).
    guarded: bool,
}

/// Most cached clients kept; the cache is emptied when it would grow past this.
const MAX_CACHED_CLIENTS: usize = 64;

/// Shared registry configuration; cheap to clone.
#[derive(Clone)]
pub struct Registry {
    hosts: RegistryHosts,
    connect_timeout: Duration,
    read_timeout: Duration,
    request_deadline: Duration,
    /// Each client with the time it was last handed out.
    clients: std::sync::Arc<
        std::sync::Mutex<std::collections::HashMap<ClientKey, (reqwest::Client, Instant)>>,
    >,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("hosts", &self.hosts)
            .finish_non_exhaustive()
    }
}

/// `ep`'s TLS material (extra CAs, client certificate and key), read and checked when a session
/// starts so that a missing or bad file is a configuration error naming it rather than a
/// failure at the endpoint.
fn read_tls(ep: &Endpoint) -> Result<http::Tls> {
    let read = |path: &std::path::Path, what: &str| {
        std::fs::read(path).map_err(|e| StoreError::HostsConfig {
            path: path.to_path_buf(),
            reason: format!("reading {what} for {ep}: {e}"),
        })
    };
    let ca = ep
        .ca
        .iter()
        .map(|path| {
            let pem = read(path, "CA certificate")?;
            reqwest::Certificate::from_pem(&pem).map_err(|e| StoreError::HostsConfig {
                path: path.clone(),
                reason: format!("parsing CA certificate for {ep}: {}", describe(&e)),
            })?;
            Ok(pem)
        })
        .collect::<Result<Vec<_>>>()?;
    let identity = match ep.client.first() {
        None => None,
        Some((cert, key)) => {
            let mut pem = read(cert, "client certificate")?;
            if let Some(key) = key {
                pem.push(b'\n');
                pem.extend(read(key, "client key")?);
            }
            reqwest::Identity::from_pem(&pem).map_err(|e| StoreError::HostsConfig {
                path: cert.clone(),
                reason: format!(
                    "client certificate for {ep}: not a PEM certificate and private key: {}",
                    describe(&e)
                ),
            })?;
            Some(pem)
        }
    };
    Ok(http::Tls { ca, identity })
}

impl Registry {
    pub fn new(hosts: RegistryHosts) -> Registry {
        Registry {
            hosts,
            connect_timeout: Duration::from_secs(10),
            read_timeout: Duration::from_secs(30),
            request_deadline: REQUEST_DEADLINE,
            clients: Default::default(),
        }
    }

    /// Sets the total deadline of a manifest request, authentication included (and of a blob
    /// request until its response headers).
    pub fn with_request_deadline(mut self, deadline: Duration) -> Registry {
        self.request_deadline = deadline;
        self
    }

    /// The HTTP client for `ep`'s TLS settings (`tls`, read from them), `guarded` or not.
    fn client(&self, ep: &Endpoint, tls: &http::Tls, guarded: bool) -> Result<reqwest::Client> {
        let key = ClientKey {
            host: ep.host.clone(),
            plain_http: ep.plain_http,
            skip_verify: ep.skip_verify,
            tls: tls.fingerprint(),
            dial_timeout: ep.dial_timeout,
            guarded,
        };
        if let Some((c, used)) = self.clients.lock().unwrap().get_mut(&key) {
            *used = Instant::now();
            return Ok(c.clone());
        }
        let timeouts = http::Timeouts {
            connect: self.connect_timeout,
            read: self.read_timeout,
        };
        let client =
            http::client(ep, tls, &timeouts, guarded).map_err(|e| StoreError::HostsConfig {
                path: ep.ca.first().cloned().unwrap_or_default(),
                reason: format!("building the HTTP client for {ep}: {}", describe(&e)),
            })?;
        let mut cache = self.clients.lock().unwrap();
        if cache.len() >= MAX_CACHED_CLIENTS {
            cache.clear();
        }
        cache.insert(key, (client.clone(), Instant::now()));
        Ok(client)
    }

    /// Forgets the clients not handed out for `idle`, and with them the connections their pools
    /// keep alive (the HTTP client keeps every idle connection for 90 s, however many a burst of
    /// pulls opened; a download still using a client keeps it until it ends). Returns how many
    /// were dropped.
    pub fn drop_idle_clients(&self, idle: Duration) -> usize {
        let mut cache = self.clients.lock().unwrap();
        let before = cache.len();
        cache.retain(|_, (_, used)| used.elapsed() < idle);
        before - cache.len()
    }

    /// Starts a session for pulling `reference` with `creds`.
    pub fn session(&self, reference: &Reference, creds: &Credentials) -> Result<Session> {
        let endpoints = self.hosts.endpoints(&reference.domain)?;
        let basic = creds
            .basic()
            .map_err(|reason| StoreError::Unauthenticated {
                reference: reference.to_string(),
                registry: reference.domain.clone(),
                reason,
            })?;
        // Where these credentials may go: the registry and its configured endpoints.
        let mut cred_hosts: Vec<String> = vec![reference.domain.clone()];
        if reference.domain == "docker.io" {
            cred_hosts.push("registry-1.docker.io".into());
        }
        cred_hosts.extend(endpoints.iter().map(|e| e.host.clone()));
        let trusted = std::sync::Arc::new(dest::Trusted::new(&reference.domain, &endpoints));
        let mut sessions = Vec::new();
        for ep in endpoints {
            let creds =
                EndpointCreds::new(creds, &basic, &ep, &reference.domain, cred_hosts.clone());
            let tls = read_tls(&ep)?;
            let net = http::Net {
                direct: self.client(&ep, &tls, false)?,
                guarded: self.client(&ep, &tls, true)?,
                trusted: trusted.clone(),
            };
            let base = format!(
                "{}://{}{}/",
                if ep.plain_http { "http" } else { "https" },
                ep.host,
                ep.api_root
            );
            let base = Url::parse(&base).map_err(|e| StoreError::HostsConfig {
                path: Default::default(),
                reason: format!("{ep}: not a URL: {e}"),
            })?;
            let state = AuthState {
                header: creds.initial(),
                generation: 0,
                withheld: creds.withheld().map(str::to_string),
            };
            sessions.push(EndpointSession {
                repository: ep.repository(&reference.path),
                headers: ep.headers.clone(),
                endpoint: ep,
                base,
                net,
                creds,
                auth: tokio::sync::Mutex::new(state),
                request_deadline: self.request_deadline,
            });
        }
        let source = {
            use sha2::Digest as _;
            let mut h = sha2::Sha256::new();
            // Endpoints as `scheme://host[root]`: a path-based mirror is another source.
            let endpoints: Vec<String> = sessions.iter().map(|s| s.endpoint.to_string()).collect();
            for part in [&reference.domain, &reference.path]
                .into_iter()
                .chain(endpoints.iter())
                .chain([
                    &creds.username,
                    &creds.password,
                    &creds.auth,
                    &creds.identity_token,
                    &creds.registry_token,
                ])
            {
                h.update((part.len() as u64).to_be_bytes());
                h.update(part.as_bytes());
            }
            h.finalize().into()
        };
        Ok(Session {
            reference: reference.clone(),
            source,
            endpoints: sessions,
            preferred: AtomicUsize::new(0),
        })
    }
}

/// The authorization one endpoint session sends.
struct AuthState {
    header: Option<HeaderValue>,
    /// Bumped at each new authorization, so that of several requests refused at once only the
    /// first fetches a token and the others retry with it.
    generation: u64,
    /// Why the credentials were not used here, added to a refusal's message.
    withheld: Option<String>,
}

struct EndpointSession {
    endpoint: Endpoint,
    /// `scheme://host<api_root>/`: request URLs are `<base><repository path>/...`.
    base: Url,
    /// The repository as this endpoint names it (token scopes).
    repository: String,
    /// hosts.toml headers, sent to the endpoint's own origin.
    headers: HeaderMap,
    net: http::Net,
    creds: EndpointCreds,
    auth: tokio::sync::Mutex<AuthState>,
    request_deadline: Duration,
}

impl EndpointSession {
    fn err(&self, kind: RemoteKind, message: String) -> RemoteError {
        RemoteError {
            kind,
            endpoint: self.endpoint.to_string(),
            message: excerpt(&message, MAX_MESSAGE_CHARS),
        }
    }

    /// `<base><repository path>/<kind>/<reference>`.
    fn url(
        &self,
        r: &Reference,
        kind: &str,
        reference: &str,
    ) -> std::result::Result<Url, RemoteError> {
        self.base
            .join(&format!("{}/{kind}/{reference}", r.path))
            .map_err(|e| self.err(RemoteKind::Unavailable, format!("bad request URL: {e}")))
    }

    /// Runs `f` within the request deadline.
    async fn deadline<T>(
        &self,
        what: &str,
        f: impl Future<Output = std::result::Result<T, RemoteError>>,
    ) -> std::result::Result<T, RemoteError> {
        let limit = self.request_deadline;
        tokio::time::timeout(limit, f).await.unwrap_or_else(|_| {
            Err(self.err(
                RemoteKind::Unavailable,
                format!("{what} took longer than {limit:?} (registry.request_timeout)"),
            ))
        })
    }

    /// GETs `url` with `always` headers on every hop and the session's authorization and the
    /// endpoint's headers on its own origin; answers one `401` and retries. A response that is
    /// not a success is turned into the error it says.
    async fn get(
        &self,
        url: Url,
        always: HeaderMap,
    ) -> std::result::Result<reqwest::Response, RemoteError> {
        let (mut authorization, mut generation) = {
            let s = self.auth.lock().await;
            (s.header.clone(), s.generation)
        };
        for attempt in 0..2 {
            let mut req = http::Request::get(url.clone());
            req.always = always.clone();
            req.scoped = self.headers.clone();
            if let Some(a) = &authorization {
                req.scoped.insert(header::AUTHORIZATION, a.clone());
            }
            let resp = http::send(&self.net, req)
                .await
                .map_err(|(kind, m)| self.err(kind, m))?;
            if resp.status().is_success() {
                return Ok(resp);
            }
            if resp.status() != StatusCode::UNAUTHORIZED || attempt == 1 {
                return Err(self.refused(resp).await);
            }
            let challenges = auth::parse_challenges(
                resp.headers()
                    .get_all(header::WWW_AUTHENTICATE)
                    .iter()
                    .filter_map(|v| v.to_str().ok()),
            );
            let mut state = self.auth.lock().await;
            if state.generation == generation {
                // Nobody has answered a challenge since this request went out: answer it,
                // holding the lock so that concurrent requests wait for this token.
                let answer = self
                    .creds
                    .answer(
                        &self.net,
                        &self.base,
                        &self.headers,
                        &challenges,
                        &self.repository,
                    )
                    .await
                    .map_err(|(kind, m)| self.with_withheld(kind, m, state.withheld.as_deref()))?;
                state.header = Some(answer.header);
                state.withheld = answer.withheld.or(state.withheld.take());
                state.generation += 1;
            }
            authorization = state.header.clone();
            generation = state.generation;
        }
        unreachable!("the second attempt returns")
    }

    /// The error for a response that is not a success.
    async fn refused(&self, resp: reqwest::Response) -> RemoteError {
        let (kind, message) = http::error_of(resp).await;
        let withheld = self.auth.lock().await.withheld.clone();
        self.with_withheld(kind, message, withheld.as_deref())
    }

    /// An error, saying why credentials were withheld if the endpoint refused.
    fn with_withheld(
        &self,
        kind: RemoteKind,
        message: String,
        withheld: Option<&str>,
    ) -> RemoteError {
        match withheld {
            Some(why) if kind == RemoteKind::Unauthenticated => {
                self.err(kind, format!("{} ({why})", bounded(message)))
            }
            _ => self.err(kind, message),
        }
    }

    /// GETs one manifest, read within [`MAX_MANIFEST_BYTES`]; returns its bytes and the digest
    /// header's value.
    async fn fetch_manifest(
        &self,
        r: &Reference,
        reference: &str,
    ) -> std::result::Result<(Bytes, Option<String>), RemoteError> {
        let url = self.url(r, "manifests", reference)?;
        let mut always = HeaderMap::new();
        always.insert(
            header::ACCEPT,
            HeaderValue::from_str(&MANIFEST_MEDIA_TYPES.join(", ")).expect("static media types"),
        );
        let resp = self.get(url, always).await?;
        let digest = resp
            .headers()
            .get("docker-content-digest")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let body = http::read_capped(resp, MAX_MANIFEST_BYTES)
            .await
            .map_err(|(kind, m)| self.err(kind, format!("manifest: {m}")))?;
        Ok((Bytes::from(body), digest))
    }

    /// Opens `length` bytes of blob `digest` from `offset`.
    async fn open_blob(
        &self,
        r: &Reference,
        digest: &Digest,
        offset: u64,
        length: u64,
    ) -> std::result::Result<BlobBody, RemoteError> {
        let url = self.url(r, "blobs", digest.as_str())?;
        let mut always = HeaderMap::new();
        let last = offset.saturating_add(length.max(1)) - 1;
        always.insert(
            header::RANGE,
            HeaderValue::from_str(&format!("bytes={offset}-{last}")).expect("digits"),
        );
        let resp = self.get(url, always).await?;
        let resumed = match resp.status() {
            StatusCode::PARTIAL_CONTENT => {
                let start = resp
                    .headers()
                    .get(header::CONTENT_RANGE)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("bytes "))
                    .and_then(|v| v.split_once('-'))
                    .and_then(|(s, _)| s.trim().parse::<u64>().ok());
                if start != Some(offset) {
                    return Err(self.err(
                        RemoteKind::Unavailable,
                        format!(
                            "asked for bytes from {offset}, got a partial answer starting at \
                             {start:?}"
                        ),
                    ));
                }
                true
            }
            StatusCode::OK => false,
            other => {
                return Err(self.err(
                    RemoteKind::Unavailable,
                    format!("blob request answered {other}"),
                ));
            }
        };
        Ok(BlobBody {
            resumed,
            stream: resp
                .bytes_stream()
                .map(|r| r.map_err(|e| std::io::Error::other(describe(&e))))
                .boxed(),
            endpoint: self.endpoint.to_string(),
        })
    }
}

/// A manifest as fetched: raw bytes (what its digest covers) and that digest.
#[derive(Debug, Clone)]
pub struct FetchedManifest {
    pub bytes: Bytes,
    pub digest: Digest,
}

/// The body of a blob response.
pub struct BlobBody {
    /// True when the body starts at the requested offset; false when it is the whole blob.
    pub resumed: bool,
    pub stream: BoxStream<'static, std::io::Result<Bytes>>,
    pub endpoint: String,
}

/// A pull's view of one image's registry endpoints.
pub struct Session {
    reference: Reference,
    /// sha256 of where the session's blob requests go and with what credentials: two sessions
    /// with the same source fail alike.
    source: [u8; 32],
    endpoints: Vec<EndpointSession>,
    /// The endpoint that answered last; tried first for everything after the manifest.
    preferred: AtomicUsize,
}

impl Session {
    pub fn reference(&self) -> &Reference {
        &self.reference
    }

    /// Where its blob requests go and with what credentials (a hash): two sessions with the same
    /// source fail alike.
    pub fn source(&self) -> [u8; 32] {
        self.source
    }

    /// Endpoint indices in the order to try: the preferred one first, then the rest in order.
    fn order(&self, need_resolve: bool) -> Vec<usize> {
        let p = self.preferred.load(Ordering::Relaxed);
        let mut v: Vec<usize> = std::iter::once(p)
            .chain((0..self.endpoints.len()).filter(|i| *i != p))
            .collect();
        v.retain(|i| {
            let e = &self.endpoints[*i].endpoint;
            if need_resolve { e.resolve } else { e.pull }
        });
        v
    }

    /// Tries `attempt` at the endpoints in `order` until one succeeds; with `remember`, that one
    /// becomes the preferred endpoint, unless one before it answered "not found": a mirror that
    /// lacks one blob is alive and stays first for the others (a fleet's cache). Returns every
    /// endpoint's failure otherwise.
    async fn first_success<'a, T, Fut>(
        &'a self,
        order: Vec<usize>,
        remember: bool,
        attempt: impl Fn(&'a EndpointSession) -> Fut,
    ) -> std::result::Result<T, Vec<RemoteError>>
    where
        Fut: Future<Output = std::result::Result<T, RemoteError>>,
    {
        let mut errors = Vec::new();
        let tries = order.len();
        for (n, i) in order.into_iter().enumerate() {
            match attempt(&self.endpoints[i]).await {
                Ok(v) => {
                    if remember
                        && errors
                            .iter()
                            .all(|e: &RemoteError| e.kind != RemoteKind::NotFound)
                    {
                        self.preferred.store(i, Ordering::Relaxed);
                    }
                    return Ok(v);
                }
                Err(e) => {
                    // A host that fails and hands over to the next is otherwise silent: the
                    // request succeeds, only later (a mirror's connect timeout at every
                    // request). The last one's error is the caller's to report.
                    if n + 1 < tries {
                        tracing::info!(
                            reference = %self.reference,
                            error = %e,
                            "registry host failed; trying the next one"
                        );
                    }
                    errors.push(e);
                }
            }
        }
        Err(errors)
    }

    /// Fetches the manifest the reference names (by tag, or by digest if it has one), or the
    /// manifest `digest` (a child of an index).
    pub async fn manifest(
        &self,
        digest: Option<&Digest>,
    ) -> std::result::Result<FetchedManifest, Vec<RemoteError>> {
        let by_tag = digest.is_none() && self.reference.digest.is_none();
        let expected = digest.or(self.reference.digest.as_ref());
        let name = match (expected, &self.reference.tag) {
            (Some(d), _) => d.to_string(),
            (None, Some(t)) => t.clone(),
            (None, None) => unreachable!("normalised references have a tag or digest"),
        };
        let fetched = self
            .first_success(self.order(by_tag), true, |ep| {
                let name = name.clone();
                async move {
                    let (bytes, header_digest) = ep
                        .deadline(
                            "manifest request",
                            ep.fetch_manifest(&self.reference, &name),
                        )
                        .await?;
                    let computed = Digest::of(&bytes);
                    if let Some(want) = expected
                        && *want != computed
                    {
                        return Err(ep.err(
                            RemoteKind::Corrupt,
                            format!("manifest hashes to {computed}, expected {want}"),
                        ));
                    }
                    if let Some(d) = header_digest
                        && d != computed.as_str()
                    {
                        tracing::debug!(endpoint = %ep.endpoint, header = %d, %computed, "registry digest header differs from content");
                    }
                    Ok(FetchedManifest {
                        bytes,
                        digest: computed,
                    })
                }
            })
            .await;
        match fetched {
            Err(errors) if errors.is_empty() => Err(vec![RemoteError {
                kind: RemoteKind::Unavailable,
                endpoint: self.reference.domain.clone(),
                message: "no configured endpoint may resolve this reference".into(),
            }]),
            other => other,
        }
    }

    /// Opens `length` bytes of blob `digest` from byte `offset`. The endpoint named
    /// `last_resort` (`http(s)://host[:port][root]`, as [`BlobBody::endpoint`] says it), whose
    /// body broke off, is tried after every other.
    pub async fn blob(
        &self,
        digest: &Digest,
        offset: u64,
        length: u64,
        last_resort: Option<&str>,
    ) -> std::result::Result<BlobBody, Vec<RemoteError>> {
        let mut order = self.order(false);
        if let Some(avoid) = last_resort {
            // A stable sort: the others keep their order.
            order.sort_by_key(|i| self.endpoints[*i].endpoint.to_string() == avoid);
        }
        // Only this blob moves on from an endpoint that broke off: the pull's other blobs keep
        // the preferred one (a fleet's cache stays first).
        self.first_success(order, last_resort.is_none(), |ep| async move {
            // Always a range request (bytes=0-... for a fresh download): the body is hashed once,
            // by the ingest. The deadline covers the request until its headers (and an error
            // body, read up to a cap).
            ep.deadline(
                "blob request",
                ep.open_blob(&self.reference, digest, offset, length),
            )
            .await
        })
        .await
    }

    /// Folds the failures of every endpoint into one error for `what`: not found only if every
    /// endpoint said so; refused if any refused; otherwise unavailable, listing each endpoint's cause.
    pub fn fold_errors(&self, what: &str, errors: Vec<RemoteError>) -> StoreError {
        let reference = self.reference.to_string();
        let detail = errors
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        let all = |k| !errors.is_empty() && errors.iter().all(|e| e.kind == k);
        let any = |k| errors.iter().any(|e| e.kind == k);
        if all(RemoteKind::NotFound) {
            StoreError::RemoteNotFound {
                reference,
                what: what.to_string(),
                registry: errors
                    .iter()
                    .map(|e| e.endpoint.clone())
                    .collect::<Vec<_>>()
                    .join(", "),
            }
        } else if any(RemoteKind::Refused) {
            // Where a registry sends the daemon is its answer, the same at every retry.
            StoreError::Refused {
                reference,
                reason: format!("{what}: {detail}"),
            }
        } else if let Some(e) = errors
            .iter()
            .find(|e| e.kind == RemoteKind::Unauthenticated)
        {
            StoreError::Unauthenticated {
                reference,
                registry: e.endpoint.clone(),
                reason: detail,
            }
        } else if errors.iter().all(|e| {
            matches!(
                e.kind,
                RemoteKind::Corrupt | RemoteKind::NotFound | RemoteKind::TooLarge
            )
        }) {
            StoreError::Malformed {
                reference,
                what: what.to_string(),
                reason: detail,
            }
        } else {
            StoreError::Unavailable {
                reference,
                reason: format!("{what}: {detail}"),
            }
        }
    }
}

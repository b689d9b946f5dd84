//! Registry access: one [`Session`] per pull, over the endpoints the hosts configuration lists.
//!
//! The wire protocol (auth challenges, token fetches, manifest and blob requests, HTTP Range) is
//! `oci-client`'s; this module adds what a node runtime needs on top: mirrors tried in order with
//! fallback, the CRI's credential forms, and errors classified so the caller can tell "not found"
//! from "refused" from "unreachable". Each session decides per endpoint what its credentials may
//! be used for ([`auth`]), and `oci-client` clients are cached per endpoint and per that decision,
//! so tokens obtained with one requester's credentials are never used for another's.
//!
//! What a registry (or anyone in its place) can make a pull do is bounded where minicri can reach
//! it (docs/hardening.md has the whole list, and what `oci-client` leaves unbounded):
//! - authentication (minicri's ping and identity-token exchange, `oci-client`'s ping and token
//!   request) and each manifest request have a total deadline ([`REQUEST_DEADLINE`],
//!   `registry_request_timeout`) on top of the per-read timeout; a blob request has it until its
//!   response headers, and blob bodies are held to a minimum speed by the pull's watchdog
//!   (`pull_min_speed`) and to their descriptor's size by the ingest;
//! - a manifest over [`MAX_MANIFEST_BYTES`] is refused before it is hashed, parsed or stored
//!   (`oci-client` has buffered it by then: the deadline is what bounds that read);
//! - error messages built from a registry's answer are cut to [`MAX_MESSAGE_CHARS`].

pub mod auth;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::stream::BoxStream;
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, RegistryOperation};

pub use auth::{Credentials, MAX_TOKEN_BYTES, realm_may_get_credentials};

use crate::digest::Digest;
use crate::error::{Result, StoreError};
use crate::hosts::{Endpoint, RegistryHosts};
use crate::reference::Reference;
use auth::{Decision, EndpointCreds, ProbeTimeouts};

/// Largest manifest or index accepted: 4 MiB, the size the OCI distribution spec asks registries
/// to accept at least. Checked once `oci-client` has read the body (it reads bodies whole).
pub const MAX_MANIFEST_BYTES: u64 = 4 << 20;
/// Default total time authentication with one endpoint, or one manifest request, may take, body
/// included; for a blob request, the time until its response headers
/// ([`Registry::with_request_deadline`]).
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(60);
/// Most characters of a registry's answer kept in an error message (`oci-client` puts whole
/// error bodies into its errors).
pub const MAX_MESSAGE_CHARS: usize = 1024;

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

fn classify(e: &OciDistributionError) -> RemoteKind {
    use OciDistributionError as E;
    match e {
        E::UnauthorizedError { .. } | E::AuthenticationFailure(_) => RemoteKind::Unauthenticated,
        E::ImageManifestNotFoundError(_) => RemoteKind::NotFound,
        E::RegistryError { envelope, .. } => {
            let codes: Vec<&OciErrorCode> = envelope.errors.iter().map(|e| &e.code).collect();
            if codes
                .iter()
                .any(|c| matches!(c, OciErrorCode::Unauthorized | OciErrorCode::Denied))
            {
                RemoteKind::Unauthenticated
            } else if codes.iter().any(|c| {
                matches!(
                    c,
                    OciErrorCode::ManifestUnknown
                        | OciErrorCode::NameUnknown
                        | OciErrorCode::BlobUnknown
                        | OciErrorCode::NotFound
                        | OciErrorCode::ManifestBlobUnknown
                )
            }) {
                RemoteKind::NotFound
            } else {
                RemoteKind::Unavailable
            }
        }
        E::ServerError { code, .. } => match code {
            401 | 403 => RemoteKind::Unauthenticated,
            404 => RemoteKind::NotFound,
            _ => RemoteKind::Unavailable,
        },
        E::DigestError(_) => RemoteKind::Corrupt,
        _ => RemoteKind::Unavailable,
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

fn describe_oci(e: &OciDistributionError) -> String {
    use OciDistributionError as E;
    match e {
        E::RequestError(re) => describe(re),
        E::UnauthorizedError { .. } => "unauthorized (credentials missing or rejected)".into(),
        other => other.to_string(),
    }
}

/// `message` cut to [`MAX_MESSAGE_CHARS`] characters.
fn bounded(mut message: String) -> String {
    if let Some((at, _)) = message.char_indices().nth(MAX_MESSAGE_CHARS) {
        message.truncate(at);
        message.push_str("… (cut)");
    }
    message
}

/// Clients are cached per endpoint and per what they may send ([`Decision::fingerprint`]):
/// building one loads the TLS roots, which takes long enough (~0.2 s here) to matter per pull. A
/// client's token cache is only ever shared by sessions with the same credentials and the same
/// decision about them.
#[derive(Clone, PartialEq, Eq, Hash)]
struct ClientKey {
    host: String,
    plain_http: bool,
    skip_verify: bool,
    ca: Vec<std::path::PathBuf>,
    dial_timeout: Option<Duration>,
    /// `None` for minicri's own client (pings, identity-token exchange), which holds nothing.
    auth: Option<[u8; 32]>,
}

/// Most cached clients kept; the cache is emptied when it would grow past this.
const MAX_CACHED_CLIENTS: usize = 64;

#[derive(Clone)]
enum CachedClient {
    Oci(Client),
    Probe(reqwest::Client),
}

/// Shared registry configuration; cheap to clone.
#[derive(Clone)]
pub struct Registry {
    hosts: RegistryHosts,
    connect_timeout: Duration,
    read_timeout: Duration,
    request_deadline: Duration,
    /// Each client with the time it was last handed out.
    clients: std::sync::Arc<
        std::sync::Mutex<std::collections::HashMap<ClientKey, (CachedClient, Instant)>>,
    >,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("hosts", &self.hosts)
            .finish_non_exhaustive()
    }
}

/// The hosts configuration error for `ep`'s CA files (or its client).
fn ca_error(ep: &Endpoint, reason: String) -> StoreError {
    StoreError::HostsConfig {
        path: ep.ca.first().cloned().unwrap_or_default(),
        reason,
    }
}

/// `ep`'s extra CA certificates, read and checked when a session starts so that a missing or
/// bad file is a configuration error of the session rather than a failure at the endpoint.
fn read_ca(ep: &Endpoint) -> Result<Vec<Vec<u8>>> {
    ep.ca
        .iter()
        .map(|path| {
            let bad = |reason: String| StoreError::HostsConfig {
                path: path.clone(),
                reason,
            };
            let pem =
                std::fs::read(path).map_err(|e| bad(format!("reading CA certificate: {e}")))?;
            reqwest::Certificate::from_pem(&pem)
                .map_err(|e| bad(format!("parsing CA certificate: {}", describe(&e))))?;
            Ok(pem)
        })
        .collect()
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

    /// Sets the total deadline of authenticating with an endpoint and of a manifest request (and
    /// of a blob request until its response headers).
    pub fn with_request_deadline(mut self, deadline: Duration) -> Registry {
        self.request_deadline = deadline;
        self
    }

    fn cached(
        &self,
        ep: &Endpoint,
        auth: Option<[u8; 32]>,
        build: impl FnOnce() -> Result<CachedClient>,
    ) -> Result<CachedClient> {
        let key = ClientKey {
            host: ep.host.clone(),
            plain_http: ep.plain_http,
            skip_verify: ep.skip_verify,
            ca: ep.ca.clone(),
            dial_timeout: ep.dial_timeout,
            auth,
        };
        if let Some((c, used)) = self.clients.lock().unwrap().get_mut(&key) {
            *used = Instant::now();
            return Ok(c.clone());
        }
        let client = build()?;
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

    /// The `oci-client` client for `ep` (whose CA certificates are `pems`) holding `decision`'s
    /// authorization.
    fn oci_client(&self, ep: &Endpoint, pems: &[Vec<u8>], decision: &Decision) -> Result<Client> {
        let built = self.cached(ep, Some(decision.fingerprint), || {
            let certs = pems
                .iter()
                .map(|data| oci_client::client::Certificate {
                    encoding: oci_client::client::CertificateEncoding::Pem,
                    data: data.clone(),
                })
                .collect();
            let config = ClientConfig {
                protocol: if ep.plain_http {
                    ClientProtocol::Http
                } else {
                    ClientProtocol::Https
                },
                accept_invalid_certificates: ep.skip_verify,
                extra_root_certificates: certs,
                connect_timeout: Some(ep.dial_timeout.unwrap_or(self.connect_timeout)),
                read_timeout: Some(self.read_timeout),
                user_agent: concat!("minicri/", env!("CARGO_PKG_VERSION")),
                ..Default::default()
            };
            // Not `Client::new`, which falls back to a default configuration (no CA, https) on
            // an error.
            Client::try_from(config)
                .map(CachedClient::Oci)
                .map_err(|e| ca_error(ep, format!("building the registry client for {ep}: {e}")))
        })?;
        match built {
            CachedClient::Oci(c) => Ok(c),
            CachedClient::Probe(_) => unreachable!("keyed with an auth fingerprint"),
        }
    }

    /// minicri's own client for `ep` (pings, identity-token exchange).
    fn probe_client(&self, ep: &Endpoint, pems: &[Vec<u8>]) -> Result<reqwest::Client> {
        let built = self.cached(ep, None, || {
            let certs = pems
                .iter()
                .map(|pem| reqwest::Certificate::from_pem(pem))
                .collect::<reqwest::Result<Vec<_>>>()
                .map_err(|e| ca_error(ep, format!("parsing CA certificate: {}", describe(&e))))?;
            let timeouts = ProbeTimeouts {
                connect: ep.dial_timeout.unwrap_or(self.connect_timeout),
                read: self.read_timeout,
            };
            auth::probe_client(ep, certs, &timeouts)
                .map(CachedClient::Probe)
                .map_err(|e| {
                    ca_error(
                        ep,
                        format!("building the HTTP client for {ep}: {}", describe(&e)),
                    )
                })
        })?;
        match built {
            CachedClient::Probe(c) => Ok(c),
            CachedClient::Oci(_) => unreachable!("keyed without an auth fingerprint"),
        }
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
        let mut sessions = Vec::new();
        for ep in endpoints {
            let creds =
                EndpointCreds::new(creds, &basic, &ep, &reference.domain, cred_hosts.clone());
            let ca_pems = read_ca(&ep)?;
            let probe = if creds.needs_probe() {
                Some(self.probe_client(&ep, &ca_pems)?)
            } else {
                None
            };
            sessions.push(EndpointSession {
                endpoint: ep,
                ca_pems,
                creds,
                probe,
                registry: self.clone(),
                authed: tokio::sync::OnceCell::new(),
            });
        }
        let source = {
            use sha2::Digest as _;
            let mut h = sha2::Sha256::new();
            // Endpoints as `scheme://host[/v2/prefix]`: a path-based mirror is another source.
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

/// Authentication with one endpoint, once done: the client to use and what it was given.
#[derive(Clone)]
struct Authed {
    client: Client,
    auth: RegistryAuth,
    /// Why the credentials were not used here, added to a refusal's message.
    withheld: Option<String>,
}

struct EndpointSession {
    endpoint: Endpoint,
    /// The endpoint's extra CA certificates (PEM), for the clients made for it.
    ca_pems: Vec<Vec<u8>>,
    creds: EndpointCreds,
    /// minicri's own client, when deciding about the credentials needs to ask the endpoint.
    probe: Option<reqwest::Client>,
    registry: Registry,
    authed: tokio::sync::OnceCell<std::result::Result<Authed, RemoteError>>,
}

impl EndpointSession {
    fn oci_ref(&self, r: &Reference, digest: Option<&Digest>) -> oci_client::Reference {
        // A path-based mirror (API root `/v2/<prefix>`) serves the repository under its prefix.
        let path = match self.endpoint.path_prefix.as_str() {
            "" => r.path.clone(),
            prefix => format!("{prefix}/{}", r.path),
        };
        match (digest.or(r.digest.as_ref()), &r.tag) {
            (Some(d), _) => {
                oci_client::Reference::with_digest(self.endpoint.host.clone(), path, d.to_string())
            }
            (None, Some(t)) => {
                oci_client::Reference::with_tag(self.endpoint.host.clone(), path, t.clone())
            }
            (None, None) => unreachable!("normalised references have a tag or digest"),
        }
    }

    fn err(&self, kind: RemoteKind, message: String) -> RemoteError {
        RemoteError {
            kind,
            endpoint: self.endpoint.to_string(),
            message: bounded(message),
        }
    }

    /// The error for an `oci-client` failure, saying why credentials were withheld if the
    /// endpoint then refused.
    fn oci_err(&self, e: OciDistributionError, authed: Option<&Authed>) -> RemoteError {
        let kind = classify(&e);
        let mut message = bounded(describe_oci(&e));
        if kind == RemoteKind::Unauthenticated
            && let Some(why) = authed.and_then(|a| a.withheld.as_ref())
        {
            message = format!("{message} ({why})");
        }
        self.err(kind, message)
    }

    /// Runs `f` within the request deadline.
    async fn deadline<T>(
        &self,
        what: &str,
        f: impl Future<Output = std::result::Result<T, RemoteError>>,
    ) -> std::result::Result<T, RemoteError> {
        let limit = self.registry.request_deadline;
        tokio::time::timeout(limit, f).await.unwrap_or_else(|_| {
            Err(self.err(
                RemoteKind::Unavailable,
                format!("{what} took longer than {limit:?} (registry_request_timeout)"),
            ))
        })
    }

    /// Authenticates once per session and endpoint, within the request deadline: decides what
    /// the credentials may be used for, then lets `oci-client` ping and fetch its token.
    async fn ensure_auth(&self, r: &Reference) -> std::result::Result<Authed, RemoteError> {
        self.authed
            .get_or_init(|| self.deadline("authentication", self.authenticate(r)))
            .await
            .clone()
    }

    async fn authenticate(&self, r: &Reference) -> std::result::Result<Authed, RemoteError> {
        let decision = self
            .creds
            .decide(self.probe.as_ref(), &self.endpoint, &r.path)
            .await
            .map_err(|(kind, m)| self.err(kind, m))?;
        let client = self
            .registry
            .oci_client(&self.endpoint, &self.ca_pems, &decision)
            .map_err(|e| self.err(RemoteKind::Unavailable, e.to_string()))?;
        let authed = Authed {
            client,
            auth: decision.auth,
            withheld: decision.withheld,
        };
        authed
            .client
            .auth(
                &self.oci_ref(r, None),
                &authed.auth,
                RegistryOperation::Pull,
            )
            .await
            .map_err(|e| self.oci_err(e, Some(&authed)))?;
        Ok(authed)
    }

    /// GET one manifest through `oci-client`, refused over [`MAX_MANIFEST_BYTES`].
    async fn fetch_manifest(
        &self,
        authed: &Authed,
        oref: &oci_client::Reference,
    ) -> std::result::Result<(Bytes, String), RemoteError> {
        let (bytes, header_digest) = authed
            .client
            .pull_manifest_raw(oref, &authed.auth, MANIFEST_MEDIA_TYPES)
            .await
            .map_err(|e| self.oci_err(e, Some(authed)))?;
        if bytes.len() as u64 > MAX_MANIFEST_BYTES {
            return Err(self.err(
                RemoteKind::TooLarge,
                format!(
                    "manifest of {} bytes exceeds the limit of {MAX_MANIFEST_BYTES} bytes",
                    bytes.len()
                ),
            ));
        }
        Ok((bytes, header_digest))
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

    /// Whether `other` fetches from the same endpoints, for the same repository, with the same
    /// credentials (so a failure of one is a failure of both).
    pub fn same_source(&self, other: &Session) -> bool {
        self.source == other.source
    }

    /// Appends `session` to `sessions` unless one of the same source is there; whether it did.
    pub fn add_distinct(
        sessions: &mut Vec<std::sync::Arc<Session>>,
        session: &std::sync::Arc<Session>,
    ) -> bool {
        if sessions.iter().any(|s| s.same_source(session)) {
            return false;
        }
        sessions.push(session.clone());
        true
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

    /// Tries `attempt` at the endpoints in `order`, each authenticated first, until one
    /// succeeds; with `remember`, that one becomes the preferred endpoint. Returns every
    /// endpoint's failure otherwise.
    async fn first_success<'a, T, Fut>(
        &'a self,
        order: Vec<usize>,
        remember: bool,
        attempt: impl Fn(&'a EndpointSession, Authed) -> Fut,
    ) -> std::result::Result<T, Vec<RemoteError>>
    where
        Fut: Future<Output = std::result::Result<T, RemoteError>>,
    {
        let mut errors = Vec::new();
        let tries = order.len();
        for (n, i) in order.into_iter().enumerate() {
            let ep = &self.endpoints[i];
            let outcome = match ep.ensure_auth(&self.reference).await {
                Ok(authed) => attempt(ep, authed).await,
                Err(e) => Err(e),
            };
            match outcome {
                Ok(v) => {
                    if remember {
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
        let fetched = self
            .first_success(self.order(by_tag), true, |ep, authed| async move {
                let oref = ep.oci_ref(&self.reference, digest);
                let (bytes, d) = ep
                    .deadline("manifest request", ep.fetch_manifest(&authed, &oref))
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
                if d != computed.as_str() {
                    tracing::debug!(endpoint = %ep.endpoint, header = %d, %computed, "registry digest header differs from content");
                }
                Ok(FetchedManifest {
                    bytes,
                    digest: computed,
                })
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
    /// `last_resort` (`http(s)://host[:port]`, as [`BlobBody::endpoint`] says it), whose body
    /// broke off, is tried after every other.
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
        self.first_success(order, last_resort.is_none(), |ep, authed| async move {
            let oref = ep.oci_ref(&self.reference, None);
            // Always a range request (bytes=0-... for a fresh download): the body is hashed once,
            // by the ingest, rather than also by the client's verifying stream. The deadline
            // covers the request until its headers (and an error body, which oci-client reads
            // whole).
            let response = ep
                .deadline("blob request", async {
                    authed
                        .client
                        .pull_blob_stream_partial(&oref, digest.as_str(), offset, Some(length))
                        .await
                        .map_err(|e| ep.oci_err(e, Some(&authed)))
                })
                .await?;
            let (resumed, s) = match response {
                oci_client::client::BlobResponse::Full(s) => (false, s),
                oci_client::client::BlobResponse::Partial(s) => (true, s),
            };
            Ok(BlobBody {
                resumed,
                stream: s.stream,
                endpoint: ep.endpoint.to_string(),
            })
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_cut() {
        assert_eq!(bounded("short".into()), "short");
        let long = "é".repeat(MAX_MESSAGE_CHARS + 10);
        let cut = bounded(long);
        assert_eq!(
            cut.chars().count(),
            MAX_MESSAGE_CHARS + "… (cut)".chars().count()
        );
    }
}

//! Registry access: one [`Session`] per pull, over the endpoints the hosts configuration lists.
//!
//! Speaks the OCI distribution API itself over `reqwest`: the `/v2/` ping and its auth challenge,
//! token fetches (Docker token and OAuth2 refresh-token grants), manifest and blob requests with
//! HTTP Range. On top of that it adds what a node runtime needs: mirrors tried in order with
//! fallback, the CRI's credential forms, and errors classified so the caller can tell "not found"
//! from "refused" from "unreachable". Each session has its own authorization, so tokens obtained
//! with one requester's credentials are never used for another's.
//!
//! What a registry (or anyone in its place) can make a pull do is bounded (docs/hardening.md):
//! - manifests and indexes are read up to [`MAX_MANIFEST_BYTES`], token responses up to
//!   [`MAX_TOKEN_BYTES`], error bodies up to [`MAX_ERROR_BYTES`], counted as the body arrives;
//! - the ping, token and manifest requests each have a total deadline ([`REQUEST_DEADLINE`]) on
//!   top of the per-read timeout, and a blob request has it until its response headers; blob
//!   bodies are held to a minimum speed by the pull's watchdog (`pull_min_speed`);
//! - credentials (basic, identity token) go only to the hosts they were given for: the endpoints
//!   of the registry (the registry and its hosts.toml mirrors) and a token realm on one of those
//!   hosts or on the same site ([`realm_may_get_credentials`]); never to a realm elsewhere, and
//!   never over plain http except to a loopback IP literal. A redirect to another host loses the
//!   `Authorization` header (reqwest), and a redirect from https down to plain http is refused.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use reqwest::header::{self, HeaderValue};

use crate::digest::Digest;
use crate::error::{Result, StoreError};
use crate::hosts::{Endpoint, RegistryHosts, is_loopback_ip};
use crate::reference::Reference;

/// Largest manifest or index read: 4 MiB, the size the OCI distribution spec asks registries to
/// accept at least.
pub const MAX_MANIFEST_BYTES: u64 = 4 << 20;
/// Largest token response read: 1 MiB (tokens are JWTs of a few KiB).
pub const MAX_TOKEN_BYTES: u64 = 1 << 20;
/// Largest error body read (for its error codes): 64 KiB.
pub const MAX_ERROR_BYTES: u64 = 64 << 10;
/// Default total time a ping, token or manifest request may take, body included; for a blob
/// request, the time until its response headers ([`Registry::with_request_deadline`]).
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(60);
/// Redirects followed per request.
const MAX_REDIRECTS: usize = 10;

/// Manifest media types minicri accepts, best first.
pub const MANIFEST_MEDIA_TYPES: &[&str] = &[
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
];

/// Credentials as the CRI's AuthConfig carries them.
#[derive(Clone, Default, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct Credentials {
    pub username: String,
    pub password: String,
    /// base64 of `username:password`.
    pub auth: String,
    /// The registry these credentials are for; empty means any.
    pub server_address: String,
    /// An OAuth2 refresh token exchanged for an access token at the registry's token service.
    pub identity_token: String,
    /// A bearer token sent to the registry as is.
    pub registry_token: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("server_address", &self.server_address)
            .finish_non_exhaustive()
    }
}

impl Credentials {
    fn applies_to(&self, endpoint: &Endpoint, registry: &str) -> bool {
        let server = self
            .server_address
            .trim_start_matches("https://")
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .trim_end_matches("/v1")
            .trim_end_matches("/v2");
        server.is_empty()
            || server == endpoint.host
            || server == registry
            || (registry == "docker.io" && server.ends_with("docker.io"))
    }

    /// `(username, password)` from the explicit fields or the `auth` field.
    fn basic(&self) -> Result<Option<(String, String)>, String> {
        if !self.username.is_empty() || !self.password.is_empty() {
            return Ok(Some((self.username.clone(), self.password.clone())));
        }
        if self.auth.is_empty() {
            return Ok(None);
        }
        let raw = base64::engine::general_purpose::STANDARD
            .decode(self.auth.trim())
            .map_err(|e| format!("auth is not base64: {e}"))?;
        let s = String::from_utf8(raw).map_err(|_| "auth is not UTF-8".to_string())?;
        let (u, p) = s
            .split_once(':')
            .ok_or("auth must encode username:password")?;
        Ok(Some((u.to_string(), p.to_string())))
    }
}

/// How a remote operation failed, before it is tied to a reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteKind {
    NotFound,
    Unauthenticated,
    Unavailable,
    Corrupt,
    /// The registry sent more than a limit allows (a manifest over [`MAX_MANIFEST_BYTES`]).
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

/// The kind of failure an error response is, from its status and the distribution spec's error
/// codes in its body.
fn classify(status: reqwest::StatusCode, body: &[u8]) -> RemoteKind {
    #[derive(serde::Deserialize)]
    struct Envelope {
        #[serde(default)]
        errors: Vec<ErrorEntry>,
    }
    #[derive(serde::Deserialize)]
    struct ErrorEntry {
        #[serde(default)]
        code: String,
    }
    let codes: Vec<String> = serde_json::from_slice::<Envelope>(body)
        .map(|e| e.errors.into_iter().map(|e| e.code).collect())
        .unwrap_or_default();
    let any = |names: &[&str]| codes.iter().any(|c| names.contains(&c.as_str()));
    if any(&["UNAUTHORIZED", "DENIED"]) || matches!(status.as_u16(), 401 | 403) {
        RemoteKind::Unauthenticated
    } else if any(&[
        "MANIFEST_UNKNOWN",
        "NAME_UNKNOWN",
        "BLOB_UNKNOWN",
        "NOT_FOUND",
        "MANIFEST_BLOB_UNKNOWN",
    ]) || status.as_u16() == 404
    {
        RemoteKind::NotFound
    } else {
        RemoteKind::Unavailable
    }
}

/// A reqwest error with its causes (reqwest hides "connection refused" or "timed out" in its
/// source chain).
fn describe(e: &reqwest::Error) -> String {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        msg = format!("{msg}: {s}");
        src = s.source();
    }
    msg
}

/// Reads a response body up to `max` bytes, failing as soon as it goes past: the body is never
/// buffered beyond the limit, whatever Content-Length says.
async fn read_capped(resp: reqwest::Response, max: u64) -> std::result::Result<Vec<u8>, BodyError> {
    if let Some(len) = resp.content_length()
        && len > max
    {
        return Err(BodyError::TooLarge(len));
    }
    let mut out = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| BodyError::Read(describe(&e)))?;
        if out.len() as u64 + chunk.len() as u64 > max {
            return Err(BodyError::TooLarge(out.len() as u64 + chunk.len() as u64));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

enum BodyError {
    /// At least this many bytes.
    TooLarge(u64),
    Read(String),
}

/// May credentials for the hosts `allowed` be sent to the token realm `realm`? Only over https
/// (or plain http to a loopback IP literal), and only to one of those hosts or to a host of the
/// same site: the parent domain of an allowed host (at least two labels) or a subdomain of it,
/// as Docker Hub's `registry-1.docker.io` and `auth.docker.io` or GitLab's `registry.gitlab.com`
/// and `gitlab.com` are. Without a public-suffix list, a registry directly under a two-label
/// public suffix (`x.co.uk`) counts its suffix's other domains as its site: documented as a
/// limit in docs/hardening.md.
pub fn realm_may_get_credentials(realm: &str, allowed: &[String]) -> bool {
    let Ok(url) = reqwest::Url::parse(realm) else {
        return false;
    };
    let Some(host) = url.host_str().map(|h| h.to_ascii_lowercase()) else {
        return false;
    };
    let bare = |h: &str| -> String {
        let h = h.trim_start_matches('[');
        let h = match h.split_once(']') {
            Some((ip6, _)) => ip6.to_string(),
            None => h.rsplit_once(':').map_or(h, |(name, _)| name).to_string(),
        };
        h.to_ascii_lowercase()
    };
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    let loopback = host
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback());
    match url.scheme() {
        "https" => {}
        "http" if loopback => {}
        _ => return false,
    }
    let is_ip = host.parse::<std::net::IpAddr>().is_ok();
    allowed.iter().map(|a| bare(a)).any(|a| {
        if a == host {
            return true;
        }
        if is_ip || a.parse::<std::net::IpAddr>().is_ok() {
            return false;
        }
        let Some((_, parent)) = a.split_once('.') else {
            return false;
        };
        parent.contains('.') && (host == parent || host.ends_with(&format!(".{parent}")))
    })
}

/// Clients are cached per endpoint configuration: building one loads the TLS roots, which takes
/// long enough (~0.2 s here) to matter per pull. Clients hold no credentials or tokens.
#[derive(Clone, PartialEq, Eq, Hash)]
struct ClientKey {
    skip_verify: bool,
    ca: Vec<std::path::PathBuf>,
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
    clients:
        std::sync::Arc<std::sync::Mutex<std::collections::HashMap<ClientKey, reqwest::Client>>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("hosts", &self.hosts)
            .finish_non_exhaustive()
    }
}

/// How a session authenticates at one endpoint.
#[derive(Clone)]
enum Auth {
    Anonymous,
    Basic(String, String),
    /// A registry token sent as is.
    Bearer(String),
}

/// Follows redirects, but never from https down to plain http (except to a loopback IP literal):
/// that would hand the request, and any token in it, to whoever is on the path.
fn redirect_policy() -> reqwest::redirect::Policy {
    reqwest::redirect::Policy::custom(|attempt| {
        if attempt.previous().len() >= MAX_REDIRECTS {
            return attempt.error("too many redirects");
        }
        let downgrade = attempt.url().scheme() == "http"
            && attempt.previous().iter().any(|u| u.scheme() == "https")
            && !attempt.url().host_str().is_some_and(is_loopback_ip);
        if downgrade {
            let to = attempt.url().to_string();
            return attempt.error(format!("refusing a redirect from https to {to}"));
        }
        attempt.follow()
    })
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

    /// Sets the total deadline of ping, token and manifest requests (and of a blob request until
    /// its response headers).
    pub fn with_request_deadline(mut self, deadline: Duration) -> Registry {
        self.request_deadline = deadline;
        self
    }

    fn client(&self, ep: &Endpoint) -> Result<reqwest::Client> {
        let key = ClientKey {
            skip_verify: ep.skip_verify,
            ca: ep.ca.clone(),
        };
        if let Some(c) = self.clients.lock().unwrap().get(&key) {
            return Ok(c.clone());
        }
        let mut certs = Vec::new();
        for path in &ep.ca {
            let bad = |reason: String| StoreError::HostsConfig {
                path: path.clone(),
                reason,
            };
            let data =
                std::fs::read(path).map_err(|e| bad(format!("reading CA certificate: {e}")))?;
            certs.push(
                reqwest::Certificate::from_pem(&data)
                    .map_err(|e| bad(format!("parsing CA certificate: {e}")))?,
            );
        }
        let client = reqwest::Client::builder()
            .danger_accept_invalid_certs(ep.skip_verify)
            .tls_certs_merge(certs)
            .connect_timeout(self.connect_timeout)
            .read_timeout(self.read_timeout)
            .redirect(redirect_policy())
            .user_agent(concat!("minicri/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| StoreError::HostsConfig {
                path: ep.ca.first().cloned().unwrap_or_default(),
                reason: format!("building the HTTP client for {ep}: {}", describe(&e)),
            })?;
        let mut cache = self.clients.lock().unwrap();
        if cache.len() >= MAX_CACHED_CLIENTS {
            cache.clear();
        }
        cache.insert(key, client.clone());
        Ok(client)
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
            let applies = creds.applies_to(&ep, &reference.domain);
            let auth = if !applies {
                Auth::Anonymous
            } else if !creds.registry_token.is_empty() {
                Auth::Bearer(creds.registry_token.clone())
            } else if let Some((u, p)) = &basic {
                Auth::Basic(u.clone(), p.clone())
            } else {
                Auth::Anonymous
            };
            let identity_token =
                (applies && !creds.identity_token.is_empty()).then(|| creds.identity_token.clone());
            let client = self.client(&ep)?;
            sessions.push(EndpointSession {
                endpoint: ep,
                client,
                auth,
                identity_token,
                cred_hosts: cred_hosts.clone(),
                deadline: self.request_deadline,
                authed: tokio::sync::OnceCell::new(),
            });
        }
        Ok(Session {
            reference: reference.clone(),
            endpoints: sessions,
            preferred: AtomicUsize::new(0),
        })
    }
}

struct EndpointSession {
    endpoint: Endpoint,
    client: reqwest::Client,
    auth: Auth,
    identity_token: Option<String>,
    /// Hosts the credentials may be sent to (see [`realm_may_get_credentials`]).
    cred_hosts: Vec<String>,
    deadline: Duration,
    /// The `Authorization` header for this endpoint, once known (None: anonymous).
    authed: tokio::sync::OnceCell<std::result::Result<Option<HeaderValue>, RemoteError>>,
}

impl EndpointSession {
    fn base(&self) -> String {
        let scheme = if self.endpoint.plain_http {
            "http"
        } else {
            "https"
        };
        format!("{scheme}://{}/v2", self.endpoint.host)
    }

    fn err(&self, kind: RemoteKind, message: String) -> RemoteError {
        RemoteError {
            kind,
            endpoint: self.endpoint.to_string(),
            message,
        }
    }

    fn unavailable(&self, e: &reqwest::Error) -> RemoteError {
        self.err(RemoteKind::Unavailable, describe(e))
    }

    /// Runs `f` within the request deadline.
    async fn deadline<T>(
        &self,
        what: &str,
        f: impl Future<Output = std::result::Result<T, RemoteError>>,
    ) -> std::result::Result<T, RemoteError> {
        let limit = self.deadline;
        tokio::time::timeout(limit, f).await.unwrap_or_else(|_| {
            Err(self.err(
                RemoteKind::Unavailable,
                format!("{what} took longer than {limit:?} (registry_request_timeout)"),
            ))
        })
    }

    /// The error for a response that is not a success.
    async fn status_error(&self, what: &str, resp: reqwest::Response) -> RemoteError {
        let status = resp.status();
        let body = read_capped(resp, MAX_ERROR_BYTES).await.unwrap_or_default();
        let kind = classify(status, &body);
        let text = String::from_utf8_lossy(&body[..body.len().min(512)]).into_owned();
        let message = match kind {
            RemoteKind::Unauthenticated => {
                format!("{what}: unauthorized (credentials missing or rejected): {status}")
            }
            _ => format!("{what}: {status} {}", text.trim()),
        };
        self.err(kind, message)
    }

    /// Reads a body within `max` bytes.
    async fn body(
        &self,
        what: &str,
        resp: reqwest::Response,
        max: u64,
    ) -> std::result::Result<Vec<u8>, RemoteError> {
        read_capped(resp, max).await.map_err(|e| match e {
            BodyError::TooLarge(n) => self.err(
                RemoteKind::TooLarge,
                format!("{what} of {n} bytes or more exceeds the limit of {max} bytes"),
            ),
            BodyError::Read(m) => self.err(RemoteKind::Unavailable, format!("reading {what}: {m}")),
        })
    }

    /// Authenticates once per session and endpoint: ping, challenge, token.
    async fn ensure_auth(
        &self,
        r: &Reference,
    ) -> std::result::Result<Option<HeaderValue>, RemoteError> {
        self.authed
            .get_or_init(|| self.deadline("authentication", self.authenticate(r)))
            .await
            .clone()
    }

    async fn authenticate(
        &self,
        r: &Reference,
    ) -> std::result::Result<Option<HeaderValue>, RemoteError> {
        if let Auth::Bearer(t) = &self.auth {
            return bearer(t)
                .map(Some)
                .map_err(|m| self.err(RemoteKind::Unauthenticated, m));
        }
        let ping = self
            .client
            .get(format!("{}/", self.base()))
            .send()
            .await
            .map_err(|e| self.unavailable(&e))?;
        let status = ping.status();
        let challenge = ping
            .headers()
            .get(header::WWW_AUTHENTICATE)
            .and_then(|h| h.to_str().ok())
            .map(str::to_string);
        // The ping's body is of no interest; read a bounded part of it so the connection is reused.
        let _ = read_capped(ping, MAX_ERROR_BYTES).await;
        if status.is_success() {
            return Ok(self.basic_header());
        }
        if status.as_u16() != 401 {
            return Err(self.err(
                RemoteKind::Unavailable,
                format!("registry ping answered {status}"),
            ));
        }
        match challenge.as_deref().and_then(parse_bearer_challenge) {
            Some((realm, service)) => self.token(r, &realm, service.as_deref()).await.map(Some),
            // Basic (or no) challenge: the credentials go to this endpoint only.
            None => Ok(self.basic_header()),
        }
    }

    fn basic_header(&self) -> Option<HeaderValue> {
        match &self.auth {
            Auth::Basic(u, p) => {
                let enc = base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"));
                HeaderValue::from_str(&format!("Basic {enc}"))
                    .ok()
                    .map(|mut v| {
                        v.set_sensitive(true);
                        v
                    })
            }
            _ => None,
        }
    }

    /// A bearer token from the realm: with the credentials if they may go there, anonymously
    /// otherwise (public images still pull).
    async fn token(
        &self,
        r: &Reference,
        realm: &str,
        service: Option<&str>,
    ) -> std::result::Result<HeaderValue, RemoteError> {
        let scope = format!("repository:{}:pull", r.path);
        let trusted = realm_may_get_credentials(realm, &self.cred_hosts);
        let has_creds = self.identity_token.is_some() || matches!(self.auth, Auth::Basic(..));
        if has_creds && !trusted {
            tracing::warn!(endpoint = %self.endpoint, realm, "token realm is not a host the credentials were given for (or is plain http); asking it for an anonymous token");
        }
        let req = match (&self.identity_token, trusted) {
            (Some(tok), true) => {
                // OAuth2 refresh-token grant.
                let mut form = vec![
                    ("grant_type", "refresh_token"),
                    ("refresh_token", tok.as_str()),
                    ("client_id", "minicri"),
                    ("scope", scope.as_str()),
                ];
                if let Some(s) = service {
                    form.push(("service", s));
                }
                self.client.post(realm).form(&form)
            }
            _ => {
                let mut query = vec![("scope", scope.as_str())];
                if let Some(s) = service {
                    query.push(("service", s));
                }
                let req = self.client.get(realm).query(&query);
                match (&self.auth, trusted) {
                    (Auth::Basic(u, p), true) => req.basic_auth(u, Some(p)),
                    _ => req,
                }
            }
        };
        let resp = req.send().await.map_err(|e| self.unavailable(&e))?;
        if !resp.status().is_success() {
            let status = resp.status();
            return Err(self.err(
                RemoteKind::Unauthenticated,
                format!("token service {realm} refused: {status}"),
            ));
        }
        let body = self.body("token response", resp, MAX_TOKEN_BYTES).await?;
        #[derive(serde::Deserialize)]
        struct TokenResponse {
            access_token: Option<String>,
            token: Option<String>,
        }
        let parsed: TokenResponse = serde_json::from_slice(&body).map_err(|e| {
            self.err(
                RemoteKind::Unauthenticated,
                format!("bad token response: {e}"),
            )
        })?;
        let token = parsed
            .token
            .or(parsed.access_token)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                self.err(
                    RemoteKind::Unauthenticated,
                    "token response has no token".into(),
                )
            })?;
        bearer(&token).map_err(|m| self.err(RemoteKind::Unauthenticated, m))
    }

    fn get(&self, url: String, auth: &Option<HeaderValue>) -> reqwest::RequestBuilder {
        let req = self.client.get(url);
        match auth {
            Some(a) => req.header(header::AUTHORIZATION, a.clone()),
            None => req,
        }
    }

    /// GET one manifest (by tag or digest), read within [`MAX_MANIFEST_BYTES`].
    async fn fetch_manifest(
        &self,
        r: &Reference,
        reference: &str,
        auth: &Option<HeaderValue>,
    ) -> std::result::Result<Bytes, RemoteError> {
        let url = format!("{}/{}/manifests/{reference}", self.base(), r.path);
        let resp = self
            .get(url, auth)
            .header(header::ACCEPT, MANIFEST_MEDIA_TYPES.join(", "))
            .send()
            .await
            .map_err(|e| self.unavailable(&e))?;
        if !resp.status().is_success() {
            return Err(self.status_error("manifest", resp).await);
        }
        Ok(Bytes::from(
            self.body("manifest", resp, MAX_MANIFEST_BYTES).await?,
        ))
    }
}

/// `Bearer <token>` as a header value, marked sensitive.
fn bearer(token: &str) -> std::result::Result<HeaderValue, String> {
    let mut v = HeaderValue::from_str(&format!("Bearer {token}"))
        .map_err(|_| "the token is not a valid header value".to_string())?;
    v.set_sensitive(true);
    Ok(v)
}

/// `(realm, service)` of a `Bearer realm="…",service="…"` challenge.
fn parse_bearer_challenge(h: &str) -> Option<(String, Option<String>)> {
    let rest = h
        .trim()
        .strip_prefix("Bearer ")
        .or_else(|| h.trim().strip_prefix("bearer "))?;
    let mut realm = None;
    let mut service = None;
    for part in rest.split(',') {
        let (k, v) = part.trim().split_once('=')?;
        let v = v.trim().trim_matches('"').to_string();
        match k.trim() {
            "realm" => realm = Some(v),
            "service" => service = Some(v),
            _ => {}
        }
    }
    Some((realm?, service))
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
    endpoints: Vec<EndpointSession>,
    /// The endpoint that answered last; tried first for everything after the manifest.
    preferred: AtomicUsize,
}

impl Session {
    pub fn reference(&self) -> &Reference {
        &self.reference
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

    /// Fetches the manifest the reference names (by tag, or by digest if it has one), or the
    /// manifest `digest` (a child of an index).
    pub async fn manifest(
        &self,
        digest: Option<&Digest>,
    ) -> std::result::Result<FetchedManifest, Vec<RemoteError>> {
        let by_tag = digest.is_none() && self.reference.digest.is_none();
        let mut errors = Vec::new();
        for i in self.order(by_tag) {
            let ep = &self.endpoints[i];
            let auth = match ep.ensure_auth(&self.reference).await {
                Ok(a) => a,
                Err(e) => {
                    errors.push(e);
                    continue;
                }
            };
            let want = digest.or(self.reference.digest.as_ref());
            let name = match (want, &self.reference.tag) {
                (Some(d), _) => d.to_string(),
                (None, Some(t)) => t.clone(),
                (None, None) => unreachable!("normalised references have a tag or digest"),
            };
            let fetched = ep
                .deadline(
                    "manifest request",
                    ep.fetch_manifest(&self.reference, &name, &auth),
                )
                .await;
            match fetched {
                Ok(bytes) => {
                    let computed = Digest::of(&bytes);
                    if let Some(want) = want
                        && *want != computed
                    {
                        errors.push(ep.err(
                            RemoteKind::Corrupt,
                            format!("manifest hashes to {computed}, expected {want}"),
                        ));
                        continue;
                    }
                    self.preferred.store(i, Ordering::Relaxed);
                    return Ok(FetchedManifest {
                        bytes,
                        digest: computed,
                    });
                }
                Err(e) => errors.push(e),
            }
        }
        if errors.is_empty() {
            errors.push(RemoteError {
                kind: RemoteKind::Unavailable,
                endpoint: self.reference.domain.clone(),
                message: "no configured endpoint may resolve this reference".into(),
            });
        }
        Err(errors)
    }

    /// Opens blob `digest` at byte `offset` (0 for the whole blob).
    pub async fn blob(
        &self,
        digest: &Digest,
        offset: u64,
    ) -> std::result::Result<BlobBody, Vec<RemoteError>> {
        let mut errors = Vec::new();
        for i in self.order(false) {
            let ep = &self.endpoints[i];
            let auth = match ep.ensure_auth(&self.reference).await {
                Ok(a) => a,
                Err(e) => {
                    errors.push(e);
                    continue;
                }
            };
            // Always a range request (bytes=0- for a fresh download): a registry that ignores it
            // answers 200 with the whole blob, which the caller sees in `resumed`.
            let url = format!("{}/{}/blobs/{digest}", ep.base(), self.reference.path);
            let sent = ep
                .deadline("blob request", async {
                    ep.get(url, &auth)
                        .header(header::RANGE, format!("bytes={offset}-"))
                        .send()
                        .await
                        .map_err(|e| ep.unavailable(&e))
                })
                .await;
            let resp = match sent {
                Ok(r) => r,
                Err(e) => {
                    errors.push(e);
                    continue;
                }
            };
            let resumed = match resp.status().as_u16() {
                206 => true,
                200 => false,
                _ => {
                    errors.push(ep.status_error("blob", resp).await);
                    continue;
                }
            };
            self.preferred.store(i, Ordering::Relaxed);
            let stream = resp
                .bytes_stream()
                .map(|r| r.map_err(|e| std::io::Error::other(describe(&e))))
                .boxed();
            return Ok(BlobBody {
                resumed,
                stream,
                endpoint: ep.endpoint.to_string(),
            });
        }
        Err(errors)
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
    fn decodes_auth_field() {
        let c = Credentials {
            auth: base64::engine::general_purpose::STANDARD.encode("u:p:x"),
            ..Default::default()
        };
        assert_eq!(c.basic().unwrap(), Some(("u".into(), "p:x".into())));
        let c = Credentials {
            auth: "!!".into(),
            ..Default::default()
        };
        assert!(c.basic().is_err());
        assert_eq!(Credentials::default().basic().unwrap(), None);
    }

    #[test]
    fn parses_bearer_challenges() {
        let (realm, service) = parse_bearer_challenge(
            r#"Bearer realm="http://127.0.0.1:1/token",service="reg",scope="x""#,
        )
        .unwrap();
        assert_eq!(realm, "http://127.0.0.1:1/token");
        assert_eq!(service.as_deref(), Some("reg"));
        assert!(parse_bearer_challenge("Basic realm=\"x\"").is_none());
    }
}

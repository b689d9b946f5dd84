//! Registry access: one [`Session`] per pull, over the endpoints the hosts configuration lists.
//!
//! The wire protocol (auth challenges, token fetches, manifest and blob requests, HTTP Range) is
//! `oci-client`'s; this module adds what a node runtime needs on top: mirrors tried in order with
//! fallback, the CRI's credential forms, and errors classified so the caller can tell "not found"
//! from "refused" from "unreachable". Each session has its own clients, so tokens obtained with one
//! requester's credentials are never used for another's.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use futures::stream::BoxStream;
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, RegistryOperation};

use crate::digest::Digest;
use crate::error::{Result, StoreError};
use crate::hosts::{Endpoint, RegistryHosts};
use crate::reference::Reference;

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

fn describe(e: &OciDistributionError) -> String {
    use OciDistributionError as E;
    match e {
        E::RequestError(re) => {
            // reqwest hides the cause (connection refused, timeout) in its source chain.
            let mut msg = re.to_string();
            let mut src = std::error::Error::source(re);
            while let Some(s) = src {
                msg = format!("{msg}: {s}");
                src = s.source();
            }
            msg
        }
        E::UnauthorizedError { .. } => "unauthorized (credentials missing or rejected)".into(),
        other => other.to_string(),
    }
}

/// Clients are cached per endpoint and credential: building one loads the TLS roots, which takes
/// long enough (~0.2 s here) to matter per pull. A client's token cache is only ever shared by
/// sessions with the same credentials.
#[derive(Clone, PartialEq, Eq, Hash)]
struct ClientKey {
    host: String,
    plain_http: bool,
    skip_verify: bool,
    ca: Vec<std::path::PathBuf>,
    /// sha256 of the credential the client authenticates with.
    auth: [u8; 32],
}

/// Most cached clients kept; the cache is emptied when it would grow past this.
const MAX_CACHED_CLIENTS: usize = 64;

/// Shared registry configuration; cheap to clone.
#[derive(Clone)]
pub struct Registry {
    hosts: RegistryHosts,
    connect_timeout: Duration,
    read_timeout: Duration,
    clients: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<ClientKey, Client>>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("hosts", &self.hosts)
            .finish_non_exhaustive()
    }
}

fn auth_fingerprint(auth: &RegistryAuth, identity_token: Option<&str>) -> [u8; 32] {
    use sha2::Digest as _;
    let mut h = sha2::Sha256::new();
    match auth {
        RegistryAuth::Anonymous => h.update(b"anonymous\0"),
        RegistryAuth::Basic(u, p) => {
            h.update(b"basic\0");
            h.update(u.as_bytes());
            h.update(b"\0");
            h.update(p.as_bytes());
        }
        RegistryAuth::Bearer(t) => {
            h.update(b"bearer\0");
            h.update(t.as_bytes());
        }
    }
    if let Some(t) = identity_token {
        h.update(b"\0identity\0");
        h.update(t.as_bytes());
    }
    h.finalize().into()
}

impl Registry {
    pub fn new(hosts: RegistryHosts) -> Registry {
        Registry {
            hosts,
            connect_timeout: Duration::from_secs(10),
            read_timeout: Duration::from_secs(30),
            clients: Default::default(),
        }
    }

    fn client(&self, ep: &Endpoint, key: ClientKey) -> Result<Client> {
        if let Some(c) = self.clients.lock().unwrap().get(&key) {
            return Ok(c.clone());
        }
        let mut certs = Vec::new();
        for path in &ep.ca {
            let data = std::fs::read(path).map_err(|e| StoreError::HostsConfig {
                path: path.clone(),
                reason: format!("reading CA certificate: {e}"),
            })?;
            certs.push(oci_client::client::Certificate {
                encoding: oci_client::client::CertificateEncoding::Pem,
                data,
            });
        }
        let client = Client::new(ClientConfig {
            protocol: if ep.plain_http {
                ClientProtocol::Http
            } else {
                ClientProtocol::Https
            },
            accept_invalid_certificates: ep.skip_verify,
            extra_root_certificates: certs,
            connect_timeout: Some(self.connect_timeout),
            read_timeout: Some(self.read_timeout),
            user_agent: concat!("minicri/", env!("CARGO_PKG_VERSION")),
            ..Default::default()
        });
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
        let mut sessions = Vec::new();
        for ep in endpoints {
            let auth = if !creds.applies_to(&ep, &reference.domain) {
                RegistryAuth::Anonymous
            } else if !creds.registry_token.is_empty() {
                RegistryAuth::Bearer(creds.registry_token.clone())
            } else if let Some((u, p)) = &basic {
                RegistryAuth::Basic(u.clone(), p.clone())
            } else {
                RegistryAuth::Anonymous
            };
            let identity_token = (creds.applies_to(&ep, &reference.domain)
                && !creds.identity_token.is_empty())
            .then(|| creds.identity_token.clone());
            let key = ClientKey {
                host: ep.host.clone(),
                plain_http: ep.plain_http,
                skip_verify: ep.skip_verify,
                ca: ep.ca.clone(),
                auth: auth_fingerprint(&auth, identity_token.as_deref()),
            };
            let client = self.client(&ep, key)?;
            sessions.push(EndpointSession {
                endpoint: ep,
                client,
                auth,
                identity_token,
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
    client: Client,
    auth: RegistryAuth,
    identity_token: Option<String>,
    authed: tokio::sync::OnceCell<std::result::Result<RegistryAuth, RemoteError>>,
}

impl EndpointSession {
    fn oci_ref(&self, r: &Reference, digest: Option<&Digest>) -> oci_client::Reference {
        let path = r.path.clone();
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
            message,
        }
    }

    fn oci_err(&self, e: OciDistributionError) -> RemoteError {
        self.err(classify(&e), describe(&e))
    }

    /// Authenticates once per session and endpoint (ping, challenge, token).
    async fn ensure_auth(&self, r: &Reference) -> std::result::Result<RegistryAuth, RemoteError> {
        self.authed
            .get_or_init(|| async {
                let auth = match &self.identity_token {
                    Some(tok) => RegistryAuth::Bearer(self.exchange_identity_token(r, tok).await?),
                    None => self.auth.clone(),
                };
                let oref = self.oci_ref(r, None);
                self.client
                    .auth(&oref, &auth, RegistryOperation::Pull)
                    .await
                    .map_err(|e| self.oci_err(e))?;
                Ok(auth)
            })
            .await
            .clone()
    }

    /// OAuth2 refresh-token grant: the identity token buys an access token from the realm the
    /// registry's challenge names.
    async fn exchange_identity_token(
        &self,
        r: &Reference,
        token: &str,
    ) -> std::result::Result<String, RemoteError> {
        let scheme = if self.endpoint.plain_http {
            "http"
        } else {
            "https"
        };
        let http = reqwest::Client::builder()
            .danger_accept_invalid_certs(self.endpoint.skip_verify)
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| self.err(RemoteKind::Unavailable, e.to_string()))?;
        let unavailable = |e: reqwest::Error| self.err(RemoteKind::Unavailable, e.to_string());
        let ping = http
            .get(format!("{scheme}://{}/v2/", self.endpoint.host))
            .send()
            .await
            .map_err(unavailable)?;
        let challenge = ping
            .headers()
            .get(reqwest::header::WWW_AUTHENTICATE)
            .and_then(|h| h.to_str().ok())
            .and_then(parse_bearer_challenge)
            .ok_or_else(|| {
                self.err(
                    RemoteKind::Unauthenticated,
                    "identity token given but the registry does not offer bearer-token auth".into(),
                )
            })?;
        let scope = format!("repository:{}:pull", r.path);
        let mut form = vec![
            ("grant_type", "refresh_token"),
            ("refresh_token", token),
            ("client_id", "minicri"),
            ("scope", scope.as_str()),
        ];
        if let Some(s) = &challenge.1 {
            form.push(("service", s));
        }
        let resp = http
            .post(&challenge.0)
            .form(&form)
            .send()
            .await
            .map_err(unavailable)?;
        if !resp.status().is_success() {
            let status = resp.status();
            return Err(self.err(
                RemoteKind::Unauthenticated,
                format!("token service refused the identity token: {status}"),
            ));
        }
        #[derive(serde::Deserialize)]
        struct TokenResponse {
            access_token: Option<String>,
            token: Option<String>,
        }
        let body: TokenResponse = resp.json().await.map_err(|e| {
            self.err(
                RemoteKind::Unauthenticated,
                format!("bad token response: {e}"),
            )
        })?;
        body.access_token.or(body.token).ok_or_else(|| {
            self.err(
                RemoteKind::Unauthenticated,
                "token response has no token".into(),
            )
        })
    }
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
            let oref = ep.oci_ref(&self.reference, digest);
            match ep
                .client
                .pull_manifest_raw(&oref, &auth, MANIFEST_MEDIA_TYPES)
                .await
            {
                Ok((bytes, d)) => {
                    let computed = Digest::of(&bytes);
                    let expected = digest.or(self.reference.digest.as_ref());
                    if let Some(want) = expected
                        && *want != computed
                    {
                        errors.push(ep.err(
                            RemoteKind::Corrupt,
                            format!("manifest hashes to {computed}, expected {want}"),
                        ));
                        continue;
                    }
                    if d != computed.as_str() {
                        tracing::debug!(endpoint = %ep.endpoint, header = %d, %computed, "registry digest header differs from content");
                    }
                    self.preferred.store(i, Ordering::Relaxed);
                    return Ok(FetchedManifest {
                        bytes,
                        digest: computed,
                    });
                }
                Err(e) => errors.push(ep.oci_err(e)),
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
            let auth = ep.ensure_auth(&self.reference).await;
            if let Err(e) = auth {
                errors.push(e);
                continue;
            }
            let oref = ep.oci_ref(&self.reference, None);
            // Always a range request (bytes=0- for a fresh download): the body is hashed once, by
            // the ingest, rather than also by the client's verifying stream.
            let result = ep
                .client
                .pull_blob_stream_partial(&oref, digest.as_str(), offset, None)
                .await
                .map(|r| match r {
                    oci_client::client::BlobResponse::Full(s) => (false, s),
                    oci_client::client::BlobResponse::Partial(s) => (true, s),
                });
            match result {
                Ok((resumed, s)) => {
                    self.preferred.store(i, Ordering::Relaxed);
                    return Ok(BlobBody {
                        resumed,
                        stream: s.stream,
                        endpoint: ep.endpoint.to_string(),
                    });
                }
                Err(e) => errors.push(ep.oci_err(e)),
            }
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
        } else if errors
            .iter()
            .all(|e| matches!(e.kind, RemoteKind::Corrupt | RemoteKind::NotFound))
        {
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

//! Registry credentials: the CRI's forms of them ([`Credentials`]), which hosts they may reach,
//! and the part of authentication minicri does itself before `oci-client` takes over.
//!
//! `oci-client` performs the distribution auth handshake (ping, challenge, token request) and
//! sends whatever `RegistryAuth` it is given to whatever token realm the registry's challenge
//! names, over whatever scheme the realm says. So what it is given is decided here, once per
//! session and endpoint ([`EndpointCreds::decide`]):
//! - credentials apply only to the endpoints they were given for (the CRI's `server_address`,
//!   or any endpoint of the image's registry when it is empty);
//! - no credential (basic, identity token, registry token) is used over plain http unless the
//!   endpoint is a loopback IP literal ([`is_loopback_ip`]); such an endpoint is asked
//!   anonymously;
//! - before basic credentials or an identity token are used, the endpoint is pinged with this
//!   module's own HTTP client and a bearer challenge's realm is checked with
//!   [`realm_may_get_credentials`]: a realm on another site, or over plain http (except to a
//!   loopback IP literal), gets an anonymous token request instead;
//! - an identity token (an OAuth2 refresh token, which `oci-client` does not support) is
//!   exchanged for an access token here, the response read within [`MAX_TOKEN_BYTES`].
//!
//! This module's HTTP client (pings and the identity-token exchange) refuses redirects from https
//! down to plain http. What stays out of reach (`oci-client`'s own second ping, its token
//! requests and redirects) is written down in docs/hardening.md.

use std::time::Duration;

use base64::Engine as _;
use oci_client::secrets::RegistryAuth;
use reqwest::header;

use super::RemoteKind;
use crate::hosts::{Endpoint, is_loopback_ip};

/// Largest token response read by minicri's own identity-token exchange: 1 MiB (tokens are JWTs
/// of a few KiB). `oci-client`'s own token requests are not bounded this way
/// (docs/hardening.md).
pub const MAX_TOKEN_BYTES: u64 = 1 << 20;
/// Redirects followed per request by minicri's own client.
const MAX_REDIRECTS: usize = 10;

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
    pub(super) fn basic(&self) -> Result<Option<(String, String)>, String> {
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

/// May credentials for the hosts `allowed` be sent to the token realm `realm`? Only over https
/// (or plain http to a loopback IP literal), and only to one of those hosts or to a host of the
/// same site: the parent domain of an allowed host (at least two labels) or a subdomain of it,
/// as Docker Hub's `registry-1.docker.io` and `auth.docker.io` or GitLab's `registry.gitlab.com`
/// and `gitlab.com` are. Without a public-suffix list, a registry directly under a two-label
/// public suffix (`x.co.uk`) counts its suffix's other domains as its site: a limit written down
/// in docs/hardening.md.
pub fn realm_may_get_credentials(realm: &str, allowed: &[String]) -> bool {
    let Ok(url) = reqwest::Url::parse(realm) else {
        return false;
    };
    let Some(host) = url.host_str().map(str::to_ascii_lowercase) else {
        return false;
    };
    match url.scheme() {
        "https" => {}
        "http" if is_loopback_ip(&host) => {}
        _ => return false,
    }
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let is_ip = host.parse::<std::net::IpAddr>().is_ok();
    allowed.iter().map(|a| bare_host(a)).any(|a| {
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

/// `host[:port]` or `[v6][:port]` without the port and brackets, lower-case.
fn bare_host(h: &str) -> String {
    let h = match h.strip_prefix('[') {
        Some(rest) => rest.split_once(']').map_or(rest, |(ip6, _)| ip6),
        None => h.rsplit_once(':').map_or(h, |(name, _)| name),
    };
    h.to_ascii_lowercase()
}

/// `(realm, service)` of a `Bearer realm="…",service="…"` challenge.
pub(super) fn parse_bearer_challenge(h: &str) -> Option<(String, Option<String>)> {
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

/// Follows redirects, but never from https down to plain http (except to a loopback IP literal):
/// that would hand the request, and a refresh token in its body, to whoever is on the path.
pub(super) fn redirect_policy() -> reqwest::redirect::Policy {
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

/// Reads a response body up to `max` bytes, failing as soon as it goes past: never buffered
/// beyond the limit, whatever Content-Length says (or whether it says anything).
pub(super) async fn read_capped(
    mut resp: reqwest::Response,
    max: u64,
) -> Result<Vec<u8>, (RemoteKind, String)> {
    let too_large = |n: u64| {
        (
            RemoteKind::TooLarge,
            format!("{n} bytes or more exceeds the limit of {max} bytes"),
        )
    };
    if let Some(len) = resp.content_length()
        && len > max
    {
        return Err(too_large(len));
    }
    let mut out = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| (RemoteKind::Unavailable, super::describe(&e)))?
    {
        let n = out.len() as u64 + chunk.len() as u64;
        if n > max {
            return Err(too_large(n));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

/// What the requester's credentials offer at one endpoint, strongest first.
enum Offered {
    /// An OAuth2 refresh token, exchanged here for an access token.
    IdentityToken(String),
    /// A registry token sent to the endpoint as is.
    RegistryToken(String),
    Basic(String, String),
    None,
}

/// The credentials of one session at one endpoint, before the endpoint has been asked anything.
pub(super) struct EndpointCreds {
    offered: Offered,
    /// The hosts the credentials were given for: the registry and its configured endpoints.
    cred_hosts: Vec<String>,
    /// Why the credentials are not used at all here (plain http to a host that is not a
    /// loopback IP literal).
    withheld: Option<String>,
}

/// What one endpoint session hands `oci-client`.
pub(super) struct Decision {
    pub auth: RegistryAuth,
    /// sha256 of what an `oci-client` client holding this decision may send: clients are cached
    /// under it, so a client that was given credentials is never reused by a session whose
    /// decision was to withhold them (the client would re-authenticate with them on its own when
    /// its token expires).
    pub fingerprint: [u8; 32],
    /// Why the credentials were not used, for the error if the endpoint then refuses.
    pub withheld: Option<String>,
}

impl EndpointCreds {
    /// What `creds` offer at `endpoint` of `registry`; `cred_hosts` are the hosts they were given
    /// for.
    pub(super) fn new(
        creds: &Credentials,
        basic: &Option<(String, String)>,
        endpoint: &Endpoint,
        registry: &str,
        cred_hosts: Vec<String>,
    ) -> EndpointCreds {
        let offered = if !creds.applies_to(endpoint, registry) {
            Offered::None
        } else if !creds.identity_token.is_empty() {
            Offered::IdentityToken(creds.identity_token.clone())
        } else if !creds.registry_token.is_empty() {
            Offered::RegistryToken(creds.registry_token.clone())
        } else if let Some((u, p)) = basic {
            Offered::Basic(u.clone(), p.clone())
        } else {
            Offered::None
        };
        let withheld = (!matches!(offered, Offered::None)
            && endpoint.plain_http
            && !is_loopback_ip(&endpoint.host))
        .then(|| {
            format!(
                "credentials withheld: they are not sent over plain http to {}, which is not a \
                 loopback IP address",
                endpoint.host
            )
        });
        EndpointCreds {
            offered,
            cred_hosts,
            withheld,
        }
    }

    /// Whether [`EndpointCreds::decide`] will talk to the endpoint itself (and so needs a client).
    pub(super) fn needs_probe(&self) -> bool {
        self.withheld.is_none()
            && matches!(self.offered, Offered::IdentityToken(_) | Offered::Basic(..))
    }

    /// Decides what `oci-client` gets for pulling `repository` from `endpoint`: pings the
    /// endpoint with `probe` when the credentials could go to a token realm, checks the realm,
    /// and exchanges an identity token. The caller bounds the time this takes.
    pub(super) async fn decide(
        &self,
        probe: Option<&reqwest::Client>,
        endpoint: &Endpoint,
        repository: &str,
    ) -> Result<Decision, (RemoteKind, String)> {
        let anonymous = |withheld: Option<String>| Decision {
            auth: RegistryAuth::Anonymous,
            fingerprint: fingerprint(&[b"anonymous"]),
            withheld,
        };
        if let Some(why) = &self.withheld {
            return Ok(anonymous(Some(why.clone())));
        }
        let probe = match (&self.offered, probe) {
            (Offered::None, _) => return Ok(anonymous(None)),
            (Offered::RegistryToken(t), _) => {
                return Ok(Decision {
                    auth: RegistryAuth::Bearer(t.clone()),
                    fingerprint: fingerprint(&[b"bearer", t.as_bytes()]),
                    withheld: None,
                });
            }
            (_, Some(p)) => p,
            (_, None) => unreachable!("sessions with basic or identity credentials have a probe"),
        };
        let challenge = bearer_challenge(probe, endpoint).await?;
        if let Some((realm, _)) = &challenge
            && !realm_may_get_credentials(realm, &self.cred_hosts)
        {
            tracing::warn!(%endpoint, realm, "token realm is not a host the credentials were given for (or is plain http); asking it for an anonymous token");
            return Ok(anonymous(Some(format!(
                "credentials withheld: the token realm {realm} is not a host they were given for, \
                 or not https"
            ))));
        }
        match (&self.offered, challenge) {
            (Offered::Basic(u, p), _) => Ok(Decision {
                auth: RegistryAuth::Basic(u.clone(), p.clone()),
                fingerprint: fingerprint(&[b"basic", u.as_bytes(), p.as_bytes()]),
                withheld: None,
            }),
            (Offered::IdentityToken(t), Some((realm, service))) => {
                let scope = format!("repository:{repository}:pull");
                let access =
                    exchange_identity_token(probe, &realm, service.as_deref(), t, &scope).await?;
                Ok(Decision {
                    auth: RegistryAuth::Bearer(access),
                    // The refresh token, not the access token: one client per identity, reused.
                    fingerprint: fingerprint(&[b"identity", t.as_bytes()]),
                    withheld: None,
                })
            }
            (Offered::IdentityToken(_), None) => Err((
                RemoteKind::Unauthenticated,
                "identity token given but the registry does not offer bearer-token auth".into(),
            )),
            (Offered::RegistryToken(_) | Offered::None, _) => unreachable!("returned above"),
        }
    }
}

fn fingerprint(parts: &[&[u8]]) -> [u8; 32] {
    use sha2::Digest as _;
    let mut h = sha2::Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    h.finalize().into()
}

/// Pings `endpoint`'s `/v2/` and returns its bearer challenge, if it answers with one. The body
/// is not read.
async fn bearer_challenge(
    probe: &reqwest::Client,
    endpoint: &Endpoint,
) -> Result<Option<(String, Option<String>)>, (RemoteKind, String)> {
    let scheme = if endpoint.plain_http { "http" } else { "https" };
    let ping = probe
        .get(format!("{scheme}://{}/v2/", endpoint.host))
        .send()
        .await
        .map_err(|e| (RemoteKind::Unavailable, super::describe(&e)))?;
    if ping.status() != reqwest::StatusCode::UNAUTHORIZED {
        return Ok(None);
    }
    Ok(ping
        .headers()
        .get(header::WWW_AUTHENTICATE)
        .and_then(|h| h.to_str().ok())
        .and_then(parse_bearer_challenge))
}

/// OAuth2 refresh-token grant: the identity token buys an access token from `realm`.
async fn exchange_identity_token(
    probe: &reqwest::Client,
    realm: &str,
    service: Option<&str>,
    token: &str,
    scope: &str,
) -> Result<String, (RemoteKind, String)> {
    let mut form = vec![
        ("grant_type", "refresh_token"),
        ("refresh_token", token),
        ("client_id", "minicri"),
        ("scope", scope),
    ];
    if let Some(s) = service {
        form.push(("service", s));
    }
    let resp = probe
        .post(realm)
        .form(&form)
        .send()
        .await
        .map_err(|e| (RemoteKind::Unavailable, super::describe(&e)))?;
    if !resp.status().is_success() {
        return Err((
            RemoteKind::Unauthenticated,
            format!(
                "token service {realm} refused the identity token: {}",
                resp.status()
            ),
        ));
    }
    let body = read_capped(resp, MAX_TOKEN_BYTES)
        .await
        .map_err(|(kind, m)| (kind, format!("token response from {realm}: {m}")))?;
    #[derive(serde::Deserialize)]
    struct TokenResponse {
        access_token: Option<String>,
        token: Option<String>,
    }
    let parsed: TokenResponse = serde_json::from_slice(&body).map_err(|e| {
        (
            RemoteKind::Unauthenticated,
            format!("bad token response: {e}"),
        )
    })?;
    parsed
        .access_token
        .or(parsed.token)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| {
            (
                RemoteKind::Unauthenticated,
                "token response has no token".into(),
            )
        })
}

/// The timeouts of minicri's own client; the same as the `oci-client` clients'.
pub(super) struct ProbeTimeouts {
    pub connect: Duration,
    pub read: Duration,
}

/// minicri's own HTTP client for `endpoint`'s TLS settings: pings and identity-token exchanges.
pub(super) fn probe_client(
    endpoint: &Endpoint,
    certs: Vec<reqwest::Certificate>,
    timeouts: &ProbeTimeouts,
) -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .danger_accept_invalid_certs(endpoint.skip_verify)
        .tls_certs_merge(certs)
        .connect_timeout(timeouts.connect)
        .read_timeout(timeouts.read)
        .redirect(redirect_policy())
        .user_agent(concat!("minicri/", env!("CARGO_PKG_VERSION")))
        .build()
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

    #[test]
    fn credentials_over_plain_http_only_to_loopback_ips() {
        let creds = Credentials {
            username: "u".into(),
            password: "p".into(),
            ..Default::default()
        };
        let basic = creds.basic().unwrap();
        let at = |host: &str, plain_http: bool| {
            let ep = Endpoint {
                host: host.into(),
                plain_http,
                resolve: true,
                pull: true,
                skip_verify: false,
                ca: vec![],
                mirror: false,
                path_prefix: String::new(),
                dial_timeout: None,
            };
            EndpointCreds::new(&creds, &basic, &ep, host, vec![host.into()])
        };
        for (host, plain) in [
            ("127.0.0.1:5000", true),
            ("[::1]:5000", true),
            ("localhost:5000", false),
            ("registry.example", false),
        ] {
            let c = at(host, plain);
            assert!(c.withheld.is_none() && c.needs_probe(), "{host}");
        }
        for host in ["localhost:5000", "127.evil.example", "registry.example"] {
            let c = at(host, true);
            assert!(c.withheld.is_some() && !c.needs_probe(), "{host}");
        }
    }
}

//! Registry credentials: the CRI's forms of them ([`Credentials`]), which hosts they may reach,
//! and the answer to a registry's `401` challenge ([`EndpointCreds::answer`]).
//!
//! Authentication is driven by the registry: a request goes out with whatever authorization the
//! endpoint session holds (none at first, or the CRI's registry token); a `401` names a scheme,
//! and for bearer tokens a realm, which this module answers:
//! - credentials apply only to the endpoints they were given for (the CRI's `server_address`,
//!   or any endpoint of the image's registry when it is empty);
//! - no credential (basic, identity token, registry token) is used over plain http unless the
//!   endpoint is a loopback IP literal ([`is_loopback_ip`]); such an endpoint is asked
//!   anonymously;
//! - a bearer realm gets basic credentials or the identity token only if
//!   [`realm_may_get_credentials`] allows it (https, and a host of the same site); any other
//!   realm is asked for an anonymous token;
//! - an identity token (an OAuth2 refresh token) is exchanged for an access token with a POST
//!   (never followed through a redirect); basic credentials buy a token with a GET;
//! - token responses are read within [`MAX_TOKEN_BYTES`], and the endpoint's hosts.toml headers
//!   go with a token request only when the realm is on the endpoint's own origin;
//! - a realm is asked only where a redirect could go: not down to plain http from https
//!   ([`realm_may_be_asked`]), and on the node itself only where `dest` allows.

use base64::Engine as _;
use reqwest::Url;
use reqwest::header::{self, HeaderMap, HeaderValue};

use super::RemoteKind;
use super::dest::{self, Trusted};
use super::http::{self, Request};
use crate::hosts::{Endpoint, is_loopback_ip};

/// Largest token response read: 1 MiB (tokens are JWTs of a few KiB).
pub const MAX_TOKEN_BYTES: u64 = 1 << 20;

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

/// Whether a token realm (its caller has checked it is http or https) may be asked, for a
/// registry reached at `endpoint` by a session trusting `trusted`: over https, or over plain
/// http only when the registry itself is (the operator said `http://`, or it is a loopback IP
/// literal) or the realm is a loopback IP literal the session trusts. The rule of redirects
/// (`http::is_downgrade`): a registry reached over https cannot send the daemon to a plain-http
/// address. Before that, a realm on the node must be one the session trusts ([`dest::route`]:
/// the address says more about why than the scheme does).
pub fn realm_may_be_asked(realm: &Url, endpoint: &Url, trusted: &Trusted) -> Result<(), String> {
    dest::route(realm, trusted).map_err(|r| format!("refusing the token realm {realm}: {r}"))?;
    if http::is_downgrade(endpoint, realm, trusted) {
        return Err(format!(
            "refusing the token realm {realm}: plain http, for a registry reached over https"
        ));
    }
    Ok(())
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

/// One challenge of a `WWW-Authenticate` header: its scheme and parameter names (lower-case),
/// and the parameters' values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Challenge {
    pub scheme: String,
    pub params: Vec<(String, String)>,
}

impl Challenge {
    /// The value of parameter `name` (lower-case), the first if it is given twice.
    pub fn param(&self, name: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The challenges of `WWW-Authenticate` header values (RFC 7235: `scheme k=v, k="quoted, v"`,
/// several challenges in one value or in several values). Anything unparseable is skipped.
pub fn parse_challenges<'a>(values: impl IntoIterator<Item = &'a str>) -> Vec<Challenge> {
    let mut out: Vec<Challenge> = Vec::new();
    for value in values {
        let mut rest = value.trim();
        while !rest.is_empty() {
            rest = rest.trim_start_matches([',', ' ', '\t']);
            let token_end = rest.find([' ', '=', ',', '\t']).unwrap_or(rest.len());
            let token = &rest[..token_end];
            let after = rest[token_end..].trim_start_matches([' ', '\t']);
            if token.is_empty() {
                break;
            }
            if let Some(v) = after.strip_prefix('=') {
                // A parameter of the current challenge.
                let (val, tail) = parse_value(v.trim_start());
                if let Some(c) = out.last_mut() {
                    c.params.push((token.to_ascii_lowercase(), val));
                }
                rest = tail;
            } else {
                out.push(Challenge {
                    scheme: token.to_ascii_lowercase(),
                    params: Vec::new(),
                });
                rest = after;
            }
        }
    }
    out
}

/// A parameter value (token or quoted string) and what follows it.
fn parse_value(s: &str) -> (String, &str) {
    if let Some(q) = s.strip_prefix('"') {
        let mut val = String::new();
        let mut chars = q.char_indices();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        val.push(n);
                    }
                }
                '"' => return (val, &q[i + 1..]),
                c => val.push(c),
            }
        }
        (val, "")
    } else {
        let end = s.find([',', ' ', '\t']).unwrap_or(s.len());
        (s[..end].to_string(), &s[end..])
    }
}

/// What the requester's credentials offer at one endpoint, strongest first.
enum Offered {
    /// An OAuth2 refresh token, exchanged for an access token at the token realm.
    IdentityToken(String),
    /// A registry token sent to the endpoint as is.
    RegistryToken(String),
    Basic(String, String),
    None,
}

/// The credentials of one session at one endpoint.
pub(super) struct EndpointCreds {
    offered: Offered,
    /// The hosts the credentials were given for: the registry and its configured endpoints.
    cred_hosts: Vec<String>,
    /// Why the credentials are not used at all here (plain http to a host that is not a
    /// loopback IP literal).
    withheld: Option<String>,
}

/// The authorization answering a challenge.
pub(super) struct Answer {
    pub header: HeaderValue,
    /// Why the credentials were not used, for the error if the endpoint then refuses.
    pub withheld: Option<String>,
}

type AuthResult<T> = Result<T, (RemoteKind, String)>;

fn unauthenticated(message: impl Into<String>) -> (RemoteKind, String) {
    (RemoteKind::Unauthenticated, message.into())
}

fn header_value(v: String) -> AuthResult<HeaderValue> {
    HeaderValue::from_str(&v).map_err(|_| unauthenticated("the token is not a valid header value"))
}

fn basic_header(user: &str, password: &str) -> AuthResult<HeaderValue> {
    let raw = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    let mut v = header_value(format!("Basic {raw}"))?;
    v.set_sensitive(true);
    Ok(v)
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
        let offered = if withheld.is_some() {
            Offered::None
        } else {
            offered
        };
        EndpointCreds {
            offered,
            cred_hosts,
            withheld,
        }
    }

    /// Why the credentials are not used at this endpoint at all, if they are not.
    pub(super) fn withheld(&self) -> Option<&str> {
        self.withheld.as_deref()
    }

    /// The authorization sent before any challenge: a registry token, as the CRI gave it.
    pub(super) fn initial(&self) -> Option<HeaderValue> {
        match &self.offered {
            Offered::RegistryToken(t) => header_value(format!("Bearer {t}")).ok().map(|mut v| {
                v.set_sensitive(true);
                v
            }),
            _ => None,
        }
    }

    /// Answers the challenges of a `401` from `endpoint` for `repository` (the name the
    /// endpoint serves it under): the `Authorization` to retry with. `headers` are the
    /// endpoint's hosts.toml headers, sent to a realm on the endpoint's own origin. The caller
    /// bounds the time this takes.
    pub(super) async fn answer(
        &self,
        net: &http::Net,
        endpoint_url: &Url,
        headers: &HeaderMap,
        challenges: &[Challenge],
        repository: &str,
    ) -> AuthResult<Answer> {
        let withheld = self.withheld.clone();
        if let Offered::RegistryToken(_) = self.offered {
            return Err(unauthenticated("the registry token was refused"));
        }
        if let Some(bearer) = challenges.iter().find(|c| c.scheme == "bearer") {
            let realm = bearer
                .param("realm")
                .ok_or_else(|| unauthenticated("bearer challenge without a realm"))?;
            let realm_url = Url::parse(realm)
                .ok()
                .filter(|u| matches!(u.scheme(), "http" | "https"))
                .ok_or_else(|| unauthenticated(format!("bad token realm {realm:?}")))?;
            realm_may_be_asked(&realm_url, endpoint_url, &net.trusted)
                .map_err(|m| (RemoteKind::Refused, m))?;
            let (offered, withheld) = if matches!(self.offered, Offered::None)
                || realm_may_get_credentials(realm, &self.cred_hosts)
            {
                (&self.offered, withheld)
            } else {
                tracing::warn!(endpoint = %endpoint_url, realm, "token realm is not a host the credentials were given for (or is plain http); asking it for an anonymous token");
                let why = format!(
                    "credentials withheld: the token realm {realm} is not a host they were given \
                     for, or not https"
                );
                (&Offered::None, Some(why))
            };
            let scope = bearer
                .param("scope")
                .map(str::to_string)
                .unwrap_or_else(|| format!("repository:{repository}:pull"));
            let token = fetch_token(
                net,
                realm_url,
                headers,
                endpoint_url,
                bearer.param("service"),
                &scope,
                offered,
            )
            .await?;
            let mut header = header_value(format!("Bearer {token}"))?;
            header.set_sensitive(true);
            return Ok(Answer { header, withheld });
        }
        if challenges.iter().any(|c| c.scheme == "basic") {
            return match &self.offered {
                Offered::Basic(u, p) => Ok(Answer {
                    header: basic_header(u, p)?,
                    withheld,
                }),
                Offered::IdentityToken(_) => Err(unauthenticated(
                    "identity token given but the registry asks for basic auth",
                )),
                _ => Err(unauthenticated(match withheld {
                    Some(why) => format!("the registry asks for basic auth ({why})"),
                    None => "the registry asks for basic auth and no credentials were given".into(),
                })),
            };
        }
        Err(unauthenticated(
            "unauthorized, with no bearer or basic challenge to answer",
        ))
    }
}

/// Gets a bearer token from `realm` for `scope`: with the identity token (an OAuth2 refresh
/// grant, POST), with basic credentials (GET), or anonymously (GET).
async fn fetch_token(
    net: &http::Net,
    realm: Url,
    endpoint_headers: &HeaderMap,
    endpoint_url: &Url,
    service: Option<&str>,
    scope: &str,
    offered: &Offered,
) -> AuthResult<String> {
    // A GET names the service and scope in its query; the refresh grant (POST) in its form.
    let mut url = realm.clone();
    if !matches!(offered, Offered::IdentityToken(_)) {
        let mut q = url.query_pairs_mut();
        if let Some(s) = service {
            q.append_pair("service", s);
        }
        q.append_pair("scope", scope);
    }
    let mut req = Request::get(url);
    req.first_hop = "the token realm";
    if http::same_origin(&realm, endpoint_url) {
        req.scoped = endpoint_headers.clone();
    }
    match offered {
        Offered::IdentityToken(t) => {
            let mut form = vec![
                ("grant_type".to_string(), "refresh_token".to_string()),
                ("refresh_token".to_string(), t.clone()),
                ("client_id".to_string(), "minicri".to_string()),
                ("scope".to_string(), scope.to_string()),
            ];
            if let Some(s) = service {
                form.push(("service".into(), s.into()));
            }
            req.method = reqwest::Method::POST;
            req.form = Some(form);
        }
        Offered::Basic(u, p) => {
            req.scoped
                .insert(header::AUTHORIZATION, basic_header(u, p)?);
        }
        Offered::None | Offered::RegistryToken(_) => {}
    }
    let resp = http::send(net, req)
        .await
        .map_err(|(kind, m)| (kind, format!("token request: {m}")))?;
    if !resp.status().is_success() {
        let (kind, message) = http::error_of(resp).await;
        let kind = match kind {
            RemoteKind::NotFound => RemoteKind::Unauthenticated,
            k => k,
        };
        return Err((kind, format!("token service refused: {message}")));
    }
    let body = http::read_capped(resp, MAX_TOKEN_BYTES)
        .await
        .map_err(|(kind, m)| (kind, format!("token response from {realm}: {m}")))?;
    #[derive(serde::Deserialize)]
    struct TokenResponse {
        access_token: Option<String>,
        token: Option<String>,
    }
    let parsed: TokenResponse = serde_json::from_slice(&body)
        .map_err(|e| unauthenticated(format!("bad token response from {realm}: {e}")))?;
    parsed
        .access_token
        .filter(|t| !t.is_empty())
        .or(parsed.token)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| unauthenticated(format!("token response from {realm} has no token")))
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
    fn parses_challenges() {
        let c = parse_challenges([
            r#"Bearer realm="http://127.0.0.1:1/token",service="reg",scope="repository:a/b:pull,push""#,
        ]);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].scheme, "bearer");
        assert_eq!(c[0].param("realm"), Some("http://127.0.0.1:1/token"));
        assert_eq!(c[0].param("service"), Some("reg"));
        assert_eq!(c[0].param("scope"), Some("repository:a/b:pull,push"));
        // Several challenges in one value and across values; escapes; token values.
        let c = parse_challenges([
            r#"Basic realm="a \"q\" b", Bearer realm=https://t.example/x,service=s"#,
            "Negotiate",
        ]);
        let schemes: Vec<&str> = c.iter().map(|c| c.scheme.as_str()).collect();
        assert_eq!(schemes, ["basic", "bearer", "negotiate"]);
        assert_eq!(c[0].param("realm"), Some(r#"a "q" b"#));
        assert_eq!(c[1].param("realm"), Some("https://t.example/x"));
        assert_eq!(c[1].param("service"), Some("s"));
        // Garbage parses to something or nothing, never panics.
        for junk in [
            "",
            "=",
            "==,,",
            "Bearer realm=\"unterminated",
            "\"x\"=y",
            ", ,",
        ] {
            let _ = parse_challenges([junk]);
        }
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
                ..crate::hosts::default_endpoint(host)
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
            assert!(c.withheld.is_none(), "{host}");
            assert!(matches!(c.offered, Offered::Basic(..)), "{host}");
        }
        for host in ["localhost:5000", "127.evil.example", "registry.example"] {
            let c = at(host, true);
            assert!(c.withheld.is_some(), "{host}");
            assert!(matches!(c.offered, Offered::None), "{host}");
        }
    }
}

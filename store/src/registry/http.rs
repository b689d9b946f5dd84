//! The HTTP layer of the registry client: one `reqwest` client per endpoint's TLS settings
//! (extra CAs, client certificate, `skip_verify`, dial timeout), and requests sent through it
//! with redirects followed here rather than by `reqwest`, so that what a request carries is
//! decided per hop:
//! - the endpoint's `Authorization` and its hosts.toml `header`s go only to the endpoint's own
//!   origin (scheme, host and port), never to where a redirect points (a blob store's signed
//!   URL, or anyone a registry names);
//! - every hop (a token realm, each redirect) goes where [`dest`] allows: a destination on the
//!   node itself only when the session trusts it, any other through a client whose resolver
//!   drops the node's addresses;
//! - a redirect from https down to plain http is refused, except to a loopback IP literal the
//!   session trusts ([`dest::Trusted::allows_plain_http_to`]);
//! - at most [`MAX_REDIRECTS`] hops; only GET requests are redirected.
//!
//! Bodies the client buffers (manifests, tokens, error bodies) are read with [`read_capped`],
//! which stops at a limit whatever the response says about its length. An error response is
//! reported by [`error_of`] as its status and a short excerpt of its body ([`super::excerpt`]): the
//! message reaches the pod's events, which whoever owns the pod reads.

use std::sync::Arc;
use std::time::Duration;

use reqwest::header::{self, HeaderMap};
use reqwest::{Method, StatusCode, Url};

use super::RemoteKind;
use super::dest::{self, Route};
use crate::hosts::Endpoint;

/// Redirects followed per request.
pub(super) const MAX_REDIRECTS: usize = 10;
/// Most bytes of an error response read (for its error codes and message).
pub(super) const MAX_ERROR_BODY_BYTES: u64 = 64 << 10;

/// The TLS material of one endpoint, read from the files hosts.toml names.
pub(super) struct Tls {
    /// Extra CA certificates (PEM).
    pub ca: Vec<Vec<u8>>,
    /// The client certificate and its key (PEM), for mutual TLS.
    pub identity: Option<Vec<u8>>,
}

impl Tls {
    /// sha256 of everything here, each part length-prefixed.
    pub fn fingerprint(&self) -> [u8; 32] {
        use sha2::Digest as _;
        let mut h = sha2::Sha256::new();
        for part in self.ca.iter().chain(self.identity.iter()) {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part);
        }
        h.update([self.identity.is_some() as u8]);
        h.finalize().into()
    }
}

/// Timeouts of every client.
pub(super) struct Timeouts {
    pub connect: Duration,
    pub read: Duration,
}

/// A client for `endpoint`'s TLS settings. It follows no redirects itself ([`send`] does).
/// A `guarded` one resolves names with [`dest::GuardedResolver`].
pub(super) fn client(
    endpoint: &Endpoint,
    tls: &Tls,
    timeouts: &Timeouts,
    guarded: bool,
) -> reqwest::Result<reqwest::Client> {
    let certs = tls
        .ca
        .iter()
        .map(|pem| reqwest::Certificate::from_pem(pem))
        .collect::<reqwest::Result<Vec<_>>>()?;
    let mut builder = reqwest::Client::builder()
        .danger_accept_invalid_certs(endpoint.skip_verify)
        .tls_certs_merge(certs)
        .connect_timeout(endpoint.dial_timeout.unwrap_or(timeouts.connect))
        .read_timeout(timeouts.read)
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("minicri/", env!("CARGO_PKG_VERSION")));
    if let Some(pem) = &tls.identity {
        builder = builder.identity(reqwest::Identity::from_pem(pem)?);
    }
    if guarded {
        builder = builder.dns_resolver(dest::GuardedResolver);
    }
    builder.build()
}

/// How one endpoint session reaches the network: a client per [`Route`] (both with the
/// endpoint's TLS settings) and the destinations the session trusts.
#[derive(Clone)]
pub(super) struct Net {
    pub direct: reqwest::Client,
    pub guarded: reqwest::Client,
    pub trusted: Arc<dest::Trusted>,
}

/// One request to send: `scoped` headers go only to `origin`'s scheme, host and port; `always`
/// headers (Accept, Range) go with every hop.
pub(super) struct Request {
    pub method: Method,
    pub url: Url,
    pub always: HeaderMap,
    pub scoped: HeaderMap,
    /// A form body (POST).
    pub form: Option<Vec<(String, String)>>,
    /// What the first hop is, for a refusal's message ("refusing the token realm URL: ...").
    pub first_hop: &'static str,
}

impl Request {
    pub fn get(url: Url) -> Request {
        Request {
            method: Method::GET,
            url,
            always: HeaderMap::new(),
            scoped: HeaderMap::new(),
            form: None,
            first_hop: "the request to",
        }
    }
}

/// Whether going from `from` to `to` drops from https to plain http, to anything but a loopback
/// IP literal `trusted` allows: refused for redirects and token realms alike.
pub(super) fn is_downgrade(from: &Url, to: &Url, trusted: &dest::Trusted) -> bool {
    to.scheme() == "http" && from.scheme() == "https" && !trusted.allows_plain_http_to(to)
}

/// The [`dest::Refused`] among the causes of a request error: the guarded resolver's answer.
fn refused_in<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a dest::Refused> {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if let Some(r) = c.downcast_ref::<dest::Refused>() {
            return Some(r);
        }
        cause = c.source();
    }
    None
}

/// Whether `a` and `b` share scheme, host and port.
pub(super) fn same_origin(a: &Url, b: &Url) -> bool {
    a.scheme() == b.scheme()
        && a.host_str() == b.host_str()
        && a.port_or_known_default() == b.port_or_known_default()
}

/// Sends `req` through `net`, following redirects as the module says.
pub(super) async fn send(
    net: &Net,
    req: Request,
) -> Result<reqwest::Response, (RemoteKind, String)> {
    let origin = req.url.clone();
    let mut url = req.url.clone();
    // Where the current hop came from, for a redirect (a refusal names it).
    let mut from: Option<Url> = None;
    for _ in 0..=MAX_REDIRECTS {
        let refusal = |why: &dyn std::fmt::Display| {
            let (at, what) = match &from {
                Some(f) => (format!("GET {f}: "), "the redirect to"),
                None => (String::new(), req.first_hop),
            };
            (
                RemoteKind::Refused,
                format!("{at}refusing {what} {url}: {why}"),
            )
        };
        let client = match hop_route(from.as_ref(), &url, &net.trusted) {
            Ok(Route::Direct) => &net.direct,
            Ok(Route::Guarded) => &net.guarded,
            Err(why) => return Err(refusal(&why)),
        };
        let mut headers = req.always.clone();
        if same_origin(&url, &origin) {
            for (name, value) in &req.scoped {
                headers.append(name.clone(), value.clone());
            }
        }
        let mut builder = client
            .request(req.method.clone(), url.clone())
            .headers(headers);
        if let Some(form) = &req.form {
            builder = builder.form(form);
        }
        let resp = builder.send().await.map_err(|e| {
            if let Some(r) = refused_in(&e) {
                return refusal(&r);
            }
            let mut message = format!("{} {url}: {}", req.method, super::describe(&e));
            // The alerts a server sends when it wants a client certificate it did not get.
            if ["BadCertificate", "CertificateRequired"]
                .iter()
                .any(|alert| message.contains(alert))
            {
                message.push_str(
                    " (the host refused the TLS handshake over the client certificate: see \
                     `client` in its hosts.toml)",
                );
            }
            (RemoteKind::Unavailable, message)
        })?;
        if !resp.status().is_redirection() || req.method != Method::GET {
            return Ok(resp);
        }
        let Some(location) = resp.headers().get(header::LOCATION) else {
            return Ok(resp);
        };
        let next = next_hop(&url, location.to_str().unwrap_or(""))?;
        from = Some(std::mem::replace(&mut url, next));
    }
    Err((
        RemoteKind::Unavailable,
        format!("GET {origin}: more than {MAX_REDIRECTS} redirects"),
    ))
}

/// How the hop to `url` goes out ([`dest::route`]), coming from `from` for a redirect, or why
/// it may not: on the node where the session does not trust it, or down from https to plain
/// http (a token realm's scheme is checked by `auth::realm_may_be_asked`).
fn hop_route(
    from: Option<&Url>,
    url: &Url,
    trusted: &dest::Trusted,
) -> Result<Route, Box<dyn std::fmt::Display>> {
    let route = dest::route(url, trusted).map_err(|r| Box::new(r) as _)?;
    if from.is_some_and(|from| is_downgrade(from, url, trusted)) {
        return Err(Box::new("it goes from https down to plain http"));
    }
    Ok(route)
}

/// Where a redirect from `url` to `location` goes, unless it is not an http(s) URL (where it
/// may go is [`hop_route`]'s to say).
fn next_hop(url: &Url, location: &str) -> Result<Url, (RemoteKind, String)> {
    let next = url.join(location).map_err(|_| {
        (
            RemoteKind::Unavailable,
            format!("GET {url}: redirect to an invalid location"),
        )
    })?;
    if !matches!(next.scheme(), "http" | "https") {
        return Err((
            RemoteKind::Refused,
            format!("GET {url}: refusing the redirect to {}", next.scheme()),
        ));
    }
    Ok(next)
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

/// The first `max` bytes of a body (fewer if it ends or breaks off sooner); the rest is never
/// read.
async fn read_prefix(mut resp: reqwest::Response, max: u64) -> Vec<u8> {
    let mut out = Vec::new();
    while (out.len() as u64) < max {
        match resp.chunk().await {
            Ok(Some(chunk)) => {
                let room = (max - out.len() as u64) as usize;
                out.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            Ok(None) | Err(_) => break,
        }
    }
    out
}

/// Most bytes of an error body written to the daemon's log, at debug level.
const MAX_LOGGED_BODY_BYTES: usize = 4096;

/// How a registry's error response is classified, and what it said: the status, then a short
/// excerpt of its body (read up to [`MAX_ERROR_BODY_BYTES`]): the distribution error codes and
/// messages when the body is the spec's `{"errors": [{"code", "message"}]}`, else its text, with
/// control characters and line breaks made spaces, at most [`super::MAX_EXCERPT_CHARS`]
/// characters. The message reaches the pod's events, readable by whoever owns the pod, and the
/// body may be anyone's: a service the registry sent the daemon to, a proxy's error page. The
/// body itself goes to the daemon's log at debug level, its first [`MAX_LOGGED_BODY_BYTES`].
pub(super) async fn error_of(resp: reqwest::Response) -> (RemoteKind, String) {
    let status = resp.status();
    let url = resp.url().clone();
    let body = read_prefix(resp, MAX_ERROR_BODY_BYTES).await;
    tracing::debug!(
        %url,
        %status,
        body = %String::from_utf8_lossy(&body[..body.len().min(MAX_LOGGED_BODY_BYTES)]).escape_debug(),
        "registry error response"
    );
    #[derive(serde::Deserialize)]
    struct Envelope {
        #[serde(default)]
        errors: Vec<ErrorEntry>,
    }
    #[derive(serde::Deserialize)]
    struct ErrorEntry {
        #[serde(default)]
        code: String,
        #[serde(default)]
        message: String,
    }
    let codes: Vec<ErrorEntry> = serde_json::from_slice::<Envelope>(&body)
        .map(|e| e.errors)
        .unwrap_or_default();
    let has = |names: &[&str]| codes.iter().any(|e| names.contains(&e.code.as_str()));
    let kind = if matches!(status, StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN)
        || has(&["UNAUTHORIZED", "DENIED"])
    {
        RemoteKind::Unauthenticated
    } else if status == StatusCode::NOT_FOUND
        || has(&[
            "MANIFEST_UNKNOWN",
            "NAME_UNKNOWN",
            "BLOB_UNKNOWN",
            "NOT_FOUND",
            "MANIFEST_BLOB_UNKNOWN",
        ])
    {
        RemoteKind::NotFound
    } else {
        RemoteKind::Unavailable
    };
    let said = if codes.is_empty() {
        String::from_utf8_lossy(&body).into_owned()
    } else {
        codes
            .iter()
            .map(|e| format!("{} {}", e.code, e.message))
            .collect::<Vec<_>>()
            .join("; ")
    };
    let said = crate::text::excerpt(&said, super::MAX_EXCERPT_CHARS);
    let message = if said.is_empty() {
        format!("GET {url}: {status}")
    } else {
        format!("GET {url}: {status}: {said}")
    };
    (kind, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirects() {
        let u = |s: &str| Url::parse(s).unwrap();
        let ep = |host: &str, plain_http: bool| Endpoint {
            plain_http,
            ..crate::hosts::default_endpoint(host)
        };
        // r.example over https, with a mirror hosts.toml configures on 127.0.0.1:5000.
        let trusted = dest::Trusted::new(
            "r.example",
            &[ep("127.0.0.1:5000", true), ep("r.example", false)],
        );
        let from = u("https://r.example/v2/a/blobs/sha256:1");
        let hop = |from: &Url, to: &str| {
            let next = next_hop(from, to).map_err(|(_, m)| m)?;
            hop_route(Some(from), &next, &trusted)
                .map(|route| (next, route))
                .map_err(|why| why.to_string())
        };
        assert_eq!(
            hop(&from, "https://s3.example/x?sig=1").unwrap(),
            (u("https://s3.example/x?sig=1"), Route::Guarded)
        );
        assert_eq!(
            hop(&from, "/other").unwrap(),
            (u("https://r.example/other"), Route::Direct)
        );
        assert_eq!(
            hop(&from, "http://127.0.0.1:5000/x").unwrap().1,
            Route::Direct
        );
        for (to, why) in [
            ("http://s3.example/x", "from https down to plain http"),
            ("http://localhost/x", "from https down to plain http"),
            ("ftp://r.example/x", "refusing the redirect to ftp"),
            // Loopback IP literals, but not ones the session trusts: the address says why.
            ("http://127.0.0.1:5001/x", "127.0.0.1 is a loopback address"),
            ("http://[::1]:5000/x", "[::1] is a loopback address"),
            ("https://[::1]:5000/x", "[::1] is a loopback address"),
        ] {
            let err = hop(&from, to).unwrap_err();
            assert!(err.contains(why), "{to}: {err}");
        }
        let plain = u("http://127.0.0.1:5000/v2/a");
        assert!(hop(&plain, "http://10.0.0.1/x").is_ok());
        assert_eq!(
            next_hop(&from, "http://[").unwrap_err().0,
            RemoteKind::Unavailable
        );
        assert_eq!(
            next_hop(&from, "ftp://x/").unwrap_err().0,
            RemoteKind::Refused
        );
    }

    #[test]
    fn tls_fingerprints_follow_contents() {
        let tls = |ca: &[&[u8]], identity: Option<&[u8]>| Tls {
            ca: ca.iter().map(|c| c.to_vec()).collect(),
            identity: identity.map(<[u8]>::to_vec),
        };
        let base = tls(&[b"ca"], Some(b"id"));
        assert_eq!(base.fingerprint(), tls(&[b"ca"], Some(b"id")).fingerprint());
        for other in [
            tls(&[b"ca"], Some(b"rotated")),
            tls(&[b"ca2"], Some(b"id")),
            tls(&[b"ca"], None),
            tls(&[b"c", b"a"], Some(b"id")),
            tls(&[b"ca", b"id"], None),
        ] {
            assert_ne!(base.fingerprint(), other.fingerprint());
        }
    }

    #[test]
    fn origins() {
        let u = |s: &str| Url::parse(s).unwrap();
        assert!(same_origin(
            &u("https://a.example/x"),
            &u("https://a.example:443/y")
        ));
        assert!(!same_origin(
            &u("https://a.example/x"),
            &u("http://a.example/x")
        ));
        assert!(!same_origin(
            &u("https://a.example/x"),
            &u("https://a.example:5000/x")
        ));
        assert!(!same_origin(
            &u("https://a.example/x"),
            &u("https://b.example/x")
        ));
    }
}

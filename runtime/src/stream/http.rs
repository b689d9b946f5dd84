//! The streaming server's HTTP/1.1 side: `/exec/<token>` and `/attach/<token>` requests, the
//! upgrade to SPDY/3.1 and the remotecommand version negotiation; `/portforward/<token>`
//! goes to [`super::portforward`], which negotiates `portforward.k8s.io` itself.
//!
//! A request's token is consumed whatever happens next (single use, as the kubelet's streaming
//! server does). Refusals carry a plain-text body, which client-go shows as the error:
//! 404 (unknown path, or a token that is unknown, used or expired), 405 (not GET/POST),
//! 400 (not an upgrade to SPDY/3.1: WebSocket streaming is not served), 403 (no common
//! protocol version; `X-Accepted-Stream-Protocol-Versions` lists ours). Success is
//! `101 Switching Protocols` with `Connection: Upgrade`, `Upgrade: SPDY/3.1` and the chosen
//! `X-Stream-Protocol-Version`; the session then runs on the upgraded connection.

use std::convert::Infallible;
use std::sync::Arc;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONNECTION, HeaderValue, UPGRADE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

use super::exec::{self, ExecBackend};
use super::remotecommand::{
    ACCEPTED_PROTOCOLS_HEADER, Negotiated, PROTOCOL_HEADER, Protocol, SUPPORTED, negotiate,
};
use super::{Pending, StreamServer};

/// The `Upgrade` token of SPDY/3.1.
pub const SPDY_31: &str = "SPDY/3.1";

pub(super) fn text(status: StatusCode, msg: impl Into<String>) -> Response<Full<Bytes>> {
    let mut body = msg.into();
    body.push('\n');
    Response::builder()
        .status(status)
        .header("content-type", "text/plain; charset=utf-8")
        .body(Full::new(Bytes::from(body)))
        .expect("static response")
}

/// Whether a comma-separated header (`Connection`, `Upgrade`) lists `token`.
pub(super) fn lists(req: &Request<Incoming>, name: hyper::header::HeaderName, token: &str) -> bool {
    req.headers()
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// Answers one request of the streaming server.
pub async fn handle(
    mut req: Request<Incoming>,
    server: Arc<StreamServer>,
    backend: Arc<dyn ExecBackend>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    if let Some(token) = req.uri().path().strip_prefix("/portforward/") {
        let token = token.to_string();
        return Ok(super::portforward::handle_http(req, &token, &server));
    }
    // Exec and attach share the upgrade and the remotecommand negotiation.
    let path = req.uri().path().to_string();
    let (kind, token) = match (path.strip_prefix("/exec/"), path.strip_prefix("/attach/")) {
        (Some(t), _) => ("exec", t),
        (_, Some(t)) => ("attach", t),
        _ => {
            return Ok(text(
                StatusCode::NOT_FOUND,
                "only /exec/<token>, /attach/<token> and /portforward/<token> are served here",
            ));
        }
    };
    if req.method() != Method::POST && req.method() != Method::GET {
        return Ok(text(
            StatusCode::METHOD_NOT_ALLOWED,
            format!("{kind} streams are opened with POST or GET"),
        ));
    }
    let session = match server.take(token) {
        Some(p @ Pending::Exec(_)) if kind == "exec" => p,
        Some(p @ Pending::Attach(_)) if kind == "attach" => p,
        _ => {
            return Ok(text(
                StatusCode::NOT_FOUND,
                format!("{kind} session {token:?} not found: unknown, already used or expired"),
            ));
        }
    };
    if !lists(&req, CONNECTION, "upgrade") || !lists(&req, UPGRADE, SPDY_31) {
        return Ok(text(
            StatusCode::BAD_REQUEST,
            "unable to upgrade: the request must carry Connection: Upgrade and Upgrade: SPDY/3.1 (WebSocket streaming is not supported)",
        ));
    }
    let offered = req
        .headers()
        .get_all(PROTOCOL_HEADER)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect::<Vec<_>>();
    let supported: Vec<&str> = SUPPORTED.iter().map(|p| p.name()).collect();
    let (protocol, announce) = match negotiate(offered) {
        Negotiated::Chosen(p) => (p, true),
        Negotiated::Legacy => (Protocol::V1, false),
        Negotiated::NoCommon(client) => {
            let mut r = text(
                StatusCode::FORBIDDEN,
                format!(
                    "unable to upgrade: unable to negotiate protocol: client supports {client:?}, server supports {supported:?}"
                ),
            );
            r.headers_mut().insert(
                ACCEPTED_PROTOCOLS_HEADER,
                HeaderValue::from_str(&supported.join(", ")).expect("ASCII names"),
            );
            return Ok(r);
        }
    };
    let on_upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        match (on_upgrade.await, session) {
            (Ok(upgraded), Pending::Exec(r)) => {
                exec::serve(TokioIo::new(upgraded), protocol, r, backend).await
            }
            (Ok(upgraded), Pending::Attach(r)) => {
                super::attach::serve(TokioIo::new(upgraded), protocol, r, backend).await
            }
            (Ok(_), _) => {}
            (Err(e), _) => tracing::info!(error = %e, "{kind} upgrade failed"),
        }
    });
    let mut r = Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(CONNECTION, "Upgrade")
        .header(UPGRADE, SPDY_31);
    if announce {
        r = r.header(PROTOCOL_HEADER, protocol.name());
    }
    Ok(r.body(Full::new(Bytes::new())).expect("valid response"))
}

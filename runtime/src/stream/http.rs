//! The streaming server's HTTP/1.1 side: `/exec/<token>`, `/attach/<token>` and
//! `/portforward/<token>` requests, the upgrade to SPDY/3.1 or WebSocket and the protocol
//! negotiation (remotecommand versions; for port-forward `portforward.k8s.io` over SPDY, and
//! over WebSocket its tunnelled form or the per-port channels, [`ws::portforward`]).
//!
//! The transport is the one the client asks for: `Upgrade: SPDY/3.1` (versions offered in
//! `X-Stream-Protocol-Version` headers) or `Upgrade: websocket` (RFC 6455: a GET with
//! `Sec-WebSocket-Version: 13` and a `Sec-WebSocket-Key`; versions offered as subprotocols in
//! `Sec-WebSocket-Protocol`). A request's token is consumed whatever happens next (single use,
//! as the kubelet's streaming server does). Refusals carry a plain-text body, which client-go
//! shows as the error: 404 (unknown path, or a token that is unknown, used or expired), 405 (not
//! GET/POST), 400 (not an upgrade to SPDY/3.1 or WebSocket, or a WebSocket upgrade that is not
//! a GET or has no valid key), 426 (a WebSocket version other than 13), 403 (no common protocol
//! version; over SPDY `X-Accepted-Stream-Protocol-Versions` lists ours). Success is
//! `101 Switching Protocols` naming the transport and the chosen protocol
//! (`X-Stream-Protocol-Version`, or `Sec-WebSocket-Protocol` with `Sec-WebSocket-Accept`); the
//! session then runs on the upgraded connection.

use std::convert::Infallible;
use std::sync::Arc;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{CONNECTION, HeaderName, HeaderValue, UPGRADE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;

use super::backend::ExecBackend;
use super::exec;
use super::remotecommand::{
    ACCEPTED_PROTOCOLS_HEADER, Negotiated, PROTOCOL_HEADER, Protocol, SUPPORTED, WS_SUPPORTED,
    negotiate, offered,
};
use super::{Pending, Refused, StreamServer, attach, session, ws};

/// The `Upgrade` token of SPDY/3.1.
pub const SPDY_31: &str = "SPDY/3.1";
/// The `Upgrade` token of WebSocket.
pub const WEBSOCKET: &str = "websocket";
const WS_KEY: &str = "sec-websocket-key";
const WS_VERSION: &str = "sec-websocket-version";
const WS_PROTOCOL: &str = "sec-websocket-protocol";
const WS_ACCEPT: &str = "sec-websocket-accept";

pub(super) type Reply = Response<Full<Bytes>>;

pub(super) fn text(status: StatusCode, msg: impl Into<String>) -> Reply {
    let mut body = msg.into();
    body.push('\n');
    Response::builder()
        .status(status)
        .header("content-type", "text/plain; charset=utf-8")
        .body(Full::new(Bytes::from(body)))
        .expect("static response")
}

/// Whether a comma-separated header (`Connection`, `Upgrade`) lists `token`.
pub(super) fn lists(req: &Request<Incoming>, name: HeaderName, token: &str) -> bool {
    req.headers()
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// The transport a request upgrades to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Upgrade {
    Spdy,
    /// With the `Sec-WebSocket-Accept` of the client's key.
    WebSocket {
        accept: String,
    },
}

impl Upgrade {
    pub(super) fn is_websocket(&self) -> bool {
        matches!(self, Upgrade::WebSocket { .. })
    }
}

/// The upgrade `req` asks for, or the refusal to send.
pub(super) fn requested_upgrade(req: &Request<Incoming>) -> Result<Upgrade, Box<Reply>> {
    let upgrade = lists(req, CONNECTION, "upgrade");
    if upgrade && lists(req, UPGRADE, WEBSOCKET) {
        if req.method() != Method::GET {
            return Err(Box::new(text(
                StatusCode::BAD_REQUEST,
                "unable to upgrade: a WebSocket upgrade is a GET request",
            )));
        }
        let header = |n: &str| req.headers().get(n).and_then(|v| v.to_str().ok());
        if header(WS_VERSION).map(str::trim) != Some("13") {
            let mut r = text(
                StatusCode::UPGRADE_REQUIRED,
                "unable to upgrade: only WebSocket version 13 is spoken",
            );
            r.headers_mut()
                .insert(WS_VERSION, HeaderValue::from_static("13"));
            return Err(Box::new(r));
        }
        return match header(WS_KEY).filter(|k| ws::valid_key(k)) {
            Some(key) => Ok(Upgrade::WebSocket {
                accept: ws::accept_key(key),
            }),
            None => Err(Box::new(text(
                StatusCode::BAD_REQUEST,
                "unable to upgrade: no valid Sec-WebSocket-Key",
            ))),
        };
    }
    if upgrade && lists(req, UPGRADE, SPDY_31) {
        return Ok(Upgrade::Spdy);
    }
    Err(Box::new(text(
        StatusCode::BAD_REQUEST,
        "unable to upgrade: the request must carry Connection: Upgrade and Upgrade: SPDY/3.1 or websocket",
    )))
}

/// The protocols the client offers for `up`, in its order of preference.
pub(super) fn offered_protocols(req: &Request<Incoming>, up: &Upgrade) -> Vec<String> {
    let name = if up.is_websocket() {
        WS_PROTOCOL
    } else {
        PROTOCOL_HEADER
    };
    offered(
        req.headers()
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok()),
    )
}

/// `101 Switching Protocols` to `up`, naming `protocol` when there is one to name.
pub(super) fn switching(up: &Upgrade, protocol: Option<&str>) -> Reply {
    let mut r = Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(CONNECTION, "Upgrade");
    r = match up {
        Upgrade::Spdy => r.header(UPGRADE, SPDY_31),
        Upgrade::WebSocket { accept } => r.header(UPGRADE, WEBSOCKET).header(WS_ACCEPT, accept),
    };
    if let Some(p) = protocol {
        let name = if up.is_websocket() {
            WS_PROTOCOL
        } else {
            PROTOCOL_HEADER
        };
        r = r.header(name, p);
    }
    r.body(Full::new(Bytes::new())).expect("valid response")
}

/// 403: none of the client's protocols is one of `supported`.
pub(super) fn no_common_protocol(up: &Upgrade, client: &[String], supported: &[&str]) -> Reply {
    let mut r = text(
        StatusCode::FORBIDDEN,
        format!(
            "unable to upgrade: unable to negotiate protocol: client supports {client:?}, server supports {supported:?}"
        ),
    );
    if *up == Upgrade::Spdy {
        r.headers_mut().insert(
            ACCEPTED_PROTOCOLS_HEADER,
            HeaderValue::from_str(&supported.join(", ")).expect("ASCII names"),
        );
    }
    r
}

/// 503: [`super::MAX_SESSIONS`] sessions run already; the token is left for a retry.
fn too_many_sessions(why: &str) -> Reply {
    text(
        StatusCode::SERVICE_UNAVAILABLE,
        format!("{why}; try again later"),
    )
}

/// Answers one request of the streaming server.
pub async fn handle(
    mut req: Request<Incoming>,
    server: Arc<StreamServer>,
    backend: Arc<dyn ExecBackend>,
) -> Result<Reply, Infallible> {
    if let Some(token) = req.uri().path().strip_prefix("/portforward/") {
        let token = token.to_string();
        return Ok(port_forward(req, &token, &server));
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
    let (slot, session) = match server.start_session(token) {
        Ok((slot, p @ Pending::Exec(_))) if kind == "exec" => (slot, p),
        Ok((slot, p @ Pending::Attach(_))) if kind == "attach" => (slot, p),
        Err(Refused::Busy(why)) => return Ok(too_many_sessions(&why)),
        _ => {
            return Ok(text(
                StatusCode::NOT_FOUND,
                format!("{kind} session {token:?} not found: unknown, already used or expired"),
            ));
        }
    };
    let up = match requested_upgrade(&req) {
        Ok(u) => u,
        Err(refusal) => return Ok(*refusal),
    };
    let supported: &[Protocol] = if up.is_websocket() {
        &WS_SUPPORTED
    } else {
        &SUPPORTED
    };
    let (protocol, announce) = match negotiate(offered_protocols(&req, &up), supported) {
        Negotiated::Chosen(p) => (p, true),
        Negotiated::Legacy => (Protocol::V1, false),
        Negotiated::NoCommon(client) => {
            let names: Vec<&str> = supported.iter().map(|p| p.name()).collect();
            return Ok(no_common_protocol(&up, &client, &names));
        }
    };
    let on_upgrade = hyper::upgrade::on(&mut req);
    let websocket = up.is_websocket();
    tokio::spawn(async move {
        let _slot = slot;
        let io = match on_upgrade.await {
            Ok(upgraded) => TokioIo::new(upgraded),
            Err(e) => return tracing::info!(error = %e, "{kind} upgrade failed"),
        };
        match (session, websocket) {
            (Pending::Exec(r), false) => exec::serve(io, protocol, r, backend).await,
            (Pending::Attach(r), false) => attach::serve(io, protocol, r, backend).await,
            (Pending::Exec(r), true) => {
                let (ch, link) = session::open_ws(io, protocol, &r.streams(protocol));
                exec::run_session(ch, link, protocol, r, backend).await
            }
            (Pending::Attach(r), true) => {
                let (ch, link) = session::open_ws(io, protocol, &r.streams(protocol));
                attach::run_session(ch, link, protocol, r, backend).await
            }
            (Pending::PortForward(_), _) => {}
        }
    });
    Ok(switching(&up, announce.then(|| protocol.name())))
}

/// Answers `/portforward/<token>`: the token is consumed, then the request must be an upgrade:
/// to SPDY/3.1 offering `portforward.k8s.io` (or no protocol at all: the legacy form, answered
/// without the header), or to WebSocket offering [`ws::portforward::TUNNEL_PROTOCOL`] or
/// [`ws::portforward::CHANNEL_PROTOCOL`] (or none: the channel form) with its ports in the
/// query; the session runs on the upgraded connection. Refusals as for exec, and 400 for the
/// channel form's missing or bad ports.
fn port_forward(mut req: Request<Incoming>, token: &str, server: &StreamServer) -> Reply {
    use super::portforward::{PROTOCOL, serve};
    use ws::portforward::{CHANNEL_PROTOCOL, TUNNEL_PROTOCOL, ports_from_query};

    if req.method() != Method::POST && req.method() != Method::GET {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            "port-forward streams are opened with POST or GET",
        );
    }
    let (slot, pf) = match server.start_session(token) {
        Ok((slot, Pending::PortForward(r))) => (slot, r),
        Err(Refused::Busy(why)) => return too_many_sessions(&why),
        _ => {
            return text(
                StatusCode::NOT_FOUND,
                format!(
                    "port-forward session {token:?} not found: unknown, already used or expired"
                ),
            );
        }
    };
    let up = match requested_upgrade(&req) {
        Ok(u) => u,
        Err(refusal) => return *refusal,
    };
    let offered = offered_protocols(&req, &up);
    let supported: &[&str] = if up.is_websocket() {
        &[TUNNEL_PROTOCOL, CHANNEL_PROTOCOL]
    } else {
        &[PROTOCOL]
    };
    let chosen = offered
        .iter()
        .find(|o| supported.contains(&o.as_str()))
        .cloned();
    if chosen.is_none() && !offered.is_empty() {
        return no_common_protocol(&up, &offered, supported);
    }
    // The channel form: its ports come with the request.
    let channel_ports = match (&up, chosen.as_deref()) {
        (Upgrade::WebSocket { .. }, None | Some(CHANNEL_PROTOCOL)) => {
            match ports_from_query(req.uri().query()) {
                Ok(p) => Some(p),
                Err(m) => return text(StatusCode::BAD_REQUEST, m),
            }
        }
        _ => None,
    };
    let on_upgrade = hyper::upgrade::on(&mut req);
    let websocket = up.is_websocket();
    let bounds = server.port_forward_bounds(&pf.sandbox_id);
    tokio::spawn(async move {
        let _slot = slot;
        let io = match on_upgrade.await {
            Ok(upgraded) => TokioIo::new(upgraded),
            Err(e) => {
                return tracing::info!(sandbox = %pf.sandbox_id, error = %e, "port-forward upgrade failed");
            }
        };
        match (websocket, channel_ports) {
            (false, _) => serve(io, pf, bounds).await,
            (true, None) => ws::portforward::serve_tunnel(io, pf, bounds).await,
            (true, Some(ports)) => ws::portforward::serve_channels(io, pf, ports, bounds).await,
        }
    });
    switching(&up, chosen.as_deref())
}

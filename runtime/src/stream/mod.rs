//! The CRI streaming server: where `crictl exec` and the kubelet connect after the Exec RPC.
//!
//! The CRI does not stream over gRPC: Exec (and Attach, PortForward) answer a URL, and the
//! client opens it with HTTP/1.1, upgrades the connection to SPDY/3.1 or WebSocket (whichever
//! it asks for) and speaks the Kubernetes remotecommand (or port-forward) protocol on it. minicri serves that URL on a loopback address
//! (`stream.address`, default `127.0.0.1:0`: any free port), like containerd's default
//! `stream_server_address`; nothing here authenticates the client beyond the token, so the
//! configuration refuses other addresses.
//!
//! - this module: [`StreamServer`]: the listener and the pending requests, each under a random
//!   single-use token that expires after [`TOKEN_TTL`];
//! - [`http`]: the HTTP/1.1 request, upgrade and protocol negotiation;
//! - SPDY/3.1 framing, header compression, flow control and the connection are
//!   [`minicri_codecs::spdy`] (a crate of its own, so the fuzz targets build it);
//! - [`ws`]: WebSocket framing and limits, the connection, remotecommand channels, SPDY
//!   tunnelled through WebSocket and port-forward channels;
//! - [`remotecommand`]: protocol versions, stream types, the error stream's status;
//! - [`session`]: what exec and attach sessions share whatever the transport: channels, the
//!   link to the client, the copies;
//! - [`attach`]: one attach session, on the container's own stdio through its shim;
//! - [`exec`]: one exec session;
//! - [`backend`]: [`ExecBackend`], the seam to the pod service, and the stdio types exec and
//!   attach share;
//! - [`portforward`]: one port-forward session (`portforward.k8s.io`): TCP connections into
//!   the pod's network namespace;
//! - [`minicri_codecs::budget`]: the node-wide total of bytes port-forward sessions hold
//!   buffered, and each pod's share of it;
//! - [`pty`]: a pty master as async I/O, and terminal resizes (exec with a tty).
//!
//! Attach shares exec's upgrade and streams; the container's stdio comes from its shim.

pub mod attach;
pub mod backend;
pub mod config;
pub mod exec;
pub mod http;
pub mod portforward;
pub mod pty;
pub mod remotecommand;
pub mod session;
#[cfg(test)]
mod testing;
#[cfg(test)]
mod tests;
pub mod ws;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use minicri_codecs::budget;

use crate::error::{Error, Result};
pub use attach::AttachRequest;
pub use backend::ExecBackend;
pub use exec::ExecRequest;
pub use portforward::PortForwardRequest;

/// How long a URL handed out by Exec stays valid.
pub const TOKEN_TTL: Duration = Duration::from_secs(60);
/// Requests waiting for their client, at most (as the kubelet's streaming server).
pub const MAX_PENDING: usize = 1000;
/// Sessions (exec, attach, port-forward) running at once, at most. Each holds an upgraded
/// connection, its tasks and buffers, and often a process; one past this is answered 503 and its
/// token stays valid for a retry.
pub const MAX_SESSIONS: usize = 256;
/// Sessions into one pod (exec and attach into its containers, port-forward into its network)
/// running at once, at most: whoever may exec into one pod cannot take every session of the
/// node from the other pods' users. One past this is answered 503, its token kept.
pub const MAX_POD_SESSIONS: usize = 32;

/// A request waiting for its client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pending {
    Exec(ExecRequest),
    Attach(AttachRequest),
    PortForward(PortForwardRequest),
}

impl Pending {
    /// The pod the session goes into.
    fn pod(&self) -> &str {
        match self {
            Pending::Exec(r) => &r.sandbox_id,
            Pending::Attach(r) => &r.sandbox_id,
            Pending::PortForward(r) => &r.sandbox_id,
        }
    }
}

/// Why a token does not start a session now.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// Unknown, already used or expired.
    Unknown,
    /// Too many sessions on the node or in the pod (the reason); the token is kept for a retry.
    Busy(String),
}

/// A running session's place in the node's and its pod's counts, given back when dropped.
pub struct SessionSlot {
    _node: tokio::sync::OwnedSemaphorePermit,
    pod: String,
    pods: Arc<Mutex<HashMap<String, usize>>>,
}

impl Drop for SessionSlot {
    fn drop(&mut self) {
        let mut pods = self.pods.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = pods.get_mut(&self.pod) {
            *n -= 1;
            if *n == 0 {
                pods.remove(&self.pod);
            }
        }
    }
}

/// The streaming server: bound at daemon start, serving once [`StreamServer::spawn`]ed.
pub struct StreamServer {
    addr: SocketAddr,
    listener: Mutex<Option<std::net::TcpListener>>,
    pending: Mutex<HashMap<String, (Instant, Pending)>>,
    ttl: Duration,
    /// One permit per running session ([`MAX_SESSIONS`]).
    sessions: Arc<tokio::sync::Semaphore>,
    /// Running sessions per pod, and their most ([`MAX_POD_SESSIONS`]).
    pod_sessions: Arc<Mutex<HashMap<String, usize>>>,
    max_pod_sessions: usize,
    /// What the port-forward sessions buffer, node-wide (`stream.port_forward_buffer_bytes`).
    port_forward_budget: budget::Budget,
    /// How long port-forwards' bytes may wait for a peer (`stream.port_forward_stall_timeout`).
    port_forward_stall: Option<Duration>,
}

impl StreamServer {
    /// Binds `addr` (port 0: any free port).
    pub fn bind(addr: SocketAddr) -> anyhow::Result<StreamServer> {
        let listener = std::net::TcpListener::bind(addr)
            .map_err(|e| anyhow::anyhow!("binding the streaming address {addr}: {e}"))?;
        listener.set_nonblocking(true)?;
        Ok(StreamServer {
            addr: listener.local_addr()?,
            listener: Mutex::new(Some(listener)),
            pending: Mutex::new(HashMap::new()),
            ttl: TOKEN_TTL,
            sessions: Arc::new(tokio::sync::Semaphore::new(MAX_SESSIONS)),
            pod_sessions: Arc::new(Mutex::new(HashMap::new())),
            max_pod_sessions: MAX_POD_SESSIONS,
            port_forward_budget: budget::Budget::new(config::DEFAULT_PORT_FORWARD_BUFFER_BYTES),
            port_forward_stall: config::StreamSettings::default()
                .port_forward_stall()
                .map_err(anyhow::Error::msg)?,
        })
    }

    /// Port-forward sessions share a total of `bytes` for what they buffer.
    pub fn with_port_forward_buffer(mut self, bytes: u64) -> StreamServer {
        self.port_forward_budget = budget::Budget::new(bytes);
        self
    }

    /// Port-forwards whose bytes wait `stall` for a peer are closed (`None`: never).
    pub fn with_port_forward_stall(mut self, stall: Option<Duration>) -> StreamServer {
        self.port_forward_stall = stall;
        self
    }

    /// The port-forward sessions' total and what they hold of it.
    pub fn port_forward_budget(&self) -> &budget::Budget {
        &self.port_forward_budget
    }

    /// What bounds a port-forward session into `pod`: the pod's share of the node's total and
    /// the stall timeout.
    pub fn port_forward_bounds(&self, pod: &str) -> portforward::Bounds {
        portforward::Bounds {
            share: self.port_forward_budget.share(pod),
            stall: self.port_forward_stall,
        }
    }

    /// The address actually bound.
    pub fn address(&self) -> SocketAddr {
        self.addr
    }

    /// Keeps an exec request for its client; returns the URL to hand out.
    pub fn register_exec(&self, req: ExecRequest) -> Result<String> {
        let token = self.insert(Pending::Exec(req))?;
        Ok(format!("http://{}/exec/{token}", self.addr))
    }

    /// Keeps a port-forward request for its client; returns the URL to hand out.
    pub fn register_port_forward(&self, req: PortForwardRequest) -> Result<String> {
        let token = self.insert(Pending::PortForward(req))?;
        Ok(format!("http://{}/portforward/{token}", self.addr))
    }

    /// Keeps an attach request for its client; returns the URL to hand out.
    pub fn register_attach(&self, req: AttachRequest) -> Result<String> {
        let token = self.insert(Pending::Attach(req))?;
        Ok(format!("http://{}/attach/{token}", self.addr))
    }

    fn insert(&self, p: Pending) -> Result<String> {
        let token = crate::ids::random_hex::<16>()?;
        let now = Instant::now();
        let mut pending = self.pending.lock().unwrap();
        pending.retain(|_, (expires, _)| *expires > now);
        if pending.len() >= MAX_PENDING {
            return Err(Error::Unavailable(format!(
                "{MAX_PENDING} streaming requests are already waiting for their clients"
            )));
        }
        pending.insert(token.clone(), (now + self.ttl, p));
        Ok(token)
    }

    /// Takes the request under `token` with a place for its session, if the node and its pod
    /// have one; else the token stays (until it expires) for a retry.
    fn start_session(&self, token: &str) -> std::result::Result<(SessionSlot, Pending), Refused> {
        let mut pending = self.pending.lock().unwrap();
        let Some((expires, p)) = pending.get(token) else {
            return Err(Refused::Unknown);
        };
        if *expires <= Instant::now() {
            pending.remove(token);
            return Err(Refused::Unknown);
        }
        let pod = p.pod().to_string();
        let mut pods = self.pod_sessions.lock().unwrap();
        let running = pods.get(&pod).copied().unwrap_or(0);
        if running >= self.max_pod_sessions {
            return Err(Refused::Busy(format!(
                "{running} streaming sessions into pod {pod} are running already"
            )));
        }
        let Ok(node) = self.sessions.clone().try_acquire_owned() else {
            return Err(Refused::Busy(format!(
                "{MAX_SESSIONS} streaming sessions are running already"
            )));
        };
        *pods.entry(pod.clone()).or_default() += 1;
        let (_, p) = pending.remove(token).expect("looked up above");
        let slot = SessionSlot {
            _node: node,
            pod,
            pods: self.pod_sessions.clone(),
        };
        Ok((slot, p))
    }

    /// Starts serving; sessions run their processes through `backend`. Runs until the returned
    /// task is aborted (sessions in progress carry on).
    pub fn spawn(
        self: &Arc<Self>,
        backend: Arc<dyn ExecBackend>,
        shutdown: tokio_util::sync::CancellationToken,
    ) -> anyhow::Result<tokio::task::JoinHandle<()>> {
        let std_listener = self
            .listener
            .lock()
            .unwrap()
            .take()
            .ok_or_else(|| anyhow::anyhow!("the streaming server is already serving"))?;
        let listener = tokio::net::TcpListener::from_std(std_listener)?;
        tracing::info!(address = %self.addr, "streaming server (exec, attach, port-forward) listening");
        let server = self.clone();
        Ok(crate::httpserve::serve(
            listener,
            "streaming",
            crate::httpserve::DEFAULT_LIMITS,
            shutdown,
            move |req| http::handle(req, server.clone(), backend.clone()),
        ))
    }
}

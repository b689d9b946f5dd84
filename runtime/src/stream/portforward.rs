//! One port-forward session: the `portforward.k8s.io` protocol on an upgraded connection, what
//! `kubectl port-forward` and `crictl port-forward` speak through
//! k8s.io/client-go/tools/portforward.
//!
//! The URL handed out by the PortForward RPC names a pod sandbox, not a port: one SPDY
//! connection carries any number of forwarded TCP connections, each as a pair of streams the
//! client opens with the headers `streamType` (`error` or `data`), `port` and `requestID` (the
//! pair's common key; clients older than `requestID` are paired as the kubelet does: an error
//! stream's key is its own id, a data stream's its id minus 2). For each complete pair:
//!
//! 1. connect to `localhost:<port>` inside the pod's network namespace: on a dedicated thread
//!    that joined the namespace (`setns`, [`crate::netns::run_in`]), 127.0.0.1 then ::1; the
//!    socket keeps its namespace and is then driven by tokio. Host-network pods (no namespace
//!    of their own) connect on the host's loopback;
//! 2. copy both ways: the client's DATA to the socket (its FIN or RST_STREAM half-closes the
//!    socket with `shutdown(SHUT_WR)`), the socket's bytes as DATA (its EOF becomes our FIN);
//!    the pair ends when both directions are done, or when the socket's side is done and the
//!    client cannot be written to any more;
//! 3. a failure (bad port, refused connection, I/O error) is written as text on the error
//!    stream, which client-go shows as "an error occurred forwarding L -> P: <text>"; then both
//!    streams are half-closed (FIN).
//!
//! The same session runs on SPDY tunnelled through WebSocket; WebSocket clients may also use the
//! kubelet's per-port channel form ([`super::ws::portforward`]); [`super::http`] picks.
//!
//! Everything a session buffers counts against its pod's share of the node's port-forward total
//! ([`minicri_codecs::budget`], `stream.port_forward_buffer_bytes`; [`Bounds`]): its connection's
//! own buffers ([`SESSION_BYTES`], taken when it starts), the client's DATA until it is written to
//! the pod's socket, and each read from the pod's socket until the client's connection has taken
//! it. A forward whose bytes do not fit waits. Bytes that wait for a peer that does not read are
//! bounded in time (`stream.port_forward_stall_timeout`): a client that takes no frame of the
//! session in that time has the session closed (logged with the pod, its ports and the setting), a
//! pod that takes no byte of a forwarded connection has that connection closed
//! (the reason on its error stream).
//!
//! A pair left incomplete for [`super::session::STREAM_CREATION_TIMEOUT`] gets "timed out waiting
//! for complete stream pair" on its error stream (as the kubelet). A stream of another type, or
//! a second stream of one type for a key, is refused (RST_STREAM REFUSED_STREAM). The session
//! ends when the client closes the connection; forwards in progress then stop.

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use minicri_codecs::budget::{Input, Share};
use minicri_codecs::spdy::conn::{self, Event, IncomingStream, MAX_DATA_CHUNK};
use minicri_codecs::spdy::liveness::{self, Stall};
use minicri_codecs::spdy::rst;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;

use super::config::PORT_FORWARD_STALL_KEY;
use super::remotecommand::STREAM_TYPE_HEADER;
use super::session::{LINGER, Output, STREAM_CREATION_TIMEOUT};

/// The subprotocol client-go asks for in `X-Stream-Protocol-Version` (over WebSocket, the
/// tunnelled form prefixes it: [`super::ws::portforward`]).
pub const PROTOCOL: &str = "portforward.k8s.io";
/// The stream header naming the remote port.
pub const PORT_HEADER: &str = "port";
/// The stream header pairing an error stream with its data stream.
pub const REQUEST_ID_HEADER: &str = "requestID";
/// How long one connection attempt inside the pod may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Streams of one session waiting for the other half of their pair. Each holds its header block;
/// a client opening only halves (or streams already half-closed, which the connection does not
/// count as open) is refused past this.
const MAX_PENDING_PAIRS: usize = 256;
/// How long a forward whose pod closed its side still carries what the client sends.
const POD_CLOSED_GRACE: Duration = Duration::from_secs(1);
/// Connections one session forwards at once (each a socket in the pod and two tasks); a pair
/// completed past this gets the reason on its error stream.
const MAX_FORWARDS: usize = 512;

/// What a SPDY port-forward session's connection buffers of its own, charged when it starts:
/// the reader's and the writer's buffers (8 KiB each), the frame being encoded (up to 32 KiB)
/// and the header blocks being inflated.
pub const SESSION_BYTES: usize = 64 << 10;

/// What bounds a port-forward session's buffers: its pod's share of the node's total, and how
/// long its bytes may wait for a peer that does not read (`None`: for ever).
#[derive(Clone, Debug)]
pub struct Bounds {
    pub share: Share,
    pub stall: Option<Duration>,
}

impl Bounds {
    /// The stall limit of the connection to the client.
    pub(super) fn client_stall(&self) -> Option<Stall> {
        self.stall.map(|after| Stall {
            after,
            setting: PORT_FORWARD_STALL_KEY,
        })
    }
}

/// What a forward whose pod took no byte for `after` reports.
pub(super) fn pod_stalled(req: &PortForwardRequest, port: u16, after: Duration) -> String {
    format!(
        "port-forward to port {port} of pod {} closed: the pod took none of the client's bytes \
         for {after:?} ({PORT_FORWARD_STALL_KEY})",
        req.sandbox_id
    )
}

/// How a session's SPDY connection reaches its client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Carrier {
    /// On the upgraded connection itself.
    Direct,
    /// Tunnelled through WebSocket ([`super::ws::tunnel`]): the WebSocket connection has the
    /// stall limit, and its buffers take the pod's bytes after this session's (which are then
    /// relays, [`Share::relay`]).
    Tunnel,
}

/// How a session ended.
pub(super) struct Ended {
    /// The ports it forwarded connections to.
    pub(super) ports: BTreeSet<u16>,
    pub(super) forwards: u64,
    pub(super) reason: String,
}

/// Logs a session's end: a stall (the reason names the setting) as a warning with the pod and
/// its ports, anything else for debugging.
pub(super) fn log_end(req: &PortForwardRequest, ended: &Ended, reason: &str) {
    if liveness::is_stall(reason) {
        tracing::warn!(
            sandbox = %req.sandbox_id,
            ports = ?ended.ports,
            %reason,
            "port-forward session closed: its client stopped reading"
        );
    } else {
        tracing::debug!(
            sandbox = %req.sandbox_id,
            forwards = ended.forwards,
            %reason,
            "port-forward session ended"
        );
    }
}

/// What the PortForward RPC accepted, kept under its token until the client connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortForwardRequest {
    pub sandbox_id: String,
    /// The pod's network namespace; `None`: the host's (host-network pod).
    pub netns: Option<PathBuf>,
}

/// The two halves of one forwarded connection.
#[derive(Default)]
struct Pair {
    error: Option<IncomingStream>,
    data: Option<IncomingStream>,
}

/// The pairing key of a stream: its `requestID`, or the kubelet's fallback for old clients.
fn pair_key(s: &IncomingStream, kind: &str) -> String {
    match s.headers.get(REQUEST_ID_HEADER) {
        Some(id) => id.to_string(),
        None if kind == "data" => s.id.saturating_sub(2).to_string(),
        None => s.id.to_string(),
    }
}

/// Parses a `port` header: 1 to 65535.
pub fn parse_port(v: Option<&str>) -> Result<u16, String> {
    let v = v.ok_or("the data stream has no port header")?;
    match v.trim().parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(format!("invalid port {v:?}: ports are 1 to 65535")),
    }
}

/// Runs one port-forward session on an upgraded connection, its buffers held to `bounds`.
pub async fn serve<IO>(io: IO, req: PortForwardRequest, bounds: Bounds)
where
    IO: AsyncRead + AsyncWrite + Send + 'static,
{
    let ended = run(io, req.clone(), bounds, Carrier::Direct).await;
    log_end(&req, &ended, &ended.reason);
}

/// Runs one session whose SPDY connection is `io`, reaching the client by `carrier`.
pub(super) async fn run<IO>(
    io: IO,
    req: PortForwardRequest,
    bounds: Bounds,
    carrier: Carrier,
) -> Ended
where
    IO: AsyncRead + AsyncWrite + Send + 'static,
{
    let _own = bounds.share.charge_session(SESSION_BYTES).await;
    let req = Arc::new(req);
    let (stall, reads) = match carrier {
        Carrier::Direct => (bounds.client_stall(), bounds.share.clone()),
        Carrier::Tunnel => (None, bounds.share.relay()),
    };
    let (conn, mut events) = conn::serve_budgeted(io, bounds.share.clone(), stall);
    // Tells the forwards in progress that the connection is gone.
    let (closed_tx, closed_rx) = watch::channel(false);
    let mut pairs: HashMap<String, (Instant, Pair)> = HashMap::new();
    let mut forwards = 0u64;
    let mut ports = BTreeSet::new();
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_FORWARDS));
    let reason = loop {
        let next_expiry = pairs
            .values()
            .map(|(t, _)| *t + STREAM_CREATION_TIMEOUT)
            .min();
        let ev = match next_expiry {
            Some(at) => tokio::select! {
                ev = events.recv() => ev,
                _ = tokio::time::sleep_until(at) => {
                    expire(&mut pairs).await;
                    continue;
                }
            },
            None => events.recv().await,
        };
        let s = match ev {
            Some(Event::Stream(s)) => s,
            Some(Event::Closed(reason)) => break reason,
            None => break "the connection's reader is gone".to_string(),
        };
        let kind = s.headers.get(STREAM_TYPE_HEADER).unwrap_or("").to_string();
        if kind != "error" && kind != "data" {
            tracing::debug!(sandbox = %req.sandbox_id, stream_type = %kind, "port-forward stream refused");
            s.writer.reset(rst::REFUSED_STREAM).await;
            continue;
        }
        let key = pair_key(&s, &kind);
        if pairs.len() >= MAX_PENDING_PAIRS && !pairs.contains_key(&key) {
            tracing::debug!(sandbox = %req.sandbox_id, "port-forward stream refused: too many half pairs");
            s.writer.reset(rst::REFUSED_STREAM).await;
            continue;
        }
        let (_, pair) = pairs
            .entry(key.clone())
            .or_insert_with(|| (Instant::now(), Pair::default()));
        let slot = if kind == "error" {
            &mut pair.error
        } else {
            &mut pair.data
        };
        if slot.is_some() {
            s.writer.reset(rst::REFUSED_STREAM).await;
            continue;
        }
        *slot = Some(s);
        if pair.error.is_some() && pair.data.is_some() {
            let (_, pair) = pairs.remove(&key).expect("just completed");
            let (error, data) = (pair.error.unwrap(), pair.data.unwrap());
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                let msg = format!(
                    "more than {MAX_FORWARDS} connections forwarded at once in this session"
                );
                tell(error, msg.into_bytes());
                data.writer.reset(rst::REFUSED_STREAM).await;
                continue;
            };
            forwards += 1;
            ports.extend(parse_port(data.headers.get(PORT_HEADER)).ok());
            let (req, closed, reads) = (req.clone(), closed_rx.clone(), reads.clone());
            let stall = bounds.stall;
            tokio::spawn(async move {
                forward(req, error, data, closed, reads, stall).await;
                drop(slot);
            });
        }
    };
    let _ = closed_tx.send(true);
    conn.close().await;
    Ended {
        ports,
        forwards,
        reason,
    }
}

/// Writes `msg` on an error stream and ends it, in a task of its own and for at most
/// [`LINGER`]: a client granting no flow-control window must not hold the session's loop.
fn tell(error: IncomingStream, msg: Vec<u8>) {
    tokio::spawn(async move {
        let _ = tokio::time::timeout(LINGER, async {
            let _ = error.writer.write(&msg).await;
            let _ = error.writer.close().await;
        })
        .await;
    });
}

/// Fails the pairs that waited too long for their other half.
async fn expire(pairs: &mut HashMap<String, (Instant, Pair)>) {
    let now = Instant::now();
    let expired: Vec<String> = pairs
        .iter()
        .filter(|(_, (t, _))| *t + STREAM_CREATION_TIMEOUT <= now)
        .map(|(k, _)| k.clone())
        .collect();
    for k in expired {
        let (_, p) = pairs.remove(&k).expect("listed");
        if let Some(e) = p.error {
            tell(e, b"timed out waiting for complete stream pair".to_vec());
        }
        if let Some(d) = p.data {
            d.writer.reset(rst::CANCEL).await;
        }
    }
}

/// Connects to `localhost:port` in `netns` (the host's when `None`): 127.0.0.1, then ::1.
///
/// The two sockets are made in the namespace (by a thread that joins it for that moment: a
/// socket stays in the namespace it was made in) and connect from the async workers, each within
/// [`CONNECT_TIMEOUT`]: a port whose listener never answers (a full backlog drops the SYNs) holds
/// no thread while it is tried, so clients cannot fill the blocking pool with dials.
pub async fn connect(netns: Option<PathBuf>, port: u16) -> Result<TcpStream, String> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socket};
    // A namespace without IPv6 cannot make the second one; that is its dial's error.
    type Made = nix::Result<std::net::TcpStream>;
    let make = || -> [Made; 2] {
        let flags = SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC;
        [AddressFamily::Inet, AddressFamily::Inet6]
            .map(|family| socket(family, SockType::Stream, flags, None).map(Into::into))
    };
    let [v4, v6] = tokio::task::spawn_blocking(move || match &netns {
        Some(path) => crate::netns::run_in(path, make).map_err(|e| e.to_string()),
        None => Ok(make()),
    })
    .await
    .map_err(|e| format!("connecting: {e}"))??;
    let dial = |socket: Made, ip: std::net::IpAddr| async move {
        let socket = tokio::net::TcpSocket::from_std_stream(socket.map_err(|e| e.to_string())?);
        match tokio::time::timeout(CONNECT_TIMEOUT, socket.connect((ip, port).into())).await {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(_) => Err(format!("no answer in {CONNECT_TIMEOUT:?}")),
        }
    };
    let e4 = match dial(v4, std::net::Ipv4Addr::LOCALHOST.into()).await {
        Ok(s) => return Ok(s),
        Err(e) => e,
    };
    dial(v6, std::net::Ipv6Addr::LOCALHOST.into())
        .await
        .map_err(|e6| format!("IPv4: {e4}; IPv6: {e6}"))
}

/// Connects to `localhost:port` in the pod of `req`; the error is the text a client shows.
pub async fn dial(req: &PortForwardRequest, port: u16) -> Result<TcpStream, String> {
    connect(req.netns.clone(), port).await.map_err(|e| {
        format!(
            "failed to connect to localhost:{port} inside namespace of pod {}: {e}",
            req.sandbox_id
        )
    })
}

/// Forwards one pair's connection, charging the pod's bytes read for the client to `reads`;
/// reports a failure (a pod stalled for `stall` included) on its error stream.
async fn forward(
    req: Arc<PortForwardRequest>,
    error: IncomingStream,
    data: IncomingStream,
    closed: watch::Receiver<bool>,
    reads: Share,
    stall: Option<Duration>,
) {
    let data_writer = data.writer.clone();
    let result = async {
        let port = parse_port(data.headers.get(PORT_HEADER))?;
        let socket = dial(&req, port).await?;
        tracing::debug!(sandbox = %req.sandbox_id, port, "port-forward connected");
        copy(socket, data, closed, &reads, stall)
            .await
            .map_err(|e| e.report(&req, port))
    }
    .await;
    if let Err(msg) = result {
        tracing::info!(sandbox = %req.sandbox_id, error = %msg, "port-forward failed");
        let _ = error.writer.write(msg.as_bytes()).await;
    }
    // Both halves end with FIN (a no-op on a data stream the copy already finished).
    let _ = data_writer.close().await;
    let _ = error.writer.close().await;
}

/// Copies the client's bytes to the pod's socket until the client's side ends (or the pod
/// closes its side), then half-closes the socket (`shutdown(SHUT_WR)`). Each piece's charge is
/// given back once the socket has taken it. A pod that takes no byte for `stall` ends the copy
/// with `Err(stall)`; the socket is left to the caller to drop.
pub(super) async fn client_to_socket(
    mut from_client: Input,
    mut wr: tokio::net::tcp::OwnedWriteHalf,
    stall: Option<Duration>,
) -> Result<(), Duration> {
    'pieces: while let Some((buf, _charge)) = from_client.recv_charged().await {
        let mut rest = &buf[..];
        while !rest.is_empty() {
            let written = match stall {
                Some(after) => tokio::time::timeout(after, wr.write(rest))
                    .await
                    .map_err(|_| after)?,
                None => wr.write(rest).await,
            };
            match written {
                Ok(n) if n > 0 => rest = &rest[n..],
                // The pod's side closed its read half: nothing more can be delivered.
                _ => break 'pieces,
            }
        }
    }
    let _ = wr.shutdown().await;
    Ok(())
}

/// Copies the pod's bytes to the client until the socket's EOF, or until the client cannot be
/// written to (it reset the stream or went away); a read error is the text to report. A read
/// waits until the socket has bytes, then for their room in the pod's share, then takes at most
/// [`MAX_DATA_CHUNK`] into a buffer of its own that goes to the client's connection as it is:
/// an idle forward holds no buffer, and one whose client does not read holds one.
pub(super) async fn socket_to_client(
    rd: tokio::net::tcp::OwnedReadHalf,
    to: &Output,
    budget: &Share,
) -> Result<(), String> {
    let failed = |e: std::io::Error| format!("reading from the pod: {e}");
    loop {
        rd.readable().await.map_err(failed)?;
        let charge = budget.charge(to.charge_for(MAX_DATA_CHUNK)).await;
        let head = to.head();
        let mut buf = Vec::with_capacity(head.len() + MAX_DATA_CHUNK);
        buf.extend_from_slice(head);
        match rd.try_read_buf(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(_) => {
                if to.write_owned(buf, charge).await.is_err() {
                    return Ok(());
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(failed(e)),
        }
    }
}

/// Why a forward's copy failed.
enum CopyError {
    /// Reading from the pod failed (the text to report).
    Read(String),
    /// The pod took no byte for this long.
    PodStalled(Duration),
}

impl CopyError {
    fn report(self, req: &PortForwardRequest, port: u16) -> String {
        match self {
            CopyError::Read(e) => e,
            CopyError::PodStalled(after) => pod_stalled(req, port, after),
        }
    }
}

/// Copies between the socket and the data stream until both directions are done (once the pod
/// has closed its side, the client's gets [`POD_CLOSED_GRACE`]); then FINs the data stream. A
/// client that resets the data stream (client-go does once its local connection is done with)
/// or whose connection ends has abandoned the forward: the socket is closed then, even if the
/// pod keeps its side open and silent, so the forward does not hold its slot and the pod's
/// connection until the session ends. A pod that takes no byte for `stall` ends the forward,
/// and its queue of the client's bytes with it.
async fn copy(
    socket: TcpStream,
    data: IncomingStream,
    mut closed: watch::Receiver<bool>,
    reads: &Share,
    stall: Option<Duration>,
) -> Result<(), CopyError> {
    let IncomingStream {
        data: from_client,
        writer,
        ..
    } = data;
    let (rd, wr) = socket.into_split();
    let to_socket = client_to_socket(from_client, wr, stall);
    let we_closed = std::sync::atomic::AtomicBool::new(false);
    let to_client = async {
        let res = socket_to_client(rd, &Output::Spdy(writer.clone()), reads).await;
        we_closed.store(true, std::sync::atomic::Ordering::Relaxed);
        let _ = writer.close().await;
        res
    };
    let gone = async {
        while !*closed.borrow_and_update() {
            if closed.changed().await.is_err() {
                break;
            }
        }
    };
    // The stream closed for sending without our FIN: the client reset it.
    let reset = async {
        writer.gone().await;
        if we_closed.load(std::sync::atomic::Ordering::Relaxed) {
            std::future::pending::<()>().await;
        }
    };
    let both = async {
        tokio::pin!(to_socket, to_client);
        tokio::select! {
            // The client is done sending: the pod's answer still comes.
            r = &mut to_socket => {
                r.map_err(CopyError::PodStalled)?;
                to_client.await.map_err(CopyError::Read)
            }
            // The pod closed its side: what the client still sends gets a short grace, then
            // the forward ends (and its error stream with it, which older clients wait for
            // before they let go of the connection).
            res = &mut to_client => {
                if let Ok(Err(after)) = tokio::time::timeout(POD_CLOSED_GRACE, to_socket).await {
                    return Err(CopyError::PodStalled(after));
                }
                res.map_err(CopyError::Read)
            }
        }
    };
    tokio::select! {
        res = both => res,
        () = gone => Ok(()),
        () = reset => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use minicri_codecs::spdy::headers::Headers;
    use minicri_codecs::spdy::test_peer::Peer;
    use minicri_codecs::spdy::{FLAG_FIN, Frame};
    use tokio::io::AsyncReadExt;

    /// A listener that never accepts, with a full backlog, drops the SYNs sent to it: a dial
    /// there waits for its timeout. It waits on the async workers, not on a blocking thread, so
    /// a client dialling such a port by the hundred leaves the blocking pool (record writes,
    /// unpacks, removals) free.
    #[test]
    fn a_dial_that_gets_no_answer_holds_no_blocking_thread() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .max_blocking_threads(1)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
            let listener = socket.listen(0).unwrap();
            let addr = listener.local_addr().unwrap();
            let mut queued = Vec::new();
            for _ in 0..3 {
                let c = tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(addr));
                if let Ok(Ok(c)) = c.await {
                    queued.push(c);
                }
            }
            assert!(!queued.is_empty(), "the backlog takes one connection");
            let dials: Vec<_> = (0..4)
                .map(|_| tokio::spawn(connect(None, addr.port())))
                .collect();
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert!(
                dials.iter().all(|d| !d.is_finished()),
                "the dials wait for an answer"
            );
            let free = tokio::time::timeout(
                Duration::from_secs(2),
                tokio::task::spawn_blocking(|| "free"),
            )
            .await;
            assert!(
                matches!(free, Ok(Ok("free"))),
                "a dial holds the only blocking thread"
            );
            for d in dials {
                d.abort();
            }
        });
    }

    #[test]
    fn ports_are_checked() {
        assert_eq!(parse_port(Some("8080")), Ok(8080));
        assert_eq!(parse_port(Some("65535")), Ok(65535));
        for bad in ["0", "65536", "-1", "http", ""] {
            assert!(parse_port(Some(bad)).is_err(), "{bad:?}");
        }
        assert!(parse_port(None).is_err());
    }

    async fn open(p: &mut Peer<tokio::io::DuplexStream>, id: u32, kind: &str, h: &[(&str, &str)]) {
        let mut headers = Headers::new().with("streamType", kind);
        for (k, v) in h {
            headers = headers.with(k, v);
        }
        p.send(Frame::SynStream {
            stream_id: id,
            associated_to: 0,
            priority: 0,
            slot: 0,
            flags: 0,
            headers,
        })
        .await;
    }

    /// Opens error stream `id` already half-closed (SYN_STREAM with FIN).
    async fn open_error_half_closed(
        p: &mut Peer<tokio::io::DuplexStream>,
        id: u32,
        port: &str,
        request_id: &str,
    ) {
        p.send(Frame::SynStream {
            stream_id: id,
            associated_to: 0,
            priority: 0,
            slot: 0,
            flags: FLAG_FIN,
            headers: Headers::new()
                .with("streamType", "error")
                .with("port", port)
                .with("requestID", request_id),
        })
        .await;
    }

    /// Reads frames until streams `ids` all got FIN; returns each one's bytes.
    async fn collect(p: &mut Peer<tokio::io::DuplexStream>, ids: &[u32]) -> HashMap<u32, Vec<u8>> {
        let mut out: HashMap<u32, Vec<u8>> = ids.iter().map(|i| (*i, Vec::new())).collect();
        let mut open: Vec<u32> = ids.to_vec();
        while !open.is_empty() {
            let f = tokio::time::timeout(Duration::from_secs(10), p.recv())
                .await
                .expect("a frame in time");
            match f {
                Frame::Data {
                    stream_id,
                    flags,
                    data,
                } => {
                    out.entry(stream_id).or_default().extend(data);
                    if flags & FLAG_FIN != 0 {
                        open.retain(|i| *i != stream_id);
                    }
                }
                Frame::RstStream { stream_id, status } => {
                    panic!("stream {stream_id} reset ({status})")
                }
                _ => {}
            }
        }
        out
    }

    fn session() -> Peer<tokio::io::DuplexStream> {
        session_with(&minicri_codecs::budget::Budget::new(64 << 20), None)
    }

    /// A session into pod `sb1` charging `budget`, stalled forwards closed after `stall`.
    fn session_with(
        budget: &minicri_codecs::budget::Budget,
        stall: Option<Duration>,
    ) -> Peer<tokio::io::DuplexStream> {
        let (client, server) = tokio::io::duplex(1 << 20);
        let bounds = Bounds {
            share: budget.share("sb1"),
            stall,
        };
        let req = PortForwardRequest {
            sandbox_id: "sb1".into(),
            netns: None,
        };
        tokio::spawn(serve(server, req, bounds));
        Peer::new(client)
    }

    /// A pod that accepts the connection and never reads it: once its socket's buffers are
    /// full, the forward waits the stall timeout, then ends with the reason on its error stream
    /// (the pod, the port and the setting), and the session's bytes are given back when it ends.
    #[tokio::test]
    async fn a_pod_that_does_not_read_has_its_forward_closed_after_the_stall_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let held = tokio::spawn(async move { listener.accept().await.unwrap().0 });
        let budget = minicri_codecs::budget::Budget::new(64 << 20);
        let mut p = session_with(&budget, Some(Duration::from_millis(300)));
        let (rid, port_text) = ("0", port.to_string());
        open_error_half_closed(&mut p, 1, &port_text, rid).await;
        open(
            &mut p,
            3,
            "data",
            &[("port", &port_text), ("requestID", rid)],
        )
        .await;
        // More than the pod's socket takes (the kernel grows its buffers as the pod reads, and
        // it reads nothing): the forward's queue fills, the session stops reading until the
        // forward is closed, then drops what comes for it.
        for _ in 0..32 {
            let frame = Frame::Data {
                stream_id: 3,
                flags: 0,
                data: vec![b'x'; 1 << 20],
            };
            let sent = tokio::time::timeout(Duration::from_secs(10), p.send(frame)).await;
            assert!(sent.is_ok(), "the session did not read on after the stall");
        }
        let out = collect(&mut p, &[1, 3]).await;
        let msg = String::from_utf8_lossy(&out[&1]);
        assert!(
            msg.contains(&format!("port-forward to port {port} of pod sb1 closed"))
                && msg.contains("stream.port_forward_stall_timeout"),
            "{msg}"
        );
        drop(p);
        let mut left = budget.in_use();
        for _ in 0..50 {
            left = budget.in_use();
            if left == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(left, 0, "bytes still held after the session ended");
        drop(held);
    }

    #[tokio::test]
    async fn forwards_two_connections_on_one_session_and_reports_refusals() {
        // An upper-casing echo server that answers until its client half-closes.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port().to_string();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut all = Vec::new();
                    s.read_to_end(&mut all).await.unwrap();
                    s.write_all(&all.to_ascii_uppercase()).await.unwrap();
                });
            }
        });
        let mut p = session();
        for (n, (e, d)) in [(1u32, 3u32), (5, 7)].into_iter().enumerate() {
            let rid = n.to_string();
            let h = [("port", port.as_str()), ("requestID", rid.as_str())];
            open(&mut p, e, "error", &h).await;
            // client-go half-closes the error stream at once.
            p.send(Frame::Data {
                stream_id: e,
                flags: FLAG_FIN,
                data: vec![],
            })
            .await;
            open(&mut p, d, "data", &h).await;
            p.send(Frame::Data {
                stream_id: d,
                flags: 0,
                data: b"hello ".to_vec(),
            })
            .await;
            p.send(Frame::Data {
                stream_id: d,
                flags: FLAG_FIN,
                data: format!("pair {n}").into_bytes(),
            })
            .await;
            let out = collect(&mut p, &[e, d]).await;
            assert_eq!(out[&d], format!("HELLO PAIR {n}").into_bytes());
            assert!(
                out[&e].is_empty(),
                "{:?}",
                String::from_utf8_lossy(&out[&e])
            );
        }

        // Nothing listens on a port just freed: the refusal comes on the error stream.
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let closed_port = free.local_addr().unwrap().port().to_string();
        drop(free);
        let h = [("port", closed_port.as_str()), ("requestID", "9")];
        open(&mut p, 9, "error", &h).await;
        open(&mut p, 11, "data", &h).await;
        let out = collect(&mut p, &[9, 11]).await;
        let msg = String::from_utf8(out[&9].clone()).unwrap();
        assert!(
            msg.contains(&format!("failed to connect to localhost:{closed_port}"))
                && msg.contains("sb1"),
            "{msg}"
        );
        assert!(out[&11].is_empty());

        // An invalid port, paired without requestID (data id = error id + 2).
        open(&mut p, 13, "error", &[("port", "0")]).await;
        open(&mut p, 15, "data", &[("port", "0")]).await;
        let out = collect(&mut p, &[13, 15]).await;
        assert!(String::from_utf8_lossy(&out[&13]).contains("invalid port"));

        // Neither error nor data: refused.
        open(&mut p, 17, "stdin", &[]).await;
        loop {
            match p.recv().await {
                Frame::RstStream { stream_id, status } => {
                    assert_eq!((stream_id, status), (17, rst::REFUSED_STREAM));
                    break;
                }
                Frame::SynReply { .. } => {}
                f => panic!("unexpected {f:?}"),
            }
        }
    }

    /// Error streams opened already half-closed, never paired: the connection does not count
    /// them as open, so the session bounds them itself.
    #[tokio::test]
    async fn half_pairs_are_bounded() {
        let mut p = session();
        let id = |i: usize| 2 * i as u32 + 1;
        for i in 0..=MAX_PENDING_PAIRS {
            open_error_half_closed(&mut p, id(i), "80", &i.to_string()).await;
        }
        let over = id(MAX_PENDING_PAIRS);
        loop {
            let f = tokio::time::timeout(Duration::from_secs(10), p.recv())
                .await
                .expect("a frame in time");
            match f {
                Frame::RstStream { stream_id, status } => {
                    assert_eq!((stream_id, status), (over, rst::REFUSED_STREAM));
                    break;
                }
                Frame::SynReply { .. } => {}
                f => panic!("unexpected {f:?}"),
            }
        }
    }

    /// A session forwards at most `MAX_FORWARDS` connections at once: the next pair is told so
    /// on its error stream and its data stream refused; a forward that ends frees its slot.
    #[tokio::test]
    async fn forwards_at_once_are_bounded_and_an_ended_one_frees_its_slot() {
        // A server in the "pod" that keeps every connection open.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port().to_string();
        let (accepted_tx, accepted) = watch::channel(0usize);
        tokio::spawn(async move {
            let mut held = Vec::new();
            loop {
                let (s, _) = listener.accept().await.unwrap();
                held.push(s);
                let _ = accepted_tx.send(held.len());
            }
        });
        let mut p = session();
        let ids = |i: usize| (4 * i as u32 + 1, 4 * i as u32 + 3);
        let pair = async |p: &mut Peer<tokio::io::DuplexStream>, i: usize| {
            let (e, d) = ids(i);
            let rid = i.to_string();
            let h = [("port", port.as_str()), ("requestID", rid.as_str())];
            // Error streams half-closed at once, as client-go does (they do not count as open).
            open_error_half_closed(p, e, &port, &rid).await;
            open(p, d, "data", &h).await;
        };
        for i in 0..=MAX_FORWARDS {
            pair(&mut p, i).await;
        }
        let (over_e, over_d) = ids(MAX_FORWARDS);
        let (mut told, mut refused) = (Vec::new(), false);
        while !refused || !told.ends_with(b"in this session") {
            let f = tokio::time::timeout(Duration::from_secs(20), p.recv())
                .await
                .expect("a frame in time");
            match f {
                Frame::RstStream { stream_id, status } => {
                    assert_eq!((stream_id, status), (over_d, rst::REFUSED_STREAM));
                    refused = true;
                }
                Frame::Data {
                    stream_id, data, ..
                } => {
                    assert_eq!(stream_id, over_e, "{:?}", String::from_utf8_lossy(&data));
                    told.extend(data);
                }
                _ => {}
            }
        }
        assert_eq!(
            String::from_utf8_lossy(&told),
            format!("more than {MAX_FORWARDS} connections forwarded at once in this session")
        );
        let mut watch = accepted.clone();
        let all = tokio::time::timeout(
            Duration::from_secs(20),
            watch.wait_for(|n| *n >= MAX_FORWARDS),
        )
        .await
        .is_ok();
        assert!(all, "{} accepted", *accepted.borrow());
        assert_eq!(*accepted.borrow(), MAX_FORWARDS);

        // The client ends one forward; the next pair is forwarded.
        p.send(Frame::RstStream {
            stream_id: ids(0).1,
            status: rst::CANCEL,
        })
        .await;
        // (Its slot is freed once its task has ended: a pair arriving just before is refused,
        // so new pairs are tried until one is forwarded.)
        let mut next = MAX_FORWARDS + 1;
        let deadline = Instant::now() + Duration::from_secs(20);
        while *accepted.borrow() == MAX_FORWARDS && Instant::now() < deadline {
            pair(&mut p, next).await;
            next += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(*accepted.borrow(), MAX_FORWARDS + 1);
    }

    /// A pod that answers and closes ends the forward by itself, error stream included: older
    /// clients wait for the error stream's end before they let go of the connection, so waiting
    /// for the client's reset instead would leave both sides waiting.
    #[tokio::test]
    async fn a_closing_server_ends_the_forward_without_the_clients_reset() {
        let mut p = forward_to_a_banner_server().await;
        let out = collect(&mut p, &[1, 3]).await;
        assert_eq!(out[&3], b"banner\n");
        assert!(out[&1].is_empty());
    }

    /// A session forwarding one connection (error stream 1, data stream 3) to a server that
    /// talks first ("banner\n") and closes.
    async fn forward_to_a_banner_server() -> Peer<tokio::io::DuplexStream> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port().to_string();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            s.write_all(b"banner\n").await.unwrap();
        });
        let mut p = session();
        let h = [("port", port.as_str()), ("requestID", "0")];
        open(&mut p, 1, "error", &h).await;
        open(&mut p, 3, "data", &h).await;
        p
    }

    #[tokio::test]
    async fn a_closing_server_ends_the_data_stream() {
        // The client gets the server's bytes and a FIN.
        let mut p = forward_to_a_banner_server().await;
        let out = collect(&mut p, &[3]).await;
        assert_eq!(out[&3], b"banner\n");
        // The client resets its data stream, as client-go does; the error stream then ends.
        p.send(Frame::RstStream {
            stream_id: 3,
            status: rst::CANCEL,
        })
        .await;
        let out = collect(&mut p, &[1]).await;
        assert!(out[&1].is_empty());
    }
}

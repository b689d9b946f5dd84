//! Port-forward over WebSocket. The subprotocol the client asks for picks one of two forms:
//!
//! - [`TUNNEL_PROTOCOL`] (`SPDY/3.1+portforward.k8s.io`; client-go's tunnelling dialer, what
//!   `crictl port-forward -r websocket` and critest's `-websocket-portforward` use): SPDY/3.1
//!   carried in binary messages ([`super::tunnel`]), then exactly the SPDY session of
//!   [`crate::stream::portforward`] (pairs of streams, any number of connections);
//! - [`CHANNEL_PROTOCOL`] (`v4.channel.k8s.io`, or no subprotocol: the kubelet's channel form,
//!   [`serve_channels`]): one connection per port named in the URL's `port` query parameters
//!   (at least one, at most [`MAX_PORTS`]); port `i` has the data channel `2i` and the error
//!   channel `2i+1`. The server's first message on each of those channels is the port, two
//!   bytes little-endian; then the client's data messages go to the pod's socket and the
//!   socket's bytes come back as data messages; a failure is text on the error channel. A
//!   port's forward ends when the pod closes its socket; when every port's has ended, the
//!   server closes the connection (the client has no half-close here). The client closing the
//!   connection stops them all.
//!
//! Both charge what they buffer to the pod's share of the node's port-forward total
//! ([`minicri_codecs::budget`]): the WebSocket connection's own buffers when the session starts
//! ([`SESSION_BYTES`], [`TUNNEL_BYTES`]), each message of the client until it is handed on (in
//! the tunnelled form, to the SPDY connection inside: relays), and what goes back to the client
//! until it is written. Both hold the stall timeout ([`Bounds::stall`]): the WebSocket
//! connection to a client that takes no frame within it is closed (logged with the pod, its
//! ports and the setting), and a port whose pod takes no byte within it is closed with the
//! reason on its error channel (in the tunnelled form, the forward's error stream).

use std::sync::Arc;

use std::time::Duration;

use minicri_codecs::budget::{self, InputTx, Share};
use minicri_codecs::spdy::liveness;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::channels::ChannelWriter;
use super::close;
use super::conn::{self, Event};
use crate::stream::portforward::{
    self, Bounds, Carrier, PortForwardRequest, client_to_socket, dial, parse_port, pod_stalled,
    socket_to_client,
};
use crate::stream::session::{LINGER, Output};

/// The subprotocol of SPDY tunnelled through WebSocket.
pub const TUNNEL_PROTOCOL: &str = "SPDY/3.1+portforward.k8s.io";
/// The subprotocol of the channel form.
pub const CHANNEL_PROTOCOL: &str = "v4.channel.k8s.io";
/// Ports one channel-form session may forward (channel numbers are one byte).
pub const MAX_PORTS: usize = 128;
/// Messages queued per port before the demux (and so the connection's reader) waits.
const INPUT_QUEUE: usize = 4;

/// What a WebSocket port-forward session's connection buffers of its own, charged when it
/// starts: the reader's buffer (64 KiB). Messages being put together are charged as they
/// arrive ([`super::conn`]).
pub const SESSION_BYTES: usize = 64 << 10;

/// What the tunnelled form adds, charged with [`SESSION_BYTES`]: its pipe (64 KiB each way) and
/// its read buffer (32 KiB); the SPDY connection inside charges its own
/// ([`crate::stream::portforward::SESSION_BYTES`]).
pub const TUNNEL_BYTES: usize = 160 << 10;

/// The ports of a channel-form request: every `port=` query parameter (1 to 65535), at least
/// one, at most [`MAX_PORTS`].
pub fn ports_from_query(query: Option<&str>) -> Result<Vec<u16>, String> {
    let mut ports = Vec::new();
    for pair in query.unwrap_or("").split('&') {
        if let Some(v) = pair.strip_prefix("port=") {
            ports.push(parse_port(Some(v))?);
        }
    }
    if ports.is_empty() {
        return Err("the query parameter port is required (at least one port to forward)".into());
    }
    if ports.len() > MAX_PORTS {
        return Err(format!(
            "{} ports asked for: at most {MAX_PORTS} per connection",
            ports.len()
        ));
    }
    Ok(ports)
}

/// Serves the tunnelled form on `io` (the handshake is done).
pub async fn serve_tunnel<IO>(io: IO, req: PortForwardRequest, bounds: Bounds)
where
    IO: AsyncRead + AsyncWrite + Send + 'static,
{
    let share = &bounds.share;
    let _own = share.charge_session(SESSION_BYTES + TUNNEL_BYTES).await;
    // The client's messages go on to the SPDY connection's buffers: relays.
    let (c, events) = conn::serve_budgeted(io, share.relay(), bounds.client_stall());
    let tunnel = super::tunnel::byte_stream(c, events, Some(share.clone()));
    let ended = portforward::run(tunnel.stream, req.clone(), bounds, Carrier::Tunnel).await;
    // A stall is the WebSocket connection's; the SPDY session inside only saw its end.
    let outer = tokio::time::timeout(LINGER, tunnel.ended).await;
    let reason = match outer {
        Ok(Ok(why)) if liveness::is_stall(&why) => why,
        _ => ended.reason.clone(),
    };
    portforward::log_end(&req, &ended, &reason);
}

/// Serves the channel form on `io` (the handshake is done) for `ports`.
pub async fn serve_channels<IO>(io: IO, req: PortForwardRequest, ports: Vec<u16>, bounds: Bounds)
where
    IO: AsyncRead + AsyncWrite + Send + 'static,
{
    let share = &bounds.share;
    let _own = share.charge_session(SESSION_BYTES).await;
    let (c, events) = conn::serve_budgeted(io, share.clone(), bounds.client_stall());
    let req = Arc::new(req);
    let (gone_tx, gone) = watch::channel(false);
    let mut inputs = Vec::new();
    let mut forwards = tokio::task::JoinSet::new();
    for (i, port) in ports.iter().copied().enumerate() {
        let (tx, rx) = budget::input(INPUT_QUEUE);
        inputs.push(tx);
        let data = (2 * i) as u8;
        for channel in [data, data + 1] {
            let mut m = vec![channel];
            m.extend_from_slice(&port.to_le_bytes());
            if c.sender.send(m).await.is_err() {
                return;
            }
        }
        let (req, sender, gone) = (req.clone(), c.sender.clone(), gone.clone());
        let to = Port {
            port,
            channel: data,
            share: share.clone(),
            stall: bounds.stall,
        };
        forwards.spawn(forward(req, to, rx, sender, gone));
    }
    let (reason_tx, reason) = tokio::sync::oneshot::channel();
    tokio::spawn(demux(events, c.ended.clone(), inputs, gone_tx, reason_tx));
    let mut gone_now = gone.clone();
    let client_gone = tokio::select! {
        _ = async { while forwards.join_next().await.is_some() {} } => false,
        _ = gone_now.wait_for(|g| *g) => true,
    };
    forwards.abort_all();
    // Why the connection ended, if it did (the demux says so right after it saw it go).
    let why = match client_gone {
        true => reason.await.unwrap_or_default(),
        false => String::new(),
    };
    match why {
        why if liveness::is_stall(&why) => tracing::warn!(
            sandbox = %req.sandbox_id,
            ?ports,
            reason = %why,
            "port-forward session closed: its client stopped reading"
        ),
        _ => tracing::debug!(
            sandbox = %req.sandbox_id,
            ?ports,
            "port-forward (WebSocket channels) ended"
        ),
    }
    c.finish(close::NORMAL, LINGER).await;
}

/// Routes the client's data messages to their ports until the connection ends; then says why
/// it ended (nothing if the session went first).
async fn demux(
    mut events: mpsc::Receiver<Event>,
    ended: CancellationToken,
    inputs: Vec<InputTx>,
    gone: watch::Sender<bool>,
    reason: tokio::sync::oneshot::Sender<String>,
) {
    // A message's charge goes with its bytes to the port (less the channel byte, dropped).
    let why = loop {
        let (m, charge) = match events.recv().await {
            Some(Event::Message(m, charge)) => (m, charge),
            Some(Event::Closed(why)) => break why,
            None => break String::new(),
        };
        let Some((&channel, data)) = m.split_first() else {
            continue;
        };
        // Only data channels (even) carry input; the error channels are the server's.
        if channel % 2 == 0
            && let Some(tx) = inputs.get(usize::from(channel / 2))
            && !data.is_empty()
            && !conn::deliver(tx, data.to_vec(), charge, &ended).await
            && ended.is_cancelled()
        {
            // The rest of the events: up to the reason.
            let mut why = String::new();
            while let Some(ev) = events.recv().await {
                if let Event::Closed(r) = ev {
                    why = r;
                }
            }
            break why;
        }
    };
    drop(inputs);
    let _ = gone.send(true);
    let _ = reason.send(why);
}

/// One port of a channel-form session.
struct Port {
    port: u16,
    /// Its data channel (the error channel is the next).
    channel: u8,
    share: Share,
    stall: Option<Duration>,
}

/// One port's connection: until the pod closes the socket, stalls, or the client goes.
async fn forward(
    req: Arc<PortForwardRequest>,
    to: Port,
    from_client: budget::Input,
    sender: conn::Sender,
    mut gone: watch::Receiver<bool>,
) {
    let error = ChannelWriter::new(to.channel + 1, sender.clone());
    let fail = async |msg: String| {
        tracing::info!(sandbox = %req.sandbox_id, error = %msg, "port-forward failed");
        let _ = error.write(msg.as_bytes()).await;
    };
    let socket = match dial(&req, to.port).await {
        Ok(s) => s,
        Err(msg) => return fail(msg).await,
    };
    let (rd, wr) = socket.into_split();
    // Aborted with this forward, also when the session aborts it (a spawned task outlives its
    // JoinHandle): else its copy, blocked on a pod that does not read, would hold the client's
    // queued bytes against the pod's share until the stall timeout.
    let mut to_socket = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(client_to_socket(
        from_client,
        wr,
        to.stall,
    )));
    let to_client = async {
        let data = Output::Ws(ChannelWriter::new(to.channel, sender.clone()));
        if let Err(msg) = socket_to_client(rd, &data, &to.share).await {
            let _ = error.write(msg.as_bytes()).await;
        }
    };
    let stalled = tokio::select! {
        () = to_client => None,
        _ = gone.wait_for(|g| *g) => None,
        Ok(Err(after)) = &mut to_socket => Some(after),
    };
    to_socket.abort();
    if let Some(after) = stalled {
        fail(pod_stalled(&req, to.port, after)).await;
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;

    use super::super::opcode;
    use super::super::tests::Client;
    use super::*;

    /// A client of the channel form that stops reading while its pod sends without end: its
    /// connection is closed after the stall timeout, and what the session held is given back.
    #[tokio::test]
    async fn a_client_that_stops_reading_is_closed_after_the_stall_timeout() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let zeros = vec![0u8; 64 << 10];
            while s.write_all(&zeros).await.is_ok() {}
        });
        let (a, b) = tokio::io::duplex(64 << 10);
        let budget = minicri_codecs::budget::Budget::new(64 << 20);
        let bounds = Bounds {
            share: budget.share("sb1"),
            stall: Some(Duration::from_millis(300)),
        };
        let req = PortForwardRequest {
            sandbox_id: "sb1".into(),
            netns: None,
        };
        let session = tokio::spawn(serve_channels(b, req, vec![port], bounds));
        let _client = Client::new(a);
        tokio::time::timeout(Duration::from_secs(10), session)
            .await
            .expect("the session is closed")
            .unwrap();
        assert_eq!(budget.in_use(), 0);
    }

    /// A port's forward aborted (as the session aborts its forwards once the client is gone)
    /// while its copy to a pod that reads nothing is blocked: the client's bytes it held and
    /// queued are given back at once, not at the stall timeout (none here).
    #[tokio::test]
    async fn an_aborted_forward_gives_its_queued_bytes_back() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        // The pod accepts and never reads.
        let pod = tokio::spawn(async move { listener.accept().await.unwrap() });
        let budget = minicri_codecs::budget::Budget::new(64 << 20);
        let share = budget.share("sb1");
        let (tx, rx) = budget::input(INPUT_QUEUE);
        let (a, b) = tokio::io::duplex(64 << 10);
        let (c, _events) = conn::serve_budgeted(b, share.clone(), None);
        let _client = Client::new(a);
        let (_gone_tx, gone) = watch::channel(false);
        let req = Arc::new(PortForwardRequest {
            sandbox_id: "sb1".into(),
            netns: None,
        });
        let to = Port {
            port,
            channel: 0,
            share: share.clone(),
            stall: None,
        };
        let forward = tokio::spawn(forward(req, to, rx, c.sender.clone(), gone));
        let _socket = pod.await.unwrap();
        // Pieces of 1 MiB until the socket's buffers are full and the queue holds the rest.
        let mut sent = 0;
        loop {
            let charge = share.charge(1 << 20).await;
            let piece = tx.send((vec![b'x'; 1 << 20], charge));
            match tokio::time::timeout(Duration::from_millis(500), piece).await {
                Ok(r) => r.unwrap(),
                Err(_) => break,
            }
            sent += 1;
        }
        assert!(sent > INPUT_QUEUE, "{sent} pieces went");
        assert!(budget.in_use() >= INPUT_QUEUE << 20, "{}", budget.in_use());
        forward.abort();
        let _ = forward.await;
        for _ in 0..100 {
            if budget.in_use() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            budget.in_use(),
            0,
            "bytes still charged after the forward went"
        );
    }

    #[test]
    fn ports_come_from_the_query() {
        assert_eq!(
            ports_from_query(Some("port=80&port=8080")),
            Ok(vec![80, 8080])
        );
        assert_eq!(ports_from_query(Some("x=1&port=22")), Ok(vec![22]));
        assert!(ports_from_query(None).is_err());
        assert!(ports_from_query(Some("port=0")).is_err());
        assert!(ports_from_query(Some("port=http")).is_err());
        let many: Vec<String> = (1..=129).map(|p| format!("port={p}")).collect();
        assert!(ports_from_query(Some(&many.join("&"))).is_err());
    }

    #[tokio::test]
    async fn forwards_each_port_on_its_channels() {
        // An upper-casing echo server that answers one line, then closes.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            let (r, mut w) = s.into_split();
            let mut line = String::new();
            tokio::io::AsyncBufReadExt::read_line(&mut tokio::io::BufReader::new(r), &mut line)
                .await
                .unwrap();
            w.write_all(line.to_ascii_uppercase().as_bytes())
                .await
                .unwrap();
        });
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let (a, b) = tokio::io::duplex(1 << 20);
        let req = PortForwardRequest {
            sandbox_id: "sb1".into(),
            netns: None,
        };
        let bounds = Bounds {
            share: minicri_codecs::budget::Budget::new(64 << 20).share("sb1"),
            stall: None,
        };
        tokio::spawn(serve_channels(b, req, vec![port, closed], bounds));
        let mut c = Client::new(a);
        let mut by_channel: std::collections::HashMap<u8, Vec<Vec<u8>>> = Default::default();
        // Each channel's first message is its port, little-endian.
        for _ in 0..4 {
            let (_, m) = c.recv().await.unwrap();
            by_channel.entry(m[0]).or_default().push(m[1..].to_vec());
        }
        assert_eq!(by_channel[&0], [port.to_le_bytes().to_vec()]);
        assert_eq!(by_channel[&1], [port.to_le_bytes().to_vec()]);
        assert_eq!(by_channel[&2], [closed.to_le_bytes().to_vec()]);
        assert_eq!(by_channel[&3], [closed.to_le_bytes().to_vec()]);
        c.send(opcode::BINARY, b"\x00hello\n").await;
        let mut data = Vec::new();
        let mut error = Vec::new();
        loop {
            match c.recv().await.unwrap() {
                (opcode::BINARY, m) if m[0] == 0 => data.extend_from_slice(&m[1..]),
                (opcode::BINARY, m) if m[0] == 3 => error.extend_from_slice(&m[1..]),
                (opcode::CLOSE, p) => {
                    assert_eq!(p, [0x03, 0xe8]);
                    break;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(data, b"HELLO\n");
        let error = String::from_utf8(error).unwrap();
        assert!(
            error.contains(&format!("failed to connect to localhost:{closed}")),
            "{error}"
        );
    }
}

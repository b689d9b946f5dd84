//! The server side of a WebSocket connection over an async byte stream (an upgraded HTTP/1.1
//! connection).
//!
//! Two tasks own the connection: the reader decodes the client's frames ([`super::Decoder`],
//! with its limits), answers pings with pongs, hands each whole binary message to the user as
//! an [`Event::Message`] (waiting while the user's queue is full, so a client that sends faster
//! than the session consumes is simply not read) and runs the closing handshake; the writer
//! sends frames in queue order.
//!
//! Closing: whoever closes first sends a close frame; the other answers with one (the status
//! code echoed). After a close frame has been queued nothing else is sent and the writer shuts
//! the write side down. [`Event::Closed`] is the reader's last event: the client's close frame,
//! EOF, an I/O error or a broken rule (then a close frame with the rule's code is sent first).
//! [`Conn::finish`] closes from the server side and waits a bounded time for the client's
//! answer.
//!
//! Served with a pod's [`Share`] of a budget ([`serve_budgeted`], port-forward's), the bytes of
//! each read are charged before the decoder takes them (frames and fragments being put together
//! included; the rest of a message under way is a top-up, [`Share::top_up`]), a whole
//! message's part going with it ([`Event::Message`]), and messages sent with
//! [`Sender::send_charged`] hold theirs until written. See [`minicri_codecs::budget`]. Served
//! with a [`Stall`] limit too, a frame the client does not take within it ends the connection
//! ([`minicri_codecs::spdy::liveness`]); nothing more is sent then, not even a close frame.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use minicri_codecs::budget::{Charge, InputTx, Share};
use minicri_codecs::spdy::liveness::{IDLE_TIMEOUT, KEEPALIVE, Liveness, Stall};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{Decoder, MAX_MESSAGE, Message, close, close_payload, encode, opcode};

/// Whole messages queued for the user before the reader stops reading.
const EVENT_QUEUE: usize = 4;
/// Frames queued for the writer.
const OUT_QUEUE: usize = 64;

/// What the connection tells its user.
#[derive(Debug)]
pub enum Event {
    /// A whole binary message, with its charge (none on a connection without a budget).
    Message(Vec<u8>, Charge),
    /// The connection ended (why); the last event.
    Closed(String),
}

/// The connection is closing or closed: nothing more can be sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Closed;

/// Sends messages on a connection; cheap to clone.
#[derive(Clone)]
pub struct Sender {
    out: mpsc::Sender<(u8, Vec<u8>, Charge)>,
    /// A close frame has been queued.
    closing: Arc<AtomicBool>,
}

impl std::fmt::Debug for Sender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ws::Sender")
    }
}

impl Sender {
    /// Sends `data` as one binary message (waits while the writer's queue is full).
    pub async fn send(&self, data: Vec<u8>) -> Result<(), Closed> {
        self.send_charged(data, Charge::none()).await
    }

    /// [`Sender::send`], holding `charge` until the message is written.
    pub async fn send_charged(&self, data: Vec<u8>, charge: Charge) -> Result<(), Closed> {
        if self.closing.load(Ordering::SeqCst) {
            return Err(Closed);
        }
        self.out
            .send((opcode::BINARY, data, charge))
            .await
            .map_err(|_| Closed)
    }

    /// Queues a close frame (once; later calls do nothing).
    pub async fn close(&self, code: u16, reason: &str) {
        if !self.closing.swap(true, Ordering::SeqCst) {
            let _ = self
                .out
                .send((opcode::CLOSE, close_payload(code, reason), Charge::none()))
                .await;
        }
    }

    async fn pong(&self, payload: Vec<u8>) {
        if !self.closing.load(Ordering::SeqCst) {
            let _ = self.out.send((opcode::PONG, payload, Charge::none())).await;
        }
    }
}

/// A served connection: its sender and its reader.
pub struct Conn {
    pub sender: Sender,
    /// Cancelled when the reader ends, before it sends [`Event::Closed`]: a user waiting on a
    /// consumer of its own (not reading events meanwhile) stops waiting ([`deliver`]).
    pub ended: CancellationToken,
    reader: tokio::task::JoinHandle<()>,
    writer: tokio::task::JoinHandle<()>,
}

/// Hands `data` to a consumer's queue, waiting while it is full, unless the connection ends
/// first. False if it was not delivered (the consumer is gone or the connection ended).
pub async fn deliver(
    tx: &InputTx,
    data: Vec<u8>,
    charge: Charge,
    ended: &CancellationToken,
) -> bool {
    tokio::select! {
        r = tx.send((data, charge)) => r.is_ok(),
        () = ended.cancelled() => false,
    }
}

impl Conn {
    /// Closes from the server side (`code`), gives the client up to `linger` to answer with its
    /// close frame (or to hang up), then drops the connection (also when the client reads
    /// nothing, so the close frame cannot even be queued).
    pub async fn finish(self, code: u16, linger: Duration) {
        let mut reader = self.reader;
        let answered = tokio::time::timeout(linger, async {
            self.sender.close(code, "").await;
            let _ = (&mut reader).await;
        })
        .await;
        if answered.is_err() {
            reader.abort();
            self.writer.abort();
        }
    }
}

/// Starts serving `io` as the server side of a WebSocket connection whose handshake is done.
pub fn serve<IO>(io: IO) -> (Conn, mpsc::Receiver<Event>)
where
    IO: AsyncRead + AsyncWrite + Send + 'static,
{
    serve_with(io, IDLE_TIMEOUT, KEEPALIVE)
}

/// [`serve`], charging the client's messages to `share`, and ending the connection when the
/// client stalls past `stall` (see the module docs).
pub fn serve_budgeted<IO>(
    io: IO,
    share: Share,
    stall: Option<Stall>,
) -> (Conn, mpsc::Receiver<Event>)
where
    IO: AsyncRead + AsyncWrite + Send + 'static,
{
    start(
        io,
        Liveness::new(IDLE_TIMEOUT, KEEPALIVE, stall),
        Some(share),
    )
}

/// [`serve`], ending the connection after `idle` without a frame either way, and pinging the
/// client after `keepalive` without a frame to send.
pub fn serve_with<IO>(io: IO, idle: Duration, keepalive: Duration) -> (Conn, mpsc::Receiver<Event>)
where
    IO: AsyncRead + AsyncWrite + Send + 'static,
{
    start(io, Liveness::new(idle, keepalive, None), None)
}

fn start<IO>(io: IO, live: Liveness, budget: Option<Share>) -> (Conn, mpsc::Receiver<Event>)
where
    IO: AsyncRead + AsyncWrite + Send + 'static,
{
    let (rd, wr) = tokio::io::split(io);
    let (out_tx, out_rx) = mpsc::channel(OUT_QUEUE);
    let (ev_tx, ev_rx) = mpsc::channel(EVENT_QUEUE);
    let sender = Sender {
        out: out_tx,
        closing: Arc::new(AtomicBool::new(false)),
    };
    let ended = CancellationToken::new();
    let writer = tokio::spawn(write_loop(wr, out_rx, live.clone()));
    let reader = tokio::spawn(read_loop(
        rd,
        sender.clone(),
        ev_tx,
        live,
        ended.clone(),
        budget,
    ));
    (
        Conn {
            sender,
            ended,
            reader,
            writer,
        },
        ev_rx,
    )
}

async fn write_loop<W: AsyncWrite + Unpin>(
    wr: W,
    mut rx: mpsc::Receiver<(u8, Vec<u8>, Charge)>,
    live: Liveness,
) {
    let mut wr = BufWriter::new(wr);
    let mut buf = Vec::new();
    loop {
        // A charged message's charge goes once it is in the connection's buffer.
        let ((op, payload, _charge), keepalive) =
            match tokio::time::timeout(live.keepalive(), rx.recv()).await {
                Ok(Some(item)) => (item, false),
                Ok(None) => break,
                Err(_) => ((opcode::PING, Vec::new(), Charge::none()), true),
            };
        buf.clear();
        encode(op, &payload, &mut buf);
        let write = async {
            wr.write_all(&buf).await?;
            // Flush when nothing else is queued: batches frames without delaying the last one.
            if rx.is_empty() || op == opcode::CLOSE {
                wr.flush().await?;
            }
            Ok::<_, std::io::Error>(())
        };
        let Some(res) = live.within_stall("a frame sent to it", write).await else {
            // Shutting down would flush to a client that does not read: the connection is
            // dropped, and what is queued (with its charges) with it.
            return;
        };
        if res.is_err() {
            live.write_failed();
            break;
        }
        if !keepalive {
            live.touch();
        }
        if op == opcode::CLOSE {
            break;
        }
    }
    let _ = wr.shutdown().await;
}

async fn read_loop<R: AsyncRead + Unpin>(
    mut rd: R,
    sender: Sender,
    events: mpsc::Sender<Event>,
    live: Liveness,
    ended: CancellationToken,
    budget: Option<Share>,
) {
    let mut decoder = Decoder::new(MAX_MESSAGE);
    let mut buf = vec![0u8; 64 * 1024];
    // The budget's bytes held for what the decoder holds (none without a budget).
    let mut held = Charge::none();
    // One future for the whole connection: it re-reads the last activity when it wakes.
    let over = live.over();
    tokio::pin!(over);
    let reason = loop {
        // Handing a message over may wait for the user: the connection can end meanwhile.
        let step = async {
            let n = match rd.read(&mut buf).await {
                Ok(0) => return Err("the client hung up".to_string()),
                Ok(n) => n,
                Err(e) => return Err(format!("reading the connection: {e}")),
            };
            live.touch();
            // What the decoder will hold is charged before it takes the bytes; a whole
            // message takes its part along, and the rest is trimmed to what the decoder
            // still holds once it has given out what it could. A read that continues what the
            // decoder holds only waits for the total, not for the pod's share: the pod's
            // readers must not each hold part of a message waiting for the others' bytes.
            let more = match &budget {
                Some(share) if held.bytes() > 0 => share.top_up(n).await,
                Some(share) => share.charge(n).await,
                None => Charge::none(),
            };
            held.merge(more);
            decoder.feed(&buf[..n]);
            loop {
                match decoder.next_message() {
                    Ok(None) => {
                        let over = held.bytes().saturating_sub(decoder.held());
                        drop(held.split(over));
                        return Ok(());
                    }
                    Ok(Some(Message::Binary(m))) => {
                        // A user that stopped listening just does not want the data.
                        let charge = held.split(m.len());
                        let _ = events.send(Event::Message(m, charge)).await;
                    }
                    Ok(Some(Message::Ping(p))) => sender.pong(p).await,
                    Ok(Some(Message::Pong(_))) => {}
                    Ok(Some(Message::Close(code, reason))) => {
                        // The answer echoes the client's code (none: a normal closure).
                        sender.close(code.unwrap_or(close::NORMAL), "").await;
                        return Err(format!(
                            "the client closed the connection ({}{}{reason})",
                            code.map_or("no code".to_string(), |c| c.to_string()),
                            if reason.is_empty() { "" } else { ": " }
                        ));
                    }
                    Err(v) => {
                        tracing::debug!(error = %v, "WebSocket client broke the protocol");
                        sender.close(v.code, &v.reason).await;
                        return Err(v.to_string());
                    }
                }
            }
        };
        tokio::select! {
            r = step => if let Err(reason) = r {
                break reason;
            },
            reason = &mut over => break reason,
        }
    };
    // Whatever ended the connection, the writer ends too (a no-op if closing already).
    ended.cancel();
    sender.close(close::NORMAL, "").await;
    let _ = events.send(Event::Closed(reason)).await;
}

#[cfg(test)]
mod tests {
    use super::super::tests::{Client, client_frame};
    use super::*;

    fn start() -> (Client<tokio::io::DuplexStream>, Conn, mpsc::Receiver<Event>) {
        let (a, b) = tokio::io::duplex(1 << 20);
        let (conn, ev) = serve(b);
        (Client::new(a), conn, ev)
    }

    /// With nothing to send, the server pings; once the client has hung up, the ping fails and
    /// the connection ends (the reader may be waiting on a consumer and not see the hang-up).
    #[tokio::test]
    async fn keepalive_pings_find_a_client_that_hung_up() {
        let (a, b) = tokio::io::duplex(1 << 20);
        let (_conn, mut ev) = serve_with(b, Duration::from_secs(3600), Duration::from_millis(200));
        let mut c = Client::new(a);
        let (op, payload) = c.recv().await.expect("a ping");
        assert_eq!((op, payload.len()), (opcode::PING, 0));
        drop(c);
        let why = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if let Some(Event::Closed(why)) = ev.recv().await {
                    break why;
                }
            }
        })
        .await
        .expect("the connection ended");
        // The reader saw EOF here (nothing held it); either way it ended.
        assert!(
            why == "the client hung up" || why == "writing to the client failed",
            "{why}"
        );
    }

    #[tokio::test]
    async fn messages_flow_both_ways_and_pings_are_answered() {
        let (mut c, conn, mut ev) = start();
        c.send(opcode::BINARY, b"\x00hello").await;
        match ev.recv().await.unwrap() {
            Event::Message(m, _) => assert_eq!(m, b"\x00hello"),
            e => panic!("{e:?}"),
        }
        // Fragments make one message; a ping between them is answered at once.
        c.raw(&client_frame(false, opcode::BINARY, b"ab")).await;
        c.raw(&client_frame(true, opcode::PING, b"p1")).await;
        assert_eq!(c.recv().await, Some((opcode::PONG, b"p1".to_vec())));
        c.raw(&client_frame(true, opcode::CONTINUATION, b"cd"))
            .await;
        match ev.recv().await.unwrap() {
            Event::Message(m, _) => assert_eq!(m, b"abcd"),
            e => panic!("{e:?}"),
        }
        conn.sender.send(b"\x01out".to_vec()).await.unwrap();
        assert_eq!(c.recv().await, Some((opcode::BINARY, b"\x01out".to_vec())));
        // The server closes: a close frame, then nothing; the client answers and it ends.
        let sender = conn.sender.clone();
        let finishing = tokio::spawn(conn.finish(close::NORMAL, Duration::from_secs(5)));
        assert_eq!(c.recv().await, Some((opcode::CLOSE, vec![0x03, 0xe8])));
        assert_eq!(sender.send(b"late".to_vec()).await, Err(Closed));
        c.send(opcode::CLOSE, &[0x03, 0xe8]).await;
        tokio::time::timeout(Duration::from_secs(5), finishing)
            .await
            .expect("the close handshake completes")
            .unwrap();
        assert!(matches!(ev.recv().await, Some(Event::Closed(r)) if r.contains("1000")));
        assert_eq!(c.recv().await, None, "the server's side is shut down");
    }

    #[tokio::test]
    async fn a_client_close_is_echoed() {
        let (mut c, conn, mut ev) = start();
        c.send(opcode::CLOSE, &[0x03, 0xe9, b'b', b'y', b'e']).await;
        assert_eq!(c.recv().await, Some((opcode::CLOSE, vec![0x03, 0xe9])));
        assert_eq!(c.recv().await, None);
        match ev.recv().await.unwrap() {
            Event::Closed(r) => assert!(r.contains("1001: bye"), "{r}"),
            e => panic!("{e:?}"),
        }
        assert_eq!(conn.sender.send(vec![1]).await, Err(Closed));
    }

    #[tokio::test]
    async fn broken_rules_close_the_connection_with_their_code() {
        let cases: Vec<(Vec<u8>, u16)> = vec![
            // Unmasked.
            (vec![0x82, 0x01, 0x00], close::PROTOCOL_ERROR),
            // A text message.
            (
                client_frame(true, opcode::TEXT, b"hi"),
                close::UNSUPPORTED_DATA,
            ),
            // A fragmented ping.
            (
                client_frame(false, opcode::PING, b""),
                close::PROTOCOL_ERROR,
            ),
            // A continuation of nothing.
            (
                client_frame(true, opcode::CONTINUATION, b"x"),
                close::PROTOCOL_ERROR,
            ),
            // A frame announcing 2^40 bytes: refused before anything is buffered.
            (
                {
                    let mut f = vec![0x82, 0x80 | 127];
                    f.extend_from_slice(&(1u64 << 40).to_be_bytes());
                    f.extend_from_slice(&[0, 0, 0, 0]);
                    f
                },
                close::TOO_BIG,
            ),
        ];
        for (frame, code) in cases {
            let (mut c, _conn, mut ev) = start();
            c.raw(&frame).await;
            match c.recv().await {
                Some((opcode::CLOSE, p)) => {
                    assert_eq!(u16::from_be_bytes([p[0], p[1]]), code, "{frame:?}")
                }
                other => panic!("{frame:?}: {other:?}"),
            }
            assert!(matches!(ev.recv().await, Some(Event::Closed(_))));
        }
    }

    #[tokio::test]
    async fn a_slow_user_stops_the_reading_not_the_memory() {
        let (mut c, _conn, mut ev) = start();
        // Many messages while the user reads none: the reader holds EVENT_QUEUE, then waits.
        // 4 MiB in all, four times what the in-memory connection buffers.
        let message = |i: u32| {
            let mut m = i.to_be_bytes().to_vec();
            m.resize(4096, 7);
            m
        };
        let writer = tokio::spawn(async move {
            for i in 0..1024u32 {
                c.send(opcode::BINARY, &message(i)).await;
            }
            c
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!writer.is_finished(), "the client is held up, not buffered");
        for i in 0..1024u32 {
            match ev.recv().await.unwrap() {
                Event::Message(m, _) => assert_eq!(m, message(i)),
                e => panic!("{e:?}"),
            }
        }
        writer.await.unwrap();
    }

    #[tokio::test]
    async fn eof_ends_the_connection() {
        let (c, _conn, mut ev) = start();
        drop(c);
        match ev.recv().await.unwrap() {
            Event::Closed(r) => assert!(r.contains("hung up"), "{r}"),
            e => panic!("{e:?}"),
        }
        assert!(ev.recv().await.is_none());
    }
}

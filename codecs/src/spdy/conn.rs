//! The server side of a SPDY/3.1 connection over an async byte stream (an upgraded HTTP/1.1
//! connection).
//!
//! Two tasks own the connection: the reader decodes frames, answers SYN_STREAM with SYN_REPLY,
//! echoes the peer's PINGs, applies WINDOW_UPDATE / SETTINGS to the [`SendWindows`] and hands
//! each new stream, with a channel of its DATA, to the user as an [`Event::Stream`]; the writer
//! encodes every outgoing frame in queue order, which keeps the header compressor's zlib stream
//! in wire order and puts each SYN_REPLY before any DATA of its stream.
//!
//! Invariants: streams are opened only by the peer (odd, increasing ids; anything else gets
//! RST_STREAM PROTOCOL_ERROR); a stream's DATA channel ends at the peer's FIN or RST_STREAM; a
//! [`StreamWriter`] stops at the peer's RST_STREAM or after its own FIN; when the connection
//! ends (EOF, I/O or protocol error, [`Handle::close`]) every channel ends, waiting writers give
//! up and [`Event::Closed`] is the last event.
//!
//! A connection served with a pod's [`Share`] of a budget ([`serve_budgeted`], port-forward's)
//! charges what it buffers of the peer's DATA: a DATA frame's payload before it is read (twice a
//! frame larger than [`MAX_DATA_CHUNK`], which is copied into pieces), each piece's part going
//! with it to its consumer ([`Input`]); DATA this side sends with
//! [`StreamWriter::write_charged`] holds its charge until the writer has written it. See
//! [`crate::budget`]. Served with a [`Stall`] limit too, a frame the client does not take within
//! it, or a stream's flow-control window it does not open within it, ends the connection
//! ([`super::liveness`]): what the client does not read is then no longer held.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::sync::{mpsc, oneshot};

use super::flow::{RecvWindow, SendBlocked, SendWindows};
use super::headers::{HeaderCompressor, HeaderDecompressor, Headers};
use super::liveness::{IDLE_TIMEOUT, KEEPALIVE, Liveness, Stall};
use super::{FLAG_FIN, FLAG_UNIDIRECTIONAL, Frame, SpdyError, decode, encode, goaway, rst};
use crate::budget::{self, Charge, Input, InputTx, Share};

/// Largest DATA frame this side sends.
pub const MAX_DATA_CHUNK: usize = 32 * 1024;
/// Pieces of DATA (each at most [`MAX_DATA_CHUNK`]) of one stream buffered for its reader before
/// the connection's reader waits: 256 KiB. Peers do not honour flow control (see `flow`), so this
/// and the socket are what holds a fast writer back; a frame of up to 1 MiB is queued in pieces,
/// so a stream nobody reads holds at most this much, whatever the frames' size.
const DATA_QUEUE: usize = 8;
/// Streams a peer may hold open (not yet half-closed by it) in one session: exec and attach use
/// up to five, port-forward two per forwarded connection. More are refused with REFUSED_STREAM.
pub const MAX_OPEN_STREAMS: usize = 1024;

/// What the connection tells its user.
#[derive(Debug)]
pub enum Event {
    /// The peer opened a stream; it has been answered with SYN_REPLY.
    Stream(IncomingStream),
    /// The connection ended: the peer closed it or sent garbage, or I/O failed. Last event.
    Closed(String),
}

/// A stream the peer opened.
#[derive(Debug)]
pub struct IncomingStream {
    pub id: u32,
    pub headers: Headers,
    /// The peer's DATA; ends at its FIN or RST_STREAM (or when the connection ends).
    pub data: Input,
    pub writer: StreamWriter,
}

enum Outgoing {
    Frame(Frame),
    /// A frame whose bytes are charged until it is written.
    Charged(Frame, Charge),
    /// Flush, shut the write side down, then answer.
    Shutdown(oneshot::Sender<()>),
}

/// Sends DATA on one stream.
#[derive(Clone)]
pub struct StreamWriter {
    id: u32,
    out: mpsc::Sender<Outgoing>,
    windows: Arc<SendWindows>,
    /// The connection's, for its stall limit on flow-control windows.
    live: Liveness,
}

impl std::fmt::Debug for StreamWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StreamWriter({})", self.id)
    }
}

impl StreamWriter {
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Takes up to `want` bytes of the send windows, waiting for the peer's WINDOW_UPDATE at most
    /// the connection's stall limit (then the connection is over).
    async fn reserve(&self, want: usize) -> Result<usize, SendBlocked> {
        let what = format!("a flow-control window for stream {}", self.id);
        let wait = self.windows.reserve(self.id, want);
        self.live
            .within_stall(&what, wait)
            .await
            .unwrap_or(Err(SendBlocked::Closed))
    }

    /// Sends `data` as DATA frames of at most [`MAX_DATA_CHUNK`] bytes, within the send windows.
    pub async fn write(&self, mut data: &[u8]) -> Result<(), SendBlocked> {
        while !data.is_empty() {
            let n = self.reserve(data.len().min(MAX_DATA_CHUNK)).await?;
            let frame = Frame::Data {
                stream_id: self.id,
                flags: 0,
                data: data[..n].to_vec(),
            };
            self.out
                .send(Outgoing::Frame(frame))
                .await
                .map_err(|_| SendBlocked::Closed)?;
            data = &data[n..];
        }
        Ok(())
    }

    /// Sends `data` (at most [`MAX_DATA_CHUNK`] bytes), holding `charge` until the connection's
    /// writer has written it: as one DATA frame without a copy when the send windows allow it
    /// (always with Kubernetes' clients, which do no flow control), else in pieces as the
    /// windows open (copies, which [`StreamWriter::flow_controlled`] tells the caller to charge
    /// for).
    pub async fn write_charged(&self, data: Vec<u8>, charge: Charge) -> Result<(), SendBlocked> {
        if data.is_empty() {
            return Ok(());
        }
        let n = self.reserve(data.len()).await?;
        if n == data.len() {
            let frame = Frame::Data {
                stream_id: self.id,
                flags: 0,
                data,
            };
            return self
                .out
                .send(Outgoing::Charged(frame, charge))
                .await
                .map_err(|_| SendBlocked::Closed);
        }
        // The peer's window took only `n`: the rest follows as the windows open.
        let first = Frame::Data {
            stream_id: self.id,
            flags: 0,
            data: data[..n].to_vec(),
        };
        self.out
            .send(Outgoing::Frame(first))
            .await
            .map_err(|_| SendBlocked::Closed)?;
        let res = self.write(&data[n..]).await;
        drop(charge);
        res
    }

    /// Whether the peer does flow control (so a write may be cut into copied pieces).
    pub fn flow_controlled(&self) -> bool {
        self.windows.enforced()
    }

    /// Half-closes the stream: an empty DATA frame with FIN. Later writes fail.
    pub async fn close(&self) -> Result<(), SendBlocked> {
        // Only a stream still open for sending gets its FIN.
        self.windows.try_reserve(self.id, 0)?;
        self.windows.close_stream(self.id);
        self.out
            .send(Outgoing::Frame(Frame::Data {
                stream_id: self.id,
                flags: FLAG_FIN,
                data: Vec::new(),
            }))
            .await
            .map_err(|_| SendBlocked::Closed)
    }

    /// Returns once the stream can no longer be sent on: this side closed or reset it, the peer
    /// reset it, or the connection ended.
    pub async fn gone(&self) {
        self.windows.gone(self.id).await
    }

    /// Aborts the stream with RST_STREAM `status`.
    pub async fn reset(&self, status: u32) {
        self.windows.close_stream(self.id);
        let _ = self
            .out
            .send(Outgoing::Frame(Frame::RstStream {
                stream_id: self.id,
                status,
            }))
            .await;
    }
}

/// The user's handle on a connection.
pub struct Handle {
    out: mpsc::Sender<Outgoing>,
    windows: Arc<SendWindows>,
    reader: tokio::task::JoinHandle<()>,
    writer: tokio::task::JoinHandle<()>,
    /// The last stream id the peer opened (for GOAWAY).
    last_id: Arc<AtomicU32>,
}

/// How long [`Handle::close`] waits for what is queued to reach a client.
const CLOSE_LINGER: Duration = Duration::from_secs(5);

impl Handle {
    /// Sends GOAWAY (status OK), flushes what is queued and closes the connection. A client
    /// that does not read gets [`CLOSE_LINGER`], then the connection is dropped.
    pub async fn close(self) {
        let graceful = async {
            let _ = self
                .out
                .send(Outgoing::Frame(Frame::GoAway {
                    last_good_stream_id: self.last_id.load(Ordering::Relaxed),
                    status: goaway::OK,
                }))
                .await;
            let (tx, rx) = oneshot::channel();
            if self.out.send(Outgoing::Shutdown(tx)).await.is_ok() {
                let _ = rx.await;
            }
        };
        let _ = tokio::time::timeout(CLOSE_LINGER, graceful).await;
        self.windows.shutdown();
        self.reader.abort();
        self.writer.abort();
    }
}

/// Starts serving `io` as the server side of a SPDY/3.1 connection.
pub fn serve<IO>(io: IO) -> (Handle, mpsc::Receiver<Event>)
where
    IO: AsyncRead + AsyncWrite + Send + 'static,
{
    serve_with(io, IDLE_TIMEOUT, KEEPALIVE)
}

/// [`serve`], charging the peer's DATA to `share`, and ending the connection when the client
/// stalls past `stall` (see the module docs).
pub fn serve_budgeted<IO>(
    io: IO,
    share: Share,
    stall: Option<Stall>,
) -> (Handle, mpsc::Receiver<Event>)
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
pub fn serve_with<IO>(
    io: IO,
    idle: Duration,
    keepalive: Duration,
) -> (Handle, mpsc::Receiver<Event>)
where
    IO: AsyncRead + AsyncWrite + Send + 'static,
{
    start(io, Liveness::new(idle, keepalive, None), None)
}

fn start<IO>(io: IO, live: Liveness, budget: Option<Share>) -> (Handle, mpsc::Receiver<Event>)
where
    IO: AsyncRead + AsyncWrite + Send + 'static,
{
    let (rd, wr) = tokio::io::split(io);
    let (out_tx, out_rx) = mpsc::channel(64);
    let (ev_tx, ev_rx) = mpsc::channel(16);
    let windows = Arc::new(SendWindows::new());
    let last_id = Arc::new(AtomicU32::new(0));
    let writer = tokio::spawn(write_loop(wr, out_rx, windows.clone(), live.clone()));
    let reader = Reader {
        live,
        shared_last_id: last_id.clone(),
        out: out_tx.clone(),
        events: ev_tx,
        windows: windows.clone(),
        streams: HashMap::new(),
        last_id: 0,
        goaway: false,
        session_recv: RecvWindow::default(),
        budget,
    };
    let reader = tokio::spawn(reader.run(rd));
    (
        Handle {
            out: out_tx,
            windows,
            reader,
            writer,
            last_id,
        },
        ev_rx,
    )
}

async fn write_loop<W: AsyncWrite + Unpin>(
    wr: W,
    mut rx: mpsc::Receiver<Outgoing>,
    windows: Arc<SendWindows>,
    live: Liveness,
) {
    let mut wr = BufWriter::new(wr);
    let mut z = HeaderCompressor::new();
    let mut buf = Vec::with_capacity(MAX_DATA_CHUNK + 64);
    // Pings this side starts have even ids.
    let mut ping_id = 0u32;
    loop {
        let (item, keepalive) = match tokio::time::timeout(live.keepalive(), rx.recv()).await {
            Ok(Some(item)) => (item, false),
            Ok(None) => break,
            Err(_) => {
                ping_id = ping_id.wrapping_add(2) & 0x7fff_fffe;
                (Outgoing::Frame(Frame::Ping { id: ping_id.max(2) }), true)
            }
        };
        // A charged frame's charge goes once its bytes are in the connection's buffer.
        let (frame, _charge) = match item {
            Outgoing::Frame(f) => (f, Charge::none()),
            Outgoing::Charged(f, c) => (f, c),
            Outgoing::Shutdown(done) => {
                let _ = wr.flush().await;
                let _ = wr.shutdown().await;
                let _ = done.send(());
                break;
            }
        };
        buf.clear();
        if let Err(e) = encode(&frame, &mut z, &mut buf) {
            tracing::warn!(error = %e, "cannot encode a SPDY frame");
            continue;
        }
        let write = async {
            wr.write_all(&buf).await?;
            // Flush when nothing else is queued: batches frames without delaying the last one.
            if rx.is_empty() {
                wr.flush().await?;
            }
            Ok::<_, std::io::Error>(())
        };
        let Some(res) = live.within_stall("a frame sent to it", write).await else {
            // What is queued, and its charges, go with the writer.
            break;
        };
        if let Err(e) = res {
            tracing::debug!(error = %e, "SPDY connection write failed");
            live.write_failed();
            break;
        }
        if !keepalive {
            live.touch();
        }
    }
    windows.shutdown();
}

struct StreamIn {
    /// `None` once the peer half-closed the stream.
    data: Option<InputTx>,
    recv: RecvWindow,
}

struct Reader {
    live: Liveness,
    out: mpsc::Sender<Outgoing>,
    events: mpsc::Sender<Event>,
    windows: Arc<SendWindows>,
    streams: HashMap<u32, StreamIn>,
    last_id: u32,
    shared_last_id: Arc<AtomicU32>,
    goaway: bool,
    session_recv: RecvWindow,
    /// What the peer's DATA is charged to (port-forward's connections).
    budget: Option<Share>,
}

impl Reader {
    async fn run<R: AsyncRead + Unpin>(mut self, rd: R) {
        let mut rd = BufReader::new(rd);
        let mut z = HeaderDecompressor::new();
        let live = self.live.clone();
        // One future for the whole connection: it re-reads the last activity when it wakes.
        let over = live.over();
        tokio::pin!(over);
        let reason = loop {
            // Handling a frame may wait for a stream's consumer: the connection can end meanwhile.
            let step = async {
                let (frame, charge) = match read_frame(&mut rd, &mut z, self.budget.as_ref()).await
                {
                    Ok(Some(f)) => f,
                    Ok(None) => return Err("the peer closed the connection".to_string()),
                    Err(e @ (SpdyError::Protocol(_) | SpdyError::Compression(_))) => {
                        let _ = self
                            .send(Frame::GoAway {
                                last_good_stream_id: self.last_id,
                                status: goaway::PROTOCOL_ERROR,
                            })
                            .await;
                        return Err(e.to_string());
                    }
                    Err(e) => return Err(format!("reading the connection: {e}")),
                };
                live.touch();
                self.handle(frame, charge).await
            };
            tokio::select! {
                r = step => if let Err(reason) = r {
                    break reason;
                },
                reason = &mut over => break reason,
            }
        };
        tracing::debug!(%reason, "SPDY connection ended");
        self.windows.shutdown();
        self.streams.clear();
        let _ = self.events.send(Event::Closed(reason)).await;
    }

    async fn send(&self, f: Frame) -> Result<(), String> {
        self.out
            .send(Outgoing::Frame(f))
            .await
            .map_err(|_| "the connection's writer is gone".to_string())
    }

    /// Handles one frame; `charge` is what a DATA frame's payload holds of the budget.
    async fn handle(&mut self, frame: Frame, mut charge: Charge) -> Result<(), String> {
        match frame {
            Frame::SynStream {
                stream_id,
                flags,
                headers,
                ..
            } => {
                if self.goaway {
                    return self
                        .send(Frame::RstStream {
                            stream_id,
                            status: rst::REFUSED_STREAM,
                        })
                        .await;
                }
                if stream_id % 2 == 0 || stream_id <= self.last_id {
                    return self
                        .send(Frame::RstStream {
                            stream_id,
                            status: rst::PROTOCOL_ERROR,
                        })
                        .await;
                }
                self.last_id = stream_id;
                self.shared_last_id.store(stream_id, Ordering::Relaxed);
                if self.streams.len() >= MAX_OPEN_STREAMS {
                    tracing::debug!(stream_id, "refused a SPDY stream: too many open");
                    return self
                        .send(Frame::RstStream {
                            stream_id,
                            status: rst::REFUSED_STREAM,
                        })
                        .await;
                }
                self.send(Frame::SynReply {
                    stream_id,
                    flags: 0,
                    headers: Headers::new(),
                })
                .await?;
                if flags & FLAG_UNIDIRECTIONAL == 0 {
                    self.windows.open_stream(stream_id);
                }
                let (tx, rx) = budget::input(DATA_QUEUE);
                // A stream the peer opened half-closed has nothing to read: not kept.
                if flags & FLAG_FIN == 0 {
                    self.streams.insert(
                        stream_id,
                        StreamIn {
                            data: Some(tx),
                            recv: RecvWindow::default(),
                        },
                    );
                }
                let stream = IncomingStream {
                    id: stream_id,
                    headers,
                    data: rx,
                    writer: StreamWriter {
                        id: stream_id,
                        out: self.out.clone(),
                        windows: self.windows.clone(),
                        live: self.live.clone(),
                    },
                };
                let _ = self.events.send(Event::Stream(stream)).await;
            }
            Frame::Data {
                stream_id,
                flags,
                data,
            } => {
                let len = data.len();
                let mut updates = Vec::new();
                let mut fin = false;
                if let Some(d) = self.session_recv.consumed(len) {
                    updates.push((0, d));
                }
                match self.streams.get_mut(&stream_id) {
                    Some(s) => {
                        if let Some(tx) = &s.data
                            && !data.is_empty()
                        {
                            // A reader that went away just means the data is not wanted.
                            if data.len() <= MAX_DATA_CHUNK {
                                let _ = tx.send((data, charge)).await;
                            } else {
                                for piece in data.chunks(MAX_DATA_CHUNK) {
                                    let share = charge.split(piece.len());
                                    if tx.send((piece.to_vec(), share)).await.is_err() {
                                        break;
                                    }
                                }
                            }
                        }
                        if flags & FLAG_FIN != 0 {
                            // The peer is done writing: nothing more is read for the stream
                            // (writes from this side go on through the send windows).
                            fin = true;
                        } else if let Some(d) = s.recv.consumed(len) {
                            updates.push((stream_id, d));
                        }
                    }
                    None if stream_id > self.last_id || stream_id % 2 == 0 => {
                        self.send(Frame::RstStream {
                            stream_id,
                            status: rst::INVALID_STREAM,
                        })
                        .await?;
                    }
                    // A stream that is gone already (reset, or half-closed by the peer): dropped.
                    None => {}
                }
                if fin {
                    self.streams.remove(&stream_id);
                }
                for (stream_id, delta) in updates {
                    self.send(Frame::WindowUpdate { stream_id, delta }).await?;
                }
            }
            Frame::Headers {
                stream_id, flags, ..
            } => {
                if flags & FLAG_FIN != 0 {
                    self.streams.remove(&stream_id);
                }
            }
            Frame::RstStream { stream_id, status } => {
                tracing::debug!(stream_id, status, "the peer reset a SPDY stream");
                self.streams.remove(&stream_id);
                self.windows.close_stream(stream_id);
            }
            Frame::Settings { entries, .. } => {
                for e in entries {
                    if e.id == super::SETTINGS_INITIAL_WINDOW_SIZE {
                        self.windows.set_initial_window(e.value);
                    }
                }
            }
            Frame::Ping { id } => {
                // Odd ids are the client's: echoed. Even ones would answer our own pings.
                if id % 2 == 1 {
                    self.send(Frame::Ping { id }).await?;
                }
            }
            Frame::GoAway { .. } => {
                // Streams already open carry on; new ones are refused.
                self.goaway = true;
            }
            Frame::WindowUpdate { stream_id, delta } => {
                if self.windows.window_update(stream_id, delta).is_err() {
                    if stream_id == 0 {
                        let _ = self
                            .send(Frame::GoAway {
                                last_good_stream_id: self.last_id,
                                status: goaway::PROTOCOL_ERROR,
                            })
                            .await;
                        return Err("session flow-control window overflow".into());
                    }
                    self.windows.close_stream(stream_id);
                    self.streams.remove(&stream_id);
                    self.send(Frame::RstStream {
                        stream_id,
                        status: rst::FLOW_CONTROL_ERROR,
                    })
                    .await?;
                }
            }
            Frame::SynReply { stream_id, .. } => {
                // This side never opens streams.
                self.send(Frame::RstStream {
                    stream_id,
                    status: rst::PROTOCOL_ERROR,
                })
                .await?;
            }
            Frame::Unknown { frame_type } => {
                tracing::debug!(frame_type, "skipped an unknown SPDY control frame");
            }
        }
        Ok(())
    }
}

/// Reads one frame; `None` at a clean end of the connection (EOF between frames). A DATA
/// frame's payload is charged to `budget` before it is read (twice when it is larger than
/// [`MAX_DATA_CHUNK`]: its pieces are copies while it lives).
async fn read_frame<R: AsyncRead + Unpin>(
    rd: &mut R,
    z: &mut HeaderDecompressor,
    budget: Option<&Share>,
) -> Result<Option<(Frame, Charge)>, SpdyError> {
    let mut header = [0u8; 8];
    let mut got = 0;
    while got < 8 {
        let n = rd.read(&mut header[got..]).await?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(SpdyError::Protocol(
                "connection ended inside a frame".into(),
            ));
        }
        got += n;
    }
    let len = super::payload_len(&header);
    if len > super::MAX_RECV_PAYLOAD {
        return Err(SpdyError::Protocol(format!(
            "a frame of {len} bytes, over the {} accepted",
            super::MAX_RECV_PAYLOAD
        )));
    }
    let is_data = header[0] & 0x80 == 0;
    let charge = match budget {
        Some(b) if is_data && len > MAX_DATA_CHUNK => b.charge(2 * len).await,
        Some(b) if is_data => b.charge(len).await,
        _ => Charge::none(),
    };
    let mut payload = vec![0u8; len];
    rd.read_exact(&mut payload).await?;
    decode(&header, payload, z).map(|f| Some((f, charge)))
}

#[cfg(test)]
mod tests {
    use super::super::test_peer::Peer;
    use super::super::{DEFAULT_WINDOW, Setting};
    use super::*;
    use tokio::io::DuplexStream;

    fn start() -> (Peer<DuplexStream>, Handle, mpsc::Receiver<Event>) {
        let (a, b) = tokio::io::duplex(1 << 20);
        let (h, ev) = serve(b);
        (Peer::new(a), h, ev)
    }

    #[tokio::test]
    async fn open_streams_are_bounded_and_half_closed_ones_forgotten() {
        let (mut peer, _handle, mut ev) = start();
        // The session's handler: keeps every stream it is given.
        tokio::spawn(async move {
            let mut kept = Vec::new();
            while let Some(e) = ev.recv().await {
                kept.push(e);
            }
        });
        let id = |i: usize| 2 * i as u32 + 1;
        for i in 0..MAX_OPEN_STREAMS {
            peer.open(id(i), "data").await;
        }
        let over = id(MAX_OPEN_STREAMS);
        peer.open(over, "data").await;
        loop {
            match peer.recv().await {
                Frame::RstStream { stream_id, status } => {
                    assert_eq!((stream_id, status), (over, rst::REFUSED_STREAM));
                    break;
                }
                Frame::SynReply { stream_id, .. } => assert!(stream_id < over),
                _ => {}
            }
        }
        // The peer half-closes one: its slot is free again.
        peer.send(Frame::Data {
            stream_id: id(0),
            flags: FLAG_FIN,
            data: Vec::new(),
        })
        .await;
        let next = id(MAX_OPEN_STREAMS + 1);
        peer.open(next, "data").await;
        loop {
            match peer.recv().await {
                Frame::SynReply { stream_id, .. } if stream_id == next => break,
                Frame::RstStream { stream_id, .. } => panic!("stream {stream_id} refused"),
                _ => {}
            }
        }
    }

    /// A stream whose reader never reads: the peer's large DATA frames are buffered up to the
    /// stream's queue, then the connection stops reading the socket. Before, each of the 16
    /// queued frames could be 1 MiB: 16 MiB per stream, 16 GiB per session of 1024 streams.
    #[tokio::test]
    async fn an_unread_stream_buffers_a_bounded_number_of_bytes() {
        let (a, b) = tokio::io::duplex(64 << 10);
        let (_h, mut ev) = serve(b);
        let mut peer = Peer::new(a);
        peer.open(1, "data").await;
        // Keeps the stream, never reads it.
        let Some(Event::Stream(_held)) = ev.recv().await else {
            panic!("no stream");
        };
        let sent = flood_until_the_reader_waits(&mut peer).await;
        // The queue (256 KiB), one frame being queued (1 MiB) and the pipe (64 KiB).
        assert!(sent <= 2 << 20, "{sent} bytes were taken from the peer");
    }

    /// Floods stream 1, which nobody reads, with 1 MiB frames until the connection's reader waits
    /// for it (the peer's writes block for 2 s); returns the bytes written.
    async fn flood_until_the_reader_waits(peer: &mut Peer<tokio::io::DuplexStream>) -> usize {
        let frame = vec![7u8; 1 << 20];
        let mut sent = 0usize;
        let flooded = tokio::time::timeout(std::time::Duration::from_secs(2), async {
            loop {
                peer.send(Frame::Data {
                    stream_id: 1,
                    flags: 0,
                    data: frame.clone(),
                })
                .await;
                sent += frame.len();
            }
        })
        .await;
        assert!(flooded.is_err(), "the peer's writes never blocked");
        sent
    }

    async fn closed_within(ev: &mut mpsc::Receiver<Event>, limit: Duration) -> String {
        tokio::time::timeout(limit, async {
            loop {
                match ev.recv().await {
                    Some(Event::Closed(why)) => break why,
                    Some(Event::Stream(_)) => {}
                    None => panic!("events ended without Closed"),
                }
            }
        })
        .await
        .expect("the connection ended")
    }

    /// A reader waiting for a stream nobody reads cannot see the client go: the connection ends
    /// when writing to the client fails (and the streams' channels with it).
    #[tokio::test]
    async fn a_reader_held_by_an_unread_stream_ends_when_the_client_is_gone() {
        let (a, b) = tokio::io::duplex(64 << 10);
        let (_h, mut ev) = serve(b);
        let mut peer = Peer::new(a);
        peer.open(1, "stdin").await;
        peer.open(3, "stdout").await;
        let (Some(Event::Stream(_stdin)), Some(Event::Stream(stdout))) =
            (ev.recv().await, ev.recv().await)
        else {
            panic!("no streams");
        };
        flood_until_the_reader_waits(&mut peer).await;
        drop(peer);
        // The process goes on writing its output.
        let _ = stdout.writer.write(b"output").await;
        let why = closed_within(&mut ev, Duration::from_secs(10)).await;
        assert_eq!(why, "writing to the client failed");
    }

    /// A session with nothing to write (a process that neither reads its stdin nor prints)
    /// learns of a hang-up from its keepalive pings, not only after the idle timeout.
    #[tokio::test]
    async fn a_silent_session_learns_of_a_hang_up_from_its_keepalive_pings() {
        let (a, b) = tokio::io::duplex(64 << 10);
        let (_h, mut ev) = serve_with(b, Duration::from_secs(3600), Duration::from_millis(200));
        let mut peer = Peer::new(a);
        peer.open(1, "stdin").await;
        let Some(Event::Stream(_stdin)) = ev.recv().await else {
            panic!("no stream");
        };
        // A client still there gets pings; the server's have even ids.
        loop {
            match peer.recv().await {
                Frame::Ping { id } => {
                    assert_eq!(id % 2, 0, "{id}");
                    break;
                }
                Frame::SynReply { .. } => {}
                f => panic!("unexpected {f:?}"),
            }
        }
        flood_until_the_reader_waits(&mut peer).await;
        drop(peer);
        let why = closed_within(&mut ev, Duration::from_secs(10)).await;
        assert_eq!(why, "writing to the client failed");
    }

    /// A silent session (nothing written either way) behind such a reader ends after the idle
    /// timeout.
    #[tokio::test]
    async fn a_reader_held_by_an_unread_stream_ends_after_the_idle_time() {
        let (a, b) = tokio::io::duplex(64 << 10);
        let (_h, mut ev) = serve_with(b, Duration::from_secs(1), KEEPALIVE);
        let mut peer = Peer::new(a);
        peer.open(1, "stdin").await;
        let Some(Event::Stream(_stdin)) = ev.recv().await else {
            panic!("no stream");
        };
        flood_until_the_reader_waits(&mut peer).await;
        let why = closed_within(&mut ev, Duration::from_secs(10)).await;
        assert!(why.contains("no frame in either direction"), "{why}");
    }

    /// A port-forward client that keeps its connection but stops reading: the frame the writer
    /// cannot get out ends the connection after the stall limit, naming the setting, and the
    /// bytes queued behind it are given back.
    #[tokio::test]
    async fn a_client_that_stops_reading_is_closed_after_the_stall_limit() {
        let (a, b) = tokio::io::duplex(64 << 10);
        let budget = crate::budget::Budget::new(64 << 20);
        let stall = Stall {
            after: Duration::from_millis(300),
            setting: "stream.some_timeout",
        };
        let (_h, mut ev) = serve_budgeted(b, budget.share("pod"), Some(stall));
        let mut peer = Peer::new(a);
        peer.open(1, "data").await;
        let s = next_stream(&mut ev).await;
        let share = budget.share("pod");
        let start = tokio::time::Instant::now();
        let sender = tokio::spawn(async move {
            loop {
                let charge = share.charge(MAX_DATA_CHUNK).await;
                let piece = vec![7u8; MAX_DATA_CHUNK];
                if s.writer.write_charged(piece, charge).await.is_err() {
                    break;
                }
            }
        });
        let why = closed_within(&mut ev, Duration::from_secs(10)).await;
        assert!(super::super::liveness::is_stall(&why), "{why}");
        assert!(why.contains("stream.some_timeout"), "{why}");
        assert!(start.elapsed() >= stall.after);
        tokio::time::timeout(Duration::from_secs(5), sender)
            .await
            .expect("the session's writes fail")
            .unwrap();
        assert_eq!(
            budget.in_use(),
            0,
            "the queued frames' charges are given back"
        );
    }

    /// A client that does flow control and opens no window for a stream stalls it likewise.
    #[tokio::test]
    async fn a_window_never_opened_is_a_stall() {
        let (a, b) = tokio::io::duplex(1 << 20);
        let budget = crate::budget::Budget::new(64 << 20);
        let stall = Stall {
            after: Duration::from_millis(300),
            setting: "stream.some_timeout",
        };
        let (_h, mut ev) = serve_budgeted(b, budget.share("pod"), Some(stall));
        let mut peer = Peer::new(a);
        peer.send(Frame::Settings {
            flags: 0,
            entries: vec![Setting {
                flags: 0,
                id: crate::spdy::SETTINGS_INITIAL_WINDOW_SIZE,
                value: 10,
            }],
        })
        .await;
        peer.open(1, "data").await;
        let s = next_stream(&mut ev).await;
        assert_eq!(s.writer.write(&[1; 100]).await, Err(SendBlocked::Closed));
        let why = closed_within(&mut ev, Duration::from_secs(10)).await;
        assert!(why.contains("flow-control window for stream 1"), "{why}");
    }

    #[tokio::test]
    async fn a_frame_over_the_accepted_size_ends_the_connection_unread() {
        let (a, b) = tokio::io::duplex(1 << 16);
        let (_h, _ev) = serve(b);
        let mut peer = Peer::new(a);
        peer.open(1, "stdout").await;
        // A data frame header announcing 16 MiB - 1, then nothing: the server must not wait
        // for (or allocate) the payload.
        let mut raw = Vec::new();
        raw.extend_from_slice(&1u32.to_be_bytes());
        raw.extend_from_slice(&[0x00, 0xff, 0xff, 0xff]);
        tokio::io::AsyncWriteExt::write_all(&mut peer.io, &raw)
            .await
            .unwrap();
        let goaway = tokio::time::timeout(std::time::Duration::from_secs(5), async {
            loop {
                match peer.try_recv().await {
                    Some(Frame::GoAway { status, .. }) => break Some(status),
                    Some(_) => continue,
                    None => break None,
                }
            }
        })
        .await
        .expect("the server answers at once");
        assert_eq!(goaway, Some(goaway::PROTOCOL_ERROR));
    }

    async fn next_stream(ev: &mut mpsc::Receiver<Event>) -> IncomingStream {
        match ev.recv().await.unwrap() {
            Event::Stream(s) => s,
            other => panic!("expected a stream, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn streams_are_replied_data_flows_both_ways_and_pings_are_echoed() {
        let (mut peer, handle, mut ev) = start();
        peer.open(1, "stdin").await;
        assert_eq!(
            peer.recv().await,
            Frame::SynReply {
                stream_id: 1,
                flags: 0,
                headers: Headers::new()
            }
        );
        let mut s = next_stream(&mut ev).await;
        assert_eq!(s.headers.get("streamtype"), Some("stdin"));
        peer.send(Frame::Data {
            stream_id: 1,
            flags: FLAG_FIN,
            data: b"input".to_vec(),
        })
        .await;
        assert_eq!(s.data.recv().await.unwrap(), b"input");
        assert!(s.data.recv().await.is_none(), "FIN ends the data");
        peer.send(Frame::Ping { id: 5 }).await;
        assert_eq!(peer.recv().await, Frame::Ping { id: 5 });
        s.writer.write(b"output").await.unwrap();
        s.writer.close().await.unwrap();
        assert_eq!(
            peer.recv().await,
            Frame::Data {
                stream_id: 1,
                flags: 0,
                data: b"output".to_vec()
            }
        );
        assert_eq!(
            peer.recv().await,
            Frame::Data {
                stream_id: 1,
                flags: FLAG_FIN,
                data: vec![]
            }
        );
        assert_eq!(s.writer.write(b"late").await, Err(SendBlocked::StreamGone));
        handle.close().await;
        assert_eq!(
            peer.recv().await,
            Frame::GoAway {
                last_good_stream_id: 1,
                status: goaway::OK,
            }
        );
    }

    #[tokio::test]
    async fn bad_stream_ids_are_reset_and_eof_closes() {
        let (mut peer, _handle, mut ev) = start();
        peer.open(3, "error").await;
        let _ = peer.recv().await;
        let _ = next_stream(&mut ev).await;
        peer.open(1, "stdout").await; // not increasing
        assert_eq!(
            peer.recv().await,
            Frame::RstStream {
                stream_id: 1,
                status: rst::PROTOCOL_ERROR
            }
        );
        peer.open(4, "stdout").await; // even: the server's ids
        assert_eq!(
            peer.recv().await,
            Frame::RstStream {
                stream_id: 4,
                status: rst::PROTOCOL_ERROR
            }
        );
        drop(peer);
        assert!(matches!(ev.recv().await.unwrap(), Event::Closed(_)));
        assert!(ev.recv().await.is_none());
    }

    #[tokio::test]
    async fn writes_wait_for_window_updates_from_peers_that_send_them() {
        let (mut peer, _handle, mut ev) = start();
        peer.send(Frame::Settings {
            flags: 0,
            entries: vec![Setting {
                flags: 0,
                id: crate::spdy::SETTINGS_INITIAL_WINDOW_SIZE,
                value: 1000,
            }],
        })
        .await;
        peer.open(1, "stdout").await;
        let _ = peer.recv().await;
        let s = next_stream(&mut ev).await;
        let w = s.writer.clone();
        let writer = tokio::spawn(async move { w.write(&[7u8; 1500]).await });
        match peer.recv().await {
            Frame::Data { data, .. } => assert_eq!(data.len(), 1000),
            f => panic!("{f:?}"),
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!writer.is_finished(), "stream window spent");
        peer.send(Frame::WindowUpdate {
            stream_id: 1,
            delta: 1000,
        })
        .await;
        match peer.recv().await {
            Frame::Data { data, .. } => assert_eq!(data.len(), 500),
            f => panic!("{f:?}"),
        }
        writer.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn received_data_is_acknowledged_with_window_updates() {
        let (mut peer, _handle, mut ev) = start();
        peer.open(1, "stdin").await;
        let _ = peer.recv().await;
        let mut s = next_stream(&mut ev).await;
        let half = DEFAULT_WINDOW as usize / 2;
        peer.send(Frame::Data {
            stream_id: 1,
            flags: 0,
            data: vec![1; half],
        })
        .await;
        assert_eq!(s.data.recv().await.unwrap().len(), half);
        assert_eq!(
            peer.recv().await,
            Frame::WindowUpdate {
                stream_id: 0,
                delta: half as u32
            }
        );
        assert_eq!(
            peer.recv().await,
            Frame::WindowUpdate {
                stream_id: 1,
                delta: half as u32
            }
        );
        // A reset from the peer ends the stream's data and its writer.
        peer.send(Frame::RstStream {
            stream_id: 1,
            status: rst::CANCEL,
        })
        .await;
        assert!(s.data.recv().await.is_none());
        assert_eq!(s.writer.write(b"x").await, Err(SendBlocked::StreamGone));
    }
}

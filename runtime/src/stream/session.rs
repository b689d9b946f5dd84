//! What exec and attach sessions share whatever the transport: the remotecommand channels as a
//! session uses them ([`Channels`]: input as chunks, output as writers), the connection under
//! them ([`Link`]: when the client went away, how the session ends), and the copies between
//! the channels and a process or a container's stdio.
//!
//! Two transports carry the same channels:
//! - SPDY/3.1 ([`minicri_codecs::spdy`]): the client opens one stream per channel, each with a
//!   `streamType` header; [`collect`] waits for the ones the request needs. Outputs end with
//!   FIN; at the end the client's input streams are half-closed too and the connection gets
//!   GOAWAY.
//! - WebSocket ([`super::ws::channels`], [`open_ws`]): every binary message starts with its channel number
//!   (0 stdin, 1 stdout, 2 stderr, 3 error, 4 resize); nothing to wait for. Outputs have no end
//!   of their own: the session ends with a close frame (normal closure).

use std::time::Duration;

use minicri_codecs::budget::{Charge, Input};
use minicri_codecs::spdy::conn::{self, Event, IncomingStream, MAX_DATA_CHUNK, StreamWriter};
use minicri_codecs::spdy::rst;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use super::backend::{BoxRead, BoxWrite, Resize};
use super::remotecommand::{
    Outcome, Protocol, STREAM_TYPE_HEADER, StreamType, error_stream_payload,
};
use super::ws;

/// How long the client has to open its streams after the upgrade (SPDY; as the kubelet).
pub const STREAM_CREATION_TIMEOUT: Duration = Duration::from_secs(30);
/// How long output may keep flowing after the process exited.
pub(super) const DRAIN_GRACE: Duration = Duration::from_secs(2);
/// How long the client gets to close the connection after the last frame.
pub(super) const LINGER: Duration = Duration::from_secs(5);

/// Sends on one output channel.
#[derive(Clone, Debug)]
pub enum Output {
    Spdy(StreamWriter),
    Ws(ws::channels::ChannelWriter),
}

/// The client can no longer be written to on this channel (reset, or the connection is gone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gone;

impl Output {
    pub async fn write(&self, data: &[u8]) -> Result<(), Gone> {
        match self {
            Output::Spdy(w) => w.write(data).await.map_err(|_| Gone),
            Output::Ws(w) => w.write(data).await.map_err(|_| Gone),
        }
    }

    /// What a buffer handed to [`Output::write_owned`] starts with (WebSocket: the channel
    /// byte; SPDY: nothing).
    pub fn head(&self) -> &[u8] {
        match self {
            Output::Spdy(_) => &[],
            Output::Ws(w) => w.head(),
        }
    }

    /// What a buffer of `n` bytes (and the head) costs while [`Output::write_owned`] sends it:
    /// twice on a SPDY stream whose peer does flow control (it may be sent as copied pieces).
    pub fn charge_for(&self, n: usize) -> usize {
        match self {
            Output::Spdy(w) if w.flow_controlled() => 2 * n,
            Output::Spdy(_) => n,
            Output::Ws(w) => w.head().len() + n,
        }
    }

    /// Sends `buf` (starting with [`Output::head`], at most [`MAX_DATA_CHUNK`] bytes after it)
    /// without copying it where it can, holding `charge` until it is written.
    pub async fn write_owned(&self, buf: Vec<u8>, charge: Charge) -> Result<(), Gone> {
        match self {
            Output::Spdy(w) => w.write_charged(buf, charge).await.map_err(|_| Gone),
            Output::Ws(w) => w.send_charged(buf, charge).await.map_err(|_| Gone),
        }
    }

    /// The end of this channel's output: FIN on SPDY; nothing on WebSocket (the close frame
    /// ends every channel).
    pub async fn close(&self) {
        if let Output::Spdy(w) = self {
            let _ = w.close().await;
        }
    }
}

/// A session's channels; each is there when the request asked for it.
#[derive(Default)]
pub struct Channels {
    pub error: Option<Output>,
    /// The client's input; ends when the client closes it (SPDY FIN, v5 close signal) or goes.
    pub stdin: Option<Input>,
    pub stdout: Option<Output>,
    pub stderr: Option<Output>,
    /// Terminal sizes, `{"Width":W,"Height":H}` one per line.
    pub resize: Option<Input>,
    /// The writers of the client's input streams: half-closed when the session ends (SPDY).
    pub inputs: Vec<Output>,
}

/// The connection under a session.
pub enum Link {
    Spdy {
        conn: conn::Handle,
        events: mpsc::Receiver<Event>,
    },
    Ws(ws::channels::WsLink),
}

impl Link {
    /// Resolves when the client has gone (hung up, or broke the connection). SPDY streams it
    /// opens meanwhile are refused.
    pub async fn gone(&mut self) {
        match self {
            Link::Spdy { events, .. } => loop {
                match events.recv().await {
                    Some(Event::Stream(s)) => s.writer.reset(rst::REFUSED_STREAM).await,
                    Some(Event::Closed(_)) | None => return,
                }
            },
            Link::Ws(l) => l.gone().await,
        }
    }

    /// The session is over: the client gets [`LINGER`] to hang up (a WebSocket client is sent
    /// the close frame first), then the connection is closed.
    pub async fn finish(self) {
        match self {
            Link::Ws(l) => l.finish(LINGER).await,
            mut spdy => {
                let _ = tokio::time::timeout(LINGER, spdy.gone()).await;
                spdy.close().await;
            }
        }
    }

    /// Closes the connection at once.
    pub async fn close(self) {
        match self {
            Link::Spdy { conn, .. } => conn.close().await,
            Link::Ws(l) => l.finish(Duration::ZERO).await,
        }
    }
}

/// The client's SPDY streams, by type.
#[derive(Default)]
pub(super) struct Streams {
    pub(super) error: Option<IncomingStream>,
    pub(super) stdin: Option<IncomingStream>,
    pub(super) stdout: Option<IncomingStream>,
    pub(super) stderr: Option<IncomingStream>,
    pub(super) resize: Option<IncomingStream>,
}

impl Streams {
    fn slot(&mut self, t: StreamType) -> &mut Option<IncomingStream> {
        match t {
            StreamType::Error => &mut self.error,
            StreamType::Stdin => &mut self.stdin,
            StreamType::Stdout => &mut self.stdout,
            StreamType::Stderr => &mut self.stderr,
            StreamType::Resize => &mut self.resize,
        }
    }
}

impl From<Streams> for Channels {
    fn from(s: Streams) -> Channels {
        let out = |s: Option<IncomingStream>| s.map(|s| Output::Spdy(s.writer));
        let mut inputs = Vec::new();
        let mut input = |s: Option<IncomingStream>| {
            s.map(|s| {
                inputs.push(Output::Spdy(s.writer));
                s.data
            })
        };
        let (stdin, resize) = (input(s.stdin), input(s.resize));
        // The error stream is only written to, but the client may still send on it: the
        // connection's reader just drops what nobody reads.
        Channels {
            error: out(s.error),
            stdin,
            stdout: out(s.stdout),
            stderr: out(s.stderr),
            resize,
            inputs,
        }
    }
}

/// Waits until the client has opened every SPDY stream of `expected`; a stream of an unknown
/// or repeated type is refused (RST_STREAM REFUSED_STREAM).
pub(super) async fn collect(
    events: &mut mpsc::Receiver<Event>,
    expected: Vec<StreamType>,
    timeout: Duration,
) -> Result<Streams, String> {
    let mut ch = Streams::default();
    let deadline = tokio::time::sleep(timeout);
    tokio::pin!(deadline);
    while !expected.iter().all(|t| ch.slot(*t).is_some()) {
        tokio::select! {
            _ = &mut deadline => {
                return Err(format!("the client did not open its streams ({expected:?}) within {timeout:?}"));
            }
            ev = events.recv() => match ev {
                Some(Event::Stream(s)) => {
                    let t = s.headers.get(STREAM_TYPE_HEADER).and_then(StreamType::parse);
                    match t {
                        Some(t) if ch.slot(t).is_none() => *ch.slot(t) = Some(s),
                        _ => {
                            tracing::debug!(headers = ?s.headers, "refused an unexpected stream");
                            s.writer.reset(rst::REFUSED_STREAM).await;
                        }
                    }
                }
                Some(Event::Closed(reason)) => return Err(reason),
                None => return Err("the connection ended".into()),
            }
        }
    }
    Ok(ch)
}

/// Serves SPDY on `io` and waits for the streams of `expected`: the session's channels and
/// link, or why the client never got that far (the connection is then closed).
pub(super) async fn open_spdy<IO>(
    io: IO,
    expected: Vec<StreamType>,
) -> Result<(Channels, Link), String>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
{
    let (conn, mut events) = conn::serve(io);
    match collect(&mut events, expected, STREAM_CREATION_TIMEOUT).await {
        Ok(streams) => Ok((streams.into(), Link::Spdy { conn, events })),
        Err(reason) => {
            conn.close().await;
            Err(reason)
        }
    }
}

/// Serves WebSocket on `io` (the handshake is done) for a session of `protocol` using
/// `streams` ([`ws::channels`]): every channel the request asked for is there at once.
pub(super) fn open_ws<IO>(io: IO, protocol: Protocol, streams: &[StreamType]) -> (Channels, Link)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
{
    let ws::channels::Opened {
        sender,
        stdin,
        resize,
        link,
    } = ws::channels::open(io, protocol, streams);
    let output = |t: StreamType| {
        streams.contains(&t).then(|| {
            Output::Ws(ws::channels::ChannelWriter::new(
                t.channel(),
                sender.clone(),
            ))
        })
    };
    let channels = Channels {
        error: output(StreamType::Error),
        stdin,
        stdout: output(StreamType::Stdout),
        stderr: output(StreamType::Stderr),
        resize,
        inputs: Vec::new(),
    };
    (channels, Link::Ws(link))
}

/// The copies between a session's channels and a process (or a container's stdio).
pub(super) struct Pumps {
    outputs: [tokio::task::JoinHandle<()>; 2],
    inputs: Vec<tokio::task::JoinHandle<()>>,
}

impl Pumps {
    /// Starts copying the client's stdin and terminal sizes to the process, and its stdout and
    /// stderr to the client (output nobody asked for is read and dropped, so the process never
    /// blocks on a full pipe). Takes the input channels out of `ch`.
    pub(super) fn start(
        ch: &mut Channels,
        stdin: Option<BoxWrite>,
        stdout: Option<BoxRead>,
        stderr: Option<BoxRead>,
        resize: Option<Resize>,
    ) -> Pumps {
        let mut inputs = Vec::new();
        if let (Some(rx), Some(f)) = (ch.resize.take(), resize) {
            inputs.push(tokio::spawn(apply_resizes(rx, f)));
        }
        // Without a stdin channel the pipe is dropped here: the process's stdin is closed.
        if let (Some(rx), Some(w)) = (ch.stdin.take(), stdin) {
            inputs.push(tokio::spawn(copy_in(rx, w)));
        }
        let outputs = [(stdout, ch.stdout.clone()), (stderr, ch.stderr.clone())]
            .map(|(r, w)| tokio::spawn(copy_out(r, w)));
        Pumps { outputs, inputs }
    }

    /// The process has exited: its output gets [`DRAIN_GRACE`] to reach the client (a
    /// background child may hold the pipes open), the input copies stop. Whether output was
    /// cut short.
    pub(super) async fn drain(self) -> bool {
        let drained_by = tokio::time::Instant::now() + DRAIN_GRACE;
        let mut cut = false;
        for mut t in self.outputs {
            if tokio::time::timeout_at(drained_by, &mut t).await.is_err() {
                t.abort();
                cut = true;
            }
        }
        for t in self.inputs {
            t.abort();
        }
        cut
    }

    /// Stops every copy at once (the client is gone).
    pub(super) fn abort(self) {
        for t in self.outputs.iter().chain(&self.inputs) {
            t.abort();
        }
    }
}

/// Copies the client's input to a process's stdin, then closes it.
async fn copy_in(mut rx: Input, mut w: BoxWrite) {
    while let Some(chunk) = rx.recv().await {
        if w.write_all(&chunk).await.is_err() || w.flush().await.is_err() {
            return;
        }
    }
    let _ = w.shutdown().await;
}

/// Copies a pipe to a channel (or to nowhere), then ends the channel's output.
async fn copy_out(r: Option<BoxRead>, mut w: Option<Output>) {
    if let Some(mut r) = r {
        let mut buf = vec![0u8; MAX_DATA_CHUNK];
        loop {
            let n = match r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if let Some(s) = &w
                && s.write(&buf[..n]).await.is_err()
            {
                // Reset by the client: keep draining so the process does not block.
                w = None;
            }
        }
    }
    if let Some(s) = w {
        s.close().await;
    }
}

/// The terminal size messages of the `resize` channel: `{"Width":W,"Height":H}`, one per line.
///
/// A client may send a megabyte of lines in one message: they are read in one pass (linear in
/// what arrived), and of the sizes one read brings only the last is applied, so the terminal gets
/// one resize (an ioctl and a SIGWINCH) per read, not one per line.
async fn apply_resizes(mut rx: Input, resize: Resize) {
    let mut buf = Vec::new();
    while let Some(chunk) = rx.recv().await {
        buf.extend_from_slice(&chunk);
        if let Some((width, height)) = last_size(&mut buf) {
            resize(width, height);
        }
    }
}

/// The last well-formed size among the complete lines of `buf`, which keeps only what follows
/// them (dropped once past 4 KiB: no size message is that long).
fn last_size(buf: &mut Vec<u8>) -> Option<(u16, u16)> {
    #[derive(serde::Deserialize)]
    struct Size {
        #[serde(rename = "Width")]
        width: u16,
        #[serde(rename = "Height")]
        height: u16,
    }
    let mut last = None;
    let mut start = 0;
    while let Some(len) = buf[start..].iter().position(|b| *b == b'\n') {
        let line = &buf[start..start + len];
        start += len + 1;
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        match serde_json::from_slice::<Size>(line) {
            Ok(s) => last = Some((s.width, s.height)),
            Err(e) => tracing::debug!(error = %e, "bad terminal size message"),
        }
    }
    buf.drain(..start);
    if buf.len() > 4096 {
        buf.clear();
    }
    last
}

/// Ends the output channels, reports `outcome` on the error channel (if anything is to be
/// reported under `protocol`), ends the rest. A client that takes nothing (it does not read,
/// or grants no flow-control window) gets [`LINGER`] for all of it, not the session's life.
pub(super) async fn finish(ch: &Channels, protocol: Protocol, outcome: &Outcome, cmd: &[String]) {
    let report = async {
        for s in [&ch.stdout, &ch.stderr].into_iter().flatten() {
            // Already ended by the copy unless it was cut short.
            s.close().await;
        }
        if let Some(e) = &ch.error {
            let payload = error_stream_payload(protocol, outcome, cmd);
            if !payload.is_empty() {
                let _ = e.write(&payload).await;
            }
        }
        close_channels(ch).await;
    };
    if tokio::time::timeout(LINGER, report).await.is_err() {
        tracing::debug!(
            "the client took nothing for {LINGER:?}; the session's end is not reported"
        );
    }
}

/// Ends every channel, reporting nothing on the error channel; at most [`LINGER`].
pub(super) async fn close_all(ch: &Channels) {
    let _ = tokio::time::timeout(LINGER, close_channels(ch)).await;
}

async fn close_channels(ch: &Channels) {
    for s in [&ch.stdout, &ch.stderr, &ch.error]
        .into_iter()
        .flatten()
        .chain(&ch.inputs)
    {
        s.close().await;
    }
}

#[cfg(test)]
mod ws_tests;

#[cfg(test)]
mod resize_tests {
    use super::last_size;

    /// Sizes are read line by line across reads; of one read's sizes the last is applied.
    #[test]
    fn the_last_size_of_each_read_is_applied() {
        let mut buf = br#"{"Width":80,"Height":24}
{"Width":100,"Height":30}
{"Width":1"#
            .to_vec();
        assert_eq!(last_size(&mut buf), Some((100, 30)));
        assert_eq!(buf, br#"{"Width":1"#);
        buf.extend_from_slice(b"20,\"Height\":40}\nnot json\n\n");
        assert_eq!(last_size(&mut buf), Some((120, 40)));
        assert!(buf.is_empty());
        buf.extend_from_slice(b"garbage\n");
        assert_eq!(last_size(&mut buf), None);
    }

    /// A megabyte of lines in one message is read in one pass: it used to shift the rest of the
    /// buffer for every line, minutes of a worker's time per message.
    #[test]
    fn a_megabyte_of_lines_is_read_in_linear_time() {
        let mut buf = vec![b'\n'; 1 << 20];
        buf.extend_from_slice(b"{\"Width\":7,\"Height\":9}\n");
        let start = std::time::Instant::now();
        assert_eq!(last_size(&mut buf), Some((7, 9)));
        assert!(
            start.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
        assert!(buf.is_empty());
    }
}

//! A minimal client of the Kubernetes remotecommand protocol, over SPDY/3.1 or WebSocket, for
//! black-box tests of a CRI streaming server (what `crictl exec` does through client-go,
//! without Go).
//!
//! Over SPDY it sends the HTTP/1.1 upgrade request, opens one SPDY stream per channel (`error`,
//! then `stdin`, `stdout`, `stderr` as asked, `resize` with a terminal), sends stdin followed by
//! FIN, and reads until the error stream and the output streams are finished. It never sends
//! WINDOW_UPDATE, like client-go's SPDY library, so a server that waited for window updates
//! would stall past 64 KiB. Over WebSocket ([`Transport::WebSocket`], with
//! [`crate::websocket`]) each message carries a channel byte; the end of stdin is v5's close
//! signal `[255, 0]` (client-go sends it whatever the version) and the session ends with the
//! server's close frame. [`Session`] keeps the channels open for interactive use (attach):
//! input in steps, output read as it comes; [`exec_with`] runs a whole exec on one.
//!
//! [`PortForward`] speaks `portforward.k8s.io` on SPDY, as k8s.io/client-go/tools/portforward
//! does: per forwarded connection an `error` stream (half-closed at once) and a `data` stream,
//! both with `port` and `requestID` headers; directly, or tunnelled through WebSocket
//! ([`PortForward::connect_websocket`]).
//!
//! Written for tests from the remotecommand protocol; independent of minicri's server code on
//! purpose. The SPDY framing is in [`crate::spdy`].

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{Context, bail};
use tokio::net::TcpStream;

use crate::spdy::Spdy;
use crate::upgrade::http_upgrade;
use crate::websocket::{CLOSE_SIGNAL, Ws};

/// The protocol versions client-go offers, best first.
pub const CLIENT_GO_PROTOCOLS: [&str; 5] = [
    "v5.channel.k8s.io",
    "v4.channel.k8s.io",
    "v3.channel.k8s.io",
    "v2.channel.k8s.io",
    "channel.k8s.io",
];

/// The answer to the upgrade request.
pub struct Upgrade {
    pub status: u16,
    /// The response head, header names lowercased.
    pub head: String,
    conn: TcpStream,
}

/// What an exec session produced.
#[derive(Debug, Default)]
pub struct ExecOutput {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// The bytes of the error stream (a JSON status under v4).
    pub error: Vec<u8>,
    pub protocol: String,
}

impl ExecOutput {
    pub fn status(&self) -> serde_json::Value {
        serde_json::from_slice(&self.error).unwrap_or(serde_json::Value::Null)
    }
}

/// Sends `POST path` with the SPDY upgrade headers and `protocols`; reads the response head.
pub async fn upgrade(url: &str, protocols: &[&str]) -> anyhow::Result<Upgrade> {
    let mut headers = vec![
        "Connection: Upgrade".to_string(),
        "Upgrade: SPDY/3.1".to_string(),
    ];
    headers.extend(
        protocols
            .iter()
            .map(|p| format!("X-Stream-Protocol-Version: {p}")),
    );
    let (status, head, conn) = http_upgrade(url, "POST", &headers).await?;
    Ok(Upgrade { status, head, conn })
}

impl Upgrade {
    /// The protocol the server announced (`x-stream-protocol-version`; empty: none).
    fn protocol(&self) -> String {
        self.head
            .lines()
            .find_map(|l| l.strip_prefix("x-stream-protocol-version: "))
            .unwrap_or("")
            .trim()
            .to_string()
    }
}

/// What the client asks for.
#[derive(Debug, Default, Clone)]
pub struct ExecOptions<'a> {
    /// Sent on the stdin channel, followed by its end.
    pub stdin: Option<&'a [u8]>,
    pub stdout: bool,
    /// Ignored with `tty` (a terminal has one output).
    pub stderr: bool,
    /// Opens a `resize` channel and sends this (width, height) on it first.
    pub tty: Option<(u16, u16)>,
    pub transport: Transport,
}

/// Runs an exec session on `url` over SPDY: opens error, then stdin (when `stdin` is given),
/// stdout and stderr (as asked); sends `stdin` and FIN; collects everything until the streams
/// end.
pub async fn exec(
    url: &str,
    stdin: Option<&[u8]>,
    stdout: bool,
    stderr: bool,
) -> anyhow::Result<ExecOutput> {
    exec_with(
        url,
        ExecOptions {
            stdin,
            stdout,
            stderr,
            ..Default::default()
        },
    )
    .await
}

/// [`exec`] with a terminal and a transport possible. With a terminal the channels are error,
/// stdin, stdout and resize, as client-go opens them; the size is sent before the input.
pub async fn exec_with(url: &str, o: ExecOptions<'_>) -> anyhow::Result<ExecOutput> {
    let mut s = Session::open_with(
        url,
        SessionOptions {
            transport: o.transport,
            stdin: o.stdin.is_some(),
            stdout: o.stdout,
            stderr: o.stderr && o.tty.is_none(),
            tty: o.tty.is_some(),
        },
    )
    .await?;
    if let Some((w, h)) = o.tty {
        s.resize(w, h).await?;
    }
    if let Some(data) = o.stdin {
        for chunk in data.chunks(16 * 1024) {
            s.send(chunk).await?;
        }
        s.close_stdin().await?;
    }
    s.read_until(Duration::from_secs(60), |s| s.ended()).await?;
    Ok(ExecOutput {
        stdout: s.stdout,
        stderr: s.stderr,
        error: s.error,
        protocol: s.protocol,
    })
}

/// What one forwarded connection produced.
#[derive(Debug, Default)]
pub struct Forwarded {
    /// The bytes the remote side sent back.
    pub data: Vec<u8>,
    /// The bytes of the error stream (empty when the forward worked).
    pub error: Vec<u8>,
}

impl Forwarded {
    /// Panics unless the forward carried an HTTP 200 answer whose body ends with `body` and
    /// reported no error (`what` names the forward in the message).
    pub fn assert_http_ok(&self, body: &str, what: &str) {
        let text = String::from_utf8_lossy(&self.data);
        assert!(
            text.starts_with("HTTP/1.") && text.contains(" 200 "),
            "{what}: {text}"
        );
        assert!(text.ends_with(body), "{what}: {text}");
        assert!(
            self.error.is_empty(),
            "{what}: {}",
            String::from_utf8_lossy(&self.error)
        );
    }
}

/// A port-forward session: one upgraded connection carrying any number of forwards.
pub struct PortForward {
    s: Spdy,
    next_id: u32,
    next_request: u32,
    /// The protocol the server announced (`x-stream-protocol-version`).
    pub protocol: String,
}

impl PortForward {
    /// Opens `url` offering `portforward.k8s.io`.
    pub async fn connect(url: &str) -> anyhow::Result<PortForward> {
        let up = upgrade(url, &["portforward.k8s.io"]).await?;
        if up.status != 101 {
            bail!("upgrade refused: {}", up.head);
        }
        let protocol = up.protocol();
        Ok(PortForward {
            s: Spdy::new(up.conn),
            next_id: 1,
            next_request: 0,
            protocol,
        })
    }

    /// Opens `url` with WebSocket offering `SPDY/3.1+portforward.k8s.io`, as client-go's
    /// tunnelling dialer does, and speaks SPDY through the tunnel.
    pub async fn connect_websocket(url: &str) -> anyhow::Result<PortForward> {
        let ws = Ws::connect(url, &["SPDY/3.1+portforward.k8s.io"]).await?;
        let protocol = ws.protocol.clone();
        Ok(PortForward {
            s: Spdy::new(ws.tunnel()),
            next_id: 1,
            next_request: 0,
            protocol,
        })
    }

    /// Forwards one connection to `port`: sends `request` (no FIN), reads until the server has
    /// finished both the data and the error stream; half-closes the data stream when the server
    /// has finished it.
    pub async fn forward(&mut self, port: u16, request: &[u8]) -> anyhow::Result<Forwarded> {
        let (error_id, data_id) = self.open(port).await?;
        if !request.is_empty() {
            self.s.data(data_id, request, false).await?;
        }
        let mut out = Forwarded::default();
        let mut pending = vec![error_id, data_id];
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while !pending.is_empty() {
            let f = tokio::time::timeout_at(deadline, self.s.frame())
                .await
                .context("the forward did not end in 60 s")??;
            let Some((kind, id, flags, payload)) = f else {
                bail!("connection closed with streams {pending:?} open");
            };
            match kind {
                None => {
                    if id == data_id {
                        out.data.extend(&payload);
                    } else if id == error_id {
                        out.error.extend(&payload);
                    }
                    if flags & 1 != 0 {
                        pending.retain(|p| *p != id);
                        if id == data_id {
                            // The remote side is done: so is this one (client-go resets).
                            self.s.data(data_id, &[], true).await?;
                        }
                    }
                }
                Some(3) if pending.contains(&id) => {
                    let status = u32::from_be_bytes(payload[4..8].try_into()?);
                    bail!("stream {id} reset with status {status}");
                }
                Some(7) => bail!("GOAWAY with streams {pending:?} open"),
                Some(_) => {}
            }
        }
        Ok(out)
    }

    /// Opens a forwarded connection to `port` as client-go does (its error stream, half-closed
    /// at once, then its data stream): (error stream, data stream).
    pub async fn open(&mut self, port: u16) -> anyhow::Result<(u32, u32)> {
        let (error_id, data_id) = (self.next_id, self.next_id + 2);
        self.next_id += 4;
        let rid = self.next_request.to_string();
        self.next_request += 1;
        let port = port.to_string();
        for (id, kind) in [(error_id, "error"), (data_id, "data")] {
            self.s
                .syn_stream_with(
                    id,
                    &[("streamtype", kind), ("port", &port), ("requestid", &rid)],
                )
                .await?;
            if kind == "error" {
                // client-go half-closes the error stream at once: it only reads from it.
                self.s.data(error_id, &[], true).await?;
            }
        }
        Ok((error_id, data_id))
    }

    /// Sends `data` on a forward's data stream as one DATA frame (no FIN), reading nothing.
    pub async fn push(&mut self, data_id: u32, data: &[u8]) -> anyhow::Result<()> {
        self.s.data(data_id, data, false).await
    }

    /// Reads and drops frames until the server closes the connection (EOF, or a reset: a server
    /// may drop a connection it still had bytes for); the bytes of DATA read.
    pub async fn read_until_closed(&mut self) -> usize {
        let mut got = 0;
        while let Ok(Some((kind, _, _, payload))) = self.s.frame().await {
            if kind.is_none() {
                got += payload.len();
            }
        }
        got
    }

    /// Reads frames until `n` bytes have come on the data stream `data_id` (others' DATA is
    /// dropped); fails if the stream ends or is reset first.
    pub async fn read_data(&mut self, data_id: u32, n: usize) -> anyhow::Result<()> {
        let mut got = 0;
        while got < n {
            let Some((kind, id, flags, payload)) = self.s.frame().await? else {
                bail!("connection closed after {got} bytes");
            };
            match kind {
                None if id == data_id => {
                    got += payload.len();
                    if flags & 1 != 0 && got < n {
                        bail!("the stream ended after {got} bytes");
                    }
                }
                Some(3) if id == data_id => bail!("stream {id} reset after {got} bytes"),
                _ => {}
            }
        }
        Ok(())
    }
}

/// How a session reaches the server.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Transport {
    /// SPDY/3.1, offering [`CLIENT_GO_PROTOCOLS`].
    #[default]
    Spdy,
    /// WebSocket, offering these subprotocols (client-go's executor offers v5 only).
    WebSocket(&'static [&'static str]),
}

/// What an interactive session asks for.
#[derive(Debug, Clone, Copy, Default)]
pub struct SessionOptions {
    pub transport: Transport,
    pub stdin: bool,
    pub stdout: bool,
    /// Not with `tty`.
    pub stderr: bool,
    /// A terminal: a `resize` channel.
    pub tty: bool,
}

/// The connection under a session.
enum Wire {
    Spdy {
        s: Box<Spdy>,
        ids: HashMap<u32, &'static str>,
        stdin_id: Option<u32>,
        resize_id: Option<u32>,
        /// Output streams and the error stream not finished yet.
        open: Vec<u32>,
    },
    Ws {
        ws: Ws,
        /// The server has closed the connection.
        closed: bool,
    },
}

/// An interactive remotecommand session (what `crictl attach` and `kubectl attach` do): the
/// channels stay open while the test sends input in steps and reads output as it comes.
pub struct Session {
    wire: Wire,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// The bytes of the error channel.
    pub error: Vec<u8>,
    pub protocol: String,
}

impl Session {
    /// Upgrades `url` to SPDY and opens error, then stdin, stdout and stderr as asked (no
    /// terminal).
    pub async fn open(
        url: &str,
        stdin: bool,
        stdout: bool,
        stderr: bool,
    ) -> anyhow::Result<Session> {
        Session::open_with(
            url,
            SessionOptions {
                stdin,
                stdout,
                stderr,
                ..Default::default()
            },
        )
        .await
    }

    /// Upgrades `url` as `o.transport` says; over SPDY opens error, stdin, stdout, stderr and
    /// resize as asked (WebSocket channels need no opening).
    pub async fn open_with(url: &str, o: SessionOptions) -> anyhow::Result<Session> {
        let (wire, protocol) = match o.transport {
            Transport::WebSocket(protocols) => {
                let ws = Ws::connect(url, protocols).await?;
                let protocol = ws.protocol.clone();
                (Wire::Ws { ws, closed: false }, protocol)
            }
            Transport::Spdy => {
                let up = upgrade(url, &CLIENT_GO_PROTOCOLS).await?;
                if up.status != 101 {
                    bail!("upgrade refused: {}", up.head);
                }
                let protocol = up.protocol();
                let mut s = Spdy::new(up.conn);
                let (mut ids, mut open) = (HashMap::new(), Vec::new());
                let (mut stdin_id, mut resize_id) = (None, None);
                let mut next = 1;
                for (kind, on) in [
                    ("error", true),
                    ("stdin", o.stdin),
                    ("stdout", o.stdout),
                    ("stderr", o.stderr),
                    ("resize", o.tty),
                ] {
                    if !on {
                        continue;
                    }
                    s.syn_stream(next, kind).await?;
                    ids.insert(next, kind);
                    match kind {
                        "stdin" => stdin_id = Some(next),
                        "resize" => resize_id = Some(next),
                        _ => open.push(next),
                    }
                    next += 2;
                }
                let wire = Wire::Spdy {
                    s: Box::new(s),
                    ids,
                    stdin_id,
                    resize_id,
                    open,
                };
                (wire, protocol)
            }
        };
        Ok(Session {
            wire,
            stdout: Vec::new(),
            stderr: Vec::new(),
            error: Vec::new(),
            protocol,
        })
    }

    /// Sends `data` on the stdin channel.
    pub async fn send(&mut self, data: &[u8]) -> anyhow::Result<()> {
        match &mut self.wire {
            Wire::Spdy { s, stdin_id, .. } => {
                let id = stdin_id.context("the session has no stdin")?;
                s.data(id, data, false).await
            }
            Wire::Ws { ws, .. } => ws.send_channel(0, data).await,
        }
    }

    /// Ends the stdin channel: FIN over SPDY, the close signal over WebSocket.
    pub async fn close_stdin(&mut self) -> anyhow::Result<()> {
        match &mut self.wire {
            Wire::Spdy { s, stdin_id, .. } => {
                let id = stdin_id.context("the session has no stdin")?;
                s.data(id, &[], true).await
            }
            Wire::Ws { ws, .. } => ws.send(&[CLOSE_SIGNAL, 0]).await,
        }
    }

    /// Sends a terminal size on the resize channel (as client-go: JSON and a newline).
    pub async fn resize(&mut self, width: u16, height: u16) -> anyhow::Result<()> {
        let msg = format!("{{\"Width\":{width},\"Height\":{height}}}\n");
        match &mut self.wire {
            Wire::Spdy { s, resize_id, .. } => {
                let id = resize_id.context("the session has no terminal")?;
                s.data(id, msg.as_bytes(), false).await
            }
            Wire::Ws { ws, .. } => ws.send_channel(4, msg.as_bytes()).await,
        }
    }

    /// Whether the server has ended the session: over SPDY every output stream and the error
    /// stream are finished; over WebSocket the connection is closed.
    pub fn ended(&self) -> bool {
        match &self.wire {
            Wire::Spdy { open, .. } => open.is_empty(),
            Wire::Ws { closed, .. } => *closed,
        }
    }

    /// Reads until `done(self)` holds; an error when `timeout` passes first (the session is not
    /// usable after that), or the session or the connection ends.
    pub async fn read_until(
        &mut self,
        timeout: Duration,
        done: impl Fn(&Session) -> bool,
    ) -> anyhow::Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        while !done(self) {
            if self.ended() {
                bail!(
                    "the session ended; stdout {:?}",
                    String::from_utf8_lossy(&self.stdout)
                );
            }
            tokio::time::timeout_at(deadline, self.read_one())
                .await
                .with_context(|| {
                    format!(
                        "timed out after {timeout:?}; stdout so far {:?}",
                        String::from_utf8_lossy(&self.stdout)
                    )
                })??;
        }
        Ok(())
    }

    /// Reads one frame or message and files its bytes.
    async fn read_one(&mut self) -> anyhow::Result<()> {
        match &mut self.wire {
            Wire::Ws { ws, closed } => match ws.message().await? {
                None => *closed = true,
                Some(m) => match m.split_first() {
                    Some((1, d)) => self.stdout.extend(d),
                    Some((2, d)) => self.stderr.extend(d),
                    Some((3, d)) => self.error.extend(d),
                    _ => {}
                },
            },
            Wire::Spdy { s, ids, open, .. } => {
                let Some((kind, id, flags, payload)) = s.frame().await? else {
                    bail!("connection closed with streams {open:?} open");
                };
                match kind {
                    None => {
                        match ids.get(&id).copied() {
                            Some("stdout") => self.stdout.extend(&payload),
                            Some("stderr") => self.stderr.extend(&payload),
                            Some("error") => self.error.extend(&payload),
                            _ => {}
                        }
                        if flags & 1 != 0 {
                            open.retain(|p| *p != id);
                        }
                    }
                    Some(3) => {
                        let status = u32::from_be_bytes(payload[4..8].try_into()?);
                        bail!("stream {id} reset with status {status}");
                    }
                    Some(7) => bail!("GOAWAY with streams {open:?} open"),
                    Some(_) => {}
                }
            }
        }
        Ok(())
    }

    /// Reads until stdout contains `text`.
    pub async fn read_stdout_until(&mut self, text: &str, timeout: Duration) -> anyhow::Result<()> {
        self.read_until(timeout, |s| {
            String::from_utf8_lossy(&s.stdout).contains(text)
        })
        .await
    }
}

/// The kubelet's channel form of port-forward over WebSocket (`v4.channel.k8s.io`): one
/// connection to the port the URL names in its `port` query parameter. Checks the port prefix
/// of the first message on the data and error channels, sends `request` on the data channel,
/// then collects both channels until the server closes the connection (after the pod closed
/// its socket).
pub async fn port_forward_channels(
    url: &str,
    port: u16,
    request: &[u8],
) -> anyhow::Result<Forwarded> {
    let mut ws = Ws::connect(&format!("{url}?port={port}"), &["v4.channel.k8s.io"]).await?;
    if ws.protocol != "v4.channel.k8s.io" {
        bail!("the server chose {:?}", ws.protocol);
    }
    let mut out = Forwarded::default();
    let mut first = [true, true];
    if !request.is_empty() {
        ws.send_channel(0, request).await?;
    }
    loop {
        let m = tokio::time::timeout(Duration::from_secs(60), ws.message())
            .await
            .context("the forward did not end in 60 s")??;
        let Some(m) = m else { break };
        let (&channel, mut data) = m.split_first().context("an empty message")?;
        if channel > 1 {
            bail!("a message on channel {channel}");
        }
        if std::mem::take(&mut first[usize::from(channel)]) {
            if data.get(..2) != Some(&port.to_le_bytes()[..]) {
                bail!("channel {channel} did not start with the port: {data:?}");
            }
            data = &data[2..];
        }
        if channel == 0 {
            out.data.extend_from_slice(data);
        } else {
            out.error.extend_from_slice(data);
        }
    }
    Ok(out)
}

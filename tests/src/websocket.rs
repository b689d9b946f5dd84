//! A minimal WebSocket client (RFC 6455) for black-box tests of a CRI streaming server over
//! WebSocket, as client-go uses it: the opening handshake (the server's `Sec-WebSocket-Accept`
//! is checked), masked binary frames, answers to the server's pings, the closing handshake.
//!
//! On top of it, what client-go speaks over WebSocket: [`Ws::tunnel`], a byte stream in binary
//! messages (SPDY tunnelled through WebSocket, as client-go's port-forward tunnelling dialer;
//! [`crate::remotecommand::PortForward::connect_websocket`] runs its SPDY client on it), and
//! the kubelet's per-port channel form of port-forward
//! ([`crate::remotecommand::port_forward_channels`]). remotecommand sessions over WebSocket are
//! [`crate::remotecommand::Session`]s with [`crate::remotecommand::Transport::WebSocket`].
//!
//! Written for tests from RFC 6455 and the Kubernetes protocols; independent of minicri's server
//! code on purpose.

use anyhow::bail;
use base64::Engine;
use sha1::Digest;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::net::TcpStream;

use crate::upgrade::http_upgrade;

pub const OP_CONTINUATION: u8 = 0x0;
pub const OP_TEXT: u8 = 0x1;
pub const OP_BINARY: u8 = 0x2;
pub const OP_CLOSE: u8 = 0x8;
pub const OP_PING: u8 = 0x9;
pub const OP_PONG: u8 = 0xA;

/// The v5 close signal's channel: `[255, channel]` closes the client's input on `channel`.
pub const CLOSE_SIGNAL: u8 = 255;

/// The key every test handshake sends (RFC 6455 1.3's example) and the answer it must get.
const KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";

fn expected_accept(key: &str) -> String {
    let mut h = sha1::Sha1::new();
    h.update(key.as_bytes());
    h.update(b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11");
    base64::engine::general_purpose::STANDARD.encode(h.finalize())
}

/// The answer to a WebSocket upgrade request.
pub struct Answer {
    pub status: u16,
    /// The response head, header names lowercased.
    pub head: String,
    conn: TcpStream,
}

impl Answer {
    /// The value of response header `name` (lowercase).
    pub fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k == name).then(|| v.trim().to_string())
        })
    }
}

/// Sends a WebSocket upgrade request (`method`, normally GET; version 13 unless `extra` names
/// one) for `url` offering `protocols`; reads the response head. `extra` headers are added as
/// given (e.g. to break the handshake).
pub async fn upgrade(
    url: &str,
    method: &str,
    protocols: &[&str],
    extra: &[&str],
) -> anyhow::Result<Answer> {
    let mut headers = vec![
        "Connection: Upgrade".to_string(),
        "Upgrade: websocket".to_string(),
        format!("Sec-WebSocket-Key: {KEY}"),
    ];
    if !extra.iter().any(|h| h.starts_with("Sec-WebSocket-Version")) {
        headers.push("Sec-WebSocket-Version: 13".into());
    }
    if !protocols.is_empty() {
        headers.push(format!("Sec-WebSocket-Protocol: {}", protocols.join(", ")));
    }
    headers.extend(extra.iter().map(|h| h.to_string()));
    let (status, head, conn) = http_upgrade(url, method, &headers).await?;
    Ok(Answer { status, head, conn })
}

/// A frame from the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub fin: bool,
    pub op: u8,
    pub payload: Vec<u8>,
}

/// An open WebSocket connection.
pub struct Ws {
    conn: TcpStream,
    /// The subprotocol the server chose (empty: none).
    pub protocol: String,
    /// Whether this side has sent its close frame.
    closing: bool,
}

impl Ws {
    /// Opens `url` offering `protocols`; fails unless the server switches protocols with the
    /// right `Sec-WebSocket-Accept`.
    pub async fn connect(url: &str, protocols: &[&str]) -> anyhow::Result<Ws> {
        let a = upgrade(url, "GET", protocols, &[]).await?;
        if a.status != 101 {
            bail!("upgrade refused: {}", a.head);
        }
        if a.header("upgrade").map(|v| v.to_ascii_lowercase()) != Some("websocket".into()) {
            bail!("not a WebSocket upgrade: {}", a.head);
        }
        // Header values were lowercased with the head: compare the accept key likewise.
        if a.header("sec-websocket-accept") != Some(expected_accept(KEY).to_ascii_lowercase()) {
            bail!("wrong Sec-WebSocket-Accept: {}", a.head);
        }
        Ok(Ws {
            protocol: a.header("sec-websocket-protocol").unwrap_or_default(),
            conn: a.conn,
            closing: false,
        })
    }

    /// Sends one frame, masked as a client must.
    pub async fn send_frame(&mut self, fin: bool, op: u8, payload: &[u8]) -> anyhow::Result<()> {
        Ok(self.conn.write_all(&masked_frame(fin, op, payload)).await?)
    }

    /// Sends one binary message.
    pub async fn send(&mut self, data: &[u8]) -> anyhow::Result<()> {
        self.send_frame(true, OP_BINARY, data).await
    }

    /// Sends `data` on remotecommand `channel` (one binary message).
    pub async fn send_channel(&mut self, channel: u8, data: &[u8]) -> anyhow::Result<()> {
        let mut m = vec![channel];
        m.extend_from_slice(data);
        self.send(&m).await
    }

    /// Sends a close frame with `code` (once).
    pub async fn close(&mut self, code: u16) -> anyhow::Result<()> {
        if !self.closing {
            self.closing = true;
            self.send_frame(true, OP_CLOSE, &code.to_be_bytes()).await?;
        }
        Ok(())
    }

    /// The server's next frame, as it is (pings included); `None` at EOF.
    pub async fn frame(&mut self) -> anyhow::Result<Option<Frame>> {
        read_frame(&mut self.conn).await
    }

    /// The server's next data message (fragments joined; pings answered on the way); `None`
    /// once the server has closed (its close frame is answered) or hung up.
    pub async fn message(&mut self) -> anyhow::Result<Option<Vec<u8>>> {
        let mut partial: Option<Vec<u8>> = None;
        loop {
            let Some(f) = self.frame().await? else {
                return Ok(None);
            };
            match f.op {
                OP_PING => self.send_frame(true, OP_PONG, &f.payload).await?,
                OP_PONG => {}
                OP_CLOSE => {
                    let code = f.payload.get(..2).map(|c| u16::from_be_bytes([c[0], c[1]]));
                    self.close(code.unwrap_or(1000)).await?;
                    return Ok(None);
                }
                OP_BINARY | OP_TEXT if partial.is_none() => {
                    if f.fin {
                        return Ok(Some(f.payload));
                    }
                    partial = Some(f.payload);
                }
                OP_CONTINUATION if partial.is_some() => {
                    let mut p = partial.take().expect("checked");
                    p.extend(f.payload);
                    if f.fin {
                        return Ok(Some(p));
                    }
                    partial = Some(p);
                }
                op => bail!("unexpected frame (opcode {op:#x}) from the server"),
            }
        }
    }

    /// A byte stream carried in binary messages (client-go's SPDY tunnelling): what is written
    /// to the returned end goes out as messages, what comes in is read from it; its EOF closes
    /// the connection. (The server's pings, which minicri does not send, are not answered.)
    pub fn tunnel(self) -> DuplexStream {
        let (theirs, ours) = tokio::io::duplex(64 * 1024);
        let (mut rd, mut wr) = tokio::io::split(ours);
        let (mut read_half, mut write_half) = self.conn.into_split();
        tokio::spawn(async move {
            while let Ok(Some(f)) = read_frame(&mut read_half).await {
                let data = matches!(f.op, OP_BINARY | OP_CONTINUATION);
                if f.op == OP_CLOSE || (data && wr.write_all(&f.payload).await.is_err()) {
                    break;
                }
            }
            let _ = wr.shutdown().await;
        });
        tokio::spawn(async move {
            let mut buf = vec![0u8; 32 * 1024];
            loop {
                match rd.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        let f = masked_frame(true, OP_BINARY, &buf[..n]);
                        if write_half.write_all(&f).await.is_err() {
                            return;
                        }
                    }
                }
            }
            let close = masked_frame(true, OP_CLOSE, &1000u16.to_be_bytes());
            let _ = write_half.write_all(&close).await;
        });
        theirs
    }
}

/// A masked client frame.
fn masked_frame(fin: bool, op: u8, payload: &[u8]) -> Vec<u8> {
    let mask: [u8; 4] = rand::random();
    let mut f = vec![if fin { 0x80 } else { 0 } | op];
    match payload.len() {
        n @ 0..=125 => f.push(0x80 | n as u8),
        n @ 126..=0xffff => {
            f.push(0x80 | 126);
            f.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            f.push(0x80 | 127);
            f.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    f.extend_from_slice(&mask);
    f.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
    f
}

/// Reads one server frame (unmasked); `None` at EOF.
async fn read_frame<R: tokio::io::AsyncRead + Unpin>(r: &mut R) -> anyhow::Result<Option<Frame>> {
    let mut h = [0u8; 2];
    if let Err(e) = r.read_exact(&mut h).await {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            return Ok(None);
        }
        return Err(e.into());
    }
    if h[1] & 0x80 != 0 {
        bail!("the server masked a frame");
    }
    let len = match h[1] & 0x7f {
        126 => u64::from(r.read_u16().await?),
        127 => r.read_u64().await?,
        n => u64::from(n),
    };
    if len > 16 << 20 {
        bail!("a frame of {len} bytes");
    }
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload).await?;
    Ok(Some(Frame {
        fin: h[0] & 0x80 != 0,
        op: h[0] & 0x0f,
        payload,
    }))
}

//! WebSocket (RFC 6455), the server side, for Kubernetes streaming over WebSocket (what
//! client-go's WebSocket executor and `crictl exec/attach/port-forward -r websocket` speak).
//!
//! - this module: the opening handshake's answer ([`accept_key`]) and the frames: [`Decoder`]
//!   turns the client's bytes into whole messages, [`encode`] writes the server's (sans I/O);
//! - [`conn`]: a server connection over an upgraded HTTP/1.1 connection: answers pings, runs
//!   the closing handshake, hands whole binary messages to its user;
//! - [`channels`]: remotecommand over WebSocket (exec, attach): a channel byte per message;
//! - [`tunnel`]: a byte stream carried in binary messages (SPDY over WebSocket);
//! - [`portforward`]: port-forward over WebSocket, tunnelled SPDY or per-port channels.
//!
//! A client is a stranger; it is held to these limits, and the connection is closed with the
//! status code in brackets when it breaks one: a message (one frame, or the fragments of one)
//! larger than [`MAX_MESSAGE`] (1009, before its payload is buffered); an unmasked frame,
//! reserved bits, an unknown opcode, a continuation with nothing to continue, a new message
//! inside a fragmented one, a fragmented or oversized (over 125 bytes) control frame, a close
//! frame with a 1-byte payload or an invalid status code (1002); a close reason that is not
//! UTF-8 (1007); a text message (1003: the Kubernetes protocols served here are binary, their
//! base64 variants are not offered). What a client can make a connection hold is bounded by
//! the message limit times the queues it fills before its connection is no longer read: the
//! decoder's one message, the reader's 4 ([`conn`]) and 4 per input channel ([`channels`],
//! [`portforward`]), so about 13 MiB for an exec with stdin and a terminal at worst; a
//! client-go client sends messages of 32 KiB.

pub mod channels;
pub mod conn;
pub mod portforward;
pub mod tunnel;

use base64::Engine;
use sha1::Digest;

/// The GUID of the opening handshake (RFC 6455 1.3).
const GUID: &str = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

/// The largest message accepted from a client. client-go sends stdin and tunnelled SPDY in
/// messages of at most 32 KiB.
pub const MAX_MESSAGE: usize = 1 << 20;
/// The largest payload of a control frame (RFC 6455 5.5).
const MAX_CONTROL: usize = 125;

/// Close status codes (RFC 6455 7.4.1).
pub mod close {
    pub const NORMAL: u16 = 1000;
    pub const GOING_AWAY: u16 = 1001;
    pub const PROTOCOL_ERROR: u16 = 1002;
    pub const UNSUPPORTED_DATA: u16 = 1003;
    pub const INVALID_PAYLOAD: u16 = 1007;
    pub const TOO_BIG: u16 = 1009;
    pub const INTERNAL_ERROR: u16 = 1011;
}

/// Frame opcodes.
pub mod opcode {
    pub const CONTINUATION: u8 = 0x0;
    pub const TEXT: u8 = 0x1;
    pub const BINARY: u8 = 0x2;
    pub const CLOSE: u8 = 0x8;
    pub const PING: u8 = 0x9;
    pub const PONG: u8 = 0xA;
}

/// `Sec-WebSocket-Accept` for the client's `Sec-WebSocket-Key`.
pub fn accept_key(key: &str) -> String {
    let mut h = sha1::Sha1::new();
    h.update(key.trim().as_bytes());
    h.update(GUID.as_bytes());
    base64::engine::general_purpose::STANDARD.encode(h.finalize())
}

/// Whether `key` is a valid `Sec-WebSocket-Key`: 16 bytes in base64.
pub fn valid_key(key: &str) -> bool {
    base64::engine::general_purpose::STANDARD
        .decode(key.trim())
        .is_ok_and(|k| k.len() == 16)
}

/// A whole message from the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Binary(Vec<u8>),
    Ping(Vec<u8>),
    Pong(Vec<u8>),
    /// The client's close frame: its status code (none if it sent none) and reason.
    Close(Option<u16>, String),
}

/// A broken rule: the connection is closed with `code`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{reason} (close {code})")]
pub struct Violation {
    pub code: u16,
    pub reason: String,
}

fn violation(code: u16, reason: impl Into<String>) -> Violation {
    Violation {
        code,
        reason: reason.into(),
    }
}

/// Whether a client may send `code` in a close frame (RFC 6455 7.4).
fn valid_close_code(code: u16) -> bool {
    matches!(code, 1000..=1003 | 1007..=1011 | 3000..=4999)
}

/// Turns the client's bytes into messages, whatever the read boundaries, holding at most one
/// frame's header and [`MAX_MESSAGE`] bytes of payload (plus one read).
#[derive(Debug)]
pub struct Decoder {
    buf: Vec<u8>,
    /// Where the next frame starts in `buf`: frames are consumed by moving it, and the bytes
    /// before it are dropped once per [`Decoder::feed`] (dropping them per frame moved the rest
    /// of the buffer for every frame: quadratic in the frames of one read).
    pos: usize,
    max: usize,
    /// The fragments of the binary message being received.
    partial: Option<Vec<u8>>,
}

impl Default for Decoder {
    fn default() -> Self {
        Decoder::new(MAX_MESSAGE)
    }
}

impl Decoder {
    /// A decoder refusing messages over `max` bytes.
    pub fn new(max: usize) -> Decoder {
        Decoder {
            buf: Vec::new(),
            pos: 0,
            max,
            partial: None,
        }
    }

    /// Adds bytes read from the connection.
    pub fn feed(&mut self, bytes: &[u8]) {
        self.buf.drain(..self.pos);
        self.pos = 0;
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole message, `Ok(None)` when more bytes are needed; a [`Violation`] ends the
    /// connection (the decoder is then unusable).
    pub fn next_message(&mut self) -> Result<Option<Message>, Violation> {
        loop {
            let Some((fin, op, payload)) = self.next_frame()? else {
                return Ok(None);
            };
            match op {
                opcode::PING => return Ok(Some(Message::Ping(payload))),
                opcode::PONG => return Ok(Some(Message::Pong(payload))),
                opcode::CLOSE => return close_message(payload).map(Some),
                opcode::TEXT => {
                    return Err(violation(
                        close::UNSUPPORTED_DATA,
                        "text messages are not spoken here (binary channels only)",
                    ));
                }
                opcode::BINARY if self.partial.is_some() => {
                    return Err(violation(
                        close::PROTOCOL_ERROR,
                        "a new message inside a fragmented one",
                    ));
                }
                opcode::BINARY if fin => return Ok(Some(Message::Binary(payload))),
                opcode::BINARY => self.partial = Some(payload),
                _ => {
                    // A continuation (next_frame refuses unknown opcodes).
                    let Some(mut partial) = self.partial.take() else {
                        return Err(violation(
                            close::PROTOCOL_ERROR,
                            "a continuation frame with no message to continue",
                        ));
                    };
                    partial.extend_from_slice(&payload);
                    if fin {
                        return Ok(Some(Message::Binary(partial)));
                    }
                    self.partial = Some(partial);
                }
            }
        }
    }

    /// The next whole frame: (FIN, opcode, unmasked payload).
    fn next_frame(&mut self) -> Result<Option<(bool, u8, Vec<u8>)>, Violation> {
        let b = &self.buf[self.pos..];
        if b.len() < 2 {
            return Ok(None);
        }
        let fin = b[0] & 0x80 != 0;
        if b[0] & 0x70 != 0 {
            return Err(violation(
                close::PROTOCOL_ERROR,
                "reserved bits set (no extension was negotiated)",
            ));
        }
        let op = b[0] & 0x0f;
        let control = op & 0x8 != 0;
        if !matches!(
            op,
            opcode::CONTINUATION
                | opcode::TEXT
                | opcode::BINARY
                | opcode::CLOSE
                | opcode::PING
                | opcode::PONG
        ) {
            return Err(violation(
                close::PROTOCOL_ERROR,
                format!("unknown opcode {op:#x}"),
            ));
        }
        if b[1] & 0x80 == 0 {
            return Err(violation(
                close::PROTOCOL_ERROR,
                "client frames must be masked",
            ));
        }
        let (len, at) = match b[1] & 0x7f {
            126 if b.len() >= 4 => (u64::from(u16::from_be_bytes([b[2], b[3]])), 4),
            127 if b.len() >= 10 => (
                u64::from_be_bytes(b[2..10].try_into().expect("8 bytes")),
                10,
            ),
            126 | 127 => return Ok(None),
            n => (u64::from(n), 2),
        };
        if control && (!fin || len > MAX_CONTROL as u64) {
            return Err(violation(
                close::PROTOCOL_ERROR,
                "control frames must be unfragmented and at most 125 bytes",
            ));
        }
        let so_far = self.partial.as_ref().map_or(0, Vec::len) as u64;
        if !control && len.saturating_add(so_far) > self.max as u64 {
            return Err(violation(
                close::TOO_BIG,
                format!("a message over {} bytes", self.max),
            ));
        }
        let len = len as usize;
        if b.len() < at + 4 + len {
            return Ok(None);
        }
        let mask: [u8; 4] = b[at..at + 4].try_into().expect("4 bytes");
        let mut payload = b[at + 4..at + 4 + len].to_vec();
        for (i, x) in payload.iter_mut().enumerate() {
            *x ^= mask[i % 4];
        }
        self.pos += at + 4 + len;
        Ok(Some((fin, op, payload)))
    }

    /// Bytes received that do not make a whole frame yet.
    pub fn pending(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Bytes the decoder holds: [`Decoder::pending`] and the fragments of the message being
    /// received.
    pub fn held(&self) -> usize {
        self.pending() + self.partial.as_ref().map_or(0, Vec::len)
    }
}

fn close_message(p: Vec<u8>) -> Result<Message, Violation> {
    match p.len() {
        0 => Ok(Message::Close(None, String::new())),
        1 => Err(violation(close::PROTOCOL_ERROR, "a close frame of 1 byte")),
        _ => {
            let code = u16::from_be_bytes([p[0], p[1]]);
            if !valid_close_code(code) {
                return Err(violation(
                    close::PROTOCOL_ERROR,
                    format!("invalid close code {code}"),
                ));
            }
            let reason = String::from_utf8(p[2..].to_vec()).map_err(|_| {
                violation(close::INVALID_PAYLOAD, "a close reason that is not UTF-8")
            })?;
            Ok(Message::Close(Some(code), reason))
        }
    }
}

/// Appends a whole, unmasked (server) frame to `out`.
pub fn encode(op: u8, payload: &[u8], out: &mut Vec<u8>) {
    out.push(0x80 | op);
    match payload.len() {
        n @ 0..=125 => out.push(n as u8),
        n @ 126..=0xffff => {
            out.push(126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(payload);
}

/// The payload of a close frame: the status code and a reason cut to fit a control frame.
pub fn close_payload(code: u16, reason: &str) -> Vec<u8> {
    let mut p = code.to_be_bytes().to_vec();
    let mut end = reason.len().min(MAX_CONTROL - 2);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    p.extend_from_slice(&reason.as_bytes()[..end]);
    p
}

#[cfg(test)]
pub(crate) mod tests;

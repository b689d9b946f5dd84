//! SPDY/3.1 framing (draft-mbelshe-httpbis-spdy-00 with the 3.1 flow-control changes), the
//! transport Kubernetes streaming (exec, attach, port-forward) still runs on.
//!
//! - this module: [`Frame`], and [`encode`] / [`decode`] between frames and bytes (sans I/O);
//! - [`headers`]: name/value header blocks and their zlib compression with the SPDY/3
//!   dictionary;
//! - [`flow`]: send windows (per stream and per session) and WINDOW_UPDATE bookkeeping;
//! - [`conn`]: a server-side connection over an async byte stream: accepts the peer's streams,
//!   answers PINGs, writes DATA within the flow-control windows;
//! - [`liveness`]: when a connection is over although its reader cannot tell (keepalive pings,
//!   failed writes, the idle timeout), shared with the WebSocket connection.
//!
//! Wire format: every frame has an 8-byte header. Control frames: `1 | version(15) | type(16)`,
//! `flags(8) | length(24)`; data frames: `0 | stream-id(31)`, `flags(8) | length(24)`. Only
//! version 3 is spoken; unknown control frame types are skipped as the spec requires.

pub mod conn;
pub mod flow;
pub mod headers;
pub mod liveness;
// Compiled in every build (not only under cfg(test)): the runtime's stream tests drive
// sessions with it, and a feature for it would make cargo build the runtime twice.
pub mod test_peer;

use headers::{HeaderCompressor, HeaderDecompressor, Headers};

/// The SPDY version carried in control frames.
pub const VERSION: u16 = 3;
/// Largest payload of one frame (24-bit length).
pub const MAX_FRAME_PAYLOAD: usize = (1 << 24) - 1;
/// Largest frame payload accepted from a peer. The 24-bit length allows 16 MiB, and the payload
/// is read whole before it is parsed: a stranger announcing 16 MiB frames on many connections
/// would make the daemon allocate that much for each. Data frames never need more than the
/// receive window granted (64 KiB per stream; clients write 32 KiB chunks), header blocks are
/// small.
pub const MAX_RECV_PAYLOAD: usize = 1 << 20;
/// Initial per-stream and per-session flow-control window (SPDY/3.1: 64 KiB).
pub const DEFAULT_WINDOW: u32 = 64 * 1024;

pub const FLAG_FIN: u8 = 0x01;
pub const FLAG_UNIDIRECTIONAL: u8 = 0x02;
pub const FLAG_SETTINGS_CLEAR: u8 = 0x01;

const TYPE_SYN_STREAM: u16 = 1;
const TYPE_SYN_REPLY: u16 = 2;
const TYPE_RST_STREAM: u16 = 3;
const TYPE_SETTINGS: u16 = 4;
const TYPE_PING: u16 = 6;
const TYPE_GOAWAY: u16 = 7;
const TYPE_HEADERS: u16 = 8;
const TYPE_WINDOW_UPDATE: u16 = 9;

/// RST_STREAM status codes (SPDY/3 2.6.3).
pub mod rst {
    pub const PROTOCOL_ERROR: u32 = 1;
    pub const INVALID_STREAM: u32 = 2;
    pub const REFUSED_STREAM: u32 = 3;
    pub const CANCEL: u32 = 5;
    pub const INTERNAL_ERROR: u32 = 6;
    pub const FLOW_CONTROL_ERROR: u32 = 7;
    pub const STREAM_IN_USE: u32 = 8;
    pub const STREAM_ALREADY_CLOSED: u32 = 9;
}

/// GOAWAY status codes.
pub mod goaway {
    pub const OK: u32 = 0;
    pub const PROTOCOL_ERROR: u32 = 1;
    pub const INTERNAL_ERROR: u32 = 2;
}

/// SETTINGS id of the initial stream window size.
pub const SETTINGS_INITIAL_WINDOW_SIZE: u32 = 7;

#[derive(Debug, thiserror::Error)]
pub enum SpdyError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("SPDY protocol error: {0}")]
    Protocol(String),
    #[error("SPDY header compression: {0}")]
    Compression(String),
}

/// One SETTINGS entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Setting {
    pub flags: u8,
    pub id: u32,
    pub value: u32,
}

/// A SPDY/3.1 frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    SynStream {
        stream_id: u32,
        associated_to: u32,
        /// 0 (highest) to 7.
        priority: u8,
        slot: u8,
        flags: u8,
        headers: Headers,
    },
    SynReply {
        stream_id: u32,
        flags: u8,
        headers: Headers,
    },
    RstStream {
        stream_id: u32,
        status: u32,
    },
    Settings {
        flags: u8,
        entries: Vec<Setting>,
    },
    Ping {
        id: u32,
    },
    GoAway {
        last_good_stream_id: u32,
        status: u32,
    },
    Headers {
        stream_id: u32,
        flags: u8,
        headers: Headers,
    },
    /// `stream_id` 0 updates the session window (SPDY/3.1).
    WindowUpdate {
        stream_id: u32,
        delta: u32,
    },
    Data {
        stream_id: u32,
        flags: u8,
        data: Vec<u8>,
    },
    /// A control frame of a type this implementation does not know; skipped.
    Unknown {
        frame_type: u16,
    },
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

fn control_header(out: &mut Vec<u8>, frame_type: u16, flags: u8, len: usize) {
    out.extend_from_slice(&(0x8000 | VERSION).to_be_bytes());
    out.extend_from_slice(&frame_type.to_be_bytes());
    out.extend_from_slice(&((u32::from(flags) << 24) | len as u32).to_be_bytes());
}

/// Appends the wire form of `frame` to `out`. Header blocks go through `z`, which must see
/// every header block of the connection's direction in order.
pub fn encode(frame: &Frame, z: &mut HeaderCompressor, out: &mut Vec<u8>) -> Result<(), SpdyError> {
    let too_big = |n: usize| {
        if n > MAX_FRAME_PAYLOAD {
            Err(SpdyError::Protocol(format!("frame payload of {n} bytes")))
        } else {
            Ok(())
        }
    };
    match frame {
        Frame::SynStream {
            stream_id,
            associated_to,
            priority,
            slot,
            flags,
            headers,
        } => {
            let block = z.compress(headers)?;
            too_big(block.len() + 10)?;
            control_header(out, TYPE_SYN_STREAM, *flags, block.len() + 10);
            out.extend_from_slice(&(stream_id & 0x7fff_ffff).to_be_bytes());
            out.extend_from_slice(&(associated_to & 0x7fff_ffff).to_be_bytes());
            out.push((priority & 0x7) << 5);
            out.push(*slot);
            out.extend_from_slice(&block);
        }
        Frame::SynReply {
            stream_id,
            flags,
            headers,
        }
        | Frame::Headers {
            stream_id,
            flags,
            headers,
        } => {
            let t = if matches!(frame, Frame::SynReply { .. }) {
                TYPE_SYN_REPLY
            } else {
                TYPE_HEADERS
            };
            let block = z.compress(headers)?;
            too_big(block.len() + 4)?;
            control_header(out, t, *flags, block.len() + 4);
            out.extend_from_slice(&(stream_id & 0x7fff_ffff).to_be_bytes());
            out.extend_from_slice(&block);
        }
        Frame::RstStream { stream_id, status } => {
            control_header(out, TYPE_RST_STREAM, 0, 8);
            out.extend_from_slice(&(stream_id & 0x7fff_ffff).to_be_bytes());
            out.extend_from_slice(&status.to_be_bytes());
        }
        Frame::Settings { flags, entries } => {
            too_big(4 + 8 * entries.len())?;
            control_header(out, TYPE_SETTINGS, *flags, 4 + 8 * entries.len());
            out.extend_from_slice(&(entries.len() as u32).to_be_bytes());
            for e in entries {
                out.extend_from_slice(
                    &((u32::from(e.flags) << 24) | (e.id & 0xff_ffff)).to_be_bytes(),
                );
                out.extend_from_slice(&e.value.to_be_bytes());
            }
        }
        Frame::Ping { id } => {
            control_header(out, TYPE_PING, 0, 4);
            out.extend_from_slice(&id.to_be_bytes());
        }
        Frame::GoAway {
            last_good_stream_id,
            status,
        } => {
            control_header(out, TYPE_GOAWAY, 0, 8);
            out.extend_from_slice(&(last_good_stream_id & 0x7fff_ffff).to_be_bytes());
            out.extend_from_slice(&status.to_be_bytes());
        }
        Frame::WindowUpdate { stream_id, delta } => {
            control_header(out, TYPE_WINDOW_UPDATE, 0, 8);
            out.extend_from_slice(&(stream_id & 0x7fff_ffff).to_be_bytes());
            out.extend_from_slice(&(delta & 0x7fff_ffff).to_be_bytes());
        }
        Frame::Data {
            stream_id,
            flags,
            data,
        } => {
            too_big(data.len())?;
            out.extend_from_slice(&(stream_id & 0x7fff_ffff).to_be_bytes());
            out.extend_from_slice(&((u32::from(*flags) << 24) | data.len() as u32).to_be_bytes());
            out.extend_from_slice(data);
        }
        Frame::Unknown { frame_type } => {
            return Err(SpdyError::Protocol(format!(
                "cannot encode unknown frame type {frame_type}"
            )));
        }
    }
    Ok(())
}

/// The payload length announced by a frame's 8-byte header.
pub fn payload_len(header: &[u8; 8]) -> usize {
    (be32(&header[4..8]) & 0xff_ffff) as usize
}

/// Parses one frame from its 8-byte header and its payload (`payload_len(header)` bytes).
pub fn decode(
    header: &[u8; 8],
    payload: Vec<u8>,
    z: &mut HeaderDecompressor,
) -> Result<Frame, SpdyError> {
    let first = be32(&header[0..4]);
    let flags = header[4];
    if first & 0x8000_0000 == 0 {
        let stream_id = first & 0x7fff_ffff;
        if stream_id == 0 {
            return Err(SpdyError::Protocol("data frame on stream 0".into()));
        }
        return Ok(Frame::Data {
            stream_id,
            flags,
            data: payload,
        });
    }
    let version = ((first >> 16) & 0x7fff) as u16;
    let frame_type = (first & 0xffff) as u16;
    if version != VERSION {
        return Err(SpdyError::Protocol(format!(
            "control frame of SPDY version {version}, only 3 is spoken"
        )));
    }
    let p = &payload[..];
    let need = |n: usize, what: &str| {
        if p.len() < n {
            Err(SpdyError::Protocol(format!(
                "{what} frame of {} bytes is too short",
                p.len()
            )))
        } else {
            Ok(())
        }
    };
    let exact = |n: usize, what: &str| {
        if p.len() != n {
            Err(SpdyError::Protocol(format!(
                "{what} frame of {} bytes, not {n}",
                p.len()
            )))
        } else {
            Ok(())
        }
    };
    let nonzero = |id: u32, what: &str| {
        if id == 0 {
            Err(SpdyError::Protocol(format!("{what} on stream 0")))
        } else {
            Ok(id)
        }
    };
    Ok(match frame_type {
        TYPE_SYN_STREAM => {
            need(10, "SYN_STREAM")?;
            Frame::SynStream {
                stream_id: nonzero(be32(&p[0..4]) & 0x7fff_ffff, "SYN_STREAM")?,
                associated_to: be32(&p[4..8]) & 0x7fff_ffff,
                priority: p[8] >> 5,
                slot: p[9],
                flags,
                headers: z.decompress(&p[10..])?,
            }
        }
        TYPE_SYN_REPLY | TYPE_HEADERS => {
            need(4, "SYN_REPLY/HEADERS")?;
            let stream_id = nonzero(be32(&p[0..4]) & 0x7fff_ffff, "SYN_REPLY/HEADERS")?;
            let headers = z.decompress(&p[4..])?;
            if frame_type == TYPE_SYN_REPLY {
                Frame::SynReply {
                    stream_id,
                    flags,
                    headers,
                }
            } else {
                Frame::Headers {
                    stream_id,
                    flags,
                    headers,
                }
            }
        }
        TYPE_RST_STREAM => {
            exact(8, "RST_STREAM")?;
            Frame::RstStream {
                stream_id: nonzero(be32(&p[0..4]) & 0x7fff_ffff, "RST_STREAM")?,
                status: be32(&p[4..8]),
            }
        }
        TYPE_SETTINGS => {
            need(4, "SETTINGS")?;
            let n = be32(&p[0..4]) as usize;
            if p.len() != 4 + n.saturating_mul(8) {
                return Err(SpdyError::Protocol(format!(
                    "SETTINGS frame of {} bytes for {n} entries",
                    p.len()
                )));
            }
            let entries = p[4..]
                .chunks_exact(8)
                .map(|e| {
                    let fid = be32(&e[0..4]);
                    Setting {
                        flags: (fid >> 24) as u8,
                        id: fid & 0xff_ffff,
                        value: be32(&e[4..8]),
                    }
                })
                .collect();
            Frame::Settings { flags, entries }
        }
        TYPE_PING => {
            exact(4, "PING")?;
            Frame::Ping { id: be32(p) }
        }
        TYPE_GOAWAY => {
            exact(8, "GOAWAY")?;
            Frame::GoAway {
                last_good_stream_id: be32(&p[0..4]) & 0x7fff_ffff,
                status: be32(&p[4..8]),
            }
        }
        TYPE_WINDOW_UPDATE => {
            exact(8, "WINDOW_UPDATE")?;
            let delta = be32(&p[4..8]) & 0x7fff_ffff;
            if delta == 0 {
                return Err(SpdyError::Protocol("WINDOW_UPDATE of 0".into()));
            }
            Frame::WindowUpdate {
                stream_id: be32(&p[0..4]) & 0x7fff_ffff,
                delta,
            }
        }
        other => Frame::Unknown { frame_type: other },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(frames: &[Frame]) {
        let mut c = HeaderCompressor::new();
        let mut d = HeaderDecompressor::new();
        let mut wire = Vec::new();
        for f in frames {
            encode(f, &mut c, &mut wire).unwrap();
        }
        let mut rest = &wire[..];
        for f in frames {
            let h: [u8; 8] = rest[..8].try_into().unwrap();
            let n = payload_len(&h);
            let got = decode(&h, rest[8..8 + n].to_vec(), &mut d).unwrap();
            assert_eq!(&got, f);
            rest = &rest[8 + n..];
        }
        assert!(rest.is_empty());
    }

    #[test]
    fn every_frame_type_round_trips() {
        round_trip(&[
            Frame::SynStream {
                stream_id: 1,
                associated_to: 0,
                priority: 3,
                slot: 0,
                flags: FLAG_FIN,
                headers: Headers::new().with("streamtype", "error"),
            },
            Frame::SynReply {
                stream_id: 1,
                flags: 0,
                headers: Headers::new(),
            },
            Frame::Headers {
                stream_id: 3,
                flags: FLAG_FIN,
                headers: Headers::new().with("a", "b"),
            },
            Frame::RstStream {
                stream_id: 5,
                status: rst::CANCEL,
            },
            Frame::Settings {
                flags: FLAG_SETTINGS_CLEAR,
                entries: vec![Setting {
                    flags: 0,
                    id: SETTINGS_INITIAL_WINDOW_SIZE,
                    value: 1 << 20,
                }],
            },
            Frame::Ping { id: 7 },
            Frame::GoAway {
                last_good_stream_id: 9,
                status: goaway::OK,
            },
            Frame::WindowUpdate {
                stream_id: 0,
                delta: 4096,
            },
            Frame::Data {
                stream_id: 3,
                flags: FLAG_FIN,
                data: b"hello".to_vec(),
            },
            Frame::Data {
                stream_id: 0x7fff_fffd,
                flags: 0,
                data: vec![0; 100_000],
            },
        ]);
    }

    #[test]
    fn wire_layout_matches_the_spec() {
        let mut c = HeaderCompressor::new();
        let mut w = Vec::new();
        encode(&Frame::Ping { id: 1 }, &mut c, &mut w).unwrap();
        assert_eq!(w, [0x80, 3, 0, 6, 0, 0, 0, 4, 0, 0, 0, 1]);
        w.clear();
        encode(
            &Frame::Data {
                stream_id: 5,
                flags: FLAG_FIN,
                data: b"ab".to_vec(),
            },
            &mut c,
            &mut w,
        )
        .unwrap();
        assert_eq!(w, [0, 0, 0, 5, 1, 0, 0, 2, b'a', b'b']);
        w.clear();
        encode(
            &Frame::WindowUpdate {
                stream_id: 1,
                delta: 0x10000,
            },
            &mut c,
            &mut w,
        )
        .unwrap();
        assert_eq!(w, [0x80, 3, 0, 9, 0, 0, 0, 8, 0, 0, 0, 1, 0, 1, 0, 0]);
        w.clear();
        encode(
            &Frame::RstStream {
                stream_id: 3,
                status: rst::REFUSED_STREAM,
            },
            &mut c,
            &mut w,
        )
        .unwrap();
        assert_eq!(w, [0x80, 3, 0, 3, 0, 0, 0, 8, 0, 0, 0, 3, 0, 0, 0, 3]);
    }

    #[test]
    fn malformed_frames_are_errors_and_unknown_types_are_skipped() {
        let mut d = HeaderDecompressor::new();
        let hdr = |t: u16, len: u32| {
            let mut h = [0u8; 8];
            h[0..2].copy_from_slice(&(0x8000u16 | 3).to_be_bytes());
            h[2..4].copy_from_slice(&t.to_be_bytes());
            h[4..8].copy_from_slice(&len.to_be_bytes());
            h
        };
        assert!(decode(&hdr(TYPE_PING, 3), vec![0; 3], &mut d).is_err());
        assert!(decode(&hdr(TYPE_WINDOW_UPDATE, 8), vec![0; 8], &mut d).is_err());
        assert!(decode(&hdr(TYPE_RST_STREAM, 8), vec![0; 8], &mut d).is_err());
        assert!(decode(&hdr(TYPE_SETTINGS, 8), vec![0, 0, 0, 2, 0, 0, 0, 0], &mut d).is_err());
        assert_eq!(
            decode(&hdr(0x20, 2), vec![1, 2], &mut d).unwrap(),
            Frame::Unknown { frame_type: 0x20 }
        );
        let mut v2 = hdr(TYPE_PING, 4);
        v2[1] = 2;
        assert!(decode(&v2, vec![0, 0, 0, 1], &mut d).is_err());
        assert!(decode(&[0, 0, 0, 0, 0, 0, 0, 0], vec![], &mut d).is_err());
        assert_eq!(
            payload_len(&[0, 0, 0, 1, 0xff, 0x12, 0x34, 0x56]),
            0x12_3456
        );
    }
}

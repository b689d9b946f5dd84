//! The frame codec and its limits; [`Client`], a minimal masking client for the connection
//! tests of this module's submodules.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::*;

/// A client frame (masked, with a fixed mask) of `payload`.
pub(crate) fn client_frame(fin: bool, op: u8, payload: &[u8]) -> Vec<u8> {
    let mask = [0x37, 0xfa, 0x21, 0x3d];
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

/// The client's end of an in-memory connection.
pub(crate) struct Client<IO> {
    io: IO,
}

impl<IO: AsyncRead + AsyncWrite + Unpin> Client<IO> {
    pub(crate) fn new(io: IO) -> Self {
        Client { io }
    }

    pub(crate) async fn raw(&mut self, bytes: &[u8]) {
        self.io.write_all(bytes).await.unwrap();
    }

    /// Sends one whole message.
    pub(crate) async fn send(&mut self, op: u8, payload: &[u8]) {
        self.raw(&client_frame(true, op, payload)).await;
    }

    /// The server's next frame (opcode, payload); `None` at EOF. Server frames are whole and
    /// unmasked.
    pub(crate) async fn recv(&mut self) -> Option<(u8, Vec<u8>)> {
        let mut h = [0u8; 2];
        let read = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            self.io.read_exact(&mut h),
        )
        .await
        .expect("a frame in time");
        if read.is_err() {
            return None;
        }
        assert_eq!(h[0] & 0xf0, 0x80, "FIN, no reserved bits");
        assert_eq!(h[1] & 0x80, 0, "server frames are not masked");
        let len = match h[1] & 0x7f {
            126 => u64::from(self.io.read_u16().await.unwrap()),
            127 => self.io.read_u64().await.unwrap(),
            n => u64::from(n),
        };
        let mut p = vec![0u8; len as usize];
        self.io.read_exact(&mut p).await.unwrap();
        Some((h[0] & 0x0f, p))
    }
}

#[test]
fn accept_key_is_the_rfc_example() {
    // RFC 6455 1.3.
    assert_eq!(
        accept_key("dGhlIHNhbXBsZSBub25jZQ=="),
        "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
    );
    assert!(valid_key("dGhlIHNhbXBsZSBub25jZQ=="));
    assert!(!valid_key("c2hvcnQ="), "8 bytes");
    assert!(!valid_key("not base64!"));
}

fn decode_all(d: &mut Decoder) -> Result<Vec<Message>, Violation> {
    let mut out = Vec::new();
    while let Some(m) = d.next_message()? {
        out.push(m);
    }
    Ok(out)
}

#[test]
fn messages_survive_any_split() {
    let mut wire = Vec::new();
    wire.extend(client_frame(true, opcode::BINARY, b"\x00one"));
    wire.extend(client_frame(false, opcode::BINARY, &[1u8; 200]));
    wire.extend(client_frame(true, opcode::PING, b"ping"));
    wire.extend(client_frame(false, opcode::CONTINUATION, &[2u8; 70_000]));
    wire.extend(client_frame(true, opcode::CONTINUATION, b""));
    wire.extend(client_frame(true, opcode::PONG, b""));
    wire.extend(client_frame(
        true,
        opcode::CLOSE,
        &close_payload(1000, "done"),
    ));
    let mut big = vec![1u8; 200];
    big.extend([2u8; 70_000]);
    let want = vec![
        Message::Binary(b"\x00one".to_vec()),
        Message::Ping(b"ping".to_vec()),
        Message::Binary(big),
        Message::Pong(vec![]),
        Message::Close(Some(1000), "done".into()),
    ];
    for step in [1, 2, 3, 7, 125, 4096, wire.len()] {
        let mut d = Decoder::default();
        let mut got = Vec::new();
        for chunk in wire.chunks(step) {
            d.feed(chunk);
            got.extend(decode_all(&mut d).unwrap());
        }
        assert_eq!(got, want, "chunks of {step}");
        assert_eq!(d.pending(), 0);
    }
}

#[test]
fn limits_and_rules() {
    let refused = |wire: Vec<u8>, max: usize| {
        let mut d = Decoder::new(max);
        d.feed(&wire);
        decode_all(&mut d).unwrap_err().code
    };
    // One frame over the limit, refused from its header alone.
    let mut header_only = client_frame(true, opcode::BINARY, &[0u8; 2000]);
    header_only.truncate(8);
    assert_eq!(refused(header_only, 1000), close::TOO_BIG);
    // Fragments adding up to more than the limit.
    let mut w = client_frame(false, opcode::BINARY, &[0u8; 600]);
    w.extend(client_frame(true, opcode::CONTINUATION, &[0u8; 600]));
    assert_eq!(refused(w, 1000), close::TOO_BIG);
    // Exactly the limit is fine.
    let mut d = Decoder::new(1000);
    d.feed(&client_frame(true, opcode::BINARY, &[0u8; 1000]));
    assert_eq!(decode_all(&mut d).unwrap().len(), 1);
    // Control frames: unfragmented, at most 125 bytes, even under a large limit.
    assert_eq!(
        refused(client_frame(true, opcode::PING, &[0u8; 126]), MAX_MESSAGE),
        close::PROTOCOL_ERROR
    );
    assert_eq!(
        refused(client_frame(false, opcode::PONG, b""), MAX_MESSAGE),
        close::PROTOCOL_ERROR
    );
    // A new message inside a fragmented one.
    let mut w = client_frame(false, opcode::BINARY, b"a");
    w.extend(client_frame(true, opcode::BINARY, b"b"));
    assert_eq!(refused(w, MAX_MESSAGE), close::PROTOCOL_ERROR);
    // Reserved bits, unknown opcodes, unmasked frames.
    let mut rsv = client_frame(true, opcode::BINARY, b"x");
    rsv[0] |= 0x40;
    assert_eq!(refused(rsv, MAX_MESSAGE), close::PROTOCOL_ERROR);
    assert_eq!(
        refused(client_frame(true, 0x3, b""), MAX_MESSAGE),
        close::PROTOCOL_ERROR
    );
    assert_eq!(
        refused(vec![0x82, 0x00], MAX_MESSAGE),
        close::PROTOCOL_ERROR
    );
    // Text is not spoken here.
    assert_eq!(
        refused(client_frame(true, opcode::TEXT, b"0aGk="), MAX_MESSAGE),
        close::UNSUPPORTED_DATA
    );
    // Close frames: 1 byte, a reserved code, a reason that is not UTF-8.
    assert_eq!(
        refused(client_frame(true, opcode::CLOSE, &[3]), MAX_MESSAGE),
        close::PROTOCOL_ERROR
    );
    assert_eq!(
        refused(
            client_frame(true, opcode::CLOSE, &[0x03, 0xed]),
            MAX_MESSAGE
        ),
        close::PROTOCOL_ERROR,
        "1005 is never sent"
    );
    assert_eq!(
        refused(
            client_frame(true, opcode::CLOSE, &[0x03, 0xe8, 0xff]),
            MAX_MESSAGE
        ),
        close::INVALID_PAYLOAD
    );
    let mut d = Decoder::default();
    d.feed(&client_frame(true, opcode::CLOSE, &[]));
    assert_eq!(
        decode_all(&mut d).unwrap(),
        [Message::Close(None, String::new())]
    );
}

#[test]
fn server_frames_use_the_shortest_length() {
    let mut out = Vec::new();
    encode(opcode::BINARY, &[9u8; 125], &mut out);
    assert_eq!(&out[..2], &[0x82, 125]);
    out.clear();
    encode(opcode::BINARY, &[9u8; 126], &mut out);
    assert_eq!(&out[..4], &[0x82, 126, 0, 126]);
    out.clear();
    encode(opcode::BINARY, &[9u8; 70_000], &mut out);
    assert_eq!(&out[..2], &[0x82, 127]);
    assert_eq!(u64::from_be_bytes(out[2..10].try_into().unwrap()), 70_000);
    assert_eq!(out.len(), 10 + 70_000);
    // A close reason is cut to fit a control frame, on a character boundary.
    let p = close_payload(1000, &"é".repeat(100));
    assert!(p.len() <= 125);
    assert!(std::str::from_utf8(&p[2..]).is_ok());
}

/// Many small frames in one read cost each its own bytes, not the rest of the buffer: 2 MiB of
/// empty frames (350,000 of them) decode in well under a second. Dropping each frame's bytes
/// from the front of the buffer moved the rest every time: about 370 GB of copying here, 7 s on
/// the development machine; for the connection's 64 KiB reads, 7 ms of copying per read, so a
/// client sending empty frames at 100 MB/s kept several cores busy.
#[test]
fn many_frames_in_one_read_decode_in_linear_time() {
    let frame = client_frame(true, opcode::BINARY, b"");
    let n = (2 << 20) / frame.len();
    let wire: Vec<u8> = frame
        .iter()
        .copied()
        .cycle()
        .take(n * frame.len())
        .collect();
    let mut d = Decoder::new(MAX_MESSAGE);
    let start = std::time::Instant::now();
    d.feed(&wire);
    assert_eq!(decode_all(&mut d).unwrap().len(), n);
    assert_eq!(d.pending(), 0);
    assert!(
        start.elapsed() < std::time::Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
}

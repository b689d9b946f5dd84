//! A SPDY client for tests (this crate's and the runtime's streaming tests): writes and reads
//! whole frames on any byte stream.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::headers::{HeaderCompressor, HeaderDecompressor, Headers};
use super::{Frame, decode, encode, payload_len};

pub struct Peer<IO> {
    pub io: IO,
    z: HeaderCompressor,
    dz: HeaderDecompressor,
}

impl<IO: AsyncRead + AsyncWrite + Unpin> Peer<IO> {
    pub fn new(io: IO) -> Peer<IO> {
        Peer {
            io,
            z: HeaderCompressor::new(),
            dz: HeaderDecompressor::new(),
        }
    }

    pub async fn send(&mut self, f: Frame) {
        let mut buf = Vec::new();
        encode(&f, &mut self.z, &mut buf).unwrap();
        self.io.write_all(&buf).await.unwrap();
    }

    /// The next frame; `None` at EOF.
    pub async fn try_recv(&mut self) -> Option<Frame> {
        let mut h = [0u8; 8];
        self.io.read_exact(&mut h).await.ok()?;
        let mut p = vec![0; payload_len(&h)];
        self.io.read_exact(&mut p).await.unwrap();
        Some(decode(&h, p, &mut self.dz).unwrap())
    }

    pub async fn recv(&mut self) -> Frame {
        self.try_recv().await.expect("a frame, not EOF")
    }

    /// Opens stream `id` with `streamType: kind`.
    pub async fn open(&mut self, id: u32, kind: &str) {
        self.send(Frame::SynStream {
            stream_id: id,
            associated_to: 0,
            priority: 0,
            slot: 0,
            flags: 0,
            headers: Headers::new().with("streamType", kind),
        })
        .await;
    }
}

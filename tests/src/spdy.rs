//! The client side of SPDY/3.1 framing, for the test clients of [`crate::remotecommand`]: the
//! header dictionary and compression, SYN_STREAM, DATA, and reading frames. It never sends
//! WINDOW_UPDATE, like client-go's SPDY library, so a server that waited for window updates
//! would stall past 64 KiB.
//!
//! Written for tests from the SPDY/3 draft; independent of minicri's server code on purpose.

use anyhow::bail;
use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The SPDY/3 header dictionary: length-prefixed words, then a tail (draft section 2.6.10.1).
fn dictionary() -> Vec<u8> {
    const WORDS: &str = "options head post put delete trace accept accept-charset \
        accept-encoding accept-language accept-ranges age allow authorization cache-control \
        connection content-base content-encoding content-language content-length \
        content-location content-md5 content-range content-type date etag expect expires from \
        host if-match if-modified-since if-none-match if-range if-unmodified-since \
        last-modified location max-forwards pragma proxy-authenticate proxy-authorization range \
        referer retry-after server te trailer transfer-encoding upgrade user-agent vary via \
        warning www-authenticate method get status 200_OK version HTTP/1.1 url public \
        set-cookie keep-alive origin";
    const TAIL: &str = "100101201202205206300302303304305306307402405406407408409410411412413\
        414415416417502504505203 Non-Authoritative Information204 No Content301 Moved \
        Permanently400 Bad Request401 Unauthorized403 Forbidden404 Not Found500 Internal \
        Server Error501 Not Implemented503 Service UnavailableJan Feb Mar Apr May Jun Jul Aug \
        Sept Oct Nov Dec 00:00:00 Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMTchunked,text/html,\
        image/png,image/jpg,image/gif,application/xml,application/xhtml+xml,text/plain,\
        text/javascript,publicprivatemax-age=gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,\
        utf-,*,enq=0.";
    let mut d = Vec::new();
    for w in WORDS.split_whitespace() {
        let w = w.replace('_', " ");
        d.extend_from_slice(&(w.len() as u32).to_be_bytes());
        d.extend_from_slice(w.as_bytes());
    }
    d.extend_from_slice(TAIL.as_bytes());
    assert_eq!(d.len(), 1423, "the SPDY/3 dictionary");
    d
}

/// A byte stream a SPDY client can run on: a TCP connection, or a WebSocket tunnel.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// The client side of a SPDY/3.1 connection: streams it opens, DATA both ways, frames read
/// whole (SYN_REPLY header blocks decompressed to keep the zlib stream in step).
pub struct Spdy {
    conn: Box<dyn Io>,
    z: Compress,
    dz: Decompress,
}

impl Spdy {
    pub fn new(conn: impl Io + 'static) -> Spdy {
        let mut z = Compress::new(Compression::default(), true);
        z.set_dictionary(&dictionary()).unwrap();
        Spdy {
            conn: Box::new(conn),
            z,
            dz: Decompress::new(true),
        }
    }

    pub async fn syn_stream(&mut self, id: u32, stream_type: &str) -> anyhow::Result<()> {
        self.syn_stream_with(id, &[("streamtype", stream_type)])
            .await
    }

    /// Opens stream `id` with `headers` (names lowercase, as SPDY/3 wants them).
    pub async fn syn_stream_with(
        &mut self,
        id: u32,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<()> {
        let mut block = Vec::new();
        block.extend_from_slice(&(headers.len() as u32).to_be_bytes());
        for s in headers.iter().flat_map(|(k, v)| [*k, *v]) {
            block.extend_from_slice(&(s.len() as u32).to_be_bytes());
            block.extend_from_slice(s.as_bytes());
        }
        let mut z = Vec::with_capacity(block.len() + 1024);
        self.z.compress_vec(&block, &mut z, FlushCompress::Sync)?;
        let mut f = vec![0x80, 3, 0, 1];
        f.extend_from_slice(&((10 + z.len()) as u32).to_be_bytes());
        f.extend_from_slice(&id.to_be_bytes());
        f.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
        f.extend_from_slice(&z);
        Ok(self.conn.write_all(&f).await?)
    }

    pub async fn data(&mut self, id: u32, data: &[u8], fin: bool) -> anyhow::Result<()> {
        let mut f = id.to_be_bytes().to_vec();
        f.extend_from_slice(&((u32::from(fin) << 24) | data.len() as u32).to_be_bytes());
        f.extend_from_slice(data);
        Ok(self.conn.write_all(&f).await?)
    }

    /// The next frame: (control type or None for data, stream id, flags, payload); None at EOF.
    pub async fn frame(&mut self) -> anyhow::Result<Option<(Option<u16>, u32, u8, Vec<u8>)>> {
        let mut h = [0u8; 8];
        if let Err(e) = self.conn.read_exact(&mut h).await {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                return Ok(None);
            }
            return Err(e.into());
        }
        let len = u32::from_be_bytes([0, h[5], h[6], h[7]]) as usize;
        let mut p = vec![0u8; len];
        self.conn.read_exact(&mut p).await?;
        if h[0] & 0x80 == 0 {
            let id = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
            return Ok(Some((None, id, h[4], p)));
        }
        let t = u16::from_be_bytes([h[2], h[3]]);
        let id = if p.len() >= 4 {
            u32::from_be_bytes([p[0] & 0x7f, p[1], p[2], p[3]])
        } else {
            0
        };
        if t == 2 {
            // SYN_REPLY: its header block must be decompressed to keep the zlib stream in step.
            let mut out = Vec::with_capacity(4096);
            let mut input = &p[4..];
            loop {
                let before = self.dz.total_in();
                match self
                    .dz
                    .decompress_vec(input, &mut out, FlushDecompress::Sync)
                {
                    Ok(_) => {}
                    Err(e) if e.needs_dictionary().is_some() => {
                        self.dz.set_dictionary(&dictionary())?;
                    }
                    Err(e) => bail!("SYN_REPLY headers: {e}"),
                }
                input = &input[(self.dz.total_in() - before) as usize..];
                if input.is_empty() && out.len() < out.capacity() {
                    break;
                }
                out.reserve(4096);
            }
        }
        Ok(Some((Some(t), id, h[4], p)))
    }
}

//! SPDY/3 name/value header blocks and their zlib compression.
//!
//! A header block is `u32 count` then, per pair, `u32 len, name, u32 len, value` (names are
//! lowercase; a value holding several values separates them with NUL). The whole block is
//! zlib-compressed with the SPDY/3 dictionary (spec section 2.6.10.1). Each direction of a
//! connection is ONE zlib stream: every block continues the stream of the blocks before it and
//! ends with a sync flush, so one [`HeaderCompressor`] and one [`HeaderDecompressor`] live as long
//! as the connection and must see the blocks in wire order.

use flate2::{Compress, Compression, Decompress, FlushCompress, FlushDecompress, Status};

use super::SpdyError;

/// A decompressed header block may not grow beyond this (a zlib bomb guard; zlib inflates up
/// to about 1000:1). Exec, attach and port-forward streams carry a few short headers, and every
/// stream keeps its block while it lives (a session holds up to 1024), so 16 KiB is plenty.
pub const MAX_BLOCK: usize = 16 << 10;
/// Pairs per header block.
const MAX_PAIRS: u32 = 1000;

/// Header-name words of the SPDY/3 dictionary, each stored with a 4-byte big-endian length.
const DICT_WORDS: &[&str] = &[
    "options",
    "head",
    "post",
    "put",
    "delete",
    "trace",
    "accept",
    "accept-charset",
    "accept-encoding",
    "accept-language",
    "accept-ranges",
    "age",
    "allow",
    "authorization",
    "cache-control",
    "connection",
    "content-base",
    "content-encoding",
    "content-language",
    "content-length",
    "content-location",
    "content-md5",
    "content-range",
    "content-type",
    "date",
    "etag",
    "expect",
    "expires",
    "from",
    "host",
    "if-match",
    "if-modified-since",
    "if-none-match",
    "if-range",
    "if-unmodified-since",
    "last-modified",
    "location",
    "max-forwards",
    "pragma",
    "proxy-authenticate",
    "proxy-authorization",
    "range",
    "referer",
    "retry-after",
    "server",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "user-agent",
    "vary",
    "via",
    "warning",
    "www-authenticate",
    "method",
    "get",
    "status",
    "200 OK",
    "version",
    "HTTP/1.1",
    "url",
    "public",
    "set-cookie",
    "keep-alive",
    "origin",
];

/// The dictionary's tail: status codes and common values, without length prefixes.
const DICT_TAIL: &str = concat!(
    "100101201202205206300302303304305306307402405406407408409410411412413414415416417502504505",
    "203 Non-Authoritative Information204 No Content301 Moved Permanently400 Bad Request",
    "401 Unauthorized403 Forbidden404 Not Found500 Internal Server Error501 Not Implemented",
    "503 Service UnavailableJan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec 00:00:00 ",
    "Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMTchunked,text/html,image/png,image/jpg,image/gif,",
    "application/xml,application/xhtml+xml,text/plain,text/javascript,publicprivatemax-age=",
    "gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,utf-,*,enq=0.",
);

/// The SPDY/3 header compression dictionary (1423 bytes).
pub fn dictionary() -> &'static [u8] {
    static DICT: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    DICT.get_or_init(|| {
        let mut d = Vec::with_capacity(1423);
        for w in DICT_WORDS {
            d.extend_from_slice(&(w.len() as u32).to_be_bytes());
            d.extend_from_slice(w.as_bytes());
        }
        d.extend_from_slice(DICT_TAIL.as_bytes());
        d
    })
}

/// The pairs of one header block, in wire order. Names are lowercase.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Headers(pub Vec<(String, String)>);

impl Headers {
    pub fn new() -> Headers {
        Headers(Vec::new())
    }

    /// Adds a pair; the name is lowercased as SPDY requires.
    pub fn with(mut self, name: &str, value: &str) -> Headers {
        self.0.push((name.to_ascii_lowercase(), value.to_string()));
        self
    }

    /// The first value of `name` (case-insensitive; a NUL-separated value gives its first part).
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.split('\0').next().unwrap_or(""))
    }

    /// The uncompressed block.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&(self.0.len() as u32).to_be_bytes());
        for (n, v) in &self.0 {
            out.extend_from_slice(&(n.len() as u32).to_be_bytes());
            out.extend_from_slice(n.as_bytes());
            out.extend_from_slice(&(v.len() as u32).to_be_bytes());
            out.extend_from_slice(v.as_bytes());
        }
        out
    }

    /// Parses an uncompressed block. Names must be lowercase and appear once (SPDY/3 2.6.10).
    pub fn decode(block: &[u8]) -> Result<Headers, SpdyError> {
        let mut r = block;
        let mut take = |n: usize| -> Result<&[u8], SpdyError> {
            if r.len() < n {
                return Err(SpdyError::Protocol("truncated header block".into()));
            }
            let (a, b) = r.split_at(n);
            r = b;
            Ok(a)
        };
        let count = u32::from_be_bytes(take(4)?.try_into().expect("4 bytes"));
        if count > MAX_PAIRS {
            return Err(SpdyError::Protocol(format!(
                "header block with {count} pairs"
            )));
        }
        let mut pairs: Vec<(String, String)> = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let n = u32::from_be_bytes(take(4)?.try_into().expect("4 bytes")) as usize;
            let name = String::from_utf8(take(n)?.to_vec())
                .map_err(|_| SpdyError::Protocol("header name is not UTF-8".into()))?;
            let n = u32::from_be_bytes(take(4)?.try_into().expect("4 bytes")) as usize;
            let value = String::from_utf8_lossy(take(n)?).into_owned();
            if name.is_empty() || name.bytes().any(|b| b.is_ascii_uppercase()) {
                return Err(SpdyError::Protocol(format!("bad header name {name:?}")));
            }
            if pairs.iter().any(|(p, _)| *p == name) {
                return Err(SpdyError::Protocol(format!("duplicate header {name:?}")));
            }
            pairs.push((name, value));
        }
        if !r.is_empty() {
            return Err(SpdyError::Protocol(
                "bytes after the header block's pairs".into(),
            ));
        }
        Ok(Headers(pairs))
    }
}

/// Compresses the header blocks this side sends (one zlib stream per connection direction).
pub struct HeaderCompressor {
    z: Compress,
}

impl Default for HeaderCompressor {
    fn default() -> Self {
        Self::new()
    }
}

impl HeaderCompressor {
    pub fn new() -> HeaderCompressor {
        let mut z = Compress::new(Compression::default(), true);
        // Before the first deflate call: the zlib header then names the dictionary (FDICT).
        z.set_dictionary(dictionary())
            .expect("a fresh deflate stream accepts a dictionary");
        HeaderCompressor { z }
    }

    /// The compressed form of `headers`, ending with a sync flush.
    pub fn compress(&mut self, headers: &Headers) -> Result<Vec<u8>, SpdyError> {
        let input = headers.encode();
        let mut out = Vec::with_capacity(input.len() / 2 + 64);
        let mut pos = 0;
        loop {
            if out.capacity() - out.len() < 64 {
                out.reserve(out.capacity().max(256));
            }
            let before_in = self.z.total_in();
            self.z
                .compress_vec(&input[pos..], &mut out, FlushCompress::Sync)
                .map_err(|e| SpdyError::Compression(e.to_string()))?;
            pos += (self.z.total_in() - before_in) as usize;
            // The flush is complete when all input is taken and deflate left room unused.
            if pos == input.len() && out.len() < out.capacity() {
                return Ok(out);
            }
        }
    }
}

/// Decompresses the header blocks the peer sends.
pub struct HeaderDecompressor {
    z: Decompress,
}

impl Default for HeaderDecompressor {
    fn default() -> Self {
        Self::new()
    }
}

impl HeaderDecompressor {
    pub fn new() -> HeaderDecompressor {
        HeaderDecompressor {
            z: Decompress::new(true),
        }
    }

    /// Decompresses one block (the compressed bytes of one frame) and parses it.
    pub fn decompress(&mut self, compressed: &[u8]) -> Result<Headers, SpdyError> {
        let mut out: Vec<u8> = Vec::with_capacity((compressed.len() * 4 + 256).min(MAX_BLOCK + 1));
        let mut pos = 0;
        loop {
            if out.len() > MAX_BLOCK {
                return Err(SpdyError::Compression(format!(
                    "header block larger than {MAX_BLOCK} bytes"
                )));
            }
            if out.capacity() - out.len() < 256 {
                // Grown up to one byte past the cap: enough to tell that a block is over it.
                let room = (MAX_BLOCK + 1).saturating_sub(out.capacity());
                out.reserve_exact(out.capacity().max(256).min(room.max(256)));
            }
            let before_in = self.z.total_in();
            let before_out = out.len();
            let r = self
                .z
                .decompress_vec(&compressed[pos..], &mut out, FlushDecompress::Sync);
            pos += (self.z.total_in() - before_in) as usize;
            match r {
                Ok(Status::StreamEnd) => {
                    return Err(SpdyError::Compression(
                        "the peer ended its header zlib stream".into(),
                    ));
                }
                Ok(_) => {}
                Err(e) => match e.needs_dictionary() {
                    Some(_) => {
                        self.z
                            .set_dictionary(dictionary())
                            .map_err(|e| SpdyError::Compression(format!("dictionary: {e}")))?;
                        continue;
                    }
                    None => return Err(SpdyError::Compression(e.to_string())),
                },
            }
            let room_left = out.len() < out.capacity();
            if pos == compressed.len() && room_left {
                break;
            }
            if out.len() == before_out && self.z.total_in() == before_in && room_left {
                return Err(SpdyError::Compression(
                    "header block does not end with a complete flush".into(),
                ));
            }
        }
        Headers::decode(&out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adler32(data: &[u8]) -> u32 {
        let (mut a, mut b) = (1u32, 0u32);
        for &x in data {
            a = (a + x as u32) % 65521;
            b = (b + a) % 65521;
        }
        (b << 16) | a
    }

    #[test]
    fn dictionary_is_the_spdy3_one() {
        let d = dictionary();
        assert_eq!(d.len(), 1423);
        // The dictionary id every SPDY/3 implementation puts in its zlib header.
        assert_eq!(adler32(d), 0xe3c6_a7c2);
        assert_eq!(&d[..11], b"\0\0\0\x07options");
        assert!(d.ends_with(b"enq=0."));
    }

    #[test]
    fn header_blocks_round_trip_over_one_zlib_stream() {
        let mut c = HeaderCompressor::new();
        let mut d = HeaderDecompressor::new();
        let blocks = [
            Headers::new().with("streamType", "error"),
            Headers::new().with("streamtype", "stdout"),
            Headers::new(),
            Headers::new()
                .with("x-many", "a\0b")
                .with("content-type", "text/plain"),
        ];
        for (i, h) in blocks.iter().enumerate() {
            let z = c.compress(h).unwrap();
            if i == 0 {
                // zlib header with FDICT and the dictionary's id.
                assert_eq!(z[0] & 0x0f, 8);
                assert_ne!(z[1] & 0x20, 0, "FDICT set");
                assert_eq!(&z[2..6], &0xe3c6_a7c2u32.to_be_bytes());
            }
            // A sync flush ends with the empty stored block.
            assert!(z.ends_with(&[0, 0, 0xff, 0xff]), "{z:02x?}");
            assert_eq!(&d.decompress(&z).unwrap(), h);
        }
        assert_eq!(blocks[0].get("StreamType"), Some("error"));
        assert_eq!(blocks[3].get("x-many"), Some("a"));
    }

    #[test]
    fn blocks_depend_on_the_earlier_ones() {
        let mut c = HeaderCompressor::new();
        let h = Headers::new().with("streamtype", "stdout");
        let first = c.compress(&h).unwrap();
        let second = c.compress(&h).unwrap();
        // A fresh decompressor cannot read the second block alone: no zlib header.
        assert!(HeaderDecompressor::new().decompress(&second).is_err());
        let mut d = HeaderDecompressor::new();
        assert_eq!(d.decompress(&first).unwrap(), h);
        assert_eq!(d.decompress(&second).unwrap(), h);
    }

    #[test]
    fn interoperates_with_plain_zlib_using_the_dictionary() {
        // A block compressed by an independent zlib stream (as Go's zlib.NewWriterLevelDict does).
        let h = Headers::new().with("streamtype", "stdin");
        let mut z = Compress::new(Compression::best(), true);
        z.set_dictionary(dictionary()).unwrap();
        let mut out = Vec::with_capacity(1024);
        z.compress_vec(&h.encode(), &mut out, FlushCompress::Sync)
            .unwrap();
        assert_eq!(HeaderDecompressor::new().decompress(&out).unwrap(), h);
    }

    #[test]
    fn bad_blocks_are_errors() {
        assert!(Headers::decode(&[0, 0, 0, 1, 0, 0, 0, 9, b'a']).is_err());
        let upper = Headers(vec![("Upper".into(), "x".into())]).encode();
        assert!(Headers::decode(&upper).is_err());
        let dup = Headers(vec![("a".into(), "1".into()), ("a".into(), "2".into())]).encode();
        assert!(Headers::decode(&dup).is_err());
        assert!(
            HeaderDecompressor::new()
                .decompress(b"not zlib at all")
                .is_err()
        );
    }

    #[test]
    fn large_blocks_compress_and_bombs_are_refused() {
        // Up to the cap: a block of a 16,000-byte value (and its framing) is read.
        let big = "v".repeat(16_000);
        let h = Headers::new().with("big", &big);
        let mut c = HeaderCompressor::new();
        let z = c.compress(&h).unwrap();
        assert!(z.len() < 1_000);
        assert_eq!(HeaderDecompressor::new().decompress(&z).unwrap(), h);
        // Past it, a few hundred compressed bytes inflating to 17 KiB or to 2 MiB are refused.
        for n in [17 << 10, 2 << 20] {
            let bomb = Headers::new().with("big", &"v".repeat(n));
            let z = HeaderCompressor::new().compress(&bomb).unwrap();
            let err = HeaderDecompressor::new().decompress(&z).unwrap_err();
            assert!(err.to_string().contains("16384 bytes"), "{err}");
        }
    }
}

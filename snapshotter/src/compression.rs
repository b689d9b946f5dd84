//! Layer media types and streaming decompression.
//!
//! Invariant: decompression is always streaming. Bytes are decompressed as the caller's reader yields
//! them, so a layer is applied while it downloads. The media type must be one of the OCI or Docker layer
//! types; the actual codec is then taken from the stream's magic bytes, because registries do serve
//! layers whose media type does not match their bytes (a gzip type on an uncompressed tar).

use std::io::{self, BufReader, Read};

use crate::error::{Error, Result};

/// How a layer blob is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    /// The compression a layer media type declares. Accepts the OCI layer types (including the
    /// non-distributable ones) and Docker's schema 2 layer types.
    pub fn from_media_type(media_type: &str) -> Result<Self> {
        // Media type parameters (`; foo=bar`) do not change the codec.
        let mt = media_type.split(';').next().unwrap_or("").trim();
        Ok(match mt {
            "application/vnd.oci.image.layer.v1.tar"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar"
            | "application/vnd.docker.image.rootfs.diff.tar" => Compression::None,
            "application/vnd.oci.image.layer.v1.tar+gzip"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
            | "application/vnd.docker.image.rootfs.diff.tar.gzip"
            | "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip" => Compression::Gzip,
            "application/vnd.oci.image.layer.v1.tar+zstd"
            | "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd"
            | "application/vnd.docker.image.rootfs.diff.tar.zstd" => Compression::Zstd,
            _ => return Err(Error::UnsupportedMediaType(media_type.to_string())),
        })
    }

    fn sniff(prefix: &[u8]) -> Option<Self> {
        if prefix.starts_with(&[0x1f, 0x8b]) {
            Some(Compression::Gzip)
        } else if prefix.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            Some(Compression::Zstd)
        } else {
            None
        }
    }
}

/// Size of the buffer between the network stream and the decompressor.
const INPUT_BUFFER: usize = 256 * 1024;

/// Wraps `stream` in the decompressor its first bytes call for (falling back to `declared` when the
/// stream is too short to tell). Returns the codec actually used.
pub(crate) fn decompress<'a>(
    declared: Compression,
    mut stream: impl Read + Send + 'a,
) -> Result<(Compression, Box<dyn Read + Send + 'a>)> {
    // Read up to four bytes without losing them; a chunked source may hand them over one at a time.
    let mut magic = [0u8; 4];
    let mut have = 0;
    while have < magic.len() {
        match stream.read(&mut magic[have..]) {
            Ok(0) => break,
            Ok(n) => have += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::LayerStream { source: e }),
        }
    }
    let codec = Compression::sniff(&magic[..have]).unwrap_or(if have < 4 {
        declared
    } else {
        Compression::None
    });
    let joined = BufReader::with_capacity(
        INPUT_BUFFER,
        io::Cursor::new(magic[..have].to_vec()).chain(stream),
    );
    let reader: Box<dyn Read + Send + 'a> = match codec {
        Compression::None => Box::new(joined),
        // Multi-member gzip streams are valid layers (pigz and some builders write them).
        Compression::Gzip => Box::new(flate2::bufread::MultiGzDecoder::new(joined)),
        Compression::Zstd => Box::new(
            zstd::stream::read::Decoder::with_buffer(joined)
                .map_err(|e| Error::LayerStream { source: e })?,
        ),
    };
    Ok((codec, reader))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::ChunkReader;
    use std::io::Write;

    #[test]
    fn media_types() {
        use Compression::*;
        let cases = [
            ("application/vnd.oci.image.layer.v1.tar", None),
            ("application/vnd.oci.image.layer.v1.tar+gzip", Gzip),
            ("application/vnd.oci.image.layer.v1.tar+zstd", Zstd),
            ("application/vnd.docker.image.rootfs.diff.tar.gzip", Gzip),
            (
                "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
                Gzip,
            ),
        ];
        for (mt, want) in cases {
            assert_eq!(Compression::from_media_type(mt).unwrap(), want, "{mt}");
        }
        assert!(matches!(
            Compression::from_media_type("application/json"),
            Err(Error::UnsupportedMediaType(_))
        ));
    }

    fn roundtrip(declared: Compression, blob: &[u8]) -> (Compression, Vec<u8>) {
        // Feed the blob one byte per chunk to exercise the magic sniffing across reads.
        let mut chunks = blob.iter().map(|b| Ok(vec![*b]));
        let reader = ChunkReader::new(move || chunks.next());
        let (codec, mut r) = decompress(declared, reader).unwrap();
        let mut out = Vec::new();
        r.read_to_end(&mut out).unwrap();
        (codec, out)
    }

    #[test]
    fn sniffs_codecs() {
        let data = b"some tar bytes, not really".repeat(100);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&data).unwrap();
        let gz = gz.finish().unwrap();
        let zs = zstd::encode_all(&data[..], 1).unwrap();
        assert_eq!(
            roundtrip(Compression::Gzip, &gz),
            (Compression::Gzip, data.clone())
        );
        assert_eq!(
            roundtrip(Compression::Zstd, &zs),
            (Compression::Zstd, data.clone())
        );
        // Mislabelled: a gzip type on plain bytes still reads them plain.
        assert_eq!(
            roundtrip(Compression::Gzip, &data),
            (Compression::None, data.clone())
        );
        assert_eq!(
            roundtrip(Compression::None, b"ab"),
            (Compression::None, b"ab".to_vec())
        );
    }
}

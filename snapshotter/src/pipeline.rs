//! Runs a layer apply on three threads: one reads the compressed stream and decompresses it, one
//! hashes the uncompressed bytes (the diff_id check), and the caller's parses the tar and writes the
//! files. Decompression is the longest of the three for large files (zlib-rs inflates about 0.5
//! GB/s here); file creation is for many small ones. Keeping the hash off both lets the two cores of
//! a small node share the rest, whichever of them is the longer.
//!
//! Invariants: the hash covers every uncompressed byte (the applier drains the stream to its end,
//! and every chunk goes to the hasher before the applier); if the applier stops early, the
//! decompressing thread stops at its next chunk instead of reading the rest of the download; a
//! stream error wins over the applier's view of the same failure.

use std::io::{self, Read};
use std::sync::{Arc, mpsc};

use crate::compression::{Compression, decompress};
use crate::digest::StreamHash;
use crate::error::{Error, Result};
use crate::snapshotter::SpaceCheck;
use crate::stream::ChunkReader;

/// Bytes handed from the decompressing thread to the applier at a time.
const CHUNK: usize = 512 * 1024;
/// Chunks in flight from the decompressing thread to the applier.
const DEPTH: usize = 8;
/// Chunks in flight to the hasher: few, as a chunk it holds after the applier has written it is
/// memory the applier no longer needs (the hasher is the fastest of the three; a short queue only
/// makes the decompressing thread wait for it now and then).
const HASH_DEPTH: usize = 2;

/// A decompressed chunk, shared by the hasher and the applier.
#[derive(Clone)]
struct Chunk(Arc<Vec<u8>>);

impl AsRef<[u8]> for Chunk {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// Decompresses `stream` (declared `codec`) on a helper thread, hashes the result on another, and
/// feeds the tar bytes to `apply`, each chunk claimed from `space` as the applier takes it (and
/// settled when it takes the next: it has written the last one by then). Returns the
/// `sha256:<hex>` digest and size of the uncompressed stream.
pub(crate) fn decode_and_apply(
    codec: Compression,
    stream: &mut (dyn Read + Send),
    space: Option<&dyn SpaceCheck>,
    apply: impl FnOnce(&mut dyn Read) -> Result<()>,
) -> Result<(String, u64)> {
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::sync_channel::<io::Result<Chunk>>(DEPTH);
        let (hash_tx, hash_rx) = mpsc::sync_channel::<Chunk>(HASH_DEPTH);
        let hasher = scope.spawn(move || {
            let mut hash = StreamHash::default();
            for chunk in hash_rx {
                hash.update(chunk.as_ref());
            }
            hash.finish()
        });
        let producer = scope.spawn(move || -> Result<()> {
            let (_, mut decoded) = decompress(codec, stream)?;
            loop {
                let mut buf = vec![0u8; CHUNK];
                let mut filled = 0;
                while filled < CHUNK {
                    match decoded.read(&mut buf[filled..]) {
                        Ok(0) => break,
                        Ok(n) => filled += n,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => {
                            let _ = tx.send(Err(io::Error::new(e.kind(), e.to_string())));
                            return Err(Error::LayerStream { source: e });
                        }
                    }
                }
                if filled == 0 {
                    return Ok(());
                }
                buf.truncate(filled);
                let chunk = Chunk(Arc::new(buf));
                // The hasher never stops before the end of the stream.
                let _ = hash_tx.send(chunk.clone());
                if tx.send(Ok(chunk)).is_err() {
                    // The applier gave up; its error is the one to report.
                    return Ok(());
                }
            }
        });
        let mut claims = Claims { space, held: 0 };
        // Dropping the reader drops the receiver (the producer stops at its next chunk) and
        // settles the last claim.
        let mut reader = ChunkReader::new(move || {
            let chunk = rx.recv().ok()?;
            Some(chunk.and_then(|c| claims.next(c)))
        });
        let applied = apply(&mut reader);
        drop(reader);
        let panicked = |_| Error::io("layer decompression", io::Error::other("thread panicked"));
        let produced = producer.join().map_err(panicked)?;
        let digest = hasher.join().map_err(panicked)?;
        match (applied, produced) {
            (Err(e), _) if !matches!(e, Error::LayerStream { .. }) => Err(e),
            (_, Err(e)) => Err(e),
            (Err(e), Ok(())) => Err(e),
            (Ok(()), Ok(())) => Ok(digest),
        }
    })
}

/// The claim on the chunk the applier is writing, settled when it asks for the next one (or the
/// apply ends).
struct Claims<'a> {
    space: Option<&'a dyn SpaceCheck>,
    held: u64,
}

impl Claims<'_> {
    fn next(&mut self, chunk: Chunk) -> io::Result<Chunk> {
        let Some(space) = self.space else {
            return Ok(chunk);
        };
        let len = chunk.as_ref().len() as u64;
        space.settle(std::mem::take(&mut self.held));
        space.claim(len)?;
        self.held = len;
        Ok(chunk)
    }
}

impl Drop for Claims<'_> {
    fn drop(&mut self) {
        if let Some(space) = self.space {
            space.settle(self.held);
        }
    }
}

//! Runs a layer apply on two threads: one reads the compressed stream, decompresses it and hashes the
//! uncompressed bytes (the diff_id check); the other parses the tar and writes the files. With flate2
//! at ~380 MB/s and file creation costing about as much again, overlapping the two is where most of
//! the unpack speed comes from on a two-core machine.
//!
//! Invariants: the hash covers every uncompressed byte (the applier drains the stream to its end);
//! if the applier stops early, the decompressing thread stops at its next chunk instead of reading the
//! rest of the download; a stream error wins over the applier's view of the same failure.

use std::io::{self, Read};
use std::sync::mpsc;

use crate::compression::{Compression, decompress};
use crate::digest::HashingReader;
use crate::error::{Error, Result};
use crate::snapshotter::SpaceCheck;
use crate::stream::ChunkReader;

/// Bytes handed from the decompressing thread to the applier at a time.
const CHUNK: usize = 512 * 1024;
/// Chunks in flight between the two threads.
const DEPTH: usize = 8;

/// Decompresses `stream` (declared `codec`) on a helper thread and feeds the tar bytes to `apply`,
/// each chunk claimed from `space` as the applier takes it (and settled when it takes the next:
/// it has written the last one by then). Returns the `sha256:<hex>` digest and size of the
/// uncompressed stream.
pub(crate) fn decode_and_apply(
    codec: Compression,
    stream: &mut (dyn Read + Send),
    space: Option<&dyn SpaceCheck>,
    apply: impl FnOnce(&mut dyn Read) -> Result<()>,
) -> Result<(String, u64)> {
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::sync_channel::<io::Result<Vec<u8>>>(DEPTH);
        let producer = scope.spawn(move || -> Result<(String, u64)> {
            let (_, decoded) = decompress(codec, stream)?;
            let mut hashing = HashingReader::new(decoded);
            loop {
                let mut buf = vec![0u8; CHUNK];
                let mut filled = 0;
                while filled < CHUNK {
                    match hashing.read(&mut buf[filled..]) {
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
                    break;
                }
                buf.truncate(filled);
                if tx.send(Ok(buf)).is_err() {
                    // The applier gave up; its error is the one to report.
                    break;
                }
            }
            Ok(hashing.finish())
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
        let produced = producer
            .join()
            .map_err(|_| Error::io("layer decompression", io::Error::other("thread panicked")))?;
        match (applied, produced) {
            (Err(e), _) if !matches!(e, Error::LayerStream { .. }) => Err(e),
            (_, Err(e)) => Err(e),
            (Err(e), Ok(_)) => Err(e),
            (Ok(()), Ok(digest)) => Ok(digest),
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
    fn next(&mut self, chunk: Vec<u8>) -> io::Result<Vec<u8>> {
        let Some(space) = self.space else {
            return Ok(chunk);
        };
        space.settle(std::mem::take(&mut self.held));
        space.claim(chunk.len() as u64)?;
        self.held = chunk.len() as u64;
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

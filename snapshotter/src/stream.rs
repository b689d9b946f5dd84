//! Readers that let a download feed [`crate::Snapshotter::apply_layer`] while it is still running.
//!
//! - [`ChunkReader`]: chunks handed over in memory (a channel from the download task). Use it for the
//!   layer being applied right now.
//! - [`FollowReader`]: a blob file that the download is still appending to (the content store's ingest
//!   file). Use it for layers that download ahead of the apply, so their bytes go to disk instead of
//!   piling up in memory, and are decompressed as soon as the apply gets to them.

use std::fs::File;
use std::io::{self, Read};

/// A [`Read`] over chunks handed out one at a time by `next`, for example from a channel that a
/// download task fills: `ChunkReader::new(move || rx.blocking_recv())` with a tokio channel of
/// `io::Result<Bytes>`, or `move || rx.recv().ok()` with a std channel. `None` ends the stream; an `Err`
/// chunk fails the read (and so the apply) with that error.
pub struct ChunkReader<F, B> {
    next: F,
    current: Option<B>,
    pos: usize,
    done: bool,
}

impl<F, B> ChunkReader<F, B>
where
    F: FnMut() -> Option<io::Result<B>>,
    B: AsRef<[u8]>,
{
    pub fn new(next: F) -> Self {
        ChunkReader {
            next,
            current: None,
            pos: 0,
            done: false,
        }
    }
}

impl<F, B> Read for ChunkReader<F, B>
where
    F: FnMut() -> Option<io::Result<B>>,
    B: AsRef<[u8]>,
{
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            if let Some(chunk) = &self.current {
                let bytes = chunk.as_ref();
                if self.pos < bytes.len() {
                    let n = buf.len().min(bytes.len() - self.pos);
                    buf[..n].copy_from_slice(&bytes[self.pos..self.pos + n]);
                    self.pos += n;
                    return Ok(n);
                }
                self.current = None;
            }
            if self.done {
                return Ok(0);
            }
            match (self.next)() {
                None => self.done = true,
                Some(Err(e)) => {
                    self.done = true;
                    return Err(e);
                }
                Some(Ok(chunk)) => {
                    self.current = Some(chunk);
                    self.pos = 0;
                }
            }
        }
    }
}

/// What the writer of a followed file says about it.
#[derive(Debug)]
pub enum WriterStatus {
    /// More bytes may come; this many from the file's start are written and may be read (the
    /// rest of the file, if any, may still have holes).
    Writing(u64),
    /// The file is complete.
    Done,
    /// The download failed; the read fails with this error.
    Failed(io::Error),
}

/// A [`Read`] over a file another task is still writing, not necessarily in order: it reads only
/// the bytes the writer says are written; at their end it calls `status` with the bytes read so
/// far, which blocks until the writer has written past them (or a while has passed) and says how
/// far the file may be read now, or that it is complete. No polling: the writer's notification
/// wakes the reader.
pub struct FollowReader<F> {
    file: File,
    status: F,
    read: u64,
    /// Bytes from the file's start that may be read (`u64::MAX` once the file is complete).
    readable: u64,
}

impl<F: FnMut(u64) -> WriterStatus> FollowReader<F> {
    pub fn new(file: File, status: F) -> Self {
        FollowReader {
            file,
            status,
            read: 0,
            readable: 0,
        }
    }
}

impl<F: FnMut(u64) -> WriterStatus> Read for FollowReader<F> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        loop {
            if self.read < self.readable {
                let want = buf
                    .len()
                    .min((self.readable - self.read).min(1 << 30) as usize);
                let n = self.file.read(&mut buf[..want])?;
                if n == 0 && self.readable != u64::MAX {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!(
                            "followed file ends at {} bytes; its writer said {} were written",
                            self.read, self.readable
                        ),
                    ));
                }
                self.read += n as u64;
                return Ok(n);
            }
            match (self.status)(self.read) {
                WriterStatus::Writing(n) => self.readable = n,
                WriterStatus::Done => self.readable = u64::MAX,
                WriterStatus::Failed(e) => return Err(e),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    #[test]
    fn chunk_reader_passes_errors() {
        let mut items = vec![Ok(vec![1u8, 2]), Err(io::Error::other("net down"))].into_iter();
        let mut r = ChunkReader::new(move || items.next());
        let mut buf = Vec::new();
        let err = r.read_to_end(&mut buf).unwrap_err();
        assert_eq!(err.to_string(), "net down");
        assert_eq!(buf, vec![1, 2]);
    }

    #[test]
    fn follow_reader_waits_for_the_writer() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("blob");
        let mut w = File::create(&path).unwrap();
        let done = Arc::new(AtomicBool::new(false));
        let written = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (d, wr) = (done.clone(), written.clone());
        let writer = std::thread::spawn(move || {
            for i in 0..50u8 {
                w.write_all(&[i; 1000]).unwrap();
                wr.fetch_add(1000, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(1));
            }
            d.store(true, Ordering::SeqCst);
        });
        let mut positions = Vec::new();
        let mut r = FollowReader::new(File::open(&path).unwrap(), |read| {
            positions.push(read);
            // The writer's side: wait until it wrote past `read` or is done.
            while written.load(Ordering::SeqCst) <= read && !done.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_micros(200));
            }
            if done.load(Ordering::SeqCst) {
                WriterStatus::Done
            } else {
                WriterStatus::Writing(written.load(Ordering::SeqCst))
            }
        });
        let mut out = Vec::new();
        r.read_to_end(&mut out).unwrap();
        drop(r);
        writer.join().unwrap();
        assert_eq!(out.len(), 50_000);
        assert_eq!(out[49_999], 49);
        // Asked only at the end of what was read, with that position.
        assert!(!positions.is_empty());
        assert!(positions.windows(2).all(|w| w[0] <= w[1]), "{positions:?}");
        assert!(positions.iter().all(|&p| p <= 50_000));
    }

    #[test]
    fn follow_reader_reads_only_what_the_writer_says_is_written() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("blob");
        let f = File::create(&path).unwrap();
        // The second half lands first (a ranged piece); the first half's end is a hole yet.
        f.write_all_at(&[2u8; 1000], 2000).unwrap();
        f.write_all_at(&[1u8; 1000], 0).unwrap();
        let mut calls = Vec::new();
        let mut r = FollowReader::new(File::open(&path).unwrap(), |read| {
            calls.push(read);
            match read {
                0 => WriterStatus::Writing(1000),
                1000 => {
                    f.write_all_at(&[3u8; 1000], 1000).unwrap();
                    WriterStatus::Writing(3000)
                }
                _ => WriterStatus::Done,
            }
        });
        let mut out = Vec::new();
        r.read_to_end(&mut out).unwrap();
        drop(r);
        let mut want = vec![1u8; 1000];
        want.extend([3u8; 1000]);
        want.extend([2u8; 1000]);
        assert_eq!(out, want, "no byte of the hole was read");
        assert_eq!(calls, vec![0, 1000, 3000]);
    }

    #[test]
    fn follow_reader_fails_when_the_file_is_shorter_than_said() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("blob");
        std::fs::write(&path, [0u8; 10]).unwrap();
        let mut r = FollowReader::new(File::open(&path).unwrap(), |_| WriterStatus::Writing(20));
        let err = r.read_to_end(&mut Vec::new()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "{err}");
    }
}

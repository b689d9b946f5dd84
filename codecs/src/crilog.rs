//! The CRI container log line format: formatting, splitting output into entries, parsing.
//!
//! Owns the on-disk line format the kubelet reads (`kuberuntime` log parser, CRI
//! "container logs" design): one entry per line,
//!
//! ```text
//! 2026-11-21T10:49:26.123456789Z stdout F hello world
//! ```
//!
//! - the timestamp is RFC 3339 in UTC with nanoseconds, always nine fraction digits (still valid
//!   RFC3339Nano for Go's parser, and lines sort lexically);
//! - the stream tag is `stdout` or `stderr`;
//! - the tag is `F` for the final (or only) piece of a line and `P` for a partial piece: an output
//!   line longer than the limit ([`DEFAULT_MAX_LINE`], 16 KiB as the kubelet's other runtimes use) is
//!   cut into `P` pieces followed by one `F` piece; the reader joins them;
//! - the content is the bytes of the line without its `\n`; output that ends without a newline is
//!   written as an `F` piece when the stream ends.
//!
//! Sans I/O: the log files themselves (opening beneath the pod's log directory, one `write(2)`
//! per entry, reopening after rotation) are the runtime's (`runtime/src/logs.rs`).

use chrono::{DateTime, Utc};

/// Longest piece of one output line written as one entry.
pub const DEFAULT_MAX_LINE: usize = 16 * 1024;

/// The output stream an entry came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    pub fn as_str(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// `2026-11-21T10:49:26.123456789Z`: RFC 3339, UTC, nanoseconds.
pub fn rfc3339_nano(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%dT%H:%M:%S%.9fZ").to_string()
}

/// Appends one CRI log entry (with its trailing `\n`) to `out`.
pub fn format_entry(
    out: &mut Vec<u8>,
    t: DateTime<Utc>,
    stream: Stream,
    partial: bool,
    content: &[u8],
) {
    out.extend_from_slice(rfc3339_nano(t).as_bytes());
    out.push(b' ');
    out.extend_from_slice(stream.as_str().as_bytes());
    out.extend_from_slice(if partial { b" P " } else { b" F " });
    out.extend_from_slice(content);
    out.push(b'\n');
}

/// Cuts a byte stream into log pieces: complete lines (final) and, for lines longer than `max`,
/// partial pieces of exactly `max` bytes.
#[derive(Debug)]
pub struct LineSplitter {
    buf: Vec<u8>,
    max: usize,
}

impl LineSplitter {
    pub fn new(max: usize) -> Self {
        assert!(max > 0, "line limit must be positive");
        LineSplitter {
            buf: Vec::new(),
            max,
        }
    }

    /// Feeds bytes read from the stream; `emit(content, partial)` is called for every piece that
    /// is complete. Bytes of an unfinished short line stay buffered.
    pub fn feed(&mut self, mut data: &[u8], emit: &mut dyn FnMut(&[u8], bool)) {
        while !data.is_empty() {
            if self.buf.len() == self.max {
                // A full piece is held back until the next byte tells whether the line ends
                // right after it (then it is the final piece) or goes on (then it is partial).
                let ends = data[0] == b'\n';
                emit(&self.buf, !ends);
                self.buf.clear();
                if ends {
                    data = &data[1..];
                    continue;
                }
            }
            let room = self.max - self.buf.len();
            let window = &data[..data.len().min(room)];
            match window.iter().position(|&b| b == b'\n') {
                Some(nl) => {
                    if self.buf.is_empty() {
                        emit(&window[..nl], false);
                    } else {
                        self.buf.extend_from_slice(&window[..nl]);
                        emit(&self.buf, false);
                        self.buf.clear();
                    }
                    data = &data[nl + 1..];
                }
                None => {
                    self.buf.extend_from_slice(window);
                    data = &data[window.len()..];
                }
            }
        }
    }

    /// The stream ended: what is left is the last line, written as final.
    pub fn finish(&mut self, emit: &mut dyn FnMut(&[u8], bool)) {
        if !self.buf.is_empty() {
            emit(&self.buf, false);
            self.buf.clear();
        }
    }
}

/// One parsed log entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogEntry {
    pub timestamp: DateTime<Utc>,
    pub stream: Stream,
    pub partial: bool,
    pub content: Vec<u8>,
}

/// Parses one entry (without or with its trailing `\n`).
pub fn parse_entry(line: &[u8]) -> Result<LogEntry, String> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let mut parts = line.splitn(4, |&b| b == b' ');
    let (Some(ts), Some(stream), Some(tag)) = (parts.next(), parts.next(), parts.next()) else {
        return Err("too few fields".into());
    };
    let content = parts.next().unwrap_or_default().to_vec();
    let ts = std::str::from_utf8(ts).map_err(|e| e.to_string())?;
    let timestamp = DateTime::parse_from_rfc3339(ts)
        .map_err(|e| format!("timestamp {ts:?}: {e}"))?
        .with_timezone(&Utc);
    let stream = match stream {
        b"stdout" => Stream::Stdout,
        b"stderr" => Stream::Stderr,
        other => return Err(format!("stream {:?}", String::from_utf8_lossy(other))),
    };
    let partial = match tag {
        b"P" => true,
        b"F" => false,
        other => return Err(format!("tag {:?}", String::from_utf8_lossy(other))),
    };
    Ok(LogEntry {
        timestamp,
        stream,
        partial,
        content,
    })
}

/// Parses a whole log and joins partial pieces, per stream, into lines.
pub fn reassemble(log: &[u8]) -> Result<Vec<(Stream, Vec<u8>)>, String> {
    let mut lines = Vec::new();
    let mut pending: Vec<(Stream, Vec<u8>)> = Vec::new();
    for raw in log.split_inclusive(|&b| b == b'\n') {
        let e = parse_entry(raw)?;
        let slot = match pending.iter().position(|(s, _)| *s == e.stream) {
            Some(i) => i,
            None => {
                pending.push((e.stream, Vec::new()));
                pending.len() - 1
            }
        };
        pending[slot].1.extend_from_slice(&e.content);
        if !e.partial {
            lines.push(pending.remove(slot));
        }
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(max: usize, chunks: &[&[u8]]) -> Vec<(Vec<u8>, bool)> {
        let mut s = LineSplitter::new(max);
        let mut out = Vec::new();
        let mut emit = |c: &[u8], p: bool| out.push((c.to_vec(), p));
        for c in chunks {
            s.feed(c, &mut emit);
        }
        s.finish(&mut emit);
        out
    }

    #[test]
    fn timestamp_is_rfc3339_nano_utc() {
        let t = DateTime::parse_from_rfc3339("2026-01-02T03:04:05.000000007+02:00").unwrap();
        assert_eq!(
            rfc3339_nano(t.with_timezone(&Utc)),
            "2026-01-02T01:04:05.000000007Z"
        );
        let t = DateTime::parse_from_rfc3339("2026-01-02T03:04:05Z").unwrap();
        assert_eq!(
            rfc3339_nano(t.with_timezone(&Utc)),
            "2026-01-02T03:04:05.000000000Z"
        );
    }

    #[test]
    fn entry_format_and_parse_round_trip() {
        let t = Utc::now();
        let mut out = Vec::new();
        format_entry(&mut out, t, Stream::Stderr, true, b"a b  c");
        let s = String::from_utf8(out.clone()).unwrap();
        assert!(s.ends_with(" stderr P a b  c\n"), "{s}");
        let e = parse_entry(&out).unwrap();
        assert_eq!(
            e,
            LogEntry {
                timestamp: t,
                stream: Stream::Stderr,
                partial: true,
                content: b"a b  c".to_vec()
            }
        );
        let mut out = Vec::new();
        format_entry(&mut out, t, Stream::Stdout, false, b"");
        assert_eq!(parse_entry(&out).unwrap().content, b"");
        assert!(parse_entry(b"2026-01-02T03:04:05Z stdin F x").is_err());
        assert!(parse_entry(b"yesterday stdout F x").is_err());
    }

    #[test]
    fn lines_across_chunks() {
        let out = split(16, &[b"hel", b"lo\nwor", b"ld\n\nend"]);
        let want: Vec<(Vec<u8>, bool)> = vec![
            (b"hello".to_vec(), false),
            (b"world".to_vec(), false),
            (b"".to_vec(), false),
            (b"end".to_vec(), false),
        ];
        assert_eq!(out, want);
    }

    #[test]
    fn long_lines_become_partials() {
        let out = split(4, &[b"abcdefghij\nxy\nabcd\n"]);
        let want: Vec<(Vec<u8>, bool)> = vec![
            (b"abcd".to_vec(), true),
            (b"efgh".to_vec(), true),
            (b"ij".to_vec(), false),
            (b"xy".to_vec(), false),
            (b"abcd".to_vec(), false),
        ];
        assert_eq!(out, want);
    }

    #[test]
    fn one_mebibyte_line_splits_and_reassembles() {
        let line: Vec<u8> = (0..1024 * 1024).map(|i| b'a' + (i % 26) as u8).collect();
        let mut input = line.clone();
        input.push(b'\n');
        input.extend_from_slice(b"after\n");
        let mut log = Vec::new();
        let mut s = LineSplitter::new(DEFAULT_MAX_LINE);
        let mut pieces = 0;
        let mut emit = |c: &[u8], p: bool| {
            assert!(c.len() <= DEFAULT_MAX_LINE);
            pieces += 1;
            format_entry(&mut log, Utc::now(), Stream::Stdout, p, c);
        };
        for chunk in input.chunks(4096 + 7) {
            s.feed(chunk, &mut emit);
        }
        s.finish(&mut emit);
        // 63 partial pieces, the 64th final (the newline follows it), then "after".
        assert_eq!(pieces, 64 + 1);
        let lines = reassemble(&log).unwrap();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0], (Stream::Stdout, line));
        assert_eq!(lines[1], (Stream::Stdout, b"after".to_vec()));
    }

    #[test]
    fn reassembly_keeps_streams_apart() {
        let t = Utc::now();
        let mut log = Vec::new();
        format_entry(&mut log, t, Stream::Stdout, true, b"out-");
        format_entry(&mut log, t, Stream::Stderr, false, b"err");
        format_entry(&mut log, t, Stream::Stdout, false, b"line");
        let lines = reassemble(&log).unwrap();
        assert_eq!(
            lines,
            vec![
                (Stream::Stderr, b"err".to_vec()),
                (Stream::Stdout, b"out-line".to_vec())
            ]
        );
    }
}

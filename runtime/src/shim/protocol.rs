//! What the shim and the daemon exchange: the readiness report, the control socket requests and
//! responses, and the exit file. All are JSON; socket messages are one JSON object per line.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Files of one container's bundle directory (see the layout in [`crate::shim`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShimPaths {
    pub bundle: PathBuf,
}

impl ShimPaths {
    pub fn new(bundle: impl Into<PathBuf>) -> Self {
        ShimPaths {
            bundle: bundle.into(),
        }
    }
    /// The OCI spec, written by the daemon before the shim starts.
    pub fn config(&self) -> PathBuf {
        self.bundle.join("config.json")
    }
    /// The container's init pid, written by the OCI runtime (`--pid-file`).
    pub fn init_pid(&self) -> PathBuf {
        self.bundle.join("init.pid")
    }
    /// The shim's own pid.
    pub fn shim_pid(&self) -> PathBuf {
        self.bundle.join("shim.pid")
    }
    /// The exit status, written once by the shim ([`ExitRecord`]).
    pub fn exit_file(&self) -> PathBuf {
        self.bundle.join("exit.json")
    }
    /// The control socket.
    pub fn socket(&self) -> PathBuf {
        self.bundle.join("shim.sock")
    }
    /// The shim's own diagnostics (its stderr).
    pub fn shim_log(&self) -> PathBuf {
        self.bundle.join("shim.log")
    }
    /// The OCI runtime's JSON log of `create`.
    pub fn runtime_log(&self) -> PathBuf {
        self.bundle.join("runtime-log.json")
    }
    /// Where the runtime sends a tty container's pty master (`--console-socket`; removed once
    /// received). Shorter than [`ShimPaths::socket`], so it fits wherever that does.
    pub fn console_socket(&self) -> PathBuf {
        self.bundle.join("pty.sock")
    }
}

/// How the container's init ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitRecord {
    pub pid: i32,
    /// The exit code, or 128 + signal number when a signal killed it (the CRI convention).
    pub exit_code: i32,
    /// The signal that killed it, if one did.
    pub signal: Option<i32>,
    /// RFC 3339 with nanoseconds, UTC.
    pub exited_at: String,
    /// The same instant in nanoseconds since the epoch (CRI `finished_at`).
    pub exited_at_ns: i64,
    /// The OOM killer struck in the container's cgroup while it ran (cgroup v2, seen by the
    /// shim's [`super::oom::OomWatch`]; absent in records of older shims).
    #[serde(default)]
    pub oom_killed: bool,
}

/// The one line the shim writes on its readiness pipe, then closes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ready {
    pub ok: bool,
    #[serde(default)]
    pub shim_pid: i32,
    /// The container's init pid (created, waiting for `start`).
    #[serde(default)]
    pub init_pid: i32,
    #[serde(default)]
    pub error: Option<String>,
}

/// A control socket request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Answered at once with [`Response::State`].
    State,
    /// Reopen the log file at its path (CRI `ReopenContainerLog`); answered with `Ok`.
    ReopenLog,
    /// Answered with [`Response::Exited`] once the init has exited and its output is written.
    Wait,
    /// CRI `Attach`: answered with [`Response::Attached`] (or `Error`), after which the
    /// connection carries [`Frame`]s both ways: the container's output as the shim reads it
    /// (the streams asked for), and stdin from the daemon. The daemon half-closing its side
    /// detaches; the shim closes the connection when the container's output has ended.
    Attach {
        stdin: bool,
        stdout: bool,
        stderr: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Response {
    Ok,
    State {
        shim_pid: i32,
        init_pid: i32,
        exited: Option<ExitRecord>,
    },
    Exited {
        exit: ExitRecord,
    },
    /// The attach session has started; frames follow.
    Attached,
    Error {
        message: String,
    },
}

/// The kind of an attach [`Frame`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// Daemon to shim: bytes for the container's stdin.
    Stdin = 0,
    /// Shim to daemon: the container's stdout.
    Stdout = 1,
    /// Shim to daemon: the container's stderr.
    Stderr = 2,
    /// Daemon to shim: the client closed its stdin (with `stdin_once`, the container's stdin
    /// is closed; otherwise it stays open for the next session).
    CloseStdin = 3,
    /// Daemon to shim: the client's terminal size, `[width u16 BE][height u16 BE]`
    /// ([`Frame::resize`]); applied to a tty container's terminal, ignored otherwise.
    Resize = 4,
}

impl FrameKind {
    fn from_u8(b: u8) -> Option<FrameKind> {
        Some(match b {
            0 => FrameKind::Stdin,
            1 => FrameKind::Stdout,
            2 => FrameKind::Stderr,
            3 => FrameKind::CloseStdin,
            4 => FrameKind::Resize,
            _ => return None,
        })
    }
}

/// The largest frame payload accepted (the shim reads at most 64 KiB at a time).
pub const MAX_FRAME: usize = 1 << 20;

/// One attach frame: `[kind: u8][length: u32 big-endian][payload]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: FrameKind,
    pub data: Vec<u8>,
}

impl Frame {
    pub fn new(kind: FrameKind, data: impl Into<Vec<u8>>) -> Frame {
        Frame {
            kind,
            data: data.into(),
        }
    }

    /// A [`FrameKind::Resize`] frame.
    pub fn resize(width: u16, height: u16) -> Frame {
        let mut data = width.to_be_bytes().to_vec();
        data.extend_from_slice(&height.to_be_bytes());
        Frame::new(FrameKind::Resize, data)
    }

    /// The (width, height) of a [`FrameKind::Resize`] frame; `None` for anything else.
    pub fn size(&self) -> Option<(u16, u16)> {
        match (self.kind, self.data.as_slice()) {
            (FrameKind::Resize, [w0, w1, h0, h1]) => Some((
                u16::from_be_bytes([*w0, *w1]),
                u16::from_be_bytes([*h0, *h1]),
            )),
            _ => None,
        }
    }

    /// The frame's bytes on the wire.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(5 + self.data.len());
        v.push(self.kind as u8);
        v.extend_from_slice(&(self.data.len() as u32).to_be_bytes());
        v.extend_from_slice(&self.data);
        v
    }
}

/// Splits a byte stream into [`Frame`]s, whatever the read boundaries (no I/O of its own, so
/// the shim's threads and the daemon's tasks share it). Frames are taken from a cursor and the
/// consumed bytes dropped once per [`FrameDecoder::feed`], so many small frames in one read cost
/// time linear in the read.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    /// Where the next frame starts in `buf`.
    start: usize,
}

impl FrameDecoder {
    /// Adds bytes read from the connection.
    pub fn feed(&mut self, bytes: &[u8]) {
        self.buf.drain(..self.start);
        self.start = 0;
        self.buf.extend_from_slice(bytes);
    }

    /// The next complete frame, `Ok(None)` when more bytes are needed; an error for an unknown
    /// kind or an oversized frame (the connection is then unusable).
    pub fn next_frame(&mut self) -> std::io::Result<Option<Frame>> {
        let buf = &self.buf[self.start..];
        if buf.len() < 5 {
            return Ok(None);
        }
        let kind = FrameKind::from_u8(buf[0]).ok_or_else(|| {
            std::io::Error::other(format!("unknown attach frame kind {}", buf[0]))
        })?;
        let len = u32::from_be_bytes(buf[1..5].try_into().expect("4 bytes")) as usize;
        if len > MAX_FRAME {
            return Err(std::io::Error::other(format!(
                "attach frame of {len} bytes (at most {MAX_FRAME})"
            )));
        }
        if buf.len() < 5 + len {
            return Ok(None);
        }
        let data = buf[5..5 + len].to_vec();
        self.start += 5 + len;
        Ok(Some(Frame { kind, data }))
    }

    /// Bytes received that do not make a whole frame yet.
    pub fn pending(&self) -> usize {
        self.buf.len() - self.start
    }
}

/// Reads the exit file; `Ok(None)` when it is not there (yet).
pub fn read_exit_file(path: &Path) -> std::io::Result<Option<ExitRecord>> {
    match std::fs::read(path) {
        Ok(b) => serde_json::from_slice(&b)
            .map(Some)
            .map_err(std::io::Error::other),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_format() {
        assert_eq!(
            serde_json::to_string(&Request::ReopenLog).unwrap(),
            r#"{"op":"reopen_log"}"#
        );
        let r: Request = serde_json::from_str(r#"{"op":"wait"}"#).unwrap();
        assert_eq!(r, Request::Wait);
        let exit = ExitRecord {
            pid: 7,
            exit_code: 137,
            signal: Some(9),
            exited_at: "t".into(),
            exited_at_ns: 1,
            oom_killed: false,
        };
        let s = serde_json::to_string(&Response::Exited { exit: exit.clone() }).unwrap();
        assert!(
            s.starts_with(r#"{"status":"exited","exit":{"pid":7"#),
            "{s}"
        );
        assert_eq!(
            serde_json::from_str::<Response>(&s).unwrap(),
            Response::Exited { exit }
        );
    }

    #[test]
    fn attach_request_and_answer() {
        let r = Request::Attach {
            stdin: true,
            stdout: true,
            stderr: false,
        };
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(
            s,
            r#"{"op":"attach","stdin":true,"stdout":true,"stderr":false}"#
        );
        assert_eq!(serde_json::from_str::<Request>(&s).unwrap(), r);
        assert_eq!(
            serde_json::to_string(&Response::Attached).unwrap(),
            r#"{"status":"attached"}"#
        );
        assert!(serde_json::from_str::<Request>(r#"{"op":"attach"}"#).is_err());
    }

    #[test]
    fn frames_survive_any_split() {
        let frames = vec![
            Frame::new(FrameKind::Stdout, b"hello\n".to_vec()),
            Frame::new(FrameKind::Stderr, Vec::new()),
            Frame::new(FrameKind::Stdin, vec![0u8; 70_000]),
            Frame::new(FrameKind::CloseStdin, Vec::new()),
            Frame::resize(80, 24),
        ];
        let wire: Vec<u8> = frames.iter().flat_map(|f| f.encode()).collect();
        assert_eq!(&wire[..5], &[1, 0, 0, 0, 6]);
        for step in [1, 2, 5, 7, 4096, wire.len()] {
            let mut d = FrameDecoder::default();
            let mut got = Vec::new();
            for chunk in wire.chunks(step) {
                d.feed(chunk);
                while let Some(f) = d.next_frame().unwrap() {
                    got.push(f);
                }
            }
            assert_eq!(got, frames, "chunks of {step}");
            assert_eq!(d.pending(), 0);
        }
    }

    #[test]
    fn bad_frames_are_errors() {
        let mut d = FrameDecoder::default();
        d.feed(&[9, 0, 0, 0, 0]);
        assert!(d.next_frame().is_err());
        let mut d = FrameDecoder::default();
        d.feed(&[1]);
        d.feed(&((MAX_FRAME + 1) as u32).to_be_bytes());
        assert!(d.next_frame().is_err());
        let mut d = FrameDecoder::default();
        d.feed(&[2, 0, 0]);
        assert_eq!(d.next_frame().unwrap(), None);
    }

    /// Many small frames in one read are decoded in time linear in the read (each used to
    /// shift the rest of the buffer).
    #[test]
    fn many_small_frames_in_one_read_decode_in_linear_time() {
        let one = Frame::new(FrameKind::Stdout, vec![7]).encode();
        let mut d = FrameDecoder::default();
        let start = std::time::Instant::now();
        d.feed(&one.repeat(200_000));
        d.feed(&one[..3]);
        let mut n = 0;
        while let Some(f) = d.next_frame().unwrap() {
            assert_eq!(f.data, [7]);
            n += 1;
        }
        assert_eq!((n, d.pending()), (200_000, 3));
        assert!(
            start.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
        d.feed(&one[3..]);
        assert_eq!(d.next_frame().unwrap().unwrap().data, [7]);
        assert_eq!(d.pending(), 0);
    }

    #[test]
    fn resize_frames_carry_width_and_height() {
        let f = Frame::resize(300, 2);
        assert_eq!(f.encode(), [4, 0, 0, 0, 4, 1, 44, 0, 2]);
        assert_eq!(f.size(), Some((300, 2)));
        assert_eq!(Frame::new(FrameKind::Resize, vec![1, 2, 3]).size(), None);
        assert_eq!(Frame::new(FrameKind::Stdin, vec![0, 1, 0, 1]).size(), None);
    }

    #[test]
    fn exit_file_round_trip() {
        let d = tempfile::tempdir().unwrap();
        let p = ShimPaths::new(d.path());
        assert_eq!(read_exit_file(&p.exit_file()).unwrap(), None);
        let e = ExitRecord {
            pid: 1,
            exit_code: 3,
            signal: None,
            exited_at: "x".into(),
            exited_at_ns: 2,
            oom_killed: false,
        };
        minicri_snapshotter::write_atomic(&p.exit_file(), &serde_json::to_vec(&e).unwrap(), 0o600)
            .unwrap();
        assert_eq!(read_exit_file(&p.exit_file()).unwrap(), Some(e));
    }
}

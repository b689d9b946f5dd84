//! The shim's attach sessions (CRI `Attach`) and the container's input: who gets the output the
//! pumps read, where session input goes, and the container's terminal size.
//!
//! [`Attachments`] is shared by the output pumps ([`Attachments::publish`]), the control socket's
//! `attach` connections ([`serve_session`]) and the shim's main thread. The container's input is
//! a stdin pipe (with `--stdin`) or, for a tty container, the pty master (with `--stdin`, input
//! is written to it; with or without, resizes apply to it). A terminal has no half-close: the
//! end of a `stdin_once` session's input is sent as the EOF character (^D), as exec does.

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use super::protocol::{Frame, FrameDecoder, FrameKind, Response};
use crate::logs::Stream;

/// Queued output frames per attach session; a session further behind is cut off, so a slow
/// client never holds up the container or its log.
pub(super) const ATTACH_QUEUE: usize = 1024;
/// Queued output bytes per attach session, the other bound: chunks are up to 64 KiB, so the
/// frame count alone let a session that stopped reading hold 64 MiB of the shim's memory.
pub(super) const ATTACH_QUEUE_BYTES: usize = 1 << 20;

/// The EOF character of a terminal in canonical mode (^D).
const VEOF: u8 = 0x04;

/// One attach session's share of the output.
struct Subscriber {
    id: u64,
    stdout: bool,
    stderr: bool,
    tx: std::sync::mpsc::SyncSender<Frame>,
    /// Bytes in `tx` not yet taken by the session's writer.
    queued: Arc<AtomicUsize>,
}

/// The attach sessions and the container's input.
#[derive(Default)]
pub(super) struct Attachments {
    subscribers: Mutex<Vec<Subscriber>>,
    next_id: AtomicU64,
    /// Output pumps still running; at 0 the output has ended and sessions are closed.
    pub(super) open_outputs: Mutex<usize>,
    /// Sessions still writing to their connection (the shim lets them finish before leaving).
    pub(super) active: Mutex<usize>,
    /// Where session input goes (with `--stdin`): the stdin pipe's write end, or the pty master
    /// of a tty container; `None` once closed.
    pub(super) stdin: Mutex<Option<std::fs::File>>,
    /// Whether the container was created with stdin (`--stdin`).
    pub(super) has_stdin: bool,
    pub(super) stdin_once: bool,
    /// The pty master of a tty container (for resizes), once the runtime has sent it.
    pub(super) terminal: Mutex<Option<OwnedFd>>,
}

impl Attachments {
    /// No session yet, `outputs` output pumps to come; the input is set once it exists.
    pub(super) fn new(outputs: usize, has_stdin: bool, stdin_once: bool) -> Attachments {
        Attachments {
            open_outputs: Mutex::new(outputs),
            has_stdin,
            stdin_once,
            ..Default::default()
        }
    }

    /// Hands `data` read from `stream` to every session that asked for it.
    pub(super) fn publish(&self, stream: Stream, data: &[u8]) {
        let mut subs = self.subscribers.lock().unwrap();
        if subs.is_empty() {
            return;
        }
        let kind = match stream {
            Stream::Stdout => FrameKind::Stdout,
            Stream::Stderr => FrameKind::Stderr,
        };
        subs.retain(|s| {
            let wanted = match kind {
                FrameKind::Stdout => s.stdout,
                _ => s.stderr,
            };
            if !wanted {
                return true;
            }
            if s.queued.load(Ordering::Relaxed) + data.len() > ATTACH_QUEUE_BYTES {
                note!(
                    "minicri shim: attach session {} is {ATTACH_QUEUE_BYTES} bytes behind: cut off",
                    s.id
                );
                return false;
            }
            match s.tx.try_send(Frame::new(kind, data)) {
                Ok(()) => {
                    s.queued.fetch_add(data.len(), Ordering::Relaxed);
                    true
                }
                Err(std::sync::mpsc::TrySendError::Full(_)) => {
                    note!(
                        "minicri shim: attach session {} is {ATTACH_QUEUE} chunks behind: cut off",
                        s.id
                    );
                    false
                }
                Err(std::sync::mpsc::TrySendError::Disconnected(_)) => false,
            }
        });
    }

    /// One output pump reached EOF; after the last one, every session is told the end.
    pub(super) fn output_closed(&self) {
        let mut open = self.open_outputs.lock().unwrap();
        *open = open.saturating_sub(1);
        if *open == 0 {
            self.subscribers.lock().unwrap().clear();
        }
    }

    fn unsubscribe(&self, id: u64) {
        self.subscribers.lock().unwrap().retain(|s| s.id != id);
    }

    fn write_stdin(&self, data: &[u8]) {
        let mut stdin = self.stdin.lock().unwrap();
        if let Some(f) = stdin.as_mut()
            && let Err(e) = f.write_all(data)
        {
            note!("minicri shim: write to the container's stdin: {e}");
            *stdin = None;
        }
    }

    /// The end of a session's stdin: with `stdin_once` the container's stdin is closed (a
    /// terminal gets ^D first: closing the master would hang the terminal up).
    fn stdin_done(&self) {
        if !self.stdin_once {
            return;
        }
        let terminal = self.terminal.lock().unwrap().is_some();
        let mut stdin = self.stdin.lock().unwrap();
        if terminal && let Some(f) = stdin.as_mut() {
            let _ = f.write_all(&[VEOF]);
        }
        stdin.take();
    }

    /// Sets the terminal's size (a tty container's); the kernel signals SIGWINCH to its
    /// foreground process group. Ignored without a terminal.
    fn resize(&self, width: u16, height: u16) {
        if let Some(master) = self.terminal.lock().unwrap().as_ref()
            && let Err(e) = crate::stream::pty::resize(master, width, height)
        {
            note!("minicri shim: resize the terminal: {e}");
        }
    }
}

/// Serves one attach session on `conn` (see [`super::Request::Attach`]): this thread copies the
/// subscribed output to the connection, a second one reads the daemon's frames (stdin,
/// resizes).
pub(super) fn serve_session(
    conn: UnixStream,
    a: Arc<Attachments>,
    stdin: bool,
    stdout: bool,
    stderr: bool,
) -> std::io::Result<()> {
    let refuse = |message: String| {
        let mut out = serde_json::to_vec(&Response::Error { message })?;
        out.push(b'\n');
        (&conn).write_all(&out)
    };
    if stdin && !a.has_stdin {
        return refuse("the container was not created with stdin".into());
    }
    let (tx, rx) = std::sync::mpsc::sync_channel(ATTACH_QUEUE);
    let queued = Arc::new(AtomicUsize::new(0));
    let id = a.next_id.fetch_add(1, Ordering::Relaxed);
    {
        // Subscribe under the pumps' counter, so the end of the output cannot slip by.
        let open = a.open_outputs.lock().unwrap();
        if *open == 0 {
            drop(open);
            return refuse("the container's output has ended (it exited)".into());
        }
        a.subscribers.lock().unwrap().push(Subscriber {
            id,
            stdout,
            stderr,
            tx,
            queued: queued.clone(),
        });
    }
    *a.active.lock().unwrap() += 1;
    let result = (|| {
        let mut out = serde_json::to_vec(&Response::Attached).map_err(std::io::Error::other)?;
        out.push(b'\n');
        (&conn).write_all(&out)?;
        let reader = conn.try_clone()?;
        let ra = a.clone();
        std::thread::spawn(move || read_input(reader, &ra, id, stdin));
        for frame in rx {
            queued.fetch_sub(frame.data.len(), Ordering::Relaxed);
            (&conn).write_all(&frame.encode())?;
        }
        Ok(())
    })();
    // The output has ended, the daemon detached, or the connection broke.
    a.unsubscribe(id);
    let _ = conn.shutdown(std::net::Shutdown::Both);
    *a.active.lock().unwrap() -= 1;
    result
}

/// Reads an attach session's frames until the daemon detaches: stdin goes to the container,
/// resizes to its terminal.
fn read_input(mut conn: UnixStream, a: &Attachments, id: u64, with_stdin: bool) {
    let mut decoder = FrameDecoder::default();
    let mut buf = vec![0u8; 64 * 1024];
    let mut stdin_open = with_stdin;
    'read: loop {
        let n = match conn.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        decoder.feed(&buf[..n]);
        loop {
            match decoder.next_frame() {
                Ok(Some(f)) => match f.kind {
                    FrameKind::Stdin if stdin_open => a.write_stdin(&f.data),
                    FrameKind::CloseStdin if stdin_open => {
                        stdin_open = false;
                        a.stdin_done();
                    }
                    FrameKind::Resize => {
                        if let Some((w, h)) = f.size() {
                            a.resize(w, h);
                        }
                    }
                    _ => {}
                },
                Ok(None) => break,
                Err(e) => {
                    note!("minicri shim: attach session {id}: {e}");
                    break 'read;
                }
            }
        }
    }
    // Detached: a session that had stdin ends it too (stdin_once closes the container's).
    if stdin_open {
        a.stdin_done();
    }
    a.unsubscribe(id);
    let _ = conn.shutdown(std::net::Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn subscribe(
        a: &Attachments,
        id: u64,
        stdout: bool,
        stderr: bool,
    ) -> std::sync::mpsc::Receiver<Frame> {
        let (tx, rx) = std::sync::mpsc::sync_channel(ATTACH_QUEUE);
        a.subscribers.lock().unwrap().push(Subscriber {
            id,
            stdout,
            stderr,
            tx,
            queued: Arc::default(),
        });
        rx
    }

    #[test]
    fn output_goes_to_the_sessions_that_asked_for_it() {
        let a = Attachments {
            open_outputs: Mutex::new(2),
            ..Default::default()
        };
        let both = subscribe(&a, 1, true, true);
        let out = subscribe(&a, 2, true, false);
        a.publish(Stream::Stdout, b"o");
        a.publish(Stream::Stderr, b"e");
        assert_eq!(
            both.try_iter().collect::<Vec<_>>(),
            [
                Frame::new(FrameKind::Stdout, b"o".to_vec()),
                Frame::new(FrameKind::Stderr, b"e".to_vec())
            ]
        );
        assert_eq!(
            out.try_iter().collect::<Vec<_>>(),
            [Frame::new(FrameKind::Stdout, b"o".to_vec())]
        );
        // A session that went away is dropped at the next chunk.
        drop(out);
        a.publish(Stream::Stdout, b"x");
        assert_eq!(a.subscribers.lock().unwrap().len(), 1);
        // The end of both outputs ends every session.
        a.output_closed();
        assert_eq!(a.subscribers.lock().unwrap().len(), 1);
        a.output_closed();
        assert!(a.subscribers.lock().unwrap().is_empty());
        assert_eq!(both.try_iter().count(), 1);
        assert!(both.recv().is_err(), "disconnected");
    }

    #[test]
    fn a_session_that_falls_behind_is_cut_off() {
        let a = Attachments::default();
        let slow = subscribe(&a, 1, true, true);
        for _ in 0..ATTACH_QUEUE {
            a.publish(Stream::Stdout, b"chunk");
        }
        assert_eq!(a.subscribers.lock().unwrap().len(), 1);
        a.publish(Stream::Stdout, b"one too many");
        assert!(a.subscribers.lock().unwrap().is_empty());
        assert_eq!(slow.try_iter().count(), ATTACH_QUEUE);
    }

    #[test]
    fn a_session_is_cut_off_by_bytes_too() {
        let a = Attachments::default();
        let slow = subscribe(&a, 1, true, true);
        let chunk = vec![b'x'; 64 << 10];
        for _ in 0..(ATTACH_QUEUE_BYTES / chunk.len()) {
            a.publish(Stream::Stdout, &chunk);
        }
        assert_eq!(a.subscribers.lock().unwrap().len(), 1, "1 MiB fits");
        a.publish(Stream::Stdout, b"one byte too many");
        assert!(a.subscribers.lock().unwrap().is_empty());
        assert_eq!(slow.try_iter().count(), 16);
    }

    #[test]
    fn stdin_once_closes_the_containers_stdin() {
        let (r, w) = nix::unistd::pipe().unwrap();
        let a = Attachments {
            stdin: Mutex::new(Some(std::fs::File::from(w))),
            has_stdin: true,
            stdin_once: true,
            ..Default::default()
        };
        a.write_stdin(b"in\n");
        a.stdin_done();
        assert!(a.stdin.lock().unwrap().is_none());
        let mut got = String::new();
        std::fs::File::from(r).read_to_string(&mut got).unwrap();
        assert_eq!(got, "in\n", "EOF after the input: the write end is closed");

        let (_r, w) = nix::unistd::pipe().unwrap();
        let kept = Attachments {
            stdin: Mutex::new(Some(std::fs::File::from(w))),
            has_stdin: true,
            ..Default::default()
        };
        kept.stdin_done();
        assert!(kept.stdin.lock().unwrap().is_some(), "without stdin_once");
    }

    #[test]
    fn a_terminal_gets_input_eof_and_resizes() {
        let pty = nix::pty::openpty(None, None).unwrap();
        let a = Attachments {
            stdin: Mutex::new(Some(std::fs::File::from(pty.master.try_clone().unwrap()))),
            has_stdin: true,
            stdin_once: true,
            terminal: Mutex::new(Some(pty.master.try_clone().unwrap())),
            ..Default::default()
        };
        a.resize(132, 43);
        let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
        // SAFETY: TIOCGWINSZ writes one `winsize` into the valid pointer.
        assert_eq!(
            unsafe { libc::ioctl(pty.slave.as_raw_fd(), libc::TIOCGWINSZ, &mut ws) },
            0
        );
        assert_eq!((ws.ws_col, ws.ws_row), (132, 43));
        // Canonical mode: a line, then ^D at the start of a line reads as end of file.
        a.write_stdin(b"line\n");
        a.stdin_done();
        assert!(a.stdin.lock().unwrap().is_none());
        let mut slave = std::fs::File::from(pty.slave);
        let mut buf = [0u8; 64];
        assert_eq!(slave.read(&mut buf).unwrap(), 5);
        assert_eq!(&buf[..5], b"line\n");
        assert_eq!(slave.read(&mut buf).unwrap(), 0, "^D: end of file");
    }
}

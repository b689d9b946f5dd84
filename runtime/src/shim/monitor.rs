//! The shim process (`minicri shim`): creates one container through the OCI runtime and
//! monitors it until it exits. No async runtime: plain threads and one reaper.
//!
//! Threads: main (setup, then the only caller of `waitpid`), one pump per output pipe, the
//! control socket acceptor (one short-lived thread per connection) and a `sigwait` thread
//! (SIGUSR1 reopens the log; SIGTERM, SIGINT and SIGHUP are ignored so the shim outlives
//! whoever signals its session). Signals are blocked before any thread starts and unblocked in
//! the OCI runtime's child before it execs, so the container does not inherit the mask.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use chrono::Utc;
use nix::sys::signal::{SigSet, Signal};
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::Pid;

use super::protocol::{
    ExitRecord, Frame, FrameDecoder, FrameKind, Ready, Request, Response, ShimPaths,
};
use crate::fsutil::write_atomic;
use crate::logs::{CriLogFile, DEFAULT_MAX_LINE, LineSplitter, Stream};
use crate::oci::runc::{Runc, read_runtime_log};

/// `minicri shim` flags. The daemon builds them with [`super::spawn_shim`].
#[derive(Debug, Clone, clap::Args)]
pub struct ShimArgs {
    /// Container id (as the OCI runtime knows it).
    #[arg(long)]
    pub id: String,
    /// The bundle directory: config.json, and the shim's files (see `minicri::shim`).
    #[arg(long)]
    pub bundle: PathBuf,
    /// The OCI runtime binary (runc, crun, youki).
    #[arg(long)]
    pub runtime: PathBuf,
    /// The runtime's state directory (`--root`).
    #[arg(long)]
    pub runtime_root: PathBuf,
    /// Pass `--systemd-cgroup` to the runtime.
    #[arg(long)]
    pub systemd_cgroup: bool,
    /// The CRI log file; without it the container's output is discarded.
    #[arg(long)]
    pub log_path: Option<PathBuf>,
    /// Inherited descriptor to report readiness on (one JSON line, then closed).
    #[arg(long)]
    pub ready_fd: Option<i32>,
    /// Do not fork and start a new session (for debugging).
    #[arg(long)]
    pub foreground: bool,
    /// Give the container a stdin pipe the shim keeps open for attach sessions (CRI
    /// `ContainerConfig.stdin`); without it the container's stdin is `/dev/null`.
    #[arg(long)]
    pub stdin: bool,
    /// Close the container's stdin when the first attach session with stdin ends (CRI
    /// `ContainerConfig.stdin_once`).
    #[arg(long, requires = "stdin")]
    pub stdin_once: bool,
}

type SharedLog = Arc<Mutex<Option<CriLogFile>>>;

/// Queued output frames per attach session; a session further behind is cut off, so a slow
/// client never holds up the container or its log.
const ATTACH_QUEUE: usize = 1024;

/// One attach session's share of the output.
struct Subscriber {
    id: u64,
    stdout: bool,
    stderr: bool,
    tx: std::sync::mpsc::SyncSender<Frame>,
}

/// The attach sessions and the container's stdin.
#[derive(Default)]
struct Attachments {
    subscribers: Mutex<Vec<Subscriber>>,
    next_id: std::sync::atomic::AtomicU64,
    /// Output pumps still running; at 0 the output has ended and sessions are closed.
    open_outputs: Mutex<usize>,
    /// Sessions still writing to their connection (the shim lets them finish before leaving).
    active: Mutex<usize>,
    /// The write end of the container's stdin (with `--stdin`), until it is closed.
    stdin: Mutex<Option<std::fs::File>>,
    /// Whether the container was created with a stdin pipe (`--stdin`).
    has_stdin: bool,
    stdin_once: bool,
}

impl Attachments {
    /// Hands `data` read from `stream` to every session that asked for it.
    fn publish(&self, stream: Stream, data: &[u8]) {
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
            match s.tx.try_send(Frame::new(kind, data)) {
                Ok(()) => true,
                Err(std::sync::mpsc::TrySendError::Full(_)) => {
                    eprintln!(
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
    fn output_closed(&self) {
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
            eprintln!("minicri shim: write to the container's stdin: {e}");
            *stdin = None;
        }
    }

    /// The end of a session's stdin: with `stdin_once` the container's stdin is closed.
    fn stdin_done(&self) {
        if self.stdin_once {
            self.stdin.lock().unwrap().take();
        }
    }
}

struct Shared {
    shim_pid: i32,
    init_pid: i32,
    exited: Mutex<Option<ExitRecord>>,
    cond: Condvar,
    log: SharedLog,
    /// Connections waiting for the exit, answered before the shim leaves.
    waiters: Mutex<usize>,
    attach: Arc<Attachments>,
}

/// Closes every descriptor but stdio and `keep`, so nothing of the spawner's stays open.
fn close_inherited(keep: Option<i32>) {
    let fds: Vec<i32> = match std::fs::read_dir("/proc/self/fd") {
        Ok(d) => d
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect(),
        Err(_) => (3..1024).collect(),
    };
    for fd in fds.into_iter().filter(|fd| *fd > 2 && Some(*fd) != keep) {
        // SAFETY: nothing in this process owns these descriptors yet (no threads, no files).
        unsafe { libc::close(fd) };
    }
}

fn report(ready: &mut Option<std::fs::File>, msg: &Ready) {
    if let Some(mut f) = ready.take() {
        let mut line = serde_json::to_vec(msg).unwrap_or_default();
        line.push(b'\n');
        let _ = f.write_all(&line);
    }
}

/// Entry point of `minicri shim`.
pub fn main(args: ShimArgs) -> ExitCode {
    if !args.foreground {
        // Fork before any thread exists: the spawner's child exits at once (no zombie for the
        // daemon to keep), the grandchild goes on in a new session and is reparented to init,
        // so it survives the daemon.
        // SAFETY: single-threaded here; the child only continues normal Rust code.
        match unsafe { nix::unistd::fork() } {
            Ok(nix::unistd::ForkResult::Parent { .. }) => return ExitCode::SUCCESS,
            Ok(nix::unistd::ForkResult::Child) => {}
            Err(e) => {
                eprintln!("minicri shim: fork: {e}");
                return ExitCode::FAILURE;
            }
        }
        let _ = nix::unistd::setsid();
    }
    close_inherited(args.ready_fd);
    let _ = std::env::set_current_dir("/");
    // SAFETY: the descriptor was handed to us for this purpose and nothing else owns it.
    let mut ready = args
        .ready_fd
        .map(|fd| unsafe { std::fs::File::from_raw_fd(fd) });
    match run(&args, &mut ready) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("minicri shim {}: {e}", args.id);
            report(
                &mut ready,
                &Ready {
                    ok: false,
                    shim_pid: std::process::id() as i32,
                    init_pid: 0,
                    error: Some(e),
                },
            );
            let _ = std::fs::remove_file(ShimPaths::new(&args.bundle).socket());
            ExitCode::FAILURE
        }
    }
}

fn run(args: &ShimArgs, ready: &mut Option<std::fs::File>) -> Result<(), String> {
    let paths = ShimPaths::new(&args.bundle);
    let mut signals = SigSet::empty();
    for s in [
        Signal::SIGUSR1,
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
        Signal::SIGPIPE,
    ] {
        signals.add(s);
    }
    signals
        .thread_block()
        .map_err(|e| format!("block signals: {e}"))?;
    nix::sys::prctl::set_child_subreaper(true)
        .map_err(|e| format!("PR_SET_CHILD_SUBREAPER: {e}"))?;
    for stale in [
        paths.exit_file(),
        paths.init_pid(),
        paths.socket(),
        paths.runtime_log(),
    ] {
        let _ = std::fs::remove_file(stale);
    }
    let shim_pid = std::process::id() as i32;
    std::fs::write(paths.shim_pid(), shim_pid.to_string())
        .map_err(|e| format!("write shim.pid: {e}"))?;
    let log: SharedLog = Arc::new(Mutex::new(match &args.log_path {
        Some(p) => Some(CriLogFile::open(p).map_err(|e| format!("open log {}: {e}", p.display()))?),
        None => None,
    }));
    let listener = UnixListener::bind(paths.socket())
        .map_err(|e| format!("bind {}: {e}", paths.socket().display()))?;

    // Create the container with pipes as its stdout and stderr.
    let (out_r, out_w) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
    let (err_r, err_w) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
    // With `--stdin`, a pipe whose write end the shim keeps for attach sessions.
    let (stdin, stdin_w) = if args.stdin {
        let (r, w) =
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
        (Stdio::from(r), Some(std::fs::File::from(w)))
    } else {
        (Stdio::null(), None)
    };
    let attach = Arc::new(Attachments {
        open_outputs: Mutex::new(2),
        stdin: Mutex::new(stdin_w),
        has_stdin: args.stdin,
        stdin_once: args.stdin_once,
        ..Default::default()
    });
    let mut runc = Runc::new(&args.runtime, &args.runtime_root);
    runc.systemd_cgroup = args.systemd_cgroup;
    let mut cmd = Command::new(&args.runtime);
    cmd.args(runc.create_args(
        &args.id,
        &args.bundle,
        &paths.init_pid(),
        &paths.runtime_log(),
    ))
    .stdin(stdin)
    .stdout(Stdio::from(out_w))
    .stderr(Stdio::from(err_w));
    // SAFETY: sigprocmask is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            SigSet::empty()
                .thread_set_mask()
                .map_err(std::io::Error::from)?;
            Ok(())
        });
    }
    let child = cmd
        .spawn()
        .map_err(|e| format!("run {}: {e}", args.runtime.display()))?;
    drop(cmd); // our copies of the pipes' write ends: EOF comes when the container's are gone
    let runtime_pid = child.id() as i32;
    drop(child); // reaped below by waitpid, never through the handle

    let (done_tx, done_rx) = std::sync::mpsc::channel();
    for (fd, stream) in [(out_r, Stream::Stdout), (err_r, Stream::Stderr)] {
        let log = log.clone();
        let done = done_tx.clone();
        let attach = attach.clone();
        std::thread::spawn(move || {
            pump(fd, stream, &log, &attach);
            attach.output_closed();
            let _ = done.send(());
        });
    }
    drop(done_tx);

    // Reap until the runtime's `create` is done; keep any other status (the init, if it was
    // already killed) for later.
    let mut statuses: HashMap<i32, WaitStatus> = HashMap::new();
    let create_status = loop {
        match waitpid(None, None) {
            Ok(s) => match s.pid() {
                Some(p) if p.as_raw() == runtime_pid => break s,
                Some(p) => {
                    statuses.insert(p.as_raw(), s);
                }
                None => {}
            },
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(format!("waitpid: {e}")),
        }
    };
    if !matches!(create_status, WaitStatus::Exited(_, 0)) {
        let msg =
            read_runtime_log(&paths.runtime_log()).unwrap_or_else(|| format!("{create_status:?}"));
        return Err(format!("{} create: {msg}", args.runtime.display()));
    }
    let init_pid: i32 = std::fs::read_to_string(paths.init_pid())
        .map_err(|e| format!("read init.pid: {e}"))?
        .trim()
        .parse()
        .map_err(|e| format!("init.pid: {e}"))?;

    let shared = Arc::new(Shared {
        shim_pid,
        init_pid,
        exited: Mutex::new(None),
        cond: Condvar::new(),
        log: log.clone(),
        waiters: Mutex::new(0),
        attach: attach.clone(),
    });
    {
        let shared = shared.clone();
        std::thread::spawn(move || serve(listener, shared));
    }
    {
        let log = log.clone();
        std::thread::spawn(move || signal_loop(signals, log));
    }
    report(
        ready,
        &Ready {
            ok: true,
            shim_pid,
            init_pid,
            error: None,
        },
    );

    let status = wait_init(init_pid, statuses);
    // Give the pumps time to drain what the container wrote; processes it left behind in a
    // shared PID namespace may keep the pipes open forever, so do not wait for them.
    let deadline = Instant::now() + Duration::from_secs(2);
    for _ in 0..2 {
        let left = deadline.saturating_duration_since(Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            break;
        }
    }
    let now = Utc::now();
    let (exit_code, signal) = match status {
        Some(WaitStatus::Exited(_, code)) => (code, None),
        Some(WaitStatus::Signaled(_, sig, _)) => (128 + sig as i32, Some(sig as i32)),
        _ => (255, None),
    };
    let record = ExitRecord {
        pid: init_pid,
        exit_code,
        signal,
        exited_at: crate::logs::rfc3339_nano(now),
        exited_at_ns: now.timestamp_nanos_opt().unwrap_or_default(),
    };
    let json = serde_json::to_vec(&record).map_err(|e| e.to_string())?;
    if let Err(e) = write_atomic(&paths.exit_file(), &json, 0o600) {
        eprintln!("minicri shim {}: write exit file: {e}", args.id);
    }
    *shared.exited.lock().unwrap() = Some(record);
    shared.cond.notify_all();
    // Let connections already waiting get their answer.
    let until = Instant::now() + Duration::from_secs(1);
    while (*shared.waiters.lock().unwrap() > 0 || *attach.active.lock().unwrap() > 0)
        && Instant::now() < until
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = std::fs::remove_file(paths.socket());
    Ok(())
}

/// Waits for the init to exit, reaping everything else that gets reparented to the shim.
/// `None` when the init turned out not to be our child (its status cannot be known).
fn wait_init(init_pid: i32, mut seen: HashMap<i32, WaitStatus>) -> Option<WaitStatus> {
    if let Some(s) = seen.remove(&init_pid) {
        return Some(s);
    }
    loop {
        match waitpid(None, None) {
            Ok(s) if s.pid() == Some(Pid::from_raw(init_pid)) => return Some(s),
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(_) => {
                // ECHILD: not our child after all; poll until it is gone.
                while nix::sys::signal::kill(Pid::from_raw(init_pid), None).is_ok() {
                    std::thread::sleep(Duration::from_millis(100));
                }
                return None;
            }
        }
    }
}

/// Copies one output pipe into the CRI log, and to the attach sessions, until EOF.
fn pump(fd: OwnedFd, stream: Stream, log: &SharedLog, attach: &Attachments) {
    let mut pipe = std::fs::File::from(fd);
    let mut splitter = LineSplitter::new(DEFAULT_MAX_LINE);
    let mut buf = vec![0u8; 64 * 1024];
    let mut write = |content: &[u8], partial: bool| {
        if let Some(f) = log.lock().unwrap().as_mut()
            && let Err(e) = f.write_entry(stream, partial, content)
        {
            eprintln!("minicri shim: write {}: {e}", f.path().display());
        }
    };
    loop {
        match pipe.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                splitter.feed(&buf[..n], &mut write);
                attach.publish(stream, &buf[..n]);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                eprintln!("minicri shim: read {}: {e}", stream.as_str());
                break;
            }
        }
    }
    splitter.finish(&mut write);
}

fn reopen(log: &SharedLog) -> Result<(), String> {
    match log.lock().unwrap().as_mut() {
        Some(f) => f
            .reopen()
            .map_err(|e| format!("reopen {}: {e}", f.path().display())),
        None => Err("this container has no log file".into()),
    }
}

fn signal_loop(signals: SigSet, log: SharedLog) {
    loop {
        match signals.wait() {
            Ok(Signal::SIGUSR1) => {
                if let Err(e) = reopen(&log) {
                    eprintln!("minicri shim: {e}");
                }
            }
            Ok(_) => {}
            Err(_) => return,
        }
    }
}

fn serve(listener: UnixListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let shared = shared.clone();
        std::thread::spawn(move || {
            if let Err(e) = handle(conn, &shared) {
                eprintln!("minicri shim: control connection: {e}");
            }
        });
    }
}

fn handle(conn: UnixStream, shared: &Shared) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let response = match serde_json::from_str::<Request>(&line) {
        Err(e) => Response::Error {
            message: format!("bad request: {e}"),
        },
        Ok(Request::State) => Response::State {
            shim_pid: shared.shim_pid,
            init_pid: shared.init_pid,
            exited: shared.exited.lock().unwrap().clone(),
        },
        Ok(Request::ReopenLog) => match reopen(&shared.log) {
            Ok(()) => Response::Ok,
            Err(message) => Response::Error { message },
        },
        Ok(Request::Attach {
            stdin,
            stdout,
            stderr,
        }) => return attach(conn, shared, stdin, stdout, stderr),
        Ok(Request::Wait) => {
            *shared.waiters.lock().unwrap() += 1;
            let mut exited = shared.exited.lock().unwrap();
            while exited.is_none() {
                exited = shared.cond.wait(exited).unwrap();
            }
            let exit = exited.clone().expect("set");
            drop(exited);
            let r = Response::Exited { exit };
            let mut out = serde_json::to_vec(&r).map_err(std::io::Error::other)?;
            out.push(b'\n');
            let res = (&conn).write_all(&out);
            *shared.waiters.lock().unwrap() -= 1;
            return res;
        }
    };
    let mut out = serde_json::to_vec(&response).map_err(std::io::Error::other)?;
    out.push(b'\n');
    (&conn).write_all(&out)
}

/// Serves one attach session on `conn` (see [`Request::Attach`]): this thread copies the
/// subscribed output to the connection, a second one reads the daemon's frames (stdin).
fn attach(
    conn: UnixStream,
    shared: &Shared,
    stdin: bool,
    stdout: bool,
    stderr: bool,
) -> std::io::Result<()> {
    let a = shared.attach.clone();
    let refuse = |message: String| {
        let mut out = serde_json::to_vec(&Response::Error { message })?;
        out.push(b'\n');
        (&conn).write_all(&out)
    };
    if stdin && !a.has_stdin {
        return refuse("the container was not created with stdin".into());
    }
    let (tx, rx) = std::sync::mpsc::sync_channel(ATTACH_QUEUE);
    let id = a.next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
        });
    }
    *a.active.lock().unwrap() += 1;
    let result = (|| {
        let mut out = serde_json::to_vec(&Response::Attached).map_err(std::io::Error::other)?;
        out.push(b'\n');
        (&conn).write_all(&out)?;
        let reader = conn.try_clone()?;
        let ra = a.clone();
        std::thread::spawn(move || read_stdin(reader, &ra, id, stdin));
        for frame in rx {
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

/// Reads an attach session's frames until the daemon detaches: stdin goes to the container.
fn read_stdin(mut conn: UnixStream, a: &Attachments, id: u64, with_stdin: bool) {
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
                    _ => {}
                },
                Ok(None) => break,
                Err(e) => {
                    eprintln!("minicri shim: attach session {id}: {e}");
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
}

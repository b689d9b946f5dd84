//! The shim process (`minicri shim`): creates one container through the OCI runtime and
//! monitors it until it exits. No async runtime: plain threads and one reaper.
//!
//! Threads: main (setup, then the only caller of `waitpid`), one pump per output ([`super::output`]:
//! the stdout and stderr pipes, or a tty container's pty master, [`super::console`]), the control
//! socket acceptor ([`super::control`]: one short-lived thread per connection, attach sessions in
//! [`super::attach`]) and a `sigwait` thread
//! (SIGUSR1 reopens the log; SIGTERM, SIGINT and SIGHUP are ignored so the shim outlives
//! whoever signals its session). Signals are blocked before any thread starts and unblocked in
//! the OCI runtime's child before it execs, so the container does not inherit the mask.

use std::collections::HashMap;
use std::io::Write;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use chrono::Utc;
use nix::sys::signal::{SigSet, Signal};
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::Pid;

use super::attach::Attachments;
use super::console::ConsoleSocket;
use super::control::{Shared, serve};
use super::output::{SharedLog, pump, signal_loop};
use super::protocol::{ExitRecord, Ready, ShimPaths};
use crate::logs::{CriLogFile, Stream};
use crate::oci::runc::{Runc, read_runtime_log};
use minicri_snapshotter::write_atomic;

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
    #[arg(long, requires = "log_dir")]
    pub log_path: Option<PathBuf>,
    /// The pod's log directory, which the log file lies in: nothing below it is followed if it
    /// is a symlink.
    #[arg(long, requires = "log_path")]
    pub log_dir: Option<PathBuf>,
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
    /// The container has a terminal (CRI `ContainerConfig.tty`; `process.terminal` in its
    /// spec): the runtime sends its pty master over a console socket and the shim owns it.
    #[arg(long)]
    pub tty: bool,
    /// Restore the container from these CRIU images (`runtime restore --detach`) instead of
    /// creating it: it runs once the shim reports ready, with no `start`.
    #[arg(long, value_name = "DIR")]
    pub restore_from: Option<PathBuf>,
}

/// How long the runtime may take to hand over the terminal once `create` has returned.
const CONSOLE_TIMEOUT: Duration = Duration::from_secs(10);

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
                note!("minicri shim: fork: {e}");
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
            note!("minicri shim {}: {e}", args.id);
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
    let (signals, shim_pid, log, listener) = setup(args, &paths)?;

    // Create the container: with pipes as its stdout and stderr, or on a terminal whose master
    // the runtime sends to the console socket.
    let console = if args.tty {
        Some(
            ConsoleSocket::bind(&paths.console_socket())
                .map_err(|e| format!("bind {}: {e}", paths.console_socket().display()))?,
        )
    } else {
        None
    };
    let outputs_count = if args.tty { 1 } else { 2 };
    let attach = Arc::new(Attachments::new(outputs_count, args.stdin, args.stdin_once));
    let console_path = console.as_ref().map(|c| c.path());
    let (runtime_pid, outputs) = start_runtime(args, &paths, &attach, console_path)?;

    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let spawn_pump = |fd: OwnedFd, stream: Stream| {
        let log = log.clone();
        let done = done_tx.clone();
        let attach = attach.clone();
        std::thread::spawn(move || {
            pump(fd, stream, &log, &attach);
            attach.output_closed();
            let _ = done.send(());
        });
    };
    let pumps = outputs.len().max(1);
    for (fd, stream) in outputs {
        spawn_pump(fd, stream);
    }

    let statuses = reap_create(args, &paths, runtime_pid)?;
    if let Some(console) = console {
        // The terminal is the container's only output (stdout); input and resizes go to it.
        let master = console
            .receive(CONSOLE_TIMEOUT)
            .map_err(|e| format!("the container's terminal: {e}"))?;
        let dup = || {
            master
                .try_clone()
                .map_err(|e| format!("dup the terminal: {e}"))
        };
        if args.stdin {
            *attach.stdin.lock().unwrap() = Some(std::fs::File::from(dup()?));
        }
        *attach.terminal.lock().unwrap() = Some(dup()?);
        spawn_pump(master, Stream::Stdout);
    }
    drop(done_tx);
    let init_pid: i32 = std::fs::read_to_string(paths.init_pid())
        .map_err(|e| format!("read init.pid: {e}"))?
        .trim()
        .parse()
        .map_err(|e| format!("init.pid: {e}"))?;

    // Before the container starts (the daemon starts it after the ready report).
    let oom = super::oom::OomWatch::start(init_pid);

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
    for _ in 0..pumps {
        let left = deadline.saturating_duration_since(Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            break;
        }
    }
    let oom_killed = oom.is_some_and(|w| w.killed(Duration::from_millis(500)));
    let record = exit_record(args, &paths, init_pid, status, oom_killed)?;
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

/// The shim's start: the signals it handles blocked (the signal loop takes them), made the
/// subreaper of what the container leaves behind, files of an earlier shim of this bundle
/// removed, `shim.pid` written, the CRI log opened and the daemon's socket bound.
fn setup(
    args: &ShimArgs,
    paths: &ShimPaths,
) -> Result<(SigSet, i32, SharedLog, UnixListener), String> {
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
        paths.console_socket(),
    ] {
        let _ = std::fs::remove_file(stale);
    }
    let shim_pid = std::process::id() as i32;
    std::fs::write(paths.shim_pid(), shim_pid.to_string())
        .map_err(|e| format!("write shim.pid: {e}"))?;
    let log: SharedLog = Arc::new(Mutex::new(match (&args.log_dir, &args.log_path) {
        (Some(dir), Some(p)) => {
            Some(CriLogFile::open(dir, p).map_err(|e| format!("open log {}: {e}", p.display()))?)
        }
        _ => None,
    }));
    let listener = UnixListener::bind(paths.socket())
        .map_err(|e| format!("bind {}: {e}", paths.socket().display()))?;
    Ok((signals, shim_pid, log, listener))
}

/// Runs the runtime's `create` (or `restore`) of the container, its stdio pipes (or the console
/// socket) in place: its pid, and the read ends of the container's stdout and stderr.
fn start_runtime(
    args: &ShimArgs,
    paths: &ShimPaths,
    attach: &Attachments,
    console_path: Option<&Path>,
) -> Result<(i32, Vec<(OwnedFd, Stream)>), String> {
    let mut runc = Runc::new(&args.runtime, &args.runtime_root);
    runc.systemd_cgroup = args.systemd_cgroup;
    let mut cmd = Command::new(&args.runtime);
    cmd.args(match &args.restore_from {
        Some(images) => runc.restore_args(
            &args.id,
            &args.bundle,
            &paths.init_pid(),
            &paths.runtime_log(),
            console_path,
            images,
        ),
        None => runc.create_args(
            &args.id,
            &args.bundle,
            &paths.init_pid(),
            &paths.runtime_log(),
            console_path,
        ),
    });
    let mut outputs: Vec<(OwnedFd, Stream)> = Vec::new();
    if args.tty {
        // The runtime's own stdio is not the container's; its errors go to shim.log.
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
    } else {
        let pipe =
            || nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"));
        let ((out_r, out_w), (err_r, err_w)) = (pipe()?, pipe()?);
        // With `--stdin`, a pipe whose write end the shim keeps for attach sessions.
        let stdin = if args.stdin {
            let (r, w) = pipe()?;
            *attach.stdin.lock().unwrap() = Some(std::fs::File::from(w));
            Stdio::from(r)
        } else {
            Stdio::null()
        };
        cmd.stdin(stdin)
            .stdout(Stdio::from(out_w))
            .stderr(Stdio::from(err_w));
        outputs = vec![(out_r, Stream::Stdout), (err_r, Stream::Stderr)];
    }
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
    Ok((runtime_pid, outputs))
}

/// Reaps until the runtime's `create` is done, an error with the runtime's own message if it
/// failed; any other status (the init, if it was already killed) is kept for later.
fn reap_create(
    args: &ShimArgs,
    paths: &ShimPaths,
    runtime_pid: i32,
) -> Result<HashMap<i32, WaitStatus>, String> {
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
        let op = if args.restore_from.is_some() {
            "restore"
        } else {
            "create"
        };
        return Err(format!("{} {op}: {msg}", args.runtime.display()));
    }
    Ok(statuses)
}

/// The init's exit as the shim records it (in the exit file, and for the daemon's waiters),
/// written to the exit file.
fn exit_record(
    args: &ShimArgs,
    paths: &ShimPaths,
    init_pid: i32,
    status: Option<WaitStatus>,
    oom_killed: bool,
) -> Result<ExitRecord, String> {
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
        oom_killed,
    };
    let json = serde_json::to_vec(&record).map_err(|e| e.to_string())?;
    if let Err(e) = write_atomic(&paths.exit_file(), &json, 0o600) {
        note!("minicri shim {}: write exit file: {e}", args.id);
    }
    Ok(record)
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

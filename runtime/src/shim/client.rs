//! The daemon's side of the shim: starting one ([`spawn_shim`]) and talking to it
//! ([`ShimHandle`]).

use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

use super::protocol::{ExitRecord, Ready, Request, Response, ShimPaths, read_exit_file};

/// An attach session with a shim ([`ShimHandle::attach`]): [`super::protocol::Frame`]s are
/// read from `reader` (which may already hold some) and written to `writer`. Shutting
/// `writer` down, or dropping both, detaches.
pub struct ShimAttach {
    pub reader: BufReader<tokio::net::unix::OwnedReadHalf>,
    pub writer: tokio::net::unix::OwnedWriteHalf,
}
use crate::oci::RuntimeCommand;
use crate::oci::error::{OciError, Result};

/// The descriptor number the readiness pipe gets in the shim.
const READY_FD: i32 = 3;

/// Longest unix socket path (`sun_path` holds 108 bytes with the terminating NUL).
const MAX_SOCKET_PATH: usize = 107;

/// Where a shim writes its container's CRI log: `path`, in the pod's log directory `dir`; nothing
/// below `dir` is followed if it is a symlink ([`crate::logs::CriLogFile::open`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogTarget {
    pub dir: PathBuf,
    pub path: PathBuf,
}

/// What to start a shim for.
#[derive(Debug, Clone)]
pub struct ShimConfig {
    pub id: String,
    /// The bundle directory holding `config.json`; the shim's files go there too.
    pub bundle: PathBuf,
    /// How the shim runs the container's OCI runtime ([`crate::oci::OciRuntime::command`]).
    pub runtime: RuntimeCommand,
    /// The CRI log; `None` discards the output (the sandbox infra process).
    pub log: Option<LogTarget>,
    /// The minicri executable (normally `std::env::current_exe()`).
    pub shim_binary: PathBuf,
    /// How long to wait for the container to be created.
    pub ready_timeout: Duration,
    /// Keep a stdin pipe open for attach sessions (CRI `ContainerConfig.stdin`).
    pub stdin: bool,
    /// Close that stdin when the first attach session with stdin ends (`stdin_once`).
    pub stdin_once: bool,
    /// The container has a terminal (`tty`; its spec has `process.terminal`): the shim owns it.
    pub tty: bool,
    /// Restore the container from these CRIU images instead of creating it (it then runs
    /// without `start`).
    pub restore_from: Option<PathBuf>,
}

impl ShimConfig {
    pub fn new(
        id: impl Into<String>,
        bundle: impl Into<PathBuf>,
        runtime: RuntimeCommand,
        shim_binary: impl Into<PathBuf>,
    ) -> Self {
        ShimConfig {
            id: id.into(),
            bundle: bundle.into(),
            runtime,
            log: None,
            shim_binary: shim_binary.into(),
            ready_timeout: Duration::from_secs(120),
            stdin: false,
            stdin_once: false,
            tty: false,
            restore_from: None,
        }
    }
}

/// A running shim and its created container. Everything in it can be found again from the
/// bundle directory ([`ShimHandle::load`]), e.g. after a daemon restart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShimHandle {
    pub id: String,
    pub paths: ShimPaths,
    pub shim_pid: i32,
    /// The container's init process on the host.
    pub init_pid: i32,
}

/// Starts `minicri shim` for a bundle whose `config.json` is written, and waits until the
/// container is created (its init waits for `start`, which the daemon issues through
/// [`crate::oci::OciRuntime::start`]). Blocking: call from a blocking context, or use
/// [`spawn_shim`].
pub fn spawn_shim_blocking(cfg: &ShimConfig) -> Result<ShimHandle> {
    let paths = ShimPaths::new(&cfg.bundle);
    let socket = paths.socket();
    if socket.as_os_str().len() > MAX_SOCKET_PATH {
        return Err(OciError::invalid(format!(
            "control socket path {} is too long",
            socket.display()
        )));
    }
    let shim_log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(paths.shim_log())
        .map_err(|e| OciError::io("open", paths.shim_log(), e))?;
    let (ready_r, ready_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| OciError::io("pipe for", "shim", e.into()))?;
    let mut cmd = Command::new(&cfg.shim_binary);
    cmd.arg("shim")
        .arg("--id")
        .arg(&cfg.id)
        .arg("--bundle")
        .arg(&cfg.bundle)
        .arg("--runtime")
        .arg(&cfg.runtime.binary)
        .arg("--runtime-root")
        .arg(&cfg.runtime.root)
        .arg("--ready-fd")
        .arg(READY_FD.to_string());
    if cfg.runtime.systemd_cgroup {
        cmd.arg("--systemd-cgroup");
    }
    if let Some(log) = &cfg.log {
        cmd.arg("--log-path")
            .arg(&log.path)
            .arg("--log-dir")
            .arg(&log.dir);
    }
    if cfg.stdin {
        cmd.arg("--stdin");
        if cfg.stdin_once {
            cmd.arg("--stdin-once");
        }
    }
    if cfg.tty {
        cmd.arg("--tty");
    }
    if let Some(images) = &cfg.restore_from {
        cmd.arg("--restore-from").arg(images);
    }
    let err_log = shim_log
        .try_clone()
        .map_err(|e| OciError::io("dup", paths.shim_log(), e))?;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(shim_log))
        .stderr(Stdio::from(err_log));
    let w = ready_w.as_raw_fd();
    // SAFETY: dup2 and fcntl are async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(w, READY_FD) < 0 || libc::fcntl(READY_FD, libc::F_SETFD, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| OciError::io("run", &cfg.shim_binary, e))?;
    drop(cmd);
    drop(ready_w);
    // The first shim process forks and exits at once; the shim proper reports on the pipe.
    let _ = child.wait();
    let line = read_ready(ready_r, cfg.ready_timeout)?;
    let ready: Ready = match serde_json::from_slice(&line) {
        Ok(r) => r,
        Err(_) => {
            let tail = std::fs::read_to_string(paths.shim_log()).unwrap_or_default();
            let tail: String = tail.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
            return Err(OciError::Other(format!(
                "shim for {} exited without reporting: {tail}",
                cfg.id
            )));
        }
    };
    if !ready.ok {
        let message = ready.error.unwrap_or_default();
        return Err(OciError::Runtime {
            binary: "minicri shim".into(),
            op: if cfg.restore_from.is_some() {
                "restore"
            } else {
                "create"
            },
            id: cfg.id.clone(),
            message,
        });
    }
    Ok(ShimHandle {
        id: cfg.id.clone(),
        paths,
        shim_pid: ready.shim_pid,
        init_pid: ready.init_pid,
    })
}

fn read_ready(fd: std::os::fd::OwnedFd, timeout: Duration) -> Result<Vec<u8>> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    use std::io::Read;
    let deadline = Instant::now() + timeout;
    let mut file = std::fs::File::from(fd);
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(OciError::Other(format!(
                "shim did not report within {timeout:?}"
            )));
        }
        let ms = PollTimeout::try_from(left.as_millis().min(i32::MAX as u128) as i32)
            .unwrap_or(PollTimeout::MAX);
        let mut fds = [PollFd::new(
            std::os::fd::AsFd::as_fd(&file),
            PollFlags::POLLIN,
        )];
        match poll(&mut fds, ms) {
            Ok(0) | Err(nix::errno::Errno::EINTR) => continue,
            Ok(_) => {}
            Err(e) => return Err(OciError::io("poll", "shim ready pipe", e.into())),
        }
        match file.read(&mut buf) {
            Ok(0) => return Ok(out),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(OciError::io("read", "shim ready pipe", e)),
        }
    }
}

/// [`spawn_shim_blocking`] on tokio's blocking pool.
pub async fn spawn_shim(cfg: ShimConfig) -> Result<ShimHandle> {
    tokio::task::spawn_blocking(move || spawn_shim_blocking(&cfg))
        .await
        .map_err(|e| OciError::Other(format!("spawn shim task: {e}")))?
}

/// The real monitors: `minicri shim` processes ([`super::Monitors`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Shims;

impl super::Monitors for Shims {
    fn spawn(&self, cfg: ShimConfig) -> BoxFuture<'_, Result<ShimHandle>> {
        Box::pin(spawn_shim(cfg))
    }

    fn load(&self, id: &str, bundle: &Path) -> Result<ShimHandle> {
        ShimHandle::load(id, bundle)
    }

    fn is_alive(&self, shim: &ShimHandle) -> bool {
        shim.is_alive()
    }

    fn exit_record(&self, shim: &ShimHandle) -> Result<Option<ExitRecord>> {
        shim.exit_record()
    }

    fn wait<'a>(&'a self, shim: &'a ShimHandle) -> BoxFuture<'a, Result<ExitRecord>> {
        Box::pin(shim.wait())
    }

    fn reopen_log<'a>(&'a self, shim: &'a ShimHandle) -> BoxFuture<'a, Result<()>> {
        Box::pin(shim.reopen_log())
    }

    fn attach<'a>(
        &'a self,
        shim: &'a ShimHandle,
        stdin: bool,
        stdout: bool,
        stderr: bool,
    ) -> BoxFuture<'a, Result<ShimAttach>> {
        Box::pin(shim.attach(stdin, stdout, stderr))
    }

    fn kill_group(&self, shim: &ShimHandle) {
        shim.kill_group()
    }

    fn kill_shim(&self, shim: &ShimHandle) {
        shim.kill_shim()
    }
}

fn read_pid(path: &Path) -> Option<i32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

impl ShimHandle {
    /// Finds a shim again from its bundle directory (pids from `shim.pid` and `init.pid`).
    pub fn load(id: impl Into<String>, bundle: impl Into<PathBuf>) -> Result<Self> {
        let paths = ShimPaths::new(bundle);
        let shim_pid = read_pid(&paths.shim_pid())
            .ok_or_else(|| OciError::Other(format!("no shim.pid in {}", paths.bundle.display())))?;
        let init_pid = read_pid(&paths.init_pid()).unwrap_or(0);
        Ok(ShimHandle {
            id: id.into(),
            paths,
            shim_pid,
            init_pid,
        })
    }

    /// Whether the shim process still runs (and is a minicri shim, not a reused pid).
    pub fn is_alive(&self) -> bool {
        if kill(Pid::from_raw(self.shim_pid), None).is_err() {
            return false;
        }
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", self.shim_pid)).unwrap_or_default();
        cmdline.split(|&b| b == 0).any(|a| a == b"shim")
            && cmdline
                .windows(self.id.len())
                .any(|w| w == self.id.as_bytes())
    }

    /// The exit status, if the shim has written it.
    pub fn exit_record(&self) -> Result<Option<ExitRecord>> {
        read_exit_file(&self.paths.exit_file())
            .map_err(|e| OciError::io("read", self.paths.exit_file(), e))
    }

    async fn request(&self, req: &Request) -> std::io::Result<Response> {
        let mut s = UnixStream::connect(self.paths.socket()).await?;
        let mut line = serde_json::to_vec(req).map_err(std::io::Error::other)?;
        line.push(b'\n');
        s.write_all(&line).await?;
        let mut reader = BufReader::new(s);
        let mut resp = String::new();
        if reader.read_line(&mut resp).await? == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "shim closed the connection",
            ));
        }
        serde_json::from_str(&resp).map_err(std::io::Error::other)
    }

    /// Asks the shim to reopen the log file (CRI `ReopenContainerLog`). Fails when the
    /// container has exited (the shim is gone) or has no log.
    pub async fn reopen_log(&self) -> Result<()> {
        match self.request(&Request::ReopenLog).await {
            Ok(Response::Ok) => Ok(()),
            Ok(Response::Error { message }) => Err(OciError::Other(message)),
            Ok(other) => Err(OciError::Other(format!(
                "unexpected shim response {other:?}"
            ))),
            Err(e) => Err(OciError::NotRunning(format!(
                "container {} is not running (shim: {e})",
                self.id
            ))),
        }
    }

    /// Starts an attach session (CRI `Attach`) for the streams asked for. Fails when the
    /// container has exited, or `stdin` is asked of a container created without it.
    pub async fn attach(&self, stdin: bool, stdout: bool, stderr: bool) -> Result<ShimAttach> {
        let gone = |e: std::io::Error| {
            OciError::NotRunning(format!("container {} is not running (shim: {e})", self.id))
        };
        let s = UnixStream::connect(self.paths.socket())
            .await
            .map_err(gone)?;
        let (r, mut writer) = s.into_split();
        let mut line = serde_json::to_vec(&Request::Attach {
            stdin,
            stdout,
            stderr,
        })
        .map_err(|e| OciError::Other(e.to_string()))?;
        line.push(b'\n');
        writer.write_all(&line).await.map_err(gone)?;
        let mut reader = BufReader::new(r);
        let mut resp = String::new();
        if reader.read_line(&mut resp).await.map_err(gone)? == 0 {
            return Err(gone(std::io::ErrorKind::UnexpectedEof.into()));
        }
        match serde_json::from_str(&resp) {
            Ok(Response::Attached) => Ok(ShimAttach { reader, writer }),
            Ok(Response::Error { message }) => Err(OciError::Other(message)),
            other => Err(OciError::Other(format!(
                "unexpected shim response {other:?}"
            ))),
        }
    }

    /// The shim's view: `Some` exit once the init has exited.
    pub async fn state(&self) -> Result<Option<ExitRecord>> {
        match self.request(&Request::State).await {
            Ok(Response::State { exited, .. }) => Ok(exited),
            Ok(other) => Err(OciError::Other(format!(
                "unexpected shim response {other:?}"
            ))),
            Err(_) => self.exit_or_gone(),
        }
    }

    fn exit_or_gone(&self) -> Result<Option<ExitRecord>> {
        match self.exit_record()? {
            Some(r) => Ok(Some(r)),
            None if self.is_alive() => Ok(None),
            None => Err(OciError::Other(format!(
                "the shim of {} is gone and left no exit status",
                self.id
            ))),
        }
    }

    /// Waits until the container's init has exited and its output is in the log. Errors when
    /// the shim died without recording an exit (e.g. it was SIGKILLed).
    pub async fn wait(&self) -> Result<ExitRecord> {
        loop {
            match self.request(&Request::Wait).await {
                Ok(Response::Exited { exit }) => return Ok(exit),
                Ok(other) => {
                    return Err(OciError::Other(format!(
                        "unexpected shim response {other:?}"
                    )));
                }
                Err(_) => {
                    if let Some(r) = self.exit_or_gone()? {
                        return Ok(r);
                    }
                    // Alive but not answering: between exiting and removing its socket.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    /// SIGKILL to the shim's process group (it leads its own session): the shim and a runtime
    /// `create` it still waits for, so that nothing creates the container after this.
    pub fn kill_group(&self) {
        if self.is_alive() && kill(Pid::from_raw(-self.shim_pid), Signal::SIGKILL).is_err() {
            let _ = kill(Pid::from_raw(self.shim_pid), Signal::SIGKILL);
        }
    }

    /// SIGKILLs the shim (not the container): for cleanup of a shim whose container is gone.
    pub fn kill_shim(&self) {
        if self.is_alive() {
            let _ = kill(Pid::from_raw(self.shim_pid), Signal::SIGKILL);
        }
    }
}

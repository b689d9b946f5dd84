//! [`Runc`]: the [`OciRuntime`] implementation for runc-compatible binaries (runc, crun,
//! youki), with `tokio::process`.
//!
//! Invariants:
//! - every invocation passes `--root <state>/runc` (the [`Runc::root`]), so minicri's containers
//!   live apart from anything else on the host using the same runtime;
//! - with the systemd cgroup driver every invocation passes `--systemd-cgroup`, so the runtime
//!   reads `linux.cgroupsPath` as `slice:prefix:name`;
//! - a failed invocation becomes [`OciError::Runtime`] carrying what the runtime printed, or
//!   [`OciError::NotFound`] when it says the container does not exist;
//! - `delete --force` of a container that does not exist succeeds (CRI removal is idempotent);
//! - temporary files (exec `process.json`, update resources) are written, mode 0600, to
//!   [`Runc::scratch_dir`] (`<root>.tmp`, beside the root, not inside it: the runtime lists every
//!   directory of its root as a container) and removed after use.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use futures::future::BoxFuture;
use oci_spec::runtime::{LinuxResources, Process};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};

use super::error::{OciError, Result};
use super::host::{CgroupDriver, cgroups_path};
use super::runtime::{
    CreateIo, CreateOpts, ExecOpts, ExecOutput, ExecProcess, OciRuntime, OciState, ProbeEnv,
    RuntimeCommand,
};

/// The files of one `exec`: process.json (the container's environment), the pid file and the
/// runtime's JSON log, under [`Runc::scratch_dir`]. Removed when dropped, on every path: an
/// exec whose spawn or wait failed left them in `/run`.
struct ExecScratch {
    process: PathBuf,
    pid: PathBuf,
    log: PathBuf,
}

impl Drop for ExecScratch {
    fn drop(&mut self) {
        for f in [&self.process, &self.pid, &self.log] {
            let _ = std::fs::remove_file(f);
        }
    }
}

/// A runc-compatible runtime binary (runc, crun, youki).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Runc {
    pub binary: PathBuf,
    /// The runtime's state directory (`--root`), e.g. `/run/minicri/runc`.
    pub root: PathBuf,
    /// Pass `--systemd-cgroup` (the systemd cgroup driver).
    pub systemd_cgroup: bool,
    /// Kill the runtime's process when the call awaiting it is dropped. Off for pods: a call
    /// cut short (a cancelled RPC) leaves the runtime to finish what it started, and the state
    /// it leaves is reconciled after. On for handler probes, whose timeout gives up on a runtime
    /// that hangs and must not leave it running.
    pub kill_on_drop: bool,
}

impl Runc {
    pub fn new(binary: impl Into<PathBuf>, root: impl Into<PathBuf>) -> Self {
        Runc {
            binary: binary.into(),
            root: root.into(),
            systemd_cgroup: false,
            kill_on_drop: false,
        }
    }

    /// Whether `<binary> features` lists `option` among the mount options it understands (the
    /// command exists in runc >= 1.1 and crun >= 1.5; a runtime without it is taken to know
    /// none of the newer options such as `rro`). Runs the binary once, synchronously: for
    /// startup.
    pub fn supports_mount_option(&self, option: &str) -> bool {
        let Ok(out) = std::process::Command::new(&self.binary)
            .arg("features")
            .stdin(Stdio::null())
            .stderr(Stdio::null())
            .output()
        else {
            return false;
        };
        out.status.success()
            && serde_json::from_slice::<serde_json::Value>(&out.stdout)
                .ok()
                .and_then(|v| {
                    let list = v.get("mountOptions")?.as_array()?.clone();
                    Some(list.iter().any(|o| o.as_str() == Some(option)))
                })
                .unwrap_or(false)
    }

    /// Where temporary process and resources files go.
    pub fn scratch_dir(&self) -> PathBuf {
        let mut s = self.root.clone().into_os_string();
        s.push(".tmp");
        PathBuf::from(s)
    }

    fn name(&self) -> String {
        self.binary
            .file_name()
            .unwrap_or(self.binary.as_os_str())
            .to_string_lossy()
            .into_owned()
    }

    /// The global flags every invocation carries.
    pub fn global_args(&self) -> Vec<OsString> {
        let mut a: Vec<OsString> = vec!["--root".into(), self.root.clone().into()];
        if self.systemd_cgroup {
            a.push("--systemd-cgroup".into());
        }
        a
    }

    /// Arguments (after the binary) of `create`, with the runtime's own messages going to
    /// `log` as JSON lines (its stdio belongs to the container). A container with a terminal
    /// needs `console_socket`: the runtime sends the pty master there.
    pub fn create_args(
        &self,
        id: &str,
        bundle: &Path,
        pid_file: &Path,
        log: &Path,
        console_socket: Option<&Path>,
    ) -> Vec<OsString> {
        let mut a = self.global_args();
        a.extend([
            "--log".into(),
            log.into(),
            "--log-format".into(),
            "json".into(),
        ]);
        a.extend([
            "create".into(),
            "--bundle".into(),
            bundle.into(),
            "--pid-file".into(),
            pid_file.into(),
        ]);
        if let Some(c) = console_socket {
            a.extend(["--console-socket".into(), c.into()]);
        }
        a.push(id.into());
        a
    }

    /// Arguments (after the binary) of `restore --detach` of a checkpointed container from its
    /// CRIU images in `images`, in place of [`Runc::create_args`]: the restored container runs
    /// at once (no `start`), its stdio the runtime's own (runc hands its stdio to the restored
    /// process in place of the checkpointed one's pipes).
    pub fn restore_args(
        &self,
        id: &str,
        bundle: &Path,
        pid_file: &Path,
        log: &Path,
        console_socket: Option<&Path>,
        images: &Path,
    ) -> Vec<OsString> {
        let mut a = self.create_args(id, bundle, pid_file, log, console_socket);
        let create = a.iter().position(|x| x == "create").unwrap_or(a.len());
        a.splice(
            create..=create,
            [
                "restore".into(),
                "--detach".into(),
                "--image-path".into(),
                images.into(),
                "--work-path".into(),
                bundle.into(),
            ],
        );
        a
    }

    fn command(&self) -> Command {
        let mut c = Command::new(&self.binary);
        c.args(self.global_args())
            .stdin(Stdio::null())
            .kill_on_drop(self.kill_on_drop);
        c
    }

    /// Runs a short command and maps its failure.
    async fn run(
        &self,
        op: &'static str,
        id: &str,
        args: &[OsString],
        stdin: Option<&[u8]>,
    ) -> Result<Vec<u8>> {
        let mut c = self.command();
        c.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
        if stdin.is_some() {
            c.stdin(Stdio::piped());
        }
        let mut child = c
            .spawn()
            .map_err(|e| OciError::io("run", &self.binary, e))?;
        if let (Some(data), Some(mut w)) = (stdin, child.stdin.take()) {
            let _ = w.write_all(data).await;
        }
        let out = child
            .wait_with_output()
            .await
            .map_err(|e| OciError::io("wait for", &self.binary, e))?;
        if out.status.success() {
            return Ok(out.stdout);
        }
        let msg = runtime_message(&out.stderr);
        Err(classify(&self.name(), op, id, msg))
    }

    fn scratch_file(&self, id: &str, kind: &str, contents: &[u8]) -> Result<PathBuf> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let dir = self.scratch_dir();
        std::fs::create_dir_all(&dir).map_err(|e| OciError::io("create", &dir, e))?;
        let n = SCRATCH_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = dir.join(format!("{id}.{kind}.{}.{n}", std::process::id()));
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| OciError::io("create", &path, e))?;
        f.write_all(contents)
            .map_err(|e| OciError::io("write", &path, e))?;
        Ok(path)
    }

    /// Writes process.json (off the async workers: it holds the container's whole environment)
    /// and builds the `exec` command with a pid file and a JSON log.
    fn exec_command(
        &self,
        id: &str,
        process: &Process,
        detach: bool,
    ) -> Result<(Command, ExecScratch)> {
        let process_file = minicri_store::fsutil::off_async(|| {
            let json = serde_json::to_vec(process)
                .map_err(|e| OciError::Other(format!("process.json: {e}")))?;
            self.scratch_file(id, "process", &json)
        })?;
        let dir = self.scratch_dir();
        let n = SCRATCH_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let scratch = ExecScratch {
            process: process_file,
            pid: dir.join(format!("{id}.pid.{}.{n}", std::process::id())),
            log: dir.join(format!("{id}.log.{}.{n}", std::process::id())),
        };
        let mut c = Command::new(&self.binary);
        c.args(self.global_args())
            .args([
                "--log".as_ref(),
                scratch.log.as_os_str(),
                "--log-format".as_ref(),
                "json".as_ref(),
            ])
            .arg("exec")
            .arg("--process")
            .arg(&scratch.process)
            .arg("--pid-file")
            .arg(&scratch.pid);
        if detach {
            c.arg("--detach");
        }
        c.arg(id).kill_on_drop(self.kill_on_drop);
        Ok((c, scratch))
    }
}

static SCRATCH_SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The useful part of a runtime's stderr: runc prints logrus lines
/// (`time=".." level=error msg="container does not exist"`), crun plain text.
fn runtime_message(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let mut msgs = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        match line.find("msg=") {
            Some(i) => {
                let rest = &line[i + 4..];
                let m = rest
                    .strip_prefix('"')
                    .and_then(|r| r.rfind('"').map(|j| &r[..j]))
                    .unwrap_or(rest);
                msgs.push(m.replace("\\\"", "\""));
            }
            None => msgs.push(line.trim().to_string()),
        }
    }
    if msgs.is_empty() {
        "failed (no message)".into()
    } else {
        msgs.join("; ")
    }
}

/// An exec's process: its end judged by the runtime's JSON log (the runtime's own failure, e.g.
/// a missing executable) or else the exit code it relayed; the scratch files go with it.
fn exec_process(child: Child, scratch: ExecScratch, binary: String, id: String) -> ExecProcess {
    let pid_file = Some(scratch.pid.clone());
    ExecProcess::new(child, pid_file, move |status| {
        let runtime_error = read_runtime_log(&scratch.log);
        drop(scratch);
        match runtime_error {
            Some(message) => Err(classify(&binary, "exec", &id, message)),
            None => Ok(exit_code(status)),
        }
    })
}

/// Error-level messages of a runtime's JSON log (`--log-format json`), if any.
pub fn read_runtime_log(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let msgs: Vec<String> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| matches!(v["level"].as_str(), Some("error" | "fatal" | "panic")))
        .filter_map(|v| v["msg"].as_str().map(str::to_string))
        .collect();
    if msgs.is_empty() {
        None
    } else {
        Some(msgs.join("; "))
    }
}

/// A runtime's failure as [`OciError::NotFound`] when it says the container is unknown: runc's
/// "does not exist", or crun's missing `<root>/<id>/status` file (not any missing file whose
/// name holds "status": an exec of a missing `/app/status.sh` is no missing container).
fn classify(binary: &str, op: &'static str, id: &str, message: String) -> OciError {
    let m = message.to_ascii_lowercase();
    let state_file = format!("/{}/status", id.to_ascii_lowercase());
    if m.contains("does not exist")
        || (m.contains("no such file or directory") && m.contains(&state_file))
    {
        return OciError::NotFound(id.to_string());
    }
    OciError::Runtime {
        binary: binary.to_string(),
        op,
        id: id.to_string(),
        message,
    }
}

fn exit_code(status: std::process::ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    status
        .code()
        .unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

/// The most of each of stdout and stderr an [`OciRuntime::exec`] keeps (ExecSync): both fit in
/// the kubelet's 16 MiB CRI messages, and its exec probes read only the first 10 KiB.
pub const MAX_EXEC_OUTPUT: usize = 4 << 20;

/// What a reader task has read so far: the bytes kept and how many were dropped.
type Captured = std::sync::Arc<std::sync::Mutex<(Vec<u8>, u64)>>;

/// Reads `r` to its end in a task, keeping the first `cap` bytes in the returned buffer and
/// discarding the rest (the process must not block on a full pipe).
fn capture<R: tokio::io::AsyncRead + Unpin + Send + 'static>(
    r: Option<R>,
    cap: usize,
) -> (tokio::task::JoinHandle<()>, Captured) {
    let captured = Captured::default();
    let c = captured.clone();
    let task = tokio::spawn(async move {
        let Some(mut r) = r else { return };
        let mut chunk = vec![0u8; 64 * 1024];
        loop {
            match r.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let mut c = c.lock().unwrap();
                    let keep = n.min(cap - c.0.len());
                    c.0.extend_from_slice(&chunk[..keep]);
                    c.1 += (n - keep) as u64;
                }
            }
        }
    });
    (task, captured)
}

/// The output a reader task captured, once it ends or `grace` has passed. The task is aborted
/// either way, so a process left behind in the container holding the pipe cannot keep it (and
/// its reads) alive after the call; what it read so far is kept.
async fn drain(
    (task, captured): (tokio::task::JoinHandle<()>, Captured),
    grace: Duration,
    id: &str,
    stream: &str,
) -> Vec<u8> {
    let abort = task.abort_handle();
    let ended = tokio::time::timeout(grace, task).await.is_ok();
    abort.abort();
    let (bytes, dropped) = std::mem::take(&mut *captured.lock().unwrap());
    if dropped > 0 {
        tracing::warn!(
            container = id,
            stream,
            kept = bytes.len(),
            dropped,
            "exec output over the cap was dropped"
        );
    }
    if !ended {
        tracing::debug!(
            container = id,
            stream,
            "exec output still open after the process ended (a background process holds it)"
        );
    }
    bytes
}

impl OciRuntime for Runc {
    fn create<'a>(&'a self, opts: CreateOpts) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let log = opts.bundle.join("create-log.json");
            let _ = std::fs::remove_file(&log);
            let mut c = Command::new(&self.binary);
            c.args(self.create_args(&opts.id, &opts.bundle, &opts.pid_file, &log, None))
                .kill_on_drop(self.kill_on_drop);
            let (i, o, e) = match opts.io {
                CreateIo::Null => (Stdio::null(), Stdio::null(), Stdio::null()),
                CreateIo::Files {
                    stdin,
                    stdout,
                    stderr,
                } => {
                    let f =
                        |x: Option<std::fs::File>| x.map(Stdio::from).unwrap_or_else(Stdio::null);
                    (f(stdin), f(stdout), f(stderr))
                }
            };
            c.stdin(i).stdout(o).stderr(e);
            let status = c
                .status()
                .await
                .map_err(|e| OciError::io("run", &self.binary, e))?;
            let message = read_runtime_log(&log);
            let _ = std::fs::remove_file(&log);
            if status.success() {
                return Ok(());
            }
            let message = message.unwrap_or_else(|| format!("exited with {status}"));
            Err(classify(&self.name(), "create", &opts.id, message))
        })
    }

    fn start<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.run("start", id, &["start".into(), id.into()], None)
                .await
                .map(drop)
        })
    }

    fn state<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<OciState>> {
        Box::pin(async move {
            let out = self
                .run("state", id, &["state".into(), id.into()], None)
                .await?;
            serde_json::from_slice(&out)
                .map_err(|e| OciError::Other(format!("{} state {id}: {e}", self.name())))
        })
    }

    fn kill<'a>(&'a self, id: &'a str, signal: i32, all: bool) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let mut args: Vec<OsString> = vec!["kill".into()];
            if all {
                args.push("--all".into());
            }
            args.extend([id.into(), signal.to_string().into()]);
            self.run("kill", id, &args, None).await.map(drop)
        })
    }

    fn delete<'a>(&'a self, id: &'a str, force: bool) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let mut args: Vec<OsString> = vec!["delete".into()];
            if force {
                args.push("--force".into());
            }
            args.push(id.into());
            match self.run("delete", id, &args, None).await {
                Err(OciError::NotFound(_)) if force => Ok(()),
                r => r.map(drop),
            }
        })
    }

    fn exec<'a>(&'a self, opts: ExecOpts) -> BoxFuture<'a, Result<ExecOutput>> {
        Box::pin(async move {
            let (mut c, scratch) = self.exec_command(&opts.id, &opts.process, false)?;
            c.stdin(if opts.stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
            let mut child = c
                .spawn()
                .map_err(|e| OciError::io("run", &self.binary, e))?;
            if let (Some(data), Some(mut w)) = (opts.stdin, child.stdin.take()) {
                tokio::spawn(async move {
                    let _ = w.write_all(&data).await;
                });
            }
            let out = capture(child.stdout.take(), MAX_EXEC_OUTPUT);
            let err = capture(child.stderr.take(), MAX_EXEC_OUTPUT);
            let mut timed_out = false;
            let status = match opts.timeout {
                None => child.wait().await,
                Some(t) => match tokio::time::timeout(t, child.wait()).await {
                    Ok(s) => s,
                    Err(_) => {
                        timed_out = true;
                        // Killing `runc exec` alone would leave the process running: kill the
                        // process. Then `runc exec` itself: it copies the output until every
                        // holder of it has closed it, so a process the command left in the
                        // background would keep it (and this call) alive.
                        if let Some(pid) = std::fs::read_to_string(&scratch.pid)
                            .ok()
                            .and_then(|s| s.trim().parse().ok())
                        {
                            let _ = nix::sys::signal::kill(
                                nix::unistd::Pid::from_raw(pid),
                                nix::sys::signal::SIGKILL,
                            );
                        }
                        match tokio::time::timeout(Duration::from_secs(1), child.wait()).await {
                            Ok(s) => s,
                            Err(_) => {
                                let _ = child.start_kill();
                                child.wait().await
                            }
                        }
                    }
                },
            }
            .map_err(|e| OciError::io("wait for", &self.binary, e))?;
            // Output is drained unless something left behind in the container holds the pipes.
            let grace = Duration::from_secs(2);
            // Both at once: two held pipes cost one grace, not two.
            let (stdout, stderr) = tokio::join!(
                drain(out, grace, &opts.id, "stdout"),
                drain(err, grace, &opts.id, "stderr")
            );
            let runtime_error = read_runtime_log(&scratch.log);
            drop(scratch);
            if let Some(message) = runtime_error.filter(|_| !timed_out) {
                return Err(classify(&self.name(), "exec", &opts.id, message));
            }
            Ok(ExecOutput {
                exit_code: exit_code(status),
                stdout,
                stderr,
                timed_out,
            })
        })
    }

    fn exec_spawn<'a>(&'a self, opts: ExecOpts) -> BoxFuture<'a, Result<ExecProcess>> {
        Box::pin(async move {
            self.exec_spawn_stdio(opts, Stdio::piped(), Stdio::piped(), Stdio::piped())
        })
    }

    fn exec_detached<'a>(&'a self, id: &'a str, process: Process) -> BoxFuture<'a, Result<i32>> {
        Box::pin(async move {
            let (mut c, scratch) = self.exec_command(id, &process, true)?;
            c.stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let status = c
                .status()
                .await
                .map_err(|e| OciError::io("run", &self.binary, e))?;
            let pid = std::fs::read_to_string(&scratch.pid)
                .ok()
                .and_then(|s| s.trim().parse().ok());
            let message = read_runtime_log(&scratch.log);
            drop(scratch);
            match (status.success(), pid) {
                (true, Some(pid)) => Ok(pid),
                _ => Err(classify(
                    &self.name(),
                    "exec",
                    id,
                    message.unwrap_or_else(|| format!("exited with {status}")),
                )),
            }
        })
    }

    fn update<'a>(
        &'a self,
        id: &'a str,
        resources: &'a LinuxResources,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let json = serde_json::to_vec(resources)
                .map_err(|e| OciError::Other(format!("resources: {e}")))?;
            let file =
                minicri_store::fsutil::off_async(|| self.scratch_file(id, "resources", &json))?;
            let r = self
                .run(
                    "update",
                    id,
                    &[
                        "update".into(),
                        "--resources".into(),
                        file.clone().into(),
                        id.into(),
                    ],
                    None,
                )
                .await;
            let _ = std::fs::remove_file(&file);
            r.map(drop)
        })
    }

    fn pause<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.run("pause", id, &["pause".into(), id.into()], None)
                .await
                .map(drop)
        })
    }

    fn checkpoint<'a>(
        &'a self,
        id: &'a str,
        images: &'a Path,
        work: &'a Path,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let args: Vec<OsString> = vec![
                "checkpoint".into(),
                "--leave-running".into(),
                "--image-path".into(),
                images.into(),
                "--work-path".into(),
                work.into(),
                id.into(),
            ];
            // Killed when the call is dropped: CRIU, losing runc, lets the container go on.
            let mut c = self.command();
            c.kill_on_drop(true)
                .args(&args)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            let out = c
                .output()
                .await
                .map_err(|e| OciError::io("run", &self.binary, e))?;
            if out.status.success() {
                return Ok(());
            }
            let msg = runtime_message(&out.stderr);
            Err(classify(&self.name(), "checkpoint", id, msg))
        })
    }

    fn resume<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.run("resume", id, &["resume".into(), id.into()], None)
                .await
                .map(drop)
        })
    }

    fn list(&self) -> BoxFuture<'_, Result<Vec<OciState>>> {
        Box::pin(async move {
            let out = self
                .run(
                    "list",
                    "",
                    &["list".into(), "--format".into(), "json".into()],
                    None,
                )
                .await?;
            let list: Option<Vec<OciState>> = serde_json::from_slice(&out)
                .map_err(|e| OciError::Other(format!("{} list: {e}", self.name())))?;
            Ok(list.unwrap_or_default())
        })
    }

    /// `exec` in the foreground with the given stdio instead of pipes. For a process with
    /// `terminal: true`, pass the slave side of a pty as all three: the runtime then makes the
    /// container's own pty, relays between the two and resizes the container's to the given
    /// one's size on SIGWINCH.
    fn exec_spawn_stdio(
        &self,
        opts: ExecOpts,
        stdin: Stdio,
        stdout: Stdio,
        stderr: Stdio,
    ) -> Result<ExecProcess> {
        let (mut c, scratch) = self.exec_command(&opts.id, &opts.process, false)?;
        c.stdin(stdin).stdout(stdout).stderr(stderr);
        let child = c
            .spawn()
            .map_err(|e| OciError::io("run", &self.binary, e))?;
        Ok(exec_process(child, scratch, self.name(), opts.id))
    }

    fn command(&self) -> RuntimeCommand {
        RuntimeCommand {
            binary: self.binary.clone(),
            root: self.root.clone(),
            systemd_cgroup: self.systemd_cgroup,
        }
    }

    fn check_available<'a>(
        &'a self,
        name: &'a str,
        env: &'a ProbeEnv,
    ) -> BoxFuture<'a, std::result::Result<(), String>> {
        Box::pin(probe_handler(name, self, env))
    }
}

/// Creates and deletes a throwaway container with `runtime` (under a root of its own, so
/// nothing of it is ever taken for a pod's container), bounded by the
/// probe environment's timeout (`PROBE_TIMEOUT`).
pub(super) async fn probe_handler(
    name: &str,
    runtime: &Runc,
    env: &ProbeEnv,
) -> std::result::Result<(), String> {
    if which(&runtime.binary).is_none() {
        return Err(format!(
            "binary {} not found (PATH or path)",
            runtime.binary.display()
        ));
    }
    let dir = env.dir.join(name);
    let _ = tokio::fs::remove_dir_all(&dir).await;
    let mut probe_runtime = runtime.clone();
    probe_runtime.root = dir.join("root");
    probe_runtime.kill_on_drop = true;
    let id = match crate::ids::random_hex::<6>() {
        Ok(hex) => format!("minicri-probe-{hex}"),
        Err(e) => return Err(e.to_string()),
    };
    let result = tokio::time::timeout(env.timeout, async {
        let bundle = dir.join("bundle");
        let spec = probe_spec(env, &id).map_err(|e| e.to_string())?;
        let b = bundle.clone();
        tokio::task::spawn_blocking(move || {
            std::fs::create_dir_all(&b)?;
            minicri_snapshotter::write_atomic(&b.join("config.json"), spec.as_bytes(), 0o600)
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("writing the probe bundle {}: {e}", bundle.display()))?;
        let created = probe_runtime
            .create(CreateOpts {
                id: id.clone(),
                pid_file: bundle.join("pid"),
                bundle: bundle.clone(),
                io: CreateIo::Null,
            })
            .await;
        let deleted = probe_runtime.delete(&id, true).await;
        created.map_err(probe_message)?;
        deleted.map_err(|e| format!("deleting the probe container: {}", probe_message(e)))
    })
    .await
    .unwrap_or_else(|_| Err(format!("no answer within {:?}", env.timeout)));
    let _ = tokio::fs::remove_dir_all(&dir).await;
    result
}

/// What the runtime said, without the command line around it.
fn probe_message(e: OciError) -> String {
    match e {
        OciError::Runtime { message, .. } => message,
        other => other.to_string(),
    }
}

/// The probe container: the infra process's rootfs and binary, its own cgroup, PID, mount,
/// IPC, UTS and network namespaces. It is created, never started.
fn probe_spec(env: &ProbeEnv, id: &str) -> Result<String> {
    let parent = match env.cgroup_driver {
        CgroupDriver::Cgroupfs => "/minicri",
        CgroupDriver::Systemd => "system.slice",
    };
    let cgroups = cgroups_path(env.cgroup_driver, parent, id)?;
    let bind = |dest: &Path, src: &Path| {
        serde_json::json!({
            "destination": dest, "type": "bind", "source": src,
            "options": ["rbind", "rprivate", "ro"],
        })
    };
    // /dev on a tmpfs of its own, as in the sandbox spec: the runtime sets up device nodes and
    // the ptmx link there, not in the shared infra rootfs (concurrent probes would collide).
    let mut mounts = vec![
        serde_json::json!({"destination": "/proc", "type": "proc", "source": "proc"}),
        serde_json::json!({
            "destination": "/dev", "type": "tmpfs", "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
        }),
        bind(Path::new(crate::pause::INFRA_BINARY), &env.infra.binary),
    ];
    mounts.extend(env.infra.lib_dirs.iter().map(|d| bind(d, d)));
    let spec = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {
            "args": [crate::pause::INFRA_BINARY, "pause"],
            "cwd": "/",
            "env": ["PATH=/"],
            "user": {"uid": 0, "gid": 0},
        },
        "root": {"path": env.infra.rootfs, "readonly": true},
        "hostname": "probe",
        "mounts": mounts,
        "linux": {
            "cgroupsPath": cgroups,
            "namespaces": [
                {"type": "pid"}, {"type": "mount"}, {"type": "ipc"}, {"type": "uts"},
                {"type": "network"},
            ],
        },
    });
    Ok(spec.to_string())
}

/// `binary` as the runtime command would find it: a path as is, a bare name on PATH.
fn which(binary: &Path) -> Option<PathBuf> {
    if binary.components().count() > 1 {
        return binary.is_file().then(|| binary.to_path_buf());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(binary))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_from_runc_and_crun() {
        let runc = b"time=\"2026-11-21T10:49:26Z\" level=error msg=\"container does not exist\"\n";
        assert_eq!(runtime_message(runc), "container does not exist");
        assert!(classify("runc", "state", "x", runtime_message(runc)).is_not_found());
        let crun = b"error opening file `/tmp/rt/nope/status`: No such file or directory\n";
        assert!(classify("crun", "state", "nope", runtime_message(crun)).is_not_found());
        // A missing file of the container's own is the container's business, not a missing
        // container.
        let exec = "exec failed: unable to start container process: exec: \"/app/status.sh\": \
                    stat /app/status.sh: no such file or directory";
        assert!(!classify("runc", "exec", "x", exec.into()).is_not_found());
        let other = classify(
            "runc",
            "start",
            "x",
            "cannot start an already running container".into(),
        );
        assert!(
            other.to_string().contains("runc start x: cannot start"),
            "{other}"
        );
    }

    #[test]
    fn mount_options_from_features() {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("fake-runc");
        crate::fsutil::write_executable(
            &fake,
            "#!/bin/sh\n[ \"$1\" = features ] || exit 1\necho '{\"mountOptions\": [\"ro\", \"rro\"]}'\n",
        );
        let r = Runc::new(&fake, dir.path().join("root"));
        assert!(r.supports_mount_option("rro"));
        assert!(!r.supports_mount_option("ridmap"));
        let old = Runc::new("/bin/false", dir.path().join("root"));
        assert!(!old.supports_mount_option("rro"));
        let missing = Runc::new(dir.path().join("nope"), dir.path().join("root"));
        assert!(!missing.supports_mount_option("rro"));
    }

    #[test]
    fn argv() {
        let mut r = Runc::new("/usr/bin/runc", "/run/minicri/runc");
        r.systemd_cgroup = true;
        let a = r.create_args(
            "c1",
            Path::new("/b"),
            Path::new("/b/init.pid"),
            Path::new("/b/log.json"),
            None,
        );
        let a: Vec<String> = a.into_iter().map(|s| s.into_string().unwrap()).collect();
        assert_eq!(
            a.join(" "),
            "--root /run/minicri/runc --systemd-cgroup --log /b/log.json --log-format json \
             create --bundle /b --pid-file /b/init.pid c1"
        );
        let tty = r.create_args(
            "c1",
            Path::new("/b"),
            Path::new("/b/init.pid"),
            Path::new("/b/log.json"),
            Some(Path::new("/b/pty.sock")),
        );
        assert!(
            tty.windows(3)
                .any(|w| w[0] == "--console-socket" && w[1] == "/b/pty.sock" && w[2] == "c1"),
            "{tty:?}"
        );
        assert_eq!(r.scratch_dir(), PathBuf::from("/run/minicri/runc.tmp"));
        let restore = r.restore_args(
            "c1",
            Path::new("/b"),
            Path::new("/b/init.pid"),
            Path::new("/b/log.json"),
            None,
            Path::new("/c/checkpoint"),
        );
        let restore: Vec<String> = restore
            .into_iter()
            .map(|s| s.into_string().unwrap())
            .collect();
        assert_eq!(
            restore.join(" "),
            "--root /run/minicri/runc --systemd-cgroup --log /b/log.json --log-format json \
             restore --detach --image-path /c/checkpoint --work-path /b --bundle /b \
             --pid-file /b/init.pid c1"
        );
    }

    /// An exec whose runtime cannot even be spawned leaves none of its files (process.json
    /// holds the container's environment) behind.
    #[tokio::test]
    async fn a_failed_exec_leaves_no_scratch_files() {
        let dir = tempfile::tempdir().unwrap();
        let r = Runc::new(dir.path().join("no-such-runtime"), dir.path().join("root"));
        let opts = || ExecOpts {
            id: "c1".into(),
            process: Process::default(),
            stdin: None,
            timeout: Some(Duration::from_secs(5)),
        };
        assert!(r.exec(opts()).await.is_err());
        assert!(r.exec_spawn(opts()).await.is_err());
        assert!(r.exec_detached("c1", Process::default()).await.is_err());
        let left: Vec<_> = std::fs::read_dir(r.scratch_dir())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn runtime_log_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("log.json");
        std::fs::write(&p, "{\"level\":\"info\",\"msg\":\"x\"}\n{\"level\":\"error\",\"msg\":\"exec failed: no such file\"}\n").unwrap();
        assert_eq!(
            read_runtime_log(&p).as_deref(),
            Some("exec failed: no such file")
        );
        assert_eq!(read_runtime_log(&dir.path().join("missing")), None);
    }

    #[test]
    fn state_json() {
        let s: OciState = serde_json::from_str(
            r#"{"ociVersion":"1.0.2-dev","id":"t","pid":42,"status":"running","bundle":"/b","rootfs":"/b/rootfs","created":"2026-11-21T10:49:26.1Z","owner":""}"#,
        )
        .unwrap();
        assert_eq!((s.pid, s.status.as_str()), (42, "running"));
    }
}

//! The OCI runtime seam: the [`OciRuntime`] trait and the types of its operations.
//!
//! runc, crun and youki share one command line (`create`, `start`, `state`, `kill`, `delete`,
//! `exec`, `update`, `pause`, `resume`, `list` with the same flags), so one implementation,
//! `Runc` (runc.rs), drives all of them; the binary is configurable. Fakes for tests of
//! the services implement the trait.
//!
//! Container *creation* for CRI containers and sandboxes is done by the shim (the
//! `shim` module), which owns the container's stdio and must be the process that reaps it; it
//! uses `Runc::create_args` so both paths build the same command line.
//! [`OciRuntime::create`] is for callers that do not need a monitor.
//!
//! Pods hold their runtime as `Arc<dyn OciRuntime>` in their runtime handler; the
//! pod service's unit tests put a recording fake there.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use futures::future::BoxFuture;
use oci_spec::runtime::{LinuxResources, Process};
use serde::{Deserialize, Serialize};

use super::error::{OciError, Result};
use super::host::CgroupDriver;
use crate::pause::InfraRootfs;

/// A running exec with piped stdio: the runtime's process (`runc exec` stays the parent of the
/// process in the container and relays its status) and how its end is judged.
pub struct ExecProcess {
    pub child: tokio::process::Child,
    pid_file: Option<PathBuf>,
    /// The exec's exit code, or the runtime's own failure, from the runtime process's exit
    /// status. Owns the exec's scratch files, so dropping it (waited or not) removes them.
    finish: Box<dyn FnOnce(std::process::ExitStatus) -> Result<i32> + Send>,
}

impl ExecProcess {
    pub fn new(
        child: tokio::process::Child,
        pid_file: Option<PathBuf>,
        finish: impl FnOnce(std::process::ExitStatus) -> Result<i32> + Send + 'static,
    ) -> ExecProcess {
        ExecProcess {
            child,
            pid_file,
            finish: Box::new(finish),
        }
    }

    /// The `--pid-file` where the runtime writes the host pid of the process in the container
    /// once it runs (killing `runc exec` itself would leave that process running). Removed by
    /// [`ExecProcess::wait`].
    pub fn pid_file(&self) -> Option<PathBuf> {
        self.pid_file.clone()
    }

    /// Waits for the process and returns its exit code; a failure of the runtime itself (e.g.
    /// the executable is missing) is an error.
    pub async fn wait(mut self) -> Result<i32> {
        let status = self
            .child
            .wait()
            .await
            .map_err(|e| OciError::io("wait for", "the runtime's exec", e))?;
        (self.finish)(status)
    }
}

/// What the availability probe needs from the daemon.
#[derive(Debug, Clone)]
pub struct ProbeEnv {
    /// Where each handler's throwaway bundle and runtime root go (`<dir>/<name>/`).
    pub dir: PathBuf,
    pub infra: InfraRootfs,
    pub cgroup_driver: CgroupDriver,
    /// How long one probe may take (the handlers' `PROBE_TIMEOUT`); a runtime still
    /// running then is killed.
    pub timeout: Duration,
}

/// How another process (the shim) runs the runtime: the binary and its global flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeCommand {
    pub binary: PathBuf,
    /// `--root`: the runtime's state directory.
    pub root: PathBuf,
    /// `--systemd-cgroup`.
    pub systemd_cgroup: bool,
}

/// What `runc state` / `runc list` report for one container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OciState {
    #[serde(default, rename = "ociVersion")]
    pub oci_version: String,
    pub id: String,
    /// `creating`, `created`, `running`, `paused` or `stopped`.
    pub status: String,
    /// The container's init process on the host; 0 once stopped.
    #[serde(default)]
    pub pid: i32,
    #[serde(default)]
    pub bundle: PathBuf,
    #[serde(default)]
    pub rootfs: PathBuf,
    /// RFC 3339 creation time (runc and crun report it; not part of the OCI state).
    #[serde(default)]
    pub created: Option<String>,
    #[serde(default)]
    pub annotations: Option<std::collections::HashMap<String, String>>,
}

/// How [`OciRuntime::create`] wires the container's stdio (runc passes its own stdio through to
/// the container when no terminal is requested).
#[derive(Debug, Default)]
pub enum CreateIo {
    /// All three on `/dev/null`.
    #[default]
    Null,
    /// These files (any of them `None` means `/dev/null`).
    Files {
        stdin: Option<std::fs::File>,
        stdout: Option<std::fs::File>,
        stderr: Option<std::fs::File>,
    },
}

#[derive(Debug)]
pub struct CreateOpts {
    pub id: String,
    pub bundle: PathBuf,
    pub pid_file: PathBuf,
    pub io: CreateIo,
}

/// One process to run in a running container.
#[derive(Debug, Clone)]
pub struct ExecOpts {
    pub id: String,
    pub process: Process,
    /// Bytes written to the process's stdin, which is then closed (`None`: `/dev/null`).
    pub stdin: Option<Vec<u8>>,
    /// Kill the process (SIGKILL) when it runs longer ([`ExecOutput::timed_out`] is then set).
    pub timeout: Option<Duration>,
}

/// Result of a captured exec.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecOutput {
    /// The process's exit code; 128 + signal when it was killed by a signal.
    pub exit_code: i32,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub timed_out: bool,
}

/// The OCI runtime operations minicri needs. Object safe: hold it as `Arc<dyn OciRuntime>`.
pub trait OciRuntime: Send + Sync {
    /// `create --bundle B --pid-file P ID`: the container exists, its init waits for `start`.
    fn create<'a>(&'a self, opts: CreateOpts) -> BoxFuture<'a, Result<()>>;
    /// `start ID`: runs the user process of a created container.
    fn start<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<()>>;
    fn state<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<OciState>>;
    /// `kill [--all] ID SIGNAL`. When the init dies, the kernel kills the rest of a container
    /// only if it has its own PID namespace; in the pod's shared PID namespace the other
    /// processes survive it, so stop such containers' stragglers with `all` (SIGKILL).
    fn kill<'a>(&'a self, id: &'a str, signal: i32, all: bool) -> BoxFuture<'a, Result<()>>;
    /// `delete [--force] ID`; a container that does not exist is not an error with `force`.
    fn delete<'a>(&'a self, id: &'a str, force: bool) -> BoxFuture<'a, Result<()>>;
    /// `exec --process process.json ID`, output captured.
    fn exec<'a>(&'a self, opts: ExecOpts) -> BoxFuture<'a, Result<ExecOutput>>;
    /// `exec` with stdin, stdout and stderr as pipes, for streaming.
    fn exec_spawn<'a>(&'a self, opts: ExecOpts) -> BoxFuture<'a, Result<ExecProcess>>;
    /// `exec --detach`: returns the host pid of the started process.
    fn exec_detached<'a>(&'a self, id: &'a str, process: Process) -> BoxFuture<'a, Result<i32>>;
    /// `update --resources FILE ID`.
    fn update<'a>(
        &'a self,
        id: &'a str,
        resources: &'a LinuxResources,
    ) -> BoxFuture<'a, Result<()>>;
    fn pause<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<()>>;
    /// `checkpoint --leave-running --image-path IMAGES --work-path WORK ID`: CRIU dumps the
    /// running container into `images` (its log, `dump.log`, into `work`); the container goes
    /// on running. A call dropped (its deadline passed) kills the runtime, and CRIU with it,
    /// which lets the container go on.
    fn checkpoint<'a>(
        &'a self,
        id: &'a str,
        images: &'a std::path::Path,
        work: &'a std::path::Path,
    ) -> BoxFuture<'a, Result<()>>;
    fn resume<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<()>>;
    /// `list --format json`: every container under the root.
    fn list(&self) -> BoxFuture<'_, Result<Vec<OciState>>>;
    /// `exec` in the foreground with the given stdio (a pty's slave side for a terminal).
    fn exec_spawn_stdio(
        &self,
        opts: ExecOpts,
        stdin: Stdio,
        stdout: Stdio,
        stderr: Stdio,
    ) -> Result<ExecProcess>;
    /// How the shim runs this runtime to create a container under its monitor (also what logs
    /// and inspection name it by).
    fn command(&self) -> RuntimeCommand;
    /// Whether the runtime works on this host (`Err` says why not), found out by creating and
    /// deleting a throwaway container as the handlers module describes.
    fn check_available<'a>(
        &'a self,
        name: &'a str,
        env: &'a ProbeEnv,
    ) -> BoxFuture<'a, std::result::Result<(), String>>;
}

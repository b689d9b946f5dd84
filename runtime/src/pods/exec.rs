//! Streaming's side of the pod service: the checks the Exec, Attach and PortForward RPCs make
//! before they hand out a URL (the target container, the sandbox's network namespace), and the
//! exec process started when the client connects.
//!
//! The process gets the container's process settings from its bundle's `config.json` (user,
//! groups, environment, working directory, capabilities, no_new_privileges, AppArmor/SELinux
//! labels), as ExecSync does, with the request's `cmd`; `runc exec` stays its parent, with the
//! process's stdio on pipes, or with a terminal: `runc exec` gets the slave side of a pty made
//! here as its stdio and relays it to the container's own pty (runc's foreground terminal
//! mode); the caller keeps the master side.

use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use minicri_proto::runtime::v1 as cri;

use super::PodService;
use super::store::{ContainerRecord, ContainerState};
use crate::error::{Error, Result};
use crate::oci::{ExecOpts, ExecProcess};

/// The process settings (user, env, cwd, capabilities) in container `id`'s bundle: the base
/// of each of its execs. The file holds the image's env and can be megabytes, and exec probes
/// run every few seconds: read off the async workers.
pub(crate) fn bundle_process(
    id: &str,
    bundle: &std::path::Path,
) -> Result<oci_spec::runtime::Process> {
    let spec = minicri_store::fsutil::off_async(|| {
        oci_spec::runtime::Spec::load(bundle.join("config.json"))
    })
    .map_err(|e| Error::Internal(format!("reading the spec of {id}: {e}")))?;
    Ok(spec.process().clone().unwrap_or_default())
}

/// Most bytes of an exec's command line, its arguments with their terminating NULs: the kernel
/// takes about 2 MiB at most for a process's arguments and environment together, and until it
/// runs, a streaming exec's command waits with its token (up to a minute, a thousand at once:
/// 256 MiB at most).
pub const MAX_EXEC_CMD_BYTES: usize = 256 << 10;

/// Checks the command of an Exec or ExecSync request: present, at most [`MAX_EXEC_CMD_BYTES`],
/// no NUL byte (the OCI runtime would refuse it, as an internal error).
pub fn check_cmd(cmd: &[String]) -> Result<()> {
    if cmd.is_empty() {
        return Err(Error::InvalidArgument("cmd is required".into()));
    }
    let bytes: usize = cmd.iter().map(|a| a.len() + 1).sum();
    if bytes > MAX_EXEC_CMD_BYTES {
        return Err(Error::InvalidArgument(format!(
            "cmd is {bytes} bytes long, more than the {MAX_EXEC_CMD_BYTES} an exec may have"
        )));
    }
    if let Some(i) = cmd.iter().position(|a| a.contains('\0')) {
        return Err(Error::InvalidArgument(format!("cmd[{i}] holds a NUL byte")));
    }
    Ok(())
}

impl PodService {
    /// The container `id` if it exists and is running: NOT_FOUND or FAILED_PRECONDITION naming
    /// it otherwise.
    pub fn exec_target(&self, id: &str) -> Result<ContainerRecord> {
        let r = self.container_record(id)?;
        if r.state != ContainerState::Running {
            return Err(Error::FailedPrecondition(format!(
                "container {id} is not running (state {:?})",
                r.state
            )));
        }
        Ok(r)
    }

    /// The network namespace a port forward into the sandbox `id` enters: its pinned namespace,
    /// else its infra process's; `None` for a host-network pod (the host's). NOT_FOUND or
    /// FAILED_PRECONDITION naming the sandbox when it is missing, not ready or has none.
    pub fn port_forward_netns(&self, id: &str) -> Result<Option<PathBuf>> {
        let sb = self.ready_sandbox(id)?;
        let host_network = crate::spec::namespaces::namespace_options(&sb.config())
            .is_some_and(|o| o.network == cri::NamespaceMode::Node as i32);
        match (&sb.netns, host_network) {
            (Some(p), _) => Ok(Some(p.clone())),
            (None, true) => Ok(None),
            (None, false) if sb.infra_pid > 0 => {
                Ok(Some(format!("/proc/{}/ns/net", sb.infra_pid).into()))
            }
            (None, false) => Err(Error::FailedPrecondition(format!(
                "pod sandbox {id} has no network namespace"
            ))),
        }
    }

    /// The process of an exec of `cmd` in the running container `id`.
    fn exec_process(
        &self,
        id: &str,
        cmd: Vec<String>,
        terminal: bool,
    ) -> Result<oci_spec::runtime::Process> {
        let r = self.exec_target(id)?;
        check_cmd(&cmd)?;
        let mut process = bundle_process(id, &r.bundle)?;
        process.set_args(Some(cmd));
        process.set_terminal(Some(terminal));
        if terminal {
            let mut env = process.env().clone().unwrap_or_default();
            crate::spec::container::with_term(&mut env);
            process.set_env(Some(env));
        }
        Ok(process)
    }

    /// Starts `cmd` in the running container `id` with piped stdin, stdout and stderr.
    pub async fn exec_streaming(&self, id: &str, cmd: Vec<String>) -> Result<ExecProcess> {
        let process = self.exec_process(id, cmd, false)?;
        Ok(self
            .container_runtime(id)?
            .exec_spawn(ExecOpts {
                id: id.to_string(),
                process,
                stdin: None,
                timeout: None,
            })
            .await?)
    }

    /// Starts `cmd` in the running container `id` with a terminal; returns the process and the
    /// master side of the pty `runc exec` relays to the container's terminal.
    pub async fn exec_streaming_tty(
        &self,
        id: &str,
        cmd: Vec<String>,
    ) -> Result<(ExecProcess, OwnedFd)> {
        let process = self.exec_process(id, cmd, true)?;
        let pty = nix::pty::openpty(None, None)
            .map_err(|e| Error::Internal(format!("opening a pty: {e}")))?;
        // Raw from the start: `runc exec` makes its terminal raw itself, but only once it runs.
        // Input that arrived before, in canonical mode, is cooked on the way: a client's end of
        // input (^D) was stored as a NUL byte and reached the container's terminal as a typed
        // NUL (echoed "^@") instead of the end of input.
        let mut raw = nix::sys::termios::tcgetattr(&pty.slave)
            .map_err(|e| Error::Internal(format!("pty: {e}")))?;
        nix::sys::termios::cfmakeraw(&mut raw);
        nix::sys::termios::tcsetattr(&pty.slave, nix::sys::termios::SetArg::TCSANOW, &raw)
            .map_err(|e| Error::Internal(format!("pty: {e}")))?;
        for fd in [&pty.master, &pty.slave] {
            // No other child the daemon starts may keep the slave open (the master would never
            // see the end) or get the master.
            nix::fcntl::fcntl(
                fd,
                nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
            )
            .map_err(|e| Error::Internal(format!("pty: {e}")))?;
        }
        let dup = |fd: &OwnedFd| {
            fd.try_clone()
                .map_err(|e| Error::Internal(format!("pty: {e}")))
        };
        let (stdin, stdout) = (dup(&pty.slave)?, dup(&pty.slave)?);
        // The slave copies go with the command: only the runtime holds them once it started.
        let p = self.container_runtime(id)?.exec_spawn_stdio(
            ExecOpts {
                id: id.to_string(),
                process,
                stdin: None,
                timeout: None,
            },
            Stdio::from(stdin),
            Stdio::from(stdout),
            Stdio::from(pty.slave),
        )?;
        Ok((p, pty.master))
    }
}

impl PodService {
    /// ExecSync: runs `cmd` in the container with its process settings (user, env, cwd),
    /// output captured; killed after `timeout` seconds (0: no limit).
    pub async fn exec_sync(
        &self,
        id: &str,
        cmd: Vec<String>,
        timeout: i64,
    ) -> Result<cri::ExecSyncResponse> {
        let r = self.running(id)?;
        super::exec::check_cmd(&cmd)?;
        let mut process = super::exec::bundle_process(id, &r.bundle)?;
        process.set_args(Some(cmd));
        process.set_terminal(Some(false));
        let out = self
            .runtime(&r.runtime_handler)?
            .exec(ExecOpts {
                id: id.to_string(),
                process,
                stdin: None,
                timeout: (timeout > 0).then(|| Duration::from_secs(timeout as u64)),
            })
            .await?;
        if out.timed_out {
            return Err(Error::DeadlineExceeded(format!(
                "command in container {id} timed out after {timeout}s"
            )));
        }
        Ok(cri::ExecSyncResponse {
            stdout: out.stdout,
            stderr: out.stderr,
            exit_code: out.exit_code,
        })
    }
}

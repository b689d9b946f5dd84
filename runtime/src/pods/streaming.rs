//! The pod service as the streaming server's [`ExecBackend`]: exec processes started in a
//! container through the OCI runtime (on a terminal when asked: its master becomes the
//! session's stdin and stdout, and resizes reach the runtime as SIGWINCH), and attach sessions
//! served by the container's shim. `crate::stream` knows only the trait.

use futures::future::BoxFuture;

use super::PodService;
use crate::stream::attach::from_shim;
use crate::stream::backend::{Attached, BoxRead, BoxWrite, ExecBackend, Resize, Spawned};
use crate::stream::remotecommand::{Failure, FailureKind};

/// How often (every 20 ms) a kill looks for the pid file of an exec's process.
const KILL_PID_POLLS: usize = 250;

impl ExecBackend for PodService {
    fn spawn<'a>(
        &'a self,
        container_id: &'a str,
        cmd: Vec<String>,
        tty: bool,
    ) -> BoxFuture<'a, Result<Spawned, Failure>> {
        Box::pin(async move {
            let (p, stdin, stdout, stderr, resize) = if tty {
                let (p, master) = self.exec_streaming_tty(container_id, cmd).await?;
                let io = |fd: &std::os::fd::OwnedFd| {
                    fd.try_clone()
                        .and_then(crate::stream::pty::PtyIo::new)
                        .map_err(|e| Failure::internal(format!("pty: {e}")))
                };
                let (w, r) = (io(&master)?, io(&master)?);
                // runc resizes the container's terminal to its own on SIGWINCH.
                let runc = p
                    .child
                    .id()
                    .map(|pid| nix::unistd::Pid::from_raw(pid as i32));
                let resize: Resize = Box::new(move |width, height| {
                    if crate::stream::pty::resize(&master, width, height).is_ok()
                        && let Some(pid) = runc
                    {
                        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGWINCH);
                    }
                });
                (
                    p,
                    Some(Box::pin(w) as BoxWrite),
                    Some(Box::pin(r) as BoxRead),
                    None,
                    Some(resize),
                )
            } else {
                let mut p = self.exec_streaming(container_id, cmd).await?;
                let stdin = p.child.stdin.take().map(|s| Box::pin(s) as BoxWrite);
                let stdout = p.child.stdout.take().map(|s| Box::pin(s) as BoxRead);
                let stderr = p.child.stderr.take().map(|s| Box::pin(s) as BoxRead);
                (p, stdin, stdout, stderr, None)
            };
            let pid_file = p.pid_file();
            let kill = Box::new(move || {
                // runc writes the pid file once the process runs, which may be after the
                // process's first output: a client that hangs up at once must not find it
                // missing. Wait for it a little (it goes when the process has been waited for).
                let Some(pid_file) = pid_file.clone() else {
                    return;
                };
                tokio::spawn(async move {
                    for _ in 0..KILL_PID_POLLS {
                        let pid = std::fs::read_to_string(&pid_file)
                            .ok()
                            .and_then(|s| s.trim().parse::<i32>().ok());
                        if let Some(pid) = pid.filter(|p| *p > 0) {
                            let _ = nix::sys::signal::kill(
                                nix::unistd::Pid::from_raw(pid),
                                nix::sys::signal::Signal::SIGKILL,
                            );
                            return;
                        }
                        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                    }
                });
            });
            let exit = Box::pin(async move { Ok(p.wait().await?) });
            Ok(Spawned {
                stdin,
                stdout,
                stderr,
                exit,
                kill,
                resize,
            })
        })
    }

    fn attach<'a>(
        &'a self,
        container_id: &'a str,
        stdin: bool,
        stdout: bool,
        stderr: bool,
    ) -> BoxFuture<'a, Result<Attached, Failure>> {
        Box::pin(async move {
            let rec = self.exec_target(container_id)?;
            let shim = rec.shim.ok_or_else(|| Failure {
                kind: FailureKind::BadRequest,
                message: format!("container {container_id} has no monitor to attach to"),
            })?;
            let conn = self
                .monitors
                .attach(&shim, stdin, stdout, stderr)
                .await
                .map_err(|e| {
                    Failure::internal(format!("attaching to container {container_id}: {e}"))
                })?;
            Ok(from_shim(conn, stdin, stdout, stderr))
        })
    }
}

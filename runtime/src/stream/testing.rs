//! Test support: an [`ExecBackend`] running local processes, on pipes or on a pty.

use std::os::fd::OwnedFd;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::future::BoxFuture;

use super::backend::{BoxRead, BoxWrite, ExecBackend, Resize, Spawned};
use super::pty::{PtyIo, resize};
use super::remotecommand::Failure;

/// Runs `cmd` on the host; refuses the command `missing`.
pub struct LocalBackend {
    pub killed: Arc<AtomicBool>,
}

impl ExecBackend for LocalBackend {
    fn spawn<'a>(
        &'a self,
        _container_id: &'a str,
        cmd: Vec<String>,
        tty: bool,
    ) -> BoxFuture<'a, Result<Spawned, Failure>> {
        Box::pin(async move {
            if cmd[0] == "missing" {
                return Err(Failure::internal(
                    "exec failed: \"missing\": executable file not found",
                ));
            }
            let mut c = tokio::process::Command::new(&cmd[0]);
            c.args(&cmd[1..]);
            let mut master: Option<OwnedFd> = None;
            if tty {
                let pty =
                    nix::pty::openpty(None, None).map_err(|e| Failure::internal(e.to_string()))?;
                let dup = |f: &OwnedFd| f.try_clone().unwrap();
                c.stdin(Stdio::from(dup(&pty.slave)))
                    .stdout(Stdio::from(dup(&pty.slave)))
                    .stderr(Stdio::from(pty.slave));
                master = Some(pty.master);
            } else {
                c.stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped());
            }
            let mut child = c.spawn().map_err(|e| Failure::internal(e.to_string()))?;
            // The command holds the slave copies; they must close for the master to see EOF.
            drop(c);
            let pid = child.id().unwrap() as i32;
            let killed = self.killed.clone();
            let (stdin, stdout, stderr, resize_fn) = match master {
                Some(m) => {
                    let w = PtyIo::new(m.try_clone().unwrap()).unwrap();
                    let r = PtyIo::new(m.try_clone().unwrap()).unwrap();
                    let f: Resize = Box::new(move |w, h| {
                        let _ = resize(&m, w, h);
                    });
                    (
                        Some(Box::pin(w) as BoxWrite),
                        Some(Box::pin(r) as BoxRead),
                        None,
                        Some(f),
                    )
                }
                None => (
                    child.stdin.take().map(|s| Box::pin(s) as BoxWrite),
                    child.stdout.take().map(|s| Box::pin(s) as BoxRead),
                    child.stderr.take().map(|s| Box::pin(s) as BoxRead),
                    None,
                ),
            };
            Ok(Spawned {
                stdin,
                stdout,
                stderr,
                exit: Box::pin(async move {
                    use std::os::unix::process::ExitStatusExt;
                    let s = child
                        .wait()
                        .await
                        .map_err(|e| Failure::internal(e.to_string()))?;
                    Ok(s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0)))
                }),
                kill: Box::new(move || {
                    killed.store(true, Ordering::SeqCst);
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }),
                resize: resize_fn,
            })
        })
    }
}

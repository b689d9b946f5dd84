//! The seam between the streaming sessions and whatever runs the processes: [`ExecBackend`]
//! (the pod service in the daemon, `crate::pods::streaming`; a local process in unit tests),
//! what it hands back ([`Spawned`] for exec, [`Attached`] for attach), and the boxed stdio and
//! resize types both sessions copy between ([`BoxRead`], [`BoxWrite`], [`Resize`]).
//!
//! A leaf: it imports no session module, so exec, attach and the session code that shares
//! these types do not import one another for them.

use std::pin::Pin;

use futures::future::BoxFuture;
use tokio::io::{AsyncRead, AsyncWrite};

use super::remotecommand::{Failure, FailureKind};

pub type BoxRead = Pin<Box<dyn AsyncRead + Send>>;
pub type BoxWrite = Pin<Box<dyn AsyncWrite + Send>>;

/// Resizes a process's terminal to (width, height).
pub type Resize = Box<dyn Fn(u16, u16) + Send + Sync>;

/// A started process.
pub struct Spawned {
    pub stdin: Option<BoxWrite>,
    pub stdout: Option<BoxRead>,
    pub stderr: Option<BoxRead>,
    /// Resolves to the exit code (128 + signal when killed), or why the process could not run.
    pub exit: BoxFuture<'static, Result<i32, Failure>>,
    /// SIGKILLs the process (best effort).
    pub kill: Box<dyn Fn() + Send + Sync>,
    /// With a terminal: resizes it.
    pub resize: Option<Resize>,
}

/// Starts processes in containers: the seam between the streaming server and the pod service.
pub trait ExecBackend: Send + Sync + 'static {
    /// Starts `cmd` in the container; with `tty`, on a terminal whose output is `stdout`.
    fn spawn<'a>(
        &'a self,
        container_id: &'a str,
        cmd: Vec<String>,
        tty: bool,
    ) -> BoxFuture<'a, Result<Spawned, Failure>>;

    /// Attaches to the running container's own stdio (CRI `Attach`, [`super::attach`]), for
    /// the streams asked for. The default refuses.
    fn attach<'a>(
        &'a self,
        container_id: &'a str,
        _stdin: bool,
        _stdout: bool,
        _stderr: bool,
    ) -> BoxFuture<'a, Result<Attached, Failure>> {
        Box::pin(async move {
            Err(Failure {
                kind: FailureKind::BadRequest,
                message: format!("cannot attach to {container_id} here"),
            })
        })
    }
}

/// A session attached to a container's stdio. Dropping it detaches.
pub struct Attached {
    /// The container's stdin (when asked for); shutting it down ends this session's input.
    pub stdin: Option<BoxWrite>,
    /// The container's stdout and stderr from now on (when asked for); EOF when they end.
    pub stdout: Option<BoxRead>,
    pub stderr: Option<BoxRead>,
    /// Resizes the container's terminal (tty containers; a no-op for others).
    pub resize: Option<Resize>,
    /// Resolves when the container's output has ended (it exited, or its shim is gone).
    pub ended: BoxFuture<'static, ()>,
}

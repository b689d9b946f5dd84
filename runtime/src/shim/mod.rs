//! The per-container monitor (`minicri shim`): creates a container through the OCI runtime,
//! owns its stdio, writes its CRI log, records its exit, and outlives the daemon.
//!
//! # Lifecycle
//! 1. The daemon writes `<bundle>/config.json` and calls [`spawn_shim`]. That runs
//!    `minicri shim --id ID --bundle DIR --runtime BIN --runtime-root DIR [--systemd-cgroup]
//!    [--log-path FILE --log-dir DIR] [--stdin [--stdin-once]] [--tty] --ready-fd 3` with stdout/stderr on `<bundle>/shim.log` and a pipe as
//!    fd 3. The shim forks at once (its first process exits, so the daemon keeps no zombie),
//!    starts a new session, closes every inherited descriptor but stdio and fd 3, and becomes a
//!    child subreaper. Reparented to init, it survives the daemon being killed or restarted.
//! 2. The shim runs `<runtime> --root DIR --log <bundle>/runtime-log.json --log-format json
//!    create --bundle DIR --pid-file <bundle>/init.pid ID` with stdin on `/dev/null` (a pipe with
//!    `--stdin`, see below) and two pipes as stdout and stderr (runc passes them to the
//!    container). With `--tty` it adds `--console-socket <bundle>/pty.sock` instead of the
//!    pipes: the runtime makes the container's pty and sends the master there
//!    ([`console`]); the shim keeps it. Then it writes one JSON line on fd 3: `{"ok":true,"shim_pid":N,"init_pid":M}`
//!    or `{"ok":false,"error":"..."}`
//!    (the runtime's own error message), and closes it.
//! 3. The daemon starts the container itself with `runtime start ID`
//!    ([`crate::oci::OciRuntime::start`]); likewise kill, exec, update and delete go straight
//!    to the runtime. The shim only monitors.
//! 4. The shim copies both pipes (or the pty master, as stream `stdout`) into the CRI log
//!    ([`crate::logs`]) until EOF, reaps every child
//!    (one `waitpid(-1)` loop on its main thread, nothing else waits), and when the init exits:
//!    waits up to 2 s for the pipes to drain, writes `<bundle>/exit.json` by atomic rename,
//!    answers waiting clients, removes its socket and exits.
//!
//! # Bundle directory layout ([`ShimPaths`])
//! `config.json` (daemon), `init.pid` (runtime), `shim.pid`, `shim.sock`, `shim.log`,
//! `runtime-log.json`, `exit.json`, `pty.sock` (shim, while a tty container is created). The socket path must fit in 107 bytes.
//!
//! # Control socket (`<bundle>/shim.sock`)
//! One request per connection, one JSON line each way:
//! - `{"op":"state"}` → `{"status":"state","shim_pid":N,"init_pid":M,"exited":null|EXIT}`
//! - `{"op":"reopen_log"}` → `{"status":"ok"}` or `{"status":"error","message":"..."}`
//! - `{"op":"wait"}` → `{"status":"exited","exit":EXIT}` once the init has exited
//! - `{"op":"attach","stdin":B,"stdout":B,"stderr":B}` → `{"status":"attached"}`, then binary
//!   frames both ways (`[kind u8][len u32 BE][bytes]`, [`protocol::Frame`]): the container's
//!   stdout (1) / stderr (2) as the shim reads them (after writing them to the log; a session
//!   more than 1024 chunks behind is cut off), stdin (0), the end of the session's stdin (3)
//!   and terminal resizes (4: width, height as u16 BE; tty containers) from the daemon
//!   ([`attach`]). The daemon half-closing the connection detaches; the shim closes it when
//!   the container's output ends. With `--stdin` (CRI `stdin`) the container's stdin is a pipe
//!   the shim keeps open across sessions (else `/dev/null`, and stdin attach is refused); with
//!   `--stdin-once` it is closed when the first session with stdin ends. A tty container's
//!   input is its pty master (the end of a `--stdin-once` session's input is ^D there).
//!
//! where `EXIT` is the content of `exit.json`:
//! `{"pid":M,"exit_code":3,"signal":null,"exited_at":"<RFC3339Nano>","exited_at_ns":N,"oom_killed":false}`
//! (`exit_code` is 128 + signal for a killed process; `oom_killed` from the cgroup v2 OOM count
//! the shim watches while the container runs, [`oom`]). SIGUSR1 to the shim also reopens the
//! log. Once the shim is gone, `exit.json` is the record; a shim gone without one was killed.

/// A line to the shim's own log (its stderr, a file in the state directory). Unlike `eprintln!`,
/// a log that cannot be written (a full `/run`) loses the line instead of panicking the thread,
/// which may hold a lock the container's output needs.
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

pub mod attach;
pub mod client;
pub mod console;
mod control;
pub mod monitor;
mod oom;
mod output;
pub mod protocol;

pub use client::{
    LogTarget, ShimAttach, ShimConfig, ShimHandle, Shims, spawn_shim, spawn_shim_blocking,
};
pub use monitor::{ShimArgs, main};
pub use protocol::{ExitRecord, Request, Response, ShimPaths, read_exit_file};

use futures::future::BoxFuture;

use crate::oci::Result;

/// The container monitors, as the pod service uses them: one is started for each container
/// (it runs the runtime's `create`), then waited on, asked to reopen the log or attach, and
/// killed once its container is gone. A [`ShimHandle`] is the monitor's persistent address.
/// [`Shims`] runs `minicri shim` processes; the pod service's unit tests put a fake here.
pub trait Monitors: Send + Sync {
    /// Starts a monitor that creates the container of a written bundle.
    fn spawn(&self, cfg: ShimConfig) -> BoxFuture<'_, Result<ShimHandle>>;
    /// Finds the monitor of a bundle again (an undo step after a crash).
    fn load(&self, id: &str, bundle: &std::path::Path) -> Result<ShimHandle>;
    fn is_alive(&self, shim: &ShimHandle) -> bool;
    /// The container's exit status, once the monitor has recorded it.
    fn exit_record(&self, shim: &ShimHandle) -> Result<Option<ExitRecord>>;
    /// Waits for the container's exit (its output logged).
    fn wait<'a>(&'a self, shim: &'a ShimHandle) -> BoxFuture<'a, Result<ExitRecord>>;
    fn reopen_log<'a>(&'a self, shim: &'a ShimHandle) -> BoxFuture<'a, Result<()>>;
    fn attach<'a>(
        &'a self,
        shim: &'a ShimHandle,
        stdin: bool,
        stdout: bool,
        stderr: bool,
    ) -> BoxFuture<'a, Result<ShimAttach>>;
    /// Kills the monitor and a `create` it still runs.
    fn kill_group(&self, shim: &ShimHandle);
    /// Kills the monitor (not the container).
    fn kill_shim(&self, shim: &ShimHandle);
}

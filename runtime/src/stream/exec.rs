//! One exec session: the remotecommand protocol on an upgraded connection, from the client's
//! streams to the exit status.
//!
//! 1. Wait (up to 30 s, as the kubelet does) until the client has opened the streams the
//!    request announced: `error`, and `stdin` / `stdout` / `stderr` as asked. A stream of an
//!    unknown or repeated type is refused (RST_STREAM REFUSED_STREAM).
//! 2. Start the process through an [`ExecBackend`] (the pod service in the daemon; a local
//!    process in unit tests), with a terminal when the request asks for one.
//! 3. Copy stdin from its stream to the process (the client's FIN closes the process's stdin, or
//!    sends ^D to a terminal; no stdin stream: closed at once) and stdout / stderr to theirs as
//!    DATA frames; output nobody asked for is read and dropped so the process never blocks on a
//!    full pipe. With a terminal there is one output (stdout) and the `resize` stream's
//!    `{"Width":W,"Height":H}` messages (one JSON object per line) resize it.
//! 4. When the process exits, give its output 2 s to drain (a background child may hold the
//!    pipes open), half-close the output streams, write the outcome on the error stream
//!    ([`super::remotecommand::error_stream_payload`]) and half-close it and the others.
//! 5. Wait up to 5 s for the client to hang up, then close the connection.
//!
//! A client that hangs up (or breaks the connection) before the process ends gets the process
//! SIGKILLed: nobody is left to read its output.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

use super::remotecommand::{
    Outcome, Protocol, STREAM_TYPE_HEADER, StreamType, error_stream_payload,
};
use super::spdy::conn::{self, Event, IncomingStream, MAX_DATA_CHUNK, StreamWriter};
use super::spdy::rst;

/// How long the client has to open its streams after the upgrade.
pub const STREAM_CREATION_TIMEOUT: Duration = Duration::from_secs(30);
/// How long output may keep flowing after the process exited.
pub(super) const DRAIN_GRACE: Duration = Duration::from_secs(2);
/// How long the client gets to close the connection after the last frame.
pub(super) const LINGER: Duration = Duration::from_secs(5);

/// What the Exec RPC accepted, kept under its token until the client connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecRequest {
    pub container_id: String,
    pub cmd: Vec<String>,
    pub tty: bool,
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
}

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
    pub exit: BoxFuture<'static, Result<i32, String>>,
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
    ) -> BoxFuture<'a, Result<Spawned, String>>;

    /// Attaches to the running container's own stdio (CRI `Attach`, [`super::attach`]), for
    /// the streams asked for. The default refuses.
    fn attach<'a>(
        &'a self,
        container_id: &'a str,
        _stdin: bool,
        _stdout: bool,
        _stderr: bool,
    ) -> BoxFuture<'a, Result<super::attach::Attached, String>> {
        Box::pin(async move { Err(format!("cannot attach to {container_id} here")) })
    }
}

impl ExecBackend for crate::pods::PodService {
    fn spawn<'a>(
        &'a self,
        container_id: &'a str,
        cmd: Vec<String>,
        tty: bool,
    ) -> BoxFuture<'a, Result<Spawned, String>> {
        Box::pin(async move {
            let (p, stdin, stdout, stderr, resize) = if tty {
                let (p, master) = self
                    .exec_streaming_tty(container_id, cmd)
                    .await
                    .map_err(|e| e.to_string())?;
                let io = |fd: &std::os::fd::OwnedFd| {
                    fd.try_clone()
                        .and_then(super::pty::PtyIo::new)
                        .map_err(|e| format!("pty: {e}"))
                };
                let (w, r) = (io(&master)?, io(&master)?);
                // runc resizes the container's terminal to its own on SIGWINCH.
                let runc = p
                    .child
                    .id()
                    .map(|pid| nix::unistd::Pid::from_raw(pid as i32));
                let resize: Resize = Box::new(move |width, height| {
                    if super::pty::resize(&master, width, height).is_ok()
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
                let mut p = self
                    .exec_streaming(container_id, cmd)
                    .await
                    .map_err(|e| e.to_string())?;
                let stdin = p.child.stdin.take().map(|s| Box::pin(s) as BoxWrite);
                let stdout = p.child.stdout.take().map(|s| Box::pin(s) as BoxRead);
                let stderr = p.child.stderr.take().map(|s| Box::pin(s) as BoxRead);
                (p, stdin, stdout, stderr, None)
            };
            let pid_file = p.pid_file();
            let kill = Box::new(move || {
                let pid = pid_file
                    .as_ref()
                    .and_then(|f| std::fs::read_to_string(f).ok())
                    .and_then(|s| s.trim().parse::<i32>().ok());
                if let Some(pid) = pid.filter(|p| *p > 0) {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            });
            let exit = Box::pin(async move { p.wait().await.map_err(|e| e.to_string()) });
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
    ) -> BoxFuture<'a, Result<super::attach::Attached, String>> {
        super::attach::pod_attach(self, container_id, stdin, stdout, stderr)
    }
}

/// The client's streams, by type.
#[derive(Default)]
pub(super) struct Channels {
    pub(super) error: Option<IncomingStream>,
    pub(super) stdin: Option<IncomingStream>,
    pub(super) stdout: Option<IncomingStream>,
    pub(super) stderr: Option<IncomingStream>,
    pub(super) resize: Option<IncomingStream>,
}

impl Channels {
    fn slot(&mut self, t: StreamType) -> &mut Option<IncomingStream> {
        match t {
            StreamType::Error => &mut self.error,
            StreamType::Stdin => &mut self.stdin,
            StreamType::Stdout => &mut self.stdout,
            StreamType::Stderr => &mut self.stderr,
            StreamType::Resize => &mut self.resize,
        }
    }

    fn writers(&self) -> impl Iterator<Item = &StreamWriter> {
        [&self.stdin, &self.resize, &self.error]
            .into_iter()
            .flatten()
            .map(|s| &s.writer)
    }
}

/// The streams a client opens for `req` under protocol `p`.
fn expected_streams(req: &ExecRequest, p: Protocol) -> Vec<StreamType> {
    let mut v = vec![StreamType::Error];
    if req.stdin {
        v.push(StreamType::Stdin);
    }
    if req.stdout {
        v.push(StreamType::Stdout);
    }
    if req.stderr && !req.tty {
        v.push(StreamType::Stderr);
    }
    if req.tty && p >= Protocol::V3 {
        v.push(StreamType::Resize);
    }
    v
}

/// Runs one exec session on an upgraded connection.
pub async fn serve<IO>(io: IO, protocol: Protocol, req: ExecRequest, backend: Arc<dyn ExecBackend>)
where
    IO: AsyncRead + AsyncWrite + Send + 'static,
{
    let started = Instant::now();
    let (conn, mut events) = conn::serve(io);
    let mut channels = match collect_streams(&mut events, &req, protocol, STREAM_CREATION_TIMEOUT)
        .await
    {
        Ok(c) => c,
        Err(reason) => {
            tracing::info!(container = %req.container_id, %reason, "exec session ended before it started");
            conn.close().await;
            return;
        }
    };
    let (outcome, client_gone) = run(&req, &mut channels, &mut events, backend.as_ref()).await;
    let ms = format!("{:.1}", started.elapsed().as_secs_f64() * 1e3);
    match &outcome {
        Outcome::Error(e) => {
            tracing::warn!(container = %req.container_id, cmd = ?req.cmd, error = %e, duration_ms = ms, "exec failed")
        }
        o => {
            let code = match o {
                Outcome::ExitCode(c) => *c,
                _ => 0,
            };
            tracing::info!(container = %req.container_id, cmd = ?req.cmd, exit_code = code, client_gone, protocol = protocol.name(), duration_ms = ms, "exec finished")
        }
    }
    if !client_gone {
        finish(&channels, protocol, &outcome, &req.cmd).await;
        let _ = tokio::time::timeout(LINGER, async {
            while let Some(ev) = events.recv().await {
                match ev {
                    Event::Stream(s) => s.writer.reset(rst::REFUSED_STREAM).await,
                    Event::Closed(_) => break,
                }
            }
        })
        .await;
    }
    conn.close().await;
}

/// Waits until the client has opened every stream `req` needs.
async fn collect_streams(
    events: &mut mpsc::Receiver<Event>,
    req: &ExecRequest,
    protocol: Protocol,
    timeout: Duration,
) -> Result<Channels, String> {
    collect(events, expected_streams(req, protocol), timeout).await
}

/// Waits until the client has opened every stream of `expected` (exec and attach alike).
pub(super) async fn collect(
    events: &mut mpsc::Receiver<Event>,
    expected: Vec<StreamType>,
    timeout: Duration,
) -> Result<Channels, String> {
    let mut ch = Channels::default();
    let deadline = tokio::time::sleep(timeout);
    tokio::pin!(deadline);
    while !expected.iter().all(|t| ch.slot(*t).is_some()) {
        tokio::select! {
            _ = &mut deadline => {
                return Err(format!("the client did not open its streams ({expected:?}) within {timeout:?}"));
            }
            ev = events.recv() => match ev {
                Some(Event::Stream(s)) => {
                    let t = s.headers.get(STREAM_TYPE_HEADER).and_then(StreamType::parse);
                    match t {
                        Some(t) if ch.slot(t).is_none() => *ch.slot(t) = Some(s),
                        _ => {
                            tracing::debug!(headers = ?s.headers, "refused an unexpected stream");
                            s.writer.reset(rst::REFUSED_STREAM).await;
                        }
                    }
                }
                Some(Event::Closed(reason)) => return Err(reason),
                None => return Err("the connection ended".into()),
            }
        }
    }
    Ok(ch)
}

/// Starts the process and pumps its stdio until it exits. Returns how it ended and whether the
/// client went away meanwhile.
async fn run(
    req: &ExecRequest,
    ch: &mut Channels,
    events: &mut mpsc::Receiver<Event>,
    backend: &dyn ExecBackend,
) -> (Outcome, bool) {
    let spawned = match backend
        .spawn(&req.container_id, req.cmd.clone(), req.tty)
        .await
    {
        Ok(s) => s,
        Err(m) => return (Outcome::Error(m), false),
    };
    let Spawned {
        stdin,
        stdout,
        stderr,
        mut exit,
        kill,
        resize,
    } = spawned;
    let resize_task = match (ch.resize.as_mut(), resize) {
        (Some(s), Some(f)) => {
            let rx = std::mem::replace(&mut s.data, mpsc::channel(1).1);
            Some(tokio::spawn(apply_resizes(rx, f)))
        }
        _ => None,
    };
    let stdin_task = match (ch.stdin.as_mut(), stdin) {
        (Some(s), Some(w)) => {
            let rx = std::mem::replace(&mut s.data, mpsc::channel(1).1);
            Some(tokio::spawn(copy_in(rx, w)))
        }
        // Dropping the pipe closes the process's stdin.
        _ => None,
    };
    let outputs = [
        (stdout, ch.stdout.as_ref().map(|s| s.writer.clone())),
        (stderr, ch.stderr.as_ref().map(|s| s.writer.clone())),
    ]
    .map(|(r, w)| tokio::spawn(copy_out(r, w)));

    let mut client_gone = false;
    let result = loop {
        tokio::select! {
            r = &mut exit => break r,
            ev = events.recv(), if !client_gone => match ev {
                Some(Event::Stream(s)) => s.writer.reset(rst::REFUSED_STREAM).await,
                Some(Event::Closed(_)) | None => {
                    tracing::info!(container = %req.container_id, "exec client went away: killing the process");
                    client_gone = true;
                    kill();
                }
            },
        }
    };
    let drained_by = tokio::time::Instant::now() + DRAIN_GRACE;
    for mut t in outputs {
        if tokio::time::timeout_at(drained_by, &mut t).await.is_err() {
            tracing::debug!(container = %req.container_id, "exec output still open after the exit: dropped");
            t.abort();
        }
    }
    for t in [stdin_task, resize_task].into_iter().flatten() {
        t.abort();
    }
    let outcome = match result {
        Ok(0) => Outcome::Success,
        Ok(code) => Outcome::ExitCode(code),
        Err(m) => Outcome::Error(m),
    };
    (outcome, client_gone)
}

/// The terminal size messages of the `resize` stream: `{"Width":W,"Height":H}`, one per line.
async fn apply_resizes(mut rx: mpsc::Receiver<Vec<u8>>, resize: Resize) {
    #[derive(serde::Deserialize)]
    struct Size {
        #[serde(rename = "Width")]
        width: u16,
        #[serde(rename = "Height")]
        height: u16,
    }
    let mut buf = Vec::new();
    while let Some(chunk) = rx.recv().await {
        buf.extend_from_slice(&chunk);
        while let Some(end) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=end).collect();
            match serde_json::from_slice::<Size>(&line) {
                Ok(s) => resize(s.width, s.height),
                Err(e) => tracing::debug!(error = %e, "bad terminal size message"),
            }
        }
        if buf.len() > 4096 {
            buf.clear();
        }
    }
}

pub(super) async fn copy_in(mut rx: mpsc::Receiver<Vec<u8>>, mut w: BoxWrite) {
    while let Some(chunk) = rx.recv().await {
        if w.write_all(&chunk).await.is_err() || w.flush().await.is_err() {
            return;
        }
    }
    let _ = w.shutdown().await;
}

/// Copies a pipe to a stream (or to nowhere), then half-closes the stream.
pub(super) async fn copy_out(r: Option<BoxRead>, mut w: Option<StreamWriter>) {
    if let Some(mut r) = r {
        let mut buf = vec![0u8; MAX_DATA_CHUNK];
        loop {
            let n = match r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if let Some(s) = &w
                && s.write(&buf[..n]).await.is_err()
            {
                // Reset by the client: keep draining so the process does not block.
                w = None;
            }
        }
    }
    if let Some(s) = w {
        let _ = s.close().await;
    }
}

/// Closes the output streams, reports the outcome on the error stream, closes the rest.
pub(super) async fn finish(ch: &Channels, protocol: Protocol, outcome: &Outcome, cmd: &[String]) {
    for s in [&ch.stdout, &ch.stderr].into_iter().flatten() {
        // Already closed by the copy unless it was cut short.
        let _ = s.writer.close().await;
    }
    if let Some(e) = &ch.error {
        let payload = error_stream_payload(protocol, outcome, cmd);
        if !payload.is_empty() {
            let _ = e.writer.write(&payload).await;
        }
    }
    for w in ch.writers() {
        let _ = w.close().await;
    }
}

/// Half-closes every stream, reporting nothing on the error stream.
pub(super) async fn close_all(ch: &Channels) {
    for s in [&ch.stdout, &ch.stderr].into_iter().flatten() {
        let _ = s.writer.close().await;
    }
    for w in ch.writers() {
        let _ = w.close().await;
    }
}

#[cfg(test)]
mod tests;

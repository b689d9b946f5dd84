//! One exec session: the remotecommand protocol on an upgraded connection, from the client's
//! streams to the exit status.
//!
//! 1. Get the channels the request announced: `error`, and `stdin` / `stdout` / `stderr` as
//!    asked, `resize` with a terminal ([`super::session`]; over SPDY, wait up to 30 s, as the
//!    kubelet does, until the client has opened them; over WebSocket they are just there).
//! 2. Start the process through an [`ExecBackend`] (the pod service in the daemon,
//!    `crate::pods::streaming`; a local process in unit tests), with a terminal when the request
//!    asks for one.
//! 3. Copy stdin from its stream to the process (the client's FIN closes the process's stdin, or
//!    sends ^D to a terminal; no stdin stream: closed at once) and stdout / stderr to theirs as
//!    data; output nobody asked for is read and dropped so the process never blocks on a
//!    full pipe. With a terminal there is one output (stdout) and the `resize` stream's
//!    `{"Width":W,"Height":H}` messages (one JSON object per line) resize it.
//! 4. When the process exits, give its output 2 s to drain (a background child may hold the
//!    pipes open), end the output channels, write the outcome on the error channel
//!    ([`super::remotecommand::error_stream_payload`]) and end it and the others.
//! 5. Wait up to 5 s for the client to hang up (WebSocket: after a close frame), then close.
//!
//! A client that hangs up (or breaks the connection) before the process ends gets the process
//! SIGKILLed: nobody is left to read its output.

use std::sync::Arc;
use std::time::Instant;

use tokio::io::{AsyncRead, AsyncWrite};

use super::backend::{ExecBackend, Spawned};
use super::remotecommand::{self, Outcome, Protocol, StreamType};
use super::session::{self, Channels, Link, Pumps};

/// What the Exec RPC accepted, kept under its token until the client connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecRequest {
    pub container_id: String,
    /// The container's pod: its sessions share the pod's [`super::MAX_POD_SESSIONS`].
    pub sandbox_id: String,
    pub cmd: Vec<String>,
    pub tty: bool,
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
}

impl ExecRequest {
    /// The channels a client of `p` uses for this request.
    pub fn streams(&self, p: Protocol) -> Vec<StreamType> {
        remotecommand::streams(self.stdin, self.stdout, self.stderr, self.tty, p)
    }
}

/// Runs one exec session on an upgraded SPDY connection.
pub async fn serve<IO>(io: IO, protocol: Protocol, req: ExecRequest, backend: Arc<dyn ExecBackend>)
where
    IO: AsyncRead + AsyncWrite + Send + 'static,
{
    match session::open_spdy(io, req.streams(protocol)).await {
        Ok((channels, link)) => run_session(channels, link, protocol, req, backend).await,
        Err(reason) => {
            tracing::info!(container = %req.container_id, %reason, "exec session ended before it started")
        }
    }
}

/// Runs one exec session on its channels, whatever the transport: the process, its stdio, the
/// outcome on the error channel, the end of the connection.
pub async fn run_session(
    mut channels: Channels,
    mut link: Link,
    protocol: Protocol,
    req: ExecRequest,
    backend: Arc<dyn ExecBackend>,
) {
    let started = Instant::now();
    let (outcome, client_gone) = run(&req, &mut channels, &mut link, backend.as_ref()).await;
    let ms = format!("{:.1}", started.elapsed().as_secs_f64() * 1e3);
    // The client's command, up to a megabyte: its start is enough for a log line.
    let cmd = minicri_store::text::bounded_to(format!("{:?}", req.cmd), 512);
    match &outcome {
        Outcome::Error(e) => {
            tracing::warn!(container = %req.container_id, cmd, error = %e, duration_ms = ms, "exec failed")
        }
        o => {
            let code = match o {
                Outcome::ExitCode(c) => *c,
                _ => 0,
            };
            tracing::info!(container = %req.container_id, cmd, exit_code = code, client_gone, protocol = protocol.name(), duration_ms = ms, "exec finished")
        }
    }
    if client_gone {
        link.close().await;
    } else {
        session::finish(&channels, protocol, &outcome, &req.cmd).await;
        link.finish().await;
    }
}

/// Starts the process and pumps its stdio until it exits. Returns how it ended and whether the
/// client went away meanwhile.
async fn run(
    req: &ExecRequest,
    ch: &mut Channels,
    link: &mut Link,
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
    let pumps = Pumps::start(ch, stdin, stdout, stderr, resize);
    let mut client_gone = false;
    let result = loop {
        tokio::select! {
            r = &mut exit => break r,
            () = link.gone(), if !client_gone => {
                tracing::info!(container = %req.container_id, "exec client went away: killing the process");
                client_gone = true;
                kill();
            }
        }
    };
    if pumps.drain().await {
        tracing::debug!(container = %req.container_id, "exec output still open after the exit: dropped");
    }
    let outcome = match result {
        Ok(0) => Outcome::Success,
        Ok(code) => Outcome::ExitCode(code),
        Err(m) => Outcome::Error(m),
    };
    (outcome, client_gone)
}

#[cfg(test)]
mod tests;

//! One attach session (CRI `Attach`): the remotecommand protocol on an upgraded connection,
//! wired to the container's own stdio, which its shim owns ([`crate::shim`]).
//!
//! The client opens its channels exactly as for exec (`error`, and `stdin` / `stdout` /
//! `stderr` as the request said, `resize` with a terminal; [`super::session`]), over SPDY or
//! WebSocket. Then the session asks the backend to attach ([`ExecBackend::attach`]; for the daemon: an `attach` request on the
//! shim's control socket) and copies:
//! - the container's stdout / stderr, as the shim reads them (they also go to the CRI log, and
//!   only what is written after the attach), to their streams;
//! - the client's stdin to the container's stdin; the client's FIN on `stdin` ends this
//!   session's input (with the container's `stdin_once` the shim then closes the container's
//!   stdin, and the container usually exits).
//!
//! The session ends
//! - when the container's output ends (it exited): the output streams are drained and every
//!   stream is half-closed, with nothing written on the error stream (there is no command
//!   outcome to report; client-go then returns without error);
//! - when the client hangs up (detaches): the shim connection is dropped, the container goes
//!   on, and no exit status is sent.
//!
//! Terminals: the RPC's `tty` must match the container's. A tty container's shim owns its pty
//! ([`crate::shim::console`]): its output comes as stdout, input goes to the terminal, and the
//! `resize` channel's sizes become resize frames to the shim, which sets the terminal's size
//! (the kernel then signals SIGWINCH to the container's foreground processes).

use std::sync::Arc;
use std::time::Instant;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};
use tokio::sync::{mpsc, oneshot, watch};

use super::backend::{Attached, BoxRead, BoxWrite, ExecBackend, Resize};
use super::remotecommand::{self, Outcome, Protocol, StreamType};
use super::session::{self, Channels, Link, Pumps};
use crate::shim::ShimAttach;
use crate::shim::protocol::{Frame, FrameDecoder, FrameKind};

/// Bytes buffered between the shim connection and the session, per direction and stream.
const PIPE: usize = 64 * 1024;

/// What the Attach RPC accepted, kept under its token until the client connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachRequest {
    pub container_id: String,
    /// The container's pod: its sessions share the pod's [`super::MAX_POD_SESSIONS`].
    pub sandbox_id: String,
    pub tty: bool,
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
}

impl AttachRequest {
    /// The channels a client of `p` uses for this request (as for exec).
    pub fn streams(&self, p: Protocol) -> Vec<StreamType> {
        remotecommand::streams(self.stdin, self.stdout, self.stderr, self.tty, p)
    }
}

/// Runs one attach session on an upgraded SPDY connection.
pub async fn serve<IO>(
    io: IO,
    protocol: Protocol,
    req: AttachRequest,
    backend: Arc<dyn ExecBackend>,
) where
    IO: AsyncRead + AsyncWrite + Send + 'static,
{
    match session::open_spdy(io, req.streams(protocol)).await {
        Ok((channels, link)) => run_session(channels, link, protocol, req, backend).await,
        Err(reason) => {
            tracing::info!(container = %req.container_id, %reason, "attach session ended before it started")
        }
    }
}

/// Runs one attach session on its channels, whatever the transport.
pub async fn run_session(
    mut ch: Channels,
    mut link: Link,
    protocol: Protocol,
    req: AttachRequest,
    backend: Arc<dyn ExecBackend>,
) {
    let started = Instant::now();
    let id = req.container_id.clone();
    let attached = match backend
        .attach(&id, req.stdin, req.stdout, req.stderr && !req.tty)
        .await
    {
        Ok(a) => a,
        Err(m) => {
            tracing::warn!(container = %id, error = %m, "attach failed");
            session::finish(&ch, protocol, &Outcome::Error(m), &[]).await;
            link.finish().await;
            return;
        }
    };
    let Attached {
        stdin,
        stdout,
        stderr,
        resize,
        mut ended,
    } = attached;
    let pumps = Pumps::start(&mut ch, stdin, stdout, stderr, resize);

    let client_gone = tokio::select! {
        _ = &mut ended => false,
        () = link.gone() => true,
    };
    let ms = format!("{:.1}", started.elapsed().as_secs_f64() * 1e3);
    if client_gone {
        // Detach: the container carries on; dropping the pieces closes the shim connection.
        pumps.abort();
        drop(ended);
        tracing::info!(container = %id, duration_ms = ms, "attach client detached");
        link.close().await;
        return;
    }
    pumps.drain().await;
    drop(ended);
    tracing::info!(container = %id, duration_ms = ms, protocol = protocol.name(), "attach ended: the container's output ended");
    // No outcome on the error channel: an attach has no command whose status it could report.
    session::close_all(&ch).await;
    link.finish().await;
}

/// Turns a shim attach connection into the session's pipes: one task copies the shim's
/// frames to the stdout / stderr pipes, another the stdin pipe and the resizes to the shim as
/// frames. Both stop, closing the connection (the shim's sign of a detach), when
/// [`Attached::ended`] is dropped.
pub fn from_shim(conn: ShimAttach, stdin: bool, stdout: bool, stderr: bool) -> Attached {
    let ShimAttach { reader, writer } = conn;
    let (detach_tx, detach_rx) = watch::channel(());
    let (done_tx, done_rx) = oneshot::channel::<()>();
    let pipe = |on: bool| on.then(|| tokio::io::duplex(PIPE));
    let (out, err, inp) = (pipe(stdout), pipe(stderr), pipe(stdin));
    let (out_session, out_shim) = out.map_or((None, None), |(a, b)| (Some(a), Some(b)));
    let (err_session, err_shim) = err.map_or((None, None), |(a, b)| (Some(a), Some(b)));
    let (in_session, in_shim) = inp.map_or((None, None), |(a, b)| (Some(a), Some(b)));
    let mut detached = detach_rx.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = copy_frames_out(reader, out_shim, err_shim) => {}
            _ = detached.changed() => {}
        }
        let _ = done_tx.send(());
    });
    let mut detached = detach_rx;
    // Resizes are few and idempotent: when the shim lags, one more is simply dropped.
    let (resize_tx, resize_rx) = mpsc::channel::<(u16, u16)>(8);
    tokio::spawn(async move {
        tokio::select! {
            _ = copy_frames_in(in_shim, resize_rx, writer) => {}
            _ = detached.changed() => {}
        }
        // Dropping the write half shuts it down: the shim's sign that the session detached.
    });
    let resize: Resize = Box::new(move |w, h| {
        let _ = resize_tx.try_send((w, h));
    });
    Attached {
        stdin: in_session.map(|s| Box::pin(s) as BoxWrite),
        stdout: out_session.map(|s| Box::pin(s) as BoxRead),
        stderr: err_session.map(|s| Box::pin(s) as BoxRead),
        resize: Some(resize),
        ended: Box::pin(async move {
            let _detach_on_drop = detach_tx;
            let _ = done_rx.await;
        }),
    }
}

/// The shim's output frames to their pipes, until the shim closes the connection. A pipe whose
/// reader is gone is skipped from then on.
async fn copy_frames_out<R: AsyncRead + Unpin>(
    mut shim: R,
    mut stdout: Option<DuplexStream>,
    mut stderr: Option<DuplexStream>,
) {
    let mut decoder = FrameDecoder::default();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match shim.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        decoder.feed(&buf[..n]);
        loop {
            let f = match decoder.next_frame() {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "attach: bad frame from the shim");
                    return;
                }
            };
            let pipe = match f.kind {
                FrameKind::Stdout => &mut stdout,
                FrameKind::Stderr => &mut stderr,
                _ => continue,
            };
            if let Some(p) = pipe
                && p.write_all(&f.data).await.is_err()
            {
                *pipe = None;
            }
        }
    }
}

/// The session's stdin (its end as a `CloseStdin` frame) and resizes to the shim as frames;
/// after both have ended, waits to be dropped (the detach).
async fn copy_frames_in<W: AsyncWrite + Unpin>(
    mut stdin: Option<DuplexStream>,
    mut resizes: mpsc::Receiver<(u16, u16)>,
    mut shim: W,
) {
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        let frame = tokio::select! {
            n = async { stdin.as_mut().expect("guarded").read(&mut buf).await }, if stdin.is_some() => {
                match n {
                    Ok(0) | Err(_) => {
                        stdin = None;
                        Frame::new(FrameKind::CloseStdin, Vec::new())
                    }
                    Ok(n) => Frame::new(FrameKind::Stdin, &buf[..n]),
                }
            }
            Some((w, h)) = resizes.recv() => Frame::resize(w, h),
            else => break,
        };
        if shim.write_all(&frame.encode()).await.is_err() {
            break;
        }
    }
    std::future::pending::<()>().await;
}

#[cfg(test)]
mod tests;

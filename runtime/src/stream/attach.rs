//! One attach session (CRI `Attach`): the remotecommand protocol on an upgraded connection,
//! wired to the container's own stdio, which its shim owns ([`crate::shim`]).
//!
//! The client opens its streams exactly as for exec (`error`, and `stdin` / `stdout` /
//! `stderr` as the request said; [`super::exec`] collects them). Then the session asks the
//! backend to attach ([`ExecBackend::attach`]; for the daemon: an `attach` request on the
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
//! Terminals: containers with `tty` are refused at creation ([`crate::oci::spec`]), so an
//! attach never has a terminal here; the RPC refuses `tty` (it must match the container's).

use std::sync::Arc;
use std::time::Instant;

use futures::future::BoxFuture;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};
use tokio::sync::{oneshot, watch};

use super::exec::{
    self, BoxRead, BoxWrite, DRAIN_GRACE, ExecBackend, LINGER, STREAM_CREATION_TIMEOUT,
};
use super::remotecommand::{Outcome, Protocol, StreamType};
use super::spdy::conn::{self, Event};
use super::spdy::rst;
use crate::shim::ShimAttach;
use crate::shim::protocol::{Frame, FrameDecoder, FrameKind};

/// Bytes buffered between the shim connection and the session, per direction and stream.
const PIPE: usize = 64 * 1024;

/// What the Attach RPC accepted, kept under its token until the client connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachRequest {
    pub container_id: String,
    pub tty: bool,
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
}

/// A session attached to a container's stdio. Dropping it detaches.
pub struct Attached {
    /// The container's stdin (when asked for); shutting it down ends this session's input.
    pub stdin: Option<BoxWrite>,
    /// The container's stdout and stderr from now on (when asked for); EOF when they end.
    pub stdout: Option<BoxRead>,
    pub stderr: Option<BoxRead>,
    /// Resolves when the container's output has ended (it exited, or its shim is gone).
    pub ended: BoxFuture<'static, ()>,
}

/// The streams a client opens for `req` under protocol `p` (as for exec).
pub fn expected_streams(req: &AttachRequest, p: Protocol) -> Vec<StreamType> {
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

/// Runs one attach session on an upgraded connection.
pub async fn serve<IO>(
    io: IO,
    protocol: Protocol,
    req: AttachRequest,
    backend: Arc<dyn ExecBackend>,
) where
    IO: AsyncRead + AsyncWrite + Send + 'static,
{
    let started = Instant::now();
    let id = req.container_id.clone();
    let (conn, mut events) = conn::serve(io);
    let expected = expected_streams(&req, protocol);
    let mut ch = match exec::collect(&mut events, expected, STREAM_CREATION_TIMEOUT).await {
        Ok(c) => c,
        Err(reason) => {
            tracing::info!(container = %id, %reason, "attach session ended before it started");
            conn.close().await;
            return;
        }
    };
    let attached = match backend
        .attach(&id, req.stdin, req.stdout, req.stderr && !req.tty)
        .await
    {
        Ok(a) => a,
        Err(m) => {
            tracing::warn!(container = %id, error = %m, "attach failed");
            exec::finish(&ch, protocol, &Outcome::Error(m), &[]).await;
            let _ = tokio::time::timeout(LINGER, async {
                while let Some(Event::Stream(_)) = events.recv().await {}
            })
            .await;
            conn.close().await;
            return;
        }
    };
    let Attached {
        stdin,
        stdout,
        stderr,
        mut ended,
    } = attached;
    let stdin_task = match (ch.stdin.as_mut(), stdin) {
        (Some(s), Some(w)) => {
            let rx = std::mem::replace(&mut s.data, tokio::sync::mpsc::channel(1).1);
            Some(tokio::spawn(exec::copy_in(rx, w)))
        }
        _ => None,
    };
    let outputs = [
        (stdout, ch.stdout.as_ref().map(|s| s.writer.clone())),
        (stderr, ch.stderr.as_ref().map(|s| s.writer.clone())),
    ]
    .map(|(r, w)| tokio::spawn(exec::copy_out(r, w)));

    let client_gone = loop {
        tokio::select! {
            _ = &mut ended => break false,
            ev = events.recv() => match ev {
                Some(Event::Stream(s)) => s.writer.reset(rst::REFUSED_STREAM).await,
                Some(Event::Closed(_)) | None => break true,
            },
        }
    };
    let ms = format!("{:.1}", started.elapsed().as_secs_f64() * 1e3);
    if client_gone {
        // Detach: the container carries on; dropping the pieces closes the shim connection.
        for t in outputs {
            t.abort();
        }
        if let Some(t) = stdin_task {
            t.abort();
        }
        drop(ended);
        tracing::info!(container = %id, duration_ms = ms, "attach client detached");
        conn.close().await;
        return;
    }
    let drained_by = tokio::time::Instant::now() + DRAIN_GRACE;
    for mut t in outputs {
        if tokio::time::timeout_at(drained_by, &mut t).await.is_err() {
            t.abort();
        }
    }
    if let Some(t) = stdin_task {
        t.abort();
    }
    drop(ended);
    tracing::info!(container = %id, duration_ms = ms, protocol = protocol.name(), "attach ended: the container's output ended");
    // No outcome on the error stream: an attach has no command whose status it could report.
    exec::close_all(&ch).await;
    let _ = tokio::time::timeout(LINGER, async {
        while let Some(ev) = events.recv().await {
            match ev {
                Event::Stream(s) => s.writer.reset(rst::REFUSED_STREAM).await,
                Event::Closed(_) => break,
            }
        }
    })
    .await;
    conn.close().await;
}

/// The daemon's attach: the running container's shim serves the session.
pub(super) fn pod_attach<'a>(
    pods: &'a crate::pods::PodService,
    container_id: &'a str,
    stdin: bool,
    stdout: bool,
    stderr: bool,
) -> BoxFuture<'a, Result<Attached, String>> {
    Box::pin(async move {
        let rec = pods.exec_target(container_id).map_err(|e| e.to_string())?;
        let shim = rec
            .shim
            .ok_or_else(|| format!("container {container_id} has no monitor to attach to"))?;
        let conn = shim
            .attach(stdin, stdout, stderr)
            .await
            .map_err(|e| format!("attaching to container {container_id}: {e}"))?;
        Ok(from_shim(conn, stdin, stdout, stderr))
    })
}

/// Turns a shim attach connection into the session's pipes: one task copies the shim's
/// frames to the stdout / stderr pipes, another the stdin pipe to the shim as frames. Both
/// stop, closing the connection (the shim's sign of a detach), when [`Attached::ended`] is
/// dropped.
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
    tokio::spawn(async move {
        let mut writer = writer;
        if let Some(r) = in_shim {
            tokio::select! {
                _ = copy_frames_in(r, &mut writer) => {}
                _ = detached.changed() => return,
            }
        }
        let _ = detached.changed().await;
        // Dropping the write half shuts it down: the shim's sign that the session detached.
    });
    Attached {
        stdin: in_session.map(|s| Box::pin(s) as BoxWrite),
        stdout: out_session.map(|s| Box::pin(s) as BoxRead),
        stderr: err_session.map(|s| Box::pin(s) as BoxRead),
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

/// The session's stdin to the shim as frames; its end as a `CloseStdin` frame.
async fn copy_frames_in<W: AsyncWrite + Unpin>(mut stdin: DuplexStream, shim: &mut W) {
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        let n = match stdin.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if shim
            .write_all(&Frame::new(FrameKind::Stdin, &buf[..n]).encode())
            .await
            .is_err()
        {
            return;
        }
    }
    let _ = shim
        .write_all(&Frame::new(FrameKind::CloseStdin, Vec::new()).encode())
        .await;
}

#[cfg(test)]
mod tests;

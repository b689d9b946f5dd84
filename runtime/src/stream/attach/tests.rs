//! Attach sessions over an in-memory connection, with a fake shim on a unix socket pair that
//! speaks the shim's attach frames ([`crate::shim::protocol::Frame`]).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use futures::future::BoxFuture;
use minicri_codecs::spdy::test_peer::Peer;
use minicri_codecs::spdy::{FLAG_FIN, Frame as SpdyFrame};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

use super::*;
use crate::shim::ShimAttach;
use crate::stream::backend::Spawned;
use crate::stream::remotecommand::{Failure, FailureKind};

/// Hands out one prepared shim connection.
struct FakeShim(Mutex<Option<ShimAttach>>);

impl ExecBackend for FakeShim {
    fn spawn<'a>(
        &'a self,
        _: &'a str,
        _: Vec<String>,
        _: bool,
    ) -> BoxFuture<'a, Result<Spawned, Failure>> {
        Box::pin(async { Err(Failure::internal("no exec here")) })
    }

    fn attach<'a>(
        &'a self,
        _: &'a str,
        stdin: bool,
        stdout: bool,
        stderr: bool,
    ) -> BoxFuture<'a, Result<Attached, Failure>> {
        let conn = self.0.lock().unwrap().take();
        Box::pin(async move {
            let conn = conn.ok_or_else(|| Failure {
                kind: FailureKind::BadRequest,
                message: "container c1 is not running".into(),
            })?;
            Ok(from_shim(conn, stdin, stdout, stderr))
        })
    }
}

/// The daemon's end (as [`crate::shim::ShimHandle::attach`] returns it) and the shim's end.
fn pair() -> (ShimAttach, UnixStream) {
    let (daemon, shim) = UnixStream::pair().unwrap();
    let (r, w) = daemon.into_split();
    (
        ShimAttach {
            reader: BufReader::new(r),
            writer: w,
        },
        shim,
    )
}

/// Reads frames from the daemon's side until `n` have come (or EOF).
async fn shim_frames(shim: &mut UnixStream, n: usize) -> Vec<crate::shim::protocol::Frame> {
    let mut d = FrameDecoder::default();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    while out.len() < n {
        while let Some(f) = d.next_frame().unwrap() {
            out.push(f);
        }
        if out.len() >= n {
            break;
        }
        let k = tokio::time::timeout(Duration::from_secs(5), shim.read(&mut buf))
            .await
            .expect("frames in time")
            .unwrap();
        if k == 0 {
            break;
        }
        d.feed(&buf[..k]);
    }
    out
}

fn request(stdin: bool) -> AttachRequest {
    AttachRequest {
        container_id: "c1".into(),
        sandbox_id: "sb".into(),
        tty: false,
        stdin,
        stdout: true,
        stderr: true,
    }
}

/// Starts a session whose client opened error (1), stdin (3), stdout (5), stderr (7).
async fn start(
    backend: Arc<dyn ExecBackend>,
) -> (Peer<tokio::io::DuplexStream>, tokio::task::JoinHandle<()>) {
    let (a, b) = tokio::io::duplex(1 << 20);
    let session = tokio::spawn(serve(b, Protocol::V4, request(true), backend));
    let mut peer = Peer::new(a);
    for (id, kind) in [(1, "error"), (3, "stdin"), (5, "stdout"), (7, "stderr")] {
        peer.open(id, kind).await;
        assert!(
            matches!(peer.recv().await, SpdyFrame::SynReply { stream_id, .. } if stream_id == id)
        );
    }
    (peer, session)
}

#[test]
fn streams_are_those_of_exec() {
    let r = request(true);
    assert_eq!(
        r.streams(Protocol::V4),
        [
            StreamType::Error,
            StreamType::Stdin,
            StreamType::Stdout,
            StreamType::Stderr
        ]
    );
    let r = AttachRequest {
        stdin: false,
        stderr: false,
        ..request(false)
    };
    assert_eq!(
        r.streams(Protocol::V2),
        [StreamType::Error, StreamType::Stdout]
    );
}

#[tokio::test]
async fn from_shim_demultiplexes_output_and_frames_stdin() {
    let (conn, mut shim) = pair();
    let mut a = from_shim(conn, true, true, true);
    shim.write_all(&Frame::new(FrameKind::Stdout, b"out".to_vec()).encode())
        .await
        .unwrap();
    shim.write_all(&Frame::new(FrameKind::Stderr, b"err".to_vec()).encode())
        .await
        .unwrap();
    let mut b = [0u8; 3];
    a.stdout.as_mut().unwrap().read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"out");
    a.stderr.as_mut().unwrap().read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"err");
    let mut stdin = a.stdin.take().unwrap();
    stdin.write_all(b"line\n").await.unwrap();
    stdin.shutdown().await.unwrap();
    let frames = shim_frames(&mut shim, 2).await;
    assert_eq!(
        frames,
        [
            Frame::new(FrameKind::Stdin, b"line\n".to_vec()),
            Frame::new(FrameKind::CloseStdin, Vec::new())
        ]
    );
    // The shim closing the connection is the end of the output.
    drop(shim);
    tokio::time::timeout(Duration::from_secs(5), &mut a.ended)
        .await
        .expect("ended resolves");
    let mut rest = Vec::new();
    a.stdout.unwrap().read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty());
}

#[tokio::test]
async fn dropping_the_session_detaches_from_the_shim() {
    let (conn, mut shim) = pair();
    let a = from_shim(conn, false, true, false);
    assert!(a.stdin.is_none() && a.stderr.is_none());
    drop(a);
    let mut b = [0u8; 16];
    let n = tokio::time::timeout(Duration::from_secs(5), shim.read(&mut b))
        .await
        .expect("EOF in time")
        .unwrap();
    assert_eq!(n, 0, "the shim sees the connection close");
}

#[tokio::test]
async fn a_session_relays_both_ways_and_ends_without_a_status() {
    let (conn, mut shim) = pair();
    let (mut peer, session) = start(Arc::new(FakeShim(Mutex::new(Some(conn))))).await;
    peer.send(SpdyFrame::Data {
        stream_id: 3,
        flags: 0,
        data: b"hello\n".to_vec(),
    })
    .await;
    assert_eq!(
        shim_frames(&mut shim, 1).await,
        [Frame::new(FrameKind::Stdin, b"hello\n".to_vec())]
    );
    shim.write_all(&Frame::new(FrameKind::Stdout, b"got:hello\n".to_vec()).encode())
        .await
        .unwrap();
    shim.write_all(&Frame::new(FrameKind::Stderr, b"warn\n".to_vec()).encode())
        .await
        .unwrap();
    // The client's FIN on stdin ends the session's input, not the session.
    peer.send(SpdyFrame::Data {
        stream_id: 3,
        flags: FLAG_FIN,
        data: Vec::new(),
    })
    .await;
    assert_eq!(
        shim_frames(&mut shim, 1).await,
        [Frame::new(FrameKind::CloseStdin, Vec::new())]
    );
    // The container exits: the shim closes the connection.
    drop(shim);
    let mut data: HashMap<u32, Vec<u8>> = HashMap::new();
    let mut fins = Vec::new();
    while !(fins.contains(&1) && fins.contains(&5) && fins.contains(&7)) {
        match tokio::time::timeout(Duration::from_secs(10), peer.recv())
            .await
            .expect("frames in time")
        {
            SpdyFrame::Data {
                stream_id,
                flags,
                data: d,
            } => {
                data.entry(stream_id).or_default().extend(d);
                if flags & FLAG_FIN != 0 {
                    fins.push(stream_id);
                }
            }
            SpdyFrame::WindowUpdate { .. } => {}
            f => panic!("unexpected frame {f:?}"),
        }
    }
    assert_eq!(data[&5], b"got:hello\n");
    assert_eq!(data[&7], b"warn\n");
    assert!(
        data.get(&1).is_none_or(|d| d.is_empty()),
        "no status on the error stream: {data:?}"
    );
    drop(peer);
    tokio::time::timeout(Duration::from_secs(10), session)
        .await
        .expect("the session ends")
        .unwrap();
}

#[tokio::test]
async fn a_client_that_hangs_up_detaches() {
    let (conn, mut shim) = pair();
    let (peer, session) = start(Arc::new(FakeShim(Mutex::new(Some(conn))))).await;
    drop(peer);
    tokio::time::timeout(Duration::from_secs(5), session)
        .await
        .expect("the session ends")
        .unwrap();
    // Nothing was sent to the shim but the end of the connection (no CloseStdin either way
    // matters to the shim: a detach ends the session's stdin).
    let frames = shim_frames(&mut shim, 10).await;
    assert!(
        frames
            .iter()
            .all(|f| f.kind == FrameKind::CloseStdin && f.data.is_empty()),
        "{frames:?}"
    );
}

#[tokio::test]
async fn a_failed_attach_is_reported_on_the_error_stream() {
    let (mut peer, _session) = start(Arc::new(FakeShim(Mutex::new(None)))).await;
    let mut error = Vec::new();
    loop {
        let f = tokio::time::timeout(Duration::from_secs(10), peer.recv())
            .await
            .expect("frames in time");
        if let SpdyFrame::Data {
            stream_id: 1,
            flags,
            data,
        } = f
        {
            error.extend(data);
            if flags & FLAG_FIN != 0 {
                break;
            }
        }
    }
    let v: serde_json::Value = serde_json::from_slice(&error).unwrap();
    assert_eq!(v["status"], "Failure");
    assert!(
        v["message"].as_str().unwrap().contains("not running"),
        "{v}"
    );
    // The backend's kind reaches the client: not a server fault.
    assert_eq!(v["reason"], "BadRequest", "{v}");
    assert_eq!(v["code"], 400, "{v}");
}

//! Exec sessions end to end over an in-memory connection, with local processes standing in for
//! container processes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};

use std::time::Duration;

use minicri_codecs::spdy::conn;
use minicri_codecs::spdy::rst;
use minicri_codecs::spdy::test_peer::Peer;
use minicri_codecs::spdy::{FLAG_FIN, Frame};

use super::*;
use crate::stream::testing::LocalBackend;

fn request(cmd: &[&str], stdin: bool) -> ExecRequest {
    ExecRequest {
        container_id: "c1".into(),
        sandbox_id: "sb".into(),
        cmd: cmd.iter().map(|s| s.to_string()).collect(),
        tty: false,
        stdin,
        stdout: true,
        stderr: true,
    }
}

/// Starts a session; the peer has opened error (1), stdout (3), stderr (5) and, with `stdin`,
/// stdin (7), and read the replies.
async fn start(
    req: ExecRequest,
    protocol: Protocol,
) -> (
    Peer<tokio::io::DuplexStream>,
    tokio::task::JoinHandle<()>,
    Arc<AtomicBool>,
) {
    let (a, b) = tokio::io::duplex(1 << 20);
    let killed = Arc::new(AtomicBool::new(false));
    let backend = Arc::new(LocalBackend {
        killed: killed.clone(),
    });
    let with_stdin = req.stdin;
    let session = tokio::spawn(serve(b, protocol, req, backend));
    let mut peer = Peer::new(a);
    let mut kinds = vec![(1, "error"), (3, "stdout"), (5, "stderr")];
    if with_stdin {
        kinds.push((7, "stdin"));
    }
    for (id, kind) in kinds {
        peer.open(id, kind).await;
        assert!(matches!(peer.recv().await, Frame::SynReply { stream_id, .. } if stream_id == id));
    }
    (peer, session, killed)
}

/// Reads frames until the error stream (1) is finished: (data per stream, streams finished).
async fn collect(peer: &mut Peer<tokio::io::DuplexStream>) -> (HashMap<u32, Vec<u8>>, Vec<u32>) {
    let mut data: HashMap<u32, Vec<u8>> = HashMap::new();
    let mut fins = Vec::new();
    while !fins.contains(&1) {
        match tokio::time::timeout(Duration::from_secs(10), peer.recv())
            .await
            .expect("frames in time")
        {
            Frame::Data {
                stream_id,
                flags,
                data: d,
            } => {
                data.entry(stream_id).or_default().extend(d);
                if flags & FLAG_FIN != 0 {
                    fins.push(stream_id);
                }
            }
            Frame::WindowUpdate { .. } => {}
            f => panic!("unexpected frame {f:?}"),
        }
    }
    (data, fins)
}

fn status(data: &HashMap<u32, Vec<u8>>) -> serde_json::Value {
    serde_json::from_slice(&data[&1]).unwrap()
}

#[tokio::test]
async fn output_and_success_status() {
    let (mut peer, session, _) = start(
        request(&["sh", "-c", "echo out; echo err >&2"], false),
        Protocol::V4,
    )
    .await;
    let (data, fins) = collect(&mut peer).await;
    assert_eq!(data[&3], b"out\n");
    assert_eq!(data[&5], b"err\n");
    assert_eq!(data[&1], br#"{"metadata":{},"status":"Success"}"#);
    assert!(fins.contains(&3) && fins.contains(&5), "{fins:?}");
    drop(peer);
    tokio::time::timeout(Duration::from_secs(5), session)
        .await
        .expect("the session ends when the client hangs up")
        .unwrap();
}

#[tokio::test]
async fn non_zero_exit_is_reported_with_its_code() {
    let (mut peer, _session, _) = start(
        request(&["sh", "-c", "printf partial; exit 3"], false),
        Protocol::V4,
    )
    .await;
    let (data, _) = collect(&mut peer).await;
    assert_eq!(data[&3], b"partial");
    assert!(data[&5].is_empty(), "no stderr");
    let v = status(&data);
    assert_eq!(v["status"], "Failure");
    assert_eq!(v["reason"], "NonZeroExitCode");
    assert_eq!(v["details"]["causes"][0]["reason"], "ExitCode");
    assert_eq!(v["details"]["causes"][0]["message"], "3");
}

#[tokio::test]
async fn stdin_reaches_the_process_and_its_fin_closes_it() {
    let (mut peer, _session, _) = start(request(&["cat"], true), Protocol::V4).await;
    peer.send(Frame::Data {
        stream_id: 7,
        flags: 0,
        data: b"hello ".to_vec(),
    })
    .await;
    peer.send(Frame::Data {
        stream_id: 7,
        flags: FLAG_FIN,
        data: b"world".to_vec(),
    })
    .await;
    let (data, fins) = collect(&mut peer).await;
    assert_eq!(data[&3], b"hello world");
    assert_eq!(status(&data)["status"], "Success");
    // The server half-closes the stdin stream too.
    let mut stdin_fin = fins.contains(&7);
    while !stdin_fin {
        if let Frame::Data {
            stream_id: 7,
            flags,
            ..
        } = peer.recv().await
        {
            stdin_fin = flags & FLAG_FIN != 0;
        }
    }
}

#[tokio::test]
async fn large_output_is_not_held_back_by_flow_control() {
    // 1 MiB, 16 times the initial window, to a peer that never sends WINDOW_UPDATE (spdystream).
    let (mut peer, _session, _) = start(
        request(&["head", "-c", "1048576", "/dev/zero"], false),
        Protocol::V4,
    )
    .await;
    let (data, _) = collect(&mut peer).await;
    assert_eq!(data[&3].len(), 1 << 20);
}

#[tokio::test]
async fn a_process_that_cannot_start_is_an_error_status() {
    let (mut peer, _session, _) = start(request(&["missing"], false), Protocol::V4).await;
    let (data, fins) = collect(&mut peer).await;
    let v = status(&data);
    assert_eq!(v["status"], "Failure");
    assert!(
        v["message"]
            .as_str()
            .unwrap()
            .contains("executable file not found")
    );
    assert!(fins.contains(&3) && fins.contains(&5));
}

#[tokio::test]
async fn older_protocols_get_text_errors() {
    let (mut peer, _session, _) =
        start(request(&["sh", "-c", "exit 4"], false), Protocol::V2).await;
    let (data, _) = collect(&mut peer).await;
    let text = String::from_utf8(data[&1].clone()).unwrap();
    assert!(text.contains("exit code 4"), "{text}");
    let (mut peer, _session, _) = start(request(&["true"], false), Protocol::V3).await;
    let (data, _) = collect(&mut peer).await;
    assert!(data[&1].is_empty(), "nothing on success before v4");
}

#[tokio::test]
async fn a_client_that_hangs_up_gets_its_process_killed() {
    let (peer, session, killed) = start(request(&["sleep", "30"], false), Protocol::V4).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(peer);
    tokio::time::timeout(Duration::from_secs(5), session)
        .await
        .expect("the session ends")
        .unwrap();
    assert!(killed.load(Ordering::SeqCst));
}

#[tokio::test]
async fn streams_are_collected_and_strays_refused() {
    let (a, b) = tokio::io::duplex(1 << 16);
    let (_conn, mut events) = conn::serve(b);
    let mut peer = Peer::new(a);
    let req = request(&["true"], false);
    let collecting = tokio::spawn(async move {
        let r = session::collect(
            &mut events,
            req.streams(Protocol::V4),
            Duration::from_secs(5),
        )
        .await;
        r.map(|c| {
            (
                c.error.map(|s| s.id),
                c.stdout.map(|s| s.id),
                c.stderr.map(|s| s.id),
            )
        })
    });
    peer.open(1, "error").await;
    let _ = peer.recv().await;
    peer.open(3, "bogus").await;
    let _ = peer.recv().await; // SYN_REPLY, then the reset
    assert_eq!(
        peer.recv().await,
        Frame::RstStream {
            stream_id: 3,
            status: rst::REFUSED_STREAM
        }
    );
    peer.open(5, "error").await; // a second error stream
    let _ = peer.recv().await;
    assert!(matches!(
        peer.recv().await,
        Frame::RstStream { stream_id: 5, .. }
    ));
    peer.open(7, "stdout").await;
    peer.open(9, "stderr").await;
    assert_eq!(
        collecting.await.unwrap().unwrap(),
        (Some(1), Some(7), Some(9))
    );

    // A client that never opens them times out.
    let (_a, b) = tokio::io::duplex(1 << 16);
    let (_conn, mut events) = conn::serve(b);
    let err = session::collect(
        &mut events,
        request(&["true"], true).streams(Protocol::V4),
        Duration::from_millis(100),
    )
    .await
    .err()
    .unwrap();
    assert!(err.contains("did not open"), "{err}");
}

#[test]
fn expected_streams_follow_the_request() {
    let mut r = request(&["true"], true);
    assert_eq!(
        r.streams(Protocol::V4),
        [
            StreamType::Error,
            StreamType::Stdin,
            StreamType::Stdout,
            StreamType::Stderr
        ]
    );
    r.tty = true;
    assert_eq!(
        r.streams(Protocol::V4),
        [
            StreamType::Error,
            StreamType::Stdin,
            StreamType::Stdout,
            StreamType::Resize
        ]
    );
    assert_eq!(
        r.streams(Protocol::V2),
        [StreamType::Error, StreamType::Stdin, StreamType::Stdout]
    );
}

#[tokio::test]
async fn a_terminal_gets_input_resizes_and_merged_output() {
    let (a, b) = tokio::io::duplex(1 << 20);
    let backend = Arc::new(LocalBackend {
        killed: Arc::new(AtomicBool::new(false)),
    });
    let req = ExecRequest {
        container_id: "c1".into(),
        sandbox_id: "sb".into(),
        cmd: [
            "sh",
            "-c",
            "while [ \"$(stty size)\" != '30 100' ]; do sleep 0.05; done; read line; \
             echo \"got $line\"; echo to-stderr >&2; stty size",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
        tty: true,
        stdin: true,
        stdout: true,
        stderr: false,
    };
    let _session = tokio::spawn(serve(b, Protocol::V4, req, backend));
    let mut peer = Peer::new(a);
    for (id, kind) in [(1, "error"), (3, "stdin"), (5, "stdout"), (7, "resize")] {
        peer.open(id, kind).await;
        assert!(matches!(peer.recv().await, Frame::SynReply { stream_id, .. } if stream_id == id));
    }
    // client-go's json.Encoder: one object per line.
    peer.send(Frame::Data {
        stream_id: 7,
        flags: 0,
        data: b"{\"Width\":100,\"Height\":30}\n".to_vec(),
    })
    .await;
    peer.send(Frame::Data {
        stream_id: 3,
        flags: 0,
        data: b"typed\r".to_vec(),
    })
    .await;
    let (data, _) = collect(&mut peer).await;
    let out = String::from_utf8_lossy(&data[&5]);
    // The terminal echoes the input, merges stderr and ends lines with CR LF.
    assert!(out.contains("got typed\r\n"), "{out:?}");
    assert!(out.contains("to-stderr\r\n"), "{out:?}");
    assert!(out.ends_with("30 100\r\n"), "{out:?}");
    assert_eq!(status(&data)["status"], "Success");
}

/// A client that grants no flow-control window (and reads nothing) cannot hold the session: the
/// exit status it cannot take is given up after the linger time, and the session ends.
#[tokio::test]
async fn a_client_granting_no_window_cannot_hold_the_session() {
    let (a, b) = tokio::io::duplex(1 << 20);
    let backend = Arc::new(LocalBackend {
        killed: Arc::new(AtomicBool::new(false)),
    });
    let session = tokio::spawn(serve(b, Protocol::V4, request(&["true"], false), backend));
    let mut peer = Peer::new(a);
    peer.send(Frame::Settings {
        flags: 0,
        entries: vec![minicri_codecs::spdy::Setting {
            flags: 0,
            id: minicri_codecs::spdy::SETTINGS_INITIAL_WINDOW_SIZE,
            value: 0,
        }],
    })
    .await;
    for (id, kind) in [(1, "error"), (3, "stdout"), (5, "stderr")] {
        peer.open(id, kind).await;
    }
    tokio::time::timeout(Duration::from_secs(30), session)
        .await
        .expect("the session ends although its client takes nothing")
        .unwrap();
    drop(peer);
}

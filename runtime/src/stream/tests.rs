//! The streaming server over real loopback TCP: tokens, the HTTP refusals, the upgrade and a
//! whole exec session with a local process.

use std::sync::atomic::AtomicBool;

use minicri_codecs::spdy::test_peer::Peer;
use minicri_codecs::spdy::{FLAG_FIN, Frame};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::testing::LocalBackend;
use super::*;

fn exec_request(cmd: &[&str]) -> ExecRequest {
    ExecRequest {
        container_id: "c1".into(),
        sandbox_id: "sb".into(),
        cmd: cmd.iter().map(|s| s.to_string()).collect(),
        tty: false,
        stdin: false,
        stdout: true,
        stderr: true,
    }
}

fn started() -> Arc<StreamServer> {
    let s = Arc::new(StreamServer::bind("127.0.0.1:0".parse().unwrap()).unwrap());
    let backend = Arc::new(LocalBackend {
        killed: Arc::new(AtomicBool::new(false)),
    });
    s.spawn(backend, tokio_util::sync::CancellationToken::new())
        .unwrap();
    s
}

/// Sends a request with `headers`; returns the connection, the status and the response head.
async fn request(url: &str, method: &str, headers: &[&str]) -> (TcpStream, u16, String) {
    let rest = url.strip_prefix("http://").unwrap();
    let (host, path) = rest.split_at(rest.find('/').unwrap());
    let mut c = TcpStream::connect(host).await.unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\n");
    for h in headers {
        head.push_str(h);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    c.write_all(head.as_bytes()).await.unwrap();
    // The response head, byte by byte: what follows a 101 is SPDY.
    let mut resp = Vec::new();
    while !resp.ends_with(b"\r\n\r\n") {
        let mut b = [0u8; 1];
        assert_eq!(c.read(&mut b).await.unwrap(), 1, "response cut short");
        resp.push(b[0]);
    }
    let resp = String::from_utf8(resp).unwrap();
    let status = resp[9..12].parse().unwrap();
    (c, status, resp.to_ascii_lowercase())
}

const UPGRADE: [&str; 2] = ["Connection: Upgrade", "Upgrade: SPDY/3.1"];

/// The request under `token`, if it starts a session (whose place is given back at once).
fn take(s: &StreamServer, token: &str) -> Option<Pending> {
    s.start_session(token).ok().map(|(_slot, p)| p)
}

#[test]
fn tokens_are_single_use_and_expire() {
    let mut s = StreamServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let url = s.register_exec(exec_request(&["true"])).unwrap();
    let prefix = format!("http://{}/exec/", s.address());
    let token = url.strip_prefix(&prefix).unwrap();
    assert_eq!(token.len(), 32);
    assert_ne!(s.address().port(), 0);
    assert_eq!(
        take(&s, token),
        Some(Pending::Exec(exec_request(&["true"])))
    );
    assert_eq!(take(&s, token), None, "single use");
    s.ttl = Duration::ZERO;
    let url = s.register_exec(exec_request(&["true"])).unwrap();
    assert_eq!(
        take(&s, url.strip_prefix(&prefix).unwrap()),
        None,
        "expired"
    );
    assert_ne!(
        s.register_exec(exec_request(&["true"])).unwrap(),
        s.register_exec(exec_request(&["true"])).unwrap()
    );
}

#[tokio::test]
async fn refusals() {
    let s = started();
    let base = format!("http://{}", s.address());
    let (_, status, _) = request(&format!("{base}/attach/x"), "POST", &UPGRADE).await;
    assert_eq!(status, 404);
    let (_, status, _) = request(&format!("{base}/exec/nosuchtoken"), "POST", &UPGRADE).await;
    assert_eq!(status, 404);
    let url = s.register_exec(exec_request(&["true"])).unwrap();
    let (_, status, _) = request(&url, "POST", &[]).await;
    assert_eq!(status, 400, "not an upgrade");
    let (_, status, _) = request(&url, "POST", &UPGRADE).await;
    assert_eq!(status, 404, "the token went with the refused request");
    let url = s.register_exec(exec_request(&["true"])).unwrap();
    let mut h = UPGRADE.to_vec();
    h.push("X-Stream-Protocol-Version: v9.channel.k8s.io");
    let (_, status, head) = request(&url, "POST", &h).await;
    assert_eq!(status, 403);
    assert!(
        head.contains("x-accepted-stream-protocol-versions: v4.channel.k8s.io"),
        "{head}"
    );
    let url = s.register_exec(exec_request(&["true"])).unwrap();
    let (_, status, _) = request(&url, "PUT", &UPGRADE).await;
    assert_eq!(status, 405);
}

#[tokio::test]
async fn running_sessions_are_bounded() {
    let mut s = StreamServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    s.sessions = Arc::new(tokio::sync::Semaphore::new(1));
    let s = Arc::new(s);
    let backend = Arc::new(LocalBackend {
        killed: Arc::new(AtomicBool::new(false)),
    });
    s.spawn(backend, tokio_util::sync::CancellationToken::new())
        .unwrap();
    let busy = s.register_exec(exec_request(&["sleep", "2"])).unwrap();
    let (first, status, _) = request(&busy, "POST", &UPGRADE).await;
    assert_eq!(status, 101);
    // One session runs: the next is refused, for exec as for port-forward, its token kept.
    let url = s.register_exec(exec_request(&["true"])).unwrap();
    let (_, status, head) = request(&url, "POST", &UPGRADE).await;
    assert_eq!(status, 503, "{head}");
    let pf = s
        .register_port_forward(PortForwardRequest {
            sandbox_id: "sb".into(),
            netns: None,
        })
        .unwrap();
    let (_, status, _) = request(&pf, "POST", &UPGRADE).await;
    assert_eq!(status, 503);
    // Once the first has ended (its client hung up), the same token works.
    drop(first);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_c, status, _) = request(&url, "POST", &UPGRADE).await;
        if status == 101 {
            break;
        }
        assert_eq!(status, 503);
        assert!(Instant::now() < deadline, "the first session never let go");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One pod's sessions have a share of the node's: past it, a session into that pod waits (its
/// token kept) while other pods' start; one ending makes room.
#[test]
fn one_pod_cannot_take_every_session() {
    let mut s = StreamServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    s.max_pod_sessions = 2;
    let token = |url: String| url.rsplit_once('/').unwrap().1.to_string();
    let into = |pod: &str| {
        token(
            s.register_exec(ExecRequest {
                sandbox_id: pod.into(),
                ..exec_request(&["true"])
            })
            .unwrap(),
        )
    };
    let (a1, a2, a3, b1) = (into("a"), into("a"), into("a"), into("b"));
    let first = s.start_session(&a1).unwrap().0;
    let _second = s.start_session(&a2).unwrap().0;
    let Err(Refused::Busy(why)) = s.start_session(&a3) else {
        panic!("a third session into pod a started")
    };
    assert!(why.contains("2 streaming sessions into pod a"), "{why}");
    let port_forward = token(
        s.register_port_forward(PortForwardRequest {
            sandbox_id: "a".into(),
            netns: None,
        })
        .unwrap(),
    );
    assert!(matches!(
        s.start_session(&port_forward),
        Err(Refused::Busy(_))
    ));
    let _b = s.start_session(&b1).expect("another pod's session");
    drop(first);
    let (_third, p) = s
        .start_session(&a3)
        .expect("the kept token, once there is room");
    assert!(matches!(p, Pending::Exec(r) if r.sandbox_id == "a"));
    assert_eq!(
        s.start_session(&a3).err(),
        Some(Refused::Unknown),
        "single use"
    );
}

#[tokio::test]
async fn exec_over_http_upgrade() {
    let s = started();
    let url = s
        .register_exec(exec_request(&[
            "sh",
            "-c",
            "echo hi; echo oops >&2; exit 7",
        ]))
        .unwrap();
    let mut h = UPGRADE.to_vec();
    // As client-go sends them: one header line per version, best first.
    h.extend([
        "X-Stream-Protocol-Version: v5.channel.k8s.io",
        "X-Stream-Protocol-Version: v4.channel.k8s.io",
        "X-Stream-Protocol-Version: v3.channel.k8s.io",
    ]);
    let (c, status, head) = request(&url, "POST", &h).await;
    assert_eq!(status, 101, "{head}");
    assert!(head.contains("upgrade: spdy/3.1"), "{head}");
    assert!(head.contains("connection: upgrade"), "{head}");
    assert!(
        head.contains("x-stream-protocol-version: v4.channel.k8s.io"),
        "{head}"
    );
    let mut peer = Peer::new(c);
    for (id, kind) in [(1, "error"), (3, "stdout"), (5, "stderr")] {
        peer.open(id, kind).await;
        assert!(matches!(peer.recv().await, Frame::SynReply { stream_id, .. } if stream_id == id));
    }
    let mut data: HashMap<u32, Vec<u8>> = HashMap::new();
    loop {
        match peer.recv().await {
            Frame::Data {
                stream_id,
                flags,
                data: d,
            } => {
                data.entry(stream_id).or_default().extend(d);
                if stream_id == 1 && flags & FLAG_FIN != 0 {
                    break;
                }
            }
            f => panic!("unexpected {f:?}"),
        }
    }
    assert_eq!(data[&3], b"hi\n");
    assert_eq!(data[&5], b"oops\n");
    let v: serde_json::Value = serde_json::from_slice(&data[&1]).unwrap();
    assert_eq!(v["details"]["causes"][0]["message"], "7");
    // The client hangs up; the server closes too.
    drop(peer);
}

const WEBSOCKET: [&str; 4] = [
    "Connection: Upgrade",
    "Upgrade: websocket",
    "Sec-WebSocket-Version: 13",
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
];

#[tokio::test]
async fn exec_over_websocket() {
    use super::ws::opcode;
    use super::ws::tests::Client;
    let s = started();
    let url = s
        .register_exec(ExecRequest {
            stdin: true,
            ..exec_request(&["sh", "-c", "cat; echo oops >&2; exit 7"])
        })
        .unwrap();
    let mut h = WEBSOCKET.to_vec();
    h.push("Sec-WebSocket-Protocol: v5.channel.k8s.io, v4.channel.k8s.io");
    let (c, status, head) = request(&url, "GET", &h).await;
    assert_eq!(status, 101, "{head}");
    assert!(head.contains("upgrade: websocket"), "{head}");
    // RFC 6455's example key and answer (header values lowercased with the head).
    assert!(
        head.contains("sec-websocket-accept: s3pplmbitxaq9kygzzhzrbk+xoo="),
        "{head}"
    );
    assert!(
        head.contains("sec-websocket-protocol: v5.channel.k8s.io"),
        "{head}"
    );
    let mut client = Client::new(c);
    client.send(opcode::BINARY, b"\x00hi\n").await;
    // v5: the close signal for stdin is cat's end of file.
    client.send(opcode::BINARY, &[255, 0]).await;
    let mut by_channel: HashMap<u8, Vec<u8>> = HashMap::new();
    loop {
        match client.recv().await.expect("a close frame before EOF") {
            (opcode::BINARY, m) => by_channel.entry(m[0]).or_default().extend(&m[1..]),
            (opcode::CLOSE, p) => {
                assert_eq!(p, [0x03, 0xe8], "normal closure");
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(by_channel[&1], b"hi\n");
    assert_eq!(by_channel[&2], b"oops\n");
    let v: serde_json::Value = serde_json::from_slice(&by_channel[&3]).unwrap();
    assert_eq!(v["details"]["causes"][0]["message"], "7");
    client.send(opcode::CLOSE, &[0x03, 0xe8]).await;
    assert_eq!(client.recv().await, None);
}

#[tokio::test]
async fn websocket_refusals() {
    let s = started();
    let url = || s.register_exec(exec_request(&["true"])).unwrap();
    let with = |extra: &[&'static str], skip: &str| {
        let mut h: Vec<&str> = WEBSOCKET
            .iter()
            .copied()
            .filter(|l| !l.starts_with(skip))
            .collect();
        h.extend_from_slice(extra);
        h
    };
    let (_, status, head) = request(
        &url(),
        "GET",
        &with(&["Sec-WebSocket-Version: 8"], "Sec-WebSocket-Version"),
    )
    .await;
    assert_eq!(status, 426);
    assert!(head.contains("sec-websocket-version: 13"), "{head}");
    let (_, status, _) = request(&url(), "GET", &with(&[], "Sec-WebSocket-Key")).await;
    assert_eq!(status, 400, "no key");
    let (_, status, _) = request(
        &url(),
        "GET",
        &with(&["Sec-WebSocket-Key: c2hvcnQ="], "Sec-WebSocket-Key"),
    )
    .await;
    assert_eq!(status, 400, "a key of 8 bytes");
    let (_, status, _) = request(&url(), "POST", &WEBSOCKET).await;
    assert_eq!(status, 400, "WebSocket upgrades are GETs");
    let (_, status, head) = request(
        &url(),
        "GET",
        &with(&["Sec-WebSocket-Protocol: v9.channel.k8s.io"], "x"),
    )
    .await;
    assert_eq!(status, 403);
    assert!(
        !head.contains("x-accepted-stream-protocol-versions"),
        "{head}"
    );
    // No subprotocol: the legacy channel.k8s.io, announced by no header.
    let (_, status, head) = request(&url(), "GET", &WEBSOCKET).await;
    assert_eq!(status, 101);
    assert!(!head.contains("sec-websocket-protocol"), "{head}");
    // Port-forward: the channel form needs its ports; the tunnel does not.
    let pf = || {
        s.register_port_forward(PortForwardRequest {
            sandbox_id: "sb".into(),
            netns: None,
        })
        .unwrap()
    };
    let (_, status, _) = request(
        &pf(),
        "GET",
        &with(&["Sec-WebSocket-Protocol: v4.channel.k8s.io"], "x"),
    )
    .await;
    assert_eq!(status, 400, "no port");
    let (_, status, _) = request(&format!("{}?port=0", pf()), "GET", &WEBSOCKET).await;
    assert_eq!(status, 400, "port 0");
    let (_, status, head) = request(&format!("{}?port=80", pf()), "GET", &WEBSOCKET).await;
    assert_eq!(status, 101, "{head}");
    let (_, status, head) = request(
        &pf(),
        "GET",
        &with(
            &["Sec-WebSocket-Protocol: SPDY/3.1+portforward.k8s.io"],
            "x",
        ),
    )
    .await;
    assert_eq!(status, 101, "{head}");
    assert!(
        head.contains("sec-websocket-protocol: spdy/3.1+portforward.k8s.io"),
        "{head}"
    );
}

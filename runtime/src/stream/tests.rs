//! The streaming server over real loopback TCP: tokens, the HTTP refusals, the upgrade and a
//! whole exec session with a local process.

use std::sync::atomic::AtomicBool;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::spdy::test_peer::Peer;
use super::spdy::{FLAG_FIN, Frame};
use super::testing::LocalBackend;
use super::*;

fn exec_request(cmd: &[&str]) -> ExecRequest {
    ExecRequest {
        container_id: "c1".into(),
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
    s.spawn(backend).unwrap();
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

#[test]
fn tokens_are_single_use_and_expire() {
    let mut s = StreamServer::bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let url = s.register_exec(exec_request(&["true"])).unwrap();
    let prefix = format!("http://{}/exec/", s.address());
    let token = url.strip_prefix(&prefix).unwrap();
    assert_eq!(token.len(), 32);
    assert_ne!(s.address().port(), 0);
    assert_eq!(s.take(token), Some(Pending::Exec(exec_request(&["true"]))));
    assert_eq!(s.take(token), None, "single use");
    s.ttl = Duration::ZERO;
    let url = s.register_exec(exec_request(&["true"])).unwrap();
    assert_eq!(s.take(url.strip_prefix(&prefix).unwrap()), None, "expired");
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

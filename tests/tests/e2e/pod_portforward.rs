//! Black-box tests of port forwarding: the PortForward RPC hands out a loopback URL, a
//! `portforward.k8s.io` client ([`minicri_tests::remotecommand::PortForward`], SPDY/3.1 like
//! client-go) connects to it and forwards TCP connections to a busybox httpd listening on
//! 127.0.0.1:8080 inside the pod's network namespace. Also: two connections on one session, a
//! refused connection reported on the error stream, a token works once, the RPC's refusals, and
//! a host-network pod forwarding to the host's loopback, the node-wide total of what the
//! sessions buffer holding under clients and pods that never read, and one pod's client that
//! never reads neither stalling another pod's port-forward nor holding its part for longer
//! than the stall timeout.
//!
//! Root only, with runc and Debian's CNI plugins ([`skip_reason`]).

use std::time::Duration;

use minicri_proto::runtime::v1 as cri;
use minicri_tests::pod_env::{PodEnv, pod_config, skip_reason};
use minicri_tests::pod_rpc::{
    RuntimeClient, run_container, run_http_server, run_pod, sh_container_config,
    stop_and_remove_pod, stop_pod_sandbox,
};
use minicri_tests::remotecommand::{self, PortForward};
use minicri_tests::websocket::Ws;

const GET: &[u8] = b"GET / HTTP/1.0\r\nHost: localhost\r\n\r\n";

async fn port_forward(c: &mut RuntimeClient, id: &str, port: &[i32]) -> tonic::Result<String> {
    c.port_forward(cri::PortForwardRequest {
        pod_sandbox_id: id.into(),
        port: port.to_vec(),
    })
    .await
    .map(|r| r.into_inner().url)
}

#[tokio::test(flavor = "multi_thread")]
async fn port_forward_reaches_the_pods_loopback() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let env = PodEnv::new().await;
    let image = env.pull_busybox().await;
    let mut c = env.runtime().await;
    let pod = pod_config("portforward", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    run_http_server(&mut c, &sb, &pod, &image, "hello-through-the-forward").await;

    let url = port_forward(&mut c, &sb, &[8080])
        .await
        .expect("PortForward");
    let rest = url
        .strip_prefix("http://127.0.0.1:")
        .expect("a loopback URL");
    let (port, token) = rest
        .split_once("/portforward/")
        .expect("/portforward/<token>");
    assert!(port.parse::<u16>().unwrap() > 0, "{url}");
    assert!(
        token.len() >= 16 && token.bytes().all(|b| b.is_ascii_alphanumeric()),
        "{url}"
    );

    // An HTTP exchange through the forward: httpd answers from inside the pod, closes, and both
    // streams end with FIN and nothing on the error stream.
    let mut pf = PortForward::connect(&url).await.expect("upgrade");
    assert_eq!(pf.protocol, "portforward.k8s.io");
    for round in 0..2 {
        // The second connection runs on the same session, as client-go's do.
        let out = pf.forward(8080, GET).await.expect("forward");
        out.assert_http_ok("hello-through-the-forward\n", &format!("round {round}"));
    }

    // Nothing listens on 8081 in the pod: the refusal comes on the error stream.
    let out = pf
        .forward(8081, b"")
        .await
        .expect("forward to a closed port");
    let msg = String::from_utf8_lossy(&out.error);
    assert!(
        msg.contains("failed to connect to localhost:8081") && msg.contains(&sb),
        "{msg}"
    );
    assert!(out.data.is_empty());
    // The session survives a failed forward.
    let out = pf
        .forward(8080, GET)
        .await
        .expect("forward after a failure");
    assert!(String::from_utf8_lossy(&out.data).contains("hello-through-the-forward"));
    drop(pf);

    // A URL works once.
    let up = remotecommand::upgrade(&url, &["portforward.k8s.io"])
        .await
        .unwrap();
    assert_eq!(up.status, 404, "{}", up.head);
    // A protocol other than portforward.k8s.io is refused.
    let url2 = port_forward(&mut c, &sb, &[]).await.expect("PortForward");
    let up = remotecommand::upgrade(&url2, &["v4.channel.k8s.io"])
        .await
        .unwrap();
    assert_eq!(up.status, 403, "{}", up.head);

    // Refusals of the RPC itself.
    let unknown = "f".repeat(64);
    let e = port_forward(&mut c, &unknown, &[8080]).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    assert!(e.message().contains(&unknown), "{e:?}");
    for bad in [0, -1, 65536] {
        let e = port_forward(&mut c, &sb, &[8080, bad]).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bad}: {e:?}");
    }
    let e = port_forward(&mut c, "", &[8080]).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    stop_pod_sandbox(&mut c, &sb).await;
    let e = port_forward(&mut c, &sb, &[8080]).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains(&sb), "{e:?}");

    stop_and_remove_pod(&mut c, &sb).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn host_network_pods_forward_to_the_hosts_loopback() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let env = PodEnv::new().await;
    let image = env.pull_busybox().await;
    let mut c = env.runtime().await;
    let mut pod = pod_config("portforward-host", env.logs.path());
    pod.linux = Some(cri::LinuxPodSandboxConfig {
        security_context: Some(cri::LinuxSandboxSecurityContext {
            namespace_options: Some(cri::NamespaceOption {
                network: cri::NamespaceMode::Node as i32,
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    });
    // A port free on the host right now, for httpd in the host's network namespace.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let sb = run_pod(&mut c, &pod).await;
    run_container(
        &mut c,
        &sb,
        &pod,
        sh_container_config(
            "server",
            &image,
            &format!(
                "mkdir -p /www && echo hello-host-network > /www/index.html && exec httpd -f -p 127.0.0.1:{port} -h /www"
            ),
        ),
    )
    .await;
    let url = port_forward(&mut c, &sb, &[i32::from(port)])
        .await
        .expect("PortForward");
    let mut pf = PortForward::connect(&url).await.expect("upgrade");
    let mut body = String::new();
    for _ in 0..100 {
        let out = pf.forward(port, GET).await.expect("forward");
        if out.error.is_empty() {
            body = String::from_utf8_lossy(&out.data).into_owned();
            break;
        }
        // httpd may not listen yet: each refusal ends that forward only.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(body.ends_with("hello-host-network\n"), "{body}");
    drop(pf);
    stop_and_remove_pod(&mut c, &sb).await;
}

/// The daemon's resident set in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kib * 1024
}

/// The port-forward bytes buffered once they reach 0, or after 10 s.
async fn drained(metrics: &str) -> u64 {
    use minicri_tests::pull_env::{sample, scrape};
    let mut left = u64::MAX;
    for _ in 0..100 {
        left = sample(
            &scrape(metrics).await,
            "minicri_port_forward_buffered_bytes",
        );
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    left
}

/// Waits until port 8080 of pod `sb` sends (its server starts in the background): a forward
/// reads 1 MiB from it.
async fn until_8080_sends(c: &mut RuntimeClient, sb: &str) {
    for _ in 0..100 {
        let mut pf = PortForward::connect(&port_forward(c, sb, &[]).await.unwrap())
            .await
            .unwrap();
        let (_, data) = pf.open(8080).await.unwrap();
        let read = tokio::time::timeout(Duration::from_secs(5), pf.read_data(data, 1 << 20));
        if let Ok(Ok(())) = read.await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("port 8080 of pod {sb} did not send");
}

/// Pushes 1 MiB DATA frames round-robin on `streams` of `pf` until a frame has not gone out in
/// 3 s (the daemon stopped reading) or `most` bytes went: the bytes pushed.
async fn push_until_held(pf: &mut PortForward, streams: &[u32], most: usize) -> usize {
    let frame = vec![b'x'; 1 << 20];
    let mut pushed = 0;
    for id in streams.iter().cycle() {
        if pushed >= most {
            break;
        }
        match tokio::time::timeout(Duration::from_secs(3), pf.push(*id, &frame)).await {
            Ok(Ok(())) => pushed += frame.len(),
            Ok(Err(e)) => panic!("pushing after {pushed} bytes: {e}"),
            Err(_) => break,
        }
    }
    pushed
}

/// Clients that never read, and pods that never read, cannot make the daemon buffer more than
/// `port_forward_buffer_bytes` for all port-forward sessions together (8 MiB here): three SPDY
/// sessions push 1 MiB DATA frames on 24 connections each to a pod port that never reads, a
/// WebSocket session of the channel form pushes 1 MiB messages to 16 such connections, and
/// another session opens 24 connections to a pod port that sends without end and never reads
/// them. The daemon's buffered total (its metrics) fills up to the bound and stops there, with
/// reads waiting; its resident set grows by less than three times the bound (without the total
/// it grew by 105 MiB here). When the sessions go, their bytes are given back, and a new
/// session forwards again. (The kernel's socket buffers, each up to `net.ipv4.tcp_wmem`'s
/// maximum, take what the clients push first: they are not the daemon's.)
#[tokio::test(flavor = "multi_thread")]
async fn port_forward_buffers_stay_under_the_node_total() {
    use minicri_tests::pull_env::{free_metrics_address, sample, scrape};
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    const LIMIT: u64 = 8 << 20;
    const CONNECTIONS: usize = 24;
    let metrics = free_metrics_address();
    let limit = LIMIT.to_string();
    let env = PodEnv::with_args(&[
        "--port-forward-buffer-bytes",
        &limit,
        "--metrics-address",
        &metrics,
    ])
    .await;
    let image = env.pull_busybox().await;
    let mut c = env.runtime().await;
    let pod = pod_config("pf-budget", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    // 8080 sends zeros to each connection without end; 8081 never reads what it gets.
    let script = "nc -ll -p 8080 -e cat /dev/zero & exec nc -ll -p 8081 -e sleep 100000";
    run_container(
        &mut c,
        &sb,
        &pod,
        sh_container_config("flood", &image, script),
    )
    .await;
    // Both listen (nc starts in the background).
    until_8080_sends(&mut c, &sb).await;
    let pid = env.daemon.pid().expect("daemon pid");
    assert_eq!(
        drained(&metrics).await,
        0,
        "the first sessions' bytes stay charged"
    );
    let before = rss(pid);
    let text = scrape(&metrics).await;
    assert_eq!(
        sample(&text, "minicri_port_forward_buffer_limit_bytes"),
        LIMIT
    );

    // A client that never reads what the pod sends.
    let mut reader = PortForward::connect(&port_forward(&mut c, &sb, &[]).await.unwrap())
        .await
        .unwrap();
    for _ in 0..CONNECTIONS {
        reader.open(8080).await.unwrap();
    }
    // Clients that send to a pod that never reads, and never read either.
    let mut pushers = Vec::new();
    for _ in 0..3 {
        let mut pf = PortForward::connect(&port_forward(&mut c, &sb, &[]).await.unwrap())
            .await
            .unwrap();
        let mut streams = Vec::new();
        for _ in 0..CONNECTIONS {
            streams.push(pf.open(8081).await.unwrap().1);
        }
        pushers.push(tokio::spawn(async move {
            let pushed = push_until_held(&mut pf, &streams, 256 << 20).await;
            (pf, pushed)
        }));
    }
    // And one of the kubelet's per-port channel form (WebSocket), whose ports queue whole
    // messages of up to 1 MiB: 4 per port, 64 MiB for this session without a total.
    let query: Vec<String> = (0..16).map(|_| "port=8081".to_string()).collect();
    let ws_url = format!(
        "{}?{}",
        port_forward(&mut c, &sb, &[]).await.unwrap(),
        query.join("&")
    );
    let ws_pusher = tokio::spawn(async move {
        let mut ws = Ws::connect(&ws_url, &["v4.channel.k8s.io"]).await.unwrap();
        // With its channel byte, a message of the most the daemon takes (1 MiB).
        let message = vec![b'x'; (1 << 20) - 1];
        let mut pushed = 0usize;
        for port in (0..16u8).cycle() {
            if pushed >= 256 << 20 {
                break;
            }
            let send = ws.send_channel(2 * port, &message);
            match tokio::time::timeout(Duration::from_secs(3), send).await {
                Ok(Ok(())) => pushed += message.len(),
                Ok(Err(e)) => panic!("pushing after {pushed} bytes: {e}"),
                Err(_) => break,
            }
        }
        (ws, pushed)
    });
    let mut sessions = Vec::new();
    for p in pushers {
        let (pf, pushed) = p.await.unwrap();
        eprintln!(
            "a pushing client got {} MiB out before it was held",
            pushed >> 20
        );
        assert!(
            pushed < 256 << 20,
            "a client pushed 256 MiB without being held"
        );
        sessions.push(pf);
    }
    let (ws, pushed) = ws_pusher.await.unwrap();
    eprintln!(
        "the channel-form client got {} MiB out before it was held",
        pushed >> 20
    );
    assert!(
        pushed < 256 << 20,
        "a client pushed 256 MiB without being held"
    );
    // Held: the total is reached and stays there; reads wait for it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let text = scrape(&metrics).await;
    let (buffered, peak, waiting) = (
        sample(&text, "minicri_port_forward_buffered_bytes"),
        sample(&text, "minicri_port_forward_buffered_bytes_peak"),
        sample(&text, "minicri_port_forward_buffer_waiting"),
    );
    let grown = rss(pid).saturating_sub(before);
    eprintln!(
        "buffered {buffered} B, peak {peak} B, {waiting} reads waiting; RSS grew {} MiB",
        grown >> 20
    );
    assert!(buffered <= LIMIT && peak <= LIMIT, "{text}");
    assert!(
        buffered >= LIMIT / 2,
        "the clients did not fill the total: {text}"
    );
    assert!(waiting > 0, "nothing waits for room: {text}");
    assert!(grown < 3 * LIMIT, "the daemon's RSS grew by {grown} bytes");

    // The sessions go: their bytes come back, and forwarding works again.
    drop(sessions);
    drop(reader);
    drop(ws);
    assert_eq!(
        drained(&metrics).await,
        0,
        "bytes still charged after the sessions ended"
    );
    let mut pf = PortForward::connect(&port_forward(&mut c, &sb, &[]).await.unwrap())
        .await
        .unwrap();
    let (_, data) = pf.open(8080).await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), pf.read_data(data, 4 << 20))
        .await
        .expect("a new session reads in 30 s")
        .unwrap();
    drop(pf);
    stop_and_remove_pod(&mut c, &sb).await;
}

/// A port-forward client of one pod that never reads cannot stall another pod's port-forward,
/// and holds its part of the total for the stall timeout at most. With an 8 MiB total and a
/// 3 s stall timeout: pod B's client connects; pod A's client opens 4 sessions of 32
/// connections each to a port that sends without end and reads none of it, more than the
/// whole total would take; A stops at its share (half, two pods present) with reads waiting.
/// B's forward then reads 16 MiB, twice the total, while A's sessions are still open and their
/// client still reads nothing. A's sessions are closed about 3 s after they stalled, each with
/// a warning naming the pod, its port and the setting; their connections end and their bytes
/// are given back. (With one pool for the node, B's reads waited behind A's for good.)
#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_never_reads_cannot_stall_another_pods_port_forward() {
    use minicri_tests::pull_env::{free_metrics_address, sample, scrape};
    use tokio::time::Instant;
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    const LIMIT: u64 = 8 << 20;
    const STALL: Duration = Duration::from_secs(3);
    const KEY: &str = "stream.port_forward_stall_timeout";
    const CLOSED: &str = "port-forward session closed: its client stopped reading";
    let metrics = free_metrics_address();
    let limit = LIMIT.to_string();
    let stall = STALL.as_secs().to_string();
    let env = PodEnv::with_args(&[
        "--port-forward-buffer-bytes",
        &limit,
        "--port-forward-stall-timeout",
        &stall,
        "--metrics-address",
        &metrics,
    ])
    .await;
    let image = env.pull_busybox().await;
    let mut c = env.runtime().await;
    // Two pods whose port 8080 sends zeros to each connection without end.
    let mut pods = Vec::new();
    for name in ["pf-hog", "pf-other"] {
        let pod = pod_config(name, env.logs.path());
        let sb = run_pod(&mut c, &pod).await;
        let zeros = sh_container_config("zeros", &image, "exec nc -ll -p 8080 -e cat /dev/zero");
        run_container(&mut c, &sb, &pod, zeros).await;
        until_8080_sends(&mut c, &sb).await;
        pods.push(sb);
    }
    let (hog, other) = (pods[0].clone(), pods[1].clone());
    assert_eq!(drained(&metrics).await, 0, "the first sessions' bytes stay");

    // B's client connects (its session's own buffers make B present), then A's never reads.
    let mut b = PortForward::connect(&port_forward(&mut c, &other, &[]).await.unwrap())
        .await
        .unwrap();
    let hog_start = Instant::now();
    let mut hogs = Vec::new();
    for _ in 0..4 {
        let url = port_forward(&mut c, &hog, &[]).await.unwrap();
        let mut pf = PortForward::connect(&url).await.unwrap();
        for _ in 0..32 {
            pf.open(8080).await.unwrap();
        }
        hogs.push(pf);
    }
    let mut held = (0, 0);
    for _ in 0..100 {
        let text = scrape(&metrics).await;
        held = (
            sample(&text, "minicri_port_forward_buffered_bytes"),
            sample(&text, "minicri_port_forward_buffer_waiting"),
        );
        if held.0 >= LIMIT / 2 && held.1 > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (buffered, waiting) = held;
    eprintln!(
        "A held {buffered} B with {waiting} reads waiting after {:?}",
        hog_start.elapsed()
    );
    assert!(
        buffered >= LIMIT / 2 && waiting > 0,
        "A's client did not fill its share: {buffered} B, {waiting} waiting"
    );

    // B reads twice the total, while A's client still reads nothing.
    let b_start = Instant::now();
    let (_, data) = b.open(8080).await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), b.read_data(data, 16 << 20))
        .await
        .expect("B's 16 MiB within 30 s")
        .unwrap();
    let b_took = b_start.elapsed();
    eprintln!(
        "B read 16 MiB in {b_took:?}, {:?} after A's client connected",
        hog_start.elapsed()
    );
    let log = env.daemon.log();
    assert!(
        !log.contains(CLOSED),
        "A's sessions were closed before B's transfer ended ({b_took:?}): B waited for A"
    );
    drop(b);
    assert!(
        buffered < LIMIT - (1 << 20),
        "A took more than its share: {buffered} B"
    );

    // A's sessions are closed after the stall timeout, each with a warning naming the pod, its
    // port and the setting.
    let deadline = hog_start + STALL + Duration::from_secs(15);
    let lines = loop {
        let log = env.daemon.log();
        let lines: Vec<String> = log
            .lines()
            .filter(|l| l.contains(CLOSED))
            .map(str::to_string)
            .collect();
        if lines.len() >= 4 || Instant::now() > deadline {
            break lines;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let closed_after = hog_start.elapsed();
    eprintln!("A's sessions closed {closed_after:?} after its client connected");
    assert_eq!(lines.len(), 4, "{lines:#?}");
    eprintln!("{}", lines[0]);
    for l in &lines {
        assert!(
            l.contains(&hog) && l.contains("8080") && l.contains(KEY),
            "{l}"
        );
    }
    assert!(closed_after >= STALL, "closed after {closed_after:?}");
    // Their connections end: what the client had not read, then EOF.
    for mut pf in hogs {
        let left = tokio::time::timeout(Duration::from_secs(10), pf.read_until_closed())
            .await
            .expect("A's connection closed");
        eprintln!("a closed session of A left {} KiB unread", left >> 10);
    }
    assert_eq!(
        drained(&metrics).await,
        0,
        "bytes still charged after the sessions ended"
    );
    for sb in &pods {
        stop_and_remove_pod(&mut c, sb).await;
    }
}

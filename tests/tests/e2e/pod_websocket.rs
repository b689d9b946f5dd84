//! Black-box tests of streaming over WebSocket (what client-go's WebSocket executor and
//! tunnelling dialer, `crictl exec/attach/port-forward -r websocket` and critest's `-websocket-*`
//! flags use), on the same URLs as SPDY: exec under v5 (`v5.channel.k8s.io`: output channels,
//! the v4 status on the error channel, the close signal ending stdin, a terminal and its
//! resizes) and v4; attach (input, output, detach); port-forward as SPDY tunnelled through
//! WebSocket (`SPDY/3.1+portforward.k8s.io`) and as the kubelet's per-port channels
//! (`v4.channel.k8s.io`, ports in the query); and the handshake's refusals.
//!
//! Root only, with runc and Debian's CNI plugins ([`skip_reason`]).

use std::time::Duration;

use minicri_proto::runtime::v1 as cri;
use minicri_tests::pod_env::{PodEnv, pod_config, skip_reason};
use minicri_tests::pod_rpc::{
    RuntimeClient, container_status, exec_text, run_container, run_http_server, run_pod,
    sh_container_config, stop_and_remove_pod,
};
use minicri_tests::remotecommand::{
    self, ExecOptions, ExecOutput, PortForward, Session, SessionOptions, Transport,
};
use minicri_tests::websocket::{self, Ws};

const V5: Transport = Transport::WebSocket(&["v5.channel.k8s.io"]);
const V4: Transport = Transport::WebSocket(&["v4.channel.k8s.io"]);
const WAIT: Duration = Duration::from_secs(20);
const GET: &[u8] = b"GET / HTTP/1.0\r\nHost: localhost\r\n\r\n";

async fn exec_url(c: &mut RuntimeClient, id: &str, cmd: &[&str], stdin: bool, tty: bool) -> String {
    c.exec(cri::ExecRequest {
        container_id: id.into(),
        cmd: cmd.iter().map(|s| s.to_string()).collect(),
        tty,
        stdin,
        stdout: true,
        stderr: !tty,
    })
    .await
    .expect("Exec")
    .into_inner()
    .url
}

/// Exec over WebSocket with stdout (and stderr, without a terminal), as `crictl exec -r
/// websocket` does.
async fn ws_exec(
    url: &str,
    transport: Transport,
    stdin: Option<&[u8]>,
    tty: Option<(u16, u16)>,
) -> ExecOutput {
    remotecommand::exec_with(
        url,
        ExecOptions {
            stdin,
            stdout: true,
            stderr: tty.is_none(),
            tty,
            transport,
        },
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn exec_and_attach_over_websocket() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let env = PodEnv::new().await;
    let image = env.pull_busybox().await;
    let mut c = env.runtime().await;
    let pod = pod_config("wsexec", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    let id = run_container(
        &mut c,
        &sb,
        &pod,
        cri::ContainerConfig {
            stdin: true,
            ..sh_container_config("shell", &image, "while read l; do echo got:$l; done")
        },
    )
    .await;

    // v5: stdout and stderr on their channels, a non-zero exit as a v4 status.
    let url = exec_url(
        &mut c,
        &id,
        &["sh", "-c", "echo out; echo err >&2; exit 3"],
        false,
        false,
    )
    .await;
    let out = ws_exec(&url, V5, None, None).await;
    assert_eq!(out.protocol, "v5.channel.k8s.io");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "out\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "err\n");
    let status = out.status();
    assert_eq!(status["status"], "Failure", "{status}");
    assert_eq!(status["reason"], "NonZeroExitCode");
    assert_eq!(status["details"]["causes"][0]["message"], "3");

    // v5's close signal on stdin is the process's EOF: cat ends.
    let input: Vec<u8> = (0..100_000u32).map(|i| b'a' + (i % 26) as u8).collect();
    let url = exec_url(
        &mut c,
        &id,
        &["sh", "-c", "cat; echo cat-done"],
        true,
        false,
    )
    .await;
    let out = ws_exec(&url, V5, Some(&input), None).await;
    let mut want = input.clone();
    want.extend_from_slice(b"cat-done\n");
    assert!(out.stdout == want, "{} bytes of output", out.stdout.len());
    assert_eq!(out.status()["status"], "Success");

    // v4 over WebSocket: the same channels, no close signal.
    let url = exec_url(&mut c, &id, &["echo", "from-v4"], false, false).await;
    let out = ws_exec(&url, V4, None, None).await;
    assert_eq!(out.protocol, "v4.channel.k8s.io");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "from-v4\n");
    assert_eq!(out.status()["status"], "Success");

    // A terminal: the resize channel sets its size.
    let url = exec_url(
        &mut c,
        &id,
        &[
            "sh",
            "-c",
            "while [ \"$(stty size)\" != '30 100' ]; do sleep 0.05; done; stty size",
        ],
        true,
        true,
    )
    .await;
    let out = ws_exec(&url, V5, Some(b""), Some((100, 30))).await;
    assert!(String::from_utf8_lossy(&out.stdout).ends_with("30 100\r\n"));
    assert_eq!(out.status()["status"], "Success");

    // A client that hangs up gets its process killed.
    let url = exec_url(
        &mut c,
        &id,
        &["sh", "-c", "echo started; exec sleep 1000"],
        false,
        false,
    )
    .await;
    let mut s = Session::open_with(
        &url,
        SessionOptions {
            transport: V5,
            stdout: true,
            stderr: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    s.read_stdout_until("started", WAIT).await.unwrap();
    drop(s);
    let mut gone = false;
    for _ in 0..100 {
        let (_, ps, _) = exec_text(&mut c, &id, &["ps", "-o", "args"], 10).await;
        if !ps.contains("sleep 1000") {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(gone, "the exec's process was not killed");

    // Attach: input reaches the container, its output comes back; hanging up detaches.
    let url = c
        .attach(cri::AttachRequest {
            container_id: id.clone(),
            stdin: true,
            tty: false,
            stdout: true,
            stderr: true,
        })
        .await
        .expect("Attach")
        .into_inner()
        .url;
    let mut s = Session::open_with(
        &url,
        SessionOptions {
            transport: V5,
            stdin: true,
            stdout: true,
            stderr: true,
            tty: false,
        },
    )
    .await
    .unwrap();
    assert_eq!(s.protocol, "v5.channel.k8s.io");
    s.send(b"over-websocket\n").await.unwrap();
    s.read_stdout_until("got:over-websocket\n", WAIT)
        .await
        .unwrap();
    drop(s);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let st = container_status(&mut c, &id).await;
    assert_eq!(st.state, cri::ContainerState::ContainerRunning as i32);

    // The handshake's refusals; each consumes its token.
    let url = exec_url(&mut c, &id, &["true"], false, false).await;
    let a = websocket::upgrade(
        &url,
        "GET",
        &["v5.channel.k8s.io"],
        &["Sec-WebSocket-Version: 8"],
    )
    .await
    .unwrap();
    assert_eq!(a.status, 426, "{}", a.head);
    assert_eq!(a.header("sec-websocket-version").as_deref(), Some("13"));
    let again = websocket::upgrade(&url, "GET", &["v5.channel.k8s.io"], &[])
        .await
        .unwrap();
    assert_eq!(again.status, 404, "single use: {}", again.head);
    let url = exec_url(&mut c, &id, &["true"], false, false).await;
    let a = websocket::upgrade(&url, "GET", &["v9.channel.k8s.io"], &[])
        .await
        .unwrap();
    assert_eq!(a.status, 403, "{}", a.head);
    let url = exec_url(&mut c, &id, &["true"], false, false).await;
    let a = websocket::upgrade(&url, "POST", &["v5.channel.k8s.io"], &[])
        .await
        .unwrap();
    assert_eq!(a.status, 400, "{}", a.head);
    // SPDY still works on the same server.
    let url = exec_url(&mut c, &id, &["echo", "spdy"], false, false).await;
    let out = remotecommand::exec(&url, None, true, true).await.unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "spdy\n");

    stop_and_remove_pod(&mut c, &sb).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn port_forward_over_websocket() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let env = PodEnv::new().await;
    let image = env.pull_busybox().await;
    let mut c = env.runtime().await;
    let pod = pod_config("wsforward", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    run_http_server(&mut c, &sb, &pod, &image, "hello-through-websocket").await;
    let url = || {
        let mut c = c.clone();
        let sb = sb.clone();
        async move {
            c.port_forward(cri::PortForwardRequest {
                pod_sandbox_id: sb,
                port: vec![8080],
            })
            .await
            .expect("PortForward")
            .into_inner()
            .url
        }
    };

    // SPDY tunnelled through WebSocket: two connections on one session, then a refused one.
    let mut pf = PortForward::connect_websocket(&url().await)
        .await
        .expect("upgrade");
    assert_eq!(
        pf.protocol, "spdy/3.1+portforward.k8s.io",
        "header values are lowercased"
    );
    for round in 0..2 {
        let out = pf.forward(8080, GET).await.expect("forward");
        out.assert_http_ok("hello-through-websocket\n", &format!("round {round}"));
    }
    let out = pf
        .forward(8081, b"")
        .await
        .expect("forward to a closed port");
    let msg = String::from_utf8_lossy(&out.error);
    assert!(msg.contains("failed to connect to localhost:8081"), "{msg}");
    drop(pf);

    // The per-port channel form: the port comes from the query.
    let out = remotecommand::port_forward_channels(&url().await, 8080, GET)
        .await
        .expect("channel form");
    out.assert_http_ok("hello-through-websocket\n", "channel form");
    let out = remotecommand::port_forward_channels(&url().await, 8081, b"")
        .await
        .expect("channel form to a closed port");
    let msg = String::from_utf8_lossy(&out.error);
    assert!(
        msg.contains("failed to connect to localhost:8081") && msg.contains(&sb),
        "{msg}"
    );
    // Without a port the channel form is refused; so is a subprotocol not spoken here.
    let a = websocket::upgrade(&url().await, "GET", &["v4.channel.k8s.io"], &[])
        .await
        .unwrap();
    assert_eq!(a.status, 400, "{}", a.head);
    let a = websocket::upgrade(&url().await, "GET", &["v5.channel.k8s.io"], &[])
        .await
        .unwrap();
    assert_eq!(a.status, 403, "{}", a.head);
    // A session that never forwards still answers the closing handshake.
    let mut ws = Ws::connect(&url().await, &["SPDY/3.1+portforward.k8s.io"])
        .await
        .unwrap();
    ws.close(1000).await.unwrap();
    let end = tokio::time::timeout(WAIT, ws.message())
        .await
        .expect("the server answers");
    assert!(end.unwrap().is_none());

    stop_and_remove_pod(&mut c, &sb).await;
}

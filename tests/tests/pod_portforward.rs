//! Black-box tests of port forwarding: the PortForward RPC hands out a loopback URL, a
//! `portforward.k8s.io` client ([`minicri_tests::remotecommand::PortForward`], SPDY/3.1 like
//! client-go) connects to it and forwards TCP connections to a busybox httpd listening on
//! 127.0.0.1:8080 inside the pod's network namespace. Also: two connections on one session, a
//! refused connection reported on the error stream, a token works once, the RPC's refusals, and
//! a host-network pod forwarding to the host's loopback.
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

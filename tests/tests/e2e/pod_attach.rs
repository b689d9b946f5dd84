//! Black-box tests of Attach: the RPC hands out a loopback URL, a remotecommand client
//! ([`minicri_tests::remotecommand::Session`], SPDY/3.1 like client-go) connects to it and is
//! wired to the container's own stdio through its shim: what it sends reaches the container's
//! stdin, the container's output reaches it and the CRI log alike. Detaching leaves the
//! container running; with `stdin_once` the end of the first session's stdin closes the
//! container's, and the session ends when the container exits, with nothing on the error
//! stream. Also the RPC's refusals.
//!
//! Root only, with runc and Debian's CNI plugins ([`skip_reason`]).

use std::time::Duration;

use minicri_proto::runtime::v1 as cri;
use minicri_tests::pod_env::{PodEnv, eventually, pod_config, skip_reason};
use minicri_tests::pod_rpc::{
    RuntimeClient, container_status, create_container, run_container, run_pod, sh_container_config,
    stop_and_remove_pod,
};
use minicri_tests::remotecommand::{CLIENT_GO_PROTOCOLS, Session, upgrade};

const ECHO: &str = "while read l; do echo got:$l; done; echo stdin-closed";
const WAIT: Duration = Duration::from_secs(20);

fn with_stdin(config: cri::ContainerConfig, once: bool) -> cri::ContainerConfig {
    cri::ContainerConfig {
        stdin: true,
        stdin_once: once,
        ..config
    }
}

fn attach_request(id: &str, stdin: bool) -> cri::AttachRequest {
    cri::AttachRequest {
        container_id: id.into(),
        stdin,
        tty: false,
        stdout: true,
        stderr: true,
    }
}

async fn attach_url(c: &mut RuntimeClient, req: cri::AttachRequest) -> String {
    c.attach(req).await.expect("Attach").into_inner().url
}

async fn attach_err(c: &mut RuntimeClient, req: cri::AttachRequest) -> tonic::Status {
    c.attach(req).await.expect_err("Attach must fail")
}

fn running(s: &cri::ContainerStatus) -> bool {
    s.state == cri::ContainerState::ContainerRunning as i32
}

#[tokio::test(flavor = "multi_thread")]
async fn attach_relays_stdin_and_output_and_detaches() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let env = PodEnv::new().await;
    let image = env.pull_busybox().await;
    let mut c = env.runtime().await;
    let pod = pod_config("attach", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;

    // A container reading its stdin, kept open across sessions (no stdin_once).
    let id = run_container(
        &mut c,
        &sb,
        &pod,
        with_stdin(sh_container_config("echo", &image, ECHO), false),
    )
    .await;
    let url = attach_url(&mut c, attach_request(&id, true)).await;
    let rest = url
        .strip_prefix("http://127.0.0.1:")
        .expect("a loopback URL");
    let (port, token) = rest.split_once("/attach/").expect("/attach/<token>");
    assert!(port.parse::<u16>().unwrap() > 0, "{url}");
    assert!(token.len() >= 16, "{url}");
    let mut s = Session::open(&url, true, true, true).await.unwrap();
    assert_eq!(s.protocol, "v4.channel.k8s.io");
    s.send(b"hello\n").await.unwrap();
    s.read_stdout_until("got:hello\n", WAIT).await.unwrap();
    assert_eq!(String::from_utf8_lossy(&s.stdout), "got:hello\n");
    assert!(s.stderr.is_empty());

    // The same output is in the CRI log, written by the shim.
    let log = env.logs.path().join("echo/0.log");
    eventually("got:hello in the CRI log", || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains(" stdout F got:hello\n")
    })
    .await;

    // The token was used: a second connection is refused.
    let again = upgrade(&url, &CLIENT_GO_PROTOCOLS).await.unwrap();
    assert_eq!(again.status, 404, "{}", again.head);

    // The client's FIN on stdin, without stdin_once, leaves the container's stdin open; so
    // does hanging up (detach). The container runs on.
    s.close_stdin().await.unwrap();
    drop(s);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(running(&container_status(&mut c, &id).await));

    // A second session: its input reaches the container, and it sees only new output.
    let url = attach_url(&mut c, attach_request(&id, true)).await;
    let mut s = Session::open(&url, true, true, true).await.unwrap();
    s.send(b"again\n").await.unwrap();
    s.read_stdout_until("got:again\n", WAIT).await.unwrap();
    assert_eq!(String::from_utf8_lossy(&s.stdout), "got:again\n");
    // A stdout-only observer sees the output of the other session's input.
    let url = attach_url(
        &mut c,
        cri::AttachRequest {
            stdin: false,
            stderr: false,
            ..attach_request(&id, false)
        },
    )
    .await;
    let mut watcher = Session::open(&url, false, true, false).await.unwrap();
    // The watcher cannot tell when its session is wired to the shim: keep feeding lines until
    // it sees one.
    let feeder = tokio::spawn(async move {
        for _ in 0..200 {
            if s.send(b"third\n").await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    watcher
        .read_stdout_until("got:third\n", WAIT)
        .await
        .unwrap();
    feeder.abort();
    drop(watcher);

    // stdin_once: the end of the first session's stdin closes the container's; the container
    // exits and the session ends with every stream finished and no status.
    let once = run_container(
        &mut c,
        &sb,
        &pod,
        with_stdin(sh_container_config("once", &image, ECHO), true),
    )
    .await;
    let url = attach_url(&mut c, attach_request(&once, true)).await;
    let mut s = Session::open(&url, true, true, true).await.unwrap();
    s.send(b"only\n").await.unwrap();
    s.read_stdout_until("got:only\n", WAIT).await.unwrap();
    s.close_stdin().await.unwrap();
    s.read_until(WAIT, |s| s.ended()).await.unwrap();
    assert_eq!(
        String::from_utf8_lossy(&s.stdout),
        "got:only\nstdin-closed\n"
    );
    assert!(
        s.error.is_empty(),
        "{:?}",
        String::from_utf8_lossy(&s.error)
    );
    for _ in 0..100 {
        if !running(&container_status(&mut c, &once).await) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let st = container_status(&mut c, &once).await;
    assert_eq!(st.state, cri::ContainerState::ContainerExited as i32);
    assert_eq!(st.exit_code, 0);
    let e = attach_err(&mut c, attach_request(&once, false)).await;
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains(&once), "{e:?}");

    // A container without stdin: output can be attached to, stdin cannot; its stdin is still
    // /dev/null (read sees EOF at once).
    let ticker = run_container(
        &mut c,
        &sb,
        &pod,
        sh_container_config(
            "ticker",
            &image,
            "read l; echo eof:$?; while true; do echo tick >&2; sleep 0.2; done",
        ),
    )
    .await;
    let url = attach_url(&mut c, attach_request(&ticker, false)).await;
    let mut s = Session::open(&url, false, true, true).await.unwrap();
    s.read_until(WAIT, |s| s.stderr.starts_with(b"tick\n"))
        .await
        .unwrap();
    drop(s);
    let log = env.logs.path().join("ticker/0.log");
    eventually("eof:1 (stdin is /dev/null) in the CRI log", || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains(" stdout F eof:1\n")
    })
    .await;
    let e = attach_err(&mut c, attach_request(&ticker, true)).await;
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains(&ticker), "{e:?}");

    // Refusals of the RPC itself.
    let e = attach_err(&mut c, attach_request(&"f".repeat(64), false)).await;
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    assert!(e.message().contains(&"f".repeat(64)), "{e:?}");
    let created = create_container(
        &mut c,
        &sb,
        &pod,
        with_stdin(sh_container_config("idle", &image, ECHO), false),
    )
    .await
    .expect("CreateContainer");
    let e = attach_err(&mut c, attach_request(&created, true)).await;
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains(&created), "{e:?}");
    let mut tty = attach_request(&id, true);
    tty.tty = true;
    tty.stderr = false;
    let e = attach_err(&mut c, tty).await;
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let e = attach_err(
        &mut c,
        cri::AttachRequest {
            container_id: id.clone(),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");

    stop_and_remove_pod(&mut c, &sb).await;
}

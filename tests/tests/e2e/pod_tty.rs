//! Black-box tests of tty containers (CRI `ContainerConfig.tty`): the container runs on a
//! terminal its shim owns; its output reaches the CRI log as stdout lines; Attach with `tty`
//! gets that output and sends input to the terminal; the resize channel changes the terminal's
//! size (`stty size` inside); detaching leaves the container running; its exit is recorded as
//! for any container; exec with a terminal works in it; tty containers without stdin or with
//! `stdin_once` behave as the CRI says; after a daemon restart the shim still owns the terminal
//! and attaching works again.
//!
//! Root only, with runc and Debian's CNI plugins ([`skip_reason`]).

use std::time::Duration;

use minicri_proto::runtime::v1 as cri;
use minicri_tests::pod_env::{PodEnv, eventually, pod_config, skip_reason};
use minicri_tests::pod_rpc::{
    RuntimeClient, container_status, run_container, run_pod, sh_container_config,
    stop_and_remove_pod,
};
use minicri_tests::remotecommand::{self, Session, SessionOptions};

const WAIT: Duration = Duration::from_secs(20);

/// A tty container running `script`, with stdin (and `stdin_once`) as given.
fn tty_config(
    name: &str,
    image: &str,
    script: &str,
    stdin: bool,
    once: bool,
) -> cri::ContainerConfig {
    cri::ContainerConfig {
        tty: true,
        stdin,
        stdin_once: once,
        ..sh_container_config(name, image, script)
    }
}

/// An Attach URL with a terminal (stdout, and stdin when asked).
async fn attach_url(c: &mut RuntimeClient, id: &str, stdin: bool) -> String {
    c.attach(cri::AttachRequest {
        container_id: id.into(),
        stdin,
        tty: true,
        stdout: true,
        stderr: false,
    })
    .await
    .expect("Attach")
    .into_inner()
    .url
}

/// A terminal session on `url` (SPDY, as `crictl attach -it`).
async fn attach(url: &str, stdin: bool) -> Session {
    Session::open_with(
        url,
        SessionOptions {
            stdin,
            stdout: true,
            tty: true,
            ..Default::default()
        },
    )
    .await
    .expect("attach session")
}

/// Waits for container `id` to have exited; its status.
async fn exited(c: &mut RuntimeClient, id: &str) -> cri::ContainerStatus {
    for _ in 0..200 {
        let st = container_status(c, id).await;
        if st.state == cri::ContainerState::ContainerExited as i32 {
            return st;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("container {id} did not exit");
}

fn running(st: &cri::ContainerStatus) -> bool {
    st.state == cri::ContainerState::ContainerRunning as i32
}

#[tokio::test(flavor = "multi_thread")]
async fn tty_containers_log_attach_resize_and_exit() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let env = PodEnv::new().await;
    let image = env.pull_busybox().await;
    let mut c = env.runtime().await;
    let pod = pod_config("tty", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;

    // Output first, then wait for a size only a resize can give, then echo input until EOF.
    let script = "echo tty-hello; [ -t 0 ] && [ -t 1 ] && echo on-a-terminal; echo term=$TERM; \
                  while [ \"$(stty size)\" != '30 100' ]; do sleep 0.05; done; echo resized:$(stty size); \
                  while read l; do echo got:$l; done; echo eof; exit 3";
    let id = run_container(
        &mut c,
        &sb,
        &pod,
        tty_config("term", &image, script, true, false),
    )
    .await;
    let log = env.logs.path().join("term/0.log");
    eventually("the tty container's output in the CRI log", || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        text.contains(" stdout F tty-hello") && text.contains(" stdout F term=xterm")
    })
    .await;
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains(" stdout F on-a-terminal"), "{text}");
    assert!(
        !text.contains(" stderr "),
        "a terminal has one output: {text}"
    );

    // Attach with a terminal: the resize reaches the container's terminal, input is echoed and
    // read, output comes back with CR LF line ends.
    let url = attach_url(&mut c, &id, true).await;
    let mut s = attach(&url, true).await;
    assert_eq!(s.protocol, "v4.channel.k8s.io");
    s.resize(100, 30).await.unwrap();
    s.read_stdout_until("resized:30 100\r\n", WAIT)
        .await
        .unwrap();
    s.send(b"hello\n").await.unwrap();
    s.read_stdout_until("got:hello\r\n", WAIT).await.unwrap();
    assert!(s.stderr.is_empty());

    // Detach: the container runs on.
    drop(s);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(running(&container_status(&mut c, &id).await));

    // Exec with a terminal still works in a tty container.
    let url = c
        .exec(cri::ExecRequest {
            container_id: id.clone(),
            cmd: [
                "sh",
                "-c",
                "while [ \"$(stty size)\" != '24 80' ]; do sleep 0.05; done; stty size; tty",
            ]
            .map(String::from)
            .to_vec(),
            tty: true,
            stdin: true,
            stdout: true,
            stderr: false,
        })
        .await
        .expect("Exec")
        .into_inner()
        .url;
    let out = remotecommand::exec_with(
        &url,
        remotecommand::ExecOptions {
            stdin: Some(b""),
            stdout: true,
            tty: Some((80, 24)),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("24 80\r\n") && text.contains("/dev/pts/"),
        "{text:?}"
    );
    assert_eq!(out.status()["status"], "Success");

    // A second session: its input reaches the container too; ^D at the start of a line is the
    // terminal's end of file, the container exits, and the session ends with its output.
    let url = attach_url(&mut c, &id, true).await;
    let mut s = attach(&url, true).await;
    s.send(b"again\n").await.unwrap();
    s.read_stdout_until("got:again\r\n", WAIT).await.unwrap();
    s.send(&[0x04]).await.unwrap();
    s.read_until(WAIT, |s| s.ended()).await.unwrap();
    assert!(
        String::from_utf8_lossy(&s.stdout).ends_with("eof\r\n"),
        "{:?}",
        String::from_utf8_lossy(&s.stdout)
    );
    let st = exited(&mut c, &id).await;
    assert_eq!((st.exit_code, st.reason.as_str()), (3, "Error"));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains(" stdout F got:hello") && text.contains(" stdout F eof"),
        "{text}"
    );

    // Without stdin: output can be attached to, stdin cannot.
    let ticker = run_container(
        &mut c,
        &sb,
        &pod,
        tty_config(
            "ticker",
            &image,
            "while true; do echo tick; sleep 0.2; done",
            false,
            false,
        ),
    )
    .await;
    let e = c
        .attach(cri::AttachRequest {
            container_id: ticker.clone(),
            stdin: true,
            tty: true,
            stdout: true,
            stderr: false,
        })
        .await
        .expect_err("no stdin to attach to");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let url = attach_url(&mut c, &ticker, false).await;
    let mut s = attach(&url, false).await;
    s.read_stdout_until("tick\r\n", WAIT).await.unwrap();
    drop(s);

    // stdin_once: the end of the first session's input (FIN) is the terminal's EOF.
    let once = run_container(
        &mut c,
        &sb,
        &pod,
        tty_config(
            "once",
            &image,
            "while read l; do echo got:$l; done; echo closed",
            true,
            true,
        ),
    )
    .await;
    let url = attach_url(&mut c, &once, true).await;
    let mut s = attach(&url, true).await;
    s.send(b"only\n").await.unwrap();
    s.read_stdout_until("got:only\r\n", WAIT).await.unwrap();
    s.close_stdin().await.unwrap();
    s.read_until(WAIT, |s| s.ended()).await.unwrap();
    assert!(String::from_utf8_lossy(&s.stdout).ends_with("closed\r\n"));
    let st = exited(&mut c, &once).await;
    assert_eq!((st.exit_code, st.reason.as_str()), (0, "Completed"));

    stop_and_remove_pod(&mut c, &sb).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tty_container_is_attached_again_after_a_daemon_restart() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let mut env = PodEnv::new().await;
    let image = env.pull_busybox().await;
    let mut c = env.runtime().await;
    let pod = pod_config("ttyrestart", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    let script = "while [ \"$(stty size)\" != '20 90' ]; do sleep 0.05; done; echo resized; \
                  while read l; do echo got:$l; done";
    let id = run_container(
        &mut c,
        &sb,
        &pod,
        tty_config("survivor", &image, script, true, false),
    )
    .await;
    drop(c);

    env.daemon.kill();
    env.daemon.restart().await.unwrap();

    let mut c = env.runtime().await;
    assert!(running(&container_status(&mut c, &id).await));
    let url = attach_url(&mut c, &id, true).await;
    let mut s = attach(&url, true).await;
    s.resize(90, 20).await.unwrap();
    s.read_stdout_until("resized\r\n", WAIT).await.unwrap();
    s.send(b"after-restart\n").await.unwrap();
    s.read_stdout_until("got:after-restart\r\n", WAIT)
        .await
        .unwrap();
    drop(s);
    stop_and_remove_pod(&mut c, &sb).await;
}

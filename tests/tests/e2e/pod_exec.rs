//! Black-box tests of streaming exec: the Exec RPC hands out a loopback URL, a remotecommand
//! client ([`minicri_tests::remotecommand`], SPDY/3.1 like client-go) connects to it, and the
//! command runs in the container with its output on stdout / stderr and its outcome as a v4
//! status on the error stream. Also: stdin, a terminal, a token works once, and the RPC's
//! refusals.
//!
//! Root only, with runc and Debian's CNI plugins ([`skip_reason`]).

use minicri_proto::runtime::v1 as cri;
use minicri_tests::pod_env::{PodEnv, pod_config, skip_reason, write_executable};
use minicri_tests::pod_rpc::{
    RuntimeClient, create_container, run_container, run_pod, sh_container_config,
    stop_and_remove_pod,
};
use minicri_tests::remotecommand::{self, CLIENT_GO_PROTOCOLS};

/// A container that sleeps, with an environment variable and a working directory of its own.
fn container(name: &str, image: &str) -> cri::ContainerConfig {
    cri::ContainerConfig {
        envs: vec![cri::KeyValue {
            key: "GREETING".into(),
            value: "from-the-container-spec".into(),
        }],
        working_dir: "/tmp".into(),
        ..sh_container_config(name, image, "exec sleep 1000")
    }
}

fn exec_request(id: &str, cmd: &[&str]) -> cri::ExecRequest {
    cri::ExecRequest {
        container_id: id.into(),
        cmd: cmd.iter().map(|s| s.to_string()).collect(),
        tty: false,
        stdin: false,
        stdout: true,
        stderr: true,
    }
}

async fn exec_url(c: &mut RuntimeClient, req: cri::ExecRequest) -> String {
    c.exec(req).await.expect("Exec").into_inner().url
}

async fn exec_err(c: &mut RuntimeClient, req: cri::ExecRequest) -> tonic::Status {
    c.exec(req).await.expect_err("Exec must fail")
}

#[tokio::test(flavor = "multi_thread")]
async fn exec_streams_output_exit_codes_and_stdin() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let env = PodEnv::new().await;
    let image = env.pull_busybox().await;
    let mut c = env.runtime().await;
    let pod = pod_config("exec", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    let id = run_container(&mut c, &sb, &pod, container("shell", &image)).await;

    // A zero exit: output on its streams, the v4 Success status, in the container's settings.
    let url = exec_url(
        &mut c,
        exec_request(
            &id,
            &[
                "sh",
                "-c",
                "echo $GREETING; pwd; hostname; echo to-stderr >&2",
            ],
        ),
    )
    .await;
    let rest = url
        .strip_prefix("http://127.0.0.1:")
        .expect("a loopback URL");
    let (port, token) = rest.split_once("/exec/").expect("/exec/<token>");
    assert!(port.parse::<u16>().unwrap() > 0, "{url}");
    assert!(
        token.len() >= 16 && token.bytes().all(|b| b.is_ascii_alphanumeric()),
        "{url}"
    );
    let out = remotecommand::exec(&url, None, true, true).await.unwrap();
    assert_eq!(out.protocol, "v4.channel.k8s.io");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "from-the-container-spec\n/tmp\nexec\n"
    );
    assert_eq!(out.stderr, b"to-stderr\n");
    assert_eq!(out.error, br#"{"metadata":{},"status":"Success"}"#);

    // The token was used: a second connection is refused with 404.
    let again = remotecommand::upgrade(&url, &CLIENT_GO_PROTOCOLS)
        .await
        .unwrap();
    assert_eq!(again.status, 404, "{}", again.head);

    // A non-zero exit: the code is a cause of reason ExitCode, as client-go reads it.
    let url = exec_url(
        &mut c,
        exec_request(&id, &["sh", "-c", "echo out; echo err >&2; exit 3"]),
    )
    .await;
    let out = remotecommand::exec(&url, None, true, true).await.unwrap();
    assert_eq!(out.stdout, b"out\n");
    assert_eq!(out.stderr, b"err\n");
    let status = out.status();
    assert_eq!(status["status"], "Failure", "{status}");
    assert_eq!(status["reason"], "NonZeroExitCode", "{status}");
    assert_eq!(status["details"]["causes"][0]["reason"], "ExitCode");
    assert_eq!(status["details"]["causes"][0]["message"], "3");

    // A command that does not exist: a Failure status that says so.
    let url = exec_url(&mut c, exec_request(&id, &["no-such-command"])).await;
    let out = remotecommand::exec(&url, None, true, true).await.unwrap();
    let status = out.status();
    assert_eq!(status["status"], "Failure", "{status}");
    assert!(
        status["message"]
            .as_str()
            .unwrap_or("")
            .contains("no-such-command"),
        "{status}"
    );

    // stdin, larger than a SPDY window, reaches the process; its FIN is the process's EOF.
    let input: Vec<u8> = (0..200_000u32).map(|i| b'a' + (i % 26) as u8).collect();
    let mut req = exec_request(&id, &["sh", "-c", "wc -c; echo done"]);
    req.stdin = true;
    req.stderr = false;
    let url = exec_url(&mut c, req).await;
    let out = remotecommand::exec(&url, Some(&input), true, false)
        .await
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "200000\ndone\n");
    assert_eq!(out.status()["status"], "Success");

    // A terminal: the process sees a tty of the size sent on the resize stream, TERM is set,
    // stderr is merged into stdout with CR LF line ends.
    let mut req = exec_request(
        &id,
        &[
            "sh",
            "-c",
            "while [ \"$(stty size)\" != '30 100' ]; do sleep 0.05; done; \
             tty; echo $TERM; echo to-stderr >&2; stty size",
        ],
    );
    req.tty = true;
    req.stdin = true;
    req.stderr = false;
    let url = exec_url(&mut c, req).await;
    let out = remotecommand::exec_with(
        &url,
        remotecommand::ExecOptions {
            stdin: Some(b""),
            stdout: true,
            stderr: false,
            tty: Some((100, 30)),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("/dev/pts/"), "{text:?}");
    assert!(text.contains("xterm\r\n"), "{text:?}");
    assert!(text.contains("to-stderr\r\n"), "{text:?}");
    assert!(text.ends_with("30 100\r\n"), "{text:?}");
    assert_eq!(out.status()["status"], "Success");

    // Output larger than a SPDY window, to a client that never sends WINDOW_UPDATE.
    let url = exec_url(
        &mut c,
        exec_request(&id, &["sh", "-c", "head -c 3000000 /dev/zero"]),
    )
    .await;
    let out = remotecommand::exec(&url, None, true, true).await.unwrap();
    assert_eq!(out.stdout.len(), 3_000_000);
    assert_eq!(out.status()["status"], "Success");

    // Refusals of the RPC itself.
    let e = exec_err(&mut c, exec_request(&"f".repeat(64), &["true"])).await;
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    assert!(e.message().contains(&"f".repeat(64)), "{e:?}");
    let created = create_container(&mut c, &sb, &pod, container("idle", &image))
        .await
        .expect("CreateContainer");
    let e = exec_err(&mut c, exec_request(&created, &["true"])).await;
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains(&created), "{e:?}");
    let e = exec_err(&mut c, exec_request(&id, &[])).await;
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let mut tty_and_stderr = exec_request(&id, &["true"]);
    tty_and_stderr.tty = true;
    let e = exec_err(&mut c, tty_and_stderr).await;
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let mut no_streams = exec_request(&id, &["true"]);
    no_streams.stdout = false;
    no_streams.stderr = false;
    let e = exec_err(&mut c, no_streams).await;
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");

    // The streaming server itself refuses what it does not serve.
    let base = url.split("/exec/").next().unwrap();
    let up = remotecommand::upgrade(&format!("{base}/exec/not-a-token"), &CLIENT_GO_PROTOCOLS)
        .await
        .unwrap();
    assert_eq!(up.status, 404);
    let url = exec_url(&mut c, exec_request(&id, &["true"])).await;
    let up = remotecommand::upgrade(&url, &["v99.channel.k8s.io"])
        .await
        .unwrap();
    assert_eq!(up.status, 403, "{}", up.head);

    stop_and_remove_pod(&mut c, &sb).await;
}

/// A tty exec whose client ends its input at once, before `runc exec` has started (a runtime
/// wrapper holds it back 0.5 s): the end of input reaches the command as the end of input, not
/// as a NUL typed into its terminal (the pty handed to runc was in canonical mode until runc
/// made it raw, and cooked the ^D into a NUL).
#[tokio::test(flavor = "multi_thread")]
async fn a_tty_execs_input_ended_before_the_runtime_runs_is_the_end_of_input() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let wrapper = dir.path().join("slow-exec-runc");
    write_executable(
        &wrapper,
        "#!/bin/sh\ncase \" $* \" in *\" exec \"*) sleep 0.5;; esac\nexec runc \"$@\"\n",
    );
    let env = PodEnv::with_args(&["--oci-runtime", wrapper.to_str().unwrap()]).await;
    let image = env.pull_busybox().await;
    let mut c = env.runtime().await;
    let pod = pod_config("exec-eof", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    let id = run_container(&mut c, &sb, &pod, container("shell", &image)).await;
    let mut req = exec_request(&id, &["sh", "-c", "cat >/dev/null; echo got-eof"]);
    req.tty = true;
    req.stdin = true;
    req.stderr = false;
    let url = exec_url(&mut c, req).await;
    let out = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        remotecommand::exec_with(
            &url,
            remotecommand::ExecOptions {
                stdin: Some(b""),
                stdout: true,
                stderr: false,
                tty: Some((80, 24)),
                ..Default::default()
            },
        ),
    )
    .await
    .expect("cat saw the end of its input")
    .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("got-eof"), "{text:?}");
    assert!(!text.contains("^@"), "{text:?}");
    assert_eq!(out.status()["status"], "Success");
}

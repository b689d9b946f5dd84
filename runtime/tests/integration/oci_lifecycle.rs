//! Sandboxes and containers through shim + runc, as root: logs, exit codes, exec, stop, delete,
//! user resolution, and the sandbox's namespaces and files.

use crate::oci_support;

use std::time::Duration;

use minicri::logs::Stream;
use minicri::oci::{ExecOpts, OciRuntime};
use minicri_proto::runtime::v1 as cri;
use oci_spec::runtime::Process;
use oci_support::{Container, Sandbox, TestEnv, command, require_root, sandbox_config};

fn process(args: &[&str]) -> Process {
    let mut p = Process::default();
    p.set_args(Some(args.iter().map(|s| s.to_string()).collect()));
    p.set_env(Some(vec!["PATH=/bin".into()]));
    p.set_rlimits(None);
    p.set_capabilities(None);
    p.set_terminal(Some(false));
    p
}

#[tokio::test]
async fn stdout_and_stderr_land_in_the_cri_log() {
    require_root!();
    let env = TestEnv::new();
    let sb = Sandbox::start(&env, "logs-sb", sandbox_config("logs")).await;
    let c = Container::run(
        &env,
        &sb,
        "logs",
        command(&[
            "sh",
            "-c",
            "echo out1; echo err1 >&2; echo out2; printf tail",
        ]),
    )
    .await;
    let exit = c.wait().await;
    assert_eq!(exit.exit_code, 0);
    let raw = std::fs::read_to_string(&c.log).unwrap();
    for line in raw.lines() {
        let e =
            minicri::logs::parse_entry(line.as_bytes()).unwrap_or_else(|e| panic!("{line:?}: {e}"));
        assert!(!e.partial);
        // `2026-11-21T10:49:26.123456789Z stdout F out1`
        assert_eq!(line.as_bytes()[10], b'T');
        assert_eq!(
            line.split(' ').next().unwrap().len(),
            30,
            "nine fraction digits: {line}"
        );
    }
    let lines = c.lines();
    let stdout: Vec<&str> = lines
        .iter()
        .filter(|(s, _)| *s == Stream::Stdout)
        .map(|(_, l)| l.as_str())
        .collect();
    assert_eq!(
        stdout,
        ["out1", "out2", "tail"],
        "unterminated output is a final line at EOF"
    );
    assert!(lines.contains(&(Stream::Stderr, "err1".to_string())));
}

#[tokio::test]
async fn exit_codes_are_recorded() {
    require_root!();
    let env = TestEnv::new();
    let sb = Sandbox::start(&env, "exit-sb", sandbox_config("exit")).await;
    let c = Container::run(&env, &sb, "exit3", command(&["sh", "-c", "exit 3"])).await;
    let exit = c.wait().await;
    assert_eq!((exit.exit_code, exit.signal), (3, None));
    assert_eq!(exit.pid, c.shim().init_pid);
    let on_disk = c.shim().exit_record().unwrap().unwrap();
    assert_eq!(on_disk, exit);
    let t = chrono::DateTime::parse_from_rfc3339(&exit.exited_at).unwrap();
    assert_eq!(t.timestamp_nanos_opt().unwrap(), exit.exited_at_ns);
    assert!(
        (chrono::Utc::now().timestamp_nanos_opt().unwrap() - exit.exited_at_ns) < 60_000_000_000
    );
    // The shim is gone, its socket removed; waiting again reads the exit file.
    oci_support::eventually("shim exit", || !c.shim().is_alive()).await;
    assert!(!c.shim().paths.socket().exists());
    assert_eq!(c.shim().wait().await.unwrap(), exit);
    assert!(
        c.shim().reopen_log().await.is_err(),
        "no reopening for an exited container"
    );
    assert_eq!(env.runc.state(&c.id).await.unwrap().status, "stopped");
}

#[tokio::test]
async fn stop_kill_and_delete() {
    require_root!();
    let env = TestEnv::new();
    let sb = Sandbox::start(&env, "stop-sb", sandbox_config("stop")).await;
    // `sleep` is PID 1 of its own PID namespace: SIGTERM without a handler does nothing.
    let c = Container::run(&env, &sb, "stop", command(&["sleep", "1000"])).await;
    let st = env.runc.state(&c.id).await.unwrap();
    assert_eq!((st.status.as_str(), st.pid), ("running", c.shim().init_pid));
    assert_eq!(c.shim().state().await.unwrap(), None);
    env.runc.kill(&c.id, libc::SIGTERM, false).await.unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(500), c.shim().wait())
            .await
            .is_err(),
        "SIGTERM is ignored by PID 1"
    );
    env.runc.kill(&c.id, libc::SIGKILL, false).await.unwrap();
    let exit = c.wait().await;
    assert_eq!((exit.exit_code, exit.signal), (137, Some(9)));
    env.runc.delete(&c.id, false).await.unwrap();
    assert!(env.runc.state(&c.id).await.unwrap_err().is_not_found());
    env.runc.delete(&c.id, true).await.unwrap();
    assert!(
        env.runc
            .delete(&c.id, false)
            .await
            .unwrap_err()
            .is_not_found()
    );
    assert!(env.runc.start(&c.id).await.unwrap_err().is_not_found());

    // A created container that is never started can be force-deleted; the shim records it.
    let created = Container::create(&env, &sb, "never", command(&["true"])).await;
    assert_eq!(env.runc.state(&created.id).await.unwrap().status, "created");
    env.runc.delete(&created.id, true).await.unwrap();
    assert_eq!(created.wait().await.signal, Some(9));

    // The infra process exits 0 on SIGTERM.
    env.runc.kill(&sb.id, libc::SIGTERM, false).await.unwrap();
    let sb_exit = tokio::time::timeout(Duration::from_secs(10), sb.shim.as_ref().unwrap().wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(sb_exit.exit_code, 0);
}

#[tokio::test]
async fn exec_in_a_running_container() {
    require_root!();
    let env = TestEnv::new();
    let sb = Sandbox::start(&env, "exec-sb", sandbox_config("exec")).await;
    let c = Container::run(&env, &sb, "exec", command(&["sleep", "1000"])).await;
    let opts = |args: &[&str]| ExecOpts {
        id: c.id.clone(),
        process: process(args),
        stdin: None,
        timeout: None,
    };

    let out = env
        .runc
        .exec(opts(&["sh", "-c", "echo hi; echo err >&2; exit 4"]))
        .await
        .unwrap();
    assert_eq!(
        (
            out.exit_code,
            out.stdout.as_slice(),
            out.stderr.as_slice(),
            out.timed_out
        ),
        (4, &b"hi\n"[..], &b"err\n"[..], false)
    );

    let mut with_stdin = opts(&["cat"]);
    with_stdin.stdin = Some(b"piped input".to_vec());
    assert_eq!(
        env.runc.exec(with_stdin).await.unwrap().stdout,
        b"piped input"
    );

    let mut slow = opts(&["sleep", "30"]);
    slow.timeout = Some(Duration::from_millis(300));
    let t0 = std::time::Instant::now();
    let out = env.runc.exec(slow).await.unwrap();
    assert!(out.timed_out && out.exit_code == 137, "{out:?}");
    assert!(t0.elapsed() < Duration::from_secs(10));

    let err = env.runc.exec(opts(&["/no/such/binary"])).await.unwrap_err();
    assert!(
        matches!(err, minicri::oci::OciError::Runtime { .. }),
        "{err}"
    );

    // Piped, for streaming.
    let mut p = env
        .runc
        .exec_spawn(opts(&["sh", "-c", "read x; echo got:$x; exit 2"]))
        .await
        .unwrap();
    {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stdin = p.child.stdin.take().unwrap();
        stdin.write_all(b"abc\n").await.unwrap();
        drop(stdin);
        let mut s = String::new();
        p.child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut s)
            .await
            .unwrap();
        assert_eq!(s, "got:abc\n");
    }
    assert_eq!(p.wait().await.unwrap(), 2);

    let pid = env
        .runc
        .exec_detached(&c.id, process(&["sleep", "1000"]))
        .await
        .unwrap();
    assert!(pid > 0 && std::path::Path::new(&format!("/proc/{pid}")).exists());
    // Pause/resume and update go through.
    env.runc.pause(&c.id).await.unwrap();
    assert_eq!(env.runc.state(&c.id).await.unwrap().status, "paused");
    env.runc.resume(&c.id).await.unwrap();
    let r = minicri::spec::container::linux_resources(
        &cri::LinuxContainerResources {
            cpu_shares: 256,
            ..Default::default()
        },
        &env.host,
    )
    .unwrap();
    env.runc.update(&c.id, &r).await.unwrap();
    assert!(env.runc.list().await.unwrap().iter().any(|s| s.id == c.id));
    assert!(
        std::fs::read_dir(env.runc.scratch_dir())
            .unwrap()
            .next()
            .is_none(),
        "scratch files are removed"
    );
}

#[tokio::test]
async fn user_from_etc_passwd() {
    require_root!();
    let env = TestEnv::new();
    let sb = Sandbox::start(&env, "user-sb", sandbox_config("user")).await;
    let mut cfg = command(&["id"]);
    cfg.linux = Some(cri::LinuxContainerConfig {
        security_context: Some(cri::LinuxContainerSecurityContext {
            run_as_username: "app".into(),
            ..Default::default()
        }),
        resources: None,
    });
    let c = Container::run(&env, &sb, "user", cfg).await;
    assert_eq!(c.wait().await.exit_code, 0);
    let lines = c.lines();
    let id = &lines.first().expect("id output").1;
    assert!(id.starts_with("uid=1000(app) gid=1000(app)"), "{id}");
    assert!(id.contains("3000(extra)"), "{id}");
}

#[tokio::test]
async fn containers_share_the_sandbox() {
    require_root!();
    let env = TestEnv::new();
    let sb = Sandbox::start(&env, "share-sb", sandbox_config("share")).await;
    let mut cfg = command(&[
        "sh",
        "-c",
        "hostname; cat /etc/resolv.conf; cat /proc/1/cmdline; echo; readlink /proc/self/ns/net",
    ]);
    cfg.linux = Some(cri::LinuxContainerConfig {
        security_context: Some(cri::LinuxContainerSecurityContext {
            namespace_options: Some(cri::NamespaceOption {
                pid: cri::NamespaceMode::Pod as i32,
                ..Default::default()
            }),
            ..Default::default()
        }),
        resources: None,
    });
    let c = Container::run(&env, &sb, "share", cfg).await;
    assert_eq!(c.wait().await.exit_code, 0);
    let out: Vec<String> = c.lines().into_iter().map(|(_, l)| l).collect();
    assert_eq!(out[0], "share-host");
    assert!(out.contains(&"nameserver 10.0.0.10".to_string()), "{out:?}");
    assert!(out.contains(&"search test.svc".to_string()), "{out:?}");
    // PID 1 of the shared PID namespace is the infra process.
    assert!(
        out.iter()
            .any(|l| l.starts_with("/minicri\0pause") || l == "/minicripause"),
        "{out:?}"
    );
    let infra_net = std::fs::read_link(format!("/proc/{}/ns/net", sb.infra_pid())).unwrap();
    assert!(
        out.contains(&infra_net.to_string_lossy().into_owned()),
        "{out:?} vs {infra_net:?}"
    );
    assert_ne!(
        infra_net,
        std::fs::read_link("/proc/self/ns/net").unwrap(),
        "the sandbox has its own netns"
    );
    assert!(minicri::spec::propagation::is_mountpoint(
        sb.files.shm.as_ref().unwrap()
    ));
}

#[tokio::test]
async fn runtime_default_seccomp_blocks_namespace_creation() {
    require_root!();
    let env = TestEnv::new();
    let sb = Sandbox::start(&env, "seccomp-sb", sandbox_config("seccomp")).await;
    let mut cfg = command(&["sh", "-c", "echo ok; unshare -U true; echo rc=$?"]);
    cfg.linux = Some(cri::LinuxContainerConfig {
        security_context: Some(cri::LinuxContainerSecurityContext {
            seccomp: Some(cri::SecurityProfile::default()), // RuntimeDefault
            no_new_privs: true,
            ..Default::default()
        }),
        resources: Some(cri::LinuxContainerResources {
            memory_limit_in_bytes: 64 << 20,
            cpu_shares: 128,
            oom_score_adj: -900,
            ..Default::default()
        }),
    });
    let c = Container::create(&env, &sb, "seccomp", cfg).await;
    // Created, not started: the init exists with its final settings. The clamp let runc set
    // oom_score_adj without CAP_SYS_RESOURCE; the memory limit is in the container's cgroup.
    let init = c.shim().init_pid;
    let oom = std::fs::read_to_string(format!("/proc/{init}/oom_score_adj")).unwrap();
    assert_eq!(
        oom.trim().parse::<i32>().unwrap(),
        env.host.clamp_oom_score_adj(-900)
    );
    if !env.host.cgroup_v2 {
        let limit = format!(
            "/sys/fs/cgroup/memory{}/{}/memory.limit_in_bytes",
            oci_support::CGROUP_PARENT,
            c.id
        );
        assert_eq!(
            std::fs::read_to_string(limit).unwrap().trim(),
            (64u64 << 20).to_string()
        );
    }
    env.runc.start(&c.id).await.unwrap();
    assert_eq!(c.wait().await.exit_code, 0);
    // stdout only: the shim pumps stdout and stderr separately, so unshare's complaint on
    // stderr may be logged before the "ok" written to stdout before it.
    let out: Vec<String> = c
        .lines()
        .into_iter()
        .filter(|(s, _)| *s == minicri::logs::Stream::Stdout)
        .map(|(_, l)| l)
        .collect();
    assert_eq!(
        out.first().map(String::as_str),
        Some("ok"),
        "fork and exec work under the profile"
    );
    assert!(
        out.contains(&"rc=1".to_string()),
        "unshare(CLONE_NEWUSER) is denied: {out:?}"
    );
}

/// A container's idmapped mounts (a layer or volume each, sometimes stacked, with mounts below
/// them) are all unmounted, with the mount table read once, and their directory removed.
#[test]
fn idmapped_mounts_are_unmounted_however_many_are_stacked() {
    require_root!();
    use nix::mount::{MsFlags, mount};
    let d = tempfile::tempdir().unwrap();
    let layers = d.path().join("layers");
    let tmpfs = |at: &std::path::Path| {
        mount(
            Some("tmpfs"),
            at,
            Some("tmpfs"),
            MsFlags::empty(),
            None::<&str>,
        )
        .unwrap()
    };
    for n in ["0", "1"] {
        std::fs::create_dir_all(layers.join(n)).unwrap();
    }
    tmpfs(&layers.join("0"));
    tmpfs(&layers.join("0"));
    std::fs::create_dir(layers.join("0/sub")).unwrap();
    tmpfs(&layers.join("0/sub"));
    tmpfs(&layers.join("1"));
    std::fs::write(layers.join("not-a-mount"), "").unwrap();
    minicri::spec::userns::unmount_idmapped(&layers).unwrap();
    assert!(!layers.exists());
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let canon = d.path().canonicalize().unwrap();
    assert!(
        !table.contains(canon.to_str().unwrap()),
        "mounts left under {canon:?}"
    );
}

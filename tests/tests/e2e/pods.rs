//! Black-box tests of pod sandboxes and containers: the real daemon, runc, Debian's CNI plugins
//! and a busybox test image from a local registry.
//!
//! Root only (they print why and pass elsewhere). Each test has its own bridge, a /28 inside
//! 10.199.0.0/16 and no masquerading; the environment ([`minicri_tests::pod_env`]) removes
//! whatever a failed test leaves (runc containers, shims, mounts, the bridge) when it is dropped.

use std::path::Path;
use std::time::Duration;

use minicri_proto::runtime::v1 as cri;
use minicri_tests::pod_env::{
    PodEnv, eventually, mounts_under, pod_config, processes_mentioning, skip_reason,
};
use minicri_tests::pod_rpc::{
    assert_container_not_found, container_config, container_status, create_container, exec_sync,
    list_pod_sandboxes, pod_sandbox_status, remove_pod_sandbox, run_container, run_pod,
    stop_container, stop_pod_sandbox,
};
use tonic::Code;

/// The container both tests run: `main`, with a container hash label as the kubelet sets.
fn main_container(image: &str, args: &[&str]) -> cri::ContainerConfig {
    cri::ContainerConfig {
        labels: [(
            "io.kubernetes.container.hash".to_string(),
            "1234".to_string(),
        )]
        .into(),
        ..container_config("main", image, args)
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn pod_and_container_lifecycle() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let env = PodEnv::new().await;
    let image_id = env.pull_busybox().await;
    let mut c = env.runtime().await;

    // Metadata is required.
    let mut bad = pod_config("bad", env.logs.path());
    bad.metadata.as_mut().unwrap().uid.clear();
    let err = c
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(bad),
            runtime_handler: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("uid"), "{err:?}");

    // Run a pod.
    let config = pod_config("web", env.logs.path());
    let sb = run_pod(&mut c, &config).await;
    assert_eq!(sb.len(), 64);
    let dup = c
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(dup.code(), Code::AlreadyExists);

    let st = pod_sandbox_status(&mut c, &sb).await;
    assert_eq!(st.state, cri::PodSandboxState::SandboxReady as i32);
    assert_eq!(st.labels, config.labels);
    assert_eq!(st.annotations, config.annotations);
    assert_eq!(st.metadata, config.metadata);
    let ip = st.network.unwrap().ip;
    let prefix = env.subnet_base.rsplit_once('.').unwrap().0;
    assert!(
        ip.starts_with(prefix),
        "pod ip {ip} not in {}",
        env.subnet_base
    );
    let netns = env.state().join("netns").join(&sb);
    assert!(netns.exists());

    // A container writing to its CRI log.
    let cid = create_container(
        &mut c,
        &sb,
        &config,
        main_container(
            &env.set.busybox_oci.reference,
            &["sh", "-c", "echo hello; sleep 1000"],
        ),
    )
    .await
    .expect("CreateContainer");
    let created = container_status(&mut c, &cid).await;
    assert_eq!(created.state, cri::ContainerState::ContainerCreated as i32);
    assert_eq!(created.image_ref, image_id);
    c.start_container(cri::StartContainerRequest {
        container_id: cid.clone(),
    })
    .await
    .unwrap();
    let log = env.logs.path().join("main/0.log");
    eventually("the log line", || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains(" stdout F hello\n")
    })
    .await;
    let running = container_status(&mut c, &cid).await;
    assert_eq!(running.state, cri::ContainerState::ContainerRunning as i32);
    assert!(running.started_at > 0);
    assert_eq!(running.log_path, log.display().to_string());
    // Listing by pod and by labels: every pair of the selector must match.
    let hash = "io.kubernetes.container.hash";
    for (selector, want) in [
        (vec![(hash, "1234")], 1),
        (vec![(hash, "4321")], 0),
        (vec![(hash, "1234"), ("app", "x")], 0),
    ] {
        let listed = c
            .list_containers(cri::ListContainersRequest {
                filter: Some(cri::ContainerFilter {
                    pod_sandbox_id: sb.clone(),
                    label_selector: selector
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                    ..Default::default()
                }),
            })
            .await
            .unwrap()
            .into_inner()
            .containers;
        assert_eq!(listed.len(), want, "containers listed for {selector:?}");
    }
    for (value, want) in [("web", 1), ("other", 0)] {
        let pods = c
            .list_pod_sandbox(cri::ListPodSandboxRequest {
                filter: Some(cri::PodSandboxFilter {
                    label_selector: [("app".to_string(), value.to_string())].into(),
                    ..Default::default()
                }),
            })
            .await
            .unwrap()
            .into_inner()
            .items;
        assert_eq!(pods.len(), want, "pods listed for app={value}");
    }
    let shims = processes_mentioning(&cid);
    assert!(!shims.is_empty(), "a shim for the container");

    // The rootfs, with the image's setuid files and devices, is out of other users' reach;
    // the root and state directories are private (searchable only where pods need it).
    let mode = |p: &Path| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
    };
    let ctr_dir = env.state().join("containers").join(&cid);
    assert_eq!(mode(&env.daemon.root()), 0o700);
    assert_eq!(mode(&env.state()), 0o711);
    assert_eq!(mode(&ctr_dir), 0o700);
    let busybox = ctr_dir.join("rootfs/bin/busybox");
    assert!(busybox.exists(), "the rootfs is mounted");
    let nobody = {
        use std::os::unix::process::CommandExt;
        std::process::Command::new("stat")
            .arg(&busybox)
            .uid(65534)
            .gid(65534)
            .output()
            .expect("stat as nobody")
    };
    assert!(
        !nobody.status.success(),
        "an unprivileged user reached {}",
        busybox.display()
    );
    assert!(
        String::from_utf8_lossy(&nobody.stderr).contains("Permission denied"),
        "{nobody:?}"
    );

    // ExecSync.
    let out = exec_sync(
        &mut c,
        &cid,
        &["sh", "-c", "echo out; echo err >&2; exit 3"],
        10,
    )
    .await;
    assert_eq!(
        (out.exit_code, out.stdout.as_slice(), out.stderr.as_slice()),
        (3, &b"out\n"[..], &b"err\n"[..])
    );
    // Output past the cap (4 MiB per stream) is dropped, the rest still read to the end.
    let out = exec_sync(
        &mut c,
        &cid,
        &["sh", "-c", "head -c 6000000 /dev/zero; echo done >&2"],
        30,
    )
    .await;
    assert_eq!(out.exit_code, 0);
    assert_eq!(out.stdout.len(), 4 << 20);
    assert_eq!(out.stderr, b"done\n");
    // A process left behind holding the output: `runc exec` copies the output until every
    // holder has closed it, so the call ends at its timeout, with the deadline error, and the
    // daemon keeps no process, descriptor or reader for it.
    let fds = |pid: u32| {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .count()
    };
    let pid = env.daemon.pid().expect("daemon pid");
    let before = fds(pid);
    for _ in 0..3 {
        let t = std::time::Instant::now();
        let e = c
            .exec_sync(cri::ExecSyncRequest {
                container_id: cid.clone(),
                cmd: ["sh", "-c", "echo started; sleep 600 &"]
                    .map(String::from)
                    .to_vec(),
                timeout: 2,
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::DeadlineExceeded, "{e:?}");
        assert!(t.elapsed() < Duration::from_secs(8), "{:?}", t.elapsed());
    }
    let after = fds(pid);
    assert!(
        after < before + 3,
        "the daemon's descriptors grew from {before} to {after} over 3 calls"
    );

    // Stop: sh is PID 1 of its PID namespace and ignores SIGTERM, so SIGKILL after 1 s.
    stop_container(&mut c, &cid, 1).await;
    let exited = container_status(&mut c, &cid).await;
    assert_eq!(exited.state, cri::ContainerState::ContainerExited as i32);
    assert_eq!((exited.exit_code, exited.reason.as_str()), (137, "Error"));
    c.stop_container(cri::StopContainerRequest {
        container_id: cid.clone(),
        timeout: 0,
    })
    .await
    .expect("stop is idempotent");
    for _ in 0..2 {
        c.remove_container(cri::RemoveContainerRequest {
            container_id: cid.clone(),
        })
        .await
        .expect("remove (twice)");
    }
    assert_container_not_found(&mut c, &cid).await;

    // Stop and remove the pod, twice each.
    for _ in 0..2 {
        stop_pod_sandbox(&mut c, &sb).await;
    }
    let st = pod_sandbox_status(&mut c, &sb).await;
    assert_eq!(st.state, cri::PodSandboxState::SandboxNotready as i32);
    assert!(!netns.exists(), "netns removed at stop");
    let infra_shims = processes_mentioning(&sb);
    for _ in 0..2 {
        remove_pod_sandbox(&mut c, &sb).await;
    }
    let items = list_pod_sandboxes(&mut c).await;
    assert!(items.is_empty(), "{items:?}");

    // Nothing left: no mounts but the netns directory's own, no shims.
    let dir = env.daemon.root().parent().unwrap().to_path_buf();
    let netns_dir = env.state().join("netns").display().to_string();
    let mounts: Vec<String> = mounts_under(&dir)
        .into_iter()
        .filter(|m| *m != netns_dir)
        .collect();
    assert!(mounts.is_empty(), "mounts left: {mounts:?}");
    eventually("shims to exit", || {
        shims
            .iter()
            .chain(&infra_shims)
            .all(|p| !Path::new(&format!("/proc/{p}")).exists())
    })
    .await;
    assert!(processes_mentioning(&sb).is_empty());
    assert!(processes_mentioning(&cid).is_empty());
}

/// A daemon restart keeps running containers: the new daemon re-attaches to their shims.
#[tokio::test(flavor = "multi_thread")]
async fn running_containers_survive_a_daemon_restart() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let mut env = PodEnv::new().await;
    env.pull_busybox().await;
    let mut c = env.runtime().await;
    let config = pod_config("restart", env.logs.path());
    let sb = run_pod(&mut c, &config).await;
    let cid = run_container(
        &mut c,
        &sb,
        &config,
        main_container(&env.set.busybox_oci.reference, &["sleep", "1000"]),
    )
    .await;

    env.daemon.kill();
    env.daemon.restart().await.unwrap();
    let mut c = env.runtime().await;
    let st = container_status(&mut c, &cid).await;
    assert_eq!(st.state, cri::ContainerState::ContainerRunning as i32);
    stop_container(&mut c, &cid, 0).await;
    let st = container_status(&mut c, &cid).await;
    assert_eq!(
        (st.state, st.exit_code),
        (cri::ContainerState::ContainerExited as i32, 137)
    );
    remove_pod_sandbox(&mut c, &sb).await;
    assert!(
        processes_mentioning(&cid).is_empty() || {
            tokio::time::sleep(Duration::from_secs(1)).await;
            processes_mentioning(&cid).is_empty()
        }
    );
}

//! Black-box tests of what pods do for their users: CRI logs (a 1 MiB line, a reopen after
//! rotation), two containers of one pod talking over localhost, the pod IP answering from the
//! host, a container that exits while the daemon is down, and that removing every pod leaves no
//! mount, network namespace, cgroup, veth, monitor or container process behind.
//!
//! Root only, with runc and Debian's CNI plugins ([`skip_reason`]).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use minicri_proto::runtime::v1 as cri;
use minicri_tests::pod_env::{
    PodEnv, eventually, mounts_under, pod_config, ports_of, processes_mentioning, runc_list,
    skip_reason, with_busybox,
};
use minicri_tests::pod_rpc::{
    container_status, create_container, exec_text, list_pod_sandboxes, pod_sandbox_status,
    run_container, run_pod, sh_container_config, stop_and_remove_pod, stop_container,
};

/// One CRI log entry.
#[derive(Debug)]
struct Entry {
    stream: String,
    partial: bool,
    text: String,
}

/// Parses a CRI log file, checking each entry's timestamp and tags.
fn read_log(path: &Path) -> Vec<Entry> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .map(|l| {
            let mut parts = l.splitn(4, ' ');
            let (ts, stream, tag) = (
                parts.next().unwrap(),
                parts.next().unwrap_or(""),
                parts.next().unwrap_or(""),
            );
            let text = parts.next().unwrap_or("").to_string();
            chrono::DateTime::parse_from_rfc3339(ts)
                .unwrap_or_else(|e| panic!("bad timestamp {ts:?} in {l:.80}: {e}"));
            assert!(ts.ends_with('Z') && ts.len() == 30, "RFC3339Nano UTC: {ts}");
            assert!(matches!(stream, "stdout" | "stderr"), "{l:.80}");
            assert!(matches!(tag, "P" | "F"), "{l:.80}");
            Entry {
                stream: stream.into(),
                partial: tag == "P",
                text,
            }
        })
        .collect()
}

/// The whole lines of one stream, partial entries joined.
fn lines_of(entries: &[Entry], stream: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for e in entries.iter().filter(|e| e.stream == stream) {
        cur.push_str(&e.text);
        if !e.partial {
            out.push(std::mem::take(&mut cur));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn logs_split_a_1mib_line_and_follow_a_reopen() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let env = PodEnv::new().await;
    let image = env.pull_busybox().await;
    let mut c = env.runtime().await;
    let pod = pod_config("logs", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    let script = "head -c 1048576 /dev/zero | tr '\\000' a; echo; echo to-stderr >&2; \
                  while [ ! -e /tmp/go ]; do sleep 0.05; done; echo after-reopen; sleep 1000";
    let id = run_container(
        &mut c,
        &sb,
        &pod,
        sh_container_config("writer", &image, script),
    )
    .await;
    let log = env.logs.path().join("writer/0.log");
    eventually("the first lines in the log", || {
        lines_of(&read_log(&log), "stderr") == ["to-stderr"]
    })
    .await;
    let entries = read_log(&log);
    let out = lines_of(&entries, "stdout");
    assert_eq!(out.len(), 1, "one stdout line so far");
    assert_eq!(out[0].len(), 1 << 20, "the 1 MiB line is whole once joined");
    assert!(out[0].bytes().all(|b| b == b'a'));
    let pieces = entries.iter().filter(|e| e.stream == "stdout").count();
    assert!(pieces >= 64, "a 1 MiB line is cut into pieces: {pieces}");
    assert!(
        entries.iter().all(|e| e.text.len() <= 16 * 1024),
        "no entry is longer than 16 KiB"
    );

    // The kubelet's rotation: rename, then ReopenContainerLog; new output goes to a new file.
    let rotated = log.with_extension("log.1");
    std::fs::rename(&log, &rotated).unwrap();
    c.reopen_container_log(cri::ReopenContainerLogRequest {
        container_id: id.clone(),
    })
    .await
    .expect("ReopenContainerLog");
    assert!(log.exists(), "the log file is created again at once");
    assert_eq!(exec_text(&mut c, &id, &["touch", "/tmp/go"], 10).await.0, 0);
    eventually("the line after the reopen", || {
        lines_of(&read_log(&log), "stdout") == ["after-reopen"]
    })
    .await;
    assert!(
        !std::fs::read_to_string(&rotated)
            .unwrap()
            .contains("after-reopen"),
        "the rotated file got no new output"
    );

    // A running container without a log file: FAILED_PRECONDITION too (it was INTERNAL).
    let unlogged = run_container(
        &mut c,
        &sb,
        &pod,
        cri::ContainerConfig {
            log_path: String::new(),
            ..sh_container_config("unlogged", &image, "sleep 1000")
        },
    )
    .await;
    let err = c
        .reopen_container_log(cri::ReopenContainerLogRequest {
            container_id: unlogged.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("no log file"), "{}", err.message());
    stop_container(&mut c, &unlogged, 0).await;

    // Reopening a container that is not running is FAILED_PRECONDITION, an unknown one NOT_FOUND.
    stop_container(&mut c, &id, 0).await;
    let err = c
        .reopen_container_log(cri::ReopenContainerLogRequest {
            container_id: id.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    let err = c
        .reopen_container_log(cri::ReopenContainerLogRequest {
            container_id: "0123456789abcdef".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
    stop_and_remove_pod(&mut c, &sb).await;
}

/// `GET /` over plain HTTP from the host; the response body.
fn http_get(addr: &str) -> std::io::Result<String> {
    let mut s =
        std::net::TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(b"GET / HTTP/1.0\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out.split("\r\n\r\n").nth(1).unwrap_or("").to_string())
}

#[tokio::test(flavor = "multi_thread")]
async fn containers_of_a_pod_share_localhost_and_the_pod_ip_answers_from_the_host() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let env = PodEnv::new().await;
    let image = env.pull_busybox().await;
    let mut c = env.runtime().await;
    let pod = pod_config("net", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    let server = run_container(
        &mut c,
        &sb,
        &pod,
        sh_container_config(
            "server",
            &image,
            "mkdir -p /www && echo hello-from-server > /www/index.html && exec httpd -f -p 8080 -h /www",
        ),
    )
    .await;
    let client = run_container(
        &mut c,
        &sb,
        &pod,
        sh_container_config("client", &image, "exec sleep 1000"),
    )
    .await;

    // The client reaches the server on 127.0.0.1: one network namespace per pod.
    let mut got = String::new();
    for _ in 0..100 {
        let (code, out, _) = exec_text(
            &mut c,
            &client,
            &["wget", "-q", "-O", "-", "http://127.0.0.1:8080/"],
            10,
        )
        .await;
        if code == 0 {
            got = out;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(got.trim(), "hello-from-server");

    // The host reaches the pod at the IP PodSandboxStatus reports, inside the test's subnet.
    let st = pod_sandbox_status(&mut c, &sb).await;
    let ip = st.network.unwrap().ip;
    let prefix = env.subnet_base.rsplit_once('.').unwrap().0;
    assert!(ip.starts_with(prefix), "{ip} in {}", env.subnet_base);
    let body = http_get(&format!("{ip}:8080")).expect("pod IP reachable from the host");
    assert_eq!(body.trim(), "hello-from-server");
    let _ = server;
    stop_and_remove_pod(&mut c, &sb).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_container_that_exits_while_the_daemon_is_down_reports_its_exit() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let mut env = PodEnv::new().await;
    let image = env.pull_busybox().await;
    let mut c = env.runtime().await;
    let pod = pod_config("down", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    let script = "echo before; while [ ! -e /tmp/exit ]; do sleep 0.05; done; echo after; exit 7";
    let id = run_container(
        &mut c,
        &sb,
        &pod,
        sh_container_config("main", &image, script),
    )
    .await;
    let log = env.logs.path().join("main/0.log");
    eventually("the first line", || {
        lines_of(&read_log(&log), "stdout") == ["before"]
    })
    .await;
    drop(c);

    env.daemon.kill();
    // Tell the container to exit through its root filesystem, as seen from the host.
    let rootfs = env.state().join("containers").join(&id).join("rootfs");
    std::fs::write(rootfs.join("tmp/exit"), b"").expect("container rootfs mounted on the host");
    eventually("the container's init to exit", || {
        processes_mentioning("/tmp/exit ]").is_empty()
    })
    .await;
    env.daemon.restart().await.unwrap();

    let mut c = env.runtime().await;
    let st = container_status(&mut c, &id).await;
    assert_eq!(st.state, cri::ContainerState::ContainerExited as i32);
    assert_eq!(st.exit_code, 7);
    assert_eq!(st.reason, "Error");
    assert!(
        st.finished_at >= st.started_at && st.started_at > 0,
        "{st:?}"
    );
    // The shim kept writing the log while the daemon was away.
    assert_eq!(lines_of(&read_log(&log), "stdout"), ["before", "after"]);
    stop_and_remove_pod(&mut c, &sb).await;
}

/// Directories named `name` anywhere under `dir`.
fn dirs_named(dir: &Path, name: &str, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            if e.file_name().to_string_lossy().contains(name) {
                out.push(e.path());
            }
            dirs_named(&e.path(), name, out);
        }
    }
}

/// Cgroup directories (every v1 hierarchy and the v2 tree) under `parent` whose name has `id`.
fn cgroups_of(parent: &str, id: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let rel = parent.trim_start_matches('/');
    let hierarchies = std::fs::read_dir("/sys/fs/cgroup")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .chain([PathBuf::from("/sys/fs/cgroup")]);
    for h in hierarchies {
        dirs_named(&h.join(rel), id, &mut out);
    }
    out
}

/// The bridge that carries the test's subnet.
fn bridge_of(subnet_base: &str) -> String {
    let prefix = subnet_base.rsplit_once('.').unwrap().0;
    let out = std::process::Command::new("ip")
        .args(["-4", "-o", "addr", "show"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.contains(&format!(" {prefix}.")))
        .and_then(|l| l.split_whitespace().nth(1))
        .expect("the test bridge has the gateway address")
        .to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn removing_every_pod_leaves_nothing_behind() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let env = PodEnv::new().await;
    let image = env.pull_busybox().await;
    let mut c = env.runtime().await;
    let parent = env.cgroup_parent();
    let mut ids = Vec::new();
    let mut sandboxes = Vec::new();
    for (name, host_network) in [("leak-a", false), ("leak-b", false), ("leak-host", true)] {
        let mut pod = pod_config(name, env.logs.path());
        pod.linux = Some(cri::LinuxPodSandboxConfig {
            cgroup_parent: parent.clone(),
            security_context: Some(cri::LinuxSandboxSecurityContext {
                namespace_options: Some(cri::NamespaceOption {
                    network: if host_network {
                        cri::NamespaceMode::Node as i32
                    } else {
                        cri::NamespaceMode::Pod as i32
                    },
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        });
        let sb = run_pod(&mut c, &pod).await;
        let mut cfg = sh_container_config("main", &image, "exec sleep 1000");
        cfg.linux = Some(cri::LinuxContainerConfig {
            resources: Some(cri::LinuxContainerResources {
                memory_limit_in_bytes: 64 << 20,
                ..Default::default()
            }),
            ..Default::default()
        });
        let id = run_container(&mut c, &sb, &pod, cfg).await;
        // A second container that has exited before the pod goes.
        let done = run_container(
            &mut c,
            &sb,
            &pod,
            sh_container_config("done", &image, "exit 0"),
        )
        .await;
        ids.extend([id, done]);
        ids.push(sb.clone());
        sandboxes.push(sb);
    }
    let bridge = bridge_of(&env.subnet_base);
    let state = env.state();
    // While they run, the things checked below exist (so the checks can see them).
    assert!(!cgroups_of(&parent, &ids[0]).is_empty(), "container cgroup");
    assert_eq!(ports_of(&bridge).len(), 2, "two veths on {bridge}");
    assert!(!mounts_under(&state).is_empty());
    assert!(
        processes_mentioning(&state.to_string_lossy())
            .into_iter()
            .any(|p| Some(p as u32) != env.daemon.pid()),
        "monitors run"
    );

    for sb in &sandboxes {
        stop_and_remove_pod(&mut c, sb).await;
    }
    let listed = list_pod_sandboxes(&mut c).await;
    assert!(listed.is_empty(), "{listed:?}");
    // Mounts, pinned netns and monitor processes (the daemon's own aside).
    let stray = env.stray_state();
    assert!(stray.is_empty(), "left behind: {stray:?}");
    for id in &ids {
        let left = cgroups_of(&parent, id);
        assert!(left.is_empty(), "cgroups left: {left:?}");
    }
    assert!(ports_of(&bridge).is_empty(), "veths left on {bridge}");
    // runc's own record of containers.
    let runc = std::process::Command::new("runc")
        .arg("--root")
        .arg(state.join("runc"))
        .args(["list", "-q"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&runc.stdout).trim(), "");
    for id in &ids {
        let mut found = Vec::new();
        dirs_named(&state, id, &mut found);
        assert!(found.is_empty(), "state left: {found:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn container_events_follow_the_lifecycle() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let env = PodEnv::new().await;
    let image = env.pull_busybox().await;
    let mut c = env.runtime().await;
    let mut events = c
        .get_container_events(cri::GetEventsRequest {})
        .await
        .expect("GetContainerEvents")
        .into_inner();
    let pod = pod_config("events", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    let id = run_container(
        &mut c,
        &sb,
        &pod,
        sh_container_config("main", &image, "exec sleep 1000"),
    )
    .await;
    stop_container(&mut c, &id, 0).await;
    c.remove_container(cri::RemoveContainerRequest {
        container_id: id.clone(),
    })
    .await
    .expect("RemoveContainer");

    use cri::ContainerEventType as T;
    let expected = [
        (
            T::ContainerCreatedEvent,
            Some(cri::ContainerState::ContainerCreated),
        ),
        (
            T::ContainerStartedEvent,
            Some(cri::ContainerState::ContainerRunning),
        ),
        (
            T::ContainerStoppedEvent,
            Some(cri::ContainerState::ContainerExited),
        ),
        (T::ContainerDeletedEvent, None),
    ];
    let mut last_at = 0;
    for (kind, state) in expected {
        let ev = tokio::time::timeout(Duration::from_secs(10), events.message())
            .await
            .expect("an event within 10 s")
            .expect("stream open")
            .expect("an event");
        assert_eq!(ev.container_id, id);
        assert_eq!(ev.container_event_type, kind as i32, "{ev:?}");
        assert!(ev.created_at >= last_at && ev.created_at > 0);
        last_at = ev.created_at;
        let pod_status = ev.pod_sandbox_status.expect("pod status");
        assert_eq!(pod_status.id, sb);
        let own = ev.containers_statuses.iter().find(|s| s.id == id);
        assert_eq!(own.map(|s| s.state), state.map(|s| s as i32), "{kind:?}");
    }
    stop_and_remove_pod(&mut c, &sb).await;
}

/// A container that exits is deleted from the OCI runtime at once (its runtime state and cgroup
/// go, as containerd deletes its task); its record, exit code and log stay until
/// RemoveContainer, which then has no runtime call left to make.
#[tokio::test(flavor = "multi_thread")]
async fn an_exited_container_leaves_the_runtime_and_keeps_its_status() {
    let Some((env, image, mut c)) = with_busybox().await else {
        return;
    };
    let pod = pod_config("exits", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    let id = run_container(
        &mut c,
        &sb,
        &pod,
        sh_container_config("quits", &image, "echo bye; exit 3"),
    )
    .await;
    let listed = || runc_list(&env.state().join("runc"));
    eventually("the exited container is deleted from runc", || {
        !listed().contains(&id)
    })
    .await;
    assert!(listed().contains(&sb), "the infra stays: {}", listed());
    let st = container_status(&mut c, &id).await;
    assert_eq!(st.state, cri::ContainerState::ContainerExited as i32);
    assert_eq!(st.exit_code, 3);
    let log = read_log(&env.logs.path().join("quits/0.log"));
    assert_eq!(lines_of(&log, "stdout"), ["bye"], "{log:?}");
    c.remove_container(cri::RemoveContainerRequest {
        container_id: id.clone(),
    })
    .await
    .unwrap();
    stop_and_remove_pod(&mut c, &sb).await;
    assert!(env.stray_state().is_empty(), "{:?}", env.stray_state());
}

/// A stop waiting out a long grace period (the container's PID 1 ignores SIGTERM) ends as soon
/// as a later stop asks for a shorter one, as when the kubelet shortens a pod's grace period or
/// a pod is deleted with force: the later stop does not queue behind the whole grace period.
#[tokio::test(flavor = "multi_thread")]
async fn a_shorter_stop_cuts_a_long_grace_period() {
    let Some((env, image, mut c)) = with_busybox().await else {
        return;
    };
    let pod = pod_config("graceful", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    // PID 1 without a handler: SIGTERM does nothing.
    let id = run_container(
        &mut c,
        &sb,
        &pod,
        sh_container_config("stubborn", &image, "exec sleep 100000"),
    )
    .await;
    let mut long = c.clone();
    let long_stop = {
        let id = id.clone();
        tokio::spawn(async move {
            long.stop_container(cri::StopContainerRequest {
                container_id: id,
                timeout: 3600,
            })
            .await
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!long_stop.is_finished(), "SIGTERM stopped the container");
    let forced = c.stop_container(cri::StopContainerRequest {
        container_id: id.clone(),
        timeout: 0,
    });
    tokio::time::timeout(Duration::from_secs(30), forced)
        .await
        .expect("the forced stop waited behind the grace period")
        .unwrap();
    tokio::time::timeout(Duration::from_secs(30), long_stop)
        .await
        .expect("the long stop ended with the forced one")
        .unwrap()
        .unwrap();
    let st = container_status(&mut c, &id).await;
    assert_eq!(st.state, cri::ContainerState::ContainerExited as i32);
    assert_eq!(st.exit_code, 137, "{st:?}");
    stop_and_remove_pod(&mut c, &sb).await;
}

/// No directory between the pod's log directory and a container's log is followed if it is a
/// symlink: a pod that can write into its log directory (a hostPath on /var/log) could otherwise
/// point one at any host directory and have its output appended to a file created there, by
/// root. StartContainer refuses, and the host directory stays untouched.
#[tokio::test(flavor = "multi_thread")]
async fn a_symlinked_log_directory_is_not_followed() {
    let Some((env, image, mut c)) = with_busybox().await else {
        return;
    };
    let pod = pod_config("log-link", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    let host = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(host.path(), env.logs.path().join("linked")).unwrap();
    let id = create_container(
        &mut c,
        &sb,
        &pod,
        sh_container_config("linked", &image, "echo escaped"),
    )
    .await
    .unwrap();
    let err = c
        .start_container(cri::StartContainerRequest {
            container_id: id.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("symlink"), "{err:?}");
    assert_eq!(
        std::fs::read_dir(host.path()).unwrap().count(),
        0,
        "a log was created in the host directory"
    );
    stop_and_remove_pod(&mut c, &sb).await;
}

//! Black-box test of what a sandbox gives its containers besides the network: the hostname,
//! /etc/resolv.conf from the DNSConfig, /etc/hosts, one /dev/shm shared by the pod's
//! containers, namespaced sysctls; and of UpdateContainerResources reaching the cgroup.
//!
//! Root only, with runc and Debian's CNI plugins ([`skip_reason`]).

use std::path::PathBuf;

use minicri_proto::runtime::v1 as cri;
use minicri_tests::pod_env::{PodEnv, pod_config, skip_reason};
use minicri_tests::pod_rpc::{
    exec_text, run_container, run_pod, sh_container_config, stop_and_remove_pod,
};

/// The memory limit the kernel applies to container `id` under cgroup parent `parent`
/// (cgroup v1 `memory.limit_in_bytes`, or v2 `memory.max`).
fn memory_limit(parent: &str, id: &str) -> u64 {
    let rel = PathBuf::from(parent.trim_start_matches('/')).join(id);
    let v1 = PathBuf::from("/sys/fs/cgroup/memory")
        .join(&rel)
        .join("memory.limit_in_bytes");
    let v2 = PathBuf::from("/sys/fs/cgroup")
        .join(&rel)
        .join("memory.max");
    let text = std::fs::read_to_string(&v1)
        .or_else(|_| std::fs::read_to_string(&v2))
        .unwrap_or_else(|e| panic!("no memory limit file for {id}: {e}"));
    text.trim().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn sandbox_files_sysctls_shm_and_resource_updates() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let env = PodEnv::new().await;
    let image = env.pull_busybox().await;
    let mut c = env.runtime().await;
    let parent = env.cgroup_parent();
    let mut pod = pod_config("files", env.logs.path());
    pod.hostname = "files-host".into();
    pod.dns_config = Some(cri::DnsConfig {
        servers: vec!["10.0.0.10".into()],
        searches: vec!["svc.cluster.local".into()],
        options: vec!["ndots:5".into()],
    });
    pod.linux = Some(cri::LinuxPodSandboxConfig {
        cgroup_parent: parent.clone(),
        sysctls: [(
            "net.ipv4.ip_unprivileged_port_start".to_string(),
            "80".to_string(),
        )]
        .into(),
        ..Default::default()
    });
    let sb = run_pod(&mut c, &pod).await;
    let mut main = sh_container_config("main", &image, "exec sleep 1000");
    main.linux = Some(cri::LinuxContainerConfig {
        resources: Some(cri::LinuxContainerResources {
            memory_limit_in_bytes: 64 << 20,
            ..Default::default()
        }),
        ..Default::default()
    });
    let a = run_container(&mut c, &sb, &pod, main).await;
    let b = run_container(
        &mut c,
        &sb,
        &pod,
        sh_container_config("side", &image, "exec sleep 1000"),
    )
    .await;

    let out = |cmd: &'static str| {
        let id = a.clone();
        let mut c = c.clone();
        async move {
            let (code, out, err) = exec_text(&mut c, &id, &["sh", "-c", cmd], 10).await;
            assert_eq!(code, 0, "{cmd}: {err}");
            out
        }
    };
    assert_eq!(out("hostname").await.trim(), "files-host");
    let resolv = out("cat /etc/resolv.conf").await;
    for line in [
        "nameserver 10.0.0.10",
        "search svc.cluster.local",
        "options ndots:5",
    ] {
        assert!(resolv.lines().any(|l| l == line), "{line:?} in {resolv:?}");
    }
    let hosts = out("cat /etc/hosts").await;
    assert!(
        hosts
            .lines()
            .any(|l| l.split_whitespace().skip(1).any(|n| n == "files-host")),
        "hostname in /etc/hosts: {hosts:?}"
    );
    assert!(hosts.contains("localhost"), "{hosts:?}");
    assert_eq!(
        out("cat /proc/sys/net/ipv4/ip_unprivileged_port_start")
            .await
            .trim(),
        "80"
    );
    let shm = out("grep ' /dev/shm ' /proc/mounts").await;
    assert_eq!(shm.split_whitespace().nth(2), Some("tmpfs"), "{shm:?}");

    // What a container writes into its /etc/hosts (a bind mount of the pod's file) stays on the
    // pod's own small tmpfs: it cannot fill the state directory's filesystem (/run, memory).
    let (code, _, err) = exec_text(
        &mut c.clone(),
        &a,
        &["sh", "-c", "dd if=/dev/zero of=/etc/hosts bs=1M count=16"],
        30,
    )
    .await;
    assert_ne!(code, 0, "16 MiB fit into /etc/hosts");
    assert!(err.contains("No space left"), "{err}");
    let written: u64 = out("wc -c < /etc/hosts").await.trim().parse().unwrap();
    assert!(written <= 1 << 21, "{written} bytes in /etc/hosts");

    // One /dev/shm per pod: what one container writes there, the other reads.
    out("echo shared-by-the-pod > /dev/shm/note").await;
    let (code, seen, _) = exec_text(&mut c, &b, &["cat", "/dev/shm/note"], 10).await;
    assert_eq!((code, seen.trim()), (0, "shared-by-the-pod"));

    // UpdateContainerResources reaches the running container's cgroup.
    assert_eq!(memory_limit(&parent, &a), 64 << 20);
    c.update_container_resources(cri::UpdateContainerResourcesRequest {
        container_id: a.clone(),
        linux: Some(cri::LinuxContainerResources {
            memory_limit_in_bytes: 96 << 20,
            ..Default::default()
        }),
        ..Default::default()
    })
    .await
    .expect("UpdateContainerResources");
    assert_eq!(memory_limit(&parent, &a), 96 << 20);

    stop_and_remove_pod(&mut c, &sb).await;
    let stray = env.stray_state();
    assert!(stray.is_empty(), "left behind: {stray:?}");
}

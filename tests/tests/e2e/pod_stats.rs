//! Black-box tests of the stats RPCs (ContainerStats, ListContainerStats, PodSandboxStats,
//! ListPodSandboxStats) against the real daemon, runc and CNI: a container that allocates
//! memory, writes a file and burns some CPU, its idle neighbour, and a pod with a cgroup parent
//! of its own.
//!
//! Root only (they print why and pass elsewhere); see [`minicri_tests::pod_env`].

use std::collections::BTreeSet;
use std::time::Duration;

use minicri_proto::runtime::v1 as cri;
use minicri_tests::pod_env::{PodEnv, eventually, pod_config, skip_reason};
use minicri_tests::pod_rpc::{
    RuntimeClient, container_config, remove_pod_sandbox, run_container, run_pod, stop_container,
};
use tonic::Code;

const MIB: u64 = 1 << 20;

/// What the burner holds in a shell variable (anonymous memory of its cgroup).
const HELD: u64 = 16 * MIB;
/// What the burner writes to its writable layer.
const WRITTEN: u64 = MIB;

/// Allocates [`HELD`] bytes, writes [`WRITTEN`] bytes to `/data.bin`, says `ready`, then keeps
/// burning a little CPU (a short loop every 50 ms) so that two samples see it.
const BURNER: &str = "x=$(head -c 16777216 /dev/zero | tr '\\000' a); \
     head -c 1048576 /dev/urandom > /data.bin; sync; echo ready; \
     while :; do i=0; while [ $i -lt 2000 ]; do i=$((i+1)); done; sleep 0.05; done";

/// [`container_config`] with a `role` label, the kubelet's container name label and an
/// annotation with a newline and `=`.
fn labelled_container(name: &str, image: &str, args: &[&str], role: &str) -> cri::ContainerConfig {
    cri::ContainerConfig {
        labels: [
            ("role".to_string(), role.to_string()),
            ("io.kubernetes.container.name".to_string(), name.to_string()),
        ]
        .into(),
        annotations: [("why".to_string(), format!("stats of {name}\n=x"))].into(),
        ..container_config(name, image, args)
    }
}

async fn container_stats(c: &mut RuntimeClient, id: &str) -> cri::ContainerStats {
    c.container_stats(cri::ContainerStatsRequest {
        container_id: id.into(),
    })
    .await
    .unwrap()
    .into_inner()
    .stats
    .unwrap()
}

/// The container's writable layer once the daemon's background measurement shows at least
/// `bytes` (stats calls never walk a layer: the first has no figures, and figures are reused for
/// five seconds).
async fn writable_layer_of_at_least(
    c: &mut RuntimeClient,
    id: &str,
    bytes: u64,
) -> cri::FilesystemUsage {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let layer = container_stats(c, id).await.writable_layer;
        match layer {
            Some(l) if val(&l.used_bytes) >= bytes => return l,
            _ if std::time::Instant::now() > deadline => {
                panic!("writable layer of {id} never reached {bytes} bytes: {layer:?}")
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

async fn pod_stats(c: &mut RuntimeClient, id: &str) -> cri::PodSandboxStats {
    c.pod_sandbox_stats(cri::PodSandboxStatsRequest {
        pod_sandbox_id: id.into(),
    })
    .await
    .unwrap()
    .into_inner()
    .stats
    .unwrap()
}

/// The container ids ListContainerStats returns for `filter`.
async fn listed(
    c: &mut RuntimeClient,
    filter: Option<cri::ContainerStatsFilter>,
) -> BTreeSet<String> {
    c.list_container_stats(cri::ListContainerStatsRequest { filter })
        .await
        .unwrap()
        .into_inner()
        .stats
        .into_iter()
        .map(|s| s.attributes.unwrap().id)
        .collect()
}

/// The sandbox ids ListPodSandboxStats returns for `filter`.
async fn listed_pods(
    c: &mut RuntimeClient,
    filter: Option<cri::PodSandboxStatsFilter>,
) -> BTreeSet<String> {
    c.list_pod_sandbox_stats(cri::ListPodSandboxStatsRequest { filter })
        .await
        .unwrap()
        .into_inner()
        .stats
        .into_iter()
        .map(|s| s.attributes.unwrap().id)
        .collect()
}

fn ids(v: &[&String]) -> BTreeSet<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn val(v: &Option<cri::UInt64Value>) -> u64 {
    v.as_ref().expect("a value").value
}

#[tokio::test(flavor = "multi_thread")]
async fn container_and_pod_stats() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let env = PodEnv::new().await;
    env.pull_busybox().await;
    let mut c = env.runtime().await;
    let image = env.set.busybox_oci.reference.clone();

    // Pod A (default cgroup parent): the burner and an idle container.
    let config_a = pod_config("stats-a", env.logs.path());
    let pod_a = run_pod(&mut c, &config_a).await;
    let burner_config = labelled_container("burner", &image, &["sh", "-c", BURNER], "burner");
    let burner = run_container(&mut c, &pod_a, &config_a, burner_config.clone()).await;
    let idle_config = labelled_container("idle", &image, &["sleep", "1000"], "idle");
    let idle = run_container(&mut c, &pod_a, &config_a, idle_config.clone()).await;
    // Pod B, with a cgroup parent of its own: its stats come from that cgroup.
    let mut config_b = pod_config("stats-b", env.logs.path());
    config_b.linux = Some(cri::LinuxPodSandboxConfig {
        cgroup_parent: env.cgroup_parent(),
        ..Default::default()
    });
    let pod_b = run_pod(&mut c, &config_b).await;
    let idle_b = run_container(&mut c, &pod_b, &config_b, idle_config).await;

    let log = env.logs.path().join("burner/0.log");
    eventually("the burner to be ready", || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains(" stdout F ready\n")
    })
    .await;

    // ContainerStats: attributes exactly as created, CPU, memory, writable layer.
    let s = container_stats(&mut c, &burner).await;
    let attrs = s.attributes.clone().unwrap();
    assert_eq!(attrs.id, burner);
    assert_eq!(attrs.metadata, burner_config.metadata);
    assert_eq!(attrs.labels, burner_config.labels);
    assert_eq!(attrs.annotations, burner_config.annotations);
    let cpu = s.cpu.expect("cpu");
    assert!(cpu.timestamp > 0);
    let cpu_ns = val(&cpu.usage_core_nano_seconds);
    assert!(cpu_ns > 0, "cpu usage {cpu_ns}");
    let mem = s.memory.expect("memory");
    assert!(mem.timestamp > 0);
    let ws = val(&mem.working_set_bytes);
    assert!(
        (HELD..256 * MIB).contains(&ws),
        "working set {ws} not within [{HELD}, 256 MiB)"
    );
    assert!(val(&mem.usage_bytes) >= ws);
    assert!(val(&mem.rss_bytes) >= HELD, "rss {:?}", mem.rss_bytes);
    assert!(val(&mem.page_faults) > 0);
    assert!(mem.major_page_faults.is_some());
    // No memory limit: nothing to be available against.
    assert_eq!(mem.available_bytes, None);
    let layer = writable_layer_of_at_least(&mut c, &burner, WRITTEN).await;
    assert!(layer.timestamp > 0);
    assert_eq!(
        layer.fs_id.unwrap().mountpoint,
        env.daemon.root().display().to_string()
    );
    assert!(val(&layer.inodes_used) >= 1);

    // A second sample more than a second later has a rate.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let s2 = container_stats(&mut c, &burner).await;
    let cpu2 = s2.cpu.unwrap();
    assert!(cpu2.timestamp > cpu.timestamp);
    assert!(val(&cpu2.usage_core_nano_seconds) > cpu_ns);
    let rate = val(&cpu2.usage_nano_cores);
    assert!(rate > 0 && rate < 4_000_000_000, "usage_nano_cores {rate}");

    // ListContainerStats filters.
    let all = listed(&mut c, None).await;
    assert_eq!(all, ids(&[&burner, &idle, &idle_b]));
    let by_pod = |p: &str| {
        Some(cri::ContainerStatsFilter {
            pod_sandbox_id: p.into(),
            ..Default::default()
        })
    };
    assert_eq!(listed(&mut c, by_pod(&pod_a)).await, ids(&[&burner, &idle]));
    assert_eq!(listed(&mut c, by_pod(&pod_b)).await, ids(&[&idle_b]));
    let by_role = |role: &str, pod: &str| {
        Some(cri::ContainerStatsFilter {
            pod_sandbox_id: pod.into(),
            label_selector: [("role".to_string(), role.to_string())].into(),
            ..Default::default()
        })
    };
    assert_eq!(
        listed(&mut c, by_role("idle", "")).await,
        ids(&[&idle, &idle_b])
    );
    assert_eq!(
        listed(&mut c, by_role("idle", &pod_b)).await,
        ids(&[&idle_b])
    );
    assert_eq!(listed(&mut c, by_role("burner", &pod_b)).await, ids(&[]));
    assert_eq!(listed(&mut c, by_role("nobody", "")).await, ids(&[]));
    let by_id = Some(cri::ContainerStatsFilter {
        id: burner.clone(),
        ..Default::default()
    });
    assert_eq!(listed(&mut c, by_id).await, ids(&[&burner]));

    // PodSandboxStats of pod A: the sum of its containers, its network, its processes.
    // Some traffic on the pod's interface first (the ping may fail; the ARP request counts).
    let (net, last) = env.subnet_base.rsplit_once('.').unwrap();
    let gateway = format!("{net}.{}", last.parse::<u8>().unwrap() + 1);
    let _ = c
        .exec_sync(cri::ExecSyncRequest {
            container_id: idle.clone(),
            cmd: vec!["ping".into(), "-c1".into(), "-W1".into(), gateway],
            timeout: 10,
        })
        .await;
    let p = pod_stats(&mut c, &pod_a).await;
    let attrs = p.attributes.unwrap();
    assert_eq!(attrs.id, pod_a);
    assert_eq!(attrs.metadata, config_a.metadata);
    assert_eq!(attrs.labels, config_a.labels);
    assert_eq!(attrs.annotations, config_a.annotations);
    let linux = p.linux.unwrap();
    let members: BTreeSet<String> = linux
        .containers
        .iter()
        .map(|s| s.attributes.clone().unwrap().id)
        .collect();
    assert_eq!(members, ids(&[&burner, &idle]));
    assert!(val(&linux.cpu.expect("pod cpu").usage_core_nano_seconds) >= cpu_ns);
    let pod_ws = val(&linux.memory.expect("pod memory").working_set_bytes);
    assert!(pod_ws >= HELD, "pod working set {pod_ws}");
    // The infra, the burner's shell and sleep at least.
    let procs = val(&linux.process.expect("process count").process_count);
    assert!(procs >= 3, "pod processes {procs}");
    let net = linux.network.expect("network");
    assert!(net.timestamp > 0);
    assert!(net.interfaces.iter().all(|i| i.name != "lo"));
    let eth0 = net.default_interface.expect("default interface");
    assert_eq!(eth0.name, "eth0");
    assert!(val(&eth0.tx_bytes) > 0, "eth0 {eth0:?}");
    assert!(eth0.rx_bytes.is_some() && eth0.rx_errors.is_some() && eth0.tx_errors.is_some());

    // Pod B reads its own cgroup.
    let p = pod_stats(&mut c, &pod_b).await;
    let linux = p.linux.unwrap();
    assert_eq!(linux.containers.len(), 1);
    assert!(val(&linux.cpu.expect("pod cpu").usage_core_nano_seconds) > 0);
    assert!(val(&linux.memory.expect("pod memory").usage_bytes) > 0);
    let procs = val(&linux.process.expect("process count").process_count);
    assert!(procs >= 2, "pod processes {procs}");

    // ListPodSandboxStats filters.
    assert_eq!(listed_pods(&mut c, None).await, ids(&[&pod_a, &pod_b]));
    let f = Some(cri::PodSandboxStatsFilter {
        id: pod_a.clone(),
        ..Default::default()
    });
    assert_eq!(listed_pods(&mut c, f).await, ids(&[&pod_a]));
    let f = Some(cri::PodSandboxStatsFilter {
        label_selector: [("app".to_string(), "stats-b".to_string())].into(),
        ..Default::default()
    });
    assert_eq!(listed_pods(&mut c, f).await, ids(&[&pod_b]));

    // Unknown ids are NOT_FOUND, naming the id.
    let unknown = "0123456789abcdef".repeat(4);
    let e = c
        .container_stats(cri::ContainerStatsRequest {
            container_id: unknown.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert!(e.message().contains(&unknown), "{e:?}");
    let e = c
        .pod_sandbox_stats(cri::PodSandboxStatsRequest {
            pod_sandbox_id: unknown.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert!(e.message().contains(&unknown), "{e:?}");

    // A stopped container still has stats: its attributes and writable layer.
    stop_container(&mut c, &burner, 0).await;
    let s = container_stats(&mut c, &burner).await;
    assert_eq!(s.attributes.unwrap().id, burner);
    assert!(val(&s.writable_layer.expect("writable layer").used_bytes) >= WRITTEN);
    writable_layer_of_at_least(&mut c, &burner, WRITTEN).await;

    for pod in [&pod_a, &pod_b] {
        remove_pod_sandbox(&mut c, pod).await;
    }
    assert!(listed(&mut c, None).await.is_empty());
    assert!(listed_pods(&mut c, None).await.is_empty());
}

//! Black-box tests of the pod metrics RPCs (ListMetricDescriptors, ListPodSandboxMetrics,
//! StreamPodSandboxMetrics: what `crictl metricdescs` and `crictl metricsp` call) against the
//! real daemon, runc and CNI: a running container's metrics, under cAdvisor's names and labels,
//! checked against the cgroup files they come from. crictl is not installed here: the tests
//! call the RPCs through the gRPC client, as crictl does.
//!
//! Root only (they print why and pass elsewhere); see [`minicri_tests::pod_env`].

use std::collections::HashMap;
use std::path::PathBuf;

use futures::StreamExt;
use minicri_proto::runtime::v1 as cri;
use minicri_tests::pod_env::{eventually, with_busybox};
use minicri_tests::pod_rpc::{container_config, run_container, run_pod};

const MIB: u64 = 1 << 20;

/// cAdvisor's labels, the first of every metric.
const BASE: [&str; 6] = ["container", "id", "image", "name", "namespace", "pod"];

/// Holds 16 MiB in a shell variable, says `ready`, then waits for a sleep (a last command
/// alone would replace the shell, and its memory with it).
const HOLDER: &str =
    "x=$(head -c 16777216 /dev/zero | tr '\\000' a); echo ready; sleep 1000 & wait";

fn read_u64(path: &PathBuf) -> u64 {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.trim().parse().unwrap()
}

/// A memory.stat key's value.
fn stat(path: &PathBuf, key: &str) -> u64 {
    let text = std::fs::read_to_string(path).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{key} ")))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// A sample: its value, type and base label values.
type Sample = (u64, i32, Vec<String>);

/// The samples of one container or pod by name and extra label values (after the base ones).
fn by_name(metrics: &[cri::Metric]) -> HashMap<(String, Vec<String>), Sample> {
    metrics
        .iter()
        .map(|m| {
            let key = (m.name.clone(), m.label_values[BASE.len()..].to_vec());
            let v = (
                m.value.unwrap().value,
                m.metric_type,
                m.label_values[..BASE.len()].to_vec(),
            );
            (key, v)
        })
        .collect()
}

/// A running container's metrics match its cgroup files (limits exactly, counters between two
/// readings taken around the call), its labels name it as cAdvisor does, and its pod's metrics
/// hold the pod cgroup's memory and the pod's interface; every sample has as many label values
/// as its descriptor has keys, and the stream answers the same pods.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_are_the_cgroup_files_under_cadvisor_names() {
    let Some((env, image, mut c)) = with_busybox().await else {
        return;
    };
    let start = std::time::Instant::now();
    let (pod, parent) = env.pod_with_own_cgroup("metrics");
    let sandbox = run_pod(&mut c, &pod).await;
    let mut config = container_config("holder", &image, &["sh", "-c", HOLDER]);
    config.linux = Some(cri::LinuxContainerConfig {
        resources: Some(cri::LinuxContainerResources {
            cpu_shares: 512,
            cpu_quota: 50_000,
            cpu_period: 100_000,
            memory_limit_in_bytes: (64 * MIB) as i64,
            ..Default::default()
        }),
        ..Default::default()
    });
    let id = run_container(&mut c, &sandbox, &pod, config).await;
    let log = env.logs.path().join("holder/0.log");
    eventually("the holder to be ready", || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains(" stdout F ready\n")
    })
    .await;

    // The descriptors.
    let descriptors = c
        .list_metric_descriptors(cri::ListMetricDescriptorsRequest {})
        .await
        .unwrap()
        .into_inner()
        .descriptors;
    let keys: HashMap<String, Vec<String>> = (descriptors.iter())
        .map(|d| (d.name.clone(), d.label_keys.clone()))
        .collect();
    for name in [
        "container_cpu_usage_seconds_total",
        "container_memory_usage_bytes",
        "container_memory_working_set_bytes",
        "container_memory_rss",
        "container_memory_cache",
        "container_spec_memory_limit_bytes",
        "container_spec_cpu_shares",
        "container_spec_cpu_quota",
        "container_spec_cpu_period",
        "container_threads",
        "container_oom_events_total",
        "container_start_time_seconds",
        "container_fs_usage_bytes",
        "container_network_receive_bytes_total",
        "container_network_transmit_bytes_total",
    ] {
        let k = keys
            .get(name)
            .unwrap_or_else(|| panic!("no descriptor {name}"));
        assert_eq!(k[..BASE.len()], BASE, "{name}");
    }
    assert_eq!(
        keys["container_network_receive_bytes_total"][BASE.len()..],
        ["interface"]
    );

    // The cgroup files, read before and after the call.
    let cg = |ctrl: &str, rel: &str| PathBuf::from(format!("/sys/fs/cgroup/{ctrl}{parent}{rel}"));
    let ctr = format!("/{id}");
    let cpu_before = read_u64(&cg("cpuacct", &format!("{ctr}/cpuacct.usage")));
    let usage_before = read_u64(&cg("memory", &format!("{ctr}/memory.usage_in_bytes")));
    let pod_usage_before = read_u64(&cg("memory", "/memory.usage_in_bytes"));
    let pods = c
        .list_pod_sandbox_metrics(cri::ListPodSandboxMetricsRequest {})
        .await
        .unwrap()
        .into_inner()
        .pod_metrics;
    let cpu_after = read_u64(&cg("cpuacct", &format!("{ctr}/cpuacct.usage")));
    let usage_after = read_u64(&cg("memory", &format!("{ctr}/memory.usage_in_bytes")));
    let pod_usage_after = read_u64(&cg("memory", "/memory.usage_in_bytes"));
    let rss = stat(&cg("memory", &format!("{ctr}/memory.stat")), "total_rss");

    eprintln!(
        "cgroup: usage {usage_before}..{usage_after}, rss {rss}, cpu {cpu_before}..{cpu_after}"
    );
    assert_eq!(pods.len(), 1, "{pods:?}");
    let p = &pods[0];
    assert_eq!(p.pod_sandbox_id, sandbox);
    for m in p
        .metrics
        .iter()
        .chain(p.container_metrics.iter().flat_map(|c| &c.metrics))
    {
        assert_eq!(m.label_values.len(), keys[&m.name].len(), "{}", m.name);
        assert!(m.timestamp > 0);
    }
    assert_eq!(p.container_metrics.len(), 1);
    assert_eq!(p.container_metrics[0].container_id, id);
    let m = by_name(&p.container_metrics[0].metrics);
    let get = |name: &str| {
        m.get(&(name.to_string(), vec![]))
            .unwrap_or_else(|| panic!("{name}: {m:?}"))
    };
    // Labels: the container's name, its cgroup, image, id, and its pod.
    let cgroup = format!("{parent}/{id}");
    let want_labels: Vec<String> = ["holder", &cgroup, &image, &id, "pods-test", "metrics"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(get("container_memory_usage_bytes").2, want_labels);
    // Limits: exactly the files.
    assert_eq!(
        get("container_spec_memory_limit_bytes").0,
        read_u64(&cg("memory", &format!("{ctr}/memory.limit_in_bytes")))
    );
    assert_eq!(get("container_spec_memory_limit_bytes").0, 64 * MIB);
    assert_eq!(
        get("container_spec_cpu_shares").0,
        read_u64(&cg("cpu", &format!("{ctr}/cpu.shares")))
    );
    assert_eq!(get("container_spec_cpu_shares").0, 512);
    assert_eq!(get("container_spec_cpu_quota").0, 50_000);
    assert_eq!(
        get("container_spec_cpu_period").0,
        read_u64(&cg("cpu", &format!("{ctr}/cpu.cfs_period_us")))
    );
    // Counters: between the readings around the call.
    let cpu = get("container_cpu_usage_seconds_total");
    assert!(
        (cpu_before / 1_000_000_000..=cpu_after / 1_000_000_000).contains(&cpu.0),
        "{cpu:?}"
    );
    assert_eq!(cpu.1, cri::MetricType::Counter as i32);
    let usage = get("container_memory_usage_bytes");
    assert!(
        (usage_before.min(usage_after).saturating_sub(MIB)..=usage_before.max(usage_after) + MIB)
            .contains(&usage.0),
        "{usage:?} {usage_before} {usage_after}"
    );
    assert_eq!(usage.1, cri::MetricType::Gauge as i32);
    assert!(usage.0 >= 16 * MIB);
    let got_rss = get("container_memory_rss").0;
    assert!(
        got_rss >= 16 * MIB && got_rss.abs_diff(rss) <= MIB,
        "rss {got_rss} vs {rss}"
    );
    assert!(get("container_memory_working_set_bytes").0 <= usage.0 + MIB);
    assert_eq!(
        get("container_threads").0,
        read_u64(&cg("pids", &format!("{ctr}/pids.current")))
    );
    assert_eq!(get("container_oom_events_total").0, 0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let started = get("container_start_time_seconds").0;
    assert!(now - started < 120, "started {started}, now {now}");

    // The pod: its own cgroup's memory, its interface.
    let pm = by_name(&p.metrics);
    let pod_usage = pm[&("container_memory_usage_bytes".to_string(), vec![])].clone();
    assert!(
        (pod_usage_before.min(pod_usage_after).saturating_sub(MIB)
            ..=pod_usage_before.max(pod_usage_after) + MIB)
            .contains(&pod_usage.0),
        "{pod_usage:?} {pod_usage_before} {pod_usage_after}"
    );
    assert_eq!(
        pod_usage.2,
        ["", parent.as_str(), "", &sandbox, "pods-test", "metrics"]
    );
    for name in [
        "container_network_receive_bytes_total",
        "container_network_receive_errors_total",
        "container_network_transmit_bytes_total",
        "container_network_transmit_errors_total",
    ] {
        assert!(
            pm.contains_key(&(name.to_string(), vec!["eth0".to_string()])),
            "{name}: {pm:?}"
        );
    }

    // The stream: the same pods and containers.
    let streamed: Vec<cri::PodSandboxMetrics> = c
        .stream_pod_sandbox_metrics(cri::StreamPodSandboxMetricsRequest {})
        .await
        .unwrap()
        .into_inner()
        .flat_map(|b| futures::stream::iter(b.unwrap().pod_sandbox_metrics))
        .collect()
        .await;
    assert_eq!(streamed.len(), 1);
    assert_eq!(streamed[0].pod_sandbox_id, sandbox);
    assert_eq!(streamed[0].container_metrics[0].container_id, id);
    eprintln!("took {:?}", start.elapsed());
}

//! ListMetricDescriptors and ListPodSandboxMetrics (and StreamPodSandboxMetrics): the metrics
//! the kubelet serves on `/metrics/cadvisor` when it takes pod and container stats from the CRI
//! (KEP-2371), under cAdvisor's names and labels, read by the same readers as the stats RPCs
//! ([`super::stats`]: the cgroup counters of [`super::cgroups`], the pod's `/proc/<pid>/net/dev`,
//! the writable layer's background measurement).
//!
//! Every metric has cAdvisor's labels `container`, `id`, `image`, `name`, `namespace`, `pod`
//! ([`BASE_LABELS`]), in that order, then its own (`interface`, `device`, `failure_type` and
//! `scope`). A container's: its CRI name, its cgroup (`/` + the path under the hierarchy's root,
//! as cAdvisor names cgroups), the image it was created from, its id, its pod's namespace and
//! name. A pod's own metrics (its cgroup's, or the sum of its containers', and its network) have
//! an empty `container` and `image`, and the sandbox id as `name`.
//!
//! Values are `UInt64`: seconds are whole seconds (the CRI carries no fractions; the stats RPCs
//! carry nanoseconds). Only ready pods and running containers have metrics (cAdvisor reports
//! live cgroups). Which cAdvisor metrics are reported and which not, and why: docs/cri-coverage.md.

use std::path::Path;
use std::sync::Arc;

use minicri_proto::runtime::v1 as cri;

use super::cgroups::{self, Counters, Hierarchy};
use super::stats::cgroup_parent;
use super::store::{ContainerRecord, ContainerState, SandboxRecord, SandboxState};
use super::{PodService, blocking, now_ns};
use crate::error::Result;

/// cAdvisor's labels, the first of every metric.
pub const BASE_LABELS: [&str; 6] = ["container", "id", "image", "name", "namespace", "pod"];

use cri::MetricType::{Counter, Gauge};

/// One reported metric: name, help, type, and its labels after [`BASE_LABELS`].
struct Desc {
    name: &'static str,
    help: &'static str,
    kind: cri::MetricType,
    extra: &'static [&'static str],
}

const fn desc(
    name: &'static str,
    help: &'static str,
    kind: cri::MetricType,
    extra: &'static [&'static str],
) -> Desc {
    Desc {
        name,
        help,
        kind,
        extra,
    }
}

const CPU_USAGE: &str = "container_cpu_usage_seconds_total";
const MEM_USAGE: &str = "container_memory_usage_bytes";
const MEM_WORKING_SET: &str = "container_memory_working_set_bytes";
const MEM_RSS: &str = "container_memory_rss";
const MEM_CACHE: &str = "container_memory_cache";
const MEM_FAILURES: &str = "container_memory_failures_total";
const MEM_LIMIT: &str = "container_spec_memory_limit_bytes";
const OOM_EVENTS: &str = "container_oom_events_total";
const THREADS: &str = "container_threads";
const CPU_SHARES: &str = "container_spec_cpu_shares";
const CPU_QUOTA: &str = "container_spec_cpu_quota";
const CPU_PERIOD: &str = "container_spec_cpu_period";
const FS_USAGE: &str = "container_fs_usage_bytes";
const START_TIME: &str = "container_start_time_seconds";
const RX_BYTES: &str = "container_network_receive_bytes_total";
const RX_ERRORS: &str = "container_network_receive_errors_total";
const TX_BYTES: &str = "container_network_transmit_bytes_total";
const TX_ERRORS: &str = "container_network_transmit_errors_total";

/// Every metric minicri reports, as ListMetricDescriptors lists them.
const METRICS: &[Desc] = &[
    desc(
        CPU_USAGE,
        "Cumulative CPU time consumed in seconds.",
        Counter,
        &[],
    ),
    desc(
        MEM_USAGE,
        "Current memory usage in bytes, including all memory regardless of when it was accessed.",
        Gauge,
        &[],
    ),
    desc(MEM_WORKING_SET, "Current working set in bytes.", Gauge, &[]),
    desc(MEM_RSS, "Size of RSS in bytes.", Gauge, &[]),
    desc(
        MEM_CACHE,
        "Number of bytes of page cache memory.",
        Gauge,
        &[],
    ),
    desc(
        MEM_FAILURES,
        "Cumulative count of memory allocation failures.",
        Counter,
        &["failure_type", "scope"],
    ),
    desc(
        MEM_LIMIT,
        "Memory limit for the container in bytes.",
        Gauge,
        &[],
    ),
    desc(
        OOM_EVENTS,
        "Count of out of memory events observed for the container.",
        Counter,
        &[],
    ),
    desc(
        THREADS,
        "Number of threads running inside the container.",
        Gauge,
        &[],
    ),
    desc(CPU_SHARES, "CPU share of the container.", Gauge, &[]),
    desc(CPU_QUOTA, "CPU quota of the container.", Gauge, &[]),
    desc(CPU_PERIOD, "CPU period of the container.", Gauge, &[]),
    desc(
        FS_USAGE,
        "Number of bytes that are consumed by the container on this filesystem.",
        Gauge,
        &["device"],
    ),
    desc(
        START_TIME,
        "Start time of the container since unix epoch in seconds.",
        Gauge,
        &[],
    ),
    desc(
        RX_BYTES,
        "Cumulative count of bytes received.",
        Counter,
        &["interface"],
    ),
    desc(
        RX_ERRORS,
        "Cumulative count of errors encountered while receiving.",
        Counter,
        &["interface"],
    ),
    desc(
        TX_BYTES,
        "Cumulative count of bytes transmitted.",
        Counter,
        &["interface"],
    ),
    desc(
        TX_ERRORS,
        "Cumulative count of errors encountered while transmitting.",
        Counter,
        &["interface"],
    ),
];

/// ListMetricDescriptors: every metric ListPodSandboxMetrics may report.
pub fn metric_descriptors() -> Vec<cri::MetricDescriptor> {
    METRICS
        .iter()
        .map(|d| cri::MetricDescriptor {
            name: d.name.into(),
            help: d.help.into(),
            label_keys: BASE_LABELS
                .iter()
                .chain(d.extra)
                .map(|l| l.to_string())
                .collect(),
        })
        .collect()
}

fn kind_of(name: &str) -> cri::MetricType {
    METRICS
        .iter()
        .find(|d| d.name == name)
        .map(|d| d.kind)
        .unwrap_or(Gauge)
}

/// The metrics of one container or pod: its base label values, then each sample's own.
struct Samples {
    at: i64,
    base: Vec<String>,
    out: Vec<cri::Metric>,
}

impl Samples {
    fn new(base: [String; 6]) -> Samples {
        Samples {
            at: now_ns(),
            base: base.into(),
            out: Vec::new(),
        }
    }

    fn push(&mut self, name: &'static str, extra: &[&str], v: Option<u64>) {
        let Some(value) = v else { return };
        let mut label_values = self.base.clone();
        label_values.extend(extra.iter().map(|s| s.to_string()));
        self.out.push(cri::Metric {
            name: name.into(),
            timestamp: self.at,
            metric_type: kind_of(name) as i32,
            label_values,
            value: Some(cri::UInt64Value { value }),
        });
    }

    /// The CPU, memory and thread counters of a cgroup (or a pod's sum).
    fn counters(&mut self, c: &Counters) {
        self.push(CPU_USAGE, &[], c.cpu_ns.map(|ns| ns / 1_000_000_000));
        if let Some(m) = c.memory {
            self.push(MEM_USAGE, &[], Some(m.usage));
            self.push(MEM_WORKING_SET, &[], Some(m.working_set));
            self.push(MEM_RSS, &[], Some(m.rss));
            self.push(MEM_CACHE, &[], Some(m.cache));
            // `memory.stat`'s fault counts include the cgroup's descendants.
            let faults = [
                ("pgfault", m.page_faults),
                ("pgmajfault", m.major_page_faults),
            ];
            for (kind, n) in faults {
                self.push(MEM_FAILURES, &[kind, "hierarchy"], Some(n));
            }
            self.push(MEM_LIMIT, &[], m.limit);
        }
        self.push(THREADS, &[], c.pids);
    }
}

/// A cgroup path as cAdvisor names it: `/` and the path under the hierarchy's root.
fn cgroup_name(rel: Option<&Path>) -> String {
    rel.map(|p| format!("/{}", p.display())).unwrap_or_default()
}

impl PodService {
    /// ListPodSandboxMetrics (and StreamPodSandboxMetrics): the metrics of every ready pod and
    /// its running containers, in creation order.
    pub async fn list_pod_sandbox_metrics(self: &Arc<Self>) -> Result<Vec<cri::PodSandboxMetrics>> {
        let svc = self.clone();
        blocking(move || {
            let mut sandboxes: Vec<SandboxRecord> = (svc.store.sandboxes().into_iter())
                .filter(|s| s.state == SandboxState::Ready)
                .collect();
            sandboxes.sort_by_key(|s| s.created_at);
            Ok(sandboxes.iter().map(|sb| svc.pod_metrics(sb)).collect())
        })
        .await
    }

    fn pod_metrics(&self, sb: &SandboxRecord) -> cri::PodSandboxMetrics {
        let meta = sb.summary().metadata.unwrap_or_default();
        let parent = cgroup_parent(Some(sb));
        let (counters, containers) = self.pod_counters(sb, &parent);
        let pod_cgroup = cgroups::pod_cgroup(self.cgroup_driver, &parent);
        let mut pod = Samples::new([
            String::new(),
            cgroup_name(pod_cgroup.as_deref()),
            String::new(),
            sb.id.clone(),
            meta.namespace.clone(),
            meta.name.clone(),
        ]);
        pod.counters(&counters);
        if let Some(net) = self.network_usage(sb, pod.at) {
            let n = |v: &Option<cri::UInt64Value>| v.as_ref().map(|v| v.value);
            for i in &net.interfaces {
                let ifname = [i.name.as_str()];
                pod.push(RX_BYTES, &ifname, n(&i.rx_bytes));
                pod.push(RX_ERRORS, &ifname, n(&i.rx_errors));
                pod.push(TX_BYTES, &ifname, n(&i.tx_bytes));
                pod.push(TX_ERRORS, &ifname, n(&i.tx_errors));
            }
        }
        let container_metrics = (containers.iter())
            .filter(|(r, _)| r.state == ContainerState::Running)
            .map(|(r, c)| self.container_metrics(r, c, &parent, &meta))
            .collect();
        cri::PodSandboxMetrics {
            pod_sandbox_id: sb.id.clone(),
            metrics: pod.out,
            container_metrics,
        }
    }

    fn container_metrics(
        &self,
        r: &ContainerRecord,
        c: &Counters,
        parent: &str,
        pod: &cri::PodSandboxMetadata,
    ) -> cri::ContainerMetrics {
        let rel = cgroups::container_cgroup(self.cgroup_driver, parent, &r.id);
        let name = r.summary().metadata.map(|m| m.name).unwrap_or_default();
        let mut s = Samples::new([
            name,
            cgroup_name(rel.as_deref()),
            r.image.clone(),
            r.id.clone(),
            pod.namespace.clone(),
            pod.name.clone(),
        ]);
        s.counters(c);
        if let Some(rel) = &rel {
            let h = Hierarchy::host();
            s.push(OOM_EVENTS, &[], h.oom_kills(rel));
            let cpu = h.cpu_limits(rel);
            s.push(CPU_SHARES, &[], cpu.shares);
            s.push(CPU_QUOTA, &[], cpu.quota);
            s.push(CPU_PERIOD, &[], cpu.period);
        }
        if let Some(layer) = self.writable_layer(&r.id) {
            let device = layer.fs_id.map(|f| f.mountpoint).unwrap_or_default();
            s.push(
                FS_USAGE,
                &[device.as_str()],
                layer.used_bytes.map(|v| v.value),
            );
        }
        s.push(
            START_TIME,
            &[],
            u64::try_from(r.started_at / 1_000_000_000).ok(),
        );
        cri::ContainerMetrics {
            container_id: r.id.clone(),
            metrics: s.out,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every descriptor starts with cAdvisor's labels, names are unique, and each sample the
    /// service makes has as many label values as its descriptor has keys.
    #[test]
    fn descriptors_and_samples_agree() {
        let d = metric_descriptors();
        let names: std::collections::HashSet<_> = d.iter().map(|d| d.name.clone()).collect();
        assert_eq!(names.len(), d.len());
        assert!(d.iter().all(|d| d.label_keys[..6] == BASE_LABELS));
        let mut s = Samples::new(Default::default());
        s.counters(&Counters {
            cpu_ns: Some(2_500_000_000),
            memory: Some(cgroups::Memory {
                usage: 10,
                working_set: 8,
                rss: 5,
                cache: 3,
                page_faults: 7,
                major_page_faults: 1,
                limit: Some(100),
            }),
            pids: Some(4),
        });
        s.push(RX_BYTES, &["eth0"], Some(9));
        s.push(FS_USAGE, &["/var/lib/minicri"], None);
        let got: Vec<(&str, u64, usize)> = (s.out.iter())
            .map(|m| {
                (
                    m.name.as_str(),
                    m.value.unwrap().value,
                    m.label_values.len(),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (CPU_USAGE, 2, 6),
                (MEM_USAGE, 10, 6),
                (MEM_WORKING_SET, 8, 6),
                (MEM_RSS, 5, 6),
                (MEM_CACHE, 3, 6),
                (MEM_FAILURES, 7, 8),
                (MEM_FAILURES, 1, 8),
                (MEM_LIMIT, 100, 6),
                (THREADS, 4, 6),
                (RX_BYTES, 9, 7),
            ]
        );
        for m in &s.out {
            let desc = d.iter().find(|d| d.name == m.name).unwrap();
            assert_eq!(desc.label_keys.len(), m.label_values.len(), "{}", m.name);
        }
        assert_eq!(s.out[0].metric_type, Counter as i32);
        assert_eq!(s.out[1].metric_type, Gauge as i32);
    }
}

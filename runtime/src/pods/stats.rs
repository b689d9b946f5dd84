//! The stats RPCs: ContainerStats, ListContainerStats, PodSandboxStats, ListPodSandboxStats.
//!
//! Sources:
//! - CPU, memory and process counters from the cgroups ([`super::cgroups`]) of the container, or
//!   of the pod: its own cgroup (the sandbox's cgroup parent) when the sandbox names one, else
//!   the sum of its containers' and its infra's cgroups;
//! - the writable layer: the snapshotter's usage of the container's active snapshot (key = the
//!   container id), a walk of a tree the container fills as it likes (millions of files take
//!   seconds). No stats call walks: each answers with the last measurement (none before the
//!   first) and queues a layer whose measurement is missing or older than [`SNAPSHOT_USAGE_TTL`]
//!   for one background thread, which measures the queue one layer at a time. The figures are
//!   thus up to one kubelet stats period old, as ImageFsInfo's are. Its `fs_id` is the image
//!   filesystem ImageFsInfo reports (the daemon's root), which holds the snapshots;
//! - the pod's network counters: `/proc/<infra pid>/net/dev`, which lists the interfaces of the
//!   infra's network namespace, read only while that namespace is the pod's pinned one (so a
//!   recycled pid is never read); none for host-network pods (they would report the node's).
//!
//! CRI rules followed (as the kubelet's CRI stats provider reads them):
//! - attributes (id, metadata, labels, annotations) are the create-time configs', exactly;
//! - an unknown id is NOT_FOUND; a container that is not running is no error: it gets what can
//!   be had (attributes, writable layer; CPU and memory while its cgroup exists);
//! - `usage_nano_cores` is the rate since the previous sample of the same container or pod, kept
//!   in memory ([`StatsState`]); it is absent on the first sample (the kubelet then computes its
//!   own), and samples less than [`MIN_RATE_INTERVAL`] apart repeat the last rate rather than
//!   divide by a tiny interval;
//! - `working_set_bytes` is usage − inactive_file; `available_bytes` is limit − working set and
//!   only present under a memory limit (as cAdvisor reports it: 0 would read "nothing left").
//!
//! Everything here reads files: the async entry points run on the blocking pool.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use minicri_proto::runtime::v1 as cri;
use minicri_snapshotter::Usage;

use super::cgroups::{self, Counters, Hierarchy};
use super::store::{ContainerRecord, SandboxRecord, SandboxState};
use super::{PodService, blocking, now_ns};
use crate::error::Result;
use crate::images::ImageAccess;

/// Samples closer than this repeat the previous rate instead of making a new one.
pub const MIN_RATE_INTERVAL: Duration = Duration::from_secs(1);

/// How long a measured snapshot usage is reused: a container's writable layer here, the image
/// filesystem's snapshots in ImageFsInfo (`Daemon::image_fs_usage`).
pub const SNAPSHOT_USAGE_TTL: Duration = Duration::from_secs(5);

/// One CPU sample of a container or pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CpuSample {
    at_ns: i64,
    usage_ns: u64,
    /// The rate computed when this sample was taken.
    rate: Option<u64>,
}

/// The rate (nanocores) of a new reading against the kept sample, and the sample to keep.
fn cpu_rate(prev: Option<CpuSample>, at_ns: i64, usage_ns: u64) -> (Option<u64>, CpuSample) {
    let fresh = |rate| CpuSample {
        at_ns,
        usage_ns,
        rate,
    };
    let Some(p) = prev else {
        return (None, fresh(None));
    };
    // A counter that went back (a summed pod lost a container) starts over.
    if usage_ns < p.usage_ns {
        return (None, fresh(None));
    }
    let dt = at_ns.saturating_sub(p.at_ns);
    if dt < MIN_RATE_INTERVAL.as_nanos() as i64 {
        return (p.rate, p);
    }
    let rate = (u128::from(usage_ns - p.usage_ns) * 1_000_000_000 / dt as u128) as u64;
    (Some(rate), fresh(Some(rate)))
}

#[derive(Debug, Clone, Copy)]
struct LayerSample {
    measured: Instant,
    at_ns: i64,
    usage: Usage,
}

/// What the stats RPCs keep between calls: the previous CPU sample per container and pod, and
/// the last writable-layer measurement per container. Entries of removed objects are dropped by
/// the list RPCs.
pub struct StatsState {
    /// The image filesystem's mount point, the writable layers' `fs_id`.
    image_fs: PathBuf,
    images: Arc<dyn ImageAccess>,
    cpu: Mutex<HashMap<String, CpuSample>>,
    layers: Mutex<HashMap<String, LayerSample>>,
    /// Writable layers waiting for (or under) a measurement.
    queue: Mutex<LayerQueue>,
}

/// The background measurer's work: each layer once, however many stats calls (and kubelet
/// retries) ask for it meanwhile, and one walk at a time.
#[derive(Default)]
pub(super) struct LayerQueue {
    waiting: VecDeque<String>,
    /// Everything in `waiting`, and the layer being measured.
    queued: HashSet<String>,
    /// Whether the measuring thread runs; it ends when `waiting` is empty.
    running: bool,
}

#[cfg(test)]
impl LayerQueue {
    /// Whether nothing is waiting or being measured.
    pub(super) fn is_idle(&self) -> bool {
        self.queued.is_empty() && !self.running
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl StatsState {
    pub fn new(image_fs: PathBuf, images: Arc<dyn ImageAccess>) -> StatsState {
        StatsState {
            image_fs,
            images,
            cpu: Mutex::new(HashMap::new()),
            layers: Mutex::new(HashMap::new()),
            queue: Mutex::new(LayerQueue::default()),
        }
    }

    /// Records a CPU reading of `key` and returns the rate since the kept sample.
    fn cpu_rate(&self, key: &str, at_ns: i64, usage_ns: u64) -> Option<u64> {
        let mut g = lock(&self.cpu);
        let (rate, keep) = cpu_rate(g.get(key).copied(), at_ns, usage_ns);
        g.insert(key.to_string(), keep);
        rate
    }

    /// Forgets every object not in `live`.
    fn retain(&self, live: &HashSet<String>) {
        lock(&self.cpu).retain(|k, _| live.contains(k));
        lock(&self.layers).retain(|k, _| live.contains(k));
    }

    pub(super) fn queue(&self) -> MutexGuard<'_, LayerQueue> {
        lock(&self.queue)
    }

    /// The last measurement of `id`'s writable layer, if any; queues a new one when there is
    /// none or it is older than [`SNAPSHOT_USAGE_TTL`]. Never walks the layer itself.
    fn layer_sample(self: &Arc<Self>, id: &str) -> Option<LayerSample> {
        let last = lock(&self.layers).get(id).copied();
        if last.is_none_or(|s| s.measured.elapsed() >= SNAPSHOT_USAGE_TTL) {
            self.queue_measurement(id);
        }
        last
    }

    fn queue_measurement(self: &Arc<Self>, id: &str) {
        let mut q = self.queue();
        if !q.queued.insert(id.to_string()) {
            return;
        }
        q.waiting.push_back(id.to_string());
        if q.running {
            return;
        }
        q.running = true;
        let me = self.clone();
        let spawned = std::thread::Builder::new()
            .name("layer-usage".into())
            .spawn(move || me.measure_queued());
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "starting the writable-layer measurer");
            q.running = false;
            q.waiting.clear();
            q.queued.clear();
        }
    }

    /// The measuring thread: walks the queued layers one at a time until none waits.
    fn measure_queued(&self) {
        loop {
            let id = {
                // Checked and cleared under the lock that queueing takes: no layer is left
                // waiting with nobody to measure it.
                let mut q = self.queue();
                match q.waiting.pop_front() {
                    Some(id) => id,
                    None => {
                        q.running = false;
                        return;
                    }
                }
            };
            // A panic in the walk (a bug) costs this layer's figures, not the measurer.
            let usage = crate::fsutil::walk_caught(&id, || self.images.usage(&id));
            match usage {
                Ok(usage) => {
                    let s = LayerSample {
                        measured: Instant::now(),
                        at_ns: now_ns(),
                        usage,
                    };
                    lock(&self.layers).insert(id.clone(), s);
                }
                Err(minicri_snapshotter::Error::NotFound { .. }) => {
                    lock(&self.layers).remove(&id);
                }
                Err(e) => tracing::debug!(container = %id, error = %e, "writable layer usage"),
            }
            self.queue().queued.remove(&id);
        }
    }
}

/// One interface's counters from `/proc/<pid>/net/dev`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Interface {
    name: String,
    rx_bytes: u64,
    rx_errors: u64,
    tx_bytes: u64,
    tx_errors: u64,
}

/// Parses `/proc/<pid>/net/dev` (two header lines, then `<name>: <8 rx fields> <8 tx fields>`),
/// leaving out the loopback interface.
fn parse_net_dev(text: &str) -> Vec<Interface> {
    text.lines()
        .filter_map(|l| {
            let (name, rest) = l.split_once(':')?;
            let name = name.trim();
            let f: Vec<u64> = rest
                .split_whitespace()
                .map(|v| v.parse().ok())
                .collect::<Option<_>>()?;
            (name != "lo" && f.len() >= 16).then(|| Interface {
                name: name.to_string(),
                rx_bytes: f[0],
                rx_errors: f[2],
                tx_bytes: f[8],
                tx_errors: f[10],
            })
        })
        .collect()
}

fn value(v: u64) -> Option<cri::UInt64Value> {
    Some(cri::UInt64Value { value: v })
}

/// Whether two paths are the same file (a namespace: same device and inode).
fn same_file(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// The pod's cgroup parent, decoding nothing else of its config (called for every container).
pub(super) fn cgroup_parent(sb: Option<&SandboxRecord>) -> String {
    sb.and_then(|s| s.summary().linux.map(|l| l.cgroup_parent))
        .unwrap_or_default()
}

impl PodService {
    /// ContainerStats: NOT_FOUND for an unknown id.
    pub async fn container_stats(self: &Arc<Self>, id: &str) -> Result<cri::ContainerStats> {
        let rec = self.container_record(id)?;
        let svc = self.clone();
        blocking(move || {
            let parent = cgroup_parent(svc.store.sandbox(&rec.sandbox_id).as_ref());
            Ok(svc.one_container_stats(&rec, &parent).0)
        })
        .await
    }

    /// ListContainerStats: every container matching the filter (id and sandbox id by prefix,
    /// every label of the selector), in creation order.
    pub async fn list_container_stats(
        self: &Arc<Self>,
        filter: Option<cri::ContainerStatsFilter>,
    ) -> Result<Vec<cri::ContainerStats>> {
        let f = filter.unwrap_or_default();
        let svc = self.clone();
        blocking(move || {
            svc.forget_removed();
            let mut recs: Vec<ContainerRecord> = svc
                .store
                .containers()
                .into_iter()
                .filter(|r| r.id.starts_with(&f.id))
                .filter(|r| r.sandbox_id.starts_with(&f.pod_sandbox_id))
                .filter(|r| super::labels_match(&f.label_selector, &r.summary().labels))
                .collect();
            recs.sort_by_key(|r| r.created_at);
            let mut parents: HashMap<String, String> = HashMap::new();
            Ok(recs
                .iter()
                .map(|r| {
                    let parent = parents.entry(r.sandbox_id.clone()).or_insert_with(|| {
                        cgroup_parent(svc.store.sandbox(&r.sandbox_id).as_ref())
                    });
                    svc.one_container_stats(r, parent).0
                })
                .collect())
        })
        .await
    }

    /// PodSandboxStats: NOT_FOUND for an unknown id.
    pub async fn pod_sandbox_stats(self: &Arc<Self>, id: &str) -> Result<cri::PodSandboxStats> {
        let rec = self.sandbox_record(id)?;
        let svc = self.clone();
        blocking(move || Ok(svc.one_pod_stats(&rec))).await
    }

    /// ListPodSandboxStats: every sandbox matching the filter (id by prefix, every label of the
    /// selector), in creation order.
    pub async fn list_pod_sandbox_stats(
        self: &Arc<Self>,
        filter: Option<cri::PodSandboxStatsFilter>,
    ) -> Result<Vec<cri::PodSandboxStats>> {
        let f = filter.unwrap_or_default();
        let svc = self.clone();
        blocking(move || {
            svc.forget_removed();
            let mut recs: Vec<SandboxRecord> = svc
                .store
                .sandboxes()
                .into_iter()
                .filter(|r| r.id.starts_with(&f.id))
                .filter(|r| super::labels_match(&f.label_selector, &r.summary().labels))
                .collect();
            recs.sort_by_key(|r| r.created_at);
            Ok(recs.iter().map(|r| svc.one_pod_stats(r)).collect())
        })
        .await
    }

    /// Drops the kept samples of objects that no longer exist.
    fn forget_removed(&self) {
        let live: HashSet<String> = self
            .store
            .containers()
            .into_iter()
            .map(|c| c.id)
            .chain(self.store.sandboxes().into_iter().map(|s| s.id))
            .collect();
        self.stats.retain(&live);
    }

    /// The counters of the cgroup the runtime made for `id` (a container or an infra process)
    /// under `parent`.
    pub(super) fn cgroup_counters(&self, parent: &str, id: &str) -> Counters {
        cgroups::container_cgroup(self.cgroup_driver, parent, id)
            .map(|rel| Hierarchy::host().read(&rel))
            .unwrap_or_default()
    }

    fn cpu_usage(&self, key: &str, at_ns: i64, c: &Counters) -> Option<cri::CpuUsage> {
        let usage = c.cpu_ns?;
        Some(cri::CpuUsage {
            timestamp: at_ns,
            usage_core_nano_seconds: value(usage),
            usage_nano_cores: self.stats.cpu_rate(key, at_ns, usage).and_then(value),
            psi: None,
        })
    }

    /// The stats of one container, and its cgroup counters (for a pod's sum).
    fn one_container_stats(
        &self,
        r: &ContainerRecord,
        parent: &str,
    ) -> (cri::ContainerStats, Counters) {
        let counters = self.cgroup_counters(parent, &r.id);
        (self.container_stats_of(r, &counters), counters)
    }

    fn container_stats_of(&self, r: &ContainerRecord, counters: &Counters) -> cri::ContainerStats {
        let config = r.summary();
        let at = now_ns();
        cri::ContainerStats {
            attributes: Some(cri::ContainerAttributes {
                id: r.id.clone(),
                metadata: config.metadata,
                labels: config.labels,
                annotations: config.annotations,
            }),
            cpu: self.cpu_usage(&r.id, at, counters),
            memory: memory_usage(at, counters),
            writable_layer: self.writable_layer(&r.id),
            swap: None,
            io: None,
        }
    }

    /// The counters of pod `sb` (under its cgroup `parent`): its own cgroup's when it has one,
    /// else the sum of its infra's and its containers'; and each container's, in creation order.
    /// What the pod stats and the pod metrics report.
    pub(super) fn pod_counters(
        &self,
        sb: &SandboxRecord,
        parent: &str,
    ) -> (Counters, Vec<(ContainerRecord, Counters)>) {
        let mut recs = self.store.containers_of(&sb.id);
        recs.sort_by_key(|r| r.created_at);
        let mut sum = self.cgroup_counters(parent, &sb.id);
        let containers: Vec<_> = recs
            .into_iter()
            .map(|r| {
                let c = self.cgroup_counters(parent, &r.id);
                sum.add(&c);
                (r, c)
            })
            .collect();
        let counters = cgroups::pod_cgroup(self.cgroup_driver, parent)
            .map(|rel| Hierarchy::host().read(&rel))
            .filter(|c| !c.is_empty())
            .unwrap_or(sum);
        (counters, containers)
    }

    /// The writable layer's usage as last measured in the background (see the module's doc);
    /// `None` before the first measurement and once the snapshot is gone.
    pub(super) fn writable_layer(&self, id: &str) -> Option<cri::FilesystemUsage> {
        let sample = self.stats.layer_sample(id)?;
        Some(cri::FilesystemUsage {
            timestamp: sample.at_ns,
            fs_id: Some(cri::FilesystemIdentifier {
                mountpoint: self.stats.image_fs.display().to_string(),
            }),
            used_bytes: value(sample.usage.bytes),
            inodes_used: value(sample.usage.inodes),
        })
    }

    fn one_pod_stats(&self, sb: &SandboxRecord) -> cri::PodSandboxStats {
        // Only the summary: the whole config (port mappings, DNS, sysctls) is not needed here.
        let config = sb.summary();
        let parent = cgroup_parent(Some(sb));
        let (counters, recs) = self.pod_counters(sb, &parent);
        let containers = (recs.iter())
            .map(|(r, c)| self.container_stats_of(r, c))
            .collect();
        let at = now_ns();
        cri::PodSandboxStats {
            attributes: Some(cri::PodSandboxAttributes {
                id: sb.id.clone(),
                metadata: config.metadata,
                labels: config.labels,
                annotations: config.annotations,
            }),
            linux: Some(cri::LinuxPodSandboxStats {
                cpu: self.cpu_usage(&sb.id, at, &counters),
                memory: memory_usage(at, &counters),
                network: self.network_usage(sb, at),
                process: counters.pids.map(|n| cri::ProcessUsage {
                    timestamp: at,
                    process_count: value(n),
                }),
                containers,
                io: None,
            }),
            windows: None,
        }
    }

    /// The pod's interfaces, from its infra's `/proc/<pid>/net/dev`.
    pub(super) fn network_usage(&self, sb: &SandboxRecord, at: i64) -> Option<cri::NetworkUsage> {
        let netns = sb.netns.as_ref()?;
        if sb.state != SandboxState::Ready || sb.infra_pid <= 0 {
            return None;
        }
        let proc_dir = PathBuf::from(format!("/proc/{}", sb.infra_pid));
        if !same_file(&proc_dir.join("ns/net"), netns) {
            return None;
        }
        let text = std::fs::read_to_string(proc_dir.join("net/dev")).ok()?;
        let default_name = crate::cni::pod::POD_IF_NAME;
        let interfaces: Vec<cri::NetworkInterfaceUsage> = parse_net_dev(&text)
            .into_iter()
            .map(|i| cri::NetworkInterfaceUsage {
                name: i.name,
                rx_bytes: value(i.rx_bytes),
                rx_errors: value(i.rx_errors),
                tx_bytes: value(i.tx_bytes),
                tx_errors: value(i.tx_errors),
            })
            .collect();
        Some(cri::NetworkUsage {
            timestamp: at,
            default_interface: interfaces.iter().find(|i| i.name == default_name).cloned(),
            interfaces,
        })
    }
}

fn memory_usage(at: i64, c: &Counters) -> Option<cri::MemoryUsage> {
    let m = c.memory?;
    Some(cri::MemoryUsage {
        timestamp: at,
        working_set_bytes: value(m.working_set),
        available_bytes: m.available().and_then(value),
        usage_bytes: value(m.usage),
        rss_bytes: value(m.rss),
        page_faults: value(m.page_faults),
        major_page_faults: value(m.major_page_faults),
        psi: None,
    })
}

#[cfg(test)]
mod tests;

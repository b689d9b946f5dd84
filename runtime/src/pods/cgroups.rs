//! What the kernel's cgroup files say about a container or a pod: whether the OOM killer struck
//! a container, and the CPU, memory and process counters the stats RPCs report.
//!
//! Which cgroup: a container's is the one the OCI runtime makes of `linux.cgroupsPath`
//! ([`cgroups_path`]): with the cgroupfs driver the directory `<parent>/<id>`; with the systemd
//! driver (`<slice>:minicri:<id>`) the scope `minicri-<id>.scope` inside the slice's directory,
//! which nests as systemd nests slices (`a-b.slice` is `a.slice/a-b.slice`). A pod's own cgroup
//! is its sandbox's cgroup parent when the sandbox names one ([`pod_cgroup`]); the default
//! parent (`/minicri`, `system.slice`) is shared by every pod, so it is nobody's.
//!
//! Which hierarchy ([`Hierarchy`], from `/proc/self/mountinfo`): cgroup v1, one mount per
//! controller (`memory`, `cpuacct`, `pids`; the empty cgroup2 mount of a hybrid host is ignored),
//! or the cgroup v2 unified mount when no v1 memory controller is mounted.
//!
//! Files read:
//! - v1: `cpuacct.usage` (ns); `memory.usage_in_bytes`, `memory.stat` (the hierarchical
//!   `total_*` keys: a pod's cgroup holds its containers' memory in children), the limit (the
//!   least of `memory.limit_in_bytes` and `memory.stat`'s `hierarchical_memory_limit`),
//!   `memory.oom_control` (`oom_kill N`); `pids.current`;
//! - v2: `cpu.stat` (`usage_usec`); `memory.current`, `memory.max` (the least of the cgroup's
//!   and its ancestors'), `memory.stat`, `memory.events` (`oom_kill N`); `pids.current`.
//!
//! Cgroups come and go with their containers: a missing cgroup or file reads as `None`, never as
//! an error. The OOM count is read when the shim reports the container's exit, before `runc
//! delete` removes a cgroupfs cgroup; on cgroup v2 the shim has counted OOM kills while the
//! container ran (`crate::shim::oom`), since systemd removes a scope's cgroup as soon as it is
//! empty. systemd watches the same count (a scope's `OOMPolicy`, `stop` by default, stops the
//! unit at the first kill) and can remove the cgroup before the shim's watch has read the
//! change; so under the systemd driver a container killed by SIGKILL with no count read is asked
//! of systemd ([`oom_killed_after_exit`]): a scope it stopped for an OOM kill is left failed with
//! `Result=oom-kill` until the runtime's delete resets it.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::oci::{CgroupDriver, cgroups_path, systemd_slice};

/// Limits above this are "no limit": the kernel reports an unset limit as a page-rounded
/// `i64::MAX`, never exactly a round number.
const UNLIMITED: u64 = 1 << 62;

/// Where the cgroup hierarchies are mounted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hierarchy {
    /// One mount per controller; `None` for a controller that is not mounted.
    V1 {
        memory: Option<PathBuf>,
        cpuacct: Option<PathBuf>,
        pids: Option<PathBuf>,
        /// The CPU limits (`cpu.shares`, `cpu.cfs_*`): often mounted with `cpuacct`.
        cpu: Option<PathBuf>,
        cpuset: Option<PathBuf>,
    },
    /// The unified hierarchy.
    V2 { root: PathBuf },
}

/// Memory counters of one cgroup, in bytes (faults are counts).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Memory {
    pub usage: u64,
    /// `usage - inactive_file`: what the kubelet's eviction and the OOM killer care about.
    pub working_set: u64,
    /// Anonymous memory (v1 `total_rss`, v2 `anon`).
    pub rss: u64,
    /// Page cache (v1 `total_cache`, v2 `file`).
    pub cache: u64,
    pub page_faults: u64,
    pub major_page_faults: u64,
    /// The effective limit; `None` without one.
    pub limit: Option<u64>,
}

impl Memory {
    /// `limit - working_set` under a limit; `None` without one (nothing bounds it but the node).
    pub fn available(&self) -> Option<u64> {
        self.limit.map(|l| l.saturating_sub(self.working_set))
    }

    /// Adds the counters of another cgroup; the sum has no limit.
    fn add(&mut self, o: &Memory) {
        self.usage += o.usage;
        self.working_set += o.working_set;
        self.rss += o.rss;
        self.cache += o.cache;
        self.page_faults += o.page_faults;
        self.major_page_faults += o.major_page_faults;
        self.limit = None;
    }
}

/// The counters of one cgroup (or a sum of several); `None` where nothing could be read.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counters {
    /// CPU time consumed, in nanoseconds.
    pub cpu_ns: Option<u64>,
    pub memory: Option<Memory>,
    /// Processes (tasks) in the cgroup and its descendants.
    pub pids: Option<u64>,
}

impl Counters {
    /// Adds the counters of another cgroup.
    pub fn add(&mut self, o: &Counters) {
        fn sum(a: Option<u64>, b: Option<u64>) -> Option<u64> {
            match (a, b) {
                (Some(x), Some(y)) => Some(x + y),
                (x, None) | (None, x) => x,
            }
        }
        self.cpu_ns = sum(self.cpu_ns, o.cpu_ns);
        self.pids = sum(self.pids, o.pids);
        self.memory = match (self.memory, o.memory) {
            (Some(mut a), Some(b)) => {
                a.add(&b);
                Some(a)
            }
            (Some(mut a), None) | (None, Some(mut a)) => {
                a.limit = None;
                Some(a)
            }
            (None, None) => None,
        };
    }

    pub fn is_empty(&self) -> bool {
        self.cpu_ns.is_none() && self.memory.is_none() && self.pids.is_none()
    }
}

impl Hierarchy {
    /// The hierarchies mounted on this host (read once).
    pub fn host() -> &'static Hierarchy {
        static HOST: OnceLock<Hierarchy> = OnceLock::new();
        HOST.get_or_init(|| {
            std::fs::read_to_string("/proc/self/mountinfo")
                .ok()
                .and_then(|t| Hierarchy::from_mountinfo(&t))
                .unwrap_or_else(|| {
                    let root = Path::new("/sys/fs/cgroup");
                    if root.join("cgroup.controllers").exists() {
                        Hierarchy::V2 { root: root.into() }
                    } else {
                        Hierarchy::V1 {
                            memory: Some(root.join("memory")),
                            cpuacct: Some(root.join("cpuacct")),
                            pids: Some(root.join("pids")),
                            cpu: Some(root.join("cpu")),
                            cpuset: Some(root.join("cpuset")),
                        }
                    }
                })
        })
    }

    /// The hierarchies a `/proc/<pid>/mountinfo` lists: v1 when a v1 memory controller is
    /// mounted, else v2 when a cgroup2 filesystem is; `None` when neither is.
    pub fn from_mountinfo(text: &str) -> Option<Hierarchy> {
        let (mut memory, mut cpuacct, mut pids, mut unified) = (None, None, None, None);
        let (mut cpu, mut cpuset) = (None, None);
        for line in text.lines() {
            // `<id> <parent> <dev> <root> <mountpoint> <options> [optional…] - <fstype> <source> <super options>`
            let Some((left, right)) = line.split_once(" - ") else {
                continue;
            };
            let Some(mountpoint) = left.split(' ').nth(4) else {
                continue;
            };
            let mut r = right.split(' ');
            let (fstype, _source, opts) = (r.next(), r.next(), r.next().unwrap_or(""));
            let mountpoint = PathBuf::from(mountpoint.replace("\\040", " "));
            match fstype {
                Some("cgroup") => {
                    for o in opts.split(',') {
                        let slot = match o {
                            "memory" => &mut memory,
                            "cpuacct" => &mut cpuacct,
                            "pids" => &mut pids,
                            "cpu" => &mut cpu,
                            "cpuset" => &mut cpuset,
                            _ => continue,
                        };
                        slot.get_or_insert_with(|| mountpoint.clone());
                    }
                }
                Some("cgroup2") => {
                    unified.get_or_insert(mountpoint);
                }
                _ => {}
            }
        }
        if memory.is_some() {
            Some(Hierarchy::V1 {
                memory,
                cpuacct,
                pids,
                cpu,
                cpuset,
            })
        } else {
            unified.map(|root| Hierarchy::V2 { root })
        }
    }

    /// The directory of cgroup `rel` (relative to the hierarchy's root) in the hierarchy that
    /// holds `controller`'s files.
    pub(crate) fn dir(&self, controller: &str, rel: &Path) -> Option<PathBuf> {
        let base = match self {
            Hierarchy::V2 { root } => root,
            Hierarchy::V1 {
                memory,
                cpuacct,
                pids,
                cpu,
                cpuset,
            } => match controller {
                "memory" => memory.as_ref()?,
                "cpuacct" => cpuacct.as_ref()?,
                "pids" => pids.as_ref()?,
                "cpu" => cpu.as_ref()?,
                "cpuset" => cpuset.as_ref()?,
                _ => return None,
            },
        };
        Some(base.join(rel))
    }

    /// The counters of cgroup `rel`; all `None` when it does not exist.
    pub fn read(&self, rel: &Path) -> Counters {
        let read = |controller: &str, file: &str| {
            self.dir(controller, rel)
                .and_then(|d| std::fs::read_to_string(d.join(file)).ok())
        };
        match self {
            Hierarchy::V1 { .. } => Counters {
                cpu_ns: read("cpuacct", "cpuacct.usage").and_then(|t| parse_u64(&t)),
                memory: memory_v1(
                    read("memory", "memory.usage_in_bytes").as_deref(),
                    read("memory", "memory.stat").as_deref(),
                    read("memory", "memory.limit_in_bytes").as_deref(),
                ),
                pids: read("pids", "pids.current").and_then(|t| parse_u64(&t)),
            },
            Hierarchy::V2 { root } => {
                let dir = root.join(rel);
                // The effective limit is the least along the path to the root.
                let maxes: Vec<String> = dir
                    .ancestors()
                    .take_while(|d| d.starts_with(root) && *d != root.as_path())
                    .filter_map(|d| std::fs::read_to_string(d.join("memory.max")).ok())
                    .collect();
                Counters {
                    cpu_ns: read("cpu", "cpu.stat").and_then(|t| cpu_v2(&t)),
                    memory: memory_v2(
                        read("memory", "memory.current").as_deref(),
                        read("memory", "memory.stat").as_deref(),
                        maxes.iter().map(String::as_str),
                    ),
                    pids: read("pids", "pids.current").and_then(|t| parse_u64(&t)),
                }
            }
        }
    }

    /// The CPU limits set on cgroup `rel`, in cgroup v1 units (v2's `cpu.weight` converted back
    /// to shares as the runtimes convert shares to it); `None` where unreadable or unset.
    pub fn cpu_limits(&self, rel: &Path) -> CpuLimits {
        let read = |file: &str| {
            self.dir("cpu", rel)
                .and_then(|d| std::fs::read_to_string(d.join(file)).ok())
        };
        match self {
            Hierarchy::V1 { .. } => CpuLimits {
                shares: read("cpu.shares").and_then(|t| parse_u64(&t)),
                // -1: no quota.
                quota: read("cpu.cfs_quota_us")
                    .and_then(|t| t.trim().parse::<i64>().ok())
                    .and_then(|q| u64::try_from(q).ok()),
                period: read("cpu.cfs_period_us").and_then(|t| parse_u64(&t)),
            },
            Hierarchy::V2 { .. } => {
                let max = read("cpu.max").unwrap_or_default();
                let mut f = max.split_whitespace();
                let (quota, period) = (f.next(), f.next());
                CpuLimits {
                    shares: read("cpu.weight")
                        .and_then(|t| parse_u64(&t))
                        .map(shares_of_weight),
                    quota: quota.and_then(parse_u64),
                    period: period.and_then(parse_u64),
                }
            }
        }
    }

    /// How many processes of cgroup `rel` the OOM killer killed; `None` when unreadable.
    pub fn oom_kills(&self, rel: &Path) -> Option<u64> {
        let file = match self {
            Hierarchy::V1 { .. } => "memory.oom_control",
            Hierarchy::V2 { .. } => "memory.events",
        };
        let text = std::fs::read_to_string(self.dir("memory", rel)?.join(file)).ok()?;
        keyed(&text).get("oom_kill").copied()
    }
}

/// The CPU limits of one cgroup (v1 units: shares, and microseconds of quota per period).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct CpuLimits {
    pub shares: Option<u64>,
    pub quota: Option<u64>,
    pub period: Option<u64>,
}

/// cgroup v2 `cpu.weight` (1 to 10000) from v1 shares (2 to 262144), as runc and crun convert.
pub fn weight_of_shares(shares: u64) -> u64 {
    let shares = shares.clamp(2, 262_144);
    1 + ((shares - 2) * 9999) / 262_142
}

/// v1 shares from a cgroup v2 `cpu.weight` (the inverse of [`weight_of_shares`], rounded down).
pub fn shares_of_weight(weight: u64) -> u64 {
    let weight = weight.clamp(1, 10_000);
    2 + ((weight - 1) * 262_142) / 9999
}

/// The directory systemd gives slice `name`, relative to the hierarchy's root: each `-` nests
/// (`a-b-c.slice` is `a.slice/a-b.slice/a-b-c.slice`); `-.slice` is the root itself.
pub fn slice_dir(name: &str) -> Option<PathBuf> {
    let stem = name.strip_suffix(".slice")?;
    if stem == "-" {
        return Some(PathBuf::new());
    }
    if stem.is_empty() || stem.contains('/') || stem.split('-').any(str::is_empty) {
        return None;
    }
    let mut dir = PathBuf::new();
    let mut prefix = String::new();
    for part in stem.split('-') {
        if !prefix.is_empty() {
            prefix.push('-');
        }
        prefix.push_str(part);
        dir.push(format!("{prefix}.slice"));
    }
    Some(dir)
}

/// The cgroup of container (or infra) `id` under the sandbox's `parent`, relative to the
/// hierarchy's root; `None` when `parent` does not suit `driver` (the runtime refused it too).
pub fn container_cgroup(driver: CgroupDriver, parent: &str, id: &str) -> Option<PathBuf> {
    let path = cgroups_path(driver, parent, id).ok()?;
    match driver {
        CgroupDriver::Cgroupfs => Some(relative(&path)),
        CgroupDriver::Systemd => {
            // `<slice>:<prefix>:<name>`: runc and crun make the unit `<prefix>-<name>.scope`.
            let s = path.to_str()?;
            let mut parts = s.splitn(3, ':');
            let (slice, prefix, name) = (parts.next()?, parts.next()?, parts.next()?);
            Some(slice_dir(slice)?.join(format!("{prefix}-{name}.scope")))
        }
    }
}

/// The pod's own cgroup: the sandbox's cgroup parent, relative to the hierarchy's root; `None`
/// when it names none (the default parent is shared by all pods) or does not suit `driver`.
pub fn pod_cgroup(driver: CgroupDriver, parent: &str) -> Option<PathBuf> {
    if parent.is_empty() {
        return None;
    }
    let rel = match driver {
        CgroupDriver::Cgroupfs if parent.ends_with(".slice") && !parent.contains('/') => {
            return None;
        }
        CgroupDriver::Cgroupfs => relative(Path::new(parent)),
        CgroupDriver::Systemd => slice_dir(systemd_slice(parent).ok()?)?,
    };
    (!rel.as_os_str().is_empty()).then_some(rel)
}

fn relative(p: &Path) -> PathBuf {
    p.strip_prefix("/")
        .map(Path::to_path_buf)
        .unwrap_or(p.into())
}

/// Whether the container `id` under `parent` had a process killed by the OOM killer.
pub fn oom_killed(driver: CgroupDriver, parent: &str, id: &str) -> bool {
    container_cgroup(driver, parent, id)
        .and_then(|rel| Hierarchy::host().oom_kills(&rel))
        .is_some_and(|n| n > 0)
}

/// How long systemd is given to say how a scope ended.
const SYSTEMCTL_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether the OOM killer ended container `id` under `parent`, once its init has ended as `exit`
/// says (blocking: reads cgroup files, and may run `systemctl`): the shim's count (cgroup v2,
/// read while the cgroup existed), else the cgroup's (v1 cgroups stay until the runtime deletes
/// the container), else, under the systemd driver for a container killed by SIGKILL, its
/// scope's `Result`. Call before the runtime deletes the container: the delete removes the
/// cgroup and resets a failed scope.
pub fn oom_killed_after_exit(
    driver: CgroupDriver,
    parent: &str,
    id: &str,
    exit: &crate::shim::ExitRecord,
) -> bool {
    oom_after_exit(Path::new("systemctl"), driver, parent, id, exit)
}

fn oom_after_exit(
    systemctl: &Path,
    driver: CgroupDriver,
    parent: &str,
    id: &str,
    exit: &crate::shim::ExitRecord,
) -> bool {
    if exit.oom_killed || oom_killed(driver, parent, id) {
        return true;
    }
    if driver != CgroupDriver::Systemd || exit.exit_code != 128 + libc::SIGKILL {
        return false;
    }
    let Some(unit) = container_cgroup(driver, parent, id)
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
    else {
        return false;
    };
    match unit_result(systemctl, &unit, SYSTEMCTL_TIMEOUT) {
        Ok(UnitResult { result, load_state }) => {
            // A unit systemd no longer has (`not-found`) reads as `success`: nothing is known.
            tracing::debug!(container = %id, unit = %unit, %result, %load_state, "systemd's account of a scope killed by SIGKILL");
            load_state == "loaded" && result == "oom-kill"
        }
        Err(e) => {
            tracing::debug!(container = %id, unit = %unit, error = %e, "asking systemd how the scope ended");
            false
        }
    }
}

/// How a unit ended, as `systemctl show` tells.
#[derive(Debug, PartialEq, Eq)]
struct UnitResult {
    /// `success`, `oom-kill`, `signal`, ...
    result: String,
    /// `loaded`, or `not-found` for a unit systemd has let go.
    load_state: String,
}

/// A unit's `Result` and `LoadState` properties from `systemctl show`, waiting at most
/// `timeout` for them.
fn unit_result(systemctl: &Path, unit: &str, timeout: Duration) -> std::io::Result<UnitResult> {
    let failed = |what: String| std::io::Error::other(format!("systemctl show {unit}: {what}"));
    let mut child = Command::new(systemctl)
        .args(["show", "--property=Result,LoadState", "--", unit])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait()? {
            Some(status) if status.success() => break,
            Some(status) => return Err(failed(status.to_string())),
            None if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            None => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("systemctl show {unit}: no answer within {timeout:?}"),
                ));
            }
        }
    }
    let mut out = String::new();
    if let Some(stdout) = child.stdout.take() {
        stdout.take(4096).read_to_string(&mut out)?;
    }
    let property = |key: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
            .map(|v| v.trim().to_string())
            .ok_or_else(|| failed(format!("no {key} in its answer {out:?}")))
    };
    Ok(UnitResult {
        result: property("Result")?,
        load_state: property("LoadState")?,
    })
}

fn parse_u64(text: &str) -> Option<u64> {
    text.trim().parse().ok()
}

/// A flat keyed file (`memory.stat`, `cpu.stat`, `memory.events`): `<key> <value>` lines.
fn keyed(text: &str) -> HashMap<&str, u64> {
    text.lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(' ')?;
            Some((k, v.trim().parse().ok()?))
        })
        .collect()
}

/// A v2 limit file: a number, or `max`.
fn limit_v2(text: &str) -> Option<u64> {
    parse_u64(text).filter(|&v| v < UNLIMITED)
}

/// v1 memory counters from `memory.usage_in_bytes`, `memory.stat` and `memory.limit_in_bytes`.
fn memory_v1(usage: Option<&str>, stat: Option<&str>, limit: Option<&str>) -> Option<Memory> {
    let usage = parse_u64(usage?)?;
    let stat = keyed(stat.unwrap_or(""));
    // `total_*` include the descendants (a pod cgroup's containers); plain keys are the
    // cgroup's own pages.
    let get = |k: &str| {
        stat.get(format!("total_{k}").as_str())
            .or_else(|| stat.get(k))
            .copied()
            .unwrap_or(0)
    };
    let limit = [
        limit.and_then(parse_u64),
        stat.get("hierarchical_memory_limit").copied(),
    ]
    .into_iter()
    .flatten()
    .filter(|&v| v < UNLIMITED)
    .min();
    Some(Memory {
        usage,
        working_set: usage.saturating_sub(get("inactive_file")),
        rss: get("rss"),
        cache: get("cache"),
        page_faults: get("pgfault"),
        major_page_faults: get("pgmajfault"),
        limit,
    })
}

/// v2 memory counters from `memory.current`, `memory.stat` and the `memory.max` of the cgroup
/// and its ancestors.
fn memory_v2<'a>(
    current: Option<&str>,
    stat: Option<&str>,
    maxes: impl Iterator<Item = &'a str>,
) -> Option<Memory> {
    let usage = parse_u64(current?)?;
    let stat = keyed(stat.unwrap_or(""));
    let get = |k: &str| stat.get(k).copied().unwrap_or(0);
    Some(Memory {
        usage,
        working_set: usage.saturating_sub(get("inactive_file")),
        rss: get("anon"),
        cache: get("file"),
        page_faults: get("pgfault"),
        major_page_faults: get("pgmajfault"),
        limit: maxes.filter_map(limit_v2).min(),
    })
}

/// CPU time from v2 `cpu.stat` (`usage_usec`), in nanoseconds.
fn cpu_v2(text: &str) -> Option<u64> {
    keyed(text).get("usage_usec").map(|us| us * 1000)
}

/// Writes `value` to the cgroup file `path`; the kernel's refusal names the file and the value.
pub(super) fn write_file(path: &Path, value: &str) -> crate::error::Result<()> {
    use crate::error::Error;
    std::fs::write(path, value).map_err(|e| {
        let what = format!("setting {} to {value:?}: {e}", path.display());
        match e.raw_os_error() {
            // The kernel refuses the value itself (a cpuset the node does not have, a quota
            // below a child's) or cannot meet it (a limit below what the pod uses).
            Some(libc::EINVAL) | Some(libc::EBUSY) | Some(libc::ERANGE) => {
                Error::FailedPrecondition(what)
            }
            _ => Error::Internal(what),
        }
    })
}

#[cfg(test)]
mod tests;

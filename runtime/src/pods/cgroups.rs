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
mod tests {
    use super::*;

    fn fake_systemctl(dir: &Path, body: &str) -> PathBuf {
        let path = dir.join("systemctl");
        crate::fsutil::write_executable(&path, &format!("#!/bin/sh\n{body}\n"));
        path
    }

    #[test]
    fn unit_result_asks_systemctl_for_the_result_property() {
        let dir = tempfile::tempdir().unwrap();
        let args = dir.path().join("args");
        let systemctl = fake_systemctl(
            dir.path(),
            &format!(
                "echo \"$@\" > {}; echo Result=oom-kill; echo LoadState=loaded",
                args.display()
            ),
        );
        let got = unit_result(&systemctl, "minicri-c1.scope", Duration::from_secs(5)).unwrap();
        assert_eq!(
            got,
            UnitResult {
                result: "oom-kill".into(),
                load_state: "loaded".into()
            }
        );
        assert_eq!(
            std::fs::read_to_string(&args).unwrap().trim(),
            "show --property=Result,LoadState -- minicri-c1.scope"
        );
        let partial = fake_systemctl(dir.path(), "echo Result=success");
        assert!(unit_result(&partial, "u.scope", Duration::from_secs(5)).is_err());
    }

    /// systemd is asked only under the systemd driver, only for a SIGKILL with no count read, and
    /// only a loaded unit failed by an OOM kill counts.
    #[test]
    fn oom_after_exit_asks_systemd_only_for_an_unexplained_sigkill() {
        let dir = tempfile::tempdir().unwrap();
        let asked = dir.path().join("asked");
        let answer = dir.path().join("answer");
        let systemctl = fake_systemctl(
            dir.path(),
            &format!(
                "echo \"$@\" >> {}; cat {}",
                asked.display(),
                answer.display()
            ),
        );
        let exit = |code, oom_killed| crate::shim::ExitRecord {
            pid: 1,
            exit_code: code,
            signal: None,
            exited_at: String::new(),
            exited_at_ns: 0,
            oom_killed,
        };
        let id = "minicri-unit-test-no-such-container";
        let decide =
            |driver, e: &crate::shim::ExitRecord| oom_after_exit(&systemctl, driver, "", id, e);
        std::fs::write(&answer, "Result=oom-kill\nLoadState=loaded\n").unwrap();
        // The shim's count answers without asking.
        assert!(decide(CgroupDriver::Systemd, &exit(137, true)));
        // Not SIGKILL, or not the systemd driver: nothing to ask.
        assert!(!decide(CgroupDriver::Systemd, &exit(1, false)));
        assert!(!decide(CgroupDriver::Cgroupfs, &exit(137, false)));
        assert!(!asked.exists(), "systemd was asked");
        // A SIGKILL with no count under the systemd driver: systemd decides.
        assert!(decide(CgroupDriver::Systemd, &exit(137, false)));
        assert_eq!(
            std::fs::read_to_string(&asked).unwrap().trim(),
            format!("show --property=Result,LoadState -- minicri-{id}.scope")
        );
        std::fs::write(&answer, "Result=success\nLoadState=loaded\n").unwrap();
        assert!(!decide(CgroupDriver::Systemd, &exit(137, false)));
        // A unit systemd let go reads as success by default, whatever it was.
        std::fs::write(&answer, "Result=oom-kill\nLoadState=not-found\n").unwrap();
        assert!(!decide(CgroupDriver::Systemd, &exit(137, false)));
    }

    #[test]
    fn unit_result_fails_on_a_failing_or_hung_systemctl() {
        let dir = tempfile::tempdir().unwrap();
        let failing = fake_systemctl(
            dir.path(),
            "echo Result=oom-kill; echo LoadState=loaded; exit 1",
        );
        assert!(unit_result(&failing, "u.scope", Duration::from_secs(5)).is_err());
        let hung = fake_systemctl(dir.path(), "exec sleep 30");
        let started = Instant::now();
        let err = unit_result(&hung, "u.scope", Duration::from_millis(300)).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        let missing = dir.path().join("absent");
        assert!(unit_result(&missing, "u.scope", Duration::from_secs(5)).is_err());
    }

    const MOUNTINFO_HYBRID: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:9 - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime shared:12 - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    const MOUNTINFO_V2: &str = "\
22 1 0:21 / / rw - ext4 /dev/sda1 rw
30 22 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
";

    #[test]
    fn hierarchies_from_mountinfo() {
        assert_eq!(
            Hierarchy::from_mountinfo(MOUNTINFO_HYBRID),
            Some(Hierarchy::V1 {
                memory: Some("/sys/fs/cgroup/memory".into()),
                cpuacct: Some("/sys/fs/cgroup/cpu,cpuacct".into()),
                pids: Some("/sys/fs/cgroup/pids".into()),
                cpu: Some("/sys/fs/cgroup/cpu,cpuacct".into()),
                cpuset: None,
            })
        );
        assert_eq!(
            Hierarchy::from_mountinfo(MOUNTINFO_V2),
            Some(Hierarchy::V2 {
                root: "/sys/fs/cgroup".into()
            })
        );
        assert_eq!(
            Hierarchy::from_mountinfo("22 1 0:21 / / rw - ext4 /dev/sda1 rw\n"),
            None
        );
    }

    const MEMORY_STAT_V1: &str = "\
cache 4096
rss 1048576
inactive_file 4096
pgfault 10
pgmajfault 1
hierarchical_memory_limit 268435456
hierarchical_memsw_limit 9223372036854771712
total_cache 8192
total_rss 2097152
total_pgfault 250
total_pgmajfault 3
total_inactive_anon 0
total_active_anon 2097152
total_inactive_file 8192
total_active_file 0
";

    #[test]
    fn memory_v1_counters() {
        let m = memory_v1(
            Some("2170880\n"),
            Some(MEMORY_STAT_V1),
            Some("9223372036854771712\n"),
        )
        .unwrap();
        assert_eq!(
            m,
            Memory {
                usage: 2_170_880,
                working_set: 2_170_880 - 8192,
                rss: 2_097_152,
                cache: 8192,
                page_faults: 250,
                major_page_faults: 3,
                // The parent's limit bounds a container without its own.
                limit: Some(268_435_456),
            }
        );
        assert_eq!(m.available(), Some(268_435_456 - (2_170_880 - 8192)));
        // Own limit lower than the hierarchy's; no total_* keys (old kernels' leaf view).
        let m = memory_v1(
            Some("100"),
            Some("rss 60\ninactive_file 200\npgfault 5\n"),
            Some("1048576"),
        )
        .unwrap();
        assert_eq!((m.working_set, m.rss, m.page_faults), (0, 60, 5));
        assert_eq!(m.limit, Some(1_048_576));
        // Unlimited everywhere.
        let m = memory_v1(Some("1"), Some(""), Some("9223372036854771712")).unwrap();
        assert_eq!((m.limit, m.available()), (None, None));
        assert_eq!(memory_v1(None, Some(MEMORY_STAT_V1), None), None);
    }

    const MEMORY_STAT_V2: &str = "\
anon 3145728
file 1048576
kernel 204800
inactive_anon 0
active_anon 3145728
inactive_file 1040384
active_file 8192
pgfault 1234
pgmajfault 7
";

    #[test]
    fn memory_v2_counters() {
        let m = memory_v2(
            Some("4395008\n"),
            Some(MEMORY_STAT_V2),
            ["max\n", "536870912\n", "1073741824\n"].into_iter(),
        )
        .unwrap();
        assert_eq!(
            m,
            Memory {
                usage: 4_395_008,
                working_set: 4_395_008 - 1_040_384,
                rss: 3_145_728,
                cache: 1_048_576,
                page_faults: 1234,
                major_page_faults: 7,
                limit: Some(536_870_912),
            }
        );
        let m = memory_v2(Some("10"), Some(MEMORY_STAT_V2), ["max"].into_iter()).unwrap();
        assert_eq!((m.working_set, m.limit), (0, None));
    }

    #[test]
    fn cpu_counters() {
        let stat = "usage_usec 1500\nuser_usec 1000\nsystem_usec 500\nnr_periods 0\n";
        assert_eq!(cpu_v2(stat), Some(1_500_000));
        assert_eq!(cpu_v2("user_usec 3\n"), None);
        assert_eq!(parse_u64("2421425704\n"), Some(2_421_425_704));
        assert_eq!(
            keyed("oom 0\nunder_oom 0\noom_kill 2\n").get("oom_kill"),
            Some(&2)
        );
    }

    #[test]
    fn counters_add_up() {
        let a = Counters {
            cpu_ns: Some(10),
            memory: Some(Memory {
                usage: 100,
                working_set: 80,
                rss: 50,
                cache: 20,
                page_faults: 1,
                major_page_faults: 0,
                limit: Some(1000),
            }),
            pids: Some(2),
        };
        let mut sum = Counters::default();
        assert!(sum.is_empty());
        sum.add(&a);
        sum.add(&Counters::default());
        sum.add(&a);
        assert_eq!(sum.cpu_ns, Some(20));
        assert_eq!(sum.pids, Some(4));
        let m = sum.memory.unwrap();
        assert_eq!(
            (m.usage, m.working_set, m.rss, m.limit),
            (200, 160, 100, None)
        );
    }

    #[test]
    fn cgroup_paths_per_driver() {
        use CgroupDriver::*;
        assert_eq!(
            slice_dir("kubepods-besteffort-pod12.slice").unwrap(),
            PathBuf::from(
                "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod12.slice"
            )
        );
        assert_eq!(slice_dir("-.slice").unwrap(), PathBuf::new());
        assert_eq!(slice_dir("a--b.slice"), None);
        assert_eq!(slice_dir("kubepods"), None);
        assert_eq!(
            container_cgroup(Cgroupfs, "/kubepods/pod1", "c1").unwrap(),
            PathBuf::from("kubepods/pod1/c1")
        );
        assert_eq!(
            container_cgroup(Cgroupfs, "", "c1").unwrap(),
            PathBuf::from("minicri/c1")
        );
        assert_eq!(
            container_cgroup(Systemd, "kubepods-pod1.slice", "c1").unwrap(),
            PathBuf::from("kubepods.slice/kubepods-pod1.slice/minicri-c1.scope")
        );
        assert_eq!(
            container_cgroup(Systemd, "", "c1").unwrap(),
            PathBuf::from("system.slice/minicri-c1.scope")
        );
        assert_eq!(container_cgroup(Systemd, "/kubepods", "c1"), None);
        assert_eq!(
            pod_cgroup(Cgroupfs, "/kubepods/pod1").unwrap(),
            PathBuf::from("kubepods/pod1")
        );
        assert_eq!(pod_cgroup(Cgroupfs, ""), None);
        assert_eq!(pod_cgroup(Cgroupfs, "/"), None);
        assert_eq!(pod_cgroup(Cgroupfs, "kubepods.slice"), None);
        assert_eq!(
            pod_cgroup(Systemd, "kubepods-pod1.slice").unwrap(),
            PathBuf::from("kubepods.slice/kubepods-pod1.slice")
        );
        assert_eq!(
            pod_cgroup(Systemd, "/test.slice").unwrap(),
            PathBuf::from("test.slice")
        );
    }

    #[test]
    fn reads_a_v2_tree() {
        let d = tempfile::tempdir().unwrap();
        let pod = d.path().join("kubepods/pod1");
        let c = pod.join("c1");
        std::fs::create_dir_all(&c).unwrap();
        std::fs::write(d.path().join("kubepods/memory.max"), "max\n").unwrap();
        std::fs::write(pod.join("memory.max"), "1048576\n").unwrap();
        std::fs::write(c.join("memory.max"), "max\n").unwrap();
        std::fs::write(c.join("memory.current"), "4096\n").unwrap();
        std::fs::write(c.join("memory.stat"), "anon 4096\ninactive_file 0\n").unwrap();
        std::fs::write(c.join("cpu.stat"), "usage_usec 7\n").unwrap();
        std::fs::write(c.join("pids.current"), "3\n").unwrap();
        std::fs::write(c.join("memory.events"), "oom 1\noom_kill 1\n").unwrap();
        let h = Hierarchy::V2 {
            root: d.path().into(),
        };
        let got = h.read(Path::new("kubepods/pod1/c1"));
        assert_eq!(got.cpu_ns, Some(7000));
        assert_eq!(got.pids, Some(3));
        assert_eq!(got.memory.unwrap().limit, Some(1_048_576));
        assert_eq!(h.oom_kills(Path::new("kubepods/pod1/c1")), Some(1));
        assert!(h.read(Path::new("kubepods/pod1/gone")).is_empty());
    }

    #[test]
    fn reads_a_v1_tree() {
        let d = tempfile::tempdir().unwrap();
        let dir = |c: &str| d.path().join(c).join("minicri/c1");
        for c in ["memory", "cpuacct", "pids"] {
            std::fs::create_dir_all(dir(c)).unwrap();
        }
        std::fs::write(dir("memory").join("memory.usage_in_bytes"), "2170880\n").unwrap();
        std::fs::write(dir("memory").join("memory.stat"), MEMORY_STAT_V1).unwrap();
        std::fs::write(dir("memory").join("memory.oom_control"), "oom_kill 0\n").unwrap();
        std::fs::write(dir("cpuacct").join("cpuacct.usage"), "123456789\n").unwrap();
        std::fs::write(dir("pids").join("pids.current"), "2\n").unwrap();
        let h = Hierarchy::V1 {
            memory: Some(d.path().join("memory")),
            cpuacct: Some(d.path().join("cpuacct")),
            pids: Some(d.path().join("pids")),
            cpu: Some(d.path().join("cpu")),
            cpuset: None,
        };
        let got = h.read(Path::new("minicri/c1"));
        assert_eq!(got.cpu_ns, Some(123_456_789));
        assert_eq!(got.pids, Some(2));
        assert_eq!(got.memory.unwrap().rss, 2_097_152);
        assert_eq!(h.oom_kills(Path::new("minicri/c1")), Some(0));
        let no_pids = Hierarchy::V1 {
            memory: Some(d.path().join("memory")),
            cpuacct: Some(d.path().join("cpuacct")),
            pids: None,
            cpu: None,
            cpuset: None,
        };
        assert_eq!(no_pids.read(Path::new("minicri/c1")).pids, None);
        // CPU limits: -1 is no quota; none at all without the controller.
        std::fs::create_dir_all(dir("cpu")).unwrap();
        std::fs::write(dir("cpu").join("cpu.shares"), "512\n").unwrap();
        std::fs::write(dir("cpu").join("cpu.cfs_quota_us"), "-1\n").unwrap();
        std::fs::write(dir("cpu").join("cpu.cfs_period_us"), "100000\n").unwrap();
        let want = CpuLimits {
            shares: Some(512),
            quota: None,
            period: Some(100_000),
        };
        assert_eq!(h.cpu_limits(Path::new("minicri/c1")), want);
        assert_eq!(
            no_pids.cpu_limits(Path::new("minicri/c1")),
            CpuLimits::default()
        );
    }

    /// v2 CPU limits: `cpu.weight` as shares, `cpu.max` as quota and period.
    #[test]
    fn reads_v2_cpu_limits() {
        let d = tempfile::tempdir().unwrap();
        let c = d.path().join("pod1");
        std::fs::create_dir_all(&c).unwrap();
        std::fs::write(c.join("cpu.weight"), "39\n").unwrap();
        std::fs::write(c.join("cpu.max"), "50000 100000\n").unwrap();
        let h = Hierarchy::V2 {
            root: d.path().into(),
        };
        let got = h.cpu_limits(Path::new("pod1"));
        assert_eq!((got.quota, got.period), (Some(50_000), Some(100_000)));
        // 1024 shares are weight 39, which reads back as 998 shares (the conversion rounds down).
        assert_eq!(weight_of_shares(1024), 39);
        assert_eq!(got.shares, Some(shares_of_weight(39)));
        assert_eq!(shares_of_weight(39), 998);
        std::fs::write(c.join("cpu.max"), "max 100000\n").unwrap();
        assert_eq!(h.cpu_limits(Path::new("pod1")).quota, None);
        assert_eq!(
            (weight_of_shares(2), weight_of_shares(262_144)),
            (1, 10_000)
        );
    }
}

//! UpdatePodSandboxResources: a pod's new total resources (its containers' sum plus its
//! overhead, as the kubelet sizes pod cgroups) written to the pod's own cgroup, the sandbox's
//! cgroup parent ([`super::cgroups::pod_cgroup`]: the cgroupfs directory, or the systemd slice's
//! directory). A pod without a cgroup of its own (no cgroup parent: the default parent is shared
//! by every pod) is refused with FAILED_PRECONDITION, as is a pod that is not ready.
//!
//! Files written, in this order, each only when the request sets its value (zero is unset, as in
//! the CRI): the memory limit (v1 `memory.limit_in_bytes`, v2 `memory.max`), the CPU weight (v1
//! `cpu.shares`, v2 `cpu.weight` converted as runc converts), the CPU quota and period (v1
//! `cpu.cfs_period_us` and `cpu.cfs_quota_us`, v2 `cpu.max`), then the cpusets (`cpuset.cpus`,
//! `cpuset.mems`). Hugepage limits, swap and `unified` are not applied to the pod's cgroup.
//!
//! Each file's old value is journaled ([`super::undo`]) before it is written: a write the kernel
//! refuses (a limit below what the pod uses, a cpuset the node does not have) puts back every
//! file written before it and the call fails with the kernel's error, leaving the old values; a
//! daemon killed half-way puts them back at its next start. The sandbox record keeps the last
//! request that was applied, which PodSandboxStatus reports in its verbose `info` (the CRI's
//! `PodSandboxStatus` message has no resources field).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use minicri_proto::runtime::v1 as cri;
use prost::Message;

use super::cgroups::{self, Hierarchy};
use super::store::{ContainerState, SandboxState};
use super::{Journal, Operation, PodService, Undo, blocking};
use crate::error::{Error, Result};

/// The sum of two CRI resource figures where zero is unset.
fn sum(a: i64, b: i64) -> i64 {
    if a == 0 || b == 0 { a.max(b) } else { a + b }
}

/// The pod cgroup's total: `resources` (the containers' sum) plus `overhead`. A limit only
/// `overhead` sets is not a limit of the pod (the containers are unbounded): memory and quota
/// are the sum only when `resources` sets them.
pub fn pod_total(
    overhead: Option<&cri::LinuxContainerResources>,
    resources: Option<&cri::LinuxContainerResources>,
) -> cri::LinuxContainerResources {
    let none = cri::LinuxContainerResources::default();
    let (o, r) = (overhead.unwrap_or(&none), resources.unwrap_or(&none));
    let bounded = |a: i64, b: i64| if a > 0 { sum(a, b.max(0)) } else { a };
    cri::LinuxContainerResources {
        cpu_shares: sum(r.cpu_shares, o.cpu_shares),
        cpu_period: r.cpu_period,
        cpu_quota: bounded(r.cpu_quota, o.cpu_quota),
        memory_limit_in_bytes: bounded(r.memory_limit_in_bytes, o.memory_limit_in_bytes),
        cpuset_cpus: r.cpuset_cpus.clone(),
        cpuset_mems: r.cpuset_mems.clone(),
        ..Default::default()
    }
}

/// The writes that set `r` on cgroup `rel` of `h`, in order: (file, value). `current_period`
/// is the cgroup's CPU period, for a v2 `cpu.max` whose request sets only the quota.
pub fn planned_writes(
    h: &Hierarchy,
    rel: &Path,
    r: &cri::LinuxContainerResources,
    current_period: Option<u64>,
) -> Result<Vec<(PathBuf, String)>> {
    let mut out = Vec::new();
    let mut add = |controller: &str, file: &str, value: String| -> Result<()> {
        let dir = h.dir(controller, rel).ok_or_else(|| {
            Error::FailedPrecondition(format!(
                "the {controller} cgroup controller is not mounted on this node"
            ))
        })?;
        out.push((dir.join(file), value));
        Ok(())
    };
    let v2 = matches!(h, Hierarchy::V2 { .. });
    if r.memory_limit_in_bytes > 0 {
        let file = if v2 {
            "memory.max"
        } else {
            "memory.limit_in_bytes"
        };
        add("memory", file, r.memory_limit_in_bytes.to_string())?;
    }
    if r.cpu_shares > 0 {
        match v2 {
            true => add(
                "cpu",
                "cpu.weight",
                cgroups::weight_of_shares(r.cpu_shares as u64).to_string(),
            )?,
            false => add("cpu", "cpu.shares", r.cpu_shares.to_string())?,
        }
    }
    if v2 {
        if r.cpu_quota != 0 || r.cpu_period > 0 {
            let period = match r.cpu_period {
                p if p > 0 => p as u64,
                _ => current_period.unwrap_or(100_000),
            };
            let quota = match r.cpu_quota {
                q if q > 0 => q.to_string(),
                _ => "max".to_string(),
            };
            add("cpu", "cpu.max", format!("{quota} {period}"))?;
        }
    } else {
        if r.cpu_period > 0 {
            add("cpu", "cpu.cfs_period_us", r.cpu_period.to_string())?;
        }
        if r.cpu_quota != 0 {
            add("cpu", "cpu.cfs_quota_us", r.cpu_quota.to_string())?;
        }
    }
    if !r.cpuset_cpus.is_empty() {
        add("cpuset", "cpuset.cpus", r.cpuset_cpus.clone())?;
    }
    if !r.cpuset_mems.is_empty() {
        add("cpuset", "cpuset.mems", r.cpuset_mems.clone())?;
    }
    Ok(out)
}

/// What a cgroup file holds now, as it can be written back (trimmed).
fn read_cgroup_file(path: &Path) -> Result<String> {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .map_err(|e| Error::FailedPrecondition(format!("reading {}: {e}", path.display())))
}

impl PodService {
    /// UpdatePodSandboxResources: NOT_FOUND for an unknown sandbox, FAILED_PRECONDITION for one
    /// that is not ready or has no cgroup of its own, INVALID_ARGUMENT for values the CRI does
    /// not allow; a write the kernel refuses undoes the others.
    pub async fn update_pod_sandbox_resources(
        self: &Arc<Self>,
        req: cri::UpdatePodSandboxResourcesRequest,
    ) -> Result<()> {
        let total = pod_total(req.overhead.as_ref(), req.resources.as_ref());
        // The values the CRI allows (the same checks as a container's resources).
        crate::spec::container::linux_resources(&total, &self.host)?;
        self.undoable(Operation::UpdatePodSandboxResources, move |svc, journal| {
            Box::pin(async move { svc.resize_steps(req, total, journal).await })
        })
        .await
    }

    async fn resize_steps(
        self: &Arc<Self>,
        req: cri::UpdatePodSandboxResourcesRequest,
        total: cri::LinuxContainerResources,
        journal: &mut Journal,
    ) -> Result<()> {
        let id = req.pod_sandbox_id.clone();
        let _guard = self.store.op_lock(&id).await;
        let sb = self.sandbox_record(&id)?;
        if sb.state != SandboxState::Ready {
            return Err(Error::FailedPrecondition(format!(
                "pod sandbox {id} is not ready"
            )));
        }
        let parent = super::stats::cgroup_parent(Some(&sb));
        let rel = cgroups::pod_cgroup(self.cgroup_driver, &parent).ok_or_else(|| {
            Error::FailedPrecondition(format!(
                "pod sandbox {id} has no cgroup of its own (no cgroup_parent, or one the {:?} \
                 driver does not use): its resources cannot be updated",
                self.cgroup_driver
            ))
        })?;
        journal.subject(&id)?;
        self.write_pod_cgroup(Hierarchy::host().clone(), rel, total, journal)
            .await?;
        let applied: Arc<[u8]> = cri::UpdatePodSandboxResourcesRequest {
            pod_sandbox_id: String::new(),
            ..req
        }
        .encode_to_vec()
        .into();
        journal.push(Undo::SandboxResources {
            id: id.clone(),
            old: sb.resources.clone(),
        })?;
        let svc = self.clone();
        blocking(move || {
            svc.store
                .update_sandbox(&id, |r| r.resources = applied)
                .map(|_| ())
                .map_err(|e| Error::Internal(format!("recording the resources of {id}: {e}")))
        })
        .await
    }

    /// Sets `total` on cgroup `rel` of `h`, journaling each file's old value before writing it
    /// (a failed write is undone with the others by [`PodService::undoable`]).
    pub(super) async fn write_pod_cgroup(
        &self,
        h: Hierarchy,
        rel: PathBuf,
        total: cri::LinuxContainerResources,
        journal: &mut Journal,
    ) -> Result<()> {
        let writes = blocking(move || {
            let period = h.cpu_limits(&rel).period;
            let writes = planned_writes(&h, &rel, &total, period)?;
            writes
                .into_iter()
                .map(|(path, value)| Ok((read_cgroup_file(&path)?, path, value)))
                .collect::<Result<Vec<_>>>()
        })
        .await?;
        for (old, path, value) in writes {
            journal.push(Undo::RestoreCgroupFile {
                path: path.clone(),
                value: old,
            })?;
            blocking(move || cgroups::write_file(&path, &value)).await?;
        }
        Ok(())
    }

    /// The resources UpdatePodSandboxResources last applied to sandbox `sb` (its request
    /// without the id), if any.
    pub(crate) fn applied_resources(
        sb: &super::store::SandboxRecord,
    ) -> Option<cri::UpdatePodSandboxResourcesRequest> {
        (!sb.resources.is_empty())
            .then(|| cri::UpdatePodSandboxResourcesRequest::decode(&*sb.resources).ok())
            .flatten()
    }
}

impl PodService {
    /// UpdateContainerResources: applied through the runtime to a running container, and to
    /// the bundle of a created one. Serialised with StartContainer (the object's op lock), so an
    /// update of a created container is either in the bundle runc reads or sent to the running
    /// container, never written after runc read it and lost.
    pub async fn update_container_resources(
        &self,
        id: &str,
        linux: Option<cri::LinuxContainerResources>,
    ) -> Result<()> {
        let _guard = self.store.op_lock(id).await;
        let r = self.container_record(id)?;
        let Some(linux) = linux else { return Ok(()) };
        let resources = crate::spec::container::linux_resources(&linux, &self.host)?;
        match r.state {
            ContainerState::Running => Ok(self
                .runtime(&r.runtime_handler)?
                .update(id, &resources)
                .await?),
            ContainerState::Created => minicri_store::fsutil::off_async(|| {
                let path = r.bundle.join("config.json");
                let mut spec = oci_spec::runtime::Spec::load(&path)
                    .map_err(|e| Error::Internal(format!("reading the spec of {id}: {e}")))?;
                let mut l = spec.linux().clone().unwrap_or_default();
                let mut merged = resources;
                if let Some(old) = l.resources() {
                    merged.set_devices(old.devices().clone());
                }
                l.set_resources(Some(merged));
                spec.set_linux(Some(l));
                Ok(crate::spec::write_bundle(&r.bundle, &spec)?)
            }),
            _ => Err(Error::FailedPrecondition(format!(
                "container {id} is not running"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(shares: i64, quota: i64, mem: i64) -> cri::LinuxContainerResources {
        cri::LinuxContainerResources {
            cpu_shares: shares,
            cpu_quota: quota,
            memory_limit_in_bytes: mem,
            ..Default::default()
        }
    }

    #[test]
    fn the_pod_total_is_the_containers_plus_the_overhead() {
        let t = pod_total(Some(&res(10, 1000, 100)), Some(&res(1024, 50_000, 1 << 20)));
        assert_eq!(
            (t.cpu_shares, t.cpu_quota, t.memory_limit_in_bytes),
            (1034, 51_000, (1 << 20) + 100)
        );
        // Overhead alone does not bound a pod whose containers are unbounded.
        let t = pod_total(Some(&res(10, 1000, 100)), Some(&res(0, 0, 0)));
        assert_eq!(
            (t.cpu_shares, t.cpu_quota, t.memory_limit_in_bytes),
            (10, 0, 0)
        );
        let t = pod_total(None, Some(&res(2, -1, 5)));
        assert_eq!(
            (t.cpu_shares, t.cpu_quota, t.memory_limit_in_bytes),
            (2, -1, 5)
        );
    }

    /// The files each hierarchy's layout gets, in order; v2 converts shares to a weight and
    /// writes quota and period together.
    #[test]
    fn writes_follow_the_hierarchy() {
        let r = cri::LinuxContainerResources {
            cpu_shares: 1024,
            cpu_quota: 50_000,
            memory_limit_in_bytes: 64 << 20,
            cpuset_cpus: "0".into(),
            ..Default::default()
        };
        let v1 = Hierarchy::V1 {
            memory: Some("/cg/memory".into()),
            cpuacct: Some("/cg/cpuacct".into()),
            pids: None,
            cpu: Some("/cg/cpu".into()),
            cpuset: Some("/cg/cpuset".into()),
        };
        let got = planned_writes(&v1, Path::new("pod1"), &r, None).unwrap();
        let want: Vec<(PathBuf, String)> = [
            ("/cg/memory/pod1/memory.limit_in_bytes", "67108864"),
            ("/cg/cpu/pod1/cpu.shares", "1024"),
            ("/cg/cpu/pod1/cpu.cfs_quota_us", "50000"),
            ("/cg/cpuset/pod1/cpuset.cpus", "0"),
        ]
        .iter()
        .map(|(p, v)| (PathBuf::from(p), v.to_string()))
        .collect();
        assert_eq!(got, want);
        let v2 = Hierarchy::V2 {
            root: "/cg2".into(),
        };
        let got = planned_writes(
            &v2,
            Path::new("kubepods.slice/pod1.slice"),
            &r,
            Some(20_000),
        )
        .unwrap();
        let want: Vec<(PathBuf, String)> = [
            ("/cg2/kubepods.slice/pod1.slice/memory.max", "67108864"),
            ("/cg2/kubepods.slice/pod1.slice/cpu.weight", "39"),
            ("/cg2/kubepods.slice/pod1.slice/cpu.max", "50000 20000"),
            ("/cg2/kubepods.slice/pod1.slice/cpuset.cpus", "0"),
        ]
        .iter()
        .map(|(p, v)| (PathBuf::from(p), v.to_string()))
        .collect();
        assert_eq!(got, want);
        let unlimited = cri::LinuxContainerResources {
            cpu_quota: -1,
            cpu_period: 100_000,
            ..Default::default()
        };
        let got = planned_writes(&v2, Path::new("p"), &unlimited, None).unwrap();
        assert_eq!(
            got,
            vec![(PathBuf::from("/cg2/p/cpu.max"), "max 100000".into())]
        );
        // A controller that is not mounted is named.
        let no_cpuset = Hierarchy::V1 {
            memory: None,
            cpuacct: None,
            pids: None,
            cpu: None,
            cpuset: None,
        };
        let err = planned_writes(&no_cpuset, Path::new("p"), &r, None).unwrap_err();
        assert!(
            err.to_string().contains("memory cgroup controller"),
            "{err}"
        );
    }
}

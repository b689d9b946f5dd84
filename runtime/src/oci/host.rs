//! Facts about the host that shape specs: what the runtime's process may do
//! (`oom_score_adj`, `CAP_SYS_RESOURCE`), which capabilities the kernel knows, the cgroup
//! version, and the cgroups path for a cgroup parent under either driver.

use std::path::PathBuf;

pub use crate::config::CgroupDriver;

use super::error::{OciError, Result};

/// Read once at startup by the daemon ([`HostInfo::detect`]); tests build their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostInfo {
    /// This process's `oom_score_adj`, which its children (the shim, runc, the container) inherit.
    pub oom_score_adj: i32,
    /// Whether this process may lower `oom_score_adj` (it needs `CAP_SYS_RESOURCE`).
    pub cap_sys_resource: bool,
    /// `/proc/sys/kernel/cap_last_cap`: the highest capability number the kernel knows.
    pub cap_last_cap: u32,
    /// `/sys/fs/cgroup` is the cgroup v2 unified hierarchy (a hybrid host counts as v1).
    pub cgroup_v2: bool,
}

impl Default for HostInfo {
    fn default() -> Self {
        HostInfo {
            oom_score_adj: 0,
            cap_sys_resource: true,
            cap_last_cap: 40,
            cgroup_v2: false,
        }
    }
}

const CAP_SYS_RESOURCE: u32 = 24;

impl HostInfo {
    pub fn detect() -> Self {
        let oom_score_adj = std::fs::read_to_string("/proc/self/oom_score_adj")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0);
        let cap_eff = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("CapEff:"))
                    .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            })
            .unwrap_or(0);
        let cap_last_cap = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(40);
        HostInfo {
            oom_score_adj,
            cap_sys_resource: cap_eff & (1 << CAP_SYS_RESOURCE) != 0,
            cap_last_cap,
            cgroup_v2: std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists(),
        }
    }

    /// The `oom_score_adj` a container can actually get: the kernel refuses to set a value
    /// below the current one without `CAP_SYS_RESOURCE` (and the OCI runtime would then fail the
    /// whole create), so without it requests are raised to this process's own value. The result
    /// is kept within the kernel's range, -1000..=1000.
    pub fn clamp_oom_score_adj(&self, requested: i64) -> i32 {
        let v = requested.clamp(-1000, 1000) as i32;
        if !self.cap_sys_resource && v < self.oom_score_adj {
            self.oom_score_adj
        } else {
            v
        }
    }
}

/// `linux.cgroupsPath` for container `id` under the CRI `cgroup_parent`:
/// - cgroupfs: `<parent>/<id>` (an empty parent means `/minicri`); the parent must be a path,
///   not a systemd slice;
/// - systemd: `<slice>:minicri:<id>` (runc and crun then create the scope `minicri-<id>.scope`
///   in the slice; an empty parent means `system.slice`); the parent must be a slice name.
pub fn cgroups_path(driver: CgroupDriver, parent: &str, id: &str) -> Result<PathBuf> {
    match driver {
        CgroupDriver::Cgroupfs => {
            if parent.ends_with(".slice") && !parent.contains('/') {
                return Err(OciError::invalid(format!(
                    "cgroup parent {parent:?} is a systemd slice but the cgroup driver is cgroupfs"
                )));
            }
            let parent = if parent.is_empty() {
                "/minicri"
            } else {
                parent
            };
            let base = if parent.starts_with('/') {
                PathBuf::from(parent)
            } else {
                PathBuf::from("/").join(parent)
            };
            Ok(base.join(id))
        }
        CgroupDriver::Systemd => {
            let slice = if parent.is_empty() {
                "system.slice"
            } else {
                parent
            };
            if !slice.ends_with(".slice") || slice.contains('/') {
                return Err(OciError::invalid(format!(
                    "cgroup parent {parent:?} is not a systemd slice but the cgroup driver is systemd"
                )));
            }
            Ok(PathBuf::from(format!("{slice}:minicri:{id}")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oom_score_adj_clamp() {
        let weak = HostInfo {
            oom_score_adj: 0,
            cap_sys_resource: false,
            ..HostInfo::default()
        };
        assert_eq!(weak.clamp_oom_score_adj(-998), 0);
        assert_eq!(weak.clamp_oom_score_adj(-1), 0);
        assert_eq!(weak.clamp_oom_score_adj(1000), 1000);
        let raised = HostInfo {
            oom_score_adj: 500,
            cap_sys_resource: false,
            ..HostInfo::default()
        };
        assert_eq!(raised.clamp_oom_score_adj(100), 500);
        let strong = HostInfo {
            oom_score_adj: 0,
            cap_sys_resource: true,
            ..HostInfo::default()
        };
        assert_eq!(strong.clamp_oom_score_adj(-998), -998);
        assert_eq!(strong.clamp_oom_score_adj(-5000), -1000);
        assert_eq!(strong.clamp_oom_score_adj(5000), 1000);
    }

    #[test]
    fn detect_reads_this_process() {
        let h = HostInfo::detect();
        assert!((-1000..=1000).contains(&h.oom_score_adj));
        assert!(h.cap_last_cap >= 30);
    }

    #[test]
    fn cgroup_paths() {
        use CgroupDriver::*;
        assert_eq!(
            cgroups_path(Cgroupfs, "/kubepods/besteffort/podx", "c1").unwrap(),
            PathBuf::from("/kubepods/besteffort/podx/c1")
        );
        assert_eq!(
            cgroups_path(Cgroupfs, "", "c1").unwrap(),
            PathBuf::from("/minicri/c1")
        );
        assert_eq!(
            cgroups_path(Cgroupfs, "kubepods", "c1").unwrap(),
            PathBuf::from("/kubepods/c1")
        );
        assert!(cgroups_path(Cgroupfs, "kubepods-besteffort.slice", "c1").is_err());
        assert_eq!(
            cgroups_path(Systemd, "kubepods-besteffort-podx.slice", "c1").unwrap(),
            PathBuf::from("kubepods-besteffort-podx.slice:minicri:c1")
        );
        assert_eq!(
            cgroups_path(Systemd, "", "c1").unwrap(),
            PathBuf::from("system.slice:minicri:c1")
        );
        assert!(cgroups_path(Systemd, "/kubepods/podx", "c1").is_err());
    }
}

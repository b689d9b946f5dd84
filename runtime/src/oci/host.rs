//! Facts about the host that shape specs: what the runtime's process may do
//! (`oom_score_adj`, `CAP_SYS_RESOURCE`), which capabilities the kernel knows, the cgroup
//! version, and the cgroups path for a cgroup parent under either driver.

use std::path::{Path, PathBuf};

use super::error::{OciError, Result};

/// The cgroup driver the runtime uses and reports (`runtime.cgroup_driver`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum CgroupDriver {
    Cgroupfs,
    Systemd,
}

/// What this host can do for AppArmor requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AppArmorHost {
    /// The kernel enforces AppArmor ([`apparmor_enabled`]).
    pub enabled: bool,
    /// minicri's default profile is loaded (the spec's `apparmor::load_default_profile`
    /// succeeded at start).
    pub default_profile: bool,
}

/// Whether the kernel enforces AppArmor.
pub fn apparmor_enabled() -> bool {
    std::fs::read("/sys/module/apparmor/parameters/enabled").is_ok_and(|b| b.first() == Some(&b'Y'))
}

/// Read once at startup by the daemon ([`HostInfo::detect`]); tests build their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostInfo {
    /// This process's `oom_score_adj`, which its children (the shim, runc, the container) inherit.
    pub oom_score_adj: i32,
    /// Whether this process may lower `oom_score_adj` (it needs `CAP_SYS_RESOURCE`).
    pub cap_sys_resource: bool,
    /// `/proc/sys/kernel/cap_last_cap`: the highest capability number the kernel knows.
    pub cap_last_cap: u32,
    /// This process's bounding set (`CapBnd`, bit n = capability n): a container can only get
    /// capabilities its runtime holds (runc fails the create with "unable to apply caps"
    /// otherwise), so "every capability" means every one in this mask.
    pub cap_bounding: u64,
    /// `/sys/fs/cgroup` is the cgroup v2 unified hierarchy (a hybrid host counts as v1).
    pub cgroup_v2: bool,
    /// Recursive read-only bind mounts can be made: the kernel has `mount_setattr(2)` (5.12)
    /// and the OCI runtime knows the `rro` mount option (the daemon clears this when it does
    /// not, see `Runc::supports_mount_option`).
    pub recursive_read_only: bool,
    /// Pods can have user namespaces of their own (the spec's `userns`): the kernel has user
    /// namespaces, idmapped mounts and overlayfs on idmapped layers (Linux >= 5.19).
    pub user_namespaces: bool,
    /// AppArmor: whether the kernel enforces it and minicri's default profile is loaded (the
    /// daemon loads it at start, see the spec's `apparmor`).
    pub apparmor: AppArmorHost,
}

impl Default for HostInfo {
    fn default() -> Self {
        HostInfo {
            oom_score_adj: 0,
            cap_sys_resource: true,
            cap_last_cap: 40,
            cap_bounding: u64::MAX,
            cgroup_v2: false,
            recursive_read_only: true,
            user_namespaces: true,
            apparmor: AppArmorHost::default(),
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
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let mask = |key: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        };
        let cap_eff = mask("CapEff:").unwrap_or(0);
        let cap_last_cap = std::fs::read_to_string("/proc/sys/kernel/cap_last_cap")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(40);
        HostInfo {
            oom_score_adj,
            cap_sys_resource: cap_eff & (1 << CAP_SYS_RESOURCE) != 0,
            cap_last_cap,
            cap_bounding: mask("CapBnd:").unwrap_or(u64::MAX),
            cgroup_v2: std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists(),
            recursive_read_only: kernel_has_mount_setattr(),
            user_namespaces: std::path::Path::new("/proc/self/ns/user").exists()
                && kernel_has_mount_setattr()
                && kernel_at_least(
                    &std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default(),
                    (5, 19),
                ),
            apparmor: AppArmorHost {
                enabled: apparmor_enabled(),
                default_profile: false,
            },
        }
    }

    /// Whether capability number `n` can be given to a container: the kernel knows it and
    /// this process's bounding set holds it.
    pub fn has_capability(&self, n: usize) -> bool {
        n <= self.cap_last_cap as usize && n < 64 && self.cap_bounding & (1 << n) != 0
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

/// Whether a kernel release string (`6.1.0-13-amd64`) is at least `major.minor`.
fn kernel_at_least(release: &str, (major, minor): (u32, u32)) -> bool {
    let mut parts = release
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let have = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    have >= (major, minor)
}

/// Whether the kernel implements `mount_setattr(2)`: a call with an invalid descriptor fails
/// with `EBADF` (or `EINVAL`) where it exists and `ENOSYS` where it does not. Changes nothing.
fn kernel_has_mount_setattr() -> bool {
    // SAFETY: no pointer is dereferenced: the path is a valid C string, the attribute pointer
    // is null with size 0, and the descriptor -1 makes the call fail before doing anything.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            -1,
            c"".as_ptr(),
            0,
            std::ptr::null::<u8>(),
            0usize,
        )
    };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ENOSYS)
}

/// `linux.cgroupsPath` for container `id` under the CRI `cgroup_parent`:
/// - cgroupfs: `<parent>/<id>` (an empty parent means `/minicri`); the parent must be a path,
///   not a systemd slice;
/// - systemd: `<slice>:minicri:<id>` (runc and crun then create the scope `minicri-<id>.scope`
///   in the slice; an empty parent means `system.slice`); the parent must be a slice name, or a
///   path whose last component is one.
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
            if Path::new(parent)
                .components()
                .any(|c| matches!(c, std::path::Component::ParentDir))
                || parent.contains('\0')
            {
                return Err(OciError::invalid(format!(
                    "cgroup parent {parent:?} has '..' components: it must stay under the cgroup root"
                )));
            }
            let base = if parent.starts_with('/') {
                PathBuf::from(parent)
            } else {
                PathBuf::from("/").join(parent)
            };
            Ok(base.join(id))
        }
        CgroupDriver::Systemd => {
            let slice = systemd_slice(parent)?;
            Ok(PathBuf::from(format!("{slice}:minicri:{id}")))
        }
    }
}

/// The systemd slice a CRI `cgroup_parent` names under the systemd driver: the parent itself,
/// or the last component of a path (`/test.slice`, what critest sends, or
/// `/kubepods.slice/kubepods-pod1.slice`: a slice's name encodes its ancestors, `a-b.slice` is
/// inside `a.slice`); `system.slice` for an empty parent.
pub fn systemd_slice(parent: &str) -> Result<&str> {
    if parent.is_empty() {
        return Ok("system.slice");
    }
    match parent.rsplit('/').next() {
        Some(slice) if slice.len() > ".slice".len() && slice.ends_with(".slice") => Ok(slice),
        _ => Err(OciError::invalid(format!(
            "cgroup parent {parent:?} is not a systemd slice but the cgroup driver is systemd"
        ))),
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
    fn kernel_versions() {
        assert!(kernel_at_least("6.18.44-fc-v445", (5, 19)));
        assert!(kernel_at_least("5.19.0", (5, 19)));
        assert!(!kernel_at_least("5.10.0-26-amd64", (5, 19)));
        assert!(!kernel_at_least("", (5, 19)));
    }

    #[test]
    fn detect_reads_this_process() {
        let h = HostInfo::detect();
        assert!((-1000..=1000).contains(&h.oom_score_adj));
        assert!(h.cap_last_cap >= 30);
        assert!(h.has_capability(0), "the tests run with CAP_CHOWN");
        assert!(!h.has_capability(64));
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
        for escape in ["/kubepods/../../sys/fs", "..", "kubepods/.."] {
            let e = cgroups_path(Cgroupfs, escape, "c1").unwrap_err();
            assert!(e.to_string().contains("'..'"), "{escape}: {e}");
        }
        assert_eq!(
            cgroups_path(Systemd, "kubepods-besteffort-podx.slice", "c1").unwrap(),
            PathBuf::from("kubepods-besteffort-podx.slice:minicri:c1")
        );
        assert_eq!(
            cgroups_path(Systemd, "", "c1").unwrap(),
            PathBuf::from("system.slice:minicri:c1")
        );
        assert_eq!(
            cgroups_path(Systemd, "/test.slice", "c1").unwrap(),
            PathBuf::from("test.slice:minicri:c1")
        );
        assert_eq!(
            cgroups_path(
                Systemd,
                "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-podx.slice",
                "c1"
            )
            .unwrap(),
            PathBuf::from("kubepods-besteffort-podx.slice:minicri:c1")
        );
        for bad in [
            "/kubepods/podx",
            "/test.slice/",
            ".slice",
            "/x/.slice",
            "kubepods",
        ] {
            let e = cgroups_path(Systemd, bad, "c1").unwrap_err();
            assert!(e.to_string().contains("not a systemd slice"), "{bad}: {e}");
        }
    }
}

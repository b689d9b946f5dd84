//! What the kernel's cgroup files say about a container: whether the OOM killer struck it.
//!
//! Read right after the container's init exits, before `runc delete` removes the cgroup.
//! cgroup v1: `memory.oom_control` of the memory hierarchy has `oom_kill N`; cgroup v2:
//! `memory.events` has `oom_kill N`. Only the cgroupfs driver's paths are known here; with the
//! systemd driver the answer is `false`.

use std::path::{Path, PathBuf};

use crate::oci::{CgroupDriver, cgroups_path};

fn counter(file: &Path, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// Whether the container `id` under `parent` had a process killed by the OOM killer.
pub fn oom_killed(driver: CgroupDriver, parent: &str, id: &str) -> bool {
    if driver != CgroupDriver::Cgroupfs {
        return false;
    }
    let Ok(rel) = cgroups_path(driver, parent, id) else {
        return false;
    };
    let rel: PathBuf = rel.strip_prefix("/").map(Path::to_path_buf).unwrap_or(rel);
    let root = Path::new("/sys/fs/cgroup");
    let v1 = root.join("memory").join(&rel).join("memory.oom_control");
    let v2 = root.join(&rel).join("memory.events");
    counter(&v1, "oom_kill")
        .or_else(|| counter(&v2, "oom_kill"))
        .is_some_and(|n| n > 0)
}

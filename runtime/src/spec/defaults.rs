//! What a container gets when the CRI says nothing: capabilities, masked and read-only paths,
//! standard mounts and device rules. The values are the ones container runtimes have converged
//! on (runc's `spec` template, Docker and containerd defaults), taken from the OCI runtime spec's
//! Linux section. Also the spec pieces every builder uses: mounts ([`mount`], [`bind_mount`]) and
//! a process's capability sets ([`linux_capabilities`]).

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use oci_spec::runtime::{
    Capability, LinuxCapabilities, LinuxDevice, LinuxDeviceCgroup, LinuxDeviceType, Mount,
};

use crate::oci::error::{OciError, Result};
use crate::oci::host::HostInfo;

/// The 14 capabilities a non-privileged container keeps by default.
pub const DEFAULT_CAPABILITIES: [&str; 14] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];

/// Every capability in kernel numbering order (`CAP_CHOWN` is 0); a host supports those up to
/// `/proc/sys/kernel/cap_last_cap`.
pub const ALL_CAPABILITIES: [&str; 41] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
];

/// Parses `NET_ADMIN`, `CAP_NET_ADMIN` or `net_admin`.
pub fn parse_capability(name: &str) -> Result<Capability> {
    serde_json::from_value(serde_json::Value::String(name.to_string()))
        .map_err(|_| OciError::invalid(format!("unknown capability {name:?}")))
}

/// The kernel number of a capability (its index in [`ALL_CAPABILITIES`]).
pub fn capability_number(c: &Capability) -> Option<usize> {
    ALL_CAPABILITIES
        .iter()
        .position(|n| parse_capability(n).ok().as_ref() == Some(c))
}

/// Every capability a container can be given on this host: the kernel knows it and minicri's
/// own bounding set holds it ([`HostInfo::has_capability`]).
pub fn host_capabilities(host: &HostInfo) -> Vec<Capability> {
    ALL_CAPABILITIES
        .iter()
        .enumerate()
        .filter(|(n, _)| host.has_capability(*n))
        .map(|(_, c)| parse_capability(c).expect("known capability"))
        .collect()
}

/// Paths hidden from non-privileged containers (bind-mounted over with /dev/null or an empty
/// read-only tmpfs by the OCI runtime).
pub const DEFAULT_MASKED_PATHS: [&str; 11] = [
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];

/// Paths made read-only in non-privileged containers.
pub const DEFAULT_READONLY_PATHS: [&str; 5] = [
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

pub fn strings(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

pub(crate) fn mount(dest: &str, typ: &str, source: &str, options: &[&str]) -> Mount {
    let mut m = Mount::default();
    m.set_destination(PathBuf::from(dest));
    m.set_typ(Some(typ.to_string()));
    m.set_source(Some(PathBuf::from(source)));
    m.set_options(Some(strings(options)));
    m
}

pub(crate) fn bind_mount(dest: &str, source: &Path, options: &[&str]) -> Mount {
    let mut m = Mount::default();
    m.set_destination(PathBuf::from(dest));
    m.set_typ(Some("bind".to_string()));
    m.set_source(Some(source.to_path_buf()));
    let mut o = vec!["rbind".to_string()];
    o.extend(strings(options));
    m.set_options(Some(o));
    m
}

/// A fresh `/proc` (every container's and the infra process's).
pub fn proc_mount() -> Mount {
    mount("/proc", "proc", "proc", &["nosuid", "noexec", "nodev"])
}

/// A small tmpfs `/dev` the runtime fills with the default device nodes (every container's and
/// the infra process's).
pub fn dev_mount() -> Mount {
    mount(
        "/dev",
        "tmpfs",
        "tmpfs",
        &["nosuid", "strictatime", "mode=755", "size=65536k"],
    )
}

/// The mounts every container has: `/proc`, a tmpfs `/dev` with `/dev/pts` and `/dev/mqueue`,
/// `/sys` and its cgroup tree (read-only unless privileged). `/dev/shm` is added by the caller
/// (the sandbox's, or a private tmpfs).
pub fn standard_mounts(privileged: bool) -> Vec<Mount> {
    let ro = if privileged { "rw" } else { "ro" };
    vec![
        proc_mount(),
        dev_mount(),
        mount(
            "/dev/pts",
            "devpts",
            "devpts",
            &[
                "nosuid",
                "noexec",
                "newinstance",
                "ptmxmode=0666",
                "mode=0620",
                "gid=5",
            ],
        ),
        mount(
            "/dev/mqueue",
            "mqueue",
            "mqueue",
            &["nosuid", "noexec", "nodev"],
        ),
        mount("/sys", "sysfs", "sysfs", &["nosuid", "noexec", "nodev", ro]),
        mount(
            "/sys/fs/cgroup",
            "cgroup",
            "cgroup",
            &["nosuid", "noexec", "nodev", "relatime", ro],
        ),
    ]
}

/// A private `/dev/shm` (used when there is no sandbox shm to share).
pub fn private_shm() -> Mount {
    mount(
        "/dev/shm",
        "tmpfs",
        "shm",
        &["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
    )
}

fn char_rule(major: i64, minor: Option<i64>, access: &str) -> LinuxDeviceCgroup {
    let mut r = LinuxDeviceCgroup::default();
    r.set_allow(true);
    r.set_typ(Some(LinuxDeviceType::C));
    r.set_major(if major < 0 { None } else { Some(major) });
    r.set_minor(minor);
    r.set_access(Some(access.to_string()));
    r
}

/// Device cgroup rules: deny everything, then allow `mknod` of any node and use of the devices
/// every container has (null, zero, full, random, urandom, tty, the pty multiplexer and slaves).
pub fn default_device_rules() -> Vec<LinuxDeviceCgroup> {
    let mut deny = LinuxDeviceCgroup::default();
    deny.set_allow(false);
    deny.set_access(Some("rwm".into()));
    let mut block_mknod = char_rule(-1, None, "m");
    block_mknod.set_typ(Some(LinuxDeviceType::B));
    vec![
        deny,
        char_rule(-1, None, "m"),
        block_mknod,
        char_rule(1, Some(3), "rwm"),
        char_rule(1, Some(5), "rwm"),
        char_rule(1, Some(7), "rwm"),
        char_rule(1, Some(8), "rwm"),
        char_rule(1, Some(9), "rwm"),
        char_rule(5, Some(0), "rwm"),
        char_rule(5, Some(2), "rwm"),
        char_rule(136, None, "rwm"),
    ]
}

/// Everything allowed (privileged containers).
pub fn allow_all_devices() -> Vec<LinuxDeviceCgroup> {
    let mut r = LinuxDeviceCgroup::default();
    r.set_allow(true);
    r.set_access(Some("rwm".into()));
    vec![r]
}

/// Entries the device walks of one container look at, at most, before it is refused: a pod's
/// `host_path` may name any directory of the host (`/`, `/sys`), as many times as it likes, and
/// the walks run in CreateContainer. Each requested device counts one besides what its walk reads.
pub const MAX_DEVICE_WALK: usize = 65_536;

/// Names a walk of device directories leaves alone, as other runtimes do: pseudo-terminals,
/// shared memory and message queues are the container's own, `fd` is a link to the daemon's
/// descriptors, and `console` / `ptmx` come from the container's own devpts.
const SKIPPED_DEVICE_NAMES: [&str; 9] = [
    "pts",
    "shm",
    "fd",
    "mqueue",
    "console",
    "ptmx",
    ".lxc",
    ".lxd-mounts",
    ".udev",
];

/// The device node at `host` (a symlink naming it is followed), to appear at `container`;
/// directories are walked and yield every node below them, at the same relative path under
/// `container`. The walk does not follow symlinks (in `/sys` they loop) and takes what it looks
/// at from `budget` (one container's: start it at [`MAX_DEVICE_WALK`]), one entry for `host`
/// itself included. A path that is no device or directory is an invalid argument, as it comes
/// from the pod's spec, and so is running out of budget.
pub fn host_devices(host: &Path, container: &Path, budget: &mut usize) -> Result<Vec<LinuxDevice>> {
    let spent = || {
        OciError::invalid(format!(
            "the container's devices, up to {}, hold more than {MAX_DEVICE_WALK} entries",
            host.display()
        ))
    };
    *budget = budget.checked_sub(1).ok_or_else(spent)?;
    let meta = std::fs::metadata(host)
        .map_err(|e| OciError::invalid(format!("device {}: {e}", host.display())))?;
    if !meta.is_dir() {
        return device(host, container, &meta).map(|d| vec![d]);
    }
    let mut out = Vec::new();
    std::fs::read_dir(host)
        .map_err(|e| OciError::invalid(format!("device directory {}: {e}", host.display())))?;
    walk_devices(host, container, budget, &mut out).map_err(|()| spent())?;
    Ok(out)
}

/// Appends the device nodes under `dir` (in name order, at the same relative path under
/// `container`) to `out`, skipping [`SKIPPED_DEVICE_NAMES`], symlinks, anything else that is
/// no device, and directories that cannot be read. `Err` when `budget` entries were not enough.
fn walk_devices(
    dir: &Path,
    container: &Path,
    budget: &mut usize,
    out: &mut Vec<LinuxDevice>,
) -> std::result::Result<(), ()> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    let mut found = Vec::new();
    for e in entries.flatten() {
        *budget = budget.checked_sub(1).ok_or(())?;
        let Ok(ft) = e.file_type() else { continue };
        let name = e.file_name();
        if SKIPPED_DEVICE_NAMES.iter().any(|n| name == *n) {
            continue;
        }
        if ft.is_dir() || ft.is_char_device() || ft.is_block_device() {
            found.push((name, ft.is_dir()));
        }
    }
    found.sort();
    for (name, is_dir) in found {
        let (sub, at) = (dir.join(&name), container.join(&name));
        if is_dir {
            walk_devices(&sub, &at, budget, out)?;
        } else if let Ok(meta) = std::fs::symlink_metadata(&sub)
            && let Ok(d) = device(&sub, &at, &meta)
        {
            out.push(d);
        }
    }
    Ok(())
}

/// The device node `host`, of metadata `meta`, to appear at `container`.
fn device(host: &Path, container: &Path, meta: &std::fs::Metadata) -> Result<LinuxDevice> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let ft = meta.file_type();
    let typ = if ft.is_char_device() {
        LinuxDeviceType::C
    } else if ft.is_block_device() {
        LinuxDeviceType::B
    } else {
        return Err(OciError::invalid(format!(
            "{} is not a device",
            host.display()
        )));
    };
    let rdev = meta.rdev();
    let mut d = LinuxDevice::default();
    d.set_path(container.to_path_buf());
    d.set_typ(typ);
    d.set_major(nix::sys::stat::major(rdev) as i64);
    d.set_minor(nix::sys::stat::minor(rdev) as i64);
    d.set_file_mode(Some(meta.mode() & 0o7777));
    d.set_uid(Some(meta.uid()));
    d.set_gid(Some(meta.gid()));
    Ok(d)
}

/// The cgroup rule granting `access` (`r`, `w`, `m` letters) to one device.
pub fn device_rule(d: &LinuxDevice, access: &str) -> LinuxDeviceCgroup {
    let mut r = LinuxDeviceCgroup::default();
    r.set_allow(true);
    r.set_typ(Some(d.typ()));
    r.set_major(Some(d.major()));
    r.set_minor(Some(d.minor()));
    r.set_access(Some(if access.is_empty() {
        "rwm".into()
    } else {
        access.to_string()
    }));
    r
}

/// All device nodes of the host's `/dev` for privileged containers, except
/// [`SKIPPED_DEVICE_NAMES`] (the per-container pseudo-terminal, shm and mqueue trees and the
/// console), in path order. Past [`MAX_DEVICE_WALK`] entries the rest is left out, with a
/// warning.
pub fn all_host_devices() -> Vec<LinuxDevice> {
    let dev = Path::new("/dev");
    let mut out = Vec::new();
    let mut budget = MAX_DEVICE_WALK;
    if walk_devices(dev, dev, &mut budget, &mut out).is_err() {
        tracing::warn!(
            "/dev holds more than {MAX_DEVICE_WALK} entries: privileged containers get the \
             devices of the first ones only"
        );
    }
    out
}

/// Bounding, permitted and effective sets are `set`; ambient as asked, and inheritable the same.
pub fn linux_capabilities(
    set: &HashSet<Capability>,
    ambient: &[String],
) -> Result<LinuxCapabilities> {
    let mut c = LinuxCapabilities::default();
    c.set_bounding(Some(set.clone()));
    c.set_permitted(Some(set.clone()));
    c.set_effective(Some(set.clone()));
    let amb: HashSet<Capability> = ambient
        .iter()
        .map(|a| parse_capability(a))
        .collect::<Result<_>>()?;
    if amb.iter().any(|a| !set.contains(a)) {
        return Err(OciError::invalid(
            "ambient capabilities must also be added to the bounding set",
        ));
    }
    // The kernel raises an ambient capability only when it is permitted and inheritable:
    // inheritable holds exactly the ambient ones (empty without them).
    c.set_inheritable(Some(amb.clone()));
    c.set_ambient(Some(amb));
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capability_names() {
        assert_eq!(parse_capability("NET_ADMIN").unwrap(), Capability::NetAdmin);
        assert_eq!(
            parse_capability("cap_sys_admin").unwrap(),
            Capability::SysAdmin
        );
        assert!(parse_capability("CAP_FLY").is_err());
        let all = HostInfo::default();
        assert_eq!(host_capabilities(&all).len(), 41);
        let old_kernel = HostInfo {
            cap_last_cap: 37,
            ..HostInfo::default()
        };
        assert_eq!(
            host_capabilities(&old_kernel).last(),
            Some(&Capability::AuditRead)
        );
        // This machine's root lacks CAP_SYS_RESOURCE (24) in its bounding set.
        let no_sys_resource = HostInfo {
            cap_bounding: 0x1ff_feff_ffff,
            ..HostInfo::default()
        };
        let caps = host_capabilities(&no_sys_resource);
        assert_eq!(caps.len(), 40);
        assert!(!caps.contains(&Capability::SysResource));
        assert_eq!(capability_number(&Capability::SysResource), Some(24));
        assert_eq!(capability_number(&Capability::Chown), Some(0));
        for c in DEFAULT_CAPABILITIES {
            parse_capability(c).unwrap();
        }
    }

    #[test]
    fn devices_from_host() {
        let mut budget = MAX_DEVICE_WALK;
        let budget = &mut budget;
        let d = host_devices(Path::new("/dev/null"), Path::new("/dev/mynull"), budget).unwrap();
        assert_eq!(d.len(), 1);
        assert_eq!(
            (d[0].typ(), d[0].major(), d[0].minor()),
            (LinuxDeviceType::C, 1, 3)
        );
        assert_eq!(d[0].path(), Path::new("/dev/mynull"));
        let r = device_rule(&d[0], "rw");
        assert_eq!(
            (r.major(), r.minor(), r.access().as_deref()),
            (Some(1), Some(3), Some("rw"))
        );
        // Not a device, or missing: the pod's spec is wrong.
        for p in ["/etc/hostname", "/dev/nonexistent-device"] {
            let e = host_devices(Path::new(p), Path::new("/x"), budget).unwrap_err();
            assert!(matches!(e, OciError::InvalidArgument(_)), "{p}: {e:?}");
        }
    }

    /// A directory is walked without following symlinks: in /sys they loop, and a walk that
    /// followed them never ended (each loop doubles the paths to walk).
    #[test]
    fn device_directories_are_walked_without_following_symlinks() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("sub/deeper")).unwrap();
        for (at, to) in [("sub/a", "."), ("sub/b", ".."), ("sub/null", "/dev/null")] {
            std::os::unix::fs::symlink(to, d.path().join(at)).unwrap();
        }
        let mut budget = MAX_DEVICE_WALK;
        assert!(
            host_devices(d.path(), Path::new("/dev/x"), &mut budget)
                .unwrap()
                .is_empty()
        );
        // Real directories are walked: /dev's nodes, at their paths under `container`, but
        // not the container's own pseudo-terminals.
        let found = host_devices(Path::new("/dev"), Path::new("/c"), &mut budget).unwrap();
        assert!(found.iter().any(|d| d.path() == Path::new("/c/null")));
        assert!(!found.iter().any(|d| d.path().starts_with("/c/pts")));
    }

    /// The walk looks at a bounded number of entries.
    #[test]
    fn device_walks_are_bounded() {
        let d = tempfile::tempdir().unwrap();
        for n in 0..10 {
            std::fs::create_dir(d.path().join(format!("d{n}"))).unwrap();
        }
        let mut out = Vec::new();
        assert!(walk_devices(d.path(), Path::new("/x"), &mut 9, &mut out).is_err());
        assert!(walk_devices(d.path(), Path::new("/x"), &mut 10, &mut out).is_ok());
        assert!(out.is_empty());
        // One budget for all of a container's devices: the directory costs 11 (itself and its
        // entries), so 21 pays for it once, not twice.
        let mut budget = 21;
        host_devices(d.path(), Path::new("/x"), &mut budget).unwrap();
        let e = host_devices(d.path(), Path::new("/y"), &mut budget).unwrap_err();
        assert!(
            matches!(&e, OciError::InvalidArgument(m) if m.contains("more than")),
            "{e:?}"
        );
        // Each device asked for counts, directory or not.
        let mut budget = 1;
        host_devices(Path::new("/dev/null"), Path::new("/x"), &mut budget).unwrap();
        host_devices(Path::new("/dev/null"), Path::new("/y"), &mut budget).unwrap_err();
    }
}

//! minicri's `RuntimeDefault` seccomp profile, loading `Localhost` profiles, and choosing the filter
//! for a CRI security profile ([`select_seccomp`]).
//!
//! The default profile is a deny-list: every system call is allowed except the ones below,
//! which fail with `EPERM`. It blocks what containers never need and what escapes or
//! destabilises the host; calls guarded by a capability are blocked only when the container
//! does not hold that capability (a container granted `CAP_SYS_ADMIN` may mount, as the
//! kernel then allows):
//!
//! | always denied | why |
//! |---|---|
//! | `kexec_load`, `kexec_file_load` | replace the running kernel |
//! | `add_key`, `request_key`, `keyctl` | the kernel keyring is not namespaced |
//! | `userfaultfd` | a common exploitation primitive |
//! | `uselib`, `nfsservctl`, `vm86`, `vm86old`, `_sysctl`, `lookup_dcookie`, `get_kernel_syms`, `create_module`, `query_module` | obsolete |
//!
//! | denied without | calls |
//! |---|---|
//! | `CAP_SYS_ADMIN` | mount family (`mount`, `umount`, `umount2`, `pivot_root`, `fsopen`, `fsconfig`, `fsmount`, `fspick`, `move_mount`, `open_tree`, `mount_setattr`), `setns`, `unshare`, `clone` with any `CLONE_NEW*` flag, `clone3` (answered `ENOSYS` so libcs fall back to `clone`, whose flags can be inspected), `quotactl`, `swapon`, `swapoff`, `open_by_handle_at`, `name_to_handle_at`, `bpf`, `perf_event_open`, `fanotify_init`, `syslog` |
//! | `CAP_SYS_MODULE` | `init_module`, `finit_module`, `delete_module` |
//! | `CAP_SYS_BOOT` | `reboot` |
//! | `CAP_SYS_TIME` | `settimeofday`, `stime`, `clock_settime`, `clock_settime64`, `clock_adjtime`, `clock_adjtime64` |
//! | `CAP_SYS_PACCT` | `acct` |
//! | `CAP_SYS_RAWIO` | `iopl`, `ioperm` |
//! | `CAP_SYS_PTRACE` | `kcmp`, `process_madvise` |
//!
//! `ptrace` and `process_vm_readv/writev` stay allowed: since Linux 4.8 seccomp cannot be
//! bypassed with ptrace, and debuggers inside a container are legitimate. Names a kernel or
//! libseccomp does not know are skipped by runc and crun.

use std::collections::HashSet;
use std::path::Path;

use oci_spec::runtime::{
    Arch, Capability, LinuxSeccomp, LinuxSeccompAction, LinuxSeccompArgBuilder,
    LinuxSeccompOperator, LinuxSyscall,
};

use crate::oci::error::{OciError, Result};

const EPERM: u32 = 1;
const ENOSYS: u32 = 38;

const ALWAYS: &[&str] = &[
    "kexec_load",
    "kexec_file_load",
    "add_key",
    "request_key",
    "keyctl",
    "userfaultfd",
    "uselib",
    "nfsservctl",
    "vm86",
    "vm86old",
    "_sysctl",
    "lookup_dcookie",
    "get_kernel_syms",
    "create_module",
    "query_module",
];

const SYS_ADMIN: &[&str] = &[
    "mount",
    "umount",
    "umount2",
    "pivot_root",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "setns",
    "unshare",
    "quotactl",
    "swapon",
    "swapoff",
    "open_by_handle_at",
    "name_to_handle_at",
    "bpf",
    "perf_event_open",
    "fanotify_init",
    "syslog",
];

const GUARDED: &[(Capability, &[&str])] = &[
    (
        Capability::SysModule,
        &["init_module", "finit_module", "delete_module"],
    ),
    (Capability::SysBoot, &["reboot"]),
    (
        Capability::SysTime,
        &[
            "settimeofday",
            "stime",
            "clock_settime",
            "clock_settime64",
            "clock_adjtime",
            "clock_adjtime64",
        ],
    ),
    (Capability::SysPacct, &["acct"]),
    (Capability::SysRawio, &["iopl", "ioperm"]),
    (Capability::SysPtrace, &["kcmp", "process_madvise"]),
];

/// `CLONE_NEWNS`, `CLONE_NEWCGROUP`, `CLONE_NEWUTS`, `CLONE_NEWIPC`, `CLONE_NEWUSER`,
/// `CLONE_NEWPID`, `CLONE_NEWNET`: each gets its own rule, since one masked comparison cannot
/// express "any of these bits".
const CLONE_NEW_FLAGS: [u64; 7] = [
    0x0002_0000,
    0x0200_0000,
    0x0400_0000,
    0x0800_0000,
    0x1000_0000,
    0x2000_0000,
    0x4000_0000,
];

fn deny(names: &[&str], errno: u32) -> LinuxSyscall {
    let mut s = LinuxSyscall::default();
    s.set_names(names.iter().map(|n| n.to_string()).collect());
    s.set_action(LinuxSeccompAction::ScmpActErrno);
    s.set_errno_ret(Some(errno));
    s
}

/// The `RuntimeDefault` profile for a container holding `caps` (its bounding set).
pub fn default_profile(caps: &HashSet<Capability>) -> LinuxSeccomp {
    let mut syscalls = vec![deny(ALWAYS, EPERM)];
    if !caps.contains(&Capability::SysAdmin) {
        syscalls.push(deny(SYS_ADMIN, EPERM));
        syscalls.push(deny(&["clone3"], ENOSYS));
        // clone(flags, ...) on x86_64 and arm64 has the flags in argument 0.
        for flag in CLONE_NEW_FLAGS {
            let arg = LinuxSeccompArgBuilder::default()
                .index(0usize)
                .value(flag)
                .value_two(flag)
                .op(LinuxSeccompOperator::ScmpCmpMaskedEq)
                .build()
                .expect("all fields set");
            let mut s = deny(&["clone"], EPERM);
            s.set_args(Some(vec![arg]));
            syscalls.push(s);
        }
    }
    for (cap, names) in GUARDED {
        if !caps.contains(cap) {
            syscalls.push(deny(names, EPERM));
        }
    }
    let mut p = LinuxSeccomp::default();
    p.set_default_action(LinuxSeccompAction::ScmpActAllow);
    p.set_architectures(Some(native_architectures()));
    p.set_syscalls(Some(syscalls));
    p
}

/// The native architecture and the ones it can run (so a 32-bit binary cannot use the
/// 32-bit syscall table to get around the profile).
fn native_architectures() -> Vec<Arch> {
    if cfg!(target_arch = "x86_64") {
        vec![Arch::ScmpArchX86_64, Arch::ScmpArchX86, Arch::ScmpArchX32]
    } else if cfg!(target_arch = "aarch64") {
        vec![Arch::ScmpArchAarch64, Arch::ScmpArchArm]
    } else {
        vec![Arch::ScmpArchNative]
    }
}

/// The largest `Localhost` profile read (real ones are tens of KiB).
pub const MAX_PROFILE_BYTES: u64 = 4 << 20;

/// Loads a `Localhost` profile: an OCI `linux.seccomp` JSON document at `path` (absolute, as the
/// kubelet resolves it under its seccomp root). Any CRI client can name any path, so it is read
/// only if it is a regular file of at most [`MAX_PROFILE_BYTES`] (a FIFO would block the daemon,
/// `/dev/zero` would grow it without end).
pub fn load_profile(path: &str) -> Result<LinuxSeccomp> {
    let path = path.strip_prefix("localhost/").unwrap_or(path);
    if !path.starts_with('/') {
        return Err(OciError::invalid(format!(
            "seccomp profile path {path:?} is not absolute"
        )));
    }
    use crate::fsutil::{ReadRegularError as E, read_regular};
    let text = match read_regular(Path::new(path), MAX_PROFILE_BYTES, true) {
        Ok(b) => b,
        Err(E::Missing) => {
            return Err(OciError::invalid(format!(
                "seccomp profile {path} does not exist"
            )));
        }
        Err(E::NotRegular) => {
            return Err(OciError::invalid(format!(
                "seccomp profile {path} is not a regular file"
            )));
        }
        Err(E::TooBig(n)) => {
            return Err(OciError::invalid(format!(
                "seccomp profile {path} is {n} bytes or more, more than the {MAX_PROFILE_BYTES} read"
            )));
        }
        Err(E::Io(what, e)) => return Err(OciError::io(what, path, e)),
    };
    serde_json::from_slice(&text)
        .map_err(|e| OciError::invalid(format!("seccomp profile {path}: {e}")))
}

/// The seccomp filter for a security profile: `None` (absent) or `Unconfined` → no filter;
/// `RuntimeDefault` → [`default_profile`]; `Localhost` → the JSON file at
/// `localhost_ref`. The deprecated `seccomp_profile_path` strings (`runtime/default`,
/// `docker/default`, `unconfined`, `localhost/<path>`) are honoured when no profile is set.
pub fn select_seccomp(
    profile: Option<&minicri_proto::runtime::v1::SecurityProfile>,
    deprecated_path: &str,
    caps: &HashSet<Capability>,
) -> Result<Option<LinuxSeccomp>> {
    use minicri_proto::runtime::v1::security_profile::ProfileType;
    if let Some(p) = profile {
        return match ProfileType::try_from(p.profile_type) {
            Ok(ProfileType::Unconfined) => Ok(None),
            Ok(ProfileType::RuntimeDefault) => Ok(Some(default_profile(caps))),
            Ok(ProfileType::Localhost) => load_profile(&p.localhost_ref).map(Some),
            Err(_) => Err(OciError::invalid(format!(
                "unknown seccomp profile type {}",
                p.profile_type
            ))),
        };
    }
    match deprecated_path {
        "" | "unconfined" => Ok(None),
        "runtime/default" | "docker/default" => Ok(Some(default_profile(caps))),
        p if p.starts_with("localhost/") => load_profile(p).map(Some),
        p => Err(OciError::invalid(format!("unknown seccomp profile {p:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(p: &LinuxSeccomp) -> Vec<String> {
        p.syscalls()
            .as_ref()
            .unwrap()
            .iter()
            .flat_map(|s| s.names().clone())
            .collect()
    }

    #[test]
    fn localhost_profiles_that_are_not_small_regular_files_are_refused_without_blocking() {
        let d = tempfile::tempdir().unwrap();
        let invalid = |path: &Path, want: &str| {
            let t = std::time::Instant::now();
            let e = load_profile(path.to_str().unwrap()).unwrap_err();
            assert!(
                matches!(&e, OciError::InvalidArgument(m) if m.contains(want)),
                "{path:?}: {e:?}"
            );
            assert!(t.elapsed() < std::time::Duration::from_secs(1), "{path:?}");
        };
        // A FIFO nobody writes: opening it for reading would block the daemon forever.
        let fifo = d.path().join("fifo.json");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap();
        invalid(&fifo, "not a regular file");
        // A device that never ends, named directly and through a symlink.
        invalid(Path::new("/dev/zero"), "not a regular file");
        let link = d.path().join("zero.json");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        invalid(&link, "not a regular file");
        invalid(&d.path().join("absent.json"), "does not exist");
        // Over the cap (sparse: no disk used).
        let big = d.path().join("big.json");
        std::fs::File::create(&big)
            .unwrap()
            .set_len(MAX_PROFILE_BYTES + 1)
            .unwrap();
        invalid(&big, "more than");
        // A real profile is read, through a symlink too (the kubelet's seccomp root may hold them).
        let good = d.path().join("good.json");
        std::fs::write(&good, r#"{"defaultAction": "SCMP_ACT_ALLOW"}"#).unwrap();
        let via = d.path().join("via.json");
        std::os::unix::fs::symlink(&good, &via).unwrap();
        let p = load_profile(&format!("localhost/{}", via.display())).unwrap();
        assert_eq!(p.default_action(), LinuxSeccompAction::ScmpActAllow);
    }

    #[test]
    fn deny_list_depends_on_capabilities() {
        let none = default_profile(&HashSet::new());
        assert_eq!(none.default_action(), LinuxSeccompAction::ScmpActAllow);
        let n = names(&none);
        for call in [
            "kexec_load",
            "keyctl",
            "mount",
            "unshare",
            "reboot",
            "init_module",
            "clone3",
            "clone",
        ] {
            assert!(n.iter().any(|x| x == call), "{call} should be denied");
        }
        assert!(!n.iter().any(|x| x == "ptrace"));
        let admin = default_profile(&HashSet::from([Capability::SysAdmin, Capability::SysBoot]));
        let n = names(&admin);
        assert!(
            !n.iter()
                .any(|x| x == "mount" || x == "reboot" || x == "clone")
        );
        assert!(n.iter().any(|x| x == "keyctl"));
        // Serialises the way runc expects.
        let json = serde_json::to_string(&none).unwrap();
        assert!(
            json.contains("\"defaultAction\":\"SCMP_ACT_ALLOW\""),
            "{json}"
        );
        assert!(json.contains("SCMP_CMP_MASKED_EQ"), "{json}");
    }

    #[test]
    fn localhost_profiles() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("p.json");
        std::fs::write(&p, r#"{"defaultAction":"SCMP_ACT_ERRNO","syscalls":[{"names":["read"],"action":"SCMP_ACT_ALLOW"}]}"#)
            .unwrap();
        let prof = load_profile(p.to_str().unwrap()).unwrap();
        assert_eq!(prof.default_action(), LinuxSeccompAction::ScmpActErrno);
        assert_eq!(
            load_profile(&format!("localhost/{}", p.display())).unwrap(),
            prof
        );
        assert!(load_profile("relative.json").is_err());
        assert!(load_profile("/nonexistent/profile.json").is_err());
    }
}

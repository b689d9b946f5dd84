//! The sandbox infra process (`minicri pause`) and the rootfs it runs from.
//!
//! The infra process holds the pod's namespaces. Run by the OCI runtime as PID 1 of the pod's
//! PID namespace, it:
//! - exits 0 on SIGTERM or SIGINT (PID 1 gets no default signal actions, so without handling
//!   them it could only be SIGKILLed);
//! - reaps every child it inherits (when containers share the pod's PID namespace, orphans are
//!   reparented to it);
//! - otherwise sleeps in `sigwait`. The signals are blocked, not handled, so nothing runs in a
//!   signal handler; a blocked signal is still queued for a namespace's init.
//!
//! Its rootfs needs no image: [`prepare_infra_rootfs`] makes a directory of empty mount points,
//! and the sandbox spec bind-mounts this very binary read-only at [`INFRA_BINARY`] and the
//! host's library directories read-only beside it so the dynamically linked binary runs.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use nix::sys::signal::{SigSet, Signal};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};

use crate::oci::error::{OciError, Result};

/// Where the minicri binary appears inside the infra rootfs.
pub const INFRA_BINARY: &str = "/minicri";

/// Host library directories the dynamic loader and libc come from (those that exist are
/// mounted).
pub const HOST_LIB_DIRS: [&str; 4] = ["/lib", "/lib64", "/usr/lib", "/usr/lib64"];

/// A prepared infra rootfs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfraRootfs {
    /// The directory used as the read-only root.
    pub rootfs: PathBuf,
    /// The host path of the binary mounted at [`INFRA_BINARY`].
    pub binary: PathBuf,
    /// Host library directories to mount at the same paths.
    pub lib_dirs: Vec<PathBuf>,
}

/// Creates (or refreshes) the infra rootfs at `dir`: mount points for `/proc`, `/dev`, the
/// binary and the host's library directories. `binary` is the minicri executable to run
/// (normally `std::env::current_exe()`). One rootfs serves every sandbox.
pub fn prepare_infra_rootfs(dir: &Path, binary: &Path) -> Result<InfraRootfs> {
    let mkdir = |p: &Path| std::fs::create_dir_all(p).map_err(|e| OciError::io("create", p, e));
    mkdir(dir)?;
    for d in ["proc", "dev", "etc"] {
        mkdir(&dir.join(d))?;
    }
    let target = dir.join(INFRA_BINARY.trim_start_matches('/'));
    if !target.exists() {
        std::fs::write(&target, b"").map_err(|e| OciError::io("create", &target, e))?;
    }
    let binary = binary
        .canonicalize()
        .map_err(|e| OciError::io("resolve", binary, e))?;
    let mut lib_dirs = Vec::new();
    for d in HOST_LIB_DIRS {
        if Path::new(d).is_dir() {
            mkdir(&dir.join(d.trim_start_matches('/')))?;
            lib_dirs.push(PathBuf::from(d));
        }
    }
    Ok(InfraRootfs {
        rootfs: dir.to_path_buf(),
        binary,
        lib_dirs,
    })
}

/// Reaps every exited child without blocking.
fn reap() {
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) | Err(_) => return,
            Ok(_) => continue,
        }
    }
}

/// `minicri pause`: runs until SIGTERM or SIGINT.
pub fn main() -> ExitCode {
    let mut set = SigSet::empty();
    for s in [Signal::SIGTERM, Signal::SIGINT, Signal::SIGCHLD] {
        set.add(s);
    }
    if let Err(e) = set.thread_block() {
        eprintln!("minicri pause: blocking signals: {e}");
        return ExitCode::FAILURE;
    }
    reap();
    loop {
        match set.wait() {
            Ok(Signal::SIGTERM | Signal::SIGINT) => return ExitCode::SUCCESS,
            Ok(_) => reap(),
            Err(e) => {
                eprintln!("minicri pause: sigwait: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rootfs_layout() {
        let d = tempfile::tempdir().unwrap();
        let exe = std::env::current_exe().unwrap();
        let r = prepare_infra_rootfs(&d.path().join("infra"), &exe).unwrap();
        assert!(r.rootfs.join("proc").is_dir() && r.rootfs.join("dev").is_dir());
        assert!(r.rootfs.join("minicri").is_file());
        assert_eq!(r.binary, exe.canonicalize().unwrap());
        assert!(!r.lib_dirs.is_empty());
        for l in &r.lib_dirs {
            assert!(r.rootfs.join(l.strip_prefix("/").unwrap()).is_dir());
        }
        // Idempotent.
        assert_eq!(
            prepare_infra_rootfs(&d.path().join("infra"), &exe).unwrap(),
            r
        );
    }
}

//! Persistent named network namespaces for pod sandboxes.
//!
//! Owns the directory minicri keeps them in (`<state>/netns/`) and every file in it. A namespace is
//! kept alive by bind-mounting its nsfs inode onto `<dir>/<name>`, the same scheme as
//! `ip netns add`, so CNI plugins (`CNI_NETNS`) and the OCI runtime (the spec's `network`
//! namespace path) can join it by path after the thread that created it is gone.
//!
//! Invariants:
//! - The daemon's own threads never change namespace: every `unshare`/`setns` happens on a
//!   dedicated short-lived [`std::thread`] that exits right after.
//! - The directory is a mount point with shared propagation (made so on first use, like
//!   `ip netns`), so a namespace mounted or unmounted here is seen the same way by mount
//!   namespaces cloned from the host's (a container being set up by runc) and none keeps a stale
//!   copy alive.
//! - [`create`] either leaves a live namespace with `lo` up at the returned path, or nothing at
//!   all (no file, no mount).
//! - [`remove`] is idempotent: a missing file, or a file that is no longer a mount, is success.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nix::errno::Errno;
use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, setns, unshare};
use nix::sys::statfs::{NSFS_MAGIC, statfs};

/// A failed namespace operation: what was being done, on which path, and the OS error.
#[derive(Debug, thiserror::Error)]
#[error("network namespace {op} {}: {source}", path.display())]
pub struct NetnsError {
    pub op: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

pub type Result<T, E = NetnsError> = std::result::Result<T, E>;

fn err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> NetnsError + 'a {
    move |source| NetnsError {
        op,
        path: path.to_path_buf(),
        source,
    }
}

fn errno(e: Errno) -> io::Error {
    io::Error::from_raw_os_error(e as i32)
}

/// Serialises the "is the directory a shared mount point yet?" step, so two concurrent first
/// creations do not stack two self-bind-mounts.
static DIR_SETUP: Mutex<()> = Mutex::new(());

/// Makes `dir` exist and be a mount point with shared propagation, as `ip netns` does with
/// `/run/netns`: try `MS_SHARED|MS_REC`; if the kernel says it is not a mount point (`EINVAL`),
/// bind-mount it onto itself and try again. Idempotent.
pub fn prepare_dir(dir: &Path) -> Result<()> {
    let _guard = DIR_SETUP.lock().unwrap_or_else(|p| p.into_inner());
    std::fs::create_dir_all(dir).map_err(err("directory create", dir))?;
    let shared = || {
        mount(
            None::<&str>,
            dir,
            None::<&str>,
            MsFlags::MS_SHARED | MsFlags::MS_REC,
            None::<&str>,
        )
    };
    match shared() {
        Ok(()) => Ok(()),
        Err(Errno::EINVAL) => {
            mount(
                Some(dir),
                dir,
                None::<&str>,
                MsFlags::MS_BIND | MsFlags::MS_REC,
                None::<&str>,
            )
            .map_err(|e| err("directory bind-mount", dir)(errno(e)))?;
            shared().map_err(|e| err("directory make-shared", dir)(errno(e)))
        }
        Err(e) => Err(err("directory make-shared", dir)(errno(e))),
    }
}

/// Undoes [`prepare_dir`]'s self-bind-mount (lazily). For tests and uninstall; the namespaces in
/// the directory should be [`remove`]d first. Fine when `dir` is not a mount point.
pub fn unmount_dir(dir: &Path) -> Result<()> {
    match umount2(dir, MntFlags::MNT_DETACH) {
        Ok(()) | Err(Errno::EINVAL) | Err(Errno::ENOENT) => Ok(()),
        Err(e) => Err(err("directory unmount", dir)(errno(e))),
    }
}

fn check_name(name: &str) -> io::Result<()> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("invalid network namespace name {name:?}"),
        ));
    }
    Ok(())
}

/// Creates a new network namespace pinned at `<dir>/<name>` and returns that path.
///
/// `lo` is brought up inside it (Kubernetes pods expect a working loopback whatever the CNI
/// configuration). Fails with `AlreadyExists` when a live namespace is already pinned there; a
/// leftover plain file of that name (a crash between creating the file and mounting onto it) is
/// reused. On any failure nothing is left behind.
pub fn create(dir: &Path, name: &str) -> Result<PathBuf> {
    check_name(name).map_err(err("create", &dir.join(name)))?;
    let path = mount_point(dir, name, "create")?;
    let target = path.clone();
    let made = std::thread::Builder::new()
        .name("netns-create".into())
        .spawn(move || pin_new_namespace(&target))
        .map_err(err("spawn thread for", &path))?
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("namespace thread panicked")));
    if let Err(e) = made {
        // Roll back: the mount may or may not have happened.
        let _ = umount2(&path, MntFlags::MNT_DETACH);
        let _ = std::fs::remove_file(&path);
        return Err(err("create", &path)(e));
    }
    Ok(path)
}

/// Pins the existing network namespace `ns_file` (e.g. `/proc/<pid>/ns/net` of a process that
/// created it) at `<dir>/<name>` and returns that path; as [`create`], nothing is left behind
/// on failure. For pods whose network namespace must be created by the OCI runtime (inside the
/// pod's user namespace).
pub fn pin(dir: &Path, name: &str, ns_file: &Path) -> Result<PathBuf> {
    check_name(name).map_err(err("pin", &dir.join(name)))?;
    if !exists(ns_file) {
        return Err(err("pin", ns_file)(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a namespace file",
        )));
    }
    let path = mount_point(dir, name, "pin")?;
    if let Err(e) = mount(
        Some(ns_file),
        &path,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    ) {
        let _ = std::fs::remove_file(&path);
        return Err(err("pin", &path)(errno(e)));
    }
    Ok(path)
}

/// Prepares `dir` and makes `<dir>/<name>` the mount point for a namespace (`op` names the caller
/// in errors): an empty file, as `ip netns add` makes it. AlreadyExists when a live namespace is
/// pinned there; a leftover plain file (a crash between making it and mounting onto it) is reused.
fn mount_point(dir: &Path, name: &str, op: &'static str) -> Result<PathBuf> {
    prepare_dir(dir)?;
    let path = dir.join(name);
    if exists(&path) {
        return Err(err(op, &path)(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "a network namespace is already mounted there",
        )));
    }
    match OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o444)
        .open(&path)
    {
        Ok(_) => Ok(path),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(path),
        Err(e) => Err(err("create mount point", &path)(e)),
    }
}

/// Runs on its own thread, which exits afterwards: only this thread enters the new namespace.
fn pin_new_namespace(target: &Path) -> io::Result<()> {
    unshare(CloneFlags::CLONE_NEWNET).map_err(errno)?;
    // `/proc/self/ns/net` would name the thread-group leader's namespace, not this thread's.
    let own = format!("/proc/self/task/{}/ns/net", nix::unistd::gettid());
    mount(
        Some(own.as_str()),
        target,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(errno)?;
    loopback_up()
}

/// Sets IFF_UP on `lo` of the calling thread's network namespace.
fn loopback_up() -> io::Result<()> {
    use nix::libc;
    // SAFETY: plain socket/ioctl calls on a zeroed `ifreq` whose name is NUL-terminated; the
    // descriptor is owned by `OwnedFd` and closed on return.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let fd = <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd);
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        let mut req: libc::ifreq = std::mem::zeroed();
        for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
            *dst = *src as libc::c_char;
        }
        if libc::ioctl(raw, libc::SIOCGIFFLAGS as _, &mut req) < 0 {
            return Err(io::Error::last_os_error());
        }
        req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(raw, libc::SIOCSIFFLAGS as _, &req) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Unpins and deletes the namespace at `path`: lazy unmount (`MNT_DETACH`, so a process still
/// inside it keeps it until it exits), then unlink. Idempotent: success when already gone.
pub fn remove(path: &Path) -> Result<()> {
    match umount2(path, MntFlags::MNT_DETACH) {
        // EINVAL: not a mount point (already unmounted); ENOENT: no file.
        Ok(()) | Err(Errno::EINVAL) | Err(Errno::ENOENT) => {}
        Err(e) => return Err(err("unmount", path)(errno(e))),
    }
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(err("unlink", path)(e)),
    }
}

/// Whether `path` is a live, pinned network namespace (a file on nsfs), not merely a file.
pub fn exists(path: &Path) -> bool {
    statfs(path)
        .map(|s| s.filesystem_type() == NSFS_MAGIC)
        .unwrap_or(false)
}

/// Runs `f` on a dedicated thread that has joined the namespace at `path` (`setns`), and returns
/// its value. Sockets `f` creates stay in that namespace after it returns, and processes it spawns
/// start there (they inherit the thread's namespaces).
pub fn run_in<T, F>(path: &Path, f: F) -> Result<T>
where
    T: Send,
    F: FnOnce() -> T + Send,
{
    let file = File::open(path).map_err(err("open", path))?;
    if !exists(path) {
        return Err(err("join", path)(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a network namespace",
        )));
    }
    std::thread::scope(|s| {
        std::thread::Builder::new()
            .name("netns-run".into())
            .spawn_scoped(s, move || {
                setns(&file, CloneFlags::CLONE_NEWNET).map_err(errno)?;
                Ok(f())
            })
            .map_err(err("spawn thread for", path))?
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
            .map_err(err("join", path))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        for bad in ["", ".", "..", "a/b", "a\0"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        check_name("abc-123_x.y").unwrap();
    }

    #[test]
    fn plain_files_are_not_namespaces() {
        let f = tempfile::NamedTempFile::new().unwrap();
        assert!(!exists(f.path()));
        assert!(!exists(Path::new("/nonexistent/netns")));
        assert!(exists(Path::new("/proc/self/ns/net")));
    }

    #[test]
    fn pinning_an_existing_namespace() {
        if minicri_tests::prereq::skip_unless_root() {
            return;
        }
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("netns");
        let p = pin(&dir, "pinned", Path::new("/proc/self/ns/net")).unwrap();
        assert!(exists(&p));
        assert_eq!(
            std::fs::metadata(&p)
                .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
                .unwrap(),
            std::fs::metadata("/proc/self/ns/net")
                .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
                .unwrap(),
            "the same namespace"
        );
        let again = pin(&dir, "pinned", Path::new("/proc/self/ns/net")).unwrap_err();
        assert_eq!(again.source.kind(), io::ErrorKind::AlreadyExists);
        // Not a namespace: nothing is left.
        let f = tempfile::NamedTempFile::new().unwrap();
        assert!(pin(&dir, "bad", f.path()).is_err());
        assert!(!dir.join("bad").exists());
        remove(&p).unwrap();
        assert!(!p.exists());
        unmount_dir(&dir).unwrap();
    }
}

//! Small filesystem helpers of the daemon's modules: reading a file someone else wrote without
//! blocking or reading without end ([`read_regular`]), the modes of the daemon's directories
//! ([`private_layout`]), and a disk usage walk whose panic is an error ([`walk_caught`]).
//! Replacing a record durably is `minicri_snapshotter::write_atomic` (with `sync_dir`), running
//! file work from async code `minicri_store::fsutil::off_async`: one definition each.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Runs a disk usage walk, turning a panic in it (a bug) into an error about measuring `what`, so
/// the bookkeeping around the walk (a refresh flag, a measuring queue) still moves on.
pub fn walk_caught<T>(
    what: &str,
    walk: impl FnOnce() -> minicri_snapshotter::Result<T>,
) -> minicri_snapshotter::Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(walk)).unwrap_or_else(|_| {
        Err(minicri_snapshotter::Error::Io {
            context: format!("measuring {what}"),
            source: std::io::Error::other("the walk panicked (a bug: see the daemon's log)"),
        })
    })
}

/// Why [`read_regular`] returned no bytes.
#[derive(Debug)]
pub enum ReadRegularError {
    /// Nothing at the path (or a component on the way is not a directory).
    Missing,
    /// A FIFO, device, socket, directory, or (when not following) a symlink.
    NotRegular,
    /// Larger than the cap, when opened or while read: the size seen.
    TooBig(u64),
    /// What failed, and how.
    Io(&'static str, std::io::Error),
}

/// Reads the regular file at `path`, at most `max` bytes: for files that others write (an image's
/// `/etc/passwd`, a seccomp profile named in a pod spec). A FIFO would block the read forever and a
/// device such as `/dev/zero` would never end, so anything but a regular file is refused before it
/// is opened, and again on the descriptor (opened with `O_NONBLOCK`, in case the path changed in
/// between). `follow`: whether a symlink as the last component is followed.
pub fn read_regular(path: &Path, max: u64, follow: bool) -> Result<Vec<u8>, ReadRegularError> {
    use std::io::{ErrorKind, Read};
    use std::os::unix::fs::OpenOptionsExt;
    let missing =
        |e: &std::io::Error| matches!(e.kind(), ErrorKind::NotFound | ErrorKind::NotADirectory);
    let check = |m: &std::fs::Metadata| {
        if !m.is_file() {
            Err(ReadRegularError::NotRegular)
        } else if m.len() > max {
            Err(ReadRegularError::TooBig(m.len()))
        } else {
            Ok(())
        }
    };
    let stat = if follow {
        std::fs::metadata(path)
    } else {
        std::fs::symlink_metadata(path)
    };
    match stat {
        Ok(m) => check(&m)?,
        Err(e) if missing(&e) => return Err(ReadRegularError::Missing),
        Err(e) => return Err(ReadRegularError::Io("stat", e)),
    }
    let nofollow = if follow { 0 } else { libc::O_NOFOLLOW };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nofollow | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path);
    let file = match file {
        Ok(f) => f,
        Err(e) if missing(&e) => return Err(ReadRegularError::Missing),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(ReadRegularError::NotRegular);
        }
        Err(e) => return Err(ReadRegularError::Io("open", e)),
    };
    let meta = file
        .metadata()
        .map_err(|e| ReadRegularError::Io("stat", e))?;
    check(&meta)?;
    let mut b = Vec::with_capacity(meta.len() as usize);
    file.take(max + 1)
        .read_to_end(&mut b)
        .map_err(|e| ReadRegularError::Io("read", e))?;
    if b.len() as u64 > max {
        return Err(ReadRegularError::TooBig(b.len() as u64));
    }
    Ok(b)
}

/// Directories of the state directory that containers in a pod user namespace must traverse
/// (their root is an unprivileged host uid): searchable by all, not listable. Everything under
/// them that matters is in per-object directories of mode 0700 ([`private_dir`]) or harmless
/// (a sandbox's resolv.conf and hosts).
const TRAVERSED: &[&str] = &["containers", "sandboxes"];

/// The infra rootfs (the pause binary, read-only, nothing setuid): a pod user namespace's root
/// opens it as its root directory, so it is readable by all.
const INFRA: &str = "infra";

/// Gives the root and state directories their modes: the root (content, images, snapshots:
/// image files with setuid bits and device nodes) 0700; the state directory and its
/// [`TRAVERSED`] subdirectories 0711; the [`INFRA`] rootfs 0755; the other state
/// subdirectories (bundles, network namespaces, idmapped mounts, runc's state, records) 0700.
pub fn private_layout(root: &Path, state: &Path) -> anyhow::Result<()> {
    use anyhow::Context;
    let set = |p: &Path, mode: u32| -> anyhow::Result<()> {
        std::fs::create_dir_all(p).with_context(|| format!("creating {}", p.display()))?;
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode))
            .with_context(|| format!("setting the mode of {}", p.display()))
    };
    set(root, 0o700)?;
    set(state, 0o711)?;
    for d in TRAVERSED {
        set(&state.join(d), 0o711)?;
    }
    set(&state.join(INFRA), 0o755)?;
    for d in ["b", "netns", "idmap", "runc", "pods", "pulls"] {
        set(&state.join(d), 0o700)?;
    }
    Ok(())
}

/// Creates `dir` (its parent must exist) with mode 0700, owned by `owner` (uid, gid) when given:
/// the host ids of a pod user namespace's root, the only unprivileged user that may enter it.
pub fn private_dir(dir: &Path, owner: Option<(u32, u32)>) -> std::io::Result<()> {
    match std::fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(dir, Some(uid), Some(gid))?;
    }
    Ok(())
}

/// The first directory above `dir` that other users cannot search (no `o+x`), if any.
pub fn closed_ancestor(dir: &Path) -> Option<std::path::PathBuf> {
    let dir = std::fs::canonicalize(dir).ok()?;
    dir.ancestors()
        .skip(1)
        .find(|a| std::fs::metadata(a).is_ok_and(|m| m.permissions().mode() & 0o001 == 0))
        .map(Path::to_path_buf)
}

/// Writes `text` to `path` as an executable (mode 0755): the fake runtimes and tools unit tests
/// put in the daemon's way.
#[cfg(test)]
pub fn write_executable(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
    }

    /// A usage walk that panics becomes that walk's error, and the measurer can go on.
    #[test]
    fn a_panicking_usage_walk_is_an_error_naming_what_it_measured() {
        let r: minicri_snapshotter::Result<()> =
            super::walk_caught("layer abc", || panic!("a bug in the walk"));
        let e = r.unwrap_err().to_string();
        assert!(e.contains("measuring layer abc"), "{e}");
        assert!(e.contains("the walk panicked"), "{e}");
        assert_eq!(super::walk_caught("layer abc", || Ok(7)).unwrap(), 7);
    }

    #[test]
    fn the_layout_is_private_and_traversable_where_pods_need_it() {
        let d = tempfile::tempdir().unwrap();
        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let (root, state) = (d.path().join("root"), d.path().join("state"));
        std::fs::create_dir_all(state.join("b")).unwrap();
        std::fs::set_permissions(state.join("b"), std::fs::Permissions::from_mode(0o777)).unwrap();
        private_layout(&root, &state).unwrap();
        assert_eq!(mode(&root), 0o700);
        assert_eq!(mode(&state), 0o711);
        for t in TRAVERSED {
            assert_eq!(mode(&state.join(t)), 0o711, "{t}");
        }
        assert_eq!(mode(&state.join(INFRA)), 0o755);
        assert_eq!(
            mode(&state.join("b")),
            0o700,
            "an existing directory is fixed"
        );
        assert_eq!(closed_ancestor(&state), None);
        private_dir(&state.join("containers/c1"), Some((2_000_000, 2_000_000))).unwrap();
        let m = std::fs::metadata(state.join("containers/c1")).unwrap();
        assert_eq!(m.permissions().mode() & 0o7777, 0o700);
        assert_eq!(std::os::unix::fs::MetadataExt::uid(&m), 2_000_000);

        std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
        assert_eq!(
            closed_ancestor(&state),
            Some(d.path().canonicalize().unwrap())
        );
    }
}

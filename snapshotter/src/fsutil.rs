//! Low-level filesystem helpers: durable atomic file replacement ([`write_atomic`], the one every
//! record writer of the daemon uses), extended attributes, device nodes, timestamps, ownership, tree copies
//! that keep everything (owners, modes, xattrs, hardlinks, devices, times). Removal and disk usage
//! of trees a container shaped are in `tree`, re-exported here.
//!
//! Invariant: nothing here follows a symlink at the last component of a path it is given. Callers pass
//! paths whose parent components they have checked are real directories.

use std::collections::HashMap;
use std::ffi::{CString, OsStr, OsString};
use std::fs::{self, File, Metadata};
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::sys::stat::{Mode, SFlag, UtimensatFlags};
use nix::sys::time::TimeSpec;

/// The xattr overlayfs reads to tell an opaque directory.
pub(crate) const OVERLAY_OPAQUE: &str = "trusted.overlay.opaque";

/// True for xattrs that steer overlayfs itself; layers never get to set them, and they are not
/// copied between snapshots (they describe one upper directory, not file content).
pub(crate) fn is_overlay_xattr(name: &OsStr) -> bool {
    name.as_bytes().starts_with(b"trusted.overlay.")
}

fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

fn cname(name: &OsStr) -> io::Result<CString> {
    CString::new(name.as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

fn unsupported(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::ENOTSUP)
}

/// Names of the xattrs of `path` (not following a symlink). Empty on filesystems without xattrs.
pub(crate) fn list_xattrs(path: &Path) -> io::Result<Vec<OsString>> {
    let p = cpath(path)?;
    let mut buf = vec![0u8; 1024];
    loop {
        // SAFETY: p is NUL-terminated and buf is valid for buf.len() bytes.
        let n = unsafe { libc::llistxattr(p.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if n >= 0 {
            buf.truncate(n as usize);
            break;
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ERANGE) {
            buf.resize(buf.len() * 4, 0);
            continue;
        }
        if unsupported(&e) {
            return Ok(Vec::new());
        }
        return Err(e);
    }
    Ok(buf
        .split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| OsString::from_vec(s.to_vec()))
        .collect())
}

/// The value of one xattr, or None if it is not set.
pub(crate) fn get_xattr(path: &Path, name: &OsStr) -> io::Result<Option<Vec<u8>>> {
    let p = cpath(path)?;
    let n = cname(name)?;
    let mut buf = vec![0u8; 256];
    loop {
        // SAFETY: both strings are NUL-terminated and buf is valid for buf.len() bytes.
        let len =
            unsafe { libc::lgetxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if len >= 0 {
            buf.truncate(len as usize);
            return Ok(Some(buf));
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::ERANGE) => buf.resize(buf.len() * 4, 0),
            Some(libc::ENODATA) => return Ok(None),
            Some(libc::ENOTSUP) => return Ok(None),
            _ => return Err(e),
        }
    }
}

pub(crate) fn set_xattr(path: &Path, name: &OsStr, value: &[u8]) -> io::Result<()> {
    let p = cpath(path)?;
    let n = cname(name)?;
    // SAFETY: both strings are NUL-terminated and value is valid for value.len() bytes.
    let r = unsafe {
        libc::lsetxattr(
            p.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

pub(crate) fn remove_xattr(path: &Path, name: &OsStr) -> io::Result<()> {
    let p = cpath(path)?;
    let n = cname(name)?;
    // SAFETY: both strings are NUL-terminated.
    let r = unsafe { libc::lremovexattr(p.as_ptr(), n.as_ptr()) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Is this the 0/0 character device overlayfs uses as a whiteout?
pub(crate) fn is_whiteout(m: &Metadata) -> bool {
    m.file_type().is_char_device() && m.rdev() == 0
}

/// Does the open directory `dir` carry overlayfs's opaque marker?
pub(crate) fn is_opaque_fd(dir: &OwnedFd) -> io::Result<bool> {
    use std::os::fd::AsRawFd;
    let n = cname(OsStr::new(OVERLAY_OPAQUE))?;
    let mut buf = [0u8; 8];
    // SAFETY: the name is NUL-terminated and buf is valid for buf.len() bytes.
    let len = unsafe {
        libc::fgetxattr(
            dir.as_raw_fd(),
            n.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if len >= 0 {
        return Ok(&buf[..len as usize] == b"y");
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        // Absent, or longer than "y": not the marker either way.
        Some(libc::ENODATA) | Some(libc::ERANGE) | Some(libc::ENOTSUP) => Ok(false),
        _ => Err(e),
    }
}

pub(crate) fn set_opaque(path: &Path) -> io::Result<()> {
    set_xattr(path, OsStr::new(OVERLAY_OPAQUE), b"y")
}

/// Creates the overlayfs whiteout (a 0/0 character device) at `path`.
pub(crate) fn make_whiteout(path: &Path) -> io::Result<()> {
    nix::sys::stat::mknod(path, SFlag::S_IFCHR, Mode::empty(), 0).map_err(io::Error::from)
}

/// Creates a character device, block device or fifo. `kind` is one of the S_IF* bits.
pub(crate) fn make_node(path: &Path, kind: SFlag, major: u64, minor: u64) -> io::Result<()> {
    let dev = nix::sys::stat::makedev(major, minor);
    nix::sys::stat::mknod(path, kind, Mode::from_bits_truncate(0o600), dev).map_err(io::Error::from)
}

/// Opens the directory `path` (relative to `at`, or as is) without following a symlink at its last
/// component.
pub(crate) fn open_dir_nofollow(at: Option<&OwnedFd>, path: &Path) -> io::Result<OwnedFd> {
    use nix::fcntl::OFlag;
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let mode = Mode::empty();
    match at {
        Some(fd) => nix::fcntl::openat(fd, path, flags, mode),
        None => nix::fcntl::open(path, flags, mode),
    }
    .map_err(io::Error::from)
}

/// Opens the directory `rel` under the directory `root`, one component at a time, following no
/// symlink anywhere on the way. None if a component is missing, is not a directory or is a symlink.
pub(crate) fn open_beneath(root: &OwnedFd, rel: &Path) -> io::Result<Option<OwnedFd>> {
    let mut cur: Option<OwnedFd> = None;
    for c in rel.components() {
        let std::path::Component::Normal(name) = c else {
            return Ok(None);
        };
        let parent = cur.as_ref().unwrap_or(root);
        match open_dir_nofollow(Some(parent), Path::new(name)) {
            Ok(fd) => cur = Some(fd),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ENOENT | libc::ENOTDIR | libc::ELOOP)
                ) =>
            {
                return Ok(None);
            }
            Err(e) => return Err(e),
        }
    }
    match cur {
        Some(fd) => Ok(Some(fd)),
        None => root.try_clone().map(Some),
    }
}

/// Sets atime and mtime of `path` without following a symlink.
pub(crate) fn set_times(path: &Path, mtime: (i64, u32)) -> io::Result<()> {
    let ts = TimeSpec::new(mtime.0, mtime.1 as i64);
    nix::sys::stat::utimensat(
        nix::fcntl::AT_FDCWD,
        path,
        &ts,
        &ts,
        UtimensatFlags::NoFollowSymlink,
    )
    .map_err(io::Error::from)
}

pub(crate) fn mtime_of(m: &Metadata) -> (i64, u32) {
    (m.mtime(), m.mtime_nsec() as u32)
}

/// Sets the permission bits (including setuid, setgid and sticky). Never called on symlinks.
pub(crate) fn set_mode(path: &Path, mode: u32) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(mode & 0o7777))
}

/// Copies owner, mode, xattrs (except overlay's own) and times from `m`/`src` onto `dst`. Ownership
/// goes first: chown clears setuid/setgid and file capabilities.
pub(crate) fn copy_meta(src: &Path, dst: &Path, m: &Metadata) -> io::Result<()> {
    std::os::unix::fs::lchown(dst, Some(m.uid()), Some(m.gid()))?;
    if !m.file_type().is_symlink() {
        set_mode(dst, m.mode())?;
    }
    for name in list_xattrs(src)? {
        if is_overlay_xattr(&name) {
            continue;
        }
        if let Some(v) = get_xattr(src, &name)? {
            set_xattr(dst, &name, &v)?;
        }
    }
    set_times(dst, mtime_of(m))
}

/// Copies one non-directory node (file, symlink, device, fifo) with its metadata. `dst` must not exist.
pub(crate) fn copy_node(src: &Path, dst: &Path, m: &Metadata) -> io::Result<()> {
    let ft = m.file_type();
    if ft.is_symlink() {
        std::os::unix::fs::symlink(fs::read_link(src)?, dst)?;
    } else if ft.is_file() {
        let from = File::open(src)?;
        let to = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(dst)?;
        copy_sparse(&from, &to, m.len())?;
    } else {
        let kind = if ft.is_char_device() {
            SFlag::S_IFCHR
        } else if ft.is_block_device() {
            SFlag::S_IFBLK
        } else if ft.is_fifo() {
            SFlag::S_IFIFO
        } else {
            // Sockets are not part of images; skip them rather than fail a copy.
            return Ok(());
        };
        let dev = m.rdev();
        make_node(
            dst,
            kind,
            nix::sys::stat::major(dev),
            nix::sys::stat::minor(dev),
        )?;
    }
    copy_meta(src, dst, m)
}

/// Copies the file data of `from` (`len` bytes) into the empty `to`, data segment by data segment
/// (SEEK_DATA/SEEK_HOLE), so the holes of a sparse file stay holes instead of becoming written zeros.
fn copy_sparse(from: &File, to: &File, len: u64) -> io::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let (mut from, mut to) = (from, to);
    let mut pos = 0u64;
    while pos < len {
        let data = match nix::unistd::lseek(from, pos as i64, nix::unistd::Whence::SeekData) {
            Ok(off) => off as u64,
            // No data after `pos`: the rest is a hole.
            Err(nix::errno::Errno::ENXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let hole = nix::unistd::lseek(from, data as i64, nix::unistd::Whence::SeekHole)
            .map_err(io::Error::from)? as u64;
        from.seek(SeekFrom::Start(data))?;
        to.seek(SeekFrom::Start(data))?;
        // std uses copy_file_range here, which shares extents where the filesystem can.
        io::copy(&mut from.take(hole - data), &mut to)?;
        pos = hole;
    }
    to.set_len(len)
}

/// Copies the tree under `src` into the existing directory `dst`, preserving owners, modes, xattrs,
/// times, devices, and hardlinks within the tree. `dst` itself gets `src`'s metadata.
pub(crate) fn copy_tree(src: &Path, dst: &Path) -> io::Result<()> {
    let mut links = HashMap::new();
    copy_dir_contents(src, dst, &mut links)?;
    let m = fs::symlink_metadata(src)?;
    copy_meta(src, dst, &m)
}

fn copy_dir_contents(
    src: &Path,
    dst: &Path,
    links: &mut HashMap<(u64, u64), std::path::PathBuf>,
) -> io::Result<()> {
    for entry in fs::read_dir(src)? {
        let entry = entry?;
        let from = entry.path();
        let to = dst.join(entry.file_name());
        let m = fs::symlink_metadata(&from)?;
        if m.is_dir() {
            fs::create_dir(&to)?;
            copy_dir_contents(&from, &to, links)?;
            // Children first, then the directory's own metadata, so its mtime sticks.
            copy_meta(&from, &to, &m)?;
        } else if m.nlink() > 1 {
            match links.get(&(m.dev(), m.ino())) {
                Some(first) => fs::hard_link(first, &to)?,
                None => {
                    copy_node(&from, &to, &m)?;
                    links.insert((m.dev(), m.ino()), to);
                }
            }
        } else {
            copy_node(&from, &to, &m)?;
        }
    }
    Ok(())
}

/// lstat that answers None for a missing path.
pub(crate) fn lstat(path: &Path) -> io::Result<Option<Metadata>> {
    match fs::symlink_metadata(path) {
        Ok(m) => Ok(Some(m)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Writes `bytes` to `path` through a temporary file beside it (`<path>.tmp`, created with
/// `mode`), fsynced, renamed over `path`, and the directory fsynced: readers see the old contents
/// or the new, never a part, and the new contents survive a crash once this returns. The
/// temporary file is removed when a step fails. Blocking: call it off the async threads.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let result = (|| {
        let _ = std::fs::remove_file(&tmp);
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        sync_dir(path.parent().unwrap_or(Path::new(".")))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Starts writing `len` bytes of `file` from `offset` back to disk, without waiting for it
/// (`sync_file_range(SYNC_FILE_RANGE_WRITE)`): a later `syncfs` then finds them written or on
/// their way. Errors are ignored: this only moves work earlier, the `syncfs` is what makes the
/// data durable and reports a failure.
pub(crate) fn start_writeback(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain system call on a descriptor `file` keeps open; no memory is passed.
    unsafe {
        libc::sync_file_range(
            file.as_raw_fd(),
            offset as libc::off64_t,
            len as libc::off64_t,
            libc::SYNC_FILE_RANGE_WRITE,
        );
    }
}

/// Makes a directory's entries (a rename, a removal) durable.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    let dir = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn replaces_whole_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("rec.json");
        write_atomic(&p, b"first", 0o600).unwrap();
        write_atomic(&p, b"second", 0o600).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"second");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("rec.json")]);
        // A directory in the way: the error is returned and no temporary stays.
        let blocked = dir.path().join("sub");
        std::fs::create_dir(&blocked).unwrap();
        std::fs::write(blocked.join("x"), b"").unwrap();
        assert!(write_atomic(&blocked, b"x", 0o600).is_err());
        assert!(!dir.path().join("sub.tmp").exists());
    }

    #[test]
    fn creates_with_the_mode_asked_for() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("secret.json");
        write_atomic(&p, b"{}", 0o600).unwrap();
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        // A stale temporary with a wider mode is not reused.
        let tmp = dir.path().join("open.json.tmp");
        std::fs::write(&tmp, b"old").unwrap();
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o666)).unwrap();
        write_atomic(&dir.path().join("open.json"), b"{}", 0o600).unwrap();
        assert_eq!(
            std::fs::metadata(dir.path().join("open.json"))
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o600
        );
    }

    #[test]
    fn copy_tree_keeps_links_modes_xattrs_and_times() {
        let t = tempfile::tempdir().unwrap();
        let src = t.path().join("src");
        let dst = t.path().join("dst");
        fs::create_dir_all(src.join("d")).unwrap();
        fs::write(src.join("d/f"), b"data").unwrap();
        fs::hard_link(src.join("d/f"), src.join("g")).unwrap();
        std::os::unix::fs::symlink("d/f", src.join("s")).unwrap();
        set_mode(&src.join("d/f"), 0o4751).unwrap();
        set_xattr(&src.join("d/f"), OsStr::new("user.k"), b"v").unwrap();
        make_node(&src.join("fifo"), SFlag::S_IFIFO, 0, 0).unwrap();
        set_times(&src.join("d"), (1_000_000, 5)).unwrap();
        fs::create_dir(&dst).unwrap();
        copy_tree(&src, &dst).unwrap();
        let f = fs::symlink_metadata(dst.join("d/f")).unwrap();
        let g = fs::symlink_metadata(dst.join("g")).unwrap();
        assert_eq!(f.ino(), g.ino());
        assert_eq!(f.mode() & 0o7777, 0o4751);
        assert_eq!(
            get_xattr(&dst.join("d/f"), OsStr::new("user.k"))
                .unwrap()
                .unwrap(),
            b"v"
        );
        assert_eq!(fs::read_link(dst.join("s")).unwrap(), Path::new("d/f"));
        assert!(
            fs::symlink_metadata(dst.join("fifo"))
                .unwrap()
                .file_type()
                .is_fifo()
        );
        assert_eq!(
            mtime_of(&fs::symlink_metadata(dst.join("d")).unwrap()),
            (1_000_000, 5)
        );
        // Nothing more was made: dst, d, d/f (=g), s, fifo.
        let mut inodes =
            std::collections::BTreeSet::from([fs::symlink_metadata(&dst).unwrap().ino()]);
        for dir in [dst.clone(), dst.join("d")] {
            for e in fs::read_dir(dir).unwrap() {
                inodes.insert(e.unwrap().metadata().unwrap().ino());
            }
        }
        assert_eq!(inodes.len(), 5);
    }
}

//! Walking directory trees that containers shaped: measuring one ([`disk_usage`]) and removing one
//! ([`remove_all`]).
//!
//! A container can make a chain of directories millions deep (each `mkdir` relative to the last,
//! so no path is ever longer than `PATH_MAX`) and millions of entries wide. Both walks here are
//! loops, never recursion (a blocking thread has a 2 MiB stack), keep at most [`OPEN_DIRS`]
//! directories open, and hold a few words per level of depth: never a path per directory. Nothing
//! follows a symlink.

use std::collections::HashSet;
use std::ffi::{CStr, CString};
use std::fs;
use std::io;
use std::os::fd::{BorrowedFd, FromRawFd, IntoRawFd, OwnedFd};
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, RenameFlags};
use nix::sys::stat::{FileStat, Mode, SFlag, fstat, fstatat};
use nix::unistd::UnlinkatFlags;

use crate::fsutil::open_dir_nofollow;

/// Directories a walk keeps open at once.
pub(crate) const OPEN_DIRS: usize = 64;

/// A directory stream that can say where it is and be put back there (`telldir`, `seekdir`), so a
/// walk can close it while it is deep below and go on from the same entry when it comes back.
struct DirStream(std::ptr::NonNull<libc::DIR>);

impl DirStream {
    fn new(fd: OwnedFd) -> io::Result<DirStream> {
        let raw = fd.into_raw_fd();
        // SAFETY: `raw` is an open descriptor this function owns; on success the stream owns it.
        match std::ptr::NonNull::new(unsafe { libc::fdopendir(raw) }) {
            Some(p) => Ok(DirStream(p)),
            None => {
                let e = io::Error::last_os_error();
                // SAFETY: fdopendir failed, so the descriptor is still ours, and closed once here.
                drop(unsafe { OwnedFd::from_raw_fd(raw) });
                Err(e)
            }
        }
    }

    fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the stream's descriptor is open for as long as the stream.
        unsafe { BorrowedFd::borrow_raw(libc::dirfd(self.0.as_ptr())) }
    }

    /// The next entry's name, `.` and `..` left out; None at the end.
    fn next_name(&mut self) -> Option<io::Result<CString>> {
        loop {
            Errno::clear();
            // SAFETY: the stream is open; the entry returned is copied before the next call.
            let e = unsafe { libc::readdir(self.0.as_ptr()) };
            if e.is_null() {
                return match Errno::last_raw() {
                    0 => None,
                    n => Some(Err(io::Error::from_raw_os_error(n))),
                };
            }
            // SAFETY: readdir returned a valid entry; its name is NUL-terminated.
            let name = unsafe { CStr::from_ptr((*e).d_name.as_ptr()) };
            if name != c"." && name != c".." {
                return Some(Ok(name.to_owned()));
            }
        }
    }

    fn tell(&self) -> libc::c_long {
        // SAFETY: the stream is open.
        unsafe { libc::telldir(self.0.as_ptr()) }
    }

    fn seek(&mut self, pos: libc::c_long) {
        // SAFETY: the stream is open and `pos` came from `tell` on the same directory.
        unsafe { libc::seekdir(self.0.as_ptr(), pos) }
    }
}

impl Drop for DirStream {
    fn drop(&mut self) {
        // SAFETY: the stream is open and not used after this.
        unsafe { libc::closedir(self.0.as_ptr()) };
    }
}

fn is_dir(st: &FileStat) -> bool {
    SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR
}

/// Gone, or replaced by something that is not a directory, since it was listed.
fn vanished(e: Errno) -> bool {
    matches!(e, Errno::ENOENT | Errno::ENOTDIR | Errno::ELOOP)
}

fn open_child(at: BorrowedFd<'_>, name: &CStr) -> nix::Result<OwnedFd> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    nix::fcntl::openat(at, name, flags, Mode::empty())
}

/// Disk space and inodes a directory tree takes. Hardlinked files count once.
///
/// The tree may be a container's writable layer, shaped by whatever runs there while it is
/// measured. Directories are read as they are walked, one entry at a time. Past [`OPEN_DIRS`]
/// levels the shallowest open level (below `root`, which stays open) is closed, remembering its
/// position, and reopened through the `..` of its child when the walk comes back up; the reopened
/// directory must be the one that was closed (same device and inode). One moved away meanwhile
/// ends the walk of the levels between it and `root`, which then goes on. What disappears or is
/// replaced during the walk is skipped, so a tree that changes while it is measured may come out
/// smaller than it is.
pub(crate) fn disk_usage(root: &Path) -> io::Result<(u64, u64)> {
    /// A directory on the walk's path: its stream (None while closed), where the stream was when
    /// it was closed, and which directory it is.
    struct Level {
        dir: Option<DirStream>,
        pos: libc::c_long,
        dev: u64,
        ino: u64,
    }
    let mut seen = HashSet::new();
    let mut bytes = 0u64;
    let mut inodes = 0u64;
    let mut count = |st: &FileStat| {
        if st.st_nlink > 1 && !is_dir(st) && !seen.insert((st.st_dev, st.st_ino)) {
            return;
        }
        inodes += 1;
        bytes += st.st_blocks as u64 * 512;
    };
    let st = match nix::sys::stat::lstat(root) {
        Ok(st) => st,
        Err(Errno::ENOENT) => return Ok((0, 0)),
        Err(e) => return Err(e.into()),
    };
    count(&st);
    if !is_dir(&st) {
        return Ok((bytes, inodes));
    }
    let mut levels = vec![Level {
        dir: Some(DirStream::new(open_dir_nofollow(None, root)?)?),
        pos: 0,
        dev: st.st_dev,
        ino: st.st_ino,
    }];
    // levels[0] (`root`) is always open, levels[1..first_open] are closed, the rest are open.
    let mut first_open = 1;
    while let Some(top) = levels.last_mut() {
        let dir = top.dir.as_mut().expect("the deepest level is open");
        let name = match dir.next_name() {
            Some(Ok(name)) => name,
            Some(Err(e)) => return Err(e),
            None => {
                let done = levels.pop().expect("a level");
                let Some(parent) = levels.len().checked_sub(1) else {
                    break;
                };
                if parent >= first_open || parent == 0 {
                    continue;
                }
                first_open = parent;
                let done = done.dir.expect("the deepest level is open");
                let up = match nix::fcntl::openat(
                    done.fd(),
                    c"..",
                    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
                    Mode::empty(),
                ) {
                    Ok(fd) => Some(fd),
                    Err(e) if vanished(e) => None,
                    Err(e) => return Err(e.into()),
                };
                let l = &mut levels[parent];
                match up.map(|fd| (fstat(&fd), fd)) {
                    Some((Ok(st), fd)) if (st.st_dev, st.st_ino) == (l.dev, l.ino) => {
                        let mut d = DirStream::new(fd)?;
                        d.seek(l.pos);
                        l.dir = Some(d);
                    }
                    Some((Err(e), _)) if !vanished(e) => return Err(e.into()),
                    // Moved away while closed: what it had left is out of reach.
                    _ => {
                        levels.truncate(1);
                        first_open = 1;
                    }
                }
                continue;
            }
        };
        let st = match fstatat(dir.fd(), name.as_c_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(e) if vanished(e) => continue,
            Err(e) => return Err(e.into()),
        };
        count(&st);
        if !is_dir(&st) {
            continue;
        }
        let child = match open_child(dir.fd(), &name) {
            Ok(fd) => DirStream::new(fd)?,
            Err(e) if vanished(e) => continue,
            Err(e) => return Err(e.into()),
        };
        // Open: `root` and levels[first_open..]; the child makes one more.
        if 1 + (levels.len() - first_open) + 1 > OPEN_DIRS {
            let l = &mut levels[first_open];
            l.pos = l.dir.take().expect("an open level").tell();
            first_open += 1;
        }
        levels.push(Level {
            dir: Some(child),
            pos: 0,
            dev: st.st_dev,
            ino: st.st_ino,
        });
    }
    Ok((bytes, inodes))
}

/// Removes `path` whatever it is (a directory with everything in it), without following
/// symlinks. Missing paths are fine.
///
/// Directories more than [`OPEN_DIRS`] levels down are moved up into `path` itself (under fresh
/// names) and emptied from there, so however deep the tree, the walk keeps at most that many
/// directories open and never recurses.
pub(crate) fn remove_all(path: &Path) -> io::Result<()> {
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
        Ok(m) if m.is_dir() => {
            let root = open_dir_nofollow(None, path)?;
            let mut moved = 0u64;
            // A directory moved up after the listing of `path` went past its new name waits
            // for the next pass.
            while empty_pass(&root, &mut moved)? {}
            match fs::remove_dir(path) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                r => r,
            }
        }
        Ok(_) => fs::remove_file(path),
    }
}

/// One pass over the tree under `root`, removing everything it meets. True if `root` still has
/// entries afterwards (and this pass removed something, so another one makes progress).
fn empty_pass(root: &OwnedFd, moved: &mut u64) -> io::Result<bool> {
    // A directory being emptied, and its name in its parent (empty for `root`).
    let mut levels = vec![(
        DirStream::new(open_dir_nofollow(Some(root), Path::new("."))?)?,
        CString::default(),
    )];
    let mut progress = false;
    while let Some(depth) = levels.len().checked_sub(1) {
        let dir = &mut levels[depth].0;
        let name = match dir.next_name() {
            Some(Ok(name)) => name,
            Some(Err(e)) => return Err(e),
            None => {
                let (done, name) = levels.pop().expect("a level");
                drop(done);
                if let Some((parent, _)) = levels.last() {
                    match nix::unistd::unlinkat(
                        parent.fd(),
                        name.as_c_str(),
                        UnlinkatFlags::RemoveDir,
                    ) {
                        Ok(()) => progress = true,
                        // Not empty: an entry the listing missed; the next pass gets it.
                        Err(Errno::ENOENT | Errno::ENOTEMPTY) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
                continue;
            }
        };
        match nix::unistd::unlinkat(dir.fd(), name.as_c_str(), UnlinkatFlags::NoRemoveDir) {
            Ok(()) => {
                progress = true;
                continue;
            }
            Err(Errno::ENOENT) => continue,
            // Linux answers EISDIR for a directory (POSIX allows EPERM).
            Err(e @ (Errno::EISDIR | Errno::EPERM)) => {
                match fstatat(dir.fd(), name.as_c_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
                    Ok(st) if is_dir(&st) => {}
                    _ => return Err(e.into()),
                }
            }
            Err(e) => return Err(e.into()),
        }
        if depth + 1 < OPEN_DIRS {
            match open_child(dir.fd(), &name) {
                Ok(fd) => levels.push((DirStream::new(fd)?, name)),
                Err(Errno::ENOENT) => {}
                Err(e) => return Err(e.into()),
            }
            continue;
        }
        // Too deep to open: up into `root`, under a name nothing there has.
        loop {
            let fresh = CString::new(format!(".minicri-deep-{moved}")).expect("no NUL");
            *moved += 1;
            match nix::fcntl::renameat2(
                dir.fd(),
                name.as_c_str(),
                root,
                fresh.as_c_str(),
                RenameFlags::RENAME_NOREPLACE,
            ) {
                Ok(()) => {
                    progress = true;
                    break;
                }
                Err(Errno::EEXIST) => continue,
                Err(e) => return Err(e.into()),
            }
        }
    }
    let mut rest = DirStream::new(open_dir_nofollow(Some(root), Path::new("."))?)?;
    match rest.next_name() {
        None => Ok(false),
        Some(Err(e)) => Err(e),
        Some(Ok(_)) if progress => Ok(true),
        Some(Ok(name)) => Err(io::Error::other(format!(
            "{} stays after a pass that removed nothing",
            name.to_string_lossy()
        ))),
    }
}

/// Deletes snapshot data directories already moved aside (by `LocalSnapshotter::collect`),
/// logging what cannot be removed: the next start empties `tmp/` again.
pub(crate) fn empty_trash(trash: Vec<std::path::PathBuf>) {
    for d in trash {
        if let Err(e) = remove_all(&d) {
            tracing::warn!(dir = %d.display(), error = %e, "removing snapshot data");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Makes a chain of `depth` directories named `name` under `root` as a container does (each
    /// `mkdir` relative to the last, so no path is ever longer than `PATH_MAX`), calling `each`
    /// in every directory of it, and returns the bottom one.
    fn chain(root: &Path, name: &str, depth: usize, mut each: impl FnMut(&OwnedFd)) -> OwnedFd {
        let mut dir = open_dir_nofollow(None, root).unwrap();
        for _ in 0..depth {
            nix::sys::stat::mkdirat(&dir, name, Mode::from_bits_truncate(0o755)).unwrap();
            dir = open_dir_nofollow(Some(&dir), Path::new(name)).unwrap();
            each(&dir);
        }
        dir
    }

    fn create_file(at: &OwnedFd, name: &str, data: &[u8]) {
        let f = nix::fcntl::openat(
            at,
            name,
            OFlag::O_CREAT | OFlag::O_WRONLY | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o644),
        )
        .unwrap();
        nix::unistd::write(&f, data).unwrap();
    }

    /// A temporary directory for trees of tens of thousands of directories: on tmpfs if there is
    /// one, since each `rmdir` on a disk mounted with `discard` can take milliseconds.
    fn big_tempdir() -> tempfile::TempDir {
        tempfile::tempdir_in("/dev/shm").unwrap_or_else(|_| tempfile::tempdir().unwrap())
    }

    /// Counts, per thread, the bytes allocated and not yet freed, and their peak.
    struct Counting;

    thread_local! {
        static LIVE: std::cell::Cell<isize> = const { std::cell::Cell::new(0) };
        static PEAK: std::cell::Cell<isize> = const { std::cell::Cell::new(0) };
    }

    // SAFETY: every call goes to the system allocator unchanged; the counters only look.
    unsafe impl std::alloc::GlobalAlloc for Counting {
        unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
            let _ = LIVE.try_with(|c| {
                let v = c.get() + l.size() as isize;
                c.set(v);
                let _ = PEAK.try_with(|p| p.set(p.get().max(v)));
            });
            // SAFETY: as the caller promised for `l`.
            unsafe { std::alloc::System.alloc(l) }
        }

        unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
            let _ = LIVE.try_with(|c| c.set(c.get() - l.size() as isize));
            // SAFETY: `p` came from `alloc` with `l`.
            unsafe { std::alloc::System.dealloc(p, l) }
        }
    }

    #[global_allocator]
    static ALLOCATOR: Counting = Counting;

    /// Runs `f` on a thread with a small stack (a recursive walk would overflow it), failing
    /// if it takes longer than `secs` (a walk that reopens each deep directory from the top
    /// would).
    fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(move || tx.send(f()))
            .unwrap();
        rx.recv_timeout(std::time::Duration::from_secs(secs))
            .expect("the walk finished in time")
    }

    /// A chain deeper than the directories kept open, and a wide directory at its bottom: every
    /// inode counted once.
    #[test]
    fn disk_usage_walks_deep_and_wide_trees() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("layer");
        let mut deep = root.clone();
        for _ in 0..(OPEN_DIRS * 3) {
            deep.push("d");
        }
        fs::create_dir_all(&deep).unwrap();
        for i in 0..1000 {
            fs::write(deep.join(format!("f{i}")), b"").unwrap();
        }
        fs::create_dir(deep.join("sub")).unwrap();
        fs::write(deep.join("sub/x"), b"x").unwrap();
        fs::hard_link(deep.join("sub/x"), root.join("link")).unwrap();
        std::os::unix::fs::symlink("/", root.join("to-root")).unwrap();
        let (bytes, inodes) = disk_usage(&root).unwrap();
        // root, 192 directories, 1000 files, sub, x (and its link once), the symlink.
        assert_eq!(inodes, 1 + (OPEN_DIRS as u64 * 3) + 1000 + 2 + 1);
        assert!(bytes > 0);
        assert_eq!(disk_usage(&t.path().join("absent")).unwrap(), (0, 0));
    }

    /// A chain of directories whose path is longer than `PATH_MAX`, made as a container makes
    /// one (each `mkdir` relative to the last): every directory and the file at the bottom are
    /// counted.
    #[test]
    fn disk_usage_measures_a_tree_deeper_than_path_max() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("layer");
        fs::create_dir(&root).unwrap();
        let name = "d".repeat(20);
        let depth = 500; // 21 bytes a level: over 10,000 bytes of path
        let mut dir = open_dir_nofollow(None, &root).unwrap();
        for _ in 0..depth {
            nix::sys::stat::mkdirat(&dir, name.as_str(), Mode::from_bits_truncate(0o755)).unwrap();
            dir = open_dir_nofollow(Some(&dir), Path::new(&name)).unwrap();
        }
        let f = nix::fcntl::openat(
            &dir,
            "f",
            nix::fcntl::OFlag::O_CREAT | nix::fcntl::OFlag::O_WRONLY,
            Mode::from_bits_truncate(0o644),
        )
        .unwrap();
        drop(f);
        let (bytes, inodes) = disk_usage(&root).unwrap();
        assert_eq!(inodes, 1 + depth + 1);
        assert!(bytes > 0);
    }

    /// At every level of a chain deeper than the directories kept open, entries before and after
    /// the next level's directory (a file, a directory holding a file, another file): the walk
    /// comes back up through closed levels and counts each entry exactly once.
    #[test]
    fn disk_usage_goes_on_where_it_left_each_level() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("layer");
        fs::create_dir(&root).unwrap();
        let depth = OPEN_DIRS * 4;
        chain(&root, "m", depth, |d| {
            create_file(d, "a", b"");
            nix::sys::stat::mkdirat(d, "s", Mode::from_bits_truncate(0o755)).unwrap();
            create_file(
                &open_dir_nofollow(Some(d), Path::new("s")).unwrap(),
                "f",
                b"f",
            );
            create_file(d, "z", b"");
        });
        let (_, inodes) = disk_usage(&root).unwrap();
        assert_eq!(inodes, 1 + depth as u64 * 5);
    }

    /// A chain 1,023 deep of 255-byte names, and 1,000 directories at its bottom. Measuring it
    /// holds memory for the levels, not a path for each directory met below the open ones. (The
    /// walk before this one kept 64 levels open and set aside what lay below them as paths, then
    /// went on from each of those 64 levels at a time: at depth 64 × 16 = 1,024 it kept each of
    /// these directories as its path, 1,000 paths of 262 KB.)
    #[test]
    fn disk_usage_holds_memory_for_the_depth_not_a_path_per_directory() {
        let t = big_tempdir();
        let root = t.path().join("layer");
        fs::create_dir(&root).unwrap();
        let bottom = chain(&root, &"d".repeat(255), 1023, |_| {});
        for i in 0..1000 {
            nix::sys::stat::mkdirat(&bottom, format!("w{i}").as_str(), Mode::S_IRWXU).unwrap();
        }
        drop(bottom);
        let r = root.clone();
        let (inodes, peak) = within(60, move || {
            let (_, inodes) = disk_usage(&r).unwrap();
            (inodes, PEAK.with(|p| p.get()))
        });
        assert_eq!(inodes, 1 + 1023 + 1000);
        assert!(peak < 1 << 20, "measuring held {peak} bytes at its peak");
        within(60, move || remove_all(&root).unwrap());
    }

    /// 30,000 levels (a few seconds of `mkdir` for a container) and a file at the bottom:
    /// measured exactly, on a small stack, with fewer descriptors than levels.
    #[test]
    fn disk_usage_of_a_chain_thirty_thousand_deep() {
        let t = big_tempdir();
        let root = t.path().join("layer");
        fs::create_dir(&root).unwrap();
        let depth = 30_000;
        let bottom = chain(&root, "d", depth, |_| {});
        create_file(&bottom, "f", b"x");
        drop(bottom);
        let r = root.clone();
        let (_, inodes) = within(60, move || disk_usage(&r).unwrap());
        assert_eq!(inodes, 1 + depth as u64 + 1);
        within(60, move || remove_all(&root).unwrap());
    }

    /// A chain 30,000 deep, wide directories along it, and a symlink to a directory outside:
    /// everything goes, on a small stack and with at most [`OPEN_DIRS`] directories open (std's
    /// `remove_dir_all` recurses, one open directory per level), and nothing outside is touched.
    #[test]
    fn remove_all_removes_a_chain_thirty_thousand_deep() {
        let t = big_tempdir();
        let outside = t.path().join("outside");
        fs::create_dir(&outside).unwrap();
        fs::write(outside.join("keep"), b"keep").unwrap();
        let root = t.path().join("layer");
        fs::create_dir(&root).unwrap();
        let mut level = 0;
        let bottom = chain(&root, "d", 30_000, |d| {
            level += 1;
            if level % 1000 == 0 {
                for i in 0..100 {
                    create_file(d, &format!("f{i}"), b"");
                }
                nix::unistd::symlinkat(&outside, d, "out").unwrap();
            }
        });
        create_file(&bottom, "f", b"x");
        drop(bottom);
        // A name a move up would pick is taken already.
        fs::create_dir(root.join(".minicri-deep-0")).unwrap();
        let r = root.clone();
        within(60, move || remove_all(&r).unwrap());
        assert!(!root.exists());
        assert_eq!(fs::read(outside.join("keep")).unwrap(), b"keep");
        remove_all(&t.path().join("absent")).unwrap();
        let file = t.path().join("file");
        fs::write(&file, b"").unwrap();
        remove_all(&file).unwrap();
        assert!(!file.exists());
    }
}

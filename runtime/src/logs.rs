//! CRI container log files: where a container's log goes, opening it beneath the pod's log
//! directory, and writing entries to it.
//!
//! The line format itself (timestamp, stream, `P`/`F` tag, content; splitting output into
//! entries; parsing) is `minicri_codecs::crilog`, sans I/O so the fuzz targets build it without
//! the daemon; it is re-exported here, where the daemon and its tests use it.
//!
//! Invariants: every entry is produced by one `write(2)` on an `O_APPEND` file, so the two
//! streams' entries never interleave inside a line; [`CriLogFile::reopen`] opens the path afresh
//! (the kubelet renames the old file first when it rotates logs).

use std::ffi::{CString, OsStr};
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use chrono::Utc;

pub use minicri_codecs::crilog::{
    DEFAULT_MAX_LINE, LineSplitter, LogEntry, Stream, format_entry, parse_entry, reassemble,
    rfc3339_nano,
};

/// Where a container's log goes: `log_path` under the sandbox's `log_directory` (CRI), `None`
/// when either is empty. Both come from the pod's writer: the directory must be absolute and
/// the path relative, with no `..` or `.` components, so the log stays inside the directory.
pub fn container_log_path(log_directory: &str, log_path: &str) -> Result<Option<PathBuf>, String> {
    use std::path::Component;
    if log_directory.is_empty() || log_path.is_empty() {
        return Ok(None);
    }
    let dir = Path::new(log_directory);
    if !dir.is_absolute() || dir.components().any(|c| c == Component::ParentDir) {
        return Err(format!(
            "log_directory {log_directory:?} is not an absolute path without '..'"
        ));
    }
    let rel = Path::new(log_path);
    if log_path.contains('\0') || !rel.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err(format!(
            "log_path {log_path:?} is not a relative path inside log_directory (no '/', '..' or '.' components)"
        ));
    }
    Ok(Some(dir.join(rel)))
}

/// The log file of one container, shared by its stdout and stderr pumps (wrap it in a mutex).
#[derive(Debug)]
pub struct CriLogFile {
    /// The pod's log directory, which the path lies in.
    root: PathBuf,
    path: PathBuf,
    file: File,
    scratch: Vec<u8>,
}

/// The directory of `path`, which lies in `root`, walked from `root` one component at a time
/// without following a symlink and created where missing (0755 before the umask); and the
/// file's name in it. The daemon and the shims write logs as root: whoever can write into the
/// pod's log directory (a pod with a hostPath on /var/log) could otherwise make a directory of
/// the log's path a symlink to anywhere on the host, and have the container's output appended
/// to a file created there.
fn dir_beneath<'p>(root: &Path, path: &'p Path) -> io::Result<(OwnedFd, &'p OsStr)> {
    use std::path::Component;
    let outside = || {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a file inside {}", path.display(), root.display()),
        )
    };
    let rel = path.strip_prefix(root).map_err(|_| outside())?;
    let mut names = rel
        .components()
        .map(|c| match c {
            Component::Normal(n) => Ok(n),
            _ => Err(outside()),
        })
        .collect::<io::Result<Vec<_>>>()?;
    let name = names.pop().ok_or_else(outside)?;
    let mut dir = OwnedFd::from(
        OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
            .open(root)?,
    );
    for n in names {
        let c = c_name(n)?;
        // SAFETY: a valid descriptor and a NUL-terminated name.
        if unsafe { libc::mkdirat(dir.as_raw_fd(), c.as_ptr(), 0o755) } != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EEXIST) {
                return Err(e);
            }
        }
        let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
        // SAFETY: as above; the descriptor returned is owned here.
        let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags) };
        if fd < 0 {
            let e = io::Error::last_os_error();
            // O_DIRECTORY answers a symlink with ENOTDIR: say what it is.
            if e.raw_os_error() == Some(libc::ENOTDIR)
                && file_type_at(&dir, &c) == Some(libc::S_IFLNK)
            {
                return Err(io::Error::from_raw_os_error(libc::ELOOP));
            }
            return Err(e);
        }
        // SAFETY: `fd` was just opened and nothing else owns it.
        dir = unsafe { OwnedFd::from_raw_fd(fd) };
    }
    Ok((dir, name))
}

/// The type bits (`S_IFMT`) of `name` in `dir`, not following a symlink; `None` when it is
/// not there.
fn file_type_at(dir: &OwnedFd, name: &CString) -> Option<libc::mode_t> {
    // SAFETY: a zeroed stat is a valid out-parameter; the descriptor and name are valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    let flags = libc::AT_SYMLINK_NOFOLLOW;
    let r = unsafe { libc::fstatat(dir.as_raw_fd(), name.as_ptr(), &mut st, flags) };
    (r == 0).then_some(st.st_mode & libc::S_IFMT)
}

fn c_name(n: &OsStr) -> io::Result<CString> {
    CString::new(n.as_bytes()).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
}

/// Creates the directories between `root` and the log at `path` as [`CriLogFile::open`] would,
/// without opening the log. The pod's log directory `root` is created first if it is missing
/// (0755 before the umask): the kubelet makes it before RunPodSandbox, but an operator running
/// pods with crictl names one that may not exist yet. It is the caller's (the kubelet's) path,
/// so symlinks in it are followed as they would be for the kubelet.
pub fn create_log_dirs(root: &Path, path: &Path) -> io::Result<()> {
    if !root.exists() {
        std::fs::create_dir_all(root)?;
    }
    dir_beneath(root, path).map(drop)
}

/// Opens the log at `path` (in `root`, see [`dir_beneath`]) for appending; a symlink in the
/// log's place is not followed either (`ELOOP`), and anything but a regular file there is
/// refused without blocking on it: opening a FIFO for writing waits for a reader, which froze the
/// container's output (the shim holds the log's lock while it reopens) and StartContainer.
fn open_log(root: &Path, path: &Path) -> io::Result<File> {
    let not_regular = || io::Error::other(format!("{} is not a regular file", path.display()));
    let (dir, name) = dir_beneath(root, path)?;
    let c = c_name(name)?;
    match file_type_at(&dir, &c) {
        Some(libc::S_IFLNK) => return Err(io::Error::from_raw_os_error(libc::ELOOP)),
        None | Some(libc::S_IFREG) => {}
        Some(_) => return Err(not_regular()),
    }
    let flags = libc::O_WRONLY
        | libc::O_CREAT
        | libc::O_APPEND
        | libc::O_NOFOLLOW
        | libc::O_CLOEXEC
        | libc::O_NONBLOCK;
    // SAFETY: as above; the descriptor returned is owned by the File.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags, 0o640 as libc::c_uint) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and nothing else owns it.
    let file = unsafe { File::from_raw_fd(fd) };
    // Replaced between the check and the open.
    if !file.metadata()?.is_file() {
        return Err(not_regular());
    }
    Ok(file)
}

impl CriLogFile {
    /// Opens (creating if needed) the log at `path`, in the pod's log directory `root`, for
    /// appending.
    pub fn open(root: &Path, path: &Path) -> io::Result<Self> {
        Ok(CriLogFile {
            root: root.to_path_buf(),
            path: path.to_path_buf(),
            file: open_log(root, path)?,
            scratch: Vec::new(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens the path again: after a rename by the kubelet's log rotation, entries go to a new
    /// file. On failure the old file stays in use.
    pub fn reopen(&mut self) -> io::Result<()> {
        self.file = open_log(&self.root, &self.path)?;
        Ok(())
    }

    /// Writes one entry, timestamped now, in a single write.
    pub fn write_entry(&mut self, stream: Stream, partial: bool, content: &[u8]) -> io::Result<()> {
        self.scratch.clear();
        format_entry(&mut self.scratch, Utc::now(), stream, partial, content);
        self.file.write_all(&self.scratch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_paths_stay_inside_the_log_directory() {
        let ok = container_log_path("/var/log/pods/ns_p_u", "app/0.log").unwrap();
        assert_eq!(ok, Some(PathBuf::from("/var/log/pods/ns_p_u/app/0.log")));
        assert_eq!(container_log_path("", "app/0.log").unwrap(), None);
        assert_eq!(container_log_path("/var/log/pods/x", "").unwrap(), None);
        for bad in [
            "../../etc/cron.d/x",
            "/etc/passwd",
            "app/../../x",
            "./x",
            "a\0b",
        ] {
            let e = container_log_path("/var/log/pods/x", bad).unwrap_err();
            assert!(e.contains("log_path"), "{bad}: {e}");
        }
        for bad in ["relative/dir", "/var/log/../etc"] {
            let e = container_log_path(bad, "a.log").unwrap_err();
            assert!(e.contains("log_directory"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_symlink_in_the_logs_place_is_not_followed() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("host-file");
        std::fs::write(&target, "precious\n").unwrap();
        let log = d.path().join("0.log");
        std::os::unix::fs::symlink(&target, &log).unwrap();
        let e = CriLogFile::open(d.path(), &log).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ELOOP), "{e}");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "precious\n");
    }

    /// A pod log directory that does not exist yet (crictl, not the kubelet, made the pod) is
    /// created with the log's own directories.
    #[test]
    fn a_missing_pod_log_directory_is_created() {
        let d = tempfile::tempdir().unwrap();
        let pod = d.path().join("logs/pod");
        create_log_dirs(&pod, &pod.join("app/0.log")).unwrap();
        assert!(pod.join("app").is_dir());
        let mut f = CriLogFile::open(&pod, &pod.join("app/0.log")).unwrap();
        f.write_entry(Stream::Stdout, false, b"hi").unwrap();
    }

    /// No directory between the pod's log directory and the log is followed if it is a symlink
    /// (a pod writing into the log directory could point one at any host directory); the log
    /// directory itself may be one.
    #[test]
    fn no_symlink_below_the_log_directory_is_followed() {
        let d = tempfile::tempdir().unwrap();
        let pod = d.path().join("pod");
        let host = d.path().join("host-etc");
        std::fs::create_dir_all(&pod).unwrap();
        std::fs::create_dir_all(&host).unwrap();
        std::os::unix::fs::symlink(&host, pod.join("app")).unwrap();
        let log = pod.join("app/0.log");
        let e = CriLogFile::open(&pod, &log).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ELOOP), "{e}");
        assert_eq!(
            create_log_dirs(&pod, &pod.join("app/deeper/0.log"))
                .unwrap_err()
                .raw_os_error(),
            Some(libc::ELOOP)
        );
        assert_eq!(
            std::fs::read_dir(&host).unwrap().count(),
            0,
            "wrote into the host's"
        );
        // Directories are made as needed; a symlinked log directory is fine.
        let linked = d.path().join("linked-pod");
        std::os::unix::fs::symlink(&pod, &linked).unwrap();
        let mut f = CriLogFile::open(&linked, &linked.join("web/1/0.log")).unwrap();
        f.write_entry(Stream::Stdout, false, b"hi").unwrap();
        assert!(pod.join("web/1/0.log").is_file());
        // Only paths inside the directory.
        for outside in ["/etc/passwd", "/tmp"] {
            let e = CriLogFile::open(&pod, Path::new(outside)).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{outside}: {e}");
        }
    }

    #[test]
    fn a_fifo_or_device_in_the_logs_place_is_refused_without_blocking() {
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("0.log");
        let mut f = CriLogFile::open(d.path(), &log).unwrap();
        // The kubelet's rotation renames the log; a FIFO appears in its place.
        std::fs::rename(&log, d.path().join("0.log.1")).unwrap();
        nix::unistd::mkfifo(&log, nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap();
        let t = std::time::Instant::now();
        let e = f.reopen().unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        assert!(CriLogFile::open(d.path(), &log).is_err());
        assert!(t.elapsed() < std::time::Duration::from_secs(1));
        // The old file stays in use.
        f.write_entry(Stream::Stdout, false, b"still here").unwrap();
        assert!(
            std::fs::read_to_string(d.path().join("0.log.1"))
                .unwrap()
                .contains("still here")
        );
        // A device.
        assert!(CriLogFile::open(Path::new("/dev"), Path::new("/dev/null")).is_err());
    }

    #[test]
    fn file_reopen_after_rename() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("0.log");
        let mut f = CriLogFile::open(dir.path(), &path).unwrap();
        f.write_entry(Stream::Stdout, false, b"one").unwrap();
        std::fs::rename(&path, dir.path().join("0.log.1")).unwrap();
        f.write_entry(Stream::Stdout, false, b"two").unwrap();
        f.reopen().unwrap();
        f.write_entry(Stream::Stderr, false, b"three").unwrap();
        let old = reassemble(&std::fs::read(dir.path().join("0.log.1")).unwrap()).unwrap();
        let new = reassemble(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(old.len(), 2);
        assert_eq!(new, vec![(Stream::Stderr, b"three".to_vec())]);
    }
}

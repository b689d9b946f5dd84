//! File work for the daemon's records: durable replacement (the one helper every record writer
//! uses) and running blocking file work without stalling the async runtime.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

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
        let mut f = std::fs::OpenOptions::new()
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

/// Runs blocking file work `f` (an fsync, a removal) without stalling the async runtime: on a
/// worker of a multi-threaded tokio runtime, the worker hands its queued tasks to another thread
/// for the duration (`block_in_place`); anywhere else `f` just runs. For short work done by
/// synchronous APIs that async code calls; long work goes to `spawn_blocking`.
pub fn off_async<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
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
}

//! File work for the daemon's records: durable replacement (the one helper every record writer
//! uses, defined in the snapshotter crate, the lowest one, whose records use it too) and running
//! blocking file work without stalling the async runtime.

pub use minicri_snapshotter::{sync_dir, write_atomic};

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

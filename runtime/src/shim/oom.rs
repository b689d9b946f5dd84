//! The container's OOM kills, counted while it runs ([`OomWatch`]).
//!
//! On cgroup v2 the kernel counts OOM kills in the container cgroup's `memory.events`
//! (`oom_kill N`) and reports every change of that file to inotify watchers. The count has to be
//! read while the cgroup exists: with the systemd cgroup driver, systemd removes a scope's
//! cgroup as soon as its last process has exited, before the shim has reaped the container's
//! init, so a read at exit (the daemon's, in the pod service's cgroups module) finds nothing.
//! The watch reads the file at each change and keeps the highest count seen. On cgroup v1, or
//! when the watch cannot be set up, nothing is watched: the daemon reads the v1 counters at
//! exit (runc removes those cgroups only at delete).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, channel};
use std::time::Duration;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};

/// A thread watching one cgroup's `memory.events`.
pub struct OomWatch {
    file: PathBuf,
    kills: Arc<AtomicU64>,
    /// Closed when the thread ends: the cgroup is gone (every change before that is counted).
    ended: Receiver<()>,
}

impl OomWatch {
    /// Watches the cgroup v2 cgroup of process `pid` (its `0::` line in `/proc/PID/cgroup`);
    /// `None` on cgroup v1 or when the watch cannot be set up (the reason on stderr, the shim's
    /// log).
    pub fn start(pid: i32) -> Option<OomWatch> {
        let root = Path::new("/sys/fs/cgroup");
        if !root.join("cgroup.controllers").exists() {
            return None;
        }
        let own = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
        let rel = own.lines().find_map(|l| l.strip_prefix("0::"))?;
        Self::start_at(&root.join(rel.trim_start_matches('/')).join("memory.events"))
    }

    /// Watches `file` (a `memory.events`).
    pub fn start_at(file: &Path) -> Option<OomWatch> {
        let inotify = match Inotify::init(InitFlags::IN_CLOEXEC) {
            Ok(i) => i,
            Err(e) => {
                note!("oom watch: inotify: {e}");
                return None;
            }
        };
        if let Err(e) = inotify.add_watch(file, AddWatchFlags::IN_MODIFY) {
            note!("oom watch: {}: {e}", file.display());
            return None;
        }
        let kills = Arc::new(AtomicU64::new(0));
        let (tx, ended) = channel::<()>();
        let watch = OomWatch {
            file: file.to_path_buf(),
            kills: kills.clone(),
            ended,
        };
        watch.read_now();
        let file = file.to_path_buf();
        std::thread::spawn(move || {
            let _ended = tx;
            loop {
                let events = match inotify.read_events() {
                    Ok(events) => events,
                    Err(nix::errno::Errno::EINTR) => continue,
                    Err(_) => return,
                };
                let has = |flag| events.iter().any(|ev| ev.mask.contains(flag));
                // One read per batch: under memory pressure the file changes at every `max`
                // event, and the latest count is all that matters.
                if has(AddWatchFlags::IN_MODIFY) {
                    match oom_kills(&file) {
                        Some(n) => {
                            kills.fetch_max(n, Ordering::SeqCst);
                        }
                        None => note!(
                            "oom watch: {} changed but could not be read (its cgroup is gone?)",
                            file.display()
                        ),
                    }
                }
                if has(AddWatchFlags::IN_IGNORED) {
                    // The file is gone with its cgroup.
                    return;
                }
            }
        });
        Some(watch)
    }

    fn read_now(&self) {
        if let Some(n) = oom_kills(&self.file) {
            self.kills.fetch_max(n, Ordering::SeqCst);
        }
    }

    /// Whether the OOM killer struck, once the container's init has exited: reads the file
    /// if the cgroup is still there, else waits up to `grace` for the watch to see the
    /// cgroup go (so it has read every change before).
    pub fn killed(&self, grace: Duration) -> bool {
        if self.file.exists() {
            self.read_now();
        } else {
            let _ = self.ended.recv_timeout(grace);
        }
        self.kills.load(Ordering::SeqCst) > 0
    }
}

/// The `oom_kill` count of a `memory.events` file.
fn oom_kills(file: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_what_the_file_says_at_each_change_and_ends_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("memory.events");
        std::fs::write(&file, "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n").unwrap();
        let w = OomWatch::start_at(&file).expect("a watch");
        assert!(!w.killed(Duration::ZERO));
        std::fs::write(&file, "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n").unwrap();
        // The watch reads the change; then the file goes, as a removed cgroup's does.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while w.kills.load(Ordering::SeqCst) == 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::fs::remove_file(&file).unwrap();
        assert!(w.killed(Duration::from_secs(5)));
        assert!(
            matches!(
                w.ended.recv_timeout(Duration::from_secs(5)),
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected)
            ),
            "the thread ended with the file"
        );
    }

    #[test]
    fn oom_kill_line() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("memory.events");
        std::fs::write(&file, "oom 2\noom_kill 2\noom_group_kill 0\n").unwrap();
        assert_eq!(oom_kills(&file), Some(2));
        assert_eq!(oom_kills(&dir.path().join("missing")), None);
    }
}

//! Owns [`SmallDisk`]: a test daemon's root on a tmpfs of a few MiB of its own, so that tests of
//! full disks and of the image filesystem's reserve neither depend on nor touch the machine's
//! disk. Unmounted when dropped, also when a test fails half-way.

use std::path::PathBuf;

use crate::daemon::Daemon;

/// The daemon's root on a tmpfs of `mib` MiB (mounted over its root while it is stopped).
pub struct SmallDisk {
    root: PathBuf,
}

impl SmallDisk {
    /// Stops `d`, mounts a tmpfs of `mib` MiB over its (emptied) root, and starts it again there.
    pub async fn under(d: &mut Daemon, mib: u64) -> SmallDisk {
        d.stop().expect("stop");
        let root = d.root();
        std::fs::remove_dir_all(&root).unwrap();
        std::fs::create_dir_all(&root).unwrap();
        let status = std::process::Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={mib}m,mode=0700"),
                "tmpfs",
            ])
            .arg(&root)
            .status()
            .unwrap();
        assert!(status.success(), "mount tmpfs");
        let disk = SmallDisk { root };
        d.restart().await.expect("restart on the small disk");
        disk
    }

    /// The mount point: the daemon's root.
    pub fn root(&self) -> &std::path::Path {
        &self.root
    }

    /// Resizes the tmpfs to `mib` MiB.
    pub fn grow(&self, mib: u64) {
        let status = std::process::Command::new("mount")
            .args(["-o", &format!("remount,size={mib}m"), "tmpfs"])
            .arg(&self.root)
            .status()
            .unwrap();
        assert!(status.success(), "remount tmpfs");
    }

    /// Free and total bytes, as the kubelet counts them (statfs `f_bavail`, `f_blocks`).
    pub fn space(&self) -> (u64, u64) {
        let s = nix::sys::statvfs::statvfs(&self.root).expect("statvfs");
        let unit = s.fragment_size();
        (s.blocks_available() * unit, s.blocks() * unit)
    }

    /// Writes a file of `bytes` into the root (outside the daemon's directories), as another
    /// program filling the filesystem would; [`SmallDisk::unfill`] removes it.
    pub fn fill(&self, bytes: u64) {
        std::fs::write(self.root.join("filler"), vec![0x5a; bytes as usize]).expect("fill");
    }

    pub fn unfill(&self) {
        let _ = std::fs::remove_file(self.root.join("filler"));
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.root, nix::mount::MntFlags::MNT_DETACH);
    }
}

//! Owns [`SmallDisk`]: a test daemon's root on a filesystem of a few MiB of its own, so that
//! tests of full disks and of the image filesystem's reserve neither depend on nor touch the
//! machine's disk: an ext4 in a file attached to a loop device ([`SmallDisk::ext4`]), which does
//! what a node's small image filesystem does (blocks allocated on write-back, a journal, metadata
//! counted against the space), or a tmpfs ([`SmallDisk::tmpfs`]), which can grow while mounted
//! (growing an ext4 online takes CAP_SYS_RESOURCE, which test machines may lack). Unmounted, and
//! the ext4's file removed, when dropped, also when a test fails half-way.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::daemon::Daemon;

/// The daemon's root on a small filesystem (mounted over its root while it is stopped).
pub struct SmallDisk {
    root: PathBuf,
    /// An ext4's backing file, beside the root; none for a tmpfs.
    image: Option<PathBuf>,
}

fn run(what: &str, cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

impl SmallDisk {
    /// Stops `d`, makes an ext4 of `mib` MiB (no blocks reserved for root, so what `statfs`
    /// shows free is what the daemon can write), mounts it through a loop device over the
    /// (emptied) root, and starts the daemon again there.
    pub async fn ext4(d: &mut Daemon, mib: u64) -> SmallDisk {
        let root = Self::emptied(d);
        let image = root.with_extension("ext4");
        let file = std::fs::File::create(&image).expect("disk image");
        file.set_len(mib << 20).expect("size the disk image");
        drop(file);
        run(
            "mkfs.ext4",
            Command::new("mkfs.ext4")
                .args(["-q", "-F", "-m", "0", "-E"])
                .arg("lazy_itable_init=0,lazy_journal_init=0")
                .arg(&image),
        );
        run(
            "mount the disk image",
            Command::new("mount")
                .args(["-t", "ext4", "-o", "loop"])
                .arg(&image)
                .arg(&root),
        );
        let disk = SmallDisk {
            root,
            image: Some(image),
        };
        // Its own lost+found is the filesystem's, not the daemon's: only the daemon's files in
        // its root, which is private like the one it replaces.
        std::fs::remove_dir(disk.root.join("lost+found")).expect("remove lost+found");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&disk.root, std::fs::Permissions::from_mode(0o700))
            .expect("chmod the root");
        d.restart().await.expect("restart on the small disk");
        disk
    }

    /// Stops `d`, mounts a tmpfs of `mib` MiB over its (emptied) root, and starts it again
    /// there.
    pub async fn tmpfs(d: &mut Daemon, mib: u64) -> SmallDisk {
        let root = Self::emptied(d);
        run(
            "mount a tmpfs",
            Command::new("mount")
                .args([
                    "-t",
                    "tmpfs",
                    "-o",
                    &format!("size={mib}m,mode=0700"),
                    "tmpfs",
                ])
                .arg(&root),
        );
        let disk = SmallDisk { root, image: None };
        d.restart().await.expect("restart on the small disk");
        disk
    }

    /// Stops `d` and empties its root; the root.
    fn emptied(d: &mut Daemon) -> PathBuf {
        d.stop().expect("stop");
        let root = d.root();
        std::fs::remove_dir_all(&root).unwrap();
        std::fs::create_dir_all(&root).unwrap();
        root
    }

    /// The mount point: the daemon's root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Grows a tmpfs to `mib` MiB while it is mounted, as an operator enlarging a node's volume
    /// would.
    pub fn grow(&self, mib: u64) {
        assert!(self.image.is_none(), "only a tmpfs grows while mounted");
        run(
            "remount the tmpfs",
            Command::new("mount")
                .args(["-o", &format!("remount,size={mib}m"), "tmpfs"])
                .arg(&self.root),
        );
    }

    /// Free and total bytes, as the kubelet counts them (statfs `f_bavail`, `f_blocks`).
    pub fn space(&self) -> (u64, u64) {
        let s = nix::sys::statvfs::statvfs(&self.root).expect("statvfs");
        let unit = s.fragment_size();
        (s.blocks_available() * unit, s.blocks() * unit)
    }

    /// Writes a file of `bytes` into the root (outside the daemon's directories), as another
    /// program filling the filesystem would, and syncs it so that its blocks count at once;
    /// [`SmallDisk::unfill`] removes it.
    pub fn fill(&self, bytes: u64) {
        use std::io::Write;
        let mut f = std::fs::File::create(self.root.join("filler")).expect("fill");
        f.write_all(&vec![0x5a; bytes as usize]).expect("fill");
        f.sync_all().expect("sync the filler");
    }

    pub fn unfill(&self) {
        let _ = std::fs::remove_file(self.root.join("filler"));
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        // A daemon still running keeps it busy: detached then, and the loop device (attached
        // with autoclear) goes when the daemon's last file closes.
        if nix::mount::umount(&self.root).is_err() {
            let _ = nix::mount::umount2(&self.root, nix::mount::MntFlags::MNT_DETACH);
        }
        if let Some(image) = &self.image {
            let _ = std::fs::remove_file(image);
        }
    }
}

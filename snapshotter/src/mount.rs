//! Mount specs the snapshotter hands out, and mounting them.
//!
//! A [`Mount`] is plain data (type, source, options with absolute paths) so it can be logged, stored or
//! passed on. [`Mount::mount_at`] performs it. An overlay with many layers has an option string longer
//! than the one page the kernel accepts for mount data (128 layers with absolute paths need ~7 KiB);
//! then the layer paths are rewritten relative to their common parent directory and the mount is made
//! from a thread that first detaches its working directory from the process (`unshare(CLONE_FS)`) and
//! changes into that directory, so no other thread's working directory moves. Snapshot directories
//! have short numeric names to keep the relative form small (~6 bytes per layer).

use std::io;
use std::path::{Path, PathBuf};

use nix::mount::{MntFlags, MsFlags};
use serde::{Deserialize, Serialize};

use crate::error::{Error, IoContext, Result};

/// One mount: `mount -t <fstype> -o <options> <source> <target>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mount {
    /// `overlay` or `bind`.
    pub fstype: String,
    pub source: String,
    pub options: Vec<String>,
}

/// The most mount data the kernel takes in one go (one page, less the terminating bytes), minus slack.
const MAX_MOUNT_DATA: usize = 4000;

impl Mount {
    /// True if the mount is read-only.
    pub fn is_read_only(&self) -> bool {
        self.options.iter().any(|o| o == "ro")
    }

    /// Mounts this spec on the directory `target`.
    pub fn mount_at(&self, target: &Path) -> Result<()> {
        let target =
            std::path::absolute(target).ctx(|| format!("mount target {}", target.display()))?;
        let ro = self.is_read_only();
        match self.fstype.as_str() {
            "bind" => {
                let mut flags = MsFlags::MS_BIND;
                if self.options.iter().any(|o| o == "rbind") {
                    flags |= MsFlags::MS_REC;
                }
                nix::mount::mount(
                    Some(self.source.as_str()),
                    &target,
                    None::<&str>,
                    flags,
                    None::<&str>,
                )
                .ctx(|| format!("bind mount {} on {}", self.source, target.display()))?;
                if ro {
                    let flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY;
                    if let Err(e) =
                        nix::mount::mount(None::<&str>, &target, None::<&str>, flags, None::<&str>)
                    {
                        let _ = nix::mount::umount2(&target, MntFlags::MNT_DETACH);
                        return Err(e).ctx(|| format!("remount {} read-only", target.display()));
                    }
                }
                Ok(())
            }
            "overlay" => {
                let flags = if ro {
                    MsFlags::MS_RDONLY
                } else {
                    MsFlags::empty()
                };
                let data: Vec<&str> = self
                    .options
                    .iter()
                    .map(String::as_str)
                    .filter(|o| *o != "ro" && *o != "rw")
                    .collect();
                let joined = data.join(",");
                if joined.len() <= MAX_MOUNT_DATA {
                    return nix::mount::mount(
                        Some("overlay"),
                        &target,
                        Some("overlay"),
                        flags,
                        Some(joined.as_str()),
                    )
                    .ctx(|| format!("overlay mount on {}", target.display()));
                }
                let (dir, short) = relative_options(&data)?;
                if short.len() > MAX_MOUNT_DATA {
                    return Err(Error::InvalidArgument(format!(
                        "overlay options are {} bytes even with relative layer paths",
                        short.len()
                    )));
                }
                mount_from(dir, target, flags, short)
            }
            other => Err(Error::InvalidArgument(format!(
                "unknown mount type {other:?}"
            ))),
        }
    }
}

/// Unmounts `target`.
pub fn unmount(target: &Path) -> Result<()> {
    nix::mount::umount2(target, MntFlags::empty()).ctx(|| format!("unmount {}", target.display()))
}

/// Rewrites the layer paths of overlay options relative to their deepest common directory.
fn relative_options(options: &[&str]) -> Result<(PathBuf, String)> {
    let mut paths: Vec<&Path> = Vec::new();
    for o in options {
        if let Some((key, value)) = o.split_once('=') {
            match key {
                "lowerdir" => paths.extend(value.split(':').map(Path::new)),
                "upperdir" | "workdir" => paths.push(Path::new(value)),
                _ => {}
            }
        }
    }
    let mut common = paths
        .first()
        .and_then(|p| p.parent())
        .ok_or_else(|| Error::InvalidArgument("overlay mount without layers".into()))?
        .to_path_buf();
    while !paths.iter().all(|p| p.starts_with(&common)) {
        if !common.pop() {
            return Err(Error::InvalidArgument(
                "overlay layers share no directory".into(),
            ));
        }
    }
    let rel = |p: &str| -> String {
        Path::new(p)
            .strip_prefix(&common)
            .map(|r| r.to_string_lossy().into_owned())
            .unwrap_or_else(|_| p.to_string())
    };
    let mut out = Vec::with_capacity(options.len());
    for o in options {
        match o.split_once('=') {
            Some(("lowerdir", v)) => out.push(format!(
                "lowerdir={}",
                v.split(':').map(rel).collect::<Vec<_>>().join(":")
            )),
            Some((k @ ("upperdir" | "workdir"), v)) => out.push(format!("{k}={}", rel(v))),
            _ => out.push(o.to_string()),
        }
    }
    Ok((common, out.join(",")))
}

/// Mounts an overlay whose options are relative to `dir`, from a thread with its own working directory.
fn mount_from(dir: PathBuf, target: PathBuf, flags: MsFlags, data: String) -> Result<()> {
    let t = target.clone();
    let d = dir.clone();
    std::thread::spawn(move || -> io::Result<()> {
        // The working directory is shared by all threads unless this thread asks for its own copy.
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_FS)?;
        nix::unistd::chdir(&d)?;
        nix::mount::mount(
            Some("overlay"),
            &t,
            Some("overlay"),
            flags,
            Some(data.as_str()),
        )?;
        Ok(())
    })
    .join()
    .map_err(|_| Error::io("overlay mount thread", io::Error::other("panicked")))?
    .ctx(|| {
        format!(
            "overlay mount on {} (layers relative to {})",
            target.display(),
            dir.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_become_relative_to_common_dir() {
        let opts = [
            "index=off",
            "lowerdir=/r/snapshots/3/fs:/r/snapshots/2/fs",
            "upperdir=/r/snapshots/4/fs",
            "workdir=/r/snapshots/4/work",
        ];
        let (dir, data) = relative_options(&opts).unwrap();
        assert_eq!(dir, Path::new("/r/snapshots"));
        assert_eq!(
            data,
            "index=off,lowerdir=3/fs:2/fs,upperdir=4/fs,workdir=4/work"
        );
    }
}

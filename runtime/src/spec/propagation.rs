//! Host-side preparation of a container's CRI bind mounts, done by CreateContainer before the
//! spec is written ([`prepare_bind_sources`]):
//!
//! - a `host_path` that does not exist is created as a directory (mode 0755), as containerd
//!   and CRI-O do: the OCI runtime would otherwise fail the create;
//! - propagation only crosses between the host and a container through mount peer groups, so
//!   the host mount holding the source of a bidirectional (`rshared`) mount must be shared, and
//!   that of a host-to-container (`rslave`) mount shared or a slave. When it is neither, that
//!   mount (the source itself when it is a mount point, else the mount it lives on) is made
//!   shared, non-recursively: its submounts keep their own propagation. Private
//!   (`rprivate`) mounts need nothing.
//!
//! Mount points come from `/proc/self/mountinfo` (also [`is_mountpoint`]) (minicri runs in the host's mount namespace,
//! the one the OCI runtime copies). Making a mount shared is not undone when the container goes:
//! other containers may rely on it, and a shared mount with no peers behaves like a private one.

use std::path::{Path, PathBuf};

use minicri_proto::runtime::v1 as cri;

use crate::oci::error::{OciError, Result};

/// One line of `/proc/<pid>/mountinfo`, the fields propagation needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountInfo {
    pub id: u32,
    pub mount_point: PathBuf,
    /// An optional field `shared:N`: the mount is in peer group N.
    pub shared: bool,
    /// An optional field `master:N`: the mount receives propagation from peer group N.
    pub slave: bool,
}

/// Undoes mountinfo's octal escapes of space, tab, newline and backslash.
fn unescape(s: &str) -> String {
    s.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

/// Parses mountinfo text (`proc(5)`: id, parent id, major:minor, root, mount point, options,
/// optional fields, `-`, fs type, source, super options). Malformed lines are skipped.
pub fn parse_mountinfo(text: &str) -> Vec<MountInfo> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split(' ').collect();
            let sep = f.iter().position(|x| *x == "-")?;
            if sep < 6 {
                return None;
            }
            let optional = &f[6..sep];
            Some(MountInfo {
                id: f[0].parse().ok()?,
                mount_point: PathBuf::from(unescape(f[4])),
                shared: optional.iter().any(|o| o.starts_with("shared:")),
                slave: optional.iter().any(|o| o.starts_with("master:")),
            })
        })
        .collect()
}

/// The mount `path` (absolute, symlinks resolved) lives on: the longest mount point above it;
/// of several mounts stacked on one point, the last listed (the visible one).
pub fn mount_of<'a>(mounts: &'a [MountInfo], path: &Path) -> Option<&'a MountInfo> {
    let mut best: Option<&MountInfo> = None;
    for m in mounts.iter().filter(|m| path.starts_with(&m.mount_point)) {
        let deeper = best.is_none_or(|b| {
            m.mount_point.components().count() >= b.mount_point.components().count()
        });
        if deeper {
            best = Some(m);
        }
    }
    best
}

/// Whether a mount needs to be made shared for `propagation`.
pub fn needs_shared(m: &MountInfo, propagation: cri::MountPropagation) -> bool {
    match propagation {
        cri::MountPropagation::PropagationPrivate => false,
        cri::MountPropagation::PropagationHostToContainer => !m.shared && !m.slave,
        cri::MountPropagation::PropagationBidirectional => !m.shared,
    }
}

/// Prepares the sources of `mounts` on the host (see the module docs). Returns the mount points
/// that were made shared.
pub fn prepare_bind_sources(mounts: &[cri::Mount]) -> Result<Vec<PathBuf>> {
    use std::os::unix::fs::DirBuilderExt;
    let mut made_shared = Vec::new();
    let mut table: Option<Vec<MountInfo>> = None;
    for m in mounts.iter().filter(|m| m.host_path.starts_with('/')) {
        let src = Path::new(&m.host_path);
        if let Err(e) = std::fs::symlink_metadata(src) {
            if e.kind() != std::io::ErrorKind::NotFound {
                return Err(OciError::io("stat mount source", src, e));
            }
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(src)
                .map_err(|e| OciError::io("create mount source", src, e))?;
        }
        let Ok(prop) = cri::MountPropagation::try_from(m.propagation) else {
            continue; // the spec reports the unknown value
        };
        if prop == cri::MountPropagation::PropagationPrivate {
            continue;
        }
        let canon = src
            .canonicalize()
            .map_err(|e| OciError::io("resolve mount source", src, e))?;
        // Read once per container, not once per mount: the table can be large, and so can the
        // list of mounts.
        let table = match &mut table {
            Some(t) => t,
            None => {
                let info = std::fs::read_to_string("/proc/self/mountinfo")
                    .map_err(|e| OciError::io("read", "/proc/self/mountinfo", e))?;
                table.insert(parse_mountinfo(&info))
            }
        };
        let Some(host_mount) = mount_of(table, &canon) else {
            return Err(OciError::invalid(format!(
                "no mount holds {} in /proc/self/mountinfo",
                canon.display()
            )));
        };
        if !needs_shared(host_mount, prop) {
            continue;
        }
        use nix::mount::{MsFlags, mount};
        mount(
            None::<&str>,
            &host_mount.mount_point,
            None::<&str>,
            MsFlags::MS_SHARED,
            None::<&str>,
        )
        .map_err(|e| OciError::io("make shared", &host_mount.mount_point, e.into()))?;
        tracing::info!(
            mount_point = %host_mount.mount_point.display(),
            source = %canon.display(),
            propagation = ?prop,
            "made the mount holding a propagated volume shared"
        );
        let point = host_mount.mount_point.clone();
        // What the kernel now says of it, for the mounts below that share it.
        table
            .iter_mut()
            .filter(|t| t.mount_point == point)
            .for_each(|t| t.shared = true);
        made_shared.push(point);
    }
    Ok(made_shared)
}

/// Whether `path` is a mount point (listed in this process's mountinfo).
pub fn is_mountpoint(path: &Path) -> bool {
    let Ok(canon) = path.canonicalize() else {
        return false;
    };
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    parse_mountinfo(&info)
        .iter()
        .any(|m| m.mount_point == canon)
}

#[cfg(test)]
mod tests {
    use super::*;

    const INFO: &str = "\
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw
30 27 0:25 / /run rw,nosuid shared:5 - tmpfs tmpfs rw
31 30 0:26 / /run/a\\040b rw master:7 - tmpfs tmpfs rw
32 27 0:27 / /tmp/x rw shared:9 master:3 - tmpfs none rw
33 27 0:28 / /tmp/x rw - tmpfs none rw
garbage line
";

    #[test]
    fn mountinfo_fields() {
        let m = parse_mountinfo(INFO);
        assert_eq!(m.len(), 5);
        assert_eq!(
            m[0],
            MountInfo {
                id: 27,
                mount_point: "/".into(),
                shared: false,
                slave: false
            }
        );
        assert!(m[1].shared && !m[1].slave);
        assert_eq!(m[2].mount_point, Path::new("/run/a b"));
        assert!(!m[2].shared && m[2].slave);
        assert!(m[3].shared && m[3].slave);
    }

    #[test]
    fn containing_mount() {
        let m = parse_mountinfo(INFO);
        let id = |p: &str| mount_of(&m, Path::new(p)).map(|x| x.id);
        assert_eq!(id("/etc/passwd"), Some(27));
        assert_eq!(id("/run"), Some(30));
        assert_eq!(id("/run/a b/c"), Some(31));
        assert_eq!(id("/runner"), Some(27), "components, not string prefixes");
        assert_eq!(id("/tmp/x/y"), Some(33), "the last of a stack is visible");
    }

    #[test]
    fn what_needs_sharing() {
        use cri::MountPropagation::*;
        let m = parse_mountinfo(INFO);
        let (private, shared, slave) = (&m[0], &m[1], &m[2]);
        assert!(!needs_shared(private, PropagationPrivate));
        assert!(needs_shared(private, PropagationHostToContainer));
        assert!(needs_shared(private, PropagationBidirectional));
        assert!(!needs_shared(shared, PropagationHostToContainer));
        assert!(!needs_shared(shared, PropagationBidirectional));
        assert!(!needs_shared(slave, PropagationHostToContainer));
        assert!(needs_shared(slave, PropagationBidirectional));
    }

    #[test]
    fn missing_sources_are_created() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("a/b");
        let mounts = [cri::Mount {
            container_path: "/data".into(),
            host_path: src.to_str().unwrap().into(),
            ..Default::default()
        }];
        assert!(prepare_bind_sources(&mounts).unwrap().is_empty());
        assert!(src.is_dir());
        // Existing sources are left alone.
        std::fs::write(dir.path().join("f"), "x").unwrap();
        let file = [cri::Mount {
            host_path: dir.path().join("f").to_str().unwrap().into(),
            ..Default::default()
        }];
        prepare_bind_sources(&file).unwrap();
        assert!(dir.path().join("f").is_file());
    }
}

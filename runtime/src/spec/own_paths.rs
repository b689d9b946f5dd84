//! minicri's own files kept out of containers: [`OwnPaths::check`] refuses, at CreateContainer, a
//! container mount or device whose host path is minicri's root, its state directory or its CRI
//! socket, lies inside one of them, or holds one of them, unless the operator lists that exact
//! host path in [`SETTING`].
//!
//! Why each case:
//! - **the paths themselves and what is inside them**: the root holds every image and every
//!   container's writable layer (other pods' files and secrets), the state directory the OCI
//!   runtime's state, bundles, network namespaces and shim sockets, and the socket is the CRI
//!   itself: a container that reaches it can start privileged containers, i.e. own the node.
//! - **directories that hold them** (`/`, `/var`, `/var/lib`, `/run`): a mount of `/var/lib`
//!   exposes `/var/lib/minicri` as much as a mount of it does. A read-only mount does not help:
//!   connecting to a unix socket needs no write access to the filesystem it is on.
//!
//! `kubectl debug node/…` and node-exporter mount `/`: on a node that runs them, list `/` in
//! the setting (one line, a decision the operator takes with the guard's message in hand). The
//! kubelet's own mounts (`/var/lib/kubelet/pods/…`, the termination log, `/etc/hosts`) and
//! volumes in `/tmp` or `/srv` are neither inside nor above minicri's directories.
//!
//! Paths are compared as the kernel will find them when the container starts: the host path is
//! resolved one component at a time, following symlinks (absolute and relative, `/proc/<pid>/root`
//! included) and `..` as the kernel does, also through components that do not exist yet (which
//! CreateContainer creates as directories). Each existing directory on the resolved path is also
//! compared with minicri's directories by device and inode, so a bind mount of one of them
//! elsewhere on the host is recognised from inside. A symlink an untrusted writer changes
//! between CreateContainer and StartContainer is not seen: the check is made once, at creation.
//!
//! Image volumes (mounts naming an image, which minicri itself mounts below its state
//! directory) have no host path of the caller's and are not checked here.

use std::ffi::OsString;
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

use minicri_proto::runtime::v1 as cri;

use crate::oci::error::{OciError, Result};

/// The setting that lists host paths a container may mount although they touch minicri's own.
pub use crate::oci::settings::ALLOW_OWN_PATH_MOUNTS as SETTING;

/// Longest host path taken (the kernel's `PATH_MAX`): resolving one costs a lookup per
/// component, and the mount would fail anyway.
const MAX_HOST_PATH: usize = 4096;

/// Symlinks followed while resolving one path (the kernel's limit, `ELOOP` past it).
const MAX_LINKS: usize = 40;

/// minicri's own paths and the host paths the operator allows anyway.
#[derive(Debug, Clone, Default)]
pub struct OwnPaths {
    /// (what it is, for messages; the path as configured).
    own: Vec<(&'static str, PathBuf)>,
    allowed: Vec<PathBuf>,
}

/// How a host path touches one of minicri's own paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Touch {
    Is,
    Inside,
    Holds,
}

impl OwnPaths {
    /// minicri's root, state directory and socket, and the allowed host paths.
    pub fn new(root: &Path, state: &Path, socket: &Path, allowed: Vec<PathBuf>) -> OwnPaths {
        OwnPaths {
            own: vec![
                ("root", root.to_path_buf()),
                ("state directory", state.to_path_buf()),
                ("socket", socket.to_path_buf()),
            ],
            allowed,
        }
    }

    /// Checks the host paths of a container's mounts and devices (see the module docs). Reads
    /// the file system (a lookup per path component): call it off the async workers.
    pub fn check(&self, mounts: &[cri::Mount], devices: &[cri::Device]) -> Result<()> {
        let own: Vec<Own> = self.own.iter().map(|(what, p)| Own::of(what, p)).collect();
        let allowed: Vec<PathBuf> = self.allowed.iter().map(|p| resolve(p)).collect();
        let entries = mounts
            .iter()
            .map(|m| ("mount", &m.container_path, &m.host_path))
            .chain(
                devices
                    .iter()
                    .map(|d| ("device", &d.container_path, &d.host_path)),
            );
        for (kind, container_path, host_path) in entries {
            // Empty: an image volume (minicri mounts it); relative: refused by the mount checks.
            if !host_path.starts_with('/') {
                continue;
            }
            let name = || format!("{kind} {container_path:?} (host_path {host_path:?})");
            if host_path.len() > MAX_HOST_PATH {
                return Err(OciError::invalid(format!(
                    "{}: the host path is longer than {MAX_HOST_PATH} bytes",
                    name()
                )));
            }
            let resolved = resolve(Path::new(host_path));
            if allowed.contains(&resolved) {
                continue;
            }
            let ids = existing_ids(&resolved);
            for o in &own {
                let Some(touch) = o.touched_by(&resolved, &ids) else {
                    continue;
                };
                let how = match touch {
                    Touch::Is => "is",
                    Touch::Inside => "is inside",
                    Touch::Holds => "holds",
                };
                let via = if resolved.as_os_str() != host_path.as_str() {
                    format!(" (it resolves to {})", resolved.display())
                } else {
                    String::new()
                };
                return Err(OciError::invalid(format!(
                    "{}{via} {how} minicri's {} {}: containers may not reach minicri's own \
                     files (its root, state directory and socket); to allow this host path, \
                     list it in {SETTING}",
                    name(),
                    o.what,
                    o.configured.display(),
                )));
            }
        }
        Ok(())
    }
}

/// One of minicri's paths, resolved, with its device and inode when it exists.
struct Own {
    what: &'static str,
    configured: PathBuf,
    resolved: PathBuf,
    id: Option<(u64, u64)>,
}

impl Own {
    fn of(what: &'static str, configured: &Path) -> Own {
        let resolved = resolve(configured);
        let id = std::fs::metadata(&resolved)
            .ok()
            .map(|m| (m.dev(), m.ino()));
        Own {
            what,
            configured: configured.to_path_buf(),
            resolved,
            id,
        }
    }

    /// How the resolved host path `p` touches this path; `ids` are the device and inode of
    /// `p` and of each existing directory above it.
    fn touched_by(&self, p: &Path, ids: &[(u64, u64)]) -> Option<Touch> {
        if p == self.resolved {
            Some(Touch::Is)
        } else if p.starts_with(&self.resolved) {
            Some(Touch::Inside)
        } else if self.resolved.starts_with(p) {
            Some(Touch::Holds)
        } else {
            // Reached another way (a bind mount of it elsewhere, a hard link of the socket).
            let id = self.id?;
            match ids.iter().position(|i| *i == id)? {
                0 => Some(Touch::Is),
                _ => Some(Touch::Inside),
            }
        }
    }
}

/// The device and inode of `p` and of each existing path above it, `p` first (none for the
/// parts that do not exist).
fn existing_ids(p: &Path) -> Vec<(u64, u64)> {
    p.ancestors()
        .filter_map(|a| std::fs::metadata(a).ok())
        .map(|m| (m.dev(), m.ino()))
        .collect()
}

/// `p` (absolute) as the kernel will resolve it: symlinks followed, `.` and `..` applied, one
/// component at a time; components that do not exist are taken as named (CreateContainer
/// creates missing bind sources as directories), and so is the rest of a path past
/// [`MAX_LINKS`] symlinks (the mount would fail with `ELOOP`).
pub fn resolve(p: &Path) -> PathBuf {
    let mut pending: Vec<OsString> = Vec::new();
    push_components(&mut pending, p);
    let mut cur = PathBuf::from("/");
    let mut links = 0;
    while let Some(c) = pending.pop() {
        if c == ".." {
            cur.pop();
            continue;
        }
        let next = cur.join(&c);
        let link = std::fs::symlink_metadata(&next)
            .ok()
            .filter(|m| m.file_type().is_symlink() && links < MAX_LINKS)
            .and_then(|_| std::fs::read_link(&next).ok());
        match link {
            Some(target) => {
                links += 1;
                if target.is_absolute() {
                    cur = PathBuf::from("/");
                }
                push_components(&mut pending, &target);
            }
            None => cur = next,
        }
    }
    cur
}

/// Pushes the normal and `..` components of `p` onto `stack`, last first (so they pop in order).
fn push_components(stack: &mut Vec<OsString>, p: &Path) {
    let parts: Vec<OsString> = p
        .components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n.to_os_string()),
            Component::ParentDir => Some("..".into()),
            Component::RootDir | Component::CurDir | Component::Prefix(_) => None,
        })
        .collect();
    stack.extend(parts.into_iter().rev());
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    struct Node {
        dir: tempfile::TempDir,
        guard: OwnPaths,
    }

    /// A node whose minicri root is `<tmp>/var/lib/minicri`, state `<tmp>/run/minicri` and
    /// socket `<tmp>/run/minicri/minicri.sock`, allowing `allowed` (relative to `<tmp>`).
    fn node(allowed: &[&str]) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path();
        std::fs::create_dir_all(t.join("var/lib/minicri/snapshots")).unwrap();
        std::fs::create_dir_all(t.join("run/minicri")).unwrap();
        std::fs::create_dir_all(t.join("srv/data")).unwrap();
        std::fs::write(t.join("run/minicri/minicri.sock"), "").unwrap();
        let guard = OwnPaths::new(
            &t.join("var/lib/minicri"),
            &t.join("run/minicri"),
            &t.join("run/minicri/minicri.sock"),
            allowed.iter().map(|a| t.join(a)).collect(),
        );
        Node { dir, guard }
    }

    impl Node {
        fn path(&self, p: &str) -> String {
            self.dir.path().join(p).display().to_string()
        }

        fn mount(&self, host: &str) -> Result<()> {
            let m = cri::Mount {
                container_path: "/data".into(),
                host_path: self.path(host),
                ..Default::default()
            };
            self.guard.check(&[m], &[])
        }
    }

    #[test]
    fn own_paths_inside_and_above_them_are_refused_naming_the_path_and_the_setting() {
        let n = node(&[]);
        for (host, says) in [
            ("var/lib/minicri", "is minicri's root"),
            ("var/lib/minicri/snapshots", "is inside minicri's root"),
            ("var/lib/minicri/no/such/dir", "is inside minicri's root"),
            ("run/minicri", "is minicri's state directory"),
            (
                "run/minicri/minicri.sock",
                "is inside minicri's state directory",
            ),
            ("var/lib", "holds minicri's root"),
            ("run", "holds minicri's state directory"),
            ("", "holds minicri's root"),
            ("srv/../var/./lib//minicri", "is minicri's root"),
        ] {
            let err = n.mount(host).unwrap_err().to_string();
            assert!(err.contains(says), "{host}: {err}");
            assert!(err.contains(SETTING), "{host}: {err}");
            assert!(err.contains("mount \"/data\""), "{host}: {err}");
        }
        // Neither inside nor above: allowed, existing or not.
        for host in [
            "srv/data",
            "srv/new/volume",
            "var/lib/kubelet/pods/x",
            "var/lib/minicri2",
        ] {
            n.mount(host).unwrap_or_else(|e| panic!("{host}: {e}"));
        }
    }

    #[test]
    fn the_socket_is_guarded_where_it_is_outside_the_state_directory() {
        let dir = tempfile::tempdir().unwrap();
        let t = dir.path();
        std::fs::create_dir_all(t.join("sock")).unwrap();
        let guard = OwnPaths::new(&t.join("r"), &t.join("s"), &t.join("sock/cri.sock"), vec![]);
        let m = |p: &str| cri::Mount {
            container_path: "/c".into(),
            host_path: t.join(p).display().to_string(),
            ..Default::default()
        };
        let err = guard.check(&[m("sock")], &[]).unwrap_err().to_string();
        assert!(err.contains("holds minicri's socket"), "{err}");
        let err = guard.check(&[m("sock/cri.sock")], &[]).unwrap_err();
        assert!(err.to_string().contains("is minicri's socket"), "{err}");
        guard.check(&[m("sock2")], &[]).unwrap();
    }

    #[test]
    fn symlinks_are_followed_as_the_kernel_follows_them() {
        let n = node(&[]);
        let t = n.dir.path();
        // Absolute and relative links, a link to a link, a link whose target does not exist
        // yet, `..` after a link, and a path continuing through a component that does not
        // exist and back out of it.
        symlink(t.join("var/lib/minicri"), t.join("srv/abs")).unwrap();
        symlink("../run", t.join("srv/rel")).unwrap();
        symlink(t.join("srv/abs"), t.join("srv/chain")).unwrap();
        symlink(t.join("var/lib/minicri/later"), t.join("srv/dangling")).unwrap();
        symlink(t.join("var/lib/minicri/snapshots"), t.join("srv/deep")).unwrap();
        for (host, says) in [
            ("srv/abs", "is minicri's root"),
            ("srv/rel/minicri", "is minicri's state directory"),
            ("srv/rel", "holds minicri's state directory"),
            ("srv/chain/x", "is inside minicri's root"),
            ("srv/dangling", "is inside minicri's root"),
            ("srv/deep/..", "is minicri's root"),
            ("srv/new/../abs", "is minicri's root"),
        ] {
            let err = n.mount(host).unwrap_err().to_string();
            assert!(err.contains(says), "{host}: {err}");
            assert!(err.contains("resolves to"), "{host}: {err}");
        }
        // A link loop is not followed forever; what it names is outside.
        symlink(t.join("srv/loop"), t.join("srv/loop")).unwrap();
        n.mount("srv/loop").unwrap();
    }

    #[test]
    fn a_bind_mount_of_an_own_directory_elsewhere_is_recognised() {
        // A hard link stands in for a bind mount (same device and inode, another name), which
        // needs no root: the socket linked into a volume directory.
        let n = node(&[]);
        let t = n.dir.path();
        std::fs::hard_link(t.join("run/minicri/minicri.sock"), t.join("srv/data/cri")).unwrap();
        let err = n.mount("srv/data/cri").unwrap_err().to_string();
        assert!(err.contains("is minicri's socket"), "{err}");
    }

    #[test]
    fn listed_host_paths_are_allowed_exactly() {
        let n = node(&["run/minicri/netns", "var/lib"]);
        n.mount("run/minicri/netns").unwrap();
        n.mount("var/lib").unwrap();
        // Only the listed paths: not what is inside or above them.
        for host in [
            "run/minicri/netns/pod",
            "run/minicri",
            "var/lib/minicri",
            "var",
        ] {
            assert!(n.mount(host).is_err(), "{host}");
        }
    }

    #[test]
    fn devices_are_guarded_and_image_volumes_skipped() {
        let n = node(&[]);
        let d = cri::Device {
            container_path: "/dev/x".into(),
            host_path: n.path("run/minicri/minicri.sock"),
            permissions: "rw".into(),
        };
        let err = n.guard.check(&[], &[d]).unwrap_err().to_string();
        assert!(err.starts_with("device \"/dev/x\""), "{err}");
        // An image volume: no host path of the caller's.
        let m = cri::Mount {
            container_path: "/img".into(),
            ..Default::default()
        };
        n.guard.check(&[m], &[]).unwrap();
        let long = cri::Mount {
            container_path: "/l".into(),
            host_path: format!("/{}", "a/".repeat(MAX_HOST_PATH)),
            ..Default::default()
        };
        let err = n.guard.check(&[long], &[]).unwrap_err().to_string();
        assert!(err.contains("longer than"), "{err}");
    }
}

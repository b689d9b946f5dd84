//! Pods in a user namespace of their own (CRI `NamespaceOption.userns_options`, Kubernetes'
//! `hostUsers: false`).
//!
//! - [`pod_userns`] validates the pod's request: mode `NODE` (or none) is the host's user
//!   namespace; mode `POD` needs exactly one uid and one gid mapping, each mapping container id 0
//!   (the kubelet allocates one contiguous range per pod), and the pod's own network, PID and IPC
//!   namespaces; `CONTAINER` and `TARGET` are refused, as the CRI allows.
//! - The infra process creates the user namespace with the mappings (see
//!   the sandbox's spec) together with the pod's other namespaces, so they are owned by it.
//!   That includes the network namespace: a process in the pod's user namespace cannot join a
//!   network namespace owned by the host's (`setns` needs `CAP_SYS_ADMIN` over its owner), so
//!   RunPodSandbox pins the infra's network namespace and attaches CNI to it after `create`.
//! - Containers join `/proc/<infra>/ns/user` with the same mappings ([`check_container`]).
//! - Their rootfs: image layers belong to the host's root, who is nobody inside the namespace.
//!   [`mount_rootfs`] gives each lower layer an idmapped, read-only bind mount
//!   (`open_tree(2)`, `mount_setattr(2)` with `MOUNT_ATTR_IDMAP` and the pod's user namespace,
//!   `move_mount(2)`; Linux >= 5.12, overlayfs on idmapped layers >= 5.19), stacks the overlay on
//!   those, and gives the upper directory's root to the namespace's root. Files the container
//!   writes are stored with their host ids. runc 1.1 cannot idmap mounts itself, so this is done
//!   here.
//! - Volumes: the kubelet passes the pod's mappings on each mount of such a pod
//!   (`Mount.uid_mappings`); [`idmap_volumes`] gives those sources idmapped bind mounts too.
//!
//! Invariant: idmapped mounts live in directories of their own, which only
//! [`remove_idmapped`] removes (unmounting, never recursively), so no removal of a container's
//! files can reach into a volume or an image layer through them; layer mounts are read-only
//! besides.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use minicri_proto::runtime::v1 as cri;
use oci_spec::runtime::LinuxIdMapping;

use super::namespaces::namespace_options;
use crate::oci::error::{OciError, Result};

/// The pod's user namespace mappings (one range each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodUserns {
    pub uid: LinuxIdMapping,
    pub gid: LinuxIdMapping,
}

fn mapping(m: &cri::IdMapping, what: &str) -> Result<LinuxIdMapping> {
    if m.container_id != 0 {
        return Err(OciError::invalid(format!(
            "{what} mapping must map container id 0 (it starts at {})",
            m.container_id
        )));
    }
    if m.length == 0 || m.host_id.checked_add(m.length - 1).is_none() {
        return Err(OciError::invalid(format!(
            "{what} mapping {}+{} is empty or overflows",
            m.host_id, m.length
        )));
    }
    oci_spec::runtime::LinuxIdMappingBuilder::default()
        .container_id(m.container_id)
        .host_id(m.host_id)
        .size(m.length)
        .build()
        .map_err(|e| OciError::Other(format!("id mapping: {e}")))
}

fn mode_name(m: i32) -> String {
    cri::NamespaceMode::try_from(m)
        .map(|m| m.as_str_name().to_string())
        .unwrap_or_else(|_| m.to_string())
}

/// The pod's user namespace, `None` for the host's; see the module docs for the rules.
pub fn pod_userns(config: &cri::PodSandboxConfig) -> Result<Option<PodUserns>> {
    let Some(o) = namespace_options(config) else {
        return Ok(None);
    };
    let Some(u) = &o.userns_options else {
        return Ok(None);
    };
    match cri::NamespaceMode::try_from(u.mode) {
        Ok(cri::NamespaceMode::Node) => {
            if !u.uids.is_empty() || !u.gids.is_empty() {
                return Err(OciError::invalid(
                    "user namespace mappings need mode POD, not NODE",
                ));
            }
            Ok(None)
        }
        Ok(cri::NamespaceMode::Pod) => {
            if u.uids.len() != 1 || u.gids.len() != 1 {
                return Err(OciError::invalid(format!(
                    "a pod user namespace needs exactly one uid and one gid mapping, not {} and {}",
                    u.uids.len(),
                    u.gids.len()
                )));
            }
            for (what, mode) in [("network", o.network), ("PID", o.pid), ("IPC", o.ipc)] {
                if mode == cri::NamespaceMode::Node as i32 {
                    return Err(OciError::invalid(format!(
                        "a pod in its own user namespace cannot use the host's {what} namespace"
                    )));
                }
            }
            Ok(Some(PodUserns {
                uid: mapping(&u.uids[0], "uid")?,
                gid: mapping(&u.gids[0], "gid")?,
            }))
        }
        _ => Err(OciError::invalid(format!(
            "user namespace mode {} is not supported (POD or NODE)",
            mode_name(u.mode)
        ))),
    }
}

/// A container's `userns_options`, when it sends any, must be its pod's.
pub fn check_container(config: &cri::ContainerConfig, pod: Option<&PodUserns>) -> Result<()> {
    let Some(u) = config
        .linux
        .as_ref()
        .and_then(|l| l.security_context.as_ref())
        .and_then(|s| s.namespace_options.as_ref())
        .and_then(|o| o.userns_options.as_ref())
    else {
        return Ok(());
    };
    let same = match pod {
        None => u.mode == cri::NamespaceMode::Node as i32,
        Some(p) => {
            let eq = |m: &[cri::IdMapping], want: &LinuxIdMapping| {
                m.len() == 1
                    && m[0].container_id == want.container_id()
                    && m[0].host_id == want.host_id()
                    && m[0].length == want.size()
            };
            u.mode == cri::NamespaceMode::Pod as i32 && eq(&u.uids, &p.uid) && eq(&u.gids, &p.gid)
        }
    };
    if same {
        Ok(())
    } else {
        Err(OciError::invalid(
            "the container's user namespace options differ from its pod's",
        ))
    }
}

fn syscall_fd(r: libc::c_long, what: &'static str, path: &Path) -> Result<OwnedFd> {
    if r < 0 {
        return Err(OciError::io(what, path, std::io::Error::last_os_error()));
    }
    // SAFETY: the kernel returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(r as i32) })
}

fn syscall_ok(r: libc::c_long, what: &'static str, path: &Path) -> Result<()> {
    if r < 0 {
        return Err(OciError::io(what, path, std::io::Error::last_os_error()));
    }
    Ok(())
}

const OPEN_TREE_CLONE: libc::c_uint = 1;
const AT_RECURSIVE: libc::c_uint = 0x8000;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;
const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

/// `struct mount_attr` of `mount_setattr(2)`.
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// Bind-mounts `source` (with its submounts) at `target` through the id mapping of the user
/// namespace `userns` (a `/proc/<pid>/ns/user` path): files owned by host id `h` appear owned by
/// `h` + (host id of the namespace's 0), and writes store the reverse. `readonly` also makes
/// the new mount read-only.
pub fn idmapped_bind(source: &Path, target: &Path, userns: &Path, readonly: bool) -> Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| {
        std::ffi::CString::new(p.as_os_str().as_bytes())
            .map_err(|_| OciError::invalid(format!("{} has a NUL byte", p.display())))
    };
    let (src, dst) = (c(source)?, c(target)?);
    let ns = std::fs::File::open(userns).map_err(|e| OciError::io("open", userns, e))?;
    // SAFETY: valid C strings and flags; the result is checked and owned.
    let tree = syscall_fd(
        unsafe {
            libc::syscall(
                libc::SYS_open_tree,
                libc::AT_FDCWD,
                src.as_ptr(),
                OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint | AT_RECURSIVE,
            )
        },
        "open_tree",
        source,
    )?;
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_IDMAP | if readonly { MOUNT_ATTR_RDONLY } else { 0 },
        attr_clr: 0,
        propagation: 0,
        userns_fd: ns.as_raw_fd() as u64,
    };
    // SAFETY: `attr` is a valid mount_attr of the size passed; the descriptors are open.
    syscall_ok(
        unsafe {
            libc::syscall(
                libc::SYS_mount_setattr,
                tree.as_raw_fd(),
                c"".as_ptr(),
                libc::AT_EMPTY_PATH as libc::c_uint,
                &attr as *const MountAttr,
                std::mem::size_of::<MountAttr>(),
            )
        },
        "idmap (mount_setattr)",
        source,
    )?;
    // SAFETY: as above; `dst` is a valid C string.
    syscall_ok(
        unsafe {
            libc::syscall(
                libc::SYS_move_mount,
                tree.as_raw_fd(),
                c"".as_ptr(),
                libc::AT_FDCWD,
                dst.as_ptr(),
                MOVE_MOUNT_F_EMPTY_PATH,
            )
        },
        "move_mount to",
        target,
    )
}

/// Mounts the snapshot `m` at `target` for a container in the user namespace `userns` whose
/// root is host `root_uid`:`root_gid` (see the module docs). Layer mounts go to
/// `layers_dir/<n>`; on failure the ones made are unmounted again. Returns them.
pub fn mount_rootfs(
    m: &minicri_snapshotter::Mount,
    target: &Path,
    layers_dir: &Path,
    userns: &Path,
    (root_uid, root_gid): (u32, u32),
) -> Result<Vec<PathBuf>> {
    match m.fstype.as_str() {
        // A plain directory (the copy backend, or an image without layers): map it in place.
        "bind" => {
            idmapped_bind(Path::new(&m.source), target, userns, m.is_read_only())?;
            Ok(Vec::new())
        }
        "overlay" => {
            let mut made = Vec::new();
            let r = overlay_on_idmapped_layers(m, layers_dir, userns, &mut made);
            let r = r.and_then(|options| {
                // The merged root shows the upper root's owner: make it the namespace's root.
                if let Some(upper) = options.iter().find_map(|o| o.strip_prefix("upperdir=")) {
                    std::os::unix::fs::chown(upper, Some(root_uid), Some(root_gid))
                        .map_err(|e| OciError::io("chown", upper, e))?;
                }
                minicri_snapshotter::Mount {
                    fstype: m.fstype.clone(),
                    source: m.source.clone(),
                    options,
                }
                .mount_at(target)
                .map_err(|e| OciError::Other(format!("overlay on idmapped layers: {e}")))
            });
            match r {
                Ok(()) => Ok(made),
                Err(e) => {
                    for p in made.iter().rev() {
                        let _ = nix::mount::umount2(p, nix::mount::MntFlags::MNT_DETACH);
                    }
                    Err(e)
                }
            }
        }
        other => Err(OciError::invalid(format!(
            "cannot idmap a {other:?} snapshot mount"
        ))),
    }
}

/// Makes the idmapped layer mounts (recorded in `made`) and returns the overlay options using
/// them.
fn overlay_on_idmapped_layers(
    m: &minicri_snapshotter::Mount,
    layers_dir: &Path,
    userns: &Path,
    made: &mut Vec<PathBuf>,
) -> Result<Vec<String>> {
    let mut options = Vec::with_capacity(m.options.len());
    for o in &m.options {
        let Some(lowers) = o.strip_prefix("lowerdir=") else {
            options.push(o.clone());
            continue;
        };
        let mut mapped = Vec::new();
        for (n, lower) in lowers.split(':').enumerate() {
            let at = layers_dir.join(n.to_string());
            std::fs::create_dir_all(&at).map_err(|e| OciError::io("create", &at, e))?;
            idmapped_bind(Path::new(lower), &at, userns, true)?;
            made.push(at.clone());
            mapped.push(at.display().to_string());
        }
        options.push(format!("lowerdir={}", mapped.join(":")));
    }
    Ok(options)
}

/// Checks the id mappings of a container's mounts: only in a pod with its own user namespace,
/// and only the pod's own mappings (the kubelet gives each mount of such a pod the pod's).
pub fn check_volume_mappings(mounts: &[cri::Mount], pod: Option<&PodUserns>) -> Result<()> {
    for m in mounts {
        if m.uid_mappings.is_empty() && m.gid_mappings.is_empty() {
            continue;
        }
        let Some(pod) = pod else {
            return Err(OciError::invalid(format!(
                "mount {:?} has id mappings but the pod has no user namespace",
                m.container_path
            )));
        };
        let is_pods = |maps: &[cri::IdMapping], want: &LinuxIdMapping| {
            maps.len() == 1
                && (maps[0].container_id, maps[0].host_id, maps[0].length)
                    == (want.container_id(), want.host_id(), want.size())
        };
        if !is_pods(&m.uid_mappings, &pod.uid) || !is_pods(&m.gid_mappings, &pod.gid) {
            return Err(OciError::invalid(format!(
                "mount {:?}: only the pod's own id mappings are supported",
                m.container_path
            )));
        }
    }
    Ok(())
}

/// Volumes of a container in a user namespace: the kubelet gives each mount the pod's id
/// mappings (CRI `Mount.uid_mappings` / `gid_mappings`) so that the container's root owns what
/// the host's root owns. runc 1.1 cannot idmap a mount, so each such source gets an idmapped
/// bind mount at `dir/<n>` (read-write: `readonly` is applied by the OCI runtime on top). This
/// is the copy of `mounts` the spec binds: those mounts name their idmapped mount, without
/// mappings; mounts without mappings are left as they are. Changes nothing
/// ([`idmap_volumes`] makes the mounts).
pub fn idmapped_mounts(mounts: &[cri::Mount], dir: &Path) -> Vec<cri::Mount> {
    let mut out = mounts.to_vec();
    for (n, m) in out.iter_mut().enumerate() {
        if !m.uid_mappings.is_empty() || !m.gid_mappings.is_empty() {
            m.host_path = dir.join(n.to_string()).display().to_string();
            m.uid_mappings.clear();
            m.gid_mappings.clear();
        }
    }
    out
}

/// Makes the idmapped bind mounts [`idmapped_mounts`] names, under `dir`
/// ([`check_volume_mappings`] first). Returns the mounts made; on failure they are unmounted
/// again.
pub fn idmap_volumes(
    mounts: &[cri::Mount],
    pod: Option<&PodUserns>,
    userns: &Path,
    dir: &Path,
) -> Result<Vec<PathBuf>> {
    check_volume_mappings(mounts, pod)?;
    let mut made = Vec::new();
    let r = (|| {
        for (m, mapped) in mounts.iter().zip(idmapped_mounts(mounts, dir)) {
            if m.uid_mappings.is_empty() && m.gid_mappings.is_empty() {
                continue;
            }
            let source = Path::new(&m.host_path);
            let at = PathBuf::from(mapped.host_path);
            std::fs::create_dir_all(dir).map_err(|e| OciError::io("create", dir, e))?;
            if source.is_dir() {
                std::fs::create_dir_all(&at).map_err(|e| OciError::io("create", &at, e))?;
            } else {
                std::fs::write(&at, b"").map_err(|e| OciError::io("create", &at, e))?;
            }
            idmapped_bind(source, &at, userns, false)?;
            made.push(at);
        }
        Ok(())
    })();
    match r {
        Ok(()) => Ok(made),
        Err(e) => {
            for p in made.iter().rev() {
                let _ = nix::mount::umount2(p, nix::mount::MntFlags::MNT_DETACH);
            }
            Err(e)
        }
    }
}

/// Unmounts the idmapped mounts [`mount_rootfs`] or [`idmap_volumes`] made under `dir` and
/// removes the directory. Idempotent.
pub fn unmount_idmapped(layers_dir: &Path) -> Result<()> {
    let entries = match std::fs::read_dir(layers_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(OciError::io("list", layers_dir, e)),
    };
    // The mount table is read once, not once per entry: a container can have many (a layer
    // each, a volume each), and so can the table.
    let stacked = mounts_stacked_in(layers_dir)?;
    for e in entries.flatten() {
        let p = e.path();
        let here = layers_dir
            .canonicalize()
            .map(|d| d.join(e.file_name()))
            .unwrap_or_else(|_| p.clone());
        for _ in 0..stacked.get(&here).copied().unwrap_or(0) {
            nix::mount::umount2(&p, nix::mount::MntFlags::MNT_DETACH)
                .map_err(|e| OciError::io("unmount", &p, e.into()))?;
        }
        let removed = if p.is_dir() {
            std::fs::remove_dir(&p)
        } else {
            std::fs::remove_file(&p)
        };
        removed.map_err(|e| OciError::io("remove", &p, e))?;
    }
    std::fs::remove_dir(layers_dir).map_err(|e| OciError::io("remove", layers_dir, e))
}

/// How many mounts are stacked on each entry of `dir` (mounts on deeper paths go with the
/// entry's when it is detached).
fn mounts_stacked_in(dir: &Path) -> Result<std::collections::HashMap<PathBuf, usize>> {
    let canon = dir
        .canonicalize()
        .map_err(|e| OciError::io("resolve", dir, e))?;
    let info = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| OciError::io("read", "/proc/self/mountinfo", e))?;
    let mut stacked = std::collections::HashMap::new();
    for m in super::propagation::parse_mountinfo(&info) {
        if m.mount_point.parent() == Some(canon.as_path()) {
            *stacked.entry(m.mount_point).or_insert(0) += 1;
        }
    }
    Ok(stacked)
}

/// Removes what [`mount_rootfs`] and [`idmap_volumes`] made under a container's `dir` (given
/// them as `dir/layers`, `dir/volumes` and, for image volumes, `dir/image-volumes/<n>`), then
/// `dir`. Only unmounts and non-recursive
/// removals: a mount that cannot be unmounted makes this fail rather than reach into a volume.
/// Idempotent.
pub fn remove_idmapped(dir: &Path) -> Result<()> {
    unmount_idmapped(&dir.join("layers"))?;
    unmount_idmapped(&dir.join("volumes"))?;
    // The layers of image volumes, one directory each (mounted by the pod service).
    let images = dir.join("image-volumes");
    match std::fs::read_dir(&images) {
        Ok(entries) => {
            for e in entries.flatten() {
                unmount_idmapped(&e.path())?;
            }
            std::fs::remove_dir(&images).map_err(|e| OciError::io("remove", &images, e))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(OciError::io("list", &images, e)),
    }
    match std::fs::remove_dir(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(OciError::io("remove", dir, e)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn volume_mappings_must_be_the_pods() {
        let pod = pod_userns(&pod(userns(cri::NamespaceMode::Pod, &[(0, 1000, 100)])))
            .unwrap()
            .unwrap();
        let d = tempfile::tempdir().unwrap();
        let m = |maps: &[(u32, u32, u32)]| cri::Mount {
            container_path: "/v".into(),
            host_path: d.path().display().to_string(),
            uid_mappings: maps
                .iter()
                .map(|&(container_id, host_id, length)| cri::IdMapping {
                    container_id,
                    host_id,
                    length,
                })
                .collect(),
            gid_mappings: Vec::new(),
            ..Default::default()
        };
        let ns = Path::new("/proc/self/ns/user");
        let dir = d.path().join("volumes");
        // No mappings: untouched, nothing mounted.
        assert_eq!(idmapped_mounts(&[m(&[])], &dir), [m(&[])]);
        let made = idmap_volumes(&[m(&[])], Some(&pod), ns, &dir).unwrap();
        assert!(made.is_empty());
        // Someone else's mappings, or mappings without a pod user namespace: refused.
        let mut other = m(&[(0, 5000, 100)]);
        other.gid_mappings = other.uid_mappings.clone();
        assert!(idmap_volumes(&[other], Some(&pod), ns, &dir).is_err());
        let mut ours = m(&[(0, 1000, 100)]);
        ours.gid_mappings = ours.uid_mappings.clone();
        // Mapped: the spec binds the idmapped mount at dir/<n>, without mappings.
        let named = idmapped_mounts(&[m(&[]), ours.clone()], &dir);
        assert_eq!(named[0], m(&[]));
        assert_eq!(named[1].host_path, dir.join("1").display().to_string());
        assert!(named[1].uid_mappings.is_empty() && named[1].gid_mappings.is_empty());
        assert!(idmap_volumes(&[ours], None, ns, &dir).is_err());
        assert!(!dir.join("0").exists() || unmount_idmapped(&dir).is_ok());
    }

    use super::*;

    fn pod(opts: cri::NamespaceOption) -> cri::PodSandboxConfig {
        cri::PodSandboxConfig {
            linux: Some(cri::LinuxPodSandboxConfig {
                security_context: Some(cri::LinuxSandboxSecurityContext {
                    namespace_options: Some(opts),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn userns(mode: cri::NamespaceMode, uids: &[(u32, u32, u32)]) -> cri::NamespaceOption {
        let m: Vec<cri::IdMapping> = uids
            .iter()
            .map(|&(container_id, host_id, length)| cri::IdMapping {
                container_id,
                host_id,
                length,
            })
            .collect();
        cri::NamespaceOption {
            userns_options: Some(cri::UserNamespace {
                mode: mode as i32,
                uids: m.clone(),
                gids: m,
            }),
            ..Default::default()
        }
    }

    #[test]
    fn pod_requests() {
        use cri::NamespaceMode::*;
        assert_eq!(pod_userns(&cri::PodSandboxConfig::default()).unwrap(), None);
        assert_eq!(pod_userns(&pod(userns(Node, &[]))).unwrap(), None);
        let u = pod_userns(&pod(userns(Pod, &[(0, 1000, 100_000)])))
            .unwrap()
            .unwrap();
        assert_eq!(
            (u.uid.container_id(), u.uid.host_id(), u.uid.size()),
            (0, 1000, 100_000)
        );
        assert_eq!(u.gid, u.uid);
        for (bad, why) in [
            (userns(Pod, &[]), "exactly one"),
            (
                userns(Pod, &[(0, 1000, 100_000), (0, 2000, 100_000)]),
                "exactly one",
            ),
            (userns(Pod, &[(1, 1000, 100_000)]), "container id 0"),
            (userns(Pod, &[(0, 1000, 0)]), "empty"),
            (userns(Pod, &[(0, u32::MAX, 2)]), "overflows"),
            (userns(Container, &[]), "mode CONTAINER is not supported"),
            (userns(Target, &[]), "mode TARGET is not supported"),
            (userns(Node, &[(0, 1000, 10)]), "need mode POD"),
            (
                cri::NamespaceOption {
                    network: Node as i32,
                    ..userns(Pod, &[(0, 1000, 100_000)])
                },
                "network",
            ),
        ] {
            let err = pod_userns(&pod(bad)).unwrap_err().to_string();
            assert!(err.contains(why), "{why}: {err}");
        }
    }

    #[test]
    fn containers_follow_their_pod() {
        use cri::NamespaceMode::*;
        let p = pod_userns(&pod(userns(Pod, &[(0, 1000, 100_000)])))
            .unwrap()
            .unwrap();
        let c = |o: Option<cri::NamespaceOption>| cri::ContainerConfig {
            linux: Some(cri::LinuxContainerConfig {
                security_context: Some(cri::LinuxContainerSecurityContext {
                    namespace_options: o,
                    ..Default::default()
                }),
                resources: None,
            }),
            ..Default::default()
        };
        check_container(&c(None), Some(&p)).unwrap();
        check_container(&c(None), None).unwrap();
        check_container(&c(Some(userns(Pod, &[(0, 1000, 100_000)]))), Some(&p)).unwrap();
        check_container(&c(Some(userns(Node, &[]))), None).unwrap();
        assert!(check_container(&c(Some(userns(Pod, &[(0, 5000, 10)]))), Some(&p)).is_err());
        assert!(check_container(&c(Some(userns(Node, &[]))), Some(&p)).is_err());
        assert!(check_container(&c(Some(userns(Pod, &[(0, 1000, 10)]))), None).is_err());
    }

    #[test]
    fn unmounting_nothing_is_fine() {
        let d = tempfile::tempdir().unwrap();
        remove_idmapped(&d.path().join("absent")).unwrap();
        std::fs::create_dir_all(d.path().join("c1/volumes")).unwrap();
        std::fs::write(d.path().join("c1/volumes/0"), "").unwrap();
        remove_idmapped(&d.path().join("c1")).unwrap();
        assert!(!d.path().join("c1").exists());
        // Never recursive: something else in the directory stays, and so does the directory.
        std::fs::create_dir_all(d.path().join("c2/other")).unwrap();
        assert!(remove_idmapped(&d.path().join("c2")).is_err());
        assert!(d.path().join("c2/other").exists());
        unmount_idmapped(&d.path().join("absent")).unwrap();
        std::fs::create_dir_all(d.path().join("layers/0")).unwrap();
        std::fs::write(d.path().join("layers/1"), "").unwrap();
        unmount_idmapped(&d.path().join("layers")).unwrap();
        assert!(!d.path().join("layers").exists());
    }
}

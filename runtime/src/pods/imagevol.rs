//! Image volumes: a container mount that names an image (CRI `Mount.image`, Kubernetes' `image`
//! volume source, KEP-4639) shows that image's root filesystem, or its `image_sub_path`,
//! read-only at `container_path`.
//!
//! The kubelet pulls the image first (with the pod's sandbox config) and names it by id in
//! `Mount.image.image`. CreateContainer ([`PodService::mount_image_volumes`]) then, for each such
//! mount:
//! - records the container as a volume user of the image (`minicri_store::images`): RemoveImage
//!   refuses the image (FAILED_PRECONDITION naming the container) until the container is torn
//!   down, and a pull that moves its last name elsewhere keeps it, without names, until then;
//! - makes a view snapshot of the image's top layer (key `<container id>.volume.<n>`): nothing
//!   is copied, the overlay backend stacks the layer directories read-only (lower directories
//!   only), the copy backend binds the top snapshot's tree read-only. The view is a child of the
//!   image's layers, so they stay while it does whatever happens to the image;
//! - mounts it at `<state>/containers/<id>/volumes/<n>/image` (in a pod with its own user
//!   namespace, on idmapped layers as the rootfs is, under `<state>/idmap/<id>/image-volumes/<n>`);
//! - with an `image_sub_path`, opens that path in the mounted image with `openat2(2)` and
//!   `RESOLVE_BENEATH`: every symlink on the way must stay inside the image (an absolute one, or
//!   one climbing above its root, is refused, as the snapshotter refuses layer entries that
//!   would pass through such links), and binds what it opened (a directory or a regular file)
//!   read-only at `<state>/containers/<id>/volumes/<n>/sub`, through the descriptor, so nothing
//!   is looked up by path again.
//!
//! The spec then binds that mount (read-only, `nosuid`, `nodev`: `crate::spec::container`). Each step
//! is journaled before it is taken ([`super::undo`]), so a failed or interrupted create leaves
//! nothing mounted, held or kept. The container's record lists its volumes ([`ImageVolume`]);
//! teardown after RemoveContainer unmounts them, removes the views and lets go of the images.
//! After a restart the mounts are still there (they are the host's) and the volume users are
//! restored from the records ([`PodService::restore_image_volume_users`]).
//!
//! Images are what minicri pulls: layers that are tar archives. An OCI artifact whose layers
//! have another media type is refused at PullImage, naming the media type (docs/image-volumes.md).

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use minicri_proto::runtime::v1 as cri;

use super::store::ImageVolume;
use super::{Journal, PodService, Undo, blocking, unmount_all};
use crate::error::{Error, Result};

/// The snapshot key of the `n`th image volume of container `id`.
fn snapshot_key(id: &str, n: usize) -> String {
    format!("{id}.volume.{n}")
}

/// Where the `n`th image volume of a container whose directory is `dir` is mounted.
fn volume_dir(dir: &Path, n: usize) -> PathBuf {
    dir.join("volumes").join(n.to_string())
}

/// Where the idmapped layers of image volume `n` go, below a container's idmap directory
/// (`crate::spec::userns::remove_idmapped` unmounts them).
fn idmapped_layers(idmap: &Path, n: usize) -> PathBuf {
    idmap.join("image-volumes").join(n.to_string())
}

/// The mounts as the spec binds them: each image volume's `host_path` is where it is mounted on
/// the host, and it carries no id mappings (in a pod user namespace its layers are idmapped
/// already).
pub(crate) fn spec_mounts(mounts: &[cri::Mount], volumes: &[ImageVolume]) -> Vec<cri::Mount> {
    let mut out = mounts.to_vec();
    for v in volumes {
        if let Some(m) = out.get_mut(v.mount) {
            m.host_path = v.source.display().to_string();
            m.uid_mappings.clear();
            m.gid_mappings.clear();
            // Nothing is mounted below it on the host: nothing to make shared or slave.
            m.propagation = cri::MountPropagation::PropagationPrivate as i32;
        }
    }
    out
}

/// The mounts as ContainerStatus reports them: an image volume names its image by id
/// (`image.image`), which the kubelet's image garbage collector matches against the images it
/// lists, keeps the reference the request gave (`user_specified_image`; the name it asked by,
/// when it gave none) and is read-only, as it is mounted whatever was asked.
pub(crate) fn status_mounts(
    mut mounts: Vec<cri::Mount>,
    volumes: &[ImageVolume],
) -> Vec<cri::Mount> {
    for v in volumes {
        if let Some(m) = mounts.get_mut(v.mount) {
            let spec = m.image.get_or_insert_with(Default::default);
            if spec.user_specified_image.is_empty() && spec.image != v.image_id.as_str() {
                spec.user_specified_image = std::mem::take(&mut spec.image);
            }
            spec.image = v.image_id.to_string();
            m.readonly = true;
        }
    }
    mounts
}

/// Unmounts the image volumes (the sub path's bind, then the image). Idempotent.
pub(crate) fn unmount(volumes: &[ImageVolume]) -> Result<()> {
    for v in volumes {
        if v.source != v.root {
            unmount_all(&v.source)?;
        }
        unmount_all(&v.root)?;
    }
    Ok(())
}

/// What an `image_sub_path` leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Found {
    Dir,
    File,
}

/// Opens `m.image_sub_path` in the image at `root` (`O_PATH`, `RESOLVE_BENEATH`: see the module
/// docs) and says what it is; NOT_FOUND when it does not exist, INVALID_ARGUMENT when it leads
/// out of the image or is neither a directory nor a regular file.
fn open_sub_path(root: &Path, m: &cri::Mount, image: &str) -> Result<(OwnedFd, Found)> {
    use nix::errno::Errno;
    use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
    let sub = &m.image_sub_path;
    let what = || {
        format!(
            "image volume {:?}: image_sub_path {sub:?} of image {image}",
            m.container_path
        )
    };
    let dir = nix::fcntl::open(
        root,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|e| Error::Internal(format!("opening {}: {e}", root.display())))?;
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    let found = nix::fcntl::openat2(&dir, sub.as_str(), how).map_err(|e| match e {
        Errno::ENOENT | Errno::ENOTDIR => Error::NotFound(format!("{} does not exist", what())),
        Errno::EXDEV => Error::InvalidArgument(format!(
            "{} leads outside the image (through an absolute symlink or one that climbs above \
             the image's root)",
            what()
        )),
        Errno::ELOOP => Error::InvalidArgument(format!("{}: too many symlinks", what())),
        Errno::ENOSYS => Error::FailedPrecondition(format!(
            "{}: resolving it safely needs openat2(2) (Linux >= 5.6)",
            what()
        )),
        e => Error::Internal(format!("{}: {e}", what())),
    })?;
    let st = nix::sys::stat::fstat(&found)
        .map_err(|e| Error::Internal(format!("{}: stat: {e}", what())))?;
    let kind = match st.st_mode & libc::S_IFMT {
        libc::S_IFDIR => Found::Dir,
        libc::S_IFREG => Found::File,
        _ => {
            return Err(Error::InvalidArgument(format!(
                "{} is neither a directory nor a regular file",
                what()
            )));
        }
    };
    Ok((found, kind))
}

/// Binds `m.image_sub_path` of the image mounted at `root` read-only at `target` (made a
/// directory or an empty file, as it is), through the descriptor [`open_sub_path`] opened: what
/// was checked is what is bound.
fn bind_sub_path(root: &Path, m: &cri::Mount, image: &str, target: &Path) -> Result<()> {
    let (found, kind) = open_sub_path(root, m, image)?;
    let made = match kind {
        Found::Dir => std::fs::create_dir(target),
        Found::File => std::fs::File::create(target).map(drop),
    };
    match made {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            return Err(Error::Internal(format!(
                "creating {}: {e}",
                target.display()
            )));
        }
        _ => {}
    }
    // The kernel follows the descriptor's magic link.
    minicri_snapshotter::Mount {
        fstype: "bind".into(),
        source: format!("/proc/self/fd/{}", found.as_raw_fd()),
        options: vec!["ro".into()],
    }
    .mount_at(target)?;
    Ok(())
}

impl PodService {
    /// Sets up the image volumes among `mounts` of container `id` (whose directory `dir` exists
    /// and is private): see the module docs. `userns` is the pod's user namespace and the host
    /// ids of its root, when it has one. Every step is journaled in `undo` before it is taken.
    /// The image must be on the node: NOT_FOUND naming it otherwise.
    pub(crate) async fn mount_image_volumes(
        &self,
        id: &str,
        mounts: &[cri::Mount],
        userns: Option<&(PathBuf, (u32, u32))>,
        undo: &mut Journal,
    ) -> Result<Vec<ImageVolume>> {
        let dir = self.container_dir(id);
        let idmap = self.idmap_dir(id);
        let mut volumes = Vec::new();
        let asked = mounts
            .iter()
            .enumerate()
            .filter_map(|(i, m)| crate::spec::container::image_of(m).map(|name| (i, m, name)));
        for (n, (index, m, name)) in asked.enumerate() {
            let image = self.images.image(name)?.ok_or_else(|| {
                Error::NotFound(format!(
                    "image {name:?} of image volume {:?} is not on the node (PullImage it first)",
                    m.container_path
                ))
            })?;
            let chain = image.chain_id.clone().ok_or_else(|| {
                Error::FailedPrecondition(format!(
                    "image {name:?} of image volume {:?} has no unpacked layers to mount",
                    m.container_path
                ))
            })?;
            undo.push(Undo::ReleaseImageVolume {
                image: image.id.clone(),
                container: id.to_string(),
            })?;
            {
                let (images, image, id) = (self.images.clone(), image.id.clone(), id.to_string());
                blocking(move || images.hold_for_volume(&image, &id)).await?;
            }
            let key = snapshot_key(id, n);
            let root = volume_dir(&dir, n).join("image");
            let source = if m.image_sub_path.is_empty() {
                root.clone()
            } else {
                volume_dir(&dir, n).join("sub")
            };
            undo.push(Undo::RemoveSnapshot(key.clone()))?;
            undo.push(Undo::Unmount(root.clone()))?;
            if source != root {
                undo.push(Undo::Unmount(source.clone()))?;
            }
            let (images, m) = (self.images.clone(), m.clone());
            let (userns, layers) = (userns.cloned(), idmapped_layers(&idmap, n));
            let (key2, root2, source2, image_id) = (
                key.clone(),
                root.clone(),
                source.clone(),
                image.id.to_string(),
            );
            blocking(move || {
                let view = images.view(&key2, &chain)?;
                std::fs::create_dir_all(&root2)
                    .map_err(|e| Error::Internal(format!("creating {}: {e}", root2.display())))?;
                match &userns {
                    Some((ns, ids)) => {
                        crate::spec::userns::mount_rootfs(&view, &root2, &layers, ns, *ids)?;
                    }
                    None => view.mount_at(&root2)?,
                }
                if source2 != root2 {
                    bind_sub_path(&root2, &m, &image_id, &source2)?;
                }
                Ok(())
            })
            .await?;
            volumes.push(ImageVolume {
                mount: index,
                image_id: image.id,
                snapshot: key,
                root,
                source,
            });
        }
        Ok(volumes)
    }

    /// Tears down what [`Self::mount_image_volumes`] made (the mounts must be gone: see
    /// [`unmount`]): removes the views, then lets go of the images (an image kept only for one
    /// of them is removed). Idempotent.
    pub(crate) async fn release_image_volumes(
        &self,
        id: &str,
        volumes: &[ImageVolume],
    ) -> Result<()> {
        let images = self.images.clone();
        let (id, volumes) = (id.to_string(), volumes.to_vec());
        blocking(move || {
            for v in &volumes {
                images.remove_snapshot(&v.snapshot)?;
            }
            for v in &volumes {
                images.release_volume(&v.image_id, &id)?;
            }
            Ok(())
        })
        .await
    }

    /// At start, before the CRI is served: the containers (also those being torn down) are the
    /// volume users of the images their volumes mount again, then the images kept only for
    /// volume users that are gone are removed.
    pub(crate) fn restore_image_volume_users(&self) {
        let records = self
            .store
            .containers()
            .into_iter()
            .chain(self.store.removals());
        for c in records {
            for v in &c.image_volumes {
                if let Err(e) = self.images.hold_for_volume(&v.image_id, &c.id) {
                    // Its view still holds the layers: the volume works, the image is not
                    // listed.
                    tracing::warn!(container = %c.id, image = %v.image_id, error = %e, "image of an image volume is gone");
                }
            }
        }
        if let Err(e) = self.images.drop_unused_volume_images() {
            tracing::warn!(error = %e, "removing images kept for image volumes that are gone");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount(sub: &str) -> cri::Mount {
        cri::Mount {
            container_path: "/v".into(),
            image: Some(cri::ImageSpec {
                image: "sha256:abc".into(),
                ..Default::default()
            }),
            image_sub_path: sub.into(),
            ..Default::default()
        }
    }

    #[test]
    fn sub_paths_resolve_only_beneath_the_image() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        std::fs::create_dir_all(r.join("a/b")).unwrap();
        std::fs::write(r.join("a/b/f"), b"x").unwrap();
        std::os::unix::fs::symlink("b", r.join("a/in")).unwrap();
        std::os::unix::fs::symlink("../..", r.join("a/up")).unwrap();
        std::os::unix::fs::symlink("/etc", r.join("a/abs")).unwrap();
        std::os::unix::fs::symlink("loop", r.join("a/loop")).unwrap();
        nix::unistd::mkfifo(&r.join("a/fifo"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        let open = |sub: &str| open_sub_path(r, &mount(sub), "sha256:abc").map(|(_, k)| k);
        assert_eq!(open("a/b").unwrap(), Found::Dir);
        assert_eq!(open("a/in/f").unwrap(), Found::File);
        assert_eq!(
            open("a/in").unwrap(),
            Found::Dir,
            "a last symlink is followed"
        );
        assert_eq!(
            open("a/b/../b/f").unwrap(),
            Found::File,
            "'..' staying inside"
        );
        for (sub, want) in [
            ("a/missing", "does not exist"),
            ("a/b/f/under", "does not exist"),
            ("a/up", "leads outside the image"),
            ("a/up/etc", "leads outside the image"),
            ("a/abs", "leads outside the image"),
            ("a/loop", "too many symlinks"),
            ("a/fifo", "neither a directory nor a regular file"),
        ] {
            let err = open(sub).unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.contains(want) && msg.contains(&format!("{sub:?}")),
                "{sub}: {msg}"
            );
            let code = if want == "does not exist" {
                tonic::Code::NotFound
            } else {
                tonic::Code::InvalidArgument
            };
            assert_eq!(err.code(), code, "{sub}: {msg}");
        }
    }

    fn volume(mount: usize, source: &str) -> ImageVolume {
        ImageVolume {
            mount,
            image_id: minicri_store::Digest::parse(&format!("sha256:{}", "a".repeat(64))).unwrap(),
            snapshot: format!("c.volume.{mount}"),
            root: PathBuf::from("/s/containers/c/volumes/0/image"),
            source: PathBuf::from(source),
        }
    }

    #[test]
    fn the_spec_binds_where_the_volume_is_mounted_and_the_status_names_the_image_by_id() {
        let plain = cri::Mount {
            container_path: "/data".into(),
            host_path: "/h".into(),
            propagation: cri::MountPropagation::PropagationHostToContainer as i32,
            ..Default::default()
        };
        let mut asked = mount("x");
        asked.propagation = cri::MountPropagation::PropagationHostToContainer as i32;
        asked.uid_mappings = vec![cri::IdMapping {
            host_id: 1000,
            container_id: 0,
            length: 10,
        }];
        asked.image.as_mut().unwrap().image = "models:v1".into();
        let mounts = vec![plain.clone(), asked];
        let vols = vec![volume(1, "/s/containers/c/volumes/0/sub")];
        let bound = spec_mounts(&mounts, &vols);
        assert_eq!(bound[0], plain, "other mounts untouched");
        assert_eq!(bound[1].host_path, "/s/containers/c/volumes/0/sub");
        assert!(bound[1].uid_mappings.is_empty());
        assert_eq!(
            bound[1].propagation,
            cri::MountPropagation::PropagationPrivate as i32
        );
        let status = status_mounts(mounts.clone(), &vols);
        let image = status[1].image.as_ref().unwrap();
        assert_eq!(image.image, vols[0].image_id.as_str());
        assert_eq!(
            image.user_specified_image, "models:v1",
            "the name it was asked by"
        );
        assert_eq!(status[1].host_path, "", "as asked");
        assert!(status[1].readonly, "as mounted");
        assert_eq!(status[0], plain);
    }
}

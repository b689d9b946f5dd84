//! What differs between the two backends: how a snapshot's directory is laid out when it is created,
//! how a layer is applied into it, and what mount exposes it. Everything else (records, reference
//! counting, commit by rename) is shared in `store.rs`.
//!
//! Directory of snapshot `<id>`: `<root>/snapshots/<id>/fs` (the layer, upper or tree), plus
//! `<root>/snapshots/<id>/work` for an active overlay snapshot (overlayfs's workdir).

pub(crate) mod copy;
pub(crate) mod overlay;

use std::io::Read;
use std::path::{Path, PathBuf};

use crate::apply::{self, CopyTarget, OverlayTarget};
use crate::error::{Error, IoContext, Result};
use crate::fsutil;
use crate::mount::Mount;
use crate::snapshotter::{Backend, Kind};

/// Creates the contents of a new snapshot directory `dir` for a snapshot of `kind` whose parent
/// chain has the layer directories `lowers` (topmost first).
pub(crate) fn populate(backend: Backend, kind: Kind, dir: &Path, lowers: &[PathBuf]) -> Result<()> {
    let fs_dir = dir.join("fs");
    std::fs::create_dir(&fs_dir).ctx(|| format!("creating {}", fs_dir.display()))?;
    match backend {
        Backend::Overlay => overlay::populate(kind, dir, lowers),
        Backend::Copy => copy::populate(kind, dir, lowers),
    }
}

/// Applies the uncompressed layer `tar` into the new snapshot directory `dir` (with `fs` created by
/// [`populate`] for a committed snapshot); `write_behind` as [`apply::apply_tar`]'s.
pub(crate) fn apply(
    backend: Backend,
    dir: &Path,
    lowers: &[PathBuf],
    tar: impl Read,
    limits: apply::Limits,
    write_behind: bool,
) -> Result<()> {
    let fs_dir = dir.join("fs");
    match backend {
        Backend::Overlay => {
            let mut t = OverlayTarget::new(fs_dir, lowers.to_vec());
            apply::apply_tar(&mut t, tar, limits, write_behind)
        }
        Backend::Copy => {
            let mut t = CopyTarget::new(fs_dir);
            apply::apply_tar(&mut t, tar, limits, write_behind)
        }
    }
}

/// Applies the uncompressed layer `tar` into the new overlay snapshot directory `dir` before its
/// parent layers exist; returns what the result assumed about them (see [`apply::rebase`]).
pub(crate) fn apply_detached(
    dir: &Path,
    tar: impl Read,
    limits: apply::Limits,
    write_behind: bool,
) -> Result<apply::Detached> {
    let mut t = OverlayTarget::detached(dir.join("fs"));
    apply::apply_tar(&mut t, tar, limits, write_behind)?;
    Ok(t.into_detached().expect("a detached target"))
}

/// The mount of an active snapshot or view in `dir` with parent layers `lowers` (topmost first).
pub(crate) fn mount(backend: Backend, kind: Kind, dir: &Path, lowers: &[PathBuf]) -> Result<Mount> {
    match (backend, kind) {
        (_, Kind::Committed) => Err(Error::InvalidArgument(
            "committed snapshots are not mounted; create a view or an active snapshot".into(),
        )),
        (Backend::Overlay, kind) => Ok(overlay::mount(kind, dir, lowers)),
        (Backend::Copy, kind) => Ok(copy::mount(kind, dir, lowers)),
    }
}

pub(crate) fn bind(source: &Path, read_only: bool) -> Mount {
    Mount {
        fstype: "bind".into(),
        source: source.to_string_lossy().into_owned(),
        options: vec!["rbind".into(), if read_only { "ro" } else { "rw" }.into()],
    }
}

/// Gives `dir` the metadata of the root of the topmost parent layer, or 0755 without a parent.
pub(crate) fn copy_root_meta(dir: &Path, lowers: &[PathBuf]) -> Result<()> {
    match lowers.first() {
        Some(top) => {
            let m = std::fs::symlink_metadata(top).ctx(|| format!("stat {}", top.display()))?;
            fsutil::copy_meta(top, dir, &m)
                .ctx(|| format!("copying root metadata to {}", dir.display()))
        }
        None => fsutil::set_mode(dir, 0o755).ctx(|| format!("chmod {}", dir.display())),
    }
}

/// Records the backend in `<root>/backend` on first use and refuses a root used with the other one.
pub(crate) fn check_marker(root: &Path, backend: Backend) -> Result<()> {
    let marker = root.join("backend");
    let name = match backend {
        Backend::Overlay => "overlay",
        Backend::Copy => "copy",
    };
    match std::fs::read_to_string(&marker) {
        Ok(found) if found.trim() == name => Ok(()),
        Ok(found) => Err(Error::InvalidArgument(format!(
            "{} holds {} snapshots, not {name}",
            root.display(),
            found.trim()
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::write(&marker, name).ctx(|| format!("writing {}", marker.display()))
        }
        Err(e) => Err(Error::io(format!("reading {}", marker.display()), e)),
    }
}

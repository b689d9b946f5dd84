//! The copy backend: every snapshot directory is a complete tree. A new snapshot starts as a copy of
//! its parent's tree (owners, modes, xattrs, hardlinks, devices and times preserved); whiteouts are
//! applied as deletions. Works on any filesystem, at the price of space and time per layer.
//!
//! Invariant: a committed tree is never written after its commit; active snapshots are their own
//! copies, and views bind-mount the parent's tree read-only instead of copying it.

use std::path::{Path, PathBuf};

use crate::error::{IoContext, Result};
use crate::fsutil;
use crate::mount::Mount;
use crate::snapshotter::Kind;

pub(crate) fn populate(kind: Kind, dir: &Path, lowers: &[PathBuf]) -> Result<()> {
    let fs_dir = dir.join("fs");
    match (kind, lowers.first()) {
        (Kind::View, _) => Ok(()),
        (_, Some(parent)) => fsutil::copy_tree(parent, &fs_dir)
            .ctx(|| format!("copying {} to {}", parent.display(), fs_dir.display())),
        (_, None) => super::copy_root_meta(&fs_dir, lowers),
    }
}

pub(crate) fn mount(kind: Kind, dir: &Path, lowers: &[PathBuf]) -> Mount {
    match (kind, lowers.first()) {
        (Kind::View, Some(parent)) => super::bind(parent, true),
        (Kind::View, None) => super::bind(&dir.join("fs"), true),
        _ => super::bind(&dir.join("fs"), false),
    }
}

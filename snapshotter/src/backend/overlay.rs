//! The overlayfs backend: every committed snapshot directory holds one layer in overlayfs's own form
//! (whiteouts as 0/0 character devices, opaque directories marked with `trusted.overlay.opaque`), and a
//! stack is an overlay mount of the chain's layer directories. An active snapshot adds an upper and a
//! work directory; a view is a read-only overlay (or a read-only bind of a single layer, since overlayfs
//! wants two lower layers when there is no upper).
//!
//! Invariant: a layer directory is never written after its commit; only an active snapshot's `fs` is.

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{Error, IoContext, Result};
use crate::fsutil;
use crate::mount::{Mount, unmount};
use crate::snapshotter::Kind;

/// Options every overlay mount gets. `index=off`: the same lower layers are mounted under many
/// upper directories, which the inode index feature refuses.
const BASE_OPTIONS: &[&str] = &["index=off"];

pub(crate) fn populate(kind: Kind, dir: &Path, lowers: &[PathBuf]) -> Result<()> {
    match kind {
        Kind::Active => {
            let work = dir.join("work");
            fs::create_dir(&work).ctx(|| format!("creating {}", work.display()))?;
            // overlayfs shows the upper root's attributes for the merged root.
            super::copy_root_meta(&dir.join("fs"), lowers)
        }
        Kind::Committed => super::copy_root_meta(&dir.join("fs"), lowers),
        Kind::View => Ok(()),
    }
}

fn lowerdir(lowers: &[PathBuf]) -> String {
    let dirs: Vec<_> = lowers
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    format!("lowerdir={}", dirs.join(":"))
}

pub(crate) fn mount(kind: Kind, dir: &Path, lowers: &[PathBuf]) -> Mount {
    let upper = dir.join("fs");
    match (kind, lowers.len()) {
        (Kind::Active, 0) => super::bind(&upper, false),
        (Kind::View, 0) => super::bind(&upper, true),
        (Kind::View, 1) => super::bind(&lowers[0], true),
        (kind, _) => {
            let mut options: Vec<String> = Vec::new();
            if kind == Kind::View {
                options.push("ro".into());
            }
            options.extend(BASE_OPTIONS.iter().map(|s| s.to_string()));
            options.push(lowerdir(lowers));
            if kind == Kind::Active {
                options.push(format!("upperdir={}", upper.display()));
                options.push(format!("workdir={}", dir.join("work").display()));
            }
            Mount {
                fstype: "overlay".into(),
                source: "overlay".into(),
                options,
            }
        }
    }
}

/// Checks that overlayfs works with layer directories under `dir`: the root path has no character
/// overlayfs options cannot carry, a two-layer overlay with upper mounts, and whiteouts (a 0/0 device
/// and the trusted opaque xattr) can be created.
pub fn check_support(dir: &Path) -> Result<()> {
    let text = dir.to_string_lossy();
    if text.contains([',', ':', '\\']) || text.contains(char::is_whitespace) {
        return Err(Error::OverlayUnsupported(format!(
            "{} contains a character overlayfs options cannot carry",
            dir.display()
        )));
    }
    let probe = tempfile_dir(dir)?;
    let result = probe_in(&probe);
    let _ = fs::remove_dir_all(&probe);
    result.map_err(|e| Error::OverlayUnsupported(e.to_string()))
}

fn tempfile_dir(dir: &Path) -> Result<PathBuf> {
    let probe = dir.join(format!(
        ".overlay-probe-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let _ = fs::remove_dir_all(&probe);
    fs::create_dir_all(&probe).ctx(|| format!("creating {}", probe.display()))?;
    Ok(probe)
}

fn probe_in(probe: &Path) -> Result<()> {
    for d in ["l1", "l2", "u", "w", "m"] {
        fs::create_dir(probe.join(d)).ctx(|| format!("creating {d} in {}", probe.display()))?;
    }
    fs::write(probe.join("l1/f"), b"x").ctx(|| "writing probe file".into())?;
    fsutil::make_whiteout(&probe.join("l2/f")).ctx(|| "creating a whiteout device".into())?;
    fsutil::set_opaque(&probe.join("l2")).ctx(|| "setting trusted.overlay.opaque".into())?;
    let m = Mount {
        fstype: "overlay".into(),
        source: "overlay".into(),
        options: vec![
            "index=off".into(),
            format!(
                "lowerdir={}:{}",
                probe.join("l2").display(),
                probe.join("l1").display()
            ),
            format!("upperdir={}", probe.join("u").display()),
            format!("workdir={}", probe.join("w").display()),
        ],
    };
    m.mount_at(&probe.join("m"))?;
    let hidden = !probe.join("m/f").exists();
    unmount(&probe.join("m"))?;
    if !hidden {
        return Err(Error::OverlayUnsupported(
            "whiteout did not hide the lower file".into(),
        ));
    }
    Ok(())
}

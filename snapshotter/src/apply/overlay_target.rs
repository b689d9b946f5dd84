//! The overlayfs backend's layer target: entries go into the layer's own (initially empty) directory,
//! which later serves as one `lowerdir` of the stack; the parent layers are read, never written.
//!
//! The view is computed the way overlayfs merges directories: the topmost layer that has a path wins;
//! a 0/0 character device (whiteout) hides the path in every layer below; a directory carrying
//! `trusted.overlay.opaque=y` hides what the layers below have under it; a non-directory hides
//! everything below it.
//!
//! Invariants of the layer directory this produces:
//! - its root carries the merged root's metadata (overlayfs shows the top layer's root attributes);
//! - a directory the layer writes into but does not list is copied up with the lower directory's
//!   owner, mode, xattrs and mtime, so the merged view keeps them;
//! - OCI whiteouts become 0/0 character devices, opaque markers become the opaque xattr, and a
//!   directory created where a lower non-directory or whited-out path was is marked opaque;
//! - a hardlink to a file of a lower layer copies that file up first, then links to the copy.
//!
//! A *detached* target ([`OverlayTarget::detached`]) applies a layer before its parent layers exist,
//! for unpacking the layers of an image at once. It sees no lowers, and records every place where
//! its result assumed "the parent has nothing here" ([`Detached`]). Once the parent is committed,
//! [`rebase`] checks those assumptions against the real parent: where every one holds, the
//! directory is what an apply on top of the parent would have written, after giving the
//! directories the layer only wrote into (and the root) the parent's metadata, as a copy-up does;
//! where one does not, the caller applies the layer again, on top of the parent.

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::ffi::OsStr;
use std::fs::{self, Metadata};
use std::io;
use std::path::{Path, PathBuf};

use super::target::PathError;
use super::target::{Created, DirTimes, NodeType, Room, Target, not_a_dir};
use crate::fsutil;

pub(crate) struct OverlayTarget {
    upper: PathBuf,
    /// Parent layer directories, topmost first.
    lowers: Vec<PathBuf>,
    /// What the layer wrote, as opposed to what was copied up for it.
    created: Created,
    times: DirTimes,
    /// Set when applying without the parent layers: what the result assumed about them.
    detached: Option<RefCell<Detached>>,
    /// Directories created without an entry of their own (see [`Target::implicit_dirs`]).
    implicit_dirs: u64,
}

/// Why a detached apply looked below its own directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Probe {
    /// Resolving an entry's directory: a directory below would change nothing.
    Resolve,
    /// Creating a parent directory the layer does not list: a directory below lends its metadata.
    ImplicitDir,
    /// A whiteout's or a hardlink's target: anything below changes the result.
    Exact,
}

/// What a detached apply assumed the parent layers do not have, in the order it asked.
#[derive(Debug, Default)]
pub(crate) struct Detached {
    probes: Vec<(PathBuf, Probe)>,
    /// Paths of whiteouts and opaque markers: their effect depends on which directories the layer
    /// created, so a directory below at or under one of them cannot be patched in afterwards.
    covered: Vec<PathBuf>,
    /// Paths the layer has entries for (an implicit directory listed later is one).
    listed: BTreeSet<PathBuf>,
}

impl Detached {
    /// Whether the layer has an entry for its root; if not, the root takes the parent's metadata.
    pub(crate) fn lists_root(&self) -> bool {
        self.listed.contains(Path::new(""))
    }
}

impl OverlayTarget {
    /// `upper` is the layer's empty directory, its root already given the merged root's metadata.
    pub(crate) fn new(upper: PathBuf, lowers: Vec<PathBuf>) -> Self {
        OverlayTarget {
            upper,
            lowers,
            created: Created::default(),
            times: DirTimes::default(),
            detached: None,
            implicit_dirs: 0,
        }
    }

    /// A target for applying into `upper` before the parent layers exist; see the module doc.
    pub(crate) fn detached(upper: PathBuf) -> Self {
        OverlayTarget {
            detached: Some(RefCell::default()),
            ..Self::new(upper, Vec::new())
        }
    }

    /// What a detached apply assumed (None for a target with its lowers).
    pub(crate) fn into_detached(self) -> Option<Detached> {
        self.detached.map(RefCell::into_inner)
    }

    /// The merged view at `rel`: the layer directory path that provides it, and its metadata.
    fn lookup(&self, rel: &Path) -> io::Result<Option<(PathBuf, Metadata)>> {
        self.lookup_for(rel, Probe::Resolve)
    }

    /// [`Self::lookup`]; a detached target records that its answer assumed nothing below `rel`.
    fn lookup_for(&self, rel: &Path, why: Probe) -> io::Result<Option<(PathBuf, Metadata)>> {
        let Some(d) = &self.detached else {
            return lookup_in(std::iter::once(&self.upper).chain(self.lowers.iter()), rel);
        };
        match lookup_layer(&self.upper, rel)? {
            Step::Found(p, m) => Ok(Some((p, m))),
            Step::Hidden => Ok(None),
            Step::Below => {
                d.borrow_mut().probes.push((rel.to_path_buf(), why));
                Ok(None)
            }
        }
    }

    fn note_parent(&mut self, rel: &Path) -> io::Result<()> {
        let parent = rel.parent().unwrap_or(Path::new(""));
        self.times.note(&self.upper, parent)
    }
}

/// What one layer says about a path in overlayfs's lookup.
enum Step {
    /// The layer has the path.
    Found(PathBuf, Metadata),
    /// The layer hides the path from the layers below (a whiteout, a non-directory or an opaque
    /// directory on the way).
    Hidden,
    /// The layer leaves the path to the layers below.
    Below,
}

/// Walks `rel` down `layer` one component at a time from a descriptor of the directory above it,
/// so that a lookup costs one short path resolution per component, not one of the whole prefix
/// for each (a path 2,000 directories deep made every lookup 2,000 resolutions of up to 2,000
/// components).
fn lookup_layer(layer: &Path, rel: &Path) -> io::Result<Step> {
    use nix::fcntl::AtFlags;
    use nix::sys::stat::{SFlag, fstatat};
    let comps: Vec<_> = rel.components().collect();
    if comps.is_empty() {
        let m = fs::symlink_metadata(layer)?;
        return Ok(Step::Found(layer.to_path_buf(), m));
    }
    let mut dir = match fsutil::open_dir_nofollow(None, layer) {
        Ok(d) => d,
        // A layer without the directory has nothing there (as an lstat of the path would say).
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Step::Below),
        Err(e) => return Err(e),
    };
    let mut hides_below = false;
    for (i, c) in comps.iter().enumerate() {
        let name = c.as_os_str();
        let st = match fstatat(&dir, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(nix::errno::Errno::ENOENT) => {
                return Ok(if hides_below {
                    Step::Hidden
                } else {
                    Step::Below
                });
            }
            Err(e) => return Err(e.into()),
        };
        let kind = SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT;
        if kind == SFlag::S_IFCHR && st.st_rdev == 0 {
            // A whiteout.
            return Ok(Step::Hidden);
        }
        if i + 1 == comps.len() {
            let p = layer.join(rel);
            let m = fs::symlink_metadata(&p)?;
            return Ok(Step::Found(p, m));
        }
        if kind != SFlag::S_IFDIR {
            return Ok(Step::Hidden);
        }
        dir = fsutil::open_dir_nofollow(Some(&dir), Path::new(name))?;
        if fsutil::is_opaque_fd(&dir)? {
            hides_below = true;
        }
    }
    unreachable!("the last component returns")
}

/// overlayfs's lookup over `layers` (topmost first).
pub(crate) fn lookup_in<'a>(
    layers: impl Iterator<Item = &'a PathBuf>,
    rel: &Path,
) -> io::Result<Option<(PathBuf, Metadata)>> {
    for layer in layers {
        match lookup_layer(layer, rel)? {
            Step::Found(p, m) => return Ok(Some((p, m))),
            Step::Hidden => return Ok(None),
            Step::Below => {}
        }
    }
    Ok(None)
}

/// Checks a detached apply's assumptions (`d`) against the parent layers `lowers` (topmost first)
/// and, where they hold, finishes the layer directory `upper` as an apply on top of them would
/// have: directories the layer only wrote into take the parent's metadata (the root is the
/// caller's: see [`Detached::lists_root`]). `Err(reason)` names the first assumption that fails;
/// `upper` is then to be thrown away and the layer applied again on top of the parent.
pub(crate) fn rebase(
    upper: &Path,
    d: &Detached,
    lowers: &[PathBuf],
) -> io::Result<Result<(), String>> {
    let below = |rel: &Path| lookup_in(lowers.iter(), rel);
    let mut patch = Vec::new();
    for (rel, why) in &d.probes {
        // Every directory on the way must resolve below as it did here: no symlink, no file.
        let mut prefix = PathBuf::new();
        for c in rel.parent().unwrap_or(Path::new("")).components() {
            prefix.push(c);
            if let Some((_, m)) = below(&prefix)?
                && !m.is_dir()
            {
                return Ok(Err(format!(
                    "{} is not a directory in the parent",
                    prefix.display()
                )));
            }
        }
        match (below(rel)?, why) {
            (None, _) => {}
            (Some((_, m)), Probe::Resolve) if m.is_dir() => {}
            (Some((lp, m)), Probe::ImplicitDir) if m.is_dir() => {
                if d.listed.contains(rel) {
                    return Ok(Err(format!(
                        "{} is listed after entries under it",
                        rel.display()
                    )));
                }
                if let Some(c) = d.covered.iter().find(|c| rel.starts_with(c)) {
                    return Ok(Err(format!(
                        "the whiteout or opaque marker at {} covers {}, which the parent has",
                        c.display(),
                        rel.display()
                    )));
                }
                patch.push((rel, lp, m));
            }
            (Some(_), _) => {
                return Ok(Err(format!("the parent has {}", rel.display())));
            }
        }
    }
    for (rel, lower, m) in patch {
        let up = upper.join(rel);
        match fsutil::lstat(&up)? {
            Some(now) if now.is_dir() => fsutil::copy_meta(&lower, &up, &m)?,
            _ => {
                return Ok(Err(format!(
                    "{} was replaced after the layer wrote into it",
                    rel.display()
                )));
            }
        }
    }
    Ok(Ok(()))
}

impl Target for OverlayTarget {
    fn root(&self) -> &Path {
        &self.upper
    }

    fn node(&self, rel: &Path) -> io::Result<Option<NodeType>> {
        Ok(self.lookup(rel)?.map(|(_, m)| NodeType::of(&m)))
    }

    fn read_link(&self, rel: &Path) -> io::Result<PathBuf> {
        match self.lookup(rel)? {
            Some((p, _)) => fs::read_link(p),
            None => Err(io::ErrorKind::NotFound.into()),
        }
    }

    fn ensure_dir(&mut self, rel: &Path) -> io::Result<()> {
        if fsutil::lstat(&self.upper.join(rel))?.is_some_and(|m| m.is_dir()) {
            return Ok(());
        }
        let mut prefix = PathBuf::new();
        for c in rel.components() {
            prefix.push(c);
            let up = self.upper.join(&prefix);
            match fsutil::lstat(&up)? {
                Some(m) if m.is_dir() => continue,
                Some(m) if fsutil::is_whiteout(&m) => {
                    // Deleted below by this layer and now needed again: a fresh, opaque directory.
                    self.note_parent(&prefix)?;
                    fs::remove_file(&up)?;
                    fs::create_dir(&up)?;
                    self.implicit_dirs += 1;
                    fsutil::set_mode(&up, 0o755)?;
                    fsutil::set_opaque(&up)?;
                    self.created.insert(&prefix);
                }
                Some(_) => return Err(not_a_dir(&prefix)),
                None => {
                    let lower = self.lookup_for(&prefix, Probe::ImplicitDir)?;
                    self.note_parent(&prefix)?;
                    fs::create_dir(&up)?;
                    self.implicit_dirs += 1;
                    match lower {
                        Some((lp, m)) if m.is_dir() => {
                            fsutil::copy_meta(&lp, &up, &m)?;
                            self.times.set(&self.upper, &prefix, fsutil::mtime_of(&m))?;
                        }
                        Some(_) => {
                            // A lower non-directory: the new directory must not merge with anything.
                            fsutil::set_mode(&up, 0o755)?;
                            fsutil::set_opaque(&up)?;
                            self.created.insert(&prefix);
                        }
                        None => {
                            fsutil::set_mode(&up, 0o755)?;
                            self.created.insert(&prefix);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn make_room(&mut self, rel: &Path, for_dir: bool) -> io::Result<Room> {
        let up = self.upper.join(rel);
        match fsutil::lstat(&up)? {
            None => Ok(Room::Free),
            Some(m) if m.is_dir() && for_dir => Ok(Room::KeepDir),
            Some(m) => {
                crate::tree::remove_all(&up)?;
                // Whatever was here replaced the lower content; a directory in its place must too.
                Ok(if for_dir && !m.is_dir() {
                    Room::FreeOpaque
                } else {
                    Room::Free
                })
            }
        }
    }

    fn whiteout(&mut self, rel: &Path) -> io::Result<()> {
        if let Some(d) = &self.detached {
            d.borrow_mut().covered.push(rel.to_path_buf());
        }
        let up = self.upper.join(rel);
        let existing = fsutil::lstat(&up)?;
        if self.created.at_or_under(rel) {
            // This layer wrote here too: hide only what lies below.
            return match existing {
                Some(m) if m.is_dir() => {
                    self.created.strip(&self.upper, rel, &mut self.times)?;
                    fsutil::set_opaque(&up)
                }
                _ => Ok(()),
            };
        }
        if existing.is_some() {
            // Only copied up (for a hardlink or as a parent): drop the copy, then hide the lower one.
            self.note_parent(rel)?;
            crate::tree::remove_all(&up)?;
        }
        if self.lookup_for(rel, Probe::Exact)?.is_none() {
            return Ok(());
        }
        let parent = rel.parent().unwrap_or(Path::new(""));
        self.ensure_dir(parent)?;
        self.note_parent(rel)?;
        fsutil::make_whiteout(&up)
    }

    fn opaque(&mut self, dir: &Path) -> io::Result<()> {
        if let Some(d) = &self.detached {
            d.borrow_mut().covered.push(dir.to_path_buf());
        }
        self.created.insert(dir);
        self.created.strip(&self.upper, dir, &mut self.times)?;
        fsutil::set_opaque(&self.upper.join(dir))
    }

    fn copy_up_bytes(&self, rel: &Path) -> io::Result<u64> {
        Ok(match self.lookup_for(rel, Probe::Exact)? {
            // What the copy will hold on disk: its holes stay holes.
            Some((path, m)) if !m.is_dir() && path != self.upper.join(rel) => m
                .len()
                .min(std::os::unix::fs::MetadataExt::blocks(&m).saturating_mul(512)),
            _ => 0,
        })
    }

    fn link_source(&mut self, rel: &Path) -> Result<PathBuf, PathError> {
        let Some((path, m)) = self.lookup_for(rel, Probe::Exact)? else {
            return Err(PathError::Invalid(format!(
                "hardlink target {} does not exist",
                rel.display()
            )));
        };
        if m.is_dir() {
            return Err(PathError::Invalid(format!(
                "hardlink target {} is a directory",
                rel.display()
            )));
        }
        let up = self.upper.join(rel);
        if path != up {
            // Copy the lower file up so both names live in this layer.
            let parent = rel.parent().unwrap_or(Path::new(""));
            self.ensure_dir(parent)?;
            self.note_parent(rel)?;
            fsutil::copy_node(&path, &up, &m)?;
        }
        Ok(up)
    }

    fn created(&mut self, rel: &Path) {
        if let Some(d) = &self.detached {
            d.borrow_mut().listed.insert(rel.to_path_buf());
        }
        self.created.insert(rel);
    }

    fn keep_xattr(&self, name: &OsStr) -> bool {
        name == fsutil::OVERLAY_OPAQUE
    }

    fn implicit_dirs(&self) -> u64 {
        self.implicit_dirs
    }

    fn times(&mut self) -> &mut DirTimes {
        &mut self.times
    }
}

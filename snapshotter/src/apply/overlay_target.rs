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

use std::ffi::OsStr;
use std::fs::{self, Metadata};
use std::io;
use std::path::{Path, PathBuf};

use super::path::PathError;
use super::target::{Created, DirTimes, NodeType, Room, Target, not_a_dir};
use crate::fsutil;

pub(crate) struct OverlayTarget {
    upper: PathBuf,
    /// Parent layer directories, topmost first.
    lowers: Vec<PathBuf>,
    /// What the layer wrote, as opposed to what was copied up for it.
    created: Created,
    times: DirTimes,
}

impl OverlayTarget {
    /// `upper` is the layer's empty directory, its root already given the merged root's metadata.
    pub(crate) fn new(upper: PathBuf, lowers: Vec<PathBuf>) -> Self {
        OverlayTarget {
            upper,
            lowers,
            created: Created::default(),
            times: DirTimes::default(),
        }
    }

    /// The merged view at `rel`: the layer directory path that provides it, and its metadata.
    fn lookup(&self, rel: &Path) -> io::Result<Option<(PathBuf, Metadata)>> {
        lookup_in(std::iter::once(&self.upper).chain(self.lowers.iter()), rel)
    }

    fn note_parent(&mut self, rel: &Path) -> io::Result<()> {
        let parent = rel.parent().unwrap_or(Path::new(""));
        self.times.note(&self.upper, parent)
    }
}

/// overlayfs's lookup over `layers` (topmost first).
pub(crate) fn lookup_in<'a>(
    layers: impl Iterator<Item = &'a PathBuf>,
    rel: &Path,
) -> io::Result<Option<(PathBuf, Metadata)>> {
    let comps: Vec<_> = rel.components().collect();
    for layer in layers {
        let mut p = layer.clone();
        let mut hides_below = false;
        let mut complete = true;
        for (i, c) in comps.iter().enumerate() {
            p.push(c);
            match fsutil::lstat(&p)? {
                None => {
                    complete = false;
                    break;
                }
                Some(m) if fsutil::is_whiteout(&m) => return Ok(None),
                Some(m) if i + 1 == comps.len() => return Ok(Some((p, m))),
                Some(m) if m.is_dir() => {
                    if fsutil::is_opaque(&p)? {
                        hides_below = true;
                    }
                }
                Some(_) => return Ok(None),
            }
        }
        if complete {
            // Only reached for the root itself.
            let m = fs::symlink_metadata(&p)?;
            return Ok(Some((p, m)));
        }
        if hides_below {
            return Ok(None);
        }
    }
    Ok(None)
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
                    fsutil::set_mode(&up, 0o755)?;
                    fsutil::set_opaque(&up)?;
                    self.created.insert(&prefix);
                }
                Some(_) => return Err(not_a_dir(&prefix)),
                None => {
                    let lower = self.lookup(&prefix)?;
                    self.note_parent(&prefix)?;
                    fs::create_dir(&up)?;
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
                fsutil::remove_all(&up)?;
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
            fsutil::remove_all(&up)?;
        }
        if self.lookup(rel)?.is_none() {
            return Ok(());
        }
        let parent = rel.parent().unwrap_or(Path::new(""));
        self.ensure_dir(parent)?;
        self.note_parent(rel)?;
        fsutil::make_whiteout(&up)
    }

    fn opaque(&mut self, dir: &Path) -> io::Result<()> {
        self.created.insert(dir);
        self.created.strip(&self.upper, dir, &mut self.times)?;
        fsutil::set_opaque(&self.upper.join(dir))
    }

    fn link_source(&mut self, rel: &Path) -> Result<PathBuf, PathError> {
        let Some((path, m)) = self.lookup(rel)? else {
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
        self.created.insert(rel);
    }

    fn keep_xattr(&self, name: &OsStr) -> bool {
        name == fsutil::OVERLAY_OPAQUE
    }

    fn times(&mut self) -> &mut DirTimes {
        &mut self.times
    }
}

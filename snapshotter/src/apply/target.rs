//! Where a layer is applied: the [`Target`] seam between the tar-entry loop and a backend's idea of a
//! snapshot, plus the copy backend's target.
//!
//! A target has a *writable tree* (a directory the entries are written into) and a *view* (what the
//! stack looks like with this layer on top). For the copy backend both are the same full tree and
//! deletions are real deletions. For overlayfs the writable tree is the layer's own directory and the
//! view merges it with the parent layers; see `overlay_target.rs`.
//!
//! Whiteout semantics both targets implement (OCI image spec, layer.md: whiteouts apply to lower
//! layers only): a whiteout or opaque marker removes what the *lower* layers have at or under a path,
//! never what this same layer writes there, in whatever order the entries come.

use std::collections::{BTreeSet, HashMap};
use std::ffi::OsStr;
use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::fsutil;

/// Why a path cannot be used.
#[derive(Debug)]
pub(crate) enum PathError {
    /// Would reach outside the snapshot.
    Unsafe(String),
    /// Not applicable (a parent is a file, symlink loops, link target missing).
    Invalid(String),
    Io(io::Error),
}

impl From<io::Error> for PathError {
    fn from(e: io::Error) -> Self {
        PathError::Io(e)
    }
}

/// What the view has at a path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NodeType {
    Dir,
    Symlink,
    Other,
}

impl NodeType {
    pub(crate) fn of(m: &fs::Metadata) -> Self {
        let ft = m.file_type();
        if ft.is_dir() {
            NodeType::Dir
        } else if ft.is_symlink() {
            NodeType::Symlink
        } else {
            NodeType::Other
        }
    }
}

/// What `make_room` did with an existing node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Room {
    /// The path is free now.
    Free,
    /// The path is free, and a directory created there must hide the lower layers (overlay).
    FreeOpaque,
    /// An existing directory stays and takes the new entry's metadata.
    KeepDir,
}

/// A snapshot being written by the layer applier. Paths are relative to the snapshot root and have
/// been resolved (no symlinks in their parent components).
pub(crate) trait Target {
    /// The writable tree.
    fn root(&self) -> &Path;
    /// What the view shows at `rel`.
    fn node(&self, rel: &Path) -> io::Result<Option<NodeType>>;
    /// The target of the symlink the view shows at `rel`.
    fn read_link(&self, rel: &Path) -> io::Result<PathBuf>;
    /// Makes `rel` and its parents directories of the writable tree.
    fn ensure_dir(&mut self, rel: &Path) -> io::Result<()>;
    /// How many directories [`Self::ensure_dir`] has created: ones no entry listed, which count
    /// against the entry cap all the same.
    fn implicit_dirs(&self) -> u64;
    /// Creating `rel` failed with EEXIST: clear the way for a new node.
    fn make_room(&mut self, rel: &Path, for_dir: bool) -> io::Result<Room>;
    /// Applies the whiteout for `rel` (parent already resolved, maybe missing).
    fn whiteout(&mut self, rel: &Path) -> io::Result<()>;
    /// Marks the existing directory `dir` opaque: lower layers' content under it is gone.
    fn opaque(&mut self, dir: &Path) -> io::Result<()>;
    /// The writable-tree path of the non-directory `rel` shows, for a hardlink to it.
    fn link_source(&mut self, rel: &Path) -> Result<PathBuf, PathError>;
    /// The bytes [`Target::link_source`] would copy into this layer for `rel` (a file of a lower
    /// layer is copied up, so both names live in this one): charged to the layer before the copy.
    fn copy_up_bytes(&self, _rel: &Path) -> io::Result<u64> {
        Ok(0)
    }
    /// Records that this layer wrote `rel`.
    fn created(&mut self, rel: &Path);
    /// Xattrs of an existing directory that survive when a directory entry replaces its metadata.
    fn keep_xattr(&self, name: &OsStr) -> bool;
    fn times(&mut self) -> &mut DirTimes;
}

/// Device and inode number.
type InodeId = (u64, u64);

/// Directory mtimes to set once every entry is written (writing into a directory changes its mtime).
///
/// Each time is recorded with the inode it is for. At the end the directory is reached through
/// descriptors opened one component at a time from the root with `O_NOFOLLOW`, and its time is set
/// only if it is still that inode: a later entry of the layer may have replaced the directory, or one
/// of its parents, with a symlink (to `/etc`, say), and that must not make the applier touch what the
/// symlink points at.
#[derive(Default)]
pub(crate) struct DirTimes {
    times: HashMap<PathBuf, ((i64, u32), InodeId)>,
}

impl DirTimes {
    /// Remember `rel`'s current mtime, unless a time for it is known already.
    pub(crate) fn note(&mut self, root: &Path, rel: &Path) -> io::Result<()> {
        if !self.times.contains_key(rel)
            && let Some(m) = fsutil::lstat(&root.join(rel))?
        {
            self.times.insert(
                rel.to_path_buf(),
                (fsutil::mtime_of(&m), (m.dev(), m.ino())),
            );
        }
        Ok(())
    }

    /// The time the directory now at `rel` must end up with.
    pub(crate) fn set(&mut self, root: &Path, rel: &Path, mtime: (i64, u32)) -> io::Result<()> {
        if let Some(m) = fsutil::lstat(&root.join(rel))? {
            self.times
                .insert(rel.to_path_buf(), (mtime, (m.dev(), m.ino())));
        }
        Ok(())
    }

    pub(crate) fn apply(&self, root: &Path) -> io::Result<()> {
        let root_fd = fsutil::open_dir_nofollow(None, root)?;
        for (rel, (t, id)) in &self.times {
            // Later entries may have removed the directory or put something else in its place.
            let Some(dir) = fsutil::open_beneath(&root_fd, rel)? else {
                continue;
            };
            let m = nix::sys::stat::fstat(&dir).map_err(io::Error::from)?;
            if (m.st_dev as u64, m.st_ino as u64) != *id {
                continue;
            }
            let ts = nix::sys::time::TimeSpec::new(t.0, t.1 as i64);
            nix::sys::stat::futimens(&dir, &ts, &ts).map_err(io::Error::from)?;
        }
        Ok(())
    }
}

/// The paths a layer wrote (entries and directories it had to create), as opposed to what was there
/// below it or was only copied up. Whiteouts and opaque markers remove everything else.
#[derive(Default)]
pub(crate) struct Created(BTreeSet<PathBuf>);

impl Created {
    pub(crate) fn insert(&mut self, rel: &Path) {
        self.0.insert(rel.to_path_buf());
    }

    /// Did the layer write `rel` or anything under it?
    pub(crate) fn at_or_under(&self, rel: &Path) -> bool {
        self.0
            .range(rel.to_path_buf()..)
            .next()
            .is_some_and(|p| p.starts_with(rel))
    }

    /// Removes everything under the directory `root/dir` that the layer did not write.
    pub(crate) fn strip(&self, root: &Path, dir: &Path, times: &mut DirTimes) -> io::Result<()> {
        times.note(root, dir)?;
        for e in fs::read_dir(root.join(dir))? {
            let rel = dir.join(e?.file_name());
            if !self.at_or_under(&rel) {
                crate::tree::remove_all(&root.join(&rel))?;
            } else if fs::symlink_metadata(root.join(&rel))?.is_dir() {
                self.strip(root, &rel, times)?;
            }
        }
        Ok(())
    }
}

pub(crate) fn not_a_dir(rel: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotADirectory,
        format!("{} is not a directory", rel.display()),
    )
}

/// The copy backend's target: one full tree, whiteouts are deletions.
pub(crate) struct CopyTarget {
    root: PathBuf,
    created: Created,
    times: DirTimes,
    implicit_dirs: u64,
}

impl CopyTarget {
    pub(crate) fn new(root: PathBuf) -> Self {
        CopyTarget {
            root,
            created: Created::default(),
            times: DirTimes::default(),
            implicit_dirs: 0,
        }
    }

    fn note_parent(&mut self, rel: &Path) -> io::Result<()> {
        let parent = rel.parent().unwrap_or(Path::new(""));
        self.times.note(&self.root, parent)
    }
}

impl Target for CopyTarget {
    fn root(&self) -> &Path {
        &self.root
    }

    fn node(&self, rel: &Path) -> io::Result<Option<NodeType>> {
        Ok(fsutil::lstat(&self.root.join(rel))?.map(|m| NodeType::of(&m)))
    }

    fn read_link(&self, rel: &Path) -> io::Result<PathBuf> {
        fs::read_link(self.root.join(rel))
    }

    fn ensure_dir(&mut self, rel: &Path) -> io::Result<()> {
        if fsutil::lstat(&self.root.join(rel))?.is_some_and(|m| m.is_dir()) {
            return Ok(());
        }
        let mut prefix = PathBuf::new();
        for c in rel.components() {
            prefix.push(c);
            match fsutil::lstat(&self.root.join(&prefix))? {
                Some(m) if m.is_dir() => {}
                Some(_) => return Err(not_a_dir(&prefix)),
                None => {
                    self.note_parent(&prefix)?;
                    fs::create_dir(self.root.join(&prefix))?;
                    self.implicit_dirs += 1;
                    fsutil::set_mode(&self.root.join(&prefix), 0o755)?;
                    self.created.insert(&prefix);
                }
            }
        }
        Ok(())
    }

    fn make_room(&mut self, rel: &Path, for_dir: bool) -> io::Result<Room> {
        let path = self.root.join(rel);
        match fsutil::lstat(&path)? {
            None => Ok(Room::Free),
            Some(m) if m.is_dir() && for_dir => Ok(Room::KeepDir),
            Some(_) => {
                crate::tree::remove_all(&path)?;
                Ok(Room::Free)
            }
        }
    }

    fn whiteout(&mut self, rel: &Path) -> io::Result<()> {
        let path = self.root.join(rel);
        let Some(m) = fsutil::lstat(&path)? else {
            return Ok(());
        };
        if !self.created.at_or_under(rel) {
            self.note_parent(rel)?;
            crate::tree::remove_all(&path)
        } else if m.is_dir() {
            // This layer wrote here too: the whiteout removes only what lies below.
            self.created.strip(&self.root, rel, &mut self.times)
        } else {
            Ok(())
        }
    }

    fn opaque(&mut self, dir: &Path) -> io::Result<()> {
        self.created.insert(dir);
        self.created.strip(&self.root, dir, &mut self.times)
    }

    fn link_source(&mut self, rel: &Path) -> Result<PathBuf, PathError> {
        let path = self.root.join(rel);
        match fsutil::lstat(&path)? {
            None => Err(PathError::Invalid(format!(
                "hardlink target {} does not exist",
                rel.display()
            ))),
            Some(m) if m.is_dir() => Err(PathError::Invalid(format!(
                "hardlink target {} is a directory",
                rel.display()
            ))),
            Some(_) => Ok(path),
        }
    }

    fn created(&mut self, rel: &Path) {
        self.created.insert(rel);
    }

    fn keep_xattr(&self, _name: &OsStr) -> bool {
        false
    }

    fn implicit_dirs(&self) -> u64 {
        self.implicit_dirs
    }

    fn times(&mut self) -> &mut DirTimes {
        &mut self.times
    }
}

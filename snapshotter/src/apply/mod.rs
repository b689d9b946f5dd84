//! The layer applier: reads an uncompressed tar stream entry by entry (with the bounded reader of
//! `reader.rs`) and writes it into a [`Target`]. (The caller hashes the stream on its way in to
//! check the layer's diff_id.)
//!
//! Owns the tar-entry semantics: every entry type (regular, directory, symlink, hardlink, character and
//! block devices, fifo), numeric ownership, modes with setuid/setgid/sticky, mtimes (PAX sub-second
//! times too), PAX `SCHILY.xattr.*` extended attributes, and OCI whiteouts (`.wh.NAME`) and opaque
//! markers (`.wh..wh..opq`), which the target turns into its own form.
//!
//! Invariants:
//! - an entry is created fresh (after removing what was there, unless directory meets directory), never
//!   written through an existing file, so hardlinked lower files are not modified by accident;
//! - ownership is set before mode and xattrs (chown clears setuid/setgid and file capabilities), and
//!   directory mtimes are set after the last entry, since writing into a directory changes its mtime;
//! - `trusted.overlay.*` xattrs in a layer are ignored: overlay metadata comes only from OCI whiteouts;
//! - sparse files are written sparsely: the applier seeks over holes and sets the file's length, so a
//!   hole costs no disk;
//! - directory times are set at the end through descriptors opened from the root without following
//!   symlinks, on the inode the time was recorded for (see `DirTimes`);
//! - the first unsafe or invalid entry stops the apply with an error naming it; the caller throws the
//!   half-written tree away.

mod overlay_target;
mod path;
mod reader;
mod target;

pub(crate) use overlay_target::{Detached, OverlayTarget, rebase};
pub(crate) use reader::Limits;
pub use reader::{MAX_LONG_NAME, MAX_PATH_BYTES, MAX_PAX_BYTES, MAX_SPARSE_MAP_BYTES};
pub(crate) use target::{CopyTarget, Target};

use std::ffi::{OsStr, OsString};
use std::fs::{self, File};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::sys::stat::SFlag;

use crate::error::Error;
use crate::fsutil;
use path::{Resolver, normalize};
use reader::{Header, Kind, TarReader};
use target::PathError;
use target::Room;

const WHITEOUT_PREFIX: &[u8] = b".wh.";
const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";

/// A large file's data is handed to the disk in pieces of this size as it is written, when the
/// layer is to be synced: the `syncfs` before the commit then waits for the last piece only,
/// instead of writing the whole layer after the last byte arrives.
const WRITE_BEHIND_BYTES: u64 = 8 << 20;

/// Applies the tar stream `tar` to `target`, within `limits`. Reads the stream to its end (tar
/// readers stop at the end-of-archive blocks), so a digest computed on the way in covers all of it.
/// `write_behind`: the caller syncs the layer once applied, so large files start their write-back
/// as they are written (see [`WRITE_BEHIND_BYTES`]).
pub(crate) fn apply_tar(
    target: &mut dyn Target,
    tar: impl Read,
    limits: Limits,
    write_behind: bool,
) -> Result<(), Error> {
    let mut reader = TarReader::new(tar, limits);
    let root = target.root().to_path_buf();
    target
        .times()
        .note(&root, Path::new(""))
        .map_err(|e| Error::io("layer root", e))?;
    let mut applier = Applier {
        resolver: Resolver::default(),
        buf: vec![0; 256 * 1024],
        write_behind,
    };
    while let Some(h) = reader.next()? {
        applier
            .entry(target, &h, &mut reader)
            .map_err(|e| e.into_error(&h.path))?;
        reader.count_implicit_dirs(target.implicit_dirs())?;
    }
    target
        .times()
        .apply(&root)
        .map_err(|e| Error::io("setting directory times", e))?;
    reader.drain()
}

/// Why one entry failed; becomes an [`Error`] naming the entry.
enum EntryError {
    Path(PathError),
    Stream(io::Error),
    Io(&'static str, io::Error),
    /// Past a limit of the layer, already naming it.
    Layer(Error),
}

impl From<PathError> for EntryError {
    fn from(e: PathError) -> Self {
        EntryError::Path(e)
    }
}

impl EntryError {
    fn into_error(self, raw: &[u8]) -> Error {
        let entry = String::from_utf8_lossy(raw).into_owned();
        match self {
            EntryError::Path(PathError::Unsafe(reason)) => Error::UnsafePath { entry, reason },
            EntryError::Path(PathError::Invalid(reason)) => Error::InvalidEntry { entry, reason },
            EntryError::Path(PathError::Io(e)) => Error::io(format!("layer entry {entry:?}"), e),
            EntryError::Stream(source) => Error::LayerStream { source },
            EntryError::Io(what, e) => Error::io(format!("layer entry {entry:?}: {what}"), e),
            EntryError::Layer(e) => e,
        }
    }
}

trait Ctx<T> {
    fn at(self, what: &'static str) -> Result<T, EntryError>;
}

impl<T> Ctx<T> for io::Result<T> {
    fn at(self, what: &'static str) -> Result<T, EntryError> {
        self.map_err(|e| EntryError::Io(what, e))
    }
}

/// Ownership, mode, time and xattrs of an entry (PAX records already applied by the reader).
struct Meta {
    uid: u32,
    gid: u32,
    mode: u32,
    mtime: (i64, u32),
    xattrs: Vec<(OsString, Vec<u8>)>,
}

impl Meta {
    fn of(h: &Header) -> Self {
        Meta {
            uid: h.uid,
            gid: h.gid,
            mode: h.mode,
            mtime: h.mtime,
            xattrs: h.xattrs.clone(),
        }
    }

    /// Sets ownership, mode (not on symlinks), xattrs and mtime (not on directories: see DirTimes).
    fn apply(&self, path: &Path, symlink: bool, dir: bool) -> io::Result<()> {
        std::os::unix::fs::lchown(path, Some(self.uid), Some(self.gid))?;
        if !symlink {
            fsutil::set_mode(path, self.mode)?;
        }
        for (name, value) in &self.xattrs {
            fsutil::set_xattr(path, name, value)?;
        }
        if !dir {
            fsutil::set_times(path, self.mtime)?;
        }
        Ok(())
    }
}

struct Applier {
    resolver: Resolver,
    buf: Vec<u8>,
    /// Start large files' write-back as they are written.
    write_behind: bool,
}

impl Applier {
    fn entry<R: Read>(
        &mut self,
        t: &mut dyn Target,
        h: &Header,
        data: &mut TarReader<R>,
    ) -> Result<(), EntryError> {
        let kind = h.kind;
        let rel = normalize(&h.path)?;
        let Some(name) = rel.file_name().map(OsStr::to_os_string) else {
            // The root itself ("./").
            if kind != Kind::Directory {
                return Err(PathError::Invalid("the root entry is not a directory".into()).into());
            }
            return self.dir(t, &rel, Meta::of(h), Room::KeepDir);
        };
        let parent = self
            .resolver
            .resolve_dir(t, rel.parent().unwrap_or(Path::new("")))?;
        let name_bytes = name.as_bytes();

        if name_bytes == OPAQUE_MARKER {
            t.ensure_dir(&parent).at("creating parent directories")?;
            t.opaque(&parent).at("applying opaque marker")?;
            self.resolver.invalidate();
            return Ok(());
        }
        if let Some(hidden) = name_bytes.strip_prefix(WHITEOUT_PREFIX) {
            // `.wh..wh.*` other than the opaque marker is AUFS bookkeeping with no meaning here.
            if hidden.starts_with(WHITEOUT_PREFIX) {
                return Ok(());
            }
            if hidden.is_empty() || hidden == b"." || hidden == b".." {
                return Err(PathError::Invalid("whiteout names no file".into()).into());
            }
            t.whiteout(&parent.join(OsStr::from_bytes(hidden)))
                .at("applying whiteout")?;
            self.resolver.invalidate();
            return Ok(());
        }

        t.ensure_dir(&parent).at("creating parent directories")?;
        let root = t.root().to_path_buf();
        t.times()
            .note(&root, &parent)
            .at("reading parent directory")?;
        let rel = parent.join(&name);
        let path = root.join(&rel);

        match kind {
            Kind::Directory => {
                let meta = Meta::of(h);
                let room = create(t, &mut self.resolver, &rel, true, || fs::create_dir(&path))?;
                self.dir(t, &rel, meta, room)?;
            }
            Kind::Regular => {
                let meta = Meta::of(h);
                let mut file = None;
                create(t, &mut self.resolver, &rel, false, || {
                    file = Some(
                        fs::OpenOptions::new()
                            .write(true)
                            .create_new(true)
                            .mode(0o600)
                            .open(&path)?,
                    );
                    Ok(())
                })?;
                let file = file.expect("created above");
                self.write_file(h, data, file, &meta, &path)?;
            }
            Kind::Symlink => {
                let meta = Meta::of(h);
                if h.link.is_empty() {
                    return Err(PathError::Invalid("symlink without a target".into()).into());
                }
                let target = PathBuf::from(OsStr::from_bytes(&h.link));
                create(t, &mut self.resolver, &rel, false, || {
                    std::os::unix::fs::symlink(&target, &path)
                })?;
                meta.apply(&path, true, false)
                    .at("setting symlink metadata")?;
                self.resolver.invalidate();
            }
            Kind::Link => {
                if h.link.is_empty() {
                    return Err(PathError::Invalid("hardlink without a target".into()).into());
                }
                let target = normalize(&h.link).map_err(|e| match e {
                    PathError::Unsafe(r) => PathError::Unsafe(format!("hardlink target: {r}")),
                    other => other,
                })?;
                let Some(tname) = target.file_name() else {
                    return Err(PathError::Invalid("hardlink to the root".into()).into());
                };
                let tparent = self
                    .resolver
                    .resolve_dir(t, target.parent().unwrap_or(Path::new("")))?;
                let source = tparent.join(tname);
                let copied = t
                    .copy_up_bytes(&source)
                    .at("looking up the hardlink target")?;
                data.charge(copied, || {
                    format!(
                        "a hardlink copies up {} ({copied} bytes) from a lower layer",
                        source.display()
                    )
                })
                .map_err(EntryError::Layer)?;
                let src = t.link_source(&source)?;
                if src != path {
                    create(t, &mut self.resolver, &rel, false, || {
                        fs::hard_link(&src, &path)
                    })?;
                }
            }
            Kind::Char | Kind::Block | Kind::Fifo => {
                let meta = Meta::of(h);
                let (major, minor) = h.dev;
                let flag = match kind {
                    Kind::Char => SFlag::S_IFCHR,
                    Kind::Block => SFlag::S_IFBLK,
                    _ => SFlag::S_IFIFO,
                };
                create(t, &mut self.resolver, &rel, false, || {
                    fsutil::make_node(&path, flag, major, minor)
                })?;
                meta.apply(&path, false, false)
                    .at("setting device metadata")?;
            }
            Kind::Other(flag) => {
                return Err(PathError::Invalid(format!(
                    "unsupported tar entry type {:?}",
                    flag as char
                ))
                .into());
            }
        }
        t.created(&rel);
        Ok(())
    }

    /// Gives the directory at `rel` the entry's metadata; an existing directory loses xattrs the entry
    /// does not list, so the result does not depend on what was there.
    fn dir(
        &mut self,
        t: &mut dyn Target,
        rel: &Path,
        meta: Meta,
        room: Room,
    ) -> Result<(), EntryError> {
        let path = t.root().join(rel);
        if room == Room::KeepDir {
            for name in fsutil::list_xattrs(&path).at("listing xattrs")? {
                if !t.keep_xattr(&name) && !meta.xattrs.iter().any(|(n, _)| *n == name) {
                    fsutil::remove_xattr(&path, &name).at("removing xattr")?;
                }
            }
        }
        if room == Room::FreeOpaque {
            fsutil::set_opaque(&path).at("marking directory opaque")?;
        }
        meta.apply(&path, false, true)
            .at("setting directory metadata")?;
        let root = t.root().to_path_buf();
        t.times()
            .set(&root, rel, meta.mtime)
            .at("reading directory")?;
        t.created(rel);
        Ok(())
    }

    /// Writes the entry's data into the new `file`, then its metadata. A sparse file's data goes to
    /// its segments' offsets and the holes are left unwritten.
    fn write_file<R: Read>(
        &mut self,
        h: &Header,
        data: &mut TarReader<R>,
        mut file: File,
        meta: &Meta,
        path: &Path,
    ) -> Result<(), EntryError> {
        let segments: Vec<(u64, u64)> = match &h.sparse {
            Some(s) => s.segments.clone(),
            None => vec![(0, h.size)],
        };
        for (offset, len) in segments {
            if len == 0 {
                continue;
            }
            if h.sparse.is_some() {
                file.seek(SeekFrom::Start(offset))
                    .at("seeking in a sparse file")?;
            }
            let mut left = len;
            // Where the write-back not yet started begins.
            let mut unflushed = offset;
            while left > 0 {
                let want = left.min(self.buf.len() as u64) as usize;
                let n = data
                    .read_data(&mut self.buf[..want])
                    .map_err(EntryError::Stream)?;
                file.write_all(&self.buf[..n]).at("writing file data")?;
                left -= n as u64;
                let written_to = offset + len - left;
                if self.write_behind && written_to - unflushed >= WRITE_BEHIND_BYTES {
                    fsutil::start_writeback(&file, unflushed, written_to - unflushed);
                    unflushed = written_to;
                }
            }
        }
        if let Some(s) = &h.sparse {
            // The trailing hole, if any.
            file.set_len(s.real_size)
                .at("setting a sparse file's size")?;
        }
        std::os::unix::fs::fchown(&file, Some(meta.uid), Some(meta.gid)).at("chown")?;
        file.set_permissions(fs::Permissions::from_mode(meta.mode))
            .at("chmod")?;
        for (name, value) in &meta.xattrs {
            fsutil::set_xattr(path, name, value).at("setting xattr")?;
        }
        let ts = nix::sys::time::TimeSpec::new(meta.mtime.0, meta.mtime.1 as i64);
        nix::sys::stat::futimens(&file, &ts, &ts)
            .map_err(io::Error::from)
            .at("setting mtime")?;
        Ok(())
    }
}

/// Runs `make`; if the path is taken, asks the target to clear it and tries once more.
/// Returns what happened to the previous occupant.
fn create(
    t: &mut dyn Target,
    resolver: &mut Resolver,
    rel: &Path,
    for_dir: bool,
    mut make: impl FnMut() -> io::Result<()>,
) -> Result<Room, EntryError> {
    match make() {
        Ok(()) => Ok(Room::Free),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            let room = t.make_room(rel, for_dir).at("replacing existing file")?;
            if room != Room::KeepDir {
                // A directory or symlink may have gone: cached resolutions are stale.
                resolver.invalidate();
                make().at("creating")?;
            }
            Ok(room)
        }
        Err(e) => Err(EntryError::Io("creating", e)),
    }
}

#[cfg(test)]
mod tests {
    use super::reader::parse_pax_time;
    use super::*;

    /// Pages of `file` in the page cache that are dirty (not yet handed to the disk), from the
    /// `cachestat` system call (Linux 6.5).
    fn dirty_pages(file: &File) -> u64 {
        use std::os::fd::AsRawFd;
        #[repr(C)]
        struct Range {
            off: u64,
            len: u64,
        }
        #[repr(C)]
        #[derive(Default)]
        struct Stat {
            nr_cache: u64,
            nr_dirty: u64,
            nr_writeback: u64,
            nr_evicted: u64,
            nr_recently_evicted: u64,
        }
        const SYS_CACHESTAT: libc::c_long = 451;
        let range = Range { off: 0, len: 0 };
        let mut stat = Stat::default();
        // SAFETY: both structs are laid out as the kernel's and outlive the call.
        let r = unsafe {
            libc::syscall(
                SYS_CACHESTAT,
                file.as_raw_fd(),
                &range as *const Range,
                &mut stat as *mut Stat,
                0,
            )
        };
        assert_eq!(r, 0, "cachestat: {}", io::Error::last_os_error());
        stat.nr_dirty
    }

    /// A layer that is to be synced hands its large files to the disk as it writes them: of a
    /// 64 MiB file, at most the last write-behind piece (and the applier's buffer) is still
    /// dirty when the apply returns, so the commit's syncfs does not start from zero.
    #[test]
    fn write_behind_leaves_at_most_one_piece_of_a_large_file_dirty() {
        // On a disk filesystem: tmpfs has no write-back to start.
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let size: usize = 64 << 20;
        let mut tar = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(size as u64);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        let data: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
        tar.append_data(&mut h, "big", &data[..]).unwrap();
        let tar = tar.into_inner().unwrap();
        let mut target = CopyTarget::new(dir.path().to_path_buf());
        let limits = Limits {
            max_bytes: 1 << 30,
            max_entries: 16,
        };
        apply_tar(&mut target, &tar[..], limits, true).unwrap();
        let dirty = dirty_pages(&File::open(dir.path().join("big")).unwrap());
        let page = 4096;
        assert!(
            dirty * page <= WRITE_BEHIND_BYTES + (256 << 10),
            "{} KiB of the 64 MiB file still dirty",
            dirty * page / 1024
        );
    }

    #[test]
    fn pax_times() {
        assert_eq!(parse_pax_time("1700000000"), Some((1_700_000_000, 0)));
        assert_eq!(
            parse_pax_time("1700000000.5"),
            Some((1_700_000_000, 500_000_000))
        );
        assert_eq!(parse_pax_time("12.000000001999"), Some((12, 1)));
        assert_eq!(parse_pax_time("-1.5"), Some((-2, 500_000_000)));
        assert_eq!(parse_pax_time("-0.5"), Some((-1, 500_000_000)));
        assert_eq!(parse_pax_time("-0.000000001"), Some((-1, 999_999_999)));
        assert_eq!(parse_pax_time("-0"), Some((0, 0)));
        assert_eq!(parse_pax_time("x"), None);
    }
}

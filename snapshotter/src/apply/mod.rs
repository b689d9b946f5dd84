//! The layer applier: reads an uncompressed tar stream entry by entry and writes it into a [`Target`].
//! (The caller hashes the stream on its way in to check the layer's diff_id.)
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
//! - the first unsafe or invalid entry stops the apply with an error naming it; the caller throws the
//!   half-written tree away.

mod overlay_target;
mod path;
mod target;

pub(crate) use overlay_target::OverlayTarget;
pub(crate) use target::{CopyTarget, Target};

use std::ffi::{OsStr, OsString};
use std::fs::{self, File};
use std::io::{self, BufReader, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::sys::stat::SFlag;
use tar::EntryType;

use crate::error::Error;
use crate::fsutil;
use path::{PathError, Resolver, normalize};
use target::Room;

const WHITEOUT_PREFIX: &[u8] = b".wh.";
const OPAQUE_MARKER: &[u8] = b".wh..wh..opq";

/// Applies the tar stream `tar` to `target`. Reads the stream to its end (tar readers stop at the
/// end-of-archive blocks), so a digest computed on the way in covers all of it.
pub(crate) fn apply_tar(target: &mut dyn Target, tar: impl Read) -> Result<(), Error> {
    let stream_err = |source| Error::LayerStream { source };
    let ended = std::rc::Rc::new(std::cell::Cell::new(false));
    let tracked = EndTracking {
        inner: tar,
        ended: ended.clone(),
    };
    let mut archive = tar::Archive::new(BufReader::with_capacity(64 * 1024, tracked));
    let root = target.root().to_path_buf();
    target
        .times()
        .note(&root, Path::new(""))
        .map_err(|e| Error::io("layer root", e))?;
    let mut applier = Applier {
        resolver: Resolver::default(),
        buf: vec![0; 256 * 1024],
    };
    for entry in archive.entries().map_err(stream_err)? {
        let mut entry = match entry {
            Ok(e) => e,
            // Some image builders end the stream right after the last entry's data, without the
            // padding to 512 bytes and the end-of-archive blocks. The entries are all there (the
            // diff_id check covers exactly these bytes), so that is the end of the archive.
            Err(e) if ended.get() && e.to_string().contains("unexpected EOF during skip") => break,
            Err(e) => return Err(stream_err(e)),
        };
        let raw = entry.path_bytes().into_owned();
        applier
            .entry(target, &mut entry, &raw)
            .map_err(|e| e.into_error(&raw))?;
    }
    target
        .times()
        .apply(&root)
        .map_err(|e| Error::io("setting directory times", e))?;
    io::copy(&mut archive.into_inner(), &mut io::sink()).map_err(stream_err)?;
    Ok(())
}

/// Notes when the layer stream has ended.
struct EndTracking<R> {
    inner: R,
    ended: std::rc::Rc<std::cell::Cell<bool>>,
}

impl<R: Read> Read for EndTracking<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n == 0 && !buf.is_empty() {
            self.ended.set(true);
        }
        Ok(n)
    }
}

/// Why one entry failed; becomes an [`Error`] naming the entry.
enum EntryError {
    Path(PathError),
    Stream(io::Error),
    Io(&'static str, io::Error),
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

/// Ownership, mode, time and xattrs of an entry, with PAX records taking precedence over the header.
struct Meta {
    uid: u32,
    gid: u32,
    mode: u32,
    mtime: (i64, u32),
    xattrs: Vec<(OsString, Vec<u8>)>,
}

impl Meta {
    fn read<R: Read>(e: &mut tar::Entry<'_, R>) -> io::Result<Self> {
        let h = e.header();
        let mut meta = Meta {
            uid: h.uid()? as u32,
            gid: h.gid()? as u32,
            mode: h.mode()? & 0o7777,
            mtime: (h.mtime()? as i64, 0),
            xattrs: Vec::new(),
        };
        if let Some(pax) = e.pax_extensions()? {
            for ext in pax {
                let ext = ext?;
                let Ok(key) = ext.key() else { continue };
                let value = ext.value_bytes();
                if let Some(name) = key.strip_prefix("SCHILY.xattr.") {
                    if !fsutil::is_overlay_xattr(OsStr::new(name)) {
                        meta.xattrs.push((OsString::from(name), value.to_vec()));
                    }
                    continue;
                }
                let text = std::str::from_utf8(value).unwrap_or("");
                match key {
                    "uid" => meta.uid = text.parse().unwrap_or(meta.uid),
                    "gid" => meta.gid = text.parse().unwrap_or(meta.gid),
                    "mtime" => meta.mtime = parse_pax_time(text).unwrap_or(meta.mtime),
                    _ => {}
                }
            }
        }
        Ok(meta)
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

/// Parses a PAX time (`1700000000.123456789`, maybe negative) into seconds and nanoseconds.
fn parse_pax_time(s: &str) -> Option<(i64, u32)> {
    let (secs, frac) = s.split_once('.').unwrap_or((s, ""));
    let secs: i64 = secs.parse().ok()?;
    let digits: String = frac.chars().take(9).collect();
    if !digits.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let nanos: u32 = if digits.is_empty() {
        0
    } else {
        format!("{digits:0<9}").parse().ok()?
    };
    if secs < 0 && nanos > 0 {
        // -1.5 means 1.5 seconds before the epoch.
        Some((secs - 1, 1_000_000_000 - nanos))
    } else {
        Some((secs, nanos))
    }
}

struct Applier {
    resolver: Resolver,
    buf: Vec<u8>,
}

impl Applier {
    fn entry<R: Read>(
        &mut self,
        t: &mut dyn Target,
        e: &mut tar::Entry<'_, R>,
        raw: &[u8],
    ) -> Result<(), EntryError> {
        let kind = e.header().entry_type();
        if matches!(
            kind,
            EntryType::XGlobalHeader
                | EntryType::XHeader
                | EntryType::GNULongName
                | EntryType::GNULongLink
        ) {
            return Ok(());
        }
        let rel = normalize(raw)?;
        let Some(name) = rel.file_name().map(OsStr::to_os_string) else {
            // The root itself ("./").
            if !kind.is_dir() {
                return Err(PathError::Invalid("the root entry is not a directory".into()).into());
            }
            let meta = Meta::read(e).map_err(EntryError::Stream)?;
            return self.dir(t, &rel, meta, Room::KeepDir);
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
            EntryType::Directory => {
                let meta = Meta::read(e).map_err(EntryError::Stream)?;
                let room = create(t, &mut self.resolver, &rel, true, || fs::create_dir(&path))?;
                self.dir(t, &rel, meta, room)?;
            }
            EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => {
                let meta = Meta::read(e).map_err(EntryError::Stream)?;
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
                self.write_file(e, file, &meta, &path)?;
            }
            EntryType::Symlink => {
                let meta = Meta::read(e).map_err(EntryError::Stream)?;
                let target = e
                    .link_name_bytes()
                    .ok_or_else(|| PathError::Invalid("symlink without a target".into()))?;
                let target = PathBuf::from(OsStr::from_bytes(&target));
                create(t, &mut self.resolver, &rel, false, || {
                    std::os::unix::fs::symlink(&target, &path)
                })?;
                meta.apply(&path, true, false)
                    .at("setting symlink metadata")?;
                self.resolver.invalidate();
            }
            EntryType::Link => {
                let target = e
                    .link_name_bytes()
                    .ok_or_else(|| PathError::Invalid("hardlink without a target".into()))?;
                let target = normalize(&target).map_err(|e| match e {
                    PathError::Unsafe(r) => PathError::Unsafe(format!("hardlink target: {r}")),
                    other => other,
                })?;
                let Some(tname) = target.file_name() else {
                    return Err(PathError::Invalid("hardlink to the root".into()).into());
                };
                let tparent = self
                    .resolver
                    .resolve_dir(t, target.parent().unwrap_or(Path::new("")))?;
                let src = t.link_source(&tparent.join(tname))?;
                if src != path {
                    create(t, &mut self.resolver, &rel, false, || {
                        fs::hard_link(&src, &path)
                    })?;
                }
            }
            EntryType::Char | EntryType::Block | EntryType::Fifo => {
                let meta = Meta::read(e).map_err(EntryError::Stream)?;
                let h = e.header();
                let major = h.device_major().ok().flatten().unwrap_or(0) as u64;
                let minor = h.device_minor().ok().flatten().unwrap_or(0) as u64;
                let flag = match kind {
                    EntryType::Char => SFlag::S_IFCHR,
                    EntryType::Block => SFlag::S_IFBLK,
                    _ => SFlag::S_IFIFO,
                };
                create(t, &mut self.resolver, &rel, false, || {
                    fsutil::make_node(&path, flag, major, minor)
                })?;
                meta.apply(&path, false, false)
                    .at("setting device metadata")?;
            }
            other => {
                return Err(
                    PathError::Invalid(format!("unsupported tar entry type {other:?}")).into(),
                );
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
        t.times().set(rel, meta.mtime);
        t.created(rel);
        Ok(())
    }

    fn write_file<R: Read>(
        &mut self,
        e: &mut tar::Entry<'_, R>,
        mut file: File,
        meta: &Meta,
        path: &Path,
    ) -> Result<(), EntryError> {
        let want = e.size();
        let mut written = 0u64;
        loop {
            let n = match e.read(&mut self.buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
                Err(err) => return Err(EntryError::Stream(err)),
            };
            file.write_all(&self.buf[..n]).at("writing file data")?;
            written += n as u64;
        }
        // The stream ended inside the file's data.
        if written < want {
            return Err(EntryError::Stream(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("layer stream ended after {written} of the entry's {want} bytes"),
            )));
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
    use super::parse_pax_time;

    #[test]
    fn pax_times() {
        assert_eq!(parse_pax_time("1700000000"), Some((1_700_000_000, 0)));
        assert_eq!(
            parse_pax_time("1700000000.5"),
            Some((1_700_000_000, 500_000_000))
        );
        assert_eq!(parse_pax_time("12.000000001999"), Some((12, 1)));
        assert_eq!(parse_pax_time("-1.5"), Some((-2, 500_000_000)));
        assert_eq!(parse_pax_time("x"), None);
    }
}

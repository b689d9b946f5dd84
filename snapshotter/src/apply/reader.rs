//! A bounded tar reader: turns an uncompressed layer stream into entries, with every allocation and
//! every byte count capped, because a layer's bytes come from whoever built the image.
//!
//! Formats read (POSIX.1-1988 ustar, GNU and POSIX.1-2001 PAX, as OCI layers use them):
//! - ustar headers, with the `prefix` field joined to the name; GNU headers; numeric fields in
//!   octal or in GNU base-256;
//! - PAX extended headers (`x`) for the next entry: `path`, `linkpath`, `size`, `uid`, `gid`,
//!   `mtime` (with fractions), `SCHILY.xattr.*`, and the `GNU.sparse.*` keys; global headers (`g`)
//!   are read (bounded) and ignored, as before;
//! - GNU long names (`L`) and long link names (`K`);
//! - sparse files: GNU old sparse (`S`, with extension blocks) and PAX sparse formats 0.0, 0.1 and
//!   1.0. A sparse entry becomes a [`Sparse`] map; the applier writes only its data segments and
//!   leaves the holes as holes.
//!
//! Caps (see docs/hardening.md):
//! - an extension header (PAX `x`/`g`) is refused above [`MAX_PAX_BYTES`], a GNU long name or link
//!   name above [`MAX_LONG_NAME`], a sparse map (extension blocks or the 1.0 map) above
//!   [`MAX_SPARSE_MAP_BYTES`] — all checked from the header's size field *before* reading the data;
//! - [`Limits::max_bytes`]: the uncompressed bytes of the layer stream (drained trailing bytes
//!   included) plus the holes of sparse files, so neither a decompression bomb nor a sparse file
//!   with a huge apparent size gets past it; checked when a header announces its size, before any
//!   data is written;
//! - the entry cap, [`Limits::max_entries`], counts entries (extension headers not counted, they
//!   belong to the next entry) plus the directories the applier creates for them without an entry
//!   of their own ([`TarReader::count_implicit_dirs`]);
//! - an entry's path and link name are refused above [`MAX_PATH_BYTES`] (the kernel's `PATH_MAX`),
//!   which also bounds how deep a path can go (2,048 components).
//!
//! Malformed input (bad checksum, bad number, bad PAX record, a sparse map that does not add up) is
//! an `InvalidData` stream error; a cap exceeded is a [`Error::LayerLimit`].

use std::ffi::OsString;
use std::io::{self, Read};
use std::os::unix::ffi::OsStringExt;

use crate::error::Error;
use crate::fsutil;

/// Largest PAX extended header (`x` or `g`) read: 1 MiB. Real ones hold a path, a link path and a
/// few xattrs (file capabilities, SELinux labels): a few KiB. 1 MiB leaves room for large ACL xattrs.
pub const MAX_PAX_BYTES: u64 = 1 << 20;
/// Largest GNU long name or long link name read: 64 KiB (PATH_MAX is 4 KiB).
pub const MAX_LONG_NAME: u64 = 64 << 10;
/// Longest entry path or link name accepted: 4 KiB, Linux's `PATH_MAX` (a symlink's target cannot be
/// longer, and no path a real filesystem hands a tar writer is).
pub const MAX_PATH_BYTES: usize = 4096;
/// Largest sparse map read (GNU extension blocks or a PAX 1.0 map): 1 MiB, some 40,000 segments.
pub const MAX_SPARSE_MAP_BYTES: u64 = 1 << 20;

const BLOCK: u64 = 512;

/// Per-layer caps, from the snapshotter's `Options`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub max_bytes: u64,
    pub max_entries: u64,
}

/// What an entry is, from its type flag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Regular,
    Link,
    Symlink,
    Char,
    Block,
    Directory,
    Fifo,
    /// Any other type flag (volume labels, multi-volume parts, GNU dump directories, ...).
    Other(u8),
}

/// Data segments of a sparse file: `(offset, length)` in file order, not overlapping, and the
/// apparent size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Sparse {
    pub segments: Vec<(u64, u64)>,
    pub real_size: u64,
}

/// One entry's header, with its extension headers applied.
#[derive(Debug)]
pub(crate) struct Header {
    pub kind: Kind,
    pub path: Vec<u8>,
    pub link: Vec<u8>,
    pub uid: u32,
    pub gid: u32,
    pub mode: u32,
    pub mtime: (i64, u32),
    pub dev: (u64, u64),
    pub xattrs: Vec<(OsString, Vec<u8>)>,
    /// Data bytes that follow in the stream (for a sparse file: the segments' bytes).
    pub size: u64,
    pub sparse: Option<Sparse>,
}

/// Reads entries from a tar stream, bounded by [`Limits`].
pub(crate) struct TarReader<R> {
    r: R,
    limits: Limits,
    /// Stream bytes consumed.
    pos: u64,
    /// Bytes counted against `max_bytes`: stream bytes plus sparse holes.
    charged: u64,
    entries: u64,
    /// Data bytes of the current entry not read yet, then the padding to its block.
    remaining: u64,
    padding: u64,
    ended: bool,
}

fn bad(msg: impl Into<String>) -> Error {
    Error::LayerStream {
        source: io::Error::new(io::ErrorKind::InvalidData, msg.into()),
    }
}

fn stream(e: io::Error) -> Error {
    Error::LayerStream { source: e }
}

impl<R: Read> TarReader<R> {
    pub(crate) fn new(r: R, limits: Limits) -> Self {
        TarReader {
            r,
            limits,
            pos: 0,
            charged: 0,
            entries: 0,
            remaining: 0,
            padding: 0,
            ended: false,
        }
    }

    /// Charges `n` more bytes against `max_bytes`.
    pub(crate) fn charge(&mut self, n: u64, what: impl FnOnce() -> String) -> Result<(), Error> {
        self.charged = self.charged.saturating_add(n);
        if self.charged > self.limits.max_bytes {
            return Err(Error::LayerLimit {
                limit: "snapshotter.max_layer_bytes",
                max: self.limits.max_bytes,
                detail: what(),
            });
        }
        Ok(())
    }

    /// Reads exactly `buf.len()` bytes; `Ok(false)` at a clean end of stream before the first byte.
    fn read_block(&mut self, buf: &mut [u8]) -> Result<bool, Error> {
        let mut filled = 0;
        while filled < buf.len() {
            match self.r.read(&mut buf[filled..]) {
                Ok(0) if filled == 0 => return Ok(false),
                Ok(0) => {
                    return Err(stream(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "layer stream ended inside a tar header",
                    )));
                }
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(stream(e)),
            }
        }
        self.pos += buf.len() as u64;
        Ok(true)
    }

    /// Skips the rest of the current entry's data and padding.
    fn skip_rest(&mut self) -> Result<(), Error> {
        let mut left = self.remaining + self.padding;
        let mut buf = [0u8; 8192];
        while left > 0 {
            let want = left.min(buf.len() as u64) as usize;
            let n = match self.r.read(&mut buf[..want]) {
                Ok(0) if self.remaining == 0 => {
                    // Some image builders end the stream right after the last entry's data, without
                    // the padding and end-of-archive blocks: that is the end of the archive.
                    self.ended = true;
                    self.padding = 0;
                    return Ok(());
                }
                Ok(0) => {
                    return Err(stream(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!(
                            "layer stream ended with {} bytes of an entry's data missing",
                            self.remaining
                        ),
                    )));
                }
                Ok(n) => n as u64,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(stream(e)),
            };
            self.pos += n;
            left -= n;
            let from_data = n.min(self.remaining);
            self.remaining -= from_data;
            self.padding -= n - from_data;
        }
        Ok(())
    }

    /// Reads the current entry's data into `buf`; 0 at its end.
    pub(crate) fn read_data(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.remaining == 0 || buf.is_empty() {
            return Ok(0);
        }
        let want = self.remaining.min(buf.len() as u64) as usize;
        let n = loop {
            match self.r.read(&mut buf[..want]) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                other => break other?,
            }
        };
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "layer stream ended with {} bytes of an entry's data missing",
                    self.remaining
                ),
            ));
        }
        self.pos += n as u64;
        self.remaining -= n as u64;
        Ok(n)
    }

    /// Reads all of the current entry's data (already checked against a cap) into memory.
    fn read_small(&mut self) -> Result<Vec<u8>, Error> {
        let mut out = vec![0u8; self.remaining as usize];
        let mut filled = 0;
        while filled < out.len() {
            filled += self.read_data(&mut out[filled..]).map_err(stream)?;
        }
        Ok(out)
    }

    /// The next entry, or None at the end of the archive. Skips what is left of the previous one.
    pub(crate) fn next(&mut self) -> Result<Option<Header>, Error> {
        let mut pax: Option<Pax> = None;
        let mut long_name: Option<Vec<u8>> = None;
        let mut long_link: Option<Vec<u8>> = None;
        let mut raw = [0u8; BLOCK as usize];
        loop {
            self.skip_rest()?;
            let start = self.pos;
            if self.ended || !self.read_block(&mut raw)? {
                if pax.is_some() || long_name.is_some() || long_link.is_some() {
                    return Err(bad("extension header without an entry after it"));
                }
                self.ended = true;
                return Ok(None);
            }
            self.charge(BLOCK, || "tar headers".into())?;
            if raw.iter().all(|b| *b == 0) {
                if pax.is_some() || long_name.is_some() || long_link.is_some() {
                    return Err(bad("extension header without an entry after it"));
                }
                self.ended = true;
                return Ok(None);
            }
            let h = RawHeader::parse(&raw)
                .map_err(|e| bad(format!("tar header at byte {start}: {e}")))?;
            let mut size = h.size;
            if let Some(s) = pax.as_ref().and_then(|p| p.size)
                && !h.is_extension()
            {
                size = s;
            }
            let blocks = size
                .div_ceil(BLOCK)
                .checked_mul(BLOCK)
                .ok_or_else(|| bad("entry size overflows"))?;
            self.remaining = size;
            self.padding = blocks - size;
            let cap = |limit: &'static str, max: u64| -> Result<(), Error> {
                if size > max {
                    return Err(Error::LayerLimit {
                        limit,
                        max,
                        detail: format!("a {size}-byte header at byte {start}"),
                    });
                }
                Ok(())
            };
            match h.typeflag {
                b'x' | b'g' => {
                    cap("PAX extended header size", MAX_PAX_BYTES)?;
                    self.charge(blocks, || "a PAX header".into())?;
                    let data = self.read_small()?;
                    let parsed = Pax::parse(&data)
                        .map_err(|e| bad(format!("PAX header at byte {start}: {e}")))?;
                    if h.typeflag == b'x' {
                        if pax.is_some() {
                            return Err(bad("two PAX headers for one entry"));
                        }
                        pax = Some(parsed);
                    }
                    continue;
                }
                b'L' | b'K' => {
                    cap("GNU long name size", MAX_LONG_NAME)?;
                    self.charge(blocks, || "a GNU long name".into())?;
                    let mut data = self.read_small()?;
                    if let Some(nul) = data.iter().position(|b| *b == 0) {
                        data.truncate(nul);
                    }
                    let slot = if h.typeflag == b'L' {
                        &mut long_name
                    } else {
                        &mut long_link
                    };
                    if slot.is_some() {
                        return Err(bad("two GNU long names for one entry"));
                    }
                    *slot = Some(data);
                    continue;
                }
                _ => {}
            }
            self.entries += 1;
            if self.entries > self.limits.max_entries {
                return Err(Error::LayerLimit {
                    limit: "snapshotter.max_layer_entries",
                    max: self.limits.max_entries,
                    detail: format!("entry {} at byte {start}", self.entries),
                });
            }
            let mut out = Header {
                kind: match h.typeflag {
                    b'0' | b'\0' | b'7' | b'S' => Kind::Regular,
                    b'1' => Kind::Link,
                    b'2' => Kind::Symlink,
                    b'3' => Kind::Char,
                    b'4' => Kind::Block,
                    b'5' => Kind::Directory,
                    b'6' => Kind::Fifo,
                    other => Kind::Other(other),
                },
                path: long_name.take().unwrap_or(h.path),
                link: long_link.take().unwrap_or(h.link),
                uid: h.uid,
                gid: h.gid,
                mode: h.mode,
                mtime: (h.mtime, 0),
                dev: h.dev,
                xattrs: Vec::new(),
                size,
                sparse: None,
            };
            let mut pax = pax.take().unwrap_or_default();
            pax.apply(&mut out);
            let path = String::from_utf8_lossy(&out.path).into_owned();
            self.charge(blocks, || format!("entry {path:?}"))?;
            if h.typeflag == b'S' {
                let s = self.gnu_sparse(&raw, h.gnu)?;
                out.sparse = Some(s);
            } else if out.kind == Kind::Regular && pax.sparse.is_some() {
                let s = self.pax_sparse(&mut pax, &mut out)?;
                out.sparse = Some(s);
            }
            for (what, bytes) in [("path", &out.path), ("link name", &out.link)] {
                if bytes.len() > MAX_PATH_BYTES {
                    return Err(Error::LayerLimit {
                        limit: "entry path length",
                        max: MAX_PATH_BYTES as u64,
                        detail: format!(
                            "entry {} at byte {start} has a {}-byte {what} starting {:?}",
                            self.entries,
                            bytes.len(),
                            String::from_utf8_lossy(&bytes[..64])
                        ),
                    });
                }
            }
            out.size = self.remaining;
            // A sparse file's holes count too: its apparent size is what copies of it cost.
            let holes = out
                .sparse
                .as_ref()
                .map_or(0, |s| s.real_size.saturating_sub(self.remaining));
            self.charge(holes, || format!("sparse entry {path:?}"))?;
            return Ok(Some(out));
        }
    }

    /// Counts `dirs`, the directories created so far for entries that did not list them (an entry
    /// `a/b/c/f` alone creates three), against [`Limits::max_entries`] with the entries read: they cost
    /// an inode and the applier's bookkeeping just as listed ones do.
    pub(crate) fn count_implicit_dirs(&self, dirs: u64) -> Result<(), Error> {
        if self.entries.saturating_add(dirs) > self.limits.max_entries {
            return Err(Error::LayerLimit {
                limit: "snapshotter.max_layer_entries",
                max: self.limits.max_entries,
                detail: format!(
                    "{} entries and {dirs} directories created for them without an entry of their own",
                    self.entries
                ),
            });
        }
        Ok(())
    }

    /// The map of a GNU old-style sparse entry: four slots in the header, then extension blocks.
    fn gnu_sparse(&mut self, raw: &[u8; 512], gnu: bool) -> Result<Sparse, Error> {
        if !gnu {
            return Err(bad("GNU sparse entry in a non-GNU header"));
        }
        let mut segs = Vec::new();
        // An empty slot starts with a NUL.
        let mut add = |block: &[u8]| -> Result<(), Error> {
            let off = number(&block[..12]).map_err(bad)?;
            let len = number(&block[12..24]).map_err(bad)?;
            segs.push((off, len));
            Ok(())
        };
        for i in 0..4 {
            let at = 386 + i * 24;
            if raw[at] != 0 {
                add(&raw[at..at + 24])?;
            }
        }
        let mut extended = raw[482] != 0;
        let mut map_bytes = 0u64;
        let mut ext = [0u8; 512];
        while extended {
            map_bytes += BLOCK;
            if map_bytes > MAX_SPARSE_MAP_BYTES {
                return Err(Error::LayerLimit {
                    limit: "sparse map size",
                    max: MAX_SPARSE_MAP_BYTES,
                    detail: "GNU sparse extension blocks".into(),
                });
            }
            if !self.read_block(&mut ext)? {
                return Err(bad("layer stream ended inside a GNU sparse map"));
            }
            self.charge(BLOCK, || "a GNU sparse map".into())?;
            for i in 0..21 {
                let at = i * 24;
                if ext[at] != 0 {
                    add(&ext[at..at + 24])?;
                }
            }
            extended = ext[504] != 0;
        }
        let real_size = number(&raw[483..495]).map_err(bad)?;
        check_sparse(segs, real_size, self.remaining)
    }

    /// The map of a PAX sparse entry (formats 0.0, 0.1 and 1.0); renames the entry to its real name.
    fn pax_sparse(&mut self, pax: &mut Pax, out: &mut Header) -> Result<Sparse, Error> {
        let sp = pax.sparse.take().expect("checked by the caller");
        if let Some(name) = sp.name {
            out.path = name;
        }
        let real_size = sp
            .real_size
            .ok_or_else(|| bad("PAX sparse entry without its real size"))?;
        let segs = match (sp.major, sp.minor) {
            (Some(1), Some(0)) => self.sparse_map_1_0()?,
            (None | Some(0), _) => {
                if let Some(map) = sp.map {
                    let nums = map
                        .split(|b| *b == b',')
                        .map(|n| decimal(n).ok_or_else(|| bad("bad GNU.sparse.map")))
                        .collect::<Result<Vec<u64>, Error>>()?;
                    if nums.len() % 2 != 0 {
                        return Err(bad("GNU.sparse.map has an odd number of values"));
                    }
                    nums.chunks(2).map(|c| (c[0], c[1])).collect()
                } else {
                    sp.pairs
                }
            }
            (major, minor) => {
                return Err(bad(format!(
                    "unsupported PAX sparse format {}.{}",
                    major.unwrap_or(0),
                    minor.unwrap_or(0)
                )));
            }
        };
        if let Some(n) = sp.numblocks
            && n != segs.len() as u64
        {
            return Err(bad("GNU.sparse.numblocks does not match the map"));
        }
        check_sparse(segs, real_size, self.remaining)
    }

    /// The PAX 1.0 sparse map at the start of the entry's data: decimal lines (count, then offset
    /// and length pairs), padded to a block.
    fn sparse_map_1_0(&mut self) -> Result<Vec<(u64, u64)>, Error> {
        let mut text = Vec::new();
        let mut lines_wanted: Option<u64> = None;
        let mut values: Vec<u64> = Vec::new();
        let mut block = [0u8; 512];
        let mut read = 0u64;
        loop {
            if self.remaining < BLOCK {
                return Err(bad("PAX 1.0 sparse map runs past the entry's data"));
            }
            read += BLOCK;
            if read > MAX_SPARSE_MAP_BYTES {
                return Err(Error::LayerLimit {
                    limit: "sparse map size",
                    max: MAX_SPARSE_MAP_BYTES,
                    detail: "a PAX 1.0 sparse map".into(),
                });
            }
            let mut filled = 0;
            while filled < block.len() {
                filled += self.read_data(&mut block[filled..]).map_err(stream)?;
            }
            text.extend_from_slice(&block);
            // Parse the complete lines the map has so far.
            let mut start = 0;
            let mut done = false;
            for (i, b) in text.iter().enumerate() {
                if *b != b'\n' {
                    continue;
                }
                let v = decimal(&text[start..i]).ok_or_else(|| bad("bad PAX 1.0 sparse map"))?;
                start = i + 1;
                match lines_wanted {
                    None => {
                        if v > MAX_SPARSE_MAP_BYTES / 4 {
                            return Err(bad("PAX 1.0 sparse map lists too many segments"));
                        }
                        lines_wanted = Some(v * 2);
                    }
                    Some(_) => values.push(v),
                }
                if lines_wanted == Some(values.len() as u64) {
                    done = true;
                    break;
                }
            }
            if done {
                break;
            }
            // Keep only the unfinished line for the next block.
            text.drain(..start);
            if text.iter().any(|b| !b.is_ascii_digit()) {
                return Err(bad("bad PAX 1.0 sparse map"));
            }
        }
        Ok(values.chunks(2).map(|c| (c[0], c[1])).collect())
    }

    /// Reads and counts whatever follows the end-of-archive blocks, up to the stream's end, so the
    /// caller's digest covers it; still bounded by `max_bytes`.
    pub(crate) fn drain(&mut self) -> Result<(), Error> {
        if !self.ended {
            self.skip_rest()?;
        }
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match self.r.read(&mut buf) {
                Ok(0) => return Ok(()),
                Ok(n) => n as u64,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(stream(e)),
            };
            self.pos += n;
            self.charge(n, || "bytes after the end of the archive".into())?;
        }
    }
}

/// Checks a sparse map against the entry: in order, not overlapping, inside the real size, and
/// its lengths adding up to the data that follows.
fn check_sparse(segs: Vec<(u64, u64)>, real_size: u64, data: u64) -> Result<Sparse, Error> {
    let mut end = 0u64;
    let mut total = 0u64;
    for &(off, len) in &segs {
        if off < end {
            return Err(bad("sparse segments overlap or are out of order"));
        }
        end = off
            .checked_add(len)
            .ok_or_else(|| bad("sparse segment overflows"))?;
        if end > real_size {
            return Err(bad("sparse segment past the file's real size"));
        }
        total += len;
    }
    if total != data {
        return Err(bad(format!(
            "sparse map lists {total} data bytes, the entry has {data}"
        )));
    }
    Ok(Sparse {
        segments: segs,
        real_size,
    })
}

/// The fields of one 512-byte header.
struct RawHeader {
    typeflag: u8,
    path: Vec<u8>,
    link: Vec<u8>,
    uid: u32,
    gid: u32,
    mode: u32,
    mtime: i64,
    size: u64,
    dev: (u64, u64),
    gnu: bool,
}

impl RawHeader {
    fn is_extension(&self) -> bool {
        matches!(self.typeflag, b'x' | b'g' | b'L' | b'K')
    }

    fn parse(b: &[u8; 512]) -> Result<Self, String> {
        let want = number(&b[148..156])?;
        // The sum of the header's bytes with the checksum field as spaces; some old writers
        // summed them as signed chars.
        let (unsigned, signed) = b.iter().enumerate().fold((0u64, 0i64), |(u, s), (i, v)| {
            if (148..156).contains(&i) {
                (u + 32, s + 32)
            } else {
                (u + *v as u64, s + *v as i8 as i64)
            }
        });
        if want != unsigned && want as i64 != signed {
            return Err("checksum mismatch".into());
        }
        let magic = &b[257..265];
        let ustar = &magic[..6] == b"ustar\0";
        let gnu = magic == b"ustar  \0";
        let mut path = cstr(&b[0..100]).to_vec();
        if ustar {
            let prefix = cstr(&b[345..500]);
            if !prefix.is_empty() {
                let mut p = prefix.to_vec();
                p.push(b'/');
                p.extend_from_slice(&path);
                path = p;
            }
        }
        let typeflag = b[156];
        // Every type's data is `size` bytes long, links and devices included (some writers give
        // hardlinks their file's size and data): readers that disagree on this see different files.
        let size = number(&b[124..136])?;
        let (dev_major, dev_minor) = if ustar || gnu {
            (
                number(&b[329..337]).unwrap_or(0),
                number(&b[337..345]).unwrap_or(0),
            )
        } else {
            (0, 0)
        };
        Ok(RawHeader {
            typeflag,
            path,
            link: cstr(&b[157..257]).to_vec(),
            mode: (number(&b[100..108])? & 0o7777) as u32,
            uid: number(&b[108..116])? as u32,
            gid: number(&b[116..124])? as u32,
            mtime: signed_number(&b[136..148])?,
            size,
            dev: (dev_major, dev_minor),
            gnu,
        })
    }
}

/// The bytes of a NUL-terminated (or full) field.
fn cstr(b: &[u8]) -> &[u8] {
    match b.iter().position(|c| *c == 0) {
        Some(n) => &b[..n],
        None => b,
    }
}

/// A numeric header field: octal (spaces and NULs around it), or GNU base-256 (top bit set).
fn number(b: &[u8]) -> Result<u64, String> {
    let v = signed_number(b)?;
    u64::try_from(v).map_err(|_| "negative number in a tar header".to_string())
}

fn signed_number(b: &[u8]) -> Result<i64, String> {
    if b.first().is_some_and(|c| c & 0x80 != 0) {
        // Base-256, two's complement, the first byte's top bit being the marker.
        let negative = b[0] == 0xff;
        let mut v: i128 = if negative { -1 } else { 0 };
        for (i, byte) in b.iter().enumerate() {
            let byte = if i == 0 {
                byte & 0x7f | if negative { 0x80 } else { 0 }
            } else {
                *byte
            };
            v = (v << 8) | byte as i128;
            if !(i64::MIN as i128..=i64::MAX as i128).contains(&v) {
                return Err("base-256 number out of range".into());
            }
        }
        return Ok(v as i64);
    }
    let t: &[u8] = {
        let s = b
            .iter()
            .position(|c| *c != b' ' && *c != 0)
            .unwrap_or(b.len());
        let rest = &b[s..];
        let e = rest
            .iter()
            .position(|c| *c == b' ' || *c == 0)
            .unwrap_or(rest.len());
        if rest[e..].iter().any(|c| *c != b' ' && *c != 0) {
            return Err(format!("bad octal field {:?}", String::from_utf8_lossy(b)));
        }
        &rest[..e]
    };
    if t.is_empty() {
        return Ok(0);
    }
    let mut v: i64 = 0;
    for c in t {
        if !(b'0'..=b'7').contains(c) {
            return Err(format!("bad octal field {:?}", String::from_utf8_lossy(b)));
        }
        v = v
            .checked_mul(8)
            .and_then(|v| v.checked_add((c - b'0') as i64))
            .ok_or("octal number out of range")?;
    }
    Ok(v)
}

/// A decimal number (PAX values, sparse maps): digits only.
fn decimal(b: &[u8]) -> Option<u64> {
    if b.is_empty() || b.len() > 20 || !b.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(b).ok()?.parse().ok()
}

/// PAX sparse keys of one entry.
#[derive(Default)]
struct PaxSparse {
    major: Option<u64>,
    minor: Option<u64>,
    name: Option<Vec<u8>>,
    real_size: Option<u64>,
    numblocks: Option<u64>,
    map: Option<Vec<u8>>,
    /// Format 0.0: repeated offset/numbytes records.
    pairs: Vec<(u64, u64)>,
    pending_offset: Option<u64>,
}

/// The records of a PAX `x` header that the applier uses.
#[derive(Default)]
struct Pax {
    path: Option<Vec<u8>>,
    link: Option<Vec<u8>>,
    size: Option<u64>,
    uid: Option<u32>,
    gid: Option<u32>,
    mtime: Option<(i64, u32)>,
    xattrs: Vec<(OsString, Vec<u8>)>,
    sparse: Option<PaxSparse>,
}

impl Pax {
    /// Parses `"<len> <key>=<value>\n"` records.
    fn parse(mut data: &[u8]) -> Result<Pax, String> {
        let mut pax = Pax::default();
        while !data.is_empty() {
            // Some writers pad the header with NULs.
            if data.iter().all(|b| *b == 0) {
                break;
            }
            let sp = data
                .iter()
                .take(21)
                .position(|b| *b == b' ')
                .ok_or("PAX record without a length")?;
            let len = decimal(&data[..sp]).ok_or("bad PAX record length")? as usize;
            if len <= sp + 1 || len > data.len() || data[len - 1] != b'\n' {
                return Err("bad PAX record length".into());
            }
            let rec = &data[sp + 1..len - 1];
            data = &data[len..];
            let eq = rec
                .iter()
                .position(|b| *b == b'=')
                .ok_or("PAX record without '='")?;
            let (key, value) = (&rec[..eq], &rec[eq + 1..]);
            pax.record(key, value)?;
        }
        Ok(pax)
    }

    fn record(&mut self, key: &[u8], value: &[u8]) -> Result<(), String> {
        let text = std::str::from_utf8(value).unwrap_or("");
        if let Some(name) = key.strip_prefix(b"SCHILY.xattr.") {
            let name = OsString::from_vec(name.to_vec());
            if !fsutil::is_overlay_xattr(&name) {
                self.xattrs.push((name, value.to_vec()));
            }
            return Ok(());
        }
        if let Some(k) = key.strip_prefix(b"GNU.sparse.") {
            let sp = self.sparse.get_or_insert_with(Default::default);
            let num = || {
                decimal(value)
                    .ok_or_else(|| format!("bad GNU.sparse.{} value", String::from_utf8_lossy(k)))
            };
            match k {
                b"major" => sp.major = Some(num()?),
                b"minor" => sp.minor = Some(num()?),
                b"name" => sp.name = Some(value.to_vec()),
                b"realsize" | b"size" => sp.real_size = Some(num()?),
                b"numblocks" => sp.numblocks = Some(num()?),
                b"map" => sp.map = Some(value.to_vec()),
                b"offset" => {
                    let previous = sp.pending_offset.replace(num()?);
                    if previous.is_some() {
                        return Err("GNU.sparse.offset without its numbytes".into());
                    }
                }
                b"numbytes" => {
                    let off = sp
                        .pending_offset
                        .take()
                        .ok_or("GNU.sparse.numbytes without its offset")?;
                    sp.pairs.push((off, num()?));
                }
                _ => {}
            }
            return Ok(());
        }
        match key {
            b"path" => self.path = Some(value.to_vec()),
            b"linkpath" => self.link = Some(value.to_vec()),
            b"size" => self.size = Some(decimal(value).ok_or("bad PAX size")?),
            // Unparsable ids and times fall back to the header's, as before.
            b"uid" => self.uid = text.parse().ok(),
            b"gid" => self.gid = text.parse().ok(),
            b"mtime" => self.mtime = parse_pax_time(text),
            _ => {}
        }
        Ok(())
    }

    /// Applies the records to the entry (PAX values take precedence over the header's).
    fn apply(&mut self, h: &mut Header) {
        if let Some(p) = self.path.take() {
            h.path = p;
        }
        if let Some(l) = self.link.take() {
            h.link = l;
        }
        if let Some(u) = self.uid {
            h.uid = u;
        }
        if let Some(g) = self.gid {
            h.gid = g;
        }
        if let Some(t) = self.mtime {
            h.mtime = t;
        }
        h.xattrs = std::mem::take(&mut self.xattrs);
    }
}

/// Parses a PAX time (`1700000000.123456789`, maybe negative) into seconds and nanoseconds.
pub(crate) fn parse_pax_time(s: &str) -> Option<(i64, u32)> {
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
    // The sign is the text's, not the seconds' ("-0.5" has 0 seconds and is before the epoch).
    if s.starts_with('-') && nanos > 0 {
        // -1.5 means 1.5 seconds before the epoch.
        Some((secs.checked_sub(1)?, 1_000_000_000 - nanos))
    } else {
        Some((secs, nanos))
    }
}

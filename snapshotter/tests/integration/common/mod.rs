//! Shared test helpers: layers built in memory, snapshotters in temporary roots, mounts that clean up
//! after themselves, and a description of a mounted tree to compare.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::fs;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use minicri_snapshotter::{Backend, LayerSpec, LocalSnapshotter, Mount, Options, Snapshotter};
use sha2::{Digest, Sha256};

pub const TAR: &str = "application/vnd.oci.image.layer.v1.tar";
pub const GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";

/// A layer tar under construction.
pub struct Layer {
    b: tar::Builder<Vec<u8>>,
}

/// Per-entry metadata for [`Layer::entry`].
#[derive(Clone)]
pub struct Attrs {
    pub mode: u32,
    pub uid: u64,
    pub gid: u64,
    pub mtime: u64,
    /// PAX records (xattrs as `SCHILY.xattr.<name>`, `mtime` with fractions).
    pub pax: Vec<(String, Vec<u8>)>,
}

impl Default for Attrs {
    fn default() -> Self {
        Attrs {
            mode: 0o644,
            uid: 0,
            gid: 0,
            mtime: 1_600_000_000,
            pax: Vec::new(),
        }
    }
}

impl Attrs {
    pub fn mode(mode: u32) -> Self {
        Attrs {
            mode,
            ..Default::default()
        }
    }
    pub fn xattr(mut self, name: &str, value: &[u8]) -> Self {
        self.pax
            .push((format!("SCHILY.xattr.{name}"), value.to_vec()));
        self
    }
}

impl Default for Layer {
    fn default() -> Self {
        Self::new()
    }
}

impl Layer {
    pub fn new() -> Self {
        Layer {
            b: tar::Builder::new(Vec::new()),
        }
    }

    fn pax(&mut self, records: &[(String, Vec<u8>)]) {
        if records.is_empty() {
            return;
        }
        let mut data = Vec::new();
        for (k, v) in records {
            let body_len = 1 + k.len() + 1 + v.len() + 1;
            let mut len = body_len + 1;
            while len.to_string().len() + body_len != len {
                len = len.to_string().len() + body_len;
            }
            data.extend_from_slice(format!("{len} {k}=").as_bytes());
            data.extend_from_slice(v);
            data.push(b'\n');
        }
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(tar::EntryType::XHeader);
        h.set_size(data.len() as u64);
        raw_name(&mut h, b"PaxHeader");
        h.set_cksum();
        self.b.append(&h, &data[..]).unwrap();
    }

    /// Appends an entry with a raw (unchecked) name and link name.
    pub fn entry(
        &mut self,
        kind: tar::EntryType,
        name: &[u8],
        link: Option<&[u8]>,
        data: &[u8],
        a: &Attrs,
    ) -> &mut Self {
        self.pax(&a.pax);
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(kind);
        h.set_mode(a.mode);
        h.set_uid(a.uid);
        h.set_gid(a.gid);
        h.set_mtime(a.mtime);
        h.set_size(data.len() as u64);
        raw_name(&mut h, name);
        if let Some(l) = link {
            let old = h.as_old_mut();
            old.linkname = [0; 100];
            old.linkname[..l.len()].copy_from_slice(l);
        }
        h.set_cksum();
        self.b.append(&h, data).unwrap();
        self
    }

    pub fn dir(&mut self, name: &str, mode: u32) -> &mut Self {
        self.entry(
            tar::EntryType::Directory,
            name.as_bytes(),
            None,
            b"",
            &Attrs::mode(mode),
        )
    }
    pub fn file(&mut self, name: &str, data: &[u8]) -> &mut Self {
        self.entry(
            tar::EntryType::Regular,
            name.as_bytes(),
            None,
            data,
            &Attrs::default(),
        )
    }
    pub fn file_with(&mut self, name: &str, data: &[u8], a: &Attrs) -> &mut Self {
        self.entry(tar::EntryType::Regular, name.as_bytes(), None, data, a)
    }
    pub fn symlink(&mut self, name: &str, target: &str) -> &mut Self {
        self.entry(
            tar::EntryType::Symlink,
            name.as_bytes(),
            Some(target.as_bytes()),
            b"",
            &Attrs::mode(0o777),
        )
    }
    pub fn hardlink(&mut self, name: &str, target: &str) -> &mut Self {
        self.entry(
            tar::EntryType::Link,
            name.as_bytes(),
            Some(target.as_bytes()),
            b"",
            &Attrs::default(),
        )
    }
    /// `.wh.<name>` next to `path`.
    pub fn whiteout(&mut self, path: &str) -> &mut Self {
        let p = Path::new(path);
        let name = format!(".wh.{}", p.file_name().unwrap().to_str().unwrap());
        let full = match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => format!("{}/{name}", d.display()),
            _ => name,
        };
        self.file(&full, b"")
    }
    pub fn opaque(&mut self, dir: &str) -> &mut Self {
        self.file(&format!("{dir}/.wh..wh..opq"), b"")
    }
    pub fn device(
        &mut self,
        kind: tar::EntryType,
        name: &str,
        major: u32,
        minor: u32,
        mode: u32,
    ) -> &mut Self {
        self.pax(&[]);
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_600_000_000);
        h.set_size(0);
        h.set_device_major(major).unwrap();
        h.set_device_minor(minor).unwrap();
        raw_name(&mut h, name.as_bytes());
        h.set_cksum();
        self.b.append(&h, &b""[..]).unwrap();
        self
    }

    /// Appends a prepared header and its data as they are.
    pub fn raw(&mut self, h: &tar::Header, data: &[u8]) -> &mut Self {
        self.b.append(h, data).unwrap();
        self
    }

    /// Appends an extension header (`x`, `g`, `L`, `K`) with `data`.
    pub fn extension(&mut self, kind: u8, data: &[u8]) -> &mut Self {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::new(kind));
        h.set_size(data.len() as u64);
        raw_name(&mut h, b"././@LongLink");
        h.set_cksum();
        self.b.append(&h, data).unwrap();
        self
    }

    pub fn finish(self) -> Vec<u8> {
        self.b.into_inner().unwrap()
    }
}

fn raw_name(h: &mut tar::Header, name: &[u8]) {
    let old = h.as_old_mut();
    old.name = [0; 100];
    old.name[..name.len()].copy_from_slice(name);
}

pub fn diff_id(tar: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(tar)))
}

pub fn gzip(data: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

pub fn zstd(data: &[u8]) -> Vec<u8> {
    zstd::encode_all(data, 3).unwrap()
}

pub fn open(backend: Backend) -> (tempfile::TempDir, LocalSnapshotter) {
    let dir = tempfile::tempdir().unwrap();
    let s = reopen(backend, dir.path());
    (dir, s)
}

pub fn reopen(backend: Backend, dir: &Path) -> LocalSnapshotter {
    reopen_with(backend, dir, Options::default())
}

/// [`open`] with other options (commits are never synced in tests).
pub fn open_with(backend: Backend, options: Options) -> (tempfile::TempDir, LocalSnapshotter) {
    let dir = tempfile::tempdir().unwrap();
    let s = reopen_with(backend, dir.path(), options);
    (dir, s)
}

pub fn reopen_with(backend: Backend, dir: &Path, options: Options) -> LocalSnapshotter {
    LocalSnapshotter::open(
        dir.join("root"),
        backend,
        Options {
            sync_on_commit: false,
            ..options
        },
    )
    .unwrap()
}

/// The user the helpers record on the layers they apply (unowned layers are collected as soon as a
/// snapshot on top of them goes).
pub const IMAGE: &str = "test-image";

/// Applies an uncompressed layer on `parent` for [`IMAGE`], returning the chain id.
pub fn apply(s: &dyn Snapshotter, parent: Option<&str>, tar: &[u8]) -> String {
    try_apply(s, parent, tar, Some(IMAGE)).unwrap()
}

pub fn try_apply(
    s: &dyn Snapshotter,
    parent: Option<&str>,
    tar: &[u8],
    user: Option<&str>,
) -> minicri_snapshotter::Result<String> {
    let d = diff_id(tar);
    let spec = LayerSpec {
        media_type: TAR,
        diff_id: &d,
        parent,
        user,
        ..Default::default()
    };
    s.apply_layer(&spec, &mut &tar[..]).map(|a| a.chain_id)
}

/// Applies `stream`, a bottom layer of `media_type` said to have `diff_id`; returns its chain id.
pub fn try_apply_stream(
    s: &dyn Snapshotter,
    media_type: &str,
    diff_id: &str,
    stream: &mut (dyn std::io::Read + Send),
) -> minicri_snapshotter::Result<String> {
    let spec = LayerSpec {
        media_type,
        diff_id,
        parent: None,
        user: None,
        ..Default::default()
    };
    s.apply_layer(&spec, stream).map(|a| a.chain_id)
}

/// Applies layers bottom first; returns the chain ids.
pub fn apply_all(s: &dyn Snapshotter, layers: &[Vec<u8>]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for l in layers {
        let c = apply(s, out.last().map(String::as_str), l);
        out.push(c);
    }
    out
}

/// Applies layers as a pull that unpacks an image's layers at once does: every layer but the bottom
/// one starts with [`Snapshotter::apply_layer_early`] while its parent is not committed (the bottom
/// layer starts only once all the others have unpacked or given up), and a layer that needs its
/// parent ([`minicri_snapshotter::Error::NeedsParent`]) is applied again on top of it. Returns the
/// chain ids and how many layers needed their parent.
pub fn apply_all_early(s: &dyn Snapshotter, layers: &[Vec<u8>]) -> (Vec<String>, usize) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Condvar, Mutex};

    let diff_ids: Vec<String> = layers.iter().map(|l| diff_id(l)).collect();
    let chains = minicri_snapshotter::chain_ids(&diff_ids);
    // done[i]: whether layer i is committed, once its apply has ended.
    let done: Vec<Mutex<Option<bool>>> = layers.iter().map(|_| Mutex::new(None)).collect();
    let changed = Condvar::new();
    let arrived = Mutex::new(0usize);
    let needed_parent = AtomicUsize::new(0);
    let wait_done = |i: usize| -> bool {
        let mut g = done[i].lock().unwrap();
        while g.is_none() {
            g = changed.wait(g).unwrap();
        }
        g.unwrap()
    };
    let arrive = || {
        *arrived.lock().unwrap() += 1;
        changed.notify_all();
    };
    std::thread::scope(|scope| {
        for (i, tar) in layers.iter().enumerate() {
            let (diff_ids, chains, done) = (&diff_ids, &chains, &done);
            let (changed, arrived, needed_parent) = (&changed, &arrived, &needed_parent);
            let (wait_done, arrive) = (&wait_done, &arrive);
            scope.spawn(move || {
                let spec = LayerSpec {
                    media_type: TAR,
                    diff_id: &diff_ids[i],
                    parent: i.checked_sub(1).map(|p| chains[p].as_str()),
                    user: Some(IMAGE),
                    ..Default::default()
                };
                let result = if i == 0 {
                    let mut n = arrived.lock().unwrap();
                    while *n + 1 < layers.len() {
                        n = changed.wait(n).unwrap();
                    }
                    drop(n);
                    s.apply_layer(&spec, &mut &tar[..])
                } else {
                    let asked = std::cell::Cell::new(false);
                    let ready = || {
                        asked.set(true);
                        arrive();
                        wait_done(i - 1)
                    };
                    match s.apply_layer_early(&spec, &mut &tar[..], &ready) {
                        Err(minicri_snapshotter::Error::NeedsParent { .. }) => {
                            needed_parent.fetch_add(1, Ordering::Relaxed);
                            if !asked.get() {
                                arrive();
                            }
                            wait_done(i - 1);
                            s.apply_layer(&spec, &mut &tar[..])
                        }
                        other => other,
                    }
                };
                *done[i].lock().unwrap() = Some(result.is_ok());
                changed.notify_all();
                let applied = result.unwrap();
                assert_eq!(applied.chain_id, chains[i]);
            });
        }
    });
    (chains, needed_parent.into_inner())
}

/// A mount that is undone when dropped, even when the test fails.
pub struct Mounted {
    pub path: PathBuf,
}

impl Mounted {
    pub fn new(m: &Mount, path: &Path) -> Self {
        fs::create_dir_all(path).unwrap();
        m.mount_at(path)
            .unwrap_or_else(|e| panic!("mount {m:?}: {e}"));
        Mounted {
            path: path.to_path_buf(),
        }
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.path, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// One node of a tree, as compared by the tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub kind: char,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// Non-directories only: directory times depend on how a backend wrote them.
    pub mtime: Option<(i64, i64)>,
    pub content: Vec<u8>,
    pub rdev: u64,
    pub xattrs: BTreeMap<String, Vec<u8>>,
}

/// Reads one xattr (not following symlinks).
pub fn get_xattr(p: &Path, name: &str) -> Option<Vec<u8>> {
    let cp = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    let cn = std::ffi::CString::new(name).unwrap();
    let mut buf = vec![0u8; 65536];
    // SAFETY: NUL-terminated strings, buffer valid for its length.
    let n =
        unsafe { libc::lgetxattr(cp.as_ptr(), cn.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return None;
    }
    buf.truncate(n as usize);
    Some(buf)
}

fn xattrs(p: &Path) -> BTreeMap<String, Vec<u8>> {
    let cp = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
    let mut buf = vec![0u8; 65536];
    // SAFETY: NUL-terminated path, buffer valid for its length.
    let n = unsafe { libc::llistxattr(cp.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert!(n >= 0, "listxattr {}", p.display());
    buf.truncate(n as usize);
    let mut out = BTreeMap::new();
    for name in buf.split(|b| *b == 0).filter(|s| !s.is_empty()) {
        let n = String::from_utf8_lossy(name).into_owned();
        if n.starts_with("user.") || n == "security.capability" {
            let v = get_xattr(p, &n).unwrap_or_default();
            out.insert(n, v);
        }
    }
    out
}

/// Describes the tree under `root` (keys are relative paths, "" the root).
pub fn describe(root: &Path) -> BTreeMap<String, Node> {
    let mut out = BTreeMap::new();
    walk(root, Path::new(""), &mut out);
    out
}

fn walk(root: &Path, rel: &Path, out: &mut BTreeMap<String, Node>) {
    let p = root.join(rel);
    let m = fs::symlink_metadata(&p).unwrap();
    let ft = m.file_type();
    let (kind, content) = if ft.is_dir() {
        ('d', Vec::new())
    } else if ft.is_symlink() {
        (
            'l',
            fs::read_link(&p).unwrap().as_os_str().as_bytes().to_vec(),
        )
    } else if ft.is_file() {
        ('f', fs::read(&p).unwrap())
    } else if ft.is_char_device() {
        ('c', Vec::new())
    } else if ft.is_block_device() {
        ('b', Vec::new())
    } else {
        ('p', Vec::new())
    };
    out.insert(
        rel.to_string_lossy().into_owned(),
        Node {
            kind,
            mode: if kind == 'l' { 0 } else { m.mode() & 0o7777 },
            uid: m.uid(),
            gid: m.gid(),
            mtime: (kind != 'd').then(|| (m.mtime(), m.mtime_nsec())),
            content,
            rdev: m.rdev(),
            xattrs: if kind == 'l' {
                BTreeMap::new()
            } else {
                xattrs(&p)
            },
        },
    );
    if kind == 'd' {
        let mut names: Vec<_> = fs::read_dir(&p)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        for n in names {
            walk(root, &rel.join(OsStr::new(&n)), out);
        }
    }
}

/// Mounts a view of `chain`, runs `f` on the mounted path, and cleans everything up.
pub fn with_view<T>(s: &dyn Snapshotter, chain: &str, f: impl FnOnce(&Path) -> T) -> T {
    let key = format!("view-{}", rand_suffix());
    let m = s.view(&key, Some(chain)).unwrap();
    let mnt = tempfile::tempdir().unwrap();
    let result = {
        let mounted = Mounted::new(&m, &mnt.path().join("m"));
        f(&mounted.path)
    };
    s.remove(&key).unwrap();
    result
}

pub fn view_tree(s: &dyn Snapshotter, chain: &str) -> BTreeMap<String, Node> {
    with_view(s, chain, describe)
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Names in the directory, sorted.
pub fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// Runs a test body for both backends.
#[macro_export]
macro_rules! both_backends {
    ($($name:ident),* $(,)?) => {
        mod overlay {
            $( #[test] fn $name() { super::$name(minicri_snapshotter::Backend::Overlay) } )*
        }
        mod copy {
            $( #[test] fn $name() { super::$name(minicri_snapshotter::Backend::Copy) } )*
        }
    };
}

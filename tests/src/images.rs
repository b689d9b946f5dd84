//! Owns the test images: a builder that makes image filesystems from busybox-static as tar
//! layers (gzip, zstd or uncompressed), OCI and Docker schema 2 configs and manifests, OCI image
//! indexes and Docker manifest lists, and pushes them over the registry HTTP API
//! ([`RegistryClient`]). Also the documented standard set of images every pull test can rely on
//! ([`push_standard_set`]) and file-backed layers of random bytes for large-pull tests
//! ([`random_layer`]).
//!
//! Everything is reproducible: tar entries have fixed owners and mtimes, gzip has no timestamp,
//! configs have a fixed `created`, so building the same image twice gives the same digests.
//!
//! ```no_run
//! # async fn example(addr: &str) -> anyhow::Result<()> {
//! use minicri_tests::images::*;
//! let client = RegistryClient::new(addr);
//! let pushed = ImageBuilder::busybox()
//!     .layer(LayerBuilder::new().file("etc/motd", "hello\n", 0o644).build(Compression::Zstd)?)
//!     .user("1000")
//!     .format(Format::Oci)
//!     .push(&client, "my/test:tag")
//!     .await?;
//! assert_eq!(pushed.layers.len(), 2);
//! # Ok(()) }
//! ```

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::File;
use std::io::{self, BufWriter, Read, Write};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{Context, Result, anyhow, bail, ensure};
use bytes::Bytes;
use rand::{RngCore, SeedableRng, rngs::StdRng};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// OCI image manifest.
pub const MEDIA_OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// OCI image index.
pub const MEDIA_OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// OCI image config.
pub const MEDIA_OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
/// OCI layer, uncompressed tar.
pub const MEDIA_OCI_LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
/// OCI layer, gzip-compressed tar.
pub const MEDIA_OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// OCI layer, zstd-compressed tar.
pub const MEDIA_OCI_LAYER_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
/// Docker image manifest, schema 2.
pub const MEDIA_DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
/// Docker manifest list.
pub const MEDIA_DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
/// Docker image config.
pub const MEDIA_DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
/// Docker layer, gzip-compressed tar.
pub const MEDIA_DOCKER_LAYER_GZIP: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
/// Docker layer, uncompressed tar.
pub const MEDIA_DOCKER_LAYER_TAR: &str = "application/vnd.docker.image.rootfs.diff.tar";

/// Every manifest media type, for `Accept` headers.
pub const MANIFEST_MEDIA_TYPES: [&str; 4] = [
    MEDIA_OCI_MANIFEST,
    MEDIA_OCI_INDEX,
    MEDIA_DOCKER_MANIFEST,
    MEDIA_DOCKER_LIST,
];

/// The busybox-static binary the images are made from.
pub const BUSYBOX_BIN: &str = "/bin/busybox";
/// The `created` time of every config and history entry.
pub const CREATED: &str = "2024-01-01T00:00:00Z";
/// The mtime of every tar entry (2024-01-01T00:00:00Z).
pub const MTIME: u64 = 1_704_067_200;
/// `PATH` in every image's `Env` unless changed.
pub const DEFAULT_PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// `/etc/passwd` of the busybox rootfs.
pub const ETC_PASSWD: &str = "root:x:0:0:root:/root:/bin/sh
daemon:x:1:1:daemon:/usr/sbin:/bin/false
minicri:x:1000:1000:minicri test user:/home/minicri:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
";
/// `/etc/group` of the busybox rootfs: user `minicri` (1000) is also in group `extra` (1001).
pub const ETC_GROUP: &str = "root:x:0:
daemon:x:1:
wheel:x:10:root
minicri:x:1000:
extra:x:1001:minicri
nogroup:x:65534:
";

/// `sha256:<hex>` of some bytes.
pub fn sha256_digest(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// How a layer's tar is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Compression {
    Gzip,
    Zstd,
    /// Uncompressed tar.
    None,
}

impl Compression {
    /// The layer media type for this compression in the given manifest format. Docker schema 2
    /// has no zstd type, so zstd layers use the OCI one there (as Docker's own tools do).
    pub fn media_type(self, format: Format) -> &'static str {
        match (format, self) {
            (Format::Oci, Compression::Gzip) => MEDIA_OCI_LAYER_GZIP,
            (Format::Oci, Compression::None) => MEDIA_OCI_LAYER_TAR,
            (_, Compression::Zstd) => MEDIA_OCI_LAYER_ZSTD,
            (Format::Docker, Compression::Gzip) => MEDIA_DOCKER_LAYER_GZIP,
            (Format::Docker, Compression::None) => MEDIA_DOCKER_LAYER_TAR,
        }
    }
}

impl std::str::FromStr for Compression {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "gzip" | "gz" => Ok(Compression::Gzip),
            "zstd" | "zst" => Ok(Compression::Zstd),
            "none" | "tar" | "plain" => Ok(Compression::None),
            _ => bail!("unknown compression {s:?} (gzip, zstd, none)"),
        }
    }
}

/// Manifest format family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// OCI image manifest / OCI image index.
    Oci,
    /// Docker schema 2 manifest / Docker manifest list.
    Docker,
}

impl Format {
    /// The media type of a single-image manifest.
    pub fn manifest_media_type(self) -> &'static str {
        match self {
            Format::Oci => MEDIA_OCI_MANIFEST,
            Format::Docker => MEDIA_DOCKER_MANIFEST,
        }
    }
    /// The media type of a multi-platform manifest.
    pub fn index_media_type(self) -> &'static str {
        match self {
            Format::Oci => MEDIA_OCI_INDEX,
            Format::Docker => MEDIA_DOCKER_LIST,
        }
    }
    /// The media type of the config blob.
    pub fn config_media_type(self) -> &'static str {
        match self {
            Format::Oci => MEDIA_OCI_CONFIG,
            Format::Docker => MEDIA_DOCKER_CONFIG,
        }
    }
}

/// An image platform.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Platform {
    pub os: String,
    pub architecture: String,
    pub variant: Option<String>,
}

impl Platform {
    pub fn linux_amd64() -> Platform {
        Platform {
            os: "linux".into(),
            architecture: "amd64".into(),
            variant: None,
        }
    }
    /// linux/arm64/v8.
    pub fn linux_arm64() -> Platform {
        Platform {
            os: "linux".into(),
            architecture: "arm64".into(),
            variant: Some("v8".into()),
        }
    }
    fn to_json(&self) -> Value {
        let mut v = json!({ "architecture": self.architecture, "os": self.os });
        if let Some(variant) = &self.variant {
            v["variant"] = json!(variant);
        }
        v
    }
}

impl fmt::Display for Platform {
    /// `os/arch` or `os/arch/variant`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)?;
        if let Some(variant) = &self.variant {
            write!(f, "/{variant}")?;
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Layers

/// The bytes of a blob: in memory, in a temporary file (big layers) removed when the last
/// clone is dropped, or in a file of the caller's, left alone.
#[derive(Clone)]
enum Blob {
    Memory(Bytes),
    File(Arc<tempfile::TempPath>),
    Kept(Arc<Path>),
}

/// A built layer blob with its digests.
#[derive(Clone)]
pub struct Layer {
    /// Digest of the (compressed) blob.
    pub digest: String,
    /// Size of the (compressed) blob.
    pub size: u64,
    /// Digest of the uncompressed tar (`rootfs.diff_ids`).
    pub diff_id: String,
    /// Size of the uncompressed tar.
    pub tar_size: u64,
    pub compression: Compression,
    /// The history `created_by` of this layer.
    pub created_by: String,
    blob: Blob,
}

impl fmt::Debug for Layer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Layer")
            .field("digest", &self.digest)
            .field("size", &self.size)
            .field("diff_id", &self.diff_id)
            .field("compression", &self.compression)
            .field("created_by", &self.created_by)
            .finish()
    }
}

impl Layer {
    /// Compresses an existing tar archive (any bytes, even a broken tar) into a layer.
    pub fn from_tar(tar: &[u8], compression: Compression, created_by: &str) -> io::Result<Layer> {
        let mut sink = LayerSink::new(Vec::new(), compression, 6)?;
        sink.write_all(tar)?;
        let (data, sums) = sink.finish()?;
        Ok(sums.into_layer(Blob::Memory(data.into()), compression, created_by))
    }

    /// The media type of this layer in a manifest of the given format.
    pub fn media_type(&self, format: Format) -> &'static str {
        self.compression.media_type(format)
    }

    /// The blob bytes (reads the file for file-backed layers: mind the size).
    pub fn data(&self) -> io::Result<Bytes> {
        match &self.blob {
            Blob::Memory(b) => Ok(b.clone()),
            Blob::File(path) => std::fs::read(&***path).map(Bytes::from),
            Blob::Kept(path) => std::fs::read(path).map(Bytes::from),
        }
    }

    /// The file holding the blob, for file-backed layers.
    pub fn path(&self) -> Option<&Path> {
        match &self.blob {
            Blob::Memory(_) => None,
            Blob::File(path) => Some(&***path),
            Blob::Kept(path) => Some(path),
        }
    }

    /// The uncompressed tar.
    pub fn tar(&self) -> io::Result<Vec<u8>> {
        let data = self.data()?;
        let mut out = Vec::new();
        match self.compression {
            Compression::None => out.extend_from_slice(&data),
            Compression::Gzip => {
                flate2::read::GzDecoder::new(&data[..]).read_to_end(&mut out)?;
            }
            Compression::Zstd => {
                zstd::stream::read::Decoder::new(&data[..])?.read_to_end(&mut out)?;
            }
        }
        Ok(out)
    }
}

/// Counts and hashes what is written through it.
struct HashWriter<W> {
    inner: W,
    hasher: Sha256,
    count: u64,
}

impl<W: Write> HashWriter<W> {
    fn new(inner: W) -> Self {
        HashWriter {
            inner,
            hasher: Sha256::new(),
            count: 0,
        }
    }
    fn finish(self) -> (W, String, u64) {
        let digest = format!("sha256:{}", hex::encode(self.hasher.finalize()));
        (self.inner, digest, self.count)
    }
}

impl<W: Write> Write for HashWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.count += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

enum Encoder<W: Write> {
    Gzip(flate2::write::GzEncoder<W>),
    Zstd(zstd::stream::write::Encoder<'static, W>),
    Plain(W),
}

impl<W: Write> Write for Encoder<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Encoder::Gzip(e) => e.write(buf),
            Encoder::Zstd(e) => e.write(buf),
            Encoder::Plain(w) => w.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Encoder::Gzip(e) => e.flush(),
            Encoder::Zstd(e) => e.flush(),
            Encoder::Plain(w) => w.flush(),
        }
    }
}

/// tar bytes in → (hash of tar) → compressor → (hash of blob) → W.
struct LayerSink<W: Write> {
    inner: HashWriter<Encoder<HashWriter<W>>>,
}

struct LayerSums {
    digest: String,
    size: u64,
    diff_id: String,
    tar_size: u64,
}

impl LayerSums {
    fn into_layer(self, blob: Blob, compression: Compression, created_by: &str) -> Layer {
        Layer {
            digest: self.digest,
            size: self.size,
            diff_id: self.diff_id,
            tar_size: self.tar_size,
            compression,
            created_by: created_by.to_string(),
            blob,
        }
    }
}

impl<W: Write> LayerSink<W> {
    /// `gzip_level` 0-9 (only used for gzip).
    fn new(out: W, compression: Compression, gzip_level: u32) -> io::Result<Self> {
        let out = HashWriter::new(out);
        let encoder = match compression {
            // flate2 writes a header without mtime or file name: reproducible.
            Compression::Gzip => Encoder::Gzip(flate2::write::GzEncoder::new(
                out,
                flate2::Compression::new(gzip_level),
            )),
            Compression::Zstd => Encoder::Zstd(zstd::stream::write::Encoder::new(out, 3)?),
            Compression::None => Encoder::Plain(out),
        };
        Ok(LayerSink {
            inner: HashWriter::new(encoder),
        })
    }

    fn finish(self) -> io::Result<(W, LayerSums)> {
        let (encoder, diff_id, tar_size) = self.inner.finish();
        let mut out = match encoder {
            Encoder::Gzip(e) => e.finish()?,
            Encoder::Zstd(e) => e.finish()?,
            Encoder::Plain(w) => w,
        };
        out.flush()?;
        let (w, digest, size) = out.finish();
        Ok((
            w,
            LayerSums {
                digest,
                size,
                diff_id,
                tar_size,
            },
        ))
    }
}

impl<W: Write> Write for LayerSink<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.inner.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[derive(Debug, Clone)]
enum Entry {
    Dir {
        path: String,
        mode: u32,
        uid: u64,
        gid: u64,
    },
    File {
        path: String,
        data: Bytes,
        mode: u32,
        uid: u64,
        gid: u64,
    },
    Symlink {
        path: String,
        target: String,
    },
    Hardlink {
        path: String,
        target: String,
    },
}

/// The contents of one layer, as tar entries in the order added. Paths are relative to the
/// root ("bin/sh"; a leading "/" is removed). Parent directories are not added implicitly.
#[derive(Debug, Clone, Default)]
pub struct LayerBuilder {
    entries: Vec<Entry>,
    created_by: Option<String>,
}

fn rel(path: &str) -> String {
    path.trim_start_matches('/')
        .trim_end_matches('/')
        .to_string()
}

impl LayerBuilder {
    pub fn new() -> Self {
        Self::default()
    }

    /// The history `created_by` text of the layer (defaults to a summary of its entries).
    pub fn created_by(mut self, text: &str) -> Self {
        self.created_by = Some(text.to_string());
        self
    }

    /// A directory owned by root.
    pub fn dir(self, path: &str, mode: u32) -> Self {
        self.dir_owned(path, mode, 0, 0)
    }

    pub fn dir_owned(mut self, path: &str, mode: u32, uid: u64, gid: u64) -> Self {
        self.entries.push(Entry::Dir {
            path: rel(path),
            mode,
            uid,
            gid,
        });
        self
    }

    /// A regular file owned by root.
    pub fn file(self, path: &str, data: impl Into<Bytes>, mode: u32) -> Self {
        self.file_owned(path, data, mode, 0, 0)
    }

    pub fn file_owned(
        mut self,
        path: &str,
        data: impl Into<Bytes>,
        mode: u32,
        uid: u64,
        gid: u64,
    ) -> Self {
        self.entries.push(Entry::File {
            path: rel(path),
            data: data.into(),
            mode,
            uid,
            gid,
        });
        self
    }

    /// A symbolic link at `path` pointing to `target` (kept as given, relative or absolute).
    pub fn symlink(mut self, path: &str, target: &str) -> Self {
        self.entries.push(Entry::Symlink {
            path: rel(path),
            target: target.to_string(),
        });
        self
    }

    /// A hard link at `path` to `target`, an earlier entry of the same layer (path from root).
    pub fn hardlink(mut self, path: &str, target: &str) -> Self {
        self.entries.push(Entry::Hardlink {
            path: rel(path),
            target: rel(target),
        });
        self
    }

    /// Deletes `path` of a lower layer (an OCI whiteout file `.wh.<name>`).
    pub fn whiteout(self, path: &str) -> Self {
        let path = rel(path);
        let (dir, name) = match path.rsplit_once('/') {
            Some((dir, name)) => (format!("{dir}/"), name),
            None => (String::new(), path.as_str()),
        };
        let wh = format!("{dir}.wh.{name}");
        self.file(&wh, Bytes::new(), 0o644)
    }

    /// Hides everything lower layers have in directory `dir` (an opaque whiteout `.wh..wh..opq`).
    pub fn opaque(self, dir: &str) -> Self {
        let wh = format!("{}/.wh..wh..opq", rel(dir));
        self.file(&wh, Bytes::new(), 0o644)
    }

    /// Appends the entries of another builder.
    pub fn extend(mut self, other: LayerBuilder) -> Self {
        self.entries.extend(other.entries);
        self
    }

    /// The uncompressed tar archive.
    pub fn tar(&self) -> io::Result<Vec<u8>> {
        let mut out = Vec::new();
        self.write_tar(&mut out)?;
        Ok(out)
    }

    fn write_tar<W: Write>(&self, out: W) -> io::Result<W> {
        let mut builder = tar::Builder::new(out);
        for entry in &self.entries {
            append_entry(&mut builder, entry)?;
        }
        builder.into_inner()
    }

    /// Builds the tar and compresses it.
    pub fn build(&self, compression: Compression) -> io::Result<Layer> {
        let sink = LayerSink::new(Vec::new(), compression, 6)?;
        let sink = self.write_tar(sink)?;
        let (data, sums) = sink.finish()?;
        let created_by = self
            .created_by
            .clone()
            .unwrap_or_else(|| format!("minicri-tests layer of {} entries", self.entries.len()));
        Ok(sums.into_layer(Blob::Memory(data.into()), compression, &created_by))
    }
}

fn header(entry_type: tar::EntryType, mode: u32, uid: u64, gid: u64, size: u64) -> tar::Header {
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(entry_type);
    h.set_mode(mode);
    h.set_uid(uid);
    h.set_gid(gid);
    h.set_size(size);
    h.set_mtime(MTIME);
    h
}

fn append_entry<W: Write>(builder: &mut tar::Builder<W>, entry: &Entry) -> io::Result<()> {
    match entry {
        Entry::Dir {
            path,
            mode,
            uid,
            gid,
        } => {
            let mut h = header(tar::EntryType::Directory, *mode, *uid, *gid, 0);
            builder.append_data(&mut h, format!("{path}/"), io::empty())
        }
        Entry::File {
            path,
            data,
            mode,
            uid,
            gid,
        } => {
            let mut h = header(
                tar::EntryType::Regular,
                *mode,
                *uid,
                *gid,
                data.len() as u64,
            );
            builder.append_data(&mut h, path, &data[..])
        }
        Entry::Symlink { path, target } => {
            let mut h = header(tar::EntryType::Symlink, 0o777, 0, 0, 0);
            builder.append_link(&mut h, path, target)
        }
        Entry::Hardlink { path, target } => {
            let mut h = header(tar::EntryType::Link, 0o644, 0, 0, 0);
            builder.append_link(&mut h, path, target)
        }
    }
}

/// Reads busybox-static and checks that it is a static ELF (no program interpreter): a
/// dynamic busybox would not run in the test images.
fn busybox_binary() -> io::Result<Bytes> {
    static BIN: OnceLock<Bytes> = OnceLock::new();
    if let Some(b) = BIN.get() {
        return Ok(b.clone());
    }
    let data = std::fs::read(BUSYBOX_BIN).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("{BUSYBOX_BIN}: {e}; run hack/install-deps.sh (busybox-static)"),
        )
    })?;
    if has_interpreter(&data) {
        return Err(io::Error::other(format!(
            "{BUSYBOX_BIN} is dynamically linked; install busybox-static (hack/install-deps.sh)"
        )));
    }
    Ok(BIN.get_or_init(|| Bytes::from(data)).clone())
}

/// Whether a 64-bit little-endian ELF has a PT_INTERP program header.
fn has_interpreter(elf: &[u8]) -> bool {
    let u16_at = |o: usize| elf.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |o: usize| {
        elf.get(o..o + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let u64_at = |o: usize| {
        elf.get(o..o + 8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
    };
    if elf.get(..4) != Some(b"\x7fELF") || elf.get(4) != Some(&2) {
        return false;
    }
    let (Some(phoff), Some(phentsize), Some(phnum)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38))
    else {
        return false;
    };
    (0..phnum as usize).any(|i| u32_at(phoff as usize + i * phentsize as usize) == Some(3))
}

/// The applet names busybox was built with, sorted.
fn busybox_applets() -> io::Result<Vec<String>> {
    let out = std::process::Command::new(BUSYBOX_BIN)
        .arg("--list")
        .stdin(std::process::Stdio::null())
        .output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!("{BUSYBOX_BIN} --list failed")));
    }
    let mut applets: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|a| !a.is_empty() && *a != "busybox" && !a.contains('/'))
        .map(String::from)
        .collect();
    applets.sort();
    applets.dedup();
    Ok(applets)
}

/// The busybox root filesystem: the usual directories (`/tmp` and `/var/tmp` 1777, `/root`
/// 0700, `/home/minicri` owned by 1000:1000), `/bin/busybox` (0755) with a symlink
/// `/bin/<applet>` → `busybox` for every applet (and `/usr/bin/env`), [`ETC_PASSWD`],
/// [`ETC_GROUP`] and an `/etc/hostname`. Add entries to it for a custom base.
pub fn busybox_rootfs() -> io::Result<LayerBuilder> {
    let mut b = LayerBuilder::new().created_by("minicri-tests: busybox-static rootfs");
    for (dir, mode) in [
        ("bin", 0o755),
        ("dev", 0o755),
        ("etc", 0o755),
        ("home", 0o755),
        ("proc", 0o755),
        ("root", 0o700),
        ("run", 0o755),
        ("sbin", 0o755),
        ("sys", 0o755),
        ("tmp", 0o1777),
        ("usr", 0o755),
        ("usr/bin", 0o755),
        ("usr/sbin", 0o755),
        ("var", 0o755),
        ("var/tmp", 0o1777),
    ] {
        b = b.dir(dir, mode);
    }
    b = b.dir_owned("home/minicri", 0o755, 1000, 1000).file(
        "bin/busybox",
        busybox_binary()?,
        0o755,
    );
    for applet in busybox_applets()? {
        b = b.symlink(&format!("bin/{applet}"), "busybox");
    }
    b = b
        .symlink("usr/bin/env", "../../bin/busybox")
        .file("etc/passwd", ETC_PASSWD, 0o644)
        .file("etc/group", ETC_GROUP, 0o644)
        .file("etc/hostname", "minicri-test\n", 0o644);
    Ok(b)
}

/// [`busybox_rootfs`] built as one layer (cached per compression: always the same blob).
pub fn busybox_layer(compression: Compression) -> io::Result<Layer> {
    static CACHE: OnceLock<Mutex<HashMap<Compression, Layer>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(layer) = cache.lock().unwrap().get(&compression) {
        return Ok(layer.clone());
    }
    let layer = busybox_rootfs()?.build(compression)?;
    cache.lock().unwrap().insert(compression, layer.clone());
    Ok(layer)
}

/// Random bytes from a seeded generator, `remaining` of them.
struct RandomReader {
    rng: StdRng,
    remaining: u64,
}

impl Read for RandomReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = buf.len().min(self.remaining as usize);
        self.rng.fill_bytes(&mut buf[..n]);
        self.remaining -= n as u64;
        Ok(n)
    }
}

/// A layer holding `/data/random-<seed>.bin` with `mib` MiB of incompressible random bytes
/// (reproducible from `seed`). It is streamed into a temporary file (hashed while written;
/// never held in memory) and pushed from there; the file goes away with the last clone of the
/// layer. Gzip uses the fastest level.
pub fn random_layer(mib: u64, compression: Compression, seed: u64) -> io::Result<Layer> {
    let file = tempfile::Builder::new()
        .prefix("minicri-layer-")
        .tempfile()?;
    let (file, path) = file.into_parts();
    let sink = LayerSink::new(BufWriter::with_capacity(1 << 20, file), compression, 1)?;
    let mut builder = tar::Builder::new(sink);
    let mut h = header(tar::EntryType::Directory, 0o755, 0, 0, 0);
    builder.append_data(&mut h, "data/", io::empty())?;
    let size = mib * 1024 * 1024;
    let mut h = header(tar::EntryType::Regular, 0o644, 0, 0, size);
    let reader = RandomReader {
        rng: StdRng::seed_from_u64(seed),
        remaining: size,
    };
    builder.append_data(&mut h, format!("data/random-{seed}.bin"), reader)?;
    let sink = builder.into_inner()?;
    let (writer, sums) = sink.finish()?;
    let file: File = writer.into_inner().map_err(|e| e.into_error())?;
    file.sync_all().ok();
    Ok(sums.into_layer(
        Blob::File(Arc::new(path)),
        compression,
        &format!("minicri-tests: {mib} MiB of random bytes (seed {seed})"),
    ))
}

/// A layer from a gzip-compressed tar file made elsewhere (GNU tar keeps hard links, which the
/// benchmark's realistic image needs), pushed as it is: its digest and size are the file's, its
/// diff_id the decompressed stream's.
pub fn gzip_file_layer(path: &Path) -> io::Result<Layer> {
    let mut compressed = HashWriter::new(io::sink());
    let mut tar = HashWriter::new(io::sink());
    let mut tee = TeeReader {
        inner: io::BufReader::with_capacity(1 << 20, File::open(path)?),
        copy: &mut compressed,
    };
    io::copy(&mut flate2::read::MultiGzDecoder::new(&mut tee), &mut tar)?;
    // Bytes after the last gzip member (none from gzip itself) still belong to the blob.
    io::copy(&mut tee, &mut io::sink())?;
    let (_, digest, size) = compressed.finish();
    let (_, diff_id, tar_size) = tar.finish();
    Ok(LayerSums {
        digest,
        size,
        diff_id,
        tar_size,
    }
    .into_layer(
        Blob::Kept(Arc::from(path)),
        Compression::Gzip,
        &format!("minicri-tests: {}", path.display()),
    ))
}

/// Reads `inner` and writes what it read to `copy`.
struct TeeReader<'a, R, W> {
    inner: R,
    copy: &'a mut W,
}

impl<R: Read, W: Write> Read for TeeReader<'_, R, W> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.copy.write_all(&buf[..n])?;
        Ok(n)
    }
}

// ---------------------------------------------------------------------------------------------
// Images

/// A single-platform image under construction.
#[derive(Debug, Clone)]
pub struct ImageBuilder {
    layers: Vec<Layer>,
    platform: Platform,
    format: Format,
    cmd: Option<Vec<String>>,
    entrypoint: Option<Vec<String>>,
    env: Vec<String>,
    user: Option<String>,
    working_dir: Option<String>,
    labels: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
    stop_signal: Option<String>,
    created: String,
}

impl Default for ImageBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl ImageBuilder {
    /// No layers, linux/amd64, OCI, `Cmd ["/bin/sh"]`, `Env [PATH=...]`.
    pub fn new() -> Self {
        ImageBuilder {
            layers: Vec::new(),
            platform: Platform::linux_amd64(),
            format: Format::Oci,
            cmd: Some(vec!["/bin/sh".into()]),
            entrypoint: None,
            env: vec![DEFAULT_PATH.into()],
            user: None,
            working_dir: None,
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            stop_signal: None,
            created: CREATED.into(),
        }
    }

    /// [`ImageBuilder::new`] with the gzip busybox layer as its base.
    pub fn busybox() -> Self {
        let layer = busybox_layer(Compression::Gzip)
            .unwrap_or_else(|e| panic!("building the busybox layer: {e}"));
        Self::new().layer(layer)
    }

    /// Adds a layer on top.
    pub fn layer(mut self, layer: Layer) -> Self {
        self.layers.push(layer);
        self
    }

    pub fn layers(mut self, layers: impl IntoIterator<Item = Layer>) -> Self {
        self.layers.extend(layers);
        self
    }

    pub fn platform(mut self, platform: Platform) -> Self {
        self.platform = platform;
        self
    }

    pub fn format(mut self, format: Format) -> Self {
        self.format = format;
        self
    }

    /// `config.Cmd`; an empty slice removes it.
    pub fn cmd(mut self, cmd: &[&str]) -> Self {
        self.cmd = (!cmd.is_empty()).then(|| cmd.iter().map(|s| s.to_string()).collect());
        self
    }

    /// `config.Entrypoint`; an empty slice removes it.
    pub fn entrypoint(mut self, entrypoint: &[&str]) -> Self {
        self.entrypoint =
            (!entrypoint.is_empty()).then(|| entrypoint.iter().map(|s| s.to_string()).collect());
        self
    }

    /// Adds `KEY=VALUE` to `config.Env` (replacing an earlier value of the same key).
    pub fn env(mut self, key: &str, value: &str) -> Self {
        let prefix = format!("{key}=");
        self.env.retain(|e| !e.starts_with(&prefix));
        self.env.push(format!("{key}={value}"));
        self
    }

    /// `config.User`: "1000", "1000:1001", "minicri", "minicri:extra", ...
    pub fn user(mut self, user: &str) -> Self {
        self.user = Some(user.to_string());
        self
    }

    /// `config.WorkingDir`.
    pub fn working_dir(mut self, dir: &str) -> Self {
        self.working_dir = Some(dir.to_string());
        self
    }

    /// `config.StopSignal`.
    pub fn stop_signal(mut self, signal: &str) -> Self {
        self.stop_signal = Some(signal.to_string());
        self
    }

    /// `config.Labels[key] = value`.
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.insert(key.to_string(), value.to_string());
        self
    }

    /// A manifest annotation (OCI format only; Docker manifests have none).
    pub fn annotation(mut self, key: &str, value: &str) -> Self {
        self.annotations.insert(key.to_string(), value.to_string());
        self
    }

    /// The config's and history's `created` (default [`CREATED`]).
    pub fn created(mut self, created: &str) -> Self {
        self.created = created.to_string();
        self
    }

    /// Makes the config and manifest.
    pub fn build(&self) -> Result<Image> {
        let mut container = serde_json::Map::new();
        container.insert("Env".into(), json!(self.env));
        if let Some(cmd) = &self.cmd {
            container.insert("Cmd".into(), json!(cmd));
        }
        if let Some(entrypoint) = &self.entrypoint {
            container.insert("Entrypoint".into(), json!(entrypoint));
        }
        if let Some(user) = &self.user {
            container.insert("User".into(), json!(user));
        }
        if let Some(dir) = &self.working_dir {
            container.insert("WorkingDir".into(), json!(dir));
        }
        if let Some(signal) = &self.stop_signal {
            container.insert("StopSignal".into(), json!(signal));
        }
        if !self.labels.is_empty() {
            container.insert("Labels".into(), json!(self.labels));
        }
        let history: Vec<Value> = self
            .layers
            .iter()
            .map(|l| json!({ "created": self.created, "created_by": l.created_by }))
            .collect();
        let mut config = json!({
            "created": self.created,
            "author": "minicri-tests",
            "architecture": self.platform.architecture,
            "os": self.platform.os,
            "config": Value::Object(container),
            "rootfs": {
                "type": "layers",
                "diff_ids": self.layers.iter().map(|l| l.diff_id.clone()).collect::<Vec<_>>(),
            },
            "history": history,
        });
        if let Some(variant) = &self.platform.variant {
            config["variant"] = json!(variant);
        }
        let config = serde_json::to_vec(&config)?;
        let config_digest = sha256_digest(&config);

        let layers: Vec<Value> = self
            .layers
            .iter()
            .map(|l| json!({ "mediaType": l.media_type(self.format), "digest": l.digest, "size": l.size }))
            .collect();
        let mut manifest = json!({
            "schemaVersion": 2,
            "mediaType": self.format.manifest_media_type(),
            "config": {
                "mediaType": self.format.config_media_type(),
                "digest": config_digest,
                "size": config.len(),
            },
            "layers": layers,
        });
        if self.format == Format::Oci && !self.annotations.is_empty() {
            manifest["annotations"] = json!(self.annotations);
        }
        let manifest = serde_json::to_vec_pretty(&manifest)?;
        Ok(Image {
            format: self.format,
            platform: self.platform.clone(),
            user: self.user.clone(),
            layers: self.layers.clone(),
            config_digest,
            config: config.into(),
            manifest_digest: sha256_digest(&manifest),
            manifest: manifest.into(),
        })
    }

    /// Builds and pushes to `reference` ("name:tag", "name@sha256:..." or "name" for latest;
    /// a leading "<registry addr>/" is accepted).
    pub async fn push(&self, client: &RegistryClient, reference: &str) -> Result<PushedImage> {
        self.build()?.push(client, reference).await
    }
}

/// A built single-platform image.
#[derive(Debug, Clone)]
pub struct Image {
    pub format: Format,
    pub platform: Platform,
    pub user: Option<String>,
    pub layers: Vec<Layer>,
    /// The config JSON.
    pub config: Bytes,
    /// Its digest, the image ID.
    pub config_digest: String,
    /// The manifest JSON.
    pub manifest: Bytes,
    pub manifest_digest: String,
}

impl Image {
    pub fn manifest_media_type(&self) -> &'static str {
        self.format.manifest_media_type()
    }

    /// Pushes the blobs (skipping those the repository has), then the manifest under the tag
    /// or digest of `reference`.
    pub async fn push(&self, client: &RegistryClient, reference: &str) -> Result<PushedImage> {
        let (repository, tag) = client.split_reference(reference)?;
        for layer in &self.layers {
            client.push_layer(&repository, layer).await?;
        }
        client
            .push_blob_bytes(&repository, &self.config_digest, self.config.clone())
            .await?;
        let target = tag.clone().unwrap_or_else(|| self.manifest_digest.clone());
        let digest = client
            .put_manifest(
                &repository,
                &target,
                self.manifest_media_type(),
                self.manifest.clone(),
            )
            .await?;
        ensure!(
            digest == self.manifest_digest,
            "registry computed manifest digest {digest}, expected {}",
            self.manifest_digest
        );
        Ok(self.pushed(client, &repository, tag))
    }

    fn pushed(
        &self,
        client: &RegistryClient,
        repository: &str,
        tag: Option<String>,
    ) -> PushedImage {
        let registry = client.addr().to_string();
        let reference = match &tag {
            Some(tag) => format!("{registry}/{repository}:{tag}"),
            None => format!("{registry}/{repository}@{}", self.manifest_digest),
        };
        PushedImage {
            reference,
            registry,
            repository: repository.to_string(),
            tag,
            manifest_digest: self.manifest_digest.clone(),
            manifest_media_type: self.manifest_media_type().to_string(),
            manifest_size: self.manifest.len() as u64,
            config_digest: self.config_digest.clone(),
            config_media_type: self.format.config_media_type().to_string(),
            config_size: self.config.len() as u64,
            layers: self
                .layers
                .iter()
                .map(|l| LayerInfo {
                    digest: l.digest.clone(),
                    size: l.size,
                    diff_id: l.diff_id.clone(),
                    media_type: l.media_type(self.format).to_string(),
                })
                .collect(),
            platform: self.platform.clone(),
            user: self.user.clone(),
        }
    }
}

/// A layer as the manifest and config name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerInfo {
    /// Digest of the blob.
    pub digest: String,
    /// Size of the blob.
    pub size: u64,
    /// Digest of the uncompressed tar.
    pub diff_id: String,
    pub media_type: String,
}

/// What was pushed for one single-platform image.
#[derive(Debug, Clone)]
pub struct PushedImage {
    /// `127.0.0.1:PORT/name:tag`, or `127.0.0.1:PORT/name@sha256:...` when pushed by digest
    /// (the platform images of an index).
    pub reference: String,
    /// `127.0.0.1:PORT`.
    pub registry: String,
    /// `name`, e.g. `minicri-test/busybox`.
    pub repository: String,
    pub tag: Option<String>,
    pub manifest_digest: String,
    pub manifest_media_type: String,
    pub manifest_size: u64,
    /// The image ID.
    pub config_digest: String,
    pub config_media_type: String,
    pub config_size: u64,
    /// Bottom first.
    pub layers: Vec<LayerInfo>,
    pub platform: Platform,
    /// `config.User`.
    pub user: Option<String>,
}

impl PushedImage {
    /// `127.0.0.1:PORT/name@sha256:<manifest digest>`.
    pub fn digest_reference(&self) -> String {
        format!(
            "{}/{}@{}",
            self.registry, self.repository, self.manifest_digest
        )
    }
    /// The image ID (config digest).
    pub fn image_id(&self) -> &str {
        &self.config_digest
    }
    /// Sum of the layer blob sizes.
    pub fn layers_size(&self) -> u64 {
        self.layers.iter().map(|l| l.size).sum()
    }
    /// Every blob digest: config and layers.
    pub fn blob_digests(&self) -> Vec<String> {
        std::iter::once(self.config_digest.clone())
            .chain(self.layers.iter().map(|l| l.digest.clone()))
            .collect()
    }
}

/// A multi-platform image (OCI index or Docker manifest list) under construction.
#[derive(Debug, Clone)]
pub struct IndexBuilder {
    format: Format,
    images: Vec<Image>,
    annotations: BTreeMap<String, String>,
}

impl IndexBuilder {
    /// An empty OCI index ([`Format::Oci`]) or Docker manifest list ([`Format::Docker`]).
    pub fn new(format: Format) -> Self {
        IndexBuilder {
            format,
            images: Vec::new(),
            annotations: BTreeMap::new(),
        }
    }

    /// Adds a platform image (its own platform goes into the index entry).
    pub fn image(mut self, image: Image) -> Self {
        self.images.push(image);
        self
    }

    /// An index annotation (OCI only).
    pub fn annotation(mut self, key: &str, value: &str) -> Self {
        self.annotations.insert(key.to_string(), value.to_string());
        self
    }

    /// The index JSON and its digest.
    pub fn build(&self) -> Result<(Bytes, String)> {
        let manifests: Vec<Value> = self
            .images
            .iter()
            .map(|image| {
                json!({
                    "mediaType": image.manifest_media_type(),
                    "digest": image.manifest_digest,
                    "size": image.manifest.len(),
                    "platform": image.platform.to_json(),
                })
            })
            .collect();
        let mut index = json!({
            "schemaVersion": 2,
            "mediaType": self.format.index_media_type(),
            "manifests": manifests,
        });
        if self.format == Format::Oci && !self.annotations.is_empty() {
            index["annotations"] = json!(self.annotations);
        }
        let index = serde_json::to_vec_pretty(&index)?;
        let digest = sha256_digest(&index);
        Ok((index.into(), digest))
    }

    /// Pushes every platform image by digest, then the index under `reference`.
    pub async fn push(&self, client: &RegistryClient, reference: &str) -> Result<PushedIndex> {
        let (repository, tag) = client.split_reference(reference)?;
        let mut manifests = Vec::new();
        for image in &self.images {
            manifests.push(
                image
                    .push(client, &format!("{repository}@{}", image.manifest_digest))
                    .await?,
            );
        }
        let (index, digest) = self.build()?;
        let target = tag.clone().unwrap_or_else(|| digest.clone());
        let got = client
            .put_manifest(
                &repository,
                &target,
                self.format.index_media_type(),
                index.clone(),
            )
            .await?;
        ensure!(
            got == digest,
            "registry computed index digest {got}, expected {digest}"
        );
        let registry = client.addr().to_string();
        let reference = match &tag {
            Some(tag) => format!("{registry}/{repository}:{tag}"),
            None => format!("{registry}/{repository}@{digest}"),
        };
        Ok(PushedIndex {
            reference,
            registry,
            repository,
            tag,
            digest,
            media_type: self.format.index_media_type().to_string(),
            size: index.len() as u64,
            manifests,
        })
    }
}

/// What was pushed for a multi-platform image.
#[derive(Debug, Clone)]
pub struct PushedIndex {
    /// `127.0.0.1:PORT/name:tag`.
    pub reference: String,
    pub registry: String,
    pub repository: String,
    pub tag: Option<String>,
    /// Digest of the index / manifest list.
    pub digest: String,
    pub media_type: String,
    pub size: u64,
    /// The platform images, in index order.
    pub manifests: Vec<PushedImage>,
}

impl PushedIndex {
    /// The image for `architecture` ("amd64", "arm64").
    pub fn for_arch(&self, architecture: &str) -> Option<&PushedImage> {
        self.manifests
            .iter()
            .find(|m| m.platform.architecture == architecture)
    }
    /// `127.0.0.1:PORT/name@sha256:<index digest>`.
    pub fn digest_reference(&self) -> String {
        format!("{}/{}@{}", self.registry, self.repository, self.digest)
    }
}

// ---------------------------------------------------------------------------------------------
// Registry HTTP API

/// A minimal client of the registry HTTP API (distribution spec): blob upload, manifest
/// put/get, blob get. Plain HTTP to a local registry, optional basic auth, no proxy from the
/// environment.
#[derive(Clone)]
pub struct RegistryClient {
    addr: String,
    http: reqwest::Client,
    auth: Option<(String, String)>,
}

impl fmt::Debug for RegistryClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistryClient")
            .field("addr", &self.addr)
            .field("auth", &self.auth.as_ref().map(|(u, _)| u))
            .finish()
    }
}

/// A manifest as the registry served it.
#[derive(Debug, Clone)]
pub struct FetchedManifest {
    /// The response's Content-Type.
    pub media_type: String,
    /// The `Docker-Content-Digest` header, if any.
    pub digest_header: Option<String>,
    pub body: Bytes,
}

impl FetchedManifest {
    /// The sha256 of the body.
    pub fn digest(&self) -> String {
        sha256_digest(&self.body)
    }
    pub fn json(&self) -> Result<Value> {
        Ok(serde_json::from_slice(&self.body)?)
    }
}

impl RegistryClient {
    /// A client for the registry at `addr` ("127.0.0.1:PORT"; an `http://` prefix is accepted).
    pub fn new(addr: &str) -> Self {
        let addr = addr
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_string();
        let http = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(std::time::Duration::from_secs(10))
            .build()
            .expect("building an HTTP client");
        RegistryClient {
            addr,
            http,
            auth: None,
        }
    }

    /// Sends basic auth with every request.
    pub fn with_basic_auth(mut self, user: &str, password: &str) -> Self {
        self.auth = Some((user.to_string(), password.to_string()));
        self
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// `http://127.0.0.1:PORT`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The underlying reqwest client.
    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    /// A request with auth applied; `path_or_url` is "/v2/..." or an absolute URL.
    pub fn request(&self, method: reqwest::Method, path_or_url: &str) -> reqwest::RequestBuilder {
        let url = if path_or_url.starts_with("http://") || path_or_url.starts_with("https://") {
            path_or_url.to_string()
        } else {
            format!("{}{}", self.base_url(), path_or_url)
        };
        let req = self.http.request(method, url);
        match &self.auth {
            Some((user, password)) => req.basic_auth(user, Some(password)),
            None => req,
        }
    }

    /// ("name", Some(tag)), or ("name", None) for a digest reference ("name@sha256:...").
    pub fn split_reference(&self, reference: &str) -> Result<(String, Option<String>)> {
        let (repository, target) = self.split_reference_full(reference)?;
        Ok(if target.starts_with("sha256:") {
            (repository, None)
        } else {
            (repository, Some(target))
        })
    }

    /// ("name", "tag-or-digest"); "name" alone means tag "latest".
    pub fn split_reference_full(&self, reference: &str) -> Result<(String, String)> {
        let prefix = format!("{}/", self.addr);
        let reference = reference.strip_prefix(&prefix).unwrap_or(reference);
        let (repository, target) = if let Some((repo, digest)) = reference.split_once('@') {
            (repo, digest.to_string())
        } else {
            let last_slash = reference.rfind('/').map(|i| i + 1).unwrap_or(0);
            match reference[last_slash..].rfind(':') {
                Some(i) => (
                    &reference[..last_slash + i],
                    reference[last_slash + i + 1..].to_string(),
                ),
                None => (reference, "latest".to_string()),
            }
        };
        ensure!(
            !repository.is_empty() && !target.is_empty(),
            "bad reference {reference:?}"
        );
        Ok((repository.to_string(), target))
    }

    /// Whether the repository has the blob (`HEAD /v2/<name>/blobs/<digest>`).
    pub async fn blob_exists(&self, repository: &str, digest: &str) -> Result<bool> {
        let resp = self
            .request(
                reqwest::Method::HEAD,
                &format!("/v2/{repository}/blobs/{digest}"),
            )
            .send()
            .await?;
        match resp.status().as_u16() {
            200 => Ok(true),
            404 => Ok(false),
            code => bail!("HEAD blob {digest} in {repository}: HTTP {code}"),
        }
    }

    /// Pushes a layer's blob unless the repository has it.
    pub async fn push_layer(&self, repository: &str, layer: &Layer) -> Result<()> {
        match &layer.blob {
            Blob::Memory(data) => {
                self.push_blob_bytes(repository, &layer.digest, data.clone())
                    .await
            }
            Blob::File(path) => self.push_blob_file(repository, &layer.digest, path).await,
            Blob::Kept(path) => self.push_blob_file(repository, &layer.digest, path).await,
        }
    }

    /// Pushes a blob unless the repository has it: monolithic upload, `POST` then `PUT
    /// <location>?digest=`.
    pub async fn push_blob_bytes(&self, repository: &str, digest: &str, data: Bytes) -> Result<()> {
        if self.blob_exists(repository, digest).await? {
            return Ok(());
        }
        let len = data.len() as u64;
        self.upload(repository, digest, len, reqwest::Body::from(data))
            .await
    }

    /// Pushes a blob from a file, streamed, unless the repository has it.
    pub async fn push_blob_file(&self, repository: &str, digest: &str, path: &Path) -> Result<()> {
        if self.blob_exists(repository, digest).await? {
            return Ok(());
        }
        let file = tokio::fs::File::open(path)
            .await
            .with_context(|| format!("opening {}", path.display()))?;
        let len = file.metadata().await?.len();
        let stream = tokio_util::io::ReaderStream::with_capacity(file, 256 * 1024);
        self.upload(repository, digest, len, reqwest::Body::wrap_stream(stream))
            .await
    }

    async fn upload(
        &self,
        repository: &str,
        digest: &str,
        len: u64,
        body: reqwest::Body,
    ) -> Result<()> {
        let resp = self
            .request(
                reqwest::Method::POST,
                &format!("/v2/{repository}/blobs/uploads/"),
            )
            .header(reqwest::header::CONTENT_LENGTH, "0")
            .send()
            .await?;
        if resp.status().as_u16() != 202 {
            bail!(
                "starting an upload to {repository}: HTTP {} {}",
                resp.status(),
                resp.text().await.unwrap_or_default()
            );
        }
        let location = resp
            .headers()
            .get(reqwest::header::LOCATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| anyhow!("upload to {repository}: no Location header"))?
            .to_string();
        let sep = if location.contains('?') { '&' } else { '?' };
        let url = format!("{location}{sep}digest={}", digest.replace(':', "%3A"));
        let resp = self
            .request(reqwest::Method::PUT, &url)
            .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
            .header(reqwest::header::CONTENT_LENGTH, len.to_string())
            .body(body)
            .send()
            .await?;
        if resp.status().as_u16() != 201 {
            bail!(
                "uploading blob {digest} to {repository}: HTTP {} {}",
                resp.status(),
                resp.text().await.unwrap_or_default()
            );
        }
        Ok(())
    }

    /// `PUT /v2/<name>/manifests/<tag or digest>`; returns the registry's digest of it.
    pub async fn put_manifest(
        &self,
        repository: &str,
        reference: &str,
        media_type: &str,
        body: Bytes,
    ) -> Result<String> {
        let resp = self
            .request(
                reqwest::Method::PUT,
                &format!("/v2/{repository}/manifests/{reference}"),
            )
            .header(reqwest::header::CONTENT_TYPE, media_type)
            .body(body.clone())
            .send()
            .await?;
        if resp.status().as_u16() != 201 {
            bail!(
                "putting manifest {repository}:{reference}: HTTP {} {}",
                resp.status(),
                resp.text().await.unwrap_or_default()
            );
        }
        Ok(resp
            .headers()
            .get("docker-content-digest")
            .and_then(|v| v.to_str().ok())
            .map(String::from)
            .unwrap_or_else(|| sha256_digest(&body)))
    }

    /// `GET /v2/<name>/manifests/<tag or digest>` accepting every manifest type.
    pub async fn get_manifest(&self, repository: &str, reference: &str) -> Result<FetchedManifest> {
        let resp = self
            .request(
                reqwest::Method::GET,
                &format!("/v2/{repository}/manifests/{reference}"),
            )
            .header(reqwest::header::ACCEPT, MANIFEST_MEDIA_TYPES.join(", "))
            .send()
            .await?;
        if !resp.status().is_success() {
            bail!(
                "getting manifest {repository}:{reference}: HTTP {}",
                resp.status()
            );
        }
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(String::from)
        };
        let media_type = header("content-type").unwrap_or_default();
        let digest_header = header("docker-content-digest");
        Ok(FetchedManifest {
            media_type,
            digest_header,
            body: resp.bytes().await?,
        })
    }

    /// `GET /v2/<name>/blobs/<digest>`, the whole body.
    pub async fn get_blob(&self, repository: &str, digest: &str) -> Result<Bytes> {
        let resp = self
            .request(
                reqwest::Method::GET,
                &format!("/v2/{repository}/blobs/{digest}"),
            )
            .send()
            .await?;
        if !resp.status().is_success() {
            bail!(
                "getting blob {digest} of {repository}: HTTP {}",
                resp.status()
            );
        }
        Ok(resp.bytes().await?)
    }

    /// `DELETE /v2/<name>/manifests/<digest>` (the test registries allow deletes).
    pub async fn delete_manifest(&self, repository: &str, digest: &str) -> Result<()> {
        let resp = self
            .request(
                reqwest::Method::DELETE,
                &format!("/v2/{repository}/manifests/{digest}"),
            )
            .send()
            .await?;
        if resp.status().as_u16() != 202 {
            bail!(
                "deleting manifest {repository}@{digest}: HTTP {}",
                resp.status()
            );
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// The standard set

/// OCI manifest, one gzip layer: the busybox rootfs.
pub const BUSYBOX_OCI: &str = "minicri-test/busybox:oci";
/// Docker schema 2 manifest, one gzip layer: the same busybox blob as [`BUSYBOX_OCI`].
pub const BUSYBOX_DOCKER: &str = "minicri-test/busybox:docker";
/// OCI, three gzip layers; see [`MULTI_FILES`].
pub const MULTI: &str = "minicri-test/multi:latest";
/// OCI image index: linux/amd64 and linux/arm64/v8 (OCI manifests).
pub const INDEX: &str = "minicri-test/index:latest";
/// Docker manifest list: linux/amd64 and linux/arm64/v8 (Docker schema 2 manifests).
pub const LIST: &str = "minicri-test/list:latest";
/// OCI, one zstd layer: the busybox rootfs.
pub const ZSTD: &str = "minicri-test/zstd:latest";
/// OCI, one uncompressed layer: the busybox rootfs.
pub const PLAIN: &str = "minicri-test/plain:latest";
/// Busybox with `User "1000"` (uid of `minicri`, primary gid 1000, supplementary 1001).
pub const USER_UID: &str = "minicri-test/user:uid";
/// Busybox with `User "minicri"` (resolves through /etc/passwd to 1000:1000).
pub const USER_NAME: &str = "minicri-test/user:name";
/// Busybox with `User "1000:1001"`.
pub const USER_UIDGID: &str = "minicri-test/user:uidgid";
/// Busybox plus a top layer with `/shared/who` = "a\n".
pub const SHARED_A: &str = "minicri-test/shared-a:latest";
/// Busybox plus a top layer with `/shared/who` = "b\n"; shares its base blob with SHARED_A.
pub const SHARED_B: &str = "minicri-test/shared-b:latest";

/// What a container of [`MULTI`] sees: `(path, Some(contents))` for files that exist (read
/// through symlinks and hard links), `(path, None)` for files deleted by whiteouts.
///
/// Layer 2 adds `/data/{a.txt,overwrite.txt,removed.txt,opaque/old.txt}`, a symlink
/// `/data/link.txt` → `a.txt` and `/etc/motd`. Layer 3 overwrites `/data/overwrite.txt`, adds
/// `/data/b.txt` and a hard link `/data/hard.txt` to it, deletes `/data/removed.txt` (whiteout)
/// and makes `/data/opaque` opaque with a new `/data/opaque/new.txt`.
pub const MULTI_FILES: &[(&str, Option<&str>)] = &[
    ("/data/a.txt", Some("a from layer 2\n")),
    ("/data/link.txt", Some("a from layer 2\n")),
    ("/data/overwrite.txt", Some("layer 3\n")),
    ("/data/b.txt", Some("b from layer 3\n")),
    ("/data/hard.txt", Some("b from layer 3\n")),
    ("/data/removed.txt", None),
    ("/data/opaque/old.txt", None),
    ("/data/opaque/new.txt", Some("new in layer 3\n")),
    ("/etc/motd", Some("minicri multi-layer test image\n")),
];

/// The standard set of test images, pushed by [`push_standard_set`].
///
/// Every image is linux/amd64 (except the arm64 members of the index and list), runs
/// `Cmd ["/bin/sh"]` with `Env [PATH=...]`, and has a label `org.minicri.test.image` naming it,
/// so every image has its own config (image ID) even where the layers are the same. All
/// busybox-based gzip images share one base layer blob.
///
/// | reference | format | contents |
/// |---|---|---|
/// | `minicri-test/busybox:oci` | OCI manifest | busybox rootfs, gzip |
/// | `minicri-test/busybox:docker` | Docker schema 2 | busybox rootfs, gzip (same blob) |
/// | `minicri-test/multi:latest` | OCI | busybox + 2 small gzip layers ([`MULTI_FILES`]); `WorkingDir /data`, `Env MULTI_LAYERS=3` |
/// | `minicri-test/index:latest` | OCI index | amd64 and arm64/v8 images: busybox + `/platform` = "linux/amd64\n" / "linux/arm64/v8\n" |
/// | `minicri-test/list:latest` | Docker manifest list | as the index, with Docker manifests |
/// | `minicri-test/zstd:latest` | OCI | busybox rootfs, zstd |
/// | `minicri-test/plain:latest` | OCI | busybox rootfs, uncompressed tar |
/// | `minicri-test/user:uid` | OCI | busybox, `User "1000"` |
/// | `minicri-test/user:name` | OCI | busybox, `User "minicri"` (uid 1000) |
/// | `minicri-test/user:uidgid` | OCI | busybox, `User "1000:1001"` |
/// | `minicri-test/shared-a:latest` | OCI | busybox + `/shared/who` = "a\n" |
/// | `minicri-test/shared-b:latest` | OCI | busybox + `/shared/who` = "b\n" |
///
/// The rootfs has users root (0), daemon (1), minicri (1000, home `/home/minicri`, also in
/// group extra 1001) and nobody (65534); see [`ETC_PASSWD`] and [`ETC_GROUP`].
#[derive(Debug, Clone)]
pub struct StandardSet {
    /// `127.0.0.1:PORT`.
    pub registry: String,
    pub busybox_oci: PushedImage,
    pub busybox_docker: PushedImage,
    pub multi: PushedImage,
    pub index: PushedIndex,
    pub list: PushedIndex,
    pub zstd: PushedImage,
    pub plain: PushedImage,
    pub user_uid: PushedImage,
    pub user_name: PushedImage,
    pub user_uidgid: PushedImage,
    pub shared_a: PushedImage,
    pub shared_b: PushedImage,
}

impl StandardSet {
    /// The single-platform images pushed under tags (not the index/list members).
    pub fn images(&self) -> Vec<&PushedImage> {
        vec![
            &self.busybox_oci,
            &self.busybox_docker,
            &self.multi,
            &self.zstd,
            &self.plain,
            &self.user_uid,
            &self.user_name,
            &self.user_uidgid,
            &self.shared_a,
            &self.shared_b,
        ]
    }

    /// The two multi-platform images.
    pub fn indexes(&self) -> Vec<&PushedIndex> {
        vec![&self.index, &self.list]
    }

    /// Every tagged reference (`127.0.0.1:PORT/minicri-test/...`).
    pub fn references(&self) -> Vec<String> {
        self.images()
            .iter()
            .map(|i| i.reference.clone())
            .chain(self.indexes().iter().map(|i| i.reference.clone()))
            .collect()
    }
}

/// The base image every standard member starts from, labelled with its name.
/// Busybox whose entrypoint sleeps for 2^31-1 seconds: a sandbox ("pause") image for a runtime
/// that runs one (PID 1 of its namespace ignores SIGTERM; SIGKILL stops it).
pub fn sleeper_image() -> Result<ImageBuilder> {
    Ok(standard("sleeper", Format::Oci)?
        .entrypoint(&["/bin/sleep", "2147483647"])
        .cmd(&[]))
}

fn standard(name: &str, format: Format) -> Result<ImageBuilder> {
    Ok(ImageBuilder::new()
        .layer(busybox_layer(Compression::Gzip)?)
        .format(format)
        .label("org.minicri.test.image", name))
}

fn platform_image(name: &str, format: Format, platform: Platform) -> Result<Image> {
    let marker = LayerBuilder::new()
        .created_by(&format!("minicri-tests: /platform marker for {platform}"))
        .file("platform", format!("{platform}\n"), 0o644)
        .build(Compression::Gzip)?;
    standard(name, format)?
        .layer(marker)
        .platform(platform)
        .build()
}

/// Pushes the standard set (see [`StandardSet`]) to the registry at `registry_addr`
/// ("127.0.0.1:PORT"), with basic auth when `auth` is given. Pushing again is cheap (existing
/// blobs are skipped) and gives the same digests.
pub async fn push_standard_set(
    registry_addr: &str,
    auth: Option<(&str, &str)>,
) -> Result<StandardSet> {
    let mut client = RegistryClient::new(registry_addr);
    if let Some((user, password)) = auth {
        client = client.with_basic_auth(user, password);
    }
    push_standard_set_with(&client).await
}

/// [`push_standard_set`] with a ready client.
pub async fn push_standard_set_with(client: &RegistryClient) -> Result<StandardSet> {
    let short = |r: &str| r.trim_start_matches("minicri-test/").to_string();

    let busybox_oci = standard(&short(BUSYBOX_OCI), Format::Oci)?
        .push(client, BUSYBOX_OCI)
        .await?;
    let busybox_docker = standard(&short(BUSYBOX_DOCKER), Format::Docker)?
        .push(client, BUSYBOX_DOCKER)
        .await?;

    let layer2 = LayerBuilder::new()
        .created_by("minicri-tests: multi layer 2")
        .dir("data", 0o755)
        .file("data/a.txt", "a from layer 2\n", 0o644)
        .file("data/overwrite.txt", "layer 2\n", 0o644)
        .file("data/removed.txt", "removed in layer 3\n", 0o644)
        .dir("data/opaque", 0o755)
        .file("data/opaque/old.txt", "hidden by layer 3\n", 0o644)
        .symlink("data/link.txt", "a.txt")
        .file("etc/motd", "minicri multi-layer test image\n", 0o644)
        .build(Compression::Gzip)?;
    let layer3 = LayerBuilder::new()
        .created_by("minicri-tests: multi layer 3")
        .dir("data", 0o755)
        .file("data/overwrite.txt", "layer 3\n", 0o644)
        .file("data/b.txt", "b from layer 3\n", 0o644)
        .hardlink("data/hard.txt", "data/b.txt")
        .whiteout("data/removed.txt")
        .dir("data/opaque", 0o755)
        .opaque("data/opaque")
        .file("data/opaque/new.txt", "new in layer 3\n", 0o644)
        .build(Compression::Gzip)?;
    let multi = standard(&short(MULTI), Format::Oci)?
        .layer(layer2)
        .layer(layer3)
        .working_dir("/data")
        .env("MULTI_LAYERS", "3")
        .push(client, MULTI)
        .await?;

    let mut index = IndexBuilder::new(Format::Oci);
    let mut list = IndexBuilder::new(Format::Docker);
    for platform in [Platform::linux_amd64(), Platform::linux_arm64()] {
        index = index.image(platform_image(
            &short(INDEX),
            Format::Oci,
            platform.clone(),
        )?);
        list = list.image(platform_image(&short(LIST), Format::Docker, platform)?);
    }
    let index = index.push(client, INDEX).await?;
    let list = list.push(client, LIST).await?;

    let zstd = ImageBuilder::new()
        .layer(busybox_layer(Compression::Zstd)?)
        .label("org.minicri.test.image", &short(ZSTD))
        .push(client, ZSTD)
        .await?;
    let plain = ImageBuilder::new()
        .layer(busybox_layer(Compression::None)?)
        .label("org.minicri.test.image", &short(PLAIN))
        .push(client, PLAIN)
        .await?;

    let user_uid = standard(&short(USER_UID), Format::Oci)?
        .user("1000")
        .push(client, USER_UID)
        .await?;
    let user_name = standard(&short(USER_NAME), Format::Oci)?
        .user("minicri")
        .push(client, USER_NAME)
        .await?;
    let user_uidgid = standard(&short(USER_UIDGID), Format::Oci)?
        .user("1000:1001")
        .push(client, USER_UIDGID)
        .await?;

    let mut shared = Vec::new();
    for (reference, who) in [(SHARED_A, "a"), (SHARED_B, "b")] {
        let top = LayerBuilder::new()
            .created_by(&format!("minicri-tests: shared-{who} top layer"))
            .dir("shared", 0o755)
            .file("shared/who", format!("{who}\n"), 0o644)
            .build(Compression::Gzip)?;
        shared.push(
            standard(&short(reference), Format::Oci)?
                .layer(top)
                .push(client, reference)
                .await?,
        );
    }
    let shared_b = shared.pop().expect("shared-b");
    let shared_a = shared.pop().expect("shared-a");

    Ok(StandardSet {
        registry: client.addr().to_string(),
        busybox_oci,
        busybox_docker,
        multi,
        index,
        list,
        zstd,
        plain,
        user_uid,
        user_name,
        user_uidgid,
        shared_a,
        shared_b,
    })
}

/// Pushes `reference`: the busybox base plus the gzip tar files `files` as they are (see
/// [`gzip_file_layer`]), for the benchmark's realistic image.
pub async fn push_gzip_files_image(
    client: &RegistryClient,
    reference: &str,
    files: &[std::path::PathBuf],
) -> Result<PushedImage> {
    let (repository, _) = client.split_reference(reference)?;
    let mut image = ImageBuilder::busybox().label("org.minicri.test.image", "files");
    for file in files {
        let path = file.clone();
        let layer = tokio::task::spawn_blocking(move || gzip_file_layer(&path))
            .await
            .context("layer thread")?
            .with_context(|| format!("reading {}", file.display()))?;
        client.push_layer(&repository, &layer).await?;
        image = image.layer(layer);
    }
    image.push(client, reference).await
}

/// Pushes `name:tag` made of the gzip busybox base plus `layers` layers of `layer_mib` MiB of
/// random bytes each (seeds `seed`, `seed+1`, ...), for large-pull tests and benchmarks. Each
/// layer is made in a temporary file, pushed, and removed before the next is made.
pub async fn push_big_image(
    client: &RegistryClient,
    reference: &str,
    layers: u64,
    layer_mib: u64,
    compression: Compression,
    seed: u64,
) -> Result<PushedImage> {
    let (repository, _) = client.split_reference(reference)?;
    let mut image = ImageBuilder::busybox().label("org.minicri.test.image", "big");
    for i in 0..layers {
        let layer =
            tokio::task::spawn_blocking(move || random_layer(layer_mib, compression, seed + i))
                .await
                .context("layer thread")??;
        client.push_layer(&repository, &layer).await?;
        // Keep only the digests: the pushed file is no longer needed.
        image = image.layer(Layer {
            blob: Blob::Memory(Bytes::new()),
            ..layer
        });
    }
    // The random layers are in the registry already (skipped by HEAD), so only the base,
    // the config and the manifest move now.
    image.push(client, reference).await
}

//! Layers: tar streams built entry by entry ([`LayerBuilder`]), busybox-static's filesystem,
//! random and file-backed layers, compressed and digested as they are written ([`Layer`]).

use super::*;

/// The bytes of a blob: in memory, in a temporary file (big layers) removed when the last
/// clone is dropped, or in a file of the caller's, left alone.
#[derive(Clone)]
pub(super) enum Blob {
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
    pub(super) blob: Blob,
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

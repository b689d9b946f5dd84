//! The checkpoint archive: an uncompressed tar in the layout the kubelet, `checkpointctl`,
//! CRI-O and containerd use (file names as checkpointctl's metadata defines them):
//!
//! - `checkpoint/`: CRIU's image files (`runc checkpoint --image-path`), `stats-dump` among them;
//! - `config.dump`: JSON metadata of the container ([`ConfigDump`]);
//! - `spec.dump`: the OCI runtime spec the container ran with;
//! - `rootfs-diff.tar`: the files the container changed in its writable layer;
//! - `deleted.files`: JSON list of the paths it removed from its image's files;
//! - `dump.log`: CRIU's log of the dump.
//!
//! Reading an archive is bounded: the JSON files are read up to [`MAX_METADATA_BYTES`], and
//! unpacking (the archive, then its rootfs diff onto a container's rootfs) goes through the
//! snapshotter's layer applier ([`minicri_snapshotter::unpack_into`]) with its limits and path
//! checks, so no entry lands outside the directory it is unpacked into. Deleted files are
//! applied as whiteouts through the same applier.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use minicri_snapshotter::Options;
use serde::{Deserialize, Serialize};

pub const CONFIG_DUMP: &str = "config.dump";
pub const SPEC_DUMP: &str = "spec.dump";
pub const CHECKPOINT_DIR: &str = "checkpoint";
pub const ROOTFS_DIFF: &str = "rootfs-diff.tar";
pub const DELETED_FILES: &str = "deleted.files";
pub const DUMP_LOG: &str = "dump.log";

/// Most bytes of `config.dump`, `spec.dump` or `deleted.files` read from an archive.
pub const MAX_METADATA_BYTES: u64 = 4 << 20;
/// Most paths `deleted.files` may list.
pub const MAX_DELETED_FILES: usize = 1 << 16;

/// `config.dump`: the container the archive holds (checkpointctl's `ContainerConfig`; times
/// are RFC 3339, the zero time `0001-01-01T00:00:00Z` when unset, as Go writes them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConfigDump {
    pub id: String,
    pub name: String,
    /// The image's id (minicri: its config digest).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub rootfs_image: String,
    /// The image reference the container was created from, resolved (its id).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub rootfs_image_ref: String,
    /// The image as the CreateContainer request named it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub rootfs_image_name: String,
    #[serde(rename = "runtime", default, skip_serializing_if = "String::is_empty")]
    pub oci_runtime: String,
    #[serde(default = "zero_time")]
    pub created_time: String,
    #[serde(rename = "checkpointedTime", default = "zero_time")]
    pub checkpointed_at: String,
    #[serde(rename = "restoredTime", default = "zero_time")]
    pub restored_at: String,
    #[serde(default)]
    pub restored: bool,
}

/// Go's zero `time.Time`, as `encoding/json` writes it.
pub fn zero_time() -> String {
    "0001-01-01T00:00:00Z".into()
}

/// RFC 3339 with nanoseconds, UTC, of nanoseconds since the epoch.
pub fn rfc3339(ns: i64) -> String {
    chrono::DateTime::from_timestamp_nanos(ns).to_rfc3339_opts(chrono::SecondsFormat::Nanos, true)
}

/// Why an archive cannot be read or restored (an `InvalidArgument`: the request named it).
#[derive(Debug, thiserror::Error)]
#[error("checkpoint archive {path}: {message}")]
pub struct ArchiveError {
    pub path: PathBuf,
    pub message: String,
}

fn err(path: &Path, message: impl Into<String>) -> ArchiveError {
    ArchiveError {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// The rule for "this image names a checkpoint archive": an absolute path that, symlinks
/// resolved, is a regular file inside one of `dirs` (`runtime.checkpoint_restore_dirs`), owned
/// by root and writable by no one else. Anything else is an image reference. Returns the
/// resolved path. The directories bound what a pod spec can make the daemon read and restore
/// (CRIU images are trusted input to a root process).
pub fn archive_path(image: &str, dirs: &[PathBuf]) -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    if !image.starts_with('/') {
        return None;
    }
    let real = std::fs::canonicalize(image).ok()?;
    let md = std::fs::metadata(&real).ok()?;
    let inside = dirs.iter().any(|d| {
        std::fs::canonicalize(d)
            .map(|d| real.starts_with(&d) && real != d)
            .unwrap_or(false)
    });
    (inside && md.is_file() && md.uid() == 0 && md.mode() & 0o022 == 0).then_some(real)
}

/// What a restore needs to know before unpacking: the container's metadata and spec.
#[derive(Debug, Clone)]
pub struct Metadata {
    pub config: ConfigDump,
    pub spec: oci_spec::runtime::Spec,
}

/// An entry's path with a leading `./` (and `/`) taken off.
fn entry_name(p: &Path) -> PathBuf {
    let s = p.to_string_lossy();
    PathBuf::from(s.trim_start_matches("./").trim_start_matches('/'))
}

fn read_bounded(
    what: &str,
    archive: &Path,
    mut r: impl Read,
    size: u64,
) -> Result<Vec<u8>, ArchiveError> {
    if size > MAX_METADATA_BYTES {
        return Err(err(
            archive,
            format!("{what} is {size} bytes, more than the {MAX_METADATA_BYTES} allowed"),
        ));
    }
    let mut buf = Vec::with_capacity(size as usize);
    r.by_ref()
        .take(MAX_METADATA_BYTES + 1)
        .read_to_end(&mut buf)
        .map_err(|e| err(archive, format!("reading {what}: {e}")))?;
    Ok(buf)
}

/// Reads `config.dump` and `spec.dump` of an archive, and checks it has CRIU images
/// (`checkpoint/`). Reads the tar without unpacking anything.
pub fn read_metadata(archive: &Path) -> Result<Metadata, ArchiveError> {
    let f = File::open(archive).map_err(|e| err(archive, format!("open: {e}")))?;
    let mut tar = tar::Archive::new(f);
    let (mut config, mut spec, mut images) = (None, None, false);
    let entries = tar
        .entries()
        .map_err(|e| err(archive, format!("not a tar: {e}")))?;
    for entry in entries {
        let entry = entry.map_err(|e| err(archive, format!("not a tar: {e}")))?;
        let name = entry_name(&entry.path().map_err(|e| err(archive, e.to_string()))?);
        let regular = entry.header().entry_type().is_file();
        let size = entry.header().size().unwrap_or(u64::MAX);
        if name.starts_with(CHECKPOINT_DIR) && name != Path::new(CHECKPOINT_DIR) {
            images = true;
        } else if regular && name == Path::new(CONFIG_DUMP) {
            let b = read_bounded(CONFIG_DUMP, archive, entry, size)?;
            config = Some(
                serde_json::from_slice::<ConfigDump>(&b)
                    .map_err(|e| err(archive, format!("{CONFIG_DUMP}: {e}")))?,
            );
        } else if regular && name == Path::new(SPEC_DUMP) {
            let b = read_bounded(SPEC_DUMP, archive, entry, size)?;
            spec = Some(
                serde_json::from_slice::<oci_spec::runtime::Spec>(&b)
                    .map_err(|e| err(archive, format!("{SPEC_DUMP}: {e}")))?,
            );
        }
    }
    let missing = |what: &str| err(archive, format!("has no {what}: not a checkpoint archive"));
    let config = config.ok_or_else(|| missing(CONFIG_DUMP))?;
    let spec = spec.ok_or_else(|| missing(SPEC_DUMP))?;
    if !images {
        return Err(missing("checkpoint/ (CRIU images)"));
    }
    Ok(Metadata { config, spec })
}

/// Unpacks the archive into the existing directory `dir` within `limits`' layer bounds,
/// refusing entries that escape it.
pub fn unpack(archive: &Path, dir: &Path, limits: &Options) -> Result<(), ArchiveError> {
    let f = File::open(archive).map_err(|e| err(archive, format!("open: {e}")))?;
    minicri_snapshotter::unpack_into(dir, f, limits).map_err(|e| err(archive, e.to_string()))
}

/// Applies an unpacked archive's `rootfs-diff.tar` and `deleted.files` (in `unpacked`) onto a
/// container's fresh `rootfs`, both through the layer applier and its path checks; either file
/// may be missing (nothing changed, nothing deleted).
pub fn apply_rootfs_changes(
    archive: &Path,
    unpacked: &Path,
    rootfs: &Path,
    limits: &Options,
) -> Result<(), ArchiveError> {
    let diff = unpacked.join(ROOTFS_DIFF);
    if let Ok(f) = File::open(&diff) {
        minicri_snapshotter::unpack_into(rootfs, f, limits)
            .map_err(|e| err(archive, format!("{ROOTFS_DIFF}: {e}")))?;
    }
    let deleted = unpacked.join(DELETED_FILES);
    let Ok(f) = File::open(&deleted) else {
        return Ok(());
    };
    let size = f.metadata().map(|m| m.len()).unwrap_or(u64::MAX);
    let b = read_bounded(DELETED_FILES, archive, f, size)?;
    let paths: Vec<String> =
        serde_json::from_slice(&b).map_err(|e| err(archive, format!("{DELETED_FILES}: {e}")))?;
    if paths.len() > MAX_DELETED_FILES {
        return Err(err(
            archive,
            format!(
                "{DELETED_FILES} lists {} paths, more than the {MAX_DELETED_FILES} allowed",
                paths.len()
            ),
        ));
    }
    let whiteouts =
        whiteout_tar(&paths).map_err(|m| err(archive, format!("{DELETED_FILES}: {m}")))?;
    minicri_snapshotter::unpack_into(rootfs, &whiteouts[..], limits)
        .map_err(|e| err(archive, format!("{DELETED_FILES}: {e}")))
}

/// A tar of one whiteout (`dir/.wh.name`) per deleted path, for the layer applier.
fn whiteout_tar(paths: &[String]) -> Result<Vec<u8>, String> {
    let mut b = tar::Builder::new(Vec::new());
    for p in paths {
        let rel = Path::new(p.trim_start_matches('/'));
        let (Some(name), parent) = (rel.file_name(), rel.parent()) else {
            return Err(format!("{p:?} is not a path below the root"));
        };
        let mut wh = parent.map(Path::to_path_buf).unwrap_or_default();
        let mut n = std::ffi::OsString::from(".wh.");
        n.push(name);
        wh.push(n);
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_size(0);
        h.set_mode(0o600);
        b.append_data(&mut h, &wh, &[][..])
            .map_err(|e| format!("{p:?}: {e}"))?;
    }
    b.into_inner().map_err(|e| e.to_string())
}

/// The writable layer's changes, from an overlay upper directory: every file, directory and
/// link in it goes into `rootfs-diff.tar` (written to `out`), and every whiteout (a 0/0
/// character device) is a deleted path (returned, `/`-rooted as CRI-O writes them).
pub fn write_rootfs_diff(upper: &Path, out: &Path) -> std::io::Result<Vec<String>> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let mut b = tar::Builder::new(std::io::BufWriter::new(File::create(out)?));
    b.follow_symlinks(false);
    let mut deleted = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let dir = upper.join(&rel);
        let mut names: Vec<_> = std::fs::read_dir(&dir)?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<Result<_, _>>()?;
        names.sort();
        for name in names {
            let rel = rel.join(&name);
            let path = upper.join(&rel);
            let md = std::fs::symlink_metadata(&path)?;
            if md.file_type().is_char_device() && md.rdev() == 0 {
                deleted.push(format!("/{}", rel.display()));
                continue;
            }
            b.append_path_with_name(&path, &rel)?;
            if md.is_dir() {
                stack.push(rel);
            }
        }
    }
    b.into_inner()?
        .into_inner()
        .map_err(|e| e.into_error())?
        .sync_all()?;
    Ok(deleted)
}

/// Writes the archive `out` from the directory `staging` (which holds the layout above):
/// to a temporary name beside it, then renamed, so a reader never sees half an archive.
pub fn write_archive(staging: &Path, out: &Path) -> std::io::Result<()> {
    let mut tmp = out.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let result = (|| {
        let mut b = tar::Builder::new(std::io::BufWriter::new(File::create(&tmp)?));
        b.follow_symlinks(false);
        let mut names: Vec<_> = std::fs::read_dir(staging)?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<Result<_, _>>()?;
        names.sort();
        for name in names {
            let path = staging.join(&name);
            if std::fs::symlink_metadata(&path)?.is_dir() {
                b.append_dir_all(&name, &path)?;
            } else {
                b.append_path_with_name(&path, &name)?;
            }
        }
        b.into_inner()?
            .into_inner()
            .map_err(|e| e.into_error())?
            .sync_all()?;
        std::fs::rename(&tmp, out)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Options {
        Options {
            sync_on_commit: false,
            max_layer_bytes: 1 << 20,
            max_layer_entries: 1000,
            space: None,
        }
    }

    fn config() -> ConfigDump {
        ConfigDump {
            id: "c1".into(),
            name: "counter".into(),
            rootfs_image: "sha256:ab".into(),
            rootfs_image_ref: "sha256:ab".into(),
            rootfs_image_name: "busybox:1".into(),
            oci_runtime: "runc".into(),
            created_time: rfc3339(1_700_000_000_000_000_001),
            checkpointed_at: rfc3339(1_700_000_100_000_000_000),
            restored_at: zero_time(),
            restored: false,
        }
    }

    /// A staging directory with the layout, as the checkpoint writes it.
    fn staging(dir: &Path) -> PathBuf {
        let s = dir.join("staging");
        std::fs::create_dir_all(s.join(CHECKPOINT_DIR)).unwrap();
        std::fs::write(s.join(CHECKPOINT_DIR).join("pages-1.img"), b"pages").unwrap();
        std::fs::write(s.join(CONFIG_DUMP), serde_json::to_vec(&config()).unwrap()).unwrap();
        let spec = oci_spec::runtime::Spec::default();
        std::fs::write(s.join(SPEC_DUMP), serde_json::to_vec(&spec).unwrap()).unwrap();
        s
    }

    #[test]
    fn config_dump_has_checkpointctl_field_names() {
        let v = serde_json::to_value(config()).unwrap();
        for key in [
            "id",
            "name",
            "rootfsImage",
            "rootfsImageRef",
            "rootfsImageName",
            "runtime",
            "createdTime",
            "checkpointedTime",
            "restoredTime",
            "restored",
        ] {
            assert!(v.get(key).is_some(), "{key} missing in {v}");
        }
        assert_eq!(v["createdTime"], "2023-11-14T22:13:20.000000001Z");
        assert_eq!(v["restoredTime"], "0001-01-01T00:00:00Z");
    }

    #[test]
    fn written_archives_read_back_with_the_layout() {
        let d = tempfile::tempdir().unwrap();
        let s = staging(d.path());
        let out = d.path().join("c1.tar");
        write_archive(&s, &out).unwrap();
        assert!(!d.path().join("c1.tar.tmp").exists());
        let mut names: Vec<String> = tar::Archive::new(File::open(&out).unwrap())
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().display().to_string())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "checkpoint/",
                "checkpoint/pages-1.img",
                "config.dump",
                "spec.dump"
            ]
        );
        let m = read_metadata(&out).unwrap();
        assert_eq!(m.config, config());
        let un = d.path().join("un");
        std::fs::create_dir(&un).unwrap();
        unpack(&out, &un, &limits()).unwrap();
        assert_eq!(
            std::fs::read(un.join("checkpoint/pages-1.img")).unwrap(),
            b"pages"
        );
    }

    #[test]
    fn archives_without_metadata_or_images_are_refused() {
        let d = tempfile::tempdir().unwrap();
        for (drop, what) in [
            (CONFIG_DUMP, "has no config.dump"),
            (SPEC_DUMP, "has no spec.dump"),
            (CHECKPOINT_DIR, "has no checkpoint/"),
        ] {
            let s = staging(d.path());
            let p = s.join(drop);
            if p.is_dir() {
                std::fs::remove_dir_all(&p).unwrap();
            } else {
                std::fs::remove_file(&p).unwrap();
            }
            let out = d.path().join("a.tar");
            write_archive(&s, &out).unwrap();
            let e = read_metadata(&out).unwrap_err().to_string();
            assert!(e.contains(what) && e.contains("a.tar"), "{e}");
            std::fs::remove_dir_all(&s).unwrap();
        }
        std::fs::write(d.path().join("junk"), b"not a tar at all").unwrap();
        assert!(read_metadata(&d.path().join("junk")).is_err());
    }

    #[test]
    fn oversized_metadata_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let s = staging(d.path());
        let big = vec![b' '; MAX_METADATA_BYTES as usize + 1];
        std::fs::write(s.join(SPEC_DUMP), big).unwrap();
        let out = d.path().join("a.tar");
        write_archive(&s, &out).unwrap();
        let e = read_metadata(&out).unwrap_err().to_string();
        assert!(e.contains("spec.dump is 4194305 bytes"), "{e}");
    }

    /// A tar with one entry of the given name (written raw: the tar crate refuses `..`).
    fn tar_with(name: &str) -> Vec<u8> {
        let mut h = tar::Header::new_ustar();
        h.as_ustar_mut().unwrap().name[..name.len()].copy_from_slice(name.as_bytes());
        h.set_size(1);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        let mut v = h.as_bytes().to_vec();
        v.extend_from_slice(b"x");
        v.resize(v.len() + 511, 0);
        v.extend_from_slice(&[0; 1024]);
        v
    }

    #[test]
    fn escaping_paths_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let rootfs = d.path().join("rootfs");
        std::fs::create_dir(&rootfs).unwrap();
        // In the archive itself.
        let a = d.path().join("evil.tar");
        std::fs::write(&a, tar_with("../escaped")).unwrap();
        assert!(unpack(&a, &rootfs, &limits()).is_err());
        assert!(!d.path().join("escaped").exists());
        // In its rootfs diff.
        let un = d.path().join("un");
        std::fs::create_dir(&un).unwrap();
        std::fs::write(un.join(ROOTFS_DIFF), tar_with("../escaped")).unwrap();
        assert!(apply_rootfs_changes(&a, &un, &rootfs, &limits()).is_err());
        assert!(!d.path().join("escaped").exists());
        // In deleted.files: a file beside the rootfs survives.
        std::fs::remove_file(un.join(ROOTFS_DIFF)).unwrap();
        std::fs::write(d.path().join("keep"), b"k").unwrap();
        std::fs::write(un.join(DELETED_FILES), br#"["/../keep"]"#).unwrap();
        assert!(apply_rootfs_changes(&a, &un, &rootfs, &limits()).is_err());
        assert!(d.path().join("keep").exists());
    }

    #[test]
    fn rootfs_changes_apply_diff_and_deletions() {
        let d = tempfile::tempdir().unwrap();
        // An overlay upper directory as the kernel leaves it: a new file and a whiteout.
        let upper = d.path().join("upper");
        std::fs::create_dir_all(upper.join("etc")).unwrap();
        std::fs::write(upper.join("etc/counter"), b"41").unwrap();
        nix::sys::stat::mknod(
            &upper.join("etc/gone"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o600),
            0,
        )
        .unwrap();
        let un = d.path().join("un");
        std::fs::create_dir(&un).unwrap();
        let deleted = write_rootfs_diff(&upper, &un.join(ROOTFS_DIFF)).unwrap();
        assert_eq!(deleted, ["/etc/gone"]);
        std::fs::write(
            un.join(DELETED_FILES),
            serde_json::to_vec(&deleted).unwrap(),
        )
        .unwrap();
        // A fresh rootfs of the image: the deleted file is there, the new one is not.
        let rootfs = d.path().join("rootfs");
        std::fs::create_dir_all(rootfs.join("etc")).unwrap();
        std::fs::write(rootfs.join("etc/gone"), b"old").unwrap();
        apply_rootfs_changes(Path::new("a.tar"), &un, &rootfs, &limits()).unwrap();
        assert_eq!(std::fs::read(rootfs.join("etc/counter")).unwrap(), b"41");
        assert!(!rootfs.join("etc/gone").exists());
    }

    #[test]
    fn too_many_deleted_files_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let un = d.path().join("un");
        std::fs::create_dir(&un).unwrap();
        let many: Vec<String> = (0..=MAX_DELETED_FILES).map(|i| format!("/f{i}")).collect();
        std::fs::write(un.join(DELETED_FILES), serde_json::to_vec(&many).unwrap()).unwrap();
        let e = apply_rootfs_changes(Path::new("a.tar"), &un, d.path(), &limits())
            .unwrap_err()
            .to_string();
        assert!(e.contains("65537 paths"), "{e}");
    }

    #[test]
    fn only_root_owned_files_in_the_restore_dirs_are_archives() {
        let d = tempfile::tempdir().unwrap();
        let dirs = [d.path().join("checkpoints")];
        std::fs::create_dir(&dirs[0]).unwrap();
        let a = dirs[0].join("c.tar");
        std::fs::write(&a, b"x").unwrap();
        let outside = d.path().join("o.tar");
        std::fs::write(&outside, b"x").unwrap();
        let link = dirs[0].join("link.tar");
        std::os::unix::fs::symlink(&outside, &link).unwrap();
        let s = |p: &Path| p.to_str().unwrap().to_string();
        // Tests run as root: the file is root's.
        assert_eq!(archive_path(&s(&a), &dirs), Some(a.canonicalize().unwrap()));
        assert_eq!(archive_path(&s(&outside), &dirs), None);
        assert_eq!(
            archive_path(&s(&link), &dirs),
            None,
            "a symlink out of the dir"
        );
        assert_eq!(archive_path(&s(&dirs[0]), &dirs), None, "the dir itself");
        assert_eq!(archive_path("busybox:1.29", &dirs), None);
        assert_eq!(archive_path("c.tar", &dirs), None, "relative");
        let ab = format!("{}/../checkpoints/c.tar", dirs[0].display());
        assert!(archive_path(&ab, &dirs).is_some());
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&a, std::fs::Permissions::from_mode(0o666)).unwrap();
        assert_eq!(archive_path(&s(&a), &dirs), None, "world-writable");
    }
}

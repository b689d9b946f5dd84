//! Layers written to exhaust or trick the applier: oversized extension headers, too many entries or
//! bytes, sparse files (which must stay sparse), and entries that aim the deferred directory-time
//! restore or a hardlink or whiteout at something outside the snapshot.

use std::fs;
use std::io::Read;
use std::os::unix::fs::MetadataExt;

use crate::both_backends;
use crate::common::*;
use minicri_snapshotter::{Backend, Error, Options, Snapshotter, SpaceCheck};

both_backends!(
    pax_header_over_the_cap_is_not_read,
    long_name_over_the_cap,
    entry_count_cap,
    path_length_cap,
    implicit_dirs_count_against_the_entry_cap,
    byte_cap,
    byte_cap_counts_a_gzip_bomb,
    byte_cap_counts_hardlink_copy_ups,
    byte_cap_counts_sparse_holes,
    space_check_stops_an_unpack_before_its_bytes_land,
    gnu_sparse_is_written_sparsely,
    pax_sparse_formats_are_written_sparsely,
    sparse_file_stays_sparse_in_the_next_snapshot,
    dir_times_do_not_follow_a_replaced_parent,
    dir_times_do_not_follow_a_replaced_dir,
    hardlink_to_symlink_links_the_symlink,
    whiteout_through_symlink_is_refused,
    opaque_through_symlink_is_refused,
);

fn limit_err(err: &Error, want: &str) {
    match err {
        Error::LayerLimit { limit, .. } => assert_eq!(*limit, want, "{err}"),
        other => panic!("expected LayerLimit {want}, got {other:?}"),
    }
    assert!(err.to_string().contains(want), "{err}");
}

/// Applies a stream (not a slice) under a made-up diff_id: the limits trip before the digest check.
fn apply_stream(s: &dyn Snapshotter, stream: &mut (dyn Read + Send)) -> Error {
    let zeros = "sha256:0000000000000000000000000000000000000000000000000000000000000000";
    try_apply_stream(s, TAR, zeros, stream).unwrap_err()
}

fn pax_header_over_the_cap_is_not_read(b: Backend) {
    let (_d, s) = open(b);
    // A PAX header claiming 100 MiB: refused from its header, before its data is buffered.
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(tar::EntryType::XHeader);
    h.set_size(100 << 20);
    h.set_path("PaxHeader").unwrap();
    h.set_cksum();
    let mut stream =
        std::io::Cursor::new(h.as_bytes().to_vec()).chain(std::io::repeat(b'a').take(100 << 20));
    let err = apply_stream(&s, &mut stream);
    limit_err(&err, "PAX extended header size");
    assert!(s.list().unwrap().is_empty());
    assert!(names(&s.root().join("tmp")).is_empty());
    // Just under the cap is fine.
    let mut l = Layer::new();
    let value = vec![b'v'; 900 << 10];
    l.file_with(
        "f",
        b"x",
        &Attrs {
            pax: vec![("comment".into(), value)],
            ..Default::default()
        },
    );
    apply(&s, None, &l.finish());
}

fn long_name_over_the_cap(b: Backend) {
    let (_d, s) = open(b);
    let mut l = Layer::new();
    l.extension(b'L', &vec![b'a'; 100 << 10]).file("x", b"x");
    let err = try_apply(&s, None, &l.finish(), None).unwrap_err();
    limit_err(&err, "GNU long name size");
    // A long name that fits names the entry.
    let long = format!("{}/f", "d".repeat(200));
    let mut name = long.clone().into_bytes();
    name.push(0);
    let mut l = Layer::new();
    l.extension(b'L', &name).file("short", b"data");
    let chain = apply(&s, None, &l.finish());
    with_view(&s, &chain, |root| {
        assert_eq!(fs::read(root.join(&long)).unwrap(), b"data");
    });
}

fn entry_count_cap(b: Backend) {
    let (_d, s) = open_with(
        b,
        Options {
            max_layer_entries: 10,
            ..Default::default()
        },
    );
    let mut l = Layer::new();
    for i in 0..10 {
        l.file(&format!("f{i}"), b"x");
    }
    apply(&s, None, &l.finish());
    let mut l = Layer::new();
    for i in 0..11 {
        l.file(&format!("g{i}"), b"x");
    }
    let err = try_apply(&s, None, &l.finish(), None).unwrap_err();
    limit_err(&err, "snapshotter.max_layer_entries");
    assert_eq!(s.list().unwrap().len(), 1, "only the first layer");
    assert!(names(&s.root().join("tmp")).is_empty());
}

fn path_length_cap(b: Backend) {
    let (_d, s) = open(b);
    // A PAX path of 1,000 KiB, half a million directories deep: refused from its length, before anything
    // walks it (resolving it one component per stack frame used to overflow the thread's stack).
    let deep = format!("{}f", "a/".repeat(500 << 10));
    let mut l = Layer::new();
    l.file_with(
        "short",
        b"x",
        &Attrs {
            pax: vec![("path".into(), deep.into_bytes())],
            ..Default::default()
        },
    );
    let err = try_apply(&s, None, &l.finish(), None).unwrap_err();
    limit_err(&err, "entry path length");
    // A hardlink whose target is past PATH_MAX, as a GNU long link name.
    let mut target = format!("{}f", "b/".repeat(2100)).into_bytes();
    target.push(0);
    let mut l = Layer::new();
    l.file("f", b"x")
        .extension(b'K', &target)
        .hardlink("link", "f");
    let err = try_apply(&s, None, &l.finish(), None).unwrap_err();
    limit_err(&err, "entry path length");
    assert!(s.list().unwrap().is_empty());
    // Deep paths within the cap are unpacked: 1,400 directories (2,801 bytes).
    let deep = format!("{}f", "a/".repeat(1400));
    let mut l = Layer::new();
    l.file_with(
        "short",
        b"deep",
        &Attrs {
            pax: vec![("path".into(), deep.clone().into_bytes())],
            ..Default::default()
        },
    );
    let chain = apply(&s, None, &l.finish());
    with_view(&s, &chain, |root| {
        // Walk down with relative opens: the whole path is too long for one syscall from `root`.
        let mut dir = fs::File::open(root).unwrap();
        for _ in 0..1400 {
            dir = open_at(&dir, "a");
        }
        let mut data = String::new();
        open_at(&dir, "f").read_to_string(&mut data).unwrap();
        assert_eq!(data, "deep");
    });
}

/// Opens `name` under the directory `dir`, following no symlink.
fn open_at(dir: &fs::File, name: &str) -> fs::File {
    use std::os::fd::{AsRawFd, FromRawFd};
    let c = std::ffi::CString::new(name).unwrap();
    let fd = unsafe {
        libc::openat(
            dir.as_raw_fd(),
            c.as_ptr(),
            libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    assert!(
        fd >= 0,
        "openat {name}: {}",
        std::io::Error::last_os_error()
    );
    unsafe { fs::File::from_raw_fd(fd) }
}

fn implicit_dirs_count_against_the_entry_cap(b: Backend) {
    let (_d, s) = open_with(
        b,
        Options {
            max_layer_entries: 10,
            ..Default::default()
        },
    );
    // Two entries, four directories nobody listed: six of ten.
    let mut l = Layer::new();
    l.file("a/b/c/f", b"x").file("a/b/d/g", b"x");
    apply(&s, None, &l.finish());
    // One entry, eleven directories nobody listed: twelve.
    let mut l = Layer::new();
    l.file("1/2/3/4/5/6/7/8/9/10/11/f", b"x");
    let err = try_apply(&s, None, &l.finish(), None).unwrap_err();
    limit_err(&err, "snapshotter.max_layer_entries");
    assert!(
        err.to_string().contains("directories created for them"),
        "{err}"
    );
    assert_eq!(s.list().unwrap().len(), 1, "only the first layer");
}

fn byte_cap(b: Backend) {
    let (_d, s) = open_with(
        b,
        Options {
            max_layer_bytes: 1 << 20,
            ..Default::default()
        },
    );
    let mut l = Layer::new();
    l.file("small", &vec![1u8; 512 << 10]);
    apply(&s, None, &l.finish());
    let mut l = Layer::new();
    l.file("big", &vec![1u8; 2 << 20]);
    let err = try_apply(&s, None, &l.finish(), None).unwrap_err();
    limit_err(&err, "snapshotter.max_layer_bytes");
    assert!(err.to_string().contains("big"), "{err}");
    // Bytes after the end of the archive count too.
    let mut l = Layer::new();
    l.file("small", b"x");
    let mut tar = l.finish();
    tar.extend(std::iter::repeat_n(0u8, 2 << 20));
    let err = try_apply(&s, None, &tar, None).unwrap_err();
    limit_err(&err, "snapshotter.max_layer_bytes");
}

/// A hardlink to a file of a lower layer makes the overlay backend copy that file up (both names
/// must live in one layer): a layer of a few hardlink headers could make the daemon write every
/// lower layer's files again, in each of 500 layers. The copies count against the layer's bytes.
/// (The copy backend copies its parent whole when the snapshot is prepared, whatever the layer
/// holds; its hardlinks copy nothing.)
fn byte_cap_counts_hardlink_copy_ups(b: Backend) {
    let (_d, s) = open_with(
        b,
        Options {
            max_layer_bytes: 1 << 20,
            ..Default::default()
        },
    );
    let mut l = Layer::new();
    l.file("a", &vec![1u8; 768 << 10]);
    let first = apply(&s, None, &l.finish());
    let mut l = Layer::new();
    l.file("b", &vec![2u8; 768 << 10]);
    let second = apply(&s, Some(&first), &l.finish());
    let mut l = Layer::new();
    l.hardlink("ha", "a").hardlink("hb", "b");
    let links = l.finish();
    match b {
        Backend::Overlay => {
            let err = try_apply(&s, Some(&second), &links, None).unwrap_err();
            limit_err(&err, "snapshotter.max_layer_bytes");
            assert!(err.to_string().contains("copies up b"), "{err}");
        }
        Backend::Copy => {
            let chain = apply(&s, Some(&second), &links);
            with_view(&s, &chain, |root| {
                assert_eq!(fs::read(root.join("hb")).unwrap(), vec![2u8; 768 << 10]);
            });
        }
    }
    // One copy up fits.
    let mut l = Layer::new();
    l.hardlink("ha", "a");
    let chain = apply(&s, Some(&second), &l.finish());
    with_view(&s, &chain, |root| {
        assert_eq!(fs::read(root.join("ha")).unwrap(), vec![1u8; 768 << 10]);
    });
}

fn byte_cap_counts_a_gzip_bomb(b: Backend) {
    let (_d, s) = open_with(
        b,
        Options {
            max_layer_bytes: 4 << 20,
            ..Default::default()
        },
    );
    let mut l = Layer::new();
    l.file("zeros", &vec![0u8; 64 << 20]);
    let tar = l.finish();
    let gz = gzip(&tar);
    assert!(gz.len() < 1 << 20);
    let err = try_apply_stream(&s, GZIP, &diff_id(&tar), &mut &gz[..]).unwrap_err();
    limit_err(&err, "snapshotter.max_layer_bytes");
}

/// A GNU old-style sparse header: `segments` of `real` bytes, data following.
fn gnu_sparse(name: &str, real: u64, segments: &[(u64, u64)]) -> (tar::Header, Vec<u8>) {
    assert!(segments.len() <= 4);
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::GNUSparse);
    h.set_path(name).unwrap();
    h.set_mode(0o644);
    h.set_mtime(1_600_000_000);
    let stored: u64 = segments.iter().map(|s| s.1).sum();
    h.set_size(stored);
    let g = h.as_gnu_mut().unwrap();
    for (i, (off, len)) in segments.iter().enumerate() {
        g.sparse[i].offset = octal12(*off);
        g.sparse[i].numbytes = octal12(*len);
    }
    g.realsize = octal12(real);
    h.set_cksum();
    let mut data = Vec::new();
    for (i, (_, len)) in segments.iter().enumerate() {
        data.extend(std::iter::repeat_n(b'A' + i as u8, *len as usize));
    }
    (h, data)
}

fn octal12(v: u64) -> [u8; 12] {
    let s = format!("{v:011o}\0");
    s.as_bytes().try_into().unwrap()
}

/// Checks the file at `p`: `segments` filled with 'A', 'B', ... and zeros elsewhere, `real` bytes
/// long, and sparse (far fewer blocks than its size).
fn check_sparse(p: &std::path::Path, real: u64, segments: &[(u64, u64)]) {
    let m = fs::metadata(p).unwrap();
    assert_eq!(m.len(), real);
    let stored: u64 = segments.iter().map(|s| s.1).sum();
    assert!(
        m.blocks() * 512 < stored + (1 << 20),
        "{} allocates {} bytes for {stored} bytes of data",
        p.display(),
        m.blocks() * 512
    );
    let mut f = fs::File::open(p).unwrap();
    use std::io::{Seek, SeekFrom};
    for (i, (off, len)) in segments.iter().enumerate() {
        f.seek(SeekFrom::Start(*off)).unwrap();
        let mut buf = vec![0u8; *len as usize];
        f.read_exact(&mut buf).unwrap();
        assert!(buf.iter().all(|c| *c == b'A' + i as u8), "segment {i}");
    }
    // A byte in the first hole reads as zero.
    if segments.first().is_some_and(|s| s.0 > 0) {
        f.seek(SeekFrom::Start(0)).unwrap();
        let mut one = [9u8];
        f.read_exact(&mut one).unwrap();
        assert_eq!(one, [0]);
    }
}

const GIB: u64 = 1 << 30;

fn gnu_sparse_is_written_sparsely(b: Backend) {
    let (_d, s) = open(b);
    let segs = [(GIB / 2, 4096), (GIB - 1000, 1000)];
    let (h, data) = gnu_sparse("sparse", GIB, &segs);
    let mut l = Layer::new();
    l.raw(&h, &data).file("after", b"after");
    let chain = apply(&s, None, &l.finish());
    with_view(&s, &chain, |root| {
        check_sparse(&root.join("sparse"), GIB, &segs);
        assert_eq!(fs::read(root.join("after")).unwrap(), b"after");
    });
}

fn pax_sparse_formats_are_written_sparsely(b: Backend) {
    let (_d, s) = open(b);
    let segs = [(GIB / 4, 512), (GIB / 2, 1024)];
    let data: Vec<u8> = segs
        .iter()
        .enumerate()
        .flat_map(|(i, (_, len))| std::iter::repeat_n(b'A' + i as u8, *len as usize))
        .collect();
    let real = (GIB / 2 + 4096).to_string().into_bytes();
    let mut l = Layer::new();
    // 0.0: repeated offset/numbytes records.
    let mut pax00 = vec![
        ("GNU.sparse.size".to_string(), real.clone()),
        ("GNU.sparse.numblocks".to_string(), b"2".to_vec()),
    ];
    for (off, len) in segs {
        pax00.push(("GNU.sparse.offset".into(), off.to_string().into_bytes()));
        pax00.push(("GNU.sparse.numbytes".into(), len.to_string().into_bytes()));
    }
    l.file_with(
        "s00",
        &data,
        &Attrs {
            pax: pax00,
            ..Default::default()
        },
    );
    // 0.1: one map record.
    let map = segs
        .iter()
        .map(|(o, l)| format!("{o},{l}"))
        .collect::<Vec<_>>()
        .join(",");
    l.file_with(
        "s01",
        &data,
        &Attrs {
            pax: vec![
                ("GNU.sparse.size".into(), real.clone()),
                ("GNU.sparse.numblocks".into(), b"2".to_vec()),
                ("GNU.sparse.map".into(), map.into_bytes()),
            ],
            ..Default::default()
        },
    );
    // 1.0: the map leads the data, padded to a block; the real name is in GNU.sparse.name.
    let mut body = format!(
        "2\n{}\n{}\n{}\n{}\n",
        segs[0].0, segs[0].1, segs[1].0, segs[1].1
    )
    .into_bytes();
    body.resize(512, 0);
    body.extend_from_slice(&data);
    l.file_with(
        "GNUSparseFile.0/s10",
        &body,
        &Attrs {
            pax: vec![
                ("GNU.sparse.major".into(), b"1".to_vec()),
                ("GNU.sparse.minor".into(), b"0".to_vec()),
                ("GNU.sparse.name".into(), b"s10".to_vec()),
                ("GNU.sparse.realsize".into(), real.clone()),
            ],
            ..Default::default()
        },
    );
    let chain = apply(&s, None, &l.finish());
    with_view(&s, &chain, |root| {
        for name in ["s00", "s01", "s10"] {
            check_sparse(&root.join(name), GIB / 2 + 4096, &segs);
        }
        assert!(!root.join("GNUSparseFile.0").exists());
    });
}

fn byte_cap_counts_sparse_holes(b: Backend) {
    let (_d, s) = open_with(
        b,
        Options {
            max_layer_bytes: 64 << 20,
            ..Default::default()
        },
    );
    let (h, data) = gnu_sparse("sparse", GIB, &[(0, 512)]);
    let mut l = Layer::new();
    l.raw(&h, &data);
    let err = try_apply(&s, None, &l.finish(), None).unwrap_err();
    limit_err(&err, "snapshotter.max_layer_bytes");
}

fn sparse_file_stays_sparse_in_the_next_snapshot(b: Backend) {
    let (_d, s) = open(b);
    let segs = [(GIB / 2, 4096)];
    let (h, data) = gnu_sparse("sparse", GIB, &segs);
    let mut l0 = Layer::new();
    l0.raw(&h, &data);
    let base = apply(&s, None, &l0.finish());
    // A hardlink to the lower file copies it up (overlay); the copy backend copies the whole tree.
    let mut l1 = Layer::new();
    l1.hardlink("link", "sparse");
    let top = apply(&s, Some(&base), &l1.finish());
    with_view(&s, &top, |root| {
        check_sparse(&root.join("sparse"), GIB, &segs);
        check_sparse(&root.join("link"), GIB, &segs);
    });
}

/// An outside directory whose mtime the layers aim at.
fn outside_dir() -> (tempfile::TempDir, std::path::PathBuf, (i64, i64)) {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("target");
    fs::create_dir_all(target.join("ssl")).unwrap();
    let m = fs::metadata(target.join("ssl")).unwrap();
    (dir, target, (m.mtime(), m.mtime_nsec()))
}

fn mtime_of(p: &std::path::Path) -> (i64, i64) {
    let m = fs::metadata(p).unwrap();
    (m.mtime(), m.mtime_nsec())
}

fn dir_times_do_not_follow_a_replaced_parent(b: Backend) {
    let (_d, s) = open(b);
    let (_o, out, ssl_before) = outside_dir();
    let root_before = mtime_of(&out);
    // `a/ssl/` gets time 0 at the end of the layer; by then `a` is a symlink to the outside.
    let mut l = Layer::new();
    l.dir("a", 0o755)
        .dir("a/ssl", 0o755)
        .symlink("a", out.to_str().unwrap());
    let chain = apply(&s, None, &l.finish());
    assert_eq!(
        mtime_of(&out.join("ssl")),
        ssl_before,
        "outside dir touched"
    );
    assert_eq!(mtime_of(&out), root_before);
    with_view(&s, &chain, |root| {
        assert!(fs::symlink_metadata(root.join("a")).unwrap().is_symlink());
    });
}

fn dir_times_do_not_follow_a_replaced_dir(b: Backend) {
    let (_d, s) = open(b);
    let (_o, out, ssl_before) = outside_dir();
    let mut l = Layer::new();
    l.dir("d", 0o755)
        .symlink("d", out.join("ssl").to_str().unwrap());
    apply(&s, None, &l.finish());
    assert_eq!(mtime_of(&out.join("ssl")), ssl_before);
    // A directory replaced by another directory gets the times of the new one.
    let mut l = Layer::new();
    l.dir("e", 0o755)
        .file("e/f", b"x")
        .symlink("e", "elsewhere")
        .dir("e", 0o755);
    let chain = apply(&s, None, &l.finish());
    with_view(&s, &chain, |root| {
        assert_eq!(mtime_of(&root.join("e")).0, 1_600_000_000);
    });
}

fn hardlink_to_symlink_links_the_symlink(b: Backend) {
    let (_d, s) = open(b);
    let (_o, out, _) = outside_dir();
    fs::write(out.join("secret"), b"secret").unwrap();
    let mut l = Layer::new();
    l.symlink("l", out.join("secret").to_str().unwrap())
        .hardlink("h", "l");
    let chain = apply(&s, None, &l.finish());
    assert_eq!(fs::metadata(out.join("secret")).unwrap().nlink(), 1);
    with_view(&s, &chain, |root| {
        assert!(fs::symlink_metadata(root.join("h")).unwrap().is_symlink());
    });
}

fn whiteout_through_symlink_is_refused(b: Backend) {
    let (_d, s) = open(b);
    let (_o, out, _) = outside_dir();
    fs::write(out.join("secret"), b"secret").unwrap();
    let mut l = Layer::new();
    l.symlink("l", out.to_str().unwrap()).whiteout("l/secret");
    let err = try_apply(&s, None, &l.finish(), None).unwrap_err();
    assert!(matches!(err, Error::UnsafePath { .. }), "{err:?}");
    assert_eq!(fs::read(out.join("secret")).unwrap(), b"secret");
}

fn opaque_through_symlink_is_refused(b: Backend) {
    let (_d, s) = open(b);
    let (_o, out, _) = outside_dir();
    fs::write(out.join("secret"), b"secret").unwrap();
    let mut l = Layer::new();
    l.symlink("l", out.to_str().unwrap()).opaque("l");
    let err = try_apply(&s, None, &l.finish(), None).unwrap_err();
    assert!(matches!(err, Error::UnsafePath { .. }), "{err:?}");
    assert_eq!(fs::read(out.join("secret")).unwrap(), b"secret");
    assert!(out.join("ssl").exists());
}

/// A [`SpaceCheck`] with room for `room` bytes; records what was claimed and settled.
#[derive(Default)]
struct Room {
    room: u64,
    claimed: std::sync::atomic::AtomicU64,
    settled: std::sync::atomic::AtomicU64,
}

impl SpaceCheck for Room {
    fn claim(&self, bytes: u64) -> std::io::Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        if self.claimed.load(Relaxed) + bytes > self.room {
            return Err(std::io::Error::new(
                std::io::ErrorKind::StorageFull,
                "test: no room",
            ));
        }
        self.claimed.fetch_add(bytes, Relaxed);
        Ok(())
    }

    fn settle(&self, bytes: u64) {
        self.settled
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The space check is asked for the uncompressed bytes before they are written: a gzip layer of
/// under 1 MiB that unpacks to 8 MiB is stopped at the room given (2 MiB), with the check's error,
/// having written no more than that; nothing is committed; every claim is settled. With room
/// enough, the same layer applies and every byte of it was claimed.
fn space_check_stops_an_unpack_before_its_bytes_land(b: Backend) {
    let room = std::sync::Arc::new(Room {
        room: 2 << 20,
        ..Default::default()
    });
    let (d, s) = open_with(
        b,
        Options {
            space: Some(room.clone()),
            ..Default::default()
        },
    );
    let mut l = Layer::new();
    l.file("zeros", &vec![0u8; 8 << 20]);
    let tar = l.finish();
    let gz = gzip(&tar);
    assert!(
        gz.len() < 1 << 20,
        "smaller than the room: only its unpacked bytes can go past"
    );
    let err = try_apply_stream(&s, GZIP, &diff_id(&tar), &mut &gz[..]).unwrap_err();
    match &err {
        Error::LayerStream { source } => {
            assert_eq!(source.kind(), std::io::ErrorKind::StorageFull, "{err}")
        }
        other => panic!("expected the check's error, got {other:?}"),
    }
    assert!(s.list().unwrap().is_empty());
    use std::sync::atomic::Ordering::Relaxed;
    let claimed = room.claimed.load(Relaxed);
    assert!(claimed <= 2 << 20, "{claimed}");
    assert_eq!(room.settled.load(Relaxed), claimed, "every claim settled");
    drop(s);

    let room = std::sync::Arc::new(Room {
        room: u64::MAX / 2,
        ..Default::default()
    });
    let s = reopen_with(
        b,
        d.path(),
        Options {
            space: Some(room.clone()),
            ..Default::default()
        },
    );
    try_apply_stream(&s, GZIP, &diff_id(&tar), &mut &gz[..]).unwrap();
    assert_eq!(room.claimed.load(Relaxed), tar.len() as u64);
    assert_eq!(room.settled.load(Relaxed), tar.len() as u64);
}

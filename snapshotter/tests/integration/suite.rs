//! The snapshotter suite: filesystem semantics of layer stacks, run against both backends.

use std::fs;
use std::os::unix::fs::{FileTypeExt, MetadataExt};

use crate::both_backends;
use crate::common::*;
use minicri_snapshotter::{Backend, Snapshotter};
use tar::EntryType;

both_backends!(
    layering,
    upper_layer_updates_file,
    deletes_files_and_dirs_from_lower_layers,
    opaque_directory,
    opaque_marker_before_or_after_new_entries,
    hardlinks_within_and_across_layers,
    device_nodes_and_fifos,
    ownership_modes_times_and_xattrs,
    directory_mtimes_survive_later_layers,
    symlinked_parent_inside_snapshot,
    file_replaces_directory_and_back,
    stacked_128_layers,
    container_snapshot_lifecycle,
    view_is_read_only,
    commit_active_snapshot,
    a_view_copies_nothing_and_has_no_upper_layer,
    a_view_keeps_its_layers_after_the_image_lets_go,
);

fn layering(b: Backend) {
    let (_d, s) = open(b);
    let mut l0 = Layer::new();
    l0.dir("etc", 0o755).file("etc/a", b"A").dir("usr", 0o755);
    let mut l1 = Layer::new();
    l1.dir("usr/bin", 0o755).file("usr/bin/b", b"B");
    let chain = apply_all(&s, &[l0.finish(), l1.finish()]);
    let t = view_tree(&s, &chain[1]);
    assert_eq!(t["etc/a"].content, b"A");
    assert_eq!(t["usr/bin/b"].content, b"B");
    assert_eq!(t[""].mode, 0o755);
    let t0 = view_tree(&s, &chain[0]);
    assert!(!t0.contains_key("usr/bin"));
}

fn upper_layer_updates_file(b: Backend) {
    let (_d, s) = open(b);
    let mut l0 = Layer::new();
    l0.file_with(
        "a",
        b"old",
        &Attrs {
            mtime: 100,
            ..Attrs::mode(0o644)
        },
    );
    let mut l1 = Layer::new();
    l1.file_with(
        "a",
        b"new",
        &Attrs {
            uid: 1000,
            gid: 1001,
            ..Attrs::mode(0o600)
        },
    );
    let chain = apply_all(&s, &[l0.finish(), l1.finish()]);
    let t = view_tree(&s, &chain[1]);
    assert_eq!(t["a"].content, b"new");
    assert_eq!((t["a"].mode, t["a"].uid, t["a"].gid), (0o600, 1000, 1001));
    assert_eq!(view_tree(&s, &chain[0])["a"].content, b"old");
}

fn deletes_files_and_dirs_from_lower_layers(b: Backend) {
    let (_d, s) = open(b);
    let mut l0 = Layer::new();
    l0.file("a", b"a")
        .dir("d", 0o755)
        .file("d/x", b"x")
        .dir("d/sub", 0o755)
        .file("d/sub/y", b"y")
        .file("keep", b"k");
    let mut l1 = Layer::new();
    l1.whiteout("a").whiteout("d").whiteout("never-existed");
    let chain = apply_all(&s, &[l0.finish(), l1.finish()]);
    let t = view_tree(&s, &chain[1]);
    let keys: Vec<&str> = t.keys().map(String::as_str).collect();
    assert_eq!(keys, ["", "keep"]);
}

fn opaque_directory(b: Backend) {
    let (_d, s) = open(b);
    let mut l0 = Layer::new();
    l0.dir("d", 0o755)
        .file("d/old", b"o")
        .dir("d/sub", 0o755)
        .file("d/sub/deep", b"x");
    let mut l1 = Layer::new();
    l1.dir("d", 0o750).opaque("d").file("d/new", b"n");
    let mut l2 = Layer::new();
    l2.file("d/newer", b"nn");
    let chain = apply_all(&s, &[l0.finish(), l1.finish(), l2.finish()]);
    let t = view_tree(&s, &chain[2]);
    let keys: Vec<&str> = t.keys().map(String::as_str).collect();
    assert_eq!(keys, ["", "d", "d/new", "d/newer"]);
    assert_eq!(t["d"].mode, 0o750);
}

fn opaque_marker_before_or_after_new_entries(b: Backend) {
    let (_d, s) = open(b);
    let mut l0 = Layer::new();
    l0.dir("d", 0o755).file("d/old", b"o");
    let base = apply(&s, None, &l0.finish());
    // The opaque marker hides only the lower layers, wherever it comes in the tar.
    let mut after = Layer::new();
    after.dir("d", 0o755).file("d/new", b"n").opaque("d");
    let c = apply(&s, Some(&base), &after.finish());
    let keys: Vec<String> = view_tree(&s, &c).into_keys().collect();
    assert_eq!(keys, ["", "d", "d/new"]);
    // A whiteout of a directory this layer also writes removes only the lower content.
    let mut mixed = Layer::new();
    mixed.file("d/new2", b"n").whiteout("d");
    let c = apply(&s, Some(&base), &mixed.finish());
    let keys: Vec<String> = view_tree(&s, &c).into_keys().collect();
    assert_eq!(keys, ["", "d", "d/new2"]);
}

fn hardlinks_within_and_across_layers(b: Backend) {
    let (_d, s) = open(b);
    let mut l0 = Layer::new();
    l0.dir("bin", 0o755)
        .file_with("bin/a", b"data", &Attrs::mode(0o755))
        .hardlink("bin/b", "bin/a");
    let mut l1 = Layer::new();
    l1.dir("other", 0o755)
        .hardlink("other/c", "bin/a")
        .hardlink("./d", "./bin/b");
    let chain = apply_all(&s, &[l0.finish(), l1.finish()]);
    with_view(&s, &chain[0], |root| {
        let a = fs::metadata(root.join("bin/a")).unwrap();
        let bb = fs::metadata(root.join("bin/b")).unwrap();
        assert_eq!(a.ino(), bb.ino());
        assert_eq!(a.nlink(), 2);
    });
    with_view(&s, &chain[1], |root| {
        let a = fs::metadata(root.join("bin/a")).unwrap();
        let c = fs::metadata(root.join("other/c")).unwrap();
        assert_eq!(
            a.ino(),
            c.ino(),
            "cross-layer link shares the inode with its target"
        );
        assert_eq!(fs::read(root.join("other/c")).unwrap(), b"data");
        assert_eq!(fs::read(root.join("d")).unwrap(), b"data");
        assert_eq!(c.mode() & 0o7777, 0o755);
    });
}

fn device_nodes_and_fifos(b: Backend) {
    let (_d, s) = open(b);
    let mut l0 = Layer::new();
    l0.dir("dev", 0o755)
        .device(EntryType::Char, "dev/null", 1, 3, 0o666)
        .device(EntryType::Block, "dev/loop9", 7, 9, 0o660)
        .device(EntryType::Fifo, "dev/fifo", 0, 0, 0o620);
    let chain = apply(&s, None, &l0.finish());
    with_view(&s, &chain, |root| {
        let null = fs::symlink_metadata(root.join("dev/null")).unwrap();
        assert!(null.file_type().is_char_device());
        assert_eq!(null.rdev(), nix::sys::stat::makedev(1, 3));
        assert_eq!(null.mode() & 0o7777, 0o666);
        let lp = fs::symlink_metadata(root.join("dev/loop9")).unwrap();
        assert!(lp.file_type().is_block_device());
        assert_eq!(lp.rdev(), nix::sys::stat::makedev(7, 9));
        let fifo = fs::symlink_metadata(root.join("dev/fifo")).unwrap();
        assert!(fifo.file_type().is_fifo());
        assert_eq!(fifo.mode() & 0o7777, 0o620);
    });
}

/// VFS_CAP_REVISION_2 with the effective flag and cap_net_bind_service (bit 10) permitted.
const CAP_NET_BIND: [u8; 20] = [1, 0, 0, 2, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];

fn ownership_modes_times_and_xattrs(b: Backend) {
    let (_d, s) = open(b);
    let mut l0 = Layer::new();
    l0.entry(
        EntryType::Directory,
        b"./",
        None,
        b"",
        &Attrs {
            mtime: 42,
            ..Attrs::mode(0o711)
        },
    )
    .dir("tmp", 0o1777)
    .entry(
        EntryType::Directory,
        b"shared",
        None,
        b"",
        &Attrs {
            uid: 0,
            gid: 50,
            ..Attrs::mode(0o2775)
        },
    )
    .file_with("suid", b"x", &Attrs::mode(0o4755))
    .file_with(
        "owned",
        b"o",
        &Attrs {
            uid: 1234,
            gid: 5678,
            pax: vec![("mtime".into(), b"1700000000.123456789".to_vec())],
            ..Attrs::mode(0o640)
        },
    )
    .file_with(
        "cap",
        b"c",
        &Attrs::mode(0o755)
            .xattr("security.capability", &CAP_NET_BIND)
            .xattr("user.note", b"hi"),
    )
    .entry(
        EntryType::Symlink,
        b"link",
        Some(b"owned"),
        b"",
        &Attrs {
            uid: 77,
            gid: 88,
            mtime: 1234,
            ..Attrs::mode(0o777)
        },
    );
    let chain = apply(&s, None, &l0.finish());
    let t = view_tree(&s, &chain);
    assert_eq!(t[""].mode, 0o711);
    assert_eq!(t["tmp"].mode, 0o1777);
    assert_eq!((t["shared"].mode, t["shared"].gid), (0o2775, 50));
    assert_eq!(t["suid"].mode, 0o4755);
    assert_eq!(
        (t["owned"].uid, t["owned"].gid, t["owned"].mode),
        (1234, 5678, 0o640)
    );
    assert_eq!(t["owned"].mtime, Some((1_700_000_000, 123_456_789)));
    assert_eq!(t["cap"].xattrs["security.capability"], CAP_NET_BIND);
    assert_eq!(t["cap"].xattrs["user.note"], b"hi");
    assert_eq!(t["cap"].mode, 0o755);
    assert_eq!(
        (t["link"].uid, t["link"].gid, t["link"].mtime),
        (77, 88, Some((1234, 0)))
    );
    assert_eq!(t["link"].content, b"owned");
    // The root's time comes from the "./" entry even though entries were written into it later.
    with_view(&s, &chain, |root| {
        assert_eq!(fs::metadata(root).unwrap().mtime(), 42)
    });
}

fn directory_mtimes_survive_later_layers(b: Backend) {
    let (_d, s) = open(b);
    let mut l0 = Layer::new();
    l0.entry(
        EntryType::Directory,
        b"d",
        None,
        b"",
        &Attrs {
            mtime: 1000,
            ..Attrs::mode(0o755)
        },
    )
    .file("d/x", b"x")
    .file("d/gone", b"g");
    let mut l1 = Layer::new();
    l1.file("d/y", b"y").whiteout("d/gone");
    let chain = apply_all(&s, &[l0.finish(), l1.finish()]);
    for c in &chain {
        with_view(&s, c, |root| {
            assert_eq!(fs::metadata(root.join("d")).unwrap().mtime(), 1000)
        });
    }
}

fn symlinked_parent_inside_snapshot(b: Backend) {
    let (_d, s) = open(b);
    let mut l0 = Layer::new();
    l0.dir("usr", 0o755)
        .dir("usr/lib", 0o755)
        .symlink("lib", "usr/lib");
    let mut l1 = Layer::new();
    l1.file("lib/libx.so", b"elf");
    let chain = apply_all(&s, &[l0.finish(), l1.finish()]);
    let t = view_tree(&s, &chain[1]);
    assert_eq!(t["usr/lib/libx.so"].content, b"elf");
    assert_eq!(t["lib"].kind, 'l');
}

fn file_replaces_directory_and_back(b: Backend) {
    let (_d, s) = open(b);
    let mut l0 = Layer::new();
    l0.dir("x", 0o755).file("x/inner", b"i").file("y", b"file");
    let mut l1 = Layer::new();
    l1.file("x", b"now a file")
        .dir("y", 0o700)
        .file("y/z", b"z");
    let chain = apply_all(&s, &[l0.finish(), l1.finish()]);
    let t = view_tree(&s, &chain[1]);
    let keys: Vec<&str> = t.keys().map(String::as_str).collect();
    assert_eq!(keys, ["", "x", "y", "y/z"]);
    assert_eq!(t["x"].content, b"now a file");
    assert_eq!((t["y"].kind, t["y"].mode), ('d', 0o700));
}

fn stacked_128_layers(b: Backend) {
    let (d, s) = open(b);
    let mut layers = Vec::new();
    for i in 0..128 {
        let mut l = Layer::new();
        l.file(&format!("f{i}"), format!("{i}").as_bytes())
            .file("top", format!("{i}").as_bytes());
        if i > 0 {
            l.whiteout(&format!("f{}", i - 1));
        }
        layers.push(l.finish());
    }
    let chain = apply_all(&s, &layers);
    let m = s.prepare("ctr", Some(&chain[127])).unwrap();
    if b == Backend::Overlay {
        assert!(
            m.options.join(",").len() > 4096,
            "the test must exceed one page of mount options"
        );
    }
    {
        let mounted = Mounted::new(&m, &d.path().join("mnt"));
        assert_eq!(names(&mounted.path), ["f127", "top"]);
        assert_eq!(fs::read(mounted.path.join("top")).unwrap(), b"127");
        fs::write(mounted.path.join("written"), b"w").unwrap();
    }
    assert!(s.usage("ctr").unwrap().inodes >= 2);
    s.remove("ctr").unwrap();
}

fn container_snapshot_lifecycle(b: Backend) {
    let (d, s) = open(b);
    let mut l0 = Layer::new();
    l0.dir("app", 0o755).file("app/run", b"#!/bin/sh");
    let image = apply(&s, None, &l0.finish());
    s.add_user(&image, "image-1").unwrap();
    let m = s.prepare("ctr-1", Some(&image)).unwrap();
    assert_eq!(s.mounts("ctr-1").unwrap(), m);
    let before = s.usage("ctr-1").unwrap();
    {
        let mounted = Mounted::new(&m, &d.path().join("mnt"));
        fs::write(mounted.path.join("app/log"), vec![7u8; 1 << 20]).unwrap();
        assert_eq!(
            fs::read(mounted.path.join("app/run")).unwrap(),
            b"#!/bin/sh"
        );
    }
    let after = s.usage("ctr-1").unwrap();
    assert!(
        after.bytes >= before.bytes + (1 << 20),
        "{before:?} -> {after:?}"
    );
    assert!(after.inodes > before.inodes);
    // The image's layer is still unchanged.
    assert!(!view_tree(&s, &image).contains_key("app/log"));
    assert_eq!(s.remove("ctr-1").unwrap(), ["ctr-1"]);
    assert!(matches!(
        s.stat("ctr-1"),
        Err(minicri_snapshotter::Error::NotFound { .. })
    ));
    assert_eq!(s.list().unwrap().len(), 1);
    assert!(s.total_usage().unwrap().inodes > 0);
}

fn view_is_read_only(b: Backend) {
    let (_d, s) = open(b);
    let mut l0 = Layer::new();
    l0.file("f", b"x");
    let mut l1 = Layer::new();
    l1.file("g", b"y");
    let chain = apply_all(&s, &[l0.finish(), l1.finish()]);
    for c in &chain {
        with_view(&s, c, |root| {
            let err = fs::write(root.join("new"), b"no").unwrap_err();
            assert_eq!(err.raw_os_error(), Some(libc::EROFS));
        });
    }
}

fn commit_active_snapshot(b: Backend) {
    let (d, s) = open(b);
    let mut l0 = Layer::new();
    l0.file("base", b"b").file("drop", b"d");
    let image = apply(&s, None, &l0.finish());
    let m = s.prepare("work", Some(&image)).unwrap();
    {
        let mounted = Mounted::new(&m, &d.path().join("mnt"));
        fs::write(mounted.path.join("added"), b"a").unwrap();
        fs::remove_file(mounted.path.join("drop")).unwrap();
    }
    s.commit("committed", "work").unwrap();
    let keys: Vec<String> = view_tree(&s, "committed").into_keys().collect();
    assert_eq!(keys, ["", "added", "base"]);
    assert!(s.mounts("committed").is_err());
}

/// What an image volume is made of (runtime/src/pods/imagevol.rs): a view of the image's top
/// layer. It must cost no copy of the image's files (a model image is gigabytes): the overlay
/// backend stacks the layer directories read-only, without an upper or work directory, and the
/// copy backend binds the parent's tree read-only.
fn a_view_copies_nothing_and_has_no_upper_layer(b: Backend) {
    let (d, s) = open(b);
    let mut l0 = Layer::new();
    l0.dir("w", 0o755).file("w/big", &vec![3u8; 4 << 20]);
    let mut l1 = Layer::new();
    l1.file("w/small", b"s");
    let chain = apply_all(&s, &[l0.finish(), l1.finish()]);
    for (n, c) in chain.iter().enumerate() {
        let key = format!("vol-{n}");
        let before = s.total_usage().unwrap();
        let m = s.view(&key, Some(c)).unwrap();
        assert!(m.is_read_only(), "{m:?}");
        assert!(
            !m.options
                .iter()
                .any(|o| o.starts_with("upperdir=") || o.starts_with("workdir=")),
            "{m:?}"
        );
        if b == Backend::Overlay && n == 1 {
            assert_eq!(m.fstype, "overlay", "two layers stacked: {m:?}");
        } else {
            assert_eq!(m.fstype, "bind", "{m:?}");
        }
        let after = s.total_usage().unwrap();
        assert!(
            after.bytes < before.bytes + (64 << 10),
            "the view copied files: {before:?} -> {after:?}"
        );
        assert!(s.usage(&key).unwrap().bytes < 64 << 10);
        {
            let mounted = Mounted::new(&m, &d.path().join(format!("mnt-{n}")));
            assert_eq!(fs::read(mounted.path.join("w/big")).unwrap().len(), 4 << 20);
            assert_eq!(mounted.path.join("w/small").exists(), n == 1);
            let err = fs::write(mounted.path.join("w/new"), b"no").unwrap_err();
            assert_eq!(err.raw_os_error(), Some(libc::EROFS));
        }
        assert_eq!(s.stat(&key).unwrap().kind, minicri_snapshotter::Kind::View);
        s.remove(&key).unwrap();
    }
}

/// An image volume's view holds the image's layers while the image's own hold goes (a removal
/// racing a container's creation): they go with the view.
fn a_view_keeps_its_layers_after_the_image_lets_go(b: Backend) {
    let (d, s) = open(b);
    let mut l0 = Layer::new();
    l0.file("a", b"a");
    let mut l1 = Layer::new();
    l1.file("b", b"b");
    // Both layers are held by IMAGE, the image the helpers apply them for.
    let chain = apply_all(&s, &[l0.finish(), l1.finish()]);
    let m = s.view("vol", Some(&chain[1])).unwrap();
    let released = s.release(IMAGE).unwrap();
    assert!(released.keys.is_empty(), "{:?}", released.keys);
    drop(released);
    {
        let mounted = Mounted::new(&m, &d.path().join("mnt"));
        assert_eq!(fs::read(mounted.path.join("a")).unwrap(), b"a");
        assert_eq!(fs::read(mounted.path.join("b")).unwrap(), b"b");
    }
    let mut removed = s.remove("vol").unwrap();
    removed.sort();
    let mut want = vec!["vol".to_string(), chain[0].clone(), chain[1].clone()];
    want.sort();
    assert_eq!(removed, want);
    assert!(s.list().unwrap().is_empty());
}

/// A tree with directory times (which `describe` leaves out) for comparing two applies exactly.
/// The root's time is left out when no layer set it (it is then when the snapshotter made it, and
/// two snapshotters a second apart differ there): test layers carry times of 2020.
fn exact_tree(root: &std::path::Path) -> Vec<(String, Node, i64)> {
    let recent = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
        - 3600;
    describe(root)
        .into_iter()
        .map(|(k, n)| {
            let t = fs::symlink_metadata(root.join(&k)).unwrap().mtime();
            let t = if k.is_empty() && t > recent { 0 } else { t };
            (k, n, t)
        })
        .collect()
}

/// Applies `layers` one after the other and all at once (each before its parent is committed) on
/// the overlay backend; asserts the two give the same trees, directory times included; returns how
/// many layers the early apply had to redo on top of their parent.
fn early_matches_sequential(layers: &[Vec<u8>]) -> usize {
    let (_d, seq) = open(Backend::Overlay);
    let chain = apply_all(&seq, layers);
    let (_d, early) = open(Backend::Overlay);
    let (early_chain, redone) = apply_all_early(&early, layers);
    assert_eq!(early_chain, chain);
    for c in &chain {
        assert_eq!(
            with_view(&early, c, exact_tree),
            with_view(&seq, c, exact_tree)
        );
    }
    redone
}

fn dir_with(name: &str, mode: u32, uid: u64, mtime: u64) -> (String, Attrs) {
    (
        name.to_string(),
        Attrs {
            uid,
            gid: uid,
            mtime,
            ..Attrs::mode(mode)
        },
    )
}

#[test]
fn a_layer_unpacked_before_its_parent_takes_the_parents_directory_metadata() {
    let mut l0 = Layer::new();
    for (name, a) in [
        dir_with("./", 0o750, 0, 11),
        dir_with("usr", 0o711, 7, 22),
        dir_with("usr/lib", 0o700, 1000, 33),
    ] {
        l0.entry(EntryType::Directory, name.as_bytes(), None, b"", &a);
    }
    l0.file("usr/lib/a", b"a");
    // Files under directories the layer does not list: the parent's directories, as copied up.
    let mut l1 = Layer::new();
    l1.file("usr/lib/b", b"b").file("usr/new/c", b"c");
    let redone = early_matches_sequential(&[l0.finish(), l1.finish()]);
    assert_eq!(
        redone, 0,
        "nothing in the layer depends on the parent's content"
    );

    let (_d, s) = open(Backend::Overlay);
    let mut l0 = Layer::new();
    l0.entry(
        EntryType::Directory,
        b"usr",
        None,
        b"",
        &dir_with("usr", 0o711, 7, 22).1,
    );
    let mut l1 = Layer::new();
    l1.file("usr/b", b"b");
    let (chain, redone) = apply_all_early(&s, &[l0.finish(), l1.finish()]);
    assert_eq!(redone, 0);
    let t = view_tree(&s, &chain[1]);
    assert_eq!((t["usr"].mode, t["usr"].uid), (0o711, 7));
    with_view(&s, &chain[1], |root| {
        assert_eq!(fs::symlink_metadata(root.join("usr")).unwrap().mtime(), 22);
    });
}

#[test]
fn a_layer_that_depends_on_its_parents_content_is_applied_again_on_top_of_it() {
    let base = || {
        let mut l0 = Layer::new();
        l0.dir("bin", 0o755)
            .file("bin/sh", b"sh")
            .dir("usr", 0o755)
            .dir("usr/lib", 0o755)
            .symlink("lib", "usr/lib");
        l0.finish()
    };
    let cases: Vec<(&str, Layer)> = vec![
        ("a whiteout of the parent's file", {
            let mut l = Layer::new();
            l.whiteout("bin/sh");
            l
        }),
        ("a hardlink to the parent's file", {
            let mut l = Layer::new();
            l.hardlink("bin/sh2", "bin/sh");
            l
        }),
        ("a path through the parent's symlink", {
            let mut l = Layer::new();
            l.file("lib/x", b"x");
            l
        }),
        ("a whiteout of the parent's directory", {
            let mut l = Layer::new();
            l.whiteout("usr/lib");
            l
        }),
        ("an opaque marker on the parent's directory", {
            let mut l = Layer::new();
            l.opaque("bin").file("bin/new", b"n");
            l
        }),
    ];
    for (what, l) in cases {
        let redone = early_matches_sequential(&[base(), l.finish()]);
        assert_eq!(redone, 1, "{what}");
    }
}

#[test]
fn a_layer_waiting_for_a_parent_that_failed_commits_nothing() {
    let (_d, s) = open(Backend::Overlay);
    let mut l0 = Layer::new();
    l0.file("a", b"a");
    let parent = minicri_snapshotter::chain_id(None, &diff_id(&l0.finish()));
    let mut l1 = Layer::new();
    l1.file("b", b"b");
    let tar = l1.finish();
    let d1 = diff_id(&tar);
    let spec = minicri_snapshotter::LayerSpec {
        media_type: TAR,
        diff_id: &d1,
        parent: Some(&parent),
        user: Some(IMAGE),
        ..Default::default()
    };
    let err = s
        .apply_layer_early(&spec, &mut &tar[..], &|| false)
        .unwrap_err();
    assert!(
        matches!(&err, minicri_snapshotter::Error::NotFound { key } if *key == parent),
        "{err}"
    );
    assert!(s.list().unwrap().is_empty());
    assert_eq!(names(&s.root().join("tmp")), Vec::<String>::new());
}

//! Layers that try to write outside the snapshot: every one fails with an error naming the entry,
//! nothing is committed, nothing is left in tmp/, and nothing outside the snapshot is touched.

use std::fs;

use crate::both_backends;
use crate::common::*;
use minicri_snapshotter::{Backend, Error, LayerSpec, Snapshotter};

both_backends!(
    dotdot_entry,
    absolute_entry,
    symlink_to_absolute_dir,
    symlink_climbing_out,
    symlink_from_lower_layer,
    hardlink_to_dotdot,
    hardlink_to_absolute,
    hardlink_through_symlink,
    hardlink_to_missing_file,
    diff_id_mismatch,
    truncated_stream,
);

/// A directory outside the snapshotter root that the layers aim at.
struct Outside {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
}

fn outside() -> Outside {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("target");
    fs::create_dir(&path).unwrap();
    fs::write(path.join("secret"), b"secret").unwrap();
    Outside { _dir: dir, path }
}

/// Applies `tar` on `parent` and checks the failure: `UnsafePath` (or `want`) naming `entry`, no new
/// snapshot, empty tmp/, and `out` unchanged.
fn refused(s: &dyn Snapshotter, parent: Option<&str>, tar: &[u8], entry: &str, out: &Outside) {
    let before = s.list().unwrap();
    let err = try_apply(s, parent, tar, Some(IMAGE)).unwrap_err();
    match &err {
        Error::UnsafePath { entry: e, .. } => assert_eq!(e, entry, "{err}"),
        other => panic!("expected UnsafePath for {entry}, got {other:?}"),
    }
    assert!(err.to_string().contains(entry));
    assert_eq!(s.list().unwrap(), before, "nothing committed");
    assert!(
        names(&s.root().join("tmp")).is_empty(),
        "the half-applied layer is gone"
    );
    assert_eq!(names(&out.path), ["secret"], "nothing written outside");
    assert_eq!(fs::read(out.path.join("secret")).unwrap(), b"secret");
}

fn dotdot_entry(b: Backend) {
    let (d, s) = open(b);
    let out = outside();
    let mut l = Layer::new();
    l.file("ok", b"fine").file("../../../../escape", b"x");
    refused(&s, None, &l.finish(), "../../../../escape", &out);
    assert!(!d.path().join("escape").exists());
    let mut l = Layer::new();
    l.dir("a", 0o755).file("a/../../b", b"x");
    refused(&s, None, &l.finish(), "a/../../b", &out);
}

fn absolute_entry(b: Backend) {
    let (_d, s) = open(b);
    let out = outside();
    let name = format!("{}/pwned", out.path.display());
    let mut l = Layer::new();
    l.file(&name, b"x");
    refused(&s, None, &l.finish(), &name, &out);
}

fn symlink_to_absolute_dir(b: Backend) {
    let (_d, s) = open(b);
    let out = outside();
    let mut l = Layer::new();
    l.symlink("link", out.path.to_str().unwrap())
        .file("link/pwned", b"x");
    refused(&s, None, &l.finish(), "link/pwned", &out);
}

fn symlink_climbing_out(b: Backend) {
    let (_d, s) = open(b);
    let out = outside();
    let up = "../".repeat(20);
    let target = format!(
        "{up}{}",
        out.path.display().to_string().trim_start_matches('/')
    );
    let mut l = Layer::new();
    l.dir("d", 0o755)
        .symlink("d/link", &target)
        .file("d/link/pwned", b"x");
    refused(&s, None, &l.finish(), "d/link/pwned", &out);
    // A chain of links that climbs out step by step.
    let mut l = Layer::new();
    l.symlink("a", ".")
        .symlink("b", "a/..")
        .file("b/pwned", b"x");
    refused(&s, None, &l.finish(), "b/pwned", &out);
}

fn symlink_from_lower_layer(b: Backend) {
    let (_d, s) = open(b);
    let out = outside();
    let mut l0 = Layer::new();
    l0.symlink("etc", out.path.to_str().unwrap());
    let base = apply(&s, None, &l0.finish());
    let mut l1 = Layer::new();
    l1.file("etc/pwned", b"x");
    refused(&s, Some(&base), &l1.finish(), "etc/pwned", &out);
}

fn hardlink_to_dotdot(b: Backend) {
    let (_d, s) = open(b);
    let out = outside();
    let mut l = Layer::new();
    l.hardlink("h", "../../../../../../etc/passwd");
    refused(&s, None, &l.finish(), "h", &out);
}

fn hardlink_to_absolute(b: Backend) {
    let (_d, s) = open(b);
    let out = outside();
    let target = format!("{}/secret", out.path.display());
    let mut l = Layer::new();
    l.hardlink("h", &target);
    refused(&s, None, &l.finish(), "h", &out);
}

fn hardlink_through_symlink(b: Backend) {
    let (_d, s) = open(b);
    let out = outside();
    let mut l = Layer::new();
    l.symlink("link", out.path.to_str().unwrap())
        .hardlink("h", "link/secret");
    refused(&s, None, &l.finish(), "h", &out);
}

fn hardlink_to_missing_file(b: Backend) {
    let (_d, s) = open(b);
    let mut l = Layer::new();
    l.hardlink("h", "nothing");
    let err = try_apply(&s, None, &l.finish(), None).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidEntry { entry, .. } if entry == "h"),
        "{err:?}"
    );
    assert!(s.list().unwrap().is_empty());
}

fn diff_id_mismatch(b: Backend) {
    let (_d, s) = open(b);
    let mut l = Layer::new();
    l.file("a", b"a");
    let tar = l.finish();
    let wrong = diff_id(b"something else");
    let spec = LayerSpec {
        media_type: TAR,
        diff_id: &wrong,
        parent: None,
        user: None,
        ..Default::default()
    };
    let err = s.apply_layer(&spec, &mut &tar[..]).unwrap_err();
    match err {
        Error::DiffIdMismatch { expected, actual } => {
            assert_eq!(expected, wrong);
            assert_eq!(actual, diff_id(&tar));
        }
        other => panic!("{other:?}"),
    }
    assert!(s.list().unwrap().is_empty());
    assert!(names(&s.root().join("tmp")).is_empty());
    assert!(names(&s.root().join("snapshots")).is_empty());
}

fn truncated_stream(b: Backend) {
    let (_d, s) = open(b);
    let mut l = Layer::new();
    l.file("big", &vec![1u8; 100_000]);
    let tar = l.finish();
    let gz = gzip(&tar);
    let d = diff_id(&tar);
    let spec = LayerSpec {
        media_type: GZIP,
        diff_id: &d,
        parent: None,
        user: None,
        ..Default::default()
    };
    let err = s.apply_layer(&spec, &mut &gz[..gz.len() / 2]).unwrap_err();
    assert!(matches!(err, Error::LayerStream { .. }), "{err:?}");
    assert!(s.list().unwrap().is_empty());
    assert!(names(&s.root().join("tmp")).is_empty());
    // Same stream whole: fine.
    s.apply_layer(&spec, &mut &gz[..]).unwrap();
}

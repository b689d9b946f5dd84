//! Snapshot lifecycle against both backends: compression, chain ids, unpack-once, reference counting
//! by images and containers, persistence across restarts, concurrent applies, streaming input.

use std::fs;
use std::io;
use std::sync::{Arc, Barrier, mpsc};

use crate::both_backends;
use crate::common::*;
use minicri_snapshotter::{Backend, ChunkReader, Error, Kind, LayerSpec, Snapshotter, chain_ids};

both_backends!(
    compressions_and_media_types,
    chain_ids_and_unpack_once,
    shared_layers_survive_removal_of_one_image,
    container_keeps_released_image_layers,
    remove_refuses_snapshots_in_use,
    state_survives_restart_and_crash_leftovers_are_swept,
    concurrent_applies_of_one_chain_unpack_once,
    streams_from_a_channel,
    an_apply_from_other_bytes_does_not_wait_and_a_waiter_can_stop,
    prepare_and_view_errors,
    unpadded_stream_end_and_root_entry,
);

fn base_layer() -> Vec<u8> {
    let mut l = Layer::new();
    l.dir("etc", 0o755)
        .file("etc/os-release", b"minicri")
        .file("etc/big", &vec![b'z'; 300_000]);
    l.finish()
}

fn layer_with(name: &str) -> Vec<u8> {
    let mut l = Layer::new();
    l.file(name, name.as_bytes());
    l.finish()
}

fn compressions_and_media_types(b: Backend) {
    let tar = base_layer();
    let d = diff_id(&tar);
    let cases: [(&str, Vec<u8>); 5] = [
        (TAR, tar.clone()),
        (GZIP, gzip(&tar)),
        (ZSTD, zstd(&tar)),
        (
            "application/vnd.docker.image.rootfs.diff.tar.gzip",
            gzip(&tar),
        ),
        // Mislabelled: an uncompressed blob with a gzip media type still applies.
        (
            "application/vnd.docker.image.rootfs.diff.tar.gzip",
            tar.clone(),
        ),
    ];
    let mut trees = Vec::new();
    for (mt, blob) in cases {
        let (_dir, s) = open(b);
        let spec = LayerSpec {
            media_type: mt,
            diff_id: &d,
            parent: None,
            user: Some(IMAGE),
            ..Default::default()
        };
        let a = s.apply_layer(&spec, &mut &blob[..]).unwrap();
        assert!(a.unpacked);
        assert_eq!(a.size, tar.len() as u64);
        assert_eq!(
            s.stat(&a.chain_id).unwrap().layer_size,
            Some(tar.len() as u64)
        );
        trees.push(view_tree(&s, &a.chain_id));
    }
    assert!(trees.windows(2).all(|w| w[0] == w[1]));
    let (_dir, s) = open(b);
    let spec = LayerSpec {
        media_type: "application/json",
        diff_id: &d,
        parent: None,
        user: None,
        ..Default::default()
    };
    assert!(matches!(
        s.apply_layer(&spec, &mut &tar[..]),
        Err(Error::UnsupportedMediaType(_))
    ));
}

fn chain_ids_and_unpack_once(b: Backend) {
    let (_d, s) = open(b);
    let layers = [base_layer(), layer_with("one"), layer_with("two")];
    let diffs: Vec<String> = layers.iter().map(|l| diff_id(l)).collect();
    let chain = apply_all(&s, &layers);
    assert_eq!(chain, chain_ids(&diffs));
    assert_eq!(chain[0], diffs[0]);
    // The same layer again, for another image: not unpacked, the stream is not even read.
    let spec = LayerSpec {
        media_type: TAR,
        diff_id: &diffs[1],
        parent: Some(&chain[0]),
        user: Some("other"),
        ..Default::default()
    };
    let mut unread: &[u8] = b"not a tar at all";
    let a = s.apply_layer(&spec, &mut unread).unwrap();
    assert_eq!(
        (a.unpacked, a.chain_id.as_str()),
        (false, chain[1].as_str())
    );
    assert!(s.stat(&chain[1]).unwrap().users.contains("other"));
    assert_eq!(s.list().unwrap().len(), 3);
    // A missing parent is an error.
    let spec = LayerSpec {
        media_type: TAR,
        diff_id: &diffs[2],
        parent: Some(&diffs[2]),
        user: None,
        ..Default::default()
    };
    assert!(matches!(
        s.apply_layer(&spec, &mut &layers[2][..]),
        Err(Error::NotFound { .. })
    ));
}

/// Applies `layers` for the image `user`; returns the chain ids.
fn pull(s: &dyn Snapshotter, user: &str, layers: &[Vec<u8>]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for l in layers {
        let c = try_apply(s, out.last().map(String::as_str), l, Some(user)).unwrap();
        out.push(c);
    }
    out
}

fn keys(s: &dyn Snapshotter) -> Vec<String> {
    s.list().unwrap().into_iter().map(|i| i.key).collect()
}

fn shared_layers_survive_removal_of_one_image(b: Backend) {
    let (_d, s) = open(b);
    let a = pull(&s, "image-a", &[base_layer(), layer_with("a")]);
    let bb = pull(&s, "image-b", &[base_layer(), layer_with("b")]);
    assert_eq!(a[0], bb[0], "the shared base is one snapshot");
    assert_eq!(s.list().unwrap().len(), 3);
    let removed = s.release("image-a").unwrap();
    assert_eq!(removed.keys, vec![a[1].clone()]);
    drop(removed);
    assert!(
        names(&s.root().join("tmp")).is_empty(),
        "the released tree is deleted when the release is dropped"
    );
    let mut left = keys(&s);
    left.sort();
    let mut want = vec![bb[0].clone(), bb[1].clone()];
    want.sort();
    assert_eq!(left, want);
    assert_eq!(view_tree(&s, &bb[1])["b"].content, b"b");
    drop(s.release("image-b").unwrap());
    assert!(keys(&s).is_empty());
    assert!(names(&s.root().join("snapshots")).is_empty());
    assert!(names(&s.root().join("meta")).is_empty());
}

fn container_keeps_released_image_layers(b: Backend) {
    let (_d, s) = open(b);
    let img = pull(&s, "image", &[base_layer(), layer_with("x")]);
    s.prepare("ctr", Some(&img[1])).unwrap();
    assert!(
        s.release("image").unwrap().keys.is_empty(),
        "the container still needs the layers"
    );
    assert_eq!(s.list().unwrap().len(), 3);
    let removed = s.remove("ctr").unwrap();
    assert_eq!(
        removed,
        vec!["ctr".to_string(), img[1].clone(), img[0].clone()]
    );
    assert!(keys(&s).is_empty());
    // A container can also be a user: released with it.
    let img = pull(&s, "image", &[base_layer()]);
    s.prepare("ctr2", Some(&img[0])).unwrap();
    s.add_user("ctr2", "pod-sandbox-1").unwrap();
    assert!(matches!(s.remove("ctr2"), Err(Error::InUse { .. })));
    assert_eq!(s.release("pod-sandbox-1").unwrap().keys, ["ctr2"]);
    assert_eq!(keys(&s), [img[0].clone()]);
}

fn remove_refuses_snapshots_in_use(b: Backend) {
    let (_d, s) = open(b);
    let img = pull(&s, "image", &[base_layer(), layer_with("x")]);
    assert!(
        matches!(s.remove(&img[0]), Err(Error::InUse { .. })),
        "has a child"
    );
    assert!(
        matches!(s.remove(&img[1]), Err(Error::InUse { .. })),
        "has a user"
    );
    assert!(matches!(s.remove("nope"), Err(Error::NotFound { .. })));
}

fn state_survives_restart_and_crash_leftovers_are_swept(b: Backend) {
    let dir = tempfile::tempdir().unwrap();
    let img;
    {
        let s = reopen(b, dir.path());
        img = pull(&s, "image", &[base_layer(), layer_with("x")]);
        s.prepare("ctr", Some(&img[1])).unwrap();
        // A second daemon on the same root is refused while the first has it.
        assert!(
            minicri_snapshotter::LocalSnapshotter::open(
                dir.path().join("root"),
                b,
                Default::default()
            )
            .is_err()
        );
    }
    // What a crash mid-apply leaves behind: a half-written layer in tmp/ and an unrecorded directory.
    let root = dir.path().join("root");
    fs::create_dir_all(root.join("tmp/apply-7/fs/usr")).unwrap();
    fs::create_dir_all(root.join("snapshots/999/fs")).unwrap();
    fs::write(root.join("meta/12.json.tmp"), b"{").unwrap();
    let s = reopen(b, dir.path());
    let infos = s.list().unwrap();
    assert_eq!(infos.len(), 3);
    let ctr = s.stat("ctr").unwrap();
    assert_eq!(
        (ctr.kind, ctr.parent.as_deref()),
        (Kind::Active, Some(img[1].as_str()))
    );
    assert!(s.stat(&img[0]).unwrap().users.contains("image"));
    assert!(names(&root.join("tmp")).is_empty());
    assert!(!root.join("snapshots/999").exists());
    assert!(!root.join("meta/12.json.tmp").exists());
    assert_eq!(view_tree(&s, &img[1])["x"].content, b"x");
    // New snapshots never reuse an id seen on disk.
    s.prepare("ctr2", Some(&img[1])).unwrap();
    let ids: Vec<u64> = names(&root.join("snapshots"))
        .iter()
        .map(|n| n.parse().unwrap())
        .collect();
    assert!(ids.iter().any(|id| *id > 999), "{ids:?}");
    drop(s);
    let other = match b {
        Backend::Overlay => Backend::Copy,
        Backend::Copy => Backend::Overlay,
    };
    assert!(minicri_snapshotter::LocalSnapshotter::open(&root, other, Default::default()).is_err());
}

fn concurrent_applies_of_one_chain_unpack_once(b: Backend) {
    let (_d, s) = open(b);
    let s = Arc::new(s);
    let tar = Arc::new(base_layer());
    let barrier = Arc::new(Barrier::new(4));
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let (s, tar, barrier) = (s.clone(), tar.clone(), barrier.clone());
            std::thread::spawn(move || {
                let d = diff_id(&tar);
                let user = format!("image-{i}");
                let spec = LayerSpec {
                    media_type: TAR,
                    diff_id: &d,
                    parent: None,
                    user: Some(&user),
                    ..Default::default()
                };
                barrier.wait();
                s.apply_layer(&spec, &mut &tar[..]).unwrap()
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(results.iter().filter(|a| a.unpacked).count(), 1);
    assert_eq!(s.list().unwrap().len(), 1);
    assert_eq!(s.list().unwrap()[0].users.len(), 4);
    assert_eq!(names(&s.root().join("snapshots")).len(), 1);
}

fn streams_from_a_channel(b: Backend) {
    let (_d, s) = open(b);
    let tar = base_layer();
    let d = diff_id(&tar);
    let blob = gzip(&tar);
    let (tx, rx) = mpsc::sync_channel::<io::Result<Vec<u8>>>(2);
    let feeder = std::thread::spawn(move || {
        for chunk in blob.chunks(977) {
            tx.send(Ok(chunk.to_vec())).unwrap();
        }
    });
    let mut reader = ChunkReader::new(move || rx.recv().ok());
    let spec = LayerSpec {
        media_type: GZIP,
        diff_id: &d,
        parent: None,
        user: Some(IMAGE),
        ..Default::default()
    };
    let a = s.apply_layer(&spec, &mut reader).unwrap();
    feeder.join().unwrap();
    assert!(a.unpacked);
    // A download that fails half-way fails the apply and commits nothing.
    let (_d2, s2) = open(b);
    let blob = gzip(&tar);
    let (tx, rx) = mpsc::sync_channel::<io::Result<Vec<u8>>>(2);
    std::thread::spawn(move || {
        tx.send(Ok(blob[..blob.len() / 3].to_vec())).unwrap();
        let _ = tx.send(Err(io::Error::new(
            io::ErrorKind::ConnectionReset,
            "registry went away",
        )));
    });
    let mut reader = ChunkReader::new(move || rx.recv().ok());
    let err = s2.apply_layer(&spec, &mut reader).unwrap_err();
    assert!(err.to_string().contains("registry went away"), "{err}");
    assert!(s2.list().unwrap().is_empty());
}

/// Two applies of one layer: one from a source whose bytes do not come (a slow download, held
/// here), one from another source (other bytes that unpack to the same layer). The second does
/// not wait for the first: it commits; the first, once its bytes come, finds the layer there.
/// A third apply from the first one's source waits for it, and returns `Cancelled` soon after
/// its caller gives up.
fn an_apply_from_other_bytes_does_not_wait_and_a_waiter_can_stop(b: Backend) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};
    let (_d, s) = open(b);
    let s = Arc::new(s);
    let tar = base_layer();
    let d = diff_id(&tar);
    let spec = |source: &'static str| LayerSpec {
        media_type: TAR,
        diff_id: &d,
        user: Some(IMAGE),
        source: Some(source),
        ..Default::default()
    };
    let (tx, rx) = mpsc::sync_channel::<io::Result<Vec<u8>>>(1);
    let slow = std::thread::spawn({
        let (s, d) = (s.clone(), d.clone());
        move || {
            let spec = LayerSpec {
                media_type: TAR,
                diff_id: &d,
                user: Some(IMAGE),
                source: Some("slow"),
                ..Default::default()
            };
            s.apply_layer(&spec, &mut ChunkReader::new(move || rx.recv().ok()))
        }
    });
    // The slow apply leads its flight once it has its first bytes.
    tx.send(Ok(tar[..512].to_vec())).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    // A second apply from the slow source waits for it; stopped, it gives up within a check
    // or two.
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let waiter = scope.spawn(|| {
            let spec = LayerSpec {
                stop: Some(&stop),
                ..spec("slow")
            };
            s.apply_layer(&spec, &mut tar.as_slice())
        });
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            !waiter.is_finished(),
            "the same source waits for its flight"
        );
        let stopped_at = Instant::now();
        stop.store(true, Ordering::Relaxed);
        let err = waiter.join().unwrap().unwrap_err();
        assert!(matches!(err, Error::Cancelled { .. }), "{err}");
        assert!(stopped_at.elapsed() < Duration::from_secs(2));
    });
    // Another source does not wait for the slow one: it commits the layer.
    let start = Instant::now();
    let a = s.apply_layer(&spec("fast"), &mut tar.as_slice()).unwrap();
    assert!(a.unpacked, "the other source applied it");
    assert!(start.elapsed() < Duration::from_secs(5));
    // The slow bytes come: that apply finds the layer committed and throws its work away.
    tx.send(Ok(tar[512..].to_vec())).unwrap();
    drop(tx);
    let late = slow.join().unwrap().unwrap();
    assert!(!late.unpacked);
    assert_eq!(late.chain_id, a.chain_id);
}

fn prepare_and_view_errors(b: Backend) {
    let (_d, s) = open(b);
    let img = pull(&s, "image", &[base_layer()]);
    s.prepare("c", Some(&img[0])).unwrap();
    assert!(matches!(
        s.prepare("c", Some(&img[0])),
        Err(Error::AlreadyExists { .. })
    ));
    assert!(matches!(
        s.prepare("d", Some("missing")),
        Err(Error::NotFound { .. })
    ));
    assert!(
        matches!(s.prepare("e", Some("c")), Err(Error::InvalidArgument(_))),
        "parent must be committed"
    );
    assert!(matches!(s.view("", None), Err(Error::InvalidArgument(_))));
    // Scratch snapshots (no parent) work too.
    let m = s.prepare("scratch", None).unwrap();
    assert_eq!(m.fstype, "bind");
    let v = s.view("empty-view", None).unwrap();
    assert!(v.is_read_only());
    assert_eq!(s.usage(&img[0]).unwrap().inodes, 4);
    assert!(s.usage(&img[0]).unwrap().bytes >= 300_000);
}

/// Some builders write a "/" entry for the root and end the stream right after the last file's data
/// (no padding, no end-of-archive blocks). Such a layer applies, checked by its diff_id.
fn unpadded_stream_end_and_root_entry(b: Backend) {
    let mut l = Layer::new();
    l.dir("/", 0o755).file("pause", &vec![b'p'; 1000]);
    let full = l.finish();
    // Header of "/", header of "pause", then exactly its 1000 data bytes.
    let tar = full[..512 + 512 + 1000].to_vec();
    let (_d, s) = open(b);
    let chain = apply(&s, None, &tar);
    with_view(&s, &chain, |root| {
        assert_eq!(fs::read(root.join("pause")).unwrap(), vec![b'p'; 1000]);
    });
    // A stream cut inside an entry's data is still an error.
    let (_d, s) = open(b);
    let cut = &full[..512 + 512 + 600];
    assert!(try_apply(&s, None, cut, Some(IMAGE)).is_err());
}

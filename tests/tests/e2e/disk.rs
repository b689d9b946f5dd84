//! Disk bounds on pulls, end to end through the CRI with the real daemon, registry and fault
//! proxy: the image filesystem's reserve (`--image-fs-reserve`) holds for downloads and unpacks
//! on a small filesystem of the test's own, a blob over `--max-blob-size` is refused with no byte
//! fetched, a registry serving endless bytes is cut at the blob's size, and the bytes of partial
//! downloads show in `minicri pulls` and the metrics.
//!
//! The small filesystems are loop-mounted ext4 images, or tmpfs mounts where a test grows one
//! ([`SmallDisk`]): these tests need root.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use minicri_tests::daemon::minicri_bin;
use minicri_tests::images::{Compression, ImageBuilder, LayerBuilder, RegistryClient};
use minicri_tests::proxy::{Target, Times};
use minicri_tests::pull_env::{
    self, MIB, big, free_metrics_address, ingest_bytes, pull, sample, scrape, wait_until,
};
use minicri_tests::small_disk::SmallDisk;

/// A figure sampled every millisecond while it runs, keeping the least or the most seen.
struct Watch {
    stop: Arc<AtomicBool>,
    seen: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watch {
    fn start(least: bool, sample: impl Fn() -> Option<u64> + Send + 'static) -> Watch {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(AtomicU64::new(if least { u64::MAX } else { 0 }));
        let thread = std::thread::spawn({
            let (stop, seen) = (stop.clone(), seen.clone());
            move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(v) = sample() {
                        if least {
                            seen.fetch_min(v, Ordering::Relaxed);
                        } else {
                            seen.fetch_max(v, Ordering::Relaxed);
                        }
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        });
        Watch {
            stop,
            seen,
            thread: Some(thread),
        }
    }

    /// The least free space of `disk`.
    fn free_space(disk: &SmallDisk) -> Watch {
        let root = disk.root().to_path_buf();
        Watch::start(true, move || {
            let s = nix::sys::statvfs::statvfs(&root).ok()?;
            Some(s.blocks_available() * s.fragment_size())
        })
    }

    /// The largest file of blob `digest` under `<root>/content`: its ingest or the blob.
    fn blob_file(root: &Path, digest: &str) -> Watch {
        let (root, digest) = (root.to_path_buf(), digest.to_string());
        let blob = root
            .join("content/blobs/sha256")
            .join(digest.trim_start_matches("sha256:"));
        Watch::start(false, move || {
            let ingest = pull_env::ingest_dir(&root, &digest).map(|d| d.join("data"));
            [Some(blob.clone()), ingest]
                .iter()
                .flatten()
                .filter_map(|f| std::fs::metadata(f).ok())
                .map(|m| m.len())
                .max()
        })
    }

    fn stop(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap();
        self.seen.load(Ordering::Relaxed)
    }
}

/// A test failing half-way stops the watch too.
impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn snapshot_count(root: &Path) -> usize {
    std::fs::read_dir(root.join("snapshots/snapshots")).map_or(0, |d| d.count())
}

/// `minicri pulls` against the daemon's socket.
fn minicri_pulls(socket: &Path) -> String {
    let out = std::process::Command::new(minicri_bin())
        .arg("pulls")
        .arg("--socket")
        .arg(socket)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// A download stopped by the reserve while it writes: a pull stalls at 4 MiB of a 24 MiB layer
/// (its partial download shows, active, in `minicri pulls` and the metrics), another program
/// then fills the filesystem to 6 MiB above the reserve, and the download goes on: it fails
/// with RESOURCE_EXHAUSTED naming the blob, the free space and the setting; free space never
/// fell under the reserve; the partial download stays (idle now) and the pull, once there is
/// room (the filler gone, the filesystem grown for the unpack), resumes it and fetches only the
/// rest.
#[tokio::test(flavor = "multi_thread")]
async fn a_download_stops_at_the_reserve_keeps_it_free_and_resumes() {
    if minicri_tests::prereq::skip_unless_root() {
        return;
    }
    let metrics = free_metrics_address();
    let mut e = pull_env::env(&["--image-fs-reserve", "25%", "--metrics-address", &metrics]).await;
    let disk = SmallDisk::tmpfs(&mut e.daemon, 64).await;
    let (img, image) = big(&e, "disk-stop", 1, 24, 31).await;
    let layer = img.layers.last().unwrap().clone();
    let root = e.daemon.root();
    let (_, total) = disk.space();
    let reserve = total / 4;

    e.proxy
        .faults()
        .stall_after(Target::Blob(layer.digest.clone()), 4 * MIB);
    let call = pull_env::spawn_pull(&e.daemon, &image, None).await;
    assert!(
        e.proxy
            .faults()
            .wait_stalled(1, Duration::from_secs(30))
            .await
    );
    let active = "minicri_ingest_bytes{state=\"active\"}";
    for _ in 0..500 {
        if sample(&scrape(&metrics).await, active) == 4 * MIB && snapshot_count(&root) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let text = scrape(&metrics).await;
    assert_eq!(sample(&text, active), 4 * MIB, "{text}");
    assert_eq!(sample(&text, "minicri_ingests{state=\"active\"}"), 1);
    assert_eq!(snapshot_count(&root), 1, "the busybox layer is unpacked");
    let socket = e.daemon.socket();
    let listing = tokio::task::spawn_blocking(move || minicri_pulls(&socket))
        .await
        .unwrap();
    assert!(
        listing.contains("partial downloads on disk: 1 downloading (4.0 MiB), 0 kept"),
        "{listing}"
    );

    // 6 MiB of room: the daemon sees the filler at its next measure of the filesystem, due
    // within 4 MiB of its writes (what a foreign write can make it miss).
    let (free, _) = disk.space();
    disk.fill(free - reserve - 6 * MIB);
    let low = Watch::free_space(&disk);
    e.proxy.faults().release_stall();
    let err = call.await.unwrap().unwrap_err();
    let low = low.stop();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    // The layer unpacks as it downloads, so the download or the unpack following it reaches the
    // reserve first, whichever claims its next bytes then; either way the download stops and
    // keeps what it has.
    let stopped = [
        format!("download of blob {}", layer.digest),
        format!("unpacking layer {}", layer.digest),
    ];
    assert!(
        stopped.iter().any(|s| err.message().contains(s.as_str())),
        "{err:?}"
    );
    for part in ["free", "pull.image_fs_reserve = 25% of"] {
        assert!(err.message().contains(part), "{part:?} not in {err:?}");
    }
    assert!(
        low >= reserve,
        "free space fell to {low}, under the reserve of {reserve}"
    );
    let kept = ingest_bytes(&root);
    assert!(kept > 4 * MIB && kept < layer.size, "{kept} bytes kept");
    let text = scrape(&metrics).await;
    assert_eq!(sample(&text, "minicri_ingest_bytes{state=\"idle\"}"), kept);
    assert_eq!(sample(&text, active), 0);
    assert!(sample(&text, "minicri_image_fs_reserve_refusals_total") >= 1);

    disk.unfill();
    disk.grow(256);
    e.proxy.reset_stats();
    assert_eq!(
        pull(&e.daemon, &image, None).await.unwrap(),
        img.config_digest
    );
    assert_eq!(
        e.proxy.bytes_served(&layer.digest),
        layer.size - kept,
        "only the missing bytes were fetched: {:?}",
        e.proxy.blob_requests(&layer.digest)
    );
    assert_eq!(ingest_bytes(&root), 0);
}

/// An unpack that would cross the reserve (a layer of 48 MiB of zeros, under 1 MiB compressed,
/// on a 64 MiB filesystem with 16 MiB reserved: its download fits, its files do not) stops with
/// RESOURCE_EXHAUSTED naming the layer; free space never fell under the reserve; nothing of the
/// layer is kept as a snapshot; with room the same pull completes.
#[tokio::test(flavor = "multi_thread")]
async fn an_unpack_stops_at_the_reserve_and_keeps_it_free() {
    if minicri_tests::prereq::skip_unless_root() {
        return;
    }
    let mut e = pull_env::env(&["--image-fs-reserve", "16MiB"]).await;
    let disk = SmallDisk::tmpfs(&mut e.daemon, 64).await;
    let zeros = LayerBuilder::new()
        .dir("zeros", 0o755)
        .file("zeros/a", vec![0u8; 24 << 20], 0o644)
        .file("zeros/b", vec![0u8; 24 << 20], 0o644)
        .build(Compression::Gzip)
        .unwrap();
    let pushed = ImageBuilder::busybox()
        .layer(zeros)
        .push(&RegistryClient::new(e.proxy.upstream()), "disk/zeros:1")
        .await
        .unwrap();
    let zeros = pushed.layers.last().unwrap();
    assert!(zeros.size < MIB);
    let image = format!("{}/disk/zeros:1", e.proxy.addr());
    let root = e.daemon.root();

    let low = Watch::free_space(&disk);
    let err = pull(&e.daemon, &image, None).await.unwrap_err();
    let low = low.stop();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message()
            .contains(&format!("unpacking layer {}", zeros.digest)),
        "{err:?}"
    );
    assert!(
        err.message().contains("pull.image_fs_reserve = 16777216"),
        "{err:?}"
    );
    assert!(low >= 16 * MIB, "free space fell to {low}");
    wait_until("the half-made tree to go", Duration::from_secs(30), || {
        std::fs::read_dir(root.join("snapshots/tmp")).map_or(0, |d| d.count()) == 0
    })
    .await;
    assert_eq!(snapshot_count(&root), 1, "only the busybox layer");

    disk.grow(256);
    assert_eq!(
        pull(&e.daemon, &image, None).await.unwrap(),
        pushed.config_digest
    );
}

/// A pull whose blobs plainly cannot fit above the reserve (a 56 MiB layer, 48 MiB of room) is
/// refused before the first byte of its layers: RESOURCE_EXHAUSTED naming the pull, and the
/// registry served only the image config (which names the layers' chains: a layer already
/// unpacked needs no download, so the layers to fit are known only from it).
#[tokio::test(flavor = "multi_thread")]
async fn a_pull_that_cannot_fit_is_refused_before_its_first_byte() {
    if minicri_tests::prereq::skip_unless_root() {
        return;
    }
    let mut e = pull_env::env(&["--image-fs-reserve", "25%"]).await;
    let _disk = SmallDisk::ext4(&mut e.daemon, 64).await;
    let (img, image) = big(&e, "disk-large", 1, 56, 32).await;
    let err = pull(&e.daemon, &image, None).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains("of blobs to download"), "{err:?}");
    assert!(err.message().contains("pull.image_fs_reserve"), "{err:?}");
    assert_eq!(e.proxy.total_blob_bytes(), img.config_size);
    assert_eq!(e.proxy.bytes_served(&img.layers[0].digest), 0);
    assert_eq!(ingest_bytes(&e.daemon.root()), 0);
}

/// A layer over `--max-blob-size` (16 MiB, 8 MiB allowed) fails the pull with
/// RESOURCE_EXHAUSTED naming the blob, its size and the setting, before any blob (the config
/// included) is fetched.
#[tokio::test(flavor = "multi_thread")]
async fn a_blob_over_max_blob_size_is_refused_with_no_byte_fetched() {
    let e = pull_env::env(&["--max-blob-size", "8388608"]).await;
    let (img, image) = big(&e, "disk-max", 1, 16, 33).await;
    let layer = img.layers.last().unwrap();
    let err = pull(&e.daemon, &image, None).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    for part in [
        layer.digest.clone(),
        format!("claims {} bytes", layer.size),
        "max_blob_size".into(),
        "8388608".into(),
    ] {
        assert!(err.message().contains(&part), "{part:?} not in {err:?}");
    }
    assert_eq!(e.proxy.total_blob_bytes(), 0, "{:?}", e.proxy.requests());
}

/// A registry that sends endless bytes after a blob (1 GiB past each body, chunked, the first
/// ones in the same read as the body's last): each answer is cut at the end of what was asked
/// for, so no file of the blob ever grows past its size, the registry gets to send only what
/// the daemon's buffers hold beyond it, and the blob's bytes are verified against its digest and
/// used. Fetched as one stream and as ranged pieces.
#[tokio::test(flavor = "multi_thread")]
async fn a_registry_serving_endless_bytes_is_cut_at_the_blob_size() {
    const ENDLESS: u64 = 1 << 30;
    // One stream (the layer is smaller than two chunks of 32 MiB).
    let e = pull_env::env(&[]).await;
    let (img, image) = big(&e, "disk-endless", 1, 8, 34).await;
    let layer = img.layers.last().unwrap().clone();
    e.proxy
        .faults()
        .append_after_body(Target::Blob(layer.digest.clone()), ENDLESS, Times::Always);
    let high = Watch::blob_file(&e.daemon.root(), &layer.digest);
    assert_eq!(
        pull(&e.daemon, &image, None).await.unwrap(),
        img.config_digest
    );
    let high = high.stop();
    assert!(high <= layer.size, "a file of the blob grew to {high}");
    let served = e.proxy.bytes_served(&layer.digest);
    assert!(
        served < layer.size + 16 * MIB,
        "{served} bytes served for a blob of {}",
        layer.size
    );
    assert_eq!(ingest_bytes(&e.daemon.root()), 0);
    drop(e);

    // Ranged pieces of 1 MiB over 4 connections.
    let e = pull_env::env(&["--blob-chunk-size", "1048576", "--blob-connections", "4"]).await;
    let (img, image) = big(&e, "disk-endless-ranged", 1, 8, 35).await;
    let layer = img.layers.last().unwrap().clone();
    e.proxy
        .faults()
        .append_after_body(Target::Blob(layer.digest.clone()), ENDLESS, Times::Always);
    let high = Watch::blob_file(&e.daemon.root(), &layer.digest);
    assert_eq!(
        pull(&e.daemon, &image, None).await.unwrap(),
        img.config_digest
    );
    assert!(high.stop() <= layer.size);
    let requests = e.proxy.blob_requests(&layer.digest);
    assert!(requests.len() >= 8, "{requests:?}");
    assert!(requests.iter().all(|r| r.status == 206), "{requests:?}");
    let served = e.proxy.bytes_served(&layer.digest);
    assert!(
        served < layer.size + requests.len() as u64 * 8 * MIB,
        "{served} bytes served over {} requests",
        requests.len()
    );
}

/// A deleted pod's partial download does not make a later pull fail, on a 320 MiB ext4 (about
/// 290 MiB of it usable, 15% reserved): pod 1's pull of a 120 MiB layer stops (its call goes) with 100 MiB on disk, kept for a resume (no cap here); pod 2's
/// image (80 MiB, which with its unpack needs more room than is left above the reserve beside
/// that partial data) pulls on its first try: the reserve has the idle partial data removed
/// before it would refuse.
#[tokio::test(flavor = "multi_thread")]
async fn idle_partial_data_makes_room_before_a_pull_is_refused() {
    if minicri_tests::prereq::skip_unless_root() {
        return;
    }
    // One stream per blob, so that the proxy's stall holds the whole download.
    let mut e = pull_env::env(&[
        "--image-fs-reserve",
        "15%",
        "--partial-data-per-pod",
        "1TiB",
        "--blob-connections",
        "1",
    ])
    .await;
    let disk = SmallDisk::ext4(&mut e.daemon, 320).await;
    let (a_img, a) = big(&e, "room-a", 1, 120, 41).await;
    let (b_img, b) = big(&e, "room-b", 1, 80, 42).await;
    let a_layer = a_img.layers.last().unwrap().digest.clone();
    e.proxy
        .faults()
        .stall_after(Target::Blob(a_layer.clone()), 100 * MIB);
    let call = pull_env::spawn_pull(&e.daemon, &a, pull_env::pod(1)).await;
    assert!(
        e.proxy
            .faults()
            .wait_stalled(1, Duration::from_secs(60))
            .await
    );
    let root = e.daemon.root();
    wait_until("100 MiB on disk", Duration::from_secs(30), || {
        ingest_bytes(&root) >= 100 * MIB
    })
    .await;
    call.abort();
    wait_until("the pull stops", Duration::from_secs(10), || {
        e.daemon.log().contains("last requester gone")
    })
    .await;
    e.proxy.faults().release_stall();
    let (free, total) = disk.space();
    let room = free.saturating_sub(total * 15 / 100);
    assert!(
        room < 2 * 80 * MIB,
        "the test needs the partial data to crowd the room: {room} bytes left"
    );
    let got = pull(&e.daemon, &b, pull_env::pod(2))
        .await
        .expect("the pull succeeds on its first try");
    assert_eq!(got, b_img.config_digest);
    let log = e.daemon.log();
    assert!(
        log.contains("idle partial downloads removed to make room"),
        "{log}"
    );
    assert!(pull_env::ingest_dir(&root, &a_layer).is_none());
}

/// Three 200 MiB images pulled at once on a 1 GiB filesystem (15% reserved) do not all fit:
/// some stop with RESOURCE_EXHAUSTED. Each that failed then pulls alone on its first try,
/// whatever partial data the failures left.
#[tokio::test(flavor = "multi_thread")]
async fn images_that_failed_together_at_the_reserve_each_pull_alone() {
    if minicri_tests::prereq::skip_unless_root() {
        return;
    }
    let mut e = pull_env::env(&[
        "--image-fs-reserve",
        "15%",
        "--partial-data-per-pod",
        "1TiB",
    ])
    .await;
    let _disk = SmallDisk::ext4(&mut e.daemon, 1024).await;
    let mut images = Vec::new();
    for i in 0..3 {
        images.push(big(&e, &format!("together-{i}"), 1, 200, 50 + i).await);
    }
    let mut calls = Vec::new();
    for (i, (_, r)) in images.iter().enumerate() {
        calls.push(pull_env::spawn_pull(&e.daemon, r, pull_env::pod(10 + i)).await);
    }
    let mut failed = Vec::new();
    for (i, call) in calls.into_iter().enumerate() {
        match call.await.unwrap() {
            Ok(_) => {}
            Err(err) => {
                assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
                failed.push(i);
            }
        }
    }
    eprintln!("together, images {failed:?} stopped at the reserve");
    assert!(
        !failed.is_empty(),
        "the three images fitted together: the test needs them not to"
    );
    for i in failed {
        let (img, r) = &images[i];
        let got = pull(&e.daemon, r, pull_env::pod(20 + i))
            .await
            .unwrap_or_else(|err| panic!("image {i} alone: {err:?}"));
        assert_eq!(&got, &img.config_digest);
    }
}

/// A pod's share of partial data (`--partial-data-per-pod`, 50 MiB here): a pod that leaves
/// 100 MiB of one blob behind has it removed; a pod that leaves 30 MiB keeps it for a resume.
#[tokio::test(flavor = "multi_thread")]
async fn a_pods_partial_data_past_its_share_goes() {
    let e = pull_env::env(&["--partial-data-per-pod", "50MiB", "--blob-connections", "1"]).await;
    let root = e.daemon.root();
    let (img, r) = big(&e, "share", 1, 120, 61).await;
    let layer = img.layers.last().unwrap().digest.clone();
    for (pod, stall, kept) in [(1, 100 * MIB, false), (2, 30 * MIB, true)] {
        e.proxy
            .faults()
            .stall_after(Target::Blob(layer.clone()), stall);
        let call = pull_env::spawn_pull(&e.daemon, &r, pull_env::pod(pod)).await;
        assert!(
            e.proxy
                .faults()
                .wait_stalled(1, Duration::from_secs(60))
                .await
        );
        wait_until(
            "the bytes before the stall are on disk",
            Duration::from_secs(30),
            || ingest_bytes(&root) >= stall,
        )
        .await;
        call.abort();
        e.proxy.faults().release_stall();
        if kept {
            tokio::time::sleep(Duration::from_secs(2)).await;
            assert!(
                ingest_bytes(&root) >= stall,
                "pod {pod}'s partial data is kept"
            );
        } else {
            wait_until("pod 1's partial data goes", Duration::from_secs(20), || {
                e.daemon.log().contains("(pull.partial_data_per_pod)")
            })
            .await;
            assert_eq!(ingest_bytes(&root), 0);
        }
    }
}

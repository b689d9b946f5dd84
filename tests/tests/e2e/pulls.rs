//! Black-box tests of shared, resumable, abortable pulls: the real daemon pulls through the
//! fault-injecting proxy in front of a real registry, and the assertions are on the bytes the proxy
//! served per blob.

use std::time::{Duration, Instant};

use minicri_proto::minicri::v1 as admin;
use minicri_proto::minicri::v1::pulls_client::PullsClient;
use minicri_proto::runtime::v1 as cri;
use minicri_tests::images::{self, PushedImage};
use minicri_tests::proxy::{Target, Times};
use minicri_tests::pull_env::*;
use tonic::Code;

#[tokio::test(flavor = "multi_thread")]
async fn ten_sandboxes_pulling_one_image_download_each_blob_once() {
    let e = env(&[]).await;
    let (img, r) = big(&e, "big", 2, 4, 1).await;
    e.proxy.faults().set_rate_limit(Some(8 * MIB));
    let mut calls = Vec::new();
    for i in 0..10 {
        calls.push(spawn_pull(&e.daemon, &r, pod(i)).await);
    }
    for c in calls {
        assert_eq!(
            c.await.unwrap().unwrap().into_inner().image_ref,
            img.config_digest
        );
    }
    assert_each_blob_served_once(&e.proxy, &img);
    let log = e.daemon.log();
    let summary = log
        .lines()
        .find(|l| l.contains("pull job finished"))
        .expect("summary line");
    assert!(summary.contains("requesters_joined=10"), "{summary}");
}

#[tokio::test(flavor = "multi_thread")]
async fn images_sharing_layers_download_the_shared_layers_once() {
    let e = env(&[]).await;
    let set = images::push_standard_set(e.proxy.upstream(), None)
        .await
        .unwrap();
    e.proxy.faults().set_rate_limit(Some(2 * MIB));
    let (a, b) = (&set.shared_a, &set.shared_b);
    let ra = format!("{}/{}:latest", e.proxy.addr(), a.repository);
    let rb = format!("{}/{}:latest", e.proxy.addr(), b.repository);
    let (x, y) = tokio::join!(pull(&e.daemon, &ra, None), pull(&e.daemon, &rb, None));
    assert_eq!(x.unwrap(), a.config_digest);
    assert_eq!(y.unwrap(), b.config_digest);
    let shared: Vec<&String> = a
        .layers
        .iter()
        .map(|l| &l.digest)
        .filter(|d| b.layers.iter().any(|m| &m.digest == *d))
        .collect();
    assert!(!shared.is_empty());
    for d in shared {
        let size = a.layers.iter().find(|l| &l.digest == d).unwrap().size;
        assert_eq!(
            e.proxy.bytes_served(d),
            size,
            "shared layer {d} served once"
        );
    }
    // Pulled again later: nothing is downloaded.
    e.proxy.reset_stats();
    pull(&e.daemon, &ra, None).await.unwrap();
    assert_eq!(e.proxy.total_blob_bytes(), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn one_requester_cancelling_does_not_disturb_another() {
    let e = env(&[]).await;
    let (img, r) = big(&e, "big", 1, 8, 2).await;
    e.proxy.faults().set_rate_limit(Some(4 * MIB));
    let first = spawn_pull(&e.daemon, &r, pod(1)).await;
    wait_until("the download to start", Duration::from_secs(10), || {
        e.proxy.total_blob_bytes() > MIB / 2
    })
    .await;
    // The second requester's call gives up (its client cancels: the call future is dropped).
    let second =
        tokio::time::timeout(Duration::from_millis(300), pull(&e.daemon, &r, pod(2))).await;
    assert!(second.is_err(), "second call cancelled by its client");
    assert_eq!(
        first.await.unwrap().unwrap().into_inner().image_ref,
        img.config_digest
    );
    assert_each_blob_served_once(&e.proxy, &img);
}

/// Starts a rate-limited pull, stops it with `stop`, and checks that bytes stop within 100 ms, the
/// partial data stays, and the next pull transfers only the remainder (give or take `slack`
/// bytes: what was on its way when the pull stopped).
async fn stop_then_resume<T>(
    e: &Env,
    img: &PushedImage,
    r: &str,
    slack: u64,
    stop: impl std::future::Future<Output = T>,
) -> T {
    let layer = img.layers.last().unwrap();
    e.proxy.faults().set_rate_limit(Some(4 * MIB));
    let stopped = stop.await;
    let stopped_at = e.proxy.bytes_served(&layer.digest);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let after_100ms = e.proxy.bytes_served(&layer.digest);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let later = e.proxy.bytes_served(&layer.digest);
    assert!(
        stopped_at > 0 && stopped_at < layer.size,
        "stopped mid-blob: {stopped_at} of {}",
        layer.size
    );
    assert_eq!(
        after_100ms, later,
        "bytes kept flowing after the stop ({stopped_at} -> {after_100ms} -> {later})"
    );
    let kept = ingest_bytes(&e.daemon.root());
    assert!(
        kept + slack >= later && kept > 0,
        "partial data kept: {kept} on disk, {later} served"
    );

    e.proxy.faults().set_rate_limit(None);
    e.proxy.reset_stats();
    assert_eq!(pull(&e.daemon, r, None).await.unwrap(), img.config_digest);
    let second = e.proxy.bytes_served(&layer.digest);
    assert!(
        second <= layer.size - later + slack,
        "second pull transferred {second}; remainder was {}",
        layer.size - later
    );
    assert!(
        second >= layer.size - later,
        "second pull transferred {second}, less than the remainder"
    );
    assert_eq!(ingest_bytes(&e.daemon.root()), 0, "ingest committed");
    stopped
}

#[tokio::test(flavor = "multi_thread")]
async fn deadline_stops_the_download_and_the_next_pull_resumes() {
    let e = env(&[]).await;
    let (img, r) = big(&e, "big", 1, 16, 3).await;
    let stop = async {
        let mut raw = e.daemon.raw_images().await.unwrap();
        let mut req = tonic::Request::new(pull_req(&r, pod(1)));
        req.metadata_mut()
            .insert("grpc-timeout", "1500m".parse().unwrap());
        let err = raw.pull_image(req).await.unwrap_err();
        assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    };
    stop_then_resume(&e, &img, &r, MIB, stop).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn operator_abort_stops_the_download_and_the_next_pull_resumes() {
    let e = env(&[]).await;
    let (img, r) = big(&e, "big", 1, 16, 4).await;
    let stop = async {
        let call = spawn_pull(&e.daemon, &r, pod(7)).await;
        wait_until("the download to start", Duration::from_secs(10), || {
            e.proxy.total_blob_bytes() > 2 * MIB
        })
        .await;
        let mut admin = PullsClient::new(e.daemon.channel().await.unwrap());
        let jobs = admin
            .list_pulls(admin::ListPullsRequest {})
            .await
            .unwrap()
            .into_inner()
            .jobs;
        assert_eq!(jobs.len(), 1);
        let req = &jobs[0].requesters[0];
        assert_eq!(
            (
                req.pod_namespace.as_str(),
                req.pod_name.as_str(),
                req.pod_uid.as_str()
            ),
            ("pulls", "pod-7", "uid-7")
        );
        assert!(
            jobs[0]
                .layers
                .iter()
                .any(|l| l.done > 0 && l.state == "downloading"),
            "{:?}",
            jobs[0].layers
        );
        let dropped = admin
            .abort_pulls(admin::AbortPullsRequest {
                target: Some(admin::abort_pulls_request::Target::Pod(
                    "pulls/pod-7".into(),
                )),
                reason: String::new(),
            })
            .await
            .unwrap()
            .into_inner()
            .references_dropped;
        assert_eq!(dropped, 1);
        let err = call.await.unwrap().unwrap_err();
        assert_eq!(err.code(), Code::Cancelled, "{err:?}");
        assert!(
            err.message().contains("aborted by operator"),
            "{}",
            err.message()
        );
    };
    stop_then_resume(&e, &img, &r, MIB, stop).await;
}

/// Pulls at 4 MiB/s per response, looks at the running pull with `while_running`, SIGKILLs the
/// daemon once a third of the last layer was served, restarts it and pulls again at full speed:
/// at most the remainder and `slack` bytes (what was on its way, or written but not yet recorded)
/// move the second time.
async fn sigkill_then_resume(
    e: &mut Env,
    img: &PushedImage,
    r: &str,
    slack: u64,
    while_running: impl FnOnce(&Env),
) {
    let layer = img.layers.last().unwrap().clone();
    e.proxy.faults().set_rate_limit(Some(4 * MIB));
    let call = spawn_pull(&e.daemon, r, None).await;
    wait_until("a third of the layer", Duration::from_secs(20), || {
        e.proxy.bytes_served(&layer.digest) > layer.size / 3
    })
    .await;
    while_running(e);
    e.daemon.kill();
    assert!(call.await.unwrap().is_err());
    let served = e.proxy.bytes_served(&layer.digest);
    e.daemon.restart().await.unwrap();
    e.proxy.faults().set_rate_limit(None);
    e.proxy.reset_stats();
    assert_eq!(pull(&e.daemon, r, None).await.unwrap(), img.config_digest);
    let second = e.proxy.bytes_served(&layer.digest);
    assert!(
        second <= layer.size - served + slack,
        "after restart {second} bytes; remainder {}",
        layer.size - served
    );
    assert_eq!(ingest_bytes(&e.daemon.root()), 0, "ingest committed");
}

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_mid_pull_then_restart_transfers_only_the_remainder() {
    let mut e = env(&[]).await;
    let (img, r) = big(&e, "big", 1, 16, 5).await;
    sigkill_then_resume(&mut e, &img, &r, MIB, |_| {}).await;
    let mut c = e.daemon.images().await.unwrap();
    let st = c
        .image_status(cri::ImageStatusRequest {
            image: Some(cri::ImageSpec {
                image: r.clone(),
                ..Default::default()
            }),
            verbose: false,
        })
        .await
        .unwrap();
    assert_eq!(st.into_inner().image.unwrap().id, img.config_digest);
}

#[tokio::test(flavor = "multi_thread")]
async fn connection_cut_mid_blob_is_resumed_without_serving_a_byte_twice() {
    let e = env(&[]).await;
    let (img, r) = big(&e, "big", 1, 8, 6).await;
    let layer = img.layers.last().unwrap();
    e.proxy
        .faults()
        .cut_after(Target::Blob(layer.digest.clone()), 3 * MIB, Times::Once);
    assert_eq!(pull(&e.daemon, &r, None).await.unwrap(), img.config_digest);
    let reqs = e.proxy.blob_requests(&layer.digest);
    assert!(
        reqs.len() >= 2,
        "a second request resumed the blob: {reqs:?}"
    );
    assert!(
        reqs[1]
            .range
            .as_deref()
            .is_some_and(|r| r.starts_with(&format!("bytes={}-", 3 * MIB))),
        "{reqs:?}"
    );
    assert_eq!(
        e.proxy.bytes_served(&layer.digest),
        layer.size,
        "no byte served twice"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn registry_ignoring_range_restarts_the_blob_and_verifies_it() {
    let e = env(&[]).await;
    let (img, r) = big(&e, "big", 1, 8, 7).await;
    let layer = img.layers.last().unwrap();
    e.proxy
        .faults()
        .cut_after(Target::Blob(layer.digest.clone()), 2 * MIB, Times::Once);
    e.proxy.faults().set_ignore_range(true);
    assert_eq!(pull(&e.daemon, &r, None).await.unwrap(), img.config_digest);
    assert_eq!(
        e.proxy.bytes_served(&layer.digest),
        2 * MIB + layer.size,
        "cut part, then the whole blob again"
    );
    assert!(e.daemon.log().contains("ignored the range request"));
}

/// A registry that ignores `Range` and cuts every body short, each one a MiB further than the one
/// before: every answer starts from byte 0 again, so no cut body is progress, and the blob fails
/// after its retries (6 requests) with a message that says so, instead of being fetched from the
/// start as long as each body gets further (32 requests here; for ever for a registry whose cuts
/// keep moving).
#[tokio::test(flavor = "multi_thread")]
async fn a_registry_ignoring_range_and_cutting_every_body_fails_the_blob_after_its_retries() {
    let e = env(&[]).await;
    let (img, r) = big(&e, "big", 1, 32, 9).await;
    let layer = img.layers.last().unwrap().digest.clone();
    for mib in 1..32 {
        e.proxy
            .faults()
            .cut_after(Target::Blob(layer.clone()), mib * MIB, Times::Once);
    }
    e.proxy.faults().set_ignore_range(true);
    let err = pull(&e.daemon, &r, None).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert!(
        err.message().contains("gave up after 5 retries")
            && err.message().contains("ignores Range"),
        "{}",
        err.message()
    );
    let requests = e.proxy.blob_requests(&layer).len();
    assert_eq!(requests, 6, "the first request and 5 retries");
}

/// A daemon that fetches blobs of two chunks or more over four ranged requests of 2 MiB at once.
const RANGED: &[&str] = &["--blob-connections", "4", "--blob-chunk-size", "2097152"];
const CHUNK: u64 = 2 * MIB;

/// The `[start, end]` (inclusive) ranges the requests for one blob asked for, in order.
fn requested_ranges(e: &Env, digest: &str) -> Vec<(u64, u64)> {
    e.proxy
        .blob_requests(digest)
        .iter()
        .map(|r| {
            let range = r.range.as_deref().expect("every blob request is ranged");
            let (a, b) = range
                .strip_prefix("bytes=")
                .and_then(|x| x.split_once('-'))
                .unwrap_or_else(|| panic!("a bounded range: {range}"));
            (a.parse().unwrap(), b.parse().unwrap())
        })
        .collect()
}

/// The chunk-sized pieces a blob of `size` bytes is fetched as, as inclusive ranges.
fn chunks(size: u64) -> Vec<(u64, u64)> {
    (0..size.div_ceil(CHUNK))
        .map(|k| (k * CHUNK, ((k + 1) * CHUNK).min(size) - 1))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_large_blob_is_fetched_over_four_ranged_requests_at_once() {
    let e = env(RANGED).await;
    let (img, r) = big(&e, "big", 1, 24, 11).await;
    let layer = img.layers.last().unwrap();
    // Each response at 4 MiB/s: the pieces overlap in time however fast this machine is.
    e.proxy.faults().set_rate_limit(Some(4 * MIB));
    assert_eq!(pull(&e.daemon, &r, None).await.unwrap(), img.config_digest);
    assert_each_blob_served_once(&e.proxy, &img);
    let mut asked = requested_ranges(&e, &layer.digest);
    asked.sort();
    assert_eq!(
        asked,
        chunks(layer.size),
        "one request per chunk, none twice"
    );
    assert_eq!(
        e.proxy.peak_concurrent_bodies(&layer.digest),
        4,
        "four requests of the blob at once"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_node_wide_transfer_limit_counts_each_ranged_request() {
    let mut args = RANGED.to_vec();
    args.extend(["--max-concurrent-transfers", "2"]);
    let e = env(&args).await;
    // The base layer (small: it has a lane of its own) first, so that only the two large
    // layers are fetched below.
    let (base, base_ref) = big(&e, "base", 0, 0, 0).await;
    assert_eq!(
        pull(&e.daemon, &base_ref, None).await.unwrap(),
        base.config_digest
    );
    let (img, r) = big(&e, "big", 2, 12, 12).await;
    e.proxy.reset_stats();
    e.proxy.faults().set_rate_limit(Some(4 * MIB));
    assert_eq!(pull(&e.daemon, &r, None).await.unwrap(), img.config_digest);
    // Both layers of one requester: neither takes the other's slot, and their further requests
    // get a slot only when one frees.
    assert_eq!(
        e.proxy.peak_concurrent_blob_bodies(),
        2,
        "two layers of four requests each share two transfer slots"
    );
    for l in img.layers.iter().skip(1) {
        assert_eq!(
            e.proxy.bytes_served(&l.digest),
            l.size,
            "{} served once",
            l.digest
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_ranged_request_cut_mid_piece_resumes_that_piece_without_serving_a_byte_twice() {
    let e = env(RANGED).await;
    let (img, r) = big(&e, "big", 1, 16, 13).await;
    let layer = img.layers.last().unwrap();
    e.proxy
        .faults()
        .cut_after(Target::Blob(layer.digest.clone()), MIB, Times::Once);
    assert_eq!(pull(&e.daemon, &r, None).await.unwrap(), img.config_digest);
    let reqs = e.proxy.blob_requests(&layer.digest);
    let cut = reqs
        .iter()
        .find(|r| r.faults.iter().any(|f| f == "cut"))
        .expect("one request was cut");
    let (cut_start, cut_end) = requested_ranges(&e, &layer.digest)
        [reqs.iter().position(|r| std::ptr::eq(r, cut)).unwrap()];
    assert!(
        requested_ranges(&e, &layer.digest).contains(&(cut_start + MIB, cut_end)),
        "the cut piece went on from where it stopped: {reqs:?}"
    );
    assert_eq!(
        e.proxy.bytes_served(&layer.digest),
        layer.size,
        "no byte served twice"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deadline_mid_ranged_download_keeps_every_piece_and_the_next_pull_fetches_the_rest() {
    let e = env(RANGED).await;
    let (img, r) = big(&e, "big", 1, 48, 14).await;
    let digest = img.layers.last().unwrap().digest.clone();
    let stop = async {
        let mut raw = e.daemon.raw_images().await.unwrap();
        let mut req = tonic::Request::new(pull_req(&r, pod(1)));
        req.metadata_mut()
            .insert("grpc-timeout", "1500m".parse().unwrap());
        let err = raw.pull_image(req).await.unwrap_err();
        assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
        assert_eq!(e.proxy.peak_concurrent_bodies(&digest), 4);
        let ranges = ingest_ranges(&e.daemon.root(), &digest);
        assert!(
            ranges.contains("\"prefix\""),
            "bytes landed beyond the prefix, so the pieces are recorded: {ranges:?}"
        );
    };
    // Four requests' worth of bytes may be on their way when the call ends.
    stop_then_resume(&e, &img, &r, 2 * MIB, stop).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_mid_ranged_download_then_restart_fetches_only_the_missing_pieces() {
    let mut e = env(RANGED).await;
    let (img, r) = big(&e, "big", 1, 48, 15).await;
    let digest = img.layers.last().unwrap().digest.clone();
    // What was written since the last record of the pieces (at most 1 MiB) and what was on its
    // way over four connections are fetched again; nothing else.
    sigkill_then_resume(&mut e, &img, &r, 2 * MIB, |e| {
        assert_eq!(e.proxy.peak_concurrent_bodies(&digest), 4);
    })
    .await;
    let asked = requested_ranges(&e, &digest);
    assert!(
        asked.iter().all(|&(a, _)| a > 0),
        "no piece started over from byte 0: {asked:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_registry_ignoring_ranges_gets_one_request_for_a_large_blob() {
    let e = env(RANGED).await;
    let (img, r) = big(&e, "big", 1, 16, 16).await;
    let layer = img.layers.last().unwrap();
    e.proxy.faults().set_ignore_range(true);
    assert_eq!(pull(&e.daemon, &r, None).await.unwrap(), img.config_digest);
    assert_eq!(
        e.proxy.blob_requests(&layer.digest).len(),
        1,
        "its answer, the whole blob, was taken"
    );
    assert_eq!(e.proxy.bytes_served(&layer.digest), layer.size);
}

#[tokio::test(flavor = "multi_thread")]
async fn corrupted_bytes_fail_the_pull_and_discard_the_partial() {
    let e = env(&[]).await;
    let (img, r) = big(&e, "big", 1, 4, 8).await;
    let layer = img.layers.last().unwrap();
    e.proxy
        .faults()
        .corrupt_at(Target::Blob(layer.digest.clone()), MIB, Times::Always);
    let err = pull(&e.daemon, &r, None).await.unwrap_err();
    assert_eq!(err.code(), Code::DataLoss, "{err:?}");
    assert!(err.message().contains(&layer.digest), "{}", err.message());
    // The corrupt blob's partial is discarded. The pull's other blobs (the base layer) may keep
    // theirs, as any cancelled download does, depending on how far they got.
    let ingest = e.daemon.root().join("content/ingest");
    assert!(
        ingest_dir(&e.daemon.root(), &layer.digest).is_none(),
        "bad partial discarded: {:?}",
        std::fs::read_dir(&ingest).map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
    );
    let mut c = e.daemon.images().await.unwrap();
    assert!(
        c.list_images(cri::ListImagesRequest { filter: None })
            .await
            .unwrap()
            .into_inner()
            .images
            .is_empty()
    );
    assert!(
        !e.daemon
            .root()
            .join("content/blobs/sha256")
            .join(&layer.digest[7..])
            .exists()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn progress_watchdog_drops_a_stalled_pull() {
    let e = env(&["--pull-progress-timeout", "1"]).await;
    let (img, r) = big(&e, "big", 1, 4, 9).await;
    let layer = img.layers.last().unwrap();
    e.proxy
        .faults()
        .stall_after(Target::Blob(layer.digest.clone()), MIB);
    let start = Instant::now();
    let err = pull(&e.daemon, &r, pod(3)).await.unwrap_err();
    let waited = start.elapsed();
    e.proxy.faults().release_stall();
    assert_eq!(err.code(), Code::Cancelled, "{err:?}");
    assert!(err.message().contains("no progress"), "{}", err.message());
    assert!(
        waited < Duration::from_secs(5),
        "watchdog fired after {waited:?}"
    );
    assert!(ingest_bytes(&e.daemon.root()) >= MIB, "partial data kept");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_watchdog_leaves_a_pull_alone_while_it_unpacks_after_its_last_byte() {
    let e = env(&["--pull-progress-timeout", "1"]).await;
    // 150,000 empty files: a blob of about a MiB, downloaded at once, whose unpack (an inode and
    // its metadata per entry, then a sync) takes seconds after the last byte arrived.
    let mut b = images::LayerBuilder::new();
    for i in 0..150_000 {
        b = b.file(&format!("d{}/f{i}", i / 1000), Vec::new(), 0o644);
    }
    let layer = b.build(images::Compression::Gzip).unwrap();
    let client = images::RegistryClient::new(e.proxy.upstream());
    images::ImageBuilder::new()
        .layer(layer)
        .push(&client, "minicri-test/manyfiles:latest")
        .await
        .unwrap();
    let r = format!("{}/minicri-test/manyfiles:latest", e.proxy.addr());
    let start = Instant::now();
    pull(&e.daemon, &r, pod(5)).await.unwrap();
    let took = start.elapsed();
    // Otherwise the unpack ended within the timeout (and its 100 ms ticks) and the test showed
    // nothing: the pull must have outlasted it.
    assert!(
        took > Duration::from_secs(2),
        "the pull took {took:?}: too little to outlast the 1 s progress timeout"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn stopping_one_of_two_sandboxes_fails_only_its_pull() {
    if let Some(why) = sandboxes_skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let mut e = env(&[]).await;
    let (img, r) = big(&e, "big", 2, 8, 10).await;
    let mut sb = Sandboxes::new(&e.daemon);
    let (a, b) = (sb.run(&e.daemon, 1).await, sb.run(&e.daemon, 2).await);
    e.proxy.faults().set_rate_limit(Some(4 * MIB));
    let mut calls = Vec::new();
    for i in [1, 2] {
        calls.push(spawn_pull(&e.daemon, &r, pod(i)).await);
    }
    wait_until("the download to start", Duration::from_secs(10), || {
        e.proxy.total_blob_bytes() > 2 * MIB
    })
    .await;

    // Both pods hold a reference, each named by its sandbox.
    let mut admin = PullsClient::new(e.daemon.channel().await.unwrap());
    let jobs = admin
        .list_pulls(admin::ListPullsRequest {})
        .await
        .unwrap()
        .into_inner()
        .jobs;
    assert_eq!(jobs.len(), 1, "one job for both pods");
    let mut holders: Vec<&str> = jobs[0]
        .requesters
        .iter()
        .map(|q| q.sandbox_id.as_str())
        .collect();
    holders.sort();
    let mut expected = vec![a.as_str(), b.as_str()];
    expected.sort();
    assert_eq!(holders, expected);

    let [call_a, call_b]: [_; 2] = calls.try_into().unwrap();
    let started = Instant::now();
    let stop = tokio::spawn({
        let ch = e.daemon.channel().await.unwrap();
        let a = a.clone();
        async move {
            minicri_proto::runtime::v1::runtime_service_client::RuntimeServiceClient::new(ch)
                .stop_pod_sandbox(cri::StopPodSandboxRequest { pod_sandbox_id: a })
                .await
        }
    });
    let err = call_a.await.unwrap().unwrap_err();
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_millis(500),
        "the stopped pod's pull returned after {waited:?}"
    );
    assert_eq!(err.code(), Code::Cancelled, "{err:?}");
    assert!(
        err.message().contains(&a),
        "names the sandbox: {}",
        err.message()
    );
    stop.await.unwrap().expect("StopPodSandbox");

    // The other pod's pull carries on and completes; nothing was downloaded twice.
    e.proxy.faults().set_rate_limit(None);
    assert_eq!(
        call_b.await.unwrap().unwrap().into_inner().image_ref,
        img.config_digest
    );
    assert_each_blob_served_once(&e.proxy, &img);

    // A stopped sandbox gets no new pulls, also after a daemon restart; a ready one does.
    let err = pull(&e.daemon, &r, pod(1)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains(&a), "{}", err.message());
    e.daemon.restart().await.unwrap();
    let err = pull(&e.daemon, &r, pod(1)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains(&a), "{}", err.message());
    assert_eq!(
        pull(&e.daemon, &r, pod(2)).await.unwrap(),
        img.config_digest
    );
    sb.remove_all(&e.daemon).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn stopping_the_only_sandbox_stops_the_download_and_the_next_pull_resumes() {
    if let Some(why) = sandboxes_skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let e = env(&[]).await;
    let (img, r) = big(&e, "big", 1, 16, 11).await;
    let mut sb = Sandboxes::new(&e.daemon);
    let id = sb.run(&e.daemon, 1).await;
    // The future hands back the StopPodSandbox task: it is awaited after the byte checks.
    #[allow(clippy::async_yields_async)]
    let stop = async {
        let call = spawn_pull(&e.daemon, &r, pod(1)).await;
        wait_until("the download to start", Duration::from_secs(10), || {
            e.proxy.total_blob_bytes() > 2 * MIB
        })
        .await;
        let ch = e.daemon.channel().await.unwrap();
        let id2 = id.clone();
        let stop = tokio::spawn(async move {
            minicri_proto::runtime::v1::runtime_service_client::RuntimeServiceClient::new(ch)
                .stop_pod_sandbox(cri::StopPodSandboxRequest {
                    pod_sandbox_id: id2,
                })
                .await
        });
        let err = call.await.unwrap().unwrap_err();
        assert_eq!(err.code(), Code::Cancelled, "{err:?}");
        assert!(err.message().contains(&id), "{}", err.message());
        // Bytes are measured from the moment the pod's PullImage returned, not StopPodSandbox.
        stop
    };
    let stop = stop_then_resume(&e, &img, &r, MIB, stop).await;
    stop.await.unwrap().expect("StopPodSandbox");
    sb.stop(&e.daemon, &id)
        .await
        .expect("StopPodSandbox is idempotent");
    sb.remove_all(&e.daemon).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn metrics_count_calls_jobs_and_bytes() {
    let addr = free_metrics_address();
    let e = env(&["--metrics-address", &addr]).await;
    let (img, r) = big(&e, "big", 2, 2, 12).await;
    let before = scrape(&addr).await;
    assert_eq!(sample(&before, "minicri_pull_calls_total"), 0);
    e.proxy.faults().set_rate_limit(Some(4 * MIB));
    let mut calls = Vec::new();
    for i in 0..3 {
        calls.push(spawn_pull(&e.daemon, &r, pod(i)).await);
    }
    wait_until("all three calls joined", Duration::from_secs(10), || {
        e.proxy.total_blob_bytes() > MIB
    })
    .await;
    let during = scrape(&addr).await;
    assert_eq!(sample(&during, "minicri_pull_jobs_active"), 1, "{during}");
    for c in calls {
        assert_eq!(
            c.await.unwrap().unwrap().into_inner().image_ref,
            img.config_digest
        );
    }
    let after = scrape(&addr).await;
    assert_eq!(sample(&after, "minicri_pull_calls_total"), 3, "{after}");
    assert_eq!(sample(&after, "minicri_pull_calls_joined_total"), 2);
    assert_eq!(sample(&after, "minicri_pull_jobs_started_total"), 1);
    assert_eq!(
        sample(&after, "minicri_pull_jobs_finished_total{outcome=\"done\"}"),
        1
    );
    assert_eq!(sample(&after, "minicri_pull_jobs_active"), 0);
    let blob_bytes: u64 = img.config_size + img.layers.iter().map(|l| l.size).sum::<u64>();
    assert_eq!(
        sample(&after, "minicri_pull_downloaded_bytes_total"),
        blob_bytes
    );
    assert_eq!(sample(&after, "minicri_pull_resumed_bytes_total"), 0);
}

#[test]
fn metrics_are_refused_off_loopback() {
    let out = std::process::Command::new(minicri_tests::daemon::minicri_bin())
        .args([
            "serve",
            "--metrics-address",
            "0.0.0.0:9464",
            "--root",
            "/nonexistent/x",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("loopback"), "{err}");
}

/// One image (an 8 MiB layer) behind two registry names: the env's proxy `a` and a second proxy
/// `b` in front of the same registry, for the shared-download tests.
struct TwoNames {
    _env: (
        minicri_tests::registry::Registry,
        minicri_tests::daemon::HostsDir,
    ),
    a: minicri_tests::proxy::Proxy,
    b: minicri_tests::proxy::Proxy,
    daemon: minicri_tests::daemon::Daemon,
    img: PushedImage,
    via_a: String,
    via_b: String,
    layer: images::LayerInfo,
}

async fn two_names_for_one_image(name: &str, seed: u64) -> TwoNames {
    let Env {
        registry,
        proxy: a,
        hosts,
        daemon,
    } = env(&[]).await;
    let client = images::RegistryClient::new(a.upstream());
    let img = images::push_big_image(
        &client,
        &format!("minicri-test/{name}:latest"),
        1,
        8,
        images::Compression::None,
        seed,
    )
    .await
    .expect("push");
    let b = minicri_tests::proxy::Proxy::start(a.upstream()).expect("second proxy");
    let via_a = format!("{}/minicri-test/{name}:latest", a.addr());
    let via_b = format!("{}/minicri-test/{name}:latest", b.addr());
    let layer = img.layers.last().unwrap().clone();
    TwoNames {
        _env: (registry, hosts),
        a,
        b,
        daemon,
        img,
        via_a,
        via_b,
        layer,
    }
}

/// Nor its pace: when the first requester's registry trickles the blob (here 32 KiB/s, which
/// would take over four minutes for the layer), the download moves to the second requester's
/// registry once one window shows it slow, from the bytes on disk, and both pulls finish.
#[tokio::test(flavor = "multi_thread")]
async fn a_shared_download_leaves_a_trickling_registry_for_anothers() {
    let TwoNames {
        _env,
        a,
        b,
        daemon,
        img,
        via_a,
        via_b,
        layer,
    } = two_names_for_one_image("trickled", 11).await;
    a.faults().set_rate_limit(Some(32 * 1024));
    let start = Instant::now();
    let first = spawn_pull(&daemon, &via_a, pod(1)).await;
    wait_until(
        "the first bytes of the layer",
        Duration::from_secs(30),
        || a.bytes_served(&layer.digest) > 0,
    )
    .await;
    let second = spawn_pull(&daemon, &via_b, pod(2)).await;
    let second = tokio::time::timeout(Duration::from_secs(90), second)
        .await
        .expect("the second pull waited on the trickling registry")
        .unwrap();
    assert_eq!(
        second.expect("the second pull").into_inner().image_ref,
        img.config_digest
    );
    let first = tokio::time::timeout(Duration::from_secs(30), first)
        .await
        .expect("the first pull, finished through the other registry")
        .unwrap();
    assert!(first.is_ok(), "{first:?}");
    assert!(start.elapsed() < Duration::from_secs(120));
    let (from_a, from_b) = (a.bytes_served(&layer.digest), b.bytes_served(&layer.digest));
    assert!(
        from_b > 0 && from_b < layer.size && from_a + from_b >= layer.size,
        "{from_a} bytes from the slow registry, {from_b} from the other, of {}",
        layer.size
    );
    assert!(
        daemon
            .log()
            .contains("while another requester's registry could serve the blob")
    );
}

/// A shared blob download does not inherit the first requester's fate: a second requester that
/// reaches the same blob through another registry name (here another proxy in front of the same
/// registry) joins the download; when the first requester's registry dies mid-blob, the download
/// goes on with the second one's session from the bytes on disk, and both pulls succeed.
#[tokio::test(flavor = "multi_thread")]
async fn a_shared_download_failing_for_one_requester_goes_on_with_anothers_registry() {
    let TwoNames {
        _env,
        a,
        b,
        daemon,
        img,
        via_a,
        via_b,
        layer,
    } = two_names_for_one_image("shared", 9).await;

    // Through the first registry name the layer stalls after 2 MiB.
    a.faults()
        .stall_after(Target::Blob(layer.digest.clone()), 2 * MIB);
    let first = spawn_pull(&daemon, &via_a, pod(1)).await;
    assert!(a.faults().wait_stalled(1, Duration::from_secs(30)).await);
    let second = spawn_pull(&daemon, &via_b, pod(2)).await;
    // The second pull has resolved its manifest and joined the layer's download.
    wait_until(
        "the second pull's manifest",
        Duration::from_secs(30),
        || b.requests().iter().any(|r| r.path.contains("/manifests/")),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(b.bytes_served(&layer.digest), 0, "not downloaded twice");

    // The first registry goes away for good, mid-blob.
    drop(a);
    let second = second.await.unwrap();
    let first = first.await.unwrap();
    assert_eq!(
        second
            .expect("the second requester's pull")
            .into_inner()
            .image_ref,
        img.config_digest
    );
    assert_eq!(
        first
            .expect("the first requester's pull, finished through the other registry")
            .into_inner()
            .image_ref,
        img.config_digest
    );
    let from_b = b.bytes_served(&layer.digest);
    assert!(
        from_b > 0 && from_b < layer.size,
        "resumed from the bytes on disk: {from_b} of {} from the second registry",
        layer.size
    );
    assert!(
        daemon
            .log()
            .contains("going on with another's registry session")
    );
}

/// A mirror (a proxy of its own in front of the registry) tried before the registry's own
/// server (the test's proxy) for the images `big` pushes.
fn mirror_before_the_server(e: &Env) -> minicri_tests::proxy::Proxy {
    let mirror = minicri_tests::proxy::Proxy::start(&e.registry.addr()).unwrap();
    e.hosts.set(
        &e.proxy.addr(),
        &format!(
            "server = \"{}\"\n[host.\"{}\"]\n  capabilities = [\"pull\", \"resolve\"]\n",
            e.proxy.url(),
            mirror.url()
        ),
    );
    mirror
}

/// ListPulls until the layer `digest` is downloading from `source`; that layer's progress.
async fn layer_downloading_from(e: &Env, digest: &str, source: &str) -> admin::LayerProgress {
    let mut client = PullsClient::new(e.daemon.channel().await.unwrap());
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let jobs = client
            .list_pulls(admin::ListPullsRequest {})
            .await
            .unwrap()
            .into_inner()
            .jobs;
        let layer = jobs
            .iter()
            .flat_map(|j| j.layers.iter())
            .find(|l| l.digest == digest);
        if let Some(l) = layer
            && l.state == "downloading"
            && l.source == source
        {
            return l.clone();
        }
        assert!(
            Instant::now() < deadline,
            "layer {digest} not downloading from {source}: {jobs:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_mirror_breaking_off_mid_blob_hands_the_rest_to_the_next_host() {
    let e = env(&[]).await;
    let (img, r) = big(&e, "mirrored", 2, 8, 11).await;
    let layer = img.layers.last().unwrap();
    // The mirror breaks off every response for the last layer after 3 MiB.
    let mirror = mirror_before_the_server(&e);
    mirror
        .faults()
        .cut_after(Target::Blob(layer.digest.clone()), 3 * MIB, Times::Always);
    e.proxy
        .faults()
        .stall_after(Target::Blob(layer.digest.clone()), MIB);
    let call = spawn_pull(&e.daemon, &r, None).await;
    // The rest of the layer comes from the server, and `minicri pulls` says so.
    let l = layer_downloading_from(&e, &layer.digest, &e.proxy.url()).await;
    assert_eq!(l.resumed_from, 0, "one download, resumed in place: {l:?}");
    e.proxy.faults().release_stall();
    call.await.unwrap().unwrap();

    let at_mirror = mirror.bytes_served(&layer.digest);
    assert_eq!(
        at_mirror,
        3 * MIB,
        "{:?}",
        mirror.blob_requests(&layer.digest)
    );
    let reqs = e.proxy.blob_requests(&layer.digest);
    assert_eq!(reqs.len(), 1, "{reqs:?}");
    assert_eq!(
        reqs[0].range.as_deref(),
        Some(format!("bytes={}-{}", 3 * MIB, layer.size - 1).as_str()),
        "resumed from the bytes on disk"
    );
    assert_eq!(
        at_mirror + e.proxy.bytes_served(&layer.digest),
        layer.size,
        "no byte served twice"
    );
    // Only that blob moved on: the image's other blobs came from the mirror.
    for d in img.blob_digests() {
        if d != layer.digest {
            assert_eq!(e.proxy.bytes_served(&d), 0, "{d} not from the mirror");
            assert!(mirror.bytes_served(&d) > 0, "{d}");
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_path_based_mirror_serves_the_repository_under_its_prefix() {
    let e = env(&[]).await;
    // The mirror serves `hub-cache/<repository>` (as a Harbor proxy-cache project does), and
    // the registry's own server is down: only the prefixed path can serve the image.
    let client = images::RegistryClient::new(&e.registry.addr());
    let img = images::push_big_image(
        &client,
        "hub-cache/minicri-test/prefixed:latest",
        1,
        1,
        minicri_tests::images::Compression::None,
        12,
    )
    .await
    .unwrap();
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    e.hosts.set(
        "r.example",
        &format!(
            "server = \"http://{dead}\"\n\
             [host.\"http://{}/v2/hub-cache\"]\n  capabilities = [\"pull\", \"resolve\"]\n  \
             override_path = true\n",
            e.registry.addr()
        ),
    );
    assert_eq!(
        pull(&e.daemon, "r.example/minicri-test/prefixed:latest", None)
            .await
            .unwrap(),
        img.config_digest
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_mirror_without_a_blob_hands_it_to_the_next_host() {
    let e = env(&[]).await;
    let (img, r) = big(&e, "partial-mirror", 2, 2, 13).await;
    let layer = img.layers.last().unwrap();
    // The mirror has every blob but the last layer (404, as a cache that lost it answers).
    let mirror = mirror_before_the_server(&e);
    mirror
        .faults()
        .fail(Target::Blob(layer.digest.clone()), 404, Times::Always);
    assert_eq!(pull(&e.daemon, &r, None).await.unwrap(), img.config_digest);
    assert_eq!(e.proxy.bytes_served(&layer.digest), layer.size);
    for d in img.blob_digests() {
        if d != layer.digest {
            let log = e.daemon.log();
            let about: Vec<&str> = log.lines().filter(|l| l.contains(&d[7..19])).collect();
            assert_eq!(
                e.proxy.bytes_served(&d),
                0,
                "{d} not from the mirror; the daemon said: {about:#?}"
            );
        }
    }
}

/// A mirror whose connections hang (a dead route, a firewall dropping packets): with
/// `dial_timeout` on its host entry, the pull gives up connecting to it after that long and
/// goes on with the server, instead of waiting for the daemon's own connect timeout (10 s) at
/// every request.
#[tokio::test(flavor = "multi_thread")]
async fn dial_timeout_bounds_connecting_to_a_mirror_that_never_answers() {
    let e = env(&[]).await;
    let (img, r) = big(&e, "dial-timeout", 1, 1, 14).await;
    let hole = minicri_tests::blackhole::Blackhole::start().unwrap();
    e.hosts.set(
        &e.proxy.addr(),
        &format!(
            "server = \"{}\"\n[host.\"http://{}\"]\n  capabilities = [\"pull\", \"resolve\"]\n  \
             dial_timeout = \"300ms\"\n",
            e.proxy.url(),
            hole.addr()
        ),
    );
    let start = Instant::now();
    assert_eq!(pull(&e.daemon, &r, None).await.unwrap(), img.config_digest);
    let took = start.elapsed();
    // Without the key it takes the daemon's connect timeout, 10 s, for the mirror (checked by
    // hand: 10.2 s), so this fails if dial_timeout is not applied.
    assert!(took < Duration::from_secs(8), "the pull took {took:?}");
    // The daemon says which host it gave up on.
    let log = e.daemon.log();
    assert!(
        log.lines()
            .any(|l| l.contains("trying the next one") && l.contains(&hole.addr())),
        "no line about the mirror {} in the log:\n{log}",
        hole.addr()
    );
}

/// Layers of one image unpack at once: with the download of one layer stalled, the layer above it
/// is unpacked in full (ahead of its parent, in the snapshotter's scratch directory) before the one
/// below has arrived; released, the pull finishes with every layer committed in order.
#[tokio::test(flavor = "multi_thread")]
async fn a_layer_unpacks_while_the_layer_below_it_still_downloads() {
    let e = env(&[]).await;
    let (img, r) = big(&e, "ahead", 2, 4, 31).await;
    let below = &img.layers[img.layers.len() - 2];
    e.proxy
        .faults()
        .stall_after(Target::Blob(below.digest.clone()), MIB);
    let call = spawn_pull(&e.daemon, &r, None).await;
    assert!(
        e.proxy
            .faults()
            .wait_stalled(1, Duration::from_secs(20))
            .await,
        "the layer below stalls"
    );
    // The top layer holds data/random-32.bin (seed 31 + 1): 4 MiB once written in full.
    let root = e.daemon.root();
    let unpacked_above =
        || unpacking_ahead(&root, "data/random-32.bin").is_some_and(|m| m.len() == 4 * MIB);
    wait_until(
        "the layer above to be unpacked",
        Duration::from_secs(20),
        unpacked_above,
    )
    .await;
    assert!(
        e.proxy.faults().stalled() >= 1,
        "the layer below is still stalled"
    );
    assert!(!call.is_finished());
    e.proxy.faults().release_stall();
    let pulled = call.await.unwrap().unwrap().into_inner().image_ref;
    assert_eq!(pulled, img.config_digest);
    assert_each_blob_served_once(&e.proxy, &img);
}

/// Layers applied ahead of their parent are bounded node-wide (`max_concurrent_unpacks` less
/// one), however many pulls want it: with 2, two pulls whose lower layers stall get one top
/// layer unpacked ahead between them; the other waits for its parent, and both then finish.
#[tokio::test]
async fn layers_applied_ahead_are_bounded_node_wide() {
    let e = env(&["--max-concurrent-unpacks", "2"]).await;
    let (a, ra) = big(&e, "ahead-a", 2, 4, 31).await;
    let (b, rb) = big(&e, "ahead-b", 2, 4, 41).await;
    // The layer below each top layer (under both: a shared base layer).
    let lower = [&a, &b].map(|img| img.layers[img.layers.len() - 2].digest.clone());
    e.proxy
        .faults()
        .stall_after(Target::Blobs(lower.to_vec()), MIB);
    let calls = [
        spawn_pull(&e.daemon, &ra, None).await,
        spawn_pull(&e.daemon, &rb, None).await,
    ];
    assert!(
        e.proxy
            .faults()
            .wait_stalled(2, Duration::from_secs(20))
            .await,
        "both lower layers stall"
    );
    // The top layers hold data/random-32.bin and data/random-42.bin (seed + 1), 4 MiB each.
    let root = e.daemon.root();
    let ahead = || {
        ["data/random-32.bin", "data/random-42.bin"]
            .map(|f| unpacking_ahead(&root, f).is_some_and(|m| m.len() == 4 * MIB))
    };
    wait_until(
        "a top layer unpacked ahead",
        Duration::from_secs(20),
        || ahead().contains(&true),
    )
    .await;
    // Time for the other one to go ahead too, if it could.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let started =
        ["data/random-32.bin", "data/random-42.bin"].map(|f| unpacking_ahead(&root, f).is_some());
    assert_eq!(
        started.iter().filter(|s| **s).count(),
        1,
        "one top layer in the node's one slot ahead: {started:?}"
    );
    assert!(calls.iter().all(|c| !c.is_finished()));
    e.proxy.faults().release_stall();
    for (call, img) in calls.into_iter().zip([&a, &b]) {
        let pulled = call.await.unwrap().unwrap().into_inner().image_ref;
        assert_eq!(pulled, img.config_digest);
    }
}

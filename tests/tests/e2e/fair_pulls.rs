//! Black-box tests of pulls sharing a node: the fair transfer scheduler (a slow registry does not
//! starve other pods' pulls, waiting for a transfer slot is not a stall, small blobs have their
//! own lane) and resumed partial data that fails its digest (fetched again from byte 0). A real
//! daemon pulls from a real registry through fault-injecting proxies, each proxy a registry host
//! of its own.

use std::time::{Duration, Instant};

use minicri_tests::images::{self, Compression, PushedImage};
use minicri_tests::proxy::{Proxy, Target};
use minicri_tests::pull_env::*;
use tonic::Code;

const KIB: u64 = 1024;

/// Pushes an image of incompressible layers of `mibs` MiB each (no base layer: images of
/// different tests share no blob) and names it through `proxy`.
async fn image_via(
    e: &Env,
    proxy: &Proxy,
    name: &str,
    mibs: &[u64],
    seed: u64,
) -> (PushedImage, String) {
    let client = images::RegistryClient::new(e.proxy.upstream());
    let mut image = images::ImageBuilder::new();
    for (i, &mib) in mibs.iter().enumerate() {
        let layer = tokio::task::spawn_blocking(move || {
            images::random_layer(mib, Compression::None, seed + i as u64)
        })
        .await
        .unwrap()
        .expect("layer");
        image = image.layer(layer);
    }
    let img = image
        .push(&client, &format!("minicri-test/{name}:latest"))
        .await
        .expect("push image");
    (img, format!("{}/minicri-test/{name}:latest", proxy.addr()))
}

fn lane(metrics: &str, name: &str, lane: &str) -> u64 {
    sample(metrics, &format!("{name}{{lane=\"{lane}\"}}"))
}

async fn wait_for_slots_in_use(addr: &str, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let m = scrape(addr).await;
        if lane(&m, "minicri_transfer_slots_in_use", "large") == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "never {n} large slots in use:\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn assert_no_watchdog_drop(e: &Env) {
    let log = e.daemon.log();
    assert!(
        !log.contains("pull.progress_timeout") && !log.contains("pull.min_speed"),
        "a pull was dropped by the watchdog:\n{log}"
    );
}

/// Two transfer slots, both taken by a 64 MiB blob trickling from a slow registry over ranged
/// requests: another pod's image from another registry still pulls in seconds, its 16 MiB layer
/// with a slot given back by the slow blob and its config and 1 MiB layer in the small lane; the slow pull
/// is not dropped for the time it waited, and completes once its registry speeds up.
#[tokio::test(flavor = "multi_thread")]
async fn a_trickling_registry_does_not_starve_another_pods_pull() {
    let addr = free_metrics_address();
    let e = env(&[
        "--max-concurrent-transfers",
        "2",
        "--blob-chunk-size",
        "4194304",
        "--pull-progress-timeout",
        "5",
        "--metrics-address",
        &addr,
    ])
    .await;
    let fast = Proxy::start(&e.registry.addr()).expect("proxy");
    let (slow_img, slow_ref) = image_via(&e, &e.proxy, "slow", &[64, 1], 31).await;
    let (fast_img, fast_ref) = image_via(&e, &fast, "fast", &[16, 1], 32).await;
    e.proxy.faults().set_rate_limit(Some(128 * KIB));

    let slow_call = spawn_pull(&e.daemon, &slow_ref, pod(1)).await;
    wait_for_slots_in_use(&addr, 2).await;
    let slow_layer = &slow_img.layers[0].digest;
    wait_until(
        "two requests of the slow blob",
        Duration::from_secs(10),
        || e.proxy.peak_concurrent_bodies(slow_layer) == 2,
    )
    .await;

    let start = Instant::now();
    let got = pull(&e.daemon, &fast_ref, pod(2)).await.expect("fast pull");
    let took = start.elapsed();
    eprintln!("the other pod's pull took {took:?}");
    assert_eq!(got, fast_img.config_digest);
    assert!(
        took < Duration::from_secs(5),
        "the other pod's pull took {took:?}"
    );
    let m = scrape(&addr).await;
    assert!(
        lane(&m, "minicri_transfer_revocations_total", "large") >= 1,
        "{m}"
    );
    // Both images' configs and 1 MiB layers (at most 4 MiB each) went through the small lane.
    assert!(
        lane(&m, "minicri_transfer_grants_total", "small") >= 4,
        "{m}"
    );
    assert!(!slow_call.is_finished(), "the slow pull is still running");

    // Longer than pull.progress_timeout, during which the slow blob waited for its slots at
    // times: not a stall.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(!slow_call.is_finished(), "the slow pull is still running");
    e.proxy.faults().set_rate_limit(None);
    let done = tokio::time::timeout(Duration::from_secs(60), slow_call)
        .await
        .expect("the slow pull completes")
        .unwrap()
        .expect("the slow pull succeeds");
    assert_eq!(done.into_inner().image_ref, slow_img.config_digest);
    assert_no_watchdog_drop(&e);
}

/// One transfer slot and two pods pulling large blobs from a slow registry: the newcomer gets the
/// slot within about a second, the first waits a quantum (10 s) for it back, longer than
/// `pull.progress_timeout` (3 s), and neither is dropped for it.
#[tokio::test(flavor = "multi_thread")]
async fn waiting_for_a_transfer_slot_is_not_a_stall() {
    let addr = free_metrics_address();
    let e = env(&[
        "--max-concurrent-transfers",
        "1",
        "--blob-chunk-size",
        "4194304",
        "--pull-progress-timeout",
        "3",
        "--metrics-address",
        &addr,
    ])
    .await;
    let (a_img, a_ref) = image_via(&e, &e.proxy, "a", &[24], 41).await;
    let (b_img, b_ref) = image_via(&e, &e.proxy, "b", &[24], 42).await;
    e.proxy.faults().set_rate_limit(Some(256 * KIB));

    let a = spawn_pull(&e.daemon, &a_ref, pod(1)).await;
    wait_for_slots_in_use(&addr, 1).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let asked = Instant::now();
    let b = spawn_pull(&e.daemon, &b_ref, pod(2)).await;
    let b_layer = b_img.layers.last().unwrap().digest.clone();
    wait_until(
        "the newcomer's layer is served",
        Duration::from_secs(5),
        || e.proxy.bytes_served(&b_layer) > 0,
    )
    .await;
    // Its manifest, config and first connection: the slot comes after a's 1 s of tenure at
    // most, give or take a scheduler tick and a request on loopback.
    let first_bytes = asked.elapsed();
    eprintln!("the newcomer's first layer bytes came {first_bytes:?} after its call");
    assert!(first_bytes < Duration::from_secs(2), "{first_bytes:?}");
    // a waits for b's quantum, then takes the slot back.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let m = scrape(&addr).await;
    assert!(
        lane(&m, "minicri_transfer_revocations_total", "large") >= 2,
        "{m}"
    );
    assert!(!a.is_finished() && !b.is_finished(), "both pulls still run");

    e.proxy.faults().set_rate_limit(None);
    for (call, img) in [(a, &a_img), (b, &b_img)] {
        let r = tokio::time::timeout(Duration::from_secs(60), call)
            .await
            .expect("completes")
            .unwrap()
            .expect("succeeds");
        assert_eq!(r.into_inner().image_ref, img.config_digest);
    }
    assert_no_watchdog_drop(&e);
}

/// A pod's image names a popular layer's digest, served with wrong bytes from its own registry;
/// the pod goes away mid-download and its junk stays as partial data. The next pull of the
/// layer, from an honest registry, resumes from the junk, fails the digest, drops it and fetches
/// the blob once more from byte 0: it succeeds, and the bytes fetched again are counted.
#[tokio::test(flavor = "multi_thread")]
async fn a_poisoned_partial_blob_does_not_fail_the_next_honest_pull() {
    let addr = free_metrics_address();
    let e = env(&["--metrics-address", &addr]).await;
    let honest = Proxy::start(&e.registry.addr()).expect("proxy");
    let (img, evil_ref) = image_via(&e, &e.proxy, "popular", &[24], 51).await;
    let honest_ref = format!("{}/minicri-test/popular:latest", honest.addr());
    let layer = img.layers.last().unwrap().clone();

    let evil = e.proxy.faults();
    evil.corrupt_at(
        Target::Blob(layer.digest.clone()),
        1000,
        minicri_tests::proxy::Times::Always,
    );
    evil.stall_after(Target::Blob(layer.digest.clone()), 8 * MIB);
    let call = spawn_pull(&e.daemon, &evil_ref, pod(1)).await;
    assert!(evil.wait_stalled(1, Duration::from_secs(20)).await);
    wait_until(
        "the bytes before the stall are on disk",
        Duration::from_secs(10),
        || ingest_bytes(&e.daemon.root()) >= 8 * MIB,
    )
    .await;
    // The pod goes: its call is cancelled, the download stops, the junk stays.
    call.abort();
    wait_until("the download stops", Duration::from_secs(10), || {
        e.daemon.log().contains("last requester gone")
    })
    .await;
    evil.release_stall();
    let kept = ingest_bytes(&e.daemon.root());
    assert!(
        kept >= 8 * MIB && kept < layer.size,
        "partial data kept: {kept}"
    );

    let got = pull(&e.daemon, &honest_ref, pod(2))
        .await
        .expect("honest pull");
    assert_eq!(got, img.config_digest);
    let served = honest.bytes_served(&layer.digest);
    assert_eq!(
        served,
        (layer.size - kept) + layer.size,
        "the rest of the resumed blob, then all of it again"
    );
    let m = scrape(&addr).await;
    assert_eq!(
        sample(&m, "minicri_pull_refetched_bytes_total"),
        layer.size,
        "{m}"
    );
    let log = e.daemon.log();
    assert!(
        log.contains("resumed partial data failed the digest"),
        "{log}"
    );
    // The log says whose bytes were resumed.
    assert!(log.contains(&e.proxy.addr()), "{log}");

    // A download that started from byte 0 and fails the digest is not fetched again: the
    // registry itself serves wrong bytes.
    let (bad, bad_ref) = image_via(&e, &e.proxy, "bad", &[4], 52).await;
    let bad_layer = bad.layers.last().unwrap().digest.clone();
    evil.corrupt_at(
        Target::Blob(bad_layer.clone()),
        1000,
        minicri_tests::proxy::Times::Always,
    );
    let err = pull(&e.daemon, &bad_ref, pod(3)).await.unwrap_err();
    assert_eq!(err.code(), Code::DataLoss, "{err:?}");
    assert_eq!(e.proxy.blob_requests(&bad_layer).len(), 1);
}

/// A registry that ignores `Range` and trickles 30 kB/s: an 8-layer image's pull holds both
/// large transfer slots with streams that cannot resume. The pod's call goes (its last
/// requester): the job ends with its live unpacks (they follow those streams), and the daemon
/// then exits on SIGTERM within its grace period, whatever was in flight.
#[tokio::test(flavor = "multi_thread")]
async fn a_pull_stopped_while_its_blobs_stream_without_range_ends_and_the_daemon_stops() {
    let addr = free_metrics_address();
    let mut e = env(&[
        "--max-concurrent-transfers",
        "2",
        "--metrics-address",
        &addr,
    ])
    .await;
    let (_img, slow_ref) = image_via(&e, &e.proxy, "norange", &[6, 6, 6, 6, 6, 6, 6, 6], 61).await;
    e.proxy.faults().set_ignore_range(true);
    e.proxy.faults().set_rate_limit(Some(30_000));

    let call = spawn_pull(&e.daemon, &slow_ref, pod(1)).await;
    wait_for_slots_in_use(&addr, 2).await;
    // Bytes flow into live unpacks.
    tokio::time::sleep(Duration::from_secs(3)).await;
    call.abort();
    wait_until("the job ends", Duration::from_secs(10), || {
        e.daemon.log().contains("pull job finished")
    })
    .await;
    wait_until(
        "the transfer slots are free",
        Duration::from_secs(10),
        || {
            futures::executor::block_on(scrape(&addr))
                .contains("minicri_transfer_slots_in_use{lane=\"large\"} 0")
        },
    )
    .await;
    // Pulled again (resuming), and the daemon told to stop while the blobs stream into live
    // unpacks: the pull ends with them, and the daemon exits.
    let again = spawn_pull(&e.daemon, &slow_ref, pod(2)).await;
    wait_for_slots_in_use(&addr, 2).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let start = Instant::now();
    let status = e.daemon.stop().expect("the daemon exits on SIGTERM");
    let took = start.elapsed();
    eprintln!("the daemon exited {took:?} after SIGTERM: {status:?}");
    assert!(status.success(), "{status:?}");
    assert!(took < Duration::from_secs(20), "{took:?}");
    let err = again
        .await
        .unwrap()
        .expect_err("the call ends with the daemon");
    eprintln!("the call in flight: {err:?}");
}

/// Two large transfer slots, both held by an 8-layer image's blobs streaming from a registry
/// that ignores `Range` and trickles 30 kB/s (they cannot resume: revoking one loses its
/// bytes). Another pod's image of one large layer (256 MiB; `MINICRI_TEST_BIG_MIB=1024` for the
/// 1 GiB of the issue, on a release build) from a fast registry still pulls in under 10 s: a
/// trickle that cannot resume gives its slot up once its rate shows it would hold it past the
/// quantum, and starts again from byte 0 only in a slot nobody else waits for.
#[tokio::test(flavor = "multi_thread")]
async fn trickles_that_cannot_resume_do_not_hold_slots_against_another_pods_pull() {
    let mib: u64 = std::env::var("MINICRI_TEST_BIG_MIB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    let addr = free_metrics_address();
    let e = env(&[
        "--max-concurrent-transfers",
        "2",
        "--metrics-address",
        &addr,
    ])
    .await;
    let fast = Proxy::start(&e.registry.addr()).expect("proxy");
    let (_, slow_ref) = image_via(&e, &e.proxy, "trickle", &[6, 6, 6, 6, 6, 6, 6, 6], 71).await;
    let (big_img, big_ref) = image_via(&e, &fast, "big-one", &[mib], 72).await;
    e.proxy.faults().set_ignore_range(true);
    e.proxy.faults().set_rate_limit(Some(30_000));

    let slow_call = spawn_pull(&e.daemon, &slow_ref, pod(1)).await;
    wait_for_slots_in_use(&addr, 2).await;
    let start = Instant::now();
    let got = tokio::time::timeout(Duration::from_secs(60), pull(&e.daemon, &big_ref, pod(2)))
        .await
        .expect("the other pod's pull is not starved by the trickles")
        .expect("the other pod's pull");
    let took = start.elapsed();
    eprintln!("the {mib} MiB pull took {took:?} beside the trickles");
    assert_eq!(got, big_img.config_digest);
    assert!(
        took < Duration::from_secs(10),
        "the {mib} MiB pull took {took:?}"
    );
    let m = scrape(&addr).await;
    assert!(
        lane(
            &m,
            "minicri_transfer_unresumable_revocations_total",
            "large"
        ) >= 1,
        "{m}"
    );
    let log = e.daemon.log();
    assert!(
        log.contains("taken back from a download that cannot resume"),
        "{log}"
    );
    assert!(!slow_call.is_finished(), "the trickling pull goes on");
    slow_call.abort();
}

/// A pod's image names a popular layer's digest with another size, and its own registry serves
/// that layer slowly. While that download runs, another pod's honest pull of the layer (right
/// size, another registry) neither waits for it nor fails: downloads are keyed by digest and
/// size. The liar's pull then fails on its own, and the honest image stays.
#[tokio::test(flavor = "multi_thread")]
async fn a_descriptor_with_a_wrong_size_fails_only_its_own_pull() {
    let e = env(&[]).await;
    let honest = Proxy::start(&e.registry.addr()).expect("proxy");
    let (img, honest_ref) = image_via(&e, &honest, "popular-size", &[24], 81).await;
    let layer = img.layers.last().unwrap().clone();

    // The liar's manifest: the same config and layer, the layer's size 1 MiB larger.
    let client = minicri_tests::images::RegistryClient::new(e.proxy.upstream());
    let fetched = client
        .get_manifest("minicri-test/popular-size", "latest")
        .await
        .expect("manifest");
    let mut doc: serde_json::Value = serde_json::from_slice(&fetched.body).unwrap();
    for l in doc["layers"].as_array_mut().unwrap() {
        if l["digest"] == layer.digest.as_str() {
            l["size"] = serde_json::json!(layer.size + MIB);
        }
    }
    let body = serde_json::to_vec(&doc).unwrap();
    let digest = minicri_tests::images::sha256_digest(&body);
    e.proxy.faults().answer(
        Target::Manifests,
        200,
        &[
            ("Content-Type", img.manifest_media_type.as_str()),
            ("Docker-Content-Digest", digest.as_str()),
        ],
        body,
        minicri_tests::proxy::Times::Always,
    );
    e.proxy.faults().set_rate_limit(Some(256 * KIB));
    let liar_ref = format!("{}/minicri-test/popular-size:latest", e.proxy.addr());

    let liar = spawn_pull(&e.daemon, &liar_ref, pod(1)).await;
    wait_until(
        "the liar's registry serves the layer",
        Duration::from_secs(20),
        || e.proxy.bytes_served(&layer.digest) > 0,
    )
    .await;
    let start = Instant::now();
    let got = pull(&e.daemon, &honest_ref, pod(2))
        .await
        .expect("the honest pull succeeds while the liar's download runs");
    assert_eq!(got, img.config_digest);
    eprintln!("the honest pull took {:?}", start.elapsed());
    assert!(start.elapsed() < Duration::from_secs(20));
    assert_eq!(honest.bytes_served(&layer.digest), layer.size);
    assert!(!liar.is_finished(), "the liar's download is still running");

    e.proxy.faults().set_rate_limit(None);
    let err = tokio::time::timeout(Duration::from_secs(60), liar)
        .await
        .expect("the liar's pull ends")
        .unwrap()
        .expect_err("the liar's pull fails");
    eprintln!("the liar's pull: {err:?}");
    assert!(err.message().contains(&layer.digest), "{err:?}");
    // The honest image is still there and whole.
    let again = pull(&e.daemon, &honest_ref, pod(3)).await.expect("again");
    assert_eq!(again, img.config_digest);
}

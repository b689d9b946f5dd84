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

    // Longer than pull_progress_timeout, during which the slow blob waited for its slots at
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
/// `pull_progress_timeout` (3 s), and neither is dropped for it.
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

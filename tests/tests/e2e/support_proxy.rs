//! Tests of the fault-injecting registry proxy (`minicri_tests::proxy`): each fault is seen by
//! a plain reqwest client, and the byte counts match what went over the wire.

use std::time::{Duration, Instant};

use minicri_tests::images::{
    BUSYBOX_OCI, ImageBuilder, LayerInfo, PushedImage, RegistryClient, sha256_digest,
};
use minicri_tests::proxy::{Proxy, Target, Times};
use minicri_tests::registry::Registry;

struct Setup {
    _registry: Registry,
    proxy: Proxy,
    image: PushedImage,
    http: reqwest::Client,
}

impl Setup {
    async fn new() -> Setup {
        let registry = Registry::start();
        let image = ImageBuilder::busybox()
            .push(&registry.client(), BUSYBOX_OCI)
            .await
            .unwrap();
        let proxy = Proxy::start(&registry.addr()).unwrap();
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        Setup {
            _registry: registry,
            proxy,
            image,
            http,
        }
    }

    fn layer(&self) -> &LayerInfo {
        &self.image.layers[0]
    }

    fn blob_url(&self, digest: &str) -> String {
        format!(
            "{}/v2/{}/blobs/{digest}",
            self.proxy.url(),
            self.image.repository
        )
    }

    async fn get(&self, digest: &str, range: Option<&str>) -> reqwest::Result<(u16, Vec<u8>)> {
        let mut req = self.http.get(self.blob_url(digest));
        if let Some(range) = range {
            req = req.header("Range", range);
        }
        let resp = req.send().await?;
        let status = resp.status().as_u16();
        Ok((status, resp.bytes().await?.to_vec()))
    }
}

#[tokio::test]
async fn proxy_forwards_and_counts_bytes() {
    let s = Setup::new().await;
    let layer = s.layer().clone();

    // Manifest through the proxy, then the blob.
    let client = RegistryClient::new(&s.proxy.addr());
    let manifest = client
        .get_manifest(&s.image.repository, "oci")
        .await
        .unwrap();
    assert_eq!(manifest.digest(), s.image.manifest_digest);

    let (status, body) = s.get(&layer.digest, None).await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(sha256_digest(&body), layer.digest);
    assert_eq!(s.proxy.bytes_served(&layer.digest), layer.size);
    let blob_gets = s.proxy.blob_requests(&layer.digest);
    assert_eq!(blob_gets.len(), 1, "served once");
    assert_eq!(blob_gets[0].status, 200);
    assert_eq!(blob_gets[0].bytes_sent, layer.size);
    assert!(blob_gets[0].completed);
    assert!(blob_gets[0].faults.is_empty());

    // HEAD and other requests are recorded but add no blob bytes.
    let head = s.http.head(s.blob_url(&layer.digest)).send().await.unwrap();
    assert_eq!(head.status().as_u16(), 200);
    assert_eq!(s.proxy.bytes_served(&layer.digest), layer.size);
    let requests = s.proxy.requests();
    assert_eq!(requests.len(), 3);
    assert_eq!(requests[0].path, "/v2/minicri-test/busybox/manifests/oci");
    assert_eq!(requests[2].method, "HEAD");

    // A range request serves only the remainder.
    s.proxy.reset_stats();
    let (status, body) = s.get(&layer.digest, Some("bytes=1000-")).await.unwrap();
    assert_eq!(status, 206);
    assert_eq!(body.len() as u64, layer.size - 1000);
    assert_eq!(s.proxy.bytes_served(&layer.digest), layer.size - 1000);
    assert_eq!(s.proxy.requests()[0].range.as_deref(), Some("bytes=1000-"));
}

#[tokio::test]
async fn proxy_cuts_a_connection_after_n_bytes() {
    let s = Setup::new().await;
    let layer = s.layer().clone();
    s.proxy
        .faults()
        .cut_after(Target::Blob(layer.digest.clone()), 1000, Times::Once);

    let first = s.get(&layer.digest, None).await;
    assert!(
        first.is_err(),
        "the body was cut: {:?}",
        first.map(|(s, b)| (s, b.len()))
    );
    let records = s.proxy.blob_requests(&layer.digest);
    assert_eq!(records[0].bytes_sent, 1000);
    assert!(!records[0].completed);
    assert_eq!(records[0].faults, vec!["cut".to_string()]);

    // Resume: only the remainder moves, and the cut was used up.
    let (status, rest) = s.get(&layer.digest, Some("bytes=1000-")).await.unwrap();
    assert_eq!(status, 206);
    assert_eq!(rest.len() as u64, layer.size - 1000);
    assert_eq!(s.proxy.bytes_served(&layer.digest), layer.size);

    // Every time: each request is cut.
    s.proxy
        .faults()
        .cut_after(Target::AnyBlob, 10, Times::Always);
    for _ in 0..2 {
        assert!(s.get(&layer.digest, None).await.is_err());
    }
    // Other blobs are hit by AnyBlob too; clearing restores service.
    s.proxy.faults().clear();
    let (_, body) = s.get(&layer.digest, None).await.unwrap();
    assert_eq!(sha256_digest(&body), layer.digest);
}

#[tokio::test]
async fn proxy_ignores_range_when_told() {
    let s = Setup::new().await;
    let layer = s.layer().clone();
    s.proxy.faults().set_ignore_range(true);
    let (status, body) = s.get(&layer.digest, Some("bytes=1000-")).await.unwrap();
    assert_eq!(status, 200, "the upstream saw no Range");
    assert_eq!(sha256_digest(&body), layer.digest);
    let record = &s.proxy.requests()[0];
    assert_eq!(record.range.as_deref(), Some("bytes=1000-"));
    assert!(record.faults.contains(&"range-ignored".to_string()));
    assert_eq!(s.proxy.bytes_served(&layer.digest), layer.size);
}

#[tokio::test]
async fn proxy_corrupts_bytes() {
    let s = Setup::new().await;
    let layer = s.layer().clone();
    let (_, good) = s.get(&layer.digest, None).await.unwrap();
    s.proxy
        .faults()
        .corrupt_at(Target::AnyBlob, 12345, Times::Once);
    let (status, bad) = s.get(&layer.digest, None).await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(bad.len(), good.len());
    assert_ne!(sha256_digest(&bad), layer.digest);
    let differing: Vec<usize> = (0..good.len()).filter(|&i| good[i] != bad[i]).collect();
    assert_eq!(differing, vec![12345]);
    assert_eq!(bad[12345], !good[12345]);
    // Once: the next one is fine.
    let (_, again) = s.get(&layer.digest, None).await.unwrap();
    assert_eq!(sha256_digest(&again), layer.digest);
}

#[tokio::test]
async fn proxy_fails_n_times() {
    let s = Setup::new().await;
    let layer = s.layer().clone();
    s.proxy.faults().fail(Target::AnyBlob, 503, Times::N(2));
    assert_eq!(s.get(&layer.digest, None).await.unwrap().0, 503);
    assert_eq!(s.get(&layer.digest, None).await.unwrap().0, 503);
    let (status, body) = s.get(&layer.digest, None).await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(sha256_digest(&body), layer.digest);
    // Failed requests add no blob bytes.
    assert_eq!(s.proxy.bytes_served(&layer.digest), layer.size);

    s.proxy.faults().fail(Target::Manifests, 500, Times::Once);
    let client = RegistryClient::new(&s.proxy.addr());
    assert!(
        client
            .get_manifest(&s.image.repository, "oci")
            .await
            .is_err()
    );
    assert!(
        client
            .get_manifest(&s.image.repository, "oci")
            .await
            .is_ok()
    );
}

#[tokio::test]
async fn proxy_stalls_until_released() {
    let s = Setup::new().await;
    let layer = s.layer().clone();
    let faults = s.proxy.faults().clone();
    faults.stall_after(Target::AnyBlob, 4096);
    let url = s.blob_url(&layer.digest);
    let http = s.http.clone();
    let download = tokio::spawn(async move { http.get(url).send().await?.bytes().await });
    assert!(faults.wait_stalled(1, Duration::from_secs(10)).await);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        s.proxy.bytes_served(&layer.digest),
        4096,
        "nothing moves while stalled"
    );
    assert!(!download.is_finished());
    faults.release_stall();
    let body = download.await.unwrap().unwrap();
    assert_eq!(sha256_digest(&body), layer.digest);
    assert_eq!(faults.stalled(), 0);
    assert_eq!(faults.stall_hits(), 1);
}

/// A dropped proxy is a registry host going away: a stalled transfer is cut where it stands, never
/// released to finish the blob first.
#[tokio::test]
async fn dropping_the_proxy_cuts_a_stalled_transfer() {
    let s = Setup::new().await;
    let url = s.blob_url(&s.layer().digest);
    let Setup {
        _registry,
        proxy,
        http,
        ..
    } = s;
    let faults = proxy.faults().clone();
    faults.stall_after(Target::AnyBlob, 4096);
    let download = tokio::spawn(async move { http.get(url).send().await?.bytes().await });
    assert!(faults.wait_stalled(1, Duration::from_secs(10)).await);
    drop(proxy);
    let outcome = tokio::time::timeout(Duration::from_secs(10), download)
        .await
        .expect("the cut ends the download")
        .unwrap();
    assert!(outcome.is_err(), "the blob was served whole after the drop");
}

#[tokio::test]
async fn proxy_rate_limits_blob_bodies() {
    let s = Setup::new().await;
    let layer = s.layer().clone();
    let rate = 2 * 1024 * 1024;
    s.proxy.faults().set_rate_limit(Some(rate));
    let start = Instant::now();
    let (_, body) = s.get(&layer.digest, None).await.unwrap();
    let elapsed = start.elapsed();
    assert_eq!(sha256_digest(&body), layer.digest);
    let expected = Duration::from_secs_f64(layer.size as f64 / rate as f64);
    assert!(
        elapsed >= expected.mul_f64(0.9),
        "{} bytes in {elapsed:?} at {rate} B/s",
        layer.size
    );
    s.proxy.faults().set_rate_limit(None);
    let start = Instant::now();
    s.get(&layer.digest, None).await.unwrap();
    assert!(start.elapsed() < expected);
}

/// A link rate is shared: three bodies at once take three times as long as one would at that
/// rate (a per-response limit would let them finish together in the time of one).
#[tokio::test(flavor = "multi_thread")]
async fn proxy_link_rate_is_shared_by_every_blob_body() {
    let s = Setup::new().await;
    let layer = s.layer().clone();
    let rate = 4 * 1024 * 1024;
    s.proxy.faults().set_link_rate(Some(rate));
    let start = Instant::now();
    let (a, b, c) = tokio::join!(
        s.get(&layer.digest, None),
        s.get(&layer.digest, None),
        s.get(&layer.digest, None)
    );
    let elapsed = start.elapsed();
    for r in [a, b, c] {
        assert_eq!(sha256_digest(&r.unwrap().1), layer.digest);
    }
    let one = Duration::from_secs_f64(layer.size as f64 / rate as f64);
    assert!(
        elapsed >= (one * 3).mul_f64(0.9),
        "3 x {} bytes in {elapsed:?} at {rate} B/s shared",
        layer.size
    );
    let reqs = s.proxy.requests();
    assert!(
        reqs.iter()
            .filter(|r| r.digest.is_some())
            .all(|r| r.faults.iter().any(|f| f == "link-rate")),
        "{reqs:?}"
    );
}

#[tokio::test]
async fn pushing_through_the_proxy_rewrites_locations_and_forwards_auth() {
    let registry = Registry::start_with_auth("u", "pw");
    let proxy = Proxy::start(&registry.addr()).unwrap();
    let through = RegistryClient::new(&proxy.addr()).with_basic_auth("u", "pw");
    let pushed = ImageBuilder::busybox()
        .push(&through, "minicri-test/via-proxy:1")
        .await
        .unwrap();
    assert!(pushed.reference.starts_with(&proxy.addr()));
    let requests = proxy.requests();
    assert!(requests.iter().all(|r| r.authorization));
    let puts: Vec<_> = requests
        .iter()
        .filter(|r| r.method == "PUT" && r.path.contains("/blobs/uploads/"))
        .collect();
    assert_eq!(
        puts.len(),
        2,
        "layer and config uploads went through the proxy"
    );
    assert!(puts.iter().all(|r| r.status == 201));
    // And the image is in the upstream registry.
    let manifest = registry
        .client()
        .get_manifest("minicri-test/via-proxy", "1")
        .await
        .unwrap();
    assert_eq!(manifest.digest(), pushed.manifest_digest);
    // Anonymous requests through the proxy get the upstream's 401.
    let anonymous = RegistryClient::new(&proxy.addr());
    assert!(
        anonymous
            .get_manifest("minicri-test/via-proxy", "1")
            .await
            .is_err()
    );
    assert_eq!(proxy.requests().last().unwrap().status, 401);
}

#[tokio::test]
async fn proxy_streams_a_big_blob_and_a_resume_moves_only_the_rest() {
    use minicri_tests::images::{Compression, random_layer};
    let registry = Registry::start();
    let layer = random_layer(8, Compression::None, 42).unwrap();
    registry
        .client()
        .push_layer("minicri-test/big", &layer)
        .await
        .unwrap();
    let proxy = Proxy::start(&registry.addr()).unwrap();
    let half = layer.size / 2;
    proxy.faults().cut_after(Target::AnyBlob, half, Times::Once);
    let url = format!("{}/v2/minicri-test/big/blobs/{}", proxy.url(), layer.digest);
    let http = reqwest::Client::builder().no_proxy().build().unwrap();

    // Read the first response as a stream, keeping what arrived before the cut.
    let mut resp = http.get(&url).send().await.unwrap();
    let mut got = Vec::new();
    let mut cut = false;
    loop {
        match resp.chunk().await {
            Ok(Some(chunk)) => got.extend_from_slice(&chunk),
            Ok(None) => break,
            Err(_) => {
                cut = true;
                break;
            }
        }
    }
    assert!(cut);
    assert_eq!(got.len() as u64, half);
    let rest = http
        .get(&url)
        .header("Range", format!("bytes={half}-"))
        .send()
        .await
        .unwrap();
    assert_eq!(rest.status().as_u16(), 206);
    got.extend_from_slice(&rest.bytes().await.unwrap());
    assert_eq!(sha256_digest(&got), layer.digest);
    assert_eq!(
        proxy.bytes_served(&layer.digest),
        layer.size,
        "nothing moved twice"
    );
    assert_eq!(proxy.blob_requests(&layer.digest).len(), 2);
}

/// A body made longer than the blob: the blob's bytes, then the extra bytes, with no
/// Content-Length; ranged answers too; used up after the times given.
#[tokio::test]
async fn append_after_body_sends_bytes_past_the_end() {
    let s = Setup::new().await;
    let layer = s.layer().clone();
    s.proxy
        .faults()
        .append_after_body(Target::Blob(layer.digest.clone()), 100_000, Times::N(2));
    let resp = s.http.get(s.blob_url(&layer.digest)).send().await.unwrap();
    assert!(resp.content_length().is_none(), "no Content-Length");
    let body = resp.bytes().await.unwrap();
    assert_eq!(body.len() as u64, layer.size + 100_000);
    assert_eq!(sha256_digest(&body[..layer.size as usize]), layer.digest);
    assert!(body[layer.size as usize..].iter().all(|&b| b == 0xee));
    let (status, body) = s.get(&layer.digest, Some("bytes=10-19")).await.unwrap();
    assert_eq!((status, body.len()), (206, 10 + 100_000));
    let (_, body) = s.get(&layer.digest, None).await.unwrap();
    assert_eq!(body.len() as u64, layer.size, "used up");
    assert_eq!(
        s.proxy.bytes_served(&layer.digest),
        2 * layer.size + 10 + 200_000
    );
    let records = s.proxy.blob_requests(&layer.digest);
    assert!(records[0].faults.contains(&"overlong".to_string()));
}

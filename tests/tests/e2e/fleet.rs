//! Nodes pulling through a cluster's pull-through cache: the project's registry as the origin,
//! the byte-counting proxy in front of it, a cache in front of that, a second counting proxy in
//! front of the cache (what the nodes ask), and minicri daemons (the nodes) with their own roots,
//! reaching the origin's name through hosts.toml with the cache as the mirror.
//!
//! Two caches, because what reaches the origin is the cache's behaviour as much as the nodes':
//! - Debian's `docker-registry` (distribution 2.8) in proxy mode fetches a blob it does not have
//!   twice on a miss, one copy for the client and one to store, and does not merge concurrent
//!   misses; its tests assert what the nodes add on top of that (one request per blob and node)
//!   and print the origin's bytes for docs/fleet.md.
//! - Debian's nginx as a caching proxy ([`NginxCache`]) stores what it serves and makes
//!   concurrent misses wait for one fetch; through it a cold pull, by one node or by several at
//!   once, must cost the origin exactly one copy of the image.

use std::time::{Duration, Instant};

use minicri_tests::daemon::{Daemon, HostsDir};
use minicri_tests::images::{self, Compression, PushedImage};
use minicri_tests::nginx_cache::NginxCache;
use minicri_tests::proxy::Proxy;
use minicri_tests::pull_env::pull;
use minicri_tests::registry::Registry;

/// The origin's name in image references; hosts.toml sends it to the cache, then the origin.
const ORIGIN: &str = "origin.example";

/// The pull-through cache between the nodes and the origin.
enum Cache {
    /// distribution's registry in proxy mode.
    Distribution(Registry),
    /// nginx with `proxy_cache`.
    Nginx(NginxCache),
}

impl Cache {
    fn addr(&self) -> String {
        match self {
            Cache::Distribution(r) => r.addr(),
            Cache::Nginx(n) => n.addr(),
        }
    }

    /// Whether the cache has stored every blob of `img` in full.
    fn holds(&self, img: &PushedImage) -> bool {
        match self {
            Cache::Distribution(r) => img.blob_digests().iter().all(|d| r.blob_path(d).is_file()),
            Cache::Nginx(n) => n.stored_blobs() >= img.blob_digests().len(),
        }
    }
}

struct Fleet {
    origin: Registry,
    /// Counts what the origin serves.
    counting: Proxy,
    cache: Cache,
    /// Counts what the nodes ask of the cache.
    edge: Proxy,
    hosts: HostsDir,
}

impl Fleet {
    /// A fleet behind distribution's proxy mode.
    fn new() -> Fleet {
        Self::with_cache(|origin| Cache::Distribution(Registry::start_cache_of(origin)))
    }

    /// A fleet behind a caching nginx.
    fn behind_nginx() -> Fleet {
        Self::with_cache(|origin| Cache::Nginx(NginxCache::start_of(origin)))
    }

    fn with_cache(start: impl FnOnce(&str) -> Cache) -> Fleet {
        let origin = Registry::start();
        let counting = Proxy::start(&origin.addr()).expect("proxy");
        let cache = start(&counting.url());
        let edge = Proxy::start(&cache.addr()).expect("proxy");
        let hosts = HostsDir::new();
        hosts.set(
            ORIGIN,
            &format!(
                "server = \"{}\"\n[host.\"{}\"]\n  capabilities = [\"pull\", \"resolve\"]\n",
                counting.url(),
                edge.url()
            ),
        );
        Fleet {
            origin,
            counting,
            cache,
            edge,
            hosts,
        }
    }

    async fn node(&self) -> Daemon {
        self.node_with(&[]).await
    }

    async fn node_with(&self, args: &[&str]) -> Daemon {
        Daemon::start_with(self.hosts.path(), args).await.unwrap()
    }

    /// Pushes an image of `layers` incompressible layers of `mib` MiB to the origin; its
    /// reference by the origin's name.
    async fn push(&self, name: &str, layers: u64, mib: u64) -> (PushedImage, String) {
        let client = images::RegistryClient::new(&self.origin.addr());
        let img = images::push_big_image(
            &client,
            &format!("minicri-test/{name}:latest"),
            layers,
            mib,
            Compression::None,
            21,
        )
        .await
        .unwrap();
        (img, format!("{ORIGIN}/minicri-test/{name}:latest"))
    }

    /// Asserts that the nodes asked the cache for each blob of `img` `times` times in all
    /// (GETs: one per node that pulled).
    fn asked_each_blob(&self, img: &PushedImage, times: usize) {
        for d in img.blob_digests() {
            let gets: Vec<_> = self
                .edge
                .blob_requests(&d)
                .into_iter()
                .filter(|q| q.method == "GET")
                .collect();
            assert_eq!(gets.len(), times, "{d}: {gets:?}");
        }
    }

    /// The nodes' GETs for the blobs of `img` and how many of them asked for a range and were
    /// answered 206.
    fn gets(&self, img: &PushedImage) -> (usize, usize) {
        let gets: Vec<_> = img
            .blob_digests()
            .iter()
            .flat_map(|d| self.edge.blob_requests(d))
            .filter(|q| q.method == "GET")
            .collect();
        let ranged = gets
            .iter()
            .filter(|q| q.range.is_some() && q.status == 206)
            .count();
        (gets.len(), ranged)
    }

    /// Waits until the cache has stored every blob of `img` (distribution stores in the
    /// background after serving).
    async fn cached(&self, img: &PushedImage) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.cache.holds(img) {
            assert!(Instant::now() < deadline, "the cache never stored {img:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn blob_bytes(img: &PushedImage) -> u64 {
    img.config_size + img.layers.iter().map(|l| l.size).sum::<u64>()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_second_node_pulls_from_the_cache_at_no_cost_to_the_origin() {
    let fleet = Fleet::new();
    let (img, r) = fleet.push("fleet", 2, 16).await;
    let size = blob_bytes(&img);
    let (a, b) = (fleet.node().await, fleet.node().await);

    assert_eq!(pull(&a, &r, None).await.unwrap(), img.config_digest);
    fleet.cached(&img).await;
    let first = fleet.counting.total_blob_bytes();
    eprintln!(
        "first node, cold cache: the origin served {:.2}x the image's blobs ({first} of {size} bytes)",
        first as f64 / size as f64
    );
    // The node asked the cache for each blob once; what that cost the origin (every blob at
    // least once) is the cache's doing.
    fleet.asked_each_blob(&img, 1);
    assert!(first >= size, "{first} < {size}");

    assert_eq!(pull(&b, &r, None).await.unwrap(), img.config_digest);
    fleet.asked_each_blob(&img, 2);
    assert_eq!(
        fleet.counting.total_blob_bytes(),
        first,
        "the second node's pull cost the origin blob bytes"
    );
    eprintln!("second node, warm cache: the origin served 0 blob bytes");
}

#[tokio::test(flavor = "multi_thread")]
async fn nodes_pulling_at_once_through_a_cold_cache() {
    let fleet = Fleet::new();
    let (img, r) = fleet.push("fleet-burst", 2, 16).await;
    let size = blob_bytes(&img);
    let nodes = [fleet.node().await, fleet.node().await, fleet.node().await];
    let pulls = nodes.iter().map(|n| pull(n, &r, None));
    for result in futures::future::join_all(pulls).await {
        assert_eq!(result.unwrap(), img.config_digest);
    }
    fleet.cached(&img).await;
    let served = fleet.counting.total_blob_bytes();
    eprintln!(
        "{} nodes at once, cold cache: the origin served {:.2}x the image's blobs ({served} of {size} bytes)",
        nodes.len(),
        served as f64 / size as f64
    );
    // Each node asked for each blob once; the origin's bytes (about one copy per node plus the
    // one the cache stores: it does not merge concurrent misses) are the cache's doing.
    fleet.asked_each_blob(&img, nodes.len());
    assert!(served >= size, "{served} < {size}");
}

/// Nodes fetching blobs in 8 MiB pieces, so that the 40 MiB layers below take ranged requests.
const PIECES: &[&str] = &["--blob-chunk-size", "8388608"];

/// Through a cache that stores what it serves, one node's cold pull costs the origin exactly one
/// copy of the image, ranged requests and all; the next node's pull costs the origin nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_cold_pull_through_a_cache_that_stores_what_it_serves_costs_the_origin_one_copy() {
    let fleet = Fleet::behind_nginx();
    let (img, r) = fleet.push("fleet-once", 2, 40).await;
    let size = blob_bytes(&img);
    let (a, b) = (fleet.node_with(PIECES).await, fleet.node_with(PIECES).await);

    assert_eq!(pull(&a, &r, None).await.unwrap(), img.config_digest);
    fleet.cached(&img).await;
    let first = fleet.counting.total_blob_bytes();
    let (gets, ranged) = fleet.gets(&img);
    eprintln!(
        "nginx cache, first node, cold: {gets} GETs for {} blobs, {ranged} of them ranges answered 206; the origin served {:.2}x the image's blobs ({first} of {size} bytes)",
        img.blob_digests().len(),
        first as f64 / size as f64
    );
    assert!(
        ranged > img.blob_digests().len(),
        "the node took its large blobs in pieces: {gets} GETs, {ranged} ranged"
    );
    assert_eq!(first, size, "one copy of the image from the origin");

    fleet.edge.reset_stats();
    assert_eq!(pull(&b, &r, None).await.unwrap(), img.config_digest);
    let (gets, ranged) = fleet.gets(&img);
    eprintln!("nginx cache, second node, warm: {gets} GETs, {ranged} ranges answered 206");
    assert_eq!(
        fleet.counting.total_blob_bytes(),
        first,
        "the second node's pull cost the origin blob bytes"
    );
}

/// Nodes starting one image at once through a cache that makes concurrent misses wait for one
/// fetch: the whole burst costs the origin one copy of the image.
#[tokio::test(flavor = "multi_thread")]
async fn nodes_pulling_at_once_through_a_cache_that_merges_misses_cost_the_origin_one_copy() {
    let fleet = Fleet::behind_nginx();
    let (img, r) = fleet.push("fleet-burst-once", 2, 40).await;
    let size = blob_bytes(&img);
    let nodes = [
        fleet.node_with(PIECES).await,
        fleet.node_with(PIECES).await,
        fleet.node_with(PIECES).await,
    ];
    let pulls = nodes.iter().map(|n| pull(n, &r, None));
    for result in futures::future::join_all(pulls).await {
        assert_eq!(result.unwrap(), img.config_digest);
    }
    fleet.cached(&img).await;
    let served = fleet.counting.total_blob_bytes();
    let (gets, ranged) = fleet.gets(&img);
    eprintln!(
        "nginx cache, {} nodes at once, cold: {gets} GETs, {ranged} ranges answered 206; the origin served {:.2}x the image's blobs ({served} of {size} bytes)",
        nodes.len(),
        served as f64 / size as f64
    );
    assert_eq!(served, size, "one copy of the image from the origin");
}

/// What one pull of a large blob through the cache asked and cost: the requests for the blob
/// (range asked, status), the origin's blob bytes; then the same for a second node, warm cache.
struct RangedRun {
    cold: Vec<(Option<String>, u16)>,
    cold_origin: u64,
    warm: Vec<(Option<String>, u16)>,
    warm_origin: u64,
}

async fn ranged_run(args: &[&str]) -> RangedRun {
    let fleet = Fleet::new();
    let (img, r) = fleet.push("fleet-ranged", 1, 48).await;
    let big = img.layers.last().unwrap().digest.clone();
    let asked = |fleet: &Fleet| -> Vec<(Option<String>, u16)> {
        let mut v: Vec<_> = fleet
            .edge
            .blob_requests(&big)
            .into_iter()
            .map(|q| (q.range, q.status))
            .collect();
        v.sort();
        v
    };
    let node = Daemon::start_with(fleet.hosts.path(), args).await.unwrap();
    assert_eq!(pull(&node, &r, None).await.unwrap(), img.config_digest);
    fleet.cached(&img).await;
    let cold = asked(&fleet);
    let cold_origin = fleet.counting.total_blob_bytes();
    fleet.edge.reset_stats();
    let second = Daemon::start_with(fleet.hosts.path(), args).await.unwrap();
    assert_eq!(pull(&second, &r, None).await.unwrap(), img.config_digest);
    let run = RangedRun {
        cold,
        cold_origin,
        warm: asked(&fleet),
        warm_origin: fleet.counting.total_blob_bytes() - cold_origin,
    };
    let size = blob_bytes(&img);
    eprintln!(
        "{args:?}: cold cache {:?}, the origin served {:.2}x the image ({} of {size} bytes); warm cache {:?}, the origin served {} more",
        run.cold,
        run.cold_origin as f64 / size as f64,
        run.cold_origin,
        run.warm,
        run.warm_origin
    );
    run
}

/// A blob fetched over ranged requests (8 MiB pieces here, 4 at once) costs a fleet behind the
/// cache no more than one stream: on a miss the cache answers the first range with the whole
/// blob (200), and the node takes that one stream; once the cache holds the blob it answers
/// ranges (206), and the next node fetches the pieces at once from the cache alone.
#[tokio::test(flavor = "multi_thread")]
async fn ranged_requests_cost_a_cold_cache_no_more_than_one_stream_and_use_a_warm_one() {
    let ranged = ranged_run(&["--blob-chunk-size", "8388608"]).await;
    let single = ranged_run(&["--blob-connections", "1"]).await;
    assert_eq!(
        ranged.cold.len(),
        1,
        "one request on a miss: {:?}",
        ranged.cold
    );
    assert_eq!(
        ranged.cold[0].1, 200,
        "the cache sent the whole blob on a miss"
    );
    assert_eq!(
        ranged.cold_origin, single.cold_origin,
        "ranged requests cost the origin what one stream does"
    );
    assert!(
        ranged.warm.len() > 1,
        "pieces from the warm cache: {:?}",
        ranged.warm
    );
    assert!(
        ranged
            .warm
            .iter()
            .all(|(range, status)| range.is_some() && *status == 206)
    );
    assert_eq!(single.warm.len(), 1);
    assert_eq!((ranged.warm_origin, single.warm_origin), (0, 0));
}

/// A containerd `certs.d` directory that uses every key containerd documents for a host, across
/// two registries, pulled through unchanged:
/// - `path.example` reaches a mirror that serves the API under `/mirror/api` (`override_path`)
///   and wants its own key in a header (`header`), with a `dial_timeout`; the registry's own
///   server is down;
/// - `mtls.example`'s server is a pull-through cache serving https only to clients with a
///   certificate of its CA: `ca` and `client` as paths relative to the hosts.toml, top-level
///   `capabilities` and `skip_verify = false`.
///
/// Each mirror refuses what lacks its setting: without the header, the mirror answers 403 and the
/// pull is refused; without the client certificate the TLS handshake fails; without `ca` the
/// server's certificate is refused, and `skip_verify = true` accepts it.
#[tokio::test(flavor = "multi_thread")]
async fn a_containerd_certs_d_using_every_host_key_works_unchanged() {
    use minicri_tests::pki::TestPki;

    let origin = Registry::start();
    let client = images::RegistryClient::new(&origin.addr());
    let push = |name: &'static str, seed: u64| {
        let client = &client;
        async move {
            images::push_big_image(
                client,
                &format!("minicri-test/{name}:latest"),
                2,
                1,
                Compression::Gzip,
                seed,
            )
            .await
            .unwrap()
        }
    };
    let by_path = push("by-path", 31).await;
    let by_mtls = push("by-mtls", 32).await;

    // The header-and-path mirror, in front of the origin.
    let mirror = Proxy::start(&origin.addr()).expect("proxy");
    mirror.faults().serve_under("/mirror/api");
    mirror.faults().require_header("x-fleet-key", "k1");
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let hosts = HostsDir::new();
    let path_file = |header: &str| {
        format!(
            "server = \"http://{dead}\"\n\
             [host.\"http://{}/mirror/api\"]\n  capabilities = [\"pull\", \"resolve\"]\n  \
             override_path = true\n  dial_timeout = \"5s\"\n{header}",
            mirror.addr()
        )
    };
    let mirror_host = format!("host.\"http://{}/mirror/api\"", mirror.addr());
    hosts.set(
        "path.example",
        &path_file(&format!(
            "  [{mirror_host}.header]\n    X-Fleet-Key = \"k1\"\n"
        )),
    );

    // The mutual-TLS cache, its PKI beside its hosts.toml.
    let mtls_dir = hosts.path().join("mtls.example");
    std::fs::create_dir_all(&mtls_dir).unwrap();
    let pki = TestPki::create(&mtls_dir).unwrap();
    let cache = Registry::start_mutual_tls_cache_of(&origin.url(), &pki);
    let mtls_with = |trust: &str, client: &str| {
        format!(
            "server = \"https://{}\"\ncapabilities = [\"pull\", \"resolve\"]\n{trust}{client}",
            cache.addr()
        )
    };
    let mtls_file = |client: &str| mtls_with("skip_verify = false\nca = \"ca.pem\"\n", client);
    let client_pair = "client = [[\"client.pem\", \"client.key\"]]\n";
    hosts.set("mtls.example", &mtls_file(client_pair));

    let node = Daemon::start_with(hosts.path(), &[]).await.unwrap();
    assert_eq!(
        pull(&node, "path.example/minicri-test/by-path:latest", None)
            .await
            .unwrap(),
        by_path.config_digest
    );
    let asked = mirror.requests();
    assert!(!asked.is_empty());
    for q in &asked {
        assert!(q.faults.is_empty(), "refused or outside the root: {q:?}");
        assert!(q.path.starts_with("/mirror/api/"), "{q:?}");
    }
    assert_eq!(
        pull(&node, "mtls.example/minicri-test/by-mtls:latest", None)
            .await
            .unwrap(),
        by_mtls.config_digest
    );

    // Without the header, the mirror refuses and so does the pull; without the client
    // certificate, the cache's handshake fails.
    hosts.set("path.example", &path_file(""));
    hosts.set("mtls.example", &mtls_file(""));
    let fresh = Daemon::start_with(hosts.path(), &[]).await.unwrap();
    let err = pull(&fresh, "path.example/minicri-test/by-path:latest", None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated, "{err:?}");
    assert!(err.message().contains("403"), "{err:?}");
    assert!(
        mirror
            .requests()
            .iter()
            .any(|q| q.faults.iter().any(|f| f == "missing-header"))
    );
    let err = pull(&fresh, "mtls.example/minicri-test/by-mtls:latest", None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert!(err.message().contains("client certificate"), "{err:?}");

    // The server's certificate: without `ca` it is refused, unless `skip_verify` says not to
    // check it.
    hosts.set("mtls.example", &mtls_with("", client_pair));
    let err = pull(&fresh, "mtls.example/minicri-test/by-mtls:latest", None)
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
    assert!(
        err.message().contains("invalid peer certificate"),
        "{err:?}"
    );
    hosts.set(
        "mtls.example",
        &mtls_with("skip_verify = true\n", client_pair),
    );
    assert_eq!(
        pull(&fresh, "mtls.example/minicri-test/by-mtls:latest", None)
            .await
            .unwrap(),
        by_mtls.config_digest
    );
}

//! Black-box tests of where a registry can send the daemon (minicri issue 31; docs/hardening.md
//! "Where requests go"): a registry elsewhere on the network cannot make the daemon request the
//! node's own services through a redirect or a token realm, while a registry named on loopback
//! and a loopback mirror in hosts.toml keep working; and what a registry's error body puts in
//! PullImage's status (so in the pod's events) is a short one-line excerpt.
//!
//! "Elsewhere" is the fault proxy in front of the real test registry, serving https with the test
//! PKI from a network namespace ([`FarHost`]): an address that is neither loopback nor the
//! node's. Its redirects and challenges point at a [`Tripwire`], a listener on every address of
//! the node that counts the connections it accepts: a refused request leaves it at zero.
//! Each test takes about 2 s (a registry, a daemon, a namespace).

use std::time::Duration;

use minicri_tests::daemon::{Daemon, HostsDir};
use minicri_tests::far_host::FarHost;
use minicri_tests::images::{self, Compression, ImageBuilder, LayerBuilder};
use minicri_tests::pki::TestPki;
use minicri_tests::prereq::skip_unless_root;
use minicri_tests::proxy::{Proxy, Target, Times};
use minicri_tests::pull_env::pull;
use minicri_tests::registry::Registry;
use minicri_tests::tripwire::Tripwire;
use tonic::Code;

/// Pushes a one-file image `minicri-test/<name>:latest` to `registry`.
async fn push_small(registry: &Registry, name: &str) {
    let layer = LayerBuilder::new()
        .file("hello", format!("{name}\n"), 0o644)
        .build(Compression::Gzip)
        .unwrap();
    ImageBuilder::new()
        .layer(layer)
        .push(
            &images::RegistryClient::new(&registry.addr()),
            &format!("minicri-test/{name}:latest"),
        )
        .await
        .unwrap();
}

/// A registry elsewhere: the test registry behind the proxy, which serves https on the far
/// address of a network namespace; the daemon trusts the test PKI's CA for it through
/// hosts.toml.
struct Elsewhere {
    daemon: Daemon,
    hosts: HostsDir,
    proxy: Proxy,
    registry: Registry,
    pki: TestPki,
    _pki_dir: tempfile::TempDir,
    far: FarHost,
}

impl Elsewhere {
    async fn start() -> Elsewhere {
        let far = FarHost::create().unwrap();
        let registry = Registry::start();
        let pki_dir = tempfile::tempdir().unwrap();
        let pki = TestPki::create_for(pki_dir.path(), &[far.far_ip().into()]).unwrap();
        let proxy = Proxy::start_on(&registry.addr(), far.listen(0).unwrap(), Some(&pki)).unwrap();
        let hosts = HostsDir::new();
        hosts.set(
            &proxy.addr(),
            &format!("ca = {:?}\n", pki.ca.display().to_string()),
        );
        let daemon = Daemon::start(hosts.path()).await.unwrap();
        Elsewhere {
            daemon,
            hosts,
            proxy,
            registry,
            pki,
            _pki_dir: pki_dir,
            far,
        }
    }

    /// `<far address>:<port>/minicri-test/<name>:latest`, through the proxy.
    fn image(&self, name: &str) -> String {
        format!("{}/minicri-test/{name}:latest", self.proxy.addr())
    }
}

/// Where on the node a registry may try to send the daemon: every form of the tripwire's
/// address (a name that resolves to loopback, the unspecified address, IPv4-mapped IPv6, the
/// near end's address, which is one of the node's own interfaces).
fn node_targets(wire: &Tripwire, near: std::net::Ipv4Addr) -> Vec<String> {
    let p = wire.port();
    vec![
        format!("http://127.0.0.1:{p}"),
        format!("https://127.0.0.1:{p}"),
        format!("https://localhost:{p}"),
        format!("https://[::1]:{p}"),
        format!("https://0.0.0.0:{p}"),
        format!("https://[::ffff:127.0.0.1]:{p}"),
        format!("https://{near}:{p}"),
        format!("http://{near}:{p}"),
    ]
}

async fn pull_fails(daemon: &Daemon, image: &str) -> tonic::Status {
    tokio::time::timeout(Duration::from_secs(60), pull(daemon, image, None))
        .await
        .expect("PullImage returns within 60 s")
        .expect_err("the pull is refused")
}

#[tokio::test(flavor = "multi_thread")]
async fn a_registry_elsewhere_cannot_redirect_the_daemon_to_the_node() {
    if skip_unless_root() {
        return;
    }
    let e = Elsewhere::start().await;
    let wire = Tripwire::start();
    push_small(&e.registry, "redirected").await;
    let image = e.image("redirected");
    let faults = e.proxy.faults();

    // A blob (the config, the first one fetched) redirected to loopback over plain http: what
    // the https-to-http rule let through before.
    faults.redirect(
        Target::AnyBlob,
        &format!("http://127.0.0.1:{}", wire.port()),
        Times::Always,
    );
    let err = pull_fails(&e.daemon, &image).await;
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let msg = err.message();
    assert!(
        msg.contains(&format!(
            "refusing the redirect to http://127.0.0.1:{}/v2/",
            wire.port()
        )),
        "{msg}"
    );
    assert!(msg.contains("127.0.0.1 is a loopback address"), "{msg}");
    assert!(msg.contains("hosts.toml"), "{msg}");

    // The manifest redirected to every form of an address on the node, and to a cloud's
    // metadata service.
    let mut targets = node_targets(&wire, e.far.near_ip());
    targets.push("http://169.254.169.254".into());
    for target in &targets {
        faults.clear();
        faults.redirect(Target::Manifests, target, Times::Always);
        let err = pull_fails(&e.daemon, &image).await;
        assert_eq!(err.code(), Code::FailedPrecondition, "{target}: {err:?}");
        let msg = err.message();
        assert!(msg.contains("refusing"), "{target}: {msg}");
        assert!(
            ["loopback", "unspecified", "link-local", "node's own"]
                .iter()
                .any(|class| msg.contains(class))
                || msg.contains("from https to http"),
            "{target}: {msg}"
        );
    }
    assert_eq!(wire.hits(), 0, "a request reached the node");

    // The positive control: without the redirect the same pull goes through.
    faults.clear();
    pull(&e.daemon, &image, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_registry_elsewhere_cannot_send_the_daemon_to_a_token_realm_on_the_node() {
    if skip_unless_root() {
        return;
    }
    let e = Elsewhere::start().await;
    let wire = Tripwire::start();
    push_small(&e.registry, "challenged").await;
    let image = e.image("challenged");
    let faults = e.proxy.faults();
    for target in node_targets(&wire, e.far.near_ip()) {
        let realm = format!("{target}/token");
        let challenge = format!(r#"Bearer realm="{realm}",service="minicri-test""#);
        faults.clear();
        faults.answer(
            Target::Any,
            401,
            &[("www-authenticate", challenge.as_str())],
            r#"{"errors":[{"code":"UNAUTHORIZED","message":"token wanted"}]}"#,
            Times::Always,
        );
        let err = pull_fails(&e.daemon, &image).await;
        assert_eq!(err.code(), Code::FailedPrecondition, "{realm}: {err:?}");
        let msg = err.message();
        assert!(msg.contains("refusing the token realm"), "{realm}: {msg}");
    }
    assert_eq!(wire.hits(), 0, "a request reached the node");
    faults.clear();
    pull(&e.daemon, &image, None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_loopback_mirror_in_hosts_toml_keeps_working() {
    if skip_unless_root() {
        return;
    }
    let e = Elsewhere::start().await;
    push_small(&e.registry, "mirrored").await;
    push_small(&e.registry, "handed-over").await;
    let ca = format!("ca = {:?}\n", e.pki.ca.display().to_string());
    let mirror = e.registry.url();

    // The mirror on loopback serves the whole pull: the registry elsewhere is not asked.
    e.hosts.set(
        &e.proxy.addr(),
        &format!("{ca}[host.\"{mirror}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"),
    );
    pull(&e.daemon, &e.image("mirrored"), None).await.unwrap();
    assert!(e.proxy.requests().is_empty(), "{:?}", e.proxy.requests());

    // The mirror resolves tags only; the registry elsewhere serves blobs by redirecting them to
    // the mirror: a configured host and port, so followed, even from https to plain http.
    e.hosts.set(
        &e.proxy.addr(),
        &format!("{ca}[host.\"{mirror}\"]\n  capabilities = [\"resolve\"]\n"),
    );
    e.proxy
        .faults()
        .redirect(Target::AnyBlob, &mirror, Times::Always);
    pull(&e.daemon, &e.image("handed-over"), None)
        .await
        .unwrap();
    let redirected = e
        .proxy
        .requests()
        .iter()
        .filter(|r| r.faults.iter().any(|f| f == "redirect"))
        .count();
    assert!(redirected >= 2, "{:?}", e.proxy.requests());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_registry_named_on_loopback_may_redirect_to_its_own_host() {
    // The usual node-local registry: named by its loopback IP, it redirects blobs to another
    // port of that host (here the registry itself, behind the proxy).
    let registry = Registry::start();
    push_small(&registry, "local").await;
    let proxy = Proxy::start(&registry.addr()).unwrap();
    proxy
        .faults()
        .redirect(Target::AnyBlob, &registry.url(), Times::Always);
    let hosts = HostsDir::new();
    let daemon = Daemon::start(hosts.path()).await.unwrap();
    pull(
        &daemon,
        &format!("{}/minicri-test/local:latest", proxy.addr()),
        None,
    )
    .await
    .unwrap();
    assert!(
        proxy
            .requests()
            .iter()
            .any(|r| r.faults.iter().any(|f| f == "redirect")),
        "{:?}",
        proxy.requests()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hostile_error_body_reaches_the_status_as_a_short_line() {
    let registry = Registry::start();
    let proxy = Proxy::start(&registry.addr()).unwrap();
    let hosts = HostsDir::new();
    let daemon = Daemon::start(hosts.path()).await.unwrap();
    let image = format!("{}/minicri-test/none:latest", proxy.addr());

    // 64 KiB of what a service could answer: lines, escape sequences, a bidirectional override,
    // and a marker past the excerpt that must reach only the daemon's log.
    let mut body = String::from("secret-line-1\r\n\x1b[2J\x1b[31mred\u{202e}txt.exe\n");
    body.push_str(&"x".repeat(300));
    body.push_str("MARKER-IN-LOG-ONLY");
    body.push_str(&"y".repeat(64 << 10));
    proxy
        .faults()
        .answer(Target::Manifests, 500, &[], body, Times::Always);
    let err = pull_fails(&daemon, &image).await;
    let msg = err.message();
    assert!(
        msg.contains("500 Internal Server Error: secret-line-1 [2J [31mred txt.exe xxx"),
        "{msg}"
    );
    assert!(!msg.chars().any(char::is_control), "{msg:?}");
    assert!(!msg.contains('\u{202e}'), "{msg:?}");
    assert!(!msg.contains("MARKER-IN-LOG-ONLY"), "{msg}");
    let quoted = msg.split("Internal Server Error: ").nth(1).unwrap();
    let quoted = quoted.split("… (cut)").next().unwrap();
    assert_eq!(quoted.chars().count(), 200, "{quoted}");
    assert!(msg.len() < 600, "{} bytes: {msg}", msg.len());
    // The body, escaped, is in the daemon's log at debug level.
    assert!(daemon.log().contains("MARKER-IN-LOG-ONLY"), "not logged");

    // A distribution error body is quoted by code and message.
    proxy.faults().clear();
    proxy.faults().answer(
        Target::Manifests,
        503,
        &[("content-type", "application/json")],
        r#"{"errors":[{"code":"UNAVAILABLE","message":"back\nsoon","detail":{"trace":"deep inside"}}]}"#,
        Times::Always,
    );
    let err = pull_fails(&daemon, &image).await;
    assert!(
        err.message()
            .contains("503 Service Unavailable: UNAVAILABLE back soon"),
        "{err:?}"
    );
    assert!(!err.message().contains("deep inside"), "{err:?}");
}

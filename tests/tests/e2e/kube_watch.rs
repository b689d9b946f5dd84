//! The API-server watch of a real daemon, with the test API server (tests/src/apiserver.rs):
//! how it finds the kubelet's kubeconfig and node name, how it follows the kubelet's
//! certificate rotation, and how it says whether it is connected (log, metrics, verbose
//! Status). Needs neither root nor runc.

use std::time::{Duration, Instant};

use minicri_proto::runtime::v1 as cri;
use minicri_tests::apiserver::{ApiServer, ApiServerOptions, KubeUser, fingerprint_pem};
use minicri_tests::daemon::{Daemon, HostsDir};
use minicri_tests::pki::{TestPki, node_client_pem};
use minicri_tests::pull_env::{free_metrics_address, sample, scrape, wait_until};

/// Writes the kubelet's client credentials as the kubelet keeps them after bootstrap (and after
/// each rotation): certificate and key in a new file `kubelet-client-<n>.pem`, the symlink
/// `kubelet-client-current.pem` moved to it. Returns the symlink and the certificate's
/// fingerprint.
fn kubelet_pem(
    dir: &std::path::Path,
    pki: &TestPki,
    node: &str,
    n: u32,
) -> (std::path::PathBuf, String) {
    let (cert, key) = node_client_pem(pki, &format!("system:node:{node}")).unwrap();
    let file = dir.join(format!("kubelet-client-{n}.pem"));
    std::fs::write(&file, format!("{cert}{key}")).unwrap();
    let current = dir.join("kubelet-client-current.pem");
    let next = dir.join("kubelet-client-next.pem");
    let _ = std::fs::remove_file(&next);
    std::os::unix::fs::symlink(&file, &next).unwrap();
    std::fs::rename(&next, &current).unwrap();
    (current, fingerprint_pem(&cert).unwrap())
}

/// The `kubeWatch` entry of verbose Status.
async fn watch_status(daemon: &Daemon) -> serde_json::Value {
    let mut rt = daemon.runtime().await.unwrap();
    let info = rt
        .status(cri::StatusRequest { verbose: true })
        .await
        .unwrap()
        .into_inner()
        .info;
    serde_json::from_str(&info["kubeWatch"]).unwrap()
}

/// Waits until the daemon's log has `needle` (at most `within`).
async fn logged(daemon: &Daemon, needle: &str, within: Duration) {
    wait_until(&format!("the log to say {needle:?}"), within, || {
        daemon.log().contains(needle)
    })
    .await;
}

/// Whether the API server answered a list of `node`'s pods.
fn listed(api: &ApiServer, node: &str) -> bool {
    let selector = format!("fieldSelector=spec.nodeName%3D{node}");
    api.requests()
        .iter()
        .any(|r| !r.watch && r.status == 200 && r.query.contains(&selector))
}

#[tokio::test]
async fn the_watch_starts_when_the_kubelets_kubeconfig_appears_for_the_certificates_node() {
    let api = ApiServer::start().unwrap();
    let hosts = HostsDir::new();
    let daemon = Daemon::start(hosts.path()).await.unwrap();
    // Nothing where the kubeconfig is looked for: the daemon runs without the watch, and says so.
    wait_until(
        "the daemon to say it runs without the watch",
        Duration::from_secs(10),
        || {
            daemon
                .log()
                .contains("no kubeconfig found: running without the API-server watch")
        },
    )
    .await;
    assert_eq!(api.requests(), vec![]);

    // The kubelet bootstraps: its kubeconfig appears, naming its client certificate.
    let pki_dir = tempfile::tempdir().unwrap();
    let pki = TestPki::create(pki_dir.path()).unwrap();
    let (pem, _) = kubelet_pem(pki_dir.path(), &pki, "node-7", 1);
    api.write_kubeconfig_at(
        &daemon.kubeconfig_search_path(),
        &KubeUser::ClientCert {
            cert: pem.clone(),
            key: pem,
        },
    )
    .unwrap();
    // Looked for every 10 s: the node's pods are listed within that (and some slack).
    wait_until("a list of node-7's pods", Duration::from_secs(20), || {
        listed(&api, "node-7")
    })
    .await;
    let log = daemon.log();
    assert!(
        log.contains("pod watcher: found the kubelet's kubeconfig"),
        "{log}"
    );
    assert!(
        !api.requests().iter().any(|r| !r.query.contains("node-7")),
        "only node-7's pods: {:#?}",
        api.requests()
    );
}

#[tokio::test]
async fn a_rotated_client_certificate_is_taken_up_without_missing_a_deletion() {
    let pki_dir = tempfile::tempdir().unwrap();
    let pki = TestPki::create(pki_dir.path()).unwrap();
    let api = ApiServer::start_with(ApiServerOptions {
        tls: Some(pki.clone()),
        ..Default::default()
    })
    .unwrap();
    api.add_pod("ns", "a", "uid-a", "node-1");
    api.add_pod("ns", "b", "uid-b", "node-1");
    let kubelet = pki_dir.path().join("kubelet");
    std::fs::create_dir(&kubelet).unwrap();
    let (pem, first) = kubelet_pem(&kubelet, &pki, "node-1", 1);
    let kubeconfig = pki_dir.path().join("kubelet.conf");
    api.write_kubeconfig_at(
        &kubeconfig,
        &KubeUser::ClientCert {
            cert: pem.clone(),
            key: pem,
        },
    )
    .unwrap();
    let metrics = free_metrics_address();
    let hosts = HostsDir::new();
    let kubeconfig_arg = kubeconfig.to_string_lossy().into_owned();
    let daemon = Daemon::start_with(
        hosts.path(),
        &[
            "--kube-watch-kubeconfig",
            &kubeconfig_arg,
            "--metrics-address",
            &metrics,
        ],
    )
    .await
    .unwrap();
    let watching_with = |cert: &str| {
        api.requests()
            .iter()
            .any(|r| r.watch && r.status == 200 && r.client_cert.as_deref() == Some(cert))
    };
    wait_until(
        "a watch with the first certificate",
        Duration::from_secs(10),
        || watching_with(&first),
    )
    .await;
    // Connected and synced, for the node the certificate names; said in the log, the metrics and
    // verbose Status.
    logged(
        &daemon,
        "pod watcher: connected to the API server",
        Duration::from_secs(5),
    )
    .await;
    let m = scrape(&metrics).await;
    assert_eq!(sample(&m, "minicri_kube_watch_connected"), 1, "{m}");
    assert_eq!(sample(&m, "minicri_kube_watch_synced"), 1, "{m}");
    assert_eq!(sample(&m, "minicri_kube_watch_pods"), 2, "{m}");
    assert_eq!(
        sample(&m, "minicri_kube_watch_credential_reloads_total"),
        0,
        "{m}"
    );
    let st = watch_status(&daemon).await;
    assert_eq!(st["state"], "connected", "{st}");
    assert_eq!(st["synced"], true, "{st}");
    assert_eq!(st["nodeName"], "node-1", "{st}");
    assert_eq!(st["kubeconfig"], kubeconfig_arg.as_str(), "{st}");
    assert!(st["lastError"].is_null(), "{st}");

    // The kubelet rotates its certificate: the watch reconnects with the new one within the
    // reload check (5 s) and some slack.
    let (_, second) = kubelet_pem(&kubelet, &pki, "node-1", 2);
    let rotated = Instant::now();
    wait_until(
        "a watch with the rotated certificate",
        Duration::from_secs(10),
        || watching_with(&second),
    )
    .await;
    eprintln!(
        "reconnected with the rotated certificate after {:?}",
        rotated.elapsed()
    );
    logged(
        &daemon,
        "the credentials changed; reconnecting with them",
        Duration::from_secs(1),
    )
    .await;
    assert_eq!(
        sample(
            &scrape(&metrics).await,
            "minicri_kube_watch_credential_reloads_total"
        ),
        1
    );
    // The old certificate is refused from now on: the watch goes on with the new one.
    api.revoke(&first);
    api.close_watches();
    api.mark_deleted("uid-a");
    logged(
        &daemon,
        "uid=uid-a cause=deletionTimestamp",
        Duration::from_secs(2),
    )
    .await;

    // An outage: connected no more, and the error said.
    api.stop();
    wait_until(
        "the watch to see the outage",
        Duration::from_secs(5),
        || {
            daemon
                .log()
                .contains("pod watcher: disconnected from the API server")
        },
    )
    .await;
    let m = scrape(&metrics).await;
    assert_eq!(sample(&m, "minicri_kube_watch_connected"), 0, "{m}");
    assert_eq!(sample(&m, "minicri_kube_watch_synced"), 0, "{m}");
    let st = watch_status(&daemon).await;
    assert_eq!(st["connected"], false, "{st}");
    assert!(st["lastError"]["message"].is_string(), "{st}");

    // Meanwhile the certificate rotates again, the old one is revoked, a pod is deleted and the
    // API server's history is lost: the watch comes back with the new certificate, relists and
    // sees the pod gone.
    let (_, third) = kubelet_pem(&kubelet, &pki, "node-1", 3);
    api.revoke(&second);
    assert!(api.remove_pod("uid-b"));
    api.compact();
    let outage_end = api.requests().len();
    api.restart().unwrap();
    logged(
        &daemon,
        "uid=uid-b cause=gone at resync",
        Duration::from_secs(35),
    )
    .await;
    let after: Vec<_> = api.requests()[outage_end..]
        .iter()
        .filter(|r| r.status == 200)
        .map(|r| r.client_cert.clone())
        .collect();
    assert!(
        !after.is_empty() && after.iter().all(|c| c.as_deref() == Some(third.as_str())),
        "{:#?}",
        api.requests()
    );
    wait_until("connected again", Duration::from_secs(5), || {
        daemon
            .log()
            .matches("pod watcher: connected to the API server")
            .count()
            >= 2
    })
    .await;
    let m = scrape(&metrics).await;
    assert_eq!(sample(&m, "minicri_kube_watch_connected"), 1, "{m}");
    assert_eq!(sample(&m, "minicri_kube_watch_synced"), 1, "{m}");
    // a (being deleted) is still in the API; b is gone.
    assert_eq!(sample(&m, "minicri_kube_watch_pods"), 1, "{m}");
}

//! The API-server watch of a real daemon, with the test API server (tests/src/apiserver.rs):
//! how it finds the kubelet's kubeconfig and node name. Needs neither root nor runc.

use std::time::Duration;

use minicri_tests::apiserver::{ApiServer, KubeUser};
use minicri_tests::daemon::{Daemon, HostsDir};
use minicri_tests::pki::{TestPki, node_client_pem};
use minicri_tests::pull_env::wait_until;

/// Writes the kubelet's client credentials as the kubelet keeps them after bootstrap: certificate
/// and key in one file behind `kubelet-client-current.pem`. Returns the symlink.
fn kubelet_pem(dir: &std::path::Path, pki: &TestPki, node: &str, n: u32) -> std::path::PathBuf {
    let (cert, key) = node_client_pem(pki, &format!("system:node:{node}")).unwrap();
    let file = dir.join(format!("kubelet-client-{n}.pem"));
    std::fs::write(&file, format!("{cert}{key}")).unwrap();
    let current = dir.join("kubelet-client-current.pem");
    let next = dir.join("kubelet-client-next.pem");
    let _ = std::fs::remove_file(&next);
    std::os::unix::fs::symlink(&file, &next).unwrap();
    std::fs::rename(&next, &current).unwrap();
    current
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
    let pem = kubelet_pem(pki_dir.path(), &pki, "node-7", 1);
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

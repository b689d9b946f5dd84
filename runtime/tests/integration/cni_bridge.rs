//! The CNI manager with Debian's real plugins (bridge, host-local, tuning, bandwidth) in pinned
//! network namespaces. Root only. Each test has its own conf dir, bridge, /28 inside
//! 10.199.0.0/16 and IPAM data dir, and no masquerading (no iptables), so tests run in parallel
//! and leave nothing behind (see `cni_common::TestNet`).

use crate::{cni_common, require_plugins};

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::time::Duration;

use cni_common::{TestNet, ip_in, link_exists, stdout};
use minicri::cni::{CniError, NetworkStatus};
use minicri::netns;
use serde_json::json;

fn in_subnet(ip: IpAddr, base: &str) -> bool {
    let (IpAddr::V4(ip), Ok(IpAddr::V4(base))) = (ip, base.parse::<IpAddr>()) else {
        return false;
    };
    u32::from(ip) & !0xf == u32::from(base)
}

/// The host end of the pod's veth, from the result (the interface without a sandbox that is not
/// the bridge).
fn host_veth(status: &NetworkStatus, bridge: &str) -> String {
    status
        .result
        .interfaces
        .iter()
        .find(|i| i.sandbox.is_empty() && i.name != bridge)
        .expect("a host veth in the result")
        .name
        .clone()
}

/// A TCP round trip from the host to `ip` inside `ns`: a listener bound inside the namespace,
/// a connection from the host namespace through the bridge.
fn reachable(ns: &std::path::Path, ip: IpAddr) -> bool {
    let listener = netns::run_in(ns, || TcpListener::bind("0.0.0.0:0"))
        .unwrap()
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.write_all(b"pong").unwrap();
    });
    let addr = SocketAddr::new(ip, port);
    let Ok(mut c) = TcpStream::connect_timeout(&addr, Duration::from_secs(3)) else {
        return false;
    };
    let mut buf = [0u8; 4];
    c.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let ok = c.read_exact(&mut buf).is_ok() && &buf == b"pong";
    server.join().unwrap();
    ok
}

#[tokio::test]
async fn add_gives_a_reachable_ip_and_del_releases_everything() {
    require_plugins!();
    let net = TestNet::new();
    net.write_conflist("10-bridge.conflist", vec![net.bridge_plugin()]);
    let m = net.system_manager();
    let pod = net.pod();

    let status = m.setup(&pod).await.unwrap();
    let ip = status.primary_ip().expect("a pod IP");
    assert!(
        in_subnet(ip, &net.subnet_base),
        "{ip} not in {}",
        net.subnet
    );
    assert!(status.additional_ips().is_empty());
    assert_eq!(net.allocated_ips(), [ip.to_string()]);

    // eth0 inside the namespace holds the address; lo is up.
    let addrs = ip_in(&pod.netns, &["-o", "addr", "show", "dev", "eth0"]);
    assert!(addrs.contains(&format!("inet {ip}/28")), "{addrs}");
    assert!(ip_in(&pod.netns, &["link", "show", "lo"]).contains("UP"));
    // Not on the host.
    assert!(!stdout("ip", &["-o", "addr", "show"]).contains(&format!("inet {ip}/")));
    let veth = host_veth(&status, &net.bridge);
    assert!(link_exists(&veth));

    assert!(
        reachable(&pod.netns, ip),
        "pod {ip} unreachable from the host"
    );
    m.check(&pod).await.unwrap();

    m.teardown(&pod).await.unwrap();
    assert!(net.allocated_ips().is_empty(), "IP released");
    assert!(!link_exists(&veth), "veth {veth} removed");
    assert!(ip_in(&pod.netns, &["-o", "link", "show", "eth0"]).contains("does not exist"));
    // Idempotent.
    m.teardown(&pod).await.unwrap();
    assert!(m.cached_status(&pod.id).is_none());
}

#[tokio::test]
async fn del_after_the_netns_is_gone_releases_the_ip() {
    require_plugins!();
    let net = TestNet::new();
    net.write_conflist("10-bridge.conflist", vec![net.bridge_plugin()]);
    let m = net.system_manager();
    let pod = net.pod();
    let status = m.setup(&pod).await.unwrap();
    let veth = host_veth(&status, &net.bridge);
    assert_eq!(net.allocated_ips().len(), 1);

    netns::remove(&pod.netns).unwrap();
    assert!(!netns::exists(&pod.netns));
    m.teardown(&pod).await.unwrap();
    assert!(net.allocated_ips().is_empty());
    // The veth dies with its peer's namespace (the kernel frees namespaces asynchronously).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while link_exists(&veth) {
        assert!(
            std::time::Instant::now() < deadline,
            "veth {veth} outlived its namespace"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    m.teardown(&pod).await.unwrap();
}

#[tokio::test]
async fn chained_plugins_see_prev_result_and_capabilities() {
    require_plugins!();
    let net = TestNet::new();
    let mac = "02:42:ac:11:00:99";
    net.write_conflist(
        "10-chain.conflist",
        vec![
            net.bridge_plugin(),
            // tuning only works chained: it needs prevResult to find eth0, and it reports the
            // MAC it set in its own result.
            json!({"type": "tuning", "mac": mac, "dataDir": net.tmp.path().join("tuning")}),
            json!({"type": "bandwidth", "capabilities": {"bandwidth": true}}),
        ],
    );
    let m = net.system_manager();
    let mut pod = net.pod();
    pod.annotations
        .insert("kubernetes.io/ingress-bandwidth".into(), "10M".into());

    let status = m.setup(&pod).await.unwrap();
    let eth0 = status
        .result
        .interfaces
        .iter()
        .find(|i| i.name == "eth0")
        .unwrap();
    assert_eq!(eth0.mac, mac, "tuning's change is in the final result");
    assert!(ip_in(&pod.netns, &["link", "show", "eth0"]).contains(mac));
    let ip = status.primary_ip().unwrap();
    assert!(in_subnet(ip, &net.subnet_base));

    // bandwidth got runtimeConfig.bandwidth: a token bucket on the host veth (ingress = traffic
    // towards the pod).
    let veth = host_veth(&status, &net.bridge);
    let qdisc = stdout("tc", &["qdisc", "show", "dev", &veth]);
    assert!(qdisc.contains("tbf"), "{qdisc}");
    assert!(reachable(&pod.netns, ip));
    m.check(&pod).await.unwrap();

    m.teardown(&pod).await.unwrap();
    assert!(net.allocated_ips().is_empty());
    assert!(!link_exists(&veth));
}

#[tokio::test]
async fn a_failed_add_is_rolled_back() {
    require_plugins!();
    let net = TestNet::new();
    net.write_conflist(
        "10-broken.conflist",
        vec![
            net.bridge_plugin(),
            json!({"type": "minicri-no-such-plugin"}),
        ],
    );
    let m = net.system_manager();
    let pod = net.pod();
    let err = m.setup(&pod).await.unwrap_err();
    assert!(matches!(err, CniError::PluginNotFound { .. }), "{err}");
    assert!(err.to_string().contains("minicri-no-such-plugin"));
    // bridge's ADD was undone: no address held, no eth0 left in the namespace, no cache.
    assert!(net.allocated_ips().is_empty());
    assert!(ip_in(&pod.netns, &["-o", "link", "show", "eth0"]).contains("does not exist"));
    assert!(!m.cache().path(&pod.id).exists());
}

#[tokio::test]
async fn a_real_plugin_error_is_reported_with_its_message() {
    require_plugins!();
    let net = TestNet::new();
    let mut bridge = net.bridge_plugin();
    bridge["ipam"]["ranges"] = json!([[{"subnet": "10.199.0.0/99"}]]);
    net.write_conflist("10-bad.conflist", vec![bridge]);
    let m = net.system_manager();
    let err = m.setup(&net.pod()).await.unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, CniError::Plugin { .. }), "{err:?}");
    assert!(text.starts_with("CNI plugin bridge ADD failed: "), "{text}");
    assert!(text.contains("10.199.0.0/99"), "{text}");
}

#[tokio::test]
async fn the_lexically_first_configuration_is_used() {
    require_plugins!();
    let net = TestNet::new();
    let other = TestNet::new();
    // 20-… would give an address from `other`'s subnet; 10-… wins.
    let mut second = other.bridge_plugin();
    second["bridge"] = json!(net.bridge);
    net.write_conflist("20-second.conflist", vec![second]);
    let first = net.write_conflist("10-first.conflist", vec![net.bridge_plugin()]);
    std::fs::write(net.conf_dir.join("00-broken.conf"), "{").unwrap();
    let m = net.system_manager();
    assert_eq!(m.network_ready().unwrap(), first);
    let pod = net.pod();
    let status = m.setup(&pod).await.unwrap();
    assert_eq!(status.config_source, Some(PathBuf::from(&first)));
    let ip = status.primary_ip().unwrap();
    assert!(
        in_subnet(ip, &net.subnet_base),
        "{ip} not from {}",
        net.subnet
    );
    m.teardown(&pod).await.unwrap();
}

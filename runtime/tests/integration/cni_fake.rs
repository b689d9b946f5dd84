//! The CNI manager against fake plugins (shell scripts that record their environment and stdin):
//! the execution protocol, chaining, capabilities, the cache, errors, time limits. No root needed.

use crate::cni_common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use cni_common::FakePlugins;
use minicri::cni::{CniError, CniManager, CniOptions, PodNetwork, PortMapping};
use serde_json::{Value, json};

struct World {
    tmp: tempfile::TempDir,
    conf: PathBuf,
    fake: FakePlugins,
}

impl World {
    fn new() -> World {
        let tmp = tempfile::tempdir().unwrap();
        let conf = tmp.path().join("net.d");
        std::fs::create_dir_all(&conf).unwrap();
        let fake = FakePlugins::new(tmp.path());
        World { tmp, conf, fake }
    }

    fn conflist(&self, file: &str, version: &str, plugins: Value) {
        let list = json!({"cniVersion": version, "name": "fakenet", "plugins": plugins});
        std::fs::write(self.conf.join(file), list.to_string()).unwrap();
    }

    fn manager(&self, timeout: Duration) -> CniManager {
        let mut opts = CniOptions::new(
            vec![self.conf.clone()],
            vec![self.tmp.path().join("nobin"), self.fake.bin.clone()],
            &self.tmp.path().join("state"),
        );
        opts.plugin_timeout = timeout;
        CniManager::new(opts)
    }

    fn pod(&self, netns: &str) -> PodNetwork {
        PodNetwork {
            id: "sandbox1".into(),
            netns: netns.into(),
            name: "web".into(),
            namespace: "prod".into(),
            uid: "u-42".into(),
            if_name: "eth0".into(),
            port_mappings: vec![PortMapping {
                host_port: 8080,
                container_port: 80,
                protocol: "tcp".into(),
                host_ip: String::new(),
            }],
            ..Default::default()
        }
    }
}

// A live namespace path that fake plugins never touch.
const NETNS: &str = "/proc/self/ns/net";

#[tokio::test]
async fn add_chains_prev_result_and_injects_declared_capabilities() {
    let w = World::new();
    w.fake.ok("fake-a", "10.9.0.5/24", "aa:00:00:00:00:01");
    w.fake.ok("fake-b", "10.9.0.6/24", "aa:00:00:00:00:02");
    w.conflist(
        "10.conflist",
        "1.0.0",
        json!([
            {"type": "fake-a", "capabilities": {"dns": true}},
            {"type": "fake-b", "capabilities": {"portMappings": true, "bandwidth": true}, "extra": 1}
        ]),
    );
    let m = w.manager(Duration::from_secs(10));
    let no_ns = w.pod("/nonexistent/netns");
    assert!(matches!(
        m.setup(&no_ns).await,
        Err(CniError::NoNetns { .. })
    ));
    assert!(w.fake.calls().is_empty());
    let pod = w.pod(NETNS);
    let status = m.setup(&pod).await.unwrap();
    assert!(matches!(
        m.setup(&pod).await,
        Err(CniError::AlreadyAdded(_))
    ));

    assert_eq!(w.fake.calls(), ["fake-a ADD", "fake-b ADD"]);
    // The final result is the last plugin's.
    assert_eq!(status.network, "fakenet");
    assert_eq!(
        status.ips,
        ["10.9.0.6".parse::<std::net::IpAddr>().unwrap()]
    );
    assert_eq!(status.result.interfaces[1].mac, "aa:00:00:00:00:02");

    let a = w.fake.stdin("fake-a", "ADD");
    assert_eq!(a["name"], "fakenet");
    assert_eq!(a["cniVersion"], "1.0.0");
    assert!(a.get("prevResult").is_none());
    // dns declared but the pod has none: no runtimeConfig at all; capabilities never passed on.
    assert!(a.get("runtimeConfig").is_none() && a.get("capabilities").is_none());

    let b = w.fake.stdin("fake-b", "ADD");
    assert_eq!(b["prevResult"]["ips"][0]["address"], "10.9.0.5/24");
    assert_eq!(b["prevResult"]["interfaces"][1]["sandbox"], NETNS);
    assert_eq!(
        b["runtimeConfig"],
        json!({"portMappings": [{"hostPort": 8080, "containerPort": 80, "protocol": "tcp"}]})
    );
    assert_eq!(b["extra"], 1);
    assert!(b.get("capabilities").is_none());

    let env = w.fake.env("fake-a", "ADD");
    for want in [
        "CNI_COMMAND=ADD",
        "CNI_CONTAINERID=sandbox1",
        &format!("CNI_NETNS={NETNS}"),
        "CNI_IFNAME=eth0",
        "CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAMESPACE=prod;K8S_POD_NAME=web;K8S_POD_INFRA_CONTAINER_ID=sandbox1;K8S_POD_UID=u-42",
        &format!(
            "CNI_PATH={}:{}",
            w.tmp.path().join("nobin").display(),
            w.fake.bin.display()
        ),
    ] {
        assert!(env.lines().any(|l| l == want), "missing {want} in\n{env}");
    }

    // The cache holds the result; CHECK runs in order with it as prevResult.
    let cached = m.cached_status("sandbox1").unwrap();
    assert_eq!(cached.ips, status.ips);
    w.fake.clear_calls();
    m.check(&pod).await.unwrap();
    assert_eq!(w.fake.calls(), ["fake-a CHECK", "fake-b CHECK"]);
    assert_eq!(
        w.fake.stdin("fake-a", "CHECK")["prevResult"]["ips"][0]["address"],
        "10.9.0.6/24"
    );
}

#[tokio::test]
async fn del_reverses_with_the_cached_config_and_result() {
    let w = World::new();
    w.fake.ok("fake-a", "10.9.0.5/24", "aa:00:00:00:00:01");
    w.fake.ok("fake-b", "10.9.0.6/24", "aa:00:00:00:00:02");
    w.fake.ok("fake-c", "10.9.0.7/24", "aa:00:00:00:00:03");
    w.conflist(
        "10.conflist",
        "1.0.0",
        json!([{"type": "fake-a"}, {"type": "fake-b", "capabilities": {"portMappings": true}}]),
    );
    let m = w.manager(Duration::from_secs(10));
    let pod = w.pod(NETNS);
    m.setup(&pod).await.unwrap();
    assert!(m.cache().path("sandbox1").exists());

    // The configuration changes under the running pod: DEL still uses what ADD used.
    w.conflist("10.conflist", "1.0.0", json!([{"type": "fake-c"}]));
    w.fake.clear_calls();
    // The namespace is gone by now: CNI_NETNS is empty.
    let gone = PodNetwork {
        netns: "/nonexistent/netns/sandbox1".into(),
        ..pod.clone()
    };
    m.teardown(&gone).await.unwrap();
    assert_eq!(w.fake.calls(), ["fake-b DEL", "fake-a DEL"]);
    let b = w.fake.stdin("fake-b", "DEL");
    assert_eq!(b["prevResult"]["ips"][0]["address"], "10.9.0.6/24");
    assert_eq!(b["runtimeConfig"]["portMappings"][0]["hostPort"], 8080);
    assert!(
        w.fake
            .env("fake-a", "DEL")
            .lines()
            .any(|l| l == "CNI_NETNS=")
    );
    assert!(
        !m.cache().path("sandbox1").exists(),
        "cache removed after DEL"
    );

    // Again, with no cache: DEL with the current configuration, no prevResult.
    w.fake.clear_calls();
    m.teardown(&gone).await.unwrap();
    assert_eq!(w.fake.calls(), ["fake-c DEL"]);
    assert!(w.fake.stdin("fake-c", "DEL").get("prevResult").is_none());

    // CHECK of a pod that is not set up is refused.
    assert!(matches!(m.check(&pod).await, Err(CniError::NotAdded(_))));
}

#[tokio::test]
async fn a_missing_plugin_is_a_clear_error_and_add_is_rolled_back() {
    let w = World::new();
    w.fake.ok("fake-a", "10.9.0.5/24", "aa:00:00:00:00:01");
    w.conflist(
        "10.conflist",
        "1.0.0",
        json!([{"type": "fake-a"}, {"type": "no-such-plugin"}]),
    );
    let m = w.manager(Duration::from_secs(10));
    let err = m.setup(&w.pod(NETNS)).await.unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, CniError::PluginNotFound { .. }), "{err:?}");
    assert!(text.contains("\"no-such-plugin\" not found in"), "{text}");
    assert!(text.contains(&w.fake.bin.display().to_string()), "{text}");
    // Rollback: DEL of the plugin that did run, with its result.
    assert_eq!(w.fake.calls(), ["fake-a ADD", "fake-a DEL"]);
    assert_eq!(
        w.fake.stdin("fake-a", "DEL")["prevResult"]["ips"][0]["address"],
        "10.9.0.5/24"
    );
}

#[tokio::test]
async fn plugin_errors_name_the_plugin_and_its_message() {
    let w = World::new();
    w.fake.ok("fake-a", "10.9.0.5/24", "aa:00:00:00:00:01");
    w.fake.fails_with_json("fake-json");
    w.fake.crashes("fake-crash");
    w.fake.prints_garbage("fake-garbage");
    let m = w.manager(Duration::from_secs(10));

    w.conflist(
        "10.conflist",
        "1.0.0",
        json!([{"type": "fake-a"}, {"type": "fake-json"}]),
    );
    let err = m.setup(&w.pod(NETNS)).await.unwrap_err();
    assert!(
        matches!(err, CniError::Plugin { code: Some(7), .. }),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "CNI plugin fake-json ADD failed: bad bridge name: too long (code 7, invalid network config)"
    );
    // Rolled back: every plugin got a DEL, in reverse; the cache is gone.
    assert_eq!(
        w.fake.calls(),
        ["fake-a ADD", "fake-json ADD", "fake-json DEL", "fake-a DEL"]
    );
    assert!(!m.cache().path("sandbox1").exists());

    w.conflist("10.conflist", "1.0.0", json!([{"type": "fake-crash"}]));
    let err = m.setup(&w.pod(NETNS)).await.unwrap_err().to_string();
    assert!(
        err.starts_with("CNI plugin fake-crash ADD failed: panic: runtime error (exit status: 2)"),
        "{err}"
    );
    // Its rollback DEL failed too, so the cache stays for a later teardown, which reports the
    // error; until then no new ADD for that id.
    assert!(m.cache().path("sandbox1").exists());
    let again = m.setup(&w.pod(NETNS)).await.unwrap_err();
    assert!(matches!(again, CniError::AlreadyAdded(_)), "{again:?}");
    let err = m.teardown(&w.pod(NETNS)).await.unwrap_err().to_string();
    assert!(err.contains("fake-crash DEL failed"), "{err}");

    std::fs::remove_file(m.cache().path("sandbox1")).unwrap();
    w.conflist("10.conflist", "1.0.0", json!([{"type": "fake-garbage"}]));
    let err = m.setup(&w.pod(NETNS)).await.unwrap_err();
    assert!(matches!(err, CniError::BadResult { .. }), "{err:?}");
    assert!(
        err.to_string()
            .contains("fake-garbage ADD printed an invalid result")
    );
}

/// An ADD that fails, whose rollback DEL fails too (the first plugin's daemon is not up yet): the
/// cache entry stays, and the sweep tears the network down once DEL works, leaving known
/// sandboxes alone. Nothing else would: the kubelet never got a sandbox id to stop.
#[tokio::test]
async fn a_network_whose_rollback_failed_is_swept_once_del_works() {
    let w = World::new();
    let down = w.tmp.path().join("ipam-down");
    std::fs::write(&down, "").unwrap();
    w.fake
        .del_fails_while("fake-flaky", "10.9.0.7/24", "aa:00:00:00:00:07", &down);
    w.fake.fails_with_json("fake-json");
    w.conflist(
        "10.conflist",
        "1.0.0",
        json!([{"type": "fake-flaky"}, {"type": "fake-json"}]),
    );
    let m = w.manager(Duration::from_secs(10));
    assert!(m.setup(&w.pod(NETNS)).await.is_err());
    let entry = m.cache().path("sandbox1");
    assert!(entry.exists(), "kept for a later teardown");
    assert!(
        m.sweep(|_| true).await.is_empty(),
        "a known sandbox is left alone"
    );
    assert!(m.sweep(|_| false).await.is_empty(), "DEL still fails");
    assert!(entry.exists());
    std::fs::remove_file(&down).unwrap();
    assert_eq!(m.sweep(|_| false).await, ["sandbox1"]);
    assert!(!entry.exists());
    let calls = w.fake.calls();
    assert_eq!(
        calls.last().map(String::as_str),
        Some("fake-flaky DEL"),
        "{calls:?}"
    );
}

#[tokio::test]
async fn what_a_plugin_prints_is_bounded() {
    let w = World::new();
    let m = w.manager(Duration::from_secs(30));
    // 200 MiB on stdout: refused, not held in the daemon's memory.
    w.fake.floods("fake-flood", 200);
    w.conflist("10.conflist", "1.0.0", json!([{"type": "fake-flood"}]));
    let err = m.setup(&w.pod(NETNS)).await.unwrap_err().to_string();
    assert!(
        err.contains("printed more than 1048576 bytes on stdout"),
        "{err}"
    );
    let _ = std::fs::remove_file(m.cache().path("sandbox1"));
    // A 512 KiB error message: cut before it becomes a gRPC status and a log line.
    w.fake.fails_at_length("fake-long", 512);
    w.conflist("10.conflist", "1.0.0", json!([{"type": "fake-long"}]));
    let err = m.setup(&w.pod(NETNS)).await.unwrap_err().to_string();
    assert!(
        err.contains("mmmm") && err.contains("(cut)"),
        "{:.200}",
        err
    );
    assert!(err.len() < 4096, "{} bytes", err.len());
}

#[tokio::test]
async fn a_hanging_plugin_is_killed_at_the_time_limit() {
    let w = World::new();
    w.fake.hangs("fake-hang");
    w.conflist("10.conflist", "1.0.0", json!([{"type": "fake-hang"}]));
    let m = w.manager(Duration::from_millis(700));
    let started = Instant::now();
    let err = m.setup(&w.pod(NETNS)).await.unwrap_err();
    assert!(matches!(err, CniError::Timeout { .. }), "{err:?}");
    assert!(
        err.to_string()
            .contains("fake-hang ADD timed out after 0.7s")
    );
    // ADD and the rollback DEL each hit the limit, no more.
    assert!(started.elapsed() < Duration::from_secs(5));
    let pid: i32 = std::fs::read_to_string(w.fake.rec.join("fake-hang.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // The plugin (exec'd into sleep) is gone: killed, and reaped by the runtime.
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::path::Path::new(&format!("/proc/{pid}")).exists() {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if stat.split_whitespace().nth(2) == Some("Z") {
            break; // killed, not yet reaped
        }
        assert!(Instant::now() < deadline, "plugin {pid} still running");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn check_is_skipped_where_the_spec_has_none() {
    let w = World::new();
    w.fake.ok("fake-a", "10.9.0.5/24", "aa:00:00:00:00:01");
    let m = w.manager(Duration::from_secs(10));
    let pod = w.pod(NETNS);

    w.conflist("10.conflist", "0.3.1", json!([{"type": "fake-a"}]));
    m.setup(&pod).await.unwrap();
    w.fake.clear_calls();
    m.check(&pod).await.unwrap();
    assert!(w.fake.calls().is_empty(), "no CHECK before spec 0.4.0");
    m.teardown(&pod).await.unwrap();
    // 0.3.x DEL gets no prevResult.
    assert!(w.fake.stdin("fake-a", "DEL").get("prevResult").is_none());

    let list = json!({"cniVersion": "1.0.0", "name": "n", "disableCheck": true,
                      "plugins": [{"type": "fake-a"}]});
    std::fs::write(w.conf.join("10.conflist"), list.to_string()).unwrap();
    m.setup(&pod).await.unwrap();
    w.fake.clear_calls();
    m.check(&pod).await.unwrap();
    assert!(w.fake.calls().is_empty(), "disableCheck");
    m.teardown(&pod).await.unwrap();
}

#[tokio::test]
async fn network_ready_follows_the_configuration() {
    let w = World::new();
    let m = w.manager(Duration::from_secs(10));
    let why = m.network_ready().unwrap_err();
    assert!(why.contains("no valid CNI network configuration"), "{why}");
    assert!(matches!(
        m.setup(&w.pod(NETNS)).await,
        Err(CniError::NotReady(_))
    ));
    std::fs::write(w.conf.join("05-bad.conflist"), "{").unwrap();
    assert!(m.network_ready().unwrap_err().contains("05-bad.conflist"));
    w.conflist("10.conflist", "1.0.0", json!([{"type": "fake-a"}]));
    assert_eq!(m.network_ready().unwrap(), w.conf.join("10.conflist"));

    m.set_pod_cidr("10.244.1.0/24");
    assert_eq!(m.pod_cidr(), "10.244.1.0/24");
}

#[tokio::test]
async fn invalid_requests_are_refused_before_any_plugin_runs() {
    let w = World::new();
    w.fake.ok("fake-a", "10.9.0.5/24", "aa:00:00:00:00:01");
    w.conflist("10.conflist", "1.0.0", json!([{"type": "fake-a"}]));
    let m = w.manager(Duration::from_secs(10));
    let mut pod = w.pod(NETNS);
    pod.id = "../escape".into();
    assert!(matches!(
        m.setup(&pod).await,
        Err(CniError::InvalidArgument(_))
    ));
    let mut pod = w.pod(NETNS);
    pod.annotations
        .insert("kubernetes.io/ingress-bandwidth".into(), "lots".into());
    let err = m.setup(&pod).await.unwrap_err().to_string();
    assert!(err.contains("kubernetes.io/ingress-bandwidth"), "{err}");
    assert!(w.fake.calls().is_empty());
}

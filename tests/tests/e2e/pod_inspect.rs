//! Black-box tests of verbose status (`crictl inspect` / `crictl inspectp`): ContainerStatus
//! and PodSandboxStatus with `verbose: true` answer an `info` map with one key, `"info"`,
//! holding a JSON object with the keys tools read from containerd (docs/inspect.md): for a
//! container its pid, sandbox, OCI spec, snapshot, image and CRI config (protobuf JSON
//! mapping); for a sandbox its infra pid, network namespace, OCI spec, config and infra rootfs.
//! Without `verbose` the map is empty.
//!
//! Root only, with runc and Debian's CNI plugins ([`skip_reason`]).

use minicri_proto::runtime::v1 as cri;
use minicri_tests::pod_env::{PodEnv, pod_config, skip_reason};
use minicri_tests::pod_rpc::{
    RuntimeClient, exec_text, run_container, run_pod, sh_container_config, stop_and_remove_pod,
};
use serde_json::Value;

async fn container_info(c: &mut RuntimeClient, id: &str, verbose: bool) -> Option<Value> {
    let r = c
        .container_status(cri::ContainerStatusRequest {
            container_id: id.into(),
            verbose,
        })
        .await
        .expect("ContainerStatus")
        .into_inner();
    info_of(r.info)
}

async fn sandbox_info(c: &mut RuntimeClient, id: &str, verbose: bool) -> Option<Value> {
    let r = c
        .pod_sandbox_status(cri::PodSandboxStatusRequest {
            pod_sandbox_id: id.into(),
            verbose,
        })
        .await
        .expect("PodSandboxStatus")
        .into_inner();
    info_of(r.info)
}

/// The JSON object under the one key `"info"`; `None` for an empty map.
fn info_of(info: std::collections::HashMap<String, String>) -> Option<Value> {
    if info.is_empty() {
        return None;
    }
    assert_eq!(info.keys().collect::<Vec<_>>(), ["info"], "{info:?}");
    let v: Value = serde_json::from_str(&info["info"]).expect("info is JSON");
    assert!(v.is_object(), "{v}");
    Some(v)
}

fn cmdline(pid: i64) -> String {
    String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default())
        .replace('\0', " ")
}

#[tokio::test(flavor = "multi_thread")]
async fn verbose_status_carries_the_info_tools_read() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let env = PodEnv::new().await;
    let image = env.pull_busybox().await;
    let mut c = env.runtime().await;
    let pod = pod_config("inspect", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    let config = cri::ContainerConfig {
        envs: vec![cri::KeyValue {
            key: "WHO".into(),
            value: b"inspected".to_vec(),
        }],
        stdin_once: false,
        ..sh_container_config("main", &image, "exec sleep 1000")
    };
    let id = run_container(&mut c, &sb, &pod, config).await;

    // Not verbose: nothing.
    assert!(container_info(&mut c, &id, false).await.is_none());
    assert!(sandbox_info(&mut c, &sb, false).await.is_none());

    let info = container_info(&mut c, &id, true)
        .await
        .expect("verbose info");
    // The pid is the container's init on the host: `sleep 1000` in the container's pid 1.
    let pid = info["pid"].as_i64().expect("a pid");
    assert!(pid > 1, "{info}");
    // StartContainer returns once runc has released the container's init, which may not have
    // exec'd the process yet (its command line is still `runc init` for a moment).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !cmdline(pid).contains("sleep 1000") && std::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(cmdline(pid).contains("sleep 1000"), "{}", cmdline(pid));
    let (_, ns_pid, _) = exec_text(&mut c, &id, &["sh", "-c", "cat /proc/1/cmdline"], 10).await;
    assert!(ns_pid.contains("sleep"), "{ns_pid}");
    assert_eq!(info["sandboxID"], sb.as_str());
    assert_eq!(info["snapshotKey"], id.as_str());
    assert!(
        info["snapshotter"].as_str().is_some_and(|s| !s.is_empty()),
        "{info}"
    );
    assert_eq!(info["image"], image.as_str());
    assert_eq!(info["removing"], false);
    // The OCI spec as written for runc.
    let spec = &info["runtimeSpec"];
    assert_eq!(
        spec["process"]["args"],
        serde_json::json!(["sh", "-c", "exec sleep 1000"])
    );
    assert!(
        spec["process"]["env"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e == "WHO=inspected"),
        "{spec}"
    );
    assert!(
        spec["root"]["path"].as_str().unwrap().ends_with("rootfs"),
        "{spec}"
    );
    // The CRI config in the protobuf JSON mapping: lowerCamelCase names, bytes in base64.
    let cfg = &info["config"];
    assert_eq!(cfg["metadata"]["name"], "main");
    assert_eq!(cfg["logPath"], "main/0.log");
    assert_eq!(cfg["image"]["image"], image.as_str());
    assert_eq!(cfg["envs"][0]["key"], "WHO");
    assert_eq!(cfg["envs"][0]["value"], "aW5zcGVjdGVk", "bytes in base64");
    assert!(
        cfg.get("log_path").is_none() && cfg.get("stdinOnce").is_none(),
        "{cfg}"
    );

    let info = sandbox_info(&mut c, &sb, true).await.expect("verbose info");
    let pid = info["pid"].as_i64().expect("a pid");
    assert!(
        pid > 1 && cmdline(pid).contains("pause"),
        "{info} {}",
        cmdline(pid)
    );
    let netns = info["netNamespacePath"].as_str().expect("a netns path");
    assert!(std::path::Path::new(netns).exists(), "{netns}");
    let spec = &info["runtimeSpec"];
    assert!(
        spec["linux"]["namespaces"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n["type"] == "network" && n["path"] == netns),
        "{spec}"
    );
    assert_eq!(info["image"], spec["root"]["path"]);
    assert_eq!(info["config"]["metadata"]["name"], "inspect");
    assert_eq!(info["config"]["metadata"]["uid"], "uid-inspect");
    assert_eq!(
        info["config"]["logDirectory"],
        env.logs.path().display().to_string()
    );
    assert_eq!(info["config"]["labels"]["app"], "inspect");

    // Unknown ids are still NOT_FOUND, verbose or not.
    let e = c
        .container_status(cri::ContainerStatusRequest {
            container_id: "f".repeat(64),
            verbose: true,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound);

    stop_and_remove_pod(&mut c, &sb).await;
}

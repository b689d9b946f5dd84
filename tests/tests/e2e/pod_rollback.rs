//! Black-box test of RunPodSandbox's rollback: when a step fails half-way (here the second CNI
//! plugin of the chain, after the bridge plugin has already plugged a veth in), every completed
//! step is undone and the pod's name can be used again.
//!
//! Root only, with runc and Debian's CNI plugins ([`skip_reason`]).

use minicri_proto::runtime::v1 as cri;
use minicri_tests::pod_env::{PodEnv, pod_config, ports_of, skip_reason};
use minicri_tests::pod_rpc::{list_pod_sandboxes, stop_and_remove_pod};

#[tokio::test(flavor = "multi_thread")]
async fn a_failing_cni_plugin_rolls_the_sandbox_back() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let env = PodEnv::new().await;
    let dir = env.daemon.root().parent().unwrap().to_path_buf();
    let conf = dir.join("cni/10-test.conflist");
    let good = std::fs::read_to_string(&conf).unwrap();
    let mut list: serde_json::Value = serde_json::from_str(&good).unwrap();
    let bridge = list["plugins"][0]["bridge"].as_str().unwrap().to_string();
    // The bridge plugin succeeds, then a plugin that does not exist fails the ADD.
    list["plugins"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({ "type": "minicri-test-no-such-plugin" }));
    std::fs::write(&conf, serde_json::to_vec_pretty(&list).unwrap()).unwrap();

    let mut c = env.runtime().await;
    let pod = pod_config("rollback", env.logs.path());
    let err = c
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(pod.clone()),
            runtime_handler: String::new(),
        })
        .await
        .unwrap_err();
    assert!(
        err.message().contains("minicri-test-no-such-plugin"),
        "the error names the failing plugin: {err:?}"
    );

    // Nothing of the half-made sandbox is left.
    let listed = list_pod_sandboxes(&mut c).await;
    assert!(listed.is_empty(), "{listed:?}");
    assert!(
        ports_of(&bridge).is_empty(),
        "the bridge plugin's veth was deleted (CNI DEL)"
    );
    let stray = env.stray_state();
    assert!(stray.is_empty(), "left behind: {stray:?}");

    // The name was released: with the plugin chain fixed, the same pod runs.
    std::fs::write(&conf, good).unwrap();
    let id = c
        .run_pod_sandbox(cri::RunPodSandboxRequest {
            config: Some(pod),
            runtime_handler: String::new(),
        })
        .await
        .expect("the same pod runs once the network works")
        .into_inner()
        .pod_sandbox_id;
    assert_eq!(ports_of(&bridge).len(), 1);
    stop_and_remove_pod(&mut c, &id).await;
    assert!(ports_of(&bridge).is_empty());
}

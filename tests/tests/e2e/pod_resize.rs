//! Black-box tests of UpdatePodSandboxResources against the real daemon, runc and CNI on this
//! host's cgroup v1 (cgroupfs driver): a pod's cgroup limits grow and shrink with its requests
//! (containers' sum plus overhead), a request the kernel refuses part way leaves the old values
//! in every file, and verbose PodSandboxStatus reports what was applied. The cgroup v2 layout is
//! covered by the unit test `pods::tests::a_pod_resize_on_cgroup_v2_is_written_and_undone_on_failure`.
//!
//! Root only (they print why and pass elsewhere); see [`minicri_tests::pod_env`].

use std::path::PathBuf;

use minicri_proto::runtime::v1 as cri;
use minicri_tests::pod_env::{pod_config, with_busybox};
use minicri_tests::pod_rpc::{RuntimeClient, container_config, run_container, run_pod};
use tonic::Code;

const MIB: i64 = 1 << 20;

fn read(path: &PathBuf) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .trim()
        .to_string()
}

async fn resize(
    c: &mut RuntimeClient,
    id: &str,
    overhead: Option<cri::LinuxContainerResources>,
    resources: cri::LinuxContainerResources,
) -> Result<(), tonic::Status> {
    c.update_pod_sandbox_resources(cri::UpdatePodSandboxResourcesRequest {
        pod_sandbox_id: id.into(),
        overhead,
        resources: Some(resources),
    })
    .await
    .map(|_| ())
}

/// The memory limit verbose PodSandboxStatus reports as applied.
async fn reported_memory(c: &mut RuntimeClient, id: &str) -> Option<String> {
    let info = c
        .pod_sandbox_status(cri::PodSandboxStatusRequest {
            pod_sandbox_id: id.into(),
            verbose: true,
        })
        .await
        .unwrap()
        .into_inner()
        .info;
    let v: serde_json::Value = serde_json::from_str(&info["info"]).unwrap();
    let r = &v["podResources"]["resources"]["memoryLimitInBytes"];
    r.as_str().map(String::from)
}

/// A pod whose limits grow, shrink, and survive a refused update unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pod_cgroup_limits_follow_updates_and_a_refused_one_changes_nothing() {
    let Some((env, image, mut c)) = with_busybox().await else {
        return;
    };
    let start = std::time::Instant::now();
    let (pod, parent) = env.pod_with_own_cgroup("resize");
    let sandbox = run_pod(&mut c, &pod).await;
    let config = container_config("sleeper", &image, &["sleep", "1000"]);
    run_container(&mut c, &sandbox, &pod, config).await;
    let file = |ctrl: &str, f: &str| PathBuf::from(format!("/sys/fs/cgroup/{ctrl}{parent}/{f}"));
    let values = || {
        (
            read(&file("memory", "memory.limit_in_bytes")),
            read(&file("cpu", "cpu.shares")),
            read(&file("cpu", "cpu.cfs_quota_us")),
            read(&file("cpu", "cpu.cfs_period_us")),
            read(&file("cpuset", "cpuset.cpus")),
        )
    };
    let cpus = values().4;
    assert_eq!(reported_memory(&mut c, &sandbox).await, None);

    // Grow: the containers' 256 MiB and 2 CPUs, plus 16 MiB and 10 shares of overhead.
    let overhead = cri::LinuxContainerResources {
        cpu_shares: 10,
        memory_limit_in_bytes: 16 * MIB,
        ..Default::default()
    };
    let grow = cri::LinuxContainerResources {
        cpu_shares: 2048,
        cpu_quota: 200_000,
        cpu_period: 100_000,
        memory_limit_in_bytes: 256 * MIB,
        ..Default::default()
    };
    resize(&mut c, &sandbox, Some(overhead.clone()), grow)
        .await
        .unwrap();
    let v = values();
    assert_eq!(
        (v.0.as_str(), v.1.as_str(), v.2.as_str(), v.3.as_str()),
        ("285212672", "2058", "200000", "100000")
    );
    assert_eq!(
        reported_memory(&mut c, &sandbox).await.as_deref(),
        Some("268435456")
    );

    // Shrink to 128 MiB and half a CPU.
    let shrink = cri::LinuxContainerResources {
        cpu_shares: 512,
        cpu_quota: 50_000,
        memory_limit_in_bytes: 128 * MIB,
        ..Default::default()
    };
    resize(&mut c, &sandbox, None, shrink).await.unwrap();
    let shrunk = values();
    assert_eq!(
        (
            shrunk.0.as_str(),
            shrunk.1.as_str(),
            shrunk.2.as_str(),
            shrunk.4.as_str()
        ),
        ("134217728", "512", "50000", cpus.as_str())
    );

    // Refused part way: the memory and CPU files were written before the kernel refused a
    // cpuset of CPUs this node does not have; all go back.
    let refused = cri::LinuxContainerResources {
        cpu_shares: 4096,
        cpu_quota: 400_000,
        memory_limit_in_bytes: 512 * MIB,
        cpuset_cpus: "0-4095".into(),
        ..Default::default()
    };
    let err = resize(&mut c, &sandbox, Some(overhead), refused)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("cpuset.cpus"), "{err:?}");
    assert_eq!(values(), shrunk);
    assert_eq!(
        reported_memory(&mut c, &sandbox).await.as_deref(),
        Some("134217728")
    );

    // Bad values, an unknown pod, a pod without a cgroup of its own.
    let bad = cri::LinuxContainerResources {
        cpu_quota: 5,
        ..Default::default()
    };
    let err = resize(&mut c, &sandbox, None, bad).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    let err = resize(&mut c, "nope", None, Default::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
    let plain = run_pod(&mut c, &pod_config("plain", env.logs.path())).await;
    let err = resize(&mut c, &plain, None, Default::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("no cgroup of its own"), "{err:?}");
    assert_eq!(values(), shrunk);
    eprintln!("took {:?}", start.elapsed());
}

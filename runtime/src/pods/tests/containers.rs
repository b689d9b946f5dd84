//! Containers through the fake runtime: the writable layer's background measurement, updates
//! during a start, start errors in the record, refused names and commands, pod resizes.

use std::sync::Arc;
use std::time::Duration;

use minicri_proto::runtime::v1 as cri;

use super::*;

/// A stats call never walks a writable layer (a tree the container fills as it likes): the
/// first answers with nothing and queues the layer; the background measurer fills in the figures,
/// once however often it is asked meanwhile, and stops when nothing waits.
#[tokio::test]
async fn a_writable_layer_is_measured_in_the_background() {
    let node = Node::new();
    let svc = node.service();
    let m = node.images.prepare("c1", None).unwrap();
    let upper = std::path::PathBuf::from(&m.source);
    for i in 0..2000 {
        std::fs::write(upper.join(format!("f{i}")), b"x").unwrap();
    }
    assert!(
        svc.writable_layer("c1").is_none(),
        "measured inside the call"
    );
    for _ in 0..10 {
        assert!(
            svc.writable_layer("c1")
                .is_none_or(|u| u.inodes_used.is_some())
        );
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let u = loop {
        if let Some(u) = svc.writable_layer("c1") {
            break u;
        }
        assert!(std::time::Instant::now() < deadline, "never measured");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(u.inodes_used.is_some_and(|v| v.value >= 2000), "{u:?}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !svc.stats.queue().is_idle() {
        assert!(
            std::time::Instant::now() < deadline,
            "the measurer never ended"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Once stale, the last figures are served while the layer is measured again; a layer that
    // is gone is forgotten.
    node.images.remove_snapshot("c1").unwrap();
    tokio::time::sleep(crate::pods::stats::SNAPSHOT_USAGE_TTL).await;
    assert!(
        svc.writable_layer("c1").is_some(),
        "stale figures are served"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while svc.writable_layer("c1").is_some() {
        assert!(
            std::time::Instant::now() < deadline,
            "a removed layer stays measured"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A pod "web" and, in it, the container `id` as CreateContainer leaves it (recorded as created,
/// with a bundle holding a default spec): returns the bundle's config.json.
async fn created_container(node: &Node, svc: &Arc<PodService>, id: &str) -> std::path::PathBuf {
    use crate::pods::store::{ContainerRecord, ContainerState};
    let sandbox_id = run(svc, "web").await;
    let bundle = node.dir.path().join(format!("bundle-{id}"));
    std::fs::create_dir_all(&bundle).unwrap();
    let config = bundle.join("config.json");
    oci_spec::runtime::Spec::default().save(&config).unwrap();
    let mut rec = ContainerRecord::exited(id, &format!("{id}_web"));
    rec.sandbox_id = sandbox_id;
    rec.state = ContainerState::Created;
    rec.bundle = bundle;
    svc.store.put_container(rec).unwrap();
    config
}

/// UpdateContainerResources of a container that StartContainer is starting waits for the start
/// (the container's op lock): the update then goes to the running container through the
/// runtime, instead of into a bundle the runtime has already read, where it would be lost.
#[tokio::test]
async fn an_update_during_a_start_waits_for_it_and_reaches_the_running_container() {
    let node = Node::new();
    let svc = node.service();
    let config = created_container(&node, &svc, "c1").await;
    let written = std::fs::read(&config).unwrap();

    node.fake.hang("start");
    let start = tokio::spawn({
        let svc = svc.clone();
        async move { svc.start_container("c1".into()).await }
    });
    wait_for("the runtime is starting c1", || {
        node.fake.called("start c1")
    })
    .await;
    let update = tokio::spawn({
        let svc = svc.clone();
        let resources = cri::LinuxContainerResources {
            memory_limit_in_bytes: 64 << 20,
            ..Default::default()
        };
        async move { svc.update_container_resources("c1", Some(resources)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!update.is_finished(), "the update waits for the start");
    assert_eq!(std::fs::read(&config).unwrap(), written, "bundle rewritten");

    node.fake.release("start");
    start.await.unwrap().unwrap();
    update.await.unwrap().unwrap();
    assert!(node.fake.called("update c1"), "{:?}", node.fake.calls());
    assert_eq!(std::fs::read(&config).unwrap(), written, "bundle rewritten");
}

/// A runtime's start error goes into the container's record (ContainerStatus' message, and the
/// kubelet's events) cut to what a status carries: runc quotes the command it could not find,
/// which a pod spec or an image config can make megabytes long.
#[tokio::test]
async fn a_start_error_is_recorded_cut_to_a_status_message() {
    let node = Node::new();
    let svc = node.service();
    created_container(&node, &svc, "c1").await;
    let huge = format!(
        "exec: \"{}\": executable file not found",
        "x".repeat(4 << 20)
    );
    node.fake.fail("start", &huge);
    svc.start_container("c1".into()).await.unwrap_err();
    let rec = svc.store.container("c1").unwrap();
    assert_eq!(rec.reason, "StartError");
    assert!(
        rec.message.contains("exec: \"xxx"),
        "{}",
        &rec.message[..64]
    );
    let chars = rec.message.chars().count();
    assert!(
        chars <= crate::error::MAX_STATUS_CHARS + 16,
        "{chars} characters"
    );
}

/// Names and commands a relist or an exec would carry to every caller are bounded and refused
/// by name before anything is looked up or created.
#[tokio::test]
async fn long_container_names_and_exec_commands_are_refused() {
    let node = Node::new();
    let svc = node.service();
    let sb = run(&svc, "names").await;
    for name in ["x".repeat(254), "a b".into(), "a/b".into(), "tab\t".into()] {
        let config = cri::ContainerConfig {
            metadata: Some(cri::ContainerMetadata {
                name: name.clone(),
                attempt: 0,
            }),
            ..Default::default()
        };
        let e = svc
            .create_container(sb.clone(), config, None)
            .await
            .unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("metadata.name")),
            "{name:?}: {e:?}"
        );
    }
    let huge = vec!["x".repeat(1 << 16); 5];
    for (cmd, says) in [
        (vec![], "required"),
        (huge, "more than"),
        (vec!["sh".into(), "a\0b".into()], "cmd[1]"),
    ] {
        let e = crate::pods::exec::check_cmd(&cmd).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains(says)),
            "{says}: {e:?}"
        );
    }
    crate::pods::exec::check_cmd(&vec!["x".repeat(1 << 16); 3]).unwrap();
}

/// UpdatePodSandboxResources on a cgroup v2 layout (a temporary directory laid out as the
/// unified hierarchy: this host is cgroup v1): the files get the new values; a write that fails
/// part way puts back the ones written before it.
#[tokio::test]
async fn a_pod_resize_on_cgroup_v2_is_written_and_undone_on_failure() {
    use crate::pods::resize::pod_total;
    use std::path::PathBuf;
    let node = Node::new();
    let svc = node.service();
    let cg = tempfile::tempdir().unwrap();
    let rel = PathBuf::from("kubepods.slice/kubepods-pod1.slice");
    let dir = cg.path().join(&rel);
    std::fs::create_dir_all(&dir).unwrap();
    let files = [
        ("memory.max", "max"),
        ("cpu.weight", "100"),
        ("cpu.max", "max 100000"),
        ("cpuset.cpus", ""),
    ];
    for (f, v) in files {
        std::fs::write(dir.join(f), format!("{v}\n")).unwrap();
    }
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
    let h = crate::pods::cgroups::Hierarchy::V2 {
        root: cg.path().into(),
    };
    let resize = |total: cri::LinuxContainerResources| {
        let (h, rel) = (h.clone(), rel.clone());
        svc.undoable(
            crate::pods::Operation::UpdatePodSandboxResources,
            move |svc, j| Box::pin(async move { svc.write_pod_cgroup(h, rel, total, j).await }),
        )
    };
    let grow = cri::LinuxContainerResources {
        cpu_shares: 2048,
        cpu_quota: 150_000,
        memory_limit_in_bytes: 256 << 20,
        ..Default::default()
    };
    resize(pod_total(None, Some(&grow))).await.unwrap();
    assert_eq!(read("memory.max"), (256u64 << 20).to_string());
    assert_eq!(read("cpu.weight"), "79");
    assert_eq!(read("cpu.max"), "150000 100000");
    // The cpuset cannot be written (here: it is a directory, as a refused value would be
    // refused by the kernel): memory and CPU go back to the grown values.
    std::fs::remove_file(dir.join("cpuset.cpus")).unwrap();
    std::fs::create_dir(dir.join("cpuset.cpus")).unwrap();
    let shrink = cri::LinuxContainerResources {
        cpu_shares: 512,
        cpu_quota: 50_000,
        memory_limit_in_bytes: 64 << 20,
        cpuset_cpus: "0".into(),
        ..Default::default()
    };
    let err = resize(pod_total(None, Some(&shrink))).await.unwrap_err();
    assert!(err.to_string().contains("cpuset.cpus"), "{err}");
    assert_eq!(read("memory.max"), (256u64 << 20).to_string());
    assert_eq!(read("cpu.weight"), "79");
    assert_eq!(read("cpu.max"), "150000 100000");
    // No journal is left behind.
    let journals = std::fs::read_dir(node.state().join("pods/inflight")).unwrap();
    assert_eq!(journals.count(), 0);
}

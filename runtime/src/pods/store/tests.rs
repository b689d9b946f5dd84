//! Unit tests of the pod store: records on disk, name reservations, removals, subscriptions.

use super::*;

impl ContainerRecord {
    /// A record of container `id` named `name`, exited, of sandbox `sb`, with nothing else set.
    pub(crate) fn exited(id: &str, name: &str) -> ContainerRecord {
        ContainerRecord {
            id: id.into(),
            sandbox_id: "sb".into(),
            name: name.into(),
            config: Arc::from([]),
            image: String::new(),
            image_id: String::new(),
            created_at: 1,
            started_at: 0,
            finished_at: 0,
            exit_code: 0,
            reason: String::new(),
            message: String::new(),
            state: ContainerState::Exited,
            log_path: None,
            rootfs: PathBuf::new(),
            bundle: PathBuf::new(),
            stop_signal: 15,
            shim: None,
            pid: 0,
            user: None,
            runtime_handler: String::new(),
            runtime_deleted: false,
            image_volumes: Vec::new(),
            restore_from: None,
        }
    }
}

fn sandbox(id: &str, name: &str) -> SandboxRecord {
    let cfg = cri::PodSandboxConfig {
        labels: [("a".to_string(), "b".to_string())].into(),
        ..Default::default()
    };
    SandboxRecord {
        id: id.into(),
        name: name.into(),
        config: cfg.encode_to_vec().into(),
        runtime_handler: String::new(),
        created_at: 1,
        state: SandboxState::Ready,
        netns: None,
        ips: vec!["10.0.0.2".into()],
        shim: None,
        infra_pid: 0,
        network_attached: false,
        resources: Default::default(),
    }
}

#[test]
fn interrupted_record_writes_are_swept_at_open() {
    let d = tempfile::tempdir().unwrap();
    let s = Store::open(d.path()).unwrap();
    s.put_sandbox(sandbox("id1", "n")).unwrap();
    drop(s);
    // What a SIGKILL inside write_atomic leaves: the new contents beside the record.
    for dir in ["sandboxes", "containers", REMOVING] {
        std::fs::write(
            d.path().join(dir).join("x.json.tmp"),
            b"{\"env\":\"SECRET\"}",
        )
        .unwrap();
    }
    let s = Store::open(d.path()).unwrap();
    assert!(s.sandbox("id1").is_some());
    for dir in ["sandboxes", "containers", REMOVING] {
        assert!(!d.path().join(dir).join("x.json.tmp").exists(), "{dir}");
    }
}

/// A record whose config is not hex (a hand edit, a corrupted disk) is skipped at open
/// with a warning like any unreadable record; a multi-byte character across a pair of digits
/// used to panic the daemon's start.
#[test]
fn a_record_with_a_config_that_is_not_hex_is_skipped_at_open() {
    let d = tempfile::tempdir().unwrap();
    let s = Store::open(d.path()).unwrap();
    s.put_sandbox(sandbox("id1", "n")).unwrap();
    s.put_sandbox(sandbox("id2", "m")).unwrap();
    drop(s);
    let path = d.path().join("sandboxes").join("id2.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    v["config"] = "a\u{e9}b".into(); // 4 bytes, the 2nd and 3rd one character
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
    let s = Store::open(d.path()).unwrap();
    assert!(s.sandbox("id1").is_some());
    assert!(s.sandbox("id2").is_none());
}

#[test]
fn records_persist_and_names_are_exclusive() {
    let d = tempfile::tempdir().unwrap();
    let s = Store::open(d.path()).unwrap();
    s.reserve("n", "id1").unwrap();
    assert!(matches!(
        s.reserve("n", "id2"),
        Err(Error::AlreadyExists(_))
    ));
    s.put_sandbox(sandbox("id1", "n")).unwrap();
    s.update_sandbox("id1", |r| r.state = SandboxState::NotReady)
        .unwrap()
        .unwrap();
    let again = Store::open(d.path()).unwrap();
    let r = again.sandbox("id1").unwrap();
    assert_eq!(r.state, SandboxState::NotReady);
    assert_eq!(r.config().labels["a"], "b");
    assert!(again.reserve("n", "id2").is_err());
    again.delete_sandbox("id1").unwrap();
    again.reserve("n", "id2").unwrap();
    assert!(Store::open(d.path()).unwrap().sandbox("id1").is_none());
}

/// The summaries decode the same metadata, labels and annotations as the full configs,
/// whatever else the configs hold (their tags match the CRI's).
#[test]
fn summaries_read_the_same_fields_as_the_full_configs() {
    let map = |k: &str, v: &str| HashMap::from([(k.to_string(), v.to_string())]);
    let c = cri::ContainerConfig {
        metadata: Some(cri::ContainerMetadata {
            name: "c".into(),
            attempt: 2,
        }),
        command: vec!["sh".into()],
        envs: vec![cri::KeyValue {
            key: "K".into(),
            value: vec![b'v'; 1 << 20],
        }],
        mounts: vec![cri::Mount {
            host_path: "/srv".into(),
            ..Default::default()
        }],
        labels: map("l", "1"),
        annotations: map("a", "2"),
        log_path: "c/0.log".into(),
        linux: Some(Default::default()),
        ..Default::default()
    };
    let mut r = ContainerRecord::exited("id1", "c");
    r.config = c.encode_to_vec().into();
    let summary = r.summary();
    assert_eq!(summary.metadata, c.metadata);
    assert_eq!(
        (summary.labels, summary.annotations),
        (c.labels, c.annotations)
    );

    let p = cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: "p".into(),
            uid: "u".into(),
            namespace: "ns".into(),
            attempt: 1,
        }),
        hostname: "h".into(),
        log_directory: "/logs".into(),
        port_mappings: vec![Default::default()],
        labels: map("l", "3"),
        annotations: map("a", "4"),
        linux: Some(cri::LinuxPodSandboxConfig {
            cgroup_parent: "/kubepods/pod-u".into(),
            sysctls: map("net.core.somaxconn", "1024"),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut sb = sandbox("sb1", "p");
    sb.config = p.encode_to_vec().into();
    let summary = sb.summary();
    assert_eq!(summary.metadata, p.metadata);
    assert_eq!(
        (summary.labels, summary.annotations),
        (p.labels, p.annotations)
    );
    assert_eq!(summary.linux.unwrap().cgroup_parent, "/kubepods/pod-u");
}

#[test]
fn a_removal_hides_the_container_at_once_and_survives_a_restart_until_finished() {
    let d = tempfile::tempdir().unwrap();
    let s = Store::open(d.path()).unwrap();
    s.reserve("c", "id1").unwrap();
    s.put_container(ContainerRecord::exited("id1", "c"))
        .unwrap();
    let mut events = s.subscribe();

    let r = s.begin_removal("id1").unwrap().expect("the record");
    assert_eq!(r.id, "id1");
    assert!(s.container("id1").is_none() && s.containers().is_empty());
    assert!(s.containers_of("sb").is_empty());
    assert_eq!(events.try_recv().unwrap().kind, ContainerEventKind::Deleted);
    s.reserve("c", "id2").expect("the name is free");
    assert!(s.id_in_use("id1"), "the id is not reused while torn down");
    assert!(s.begin_removal("id1").unwrap().is_none(), "once");
    // A change the teardown must see (a runtime delete that finished meanwhile).
    assert!(
        s.update_container("id1", |r| r.runtime_deleted = true)
            .unwrap()
            .is_none()
    );
    assert!(s.removal("id1").unwrap().runtime_deleted);

    // A crash now: the next start finds the removal, not the container.
    let again = Store::open(d.path()).unwrap();
    assert!(again.container("id1").is_none());
    assert_eq!(again.removals().len(), 1);
    again.finish_removal("id1").unwrap();
    assert!(again.removals().is_empty() && !again.id_in_use("id1"));
    let third = Store::open(d.path()).unwrap();
    assert!(third.removals().is_empty() && third.container("id1").is_none());
}

/// Puts container `id`'s record back beside its removal record, as if the rename had been a
/// copy that a crash cut short.
fn leave_stale_record(dir: &Path, id: &str) {
    std::fs::copy(
        dir.join(REMOVING).join(format!("{id}.json")),
        dir.join("containers").join(format!("{id}.json")),
    )
    .unwrap();
}

#[test]
fn a_record_left_beside_its_removal_is_not_loaded() {
    let d = tempfile::tempdir().unwrap();
    let s = Store::open(d.path()).unwrap();
    s.put_container(ContainerRecord::exited("id1", "c"))
        .unwrap();
    s.begin_removal("id1").unwrap().unwrap();
    leave_stale_record(d.path(), "id1");
    let again = Store::open(d.path()).unwrap();
    assert!(again.container("id1").is_none());
    assert!(again.removal("id1").is_some());
    again.reserve("c", "id2").expect("its name is free");
    assert!(!d.path().join("containers/id1.json").exists());
}

#[test]
fn a_stale_record_does_not_take_its_name_from_the_container_created_since() {
    let d = tempfile::tempdir().unwrap();
    let s = Store::open(d.path()).unwrap();
    s.reserve("c", "id1").unwrap();
    s.put_container(ContainerRecord::exited("id1", "c"))
        .unwrap();
    s.begin_removal("id1").unwrap().unwrap();
    // The name went to a new container, then a crash left the old record beside its removal.
    s.reserve("c", "id2").unwrap();
    s.put_container(ContainerRecord::exited("id2", "c"))
        .unwrap();
    leave_stale_record(d.path(), "id1");
    let again = Store::open(d.path()).unwrap();
    assert!(again.container("id2").is_some());
    assert!(
        matches!(again.reserve("c", "id3"), Err(Error::AlreadyExists(_))),
        "the name still belongs to id2"
    );
    again.reserve("c", "id2").expect("id2 keeps its name");
}

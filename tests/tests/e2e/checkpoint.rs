//! Black-box tests of CheckpointContainer and of containers created from checkpoint archives,
//! with real runc and real CRIU. Where `criu check` fails (this project's CI host: its kernel's
//! vDSO is one CRIU 3.17 cannot read), a checkpoint answers FAILED_PRECONDITION with CRIU's
//! reason and leaves the container running, and a restore fails at StartContainer with CRIU's
//! reason, leaving no container in runc and no process behind. A full checkpoint and restore
//! is checked in the node VM (hack/node-vm/guest.sh), whose kernel CRIU runs on.
//!
//! Root only, with runc and Debian's CNI plugins ([`with_busybox`]).

use std::path::Path;
use std::process::Command;

use minicri_proto::runtime::v1 as cri;
use minicri_tests::pod_env::{
    eventually, pod_config, processes_mentioning, runc_list, with_busybox_args,
};
use minicri_tests::pod_rpc::{
    container_status, create_container, exec_text, list_containers, remove_container,
    run_container, run_pod, sh_container_config, stop_and_remove_pod,
};

/// `criu check`'s outcome here: `Err` with its first error message when it fails.
fn criu_check() -> Result<(), String> {
    let out = Command::new("criu")
        .arg("check")
        .output()
        .map_err(|e| format!("criu: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let text = String::from_utf8_lossy(&out.stderr).into_owned();
    let first = text
        .lines()
        .find_map(|l| l.split_once("): ").map(|(_, m)| m.trim().to_string()))
        .unwrap_or_else(|| text.trim().to_string());
    Err(first)
}

/// The counter the container writes every 0.2 s.
async fn counter(c: &mut minicri_tests::pod_rpc::RuntimeClient, id: &str) -> u64 {
    exec_text(c, id, &["cat", "/tmp/n"], 10)
        .await
        .1
        .trim()
        .parse()
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_checkpoint_where_criu_cannot_run_names_why_and_leaves_the_container_running() {
    let Some((env, image, mut c)) = with_busybox_args(&[]).await else {
        return;
    };
    let pod = pod_config("ckpt", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    let script = "i=0; while true; do i=$((i+1)); echo $i > /tmp/n; sleep 0.2; done";
    let id = run_container(
        &mut c,
        &sb,
        &pod,
        sh_container_config("count", &image, script),
    )
    .await;
    let out = env.logs.path().join("count.tar");
    let r = c
        .checkpoint_container(cri::CheckpointContainerRequest {
            container_id: id.clone(),
            location: out.display().to_string(),
            timeout: 30,
        })
        .await;
    match criu_check() {
        Err(reason) => {
            let e = r.unwrap_err();
            assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
            assert!(
                e.message().contains(&reason)
                    && e.message().contains("CRIU does not work on this host")
                    && e.message().contains("not touched"),
                "{e:?} should name {reason:?}"
            );
            assert!(!out.exists(), "no archive is written");
        }
        Ok(()) => {
            r.expect("CheckpointContainer where criu check passes");
            assert!(out.is_file());
        }
    }
    // Still running, and counting.
    let st = container_status(&mut c, &id).await;
    assert_eq!(st.state, cri::ContainerState::ContainerRunning as i32);
    let before = counter(&mut c, &id).await;
    tokio::time::sleep(std::time::Duration::from_millis(700)).await;
    assert!(counter(&mut c, &id).await > before, "the counter goes on");

    // A location that is not an absolute path is refused before anything else.
    let e = c
        .checkpoint_container(cri::CheckpointContainerRequest {
            container_id: id.clone(),
            location: "relative.tar".into(),
            timeout: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    stop_and_remove_pod(&mut c, &sb).await;
}

/// Appends a file entry `name` with `data` to a tar.
fn file(b: &mut tar::Builder<Vec<u8>>, name: &str, data: &[u8]) {
    let mut h = tar::Header::new_gnu();
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::Regular);
    b.append_data(&mut h, name, data).unwrap();
}

/// An archive in the checkpoint layout: `image` as its image, `spec.dump`'s process running
/// `args`, CRIU images that are not (CRIU refuses them, or cannot run), a rootfs diff adding
/// `/restored` and deleting `/etc/hostname`, and `extra` entries (name, bytes).
fn archive(path: &Path, image: &str, args: &[&str], extra: &[(&str, Vec<u8>)]) {
    let mut diff = tar::Builder::new(Vec::new());
    file(&mut diff, "restored", b"from-archive\n");
    let diff = diff.into_inner().unwrap();
    let config = serde_json::json!({
        "id": "0123", "name": "count", "rootfsImageName": image, "runtime": "runc",
        "createdTime": "2026-01-01T00:00:00Z", "checkpointedTime": "2026-01-01T00:01:00Z",
        "restoredTime": "0001-01-01T00:00:00Z", "restored": false,
    });
    let spec = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {"args": args, "cwd": "/", "env": ["PATH=/bin", "FROM=archive"],
                    "user": {"uid": 0, "gid": 0}},
        "root": {"path": "rootfs"},
    });
    let mut b = tar::Builder::new(Vec::new());
    file(&mut b, "config.dump", &serde_json::to_vec(&config).unwrap());
    file(&mut b, "spec.dump", &serde_json::to_vec(&spec).unwrap());
    file(&mut b, "checkpoint/inventory.img", b"not a CRIU image");
    // What runc reads before it runs CRIU: the checkpointed process's stdio.
    file(
        &mut b,
        "checkpoint/descriptors.json",
        br#"["/dev/null","pipe:[1]","pipe:[2]"]"#,
    );
    file(&mut b, "rootfs-diff.tar", &diff);
    file(&mut b, "deleted.files", br#"["/etc/hostname"]"#);
    for (name, data) in extra {
        file(&mut b, name, data);
    }
    std::fs::write(path, b.into_inner().unwrap()).unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restore_applies_the_archives_files_and_a_failed_one_leaves_nothing_running() {
    let archives = tempfile::tempdir().unwrap();
    let dir = archives.path().display().to_string();
    let Some((env, image, mut c)) = with_busybox_args(&["--checkpoint-restore-dir", &dir]).await
    else {
        return;
    };
    let pod = pod_config("restore", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    let ar = archives.path().join("count.tar");
    archive(&ar, &image, &["sh", "-c", "sleep 1000"], &[]);
    let config = |image: &str| cri::ContainerConfig {
        image: Some(cri::ImageSpec {
            image: image.into(),
            ..Default::default()
        }),
        ..sh_container_config("count", image, "exit 3")
    };
    let id = create_container(&mut c, &sb, &pod, config(&ar.display().to_string()))
        .await
        .expect("CreateContainer from the archive");
    // Made from the archive's image, with its rootfs changes and its process.
    let rootfs = env.state().join("containers").join(&id).join("rootfs");
    assert_eq!(
        std::fs::read_to_string(rootfs.join("restored")).unwrap(),
        "from-archive\n"
    );
    assert!(
        !rootfs.join("etc/hostname").exists(),
        "deleted.files applied"
    );
    assert!(rootfs.join("bin/busybox").exists(), "the image's files");
    let spec: serde_json::Value = serde_json::from_slice(
        &std::fs::read(env.state().join("b").join(&id[..32]).join("config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        spec["process"]["args"],
        serde_json::json!(["sh", "-c", "sleep 1000"])
    );
    assert!(
        spec["process"]["env"]
            .as_array()
            .unwrap()
            .contains(&"FROM=archive".into()),
        "{}",
        spec["process"]
    );

    // StartContainer restores: CRIU cannot here (or refuses the fake images): a clear error,
    // the container exited with the reason, nothing left in runc, no monitor or process.
    let e = c
        .start_container(cri::StartContainerRequest {
            container_id: id.clone(),
        })
        .await
        .unwrap_err();
    assert!(
        e.message().contains("restoring container") && e.message().contains("runc restore"),
        "{e:?}"
    );
    if let Err(reason) = criu_check() {
        assert!(
            e.message().contains(&reason),
            "{e:?} should name {reason:?}"
        );
    }
    let st = container_status(&mut c, &id).await;
    assert_eq!(st.state, cri::ContainerState::ContainerExited as i32);
    assert_eq!(st.reason, "StartError");
    assert!(
        !runc_list(&env.state().join("runc")).contains(&id),
        "runc still has {id}"
    );
    assert!(
        processes_mentioning(&id).is_empty(),
        "a process of {id} is left"
    );
    remove_container(&mut c, &id).await;

    // A hostile archive: an entry escaping the directory it is unpacked in. Refused with the
    // reason, and no container is left half-made.
    let evil = archives.path().join("evil.tar");
    archive(&evil, &image, &["true"], &[]);
    let mut bytes = std::fs::read(&evil).unwrap();
    // Append a raw entry named `../escaped` in place of the end-of-archive blocks.
    bytes.truncate(bytes.len() - 1024);
    let mut h = tar::Header::new_ustar();
    h.as_ustar_mut().unwrap().name[..10].copy_from_slice(b"../escaped");
    h.set_size(0);
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::Regular);
    h.set_cksum();
    bytes.extend_from_slice(h.as_bytes());
    bytes.extend_from_slice(&[0; 1024]);
    std::fs::write(&evil, bytes).unwrap();
    let e = create_container(&mut c, &sb, &pod, config(&evil.display().to_string()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("evil.tar"), "{e:?}");
    assert!(list_containers(&mut c).await.is_empty());
    // No archive metadata: refused as well.
    let junk = archives.path().join("junk.tar");
    std::fs::write(&junk, tar::Builder::new(Vec::new()).into_inner().unwrap()).unwrap();
    let e = create_container(&mut c, &sb, &pod, config(&junk.display().to_string()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("has no config.dump"), "{e:?}");
    stop_and_remove_pod(&mut c, &sb).await;
    // The removed container's teardown runs in the background.
    let containers = env.state().join("containers");
    eventually("no container directory left", || {
        std::fs::read_dir(&containers).map_or(true, |mut d| d.next().is_none())
    })
    .await;
}

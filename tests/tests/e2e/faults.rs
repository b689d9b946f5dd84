//! Faults: the daemon killed (SIGKILL) in the middle of an operation leaves a state the next
//! start finishes or undoes, with nothing half-done ever used; a component failing (the OCI
//! runtime in `create`) leaves a clear error and nothing behind. More of the matrix (SIGKILL
//! during pull: pulls.rs and kubelet_release.rs; registry faults: pulls.rs; a failing
//! CNI plugin: pod_rollback.rs) lives with the feature it exercises; docs/hardening.md lists it.
//!
//! The pod tests need root, runc and Debian's CNI plugins ([`skip_reason`]).

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use minicri_proto::runtime::v1 as cri;
use minicri_tests::daemon::{Daemon, HostsDir};
use minicri_tests::images::{Compression, ImageBuilder, LayerBuilder, RegistryClient};
use minicri_tests::pod_env::{
    PodEnv, eventually, mounts_under, output_lines, pod_config, ports_of, processes_mentioning,
    skip_reason, write_executable,
};
use minicri_tests::pod_rpc::{
    RuntimeClient, assert_container_not_found, container_config, container_status,
    create_container, list_containers, list_pod_sandboxes, pod_sandbox_status, remove_pod_sandbox,
    run_container, run_pod, stop_and_remove_pod, stop_container, stop_pod_sandbox,
};
use minicri_tests::registry::Registry;
use minicri_tests::small_disk::SmallDisk;

fn spec(image: &str) -> Option<cri::ImageSpec> {
    Some(cri::ImageSpec {
        image: image.into(),
        ..Default::default()
    })
}

fn names(dir: &Path) -> BTreeSet<OsString> {
    std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default()
}

fn blobs(root: &Path) -> BTreeSet<String> {
    names(&root.join("content/blobs/sha256"))
        .into_iter()
        .map(|n| format!("sha256:{}", n.to_string_lossy()))
        .collect()
}

async fn pull(d: &Daemon, image: &str) -> String {
    d.images()
        .await
        .unwrap()
        .pull_image(cri::PullImageRequest {
            image: spec(image),
            auth: None,
            sandbox_config: None,
        })
        .await
        .unwrap_or_else(|e| panic!("pull {image}: {e:?}"))
        .into_inner()
        .image_ref
}

/// RemoveImage returns once the record is gone and removes the snapshots and blobs in the
/// background; SIGKILL right then, and the next start finishes the removal: the image's
/// snapshots and blobs go, nothing is left in the snapshotter's tmp, and pulling the image again
/// unpacks it afresh.
#[tokio::test(flavor = "multi_thread")]
async fn sigkill_during_remove_image_is_finished_at_the_next_start() {
    let registry = Registry::start();
    let hosts = HostsDir::new();
    let mut d = Daemon::start(hosts.path()).await.expect("minicri");
    let client = RegistryClient::new(&registry.addr());
    // Four layers of 4,096 files: their removal takes long enough to be interrupted.
    let layers = (0..4).map(|l| {
        let mut b = LayerBuilder::new().dir(&format!("l{l}"), 0o755);
        for f in 0..4096 {
            b = b.file(&format!("l{l}/f{f}"), format!("{l}/{f}\n"), 0o644);
        }
        b.build(Compression::Gzip).unwrap()
    });
    let pushed = ImageBuilder::busybox()
        .layers(layers)
        .push(&client, "faults/many:1")
        .await
        .expect("push");
    let image = format!("{}/faults/many:1", registry.addr());
    let root = d.root();
    let snapshots = root.join("snapshots/snapshots");
    assert_eq!(pull(&d, &image).await, pushed.config_digest);
    let own_snapshots = names(&snapshots);
    // The layers' compressed blobs went once they were unpacked; the config stays.
    let own_blobs: BTreeSet<String> = [pushed.config_digest.clone()].into();
    assert_eq!(own_snapshots.len(), 5, "{own_snapshots:?}");
    assert!(own_blobs.is_subset(&blobs(&root)));
    assert!(
        pushed
            .layers
            .iter()
            .all(|l| !blobs(&root).contains(&l.digest))
    );

    d.images()
        .await
        .unwrap()
        .remove_image(cri::RemoveImageRequest {
            image: spec(&image),
        })
        .await
        .expect("RemoveImage");
    d.kill();
    // The kill came before the background work was done (else this test shows nothing).
    let snapshots_left = names(&snapshots).intersection(&own_snapshots).count();
    let blobs_left = blobs(&root).intersection(&own_blobs).count();
    let tmp_left = names(&root.join("snapshots/tmp")).len();
    eprintln!(
        "killed with {snapshots_left} snapshots, {blobs_left} blobs and {tmp_left} trees in tmp left"
    );
    assert!(
        snapshots_left + blobs_left + tmp_left > 0,
        "the removal had finished before the kill"
    );

    d.restart().await.expect("restart");
    let mut c = d.images().await.unwrap();
    let listed = c
        .list_images(cri::ListImagesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .images;
    assert!(
        listed.iter().all(|i| i.id != pushed.config_digest),
        "the removed image is listed again"
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = names(&snapshots).intersection(&own_snapshots).count();
        let b = blobs(&root).intersection(&own_blobs).count();
        let t = names(&root.join("snapshots/tmp")).len();
        if s + b + t == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after the restart, still {s} snapshots, {b} blobs and {t} trees in tmp"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Pulled again: a fresh unpack, whole.
    assert_eq!(pull(&d, &image).await, pushed.config_digest);
    let again = names(&snapshots);
    assert_eq!(again.len(), 5, "{again:?}");
    let files: usize = again.iter().map(|s| walk_count(&snapshots.join(s))).sum();
    assert!(files >= 4 * 4096, "only {files} entries unpacked");
}

fn walk_count(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| {
                    if e.file_type().is_ok_and(|t| t.is_dir()) {
                        1 + walk_count(&e.path())
                    } else {
                        1
                    }
                })
                .sum()
        })
        .unwrap_or(0)
}

// ---- Pods: SIGKILL half-way through RunPodSandbox, CreateContainer, StartContainer and
// StopPodSandbox, and a runtime failing in `create`. Real runc and CNI plugins; the slow or failing
// step is a wrapper script around them, steered by flag files in its directory.

/// A directory holding `runc-wrapper` (runs runc; with the flag `fail-create` it fails `create`
/// as runc does, logging the error; with `hang-start` or `hang-delete` it touches
/// `<command>-started` and blocks in that command until `release`, then fails) and
/// `cni/minicri-test-hang` (a CNI plugin for the end of a chain: ADD touches `add-started`, with
/// `hang-add` blocks until `release`, and fails; DEL succeeds).
struct Injector {
    dir: tempfile::TempDir,
}

impl Injector {
    fn new() -> Injector {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().display().to_string();
        let runc = format!(
            r#"#!/bin/sh
D={d}
log=""; prev=""; cmd=""
for a in "$@"; do
    [ "$prev" = "--log" ] && log="$a"
    case "$a" in create|start|delete) [ -z "$cmd" ] && cmd="$a";; esac
    prev="$a"
done
if [ "$cmd" = create ] && [ -e "$D/fail-create" ]; then
    printf '{{"level":"error","msg":"injected: runc create failed","time":"2026-01-01T00:00:00Z"}}\n' >>"$log"
    exit 1
fi
if [ -e "$D/hang-$cmd" ]; then
    touch "$D/$cmd-started"
    while [ ! -e "$D/release" ]; do sleep 0.05; done
    exit 1
fi
exec runc "$@"
"#
        );
        let plugin = format!(
            r#"#!/bin/sh
D={d}
case "$CNI_COMMAND" in
ADD)
    cat >/dev/null
    touch "$D/add-started"
    if [ -e "$D/hang-add" ]; then
        while [ ! -e "$D/release" ]; do sleep 0.05; done
        echo '{{"cniVersion":"1.0.0","code":999,"msg":"released"}}'
        exit 1
    fi
    echo '{{"cniVersion":"1.0.0","code":999,"msg":"this plugin only hangs"}}'
    exit 1;;
DEL)
    cat >/dev/null
    exit 0;;
VERSION)
    echo '{{"cniVersion":"1.0.0","supportedVersions":["0.4.0","1.0.0"]}}';;
esac
exit 0
"#
        );
        std::fs::create_dir(dir.path().join("cni")).unwrap();
        for (path, text) in [
            (dir.path().join("runc-wrapper"), runc),
            (dir.path().join("cni/minicri-test-hang"), plugin),
        ] {
            write_executable(&path, &text);
        }
        Injector { dir }
    }

    /// Daemon arguments that put the wrapper and the plugin in place.
    fn args(&self) -> Vec<String> {
        let d = self.dir.path();
        vec![
            "--oci-runtime".into(),
            d.join("runc-wrapper").display().to_string(),
            "--cni-bin-dir".into(),
            d.join("cni").display().to_string(),
            "--cni-bin-dir".into(),
            "/usr/lib/cni".into(),
            "--cni-bin-dir".into(),
            "/opt/cni/bin".into(),
        ]
    }

    fn set(&self, flag: &str) {
        std::fs::write(self.dir.path().join(flag), b"").unwrap();
    }

    fn clear(&self, flag: &str) {
        let _ = std::fs::remove_file(self.dir.path().join(flag));
    }

    async fn wait_for(&self, flag: &str) {
        let p = self.dir.path().join(flag);
        eventually(flag, || p.exists()).await;
    }
}

impl Drop for Injector {
    fn drop(&mut self) {
        // Whatever still waits in a wrapper goes on and ends.
        self.set("release");
    }
}

async fn pod_env_with(inj: &Injector) -> PodEnv {
    let args = inj.args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    PodEnv::with_args(&args).await
}

/// The CNI configuration of `env`, the name of its bridge, and its host-local IPAM directory.
fn network_of(env: &PodEnv) -> (PathBuf, serde_json::Value, String, PathBuf) {
    let dir = env.daemon.root().parent().unwrap().to_path_buf();
    let conf = dir.join("cni/10-test.conflist");
    let list: serde_json::Value = serde_json::from_slice(&std::fs::read(&conf).unwrap()).unwrap();
    let bridge = list["plugins"][0]["bridge"].as_str().unwrap().to_string();
    (conf, list, bridge, dir.join("ipam"))
}

/// Rewrites the conflist at `conf` as `good` with the injector's hanging plugin at its end.
fn chain_the_hanging_plugin(conf: &Path, good: &serde_json::Value) {
    let mut chained = good.clone();
    chained["plugins"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({ "type": "minicri-test-hang" }));
    std::fs::write(conf, serde_json::to_vec(&chained).unwrap()).unwrap();
}

/// Addresses host-local holds (files named as IPs under its data directory).
fn leases(ipam: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for net in std::fs::read_dir(ipam).into_iter().flatten().flatten() {
        for f in std::fs::read_dir(net.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            let n = f.file_name().to_string_lossy().into_owned();
            if n.parse::<std::net::IpAddr>().is_ok() {
                out.push(n);
            }
        }
    }
    out
}

/// Operations the daemon has journaled and not finished.
fn journals(env: &PodEnv) -> BTreeSet<OsString> {
    names(&env.state().join("pods/inflight"))
}

/// The ids of the containers runc knows under the daemon's runtime root.
fn runc_ids(env: &PodEnv) -> Vec<String> {
    output_lines(
        std::process::Command::new("runc")
            .arg("--root")
            .arg(env.state().join("runc"))
            .args(["list", "-q"]),
    )
}

/// Runs `call` in a task until the wrapper it reaches touches `<step>-started` (blocked by the
/// flag `hang-<step>`), then SIGKILLs the daemon, checks that the call failed, and lets the
/// wrapper go on (it fails).
async fn kill_during<T: Send + 'static>(
    env: &mut PodEnv,
    inj: &Injector,
    step: &str,
    call: impl std::future::Future<Output = Result<T, tonic::Status>> + Send + 'static,
) {
    inj.set(&format!("hang-{step}"));
    let call = tokio::spawn(call);
    inj.wait_for(&format!("{step}-started")).await;
    env.daemon.kill();
    assert!(call.await.unwrap().is_err(), "the call outlived the daemon");
    inj.clear(&format!("hang-{step}"));
    inj.set("release");
}

/// A running pod `name` with a created (not started) busybox container `container` that would
/// sleep: (client, pod config, sandbox id, container id).
async fn pod_with_created_container(
    env: &PodEnv,
    name: &str,
    container: &str,
) -> (RuntimeClient, cri::PodSandboxConfig, String, String) {
    env.pull_busybox().await;
    let mut c = env.runtime().await;
    let pod = pod_config(name, env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    let image = env.set.busybox_oci.reference.clone();
    let cid = create_container(
        &mut c,
        &sb,
        &pod,
        container_config(container, &image, &["sleep", "1000"]),
    )
    .await
    .unwrap();
    (c, pod, sb, cid)
}

/// SIGKILL while the last CNI plugin of the chain is in ADD (the bridge plugin before it has
/// plugged a veth in and host-local has leased an address): the next start undoes the sandbox
/// (CNI DEL, network namespace, files, infra), nothing is listed, and the name is free again.
#[tokio::test(flavor = "multi_thread")]
async fn sigkill_during_run_pod_sandbox_is_undone_at_the_next_start() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let inj = Injector::new();
    let mut env = pod_env_with(&inj).await;
    let (conf, good, bridge, ipam) = network_of(&env);
    chain_the_hanging_plugin(&conf, &good);
    let pod = pod_config("killed-in-run", env.logs.path());
    let c = env.runtime().await;
    let run = {
        let (pod, mut c) = (pod.clone(), c.clone());
        async move {
            c.run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(pod),
                runtime_handler: String::new(),
            })
            .await
        }
    };
    kill_during(&mut env, &inj, "add", run).await;
    assert_eq!(ports_of(&bridge).len(), 1, "the bridge plugin ran first");
    assert_eq!(leases(&ipam).len(), 1);

    env.daemon.restart().await.unwrap();
    let mut c2 = env.runtime().await;
    assert!(list_pod_sandboxes(&mut c2).await.is_empty());
    assert!(ports_of(&bridge).is_empty(), "the veth is gone (CNI DEL)");
    assert!(leases(&ipam).is_empty(), "the address is released");
    let stray = env.stray_state();
    assert!(stray.is_empty(), "left behind: {stray:?}");
    assert!(journals(&env).is_empty());
    assert!(names(&env.state().join("sandboxes")).is_empty());

    // The name is free: with the chain fixed, the same pod runs.
    std::fs::write(&conf, serde_json::to_vec(&good).unwrap()).unwrap();
    let mut c = c2;
    let id = run_pod(&mut c, &pod).await;
    assert_eq!(ports_of(&bridge).len(), 1);
    stop_and_remove_pod(&mut c, &id).await;
    assert!(env.stray_state().is_empty());
}

/// RunPodSandbox attaches the network while the infra container is created and started (neither
/// waits for the other): with the last CNI plugin hanging in ADD, the infra already runs. When
/// the plugin then fails, the call fails with its message and both halves are undone: no infra
/// container, veth, address or namespace is left, and nothing is listed.
#[tokio::test(flavor = "multi_thread")]
async fn the_infra_starts_while_cni_adds_and_a_failed_add_undoes_both() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let inj = Injector::new();
    let env = pod_env_with(&inj).await;
    let (conf, good, bridge, ipam) = network_of(&env);
    chain_the_hanging_plugin(&conf, &good);
    let mut c = env.runtime().await;
    inj.set("hang-add");
    let run = {
        let (pod, mut c) = (pod_config("overlap", env.logs.path()), c.clone());
        tokio::spawn(async move {
            c.run_pod_sandbox(cri::RunPodSandboxRequest {
                config: Some(pod),
                runtime_handler: String::new(),
            })
            .await
        })
    };
    inj.wait_for("add-started").await;
    eventually("the infra container to run while CNI ADD hangs", || {
        output_lines(
            std::process::Command::new("runc")
                .arg("--root")
                .arg(env.state().join("runc"))
                .arg("list"),
        )
        .iter()
        .skip(1)
        .any(|l| l.split_whitespace().nth(2) == Some("running"))
    })
    .await;

    inj.set("release");
    let err = run
        .await
        .unwrap()
        .expect_err("the failed ADD fails the call");
    assert!(err.message().contains("released"), "{err:?}");
    assert!(runc_ids(&env).is_empty(), "the infra container is deleted");
    assert!(ports_of(&bridge).is_empty(), "the veth is gone (CNI DEL)");
    assert!(leases(&ipam).is_empty(), "the address is released");
    assert!(list_pod_sandboxes(&mut c).await.is_empty());
    assert!(journals(&env).is_empty());
    eventually("nothing of the pod left", || env.stray_state().is_empty()).await;
}

/// SIGKILL during StopPodSandbox, while `runc delete` of the infra container hangs (the infra is
/// killed; the network, torn down at the same time, still recorded attached): after the restart the sandbox is not ready, a second
/// StopPodSandbox (the kubelet's retry) finishes the teardown (CNI DEL, network namespace) and
/// RemovePodSandbox leaves nothing.
#[tokio::test(flavor = "multi_thread")]
async fn sigkill_during_stop_pod_sandbox_is_finished_by_the_next_stop() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let inj = Injector::new();
    let mut env = pod_env_with(&inj).await;
    let (_, _, bridge, ipam) = network_of(&env);
    let mut c = env.runtime().await;
    let pod = pod_config("killed-in-stop", env.logs.path());
    let id = run_pod(&mut c, &pod).await;
    assert_eq!(leases(&ipam).len(), 1);
    let stop = {
        let (mut c, id) = (c.clone(), id.clone());
        async move {
            c.stop_pod_sandbox(cri::StopPodSandboxRequest { pod_sandbox_id: id })
                .await
        }
    };
    // The network goes at the same time as the infra: when the kill comes (the infra's delete
    // hangs), its CNI DEL may or may not have finished. Either way the record still says
    // attached (it is updated once both are done), so the next stop runs DEL again.
    kill_during(&mut env, &inj, "delete", stop).await;

    env.daemon.restart().await.unwrap();
    let mut c = env.runtime().await;
    let st = pod_sandbox_status(&mut c, &id).await;
    assert_eq!(st.state, cri::PodSandboxState::SandboxNotready as i32);
    stop_pod_sandbox(&mut c, &id).await;
    assert!(ports_of(&bridge).is_empty());
    assert!(leases(&ipam).is_empty());
    remove_pod_sandbox(&mut c, &id).await;
    let stray = env.stray_state();
    assert!(stray.is_empty(), "left behind: {stray:?}");
    assert!(list_pod_sandboxes(&mut c).await.is_empty());
}

/// SIGKILL while `runc start` runs (the shim has created the container): the next start undoes
/// the start (shim and runtime container gone) and the container is created again, not running;
/// StartContainer then runs it.
#[tokio::test(flavor = "multi_thread")]
async fn sigkill_during_start_container_leaves_it_created() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let inj = Injector::new();
    let mut env = pod_env_with(&inj).await;
    let (c, _, sb, cid) = pod_with_created_container(&env, "killed-in-start", "main").await;
    let start = {
        let (mut c, cid) = (c.clone(), cid.clone());
        async move {
            c.start_container(cri::StartContainerRequest { container_id: cid })
                .await
        }
    };
    kill_during(&mut env, &inj, "start", start).await;
    // `runc start` blocked in the wrapper: the shim had created the container.
    assert!(
        runc_ids(&env).contains(&cid),
        "the shim created the container"
    );
    assert!(!processes_mentioning(&cid).is_empty());

    env.daemon.restart().await.unwrap();
    let mut c = env.runtime().await;
    let st = container_status(&mut c, &cid).await;
    assert_eq!(st.state, cri::ContainerState::ContainerCreated as i32);
    assert!(!runc_ids(&env).contains(&cid), "runc still has it");
    eventually("the container's shim to be gone", || {
        processes_mentioning(&cid).is_empty()
    })
    .await;
    assert!(journals(&env).is_empty());

    c.start_container(cri::StartContainerRequest {
        container_id: cid.clone(),
    })
    .await
    .expect("the created container starts");
    let st = container_status(&mut c, &cid).await;
    assert_eq!(st.state, cri::ContainerState::ContainerRunning as i32);
    stop_and_remove_pod(&mut c, &sb).await;
    let stray = env.stray_state();
    assert!(stray.is_empty(), "left behind: {stray:?}");
}

/// The shim of a running container is killed while the daemon is down (the OOM killer, an
/// operator): the next start records the container as exited with no status, and must also see
/// that its process does not run on unmonitored (StopContainer skips an exited container).
#[tokio::test(flavor = "multi_thread")]
async fn a_container_whose_shim_died_while_the_daemon_was_down_does_not_run_on() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let inj = Injector::new();
    let mut env = pod_env_with(&inj).await;
    let (mut c, _, sb, cid) = pod_with_created_container(&env, "orphaned", "main").await;
    c.start_container(cri::StartContainerRequest {
        container_id: cid.clone(),
    })
    .await
    .expect("StartContainer");
    let bundle = env.state().join("b").join(&cid[..cid.len().min(32)]);
    let pid_in = |name: &str| -> i32 {
        std::fs::read_to_string(bundle.join(name))
            .unwrap_or_else(|e| panic!("{name}: {e}"))
            .trim()
            .parse()
            .unwrap()
    };
    let (shim, init) = (pid_in("shim.pid"), pid_in("init.pid"));
    let alive = |pid: i32| Path::new(&format!("/proc/{pid}")).exists();
    assert!(alive(init), "the container runs");

    env.daemon.kill();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(shim),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    eventually("the shim to be gone", || !alive(shim)).await;
    assert!(alive(init), "the container outlives its shim");

    env.daemon.restart().await.unwrap();
    let mut c = env.runtime().await;
    let st = container_status(&mut c, &cid).await;
    assert_eq!(st.state, cri::ContainerState::ContainerExited as i32);
    assert_eq!(st.reason, "Unknown");
    eventually("the container's process to be killed", || !alive(init)).await;
    eventually("runc to forget it", || !runc_ids(&env).contains(&cid)).await;
    stop_and_remove_pod(&mut c, &sb).await;
    let stray = env.stray_state();
    assert!(stray.is_empty(), "left behind: {stray:?}");
}

/// RemoveContainer does not wait for the container's teardown: with `runc delete` hanging (the
/// delete after the exit holds the container), it returns at once, and the container is gone
/// from listings and status. A SIGKILL in the middle of the teardown leaves its record under
/// `pods/removing/`; the next start finishes it (runtime state, rootfs mount, directories) and
/// the container never comes back.
#[tokio::test(flavor = "multi_thread")]
async fn remove_container_returns_before_its_teardown_which_a_restart_finishes() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let inj = Injector::new();
    let mut env = pod_env_with(&inj).await;
    let (mut c, _, sb, cid) = pod_with_created_container(&env, "removed", "main").await;
    c.start_container(cri::StartContainerRequest {
        container_id: cid.clone(),
    })
    .await
    .expect("StartContainer");
    inj.set("hang-delete");
    stop_container(&mut c, &cid, 0).await;
    inj.wait_for("delete-started").await;

    let t = Instant::now();
    let remove = c.remove_container(cri::RemoveContainerRequest {
        container_id: cid.clone(),
    });
    tokio::time::timeout(Duration::from_secs(5), remove)
        .await
        .expect("RemoveContainer waited for the hanging runtime")
        .expect("RemoveContainer");
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "RemoveContainer waited for the runtime: {:?}",
        t.elapsed()
    );
    let listed = list_containers(&mut c).await;
    assert!(listed.iter().all(|x| x.id != cid), "still listed");
    assert_container_not_found(&mut c, &cid).await;
    let pending = env
        .state()
        .join("pods/removing")
        .join(format!("{cid}.json"));
    assert!(pending.exists(), "the teardown is under way");
    assert!(runc_ids(&env).contains(&cid), "runc delete hangs");

    // The daemon dies half-way through the teardown; the next start finishes it.
    env.daemon.kill();
    inj.clear("hang-delete");
    inj.set("release");
    env.daemon.restart().await.unwrap();
    let mut c = env.runtime().await;
    eventually("the teardown to finish after the restart", || {
        !pending.exists()
    })
    .await;
    assert!(!runc_ids(&env).contains(&cid), "runc still has it");
    assert!(mounts_under(&env.state()).iter().all(|m| !m.contains(&cid)));
    assert!(!env.state().join("containers").join(&cid).exists());
    let listed = list_containers(&mut c).await;
    assert!(listed.iter().all(|x| x.id != cid), "back after the restart");
    stop_and_remove_pod(&mut c, &sb).await;
    let stray = env.stray_state();
    assert!(stray.is_empty(), "left behind: {stray:?}");
}

/// The OCI runtime failing in `create`: StartContainer fails with the runtime's own message, the
/// container is recorded as exited (StartError), nothing of it is left running, and the pod
/// goes on (another container starts).
#[tokio::test(flavor = "multi_thread")]
async fn runc_failing_in_create_fails_the_start_and_leaves_nothing() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let inj = Injector::new();
    let env = pod_env_with(&inj).await;
    let (mut c, pod, sb, cid) = pod_with_created_container(&env, "create-fails", "broken").await;
    let image = env.set.busybox_oci.reference.clone();
    inj.set("fail-create");
    let err = c
        .start_container(cri::StartContainerRequest {
            container_id: cid.clone(),
        })
        .await
        .unwrap_err();
    assert!(
        err.message().contains("injected: runc create failed"),
        "the runtime's message reaches the caller: {err:?}"
    );
    let st = container_status(&mut c, &cid).await;
    assert_eq!(st.state, cri::ContainerState::ContainerExited as i32);
    assert_eq!(st.reason, "StartError");
    assert!(!runc_ids(&env).contains(&cid));
    eventually("the failed container's shim to be gone", || {
        processes_mentioning(&cid).is_empty()
    })
    .await;
    assert!(journals(&env).is_empty());

    inj.clear("fail-create");
    let ok = run_container(
        &mut c,
        &sb,
        &pod,
        container_config("works", &image, &["sleep", "1000"]),
    )
    .await;
    assert_eq!(
        container_status(&mut c, &ok).await.state,
        cri::ContainerState::ContainerRunning as i32
    );
    c.remove_container(cri::RemoveContainerRequest {
        container_id: cid.clone(),
    })
    .await
    .expect("RemoveContainer of the failed one");
    stop_and_remove_pod(&mut c, &sb).await;
    let stray = env.stray_state();
    assert!(stray.is_empty(), "left behind: {stray:?}");
}

/// SIGKILL at a sweep of moments during CreateContainer (a few milliseconds of snapshot,
/// mount and bundle work): after each restart the container is either whole and listed or
/// gone without a trace (no directory, mount, bundle or snapshot of it). The sweep must hit
/// the operation half-way at least once (a journal left), or it shows nothing.
#[tokio::test(flavor = "multi_thread")]
async fn sigkill_during_create_container_leaves_it_whole_or_gone() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let mut env = PodEnv::new().await;
    env.pull_busybox().await;
    let mut c = env.runtime().await;
    let pod = pod_config("killed-in-create", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    let image = env.set.busybox_oci.reference.clone();
    let snapshots = env.daemon.root().join("snapshots/snapshots");
    let base_snapshots = names(&snapshots);
    let base_bundles = names(&env.state().join("b"));
    let (mut interrupted, mut whole, mut never) = (0, 0, 0);
    for (i, delay_ms) in [0u64, 1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 40]
        .into_iter()
        .enumerate()
    {
        let call = {
            let mut c = c.clone();
            let (pod, sb) = (pod.clone(), sb.clone());
            let config = container_config(&format!("c{i}"), &image, &["sleep", "1000"]);
            tokio::spawn(async move { create_container(&mut c, &sb, &pod, config).await })
        };
        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
        env.daemon.kill();
        let _ = call.await;
        if !journals(&env).is_empty() {
            interrupted += 1;
        }
        env.daemon.restart().await.unwrap();
        c = env.runtime().await;
        let listed = c
            .list_containers(cri::ListContainersRequest::default())
            .await
            .unwrap()
            .into_inner()
            .containers;
        assert!(journals(&env).is_empty(), "journals left after the restart");
        let dirs = names(&env.state().join("containers"));
        let mounts = mounts_under(&env.state().join("containers"));
        let snaps: BTreeSet<_> = names(&snapshots)
            .difference(&base_snapshots)
            .cloned()
            .collect();
        let bundles: BTreeSet<_> = names(&env.state().join("b"))
            .difference(&base_bundles)
            .cloned()
            .collect();
        match listed.as_slice() {
            [] => {
                never += 1;
                assert!(dirs.is_empty(), "kill at {delay_ms} ms: dirs {dirs:?}");
                assert!(
                    mounts.is_empty(),
                    "kill at {delay_ms} ms: mounts {mounts:?}"
                );
                assert!(
                    snaps.is_empty(),
                    "kill at {delay_ms} ms: snapshots {snaps:?}"
                );
                assert!(
                    bundles.is_empty(),
                    "kill at {delay_ms} ms: bundles {bundles:?}"
                );
            }
            [one] => {
                whole += 1;
                assert_eq!(dirs.len(), 1, "kill at {delay_ms} ms: {dirs:?}");
                assert_eq!(snaps.len(), 1, "kill at {delay_ms} ms: {snaps:?}");
                assert_eq!(bundles.len(), 1, "kill at {delay_ms} ms: {bundles:?}");
                // Whole: it starts and runs.
                c.start_container(cri::StartContainerRequest {
                    container_id: one.id.clone(),
                })
                .await
                .unwrap_or_else(|e| panic!("kill at {delay_ms} ms: start: {e:?}"));
                stop_container(&mut c, &one.id, 0).await;
                c.remove_container(cri::RemoveContainerRequest {
                    container_id: one.id.clone(),
                })
                .await
                .unwrap();
            }
            more => panic!("kill at {delay_ms} ms: {} containers", more.len()),
        }
    }
    eprintln!(
        "CreateContainer killed: {interrupted} times half-way, {whole} times after it finished, \
         {never} times with no container"
    );
    assert!(
        interrupted > 0,
        "no kill came half-way through CreateContainer"
    );
    stop_and_remove_pod(&mut c, &sb).await;
    let stray = env.stray_state();
    assert!(stray.is_empty(), "left behind: {stray:?}");
}

// ---- Images: SIGKILL during an unpack, and a full disk during a download and during an unpack.

/// SIGKILL while a layer of 30,000 files is unpacked (its tree in the snapshotter's tmp): the
/// next start removes the half-made tree, the image is not listed, and pulling it again
/// unpacks it whole.
#[tokio::test(flavor = "multi_thread")]
async fn sigkill_during_unpack_leaves_no_half_snapshot() {
    let registry = Registry::start();
    let hosts = HostsDir::new();
    let mut d = Daemon::start(hosts.path()).await.expect("minicri");
    let client = RegistryClient::new(&registry.addr());
    let mut b = LayerBuilder::new().dir("many", 0o755);
    for f in 0..30_000 {
        b = b.file(&format!("many/f{f}"), format!("{f}\n"), 0o644);
    }
    let pushed = ImageBuilder::busybox()
        .layer(b.build(Compression::Gzip).unwrap())
        .push(&client, "faults/unpack:1")
        .await
        .expect("push");
    let image = format!("{}/faults/unpack:1", registry.addr());
    let root = d.root();
    let tmp = root.join("snapshots/tmp");
    let snapshots = root.join("snapshots/snapshots");

    let call = {
        let images = d.images().await.unwrap();
        let image = image.clone();
        tokio::spawn(async move {
            let mut images = images;
            images
                .pull_image(cri::PullImageRequest {
                    image: spec(&image),
                    auth: None,
                    sandbox_config: None,
                })
                .await
        })
    };
    // The busybox layer unpacks first; the big one is the tree that stays in tmp for a while.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if names(&snapshots).len() == 1 && walk_count(&tmp) > 1000 {
            break;
        }
        assert!(Instant::now() < deadline, "the unpack never showed in tmp");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    d.kill();
    assert!(call.await.unwrap().is_err());
    let half = walk_count(&tmp);
    eprintln!("killed with {half} entries of the layer unpacked in tmp");

    d.restart().await.expect("restart");
    let mut c = d.images().await.unwrap();
    let listed = c
        .list_images(cri::ListImagesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .images;
    assert!(listed.iter().all(|i| i.id != pushed.config_digest));
    let deadline = Instant::now() + Duration::from_secs(30);
    while !names(&tmp).is_empty() {
        assert!(
            Instant::now() < deadline,
            "tmp still holds {:?}",
            names(&tmp)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    assert_eq!(pull(&d, &image).await, pushed.config_digest);
    let snaps = names(&snapshots);
    assert_eq!(snaps.len(), 2);
    let files: usize = snaps.iter().map(|s| walk_count(&snapshots.join(s))).sum();
    assert!(files > 30_000, "only {files} entries unpacked");
}

async fn pull_result(d: &Daemon, image: &str) -> Result<String, tonic::Status> {
    Ok(d.images()
        .await
        .unwrap()
        .pull_image(cri::PullImageRequest {
            image: spec(image),
            auth: None,
            sandbox_config: None,
        })
        .await?
        .into_inner()
        .image_ref)
}

/// The disk fills up during a download (a 64 MiB layer, a 48 MiB disk): PullImage fails with
/// RESOURCE_EXHAUSTED naming the full disk, the daemon goes on answering, nothing stored is
/// damaged, and once there is room the same pull completes and the image is whole.
#[tokio::test(flavor = "multi_thread")]
async fn disk_full_during_a_download_is_resource_exhausted_and_recoverable() {
    if let Some(why) = minicri_tests::pod_env::runc_skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let registry = Registry::start();
    let hosts = HostsDir::new();
    let mut d = Daemon::start(hosts.path()).await.expect("minicri");
    let disk = SmallDisk::tmpfs(&mut d, 48).await;
    let client = RegistryClient::new(&registry.addr());
    let small = ImageBuilder::busybox()
        .push(&client, "faults/small:1")
        .await
        .expect("push");
    let big = ImageBuilder::busybox()
        .layer(minicri_tests::images::random_layer(64, Compression::None, 7).unwrap())
        .push(&client, "faults/big:1")
        .await
        .expect("push");
    let small_ref = format!("{}/faults/small:1", registry.addr());
    let big_ref = format!("{}/faults/big:1", registry.addr());
    assert_eq!(pull(&d, &small_ref).await, small.config_digest);

    let err = pull_result(&d, &big_ref).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message().to_lowercase().contains("no space left"),
        "the message says the disk is full: {err:?}"
    );
    // The daemon answers, and what it had is intact.
    let mut c = d.images().await.unwrap();
    let listed = c
        .list_images(cri::ListImagesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .images;
    assert!(listed.iter().any(|i| i.id == small.config_digest));
    assert!(listed.iter().all(|i| i.id != big.config_digest));
    c.image_fs_info(cri::ImageFsInfoRequest {}).await.unwrap();

    disk.grow(256);
    assert_eq!(pull(&d, &big_ref).await, big.config_digest);
    // The config is stored intact; the layer, verified and unpacked, left no compressed copy.
    let root = d.root();
    let blob = |digest: &str| root.join("content/blobs/sha256").join(&digest[7..]);
    let bytes = std::fs::read(blob(&big.config_digest)).unwrap();
    assert_eq!(
        minicri_tests::images::sha256_digest(&bytes),
        big.config_digest
    );
    for l in &big.layers {
        assert!(!blob(&l.digest).exists(), "{} kept", l.digest);
    }
    d.kill();
}

/// The disk fills up during an unpack (a layer of 96 MiB of zeros, small compressed, on a
/// 48 MiB disk): PullImage fails with RESOURCE_EXHAUSTED, the half-made tree is removed, no
/// snapshot of the layer is kept, and once there is room the pull completes.
#[tokio::test(flavor = "multi_thread")]
async fn disk_full_during_an_unpack_is_resource_exhausted_and_recoverable() {
    if let Some(why) = minicri_tests::pod_env::runc_skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let registry = Registry::start();
    let hosts = HostsDir::new();
    let mut d = Daemon::start(hosts.path()).await.expect("minicri");
    let disk = SmallDisk::tmpfs(&mut d, 48).await;
    let client = RegistryClient::new(&registry.addr());
    let zeros = LayerBuilder::new()
        .dir("zeros", 0o755)
        .file("zeros/a", vec![0u8; 48 << 20], 0o644)
        .file("zeros/b", vec![0u8; 48 << 20], 0o644)
        .build(Compression::Gzip)
        .unwrap();
    let pushed = ImageBuilder::busybox()
        .layer(zeros)
        .push(&client, "faults/zeros:1")
        .await
        .expect("push");
    let image = format!("{}/faults/zeros:1", registry.addr());
    let root = d.root();
    let snapshots = root.join("snapshots/snapshots");

    let err = pull_result(&d, &image).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message().to_lowercase().contains("no space left"),
        "{err:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while !names(&root.join("snapshots/tmp")).is_empty() {
        assert!(Instant::now() < deadline, "the half-made tree stays in tmp");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        names(&snapshots).len(),
        1,
        "only the busybox layer is a snapshot"
    );

    disk.grow(256);
    assert_eq!(pull(&d, &image).await, pushed.config_digest);
    assert_eq!(names(&snapshots).len(), 2);
    d.kill();
}

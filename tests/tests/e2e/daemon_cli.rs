//! Black-box tests of the `minicri` binary itself: runtime info RPCs, the command line, the
//! single-instance lock, the socket's life cycle and the configuration file.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use minicri_proto::runtime::v1 as cri;
use minicri_tests::daemon::{Daemon, HostsDir, channel_to, minicri_bin};

#[tokio::test(flavor = "multi_thread")]
async fn version_status_and_runtime_config() {
    let hosts = HostsDir::new();
    let d = Daemon::start(hosts.path()).await.unwrap();
    let mut rt = d.runtime().await.unwrap();
    let v = rt
        .version(cri::VersionRequest {
            version: "v1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(v.runtime_name, "minicri");
    assert_eq!(v.runtime_api_version, "v1");
    assert_eq!(v.runtime_version, env!("CARGO_PKG_VERSION"));

    // A checkpoint of a container that does not exist says so (tests/tests/e2e/checkpoint.rs
    // checkpoints real ones).
    let err = rt
        .checkpoint_container(cri::CheckpointContainerRequest {
            container_id: "abc".into(),
            location: "/tmp/x.tar".into(),
            timeout: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
    assert!(err.message().contains("container abc"), "{err:?}");

    let cond = |s: &cri::StatusResponse, t: &str| {
        s.status
            .as_ref()
            .unwrap()
            .conditions
            .iter()
            .find(|c| c.r#type == t)
            .cloned()
            .unwrap()
    };
    let s = rt
        .status(cri::StatusRequest { verbose: false })
        .await
        .unwrap()
        .into_inner();
    assert!(cond(&s, "RuntimeReady").status);
    let net = cond(&s, "NetworkReady");
    assert!(!net.status, "no CNI config yet");
    assert_eq!(net.reason, "NetworkPluginNotReady");
    assert!(net.message.contains("cni"), "{}", net.message);

    // A file that does not parse does not make the network ready (RunPodSandbox could not use
    // it); the message names it.
    let cni = d.root().parent().unwrap().join("cni");
    std::fs::create_dir_all(&cni).unwrap();
    std::fs::write(cni.join("10-test.conflist"), "{").unwrap();
    let s = rt
        .status(cri::StatusRequest { verbose: false })
        .await
        .unwrap()
        .into_inner();
    let net = cond(&s, "NetworkReady");
    assert!(!net.status, "a broken conflist is not a network");
    assert!(net.message.contains("10-test.conflist"), "{}", net.message);

    // A valid conflist makes the network ready, without a restart.
    std::fs::write(
        cni.join("10-test.conflist"),
        r#"{"cniVersion":"1.0.0","name":"t","plugins":[{"type":"bridge"}]}"#,
    )
    .unwrap();
    let s = rt
        .status(cri::StatusRequest { verbose: true })
        .await
        .unwrap()
        .into_inner();
    assert!(cond(&s, "NetworkReady").status);
    let config: serde_json::Value = serde_json::from_str(&s.info["config"]).unwrap();
    assert_eq!(config["daemon"]["root"], d.root().display().to_string());
    assert_eq!(
        config["pod_cidr"], "",
        "no pod CIDR before the kubelet sends one"
    );

    // The pod CIDR the kubelet sends with UpdateRuntimeConfig is what verbose Status shows.
    rt.update_runtime_config(cri::UpdateRuntimeConfigRequest {
        runtime_config: Some(cri::RuntimeConfig {
            network_config: Some(cri::NetworkConfig {
                pod_cidr: "10.244.7.0/24".into(),
            }),
        }),
    })
    .await
    .unwrap();
    let s = rt
        .status(cri::StatusRequest { verbose: true })
        .await
        .unwrap()
        .into_inner();
    let config: serde_json::Value = serde_json::from_str(&s.info["config"]).unwrap();
    assert_eq!(config["pod_cidr"], "10.244.7.0/24");

    let rc = rt
        .runtime_config(cri::RuntimeConfigRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        rc.linux.unwrap().cgroup_driver,
        cri::CgroupDriver::Cgroupfs as i32
    );
    let sd = Daemon::start_with(hosts.path(), &["--cgroup-driver", "systemd"])
        .await
        .unwrap();
    let rc = sd
        .runtime()
        .await
        .unwrap()
        .runtime_config(cri::RuntimeConfigRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        rc.linux.unwrap().cgroup_driver,
        cri::CgroupDriver::Systemd as i32
    );

    // A fresh daemon has no pods; a request without its id is refused before anything else.
    let pods = rt
        .list_pod_sandbox(cri::ListPodSandboxRequest { filter: None })
        .await
        .unwrap()
        .into_inner();
    assert!(pods.items.is_empty());
    let err = rt
        .checkpoint_container(cri::CheckpointContainerRequest::default())
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("container_id"), "{err:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn socket_mode_lock_and_graceful_stop() {
    let hosts = HostsDir::new();
    let mut d = Daemon::start(hosts.path()).await.unwrap();
    let mode = std::fs::metadata(d.socket()).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660, "socket mode {mode:o}");

    // A second daemon on the same root is refused and names the first one's pid.
    let other = d.root().parent().unwrap().join("other.sock");
    let out = Command::new(minicri_bin())
        .args([
            "serve",
            "--root",
            d.root().to_str().unwrap(),
            "--socket",
            other.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    assert!(!other.exists(), "the refused daemon left no socket");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("another minicri") && err.contains(&d.pid().unwrap().to_string()),
        "{err}"
    );
    // ...and the first is unharmed.
    d.runtime()
        .await
        .unwrap()
        .version(cri::VersionRequest::default())
        .await
        .unwrap();

    // SIGKILL leaves a stale socket file behind; the next start replaces it.
    d.kill();
    assert!(d.socket().exists(), "stale socket left by SIGKILL");
    d.restart().await.unwrap();
    d.runtime()
        .await
        .unwrap()
        .version(cri::VersionRequest::default())
        .await
        .unwrap();

    // SIGTERM: exit 0, socket removed.
    assert!(d.stop().unwrap().success());
    assert!(!d.socket().exists());
}

/// Under systemd with `Type=notify`: READY=1 once the socket answers calls, STOPPING=1 at
/// SIGTERM.
#[tokio::test(flavor = "multi_thread")]
async fn tells_systemd_when_it_is_ready_and_when_it_stops() {
    let dir = tempfile::tempdir().unwrap();
    let notify = std::os::unix::net::UnixDatagram::bind(dir.path().join("notify.sock")).unwrap();
    notify
        .set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    let socket = dir.path().join("minicri.sock");
    let mut child = Command::new(minicri_bin())
        .arg("serve")
        .arg("--socket")
        .arg(&socket)
        .arg("--root")
        .arg(dir.path().join("root"))
        .arg("--state")
        .arg(dir.path().join("state"))
        .arg("--cni-conf-dir")
        .arg(dir.path().join("cni"))
        .env("NOTIFY_SOCKET", dir.path().join("notify.sock"))
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut buf = [0u8; 64];
    let n = notify.recv(&mut buf).expect("READY=1 within 30 s");
    assert_eq!(&buf[..n], b"READY=1");
    // Ready means the CRI answers.
    let channel = channel_to(&socket).await.unwrap();
    cri::runtime_service_client::RuntimeServiceClient::new(channel)
        .version(cri::VersionRequest::default())
        .await
        .unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let n = notify.recv(&mut buf).expect("STOPPING=1");
    assert_eq!(&buf[..n], b"STOPPING=1");
    assert!(child.wait().unwrap().success());
}

#[tokio::test(flavor = "multi_thread")]
async fn config_file_and_flags() {
    let dir = tempfile::tempdir().unwrap();
    let hosts = HostsDir::new();
    let cfg = dir.path().join("config.toml");
    std::fs::write(
        &cfg,
        "[runtime]\ncgroup_driver = \"systemd\"\n[pull]\nplatform = \"linux/arm64\"\n",
    )
    .unwrap();
    let d = Daemon::start_with(hosts.path(), &["--config", cfg.to_str().unwrap()])
        .await
        .unwrap();
    let mut rt = d.runtime().await.unwrap();
    let rc = rt
        .runtime_config(cri::RuntimeConfigRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        rc.linux.unwrap().cgroup_driver,
        cri::CgroupDriver::Systemd as i32
    );
    let s = rt
        .status(cri::StatusRequest { verbose: true })
        .await
        .unwrap()
        .into_inner();
    let config: serde_json::Value = serde_json::from_str(&s.info["config"]).unwrap();
    assert_eq!(config["pull"]["platform"], "linux/arm64");

    // A flag beats the file.
    let d2 = Daemon::start_with(
        hosts.path(),
        &[
            "--config",
            cfg.to_str().unwrap(),
            "--cgroup-driver",
            "cgroupfs",
        ],
    )
    .await
    .unwrap();
    let rc = d2
        .runtime()
        .await
        .unwrap()
        .runtime_config(cri::RuntimeConfigRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        rc.linux.unwrap().cgroup_driver,
        cri::CgroupDriver::Cgroupfs as i32
    );

    // A bad file is refused with a message naming the file and the key; a file in the flat
    // form of before sections is refused naming the key's new place, not misread.
    for (text, says) in [
        ("[daemon]\nsockett = \"/x\"\n", "sockett"),
        ("cgroup_driver = \"systemd\"\n", "`runtime.cgroup_driver`"),
    ] {
        std::fs::write(&cfg, text).unwrap();
        let out = Command::new(minicri_bin())
            .args(["serve", "--config", cfg.to_str().unwrap()])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("config.toml") && err.contains(says), "{err}");
    }
}

/// `minicri config check FILE`: a good file passes; an unknown key, a bad value and a key of
/// the flat form before sections are refused, naming the key; `config default` passes.
#[test]
fn config_check_passes_good_files_and_names_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.toml");
    let check = |text: &str| {
        std::fs::write(&cfg, text).unwrap();
        let out = Command::new(minicri_bin())
            .args(["config", "check", cfg.to_str().unwrap()])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        (out.status.success(), err)
    };
    let default = Command::new(minicri_bin())
        .args(["config", "default"])
        .output()
        .unwrap();
    assert!(default.status.success());
    let (ok, err) = check(&String::from_utf8(default.stdout).unwrap());
    assert!(ok, "{err}");
    let (ok, err) =
        check("[pull]\nmax_concurrent_downloads = 2\n[stream]\naddress = \"127.0.0.1:0\"\n");
    assert!(ok, "{err}");
    for (text, says) in [
        (
            "[pull]\nmax_concurent_downloads = 2\n",
            "max_concurent_downloads",
        ),
        (
            "[pull]\nmax_concurrent_downloads = -2\n",
            "max_concurrent_downloads",
        ),
        ("[stream]\naddress = \"0.0.0.0:1\"\n", "stream.address"),
        (
            "max_concurrent_downloads = 2\n",
            "`pull.max_concurrent_downloads`",
        ),
    ] {
        let (ok, err) = check(text);
        assert!(!ok, "{text} passed");
        assert!(err.contains(says), "{text}: {err}");
    }
}

#[test]
fn version_and_help() {
    let out = Command::new(minicri_bin())
        .arg("--version")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("minicri {}", env!("CARGO_PKG_VERSION"))
    );
    let out = Command::new(minicri_bin())
        .args(["serve", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--socket",
        "--root",
        "--state",
        "--registry-config-dir",
        "--log-level",
        "--config",
        "--cgroup-driver",
    ] {
        assert!(help.contains(flag), "serve --help lacks {flag}:\n{help}");
    }
    assert!(
        help.contains("/run/minicri/minicri.sock"),
        "defaults are documented:\n{help}"
    );
}

/// hack/install-node.sh below a root of the test's: the binary, the systemd unit (notify,
/// process kill mode), the hosts directory and the default CNI network; a second run keeps an
/// existing CNI configuration.
#[test]
fn install_node_puts_the_binary_unit_and_network_in_place() {
    use std::os::unix::fs::PermissionsExt;
    let root = tempfile::tempdir().unwrap();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../hack/install-node.sh");
    let run = || {
        let out = Command::new("bash")
            .arg(&script)
            .arg("--binary")
            .arg(minicri_bin())
            .arg("--root")
            .arg(root.path())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    run();
    let bin = root.path().join("usr/local/bin/minicri");
    assert_eq!(
        std::fs::metadata(&bin).unwrap().permissions().mode() & 0o777,
        0o755
    );
    let version = Command::new(&bin).arg("--version").output().unwrap();
    assert!(String::from_utf8_lossy(&version.stdout).starts_with("minicri "));
    let unit =
        std::fs::read_to_string(root.path().join("etc/systemd/system/minicri.service")).unwrap();
    for line in [
        "Type=notify",
        "KillMode=process",
        "Delegate=yes",
        "ExecStart=/usr/local/bin/minicri serve",
    ] {
        assert!(unit.lines().any(|l| l == line), "{line} missing:\n{unit}");
    }
    assert!(root.path().join("etc/minicri/certs.d").is_dir());
    let cni = root.path().join("etc/cni/net.d/10-minicri-bridge.conflist");
    let conf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cni).unwrap()).unwrap();
    assert_eq!(conf["plugins"][0]["type"], "bridge");
    // An operator's own network stays.
    std::fs::remove_file(&cni).unwrap();
    let own = root.path().join("etc/cni/net.d/05-own.conflist");
    std::fs::write(&own, "{}").unwrap();
    assert!(run().contains("leaving it"));
    assert!(!cni.exists() && own.exists());
}

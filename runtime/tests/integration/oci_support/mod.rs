//! Shared fixtures of the `oci_*` tests: a busybox rootfs, a sandbox (infra process through
//! shim + runc) and containers joining it, each behind a Drop guard that force-deletes the
//! runc container, kills the shim, unmounts and removes its files, also when a test fails.
//!
//! These tests need root, runc and /bin/busybox; without them they print why and pass.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use minicri::oci::{CgroupDriver, HostInfo, OciRuntime, Runc};
use minicri::shim::{ShimConfig, ShimHandle, spawn_shim};
use minicri::spec::{self, ImageConfig, SandboxFiles, SandboxNamespaces};
use minicri_proto::runtime::v1 as cri;

pub const CGROUP_PARENT: &str = "/minicri-oci-test";

/// Why these tests cannot run here, if they cannot (a failure instead when CI must run them).
pub fn skip_reason() -> Option<String> {
    minicri_tests::prereq::missing(skip_reason_here())
}

fn skip_reason_here() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("not root".into());
    }
    if !Path::new("/bin/busybox").exists() {
        return Some("no /bin/busybox".into());
    }
    let runtime = std::env::var("MINICRI_TEST_RUNTIME").unwrap_or_else(|_| "runc".into());
    if std::process::Command::new(&runtime)
        .arg("--version")
        .output()
        .is_err()
    {
        return Some(format!("no {runtime}"));
    }
    None
}

macro_rules! require_root {
    () => {
        if let Some(why) = $crate::oci_support::skip_reason() {
            eprintln!("skipping: {why}");
            return;
        }
    };
}
pub(crate) use require_root;

/// A unique id for this process and name.
pub fn unique(name: &str) -> String {
    format!("{name}-{}", std::process::id())
}

const APPLETS: &[&str] = &[
    "sh", "echo", "cat", "sleep", "id", "ls", "true", "false", "printf", "head", "tr", "hostname",
    "readlink", "touch", "unshare", "test", "[",
];

/// A rootfs of busybox with its applets, `/etc/passwd` (root, app 1000) and `/etc/group`
/// (`extra` 3000 has `app` as a member).
pub fn busybox_rootfs(dir: &Path) {
    for d in ["bin", "etc", "proc", "dev", "sys", "tmp"] {
        std::fs::create_dir_all(dir.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", dir.join("bin/busybox")).unwrap();
    for a in APPLETS {
        std::os::unix::fs::symlink("busybox", dir.join("bin").join(a)).unwrap();
    }
    std::fs::write(
        dir.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("etc/group"),
        "root:x:0:\napp:x:1000:\nextra:x:3000:app\n",
    )
    .unwrap();
    let mut p = std::fs::metadata(dir.join("tmp")).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut p, 0o1777);
    std::fs::set_permissions(dir.join("tmp"), p).unwrap();
}

/// One test's world: a temp dir, a runc root inside it, the infra rootfs.
pub struct TestEnv {
    pub dir: tempfile::TempDir,
    pub runc: Runc,
    pub host: HostInfo,
    pub infra: minicri::pause::InfraRootfs,
}

pub fn minicri_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_minicri"))
}

impl TestEnv {
    pub fn new() -> Self {
        // Short paths: the shim's control socket must fit in sun_path.
        let dir = tempfile::Builder::new()
            .prefix("oci")
            .tempdir_in("/tmp")
            .unwrap();
        // MINICRI_TEST_RUNTIME=crun runs the same tests on crun.
        let binary = std::env::var("MINICRI_TEST_RUNTIME").unwrap_or_else(|_| "runc".into());
        let runc = Runc::new(binary, dir.path().join("runc"));
        let infra =
            minicri::pause::prepare_infra_rootfs(&dir.path().join("infra"), &minicri_binary())
                .unwrap();
        TestEnv {
            dir,
            runc,
            host: HostInfo::detect(),
            infra,
        }
    }

    /// A shim's configuration; `log` is written in its parent directory.
    pub fn shim_config(&self, id: &str, bundle: &Path, log: Option<PathBuf>) -> ShimConfig {
        let mut c = ShimConfig::new(id, bundle, self.runc.command(), minicri_binary());
        c.log = log.map(|path| minicri::shim::LogTarget {
            dir: path.parent().expect("a log in a directory").to_path_buf(),
            path,
        });
        c.ready_timeout = Duration::from_secs(60);
        c
    }
}

/// `runc delete --force` and a SIGKILL to the shim, synchronously (usable in Drop).
pub fn force_cleanup(runc: &Runc, id: &str, shim: Option<&ShimHandle>) {
    let _ = std::process::Command::new(&runc.binary)
        .args(runc.global_args())
        .args(["delete", "--force", id])
        .output();
    if let Some(s) = shim {
        // The shim exits by itself once its container is gone; give it a moment.
        for _ in 0..50 {
            if !s.is_alive() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        s.kill_shim();
    }
}

pub fn sandbox_config(name: &str) -> cri::PodSandboxConfig {
    cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: name.into(),
            uid: name.into(),
            namespace: "test".into(),
            attempt: 0,
        }),
        hostname: format!("{name}-host"),
        dns_config: Some(cri::DnsConfig {
            servers: vec!["10.0.0.10".into()],
            searches: vec!["test.svc".into()],
            options: vec![],
        }),
        linux: Some(cri::LinuxPodSandboxConfig {
            cgroup_parent: CGROUP_PARENT.into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A running sandbox: infra process under a shim.
pub struct Sandbox {
    pub id: String,
    pub config: cri::PodSandboxConfig,
    pub dir: PathBuf,
    pub files: SandboxFiles,
    pub shim: Option<ShimHandle>,
    pub namespaces: SandboxNamespaces,
    runc: Runc,
}

impl Sandbox {
    pub async fn start(env: &TestEnv, name: &str, config: cri::PodSandboxConfig) -> Sandbox {
        let id = unique(name);
        let dir = env.dir.path().join(&id);
        let mut sb = Sandbox {
            id: id.clone(),
            config: config.clone(),
            dir: dir.clone(),
            files: SandboxFiles::default(),
            shim: None,
            namespaces: SandboxNamespaces::default(),
            runc: env.runc.clone(),
        };
        sb.files = SandboxFiles::prepare(&dir.join("files"), &config).unwrap();
        let spec = spec::sandbox_spec(&spec::SandboxSpecParams {
            id: &id,
            config: &config,
            infra: &env.infra,
            netns: None,
            cgroup_driver: CgroupDriver::Cgroupfs,
            host: &env.host,
            annotations: &minicri::oci::annotations::AnnotationPolicy::NONE,
        })
        .unwrap();
        let bundle = dir.join("bundle");
        spec::write_bundle(&bundle, &spec).unwrap();
        let shim = spawn_shim(env.shim_config(&id, &bundle, None))
            .await
            .unwrap();
        sb.namespaces = SandboxNamespaces::of_infra(shim.init_pid, &config);
        sb.shim = Some(shim);
        env.runc.start(&id).await.unwrap();
        sb
    }

    pub fn infra_pid(&self) -> i32 {
        self.shim.as_ref().unwrap().init_pid
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        force_cleanup(&self.runc, &self.id, self.shim.as_ref());
        let _ = SandboxFiles::cleanup(&self.dir.join("files"));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A created container in a sandbox, with its own busybox rootfs and log file.
pub struct Container {
    pub id: String,
    pub dir: PathBuf,
    pub rootfs: PathBuf,
    pub log: PathBuf,
    pub shim: Option<ShimHandle>,
    runc: Runc,
}

pub fn command(args: &[&str]) -> cri::ContainerConfig {
    cri::ContainerConfig {
        command: args.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

impl Container {
    /// Builds the spec and creates the container through a shim (not started).
    pub async fn create(
        env: &TestEnv,
        sandbox: &Sandbox,
        name: &str,
        config: cri::ContainerConfig,
    ) -> Container {
        let id = unique(name);
        let dir = env.dir.path().join(&id);
        let rootfs = dir.join("rootfs");
        busybox_rootfs(&rootfs);
        let log = dir.join("logs/0.log");
        std::fs::create_dir_all(log.parent().unwrap()).unwrap();
        let mut c = Container {
            id: id.clone(),
            dir: dir.clone(),
            rootfs: rootfs.clone(),
            log: log.clone(),
            shim: None,
            runc: env.runc.clone(),
        };
        let image = ImageConfig::default();
        let spec = spec::container_spec(&spec::ContainerSpecParams {
            id: &id,
            sandbox_id: &sandbox.id,
            config: &config,
            sandbox_config: &sandbox.config,
            image: &image,
            rootfs: &rootfs,
            namespaces: &sandbox.namespaces,
            files: &sandbox.files,
            target_pid_ns: None,
            cgroup_driver: CgroupDriver::Cgroupfs,
            host: &env.host,
            annotations: &minicri::oci::annotations::AnnotationPolicy::NONE,
        })
        .unwrap();
        let bundle = dir.join("bundle");
        spec::write_bundle(&bundle, &spec).unwrap();
        c.shim = Some(
            spawn_shim(env.shim_config(&id, &bundle, Some(log)))
                .await
                .unwrap(),
        );
        c
    }

    pub async fn run(
        env: &TestEnv,
        sandbox: &Sandbox,
        name: &str,
        config: cri::ContainerConfig,
    ) -> Container {
        let c = Container::create(env, sandbox, name, config).await;
        env.runc.start(&c.id).await.unwrap();
        c
    }

    pub fn shim(&self) -> &ShimHandle {
        self.shim.as_ref().unwrap()
    }

    pub async fn wait(&self) -> minicri::shim::ExitRecord {
        tokio::time::timeout(Duration::from_secs(30), self.shim().wait())
            .await
            .expect("container exits in time")
            .unwrap()
    }

    /// The log's lines, partials joined.
    pub fn lines(&self) -> Vec<(minicri::logs::Stream, String)> {
        lines_of(&self.log)
    }
}

pub fn lines_of(path: &Path) -> Vec<(minicri::logs::Stream, String)> {
    let raw = std::fs::read(path).unwrap_or_default();
    minicri::logs::reassemble(&raw)
        .unwrap()
        .into_iter()
        .map(|(s, l)| (s, String::from_utf8_lossy(&l).into_owned()))
        .collect()
}

impl Drop for Container {
    fn drop(&mut self) {
        force_cleanup(&self.runc, &self.id, self.shim.as_ref());
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Polls `f` until it returns true (10 s at most).
pub async fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..500 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("timed out waiting for {what}");
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        // Remove the (empty) test cgroup parent from every v1 hierarchy / the v2 tree.
        if let Ok(entries) = std::fs::read_dir("/sys/fs/cgroup") {
            for e in entries.flatten() {
                let _ = std::fs::remove_dir(e.path().join(CGROUP_PARENT.trim_start_matches('/')));
            }
        }
        let _ = std::fs::remove_dir(
            Path::new("/sys/fs/cgroup").join(CGROUP_PARENT.trim_start_matches('/')),
        );
    }
}

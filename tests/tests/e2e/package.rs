//! The Debian package as an operator gets it: `hack/package-deb.sh` builds it from the binary the
//! suite built (no second build), `hack/debian-root.sh` makes a fresh Debian 12 root (debootstrap,
//! cached between runs in /var/tmp/minicri-debian-root), and in that root, through chroot:
//! `apt-get install ./minicri_*.deb` pulls runc and the CNI plugins, puts the stripped binary, the
//! unit (enabled), the conffile (the binary's own defaults) and the default pod network in place;
//! the installed daemon serves the CRI on the socket its configuration names; `apt-get remove`
//! keeps the data and the configuration; `apt-get purge` removes them; a node that has a CNI
//! configuration of its own keeps it alone.
//!
//! Root only (chroot, debootstrap). The first run makes the cached root (157 s here, the whole test
//! 260 s, on a loaded machine); later runs copy it (the test: 63 s).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use minicri_proto::runtime::v1 as cri;
use minicri_proto::runtime::v1::runtime_service_client::RuntimeServiceClient;
use minicri_tests::daemon::{channel_to, minicri_bin};
use minicri_tests::prereq::skip_unless_root;

/// What the root's apt cache holds before the install: the package's dependencies.
const DOWNLOAD: &str = "runc containernetworking-plugins iptables apparmor";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Runs `cmd`, panicking with its output unless it succeeds.
fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A command in the root, as root, without a terminal (apt asks nothing).
fn chroot(root: &Path, args: &[&str]) -> Command {
    let mut c = Command::new("chroot");
    c.arg(root)
        .args(["env", "DEBIAN_FRONTEND=noninteractive", "LC_ALL=C"])
        .args(args);
    c
}

/// The root of a fresh Debian, removed with what is mounted in it when dropped.
struct Root {
    dir: tempfile::TempDir,
    root: PathBuf,
}

impl Root {
    fn new() -> Root {
        let dir = tempfile::Builder::new()
            .prefix("minicri-debroot")
            .tempdir_in("/var/tmp")
            .unwrap();
        let root = dir.path().join("root");
        Root { dir, root }
    }

    fn path(&self) -> &Path {
        &self.root
    }

    fn file(&self, p: &str) -> PathBuf {
        self.path().join(p.trim_start_matches('/'))
    }

    fn read(&self, p: &str) -> String {
        std::fs::read_to_string(self.file(p)).unwrap_or_else(|e| panic!("{p}: {e}"))
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        // The daemon ran in a mount namespace of its own: nothing of it is mounted here. A
        // failed test may still leave its process: the namespace goes with it.
        let _ = std::fs::remove_dir_all(self.dir.path());
    }
}

/// The build id of an ELF file (`readelf -n`).
fn build_id(file: &Path) -> String {
    let out = text(&run(Command::new("readelf").arg("-n").arg(file)));
    out.lines()
        .find_map(|l| l.trim().strip_prefix("Build ID: "))
        .unwrap_or_else(|| panic!("{}: no build id", file.display()))
        .to_string()
}

/// Starts the installed daemon in the root (`/usr/bin/minicri serve`, its configuration from
/// `/etc/minicri/config.toml`) in a mount namespace of its own that sees the host's /proc, /sys
/// and /dev, and waits for its socket to answer Version.
async fn serve_in(root: &Root) -> (std::process::Child, cri::VersionResponse) {
    let r = root.path().display().to_string();
    let script = format!(
        "mount --make-rprivate / && for d in proc sys dev; do mount --rbind /$d {r}/$d; done \
         && exec chroot {r} /usr/bin/minicri serve"
    );
    let log = std::fs::File::create(root.dir.path().join("serve.log")).unwrap();
    let mut child = Command::new("unshare")
        .args(["--mount", "sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let socket = root.file("/run/minicri/minicri.sock");
    let start = Instant::now();
    loop {
        if let Ok(ch) = channel_to(&socket).await
            && let Ok(v) = RuntimeServiceClient::new(ch)
                .version(cri::VersionRequest::default())
                .await
        {
            return (child, v.into_inner());
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "the installed minicri exited ({status}): {}",
                std::fs::read_to_string(root.dir.path().join("serve.log")).unwrap_or_default()
            );
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the installed minicri did not answer on {} in 60 s",
            socket.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_package_installs_serves_and_removes_as_an_operator_expects() {
    if skip_unless_root() {
        return;
    }
    let started = Instant::now();
    let work = tempfile::Builder::new()
        .prefix("minicri-package")
        .tempdir_in("/var/tmp")
        .unwrap();
    let debs = work.path().join("debs");
    let binary = minicri_bin();
    run(Command::new(repo().join("hack/package-deb.sh"))
        .arg("--binary")
        .arg(&binary)
        .arg("--out")
        .arg(&debs)
        .args(["--version", "0.1.0+test1", "--fast"]));
    let arch = text(&run(Command::new("dpkg").arg("--print-architecture")));
    let arch = arch.trim();
    let deb = debs.join(format!("minicri_0.1.0+test1_{arch}.deb"));
    let dbg = debs.join(format!("minicri-dbgsym_0.1.0+test1_{arch}.deb"));
    assert!(
        deb.exists() && dbg.exists(),
        "{:?}",
        std::fs::read_dir(&debs)
    );

    // The control file: the runtime's dependencies, the conffile.
    let control = text(&run(Command::new("dpkg-deb").arg("-f").arg(&deb)));
    for dep in ["runc", "containernetworking-plugins", "iptables", "libc6"] {
        assert!(control.contains(dep), "Depends lacks {dep}:\n{control}");
    }
    let conffiles = text(&run(Command::new("dpkg-deb")
        .arg("-I")
        .arg(&deb)
        .arg("conffiles")));
    assert_eq!(conffiles, "/etc/minicri/config.toml\n");

    let root = Root::new();
    let made = Instant::now();
    run(Command::new(repo().join("hack/debian-root.sh"))
        .args(["--download", DOWNLOAD])
        .arg(root.path()));
    eprintln!("fresh Debian root in {:?}", made.elapsed());
    // A fresh root: no runtime, no CNI configuration.
    assert!(!root.file("/usr/sbin/runc").exists());
    assert!(
        !root
            .file("/etc/cni/net.d/10-minicri-bridge.conflist")
            .exists()
    );
    for f in [&deb, &dbg] {
        std::fs::copy(f, root.file("/tmp").join(f.file_name().unwrap())).unwrap();
    }
    let in_root = |f: &Path| format!("/tmp/{}", f.file_name().unwrap().to_string_lossy());
    let (deb_in, dbg_in) = (in_root(&deb), in_root(&dbg));
    run(&mut chroot(
        root.path(),
        &["apt-get", "install", "-y", "-q", &deb_in, &dbg_in],
    ));

    // Its dependencies came with it.
    assert!(root.file("/usr/sbin/runc").exists(), "runc not installed");
    assert!(
        root.file("/usr/lib/cni/bridge").exists(),
        "CNI plugins not installed"
    );
    // The binary: stripped of debug info, which the dbgsym package holds under its build id.
    let bin = root.file("/usr/bin/minicri");
    let sections = text(&run(Command::new("readelf").arg("-SW").arg(&bin)));
    for debug_info in [".debug_info", ".debug_line", ".debug_str"] {
        assert!(
            !sections.contains(debug_info),
            "{debug_info} left:\n{sections}"
        );
    }
    let id = build_id(&bin);
    assert_eq!(
        id,
        build_id(&binary),
        "the packaged binary is another build"
    );
    let debug = root.file(&format!(
        "/usr/lib/debug/.build-id/{}/{}.debug",
        &id[..2],
        &id[2..]
    ));
    let debug_sections = text(&run(Command::new("readelf").arg("-SW").arg(&debug)));
    assert!(debug_sections.contains(".debug_line"), "{debug_sections}");
    assert!(
        std::fs::metadata(&bin).unwrap().len() < std::fs::metadata(&binary).unwrap().len(),
        "the packaged binary is not smaller than the built one"
    );
    // The unit, from /usr/bin, enabled for multi-user.target (not started: no systemd here).
    let unit = root.read("/lib/systemd/system/minicri.service");
    assert!(
        unit.contains("\nExecStart=/usr/bin/minicri serve\n"),
        "{unit}"
    );
    assert!(unit.contains("\nType=notify\n") && unit.contains("\nKillMode=process\n"));
    let wants = root.file("/etc/systemd/system/multi-user.target.wants/minicri.service");
    assert_eq!(
        std::fs::read_link(&wants).unwrap(),
        Path::new("/lib/systemd/system/minicri.service")
    );
    // The conffile: what the installed binary says its defaults are, every line a comment or a
    // section header, and a file the binary takes.
    let config = root.read("/etc/minicri/config.toml");
    let defaults = text(&run(&mut chroot(
        root.path(),
        &["minicri", "config", "default"],
    )));
    assert_eq!(config, defaults);
    assert!(
        config
            .lines()
            .all(|l| l.is_empty() || l.starts_with('#') || l.starts_with('['))
    );
    assert!(config.contains("\n[daemon]\n") && config.contains("\n[pull]\n"));
    run(&mut chroot(
        root.path(),
        &["minicri", "config", "check", "/etc/minicri/config.toml"],
    ));
    assert!(
        config.contains("\n#socket = \"/run/minicri/minicri.sock\"\n"),
        "{config}"
    );
    let status = text(&run(&mut chroot(
        root.path(),
        &["dpkg-query", "-W", "-f", "${Conffiles}", "minicri"],
    )));
    assert!(status.contains("/etc/minicri/config.toml"), "{status}");
    // The default pod network, where there was none.
    let net = root.read("/etc/cni/net.d/10-minicri-bridge.conflist");
    assert!(net.contains("\"bridge\": \"minicri0\""), "{net}");

    // The installed daemon serves the CRI on its configured socket, with its defaults.
    let (mut daemon, version) = serve_in(&root).await;
    assert_eq!(version.runtime_name, "minicri");
    let status = RuntimeServiceClient::new(
        channel_to(&root.file("/run/minicri/minicri.sock"))
            .await
            .unwrap(),
    )
    .status(cri::StatusRequest { verbose: false })
    .await
    .unwrap()
    .into_inner();
    let conditions = status.status.unwrap().conditions;
    assert!(
        conditions
            .iter()
            .any(|c| c.r#type == "NetworkReady" && c.status),
        "the default network is not seen: {conditions:?}"
    );
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(daemon.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    daemon.wait().unwrap();
    let data: Vec<_> = std::fs::read_dir(root.file("/var/lib/minicri"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(!data.is_empty(), "the daemon left no data in its root");
    std::fs::write(root.file("/var/lib/minicri/an-image-of-the-operators"), "x").unwrap();
    std::fs::write(
        root.file("/etc/minicri/config.toml"),
        "[daemon]\nlog_level = \"debug\"\n",
    )
    .unwrap();

    // remove: the binary goes; data, configuration and network stay.
    run(&mut chroot(
        root.path(),
        &["apt-get", "remove", "-y", "-q", "minicri"],
    ));
    assert!(!bin.exists());
    assert!(
        root.file("/var/lib/minicri/an-image-of-the-operators")
            .exists()
    );
    for d in &data {
        assert!(
            root.file("/var/lib/minicri").join(d).exists(),
            "{d:?} removed"
        );
    }
    assert_eq!(
        root.read("/etc/minicri/config.toml"),
        "[daemon]\nlog_level = \"debug\"\n"
    );
    assert!(
        root.file("/etc/cni/net.d/10-minicri-bridge.conflist")
            .exists()
    );

    // purge: data, configuration, the unit's enablement and the unchanged network go.
    run(&mut chroot(
        root.path(),
        &["apt-get", "purge", "-y", "-q", "minicri"],
    ));
    for gone in [
        "/var/lib/minicri",
        "/etc/minicri",
        "/etc/cni/net.d/10-minicri-bridge.conflist",
        "/etc/systemd/system/multi-user.target.wants/minicri.service",
    ] {
        assert!(!root.file(gone).exists(), "{gone} left after purge");
    }

    // A node with a CNI configuration of its own: the package installs none beside it.
    let theirs = root.file("/etc/cni/net.d/05-cluster.conflist");
    std::fs::write(
        &theirs,
        "{\"cniVersion\":\"1.0.0\",\"name\":\"cluster\",\"plugins\":[]}",
    )
    .unwrap();
    let out = run(&mut chroot(
        root.path(),
        &["apt-get", "install", "-y", "-q", &deb_in],
    ));
    assert!(
        text(&out).contains("has a CNI configuration"),
        "{}",
        text(&out)
    );
    assert!(
        !root
            .file("/etc/cni/net.d/10-minicri-bridge.conflist")
            .exists()
    );
    assert!(theirs.exists());
    eprintln!("package test: {:?} in all", started.elapsed());
}

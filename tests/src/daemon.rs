//! Owns [`Daemon`]: the real `minicri` binary started on a temporary socket, root and state
//! directory, with a registry hosts directory the test writes, and gRPC clients connected to it.
//!
//! The binary is the workspace's `target/<profile>/minicri` (or `$MINICRI_BIN`); build it first
//! (`cargo build --bins`). Dropping a `Daemon` kills the process and removes its directories.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use minicri_proto::MAX_MESSAGE_SIZE;
use minicri_proto::runtime::v1::image_service_client::ImageServiceClient;
use minicri_proto::runtime::v1::runtime_service_client::RuntimeServiceClient;
use tonic::transport::{Channel, Endpoint};

/// A gRPC transport without client-side deadline enforcement (see [`Daemon::raw_images`]).
pub type RawChannel = tower::util::BoxCloneService<
    tonic::codegen::http::Request<tonic::body::Body>,
    tonic::codegen::http::Response<hyper::body::Incoming>,
    hyper::Error,
>;

/// The `minicri` binary under test.
pub fn minicri_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("MINICRI_BIN") {
        return PathBuf::from(p);
    }
    // Test executables live in target/<profile>/deps; the binary one level up.
    let exe = std::env::current_exe().expect("current exe");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>");
    let bin = profile_dir.join("minicri");
    assert!(
        bin.exists(),
        "{} does not exist: run `cargo build --bins` first (or set MINICRI_BIN)",
        bin.display()
    );
    bin
}

/// A registry hosts directory (containerd's hosts.toml format) owned by a test.
pub struct HostsDir {
    dir: tempfile::TempDir,
}

impl HostsDir {
    pub fn new() -> HostsDir {
        HostsDir {
            dir: tempfile::tempdir().expect("tempdir"),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Writes `<dir>/<registry>/hosts.toml` with `text`.
    pub fn set(&self, registry: &str, text: &str) {
        let d = self.dir.path().join(registry);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("hosts.toml"), text).unwrap();
    }

    /// Makes `registry` resolve through the given mirrors (plain-http `host:port`s), in order.
    pub fn mirror(&self, registry: &str, mirrors: &[&str]) {
        let mut text = String::new();
        for m in mirrors {
            text.push_str(&format!(
                "[host.\"http://{m}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
            ));
        }
        self.set(registry, &text);
    }
}

impl Default for HostsDir {
    fn default() -> Self {
        HostsDir::new()
    }
}

/// A running minicri.
pub struct Daemon {
    child: Option<Child>,
    dir: tempfile::TempDir,
    hosts: PathBuf,
    extra_args: Vec<String>,
}

impl Daemon {
    /// Starts minicri with a fresh root, using `hosts` as its registry configuration directory.
    pub async fn start(hosts: &Path) -> Result<Daemon> {
        Self::start_with(hosts, &[]).await
    }

    /// Like [`Daemon::start`], with extra `serve` flags.
    pub async fn start_with(hosts: &Path, extra_args: &[&str]) -> Result<Daemon> {
        let dir = tempfile::Builder::new().prefix("minicri-test").tempdir()?;
        let mut d = Daemon {
            child: None,
            dir,
            hosts: hosts.to_path_buf(),
            extra_args: extra_args.iter().map(|s| s.to_string()).collect(),
        };
        d.spawn().await?;
        Ok(d)
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("minicri.sock")
    }

    pub fn root(&self) -> PathBuf {
        self.dir.path().join("root")
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("minicri.log")
    }

    /// The daemon's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Where the daemon looks for the kubelet's kubeconfig (instead of the host's
    /// /etc/kubernetes/kubelet.conf): absent unless a test writes it. Its API-server watch is
    /// otherwise off in effect (it looks again every 10 s).
    pub fn kubeconfig_search_path(&self) -> PathBuf {
        self.dir.path().join("kubelet.conf")
    }

    /// The command line used to start the daemon.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(minicri_bin());
        cmd.arg("serve")
            .arg("--socket")
            .arg(self.socket())
            .arg("--root")
            .arg(self.root())
            .arg("--state")
            .arg(self.dir.path().join("state"))
            .arg("--registry-config-dir")
            .arg(&self.hosts)
            .arg("--cni-conf-dir")
            .arg(self.dir.path().join("cni"))
            .arg("--log-level")
            .arg("info,minicri=debug,minicri_store=debug")
            .arg("--kube-watch-kubeconfig-search")
            .arg(self.kubeconfig_search_path());
        // The test daemons' roots share this machine's disk with everything else on it: with
        // the default reserve (15%) every pull would fail once the machine itself fell under
        // 15% free, whatever the test. The reserve is off unless a test sets it (the tests of
        // the reserve put the root on a filesystem of its own).
        if !self
            .extra_args
            .iter()
            .any(|a| a.starts_with("--image-fs-reserve"))
        {
            cmd.args(["--image-fs-reserve", "0"]);
        }
        cmd.args(&self.extra_args);
        cmd
    }

    async fn spawn(&mut self) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())?;
        let child = self
            .command()
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", minicri_bin().display()))?;
        self.child = Some(child);
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.as_mut().unwrap().try_wait()? {
                bail!(
                    "minicri exited with {status} during start-up:\n{}",
                    self.log()
                );
            }
            if tokio::net::UnixStream::connect(self.socket()).await.is_ok() {
                return Ok(());
            }
            if start.elapsed() > Duration::from_secs(20) {
                bail!(
                    "minicri did not open its socket within 20s:\n{}",
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A channel to the daemon's socket.
    pub async fn channel(&self) -> Result<Channel> {
        channel_to(&self.socket()).await
    }

    pub async fn images(&self) -> Result<ImageServiceClient<Channel>> {
        Ok(ImageServiceClient::new(self.channel().await?)
            .max_decoding_message_size(MAX_MESSAGE_SIZE)
            .max_encoding_message_size(MAX_MESSAGE_SIZE))
    }

    pub async fn runtime(&self) -> Result<RuntimeServiceClient<Channel>> {
        Ok(RuntimeServiceClient::new(self.channel().await?)
            .max_decoding_message_size(MAX_MESSAGE_SIZE)
            .max_encoding_message_size(MAX_MESSAGE_SIZE))
    }

    /// An image client over a bare HTTP/2 connection. Unlike a tonic `Channel`, it does not enforce
    /// `grpc-timeout` itself, so a test sees the status the daemon answers when a deadline passes.
    pub async fn raw_images(&self) -> Result<ImageServiceClient<RawChannel>> {
        let stream = tokio::net::UnixStream::connect(self.socket()).await?;
        let (send, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(stream),
        )
        .await?;
        tokio::spawn(conn);
        let svc = tower::service_fn(
            move |req: tonic::codegen::http::Request<tonic::body::Body>| {
                let mut send = send.clone();
                async move { send.send_request(req).await }
            },
        );
        // HTTP/2 requests need a scheme and authority; any will do on a unix socket.
        let origin = tonic::codegen::http::Uri::from_static("http://minicri");
        Ok(ImageServiceClient::with_origin(
            tower::util::BoxCloneService::new(svc),
            origin,
        ))
    }

    /// SIGKILLs the daemon (no clean-up on its side) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERMs the daemon and waits for it to exit; returns its exit status.
    pub fn stop(&mut self) -> Result<std::process::ExitStatus> {
        let mut c = self.child.take().context("daemon not running")?;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(c.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )?;
        let start = Instant::now();
        loop {
            if let Some(s) = c.try_wait()? {
                return Ok(s);
            }
            if start.elapsed() > Duration::from_secs(20) {
                let _ = c.kill();
                bail!("minicri did not exit within 20s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts the daemon again on the same root and socket (after [`Daemon::kill`] or [`Daemon::stop`]).
    pub async fn restart(&mut self) -> Result<()> {
        self.kill();
        self.spawn().await
    }

    /// [`Daemon::restart`] with other extra arguments (a changed configuration).
    pub async fn restart_with(&mut self, extra_args: &[&str]) -> Result<()> {
        self.kill();
        self.extra_args = extra_args.iter().map(|s| s.to_string()).collect();
        self.spawn().await
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!(
                "--- minicri log ({}) ---\n{}",
                self.log_path().display(),
                self.log()
            );
        }
    }
}

/// A gRPC channel to the unix socket `path` (a daemon's CRI socket).
pub async fn channel_to(path: &Path) -> Result<Channel> {
    let path = path.to_path_buf();
    let ch = Endpoint::try_from("http://[::]:50051")?
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await?;
    Ok(ch)
}

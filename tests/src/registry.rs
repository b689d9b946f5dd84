//! Owns [`Registry`]: a real image registry for tests, Debian's `docker-registry` (distribution
//! 2.x) started on a free 127.0.0.1 port with its own generated config and a temporary state
//! directory, optionally behind HTTP basic auth, and killed and removed again on drop.
//!
//! The registry uses the filesystem storage driver, so a test can find (and damage) the bytes
//! of any stored blob with [`Registry::blob_path`] / [`Registry::corrupt_blob`].
//!
//! The process is tied to the test process ([`crate::server::spawn_tied`]), so it also dies when
//! the test binary exits without running destructors (a `static` registry, a killed test
//! process).

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, anyhow, bail};

use crate::images::RegistryClient;
use crate::server;

/// Where Debian's `docker-registry` package puts the registry binary.
pub const REGISTRY_BIN: &str = "/usr/bin/docker-registry";
/// Where Debian's `apache2-utils` package puts `htpasswd`.
pub const HTPASSWD_BIN: &str = "/usr/bin/htpasswd";

/// How often a start is retried when the chosen port was taken in the meantime.
const PORT_ATTEMPTS: usize = 5;

/// How to start a [`Registry`].
#[derive(Debug, Clone, Default)]
pub struct RegistryOptions {
    /// Require HTTP basic auth with this `(user, password)`.
    pub htpasswd: Option<(String, String)>,
    /// Run as a pull-through cache of the registry at this URL (distribution's proxy mode:
    /// what it does not have it fetches from there, serves and stores).
    pub proxy_remote: Option<String>,
    /// Serve https with this PKI's server certificate and require a client certificate signed
    /// by its CA (mutual TLS).
    pub mutual_tls: Option<crate::pki::TestPki>,
}

/// A running `docker-registry` on 127.0.0.1. Dropping it kills the process and removes its
/// directory (config, storage, log).
pub struct Registry {
    child: Option<Child>,
    port: u16,
    dir: Option<tempfile::TempDir>,
    credentials: Option<(String, String)>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("addr", &self.addr())
            .field("dir", &self.dir())
            .field("pid", &self.pid())
            .field("auth", &self.credentials.is_some())
            .finish()
    }
}

impl Registry {
    /// Starts an anonymous registry. Panics with a readable message when it cannot (for example
    /// when `docker-registry` is not installed: run `hack/install-deps.sh`).
    pub fn start() -> Registry {
        Self::try_start(&RegistryOptions::default())
            .unwrap_or_else(|e| panic!("cannot start a test registry: {e:#}"))
    }

    /// Starts a pull-through cache of the registry at `remote` (a URL). Panics like
    /// [`Registry::start`].
    pub fn start_cache_of(remote: &str) -> Registry {
        let options = RegistryOptions {
            proxy_remote: Some(remote.to_string()),
            ..Default::default()
        };
        Self::try_start(&options).unwrap_or_else(|e| panic!("cannot start a test cache: {e:#}"))
    }

    /// Starts a pull-through cache of `remote` that serves https only to clients presenting a
    /// certificate of `pki`'s CA. Panics like [`Registry::start`].
    pub fn start_mutual_tls_cache_of(remote: &str, pki: &crate::pki::TestPki) -> Registry {
        let options = RegistryOptions {
            proxy_remote: Some(remote.to_string()),
            mutual_tls: Some(pki.clone()),
            ..Default::default()
        };
        Self::try_start(&options)
            .unwrap_or_else(|e| panic!("cannot start a mutual-TLS test cache: {e:#}"))
    }

    /// Starts a registry that requires basic auth with `user` / `password`. Panics like
    /// [`Registry::start`].
    pub fn start_with_auth(user: &str, password: &str) -> Registry {
        let options = RegistryOptions {
            htpasswd: Some((user.to_string(), password.to_string())),
            ..Default::default()
        };
        Self::try_start(&options).unwrap_or_else(|e| panic!("cannot start a test registry: {e:#}"))
    }

    /// Starts a registry and waits until `GET /v2/` answers (200, or 401 with auth).
    pub fn try_start(options: &RegistryOptions) -> Result<Registry> {
        if !Path::new(REGISTRY_BIN).exists() {
            bail!(
                "{REGISTRY_BIN} is missing: run hack/install-deps.sh (Debian package docker-registry)"
            );
        }
        let dir = tempfile::Builder::new()
            .prefix("minicri-registry-")
            .tempdir()
            .context("creating the registry's temporary directory")?;
        fs::create_dir_all(dir.path().join("storage"))?;
        if let Some((user, password)) = &options.htpasswd {
            let line = htpasswd_line(user, password)?;
            fs::write(dir.path().join("htpasswd"), line)?;
        }

        let mut last_error = None;
        for _ in 0..PORT_ATTEMPTS {
            let port = server::free_port()?;
            write_config(dir.path(), port, options)?;
            let mut child = spawn_registry(dir.path())?;
            let tls = options.mutual_tls.is_some();
            match server::wait_ready(
                &mut child,
                "docker-registry",
                port,
                tls,
                &dir.path().join("registry.log"),
            ) {
                Ok(()) => {
                    return Ok(Registry {
                        child: Some(child),
                        port,
                        dir: Some(dir),
                        credentials: options.htpasswd.clone(),
                    });
                }
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    let log =
                        fs::read_to_string(dir.path().join("registry.log")).unwrap_or_default();
                    let port_taken = log.contains("address already in use");
                    last_error = Some(e);
                    if !port_taken {
                        break;
                    }
                    // Someone took the port between our probe and the registry's bind: retry.
                    let _ = fs::remove_file(dir.path().join("registry.log"));
                }
            }
        }
        Err(last_error.unwrap_or_else(|| anyhow!("could not start docker-registry")))
    }

    /// `127.0.0.1:PORT`, the registry part of an image reference.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The TCP port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The state directory: `config.yml`, `storage/`, `registry.log` and maybe `htpasswd`.
    pub fn dir(&self) -> &Path {
        self.dir.as_ref().expect("registry directory").path()
    }

    /// The filesystem driver's root directory.
    pub fn storage_dir(&self) -> PathBuf {
        self.dir().join("storage")
    }

    /// The process id of `docker-registry`.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).unwrap_or(0)
    }

    /// The `(user, password)` the registry requires, if it was started with auth.
    pub fn credentials(&self) -> Option<(&str, &str)> {
        self.credentials
            .as_ref()
            .map(|(u, p)| (u.as_str(), p.as_str()))
    }

    /// A client for this registry's HTTP API, with its credentials if it has any.
    pub fn client(&self) -> RegistryClient {
        let client = RegistryClient::new(&self.addr());
        match self.credentials() {
            Some((user, password)) => client.with_basic_auth(user, password),
            None => client,
        }
    }

    /// Everything the registry logged so far (to print when a test fails).
    pub fn log(&self) -> String {
        fs::read_to_string(self.dir().join("registry.log")).unwrap_or_default()
    }

    /// The on-disk path of a blob, `sha256:<hex>` or bare `<hex>`, in the filesystem driver's
    /// layout `docker/registry/v2/blobs/sha256/<first 2 hex>/<hex>/data`. The file exists only
    /// once the blob was pushed.
    pub fn blob_path(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
        assert!(
            hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()),
            "not a sha256 digest: {digest}"
        );
        self.storage_dir()
            .join("docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }

    /// Damages a stored blob in place: flips every bit of the byte in its middle, keeping its
    /// size, so the registry serves it with the right length but the wrong digest.
    pub fn corrupt_blob(&self, digest: &str) -> io::Result<()> {
        let path = self.blob_path(digest);
        let mut data = fs::read(&path)?;
        if data.is_empty() {
            return Err(io::Error::other(format!("{} is empty", path.display())));
        }
        let middle = data.len() / 2;
        data[middle] ^= 0xff;
        fs::write(&path, data)
    }

    /// Stops the registry now (drop does the same).
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(dir) = self.dir.take() {
            let _ = dir.close();
        }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// One `user:bcrypt-hash` line made by `htpasswd -Bbn`.
fn htpasswd_line(user: &str, password: &str) -> Result<String> {
    if !Path::new(HTPASSWD_BIN).exists() {
        bail!("{HTPASSWD_BIN} is missing: run hack/install-deps.sh (Debian package apache2-utils)");
    }
    let out = Command::new(HTPASSWD_BIN)
        .args(["-Bbn", user, password])
        .stdin(Stdio::null())
        .output()
        .context("running htpasswd")?;
    if !out.status.success() {
        bail!(
            "htpasswd failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let text = String::from_utf8(out.stdout).context("htpasswd output")?;
    Ok(format!("{}\n", text.trim()))
}

fn write_config(dir: &Path, port: u16, options: &RegistryOptions) -> Result<()> {
    let storage = dir.join("storage");
    let mut config = format!(
        "# Generated by minicri-tests for one test registry.
version: 0.1
log:
  level: info
  formatter: text
storage:
  filesystem:
    rootdirectory: {storage}
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: 127.0.0.1:{port}
  secret: minicri-test-registry-{port}
  headers:
    X-Content-Type-Options: [nosniff]
",
        storage = storage.display()
    );
    if let Some(pki) = &options.mutual_tls {
        config.push_str(&format!(
            "  tls:\n    certificate: {}\n    key: {}\n    clientcas:\n      - {}\n",
            pki.server_cert.display(),
            pki.server_key.display(),
            pki.ca.display()
        ));
    }
    if let Some(remote) = &options.proxy_remote {
        config.push_str(&format!("proxy:\n  remoteurl: {remote}\n"));
    }
    if options.htpasswd.is_some() {
        config.push_str(&format!(
            "auth:
  htpasswd:
    realm: minicri-test-registry
    path: {}
",
            dir.join("htpasswd").display()
        ));
    }
    fs::write(dir.join("config.yml"), config).context("writing config.yml")
}

/// Spawns `docker-registry serve DIR/config.yml`, tied to the test process.
fn spawn_registry(dir: &Path) -> Result<Child> {
    let log = fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("registry.log"))?;
    let mut cmd = Command::new(REGISTRY_BIN);
    cmd.arg("serve")
        .arg(dir.join("config.yml"))
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    // Environment overrides (REGISTRY_HTTP_ADDR, ...) would silently change the config.
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("REGISTRY_") {
            cmd.env_remove(key);
        }
    }
    server::spawn_tied(cmd)
}

//! Owns [`NginxCache`]: a pull-through cache of the kind fleets build from a caching HTTP proxy,
//! Debian's nginx with `proxy_cache` in front of a registry. Blobs are content-addressed, so it
//! keeps them by digest: a miss is fetched from the origin once, stored while it is served, and
//! requests for a blob that is being fetched wait for that one fetch (`proxy_cache_lock`) and are
//! then served from the store. Everything else (`/v2/`, manifests, tokens) passes through
//! uncached, so tags are never stale.
//!
//! It is the counterpart of distribution's proxy mode ([`crate::registry::Registry::start_cache_of`]),
//! which fetches a missing blob twice (once to serve, once to store) and does not merge
//! concurrent misses: together they show what the nodes cost an origin and what the cache does.
//!
//! One nginx process (`master_process off`), tied to the test process, with its configuration,
//! temporary files, store and logs in a temporary directory removed on drop.

use std::fs;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::server;

/// Where Debian's `nginx` package puts the server.
pub const NGINX_BIN: &str = "/usr/sbin/nginx";

/// How often a start is retried when the chosen port was taken in the meantime.
const PORT_ATTEMPTS: usize = 5;

/// A running caching nginx on 127.0.0.1 in front of one registry.
pub struct NginxCache {
    child: Child,
    port: u16,
    dir: tempfile::TempDir,
}

impl std::fmt::Debug for NginxCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NginxCache")
            .field("addr", &self.addr())
            .field("dir", &self.dir.path())
            .finish()
    }
}

impl NginxCache {
    /// Starts a cache of the registry at `remote` (`http://HOST:PORT`). Panics with a readable
    /// message when it cannot (nginx missing: run `hack/install-deps.sh`).
    pub fn start_of(remote: &str) -> NginxCache {
        Self::try_start_of(remote).unwrap_or_else(|e| panic!("cannot start an nginx cache: {e:#}"))
    }

    /// [`NginxCache::start_of`], returning what went wrong.
    pub fn try_start_of(remote: &str) -> Result<NginxCache> {
        if !Path::new(NGINX_BIN).exists() {
            bail!("{NGINX_BIN} is missing: run hack/install-deps.sh (Debian package nginx)");
        }
        let dir = tempfile::Builder::new()
            .prefix("minicri-nginx-cache-")
            .tempdir()
            .context("creating the cache's temporary directory")?;
        fs::create_dir(dir.path().join("tmp")).context("creating the cache's tmp/")?;
        let log = dir.path().join("error.log");
        let mut last_error = None;
        for _ in 0..PORT_ATTEMPTS {
            let port = server::free_port()?;
            fs::write(
                dir.path().join("nginx.conf"),
                config(dir.path(), port, remote),
            )
            .context("writing nginx.conf")?;
            let mut cmd = Command::new(NGINX_BIN);
            cmd.arg("-p")
                .arg(dir.path())
                .arg("-c")
                .arg(dir.path().join("nginx.conf"))
                .arg("-e")
                .arg(&log)
                .current_dir(dir.path())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            let mut child = server::spawn_tied(cmd)?;
            match server::wait_ready(&mut child, "nginx", port, false, &log) {
                Ok(()) => return Ok(NginxCache { child, port, dir }),
                Err(e) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    let taken = fs::read_to_string(&log)
                        .unwrap_or_default()
                        .contains("Address already in use");
                    last_error = Some(e);
                    if !taken {
                        break;
                    }
                    let _ = fs::remove_file(&log);
                }
            }
        }
        Err(last_error.expect("at least one attempt"))
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr())
    }

    /// How many blobs the cache holds in full (entries still being written are not counted).
    pub fn stored_blobs(&self) -> usize {
        fn count(dir: &Path) -> usize {
            let Ok(entries) = fs::read_dir(dir) else {
                return 0;
            };
            entries
                .flatten()
                .map(|e| match e.file_type() {
                    Ok(t) if t.is_dir() => count(&e.path()),
                    // A stored entry is named by the MD5 of its key; one being written has a
                    // numeric suffix.
                    Ok(t) if t.is_file() => {
                        let name = e.file_name();
                        let name = name.to_string_lossy();
                        usize::from(name.len() == 32 && name.bytes().all(|b| b.is_ascii_hexdigit()))
                    }
                    _ => 0,
                })
                .sum()
        }
        count(&self.dir.path().join("store"))
    }

    /// The access log: one line per request, `METHOD URI STATUS CACHE-STATUS RANGE`.
    pub fn access_log(&self) -> String {
        fs::read_to_string(self.dir.path().join("access.log")).unwrap_or_default()
    }
}

impl Drop for NginxCache {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The configuration: blobs cached by digest with one origin fetch per miss, the rest passed
/// through.
fn config(dir: &Path, port: u16, remote: &str) -> String {
    let d = dir.display();
    format!(
        "# Generated by minicri-tests for one test cache.
daemon off;
master_process off;
pid {d}/nginx.pid;
error_log {d}/error.log info;
events {{ worker_connections 1024; }}
http {{
    log_format cache '$request_method $uri $status $upstream_cache_status $http_range';
    access_log {d}/access.log cache;
    client_body_temp_path {d}/tmp/body;
    proxy_temp_path {d}/tmp/proxy;
    fastcgi_temp_path {d}/tmp/fastcgi;
    uwsgi_temp_path {d}/tmp/uwsgi;
    scgi_temp_path {d}/tmp/scgi;
    proxy_cache_path {d}/store levels=1:2 keys_zone=blobs:10m max_size=20g inactive=7d use_temp_path=off;
    proxy_http_version 1.1;
    proxy_set_header Connection \"\";
    proxy_set_header Host $http_host;
    server {{
        listen 127.0.0.1:{port};
        # A blob is the same bytes in every repository: one entry per digest.
        location ~ \"^/v2/.+/blobs/(sha256:[0-9a-f]{{64}})$\" {{
            proxy_pass {remote};
            proxy_cache blobs;
            proxy_cache_key $1;
            proxy_cache_valid 200 7d;
            # Requests for a blob being fetched wait for that fetch, however long it takes.
            proxy_cache_lock on;
            proxy_cache_lock_timeout 1h;
            proxy_cache_lock_age 1h;
        }}
        location / {{
            proxy_pass {remote};
            proxy_buffering off;
        }}
    }}
}}
"
    )
}

//! Registry hosts configuration in containerd's `hosts.toml` directory format, so mirror setups
//! written for containerd carry over.
//!
//! For an image on registry `R`, `<dir>/R/hosts.toml` (else `<dir>/_default/hosts.toml`) lists the
//! endpoints to try: every `[host."URL"]` table in file order, then `server` (or, when `server` is
//! absent, the registry itself). Without a file the registry itself is the only endpoint. Endpoints
//! whose URL says `http://` are reached over plain HTTP (and are given no credentials unless they
//! are loopback IP literals: `registry::auth`); without a file, only a registry named by a
//! loopback IP literal is. The files are read at every pull, so edits apply without a restart.
//!
//! Supported keys: `server`, `capabilities` (`pull`, `resolve`), `skip_verify`, `ca`. A host URL
//! with a path other than `/v2` cannot be used by the registry client and is skipped with a warning.

use std::fs;
use std::path::{Path, PathBuf};

use crate::error::{Result, StoreError};

/// One place to fetch an image from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// `host[:port]` to connect to.
    pub host: String,
    /// Plain HTTP instead of HTTPS.
    pub plain_http: bool,
    /// May resolve tags to manifests.
    pub resolve: bool,
    /// May serve content by digest.
    pub pull: bool,
    /// Do not verify the server's TLS certificate.
    pub skip_verify: bool,
    /// Extra CA certificates (PEM files) to trust for this host.
    pub ca: Vec<PathBuf>,
    /// Whether this endpoint is a mirror (a `[host]` entry) rather than the registry's server.
    pub mirror: bool,
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}://{}",
            if self.plain_http { "http" } else { "https" },
            self.host
        )
    }
}

/// Where registry host configuration is read from.
#[derive(Debug, Clone)]
pub struct RegistryHosts {
    dir: Option<PathBuf>,
}

#[derive(Debug, serde::Deserialize)]
struct HostsFile {
    server: Option<String>,
    #[serde(default)]
    capabilities: Option<Vec<String>>,
    #[serde(default)]
    skip_verify: Option<bool>,
    #[serde(default)]
    ca: Option<StringOrList>,
    #[serde(default)]
    host: toml::Table,
}

#[derive(Debug, serde::Deserialize)]
struct HostEntry {
    capabilities: Option<Vec<String>>,
    skip_verify: Option<bool>,
    ca: Option<StringOrList>,
    override_path: Option<bool>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(untagged)]
enum StringOrList {
    One(String),
    Many(Vec<String>),
}

impl StringOrList {
    fn paths(self) -> Vec<PathBuf> {
        match self {
            StringOrList::One(s) => vec![s.into()],
            StringOrList::Many(v) => v.into_iter().map(Into::into).collect(),
        }
    }
}

impl RegistryHosts {
    /// Reads configuration from `dir` (which need not exist).
    pub fn new(dir: Option<PathBuf>) -> RegistryHosts {
        RegistryHosts { dir }
    }

    /// The endpoints for `registry`, in the order to try them.
    pub fn endpoints(&self, registry: &str) -> Result<Vec<Endpoint>> {
        let file = self.dir.as_ref().and_then(|dir| {
            [registry, "_default"]
                .iter()
                .map(|d| dir.join(host_dir_name(d)).join("hosts.toml"))
                .find(|p| p.is_file())
        });
        match file {
            Some(path) => parse_hosts_file(&path, registry),
            None => Ok(vec![default_endpoint(registry)]),
        }
    }
}

/// containerd's directory names: `host:port` as is (IPv6 brackets kept).
fn host_dir_name(registry: &str) -> &str {
    registry
}

/// Is `host` (`host`, `host:port`, `[v6]` or `[v6]:port`) a loopback IP literal (127.0.0.0/8,
/// ::1)? Names are not: `127.evil.example` is a DNS name like any other, and even `localhost`
/// resolves through /etc/hosts and NSS, which the runtime does not control. So only a literal
/// address is known to stay on the machine.
pub fn is_loopback_ip(host: &str) -> bool {
    let bare = if let Some(rest) = host.strip_prefix('[') {
        match rest.split_once(']') {
            Some((ip, tail)) if tail.is_empty() || is_port(tail) => ip,
            _ => return false,
        }
    } else {
        match host.rsplit_once(':') {
            Some((h, p)) if !h.contains(':') && p.chars().all(|c| c.is_ascii_digit()) => h,
            _ => host,
        }
    };
    bare.parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback())
}

fn is_port(tail: &str) -> bool {
    tail.strip_prefix(':')
        .is_some_and(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()))
}

/// The registry itself: Docker Hub's API host for `docker.io`; plain HTTP only for a registry
/// named by a loopback IP literal (see [`is_loopback_ip`]); anything else over HTTPS unless a
/// hosts.toml says `http://`.
pub fn default_endpoint(registry: &str) -> Endpoint {
    let host = if registry == "docker.io" {
        "registry-1.docker.io".to_string()
    } else {
        registry.to_string()
    };
    Endpoint {
        plain_http: is_loopback_ip(registry),
        host,
        resolve: true,
        pull: true,
        skip_verify: false,
        ca: Vec::new(),
        mirror: false,
    }
}

fn parse_url(url: &str, path: &Path) -> Result<(String, bool, String)> {
    let bad = |reason: String| StoreError::HostsConfig {
        path: path.to_path_buf(),
        reason,
    };
    let (plain_http, rest) = if let Some(r) = url.strip_prefix("http://") {
        (true, r)
    } else if let Some(r) = url.strip_prefix("https://") {
        (false, r)
    } else if url.contains("://") {
        return Err(bad(format!("host URL {url:?} must use http or https")));
    } else {
        (false, url)
    };
    let (host, url_path) = match rest.split_once('/') {
        Some((h, p)) => (h, format!("/{p}")),
        None => (rest, String::new()),
    };
    if host.is_empty() {
        return Err(bad(format!("host URL {url:?} has no host")));
    }
    if !valid_authority(host) {
        return Err(bad(format!(
            "host URL {url:?}: {host:?} is not a host name, IPv4 address or [IPv6] address with \
             an optional port"
        )));
    }
    Ok((host.to_string(), plain_http, url_path))
}

/// `name[:port]`, `ipv4[:port]` or `[ipv6][:port]`: DNS labels of letters, digits, `-` and `_`.
fn valid_authority(a: &str) -> bool {
    let (host_ok, port) = if let Some(rest) = a.strip_prefix('[') {
        let Some((v6, after)) = rest.split_once(']') else {
            return false;
        };
        let port = match after {
            "" => None,
            p => match p.strip_prefix(':') {
                Some(p) => Some(p),
                None => return false,
            },
        };
        (v6.parse::<std::net::Ipv6Addr>().is_ok(), port)
    } else {
        let (h, port) = match a.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (a, None),
        };
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        };
        (h.len() <= 253 && h.split('.').all(label_ok), port)
    };
    host_ok
        && port.is_none_or(|p| {
            !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) && p.parse::<u16>().is_ok()
        })
}

fn caps(list: &Option<Vec<String>>) -> (bool, bool) {
    match list {
        None => (true, true),
        Some(v) => (
            v.iter().any(|c| c == "pull"),
            v.iter().any(|c| c == "resolve"),
        ),
    }
}

fn parse_hosts_file(path: &Path, registry: &str) -> Result<Vec<Endpoint>> {
    let text = fs::read_to_string(path).map_err(|e| StoreError::HostsConfig {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    parse_hosts_toml(&text, registry, path)
}

/// The endpoints a `hosts.toml` text lists for `registry`; `path` only names the file in errors.
/// Pure, so it can be fuzzed.
pub fn parse_hosts_toml(text: &str, registry: &str, path: &Path) -> Result<Vec<Endpoint>> {
    let bad = |reason: String| StoreError::HostsConfig {
        path: path.to_path_buf(),
        reason,
    };
    let file: HostsFile = toml::from_str(text).map_err(|e| bad(e.to_string()))?;
    let mut out = Vec::new();
    for (url, entry) in file.host {
        let entry: HostEntry = entry
            .try_into()
            .map_err(|e: toml::de::Error| bad(format!("[host.{url:?}]: {e}")))?;
        let (host, plain_http, url_path) = parse_url(&url, path)?;
        let v2_path =
            url_path.is_empty() || url_path == "/" || url_path.trim_end_matches('/') == "/v2";
        if !v2_path || entry.override_path == Some(true) {
            tracing::warn!(hosts_toml = %path.display(), %url, "skipping mirror: URL paths other than /v2 are not supported");
            continue;
        }
        let (pull, resolve) = caps(&entry.capabilities);
        out.push(Endpoint {
            host,
            plain_http,
            pull,
            resolve,
            skip_verify: entry.skip_verify.unwrap_or(false),
            ca: entry.ca.map(StringOrList::paths).unwrap_or_default(),
            mirror: true,
        });
    }
    let mut server = match &file.server {
        Some(url) => {
            let (host, plain_http, _) = parse_url(url, path)?;
            let mut e = default_endpoint(registry);
            e.host = host;
            e.plain_http = plain_http;
            e
        }
        None => default_endpoint(registry),
    };
    let (pull, resolve) = caps(&file.capabilities);
    server.pull = pull;
    server.resolve = resolve;
    server.skip_verify = file.skip_verify.unwrap_or(false);
    server.ca = file.ca.map(StringOrList::paths).unwrap_or_default();
    // A server that repeats the last mirror adds nothing.
    if !out
        .iter()
        .any(|e| e.host == server.host && e.plain_http == server.plain_http)
    {
        out.push(server);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts_with(registry: &str, text: &str) -> (tempfile::TempDir, RegistryHosts) {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir_all(dir.path().join(registry)).unwrap();
        fs::write(dir.path().join(registry).join("hosts.toml"), text).unwrap();
        let h = RegistryHosts::new(Some(dir.path().to_path_buf()));
        (dir, h)
    }

    #[test]
    fn defaults_without_config() {
        let h = RegistryHosts::new(None);
        let e = h.endpoints("docker.io").unwrap();
        assert_eq!(e.len(), 1);
        assert_eq!(e[0].to_string(), "https://registry-1.docker.io");
        assert_eq!(
            h.endpoints("127.0.0.1:5000").unwrap()[0].to_string(),
            "http://127.0.0.1:5000"
        );
        assert_eq!(
            h.endpoints("quay.io").unwrap()[0].to_string(),
            "https://quay.io"
        );
    }

    #[test]
    fn hosts_that_are_not_host_names_are_refused() {
        for host in [
            "a b",
            "plm:##5##ost:0ple:5\\u0008bb",
            "m.example:99999",
            "m.example:",
            "[::1",
            "[::1]x",
            "bad..dots",
            "m.example:5000:1",
        ] {
            let text = format!("[host.\"http://{host}\"]\n");
            let (_d, h) = hosts_with("r.example", &text);
            let err = h.endpoints("r.example").unwrap_err().to_string();
            assert!(err.contains("is not a host name"), "{host}: {err}");
        }
        for host in [
            "m.example",
            "m.example:5000",
            "10.0.0.1:5000",
            "[::1]:5000",
            "my_host",
        ] {
            let text = format!("[host.\"https://{host}\"]\n");
            let (_d, h) = hosts_with("r.example", &text);
            assert_eq!(h.endpoints("r.example").unwrap()[0].host, host);
        }
    }

    #[test]
    fn plain_http_only_for_loopback_ip_literals() {
        let h = RegistryHosts::new(None);
        let scheme = |r: &str| h.endpoints(r).unwrap()[0].plain_http;
        for r in ["127.0.0.1:5000", "127.1.2.3", "[::1]:5000", "[::1]"] {
            assert!(scheme(r), "{r}");
        }
        for r in [
            "127.evil.example",
            "127.evil.example:5000",
            "127.0.0.1.nip.io",
            "localhost",
            "localhost:5000",
            "[::2]:5000",
            "10.0.0.1:5000",
            "registry.example",
        ] {
            assert!(!scheme(r), "{r}");
        }
    }

    #[test]
    fn mirrors_in_file_order_then_server() {
        let (_d, h) = hosts_with(
            "docker.io",
            r#"
server = "https://registry-1.docker.io"
[host."http://127.0.0.1:9"]
  capabilities = ["pull", "resolve"]
[host."https://mirror.example:5000"]
  capabilities = ["pull"]
  skip_verify = true
"#,
        );
        let e = h.endpoints("docker.io").unwrap();
        let names: Vec<String> = e.iter().map(ToString::to_string).collect();
        assert_eq!(
            names,
            [
                "http://127.0.0.1:9",
                "https://mirror.example:5000",
                "https://registry-1.docker.io"
            ]
        );
        assert!(e[0].resolve && e[0].mirror);
        assert!(!e[1].resolve && e[1].pull && e[1].skip_verify);
        assert!(!e[2].mirror);
    }

    #[test]
    fn server_equal_to_mirror_is_listed_once() {
        let (_d, h) = hosts_with(
            "registry.k8s.io",
            "server = \"http://127.0.0.1:5000\"\n[host.\"http://127.0.0.1:5000\"]\n  capabilities = [\"pull\", \"resolve\"]\n",
        );
        assert_eq!(h.endpoints("registry.k8s.io").unwrap().len(), 1);
    }

    #[test]
    fn bad_files_name_the_file() {
        let (_d, h) = hosts_with("x.io", "server = 3");
        let err = h.endpoints("x.io").unwrap_err().to_string();
        assert!(err.contains("hosts.toml"), "{err}");
    }
}

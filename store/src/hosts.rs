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
//! Every key containerd documents for a host is read, with containerd's meaning: `server`,
//! `capabilities` (`pull`, `resolve`), `skip_verify`, `ca`, `client` (a certificate and key for
//! mutual TLS: one PEM file holding both, or `[cert, key]` pairs), `header` (extra request
//! headers: a string or a list of strings per name), `dial_timeout` (a Go duration: `5s`,
//! `500ms`, `1m30s`) and `override_path`. The top level describes `server`; each `[host]` table
//! describes that host alone (nothing is inherited). Relative `ca` and `client` paths are taken
//! from the hosts.toml's directory. A host URL's path follows containerd: without
//! `override_path` a path gets `/v2` appended (unless it ends in `/v2`); with it, the path is the
//! API root as given (a path-based mirror such as a Harbor proxy-cache project). Keys containerd
//! does not know are warned about, not fatal. Each warning is logged once per file and key.

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
    /// The API root: `/v2`, or the path a mirror serves the API under (`/v2/<project>`, or
    /// anything with `override_path`). Request paths are `<api_root>/<repository>/...`.
    pub api_root: String,
    /// Time limit of connecting to it (`dial_timeout`; `None`: the daemon's).
    pub dial_timeout: Option<std::time::Duration>,
    /// Client certificates for mutual TLS (`client`): `(certificate, key)` PEM files; no key
    /// file when the certificate's file holds the key too.
    pub client: Vec<(PathBuf, Option<PathBuf>)>,
    /// Extra headers sent with every request to this host (`header`), checked when the file is
    /// read.
    pub headers: reqwest::header::HeaderMap,
}

/// The API root of a registry that is not a path-based mirror.
pub const DEFAULT_API_ROOT: &str = "/v2";

impl Endpoint {
    /// The repository name the endpoint serves `repository` under: a `/v2/<project>` root puts
    /// the project before it (what token scopes name); any other root names it as is.
    pub fn repository(&self, repository: &str) -> String {
        match self.api_root.strip_prefix("/v2/") {
            Some(project) => format!("{project}/{repository}"),
            None => repository.to_string(),
        }
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}://{}",
            if self.plain_http { "http" } else { "https" },
            self.host
        )?;
        if self.api_root != DEFAULT_API_ROOT {
            f.write_str(&self.api_root)?;
        }
        Ok(())
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
    host: toml::Table,
    #[serde(flatten)]
    settings: HostEntry,
}

/// What a `[host]` table, or the file's top level for `server`, says about one host.
#[derive(Debug, serde::Deserialize)]
struct HostEntry {
    capabilities: Option<Vec<String>>,
    skip_verify: Option<bool>,
    ca: Option<StringOrList>,
    override_path: Option<bool>,
    dial_timeout: Option<String>,
    client: Option<ClientSetting>,
    header: Option<toml::Table>,
}

/// `client`: one PEM file with certificate and key, or a list of such files and
/// `[certificate, key]` pairs (an empty key: the certificate's file holds it).
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(untagged)]
enum ClientSetting {
    One(String),
    Many(Vec<ClientPair>),
}

#[derive(Debug, Clone, serde::Deserialize)]
#[serde(untagged)]
enum ClientPair {
    File(String),
    Pair(Vec<String>),
}

/// Keys containerd reads in a `[host]` table (and at the top level, beside `server`).
const HOST_KEYS: [&str; 7] = [
    "capabilities",
    "skip_verify",
    "ca",
    "client",
    "header",
    "override_path",
    "dial_timeout",
];

/// Logs `message` for `path` once per daemon (the files are read at every pull).
fn warn_once(path: &Path, key: &str, message: &str) {
    static WARNED: std::sync::Mutex<Option<std::collections::HashSet<String>>> =
        std::sync::Mutex::new(None);
    let id = format!("{}\0{key}\0{message}", path.display());
    let mut warned = WARNED.lock().unwrap_or_else(|p| p.into_inner());
    let set = warned.get_or_insert_with(Default::default);
    if set.len() >= 1024 {
        set.clear();
    }
    if set.insert(id) {
        tracing::warn!(hosts_toml = %path.display(), key, "{message}");
    }
}

/// Warns about the keys of `table` that are not in `known` (`at` names the table).
fn warn_unknown_keys(table: &toml::Table, known: &[&str], at: &str, path: &Path) {
    for k in table.keys().filter(|k| !known.contains(&k.as_str())) {
        warn_once(path, k, &format!("{at}: unknown key {k:?} ignored"));
    }
}

/// A Go duration as containerd's `dial_timeout` takes it: decimal numbers with units (`ns`,
/// `us`, `ms`, `s`, `m`, `h`), e.g. `5s`, `1.5s`, `1m30s`.
fn parse_go_duration(text: &str) -> Option<std::time::Duration> {
    let mut rest = text.trim();
    if rest.is_empty() {
        return None;
    }
    let mut total = 0f64;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let n: f64 = rest[..num_len].parse().ok()?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += n * scale;
    }
    (total.is_finite() && total > 0.0 && total <= 86400.0)
        .then(|| std::time::Duration::from_secs_f64(total))
}

#[derive(Debug, Clone, serde::Deserialize)]
#[serde(untagged)]
enum StringOrList {
    One(String),
    Many(Vec<String>),
}

impl StringOrList {
    fn strings(self) -> Vec<String> {
        match self {
            StringOrList::One(s) => vec![s],
            StringOrList::Many(v) => v,
        }
    }
}

/// `p` as containerd resolves `ca` and `client` paths: relative ones from the hosts.toml's
/// directory.
fn config_path(p: &str, hosts_toml: &Path) -> PathBuf {
    let p = Path::new(p);
    match hosts_toml.parent() {
        Some(dir) if p.is_relative() => dir.join(p),
        _ => p.to_path_buf(),
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
        api_root: DEFAULT_API_ROOT.to_string(),
        dial_timeout: None,
        client: Vec::new(),
        headers: Default::default(),
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
    let table: toml::Table = toml::from_str(text).map_err(|e| bad(e.to_string()))?;
    let mut top_keys = HOST_KEYS.to_vec();
    top_keys.extend(["server", "host"]);
    warn_unknown_keys(&table, &top_keys, "top level", path);
    let file: HostsFile = table.try_into().map_err(|e| bad(e.to_string()))?;
    let mut out = Vec::new();
    for (url, entry) in file.host {
        let at = format!("[host.{url:?}]");
        if let toml::Value::Table(t) = &entry {
            warn_unknown_keys(t, &HOST_KEYS, &at, path);
        }
        let entry: HostEntry = entry
            .try_into()
            .map_err(|e: toml::de::Error| bad(format!("{at}: {e}")))?;
        let (host, plain_http, url_path) = parse_url(&url, path)?;
        let Some(api_root) = api_root(&url_path, entry.override_path == Some(true)) else {
            warn_once(
                path,
                "override_path",
                &format!(
                    "{at}: skipping mirror: its API root {url_path:?} is not a plain path \
                     (components of letters, digits, '.', '_', '-' and '~')"
                ),
            );
            continue;
        };
        let mut ep = endpoint_with(&entry, &at, path)?;
        ep.host = host;
        ep.plain_http = plain_http;
        ep.mirror = true;
        ep.api_root = api_root;
        out.push(ep);
    }
    let mut server = endpoint_with(&file.settings, "top level", path)?;
    server.plain_http = is_loopback_ip(registry);
    server.host = default_endpoint(registry).host;
    if let Some(url) = &file.server {
        let (host, plain_http, url_path) = parse_url(url, path)?;
        server.host = host;
        server.plain_http = plain_http;
        match api_root(&url_path, file.settings.override_path == Some(true)) {
            Some(root) => server.api_root = root,
            None => {
                return Err(bad(format!(
                    "server {url:?}: its API root {url_path:?} is not a plain path (components \
                     of letters, digits, '.', '_', '-' and '~')"
                )));
            }
        }
    }
    // A server that repeats the last mirror adds nothing.
    if !out.iter().any(|e| {
        e.host == server.host && e.plain_http == server.plain_http && e.api_root == server.api_root
    }) {
        out.push(server);
    }
    Ok(out)
}

/// The API root of a host URL's path, as containerd reads it: without `override_path` the
/// URL's path gets `/v2` appended (unless it ends in it); with it, the path is the root as given.
/// `None` when the root is not a plain path: components of ASCII letters, digits, `.`, `_`, `-`
/// and `~`, none empty, `.` or `..` (it goes into every request URL as is).
fn api_root(url_path: &str, override_path: bool) -> Option<String> {
    let trimmed = url_path.trim_end_matches('/');
    let root = if trimmed.is_empty() {
        DEFAULT_API_ROOT.to_string()
    } else if override_path || trimmed.ends_with("/v2") {
        trimmed.to_string()
    } else {
        format!("{trimmed}/v2")
    };
    let valid = root.strip_prefix('/')?.split('/').all(|c| {
        !c.is_empty()
            && c != "."
            && c != ".."
            && c.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'~'))
    });
    valid.then_some(root)
}

/// An endpoint with the settings of `entry` (capabilities, TLS, client certificates, headers,
/// dial timeout); its host is filled in by the caller.
fn endpoint_with(entry: &HostEntry, at: &str, path: &Path) -> Result<Endpoint> {
    let (pull, resolve) = caps(&entry.capabilities);
    let dial_timeout = match &entry.dial_timeout {
        None => None,
        Some(t) => Some(parse_go_duration(t).ok_or_else(|| StoreError::HostsConfig {
            path: path.to_path_buf(),
            reason: format!(
                "{at}: dial_timeout {t:?} is not a duration such as \"5s\" or \"500ms\" \
                 (at most 24h)"
            ),
        })?),
    };
    let bad = |reason: String| StoreError::HostsConfig {
        path: path.to_path_buf(),
        reason: format!("{at}: {reason}"),
    };
    let mut client = Vec::new();
    match &entry.client {
        None => {}
        Some(ClientSetting::One(file)) => client.push((config_path(file, path), None)),
        Some(ClientSetting::Many(list)) => {
            for pair in list {
                client.push(match pair {
                    ClientPair::File(file) => (config_path(file, path), None),
                    ClientPair::Pair(v) => match v.as_slice() {
                        [cert] => (config_path(cert, path), None),
                        [cert, key] if key.is_empty() => (config_path(cert, path), None),
                        [cert, key] => (config_path(cert, path), Some(config_path(key, path))),
                        _ => {
                            return Err(bad(format!(
                                "client {v:?}: a pair is [certificate, key] (key may be empty)"
                            )));
                        }
                    },
                });
            }
        }
    }
    if client.len() > 1 {
        warn_once(
            path,
            "client",
            &format!(
                "{at}: {} client certificates given; the first one is presented",
                client.len()
            ),
        );
    }
    let mut headers = reqwest::header::HeaderMap::new();
    for (name, value) in entry.header.iter().flatten() {
        let values = match value {
            toml::Value::String(v) => vec![v.clone()],
            toml::Value::Array(a) => a
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad(format!("header {name:?}: values must be strings")))?,
            _ => {
                return Err(bad(format!(
                    "header {name:?}: a string or a list of strings"
                )));
            }
        };
        let header_name = reqwest::header::HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| bad(format!("header {name:?} is not a valid header name")))?;
        if matches!(
            header_name.as_str(),
            "host" | "content-length" | "range" | "transfer-encoding"
        ) {
            return Err(bad(format!(
                "header {name:?} is set by the registry client itself"
            )));
        }
        for v in values {
            let value = reqwest::header::HeaderValue::from_str(&v).map_err(|_| {
                bad(format!(
                    "header {name:?}: value is not a valid header value"
                ))
            })?;
            headers.append(header_name.clone(), value);
        }
    }
    Ok(Endpoint {
        host: String::new(),
        plain_http: false,
        resolve,
        pull,
        skip_verify: entry.skip_verify.unwrap_or(false),
        ca: entry
            .ca
            .clone()
            .map(StringOrList::strings)
            .unwrap_or_default()
            .iter()
            .map(|p| config_path(p, path))
            .collect(),
        mirror: false,
        api_root: DEFAULT_API_ROOT.to_string(),
        dial_timeout,
        client,
        headers,
    })
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

    #[test]
    fn path_based_mirrors_follow_containerds_api_root() {
        let (_d, h) = hosts_with(
            "docker.io",
            r#"
[host."https://harbor.example/v2/proxy-hub"]
  override_path = true
[host."https://plain.example/v2"]
[host."https://root.example/"]
[host."https://prefixed.example/mirror"]
[host."https://nonstd.example/api/docker"]
  override_path = true
[host."https://twice.example/v2/proj"]
"#,
        );
        let e = h.endpoints("docker.io").unwrap();
        let names: Vec<String> = e.iter().map(ToString::to_string).collect();
        // /mirror gets /v2 appended; /api/docker is the root as given (override_path); /v2/proj
        // without override_path is /v2/proj/v2.
        assert_eq!(
            names,
            [
                "https://harbor.example/v2/proxy-hub",
                "https://plain.example",
                "https://root.example",
                "https://prefixed.example/mirror/v2",
                "https://nonstd.example/api/docker",
                "https://twice.example/v2/proj/v2",
                "https://registry-1.docker.io"
            ]
        );
        assert_eq!(e[0].api_root, "/v2/proxy-hub");
        assert_eq!(e[0].repository("library/a"), "proxy-hub/library/a");
        assert_eq!(e[1].api_root, "/v2");
        assert_eq!(e[1].repository("library/a"), "library/a");
        assert_eq!(e[4].repository("library/a"), "library/a");
        assert_eq!(e[5].repository("x"), "proj/v2/x");
        assert_eq!(api_root("/v2/a/b/", true).as_deref(), Some("/v2/a/b"));
        assert_eq!(api_root("/", true).as_deref(), Some("/v2"));
        for bad in ["/v2/../x", "/v2//x", "/v2/x y", "/a?b", "/a#b", "/a%2f"] {
            assert_eq!(api_root(bad, true), None, "{bad}");
        }
        let (_d, h) = hosts_with(
            "docker.io",
            "[host.\"https://m.example/v2/a%2e%2e\"]\n  override_path = true\n",
        );
        let e = h.endpoints("docker.io").unwrap();
        assert_eq!(e.len(), 1, "the mirror with a bad root is skipped: {e:?}");
        let (_d, h) = hosts_with("r.example", "server = \"https://r.example/o?ther\"\n");
        let err = h.endpoints("r.example").unwrap_err().to_string();
        assert!(
            err.contains("/o?ther") && err.contains("hosts.toml"),
            "{err}"
        );
    }

    #[test]
    fn dial_timeout_is_a_go_duration() {
        let (_d, h) = hosts_with(
            "r.example",
            "dial_timeout = \"1m30s\"\n[host.\"https://m.example\"]\n  dial_timeout = \"250ms\"\n",
        );
        let e = h.endpoints("r.example").unwrap();
        assert_eq!(
            e[0].dial_timeout,
            Some(std::time::Duration::from_millis(250))
        );
        assert_eq!(e[1].dial_timeout, Some(std::time::Duration::from_secs(90)));
        for (text, secs) in [("5s", 5.0), ("1.5s", 1.5), ("2h", 7200.0), ("100us", 1e-4)] {
            let d = parse_go_duration(text).unwrap();
            assert!((d.as_secs_f64() - secs).abs() < 1e-9, "{text}");
        }
        for bad in ["", "5", "s", "-1s", "5x", "1..2s", "48h", "0s"] {
            assert_eq!(parse_go_duration(bad), None, "{bad:?}");
        }
        let (_d, h) = hosts_with(
            "r.example",
            "[host.\"https://m.example\"]\n  dial_timeout = \"soon\"\n",
        );
        let err = h.endpoints("r.example").unwrap_err().to_string();
        assert!(err.contains("dial_timeout \"soon\""), "{err}");
    }

    #[test]
    fn every_containerd_key_and_unknown_keys_are_accepted() {
        // A containerd certs.d file using every host key, plus keys containerd does not know:
        // all of it parses, with containerd's meaning; the unknown keys are warned about.
        let (_d, h) = hosts_with(
            "r.example",
            r#"
server = "https://r.example"
capabilities = ["pull", "resolve"]
skip_verify = false
ca = "/etc/certs/r.pem"
client = [["/etc/certs/client.cert", "/etc/certs/client.key"], ["both.pem", ""]]
dial_timeout = "3s"
future_key = 1
[header]
  x-custom = ["1"]
[host."https://m.example:5000/v2"]
  capabilities = ["pull"]
  skip_verify = true
  ca = ["/etc/certs/m.pem", "rel.pem"]
  client = "m-client.pem"
  override_path = false
  dial_timeout = "2s"
  typo_key = "x"
  [host."https://m.example:5000/v2".header]
    Authorization = "Basic Zm9vOmJhcg=="
    X-Multi = ["a", "b"]
"#,
        );
        let dir = _d.path().join("r.example");
        let e = h.endpoints("r.example").unwrap();
        assert_eq!(e.len(), 2);
        assert_eq!(e[0].to_string(), "https://m.example:5000");
        assert!(e[0].skip_verify && e[0].pull && !e[0].resolve);
        assert_eq!(
            e[0].ca,
            [PathBuf::from("/etc/certs/m.pem"), dir.join("rel.pem")]
        );
        assert_eq!(e[0].client, [(dir.join("m-client.pem"), None)]);
        let strs = |v: &[(&str, &str)]| -> Vec<(String, String)> {
            v.iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect()
        };
        let pairs = |m: &reqwest::header::HeaderMap| -> Vec<(String, String)> {
            m.iter()
                .map(|(k, v)| (k.to_string(), v.to_str().unwrap().to_string()))
                .collect()
        };
        assert_eq!(
            pairs(&e[0].headers),
            strs(&[
                ("authorization", "Basic Zm9vOmJhcg=="),
                ("x-multi", "a"),
                ("x-multi", "b")
            ])
        );
        assert_eq!(e[1].ca, [PathBuf::from("/etc/certs/r.pem")]);
        assert_eq!(
            e[1].client,
            [
                (
                    PathBuf::from("/etc/certs/client.cert"),
                    Some(PathBuf::from("/etc/certs/client.key"))
                ),
                (dir.join("both.pem"), None)
            ]
        );
        // Top-level settings are the server's alone.
        assert_eq!(pairs(&e[1].headers), strs(&[("x-custom", "1")]));
        assert_eq!(e[1].dial_timeout, Some(std::time::Duration::from_secs(3)));
        assert_eq!(e[0].dial_timeout, Some(std::time::Duration::from_secs(2)));
    }

    #[test]
    fn bad_headers_and_client_pairs_are_refused() {
        for (text, want) in [
            (
                "[header]\n  \"bad name\" = \"x\"\n",
                "not a valid header name",
            ),
            (
                "[header]\n  x-a = \"line\\nbreak\"\n",
                "not a valid header value",
            ),
            ("[header]\n  x-a = 1\n", "a string or a list of strings"),
            ("[header]\n  x-a = [1]\n", "values must be strings"),
            (
                "[header]\n  Host = \"other\"\n",
                "set by the registry client",
            ),
            (
                "client = [[\"a\", \"b\", \"c\"]]\n",
                "a pair is [certificate, key]",
            ),
        ] {
            let (_d, h) = hosts_with("r.example", text);
            let err = h.endpoints("r.example").unwrap_err().to_string();
            assert!(
                err.contains(want) && err.contains("hosts.toml"),
                "{text}: {err}"
            );
        }
    }
}

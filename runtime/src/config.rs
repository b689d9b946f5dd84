//! The daemon's configuration: the sections each component owns, merged from their defaults,
//! an optional TOML file and the command-line flags.
//!
//! Each section is one struct of the component it configures (its defaults in one `Default`,
//! its checks in one `validate`), handed whole to it: `[daemon]` ([`DaemonSettings`], here),
//! `[pull]` ([`PullSettings`]), `[registry]` ([`RegistrySettings`]), `[snapshotter]`
//! ([`SnapshotterSettings`]), `[cni]` ([`CniSettings`]), `[stream]` ([`StreamSettings`]),
//! `[runtime]` ([`RuntimeSettings`]). A field is both a key of its section and a flag of
//! `minicri serve` (clap's `Args` on the same struct), so adding a setting is one field with
//! its doc line and its default.
//!
//! Precedence: flags over the file over the defaults ([`ServeArgs::resolve`], the one place
//! they merge). With no `--config`, `/etc/minicri/config.toml` is read if it exists; minicri
//! runs with no file at all. A file in the flat form of minicri before sections is refused with
//! the new name of its first key.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::{Arg, ArgMatches, Args, Command, FromArgMatches};
use serde::{Deserialize, Serialize};

pub use crate::cni::settings::CniSettings;
use crate::kube_watch::WatchConfig;
pub use crate::oci::settings::RuntimeSettings;
pub use crate::stream::config::StreamSettings;
pub use minicri_snapshotter::SnapshotterSettings;
pub use minicri_store::pull::PullSettings;
pub use minicri_store::registry::RegistrySettings;

pub const DEFAULT_CONFIG_FILE: &str = "/etc/minicri/config.toml";

/// Where the kubelet keeps its kubeconfig: kubeadm and kind, then k3s.
pub const KUBECONFIG_SEARCH: [&str; 2] = [
    "/etc/kubernetes/kubelet.conf",
    "/var/lib/rancher/k3s/agent/kubelet.kubeconfig",
];

/// Whether the API-server watch runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum KubeWatchMode {
    /// On when a kubeconfig is found.
    Auto,
    Off,
}

/// `[daemon]`: the daemon's own paths, logging, metrics, and the API-server watch.
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[command(next_help_heading = "[daemon]")]
pub struct DaemonSettings {
    /// Unix socket to serve the CRI on.
    #[arg(long, value_name = "PATH")]
    pub socket: PathBuf,

    /// Directory for persistent data: images, content, snapshots.
    #[arg(long, value_name = "DIR")]
    pub root: PathBuf,

    /// Directory for state that does not survive a reboot.
    #[arg(long, value_name = "DIR")]
    pub state: PathBuf,

    /// Log filter: error, warn, info, debug, trace, or a tracing directive list.
    #[arg(long, value_name = "LEVEL")]
    pub log_level: String,

    /// Serve Prometheus metrics on this loopback address (e.g. 127.0.0.1:9464) at /metrics.
    /// [default: off]
    #[arg(long, value_name = "ADDR")]
    pub metrics_address: Option<SocketAddr>,

    /// Most bytes of labels and annotations of all the node's pods together (and, separately,
    /// of all its containers); a pod or container past it is refused with RESOURCE_EXHAUSTED.
    /// The default keeps every List RPC under the kubelet's 16 MiB message limit; past it, only
    /// clients that use the streamed lists (StreamPodSandboxes, ...) still list everything.
    #[arg(long, value_name = "BYTES")]
    pub node_metadata_budget: u64,

    /// The API-server watch of this node's pods (deleted pods release their pulls at once,
    /// pulls are not detached while it is connected, pull progress shows in the pods' events):
    /// auto (use the kubelet's kubeconfig when there is one) or off.
    #[arg(long, value_name = "auto|off", value_enum)]
    pub kube_watch: KubeWatchMode,

    /// The kubeconfig the watch uses. [default: the first of daemon.kube_watch_kubeconfig_search
    /// that exists, looked for again every 10 s until one does]
    #[arg(long, value_name = "FILE")]
    pub kube_watch_kubeconfig: Option<PathBuf>,

    /// Where the kubelet's kubeconfig is looked for, in order (repeatable): kubeadm's and
    /// kind's, then k3s's.
    #[arg(long = "kube-watch-kubeconfig-search", value_name = "FILE")]
    pub kube_watch_kubeconfig_search: Vec<PathBuf>,

    /// The node whose pods are watched (the kubelet's node name). [default: NAME of the
    /// kubeconfig's client certificate `CN=system:node:NAME`, else the hostname]
    #[arg(long, value_name = "NAME")]
    pub kube_watch_node_name: Option<String>,
}

impl Default for DaemonSettings {
    fn default() -> Self {
        DaemonSettings {
            socket: "/run/minicri/minicri.sock".into(),
            root: "/var/lib/minicri".into(),
            state: "/run/minicri".into(),
            log_level: "info".into(),
            metrics_address: None,
            node_metadata_budget: crate::pods::DEFAULT_NODE_METADATA_BYTES as u64,
            kube_watch: KubeWatchMode::Auto,
            kube_watch_kubeconfig: None,
            kube_watch_kubeconfig_search: KUBECONFIG_SEARCH.iter().map(PathBuf::from).collect(),
            kube_watch_node_name: None,
        }
    }
}

impl DaemonSettings {
    /// Checks every value; the error names the key (`daemon.KEY`).
    pub fn validate(&self) -> Result<(), String> {
        for (key, p) in [
            ("socket", &self.socket),
            ("root", &self.root),
            ("state", &self.state),
        ] {
            if p.as_os_str().is_empty() {
                return Err(format!("daemon.{key} is empty"));
            }
        }
        if let Some(a) = self.metrics_address
            && !a.ip().is_loopback()
        {
            return Err(format!(
                "daemon.metrics_address {a} is not a loopback address: metrics are only served \
                 on loopback (127.0.0.1 or ::1)"
            ));
        }
        // At least one pod's labels and annotations at their caps; at most 1 GiB of memory.
        let least = 2 * crate::pods::MAX_METADATA_BYTES as u64;
        if !(least..=1 << 30).contains(&self.node_metadata_budget) {
            return Err(format!(
                "daemon.node_metadata_budget must be {least} (one object's labels and \
                 annotations at their caps) to 1073741824 bytes (1 GiB)"
            ));
        }
        if self
            .kube_watch_node_name
            .as_ref()
            .is_some_and(|n| n.trim().is_empty())
        {
            return Err("daemon.kube_watch_node_name is empty".into());
        }
        if self.kube_watch == KubeWatchMode::Off && self.kube_watch_kubeconfig.is_some() {
            return Err("daemon.kube_watch is off, but daemon.kube_watch_kubeconfig is set".into());
        }
        Ok(())
    }

    /// The API-server watch (`None`: off).
    pub fn kube_watch(&self) -> Option<WatchConfig> {
        (self.kube_watch == KubeWatchMode::Auto).then(|| WatchConfig {
            kubeconfig: self.kube_watch_kubeconfig.clone(),
            search: self.kube_watch_kubeconfig_search.clone(),
            node_name: self.kube_watch_node_name.clone(),
        })
    }
}

/// The whole configuration: one section per component. What the file holds, what the flags
/// set, what the daemon runs with and what verbose Status reports.
#[derive(Debug, Clone, PartialEq, Default, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    #[command(flatten)]
    pub daemon: DaemonSettings,
    #[command(flatten)]
    pub pull: PullSettings,
    #[command(flatten)]
    pub registry: RegistrySettings,
    #[command(flatten)]
    pub snapshotter: SnapshotterSettings,
    #[command(flatten)]
    pub cni: CniSettings,
    #[command(flatten)]
    pub stream: StreamSettings,
    #[command(flatten)]
    pub runtime: RuntimeSettings,
}

/// The sections, in the file's order: name, what it configures, and its keys (the flags of its
/// struct; a key's arg id is its field's name).
pub fn sections() -> Vec<(&'static str, &'static str, Command)> {
    let keys = |augment: fn(Command) -> Command| augment(Command::new("section"));
    vec![
        (
            "daemon",
            "The daemon's paths, logging, metrics and the API-server watch.",
            keys(DaemonSettings::augment_args),
        ),
        (
            "pull",
            "Image downloads and unpacks, and the space they leave free.",
            keys(PullSettings::augment_args),
        ),
        (
            "registry",
            "Registry hosts and requests.",
            keys(RegistrySettings::augment_args),
        ),
        (
            "snapshotter",
            "Layer snapshots and the limits of one layer.",
            keys(SnapshotterSettings::augment_args),
        ),
        ("cni", "Pod networking.", keys(CniSettings::augment_args)),
        (
            "stream",
            "The streaming server (exec, attach, port-forward).",
            keys(StreamSettings::augment_args),
        ),
        (
            "runtime",
            "OCI runtime handlers, the cgroup driver, and what of a pod spec reaches the runtime.",
            keys(RuntimeSettings::augment_args),
        ),
    ]
}

impl Config {
    /// Checks every section; the error names the key (`section.key`).
    pub fn validate(&self) -> anyhow::Result<()> {
        let checks = [
            self.daemon.validate(),
            self.pull.validate(),
            self.registry.validate(),
            self.snapshotter.validate(),
            self.cni.validate(),
            self.stream.validate(),
            self.runtime.validate(),
        ];
        for check in checks {
            check.map_err(|e| anyhow::anyhow!(e))?;
        }
        Ok(())
    }

    /// The configuration, as verbose Status reports it: every section, serialized.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or_default()
    }
}

/// `minicri serve`'s command line: `--config FILE` and a flag for every key of [`Config`].
#[derive(Debug, Clone, Default)]
pub struct ServeArgs {
    /// The configuration file. [default: /etc/minicri/config.toml if it exists]
    pub config: Option<PathBuf>,
    /// The flags given, laid over the file by [`ServeArgs::resolve`].
    flags: Option<ArgMatches>,
}

impl FromArgMatches for ServeArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        Ok(ServeArgs {
            config: m.get_one::<PathBuf>("config").cloned(),
            flags: Some(m.clone()),
        })
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
    }
}

impl Args for ServeArgs {
    fn augment_args(cmd: Command) -> Command {
        let cmd = cmd.arg(
            Arg::new("config")
                .long("config")
                .value_name("FILE")
                .value_parser(clap::value_parser!(PathBuf))
                .help(
                    "Configuration file (TOML, in sections: `minicri config default` prints \
                     one). [default: /etc/minicri/config.toml if it exists]",
                ),
        );
        let defaults = default_values();
        // No flag is required (the defaults fill in), and each help ends with its default,
        // taken from the sections' `Default`: it is written nowhere else.
        Config::augment_args(cmd).mut_args(move |a| {
            let a = a.required(false);
            match defaults.get(a.get_id().as_str()) {
                Some(v) => {
                    let help = a.get_help().map(|h| h.to_string()).unwrap_or_default();
                    a.help(format!("{help} [default: {v}]"))
                }
                None => a,
            }
        })
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        Self::augment_args(cmd)
    }
}

/// Each key's default as help shows it (keys whose default is no value are absent).
fn default_values() -> std::collections::HashMap<String, String> {
    let mut out = std::collections::HashMap::new();
    let Ok(toml::Value::Table(all)) = toml::Value::try_from(Config::default()) else {
        return out;
    };
    for (_, section) in all {
        let toml::Value::Table(section) = section else {
            continue;
        };
        for (key, value) in section {
            let shown = match &value {
                toml::Value::String(s) => s.clone(),
                toml::Value::Array(a) if a.is_empty() => "none".into(),
                toml::Value::Array(a) => a
                    .iter()
                    .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_string))
                    .collect::<Vec<_>>()
                    .join(", "),
                // Seconds and hours read better as `30` than as TOML's `30.0`.
                toml::Value::Float(f) => f.to_string(),
                toml::Value::Table(t) if t.is_empty() => continue,
                other => other.to_string(),
            };
            out.insert(key, shown);
        }
    }
    out
}

impl ServeArgs {
    /// The arguments of `minicri serve ARGS...` (for tests and tools that build a command line).
    pub fn parse_from<I, T>(args: I) -> Result<ServeArgs, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let cmd = ServeArgs::augment_args(Command::new("serve").no_binary_name(true));
        ServeArgs::from_arg_matches(&cmd.try_get_matches_from(args)?)
    }

    /// Reads the config file (if any), lays the flags over it, and checks the result.
    pub fn resolve(self) -> anyhow::Result<Config> {
        let mut config = match &self.config {
            Some(p) => read_file(p)?,
            None if Path::new(DEFAULT_CONFIG_FILE).exists() => {
                read_file(Path::new(DEFAULT_CONFIG_FILE))?
            }
            None => Config::default(),
        };
        if let Some(flags) = &self.flags {
            config.update_from_arg_matches(flags)?;
        }
        config.runtime.fold_runtime_flags();
        config.validate()?;
        Ok(config)
    }
}

/// Reads and checks the configuration file `path` (nothing else set): what `minicri config
/// check` does.
pub fn check_file(path: &Path) -> anyhow::Result<Config> {
    let config = read_file(path)?;
    config
        .validate()
        .with_context(|| format!("config file {}", path.display()))?;
    Ok(config)
}

/// The file's sections over the defaults.
pub fn read_file(path: &Path) -> anyhow::Result<Config> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading config file {}", path.display()))?;
    parse(&text).with_context(|| format!("parsing config file {}", path.display()))
}

/// A configuration file's text over the defaults. A key of the flat form before sections is
/// refused naming its new place rather than misread.
pub fn parse(text: &str) -> anyhow::Result<Config> {
    let table: toml::Table = toml::from_str(text)?;
    let sections = sections();
    for (key, value) in &table {
        let is_section =
            sections.iter().any(|(name, _, _)| *name == key.as_str()) && value.is_table();
        if !is_section && let Some(new) = new_key_of(key, &sections) {
            bail!(
                "`{key}` is now `{new}`: the file is written in sections ([daemon], [pull], \
                 ...); `minicri config default` prints every key in its section"
            );
        }
    }
    Ok(toml::from_str(text)?)
}

/// Where the key `old` of the flat file went: a field of a section keeps its flag's name, or
/// its name, or drops the section's name and `_` in front (the flat key of `pull.detach_after`
/// began with `pull_`).
fn new_key_of(old: &str, sections: &[(&'static str, &'static str, Command)]) -> Option<String> {
    if old == "runtimes" {
        return Some("runtime.handlers".into());
    }
    sections.iter().find_map(|(name, _, cmd)| {
        cmd.get_arguments().find_map(|a| {
            let id = a.get_id().as_str();
            let flag = a.get_long().map(|l| l.replace('-', "_"));
            let matches = old == id
                || old.strip_prefix(*name).and_then(|r| r.strip_prefix('_')) == Some(id)
                || flag.as_deref() == Some(old);
            // `--runtime` is `[runtime.handlers.NAME]` in the file, not a key.
            (matches && id != "runtime_flags").then(|| format!("{name}.{id}"))
        })
    })
}

#[cfg(test)]
mod docs_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oci::host::CgroupDriver;

    /// `minicri serve ARGS` resolved.
    fn serve(args: &[&str]) -> anyhow::Result<Config> {
        ServeArgs::parse_from(args)?.resolve()
    }

    /// A config file holding `text`, and the directory it is in.
    fn file(text: &str) -> (tempfile::TempDir, String) {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, text).unwrap();
        let f = f.to_str().unwrap().to_string();
        (dir, f)
    }

    #[test]
    fn defaults_without_file() {
        let c = ServeArgs::default().resolve().unwrap();
        assert_eq!(c.daemon.socket, PathBuf::from("/run/minicri/minicri.sock"));
        assert_eq!(c.daemon.root, PathBuf::from("/var/lib/minicri"));
        assert_eq!(c.runtime.cgroup_driver, CgroupDriver::Cgroupfs);
        assert_eq!(c.cni.bin_dirs.len(), 2);
        assert_eq!(c, Config::default());
    }

    #[test]
    fn hardening_limits() {
        let c = Config::default();
        assert_eq!(c.snapshotter.max_layer_bytes, 64 << 30);
        assert_eq!(c.snapshotter.max_layer_entries, 1 << 20);
        assert_eq!(c.pull.min_speed, 1024);
        let c = serve(&[
            "--pull-min-speed",
            "1",
            "--max-layer-entries",
            "10",
            "--registry-request-timeout",
            "2.5",
        ])
        .unwrap();
        assert_eq!(c.pull.pull_config(None).unwrap().min_speed, Some(1));
        assert_eq!(c.snapshotter.max_layer_entries, 10);
        assert_eq!(c.registry.request_timeout().unwrap().as_millis(), 2500);
        for (bad, key) in [
            (
                &["--max-layer-bytes", "0"][..],
                "snapshotter.max_layer_bytes",
            ),
            (
                &["--registry-request-timeout", "0"][..],
                "registry.request_timeout",
            ),
            (&["--ingest-ttl", "1e16"][..], "pull.ingest_ttl"),
        ] {
            let err = format!("{:#}", serve(bad).unwrap_err());
            assert!(err.contains(key), "{bad:?}: {err}");
        }
    }

    #[test]
    fn layer_blobs_and_the_node_metadata_budget() {
        let c = Config::default();
        assert!(!c.pull.keep_layer_blobs);
        assert_eq!(c.daemon.node_metadata_budget, 8 << 20);
        let (_d, f) =
            file("[pull]\nkeep_layer_blobs = true\n[daemon]\nnode_metadata_budget = 33554432\n");
        let c = serve(&["--config", &f]).unwrap();
        assert!(c.pull.keep_layer_blobs);
        assert_eq!(c.daemon.node_metadata_budget, 32 << 20);
        // The flag takes a value, as it did: `--keep-layer-blobs false` turns the file's off.
        let c = serve(&["--config", &f, "--keep-layer-blobs", "false"]).unwrap();
        assert!(!c.pull.keep_layer_blobs);
        for bad in ["0", "1024", "1073741825"] {
            let err = serve(&["--node-metadata-budget", bad])
                .unwrap_err()
                .to_string();
            assert!(err.contains("daemon.node_metadata_budget"), "{err}");
        }
    }

    #[test]
    fn image_fs_reserve_and_max_blob_size() {
        use minicri_store::space::Reserve;
        let c = Config::default();
        assert_eq!(c.pull.image_fs_reserve, Reserve::Percent(15.0));
        assert_eq!(c.pull.max_blob_size, 64 << 30);
        let (_d, f) = file("[pull]\nimage_fs_reserve = \"20GiB\"\nmax_blob_size = 1048576\n");
        let c = serve(&["--config", &f]).unwrap();
        assert_eq!(c.pull.image_fs_reserve, Reserve::Bytes(20 << 30));
        assert_eq!(c.pull.max_blob_size, 1 << 20);
        let c = parse("[pull]\nimage_fs_reserve = 0\n").unwrap();
        assert!(c.pull.image_fs_reserve.is_off());
        let err = serve(&["--image-fs-reserve", "3%"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("pull.image_fs_reserve") && err.contains("pull.ingest_min_free"),
            "{err}"
        );
        assert!(serve(&["--image-fs-reserve", "3%", "--ingest-min-free", "2"]).is_ok());
        let err = format!(
            "{:#}",
            parse("[pull]\nimage_fs_reserve = \"a lot\"\n").unwrap_err()
        );
        assert!(err.contains("percentage"), "{err}");
    }

    #[test]
    fn flags_override_file() {
        let (_d, f) = file(
            "[daemon]\nroot = \"/file/root\"\nsocket = \"/file.sock\"\n\
             [runtime]\ncgroup_driver = \"systemd\"\n[cni]\nconf_dirs = [\"/file/net.d\"]\n",
        );
        let c = serve(&[
            "--config",
            &f,
            "--socket",
            "/flag.sock",
            "--cni-conf-dir",
            "/a",
            "--cni-conf-dir",
            "/b",
        ])
        .unwrap();
        assert_eq!(c.daemon.socket, PathBuf::from("/flag.sock"));
        assert_eq!(c.daemon.root, PathBuf::from("/file/root"));
        assert_eq!(c.runtime.cgroup_driver, CgroupDriver::Systemd);
        // A repeatable flag replaces the file's list; a key in neither keeps its default.
        assert_eq!(c.cni.conf_dirs, vec![PathBuf::from("/a"), "/b".into()]);
        assert_eq!(c.cni.bin_dirs, CniSettings::default().bin_dirs);
    }

    #[test]
    fn unknown_keys_and_bad_values_are_errors() {
        let err = format!("{:#}", parse("[daemon]\nsockett = \"/x\"\n").unwrap_err());
        assert!(err.contains("sockett"), "{err}");
        let err = format!(
            "{:#}",
            parse("[pul]\nplatform = \"linux/arm64\"\n").unwrap_err()
        );
        assert!(err.contains("pul"), "{err}");
        let err = format!(
            "{:#}",
            parse("[runtime]\ncgroup_driver = \"cgroupv3\"\n").unwrap_err()
        );
        assert!(err.contains("cgroupv3"), "{err}");
        let err = serve(&["--cgroup-driver", "cgroupv3"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("cgroupv3"), "{err}");
    }

    #[test]
    fn a_flat_file_of_before_sections_is_refused_naming_the_new_key() {
        for (old, new) in [
            (
                "max_concurrent_downloads = 2",
                "pull.max_concurrent_downloads",
            ),
            ("pull_detach_after = 5", "pull.detach_after"),
            ("registry_config_dir = \"/x\"", "registry.config_dir"),
            ("snapshotter = \"copy\"", "snapshotter.backend"),
            ("cni_conf_dirs = [\"/x\"]", "cni.conf_dirs"),
            ("stream_address = \"127.0.0.1:1\"", "stream.address"),
            ("cgroup_driver = \"systemd\"", "runtime.cgroup_driver"),
            ("socket = \"/x.sock\"", "daemon.socket"),
            (
                "pull_priority_namespaces = [\"a\"]",
                "pull.priority_namespaces",
            ),
            ("[runtimes.kata]\nbinary = \"k\"", "runtime.handlers"),
        ] {
            let err = format!("{:#}", parse(old).unwrap_err());
            assert!(err.contains(&format!("is now `{new}`")), "{old}: {err}");
        }
    }

    #[test]
    fn metrics_only_on_loopback_and_off_by_default() {
        assert_eq!(Config::default().daemon.metrics_address, None);
        assert_eq!(
            serve(&["--metrics-address", "127.0.0.1:9464"])
                .unwrap()
                .daemon
                .metrics_address,
            Some("127.0.0.1:9464".parse().unwrap())
        );
        assert!(serve(&["--metrics-address", "[::1]:9464"]).is_ok());
        let err = serve(&["--metrics-address", "0.0.0.0:9464"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("loopback"), "{err}");
        let err = serve(&["--metrics-address", "localhost"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("metrics-address"), "{err}");
    }

    #[test]
    fn kube_watch_is_on_by_default_and_searches_the_kubelets_kubeconfig() {
        let w = Config::default().daemon.kube_watch().unwrap();
        assert_eq!(w.kubeconfig, None);
        assert_eq!(w.node_name, None);
        assert_eq!(
            w.search,
            vec![
                PathBuf::from("/etc/kubernetes/kubelet.conf"),
                PathBuf::from("/var/lib/rancher/k3s/agent/kubelet.kubeconfig")
            ]
        );
        let w = serve(&[
            "--kube-watch-kubeconfig",
            "/k/conf",
            "--kube-watch-kubeconfig-search",
            "/a",
            "--kube-watch-node-name",
            "n1",
        ])
        .unwrap()
        .daemon
        .kube_watch()
        .unwrap();
        assert_eq!(
            (w.kubeconfig, w.search, w.node_name),
            (Some("/k/conf".into()), vec!["/a".into()], Some("n1".into()))
        );
        let off = serve(&["--kube-watch", "off"]).unwrap();
        assert!(off.daemon.kube_watch().is_none());
        for (bad, says) in [
            (
                &["--kube-watch", "off", "--kube-watch-kubeconfig", "/k"][..],
                "kube_watch is off",
            ),
            (&["--kube-watch", "on"][..], "auto, off"),
            (
                &["--kube-watch-node-name", " "][..],
                "kube_watch_node_name is empty",
            ),
        ] {
            let err = serve(bad).unwrap_err().to_string();
            assert!(err.contains(says), "{err}");
        }
    }

    /// Every flag `minicri serve` had before sections still parses and lands in its key.
    #[test]
    fn every_flag_of_before_sections_still_works() {
        let c = serve(&[
            "--socket=/s",
            "--root=/r",
            "--state=/st",
            "--registry-config-dir=/certs",
            "--log-level=debug",
            "--cgroup-driver=systemd",
            "--platform=linux/arm64",
            "--max-concurrent-downloads=5",
            "--max-concurrent-unpacks=6",
            "--snapshotter=copy",
            "--max-concurrent-transfers=7",
            "--small-blob-size=8",
            "--blob-connections=9",
            "--blob-chunk-size=10",
            "--pull-progress-timeout=11",
            "--pull-min-speed=12",
            "--registry-request-timeout=13",
            "--max-layer-bytes=14",
            "--max-layer-entries=15",
            "--pull-detach-after=16",
            "--kube-watch=auto",
            "--kube-watch-kubeconfig=/kc",
            "--kube-watch-kubeconfig-search=/ks",
            "--kube-watch-node-name=n",
            "--ingest-ttl=17",
            "--ingest-min-free=1",
            "--image-fs-reserve=18GiB",
            "--max-blob-size=19",
            "--keep-layer-blobs=true",
            "--node-metadata-budget=20000000",
            "--cni-conf-dir=/cc",
            "--cni-bin-dir=/cb",
            "--oci-runtime=/runc",
            "--runtime=kata=/kata",
            "--default-runtime=kata",
            "--metrics-address=127.0.0.1:1",
            "--stream-address=127.0.0.1:2",
            "--pod-annotation=a/*",
            "--pull-priority-namespace=ns",
            "--allow-own-path-mount=/",
            "--port-forward-buffer-bytes=3000000",
            "--port-forward-stall-timeout=21",
        ])
        .unwrap();
        let (d, p) = (&c.daemon, &c.pull);
        assert_eq!(
            (d.socket.to_str(), d.root.to_str(), d.state.to_str()),
            (Some("/s"), Some("/r"), Some("/st"))
        );
        assert_eq!(d.log_level, "debug");
        assert_eq!(c.registry.config_dir, PathBuf::from("/certs"));
        assert_eq!(c.registry.request_timeout, 13.0);
        assert_eq!(c.runtime.cgroup_driver, CgroupDriver::Systemd);
        assert_eq!(
            (
                p.platform.as_str(),
                p.max_concurrent_downloads,
                p.max_concurrent_unpacks
            ),
            ("linux/arm64", 5, 6)
        );
        assert_eq!(c.snapshotter.backend, minicri_snapshotter::Backend::Copy);
        assert_eq!(
            (
                p.max_concurrent_transfers,
                p.small_blob_size,
                p.blob_connections
            ),
            (7, 8, 9)
        );
        assert_eq!(
            (
                p.blob_chunk_size,
                p.progress_timeout,
                p.min_speed,
                p.detach_after
            ),
            (10, 11.0, 12, 16.0)
        );
        assert_eq!(
            (
                c.snapshotter.max_layer_bytes,
                c.snapshotter.max_layer_entries
            ),
            (14, 15)
        );
        let w = d.kube_watch().unwrap();
        assert_eq!(
            (w.kubeconfig, w.search, w.node_name),
            (Some("/kc".into()), vec!["/ks".into()], Some("n".into()))
        );
        assert_eq!((p.ingest_ttl, p.ingest_min_free), (17.0, 1.0));
        assert_eq!(
            p.image_fs_reserve,
            minicri_store::space::Reserve::Bytes(18 << 30)
        );
        assert_eq!((p.max_blob_size, p.keep_layer_blobs), (19, true));
        assert_eq!(d.node_metadata_budget, 20_000_000);
        assert_eq!(c.cni.conf_dirs, vec![PathBuf::from("/cc")]);
        assert_eq!(c.cni.bin_dirs, vec![PathBuf::from("/cb")]);
        let handlers = c.runtime.handler_configs();
        assert_eq!(handlers["runc"].binary, PathBuf::from("/runc"));
        assert_eq!(handlers["kata"].binary, PathBuf::from("/kata"));
        assert_eq!(c.runtime.default_runtime, "kata");
        assert_eq!(d.metrics_address, Some("127.0.0.1:1".parse().unwrap()));
        assert_eq!(c.stream.address, "127.0.0.1:2".parse().unwrap());
        assert_eq!(c.runtime.pod_annotations, vec!["a/*".to_string()]);
        assert_eq!(p.priority_namespaces, vec!["ns".to_string()]);
        assert_eq!(c.runtime.allow_own_path_mounts, vec![PathBuf::from("/")]);
        assert_eq!(c.stream.port_forward_buffer_bytes, 3_000_000);
        assert_eq!(c.stream.port_forward_stall_timeout, 21.0);
    }

    /// `serve --help` shows each key's default, taken from its section's `Default`.
    #[test]
    fn help_shows_the_sections_defaults() {
        let mut cmd = ServeArgs::augment_args(Command::new("serve"));
        let help = cmd.render_help().to_string();
        for shown in [
            "[default: /run/minicri/minicri.sock]",
            "[default: 30]",
            "[default: overlay]",
            "[default: 127.0.0.1:0]",
            "[default: /opt/cni/bin, /usr/lib/cni]",
            "[default: 15%]",
        ] {
            assert!(help.contains(shown), "{shown} missing:\n{help}");
        }
        assert!(
            help.contains("[pull]") && help.contains("[runtime]"),
            "{help}"
        );
    }
}

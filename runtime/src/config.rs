//! The daemon's configuration: embedded defaults, an optional TOML file, command-line flags.
//!
//! Precedence: flags over the file over the defaults. The file's keys are the flags' long names with
//! `_` for `-` (`registry_config_dir = "..."`). With no `--config`, `/etc/minicri/config.toml` is read
//! if it exists; minicri runs with no file at all.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::Args;
use serde::{Deserialize, Serialize};

pub const DEFAULT_CONFIG_FILE: &str = "/etc/minicri/config.toml";

/// Settings of `minicri serve`. Every field is optional here so the file and the flags can be merged.
#[derive(Debug, Clone, Default, Args, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServeArgs {
    /// Configuration file (TOML; keys as these flags, with `_` for `-`).
    /// [default: /etc/minicri/config.toml if it exists]
    #[arg(long, value_name = "FILE")]
    #[serde(skip)]
    pub config: Option<PathBuf>,

    /// Unix socket to serve the CRI on. [default: /run/minicri/minicri.sock]
    #[arg(long, value_name = "PATH")]
    pub socket: Option<PathBuf>,

    /// Directory for persistent data: images, content, snapshots. [default: /var/lib/minicri]
    #[arg(long, value_name = "DIR")]
    pub root: Option<PathBuf>,

    /// Directory for state that does not survive a reboot. [default: /run/minicri]
    #[arg(long, value_name = "DIR")]
    pub state: Option<PathBuf>,

    /// Registry hosts configuration, containerd's hosts.toml directory format:
    /// <DIR>/<registry-host>/hosts.toml. [default: /etc/minicri/certs.d]
    #[arg(long, value_name = "DIR")]
    pub registry_config_dir: Option<PathBuf>,

    /// Log filter: error, warn, info, debug, trace, or a tracing directive list. [default: info]
    #[arg(long, value_name = "LEVEL")]
    pub log_level: Option<String>,

    /// Cgroup driver reported to the kubelet: cgroupfs or systemd. [default: cgroupfs]
    #[arg(long, value_name = "DRIVER")]
    pub cgroup_driver: Option<String>,

    /// Platform chosen from multi-platform images, os/arch[/variant]. [default: linux/amd64]
    #[arg(long, value_name = "PLATFORM")]
    pub platform: Option<String>,

    /// Layers of one image downloaded concurrently. [default: 3]
    #[arg(long, value_name = "N")]
    pub max_concurrent_downloads: Option<usize>,

    /// Layers of one image unpacked concurrently (each committed after the one below it);
    /// node-wide, at most this less one are applied ahead of their parent. [default: 4]
    #[arg(long, value_name = "N")]
    pub max_concurrent_unpacks: Option<usize>,

    /// Layer snapshotter backend: overlay (falls back to copy where overlayfs is unusable) or copy.
    /// [default: overlay]
    #[arg(long, value_name = "BACKEND")]
    pub snapshotter: Option<String>,

    /// Requests downloading bytes of large blobs at once on the whole node, shared fairly
    /// between the pods and calls that want downloads (docs/pulls.md); a blob fetched over
    /// several ranged requests holds one per request. Small blobs have as many again of their
    /// own. [default: 8]
    #[arg(long, value_name = "N")]
    pub max_concurrent_transfers: Option<usize>,

    /// Blobs of at most this many bytes (configs, small layers) are fetched in a lane of their
    /// own and never wait behind large transfers. [default: 4194304]
    #[arg(long, value_name = "BYTES")]
    pub small_blob_size: Option<u64>,

    /// Ranged requests one large blob is fetched over at once (1: one stream per blob). [default: 6]
    #[arg(long, value_name = "N")]
    pub blob_connections: Option<usize>,

    /// Bytes one ranged request of a large blob asks for; blobs smaller than two of these are
    /// fetched as one stream. [default: 33554432]
    #[arg(long, value_name = "BYTES")]
    pub blob_chunk_size: Option<u64>,

    /// Seconds without a downloaded byte after which a pull's requesters are dropped (0: never).
    /// [default: 60]
    #[arg(long, value_name = "SECONDS")]
    pub pull_progress_timeout: Option<f64>,

    /// Bytes per second a pull with something left to download must receive, averaged over each
    /// pull_progress_timeout window, or its requesters are dropped: a registry trickling bytes
    /// cannot hold a pull (or the kubelet's serial puller) forever (0: no minimum). [default: 1024]
    #[arg(long, value_name = "BYTES_PER_SEC")]
    pub pull_min_speed: Option<u64>,

    /// Seconds one manifest request may take in total, its body and the token request a 401
    /// leads to included (a blob request: until its response headers, its token request
    /// included). [default: 60]
    #[arg(long, value_name = "SECONDS")]
    pub registry_request_timeout: Option<f64>,

    /// Most bytes one layer may unpack to (its uncompressed tar stream plus the holes of its
    /// sparse files); a larger layer fails the pull. [default: 68719476736 (64 GiB)]
    #[arg(long, value_name = "BYTES")]
    pub max_layer_bytes: Option<u64>,

    /// Most entries (files, directories, links, whiteouts) one layer may have; a layer with more
    /// fails the pull. [default: 1048576]
    #[arg(long, value_name = "N")]
    pub max_layer_entries: Option<u64>,

    /// Seconds a PullImage made for a pod sandbox is held before it returns an error saying
    /// the download continues in the background for the sandbox; the kubelet retries after its
    /// back-off and the pod starts once the image is there. The budget is per sandbox and
    /// kubelet sync (0: never detach). [default: 30]
    #[arg(long, value_name = "SECONDS")]
    pub pull_detach_after: Option<f64>,

    /// The API-server watch of this node's pods (deleted pods release their pulls at once,
    /// pulls are not detached while it is connected, pull progress shows in the pods' events):
    /// auto (use the kubelet's kubeconfig when there is one) or off. [default: auto]
    #[arg(long, value_name = "auto|off")]
    pub kube_watch: Option<String>,

    /// The kubeconfig the watch uses. [default: the first of kube_watch_kubeconfig_search that
    /// exists, looked for again every 10 s until one does]
    #[arg(long, value_name = "FILE")]
    pub kube_watch_kubeconfig: Option<PathBuf>,

    /// Where the kubelet's kubeconfig is looked for, in order (repeatable). [default:
    /// /etc/kubernetes/kubelet.conf (kubeadm, kind), /var/lib/rancher/k3s/agent/kubelet.kubeconfig
    /// (k3s)]
    #[arg(long = "kube-watch-kubeconfig-search", value_name = "FILE")]
    #[serde(default)]
    pub kube_watch_kubeconfig_search: Vec<PathBuf>,

    /// The node whose pods are watched (the kubelet's node name). [default: NAME of the
    /// kubeconfig's client certificate `CN=system:node:NAME`, else the hostname]
    #[arg(long, value_name = "NAME")]
    pub kube_watch_node_name: Option<String>,

    /// Hours a partial download nobody resumes is kept. [default: 24]
    #[arg(long, value_name = "HOURS")]
    pub ingest_ttl: Option<f64>,

    /// Percent of the image filesystem that must stay free: below it, partial downloads nobody
    /// is resuming are removed however young (0: never). [default: 5]
    #[arg(long, value_name = "PERCENT")]
    pub ingest_min_free: Option<f64>,

    /// Free space of the image filesystem that pulls leave alone: a download or an unpack that
    /// would leave less stops with RESOURCE_EXHAUSTED (the downloaded bytes are kept for a
    /// resume). A percentage of the filesystem (15%) or a size (20GiB, or bytes); 0 turns it
    /// off. Must be at least ingest_min_free. [default: 15%, what the kubelet's default hard
    /// eviction threshold imagefs.available<15% keeps]
    #[arg(long, value_name = "PERCENT%|SIZE")]
    pub image_fs_reserve: Option<minicri_store::space::Reserve>,

    /// Largest blob (a layer or an image config) a manifest may list; a pull of a larger one
    /// fails with RESOURCE_EXHAUSTED before any byte is fetched. At most 1 TiB.
    /// [default: 68719476736 (64 GiB, as max_layer_bytes)]
    #[arg(long, value_name = "BYTES")]
    pub max_blob_size: Option<u64>,

    /// Keep each layer's compressed blob after the layer is unpacked. Off, the blob is deleted
    /// once the image is recorded, so an image costs its unpacked size on disk; a pull of an
    /// image whose layers are unpacked downloads nothing for them. [default: false]
    #[arg(long, value_name = "BOOL")]
    pub keep_layer_blobs: Option<bool>,

    /// Most bytes of labels and annotations of all the node's pods together (and, separately,
    /// of all its containers); a pod or container past it is refused with RESOURCE_EXHAUSTED.
    /// The default keeps every List RPC under the kubelet's 16 MiB message limit; past it, only
    /// clients that use the streamed lists (StreamPodSandboxes, ...) still list everything.
    /// [default: 8388608 (8 MiB)]
    #[arg(long, value_name = "BYTES")]
    pub node_metadata_budget: Option<u64>,

    /// Directories searched for CNI network configurations (repeatable). [default: /etc/cni/net.d]
    #[arg(long = "cni-conf-dir", value_name = "DIR")]
    #[serde(default)]
    pub cni_conf_dirs: Vec<PathBuf>,

    /// Directories searched for CNI plugin binaries (repeatable). [default: /opt/cni/bin, /usr/lib/cni]
    #[arg(long = "cni-bin-dir", value_name = "DIR")]
    #[serde(default)]
    pub cni_bin_dirs: Vec<PathBuf>,

    /// Binary of the `runc` runtime handler (runc's command line), a name on PATH or a path.
    /// [default: runc]
    #[arg(long, value_name = "BINARY")]
    pub oci_runtime: Option<PathBuf>,

    /// A runtime handler pods can choose by name (RuntimeClass `handler`): a runc-compatible
    /// binary, a name on PATH or a path (repeatable). `runc` and `crun` are built in. In the
    /// file: `[runtimes.NAME]` tables with `binary` and optionally `root`.
    #[arg(long = "runtime", value_name = "NAME=BINARY", value_parser = parse_runtime_flag)]
    #[serde(skip)]
    pub runtime_flags: Vec<(String, PathBuf)>,

    /// Runtime handlers from the file: `[runtimes.NAME]` with `binary` and `root`.
    #[arg(skip)]
    #[serde(default)]
    pub runtimes: BTreeMap<String, RuntimeEntry>,

    /// The runtime handler of pods that name none. [default: runc]
    #[arg(long, value_name = "NAME")]
    pub default_runtime: Option<String>,

    /// Serve Prometheus metrics on this loopback address (e.g. 127.0.0.1:9464) at /metrics.
    /// [default: off]
    #[arg(long, value_name = "ADDR")]
    pub metrics_address: Option<String>,

    /// Loopback address of the streaming server (exec, attach, port-forward), IP:PORT; port 0
    /// picks a free port.
    /// [default: 127.0.0.1:0]
    #[arg(long, value_name = "ADDR")]
    pub stream_address: Option<String>,

    /// Pod and container annotations passed into the OCI runtime spec: keys, or prefixes ending
    /// in `*` (repeatable). Keys that steer the runtime (`run.oci.*`, `org.systemd.property.*`,
    /// `io.kubernetes.cri.*`, ...) never pass. [default: none]
    #[arg(long = "pod-annotation", value_name = "PATTERN")]
    #[serde(default)]
    pub pod_annotations: Vec<String>,

    /// Namespaces whose pods may raise their share of the node's transfer connections with the
    /// annotation `pull.minicri.io/priority: high` (any pod may lower its own with `low`;
    /// repeatable). [default: none]
    #[arg(long = "pull-priority-namespace", value_name = "NAMESPACE")]
    #[serde(default)]
    pub pull_priority_namespaces: Vec<String>,

    /// Host paths a container may mount (or name as a device) although they are minicri's
    /// root, state directory or socket, lie inside them, or hold them (`/`, `/var/lib`, `/run`):
    /// CreateContainer refuses such mounts with INVALID_ARGUMENT unless their host path, resolved
    /// through symlinks, is listed here exactly (repeatable). `kubectl debug node/...` and
    /// node-exporter mount `/`. [default: none]
    #[arg(long = "allow-own-path-mount", value_name = "PATH")]
    #[serde(default)]
    pub allow_own_path_mounts: Vec<PathBuf>,

    /// Bytes the node's port-forward sessions may hold buffered together, both ways (what
    /// clients send before the pod reads it, what pods send before the client reads it): past
    /// it, forwards wait until bytes are delivered. At least 2097152 (2 MiB).
    /// [default: 67108864 (64 MiB)]
    #[arg(long, value_name = "BYTES")]
    pub port_forward_buffer_bytes: Option<u64>,
}

/// A `[runtimes.NAME]` table of the configuration file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeEntry {
    /// The runtime binary (runc's command line), a name on PATH or a path.
    pub binary: PathBuf,
    /// Its state directory (`--root`). [default: <state>/runtimes/NAME; <state>/runc for runc]
    pub root: Option<PathBuf>,
}

fn parse_runtime_flag(s: &str) -> Result<(String, PathBuf), String> {
    match s.split_once('=') {
        Some((name, binary)) if !name.is_empty() && !binary.is_empty() => {
            Ok((name.to_string(), binary.into()))
        }
        _ => Err(format!("{s:?} is not NAME=BINARY")),
    }
}

/// The cgroup driver the runtime uses and reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupDriver {
    Cgroupfs,
    Systemd,
}

/// Where the API-server watch finds its kubeconfig and which node's pods it follows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeWatch {
    /// Given explicitly; otherwise the first of `search` that exists.
    pub kubeconfig: Option<PathBuf>,
    pub search: Vec<PathBuf>,
    /// Given explicitly; otherwise from the client certificate, else the hostname.
    pub node_name: Option<String>,
}

/// Where the kubelet keeps its kubeconfig: kubeadm and kind, then k3s.
pub const KUBECONFIG_SEARCH: [&str; 2] = [
    "/etc/kubernetes/kubelet.conf",
    "/var/lib/rancher/k3s/agent/kubelet.kubeconfig",
];

/// Resolved configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub socket: PathBuf,
    pub root: PathBuf,
    pub state: PathBuf,
    pub registry_config_dir: PathBuf,
    pub log_level: String,
    pub cgroup_driver: CgroupDriver,
    pub platform: String,
    pub max_concurrent_downloads: usize,
    pub max_concurrent_unpacks: usize,
    pub max_concurrent_transfers: usize,
    pub small_blob_size: u64,
    /// How a large blob is fetched over several ranged requests.
    pub ranged_fetch: minicri_store::blobs::RangedFetch,
    pub snapshotter: String,
    pub pull_progress_timeout: Option<std::time::Duration>,
    /// Bytes/s a pull must receive per progress window (`None`: no minimum).
    pub pull_min_speed: Option<u64>,
    pub registry_request_timeout: std::time::Duration,
    pub max_layer_bytes: u64,
    pub max_layer_entries: u64,
    /// How long a pod's PullImage is held before it detaches (`None`: never).
    pub pull_detach_after: Option<std::time::Duration>,
    /// The API-server watch (`None`: off).
    pub kube_watch: Option<KubeWatch>,
    pub ingest_ttl: std::time::Duration,
    /// Fraction (0..1) of the filesystem that must stay free before young ingests are collected.
    pub ingest_min_free: f64,
    /// Free space of the image filesystem that downloads and unpacks keep.
    pub image_fs_reserve: minicri_store::space::Reserve,
    /// Largest blob a descriptor may claim.
    pub max_blob_size: u64,
    /// Keep compressed layer blobs once their layers are unpacked.
    pub keep_layer_blobs: bool,
    /// Most bytes of labels and annotations of the node's pods (and of its containers).
    pub node_metadata_budget: usize,
    pub cni_conf_dirs: Vec<PathBuf>,
    pub cni_bin_dirs: Vec<PathBuf>,
    /// Runtime handlers configured (the built-in ones are added by
    /// [`crate::oci::Handlers::new`]), by name.
    pub runtimes: BTreeMap<String, crate::oci::HandlerConfig>,
    /// The handler of pods that name none.
    pub default_runtime: String,
    pub metrics_address: Option<std::net::SocketAddr>,
    /// Where the streaming server listens (loopback only; port 0: any free port).
    pub stream_address: std::net::SocketAddr,
    /// Which pod annotations reach the OCI spec.
    pub pod_annotations: crate::spec::annotations::AnnotationPolicy,
    pub pull_priority_namespaces: Vec<String>,
    /// Host paths containers may mount although they touch minicri's own (resolved when checked).
    pub allow_own_path_mounts: Vec<PathBuf>,
    /// Bytes all port-forward sessions may hold buffered together.
    pub port_forward_buffer_bytes: u64,
}

/// The default of `port_forward_buffer_bytes`.
pub const DEFAULT_PORT_FORWARD_BUFFER_BYTES: u64 = 64 << 20;
/// The least `port_forward_buffer_bytes` taken: a SPDY DATA frame of up to 1 MiB is charged
/// whole before it is read, so the total must hold one with room for the other direction.
pub const MIN_PORT_FORWARD_BUFFER_BYTES: u64 = 2 << 20;

impl ServeArgs {
    /// Reads the config file (if any) and lays the flags over it.
    pub fn resolve(self) -> anyhow::Result<Config> {
        let file = match &self.config {
            Some(p) => Some(read_file(p)?),
            None if Path::new(DEFAULT_CONFIG_FILE).exists() => {
                Some(read_file(Path::new(DEFAULT_CONFIG_FILE))?)
            }
            None => None,
        };
        let merged = match file {
            Some(f) => self.over(f),
            None => self,
        };
        merged.finish()
    }

    /// `self` where set, else `base`.
    fn over(self, base: ServeArgs) -> ServeArgs {
        ServeArgs {
            config: self.config,
            socket: self.socket.or(base.socket),
            root: self.root.or(base.root),
            state: self.state.or(base.state),
            registry_config_dir: self.registry_config_dir.or(base.registry_config_dir),
            log_level: self.log_level.or(base.log_level),
            cgroup_driver: self.cgroup_driver.or(base.cgroup_driver),
            platform: self.platform.or(base.platform),
            max_concurrent_downloads: self
                .max_concurrent_downloads
                .or(base.max_concurrent_downloads),
            max_concurrent_unpacks: self.max_concurrent_unpacks.or(base.max_concurrent_unpacks),
            max_concurrent_transfers: self
                .max_concurrent_transfers
                .or(base.max_concurrent_transfers),
            small_blob_size: self.small_blob_size.or(base.small_blob_size),
            blob_connections: self.blob_connections.or(base.blob_connections),
            blob_chunk_size: self.blob_chunk_size.or(base.blob_chunk_size),
            snapshotter: self.snapshotter.or(base.snapshotter),
            pull_progress_timeout: self.pull_progress_timeout.or(base.pull_progress_timeout),
            pull_detach_after: self.pull_detach_after.or(base.pull_detach_after),
            pull_min_speed: self.pull_min_speed.or(base.pull_min_speed),
            registry_request_timeout: self
                .registry_request_timeout
                .or(base.registry_request_timeout),
            max_layer_bytes: self.max_layer_bytes.or(base.max_layer_bytes),
            max_layer_entries: self.max_layer_entries.or(base.max_layer_entries),
            kube_watch: self.kube_watch.or(base.kube_watch),
            kube_watch_kubeconfig: self.kube_watch_kubeconfig.or(base.kube_watch_kubeconfig),
            kube_watch_kubeconfig_search: if self.kube_watch_kubeconfig_search.is_empty() {
                base.kube_watch_kubeconfig_search
            } else {
                self.kube_watch_kubeconfig_search
            },
            kube_watch_node_name: self.kube_watch_node_name.or(base.kube_watch_node_name),
            ingest_ttl: self.ingest_ttl.or(base.ingest_ttl),
            ingest_min_free: self.ingest_min_free.or(base.ingest_min_free),
            image_fs_reserve: self.image_fs_reserve.or(base.image_fs_reserve),
            max_blob_size: self.max_blob_size.or(base.max_blob_size),
            keep_layer_blobs: self.keep_layer_blobs.or(base.keep_layer_blobs),
            node_metadata_budget: self.node_metadata_budget.or(base.node_metadata_budget),
            cni_conf_dirs: if self.cni_conf_dirs.is_empty() {
                base.cni_conf_dirs
            } else {
                self.cni_conf_dirs
            },
            cni_bin_dirs: if self.cni_bin_dirs.is_empty() {
                base.cni_bin_dirs
            } else {
                self.cni_bin_dirs
            },
            oci_runtime: self.oci_runtime.or(base.oci_runtime),
            runtime_flags: [base.runtime_flags, self.runtime_flags].concat(),
            runtimes: {
                let mut r = base.runtimes;
                r.extend(self.runtimes);
                r
            },
            default_runtime: self.default_runtime.or(base.default_runtime),
            metrics_address: self.metrics_address.or(base.metrics_address),
            stream_address: self.stream_address.or(base.stream_address),
            pod_annotations: if self.pod_annotations.is_empty() {
                base.pod_annotations
            } else {
                self.pod_annotations
            },
            pull_priority_namespaces: if self.pull_priority_namespaces.is_empty() {
                base.pull_priority_namespaces
            } else {
                self.pull_priority_namespaces
            },
            allow_own_path_mounts: if self.allow_own_path_mounts.is_empty() {
                base.allow_own_path_mounts
            } else {
                self.allow_own_path_mounts
            },
            port_forward_buffer_bytes: self
                .port_forward_buffer_bytes
                .or(base.port_forward_buffer_bytes),
        }
    }

    /// The configuration these settings give over the embedded defaults (no file is read).
    pub(crate) fn finish(self) -> anyhow::Result<Config> {
        let cgroup_driver = match self.cgroup_driver.as_deref().unwrap_or("cgroupfs") {
            "cgroupfs" => CgroupDriver::Cgroupfs,
            "systemd" => CgroupDriver::Systemd,
            other => bail!("cgroup_driver {other:?} is not one of cgroupfs, systemd"),
        };
        let platform = self.platform.unwrap_or_else(|| "linux/amd64".into());
        if minicri_store::manifest::Platform::parse(&platform).is_none() {
            bail!("platform {platform:?} is not os/arch[/variant]");
        }
        let max_concurrent_downloads = self.max_concurrent_downloads.unwrap_or(3);
        if max_concurrent_downloads == 0 {
            bail!("max_concurrent_downloads must be at least 1");
        }
        let snapshotter = self.snapshotter.unwrap_or_else(|| "overlay".into());
        if !matches!(snapshotter.as_str(), "overlay" | "copy") {
            bail!("snapshotter {snapshotter:?} is not one of overlay, copy");
        }
        let max_concurrent_unpacks = self.max_concurrent_unpacks.unwrap_or(4);
        if max_concurrent_unpacks == 0 {
            bail!("max_concurrent_unpacks must be at least 1");
        }
        let max_concurrent_transfers = self.max_concurrent_transfers.unwrap_or(8);
        if max_concurrent_transfers == 0 {
            bail!("max_concurrent_transfers must be at least 1");
        }
        let small_blob_size = self
            .small_blob_size
            .unwrap_or(minicri_store::blobs::DEFAULT_SMALL_BLOB_BYTES);
        let ranged_default = minicri_store::blobs::RangedFetch::default();
        let ranged_fetch = minicri_store::blobs::RangedFetch {
            connections: self.blob_connections.unwrap_or(ranged_default.connections),
            chunk_size: self.blob_chunk_size.unwrap_or(ranged_default.chunk_size),
        };
        if ranged_fetch.connections == 0 || ranged_fetch.chunk_size == 0 {
            bail!("blob_connections and blob_chunk_size must be at least 1");
        }
        let pull_progress_timeout =
            seconds_or_off("pull_progress_timeout", self.pull_progress_timeout, 60.0)?;
        let pull_detach_after = seconds_or_off("pull_detach_after", self.pull_detach_after, 30.0)?;
        let pull_min_speed = match self
            .pull_min_speed
            .unwrap_or(minicri_store::pull::DEFAULT_MIN_SPEED)
        {
            0 => None,
            n => Some(n),
        };
        let registry_request_timeout = seconds_or_off(
            "registry_request_timeout",
            self.registry_request_timeout,
            minicri_store::registry::REQUEST_DEADLINE.as_secs_f64(),
        )?
        .ok_or_else(|| anyhow::anyhow!("registry_request_timeout must be more than 0"))?;
        let max_layer_bytes = self
            .max_layer_bytes
            .unwrap_or(minicri_snapshotter::DEFAULT_MAX_LAYER_BYTES);
        let max_layer_entries = self
            .max_layer_entries
            .unwrap_or(minicri_snapshotter::DEFAULT_MAX_LAYER_ENTRIES);
        if max_layer_bytes == 0 || max_layer_entries == 0 {
            bail!("max_layer_bytes and max_layer_entries must be more than 0");
        }
        let node_name = match self.kube_watch_node_name {
            Some(n) if n.trim().is_empty() => bail!("kube_watch_node_name is empty"),
            n => n,
        };
        let kube_watch = match self.kube_watch.as_deref().unwrap_or("auto") {
            "auto" => Some(KubeWatch {
                kubeconfig: self.kube_watch_kubeconfig,
                search: if self.kube_watch_kubeconfig_search.is_empty() {
                    KUBECONFIG_SEARCH.iter().map(PathBuf::from).collect()
                } else {
                    self.kube_watch_kubeconfig_search
                },
                node_name,
            }),
            "off" if self.kube_watch_kubeconfig.is_some() => {
                bail!("kube_watch is off, but kube_watch_kubeconfig is set")
            }
            "off" => None,
            other => bail!("kube_watch {other:?} is not one of auto, off"),
        };
        let ingest_min_free = match self.ingest_min_free.unwrap_or(5.0) {
            p if !p.is_finite() || !(0.0..=100.0).contains(&p) => {
                bail!("ingest_min_free must be a percentage, 0 to 100")
            }
            p => p / 100.0,
        };
        let image_fs_reserve = self
            .image_fs_reserve
            .unwrap_or(minicri_store::space::DEFAULT_RESERVE);
        // A download stopped at a reserve under ingest_min_free would leave free space where
        // the collector takes its partial data: every retry would fetch it again. (A reserve in
        // bytes is compared once the filesystem's size is known, at start.)
        if let minicri_store::space::Reserve::Percent(p) = image_fs_reserve
            && p > 0.0
            && p / 100.0 < ingest_min_free
        {
            bail!(
                "image_fs_reserve ({p}%) is less than ingest_min_free ({}%): downloads stopped at the reserve would have their partial data collected; raise image_fs_reserve, or lower ingest_min_free",
                ingest_min_free * 100.0
            );
        }
        let max_blob_size = self
            .max_blob_size
            .unwrap_or(minicri_store::pull::DEFAULT_MAX_BLOB_SIZE);
        if !(1..=minicri_store::pull::MAX_BLOB_BYTES).contains(&max_blob_size) {
            bail!(
                "max_blob_size must be 1 to {} bytes (1 TiB)",
                minicri_store::pull::MAX_BLOB_BYTES
            );
        }
        let node_metadata_budget = self
            .node_metadata_budget
            .unwrap_or(crate::pods::DEFAULT_NODE_METADATA_BYTES as u64);
        // At least one pod's labels and annotations at their caps; at most 1 GiB of memory.
        let least = 2 * crate::pods::MAX_METADATA_BYTES as u64;
        if !(least..=1 << 30).contains(&node_metadata_budget) {
            bail!(
                "node_metadata_budget must be {least} (one object's labels and annotations at their caps) to 1073741824 bytes (1 GiB)"
            );
        }
        let ingest_ttl = match self.ingest_ttl.unwrap_or(24.0) {
            t if !t.is_finite() || !(0.0..=100_000.0).contains(&t) => {
                bail!("ingest_ttl must be a number of hours, 0 to 100000")
            }
            t => std::time::Duration::from_secs_f64(t * 3600.0),
        };
        let metrics_address = match self.metrics_address.as_deref() {
            None | Some("") => None,
            Some(a) => {
                let addr: std::net::SocketAddr = a
                    .parse()
                    .map_err(|_| anyhow::anyhow!("metrics_address {a:?} is not IP:PORT"))?;
                if !addr.ip().is_loopback() {
                    bail!(
                        "metrics_address {a:?} is not a loopback address: metrics are only served on loopback (127.0.0.1 or ::1)"
                    );
                }
                Some(addr)
            }
        };
        let stream_address = self
            .stream_address
            .as_deref()
            .filter(|a| !a.is_empty())
            .unwrap_or("127.0.0.1:0");
        let stream_address: std::net::SocketAddr = stream_address
            .parse()
            .map_err(|_| anyhow::anyhow!("stream_address {stream_address:?} is not IP:PORT"))?;
        if !stream_address.ip().is_loopback() {
            bail!(
                "stream_address {stream_address} is not a loopback address: the streaming server (exec, attach, port-forward) is only served on loopback (127.0.0.1 or ::1)"
            );
        }
        let pod_annotations = crate::spec::annotations::AnnotationPolicy::new(self.pod_annotations)
            .map_err(|e| anyhow::anyhow!(e))?;
        let mut runtimes: BTreeMap<String, crate::oci::HandlerConfig> = self
            .runtimes
            .into_iter()
            .map(|(name, e)| {
                let c = crate::oci::HandlerConfig {
                    binary: e.binary,
                    root: e.root,
                };
                (name, c)
            })
            .collect();
        // `oci_runtime` and the flags give binaries; a file's `root` for the same handler stays.
        let mut set_binary = |name: String, binary: PathBuf| {
            runtimes
                .entry(name)
                .or_insert_with(|| crate::oci::HandlerConfig {
                    binary: PathBuf::new(),
                    root: None,
                })
                .binary = binary;
        };
        if let Some(binary) = self.oci_runtime {
            if binary.as_os_str().is_empty() {
                bail!("oci_runtime must name a binary");
            }
            set_binary(crate::oci::handlers::DEFAULT_HANDLER.to_string(), binary);
        }
        for (name, binary) in self.runtime_flags {
            set_binary(name, binary);
        }
        let default_runtime = self
            .default_runtime
            .filter(|d| !d.is_empty())
            .unwrap_or_else(|| crate::oci::handlers::DEFAULT_HANDLER.into());
        crate::oci::handlers::check_config(&runtimes, &default_runtime)?;
        if let Some(p) = self.allow_own_path_mounts.iter().find(|p| !p.is_absolute()) {
            bail!(
                "{} entry {} is not an absolute path",
                crate::spec::own_paths::SETTING,
                p.display()
            );
        }
        let port_forward_buffer_bytes = self
            .port_forward_buffer_bytes
            .unwrap_or(DEFAULT_PORT_FORWARD_BUFFER_BYTES);
        if port_forward_buffer_bytes < MIN_PORT_FORWARD_BUFFER_BYTES {
            bail!(
                "port_forward_buffer_bytes must be at least {MIN_PORT_FORWARD_BUFFER_BYTES} (2 MiB)"
            );
        }
        Ok(Config {
            socket: self
                .socket
                .unwrap_or_else(|| "/run/minicri/minicri.sock".into()),
            root: self.root.unwrap_or_else(|| "/var/lib/minicri".into()),
            state: self.state.unwrap_or_else(|| "/run/minicri".into()),
            registry_config_dir: self
                .registry_config_dir
                .unwrap_or_else(|| "/etc/minicri/certs.d".into()),
            log_level: self.log_level.unwrap_or_else(|| "info".into()),
            cgroup_driver,
            platform,
            max_concurrent_downloads,
            max_concurrent_unpacks,
            max_concurrent_transfers,
            small_blob_size,
            ranged_fetch,
            snapshotter,
            pull_progress_timeout,
            pull_min_speed,
            registry_request_timeout,
            max_layer_bytes,
            max_layer_entries,
            pull_detach_after,
            kube_watch,
            ingest_ttl,
            ingest_min_free,
            image_fs_reserve,
            max_blob_size,
            keep_layer_blobs: self.keep_layer_blobs.unwrap_or(false),
            node_metadata_budget: node_metadata_budget as usize,
            cni_conf_dirs: if self.cni_conf_dirs.is_empty() {
                vec!["/etc/cni/net.d".into()]
            } else {
                self.cni_conf_dirs
            },
            cni_bin_dirs: if self.cni_bin_dirs.is_empty() {
                vec!["/opt/cni/bin".into(), "/usr/lib/cni".into()]
            } else {
                self.cni_bin_dirs
            },
            runtimes,
            default_runtime,
            metrics_address,
            stream_address,
            pod_annotations,
            pull_priority_namespaces: self.pull_priority_namespaces,
            allow_own_path_mounts: self.allow_own_path_mounts,
            port_forward_buffer_bytes,
        })
    }
}

/// A number of seconds from the configuration: `0` turns the setting off.
fn seconds_or_off(
    key: &str,
    value: Option<f64>,
    default: f64,
) -> anyhow::Result<Option<std::time::Duration>> {
    match value.unwrap_or(default) {
        t if !t.is_finite() || !(0.0..=1e9).contains(&t) => {
            bail!("{key} must be a number of seconds >= 0")
        }
        0.0 => Ok(None),
        t => Ok(Some(std::time::Duration::from_secs_f64(t))),
    }
}

fn read_file(path: &Path) -> anyhow::Result<ServeArgs> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading config file {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("parsing config file {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_without_file() {
        let c = ServeArgs {
            config: None,
            ..Default::default()
        }
        .finish()
        .unwrap();
        assert_eq!(c.socket, PathBuf::from("/run/minicri/minicri.sock"));
        assert_eq!(c.root, PathBuf::from("/var/lib/minicri"));
        assert_eq!(c.cgroup_driver, CgroupDriver::Cgroupfs);
        assert_eq!(c.cni_bin_dirs.len(), 2);
    }

    #[test]
    fn hardening_limits() {
        let c = ServeArgs::default().finish().unwrap();
        assert_eq!(c.max_layer_bytes, 64 << 30);
        assert_eq!(c.max_layer_entries, 1 << 20);
        assert_eq!(c.pull_min_speed, Some(1024));
        assert_eq!(
            c.registry_request_timeout,
            std::time::Duration::from_secs(60)
        );
        let c = ServeArgs {
            pull_min_speed: Some(0),
            max_layer_entries: Some(10),
            registry_request_timeout: Some(2.5),
            ..Default::default()
        }
        .finish()
        .unwrap();
        assert_eq!(c.pull_min_speed, None);
        assert_eq!(c.max_layer_entries, 10);
        assert_eq!(c.registry_request_timeout.as_millis(), 2500);
        for bad in [
            ServeArgs {
                max_layer_bytes: Some(0),
                ..Default::default()
            },
            ServeArgs {
                registry_request_timeout: Some(0.0),
                ..Default::default()
            },
            // Past what a Duration holds once turned into seconds: an error, not a panic.
            ServeArgs {
                ingest_ttl: Some(1e16),
                ..Default::default()
            },
        ] {
            assert!(bad.finish().is_err());
        }
    }

    #[test]
    fn layer_blobs_and_the_node_metadata_budget() {
        let c = ServeArgs::default().finish().unwrap();
        assert!(!c.keep_layer_blobs);
        assert_eq!(c.node_metadata_budget, 8 << 20);
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(
            &f,
            "keep_layer_blobs = true\nnode_metadata_budget = 33554432\n",
        )
        .unwrap();
        let c = ServeArgs {
            config: Some(f),
            ..Default::default()
        }
        .resolve()
        .unwrap();
        assert!(c.keep_layer_blobs);
        assert_eq!(c.node_metadata_budget, 32 << 20);
        for bad in [0, 1024, (1 << 30) + 1] {
            let err = ServeArgs {
                node_metadata_budget: Some(bad),
                ..Default::default()
            }
            .finish()
            .unwrap_err()
            .to_string();
            assert!(err.contains("node_metadata_budget"), "{err}");
        }
    }

    #[test]
    fn image_fs_reserve_and_max_blob_size() {
        use minicri_store::space::Reserve;
        let c = ServeArgs::default().finish().unwrap();
        assert_eq!(c.image_fs_reserve, Reserve::Percent(15.0));
        assert_eq!(c.max_blob_size, 64 << 30);
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(
            &f,
            "image_fs_reserve = \"20GiB\"\nmax_blob_size = 1048576\n",
        )
        .unwrap();
        let c = ServeArgs {
            config: Some(f.clone()),
            ..Default::default()
        }
        .resolve()
        .unwrap();
        assert_eq!(c.image_fs_reserve, Reserve::Bytes(20 << 30));
        assert_eq!(c.max_blob_size, 1 << 20);
        std::fs::write(&f, "image_fs_reserve = 0\n").unwrap();
        let c = ServeArgs {
            config: Some(f.clone()),
            ..Default::default()
        }
        .resolve()
        .unwrap();
        assert!(c.image_fs_reserve.is_off());
        let with = |reserve: &str, min_free: Option<f64>| {
            ServeArgs {
                image_fs_reserve: Some(reserve.parse().unwrap()),
                ingest_min_free: min_free,
                ..Default::default()
            }
            .finish()
        };
        // Under the collector's low-space threshold: refused, naming both settings.
        let err = with("3%", None).unwrap_err().to_string();
        assert!(
            err.contains("image_fs_reserve") && err.contains("ingest_min_free"),
            "{err}"
        );
        assert!(with("3%", Some(2.0)).is_ok());
        assert!(with("0%", None).is_ok(), "off");
        for bad in [Some(0), Some((1 << 40) + 1)] {
            let err = ServeArgs {
                max_blob_size: bad,
                ..Default::default()
            }
            .finish()
            .unwrap_err()
            .to_string();
            assert!(err.contains("max_blob_size"), "{err}");
        }
        std::fs::write(&f, "image_fs_reserve = \"a lot\"\n").unwrap();
        let err = ServeArgs {
            config: Some(f),
            ..Default::default()
        }
        .resolve()
        .unwrap_err();
        assert!(format!("{err:#}").contains("percentage"), "{err:#}");
    }

    #[test]
    fn flags_override_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(
            &f,
            "root = \"/file/root\"\nsocket = \"/file.sock\"\ncgroup_driver = \"systemd\"\n",
        )
        .unwrap();
        let args = ServeArgs {
            config: Some(f),
            socket: Some("/flag.sock".into()),
            ..Default::default()
        };
        let c = args.resolve().unwrap();
        assert_eq!(c.socket, PathBuf::from("/flag.sock"));
        assert_eq!(c.root, PathBuf::from("/file/root"));
        assert_eq!(c.cgroup_driver, CgroupDriver::Systemd);
    }

    #[test]
    fn unknown_keys_and_bad_values_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(&f, "sockett = \"/x\"\n").unwrap();
        let err = ServeArgs {
            config: Some(f.clone()),
            ..Default::default()
        }
        .resolve()
        .unwrap_err();
        assert!(format!("{err:#}").contains("sockett"), "{err:#}");
        std::fs::write(&f, "cgroup_driver = \"cgroupv3\"\n").unwrap();
        assert!(
            ServeArgs {
                config: Some(f),
                ..Default::default()
            }
            .resolve()
            .is_err()
        );
    }

    #[test]
    fn metrics_only_on_loopback_and_off_by_default() {
        let with = |a: &str| {
            ServeArgs {
                metrics_address: Some(a.into()),
                ..Default::default()
            }
            .finish()
        };
        assert_eq!(ServeArgs::default().finish().unwrap().metrics_address, None);
        assert_eq!(
            with("127.0.0.1:9464").unwrap().metrics_address,
            Some("127.0.0.1:9464".parse().unwrap())
        );
        assert!(with("[::1]:9464").is_ok());
        let err = with("0.0.0.0:9464").unwrap_err().to_string();
        assert!(err.contains("loopback"), "{err}");
        let err = with("localhost").unwrap_err().to_string();
        assert!(err.contains("IP:PORT"), "{err}");
    }

    #[test]
    fn stream_address_is_loopback_with_a_free_port_by_default() {
        let with = |a: &str| {
            ServeArgs {
                stream_address: Some(a.into()),
                ..Default::default()
            }
            .finish()
        };
        assert_eq!(
            ServeArgs::default().finish().unwrap().stream_address,
            "127.0.0.1:0".parse().unwrap()
        );
        assert_eq!(
            with("127.0.0.1:10010").unwrap().stream_address,
            "127.0.0.1:10010".parse().unwrap()
        );
        assert!(with("[::1]:0").is_ok());
        let err = with("0.0.0.0:10010").unwrap_err().to_string();
        assert!(err.contains("loopback"), "{err}");
        let err = with("10.1.2.3:10010").unwrap_err().to_string();
        assert!(err.contains("loopback"), "{err}");
        let err = with("localhost:10010").unwrap_err().to_string();
        assert!(err.contains("IP:PORT"), "{err}");
    }

    #[test]
    fn pull_detach_after_defaults_to_30_seconds_and_0_turns_it_off() {
        let with = |v: f64| {
            ServeArgs {
                pull_detach_after: Some(v),
                ..Default::default()
            }
            .finish()
        };
        assert_eq!(
            ServeArgs::default().finish().unwrap().pull_detach_after,
            Some(std::time::Duration::from_secs(30))
        );
        assert_eq!(with(0.0).unwrap().pull_detach_after, None);
        assert_eq!(
            with(2.5).unwrap().pull_detach_after,
            Some(std::time::Duration::from_millis(2500))
        );
        let err = with(-1.0).unwrap_err().to_string();
        assert!(err.contains("pull_detach_after"), "{err}");
        assert!(with(f64::NAN).is_err());
    }

    #[test]
    fn kube_watch_is_on_by_default_and_searches_the_kubelets_kubeconfig() {
        let w = ServeArgs::default().finish().unwrap().kube_watch.unwrap();
        assert_eq!(w.kubeconfig, None);
        assert_eq!(w.node_name, None);
        assert_eq!(
            w.search,
            vec![
                PathBuf::from("/etc/kubernetes/kubelet.conf"),
                PathBuf::from("/var/lib/rancher/k3s/agent/kubelet.kubeconfig")
            ]
        );
        let w = ServeArgs {
            kube_watch_kubeconfig: Some("/k/conf".into()),
            kube_watch_kubeconfig_search: vec!["/a".into()],
            kube_watch_node_name: Some("n1".into()),
            ..Default::default()
        }
        .finish()
        .unwrap()
        .kube_watch
        .unwrap();
        assert_eq!(
            w,
            KubeWatch {
                kubeconfig: Some("/k/conf".into()),
                search: vec!["/a".into()],
                node_name: Some("n1".into()),
            }
        );
        let off = ServeArgs {
            kube_watch: Some("off".into()),
            ..Default::default()
        };
        assert_eq!(off.finish().unwrap().kube_watch, None);
        for (bad, says) in [
            (
                ServeArgs {
                    kube_watch: Some("off".into()),
                    kube_watch_kubeconfig: Some("/k".into()),
                    ..Default::default()
                },
                "kube_watch is off",
            ),
            (
                ServeArgs {
                    kube_watch: Some("on".into()),
                    ..Default::default()
                },
                "auto, off",
            ),
            (
                ServeArgs {
                    kube_watch_node_name: Some(" ".into()),
                    ..Default::default()
                },
                "kube_watch_node_name is empty",
            ),
        ] {
            let err = bad.finish().unwrap_err().to_string();
            assert!(err.contains(says), "{err}");
        }
    }

    #[test]
    fn runtime_handlers_from_flags_and_file() {
        let c = ServeArgs::default().finish().unwrap();
        assert!(c.runtimes.is_empty());
        assert_eq!(c.default_runtime, "runc");
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        std::fs::write(
            &f,
            "default_runtime = \"crun\"\n[runtimes.crun]\nbinary = \"/opt/crun\"\nroot = \"/r\"\n\
             [runtimes.kata]\nbinary = \"kata-runtime\"\n",
        )
        .unwrap();
        let c = ServeArgs {
            config: Some(f),
            oci_runtime: Some("/usr/bin/runc".into()),
            runtime_flags: vec![("kata".into(), "/flag/kata".into())],
            ..Default::default()
        }
        .resolve()
        .unwrap();
        assert_eq!(c.default_runtime, "crun");
        let crun = &c.runtimes["crun"];
        assert_eq!(
            (crun.binary.as_path(), crun.root.as_deref()),
            (Path::new("/opt/crun"), Some(Path::new("/r")))
        );
        assert_eq!(c.runtimes["kata"].binary, Path::new("/flag/kata"));
        assert_eq!(c.runtimes["runc"].binary, Path::new("/usr/bin/runc"));
        for bad in [
            ServeArgs {
                default_runtime: Some("gvisor".into()),
                ..Default::default()
            },
            ServeArgs {
                runtime_flags: vec![("Bad/Name".into(), "x".into())],
                ..Default::default()
            },
            ServeArgs {
                oci_runtime: Some("".into()),
                ..Default::default()
            },
        ] {
            assert!(bad.finish().is_err());
        }
        assert!(parse_runtime_flag("kata").is_err() && parse_runtime_flag("=x").is_err());
    }

    #[test]
    fn own_path_mounts_allowed_must_be_absolute() {
        let with = |p: &str| {
            ServeArgs {
                allow_own_path_mounts: vec![p.into()],
                ..Default::default()
            }
            .finish()
        };
        assert!(
            ServeArgs::default()
                .finish()
                .unwrap()
                .allow_own_path_mounts
                .is_empty()
        );
        assert_eq!(
            with("/").unwrap().allow_own_path_mounts,
            vec![PathBuf::from("/")]
        );
        let err = with("var/lib").unwrap_err().to_string();
        assert!(
            err.contains("allow_own_path_mounts") && err.contains("absolute"),
            "{err}"
        );
    }

    #[test]
    fn port_forward_buffer_defaults_to_64_mib_and_holds_a_frame_at_least() {
        let with = |n: u64| {
            ServeArgs {
                port_forward_buffer_bytes: Some(n),
                ..Default::default()
            }
            .finish()
        };
        let c = ServeArgs::default().finish().unwrap();
        assert_eq!(c.port_forward_buffer_bytes, 64 << 20);
        assert_eq!(with(2 << 20).unwrap().port_forward_buffer_bytes, 2 << 20);
        let err = with((2 << 20) - 1).unwrap_err().to_string();
        assert!(err.contains("port_forward_buffer_bytes"), "{err}");
    }
}

//! CNI networking for pod sandboxes, per the CNI specification (0.3.0 to 1.1.0).
//!
//! Owns attaching a sandbox's network namespace to the configured network and detaching it:
//! [`CniManager::setup`] (ADD), [`CniManager::teardown`] (DEL), [`CniManager::check`] (CHECK),
//! the NetworkReady answer ([`CniManager::network_ready`]) and the pod CIDR the kubelet sends with
//! UpdateRuntimeConfig. The namespace itself belongs to [`crate::netns`].
//!
//! - [`config`]: which configuration file is used, and parsing it;
//! - [`exec`]: running one plugin binary;
//! - [`result`]: plugin results and errors;
//! - [`pod`]: the pod's identity and capability arguments;
//! - [`cache`]: what DEL and CHECK need from the ADD.
//!
//! Invariants:
//! - Operations on one container id are serialised (spec: the runtime must not invoke parallel
//!   operations for the same container); different containers run in parallel.
//! - After a failed [`setup`](CniManager::setup) nothing stays allocated: the plugins whose ADD ran
//!   are DELeted in reverse (best effort, logged) and the cache entry is removed once that DEL
//!   succeeded (else it stays, so a teardown retries with the whole list).
//! - [`teardown`](CniManager::teardown) is idempotent and works without the namespace; its cache
//!   entry is removed only when the DEL of the whole list succeeded, so a failed DEL can be retried.
//! - The configuration is read from disk at each operation; a running pod is always detached with
//!   the configuration it was attached with (from the cache).

pub mod cache;
pub mod config;
pub mod exec;
pub mod pod;
pub mod result;
pub mod settings;

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use serde_json::{Map, Value};

pub use cache::{Cache, CacheEntry};
pub use config::{LoadReport, NetworkConfigList};
pub use exec::{Command, Invocation, PluginRunner};
pub use pod::{Bandwidth, DnsConfig, PodNetwork, PortMapping};
pub use result::{CniResult, PluginError};

/// Errors of CNI operations. Every plugin failure names the plugin and the command.
#[derive(Debug, thiserror::Error)]
pub enum CniError {
    /// No usable network configuration (the text says where minicri looked and what it skipped).
    #[error("network not ready: {0}")]
    NotReady(String),
    #[error("invalid pod network request: {0}")]
    InvalidArgument(String),
    #[error("CNI plugin {plugin:?} not found in {dirs}")]
    PluginNotFound { plugin: String, dirs: String },
    #[error("CNI plugin {plugin} {command} failed: {message}")]
    Plugin {
        plugin: String,
        command: Command,
        message: String,
        /// The spec error code, when the plugin printed an error object.
        code: Option<u32>,
    },
    #[error("CNI plugin {plugin} {command} timed out after {}s", timeout.as_secs_f64())]
    Timeout {
        plugin: String,
        command: Command,
        timeout: Duration,
    },
    #[error("CNI plugin {plugin} {command} could not be run: {source}")]
    Exec {
        plugin: String,
        command: Command,
        #[source]
        source: std::io::Error,
    },
    #[error("CNI plugin {plugin} {command} printed an invalid result: {reason}")]
    BadResult {
        plugin: String,
        command: Command,
        reason: String,
    },
    #[error("CNI cache {}: {source}", path.display())]
    Cache {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no CNI ADD result recorded for {0}")]
    NotAdded(String),
    #[error("the network of {0} is already set up (or a failed setup awaits teardown)")]
    AlreadyAdded(String),
    #[error("network namespace {} of {id} does not exist", netns.display())]
    NoNetns { id: String, netns: PathBuf },
}

/// Where the CNI manager looks and keeps its state.
#[derive(Debug, Clone)]
pub struct CniOptions {
    /// Configuration directories (default `/etc/cni/net.d`).
    pub conf_dirs: Vec<PathBuf>,
    /// Plugin directories, searched in order and passed as `CNI_PATH`.
    pub bin_dirs: Vec<PathBuf>,
    /// The daemon's state directory; the cache is `<state>/cni/cache/`.
    pub state_dir: PathBuf,
    /// Time limit of one plugin invocation.
    pub plugin_timeout: Duration,
}

impl CniOptions {
    /// Default plugin time limit: well inside the kubelet's 2-minute runtime request timeout,
    /// with room for the rollback DEL.
    pub const DEFAULT_PLUGIN_TIMEOUT: Duration = Duration::from_secs(30);

    pub fn new(conf_dirs: Vec<PathBuf>, bin_dirs: Vec<PathBuf>, state_dir: &Path) -> Self {
        CniOptions {
            conf_dirs,
            bin_dirs,
            state_dir: state_dir.to_path_buf(),
            plugin_timeout: Self::DEFAULT_PLUGIN_TIMEOUT,
        }
    }
}

/// A sandbox's network after ADD.
#[derive(Debug, Clone)]
pub struct NetworkStatus {
    /// The network name from the configuration.
    pub network: String,
    pub config_source: Option<PathBuf>,
    pub if_name: String,
    /// The pod IPs: addresses on the pod interface, IPv4 first. The first is the primary
    /// (`PodSandboxNetworkStatus.ip`), the rest are `additional_ips`.
    pub ips: Vec<IpAddr>,
    /// The last plugin's result.
    pub result: CniResult,
}

impl NetworkStatus {
    pub fn primary_ip(&self) -> Option<IpAddr> {
        self.ips.first().copied()
    }

    pub fn additional_ips(&self) -> &[IpAddr] {
        self.ips.get(1..).unwrap_or(&[])
    }
}

/// Attaches and detaches pod sandboxes; one per daemon.
pub struct CniManager {
    opts: CniOptions,
    runner: PluginRunner,
    cache: Cache,
    /// The pod CIDR from UpdateRuntimeConfig. Stored and reported only: minicri does not write or
    /// template CNI configurations, so it reaches no plugin; the configuration's IPAM decides the
    /// addresses (`ranges`/`subnet` of host-local).
    pod_cidr: Mutex<String>,
    /// One lock per container id with an operation under way.
    locks: minicri_store::keyed::KeyedLocks<String>,
}

impl CniManager {
    pub fn new(opts: CniOptions) -> Self {
        let runner = PluginRunner::new(opts.bin_dirs.clone(), opts.plugin_timeout);
        let cache = Cache::new(opts.state_dir.join("cni").join("cache"));
        CniManager {
            opts,
            runner,
            cache,
            pod_cidr: Mutex::new(String::new()),
            locks: minicri_store::keyed::KeyedLocks::new(),
        }
    }

    pub fn options(&self) -> &CniOptions {
        &self.opts
    }

    pub fn cache(&self) -> &Cache {
        &self.cache
    }

    /// Reads the configuration directories now (off the async workers: Status calls it every
    /// few seconds, and the directories are the administrator's).
    pub fn load_config(&self) -> (Option<NetworkConfigList>, LoadReport) {
        minicri_store::fsutil::off_async(|| config::load(&self.opts.conf_dirs))
    }

    /// NetworkReady: `Ok(file in use)` when a valid configuration exists, else `Err(why not)`
    /// suitable for the condition's message. Reads the directories (a few small files).
    pub fn network_ready(&self) -> Result<PathBuf, String> {
        let (list, report) = self.load_config();
        match (list, &report.chosen) {
            (Some(_), Some(p)) => Ok(p.clone()),
            _ => Err(report.summary(&self.opts.conf_dirs)),
        }
    }

    pub fn set_pod_cidr(&self, cidr: &str) {
        *self.pod_cidr.lock().unwrap_or_else(|p| p.into_inner()) = cidr.to_string();
    }

    /// The last pod CIDR the kubelet sent (empty if none).
    pub fn pod_cidr(&self) -> String {
        self.pod_cidr
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    async fn lock(&self, id: &str) -> tokio::sync::OwnedMutexGuard<()> {
        self.locks.lock(&id.to_string()).await
    }

    /// ADD: attaches the pod's namespace to the network, running the list's plugins in order, each
    /// getting the previous one's result as `prevResult` (spec, "Adding an attachment").
    pub async fn setup(&self, pod: &PodNetwork) -> Result<NetworkStatus, CniError> {
        pod.validate().map_err(CniError::InvalidArgument)?;
        let caps = pod.capability_args().map_err(CniError::InvalidArgument)?;
        let _guard = self.lock(&pod.id).await;
        // Spec: the runtime must not call ADD twice without a DEL in between. An entry also
        // remains after a failed ADD whose rollback failed: teardown must run first.
        if self.cache.path(&pod.id).exists() {
            return Err(CniError::AlreadyAdded(pod.id.clone()));
        }
        // Spec: the namespace exists before any plugin is invoked.
        if !crate::netns::exists(&pod.netns) {
            return Err(CniError::NoNetns {
                id: pod.id.clone(),
                netns: pod.netns.clone(),
            });
        }
        let (list, report) = self.load_config();
        let list = list.ok_or_else(|| CniError::NotReady(report.summary(&self.opts.conf_dirs)))?;
        let if_name = pod.if_name();
        let netns = pod.netns.to_string_lossy().into_owned();
        let args = pod.cni_args();
        let mut entry = CacheEntry::new(
            &pod.id,
            if_name,
            &pod.netns,
            args.clone(),
            list.to_value(),
            list.source.clone(),
            caps.clone(),
        );
        self.cache.write(&entry)?;
        let inv = Invocation {
            command: Command::Add,
            container_id: &pod.id,
            netns: &netns,
            if_name,
            args: &args,
        };
        let mut prev: Option<CniResult> = None;
        for (i, plugin) in list.plugins.iter().enumerate() {
            let conf = plugin_config(&list, plugin, &caps, prev.as_ref().map(|r| &r.raw));
            let added = self.add_one(plugin, &inv, &conf).await;
            match added {
                Ok(r) => prev = Some(r),
                Err(e) => {
                    self.rollback(&list, i + 1, &inv, &caps, prev.as_ref())
                        .await;
                    return Err(e);
                }
            }
        }
        let Some(result) = prev else {
            unreachable!("a configuration list has at least one plugin")
        };
        entry.result = Some(result.raw.clone());
        if let Err(e) = self.cache.write(&entry) {
            self.rollback(&list, list.plugins.len(), &inv, &caps, Some(&result))
                .await;
            return Err(e);
        }
        let status = NetworkStatus {
            network: list.name.clone(),
            config_source: list.source.clone(),
            if_name: if_name.to_string(),
            ips: result.pod_ips(if_name),
            result,
        };
        tracing::info!(id = %pod.id, network = %status.network, ips = ?status.ips, "pod network set up");
        Ok(status)
    }

    async fn add_one(
        &self,
        plugin: &Map<String, Value>,
        inv: &Invocation<'_>,
        conf: &[u8],
    ) -> Result<CniResult, CniError> {
        let name = plugin_type(plugin);
        let out = self.runner.run(name, inv, conf).await?;
        CniResult::parse(&out).map_err(|reason| CniError::BadResult {
            plugin: name.to_string(),
            command: Command::Add,
            reason,
        })
    }

    /// Undoes a failed ADD: DEL, in reverse, of the first `ran` plugins (those whose ADD ran,
    /// the failed one included since it may have allocated before failing), then the cache entry.
    /// A plugin that cannot be found is skipped: it never ran. Failures are logged; the ADD's own
    /// error is what the caller gets, and the cache entry stays for a later teardown of the whole
    /// list.
    async fn rollback(
        &self,
        list: &NetworkConfigList,
        ran: usize,
        add: &Invocation<'_>,
        caps: &Map<String, Value>,
        prev: Option<&CniResult>,
    ) {
        let inv = Invocation {
            command: Command::Del,
            ..add.clone()
        };
        let attempted = NetworkConfigList {
            plugins: list.plugins[..ran].to_vec(),
            ..list.clone()
        };
        match self
            .del_list(&attempted, &inv, caps, prev.map(|r| &r.raw), true)
            .await
        {
            Ok(()) => {
                if let Err(e) = self.cache.remove(add.container_id) {
                    tracing::warn!(id = add.container_id, error = %e, "removing the CNI cache after a failed ADD");
                }
            }
            Err(e) => {
                tracing::warn!(id = add.container_id, error = %e, "DEL after a failed ADD failed; teardown will retry")
            }
        }
    }

    /// DEL of every plugin in reverse order. A teardown stops at the first failure (spec,
    /// "Deleting an attachment"); a rollback (`best_effort`) goes on so that the plugins before a
    /// failing one still release what they allocated, ignores plugins that cannot be found, and
    /// returns the first error.
    /// `prevResult` only from spec 0.4.0 on, which introduced it for DEL.
    async fn del_list(
        &self,
        list: &NetworkConfigList,
        inv: &Invocation<'_>,
        caps: &Map<String, Value>,
        prev: Option<&Value>,
        best_effort: bool,
    ) -> Result<(), CniError> {
        let prev = prev.filter(|_| config::version_tuple(&list.cni_version) >= (0, 4, 0));
        let mut first_err = None;
        for plugin in list.plugins.iter().rev() {
            let conf = plugin_config(list, plugin, caps, prev);
            match self.runner.run(plugin_type(plugin), inv, &conf).await {
                Ok(_) => {}
                Err(e) if !best_effort => return Err(e),
                Err(CniError::PluginNotFound { .. }) => {}
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Tears down the networks of cache entries whose sandbox `known` does not know: ADDs whose
    /// rollback DEL failed (the plugin's daemon not up yet, at boot) or was cut short by a
    /// SIGKILL. Nothing else would ever release their addresses: the kubelet never got a sandbox
    /// id to stop. An entry stays until its DEL succeeds. Returns the ids torn down.
    pub async fn sweep(&self, known: impl Fn(&str) -> bool) -> Vec<String> {
        let mut done = Vec::new();
        for id in self.cache.ids() {
            if known(&id) {
                continue;
            }
            let pod = PodNetwork {
                id: id.clone(),
                ..Default::default()
            };
            match self.teardown(&pod).await {
                Ok(()) => {
                    tracing::info!(sandbox = %id, "tore down the network of a sandbox that was never recorded");
                    done.push(id);
                }
                Err(e) => {
                    tracing::warn!(sandbox = %id, error = %e, "the network of a sandbox that was never recorded: teardown failed, tried again later")
                }
            }
        }
        done
    }

    /// DEL: detaches the pod, with the configuration and result cached at ADD (or, with no cache,
    /// the current configuration). Idempotent. When the namespace is gone, `CNI_NETNS` is empty,
    /// which the spec allows for DEL (plugins then release what they can, e.g. IPAM).
    pub async fn teardown(&self, pod: &PodNetwork) -> Result<(), CniError> {
        pod.validate().map_err(CniError::InvalidArgument)?;
        let guard = self.lock(&pod.id).await;
        let cached = self.cache.read(&pod.id);
        let from_cache = cached.as_ref().and_then(|e| {
            NetworkConfigList::from_value(e.config.clone(), e.config_source.clone())
                .inspect_err(|why| tracing::warn!(id = %pod.id, %why, "unusable cached CNI config"))
                .ok()
                .map(|l| (l, e))
        });
        let (list, if_name, args, caps, prev) = match from_cache {
            Some((list, e)) => (
                list,
                e.if_name.clone(),
                e.cni_args.clone(),
                e.capability_args.clone(),
                e.result.clone(),
            ),
            None => {
                let (list, report) = self.load_config();
                let Some(list) = list else {
                    // Nothing recorded and nothing configured: no plugin could be told anything.
                    tracing::warn!(id = %pod.id, why = %report.summary(&self.opts.conf_dirs), "no CNI configuration to tear down with");
                    return Ok(());
                };
                let caps = pod.capability_args().unwrap_or_default();
                (list, pod.if_name().to_string(), pod.cni_args(), caps, None)
            }
        };
        // The caller's path, or the one ADD used when the caller does not know it.
        let netns_path = match (&cached, pod.netns.as_os_str().is_empty()) {
            (Some(e), true) => e.netns.clone(),
            _ => pod.netns.clone(),
        };
        let netns = if crate::netns::exists(&netns_path) {
            netns_path.to_string_lossy().into_owned()
        } else {
            String::new()
        };
        let inv = Invocation {
            command: Command::Del,
            container_id: &pod.id,
            netns: &netns,
            if_name: &if_name,
            args: &args,
        };
        self.del_list(&list, &inv, &caps, prev.as_ref(), false)
            .await?;
        // Spec: a cached result must be deleted on a successful DEL.
        self.cache.remove(&pod.id)?;
        drop(guard);
        tracing::info!(id = %pod.id, network = %list.name, "pod network torn down");
        Ok(())
    }

    /// CHECK: asks every plugin, in order, whether the attachment is still as ADD left it. A no-op
    /// success when the list has `disableCheck` or a spec version before 0.4.0 (no CHECK there).
    pub async fn check(&self, pod: &PodNetwork) -> Result<(), CniError> {
        pod.validate().map_err(CniError::InvalidArgument)?;
        let _guard = self.lock(&pod.id).await;
        let Some(entry) = self.cache.read(&pod.id) else {
            return Err(CniError::NotAdded(pod.id.clone()));
        };
        let Some(result) = entry.result.clone() else {
            return Err(CniError::NotAdded(pod.id.clone()));
        };
        let list = NetworkConfigList::from_value(entry.config.clone(), entry.config_source.clone())
            .map_err(|why| CniError::NotReady(format!("cached configuration: {why}")))?;
        if list.disable_check || config::version_tuple(&list.cni_version) < (0, 4, 0) {
            return Ok(());
        }
        if !crate::netns::exists(&entry.netns) {
            return Err(CniError::NoNetns {
                id: pod.id.clone(),
                netns: entry.netns.clone(),
            });
        }
        let netns = entry.netns.to_string_lossy().into_owned();
        let inv = Invocation {
            command: Command::Check,
            container_id: &pod.id,
            netns: &netns,
            if_name: &entry.if_name,
            args: &entry.cni_args,
        };
        for plugin in &list.plugins {
            let conf = plugin_config(&list, plugin, &entry.capability_args, Some(&result));
            self.runner.run(plugin_type(plugin), &inv, &conf).await?;
        }
        Ok(())
    }

    /// The network status recorded by a completed ADD of `id` (e.g. after a daemon restart).
    pub fn cached_status(&self, id: &str) -> Option<NetworkStatus> {
        let e = self.cache.read(id)?;
        let result = CniResult::from_value(e.result?).ok()?;
        let list = NetworkConfigList::from_value(e.config, e.config_source).ok()?;
        Some(NetworkStatus {
            network: list.name,
            config_source: list.source,
            ips: result.pod_ips(&e.if_name),
            if_name: e.if_name,
            result,
        })
    }
}

fn plugin_type(plugin: &Map<String, Value>) -> &str {
    plugin.get("type").and_then(Value::as_str).unwrap_or("")
}

/// The configuration one plugin gets on stdin (spec 1.0, "Deriving execution configuration from
/// plugin configuration"): the plugin object with `cniVersion` and `name` of the list, the
/// `capabilities` key removed, `runtimeConfig` holding the capability arguments the plugin
/// declares and the runtime has (merged over a static `runtimeConfig`, if any), and `prevResult`.
pub fn plugin_config(
    list: &NetworkConfigList,
    plugin: &Map<String, Value>,
    capability_args: &Map<String, Value>,
    prev_result: Option<&Value>,
) -> Vec<u8> {
    let mut conf = plugin.clone();
    conf.insert("cniVersion".into(), Value::String(list.cni_version.clone()));
    conf.insert("name".into(), Value::String(list.name.clone()));
    let declared = conf.remove("capabilities");
    let mut runtime_config = match conf.remove("runtimeConfig") {
        Some(Value::Object(m)) => m,
        _ => Map::new(),
    };
    if let Some(Value::Object(declared)) = declared {
        for (cap, on) in declared {
            if on == Value::Bool(true)
                && let Some(arg) = capability_args.get(&cap)
            {
                runtime_config.insert(cap, arg.clone());
            }
        }
    }
    if !runtime_config.is_empty() {
        conf.insert("runtimeConfig".into(), Value::Object(runtime_config));
    }
    match prev_result {
        Some(r) => conf.insert("prevResult".into(), r.clone()),
        None => conf.remove("prevResult"),
    };
    serde_json::to_vec(&conf).expect("JSON values serialise")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn plugin_config_derivation() {
        let list = NetworkConfigList::parse(
            br#"{"cniVersion":"1.0.0","name":"net","plugins":[
                {"type":"bridge"},
                {"type":"portmap","capabilities":{"portMappings":true,"bandwidth":false,"dns":true},
                 "runtimeConfig":{"static":1}}]}"#,
            None,
        )
        .unwrap();
        let caps = json!({"portMappings":[{"hostPort":1}],"bandwidth":{"ingressRate":1}});
        let caps = caps.as_object().unwrap();
        let c: Value =
            serde_json::from_slice(&plugin_config(&list, &list.plugins[0], caps, None)).unwrap();
        assert_eq!(
            c,
            json!({"type":"bridge","cniVersion":"1.0.0","name":"net"})
        );
        let prev = json!({"cniVersion":"1.0.0","ips":[]});
        let c: Value =
            serde_json::from_slice(&plugin_config(&list, &list.plugins[1], caps, Some(&prev)))
                .unwrap();
        // Declared and available: portMappings. Declared false: bandwidth. Declared but absent: dns.
        assert_eq!(
            c,
            json!({"type":"portmap","cniVersion":"1.0.0","name":"net",
                   "runtimeConfig":{"static":1,"portMappings":[{"hostPort":1}]},
                   "prevResult":prev})
        );
    }

    #[test]
    fn network_status_ips() {
        let result = CniResult::parse(br#"{"cniVersion":"1.0.0"}"#).unwrap();
        let mut s = NetworkStatus {
            network: "n".into(),
            config_source: None,
            if_name: "eth0".into(),
            ips: vec![],
            result,
        };
        assert_eq!(s.primary_ip(), None);
        assert!(s.additional_ips().is_empty());
        s.ips = vec!["10.0.0.1".parse().unwrap(), "fd00::1".parse().unwrap()];
        assert_eq!(s.primary_ip(), Some("10.0.0.1".parse().unwrap()));
        assert_eq!(s.additional_ips(), ["fd00::1".parse::<IpAddr>().unwrap()]);
    }
}

//! Runtime handlers: the OCI runtimes a pod can run under, by the name RunPodSandbox's
//! `runtime_handler` gives (a Kubernetes RuntimeClass's `handler`).
//!
//! Each handler is a runc-compatible binary with its own state directory (`--root`). `runc` is
//! built in and is the default (the handler `""` means the default); `crun` is built in too and
//! is offered where it works. The configuration's `runtime.handlers` table adds handlers or
//! changes these (`[runtime.handlers.NAME] binary = ..., root = ...`), and
//! `runtime.default_runtime` names the default.
//!
//! Whether a handler works is found out, not assumed: at start each one creates and deletes a
//! throwaway container (the infra process's rootfs, its own cgroup and namespaces) under a root
//! of its own. A handler whose binary is missing, or that cannot create that container (crun
//! refuses hosts whose cgroup v2 hierarchy is mounted beside v1 controllers, "hybrid" mode), is
//! unavailable: left out of the Status RPC's handlers, refused by RunPodSandbox with the
//! runtime's own reason, and logged at start.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OnceCell;

use super::error::{OciError, Result};
use super::runc::Runc;
use super::runtime::{OciRuntime, ProbeEnv};

/// The handler used when none is configured as the default.
pub const DEFAULT_HANDLER: &str = "runc";

/// The handlers every daemon has (their binaries found on PATH), unless configured otherwise.
const BUILT_IN: [&str; 2] = [DEFAULT_HANDLER, "crun"];

/// How long the availability probe of one handler may take.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// What a handler is configured as (a `[runtime.handlers.NAME]` table): its binary and its
/// state directory.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HandlerConfig {
    /// The runtime binary (runc's command line), a name on PATH or a path.
    pub binary: PathBuf,
    /// `--root`; [`Handlers::new`] defaults it (<state>/runtimes/NAME; <state>/runc for runc).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<PathBuf>,
}

/// What a handler supports, as the Status RPC reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HandlerFeatures {
    pub recursive_read_only_mounts: bool,
    pub user_namespaces: bool,
}

/// One runtime handler.
pub struct Handler {
    pub name: String,
    pub runtime: Arc<dyn OciRuntime>,
    pub features: HandlerFeatures,
    /// `Err(reason)` once probed and found unusable.
    probed: OnceCell<std::result::Result<(), String>>,
}

impl Handler {
    /// The probe's outcome, if it ran (polled calls read this; they never probe).
    pub fn probed(&self) -> Option<std::result::Result<(), String>> {
        self.probed.get().cloned()
    }

    /// Whether the handler works here (`Err` says why not); probes it on first use.
    pub async fn availability(&self, probe: &ProbeEnv) -> std::result::Result<(), String> {
        self.probed
            .get_or_init(|| self.runtime.check_available(&self.name, probe))
            .await
            .clone()
    }
}

impl std::fmt::Debug for Handler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Handler")
            .field("name", &self.name)
            .field("binary", &self.runtime.command().binary)
            .field("features", &self.features)
            .finish()
    }
}

/// Every configured handler, by name.
#[derive(Debug, Clone)]
pub struct Handlers {
    default: String,
    by_name: BTreeMap<String, Arc<Handler>>,
}

/// A handler name, as Kubernetes allows for a RuntimeClass handler (a DNS label: lowercase
/// letters, digits and '-', at most 63), which also keeps it a safe directory name.
pub fn valid_handler_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// The handler names and binaries of a configuration, and its default among them (or the
/// built-in handlers).
pub fn check_config(configured: &BTreeMap<String, HandlerConfig>, default: &str) -> Result<()> {
    for (name, c) in configured {
        if !valid_handler_name(name) {
            return Err(OciError::invalid(format!(
                "runtime handler name {name:?} is not a DNS label (lowercase letters, digits and \
                 '-', at most 63)"
            )));
        }
        if c.binary.as_os_str().is_empty() {
            return Err(OciError::invalid(format!(
                "runtime handler {name:?} must name a binary"
            )));
        }
    }
    if !BUILT_IN.contains(&default) && !configured.contains_key(default) {
        let mut known: Vec<&str> = BUILT_IN.to_vec();
        known.extend(configured.keys().map(String::as_str));
        known.sort();
        known.dedup();
        return Err(OciError::invalid(format!(
            "runtime.default_runtime {default:?} is not a configured runtime handler ({})",
            known.join(", ")
        )));
    }
    Ok(())
}

impl Handlers {
    /// The built-in handlers (`runc`, `crun`) overlaid with `configured`; `default` names the
    /// handler `""` stands for. Each gets `--root` `<state>/runc` for `runc` (where its
    /// containers have always been) and `<state>/runtimes/<name>` for any other, unless set.
    /// `features` gives each runtime's supported features.
    pub fn new(
        configured: &BTreeMap<String, HandlerConfig>,
        default: &str,
        state: &Path,
        systemd_cgroup: bool,
        features: impl Fn(&Runc) -> HandlerFeatures,
    ) -> Result<Handlers> {
        let mut all: BTreeMap<String, HandlerConfig> = BUILT_IN
            .into_iter()
            .map(|n| {
                let c = HandlerConfig {
                    binary: n.into(),
                    root: None,
                };
                (n.to_string(), c)
            })
            .collect();
        all.extend(configured.iter().map(|(k, v)| (k.clone(), v.clone())));
        check_config(configured, default)?;
        let runtimes = all.into_iter().map(|(name, c)| {
            let root = c.root.clone().unwrap_or_else(|| {
                if name == DEFAULT_HANDLER {
                    state.join("runc")
                } else {
                    state.join("runtimes").join(&name)
                }
            });
            let mut runtime = Runc::new(c.binary, root);
            runtime.systemd_cgroup = systemd_cgroup;
            let features = features(&runtime);
            (name, Arc::new(runtime) as Arc<dyn OciRuntime>, features)
        });
        Ok(Handlers::from_runtimes(default, runtimes))
    }

    /// Handlers over runtimes built already (`default` must be among them).
    pub fn from_runtimes(
        default: &str,
        runtimes: impl IntoIterator<Item = (String, Arc<dyn OciRuntime>, HandlerFeatures)>,
    ) -> Handlers {
        let by_name = runtimes
            .into_iter()
            .map(|(name, runtime, features)| {
                let handler = Handler {
                    name: name.clone(),
                    runtime,
                    features,
                    probed: OnceCell::new(),
                };
                (name, Arc::new(handler))
            })
            .collect();
        Handlers {
            default: default.to_string(),
            by_name,
        }
    }

    /// The name of the default handler.
    pub fn default_name(&self) -> &str {
        &self.default
    }

    /// Every handler, by name.
    pub fn all(&self) -> impl Iterator<Item = &Arc<Handler>> {
        self.by_name.values()
    }

    /// The handler `name` stands for (`""`: the default), or why there is none.
    pub fn get(&self, name: &str) -> Result<&Arc<Handler>> {
        let name = if name.is_empty() { &self.default } else { name };
        self.by_name
            .get(name)
            .ok_or_else(|| OciError::UnknownHandler {
                name: name.to_string(),
                known: self.by_name.keys().cloned().collect(),
            })
    }

    /// The handler for a new pod: known and available here.
    pub async fn for_new_pod(&self, name: &str, probe: &ProbeEnv) -> Result<&Arc<Handler>> {
        let h = self.get(name)?;
        h.availability(probe)
            .await
            .map_err(|reason| OciError::HandlerUnavailable {
                name: h.name.clone(),
                reason,
            })?;
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oci::CgroupDriver;
    use crate::pause::InfraRootfs;

    fn handlers(configured: &[(&str, &str)], default: &str) -> Result<Handlers> {
        let configured = configured
            .iter()
            .map(|(n, b)| {
                let c = HandlerConfig {
                    binary: b.into(),
                    root: None,
                };
                (n.to_string(), c)
            })
            .collect();
        Handlers::new(&configured, default, Path::new("/run/m"), false, |_| {
            HandlerFeatures::default()
        })
    }

    #[test]
    fn built_ins_and_roots() {
        let h = handlers(&[("kata-like", "/opt/k/bin/rt")], "runc").unwrap();
        assert_eq!(
            h.all().map(|h| h.name.as_str()).collect::<Vec<_>>(),
            ["crun", "kata-like", "runc"]
        );
        assert_eq!(h.get("").unwrap().name, "runc");
        assert_eq!(
            h.get("runc").unwrap().runtime.command().root,
            Path::new("/run/m/runc")
        );
        let k = h.get("kata-like").unwrap().runtime.command();
        assert_eq!(k.root, Path::new("/run/m/runtimes/kata-like"));
        assert_eq!(k.binary, Path::new("/opt/k/bin/rt"));
    }

    #[test]
    fn the_default_can_be_another_handler() {
        let h = handlers(&[], "crun").unwrap();
        assert_eq!(h.get("").unwrap().name, "crun");
        assert_eq!(h.default_name(), "crun");
    }

    #[test]
    fn unknown_handlers_are_refused_by_name() {
        let h = handlers(&[], "runc").unwrap();
        let e = h.get("gvisor").unwrap_err().to_string();
        assert!(e.contains("\"gvisor\"") && e.contains("crun, runc"), "{e}");
        let e = handlers(&[], "youki").unwrap_err().to_string();
        assert!(e.contains("default_runtime \"youki\""), "{e}");
    }

    #[test]
    fn names_are_dns_labels() {
        for bad in ["", "Runc", "a/b", "..", "-x", "x-", &"a".repeat(64)] {
            assert!(!valid_handler_name(bad), "{bad:?}");
            assert!(handlers(&[(bad, "/bin/true")], "runc").is_err(), "{bad:?}");
        }
        for good in ["runc", "crun", "kata-qemu", "a1", &"a".repeat(63)] {
            assert!(valid_handler_name(good), "{good:?}");
        }
    }

    /// A probe environment under `dir` (no infra rootfs is needed before the runtime runs).
    fn probe_env(dir: &Path, timeout: Duration) -> ProbeEnv {
        ProbeEnv {
            dir: dir.join("probe"),
            infra: InfraRootfs {
                rootfs: dir.join("rootfs"),
                binary: "/bin/true".into(),
                lib_dirs: vec![],
            },
            cgroup_driver: CgroupDriver::Cgroupfs,
            timeout,
        }
    }

    #[tokio::test]
    async fn a_missing_binary_is_unavailable_with_its_reason() {
        let dir = tempfile::tempdir().unwrap();
        let h = handlers(&[("gone", "/nonexistent/runtime")], "runc").unwrap();
        let env = probe_env(dir.path(), PROBE_TIMEOUT);
        let e = h.for_new_pod("gone", &env).await.unwrap_err().to_string();
        assert!(
            e.contains("\"gone\"") && e.contains("/nonexistent/runtime not found"),
            "{e}"
        );
    }

    #[tokio::test]
    async fn a_hung_runtime_is_killed_at_the_probe_timeout() {
        let dir = tempfile::tempdir().unwrap();
        let pid_file = dir.path().join("hung.pid");
        let bin = dir.path().join("hung-runtime");
        crate::fsutil::write_executable(
            &bin,
            &format!(
                "#!/bin/sh\necho $$ > {}\nexec sleep 1000\n",
                pid_file.display()
            ),
        );
        let h = handlers(&[("hung", bin.to_str().unwrap())], "runc").unwrap();
        let env = probe_env(dir.path(), Duration::from_millis(500));
        let e = h.for_new_pod("hung", &env).await.unwrap_err().to_string();
        assert!(e.contains("no answer within 500ms"), "{e}");
        let pid: i32 = std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // Killed: gone, or a zombie until the runtime's orphan reaper collects it.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let alive = || {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|st| st.rsplit(')').next().is_some_and(|r| !r.starts_with(" Z")))
        };
        while alive() && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(!alive(), "the hung runtime (pid {pid}) still runs");
    }
}

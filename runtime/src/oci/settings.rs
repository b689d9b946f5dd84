//! The `[runtime]` section of the daemon's configuration: the OCI runtime handlers, the cgroup
//! driver, and what of a pod spec reaches the OCI spec. Each field is a key of the section and
//! a flag of `minicri serve`; its default is in [`Default`] only.

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::Args;
use serde::{Deserialize, Serialize};

use super::handlers::{DEFAULT_HANDLER, HandlerConfig, check_config};
use super::host::CgroupDriver;
use crate::oci::annotations::AnnotationPolicy;

/// The key of [`RuntimeSettings::allow_own_path_mounts`], for messages.
pub const ALLOW_OWN_PATH_MOUNTS: &str = "runtime.allow_own_path_mounts";

/// `[runtime]`: runtime handlers and what containers are allowed.
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[command(next_help_heading = "[runtime]")]
pub struct RuntimeSettings {
    /// Cgroup driver the runtime uses and reports to the kubelet: cgroupfs or systemd.
    #[arg(long, value_name = "DRIVER", value_enum)]
    pub cgroup_driver: CgroupDriver,

    /// Binary of the `runc` runtime handler (runc's command line), a name on PATH or a path.
    /// [default: runc, found on PATH]
    #[arg(long, value_name = "BINARY")]
    pub oci_runtime: Option<PathBuf>,

    /// The runtime handler of pods that name none.
    #[arg(long, value_name = "NAME")]
    pub default_runtime: String,

    /// Runtime handlers pods can choose by name (RuntimeClass `handler`), beside the built-in
    /// runc and crun: `[runtime.handlers.NAME]` tables with `binary` (a runc-compatible binary,
    /// a name on PATH or a path) and optionally `root` (its state directory, `--root`;
    /// default <state>/runtimes/NAME). The flag `--runtime NAME=BINARY` adds one.
    #[arg(skip)]
    pub handlers: BTreeMap<String, HandlerConfig>,

    /// A runtime handler pods can choose by name (RuntimeClass `handler`): a runc-compatible
    /// binary, a name on PATH or a path (repeatable). `runc` and `crun` are built in. In the
    /// file: `[runtime.handlers.NAME]` tables.
    #[arg(long = "runtime", value_name = "NAME=BINARY", value_parser = parse_runtime_flag)]
    #[serde(skip)]
    pub runtime_flags: Vec<(String, PathBuf)>,

    /// Pod and container annotations passed into the OCI runtime spec: keys, or prefixes ending
    /// in `*` (repeatable). Keys that steer the runtime (`run.oci.*`, `org.systemd.property.*`,
    /// `io.kubernetes.cri.*`, ...) never pass.
    #[arg(long = "pod-annotation", value_name = "PATTERN")]
    pub pod_annotations: Vec<String>,

    /// Host paths a container may mount (or name as a device) although they are minicri's
    /// root, state directory or socket, lie inside them, or hold them (`/`, `/var/lib`, `/run`):
    /// CreateContainer refuses such mounts with INVALID_ARGUMENT unless their host path, resolved
    /// through symlinks, is listed here exactly (repeatable). `kubectl debug node/...` and
    /// node-exporter mount `/`.
    #[arg(long = "allow-own-path-mount", value_name = "PATH")]
    pub allow_own_path_mounts: Vec<PathBuf>,

    /// Directories CreateContainer restores checkpoints from (repeatable): a container whose
    /// image is an absolute path that resolves to a regular file inside one of them, owned by
    /// root and not writable by group or others, is restored from that archive (as
    /// `crictl checkpoint --export` and the kubelet's checkpoint API write them); any other image
    /// is an image reference. CRIU images are trusted by the root process restoring them: list
    /// only directories that only root writes. Empty: no restores.
    #[arg(long = "checkpoint-restore-dir", value_name = "DIR")]
    pub checkpoint_restore_dirs: Vec<PathBuf>,
}

impl Default for RuntimeSettings {
    fn default() -> Self {
        RuntimeSettings {
            cgroup_driver: CgroupDriver::Cgroupfs,
            oci_runtime: None,
            default_runtime: DEFAULT_HANDLER.into(),
            handlers: BTreeMap::new(),
            runtime_flags: Vec::new(),
            pod_annotations: Vec::new(),
            allow_own_path_mounts: Vec::new(),
            // Where the kubelet's checkpoint API writes its archives.
            checkpoint_restore_dirs: vec!["/var/lib/kubelet/checkpoints".into()],
        }
    }
}

/// `--runtime NAME=BINARY`.
fn parse_runtime_flag(s: &str) -> Result<(String, PathBuf), String> {
    match s.split_once('=') {
        Some((name, binary)) if !name.is_empty() && !binary.is_empty() => {
            Ok((name.to_string(), binary.into()))
        }
        _ => Err(format!("{s:?} is not NAME=BINARY")),
    }
}

impl RuntimeSettings {
    /// Moves the handlers given as `--runtime` flags into [`RuntimeSettings::handlers`]: a
    /// flag gives the binary, and the file's `root` for the same handler stays.
    pub fn fold_runtime_flags(&mut self) {
        for (name, binary) in std::mem::take(&mut self.runtime_flags) {
            set_binary(&mut self.handlers, name, binary);
        }
    }

    /// The handlers configured (the built-in ones are added by
    /// [`super::Handlers::new`]), `runtime.oci_runtime` as the binary of `runc`.
    pub fn handler_configs(&self) -> BTreeMap<String, HandlerConfig> {
        let mut all = self.handlers.clone();
        for (name, binary) in &self.runtime_flags {
            set_binary(&mut all, name.clone(), binary.clone());
        }
        if let Some(binary) = &self.oci_runtime {
            set_binary(&mut all, DEFAULT_HANDLER.into(), binary.clone());
        }
        all
    }

    /// Which pod annotations reach the OCI spec.
    pub fn annotation_policy(&self) -> Result<AnnotationPolicy, String> {
        AnnotationPolicy::new(self.pod_annotations.clone()).map_err(|e| format!("runtime.{e}"))
    }

    /// Checks every value; the error names the key (`runtime.KEY`).
    pub fn validate(&self) -> Result<(), String> {
        if self
            .oci_runtime
            .as_ref()
            .is_some_and(|b| b.as_os_str().is_empty())
        {
            return Err("runtime.oci_runtime must name a binary".into());
        }
        check_config(&self.handler_configs(), &self.default_runtime)
            .map_err(|e| format!("runtime: {e}"))?;
        self.annotation_policy()?;
        if let Some(p) = self.allow_own_path_mounts.iter().find(|p| !p.is_absolute()) {
            return Err(format!(
                "{} entry {} is not an absolute path",
                ALLOW_OWN_PATH_MOUNTS,
                p.display()
            ));
        }
        if let Some(p) = self
            .checkpoint_restore_dirs
            .iter()
            .find(|p| !p.is_absolute())
        {
            return Err(format!(
                "runtime.checkpoint_restore_dirs entry {} is not an absolute path",
                p.display()
            ));
        }
        Ok(())
    }
}

fn set_binary(all: &mut BTreeMap<String, HandlerConfig>, name: String, binary: PathBuf) {
    all.entry(name)
        .or_insert_with(|| HandlerConfig {
            binary: PathBuf::new(),
            root: None,
        })
        .binary = binary;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn runtime_handlers_from_flags_and_file() {
        let s = RuntimeSettings::default();
        assert!(s.handler_configs().is_empty());
        assert_eq!(s.default_runtime, "runc");
        let file: RuntimeSettings = toml::from_str(
            "default_runtime = \"crun\"\n[handlers.crun]\nbinary = \"/opt/crun\"\nroot = \"/r\"\n\
             [handlers.kata]\nbinary = \"kata-runtime\"\n",
        )
        .unwrap();
        let mut s = RuntimeSettings {
            oci_runtime: Some("/usr/bin/runc".into()),
            runtime_flags: vec![("kata".into(), "/flag/kata".into())],
            ..file
        };
        s.fold_runtime_flags();
        s.validate().unwrap();
        let all = s.handler_configs();
        assert_eq!(s.default_runtime, "crun");
        let crun = &all["crun"];
        assert_eq!(
            (crun.binary.as_path(), crun.root.as_deref()),
            (Path::new("/opt/crun"), Some(Path::new("/r")))
        );
        assert_eq!(all["kata"].binary, Path::new("/flag/kata"));
        assert_eq!(all["runc"].binary, Path::new("/usr/bin/runc"));
        for bad in [
            RuntimeSettings {
                default_runtime: "gvisor".into(),
                ..Default::default()
            },
            RuntimeSettings {
                runtime_flags: vec![("Bad/Name".into(), "x".into())],
                ..Default::default()
            },
            RuntimeSettings {
                oci_runtime: Some("".into()),
                ..Default::default()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
        assert!(parse_runtime_flag("kata").is_err() && parse_runtime_flag("=x").is_err());
    }

    #[test]
    fn own_path_mounts_allowed_must_be_absolute() {
        let with = |p: &str| {
            RuntimeSettings {
                allow_own_path_mounts: vec![p.into()],
                ..Default::default()
            }
            .validate()
        };
        assert!(RuntimeSettings::default().allow_own_path_mounts.is_empty());
        assert!(with("/").is_ok());
        let err = with("var/lib").unwrap_err();
        assert!(
            err.contains("runtime.allow_own_path_mounts") && err.contains("absolute"),
            "{err}"
        );
    }

    #[test]
    fn checkpoint_restore_dirs_default_to_the_kubelets_and_must_be_absolute() {
        assert_eq!(
            RuntimeSettings::default().checkpoint_restore_dirs,
            [PathBuf::from("/var/lib/kubelet/checkpoints")]
        );
        let bad = RuntimeSettings {
            checkpoint_restore_dirs: vec!["ckpt".into()],
            ..Default::default()
        };
        let err = bad.validate().unwrap_err();
        assert!(
            err.contains("runtime.checkpoint_restore_dirs entry ckpt"),
            "{err}"
        );
    }
}

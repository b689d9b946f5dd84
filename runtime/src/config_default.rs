//! `minicri config default`: the configuration file with every setting commented out at its
//! built-in default, as the Debian package installs it (`/etc/minicri/config.toml`, a conffile).
//!
//! It is generated from the binary so that it cannot drift from it: the keys and their help are
//! `minicri serve`'s own (clap's description of [`ServeArgs`], the keys being the fields' names),
//! and each value is what [`ServeArgs::finish`] resolves with nothing set ([`settings_of`] turns
//! the resolved [`Config`] back into file values). A key without a value by default (a
//! kubeconfig found by searching, a metrics address that is off) is shown as `#key =`, to be
//! filled in. The tests hold the three together: every key is in the file, and the file with
//! every value uncommented resolves to the defaults again.

use clap::{Args, Command};

use crate::config::{CgroupDriver, Config, ServeArgs};

/// Text wraps at this column.
const WIDTH: usize = 99;

/// Fields of [`ServeArgs`] that are not keys of the file: `--config` names the file, and the
/// `--runtime` flags are `[runtimes.NAME]` tables there.
const NOT_KEYS: [&str; 2] = ["config", "runtime_flags"];

/// The file: a header, then each key's help and its default, commented out.
pub fn default_file() -> anyhow::Result<String> {
    let defaults = ServeArgs::default().finish()?;
    let values = serde_json::to_value(settings_of(&defaults))?;
    let mut out = format!(
        "# minicri's configuration (`minicri serve` reads /etc/minicri/config.toml when it exists).\n\
         #\n\
         # Every setting is commented out at its built-in default: uncomment a line to change it.\n\
         # Command-line flags (`minicri serve --help`) override this file; unknown keys are errors.\n\
         # Written by `minicri config default` (minicri {}).\n",
        env!("CARGO_PKG_VERSION")
    );
    let cmd = ServeArgs::augment_args(Command::new("serve"));
    for arg in cmd.get_arguments() {
        let key = arg.get_id().as_str();
        if NOT_KEYS.contains(&key) || key == "help" {
            continue;
        }
        let help = arg
            .get_long_help()
            .or_else(|| arg.get_help())
            .map(|h| h.to_string())
            .unwrap_or_default();
        out.push('\n');
        out.push_str(&comment(&help));
        match values.get(key).filter(|v| !v.is_null()) {
            Some(v) => {
                let v: toml::Value = serde_json::from_value(v.clone())?;
                out.push_str(&format!("#{key} = {v}\n"));
            }
            None => out.push_str(&format!("#{key} =\n")),
        }
    }
    out.push_str(&format!(
        "\n{}#[runtimes.NAME]\n#binary =\n#root =\n",
        comment(
            "Runtime handlers pods can choose by name (RuntimeClass `handler`), beside the \
             built-in runc and crun: a runc-compatible binary, a name on PATH or a path, and its \
             state directory (`--root`). [default: <state>/runtimes/NAME]"
        )
    ));
    Ok(out)
}

/// `text` as `# ` lines of at most [`WIDTH`] columns (paragraphs kept).
fn comment(text: &str) -> String {
    let mut out = String::new();
    for para in text.split("\n\n") {
        if !out.is_empty() {
            out.push_str("#\n");
        }
        let mut line = String::from("#");
        for word in para.split_whitespace() {
            if line.len() + 1 + word.len() > WIDTH && line.len() > 1 {
                out.push_str(&line);
                out.push('\n');
                line = String::from("#");
            }
            line.push(' ');
            line.push_str(word);
        }
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// The file values that resolve to `c`: every key that has a value by default is set.
pub fn settings_of(c: &Config) -> ServeArgs {
    let secs = |d: Option<std::time::Duration>| Some(d.map_or(0.0, |d| d.as_secs_f64()));
    let kube = c.kube_watch.as_ref();
    ServeArgs {
        config: None,
        socket: Some(c.socket.clone()),
        root: Some(c.root.clone()),
        state: Some(c.state.clone()),
        registry_config_dir: Some(c.registry_config_dir.clone()),
        log_level: Some(c.log_level.clone()),
        cgroup_driver: Some(
            match c.cgroup_driver {
                CgroupDriver::Cgroupfs => "cgroupfs",
                CgroupDriver::Systemd => "systemd",
            }
            .into(),
        ),
        platform: Some(c.platform.clone()),
        max_concurrent_downloads: Some(c.max_concurrent_downloads),
        max_concurrent_unpacks: Some(c.max_concurrent_unpacks),
        snapshotter: Some(c.snapshotter.clone()),
        max_concurrent_transfers: Some(c.max_concurrent_transfers),
        small_blob_size: Some(c.small_blob_size),
        blob_connections: Some(c.ranged_fetch.connections),
        blob_chunk_size: Some(c.ranged_fetch.chunk_size),
        pull_progress_timeout: secs(c.pull_progress_timeout),
        pull_min_speed: Some(c.pull_min_speed.unwrap_or(0)),
        registry_request_timeout: secs(Some(c.registry_request_timeout)),
        max_layer_bytes: Some(c.max_layer_bytes),
        max_layer_entries: Some(c.max_layer_entries),
        pull_detach_after: secs(c.pull_detach_after),
        kube_watch: Some(if kube.is_some() { "auto" } else { "off" }.into()),
        kube_watch_kubeconfig: kube.and_then(|k| k.kubeconfig.clone()),
        kube_watch_kubeconfig_search: kube.map(|k| k.search.clone()).unwrap_or_default(),
        kube_watch_node_name: kube.and_then(|k| k.node_name.clone()),
        ingest_ttl: Some(c.ingest_ttl.as_secs_f64() / 3600.0),
        ingest_min_free: Some(c.ingest_min_free * 100.0),
        image_fs_reserve: Some(c.image_fs_reserve),
        max_blob_size: Some(c.max_blob_size),
        keep_layer_blobs: Some(c.keep_layer_blobs),
        node_metadata_budget: Some(c.node_metadata_budget as u64),
        cni_conf_dirs: c.cni_conf_dirs.clone(),
        cni_bin_dirs: c.cni_bin_dirs.clone(),
        // The built-in handler's binary is found on PATH unless one is named.
        oci_runtime: None,
        runtime_flags: Vec::new(),
        runtimes: c
            .runtimes
            .iter()
            .map(|(name, h)| {
                let e = crate::config::RuntimeEntry {
                    binary: h.binary.clone(),
                    root: h.root.clone(),
                };
                (name.clone(), e)
            })
            .collect(),
        default_runtime: Some(c.default_runtime.clone()),
        metrics_address: c.metrics_address.map(|a| a.to_string()),
        stream_address: Some(c.stream_address.to_string()),
        pod_annotations: c.pod_annotations.patterns().to_vec(),
        pull_priority_namespaces: c.pull_priority_namespaces.clone(),
        allow_own_path_mounts: c.allow_own_path_mounts.clone(),
        port_forward_buffer_bytes: Some(c.port_forward_buffer_bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The file with each `#key = value` line uncommented.
    fn uncommented(file: &str) -> String {
        file.lines()
            .filter_map(|l| l.strip_prefix('#'))
            .filter(|l| {
                l.split_once(" = ").is_some_and(|(k, v)| {
                    !v.is_empty() && k.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
                })
            })
            .map(|l| format!("{l}\n"))
            .collect()
    }

    #[test]
    fn every_key_is_in_the_file_and_nothing_is_set() {
        let file = default_file().unwrap();
        let cmd = ServeArgs::augment_args(Command::new("serve"));
        for arg in cmd.get_arguments() {
            let key = arg.get_id().as_str();
            if NOT_KEYS.contains(&key) {
                continue;
            }
            assert!(
                file.contains(&format!("\n#{key} =")),
                "{key} missing:\n{file}"
            );
        }
        assert!(file.contains("#[runtimes.NAME]"));
        // Nothing but comments and blank lines: the file sets nothing.
        let parsed: ServeArgs = toml::from_str(&file).unwrap();
        assert_eq!(
            serde_json::to_value(&parsed).unwrap(),
            serde_json::to_value(ServeArgs::default()).unwrap()
        );
        assert!(file.lines().all(|l| l.is_empty() || l.starts_with('#')));
        assert!(file.lines().all(|l| l.len() <= WIDTH + 40), "{file}");
    }

    #[test]
    fn the_values_shown_are_the_defaults() {
        let file = default_file().unwrap();
        let text = uncommented(&file);
        assert!(
            text.contains("socket = \"/run/minicri/minicri.sock\""),
            "{text}"
        );
        assert!(text.contains("image_fs_reserve = \"15%\""), "{text}");
        let set: ServeArgs = toml::from_str(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let from_file = format!("{:?}", set.finish().unwrap());
        let builtin = format!("{:?}", ServeArgs::default().finish().unwrap());
        assert_eq!(from_file, builtin);
    }

    #[test]
    fn settings_of_a_configuration_resolve_to_it() {
        let c = ServeArgs {
            cgroup_driver: Some("systemd".into()),
            kube_watch: Some("off".into()),
            pull_progress_timeout: Some(0.0),
            metrics_address: Some("127.0.0.1:9464".into()),
            pod_annotations: vec!["example.com/*".into()],
            allow_own_path_mounts: vec!["/".into()],
            ..Default::default()
        }
        .finish()
        .unwrap();
        let again = settings_of(&c).finish().unwrap();
        assert_eq!(format!("{again:?}"), format!("{c:?}"));
    }
}

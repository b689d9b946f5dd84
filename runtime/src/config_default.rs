//! `minicri config default` and `minicri config check FILE`: the configuration file with every
//! setting commented out at its built-in default, as the Debian package installs it
//! (`/etc/minicri/config.toml`, a conffile), and the check of a file.
//!
//! The file is generated from the binary so that it cannot drift from it: its sections and
//! keys are the [`Config`] sections' fields (the keys' help is their doc, the flags' help), and
//! each value is the section's `Default`, serialized. A key without a value by default (a
//! kubeconfig found by searching, a metrics address that is off) is shown as `#key =`, to be
//! filled in. The section headers are not commented out: uncommenting a key's line sets it.

use crate::config::{Config, sections};

/// Text wraps at this column.
const WIDTH: usize = 99;

/// The file: a header, then each section, and in it each key's help and its default,
/// commented out.
pub fn default_file() -> anyhow::Result<String> {
    let toml::Value::Table(values) = toml::Value::try_from(Config::default())? else {
        anyhow::bail!("the defaults do not serialize to a table");
    };
    let mut out = format!(
        "# minicri's configuration (`minicri serve` reads /etc/minicri/config.toml when it exists).\n\
         #\n\
         # Every setting is commented out at its built-in default: uncomment a line to change it.\n\
         # Command-line flags (`minicri serve --help`) override this file; unknown keys are errors.\n\
         # `minicri config check FILE` checks a file. Written by `minicri config default` (minicri {}).\n",
        env!("CARGO_PKG_VERSION")
    );
    for (name, about, cmd) in sections() {
        out.push_str(&format!("\n[{name}]\n"));
        out.push_str(&comment(about));
        let section = values.get(name).and_then(|v| v.as_table());
        for arg in cmd.get_arguments() {
            let key = arg.get_id().as_str();
            // `--runtime NAME=BINARY` is `[runtime.handlers.NAME]` in the file, below.
            if key == "runtime_flags" || key == "help" {
                continue;
            }
            let help = arg
                .get_long_help()
                .or_else(|| arg.get_help())
                .map(|h| h.to_string())
                .unwrap_or_default();
            out.push('\n');
            out.push_str(&comment(&help));
            match section.and_then(|s| s.get(key)) {
                Some(v) => out.push_str(&format!("#{key} = {v}\n")),
                None => out.push_str(&format!("#{key} =\n")),
            }
        }
        if name == "runtime" {
            out.push_str(&format!(
                "\n{}#[runtime.handlers.NAME]\n#binary =\n#root =\n",
                comment(
                    "Runtime handlers pods can choose by name (RuntimeClass `handler`), beside \
                     the built-in runc and crun: a runc-compatible binary, a name on PATH or a \
                     path, and its state directory (`--root`). [default: <state>/runtimes/NAME]"
                )
            ));
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse;

    /// The file with each `#key = value` line uncommented (sections kept).
    fn uncommented(file: &str) -> String {
        file.lines()
            .filter_map(|l| {
                if l.starts_with('[') {
                    return Some(l);
                }
                l.strip_prefix('#').filter(|l| {
                    l.split_once(" = ").is_some_and(|(k, v)| {
                        !v.is_empty() && k.bytes().all(|b| b.is_ascii_lowercase() || b == b'_')
                    })
                })
            })
            .map(|l| format!("{l}\n"))
            .collect()
    }

    #[test]
    fn every_key_is_in_the_file_and_nothing_is_set() {
        let file = default_file().unwrap();
        for (name, _, cmd) in sections() {
            let at = file
                .find(&format!("\n[{name}]\n"))
                .unwrap_or_else(|| panic!("[{name}] missing:\n{file}"));
            for arg in cmd.get_arguments() {
                let key = arg.get_id().as_str();
                if key == "runtime_flags" {
                    continue;
                }
                assert!(
                    file[at..].contains(&format!("\n#{key} =")),
                    "{name}.{key} missing:\n{file}"
                );
            }
        }
        assert!(file.contains("#[runtime.handlers.NAME]"));
        // Nothing but comments, section headers and blank lines: the file sets nothing.
        assert_eq!(parse(&file).unwrap(), Config::default());
        assert!(
            file.lines()
                .all(|l| l.is_empty() || l.starts_with('#') || l.starts_with('['))
        );
        assert!(file.lines().all(|l| l.len() <= WIDTH + 40), "{file}");
    }

    #[test]
    fn the_values_shown_are_the_defaults() {
        let file = default_file().unwrap();
        let text = uncommented(&file);
        assert!(
            text.contains("[daemon]\nsocket = \"/run/minicri/minicri.sock\""),
            "{text}"
        );
        assert!(text.contains("image_fs_reserve = \"15%\""), "{text}");
        let set = parse(&text).unwrap_or_else(|e| panic!("{e:#}\n{text}"));
        assert_eq!(set, Config::default());
    }

    /// A configuration written out as a file and read back is itself: the sections' serde
    /// forms lose nothing (what `config default` and verbose Status rely on).
    #[test]
    fn a_configuration_written_and_read_back_is_itself() {
        let defaults = toml::to_string(&Config::default()).unwrap();
        assert_eq!(parse(&defaults).unwrap(), Config::default());
        let mut c = Config::default();
        c.runtime.cgroup_driver = crate::oci::host::CgroupDriver::Systemd;
        c.daemon.kube_watch = crate::config::KubeWatchMode::Off;
        c.daemon.metrics_address = Some("127.0.0.1:9464".parse().unwrap());
        c.pull.progress_timeout = 30.0;
        c.pull.image_fs_reserve = "20GiB".parse().unwrap();
        c.runtime.pod_annotations = vec!["example.com/*".into()];
        c.runtime.allow_own_path_mounts = vec!["/".into()];
        c.runtime.handlers.insert(
            "kata".into(),
            crate::oci::handlers::HandlerConfig {
                binary: "/opt/kata".into(),
                root: Some("/run/kata".into()),
            },
        );
        c.validate().unwrap();
        let text = toml::to_string(&c).unwrap();
        assert_eq!(parse(&text).unwrap(), c, "{text}");
    }

    /// `minicri config check FILE`: a good file passes; a bad key and a bad value are refused,
    /// naming them.
    #[test]
    fn check_refuses_bad_keys_and_values_naming_them() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("c.toml");
        let check = |text: &str| {
            std::fs::write(&f, text).unwrap();
            crate::config::check_file(&f).map_err(|e| format!("{e:#}"))
        };
        let c =
            check("[pull]\nmax_concurrent_downloads = 2\n[runtime]\ncgroup_driver = \"systemd\"\n")
                .unwrap();
        assert_eq!(c.pull.max_concurrent_downloads, 2);
        let err = check("[pull]\nmax_concurent_downloads = 2\n").unwrap_err();
        assert!(err.contains("max_concurent_downloads"), "{err}");
        let err = check("[pull]\nmax_concurrent_downloads = \"two\"\n").unwrap_err();
        assert!(err.contains("max_concurrent_downloads"), "{err}");
        let err = check("[pull]\nmax_concurrent_downloads = 0\n").unwrap_err();
        assert!(err.contains("pull.max_concurrent_downloads"), "{err}");
        assert!(err.contains("c.toml"), "names the file: {err}");
    }
}

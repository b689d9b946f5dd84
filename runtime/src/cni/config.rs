//! Finding and parsing the CNI network configuration.
//!
//! Owns the choice of network: among the `*.conflist`, `*.conf` and `*.json` files of the
//! configured directories, the valid one whose file name sorts first (byte order, ties broken by
//! the order of the directories) is used, as kubelet-era runtimes do with a single directory. A
//! single-plugin configuration (`.conf`, or any file whose object has `type` and no `plugins`) is
//! wrapped as a one-plugin list. Each skipped file is reported with its reason.
//!
//! Invariants of a [`NetworkConfigList`]: `name` and `cniVersion` are non-empty, the version is
//! one minicri speaks (0.3.0 to 1.1.0: those with plugin chaining and `prevResult`), there is at
//! least one plugin and every plugin has a `type` that is a plain file name.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

/// CNI spec versions whose configurations and results minicri handles.
pub const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"];

const EXTENSIONS: &[&str] = &["conflist", "conf", "json"];

/// A network configuration list (CNI spec, section 1), normalised from either file form.
#[derive(Debug, Clone, PartialEq)]
pub struct NetworkConfigList {
    pub cni_version: String,
    pub name: String,
    /// `disableCheck`: the runtime must not call CHECK (spec, CHECK).
    pub disable_check: bool,
    /// The plugin configuration objects, in order, verbatim from the file.
    pub plugins: Vec<Map<String, Value>>,
    /// The file it was read from (`None` when rebuilt from the result cache).
    pub source: Option<PathBuf>,
}

impl NetworkConfigList {
    /// Parses a configuration list, or a single plugin configuration that is then wrapped.
    pub fn parse(bytes: &[u8], source: Option<PathBuf>) -> Result<Self, String> {
        let value: Value =
            serde_json::from_slice(bytes).map_err(|e| format!("not valid JSON: {e}"))?;
        Self::from_value(value, source)
    }

    /// As [`parse`](Self::parse), from a JSON value.
    pub fn from_value(value: Value, source: Option<PathBuf>) -> Result<Self, String> {
        let Value::Object(mut obj) = value else {
            return Err("not a JSON object".into());
        };
        let version = match obj.get("cniVersion") {
            Some(Value::String(v)) if !v.is_empty() => v.clone(),
            _ => return Err("no cniVersion".into()),
        };
        if !SUPPORTED_VERSIONS.contains(&version.as_str()) {
            return Err(format!(
                "cniVersion {version:?} is not supported (supported: {})",
                SUPPORTED_VERSIONS.join(", ")
            ));
        }
        let name = match obj.get("name") {
            Some(Value::String(n)) if !n.is_empty() => n.clone(),
            _ => return Err("no network name".into()),
        };
        let disable_check = matches!(obj.get("disableCheck"), Some(Value::Bool(true)));
        let plugins = match obj.remove("plugins") {
            Some(Value::Array(list)) => list
                .into_iter()
                .enumerate()
                .map(|(i, p)| match p {
                    Value::Object(m) => Ok(m),
                    _ => Err(format!("plugin {i} is not an object")),
                })
                .collect::<Result<Vec<_>, _>>()?,
            Some(_) => return Err("\"plugins\" is not an array".into()),
            // A single plugin configuration: the object itself is the only plugin.
            None if obj.contains_key("type") => vec![obj],
            None => return Err("neither \"plugins\" nor \"type\"".into()),
        };
        if plugins.is_empty() {
            return Err("no plugins".into());
        }
        for (i, p) in plugins.iter().enumerate() {
            match p.get("type") {
                Some(Value::String(t)) if is_plain_name(t) => {}
                Some(Value::String(t)) => {
                    return Err(format!("plugin {i} has an invalid type {t:?}"));
                }
                _ => return Err(format!("plugin {i} has no type")),
            }
        }
        Ok(NetworkConfigList {
            cni_version: version,
            name,
            disable_check,
            plugins,
            source,
        })
    }

    /// The list as JSON (list form), as stored in the result cache.
    pub fn to_value(&self) -> Value {
        serde_json::json!({
            "cniVersion": self.cni_version,
            "name": self.name,
            "disableCheck": self.disable_check,
            "plugins": self.plugins,
        })
    }

    /// The plugin types, in order.
    pub fn plugin_types(&self) -> Vec<&str> {
        self.plugins
            .iter()
            .map(|p| p.get("type").and_then(Value::as_str).unwrap_or(""))
            .collect()
    }
}

/// A plugin type names an executable in a bin dir: no path separators, no dot-only names.
fn is_plain_name(t: &str) -> bool {
    !t.is_empty() && t != "." && t != ".." && !t.contains('/') && !t.contains('\0')
}

/// `a.b.c` as a comparable tuple; unparsable parts count as 0.
pub fn version_tuple(v: &str) -> (u32, u32, u32) {
    let mut it = v.split('.').map(|p| p.parse().unwrap_or(0));
    (
        it.next().unwrap_or(0),
        it.next().unwrap_or(0),
        it.next().unwrap_or(0),
    )
}

/// What [`load`] looked at: the file used (if any) and why each other candidate was not.
#[derive(Debug, Clone, Default)]
pub struct LoadReport {
    pub chosen: Option<PathBuf>,
    /// Files that were candidates but invalid, with the reason, in the order they were tried.
    pub skipped: Vec<(PathBuf, String)>,
    /// Valid files that lost to the chosen one.
    pub shadowed: Vec<PathBuf>,
    /// Configuration directories that could not be read (missing ones are normal and not listed).
    pub unreadable_dirs: Vec<(PathBuf, String)>,
}

impl LoadReport {
    /// One line for logs and the NetworkReady message.
    pub fn summary(&self, dirs: &[PathBuf]) -> String {
        let mut s = match &self.chosen {
            Some(p) => format!("using {}", p.display()),
            None => format!(
                "no valid CNI network configuration (*.conflist, *.conf, *.json) in {}",
                join_paths(dirs, ", ")
            ),
        };
        for (p, why) in &self.skipped {
            s.push_str(&format!("; skipped {}: {why}", p.display()));
        }
        for (p, why) in &self.unreadable_dirs {
            s.push_str(&format!("; cannot read {}: {why}", p.display()));
        }
        s
    }
}

pub(crate) fn join_paths(paths: &[PathBuf], sep: &str) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(sep)
}

/// The candidate files of `dirs`, in the order they are tried.
pub fn candidates(dirs: &[PathBuf], report: &mut LoadReport) -> Vec<PathBuf> {
    // (file name, directory rank, path)
    let mut found: Vec<(std::ffi::OsString, usize, PathBuf)> = Vec::new();
    for (rank, dir) in dirs.iter().enumerate() {
        let entries = match std::fs::read_dir(dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                report.unreadable_dirs.push((dir.clone(), e.to_string()));
                continue;
            }
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let wanted = path
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| EXTENSIONS.contains(&e));
            // Follows symlinks: configurations installed as links are normal.
            if wanted && path.is_file() {
                found.push((entry.file_name(), rank, path));
            }
        }
    }
    found.sort();
    found.into_iter().map(|(_, _, p)| p).collect()
}

/// Loads the network configuration: the first valid candidate (see the module docs).
pub fn load(dirs: &[PathBuf]) -> (Option<NetworkConfigList>, LoadReport) {
    let mut report = LoadReport::default();
    let mut chosen = None;
    for path in candidates(dirs, &mut report) {
        if chosen.is_some() {
            report.shadowed.push(path);
            continue;
        }
        match load_file(&path) {
            Ok(list) => {
                report.chosen = Some(path);
                chosen = Some(list);
            }
            Err(why) => report.skipped.push((path, why)),
        }
    }
    (chosen, report)
}

/// Reads one configuration file. A `.conflist` must be a list; `.conf`/`.json` may be either form.
pub fn load_file(path: &Path) -> Result<NetworkConfigList, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read: {e}"))?;
    let list = NetworkConfigList::parse(&bytes, Some(path.to_path_buf()))?;
    if path.extension().is_some_and(|e| e == "conflist") {
        let value: Value = serde_json::from_slice(&bytes).unwrap_or_default();
        if value.get("plugins").is_none() {
            return Err("a .conflist needs a \"plugins\" array".into());
        }
    }
    Ok(list)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    const LIST: &str = r#"{"cniVersion":"1.0.0","name":"n1","plugins":[{"type":"bridge","bridge":"b0"},{"type":"portmap","capabilities":{"portMappings":true}}]}"#;

    #[test]
    fn parses_a_list() {
        let l = NetworkConfigList::parse(LIST.as_bytes(), None).unwrap();
        assert_eq!(l.name, "n1");
        assert_eq!(l.cni_version, "1.0.0");
        assert!(!l.disable_check);
        assert_eq!(l.plugin_types(), ["bridge", "portmap"]);
        assert_eq!(l.plugins[0]["bridge"], "b0");
        let again = NetworkConfigList::from_value(l.to_value(), None).unwrap();
        assert_eq!(again, l);
    }

    #[test]
    fn wraps_a_single_plugin() {
        let l = NetworkConfigList::parse(
            br#"{"cniVersion":"0.3.1","name":"single","type":"bridge","ipam":{"type":"host-local"}}"#,
            None,
        )
        .unwrap();
        assert_eq!(l.name, "single");
        assert_eq!(l.plugins.len(), 1);
        assert_eq!(l.plugins[0]["type"], "bridge");
        assert_eq!(l.plugins[0]["ipam"]["type"], "host-local");
    }

    #[test]
    fn rejects_invalid() {
        let cases = [
            ("{", "not valid JSON"),
            ("[]", "not a JSON object"),
            (r#"{"name":"x","plugins":[{"type":"a"}]}"#, "no cniVersion"),
            (
                r#"{"cniVersion":"0.2.0","name":"x","type":"a"}"#,
                "not supported",
            ),
            (
                r#"{"cniVersion":"1.0.0","plugins":[{"type":"a"}]}"#,
                "no network name",
            ),
            (
                r#"{"cniVersion":"1.0.0","name":"x","plugins":[]}"#,
                "no plugins",
            ),
            (
                r#"{"cniVersion":"1.0.0","name":"x","plugins":[{"a":1}]}"#,
                "has no type",
            ),
            (
                r#"{"cniVersion":"1.0.0","name":"x","plugins":[{"type":"../sh"}]}"#,
                "invalid type",
            ),
            (r#"{"cniVersion":"1.0.0","name":"x"}"#, "neither"),
        ];
        for (text, want) in cases {
            let e = NetworkConfigList::parse(text.as_bytes(), None).unwrap_err();
            assert!(e.contains(want), "{text}: {e}");
        }
    }

    #[test]
    fn lexically_first_valid_file_wins() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), "05-broken.conflist", "{not json");
        write(d.path(), "README", "ignored");
        write(d.path(), "10-old.conf.bak", "ignored");
        let twenty = write(
            d.path(),
            "20-b.conf",
            r#"{"cniVersion":"0.4.0","name":"b","type":"bridge"}"#,
        );
        let ten = write(d.path(), "10-a.conflist", LIST);
        let dirs = vec![d.path().to_path_buf()];
        let (l, report) = load(&dirs);
        assert_eq!(l.unwrap().name, "n1");
        assert_eq!(report.chosen.as_deref(), Some(ten.as_path()));
        assert_eq!(report.skipped.len(), 1);
        assert!(report.skipped[0].0.ends_with("05-broken.conflist"));
        assert_eq!(report.shadowed, vec![twenty]);
        assert!(report.summary(&dirs).contains("skipped"));
    }

    #[test]
    fn file_names_compare_across_dirs_and_dir_order_breaks_ties() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let one = |n: &str| format!(r#"{{"cniVersion":"1.0.0","name":"{n}","type":"bridge"}}"#);
        write(a.path(), "20-x.conf", &one("a20"));
        write(b.path(), "10-x.conf", &one("b10"));
        let dirs = vec![a.path().to_path_buf(), b.path().to_path_buf()];
        assert_eq!(load(&dirs).0.unwrap().name, "b10");
        write(a.path(), "10-x.conf", &one("a10"));
        assert_eq!(load(&dirs).0.unwrap().name, "a10");
    }

    #[test]
    fn conflist_must_be_a_list_and_missing_dirs_are_fine() {
        let d = tempfile::tempdir().unwrap();
        write(
            d.path(),
            "10.conflist",
            r#"{"cniVersion":"1.0.0","name":"x","type":"bridge"}"#,
        );
        let dirs = vec![d.path().join("missing"), d.path().to_path_buf()];
        let (l, report) = load(&dirs);
        assert!(l.is_none());
        assert!(report.skipped[0].1.contains("plugins"), "{report:?}");
        assert!(report.unreadable_dirs.is_empty());
        assert!(report.summary(&dirs).starts_with("no valid CNI network"));
    }

    #[test]
    fn versions_compare() {
        assert!(version_tuple("0.4.0") > version_tuple("0.3.1"));
        assert!(version_tuple("1.0.0") > version_tuple("0.4.0"));
        assert_eq!(version_tuple("1.1.0"), (1, 1, 0));
    }
}

//! The `[cni]` section of the daemon's configuration: where network configurations and plugins
//! are found. Each field is a key of the section and a flag of `minicri serve`; its default is
//! in [`Default`] only.

use std::path::{Path, PathBuf};

use clap::Args;
use serde::{Deserialize, Serialize};

use super::CniOptions;

/// `[cni]`: pod networking.
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[command(next_help_heading = "[cni]")]
pub struct CniSettings {
    /// Directories searched for CNI network configurations (repeatable).
    #[arg(long = "cni-conf-dir", value_name = "DIR")]
    pub conf_dirs: Vec<PathBuf>,

    /// Directories searched for CNI plugin binaries (repeatable).
    #[arg(long = "cni-bin-dir", value_name = "DIR")]
    pub bin_dirs: Vec<PathBuf>,
}

impl Default for CniSettings {
    fn default() -> Self {
        CniSettings {
            conf_dirs: vec!["/etc/cni/net.d".into()],
            bin_dirs: vec!["/opt/cni/bin".into(), "/usr/lib/cni".into()],
        }
    }
}

impl CniSettings {
    /// Checks every value; the error names the key (`cni.KEY`).
    pub fn validate(&self) -> Result<(), String> {
        for (key, dirs) in [("conf_dirs", &self.conf_dirs), ("bin_dirs", &self.bin_dirs)] {
            if let Some(d) = dirs.iter().find(|d| d.as_os_str().is_empty()) {
                return Err(format!("cni.{key} has an empty entry {d:?}"));
            }
        }
        Ok(())
    }

    /// The CNI manager's options, its cache under `state`.
    pub fn options(&self, state: &Path) -> CniOptions {
        CniOptions::new(self.conf_dirs.clone(), self.bin_dirs.clone(), state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_search_the_usual_directories_and_empty_entries_are_refused() {
        let s = CniSettings::default();
        let o = s.options(Path::new("/run/x"));
        assert_eq!(o.conf_dirs, vec![PathBuf::from("/etc/cni/net.d")]);
        assert_eq!(o.bin_dirs.len(), 2);
        let err = CniSettings {
            bin_dirs: vec!["".into()],
            ..s
        }
        .validate()
        .unwrap_err();
        assert!(err.contains("cni.bin_dirs"), "{err}");
    }
}

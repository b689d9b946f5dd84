//! The `[snapshotter]` section of the daemon's configuration: the layer backend and the limits
//! one layer is held to. Each field is a key of the section and a flag of `minicri serve`; its
//! default is in [`Default`] only.

use std::sync::Arc;

use clap::Args;
use serde::{Deserialize, Serialize};

use crate::snapshotter::{Backend, SpaceCheck};
use crate::store::{DEFAULT_MAX_LAYER_BYTES, DEFAULT_MAX_LAYER_ENTRIES, Options};

/// `[snapshotter]`: where and how layers are unpacked.
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[command(next_help_heading = "[snapshotter]")]
pub struct SnapshotterSettings {
    /// Layer snapshotter backend: overlay (falls back to copy where overlayfs is unusable) or copy.
    #[arg(long = "snapshotter", value_name = "BACKEND", value_enum)]
    pub backend: Backend,

    /// Most bytes one layer may unpack to (its uncompressed tar stream plus the holes of its
    /// sparse files); a larger layer fails the pull.
    #[arg(long, value_name = "BYTES")]
    pub max_layer_bytes: u64,

    /// Most entries (files, directories, links, whiteouts) one layer may have; a layer with more
    /// fails the pull.
    #[arg(long, value_name = "N")]
    pub max_layer_entries: u64,
}

impl Default for SnapshotterSettings {
    fn default() -> Self {
        SnapshotterSettings {
            backend: Backend::Overlay,
            max_layer_bytes: DEFAULT_MAX_LAYER_BYTES,
            max_layer_entries: DEFAULT_MAX_LAYER_ENTRIES,
        }
    }
}

impl SnapshotterSettings {
    /// Checks every value; the error names the key (`snapshotter.KEY`).
    pub fn validate(&self) -> Result<(), String> {
        for (key, n) in [
            ("max_layer_bytes", self.max_layer_bytes),
            ("max_layer_entries", self.max_layer_entries),
        ] {
            if n == 0 {
                return Err(format!("snapshotter.{key} must be more than 0"));
            }
        }
        Ok(())
    }

    /// The snapshotter's options; unpacks claim their bytes from `space`.
    pub fn options(&self, space: Option<Arc<dyn SpaceCheck>>) -> Options {
        Options {
            max_layer_bytes: self.max_layer_bytes,
            max_layer_entries: self.max_layer_entries,
            space,
            ..Options::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_options_defaults_and_zero_limits_are_refused() {
        let s = SnapshotterSettings::default();
        let (o, d) = (s.options(None), Options::default());
        assert_eq!(
            (o.max_layer_bytes, o.max_layer_entries),
            (d.max_layer_bytes, d.max_layer_entries)
        );
        assert_eq!(
            (o.max_layer_bytes, o.max_layer_entries),
            (64 << 30, 1 << 20)
        );
        let err = SnapshotterSettings {
            max_layer_entries: 0,
            ..s.clone()
        }
        .validate()
        .unwrap_err();
        assert!(err.contains("snapshotter.max_layer_entries"), "{err}");
        assert!(
            SnapshotterSettings {
                max_layer_bytes: 0,
                ..s
            }
            .validate()
            .is_err()
        );
    }
}

//! The `[pull]` section of the daemon's configuration: how images are downloaded and unpacked,
//! and the space their downloads keep free. Each field is a key of the section and a flag of
//! `minicri serve` (its doc is the help of both); its default is in [`Default`] only.

use std::path::PathBuf;
use std::time::Duration;

use clap::{ArgAction, Args};
use serde::{Deserialize, Serialize};

use crate::blobs::{DEFAULT_SMALL_BLOB_BYTES, RangedFetch, TransferConfig};
use crate::manifest::Platform;
use crate::settings::seconds_or_off;
use crate::space::{DEFAULT_RESERVE, Reserve};

use super::{DEFAULT_MAX_BLOB_SIZE, DEFAULT_MIN_SPEED, MAX_BLOB_BYTES, PullConfig};

/// `[pull]`: image downloads, unpacks, and their partial data.
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[command(next_help_heading = "[pull]")]
pub struct PullSettings {
    /// Platform chosen from multi-platform images, os/arch[/variant].
    #[arg(long, value_name = "PLATFORM")]
    pub platform: String,

    /// Layers of one image downloaded concurrently.
    #[arg(long, value_name = "N")]
    pub max_concurrent_downloads: usize,

    /// Layers of one image unpacked concurrently (each committed after the one below it);
    /// node-wide, at most this less one are applied ahead of their parent.
    #[arg(long, value_name = "N")]
    pub max_concurrent_unpacks: usize,

    /// Requests downloading bytes of large blobs at once on the whole node, shared fairly
    /// between the pods and calls that want downloads (docs/pulls.md); a blob fetched over
    /// several ranged requests holds one per request. Small blobs have as many again of their
    /// own.
    #[arg(long, value_name = "N")]
    pub max_concurrent_transfers: usize,

    /// Blobs of at most this many bytes (configs, small layers) are fetched in a lane of their
    /// own and never wait behind large transfers.
    #[arg(long, value_name = "BYTES")]
    pub small_blob_size: u64,

    /// Ranged requests one large blob is fetched over at once (1: one stream per blob).
    #[arg(long, value_name = "N")]
    pub blob_connections: usize,

    /// Bytes one ranged request of a large blob asks for; blobs smaller than two of these are
    /// fetched as one stream.
    #[arg(long, value_name = "BYTES")]
    pub blob_chunk_size: u64,

    /// Seconds of transfers without a byte moving (downloaded, or read by the layer unpacks)
    /// after which a pull's requesters are dropped. More than 0: it is what ends a pull whose
    /// registry stopped sending.
    #[arg(long = "pull-progress-timeout", value_name = "SECONDS")]
    pub progress_timeout: f64,

    /// Bytes per second a pull with something left to download must receive, averaged over each
    /// pull.progress_timeout window, or its requesters are dropped: a registry trickling bytes
    /// cannot hold a pull (or the kubelet's serial puller) forever. At least 1.
    #[arg(long = "pull-min-speed", value_name = "BYTES_PER_SEC")]
    pub min_speed: u64,

    /// Seconds a PullImage made for a pod sandbox is held before it returns an error saying
    /// the download continues in the background for the sandbox; the kubelet retries after its
    /// back-off and the pod starts once the image is there. The budget is per sandbox and
    /// kubelet sync (0: never detach).
    #[arg(long = "pull-detach-after", value_name = "SECONDS")]
    pub detach_after: f64,

    /// Largest blob (a layer or an image config) a manifest may list; a pull of a larger one
    /// fails with RESOURCE_EXHAUSTED before any byte is fetched. At most 1 TiB.
    #[arg(long, value_name = "BYTES")]
    pub max_blob_size: u64,

    /// Keep each layer's compressed blob after the layer is unpacked. Off, the blob is deleted
    /// once the image is recorded, so an image costs its unpacked size on disk; a pull of an
    /// image whose layers are unpacked downloads nothing for them.
    #[arg(long, value_name = "BOOL", action = ArgAction::Set)]
    pub keep_layer_blobs: bool,

    /// Namespaces whose pods may raise their share of the node's transfer connections with the
    /// annotation `pull.minicri.io/priority: high` (any pod may lower its own with `low`;
    /// repeatable).
    #[arg(long = "pull-priority-namespace", value_name = "NAMESPACE")]
    pub priority_namespaces: Vec<String>,

    /// Hours a partial download nobody resumes is kept.
    #[arg(long, value_name = "HOURS")]
    pub ingest_ttl: f64,

    /// Percent of the image filesystem that must stay free: below it, partial downloads nobody
    /// is resuming are removed however young (0: never).
    #[arg(long, value_name = "PERCENT")]
    pub ingest_min_free: f64,

    /// Free space of the image filesystem that pulls leave alone: a download or an unpack that
    /// would leave less stops with RESOURCE_EXHAUSTED (the downloaded bytes are kept for a
    /// resume). A percentage of the filesystem (15%, what the kubelet's default hard eviction
    /// threshold imagefs.available<15% keeps) or a size (20GiB, or bytes); 0 turns it off. Must
    /// be at least pull.ingest_min_free.
    #[arg(long, value_name = "PERCENT%|SIZE")]
    pub image_fs_reserve: Reserve,

    /// Partial data that one pod's stopped pulls may leave behind for a resume: a percentage of
    /// the image filesystem (10%) or a size (20GiB, or bytes). Past it, the pod's oldest partial
    /// data that no running download wants is removed.
    #[arg(long, value_name = "PERCENT%|SIZE")]
    pub partial_data_per_pod: Reserve,
}

impl Default for PullSettings {
    fn default() -> Self {
        let ranged = RangedFetch::default();
        let transfers = TransferConfig::default();
        PullSettings {
            platform: "linux/amd64".into(),
            max_concurrent_downloads: 3,
            max_concurrent_unpacks: 4,
            max_concurrent_transfers: transfers.max_transfers,
            small_blob_size: DEFAULT_SMALL_BLOB_BYTES,
            blob_connections: ranged.connections,
            blob_chunk_size: ranged.chunk_size,
            progress_timeout: 60.0,
            min_speed: DEFAULT_MIN_SPEED,
            detach_after: 30.0,
            max_blob_size: DEFAULT_MAX_BLOB_SIZE,
            keep_layer_blobs: false,
            priority_namespaces: Vec::new(),
            ingest_ttl: 24.0,
            ingest_min_free: 5.0,
            image_fs_reserve: DEFAULT_RESERVE,
            partial_data_per_pod: Reserve::Percent(10.0),
        }
    }
}

impl PullSettings {
    /// Checks every value; the error names the key (`pull.KEY`).
    pub fn validate(&self) -> Result<(), String> {
        if Platform::parse(&self.platform).is_none() {
            return Err(format!(
                "pull.platform {:?} is not os/arch[/variant]",
                self.platform
            ));
        }
        for (key, n) in [
            ("max_concurrent_downloads", self.max_concurrent_downloads),
            ("max_concurrent_unpacks", self.max_concurrent_unpacks),
            ("max_concurrent_transfers", self.max_concurrent_transfers),
            ("blob_connections", self.blob_connections),
        ] {
            if n == 0 {
                return Err(format!("pull.{key} must be at least 1"));
            }
        }
        if self.blob_chunk_size == 0 {
            return Err("pull.blob_chunk_size must be at least 1".into());
        }
        if seconds_or_off("pull.progress_timeout", self.progress_timeout)?.is_none() {
            return Err(
                "pull.progress_timeout must be more than 0 seconds: it is what ends a pull \
                 whose registry stopped sending (there is no \"never\")"
                    .into(),
            );
        }
        if self.min_speed == 0 {
            return Err(
                "pull.min_speed must be at least 1 byte/s: it is what ends a pull whose \
                 registry trickles bytes (there is no \"no minimum\")"
                    .into(),
            );
        }
        seconds_or_off("pull.detach_after", self.detach_after)?;
        if !(1..=MAX_BLOB_BYTES).contains(&self.max_blob_size) {
            return Err(format!(
                "pull.max_blob_size must be 1 to {MAX_BLOB_BYTES} bytes (1 TiB)"
            ));
        }
        self.ingest_ttl()?;
        let min_free = self.ingest_min_free_ratio()?;
        // A download stopped at a reserve under ingest_min_free would leave free space where
        // the collector takes its partial data: every retry would fetch it again. (A reserve in
        // bytes is compared once the filesystem's size is known, at start.)
        if let Reserve::Percent(p) = self.image_fs_reserve
            && p > 0.0
            && p / 100.0 < min_free
        {
            return Err(format!(
                "pull.image_fs_reserve ({p}%) is less than pull.ingest_min_free ({}%): downloads \
                 stopped at the reserve would have their partial data collected; raise \
                 pull.image_fs_reserve, or lower pull.ingest_min_free",
                self.ingest_min_free
            ));
        }
        Ok(())
    }

    /// How long a partial download nobody resumes is kept.
    pub fn ingest_ttl(&self) -> Result<Duration, String> {
        match self.ingest_ttl {
            t if !t.is_finite() || !(0.0..=100_000.0).contains(&t) => {
                Err("pull.ingest_ttl must be a number of hours, 0 to 100000".into())
            }
            t => Ok(Duration::from_secs_f64(t * 3600.0)),
        }
    }

    /// `pull.ingest_min_free` as a fraction of the filesystem (0..1).
    pub fn ingest_min_free_ratio(&self) -> Result<f64, String> {
        match self.ingest_min_free {
            p if !p.is_finite() || !(0.0..=100.0).contains(&p) => {
                Err("pull.ingest_min_free must be a percentage, 0 to 100".into())
            }
            p => Ok(p / 100.0),
        }
    }

    /// What the pull manager runs with; `holds_dir` records the pod sandboxes' holds. The
    /// settings must be valid ([`PullSettings::validate`]).
    pub fn pull_config(&self, holds_dir: Option<PathBuf>) -> Result<PullConfig, String> {
        self.validate()?;
        Ok(PullConfig {
            platform: Platform::parse(&self.platform).expect("validated"),
            max_concurrent_layers: self.max_concurrent_downloads,
            max_concurrent_unpacks: self.max_concurrent_unpacks,
            transfers: TransferConfig {
                max_transfers: self.max_concurrent_transfers,
                small_blob_bytes: self.small_blob_size,
            },
            ranged: RangedFetch {
                connections: self.blob_connections,
                chunk_size: self.blob_chunk_size,
            },
            progress_timeout: seconds_or_off("pull.progress_timeout", self.progress_timeout)?,
            min_speed: (self.min_speed > 0).then_some(self.min_speed),
            detach_after: seconds_or_off("pull.detach_after", self.detach_after)?,
            holds_dir,
            max_blob_size: self.max_blob_size,
            keep_layer_blobs: self.keep_layer_blobs,
            partial_data_per_pod: self.partial_data_per_pod,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pull_managers_defaults_are_the_sections() {
        let c = PullSettings::default().pull_config(None).unwrap();
        assert_eq!(c.max_concurrent_layers, 3);
        assert_eq!(c.max_concurrent_unpacks, 4);
        assert_eq!(c.detach_after, Some(Duration::from_secs(30)));
        assert_eq!(c.progress_timeout, Some(Duration::from_secs(60)));
        assert_eq!(c.min_speed, Some(1024));
        assert_eq!(c.max_blob_size, 64 << 30);
        let d = PullConfig::default();
        assert_eq!(format!("{c:?}"), format!("{d:?}"));
    }

    #[test]
    fn zero_turns_the_detach_window_off_and_bad_values_name_their_key() {
        let s = PullSettings {
            detach_after: 0.0,
            progress_timeout: 2.5,
            min_speed: 1,
            ..Default::default()
        };
        let c = s.pull_config(None).unwrap();
        assert_eq!(c.detach_after, None);
        assert_eq!(c.progress_timeout, Some(Duration::from_millis(2500)));
        assert_eq!(c.min_speed, Some(1));
        // Nothing that bounds a pull can be turned off: no setting makes a PullImage hang.
        for s in [
            PullSettings {
                progress_timeout: 0.0,
                ..Default::default()
            },
            PullSettings {
                min_speed: 0,
                ..Default::default()
            },
        ] {
            let err = s.validate().unwrap_err();
            assert!(err.contains("there is no"), "{err}");
        }
        let bad = |s: PullSettings, key: &str| {
            let err = s.validate().unwrap_err();
            assert!(err.contains(key), "{key}: {err}");
        };
        bad(
            PullSettings {
                detach_after: -1.0,
                ..Default::default()
            },
            "pull.detach_after",
        );
        bad(
            PullSettings {
                detach_after: f64::NAN,
                ..Default::default()
            },
            "pull.detach_after",
        );
        bad(
            PullSettings {
                max_concurrent_downloads: 0,
                ..Default::default()
            },
            "pull.max_concurrent_downloads",
        );
        bad(
            PullSettings {
                platform: "linux".into(),
                ..Default::default()
            },
            "pull.platform",
        );
        // Past what a Duration holds once turned into seconds: an error, not a panic.
        bad(
            PullSettings {
                ingest_ttl: 1e16,
                ..Default::default()
            },
            "pull.ingest_ttl",
        );
        for size in [0, MAX_BLOB_BYTES + 1] {
            bad(
                PullSettings {
                    max_blob_size: size,
                    ..Default::default()
                },
                "pull.max_blob_size",
            );
        }
    }

    #[test]
    fn a_reserve_under_ingest_min_free_is_refused_naming_both() {
        let with = |reserve: &str, min_free: f64| {
            PullSettings {
                image_fs_reserve: reserve.parse().unwrap(),
                ingest_min_free: min_free,
                ..Default::default()
            }
            .validate()
        };
        let err = with("3%", 5.0).unwrap_err();
        assert!(
            err.contains("pull.image_fs_reserve") && err.contains("pull.ingest_min_free"),
            "{err}"
        );
        assert!(with("3%", 2.0).is_ok());
        assert!(with("0%", 5.0).is_ok(), "off");
        assert!(with("1GiB", 5.0).is_ok(), "bytes: checked at start");
    }
}

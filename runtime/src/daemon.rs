//! The daemon's services and state, shared by every CRI handler.
//!
//! Layout under the root directory: `content/` (blobs and ingests, see `minicri_store::content`)
//! and `images/` (image records). The image filesystem reported to the kubelet is the root.

use std::sync::{Arc, Mutex};

use anyhow::Context;
use minicri_proto::runtime::v1 as cri;
use minicri_store::pull::PullSettings;
use minicri_store::{ContentStore, ImageRecord, ImageStore, PullManager, Registry};

use minicri_snapshotter::{Backend, LocalSnapshotter, Snapshotter};

use crate::config::Config;
use crate::error::{Error, Result};
use crate::pods::stats::SNAPSHOT_USAGE_TTL;

pub struct Daemon {
    pub config: Config,
    /// The image filesystem's reserve: one budget per filesystem (content, snapshots).
    pub space: Vec<Arc<minicri_store::space::SpaceBudget>>,
    pub content: Arc<ContentStore>,
    pub images: Arc<ImageStore>,
    pub pulls: Arc<PullManager>,
    /// The registry sessions' shared configuration and client cache (the pulls use a clone).
    pub registry: Registry,
    pub ingest_gc: Arc<minicri_store::gc::IngestGc>,
    pub snapshotter: Arc<dyn Snapshotter>,
    /// Pod sandboxes and containers.
    pub pods: Arc<crate::pods::PodService>,
    /// The streaming server (exec, attach and port-forward URLs), bound here and served by [`crate::server::serve`].
    pub streaming: Arc<crate::stream::StreamServer>,
    /// The API-server watch's view of the node's pods and its connection state (run by
    /// [`crate::server::serve`]).
    pub kube: Arc<crate::kube_watch::WatchState>,
    /// The image filesystem's last measured usage: ImageFsInfo is polled often.
    fs_usage: Mutex<FsUsage>,
}

impl Daemon {
    /// Opens the stores under the configured root, loading every image recorded there.
    pub fn open(config: Config) -> anyhow::Result<Daemon> {
        let root = config.daemon.root.clone();
        let (content_dir, snapshots_dir) = (root.join("content"), root.join("snapshots"));
        for d in [&content_dir, &snapshots_dir] {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
        }
        // The snapshots may be on a filesystem of their own: each keeps its reserve.
        let (content_space, snapshots_space) = minicri_store::space::budgets(
            &content_dir,
            &snapshots_dir,
            config.pull.image_fs_reserve,
        )
        .context("measuring the image filesystem")?;
        warn_if_reserve_under_min_free(&content_dir, &config.pull);
        let content = Arc::new(
            ContentStore::open(&content_dir)
                .context("opening the content store")?
                .with_space(content_space.clone()),
        );
        let images = Arc::new(ImageStore::open(&root, &content).context("loading image records")?);
        let registry = config.registry.registry().map_err(anyhow::Error::msg)?;
        let pull_config = config
            .pull
            .pull_config(Some(config.daemon.state.join("pulls")))
            .map_err(anyhow::Error::msg)?;
        let snapshotter = open_snapshotter(&config, snapshots_space.clone())?;
        reconcile_snapshots(snapshotter.as_ref(), &images);
        let pulls = PullManager::new(
            content.clone(),
            images.clone(),
            registry.clone(),
            pull_config,
            Some(snapshotter.clone()),
        );
        // Before any pull runs: blobs of layers unpacked before a crash (or while
        // keep_layer_blobs was on) go now.
        if let Err(e) = pulls.discard_unpacked_layer_blobs() {
            tracing::warn!(error = %e, "cannot discard the blobs of unpacked layers");
        }
        let mut ingest_gc = minicri_store::gc::IngestGc::new(
            content.clone(),
            pulls.blobs().clone(),
            config.pull.ingest_ttl().map_err(anyhow::Error::msg)?,
        );
        ingest_gc.min_free_ratio = config
            .pull
            .ingest_min_free_ratio()
            .map_err(anyhow::Error::msg)?;
        let ingest_gc = Arc::new(ingest_gc);
        // Before a download or an unpack is refused at the reserve, idle partial downloads make
        // room (on the content store's filesystem: the one whose space they take).
        let reclaim: Arc<dyn minicri_store::space::Reclaim> = ingest_gc.clone();
        content_space.reclaim_with(Arc::downgrade(&reclaim));
        tracing::info!(images = images.list().len(), root = %root.display(), "image store loaded");
        let image_side = Arc::new(crate::images::NodeImages {
            images: images.clone(),
            content: content.clone(),
            snapshotter: snapshotter.clone(),
            pulls: pulls.clone(),
        });
        let pods =
            crate::pods::PodService::open(&config, image_side).context("loading pod records")?;
        // Downloads that sandboxes held when the daemon stopped resume for the sandboxes that
        // are still ready (after the pod records are loaded: stopped ones are closed by now).
        let restored = pulls.restore_holds(|id| pods.sandbox_is_ready(id));
        if restored > 0 {
            tracing::info!(
                holds = restored,
                "resuming background downloads held by pod sandboxes"
            );
        }
        let streaming = Arc::new(
            crate::stream::StreamServer::bind(config.stream.address)?
                .with_port_forward_buffer(config.stream.port_forward_buffer_bytes)
                .with_port_forward_stall(
                    config
                        .stream
                        .port_forward_stall()
                        .map_err(anyhow::Error::msg)?,
                ),
        );
        let mut space = vec![content_space];
        if !Arc::ptr_eq(&space[0], &snapshots_space) {
            space.push(snapshots_space);
        }
        let kube = Arc::new(crate::kube_watch::WatchState::new(
            config.daemon.kube_watch().is_some(),
        ));
        Ok(Daemon {
            config,
            space,
            content,
            images,
            pulls,
            registry,
            ingest_gc,
            snapshotter,
            pods,
            streaming,
            kube,
            fs_usage: Mutex::new(FsUsage::default()),
        })
    }

    /// Verbose ImageStatus info: the image config and where the image came from, as JSON.
    pub fn image_info(&self, rec: &ImageRecord) -> Result<String> {
        let bytes = minicri_store::fsutil::off_async(|| self.content.read(&rec.config))?;
        let config: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| {
            Error::Internal(format!("image config {} is not JSON: {e}", rec.config))
        })?;
        let info = serde_json::json!({
            "id": rec.id,
            "manifestDigest": rec.manifest,
            "chainID": rec.chain_id,
            "platform": rec.platform,
            "layers": rec.layers,
            "pulledAt": rec.pulled_at,
            "imageSpec": config,
            "volumeOf": self.images.volume_users(&rec.id),
        });
        Ok(info.to_string())
    }

    /// Bytes and inodes the image filesystem uses: content (blobs, partial downloads) and layer
    /// snapshots. The kubelet polls this every few seconds while the walks can take seconds on
    /// a large image store: the last figures are returned at once, and refreshed in the
    /// background once older than [`SNAPSHOT_USAGE_TTL`]. Only the very first call waits.
    pub async fn image_fs_usage(self: &Arc<Self>) -> Result<cri::FilesystemUsage> {
        let (cached, refresh) = {
            let mut u = self.fs_usage.lock().unwrap();
            let stale = u.value.is_none_or(|m| m.at.elapsed() >= SNAPSHOT_USAGE_TTL);
            let refresh = stale && !u.refreshing;
            if refresh {
                u.refreshing = true;
            }
            (u.value, refresh)
        };
        if refresh {
            let me = self.clone();
            let walk = tokio::task::spawn_blocking(move || {
                // A panic in the walks (a bug) must still end the refresh, or none would start
                // again and every later ImageFsInfo would answer the same old figures.
                let walked = crate::fsutil::walk_caught("the image filesystem", || {
                    let content = me.content.usage();
                    me.snapshotter.total_usage().map(|s| (content, s))
                });
                let mut u = me.fs_usage.lock().unwrap();
                u.refreshing = false;
                match walked {
                    Ok(((cb, ci), s)) => {
                        u.value = Some(Measure {
                            at: std::time::Instant::now(),
                            wall: std::time::SystemTime::now(),
                            bytes: cb + s.bytes,
                            inodes: ci + s.inodes,
                        });
                    }
                    Err(e) => tracing::warn!(error = %e, "measuring the snapshots"),
                }
                u.value
            });
            if cached.is_none() {
                walk.await
                    .map_err(|e| Error::Internal(format!("usage walk failed: {e}")))?;
            }
        }
        let m = match self.fs_usage.lock().unwrap().value {
            Some(m) => m,
            None => {
                return Err(Error::Unavailable(
                    "the image filesystem could not be measured yet".into(),
                ));
            }
        };
        // The timestamp is when the figures were measured, not when they are served.
        let timestamp = m
            .wall
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as i64)
            .unwrap_or(0);
        Ok(cri::FilesystemUsage {
            timestamp,
            fs_id: Some(cri::FilesystemIdentifier {
                mountpoint: self.config.daemon.root.display().to_string(),
            }),
            used_bytes: Some(cri::UInt64Value { value: m.bytes }),
            inodes_used: Some(cri::UInt64Value { value: m.inodes }),
        })
    }

    /// NetworkReady: whether the CNI manager that RunPodSandbox uses finds a valid network
    /// configuration now (a file that does not parse, or names no plugin, does not count; the
    /// message says why each was skipped).
    pub fn network_condition(&self) -> cri::RuntimeCondition {
        match minicri_store::fsutil::off_async(|| self.pods.cni().network_ready()) {
            Ok(_) => cri::RuntimeCondition {
                r#type: "NetworkReady".into(),
                status: true,
                ..Default::default()
            },
            Err(why) => cri::RuntimeCondition {
                r#type: "NetworkReady".into(),
                status: false,
                reason: "NetworkPluginNotReady".into(),
                message: why,
            },
        }
    }

    /// The configuration, for verbose Status: every section as the file writes it, with the
    /// streaming server's bound address and the pod CIDR the kubelet gave.
    pub fn config_json(&self) -> String {
        let mut v = self.config.to_json();
        v["stream"]["bound_address"] = self.streaming.address().to_string().into();
        v["pod_cidr"] = self.pods.cni().pod_cidr().into();
        v.to_string()
    }
}

/// (when, bytes, inodes) of the last walk of content and snapshots, and whether one runs.
#[derive(Default)]
struct FsUsage {
    value: Option<Measure>,
    refreshing: bool,
}

/// One measure of the image filesystem.
#[derive(Clone, Copy)]
struct Measure {
    at: std::time::Instant,
    wall: std::time::SystemTime,
    bytes: u64,
    inodes: u64,
}

/// A reserve given in bytes cannot be compared with `pull.ingest_min_free` (a percentage) before
/// the filesystem's size is known: warn when it is smaller, since a download stopped at it would
/// have its partial data collected (see `minicri_store::gc`).
fn warn_if_reserve_under_min_free(content_dir: &std::path::Path, pull: &PullSettings) {
    let (Ok(fs), Ok(min_free_ratio)) = (
        minicri_store::space::fs_space(content_dir),
        pull.ingest_min_free_ratio(),
    ) else {
        return;
    };
    let reserve = pull.image_fs_reserve.bytes_of(fs.total);
    let min_free = (fs.total as f64 * min_free_ratio) as u64;
    if reserve > 0 && reserve < min_free {
        tracing::warn!(
            pull.image_fs_reserve = %pull.image_fs_reserve,
            reserve_bytes = reserve,
            ingest_min_free_bytes = min_free,
            "pull.image_fs_reserve is less than pull.ingest_min_free on this filesystem: downloads stopped at the reserve will have their partial data collected"
        );
    }
}

/// Opens the layer snapshotter under `<root>/snapshots` with the configured backend; overlay falls
/// back to the copy backend, with a warning, where overlayfs cannot be used. Its unpacks claim
/// their bytes from `space`.
fn open_snapshotter(
    config: &Config,
    space: Arc<minicri_store::space::SpaceBudget>,
) -> anyhow::Result<Arc<dyn Snapshotter>> {
    let dir = config.daemon.root.join("snapshots");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let backend = match config.snapshotter.backend {
        Backend::Copy => Backend::Copy,
        Backend::Overlay => match minicri_snapshotter::overlay_supported(&dir) {
            Ok(()) => Backend::Overlay,
            Err(e) => {
                tracing::warn!(error = %e, "overlayfs unusable here; using the copy snapshotter");
                Backend::Copy
            }
        },
    };
    let options = config.snapshotter.options(Some(space));
    let snap = LocalSnapshotter::open(&dir, backend, options).context("opening the snapshotter")?;
    Ok(Arc::new(snap))
}

/// Drops snapshot claims of images that have no record (a crash between unpack and record), then
/// removes the layer snapshots nobody holds: a release killed after it had dropped its image's
/// claim from some of the image's snapshots but before it removed them leaves them so (the
/// release at the next start finds the claim on the lower ones only, and they have children).
/// Every layer snapshot minicri makes carries the id of an image, so one with no user and no
/// child can serve nothing.
fn reconcile_snapshots(snap: &dyn Snapshotter, images: &ImageStore) {
    let known: std::collections::HashSet<String> = images
        .list()
        .into_iter()
        .map(|r| r.id.to_string())
        .collect();
    let Ok(list) = snap.list() else { return };
    let orphans: std::collections::BTreeSet<String> = list
        .iter()
        .flat_map(|i| i.users.iter())
        .filter(|u| u.starts_with("sha256:") && !known.contains(*u))
        .cloned()
        .collect();
    for user in orphans {
        match snap.release(&user) {
            Ok(gone) => {
                tracing::info!(image = %user, snapshots_removed = gone.keys.len(), "released snapshots of an image with no record")
            }
            Err(e) => tracing::warn!(image = %user, error = %e, "cannot release snapshots"),
        }
    }
    let Ok(list) = snap.list() else { return };
    let parents: std::collections::HashSet<&str> =
        list.iter().filter_map(|i| i.parent.as_deref()).collect();
    for i in list.iter().filter(|i| {
        i.kind == minicri_snapshotter::Kind::Committed
            && i.users.is_empty()
            && !parents.contains(i.key.as_str())
    }) {
        match snap.remove(&i.key) {
            Ok(gone) => {
                tracing::info!(snapshot = %i.key, snapshots_removed = gone.len(), "removed layer snapshots nobody holds")
            }
            Err(e) => {
                tracing::warn!(snapshot = %i.key, error = %e, "cannot remove a layer snapshot nobody holds")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tar of one small file, as a layer.
    fn layer(name: &str) -> (Vec<u8>, String) {
        let mut b = tar::Builder::new(Vec::new());
        let data = name.as_bytes();
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, name, data).unwrap();
        let bytes = b.into_inner().unwrap();
        let diff_id = minicri_store::digest::Digest::of(&bytes).to_string();
        (bytes, diff_id)
    }

    /// Layer snapshots left without users and children (a release killed half-way) go at
    /// start, with their ancestors nobody holds; snapshots an image holds stay.
    #[test]
    fn layer_snapshots_nobody_holds_are_removed_at_start() {
        let d = tempfile::tempdir().unwrap();
        let snap = LocalSnapshotter::open(
            d.path().join("snap"),
            Backend::Copy,
            minicri_snapshotter::Options::default(),
        )
        .unwrap();
        let content = minicri_store::ContentStore::open(&d.path().join("content")).unwrap();
        let images = ImageStore::open(d.path(), &content).unwrap();
        let apply = |name: &str, parent: Option<&str>, user: Option<&str>| {
            let (bytes, diff_id) = layer(name);
            let spec = minicri_snapshotter::LayerSpec {
                media_type: "application/vnd.oci.image.layer.v1.tar",
                diff_id: &diff_id,
                parent,
                user,
                ..Default::default()
            };
            snap.apply_layer(&spec, &mut bytes.as_slice())
                .unwrap()
                .chain_id
        };
        // Two layers whose image's claim is gone, and one layer a snapshot of a kept image
        // holds (its holder is not an image: no record is needed for it).
        let bottom = apply("a", None, None);
        let top = apply("b", Some(&bottom), None);
        let held = apply("c", None, Some("container-1"));
        reconcile_snapshots(&snap, &images);
        let keys: Vec<String> = snap.list().unwrap().into_iter().map(|i| i.key).collect();
        assert_eq!(keys, vec![held], "{top} and {bottom} should be gone");
    }
}

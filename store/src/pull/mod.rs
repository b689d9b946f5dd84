//! Image pulls as shared, reference-counted jobs.
//!
//! A PullImage call resolves its reference to a manifest digest and joins the **job** for that
//! digest and platform, creating it if none runs. Every call holds a **reference** on the job,
//! counted per requester (a pod sandbox, keyed by pod uid and attempt, or the call itself); the
//! job's blob downloads are shared node-wide ([`crate::blobs`]). A reference goes when its call is
//! cancelled or times out (the call's future is dropped), when its requester is aborted (sandbox
//! stopped, pod deleted, operator command) or when the job's progress watchdog fires. When the
//! last reference goes the job stops, and with it every blob download no other job wants; partial
//! data stays.
//!
//! A call made for a pod sandbox that is still waiting after the detach window
//! ([`PullConfig::detach_after`], see [`detach`]) returns an error while the download carries on:
//! its reference passes to the sandbox (a **hold**), which keeps it until the sandbox is stopped
//! or removed, an operator aborts it, the watchdog fires or the job ends.
//!
//! - this module: the pull manager, its jobs, image removal, progress snapshots;
//! - [`requesters`]: who wants which job, references, aborts, closed pods;
//! - [`runner`]: running a job and ending it for its requesters;
//! - [`watchdog`]: dropping a job that makes no progress;
//! - [`procedure`]: what one job does (manifests, config, layers, unpack, the image record);
//! - [`detach`]: the detach window, the per-sync budget, hold files and their restoration.
//!
//! Invariants:
//! - an image becomes visible (its record is written) only after every blob it needs is committed;
//! - every blob is checked against its descriptor's digest and size before it is committed;
//! - dropping one reference never disturbs the other requesters of a job;
//! - a requester entry exists while it has calls waiting or a hold; a job runs while it has
//!   requester entries (lock order: `jobs`, then a job's `requesters`).

pub mod detach;
mod discard;
pub mod partial;
mod procedure;
mod requesters;
mod runner;
pub mod settings;
pub(crate) mod watchdog;
pub use procedure::{DEFAULT_MAX_BLOB_SIZE, MAX_BLOB_BYTES};
pub use settings::PullSettings;

pub use procedure::{MAX_CONFIG_BYTES, MAX_LAYERS, parse_manifest};

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use minicri_snapshotter::Snapshotter;

use crate::blobs::{BlobDownloads, BlobProgress, BlobSource, BlobState};
use crate::content::ContentStore;
use crate::digest::Digest;
use crate::error::{Result, StoreError};
use crate::images::{ImageRecord, ImageStore, Removed};
use crate::manifest::Platform;
use crate::reference::Reference;
use crate::registry::{Credentials, FetchedManifest, Registry, Session};
use crate::sched::{Demand, NORMAL_WEIGHT};

use detach::{Hold, SyncBudgets};

/// Default [`PullConfig::min_speed`]: 1 KiB/s. Any real link is far faster; this is about a
/// registry that trickles, not about slow networks.
pub const DEFAULT_MIN_SPEED: u64 = 1024;

/// Pull settings.
#[derive(Debug, Clone)]
pub struct PullConfig {
    /// The platform to select from indexes.
    pub platform: Platform,
    /// Layers of one image downloaded at once.
    pub max_concurrent_layers: usize,
    /// Layers of one image unpacked at once (each committed only after the one below it). Of
    /// all the layers being unpacked on the node, at most this number less one are applied
    /// ahead of their parent: one pull keeps its whole window, and many pulls at once add no
    /// more than that to their layers applied in order.
    pub max_concurrent_unpacks: usize,
    /// Requests transferring blob bytes at once on the node, shared fairly between requesters
    /// ([`crate::sched`]), and the lane of small blobs.
    pub transfers: crate::blobs::TransferConfig,
    /// How a large blob is split over several ranged requests.
    pub ranged: crate::blobs::RangedFetch,
    /// A job that receives no byte for this long while it has a transfer running drops every
    /// reference (`None`: never). Time spent waiting for a transfer slot does not count.
    pub progress_timeout: Option<Duration>,
    /// Bytes per second a job with something left to download must receive, averaged over each
    /// [`PullConfig::progress_timeout`] window, or every reference is dropped (`None`: no minimum).
    /// Catches a registry that trickles bytes slowly enough to never trip the no-byte rule or a
    /// read timeout, and would otherwise hold a pull (and the kubelet's serial puller) forever.
    pub min_speed: Option<u64>,
    /// How long a call made for a known pod sandbox waits before it returns and leaves the
    /// download to the sandbox (`None`: never detach).
    pub detach_after: Option<Duration>,
    /// Where holds are recorded so that a restarted daemon resumes their downloads (`None`:
    /// not recorded).
    pub holds_dir: Option<PathBuf>,
    /// Largest blob a descriptor may claim; a larger one is refused before any byte is fetched.
    pub max_blob_size: u64,
    /// Keep a layer's compressed blob once the layer is unpacked (off: it is deleted, see
    /// [`discard`]). Without a snapshotter blobs are always kept.
    pub keep_layer_blobs: bool,
    /// Partial data one pod's stopped pulls may leave behind ([`partial`]).
    pub partial_data_per_pod: crate::space::Reserve,
}

/// The defaults of the `[pull]` section ([`PullSettings`]), with no holds recorded.
impl Default for PullConfig {
    fn default() -> Self {
        PullSettings::default()
            .pull_config(None)
            .expect("the defaults are valid")
    }
}

/// The pod a requester belongs to (from PullImage's `sandbox_config.metadata`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub attempt: u32,
}

/// Who asked for a pull.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requester {
    /// The pod sandbox's id, when known.
    pub sandbox_id: Option<String>,
    /// The pod, for calls made on behalf of one.
    pub pod: Option<PodRef>,
    /// Unique per call for calls made on behalf of no pod.
    pub call_id: u64,
    /// Its share of the node's transfer connections relative to others
    /// ([`crate::sched::NORMAL_WEIGHT`] by default).
    pub weight: u32,
}

static NEXT_CALL: AtomicU64 = AtomicU64::new(1);

impl Requester {
    /// A call on behalf of no pod: it is its own requester.
    pub fn anonymous() -> Requester {
        Requester {
            sandbox_id: None,
            pod: None,
            call_id: NEXT_CALL.fetch_add(1, Ordering::Relaxed),
            weight: NORMAL_WEIGHT,
        }
    }

    /// A call on behalf of a pod sandbox.
    pub fn pod(pod: PodRef, sandbox_id: Option<String>) -> Requester {
        Requester {
            sandbox_id,
            pod: Some(pod),
            call_id: NEXT_CALL.fetch_add(1, Ordering::Relaxed),
            weight: NORMAL_WEIGHT,
        }
    }

    /// References are counted per key: a pod's sandbox (uid and attempt), or the call.
    pub fn key(&self) -> String {
        match &self.pod {
            Some(p) => pod_key(&p.uid, p.attempt),
            None => format!("call:{}", self.call_id),
        }
    }

    /// Who partial data is charged to: the pod (every attempt), or the call.
    pub fn owner(&self) -> String {
        match &self.pod {
            Some(p) => pod_uid_key(&p.uid),
            None => format!("call:{}", self.call_id),
        }
    }
}

fn pod_key(uid: &str, attempt: u32) -> String {
    format!("pod:{uid}:{attempt}")
}

/// The key of a pod closed in every attempt (deleted in the API server).
fn pod_uid_key(uid: &str) -> String {
    format!("poduid:{uid}")
}

/// Which references an abort drops.
#[derive(Debug, Clone)]
pub enum AbortTarget {
    Sandbox(String),
    /// A pod by `namespace`/`name`.
    Pod {
        namespace: String,
        name: String,
    },
    /// A pod by uid (and attempt, if given).
    PodUid {
        uid: String,
        attempt: Option<u32>,
    },
    /// Every reference on the jobs pulling this image (any name that resolves to the same reference).
    Image(String),
}

struct RequesterEntry {
    info: Requester,
    /// PullImage calls waiting on this reference.
    calls: usize,
    /// The sandbox's own hold, taken when one of its calls detached.
    hold: Option<Hold>,
    abort: CancellationToken,
    reason: Arc<Mutex<Option<String>>>,
}

impl RequesterEntry {
    fn in_use(&self) -> bool {
        self.calls > 0 || self.hold.is_some()
    }
}

/// One layer (or the config) of a job, for progress reports.
#[derive(Clone)]
struct Part {
    digest: Digest,
    size: u64,
    progress: Option<Arc<BlobProgress>>,
    /// A layer whose snapshot was committed already: nothing to download.
    unpacked: bool,
}

/// What a job's requesters are told when it ends.
type JobResult = Option<Result<ImageRecord, Arc<StoreError>>>;

struct Job {
    id: u64,
    key: String,
    /// The reference of the call that started the job.
    reference: Reference,
    /// The digest the reference resolved to (an index or a manifest).
    top: Digest,
    cancel: CancellationToken,
    requesters: Mutex<HashMap<String, RequesterEntry>>,
    joined: AtomicUsize,
    parts: Mutex<Vec<Part>>,
    /// Its parts' partial data, kept from the collector while the job runs.
    pinned: Mutex<Option<crate::blobs::Pinned>>,
    /// Notified when a part's download registers (the unpack waits for it).
    parts_changed: tokio::sync::Notify,
    /// Its layer applies, stopped and waited for when the job ends.
    unpacks: crate::unpack::Unpacks,
    /// The pods (by uid) and plain calls that wanted it, to charge the partial data it leaves.
    owners: Mutex<Vec<String>>,
    /// The requesters, for the transfer scheduler: kept equal to `requesters`' keys (and their
    /// weights) under its lock.
    demand: Arc<Demand>,
    /// The registry sessions of the requesters that resolved the image, one per source: a blob
    /// download that fails with one goes on with the next.
    sessions: Mutex<Vec<Arc<dyn BlobSource>>>,
    result: watch::Sender<JobResult>,
    started: Instant,
    started_at: chrono::DateTime<chrono::Utc>,
}

/// Bytes of a job: on disk, expected, downloaded by this job, found on disk when it started.
pub(crate) struct JobBytes {
    done: u64,
    total: u64,
    downloaded: u64,
    resumed: u64,
    /// Bytes downloaded again from byte 0 after resumed data failed its digest.
    refetched: u64,
    /// Network bytes per second of the blobs downloading now.
    rate: f64,
    /// Requests transferring the job's blobs now.
    connections: usize,
    /// Layer bytes its unpacks have read.
    unpacked: u64,
}

impl JobBytes {
    /// The bytes of blobs of these sizes and downloads (none yet for a blob not started), with
    /// `unpacked` bytes read by the unpacks.
    pub(crate) fn of<'a>(
        parts: impl Iterator<Item = (u64, Option<&'a BlobProgress>)>,
        unpacked: u64,
    ) -> JobBytes {
        let mut b = JobBytes {
            done: 0,
            total: 0,
            downloaded: 0,
            resumed: 0,
            refetched: 0,
            rate: 0.0,
            connections: 0,
            unpacked,
        };
        for (size, progress) in parts {
            b.total += size;
            if let Some(pr) = progress {
                b.done += pr.done();
                b.downloaded += pr.downloaded();
                b.resumed += pr.resumed_from();
                b.refetched += pr.refetched();
                if pr.state() == BlobState::Downloading {
                    b.rate += pr.speed();
                    b.connections += pr.connections();
                }
            }
        }
        b
    }
}

impl Job {
    fn bytes(&self) -> JobBytes {
        let parts = self.parts.lock().unwrap();
        JobBytes::of(
            parts
                .iter()
                .filter(|p| !p.unpacked)
                .map(|p| (p.size, p.progress.as_deref())),
            self.unpacks.bytes_read(),
        )
    }

    /// Hands the requesters (and their weights) to the transfer scheduler; call under the
    /// `requesters` lock after a change.
    fn sync_demand(&self, reqs: &HashMap<String, RequesterEntry>) {
        self.demand
            .set(reqs.iter().map(|(k, e)| (k.clone(), e.info.weight)));
    }

    /// Its config's and layers' blobs, as their descriptors name them.
    fn part_keys(&self) -> Vec<crate::content::BlobKey> {
        self.parts
            .lock()
            .unwrap()
            .iter()
            .map(|p| crate::content::BlobKey::new(p.digest.clone(), p.size))
            .collect()
    }

    fn finished(&self) -> bool {
        self.result.borrow().is_some()
    }
}

/// A requester's view of a job, for the admin API.
#[derive(Debug, Clone)]
pub struct RequesterSnapshot {
    pub requester: Requester,
    pub calls: usize,
    /// When the sandbox took over the reference from a detached call, if it did.
    pub held_since: Option<chrono::DateTime<chrono::Utc>>,
}

/// A layer's progress, for the admin API.
#[derive(Debug, Clone)]
pub struct PartSnapshot {
    pub digest: String,
    pub size: u64,
    pub done: u64,
    pub resumed_from: u64,
    pub state: String,
    pub bytes_per_second: f64,
    /// The endpoint the bytes come from (or last came from); empty before the first request.
    pub source: String,
    /// Requests transferring the blob now (0: waiting for a transfer slot).
    pub connections: usize,
    /// Bytes downloaded again from byte 0 after resumed data failed the digest.
    pub refetched: u64,
}

/// A job's progress, for the admin API.
#[derive(Debug, Clone)]
pub struct JobSnapshot {
    pub id: u64,
    pub image: String,
    pub key: String,
    pub state: String,
    pub requesters: Vec<RequesterSnapshot>,
    pub parts: Vec<PartSnapshot>,
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub bytes_per_second: f64,
    pub started_at: chrono::DateTime<chrono::Utc>,
}

/// Counts since the daemon started, for the metrics endpoint. Bytes are counted per job when it
/// ends (a blob shared by two concurrent jobs counts for both).
#[derive(Debug, Default)]
pub struct PullCounters {
    /// PullImage calls that took a reference on a job.
    pub calls: AtomicU64,
    /// Of those, calls that joined a job already running.
    pub calls_joined: AtomicU64,
    pub jobs_started: AtomicU64,
    /// Jobs that stored their image.
    pub jobs_done: AtomicU64,
    /// Jobs stopped because their last reference went.
    pub jobs_stopped: AtomicU64,
    /// Jobs that failed (registry, digest, unpack errors).
    pub jobs_failed: AtomicU64,
    pub bytes_downloaded: AtomicU64,
    /// Bytes found on disk from earlier attempts and not downloaded again.
    pub bytes_resumed: AtomicU64,
    /// Bytes downloaded again from byte 0 after resumed data failed the digest (part of
    /// `bytes_downloaded`).
    pub bytes_refetched: AtomicU64,
    /// References dropped by aborts: stopped sandboxes, deleted pods, operators, the watchdog.
    pub references_aborted: AtomicU64,
    /// Pulls refused because their sandbox was stopped or their pod deleted.
    pub refused: AtomicU64,
    /// Calls that returned after the detach window, leaving the download to their sandbox.
    pub detached: AtomicU64,
    /// Holds restored from their files after a daemon restart.
    pub holds_restored: AtomicU64,
    /// Pods seen deleted in the API server whose references were dropped.
    pub pods_deleted: AtomicU64,
}

/// Runs pulls: the jobs, their requesters and the shared blob downloads.
pub struct PullManager {
    content: Arc<ContentStore>,
    images: Arc<ImageStore>,
    registry: Registry,
    config: PullConfig,
    blobs: Arc<BlobDownloads>,
    snapshotter: Option<Arc<dyn Snapshotter>>,
    /// The node's slots for layers applied ahead of their parent
    /// ([`PullConfig::max_concurrent_unpacks`] less one).
    unpack_ahead: Arc<tokio::sync::Semaphore>,
    jobs: Mutex<HashMap<String, Arc<Job>>>,
    next_job: AtomicU64,
    /// Requester keys of stopped sandboxes (and uid keys of deleted pods), with the reason:
    /// their pulls are refused. Written under the `jobs` lock so that a join either sees the
    /// mark or is seen by the abort.
    closed: Mutex<HashMap<String, String>>,
    /// How long each sandbox's calls have been held in its current sync.
    budgets: SyncBudgets,
    counters: PullCounters,
    /// Held while an image id's hold on its layer snapshots changes: a removal releasing it
    /// ([`Self::release_snapshots`]) and a pull recording the image ([`Self::record_image`]). A
    /// removal then never releases the snapshots of an image a pull has recorded again meanwhile,
    /// and a pull never records an image whose snapshots a removal has just released.
    snapshot_users: Mutex<()>,
    /// Layer digests running pulls may still read ([`discard`]).
    pins: discard::LayerPins,
    /// Cancelled when the daemon stops: every job ends, keeping its holds' records.
    stopping: CancellationToken,
    /// Who left which partial data, for its cap per pod.
    left_behind: partial::LeftBehind,
    /// Jobs whose run has not ended yet (a stopped job leaves `jobs` at once, and ends after).
    running_jobs: AtomicUsize,
}

/// A call's reference on a job; dropping it releases the reference.
struct JobRef {
    mgr: Arc<PullManager>,
    job: Arc<Job>,
    key: String,
}

impl Drop for JobRef {
    fn drop(&mut self) {
        self.mgr.release(&self.job, &self.key);
    }
}

/// How a requester joins a job: with a waiting call, or as a restored hold.
enum Joining {
    Call,
    Hold(Box<Hold>),
}

impl PullManager {
    /// With a snapshotter, pulls also unpack every layer, and an image is recorded only once its
    /// layers are unpacked.
    pub fn new(
        content: Arc<ContentStore>,
        images: Arc<ImageStore>,
        registry: Registry,
        config: PullConfig,
        snapshotter: Option<Arc<dyn Snapshotter>>,
    ) -> Arc<PullManager> {
        let blobs = BlobDownloads::new(content.clone(), config.transfers, config.ranged);
        let budgets = SyncBudgets::new(config.detach_after);
        let ahead = config.max_concurrent_unpacks.saturating_sub(1);
        Arc::new(PullManager {
            unpack_ahead: Arc::new(tokio::sync::Semaphore::new(ahead)),
            content,
            images,
            registry,
            config,
            blobs,
            snapshotter,
            jobs: Mutex::new(HashMap::new()),
            next_job: AtomicU64::new(1),
            closed: Mutex::new(HashMap::new()),
            budgets,
            counters: PullCounters::default(),
            snapshot_users: Mutex::new(()),
            pins: Default::default(),
            stopping: CancellationToken::new(),
            left_behind: Default::default(),
            running_jobs: AtomicUsize::new(0),
        })
    }

    pub fn snapshotter(&self) -> Option<&Arc<dyn Snapshotter>> {
        self.snapshotter.as_ref()
    }

    pub fn config(&self) -> &PullConfig {
        &self.config
    }

    /// Removes the image `name_or_id` names (all its names) and returns its records: once this
    /// returns the image is gone for every reader. The blobs only it used and its claim on its
    /// layer snapshots are removed in the background (crash-safely: see [`crate::images`]).
    /// Unknown images are not an error. Blocking (a journal write): call it off the async threads.
    pub fn remove_image(self: &Arc<Self>, name_or_id: &str) -> Result<Vec<ImageRecord>> {
        let removed = self.images.remove(name_or_id)?;
        let images = removed.images.clone();
        self.finish_removal(removed);
        Ok(images)
    }

    /// Records container `container` as mounting image `id` as a volume: RemoveImage refuses
    /// the image until [`Self::release_volume`] (see [`crate::images`]). NOT_FOUND when the
    /// image is gone.
    pub fn hold_for_volume(&self, id: &Digest, container: &str) -> Result<()> {
        self.images.add_volume_user(id, container)
    }

    /// Container `container` no longer mounts image `id`: an image kept only for it (its names
    /// moved to another image meanwhile) is removed, its content in the background. Blocking
    /// (a journal write): call it off the async threads.
    pub fn release_volume(self: &Arc<Self>, id: &Digest, container: &str) -> Result<()> {
        let removed = self.images.remove_volume_user(id, container)?;
        self.finish_removal(removed);
        Ok(())
    }

    /// Removes the images kept only for volume users that are gone (see
    /// [`ImageStore::remove_unused_nameless`]); at start, once they are restored. Blocking.
    pub fn drop_unused_nameless(self: &Arc<Self>) -> Result<()> {
        let removed = self.images.remove_unused_nameless()?;
        self.finish_removal(removed);
        Ok(())
    }

    /// Deletes what a removal freed, on a blocking thread: blobs, then layer snapshots (tree
    /// removals that can take seconds for large images).
    pub(crate) fn finish_removal(self: &Arc<Self>, removed: Removed) {
        if removed.is_empty() && removed.freed_blobs.is_empty() {
            return;
        }
        let mgr = self.clone();
        let work = move || {
            let start = Instant::now();
            if let Err(e) = mgr.images.finish_removal(&removed, &mgr.content) {
                tracing::warn!(error = %e, "deleting the blobs of removed images");
            }
            mgr.release_snapshots(&removed.images);
            for img in &removed.images {
                tracing::info!(image = %img.id, tags = ?img.repo_tags, blobs_deleted = removed.freed_blobs.len(), duration_ms = start.elapsed().as_millis() as u64, "image content removed");
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(h) => {
                h.spawn_blocking(work);
            }
            Err(_) => work(),
        }
    }

    fn release_snapshots(&self, images: &[ImageRecord]) {
        let Some(snap) = &self.snapshotter else {
            return;
        };
        // The records change under the lock; the trees are deleted after it is let go, so a pull
        // recording an image meanwhile does not wait for seconds of tree removal.
        let mut released = Vec::new();
        {
            let _users = self
                .snapshot_users
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            for img in images {
                if matches!(self.images.get(img.id.as_str()), Ok(Some(_))) {
                    tracing::info!(image = %img.id, "image pulled again since its removal; its layer snapshots stay");
                    continue;
                }
                match snap.release(img.id.as_str()) {
                    Ok(gone) => {
                        tracing::info!(image = %img.id, snapshots_removed = gone.keys.len(), "released layer snapshots");
                        released.push(gone);
                    }
                    Err(e) => {
                        tracing::warn!(image = %img.id, error = %e, "cannot release layer snapshots")
                    }
                }
            }
        }
        drop(released);
    }

    /// Records a pulled image, after making sure its layer snapshots are still there and held
    /// for it: a removal of the same image running since the pull unpacked (or found) them may
    /// have released them. `Snapshotter(NotFound)` when they are gone: unpack them again.
    pub(crate) fn record_image(&self, rec: &ImageRecord) -> Result<(ImageRecord, Removed)> {
        let _users = self
            .snapshot_users
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let (Some(snap), Some(chain)) = (&self.snapshotter, &rec.chain_id) {
            snap.add_user(chain, rec.id.as_str())?;
        }
        self.images.add(rec.clone(), &self.content)
    }

    pub fn counters(&self) -> &PullCounters {
        &self.counters
    }

    pub fn blobs(&self) -> &Arc<BlobDownloads> {
        &self.blobs
    }

    /// Pulls `reference` for `requester`; returns the stored image record.
    ///
    /// A requester whose sandbox minicri runs gets the detach window: if the job is still
    /// running when the sandbox's budget for this sync is spent, the call fails with
    /// [`StoreError::Detached`] and the sandbox holds the job until it ends or is dropped.
    pub async fn pull(
        self: &Arc<Self>,
        reference: &str,
        creds: &Credentials,
        requester: Requester,
    ) -> Result<ImageRecord> {
        let reference = Reference::parse(reference)?;
        self.refuse_closed(&reference, &requester)?;
        let budget = self.budgets.start(&requester);
        let deadline = budget.as_ref().map(|b| b.deadline());

        // A sandbox that holds a job for this very reference re-joins it without asking the
        // registry again (the kubelet's retry after its back-off).
        let (job, jref) = match self.held_job(&requester, &reference) {
            Some(job) => {
                let jref = self.join_job(&job, &requester, Joining::Call)?;
                (job, jref)
            }
            None => {
                let resolving = self.resolve(&reference, creds);
                let (session, top) = match deadline {
                    Some(d) => tokio::time::timeout_at(d.into(), resolving)
                        .await
                        .map_err(|_| StoreError::Unavailable {
                            reference: reference.to_string(),
                            reason: format!(
                                "the registry did not resolve it within {:?} (pull.detach_after); \
                                 the next attempt tries again",
                                self.config.detach_after.unwrap_or_default()
                            ),
                        })??,
                    None => resolving.await?,
                };
                let key = format!("{}|{}", top.digest, self.config.platform);
                let (job, jref, created) =
                    self.join(&key, &reference, &top.digest, &requester, Joining::Call)?;
                self.add_session(&job, &session);
                if created {
                    let mgr = self.clone();
                    let job2 = job.clone();
                    tokio::spawn(async move { mgr.run_job(job2, session, top).await });
                }
                (job, jref.expect("a call's join returns its reference"))
            }
        };
        let (abort, reason) = {
            let reqs = job.requesters.lock().unwrap();
            let e = reqs.get(&jref.key).expect("own entry");
            (e.abort.clone(), e.reason.clone())
        };
        let mut rx = job.result.subscribe();
        let detach_at = async {
            match deadline {
                Some(d) => {
                    tokio::time::sleep_until(d.into()).await;
                    // The runtime's policy may let the call wait on (detach.rs).
                    self.budgets.past_window(&requester, &reference).await;
                }
                None => std::future::pending().await,
            }
        };
        let outcome = tokio::select! {
            biased;
            r = rx.wait_for(Option::is_some) => match r {
                Ok(v) => v.as_ref().expect("checked").clone(),
                Err(_) => Err(Arc::new(StoreError::Cancelled("pull job vanished".into()))),
            },
            _ = abort.cancelled() => {
                let why = reason.lock().unwrap().clone().unwrap_or_else(|| "aborted".into());
                return Err(StoreError::Cancelled(format!("pull of {reference} stopped: {why}")));
            }
            _ = detach_at => match self.detach(&job, &jref, &reference, creds) {
                Ok(err) => return Err(err),
                // The job ended as the window closed: its result is there.
                Err(()) => job.result.borrow().clone().expect("finished"),
            },
        };
        drop(jref);
        let rec = outcome.map_err(StoreError::Shared)?;
        // Each caller adds its own names: several references can resolve to one job.
        self.name_image(&rec, &reference, &job.top)
    }

    /// Builds a registry session (off the async threads: it loads TLS roots) and resolves the
    /// reference to its top manifest.
    async fn resolve(
        &self,
        reference: &Reference,
        creds: &Credentials,
    ) -> Result<(Arc<Session>, FetchedManifest)> {
        let (registry, r, c) = (self.registry.clone(), reference.clone(), creds.clone());
        let session = tokio::task::spawn_blocking(move || registry.session(&r, &c))
            .await
            .expect("session set-up does not panic")?;
        let session = Arc::new(session);
        let top = session
            .manifest(None)
            .await
            .map_err(|e| session.fold_errors("manifest", e))?;
        Ok((session, top))
    }

    /// Records `reference` (and its digest form) as names of the pulled image `rec`.
    fn name_image(
        self: &Arc<Self>,
        rec: &ImageRecord,
        reference: &Reference,
        top: &Digest,
    ) -> Result<ImageRecord> {
        let mut named = rec.clone();
        named.repo_tags = reference.tagged().into_iter().collect();
        named.repo_digests = vec![reference.with_digest(top)];
        // A name moving here from another image can leave that one with none: it goes.
        let (stored, removed) = crate::fsutil::off_async(|| self.images.add(named, &self.content))?;
        self.finish_removal(removed);
        Ok(stored)
    }

    /// The running jobs.
    pub fn list(&self) -> Vec<JobSnapshot> {
        let jobs: Vec<Arc<Job>> = self.jobs.lock().unwrap().values().cloned().collect();
        let mut out: Vec<JobSnapshot> = jobs.iter().map(|j| snapshot(j)).collect();
        out.sort_by_key(|j| j.id);
        out
    }
}

fn snapshot(j: &Job) -> JobSnapshot {
    let parts: Vec<PartSnapshot> = j
        .parts
        .lock()
        .unwrap()
        .iter()
        .map(|p| match &p.progress {
            Some(pr) => PartSnapshot {
                digest: p.digest.to_string(),
                size: p.size,
                done: pr.done(),
                resumed_from: pr.resumed_from(),
                state: pr.state().as_str().to_string(),
                bytes_per_second: pr.speed(),
                source: pr.source().unwrap_or_default(),
                connections: pr.connections(),
                refetched: pr.refetched(),
            },
            None => PartSnapshot {
                digest: p.digest.to_string(),
                size: p.size,
                done: if p.unpacked { p.size } else { 0 },
                resumed_from: 0,
                state: if p.unpacked { "unpacked" } else { "waiting" }.into(),
                bytes_per_second: 0.0,
                source: String::new(),
                connections: 0,
                refetched: 0,
            },
        })
        .collect();
    let bytes = j.bytes();
    let secs = j.started.elapsed().as_secs_f64();
    let state = if j.cancel.is_cancelled() {
        "stopping"
    } else if parts.is_empty() {
        "resolving"
    } else {
        "downloading"
    };
    JobSnapshot {
        id: j.id,
        image: j.reference.to_string(),
        key: j.key.clone(),
        state: state.into(),
        requesters: j
            .requesters
            .lock()
            .unwrap()
            .values()
            .map(|e| RequesterSnapshot {
                requester: e.info.clone(),
                calls: e.calls,
                held_since: e.hold.as_ref().map(|h| h.since),
            })
            .collect(),
        parts,
        bytes_done: bytes.done,
        bytes_total: bytes.total,
        bytes_per_second: if secs > 0.0 {
            bytes.downloaded as f64 / secs
        } else {
            0.0
        },
        started_at: j.started_at,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use minicri_snapshotter::{Backend, LayerSpec, LocalSnapshotter, Options};

    struct Node {
        _dir: tempfile::TempDir,
        content: Arc<ContentStore>,
        images: Arc<ImageStore>,
        snapshotter: Arc<LocalSnapshotter>,
        mgr: Arc<PullManager>,
    }

    fn node() -> Node {
        let dir = tempfile::tempdir().unwrap();
        let content = Arc::new(ContentStore::open(&dir.path().join("content")).unwrap());
        let images = Arc::new(ImageStore::open(dir.path(), &content).unwrap());
        let snaps = dir.path().join("snapshots");
        std::fs::create_dir_all(&snaps).unwrap();
        let snapshotter =
            Arc::new(LocalSnapshotter::open(&snaps, Backend::Copy, Options::default()).unwrap());
        let mgr = PullManager::new(
            content.clone(),
            images.clone(),
            Registry::new(crate::hosts::RegistryHosts::new(None)),
            PullConfig::default(),
            Some(snapshotter.clone()),
        );
        Node {
            _dir: dir,
            content,
            images,
            snapshotter,
            mgr,
        }
    }

    /// An image of one layer (`tar`), unpacked and held for the image as a pull does, not yet
    /// recorded.
    fn unpacked_image(n: &Node, name: &str, tar: Vec<u8>) -> ImageRecord {
        let diff_id = Digest::of(&tar).to_string();
        let config = format!(r#"{{"rootfs":{{"type":"layers","diff_ids":["{diff_id}"]}}}}"#);
        let id = Digest::of(config.as_bytes());
        n.content.write(&id, config.as_bytes()).unwrap();
        let applied = n
            .snapshotter
            .apply_layer(
                &LayerSpec {
                    media_type: "application/vnd.oci.image.layer.v1.tar",
                    diff_id: &diff_id,
                    parent: None,
                    user: Some(id.as_str()),
                    ..Default::default()
                },
                &mut std::io::Cursor::new(tar),
            )
            .unwrap();
        ImageRecord {
            id: id.clone(),
            repo_tags: vec![format!("example.com/{name}:1")],
            repo_digests: vec![],
            manifest: id.clone(),
            config: id.clone(),
            layers: vec![],
            diff_ids: vec![diff_id],
            size: 0,
            uid: None,
            username: String::new(),
            pinned: false,
            platform: "linux/amd64".into(),
            blobs: [id].into(),
            chain_id: Some(applied.chain_id),
            pulled_at: chrono::Utc::now(),
        }
    }

    /// The two zero blocks that end a tar: a layer with no files.
    fn empty_layer() -> Vec<u8> {
        vec![0u8; 1024]
    }

    /// RemoveImage deletes an image's snapshots in the background; a pull of the same image may
    /// record it again in between. Whichever comes first, the image that stays recorded has its
    /// snapshots.
    #[test]
    fn a_removal_and_a_pull_of_one_image_never_leave_it_without_snapshots() {
        let n = node();
        let (images, snapshotter, mgr) = (&n.images, &n.snapshotter, &n.mgr);
        let record = unpacked_image(&n, "a", empty_layer());
        let (id, chain) = (record.id.clone(), record.chain_id.clone().unwrap());
        mgr.record_image(&record).unwrap();
        let held = |who: &Digest| {
            snapshotter
                .stat(&chain)
                .is_ok_and(|i| i.users.contains(who.as_str()))
        };

        // The pull records the image again before the removal's background work runs: the
        // snapshots stay, held for it.
        let removed = images.remove(id.as_str()).unwrap();
        mgr.record_image(&record).unwrap();
        mgr.finish_removal(removed);
        assert!(held(&id), "the recorded image lost its snapshots");
        assert!(images.get(id.as_str()).unwrap().is_some());

        // The removal's release runs first: the pull learns that the snapshots it found are gone
        // (and unpacks again) instead of recording an image without them.
        let removed = images.remove(id.as_str()).unwrap();
        mgr.finish_removal(removed);
        assert!(snapshotter.stat(&chain).is_err(), "released");
        match mgr.record_image(&record) {
            Err(StoreError::Snapshotter(minicri_snapshotter::Error::NotFound { key })) => {
                assert_eq!(key, chain)
            }
            other => panic!("expected the snapshots to be missing, got {other:?}"),
        }
        assert!(images.get(id.as_str()).unwrap().is_none());
    }

    /// A removal deletes the released trees after letting go of the lock a pull takes to record
    /// an image: a pull finishing meanwhile does not wait for the deletion. (Were the lock held,
    /// the record could never return while the tree still exists; that it returns first depends
    /// on timing, so a loaded machine gets three tries.)
    #[test]
    fn a_pull_recording_an_image_does_not_wait_for_a_removal_deleting_trees() {
        let n = node();
        let other = unpacked_image(&n, "other", empty_layer());
        let tmp = n.snapshotter.root().join("tmp");
        let deleting = || std::fs::read_dir(&tmp).unwrap().next().is_some();
        let mut recorded_during_deletion = false;
        for attempt in 0..3 {
            let mut layer = tar::Builder::new(Vec::new());
            for i in 0..30_000 {
                let mut h = tar::Header::new_ustar();
                h.set_size(0);
                h.set_mode(0o644);
                h.set_entry_type(tar::EntryType::Regular);
                let name = format!("{attempt}/d{}/f{i}", i % 16);
                layer.append_data(&mut h, name, std::io::empty()).unwrap();
            }
            let big = unpacked_image(&n, "big", layer.into_inner().unwrap());
            n.mgr.record_image(&big).unwrap();

            let removed = n.images.remove(big.id.as_str()).unwrap();
            let mgr = n.mgr.clone();
            // Without a runtime, the background work runs on the calling thread.
            let removal = std::thread::spawn(move || mgr.finish_removal(removed));
            let start = Instant::now();
            while !deleting() {
                assert!(
                    start.elapsed() < Duration::from_secs(30),
                    "the removal never moved the tree aside"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
            n.mgr.record_image(&other).unwrap();
            recorded_during_deletion = deleting();
            removal.join().unwrap();
            assert!(!deleting(), "the released tree is deleted");
            assert!(n.snapshotter.stat(big.chain_id.as_ref().unwrap()).is_err());
            assert!(n.images.get(other.id.as_str()).unwrap().is_some());
            if recorded_during_deletion {
                break;
            }
        }
        assert!(
            recorded_during_deletion,
            "recording an image waited until the removal had deleted the released tree"
        );
    }
}

//! Image pulls as shared, reference-counted jobs.
//!
//! A PullImage call resolves its reference to a manifest digest and joins the **job** for that
//! digest and platform, creating it if none runs. Every call holds a **reference** on the job,
//! counted per requester (a pod sandbox, keyed by pod uid and attempt, or the call itself); the
//! job's blob downloads are shared node-wide ([`crate::blobs`]). A reference goes when its call is
//! cancelled or times out (the call's future is dropped), when its requester is aborted (sandbox
//! stopped, operator command) or when the job's progress watchdog fires. When the last reference
//! goes the job stops, and with it every blob download no other job wants; partial data stays.
//!
//! Invariants:
//! - an image becomes visible (its record is written) only after every blob it needs is committed;
//! - every blob is checked against its descriptor's digest and size before it is committed;
//! - dropping one reference never disturbs the other requesters of a job.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use minicri_snapshotter::Snapshotter;

use crate::blobs::{BlobDownloads, BlobHandle, BlobProgress};
use crate::content::ContentStore;
use crate::digest::Digest;
use crate::error::{Result, StoreError};
use crate::images::{ImageRecord, ImageStore, LayerRecord};
use crate::manifest::{self, Descriptor, ImageConfigDoc, ManifestDoc, Platform};
use crate::reference::Reference;
use crate::registry::{Credentials, FetchedManifest, Registry, Session};
use crate::unpack::{self, LayerToApply};

/// Pull settings.
#[derive(Debug, Clone)]
pub struct PullConfig {
    /// The platform to select from indexes.
    pub platform: Platform,
    /// Layers of one image downloaded at once.
    pub max_concurrent_layers: usize,
    /// Blobs transferred at once on the node.
    pub max_concurrent_transfers: usize,
    /// A job that receives no byte for this long drops every reference (`None`: never).
    pub progress_timeout: Option<Duration>,
}

impl Default for PullConfig {
    fn default() -> Self {
        PullConfig {
            platform: Platform::parse("linux/amd64").expect("valid"),
            max_concurrent_layers: 3,
            max_concurrent_transfers: 6,
            progress_timeout: Some(Duration::from_secs(60)),
        }
    }
}

/// The pod a requester belongs to (from PullImage's `sandbox_config.metadata`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
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
}

static NEXT_CALL: AtomicU64 = AtomicU64::new(1);

impl Requester {
    /// A call on behalf of no pod: it is its own requester.
    pub fn anonymous() -> Requester {
        Requester {
            sandbox_id: None,
            pod: None,
            call_id: NEXT_CALL.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// A call on behalf of a pod sandbox.
    pub fn pod(pod: PodRef, sandbox_id: Option<String>) -> Requester {
        Requester {
            sandbox_id,
            pod: Some(pod),
            call_id: NEXT_CALL.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// References are counted per key: a pod's sandbox (uid and attempt), or the call.
    pub fn key(&self) -> String {
        match &self.pod {
            Some(p) => pod_key(&p.uid, p.attempt),
            None => format!("call:{}", self.call_id),
        }
    }
}

fn pod_key(uid: &str, attempt: u32) -> String {
    format!("pod:{uid}:{attempt}")
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
    calls: usize,
    abort: CancellationToken,
    reason: Arc<Mutex<Option<String>>>,
}

/// One layer (or the config) of a job, for progress reports.
#[derive(Clone)]
struct Part {
    digest: Digest,
    size: u64,
    progress: Option<Arc<BlobProgress>>,
}

struct Job {
    id: u64,
    key: String,
    reference: String,
    cancel: CancellationToken,
    requesters: Mutex<HashMap<String, RequesterEntry>>,
    joined: AtomicUsize,
    parts: Mutex<Vec<Part>>,
    result: watch::Sender<Option<Result<ImageRecord, Arc<StoreError>>>>,
    started: Instant,
    started_at: chrono::DateTime<chrono::Utc>,
}

impl Job {
    fn bytes(&self) -> (u64, u64, u64, u64) {
        let parts = self.parts.lock().unwrap();
        let mut done = 0;
        let mut total = 0;
        let mut downloaded = 0;
        let mut resumed = 0;
        for p in parts.iter() {
            total += p.size;
            if let Some(pr) = &p.progress {
                done += pr.done();
                downloaded += pr.downloaded();
                resumed += pr.resumed_from();
            }
        }
        (done, total, downloaded, resumed)
    }
}

/// A requester's view of a job, for the admin API.
#[derive(Debug, Clone)]
pub struct RequesterSnapshot {
    pub requester: Requester,
    pub calls: usize,
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
    /// References dropped by aborts: stopped sandboxes, operators, the progress watchdog.
    pub references_aborted: AtomicU64,
    /// Pulls refused because their sandbox was stopped.
    pub refused: AtomicU64,
}

/// Runs pulls: the jobs, their requesters and the shared blob downloads.
pub struct PullManager {
    content: Arc<ContentStore>,
    images: Arc<ImageStore>,
    registry: Registry,
    config: PullConfig,
    blobs: Arc<BlobDownloads>,
    snapshotter: Option<Arc<dyn Snapshotter>>,
    jobs: Mutex<HashMap<String, Arc<Job>>>,
    next_job: AtomicU64,
    /// Requester keys of stopped sandboxes, with the reason: their pulls are refused. Written
    /// under the `jobs` lock so that a join either sees the mark or is seen by the abort.
    closed: Mutex<HashMap<String, String>>,
    counters: PullCounters,
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
        let blobs = BlobDownloads::new(content.clone(), config.max_concurrent_transfers);
        Arc::new(PullManager {
            content,
            images,
            registry,
            config,
            blobs,
            snapshotter,
            jobs: Mutex::new(HashMap::new()),
            next_job: AtomicU64::new(1),
            closed: Mutex::new(HashMap::new()),
            counters: PullCounters::default(),
        })
    }

    pub fn snapshotter(&self) -> Option<&Arc<dyn Snapshotter>> {
        self.snapshotter.as_ref()
    }

    /// Removes the image `name_or_id` names (all its names), the blobs only it used and its claim
    /// on its layer snapshots. Unknown images are not an error.
    pub fn remove_image(&self, name_or_id: &str) -> Result<crate::images::Removed> {
        let removed = self.images.remove(name_or_id, &self.content)?;
        self.release_snapshots(&removed.images);
        Ok(removed)
    }

    fn release_snapshots(&self, images: &[ImageRecord]) {
        let Some(snap) = &self.snapshotter else {
            return;
        };
        for img in images {
            match snap.release(img.id.as_str()) {
                Ok(gone) => {
                    tracing::info!(image = %img.id, snapshots_removed = gone.len(), "released layer snapshots")
                }
                Err(e) => {
                    tracing::warn!(image = %img.id, error = %e, "cannot release layer snapshots")
                }
            }
        }
    }

    pub fn counters(&self) -> &PullCounters {
        &self.counters
    }

    pub fn blobs(&self) -> &Arc<BlobDownloads> {
        &self.blobs
    }

    /// Pulls `reference` for `requester`; returns the stored image record.
    pub async fn pull(
        self: &Arc<Self>,
        reference: &str,
        creds: &Credentials,
        requester: Requester,
    ) -> Result<ImageRecord> {
        let reference = Reference::parse(reference)?;
        self.refuse_closed(&reference, &requester)?;
        // Building registry clients loads TLS roots (slow, blocking): keep it off the async threads.
        let (registry, r, c) = (self.registry.clone(), reference.clone(), creds.clone());
        let session = tokio::task::spawn_blocking(move || registry.session(&r, &c))
            .await
            .expect("session set-up does not panic")?;
        let session = Arc::new(session);
        let top = session
            .manifest(None)
            .await
            .map_err(|e| session.fold_errors("manifest", e))?;
        let key = format!("{}|{}", top.digest, self.config.platform);

        let (job, jref, created) = self.join(&key, &reference, &requester)?;
        if created {
            let mgr = self.clone();
            let job2 = job.clone();
            let session2 = session.clone();
            let top2 = top.clone();
            tokio::spawn(async move { mgr.run_job(job2, session2, top2).await });
        }
        let (abort, reason) = {
            let reqs = job.requesters.lock().unwrap();
            let e = reqs.get(&jref.key).expect("own entry");
            (e.abort.clone(), e.reason.clone())
        };
        let mut rx = job.result.subscribe();
        let outcome = tokio::select! {
            r = rx.wait_for(Option::is_some) => match r {
                Ok(v) => v.as_ref().expect("checked").clone(),
                Err(_) => Err(Arc::new(StoreError::Cancelled("pull job vanished".into()))),
            },
            _ = abort.cancelled() => {
                let why = reason.lock().unwrap().clone().unwrap_or_else(|| "aborted".into());
                return Err(StoreError::Cancelled(format!("pull of {reference} stopped: {why}")));
            }
        };
        drop(jref);
        let rec = outcome.map_err(StoreError::Shared)?;
        // Each caller adds its own names: several references can resolve to one job.
        let mut named = rec.clone();
        named.repo_tags = reference.tagged().into_iter().collect();
        named.repo_digests = vec![reference.with_digest(&top.digest)];
        let (stored, _) = self.images.add(named, &self.content)?;
        Ok(stored)
    }

    /// Joins the job `key` or creates it; takes a reference for `requester`.
    fn join(
        self: &Arc<Self>,
        key: &str,
        reference: &Reference,
        requester: &Requester,
    ) -> Result<(Arc<Job>, JobRef, bool)> {
        let mut jobs = self.jobs.lock().unwrap();
        self.refuse_closed(reference, requester)?;
        let (job, created) = match jobs.get(key).filter(|j| !j.cancel.is_cancelled()) {
            Some(j) => (j.clone(), false),
            None => {
                let job = Arc::new(Job {
                    id: self.next_job.fetch_add(1, Ordering::Relaxed),
                    key: key.to_string(),
                    reference: reference.to_string(),
                    cancel: CancellationToken::new(),
                    requesters: Mutex::new(HashMap::new()),
                    joined: AtomicUsize::new(0),
                    parts: Mutex::new(Vec::new()),
                    result: watch::Sender::new(None),
                    started: Instant::now(),
                    started_at: chrono::Utc::now(),
                });
                jobs.insert(key.to_string(), job.clone());
                (job, true)
            }
        };
        let rkey = requester.key();
        {
            let mut reqs = job.requesters.lock().unwrap();
            let e = reqs.entry(rkey.clone()).or_insert_with(|| RequesterEntry {
                info: requester.clone(),
                calls: 0,
                abort: CancellationToken::new(),
                reason: Arc::new(Mutex::new(None)),
            });
            e.calls += 1;
        }
        job.joined.fetch_add(1, Ordering::Relaxed);
        self.counters.calls.fetch_add(1, Ordering::Relaxed);
        if created {
            self.counters.jobs_started.fetch_add(1, Ordering::Relaxed);
        } else {
            self.counters.calls_joined.fetch_add(1, Ordering::Relaxed);
            tracing::info!(job = job.id, image = %reference, requester = %rkey, "joined running pull");
        }
        Ok((
            job.clone(),
            JobRef {
                mgr: self.clone(),
                job,
                key: rkey,
            },
            created,
        ))
    }

    /// Fails for a requester whose sandbox was stopped ([`PullManager::close_pod`]).
    fn refuse_closed(&self, reference: &Reference, requester: &Requester) -> Result<()> {
        match self.closed.lock().unwrap().get(&requester.key()) {
            Some(why) => {
                self.counters.refused.fetch_add(1, Ordering::Relaxed);
                Err(StoreError::SandboxStopped(format!(
                    "not pulling {reference}: {why}"
                )))
            }
            None => Ok(()),
        }
    }

    /// A pod sandbox (uid, attempt) stopped: drops its references on every job (their calls
    /// return at once with `reason`) and refuses its later pulls until [`PullManager::reopen_pod`].
    /// Returns how many references were dropped.
    pub fn close_pod(&self, uid: &str, attempt: u32, reason: &str) -> usize {
        {
            let _jobs = self.jobs.lock().unwrap();
            self.closed
                .lock()
                .unwrap()
                .insert(pod_key(uid, attempt), reason.to_string());
        }
        self.abort(
            &AbortTarget::PodUid {
                uid: uid.to_string(),
                attempt: Some(attempt),
            },
            reason,
        )
    }

    /// Forgets a closed pod sandbox (it was removed).
    pub fn reopen_pod(&self, uid: &str, attempt: u32) {
        self.closed.lock().unwrap().remove(&pod_key(uid, attempt));
    }

    /// Drops one call's reference; the job stops when none is left.
    fn release(&self, job: &Arc<Job>, key: &str) {
        let mut jobs = self.jobs.lock().unwrap();
        let mut reqs = job.requesters.lock().unwrap();
        if let Some(e) = reqs.get_mut(key) {
            e.calls -= 1;
            if e.calls == 0 {
                reqs.remove(key);
            }
        }
        if reqs.is_empty() && job.result.borrow().is_none() && !job.cancel.is_cancelled() {
            tracing::info!(job = job.id, image = %job.reference, "last requester gone; stopping pull (partial data kept)");
            job.cancel.cancel();
            if jobs.get(&job.key).is_some_and(|j| Arc::ptr_eq(j, job)) {
                jobs.remove(&job.key);
            }
        }
    }

    /// Drops the references `target` names; their calls return at once with `reason`.
    /// Returns how many references were dropped.
    pub fn abort(&self, target: &AbortTarget, reason: &str) -> usize {
        let jobs: Vec<Arc<Job>> = self.jobs.lock().unwrap().values().cloned().collect();
        let image_key = match target {
            AbortTarget::Image(r) => Reference::parse(r).ok().map(|r| r.to_string()),
            _ => None,
        };
        let mut dropped = 0;
        for job in jobs {
            let reqs = job.requesters.lock().unwrap();
            for e in reqs.values() {
                let hit = match target {
                    AbortTarget::Sandbox(id) => e.info.sandbox_id.as_deref() == Some(id.as_str()),
                    AbortTarget::Pod { namespace, name } => e
                        .info
                        .pod
                        .as_ref()
                        .is_some_and(|p| &p.namespace == namespace && &p.name == name),
                    AbortTarget::PodUid { uid, attempt } => {
                        e.info.pod.as_ref().is_some_and(|p| {
                            &p.uid == uid && attempt.is_none_or(|a| a == p.attempt)
                        })
                    }
                    AbortTarget::Image(_) => image_key.as_deref() == Some(job.reference.as_str()),
                };
                if hit && !e.abort.is_cancelled() {
                    *e.reason.lock().unwrap() = Some(reason.to_string());
                    e.abort.cancel();
                    dropped += 1;
                    self.counters
                        .references_aborted
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        dropped
    }

    /// The running jobs.
    pub fn list(&self) -> Vec<JobSnapshot> {
        let jobs: Vec<Arc<Job>> = self.jobs.lock().unwrap().values().cloned().collect();
        let mut out: Vec<JobSnapshot> = jobs.iter().map(|j| snapshot(j)).collect();
        out.sort_by_key(|j| j.id);
        out
    }

    async fn run_job(self: Arc<Self>, job: Arc<Job>, session: Arc<Session>, top: FetchedManifest) {
        let watchdog = self.config.progress_timeout.map(|t| {
            let job = job.clone();
            let mgr = self.clone();
            tokio::spawn(async move { mgr.watchdog(job, t).await })
        });
        let result = tokio::select! {
            r = self.pull_content(&job, &session, &top) => r,
            _ = job.cancel.cancelled() => Err(StoreError::Cancelled(format!("pull of {} stopped: no requester left", job.reference))),
        };
        if let Some(w) = watchdog {
            w.abort();
        }
        let (_, total, downloaded, resumed) = job.bytes();
        let outcome = match &result {
            Ok(_) => "done".to_string(),
            Err(e) => e.to_string(),
        };
        let c = &self.counters;
        match &result {
            Ok(_) => &c.jobs_done,
            Err(StoreError::Cancelled(_)) => &c.jobs_stopped,
            Err(_) => &c.jobs_failed,
        }
        .fetch_add(1, Ordering::Relaxed);
        c.bytes_downloaded.fetch_add(downloaded, Ordering::Relaxed);
        c.bytes_resumed.fetch_add(resumed, Ordering::Relaxed);
        tracing::info!(
            job = job.id,
            image = %job.reference,
            outcome = %outcome,
            bytes_total = total,
            bytes_downloaded = downloaded,
            bytes_resumed = resumed,
            requesters_joined = job.joined.load(Ordering::Relaxed),
            duration_ms = job.started.elapsed().as_millis() as u64,
            "pull job finished"
        );
        {
            let mut jobs = self.jobs.lock().unwrap();
            if jobs.get(&job.key).is_some_and(|j| Arc::ptr_eq(j, &job)) {
                jobs.remove(&job.key);
            }
        }
        job.result.send_replace(Some(result.map_err(Arc::new)));
    }

    /// Drops every reference of a job that received no byte for `timeout`.
    async fn watchdog(&self, job: Arc<Job>, timeout: Duration) {
        let tick = (timeout / 10).clamp(Duration::from_millis(50), Duration::from_secs(1));
        let mut last = job.bytes().0;
        let mut since = Instant::now();
        loop {
            tokio::time::sleep(tick).await;
            let now = job.bytes().0;
            if now != last {
                last = now;
                since = Instant::now();
            } else if since.elapsed() >= timeout {
                let reason = format!("no progress for {timeout:?} (pull_progress_timeout)");
                tracing::warn!(job = job.id, image = %job.reference, "{reason}; dropping every requester");
                for e in job.requesters.lock().unwrap().values() {
                    *e.reason.lock().unwrap() = Some(reason.clone());
                    e.abort.cancel();
                }
                return;
            }
        }
    }

    async fn pull_content(
        &self,
        job: &Job,
        session: &Arc<Session>,
        top: &FetchedManifest,
    ) -> Result<ImageRecord> {
        let reference = session.reference();
        let mut blobs = BTreeSet::new();
        let top_doc = parse_manifest(reference, &top.bytes)?;
        self.content.write(&top.digest, &top.bytes)?;
        blobs.insert(top.digest.clone());

        let (manifest, doc) = if top_doc.manifests.is_some() {
            let entry = select_platform(&self.config.platform, reference, &top_doc)?;
            let d = parse_digest(reference, &entry.digest)?;
            let m = session
                .manifest(Some(&d))
                .await
                .map_err(|e| session.fold_errors("platform manifest", e))?;
            let doc = parse_manifest(reference, &m.bytes)?;
            if doc.manifests.is_some() {
                return Err(malformed(
                    reference,
                    "index",
                    "an index entry points at another index".into(),
                ));
            }
            self.content.write(&m.digest, &m.bytes)?;
            blobs.insert(m.digest.clone());
            (m, doc)
        } else {
            (top.clone(), top_doc)
        };

        let config_desc = doc
            .config
            .as_ref()
            .ok_or_else(|| malformed(reference, "manifest", "no config".into()))?;
        let layers = doc.layers.clone().unwrap_or_default();
        for l in &layers {
            if manifest::layer_compression(&l.media_type).is_none() {
                return Err(StoreError::UnsupportedMediaType {
                    reference: reference.to_string(),
                    media_type: l.media_type.clone(),
                });
            }
        }
        let config_digest = parse_digest(reference, &config_desc.digest)?;
        let mut layer_digests = Vec::with_capacity(layers.len());
        for l in &layers {
            layer_digests.push(parse_digest(reference, &l.digest)?);
        }
        for (d, desc) in
            std::iter::once((&config_digest, config_desc)).chain(layer_digests.iter().zip(&layers))
        {
            if desc.size < 0 {
                return Err(malformed(
                    reference,
                    "descriptor",
                    format!("negative size for {d}"),
                ));
            }
        }
        *job.parts.lock().unwrap() = std::iter::once((&config_digest, config_desc))
            .chain(layer_digests.iter().zip(&layers))
            .map(|(d, desc)| Part {
                digest: d.clone(),
                size: desc.size as u64,
                progress: None,
            })
            .collect();

        // Config first (small, and it must parse), then the layers, a bounded number at once.
        let handle = self.acquire_part(job, 0, session);
        handle.wait().await?;
        drop(handle);
        let config_bytes = self.content.read(&config_digest)?;
        let config: ImageConfigDoc = serde_json::from_slice(&config_bytes)
            .map_err(|e| malformed(reference, "image config", e.to_string()))?;
        let diff_ids = config
            .rootfs
            .as_ref()
            .map(|r| r.diff_ids.clone())
            .unwrap_or_default();
        if diff_ids.len() != layers.len() {
            return Err(malformed(
                reference,
                "image config",
                format!("{} diff_ids for {} layers", diff_ids.len(), layers.len()),
            ));
        }
        blobs.insert(config_digest.clone());

        // Downloads (a bounded number at once) and unpacking run together: each layer is applied
        // as soon as the one below it is, reading its bytes as they arrive.
        let permits = tokio::sync::Semaphore::new(self.config.max_concurrent_layers.max(1));
        // Built in a loop, not with a closure: a closure here gives the futures a higher-ranked
        // lifetime that tonic's Send bound cannot be proven for (a rustc limitation).
        let mut waits = Vec::with_capacity(layers.len());
        for i in 0..layers.len() {
            waits.push(self.fetch_part_bounded(job, i + 1, session, &permits));
        }
        let downloads = futures::future::try_join_all(waits);
        let to_apply: Vec<LayerToApply> = layers
            .iter()
            .zip(&layer_digests)
            .zip(&diff_ids)
            .map(|((l, d), diff_id)| LayerToApply {
                digest: d.clone(),
                media_type: l.media_type.clone(),
                diff_id: diff_id.clone(),
            })
            .collect();
        let unpacking = self.unpack_layers(job, reference, &config_digest, &to_apply);
        let (_, chain_id) = tokio::try_join!(downloads, unpacking)?;
        blobs.extend(layer_digests.iter().cloned());

        let (uid, username) = manifest::user_of(
            config
                .config
                .as_ref()
                .and_then(|c| c.user.as_deref())
                .unwrap_or(""),
        );
        let size = config_desc.size as u64
            + manifest.bytes.len() as u64
            + layers.iter().map(|l| l.size as u64).sum::<u64>();
        let platform = Platform {
            os: config.os.clone(),
            architecture: config.architecture.clone(),
            variant: config.variant.clone(),
        };
        let record = ImageRecord {
            id: config_digest.clone(),
            repo_tags: reference.tagged().into_iter().collect(),
            repo_digests: vec![reference.with_digest(&top.digest)],
            manifest: manifest.digest.clone(),
            config: config_digest,
            layers: layers
                .iter()
                .zip(&layer_digests)
                .map(|(l, d)| LayerRecord {
                    digest: d.clone(),
                    size: l.size as u64,
                    media_type: l.media_type.clone(),
                })
                .collect(),
            diff_ids,
            size,
            uid,
            username,
            pinned: false,
            platform: platform.to_string(),
            blobs,
            chain_id,
            pulled_at: chrono::Utc::now(),
        };
        // An image removed while this pull reused its blobs lost them: fetch those again.
        for _ in 0..3 {
            match self.images.add(record.clone(), &self.content) {
                Err(StoreError::BlobNotFound(b)) => {
                    tracing::info!(image = %reference, blob = %b, "content removed during pull; fetching again");
                    for i in 0..=layers.len() {
                        self.fetch_part(job, i, session).await?;
                    }
                }
                Ok((stored, removed)) => {
                    for old in &removed.images {
                        tracing::info!(image = %old.id, "image lost its last name to a newer pull and was removed");
                    }
                    self.release_snapshots(&removed.images);
                    return Ok(stored);
                }
                Err(e) => return Err(e),
            }
        }
        Err(StoreError::Unavailable {
            reference: reference.to_string(),
            reason: "content kept being removed during the pull".into(),
        })
    }

    async fn fetch_part_bounded(
        &self,
        job: &Job,
        i: usize,
        session: &Arc<Session>,
        permits: &tokio::sync::Semaphore,
    ) -> Result<()> {
        let _permit = permits.acquire().await.expect("never closed");
        self.fetch_part(job, i, session).await
    }

    /// Applies the layers bottom to top as their bytes arrive; the top chain id, if unpacking.
    async fn unpack_layers(
        &self,
        job: &Job,
        reference: &Reference,
        image_id: &Digest,
        layers: &[LayerToApply],
    ) -> Result<Option<String>> {
        let Some(snap) = &self.snapshotter else {
            return Ok(None);
        };
        let mut parent = None;
        for (i, layer) in layers.iter().enumerate() {
            // Wait for the layer's download to be registered (or its blob to be present).
            let progress = loop {
                if let Some(p) = job.parts.lock().unwrap()[i + 1].progress.clone() {
                    break Some(p);
                }
                if self.content.size(&layer.digest).is_some() {
                    break None;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            };
            let chain = unpack::apply_layer(
                snap,
                &self.content,
                &reference.to_string(),
                image_id.as_str(),
                layer,
                parent,
                progress,
            )
            .await?;
            parent = Some(chain);
        }
        Ok(parent)
    }

    fn acquire_part(&self, job: &Job, i: usize, session: &Arc<Session>) -> BlobHandle {
        let (digest, size) = {
            let parts = job.parts.lock().unwrap();
            (parts[i].digest.clone(), parts[i].size)
        };
        let handle = self.blobs.acquire(&digest, size, session);
        job.parts.lock().unwrap()[i].progress = Some(handle.progress().clone());
        handle
    }

    async fn fetch_part(&self, job: &Job, i: usize, session: &Arc<Session>) -> Result<()> {
        let handle = self.acquire_part(job, i, session);
        handle.wait().await
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
            },
            None => PartSnapshot {
                digest: p.digest.to_string(),
                size: p.size,
                done: 0,
                resumed_from: 0,
                state: "waiting".into(),
                bytes_per_second: 0.0,
            },
        })
        .collect();
    let (done, total, downloaded, _) = j.bytes();
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
        image: j.reference.clone(),
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
            })
            .collect(),
        parts,
        bytes_done: done,
        bytes_total: total,
        bytes_per_second: if secs > 0.0 {
            downloaded as f64 / secs
        } else {
            0.0
        },
        started_at: j.started_at,
    }
}

fn select_platform<'a>(
    want: &Platform,
    reference: &Reference,
    index: &'a ManifestDoc,
) -> Result<&'a Descriptor> {
    let entries = index.manifests.as_deref().unwrap_or_default();
    entries
        .iter()
        .filter(|e| {
            e.media_type.is_empty()
                || e.media_type == manifest::OCI_MANIFEST
                || e.media_type == manifest::DOCKER_MANIFEST
        })
        .find(|e| e.platform.as_ref().is_some_and(|p| want.matches(p)))
        .ok_or_else(|| StoreError::NoMatchingPlatform {
            reference: reference.to_string(),
            platform: want.to_string(),
            available: entries
                .iter()
                .filter_map(|e| e.platform.as_ref().map(ToString::to_string))
                .collect::<Vec<_>>()
                .join(", "),
        })
}

fn malformed(reference: &Reference, what: &str, reason: String) -> StoreError {
    StoreError::Malformed {
        reference: reference.to_string(),
        what: what.into(),
        reason,
    }
}

fn parse_digest(reference: &Reference, s: &str) -> Result<Digest> {
    Digest::parse(s).map_err(|e| malformed(reference, "descriptor", e.to_string()))
}

fn parse_manifest(reference: &Reference, bytes: &[u8]) -> Result<ManifestDoc> {
    let doc: ManifestDoc = serde_json::from_slice(bytes)
        .map_err(|e| malformed(reference, "manifest", e.to_string()))?;
    if doc.schema_version == Some(1) {
        return Err(StoreError::UnsupportedMediaType {
            reference: reference.to_string(),
            media_type: "application/vnd.docker.distribution.manifest.v1+json (Docker schema 1)"
                .into(),
        });
    }
    if let Some(mt) = &doc.media_type
        && ![
            manifest::OCI_INDEX,
            manifest::DOCKER_LIST,
            manifest::OCI_MANIFEST,
            manifest::DOCKER_MANIFEST,
        ]
        .contains(&mt.as_str())
    {
        return Err(StoreError::UnsupportedMediaType {
            reference: reference.to_string(),
            media_type: mt.clone(),
        });
    }
    if doc.manifests.is_none() && doc.config.is_none() {
        return Err(malformed(
            reference,
            "manifest",
            "neither an index nor an image manifest".into(),
        ));
    }
    Ok(doc)
}

//! Blob downloads: one per blob node-wide, shared by every pull that needs the blob, resumable,
//! and stopped when the last pull that wants it lets go.
//!
//! [`BlobDownloads::acquire`] returns a [`BlobHandle`]; handles of one blob share one download task.
//! Dropping the last handle of an unfinished download cancels it: its HTTP transfer stops at once
//! and the bytes already received stay in the ingest area, from where the next download of the
//! blob continues with HTTP Range requests for what is missing. A large blob is fetched as
//! chunk-sized pieces over several requests at once ([`RangedFetch`]), once the first answer shows
//! the registry honours ranges (one that sends the whole blob instead gets one stream); the
//! ingest hashes the contiguous prefix as it grows, and a reader following the download reads
//! only that prefix. Transient failures (connection errors, 5xx, a body cut short) are retried
//! with back-off inside the download, resuming each piece where it stopped; the count of failures
//! resets whenever bytes arrive that the next request goes on from (never for a registry that
//! ignores Range: its bodies cut short fail the download after the retries). The node's transfer
//! connections are shared between the requesters that want downloads by the fair scheduler ([`crate::sched`]): each request holds a lease, which
//! the scheduler may revoke for a fairer share; a revoked request stops and its piece is resumed
//! later from where it stopped. Blobs up to [`TransferConfig::small_blob_bytes`] have a lane of
//! their own, so they never wait behind large transfers.
//!
//! A download that resumed partial data from an earlier attempt (possibly written from another
//! registry: the ingest records which endpoints wrote it) and then fails its digest is not
//! trusted: its data is dropped and the blob is fetched once more from byte 0 with the first
//! requester's registry before the download fails.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use futures::future::BoxFuture;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::Instant;

use crate::sched::{Demand, Flow, Lease, MAX_STRIKES, Scheduler};
use tokio_util::sync::CancellationToken;

use crate::content::{BlobKey, ContentStore, Ingest};
use crate::digest::Digest;
use crate::error::{Result, StoreError};
use crate::registry::{BlobBody, Session};

/// Consecutive failures without progress after which a blob download gives up.
const BLOB_RETRIES: u32 = 5;
/// A shared download leaves its current registry for another requester's when, with one waiting,
/// the current one delivered less than [`SLOW_SOURCE_BYTES`] in a window of this length: a
/// registry that trickles bytes (just above the pull speed minimum, say) must not hold every
/// other pull of the same blob to its pace.
const SLOW_SOURCE_WINDOW: Duration = Duration::from_secs(10);
/// See [`SLOW_SOURCE_WINDOW`]: 1 MiB per 10 s window.
const SLOW_SOURCE_BYTES: u64 = 1 << 20;
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// Where a download gets a blob's bytes: a pull's registry session
/// ([`Session`]) on a node, a simulated registry in the simulation of
/// the pull engine. The seam between the downloads and the network.
pub trait BlobSource: Send + Sync {
    /// The image reference it serves, for messages.
    fn reference(&self) -> String;
    /// Sources with the same key fetch from the same endpoints with the same credentials: a
    /// failure of one is a failure of all.
    fn source_key(&self) -> [u8; 32];
    /// Opens `length` bytes of `digest` from byte `offset` (a source that ignores ranges
    /// answers with the whole blob: [`BlobBody::resumed`] says which); the endpoint named
    /// `last_resort`, whose body broke off, is tried after every other.
    fn blob<'a>(
        &'a self,
        digest: &'a Digest,
        offset: u64,
        length: u64,
        last_resort: Option<&'a str>,
    ) -> BoxFuture<'a, Result<BlobBody>>;
}

/// A session is where a pull's blob downloads get their bytes.
impl BlobSource for Session {
    fn reference(&self) -> String {
        Session::reference(self).to_string()
    }

    fn source_key(&self) -> [u8; 32] {
        self.source()
    }

    fn blob<'a>(
        &'a self,
        digest: &'a Digest,
        offset: u64,
        length: u64,
        last_resort: Option<&'a str>,
    ) -> BoxFuture<'a, Result<BlobBody>> {
        Box::pin(async move {
            Session::blob(self, digest, offset, length, last_resort)
                .await
                .map_err(|e| self.fold_errors("blob", e))
        })
    }
}

/// Appends `source` to `sources` unless one with its key is there; whether it did.
pub fn add_distinct<S: BlobSource + ?Sized>(sources: &mut Vec<Arc<S>>, source: &Arc<S>) -> bool {
    if sources
        .iter()
        .any(|s| s.source_key() == source.source_key())
    {
        return false;
    }
    sources.push(source.clone());
    true
}

/// Where a blob download stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum BlobState {
    /// Waiting for a transfer slot.
    Queued = 0,
    Downloading = 1,
    /// All bytes received; checking the digest and committing.
    Verifying = 2,
    Done = 3,
    Failed = 4,
    /// Stopped because nobody wants it any more; its partial data is kept.
    Cancelled = 5,
}

impl BlobState {
    fn from_u8(v: u8) -> BlobState {
        match v {
            0 => BlobState::Queued,
            1 => BlobState::Downloading,
            2 => BlobState::Verifying,
            3 => BlobState::Done,
            4 => BlobState::Failed,
            _ => BlobState::Cancelled,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            BlobState::Queued => "queued",
            BlobState::Downloading => "downloading",
            BlobState::Verifying => "verifying",
            BlobState::Done => "done",
            BlobState::Failed => "failed",
            BlobState::Cancelled => "cancelled",
        }
    }
}

/// Live progress of one blob, readable while it downloads.
#[derive(Debug)]
pub struct BlobProgress {
    pub digest: Digest,
    pub total: u64,
    /// Bytes on disk (resumed bytes included).
    done: AtomicU64,
    /// Bytes that were already on disk when this download started.
    resumed_from: AtomicU64,
    /// Bytes received from the network by this download.
    downloaded: AtomicU64,
    /// Bytes of the ingest file on disk (what a reader following it can read).
    written: AtomicU64,
    state: AtomicU8,
    started: Instant,
    /// The endpoint the current (or last) request went to.
    source: Mutex<Option<String>>,
    /// Taken, then notified, after every change of `written` or `state`
    /// ([`BlobProgress::wait_until`]).
    changes: (Mutex<()>, std::sync::Condvar),
    /// Notified after every change of `state`, for async waiters ([`BlobProgress::ended`]).
    state_changed: tokio::sync::Notify,
    /// The download's claim on the transfer scheduler.
    flow: Arc<Flow>,
    /// Bytes fetched again from byte 0 after resumed data failed its digest.
    refetched: AtomicU64,
    /// Set while that second download runs.
    refetching: std::sync::atomic::AtomicBool,
}

impl BlobProgress {
    fn new(digest: Digest, total: u64) -> BlobProgress {
        BlobProgress {
            digest,
            total,
            done: AtomicU64::new(0),
            resumed_from: AtomicU64::new(0),
            downloaded: AtomicU64::new(0),
            written: AtomicU64::new(0),
            state: AtomicU8::new(BlobState::Queued as u8),
            started: Instant::now(),
            source: Mutex::new(None),
            changes: (Mutex::new(()), std::sync::Condvar::new()),
            state_changed: tokio::sync::Notify::new(),
            flow: Flow::new(),
            refetched: AtomicU64::new(0),
            refetching: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Requests transferring this blob's bytes now (each holds a transfer slot). A download with
    /// none is waiting for a slot, not stalled.
    pub fn connections(&self) -> usize {
        self.flow.connections()
    }

    /// The download's claim on the transfer scheduler (the simulation watches it).
    #[cfg(test)]
    pub(crate) fn flow(&self) -> &Arc<Flow> {
        &self.flow
    }

    /// Bytes downloaded again from byte 0 because resumed data failed the digest.
    pub fn refetched(&self) -> u64 {
        self.refetched.load(Ordering::Relaxed)
    }

    /// Bytes of the ingest file on disk.
    pub fn written(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    fn set_written(&self, n: u64) {
        self.written.store(n, Ordering::Relaxed);
        self.changed();
    }

    fn changed(&self) {
        let _g = self.changes.0.lock().unwrap_or_else(|p| p.into_inner());
        self.changes.1.notify_all();
    }

    /// Blocks (a blocking thread, not an async worker) until `ready` holds, checked now and after
    /// each change the download reports (bytes on disk, state), or until `timeout`; whether it
    /// holds.
    pub fn wait_until(&self, timeout: Duration, ready: impl Fn(&BlobProgress) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        let mut g = self.changes.0.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if ready(self) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            g = self
                .changes
                .1
                .wait_timeout(g, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    /// The blob as its descriptor names it.
    pub fn key(&self) -> BlobKey {
        BlobKey::new(self.digest.clone(), self.total)
    }

    pub fn resumed_from(&self) -> u64 {
        self.resumed_from.load(Ordering::Relaxed)
    }

    /// The endpoint the bytes come from (or last came from), `http(s)://host[:port]`.
    pub fn source(&self) -> Option<String> {
        self.source
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn set_source(&self, endpoint: &str) {
        *self.source.lock().unwrap_or_else(|p| p.into_inner()) = Some(endpoint.to_string());
    }

    pub fn downloaded(&self) -> u64 {
        self.downloaded.load(Ordering::Relaxed)
    }

    pub fn state(&self) -> BlobState {
        BlobState::from_u8(self.state.load(Ordering::Relaxed))
    }

    fn set_state(&self, s: BlobState) {
        self.state.store(s as u8, Ordering::Relaxed);
        self.changed();
        self.state_changed.notify_waiters();
    }

    /// Whether the download has ended: committed, failed or cancelled.
    pub fn ended_now(&self) -> bool {
        matches!(
            self.state(),
            BlobState::Done | BlobState::Failed | BlobState::Cancelled
        )
    }

    /// Waits until the download has ended: committed, failed or cancelled.
    pub async fn ended(&self) {
        loop {
            // Created before the state is read: a notify_waiters in between still wakes it.
            let notified = self.state_changed.notified();
            if self.ended_now() {
                return;
            }
            notified.await;
        }
    }

    /// Network bytes per second since this download started.
    pub fn speed(&self) -> f64 {
        let secs = self.started.elapsed().as_secs_f64();
        if secs > 0.0 {
            self.downloaded() as f64 / secs
        } else {
            0.0
        }
    }
}

struct BlobDownload {
    progress: Arc<BlobProgress>,
    cancel: CancellationToken,
    /// Handles alive; guarded by the `inflight` map's lock.
    interest: Mutex<usize>,
    result: watch::Receiver<Option<Result<(), Arc<StoreError>>>>,
    /// The sources of the requesters, one per key ([`BlobSource::source_key`]), in the order
    /// they came: when the download fails with one, it goes on with the next.
    sessions: Mutex<Vec<Arc<dyn BlobSource>>>,
}

impl BlobDownload {
    /// Adds `session` unless one of the same source is there.
    fn add_session(&self, session: &Arc<dyn BlobSource>) {
        add_distinct(&mut self.sessions.lock().unwrap(), session);
    }
}

/// Node-wide registry of blob downloads.
pub struct BlobDownloads {
    content: Arc<ContentStore>,
    /// Keyed by digest and size: a descriptor with a wrong size gets a download of its own.
    inflight: Mutex<HashMap<BlobKey, Arc<BlobDownload>>>,
    /// Slots for blobs larger than `small_blob_bytes`.
    large: Arc<Scheduler>,
    /// Slots for the small ones (manifests are not blobs here: they take none).
    small: Arc<Scheduler>,
    small_blob_bytes: u64,
    ranged: RangedFetch,
    file_work: FileWork,
    /// Blobs whose partial data a running pull still wants though no download of them runs (its
    /// layer unpacks read what was downloaded), with how many pins each: not collected.
    pins: Mutex<HashMap<BlobKey, usize>>,
}

/// Keeps the partial data of some blobs from the collector while it lives
/// ([`BlobDownloads::pin`]).
pub struct Pinned {
    downloads: Arc<BlobDownloads>,
    keys: Vec<BlobKey>,
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let mut pins = self.downloads.pins.lock().unwrap();
        for k in &self.keys {
            if let Some(n) = pins.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    pins.remove(k);
                }
            }
        }
    }
}

/// Where a download's file work (opening, writing, committing its ingest) runs: on blocking
/// threads in the daemon, so that writes, hashing and fsync stay off the async workers; inline
/// in the simulation of the pull engine, whose paused clock stands still while a blocking thread
/// runs (its files are small, on a tmpfs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FileWork {
    #[default]
    Threads,
    Inline,
}

impl FileWork {
    async fn run<T: Send + 'static>(self, f: impl FnOnce() -> T + Send + 'static) -> T {
        match self {
            FileWork::Threads => tokio::task::spawn_blocking(f)
                .await
                .expect("a download's file work does not panic"),
            FileWork::Inline => f(),
        }
    }
}

/// How many requests may transfer blob bytes at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferConfig {
    /// Requests transferring bytes of large blobs at once on the node (a blob fetched over
    /// several ranged requests holds one per request).
    pub max_transfers: usize,
    /// Blobs of at most this size (configs, small layers) use a lane of their own, with as many
    /// slots again: they never wait behind large transfers.
    pub small_blob_bytes: u64,
}

impl Default for TransferConfig {
    fn default() -> Self {
        TransferConfig {
            max_transfers: 8,
            small_blob_bytes: DEFAULT_SMALL_BLOB_BYTES,
        }
    }
}

/// Default [`TransferConfig::small_blob_bytes`]: 4 MiB, more than any image config and the size
/// of the small layers (certificates, a binary, a configuration file) a pod should not wait for.
pub const DEFAULT_SMALL_BLOB_BYTES: u64 = 4 << 20;

/// A claim on a blob download. The download runs while at least one handle is alive.
pub struct BlobHandle {
    downloads: Arc<BlobDownloads>,
    dl: Arc<BlobDownload>,
    demand: Arc<Demand>,
}

impl BlobDownloads {
    pub fn new(
        content: Arc<ContentStore>,
        transfers: TransferConfig,
        ranged: RangedFetch,
    ) -> Arc<BlobDownloads> {
        Self::with_file_work(content, transfers, ranged, FileWork::Threads)
    }

    /// [`BlobDownloads::new`], with the file work done where `file_work` says.
    pub fn with_file_work(
        content: Arc<ContentStore>,
        transfers: TransferConfig,
        ranged: RangedFetch,
        file_work: FileWork,
    ) -> Arc<BlobDownloads> {
        Arc::new(BlobDownloads {
            content,
            inflight: Mutex::new(HashMap::new()),
            large: Scheduler::new(transfers.max_transfers),
            small: Scheduler::new(transfers.max_transfers),
            small_blob_bytes: transfers.small_blob_bytes,
            ranged,
            file_work,
            pins: Mutex::new(HashMap::new()),
        })
    }

    /// Keeps the partial data of `keys` from the collector until the guard drops: a pull holds
    /// it while it runs, so that a download of its that failed (at the reserve, say) keeps what
    /// it has for a resume while the pull's unpacks still read it, instead of being taken as
    /// idle data to make room for those very unpacks.
    pub fn pin(self: &Arc<Self>, keys: Vec<BlobKey>) -> Pinned {
        let mut pins = self.pins.lock().unwrap();
        for k in &keys {
            *pins.entry(k.clone()).or_default() += 1;
        }
        Pinned {
            downloads: self.clone(),
            keys,
        }
    }

    /// The scheduler of large blobs' transfers, and the one of small blobs'.
    pub fn schedulers(&self) -> (&Arc<Scheduler>, &Arc<Scheduler>) {
        (&self.large, &self.small)
    }

    /// Joins the download of `digest` of `size` bytes for the requesters of `demand`, starting
    /// it (with the first of `sessions`) if none is running; the other sessions are where it goes
    /// on when one fails.
    ///
    /// Downloads are keyed by digest and size: a descriptor that gives a blob's digest with
    /// another size (one of the two is wrong) downloads on its own, into partial data of its own,
    /// so the wrong one can neither decide the other's result nor stall or discard its bytes.
    pub fn acquire(
        self: &Arc<Self>,
        digest: &Digest,
        size: u64,
        sessions: &[Arc<dyn BlobSource>],
        demand: &Arc<Demand>,
    ) -> Result<BlobHandle> {
        let session = sessions.first().expect("a blob is fetched with a session");
        let key = BlobKey::new(digest.clone(), size);
        let mut inflight = self.inflight.lock().unwrap();
        if let Some(dl) = inflight.get(&key).filter(|d| !d.cancel.is_cancelled()) {
            *dl.interest.lock().unwrap() += 1;
            for s in sessions {
                dl.add_session(s);
            }
            dl.progress.flow.add_demand(demand);
            return Ok(BlobHandle {
                downloads: self.clone(),
                dl: dl.clone(),
                demand: demand.clone(),
            });
        }
        let progress = Arc::new(BlobProgress::new(digest.clone(), size));
        progress.flow.add_demand(demand);
        let cancel = CancellationToken::new();
        let (tx, rx) = watch::channel(None);
        let dl = Arc::new(BlobDownload {
            progress: progress.clone(),
            cancel: cancel.clone(),
            interest: Mutex::new(1),
            result: rx,
            sessions: Mutex::new(vec![session.clone()]),
        });
        for s in &sessions[1..] {
            dl.add_session(s);
        }
        inflight.insert(key, dl.clone());
        drop(inflight);

        let this = self.clone();
        let me = dl.clone();
        let lane = if size <= self.small_blob_bytes {
            self.small.clone()
        } else {
            self.large.clone()
        };
        tokio::spawn(async move {
            // A task dropped unfinished (the runtime shutting down) still tells the readers
            // following the download that it ended.
            let _ended = CancelledOnDrop(progress.clone());
            // With the first requester's session; when that fails, with the next requester's of
            // another source (other registry, mirror or credentials), from the bytes on disk.
            let mut used = 0;
            // Resumed data failing the digest gets one more download from byte 0.
            let mut refetched = false;
            let result = loop {
                let session = me.sessions.lock().unwrap()[used].clone();
                // Biased (here and below): the same events in the same order give the same
                // outcome, which the simulation of the pull engine relies on.
                let result = tokio::select! {
                    biased;
                    _ = cancel.cancelled() => Err(StoreError::Cancelled(format!("download of {} stopped: no pull wants it", progress.digest))),
                    r = fetch(&this.content, &*session, &progress, &lane, this.ranged, this.file_work) => r,
                    _ = slow_while_another_waits(&me, used) => Err(StoreError::Unavailable {
                        reference: session.reference(),
                        reason: format!(
                            "under {SLOW_SOURCE_BYTES} bytes in {SLOW_SOURCE_WINDOW:?} while another requester's registry could serve the blob"
                        ),
                    }),
                };
                let next = me.sessions.lock().unwrap().len() > used + 1;
                match result {
                    // The commit dropped the data; the next fetch starts from byte 0.
                    Err(e @ StoreError::DigestMismatch { .. })
                        if !refetched && progress.resumed_from() > 0 =>
                    {
                        refetched = true;
                        used = 0;
                        progress.refetching.store(true, Ordering::Relaxed);
                        tracing::warn!(blob = %progress.digest, resumed_bytes = progress.resumed_from(), error = %e, refetch_from = %me.sessions.lock().unwrap()[0].reference(), "resumed partial data failed the digest; dropped, fetching the blob again from byte 0");
                    }
                    // Another registry helps with neither a stop nor a full disk.
                    Err(e)
                        if next
                            && !matches!(
                                e,
                                StoreError::Cancelled(_) | StoreError::ImageFsReserve { .. }
                            ) =>
                    {
                        used += 1;
                        tracing::warn!(blob = %progress.digest, failed = %session.reference(), next = %me.sessions.lock().unwrap()[used].reference(), error = %e, "blob download failed for one requester; going on with another's registry session");
                    }
                    r => break r,
                }
            };
            progress.set_state(match &result {
                Ok(()) => BlobState::Done,
                Err(StoreError::Cancelled(_)) => BlobState::Cancelled,
                Err(_) => BlobState::Failed,
            });
            {
                let mut inflight = this.inflight.lock().unwrap();
                let key = progress.key();
                if inflight.get(&key).is_some_and(|d| Arc::ptr_eq(d, &me)) {
                    inflight.remove(&key);
                }
            }
            let _ = tx.send(Some(result.map_err(Arc::new)));
        });
        Ok(BlobHandle {
            downloads: self.clone(),
            dl,
            demand: demand.clone(),
        })
    }

    /// Adds `session` to the ones the running download of `key` may go on with.
    pub fn add_session(&self, key: &BlobKey, session: &Arc<dyn BlobSource>) {
        if let Some(dl) = self.inflight.lock().unwrap().get(key) {
            dl.add_session(session);
        }
    }

    /// Removes the partial data of `key` unless a download wants it (running, or waiting for a
    /// slot); whether it did. Blocking.
    pub fn remove_idle(&self, key: &BlobKey, reason: &str, bytes: u64) -> bool {
        // The download's writer holds the ingest's lock from before it opens the ingest until the
        // blob is committed, so the lock, held while removing, is what keeps an ingest in use
        // from going; the map says whether a download waiting for a slot wants it.
        if self.inflight.lock().unwrap().contains_key(key)
            || self.pins.lock().unwrap().contains_key(key)
        {
            return false;
        }
        let Some(_ingest) = self.content.try_lock_ingest(key) else {
            return false;
        };
        if let Err(e) = self.content.remove_ingest(key) {
            tracing::warn!(blob = %key, error = %e, "cannot remove partial download");
            return false;
        }
        tracing::info!(blob = %key, bytes, reason, "removed partial download");
        true
    }

    /// Blobs with a download running now, or pinned by a running pull (their ingests must not
    /// be collected).
    pub fn active(&self) -> Vec<BlobKey> {
        let mut keys: Vec<BlobKey> = self.inflight.lock().unwrap().keys().cloned().collect();
        for k in self.pins.lock().unwrap().keys() {
            if !keys.contains(k) {
                keys.push(k.clone());
            }
        }
        keys
    }
}

impl BlobHandle {
    pub fn progress(&self) -> &Arc<BlobProgress> {
        &self.dl.progress
    }

    /// Waits until the blob is committed or its download failed.
    pub async fn wait(&self) -> Result<()> {
        let mut rx = self.dl.result.clone();
        let r = rx
            .wait_for(Option::is_some)
            .await
            .map_err(|_| StoreError::Cancelled("blob download vanished".into()))?;
        match r.as_ref().expect("checked") {
            Ok(()) => Ok(()),
            Err(e) => Err(StoreError::Shared(e.clone())),
        }
    }
}

impl Drop for BlobHandle {
    fn drop(&mut self) {
        self.dl.progress.flow.remove_demand(&self.demand);
        let mut inflight = self.downloads.inflight.lock().unwrap();
        let mut interest = self.dl.interest.lock().unwrap();
        *interest -= 1;
        if *interest == 0 && self.dl.result.borrow().is_none() {
            // Nobody wants it: stop the transfer now; the partial data stays for a later resume.
            self.dl.cancel.cancel();
            let key = self.dl.progress.key();
            if inflight.get(&key).is_some_and(|d| Arc::ptr_eq(d, &self.dl)) {
                inflight.remove(&key);
            }
        }
    }
}

/// Marks a download that has not ended as cancelled when dropped.
struct CancelledOnDrop(Arc<BlobProgress>);

impl Drop for CancelledOnDrop {
    fn drop(&mut self) {
        if !self.0.ended_now() {
            self.0.set_state(BlobState::Cancelled);
        }
    }
}

/// How one blob is fetched: a large one over several ranged requests at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RangedFetch {
    /// Bytes asked for by one ranged request.
    pub chunk_size: u64,
    /// Requests one blob may have open at once; each holds a node-wide transfer slot
    /// (1: one stream per blob).
    pub connections: usize,
}

impl Default for RangedFetch {
    fn default() -> Self {
        RangedFetch {
            chunk_size: 32 * 1024 * 1024,
            connections: 6,
        }
    }
}

impl RangedFetch {
    /// The pieces, in blob order, that fetch the `missing` ranges: chunk-sized when there are
    /// at least two chunks' worth and more than one connection, else one per range.
    fn pieces(&self, missing: &[(u64, u64)]) -> Vec<Piece> {
        let total: u64 = missing.iter().map(|(s, e)| e - s).sum();
        let step = if self.connections > 1 && total >= 2 * self.chunk_size.max(1) {
            self.chunk_size.max(1)
        } else {
            u64::MAX
        };
        let mut out = Vec::new();
        for &(s, e) in missing {
            let mut at = s;
            while at < e {
                let end = at.saturating_add(step).min(e);
                out.push(Piece {
                    pos: at,
                    end,
                    busy: false,
                });
                at = end;
            }
        }
        out
    }
}

/// A range of the blob that one request at a time fetches; `pos` is how far it got.
#[derive(Debug, Clone, Copy)]
struct Piece {
    pos: u64,
    end: u64,
    busy: bool,
}

/// Bytes of one blob received and not yet written, at most: the writer's queue is bounded by
/// bytes, not only by messages (one chunk can be as large as the HTTP client's read buffer, and
/// a blob's connections all feed one writer).
const QUEUED_BYTES: u32 = 2 * 1024 * 1024;

enum WriterMsg {
    /// `bytes` at `at`; `_queued` holds their share of [`QUEUED_BYTES`] until they are written.
    Data {
        at: u64,
        bytes: Bytes,
        _queued: OwnedSemaphorePermit,
    },
    Restart,
    /// The endpoint whose bytes come next.
    Source(String),
}

fn writer_gone() -> StoreError {
    StoreError::io(
        "ingest writer stopped",
        std::io::Error::other("writer thread ended"),
    )
}

/// One download of one blob: its pieces and the requests fetching them.
struct Transfer<'a> {
    session: &'a dyn BlobSource,
    progress: &'a BlobProgress,
    lane: &'a Arc<Scheduler>,
    tx: tokio::sync::mpsc::Sender<WriterMsg>,
    /// [`QUEUED_BYTES`] of permits: what the writer has yet to write.
    queued: Arc<Semaphore>,
    pieces: Mutex<Vec<Piece>>,
    /// Failures in a row without a byte arriving, and the back-off before the next request.
    failures: Mutex<(u32, Duration)>,
    /// The endpoint whose body broke off last: the next request tries the others first (a
    /// mirror failing mid-blob hands the rest of it to the next host, from the bytes on disk).
    broke_off: Mutex<Option<String>>,
    /// Whether the registry answers ranged requests with the range (known after the first
    /// answer; requests beyond the first wait for it).
    ranged: watch::Sender<Option<bool>>,
    /// The endpoint the ingest was last told writes its bytes ([`WriterMsg::Source`]).
    writing_from: Mutex<Option<String>>,
    /// Cancelled once every piece is claimed: extra connections still waiting for a transfer
    /// slot give up then (a connection whose slot was revoked returned its piece, and asks again
    /// whatever this says).
    drained: CancellationToken,
}

/// How a connection's run of pieces ended.
enum Run {
    /// No piece is left to claim.
    Done,
    /// The scheduler took the slot back; the piece in flight was returned.
    Revoked,
}

impl Transfer<'_> {
    fn claim(&self) -> Option<usize> {
        let mut pieces = self.pieces.lock().unwrap();
        let Some(i) = pieces.iter().position(|p| !p.busy && p.pos < p.end) else {
            self.drained.cancel();
            return None;
        };
        pieces[i].busy = true;
        Some(i)
    }

    fn piece(&self, i: usize) -> Piece {
        self.pieces.lock().unwrap()[i]
    }

    /// One connection: fetches pieces until none is left, with a transfer slot from the
    /// scheduler, asking again when the slot is revoked. `first` is the request that learns
    /// whether the registry honours ranges; further connections start only once it does.
    async fn worker(&self, first: bool) -> Result<()> {
        if !first {
            let mut ranged = self.ranged.subscribe();
            let works = tokio::select! {
                biased;
                known = ranged.wait_for(Option::is_some) => matches!(known.as_deref(), Ok(Some(true))),
                _ = self.drained.cancelled() => false,
            };
            if !works {
                return Ok(());
            }
        }
        let mut owes_piece = false;
        loop {
            let lease = if first || owes_piece {
                self.lane.acquire(&self.progress.flow).await
            } else {
                tokio::select! {
                    biased;
                    lease = self.lane.acquire(&self.progress.flow) => lease,
                    _ = self.drained.cancelled() => return Ok(()),
                }
            };
            match self.fetch_pieces(&lease).await? {
                Run::Done => return Ok(()),
                Run::Revoked => owes_piece = true,
            }
            let flow = &self.progress.flow;
            if !flow.is_resumable() && flow.strikes() >= MAX_STRIKES {
                return Err(StoreError::Unavailable {
                    reference: self.session.reference(),
                    reason: format!(
                        "{} ignores Range requests, so its transfer of {} cannot resume; it was stopped {} times (at byte {} of {}, {}/s) to let other pulls have their transfer slots, and is given up",
                        self.progress.source().unwrap_or_default(),
                        self.progress.digest,
                        flow.strikes(),
                        self.progress.done(),
                        self.progress.total,
                        crate::text::human_bytes(self.progress.speed()),
                    ),
                });
            }
        }
    }

    async fn fetch_pieces(&self, lease: &Lease) -> Result<Run> {
        while let Some(i) = self.claim() {
            let before = self.piece(i).pos;
            let outcome = self.fetch_piece(i, lease).await;
            let piece = {
                let mut pieces = self.pieces.lock().unwrap();
                pieces[i].busy = false;
                pieces[i]
            };
            let backoff = {
                let mut f = self.failures.lock().unwrap();
                // Bytes are progress only if the next answer goes on from them: a registry that
                // ignores Range starts every answer from byte 0, so one that cuts its bodies
                // fails the download after its retries, however far each body got (else bodies
                // cut at varying points would keep it going for ever).
                if piece.pos > before && self.progress.flow.is_resumable() {
                    *f = (0, FIRST_BACKOFF);
                }
                let failure = match outcome {
                    Ok(Run::Revoked) => return Ok(Run::Revoked),
                    Ok(Run::Done) if piece.pos >= piece.end => continue,
                    Ok(Run::Done) => {
                        tracing::warn!(blob = %self.progress.digest, offset = piece.pos, end = piece.end, "blob body ended early; resuming");
                        format!("its body ended at byte {} of {}", piece.pos, piece.end)
                    }
                    Err(StoreError::Unavailable { reason, .. }) => {
                        tracing::info!(blob = %self.progress.digest, offset = piece.pos, error = %reason, "transient failure");
                        reason
                    }
                    Err(e) => return Err(e),
                };
                f.0 += 1;
                if f.0 > BLOB_RETRIES {
                    let restarts = if self.progress.flow.is_resumable() {
                        ""
                    } else {
                        " (its registry ignores Range: every answer started again from byte 0)"
                    };
                    return Err(StoreError::Unavailable {
                        reference: self.session.reference(),
                        reason: format!(
                            "blob {}: gave up after {BLOB_RETRIES} retries at byte {} of {}{restarts}; the last failure: {failure}",
                            self.progress.digest, piece.pos, self.progress.total
                        ),
                    });
                }
                let backoff = f.1;
                f.1 = (f.1 * 2).min(MAX_BACKOFF);
                tracing::info!(blob = %self.progress.digest, offset = piece.pos, failures = f.0, "retrying blob download");
                backoff
            };
            // The slot is kept through the back-off unless it is wanted elsewhere.
            tokio::select! {
                biased;
                _ = lease.revoked() => return Ok(Run::Revoked),
                _ = tokio::time::sleep(backoff) => {}
            }
        }
        Ok(Run::Done)
    }

    /// One request for what is left of piece `i`, its body written as it arrives.
    async fn fetch_piece(&self, i: usize, lease: &Lease) -> Result<Run> {
        let digest = &self.progress.digest;
        let Piece { pos, end, .. } = self.piece(i);
        let avoid = self.broke_off.lock().unwrap().clone();
        let request = self.session.blob(digest, pos, end - pos, avoid.as_deref());
        let mut body = tokio::select! {
            biased;
            _ = lease.revoked() => return Ok(Run::Revoked),
            r = request => r?,
        };
        if avoid.is_some() || pos > 0 {
            tracing::info!(blob = %digest, offset = pos, end, endpoint = %body.endpoint, "blob continues");
        }
        self.progress.set_source(&body.endpoint);
        let new_writer = {
            let mut last = self.writing_from.lock().unwrap();
            (last.as_deref() != Some(body.endpoint.as_str()))
                .then(|| last.insert(body.endpoint.clone()).clone())
        };
        if let Some(endpoint) = new_writer {
            self.tx
                .send(WriterMsg::Source(endpoint))
                .await
                .map_err(|_| writer_gone())?;
        }
        let result = self.stream_body(i, &mut body, lease).await;
        let revoked = matches!(result, Ok(Run::Revoked));
        if !revoked && (result.is_err() || self.piece(i).pos < self.piece(i).end) {
            *self.broke_off.lock().unwrap() = Some(body.endpoint.clone());
        }
        result
    }

    /// Writes the body of piece `i`'s request as it arrives; stops between chunks when the slot
    /// is revoked (only waiting for the next chunk is interrupted: a chunk received is written).
    async fn stream_body(&self, i: usize, body: &mut BlobBody, lease: &Lease) -> Result<Run> {
        let digest = &self.progress.digest;
        if body.resumed {
            self.ranged.send_if_modified(|r| r.replace(true).is_none());
            self.progress.flow.set_resumable(true);
        } else {
            // Stopping this request would lose what it brought: it keeps its slot.
            self.progress.flow.set_resumable(false);
            // The whole blob, whatever was asked for.
            let sole = self.ranged.send_if_modified(|r| r.replace(false).is_none());
            if !sole && *self.ranged.borrow() == Some(true) {
                return Err(StoreError::Unavailable {
                    reference: self.session.reference(),
                    reason: format!(
                        "{} answered a range request for {digest} with the whole blob",
                        body.endpoint
                    ),
                });
            }
            // The only request so far: take the whole blob from it, from byte 0.
            if self.progress.done() > 0 {
                tracing::info!(blob = %digest, offset = self.piece(i).pos, endpoint = %body.endpoint, "registry ignored the range request; restarting blob");
                self.tx
                    .send(WriterMsg::Restart)
                    .await
                    .map_err(|_| writer_gone())?;
            }
            self.progress.done.store(0, Ordering::Relaxed);
            self.progress.resumed_from.store(0, Ordering::Relaxed);
            // No answer came before this one, so no piece moved: the request holds the first.
            debug_assert_eq!(i, 0);
            *self.pieces.lock().unwrap() = vec![Piece {
                pos: 0,
                end: self.progress.total,
                busy: true,
            }];
        }
        loop {
            let next = tokio::select! {
                biased;
                _ = lease.revoked() => return Ok(Run::Revoked),
                next = body.stream.next() => next,
            };
            let Some(chunk) = next else { break };
            let mut chunk = chunk.map_err(|e| StoreError::Unavailable {
                reference: self.session.reference(),
                reason: format!("downloading {digest} from {}: {e}", body.endpoint),
            })?;
            let Piece { pos, end, .. } = self.piece(i);
            let n = chunk.len() as u64;
            // A body longer than the range asked for (or than the blob, for a registry that
            // sends endless bytes) is cut at its end, wherever the read boundaries fall: the
            // digest decides whether the bytes before the cut are the blob.
            if pos + n > end {
                chunk.truncate((end - pos) as usize);
            }
            let n = chunk.len() as u64;
            self.pieces.lock().unwrap()[i].pos = pos + n;
            let done = self.progress.done.fetch_add(n, Ordering::Relaxed) + n;
            self.progress
                .flow
                .set_left(self.progress.total.saturating_sub(done));
            self.progress.downloaded.fetch_add(n, Ordering::Relaxed);
            if self.progress.refetching.load(Ordering::Relaxed) {
                self.progress.refetched.fetch_add(n, Ordering::Relaxed);
            }
            lease.add_bytes(n);
            let share = u32::try_from(chunk.len()).map_or(QUEUED_BYTES, |n| n.min(QUEUED_BYTES));
            let queued = self
                .queued
                .clone()
                .acquire_many_owned(share)
                .await
                .expect("the semaphore is never closed");
            self.tx
                .send(WriterMsg::Data {
                    at: pos,
                    bytes: chunk,
                    _queued: queued,
                })
                .await
                .map_err(|_| writer_gone())?;
            if pos + n >= end {
                break;
            }
        }
        Ok(Run::Done)
    }
}

/// Resolves once the download has another requester's session to go on with (past `used`) and
/// received under [`SLOW_SOURCE_BYTES`] in the last [`SLOW_SOURCE_WINDOW`] of transfer time (time
/// spent waiting for a transfer slot is not the registry's slowness).
async fn slow_while_another_waits(dl: &BlobDownload, used: usize) {
    const SAMPLE: Duration = Duration::from_secs(1);
    let mut window = (Duration::ZERO, dl.progress.downloaded());
    loop {
        tokio::time::sleep(SAMPLE).await;
        if dl.progress.connections() > 0 {
            window.0 += SAMPLE;
        }
        if window.0 < SLOW_SOURCE_WINDOW {
            continue;
        }
        let now = dl.progress.downloaded();
        let got = now.saturating_sub(window.1);
        window = (Duration::ZERO, now);
        if got < SLOW_SOURCE_BYTES && dl.sessions.lock().unwrap().len() > used + 1 {
            return;
        }
    }
}

/// Makes sure the blob is committed, downloading what is missing.
async fn fetch(
    content: &Arc<ContentStore>,
    session: &dyn BlobSource,
    progress: &Arc<BlobProgress>,
    lane: &Arc<Scheduler>,
    ranged: RangedFetch,
    file_work: FileWork,
) -> Result<()> {
    let digest = progress.digest.clone();
    let key = progress.key();
    if let Some(done) = committed(content, progress) {
        return done;
    }
    let guard = content.lock_ingest(&key).await;
    if let Some(done) = committed(content, progress) {
        return done;
    }
    let c = content.clone();
    let k = key.clone();
    let ingest = file_work.run(move || c.open_ingest(&k)).await?;
    let on_disk = ingest.on_disk();
    let pieces = ranged.pieces(&ingest.missing());
    progress.resumed_from.store(on_disk, Ordering::Relaxed);
    progress.done.store(on_disk, Ordering::Relaxed);
    progress.written.store(ingest.offset(), Ordering::Relaxed);
    // The ingest file exists from here on: a reader waiting to follow it may open it.
    progress.set_state(BlobState::Downloading);
    if on_disk > 0 {
        let written_by = ingest.written_by().join(", ");
        tracing::info!(blob = %digest, on_disk, prefix = ingest.offset(), size = key.size, %written_by, "resuming download");
    }
    // The writer thread owns the ingest and its lock, so the lock is released only after the last
    // queued chunk is on disk, even when this future is dropped (cancelled) mid-transfer.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<WriterMsg>(32);
    let on_disk = progress.clone();
    let mut ingest: Ingest = ingest;
    let writer = match file_work {
        FileWork::Threads => tokio::task::spawn_blocking(move || {
            while let Some(msg) = rx.blocking_recv() {
                write(&mut ingest, msg, &on_disk)?;
            }
            Ok::<_, StoreError>((ingest, guard))
        }),
        FileWork::Inline => tokio::spawn(async move {
            while let Some(msg) = rx.recv().await {
                write(&mut ingest, msg, &on_disk)?;
            }
            Ok::<_, StoreError>((ingest, guard))
        }),
    };

    let connections = if pieces.len() > 1 {
        ranged.connections.max(1)
    } else {
        1
    };
    let transfer = Transfer {
        session,
        progress,
        lane,
        tx,
        queued: Arc::new(Semaphore::new(QUEUED_BYTES as usize)),
        pieces: Mutex::new(pieces),
        failures: Mutex::new((0, FIRST_BACKOFF)),
        broke_off: Mutex::new(None),
        writing_from: Mutex::new(None),
        ranged: watch::channel(None).0,
        drained: CancellationToken::new(),
    };
    let mut writer = writer;
    let early = {
        let workers =
            futures::future::try_join_all((0..connections).map(|k| transfer.worker(k == 0)));
        tokio::pin!(workers);
        tokio::select! {
            biased;
            outcome = &mut workers => Ok(outcome),
            // The writer ends before the requests only when it failed (a claim refused at the
            // reserve, a full disk): the requests stop now, not when they next have bytes to
            // write (a trickle's next chunk, or a stalled registry's never).
            written = &mut writer => Err(written.expect("writer does not panic")),
        }
    };
    let Transfer { tx, pieces, .. } = transfer;
    drop(tx);
    let (outcome, written) = match early {
        Ok(outcome) => (outcome, writer.await.expect("writer does not panic")),
        Err(written) => (Err(writer_gone()), written),
    };
    if let Err(e) = outcome {
        // The writer's own error (too many bytes, disk full) explains more.
        return Err(match written {
            Err(we) => discard_on_size_error(content, &key, we, file_work).await,
            Ok(_) => e,
        });
    }
    debug_assert!(pieces.into_inner().unwrap().iter().all(|p| p.pos >= p.end));
    let (ingest, guard) = match written {
        Ok(i) => i,
        Err(e) => return Err(discard_on_size_error(content, &key, e, file_work).await),
    };
    // Every byte is on disk now: readers following the ingest may read to its end.
    progress.set_state(BlobState::Verifying);
    let c = content.clone();
    // The ingest stays locked until it is committed (or its commit failed), even if this future
    // is dropped meanwhile: a new download of the blob must not reopen the file being committed,
    // nor the collector remove it.
    file_work
        .run(move || {
            let _guard = guard;
            ingest.commit(&c)
        })
        .await
}

/// The writer's work for one message.
fn write(ingest: &mut Ingest, msg: WriterMsg, progress: &BlobProgress) -> Result<()> {
    match msg {
        WriterMsg::Data { at, bytes, .. } => ingest.write_at(at, &bytes)?,
        WriterMsg::Restart => ingest.restart()?,
        WriterMsg::Source(endpoint) => ingest.record_writer(&endpoint)?,
    }
    if ingest.offset() != progress.written() {
        progress.set_written(ingest.offset());
    }
    Ok(())
}

/// The answer for a blob already committed: done, or (committed blobs were checked against their
/// digest, so their size is the blob's) a descriptor giving it another size is wrong, with no
/// byte fetched. None if it is not committed.
fn committed(content: &ContentStore, progress: &BlobProgress) -> Option<Result<()>> {
    let have = content.size(&progress.digest)?;
    if have != progress.total {
        return Some(Err(StoreError::SizeMismatch {
            digest: progress.digest.to_string(),
            expected: progress.total,
            actual: have,
        }));
    }
    progress.done.store(have, Ordering::Relaxed);
    Some(Ok(()))
}

/// Bytes beyond the descriptor's size mean the partial data is not a prefix of the blob: drop it,
/// on a blocking thread (it can be as large as the descriptor claims).
async fn discard_on_size_error(
    content: &Arc<ContentStore>,
    key: &BlobKey,
    e: StoreError,
    file_work: FileWork,
) -> StoreError {
    if matches!(e, StoreError::SizeMismatch { .. }) {
        let (c, k) = (content.clone(), key.clone());
        let _ = file_work.run(move || c.remove_ingest(&k)).await;
    }
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn ended_wakes_its_waiter_when_the_download_ends_and_not_before() {
        let p = Arc::new(BlobProgress::new(Digest::of(b"blob"), 4));
        let waiter = tokio::spawn({
            let p = p.clone();
            async move { p.ended().await }
        });
        p.set_state(BlobState::Downloading);
        p.set_written(2);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished(), "still downloading");
        p.set_state(BlobState::Done);
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("woken by the end")
            .unwrap();
        // An ended download answers at once.
        tokio::time::timeout(Duration::from_secs(5), p.ended())
            .await
            .unwrap();
    }

    fn ranges(pieces: &[Piece]) -> Vec<(u64, u64)> {
        pieces.iter().map(|p| (p.pos, p.end)).collect()
    }

    #[test]
    fn large_missing_ranges_split_into_chunks_small_ones_stay_whole() {
        let r = RangedFetch {
            chunk_size: 10,
            connections: 4,
        };
        assert_eq!(
            ranges(&r.pieces(&[(0, 25)])),
            vec![(0, 10), (10, 20), (20, 25)]
        );
        // Gaps left by an earlier download, chunked within each gap.
        assert_eq!(
            ranges(&r.pieces(&[(5, 17), (30, 40)])),
            vec![(5, 15), (15, 17), (30, 40)]
        );
        // Less than two chunks in all, or one connection: one piece per range.
        assert_eq!(ranges(&r.pieces(&[(0, 19)])), vec![(0, 19)]);
        let one = RangedFetch {
            connections: 1,
            ..r
        };
        assert_eq!(ranges(&one.pieces(&[(0, 100)])), vec![(0, 100)]);
        assert!(r.pieces(&[]).is_empty());
    }
}

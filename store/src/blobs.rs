//! Blob downloads: one per blob node-wide, shared by every pull that needs the blob, resumable,
//! and stopped when the last pull that wants it lets go.
//!
//! [`BlobDownloads::acquire`] returns a [`BlobHandle`]; handles of one blob share one download task.
//! Dropping the last handle of an unfinished download cancels it: its HTTP transfer stops at once
//! and the bytes already received stay in the ingest area, from where the next download of the
//! blob continues with an HTTP Range request. Transient failures (connection errors, 5xx, a body
//! cut short) are retried with back-off inside the download, resuming each time; the count of
//! failures resets whenever bytes arrive. A node-wide semaphore bounds concurrent transfers.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::{Semaphore, watch};
use tokio_util::sync::CancellationToken;

use crate::content::{ContentStore, Ingest};
use crate::digest::Digest;
use crate::error::{Result, StoreError};
use crate::registry::Session;

/// Consecutive failures without progress after which a blob download gives up.
const BLOB_RETRIES: u32 = 5;
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

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
        }
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
    /// The sessions of the requesters, one per source ([`Session::same_source`]), in the order
    /// they came: when the download fails with one, it goes on with the next.
    sessions: Mutex<Vec<Arc<Session>>>,
}

impl BlobDownload {
    /// Adds `session` unless one of the same source is there.
    fn add_session(&self, session: &Arc<Session>) {
        Session::add_distinct(&mut self.sessions.lock().unwrap(), session);
    }
}

/// Node-wide registry of blob downloads.
pub struct BlobDownloads {
    content: Arc<ContentStore>,
    inflight: Mutex<HashMap<Digest, Arc<BlobDownload>>>,
    transfers: Arc<Semaphore>,
}

/// A claim on a blob download. The download runs while at least one handle is alive.
pub struct BlobHandle {
    downloads: Arc<BlobDownloads>,
    dl: Arc<BlobDownload>,
}

impl BlobDownloads {
    /// `max_transfers`: blobs transferred at once on this node.
    pub fn new(content: Arc<ContentStore>, max_transfers: usize) -> Arc<BlobDownloads> {
        Arc::new(BlobDownloads {
            content,
            inflight: Mutex::new(HashMap::new()),
            transfers: Arc::new(Semaphore::new(max_transfers.max(1))),
        })
    }

    /// Joins the download of `digest`, starting it (with the first of `sessions`) if none is
    /// running; the other sessions are where it goes on when one fails.
    pub fn acquire(
        self: &Arc<Self>,
        digest: &Digest,
        size: u64,
        sessions: &[Arc<Session>],
    ) -> BlobHandle {
        let session = sessions.first().expect("a blob is fetched with a session");
        let mut inflight = self.inflight.lock().unwrap();
        if let Some(dl) = inflight.get(digest).filter(|d| !d.cancel.is_cancelled()) {
            *dl.interest.lock().unwrap() += 1;
            for s in sessions {
                dl.add_session(s);
            }
            return BlobHandle {
                downloads: self.clone(),
                dl: dl.clone(),
            };
        }
        let progress = Arc::new(BlobProgress::new(digest.clone(), size));
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
        inflight.insert(digest.clone(), dl.clone());
        drop(inflight);

        let this = self.clone();
        let me = dl.clone();
        tokio::spawn(async move {
            // With the first requester's session; when that fails, with the next requester's of
            // another source (other registry, mirror or credentials), from the bytes on disk.
            let mut used = 0;
            let result = loop {
                let session = me.sessions.lock().unwrap()[used].clone();
                let result = tokio::select! {
                    r = fetch(&this.content, &session, &progress, &this.transfers) => r,
                    _ = cancel.cancelled() => Err(StoreError::Cancelled(format!("download of {} stopped: no pull wants it", progress.digest))),
                };
                let next = me.sessions.lock().unwrap().len() > used + 1;
                match result {
                    Err(e) if next && !matches!(e, StoreError::Cancelled(_)) => {
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
                if inflight
                    .get(&progress.digest)
                    .is_some_and(|d| Arc::ptr_eq(d, &me))
                {
                    inflight.remove(&progress.digest);
                }
            }
            let _ = tx.send(Some(result.map_err(Arc::new)));
        });
        BlobHandle {
            downloads: self.clone(),
            dl,
        }
    }

    /// Adds `session` to the ones the running download of `digest` may go on with.
    pub fn add_session(&self, digest: &Digest, session: &Arc<Session>) {
        if let Some(dl) = self.inflight.lock().unwrap().get(digest) {
            dl.add_session(session);
        }
    }

    /// Digests with a download running now (their ingests must not be collected).
    pub fn active(&self) -> Vec<Digest> {
        self.inflight.lock().unwrap().keys().cloned().collect()
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
        let mut inflight = self.downloads.inflight.lock().unwrap();
        let mut interest = self.dl.interest.lock().unwrap();
        *interest -= 1;
        if *interest == 0 && self.dl.result.borrow().is_none() {
            // Nobody wants it: stop the transfer now; the partial data stays for a later resume.
            self.dl.cancel.cancel();
            let digest = &self.dl.progress.digest;
            if inflight
                .get(digest)
                .is_some_and(|d| Arc::ptr_eq(d, &self.dl))
            {
                inflight.remove(digest);
            }
        }
    }
}

enum WriterMsg {
    Data(Bytes),
    Restart,
}

fn writer_gone() -> StoreError {
    StoreError::io(
        "ingest writer stopped",
        std::io::Error::other("writer thread ended"),
    )
}

/// Makes sure the blob is committed, downloading what is missing.
async fn fetch(
    content: &Arc<ContentStore>,
    session: &Session,
    progress: &Arc<BlobProgress>,
    transfers: &Semaphore,
) -> Result<()> {
    let digest = progress.digest.clone();
    let size = progress.total;
    let reference = session.reference().to_string();
    if content.size(&digest) == Some(size) {
        progress.done.store(size, Ordering::Relaxed);
        return Ok(());
    }
    let _permit = transfers.acquire().await.expect("semaphore never closed");
    let guard = content.lock_ingest(&digest).await;
    if content.size(&digest) == Some(size) {
        progress.done.store(size, Ordering::Relaxed);
        return Ok(());
    }
    let c = content.clone();
    let d = digest.clone();
    let ingest = tokio::task::spawn_blocking(move || c.open_ingest(&d, size))
        .await
        .expect("open_ingest does not panic")?;
    let mut offset = ingest.offset();
    progress.resumed_from.store(offset, Ordering::Relaxed);
    progress.done.store(offset, Ordering::Relaxed);
    progress.written.store(offset, Ordering::Relaxed);
    // The ingest file exists from here on: a reader waiting to follow it may open it.
    progress.set_state(BlobState::Downloading);
    if offset > 0 {
        tracing::info!(blob = %digest, offset, size, "resuming download");
    }
    // The writer thread owns the ingest and its lock, so the lock is released only after the last
    // queued chunk is on disk, even when this future is dropped (cancelled) mid-transfer.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<WriterMsg>(32);
    let on_disk = progress.clone();
    let writer = tokio::task::spawn_blocking(move || {
        let _guard = guard;
        let mut ingest: Ingest = ingest;
        while let Some(msg) = rx.blocking_recv() {
            match msg {
                WriterMsg::Data(b) => ingest.append(&b)?,
                WriterMsg::Restart => ingest.restart()?,
            }
            on_disk.set_written(ingest.offset());
        }
        Ok::<Ingest, StoreError>(ingest)
    });

    let mut failures = 0u32;
    let mut backoff = FIRST_BACKOFF;
    // The endpoint whose body broke off last: the next request tries the others first (a mirror
    // failing mid-blob hands the rest of it to the next host, from the bytes on disk).
    let mut broke_off: Option<String> = None;
    while offset < size {
        let before = offset;
        let mut opened_at: Option<String> = None;
        let attempt = async {
            let mut body = session
                .blob(&digest, offset, broke_off.as_deref())
                .await
                .map_err(|e| session.fold_errors("blob", e))?;
            if broke_off.is_some() || offset > 0 {
                tracing::info!(blob = %digest, offset, endpoint = %body.endpoint, "blob continues");
            }
            progress.set_source(&body.endpoint);
            opened_at = Some(body.endpoint.clone());
            if offset > 0 && !body.resumed {
                tracing::info!(blob = %digest, offset, endpoint = %body.endpoint, "registry ignored the range request; restarting blob");
                offset = 0;
                progress.done.store(0, Ordering::Relaxed);
                progress.resumed_from.store(0, Ordering::Relaxed);
                tx.send(WriterMsg::Restart)
                    .await
                    .map_err(|_| writer_gone())?;
            }
            while let Some(chunk) = body.stream.next().await {
                let chunk = chunk.map_err(|e| StoreError::Unavailable {
                    reference: reference.clone(),
                    reason: format!("downloading {digest} from {}: {e}", body.endpoint),
                })?;
                offset += chunk.len() as u64;
                progress.done.store(offset, Ordering::Relaxed);
                progress
                    .downloaded
                    .fetch_add(chunk.len() as u64, Ordering::Relaxed);
                tx.send(WriterMsg::Data(chunk))
                    .await
                    .map_err(|_| writer_gone())?;
            }
            Ok::<(), StoreError>(())
        };
        let outcome = attempt.await;
        if offset > before {
            failures = 0;
            backoff = FIRST_BACKOFF;
        }
        broke_off = match &outcome {
            Ok(()) if offset >= size => None,
            _ => opened_at,
        };
        match outcome {
            Ok(()) if offset < size => {
                tracing::warn!(blob = %digest, offset, size, "blob body ended early; resuming");
                failures += 1;
            }
            Ok(()) => {}
            Err(e @ StoreError::Unavailable { .. }) if failures < BLOB_RETRIES => {
                tracing::info!(blob = %digest, offset, error = %e, "transient failure");
                failures += 1;
            }
            Err(e) => {
                drop(tx);
                // The writer's own error (too many bytes, disk full) explains more.
                return match writer.await.expect("writer does not panic") {
                    Err(we) => Err(discard_on_size_error(content, &digest, we)),
                    Ok(_) => Err(e),
                };
            }
        }
        if offset < size {
            if failures > BLOB_RETRIES {
                drop(tx);
                let _ = writer.await;
                return Err(StoreError::Unavailable {
                    reference,
                    reason: format!(
                        "blob {digest}: gave up after {BLOB_RETRIES} failures at byte {offset} of {size}"
                    ),
                });
            }
            tracing::info!(blob = %digest, offset, failures, "retrying blob download");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }
    drop(tx);
    let ingest = match writer.await.expect("writer does not panic") {
        Ok(i) => i,
        Err(e) => return Err(discard_on_size_error(content, &digest, e)),
    };
    // Every byte is on disk now: readers following the ingest may read to its end.
    progress.set_state(BlobState::Verifying);
    let c = content.clone();
    tokio::task::spawn_blocking(move || ingest.commit(&c))
        .await
        .expect("commit does not panic")
}

/// Bytes beyond the descriptor's size mean the partial data is not a prefix of the blob: drop it.
fn discard_on_size_error(content: &ContentStore, digest: &Digest, e: StoreError) -> StoreError {
    if matches!(e, StoreError::SizeMismatch { .. }) {
        let _ = content.remove_ingest(digest);
    }
    e
}

//! Unpacking a pulled image's layers into snapshots, pipelined with the download.
//!
//! Layers unpack at once, each as soon as its bytes start arriving: a layer whose parent is not
//! committed yet is applied ahead of it ([`Snapshotter::apply_layer_early`]) and committed after
//! it, so only the commits follow the chain. A [`Gate`] per layer tells the layer above when the
//! layer is committed (or failed). A layer that turns out to depend on its parent's content is
//! applied again on top of the committed parent.
//!
//! A layer whose blob is already committed is read from the content store; one still downloading
//! is read from its ingest file as the bytes arrive ([`FollowReader`]), so decompression overlaps
//! the transfer. Reading unverified bytes is safe because the snapshotter checks the uncompressed
//! digest against the config's `diff_ids` before it commits anything. If a live read fails (the
//! download restarted or failed), the layer is applied again from the committed blob once the
//! download succeeds; if the download failed, its own error is the pull's error.
//!
//! Every apply runs on a blocking thread that ends with its job ([`Unpacks`]): when the job stops
//! (its last requester went, it failed, or the daemon stops) the apply's reads fail at once, a
//! reader following a download stops waiting for bytes, and a layer applied ahead stops waiting
//! for its parent; the job counts as ended only once its applies have returned.
//!
//! The snapshotter claims every uncompressed byte from the image filesystem's reserve before it
//! writes it (minicri_snapshotter::SpaceCheck, given by the daemon): an unpack that would leave
//! less free than the reserve stops with [`StoreError::ImageFsReserve`], and is not tried again.

use std::fs::File;
use std::io::BufReader;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use minicri_snapshotter::{LayerSpec, Snapshotter, WriterStatus};
use tokio_util::task::TaskTracker;

use crate::blobs::{BlobProgress, BlobState};
use crate::content::ContentStore;
use crate::digest::Digest;
use crate::error::{Result, StoreError};
use crate::space::Shortfall;

/// One layer to apply.
pub struct LayerToApply {
    pub digest: Digest,
    pub media_type: String,
    pub diff_id: String,
}

fn unpack_error(reference: &str, layer: &Digest, e: minicri_snapshotter::Error) -> StoreError {
    if let Some(shortfall) = Shortfall::find(&e) {
        return StoreError::ImageFsReserve {
            what: format!("unpacking layer {layer} of {reference}"),
            shortfall: shortfall.clone(),
        };
    }
    StoreError::Unpack {
        reference: reference.to_string(),
        layer: layer.to_string(),
        source: e,
    }
}

/// Whether a layer is committed: opened once its apply has ended, waited for by the layer above.
#[derive(Default)]
pub struct Gate {
    committed: Mutex<Option<bool>>,
    /// Wakes blocking waiters ([`Gate::wait`]).
    opened: Condvar,
    /// Wakes async waiters ([`Gate::opened`]).
    notify: tokio::sync::Notify,
}

impl Gate {
    /// Records how the layer's apply ended and wakes the waiters.
    pub fn open(&self, committed: bool) {
        let mut g = self.committed.lock().unwrap_or_else(|p| p.into_inner());
        if g.is_none() {
            *g = Some(committed);
        }
        self.opened.notify_all();
        self.notify.notify_waiters();
    }

    /// How the layer's apply ended, if it has.
    pub fn state(&self) -> Option<bool> {
        *self.committed.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn is_open(&self) -> bool {
        self.state().is_some()
    }

    /// Waits (async) until the gate opens; true if the layer was committed.
    pub async fn opened(&self) -> bool {
        loop {
            // Created before the state is read: a notify_waiters in between still wakes it.
            let notified = self.notify.notified();
            if let Some(c) = self.state() {
                return c;
            }
            notified.await;
        }
    }

    /// Blocks until the gate opens, true if the layer was committed; false as soon as `stop` is
    /// cancelled (looked at every [`STOP_CHECK`]).
    pub fn wait(&self, stop: &AtomicBool) -> bool {
        let mut g = self.committed.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(c) = *g {
                return c;
            }
            if stop.load(Ordering::Relaxed) {
                return false;
            }
            g = self
                .opened
                .wait_timeout(g, STOP_CHECK)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// Opens its gate as failed when dropped unless opened before: a cancelled or failed pull never
/// leaves the layer above waiting.
pub struct GateGuard(pub Arc<Gate>);

impl Drop for GateGuard {
    fn drop(&mut self) {
        self.0.open(false);
    }
}

/// The chain a layer goes on: the parent's chain id and its gate.
pub type Parent = Option<(String, Arc<Gate>)>;

/// How often a blocking apply looks whether its job stopped while it waits (for bytes of a
/// download, or for its parent's commit).
pub const STOP_CHECK: Duration = Duration::from_millis(200);

/// A job's applies: `stop` ends them (their reads fail, their waits return), `tasks` tracks
/// their blocking threads so that the job can wait for them to have returned, and `read` counts
/// the layer bytes they have read (the progress watchdog's view of unpacking).
#[derive(Clone, Default)]
pub struct Unpacks {
    pub stop: Arc<AtomicBool>,
    pub tasks: TaskTracker,
    pub read: Arc<AtomicU64>,
}

impl Unpacks {
    /// Layer bytes read by the applies so far.
    pub fn bytes_read(&self) -> u64 {
        self.read.load(Ordering::Relaxed)
    }

    /// Stops the applies and waits for them to return, at most `bound`; whether they did.
    pub async fn stop_and_wait(&self, bound: Duration) -> bool {
        self.stop.store(true, Ordering::Relaxed);
        self.tasks.close();
        tokio::time::timeout(bound, self.tasks.wait()).await.is_ok()
    }
}

/// A reader that fails once its job stopped (an apply reading a large committed blob ends
/// within one read of the stop) and counts what it reads.
struct Stoppable<R> {
    inner: R,
    stop: Arc<AtomicBool>,
    read: Arc<AtomicU64>,
}

impl<R: std::io::Read> std::io::Read for Stoppable<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.stop.load(Ordering::Relaxed) {
            return Err(stopped());
        }
        let n = self.inner.read(buf)?;
        self.read.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

fn stopped() -> std::io::Error {
    std::io::Error::other("the pull stopped")
}

/// Where a job's layers unpack: the node's snapshotter and content store, and the job's applies.
pub struct Unpacker<'a> {
    pub snapshotter: &'a Arc<dyn Snapshotter>,
    pub content: &'a Arc<ContentStore>,
    pub unpacks: &'a Unpacks,
}

impl Unpacker<'_> {
    /// Applies `layer` on top of `parent` for image `image_id`; returns the new chain id. The parent
    /// may still be unpacking: the layer is then applied ahead of it. `progress` is the layer's
    /// download, `None` if its blob is already committed.
    pub async fn apply_layer(
        &self,
        reference: &str,
        image_id: &str,
        layer: &LayerToApply,
        parent: Parent,
        progress: Option<Arc<BlobProgress>>,
    ) -> Result<String> {
        let live = progress.filter(|p| !matches!(p.state(), BlobState::Done));
        let first = self
            .run_apply(image_id, layer, parent.clone(), live.clone())
            .await;
        let e = match first {
            Ok(chain) => return Ok(chain),
            Err(e) => e,
        };
        let needs_parent = matches!(e, minicri_snapshotter::Error::NeedsParent { .. });
        // Stopped at the reserve: applying it again would only stop there again.
        if Shortfall::find(&e).is_some() || (!needs_parent && live.is_none()) {
            return Err(unpack_error(reference, &layer.digest, e));
        }
        // Applied again from the verified blob, on top of the committed parent.
        if let Some(p) = live {
            // Read while downloading: find out how the download ended.
            p.ended().await;
            if p.state() != BlobState::Done {
                tracing::debug!(blob = %layer.digest, error = %e, "live unpack failed with its download; the download's error stands");
                // The download's failure fails the pull through its own path.
                return futures::future::pending().await;
            }
        }
        if let Some((chain, gate)) = &parent
            && !gate.opened().await
        {
            let e = minicri_snapshotter::Error::NotFound { key: chain.clone() };
            return Err(unpack_error(reference, &layer.digest, e));
        }
        if needs_parent {
            tracing::info!(blob = %layer.digest, reason = %e, "applying the layer again on top of its parent");
        } else {
            tracing::info!(blob = %layer.digest, error = %e, "applying the layer again from the verified blob");
        }
        self.run_apply(image_id, layer, parent, None)
            .await
            .map_err(|e| unpack_error(reference, &layer.digest, e))
    }

    /// One apply of `layer` in a blocking thread: from the download as it arrives (`live`) or from
    /// the committed blob, ahead of the parent while the parent is not committed.
    async fn run_apply(
        &self,
        image_id: &str,
        layer: &LayerToApply,
        parent: Parent,
        live: Option<Arc<BlobProgress>>,
    ) -> Result<String, minicri_snapshotter::Error> {
        let unpacks = self.unpacks;
        let snap = self.snapshotter.clone();
        let content = self.content.clone();
        let (digest, media_type, diff_id, user) = (
            layer.digest.clone(),
            layer.media_type.clone(),
            layer.diff_id.clone(),
            image_id.to_string(),
        );
        let stop = unpacks.stop.clone();
        let read = unpacks.read.clone();
        // Applies of the layer from the same bytes share one apply; from other bytes (another
        // blob, or a descriptor with another size) they run side by side.
        let source = match &live {
            Some(p) => p.key().to_string(),
            None => digest.to_string(),
        };
        let task = unpacks.tasks.spawn_blocking(move || {
            let (parent, gate) = parent.unzip();
            let spec = LayerSpec {
                media_type: &media_type,
                diff_id: &diff_id,
                parent: parent.as_deref(),
                user: Some(&user),
                source: Some(&source),
                stop: Some(&stop),
            };
            let parent_ready = || gate.as_ref().is_none_or(|g| g.wait(&stop));
            let apply = |stream: &mut (dyn std::io::Read + Send)| {
                let mut stream = Stoppable {
                    inner: stream,
                    stop: stop.clone(),
                    read: read.clone(),
                };
                snap.apply_layer_early(&spec, &mut stream, &parent_ready)
            };
            let io = |context: String| {
                move |e: std::io::Error| minicri_snapshotter::Error::Io { context, source: e }
            };
            let applied = match live {
                None => {
                    let f = File::open(content.blob_path(&digest))
                        .map_err(io(format!("opening blob {digest}")))?;
                    apply(&mut BufReader::with_capacity(1 << 20, f))?
                }
                Some(p) => {
                    let file = open_growing(&content, &digest, &p, &stop)
                        .map_err(io(format!("following the download of {digest}")))?;
                    // Woken by the download as its bytes reach the disk (no polling); the job's
                    // stop is looked at every STOP_CHECK.
                    let stop = stop.clone();
                    let status = move |read: u64| {
                        p.wait_until(STOP_CHECK, |p| {
                            p.written() > read || !in_progress(p.state())
                        });
                        if stop.load(Ordering::Relaxed) {
                            return WriterStatus::Failed(stopped());
                        }
                        follow_status(p.state(), p.written())
                    };
                    let mut reader = BufReader::with_capacity(
                        1 << 20,
                        minicri_snapshotter::FollowReader::new(file, status),
                    );
                    apply(&mut reader)?
                }
            };
            Ok(applied.chain_id)
        });
        task.await.expect("layer apply does not panic")
    }
}

/// Opens the file a download is writing (its ingest), or the committed blob if it finished first.
fn open_growing(
    content: &ContentStore,
    digest: &Digest,
    p: &BlobProgress,
    stop: &AtomicBool,
) -> std::io::Result<File> {
    loop {
        if stop.load(Ordering::Relaxed) {
            return Err(stopped());
        }
        if let Ok(f) = File::open(content.ingest_data_path(&p.key())) {
            return Ok(f);
        }
        match p.state() {
            BlobState::Verifying | BlobState::Done => return File::open(content.blob_path(digest)),
            BlobState::Failed | BlobState::Cancelled => {
                return Err(std::io::Error::other("download stopped"));
            }
            // The ingest file exists once the download is past Queued.
            BlobState::Queued => {
                p.wait_until(STOP_CHECK, |p| p.state() != BlobState::Queued);
            }
            BlobState::Downloading => {
                p.wait_until(STOP_CHECK, |p| !in_progress(p.state()));
            }
        }
    }
}

fn in_progress(s: BlobState) -> bool {
    matches!(s, BlobState::Queued | BlobState::Downloading)
}

/// What a reader following the download's file is told about the writer.
fn follow_status(s: BlobState, written: u64) -> WriterStatus {
    match s {
        BlobState::Queued | BlobState::Downloading => WriterStatus::Writing(written),
        BlobState::Verifying | BlobState::Done => WriterStatus::Done,
        BlobState::Failed | BlobState::Cancelled => {
            WriterStatus::Failed(std::io::Error::other("download stopped"))
        }
    }
}

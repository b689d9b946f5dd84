//! Running a pull job: its registry session, the procedure ([`super::procedure`]) under the
//! progress watchdog ([`super::watchdog`]), and the end of the job for every requester waiting on
//! it or holding it.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::detach::Hold;
use super::{Job, PullManager};
use crate::blobs::{BlobSource, add_distinct};
use crate::error::StoreError;
use crate::reference::Reference;
use crate::registry::{FetchedManifest, Session};

/// How long an ended job waits for its layer applies to return (they look at its stop every
/// [`crate::unpack::STOP_CHECK`]; this covers a read or a write under way on a slow disk).
pub const UNPACK_STOP_BOUND: Duration = Duration::from_secs(10);

impl PullManager {
    /// Stops every running job for a daemon that is stopping, keeping their partial data and
    /// their sandboxes' hold records (the next start resumes them), and waits until they have
    /// ended with their unpacks, at most `bound`; whether they did.
    pub async fn shutdown(&self, bound: Duration) -> bool {
        self.stopping.cancel();
        let deadline = tokio::time::Instant::now() + bound;
        loop {
            let running = self
                .jobs
                .lock()
                .unwrap()
                .len()
                .max(self.running_jobs.load(Ordering::Relaxed));
            if running == 0 {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                tracing::warn!(
                    jobs = running,
                    "pull jobs still running at the end of the shutdown's grace"
                );
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub(super) async fn run_job(
        self: Arc<Self>,
        job: Arc<Job>,
        session: Arc<Session>,
        top: FetchedManifest,
    ) {
        self.running_jobs.fetch_add(1, Ordering::Relaxed);
        let _running = RunningJob(&self.running_jobs);
        let watchdog = self.config.progress_timeout.map(|t| {
            let job = job.clone();
            let mgr = self.clone();
            let min_speed = self.config.min_speed;
            tokio::spawn(async move { mgr.watchdog(job, t, min_speed).await })
        });
        // A panic in the pull (a bug) fails this job like an error: left to unwind, it would
        // leave the job listed with no result, and every later pull of the image would join it.
        let content = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(
            self.pull_content(&job, &session, &top),
        ));
        let result = tokio::select! {
            r = content => r.unwrap_or_else(|_| Err(StoreError::io(
                format!("pulling {}", job.reference),
                std::io::Error::other("the pull panicked (a bug: see the daemon's log)"),
            ))),
            _ = job.cancel.cancelled() => Err(StoreError::Cancelled(format!("pull of {} stopped: no requester left", job.reference))),
            _ = self.stopping.cancelled() => Err(StoreError::Cancelled(format!("pull of {} stopped: the daemon is stopping", job.reference))),
        };
        if let Some(w) = watchdog {
            w.abort();
        }
        // The job has ended only once its layer applies have: a stopped or failed job stops
        // them (they look every unpack::STOP_CHECK) and waits.
        if !job.unpacks.stop_and_wait(UNPACK_STOP_BOUND).await {
            tracing::warn!(job = job.id, image = %job.reference, "layer unpacks still running {UNPACK_STOP_BOUND:?} after the pull ended");
        }
        // Its partial data is the collector's to judge from now on.
        job.pinned.lock().unwrap().take();
        let bytes = job.bytes();
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
        c.bytes_downloaded
            .fetch_add(bytes.downloaded, Ordering::Relaxed);
        c.bytes_resumed.fetch_add(bytes.resumed, Ordering::Relaxed);
        c.bytes_refetched
            .fetch_add(bytes.refetched, Ordering::Relaxed);
        tracing::info!(
            job = job.id,
            image = %job.reference,
            outcome = %outcome,
            bytes_total = bytes.total,
            bytes_downloaded = bytes.downloaded,
            bytes_resumed = bytes.resumed,
            bytes_refetched = bytes.refetched,
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
        if matches!(result, Err(StoreError::Cancelled(_))) && !self.stopping.is_cancelled() {
            self.charge_left_behind(&job);
        }
        job.result.send_replace(Some(result.map_err(Arc::new)));
        // Holds end with the job (a call detaching from now on sees the result instead); the
        // image gets the names their calls asked for, as those calls would have done.
        let holds: Vec<(String, Hold)> = job
            .requesters
            .lock()
            .unwrap()
            .iter_mut()
            .filter_map(|(k, e)| Some((k.clone(), e.hold.take()?)))
            .collect();
        // A daemon that stops keeps the hold records: the next start resumes their downloads.
        let holds = if self.stopping.is_cancelled() {
            Vec::new()
        } else {
            holds
        };
        for (key, hold) in holds {
            if let Some(Ok(rec)) = job.result.borrow().as_ref() {
                for name in &hold.names {
                    let named =
                        Reference::parse(name).and_then(|r| self.name_image(rec, &r, &job.top));
                    if let Err(e) = named {
                        tracing::warn!(job = job.id, image = %name, error = %e, "cannot name the image a held pull stored");
                    }
                }
            }
            tracing::info!(job = job.id, image = %job.reference, requester = %key, outcome = %outcome, "background download for a sandbox ended");
            self.end_hold(hold);
        }
    }

    /// Charges the partial data a stopped job leaves to the pods that wanted it, removing what
    /// is past a pod's share ([`super::partial`]), on a blocking thread.
    fn charge_left_behind(self: &Arc<Self>, job: &Job) {
        let owners = job.owners.lock().unwrap().clone();
        let keys = job.part_keys();
        let mgr = self.clone();
        tokio::spawn(async move {
            // The stopped downloads' writers still flush what they had queued, holding their
            // ingests' locks: wait for them (not for a download of the blob started since).
            let active = mgr.blobs.active();
            let flushed = async {
                for k in keys.iter().filter(|k| !active.contains(k)) {
                    drop(mgr.content.lock_ingest(k).await);
                }
            };
            let _ = tokio::time::timeout(Duration::from_secs(5), flushed).await;
            let _ = tokio::task::spawn_blocking(move || {
                let cap = mgr.config.partial_data_per_pod;
                mgr.left_behind
                    .charge(&owners, &keys, cap, &mgr.content, &mgr.blobs)
            })
            .await;
        });
    }

    /// Offers `session` to `job` and to the downloads of its parts running now (unless one of the
    /// same source is there): a requester reaching the image through another registry, mirror or
    /// credentials keeps the job going when the first requester's registry fails.
    pub(super) fn add_session(&self, job: &Job, session: &Arc<Session>) {
        let source: Arc<dyn BlobSource> = session.clone();
        if !add_distinct(&mut job.sessions.lock().unwrap(), &source) {
            return;
        }
        let keys = job.part_keys();
        for k in keys {
            self.blobs.add_session(&k, &source);
        }
    }
}

/// Counts a job as running until its run ends, however it ends.
struct RunningJob<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for RunningJob<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

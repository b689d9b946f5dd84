//! Running a pull job: its registry session, the procedure ([`super::procedure`]) under the
//! progress watchdog ([`super::watchdog`]), and the end of the job for every requester waiting on
//! it or holding it.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::detach::Hold;
use super::{Job, PullManager};
use crate::digest::Digest;
use crate::error::StoreError;
use crate::reference::Reference;
use crate::registry::{FetchedManifest, Session};

impl PullManager {
    pub(super) async fn run_job(
        self: Arc<Self>,
        job: Arc<Job>,
        session: Arc<Session>,
        top: FetchedManifest,
    ) {
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
        };
        if let Some(w) = watchdog {
            w.abort();
        }
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

    /// Offers `session` to `job` and to the downloads of its parts running now (unless one of the
    /// same source is there): a requester reaching the image through another registry, mirror or
    /// credentials keeps the job going when the first requester's registry fails.
    pub(super) fn add_session(&self, job: &Job, session: &Arc<Session>) {
        if !Session::add_distinct(&mut job.sessions.lock().unwrap(), session) {
            return;
        }
        let digests: Vec<Digest> = job
            .parts
            .lock()
            .unwrap()
            .iter()
            .map(|p| p.digest.clone())
            .collect();
        for d in digests {
            self.blobs.add_session(&d, session);
        }
    }
}

//! Who wants which job: a call joins the job of its image (creating it if none runs) under its
//! requester's entry; references go when calls end, requesters are aborted (sandbox stopped, pod
//! deleted, operator command) or pods closed; the job stops when its last requester goes
//! ([`PullManager::stop_if_unwanted`]). Lock order: `jobs`, then a job's `requesters`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{
    AbortTarget, Job, JobRef, Joining, PullManager, Requester, RequesterEntry, pod_key, pod_uid_key,
};
use crate::digest::Digest;
use crate::error::{Result, StoreError};
use crate::reference::Reference;
use crate::sched::Demand;

impl PullManager {
    /// The running job `requester`'s sandbox holds for `reference`, if any.
    pub(super) fn held_job(
        &self,
        requester: &Requester,
        reference: &Reference,
    ) -> Option<Arc<Job>> {
        requester.sandbox_id.as_ref()?;
        let key = requester.key();
        let jobs = self.jobs.lock().unwrap();
        jobs.values()
            .find(|j| {
                !j.cancel.is_cancelled()
                    && j.requesters
                        .lock()
                        .unwrap()
                        .get(&key)
                        .and_then(|e| e.hold.as_ref())
                        .is_some_and(|h| h.names.contains(&reference.to_string()))
            })
            .cloned()
    }

    /// Joins the job `key` or creates it; takes a reference for `requester` (a call's, returned,
    /// or a hold). Returns whether the job was created: the caller then starts it.
    pub(super) fn join(
        self: &Arc<Self>,
        key: &str,
        reference: &Reference,
        top: &Digest,
        requester: &Requester,
        joining: Joining,
    ) -> Result<(Arc<Job>, Option<JobRef>, bool)> {
        let mut jobs = self.jobs.lock().unwrap();
        self.refuse_closed(reference, requester)?;
        let (job, created) = match jobs.get(key).filter(|j| !j.cancel.is_cancelled()) {
            Some(j) => (j.clone(), false),
            None => {
                let job = Arc::new(Job {
                    id: self.next_job.fetch_add(1, Ordering::Relaxed),
                    key: key.to_string(),
                    reference: reference.clone(),
                    top: top.clone(),
                    cancel: CancellationToken::new(),
                    requesters: Mutex::new(HashMap::new()),
                    joined: AtomicUsize::new(0),
                    parts: Mutex::new(Vec::new()),
                    pinned: Mutex::new(None),
                    parts_changed: tokio::sync::Notify::new(),
                    unpacks: Default::default(),
                    owners: Mutex::new(Vec::new()),
                    demand: Demand::new(),
                    sessions: Mutex::new(Vec::new()),
                    result: watch::Sender::new(None),
                    started: Instant::now(),
                    started_at: chrono::Utc::now(),
                });
                jobs.insert(key.to_string(), job.clone());
                (job, true)
            }
        };
        let jref = self.add_requester(&job, requester, joining, !created);
        drop(jobs);
        if created {
            self.counters.jobs_started.fetch_add(1, Ordering::Relaxed);
        } else {
            tracing::info!(job = job.id, image = %reference, requester = %requester.key(), "joined running pull");
        }
        Ok((job, jref, created))
    }

    /// Joins a job known to be running (a sandbox's re-join); fails if it ended meanwhile.
    pub(super) fn join_job(
        self: &Arc<Self>,
        job: &Arc<Job>,
        requester: &Requester,
        joining: Joining,
    ) -> Result<JobRef> {
        let jobs = self.jobs.lock().unwrap();
        self.refuse_closed(&job.reference, requester)?;
        if !jobs.get(&job.key).is_some_and(|j| Arc::ptr_eq(j, job)) {
            return Err(StoreError::Cancelled(format!(
                "pull of {} ended as it was joined; try again",
                job.reference
            )));
        }
        let jref = self.add_requester(job, requester, joining, true);
        drop(jobs);
        tracing::info!(job = job.id, image = %job.reference, requester = %requester.key(), "rejoined the pull its sandbox holds");
        Ok(jref.expect("a call's join returns its reference"))
    }

    /// Adds `requester`'s reference to `job` (under the `jobs` lock).
    pub(super) fn add_requester(
        self: &Arc<Self>,
        job: &Arc<Job>,
        requester: &Requester,
        joining: Joining,
        running: bool,
    ) -> Option<JobRef> {
        let rkey = requester.key();
        let is_call = matches!(joining, Joining::Call);
        {
            let mut reqs = job.requesters.lock().unwrap();
            let e = reqs.entry(rkey.clone()).or_insert_with(|| RequesterEntry {
                info: requester.clone(),
                calls: 0,
                hold: None,
                abort: CancellationToken::new(),
                reason: Arc::new(Mutex::new(None)),
            });
            // An aborted reference whose calls are still returning: a new call starts afresh.
            if e.abort.is_cancelled() {
                e.abort = CancellationToken::new();
                e.reason = Arc::new(Mutex::new(None));
            }
            if e.info.sandbox_id.is_none() {
                e.info.sandbox_id = requester.sandbox_id.clone();
            }
            e.info.weight = requester.weight;
            match joining {
                Joining::Call => e.calls += 1,
                Joining::Hold(h) => e.hold = Some(*h),
            }
            job.sync_demand(&reqs);
        }
        job.joined.fetch_add(1, Ordering::Relaxed);
        {
            let owner = requester.owner();
            let mut owners = job.owners.lock().unwrap();
            if !owners.contains(&owner) && owners.len() < MAX_OWNERS_PER_JOB {
                owners.push(owner);
            }
        }
        if !is_call {
            return None;
        }
        self.counters.calls.fetch_add(1, Ordering::Relaxed);
        if running {
            self.counters.calls_joined.fetch_add(1, Ordering::Relaxed);
        }
        Some(JobRef {
            mgr: self.clone(),
            job: job.clone(),
            key: rkey,
        })
    }

    /// Fails for a requester whose sandbox was stopped ([`PullManager::close_pod`]) or whose pod
    /// was deleted ([`PullManager::close_pod_uid`]).
    pub(super) fn refuse_closed(&self, reference: &Reference, requester: &Requester) -> Result<()> {
        let closed = self.closed.lock().unwrap();
        let why = closed.get(&requester.key()).or_else(|| {
            requester
                .pod
                .as_ref()
                .and_then(|p| closed.get(&pod_uid_key(&p.uid)))
        });
        match why {
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
    /// return at once with `reason`, its holds end) and refuses its later pulls until
    /// [`PullManager::reopen_pod`]. Returns how many references were dropped.
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

    /// A pod was deleted (seen in the API server): drops the references of every attempt of
    /// it and refuses its later pulls (a kubelet's serial puller may still send one it queued)
    /// until its sandbox is removed. Returns how many references were dropped.
    pub fn close_pod_uid(&self, uid: &str, reason: &str) -> usize {
        {
            let _jobs = self.jobs.lock().unwrap();
            let mut closed = self.closed.lock().unwrap();
            // Bounded: a uid mark only matters until the kubelet removes the pod's sandbox.
            if closed.len() >= MAX_CLOSED_MARKS {
                closed.retain(|k, _| !k.starts_with("poduid:"));
            }
            closed.insert(pod_uid_key(uid), reason.to_string());
        }
        self.counters.pods_deleted.fetch_add(1, Ordering::Relaxed);
        self.abort(
            &AbortTarget::PodUid {
                uid: uid.to_string(),
                attempt: None,
            },
            reason,
        )
    }

    /// Forgets a closed pod sandbox (it was removed).
    pub fn reopen_pod(&self, uid: &str, attempt: u32) {
        let mut closed = self.closed.lock().unwrap();
        closed.remove(&pod_key(uid, attempt));
        closed.remove(&pod_uid_key(uid));
    }

    /// Drops one call's reference; the job stops when none is left.
    pub(super) fn release(&self, job: &Arc<Job>, key: &str) {
        let mut jobs = self.jobs.lock().unwrap();
        let mut reqs = job.requesters.lock().unwrap();
        if let Some(e) = reqs.get_mut(key) {
            e.calls -= 1;
            if !e.in_use() {
                reqs.remove(key);
                job.sync_demand(&reqs);
            }
        }
        Self::stop_if_unwanted(&mut jobs, job, &reqs);
    }

    /// Stops `job` when no requester is left (under both locks).
    pub(super) fn stop_if_unwanted(
        jobs: &mut HashMap<String, Arc<Job>>,
        job: &Arc<Job>,
        reqs: &HashMap<String, RequesterEntry>,
    ) {
        if reqs.is_empty() && !job.finished() && !job.cancel.is_cancelled() {
            tracing::info!(job = job.id, image = %job.reference, "last requester gone; stopping pull (partial data kept)");
            job.cancel.cancel();
            if jobs.get(&job.key).is_some_and(|j| Arc::ptr_eq(j, job)) {
                jobs.remove(&job.key);
            }
        }
    }

    /// Drops the references `target` names: their calls return at once with `reason`, their
    /// holds end. Returns how many references were dropped.
    pub fn abort(&self, target: &AbortTarget, reason: &str) -> usize {
        let jobs: Vec<Arc<Job>> = self.jobs.lock().unwrap().values().cloned().collect();
        let image_key = match target {
            AbortTarget::Image(r) => Reference::parse(r).ok().map(|r| r.to_string()),
            _ => None,
        };
        let mut dropped = 0;
        for job in jobs {
            dropped += self.drop_requesters(&job, reason, |e| match target {
                AbortTarget::Sandbox(id) => e.info.sandbox_id.as_deref() == Some(id.as_str()),
                AbortTarget::Pod { namespace, name } => e
                    .info
                    .pod
                    .as_ref()
                    .is_some_and(|p| &p.namespace == namespace && &p.name == name),
                AbortTarget::PodUid { uid, attempt } => e
                    .info
                    .pod
                    .as_ref()
                    .is_some_and(|p| &p.uid == uid && attempt.is_none_or(|a| a == p.attempt)),
                AbortTarget::Image(_) => image_key.as_deref() == Some(&job.reference.to_string()),
            });
        }
        dropped
    }

    /// Drops the requesters of `job` that `hit` picks; returns how many.
    pub(super) fn drop_requesters(
        &self,
        job: &Arc<Job>,
        reason: &str,
        hit: impl Fn(&RequesterEntry) -> bool,
    ) -> usize {
        let mut ended = Vec::new();
        let mut dropped = 0;
        {
            let mut jobs = self.jobs.lock().unwrap();
            let mut reqs = job.requesters.lock().unwrap();
            for e in reqs.values_mut() {
                if !hit(e) || (e.abort.is_cancelled() && e.hold.is_none()) {
                    continue;
                }
                *e.reason.lock().unwrap() = Some(reason.to_string());
                e.abort.cancel();
                if let Some(h) = e.hold.take() {
                    tracing::info!(job = job.id, image = %job.reference, requester = %e.info.key(), %reason, "hold on a background download dropped");
                    ended.push(h);
                }
                dropped += 1;
            }
            reqs.retain(|_, e| e.in_use());
            job.sync_demand(&reqs);
            Self::stop_if_unwanted(&mut jobs, job, &reqs);
        }
        for h in ended {
            self.end_hold(h);
        }
        self.counters
            .references_aborted
            .fetch_add(dropped as u64, Ordering::Relaxed);
        dropped
    }
}

/// Owners a job charges its left-behind partial data to, at most.
const MAX_OWNERS_PER_JOB: usize = 256;

/// Uid marks of deleted pods kept at most (a mark matters only until the pod's sandbox is
/// removed; past this many the oldest kind of mark is forgotten wholesale).
const MAX_CLOSED_MARKS: usize = 16384;

//! The simulated pull engine around the daemon's own downloads: pods arrive and join pulls,
//! pulls take [`BlobHandle`]s of [`BlobDownloads`] (the daemon's `blobs.rs`, with its scheduler,
//! ingest writer and content store, on a tmpfs) whose bytes come from the simulated registries
//! ([`super::registry`]), each pull has the daemon's progress watchdog
//! ([`judge`](crate::pull::watchdog::judge)), pods leave, and a pull nobody waits for drops its
//! handles. What is simulated is only what the pull layer does around the downloads (resolving
//! images, unpacking layers, the requesters' records). It also keeps the run's trace (a
//! fingerprint of its events and the last of them as text) and the first broken invariant.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::disk::SimDisk;
use super::registry::{SimRegistry, Witness, blob_bytes, sources};
use super::scenario::{BlobRef, PROGRESS_TIMEOUT, Scenario};
use crate::blobs::{
    BlobDownloads, BlobHandle, BlobProgress, BlobSource, FileWork, RangedFetch, TransferConfig,
};
use crate::content::ContentStore;
use crate::digest::Digest;
use crate::error::StoreError;
use crate::gc::IngestGc;
use crate::pull::JobBytes;
use crate::sched::{Demand, Flow, Scheduler};
use crate::space::{DEFAULT_RESERVE, Reclaim, SpaceBudget};

/// The simulation: the scenario, the daemon's downloads, and the engine's state.
pub(super) struct Sim {
    pub sc: Scenario,
    /// The daemon's store and downloads as they are since its last start.
    daemon: Mutex<Arc<Daemon>>,
    /// The schedulers of the daemons before a restart (invariant 5 looks at them too), and
    /// their grants and revocations.
    pub past: Mutex<Vec<Arc<Scheduler>>>,
    /// Per registry, its source.
    sources: Vec<Arc<dyn BlobSource>>,
    /// Per blob, its digest.
    digests: Vec<Digest>,
    pub start: Instant,
    world: Mutex<World>,
    /// The content store's directory.
    dir: tempfile::TempDir,
    /// Per blob, the bytes its registry sent.
    served: Vec<std::sync::atomic::AtomicU64>,
}

/// What the daemon holds from its start: its content store on the scenario's directory, its
/// downloads and their scheduler, and, on a small disk, its reserve and collector.
pub(super) struct Daemon {
    pub downloads: Arc<BlobDownloads>,
    /// The downloads' scheduler (every simulated blob is larger than the small lane's bound).
    pub sched: Arc<Scheduler>,
    pub content: Arc<ContentStore>,
    disk: Option<(Arc<SimDisk>, Arc<SpaceBudget>, Arc<Checked>)>,
}

impl Daemon {
    /// Opens the content store in `dir` (as the daemon does at its start: partial downloads on
    /// disk are found and accounted for) with the downloads around it.
    fn start(sc: &Scenario, dir: &std::path::Path, sim: &std::sync::Weak<Sim>) -> Daemon {
        let content = ContentStore::open(dir).expect("content store");
        let disk = sc.disk.map(|size| {
            Arc::new(SimDisk {
                root: dir.to_path_buf(),
                size,
                content: OnceLock::new(),
            })
        });
        let budget = disk.as_ref().map(|d| {
            Arc::new(SpaceBudget::with_measure(
                dir,
                DEFAULT_RESERVE,
                Box::new(d.clone()),
            ))
        });
        let content = match &budget {
            Some(b) => content.with_space(b.clone()),
            None => content,
        };
        let content = Arc::new(content);
        let downloads = BlobDownloads::with_file_work(
            content.clone(),
            TransferConfig {
                max_transfers: sc.slots,
                small_blob_bytes: 0,
            },
            RangedFetch {
                chunk_size: sc.chunk_size,
                connections: sc.connections,
            },
            FileWork::Inline,
        );
        // The daemon's collector of idle partial downloads makes room before a refusal.
        let disk = disk.zip(budget).map(|(disk, b)| {
            let _ = disk.content.set(Arc::downgrade(&content));
            let gc = Arc::new(IngestGc::new(
                content.clone(),
                downloads.clone(),
                Duration::from_secs(24 * 3600),
            ));
            let checked = Arc::new(Checked {
                gc,
                sim: sim.clone(),
                calls: Default::default(),
            });
            let reclaim: Arc<dyn Reclaim> = checked.clone();
            b.reclaim_with(Arc::downgrade(&reclaim));
            (disk, b, checked)
        });
        Daemon {
            sched: downloads.schedulers().0.clone(),
            downloads,
            content,
            disk,
        }
    }
}

/// Counts for the figures of a run.
#[derive(Debug, Default, Clone)]
pub(super) struct Counts {
    pub grants: u64,
    pub revocations: u64,
    /// Blobs a pull got.
    pub done: u64,
    /// Blobs whose download failed for a pull (given up, wrong size or bytes).
    pub gave_up: u64,
    /// Pulls the watchdog stopped.
    pub stalled: u64,
    /// Downloads stopped because no pull wanted them any more.
    pub stopped: u64,
    /// Blobs refused at the small disk's reserve.
    pub refused: u64,
    /// Scenarios whose daemon restarted.
    pub restarts: u64,
    /// Violations of invariants `MINICRI_SIM_IGNORE` lists.
    pub ignored: u64,
}

/// The invariants whose violations are only counted (`MINICRI_SIM_IGNORE=7,3`): what else a
/// hole breaks shows then.
fn ignored() -> &'static [String] {
    static IGNORED: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    IGNORED.get_or_init(|| {
        std::env::var("MINICRI_SIM_IGNORE")
            .unwrap_or_default()
            .split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect()
    })
}

struct World {
    pulls: Vec<Pull>,
    /// Per image, the pull running for it.
    running: Vec<Option<usize>>,
    /// Per download (blob and the size it is named with), how many running pulls want it.
    interest: HashMap<BlobRef, usize>,
    /// Per pod, the pull it waits for.
    pod_pull: Vec<Option<usize>>,
    /// Per pod, whether it was deleted.
    left: Vec<bool>,
    /// The daemon is restarting: pods arriving now pull once it is up.
    restarting: bool,
    deferred: Vec<usize>,
    arrived: usize,
    /// Downloads stopped because no pull wanted them, not yet seen to let go of the scheduler
    /// (invariant 6).
    stopping: Vec<(Arc<Flow>, Instant, BlobRef)>,
    /// Every flow of the run (invariant 5), with its download.
    flows: Vec<(Arc<Flow>, BlobRef)>,
    violation: Option<String>,
    counts: Counts,
    trace: Trace,
}

/// A pull's downloads (the size each is named with, and its progress), for its watchdog.
type Progress = Arc<Mutex<Vec<(u64, Arc<BlobProgress>)>>>;

struct Pull {
    image: usize,
    demand: Arc<Demand>,
    pods: Vec<usize>,
    /// Blobs not yet in.
    waiting: Vec<BlobRef>,
    /// Every blob's download, for the watchdog.
    progress: Progress,
    /// Cancelled when the pull ends: its handles drop, its watchdog stops.
    stop: CancellationToken,
}

/// A fingerprint of the events (same seed, same fingerprint), and the last of them as text, for
/// a failure's report. Events of one instant are hashed in sorted order: tokio wakes the tasks
/// waiting on one `watch` channel in an order it draws at random, so tasks woken together (the
/// pulls sharing a download that ended) report in either order; what they do is the same.
pub(super) struct Trace {
    hash: u64,
    /// The events of the current instant, not yet hashed.
    instant: (Duration, Vec<String>),
    recent: VecDeque<String>,
    keep_all: bool,
}

const RECENT: usize = 60;

impl Trace {
    fn new(keep_all: bool) -> Trace {
        Trace {
            hash: 0xcbf2_9ce4_8422_2325,
            instant: (Duration::ZERO, Vec::new()),
            recent: VecDeque::new(),
            keep_all,
        }
    }

    fn event(&mut self, at: Duration, what: String) {
        if at != self.instant.0 {
            self.flush();
            self.instant.0 = at;
        }
        self.instant.1.push(what.clone());
        if self.recent.len() == RECENT && !self.keep_all {
            self.recent.pop_front();
        }
        self.recent
            .push_back(format!("{:>10.3}s {what}", at.as_secs_f64()));
    }

    /// Hashes the current instant's events (FNV-1a over the time and the texts).
    fn flush(&mut self) {
        let (at, mut events) = std::mem::take(&mut self.instant);
        events.sort();
        for what in events {
            for b in at.as_micros().to_le_bytes().iter().chain(what.as_bytes()) {
                self.hash = (self.hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
    }

    fn fingerprint(&mut self) -> u64 {
        self.flush();
        self.hash
    }
}

impl Sim {
    pub fn new(sc: Scenario, all_events: bool) -> Arc<Sim> {
        let dir = tempfile::Builder::new()
            .prefix("minicri-sim")
            .tempdir_in(if std::path::Path::new("/dev/shm").is_dir() {
                "/dev/shm"
            } else {
                "/tmp"
            })
            .expect("a directory for the simulation's content store");
        let data: Vec<Bytes> = (0..sc.blobs.len())
            .map(|b| blob_bytes(sc.seed, b, sc.blobs[b].size))
            .collect();
        let digests: Vec<Digest> = data.iter().map(|d| Digest::of(d)).collect();
        let world = World {
            pulls: Vec::new(),
            running: vec![None; sc.images.len()],
            interest: HashMap::new(),
            pod_pull: vec![None; sc.pods.len()],
            left: vec![false; sc.pods.len()],
            restarting: false,
            deferred: Vec::new(),
            arrived: 0,
            stopping: Vec::new(),
            flows: Vec::new(),
            violation: None,
            counts: Counts::default(),
            trace: Trace::new(all_events),
        };
        Arc::new_cyclic(|me| {
            let daemon = Daemon::start(&sc, dir.path(), me);
            let regs: Vec<Arc<SimRegistry>> = (0..sc.registries.len())
                .map(|i| {
                    Arc::new(SimRegistry {
                        index: i,
                        spec: sc.registries[i].clone(),
                        blobs: (0..sc.blobs.len())
                            .filter(|&b| sc.blobs[b].registry == i)
                            .map(|b| (digests[b].clone(), data[b].clone(), b))
                            .collect(),
                        sim: me.clone() as std::sync::Weak<dyn Witness>,
                        cuts: Mutex::new(super::rng::Rng::new(sc.seed ^ (i as u64 + 1) << 32)),
                    })
                })
                .collect();
            Sim {
                daemon: Mutex::new(Arc::new(daemon)),
                past: Mutex::new(Vec::new()),
                sources: sources(&regs),
                served: (0..sc.blobs.len()).map(|_| Default::default()).collect(),
                digests,
                sc,
                start: Instant::now(),
                world: Mutex::new(world),
                dir,
            }
        })
    }

    /// (11) Partial data is resumed, never fetched again: a blob named only with its size, from
    /// a registry that answers ranged requests with its right bytes, was sent at most once in
    /// all, whatever revocations, cuts, stopped pulls and restarts came between (on a disk
    /// without a small reserve, where the collector removes nothing).
    pub fn check_sent_once(&self) -> Option<String> {
        if self.sc.disk.is_some() {
            return None;
        }
        (0..self.sc.blobs.len()).find_map(|b| {
            let blob = &self.sc.blobs[b];
            let reg = &self.sc.registries[blob.registry];
            let honest = self
                .sc
                .images
                .iter()
                .flatten()
                .all(|r| r.blob != b || r.size == blob.size);
            let sent = self.served[b].load(std::sync::atomic::Ordering::Relaxed);
            (honest && reg.resumable && !reg.corrupt && sent > blob.size).then(|| {
                format!(
                    "(11) blob {b}'s registry sent {sent} bytes of its {}: partial data was fetched again",
                    blob.size
                )
            })
        })
    }

    /// The daemon as it is since its last start.
    pub fn daemon(&self) -> Arc<Daemon> {
        self.daemon.lock().unwrap().clone()
    }

    fn at(&self) -> Duration {
        Instant::now() - self.start
    }

    fn event(&self, w: &mut World, what: String) {
        w.trace.event(self.at(), what);
    }

    /// Records a broken invariant (the first one is reported), unless it is one of the
    /// invariants `MINICRI_SIM_IGNORE` lists (then it is only counted).
    pub fn violated(&self, what: String) {
        let mut w = self.world.lock().unwrap();
        self.violate(&mut w, what);
    }

    fn violate(&self, w: &mut World, what: String) {
        self.event(w, format!("VIOLATION {what}"));
        let label = what.split(' ').next().unwrap_or_default();
        let label = label.trim_start_matches('(').trim_end_matches(')');
        if ignored().iter().any(|i| i == label) {
            w.counts.ignored += 1;
            return;
        }
        w.violation.get_or_insert(what);
    }

    pub fn violation(&self) -> Option<String> {
        self.world.lock().unwrap().violation.clone()
    }

    pub fn fingerprint(&self) -> u64 {
        self.world.lock().unwrap().trace.fingerprint()
    }

    pub fn recent_events(&self) -> Vec<String> {
        self.world
            .lock()
            .unwrap()
            .trace
            .recent
            .iter()
            .cloned()
            .collect()
    }

    pub fn counts(&self) -> Counts {
        self.world.lock().unwrap().counts.clone()
    }

    /// Every pod arrived, no pull runs and no download runs.
    pub fn settled(&self) -> bool {
        let w = self.world.lock().unwrap();
        w.arrived == self.sc.pods.len()
            && w.running.iter().all(Option::is_none)
            && self.daemon().downloads.active().is_empty()
    }

    /// The downloads running now, named.
    pub fn running_blobs(&self) -> Vec<String> {
        let running = self.daemon().downloads.active();
        let w = self.world.lock().unwrap();
        w.flows
            .iter()
            .map(|(_, r)| *r)
            .filter(|r| {
                running
                    .iter()
                    .any(|k| k.digest == self.digests[r.blob] && k.size == r.size)
            })
            .map(|r| describe(r, &self.sc))
            .collect()
    }

    pub fn running_pulls(&self) -> usize {
        let w = self.world.lock().unwrap();
        w.running.iter().filter(|p| p.is_some()).count()
    }

    pub fn flows(&self) -> Vec<Arc<Flow>> {
        let w = self.world.lock().unwrap();
        w.flows.iter().map(|(f, _)| f.clone()).collect()
    }

    /// Names flow `id` by its blob and the blob's registry (flow ids are process-wide: they
    /// differ between the suite and a replay, blob numbers do not).
    pub fn name(&self, id: u64) -> String {
        let w = self.world.lock().unwrap();
        match w.flows.iter().find(|(f, _)| f.id() == id) {
            Some((_, r)) => {
                let reg = &self.sc.registries[self.sc.blobs[r.blob].registry];
                let ranged = if reg.resumable {
                    "ranged"
                } else {
                    "whole blobs"
                };
                format!("{} ({:?}, {ranged})", describe(*r, &self.sc), reg.speed)
            }
            None => format!("flow {id}"),
        }
    }

    /// The scheduler took a slot of flow `victim` back for a waiter of flow `for_flow` (heard
    /// through its log events, [`super::observe`]): (7) a struck flow revokes nobody.
    pub(super) fn revoked(&self, victim: u64, for_flow: u64) {
        let (victim_name, for_name) = (self.name(victim), self.name(for_flow));
        let struck = {
            let w = self.world.lock().unwrap();
            w.flows
                .iter()
                .find(|(f, _)| f.id() == for_flow)
                .is_some_and(|(f, _)| f.struck())
        };
        self.note(format!("slot of {victim_name} taken back for {for_name}"));
        if struck {
            self.violated(format!(
                "(7) a slot of {victim_name} was taken back for {for_name}, which is struck (it cannot resume and lost a slot): it revokes nobody"
            ));
        }
    }

    /// Downloads stopped and not yet seen to have let go, with when they were stopped and their
    /// blob; `keep` says which are still to be watched.
    pub fn watch_stopping(&self, mut keep: impl FnMut(&Arc<Flow>, Instant, BlobRef) -> bool) {
        self.world
            .lock()
            .unwrap()
            .stopping
            .retain(|(f, at, b)| keep(f, *at, *b));
    }

    fn requesters(&self, pods: &[usize]) -> Vec<(String, u32)> {
        pods.iter()
            .map(|&p| (format!("pod-{p}"), self.sc.pods[p].weight))
            .collect()
    }

    /// Pod `p` arrives and pulls its image: it joins the pull running for it, or starts one,
    /// which joins the running downloads of its blobs or starts them (the daemon's
    /// [`BlobDownloads::acquire`]).
    pub fn arrive(self: &Arc<Self>, p: usize) {
        let mut w = self.world.lock().unwrap();
        w.arrived += 1;
        if w.restarting {
            w.deferred.push(p);
            self.event(&mut w, format!("pod-{p} waits for the daemon's restart"));
            return;
        }
        drop(w);
        self.pull(p);
    }

    /// Pod `p` (not deleted) pulls its image: see [`Sim::arrive`].
    fn pull(self: &Arc<Self>, p: usize) {
        let mut w = self.world.lock().unwrap();
        if w.left[p] {
            return;
        }
        let daemon = self.daemon();
        let image = self.sc.pods[p].image;
        if let Some(pi) = w.running[image] {
            w.pulls[pi].pods.push(p);
            let who = self.requesters(&w.pulls[pi].pods);
            w.pulls[pi].demand.set(who);
            w.pod_pull[p] = Some(pi);
            self.event(&mut w, format!("pod-{p} joins the pull of image {image}"));
            return;
        }
        let demand = Demand::new();
        demand.set(self.requesters(&[p]));
        let pi = w.pulls.len();
        let stop = CancellationToken::new();
        let progress = Arc::new(Mutex::new(Vec::new()));
        let mut waiting = Vec::new();
        for &r in &self.sc.images[image] {
            let digest = &self.digests[r.blob];
            if daemon.content.size(digest) == Some(r.size) {
                continue;
            }
            let source = self.sources[self.sc.blobs[r.blob].registry].clone();
            let handle = match daemon.downloads.acquire(digest, r.size, &[source], &demand) {
                Ok(h) => h,
                Err(e) => {
                    self.violate(&mut w, format!("blob {}: acquire failed: {e}", r.blob));
                    continue;
                }
            };
            let flow = handle.progress().flow().clone();
            if !w.flows.iter().any(|(f, _)| Arc::ptr_eq(f, &flow)) {
                w.flows.push((flow, r));
            }
            *w.interest.entry(r).or_default() += 1;
            progress
                .lock()
                .unwrap()
                .push((r.size, handle.progress().clone()));
            waiting.push(r);
            self.wait_for(pi, r, handle, stop.clone());
        }
        let named: Vec<String> = waiting.iter().map(|r| describe(*r, &self.sc)).collect();
        self.event(
            &mut w,
            format!("pod-{p} pulls image {image}, waiting for {named:?}"),
        );
        if waiting.is_empty() {
            return;
        }
        self.watch(pi, progress.clone(), stop.clone());
        w.pulls.push(Pull {
            image,
            demand,
            pods: vec![p],
            waiting,
            progress,
            stop,
        });
        w.running[image] = Some(pi);
        w.pod_pull[p] = Some(pi);
    }

    /// Pull `pi` waits for its blob `r` through `handle` until the download ends or the pull
    /// does (then the handle drops: the pull's claim on the download).
    fn wait_for(
        self: &Arc<Self>,
        pi: usize,
        r: BlobRef,
        handle: BlobHandle,
        stop: CancellationToken,
    ) {
        let sim = self.clone();
        tokio::spawn(async move {
            let result = tokio::select! {
                biased;
                _ = stop.cancelled() => None,
                r = handle.wait() => Some(r),
            };
            drop(handle);
            if let Some(result) = result {
                sim.blob_ended(pi, r, result);
            }
        });
    }

    /// The daemon's progress watchdog, over pull `pi`'s downloads.
    fn watch(self: &Arc<Self>, pi: usize, progress: Progress, stop: CancellationToken) {
        let sim = self.clone();
        tokio::spawn(async move {
            let bytes = || {
                let parts = progress.lock().unwrap();
                JobBytes::of(parts.iter().map(|(size, p)| (*size, Some(&**p))), 0)
            };
            let reason = tokio::select! {
                biased;
                _ = stop.cancelled() => return,
                reason = crate::pull::watchdog::judge(PROGRESS_TIMEOUT, None, bytes) => reason,
            };
            let mut w = sim.world.lock().unwrap();
            if w.pulls[pi].stop.is_cancelled() {
                return;
            }
            w.counts.stalled += 1;
            sim.end_pull(&mut w, pi, &format!("failed: {reason}"));
        });
    }

    /// The daemon restarts: every pull ends (its call fails; the kubelet calls again), its
    /// downloads stop and keep their partial data, and once they let go a new daemon opens the
    /// content store and the pods that were pulling, or arrived meanwhile, pull again.
    pub async fn restart(self: &Arc<Self>) {
        let again: Vec<usize> = {
            let mut w = self.world.lock().unwrap();
            w.restarting = true;
            let pods = (0..w.pod_pull.len())
                .filter(|&p| w.pod_pull[p].is_some())
                .collect();
            for pi in 0..w.pulls.len() {
                if w.running[w.pulls[pi].image] == Some(pi) {
                    self.end_pull(&mut w, pi, "the daemon restarts");
                }
            }
            self.event(&mut w, "the daemon stops".into());
            pods
        };
        // Its tasks wind down, the bytes received written, as the process exits.
        tokio::time::sleep(crate::sched::TICK).await;
        let old = self.daemon();
        let running = old.downloads.active();
        if !running.is_empty() {
            self.violated(format!(
                "(5) {} downloads still run a tick after the daemon stopped",
                running.len()
            ));
        }
        let new = Daemon::start(&self.sc, self.dir.path(), &Arc::downgrade(self));
        self.past.lock().unwrap().push(old.sched.clone());
        *self.daemon.lock().unwrap() = Arc::new(new);
        let deferred = {
            let mut w = self.world.lock().unwrap();
            w.restarting = false;
            self.event(&mut w, "the daemon is up again".into());
            std::mem::take(&mut w.deferred)
        };
        for p in again.into_iter().chain(deferred) {
            self.pull(p);
        }
    }

    /// Pod `p` is deleted: it leaves its pull, which stops if nobody else waits for it.
    pub fn leave(&self, p: usize) {
        let mut w = self.world.lock().unwrap();
        w.left[p] = true;
        let Some(pi) = w.pod_pull[p].take() else {
            return;
        };
        w.pulls[pi].pods.retain(|&x| x != p);
        self.event(&mut w, format!("pod-{p} deleted"));
        if w.pulls[pi].pods.is_empty() {
            self.end_pull(&mut w, pi, "its last pod left");
        } else {
            let who = self.requesters(&w.pulls[pi].pods);
            w.pulls[pi].demand.set(who);
        }
    }

    /// Pull `pi` ends: its handles of downloads it still waits for drop, and a download no
    /// other pull wants stops (invariant 6 watches it let go).
    fn end_pull(&self, w: &mut World, pi: usize, why: &str) {
        let image = w.pulls[pi].image;
        w.running[image] = None;
        for p in std::mem::take(&mut w.pulls[pi].pods) {
            w.pod_pull[p] = None;
        }
        w.pulls[pi].stop.cancel();
        let progress = w.pulls[pi].progress.lock().unwrap().clone();
        let now = Instant::now();
        for r in std::mem::take(&mut w.pulls[pi].waiting) {
            let left = w.interest.get_mut(&r).map(|n| {
                *n -= 1;
                *n
            });
            if left != Some(0) {
                continue;
            }
            w.interest.remove(&r);
            let Some((_, pr)) = progress
                .iter()
                .find(|(size, pr)| *size == r.size && pr.digest == self.digests[r.blob])
            else {
                continue;
            };
            if pr.ended_now() {
                continue;
            }
            w.stopping.push((pr.flow().clone(), now, r));
            w.counts.stopped += 1;
            self.event(
                w,
                format!("{} stopped: no pull wants it", describe(r, &self.sc)),
            );
        }
        self.event(w, format!("pull of image {image} ends: {why}"));
    }

    /// The download of `r` ended for pull `pi`.
    fn blob_ended(&self, pi: usize, r: BlobRef, result: crate::error::Result<()>) {
        let mut w = self.world.lock().unwrap();
        if w.pulls[pi].stop.is_cancelled() || !w.pulls[pi].waiting.contains(&r) {
            return;
        }
        w.pulls[pi].waiting.retain(|x| *x != r);
        if let Some(n) = w.interest.get_mut(&r) {
            *n -= 1;
            if *n == 0 {
                w.interest.remove(&r);
            }
        }
        let name = describe(r, &self.sc);
        match result {
            Ok(()) => {
                w.counts.done += 1;
                let image = w.pulls[pi].image;
                self.event(
                    &mut w,
                    format!("{name} is in for the pull of image {image}"),
                );
                if w.pulls[pi].waiting.is_empty() {
                    self.end_pull(&mut w, pi, "every blob is in");
                }
            }
            Err(e) => {
                if e.kind() == crate::error::ErrorKind::ResourceExhausted {
                    w.counts.refused += 1;
                }
                if matches!(e, StoreError::Cancelled(_)) {
                    drop(w);
                    self.violated(format!(
                        "{name}'s download was stopped while a pull waited for it: {e}"
                    ));
                    return;
                }
                w.counts.gave_up += 1;
                let blob = &self.sc.blobs[r.blob];
                let reg = &self.sc.registries[blob.registry];
                // (8) A blob named with its size, from a registry that sends its right bytes, fails
                // only when its registry cannot resume (after its strikes or cuts), or at the
                // reserve.
                let refused = e.kind() == crate::error::ErrorKind::ResourceExhausted;
                if r.size == blob.size && !reg.corrupt && reg.rate > 0 && reg.resumable && !refused
                {
                    let what = format!(
                        "(8) {name} failed for the pull of image {}, although it is named with its size and its registry sends its bytes and resumes: {e}",
                        w.pulls[pi].image
                    );
                    self.violate(&mut w, what);
                }
                self.end_pull(&mut w, pi, &format!("failed: {name}: {e}"));
            }
        }
    }
}

impl Witness for Sim {
    fn note(&self, what: String) {
        let mut w = self.world.lock().unwrap();
        self.event(&mut w, what);
    }

    fn served(&self, b: usize, n: u64) {
        self.served[b].fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Sim {
    /// Bytes of partial downloads that no download wants.
    fn idle_partial_bytes(&self) -> u64 {
        let d = self.daemon();
        let active = d.downloads.active();
        d.content
            .list_ingests()
            .unwrap_or_default()
            .iter()
            .filter(|i| !active.contains(&i.key))
            .map(|i| d.content.ingest_bytes(&i.key))
            .sum()
    }

    /// The budget asked the collector for `lacking` bytes and it freed `freed`: (10) room is
    /// made before a refusal, so a collector that could not free enough left no partial data
    /// that no download wants.
    fn reclaimed(&self, lacking: u64, freed: u64) {
        let idle = self.idle_partial_bytes();
        self.note(format!(
            "the reserve lacked {lacking} bytes: {freed} freed, {idle} idle left"
        ));
        if freed < lacking && idle > 0 {
            self.violated(format!(
                "(10) the collector freed {freed} of the {lacking} bytes the reserve lacked, yet {idle} bytes of partial downloads no download wants stayed"
            ));
        }
    }

    /// (9) The blob bytes on the small disk leave its reserve free; (10) the reserve refused
    /// nothing without asking the collector for room first.
    pub fn check_reserve(&self) -> Option<String> {
        let d = self.daemon();
        let (disk, budget, checked) = d.disk.as_ref()?;
        let asked = checked.calls.load(std::sync::atomic::Ordering::Relaxed);
        if budget.refusals() > asked {
            return Some(format!(
                "(10) the reserve refused {} claims and asked the collector for room {asked} times",
                budget.refusals()
            ));
        }
        let used = disk.used();
        let reserve = DEFAULT_RESERVE.bytes_of(disk.size);
        (disk.size.saturating_sub(used) < reserve).then(|| {
            format!(
                "(9) {used} bytes of blobs on a disk of {} leave {} free, under the reserve of {reserve}",
                disk.size,
                disk.size.saturating_sub(used)
            )
        })
    }
}

/// The daemon's collector as the reserve's [`Reclaim`], checked as it runs (invariant 10).
struct Checked {
    gc: Arc<IngestGc>,
    sim: std::sync::Weak<Sim>,
    /// Times the budget asked.
    calls: std::sync::atomic::AtomicU64,
}

impl Reclaim for Checked {
    fn reclaim(&self, bytes: u64) -> u64 {
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let freed = self.gc.reclaim(bytes);
        if let Some(sim) = self.sim.upgrade() {
            sim.reclaimed(bytes, freed);
        }
        freed
    }
}

/// `blob 3`, or `blob 3 named with 120 bytes` for a descriptor with a wrong size.
fn describe(r: BlobRef, sc: &Scenario) -> String {
    if sc.blobs[r.blob].size == r.size {
        format!("blob {}", r.blob)
    } else {
        format!("blob {} named with {} bytes", r.blob, r.size)
    }
}

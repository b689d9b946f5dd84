//! The simulated pull engine around the real scheduler: pods arrive and join pulls, pulls share
//! blob downloads ([`super::download`]), pods leave, and a download nobody wants stops. The
//! scheduler, its flows, demands and leases are the daemon's own code; what is simulated here is
//! everything around them. It also keeps the run's trace (a fingerprint of its events and the
//! last of them as text) and the first broken invariant.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use tokio::time::Instant;

use super::download::{Download, End};
use super::scenario::Scenario;
use crate::sched::{Demand, Flow, Lease, Scheduler};

/// The simulation: the scenario, the real scheduler, and the engine's state.
pub(super) struct Sim {
    pub sc: Scenario,
    pub sched: Arc<Scheduler>,
    pub start: Instant,
    world: Mutex<World>,
    /// Bumped by everything that may change what the scheduler holds or how it counts shares:
    /// a step that sees the same count (and the same scheduler counters) sees the same state.
    changes: AtomicU64,
}

/// Counts for the figures of a run.
#[derive(Debug, Default, Clone)]
pub(super) struct Counts {
    pub grants: u64,
    pub revocations: u64,
    pub done: u64,
    pub gave_up: u64,
    pub stalled: u64,
    pub stopped: u64,
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
    /// Per blob, its running download and how many running pulls want it.
    downloads: Vec<Option<(Arc<Download>, usize)>>,
    blob_done: Vec<bool>,
    /// Per pod, the pull it waits for.
    pod_pull: Vec<Option<usize>>,
    arrived: usize,
    /// Downloads stopped because no pull wanted them, not yet seen to let go of the scheduler
    /// (invariant 6).
    stopping: Vec<(Arc<Flow>, Instant, usize)>,
    /// When a download last ended or stopped, or a connection last stopped waiting for a slot.
    last_gone: Option<Instant>,
    /// Every flow of the run (invariant 5), with its blob.
    flows: Vec<(Arc<Flow>, usize)>,
    violation: Option<String>,
    counts: Counts,
    trace: Trace,
}

struct Pull {
    image: usize,
    demand: Arc<Demand>,
    pods: Vec<usize>,
    /// Blobs not yet downloaded.
    waiting: Vec<usize>,
}

/// A fingerprint of the events in their order (same seed, same fingerprint), and the last of
/// them as text, for a failure's report.
pub(super) struct Trace {
    hash: u64,
    recent: VecDeque<String>,
    keep_all: bool,
}

const RECENT: usize = 60;

impl Trace {
    fn new(keep_all: bool) -> Trace {
        Trace {
            hash: 0xcbf2_9ce4_8422_2325,
            recent: VecDeque::new(),
            keep_all,
        }
    }

    fn event(&mut self, at: Duration, what: String) {
        // FNV-1a over the time and the text.
        for b in at.as_micros().to_le_bytes().iter().chain(what.as_bytes()) {
            self.hash = (self.hash ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
        if self.recent.len() == RECENT && !self.keep_all {
            self.recent.pop_front();
        }
        self.recent
            .push_back(format!("{:>10.3}s {what}", at.as_secs_f64()));
    }
}

impl Sim {
    pub fn new(sc: Scenario, all_events: bool) -> Arc<Sim> {
        let world = World {
            pulls: Vec::new(),
            running: vec![None; sc.images.len()],
            downloads: (0..sc.blobs.len()).map(|_| None).collect(),
            blob_done: vec![false; sc.blobs.len()],
            pod_pull: vec![None; sc.pods.len()],
            arrived: 0,
            stopping: Vec::new(),
            last_gone: None,
            flows: Vec::new(),
            violation: None,
            counts: Counts::default(),
            trace: Trace::new(all_events),
        };
        Arc::new(Sim {
            sched: Scheduler::new(sc.slots),
            sc,
            start: Instant::now(),
            world: Mutex::new(world),
            changes: AtomicU64::new(0),
        })
    }

    fn at(&self) -> Duration {
        Instant::now() - self.start
    }

    fn event(&self, w: &mut World, what: String) {
        self.changed();
        w.trace.event(self.at(), what);
    }

    pub(super) fn changed(&self) {
        self.changes.fetch_add(1, Ordering::Relaxed);
    }

    /// How many changes so far (see the field of that name).
    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::Relaxed)
    }

    /// Whether a stopped download is still to be seen letting go (invariant 6).
    pub fn stopping(&self) -> bool {
        !self.world.lock().unwrap().stopping.is_empty()
    }

    /// Records a broken invariant (the first one is reported), unless it is one of the
    /// invariants `MINICRI_SIM_IGNORE` lists (then it is only counted).
    pub fn violated(&self, what: String) {
        let mut w = self.world.lock().unwrap();
        self.event(&mut w, format!("VIOLATION {what}"));
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
        self.world.lock().unwrap().trace.hash
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

    /// Every pod arrived and no download runs.
    pub fn settled(&self) -> bool {
        let w = self.world.lock().unwrap();
        w.arrived == self.sc.pods.len() && w.downloads.iter().all(Option::is_none)
    }

    pub fn running_blobs(&self) -> Vec<usize> {
        let w = self.world.lock().unwrap();
        (0..w.downloads.len())
            .filter(|&b| w.downloads[b].is_some())
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
            Some((_, b)) => {
                let r = &self.sc.registries[self.sc.blobs[*b].registry];
                let ranged = if r.resumable { "ranged" } else { "whole blobs" };
                format!("blob {b} ({:?}, {ranged})", r.speed)
            }
            None => format!("flow {id}"),
        }
    }

    pub fn last_gone(&self) -> Option<Instant> {
        self.world.lock().unwrap().last_gone
    }

    /// A connection stopped waiting for a slot: every piece is claimed by others.
    pub(super) fn gave_up_waiting(&self) {
        self.changed();
        self.world.lock().unwrap().last_gone = Some(Instant::now());
    }

    /// Downloads stopped and not yet seen to have let go, with when they were stopped and their
    /// blob; `keep` says which are still to be watched.
    pub fn watch_stopping(&self, mut keep: impl FnMut(&Arc<Flow>, Instant, usize) -> bool) {
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
    /// which joins the running downloads of its blobs or starts them.
    pub fn arrive(self: &Arc<Self>, p: usize) {
        let mut w = self.world.lock().unwrap();
        w.arrived += 1;
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
        let mut waiting = Vec::new();
        for &b in &self.sc.images[image] {
            if w.blob_done[b] {
                continue;
            }
            waiting.push(b);
            match &mut w.downloads[b] {
                Some((dl, interest)) => {
                    *interest += 1;
                    dl.flow.add_demand(&demand);
                }
                None => self.start_download(&mut w, b, &demand),
            }
        }
        self.event(
            &mut w,
            format!("pod-{p} pulls image {image}, waiting for blobs {waiting:?}"),
        );
        if waiting.is_empty() {
            return;
        }
        let pi = w.pulls.len();
        w.pulls.push(Pull {
            image,
            demand,
            pods: vec![p],
            waiting,
        });
        w.running[image] = Some(pi);
        w.pod_pull[p] = Some(pi);
    }

    /// Pod `p` is deleted: it leaves its pull, which stops if nobody else waits for it.
    pub fn leave(&self, p: usize) {
        let mut w = self.world.lock().unwrap();
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

    fn end_pull(&self, w: &mut World, pi: usize, why: &str) {
        let image = w.pulls[pi].image;
        w.running[image] = None;
        for p in std::mem::take(&mut w.pulls[pi].pods) {
            w.pod_pull[p] = None;
        }
        let demand = w.pulls[pi].demand.clone();
        for b in std::mem::take(&mut w.pulls[pi].waiting) {
            self.release_blob(w, b, &demand);
        }
        self.event(w, format!("pull of image {image} ends: {why}"));
    }

    /// A pull no longer wants blob `b`: a download nobody wants stops.
    fn release_blob(&self, w: &mut World, b: usize, demand: &Arc<Demand>) {
        let Some((dl, interest)) = &mut w.downloads[b] else {
            return;
        };
        dl.flow.remove_demand(demand);
        *interest -= 1;
        if *interest > 0 {
            return;
        }
        let dl = dl.clone();
        w.downloads[b] = None;
        dl.stop.cancel();
        let now = Instant::now();
        w.stopping.push((dl.flow.clone(), now, b));
        w.last_gone = Some(now);
        self.event(w, format!("blob {b} stopped: no pull wants it"));
    }

    fn start_download(self: &Arc<Self>, w: &mut World, b: usize, demand: &Arc<Demand>) {
        let flow = Flow::new();
        flow.add_demand(demand);
        w.flows.push((flow.clone(), b));
        let spec = self.sc.blobs[b].clone();
        let reg = self.sc.registries[spec.registry].clone();
        let dl = Arc::new(Download::new(b, flow, spec, reg));
        w.downloads[b] = Some((dl.clone(), 1));
        self.event(w, format!("blob {b} download starts"));
        let sim = self.clone();
        tokio::spawn(async move {
            let end = AssertUnwindSafe(dl.run(&sim)).catch_unwind().await;
            match end {
                Ok(end) => sim.download_ended(&dl, end),
                Err(panic) => {
                    let msg = panic
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                        .unwrap_or_default();
                    sim.violated(format!("blob {b}'s download panicked: {msg}"));
                }
            }
        });
    }

    fn download_ended(&self, dl: &Arc<Download>, end: End) {
        let mut w = self.world.lock().unwrap();
        // Its other connections stopped waiting for slots.
        w.last_gone = Some(Instant::now());
        let b = dl.blob;
        self.event(&mut w, format!("blob {b} ends: {end:?}"));
        match &end {
            End::Done => w.counts.done += 1,
            End::GaveUp(_) => w.counts.gave_up += 1,
            End::Stalled(_) => w.counts.stalled += 1,
            End::Stopped => {
                w.counts.stopped += 1;
                return;
            }
        }
        if w.downloads[b]
            .as_ref()
            .is_some_and(|(d, _)| Arc::ptr_eq(d, dl))
        {
            w.downloads[b] = None;
        }
        if end == End::Done {
            w.blob_done[b] = true;
        }
        for pi in 0..w.pulls.len() {
            if !w.pulls[pi].waiting.contains(&b) {
                continue;
            }
            w.pulls[pi].waiting.retain(|&x| x != b);
            match &end {
                End::Done if w.pulls[pi].waiting.is_empty() => {
                    self.end_pull(&mut w, pi, "every blob is in")
                }
                End::Done => {}
                End::GaveUp(e) | End::Stalled(e) => {
                    let why = format!("failed: {e}");
                    self.end_pull(&mut w, pi, &why)
                }
                End::Stopped => unreachable!(),
            }
        }
    }

    /// A connection of `dl` got `lease`. A struck flow is granted only a slot no other flow
    /// asked for first (invariant 7).
    pub(super) fn granted(&self, dl: &Download, lease: &Lease) {
        {
            let mut w = self.world.lock().unwrap();
            w.counts.grants += 1;
            self.event(
                &mut w,
                format!("blob {} granted slot {}", dl.blob, lease.id()),
            );
        }
        if dl.flow.strikes() == 0 || dl.flow.is_resumable() {
            return;
        }
        let v = self.sched.view();
        let struck = |f: u64| v.flows.iter().any(|x| x.id == f && x.struck);
        if let Some(o) = v
            .waiters
            .iter()
            .find(|o| o.id < lease.id() && !struck(o.flow))
        {
            let other = self.name(o.flow);
            self.violated(format!(
                "(7) blob {} (struck: it cannot resume and lost a slot) was granted slot {} while waiter {} of {other} (not struck) asked before",
                dl.blob,
                lease.id(),
                o.id,
            ));
        }
    }

    /// A connection of `dl` sees its lease revoked: the scheduler revokes only for a flow that
    /// is not struck (invariant 7), which still waits now, or got a slot or left at this very
    /// instant (a connection whose pieces were all claimed by others stops waiting, and the
    /// scheduler may have revoked a slot for it just before).
    pub(super) fn revoked(&self, dl: &Download, lease: &Lease) {
        {
            let mut w = self.world.lock().unwrap();
            w.counts.revocations += 1;
            self.event(
                &mut w,
                format!(
                    "blob {} slot {} revoked (strikes {})",
                    dl.blob,
                    lease.id(),
                    dl.flow.strikes()
                ),
            );
        }
        let v = self.sched.view();
        let now = Instant::now();
        let struck = |f: u64| v.flows.iter().any(|x| x.id == f && x.struck);
        let for_someone = v.waiters.iter().any(|o| !struck(o.flow))
            || v.grants
                .iter()
                .any(|g| g.live && g.since == now && !struck(g.flow))
            || self.last_gone() == Some(now);
        if !for_someone {
            self.violated(format!(
                "(7) blob {}'s slot {} was revoked while only struck flows wait (they revoke nobody)",
                dl.blob,
                lease.id()
            ));
        }
    }
}

//! The fair transfer scheduler: shares the node's blob transfer connections between the
//! requesters (pod sandboxes and plain calls) that want downloads.
//!
//! Every request that transfers blob bytes holds a **lease** on one of a fixed number of slots
//! (`pull.max_concurrent_transfers`; small blobs have a lane of their own, so they never wait behind
//! large transfers). A blob download is a **flow**: it asks for one lease per connection, and
//! the requesters it serves are those of the pulls holding it ([`Demand`]), each with a weight
//! (its priority). How the slots are shared:
//!
//! - **Usage.** Each granted connection is charged to the requesters of its flow, split evenly
//!   between them; a requester's usage is its charge divided by its weight. A flow's **score** is
//!   the lowest usage among its requesters: how well served the least served of them is.
//! - **Granting.** A free slot goes to the waiting flow with the lowest score (first connections
//!   before extra ones of a multi-connection blob, then the oldest request). Slots are never left
//!   idle while someone waits: one pull alone takes every slot it can use.
//! - **Giving back.** When a flow waits and no slot is free, a granted connection is revoked if
//!   moving it makes the shares fairer: the victim's flow keeps a score at least the waiter's
//!   (strictly higher for a prompt revocation). Extra connections of a multi-connection blob go
//!   first (after [`EXTRA_TENURE`]), then sole connections (after [`SOLE_TENURE`]); a connection
//!   whose rate is below [`SLOW_FRACTION`] of the node's average per connection is a laggard and
//!   goes before faster ones. Among equally served flows (more requesters than slots) the slots
//!   rotate every [`QUANTUM`], except that a flow that never had a connection takes the slot of
//!   one held for [`SOLE_TENURE`]: a new pull gets its first connection within about a second.
//! - A revoked connection of a flow that can resume where it stopped (the registry answers ranged
//!   requests, [`Flow::set_resumable`]) stops its request at once; the bytes received stay on
//!   disk, and the flow asks for a slot again.
//! - A connection that **cannot resume** (its registry sends whole blobs) loses what it received
//!   when revoked, so it is spared while it is about to finish: it is revoked under the same
//!   rules only once its rate is known ([`RATE_AFTER`]) and either it would still hold the slot
//!   a [`QUANTUM`] from now at that rate ([`Flow::set_left`]) or the waiter has waited a
//!   [`QUANTUM`] already. Its flow then has a **strike**: it starts again from byte 0 only in a
//!   slot nobody else waits for (its request never revokes another), and after [`MAX_STRIKES`]
//!   the download gives up with a message naming the registry. A trickle that cannot resume thus
//!   holds no slot, large lane or small, against a waiter for longer than the quantum.
//!
//! The bound this gives: a flow waiting while a slot is held by a flow that is better served than
//! it (the holder's requesters keep at least its share without that slot) gets a slot within
//! [`SOLE_TENURE`] of the holder's grant for a resumable holder, within [`QUANTUM`] of its own
//! request for one that cannot resume, plus a [`TICK`] ([`Scheduler::wait_bound`]).
//!
//! The scheduler only decides who holds slots; time spent waiting for one is not a stall (the
//! pull's watchdog judges bytes only while a connection runs: [`Flow::connections`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::time::Instant;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

/// An extra connection of a multi-connection blob may be revoked after this long.
pub const EXTRA_TENURE: Duration = Duration::from_millis(250);
/// A blob's only connection may be revoked (for a fairer share, or for a flow that never had a
/// connection) after this long: long enough to get a request going.
pub const SOLE_TENURE: Duration = Duration::from_secs(1);
/// Among equally served flows, a connection keeps its slot at least this long.
pub const QUANTUM: Duration = Duration::from_secs(10);
/// A connection delivering less than this fraction of the node's average rate per connection (over
/// at least [`RATE_AFTER`]) is a laggard: it is revoked before faster ones, and after
/// [`RATE_AFTER`] even among equals.
pub const SLOW_FRACTION: f64 = 0.25;
/// Rates are judged only once a connection has run this long.
pub const RATE_AFTER: Duration = Duration::from_secs(2);
/// How often waiting flows are reconsidered (tenures pass, rates change).
pub const TICK: Duration = Duration::from_millis(200);
/// Times a download that cannot resume may have its slot revoked before it gives up.
pub const MAX_STRIKES: u32 = 3;

/// The default weight of a requester; a priority scales it.
pub const NORMAL_WEIGHT: u32 = 2;

/// The requesters a pull serves now, with their weights: shared by a pull and the flows of its
/// blobs, and updated as requesters join and leave.
#[derive(Debug, Default)]
pub struct Demand {
    requesters: Mutex<Vec<(String, u32)>>,
}

impl Demand {
    pub fn new() -> Arc<Demand> {
        Arc::new(Demand::default())
    }

    /// Replaces the requesters (key, weight).
    pub fn set(&self, requesters: impl IntoIterator<Item = (String, u32)>) {
        *self.requesters.lock().unwrap() = requesters.into_iter().collect();
    }

    pub fn requesters(&self) -> Vec<(String, u32)> {
        self.requesters.lock().unwrap().clone()
    }
}

/// One blob download's claim on the scheduler: who it serves and how it is going.
#[derive(Debug)]
pub struct Flow {
    id: u64,
    demands: Mutex<Vec<Arc<Demand>>>,
    resumable: AtomicBool,
    connections: AtomicUsize,
    /// Whether it ever held a slot.
    granted_once: AtomicBool,
    /// Bytes it still has to receive (`u64::MAX`: unknown), for the time a connection that
    /// cannot resume would still hold its slot.
    left: AtomicU64,
    /// Connections revoked while it could not resume.
    strikes: AtomicU32,
}

impl Flow {
    pub fn new() -> Arc<Flow> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Arc::new(Flow {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            demands: Mutex::new(Vec::new()),
            resumable: AtomicBool::new(false),
            connections: AtomicUsize::new(0),
            granted_once: AtomicBool::new(false),
            left: AtomicU64::new(u64::MAX),
            strikes: AtomicU32::new(0),
        })
    }

    /// Bytes the flow still has to receive.
    pub fn set_left(&self, bytes: u64) {
        self.left.store(bytes, Ordering::Relaxed);
    }

    /// Connections of this flow revoked while it could not resume: each cost it the bytes it had
    /// received.
    pub fn strikes(&self) -> u32 {
        self.strikes.load(Ordering::Relaxed)
    }

    pub fn is_resumable(&self) -> bool {
        self.resumable.load(Ordering::Relaxed)
    }

    /// A flow that lost a connection it could not resume: it waits for a slot nobody else
    /// wants, and its requests revoke no other.
    pub(crate) fn struck(&self) -> bool {
        !self.is_resumable() && self.strikes() > 0
    }

    /// A pull now wants this blob (one call per holder; [`Flow::remove_demand`] undoes it).
    pub fn add_demand(&self, d: &Arc<Demand>) {
        self.demands.lock().unwrap().push(d.clone());
    }

    pub fn remove_demand(&self, d: &Arc<Demand>) {
        let mut v = self.demands.lock().unwrap();
        if let Some(i) = v.iter().position(|x| Arc::ptr_eq(x, d)) {
            v.swap_remove(i);
        }
    }

    /// Whether a revoked connection can resume where it stopped (ranged requests work).
    pub fn set_resumable(&self, yes: bool) {
        self.resumable.store(yes, Ordering::Relaxed);
    }

    /// Connections holding a slot now.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::Relaxed)
    }

    #[cfg(test)]
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// The requesters served, each once with its highest weight; a flow serving nobody (its
    /// pulls are between requesters) counts as a requester of its own.
    fn requesters(&self) -> Vec<(String, u32)> {
        let mut out: Vec<(String, u32)> = Vec::new();
        for d in self.demands.lock().unwrap().iter() {
            for (k, w) in d.requesters() {
                match out.iter_mut().find(|(o, _)| *o == k) {
                    Some((_, ow)) => *ow = (*ow).max(w),
                    None => out.push((k, w)),
                }
            }
        }
        if out.is_empty() {
            out.push((format!("flow:{}", self.id), NORMAL_WEIGHT));
        }
        out
    }
}

/// A held slot. Dropping it frees the slot.
pub struct Lease {
    sched: Weak<Scheduler>,
    id: u64,
    flow: Arc<Flow>,
    bytes: Arc<AtomicU64>,
    revoked: CancellationToken,
}

impl Lease {
    /// Counts bytes this connection received (its rate decides whether it lags).
    pub fn add_bytes(&self, n: u64) {
        self.bytes.fetch_add(n, Ordering::Relaxed);
    }

    /// Resolves when the scheduler takes the slot back: stop the request and drop the lease.
    pub async fn revoked(&self) {
        self.revoked.cancelled().await
    }

    pub fn is_revoked(&self) -> bool {
        self.revoked.is_cancelled()
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.flow.connections.fetch_sub(1, Ordering::Relaxed);
        if let Some(s) = self.sched.upgrade() {
            s.release(self.id);
        }
    }
}

struct Grant {
    flow: Arc<Flow>,
    since: Instant,
    bytes: Arc<AtomicU64>,
    revoked: CancellationToken,
    /// Start of the current rate window: when, and the bytes then.
    mark: (Instant, u64),
    /// Bytes per second over the last whole window, once there was one.
    rate: Option<f64>,
}

impl Grant {
    fn live(&self) -> bool {
        !self.revoked.is_cancelled()
    }
}

struct Waiter {
    id: u64,
    flow: Arc<Flow>,
    /// An extra connection of a flow that has one already.
    extra: bool,
    /// When it asked.
    since: Instant,
    tx: Option<oneshot::Sender<Lease>>,
}

#[derive(Default)]
struct State {
    next: u64,
    /// In grant order (ids grow): victims that rank equal are told apart the same way on every
    /// run (the oldest grant), so a schedule replays exactly.
    grants: BTreeMap<u64, Grant>,
    /// In arrival order.
    waiters: Vec<Waiter>,
    ticking: bool,
}

/// Counts since start, for metrics.
#[derive(Debug, Default)]
pub struct SchedCounters {
    pub granted: AtomicU64,
    pub revoked: AtomicU64,
    /// Of the revocations, those of connections that could not resume (their bytes lost).
    pub struck: AtomicU64,
}

/// Slots shared fairly; see the module docs.
pub struct Scheduler {
    capacity: usize,
    state: Mutex<State>,
    counters: SchedCounters,
}

/// A snapshot, for the admin API and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedSnapshot {
    pub capacity: usize,
    pub granted: usize,
    pub waiting: usize,
}

/// Removes a waiter whose `acquire` future was dropped before it was answered.
struct Queued<'a> {
    sched: &'a Arc<Scheduler>,
    id: u64,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        let gone = {
            let mut st = self.sched.state.lock().unwrap();
            let before = st.waiters.len();
            st.waiters.retain(|w| w.id != self.id);
            st.waiters.len() != before
        };
        // A revocation may have been made for it: let another waiter have the slot.
        if gone {
            self.sched.dispatch();
        }
    }
}

impl Scheduler {
    pub fn new(capacity: usize) -> Arc<Scheduler> {
        Arc::new(Scheduler {
            capacity: capacity.max(1),
            state: Mutex::new(State::default()),
            counters: SchedCounters::default(),
        })
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn counters(&self) -> &SchedCounters {
        &self.counters
    }

    pub fn snapshot(&self) -> SchedSnapshot {
        let st = self.state.lock().unwrap();
        SchedSnapshot {
            capacity: self.capacity,
            granted: st.grants.len(),
            waiting: st.waiters.len(),
        }
    }

    /// Waits for a slot for one connection of `flow`. Cancel-safe: dropping the future gives up
    /// the place in the queue (or the slot, if it was granted meanwhile).
    pub async fn acquire(self: &Arc<Self>, flow: &Arc<Flow>) -> Lease {
        let (tx, rx) = oneshot::channel();
        let id = {
            let mut st = self.state.lock().unwrap();
            st.next += 1;
            let id = st.next;
            st.waiters.push(Waiter {
                id,
                flow: flow.clone(),
                extra: flow.connections() > 0,
                since: Instant::now(),
                tx: Some(tx),
            });
            id
        };
        let _queued = Queued { sched: self, id };
        self.dispatch();
        self.start_ticking();
        rx.await
            .expect("a waiter is answered before it leaves the queue")
    }

    fn start_ticking(self: &Arc<Self>) {
        {
            let mut st = self.state.lock().unwrap();
            if st.ticking || st.waiters.is_empty() {
                return;
            }
            st.ticking = true;
        }
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(TICK).await;
                let Some(s) = weak.upgrade() else { return };
                {
                    let mut st = s.state.lock().unwrap();
                    if st.waiters.is_empty() {
                        st.ticking = false;
                        return;
                    }
                }
                s.dispatch();
            }
        });
    }

    fn release(self: &Arc<Self>, id: u64) {
        self.state.lock().unwrap().grants.remove(&id);
        self.dispatch();
    }

    /// Grants free slots to the best waiters and revokes connections for the others where the
    /// rules allow. Leases are handed over after the lock is let go (a waiter that gave up drops
    /// its lease, which frees the slot again through [`Scheduler::release`]).
    fn dispatch(self: &Arc<Self>) {
        let mut handed = Vec::new();
        {
            let mut st = self.state.lock().unwrap();
            let now = Instant::now();
            for g in st.grants.values_mut() {
                let bytes = g.bytes.load(Ordering::Relaxed);
                let span = now.duration_since(g.mark.0);
                if span >= RATE_AFTER {
                    g.rate = Some((bytes - g.mark.1) as f64 / span.as_secs_f64());
                    g.mark = (now, bytes);
                }
            }
            let mut usage = Usage::of(&st.grants);
            let order = waiter_order(&st.waiters, &mut usage);
            // Free slots to the best waiters.
            let free = self.capacity.saturating_sub(st.grants.len());
            for &wi in order.iter().take(free) {
                let flow = st.waiters[wi].flow.clone();
                let tx = st.waiters[wi].tx.take().expect("answered once");
                let lease = self.grant(&mut st, &flow, now);
                handed.push((tx, lease));
            }
            st.waiters.retain(|w| w.tx.is_some());
            if !st.waiters.is_empty() {
                let mut usage = Usage::of(&st.grants);
                self.revoke_for_waiters(&mut st, &mut usage, now);
            }
        }
        for (tx, lease) in handed {
            // A waiter gone meanwhile: the lease drops here, outside the lock, and frees its slot.
            let _ = tx.send(lease);
        }
    }

    /// With every slot taken: revokes one connection for each waiter (best first) that a
    /// connection may be revoked for, counting the revocations already under way. Waiters of
    /// struck flows ([`Flow::struck`]) revoke nothing: they wait for a free slot.
    fn revoke_for_waiters(&self, st: &mut State, usage: &mut Usage, now: Instant) {
        let mut planned = st.grants.values().filter(|g| !g.live()).count();
        let order = waiter_order(&st.waiters, usage);
        let avg = average_rate(&st.grants);
        let eager = st.waiters.iter().filter(|w| !w.flow.struck()).count();
        for wi in order.into_iter().skip(planned) {
            if planned >= eager {
                break;
            }
            let w = &st.waiters[wi];
            if w.flow.struck() {
                continue;
            }
            let Some(vid) = pick_victim(&st.grants, w, usage, avg, now) else {
                continue;
            };
            let g = &st.grants[&vid];
            let held_ms = now.duration_since(g.since).as_millis() as u64;
            if g.flow.is_resumable() {
                tracing::debug!(
                    flow = g.flow.id,
                    for_flow = w.flow.id,
                    held_ms,
                    "transfer slot revoked for a fairer share"
                );
            } else {
                let strikes = g.flow.strikes.fetch_add(1, Ordering::Relaxed) + 1;
                self.counters.struck.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    flow = g.flow.id,
                    for_flow = w.flow.id,
                    held_ms,
                    bytes_per_second = g.rate.unwrap_or(0.0) as u64,
                    strikes,
                    "transfer slot taken back from a download that cannot resume (its registry ignores Range); it starts again from byte 0 in a free slot"
                );
            }
            g.revoked.cancel();
            usage.remove(&g.flow);
            self.counters.revoked.fetch_add(1, Ordering::Relaxed);
            planned += 1;
        }
    }

    /// How long a waiter may wait while a slot is held by a better-served flow (module docs).
    pub fn wait_bound() -> Duration {
        QUANTUM.max(SOLE_TENURE + RATE_AFTER) + 2 * TICK
    }

    /// Who holds slots and who waits, as plain data, for the simulation's invariant checks.
    #[cfg(test)]
    pub(crate) fn view(&self) -> SchedView {
        let st = self.state.lock().unwrap();
        let mut flows: Vec<FlowView> = Vec::new();
        let mut note = |f: &Arc<Flow>| {
            if !flows.iter().any(|v| v.id == f.id) {
                flows.push(FlowView {
                    id: f.id,
                    requesters: f.requesters(),
                    struck: f.struck(),
                    resumable: f.is_resumable(),
                });
            }
        };
        let grants = st
            .grants
            .iter()
            .map(|(&id, g)| {
                note(&g.flow);
                GrantView {
                    id,
                    flow: g.flow.id,
                    live: g.live(),
                    since: g.since,
                }
            })
            .collect();
        let waiters = st
            .waiters
            .iter()
            .map(|w| {
                note(&w.flow);
                WaiterView {
                    id: w.id,
                    flow: w.flow.id,
                    since: w.since,
                }
            })
            .collect();
        SchedView {
            capacity: self.capacity,
            grants,
            waiters,
            flows,
            ticking: st.ticking,
        }
    }

    fn grant(self: &Arc<Self>, st: &mut State, flow: &Arc<Flow>, now: Instant) -> Lease {
        st.next += 1;
        let id = st.next;
        let bytes = Arc::new(AtomicU64::new(0));
        let revoked = CancellationToken::new();
        flow.connections.fetch_add(1, Ordering::Relaxed);
        flow.granted_once.store(true, Ordering::Relaxed);
        st.grants.insert(
            id,
            Grant {
                flow: flow.clone(),
                since: now,
                bytes: bytes.clone(),
                revoked: revoked.clone(),
                mark: (now, 0),
                rate: None,
            },
        );
        self.counters.granted.fetch_add(1, Ordering::Relaxed);
        Lease {
            sched: Arc::downgrade(self),
            id,
            flow: flow.clone(),
            bytes,
            revoked,
        }
    }
}

/// Usages closer than this are equal.
pub(crate) const EPS: f64 = 1e-9;

/// The scheduler's state as plain data ([`Scheduler::view`]).
#[cfg(test)]
#[derive(Debug, Clone)]
pub(crate) struct SchedView {
    pub capacity: usize,
    /// In grant order, revoked ones (not yet given back) included.
    pub grants: Vec<GrantView>,
    /// In arrival order.
    pub waiters: Vec<WaiterView>,
    /// The flows of those grants and waiters.
    pub flows: Vec<FlowView>,
    /// Whether the task reconsidering waiters every [`TICK`] runs.
    pub ticking: bool,
}

#[cfg(test)]
#[derive(Debug, Clone)]
pub(crate) struct GrantView {
    pub id: u64,
    pub flow: u64,
    /// Not revoked.
    pub live: bool,
    pub since: Instant,
}

#[cfg(test)]
#[derive(Debug, Clone)]
pub(crate) struct WaiterView {
    pub id: u64,
    pub flow: u64,
    pub since: Instant,
}

#[cfg(test)]
#[derive(Debug, Clone)]
pub(crate) struct FlowView {
    pub id: u64,
    /// As the scheduler counts them: each key once with its highest weight.
    pub requesters: Vec<(String, u32)>,
    pub struck: bool,
    pub resumable: bool,
}

/// Waiter indices, best first: struck flows last (they wait for a free slot), then lowest
/// score, first connections before extra ones, oldest.
fn waiter_order(waiters: &[Waiter], usage: &mut Usage) -> Vec<usize> {
    let scores: Vec<f64> = waiters.iter().map(|w| usage.score(&w.flow)).collect();
    let mut order: Vec<usize> = (0..waiters.len()).collect();
    order.sort_by(|&a, &b| {
        (waiters[a].flow.struck())
            .cmp(&waiters[b].flow.struck())
            .then(scores[a].total_cmp(&scores[b]))
            .then(waiters[a].extra.cmp(&waiters[b].extra))
            .then(waiters[a].id.cmp(&waiters[b].id))
    });
    order
}

/// Every requester's usage (connections charged to it, divided by its relative weight), from the
/// live grants.
struct Usage {
    by_requester: HashMap<String, f64>,
    flows: HashMap<u64, Vec<(String, u32)>>,
}

impl Usage {
    fn of(grants: &BTreeMap<u64, Grant>) -> Usage {
        let mut u = Usage {
            by_requester: HashMap::new(),
            flows: HashMap::new(),
        };
        for g in grants.values().filter(|g| g.live()) {
            u.add(&g.flow, 1.0);
        }
        u
    }

    fn requesters(&mut self, flow: &Flow) -> Vec<(String, u32)> {
        self.flows
            .entry(flow.id)
            .or_insert_with(|| flow.requesters())
            .clone()
    }

    /// What one connection of `flow` adds to requester `weight`'s usage.
    fn share(n: usize, weight: u32) -> f64 {
        (1.0 / n as f64) * (NORMAL_WEIGHT as f64 / weight.max(1) as f64)
    }

    fn add(&mut self, flow: &Flow, sign: f64) {
        let rs = self.requesters(flow);
        for (k, w) in &rs {
            *self.by_requester.entry(k.clone()).or_default() += sign * Self::share(rs.len(), *w);
        }
    }

    fn remove(&mut self, flow: &Flow) {
        self.add(flow, -1.0);
    }

    /// How well the least served requester of `flow` is served.
    fn score(&mut self, flow: &Flow) -> f64 {
        let rs = self.requesters(flow);
        rs.iter()
            .map(|(k, _)| self.by_requester.get(k).copied().unwrap_or(0.0))
            .fold(f64::INFINITY, f64::min)
    }

    /// `flow`'s score once it lost one connection.
    fn score_without_one(&mut self, flow: &Flow) -> f64 {
        let rs = self.requesters(flow);
        rs.iter()
            .map(|(k, w)| {
                self.by_requester.get(k).copied().unwrap_or(0.0) - Self::share(rs.len(), *w)
            })
            .fold(f64::INFINITY, f64::min)
    }
}

/// The node's average rate per connection, over the connections with a measured rate.
fn average_rate(grants: &BTreeMap<u64, Grant>) -> Option<f64> {
    let rates: Vec<f64> = grants
        .values()
        .filter(|g| g.live())
        .filter_map(|g| g.rate)
        .collect();
    (!rates.is_empty()).then(|| rates.iter().sum::<f64>() / rates.len() as f64)
}

/// How much a connection is preferred as a victim: one that can resume, an extra connection, a
/// laggard, its flow's score once it lost it, minus its rate, how long it was held (higher first,
/// in that order).
type VictimRank = (bool, bool, bool, f64, f64, Duration);

/// The connection to revoke for waiter `w`, if the rules (module docs) allow one.
fn pick_victim(
    grants: &BTreeMap<u64, Grant>,
    w: &Waiter,
    usage: &mut Usage,
    avg_rate: Option<f64>,
    now: Instant,
) -> Option<u64> {
    let want = usage.score(&w.flow);
    let newcomer = !w.flow.granted_once.load(Ordering::Relaxed);
    let waited = now.duration_since(w.since);
    let mut live_per_flow: HashMap<u64, usize> = HashMap::new();
    for g in grants.values().filter(|g| g.live()) {
        *live_per_flow.entry(g.flow.id).or_default() += 1;
    }
    let mut best: Option<(u64, VictimRank)> = None;
    for (&id, g) in grants {
        if !g.live() || g.flow.id == w.flow.id {
            continue;
        }
        let resumable = g.flow.is_resumable();
        let held = now.duration_since(g.since);
        let extra = live_per_flow.get(&g.flow.id).copied().unwrap_or(0) > 1;
        if held < if extra { EXTRA_TENURE } else { SOLE_TENURE } {
            continue;
        }
        // Revoking a connection that cannot resume loses its bytes: not before its rate is
        // known, nor while it would finish within the quantum, unless the waiter has waited that.
        if !resumable {
            if held < RATE_AFTER || g.rate.is_none() {
                continue;
            }
            let left = g.flow.left.load(Ordering::Relaxed) as f64;
            let finishes = g
                .rate
                .is_some_and(|r| r > 0.0 && left / r <= QUANTUM.as_secs_f64());
            if finishes && waited < QUANTUM {
                continue;
            }
        }
        let slow = held >= RATE_AFTER
            && match (g.rate, avg_rate) {
                (Some(r), Some(avg)) => r < SLOW_FRACTION * avg,
                _ => false,
            };
        let after = usage.score_without_one(&g.flow);
        let fairer = after > want + EPS;
        let level = after >= want - EPS;
        let allowed = fairer || (level && (slow || newcomer || held >= QUANTUM));
        if !allowed {
            continue;
        }
        // Connections that can resume first, then extra connections, then laggards, then the
        // best served, then the slowest, then the longest held.
        let rank = (resumable, extra, slow, after, -g.rate.unwrap_or(0.0), held);
        let better = match &best {
            None => true,
            Some((_, b)) => (rank.0, rank.1, rank.2)
                .cmp(&(b.0, b.1, b.2))
                .then(rank.3.total_cmp(&b.3))
                .then(rank.4.total_cmp(&b.4))
                .then(rank.5.cmp(&b.5))
                .is_gt(),
        };
        if better {
            best = Some((id, rank));
        }
    }
    best.map(|(id, _)| id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc;

    /// A flow serving `who` (requester key, weight), resumable.
    fn flow(who: &[(&str, u32)]) -> Arc<Flow> {
        let d = Demand::new();
        d.set(who.iter().map(|(k, w)| (k.to_string(), *w)));
        let f = Flow::new();
        f.add_demand(&d);
        f.set_resumable(true);
        f
    }

    #[derive(Debug, PartialEq, Eq)]
    enum Ev {
        Granted(&'static str),
        Revoked(&'static str),
    }

    /// A connection of `f` that takes a slot, counts `rate` bytes per 100 ms while it holds it,
    /// and gives it back when revoked, then asks again if `again`.
    fn connection(
        s: &Arc<Scheduler>,
        f: &Arc<Flow>,
        name: &'static str,
        rate: u64,
        again: bool,
        events: &mpsc::UnboundedSender<Ev>,
    ) -> tokio::task::JoinHandle<()> {
        let (s, f, events) = (s.clone(), f.clone(), events.clone());
        tokio::spawn(async move {
            loop {
                let lease = s.acquire(&f).await;
                let _ = events.send(Ev::Granted(name));
                loop {
                    tokio::select! {
                        _ = lease.revoked() => break,
                        _ = tokio::time::sleep(Duration::from_millis(100)) => lease.add_bytes(rate),
                    }
                }
                drop(lease);
                let _ = events.send(Ev::Revoked(name));
                if !again {
                    return;
                }
            }
        })
    }

    async fn next(rx: &mut mpsc::UnboundedReceiver<Ev>) -> (Ev, Duration) {
        let start = Instant::now();
        let ev = tokio::time::timeout(Duration::from_secs(3600), rx.recv())
            .await
            .expect("an event within the hour")
            .expect("senders alive");
        (ev, start.elapsed())
    }

    #[tokio::test(start_paused = true)]
    async fn one_flow_alone_takes_every_slot() {
        let s = Scheduler::new(4);
        let a = flow(&[("a", NORMAL_WEIGHT)]);
        let (tx, mut rx) = mpsc::unbounded_channel();
        for _ in 0..4 {
            connection(&s, &a, "a", 1000, false, &tx);
        }
        for _ in 0..4 {
            assert_eq!(next(&mut rx).await, (Ev::Granted("a"), Duration::ZERO));
        }
        assert_eq!(s.snapshot().granted, 4);
        // Nobody waits: nothing is revoked, however long.
        tokio::time::sleep(QUANTUM * 3).await;
        assert!(rx.try_recv().is_err());
        assert_eq!(s.counters().revoked.load(Ordering::Relaxed), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_newcomer_gets_an_extra_connection_of_a_multi_connection_blob_at_once() {
        let s = Scheduler::new(4);
        let a = flow(&[("a", NORMAL_WEIGHT)]);
        let b = flow(&[("b", NORMAL_WEIGHT)]);
        let (tx, mut rx) = mpsc::unbounded_channel();
        for _ in 0..4 {
            connection(&s, &a, "a", 1000, true, &tx);
        }
        for _ in 0..4 {
            next(&mut rx).await;
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
        connection(&s, &b, "b", 1000, false, &tx);
        assert_eq!(next(&mut rx).await.0, Ev::Revoked("a"));
        let (ev, took) = next(&mut rx).await;
        assert_eq!(ev, Ev::Granted("b"));
        assert!(took <= TICK, "{took:?}");
        // a's connection asks again and waits: 3 against 1 is as fair as 2 against 2 gets for
        // one connection of b's.
        tokio::time::sleep(QUANTUM * 3).await;
        assert!(rx.try_recv().is_err(), "no further revocation");
        assert_eq!(s.snapshot().waiting, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn shares_even_out_between_two_flows_wanting_every_slot() {
        let s = Scheduler::new(6);
        let a = flow(&[("a", NORMAL_WEIGHT)]);
        let b = flow(&[("b", NORMAL_WEIGHT)]);
        let (tx, mut rx) = mpsc::unbounded_channel();
        for _ in 0..6 {
            connection(&s, &a, "a", 1000, true, &tx);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        for _ in 0..6 {
            connection(&s, &b, "b", 1000, true, &tx);
        }
        tokio::time::sleep(Duration::from_secs(30)).await;
        while rx.try_recv().is_ok() {}
        assert_eq!((a.connections(), b.connections()), (3, 3));
    }

    #[tokio::test(start_paused = true)]
    async fn a_higher_weight_gets_a_larger_share() {
        let s = Scheduler::new(6);
        let a = flow(&[("a", 2 * NORMAL_WEIGHT)]);
        let b = flow(&[("b", NORMAL_WEIGHT)]);
        let (tx, _rx) = mpsc::unbounded_channel();
        for _ in 0..6 {
            connection(&s, &b, "b", 1000, true, &tx);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        for _ in 0..6 {
            connection(&s, &a, "a", 1000, true, &tx);
        }
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert_eq!((a.connections(), b.connections()), (4, 2));
    }

    #[tokio::test(start_paused = true)]
    async fn a_newcomer_takes_a_sole_connection_within_a_second_and_equals_rotate_per_quantum() {
        let s = Scheduler::new(1);
        let a = flow(&[("a", NORMAL_WEIGHT)]);
        let b = flow(&[("b", NORMAL_WEIGHT)]);
        let (tx, mut rx) = mpsc::unbounded_channel();
        connection(&s, &a, "a", 1000, true, &tx);
        assert_eq!(next(&mut rx).await.0, Ev::Granted("a"));
        tokio::time::sleep(Duration::from_secs(30)).await;
        let asked = Instant::now();
        connection(&s, &b, "b", 1000, true, &tx);
        assert_eq!(next(&mut rx).await.0, Ev::Revoked("a"));
        assert_eq!(next(&mut rx).await.0, Ev::Granted("b"));
        assert!(
            asked.elapsed() <= Duration::from_secs(1),
            "{:?}",
            asked.elapsed()
        );
        // a had its turn: it waits for b's quantum, not a second.
        let (ev, after) = next(&mut rx).await;
        assert_eq!(ev, Ev::Revoked("b"));
        assert!(
            after >= QUANTUM - TICK && after <= QUANTUM + TICK,
            "{after:?}"
        );
        assert_eq!(next(&mut rx).await.0, Ev::Granted("a"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_newcomer_with_a_slot_just_granted_everywhere_waits_for_the_sole_tenure() {
        let s = Scheduler::new(1);
        let a = flow(&[("a", NORMAL_WEIGHT)]);
        let b = flow(&[("b", NORMAL_WEIGHT)]);
        let (tx, mut rx) = mpsc::unbounded_channel();
        connection(&s, &a, "a", 1000, true, &tx);
        next(&mut rx).await;
        connection(&s, &b, "b", 1000, true, &tx);
        let (ev, after) = next(&mut rx).await;
        assert_eq!(ev, Ev::Revoked("a"));
        assert!(
            after >= SOLE_TENURE && after <= SOLE_TENURE + TICK,
            "{after:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn blobs_of_one_requester_never_take_slots_from_each_other() {
        let s = Scheduler::new(1);
        let d = Demand::new();
        d.set([("a".to_string(), NORMAL_WEIGHT)]);
        let (x, y) = (Flow::new(), Flow::new());
        for f in [&x, &y] {
            f.add_demand(&d);
            f.set_resumable(true);
        }
        let (tx, mut rx) = mpsc::unbounded_channel();
        connection(&s, &x, "x", 1000, true, &tx);
        next(&mut rx).await;
        connection(&s, &y, "y", 1000, true, &tx);
        tokio::time::sleep(QUANTUM * 3).await;
        assert!(rx.try_recv().is_err(), "y waits for x to finish");
    }

    #[tokio::test(start_paused = true)]
    async fn a_trickle_that_cannot_resume_gives_its_slot_to_a_newcomer_and_waits_for_a_free_one() {
        let s = Scheduler::new(1);
        let a = flow(&[("a", NORMAL_WEIGHT)]);
        a.set_resumable(false);
        a.set_left(1 << 30);
        let b = flow(&[("b", NORMAL_WEIGHT)]);
        let (tx, mut rx) = mpsc::unbounded_channel();
        connection(&s, &a, "a", 3000, true, &tx);
        next(&mut rx).await;
        let asked = Instant::now();
        let bc = connection(&s, &b, "b", 1000, false, &tx);
        assert_eq!(next(&mut rx).await.0, Ev::Revoked("a"));
        assert_eq!(next(&mut rx).await.0, Ev::Granted("b"));
        // Not before its rate is known, and well within the bound.
        let took = asked.elapsed();
        assert!(
            took >= RATE_AFTER && took <= RATE_AFTER + 2 * TICK,
            "{took:?}"
        );
        assert_eq!(a.strikes(), 1);
        assert_eq!(s.counters().struck.load(Ordering::Relaxed), 1);
        // a waits for a free slot: it revokes nothing, however long b holds its slot.
        tokio::time::sleep(QUANTUM * 3).await;
        assert!(rx.try_recv().is_err());
        assert_eq!(s.snapshot().waiting, 1);
        bc.abort();
        assert_eq!(next(&mut rx).await.0, Ev::Granted("a"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_transfer_that_cannot_resume_and_is_about_to_finish_is_spared_for_the_quantum() {
        let s = Scheduler::new(1);
        let a = flow(&[("a", NORMAL_WEIGHT)]);
        a.set_resumable(false);
        // 1000 bytes per 100 ms: 10 kB/s, with 60 kB left it would finish in 6 s.
        a.set_left(60_000);
        let b = flow(&[("b", NORMAL_WEIGHT)]);
        let (tx, mut rx) = mpsc::unbounded_channel();
        connection(&s, &a, "a", 1000, true, &tx);
        next(&mut rx).await;
        let asked = Instant::now();
        connection(&s, &b, "b", 1000, true, &tx);
        // It does not finish (the test's connection never ends): revoked once b has waited a
        // quantum, not before.
        assert_eq!(next(&mut rx).await.0, Ev::Revoked("a"));
        let took = asked.elapsed();
        assert!(took >= QUANTUM && took <= QUANTUM + 2 * TICK, "{took:?}");
        assert!(took <= Scheduler::wait_bound(), "{took:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn struck_flows_wait_behind_every_other_waiter() {
        let s = Scheduler::new(1);
        let a = flow(&[("a", NORMAL_WEIGHT)]);
        a.set_resumable(false);
        a.strikes.store(1, Ordering::Relaxed);
        let b = flow(&[("b", NORMAL_WEIGHT)]);
        let c = flow(&[("c", NORMAL_WEIGHT)]);
        let held = s.acquire(&b).await;
        let (tx, mut rx) = mpsc::unbounded_channel();
        connection(&s, &a, "a", 1000, false, &tx);
        tokio::time::sleep(Duration::from_millis(10)).await;
        // c asked after a, yet gets the slot first; a is not granted while c waits.
        let cc = connection(&s, &c, "c", 1000, false, &tx);
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(held);
        assert_eq!(next(&mut rx).await.0, Ev::Granted("c"));
        cc.abort();
        assert_eq!(next(&mut rx).await.0, Ev::Granted("a"));
    }

    #[tokio::test(start_paused = true)]
    async fn the_laggard_goes_first() {
        let s = Scheduler::new(2);
        let fast = flow(&[("fast", NORMAL_WEIGHT)]);
        let slow = flow(&[("slow", NORMAL_WEIGHT)]);
        let (tx, mut rx) = mpsc::unbounded_channel();
        connection(&s, &fast, "fast", 1 << 20, true, &tx);
        connection(&s, &slow, "slow", 10, true, &tx);
        next(&mut rx).await;
        next(&mut rx).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
        // A flow that had a slot before (so no newcomer's privilege), and all equal: only the
        // laggard may be swapped out before the quantum.
        let c = flow(&[("c", NORMAL_WEIGHT)]);
        c.granted_once.store(true, Ordering::Relaxed);
        connection(&s, &c, "c", 1 << 20, true, &tx);
        assert_eq!(next(&mut rx).await.0, Ev::Revoked("slow"));
        assert_eq!(next(&mut rx).await.0, Ev::Granted("c"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_shared_blob_counts_half_for_each_of_its_requesters() {
        let s = Scheduler::new(2);
        let shared = flow(&[("a", NORMAL_WEIGHT), ("b", NORMAL_WEIGHT)]);
        let b_own = flow(&[("b", NORMAL_WEIGHT)]);
        let (tx, mut rx) = mpsc::unbounded_channel();
        connection(&s, &shared, "shared", 1000, true, &tx);
        connection(&s, &shared, "shared", 1000, true, &tx);
        next(&mut rx).await;
        next(&mut rx).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
        // a and b have one slot's worth each (half of two). b's own blob taking one of the
        // shared blob's would leave a with half a slot: b_own waits.
        connection(&s, &b_own, "b_own", 1000, true, &tx);
        tokio::time::sleep(QUANTUM * 3).await;
        assert!(rx.try_recv().is_err());
        // c has nothing: the shared blob's second connection goes to it (a and b keep half a
        // slot each, more than c's nothing).
        let c = flow(&[("c", NORMAL_WEIGHT)]);
        connection(&s, &c, "c", 1000, true, &tx);
        assert_eq!(next(&mut rx).await.0, Ev::Revoked("shared"));
        assert_eq!(next(&mut rx).await.0, Ev::Granted("c"));
        tokio::time::sleep(QUANTUM * 3).await;
        while rx.try_recv().is_ok() {}
        assert_eq!(
            (shared.connections(), b_own.connections(), c.connections()),
            (1, 0, 1)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_gives_up_leaves_the_queue_and_its_slot_goes_to_the_next() {
        let s = Scheduler::new(1);
        let a = flow(&[("a", NORMAL_WEIGHT)]);
        let b = flow(&[("b", NORMAL_WEIGHT)]);
        let held = s.acquire(&a).await;
        let gave_up = tokio::time::timeout(Duration::from_millis(100), s.acquire(&b)).await;
        assert!(gave_up.is_err());
        assert_eq!(s.snapshot().waiting, 0);
        drop(held);
        let again = tokio::time::timeout(Duration::from_millis(100), s.acquire(&b))
            .await
            .expect("the free slot is granted at once");
        assert_eq!(b.connections(), 1);
        drop(again);
        assert_eq!(s.snapshot().granted, 0);
        assert_eq!(b.connections(), 0);
    }
}

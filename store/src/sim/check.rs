//! The invariants the simulation checks on the scheduler's state at every step, and the one rule
//! it mirrors from the scheduler to do so: how well a flow's requesters are served ([`Served`]).
//!
//! Checked every [`STEP`] of simulated time (invariants 4 and 5 are checked by the run, see the
//! module docs of `super`):
//!
//! - **(1) Every grant takes a slot:** grants (revoked ones not yet given back included) never
//!   exceed the slots, and no slot stays free for more than a [`TICK`] while anyone waits.
//! - **(2) Over its share.** No waiter of a flow that is not struck waits longer than
//!   [`Scheduler::wait_bound`] (10.4 s), or [`RESUMABLE_BOUND`] (1.2 s) if the holder can resume,
//!   while one same slot is held by another flow that is *over its share* for it: whose
//!   requesters would stay strictly better served than the waiter's without that slot
//!   ([`Served::over_share`]).
//! - **(3) Equals take turns.** The same, for a slot held by a flow whose requesters would stay
//!   at least as well served as the waiter's without it ([`Served::at_least_level`]): it is
//!   rotated within the same bound.
//! - **(6)** A download that no pull wants any more has no connection and no waiter a [`TICK`]
//!   later.
//! - **(7)** A struck flow (it cannot resume and lost a slot) goes last: a slot it was granted
//!   since the last step was asked for first by a waiter of a flow that is not struck and still
//!   waits, never.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::world::Sim;
use crate::sched::{EPS, NORMAL_WEIGHT, SOLE_TENURE, SchedView, Scheduler, TICK, WaiterView};

/// How often the invariants are checked, in simulated time.
pub(super) const STEP: Duration = Duration::from_millis(100);

/// Invariant 2's bound behind a holder that can resume: its tenure, then the next tick (the
/// docs' guarantees give 1.2 s).
pub(super) const RESUMABLE_BOUND: Duration = SOLE_TENURE.saturating_add(TICK);

/// How well requesters are served, from the live grants: the scheduler's `Usage` rule, mirrored
/// here (sched.rs keeps it private; this is the one place the simulation restates it). Each live
/// connection is charged to the requesters of its flow, split evenly between them, each part
/// scaled by `NORMAL_WEIGHT / weight`; a flow's score is the lowest charge among its requesters.
pub(super) struct Served {
    /// Per flow of the view: its id, its score, and its score once it lost one connection.
    scores: Vec<(u64, f64, f64)>,
}

impl Served {
    pub fn of(view: &SchedView) -> Served {
        // Requester keys as indices (a handful per step: a linear search is cheapest).
        let mut keys: Vec<&str> = Vec::new();
        let flows: Vec<Vec<(usize, f64)>> = view
            .flows
            .iter()
            .map(|f| {
                let n = f.requesters.len();
                f.requesters
                    .iter()
                    .map(|(k, w)| {
                        let i = keys
                            .iter()
                            .position(|x| *x == k.as_str())
                            .unwrap_or_else(|| {
                                keys.push(k.as_str());
                                keys.len() - 1
                            });
                        (i, part(n, *w))
                    })
                    .collect()
            })
            .collect();
        let index = |id: u64| {
            view.flows
                .iter()
                .position(|f| f.id == id)
                .expect("in the view")
        };
        let mut charge = vec![0.0; keys.len()];
        for g in view.grants.iter().filter(|g| g.live) {
            for &(k, p) in &flows[index(g.flow)] {
                charge[k] += p;
            }
        }
        let scores = view
            .flows
            .iter()
            .zip(&flows)
            .map(|(f, rs)| {
                let min = |take_one: bool| {
                    rs.iter()
                        .map(|&(k, p)| charge[k] - if take_one { p } else { 0.0 })
                        .fold(f64::INFINITY, f64::min)
                };
                (f.id, min(false), min(true))
            })
            .collect();
        Served { scores }
    }

    fn get(&self, flow: u64) -> (f64, f64) {
        let &(_, score, without) = self
            .scores
            .iter()
            .find(|s| s.0 == flow)
            .expect("the view has the flow of each grant and waiter");
        (score, without)
    }

    /// The lowest charge among `flow`'s requesters.
    pub fn score(&self, flow: u64) -> f64 {
        self.get(flow).0
    }

    /// `flow`'s score once it lost one connection.
    pub fn score_without_one(&self, flow: u64) -> f64 {
        self.get(flow).1
    }

    /// A slot of `holder` is over its share for a waiter of `waiter`: without it, `holder`'s
    /// requesters stay strictly better served than `waiter`'s.
    pub fn over_share(&self, holder: u64, waiter: u64) -> bool {
        holder != waiter && strictly_above(self.score_without_one(holder), self.score(waiter))
    }

    /// Without it, `holder`'s requesters stay at least as well served as `waiter`'s.
    pub fn at_least_level(&self, holder: u64, waiter: u64) -> bool {
        holder != waiter && at_least(self.score_without_one(holder), self.score(waiter))
    }
}

/// A holder's score without the slot (`after`) strictly above the waiter's (`want`).
fn strictly_above(after: f64, want: f64) -> bool {
    after > want + EPS
}

/// A holder's score without the slot at least the waiter's.
fn at_least(after: f64, want: f64) -> bool {
    after >= want - EPS
}

/// What one connection of a flow with `n` requesters adds to a requester of `weight`.
fn part(n: usize, weight: u32) -> f64 {
    (1.0 / n as f64) * (f64::from(NORMAL_WEIGHT) / f64::from(weight.max(1)))
}

impl SchedView {
    fn flow(&self, id: u64) -> &crate::sched::FlowView {
        self.flows
            .iter()
            .find(|f| f.id == id)
            .expect("the view has the flow of each grant and waiter")
    }
}

/// The longest waits seen behind one slot, for the figures.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Longest {
    /// Behind a slot over its share, of a flow that can resume.
    pub over_resumable: Duration,
    /// Behind a slot over its share, of a flow that cannot resume.
    pub over_unresumable: Duration,
    /// Behind a slot of a flow at least as well served.
    pub level: Duration,
}

/// State carried from one step to the next.
#[derive(Default)]
pub(super) struct Checker {
    /// When the last step ran.
    last: Option<Instant>,
    /// The scheduler the last step looked at.
    sched: Option<Arc<Scheduler>>,
    /// Since when the oldest pair of each kind waits (over a resumable holder, over one that
    /// cannot resume, level), for the figures.
    oldest: [Option<Instant>; 3],
    idle_since: Option<Instant>,
    /// (waiter, grant) pairs over their share, since when.
    over: HashMap<(u64, u64), Instant>,
    /// (waiter, grant) pairs at least level, since when.
    level: HashMap<(u64, u64), Instant>,
    pub steps: u64,
    pub longest: Longest,
}

impl Checker {
    /// One step: the violations found, if any.
    pub fn step(&mut self, sim: &Sim) -> Vec<String> {
        self.steps += 1;
        let now = Instant::now();
        let mut broken = Vec::new();
        self.check_all(sim, now, &mut broken);
        broken.extend(sim.check_reserve());
        self.last = Some(now);
        self.note_longest(now);
        broken
    }

    /// The figures, from the oldest pairs.
    fn note_longest(&mut self, now: Instant) {
        let l = &mut self.longest;
        for (since, longest) in
            self.oldest
                .iter()
                .zip([&mut l.over_resumable, &mut l.over_unresumable, &mut l.level])
        {
            if let Some(since) = since {
                *longest = (*longest).max(now - *since);
            }
        }
    }

    fn check_all(&mut self, sim: &Sim, now: Instant, broken: &mut Vec<String>) {
        self.oldest = [None; 3];
        let sched = sim.daemon().sched.clone();
        if !self.sched.as_ref().is_some_and(|s| Arc::ptr_eq(s, &sched)) {
            // A restarted daemon's scheduler: its ids start again.
            self.over.clear();
            self.level.clear();
            self.idle_since = None;
            self.sched = Some(sched.clone());
        }
        let snap = sched.snapshot();
        if snap.waiting == 0 {
            // Nobody waits: only (1)'s count and (6) can fail; no pair is waiting.
            self.idle_since = None;
            self.over.clear();
            self.level.clear();
            if snap.granted > snap.capacity {
                broken.push(format!(
                    "(1) {} grants for {} slots",
                    snap.granted, snap.capacity
                ));
            }
            self.stopped(sim, now, &[], broken);
            return;
        }
        let v = sched.view();
        let bound = Scheduler::wait_bound();

        // (1)
        if v.grants.len() > v.capacity {
            broken.push(format!(
                "(1) {} grants for {} slots",
                v.grants.len(),
                v.capacity
            ));
        }
        if v.grants.len() < v.capacity && !v.waiters.is_empty() {
            let since = *self.idle_since.get_or_insert(now);
            if now - since > TICK {
                broken.push(format!(
                    "(1) {} of {} slots free for {:?} while {} connections wait",
                    v.capacity - v.grants.len(),
                    v.capacity,
                    now - since,
                    v.waiters.len()
                ));
            }
        } else {
            self.idle_since = None;
        }

        // (2) and (3)
        let served = Served::of(&v);
        let mut over = HashMap::new();
        let mut level = HashMap::new();
        let mut oldest = [None::<Instant>; 3];
        let mut note = |kind: usize, since: Instant| {
            let o = &mut oldest[kind];
            *o = Some(o.map_or(since, |o| o.min(since)));
        };
        for w in &v.waiters {
            if v.flow(w.flow).struck {
                continue;
            }
            let want = served.score(w.flow);
            for g in v.grants.iter().filter(|g| g.live && g.flow != w.flow) {
                let key = (w.id, g.id);
                let after = served.score_without_one(g.flow);
                if !at_least(after, want) {
                    continue;
                }
                let since = *self.level.get(&key).unwrap_or(&now);
                level.insert(key, since);
                note(2, since);
                // Reported after (2), the more precise, when both pass the bound at once.
                let mut unequal = None;
                if now - since > bound {
                    unequal = Some(format!(
                        "(3) waiter {} of {} ({:?}, served {:.3}, asked {:?} ago) waited {:?} (bound {bound:?}) while slot {} was held by {} ({:?}, served {:.3} without that slot): equals do not take turns",
                        w.id,
                        sim.name(w.flow),
                        v.flow(w.flow).requesters,
                        want,
                        now - w.since,
                        now - since,
                        g.id,
                        sim.name(g.flow),
                        v.flow(g.flow).requesters,
                        after,
                    ));
                }
                let since = self.over.get(&key).copied().unwrap_or(now);
                let resumable = v.flow(g.flow).resumable;
                let limit = if resumable { RESUMABLE_BOUND } else { bound };
                if strictly_above(after, want) {
                    over.insert(key, since);
                    note(if resumable { 0 } else { 1 }, since);
                }
                if strictly_above(after, want) && now - since > limit {
                    broken.push(format!(
                        "(2) waiter {} of {} ({:?}, served {:.3}, asked {:?} ago) waited {:?} (bound {limit:?}) while slot {} was held by {} ({:?}, served {:.3} without that slot): over its share",
                        w.id,
                        sim.name(w.flow),
                        v.flow(w.flow).requesters,
                        want,
                        now - w.since,
                        now - since,
                        g.id,
                        sim.name(g.flow),
                        v.flow(g.flow).requesters,
                        after,
                    ));
                }
                broken.extend(unequal);
            }
        }
        self.over = over;
        self.level = level;
        self.oldest = oldest;

        // (7)
        let since = self.last.unwrap_or(sim.start);
        for g in v.grants.iter().filter(|g| g.since > since) {
            if !v.flow(g.flow).struck {
                continue;
            }
            if let Some(o) = v
                .waiters
                .iter()
                .find(|o| o.since < g.since && !v.flow(o.flow).struck)
            {
                broken.push(format!(
                    "(7) {} (struck: it cannot resume and lost a slot) was granted slot {} while waiter {} of {} (not struck) asked before and still waits",
                    sim.name(g.flow),
                    g.id,
                    o.id,
                    sim.name(o.flow),
                ));
            }
        }

        self.stopped(sim, now, &v.waiters, broken);
    }

    /// (6): downloads stopped a [`TICK`] ago hold no slot and wait for none.
    fn stopped(&self, sim: &Sim, now: Instant, waiters: &[WaiterView], broken: &mut Vec<String>) {
        sim.watch_stopping(|flow, at, r| {
            let waits = waiters.iter().any(|w| w.flow == flow.id());
            let gone = flow.connections() == 0 && !waits;
            if !gone && now - at > TICK {
                broken.push(format!(
                    "(6) blob {} stopped {:?} ago (no pull wants it) still has {} connections{}",
                    r.blob,
                    now - at,
                    flow.connections(),
                    if waits { " and waits for a slot" } else { "" }
                ));
            }
            !gone
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::{FlowView, GrantView};

    fn view(flows: &[(u64, &[(&str, u32)])], grants: &[u64]) -> SchedView {
        let now = Instant::now();
        SchedView {
            capacity: grants.len(),
            grants: grants
                .iter()
                .enumerate()
                .map(|(i, &flow)| GrantView {
                    id: i as u64 + 1,
                    flow,
                    live: true,
                    since: now,
                })
                .collect(),
            waiters: Vec::new(),
            flows: flows
                .iter()
                .map(|(id, rs)| FlowView {
                    id: *id,
                    requesters: rs.iter().map(|(k, w)| (k.to_string(), *w)).collect(),
                    struck: false,
                    resumable: true,
                })
                .collect(),
            ticking: false,
        }
    }

    #[test]
    fn the_mirrored_rule_gives_the_documented_shares() {
        let n = NORMAL_WEIGHT;
        // Two connections of a blob a and b share, one of b's own: b's own is over its share
        // for nobody new, the shared blob's second connection is over its share for c.
        let v = view(
            &[
                (1, &[("a", n), ("b", n)]),
                (2, &[("b", n)]),
                (3, &[("c", n)]),
            ],
            &[1, 1],
        );
        let s = Served::of(&v);
        assert!((s.score(1) - 1.0).abs() < EPS);
        assert!(!s.over_share(1, 2), "b's own blob would leave a with half");
        assert!(s.over_share(1, 3));
        assert!(s.at_least_level(1, 3));
        // A high-priority pod (double weight) with 4 slots against a normal one with 2: level.
        let v = view(
            &[(1, &[("hi", 2 * n)]), (2, &[("lo", n)])],
            &[1, 1, 1, 1, 2, 2],
        );
        let s = Served::of(&v);
        assert!(!s.over_share(1, 2) && !s.over_share(2, 1));
        // A flow's own slots are never over its share for itself.
        assert!(!s.at_least_level(1, 1));
    }
}

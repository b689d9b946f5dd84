//! A deterministic simulation of the pull engine: seeded random scenarios drive the daemon's own
//! blob downloads ([`BlobDownloads`](crate::blobs::BlobDownloads): their pieces, retries,
//! strikes, ingest writer and content store), transfer [`Scheduler`](crate::sched::Scheduler)
//! and progress watchdog in simulated time, with simulated registries behind the downloads'
//! [`BlobSource`](crate::blobs::BlobSource) seam, and
//! invariants are checked at every step. Test-only.
//!
//! - [`scenario`]: what a seed draws (slots, registries, blobs, images, pods) and the bound of
//!   invariant 4;
//! - [`registry`]: the registries, sending each blob's real bytes at their rate, with or without
//!   ranges, cut short, stalled or wrong;
//! - [`world`]: the pull layer around the downloads (pods joining and leaving pulls, each pull
//!   holding handles of the downloads it waits for, with its watchdog) and the daemon's restarts;
//! - [`disk`]: a small image filesystem for the daemon's reserve;
//! - [`check`]: the invariants checked on the scheduler's state every 100 ms;
//! - [`observe`]: the scheduler's revocations, heard as they happen;
//! - [`rng`]: the seeded generator.
//!
//! Time is tokio's paused clock on a current-thread runtime, the downloads' file work runs inline
//! ([`FileWork::Inline`](crate::blobs::FileWork)) on a tmpfs: simulated minutes cost
//! milliseconds, and the same seed gives the same events (the run's fingerprint, a hash of its
//! events, is compared in a test).
//!
//! The invariants (1, 2, 3, 6 and 7 in [`check`]):
//!
//! - **(4)** Once the last pod arrived, every download ends (done, failed, or stopped) within
//!   [`Scenario::end_bound`].
//! - **(5)** At the end the scheduler holds nothing: no grant, no waiter, every flow without
//!   connections, and its tick task stopped within two ticks; no pull runs.
//! - **(7)** (also) A struck flow revokes nobody: checked on each revocation as the scheduler
//!   makes it ([`observe`]).
//! - **(8)** A blob named with its size, from a registry that sends its bytes right and answers
//!   ranged requests, never fails a pull: only descriptors with a wrong size, wrong bytes,
//!   registries that stall (the watchdog) or that cannot resume (strikes, cuts), or the reserve,
//!   fail one.
//! - **(9)**, **(10)** On a small disk, blob bytes leave the reserve free, and room is made
//!   before a refusal ([`world`]'s `check_reserve` and the checked collector).
//! - **(11)** Partial data is resumed, never fetched again, across revocations, cuts, stopped
//!   pulls and daemon restarts (`Sim::check_sent_once`).
//!
//! Running: `cargo nextest run -p minicri-store --lib sim::` runs the scenarios and prints one
//! line of figures. `MINICRI_SIM_SEED=<seed>` replays that one scenario and prints its events;
//! `MINICRI_SIM_SCENARIOS=<n>` and `MINICRI_SIM_BASE=<seed>` run other scenarios;
//! `MINICRI_SIM_KEEP_GOING=1` runs every scenario and reports, per invariant, how many broke it
//! and the first seed that did; `MINICRI_SIM_IGNORE=7,3` only counts those invariants'
//! violations and lets the scenarios go on (what else a hole breaks).

mod check;
mod disk;
mod observe;
mod registry;
mod rng;
mod scenario;
mod world;

use std::time::Duration;

use tokio::time::Instant;

use crate::sched::TICK;
use check::{Checker, Longest, STEP};
use scenario::Scenario;
use world::{Counts, Sim};

/// What one scenario's run gives.
struct Outcome {
    simulated: Duration,
    steps: u64,
    counts: Counts,
    longest: Longest,
    /// How long downloads ran after the last arrival, against invariant 4's bound.
    tail: (Duration, Duration),
    fingerprint: u64,
    /// The events' text, all of them if asked for.
    events: Vec<String>,
}

/// A scenario that broke an invariant.
#[derive(Debug)]
struct Failure {
    seed: u64,
    at: Duration,
    what: String,
    report: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "simulation seed {seed:#x} broke an invariant at {at:.3}s: {what}\nreplay: MINICRI_SIM_SEED={seed:#x} cargo nextest run -p minicri-store --lib sim::\n{report}",
            seed = self.seed,
            at = self.at.as_secs_f64(),
            what = self.what,
            report = self.report
        )
    }
}

/// Runs the scenario of `seed` to its end in a runtime of its own; `all_events` keeps every
/// event's text (else the last few, for a failure's report).
fn run(seed: u64, all_events: bool) -> Result<Outcome, Failure> {
    let sc = Scenario::generate(seed);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime");
    let revocations = observe::subscriber();
    tracing::subscriber::with_default(revocations.clone(), || {
        rt.block_on(simulate(sc, all_events, &revocations))
    })
}

async fn simulate(
    sc: Scenario,
    all_events: bool,
    revocations: &observe::Revocations,
) -> Result<Outcome, Failure> {
    let sim = Sim::new(sc, all_events);
    *revocations.sim.lock().unwrap() = std::sync::Arc::downgrade(&sim);
    let start = sim.start;
    for p in 0..sim.sc.pods.len() {
        let pod = sim.sc.pods[p].clone();
        let s = sim.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(start + pod.arrives).await;
            s.arrive(p);
            if let Some(leaves) = pod.leaves {
                tokio::time::sleep_until(start + leaves).await;
                s.leave(p);
            }
        });
    }
    if let Some(at) = sim.sc.restart {
        let s = sim.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(start + at).await;
            s.restart().await;
        });
    }
    let last_arrival = start + sim.sc.last_arrival();
    let bound = sim.sc.end_bound();
    let mut checker = Checker::default();
    let fail = |sim: &Sim, what: String| {
        let mut report = sim.sc.describe();
        report.push_str("last events:\n");
        for e in sim.recent_events() {
            report.push_str(&e);
            report.push('\n');
        }
        Failure {
            seed: sim.sc.seed,
            at: Instant::now() - sim.start,
            what,
            report,
        }
    };
    loop {
        tokio::time::sleep(STEP).await;
        for what in checker.step(&sim) {
            sim.violated(what);
        }
        if let Some(what) = sim.violation() {
            return Err(fail(&sim, what));
        }
        if sim.settled() {
            break;
        }
        let now = Instant::now();
        if now >= last_arrival && now - last_arrival > bound {
            let what = format!(
                "(4) downloads of blobs {:?} still run {:?} after the last pod arrived (bound {bound:?})",
                sim.running_blobs(),
                now - last_arrival
            );
            return Err(fail(&sim, what));
        }
    }
    let ended = Instant::now();
    // (5), for the daemon's scheduler and those of its runs before a restart.
    let mut scheds = sim.past.lock().unwrap().clone();
    scheds.push(sim.daemon().sched.clone());
    let busy: Vec<String> = sim
        .flows()
        .iter()
        .filter(|f| f.connections() > 0)
        .map(|f| sim.name(f.id()))
        .collect();
    for v in scheds.iter().map(|s| s.view()) {
        if !v.grants.is_empty() || !v.waiters.is_empty() || !busy.is_empty() {
            let what = format!(
                "(5) every download ended, yet the scheduler has {} grants and {} waiters, and {busy:?} connections",
                v.grants.len(),
                v.waiters.len()
            );
            return Err(fail(&sim, what));
        }
    }
    if let Some(what) = sim.check_sent_once() {
        return Err(fail(&sim, what));
    }
    if sim.running_pulls() > 0 {
        let what = format!(
            "(5) every download ended, yet {} pulls run",
            sim.running_pulls()
        );
        return Err(fail(&sim, what));
    }
    tokio::time::sleep(2 * TICK).await;
    if scheds.iter().any(|s| s.view().ticking) {
        let what = "(5) the scheduler still ticks with nobody waiting".to_string();
        return Err(fail(&sim, what));
    }
    Ok(Outcome {
        simulated: ended - start,
        steps: checker.steps,
        counts: {
            use std::sync::atomic::Ordering::Relaxed;
            let count = |f: fn(&crate::sched::SchedCounters) -> &std::sync::atomic::AtomicU64| {
                scheds.iter().map(|s| f(s.counters()).load(Relaxed)).sum()
            };
            Counts {
                grants: count(|c| &c.granted),
                revocations: count(|c| &c.revoked),
                restarts: u64::from(sim.sc.restart.is_some()),
                ..sim.counts()
            }
        },
        longest: checker.longest,
        tail: (ended.saturating_duration_since(last_arrival), bound),
        fingerprint: sim.fingerprint(),
        events: sim.recent_events(),
    })
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    let v = v.trim();
    let parsed = match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => v.parse(),
    };
    Some(parsed.unwrap_or_else(|_| panic!("{name}={v} is not a number")))
}

/// Scenarios a run of the suite makes.
const SCENARIOS: u64 = 1000;
/// The suite's scenarios are the same on every run: a failure stays reproducible.
const BASE: u64 = 0x6d69_6e69_6372_6921;

/// The figures of many scenarios.
#[derive(Default)]
struct Totals {
    scenarios: u64,
    simulated: Duration,
    steps: u64,
    counts: Counts,
    longest: Longest,
    /// The largest share of invariant 4's bound a scenario used.
    tightest: f64,
    /// Failed scenarios: their index and failure.
    failed: Vec<(u64, Failure)>,
}

impl Totals {
    fn add(&mut self, o: &Outcome) {
        self.scenarios += 1;
        self.simulated += o.simulated;
        self.steps += o.steps;
        let (t, c) = (&mut self.counts, &o.counts);
        t.grants += c.grants;
        t.revocations += c.revocations;
        t.done += c.done;
        t.gave_up += c.gave_up;
        t.stalled += c.stalled;
        t.stopped += c.stopped;
        t.refused += c.refused;
        t.restarts += c.restarts;
        t.ignored += u64::from(c.ignored > 0);
        let l = &mut self.longest;
        l.over_resumable = l.over_resumable.max(o.longest.over_resumable);
        l.over_unresumable = l.over_unresumable.max(o.longest.over_unresumable);
        l.level = l.level.max(o.longest.level);
        self.tightest = self
            .tightest
            .max(o.tail.0.as_secs_f64() / o.tail.1.as_secs_f64());
    }

    fn merge(&mut self, other: Totals) {
        self.scenarios += other.scenarios;
        self.simulated += other.simulated;
        self.steps += other.steps;
        let (t, c) = (&mut self.counts, &other.counts);
        t.grants += c.grants;
        t.revocations += c.revocations;
        t.done += c.done;
        t.gave_up += c.gave_up;
        t.stalled += c.stalled;
        t.stopped += c.stopped;
        t.refused += c.refused;
        t.restarts += c.restarts;
        t.ignored += c.ignored;
        let l = &mut self.longest;
        l.over_resumable = l.over_resumable.max(other.longest.over_resumable);
        l.over_unresumable = l.over_unresumable.max(other.longest.over_unresumable);
        l.level = l.level.max(other.longest.level);
        self.tightest = self.tightest.max(other.tightest);
        self.failed.extend(other.failed);
    }
}

/// Runs scenarios `0..n` of `base` on a few threads. Without `keep_going` it stops at a failure;
/// every scenario before the failing one has run then (they are handed out in order), so the
/// failure with the lowest index, the one reported, is the same on every run.
fn run_many(base: u64, n: u64, keep_going: bool) -> Totals {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get().min(4));
    let next = AtomicU64::new(0);
    let failed = AtomicBool::new(false);
    let mut totals = Totals::default();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut mine = Totals::default();
                    while keep_going || !failed.load(Ordering::Relaxed) {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= n {
                            break;
                        }
                        match run(rng::scenario_seed(base, i), false) {
                            Ok(o) => mine.add(&o),
                            Err(f) => {
                                failed.store(true, Ordering::Relaxed);
                                mine.failed.push((i, f));
                            }
                        }
                    }
                    mine
                })
            })
            .collect();
        for w in workers {
            totals.merge(w.join().expect("a simulation thread does not panic"));
        }
    });
    totals.failed.sort_by_key(|(i, _)| *i);
    totals
}

#[test]
fn simulated_pulls_keep_every_invariant() {
    if let Some(seed) = env_u64("MINICRI_SIM_SEED") {
        match run(seed, true) {
            Ok(o) => {
                println!("{}", Scenario::generate(seed).describe());
                for e in &o.events {
                    println!("{e}");
                }
                println!(
                    "seed {seed:#x}: every invariant held over {:.1} s simulated, {} steps; {:?}",
                    o.simulated.as_secs_f64(),
                    o.steps,
                    o.counts
                );
            }
            Err(f) => panic!("{f}"),
        }
        return;
    }
    let n = env_u64("MINICRI_SIM_SCENARIOS").unwrap_or(SCENARIOS);
    let base = env_u64("MINICRI_SIM_BASE").unwrap_or(BASE);
    let keep_going = std::env::var_os("MINICRI_SIM_KEEP_GOING").is_some();
    let wall = std::time::Instant::now();
    let t = run_many(base, n, keep_going);
    let c = &t.counts;
    println!(
        "simulation: {} scenarios, {:.1} h simulated in {:.2} s, {} invariant checks; {} grants, {} revocations; blobs: {} in, {} failed ({} at a small disk's reserve); {} pulls stalled; {} downloads stopped; {} daemon restarts{}; longest wait behind a slot over its share {:.1} s (holder that can resume; bound {:.1} s) / {:.1} s (holder that cannot resume), behind an equal {:.1} s (bound {:.1} s); downloads ended within {:.0}% of their bound",
        t.scenarios,
        t.simulated.as_secs_f64() / 3600.0,
        wall.elapsed().as_secs_f64(),
        t.steps,
        c.grants,
        c.revocations,
        c.done,
        c.gave_up,
        c.refused,
        c.stalled,
        c.stopped,
        c.restarts,
        if c.ignored > 0 {
            format!("; {} scenarios broke ignored invariants", c.ignored)
        } else {
            String::new()
        },
        t.longest.over_resumable.as_secs_f64(),
        check::RESUMABLE_BOUND.as_secs_f64(),
        t.longest.over_unresumable.as_secs_f64(),
        t.longest.level.as_secs_f64(),
        crate::sched::Scheduler::wait_bound().as_secs_f64(),
        t.tightest * 100.0
    );
    let Some((_, first)) = t.failed.first() else {
        return;
    };
    if !keep_going {
        panic!("{first}");
    }
    // Per invariant: the scenarios that broke it, the first with its message.
    let mut by: Vec<(&str, Vec<&Failure>)> = Vec::new();
    for (_, f) in &t.failed {
        let inv = f.what.split(' ').next().unwrap_or_default();
        match by.iter_mut().find(|b| b.0 == inv) {
            Some(b) => b.1.push(f),
            None => by.push((inv, vec![f])),
        }
    }
    by.sort_by_key(|b| b.0);
    let mut report = String::new();
    for (inv, fs) in by {
        let f = fs[0];
        let more: Vec<String> = fs[1..]
            .iter()
            .take(8)
            .map(|f| format!("{:#x}", f.seed))
            .collect();
        report.push_str(&format!(
            "invariant {inv} broken in {} of {n} scenarios, first: seed {:#x} at {:.3}s: {}\n  next seeds: {}\n",
            fs.len(),
            f.seed,
            f.at.as_secs_f64(),
            f.what,
            more.join(" ")
        ));
    }
    panic!("{report}");
}

#[test]
fn a_seed_replays_the_same_events() {
    for i in 0..20 {
        let seed = rng::scenario_seed(BASE ^ 0x5eed, i);
        let a = run(seed, false).unwrap_or_else(|f| panic!("{f}"));
        let b = run(seed, false).unwrap_or_else(|f| panic!("{f}"));
        assert_eq!(a.fingerprint, b.fingerprint, "seed {seed:#x}");
        assert_eq!(a.simulated, b.simulated, "seed {seed:#x}");
    }
}

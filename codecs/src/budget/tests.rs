//! The pods' shares of the budget, checked step by step: each charge is polled by hand, so a
//! test sees exactly which charge is granted when.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use super::*;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// The pieces the tests charge: a read from a pod's socket.
const PIECE: usize = 32 * KIB;

/// A charge asked for and polled by hand.
struct Ask(Option<Pin<Box<dyn Future<Output = Charge> + Send>>>);

impl Ask {
    fn new(share: &Share, bytes: usize) -> Ask {
        let s = share.clone();
        Ask::of(async move { s.charge(bytes).await })
    }

    fn of(f: impl Future<Output = Charge> + Send + 'static) -> Ask {
        Ask(Some(Box::pin(f)))
    }

    /// The charge, once granted (then the ask is spent).
    fn poll(&mut self) -> Option<Charge> {
        let f = self.0.as_mut().expect("polled after it was granted");
        match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(c) => {
                self.0 = None;
                Some(c)
            }
            Poll::Pending => None,
        }
    }

    fn granted(&mut self) -> Charge {
        self.poll().expect("granted")
    }
}

/// Charges `PIECE`s for `share` while they are granted at once: what was granted, and the first
/// ask that waits.
fn fill(share: &Share) -> (Vec<Charge>, Ask) {
    let mut held = Vec::new();
    loop {
        let mut ask = Ask::new(share, PIECE);
        match ask.poll() {
            Some(c) => held.push(c),
            None => return (held, ask),
        }
    }
}

fn bytes(charges: &[Charge]) -> usize {
    charges.iter().map(Charge::bytes).sum()
}

#[test]
fn alone_a_pod_may_use_the_whole_total() {
    let b = Budget::new(8 * MIB as u64);
    let a = b.share("a");
    let _session = Ask::of({
        let a = a.clone();
        async move { a.charge_session(64 * KIB).await }
    })
    .granted();
    let (mut held, mut next) = fill(&a);
    assert_eq!(bytes(&held) + 64 * KIB, 8 * MIB);
    assert_eq!(b.in_use(), 8 * MIB);
    let s = b.sample();
    assert_eq!(
        (s.total, s.in_use, s.peak, s.waiting),
        (8 * MIB, 8 * MIB, 8 * MIB, 1)
    );
    // Its own bytes moving on make room for it again.
    held.pop();
    assert_eq!(next.granted().bytes(), PIECE);
    assert_eq!(b.sample().waiting, 0);
}

/// With another pod present, a pod is granted last-hop bytes up to half the total (two pods):
/// the hog waits there, and the other pod is granted what is left, then what is given back,
/// although the hog asked first.
#[test]
fn a_hog_holds_its_share_and_another_pod_gets_budget_while_it_waits() {
    let b = Budget::new(8 * MIB as u64);
    let (hog, other) = (b.share("hog"), b.share("other"));
    let other_session = Ask::of({
        let o = other.clone();
        async move { o.charge_session(64 * KIB).await }
    })
    .granted();
    let (hog_held, mut hog_next) = fill(&hog);
    assert_eq!(bytes(&hog_held), 4 * MIB, "the hog stops at its share");
    let (mut other_held, mut other_next) = fill(&other);
    assert_eq!(
        bytes(&other_held),
        4 * MIB - 64 * KIB,
        "the other pod gets the rest"
    );
    assert_eq!(b.in_use(), 8 * MIB);
    // The hog's next charge came first, but it is over its share: what the other pod gives
    // back goes to the other pod.
    other_held.pop();
    assert!(other_next.poll().is_some(), "the other pod is served");
    assert!(hog_next.poll().is_none(), "the hog still waits");
    // Once the other pod has gone, the hog is alone and takes what is free.
    drop(other_held);
    assert!(
        hog_next.poll().is_none(),
        "the other pod still holds its session"
    );
    drop(other_session);
    assert!(hog_next.poll().is_some());
}

/// A pod that took the whole total while alone keeps it until its bytes move on; what it gives
/// back goes to the pod that came later, not to the hog's own waiting charges.
#[test]
fn what_a_hog_gives_back_goes_to_the_pod_under_its_limit() {
    let b = Budget::new(8 * MIB as u64);
    let (hog, late) = (b.share("hog"), b.share("late"));
    let (mut hog_held, mut hog_next) = fill(&hog);
    assert_eq!(bytes(&hog_held), 8 * MIB);
    let mut late_next = Ask::new(&late, PIECE);
    assert!(late_next.poll().is_none(), "nothing is free");
    hog_held.pop();
    let _late_held = late_next.poll().expect("the pod under its limit is served");
    assert!(hog_next.poll().is_none());
    // A session starting leaves the reserve to last hops: it waits until that much is free.
    let mut session = Ask::of({
        let l = late.clone();
        async move { l.charge_session(64 * KIB).await }
    });
    for _ in 0..(MIN_SHARE + 64 * KIB) / PIECE {
        assert!(session.poll().is_none());
        hog_held.pop();
    }
    assert!(session.poll().is_some());
    assert!(hog_next.poll().is_none(), "still over its limit");
}

/// Charges within their limits are served in order: a large one first in line is not starved
/// by small ones after it; a dropped waiter leaves its place.
#[test]
fn charges_are_served_in_order_and_a_dropped_one_leaves_its_place() {
    let b = Budget::new(8 * MIB as u64);
    let (a, big, small) = (b.share("a"), b.share("big"), b.share("small"));
    let mut held: Vec<Charge> = (0..7).map(|_| Ask::new(&a, MIB).granted()).collect();
    let mut large = Ask::new(&big, 2 * MIB + 1);
    let mut little = Ask::new(&small, PIECE);
    assert!(large.poll().is_none());
    assert!(
        little.poll().is_none(),
        "the small one waits behind the large one"
    );
    assert_eq!(b.sample().waiting, 2);
    held.pop();
    assert!(
        little.poll().is_none(),
        "2 MiB free is not enough for the first"
    );
    // The large one's client goes: the small one is next.
    drop(large);
    assert_eq!(b.sample().waiting, 0);
    assert_eq!(little.granted().bytes(), PIECE);
    assert_eq!(b.sample().waiting, 0);
    // A charge granted after its future was dropped (never polled again) is given back.
    let mut late = Ask::new(&small, 3 * MIB);
    assert!(late.poll().is_none());
    held.pop();
    drop(late);
    assert_eq!(b.in_use(), 5 * MIB);
    assert_eq!(b.sample().waiting, 0);
}

/// Relays (buffers feeding another charged buffer) leave the reserve to last hops, and a pod's
/// last hops are not held to its limit by its relays: the last hop after a relay can always be
/// granted, so the relay's bytes move on.
#[test]
fn relays_leave_room_for_the_last_hops_after_them() {
    let b = Budget::new(8 * MIB as u64);
    let a = b.share("a");
    let relay = a.relay();
    let (relayed, mut next_relay) = fill(&relay);
    assert_eq!(bytes(&relayed), 8 * MIB - MIN_SHARE, "the reserve is left");
    assert_eq!(Ask::new(&a, MIN_SHARE).granted().bytes(), MIN_SHARE);
    assert!(next_relay.poll().is_none());

    // Two pods: a's relays count against its limit, its last hops only against theirs.
    let b = Budget::new(8 * MIB as u64);
    let (a, other) = (b.share("a"), b.share("other"));
    let _other = Ask::new(&other, PIECE).granted();
    let (relayed, _) = fill(&a.relay());
    assert_eq!(bytes(&relayed), 4 * MIB);
    let (last, _) = fill(&a);
    assert_eq!(bytes(&last), 4 * MIB - PIECE, "the total is what stops it");
}

/// The rest of a message under way and a session's own buffers are held to the total only:
/// a reader holding part of a message never waits for its own pod's share.
#[test]
fn top_ups_and_session_buffers_are_held_to_the_total_only() {
    let b = Budget::new(8 * MIB as u64);
    let (a, other) = (b.share("a"), b.share("other"));
    let _other = Ask::new(&other, PIECE).granted();
    let (_held, mut next) = fill(&a);
    assert!(next.poll().is_none(), "at its limit");
    let more = Ask::of({
        let a = a.clone();
        async move { a.top_up(64 * KIB).await }
    })
    .granted();
    assert_eq!(more.bytes(), 64 * KIB);
    let session = Ask::of({
        let a = a.clone();
        async move { a.charge_session(64 * KIB).await }
    })
    .granted();
    assert_eq!(session.bytes(), 64 * KIB);
    assert!(next.poll().is_none());
    // Over the total: the whole total, not a wait for ever; none: nothing.
    let b = Budget::new(MIB as u64);
    assert_eq!(Ask::new(&b.share("x"), 4 * MIB).granted().bytes(), MIB);
    assert_eq!(
        Ask::of(async { charge(None, 10).await }).granted().bytes(),
        0
    );
}

#[test]
fn charges_split_and_merge_within_one_pod() {
    let b = Budget::new(100);
    let a = b.share("a");
    let mut c = Ask::new(&a, 60).granted();
    let mut part = c.split(20);
    assert_eq!((c.bytes(), part.bytes(), b.in_use()), (40, 20, 60));
    let mut none = Charge::none();
    none.merge(part.split(5));
    part.merge(Charge::none());
    assert_eq!((none.bytes(), part.bytes(), b.in_use()), (5, 15, 60));
    part.merge(none);
    assert_eq!((part.bytes(), b.in_use()), (20, 60));
    drop(c);
    assert_eq!(b.in_use(), 20);
    drop(part);
    assert_eq!(b.in_use(), 0);
    assert_eq!(b.sample().peak, 60);
}

/// Many pods charging at once, through relays and last hops as sessions do, with peers that
/// take the bytes after a while: whatever the interleaving, every charge is granted in the
/// end, and once the tasks whose charges were granted have run, a charge never waits while no
/// last-hop byte (which moves on by itself) is held.
#[test]
fn no_interleaving_deadlocks() {
    /// One pipeline of a pod: a relay then a last hop after it (a tunnel), or a last hop alone;
    /// the last hop's bytes are held for a few steps, then taken by the peer.
    struct Flow {
        share: Share,
        size: usize,
        relay: Option<(Ask, Option<Charge>)>,
        last: Option<Ask>,
        held: Option<(Charge, u64)>,
        left: u32,
    }
    impl Flow {
        /// Runs the flow's task as far as its charges let it: whether it moved.
        fn run(&mut self, ttl: u64) -> bool {
            let mut moved = false;
            if let Some((ask, got @ None)) = &mut self.relay
                && let Some(c) = ask.poll()
            {
                *got = Some(c);
                self.last = Some(Ask::new(&self.share, self.size));
                moved = true;
            }
            if let Some(ask) = &mut self.last
                && let Some(c) = ask.poll()
            {
                // The relay's bytes moved on into the last hop's buffer.
                self.relay = None;
                self.last = None;
                self.held = Some((c, ttl));
                moved = true;
            }
            moved
        }
    }
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut rand = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    for round in 0..30 {
        let total = [4 * MIB, 8 * MIB, 64 * MIB][round % 3];
        let b = Budget::new(total as u64);
        let pods: Vec<Share> = (0..1 + rand(6))
            .map(|i| b.share(&format!("p{i}")))
            .collect();
        let mut flows: Vec<Flow> = (0..24)
            .map(|i| Flow {
                share: pods[i % pods.len()].clone(),
                size: 0,
                relay: None,
                last: None,
                held: None,
                left: 1 + rand(8) as u32,
            })
            .collect();
        let mut steps = 0;
        while flows.iter().any(|f| f.left > 0) {
            steps += 1;
            assert!(steps < 100_000, "round {round}: no progress");
            let f = &mut flows[rand(24) as usize];
            if let Some((_, ttl)) = &mut f.held {
                // The peer takes the bytes after a while.
                *ttl -= 1;
                if *ttl == 0 {
                    f.held = None;
                    f.left -= 1;
                }
            } else if f.left > 0 && f.relay.is_none() && f.last.is_none() {
                f.size = [PIECE, 64 * KIB, MIB, 2 * MIB][rand(4) as usize];
                if rand(2) == 0 {
                    f.relay = Some((Ask::new(&f.share.relay(), f.size), None));
                } else {
                    f.last = Some(Ask::new(&f.share, f.size));
                }
            }
            // The tasks whose charges were granted run.
            loop {
                let mut moved = false;
                for f in &mut flows {
                    moved |= f.run(1 + rand(4));
                }
                if !moved {
                    break;
                }
            }
            let last_held: usize = b.pool.lock().pods.values().map(|p| p.held[0]).sum();
            let waiting = b.sample().waiting;
            assert!(
                waiting == 0 || last_held > 0,
                "round {round}: {waiting} waiting with no last hop held"
            );
        }
        drop(flows);
        assert_eq!(b.in_use(), 0, "round {round}");
    }
}

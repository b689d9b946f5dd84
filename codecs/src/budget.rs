//! The node-wide total of bytes the port-forward sessions hold buffered
//! (`stream.port_forward_buffer_bytes`) and how the pods share it: [`Budget`], a pod's [`Share`] of
//! it, the [`Charge`] each buffer holds while it lives, and [`Input`], a stream's input queue whose
//! pieces carry their charges to the consumer.
//!
//! Port-forward is where a client can make the daemon hold data for long: a pod that does not
//! read what the client sends, a client that does not read what the pod sends. Per forwarded
//! connection the daemon holds a queue of what the client sent (256 KiB), the piece being
//! written to the pod, the pod's bytes read and waiting for the client, and per session its
//! connection's queues; a session carries up to 512 forwards and the node 256 sessions, so
//! without a total a few clients that never read could make it hold gigabytes. With a
//! [`Budget`], every such buffer is charged before it is filled (a DATA frame before its
//! payload is read, a read from the pod's socket before the bytes are read) and released when
//! its bytes are handed on (written to the pod's socket, or to the client's connection); a
//! session's own connection buffers are charged when it starts. When the total is reached,
//! whoever wants to buffer more waits (backpressure to its client or its pod) until someone's
//! bytes move on; nothing is refused or dropped. Exec and attach sessions are not charged: their
//! buffers are fixed per session (no forwards multiply them).
//!
//! # The pods' shares
//!
//! One pool for the node let one pod's client that reads nothing (or a byte now and then) hold
//! all of it, and every other pod's port-forwards waited. So the total is shared per pod: every
//! session charges through its pod's [`Share`] (keyed by the pod sandbox's id). With `T` the
//! total:
//!
//! - A pod is *present* while it holds bytes (its sessions' own buffers count) or waits for
//!   some; with `n` pods present, each one's *limit* is `L = T` when it is alone, else
//!   `max(T / n, MIN_SHARE)` ([`MIN_SHARE`]: the largest single charge, 2 MiB).
//! - A buffer whose bytes go next to the pod's socket or to the client's connection is a *last
//!   hop*; its charge is granted while the pod's last-hop bytes stay within `L`. A buffer that
//!   feeds another charged buffer of its session is a *relay* ([`Share::relay`]: the WebSocket
//!   side of SPDY tunnelled through WebSocket); its charge is granted while all the pod's
//!   buffered bytes stay within `L`. Not held to `L`: a session's own buffers
//!   ([`Share::charge_session`], bounded by the session limits) and the rest of a WebSocket
//!   message under way ([`Share::top_up`], bounded by the message size).
//! - Every charge must fit in what is free; relays and sessions' own buffers leave the last
//!   `R = min(MIN_SHARE, T / 2)` to last hops.
//! - Waiting last-hop charges are served before the others; within each class in order of
//!   arrival, among the pods within their limits: the first of those that does not fit holds up
//!   the ones after it (a large charge is not starved by small ones), a pod over its limit
//!   neither gets bytes nor holds anyone up. One pod's charges of one class are served in order.
//!
//! **Bounds.** With other pods present, a pod is granted last-hop bytes up to `L` and all its
//! buffers up to `2L` (relays), besides its sessions' own buffers and one message under way per
//! WebSocket session. With the default 64 MiB: 32 MiB with two pods present, 2 MiB each from 32
//! pods on; alone, the whole 64 MiB. What a pod took while alone (or before others came) is not
//! taken back: it is given back as its bytes move on, and what is given back goes to the pods
//! within their limits first; bytes that do not move (a peer that does not read) are released
//! when the runtime closes the stalled session or forward (`stream.port_forward_stall_timeout`).
//!
//! **Progress.** A last-hop charge is at most [`MIN_SHARE`] `≤ L`: the limit refuses it only
//! while its pod holds last-hop bytes, which move on without any further charge (to a socket or
//! the client's connection). Eligible and first in line, it waits only for bytes to be given
//! back: relays and sessions' buffers never hold more than `T - R`, so the rest is held by last
//! hops, which move on. A relay's bytes move on once the last-hop charge after them is granted,
//! which never waits for relays. So every charge is granted unless some peer stops reading, and
//! that is what the stall timeout bounds. (With a total under `2 * MIN_SHARE`, 4 MiB, a DATA
//! frame over 512 KiB in a tunnel can need more than `R`.)
//!
//! Left as it was before the shares: a WebSocket message under way holds its bytes until its
//! last fragment, so clients that leave messages unfinished on enough sessions (64 of 1 MiB
//! with the default) can fill the total until their sessions end.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use tokio::sync::{mpsc, oneshot};

/// The largest single charge, and so the least limit a pod is held to: a SPDY DATA frame of the
/// largest size accepted (1 MiB), charged twice as it is copied into pieces.
pub const MIN_SHARE: usize = 2 * crate::spdy::MAX_RECV_PAYLOAD;

/// The node's total, shared by every port-forward session; each charges through its pod's
/// [`Share`].
#[derive(Clone, Debug)]
pub struct Budget {
    pool: Arc<Pool>,
}

/// A pod's share of a [`Budget`], as one session (or one of its stages) charges it.
#[derive(Clone, Debug)]
pub struct Share {
    pool: Arc<Pool>,
    pod: Arc<str>,
    /// Relay (feeds another charged buffer) or last hop.
    kind: Kind,
}

/// What a charge buffers, which decides the rules it is granted under (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    LastHop,
    Relay,
    Session,
}

impl Kind {
    fn index(self) -> usize {
        self as usize
    }
}

/// A [`Budget`] as the metrics show it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BudgetSample {
    pub total: usize,
    pub in_use: usize,
    pub peak: usize,
    pub waiting: usize,
}

#[derive(Debug)]
struct Pool {
    total: usize,
    /// What relays and sessions' own buffers leave to last hops.
    reserve: usize,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    free: usize,
    /// The most held at once since the start.
    peak: usize,
    /// Charges waiting now.
    waiting: usize,
    next_ticket: u64,
    /// The pods present: holding bytes or waiting for some.
    pods: HashMap<Arc<str>, Pod>,
}

/// The queues of one pod's waiting charges: last hops held to the limit, last hops not (top-ups),
/// then the others likewise.
const QUEUES: usize = 4;

#[derive(Debug, Default)]
struct Pod {
    /// Bytes held, by [`Kind`].
    held: [usize; 3],
    queues: [VecDeque<Waiter>; QUEUES],
}

#[derive(Debug)]
struct Waiter {
    ticket: u64,
    bytes: usize,
    kind: Kind,
    /// Held to the pod's limit.
    capped: bool,
    granted: oneshot::Sender<()>,
}

fn queue_of(kind: Kind, capped: bool) -> usize {
    let class = if kind == Kind::LastHop { 0 } else { 2 };
    class + usize::from(!capped)
}

impl Pod {
    fn is_empty(&self) -> bool {
        self.held.iter().all(|b| *b == 0) && self.queues.iter().all(VecDeque::is_empty)
    }

    /// Whether `w` is within the pod's `limit` (module docs).
    fn within(&self, w: &Waiter, limit: usize) -> bool {
        let [last, relay, _] = self.held;
        !w.capped
            || match w.kind {
                Kind::LastHop => last + w.bytes <= limit,
                Kind::Relay => last + relay + w.bytes <= limit,
                Kind::Session => true,
            }
    }
}

impl State {
    /// A pod's limit with the pods present now.
    fn limit(&self, total: usize) -> usize {
        match self.pods.len() {
            0 | 1 => total,
            n => (total / n).max(MIN_SHARE.min(total)),
        }
    }

    /// Grants what can be granted now, in the order of the module docs.
    fn serve(&mut self, total: usize, reserve: usize) {
        while let Some((pod, queue)) = self.next_grant(total, reserve) {
            let p = self.pods.get_mut(&pod).expect("listed");
            let w = p.queues[queue].pop_front().expect("listed");
            p.held[w.kind.index()] += w.bytes;
            self.free -= w.bytes;
            self.waiting -= 1;
            self.peak = self.peak.max(total - self.free);
            // A waiter that went away gives the bytes back itself (it finds itself unqueued).
            let _ = w.granted.send(());
        }
    }

    /// The pod and queue of the next charge to grant, if it fits.
    fn next_grant(&self, total: usize, reserve: usize) -> Option<(Arc<str>, usize)> {
        let limit = self.limit(total);
        for class in [0, 2] {
            let first = self
                .pods
                .iter()
                .flat_map(|(name, p)| {
                    [class, class + 1].into_iter().filter_map(move |q| {
                        let w = p.queues[q].front()?;
                        p.within(w, limit).then_some((w.ticket, name, q, w))
                    })
                })
                .min_by_key(|(ticket, ..)| *ticket);
            if let Some((_, name, q, w)) = first {
                let room = match w.kind {
                    Kind::LastHop => self.free,
                    _ => self.free.saturating_sub(reserve),
                };
                // Served in order: the first waits for its bytes, and so do the ones after it.
                return (w.bytes <= room).then(|| (name.clone(), q));
            }
        }
        None
    }

    /// `bytes` of `kind` held by `pod` are given back.
    fn release(&mut self, pod: &str, kind: Kind, bytes: usize) {
        let p = self
            .pods
            .get_mut(pod)
            .expect("a pod holding bytes is present");
        p.held[kind.index()] -= bytes;
        self.free += bytes;
        if p.is_empty() {
            self.pods.remove(pod);
        }
    }
}

impl Pool {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn release(&self, pod: &str, kind: Kind, bytes: usize) {
        let mut s = self.lock();
        s.release(pod, kind, bytes);
        s.serve(self.total, self.reserve);
    }
}

/// A charge still waiting: if its future is dropped, the waiter leaves its queue, or gives back
/// the bytes granted meanwhile.
struct Pending<'a> {
    share: &'a Share,
    kind: Kind,
    queue: usize,
    ticket: u64,
    bytes: usize,
    /// False once the charge has its bytes.
    waiting: bool,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.waiting {
            return;
        }
        let pool = &self.share.pool;
        let mut s = pool.lock();
        let pod = self.share.pod.as_ref();
        let p = s.pods.get_mut(pod).expect("a waiting pod is present");
        match p.queues[self.queue]
            .iter()
            .position(|w| w.ticket == self.ticket)
        {
            Some(i) => {
                p.queues[self.queue].remove(i);
                s.waiting -= 1;
                if s.pods[pod].is_empty() {
                    s.pods.remove(pod);
                }
            }
            None => s.release(pod, self.kind, self.bytes),
        }
        // Either way the charges behind it may go now.
        s.serve(pool.total, pool.reserve);
    }
}

/// Bytes of a [`Budget`] held by one buffer for one pod; given back when dropped. A charge of no
/// budget ([`Charge::none`]) holds nothing.
#[derive(Debug, Default)]
pub struct Charge(Option<Held>);

#[derive(Debug)]
struct Held {
    bytes: usize,
    kind: Kind,
    pod: Arc<str>,
    pool: Arc<Pool>,
}

impl Drop for Held {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.pool.release(&self.pod, self.kind, self.bytes);
        }
    }
}

impl Charge {
    /// Holds nothing: for buffers of connections without a budget.
    pub fn none() -> Charge {
        Charge(None)
    }

    /// The bytes held.
    pub fn bytes(&self) -> usize {
        self.0.as_ref().map_or(0, |h| h.bytes)
    }

    /// Adds `other`'s bytes to this charge (both of one share: one pod, one kind).
    pub fn merge(&mut self, mut other: Charge) {
        let Some(mine) = self.0.as_mut() else {
            self.0 = other.0.take();
            return;
        };
        if let Some(theirs) = other.0.as_mut() {
            debug_assert!(Arc::ptr_eq(&mine.pool, &theirs.pool) && mine.pod == theirs.pod);
            debug_assert_eq!(mine.kind, theirs.kind);
            // The bytes move between charges: what is held stays the same.
            mine.bytes += std::mem::take(&mut theirs.bytes);
        }
    }

    /// Takes `n` bytes (at most all) of this charge into a charge of their own.
    pub fn split(&mut self, n: usize) -> Charge {
        let n = n.min(self.bytes());
        match &mut self.0 {
            Some(h) if n > 0 => {
                h.bytes -= n;
                Charge(Some(Held {
                    bytes: n,
                    kind: h.kind,
                    pod: h.pod.clone(),
                    pool: h.pool.clone(),
                }))
            }
            _ => Charge(None),
        }
    }
}

impl Budget {
    /// A total of `bytes`.
    pub fn new(bytes: u64) -> Budget {
        let total = usize::try_from(bytes).unwrap_or(usize::MAX);
        Budget {
            pool: Arc::new(Pool {
                total,
                reserve: MIN_SHARE.min(total / 2),
                state: Mutex::new(State {
                    free: total,
                    ..State::default()
                }),
            }),
        }
    }

    /// The share of pod sandbox `pod`, for a session's last hops.
    pub fn share(&self, pod: &str) -> Share {
        Share {
            pool: self.pool.clone(),
            pod: pod.into(),
            kind: Kind::LastHop,
        }
    }

    /// Bytes held now.
    pub fn in_use(&self) -> usize {
        self.pool.total - self.pool.lock().free
    }

    pub fn total(&self) -> usize {
        self.pool.total
    }

    /// The total, what is held, the most held at once and the charges waiting, for the metrics.
    pub fn sample(&self) -> BudgetSample {
        let s = self.pool.lock();
        BudgetSample {
            total: self.pool.total,
            in_use: self.pool.total - s.free,
            peak: s.peak,
            waiting: s.waiting,
        }
    }
}

impl Share {
    /// The pod this share is of.
    pub fn pod(&self) -> &str {
        &self.pod
    }

    /// This pod's share for buffers that feed another charged buffer of the session (module
    /// docs).
    pub fn relay(&self) -> Share {
        Share {
            kind: Kind::Relay,
            ..self.clone()
        }
    }

    /// Waits until `bytes` may be held under the rules of the module docs, then holds them (a
    /// charge over the total holds the total: the configuration keeps the total above the
    /// largest charge).
    pub async fn charge(&self, bytes: usize) -> Charge {
        self.take(bytes, self.kind, true).await
    }

    /// [`Share::charge`] for a buffer that already holds part of one piece (a WebSocket message
    /// being put together): not held to the pod's limit, only to the total. Waiting for the
    /// pod's share while holding could leave the pod's readers each waiting for another's bytes.
    pub async fn top_up(&self, bytes: usize) -> Charge {
        self.take(bytes, self.kind, false).await
    }

    /// Charges a session's own connection buffers, held while it lives: not held to the pod's
    /// limit nor counted against it (the session limits bound them), and they leave the
    /// reserve to last hops.
    pub async fn charge_session(&self, bytes: usize) -> Charge {
        self.take(bytes, Kind::Session, false).await
    }

    async fn take(&self, bytes: usize, kind: Kind, capped: bool) -> Charge {
        let pool = &self.pool;
        let bytes = bytes.min(pool.total);
        if bytes == 0 {
            return Charge::none();
        }
        let queue = queue_of(kind, capped);
        let (granted, ticket) = {
            let mut s = pool.lock();
            let ticket = s.next_ticket;
            s.next_ticket += 1;
            s.waiting += 1;
            let (tx, rx) = oneshot::channel();
            let p = s.pods.entry(self.pod.clone()).or_default();
            p.queues[queue].push_back(Waiter {
                ticket,
                bytes,
                kind,
                capped,
                granted: tx,
            });
            s.serve(pool.total, pool.reserve);
            (rx, ticket)
        };
        let mut pending = Pending {
            share: self,
            kind,
            queue,
            ticket,
            bytes,
            waiting: true,
        };
        // The sender is dropped unsent only with the waiter, which only `pending` removes.
        let _ = granted.await;
        pending.waiting = false;
        Charge(Some(Held {
            bytes,
            kind,
            pod: self.pod.clone(),
            pool: pool.clone(),
        }))
    }
}

/// [`Share::charge`] of an optional share: none holds nothing and never waits.
pub async fn charge(share: Option<&Share>, bytes: usize) -> Charge {
    match share {
        Some(s) => s.charge(bytes).await,
        None => Charge::none(),
    }
}

/// The sending side of an [`Input`].
pub type InputTx = mpsc::Sender<(Vec<u8>, Charge)>;

/// A stream's input as its consumer takes it: pieces of bytes, each with its charge.
#[derive(Debug)]
pub struct Input(mpsc::Receiver<(Vec<u8>, Charge)>);

/// An input queue of `capacity` pieces.
pub fn input(capacity: usize) -> (InputTx, Input) {
    let (tx, rx) = mpsc::channel(capacity);
    (tx, Input(rx))
}

impl Input {
    /// The next piece; its charge is given back at once (for consumers whose own buffering is
    /// not charged).
    pub async fn recv(&mut self) -> Option<Vec<u8>> {
        self.0.recv().await.map(|(data, _)| data)
    }

    /// The next piece and its charge, to hold until the bytes are handed on.
    pub async fn recv_charged(&mut self) -> Option<(Vec<u8>, Charge)> {
        self.0.recv().await
    }
}

#[cfg(test)]
mod tests;

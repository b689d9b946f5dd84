//! The node-wide total of bytes the port-forward sessions hold buffered
//! (`port_forward_buffer_bytes`): [`Budget`], the [`Charge`] each buffer holds while it lives,
//! and [`Input`], a stream's input queue whose pieces carry their charges to the consumer.
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
//! bytes move on; nothing is refused or dropped. Waiters are served in order (tokio's
//! semaphore is fair), so a large charge is not starved by small ones.
//!
//! The price: sessions share the total, so clients that never read hold their part for as long
//! as their sessions live (the keepalive and the 4 h idle timeout end sessions whose clients
//! are gone), and the other forwards slow down meanwhile. Exec and attach sessions are not
//! charged: their buffers are fixed per session (no forwards multiply them).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

/// The node's total, shared by every port-forward session.
#[derive(Clone, Debug)]
pub struct Budget {
    sem: Arc<Semaphore>,
    total: usize,
    gauges: Arc<Gauges>,
}

/// What the metrics report of a [`Budget`]. What is held is counted here, not read from the
/// semaphore: a waiting charge sets aside the bytes given back for it until it has them all,
/// and those are not buffers yet.
#[derive(Debug, Default)]
struct Gauges {
    /// Bytes charges hold now.
    held: AtomicUsize,
    /// The most held at once since the daemon started.
    peak: AtomicUsize,
    /// Charges waiting for bytes now.
    waiting: AtomicUsize,
}

/// A [`Budget`] as the metrics show it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BudgetSample {
    pub total: usize,
    pub in_use: usize,
    pub peak: usize,
    pub waiting: usize,
}

/// Counts a charge as waiting while it lives.
struct Waiting<'a>(&'a AtomicUsize);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Bytes of a [`Budget`] held by one buffer; given back when dropped. A charge of no budget
/// ([`Charge::none`]) holds nothing.
#[derive(Debug, Default)]
pub struct Charge(Option<Held>);

#[derive(Debug)]
struct Held {
    /// Taken only by [`Charge::merge`], which moves the bytes to another charge.
    permit: Option<OwnedSemaphorePermit>,
    gauges: Arc<Gauges>,
}

impl Held {
    fn bytes(&self) -> usize {
        self.permit.as_ref().map_or(0, |p| p.num_permits())
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.gauges.held.fetch_sub(self.bytes(), Ordering::Relaxed);
    }
}

impl Charge {
    /// Holds nothing: for buffers of connections without a budget.
    pub fn none() -> Charge {
        Charge(None)
    }

    /// The bytes held.
    pub fn bytes(&self) -> usize {
        self.0.as_ref().map_or(0, Held::bytes)
    }

    /// Adds `other`'s bytes to this charge (both of one budget).
    pub fn merge(&mut self, mut other: Charge) {
        let Some(h) = self.0.as_mut() else {
            self.0 = other.0.take();
            return;
        };
        // The bytes move between charges: what is held stays the same.
        if let Some(theirs) = other.0.as_mut().and_then(|o| o.permit.take()) {
            match h.permit.as_mut() {
                Some(mine) => mine.merge(theirs),
                None => h.permit = Some(theirs),
            }
        }
    }

    /// Takes `n` bytes (at most all) of this charge into a charge of their own.
    pub fn split(&mut self, n: usize) -> Charge {
        let n = n.min(self.bytes());
        match &mut self.0 {
            Some(h) if n > 0 => {
                let permit = h.permit.as_mut().and_then(|p| p.split(n));
                Charge(Some(Held {
                    permit,
                    gauges: h.gauges.clone(),
                }))
            }
            _ => Charge(None),
        }
    }
}

impl Budget {
    /// A total of `bytes` (at most what a semaphore counts).
    pub fn new(bytes: u64) -> Budget {
        let total = usize::try_from(bytes)
            .unwrap_or(usize::MAX)
            .min(Semaphore::MAX_PERMITS);
        Budget {
            sem: Arc::new(Semaphore::new(total)),
            total,
            gauges: Arc::default(),
        }
    }

    /// Waits until `bytes` are free, then holds them (a charge over the total holds the total:
    /// the configuration keeps the total above the largest charge).
    pub async fn charge(&self, bytes: usize) -> Charge {
        let n = bytes.min(self.total).min(u32::MAX as usize) as u32;
        if n == 0 {
            return Charge::none();
        }
        let permit = match self.sem.clone().try_acquire_many_owned(n) {
            Ok(p) => Ok(p),
            Err(_) => {
                self.gauges.waiting.fetch_add(1, Ordering::Relaxed);
                let _waiting = Waiting(&self.gauges.waiting);
                self.sem.clone().acquire_many_owned(n).await
            }
        };
        match permit {
            Ok(permit) => {
                let held = self.gauges.held.fetch_add(n as usize, Ordering::Relaxed) + n as usize;
                self.gauges.peak.fetch_max(held, Ordering::Relaxed);
                Charge(Some(Held {
                    permit: Some(permit),
                    gauges: self.gauges.clone(),
                }))
            }
            // Never closed.
            Err(_) => Charge::none(),
        }
    }

    /// Bytes held now (not those set aside for a charge still waiting).
    pub fn in_use(&self) -> usize {
        self.gauges.held.load(Ordering::Relaxed)
    }

    pub fn total(&self) -> usize {
        self.total
    }

    /// The total, what is held, the most held at once and the charges waiting, for the metrics.
    pub fn sample(&self) -> BudgetSample {
        BudgetSample {
            total: self.total,
            in_use: self.in_use(),
            peak: self.gauges.peak.load(Ordering::Relaxed),
            waiting: self.gauges.waiting.load(Ordering::Relaxed),
        }
    }
}

/// [`Budget::charge`] of an optional budget: none holds nothing and never waits.
pub async fn charge(budget: Option<&Budget>, bytes: usize) -> Charge {
    match budget {
        Some(b) => b.charge(bytes).await,
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
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn charges_wait_for_bytes_given_back_and_split() {
        let b = Budget::new(100);
        let mut a = b.charge(60).await;
        assert_eq!((b.in_use(), a.bytes()), (60, 60));
        let waiting = tokio::spawn({
            let b = b.clone();
            async move { b.charge(50).await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "50 more do not fit");
        let s = b.sample();
        assert_eq!((s.total, s.in_use, s.peak, s.waiting), (100, 60, 60, 1));
        let mut part = a.split(20);
        assert_eq!((a.bytes(), part.bytes(), b.in_use()), (40, 20, 60));
        let mut none = Charge::none();
        none.merge(part.split(5));
        part.merge(Charge::none());
        assert_eq!((none.bytes(), part.bytes(), b.in_use()), (5, 15, 60));
        part.merge(none);
        assert_eq!((part.bytes(), b.in_use()), (20, 60));
        drop(a);
        let c = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("given back")
            .unwrap();
        assert_eq!((c.bytes(), b.in_use()), (50, 70));
        drop((c, part));
        assert_eq!(b.in_use(), 0);
        let s = b.sample();
        assert_eq!((s.in_use, s.peak, s.waiting), (0, 70, 0));
        // Over the total: the whole total, not a wait for ever.
        assert_eq!(b.charge(1000).await.bytes(), 100);
        assert_eq!(charge(None, 10).await.bytes(), 0);
    }

    #[tokio::test]
    async fn an_input_hands_each_piece_its_charge() {
        let b = Budget::new(100);
        let (tx, mut rx) = input(2);
        tx.send((b"ab".to_vec(), b.charge(2).await)).await.unwrap();
        tx.send((b"cd".to_vec(), b.charge(2).await)).await.unwrap();
        let (data, charge) = rx.recv_charged().await.unwrap();
        assert_eq!(
            (data.as_slice(), charge.bytes(), b.in_use()),
            (&b"ab"[..], 2, 4)
        );
        drop(charge);
        assert_eq!(rx.recv().await.unwrap(), b"cd");
        assert_eq!(b.in_use(), 0);
    }
}

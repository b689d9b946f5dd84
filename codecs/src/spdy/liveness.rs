//! When a streaming connection is over although its reader cannot tell (SPDY and WebSocket
//! connections alike; the runtime's WebSocket connection uses it from here).
//!
//! A connection's reader hands each stream's data to that stream's consumer and waits while the
//! consumer's queue is full: peers do not honour flow control, so not reading is what holds a
//! fast sender back. A consumer that never takes more (a process that does not read its stdin,
//! a pod that stops reading a forwarded socket) leaves the reader waiting, and a waiting reader
//! reads neither the client's resets nor its hang-up. [`Liveness`] ends such a connection from
//! outside the reader: at once when writing to the client fails (it is gone), and after
//! [`IDLE_TIMEOUT`] without a frame either way (the kubelet's and containerd's default for
//! streaming connections), so a session of a client that went away does not hold its process,
//! sockets and session slot for good.
//!
//! A session with nothing to write (a process that neither reads its stdin nor prints) would
//! not learn of a hang-up until the idle timeout; so the writers send a keepalive ping (SPDY
//! PING, WebSocket ping; clients answer both) after [`KEEPALIVE`] without a frame to send. A
//! ping to a client that hung up fails (its host answers the first with a reset), which ends
//! the connection within about two intervals. Pings do not count as activity for the idle
//! timeout.
//!
//! A connection may also have a [`Stall`] limit (port-forward's,
//! `stream.port_forward_stall_timeout`): a client that keeps the connection but stops reading
//! leaves the writer waiting with bytes to send, and what waits behind them stays buffered. The
//! writers run each frame's write within the limit ([`Liveness::within_stall`]); one the client has
//! not taken in that time ends the connection, the reason naming the setting ([`is_stall`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

/// How long a streaming connection may carry no frame in either direction.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(4 * 3600);
/// How long a writer waits with nothing to send before it sends a keepalive ping.
pub const KEEPALIVE: Duration = Duration::from_secs(30);

/// How a stall's reason starts ([`is_stall`]).
const STALLED: &str = "stalled: ";

/// How long bytes may wait for the client to take them, and the setting that says so (named
/// in the reason a stalled connection ends with).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stall {
    pub after: Duration,
    pub setting: &'static str,
}

/// Whether a connection's end `reason` is a stall.
pub fn is_stall(reason: &str) -> bool {
    reason.starts_with(STALLED)
}

/// A connection's activity, shared by its reader and its writer.
#[derive(Clone)]
pub struct Liveness {
    inner: Arc<Inner>,
}

struct Inner {
    start: Instant,
    /// Milliseconds from `start` to the last frame read or written.
    last: AtomicU64,
    /// Why the connection is over, once a write to the client failed or stalled.
    ended: watch::Sender<Option<String>>,
    idle: Duration,
    keepalive: Duration,
    stall: Option<Stall>,
}

impl Liveness {
    pub fn new(idle: Duration, keepalive: Duration, stall: Option<Stall>) -> Liveness {
        Liveness {
            inner: Arc::new(Inner {
                start: Instant::now(),
                last: AtomicU64::new(0),
                ended: watch::Sender::new(None),
                idle,
                keepalive,
                stall,
            }),
        }
    }

    /// How long a writer with nothing to send waits before it sends a keepalive ping.
    pub fn keepalive(&self) -> Duration {
        self.inner.keepalive
    }

    /// A frame was read or written.
    pub fn touch(&self) {
        let ms = self.inner.start.elapsed().as_millis() as u64;
        self.inner.last.store(ms, Ordering::Relaxed);
    }

    /// Writing to the client failed: the connection is over.
    pub fn write_failed(&self) {
        self.end("writing to the client failed".into());
    }

    fn end(&self, reason: String) {
        self.inner.ended.send_if_modified(|r| {
            let first = r.is_none();
            if first {
                *r = Some(reason);
            }
            first
        });
    }

    /// Runs `write` (bytes for the client: `what`) within the stall limit, if there is one:
    /// `None`, the connection then over, when the client has not taken them in time.
    pub async fn within_stall<F: Future>(&self, what: &str, write: F) -> Option<F::Output> {
        let Some(stall) = self.inner.stall else {
            return Some(write.await);
        };
        match tokio::time::timeout(stall.after, write).await {
            Ok(out) => Some(out),
            Err(_) => {
                self.end(format!(
                    "{STALLED}the client did not take {what} in {:?} ({})",
                    stall.after, stall.setting
                ));
                None
            }
        }
    }

    /// Returns why, once the connection is over: writing to the client failed or stalled, or
    /// no frame went either way for the idle timeout.
    pub async fn over(&self) -> String {
        let i = &self.inner;
        let mut ended = i.ended.subscribe();
        loop {
            let last = Duration::from_millis(i.last.load(Ordering::Relaxed));
            let deadline = i.start + last + i.idle;
            tokio::select! {
                r = ended.wait_for(Option::is_some) => {
                    return r.ok().and_then(|r| r.clone()).unwrap_or_default();
                }
                () = tokio::time::sleep_until(deadline) => {
                    if i.last.load(Ordering::Relaxed) == last.as_millis() as u64 {
                        return format!("no frame in either direction for {:?}", i.idle);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn over_after_the_idle_time_since_the_last_frame_or_a_failed_write() {
        let l = Liveness::new(Duration::from_secs(2), KEEPALIVE, None);
        let over = tokio::spawn({
            let l = l.clone();
            async move { l.over().await }
        });
        tokio::time::sleep(Duration::from_millis(1200)).await;
        l.touch();
        tokio::time::sleep(Duration::from_millis(1200)).await;
        assert!(!over.is_finished(), "a frame 1.2 s ago keeps it open");
        let why = tokio::time::timeout(Duration::from_secs(10), over)
            .await
            .expect("over once idle")
            .unwrap();
        assert!(why.contains("no frame"), "{why}");

        let l = Liveness::new(Duration::from_secs(3600), KEEPALIVE, None);
        l.write_failed();
        assert_eq!(l.over().await, "writing to the client failed");
    }

    #[tokio::test]
    async fn a_write_the_client_does_not_take_in_time_ends_the_connection() {
        let stall = Stall {
            after: Duration::from_millis(200),
            setting: "x.stall",
        };
        let l = Liveness::new(Duration::from_secs(3600), KEEPALIVE, Some(stall));
        assert_eq!(l.within_stall("a frame", async { 7 }).await, Some(7));
        let start = Instant::now();
        let stuck = l.within_stall("a frame", std::future::pending::<()>());
        assert_eq!(stuck.await, None);
        assert!(start.elapsed() >= stall.after);
        let why = l.over().await;
        assert!(is_stall(&why), "{why}");
        assert_eq!(
            why,
            "stalled: the client did not take a frame in 200ms (x.stall)"
        );
        // The first reason stays.
        l.write_failed();
        assert_eq!(l.over().await, why);
        // Without a limit, a write waits as long as it takes.
        let l = Liveness::new(Duration::from_secs(3600), KEEPALIVE, None);
        let slow = async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            1
        };
        assert_eq!(l.within_stall("a frame", slow).await, Some(1));
    }
}

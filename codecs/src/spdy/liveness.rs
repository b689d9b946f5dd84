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

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

/// How long a streaming connection may carry no frame in either direction.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(4 * 3600);
/// How long a writer waits with nothing to send before it sends a keepalive ping.
pub const KEEPALIVE: Duration = Duration::from_secs(30);

/// A connection's activity, shared by its reader and its writer.
#[derive(Clone)]
pub struct Liveness {
    inner: Arc<Inner>,
}

struct Inner {
    start: Instant,
    /// Milliseconds from `start` to the last frame read or written.
    last: AtomicU64,
    /// True once a write to the client failed.
    write_failed: watch::Sender<bool>,
    idle: Duration,
    keepalive: Duration,
}

impl Liveness {
    pub fn new(idle: Duration, keepalive: Duration) -> Liveness {
        Liveness {
            inner: Arc::new(Inner {
                start: Instant::now(),
                last: AtomicU64::new(0),
                write_failed: watch::Sender::new(false),
                idle,
                keepalive,
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
        self.inner.write_failed.send_replace(true);
    }

    /// Returns why, once the connection is over: writing to the client failed, or no frame went
    /// either way for the idle timeout.
    pub async fn over(&self) -> String {
        let i = &self.inner;
        let mut failed = i.write_failed.subscribe();
        loop {
            let last = Duration::from_millis(i.last.load(Ordering::Relaxed));
            let deadline = i.start + last + i.idle;
            tokio::select! {
                _ = failed.wait_for(|f| *f) => return "writing to the client failed".into(),
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
        let l = Liveness::new(Duration::from_secs(2), KEEPALIVE);
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

        let l = Liveness::new(Duration::from_secs(3600), KEEPALIVE);
        l.write_failed();
        assert_eq!(l.over().await, "writing to the client failed");
    }
}

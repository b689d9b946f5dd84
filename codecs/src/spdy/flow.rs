//! SPDY/3.1 flow control: how much DATA this side may send now, per stream and per session, and
//! when to tell the peer it may send more.
//!
//! SPDY/3.1 gives every stream and the session a 64 KiB send window; DATA spends it and the
//! receiver's WINDOW_UPDATE frames (stream id 0: the session) give it back. SETTINGS
//! `INITIAL_WINDOW_SIZE` changes the stream windows, also of open streams, by the difference.
//!
//! Kubernetes' own SPDY library (moby/spdystream, used by kubectl, crictl and the kubelet) never
//! sends WINDOW_UPDATE nor honours it. A sender that waited for window updates from such a peer
//! would stall for good after 64 KiB, so [`SendWindows`] counts always but makes senders wait
//! only once the peer has shown that it does flow control: a WINDOW_UPDATE or an
//! INITIAL_WINDOW_SIZE setting received. On the receiving side [`RecvWindow`] says when to send
//! WINDOW_UPDATE (after half a window is consumed); what a peer sends beyond our windows is
//! accepted for the same reason.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::sync::Notify;

/// Largest window the spec allows (2^31 - 1).
pub const MAX_WINDOW: i64 = 0x7fff_ffff;

/// Why DATA cannot be sent on a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendBlocked {
    /// The stream was closed or reset, or is unknown.
    StreamGone,
    /// The connection is shutting down.
    Closed,
}

/// A flow-control violation by the peer (RST_STREAM or GOAWAY status FLOW_CONTROL_ERROR).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowControlError;

struct State {
    session: i64,
    initial: i64,
    streams: HashMap<u32, i64>,
    enforced: bool,
    closed: bool,
}

/// The send windows of one connection, shared by the writers of its streams.
pub struct SendWindows {
    state: Mutex<State>,
    changed: Notify,
}

impl Default for SendWindows {
    fn default() -> Self {
        Self::new()
    }
}

impl SendWindows {
    pub fn new() -> SendWindows {
        SendWindows {
            state: Mutex::new(State {
                session: i64::from(super::DEFAULT_WINDOW),
                initial: i64::from(super::DEFAULT_WINDOW),
                streams: HashMap::new(),
                enforced: false,
                closed: false,
            }),
            changed: Notify::new(),
        }
    }

    /// A stream this side may send on, with the current initial window.
    pub fn open_stream(&self, id: u32) {
        let mut s = self.state.lock().unwrap();
        let w = s.initial;
        s.streams.insert(id, w);
    }

    /// The stream is closed for sending (FIN sent, or reset): waiting senders give up.
    pub fn close_stream(&self, id: u32) {
        self.state.lock().unwrap().streams.remove(&id);
        self.changed.notify_waiters();
    }

    /// The connection is ending: every waiting and later sender gives up.
    pub fn shutdown(&self) {
        self.state.lock().unwrap().closed = true;
        self.changed.notify_waiters();
    }

    /// Whether senders wait for windows (the peer has shown it does flow control).
    pub fn enforced(&self) -> bool {
        self.state.lock().unwrap().enforced
    }

    /// A WINDOW_UPDATE from the peer. An update of an unknown (closed) stream is ignored; one that
    /// takes a window past 2^31 - 1 is a flow-control error.
    pub fn window_update(&self, stream_id: u32, delta: u32) -> Result<(), FlowControlError> {
        let mut s = self.state.lock().unwrap();
        s.enforced = true;
        let w = if stream_id == 0 {
            Some(&mut s.session)
        } else {
            s.streams.get_mut(&stream_id)
        };
        if let Some(w) = w {
            *w += i64::from(delta);
            if *w > MAX_WINDOW {
                return Err(FlowControlError);
            }
        }
        drop(s);
        self.changed.notify_waiters();
        Ok(())
    }

    /// SETTINGS INITIAL_WINDOW_SIZE: every open stream's window moves by the difference (and
    /// may go negative).
    pub fn set_initial_window(&self, value: u32) {
        let mut s = self.state.lock().unwrap();
        s.enforced = true;
        let diff = i64::from(value) - s.initial;
        s.initial = i64::from(value);
        for w in s.streams.values_mut() {
            *w += diff;
        }
        drop(s);
        self.changed.notify_waiters();
    }

    /// Takes up to `want` bytes of window for `id` if some is available now: `Ok(0)` when the
    /// sender must wait.
    pub fn try_reserve(&self, id: u32, want: usize) -> Result<usize, SendBlocked> {
        let mut s = self.state.lock().unwrap();
        if s.closed {
            return Err(SendBlocked::Closed);
        }
        let enforced = s.enforced;
        let session = s.session;
        let w = s.streams.get_mut(&id).ok_or(SendBlocked::StreamGone)?;
        let n = if enforced {
            let avail = (*w).min(session).max(0);
            (want as i64).min(avail) as usize
        } else {
            want
        };
        *w -= n as i64;
        s.session -= n as i64;
        Ok(n)
    }

    /// Takes between 1 and `want` (> 0) bytes of window for `id`, waiting for WINDOW_UPDATE
    /// frames when the peer enforces flow control and the window is spent.
    pub async fn reserve(&self, id: u32, want: usize) -> Result<usize, SendBlocked> {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            // Registered before the check, so an update between the check and the wait wakes it.
            changed.as_mut().enable();
            match self.try_reserve(id, want)? {
                0 => changed.await,
                n => return Ok(n),
            }
        }
    }

    /// Returns once `id` can no longer be sent on: closed (FIN sent), reset by either side, or the
    /// connection ending.
    pub async fn gone(&self, id: u32) {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.try_reserve(id, 0).is_err() {
                return;
            }
            changed.await;
        }
    }

    /// The (stream, session) windows left, for tests and logs.
    pub fn windows(&self, id: u32) -> (Option<i64>, i64) {
        let s = self.state.lock().unwrap();
        (s.streams.get(&id).copied(), s.session)
    }
}

/// What this side has received but not yet given back with WINDOW_UPDATE, for one stream or the
/// session.
#[derive(Debug)]
pub struct RecvWindow {
    size: u32,
    pending: u32,
}

impl Default for RecvWindow {
    fn default() -> Self {
        RecvWindow::new(super::DEFAULT_WINDOW)
    }
}

impl RecvWindow {
    pub fn new(size: u32) -> RecvWindow {
        RecvWindow { size, pending: 0 }
    }

    /// `n` bytes were consumed; returns the delta of the WINDOW_UPDATE to send now, if any (once
    /// half the window is used up, so updates stay few).
    pub fn consumed(&mut self, n: usize) -> Option<u32> {
        self.pending = self.pending.saturating_add(n.min(u32::MAX as usize) as u32);
        if self.pending >= self.size / 2 {
            let d = self.pending.min(MAX_WINDOW as u32);
            self.pending -= d;
            Some(d)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    #[test]
    fn peers_without_flow_control_are_not_waited_for() {
        let w = SendWindows::new();
        w.open_stream(2);
        // spdystream never sends WINDOW_UPDATE: 1 MiB goes out although the window is 64 KiB.
        for _ in 0..16 {
            assert_eq!(w.try_reserve(2, 65536), Ok(65536));
        }
        assert!(!w.enforced());
        assert_eq!(w.windows(2), (Some(65536 - (1 << 20)), 65536 - (1 << 20)));
    }

    #[test]
    fn windows_limit_senders_once_the_peer_does_flow_control() {
        let w = SendWindows::new();
        w.open_stream(1);
        w.open_stream(3);
        w.window_update(0, 1).unwrap(); // the session window: 65537
        assert!(w.enforced());
        assert_eq!(w.try_reserve(1, 60_000), Ok(60_000));
        // The stream has 5536 left.
        assert_eq!(w.try_reserve(1, 10_000), Ok(5536));
        assert_eq!(w.try_reserve(1, 1), Ok(0));
        // Stream 3 has its own 64 KiB but the session only 1 byte.
        assert_eq!(w.try_reserve(3, 100), Ok(1));
        assert_eq!(w.try_reserve(3, 100), Ok(0));
        w.window_update(1, 1000).unwrap();
        assert_eq!(w.try_reserve(1, 2000), Ok(0), "session still spent");
        w.window_update(0, 500).unwrap();
        assert_eq!(w.try_reserve(1, 2000), Ok(500));
        assert_eq!(w.windows(1), (Some(500), 0));
        // Updates of closed streams are ignored; overflow is an error.
        w.window_update(99, 5).unwrap();
        assert_eq!(w.window_update(3, 0x7fff_ffff), Err(FlowControlError));
    }

    #[test]
    fn initial_window_setting_moves_open_streams() {
        let w = SendWindows::new();
        w.open_stream(1);
        assert_eq!(w.try_reserve(1, 1000), Ok(1000));
        w.set_initial_window(1000);
        // 1000 - 65536 + 64536 spent: the stream is at 0 and must wait.
        assert_eq!(w.windows(1).0, Some(0));
        assert_eq!(w.try_reserve(1, 1), Ok(0));
        w.open_stream(3);
        assert_eq!(w.windows(3).0, Some(1000));
        assert_eq!(w.try_reserve(3, 5000), Ok(1000));
    }

    #[tokio::test]
    async fn a_waiting_sender_wakes_on_window_update_and_on_close() {
        let w = Arc::new(SendWindows::new());
        w.open_stream(1);
        w.window_update(1, 1).unwrap();
        assert_eq!(w.try_reserve(1, 65537), Ok(65536), "session-limited");
        let w2 = w.clone();
        let waiter = tokio::spawn(async move { w2.reserve(1, 10).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished());
        w.window_update(0, 4).unwrap();
        assert_eq!(
            waiter.await.unwrap(),
            Ok(1),
            "stream window had 1 byte left"
        );
        let w2 = w.clone();
        let waiter = tokio::spawn(async move { w2.reserve(1, 10).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        w.close_stream(1);
        assert_eq!(waiter.await.unwrap(), Err(SendBlocked::StreamGone));
        w.open_stream(5);
        w.shutdown();
        assert_eq!(w.reserve(5, 1).await, Err(SendBlocked::Closed));
    }

    #[test]
    fn receive_windows_are_given_back_after_half_is_used() {
        let mut r = RecvWindow::default();
        assert_eq!(r.consumed(10_000), None);
        assert_eq!(r.consumed(22_767), None);
        assert_eq!(r.consumed(1), Some(32_768));
        assert_eq!(r.consumed(100_000), Some(100_000));
        assert_eq!(r.consumed(1), None);
    }
}

//! Owns the SIGKILL deadlines of containers being stopped. A StopContainer waiting out its grace
//! period holds the container's operation lock; a later stop with a shorter timeout (the kubelet
//! shortening a grace period, a forced delete, RemoveContainer, StopPodSandbox) brings that
//! deadline forward instead of queueing behind the whole of it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

/// Stops of containers, by id, with the earliest deadline any of them asked for.
#[derive(Default)]
pub struct StopDeadlines {
    stops: Mutex<HashMap<String, Entry>>,
}

struct Entry {
    deadline: watch::Sender<Instant>,
    /// [`Stop`]s of the container alive.
    stops: usize,
}

/// One stop of a container, joined with every other stop of it under way; dropping it leaves.
pub struct Stop<'a> {
    deadlines: &'a StopDeadlines,
    id: String,
    deadline: watch::Receiver<Instant>,
}

/// `timeout` seconds from now (a negative one is none; a huge one is decades, not an overflow).
pub fn deadline_after(timeout: i64) -> Instant {
    let now = Instant::now();
    let wait = Duration::from_secs(timeout.max(0) as u64);
    now.checked_add(wait)
        .unwrap_or_else(|| now + Duration::from_secs(1 << 30))
}

impl StopDeadlines {
    /// Joins the stops of `id`, bringing their deadline forward to `deadline` if that is sooner.
    /// Call it before waiting for the container's operation lock, so that a stop holding it
    /// learns of the shorter deadline at once.
    pub fn join(&self, id: &str, deadline: Instant) -> Stop<'_> {
        let mut stops = self.stops.lock().unwrap_or_else(|e| e.into_inner());
        let e = stops.entry(id.to_string()).or_insert_with(|| Entry {
            deadline: watch::channel(deadline).0,
            stops: 0,
        });
        e.stops += 1;
        e.deadline.send_if_modified(|d| {
            let sooner = deadline < *d;
            if sooner {
                *d = deadline;
            }
            sooner
        });
        Stop {
            deadlines: self,
            id: id.to_string(),
            deadline: e.deadline.subscribe(),
        }
    }
}

impl Stop<'_> {
    /// Whether the earliest deadline has passed.
    pub fn expired(&self) -> bool {
        *self.deadline.borrow() <= Instant::now()
    }

    /// Resolves once the earliest deadline passes, following it when another stop brings it
    /// forward.
    pub async fn reached(&mut self) {
        loop {
            let at = *self.deadline.borrow_and_update();
            tokio::select! {
                () = tokio::time::sleep_until(at) => return,
                changed = self.deadline.changed() => {
                    // The sender lives as long as any stop of the container, this one included.
                    debug_assert!(changed.is_ok());
                }
            }
        }
    }
}

impl Drop for Stop<'_> {
    fn drop(&mut self) {
        let mut stops = self
            .deadlines
            .stops
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(e) = stops.get_mut(&self.id) {
            e.stops -= 1;
            if e.stops == 0 {
                stops.remove(&self.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stop waiting out a long grace period ends when a later stop asks for a shorter one, and
    /// a later, longer one changes nothing.
    #[tokio::test]
    async fn a_shorter_stop_brings_the_deadline_forward() {
        let d = StopDeadlines::default();
        let mut long = d.join("c", deadline_after(3600));
        assert!(!long.expired());
        let start = Instant::now();
        let waiting = async {
            long.reached().await;
            Instant::now() - start
        };
        let later = async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let longer = d.join("c", deadline_after(7200));
            let forced = d.join("c", deadline_after(0));
            assert!(forced.expired() && longer.expired());
            (longer, forced)
        };
        let (waited, _stops) = tokio::join!(waiting, later);
        assert!(
            waited >= Duration::from_millis(200) && waited < Duration::from_secs(60),
            "{waited:?}"
        );
    }

    /// The deadlines of a container are forgotten when its last stop ends: the next stop starts
    /// from its own timeout.
    #[test]
    fn deadlines_are_forgotten_with_the_last_stop() {
        let d = StopDeadlines::default();
        let forced = d.join("c", deadline_after(0));
        let other = d.join("other", deadline_after(60));
        drop(forced);
        assert!(!d.join("c", deadline_after(30)).expired());
        assert!(d.stops.lock().unwrap().contains_key("other"));
        drop(other);
        assert!(d.stops.lock().unwrap().is_empty());
        // Timeouts out of range: none, or decades.
        assert!(d.join("c", deadline_after(-5)).expired());
        assert!(!d.join("d", deadline_after(i64::MAX)).expired());
    }
}

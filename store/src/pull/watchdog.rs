//! The progress watchdog of a pull job: the job's references are all dropped when its transfers
//! run for `pull.progress_timeout` without a byte moving (downloaded, or read by its layer
//! unpacks), or (with `pull.min_speed`) below that speed over a window as long. Only time with a
//! transfer of the job running counts: waiting for a transfer slot is not a stall, nor is the
//! unpack after the last byte (a layer of many small files reads its last compressed byte long
//! before its last file is written: compressed bytes cannot tell a slow unpack from a stuck one,
//! so it is not judged, rather than cancelled while healthy).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{Job, JobBytes, PullManager};

impl PullManager {
    /// Drops every reference of a job whose transfers ran for `timeout` without a byte, or (given a
    /// minimum speed, `pull.min_speed`) received fewer bytes per second of transfer time than that
    /// over a window of `timeout` ([`Watchdog`]). Only time with a transfer of the job running
    /// counts: waiting for a transfer slot, for the registry to resolve the image, or for the
    /// unpack and its sync after the last byte is not the network's doing.
    pub(super) async fn watchdog(&self, job: Arc<Job>, timeout: Duration, min_speed: Option<u64>) {
        let reason = judge(timeout, min_speed, || job.bytes()).await;
        tracing::warn!(job = job.id, image = %job.reference, "{reason}; dropping every requester");
        self.drop_requesters(&job, &reason, |_| true);
    }
}

/// Samples a job's bytes (`bytes`) until the [`Watchdog`] judges it stalled; why. Also what the
/// simulation of the pull engine runs for each of its pulls.
pub(crate) async fn judge(
    timeout: Duration,
    min_speed: Option<u64>,
    bytes: impl Fn() -> JobBytes,
) -> String {
    let tick = (timeout / 10).clamp(Duration::from_millis(50), Duration::from_secs(1));
    let mut dog = Watchdog::new(timeout, min_speed, &bytes());
    let mut last = Instant::now();
    loop {
        tokio::time::sleep(tick).await;
        let now = Instant::now();
        let verdict = dog.observe(now - last, &bytes());
        last = now;
        if let Some(reason) = verdict {
            return reason;
        }
    }
}

/// The progress watchdog's judgement of a job, from its bytes sampled over time.
struct Watchdog {
    timeout: Duration,
    min_speed: Option<u64>,
    /// Bytes downloaded and bytes unpacked, at the last change.
    last_moved: u64,
    /// Transfer time since the last byte arrived.
    idle: Duration,
    /// Transfer time in the current speed window, and the bytes downloaded when it began.
    window: (Duration, u64),
}

impl Watchdog {
    fn new(timeout: Duration, min_speed: Option<u64>, first: &JobBytes) -> Watchdog {
        Watchdog {
            timeout,
            min_speed,
            last_moved: first.done + first.unpacked,
            idle: Duration::ZERO,
            window: (Duration::ZERO, first.downloaded),
        }
    }

    /// `dt` passed and the job's bytes are now `b`: the reason to drop its requesters, if any.
    fn observe(&mut self, dt: Duration, b: &JobBytes) -> Option<String> {
        let complete = b.total > 0 && b.done >= b.total;
        let transferring = b.connections > 0 && !complete;
        let moved = b.done + b.unpacked;
        if moved != self.last_moved || complete {
            self.last_moved = moved;
            self.idle = Duration::ZERO;
        } else if transferring {
            self.idle += dt;
            if self.idle >= self.timeout {
                return Some(format!(
                    "no progress: no byte in {:?} of transfers (pull.progress_timeout)",
                    self.timeout
                ));
            }
        }
        let min = self.min_speed?;
        if transferring {
            self.window.0 += dt;
        }
        if self.window.0 < self.timeout {
            return None;
        }
        let (spent, from) = std::mem::replace(&mut self.window, (Duration::ZERO, b.downloaded));
        let got = b.downloaded.saturating_sub(from);
        let need = (min as f64 * spent.as_secs_f64()) as u64;
        (!complete && got < need).then(|| {
            format!(
                "{got} bytes received in {spent:.0?} of transfers, below the minimum of {min} \
                 bytes/s (pull.min_speed)"
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(done: u64, total: u64, connections: usize) -> JobBytes {
        read(done, total, connections, 0)
    }

    /// `bytes`, with `unpacked` bytes read by the unpacks.
    fn read(done: u64, total: u64, connections: usize, unpacked: u64) -> JobBytes {
        JobBytes {
            done,
            total,
            downloaded: done,
            resumed: 0,
            refetched: 0,
            rate: 0.0,
            connections,
            unpacked,
        }
    }

    /// Feeds the watchdog `secs` one-second samples; the second its verdict came, if it did.
    fn run(dog: &mut Watchdog, secs: u64, mut at: impl FnMut(u64) -> JobBytes) -> Option<u64> {
        (1..=secs).find(|&t| dog.observe(Duration::from_secs(1), &at(t)).is_some())
    }

    #[test]
    fn waiting_for_a_transfer_slot_is_not_a_stall() {
        let t = Duration::from_secs(10);
        let mut dog = Watchdog::new(t, Some(1024), &bytes(0, 100, 0));
        assert_eq!(run(&mut dog, 600, |_| bytes(0, 100, 0)), None);
        // Then a transfer runs and nothing arrives: judged on the transfer's time only.
        assert_eq!(run(&mut dog, 600, |_| bytes(0, 100, 1)), Some(10));
    }

    #[test]
    fn only_transfer_time_without_a_byte_counts() {
        let t = Duration::from_secs(10);
        let mut dog = Watchdog::new(t, None, &bytes(5, 100, 1));
        // Slots taken back every 5 s and given again 5 s later, never a byte: 10 s of transfer
        // time take 20 s.
        let verdict = run(&mut dog, 600, |s| {
            bytes(5, 100, usize::from((s - 1) % 10 < 5))
        });
        assert_eq!(verdict, Some(15));
        // A byte now and then keeps it alive.
        let mut dog = Watchdog::new(t, None, &bytes(5, 100, 1));
        assert_eq!(run(&mut dog, 600, |s| bytes(5 + s / 9, 100, 1)), None);
    }

    #[test]
    fn the_minimum_speed_is_judged_over_transfer_time() {
        let t = Duration::from_secs(10);
        // 100 bytes/s while transferring, half the time: above a 50 bytes/s minimum, which
        // wall-clock time would judge as 50 (and a minimum of 60 would fail).
        let mut got = 0;
        let mut dog = Watchdog::new(t, Some(60), &bytes(0, u64::MAX, 0));
        let verdict = run(&mut dog, 600, |s| {
            let on = (s - 1) % 10 < 5;
            if on {
                got += 100;
            }
            bytes(got, u64::MAX, usize::from(on))
        });
        assert_eq!(verdict, None);
        // 40 bytes/s of transfer time is below 60.
        let mut got = 0;
        let mut dog = Watchdog::new(t, Some(60), &bytes(0, u64::MAX, 1));
        let verdict = run(&mut dog, 600, |_| {
            got += 40;
            bytes(got, u64::MAX, 1)
        });
        assert_eq!(verdict, Some(10));
    }

    #[test]
    fn a_job_with_every_byte_in_is_left_alone() {
        let mut dog = Watchdog::new(Duration::from_secs(10), Some(1 << 20), &bytes(100, 100, 1));
        assert_eq!(run(&mut dog, 600, |_| bytes(100, 100, 1)), None);
    }

    #[test]
    fn bytes_read_by_the_unpacks_are_progress_and_the_unpack_after_the_last_byte_is_not_judged() {
        let t = Duration::from_secs(10);
        // A transfer stuck at 50 of 100 bytes while the unpacks read what is on disk: alive as
        // long as they read.
        let mut dog = Watchdog::new(t, None, &read(50, 100, 1, 0));
        for s in 1..=30u64 {
            assert_eq!(
                dog.observe(Duration::from_secs(1), &read(50, 100, 1, s)),
                None
            );
        }
        let fired = (1..=30u64).find(|_| {
            dog.observe(Duration::from_secs(1), &read(50, 100, 1, 30))
                .is_some()
        });
        assert_eq!(fired, Some(10));
        // Every byte in, the unpacks reading nothing for minutes (files being written): left
        // alone.
        let mut dog = Watchdog::new(t, Some(1 << 20), &read(100, 100, 0, 40));
        for _ in 0..600 {
            assert_eq!(
                dog.observe(Duration::from_secs(1), &read(100, 100, 0, 40)),
                None
            );
        }
    }
}

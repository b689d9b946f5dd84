//! What the daemon gives back once a burst of work is over: the memory allocator's free pages
//! and the registry connections nobody uses. Without this the daemon's footprint after a burst
//! of pulls and pods stays at the burst's high-water mark.
//!
//! - Memory: the live heap is small and flat (a few MiB; measured with heaptrack over the load
//!   test: 5-7 MiB while 200 pods are run and removed, 1.7 MiB idle), but glibc's malloc keeps
//!   freed memory in its arenas (one per thread that allocated, up to 8 per core) and returns
//!   little of it by itself: the resident set grew by 3-13 MiB a round, round after round. So
//!   the allocator gets at most [`ARENAS`] arenas (the freed memory of the blocking pool's
//!   short-lived threads is reused by the next burst instead of stranded), and `malloc_trim(0)`
//!   gives the free pages of every arena back every [`INTERVAL`]. Both are glibc-only (musl's
//!   allocator needs neither).
//! - Connections: the HTTP client of a registry keeps every connection a burst opened (100
//!   concurrent pulls: about 100) idle for 90 s; clients not used for [`CLIENT_IDLE`] are
//!   dropped with their pools ([`minicri_store::Registry::drop_idle_clients`]).

use std::sync::Arc;
use std::time::Duration;

/// glibc malloc arenas at most (its default is 8 per core).
pub const ARENAS: i32 = 2;
/// How often the idle resources are given back.
pub const INTERVAL: Duration = Duration::from_secs(10);
/// A registry client unused this long is dropped.
pub const CLIENT_IDLE: Duration = Duration::from_secs(10);

/// Caps the allocator's arenas; call first thing in `main`, before threads start.
pub fn limit_arenas() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes a malloc tunable; no thread allocates concurrently yet.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, ARENAS);
    }
}

/// Gives idle resources back every [`INTERVAL`], until `shutdown`.
pub fn spawn(
    daemon: Arc<crate::daemon::Daemon>,
    shutdown: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let dropped = daemon.registry.drop_idle_clients(CLIENT_IDLE);
            if dropped > 0 {
                tracing::debug!(clients = dropped, "dropped idle registry clients");
            }
            let _ = tokio::task::spawn_blocking(trim).await;
        }
    })
}

fn trim() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim is thread-safe (it takes each arena's lock in turn).
    unsafe {
        libc::malloc_trim(0);
    }
}

//! Collection of abandoned partial downloads, so they cannot fill the disk.
//!
//! A partial download (an ingest) that no running download owns is removed once it has not been
//! written to for the TTL (default 24 h). When the image filesystem runs low on space (less free
//! than `min_free_ratio` of its size, 5% by default), idle ingests go first, oldest first, until there is room
//! again, however young they are: a resumable download is worth less than a working node.
//!
//! Before a download or an unpack is refused at the reserve, the reserve asks this collector for
//! the room it lacks ([`crate::space::Reclaim`]): idle partial downloads go, oldest first, until
//! there is room, so a pull that fits the filesystem alone is never refused because of partial
//! data that nobody wants.
//!
//! How this sits with the reserve ([`crate::space`], 15% by default): downloads and unpacks stop
//! before free space falls under the reserve, and a download stopped there keeps its partial data
//! for a resume. That data is taken by this low-space rule only when something else (container
//! writes, logs, another program) brings free space under `min_free_ratio` as well, which is why
//! the reserve must be the larger of the two: with a smaller reserve, a download stopped at it
//! would leave free space under `min_free_ratio`, its partial data would be collected, and every
//! retry would fetch the same bytes again.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::blobs::BlobDownloads;
use crate::content::{BlobKey, ContentStore, IngestStatus};
use crate::digest::Digest;

/// Free fraction of the image filesystem below which young partial downloads are collected too.
pub const DEFAULT_MIN_FREE_RATIO: f64 = 0.05;

/// What a collection removed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct GcReport {
    pub expired: Vec<Digest>,
    pub for_space: Vec<Digest>,
    pub bytes_freed: u64,
}

/// Collects idle ingests.
pub struct IngestGc {
    content: Arc<ContentStore>,
    blobs: Arc<BlobDownloads>,
    pub ttl: Duration,
    /// Free space below this fraction of the filesystem triggers collection of young ingests
    /// (0 turns that off).
    pub min_free_ratio: f64,
}

impl IngestGc {
    pub fn new(content: Arc<ContentStore>, blobs: Arc<BlobDownloads>, ttl: Duration) -> IngestGc {
        IngestGc {
            content,
            blobs,
            ttl,
            min_free_ratio: DEFAULT_MIN_FREE_RATIO,
        }
    }

    /// Free fraction of the filesystem holding the content store.
    fn free_ratio(&self) -> f64 {
        match crate::space::fs_space(self.content.root()) {
            Ok(s) if s.total > 0 => s.available as f64 / s.total as f64,
            _ => 1.0,
        }
    }

    /// One collection pass (blocking I/O).
    pub fn collect(&self) -> GcReport {
        let Some((ingests, active)) = self.idle() else {
            return GcReport::default();
        };
        let plan = plan(ingests, &active, SystemTime::now(), self.ttl, || {
            self.min_free_ratio > 0.0 && self.free_ratio() < self.min_free_ratio
        });
        let mut report = GcReport::default();
        for (ing, why_space) in plan {
            let reason = if why_space {
                "low disk space"
            } else {
                "expired"
            };
            if !self.remove(&ing, reason) {
                continue;
            }
            report.bytes_freed += ing.offset;
            if why_space {
                report.for_space.push(ing.key.digest)
            } else {
                report.expired.push(ing.key.digest)
            }
        }
        report
    }

    /// The ingests on disk and the blobs downloading now.
    fn idle(&self) -> Option<(Vec<IngestStatus>, HashSet<BlobKey>)> {
        let ingests = match self.content.list_ingests() {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list partial downloads");
                return None;
            }
        };
        Some((ingests, self.blobs.active().into_iter().collect()))
    }

    /// Removes one idle ingest unless a download took it up meanwhile; whether it did.
    fn remove(&self, ing: &IngestStatus, reason: &str) -> bool {
        self.blobs.remove_idle(&ing.key, reason, ing.offset)
    }
}

/// Room for a claim the reserve would refuse: idle partial downloads, oldest first, until the
/// bytes lacking are freed (or none is left).
impl crate::space::Reclaim for IngestGc {
    fn reclaim(&self, bytes: u64) -> u64 {
        let Some((mut ingests, active)) = self.idle() else {
            return 0;
        };
        ingests.retain(|i| !active.contains(&i.key));
        ingests.sort_by_key(|i| i.updated_at);
        let mut freed = 0;
        for ing in ingests {
            if freed >= bytes {
                break;
            }
            if self.remove(&ing, "making room for a download or an unpack") {
                // The blocks the file took, which the filesystem gives back.
                freed += ing.offset.max(1);
            }
        }
        freed
    }
}

/// Which idle ingests to remove: every expired one, then (while `low_space()` says so) the rest,
/// oldest first. Returns `(ingest, removed_for_space)`.
fn plan(
    mut ingests: Vec<IngestStatus>,
    active: &HashSet<BlobKey>,
    now: SystemTime,
    ttl: Duration,
    mut low_space: impl FnMut() -> bool,
) -> Vec<(IngestStatus, bool)> {
    ingests.retain(|i| !active.contains(&i.key));
    ingests.sort_by_key(|i| i.updated_at);
    let mut out = Vec::new();
    let mut rest = Vec::new();
    for i in ingests {
        let idle = now.duration_since(i.updated_at).unwrap_or_default();
        if idle >= ttl {
            out.push((i, false))
        } else {
            rest.push(i)
        }
    }
    // Freed space shows in statvfs only after removal; the caller removes in this order, and a
    // single pass that over-collects a little is acceptable when the disk is nearly full.
    if low_space() {
        out.extend(rest.into_iter().map(|i| (i, true)));
    }
    out
}

/// Runs collections every `interval` until `shutdown` is cancelled (a collection under way
/// finishes first).
pub fn spawn_periodic(
    gc: Arc<IngestGc>,
    interval: Duration,
    shutdown: tokio_util::sync::CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let g = gc.clone();
            let _ = tokio::task::spawn_blocking(move || g.collect()).await;
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(interval) => {}
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ingest(n: u8, age_secs: u64, now: SystemTime) -> IngestStatus {
        IngestStatus {
            key: BlobKey::new(Digest::of(&[n]), 100),
            offset: 10,
            updated_at: now - Duration::from_secs(age_secs),
            written_by: Vec::new(),
        }
    }

    /// An ingest whose writer holds its lock (not yet, or no longer, listed as in flight) is in
    /// use: the collector leaves it, and the blob commits.
    #[test]
    fn a_locked_ingest_is_not_collected() {
        let dir = tempfile::tempdir().unwrap();
        let content = Arc::new(ContentStore::open(dir.path()).unwrap());
        let blobs = BlobDownloads::new(content.clone(), Default::default(), Default::default());
        let gc = IngestGc::new(content.clone(), blobs, Duration::ZERO);
        let data = b"some blob".to_vec();
        let d = Digest::of(&data);
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let key = BlobKey::new(d.clone(), data.len() as u64);
        let guard = rt.block_on(content.lock_ingest(&key));
        let mut ing = content.open_ingest(&key).unwrap();
        ing.append(&data).unwrap();
        let report = gc.collect();
        assert!(report.expired.is_empty(), "{report:?}");
        ing.commit(&content).unwrap();
        drop(guard);
        assert_eq!(content.read(&d).unwrap(), data);
        // Unlocked and idle, a partial goes.
        let other = Digest::of(b"another");
        content
            .open_ingest(&BlobKey::new(other.clone(), 7))
            .unwrap()
            .append(b"ano")
            .unwrap();
        assert_eq!(gc.collect().expired, vec![other]);
    }

    /// Partial data a running pull pins (its unpacks still read it, though its download
    /// failed) is not idle: neither room-making nor the TTL takes it; once unpinned, it goes.
    #[test]
    fn a_pinned_ingest_is_not_collected() {
        use crate::space::Reclaim;
        let dir = tempfile::tempdir().unwrap();
        let content = Arc::new(ContentStore::open(dir.path()).unwrap());
        let blobs = BlobDownloads::new(content.clone(), Default::default(), Default::default());
        let mut gc = IngestGc::new(content.clone(), blobs.clone(), Duration::ZERO);
        gc.min_free_ratio = 0.0;
        let key = BlobKey::new(Digest::of(b"a layer"), 7);
        content.open_ingest(&key).unwrap().append(b"a l").unwrap();
        let pin = blobs.pin(vec![key.clone()]);
        assert_eq!(gc.reclaim(1 << 20), 0);
        assert_eq!(gc.collect(), GcReport::default());
        assert_eq!(content.list_ingests().unwrap().len(), 1);
        drop(pin);
        assert!(gc.reclaim(1 << 20) > 0);
        assert!(content.list_ingests().unwrap().is_empty());
    }

    #[test]
    fn expired_idle_ingests_go_and_active_ones_stay() {
        let now = SystemTime::now();
        let day = 24 * 3600;
        let v = vec![
            ingest(1, day + 5, now),
            ingest(2, 10, now),
            ingest(3, day * 2, now),
        ];
        let active: HashSet<BlobKey> = [BlobKey::new(Digest::of(&[3]), 100)].into_iter().collect();
        let p = plan(v, &active, now, Duration::from_secs(day), || false);
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].0.key.digest, Digest::of(&[1]));
        assert!(!p[0].1);
    }

    #[test]
    fn low_space_takes_young_ones_oldest_first() {
        let now = SystemTime::now();
        let v = vec![ingest(1, 30, now), ingest(2, 300, now), ingest(3, 3, now)];
        let p = plan(v, &HashSet::new(), now, Duration::from_secs(3600), || true);
        let order: Vec<Digest> = p.iter().map(|(i, _)| i.key.digest.clone()).collect();
        assert_eq!(
            order,
            vec![Digest::of(&[2]), Digest::of(&[1]), Digest::of(&[3])]
        );
        assert!(p.iter().all(|(_, space)| *space));
    }

    #[test]
    fn collects_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        let content = Arc::new(ContentStore::open(dir.path()).unwrap());
        let d = Digest::of(b"old partial");
        let mut ing = content.open_ingest(&BlobKey::new(d.clone(), 100)).unwrap();
        ing.append(b"old").unwrap();
        drop(ing);
        let blobs = BlobDownloads::new(content.clone(), Default::default(), Default::default());
        let mut gc = IngestGc::new(content.clone(), blobs, Duration::from_secs(3600));
        // Whatever this machine's disk looks like, only the TTL is under test here.
        gc.min_free_ratio = 0.0;
        assert_eq!(gc.collect(), GcReport::default(), "young ingest kept");
        gc.ttl = Duration::ZERO;
        let r = gc.collect();
        assert_eq!(r.expired, vec![d]);
        assert!(content.list_ingests().unwrap().is_empty());
    }
}

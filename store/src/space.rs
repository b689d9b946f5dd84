//! The image filesystem's reserve: free space that pulls leave alone.
//!
//! A registry decides how many bytes a download writes, and a layer how many its unpack writes;
//! unbounded, one pull fills the filesystem the kubelet measures as `imagefs`, and once its free
//! space falls under the kubelet's hard eviction threshold (`imagefs.available<15%` by default)
//! the kubelet evicts pods, other tenants' included. A pull must fail first.
//!
//! [`SpaceBudget`] is one per filesystem (the content store's and the snapshotter's share one
//! when they are on the same filesystem). Every writer claims its bytes before writing them
//! ([`SpaceBudget::claim`]): the ingest writer for downloaded bytes, the unpack for the
//! uncompressed layer bytes it is about to write. A claim that would leave less free than the
//! reserve is refused with a [`Shortfall`], and the writer stops without writing.
//!
//! Not a syscall per chunk: free space is measured (statvfs) when the bytes claimed by all
//! writers since the last measure reach [`MEASURE_EVERY`], or an eighth of the room left above
//! the reserve if that is less (so the measures come closer together as the reserve nears, and
//! what the estimate misses, such as the blocks a small file takes beyond its bytes, stays a
//! fraction of the room), and whenever the estimate says a claim would cross the reserve: a
//! refusal always rests on a fresh measure. In between, free space is the last measure less the
//! bytes claimed since. A writer settles its claim once the bytes are written
//! ([`SpaceBudget::settle`]); until then they count whatever a measure says, so bytes claimed
//! but not yet on disk are never forgotten by a measure taken in between.
//!
//! **Room is made before a refusal.** A claim or check the reserve would refuse first asks the
//! budget's [`Reclaim`] (the content store's collector of idle partial downloads, installed with
//! [`SpaceBudget::reclaim_with`]) to free the bytes missing, oldest partial data that no running
//! download wants first, then measures again: a pull is refused only when the filesystem is full
//! of what is in use, never because of partial data nobody wants.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, Weak};

use crate::text::human_bytes;

/// Bytes claimed on a filesystem, by all its writers together, between two measures at most.
pub const MEASURE_EVERY: u64 = 4 << 20;
/// Bytes claimed between two measures at least (near the reserve).
const MEASURE_AT_LEAST_EVERY: u64 = 64 << 10;

/// The setting's name, for messages.
pub const SETTING: &str = "pull.image_fs_reserve";

/// How much of a filesystem stays free: a percentage of its size or a number of bytes, as the
/// kubelet's eviction thresholds are written. Zero turns the reserve off.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Reserve {
    Percent(f64),
    Bytes(u64),
}

/// The default: what the kubelet's default hard eviction threshold `imagefs.available<15%` keeps.
pub const DEFAULT_RESERVE: Reserve = Reserve::Percent(15.0);

impl Reserve {
    /// The reserve in bytes on a filesystem of `total` bytes.
    pub fn bytes_of(self, total: u64) -> u64 {
        match self {
            Reserve::Percent(p) => (total as f64 * p / 100.0).ceil() as u64,
            Reserve::Bytes(b) => b,
        }
    }

    pub fn is_off(self) -> bool {
        self.bytes_of(u64::MAX) == 0
    }
}

impl fmt::Display for Reserve {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reserve::Percent(p) => write!(f, "{p}%"),
            Reserve::Bytes(b) => write!(f, "{b}"),
        }
    }
}

impl FromStr for Reserve {
    type Err = String;

    /// `15%`, `20GiB` (`KiB`, `MiB`, `GiB`, `TiB`, or Kubernetes' `Ki`, `Mi`, `Gi`, `Ti`), or a
    /// number of bytes.
    fn from_str(s: &str) -> Result<Reserve, String> {
        let s = s.trim();
        let bad = || format!("{s:?} is not a percentage (15%) or a size (20GiB, 1073741824)");
        if let Some(p) = s.strip_suffix('%') {
            let p: f64 = p.trim().parse().map_err(|_| bad())?;
            if !p.is_finite() || !(0.0..100.0).contains(&p) {
                return Err(format!("{s:?}: a percentage from 0 to under 100"));
            }
            return Ok(Reserve::Percent(p));
        }
        let digits = s.trim_end_matches(|c: char| c.is_ascii_alphabetic());
        let unit = &s[digits.len()..];
        let shift = match unit {
            "" | "B" => 0,
            "Ki" | "KiB" => 10,
            "Mi" | "MiB" => 20,
            "Gi" | "GiB" => 30,
            "Ti" | "TiB" => 40,
            _ => return Err(bad()),
        };
        let n: u64 = digits.trim().parse().map_err(|_| bad())?;
        n.checked_mul(1 << shift)
            .map(Reserve::Bytes)
            .ok_or_else(|| format!("{s:?} is too large"))
    }
}

impl serde::Serialize for Reserve {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> serde::Deserialize<'de> for Reserve {
    /// A string as [`Reserve::from_str`] reads it, or a number of bytes.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Reserve, D::Error> {
        #[derive(serde::Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bytes(u64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Bytes(b) => Ok(Reserve::Bytes(b)),
            Raw::Text(t) => t.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// Free and total bytes of a filesystem, as the kubelet counts them (statfs `f_bavail` and
/// `f_blocks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsSpace {
    pub available: u64,
    pub total: u64,
}

/// Measures [`FsSpace`] of the filesystem holding `path`.
pub fn fs_space(path: &Path) -> std::io::Result<FsSpace> {
    let s = nix::sys::statvfs::statvfs(path)?;
    let unit = s.fragment_size().max(1);
    Ok(FsSpace {
        available: s.blocks_available().saturating_mul(unit),
        total: s.blocks().saturating_mul(unit),
    })
}

/// Where a budget measures its filesystem: statvfs, or a fake in unit tests.
pub trait Measure: Send + Sync {
    fn measure(&self) -> std::io::Result<FsSpace>;
}

struct Statvfs(PathBuf);

impl Measure for Statvfs {
    fn measure(&self) -> std::io::Result<FsSpace> {
        fs_space(&self.0)
    }
}

/// What frees space on a budget's filesystem before a claim is refused: partial downloads that
/// no running download wants. Blocking.
pub trait Reclaim: Send + Sync {
    /// Frees at least `bytes` if it can, oldest data first; returns the bytes freed.
    fn reclaim(&self, bytes: u64) -> u64;
}

/// A claim refused: the bytes would leave less than the reserve free.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the image filesystem holding {path} has {free_h} free and {needed_h} more would leave less than its reserve of {reserve_h} ({SETTING} = {setting})",
    path = .path.display(),
    free_h = human_bytes(*.free as f64),
    needed_h = human_bytes(*.needed as f64),
    reserve_h = human_bytes(*.reserve as f64),
)]
pub struct Shortfall {
    pub path: PathBuf,
    /// Free bytes (measured, less what was claimed since).
    pub free: u64,
    /// Bytes the refused claim asked for.
    pub needed: u64,
    /// The reserve in bytes.
    pub reserve: u64,
    /// The reserve as configured.
    pub setting: String,
}

impl Shortfall {
    /// As an I/O error of kind `StorageFull`, for writers that speak `io::Error` (the
    /// snapshotter): the store finds the shortfall again with [`Shortfall::find`].
    pub fn into_io(self) -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::StorageFull, self)
    }

    /// The shortfall an error (or one of its sources, or an I/O error it wraps) carries.
    pub fn find<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a Shortfall> {
        let mut cur = Some(e);
        while let Some(e) = cur {
            if let Some(s) = e.downcast_ref::<Shortfall>() {
                return Some(s);
            }
            if let Some(inner) = e
                .downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
            {
                cur = Some(inner);
                continue;
            }
            cur = e.source();
        }
        None
    }
}

/// The last measure and the claims against it.
#[derive(Debug, Default)]
struct Estimate {
    measured: Option<FsSpace>,
    /// Claimed bytes written (settled) since the measure: the measure may not show them.
    settled: u64,
    /// Claimed bytes not written yet: counted until settled, whatever a measure says meanwhile.
    outstanding: u64,
    /// Bytes claimed since the measure, and the count at which the next one is due.
    since: u64,
    next: u64,
}

impl Estimate {
    /// Free bytes as far as known, less the claims not yet seen by a measure.
    fn free(&self, m: FsSpace) -> u64 {
        m.available
            .saturating_sub(self.settled.saturating_add(self.outstanding))
    }
}

/// The reserve of one filesystem and the claims of its writers; see the module docs.
pub struct SpaceBudget {
    path: PathBuf,
    reserve: Reserve,
    measure: Box<dyn Measure>,
    estimate: Mutex<Estimate>,
    refusals: AtomicU64,
    measures: AtomicU64,
    /// What frees room before a refusal (a back-reference: the collector needs the downloads,
    /// which need this budget, so it is installed once they exist).
    reclaim: OnceLock<Weak<dyn Reclaim>>,
    /// Held while room is made.
    reclaiming: Mutex<()>,
    /// Bytes freed that way so far.
    reclaimed: AtomicU64,
}

impl fmt::Debug for SpaceBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SpaceBudget")
            .field("path", &self.path)
            .field("reserve", &self.reserve)
            .finish()
    }
}

impl SpaceBudget {
    /// The budget of the filesystem holding `path`.
    pub fn new(path: &Path, reserve: Reserve) -> SpaceBudget {
        Self::with_measure(path, reserve, Box::new(Statvfs(path.to_path_buf())))
    }

    /// A budget measured by `measure` (`path` names it in messages).
    pub fn with_measure(path: &Path, reserve: Reserve, measure: Box<dyn Measure>) -> SpaceBudget {
        SpaceBudget {
            path: path.to_path_buf(),
            reserve,
            measure,
            estimate: Mutex::new(Estimate::default()),
            refusals: AtomicU64::new(0),
            measures: AtomicU64::new(0),
            reclaim: OnceLock::new(),
            reclaiming: Mutex::new(()),
            reclaimed: AtomicU64::new(0),
        }
    }

    /// Installs what frees room before a claim is refused (once).
    pub fn reclaim_with(&self, r: Weak<dyn Reclaim>) {
        let _ = self.reclaim.set(r);
    }

    /// Bytes freed by the reclaimer so far.
    pub fn reclaimed(&self) -> u64 {
        self.reclaimed.load(Ordering::Relaxed)
    }

    /// Asks the reclaimer for the room `s` lacks (outside the estimate's lock); whether it
    /// freed anything.
    fn make_room(&self, s: &Shortfall) -> bool {
        let Some(r) = self.reclaim.get().and_then(Weak::upgrade) else {
            return false;
        };
        let lacking = s.needed.saturating_add(s.reserve).saturating_sub(s.free);
        let freed = r.reclaim(lacking);
        if freed > 0 {
            self.reclaimed.fetch_add(freed, Ordering::Relaxed);
            tracing::info!(freed, lacking, path = %self.path.display(), "idle partial downloads removed to make room");
        }
        freed > 0
    }

    pub fn reserve(&self) -> Reserve {
        self.reserve
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Claims refused so far.
    pub fn refusals(&self) -> u64 {
        self.refusals.load(Ordering::Relaxed)
    }

    /// Measures taken so far.
    pub fn measures(&self) -> u64 {
        self.measures.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Estimate> {
        self.estimate.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Measures the filesystem (a statvfs: microseconds, under the budget's own lock, which only
    /// writers take).
    fn take_measure(&self, e: &mut Estimate) {
        self.measures.fetch_add(1, Ordering::Relaxed);
        match self.measure.measure() {
            Ok(m) => {
                e.measured = Some(m);
                e.settled = 0;
                e.since = 0;
                let room = e.free(m).saturating_sub(self.reserve.bytes_of(m.total));
                e.next = (room / 8).clamp(MEASURE_AT_LEAST_EVERY, MEASURE_EVERY);
            }
            Err(err) => {
                // Writes are not held back by a filesystem that cannot be measured: they fail
                // on their own if it is broken.
                tracing::warn!(path = %self.path.display(), error = %err, "cannot measure the image filesystem's free space");
                e.measured = None;
            }
        }
    }

    /// Claims `n` bytes about to be written; the writer settles them ([`SpaceBudget::settle`])
    /// once written (or given up). Refused if, as far as known, they would leave less free than
    /// the reserve (measured afresh first); the caller then writes nothing.
    pub fn claim(&self, n: u64) -> Result<(), Shortfall> {
        if self.reserve.is_off() {
            return Ok(());
        }
        self.or_make_room(|| self.try_claim(n))
    }

    fn try_claim(&self, n: u64) -> Result<(), Shortfall> {
        let mut e = self.lock();
        let crosses = |e: &Estimate| {
            e.measured
                .is_none_or(|m| e.free(m) < n.saturating_add(self.reserve.bytes_of(m.total)))
        };
        if e.measured.is_none() || e.since.saturating_add(n) >= e.next || crosses(&e) {
            self.take_measure(&mut e);
        }
        let Some(m) = e.measured else {
            return Ok(());
        };
        if crosses(&e) {
            return Err(self.shortfall(m, e.free(m), n));
        }
        e.outstanding += n;
        e.since += n;
        Ok(())
    }

    /// `n` claimed bytes are written (or will not be): from now on the next measure accounts
    /// for them.
    pub fn settle(&self, n: u64) {
        if self.reserve.is_off() {
            return;
        }
        let mut e = self.lock();
        let n = n.min(e.outstanding);
        e.outstanding -= n;
        e.settled += n;
    }

    /// Whether `n` more bytes fit above the reserve now (measured afresh): for a download about
    /// to start, whose missing bytes plainly cannot fit. Claims nothing.
    pub fn check_fits(&self, n: u64) -> Result<(), Shortfall> {
        if self.reserve.is_off() || n == 0 {
            return Ok(());
        }
        self.or_make_room(|| self.try_check_fits(n))
    }

    /// `attempt`, and if the reserve refuses it, once more after making room: one writer at a
    /// time, so that writers refused together do not each find the room another is freeing
    /// already taken (the retry comes first, with a fresh measure), nor free it twice.
    fn or_make_room(&self, attempt: impl Fn() -> Result<(), Shortfall>) -> Result<(), Shortfall> {
        let r = match attempt() {
            Err(_) if self.reclaim.get().is_some() => {
                let _one = self.reclaiming.lock().unwrap_or_else(|p| p.into_inner());
                match attempt() {
                    Err(s) if self.make_room(&s) => attempt(),
                    r => r,
                }
            }
            r => r,
        };
        r.inspect_err(|_| {
            self.refusals.fetch_add(1, Ordering::Relaxed);
        })
    }

    fn try_check_fits(&self, n: u64) -> Result<(), Shortfall> {
        let mut e = self.lock();
        self.take_measure(&mut e);
        match e.measured {
            Some(m) if e.free(m) < n.saturating_add(self.reserve.bytes_of(m.total)) => {
                Err(self.shortfall(m, e.free(m), n))
            }
            _ => Ok(()),
        }
    }

    fn shortfall(&self, m: FsSpace, free: u64, n: u64) -> Shortfall {
        Shortfall {
            path: self.path.clone(),
            free,
            needed: n,
            reserve: self.reserve.bytes_of(m.total),
            setting: match self.reserve {
                Reserve::Percent(p) => format!("{p}% of {}", human_bytes(m.total as f64)),
                Reserve::Bytes(_) => self.reserve.to_string(),
            },
        }
    }
}

/// What the snapshotter asks before it writes a layer's bytes.
impl minicri_snapshotter::SpaceCheck for SpaceBudget {
    fn claim(&self, bytes: u64) -> std::io::Result<()> {
        SpaceBudget::claim(self, bytes).map_err(Shortfall::into_io)
    }

    fn settle(&self, bytes: u64) {
        SpaceBudget::settle(self, bytes)
    }
}

/// Budgets for the content store's and the snapshotter's directories (which must exist): one
/// shared budget when they are on the same filesystem, so their writers' claims add up.
pub fn budgets(
    content: &Path,
    snapshots: &Path,
    reserve: Reserve,
) -> std::io::Result<(std::sync::Arc<SpaceBudget>, std::sync::Arc<SpaceBudget>)> {
    use std::os::unix::fs::MetadataExt;
    let c = std::sync::Arc::new(SpaceBudget::new(content, reserve));
    if std::fs::metadata(content)?.dev() == std::fs::metadata(snapshots)?.dev() {
        return Ok((c.clone(), c));
    }
    Ok((c, std::sync::Arc::new(SpaceBudget::new(snapshots, reserve))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    const MIB: u64 = 1 << 20;

    /// A filesystem whose free space the test sets.
    #[derive(Clone)]
    struct Fake(Arc<Mutex<FsSpace>>);

    impl Fake {
        fn new(available: u64, total: u64) -> Fake {
            Fake(Arc::new(Mutex::new(FsSpace { available, total })))
        }
        fn set_available(&self, a: u64) {
            self.0.lock().unwrap().available = a;
        }
        fn write(&self, n: u64) {
            let mut s = self.0.lock().unwrap();
            s.available = s.available.saturating_sub(n);
        }
    }

    impl Measure for Fake {
        fn measure(&self) -> std::io::Result<FsSpace> {
            Ok(*self.0.lock().unwrap())
        }
    }

    fn budget(fake: &Fake, reserve: Reserve) -> SpaceBudget {
        SpaceBudget::with_measure(
            Path::new("/var/lib/minicri"),
            reserve,
            Box::new(fake.clone()),
        )
    }

    /// A writer's write: claim, write, settle.
    fn put(b: &SpaceBudget, fake: &Fake, n: u64) -> Result<(), Shortfall> {
        b.claim(n)?;
        fake.write(n);
        b.settle(n);
        Ok(())
    }

    #[test]
    fn reserve_parses_percentages_and_sizes() {
        assert_eq!("15%".parse(), Ok(Reserve::Percent(15.0)));
        assert_eq!("2.5 %".parse(), Ok(Reserve::Percent(2.5)));
        assert_eq!("0".parse(), Ok(Reserve::Bytes(0)));
        assert_eq!("1048576".parse(), Ok(Reserve::Bytes(MIB)));
        assert_eq!("20GiB".parse(), Ok(Reserve::Bytes(20 << 30)));
        assert_eq!("512Mi".parse(), Ok(Reserve::Bytes(512 * MIB)));
        for bad in [
            "",
            "100%",
            "-1%",
            "x%",
            "10GB",
            "1.5GiB",
            "20000000TiB",
            "nan%",
        ] {
            assert!(bad.parse::<Reserve>().is_err(), "{bad:?} accepted");
        }
        assert_eq!(Reserve::Percent(15.0).bytes_of(1000), 150);
        assert_eq!(Reserve::Percent(15.0).bytes_of(1001), 151, "rounded up");
        assert_eq!(Reserve::Bytes(7).bytes_of(1000), 7);
        assert!(Reserve::Percent(0.0).is_off() && Reserve::Bytes(0).is_off());
        assert!(!DEFAULT_RESERVE.is_off());
        // The configuration file may give a string or a number of bytes.
        #[derive(serde::Deserialize)]
        struct T {
            r: Reserve,
        }
        let t: T = toml::from_str("r = \"15%\"").unwrap();
        assert_eq!(t.r, Reserve::Percent(15.0));
        let t: T = toml::from_str("r = 4096").unwrap();
        assert_eq!(t.r, Reserve::Bytes(4096));
        assert!(toml::from_str::<T>("r = \"lots\"").is_err());
    }

    /// Claims are refused exactly where the reserve would be crossed: `available - reserve`
    /// bytes may go, not one more; a refused claim takes nothing, so a smaller one still fits.
    #[test]
    fn a_claim_that_would_cross_the_reserve_is_refused_and_nothing_is_taken() {
        let fake = Fake::new(100 * MIB, 1000 * MIB);
        let b = budget(&fake, Reserve::Percent(5.0)); // 50 MiB
        put(&b, &fake, 30 * MIB).unwrap();
        let err = put(&b, &fake, 20 * MIB + 1).unwrap_err();
        assert_eq!(
            (err.free, err.needed, err.reserve),
            (70 * MIB, 20 * MIB + 1, 50 * MIB)
        );
        let text = err.to_string();
        for part in [
            "70.0 MiB free",
            "reserve of 50.0 MiB",
            "pull.image_fs_reserve = 5% of",
            "/var/lib/minicri",
        ] {
            assert!(text.contains(part), "{part:?} not in {text:?}");
        }
        put(&b, &fake, 20 * MIB).unwrap();
        assert_eq!(b.refusals(), 1);
        assert!(put(&b, &fake, 1).is_err(), "the room is used up");
        // Space freed elsewhere is seen at the next claim (a refusal always measures afresh).
        fake.set_available(80 * MIB);
        put(&b, &fake, MIB).unwrap();
    }

    /// Frees up to what it holds when asked, as the collector of idle partial data does.
    struct Idle {
        fake: Fake,
        held: Mutex<u64>,
        asked: std::sync::atomic::AtomicUsize,
    }

    impl Reclaim for Idle {
        fn reclaim(&self, bytes: u64) -> u64 {
            self.asked.fetch_add(1, Ordering::Relaxed);
            let mut held = self.held.lock().unwrap();
            let freed = (*held).min(bytes.max(1)).min(*held);
            *held -= freed;
            let mut s = self.fake.0.lock().unwrap();
            s.available += freed;
            freed
        }
    }

    /// Before a refusal, the reclaimer frees what is lacking and the claim goes through; a claim
    /// that finds room asks nothing; with nothing left to free, the claim is refused.
    #[test]
    fn room_is_made_before_a_refusal() {
        let fake = Fake::new(100 * MIB, 1000 * MIB);
        let b = Arc::new(budget(&fake, Reserve::Percent(5.0))); // 50 MiB reserved
        let idle = Arc::new(Idle {
            fake: fake.clone(),
            held: Mutex::new(40 * MIB),
            asked: Default::default(),
        });
        let r: Arc<dyn Reclaim> = idle.clone();
        b.reclaim_with(Arc::downgrade(&r));
        put(&b, &fake, 40 * MIB).unwrap();
        // 10 MiB of room; 30 wanted: 20 lacking, freed from the 40 idle.
        put(&b, &fake, 30 * MIB).unwrap();
        assert_eq!(b.reclaimed(), 20 * MIB);
        assert_eq!(b.refusals(), 0);
        // 20 idle left: a 10 MiB claim has 10 freed, then another finds room freed elsewhere
        // and asks nothing.
        put(&b, &fake, 10 * MIB).unwrap();
        assert_eq!(*idle.held.lock().unwrap(), 10 * MIB);
        let asked = idle.asked.load(Ordering::Relaxed);
        fake.write(0);
        fake.0.lock().unwrap().available += 5 * MIB;
        put(&b, &fake, 5 * MIB).unwrap();
        assert_eq!(idle.asked.load(Ordering::Relaxed), asked);
        put(&b, &fake, 10 * MIB).unwrap();
        assert_eq!(*idle.held.lock().unwrap(), 0);
        // Nothing left to free: refused, having asked.
        let asked = idle.asked.load(Ordering::Relaxed);
        assert!(put(&b, &fake, MIB).is_err());
        assert_eq!(idle.asked.load(Ordering::Relaxed), asked + 1);
        assert_eq!(b.refusals(), 1);
    }

    /// The periodic measure: no syscall per claim while far from the reserve (one per
    /// MEASURE_EVERY bytes), more often near it, and each time a claim would cross it.
    #[test]
    fn measures_come_every_few_mib_and_closer_near_the_reserve() {
        let fake = Fake::new(10_000 * MIB, 10_000 * MIB);
        let b = budget(&fake, Reserve::Bytes(100 * MIB));
        for _ in 0..1024 {
            put(&b, &fake, 64 << 10).unwrap(); // 64 MiB in 64 KiB writes
        }
        let far = b.measures();
        assert!((16..=17).contains(&far), "{far} measures for 64 MiB");
        // 1 MiB above the reserve: a measure every 128 KiB (an eighth of the room).
        fake.set_available(101 * MIB);
        assert!(b.claim(MEASURE_EVERY).is_err());
        let before = b.measures();
        for _ in 0..8 {
            put(&b, &fake, 16 << 10).unwrap();
        }
        assert_eq!(b.measures() - before, 1, "128 KiB claimed: one measure");
        // Bytes written by someone else (a container's logs) are seen at the next measure, due
        // after at most an eighth of the room: claims may pass the reserve by no more.
        fake.write(MIB - (128 << 10) - 1000);
        while put(&b, &fake, 1000).is_ok() {}
        let under = (100 * MIB).saturating_sub(fake.measure().unwrap().available);
        assert!(under <= 128 << 10, "{under} bytes under the reserve");
    }

    /// Claims not yet written count against the reserve whatever a measure taken meanwhile
    /// says: writers claiming at once cannot all pass on the same figure.
    #[test]
    fn outstanding_claims_of_all_writers_add_up() {
        let fake = Fake::new(60 * MIB, 1000 * MIB);
        let b = budget(&fake, Reserve::Bytes(50 * MIB));
        // 10 MiB of room; four writers claim 256 KiB pieces at once and write nothing yet
        // (measures come every 1.25 MiB and see the filesystem unchanged).
        let granted = AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..20 {
                        if b.claim(256 << 10).is_ok() {
                            granted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert_eq!(granted.load(Ordering::Relaxed), 40);
        assert!(b.measures() > 5, "{} measures", b.measures());
        // Written and settled: counted until a measure shows them, then by the measure.
        fake.write(10 * MIB);
        b.settle(10 * MIB);
        assert!(b.claim(1).is_err());
        // Given up instead of written: the next measure gives the room back.
        let fake = Fake::new(60 * MIB, 1000 * MIB);
        let b = budget(&fake, Reserve::Bytes(50 * MIB));
        b.claim(10 * MIB).unwrap();
        assert!(b.claim(1).is_err());
        b.settle(10 * MIB);
        b.check_fits(10 * MIB).unwrap();
        b.claim(10 * MIB).unwrap();
    }

    #[test]
    fn check_fits_measures_afresh_and_claims_nothing() {
        let fake = Fake::new(100 * MIB, 200 * MIB);
        let b = budget(&fake, Reserve::Percent(10.0)); // 20 MiB
        b.check_fits(80 * MIB).unwrap();
        let err = b.check_fits(80 * MIB + 1).unwrap_err();
        assert_eq!((err.free, err.reserve), (100 * MIB, 20 * MIB));
        b.claim(80 * MIB).unwrap();
        // Off: nothing is measured or refused.
        let off = budget(&fake, Reserve::Bytes(0));
        off.claim(u64::MAX / 2).unwrap();
        off.check_fits(u64::MAX).unwrap();
        assert_eq!(off.measures(), 0);
    }

    #[test]
    fn a_shortfall_is_found_inside_io_errors() {
        let fake = Fake::new(MIB, 100 * MIB);
        let b = budget(&fake, Reserve::Percent(1.0));
        let io = minicri_snapshotter::SpaceCheck::claim(&b, 2 * MIB).unwrap_err();
        assert_eq!(io.kind(), std::io::ErrorKind::StorageFull);
        let wrapped = minicri_snapshotter::Error::LayerStream { source: io };
        assert_eq!(Shortfall::find(&wrapped).unwrap().needed, 2 * MIB);
        let other = std::io::Error::other("nope");
        assert!(Shortfall::find(&other).is_none());
    }

    /// The budgets of two directories on one filesystem are one: their claims add up.
    #[test]
    fn directories_on_one_filesystem_share_a_budget() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("content"), dir.path().join("snapshots"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        let (ca, cb) = budgets(&a, &b, DEFAULT_RESERVE).unwrap();
        assert!(Arc::ptr_eq(&ca, &cb));
        let (ca, cb) = budgets(&a, Path::new("/proc"), DEFAULT_RESERVE).unwrap();
        assert!(!Arc::ptr_eq(&ca, &cb));
    }
}

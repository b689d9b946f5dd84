//! Scenarios of the simulation, each drawn from one seed: transfer slots and how blobs are split
//! between connections, registries (fast, slow, trickling, stalled; answering ranged requests or
//! not; cutting connections; serving wrong bytes), blobs, images made of them (some naming a blob
//! with a wrong size), and pods that arrive, pull an image with a weight, and may be deleted
//! mid-pull.
//!
//! Sizes and rates are a node's divided by [`SCALE`]: the engine's decisions depend on times and
//! on bytes relative to rates, and the blobs' bytes are real (written, hashed and committed by the
//! content store), so smaller blobs keep thousands of scenarios within seconds.
//!
//! It also derives the bound of invariant (4): how long after the last arrival every download
//! may still run ([`Scenario::end_bound`]).

use std::fmt::Write;
use std::time::Duration;

use super::rng::Rng;
use crate::sched::{EXTRA_TENURE, MAX_STRIKES, NORMAL_WEIGHT};

/// A node's sizes and rates are divided by this.
pub(super) const SCALE: u64 = 4096;
/// A pull whose transfers run this long without a byte is stopped by the pull watchdog (its
/// `pull.progress_timeout`, 60 s by default, set shorter here to keep scenarios short).
pub(super) const PROGRESS_TIMEOUT: Duration = Duration::from_secs(30);
/// A failed request is asked again after at most this back-off (blobs.rs: 200 ms, doubling up
/// to 5 s, back to 200 ms once bytes arrive); [`BLOB_RETRIES`] in a row without a byte fail the
/// download.
const MAX_BACKOFF: Duration = Duration::from_secs(5);
const BLOB_RETRIES: u32 = 5;
/// Bytes arrive in chunks at most this far apart (a slower registry's chunk is 16 KiB on a
/// node). The scheduler measures rates over [`RATE_AFTER`](crate::sched::RATE_AFTER) (2 s): a
/// chunk is at most an eighth of that.
pub(super) const CHUNK_EVERY: Duration = Duration::from_millis(250);
const CHUNK_BYTES: u64 = 16 * 1024 / SCALE;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Speed {
    Fast,
    Slow,
    /// 30 kB/s per connection.
    Trickle,
    /// Answers, then sends nothing.
    Stalled,
}

#[derive(Debug, Clone)]
pub(super) struct RegistrySpec {
    pub speed: Speed,
    /// Bytes per second per connection.
    pub rate: u64,
    /// Whether it answers ranged requests with the range (else with the whole blob).
    pub resumable: bool,
    /// Cuts every response after about this long of body (between 0.75 and 1.25 times it, drawn
    /// per response: how far a body gets differs from one to the next).
    pub cut_every: Option<Duration>,
    /// From the request to the first byte.
    pub latency: Duration,
    /// Serves every blob with one byte wrong (its digest fails).
    pub corrupt: bool,
}

impl RegistrySpec {
    /// Time between two chunks of one connection.
    pub fn chunk_every(&self) -> Duration {
        if self.rate == 0 {
            // Nothing comes: the connection only waits for its revocation or the watchdog.
            return PROGRESS_TIMEOUT;
        }
        Duration::from_secs_f64(CHUNK_BYTES as f64 / self.rate as f64)
            .clamp(CHUNK_EVERY, Duration::from_secs(1))
    }
}

#[derive(Debug, Clone)]
pub(super) struct BlobSpec {
    pub registry: usize,
    pub size: u64,
}

/// A blob as an image's manifest names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct BlobRef {
    pub blob: usize,
    /// The size the descriptor gives: the blob's, or a wrong one.
    pub size: u64,
}

#[derive(Debug, Clone)]
pub(super) struct PodSpec {
    pub arrives: Duration,
    /// Deleted at this time (from the start), pulling or not.
    pub leaves: Option<Duration>,
    pub weight: u32,
    pub image: usize,
}

#[derive(Debug, Clone)]
pub(super) struct Scenario {
    pub seed: u64,
    pub slots: usize,
    /// Requests one blob may have open at once (`RangedFetch::connections`).
    pub connections: usize,
    /// Bytes asked for by one ranged request (`RangedFetch::chunk_size`).
    pub chunk_size: u64,
    pub registries: Vec<RegistrySpec>,
    pub blobs: Vec<BlobSpec>,
    /// Each image's blobs.
    pub images: Vec<Vec<BlobRef>>,
    /// In arrival order.
    pub pods: Vec<PodSpec>,
    /// The image filesystem's size, when it is small enough to matter (the reserve is its 15%,
    /// `pull.image_fs_reserve`'s default); else the disk is as large as the tmpfs.
    pub disk: Option<u64>,
    /// When the daemon restarts, if it does.
    pub restart: Option<Duration>,
}

impl Scenario {
    pub fn generate(seed: u64) -> Scenario {
        let mut rng = Rng::new(seed);
        // How pods arrive: together, over half a minute, or as a stream of newcomers wanting
        // images of their own (what takes slots from downloads that cannot resume again and
        // again). Per shape: the arrivals' spread in ms, pods, blobs, images.
        let (spread, pods, blobs, images) = match rng.weighted(&[3, 5, 2]) {
            0 => (rng.range(0, 5_000), (2, 16), (1, 10), (1, 5)),
            1 => (rng.range(0, 30_000), (2, 16), (1, 10), (1, 5)),
            _ => (rng.range(60_000, 120_000), (10, 24), (10, 30), (6, 16)),
        };
        // Few slots more often than many: contention is what the invariants are about.
        let slots = 1 + rng.weighted(&[6, 6, 5, 4, 3, 2, 2, 2]);
        let connections = rng.range(1, 3) as usize;
        let chunk_size = [8 << 20, 32 << 20, 64 << 20][rng.weighted(&[1, 2, 1])] / SCALE;
        let registries: Vec<RegistrySpec> =
            (0..rng.range(1, 4)).map(|_| registry(&mut rng)).collect();
        let blobs: Vec<BlobSpec> = (0..rng.range(blobs.0, blobs.1))
            .map(|_| blob(&mut rng, &registries))
            .collect();
        let images = (0..rng.range(images.0, images.1))
            .map(|_| {
                let want = rng.range(1, 4.min(blobs.len() as u64)) as usize;
                let mut image: Vec<BlobRef> = Vec::new();
                while image.len() < want {
                    let b = rng.range(0, blobs.len() as u64 - 1) as usize;
                    if image.iter().all(|r| r.blob != b) {
                        let real = blobs[b].size;
                        // One descriptor in twenty lies about the size, either way.
                        let size = if rng.chance(0.05) {
                            let by = rng.range(1, real.div_ceil(2));
                            if rng.chance(0.5) {
                                real + by
                            } else {
                                real - by.min(real - 1)
                            }
                        } else {
                            real
                        };
                        image.push(BlobRef { blob: b, size });
                    }
                }
                image
            })
            .collect::<Vec<_>>();
        let mut pods: Vec<PodSpec> = (0..rng.range(pods.0, pods.1))
            .map(|_| {
                let arrives = Duration::from_millis(rng.range(0, spread));
                let leaves = rng
                    .chance(0.3)
                    .then(|| arrives + Duration::from_secs_f64(rng.log_uniform(0.1, 90.0)));
                let weight = [NORMAL_WEIGHT / 2, NORMAL_WEIGHT, NORMAL_WEIGHT * 2]
                    [rng.weighted(&[20, 60, 20])];
                PodSpec {
                    arrives,
                    leaves,
                    weight,
                    image: rng.range(0, images.len() as u64 - 1) as usize,
                }
            })
            .collect();
        pods.sort_by_key(|p| p.arrives);
        // A third of the scenarios on a disk from half to two and a half times what their
        // blobs take above the reserve.
        let disk = rng.chance(0.3).then(|| {
            let blobs: u64 = blobs.iter().map(|b| b.size).sum();
            (blobs as f64 * rng.log_uniform(0.5, 2.5) / 0.85) as u64
        });
        // A fifth restart the daemon once, while pods arrive or up to 20 s after the last.
        let last = pods.last().map_or(0, |p| p.arrives.as_millis() as u64);
        let restart = rng
            .chance(0.2)
            .then(|| Duration::from_millis(rng.range(500, last + 20_000)));
        Scenario {
            seed,
            slots,
            connections,
            chunk_size,
            registries,
            blobs,
            images,
            pods,
            disk,
            restart,
        }
    }

    /// When the last pod arrived, or the daemon came back from its restart if that is later
    /// (the pods that were pulling pull again then).
    pub fn last_arrival(&self) -> Duration {
        let last = self.pods.last().map_or(Duration::ZERO, |p| p.arrives);
        self.restart
            .map_or(last, |r| last.max(r + crate::sched::TICK))
    }

    /// Invariant (4)'s bound: once the last pod arrived, every download ends within the sum over
    /// the blobs of [`Scenario::slot_time`], plus two seconds.
    ///
    /// Why: while a download runs, it holds a slot or waits, and while anyone waits every slot
    /// is held (invariant 1), so at every moment some unfinished download holds a slot. The time
    /// until the last one ends is then at most the slot time all of them can use in total.
    pub fn end_bound(&self) -> Duration {
        let sum: Duration = self.downloads().map(|r| self.slot_time(r)).sum();
        sum + Duration::from_secs(2)
    }

    /// Every (blob, size) the images name: each is a download of its own.
    fn downloads(&self) -> impl Iterator<Item = BlobRef> + '_ {
        let mut seen: Vec<BlobRef> = Vec::new();
        self.images
            .iter()
            .flatten()
            .filter(move |r| {
                let new = !seen.contains(*r);
                if new {
                    seen.push(**r);
                }
                new
            })
            .copied()
    }

    /// The most slot time one download of `r` can hold before it ends:
    ///
    /// - stalled (its registry sends nothing): its pulls' watchdogs stop them after
    ///   [`PROGRESS_TIMEOUT`] of transfer time without a byte, time that starts again whenever
    ///   another blob of the same pull brings bytes: at most the timeout plus the slot time of
    ///   those other blobs, for each of its `k` connections;
    /// - cannot resume: at most [`MAX_STRIKES`] attempts (the last revocation gives up), each at
    ///   most latency + size / rate; if its registry cuts bodies, each of those is up to
    ///   [`BLOB_RETRIES`] + 1 answers, each cut (a body that starts again from byte 0 is no
    ///   progress, however far it gets) and followed by a back-off;
    /// - resumable: its bytes take `P` = size / rate of slot time and cuts add `C` (back-off and
    ///   latency per cut, one cut per `cut_every` of body). Every other moment of a grant is
    ///   waste: a latency per request, one per piece of `chunk_size` and one more per grant (a
    ///   revoked grant lasted at least [`EXTRA_TENURE`], so at most a fraction `w` = latency /
    ///   tenure of what it held): `(P + C) / (1 - w) + pieces latency`;
    /// - a descriptor with a wrong size, or a registry serving wrong bytes: as many attempts as
    ///   the download makes before it fails ([`BLOB_RETRIES`] + 1 requests, each after a back-off
    ///   of at most [`MAX_BACKOFF`]; wrong bytes after a resume are fetched once more from byte
    ///   0).
    pub fn slot_time(&self, r: BlobRef) -> Duration {
        let blob = &self.blobs[r.blob];
        let reg = &self.registries[blob.registry];
        let k = if reg.resumable { self.connections } else { 1 } as f64;
        let l = reg.latency.as_secs_f64();
        let size = r.size.max(blob.size) as f64;
        let secs = if reg.rate == 0 {
            let others: f64 = self
                .images
                .iter()
                .filter(|im| im.contains(&r))
                .flatten()
                .filter(|o| *o != &r && self.registries[self.blobs[o.blob].registry].rate > 0)
                .map(|o| self.slot_time(*o).as_secs_f64())
                .sum();
            k * (PROGRESS_TIMEOUT.as_secs_f64() + others)
        } else if !reg.resumable {
            let whole = size / reg.rate as f64;
            match reg.cut_every {
                None => MAX_STRIKES as f64 * (l + whole),
                // Each answer starts from byte 0: a cut one is a failure however far it got.
                Some(every) => {
                    let attempt =
                        l + whole.min(1.25 * every.as_secs_f64()) + MAX_BACKOFF.as_secs_f64();
                    MAX_STRIKES as f64 * f64::from(BLOB_RETRIES + 1) * attempt
                }
            }
        } else {
            let p = size / reg.rate as f64;
            let c = reg.cut_every.map_or(0.0, |every| {
                (p / (0.75 * every.as_secs_f64()) + k) * (MAX_BACKOFF.as_secs_f64() + l)
            });
            let waste = l / EXTRA_TENURE.as_secs_f64();
            let pieces = (size / self.chunk_size.max(1) as f64).ceil() + k;
            (p + c) / (1.0 - waste) + pieces * l
        };
        let attempts = if r.size != blob.size || reg.corrupt {
            2.0 * f64::from(BLOB_RETRIES + 1)
        } else {
            1.0
        };
        let retries = if attempts > 1.0 {
            f64::from(BLOB_RETRIES + 1) * (MAX_BACKOFF.as_secs_f64() + l)
        } else {
            0.0
        };
        Duration::from_secs_f64(secs * attempts + retries)
    }

    /// What a failure report shows: enough to read the scenario without replaying it.
    pub fn describe(&self) -> String {
        let mut s = format!(
            "seed {:#x}: {} transfer slots, {} connections per blob, ranged requests of {} bytes\n",
            self.seed, self.slots, self.connections, self.chunk_size
        );
        if let Some(d) = self.disk {
            let _ = writeln!(s, "  a disk of {d} bytes, 15% of it reserved");
        }
        if let Some(r) = self.restart {
            let _ = writeln!(s, "  the daemon restarts at {r:?}");
        }
        for (i, r) in self.registries.iter().enumerate() {
            let _ = writeln!(
                s,
                "  registry {i}: {:?} {} B/s, {}{}, latency {:?}{}",
                r.speed,
                r.rate,
                if r.resumable {
                    "ranged"
                } else {
                    "whole blobs only"
                },
                r.cut_every
                    .map(|c| format!(", cuts every {c:?}"))
                    .unwrap_or_default(),
                r.latency,
                if r.corrupt {
                    ", serves wrong bytes"
                } else {
                    ""
                }
            );
        }
        for (i, b) in self.blobs.iter().enumerate() {
            let _ = writeln!(
                s,
                "  blob {i}: {} bytes from registry {}",
                b.size, b.registry
            );
        }
        for (i, im) in self.images.iter().enumerate() {
            let named: Vec<String> = im
                .iter()
                .map(|r| {
                    if r.size == self.blobs[r.blob].size {
                        format!("{}", r.blob)
                    } else {
                        format!("{} (named with {} bytes)", r.blob, r.size)
                    }
                })
                .collect();
            let _ = writeln!(s, "  image {i}: blobs {}", named.join(", "));
        }
        for (i, p) in self.pods.iter().enumerate() {
            let _ = writeln!(
                s,
                "  pod-{i}: image {} weight {} arrives {:?}{}",
                p.image,
                p.weight,
                p.arrives,
                p.leaves
                    .map(|l| format!(", deleted at {l:?}"))
                    .unwrap_or_default()
            );
        }
        s
    }
}

fn registry(rng: &mut Rng) -> RegistrySpec {
    let speed =
        [Speed::Fast, Speed::Slow, Speed::Trickle, Speed::Stalled][rng.weighted(&[35, 25, 30, 10])];
    let rate = match speed {
        Speed::Fast => rng.log_uniform(4e6, 40e6) as u64,
        Speed::Slow => rng.log_uniform(200e3, 2e6) as u64,
        Speed::Trickle => 30_000,
        Speed::Stalled => 0,
    } / SCALE;
    let resumable = rng.chance(0.6);
    // One that also ignores Range never delivers a blob longer than its cuts (each answer
    // starts again from byte 0): the download must give up rather than try for ever.
    let cut_every =
        (rate > 0 && rng.chance(0.25)).then(|| Duration::from_millis(rng.range(1000, 8000)));
    RegistrySpec {
        speed,
        rate,
        resumable,
        cut_every,
        latency: Duration::from_millis(rng.range(10, 60)),
        corrupt: rng.chance(0.04),
    }
}

fn blob(rng: &mut Rng, registries: &[RegistrySpec]) -> BlobSpec {
    let registry = rng.range(0, registries.len() as u64 - 1) as usize;
    let reg = &registries[registry];
    // Sized by how long it takes alone on one connection.
    let secs = match reg.speed {
        Speed::Fast | Speed::Slow => rng.log_uniform(0.3, 30.0),
        Speed::Trickle => rng.log_uniform(3.0, 45.0),
        Speed::Stalled => 1.0,
    };
    let size = if reg.rate == 0 {
        rng.range(1 << 20, 20 << 20) / SCALE
    } else {
        (reg.rate as f64 * secs) as u64 + 1
    };
    BlobSpec { registry, size }
}

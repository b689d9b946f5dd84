//! Scenarios of the simulation, each drawn from one seed: transfer slots, registries (fast, slow,
//! trickling, stalled; answering ranged requests or not; cutting connections), blobs, images made
//! of them, and pods that arrive, pull an image with a weight, and may be deleted mid-pull.
//!
//! It also derives the bound of invariant (4): how long after the last arrival every download
//! may still run ([`Scenario::end_bound`]).

use std::fmt::Write;
use std::time::Duration;

use super::rng::Rng;
use crate::sched::{EXTRA_TENURE, MAX_STRIKES, NORMAL_WEIGHT};

/// A connection whose registry sends nothing for this long in total is a stall: the blob fails
/// (the pull watchdog's `pull.progress_timeout`, 60 s by default, set shorter here to keep
/// scenarios short; see [`super::world`] for how it is modelled).
pub(super) const PROGRESS_TIMEOUT: Duration = Duration::from_secs(30);
/// A body cut short is asked for again after this back-off, the slot kept (blobs.rs's first
/// back-off).
pub(super) const CUT_BACKOFF: Duration = Duration::from_millis(200);
/// Bytes arrive in chunks at most this far apart (a slower registry's chunk is 16 KiB). The
/// scheduler measures rates over [`RATE_AFTER`](crate::sched::RATE_AFTER) (2 s): a chunk is at
/// most an eighth of that.
pub(super) const CHUNK_EVERY: Duration = Duration::from_millis(250);
const CHUNK_BYTES: u64 = 16 * 1024;

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
    /// Cuts every response after this long of body.
    pub cut_every: Option<Duration>,
    /// From the request to the first byte.
    pub latency: Duration,
    /// How long a revoked request takes to stop (the chunk in hand is written first).
    pub stop_delay: Duration,
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
    /// Connections it uses when its registry answers ranged requests.
    pub connections: usize,
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
    pub registries: Vec<RegistrySpec>,
    pub blobs: Vec<BlobSpec>,
    /// Each image's blobs.
    pub images: Vec<Vec<usize>>,
    /// In arrival order.
    pub pods: Vec<PodSpec>,
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
        let registries: Vec<RegistrySpec> =
            (0..rng.range(1, 4)).map(|_| registry(&mut rng)).collect();
        let blobs: Vec<BlobSpec> = (0..rng.range(blobs.0, blobs.1))
            .map(|_| blob(&mut rng, &registries))
            .collect();
        let images = (0..rng.range(images.0, images.1))
            .map(|_| {
                let want = rng.range(1, 4.min(blobs.len() as u64)) as usize;
                let mut image: Vec<usize> = Vec::new();
                while image.len() < want {
                    let b = rng.range(0, blobs.len() as u64 - 1) as usize;
                    if !image.contains(&b) {
                        image.push(b);
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
        Scenario {
            seed,
            slots,
            registries,
            blobs,
            images,
            pods,
        }
    }

    pub fn last_arrival(&self) -> Duration {
        self.pods.last().map_or(Duration::ZERO, |p| p.arrives)
    }

    /// Invariant (4)'s bound: once the last pod arrived, every download ends within the sum over
    /// the blobs of [`Scenario::slot_time`], plus two seconds.
    ///
    /// Why: while a download runs, it holds a slot or waits, and while anyone waits every slot
    /// is held (invariant 1), so at every moment some unfinished download holds a slot. The time
    /// until the last one ends is then at most the slot time all of them can use in total.
    pub fn end_bound(&self) -> Duration {
        let sum: Duration = (0..self.blobs.len()).map(|b| self.slot_time(b)).sum();
        sum + Duration::from_secs(2)
    }

    /// The most slot time one download of blob `b` can hold before it ends:
    ///
    /// - stalled: each of its `k` connections holds slots at most [`PROGRESS_TIMEOUT`] without
    ///   a byte (plus a stop delay per grant, each grant lasting at least [`EXTRA_TENURE`]);
    /// - cannot resume: at most [`MAX_STRIKES`] attempts (the last revocation gives up), each at
    ///   most latency + size / rate + stop delay;
    /// - resumable: its bytes take `P` = size / rate of slot time and cuts add `C` (back-off and
    ///   latency per cut, one cut per `cut_every` of body). Every other moment of a grant is
    ///   waste: latency and the stop delay, plus one more latency when a worker moves to a piece
    ///   another gave back; a revoked grant lasted at least [`EXTRA_TENURE`], so the waste is at
    ///   most a fraction `w` = (2 latency + stop delay) / tenure of what it held, and the `k`
    ///   grants that end with a finished piece waste a latency each: `(P + C) / (1 - w) + k
    ///   latency`.
    pub fn slot_time(&self, b: usize) -> Duration {
        let blob = &self.blobs[b];
        let reg = &self.registries[blob.registry];
        let k = if reg.resumable { blob.connections } else { 1 } as f64;
        let (l, d) = (reg.latency.as_secs_f64(), reg.stop_delay.as_secs_f64());
        let tenure = EXTRA_TENURE.as_secs_f64();
        let secs = if reg.rate == 0 {
            k * PROGRESS_TIMEOUT.as_secs_f64() / (1.0 - d / tenure)
        } else if !reg.resumable {
            MAX_STRIKES as f64 * (l + blob.size as f64 / reg.rate as f64 + d)
        } else {
            let p = blob.size as f64 / reg.rate as f64;
            let c = reg.cut_every.map_or(0.0, |every| {
                (p / every.as_secs_f64() + k) * (CUT_BACKOFF.as_secs_f64() + l)
            });
            let waste = (2.0 * l + d) / tenure;
            (p + c) / (1.0 - waste) + k * l
        };
        Duration::from_secs_f64(secs)
    }

    /// What a failure report shows: enough to read the scenario without replaying it.
    pub fn describe(&self) -> String {
        let mut s = format!("seed {:#x}: {} transfer slots\n", self.seed, self.slots);
        for (i, r) in self.registries.iter().enumerate() {
            let _ = writeln!(
                s,
                "  registry {i}: {:?} {} B/s, {}{}, latency {:?}, stop delay {:?}",
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
                r.stop_delay
            );
        }
        for (i, b) in self.blobs.iter().enumerate() {
            let _ = writeln!(
                s,
                "  blob {i}: {} bytes from registry {}, {} connections",
                b.size, b.registry, b.connections
            );
        }
        for (i, im) in self.images.iter().enumerate() {
            let _ = writeln!(s, "  image {i}: blobs {im:?}");
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
    };
    let resumable = rng.chance(0.6);
    // A registry that cuts connections and ignores Range never delivers a blob longer than its
    // cut (each answer starts again from byte 0): left out, see the module docs of `super`.
    let cut_every = (resumable && rate > 0 && rng.chance(0.25))
        .then(|| Duration::from_millis(rng.range(1000, 8000)));
    RegistrySpec {
        speed,
        rate,
        resumable,
        cut_every,
        latency: Duration::from_millis(rng.range(10, 60)),
        stop_delay: Duration::from_millis(rng.range(0, 30)),
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
        rng.range(1 << 20, 20 << 20)
    } else {
        (reg.rate as f64 * secs) as u64 + 1
    };
    BlobSpec {
        registry,
        size,
        connections: rng.range(1, 3) as usize,
    }
}

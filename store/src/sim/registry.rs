//! The simulation's registries: each is a [`BlobSource`], the seam through which the daemon's
//! downloads (`blobs.rs`, run unchanged) get a blob's bytes. A registry answers after its
//! latency, sends the blob's real bytes in chunks at its rate in simulated time, answers a ranged
//! request with the range or (one that ignores ranges) with the whole blob, cuts bodies short,
//! sends nothing at all (stalled), or serves one byte wrong.

use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use tokio::time::Instant;

use super::rng::Rng;
use super::scenario::RegistrySpec;
use crate::blobs::BlobSource;
use crate::digest::Digest;
use crate::error::{Result, StoreError};
use crate::registry::BlobBody;

/// The bytes of blob `b` of `size` bytes in the scenario of `seed`: a random block repeated,
/// each copy numbered (no two blocks alike).
pub(super) fn blob_bytes(seed: u64, b: usize, size: u64) -> Bytes {
    const BLOCK: usize = 4096;
    let mut rng = Rng::new(seed ^ (b as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let block: Vec<u8> = (0..BLOCK).map(|_| rng.next_u64() as u8).collect();
    let mut out = Vec::with_capacity(size as usize);
    let mut n = 0u64;
    while (out.len() as u64) < size {
        let take = BLOCK.min((size - out.len() as u64) as usize);
        out.extend_from_slice(&block[..take]);
        let at = out.len() - take;
        let tag = n.to_le_bytes();
        let t = tag.len().min(take);
        out[at..at + t].copy_from_slice(&tag[..t]);
        n += 1;
    }
    Bytes::from(out)
}

/// What a registry tells the world it is part of: what it answers, and the bytes it sends of
/// each blob (the world is [`super::world::Sim`], which owns the registries).
pub(super) trait Witness: Send + Sync {
    /// An event of the trace.
    fn note(&self, what: String);
    /// `n` more bytes of blob `b` were sent.
    fn served(&self, b: usize, n: u64);
}

/// One simulated registry.
pub(super) struct SimRegistry {
    pub index: usize,
    pub spec: RegistrySpec,
    /// The blobs it serves: digest, bytes, and the blob's number in the scenario.
    pub blobs: Vec<(Digest, Bytes, usize)>,
    pub sim: Weak<dyn Witness>,
    /// Draws where each body is cut.
    pub cuts: std::sync::Mutex<Rng>,
}

impl SimRegistry {
    fn endpoint(&self) -> String {
        format!("http://registry-{}.sim", self.index)
    }
}

impl BlobSource for SimRegistry {
    fn reference(&self) -> String {
        format!("registry-{}.sim/image:latest", self.index)
    }

    fn source_key(&self) -> [u8; 32] {
        [self.index as u8; 32]
    }

    fn blob<'a>(
        &'a self,
        digest: &'a Digest,
        offset: u64,
        length: u64,
        _last_resort: Option<&'a str>,
    ) -> BoxFuture<'a, Result<BlobBody>> {
        Box::pin(async move {
            tokio::time::sleep(self.spec.latency).await;
            let Some((_, data, b)) = self.blobs.iter().find(|(d, _, _)| d == digest) else {
                return Err(StoreError::Unavailable {
                    reference: self.reference(),
                    reason: format!("{}: 404 for {digest}", self.endpoint()),
                });
            };
            let total = data.len() as u64;
            let resumed = self.spec.resumable;
            if let Some(sim) = self.sim.upgrade() {
                let asked = if resumed { offset } else { 0 };
                sim.note(format!(
                    "registry {} answers for blob {b} from byte {asked}",
                    self.index
                ));
            }
            let (from, to) = if resumed {
                if offset >= total {
                    return Err(StoreError::Unavailable {
                        reference: self.reference(),
                        reason: format!(
                            "{}: 416 range {offset}- not satisfiable for {digest} of {total} bytes",
                            self.endpoint()
                        ),
                    });
                }
                (offset, offset.saturating_add(length).min(total))
            } else {
                (0, total)
            };
            let mut data = data.slice(from as usize..to as usize);
            if self.spec.corrupt {
                // The blob's middle byte, wherever this body covers it.
                let mid = total / 2;
                if (from..to).contains(&mid) {
                    let mut v = data.to_vec();
                    v[(mid - from) as usize] ^= 0xff;
                    data = Bytes::from(v);
                }
            }
            let cut = self
                .spec
                .cut_every
                .map(|c| c.mul_f64(0.75 + 0.5 * self.cuts.lock().unwrap().unit()));
            let counted = self.sim.clone();
            let b = *b;
            let stream = body(data, self.spec.rate, self.spec.chunk_every(), cut);
            let stream = futures::StreamExt::inspect(stream, move |chunk| {
                if let (Ok(c), Some(sim)) = (chunk, counted.upgrade()) {
                    sim.served(b, c.len() as u64);
                }
            });
            Ok(BlobBody {
                resumed,
                stream: Box::pin(stream),
                endpoint: self.endpoint(),
            })
        })
    }
}

/// A body sending `data` at `rate` in chunks `every` apart, cut short after `cut` if given; one
/// that sends nothing never ends.
fn body(
    data: Bytes,
    rate: u64,
    every: Duration,
    cut: Option<Duration>,
) -> futures::stream::BoxStream<'static, std::io::Result<Bytes>> {
    use futures::StreamExt;
    if rate == 0 {
        return futures::stream::pending().boxed();
    }
    let ends = cut.map(|c| Instant::now() + c);
    futures::stream::unfold(data, move |mut rest| async move {
        if rest.is_empty() {
            return None;
        }
        let full = (rate as f64 * every.as_secs_f64()).ceil().max(1.0) as usize;
        let n = full.min(rest.len());
        let mut wait = Duration::from_secs_f64(n as f64 / rate as f64);
        if let Some(end) = ends {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            if left < wait {
                // Cut mid-chunk: what came before the cut arrives, then the body ends.
                wait = left;
            }
        }
        tokio::time::sleep(wait).await;
        let got = ((rate as f64 * wait.as_secs_f64()).ceil() as usize).clamp(1, n);
        Some((Ok(rest.split_to(got)), rest))
    })
    .boxed()
}

/// The sources of a scenario's registries, by index.
pub(super) fn sources(regs: &[Arc<SimRegistry>]) -> Vec<Arc<dyn BlobSource>> {
    regs.iter()
        .map(|r| r.clone() as Arc<dyn BlobSource>)
        .collect()
}

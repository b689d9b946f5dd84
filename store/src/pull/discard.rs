//! Compressed layer blobs dropped once their layers are unpacked, so that an image costs its
//! unpacked size on disk (unless [`super::PullConfig::keep_layer_blobs`]).
//!
//! Nothing the kubelet does needs a layer's compressed blob once the layer is committed as a
//! snapshot: containers, image volumes and later pulls of images sharing the layer chain use the
//! snapshot. So, when a snapshotter unpacks the pulls:
//!
//! - an image record holds its index, manifest and config blobs, not its layer blobs;
//! - a pull whose layer chains are committed already downloads nothing for them: it takes a
//!   claim on the highest committed chain for its image (as unpacking it would) and unpacks
//!   only the layers above;
//! - when a pull has recorded its image, its layer blobs are deleted, except those a running pull
//!   has **pinned**: every pull pins its layers' digests from its start to its end, before it
//!   looks at what the content store holds, so a blob another pull is about to read (a layer it
//!   shares at another place in its chain) is never taken from under it; that pull deletes the
//!   blob when it ends;
//! - until a layer is committed its download stays the resume point: nothing here touches partial
//!   downloads, and a failed pull deletes nothing;
//! - at start, the layer blobs of every unpacked image are deleted (a crash between the record
//!   and the deletion; records written while `pull.keep_layer_blobs` was on are rewritten without
//!   them).
//!
//! A layer shared by two images at different places in their chains (other layers below it) has
//! two chains: the second image downloads the blob again if the first image's pull deleted it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use minicri_snapshotter::Kind;

use crate::digest::Digest;
use crate::error::Result;
use crate::images::ImageRecord;

use super::PullManager;

/// Layer digests pinned by running pulls, counted.
#[derive(Default, Clone)]
pub(super) struct LayerPins(Arc<Mutex<HashMap<Digest, usize>>>);

/// A pull's pins, released when dropped.
pub(super) struct Pinned {
    pins: LayerPins,
    digests: Vec<Digest>,
}

impl LayerPins {
    pub(super) fn pin(&self, digests: &[Digest]) -> Pinned {
        let mut m = self.0.lock().unwrap();
        for d in digests {
            *m.entry(d.clone()).or_default() += 1;
        }
        Pinned {
            pins: self.clone(),
            digests: digests.to_vec(),
        }
    }

    fn is_pinned(&self, d: &Digest) -> bool {
        self.0.lock().unwrap().contains_key(d)
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let mut m = self.pins.0.lock().unwrap();
        for d in &self.digests {
            if let Some(n) = m.get_mut(d) {
                *n -= 1;
                if *n == 0 {
                    m.remove(d);
                }
            }
        }
    }
}

impl PullManager {
    /// Whether layer blobs are dropped once unpacked: there is a snapshotter and
    /// `pull.keep_layer_blobs` is off.
    pub(super) fn discards_layer_blobs(&self) -> bool {
        self.snapshotter.is_some() && !self.config.keep_layer_blobs
    }

    /// Whether chain `key` is a committed snapshot.
    pub(super) fn chain_committed(&self, key: &str) -> bool {
        self.snapshotter
            .as_ref()
            .is_some_and(|s| s.stat(key).is_ok_and(|i| i.kind == Kind::Committed))
    }

    /// How many of `chains` (bottom first) are committed already, after taking a claim for
    /// image `image_id` on the highest of them (which holds the ones below): those layers need
    /// neither a download nor an unpack. Under the lock removals release claims under, so the
    /// chain found is the chain claimed.
    pub(super) fn claim_unpacked(&self, chains: &[String], image_id: &Digest) -> usize {
        let Some(snap) = &self.snapshotter else {
            return 0;
        };
        let _users = self
            .snapshot_users
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        for k in (0..chains.len()).rev() {
            if self.chain_committed(&chains[k]) {
                return match snap.add_user(&chains[k], image_id.as_str()) {
                    Ok(()) => k + 1,
                    Err(e) => {
                        tracing::debug!(chain = %chains[k], error = %e, "committed chain went before its claim; unpacking it");
                        0
                    }
                };
            }
        }
        0
    }

    /// The layers' unpacked (tar) sizes, from their snapshots (`chains`, bottom first); a
    /// layer's `compressed` size where the snapshot does not say.
    pub(super) fn unpacked_sizes(
        &self,
        chains: &[String],
        compressed: impl Iterator<Item = u64>,
    ) -> u64 {
        let snap = self.snapshotter.as_ref();
        chains
            .iter()
            .zip(compressed)
            .map(|(c, size)| {
                snap.and_then(|s| s.stat(c).ok())
                    .and_then(|i| i.layer_size)
                    .unwrap_or(size)
            })
            .sum()
    }

    /// Deletes the compressed blobs of `layers` that no record holds and no running pull has
    /// pinned, besides `own` (the caller's pins, let go here). Blocking.
    pub(super) fn discard_layer_blobs(&self, layers: &[Digest], own: Pinned) {
        drop(own);
        match self
            .images
            .discard_unheld(layers, &self.content, |d| self.pins.is_pinned(d))
        {
            Ok(gone) if !gone.is_empty() => {
                tracing::debug!(blobs = gone.len(), "discarded unpacked layer blobs")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "cannot discard unpacked layer blobs"),
        }
    }

    /// At start, before any pull runs: the layer blobs of every image whose layers are
    /// unpacked go (see the module's documentation). Blocking.
    pub fn discard_unpacked_layer_blobs(&self) -> Result<usize> {
        if !self.discards_layer_blobs() {
            return Ok(0);
        }
        let unpacked_size = |r: &ImageRecord| {
            r.chain_id
                .as_deref()
                .is_some_and(|c| self.chain_committed(c))
                .then(|| {
                    let chains = minicri_snapshotter::chain_ids(&r.diff_ids);
                    self.unpacked_sizes(&chains, r.layers.iter().map(|l| l.size))
                })
        };
        let layers = self.images.unhold_layer_blobs(unpacked_size)?;
        let gone = self
            .images
            .discard_unheld(&layers, &self.content, |d| self.pins.is_pinned(d))?;
        if !gone.is_empty() {
            tracing::info!(
                blobs = gone.len(),
                "discarded the compressed blobs of unpacked layers"
            );
        }
        Ok(gone.len())
    }
}

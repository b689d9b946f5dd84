//! The pull procedure of one job: resolve the platform manifest, fetch the config, download the
//! layers (a bounded number at once, shared node-wide) while unpacking them (a bounded number at
//! once, committed bottom to top), and record the image once every blob is committed and every
//! layer unpacked.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;

use crate::blobs::{BlobHandle, BlobSource};
use crate::content::BlobKey;
use crate::digest::Digest;
use crate::error::{Result, StoreError};
use crate::images::{ImageRecord, LayerRecord};
use crate::manifest::{self, Descriptor, ImageConfigDoc, ManifestDoc, Platform};
use crate::reference::Reference;
use crate::registry::{FetchedManifest, Session};
use crate::unpack::{self, LayerToApply};

use super::{Job, Part, PullManager};

/// Largest image config read: 8 MiB. Configs are a few KiB; a long history makes tens of KiB.
pub const MAX_CONFIG_BYTES: u64 = 8 << 20;

/// Longest image config `User` (`name:group`): account names are at most 32 characters.
pub const MAX_USER_BYTES: usize = 256;

/// Largest blob a descriptor may claim: 1 TiB. The download plans its ranges from the claimed
/// size before a byte arrives, so a manifest claiming 2^63 bytes would have it allocate
/// terabytes; no real layer comes near this.
pub const MAX_BLOB_BYTES: u64 = 1 << 40;

/// Default of the configurable maximum blob size (`pull.max_blob_size`): 64 GiB, the default most
/// bytes a layer may unpack to (`snapshotter.max_layer_bytes`). A compressed layer is no larger
/// than what it unpacks to, except by a few bytes per 32 KiB block for data that does not compress,
/// so a blob past it could only fail its unpack after filling the disk with its download.
pub const DEFAULT_MAX_BLOB_SIZE: u64 = 64 << 30;

/// Most layers an image may have: overlayfs mounts at most 500 lower layers, and each layer costs
/// a snapshot (a sync and two record writes); a 4 MiB manifest could otherwise list tens of
/// thousands.
pub const MAX_LAYERS: usize = 500;

impl PullManager {
    pub(super) async fn pull_content(
        self: &Arc<Self>,
        job: &Job,
        session: &Arc<Session>,
        top: &FetchedManifest,
    ) -> Result<ImageRecord> {
        let reference = session.reference();
        let mut blobs = BTreeSet::new();
        let top_doc = parse_manifest(reference, &top.bytes)?;
        self.content.write(&top.digest, &top.bytes)?;
        blobs.insert(top.digest.clone());

        let (manifest, doc) = if top_doc.manifests.is_some() {
            let entry = select_platform(&self.config.platform, reference, &top_doc)?;
            let d = parse_digest(reference, &entry.digest)?;
            let m = session
                .manifest(Some(&d))
                .await
                .map_err(|e| session.fold_errors("platform manifest", e))?;
            let doc = parse_manifest(reference, &m.bytes)?;
            if doc.manifests.is_some() {
                return Err(malformed(
                    reference,
                    "index",
                    "an index entry points at another index".into(),
                ));
            }
            self.content.write(&m.digest, &m.bytes)?;
            blobs.insert(m.digest.clone());
            (m, doc)
        } else {
            (top.clone(), top_doc)
        };

        let config_desc = doc
            .config
            .as_ref()
            .ok_or_else(|| malformed(reference, "manifest", "no config".into()))?;
        let layers = doc.layers.clone().unwrap_or_default();
        if layers.len() > MAX_LAYERS {
            return Err(malformed(
                reference,
                "manifest",
                format!(
                    "{} layers; at most {MAX_LAYERS} are pulled (overlayfs stacks no more)",
                    layers.len()
                ),
            ));
        }
        for l in &layers {
            if manifest::layer_compression(&l.media_type).is_none() {
                return Err(StoreError::UnsupportedMediaType {
                    reference: reference.to_string(),
                    media_type: l.media_type.clone(),
                });
            }
        }
        let config_digest = parse_digest(reference, &config_desc.digest)?;
        let mut layer_digests = Vec::with_capacity(layers.len());
        for l in &layers {
            layer_digests.push(parse_digest(reference, &l.digest)?);
        }
        for (d, desc) in
            std::iter::once((&config_digest, config_desc)).chain(layer_digests.iter().zip(&layers))
        {
            if desc.size < 0 {
                return Err(malformed(
                    reference,
                    "descriptor",
                    format!("negative size for {d}"),
                ));
            }
            if desc.size as u64 > MAX_BLOB_BYTES {
                return Err(malformed(
                    reference,
                    "descriptor",
                    format!(
                        "{d} claims {} bytes, more than the {MAX_BLOB_BYTES} a blob may have",
                        desc.size
                    ),
                ));
            }
            // Before any blob is fetched: a pull refused here has fetched no byte of any.
            if desc.size as u64 > self.config.max_blob_size {
                return Err(StoreError::BlobTooLarge {
                    reference: reference.to_string(),
                    digest: d.to_string(),
                    size: desc.size as u64,
                    max: self.config.max_blob_size,
                });
            }
        }
        // The config is read into memory whole: bound it before downloading it.
        if config_desc.size as u64 > MAX_CONFIG_BYTES {
            return Err(malformed(
                reference,
                "image config",
                format!(
                    "{} bytes exceeds the limit of {MAX_CONFIG_BYTES} bytes",
                    config_desc.size
                ),
            ));
        }
        // Pinned before the content store is looked at: a blob found there is not discarded
        // by another pull's end while this one may still read it (see `discard`).
        let pinned = self.pins.pin(&layer_digests);
        let discard = self.discards_layer_blobs();
        // The blobs still to download must fit above the image filesystem's reserve, or the
        // pull is refused before its first byte. (Each download checks again as it starts and
        // claims its bytes as it writes; the unpack, whose size no descriptor gives, claims its
        // own.) When unpacked layers' blobs are discarded, which layers need a download is known
        // only from the config (their chains): they are checked once it is read.
        let blobs_first: Vec<_> = if discard {
            vec![(&config_digest, config_desc)]
        } else {
            std::iter::once((&config_digest, config_desc))
                .chain(layer_digests.iter().zip(&layers))
                .collect()
        };
        self.check_fits(reference, &blobs_first)?;
        *job.parts.lock().unwrap() = std::iter::once((&config_digest, config_desc))
            .chain(layer_digests.iter().zip(&layers))
            .map(|(d, desc)| Part {
                digest: d.clone(),
                size: desc.size as u64,
                progress: None,
                unpacked: false,
            })
            .collect();
        *job.pinned.lock().unwrap() = Some(self.blobs.pin(job.part_keys()));

        // Config first (small, and it must parse), then the layers, a bounded number at once.
        let handle = self.acquire_part(job, 0, session)?;
        handle.wait().await?;
        drop(handle);
        let config_bytes = crate::fsutil::off_async(|| self.content.read(&config_digest))?;
        let config: ImageConfigDoc = serde_json::from_slice(&config_bytes)
            .map_err(|e| malformed(reference, "image config", e.to_string()))?;
        let diff_ids = config
            .rootfs
            .as_ref()
            .map(|r| r.diff_ids.clone())
            .unwrap_or_default();
        if diff_ids.len() != layers.len() {
            return Err(malformed(
                reference,
                "image config",
                format!("{} diff_ids for {} layers", diff_ids.len(), layers.len()),
            ));
        }
        for d in &diff_ids {
            Digest::parse(d)
                .map_err(|e| malformed(reference, "image config", format!("diff_id: {e}")))?;
        }
        // The user goes into the image's record and every ListImages and ImageStatus answer: a
        // config could otherwise make it megabytes, and a few such images every ListImages
        // larger than the kubelet's 16 MiB message cap.
        let user = config
            .config
            .as_ref()
            .and_then(|c| c.user.as_deref())
            .unwrap_or("");
        if user.len() > MAX_USER_BYTES || user.chars().any(char::is_control) {
            return Err(malformed(
                reference,
                "image config",
                format!(
                    "User is {} bytes or holds control characters (at most {MAX_USER_BYTES}, none)",
                    user.len()
                ),
            ));
        }
        blobs.insert(config_digest.clone());

        // Layers whose chains are committed already need nothing (their blobs may be gone).
        let chains = minicri_snapshotter::chain_ids(&diff_ids);
        let mut have = 0;
        if discard {
            have = crate::fsutil::off_async(|| self.claim_unpacked(&chains, &config_digest));
            self.mark_unpacked(job, have);
            let rest: Vec<_> = layer_digests.iter().zip(&layers).skip(have).collect();
            self.check_fits(reference, &rest)?;
        }

        // Downloads (a bounded number at once) and unpacking run together: each layer is applied
        // as soon as the one below it is, reading its bytes as they arrive.
        let permits = tokio::sync::Semaphore::new(self.config.max_concurrent_layers.max(1));
        // Built in a loop, not with a closure: a closure here gives the futures a higher-ranked
        // lifetime that tonic's Send bound cannot be proven for (a rustc limitation).
        let mut waits = Vec::with_capacity(layers.len());
        for i in have..layers.len() {
            waits.push(self.fetch_part_bounded(job, i + 1, session, &permits));
        }
        let downloads = futures::future::try_join_all(waits);
        let to_apply: Vec<LayerToApply> = layers
            .iter()
            .zip(&layer_digests)
            .zip(&diff_ids)
            .map(|((l, d), diff_id)| LayerToApply {
                digest: d.clone(),
                media_type: l.media_type.clone(),
                diff_id: diff_id.clone(),
            })
            .collect();
        let unpacking = self.unpack_layers(job, reference, &config_digest, &to_apply, have);
        let (_, chain_id) = tokio::try_join!(downloads, unpacking)?;
        if !discard {
            blobs.extend(layer_digests.iter().cloned());
        }

        let (uid, username) = manifest::user_of(user);
        // What the image costs on disk: its layers' unpacked size when their blobs go.
        let layer_bytes = if discard {
            crate::fsutil::off_async(|| {
                self.unpacked_sizes(&chains, layers.iter().map(|l| l.size as u64))
            })
        } else {
            layers.iter().map(|l| l.size as u64).sum::<u64>()
        };
        let size = config_desc.size as u64 + manifest.bytes.len() as u64 + layer_bytes;
        let platform = Platform {
            os: config.os.clone(),
            architecture: config.architecture.clone(),
            variant: config.variant.clone(),
        };
        let mut record = ImageRecord {
            id: config_digest.clone(),
            repo_tags: reference.tagged().into_iter().collect(),
            repo_digests: vec![reference.with_digest(&top.digest)],
            manifest: manifest.digest.clone(),
            config: config_digest,
            layers: layers
                .iter()
                .zip(&layer_digests)
                .map(|(l, d)| LayerRecord {
                    digest: d.clone(),
                    size: l.size as u64,
                    media_type: l.media_type.clone(),
                })
                .collect(),
            diff_ids,
            size,
            uid,
            username,
            pinned: false,
            platform: platform.to_string(),
            blobs,
            chain_id,
            pulled_at: chrono::Utc::now(),
        };
        // An image removed while this pull reused its blobs or snapshots lost them: fetch (and
        // unpack) those again.
        for _ in 0..3 {
            match crate::fsutil::off_async(|| self.record_image(&record)) {
                Err(StoreError::BlobNotFound(b)) => {
                    tracing::info!(image = %reference, blob = %b, "content removed during pull; fetching again");
                    // The record holds the layer blobs only when they are kept.
                    let parts = if discard { 0 } else { layers.len() };
                    for i in 0..=parts {
                        self.fetch_part(job, i, session).await?;
                    }
                }
                Err(StoreError::Snapshotter(minicri_snapshotter::Error::NotFound { key })) => {
                    tracing::info!(image = %reference, snapshot = %key, "layer snapshots removed during pull; unpacking again");
                    let have = if discard {
                        crate::fsutil::off_async(|| self.claim_unpacked(&chains, &record.config))
                    } else {
                        0
                    };
                    for i in (have + 1)..=layers.len() {
                        self.fetch_part(job, i, session).await?;
                    }
                    record.chain_id = self
                        .unpack_layers(job, reference, &record.config, &to_apply, have)
                        .await?;
                }
                Ok((stored, removed)) => {
                    for old in &removed.images {
                        tracing::info!(image = %old.id, "image lost its last name to a newer pull and was removed");
                    }
                    self.finish_removal(removed);
                    if discard {
                        crate::fsutil::off_async(|| {
                            self.discard_layer_blobs(&layer_digests, pinned)
                        });
                    }
                    return Ok(stored);
                }
                Err(e) => return Err(e),
            }
        }
        Err(StoreError::Unavailable {
            reference: reference.to_string(),
            reason: "content kept being removed during the pull".into(),
        })
    }

    /// Refuses the pull if `blobs` still to download do not fit above the image filesystem's
    /// reserve.
    fn check_fits(&self, reference: &Reference, blobs: &[(&Digest, &Descriptor)]) -> Result<()> {
        let content = &self.content;
        crate::fsutil::off_async(|| {
            let mut seen = BTreeSet::new();
            let missing = blobs
                .iter()
                .filter(|&&(d, _)| seen.insert(d) && content.size(d).is_none())
                .map(|&(d, desc)| {
                    let size = desc.size as u64;
                    size.saturating_sub(content.ingest_bytes(&BlobKey::new(d.clone(), size)))
                })
                .sum::<u64>();
            content.check_fits(missing, || {
                format!(
                    "pull of {reference} ({} of blobs to download)",
                    crate::text::human_bytes(missing as f64)
                )
            })
        })
    }

    /// Layers `0..have` need no download: their chains are committed.
    fn mark_unpacked(&self, job: &Job, have: usize) {
        let mut parts = job.parts.lock().unwrap();
        for p in parts.iter_mut().skip(1).take(have) {
            p.unpacked = true;
        }
        drop(parts);
        job.parts_changed.notify_waiters();
    }

    async fn fetch_part_bounded(
        &self,
        job: &Job,
        i: usize,
        session: &Arc<Session>,
        permits: &tokio::sync::Semaphore,
    ) -> Result<()> {
        let _permit = permits.acquire().await.expect("never closed");
        self.fetch_part(job, i, session).await
    }

    /// Unpacks the image's layers above the `have` committed already (and claimed), up to
    /// `pull.max_concurrent_unpacks` at once in chain order (each starts as its download does; a
    /// layer whose parent is still unpacking is applied ahead of it); returns the top chain id,
    /// if unpacking.
    async fn unpack_layers(
        &self,
        job: &Job,
        reference: &Reference,
        image_id: &Digest,
        layers: &[LayerToApply],
        have: usize,
    ) -> Result<Option<String>> {
        let Some(snap) = &self.snapshotter else {
            return Ok(None);
        };
        let chains = minicri_snapshotter::chain_ids(
            &layers
                .iter()
                .map(|l| l.diff_id.as_str())
                .collect::<Vec<_>>(),
        );
        let gates: Vec<Arc<unpack::Gate>> = layers.iter().map(|_| Arc::default()).collect();
        for g in &gates[..have] {
            g.open(true);
        }
        let window = self.config.max_concurrent_unpacks.max(1);
        let mut running = FuturesUnordered::new();
        let mut next = have;
        // Admitted in chain order, and a slot frees only when a layer ends: the lowest layer not
        // yet committed is always running, so every waiting layer waits on one that runs.
        while next < layers.len() || !running.is_empty() {
            while next < layers.len() && running.len() < window {
                let i = next;
                let parent = i
                    .checked_sub(1)
                    .map(|p| (chains[p].clone(), gates[p].clone()));
                let gate = unpack::GateGuard(gates[i].clone());
                let expected = chains[i].clone();
                running.push(async move {
                    // Ahead of an uncommitted parent only in one of the node's slots for that,
                    // held until the parent's apply ends; or after the parent, whichever comes
                    // first. The lowest uncommitted layer of a pull never waits for a slot, and a
                    // slot frees when its holder's parent ends: no deadlock.
                    if let Some((_, below)) = parent.as_ref().filter(|(_, g)| !g.is_open()) {
                        tokio::select! {
                            biased;
                            _ = below.opened() => {}
                            slot = self.unpack_ahead.clone().acquire_owned() => {
                                let below = below.clone();
                                let slot = slot.expect("never closed");
                                drop(tokio::spawn(async move {
                                    below.opened().await;
                                    drop(slot);
                                }));
                            }
                        }
                    }
                    let progress = self.layer_progress(job, i, &layers[i]).await;
                    let unpacker = unpack::Unpacker {
                        snapshotter: snap,
                        content: &self.content,
                        unpacks: &job.unpacks,
                    };
                    let chain = unpacker
                        .apply_layer(
                            &reference.to_string(),
                            image_id.as_str(),
                            &layers[i],
                            parent,
                            progress,
                        )
                        .await?;
                    debug_assert_eq!(chain, expected);
                    gate.0.open(true);
                    Ok::<_, StoreError>(())
                });
                next += 1;
            }
            if let Some(done) = running.next().await {
                done?;
            }
        }
        Ok(chains.last().cloned())
    }

    /// Waits until layer `i`'s download is registered (its progress) or its blob is present
    /// (None): woken when a part registers; the bound re-checks the content store, where another
    /// job may have committed the blob.
    async fn layer_progress(
        &self,
        job: &Job,
        i: usize,
        layer: &LayerToApply,
    ) -> Option<Arc<crate::blobs::BlobProgress>> {
        loop {
            let registered = job.parts_changed.notified();
            if let Some(p) = job.parts.lock().unwrap()[i + 1].progress.clone() {
                return Some(p);
            }
            if self.content.size(&layer.digest).is_some() {
                return None;
            }
            let _ = tokio::time::timeout(Duration::from_secs(1), registered).await;
        }
    }

    fn acquire_part(&self, job: &Job, i: usize, session: &Arc<Session>) -> Result<BlobHandle> {
        let (digest, size) = {
            let parts = job.parts.lock().unwrap();
            (parts[i].digest.clone(), parts[i].size)
        };
        // The job's own session first, then those of requesters that joined from elsewhere.
        let mut sessions: Vec<Arc<dyn BlobSource>> = vec![session.clone()];
        sessions.extend(job.sessions.lock().unwrap().iter().cloned());
        let handle = self.blobs.acquire(&digest, size, &sessions, &job.demand)?;
        job.parts.lock().unwrap()[i].progress = Some(handle.progress().clone());
        job.parts_changed.notify_waiters();
        Ok(handle)
    }

    async fn fetch_part(&self, job: &Job, i: usize, session: &Arc<Session>) -> Result<()> {
        let handle = self.acquire_part(job, i, session)?;
        handle.wait().await
    }
}

fn select_platform<'a>(
    want: &Platform,
    reference: &Reference,
    index: &'a ManifestDoc,
) -> Result<&'a Descriptor> {
    let entries = index.manifests.as_deref().unwrap_or_default();
    entries
        .iter()
        .filter(|e| {
            e.media_type.is_empty()
                || e.media_type == manifest::OCI_MANIFEST
                || e.media_type == manifest::DOCKER_MANIFEST
        })
        .find(|e| e.platform.as_ref().is_some_and(|p| want.matches(p)))
        .ok_or_else(|| StoreError::NoMatchingPlatform {
            reference: reference.to_string(),
            platform: want.to_string(),
            available: entries
                .iter()
                .filter_map(|e| e.platform.as_ref().map(ToString::to_string))
                .collect::<Vec<_>>()
                .join(", "),
        })
}

fn malformed(reference: &Reference, what: &str, reason: String) -> StoreError {
    StoreError::Malformed {
        reference: reference.to_string(),
        what: what.into(),
        reason,
    }
}

fn parse_digest(reference: &Reference, s: &str) -> Result<Digest> {
    Digest::parse(s).map_err(|e| malformed(reference, "descriptor", e.to_string()))
}

/// Parses a manifest or index as a pull does: JSON, a supported media type, an index or an image
/// manifest. Pure, so it can be fuzzed.
pub fn parse_manifest(reference: &Reference, bytes: &[u8]) -> Result<ManifestDoc> {
    let doc: ManifestDoc = serde_json::from_slice(bytes)
        .map_err(|e| malformed(reference, "manifest", e.to_string()))?;
    if doc.schema_version == Some(1) {
        return Err(StoreError::UnsupportedMediaType {
            reference: reference.to_string(),
            media_type: "application/vnd.docker.distribution.manifest.v1+json (Docker schema 1)"
                .into(),
        });
    }
    if let Some(mt) = &doc.media_type
        && ![
            manifest::OCI_INDEX,
            manifest::DOCKER_LIST,
            manifest::OCI_MANIFEST,
            manifest::DOCKER_MANIFEST,
        ]
        .contains(&mt.as_str())
    {
        return Err(StoreError::UnsupportedMediaType {
            reference: reference.to_string(),
            media_type: mt.clone(),
        });
    }
    if doc.manifests.is_none() && doc.config.is_none() {
        return Err(malformed(
            reference,
            "manifest",
            "neither an index nor an image manifest".into(),
        ));
    }
    Ok(doc)
}

//! Image pulls: resolve a reference through the configured endpoints, pick the platform's manifest,
//! download and verify every blob into the content store, then record the image.
//!
//! Invariants:
//! - an image becomes visible (its record is written) only after every blob it needs is committed;
//! - every blob is checked against its descriptor's digest and size before it is committed;
//! - a download that stops half-way (error, cancellation, crash) leaves its bytes in the ingest
//!   area, and the next download of that blob continues from them with an HTTP Range request;
//! - transient failures (connection errors, 5xx, a body cut short) are retried with back-off,
//!   resuming each time.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};

use crate::content::{ContentStore, Ingest};
use crate::digest::Digest;
use crate::error::{Result, StoreError};
use crate::images::{ImageRecord, ImageStore, LayerRecord};
use crate::manifest::{self, Descriptor, ImageConfigDoc, ManifestDoc, Platform};
use crate::reference::Reference;
use crate::registry::{Credentials, Registry, RemoteKind, Session};

/// How many times a blob download is retried after a transient failure.
const BLOB_RETRIES: u32 = 5;
const FIRST_BACKOFF: Duration = Duration::from_millis(200);

/// Pull settings.
#[derive(Debug, Clone)]
pub struct PullConfig {
    /// The platform to select from indexes.
    pub platform: Platform,
    /// Layers of one image downloaded at once.
    pub max_concurrent_layers: usize,
}

impl Default for PullConfig {
    fn default() -> Self {
        PullConfig {
            platform: Platform::parse("linux/amd64").expect("valid"),
            max_concurrent_layers: 3,
        }
    }
}

/// Pulls images into a content store and image store.
pub struct Puller {
    content: Arc<ContentStore>,
    images: Arc<ImageStore>,
    registry: Registry,
    config: PullConfig,
}

impl Puller {
    pub fn new(
        content: Arc<ContentStore>,
        images: Arc<ImageStore>,
        registry: Registry,
        config: PullConfig,
    ) -> Puller {
        Puller {
            content,
            images,
            registry,
            config,
        }
    }

    /// Pulls `reference` and returns the stored image record.
    pub async fn pull(&self, reference: &str, creds: &Credentials) -> Result<ImageRecord> {
        let reference = Reference::parse(reference)?;
        // Building registry clients loads TLS roots (slow, blocking): keep it off the async threads.
        let (registry, r, c) = (self.registry.clone(), reference.clone(), creds.clone());
        let session = tokio::task::spawn_blocking(move || registry.session(&r, &c))
            .await
            .expect("session set-up does not panic")?;
        let started = std::time::Instant::now();
        // An image removed while this pull reused its blobs loses them; one more pass fetches them.
        let mut tries = 0;
        loop {
            tries += 1;
            match self.pull_once(&session).await {
                Err(StoreError::BlobNotFound(b)) if tries < 3 => {
                    tracing::info!(image = %reference, blob = %b, "content removed during pull; fetching again");
                }
                Ok(rec) => {
                    tracing::info!(image = %reference, id = %rec.id, elapsed_ms = started.elapsed().as_millis() as u64, "pulled");
                    return Ok(rec);
                }
                Err(e) => return Err(e),
            }
        }
    }

    async fn pull_once(&self, session: &Session) -> Result<ImageRecord> {
        let reference = session.reference();
        let top = session
            .manifest(None)
            .await
            .map_err(|e| session.fold_errors("manifest", e))?;
        let mut blobs = BTreeSet::new();
        let top_doc = parse_manifest(reference, &top.bytes)?;
        self.content.write(&top.digest, &top.bytes)?;
        blobs.insert(top.digest.clone());

        let (manifest, doc) = if top_doc.manifests.is_some() {
            let entry = self.select_platform(reference, &top_doc)?;
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
        for l in &layers {
            if manifest::layer_compression(&l.media_type).is_none() {
                return Err(StoreError::UnsupportedMediaType {
                    reference: reference.to_string(),
                    media_type: l.media_type.clone(),
                });
            }
        }

        // Config first (small, and it must parse), then the layers concurrently.
        let config_digest = self.fetch_blob(session, config_desc).await?;
        let config_bytes = self.content.read(&config_digest)?;
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
        blobs.insert(config_digest.clone());

        // Built in a loop, not with a closure: a closure here gives the futures a higher-ranked
        // lifetime that tonic's Send bound cannot be proven for (a rustc limitation).
        let mut fetches = Vec::with_capacity(layers.len());
        for l in &layers {
            fetches.push(self.fetch_blob(session, l));
        }
        let layer_digests: Vec<Digest> = futures::stream::iter(fetches)
            .buffered(self.config.max_concurrent_layers.max(1))
            .try_collect()
            .await?;
        blobs.extend(layer_digests.iter().cloned());

        let (uid, username) = manifest::user_of(
            config
                .config
                .as_ref()
                .and_then(|c| c.user.as_deref())
                .unwrap_or(""),
        );
        let size = config_desc.size.max(0) as u64
            + manifest.bytes.len() as u64
            + layers.iter().map(|l| l.size.max(0) as u64).sum::<u64>();
        let platform = Platform {
            os: config.os.clone(),
            architecture: config.architecture.clone(),
            variant: config.variant.clone(),
        };
        let record = ImageRecord {
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
            pulled_at: chrono::Utc::now(),
        };
        let (stored, removed) = self.images.add(record, &self.content)?;
        for old in removed.images {
            tracing::info!(image = %old.id, "image lost its last name to a newer pull and was removed");
        }
        Ok(stored)
    }

    fn select_platform<'a>(
        &self,
        reference: &Reference,
        index: &'a ManifestDoc,
    ) -> Result<&'a Descriptor> {
        let entries = index.manifests.as_deref().unwrap_or_default();
        let want = &self.config.platform;
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

    /// Makes sure blob `desc` is committed, downloading what is missing. Returns its digest.
    async fn fetch_blob(&self, session: &Session, desc: &Descriptor) -> Result<Digest> {
        let reference = session.reference();
        let digest = parse_digest(reference, &desc.digest)?;
        if desc.size < 0 {
            return Err(malformed(
                reference,
                "descriptor",
                format!("negative size for {digest}"),
            ));
        }
        let size = desc.size as u64;
        if self.content.size(&digest) == Some(size) {
            return Ok(digest);
        }
        let guard = self.content.lock_ingest(&digest).await;
        if self.content.size(&digest) == Some(size) {
            return Ok(digest);
        }
        let content = self.content.clone();
        let d = digest.clone();
        let ingest = tokio::task::spawn_blocking(move || content.open_ingest(&d, size))
            .await
            .expect("open_ingest does not panic")?;
        if ingest.offset() > 0 {
            tracing::info!(blob = %digest, offset = ingest.offset(), size, "resuming download");
        }
        // The writer thread owns the ingest and its lock, so the lock is released only after the
        // last queued chunk is on disk, even if this future is dropped.
        let (tx, mut rx) = tokio::sync::mpsc::channel::<WriterMsg>(32);
        let mut offset = ingest.offset();
        let writer = tokio::task::spawn_blocking(move || {
            let _guard = guard;
            let mut ingest: Ingest = ingest;
            while let Some(msg) = rx.blocking_recv() {
                match msg {
                    WriterMsg::Data(b) => ingest.append(&b)?,
                    WriterMsg::Restart => ingest.restart()?,
                }
            }
            Ok::<Ingest, StoreError>(ingest)
        });

        let mut failures = 0u32;
        let mut backoff = FIRST_BACKOFF;
        while offset < size {
            let attempt = async {
                let mut body = session
                    .blob(&digest, offset)
                    .await
                    .map_err(|e| (true, session.fold_errors("blob", e)))?;
                if offset > 0 && !body.resumed {
                    tracing::info!(blob = %digest, offset, endpoint = %body.endpoint, "registry ignored the range request; restarting blob");
                    offset = 0;
                    tx.send(WriterMsg::Restart)
                        .await
                        .map_err(|_| (false, writer_gone()))?;
                }
                while let Some(chunk) = body.stream.next().await {
                    let chunk = chunk.map_err(|e| {
                        (
                            true,
                            StoreError::Unavailable {
                                reference: reference.to_string(),
                                reason: format!("downloading {digest}: {e}"),
                            },
                        )
                    })?;
                    offset += chunk.len() as u64;
                    tx.send(WriterMsg::Data(chunk))
                        .await
                        .map_err(|_| (false, writer_gone()))?;
                }
                Ok::<(), (bool, StoreError)>(())
            };
            match attempt.await {
                Ok(()) if offset < size => {
                    tracing::warn!(blob = %digest, offset, size, "blob body ended early; resuming");
                    failures += 1;
                }
                Ok(()) => {}
                Err((_, StoreError::Unavailable { .. }))
                | Err((true, StoreError::Malformed { .. }))
                    if failures < BLOB_RETRIES =>
                {
                    failures += 1;
                }
                Err((_, e)) => {
                    drop(tx);
                    // Surface the writer's own error (e.g. too many bytes) in preference.
                    return match writer.await.expect("writer does not panic") {
                        Err(we) => Err(self.discard_on_data_error(&digest, we)),
                        Ok(_) => Err(e),
                    };
                }
            }
            if offset < size {
                if failures > BLOB_RETRIES {
                    drop(tx);
                    let _ = writer.await;
                    return Err(StoreError::Unavailable {
                        reference: reference.to_string(),
                        reason: format!(
                            "blob {digest}: gave up after {BLOB_RETRIES} retries at byte {offset} of {size}"
                        ),
                    });
                }
                tracing::info!(blob = %digest, offset, failures, "retrying blob download");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
        drop(tx);
        let ingest = match writer.await.expect("writer does not panic") {
            Ok(i) => i,
            Err(e) => return Err(self.discard_on_data_error(&digest, e)),
        };
        let content = self.content.clone();
        tokio::task::spawn_blocking(move || ingest.commit(&content))
            .await
            .expect("commit does not panic")?;
        Ok(digest)
    }

    /// Bytes beyond the descriptor's size mean the partial data is not a prefix of the blob: drop it.
    fn discard_on_data_error(&self, digest: &Digest, e: StoreError) -> StoreError {
        if matches!(e, StoreError::SizeMismatch { .. }) {
            let _ = self.content.remove_ingest(digest);
        }
        e
    }
}

enum WriterMsg {
    Data(Bytes),
    Restart,
}

fn writer_gone() -> StoreError {
    StoreError::io(
        "ingest writer stopped",
        std::io::Error::other("writer thread ended"),
    )
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

fn parse_manifest(reference: &Reference, bytes: &[u8]) -> Result<ManifestDoc> {
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

/// Whether an error from a remote is worth another try.
pub fn is_transient(kind: RemoteKind) -> bool {
    kind == RemoteKind::Unavailable
}

//! minicri's image store: everything between a registry and a pulled image on disk.
//!
//! - [`reference`]: image reference parsing and normalisation;
//! - [`fsutil`]: durable atomic file replacement, for every record the daemon writes;
//! - [`keyed`]: per-key async locks that last as long as their holders;
//! - [`content`]: the content-addressed blob store and its resumable ingest area;
//! - [`images`]: image records (CRI images) keyed by config digest, with names and blob ownership;
//! - [`hosts`]: registry endpoints from a containerd-style `hosts.toml` directory;
//! - [`registry`]: registry sessions (auth, mirrors with fallback, manifests, blob ranges);
//! - [`blobs`]: node-wide, shared, resumable blob downloads;
//! - [`gc`]: collection of abandoned partial downloads (TTL, low disk space);
//! - [`space`]: the image filesystem's reserve, which downloads and unpacks keep free;
//! - [`unpack`]: layers applied into snapshots as they download;
//! - [`pull`]: pull jobs shared by their requesters, with references, aborts and progress;
//! - [`settings`]: what the crate's configuration sections share;
//! - `sim` (tests only): a deterministic simulation of the pull engine, driving the real
//!   [`blobs`], [`sched`], watchdog, reserve and collector with seeded scenarios and checking
//!   their invariants.

pub mod blobs;
pub mod content;
pub mod digest;
pub mod error;
pub mod fsutil;
pub mod gc;
pub mod hosts;
pub mod images;
pub mod keyed;
pub mod manifest;
pub mod pull;
pub mod reference;
pub mod registry;
pub mod sched;
pub mod settings;
#[cfg(test)]
mod sim;
pub mod space;
pub mod text;
pub mod unpack;

pub use content::ContentStore;
pub use digest::Digest;
pub use error::{ErrorKind, Result, StoreError};
pub use hosts::RegistryHosts;
pub use images::{ImageRecord, ImageStore};
pub use pull::detach::{DetachPolicy, progress_text};
pub use pull::{
    AbortTarget, JobSnapshot, PodRef, PullConfig, PullCounters, PullManager, Requester,
};
pub use reference::Reference;
pub use registry::{Credentials, Registry};

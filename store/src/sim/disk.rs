//! The simulation's small image filesystem: a [`Measure`] for the daemon's own
//! [`SpaceBudget`](crate::space::SpaceBudget), whose used bytes are the blob bytes of the content
//! store (what its partial downloads account for, and its committed blobs), on a disk of the
//! scenario's size.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock, Weak};

use crate::content::ContentStore;
use crate::space::{FsSpace, Measure};

pub(super) struct SimDisk {
    pub root: PathBuf,
    pub size: u64,
    /// The content store on it, once opened (it is opened with the budget this measures for).
    pub content: OnceLock<Weak<ContentStore>>,
}

impl SimDisk {
    /// Blob bytes on the disk: each partial download's bytes, as the content store accounts
    /// for them (a ranged download's pieces leave holes a file's length would count), and each
    /// committed blob.
    pub fn used(&self) -> u64 {
        let Some(content) = self.content.get().and_then(Weak::upgrade) else {
            return 0;
        };
        let u = content.ingest_usage();
        let partial = u.active_bytes + u.idle_bytes;
        let committed: u64 = std::fs::read_dir(self.root.join("blobs/sha256"))
            .map(|d| {
                d.flatten()
                    .filter_map(|e| e.metadata().ok())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0);
        partial + committed
    }
}

impl Measure for Arc<SimDisk> {
    fn measure(&self) -> std::io::Result<FsSpace> {
        Ok(FsSpace {
            available: self.size.saturating_sub(self.used()),
            total: self.size,
        })
    }
}

//! An in-memory image side ([`ImageAccess`]) for the pod service's unit tests, which run without
//! root, registries or images: no image is on this node, snapshots are plain directories under
//! one the test owns (`bind` mounts of them), and volume holds and closed pods are recorded for
//! the test to check, not acted on.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use minicri_snapshotter::{Backend, Mount, Usage};
use minicri_store::{Digest, ImageRecord};

use super::ImageAccess;
use crate::error::{Error, Result};

pub struct FakeImages {
    dir: PathBuf,
    /// (image id, container) of the volume holds.
    pub holds: Mutex<BTreeSet<(String, String)>>,
    /// `uid/attempt` of the pods closed and not reopened.
    pub closed: Mutex<BTreeSet<String>>,
}

impl FakeImages {
    /// Snapshots go under `dir` (made when missing).
    pub fn new(dir: &Path) -> FakeImages {
        std::fs::create_dir_all(dir).unwrap();
        FakeImages {
            dir: dir.to_path_buf(),
            holds: Mutex::default(),
            closed: Mutex::default(),
        }
    }

    fn snapshot(&self, key: &str) -> PathBuf {
        self.dir.join(key)
    }

    fn bind(path: &Path) -> Mount {
        Mount {
            fstype: "bind".into(),
            source: path.to_string_lossy().into_owned(),
            options: vec!["rbind".into()],
        }
    }
}

fn not_found(key: &str) -> minicri_snapshotter::Error {
    minicri_snapshotter::Error::NotFound {
        key: key.to_string(),
    }
}

impl ImageAccess for FakeImages {
    fn image(&self, _name_or_id: &str) -> Result<Option<ImageRecord>> {
        Ok(None)
    }

    fn config(&self, image: &ImageRecord) -> Result<Vec<u8>> {
        Err(Error::NotFound(format!(
            "image {} is not on this node",
            image.id
        )))
    }

    fn backend(&self) -> Backend {
        Backend::Copy
    }

    fn prepare(&self, key: &str, _parent: Option<&str>) -> Result<Mount> {
        let dir = self.snapshot(key);
        std::fs::create_dir_all(&dir)
            .map_err(|e| Error::Internal(format!("creating {}: {e}", dir.display())))?;
        Ok(Self::bind(&dir))
    }

    fn view(&self, key: &str, parent: &str) -> Result<Mount> {
        self.prepare(key, Some(parent))
    }

    fn mounts(&self, key: &str) -> Result<Mount> {
        let dir = self.snapshot(key);
        if !dir.is_dir() {
            return Err(not_found(key).into());
        }
        Ok(Self::bind(&dir))
    }

    fn remove_snapshot(&self, key: &str) -> Result<()> {
        match std::fs::remove_dir_all(self.snapshot(key)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(Error::Internal(format!("removing snapshot {key}: {e}")))
            }
            _ => Ok(()),
        }
    }

    fn usage(&self, key: &str) -> minicri_snapshotter::Result<Usage> {
        fn walk(dir: &Path, u: &mut Usage) -> std::io::Result<()> {
            for e in std::fs::read_dir(dir)? {
                let e = e?;
                let md = e.metadata()?;
                u.inodes += 1;
                u.bytes += md.len();
                if md.is_dir() {
                    walk(&e.path(), u)?;
                }
            }
            Ok(())
        }
        let dir = self.snapshot(key);
        if !dir.is_dir() {
            return Err(not_found(key));
        }
        let mut u = Usage {
            bytes: 0,
            inodes: 1,
        };
        walk(&dir, &mut u).map_err(|source| minicri_snapshotter::Error::Io {
            context: format!("measuring {}", dir.display()),
            source,
        })?;
        Ok(u)
    }

    fn hold_for_volume(&self, image: &Digest, container: &str) -> Result<()> {
        self.holds
            .lock()
            .unwrap()
            .insert((image.to_string(), container.to_string()));
        Ok(())
    }

    fn release_volume(&self, image: &Digest, container: &str) -> Result<()> {
        self.holds
            .lock()
            .unwrap()
            .remove(&(image.to_string(), container.to_string()));
        Ok(())
    }

    fn drop_unused_volume_images(&self) -> Result<()> {
        Ok(())
    }

    fn close_pod(&self, uid: &str, attempt: u32, _reason: &str) -> usize {
        self.closed
            .lock()
            .unwrap()
            .insert(format!("{uid}/{attempt}"));
        0
    }

    fn reopen_pod(&self, uid: &str, attempt: u32) {
        self.closed
            .lock()
            .unwrap()
            .remove(&format!("{uid}/{attempt}"));
    }
}

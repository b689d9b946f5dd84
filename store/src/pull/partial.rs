//! Partial data that stopped pulls leave behind, capped per pod.
//!
//! A job stopped because its last requester went (a pod deleted mid-pull, a call cancelled)
//! keeps the partial data of its blobs for a resume. That data is charged to every pod (or
//! plain call) that wanted the job; past `pull.partial_data_per_pod` of the image filesystem,
//! a pod's oldest left-behind partial data goes, however young, so one tenant's abandoned
//! multi-gigabyte pulls cannot take the node's disk for `pull.ingest_ttl`. Data a running
//! download wants is never taken (it is not idle), and data charged to several pods counts for
//! each. Before a pull is refused at the reserve, idle partial data goes anyway
//! ([`crate::space::Reclaim`]).

use std::collections::HashMap;
use std::sync::Mutex;

use crate::blobs::BlobDownloads;
use crate::content::{BlobKey, ContentStore};
use crate::space::Reserve;

/// Pods (or calls) remembered at most; past it the ones charged longest ago are forgotten
/// (their data stays, under the TTL and the reclaim before refusals).
const MAX_OWNERS: usize = 4096;
/// Blobs remembered per pod at most (an image has at most 500 layers and a config).
const MAX_KEYS_PER_OWNER: usize = 2048;

/// Who left which partial data: owner (pod uid, or call) to blob keys, oldest first.
#[derive(Default)]
pub struct LeftBehind {
    owners: Mutex<Vec<(String, Vec<BlobKey>)>>,
}

impl LeftBehind {
    /// Charges `keys` to each of `owners`, then removes, for each of them, its oldest idle
    /// partial data past `cap` of the content store's filesystem. Blocking. Returns the bytes
    /// removed.
    pub fn charge(
        &self,
        owners: &[String],
        keys: &[BlobKey],
        cap: Reserve,
        content: &ContentStore,
        blobs: &BlobDownloads,
    ) -> u64 {
        let total = crate::space::fs_space(content.root()).map_or(0, |s| s.total);
        let cap = cap.bytes_of(total);
        let mut removed = 0;
        let mut map = self.owners.lock().unwrap();
        for owner in owners {
            let at = match map.iter().position(|(o, _)| o == owner) {
                Some(i) => i,
                None => {
                    if map.len() >= MAX_OWNERS {
                        map.remove(0);
                    }
                    map.push((owner.clone(), Vec::new()));
                    map.len() - 1
                }
            };
            let list = &mut map[at].1;
            for k in keys {
                list.retain(|x| x != k);
                list.push(k.clone());
            }
            if list.len() > MAX_KEYS_PER_OWNER {
                list.drain(..list.len() - MAX_KEYS_PER_OWNER);
            }
            // What is still on disk, oldest first; whatever went meanwhile is forgotten.
            list.retain(|k| content.ingest_bytes(k) > 0);
            let mut held: u64 = list.iter().map(|k| content.ingest_bytes(k)).sum();
            let mut i = 0;
            while held > cap && i < list.len() {
                let bytes = content.ingest_bytes(&list[i]);
                if blobs.remove_idle(
                    &list[i],
                    "over the pod's share of partial data (pull.partial_data_per_pod)",
                    bytes,
                ) {
                    held -= bytes;
                    removed += bytes;
                    list.remove(i);
                } else {
                    i += 1;
                }
            }
        }
        map.retain(|(_, l)| !l.is_empty());
        removed
    }

    /// Bytes of idle partial data charged to each owner now (for tests and the admin API).
    pub fn charged(&self, content: &ContentStore) -> HashMap<String, u64> {
        self.owners
            .lock()
            .unwrap()
            .iter()
            .map(|(o, l)| (o.clone(), l.iter().map(|k| content.ingest_bytes(k)).sum()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::Digest;
    use std::sync::Arc;

    fn partial(content: &ContentStore, name: &str, bytes: usize) -> BlobKey {
        let key = BlobKey::new(Digest::of(name.as_bytes()), 1 << 20);
        let mut ing = content.open_ingest(&key).unwrap();
        ing.append(&vec![7u8; bytes]).unwrap();
        key
    }

    #[test]
    fn a_pods_partial_data_past_its_cap_goes_oldest_first_and_others_keep_theirs() {
        let dir = tempfile::tempdir().unwrap();
        let content = Arc::new(ContentStore::open(dir.path()).unwrap());
        let blobs = BlobDownloads::new(content.clone(), Default::default(), Default::default());
        let left = LeftBehind::default();
        let cap = Reserve::Bytes(250_000);
        let (a1, a2, a3) = (
            partial(&content, "a1", 100_000),
            partial(&content, "a2", 100_000),
            partial(&content, "a3", 100_000),
        );
        let b1 = partial(&content, "b1", 200_000);
        let pod_a = vec!["pod-a".to_string()];
        assert_eq!(
            left.charge(&pod_a, &[a1.clone(), a2.clone()], cap, &content, &blobs),
            0
        );
        assert_eq!(
            left.charge(
                &["pod-b".to_string()],
                std::slice::from_ref(&b1),
                cap,
                &content,
                &blobs
            ),
            0
        );
        // A third blob takes pod a past 250 kB: its oldest goes.
        assert_eq!(
            left.charge(&pod_a, std::slice::from_ref(&a3), cap, &content, &blobs),
            100_000
        );
        assert_eq!(content.ingest_bytes(&a1), 0);
        assert_eq!(content.ingest_bytes(&a2), 100_000);
        assert_eq!(content.ingest_bytes(&a3), 100_000);
        assert_eq!(content.ingest_bytes(&b1), 200_000);
        let charged = left.charged(&content);
        assert_eq!(charged["pod-a"], 200_000);
        assert_eq!(charged["pod-b"], 200_000);
    }

    #[test]
    fn partial_data_a_download_wants_is_not_taken() {
        let dir = tempfile::tempdir().unwrap();
        let content = Arc::new(ContentStore::open(dir.path()).unwrap());
        let blobs = BlobDownloads::new(content.clone(), Default::default(), Default::default());
        let left = LeftBehind::default();
        let key = partial(&content, "busy", 100_000);
        // A writer holds the ingest's lock: in use.
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let guard = rt.block_on(content.lock_ingest(&key));
        let owners = vec!["pod".to_string()];
        assert_eq!(
            left.charge(
                &owners,
                std::slice::from_ref(&key),
                Reserve::Bytes(1),
                &content,
                &blobs
            ),
            0
        );
        assert_eq!(content.ingest_bytes(&key), 100_000);
        drop(guard);
        assert_eq!(
            left.charge(&owners, &[], Reserve::Bytes(1), &content, &blobs),
            100_000
        );
        assert_eq!(content.ingest_bytes(&key), 0);
        assert!(left.charged(&content).is_empty());
    }
}

//! Per-key async locks ([`KeyedLocks`]): operations on one object (a blob's ingest, a pod, a
//! sandbox's network) are serialised, operations on different objects run side by side. An entry
//! lives only while someone holds or waits for its lock: nothing is left behind for the objects
//! that come and go on a node.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex, Weak};

/// A lock per key, made on first use and dropped with its last holder or waiter.
pub struct KeyedLocks<K> {
    locks: Mutex<HashMap<K, Weak<tokio::sync::Mutex<()>>>>,
}

impl<K> std::fmt::Debug for KeyedLocks<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyedLocks").finish_non_exhaustive()
    }
}

impl<K: Eq + Hash + Clone> Default for KeyedLocks<K> {
    fn default() -> Self {
        KeyedLocks {
            locks: Mutex::new(HashMap::new()),
        }
    }
}

impl<K: Eq + Hash + Clone> KeyedLocks<K> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Waits for `key`'s lock; it is released when the guard is dropped.
    pub async fn lock(&self, key: &K) -> tokio::sync::OwnedMutexGuard<()> {
        self.entry(key).lock_owned().await
    }

    /// `key`'s lock if nobody holds it now, without waiting (for blocking code).
    pub fn try_lock(&self, key: &K) -> Option<tokio::sync::OwnedMutexGuard<()>> {
        self.entry(key).try_lock_owned().ok()
    }

    fn entry(&self, key: &K) -> Arc<tokio::sync::Mutex<()>> {
        {
            let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
            // Entries whose last holder is gone (cheap: only the keys in use are there).
            locks.retain(|_, w| w.strong_count() > 0);
            match locks.get(key).and_then(Weak::upgrade) {
                Some(l) => l,
                None => {
                    let l = Arc::new(tokio::sync::Mutex::new(()));
                    locks.insert(key.clone(), Arc::downgrade(&l));
                    l
                }
            }
        }
    }

    /// Keys with a holder or waiter now.
    pub fn len(&self) -> usize {
        let locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        locks.values().filter(|w| w.strong_count() > 0).count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn one_key_is_serialised_others_are_not_and_nothing_stays() {
        let locks = Arc::new(KeyedLocks::<String>::new());
        let a = locks.lock(&"a".to_string()).await;
        // Another key is free.
        let b = locks.lock(&"b".to_string()).await;
        // The same key waits.
        let l2 = locks.clone();
        let waiter = tokio::spawn(async move { l2.lock(&"a".to_string()).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiter.is_finished());
        drop(a);
        let a2 = tokio::time::timeout(Duration::from_secs(2), waiter)
            .await
            .expect("released")
            .unwrap();
        assert_eq!(locks.len(), 2);
        drop((a2, b));
        assert!(locks.is_empty());
        // A new lock prunes the dead entries.
        drop(locks.lock(&"c".to_string()).await);
        assert_eq!(locks.locks.lock().unwrap().len(), 1);
    }
}

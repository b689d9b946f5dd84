//! Owns what the watch knows of this node's pods ([`PodCache`]: uid, name, whether it is being
//! deleted or has finished, the images its spec names) and the rules that turn lists and watch
//! events into it ([`Tracker`]), reporting each pod's deletion once.
//!
//! A pod is reported ([`DeletedPod`]) the first time it is seen with a
//! `metadata.deletionTimestamp` ([`DeletionCause::DeletionTimestamp`]), or when a `DELETED` event
//! arrives ([`DeletionCause::Deleted`]), or when a relist no longer contains a pod seen before
//! ([`DeletionCause::GoneAtResync`]: deleted while the watch was down). Pods never seen in the
//! API (static pods) are never reported; objects of other nodes, or without a uid, are ignored.
//! A pod is forgotten once it is gone.
//!
//! The cache is bounded: at most [`MAX_PODS`] pods (a node runs a hundred or so; pods past the
//! cap are unknown to the watch, so their pulls keep the detach window), and at most
//! [`MAX_POD_IMAGES`] images of a pod.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};

use k8s_openapi::api::core::v1::Pod;
use tracing::{debug, info, warn};

use super::{DeletedPod, DeletionCause, OnDeleted};

/// Pods of the node the cache keeps at most.
pub const MAX_PODS: usize = 4096;
/// Images of one pod kept at most (containers, init and ephemeral containers, image volumes).
pub const MAX_POD_IMAGES: usize = 64;
/// An image name longer than this is not a reference (names are at most 255 bytes, tags 128,
/// digests 71): kept as a marker that the pod wants an image that cannot be pulled.
const MAX_IMAGE_LEN: usize = 512;

/// What the watch knows of one pod of the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodInfo {
    pub namespace: String,
    pub name: String,
    /// Its deletion was seen (and reported).
    pub deleting: bool,
    /// Phase `Succeeded` or `Failed`: it pulls nothing more.
    pub finished: bool,
    /// The images its spec names, as written (up to [`MAX_POD_IMAGES`]).
    pub images: Vec<String>,
    /// It names more images than were kept.
    pub images_truncated: bool,
}

/// This node's pods as the watch last saw them, by uid; read by the pull policy and the
/// progress events, written by the [`Tracker`].
#[derive(Debug, Default)]
pub struct PodCache {
    pods: RwLock<HashMap<String, PodInfo>>,
}

impl PodCache {
    /// The pod with this uid, if the watch knows it.
    pub fn get(&self, uid: &str) -> Option<PodInfo> {
        self.read().get(uid).cloned()
    }

    /// How many pods the watch knows.
    pub fn len(&self) -> usize {
        self.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.read().is_empty()
    }

    /// Runs `f` over the pods (uid, info) under the read lock: keep it short.
    pub fn any(&self, mut f: impl FnMut(&str, &PodInfo) -> bool) -> bool {
        self.read().iter().any(|(uid, p)| f(uid, p))
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, PodInfo>> {
        self.pods.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, PodInfo>> {
        self.pods.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// The fields of a pod the tracker uses, checked.
struct Seen {
    uid: String,
    info: PodInfo,
}

/// Turns lists and watch events of one node's pods into the [`PodCache`] and deletion reports.
pub struct Tracker {
    node: String,
    cache: Arc<PodCache>,
    on_deleted: OnDeleted,
    /// A list completed since the tracker was made: later lists are resyncs.
    listed_once: bool,
    /// Pods past [`MAX_PODS`] were dropped (said once).
    said_full: bool,
}

impl Tracker {
    pub fn new(node: String, cache: Arc<PodCache>, on_deleted: OnDeleted) -> Tracker {
        Tracker {
            node,
            cache,
            on_deleted,
            listed_once: false,
            said_full: false,
        }
    }

    pub fn node(&self) -> &str {
        &self.node
    }

    /// Whether a list has completed: the cache holds every pod of the node as of then.
    pub fn listed_once(&self) -> bool {
        self.listed_once
    }

    /// Another node's pods from now on (the credentials changed node): forgets every pod,
    /// reporting none.
    pub fn reset(&mut self, node: String) {
        self.cache.write().clear();
        self.node = node;
        self.listed_once = false;
    }

    /// A complete list of the node's pods: the pods known before and not listed now were
    /// deleted meanwhile.
    pub fn relist(&mut self, pods: &[Pod]) {
        let mut listed = HashSet::new();
        for pod in pods {
            if let Some(seen) = self.check(pod) {
                listed.insert(seen.uid.clone());
                self.apply_seen(seen);
            }
        }
        let mut gone: Vec<(String, PodInfo)> = {
            let mut cache = self.cache.write();
            let uids: Vec<String> = cache
                .keys()
                .filter(|uid| !listed.contains(*uid))
                .cloned()
                .collect();
            uids.into_iter()
                .filter_map(|uid| cache.remove(&uid).map(|p| (uid, p)))
                .collect()
        };
        gone.sort_by(|a, b| a.0.cmp(&b.0));
        for (uid, p) in &gone {
            if !p.deleting {
                self.report(uid, &p.namespace, &p.name, DeletionCause::GoneAtResync);
            }
        }
        if self.listed_once {
            info!(
                node = %self.node, pods = listed.len(), gone = gone.len(),
                "pod watcher: resync done"
            );
        } else {
            info!(node = %self.node, pods = listed.len(), "pod watcher: initial list done");
        }
        self.listed_once = true;
    }

    /// A pod added or modified.
    pub fn apply(&mut self, pod: &Pod) {
        if let Some(seen) = self.check(pod) {
            self.apply_seen(seen);
        }
    }

    /// A pod removed (a `DELETED` event).
    pub fn delete(&mut self, pod: &Pod) {
        let Some(seen) = self.check(pod) else { return };
        let known = self.cache.write().remove(&seen.uid);
        if !known.is_some_and(|k| k.deleting) {
            self.report(
                &seen.uid,
                &seen.info.namespace,
                &seen.info.name,
                DeletionCause::Deleted,
            );
        }
    }

    /// The pod's fields, if it is a pod of this node with a uid; logs why not otherwise.
    fn check(&self, pod: &Pod) -> Option<Seen> {
        let meta = &pod.metadata;
        let namespace = meta.namespace.clone().unwrap_or_default();
        let name = meta.name.clone().unwrap_or_default();
        let Some(uid) = meta.uid.clone().filter(|u| !u.is_empty()) else {
            warn!(%namespace, %name, "pod watcher: ignoring a pod without a uid");
            return None;
        };
        let spec = pod.spec.as_ref();
        let node = spec.and_then(|s| s.node_name.as_deref());
        if node != Some(self.node.as_str()) {
            warn!(
                %namespace, %name, %uid, node = node.unwrap_or(""),
                "pod watcher: ignoring a pod of another node"
            );
            return None;
        }
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        let (images, images_truncated) = spec.map(images_of).unwrap_or_default();
        Some(Seen {
            uid,
            info: PodInfo {
                namespace,
                name,
                deleting: meta.deletion_timestamp.is_some(),
                finished: matches!(phase, Some("Succeeded" | "Failed")),
                images,
                images_truncated,
            },
        })
    }

    /// A pod seen alive or being deleted (listed, added, modified).
    fn apply_seen(&mut self, seen: Seen) {
        let report = {
            let mut cache = self.cache.write();
            let was_deleting = match cache.get(&seen.uid) {
                Some(known) => known.deleting,
                None if cache.len() >= MAX_PODS => {
                    if !self.said_full {
                        warn!(node = %self.node, max = MAX_PODS, "pod watcher: more pods on the node than it keeps; the others' pulls keep the detach window");
                        self.said_full = true;
                    }
                    return;
                }
                None => false,
            };
            let mut info = seen.info;
            // A deletion, once seen, stays seen (and is reported once).
            info.deleting |= was_deleting;
            let report = info.deleting && !was_deleting;
            cache.insert(seen.uid.clone(), info.clone());
            report.then_some(info)
        };
        if let Some(info) = report {
            self.report(
                &seen.uid,
                &info.namespace,
                &info.name,
                DeletionCause::DeletionTimestamp,
            );
        } else {
            debug!(uid = %seen.uid, "pod watcher: pod seen");
        }
    }

    fn report(&self, uid: &str, namespace: &str, name: &str, cause: DeletionCause) {
        info!(%namespace, %name, %uid, %cause, "pod watcher: pod deletion seen");
        (self.on_deleted)(&DeletedPod {
            uid: uid.to_string(),
            namespace: namespace.to_string(),
            name: name.to_string(),
            cause,
        });
    }
}

/// The images a pod spec names (containers, init containers, ephemeral containers and image
/// volumes), without repeats, and whether there were more than [`MAX_POD_IMAGES`].
fn images_of(spec: &k8s_openapi::api::core::v1::PodSpec) -> (Vec<String>, bool) {
    let named = spec
        .init_containers
        .iter()
        .flatten()
        .chain(spec.containers.iter())
        .filter_map(|c| c.image.as_deref())
        .chain(
            spec.ephemeral_containers
                .iter()
                .flatten()
                .filter_map(|c| c.image.as_deref()),
        )
        .chain(
            spec.volumes
                .iter()
                .flatten()
                .filter_map(|v| v.image.as_ref()?.reference.as_deref()),
        );
    let mut images: Vec<String> = Vec::new();
    for image in named {
        if images.iter().any(|i| i == image) {
            continue;
        }
        if images.len() == MAX_POD_IMAGES {
            return (images, true);
        }
        let image = if image.len() > MAX_IMAGE_LEN {
            "(an image name too long to be a reference)"
        } else {
            image
        };
        images.push(image.to_string());
    }
    (images, false)
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use k8s_openapi::api::core::v1::{Container, ImageVolumeSource, PodSpec, PodStatus, Volume};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    use super::*;

    fn pod(uid: &str, node: &str, deleting: bool) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(format!("pod-{uid}")),
                namespace: Some("ns".into()),
                uid: Some(uid.into()),
                deletion_timestamp: deleting.then(|| Time(Default::default())),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some(node.into()),
                containers: vec![Container {
                    name: "c".into(),
                    image: Some("busybox".into()),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// The (uid, cause) pairs reported.
    type Reports = Arc<Mutex<Vec<(String, DeletionCause)>>>;

    fn tracker() -> (Tracker, Arc<PodCache>, Reports) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let sink = seen.clone();
        let on_deleted: OnDeleted = Arc::new(move |p: &DeletedPod| {
            sink.lock().unwrap().push((p.uid.clone(), p.cause));
        });
        let cache = Arc::new(PodCache::default());
        (
            Tracker::new("node-a".into(), cache.clone(), on_deleted),
            cache,
            seen,
        )
    }

    #[test]
    fn reports_each_pod_once_and_forgets_it() {
        let (mut t, cache, seen) = tracker();
        t.relist(&[
            pod("a", "node-a", false),
            pod("b", "node-a", false),
            pod("x", "node-b", true),
        ]);
        assert!(t.listed_once());
        t.apply(&pod("a", "node-a", true));
        t.apply(&pod("a", "node-a", true));
        // A later event without the timestamp (out of order) does not make it alive again.
        t.apply(&pod("a", "node-a", false));
        assert!(cache.get("a").unwrap().deleting);
        t.delete(&pod("a", "node-a", true));
        t.delete(&pod("x", "node-b", true));
        t.apply(&pod("c", "node-a", false));
        // A relist without b and c: both gone.
        t.relist(&[pod("d", "node-a", true)]);
        assert_eq!(
            *seen.lock().unwrap(),
            vec![
                ("a".into(), DeletionCause::DeletionTimestamp),
                ("d".into(), DeletionCause::DeletionTimestamp),
                ("b".into(), DeletionCause::GoneAtResync),
                ("c".into(), DeletionCause::GoneAtResync),
            ]
        );
        assert_eq!(cache.len(), 1);
        assert!(cache.get("d").is_some());
        // Another node: everything forgotten, nothing reported.
        t.reset("node-b".into());
        assert!(cache.is_empty() && !t.listed_once());
        assert_eq!(seen.lock().unwrap().len(), 4);
    }

    #[test]
    fn the_cache_keeps_images_phase_and_bounds() {
        let (mut t, cache, _) = tracker();
        let mut p = pod("a", "node-a", false);
        let spec = p.spec.as_mut().unwrap();
        spec.init_containers = Some(vec![Container {
            name: "init".into(),
            image: Some("registry.test/init:1".into()),
            ..Default::default()
        }]);
        spec.containers.push(Container {
            name: "again".into(),
            image: Some("busybox".into()),
            ..Default::default()
        });
        spec.volumes = Some(vec![Volume {
            name: "v".into(),
            image: Some(ImageVolumeSource {
                reference: Some("registry.test/data:1".into()),
                ..Default::default()
            }),
            ..Default::default()
        }]);
        t.apply(&p);
        let info = cache.get("a").unwrap();
        assert_eq!(
            info.images,
            vec!["registry.test/init:1", "busybox", "registry.test/data:1"]
        );
        assert!(!info.images_truncated && !info.finished && !info.deleting);

        p.status = Some(PodStatus {
            phase: Some("Succeeded".into()),
            ..Default::default()
        });
        let spec = p.spec.as_mut().unwrap();
        spec.containers = (0..MAX_POD_IMAGES + 5)
            .map(|i| Container {
                name: format!("c{i}"),
                image: Some(format!("img{i}")),
                ..Default::default()
            })
            .collect();
        t.apply(&p);
        let info = cache.get("a").unwrap();
        assert!(info.finished && info.images_truncated);
        assert_eq!(info.images.len(), MAX_POD_IMAGES);

        for i in 0..MAX_PODS + 3 {
            t.apply(&pod(&format!("p{i}"), "node-a", false));
        }
        assert_eq!(cache.len(), MAX_PODS);
    }
}

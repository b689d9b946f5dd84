//! The image side as the rest of the daemon meets it: the pod service reaches images, their
//! snapshots and their pulls through one seam, [`ImageAccess`], and PullImage's requester (which
//! pod a pull is for, and its share of the node's transfers) is decided here, not in the CRI
//! handler.
//!
//! On a node the seam is [`NodeImages`]: the image and content stores, the snapshotter and the
//! pull manager of `minicri-store` and `minicri-snapshotter`. The pod service's unit tests put
//! an in-memory fake behind it.

use std::collections::HashMap;
use std::sync::Arc;

use minicri_proto::runtime::v1 as cri;
use minicri_snapshotter::{Backend, Mount, Snapshotter, Usage};
use minicri_store::{
    ContentStore, Digest, ImageRecord, ImageStore, PodRef, PullManager, Requester,
};

use crate::error::Result;

#[cfg(test)]
pub(crate) mod fake;

/// What the pod service needs of the image side: images by name, their snapshots, the holds
/// image volumes keep on images, and the pulls of a pod. The snapshot methods, `config` and the
/// volume holds do file work (a tree, a blob, a journal write): call them off the async workers.
/// `image`, `backend` and a pod's pulls only take an in-memory lock.
pub trait ImageAccess: Send + Sync {
    /// The image `name_or_id` names (a reference, or an image id), if it is on the node.
    fn image(&self, name_or_id: &str) -> Result<Option<ImageRecord>>;
    /// The config document of `image`.
    fn config(&self, image: &ImageRecord) -> Result<Vec<u8>>;
    /// The snapshotter's backend (overlay or copy).
    fn backend(&self) -> Backend;
    /// A writable snapshot `key` on the layer chain `parent` (none: empty), and how to mount it.
    fn prepare(&self, key: &str, parent: Option<&str>) -> Result<Mount>;
    /// A read-only snapshot `key` of the layer chain `parent`, and how to mount it.
    fn view(&self, key: &str, parent: &str) -> Result<Mount>;
    /// How to mount snapshot `key`.
    fn mounts(&self, key: &str) -> Result<Mount>;
    /// Removes snapshot `key`; done when it is not there.
    fn remove_snapshot(&self, key: &str) -> Result<()>;
    /// The bytes and inodes snapshot `key` holds of its own (a walk of its tree: slow); the
    /// snapshotter's own error, whose `NotFound` says the snapshot is gone.
    fn usage(&self, key: &str) -> minicri_snapshotter::Result<Usage>;
    /// Image `image` is mounted as a volume by container `container`: it stays on the node
    /// (RemoveImage keeps it, unlisted) until [`ImageAccess::release_volume`].
    fn hold_for_volume(&self, image: &Digest, container: &str) -> Result<()>;
    /// Container `container` no longer mounts image `image`: an image kept only for it goes.
    fn release_volume(&self, image: &Digest, container: &str) -> Result<()>;
    /// Removes the images kept only for volume users that are gone.
    fn drop_unused_volume_images(&self) -> Result<()>;
    /// The pod `uid` at `attempt` is stopped (`reason` says how): its pull references are
    /// dropped and its further pulls refused. Returns how many references were dropped.
    fn close_pod(&self, uid: &str, attempt: u32, reason: &str) -> usize;
    /// The pod `uid` at `attempt` runs again: its pulls are accepted.
    fn reopen_pod(&self, uid: &str, attempt: u32);
}

/// The node's image side: [`ImageAccess`] over the stores, the snapshotter and the pull manager.
pub struct NodeImages {
    pub images: Arc<ImageStore>,
    pub content: Arc<ContentStore>,
    pub snapshotter: Arc<dyn Snapshotter>,
    pub pulls: Arc<PullManager>,
}

impl ImageAccess for NodeImages {
    fn image(&self, name_or_id: &str) -> Result<Option<ImageRecord>> {
        Ok(self.images.get(name_or_id)?)
    }

    fn config(&self, image: &ImageRecord) -> Result<Vec<u8>> {
        Ok(self.content.read(&image.config)?)
    }

    fn backend(&self) -> Backend {
        self.snapshotter.backend()
    }

    fn prepare(&self, key: &str, parent: Option<&str>) -> Result<Mount> {
        Ok(self.snapshotter.prepare(key, parent)?)
    }

    fn view(&self, key: &str, parent: &str) -> Result<Mount> {
        Ok(self.snapshotter.view(key, Some(parent))?)
    }

    fn mounts(&self, key: &str) -> Result<Mount> {
        Ok(self.snapshotter.mounts(key)?)
    }

    fn remove_snapshot(&self, key: &str) -> Result<()> {
        match self.snapshotter.remove(key) {
            Ok(_) | Err(minicri_snapshotter::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    fn usage(&self, key: &str) -> minicri_snapshotter::Result<Usage> {
        self.snapshotter.usage(key)
    }

    fn hold_for_volume(&self, image: &Digest, container: &str) -> Result<()> {
        Ok(self.pulls.hold_for_volume(image, container)?)
    }

    fn release_volume(&self, image: &Digest, container: &str) -> Result<()> {
        Ok(self.pulls.release_volume(image, container)?)
    }

    fn drop_unused_volume_images(&self) -> Result<()> {
        Ok(self.pulls.drop_unused_nameless()?)
    }

    fn close_pod(&self, uid: &str, attempt: u32, reason: &str) -> usize {
        self.pulls.close_pod(uid, attempt, reason)
    }

    fn reopen_pod(&self, uid: &str, attempt: u32) {
        self.pulls.reopen_pod(uid, attempt)
    }
}

/// The pod annotation that sets a pod's share of the node's transfer connections
/// (docs/pulls.md).
pub const PULL_PRIORITY_ANNOTATION: &str = "pull.minicri.io/priority";

/// A pod's weight in the transfer scheduler: `low` halves its share, `high` doubles it, but only
/// for pods of the namespaces the operator allowed (`pull.priority_namespaces`): whoever writes a
/// pod may yield, not take from others. Anything else is the normal weight.
fn pull_weight(namespace: &str, annotations: &HashMap<String, String>, allowed: &[String]) -> u32 {
    use minicri_store::sched::NORMAL_WEIGHT;
    match annotations.get(PULL_PRIORITY_ANNOTATION).map(|v| v.trim()) {
        Some("low") => NORMAL_WEIGHT / 2,
        Some("high") if allowed.iter().any(|n| n == namespace) => NORMAL_WEIGHT * 2,
        _ => NORMAL_WEIGHT,
    }
}

/// Who a PullImage call pulls for: the pod its sandbox config names (with the pod's sandbox,
/// `sandbox_of` it, when the kubelet made one already, and the pod's weight), or, for a call
/// made on behalf of no pod, the call itself. A pull for a pod is that pod's sandbox's
/// reference; a stopped sandbox's pulls are refused by the pull manager.
pub fn requester(
    sandbox_config: Option<cri::PodSandboxConfig>,
    sandbox_of: impl FnOnce(&str, u32) -> Option<String>,
    priority_namespaces: &[String],
) -> Requester {
    let Some((m, annotations)) =
        sandbox_config.and_then(|c| c.metadata.map(|m| (m, c.annotations)))
    else {
        return Requester::anonymous();
    };
    let sandbox = sandbox_of(&m.uid, m.attempt);
    let weight = pull_weight(&m.namespace, &annotations, priority_namespaces);
    let mut r = Requester::pod(
        PodRef {
            namespace: m.namespace,
            name: m.name,
            uid: m.uid,
            attempt: m.attempt,
        },
        sandbox,
    );
    r.weight = weight;
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use minicri_store::sched::NORMAL_WEIGHT;

    #[test]
    fn a_pod_may_lower_its_pull_priority_and_raise_it_only_where_allowed() {
        let allowed = vec!["kube-system".to_string()];
        let with = |v: &str| HashMap::from([(PULL_PRIORITY_ANNOTATION.to_string(), v.to_string())]);
        assert_eq!(
            pull_weight("default", &HashMap::new(), &allowed),
            NORMAL_WEIGHT
        );
        assert_eq!(
            pull_weight("default", &with("low"), &allowed),
            NORMAL_WEIGHT / 2
        );
        assert_eq!(
            pull_weight("default", &with("high"), &allowed),
            NORMAL_WEIGHT
        );
        assert_eq!(
            pull_weight("kube-system", &with("high"), &allowed),
            NORMAL_WEIGHT * 2
        );
        assert_eq!(
            pull_weight("kube-system", &with("low"), &allowed),
            NORMAL_WEIGHT / 2
        );
        assert_eq!(
            pull_weight("kube-system", &with("urgent"), &allowed),
            NORMAL_WEIGHT
        );
        assert_eq!(
            pull_weight("kube-system", &with("high"), &[]),
            NORMAL_WEIGHT
        );
    }

    #[test]
    fn a_pull_for_a_pod_is_its_sandboxs_and_any_other_is_the_calls() {
        let config = cri::PodSandboxConfig {
            metadata: Some(cri::PodSandboxMetadata {
                name: "web".into(),
                namespace: "kube-system".into(),
                uid: "u1".into(),
                attempt: 2,
            }),
            annotations: HashMap::from([(
                PULL_PRIORITY_ANNOTATION.to_string(),
                "high".to_string(),
            )]),
            ..Default::default()
        };
        let allowed = ["kube-system".to_string()];
        let r = requester(
            Some(config.clone()),
            |uid, attempt| (uid == "u1" && attempt == 2).then(|| "sb1".to_string()),
            &allowed,
        );
        assert_eq!(r.sandbox_id.as_deref(), Some("sb1"));
        assert_eq!(r.pod.as_ref().map(|p| p.name.as_str()), Some("web"));
        assert_eq!(r.weight, NORMAL_WEIGHT * 2);
        // The sandbox may not be made yet: still the pod's reference.
        let r = requester(Some(config), |_, _| None, &[]);
        assert_eq!(r.sandbox_id, None);
        assert_eq!(
            r.key(),
            requester(
                Some(cri::PodSandboxConfig {
                    metadata: Some(cri::PodSandboxMetadata {
                        uid: "u1".into(),
                        attempt: 2,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                |_, _| None,
                &[],
            )
            .key()
        );
        assert_eq!(r.weight, NORMAL_WEIGHT);
        // No pod: each call its own reference.
        let (a, b) = (
            requester(None, |_, _| None, &[]),
            requester(None, |_, _| None, &[]),
        );
        assert!(a.pod.is_none());
        assert_ne!(a.key(), b.key());
    }
}

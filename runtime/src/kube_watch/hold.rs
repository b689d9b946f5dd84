//! Owns the pull policy the watch makes possible ([`WatchHoldPolicy`], the store's
//! [`DetachPolicy`]): a pod's PullImage whose detach window has passed keeps waiting, so the
//! kubelet sees one pull that ends when the image is there (no `ErrImagePull`, no back-off),
//! as long as
//!
//! - the watch is connected and synced, and knows the pod (by uid), not deleted nor finished: a
//!   deletion would then release the call within a second, which is what the window was for;
//! - no other pod of the node (known to the watch, not being deleted, not finished) names an
//!   image that is not in the image store, other than the one this call pulls: with the kubelet's
//!   serial puller (its default) that pod's pull may be queued behind this call, and the window
//!   is what promises it waits at most one.
//!
//! Otherwise the call detaches as it would without the watch. Images are compared as the store
//! names them ([`Reference`]: `busybox` is `docker.io/library/busybox:latest`); a name that is not
//! a reference is never pulled (the kubelet refuses it), so it waits for nothing.

use std::sync::Arc;

use minicri_store::{DetachPolicy, ImageStore, Reference, Requester};

use super::WatchState;

/// Whether the node has an image, by its normalised name.
pub type HasImage = Box<dyn Fn(&Reference) -> bool + Send + Sync>;

/// See the module docs.
pub struct WatchHoldPolicy {
    state: Arc<WatchState>,
    has_image: HasImage,
}

impl WatchHoldPolicy {
    /// The policy over the watch's `state` and the node's `images`.
    pub fn new(state: Arc<WatchState>, images: Arc<ImageStore>) -> WatchHoldPolicy {
        WatchHoldPolicy::with(
            state,
            Box::new(move |r: &Reference| {
                images
                    .get(&r.to_string())
                    .is_ok_and(|found| found.is_some())
            }),
        )
    }

    /// The policy with another way of knowing which images are there.
    pub fn with(state: Arc<WatchState>, has_image: HasImage) -> WatchHoldPolicy {
        WatchHoldPolicy { state, has_image }
    }

    /// Whether `image` (as a pod spec writes it) is one the node lacks, other than `pulling`.
    fn lacks(&self, image: &str, pulling: &Reference) -> bool {
        match Reference::parse(image) {
            Err(_) => false,
            Ok(r) if r.to_string() == pulling.to_string() => false,
            Ok(r) => !(self.has_image)(&r),
        }
    }
}

impl DetachPolicy for WatchHoldPolicy {
    fn may_hold_past_window(&self, requester: &Requester, reference: &Reference) -> bool {
        let Some(pod) = &requester.pod else {
            return false;
        };
        if !self.state.synced() {
            return false;
        }
        if !self
            .state
            .pods
            .get(&pod.uid)
            .is_some_and(|p| !p.deleting && !p.finished)
        {
            return false;
        }
        let another_waits = self.state.pods.any(|uid, p| {
            uid != pod.uid
                && !p.deleting
                && !p.finished
                && (p.images_truncated || p.images.iter().any(|i| self.lacks(i, reference)))
        });
        !another_waits
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;
    use std::sync::Mutex;

    use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
    use minicri_store::PodRef;

    use super::super::tracker::Tracker;
    use super::*;

    fn pod(uid: &str, images: &[&str]) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(uid.into()),
                namespace: Some("ns".into()),
                uid: Some(uid.into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some("node-1".into()),
                containers: images
                    .iter()
                    .map(|i| Container {
                        name: "c".into(),
                        image: Some(i.to_string()),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn requester(uid: &str) -> Requester {
        Requester::pod(
            PodRef {
                namespace: "ns".into(),
                name: uid.into(),
                uid: uid.into(),
                attempt: 0,
            },
            Some(format!("sb-{uid}")),
        )
    }

    struct Node {
        state: Arc<WatchState>,
        tracker: Tracker,
        policy: WatchHoldPolicy,
        present: Arc<Mutex<HashSet<String>>>,
    }

    fn node() -> Node {
        let state = Arc::new(WatchState::new(true));
        let tracker = Tracker::new("node-1".into(), state.pods.clone(), Arc::new(|_| {}));
        let present = Arc::new(Mutex::new(HashSet::new()));
        let p = present.clone();
        let policy = WatchHoldPolicy::with(
            state.clone(),
            Box::new(move |r: &Reference| p.lock().unwrap().contains(&r.to_string())),
        );
        Node {
            state,
            tracker,
            policy,
            present,
        }
    }

    #[test]
    fn held_only_while_synced_for_a_known_live_pod() {
        let mut n = node();
        let big = Reference::parse("registry.test/big:1").unwrap();
        n.tracker.relist(&[pod("a", &["registry.test/big:1"])]);
        let may = |n: &Node, uid: &str| n.policy.may_hold_past_window(&requester(uid), &big);
        // Not connected yet.
        assert!(!may(&n, "a"));
        n.state.status.up(false);
        assert!(!may(&n, "a"), "connected but not synced");
        n.state.status.up(true);
        assert!(may(&n, "a"));
        // A pod the watch does not know (a static pod), or a call for no pod.
        assert!(!may(&n, "static"));
        assert!(!n.policy.may_hold_past_window(&Requester::anonymous(), &big));
        // The watch goes down: detach.
        n.state.status.down("connection refused");
        assert!(!may(&n, "a"));
        n.state.status.up(true);
        // Being deleted, or finished: detach.
        let mut deleting = pod("a", &["registry.test/big:1"]);
        deleting.metadata.deletion_timestamp = Some(Time(Default::default()));
        n.tracker.apply(&deleting);
        assert!(!may(&n, "a"));
        let mut done = pod("b", &["registry.test/big:1"]);
        done.status = Some(PodStatus {
            phase: Some("Failed".into()),
            ..Default::default()
        });
        n.tracker.apply(&done);
        assert!(!may(&n, "b"));
    }

    #[test]
    fn another_pod_waiting_for_a_missing_image_makes_it_detach() {
        let mut n = node();
        n.state.status.up(true);
        let big = Reference::parse("registry.test/big:1").unwrap();
        let may = |n: &Node| n.policy.may_hold_past_window(&requester("a"), &big);
        // a's own other images, and another pod wanting the same image (named another way),
        // wait for this very pull or a's next one: no reason to detach.
        n.tracker.relist(&[
            pod("a", &["registry.test/big:1", "small"]),
            pod("twin", &["registry.test/big:1"]),
            pod("bad", &["Not A Reference"]),
        ]);
        assert!(may(&n));
        // Another pod whose image is here waits for nothing.
        n.present
            .lock()
            .unwrap()
            .insert("docker.io/library/busybox:latest".into());
        n.tracker.apply(&pod("b", &["busybox"]));
        assert!(may(&n));
        // One that lacks an image: a detaches (b's pull may be queued behind it).
        n.tracker
            .apply(&pod("b", &["busybox", "registry.test/small:2"]));
        assert!(!may(&n));
        // Until that image is there, or b is deleted or finished.
        n.present
            .lock()
            .unwrap()
            .insert("registry.test/small:2".into());
        assert!(may(&n));
        n.tracker.apply(&pod("c", &["registry.test/other:1"]));
        assert!(!may(&n));
        let mut gone = pod("c", &["registry.test/other:1"]);
        gone.metadata.deletion_timestamp = Some(Time(Default::default()));
        n.tracker.apply(&gone);
        assert!(may(&n));
    }
}

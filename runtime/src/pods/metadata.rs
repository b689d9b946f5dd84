//! The bounds on what pods and containers carry as labels and annotations: at most
//! [`MAX_METADATA_BYTES`] of each per object, and for the node's pods together, and its
//! containers together, the node's budget (`daemon.node_metadata_budget`), which creations in
//! progress claim from before their records are stored.

use super::{PodService, Strings};
use crate::error::{Error, Result};

/// Most bytes (keys and values) of a pod's or container's labels, and of its annotations: the
/// API server's own limit for annotations, plus room for the ones the kubelet adds
/// (`kubernetes.io/config.*`).
pub const MAX_METADATA_BYTES: usize = (256 + 16) << 10;

/// Default of `daemon.node_metadata_budget`: most bytes of labels and annotations of all the
/// node's pods together, and of all its containers. A memory bound (the records, and each list
/// made of them, hold them all), and by default also what keeps every list RPC (ListPodSandbox,
/// ListContainers, the stats lists), which carries all of one kind in one message, under the
/// kubelet's 16 MiB message limit, with room for the rest of each item. The streamed lists (the
/// Stream* handlers of the CRI server) carry them in batches of at most 2 MiB, so a node
/// configured past this still lists to a client that streams, while one that only lists gets
/// RESOURCE_EXHAUSTED from its own message limit (docs/hardening.md).
pub const DEFAULT_NODE_METADATA_BYTES: usize = 8 << 20;

/// The bytes (keys and values) of `map`.
fn map_bytes(map: &Strings) -> usize {
    map.iter().map(|(k, v)| k.len() + v.len()).sum()
}

/// Whose labels and annotations a node budget counts.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Listed {
    Pods,
    Containers,
}

/// Bytes claimed from the node budgets by creations in progress.
#[derive(Debug, Default)]
pub(super) struct Claimed {
    pub(super) pods: usize,
    pub(super) containers: usize,
}

impl Claimed {
    fn of(&mut self, of: Listed) -> &mut usize {
        match of {
            Listed::Pods => &mut self.pods,
            Listed::Containers => &mut self.containers,
        }
    }
}

/// A creation's share of a node budget, from its check until it is dropped (after the record
/// is stored, which then counts it): creations running side by side cannot all pass a check
/// that only counts what is recorded.
#[must_use = "the claim must live until the record is stored"]
pub(crate) struct MetadataClaim<'a> {
    svc: &'a PodService,
    of: Listed,
    bytes: usize,
}

impl Drop for MetadataClaim<'_> {
    fn drop(&mut self) {
        let mut claimed = self.svc.metadata_claims.lock().unwrap();
        let n = claimed.of(self.of);
        *n = n.saturating_sub(self.bytes);
    }
}

impl PodService {
    /// Refuses a new pod or container whose labels and annotations would bring those of its kind on
    /// the node (recorded, or claimed by creations in progress) past the node's budget,
    /// `daemon.node_metadata_budget` (RESOURCE_EXHAUSTED: room comes back as others are removed).
    /// Keep the claim until the record is stored.
    pub(crate) fn check_node_metadata(
        &self,
        of: Listed,
        labels: &Strings,
        annotations: &Strings,
    ) -> Result<MetadataClaim<'_>> {
        let adding = map_bytes(labels) + map_bytes(annotations);
        // Held while the recorded ones are counted, so that two checks cannot both pass on
        // the same room.
        let mut claimed = self.metadata_claims.lock().unwrap();
        let recorded: usize = match of {
            Listed::Pods => (self.store.sandboxes().iter())
                .map(|r| r.summary())
                .map(|s| map_bytes(&s.labels) + map_bytes(&s.annotations))
                .sum(),
            Listed::Containers => (self.store.containers().iter())
                .map(|r| r.summary())
                .map(|s| map_bytes(&s.labels) + map_bytes(&s.annotations))
                .sum(),
        };
        let held = recorded + *claimed.of(of);
        let budget = self.node_metadata_budget;
        if held + adding > budget {
            let what = match of {
                Listed::Pods => "pods",
                Listed::Containers => "containers",
            };
            return Err(Error::ResourceExhausted(format!(
                "its labels and annotations ({adding} bytes) would bring those of the node's \
                 {what} to {} bytes, past the node's budget of {budget} \
                 (daemon.node_metadata_budget)",
                held + adding
            )));
        }
        *claimed.of(of) += adding;
        Ok(MetadataClaim {
            svc: self,
            of,
            bytes: adding,
        })
    }
}

/// Refuses labels or annotations of `what` ("sandbox config", "container config") over
/// [`MAX_METADATA_BYTES`].
pub(crate) fn validate_labels_and_annotations(
    what: &str,
    labels: &Strings,
    annotations: &Strings,
) -> Result<()> {
    for (field, map) in [("labels", labels), ("annotations", annotations)] {
        let bytes = map_bytes(map);
        if bytes > MAX_METADATA_BYTES {
            return Err(Error::InvalidArgument(format!(
                "{what} {field} are {bytes} bytes; at most {MAX_METADATA_BYTES} are accepted"
            )));
        }
    }
    Ok(())
}

//! Which pod and container annotations reach the OCI runtime spec.
//!
//! Annotations are written by whoever writes the pod, while the OCI runtime reads some of the
//! spec's annotations as instructions: runc and crun take `run.oci.*` keys (crun's
//! `run.oci.keep_original_groups`, `run.oci.hooks.*`, ...), systemd cgroup drivers turn
//! `org.systemd.property.*` keys into unit properties, and `io.kubernetes.cri.*` keys are the
//! runtime's own statements about the container. So the pod's annotations reach the spec only
//! through an allowlist ([`AnnotationPolicy`], config key `runtime.pod_annotations`, empty by
//! default), and even an allowlisted key is dropped when it falls under one of the [`RESERVED`]
//! prefixes.
//! The CRI-level annotations are kept as they were given (ListContainers, statuses): only what
//! the runtime sees is filtered.

use std::collections::BTreeMap;
use std::collections::HashMap;

/// Prefixes that steer the OCI runtime or speak for minicri: never taken from a pod.
pub const RESERVED: &[&str] = &[
    "run.oci.",
    "org.systemd.property.",
    "io.kubernetes.cri.",
    "org.opencontainers.",
    "io.containerd.",
    "io.github.containers.",
];

/// The allowlist of pod and container annotations passed to the OCI runtime.
///
/// Each pattern is a key, or a prefix followed by `*` (`example.com/*`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AnnotationPolicy {
    patterns: Vec<String>,
}

impl AnnotationPolicy {
    /// Passes none of the pod's annotations (the default).
    pub const NONE: AnnotationPolicy = AnnotationPolicy {
        patterns: Vec::new(),
    };

    /// A policy passing the keys matching `patterns`; a pattern that could only ever match
    /// reserved keys is refused, so a configuration cannot believe it passes them.
    pub fn new(patterns: Vec<String>) -> Result<Self, String> {
        for p in &patterns {
            let stem = p.strip_suffix('*').unwrap_or(p);
            if p.is_empty() || stem.contains('*') {
                return Err(format!(
                    "runtime.pod_annotations pattern {p:?} is not a key or a prefix ending in '*'"
                ));
            }
            if let Some(r) = RESERVED.iter().find(|r| stem.starts_with(*r)) {
                return Err(format!(
                    "runtime.pod_annotations pattern {p:?} names reserved keys ({r}*): they never \
                     come from a pod"
                ));
            }
        }
        Ok(AnnotationPolicy { patterns })
    }

    /// The patterns, as configured.
    pub fn patterns(&self) -> &[String] {
        &self.patterns
    }

    /// Whether `key` passes.
    pub fn allows(&self, key: &str) -> bool {
        if RESERVED.iter().any(|r| key.starts_with(r)) {
            return false;
        }
        self.patterns.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) => key.starts_with(prefix),
            None => key == p,
        })
    }

    /// The annotations of a pod or container that go into its OCI spec, followed by the
    /// runtime's own `extra` ones.
    pub fn for_spec(
        &self,
        given: &HashMap<String, String>,
        extra: &[(&str, &str)],
    ) -> HashMap<String, String> {
        let kept: BTreeMap<&String, &String> =
            given.iter().filter(|(k, _)| self.allows(k)).collect();
        let dropped = given.len() - kept.len();
        if dropped > 0 {
            tracing::debug!(
                dropped,
                "annotations not in runtime.pod_annotations are kept out of the OCI spec"
            );
        }
        kept.into_iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .chain(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn given(keys: &[&str]) -> HashMap<String, String> {
        keys.iter()
            .map(|k| (k.to_string(), "v".to_string()))
            .collect()
    }

    #[test]
    fn nothing_passes_by_default() {
        let p = AnnotationPolicy::default();
        let out = p.for_spec(
            &given(&["a", "example.com/x", "run.oci.keep_original_groups"]),
            &[],
        );
        assert!(out.is_empty(), "{out:?}");
    }

    #[test]
    fn keys_and_prefixes_pass_reserved_never() {
        let p = AnnotationPolicy::new(vec!["a".into(), "example.com/*".into()]).unwrap();
        let out = p.for_spec(
            &given(&[
                "a",
                "ab",
                "example.com/x",
                "example.org/x",
                "run.oci.hooks.prestart",
                "org.systemd.property.ExecStartPre",
                "io.kubernetes.cri.container-type",
            ]),
            &[("io.kubernetes.cri.container-type", "container")],
        );
        let mut keys: Vec<&str> = out.keys().map(String::as_str).collect();
        keys.sort();
        assert_eq!(
            keys,
            ["a", "example.com/x", "io.kubernetes.cri.container-type"]
        );
        assert_eq!(out["io.kubernetes.cri.container-type"], "container");
    }

    #[test]
    fn patterns_naming_reserved_keys_are_refused() {
        for bad in [
            "run.oci.*",
            "run.oci.keep_original_groups",
            "org.systemd.property.X",
            "*",
            "a*b*",
            "",
        ] {
            let e = AnnotationPolicy::new(vec![bad.into()]);
            if bad == "*" {
                // "*" is a prefix of everything: allowed, and reserved keys still never pass.
                let p = e.unwrap();
                assert!(p.allows("x"));
                assert!(!p.allows("run.oci.hooks"));
            } else {
                assert!(e.is_err(), "{bad:?} accepted");
            }
        }
    }
}

//! Image references: parsing and normalisation.
//!
//! Follows the distribution reference grammar the kubelet and crictl use: a reference is
//! `[domain/]path[:tag][@digest]`; the first path component is a domain when it contains `.` or `:`,
//! is `localhost`, or has upper-case letters; otherwise the domain is `docker.io`, where one-component
//! names live under `library/`. A reference with neither tag nor digest means `:latest`.
//! So `busybox` is `docker.io/library/busybox:latest`.

use std::fmt;

use crate::digest::Digest;
use crate::error::{Result, StoreError};

/// The registry that names without a domain belong to.
pub const DEFAULT_DOMAIN: &str = "docker.io";
const LEGACY_DEFAULT_DOMAIN: &str = "index.docker.io";
const OFFICIAL_REPO_PREFIX: &str = "library/";
const MAX_NAME_LEN: usize = 255;
const MAX_TAG_LEN: usize = 128;

/// A fully qualified image reference.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Reference {
    /// Registry host, with port if any (`docker.io`, `127.0.0.1:5000`).
    pub domain: String,
    /// Repository path inside the registry (`library/busybox`).
    pub path: String,
    /// Tag; `None` only when the reference has a digest and no tag.
    pub tag: Option<String>,
    /// Manifest digest pinned by the reference.
    pub digest: Option<Digest>,
}

impl Reference {
    /// Parses and normalises `input`.
    pub fn parse(input: &str) -> Result<Reference> {
        let bad = |reason: &str| StoreError::InvalidReference {
            reference: input.to_string(),
            reason: reason.to_string(),
        };
        if input.is_empty() {
            return Err(bad("reference is empty"));
        }
        if input.trim() != input {
            return Err(bad("reference has surrounding white space"));
        }
        let (rest, digest) = match input.split_once('@') {
            Some((rest, d)) => (
                rest,
                Some(Digest::parse(d).map_err(|e| bad(&e.to_string()))?),
            ),
            None => (input, None),
        };
        // A ':' after the last '/' separates the tag; one before it belongs to a host:port.
        let (name, tag) = match rest.rfind(':') {
            Some(i) if !rest[i..].contains('/') => (&rest[..i], Some(&rest[i + 1..])),
            _ => (rest, None),
        };
        if let Some(tag) = tag {
            validate_tag(tag).map_err(|r| bad(&r))?;
        }
        if name.is_empty() {
            return Err(bad("repository name is empty"));
        }
        // Checked on the raw name first so a huge one is refused before it is copied, then on the
        // normalised one (as Docker does), which is what gets printed and parsed again.
        if name.len() > MAX_NAME_LEN {
            return Err(bad("repository name is longer than 255 characters"));
        }
        let (domain, path) = split_domain(name);
        if domain.len() + 1 + path.len() > MAX_NAME_LEN {
            return Err(bad(
                "repository name is longer than 255 characters once normalised",
            ));
        }
        validate_domain(&domain).map_err(|r| bad(&r))?;
        if path.chars().any(|c| c.is_ascii_uppercase()) {
            return Err(bad("repository name must be lowercase"));
        }
        for component in path.split('/') {
            validate_component(component).map_err(|r| bad(&r))?;
        }
        let tag = match (tag, &digest) {
            (Some(t), _) => Some(t.to_string()),
            (None, Some(_)) => None,
            (None, None) => Some("latest".to_string()),
        };
        Ok(Reference {
            domain,
            path,
            tag,
            digest,
        })
    }

    /// `domain/path` without tag or digest: the repository this reference names.
    pub fn repository(&self) -> String {
        format!("{}/{}", self.domain, self.path)
    }

    /// `domain/path:tag`, if the reference has a tag.
    pub fn tagged(&self) -> Option<String> {
        self.tag
            .as_ref()
            .map(|t| format!("{}:{t}", self.repository()))
    }

    /// `domain/path@digest` for a given manifest digest.
    pub fn with_digest(&self, digest: &Digest) -> String {
        format!("{}@{digest}", self.repository())
    }
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.repository())?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

fn split_domain(name: &str) -> (String, String) {
    let (domain, path) = match name.split_once('/') {
        Some((first, rest))
            if first.contains(['.', ':'])
                || first == "localhost"
                || first.chars().any(|c| c.is_ascii_uppercase()) =>
        {
            (first.to_string(), rest.to_string())
        }
        _ => (DEFAULT_DOMAIN.to_string(), name.to_string()),
    };
    let domain = if domain == LEGACY_DEFAULT_DOMAIN {
        DEFAULT_DOMAIN.to_string()
    } else {
        domain
    };
    let path = if domain == DEFAULT_DOMAIN && !path.contains('/') {
        format!("{OFFICIAL_REPO_PREFIX}{path}")
    } else {
        path
    };
    (domain, path)
}

fn validate_tag(tag: &str) -> std::result::Result<(), String> {
    let ok_first = tag
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
    let ok_rest = tag
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    if tag.is_empty() {
        Err("tag is empty".into())
    } else if tag.len() > MAX_TAG_LEN || !ok_first || !ok_rest {
        Err(format!(
            "tag {tag:?} is not valid (letters, digits, '_', '.', '-'; at most 128; not starting with '.' or '-')"
        ))
    } else {
        Ok(())
    }
}

fn validate_domain(domain: &str) -> std::result::Result<(), String> {
    let (host, port) = match domain.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || domain.starts_with('[') => (h, Some(p)),
        _ => (domain, None),
    };
    if let Some(port) = port
        && (port.is_empty() || !port.chars().all(|c| c.is_ascii_digit()))
    {
        return Err(format!("registry port {port:?} is not a number"));
    }
    let host_ok = if host.starts_with('[') && host.ends_with(']') {
        host[1..host.len() - 1]
            .parse::<std::net::Ipv6Addr>()
            .is_ok()
    } else {
        !host.is_empty()
            && host.split('.').all(|label| {
                !label.is_empty()
                    && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                    && !label.starts_with('-')
                    && !label.ends_with('-')
            })
    };
    if host_ok {
        Ok(())
    } else {
        Err(format!("registry host {host:?} is not valid"))
    }
}

/// A path component: lower-case alphanumerics separated by one `.`, one or two `_`, or any `-`s.
fn validate_component(c: &str) -> std::result::Result<(), String> {
    let bytes = c.as_bytes();
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    let err = || Err(format!("repository path component {c:?} is not valid"));
    if bytes.is_empty() || !alnum(bytes[0]) || !alnum(bytes[bytes.len() - 1]) {
        return err();
    }
    let mut i = 0;
    while i < bytes.len() {
        if alnum(bytes[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len() && !alnum(bytes[i]) {
            i += 1;
        }
        let sep = &c[start..i];
        let ok = sep == "." || sep == "_" || sep == "__" || sep.bytes().all(|b| b == b'-');
        if !ok {
            return err();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(s: &str) -> String {
        Reference::parse(s).unwrap().to_string()
    }

    #[test]
    fn normalises_docker_hub_names() {
        assert_eq!(norm("busybox"), "docker.io/library/busybox:latest");
        assert_eq!(
            norm("library/busybox:1.36"),
            "docker.io/library/busybox:1.36"
        );
        assert_eq!(norm("index.docker.io/foo/bar"), "docker.io/foo/bar:latest");
        assert_eq!(
            norm("docker.io/busybox"),
            "docker.io/library/busybox:latest"
        );
        assert_eq!(norm("user/app:v1"), "docker.io/user/app:v1");
    }

    #[test]
    fn keeps_hosts_ports_and_digests() {
        let d = format!("sha256:{}", "a".repeat(64));
        assert_eq!(norm("127.0.0.1:5000/x/y:t"), "127.0.0.1:5000/x/y:t");
        assert_eq!(norm("localhost/app"), "localhost/app:latest");
        assert_eq!(norm("localhost:5000/app"), "localhost:5000/app:latest");
        assert_eq!(
            norm(&format!("quay.io/a/b@{d}")),
            format!("quay.io/a/b@{d}")
        );
        assert_eq!(
            norm(&format!("busybox:1@{d}")),
            format!("docker.io/library/busybox:1@{d}")
        );
        let r = Reference::parse(&format!("registry.k8s.io/pause@{d}")).unwrap();
        assert_eq!(r.tag, None);
        assert_eq!(r.repository(), "registry.k8s.io/pause");
    }

    #[test]
    fn rejects_bad_references() {
        for bad in [
            "",
            "Busybox",
            "busybox:",
            "busybox:-x",
            "busybox@sha256:abc",
            "a//b",
            "a/b/",
            "bad host:5000/x",
            "host:port/x",
            " busybox",
            "busybox@md5:0123",
            &format!("x:{}", "t".repeat(129)),
        ] {
            assert!(Reference::parse(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn the_name_limit_counts_the_normalised_name() {
        // Found by the `reference` fuzz target: 250 characters pass the raw check, but
        // `docker.io/library/` makes the printed name 268, which would not parse again.
        let long = "a".repeat(250);
        let err = Reference::parse(&long).unwrap_err();
        assert!(err.to_string().contains("once normalised"), "{err}");
        // At the limit the name round-trips.
        let fits = "a".repeat(255 - "docker.io/library/".len());
        let r = Reference::parse(&fits).unwrap();
        assert_eq!(Reference::parse(&r.to_string()).unwrap(), r);
    }

    #[test]
    fn accepts_separators_in_paths() {
        for ok in ["a.b/c_d", "a-b/c__d", "a---b", "ab.cd/ef-gh/ij"] {
            Reference::parse(ok).unwrap();
        }
        for bad in ["a..b", "a___b", "-ab", "ab_"] {
            assert!(Reference::parse(bad).is_err(), "{bad:?}");
        }
    }
}

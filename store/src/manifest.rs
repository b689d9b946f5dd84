//! The parts of OCI and Docker schema-2 manifests, indexes and image configs that a pull needs.
//!
//! Docker's media types are accepted alongside OCI's; Docker schema 1 is refused by name.

use serde::Deserialize;

/// A content descriptor.
#[derive(Debug, Clone, Deserialize)]
pub struct Descriptor {
    #[serde(rename = "mediaType", default)]
    pub media_type: String,
    pub digest: String,
    pub size: i64,
    #[serde(default)]
    pub platform: Option<Platform>,
}

/// The platform an index entry is for.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct Platform {
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub os: String,
    #[serde(default)]
    pub variant: Option<String>,
}

impl Platform {
    /// Parses `os/arch[/variant]`.
    pub fn parse(s: &str) -> Option<Platform> {
        let mut it = s.split('/');
        let os = it.next().filter(|x| !x.is_empty())?.to_string();
        let architecture = it.next().filter(|x| !x.is_empty())?.to_string();
        let variant = it.next().map(str::to_string);
        if it.next().is_some() {
            return None;
        }
        Some(Platform {
            architecture,
            os,
            variant,
        })
    }

    /// Whether an index entry for `other` can run here. Without a wanted variant any variant does.
    pub fn matches(&self, other: &Platform) -> bool {
        self.os == other.os
            && self.architecture == other.architecture
            && match (&self.variant, &other.variant) {
                (Some(want), Some(have)) => want == have,
                (Some(want), None) => self.architecture == "arm64" && want == "v8",
                (None, _) => true,
            }
    }
}

impl std::fmt::Display for Platform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)?;
        if let Some(v) = &self.variant {
            write!(f, "/{v}")?;
        }
        Ok(())
    }
}

/// A manifest or index document.
#[derive(Debug, Deserialize)]
pub struct ManifestDoc {
    #[serde(rename = "schemaVersion", default)]
    pub schema_version: Option<i64>,
    #[serde(rename = "mediaType", default)]
    pub media_type: Option<String>,
    #[serde(default)]
    pub config: Option<Descriptor>,
    #[serde(default)]
    pub layers: Option<Vec<Descriptor>>,
    #[serde(default)]
    pub manifests: Option<Vec<Descriptor>>,
}

pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";

/// How a layer's bytes are compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

/// The compression of a layer media type, or `None` if it is not a layer type minicri can unpack.
pub fn layer_compression(media_type: &str) -> Option<Compression> {
    match media_type {
        "application/vnd.oci.image.layer.v1.tar"
        | "application/vnd.oci.image.layer.nondistributable.v1.tar"
        | "application/vnd.docker.image.rootfs.diff.tar" => Some(Compression::None),
        "application/vnd.oci.image.layer.v1.tar+gzip"
        | "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
        | "application/vnd.docker.image.rootfs.diff.tar.gzip"
        | "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip" => Some(Compression::Gzip),
        "application/vnd.oci.image.layer.v1.tar+zstd"
        | "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd" => Some(Compression::Zstd),
        _ => None,
    }
}

/// The image config fields minicri uses.
#[derive(Debug, Deserialize, Default)]
pub struct ImageConfigDoc {
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub os: String,
    #[serde(default)]
    pub variant: Option<String>,
    #[serde(default)]
    pub config: Option<RunConfig>,
    #[serde(default)]
    pub rootfs: Option<RootFs>,
}

#[derive(Debug, Deserialize, Default)]
pub struct RunConfig {
    #[serde(rename = "User", default)]
    pub user: Option<String>,
}

#[derive(Debug, Deserialize, Default)]
pub struct RootFs {
    #[serde(default)]
    pub diff_ids: Vec<String>,
}

/// The largest uid or gid a process can have: `(uid_t)-1`, 4294967295, is "no id" to the kernel,
/// and setuid and setgid refuse it.
pub const MAX_ID: u32 = u32::MAX - 1;

/// A uid or gid written as a number, 0 to [`MAX_ID`].
pub fn parse_id(s: &str) -> Option<u32> {
    s.parse::<u32>().ok().filter(|n| *n <= MAX_ID)
}

/// `(uid, username)` from a config `User` (`uid`, `name`, `uid:gid`, `name:group`): a uid
/// ([`parse_id`]: what the container can run as) gives a uid, anything else a username, an empty
/// one neither. A number out of range is no uid: the kubelet's runAsNonRoot check reads this, and
/// CreateContainer refuses such a user.
pub fn user_of(user: &str) -> (Option<i64>, String) {
    let u = user.split(':').next().unwrap_or("");
    if u.is_empty() {
        (None, String::new())
    } else if let Some(n) = parse_id(u) {
        (Some(i64::from(n)), String::new())
    } else {
        (None, u.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users() {
        assert_eq!(user_of(""), (None, String::new()));
        assert_eq!(user_of("1002"), (Some(1002), String::new()));
        assert_eq!(user_of("1002:100"), (Some(1002), String::new()));
        assert_eq!(user_of("www-data"), (None, "www-data".into()));
        assert_eq!(user_of("www-data:www"), (None, "www-data".into()));
        // Out of a uid's range: no uid to show as non-root.
        assert_eq!(user_of("4294967294"), (Some(4294967294), String::new()));
        assert_eq!(user_of("4294967295"), (None, "4294967295".into()));
        assert_eq!(user_of("4294967296"), (None, "4294967296".into()));
        assert_eq!(user_of("-1"), (None, "-1".into()));
    }

    #[test]
    fn platforms() {
        let want = Platform::parse("linux/amd64").unwrap();
        assert!(want.matches(&Platform::parse("linux/amd64").unwrap()));
        assert!(!want.matches(&Platform::parse("linux/arm64").unwrap()));
        let arm = Platform::parse("linux/arm64/v8").unwrap();
        assert!(arm.matches(&Platform::parse("linux/arm64").unwrap()));
        assert!(
            !Platform::parse("linux/arm/v7")
                .unwrap()
                .matches(&Platform::parse("linux/arm/v6").unwrap())
        );
        assert!(Platform::parse("linux").is_none());
    }
}

//! Owns the test images: a builder that makes image filesystems from busybox-static as tar
//! layers (gzip, zstd or uncompressed), OCI and Docker schema 2 configs and manifests, OCI image
//! indexes and Docker manifest lists, and pushes them over the registry HTTP API
//! ([`RegistryClient`]). Also the documented standard set of images every pull test can rely on
//! ([`push_standard_set`]) and file-backed layers of random bytes for large-pull tests
//! ([`random_layer`]).
//!
//! Layers are built in [`layer`], images and indexes in [`image`], pushed by [`client`]; the
//! standard set is in [`standard`]; this module re-exports them all.
//!
//! Everything is reproducible: tar entries have fixed owners and mtimes, gzip has no timestamp,
//! configs have a fixed `created`, so building the same image twice gives the same digests.
//!
//! ```no_run
//! # async fn example(addr: &str) -> anyhow::Result<()> {
//! use minicri_tests::images::*;
//! let client = RegistryClient::new(addr);
//! let pushed = ImageBuilder::busybox()
//!     .layer(LayerBuilder::new().file("etc/motd", "hello\n", 0o644).build(Compression::Zstd)?)
//!     .user("1000")
//!     .format(Format::Oci)
//!     .push(&client, "my/test:tag")
//!     .await?;
//! assert_eq!(pushed.layers.len(), 2);
//! # Ok(()) }
//! ```

pub mod client;
pub mod image;
pub mod layer;
pub mod standard;

pub use client::*;
pub use image::*;
pub use layer::*;
pub use standard::*;

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::File;
use std::io::{self, BufWriter, Read, Write};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use anyhow::{Context, Result, anyhow, bail, ensure};
use bytes::Bytes;
use rand::{RngCore, SeedableRng, rngs::StdRng};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// OCI image manifest.
pub const MEDIA_OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// OCI image index.
pub const MEDIA_OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
/// OCI image config.
pub const MEDIA_OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
/// OCI layer, uncompressed tar.
pub const MEDIA_OCI_LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
/// OCI layer, gzip-compressed tar.
pub const MEDIA_OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// OCI layer, zstd-compressed tar.
pub const MEDIA_OCI_LAYER_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
/// Docker image manifest, schema 2.
pub const MEDIA_DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
/// Docker manifest list.
pub const MEDIA_DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
/// Docker image config.
pub const MEDIA_DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
/// Docker layer, gzip-compressed tar.
pub const MEDIA_DOCKER_LAYER_GZIP: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
/// Docker layer, uncompressed tar.
pub const MEDIA_DOCKER_LAYER_TAR: &str = "application/vnd.docker.image.rootfs.diff.tar";

/// Every manifest media type, for `Accept` headers.
pub const MANIFEST_MEDIA_TYPES: [&str; 4] = [
    MEDIA_OCI_MANIFEST,
    MEDIA_OCI_INDEX,
    MEDIA_DOCKER_MANIFEST,
    MEDIA_DOCKER_LIST,
];

/// The busybox-static binary the images are made from.
pub const BUSYBOX_BIN: &str = "/bin/busybox";
/// The `created` time of every config and history entry.
pub const CREATED: &str = "2024-01-01T00:00:00Z";
/// The mtime of every tar entry (2024-01-01T00:00:00Z).
pub const MTIME: u64 = 1_704_067_200;
/// `PATH` in every image's `Env` unless changed.
pub const DEFAULT_PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// `/etc/passwd` of the busybox rootfs.
pub const ETC_PASSWD: &str = "root:x:0:0:root:/root:/bin/sh
daemon:x:1:1:daemon:/usr/sbin:/bin/false
minicri:x:1000:1000:minicri test user:/home/minicri:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
";
/// `/etc/group` of the busybox rootfs: user `minicri` (1000) is also in group `extra` (1001).
pub const ETC_GROUP: &str = "root:x:0:
daemon:x:1:
wheel:x:10:root
minicri:x:1000:
extra:x:1001:minicri
nogroup:x:65534:
";

/// `sha256:<hex>` of some bytes.
pub fn sha256_digest(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(data)))
}

/// How a layer's tar is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Compression {
    Gzip,
    Zstd,
    /// Uncompressed tar.
    None,
}

impl Compression {
    /// The layer media type for this compression in the given manifest format. Docker schema 2
    /// has no zstd type, so zstd layers use the OCI one there (as Docker's own tools do).
    pub fn media_type(self, format: Format) -> &'static str {
        match (format, self) {
            (Format::Oci, Compression::Gzip) => MEDIA_OCI_LAYER_GZIP,
            (Format::Oci, Compression::None) => MEDIA_OCI_LAYER_TAR,
            (_, Compression::Zstd) => MEDIA_OCI_LAYER_ZSTD,
            (Format::Docker, Compression::Gzip) => MEDIA_DOCKER_LAYER_GZIP,
            (Format::Docker, Compression::None) => MEDIA_DOCKER_LAYER_TAR,
        }
    }
}

impl std::str::FromStr for Compression {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "gzip" | "gz" => Ok(Compression::Gzip),
            "zstd" | "zst" => Ok(Compression::Zstd),
            "none" | "tar" | "plain" => Ok(Compression::None),
            _ => bail!("unknown compression {s:?} (gzip, zstd, none)"),
        }
    }
}

/// Manifest format family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// OCI image manifest / OCI image index.
    Oci,
    /// Docker schema 2 manifest / Docker manifest list.
    Docker,
}

impl Format {
    /// The media type of a single-image manifest.
    pub fn manifest_media_type(self) -> &'static str {
        match self {
            Format::Oci => MEDIA_OCI_MANIFEST,
            Format::Docker => MEDIA_DOCKER_MANIFEST,
        }
    }
    /// The media type of a multi-platform manifest.
    pub fn index_media_type(self) -> &'static str {
        match self {
            Format::Oci => MEDIA_OCI_INDEX,
            Format::Docker => MEDIA_DOCKER_LIST,
        }
    }
    /// The media type of the config blob.
    pub fn config_media_type(self) -> &'static str {
        match self {
            Format::Oci => MEDIA_OCI_CONFIG,
            Format::Docker => MEDIA_DOCKER_CONFIG,
        }
    }
}

/// An image platform.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Platform {
    pub os: String,
    pub architecture: String,
    pub variant: Option<String>,
}

impl Platform {
    pub fn linux_amd64() -> Platform {
        Platform {
            os: "linux".into(),
            architecture: "amd64".into(),
            variant: None,
        }
    }
    /// linux/arm64/v8.
    pub fn linux_arm64() -> Platform {
        Platform {
            os: "linux".into(),
            architecture: "arm64".into(),
            variant: Some("v8".into()),
        }
    }
    fn to_json(&self) -> Value {
        let mut v = json!({ "architecture": self.architecture, "os": self.os });
        if let Some(variant) = &self.variant {
            v["variant"] = json!(variant);
        }
        v
    }
}

impl fmt::Display for Platform {
    /// `os/arch` or `os/arch/variant`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.os, self.architecture)?;
        if let Some(variant) = &self.variant {
            write!(f, "/{variant}")?;
        }
        Ok(())
    }
}

//! Content digests (`sha256:<64 hex>`), the only algorithm minicri stores content under.

use std::fmt;
use std::str::FromStr;

use sha2::{Digest as _, Sha256};

use crate::error::{Result, StoreError};

/// A validated `sha256:<hex>` digest.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(String);

impl Digest {
    /// Parses `sha256:<64 lower-case hex>`; other algorithms are rejected by name.
    pub fn parse(s: &str) -> Result<Digest> {
        let bad = |reason: &str| StoreError::InvalidDigest {
            digest: s.to_string(),
            reason: reason.into(),
        };
        let (algo, hex) = s
            .split_once(':')
            .ok_or_else(|| bad("expected <algorithm>:<hex>"))?;
        if algo != "sha256" {
            return Err(bad("only sha256 digests are supported"));
        }
        if !minicri_snapshotter::is_sha256_hex(hex) {
            return Err(bad("a sha256 digest has 64 lower-case hex characters"));
        }
        Ok(Digest(s.to_string()))
    }

    /// The digest of `data`.
    pub fn of(data: &[u8]) -> Digest {
        Digest(format!("sha256:{}", hex::encode(Sha256::digest(data))))
    }

    /// Builds a digest from a finished hasher.
    pub fn from_hasher(h: Sha256) -> Digest {
        Digest(format!("sha256:{}", hex::encode(h.finalize())))
    }

    /// The hex part, used as a file name.
    pub fn hex(&self) -> &str {
        &self.0[7..]
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for Digest {
    type Err = StoreError;
    fn from_str(s: &str) -> Result<Self> {
        Digest::parse(s)
    }
}

impl serde::Serialize for Digest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> serde::Deserialize<'de> for Digest {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Digest::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_hashes() {
        let d = Digest::of(b"");
        assert_eq!(
            d.as_str(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(Digest::parse(d.as_str()).unwrap(), d);
        assert_eq!(d.hex().len(), 64);
        assert!(
            Digest::parse(
                "sha256:E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855"
            )
            .is_err()
        );
        assert!(Digest::parse("sha512:00").is_err());
        assert!(Digest::parse("e3b0").is_err());
    }
}

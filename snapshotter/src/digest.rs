//! Layer identities: diff_id validation, chain ids, and the hashing reader that checks a diff_id while
//! the layer streams through.
//!
//! OCI image spec (config.md, "Layer ChainID"): `ChainID(L0) = DiffID(L0)` and
//! `ChainID(Ln) = SHA256(ChainID(Ln-1) + " " + DiffID(Ln))`, where the digests are the `sha256:<hex>`
//! strings. Committed snapshots are keyed by chain id, so a layer stack two images share is one snapshot.

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// Checks that `digest` is `sha256:` followed by 64 lowercase hex digits (the only algorithm layer
/// diff_ids use in practice).
pub fn validate_digest(digest: &str) -> Result<()> {
    let hex = digest
        .strip_prefix("sha256:")
        .ok_or_else(|| Error::InvalidArgument(format!("digest {digest:?} is not sha256:<hex>")))?;
    if !is_sha256_hex(hex) {
        return Err(Error::InvalidArgument(format!(
            "digest {digest:?} does not have 64 lowercase hex digits"
        )));
    }
    Ok(())
}

/// Whether `hex` is what follows `sha256:` in a digest: 64 lowercase hex digits. The one check
/// of it, for layer diff_ids here and content digests in the store.
pub fn is_sha256_hex(hex: &str) -> bool {
    hex.len() == 64
        && hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The chain id of a layer whose diff_id is `diff_id`, stacked on the chain `parent` (None for the
/// bottom layer).
pub fn chain_id(parent: Option<&str>, diff_id: &str) -> String {
    match parent {
        None => diff_id.to_string(),
        Some(parent) => {
            let mut h = Sha256::new();
            h.update(parent.as_bytes());
            h.update(b" ");
            h.update(diff_id.as_bytes());
            format!("sha256:{}", hex::encode(h.finalize()))
        }
    }
}

/// The chain ids of every prefix of `diff_ids` (bottom layer first), as an image config's
/// `rootfs.diff_ids` lists them.
pub fn chain_ids<S: AsRef<str>>(diff_ids: &[S]) -> Vec<String> {
    let mut out: Vec<String> = Vec::with_capacity(diff_ids.len());
    for d in diff_ids {
        let next = chain_id(out.last().map(String::as_str), d.as_ref());
        out.push(next);
    }
    out
}

/// The digest and length of a stream hashed as it passes, a piece at a time.
#[derive(Default)]
pub(crate) struct StreamHash {
    hasher: Sha256,
    count: u64,
}

impl StreamHash {
    pub(crate) fn update(&mut self, bytes: &[u8]) {
        self.hasher.update(bytes);
        self.count += bytes.len() as u64;
    }

    /// `sha256:<hex>` of everything hashed, and how many bytes that was.
    pub(crate) fn finish(self) -> (String, u64) {
        (
            format!("sha256:{}", hex::encode(self.hasher.finalize())),
            self.count,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D1: &str = "sha256:a3ed95caeb02ffe68cdd9fd84406680ae93d633cb16422d00e8a7c22955b46d4";
    const D2: &str = "sha256:e7d92cdc71feacf90708cb59182d0df1b911f8ae022d29e8e95d75ca6a99776a";

    #[test]
    fn chain_of_one_is_the_diff_id() {
        assert_eq!(chain_id(None, D1), D1);
        assert_eq!(chain_ids(&[D1]), vec![D1.to_string()]);
    }

    #[test]
    fn chain_hashes_the_digest_strings() {
        // Computed independently: printf '%s %s' "$D1" "$D2" | sha256sum
        let want = "sha256:ab21c25fe1f468226293efcc66c1f86671e363411ff97a3fad8dd75b4d807b29";
        assert_eq!(chain_id(Some(D1), D2), want);
        assert_eq!(chain_ids(&[D1, D2]), vec![D1.to_string(), want.to_string()]);
    }

    #[test]
    fn digest_validation() {
        assert!(validate_digest(D1).is_ok());
        assert!(validate_digest("sha512:00").is_err());
        assert!(validate_digest(&D1.to_uppercase().replace("SHA256", "sha256")).is_err());
        assert!(validate_digest("sha256:abc").is_err());
    }

    #[test]
    fn stream_hash_counts_and_hashes_across_pieces() {
        let mut h = StreamHash::default();
        h.update(b"he");
        h.update(b"");
        h.update(b"llo");
        let (d, n) = h.finish();
        assert_eq!(n, 5);
        assert_eq!(
            d,
            "sha256:2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824"
        );
    }
}

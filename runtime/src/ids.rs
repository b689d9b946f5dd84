//! Random identifiers from the kernel's random source: sandbox and container ids (64 hex digits,
//! the format the kubelet and crictl expect), streaming tokens and journal names.

use std::io::Read;

use crate::error::{Error, Result};

/// `2 * N` lowercase hex digits of `N` random bytes (URL- and path-safe).
pub fn random_hex<const N: usize>() -> Result<String> {
    let mut b = [0u8; N];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| Error::Internal(format!("reading /dev/urandom: {e}")))?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// A sandbox or container id: 64 hex digits.
pub fn object_id() -> Result<String> {
    random_hex::<32>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_hex_of_the_asked_length_and_differ() {
        let (a, b) = (object_id().unwrap(), object_id().unwrap());
        assert_eq!(a.len(), 64);
        assert!(
            a.bytes()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
        );
        assert_ne!(a, b);
        assert_eq!(random_hex::<16>().unwrap().len(), 32);
    }
}

//! The parts of an OCI image config (`application/vnd.oci.image.config.v1+json`, Docker's
//! `container.config` is the same shape) that decide how a container runs.
//!
//! Absent and `null` fields read as empty: an image may leave any of them out.

use std::collections::HashMap;

use serde::{Deserialize, Deserializer};

use crate::oci::error::{OciError, Result};

/// `config` of an image config document.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ImageConfig {
    /// `user`, `uid`, `user:group` or `uid:gid`; empty means root.
    #[serde(default, deserialize_with = "null_default")]
    pub user: String,
    /// `KEY=value` entries.
    #[serde(default, deserialize_with = "null_default")]
    pub env: Vec<String>,
    #[serde(default, deserialize_with = "null_default")]
    pub entrypoint: Vec<String>,
    #[serde(default, deserialize_with = "null_default")]
    pub cmd: Vec<String>,
    #[serde(default, deserialize_with = "null_default")]
    pub working_dir: String,
    /// E.g. `SIGQUIT` or `3`; empty means SIGTERM.
    #[serde(default, deserialize_with = "null_default")]
    pub stop_signal: String,
    #[serde(default, deserialize_with = "null_default")]
    pub labels: HashMap<String, String>,
}

fn null_default<'de, D: Deserializer<'de>, T: Default + Deserialize<'de>>(
    d: D,
) -> std::result::Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

#[derive(Deserialize)]
struct Document {
    #[serde(default, deserialize_with = "null_default")]
    config: ImageConfig,
}

impl ImageConfig {
    /// Parses a whole image config document (the blob the manifest's `config` points to).
    pub fn from_document(json: &[u8]) -> Result<Self> {
        let doc: Document = serde_json::from_slice(json)
            .map_err(|e| OciError::invalid(format!("image config: {e}")))?;
        Ok(doc.config)
    }

    /// The stop signal as a number (SIGTERM when unset); `None` when it names no signal.
    pub fn stop_signal_number(&self) -> Option<i32> {
        parse_signal(&self.stop_signal)
    }
}

/// Parses `SIGTERM`, `TERM`, `term` or `15` (`""` is SIGTERM).
pub fn parse_signal(s: &str) -> Option<i32> {
    let s = s.trim();
    if s.is_empty() {
        return Some(nix::sys::signal::SIGTERM as i32);
    }
    if let Ok(n) = s.parse::<i32>() {
        return nix::sys::signal::Signal::try_from(n)
            .ok()
            .map(|sig| sig as i32);
    }
    let upper = s.to_ascii_uppercase();
    let name = if upper.starts_with("SIG") {
        upper
    } else {
        format!("SIG{upper}")
    };
    name.parse::<nix::sys::signal::Signal>()
        .ok()
        .map(|sig| sig as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_docker_and_oci_configs() {
        let c = ImageConfig::from_document(
            br#"{"architecture":"amd64","os":"linux","config":{"User":"nginx:web","Env":["PATH=/bin","A=b=c"],
                "Entrypoint":null,"Cmd":["sh"],"WorkingDir":"/srv","StopSignal":"SIGQUIT","Labels":null},
                "rootfs":{"type":"layers","diff_ids":[]}}"#,
        )
        .unwrap();
        assert_eq!(c.user, "nginx:web");
        assert_eq!(c.env, ["PATH=/bin", "A=b=c"]);
        assert!(c.entrypoint.is_empty());
        assert_eq!(c.cmd, ["sh"]);
        assert_eq!(c.working_dir, "/srv");
        assert_eq!(c.stop_signal_number(), Some(3));
        let empty = ImageConfig::from_document(br#"{"architecture":"amd64"}"#).unwrap();
        assert_eq!(empty, ImageConfig::default());
        assert!(ImageConfig::from_document(b"[").is_err());
    }

    #[test]
    fn signals() {
        assert_eq!(parse_signal(""), Some(15));
        assert_eq!(parse_signal("KILL"), Some(9));
        assert_eq!(parse_signal("sigusr1"), Some(10));
        assert_eq!(parse_signal("2"), Some(2));
        assert_eq!(parse_signal("SIGNOPE"), None);
        assert_eq!(parse_signal("99"), None);
    }
}

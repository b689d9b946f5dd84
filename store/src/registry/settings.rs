//! The `[registry]` section of the daemon's configuration: where registry hosts are configured
//! and how long one request may take. Each field is a key of the section and a flag of
//! `minicri serve`; its default is in [`Default`] only.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use serde::{Deserialize, Serialize};

use super::{REQUEST_DEADLINE, Registry};
use crate::hosts::RegistryHosts;

/// `[registry]`: registry hosts and requests.
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[command(next_help_heading = "[registry]")]
pub struct RegistrySettings {
    /// Registry hosts configuration, containerd's hosts.toml directory format:
    /// <DIR>/<registry-host>/hosts.toml.
    #[arg(long = "registry-config-dir", value_name = "DIR")]
    pub config_dir: PathBuf,

    /// Seconds one manifest request may take in total, its body and the token request a 401
    /// leads to included (a blob request: until its response headers, its token request
    /// included).
    #[arg(long = "registry-request-timeout", value_name = "SECONDS")]
    pub request_timeout: f64,
}

impl Default for RegistrySettings {
    fn default() -> Self {
        RegistrySettings {
            config_dir: "/etc/minicri/certs.d".into(),
            request_timeout: REQUEST_DEADLINE.as_secs_f64(),
        }
    }
}

impl RegistrySettings {
    /// Checks every value; the error names the key (`registry.KEY`).
    pub fn validate(&self) -> Result<(), String> {
        self.request_timeout().map(|_| ())
    }

    /// The total deadline of one request.
    pub fn request_timeout(&self) -> Result<Duration, String> {
        match crate::settings::seconds_or_off("registry.request_timeout", self.request_timeout)? {
            Some(d) => Ok(d),
            None => Err("registry.request_timeout must be more than 0".into()),
        }
    }

    /// The registry client these settings configure.
    pub fn registry(&self) -> Result<Registry, String> {
        Ok(
            Registry::new(RegistryHosts::new(Some(self.config_dir.clone())))
                .with_request_deadline(self.request_timeout()?),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_timeout_is_seconds_and_more_than_0() {
        let s = RegistrySettings::default();
        assert_eq!(s.request_timeout().unwrap(), Duration::from_secs(60));
        let with = |t: f64| RegistrySettings {
            request_timeout: t,
            ..Default::default()
        };
        assert_eq!(with(2.5).request_timeout().unwrap().as_millis(), 2500);
        for bad in [0.0, -1.0, f64::INFINITY] {
            let err = with(bad).validate().unwrap_err();
            assert!(err.contains("registry.request_timeout"), "{err}");
        }
    }
}

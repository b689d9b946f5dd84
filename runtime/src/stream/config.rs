//! The `[stream]` section of the daemon's configuration: where the streaming server (exec,
//! attach, port-forward) listens, what its port-forwards may buffer and how long their bytes
//! may wait for a peer that does not read. Each field is a key of the section and a flag of
//! `minicri serve`; its default is in [`Default`] only.

use std::net::SocketAddr;
use std::time::Duration;

use minicri_store::settings::seconds_or_off;

use clap::Args;
use serde::{Deserialize, Serialize};

/// The default of `stream.port_forward_buffer_bytes`.
pub const DEFAULT_PORT_FORWARD_BUFFER_BYTES: u64 = 64 << 20;
/// The least `stream.port_forward_buffer_bytes` taken: a SPDY DATA frame of up to 1 MiB is charged
/// whole before it is read, so the total must hold one with room for the other direction.
pub const MIN_PORT_FORWARD_BUFFER_BYTES: u64 = 2 << 20;
/// The key of the stall timeout, as the messages of stalled port-forwards name it.
pub const PORT_FORWARD_STALL_KEY: &str = "stream.port_forward_stall_timeout";

/// `[stream]`: the streaming server.
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[command(next_help_heading = "[stream]")]
pub struct StreamSettings {
    /// Loopback address of the streaming server (exec, attach, port-forward), IP:PORT; port 0
    /// picks a free port.
    #[arg(long = "stream-address", value_name = "ADDR")]
    pub address: SocketAddr,

    /// Bytes the node's port-forward sessions may hold buffered together, both ways (what
    /// clients send before the pod reads it, what pods send before the client reads it): past
    /// it, forwards wait until bytes are delivered. At least 2097152 (2 MiB).
    #[arg(long, value_name = "BYTES")]
    pub port_forward_buffer_bytes: u64,

    /// Seconds a port-forward's bytes may wait for a peer that does not read them: a client
    /// that has taken no frame of its session in that time has its session closed, a pod that
    /// has taken no byte of a forwarded connection has that connection closed, so neither holds
    /// its part of stream.port_forward_buffer_bytes for longer (0: never).
    #[arg(long, value_name = "SECONDS")]
    pub port_forward_stall_timeout: f64,
}

impl Default for StreamSettings {
    fn default() -> Self {
        StreamSettings {
            address: SocketAddr::from(([127, 0, 0, 1], 0)),
            port_forward_buffer_bytes: DEFAULT_PORT_FORWARD_BUFFER_BYTES,
            port_forward_stall_timeout: 60.0,
        }
    }
}

impl StreamSettings {
    /// Checks every value; the error names the key (`stream.KEY`).
    pub fn validate(&self) -> Result<(), String> {
        if !self.address.ip().is_loopback() {
            return Err(format!(
                "stream.address {} is not a loopback address: the streaming server (exec, \
                 attach, port-forward) is only served on loopback (127.0.0.1 or ::1)",
                self.address
            ));
        }
        if self.port_forward_buffer_bytes < MIN_PORT_FORWARD_BUFFER_BYTES {
            return Err(format!(
                "stream.port_forward_buffer_bytes must be at least \
                 {MIN_PORT_FORWARD_BUFFER_BYTES} (2 MiB)"
            ));
        }
        self.port_forward_stall()?;
        Ok(())
    }

    /// `stream.port_forward_stall_timeout` (`None`: off).
    pub fn port_forward_stall(&self) -> Result<Option<Duration>, String> {
        seconds_or_off(PORT_FORWARD_STALL_KEY, self.port_forward_stall_timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_address_is_loopback_with_a_free_port_by_default() {
        let with = |a: &str| {
            StreamSettings {
                address: a.parse().unwrap(),
                ..Default::default()
            }
            .validate()
        };
        assert_eq!(
            StreamSettings::default().address,
            "127.0.0.1:0".parse().unwrap()
        );
        assert!(with("127.0.0.1:10010").is_ok());
        assert!(with("[::1]:0").is_ok());
        for bad in ["0.0.0.0:10010", "10.1.2.3:10010"] {
            let err = with(bad).unwrap_err();
            assert!(
                err.contains("stream.address") && err.contains("loopback"),
                "{err}"
            );
        }
    }

    #[test]
    fn port_forward_buffer_defaults_to_64_mib_and_holds_a_frame_at_least() {
        let with = |n: u64| {
            StreamSettings {
                port_forward_buffer_bytes: n,
                ..Default::default()
            }
            .validate()
        };
        assert_eq!(
            StreamSettings::default().port_forward_buffer_bytes,
            64 << 20
        );
        assert!(with(2 << 20).is_ok());
        let err = with((2 << 20) - 1).unwrap_err();
        assert!(err.contains("stream.port_forward_buffer_bytes"), "{err}");
    }

    #[test]
    fn port_forward_stall_timeout_is_a_minute_by_default_and_zero_turns_it_off() {
        let with = |t: f64| StreamSettings {
            port_forward_stall_timeout: t,
            ..Default::default()
        };
        assert_eq!(
            StreamSettings::default().port_forward_stall(),
            Ok(Some(Duration::from_secs(60)))
        );
        assert_eq!(
            with(2.5).port_forward_stall(),
            Ok(Some(Duration::from_millis(2500)))
        );
        assert_eq!(with(0.0).port_forward_stall(), Ok(None));
        for bad in [-1.0, f64::NAN, 1e10] {
            let err = with(bad).validate().unwrap_err();
            assert!(err.contains(PORT_FORWARD_STALL_KEY), "{bad}: {err}");
        }
    }
}

//! systemd's readiness protocol (`sd_notify`), for a unit with `Type=notify`: systemd passes a
//! datagram socket in `NOTIFY_SOCKET`; the daemon sends `READY=1` once the CRI socket accepts
//! calls and `STOPPING=1` when it begins to shut down. Without the variable nothing is sent.
//!
//! [`Notifier::from_env`] takes the variable out of the environment at start, before any thread
//! runs: the processes the daemon starts (shims, runc) must not inherit it (runc would pass a
//! notify socket of its own into the container).

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// Where readiness goes (`None`: nowhere).
#[derive(Debug, Clone, Default)]
pub struct Notifier {
    address: Option<String>,
}

impl Notifier {
    /// Takes `NOTIFY_SOCKET` out of the environment. Call it before any thread is started.
    pub fn from_env() -> Notifier {
        let address = std::env::var("NOTIFY_SOCKET")
            .ok()
            .filter(|a| !a.is_empty());
        if address.is_some() {
            // SAFETY: called from `main` before the async runtime or any other thread exists.
            unsafe { std::env::remove_var("NOTIFY_SOCKET") };
        }
        Notifier { address }
    }

    /// Sends `state` (e.g. `READY=1`); a failure is logged, not fatal (the unit's own timeout
    /// then tells).
    pub fn notify(&self, state: &str) {
        let Some(address) = &self.address else {
            return;
        };
        let sent = (|| {
            let addr = match address.strip_prefix('@') {
                Some(name) => SocketAddr::from_abstract_name(name.as_bytes())?,
                None => SocketAddr::from_pathname(address)?,
            };
            UnixDatagram::unbound()?.send_to_addr(state.as_bytes(), &addr)
        })();
        if let Err(e) = sent {
            tracing::warn!(socket = %address, state, error = %e, "systemd notification failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn received(sock: &UnixDatagram) -> String {
        sock.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let mut buf = [0u8; 64];
        let n = sock.recv(&mut buf).unwrap();
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }

    #[test]
    fn notifies_a_path_and_an_abstract_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let sock = UnixDatagram::bind(&path).unwrap();
        let n = Notifier {
            address: Some(path.to_str().unwrap().to_string()),
        };
        n.notify("READY=1");
        assert_eq!(received(&sock), "READY=1");

        let name = format!("minicri-test-{}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let sock = UnixDatagram::bind_addr(&addr).unwrap();
        let n = Notifier {
            address: Some(format!("@{name}")),
        };
        n.notify("STOPPING=1");
        assert_eq!(received(&sock), "STOPPING=1");

        // Without a socket, or with one nobody listens on, nothing fails.
        Notifier::default().notify("READY=1");
        Notifier {
            address: Some(dir.path().join("gone").to_str().unwrap().into()),
        }
        .notify("READY=1");
    }
}

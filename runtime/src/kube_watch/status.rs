//! Owns whether the watch is connected and synced, since when, and its last error: what the
//! pull policy asks before holding a call past its window, what verbose `Status` shows under
//! `kubeWatch`, and what the metrics report. Transitions are logged here, once each.
//!
//! - **connected**: the last list or watch request to the API server was answered, and nothing
//!   failed since;
//! - **synced**: connected, and the pod cache holds every pod of the node as of the watch's
//!   position (a complete list was applied, and the watch resumes from it).

use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use chrono::{DateTime, Utc};
use tracing::{info, warn};

/// Where the watch is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// `daemon.kube_watch = "off"`.
    Off,
    /// No kubeconfig found yet.
    Searching,
    /// Credentials being loaded, or the first request under way.
    Connecting,
    Connected,
    /// The last request failed; retried after a back-off.
    Disconnected,
    /// The daemon is shutting down.
    Stopped,
}

impl Phase {
    fn as_str(self) -> &'static str {
        match self {
            Phase::Off => "off",
            Phase::Searching => "searching",
            Phase::Connecting => "connecting",
            Phase::Connected => "connected",
            Phase::Disconnected => "disconnected",
            Phase::Stopped => "stopped",
        }
    }
}

#[derive(Debug)]
struct Inner {
    phase: Phase,
    synced: bool,
    /// When `phase` or `synced` last changed.
    since: DateTime<Utc>,
    kubeconfig: Option<PathBuf>,
    node: Option<String>,
    credentials_loaded_at: Option<DateTime<Utc>>,
    last_error: Option<(DateTime<Utc>, String)>,
}

/// The watch's state, shared with the rest of the daemon.
#[derive(Debug)]
pub struct WatchStatus {
    inner: Mutex<Inner>,
    /// Credentials reloaded after a change of the kubeconfig or a file it names.
    pub credential_reloads: AtomicU64,
}

/// Errors kept for Status are cut to this many bytes.
const MAX_ERROR_BYTES: usize = 1024;

impl WatchStatus {
    pub fn new(on: bool) -> WatchStatus {
        WatchStatus {
            inner: Mutex::new(Inner {
                phase: if on { Phase::Searching } else { Phase::Off },
                synced: false,
                since: Utc::now(),
                kubeconfig: None,
                node: None,
                credentials_loaded_at: None,
                last_error: None,
            }),
            credential_reloads: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn connected(&self) -> bool {
        self.lock().phase == Phase::Connected
    }

    /// Connected, with a complete view of the node's pods.
    pub fn synced(&self) -> bool {
        let s = self.lock();
        s.phase == Phase::Connected && s.synced
    }

    pub fn phase(&self) -> Phase {
        self.lock().phase
    }

    fn set(&self, phase: Phase, synced: bool) -> bool {
        let mut s = self.lock();
        if s.phase == phase && s.synced == synced {
            return false;
        }
        s.phase = phase;
        s.synced = synced;
        s.since = Utc::now();
        true
    }

    pub(super) fn searching(&self) {
        self.set(Phase::Searching, false);
    }

    /// Credentials loaded from `kubeconfig` for `node`; connecting with them.
    pub(super) fn credentials(&self, kubeconfig: &std::path::Path, node: &str) {
        {
            let mut s = self.lock();
            s.kubeconfig = Some(kubeconfig.to_path_buf());
            s.node = Some(node.to_string());
            s.credentials_loaded_at = Some(Utc::now());
        }
        if self.phase() != Phase::Connected {
            self.set(Phase::Connecting, false);
        }
    }

    /// A request was answered; `synced`: the pod cache is complete.
    pub(super) fn up(&self, synced: bool) {
        let was = {
            let s = self.lock();
            (s.phase, s.synced)
        };
        if self.set(Phase::Connected, synced) {
            let node = self.lock().node.clone().unwrap_or_default();
            if was.0 != Phase::Connected {
                info!(%node, synced, "pod watcher: connected to the API server");
            } else if synced {
                info!(%node, "pod watcher: synced (every pod of the node known)");
            }
        }
    }

    /// A request failed.
    pub(super) fn down(&self, error: &str) {
        let error = cut(error);
        let was = self.phase();
        self.lock().last_error = Some((Utc::now(), error.clone()));
        if self.set(Phase::Disconnected, false) && was == Phase::Connected {
            warn!(%error, "pod watcher: disconnected from the API server");
        }
    }

    /// A failure before any request (unreadable credentials).
    pub(super) fn failed(&self, error: &str) {
        self.lock().last_error = Some((Utc::now(), cut(error)));
        self.set(Phase::Disconnected, false);
    }

    pub(super) fn stopped(&self) {
        self.set(Phase::Stopped, false);
    }

    /// What verbose Status shows under `kubeWatch`.
    pub fn to_json(&self, pods: usize) -> serde_json::Value {
        let s = self.lock();
        serde_json::json!({
            "state": s.phase.as_str(),
            "connected": s.phase == Phase::Connected,
            "synced": s.phase == Phase::Connected && s.synced,
            "since": s.since.to_rfc3339(),
            "kubeconfig": s.kubeconfig,
            "nodeName": s.node,
            "credentialsLoadedAt": s.credentials_loaded_at.map(|t| t.to_rfc3339()),
            "credentialReloads": self.credential_reloads.load(Ordering::Relaxed),
            "pods": pods,
            "lastError": s.last_error.as_ref().map(|(at, message)| serde_json::json!({
                "at": at.to_rfc3339(),
                "message": message,
            })),
        })
    }
}

fn cut(s: &str) -> String {
    if s.len() <= MAX_ERROR_BYTES {
        return s.to_string();
    }
    let mut end = MAX_ERROR_BYTES;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connected_and_synced_follow_the_requests() {
        let s = WatchStatus::new(true);
        assert_eq!(s.phase(), Phase::Searching);
        assert!(!s.connected() && !s.synced());
        s.credentials(std::path::Path::new("/k"), "n1");
        assert_eq!(s.phase(), Phase::Connecting);
        s.up(false);
        assert!(s.connected() && !s.synced());
        s.up(true);
        assert!(s.synced());
        // Credentials reloaded while connected: still connected until a request says otherwise.
        s.credentials(std::path::Path::new("/k"), "n1");
        assert!(s.synced());
        s.down(&"x".repeat(5000));
        assert!(!s.connected() && !s.synced());
        let j = s.to_json(3);
        assert_eq!(j["state"], "disconnected");
        assert_eq!(j["nodeName"], "n1");
        assert_eq!(j["pods"], 3);
        assert!(j["lastError"]["message"].as_str().unwrap().len() < 1100);
        // Back up: the last error stays for people to read.
        s.up(true);
        assert_eq!(
            s.to_json(0)["lastError"]["message"].as_str().unwrap().len(),
            1027
        );
        let off = WatchStatus::new(false);
        assert_eq!(off.to_json(0)["state"], "off");
    }
}

//! What the shim and the daemon exchange: the readiness report, the control socket requests and
//! responses, and the exit file. All are JSON; socket messages are one JSON object per line.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Files of one container's bundle directory (see the layout in [`crate::shim`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShimPaths {
    pub bundle: PathBuf,
}

impl ShimPaths {
    pub fn new(bundle: impl Into<PathBuf>) -> Self {
        ShimPaths {
            bundle: bundle.into(),
        }
    }
    /// The OCI spec, written by the daemon before the shim starts.
    pub fn config(&self) -> PathBuf {
        self.bundle.join("config.json")
    }
    /// The container's init pid, written by the OCI runtime (`--pid-file`).
    pub fn init_pid(&self) -> PathBuf {
        self.bundle.join("init.pid")
    }
    /// The shim's own pid.
    pub fn shim_pid(&self) -> PathBuf {
        self.bundle.join("shim.pid")
    }
    /// The exit status, written once by the shim ([`ExitRecord`]).
    pub fn exit_file(&self) -> PathBuf {
        self.bundle.join("exit.json")
    }
    /// The control socket.
    pub fn socket(&self) -> PathBuf {
        self.bundle.join("shim.sock")
    }
    /// The shim's own diagnostics (its stderr).
    pub fn shim_log(&self) -> PathBuf {
        self.bundle.join("shim.log")
    }
    /// The OCI runtime's JSON log of `create`.
    pub fn runtime_log(&self) -> PathBuf {
        self.bundle.join("runtime-log.json")
    }
}

/// How the container's init ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitRecord {
    pub pid: i32,
    /// The exit code, or 128 + signal number when a signal killed it (the CRI convention).
    pub exit_code: i32,
    /// The signal that killed it, if one did.
    pub signal: Option<i32>,
    /// RFC 3339 with nanoseconds, UTC.
    pub exited_at: String,
    /// The same instant in nanoseconds since the epoch (CRI `finished_at`).
    pub exited_at_ns: i64,
}

/// The one line the shim writes on its readiness pipe, then closes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ready {
    pub ok: bool,
    #[serde(default)]
    pub shim_pid: i32,
    /// The container's init pid (created, waiting for `start`).
    #[serde(default)]
    pub init_pid: i32,
    #[serde(default)]
    pub error: Option<String>,
}

/// A control socket request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Answered at once with [`Response::State`].
    State,
    /// Reopen the log file at its path (CRI `ReopenContainerLog`); answered with `Ok`.
    ReopenLog,
    /// Answered with [`Response::Exited`] once the init has exited and its output is written.
    Wait,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Response {
    Ok,
    State {
        shim_pid: i32,
        init_pid: i32,
        exited: Option<ExitRecord>,
    },
    Exited {
        exit: ExitRecord,
    },
    Error {
        message: String,
    },
}

pub use crate::fsutil::write_atomic;

/// Reads the exit file; `Ok(None)` when it is not there (yet).
pub fn read_exit_file(path: &Path) -> std::io::Result<Option<ExitRecord>> {
    match std::fs::read(path) {
        Ok(b) => serde_json::from_slice(&b)
            .map(Some)
            .map_err(std::io::Error::other),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_format() {
        assert_eq!(
            serde_json::to_string(&Request::ReopenLog).unwrap(),
            r#"{"op":"reopen_log"}"#
        );
        let r: Request = serde_json::from_str(r#"{"op":"wait"}"#).unwrap();
        assert_eq!(r, Request::Wait);
        let exit = ExitRecord {
            pid: 7,
            exit_code: 137,
            signal: Some(9),
            exited_at: "t".into(),
            exited_at_ns: 1,
        };
        let s = serde_json::to_string(&Response::Exited { exit: exit.clone() }).unwrap();
        assert!(
            s.starts_with(r#"{"status":"exited","exit":{"pid":7"#),
            "{s}"
        );
        assert_eq!(
            serde_json::from_str::<Response>(&s).unwrap(),
            Response::Exited { exit }
        );
    }

    #[test]
    fn exit_file_round_trip() {
        let d = tempfile::tempdir().unwrap();
        let p = ShimPaths::new(d.path());
        assert_eq!(read_exit_file(&p.exit_file()).unwrap(), None);
        let e = ExitRecord {
            pid: 1,
            exit_code: 3,
            signal: None,
            exited_at: "x".into(),
            exited_at_ns: 2,
        };
        write_atomic(&p.exit_file(), &serde_json::to_vec(&e).unwrap()).unwrap();
        assert_eq!(read_exit_file(&p.exit_file()).unwrap(), Some(e));
    }
}

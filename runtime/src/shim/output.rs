//! The container's output in the shim: one pump per output copies it into the CRI log and to
//! the attach sessions; the log is reopened on SIGUSR1 or a control request (after the kubelet
//! rotated it).

use std::io::Read;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};

use nix::sys::signal::{SigSet, Signal};

use super::attach::Attachments;
use crate::logs::{CriLogFile, DEFAULT_MAX_LINE, LineSplitter, Stream};

/// The CRI log file, shared by the pumps and whoever reopens it (`None`: output discarded).
pub(super) type SharedLog = Arc<Mutex<Option<CriLogFile>>>;

/// Copies one output (a pipe, or a terminal's master) into the CRI log, and to the attach
/// sessions, until EOF (EIO on a master: every slave descriptor is closed).
pub(super) fn pump(fd: OwnedFd, stream: Stream, log: &SharedLog, attach: &Attachments) {
    let mut pipe = std::fs::File::from(fd);
    let mut splitter = LineSplitter::new(DEFAULT_MAX_LINE);
    let mut buf = vec![0u8; 64 * 1024];
    let mut failures = 0u64;
    let mut write = |content: &[u8], partial: bool| {
        if let Some(f) = log.lock().unwrap().as_mut()
            && let Err(e) = f.write_entry(stream, partial, content)
        {
            // The shim's own log lives in /run (memory): a log that cannot be written (a full
            // disk) must not add a line there for every entry the container writes.
            failures += 1;
            if failures.is_power_of_two() {
                note!(
                    "minicri shim: write {}: {e} ({failures} {} entries lost so far)",
                    f.path().display(),
                    stream.as_str()
                );
            }
        }
    };
    loop {
        match pipe.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                splitter.feed(&buf[..n], &mut write);
                attach.publish(stream, &buf[..n]);
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.raw_os_error() == Some(libc::EIO) => break,
            Err(e) => {
                note!("minicri shim: read {}: {e}", stream.as_str());
                break;
            }
        }
    }
    splitter.finish(&mut write);
}

pub(super) fn reopen(log: &SharedLog) -> Result<(), String> {
    match log.lock().unwrap().as_mut() {
        Some(f) => f
            .reopen()
            .map_err(|e| format!("reopen {}: {e}", f.path().display())),
        None => Err("this container has no log file".into()),
    }
}

pub(super) fn signal_loop(signals: SigSet, log: SharedLog) {
    loop {
        match signals.wait() {
            Ok(Signal::SIGUSR1) => {
                if let Err(e) = reopen(&log) {
                    note!("minicri shim: {e}");
                }
            }
            Ok(_) => {}
            Err(_) => return,
        }
    }
}

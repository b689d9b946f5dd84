//! The container's terminal (CRI `tty`): how the shim gets the pty master from the OCI runtime.
//!
//! With `process.terminal` in the spec, `runc create --console-socket PATH` makes the pty inside
//! the container, connects to the unix socket at PATH and sends the master side as an
//! `SCM_RIGHTS` message before `create` returns; the container's stdio is the slave side. The
//! shim listens on `<bundle>/pty.sock` ([`super::ShimPaths::console_socket`]) for exactly that
//! one connection, keeps the master for the container's life (its output goes to the CRI log and
//! to attach sessions, attach input and resizes go into it) and removes the socket.

use std::io::IoSliceMut;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};

/// The listening console socket; dropping it removes the socket file.
pub struct ConsoleSocket {
    listener: UnixListener,
    path: PathBuf,
}

impl ConsoleSocket {
    /// Listens at `path` (a stale socket file there is replaced).
    pub fn bind(path: &Path) -> std::io::Result<ConsoleSocket> {
        let _ = std::fs::remove_file(path);
        let listener = UnixListener::bind(path)?;
        listener.set_nonblocking(true)?;
        Ok(ConsoleSocket {
            listener,
            path: path.to_path_buf(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The pty master the runtime sent. Call once `create` has succeeded: the runtime has
    /// connected and sent it by then, so waiting up to `timeout` only covers a slow kernel.
    pub fn receive(self, timeout: Duration) -> std::io::Result<OwnedFd> {
        let deadline = Instant::now() + timeout;
        let conn = loop {
            match self.listener.accept() {
                Ok((c, _)) => break c,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            "the runtime did not send the container's terminal",
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(e),
            }
        };
        conn.set_nonblocking(false)?;
        conn.set_read_timeout(Some(
            deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(100)),
        ))?;
        // runc sends the terminal's name as the data and the master as the one descriptor.
        let mut name = [0u8; 4096];
        let mut iov = [IoSliceMut::new(&mut name)];
        let mut space = nix::cmsg_space!([RawFd; 1]);
        let msg = recvmsg::<()>(
            conn.as_fd().as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(std::io::Error::from)?;
        let mut fds: Vec<OwnedFd> = Vec::new();
        for c in msg.cmsgs().map_err(std::io::Error::from)? {
            if let ControlMessageOwned::ScmRights(raw) = c {
                // SAFETY: the kernel just installed these descriptors for this process; nothing
                // else owns them.
                fds.extend(
                    raw.into_iter()
                        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                );
            }
        }
        if fds.len() != 1 {
            return Err(std::io::Error::other(format!(
                "expected one terminal descriptor from the runtime, got {}",
                fds.len()
            )));
        }
        Ok(fds.remove(0))
    }
}

impl Drop for ConsoleSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::socket::{ControlMessage, sendmsg};
    use std::io::{IoSlice, Read, Write};

    #[test]
    fn receives_the_descriptor_the_runtime_sends() {
        let dir = tempfile::tempdir().unwrap();
        let sock = ConsoleSocket::bind(&dir.path().join("pty.sock")).unwrap();
        // What runc does: connect, send the name and the master, close.
        let pty = nix::pty::openpty(None, None).unwrap();
        let c = std::os::unix::net::UnixStream::connect(sock.path()).unwrap();
        let fds = [pty.master.as_raw_fd()];
        sendmsg::<()>(
            c.as_raw_fd(),
            &[IoSlice::new(b"/dev/pts/9")],
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::empty(),
            None,
        )
        .unwrap();
        drop(c);
        drop(pty.master);
        let path = sock.path().to_path_buf();
        let master = sock.receive(Duration::from_secs(5)).unwrap();
        assert!(!path.exists(), "the socket is removed");
        // It is the same terminal: what the slave writes comes out of the received master.
        let mut slave = std::fs::File::from(pty.slave);
        slave.write_all(b"hi").unwrap();
        let mut got = [0u8; 2];
        std::fs::File::from(master).read_exact(&mut got).unwrap();
        assert_eq!(&got, b"hi");
    }

    #[test]
    fn a_runtime_that_never_connects_times_out() {
        let dir = tempfile::tempdir().unwrap();
        let sock = ConsoleSocket::bind(&dir.path().join("pty.sock")).unwrap();
        let e = sock.receive(Duration::from_millis(50)).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
    }
}

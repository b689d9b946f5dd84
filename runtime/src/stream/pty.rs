//! The master side of a pty as async I/O, and terminal resizes.
//!
//! The master is switched to non-blocking mode and driven by tokio's reactor. Reading returns
//! end-of-file when the kernel says EIO: every slave descriptor is closed, i.e. the runtime
//! relaying the container's terminal has exited.

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// One descriptor of a pty master (use one for reading and a duplicate for writing).
pub struct PtyIo {
    fd: AsyncFd<OwnedFd>,
}

impl PtyIo {
    pub fn new(fd: OwnedFd) -> io::Result<PtyIo> {
        let flags = nix::fcntl::fcntl(fd.as_fd(), nix::fcntl::FcntlArg::F_GETFL)?;
        let flags = nix::fcntl::OFlag::from_bits_truncate(flags) | nix::fcntl::OFlag::O_NONBLOCK;
        nix::fcntl::fcntl(fd.as_fd(), nix::fcntl::FcntlArg::F_SETFL(flags))?;
        // SAFETY: an OwnedFd keeps its descriptor open and unchanged until it is dropped, which
        // happens with the AsyncFd.
        let fd = unsafe { AsyncFd::register(fd) }?;
        Ok(PtyIo { fd })
    }
}

impl AsyncRead for PtyIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.fd.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match guard.try_io(|fd| {
                nix::unistd::read(fd.get_ref().as_fd(), unfilled).map_err(io::Error::from)
            }) {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                // The slave side is closed for good: end of file.
                Ok(Err(e)) if e.raw_os_error() == Some(libc::EIO) => return Poll::Ready(Ok(())),
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for PtyIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.fd.poll_write_ready(cx))?;
            match guard.try_io(|fd| nix::unistd::write(fd.get_ref(), data).map_err(io::Error::from))
            {
                Ok(r) => return Poll::Ready(r),
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    /// A terminal has no half-close: the end of the client's input is sent as the EOF character
    /// (^D), which ends a read at the start of a line in canonical mode.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.poll_write(cx, &[0x04]).map_ok(|_| ())
    }
}

nix::ioctl_write_ptr_bad!(set_winsize, libc::TIOCSWINSZ, libc::winsize);

/// Sets the size of the terminal behind `master`.
pub fn resize(master: &OwnedFd, width: u16, height: u16) -> io::Result<()> {
    let ws = libc::winsize {
        ws_row: height,
        ws_col: width,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one `winsize` from the pointer, which is valid for the call.
    unsafe { set_winsize(master.as_raw_fd(), &ws) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test]
    async fn reads_and_writes_through_a_pty_and_ends_when_the_slave_closes() {
        let pty = nix::pty::openpty(None, None).unwrap();
        let mut w = PtyIo::new(pty.master.try_clone().unwrap()).unwrap();
        let mut r = PtyIo::new(pty.master.try_clone().unwrap()).unwrap();
        resize(&pty.master, 120, 40).unwrap();
        let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
        // SAFETY: TIOCGWINSZ writes one `winsize` into the valid pointer.
        assert_eq!(
            unsafe { libc::ioctl(pty.slave.as_raw_fd(), libc::TIOCGWINSZ, &mut ws) },
            0
        );
        assert_eq!((ws.ws_col, ws.ws_row), (120, 40));

        // Input typed on the master comes out of the slave (and is echoed back).
        w.write_all(b"typed\n").await.unwrap();
        let mut slave = std::fs::File::from(pty.slave);
        let mut line = [0u8; 6];
        std::io::Read::read_exact(&mut slave, &mut line).unwrap();
        assert_eq!(&line, b"typed\n");
        std::io::Write::write_all(&mut slave, b"output").unwrap();
        drop(slave);
        let mut all = Vec::new();
        r.read_to_end(&mut all).await.unwrap();
        let text = String::from_utf8_lossy(&all);
        assert!(
            text.contains("typed") && text.ends_with("output"),
            "{text:?}"
        );
    }
}

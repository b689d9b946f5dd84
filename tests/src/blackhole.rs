//! An address that takes no connection and refuses none ([`Blackhole`]): what a registry host
//! behind a dead route or a firewall that drops packets looks like to a client, made on
//! loopback. A socket listens with a backlog of 0 and its accept queue is filled by connections
//! nobody accepts; the kernel then drops every new SYN, so a client's connect neither succeeds
//! nor fails until its own timeout.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::Duration;

use nix::sys::socket::{Backlog, listen};

pub struct Blackhole {
    _listener: TcpListener,
    _queued: Vec<TcpStream>,
    addr: SocketAddr,
}

impl Blackhole {
    pub fn start() -> std::io::Result<Blackhole> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        // listen(2) again on a listening socket sets its backlog.
        listen(&listener, Backlog::new(0).map_err(std::io::Error::from)?)?;
        let addr = listener.local_addr()?;
        // Fill the accept queue; the first connect that does not complete within the timeout
        // shows it is full.
        let mut queued = Vec::new();
        loop {
            match TcpStream::connect_timeout(&addr, Duration::from_millis(300)) {
                Ok(s) => queued.push(s),
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => break,
                Err(e) => return Err(e),
            }
            if queued.len() > 16 {
                return Err(std::io::Error::other(
                    "the listener's accept queue never filled",
                ));
            }
        }
        Ok(Blackhole {
            _listener: listener,
            _queued: queued,
            addr,
        })
    }

    /// `127.0.0.1:PORT`.
    pub fn addr(&self) -> String {
        self.addr.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connects_neither_succeed_nor_fail_until_the_timeout() {
        let hole = Blackhole::start().unwrap();
        let start = std::time::Instant::now();
        let e = TcpStream::connect_timeout(&hole.addr, Duration::from_millis(500)).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
        assert!(start.elapsed() >= Duration::from_millis(450));
    }
}

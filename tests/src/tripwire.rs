//! Owns [`Tripwire`]: a listener on one port of every address of the node (a dual-stack
//! wildcard: loopback, `0.0.0.0`, `::ffff:127.0.0.1`, each interface's address) that counts the
//! connections it accepts and closes them. A test points something that must not reach the node
//! at it, and checks the count stays at zero. The listener stops on drop.

use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

/// Counts the connections made to one port of the node, on any of its addresses.
pub struct Tripwire {
    port: u16,
    hits: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Tripwire {
    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Listens on `[::]`, a free port, and counts.
    pub fn start() -> Tripwire {
        let listener = TcpListener::bind("[::]:0").expect("a dual-stack listener");
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let hits = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (h, s) = (hits.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((conn, peer)) => {
                        eprintln!("tripwire: connection from {peer}");
                        h.fetch_add(1, Ordering::SeqCst);
                        drop(conn);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Tripwire {
            port,
            hits,
            stop,
            thread: Some(thread),
        }
    }

    /// Connections accepted so far.
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

impl Drop for Tripwire {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_connections_to_any_address_of_the_node() {
        let wire = Tripwire::start();
        for addr in ["127.0.0.1", "[::1]", "0.0.0.0"] {
            let _ = std::net::TcpStream::connect(format!("{addr}:{}", wire.port()));
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while wire.hits() < 3 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(wire.hits(), 3);
    }
}

//! The accept loop of the daemon's two HTTP servers (the streaming server and the metrics
//! endpoint), with the bounds a stranger on the node cannot push past: at most
//! [`Limits::max_connections`] connections are served at once (further ones wait in the
//! kernel's backlog until one ends), and a connection that has not sent a request's headers
//! within [`Limits::header_timeout`] is closed. An upgraded connection (SPDY, WebSocket) leaves
//! the count when it is handed over: a session exists only for a single-use token that a CRI
//! caller obtained, so those are bounded by the callers, not here.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio_util::sync::CancellationToken;

/// What one server admits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub header_timeout: Duration,
}

/// Connections served at once, and the time a request's headers may take, by default.
pub const DEFAULT_LIMITS: Limits = Limits {
    max_connections: 128,
    header_timeout: Duration::from_secs(10),
};

/// Serves `listener` until `shutdown` is cancelled (the listener is closed then; connections
/// already accepted go on until they end or the process does): each request goes to `handle`;
/// `name` names the server in logs.
pub fn serve<H, F>(
    listener: tokio::net::TcpListener,
    name: &'static str,
    limits: Limits,
    shutdown: CancellationToken,
    handle: H,
) -> tokio::task::JoinHandle<()>
where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Result<Response<Full<Bytes>>, Infallible>> + Send + 'static,
{
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    tokio::spawn(async move {
        loop {
            let slot = tokio::select! {
                _ = shutdown.cancelled() => return,
                s = slots.clone().acquire_owned() => match s {
                    Ok(s) => s,
                    Err(_) => return,
                },
            };
            let accepted = tokio::select! {
                _ = shutdown.cancelled() => return,
                a = listener.accept() => a,
            };
            let stream = match accepted {
                Ok((s, _)) => s,
                Err(e) => {
                    // Out of descriptors, most likely: wait instead of spinning.
                    tracing::warn!(server = name, error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let handle = handle.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(handle);
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(limits.header_timeout)
                    .serve_connection(TokioIo::new(stream), svc)
                    .with_upgrades();
                if let Err(e) = conn.await {
                    tracing::debug!(server = name, error = %e, "connection ended with an error");
                }
                drop(slot);
            });
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn start(limits: Limits) -> std::net::SocketAddr {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        serve(l, "test", limits, CancellationToken::new(), |_req| async {
            Ok(Response::new(Full::new(Bytes::from_static(b"ok"))))
        });
        addr
    }

    async fn get(addr: std::net::SocketAddr) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn shutdown_ends_the_accept_loop_and_closes_the_listener() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let task = serve(l, "test", DEFAULT_LIMITS, shutdown.clone(), |_req| async {
            Ok(Response::new(Full::new(Bytes::from_static(b"ok"))))
        });
        assert!(get(addr).await.ends_with("ok"));
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(2), task)
            .await
            .expect("the accept loop ends")
            .unwrap();
        assert!(tokio::net::TcpStream::connect(addr).await.is_err());
    }

    #[tokio::test]
    async fn silent_connections_are_closed_and_cannot_exhaust_the_server() {
        let addr = start(Limits {
            max_connections: 4,
            header_timeout: Duration::from_millis(500),
        })
        .await;
        // Four connections that never send a request fill every slot.
        let mut silent = Vec::new();
        for _ in 0..4 {
            silent.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        // A fifth client waits for a slot; it is served once the silent ones time out.
        let t = std::time::Instant::now();
        let reply = tokio::time::timeout(Duration::from_secs(5), get(addr))
            .await
            .expect("served once the silent connections were closed");
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        assert!(
            t.elapsed() >= Duration::from_millis(400),
            "it had to wait for a slot: {:?}",
            t.elapsed()
        );
        // The silent connections were closed by the server.
        for mut s in silent {
            let mut b = [0u8; 64];
            let n = tokio::time::timeout(Duration::from_secs(2), s.read(&mut b))
                .await
                .expect("closed, not left open")
                .unwrap_or(0);
            let text = String::from_utf8_lossy(&b[..n]);
            assert!(n == 0 || text.starts_with("HTTP/1.1 408"), "{text}");
        }
    }
}

//! A byte stream carried in binary WebSocket messages, both ways: how client-go tunnels SPDY
//! through WebSocket (subprotocol `SPDY/3.1+<protocol>`; each of its writes is one message, and
//! the message boundaries mean nothing).
//!
//! [`byte_stream`] hands the caller one end of an in-memory pipe of [`PIPE`] bytes and runs two
//! copies: the client's messages into the pipe (its end: EOF), and what the caller writes out
//! as messages of at most [`MAX_DATA_CHUNK`] bytes (the caller's EOF: a close frame, then up to
//! [`LINGER`] for the client's answer). Neither direction buffers more than the pipe and the
//! connection's queues. With a budget (port-forward), each message's charge is held until the
//! pipe has taken its bytes, and each read going out is charged (to the share given, the pod's
//! last hop) until it is written. The caller learns why the WebSocket connection ended (a
//! stall, say) from [`Tunnel::ended`].

use minicri_codecs::budget::{self, Share};
use minicri_codecs::spdy::conn::MAX_DATA_CHUNK;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::sync::{mpsc, oneshot};

use super::close;
use super::conn::{Conn, Event};
use crate::stream::session::LINGER;

/// Bytes buffered between the tunnel and its user, per direction.
const PIPE: usize = 64 * 1024;

/// A tunnelled byte stream and how its connection ended.
pub struct Tunnel {
    pub stream: DuplexStream,
    /// Why the WebSocket connection ended, once it has.
    pub ended: oneshot::Receiver<String>,
}

/// The tunnelled byte stream of a served connection.
pub fn byte_stream(conn: Conn, mut events: mpsc::Receiver<Event>, budget: Option<Share>) -> Tunnel {
    let (theirs, ours) = tokio::io::duplex(PIPE);
    let (mut rd, mut wr) = tokio::io::split(ours);
    let ended = conn.ended.clone();
    let (reason_tx, reason_rx) = oneshot::channel();
    tokio::spawn(async move {
        let mut reason = None;
        while let Some(ev) = events.recv().await {
            let m = match ev {
                Event::Message(m, _charge) => m,
                Event::Closed(why) => {
                    reason = Some(why);
                    break;
                }
            };
            // The pipe's reader may wait on a consumer of its own: the connection can end
            // meanwhile.
            let written = tokio::select! {
                r = wr.write_all(&m) => r.is_ok(),
                () = ended.cancelled() => false,
            };
            if !written {
                break;
            }
        }
        let _ = wr.shutdown().await;
        // Keep reading (and dropping) until the connection ends: its reader must not stall.
        while let Some(ev) = events.recv().await {
            if let Event::Closed(why) = ev {
                reason = Some(why);
            }
        }
        let _ = reason_tx.send(reason.unwrap_or_default());
    });
    tokio::spawn(async move {
        let mut buf = vec![0u8; MAX_DATA_CHUNK];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let charge = budget::charge(budget.as_ref(), n).await;
                    if conn
                        .sender
                        .send_charged(buf[..n].to_vec(), charge)
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
            }
        }
        conn.finish(close::NORMAL, LINGER).await;
    });
    Tunnel {
        stream: theirs,
        ended: reason_rx,
    }
}

#[cfg(test)]
mod tests {
    use super::super::conn;
    use super::super::opcode;
    use super::super::tests::Client;
    use super::*;

    #[tokio::test]
    async fn bytes_cross_whatever_the_message_boundaries() {
        let (a, b) = tokio::io::duplex(1 << 20);
        let (c, events) = conn::serve(b);
        let Tunnel { mut stream, ended } = byte_stream(c, events, None);
        let mut client = Client::new(a);
        client.send(opcode::BINARY, b"hel").await;
        client.send(opcode::BINARY, b"lo").await;
        let mut got = [0u8; 5];
        stream.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"hello");
        stream.write_all(b"back").await.unwrap();
        assert_eq!(
            client.recv().await,
            Some((opcode::BINARY, b"back".to_vec()))
        );
        // The user's end of the stream: a close frame; the client's answer ends it all.
        stream.shutdown().await.unwrap();
        assert_eq!(client.recv().await, Some((opcode::CLOSE, vec![0x03, 0xe8])));
        client.send(opcode::CLOSE, &[0x03, 0xe8]).await;
        let mut rest = Vec::new();
        stream.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());
        assert_eq!(client.recv().await, None);
        let why = ended.await.unwrap();
        assert!(why.contains("1000"), "{why}");
    }
}

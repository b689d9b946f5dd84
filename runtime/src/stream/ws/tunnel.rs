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
//! last hop) until it is written.

use minicri_codecs::budget::{self, Share};
use minicri_codecs::spdy::conn::MAX_DATA_CHUNK;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::sync::mpsc;

use super::close;
use super::conn::{Conn, Event};
use crate::stream::session::LINGER;

/// Bytes buffered between the tunnel and its user, per direction.
const PIPE: usize = 64 * 1024;

/// The tunnelled byte stream of a served connection.
pub fn byte_stream(
    conn: Conn,
    mut events: mpsc::Receiver<Event>,
    budget: Option<Share>,
) -> DuplexStream {
    let (theirs, ours) = tokio::io::duplex(PIPE);
    let (mut rd, mut wr) = tokio::io::split(ours);
    let ended = conn.ended.clone();
    tokio::spawn(async move {
        while let Some(Event::Message(m, _charge)) = events.recv().await {
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
        while events.recv().await.is_some() {}
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
    theirs
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
        let mut stream = byte_stream(c, events, None);
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
    }
}

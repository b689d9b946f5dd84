//! remotecommand over WebSocket (exec and attach), as client-go's WebSocket executor speaks it:
//! every binary message starts with a channel byte (0 stdin, 1 stdout, 2 stderr, 3 error,
//! 4 resize; [`StreamType::channel`]) followed by that channel's bytes.
//!
//! [`open`] turns a served connection into a session's [`Channels`] and [`Link`]: a demux task
//! routes the client's stdin and resize messages to their queues (messages on other channels,
//! or on channels the request did not ask for, are dropped); under v5 a message
//! `[255, channel]` ([`CLOSE_CHANNEL`]) ends the client's input on that channel (stdin: the
//! process's stdin is closed). Outputs are written as messages of at most
//! [`MAX_DATA_CHUNK`] bytes. The client is gone when the connection ends; the session ends with
//! a close frame (normal closure), which is also how the client learns its outputs ended.

use std::time::Duration;

use minicri_codecs::budget::{self, Charge, InputTx};
use minicri_codecs::spdy::conn::MAX_DATA_CHUNK;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::close;
use super::conn::{self, Closed, Conn, Event};
use crate::stream::remotecommand::{CLOSE_CHANNEL, Protocol, StreamType};
use crate::stream::session::{Channels, Link, Output};

/// Messages queued per input channel before the demux (and so the connection's reader) waits.
const INPUT_QUEUE: usize = 4;

/// Writes one output channel.
#[derive(Clone, Debug)]
pub struct ChannelWriter {
    channel: u8,
    sender: conn::Sender,
}

impl ChannelWriter {
    pub fn new(channel: u8, sender: conn::Sender) -> ChannelWriter {
        ChannelWriter { channel, sender }
    }

    /// What each message of the channel starts with: its channel byte.
    pub fn head(&self) -> &[u8] {
        std::slice::from_ref(&self.channel)
    }

    /// Sends `message` (starting with [`ChannelWriter::head`]) as it is, holding `charge`
    /// until it is written.
    pub async fn send_charged(&self, message: Vec<u8>, charge: Charge) -> Result<(), Closed> {
        debug_assert_eq!(message.first(), Some(&self.channel));
        self.sender.send_charged(message, charge).await
    }

    /// Sends `data` as messages of at most [`MAX_DATA_CHUNK`] bytes after the channel byte.
    pub async fn write(&self, data: &[u8]) -> Result<(), Closed> {
        for chunk in data.chunks(MAX_DATA_CHUNK) {
            let mut m = Vec::with_capacity(1 + chunk.len());
            m.push(self.channel);
            m.extend_from_slice(chunk);
            self.sender.send(m).await?;
        }
        Ok(())
    }
}

/// A WebSocket session's connection: whether the client is gone, and the end.
pub struct WsLink {
    conn: Conn,
    gone: watch::Receiver<bool>,
}

impl WsLink {
    /// Resolves when the connection has ended (the client closed it, hung up, or broke a rule).
    pub async fn gone(&mut self) {
        while !*self.gone.borrow_and_update() {
            if self.gone.changed().await.is_err() {
                return;
            }
        }
    }

    /// Sends the close frame (normal closure) and gives the client `linger` to answer.
    pub async fn finish(self, linger: Duration) {
        self.conn.finish(close::NORMAL, linger).await;
    }
}

/// Serves WebSocket on `io` (the handshake is done) for a session of `protocol` using
/// `streams`.
pub fn open<IO>(io: IO, protocol: Protocol, streams: &[StreamType]) -> (Channels, Link)
where
    IO: AsyncRead + AsyncWrite + Send + 'static,
{
    let (conn, events) = conn::serve(io);
    let output = |t: StreamType| {
        streams
            .contains(&t)
            .then(|| Output::Ws(ChannelWriter::new(t.channel(), conn.sender.clone())))
    };
    let input = |t: StreamType| streams.contains(&t).then(|| budget::input(INPUT_QUEUE));
    let (stdin_tx, stdin) = input(StreamType::Stdin).unzip();
    let (resize_tx, resize) = input(StreamType::Resize).unzip();
    let channels = Channels {
        error: output(StreamType::Error),
        stdin,
        stdout: output(StreamType::Stdout),
        stderr: output(StreamType::Stderr),
        resize,
        inputs: Vec::new(),
    };
    let (gone_tx, gone) = watch::channel(false);
    tokio::spawn(demux(
        events,
        conn.ended.clone(),
        protocol,
        stdin_tx,
        resize_tx,
        gone_tx,
    ));
    (channels, Link::Ws(WsLink { conn, gone }))
}

/// Routes the client's input messages until the connection ends, then says so.
async fn demux(
    mut events: mpsc::Receiver<Event>,
    ended: CancellationToken,
    protocol: Protocol,
    mut stdin: Option<InputTx>,
    mut resize: Option<InputTx>,
    gone: watch::Sender<bool>,
) {
    const STDIN: u8 = 0;
    const RESIZE: u8 = 4;
    while let Some(Event::Message(m, _)) = events.recv().await {
        let Some((&channel, data)) = m.split_first() else {
            continue;
        };
        match channel {
            CLOSE_CHANNEL if protocol >= Protocol::V5 => match data {
                [STDIN] => stdin = None,
                [RESIZE] => resize = None,
                _ => tracing::debug!(?data, "ignored a close signal"),
            },
            STDIN => {
                if let Some(tx) = &stdin
                    && !data.is_empty()
                {
                    // A reader that went away just means the input is not wanted.
                    let data = data.to_vec();
                    if !conn::deliver(tx, data, Charge::none(), &ended).await
                        && ended.is_cancelled()
                    {
                        break;
                    }
                }
            }
            RESIZE => {
                if let Some(tx) = &resize {
                    // client-go writes one JSON object per message, with a newline; others
                    // may not: the resize reader splits lines.
                    let mut line = data.to_vec();
                    if line.last() != Some(&b'\n') {
                        line.push(b'\n');
                    }
                    if !conn::deliver(tx, line, Charge::none(), &ended).await
                        && ended.is_cancelled()
                    {
                        break;
                    }
                }
            }
            _ => {}
        }
    }
    drop((stdin, resize));
    let _ = gone.send(true);
}

#[cfg(test)]
mod tests {
    use super::super::opcode;
    use super::super::tests::Client;
    use super::*;

    fn start(
        protocol: Protocol,
        streams: &[StreamType],
    ) -> (Client<tokio::io::DuplexStream>, Channels, Link) {
        let (a, b) = tokio::io::duplex(1 << 20);
        let (ch, link) = open(b, protocol, streams);
        (Client::new(a), ch, link)
    }

    /// Input nobody reads (a process that does not read its stdin) holds the connection's
    /// reader; the client going away still ends the session once writing to it fails.
    #[tokio::test]
    async fn a_client_gone_while_its_input_is_not_read_ends_the_session() {
        use StreamType::*;
        let (mut c, ch, mut link) = start(Protocol::V5, &[Error, Stdin, Stdout]);
        let mut message = vec![0u8]; // stdin
        message.extend(vec![b'x'; 64 << 10]);
        let flooded = tokio::time::timeout(Duration::from_secs(2), async {
            loop {
                c.send(opcode::BINARY, &message).await;
            }
        })
        .await;
        assert!(flooded.is_err(), "the client's writes never blocked");
        drop(c);
        // The process goes on writing its output.
        let _ = ch.stdout.as_ref().unwrap().write(b"output").await;
        tokio::time::timeout(Duration::from_secs(10), link.gone())
            .await
            .expect("the session learns that its client is gone");
    }

    #[tokio::test]
    async fn input_is_routed_and_output_carries_its_channel() {
        use StreamType::*;
        let (mut c, mut ch, link) = start(Protocol::V5, &[Error, Stdin, Stdout, Resize]);
        assert!(ch.stderr.is_none(), "not asked for");
        c.send(opcode::BINARY, b"\x00typed").await;
        c.send(opcode::BINARY, b"\x04{\"Width\":80,\"Height\":24}")
            .await;
        c.send(opcode::BINARY, b"\x02not an input").await;
        c.send(opcode::BINARY, b"").await;
        let stdin = ch.stdin.as_mut().unwrap();
        assert_eq!(stdin.recv().await.unwrap(), b"typed");
        assert_eq!(
            ch.resize.as_mut().unwrap().recv().await.unwrap(),
            b"{\"Width\":80,\"Height\":24}\n"
        );
        // v5: the close signal ends stdin.
        c.send(opcode::BINARY, &[CLOSE_CHANNEL, 0]).await;
        assert!(ch.stdin.as_mut().unwrap().recv().await.is_none());

        let out = ch.stdout.clone().unwrap();
        out.write(&vec![7u8; MAX_DATA_CHUNK + 1]).await.unwrap();
        let (op, m) = c.recv().await.unwrap();
        assert_eq!((op, m.len(), m[0]), (opcode::BINARY, 1 + MAX_DATA_CHUNK, 1));
        assert_eq!(c.recv().await.unwrap().1, [1, 7]);
        ch.error.as_ref().unwrap().write(b"{}").await.unwrap();
        assert_eq!(c.recv().await.unwrap().1, b"\x03{}");
        // The end: a normal closure, answered by the client.
        let finishing = tokio::spawn(link.finish());
        assert_eq!(c.recv().await, Some((opcode::CLOSE, vec![0x03, 0xe8])));
        c.send(opcode::CLOSE, &[0x03, 0xe8]).await;
        finishing.await.unwrap();
        assert_eq!(c.recv().await, None);
    }

    #[tokio::test]
    async fn v4_has_no_close_signal_and_a_hang_up_is_noticed() {
        use StreamType::*;
        let (mut c, mut ch, mut link) = start(Protocol::V4, &[Error, Stdin, Stdout]);
        c.send(opcode::BINARY, &[CLOSE_CHANNEL, 0]).await;
        c.send(opcode::BINARY, b"\x00still open").await;
        assert_eq!(
            ch.stdin.as_mut().unwrap().recv().await.unwrap(),
            b"still open"
        );
        drop(c);
        tokio::time::timeout(Duration::from_secs(5), link.gone())
            .await
            .expect("the hang-up is noticed");
        assert!(ch.stdin.as_mut().unwrap().recv().await.is_none());
        assert!(ch.stdout.unwrap().write(b"x").await.is_err());
    }
}

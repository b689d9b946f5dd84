//! remotecommand over WebSocket (exec and attach), as client-go's WebSocket executor speaks it:
//! every binary message starts with a channel byte (0 stdin, 1 stdout, 2 stderr, 3 error,
//! 4 resize; [`StreamType::channel`]) followed by that channel's bytes.
//!
//! [`open`] serves the connection for a session (`session::open_ws` makes its channels and
//! link of it; this module does not know the session's types): a demux task
//! routes the client's stdin and resize messages to their queues (messages on other channels,
//! or on channels the request did not ask for, are dropped); under v5 a message
//! `[255, channel]` ([`CLOSE_CHANNEL`]) ends the client's input on that channel (stdin: the
//! process's stdin is closed). Outputs are written as messages of at most
//! [`MAX_DATA_CHUNK`] bytes. The client is gone when the connection ends; the session ends with
//! a close frame (normal closure), which is also how the client learns its outputs ended.

use std::time::Duration;

use minicri_codecs::budget::{self, Charge, Input, InputTx};
use minicri_codecs::spdy::conn::MAX_DATA_CHUNK;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::close;
use super::conn::{self, Closed, Conn, Event};
use crate::stream::remotecommand::{CLOSE_CHANNEL, Protocol, StreamType};

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

/// What [`open`] serves: the connection's sender (each output channel is a [`ChannelWriter`]
/// on it), the client's input queues the session asked for, and the link.
pub struct Opened {
    pub sender: conn::Sender,
    pub stdin: Option<Input>,
    pub resize: Option<Input>,
    pub link: WsLink,
}

/// Serves WebSocket on `io` (the handshake is done) for a session of `protocol` using
/// `streams`: the session's channels are made of it by `session::open_ws`.
pub fn open<IO>(io: IO, protocol: Protocol, streams: &[StreamType]) -> Opened
where
    IO: AsyncRead + AsyncWrite + Send + 'static,
{
    let (conn, events) = conn::serve(io);
    let input = |t: StreamType| streams.contains(&t).then(|| budget::input(INPUT_QUEUE));
    let (stdin_tx, stdin) = input(StreamType::Stdin).unzip();
    let (resize_tx, resize) = input(StreamType::Resize).unzip();
    let (gone_tx, gone) = watch::channel(false);
    tokio::spawn(demux(
        events,
        conn.ended.clone(),
        protocol,
        stdin_tx,
        resize_tx,
        gone_tx,
    ));
    Opened {
        sender: conn.sender.clone(),
        stdin,
        resize,
        link: WsLink { conn, gone },
    }
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

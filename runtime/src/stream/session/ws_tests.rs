//! remotecommand over WebSocket ([`super::open_ws`] on [`crate::stream::ws::channels`]): the
//! channels a session gets, and the client's input and hang-up reaching it.

use std::time::Duration;

use minicri_codecs::spdy::conn::MAX_DATA_CHUNK;

use super::*;
use crate::stream::remotecommand::CLOSE_CHANNEL;
use crate::stream::ws::opcode;
use crate::stream::ws::tests::Client;

fn start(
    protocol: Protocol,
    streams: &[StreamType],
) -> (Client<tokio::io::DuplexStream>, Channels, Link) {
    let (a, b) = tokio::io::duplex(1 << 20);
    let (ch, link) = open_ws(b, protocol, streams);
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

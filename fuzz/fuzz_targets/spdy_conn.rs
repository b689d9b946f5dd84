//! A SPDY/3.1 streaming session (minicri_codecs::spdy::conn, codecs/src/spdy/conn.rs):
//! whatever bytes a client sends, the server side answers, ends the session and lets go of
//! its tasks (a hang is reported by libFuzzer's -timeout), without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;
use minicri_codecs::spdy::conn::{Event, serve};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fuzz_target!(|data: &[u8]| {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let input = data.to_vec();
    rt.block_on(async move {
        let (client, server) = tokio::io::duplex(16 * 1024);
        let (handle, mut events) = serve(server);
        let (mut crd, mut cwr) = tokio::io::split(client);
        let writer = tokio::spawn(async move {
            let _ = cwr.write_all(&input).await;
            let _ = cwr.shutdown().await;
        });
        let reader = tokio::spawn(async move {
            let mut answer = Vec::new();
            let _ = crd.read_to_end(&mut answer).await;
        });
        // Each stream is answered and read to its end, as exec and port-forward do.
        let mut closed = false;
        while let Some(ev) = events.recv().await {
            match ev {
                Event::Stream(mut s) => {
                    tokio::spawn(async move {
                        let _ = s.writer.write(b"answer").await;
                        while s.data.recv().await.is_some() {}
                        let _ = s.writer.close().await;
                    });
                }
                Event::Closed(_) => {
                    closed = true;
                    break;
                }
            }
        }
        assert!(closed, "the session ended without its Closed event");
        handle.close().await;
        writer.await.expect("the client writer ends");
        reader.await.expect("the client reader ends");
    });
});

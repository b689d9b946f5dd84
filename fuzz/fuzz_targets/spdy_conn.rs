//! A SPDY/3.1 streaming session (runtime/src/stream/spdy/conn.rs, compiled in from its source
//! files): whatever bytes a client sends, the server side answers, ends the session and lets go of
//! its tasks (a hang is reported by libFuzzer's -timeout), without panicking.
#![no_main]

#[allow(dead_code)]
#[path = "../../runtime/src/stream/spdy/mod.rs"]
mod spdy;

// The connection code charges its buffers to the runtime's port-forward budget, which it finds
// at `crate::stream::budget`: compiled in from its source file too.
#[allow(dead_code)]
#[path = "../../runtime/src/stream/budget.rs"]
mod budget;
mod stream {
    pub(crate) use crate::budget;
}

use libfuzzer_sys::fuzz_target;
use spdy::conn::{Event, serve};
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

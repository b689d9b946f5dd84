//! The HTTP/1.1 upgrade request both streaming transports start with (SPDY/3.1 in
//! [`crate::remotecommand`], WebSocket in [`crate::websocket`]), written by hand so that the
//! tests see the server's response head as it was sent.

use anyhow::{Context, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Sends `METHOD path` of `url` with `headers` (each `Name: value`); reads the response head.
/// Returns the status, the head (lowercased) and the connection, positioned after the head.
pub async fn http_upgrade(
    url: &str,
    method: &str,
    headers: &[String],
) -> anyhow::Result<(u16, String, TcpStream)> {
    let rest = url.strip_prefix("http://").context("an http:// URL")?;
    let slash = rest.find('/').context("a path")?;
    let (host, path) = rest.split_at(slash);
    let mut conn = TcpStream::connect(host).await?;
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\n");
    for h in headers {
        req.push_str(h);
        req.push_str("\r\n");
    }
    req.push_str("\r\n");
    conn.write_all(req.as_bytes()).await?;
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut b = [0u8; 1];
        if conn.read(&mut b).await? == 0 {
            bail!("connection closed in the response head: {head:?}");
        }
        head.push(b[0]);
    }
    let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
    let status = head.get(9..12).context("a status line")?.parse()?;
    Ok((status, head, conn))
}

//! minicri's codecs of what strangers send, apart from the daemon so the fuzz targets (fuzz/)
//! build exactly the code the runtime runs, without the runtime crate:
//!
//! - [`spdy`]: SPDY/3.1 framing, header blocks and their bounded zlib decompression, flow
//!   control, the server-side connection, and the liveness rules (keepalive, idle timeout) the
//!   WebSocket connection shares;
//! - [`budget`]: the node-wide byte budget that port-forward connections (SPDY and WebSocket)
//!   charge their buffers to;
//! - [`crilog`]: the CRI container log line format (the log files are the runtime's).

pub mod budget;
pub mod crilog;
pub mod spdy;

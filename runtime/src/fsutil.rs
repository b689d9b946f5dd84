//! Small filesystem helpers the daemon's modules share: replacing a file atomically (the store
//! crate's one implementation, re-exported for the daemon's modules).

pub use minicri_store::fsutil::{off_async, write_atomic};

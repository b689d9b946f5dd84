//! minicri's snapshotter: turns image layers into filesystems.
//!
//! - [`Snapshotter`] is the seam the rest of minicri uses; [`LocalSnapshotter`] implements it with
//!   the overlayfs backend ([`Backend::Overlay`], the default) or the copy backend ([`Backend::Copy`])
//!   for filesystems overlayfs cannot use (check with [`overlay_supported`]).
//! - [`Snapshotter::apply_layer`] unpacks one layer from a stream of its compressed bytes (fed while the
//!   blob downloads, through a [`ChunkReader`] or a [`FollowReader`]), checks the diff_id as it decompresses, and commits
//!   the layer under its chain id ([`chain_id`]) by renaming it into place.
//! - Snapshots are held by users (image and container ids) and by their children, and go with the last.
//!
//! Everything blocks: an async caller wraps calls in `spawn_blocking`. Applying layers and mounting
//! need root (device nodes, ownership, `trusted.*` xattrs, mount(2)).

mod apply;
mod backend;
mod compression;
mod digest;
mod error;
mod fsutil;
mod meta;
mod mount;
mod pipeline;
mod settings;
mod snapshotter;
mod store;
mod stream;
mod tree;

pub use apply::{MAX_LONG_NAME, MAX_PATH_BYTES, MAX_PAX_BYTES, MAX_SPARSE_MAP_BYTES};
pub use backend::overlay::check_support as overlay_supported;
pub use compression::Compression;
pub use digest::{chain_id, chain_ids, is_sha256_hex, validate_digest};
pub use error::{Error, Result};
pub use fsutil::{sync_dir, write_atomic};
pub use mount::{Mount, unmount};
pub use settings::SnapshotterSettings;
pub use snapshotter::{
    Backend, Info, Kind, LayerApplied, LayerSpec, Released, Snapshotter, SpaceCheck, Usage,
};
pub use store::{
    DEFAULT_MAX_LAYER_BYTES, DEFAULT_MAX_LAYER_ENTRIES, LocalSnapshotter, Options, unpack_into,
};
pub use stream::{ChunkReader, FollowReader, WriterStatus};

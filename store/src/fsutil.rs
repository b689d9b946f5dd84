//! Running blocking file work without stalling the async runtime. (Durable replacement of a
//! record, `write_atomic`, and `sync_dir` are the snapshotter crate's, the lowest one, whose
//! records use them too.)

/// Runs blocking file work `f` (an fsync, a removal) without stalling the async runtime: on a
/// worker of a multi-threaded tokio runtime, the worker hands its queued tasks to another thread
/// for the duration (`block_in_place`); anywhere else `f` just runs. For short work done by
/// synchronous APIs that async code calls; long work goes to `spawn_blocking`.
pub fn off_async<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

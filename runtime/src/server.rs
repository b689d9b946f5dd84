//! Serving the CRI on a unix socket: single-instance lock, stale-socket handling, HTTP/2 serving and
//! graceful shutdown on SIGTERM/SIGINT.
//!
//! minicri serves gRPC with hyper directly rather than through tonic's `Server`, so that the
//! client's `grpc-timeout` is enforced by the handlers themselves ([`crate::rpc::call`]) and answers
//! DEADLINE_EXCEEDED, as the CRI expects, instead of tonic's generic CANCELLED.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use minicri_proto::MAX_MESSAGE_SIZE;
use minicri_proto::minicri::v1::pulls_server::PullsServer;
use minicri_proto::runtime::v1::image_service_server::ImageServiceServer;
use minicri_proto::runtime::v1::runtime_service_server::RuntimeServiceServer;
use nix::fcntl::{Flock, FlockArg};
use tokio::net::UnixListener;
use tokio::signal::unix::{SignalKind, signal};

use crate::admin::PullsHandler;
use crate::config::Config;
use crate::cri::image::ImageHandler;
use crate::cri::runtime::RuntimeHandler;
use crate::daemon::Daemon;

/// How long in-flight calls get to finish after a shutdown signal.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// How long running pulls get to end, with their layer unpacks, after a shutdown signal.
const PULL_STOP_GRACE: Duration = Duration::from_secs(15);
/// How long blocking work still running when the server has stopped (a file operation under
/// way) gets before the process exits anyway. With the graces above, a SIGTERM ends the daemon
/// within about 32 s, under systemd's default stop timeout of 90 s.
pub const EXIT_GRACE: Duration = Duration::from_secs(5);
/// How long background tasks (collection, streaming and metrics servers, the API-server
/// watch) get to stop after the shutdown signal before they are aborted.
const BACKGROUND_GRACE: Duration = Duration::from_secs(2);

/// Holds the root's lock file for the daemon's lifetime.
pub struct RootLock {
    _lock: Flock<File>,
}

/// Refuses to run two daemons on one root: an exclusive `flock` on `<root>/minicri.lock`, which
/// holds the owner's pid for the error message. The kernel drops the lock when the process dies.
pub fn lock_root(root: &Path) -> anyhow::Result<RootLock> {
    fs::create_dir_all(root).with_context(|| format!("creating root {}", root.display()))?;
    let path = root.join("minicri.lock");
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(mut lock) => {
            lock.set_len(0)?;
            lock.rewind()?;
            write!(lock, "{}", std::process::id())?;
            Ok(RootLock { _lock: lock })
        }
        Err((mut file, _)) => {
            let mut pid = String::new();
            let _ = file.read_to_string(&mut pid);
            bail!(
                "another minicri (pid {}) is already serving root {}; stop it or choose another --root",
                pid.trim(),
                root.display()
            )
        }
    }
}

/// Binds the socket: a socket file nobody answers on is stale and replaced; a live one is refused.
async fn bind_socket(path: &Path) -> anyhow::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    if path.exists() {
        if tokio::net::UnixStream::connect(path).await.is_ok() {
            bail!("socket {} is in use by another server", path.display());
        }
        fs::remove_file(path)
            .with_context(|| format!("removing stale socket {}", path.display()))?;
        tracing::info!(socket = %path.display(), "removed stale socket");
    }
    let listener =
        UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o660))
        .with_context(|| format!("setting mode of {}", path.display()))?;
    Ok(listener)
}

/// Removes the socket file when serving ends.
struct SocketGuard(PathBuf);

impl Drop for SocketGuard {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// Runs the daemon until SIGTERM or SIGINT.
pub async fn serve(config: Config, notifier: crate::sdnotify::Notifier) -> anyhow::Result<()> {
    // Modes below are given explicitly; whatever else the daemon creates gets at most 0755.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o022));
    let _lock = lock_root(&config.daemon.root)?;
    fs::create_dir_all(&config.daemon.state)
        .with_context(|| format!("creating state dir {}", config.daemon.state.display()))?;
    crate::fsutil::private_layout(&config.daemon.root, &config.daemon.state)?;
    let socket = config.daemon.socket.clone();
    let daemon = Arc::new(Daemon::open(config)?);
    // Operations a killed daemon left half-done are undone before any call is answered.
    daemon.pods.finish_interrupted().await;
    // ...and networks whose undo could not be finished are torn down in the background.
    daemon.pods.sweep_networks();
    // Which runtime handlers work here, found out before any pod can ask for one.
    daemon.pods.probe_handlers().await;

    let routes = tonic::service::Routes::new(
        RuntimeServiceServer::new(RuntimeHandler {
            daemon: daemon.clone(),
        })
        .max_decoding_message_size(MAX_MESSAGE_SIZE)
        .max_encoding_message_size(MAX_MESSAGE_SIZE),
    )
    .add_service(
        ImageServiceServer::new(ImageHandler {
            daemon: daemon.clone(),
        })
        .max_decoding_message_size(MAX_MESSAGE_SIZE)
        .max_encoding_message_size(MAX_MESSAGE_SIZE),
    )
    .add_service(PullsServer::new(PullsHandler {
        daemon: daemon.clone(),
    }))
    .prepare();

    // Every background task stops when `shutdown` is cancelled, and is awaited (with a bound).
    let shutdown = tokio_util::sync::CancellationToken::new();
    let mut background = vec![
        // Partial downloads nobody resumes are collected after their TTL, or sooner when space
        // is low.
        minicri_store::gc::spawn_periodic(
            daemon.ingest_gc.clone(),
            Duration::from_secs(60),
            shutdown.clone(),
        ),
        daemon
            .streaming
            .spawn(daemon.pods.clone(), shutdown.clone())?,
        crate::idle::spawn(daemon.clone(), shutdown.clone()),
    ];
    if let Some(addr) = daemon.config.daemon.metrics_address {
        background.push(crate::metrics::spawn(addr, daemon.clone(), shutdown.clone()).await?);
    }
    if let Some(watch) = spawn_kube_watch(&daemon, shutdown.clone()) {
        background.push(watch);
        // Pull progress in the pods' events, with the watch's credentials.
        background.push(tokio::spawn(crate::kube_watch::events::run(
            daemon.pulls.clone(),
            daemon.kube.clone(),
            shutdown.clone(),
        )));
    }
    let listener = bind_socket(&socket).await?;
    let _socket_guard = SocketGuard(socket.clone());
    tracing::info!(socket = %socket.display(), version = env!("CARGO_PKG_VERSION"), "minicri serving");
    notifier.notify("READY=1");

    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let graceful = GracefulShutdown::new();
    let builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    loop {
        tokio::select! {
            conn = listener.accept() => {
                let (stream, _) = match conn {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        continue;
                    }
                };
                let svc = TowerToHyperService::new(routes.clone());
                let conn = builder.serve_connection(TokioIo::new(stream), svc);
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(error = %e, "connection ended with an error");
                    }
                });
            }
            _ = sigterm.recv() => { tracing::info!("SIGTERM: shutting down"); break; }
            _ = sigint.recv() => { tracing::info!("SIGINT: shutting down"); break; }
        }
    }
    notifier.notify("STOPPING=1");
    drop(listener);
    shutdown.cancel();
    if tokio::time::timeout(
        BACKGROUND_GRACE,
        futures::future::join_all(background.iter_mut()),
    )
    .await
    .is_err()
    {
        tracing::warn!("background tasks still running after {BACKGROUND_GRACE:?}; stopping them");
        for t in &background {
            t.abort();
        }
    }
    // Pulls end first, with their unpacks (their PullImage calls then return at once); their
    // partial data and the sandboxes' hold records stay for the next start.
    if daemon.pulls.shutdown(PULL_STOP_GRACE).await {
        tracing::info!("pulls stopped");
    }
    tokio::select! {
        _ = graceful.shutdown() => tracing::info!("all connections closed"),
        _ = tokio::time::sleep(SHUTDOWN_GRACE) => tracing::warn!("shutdown grace period over; closing remaining calls"),
    }
    Ok(())
}

/// Starts the API-server watch unless it is off: a pod of this node seen deleted has its pull
/// references dropped at once, and a pod it follows has its pulls held past their detach window
/// (see docs/kubelet-release.md).
fn spawn_kube_watch(
    daemon: &Arc<Daemon>,
    shutdown: tokio_util::sync::CancellationToken,
) -> Option<tokio::task::JoinHandle<()>> {
    use crate::kube_watch::DeletedPod;
    let Some(w) = daemon.config.daemon.kube_watch() else {
        tracing::info!("the API-server watch is off (daemon.kube_watch = \"off\")");
        return None;
    };
    let pulls = daemon.pulls.clone();
    let on_deleted = Arc::new(move |p: &DeletedPod| {
        let reason = format!(
            "pod {}/{} (uid {}) was deleted in the API server ({})",
            p.namespace, p.name, p.uid, p.cause
        );
        let n = pulls.close_pod_uid(&p.uid, &reason);
        tracing::info!(pod = %format!("{}/{}", p.namespace, p.name), uid = %p.uid, cause = %p.cause, references_dropped = n, "pod deleted: its pulls are dropped");
    });
    let state = daemon.kube.clone();
    // While the watch follows a pod, its pulls need not detach (kube_watch/hold.rs).
    daemon
        .pulls
        .set_detach_policy(Arc::new(crate::kube_watch::hold::WatchHoldPolicy::new(
            state.clone(),
            daemon.images.clone(),
        )));
    Some(tokio::spawn(async move {
        if let Err(e) = crate::kube_watch::run(w, state, on_deleted, shutdown).await {
            tracing::error!(error = %e, "the API-server watch stopped");
        }
    }))
}

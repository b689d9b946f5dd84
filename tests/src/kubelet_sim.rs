//! Owns [`KubeletSim`]: a kubelet simulator that drives a real minicri daemon over the CRI the
//! way the kubelet's pod workers and image pullers do, and records a timestamped event log per
//! pod, so tests can show what a kubelet experiences when a pod is deleted while its pod worker
//! is blocked in PullImage.
//!
//! It models these behaviours of the kubelet (its pod workers, its image manager and pullers,
//! and the container loop of its runtime manager's pod sync), and nothing more:
//! - One pod worker per pod runs syncs one at a time. A sync runs a sandbox if the pod has no
//!   ready one (host network; a sandbox found not ready is stopped and replaced with the next
//!   attempt), then handles each container not yet started, in order.
//! - Per container, EnsureImageExists. With pull policy IfNotPresent: ImageStatus first
//!   (present: use it, no back-off check, no pull); absent and the `<podUID>_<image>` key in
//!   back-off: ImagePullBackOff without PullImage; otherwise PullImage (no credentials, the pod's
//!   sandbox config) through the puller, with no deadline and never cancelled. With `Always`: no
//!   ImageStatus; the back-off is checked first (no CRI call while backing off), then PullImage. A failed pull records
//!   ErrImagePull and starts or extends the key's back-off (base doubling to max, no jitter; an
//!   entry idle for more than twice the max starts again at the base). Success: CreateContainer
//!   and StartContainer. A failure does not stop the container loop.
//! - A sync with any failure requeues the pod after [`SimConfig::requeue`]; a sync that started
//!   everything leaves the pod Running until it is deleted.
//! - Pullers: [`Puller::Serial`] is one task reading a FIFO queue of at most 10 requests, one
//!   PullImage at a time across all pods; [`Puller::Parallel`] allows N PullImage calls at once.
//!   Neither looks at the pod's deletion before calling the runtime: a pod deleted while its
//!   request is queued is still pulled.
//! - [`KubeletSim::delete_pod`] only sets a flag (and marks the pod deleted in the API server
//!   with [`SimConfig::api`], and calls [`SimConfig::on_delete`]). A worker notices it only between syncs: a sync in progress
//!   runs to its end (every remaining container's pull and start included: the kubelet's
//!   container loop does not look at the pod's deletion), and a worker idle between syncs
//!   notices it at once (the kubelet's pod update wakes it). It then terminates the pod:
//!   StopContainer, StopPodSandbox, RemoveContainer, RemovePodSandbox; the pod is gone.
//!
//! Simplifications: only regular containers (no init containers, probes or restarts of exited
//! containers); no periodic resync of a Running pod. RPCs other than
//! PullImage get the kubelet's 2-minute runtime request timeout; termination gives up after
//! [`TERMINATION_ATTEMPTS`] failed rounds, where the kubelet would retry forever.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use minicri_proto::MAX_MESSAGE_SIZE;
use minicri_proto::runtime::v1 as cri;
use minicri_proto::runtime::v1::image_service_client::ImageServiceClient;
use minicri_proto::runtime::v1::runtime_service_client::RuntimeServiceClient;
use tokio::sync::{Notify, Semaphore, mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tonic::transport::Channel;

use crate::daemon::Daemon;

/// The kubelet's `runtimeRequestTimeout`: the deadline of every CRI call but PullImage.
pub const RUNTIME_REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// The serial puller's queue length (the kubelet's `maxImagePullRequests`).
pub const SERIAL_QUEUE: usize = 10;

/// Rounds of termination calls before a worker gives a pod up (see the module docs).
pub const TERMINATION_ATTEMPTS: u32 = 5;

/// How pulls are dispatched: the kubelet's `serializeImagePulls` (true by default) or
/// `maxParallelImagePulls`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Puller {
    /// One PullImage at a time for the whole node, in the order the workers asked.
    Serial,
    /// At most this many PullImage calls at once.
    Parallel(usize),
}

/// Called with the pod's uid when [`KubeletSim::delete_pod`] is called, before the worker is
/// told: where a test marks the pod's deletion in an API server the runtime watches.
pub type DeleteHook = Arc<dyn Fn(&str) + Send + Sync>;

/// The API server the simulated pods live in: [`KubeletSim::create_pod`] adds each pod there
/// (bound to [`PodSpec::node`], else `node`, with its images) before its worker starts, and
/// [`KubeletSim::delete_pod`] marks it deleted, as `kubectl delete pod` would.
#[derive(Clone)]
pub struct SimApi {
    pub server: Arc<crate::apiserver::ApiServer>,
    pub node: String,
}

/// The kubelet's image pull policies the simulator models.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PullPolicy {
    #[default]
    IfNotPresent,
    Always,
}

/// The simulator's knobs. [`Default`] gives the kubelet's values; tests shorten the times.
#[derive(Clone)]
pub struct SimConfig {
    /// First image pull back-off (kubelet: 10 s).
    pub backoff_base: Duration,
    /// Longest image pull back-off (kubelet: 300 s).
    pub backoff_max: Duration,
    /// Delay before a pod whose sync failed is synced again (kubelet: 10–15 s).
    pub requeue: Duration,
    /// StopContainer's timeout in seconds (the pod's termination grace period; kubelet: 30).
    pub grace_period_secs: i64,
    pub puller: Puller,
    pub on_delete: Option<DeleteHook>,
    /// Where pods are registered and deleted, if anywhere.
    pub api: Option<SimApi>,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            backoff_base: Duration::from_secs(10),
            backoff_max: Duration::from_secs(300),
            requeue: Duration::from_secs(10),
            grace_period_secs: 30,
            puller: Puller::Serial,
            on_delete: None,
            api: None,
        }
    }
}

/// A pod: one container per image, named `c0`, `c1`, …, each running `command`.
#[derive(Clone, Debug)]
pub struct PodSpec {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub images: Vec<String>,
    pub command: Vec<String>,
    pub pull_policy: PullPolicy,
    /// The node the pod is bound to in the API server ([`SimApi`]; default: its node).
    pub node: Option<String>,
}

impl PodSpec {
    /// A pod `name` in namespace `kubesim` with a fresh uid (`<name>-<hex>`), running
    /// `sleep 3600` in a container per image.
    pub fn new(name: &str, images: &[&str]) -> PodSpec {
        PodSpec {
            namespace: "kubesim".into(),
            name: name.into(),
            uid: format!("{name}-{}", crate::pod_env::unique_hex()),
            images: images.iter().map(|s| s.to_string()).collect(),
            command: vec!["sleep".into(), "3600".into()],
            pull_policy: PullPolicy::IfNotPresent,
            node: None,
        }
    }

    /// The same pod with pull policy `Always`.
    pub fn always(mut self) -> PodSpec {
        self.pull_policy = PullPolicy::Always;
        self
    }
}

/// How a PullImage call failed.
#[derive(Clone, Debug, PartialEq)]
pub struct PullFailure {
    pub code: tonic::Code,
    pub message: String,
}

/// What happened to a pod, in the order it happened. Images are named as in the [`PodSpec`].
#[derive(Clone, Debug, PartialEq)]
pub enum EventKind {
    SyncStarted,
    /// A sandbox was run (its id).
    SandboxReady(String),
    /// ImageStatus found the image: no back-off check, no pull.
    ImagePresent(String),
    /// Image absent and its key in back-off: ImagePullBackOff, no PullImage.
    BackOff(String),
    /// The worker handed the pull to the puller (it may wait for a queue slot).
    PullQueued(String),
    /// The puller called PullImage.
    PullStarted(String),
    /// PullImage returned: the image ref, or the failure. `held`: how long the call took.
    PullReturned {
        image: String,
        result: Result<String, PullFailure>,
        held: Duration,
    },
    /// The failed pull's message and the back-off it started.
    ErrImagePull {
        image: String,
        message: String,
        backoff: Duration,
    },
    /// CreateContainer and StartContainer succeeded.
    ContainerStarted {
        image: String,
        id: String,
    },
    /// Every container has started.
    Running,
    /// A CRI call other than PullImage failed.
    RpcFailed {
        rpc: &'static str,
        message: String,
    },
    /// [`KubeletSim::delete_pod`] was called.
    DeletionRequested,
    /// The worker saw the deletion and starts terminating the pod.
    DeletionNoticed,
    ContainerStopped(String),
    SandboxStopped(String),
    ContainerRemoved(String),
    SandboxRemoved(String),
    /// Terminated: the worker has exited.
    Gone,
}

/// One entry of a pod's event log.
#[derive(Clone, Debug, PartialEq)]
pub struct SimEvent {
    pub at: Instant,
    pub kind: EventKind,
}

/// Where a pod's worker is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Pending,
    Running,
    Terminating,
    Gone,
}

/// The image pull back-off of the kubelet's image manager (`flowcontrol.Backoff`, no jitter).
#[derive(Debug)]
struct Backoff {
    base: Duration,
    max: Duration,
    /// key → (current back-off, last update).
    entries: HashMap<String, (Duration, Instant)>,
}

impl Backoff {
    fn in_backoff(&self, key: &str, now: Instant) -> bool {
        self.entries
            .get(key)
            .is_some_and(|(d, last)| now.saturating_duration_since(*last) < *d)
    }

    /// Starts or doubles the key's back-off; returns it.
    fn next(&mut self, key: &str, now: Instant) -> Duration {
        let d = match self.entries.get(key) {
            Some((d, last)) if now.saturating_duration_since(*last) <= 2 * self.max => {
                (*d * 2).min(self.max)
            }
            _ => self.base,
        };
        self.entries.insert(key.to_string(), (d, now));
        d
    }
}

/// The kubelet's `applyDefaultImageTag`: `:latest` for an image with neither tag nor digest.
fn with_default_tag(image: &str) -> String {
    let last = image.rsplit('/').next().unwrap_or(image);
    if image.contains('@') || last.contains(':') {
        image.to_string()
    } else {
        format!("{image}:latest")
    }
}

struct PodRecord {
    events: Vec<SimEvent>,
    phase: Phase,
    deleted: bool,
    sandbox_id: Option<String>,
    wake: Arc<Notify>,
}

struct State {
    pods: HashMap<String, PodRecord>,
    backoff: Backoff,
}

/// What workers and pullers share: the pods' records and a signal for waiters.
struct Core {
    state: Mutex<State>,
    changed: watch::Sender<()>,
}

impl Core {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn record(&self, uid: &str, kind: EventKind) -> Instant {
        let at = Instant::now();
        if let Some(p) = self.lock().pods.get_mut(uid) {
            p.events.push(SimEvent { at, kind });
        }
        self.changed.send_modify(|_| {});
        at
    }

    fn update(&self, uid: &str, f: impl FnOnce(&mut PodRecord)) {
        if let Some(p) = self.lock().pods.get_mut(uid) {
            f(p);
        }
        self.changed.send_modify(|_| {});
    }

    fn deleted(&self, uid: &str) -> bool {
        self.lock().pods.get(uid).is_some_and(|p| p.deleted)
    }
}

type PullOutcome = Result<String, PullFailure>;

struct PullRequest {
    uid: String,
    /// As in the pod spec (for the events).
    image: String,
    /// As sent to the runtime.
    pull_name: String,
    sandbox: cri::PodSandboxConfig,
    reply: oneshot::Sender<PullOutcome>,
}

enum PullerHandle {
    Serial(mpsc::Sender<PullRequest>),
    Parallel(Arc<Semaphore>),
}

/// One PullImage call, as both pullers make it: no deadline, no credentials.
async fn pull_image(
    core: &Core,
    images: &mut ImageServiceClient<Channel>,
    req: &PullRequest,
) -> PullOutcome {
    let started = core.record(&req.uid, EventKind::PullStarted(req.image.clone()));
    let res = images
        .pull_image(cri::PullImageRequest {
            image: Some(cri::ImageSpec {
                image: req.pull_name.clone(),
                ..Default::default()
            }),
            auth: None,
            sandbox_config: Some(req.sandbox.clone()),
        })
        .await;
    let held = started.elapsed();
    let result = res
        .map(|r| r.into_inner().image_ref)
        .map_err(|s| PullFailure {
            code: s.code(),
            message: s.message().to_string(),
        });
    core.record(
        &req.uid,
        EventKind::PullReturned {
            image: req.image.clone(),
            result: result.clone(),
            held,
        },
    );
    result
}

async fn serial_puller(
    core: Arc<Core>,
    mut images: ImageServiceClient<Channel>,
    mut queue: mpsc::Receiver<PullRequest>,
) {
    while let Some(req) = queue.recv().await {
        let outcome = pull_image(&core, &mut images, &req).await;
        let _ = req.reply.send(outcome);
    }
}

struct Inner {
    cfg: SimConfig,
    core: Arc<Core>,
    runtime: RuntimeServiceClient<Channel>,
    images: ImageServiceClient<Channel>,
    puller: PullerHandle,
    /// The serial puller's task.
    puller_task: Option<JoinHandle<()>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl Inner {
    /// Hands a pull to the puller and waits for its result, as EnsureImageExists does.
    async fn pull(&self, uid: &str, image: &str, sandbox: &cri::PodSandboxConfig) -> PullOutcome {
        self.core
            .record(uid, EventKind::PullQueued(image.to_string()));
        let (reply, result) = oneshot::channel();
        let req = PullRequest {
            uid: uid.to_string(),
            image: image.to_string(),
            pull_name: with_default_tag(image),
            sandbox: sandbox.clone(),
            reply,
        };
        let stopped = || PullFailure {
            code: tonic::Code::Unavailable,
            message: "the simulator's puller has stopped".into(),
        };
        match &self.puller {
            PullerHandle::Serial(queue) => {
                queue.send(req).await.map_err(|_| stopped())?;
                result.await.map_err(|_| stopped())?
            }
            PullerHandle::Parallel(tokens) => {
                let _token = tokens.acquire().await.map_err(|_| stopped())?;
                pull_image(&self.core, &mut self.images.clone(), &req).await
            }
        }
    }
}

/// A CRI request with the kubelet's runtime request timeout.
fn timed<T>(msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(RUNTIME_REQUEST_TIMEOUT);
    r
}

enum SyncOutcome {
    AllStarted,
    Failed,
    DeletionNoticed,
}

enum Ensure {
    Ref(String),
    Failed,
}

/// One pod's worker: its view of the pod's sandboxes and containers.
struct Worker {
    inner: Arc<Inner>,
    spec: PodSpec,
    wake: Arc<Notify>,
    /// The sandbox in use: (id, config).
    sandbox: Option<(String, cri::PodSandboxConfig)>,
    /// Every sandbox run for the pod, in order.
    sandboxes: Vec<String>,
    next_attempt: u32,
    /// Per container: the id once started.
    started: Vec<Option<String>>,
    /// Per container: CreateContainer calls so far (the next attempt number).
    creations: Vec<u32>,
    /// Every container created for the pod.
    created: Vec<String>,
}

impl Worker {
    fn uid(&self) -> &str {
        &self.spec.uid
    }

    fn record(&self, kind: EventKind) -> Instant {
        self.inner.core.record(&self.spec.uid, kind)
    }

    fn rpc_failed(&self, rpc: &'static str, s: tonic::Status) {
        self.record(EventKind::RpcFailed {
            rpc,
            message: format!("{:?}: {}", s.code(), s.message()),
        });
    }

    fn deleted(&self) -> bool {
        self.inner.core.deleted(self.uid())
    }

    fn notice_deletion(&self) {
        self.record(EventKind::DeletionNoticed);
        self.inner
            .core
            .update(self.uid(), |p| p.phase = Phase::Terminating);
    }

    async fn run(mut self) {
        loop {
            if self.deleted() {
                self.notice_deletion();
                break;
            }
            self.record(EventKind::SyncStarted);
            let wait = match self.sync().await {
                SyncOutcome::DeletionNoticed => break,
                SyncOutcome::AllStarted => {
                    let mut first = false;
                    self.inner.core.update(self.uid(), |p| {
                        first = p.phase == Phase::Pending;
                        if first {
                            p.phase = Phase::Running;
                        }
                    });
                    if first {
                        self.record(EventKind::Running);
                    }
                    None
                }
                SyncOutcome::Failed => Some(self.inner.cfg.requeue),
            };
            // Idle until the requeue (after a failure) or a deletion wakes the worker.
            let requeue = async {
                match wait {
                    Some(d) => tokio::time::sleep(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = requeue => {}
            }
        }
        self.terminate().await;
    }

    fn sandbox_config(&self, attempt: u32) -> cri::PodSandboxConfig {
        let s = &self.spec;
        cri::PodSandboxConfig {
            metadata: Some(cri::PodSandboxMetadata {
                name: s.name.clone(),
                namespace: s.namespace.clone(),
                uid: s.uid.clone(),
                attempt,
            }),
            labels: [
                ("io.kubernetes.pod.name".to_string(), s.name.clone()),
                (
                    "io.kubernetes.pod.namespace".to_string(),
                    s.namespace.clone(),
                ),
                ("io.kubernetes.pod.uid".to_string(), s.uid.clone()),
            ]
            .into(),
            linux: Some(cri::LinuxPodSandboxConfig {
                security_context: Some(cri::LinuxSandboxSecurityContext {
                    namespace_options: Some(cri::NamespaceOption {
                        network: cri::NamespaceMode::Node as i32,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// Whether the sandbox in use is still ready (PodSandboxStatus); `Err` when it cannot tell.
    async fn sandbox_ready(&self) -> Result<bool, tonic::Status> {
        let Some((id, _)) = &self.sandbox else {
            return Ok(false);
        };
        let mut rt = self.inner.runtime.clone();
        match rt
            .pod_sandbox_status(timed(cri::PodSandboxStatusRequest {
                pod_sandbox_id: id.clone(),
                verbose: false,
            }))
            .await
        {
            Ok(r) => Ok(r
                .into_inner()
                .status
                .is_some_and(|s| s.state == cri::PodSandboxState::SandboxReady as i32)),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(false),
            Err(s) => Err(s),
        }
    }

    async fn sync(&mut self) -> SyncOutcome {
        match self.sandbox_ready().await {
            Err(s) => {
                self.rpc_failed("PodSandboxStatus", s);
                return SyncOutcome::Failed;
            }
            Ok(true) => {}
            Ok(false) => {
                // A sandbox that is no longer ready: kill the pod, then start over with the
                // next attempt.
                if self.sandbox.take().is_some() {
                    self.kill().await;
                    self.started.iter_mut().for_each(|c| *c = None);
                }
                let config = self.sandbox_config(self.next_attempt);
                let mut rt = self.inner.runtime.clone();
                match rt
                    .run_pod_sandbox(timed(cri::RunPodSandboxRequest {
                        config: Some(config.clone()),
                        runtime_handler: String::new(),
                    }))
                    .await
                {
                    Ok(r) => {
                        let id = r.into_inner().pod_sandbox_id;
                        self.next_attempt += 1;
                        self.sandboxes.push(id.clone());
                        self.sandbox = Some((id.clone(), config));
                        let sid = id.clone();
                        self.inner
                            .core
                            .update(self.uid(), |p| p.sandbox_id = Some(sid));
                        self.record(EventKind::SandboxReady(id));
                    }
                    Err(s) => {
                        self.rpc_failed("RunPodSandbox", s);
                        return SyncOutcome::Failed;
                    }
                }
            }
        }
        let mut failed = false;
        for i in 0..self.spec.images.len() {
            if self.started[i].is_some() {
                continue;
            }
            let image = self.spec.images[i].clone();
            match self.ensure_image(&image).await {
                Ensure::Failed => failed = true,
                Ensure::Ref(image_ref) => {
                    if !self.start_container(i, &image, image_ref).await {
                        failed = true;
                    }
                }
            }
        }
        // The sync is over: only now does the worker act on a deletion that came during it.
        if self.deleted() {
            self.notice_deletion();
            return SyncOutcome::DeletionNoticed;
        }
        if failed {
            SyncOutcome::Failed
        } else {
            SyncOutcome::AllStarted
        }
    }

    /// EnsureImageExists for the pod's pull policy.
    async fn ensure_image(&self, image: &str) -> Ensure {
        if self.spec.pull_policy == PullPolicy::IfNotPresent
            && let Some(found) = self.image_status(image).await
        {
            return found;
        }
        let key = format!("{}_{image}", self.uid());
        let in_backoff = self
            .inner
            .core
            .lock()
            .backoff
            .in_backoff(&key, Instant::now());
        if in_backoff {
            self.record(EventKind::BackOff(image.to_string()));
            return Ensure::Failed;
        }
        let sandbox = self
            .sandbox
            .as_ref()
            .expect("a sandbox before pulls")
            .1
            .clone();
        let outcome = self.inner.pull(self.uid(), image, &sandbox).await;
        match outcome {
            Ok(image_ref) => Ensure::Ref(image_ref),
            Err(f) => {
                let backoff = self.inner.core.lock().backoff.next(&key, Instant::now());
                self.record(EventKind::ErrImagePull {
                    image: image.to_string(),
                    message: f.message,
                    backoff,
                });
                Ensure::Failed
            }
        }
    }

    /// ImageStatus before the back-off check (IfNotPresent): the outcome if the image is there
    /// or the call failed, `None` to go on.
    async fn image_status(&self, image: &str) -> Option<Ensure> {
        let mut images = self.inner.images.clone();
        match images
            .image_status(timed(cri::ImageStatusRequest {
                image: Some(cri::ImageSpec {
                    image: with_default_tag(image),
                    ..Default::default()
                }),
                verbose: false,
            }))
            .await
        {
            Err(s) => {
                self.rpc_failed("ImageStatus", s);
                Some(Ensure::Failed)
            }
            Ok(r) => {
                let img = r.into_inner().image?;
                self.record(EventKind::ImagePresent(image.to_string()));
                Some(Ensure::Ref(img.id))
            }
        }
    }

    /// CreateContainer and StartContainer of container `i`; whether both succeeded.
    async fn start_container(&mut self, i: usize, image: &str, image_ref: String) -> bool {
        let (sandbox_id, sandbox_config) = self.sandbox.clone().expect("a sandbox");
        let name = format!("c{i}");
        let attempt = self.creations[i];
        self.creations[i] += 1;
        let s = &self.spec;
        let config = cri::ContainerConfig {
            metadata: Some(cri::ContainerMetadata {
                name: name.clone(),
                attempt,
            }),
            image: Some(cri::ImageSpec {
                image: image_ref,
                user_specified_image: image.to_string(),
                ..Default::default()
            }),
            command: s.command.clone(),
            labels: [
                ("io.kubernetes.container.name".to_string(), name),
                ("io.kubernetes.pod.name".to_string(), s.name.clone()),
                (
                    "io.kubernetes.pod.namespace".to_string(),
                    s.namespace.clone(),
                ),
                ("io.kubernetes.pod.uid".to_string(), s.uid.clone()),
            ]
            .into(),
            ..Default::default()
        };
        let mut rt = self.inner.runtime.clone();
        let id = match rt
            .create_container(timed(cri::CreateContainerRequest {
                pod_sandbox_id: sandbox_id,
                config: Some(config),
                sandbox_config: Some(sandbox_config),
            }))
            .await
        {
            Ok(r) => r.into_inner().container_id,
            Err(s) => {
                self.rpc_failed("CreateContainer", s);
                return false;
            }
        };
        self.created.push(id.clone());
        if let Err(s) = rt
            .start_container(timed(cri::StartContainerRequest {
                container_id: id.clone(),
            }))
            .await
        {
            self.rpc_failed("StartContainer", s);
            return false;
        }
        self.started[i] = Some(id.clone());
        self.record(EventKind::ContainerStarted {
            image: image.to_string(),
            id,
        });
        true
    }

    /// StopContainer of every container created, StopPodSandbox of every sandbox; whether all
    /// calls succeeded.
    async fn kill(&self) -> bool {
        let mut rt = self.inner.runtime.clone();
        let mut ok = true;
        for id in &self.created {
            let mut req = tonic::Request::new(cri::StopContainerRequest {
                container_id: id.clone(),
                timeout: self.inner.cfg.grace_period_secs,
            });
            // cri-client: the grace period on top of the runtime request timeout.
            req.set_timeout(
                RUNTIME_REQUEST_TIMEOUT
                    + Duration::from_secs(self.inner.cfg.grace_period_secs.max(0) as u64),
            );
            match rt.stop_container(req).await {
                Ok(_) => {
                    self.record(EventKind::ContainerStopped(id.clone()));
                }
                Err(s) => {
                    ok = false;
                    self.rpc_failed("StopContainer", s);
                }
            }
        }
        for id in &self.sandboxes {
            match rt
                .stop_pod_sandbox(timed(cri::StopPodSandboxRequest {
                    pod_sandbox_id: id.clone(),
                }))
                .await
            {
                Ok(_) => {
                    self.record(EventKind::SandboxStopped(id.clone()));
                }
                Err(s) => {
                    ok = false;
                    self.rpc_failed("StopPodSandbox", s);
                }
            }
        }
        ok
    }

    /// Removes the containers and sandboxes; whether all calls succeeded.
    async fn remove(&self) -> bool {
        let mut rt = self.inner.runtime.clone();
        let mut ok = true;
        for id in &self.created {
            match rt
                .remove_container(timed(cri::RemoveContainerRequest {
                    container_id: id.clone(),
                }))
                .await
            {
                Ok(_) => {
                    self.record(EventKind::ContainerRemoved(id.clone()));
                }
                Err(s) => {
                    ok = false;
                    self.rpc_failed("RemoveContainer", s);
                }
            }
        }
        for id in &self.sandboxes {
            match rt
                .remove_pod_sandbox(timed(cri::RemovePodSandboxRequest {
                    pod_sandbox_id: id.clone(),
                }))
                .await
            {
                Ok(_) => {
                    self.record(EventKind::SandboxRemoved(id.clone()));
                }
                Err(s) => {
                    ok = false;
                    self.rpc_failed("RemovePodSandbox", s);
                }
            }
        }
        ok
    }

    /// Terminates the pod (every call is idempotent, so a failed round is repeated whole).
    async fn terminate(&mut self) {
        for _ in 0..TERMINATION_ATTEMPTS {
            let killed = self.kill().await;
            if killed && self.remove().await {
                break;
            }
            tokio::time::sleep(self.inner.cfg.requeue).await;
        }
        self.record(EventKind::Gone);
        self.inner
            .core
            .update(self.uid(), |p| p.phase = Phase::Gone);
    }
}

/// The simulated kubelet: pod workers and an image puller over one connection to the daemon.
/// Dropping it aborts its tasks (a test that fails half-way); [`KubeletSim::shutdown`]
/// terminates the pods first.
pub struct KubeletSim {
    inner: Arc<Inner>,
}

impl KubeletSim {
    /// A simulator talking to the daemon over `channel`. Call within a tokio runtime.
    pub fn new(channel: Channel, cfg: SimConfig) -> KubeletSim {
        let runtime = RuntimeServiceClient::new(channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_SIZE)
            .max_encoding_message_size(MAX_MESSAGE_SIZE);
        let images = ImageServiceClient::new(channel)
            .max_decoding_message_size(MAX_MESSAGE_SIZE)
            .max_encoding_message_size(MAX_MESSAGE_SIZE);
        let core = Arc::new(Core {
            state: Mutex::new(State {
                pods: HashMap::new(),
                backoff: Backoff {
                    base: cfg.backoff_base,
                    max: cfg.backoff_max,
                    entries: HashMap::new(),
                },
            }),
            changed: watch::Sender::new(()),
        });
        let (puller, puller_task) = match cfg.puller {
            Puller::Serial => {
                let (tx, rx) = mpsc::channel(SERIAL_QUEUE);
                let task = tokio::spawn(serial_puller(core.clone(), images.clone(), rx));
                (PullerHandle::Serial(tx), Some(task))
            }
            Puller::Parallel(n) => (
                PullerHandle::Parallel(Arc::new(Semaphore::new(n.max(1)))),
                None,
            ),
        };
        KubeletSim {
            inner: Arc::new(Inner {
                cfg,
                core,
                runtime,
                images,
                puller,
                puller_task,
                workers: Mutex::new(Vec::new()),
            }),
        }
    }

    /// [`KubeletSim::new`] on a fresh channel to `daemon`.
    pub async fn for_daemon(daemon: &Daemon, cfg: SimConfig) -> Result<KubeletSim> {
        Ok(KubeletSim::new(daemon.channel().await?, cfg))
    }

    /// Starts the pod's worker, after adding the pod to the API server ([`SimConfig::api`]).
    /// Panics if the uid is taken.
    pub fn create_pod(&self, spec: PodSpec) {
        if let Some(api) = &self.inner.cfg.api {
            let node = spec.node.as_deref().unwrap_or(&api.node);
            api.server.add_pod_with_images(
                &spec.namespace,
                &spec.name,
                &spec.uid,
                node,
                &spec.images,
            );
        }
        let wake = Arc::new(Notify::new());
        {
            let mut st = self.inner.core.lock();
            assert!(
                !st.pods.contains_key(&spec.uid),
                "pod uid {} already used",
                spec.uid
            );
            st.pods.insert(
                spec.uid.clone(),
                PodRecord {
                    events: Vec::new(),
                    phase: Phase::Pending,
                    deleted: false,
                    sandbox_id: None,
                    wake: wake.clone(),
                },
            );
        }
        let n = spec.images.len();
        let worker = Worker {
            inner: self.inner.clone(),
            spec,
            wake,
            sandbox: None,
            sandboxes: Vec::new(),
            next_attempt: 0,
            started: vec![None; n],
            creations: vec![0; n],
            created: Vec::new(),
        };
        let task = tokio::spawn(worker.run());
        self.workers().push(task);
    }

    /// Marks the pod deleted: records DeletionRequested, calls the [`SimConfig::on_delete`]
    /// hook, and tells the worker, which acts on it at its next step (see the module docs).
    /// A second call does nothing. Panics for an unknown uid.
    pub fn delete_pod(&self, uid: &str) {
        if self.request_deletion(uid) {
            if let Some(api) = &self.inner.cfg.api {
                api.server.mark_deleted(uid);
            }
            if let Some(hook) = &self.inner.cfg.on_delete {
                hook(uid);
            }
            self.wake(uid);
        }
    }

    /// Sets the pod's deletion flag and records DeletionRequested; false if it was set already.
    fn request_deletion(&self, uid: &str) -> bool {
        {
            let mut st = self.inner.core.lock();
            let p = st
                .pods
                .get_mut(uid)
                .unwrap_or_else(|| panic!("no pod {uid}"));
            if p.deleted {
                return false;
            }
            p.deleted = true;
            p.events.push(SimEvent {
                at: Instant::now(),
                kind: EventKind::DeletionRequested,
            });
        }
        self.inner.core.changed.send_modify(|_| {});
        true
    }

    fn wake(&self, uid: &str) {
        let wake = self.inner.core.lock().pods.get(uid).map(|p| p.wake.clone());
        if let Some(w) = wake {
            w.notify_one();
        }
    }

    /// When the pod became Running (all containers started).
    pub async fn wait_running(&self, uid: &str, timeout: Duration) -> Result<Instant> {
        self.wait_for(uid, timeout, "Running", |events| {
            if let Some(e) = events.iter().find(|e| e.kind == EventKind::Running) {
                return Some(Ok(e.at));
            }
            events
                .iter()
                .any(|e| e.kind == EventKind::DeletionNoticed)
                .then(|| Err(anyhow!("the pod is terminating")))
        })
        .await
    }

    /// When the pod was gone (terminated, its worker exited).
    pub async fn wait_gone(&self, uid: &str, timeout: Duration) -> Result<Instant> {
        self.wait_for(uid, timeout, "gone", |events| {
            events
                .iter()
                .find(|e| e.kind == EventKind::Gone)
                .map(|e| Ok(e.at))
        })
        .await
    }

    /// Waits until `check` on the pod's events answers; the error names `what` and shows the
    /// pod's timeline.
    pub async fn wait_for<T>(
        &self,
        uid: &str,
        timeout: Duration,
        what: &str,
        mut check: impl FnMut(&[SimEvent]) -> Option<Result<T>>,
    ) -> Result<T> {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut changed = self.inner.core.changed.subscribe();
        loop {
            let answer = {
                let st = self.inner.core.lock();
                let pod = st.pods.get(uid).with_context(|| format!("no pod {uid}"))?;
                check(&pod.events)
            };
            match answer {
                Some(Ok(v)) => return Ok(v),
                Some(Err(e)) => bail!("pod {uid} not {what}: {e}\n{}", self.timeline(uid)),
                None => {}
            }
            if tokio::time::timeout_at(deadline, changed.changed())
                .await
                .is_err()
            {
                bail!(
                    "pod {uid} not {what} within {timeout:?}\n{}",
                    self.timeline(uid)
                );
            }
        }
    }

    /// The pod's events so far (empty for an unknown uid).
    pub fn events(&self, uid: &str) -> Vec<SimEvent> {
        self.inner
            .core
            .lock()
            .pods
            .get(uid)
            .map(|p| p.events.clone())
            .unwrap_or_default()
    }

    /// The pod's phase (`None` for an unknown uid).
    pub fn phase(&self, uid: &str) -> Option<Phase> {
        self.inner.core.lock().pods.get(uid).map(|p| p.phase)
    }

    /// The id of the pod's latest sandbox.
    pub fn sandbox_id(&self, uid: &str) -> Option<String> {
        self.inner
            .core
            .lock()
            .pods
            .get(uid)
            .and_then(|p| p.sandbox_id.clone())
    }

    /// The pod's events, one a line, in milliseconds since its first event.
    pub fn timeline(&self, uid: &str) -> String {
        let events = self.events(uid);
        let Some(t0) = events.first().map(|e| e.at) else {
            return format!("(no events for pod {uid})");
        };
        let mut out = String::new();
        for e in &events {
            let _ = writeln!(
                out,
                "{:>8.1} ms  {:?}",
                e.at.duration_since(t0).as_secs_f64() * 1e3,
                e.kind
            );
        }
        out
    }

    /// Deletes every pod (without the deletion hook: the kubelet is going away, the pods are
    /// not), waits for the workers to terminate them, and stops the puller. A worker blocked in
    /// PullImage finishes that call first.
    pub async fn shutdown(self) {
        let uids: Vec<String> = self.inner.core.lock().pods.keys().cloned().collect();
        for uid in &uids {
            self.request_deletion(uid);
            self.wake(uid);
        }
        let workers = std::mem::take(&mut *self.workers());
        for w in workers {
            let _ = w.await;
        }
        // Drop aborts the serial puller, idle now.
    }

    fn workers(&self) -> MutexGuard<'_, Vec<JoinHandle<()>>> {
        self.inner.workers.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for KubeletSim {
    fn drop(&mut self) {
        for w in self.workers().drain(..) {
            w.abort();
        }
        if let Some(p) = &self.inner.puller_task {
            p.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_the_max_and_resets_after_twice_the_max_idle() {
        let s = Duration::from_secs;
        let mut b = Backoff {
            base: s(10),
            max: s(40),
            entries: HashMap::new(),
        };
        let t0 = Instant::now();
        assert!(!b.in_backoff("k", t0));
        assert_eq!(b.next("k", t0), s(10));
        assert!(b.in_backoff("k", t0 + s(9)));
        assert!(!b.in_backoff("k", t0 + s(10)));
        assert_eq!(b.next("k", t0 + s(10)), s(20));
        assert_eq!(b.next("k", t0 + s(30)), s(40));
        assert_eq!(b.next("k", t0 + s(70)), s(40));
        assert!(!b.in_backoff("other", t0 + s(70)));
        // Idle for more than twice the max: back to the base.
        assert_eq!(b.next("k", t0 + s(70) + s(81)), s(10));
    }

    #[test]
    fn default_tag_only_where_there_is_neither_tag_nor_digest() {
        assert_eq!(with_default_tag("busybox"), "busybox:latest");
        assert_eq!(
            with_default_tag("127.0.0.1:5000/a/b"),
            "127.0.0.1:5000/a/b:latest"
        );
        assert_eq!(
            with_default_tag("127.0.0.1:5000/a/b:1"),
            "127.0.0.1:5000/a/b:1"
        );
        assert_eq!(with_default_tag("a/b@sha256:00"), "a/b@sha256:00");
    }
}

//! A recording fake of the pod service's two process seams, the OCI runtime ([`OciRuntime`])
//! and the container monitors ([`Monitors`]), for unit tests that run without root.
//!
//! Containers are rows in a table and monitors are rows whose exit the test decides
//! ([`Fake::exit`], [`Fake::lose_monitor`]). Every call is recorded as `"<op> <id>"`, and any
//! operation can be made to fail ([`Fake::fail`]) or to hang until released ([`Fake::hang`]),
//! so a test can stop the service at any step and check what it left or undid. Pids are above
//! the kernel's `pid_max`, so no real process is ever signalled through them.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use oci_spec::runtime::{LinuxResources, Process};

use crate::oci::{
    CreateOpts, ExecOpts, ExecOutput, ExecProcess, OciError, OciRuntime, OciState, ProbeEnv,
    Result, RuntimeCommand,
};
use crate::shim::{ExitRecord, Monitors, ShimAttach, ShimConfig, ShimHandle, ShimPaths};

/// Above the largest `pid_max` (2^22): never a real process.
const FIRST_PID: i32 = 10_000_000;

#[derive(Default)]
struct State {
    calls: Vec<String>,
    /// Container id → OCI status (`created`, `running`, `stopped`).
    containers: BTreeMap<String, String>,
    monitors: BTreeMap<String, Monitor>,
    /// Operation → the error it fails with.
    fail: BTreeMap<&'static str, String>,
    /// Operations that wait for [`Fake::release`].
    hang: Vec<&'static str>,
    /// `Err(reason)`: the runtime is unavailable.
    available: Option<String>,
    next_pid: i32,
}

#[derive(Clone)]
struct Monitor {
    handle: ShimHandle,
    alive: bool,
    exit: Option<ExitRecord>,
}

/// The fake; share one as both seams (`Arc<Fake>` coerces to either trait object).
pub(crate) struct Fake {
    state: Mutex<State>,
    changed: tokio::sync::Notify,
}

impl Fake {
    pub fn new() -> Arc<Fake> {
        Arc::new(Fake {
            state: Mutex::new(State {
                next_pid: FIRST_PID,
                ..State::default()
            }),
            changed: tokio::sync::Notify::new(),
        })
    }

    /// Changes the state and wakes whoever waits on it.
    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        let t = f(&mut self.state.lock().unwrap());
        self.changed.notify_waiters();
        t
    }

    fn read<T>(&self, f: impl FnOnce(&State) -> T) -> T {
        f(&self.state.lock().unwrap())
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<String> {
        self.read(|s| s.calls.clone())
    }

    /// Whether `call` (e.g. `"delete ID"`) was made.
    pub fn called(&self, call: &str) -> bool {
        self.calls().iter().any(|c| c == call)
    }

    /// Makes every later `op` fail with `message`.
    pub fn fail(&self, op: &'static str, message: &str) {
        self.with(|s| s.fail.insert(op, message.to_string()));
    }

    /// Lets every operation succeed again.
    pub fn with_no_failures(&self) {
        self.with(|s| s.fail.clear());
    }

    /// Makes every later `op` wait until [`Fake::release`].
    pub fn hang(&self, op: &'static str) {
        self.with(|s| s.hang.push(op));
    }

    pub fn release(&self, op: &'static str) {
        self.with(|s| s.hang.retain(|o| *o != op));
    }

    /// Makes the runtime's availability probe fail with `reason`.
    pub fn unavailable(&self, reason: &str) {
        self.with(|s| s.available = Some(reason.to_string()));
    }

    /// The OCI status of container `id`, if the runtime knows it.
    pub fn status(&self, id: &str) -> Option<String> {
        self.read(|s| s.containers.get(id).cloned())
    }

    /// Whether the monitor of `id` runs.
    pub fn monitor_alive(&self, id: &str) -> bool {
        self.read(|s| s.monitors.get(id).is_some_and(|m| m.alive))
    }

    /// The container's init exits by itself with `code`; its monitor records that and ends.
    pub fn exit(&self, id: &str, code: i32) {
        self.with(|s| stop(s, id, code, None));
    }

    /// The monitor of `id` dies without recording an exit (as a SIGKILLed shim does).
    pub fn lose_monitor(&self, id: &str) {
        self.with(|s| {
            if let Some(m) = s.monitors.get_mut(id) {
                m.alive = false;
            }
        });
    }

    /// Records the call, then fails or hangs it as the test asked.
    async fn enter(&self, op: &'static str, id: &str) -> Result<()> {
        self.with(|s| s.calls.push(format!("{op} {id}")));
        loop {
            let notified = self.changed.notified();
            if !self.read(|s| s.hang.contains(&op)) {
                break;
            }
            notified.await;
        }
        match self.read(|s| s.fail.get(op).cloned()) {
            Some(message) => Err(OciError::Runtime {
                binary: "fake".into(),
                op,
                id: id.to_string(),
                message,
            }),
            None => Ok(()),
        }
    }

    fn require(&self, id: &str) -> Result<String> {
        self.status(id)
            .ok_or_else(|| OciError::NotFound(id.to_string()))
    }
}

/// The init of `id` ends: the container stops and its monitor records the exit.
fn stop(s: &mut State, id: &str, code: i32, signal: Option<i32>) {
    if let Some(st) = s.containers.get_mut(id) {
        *st = "stopped".into();
    }
    if let Some(m) = s.monitors.get_mut(id).filter(|m| m.alive) {
        let ns = super::now_ns();
        m.exit = Some(ExitRecord {
            pid: m.handle.init_pid,
            exit_code: code,
            signal,
            exited_at: ns.to_string(),
            exited_at_ns: ns,
            oom_killed: false,
        });
        m.alive = false;
    }
}

impl OciRuntime for Fake {
    fn create<'a>(&'a self, opts: CreateOpts) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.enter("create", &opts.id).await?;
            self.with(|s| s.containers.insert(opts.id, "created".into()));
            Ok(())
        })
    }

    fn start<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.enter("start", id).await?;
            match self.require(id)?.as_str() {
                "created" => {
                    self.with(|s| s.containers.insert(id.to_string(), "running".into()));
                    Ok(())
                }
                other => Err(OciError::Other(format!("cannot start a {other} container"))),
            }
        })
    }

    fn state<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<OciState>> {
        Box::pin(async move {
            self.enter("state", id).await?;
            let status = self.require(id)?;
            Ok(OciState {
                oci_version: "1.0.2".into(),
                id: id.to_string(),
                status,
                pid: 0,
                bundle: Default::default(),
                rootfs: Default::default(),
                created: None,
                annotations: None,
            })
        })
    }

    fn kill<'a>(&'a self, id: &'a str, signal: i32, _all: bool) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.enter("kill", id).await?;
            if self.require(id)? != "running" {
                return Err(OciError::Other("container not running".into()));
            }
            self.with(|s| stop(s, id, 128 + signal, Some(signal)));
            Ok(())
        })
    }

    fn delete<'a>(&'a self, id: &'a str, force: bool) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.enter("delete", id).await?;
            match self.status(id).as_deref() {
                None if force => Ok(()),
                None => Err(OciError::NotFound(id.to_string())),
                Some("running") if !force => {
                    Err(OciError::Other("cannot delete a running container".into()))
                }
                Some(_) => {
                    self.with(|s| {
                        stop(s, id, 137, Some(9));
                        s.containers.remove(id)
                    });
                    Ok(())
                }
            }
        })
    }

    fn exec<'a>(&'a self, opts: ExecOpts) -> BoxFuture<'a, Result<ExecOutput>> {
        Box::pin(async move {
            self.enter("exec", &opts.id).await?;
            self.require(&opts.id)?;
            Ok(ExecOutput::default())
        })
    }

    fn exec_spawn<'a>(&'a self, opts: ExecOpts) -> BoxFuture<'a, Result<ExecProcess>> {
        Box::pin(async move {
            self.enter("exec_spawn", &opts.id).await?;
            Err(OciError::Unsupported(
                "the fake runtime runs no processes".into(),
            ))
        })
    }

    fn exec_detached<'a>(&'a self, id: &'a str, _process: Process) -> BoxFuture<'a, Result<i32>> {
        Box::pin(async move {
            self.enter("exec_detached", id).await?;
            Err(OciError::Unsupported(
                "the fake runtime runs no processes".into(),
            ))
        })
    }

    fn update<'a>(
        &'a self,
        id: &'a str,
        _resources: &'a LinuxResources,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.enter("update", id).await?;
            self.require(id).map(drop)
        })
    }

    fn pause<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.enter("pause", id).await })
    }

    fn resume<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.enter("resume", id).await })
    }

    fn checkpoint<'a>(
        &'a self,
        id: &'a str,
        _images: &'a std::path::Path,
        _work: &'a std::path::Path,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.enter("checkpoint", id).await?;
            self.require(id).map(drop)
        })
    }

    fn list(&self) -> BoxFuture<'_, Result<Vec<OciState>>> {
        Box::pin(async move { Ok(Vec::new()) })
    }

    fn exec_spawn_stdio(
        &self,
        _opts: ExecOpts,
        _stdin: Stdio,
        _stdout: Stdio,
        _stderr: Stdio,
    ) -> Result<ExecProcess> {
        Err(OciError::Unsupported(
            "the fake runtime runs no processes".into(),
        ))
    }

    fn command(&self) -> RuntimeCommand {
        RuntimeCommand {
            binary: "/fake/runtime".into(),
            root: "/fake/root".into(),
            systemd_cgroup: false,
        }
    }

    fn check_available<'a>(
        &'a self,
        name: &'a str,
        _env: &'a ProbeEnv,
    ) -> BoxFuture<'a, std::result::Result<(), String>> {
        Box::pin(async move {
            self.with(|s| s.calls.push(format!("probe {name}")));
            match self.read(|s| s.available.clone()) {
                Some(reason) => Err(reason),
                None => Ok(()),
            }
        })
    }
}

impl Monitors for Fake {
    /// A monitor whose `create` makes the container (the shim runs the runtime's `create`).
    fn spawn(&self, cfg: ShimConfig) -> BoxFuture<'_, Result<ShimHandle>> {
        Box::pin(async move {
            self.enter("spawn", &cfg.id).await?;
            Ok(self.with(|s| {
                let handle = ShimHandle {
                    id: cfg.id.clone(),
                    paths: ShimPaths::new(&cfg.bundle),
                    shim_pid: s.next_pid,
                    init_pid: s.next_pid + 1,
                };
                s.next_pid += 2;
                s.containers.insert(cfg.id.clone(), "created".into());
                let m = Monitor {
                    handle: handle.clone(),
                    alive: true,
                    exit: None,
                };
                s.monitors.insert(cfg.id, m);
                handle
            }))
        })
    }

    fn load(&self, id: &str, _bundle: &Path) -> Result<ShimHandle> {
        self.read(|s| s.monitors.get(id).map(|m| m.handle.clone()))
            .ok_or_else(|| OciError::Other(format!("no monitor of {id}")))
    }

    fn is_alive(&self, shim: &ShimHandle) -> bool {
        self.monitor_alive(&shim.id)
    }

    fn exit_record(&self, shim: &ShimHandle) -> Result<Option<ExitRecord>> {
        Ok(self.read(|s| s.monitors.get(&shim.id).and_then(|m| m.exit.clone())))
    }

    fn wait<'a>(&'a self, shim: &'a ShimHandle) -> BoxFuture<'a, Result<ExitRecord>> {
        Box::pin(async move {
            loop {
                let notified = self.changed.notified();
                let m = self.read(|s| s.monitors.get(&shim.id).cloned());
                match m {
                    Some(Monitor {
                        exit: Some(exit), ..
                    }) => return Ok(exit),
                    Some(Monitor { alive: true, .. }) => notified.await,
                    _ => {
                        return Err(OciError::Other(format!(
                            "the monitor of {} is gone and left no exit status",
                            shim.id
                        )));
                    }
                }
            }
        })
    }

    fn reopen_log<'a>(&'a self, shim: &'a ShimHandle) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.enter("reopen_log", &shim.id).await })
    }

    fn attach<'a>(
        &'a self,
        shim: &'a ShimHandle,
        _stdin: bool,
        _stdout: bool,
        _stderr: bool,
    ) -> BoxFuture<'a, Result<ShimAttach>> {
        Box::pin(async move {
            self.enter("attach", &shim.id).await?;
            Err(OciError::Unsupported(
                "the fake monitor has no stdio".into(),
            ))
        })
    }

    fn kill_group(&self, shim: &ShimHandle) {
        self.with(|s| {
            s.calls.push(format!("kill_group {}", shim.id));
            if let Some(m) = s.monitors.get_mut(&shim.id) {
                m.alive = false;
            }
        });
    }

    fn kill_shim(&self, shim: &ShimHandle) {
        self.with(|s| {
            s.calls.push(format!("kill_shim {}", shim.id));
            if let Some(m) = s.monitors.get_mut(&shim.id) {
                m.alive = false;
            }
        });
    }
}

//! Pod sandbox operations: run, stop, remove, status, list.
//!
//! A sandbox is a pinned network namespace attached through CNI (unless the pod uses the host's
//! network), the shared files of [`SandboxFiles`], and the infra process (`minicri pause` under a
//! shim, through runc) holding the pod's IPC, UTS and PID namespaces.

use std::sync::Arc;
use std::time::Duration;

use minicri_proto::runtime::v1 as cri;
use prost::Message;

use super::store::{SandboxRecord, SandboxState};
use super::{Journal, Operation, PodService, Undo, blocking, now_ns};
use crate::cni::PodNetwork;
use crate::error::{Error, Result};
use crate::oci;
use crate::shim::{ShimConfig, ShimHandle};
use crate::spec::{SandboxFiles, SandboxSpecParams};

/// How long the infra process gets to exit after SIGKILL.
const INFRA_EXIT_TIMEOUT: Duration = Duration::from_secs(10);

fn host_network(config: &cri::PodSandboxConfig) -> bool {
    crate::spec::namespaces::namespace_options(config)
        .is_some_and(|o| o.network == cri::NamespaceMode::Node as i32)
}

/// CRI: metadata name, namespace and uid are required.
fn validate_metadata(config: &cri::PodSandboxConfig) -> Result<&cri::PodSandboxMetadata> {
    let m = config
        .metadata
        .as_ref()
        .ok_or_else(|| Error::InvalidArgument("sandbox config metadata is required".into()))?;
    for (field, v) in [
        ("metadata.name", &m.name),
        ("metadata.namespace", &m.namespace),
        ("metadata.uid", &m.uid),
    ] {
        if v.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "sandbox config {field} is required"
            )));
        }
        // They go into CNI_ARGS (`;`-separated `K=V`), the sandbox's reserved name
        // (`_`-joined) and logs: Kubernetes names and uids never hold these characters.
        if v.len() > 253
            || v.chars().any(|c| {
                c.is_whitespace() || c.is_control() || matches!(c, ';' | '=' | ',' | '/' | '_')
            })
        {
            return Err(Error::InvalidArgument(format!(
                "sandbox config {field} {v:?} is not a Kubernetes name or uid (at most 253 characters, none of whitespace, control characters, ';', '=', ',', '/', '_')"
            )));
        }
    }
    super::validate_labels_and_annotations("sandbox config", &config.labels, &config.annotations)?;
    validate_port_mappings(config)?;
    // Read by the CNI ADD, which runs beside the infra's creation: a bad one is refused first.
    crate::cni::pod::bandwidth_of(|key| config.annotations.get(key).map(String::as_str))
        .map_err(|e| Error::InvalidArgument(format!("sandbox config {e}")))?;
    Ok(m)
}

/// Host ports one pod may publish: each is a set of NAT rules the portmap plugin writes into the
/// node's tables, for every pod's traffic to walk.
pub(crate) const MAX_HOST_PORTS: usize = 1024;

/// Port mappings that publish a host port go to the CNI portmap plugin: checked here, so a bad
/// one is refused by name before anything is created (not an INTERNAL from the plugin after).
/// At most [`MAX_HOST_PORTS`] of them; mappings without a host port publish nothing and are not
/// counted.
fn validate_port_mappings(config: &cri::PodSandboxConfig) -> Result<()> {
    let published = config.port_mappings.iter().filter(|p| p.host_port != 0);
    if published.count() > MAX_HOST_PORTS {
        return Err(Error::InvalidArgument(format!(
            "sandbox config port_mappings: more than {MAX_HOST_PORTS} publish a host port"
        )));
    }
    for (i, p) in config.port_mappings.iter().enumerate() {
        let bad = |why: String| {
            Err(Error::InvalidArgument(format!(
                "sandbox config port_mappings[{i}]: {why}"
            )))
        };
        if !(0..=65535).contains(&p.host_port) {
            return bad(format!("host_port {} is not 0 to 65535", p.host_port));
        }
        if p.host_port == 0 {
            continue;
        }
        if !(1..=65535).contains(&p.container_port) {
            return bad(format!(
                "container_port {} is not 1 to 65535",
                p.container_port
            ));
        }
        if cri::Protocol::try_from(p.protocol).is_err() {
            return bad(format!("unknown protocol {}", p.protocol));
        }
        if !p.host_ip.is_empty() && p.host_ip.parse::<std::net::IpAddr>().is_err() {
            return bad(format!("host_ip {:?} is not an IP address", p.host_ip));
        }
    }
    Ok(())
}

/// The reserved name of a sandbox.
pub fn sandbox_name(m: &cri::PodSandboxMetadata) -> String {
    format!("{}_{}_{}_{}", m.name, m.namespace, m.uid, m.attempt)
}

impl PodService {
    /// RunPodSandbox. Runs in its own task: a client that hangs up does not interrupt it
    /// half-way.
    pub async fn run_pod_sandbox(
        self: &Arc<Self>,
        config: cri::PodSandboxConfig,
        runtime_handler: String,
    ) -> Result<String> {
        self.undoable(Operation::RunPodSandbox, move |svc, undo| {
            Box::pin(async move { svc.run_sandbox_steps(config, runtime_handler, undo).await })
        })
        .await
    }

    async fn run_sandbox_steps(
        self: &Arc<Self>,
        config: cri::PodSandboxConfig,
        runtime_handler: String,
        undo: &mut Journal,
    ) -> Result<String> {
        let started = std::time::Instant::now();
        let meta = validate_metadata(&config)?.clone();
        let _claim =
            self.check_node_metadata(super::Listed::Pods, &config.labels, &config.annotations)?;
        let handler = self.handler_for_new_pod(&runtime_handler).await?;
        let host = self.host_for(handler);
        crate::spec::sandbox::validate_sysctls(&config)?;
        crate::spec::sandbox::validate_dns_and_hostname(&config)?;
        // A pod in its own user namespace gets its network namespace from the infra process,
        // which creates both; CNI attaches it after `create` (see crate::spec::userns).
        let own_userns = crate::spec::userns::pod_userns(&config)?.is_some();
        if own_userns && !host.user_namespaces {
            return Err(Error::InvalidArgument(
                "pod user namespaces need Linux >= 5.19 (idmapped overlay layers)".into(),
            ));
        }
        let id = self.new_id()?;
        undo.subject(&id)?;
        let name = sandbox_name(&meta);
        self.store.reserve(&name, &id)?;
        undo.push(Undo::ReleaseName {
            name: name.clone(),
            id: id.clone(),
        })?;

        // Network: a pinned namespace, attached through CNI while the infra container is being
        // created (neither needs the other: runc joins the pinned namespace whatever CNI has
        // done to it yet; CNI needs only the namespace). Both undo steps are journaled before
        // either starts, and a failure of one is rolled back only once the other has finished.
        let mut netns = None;
        let mut cni_add = None;
        if !host_network(&config) && !own_userns {
            let dir = self.netns_dir();
            let nid = id.clone();
            undo.push(Undo::RemoveNetns(dir.join(&nid)))?;
            let path = blocking(move || Ok(crate::netns::create(&dir, &nid)?)).await?;
            netns = Some(path.clone());
            let pod = PodNetwork::from_sandbox_config(&id, path, &config);
            // CNI DEL is defined for an ADD that never happened or failed half-way.
            undo.push(Undo::CniTeardown(pod.clone()))?;
            cni_add = Some(pod);
        }
        let network = async {
            let t = std::time::Instant::now();
            let ips = match &cni_add {
                Some(pod) => self.add_network(pod).await,
                None => Ok(Vec::new()),
            };
            (ips, t.elapsed())
        };
        let infra = async {
            let t = std::time::Instant::now();
            let shim = self
                .create_infra(
                    &id,
                    &config,
                    handler,
                    netns.as_deref(),
                    &runtime_handler,
                    undo,
                )
                .await?;
            if !own_userns {
                // The infra process needs no network: it starts while CNI may still work.
                handler.runtime.start(&id).await?;
            }
            Ok::<_, Error>((shim, t.elapsed()))
        };
        let ((network, network_time), infra) = tokio::join!(network, infra);
        let (shim, infra_time) = infra?;
        let mut ips = network?;
        if !host_network(&config) && own_userns {
            // A pod in its own user namespace: the infra process created the network namespace.
            let dir = self.netns_dir();
            let nid = id.clone();
            let ns = std::path::PathBuf::from(format!("/proc/{}/ns/net", shim.init_pid));
            undo.push(Undo::RemoveNetns(dir.join(&nid)))?;
            let path = blocking(move || Ok(crate::netns::pin(&dir, &nid, &ns)?)).await?;
            netns = Some(path.clone());
            let pod = PodNetwork::from_sandbox_config(&id, path, &config);
            undo.push(Undo::CniTeardown(pod.clone()))?;
            ips = self.add_network(&pod).await?;
        }
        if own_userns {
            handler.runtime.start(&id).await?;
        }

        let rec = SandboxRecord {
            id: id.clone(),
            name,
            config: config.encode_to_vec().into(),
            runtime_handler,
            created_at: now_ns(),
            state: SandboxState::Ready,
            netns,
            ips,
            infra_pid: shim.init_pid,
            shim: Some(shim.clone()),
            network_attached: !host_network(&config),
            resources: Default::default(),
        };
        self.store.put_sandbox(rec)?;
        self.watch_infra(id.clone(), shim);
        let ms = |d: Duration| format!("{:.1}", d.as_secs_f64() * 1e3);
        tracing::info!(
            sandbox = %id, pod = %format!("{}/{}", meta.namespace, meta.name),
            duration_ms = ms(started.elapsed()), network_ms = ms(network_time),
            infra_ms = ms(infra_time), "pod sandbox running"
        );
        Ok(id)
    }

    /// CNI ADD of the pod's network (its CNI DEL journaled already); returns the pod's IPs.
    async fn add_network(&self, pod: &PodNetwork) -> Result<Vec<String>> {
        let status = self.cni.setup(pod).await?;
        Ok(status.ips.iter().map(|ip| ip.to_string()).collect())
    }

    /// The infra container, created (not started) under its shim: the pod's shared files, the
    /// infra rootfs, the bundle, then the shim, which runs the runtime's `create`.
    async fn create_infra(
        self: &Arc<Self>,
        id: &str,
        config: &cri::PodSandboxConfig,
        handler: &oci::Handler,
        netns: Option<&std::path::Path>,
        runtime_handler: &str,
        undo: &mut Journal,
    ) -> Result<ShimHandle> {
        // Shared files.
        let dir = self.sandbox_dir(id);
        undo.push(Undo::RemoveDir(dir.clone()))?;
        let files_dir = dir.join("files");
        let cfg = config.clone();
        let fd = files_dir.clone();
        undo.push(Undo::SandboxFiles(files_dir.clone()))?;
        blocking(move || Ok(SandboxFiles::prepare(&fd, &cfg)?)).await?;

        // The infra process.
        let svc = self.clone();
        let infra = blocking(move || svc.infra_rootfs()).await?;
        let bundle = self.bundle_dir(id);
        undo.push(Undo::RemoveDir(bundle.clone()))?;
        // File work (a Localhost seccomp profile is read, the bundle written and fsynced) kept
        // off the async workers.
        minicri_store::fsutil::off_async(|| -> Result<()> {
            let spec = crate::spec::sandbox_spec(&SandboxSpecParams {
                id,
                config,
                infra: &infra,
                netns,
                cgroup_driver: self.cgroup_driver,
                host: &self.host_for(handler),
                annotations: &self.annotations,
            })?;
            crate::spec::write_bundle(&bundle, &spec)?;
            Ok(())
        })?;
        // The shim creates the container; from here on, runc knows the id.
        undo.push(Undo::DeleteContainer {
            id: id.to_string(),
            shim: None,
            handler: runtime_handler.to_string(),
        })?;
        let shim = self
            .monitors
            .spawn(ShimConfig::new(
                id,
                &bundle,
                handler.runtime.command(),
                &self.shim_binary,
            ))
            .await?;
        undo.push(Undo::DeleteContainer {
            id: id.to_string(),
            shim: Some(shim.clone()),
            handler: runtime_handler.to_string(),
        })?;
        Ok(shim)
    }

    /// Marks the sandbox NotReady when its infra process exits.
    pub(crate) fn watch_infra(self: &Arc<Self>, id: String, shim: ShimHandle) {
        let svc = self.clone();
        tokio::spawn(async move {
            let _ = svc.monitors.wait(&shim).await;
            let _ = svc
                .store
                .update_sandbox(&id, |r| r.state = SandboxState::NotReady);
        });
    }

    /// StopPodSandbox: stops every container (forcibly), the infra process, detaches the
    /// network and removes the namespace, and drops the pod's pull references. Idempotent;
    /// an unknown id is success (CRI).
    pub async fn stop_pod_sandbox(self: &Arc<Self>, id: String) -> Result<()> {
        let svc = self.clone();
        tokio::spawn(async move { svc.stop_sandbox_inner(&id).await })
            .await
            .map_err(|e| Error::Internal(format!("StopPodSandbox task: {e}")))?
    }

    async fn stop_sandbox_inner(self: &Arc<Self>, id: &str) -> Result<()> {
        let Some(rec) = self.store.sandbox(id) else {
            return Ok(());
        };
        // First, so that the pod's PullImage calls return at once, whatever the rest costs.
        if let Some(m) = rec.summary().metadata {
            let n = self.images.close_pod(
                &m.uid,
                m.attempt,
                &format!("pod sandbox {id} ({}/{}) was stopped", m.namespace, m.name),
            );
            if n > 0 {
                tracing::info!(sandbox = %id, references = n, "dropped the pod's pull references");
            }
        }
        for c in self.store.containers_of(id) {
            self.stop_container_inner(&c.id, 0).await?;
        }
        let _guard = self.store.op_lock(id).await;
        let Some(rec) = self.store.sandbox(&rec.id) else {
            return Ok(());
        };
        let config = rec.config();
        // The infra process and the pod's network go at once: the network namespace is pinned
        // apart from the infra, so CNI DEL does not need it alive (nor dead). Each outcome is
        // recorded on its own, so a retry redoes only what failed.
        let infra = async {
            match &rec.shim {
                Some(shim) => self.stop_infra(&rec, shim).await,
                None => Ok(()),
            }
        };
        let network = async {
            if !rec.network_attached {
                return Ok(false);
            }
            let pod =
                PodNetwork::from_sandbox_config(id, rec.netns.clone().unwrap_or_default(), &config);
            let cni = self.cni.clone();
            tokio::spawn(async move { cni.teardown(&pod).await })
                .await
                .map_err(|e| Error::Internal(e.to_string()))??;
            Ok::<_, Error>(true)
        };
        let (infra, network) = tokio::join!(infra, network);
        if infra.is_ok() {
            self.store.update_sandbox(id, |r| {
                r.state = SandboxState::NotReady;
                r.shim = None;
            })?;
        }
        if let Ok(true) = network {
            self.store
                .update_sandbox(id, |r| r.network_attached = false)?;
        }
        infra?;
        network?;
        if let Some(ns) = rec.netns.clone() {
            blocking(move || Ok(crate::netns::remove(&ns)?)).await?;
            self.store.update_sandbox(id, |r| r.netns = None)?;
        }
        Ok(())
    }

    /// Kills the infra process (SIGKILL ends the pod's PID namespace), waits for it, deletes
    /// it from the runtime and lets its shim go.
    async fn stop_infra(&self, rec: &SandboxRecord, shim: &ShimHandle) -> Result<()> {
        let (id, runtime) = (rec.id.as_str(), self.runtime(&rec.runtime_handler)?);
        match runtime.kill(id, libc::SIGKILL, false).await {
            Ok(()) => {}
            Err(e) if e.is_not_found() => {}
            // Already stopped: runc refuses to signal it.
            Err(e) => tracing::debug!(sandbox = %id, error = %e, "kill infra"),
        }
        if self.monitors.is_alive(shim) {
            let _ = tokio::time::timeout(INFRA_EXIT_TIMEOUT, self.monitors.wait(shim)).await;
        }
        runtime.delete(id, true).await?;
        self.reap_shim(shim).await;
        Ok(())
    }

    /// RemovePodSandbox: stops it, removes its containers and every file. Idempotent.
    pub async fn remove_pod_sandbox(self: &Arc<Self>, id: String) -> Result<()> {
        let svc = self.clone();
        tokio::spawn(async move {
            let Some(rec) = svc.store.sandbox(&id) else {
                return Ok(());
            };
            let rec_metadata = rec.summary().metadata;
            svc.stop_sandbox_inner(&id).await?;
            for c in svc.store.containers_of(&id) {
                svc.remove_container_inner(&c.id).await?;
            }
            // Nothing of its containers outlives the pod.
            svc.finish_teardowns(Some(&id)).await?;
            let _guard = svc.store.op_lock(&id).await;
            // Unmounts (reading the mount table) and tree removals: off the async workers.
            let (dir, bundle) = (svc.sandbox_dir(&id), svc.bundle_dir(&id));
            blocking(move || {
                SandboxFiles::cleanup(&dir.join("files"))?;
                super::remove_dir(&dir)?;
                super::remove_dir(&bundle)
            })
            .await?;
            svc.store.delete_sandbox(&id)?;
            if let Some(m) = rec_metadata {
                svc.images.reopen_pod(&m.uid, m.attempt);
            }
            drop(_guard);
            Ok(())
        })
        .await
        .map_err(|e| Error::Internal(format!("RemovePodSandbox task: {e}")))?
    }

    pub fn pod_sandbox_status(&self, id: &str) -> Result<cri::PodSandboxStatus> {
        Ok(sandbox_status(&self.sandbox_record(id)?))
    }

    pub fn list_pod_sandbox(&self, filter: Option<cri::PodSandboxFilter>) -> Vec<cri::PodSandbox> {
        let f = filter.unwrap_or_default();
        let mut out: Vec<cri::PodSandbox> = self
            .store
            .sandboxes()
            .iter()
            .filter(|r| f.id.is_empty() || r.id == f.id || r.id.starts_with(&f.id))
            .map(|r| {
                let c = r.summary();
                cri::PodSandbox {
                    id: r.id.clone(),
                    metadata: c.metadata,
                    state: state_of(r) as i32,
                    created_at: r.created_at,
                    labels: c.labels,
                    annotations: c.annotations,
                    runtime_handler: r.runtime_handler.clone(),
                }
            })
            .filter(|s| f.state.as_ref().is_none_or(|v| v.state == s.state))
            .filter(|s| super::labels_match(&f.label_selector, &s.labels))
            .collect();
        out.sort_by_key(|s| s.created_at);
        out
    }
}

fn state_of(r: &SandboxRecord) -> cri::PodSandboxState {
    match r.state {
        SandboxState::Ready => cri::PodSandboxState::SandboxReady,
        SandboxState::NotReady => cri::PodSandboxState::SandboxNotready,
    }
}

fn sandbox_status(r: &SandboxRecord) -> cri::PodSandboxStatus {
    let c = r.config();
    let network = if host_network(&c) {
        None
    } else {
        Some(cri::PodSandboxNetworkStatus {
            ip: r.ips.first().cloned().unwrap_or_default(),
            additional_ips: r
                .ips
                .iter()
                .skip(1)
                .map(|ip| cri::PodIp { ip: ip.clone() })
                .collect(),
        })
    };
    let options = crate::spec::namespaces::namespace_options(&c)
        .cloned()
        .unwrap_or_default();
    cri::PodSandboxStatus {
        id: r.id.clone(),
        metadata: c.metadata.clone(),
        state: state_of(r) as i32,
        created_at: r.created_at,
        network,
        linux: Some(cri::LinuxPodSandboxStatus {
            namespaces: Some(cri::Namespace {
                options: Some(options),
            }),
        }),
        labels: c.labels,
        annotations: c.annotations,
        runtime_handler: r.runtime_handler.clone(),
    }
}

#[cfg(test)]
mod tests;

//! CRI RuntimeService: every RPC's handler is here. Each validates the request and converts,
//! calls the daemon's services ([`crate::pods::PodService`] for pods, containers, stats and
//! streaming targets; [`crate::stream`] registers streaming sessions), and converts back, inside
//! [`crate::rpc::call`]. GetContainerEvents's stream is built by [`super::events`]; the streamed
//! lists by [`super::stream`]; CheckpointContainer answers UNIMPLEMENTED, saying so.
//! The kubelet polls the status, list and stats RPCs, so their successes log at debug level
//! ([`Verbosity::Poll`]).

use std::collections::HashMap;
use std::sync::Arc;

use minicri_proto::runtime::v1 as cri;
use minicri_proto::runtime::v1::runtime_service_server::RuntimeService;
use tonic::{Request, Response, Status};

use crate::daemon::Daemon;
use crate::error::Error;
use crate::oci::host::CgroupDriver;
use crate::pods::inspect::INFO_KEY;
use crate::rpc::{Verbosity, call, call_on, deadline};
use crate::stream::{AttachRequest, ExecRequest, PortForwardRequest};

/// The CRI API version minicri implements.
pub const CRI_API_VERSION: &str = "v1";

type Reply<T> = Result<Response<T>, Status>;
type Streamed<T> = Result<Response<tonic::codegen::BoxStream<T>>, Status>;

/// The `info` map of a status reply: the object's JSON under [`INFO_KEY`] when `verbose`.
fn info(
    verbose: bool,
    json: impl FnOnce() -> Result<String, Error>,
) -> Result<HashMap<String, String>, Error> {
    Ok(match verbose {
        true => HashMap::from([(INFO_KEY.to_string(), json()?)]),
        false => HashMap::new(),
    })
}

pub struct RuntimeHandler {
    pub daemon: Arc<Daemon>,
}

#[tonic::async_trait]
impl RuntimeService for RuntimeHandler {
    async fn version(
        &self,
        req: Request<cri::VersionRequest>,
    ) -> Result<Response<cri::VersionResponse>, Status> {
        let dl = deadline(&req);
        call("Version", "", dl, Verbosity::Poll, async {
            Ok(cri::VersionResponse {
                // The version of the kubelet-runtime API, which CRI v1 runtimes report as 0.1.0.
                version: "0.1.0".into(),
                runtime_name: "minicri".into(),
                runtime_version: env!("CARGO_PKG_VERSION").into(),
                runtime_api_version: CRI_API_VERSION.into(),
            })
        })
        .await
    }

    async fn status(
        &self,
        req: Request<cri::StatusRequest>,
    ) -> Result<Response<cri::StatusResponse>, Status> {
        let dl = deadline(&req);
        let verbose = req.get_ref().verbose;
        call("Status", "", dl, Verbosity::Poll, async {
            let pods = &self.daemon.pods;
            let network = self.daemon.network_condition();
            // The probes ran before the CRI was served; a handler they could not reach counts
            // as unavailable.
            let handlers: Vec<_> = pods
                .handlers
                .all()
                .map(|h| {
                    let r = h.probed().unwrap_or_else(|| Err("not probed".into()));
                    (h, r)
                })
                .collect();
            let default = pods.handlers.default_name();
            let mut info = HashMap::new();
            if verbose {
                info.insert("config".to_string(), self.daemon.config_json());
                info.insert(
                    "kubeWatch".to_string(),
                    self.daemon.kube.to_json().to_string(),
                );
                let list: Vec<_> = handlers
                    .iter()
                    .map(|(h, r)| {
                        let command = h.runtime.command();
                        serde_json::json!({
                            "name": h.name, "default": h.name == default,
                            "binary": command.binary, "root": command.root,
                            "available": r.is_ok(), "reason": r.as_ref().err(),
                        })
                    })
                    .collect();
                info.insert(
                    "runtimeHandlers".to_string(),
                    serde_json::Value::from(list).to_string(),
                );
            }
            let features = |h: &crate::oci::Handler| cri::RuntimeHandlerFeatures {
                recursive_read_only_mounts: h.features.recursive_read_only_mounts,
                user_namespaces: h.features.user_namespaces,
            };
            // The default handler as "" (what pods naming none get), then every handler that
            // works here by its name.
            let mut runtime_handlers = Vec::new();
            let mut runtime_ready = cri::RuntimeCondition {
                r#type: "RuntimeReady".into(),
                status: true,
                ..Default::default()
            };
            for (h, r) in &handlers {
                match r {
                    Ok(()) if h.name == default => runtime_handlers.insert(
                        0,
                        cri::RuntimeHandler {
                            name: String::new(),
                            features: Some(features(h)),
                        },
                    ),
                    Err(reason) if h.name == default => {
                        runtime_ready.status = false;
                        runtime_ready.reason = "DefaultRuntimeHandlerUnavailable".into();
                        runtime_ready.message = format!(
                            "the default runtime handler {:?} ({}) does not work here: {reason}",
                            h.name,
                            h.runtime.command().binary.display()
                        );
                    }
                    _ => {}
                }
                if r.is_ok() {
                    runtime_handlers.push(cri::RuntimeHandler {
                        name: h.name.clone(),
                        features: Some(features(h)),
                    });
                }
            }
            Ok(cri::StatusResponse {
                status: Some(cri::RuntimeStatus {
                    conditions: vec![runtime_ready, network],
                }),
                info,
                runtime_handlers,
                // SupplementalGroupsPolicy: `Strict` is honoured (crate::oci::user) and
                // ContainerStatus reports the process's groups.
                features: Some(cri::RuntimeFeatures {
                    supplemental_groups_policy: true,
                    ..Default::default()
                }),
            })
        })
        .await
    }

    async fn runtime_config(
        &self,
        req: Request<cri::RuntimeConfigRequest>,
    ) -> Result<Response<cri::RuntimeConfigResponse>, Status> {
        let dl = deadline(&req);
        call("RuntimeConfig", "", dl, Verbosity::Normal, async {
            let driver = match self.daemon.config.runtime.cgroup_driver {
                CgroupDriver::Cgroupfs => cri::CgroupDriver::Cgroupfs,
                CgroupDriver::Systemd => cri::CgroupDriver::Systemd,
            };
            Ok(cri::RuntimeConfigResponse {
                linux: Some(cri::LinuxRuntimeConfiguration {
                    cgroup_driver: driver as i32,
                }),
            })
        })
        .await
    }

    async fn update_runtime_config(
        &self,
        req: Request<cri::UpdateRuntimeConfigRequest>,
    ) -> Result<Response<cri::UpdateRuntimeConfigResponse>, Status> {
        let dl = deadline(&req);
        let cidr = req
            .into_inner()
            .runtime_config
            .and_then(|c| c.network_config)
            .map(|n| n.pod_cidr)
            .unwrap_or_default();
        call(
            "UpdateRuntimeConfig",
            cidr.clone(),
            dl,
            Verbosity::Normal,
            async {
                self.daemon.pods.cni.set_pod_cidr(&cidr);
                self.daemon.set_pod_cidr(cidr);
                Ok(cri::UpdateRuntimeConfigResponse {})
            },
        )
        .await
    }

    async fn run_pod_sandbox(
        &self,
        req: Request<cri::RunPodSandboxRequest>,
    ) -> Result<Response<cri::RunPodSandboxResponse>, Status> {
        let dl = deadline(&req);
        let r = req.into_inner();
        let object = r
            .config
            .as_ref()
            .and_then(|c| c.metadata.as_ref())
            .map(|m| format!("{}/{}", m.namespace, m.name))
            .unwrap_or_default();
        call("RunPodSandbox", object, dl, Verbosity::Normal, async {
            let config = r
                .config
                .ok_or_else(|| Error::InvalidArgument("config is required".into()))?;
            let id = self
                .daemon
                .pods
                .run_pod_sandbox(config, r.runtime_handler)
                .await?;
            Ok(cri::RunPodSandboxResponse { pod_sandbox_id: id })
        })
        .await
    }

    async fn stop_pod_sandbox(
        &self,
        req: Request<cri::StopPodSandboxRequest>,
    ) -> Reply<cri::StopPodSandboxResponse> {
        call_on(
            "StopPodSandbox",
            Verbosity::Normal,
            req,
            ("pod_sandbox_id", |r| r.pod_sandbox_id.clone()),
            |r| async move {
                self.daemon.pods.stop_pod_sandbox(r.pod_sandbox_id).await?;
                Ok(cri::StopPodSandboxResponse {})
            },
        )
        .await
    }

    async fn remove_pod_sandbox(
        &self,
        req: Request<cri::RemovePodSandboxRequest>,
    ) -> Reply<cri::RemovePodSandboxResponse> {
        call_on(
            "RemovePodSandbox",
            Verbosity::Normal,
            req,
            ("pod_sandbox_id", |r| r.pod_sandbox_id.clone()),
            |r| async move {
                self.daemon
                    .pods
                    .remove_pod_sandbox(r.pod_sandbox_id)
                    .await?;
                Ok(cri::RemovePodSandboxResponse {})
            },
        )
        .await
    }

    async fn pod_sandbox_status(
        &self,
        req: Request<cri::PodSandboxStatusRequest>,
    ) -> Reply<cri::PodSandboxStatusResponse> {
        call_on(
            "PodSandboxStatus",
            Verbosity::Poll,
            req,
            ("pod_sandbox_id", |r| r.pod_sandbox_id.clone()),
            |r| async move {
                let (pods, id) = (&self.daemon.pods, &r.pod_sandbox_id);
                Ok(cri::PodSandboxStatusResponse {
                    status: Some(pods.pod_sandbox_status(id)?),
                    info: info(r.verbose, || pods.sandbox_info(id))?,
                    containers_statuses: vec![],
                    timestamp: crate::pods::now_ns(),
                })
            },
        )
        .await
    }

    async fn list_pod_sandbox(
        &self,
        req: Request<cri::ListPodSandboxRequest>,
    ) -> Result<Response<cri::ListPodSandboxResponse>, Status> {
        let dl = deadline(&req);
        let filter = req.into_inner().filter;
        call("ListPodSandbox", "", dl, Verbosity::Poll, async {
            Ok(cri::ListPodSandboxResponse {
                items: self.daemon.pods.list_pod_sandbox(filter),
            })
        })
        .await
    }

    async fn create_container(
        &self,
        req: Request<cri::CreateContainerRequest>,
    ) -> Result<Response<cri::CreateContainerResponse>, Status> {
        let dl = deadline(&req);
        let r = req.into_inner();
        let name = r
            .config
            .as_ref()
            .and_then(|c| c.metadata.as_ref())
            .map(|m| m.name.clone())
            .unwrap_or_default();
        let object = format!("{}/{name}", r.pod_sandbox_id);
        call("CreateContainer", object, dl, Verbosity::Normal, async {
            if r.pod_sandbox_id.is_empty() {
                return Err(Error::InvalidArgument("pod_sandbox_id is required".into()));
            }
            let config = r
                .config
                .ok_or_else(|| Error::InvalidArgument("config is required".into()))?;
            let id = self
                .daemon
                .pods
                .create_container(r.pod_sandbox_id, config, r.sandbox_config)
                .await?;
            Ok(cri::CreateContainerResponse { container_id: id })
        })
        .await
    }

    async fn start_container(
        &self,
        req: Request<cri::StartContainerRequest>,
    ) -> Reply<cri::StartContainerResponse> {
        call_on(
            "StartContainer",
            Verbosity::Normal,
            req,
            ("container_id", |r| r.container_id.clone()),
            |r| async move {
                self.daemon.pods.start_container(r.container_id).await?;
                Ok(cri::StartContainerResponse {})
            },
        )
        .await
    }

    async fn stop_container(
        &self,
        req: Request<cri::StopContainerRequest>,
    ) -> Reply<cri::StopContainerResponse> {
        call_on(
            "StopContainer",
            Verbosity::Normal,
            req,
            ("container_id", |r| r.container_id.clone()),
            |r| async move {
                let pods = &self.daemon.pods;
                pods.stop_container(r.container_id, r.timeout).await?;
                Ok(cri::StopContainerResponse {})
            },
        )
        .await
    }

    async fn remove_container(
        &self,
        req: Request<cri::RemoveContainerRequest>,
    ) -> Reply<cri::RemoveContainerResponse> {
        call_on(
            "RemoveContainer",
            Verbosity::Normal,
            req,
            ("container_id", |r| r.container_id.clone()),
            |r| async move {
                self.daemon.pods.remove_container(r.container_id).await?;
                Ok(cri::RemoveContainerResponse {})
            },
        )
        .await
    }

    async fn list_containers(
        &self,
        req: Request<cri::ListContainersRequest>,
    ) -> Result<Response<cri::ListContainersResponse>, Status> {
        let dl = deadline(&req);
        let filter = req.into_inner().filter;
        call("ListContainers", "", dl, Verbosity::Poll, async {
            Ok(cri::ListContainersResponse {
                containers: self.daemon.pods.list_containers(filter),
            })
        })
        .await
    }

    async fn container_status(
        &self,
        req: Request<cri::ContainerStatusRequest>,
    ) -> Reply<cri::ContainerStatusResponse> {
        call_on(
            "ContainerStatus",
            Verbosity::Poll,
            req,
            ("container_id", |r| r.container_id.clone()),
            |r| async move {
                let (pods, id) = (&self.daemon.pods, &r.container_id);
                Ok(cri::ContainerStatusResponse {
                    status: Some(pods.container_status(id)?),
                    info: info(r.verbose, || pods.container_info(id))?,
                })
            },
        )
        .await
    }

    async fn update_container_resources(
        &self,
        req: Request<cri::UpdateContainerResourcesRequest>,
    ) -> Reply<cri::UpdateContainerResourcesResponse> {
        call_on(
            "UpdateContainerResources",
            Verbosity::Normal,
            req,
            ("container_id", |r| r.container_id.clone()),
            |r| async move {
                let pods = &self.daemon.pods;
                pods.update_container_resources(&r.container_id, r.linux)
                    .await?;
                Ok(cri::UpdateContainerResourcesResponse {})
            },
        )
        .await
    }

    async fn reopen_container_log(
        &self,
        req: Request<cri::ReopenContainerLogRequest>,
    ) -> Reply<cri::ReopenContainerLogResponse> {
        call_on(
            "ReopenContainerLog",
            Verbosity::Normal,
            req,
            ("container_id", |r| r.container_id.clone()),
            |r| async move {
                self.daemon
                    .pods
                    .reopen_container_log(&r.container_id)
                    .await?;
                Ok(cri::ReopenContainerLogResponse {})
            },
        )
        .await
    }

    async fn get_container_events(
        &self,
        _req: Request<cri::GetEventsRequest>,
    ) -> Result<Response<tonic::codegen::BoxStream<cri::ContainerEventResponse>>, Status> {
        super::events::get_container_events(&self.daemon)
    }

    async fn exec_sync(&self, req: Request<cri::ExecSyncRequest>) -> Reply<cri::ExecSyncResponse> {
        call_on(
            "ExecSync",
            Verbosity::Normal,
            req,
            ("container_id", |r| r.container_id.clone()),
            |r| async move {
                let pods = &self.daemon.pods;
                pods.exec_sync(&r.container_id, r.cmd, r.timeout).await
            },
        )
        .await
    }

    async fn exec(&self, req: Request<cri::ExecRequest>) -> Reply<cri::ExecResponse> {
        call_on(
            "Exec",
            Verbosity::Normal,
            req,
            ("container_id", |r| r.container_id.clone()),
            |r| async move {
                crate::pods::exec::check_cmd(&r.cmd)?;
                if !(r.stdin || r.stdout || r.stderr) {
                    return Err(Error::InvalidArgument(
                        "one of stdin, stdout or stderr must be set".into(),
                    ));
                }
                if r.tty && r.stderr {
                    return Err(Error::InvalidArgument(
                        "tty and stderr cannot both be true (a terminal merges stderr into stdout)"
                            .into(),
                    ));
                }
                let target = self.daemon.pods.exec_target(&r.container_id)?;
                let url = self.daemon.streaming.register_exec(ExecRequest {
                    container_id: r.container_id,
                    sandbox_id: target.sandbox_id,
                    cmd: r.cmd,
                    tty: r.tty,
                    stdin: r.stdin,
                    stdout: r.stdout,
                    stderr: r.stderr,
                })?;
                Ok(cri::ExecResponse { url })
            },
        )
        .await
    }

    /// Attach: the container must exist (NOT_FOUND) and run (FAILED_PRECONDITION); one stream at
    /// least, `tty` as the container was created, and `stdin` only for a container created with
    /// `stdin` (INVALID_ARGUMENT). The session attaches to the container's shim when the client
    /// connects ([`crate::stream::attach`]).
    async fn attach(&self, req: Request<cri::AttachRequest>) -> Reply<cri::AttachResponse> {
        call_on(
            "Attach",
            Verbosity::Normal,
            req,
            ("container_id", |r| r.container_id.clone()),
            |r| async move {
                let id = r.container_id;
                let target = self.daemon.pods.exec_target(&id)?;
                let config = target.config();
                if !(r.stdin || r.stdout || r.stderr) {
                    return Err(Error::InvalidArgument(
                        "one of stdin, stdout or stderr must be set".into(),
                    ));
                }
                if r.tty != config.tty {
                    return Err(Error::InvalidArgument(format!(
                        "tty {} does not match container {id}, created with tty {}",
                        r.tty, config.tty
                    )));
                }
                if r.stdin && !config.stdin {
                    return Err(Error::InvalidArgument(format!(
                        "container {id} was created without stdin: cannot attach to its stdin"
                    )));
                }
                let url = self.daemon.streaming.register_attach(AttachRequest {
                    container_id: id,
                    sandbox_id: target.sandbox_id,
                    tty: r.tty,
                    stdin: r.stdin,
                    stdout: r.stdout,
                    stderr: r.stderr,
                })?;
                Ok(cri::AttachResponse { url })
            },
        )
        .await
    }

    /// PortForward: the sandbox must exist (NOT_FOUND) and be ready (FAILED_PRECONDITION); the
    /// ports, if any, must be 1 to 65535 (INVALID_ARGUMENT). The ports listed do not limit the
    /// session: as with the kubelet and containerd, each forwarded connection names its port.
    async fn port_forward(
        &self,
        req: Request<cri::PortForwardRequest>,
    ) -> Reply<cri::PortForwardResponse> {
        call_on(
            "PortForward",
            Verbosity::Normal,
            req,
            ("pod_sandbox_id", |r| r.pod_sandbox_id.clone()),
            |r| async move {
                if let Some(p) = r.port.iter().find(|p| !(1..=65535).contains(*p)) {
                    return Err(Error::InvalidArgument(format!(
                        "port {p} is out of range: ports are 1 to 65535"
                    )));
                }
                let netns = self.daemon.pods.port_forward_netns(&r.pod_sandbox_id)?;
                let url = self
                    .daemon
                    .streaming
                    .register_port_forward(PortForwardRequest {
                        sandbox_id: r.pod_sandbox_id,
                        netns,
                    })?;
                Ok(cri::PortForwardResponse { url })
            },
        )
        .await
    }

    async fn container_stats(
        &self,
        req: Request<cri::ContainerStatsRequest>,
    ) -> Reply<cri::ContainerStatsResponse> {
        call_on(
            "ContainerStats",
            Verbosity::Poll,
            req,
            ("container_id", |r| r.container_id.clone()),
            |r| async move {
                let stats = self.daemon.pods.container_stats(&r.container_id).await?;
                Ok(cri::ContainerStatsResponse { stats: Some(stats) })
            },
        )
        .await
    }

    async fn list_container_stats(
        &self,
        req: Request<cri::ListContainerStatsRequest>,
    ) -> Result<Response<cri::ListContainerStatsResponse>, Status> {
        let dl = deadline(&req);
        let filter = req.into_inner().filter;
        call("ListContainerStats", "", dl, Verbosity::Poll, async {
            Ok(cri::ListContainerStatsResponse {
                stats: self.daemon.pods.list_container_stats(filter).await?,
            })
        })
        .await
    }

    async fn pod_sandbox_stats(
        &self,
        req: Request<cri::PodSandboxStatsRequest>,
    ) -> Reply<cri::PodSandboxStatsResponse> {
        call_on(
            "PodSandboxStats",
            Verbosity::Poll,
            req,
            ("pod_sandbox_id", |r| r.pod_sandbox_id.clone()),
            |r| async move {
                let stats = self
                    .daemon
                    .pods
                    .pod_sandbox_stats(&r.pod_sandbox_id)
                    .await?;
                Ok(cri::PodSandboxStatsResponse { stats: Some(stats) })
            },
        )
        .await
    }

    async fn list_pod_sandbox_stats(
        &self,
        req: Request<cri::ListPodSandboxStatsRequest>,
    ) -> Result<Response<cri::ListPodSandboxStatsResponse>, Status> {
        let dl = deadline(&req);
        let filter = req.into_inner().filter;
        call("ListPodSandboxStats", "", dl, Verbosity::Poll, async {
            Ok(cri::ListPodSandboxStatsResponse {
                stats: self.daemon.pods.list_pod_sandbox_stats(filter).await?,
            })
        })
        .await
    }

    async fn stream_pod_sandboxes(
        &self,
        req: Request<cri::StreamPodSandboxesRequest>,
    ) -> Streamed<cri::StreamPodSandboxesResponse> {
        super::stream::pod_sandboxes(&self.daemon, req).await
    }

    async fn stream_containers(
        &self,
        req: Request<cri::StreamContainersRequest>,
    ) -> Streamed<cri::StreamContainersResponse> {
        super::stream::containers(&self.daemon, req).await
    }

    async fn stream_container_stats(
        &self,
        req: Request<cri::StreamContainerStatsRequest>,
    ) -> Streamed<cri::StreamContainerStatsResponse> {
        super::stream::container_stats(&self.daemon, req).await
    }

    async fn stream_pod_sandbox_stats(
        &self,
        req: Request<cri::StreamPodSandboxStatsRequest>,
    ) -> Streamed<cri::StreamPodSandboxStatsResponse> {
        super::stream::pod_sandbox_stats(&self.daemon, req).await
    }

    async fn list_metric_descriptors(
        &self,
        req: Request<cri::ListMetricDescriptorsRequest>,
    ) -> Reply<cri::ListMetricDescriptorsResponse> {
        let dl = deadline(&req);
        call("ListMetricDescriptors", "", dl, Verbosity::Poll, async {
            Ok(cri::ListMetricDescriptorsResponse {
                descriptors: crate::pods::metrics::metric_descriptors(),
            })
        })
        .await
    }

    async fn list_pod_sandbox_metrics(
        &self,
        req: Request<cri::ListPodSandboxMetricsRequest>,
    ) -> Reply<cri::ListPodSandboxMetricsResponse> {
        let dl = deadline(&req);
        call("ListPodSandboxMetrics", "", dl, Verbosity::Poll, async {
            Ok(cri::ListPodSandboxMetricsResponse {
                pod_metrics: self.daemon.pods.list_pod_sandbox_metrics().await?,
            })
        })
        .await
    }

    async fn stream_pod_sandbox_metrics(
        &self,
        req: Request<cri::StreamPodSandboxMetricsRequest>,
    ) -> Streamed<cri::StreamPodSandboxMetricsResponse> {
        super::stream::pod_sandbox_metrics(&self.daemon, req).await
    }

    /// Not implemented (checkpoints need CRIU, docs/cri-coverage.md): the answer says so, for
    /// `crictl checkpoint` and the kubelet's checkpoint API, and the container is not touched.
    async fn checkpoint_container(
        &self,
        req: Request<cri::CheckpointContainerRequest>,
    ) -> Reply<cri::CheckpointContainerResponse> {
        call_on(
            "CheckpointContainer",
            Verbosity::Normal,
            req,
            ("container_id", |r| r.container_id.clone()),
            |r| async move {
                Err::<cri::CheckpointContainerResponse, _>(Error::Unimplemented(format!(
                    "CheckpointContainer of {:?}: minicri does not checkpoint containers (no CRIU \
                     support); the container was not touched",
                    r.container_id
                )))
            },
        )
        .await
    }

    async fn update_pod_sandbox_resources(
        &self,
        req: Request<cri::UpdatePodSandboxResourcesRequest>,
    ) -> Reply<cri::UpdatePodSandboxResourcesResponse> {
        call_on(
            "UpdatePodSandboxResources",
            Verbosity::Normal,
            req,
            ("pod_sandbox_id", |r| r.pod_sandbox_id.clone()),
            |r| async move {
                self.daemon.pods.update_pod_sandbox_resources(r).await?;
                Ok(cri::UpdatePodSandboxResourcesResponse {})
            },
        )
        .await
    }
}

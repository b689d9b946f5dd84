//! CRI RuntimeService. Version, Status and RuntimeConfig are answered here; the pod and container
//! RPCs delegate to [`super::pods`], the stats RPCs to [`super::stats`], Exec, Attach
//! and PortForward to [`super::streaming`]; the streamed stats variants and the newer RPCs
//! answer UNIMPLEMENTED through the generated default stubs.

use std::collections::HashMap;
use std::sync::Arc;

use minicri_proto::runtime::v1 as cri;
use minicri_proto::runtime::v1::runtime_service_server::RuntimeService;
use tonic::{Request, Response, Status};

use super::{pods, stats, streaming};
use crate::config::CgroupDriver;
use crate::daemon::Daemon;
use crate::rpc::{Verbosity, call, deadline};

/// The CRI API version minicri implements.
pub const CRI_API_VERSION: &str = "v1";

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
                let list: Vec<_> = handlers
                    .iter()
                    .map(|(h, r)| {
                        serde_json::json!({
                            "name": h.name, "default": h.name == default,
                            "binary": h.runtime.binary, "root": h.runtime.root,
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
                            h.runtime.binary.display()
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
            let driver = match self.daemon.config.cgroup_driver {
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
        pods::run_pod_sandbox(&self.daemon, req).await
    }

    async fn stop_pod_sandbox(
        &self,
        req: Request<cri::StopPodSandboxRequest>,
    ) -> Result<Response<cri::StopPodSandboxResponse>, Status> {
        pods::stop_pod_sandbox(&self.daemon, req).await
    }

    async fn remove_pod_sandbox(
        &self,
        req: Request<cri::RemovePodSandboxRequest>,
    ) -> Result<Response<cri::RemovePodSandboxResponse>, Status> {
        pods::remove_pod_sandbox(&self.daemon, req).await
    }

    async fn pod_sandbox_status(
        &self,
        req: Request<cri::PodSandboxStatusRequest>,
    ) -> Result<Response<cri::PodSandboxStatusResponse>, Status> {
        pods::pod_sandbox_status(&self.daemon, req).await
    }

    async fn list_pod_sandbox(
        &self,
        req: Request<cri::ListPodSandboxRequest>,
    ) -> Result<Response<cri::ListPodSandboxResponse>, Status> {
        pods::list_pod_sandbox(&self.daemon, req).await
    }

    async fn create_container(
        &self,
        req: Request<cri::CreateContainerRequest>,
    ) -> Result<Response<cri::CreateContainerResponse>, Status> {
        pods::create_container(&self.daemon, req).await
    }

    async fn start_container(
        &self,
        req: Request<cri::StartContainerRequest>,
    ) -> Result<Response<cri::StartContainerResponse>, Status> {
        pods::start_container(&self.daemon, req).await
    }

    async fn stop_container(
        &self,
        req: Request<cri::StopContainerRequest>,
    ) -> Result<Response<cri::StopContainerResponse>, Status> {
        pods::stop_container(&self.daemon, req).await
    }

    async fn remove_container(
        &self,
        req: Request<cri::RemoveContainerRequest>,
    ) -> Result<Response<cri::RemoveContainerResponse>, Status> {
        pods::remove_container(&self.daemon, req).await
    }

    async fn list_containers(
        &self,
        req: Request<cri::ListContainersRequest>,
    ) -> Result<Response<cri::ListContainersResponse>, Status> {
        pods::list_containers(&self.daemon, req).await
    }

    async fn container_status(
        &self,
        req: Request<cri::ContainerStatusRequest>,
    ) -> Result<Response<cri::ContainerStatusResponse>, Status> {
        pods::container_status(&self.daemon, req).await
    }

    async fn update_container_resources(
        &self,
        req: Request<cri::UpdateContainerResourcesRequest>,
    ) -> Result<Response<cri::UpdateContainerResourcesResponse>, Status> {
        pods::update_container_resources(&self.daemon, req).await
    }

    async fn reopen_container_log(
        &self,
        req: Request<cri::ReopenContainerLogRequest>,
    ) -> Result<Response<cri::ReopenContainerLogResponse>, Status> {
        pods::reopen_container_log(&self.daemon, req).await
    }

    async fn get_container_events(
        &self,
        _req: Request<cri::GetEventsRequest>,
    ) -> Result<Response<tonic::codegen::BoxStream<cri::ContainerEventResponse>>, Status> {
        super::events::get_container_events(&self.daemon)
    }

    async fn exec_sync(
        &self,
        req: Request<cri::ExecSyncRequest>,
    ) -> Result<Response<cri::ExecSyncResponse>, Status> {
        pods::exec_sync(&self.daemon, req).await
    }

    async fn exec(
        &self,
        req: Request<cri::ExecRequest>,
    ) -> Result<Response<cri::ExecResponse>, Status> {
        streaming::exec(&self.daemon, req).await
    }

    async fn attach(
        &self,
        req: Request<cri::AttachRequest>,
    ) -> Result<Response<cri::AttachResponse>, Status> {
        streaming::attach(&self.daemon, req).await
    }

    async fn port_forward(
        &self,
        req: Request<cri::PortForwardRequest>,
    ) -> Result<Response<cri::PortForwardResponse>, Status> {
        streaming::port_forward(&self.daemon, req).await
    }

    async fn container_stats(
        &self,
        req: Request<cri::ContainerStatsRequest>,
    ) -> Result<Response<cri::ContainerStatsResponse>, Status> {
        stats::container_stats(&self.daemon, req).await
    }

    async fn list_container_stats(
        &self,
        req: Request<cri::ListContainerStatsRequest>,
    ) -> Result<Response<cri::ListContainerStatsResponse>, Status> {
        stats::list_container_stats(&self.daemon, req).await
    }

    async fn pod_sandbox_stats(
        &self,
        req: Request<cri::PodSandboxStatsRequest>,
    ) -> Result<Response<cri::PodSandboxStatsResponse>, Status> {
        stats::pod_sandbox_stats(&self.daemon, req).await
    }

    async fn list_pod_sandbox_stats(
        &self,
        req: Request<cri::ListPodSandboxStatsRequest>,
    ) -> Result<Response<cri::ListPodSandboxStatsResponse>, Status> {
        stats::list_pod_sandbox_stats(&self.daemon, req).await
    }
}

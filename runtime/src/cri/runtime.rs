//! CRI RuntimeService. Version, Status and RuntimeConfig are answered here; the pod and container
//! RPCs are not written yet and answer UNIMPLEMENTED through the generated default stubs.

use std::collections::HashMap;
use std::sync::Arc;

use minicri_proto::runtime::v1 as cri;
use minicri_proto::runtime::v1::runtime_service_server::RuntimeService;
use tonic::{Request, Response, Status};

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
            let network = self.daemon.network_condition();
            let mut info = HashMap::new();
            if verbose {
                info.insert("config".to_string(), self.daemon.config_json());
            }
            Ok(cri::StatusResponse {
                status: Some(cri::RuntimeStatus {
                    conditions: vec![
                        cri::RuntimeCondition {
                            r#type: "RuntimeReady".into(),
                            status: true,
                            ..Default::default()
                        },
                        network,
                    ],
                }),
                info,
                runtime_handlers: vec![cri::RuntimeHandler {
                    name: String::new(),
                    features: Some(cri::RuntimeHandlerFeatures {
                        recursive_read_only_mounts: false,
                        user_namespaces: false,
                    }),
                }],
                features: Some(cri::RuntimeFeatures::default()),
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
                self.daemon.set_pod_cidr(cidr);
                Ok(cri::UpdateRuntimeConfigResponse {})
            },
        )
        .await
    }
}

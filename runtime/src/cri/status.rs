//! The runtime's own state (CRI RuntimeService): Version, Status (conditions, runtime handlers
//! and features), RuntimeConfig (the cgroup driver) and UpdateRuntimeConfig (the pod CIDR).

use std::collections::HashMap;

use minicri_proto::runtime::v1 as cri;
use tonic::{Request, Response, Status};

use crate::daemon::Daemon;
use crate::oci::CgroupDriver;
use crate::rpc::{Verbosity, call, deadline};

/// The CRI API version minicri implements.
pub const CRI_API_VERSION: &str = "v1";

pub(super) async fn version(
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

pub(super) async fn status(
    daemon: &Daemon,
    req: Request<cri::StatusRequest>,
) -> Result<Response<cri::StatusResponse>, Status> {
    let dl = deadline(&req);
    let verbose = req.get_ref().verbose;
    call("Status", "", dl, Verbosity::Poll, async {
        let handlers = Probed::of(daemon);
        let (runtime_handlers, runtime_ready) = handlers.to_cri();
        let mut info = HashMap::new();
        if verbose {
            info.insert("config".to_string(), daemon.config_json());
            info.insert("kubeWatch".to_string(), daemon.kube.to_json().to_string());
            info.insert(
                "runtimeHandlers".to_string(),
                handlers.to_json().to_string(),
            );
        }
        Ok(cri::StatusResponse {
            status: Some(cri::RuntimeStatus {
                conditions: vec![runtime_ready, daemon.network_condition()],
            }),
            info,
            runtime_handlers,
            // SupplementalGroupsPolicy: `Strict` is honoured (crate::spec::user) and
            // ContainerStatus reports the process's groups.
            features: Some(cri::RuntimeFeatures {
                supplemental_groups_policy: true,
                ..Default::default()
            }),
        })
    })
    .await
}

/// Every configured runtime handler with what its probe found. The probes ran before the CRI
/// was served; a handler they could not reach counts as unavailable.
struct Probed<'a> {
    handlers: Vec<(&'a crate::oci::Handler, Result<(), String>)>,
    default: &'a str,
}

impl<'a> Probed<'a> {
    fn of(daemon: &'a Daemon) -> Self {
        let all = daemon.pods.handlers();
        Probed {
            handlers: all
                .all()
                .map(|h| (&**h, h.probed().unwrap_or_else(|| Err("not probed".into()))))
                .collect(),
            default: all.default_name(),
        }
    }

    /// The handlers the kubelet may name (the default first as "", what pods naming none get,
    /// then every handler that works here by its name) and the RuntimeReady condition, false
    /// when the default handler does not work.
    fn to_cri(&self) -> (Vec<cri::RuntimeHandler>, cri::RuntimeCondition) {
        let features = |h: &crate::oci::Handler| cri::RuntimeHandlerFeatures {
            recursive_read_only_mounts: h.features.recursive_read_only_mounts,
            user_namespaces: h.features.user_namespaces,
        };
        let mut runtime_handlers = Vec::new();
        let mut ready = cri::RuntimeCondition {
            r#type: "RuntimeReady".into(),
            status: true,
            ..Default::default()
        };
        for (h, r) in &self.handlers {
            let default = h.name == self.default;
            match r {
                Ok(()) if default => runtime_handlers.insert(
                    0,
                    cri::RuntimeHandler {
                        name: String::new(),
                        features: Some(features(h)),
                    },
                ),
                Err(reason) if default => {
                    ready.status = false;
                    ready.reason = "DefaultRuntimeHandlerUnavailable".into();
                    ready.message = format!(
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
        (runtime_handlers, ready)
    }

    /// The verbose Status's `runtimeHandlers`: each handler's binary, root and probe result.
    fn to_json(&self) -> serde_json::Value {
        self.handlers
            .iter()
            .map(|(h, r)| {
                let command = h.runtime.command();
                serde_json::json!({
                    "name": h.name, "default": h.name == self.default,
                    "binary": command.binary, "root": command.root,
                    "available": r.is_ok(), "reason": r.as_ref().err(),
                })
            })
            .collect()
    }
}

pub(super) async fn runtime_config(
    daemon: &Daemon,
    req: Request<cri::RuntimeConfigRequest>,
) -> Result<Response<cri::RuntimeConfigResponse>, Status> {
    let dl = deadline(&req);
    call("RuntimeConfig", "", dl, Verbosity::Normal, async {
        let driver = match daemon.config.runtime.cgroup_driver {
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

/// UpdateRuntimeConfig carries the node's pod CIDR, which the kubelet sends once it knows it;
/// it is kept and shown in the verbose Status (minicri's CNI configurations name their own
/// ranges).
pub(super) async fn update_runtime_config(
    daemon: &Daemon,
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
            daemon.pods.cni().set_pod_cidr(&cidr);
            Ok(cri::UpdateRuntimeConfigResponse {})
        },
    )
    .await
}

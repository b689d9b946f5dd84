//! CRI RuntimeService: the pod sandbox and container RPCs. Each validates and converts, then
//! calls [`crate::pods::PodService`]; the `impl RuntimeService` in [`super::runtime`] delegates
//! here.

use std::collections::HashMap;
use std::sync::Arc;

use minicri_proto::runtime::v1 as cri;
use tonic::{Request, Response, Status};

use crate::daemon::Daemon;
use crate::error::Error;
use crate::pods::inspect::INFO_KEY;
use crate::rpc::{Verbosity, call, deadline};

type Reply<T> = Result<Response<T>, Status>;

pub(super) fn require_id(field: &str, id: &str) -> Result<(), Error> {
    if id.is_empty() {
        return Err(Error::InvalidArgument(format!("{field} is required")));
    }
    Ok(())
}

pub async fn run_pod_sandbox(
    d: &Arc<Daemon>,
    req: Request<cri::RunPodSandboxRequest>,
) -> Reply<cri::RunPodSandboxResponse> {
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
        let id = d.pods.run_pod_sandbox(config, r.runtime_handler).await?;
        Ok(cri::RunPodSandboxResponse { pod_sandbox_id: id })
    })
    .await
}

pub async fn stop_pod_sandbox(
    d: &Arc<Daemon>,
    req: Request<cri::StopPodSandboxRequest>,
) -> Reply<cri::StopPodSandboxResponse> {
    let dl = deadline(&req);
    let id = req.into_inner().pod_sandbox_id;
    call("StopPodSandbox", id.clone(), dl, Verbosity::Normal, async {
        require_id("pod_sandbox_id", &id)?;
        d.pods.stop_pod_sandbox(id).await?;
        Ok(cri::StopPodSandboxResponse {})
    })
    .await
}

pub async fn remove_pod_sandbox(
    d: &Arc<Daemon>,
    req: Request<cri::RemovePodSandboxRequest>,
) -> Reply<cri::RemovePodSandboxResponse> {
    let dl = deadline(&req);
    let id = req.into_inner().pod_sandbox_id;
    call(
        "RemovePodSandbox",
        id.clone(),
        dl,
        Verbosity::Normal,
        async {
            require_id("pod_sandbox_id", &id)?;
            d.pods.remove_pod_sandbox(id).await?;
            Ok(cri::RemovePodSandboxResponse {})
        },
    )
    .await
}

pub async fn pod_sandbox_status(
    d: &Arc<Daemon>,
    req: Request<cri::PodSandboxStatusRequest>,
) -> Reply<cri::PodSandboxStatusResponse> {
    let dl = deadline(&req);
    let r = req.into_inner();
    let id = r.pod_sandbox_id;
    call("PodSandboxStatus", id.clone(), dl, Verbosity::Poll, async {
        require_id("pod_sandbox_id", &id)?;
        let status = d.pods.pod_sandbox_status(&id)?;
        let mut info = HashMap::new();
        if r.verbose {
            info.insert(INFO_KEY.to_string(), d.pods.sandbox_info(&id)?);
        }
        Ok(cri::PodSandboxStatusResponse {
            status: Some(status),
            info,
            containers_statuses: vec![],
            timestamp: crate::pods::now_ns(),
        })
    })
    .await
}

pub async fn list_pod_sandbox(
    d: &Arc<Daemon>,
    req: Request<cri::ListPodSandboxRequest>,
) -> Reply<cri::ListPodSandboxResponse> {
    let dl = deadline(&req);
    let filter = req.into_inner().filter;
    call("ListPodSandbox", "", dl, Verbosity::Poll, async {
        Ok(cri::ListPodSandboxResponse {
            items: d.pods.list_pod_sandbox(filter),
        })
    })
    .await
}

pub async fn create_container(
    d: &Arc<Daemon>,
    req: Request<cri::CreateContainerRequest>,
) -> Reply<cri::CreateContainerResponse> {
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
        require_id("pod_sandbox_id", &r.pod_sandbox_id)?;
        let config = r
            .config
            .ok_or_else(|| Error::InvalidArgument("config is required".into()))?;
        let id = d
            .pods
            .create_container(r.pod_sandbox_id, config, r.sandbox_config)
            .await?;
        Ok(cri::CreateContainerResponse { container_id: id })
    })
    .await
}

pub async fn start_container(
    d: &Arc<Daemon>,
    req: Request<cri::StartContainerRequest>,
) -> Reply<cri::StartContainerResponse> {
    let dl = deadline(&req);
    let id = req.into_inner().container_id;
    call("StartContainer", id.clone(), dl, Verbosity::Normal, async {
        require_id("container_id", &id)?;
        d.pods.start_container(id).await?;
        Ok(cri::StartContainerResponse {})
    })
    .await
}

pub async fn stop_container(
    d: &Arc<Daemon>,
    req: Request<cri::StopContainerRequest>,
) -> Reply<cri::StopContainerResponse> {
    let dl = deadline(&req);
    let r = req.into_inner();
    call(
        "StopContainer",
        r.container_id.clone(),
        dl,
        Verbosity::Normal,
        async {
            require_id("container_id", &r.container_id)?;
            d.pods.stop_container(r.container_id, r.timeout).await?;
            Ok(cri::StopContainerResponse {})
        },
    )
    .await
}

pub async fn remove_container(
    d: &Arc<Daemon>,
    req: Request<cri::RemoveContainerRequest>,
) -> Reply<cri::RemoveContainerResponse> {
    let dl = deadline(&req);
    let id = req.into_inner().container_id;
    call(
        "RemoveContainer",
        id.clone(),
        dl,
        Verbosity::Normal,
        async {
            require_id("container_id", &id)?;
            d.pods.remove_container(id).await?;
            Ok(cri::RemoveContainerResponse {})
        },
    )
    .await
}

pub async fn list_containers(
    d: &Arc<Daemon>,
    req: Request<cri::ListContainersRequest>,
) -> Reply<cri::ListContainersResponse> {
    let dl = deadline(&req);
    let filter = req.into_inner().filter;
    call("ListContainers", "", dl, Verbosity::Poll, async {
        Ok(cri::ListContainersResponse {
            containers: d.pods.list_containers(filter),
        })
    })
    .await
}

pub async fn container_status(
    d: &Arc<Daemon>,
    req: Request<cri::ContainerStatusRequest>,
) -> Reply<cri::ContainerStatusResponse> {
    let dl = deadline(&req);
    let r = req.into_inner();
    let id = r.container_id;
    call("ContainerStatus", id.clone(), dl, Verbosity::Poll, async {
        require_id("container_id", &id)?;
        let status = d.pods.container_status(&id)?;
        let mut info = HashMap::new();
        if r.verbose {
            info.insert(INFO_KEY.to_string(), d.pods.container_info(&id)?);
        }
        Ok(cri::ContainerStatusResponse {
            status: Some(status),
            info,
        })
    })
    .await
}

pub async fn update_container_resources(
    d: &Arc<Daemon>,
    req: Request<cri::UpdateContainerResourcesRequest>,
) -> Reply<cri::UpdateContainerResourcesResponse> {
    let dl = deadline(&req);
    let r = req.into_inner();
    call(
        "UpdateContainerResources",
        r.container_id.clone(),
        dl,
        Verbosity::Normal,
        async {
            require_id("container_id", &r.container_id)?;
            d.pods
                .update_container_resources(&r.container_id, r.linux)
                .await?;
            Ok(cri::UpdateContainerResourcesResponse {})
        },
    )
    .await
}

pub async fn reopen_container_log(
    d: &Arc<Daemon>,
    req: Request<cri::ReopenContainerLogRequest>,
) -> Reply<cri::ReopenContainerLogResponse> {
    let dl = deadline(&req);
    let id = req.into_inner().container_id;
    call(
        "ReopenContainerLog",
        id.clone(),
        dl,
        Verbosity::Normal,
        async {
            require_id("container_id", &id)?;
            d.pods.reopen_container_log(&id).await?;
            Ok(cri::ReopenContainerLogResponse {})
        },
    )
    .await
}

pub async fn exec_sync(
    d: &Arc<Daemon>,
    req: Request<cri::ExecSyncRequest>,
) -> Reply<cri::ExecSyncResponse> {
    let dl = deadline(&req);
    let r = req.into_inner();
    call(
        "ExecSync",
        r.container_id.clone(),
        dl,
        Verbosity::Normal,
        async {
            require_id("container_id", &r.container_id)?;
            d.pods.exec_sync(&r.container_id, r.cmd, r.timeout).await
        },
    )
    .await
}

//! Containers (CRI RuntimeService): CreateContainer, StartContainer, StopContainer,
//! RemoveContainer, ListContainers, StreamContainers, ContainerStatus, UpdateContainerResources,
//! ReopenContainerLog, CheckpointContainer. The work is [`crate::pods::PodService`]'s.

use minicri_proto::runtime::v1 as cri;
use tonic::{Request, Response, Status};

use super::{Reply, Streamed, info};
use crate::daemon::Daemon;
use crate::error::Error;
use crate::rpc::{Verbosity, call, call_batched, call_on, deadline};

/// CreateContainer: `pod_sandbox_id` and `config` are required. The `sandbox_config` the kubelet
/// also sends is not read: the sandbox's own record (the config it was run with) is what counts.
pub(super) async fn create_container(
    daemon: &Daemon,
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
        let id = daemon
            .pods
            .create_container(r.pod_sandbox_id, config, r.sandbox_config)
            .await?;
        Ok(cri::CreateContainerResponse { container_id: id })
    })
    .await
}

pub(super) async fn start_container(
    daemon: &Daemon,
    req: Request<cri::StartContainerRequest>,
) -> Reply<cri::StartContainerResponse> {
    call_on(
        "StartContainer",
        Verbosity::Normal,
        req,
        ("container_id", |r| r.container_id.clone()),
        |r| async move {
            daemon.pods.start_container(r.container_id).await?;
            Ok(cri::StartContainerResponse {})
        },
    )
    .await
}

/// StopContainer is idempotent (api.proto): a stopped or unknown container answers OK;
/// `timeout` is the grace period in seconds before SIGKILL.
pub(super) async fn stop_container(
    daemon: &Daemon,
    req: Request<cri::StopContainerRequest>,
) -> Reply<cri::StopContainerResponse> {
    call_on(
        "StopContainer",
        Verbosity::Normal,
        req,
        ("container_id", |r| r.container_id.clone()),
        |r| async move {
            let pods = &daemon.pods;
            pods.stop_container(r.container_id, r.timeout).await?;
            Ok(cri::StopContainerResponse {})
        },
    )
    .await
}

/// RemoveContainer is idempotent (api.proto) and stops a running container first.
pub(super) async fn remove_container(
    daemon: &Daemon,
    req: Request<cri::RemoveContainerRequest>,
) -> Reply<cri::RemoveContainerResponse> {
    call_on(
        "RemoveContainer",
        Verbosity::Normal,
        req,
        ("container_id", |r| r.container_id.clone()),
        |r| async move {
            daemon.pods.remove_container(r.container_id).await?;
            Ok(cri::RemoveContainerResponse {})
        },
    )
    .await
}

pub(super) async fn list_containers(
    daemon: &Daemon,
    req: Request<cri::ListContainersRequest>,
) -> Result<Response<cri::ListContainersResponse>, Status> {
    let dl = deadline(&req);
    let filter = req.into_inner().filter;
    call("ListContainers", "", dl, Verbosity::Poll, async {
        Ok(cri::ListContainersResponse {
            containers: daemon.pods.list_containers(filter),
        })
    })
    .await
}

pub(super) async fn stream_containers(
    daemon: &Daemon,
    req: Request<cri::StreamContainersRequest>,
) -> Streamed<cri::StreamContainersResponse> {
    let dl = deadline(&req);
    let filter = req.into_inner().filter;
    let list = async { Ok(daemon.pods.list_containers(filter)) };
    call_batched(
        "StreamContainers",
        dl,
        Verbosity::Poll,
        list,
        |containers| cri::StreamContainersResponse { containers },
    )
    .await
}

/// ContainerStatus of an unknown container is NOT_FOUND; `verbose` adds its record as JSON.
pub(super) async fn container_status(
    daemon: &Daemon,
    req: Request<cri::ContainerStatusRequest>,
) -> Reply<cri::ContainerStatusResponse> {
    call_on(
        "ContainerStatus",
        Verbosity::Poll,
        req,
        ("container_id", |r| r.container_id.clone()),
        |r| async move {
            let (pods, id) = (&daemon.pods, &r.container_id);
            Ok(cri::ContainerStatusResponse {
                status: Some(pods.container_status(id)?),
                info: info(r.verbose, || pods.container_info(id))?,
            })
        },
    )
    .await
}

pub(super) async fn update_container_resources(
    daemon: &Daemon,
    req: Request<cri::UpdateContainerResourcesRequest>,
) -> Reply<cri::UpdateContainerResourcesResponse> {
    call_on(
        "UpdateContainerResources",
        Verbosity::Normal,
        req,
        ("container_id", |r| r.container_id.clone()),
        |r| async move {
            let pods = &daemon.pods;
            pods.update_container_resources(&r.container_id, r.linux)
                .await?;
            Ok(cri::UpdateContainerResourcesResponse {})
        },
    )
    .await
}

pub(super) async fn reopen_container_log(
    daemon: &Daemon,
    req: Request<cri::ReopenContainerLogRequest>,
) -> Reply<cri::ReopenContainerLogResponse> {
    call_on(
        "ReopenContainerLog",
        Verbosity::Normal,
        req,
        ("container_id", |r| r.container_id.clone()),
        |r| async move {
            daemon.pods.reopen_container_log(&r.container_id).await?;
            Ok(cri::ReopenContainerLogResponse {})
        },
    )
    .await
}

/// CheckpointContainer with CRIU: the archive goes to `location` (`crictl checkpoint
/// --export`), the container keeps running; `timeout` in seconds (0: the default). A host where
/// CRIU cannot run answers FAILED_PRECONDITION with CRIU's reason, the container untouched.
pub(super) async fn checkpoint_container(
    daemon: &Daemon,
    req: Request<cri::CheckpointContainerRequest>,
) -> Reply<cri::CheckpointContainerResponse> {
    call_on(
        "CheckpointContainer",
        Verbosity::Normal,
        req,
        ("container_id", |r| r.container_id.clone()),
        |r| async move {
            daemon
                .pods
                .checkpoint_container(r.container_id, r.location, r.timeout)
                .await?;
            Ok(cri::CheckpointContainerResponse {})
        },
    )
    .await
}

//! Pod sandboxes (CRI RuntimeService): RunPodSandbox, StopPodSandbox, RemovePodSandbox,
//! PodSandboxStatus, ListPodSandbox, StreamPodSandboxes, UpdatePodSandboxResources. The work is
//! [`crate::pods::PodService`]'s; these check what the request must carry and convert.

use minicri_proto::runtime::v1 as cri;
use tonic::{Request, Response, Status};

use super::{Reply, Streamed, info};
use crate::daemon::Daemon;
use crate::error::Error;
use crate::rpc::{Verbosity, call, call_batched, call_on, deadline};

/// RunPodSandbox: `config` is required; an empty `runtime_handler` is the default handler.
pub(super) async fn run_pod_sandbox(
    daemon: &Daemon,
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
        let id = daemon
            .pods
            .run_pod_sandbox(config, r.runtime_handler)
            .await?;
        Ok(cri::RunPodSandboxResponse { pod_sandbox_id: id })
    })
    .await
}

/// StopPodSandbox is idempotent (api.proto): a sandbox already stopped, or unknown because it
/// was removed, answers OK. Stopping it first releases its pulls (docs/pulls.md).
pub(super) async fn stop_pod_sandbox(
    daemon: &Daemon,
    req: Request<cri::StopPodSandboxRequest>,
) -> Reply<cri::StopPodSandboxResponse> {
    call_on(
        "StopPodSandbox",
        Verbosity::Normal,
        req,
        ("pod_sandbox_id", |r| r.pod_sandbox_id.clone()),
        |r| async move {
            daemon.pods.stop_pod_sandbox(r.pod_sandbox_id).await?;
            Ok(cri::StopPodSandboxResponse {})
        },
    )
    .await
}

/// RemovePodSandbox succeeds when the sandbox is already gone (api.proto); a live one is
/// stopped first and its containers removed with it.
pub(super) async fn remove_pod_sandbox(
    daemon: &Daemon,
    req: Request<cri::RemovePodSandboxRequest>,
) -> Reply<cri::RemovePodSandboxResponse> {
    call_on(
        "RemovePodSandbox",
        Verbosity::Normal,
        req,
        ("pod_sandbox_id", |r| r.pod_sandbox_id.clone()),
        |r| async move {
            daemon.pods.remove_pod_sandbox(r.pod_sandbox_id).await?;
            Ok(cri::RemovePodSandboxResponse {})
        },
    )
    .await
}

/// PodSandboxStatus of an unknown sandbox is NOT_FOUND (the kubelet takes that as removed);
/// `verbose` adds the sandbox's record as JSON under `info`.
pub(super) async fn pod_sandbox_status(
    daemon: &Daemon,
    req: Request<cri::PodSandboxStatusRequest>,
) -> Reply<cri::PodSandboxStatusResponse> {
    call_on(
        "PodSandboxStatus",
        Verbosity::Poll,
        req,
        ("pod_sandbox_id", |r| r.pod_sandbox_id.clone()),
        |r| async move {
            let (pods, id) = (&daemon.pods, &r.pod_sandbox_id);
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

pub(super) async fn list_pod_sandbox(
    daemon: &Daemon,
    req: Request<cri::ListPodSandboxRequest>,
) -> Result<Response<cri::ListPodSandboxResponse>, Status> {
    let dl = deadline(&req);
    let filter = req.into_inner().filter;
    call("ListPodSandbox", "", dl, Verbosity::Poll, async {
        Ok(cri::ListPodSandboxResponse {
            items: daemon.pods.list_pod_sandbox(filter),
        })
    })
    .await
}

pub(super) async fn stream_pod_sandboxes(
    daemon: &Daemon,
    req: Request<cri::StreamPodSandboxesRequest>,
) -> Streamed<cri::StreamPodSandboxesResponse> {
    let dl = deadline(&req);
    let filter = req.into_inner().filter;
    let list = async { Ok(daemon.pods.list_pod_sandbox(filter)) };
    call_batched(
        "StreamPodSandboxes",
        dl,
        Verbosity::Poll,
        list,
        |pod_sandboxes| cri::StreamPodSandboxesResponse { pod_sandboxes },
    )
    .await
}

pub(super) async fn update_pod_sandbox_resources(
    daemon: &Daemon,
    req: Request<cri::UpdatePodSandboxResourcesRequest>,
) -> Reply<cri::UpdatePodSandboxResourcesResponse> {
    call_on(
        "UpdatePodSandboxResources",
        Verbosity::Normal,
        req,
        ("pod_sandbox_id", |r| r.pod_sandbox_id.clone()),
        |r| async move {
            daemon.pods.update_pod_sandbox_resources(r).await?;
            Ok(cri::UpdatePodSandboxResourcesResponse {})
        },
    )
    .await
}

//! CRI RuntimeService: the stats RPCs (ContainerStats, ListContainerStats, PodSandboxStats,
//! ListPodSandboxStats). Each validates, then calls [`crate::pods::PodService`]
//! (`pods/stats.rs`); the `impl RuntimeService` in [`super::runtime`] delegates here. The kubelet
//! polls them, so successes log at debug level.

use std::sync::Arc;

use minicri_proto::runtime::v1 as cri;
use tonic::{Request, Response, Status};

use super::pods::require_id;
use crate::daemon::Daemon;
use crate::rpc::{Verbosity, call, deadline};

type Reply<T> = Result<Response<T>, Status>;

pub async fn container_stats(
    d: &Arc<Daemon>,
    req: Request<cri::ContainerStatsRequest>,
) -> Reply<cri::ContainerStatsResponse> {
    let dl = deadline(&req);
    let id = req.into_inner().container_id;
    call("ContainerStats", id.clone(), dl, Verbosity::Poll, async {
        require_id("container_id", &id)?;
        Ok(cri::ContainerStatsResponse {
            stats: Some(d.pods.container_stats(&id).await?),
        })
    })
    .await
}

pub async fn list_container_stats(
    d: &Arc<Daemon>,
    req: Request<cri::ListContainerStatsRequest>,
) -> Reply<cri::ListContainerStatsResponse> {
    let dl = deadline(&req);
    let filter = req.into_inner().filter;
    call("ListContainerStats", "", dl, Verbosity::Poll, async {
        Ok(cri::ListContainerStatsResponse {
            stats: d.pods.list_container_stats(filter).await?,
        })
    })
    .await
}

pub async fn pod_sandbox_stats(
    d: &Arc<Daemon>,
    req: Request<cri::PodSandboxStatsRequest>,
) -> Reply<cri::PodSandboxStatsResponse> {
    let dl = deadline(&req);
    let id = req.into_inner().pod_sandbox_id;
    call("PodSandboxStats", id.clone(), dl, Verbosity::Poll, async {
        require_id("pod_sandbox_id", &id)?;
        Ok(cri::PodSandboxStatsResponse {
            stats: Some(d.pods.pod_sandbox_stats(&id).await?),
        })
    })
    .await
}

pub async fn list_pod_sandbox_stats(
    d: &Arc<Daemon>,
    req: Request<cri::ListPodSandboxStatsRequest>,
) -> Reply<cri::ListPodSandboxStatsResponse> {
    let dl = deadline(&req);
    let filter = req.into_inner().filter;
    call("ListPodSandboxStats", "", dl, Verbosity::Poll, async {
        Ok(cri::ListPodSandboxStatsResponse {
            stats: d.pods.list_pod_sandbox_stats(filter).await?,
        })
    })
    .await
}

//! Stats and metrics (CRI RuntimeService): ContainerStats, ListContainerStats,
//! StreamContainerStats, PodSandboxStats, ListPodSandboxStats, StreamPodSandboxStats,
//! ListMetricDescriptors, ListPodSandboxMetrics, StreamPodSandboxMetrics. The kubelet polls them:
//! successes log at debug level ([`Verbosity::Poll`]).

use minicri_proto::runtime::v1 as cri;
use tonic::{Request, Response, Status};

use super::{Reply, Streamed};
use crate::daemon::Daemon;
use crate::rpc::{Verbosity, call, call_batched, call_on, deadline};

pub(super) async fn container_stats(
    daemon: &Daemon,
    req: Request<cri::ContainerStatsRequest>,
) -> Reply<cri::ContainerStatsResponse> {
    call_on(
        "ContainerStats",
        Verbosity::Poll,
        req,
        ("container_id", |r| r.container_id.clone()),
        |r| async move {
            let stats = daemon.pods.container_stats(&r.container_id).await?;
            Ok(cri::ContainerStatsResponse { stats: Some(stats) })
        },
    )
    .await
}

pub(super) async fn list_container_stats(
    daemon: &Daemon,
    req: Request<cri::ListContainerStatsRequest>,
) -> Result<Response<cri::ListContainerStatsResponse>, Status> {
    let dl = deadline(&req);
    let filter = req.into_inner().filter;
    call("ListContainerStats", "", dl, Verbosity::Poll, async {
        Ok(cri::ListContainerStatsResponse {
            stats: daemon.pods.list_container_stats(filter).await?,
        })
    })
    .await
}

pub(super) async fn stream_container_stats(
    daemon: &Daemon,
    req: Request<cri::StreamContainerStatsRequest>,
) -> Streamed<cri::StreamContainerStatsResponse> {
    let dl = deadline(&req);
    let filter = req.into_inner().filter;
    let list = daemon.pods.list_container_stats(filter);
    call_batched(
        "StreamContainerStats",
        dl,
        Verbosity::Poll,
        list,
        |container_stats| cri::StreamContainerStatsResponse { container_stats },
    )
    .await
}

pub(super) async fn pod_sandbox_stats(
    daemon: &Daemon,
    req: Request<cri::PodSandboxStatsRequest>,
) -> Reply<cri::PodSandboxStatsResponse> {
    call_on(
        "PodSandboxStats",
        Verbosity::Poll,
        req,
        ("pod_sandbox_id", |r| r.pod_sandbox_id.clone()),
        |r| async move {
            let stats = daemon.pods.pod_sandbox_stats(&r.pod_sandbox_id).await?;
            Ok(cri::PodSandboxStatsResponse { stats: Some(stats) })
        },
    )
    .await
}

pub(super) async fn list_pod_sandbox_stats(
    daemon: &Daemon,
    req: Request<cri::ListPodSandboxStatsRequest>,
) -> Result<Response<cri::ListPodSandboxStatsResponse>, Status> {
    let dl = deadline(&req);
    let filter = req.into_inner().filter;
    call("ListPodSandboxStats", "", dl, Verbosity::Poll, async {
        Ok(cri::ListPodSandboxStatsResponse {
            stats: daemon.pods.list_pod_sandbox_stats(filter).await?,
        })
    })
    .await
}

pub(super) async fn stream_pod_sandbox_stats(
    daemon: &Daemon,
    req: Request<cri::StreamPodSandboxStatsRequest>,
) -> Streamed<cri::StreamPodSandboxStatsResponse> {
    let dl = deadline(&req);
    let filter = req.into_inner().filter;
    let list = daemon.pods.list_pod_sandbox_stats(filter);
    call_batched(
        "StreamPodSandboxStats",
        dl,
        Verbosity::Poll,
        list,
        |pod_sandbox_stats| cri::StreamPodSandboxStatsResponse { pod_sandbox_stats },
    )
    .await
}

pub(super) async fn list_metric_descriptors(
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

pub(super) async fn list_pod_sandbox_metrics(
    daemon: &Daemon,
    req: Request<cri::ListPodSandboxMetricsRequest>,
) -> Reply<cri::ListPodSandboxMetricsResponse> {
    let dl = deadline(&req);
    call("ListPodSandboxMetrics", "", dl, Verbosity::Poll, async {
        Ok(cri::ListPodSandboxMetricsResponse {
            pod_metrics: daemon.pods.list_pod_sandbox_metrics().await?,
        })
    })
    .await
}

pub(super) async fn stream_pod_sandbox_metrics(
    daemon: &Daemon,
    req: Request<cri::StreamPodSandboxMetricsRequest>,
) -> Streamed<cri::StreamPodSandboxMetricsResponse> {
    let dl = deadline(&req);
    let list = daemon.pods.list_pod_sandbox_metrics();
    call_batched(
        "StreamPodSandboxMetrics",
        dl,
        Verbosity::Poll,
        list,
        |pod_sandbox_metrics| cri::StreamPodSandboxMetricsResponse {
            pod_sandbox_metrics,
        },
    )
    .await
}

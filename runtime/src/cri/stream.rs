//! The streamed lists of CRI v0.36 (StreamPodSandboxes, StreamContainers, StreamImages,
//! StreamContainerStats, StreamPodSandboxStats, StreamPodSandboxMetrics): each answers what its
//! list RPC answers, from the same function with the same filter, in batches
//! ([`crate::rpc::call_batched`]) so that a node whose list is more than one gRPC message (the
//! kubelet's limit is 16 MiB) still lists.
//!
//! The list is made whole before the first batch is sent (the records are in memory anyway): what
//! bounds its size is the node's metadata budget (`node_metadata_budget` ([`crate::pods::DEFAULT_NODE_METADATA_BYTES`] by default)), a
//! memory bound now that no answer has to fit one message.

use std::sync::Arc;

use minicri_proto::runtime::v1 as cri;
use tonic::codegen::BoxStream;
use tonic::{Request, Response, Status};

use crate::daemon::Daemon;
use crate::rpc::{Verbosity, call_batched, deadline};

type Streamed<T> = Result<Response<BoxStream<T>>, Status>;

pub async fn pod_sandboxes(
    daemon: &Arc<Daemon>,
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

pub async fn containers(
    daemon: &Arc<Daemon>,
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

pub async fn container_stats(
    daemon: &Arc<Daemon>,
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

pub async fn pod_sandbox_stats(
    daemon: &Arc<Daemon>,
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

pub async fn images(
    daemon: &Arc<Daemon>,
    req: Request<cri::StreamImagesRequest>,
) -> Streamed<cri::StreamImagesResponse> {
    let dl = deadline(&req);
    let filter = super::image::image_filter(req.into_inner().filter);
    let list = async { super::image::list_images(daemon, &filter) };
    call_batched("StreamImages", dl, Verbosity::Poll, list, |images| {
        cri::StreamImagesResponse { images }
    })
    .await
}

pub async fn pod_sandbox_metrics(
    daemon: &Arc<Daemon>,
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

//! The tonic RuntimeService: one method per RPC, each handing the request to its group's
//! handler ([`super::status`], [`super::sandboxes`], [`super::containers`],
//! [`super::streaming`], [`super::stats`], [`super::events`]). This file is the RPC map; the
//! handlers hold the checks and conversions.

use std::sync::Arc;

use minicri_proto::runtime::v1 as cri;
use minicri_proto::runtime::v1::runtime_service_server::RuntimeService;
use tonic::{Request, Response, Status};

use super::{Reply, Streamed, containers, events, sandboxes, stats, status, streaming};
use crate::daemon::Daemon;

pub struct RuntimeHandler {
    pub daemon: Arc<Daemon>,
}

#[tonic::async_trait]
impl RuntimeService for RuntimeHandler {
    async fn version(
        &self,
        req: Request<cri::VersionRequest>,
    ) -> Result<Response<cri::VersionResponse>, Status> {
        status::version(req).await
    }

    async fn status(
        &self,
        req: Request<cri::StatusRequest>,
    ) -> Result<Response<cri::StatusResponse>, Status> {
        status::status(&self.daemon, req).await
    }

    async fn runtime_config(
        &self,
        req: Request<cri::RuntimeConfigRequest>,
    ) -> Result<Response<cri::RuntimeConfigResponse>, Status> {
        status::runtime_config(&self.daemon, req).await
    }

    async fn update_runtime_config(
        &self,
        req: Request<cri::UpdateRuntimeConfigRequest>,
    ) -> Result<Response<cri::UpdateRuntimeConfigResponse>, Status> {
        status::update_runtime_config(&self.daemon, req).await
    }

    async fn run_pod_sandbox(
        &self,
        req: Request<cri::RunPodSandboxRequest>,
    ) -> Result<Response<cri::RunPodSandboxResponse>, Status> {
        sandboxes::run_pod_sandbox(&self.daemon, req).await
    }

    async fn stop_pod_sandbox(
        &self,
        req: Request<cri::StopPodSandboxRequest>,
    ) -> Reply<cri::StopPodSandboxResponse> {
        sandboxes::stop_pod_sandbox(&self.daemon, req).await
    }

    async fn remove_pod_sandbox(
        &self,
        req: Request<cri::RemovePodSandboxRequest>,
    ) -> Reply<cri::RemovePodSandboxResponse> {
        sandboxes::remove_pod_sandbox(&self.daemon, req).await
    }

    async fn pod_sandbox_status(
        &self,
        req: Request<cri::PodSandboxStatusRequest>,
    ) -> Reply<cri::PodSandboxStatusResponse> {
        sandboxes::pod_sandbox_status(&self.daemon, req).await
    }

    async fn list_pod_sandbox(
        &self,
        req: Request<cri::ListPodSandboxRequest>,
    ) -> Result<Response<cri::ListPodSandboxResponse>, Status> {
        sandboxes::list_pod_sandbox(&self.daemon, req).await
    }

    async fn create_container(
        &self,
        req: Request<cri::CreateContainerRequest>,
    ) -> Result<Response<cri::CreateContainerResponse>, Status> {
        containers::create_container(&self.daemon, req).await
    }

    async fn start_container(
        &self,
        req: Request<cri::StartContainerRequest>,
    ) -> Reply<cri::StartContainerResponse> {
        containers::start_container(&self.daemon, req).await
    }

    async fn stop_container(
        &self,
        req: Request<cri::StopContainerRequest>,
    ) -> Reply<cri::StopContainerResponse> {
        containers::stop_container(&self.daemon, req).await
    }

    async fn remove_container(
        &self,
        req: Request<cri::RemoveContainerRequest>,
    ) -> Reply<cri::RemoveContainerResponse> {
        containers::remove_container(&self.daemon, req).await
    }

    async fn list_containers(
        &self,
        req: Request<cri::ListContainersRequest>,
    ) -> Result<Response<cri::ListContainersResponse>, Status> {
        containers::list_containers(&self.daemon, req).await
    }

    async fn container_status(
        &self,
        req: Request<cri::ContainerStatusRequest>,
    ) -> Reply<cri::ContainerStatusResponse> {
        containers::container_status(&self.daemon, req).await
    }

    async fn update_container_resources(
        &self,
        req: Request<cri::UpdateContainerResourcesRequest>,
    ) -> Reply<cri::UpdateContainerResourcesResponse> {
        containers::update_container_resources(&self.daemon, req).await
    }

    async fn reopen_container_log(
        &self,
        req: Request<cri::ReopenContainerLogRequest>,
    ) -> Reply<cri::ReopenContainerLogResponse> {
        containers::reopen_container_log(&self.daemon, req).await
    }

    async fn get_container_events(
        &self,
        _req: Request<cri::GetEventsRequest>,
    ) -> Result<Response<tonic::codegen::BoxStream<cri::ContainerEventResponse>>, Status> {
        events::get_container_events(&self.daemon)
    }

    async fn exec_sync(&self, req: Request<cri::ExecSyncRequest>) -> Reply<cri::ExecSyncResponse> {
        streaming::exec_sync(&self.daemon, req).await
    }

    async fn exec(&self, req: Request<cri::ExecRequest>) -> Reply<cri::ExecResponse> {
        streaming::exec(&self.daemon, req).await
    }

    async fn attach(&self, req: Request<cri::AttachRequest>) -> Reply<cri::AttachResponse> {
        streaming::attach(&self.daemon, req).await
    }

    async fn port_forward(
        &self,
        req: Request<cri::PortForwardRequest>,
    ) -> Reply<cri::PortForwardResponse> {
        streaming::port_forward(&self.daemon, req).await
    }

    async fn container_stats(
        &self,
        req: Request<cri::ContainerStatsRequest>,
    ) -> Reply<cri::ContainerStatsResponse> {
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
    ) -> Reply<cri::PodSandboxStatsResponse> {
        stats::pod_sandbox_stats(&self.daemon, req).await
    }

    async fn list_pod_sandbox_stats(
        &self,
        req: Request<cri::ListPodSandboxStatsRequest>,
    ) -> Result<Response<cri::ListPodSandboxStatsResponse>, Status> {
        stats::list_pod_sandbox_stats(&self.daemon, req).await
    }

    async fn stream_pod_sandboxes(
        &self,
        req: Request<cri::StreamPodSandboxesRequest>,
    ) -> Streamed<cri::StreamPodSandboxesResponse> {
        sandboxes::stream_pod_sandboxes(&self.daemon, req).await
    }

    async fn stream_containers(
        &self,
        req: Request<cri::StreamContainersRequest>,
    ) -> Streamed<cri::StreamContainersResponse> {
        containers::stream_containers(&self.daemon, req).await
    }

    async fn stream_container_stats(
        &self,
        req: Request<cri::StreamContainerStatsRequest>,
    ) -> Streamed<cri::StreamContainerStatsResponse> {
        stats::stream_container_stats(&self.daemon, req).await
    }

    async fn stream_pod_sandbox_stats(
        &self,
        req: Request<cri::StreamPodSandboxStatsRequest>,
    ) -> Streamed<cri::StreamPodSandboxStatsResponse> {
        stats::stream_pod_sandbox_stats(&self.daemon, req).await
    }

    async fn list_metric_descriptors(
        &self,
        req: Request<cri::ListMetricDescriptorsRequest>,
    ) -> Reply<cri::ListMetricDescriptorsResponse> {
        stats::list_metric_descriptors(req).await
    }

    async fn list_pod_sandbox_metrics(
        &self,
        req: Request<cri::ListPodSandboxMetricsRequest>,
    ) -> Reply<cri::ListPodSandboxMetricsResponse> {
        stats::list_pod_sandbox_metrics(&self.daemon, req).await
    }

    async fn stream_pod_sandbox_metrics(
        &self,
        req: Request<cri::StreamPodSandboxMetricsRequest>,
    ) -> Streamed<cri::StreamPodSandboxMetricsResponse> {
        stats::stream_pod_sandbox_metrics(&self.daemon, req).await
    }

    async fn checkpoint_container(
        &self,
        req: Request<cri::CheckpointContainerRequest>,
    ) -> Reply<cri::CheckpointContainerResponse> {
        containers::checkpoint_container(&self.daemon, req).await
    }

    async fn update_pod_sandbox_resources(
        &self,
        req: Request<cri::UpdatePodSandboxResourcesRequest>,
    ) -> Reply<cri::UpdatePodSandboxResourcesResponse> {
        sandboxes::update_pod_sandbox_resources(&self.daemon, req).await
    }
}

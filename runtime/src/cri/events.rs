//! GetContainerEvents: the pod store's container events (created, started, stopped, deleted) as
//! a server stream, each with the pod's status and its containers' statuses at the time of
//! sending (what the kubelet's evented PLEG reads).
//!
//! A subscriber that falls more than the store's buffer behind gets ABORTED and the stream ends:
//! it must relist, as the kubelet does when its event stream breaks.

use std::sync::Arc;

use futures::StreamExt;
use minicri_proto::runtime::v1 as cri;
use tokio::sync::broadcast::error::RecvError;
use tonic::codegen::BoxStream;
use tonic::{Response, Status};

use crate::daemon::Daemon;
use crate::pods::store::{ContainerEvent, ContainerEventKind};

fn event_type(k: ContainerEventKind) -> cri::ContainerEventType {
    match k {
        ContainerEventKind::Created => cri::ContainerEventType::ContainerCreatedEvent,
        ContainerEventKind::Started => cri::ContainerEventType::ContainerStartedEvent,
        ContainerEventKind::Stopped => cri::ContainerEventType::ContainerStoppedEvent,
        ContainerEventKind::Deleted => cri::ContainerEventType::ContainerDeletedEvent,
    }
}

fn response(daemon: &Daemon, ev: &ContainerEvent) -> cri::ContainerEventResponse {
    let pods = &daemon.pods;
    cri::ContainerEventResponse {
        container_id: ev.container_id.clone(),
        container_event_type: event_type(ev.kind) as i32,
        created_at: ev.at,
        pod_sandbox_status: pods.pod_sandbox_status(&ev.sandbox_id).ok(),
        containers_statuses: pods.container_statuses_of(&ev.sandbox_id),
    }
}

pub fn get_container_events(
    daemon: &Arc<Daemon>,
) -> Result<Response<BoxStream<cri::ContainerEventResponse>>, Status> {
    let rx = daemon.pods.container_events();
    tracing::debug!("container event subscriber joined");
    let stream = futures::stream::unfold(
        (rx, daemon.clone(), false),
        |(mut rx, daemon, ended)| async move {
            if ended {
                return None;
            }
            match rx.recv().await {
                Ok(ev) => {
                    let r = response(&daemon, &ev);
                    Some((Ok(r), (rx, daemon, false)))
                }
                Err(RecvError::Lagged(n)) => {
                    tracing::warn!(
                        missed = n,
                        "container event subscriber fell behind; ending its stream"
                    );
                    let st = Status::aborted(format!(
                        "{n} container events were dropped because this subscriber fell behind; list containers again and resubscribe"
                    ));
                    Some((Err(st), (rx, daemon, true)))
                }
                Err(RecvError::Closed) => None,
            }
        },
    );
    Ok(Response::new(stream.boxed()))
}

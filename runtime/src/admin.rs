//! minicri's admin API (`minicri.v1.Pulls`): lists pull jobs and drops references on operator request.

use std::sync::Arc;

use minicri_proto::minicri::v1 as admin;
use minicri_proto::minicri::v1::pulls_server::Pulls;
use minicri_store::{AbortTarget, JobSnapshot};
use tonic::{Request, Response, Status};

use crate::daemon::Daemon;
use crate::error::Error;
use crate::rpc::{Verbosity, call, deadline};

pub struct PullsHandler {
    pub daemon: Arc<Daemon>,
}

fn to_proto(j: JobSnapshot) -> admin::PullJob {
    admin::PullJob {
        id: j.id,
        image: j.image,
        key: j.key,
        state: j.state,
        requesters: j
            .requesters
            .into_iter()
            .map(|r| {
                let pod = r.requester.pod.clone().unwrap_or_default();
                admin::PullRequester {
                    sandbox_id: r.requester.sandbox_id.clone().unwrap_or_default(),
                    pod_namespace: pod.namespace,
                    pod_name: pod.name,
                    pod_uid: pod.uid,
                    attempt: pod.attempt,
                    call_id: if r.requester.pod.is_none() {
                        r.requester.call_id
                    } else {
                        0
                    },
                    calls: r.calls as u32,
                    held: r.held_since.is_some(),
                    held_since: r
                        .held_since
                        .and_then(|t| t.timestamp_nanos_opt())
                        .unwrap_or(0),
                    weight: r.requester.weight,
                }
            })
            .collect(),
        layers: j
            .parts
            .into_iter()
            .map(|p| admin::LayerProgress {
                digest: p.digest,
                size: p.size,
                done: p.done,
                resumed_from: p.resumed_from,
                state: p.state,
                bytes_per_second: p.bytes_per_second,
                source: p.source,
                connections: p.connections as u32,
                refetched: p.refetched,
            })
            .collect(),
        bytes_done: j.bytes_done,
        bytes_total: j.bytes_total,
        bytes_per_second: j.bytes_per_second,
        started_at: j.started_at.timestamp_nanos_opt().unwrap_or(0),
    }
}

#[tonic::async_trait]
impl Pulls for PullsHandler {
    async fn list_pulls(
        &self,
        req: Request<admin::ListPullsRequest>,
    ) -> Result<Response<admin::ListPullsResponse>, Status> {
        let dl = deadline(&req);
        call("ListPulls", "", dl, Verbosity::Poll, async {
            let (large, small) = self.daemon.pulls.blobs().schedulers();
            let lane = |name: &str, s: &minicri_store::sched::Scheduler| {
                let snap = s.snapshot();
                admin::TransferLane {
                    name: name.into(),
                    slots: snap.capacity as u32,
                    granted: snap.granted as u32,
                    waiting: snap.waiting as u32,
                }
            };
            let i = self.daemon.content.ingest_usage();
            Ok(admin::ListPullsResponse {
                jobs: self.daemon.pulls.list().into_iter().map(to_proto).collect(),
                lanes: vec![lane("large blobs", large), lane("small blobs", small)],
                ingests: Some(admin::IngestUsage {
                    active: i.active as u32,
                    active_bytes: i.active_bytes,
                    idle: i.idle as u32,
                    idle_bytes: i.idle_bytes,
                }),
            })
        })
        .await
    }

    async fn abort_pulls(
        &self,
        req: Request<admin::AbortPullsRequest>,
    ) -> Result<Response<admin::AbortPullsResponse>, Status> {
        let dl = deadline(&req);
        let req = req.into_inner();
        let object = format!("{:?}", req.target);
        call("AbortPulls", object, dl, Verbosity::Normal, async {
            use admin::abort_pulls_request::Target;
            let target = match req.target {
                Some(Target::SandboxId(id)) if !id.is_empty() => AbortTarget::Sandbox(id),
                Some(Target::Pod(p)) => match p.split_once('/') {
                    Some((ns, name)) if !ns.is_empty() && !name.is_empty() => AbortTarget::Pod {
                        namespace: ns.to_string(),
                        name: name.to_string(),
                    },
                    _ => {
                        return Err(Error::InvalidArgument(format!(
                            "pod {p:?} is not namespace/name"
                        )));
                    }
                },
                Some(Target::Image(i)) if !i.is_empty() => {
                    minicri_store::Reference::parse(&i)?;
                    AbortTarget::Image(i)
                }
                _ => {
                    return Err(Error::InvalidArgument(
                        "say which pulls to abort: sandbox_id, pod or image".into(),
                    ));
                }
            };
            let reason = if req.reason.is_empty() {
                "aborted by operator".to_string()
            } else {
                req.reason
            };
            let n = self.daemon.pulls.abort(&target, &reason);
            tracing::info!(?target, references_dropped = n, %reason, "pulls aborted");
            Ok(admin::AbortPullsResponse {
                references_dropped: n as u32,
            })
        })
        .await
    }
}

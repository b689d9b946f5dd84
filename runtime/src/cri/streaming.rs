//! CRI RuntimeService: Exec, Attach and PortForward, whose answers are URLs of the streaming
//! server ([`crate::stream`]).
//!
//! Exec checks what can be checked before the client connects (api.proto: the command, the
//! streams, the container), then keeps the request under a single-use token valid for a minute.
//! The process starts when the client opens the URL.

use std::sync::Arc;

use minicri_proto::runtime::v1 as cri;
use tonic::{Request, Response, Status};

use super::pods::require_id;
use crate::daemon::Daemon;
use crate::error::Error;
use crate::pods::store::SandboxState;
use crate::rpc::{Verbosity, call, deadline};
use crate::stream::{AttachRequest, ExecRequest, PortForwardRequest};

type Reply<T> = Result<Response<T>, Status>;

pub async fn exec(d: &Arc<Daemon>, req: Request<cri::ExecRequest>) -> Reply<cri::ExecResponse> {
    let dl = deadline(&req);
    let r = req.into_inner();
    call(
        "Exec",
        r.container_id.clone(),
        dl,
        Verbosity::Normal,
        async {
            require_id("container_id", &r.container_id)?;
            if r.cmd.is_empty() {
                return Err(Error::InvalidArgument("cmd is required".into()));
            }
            if !(r.stdin || r.stdout || r.stderr) {
                return Err(Error::InvalidArgument(
                    "one of stdin, stdout or stderr must be set".into(),
                ));
            }
            if r.tty && r.stderr {
                return Err(Error::InvalidArgument(
                    "tty and stderr cannot both be true (a terminal merges stderr into stdout)"
                        .into(),
                ));
            }
            d.pods.exec_target(&r.container_id)?;
            let url = d.streaming.register_exec(ExecRequest {
                container_id: r.container_id.clone(),
                cmd: r.cmd.clone(),
                tty: r.tty,
                stdin: r.stdin,
                stdout: r.stdout,
                stderr: r.stderr,
            })?;
            Ok(cri::ExecResponse { url })
        },
    )
    .await
}

/// PortForward: the sandbox must exist (NOT_FOUND) and be ready (FAILED_PRECONDITION); the
/// ports, if any, must be 1 to 65535 (INVALID_ARGUMENT). The ports listed do not limit the
/// session: as with the kubelet and containerd, each forwarded connection names its port.
pub async fn port_forward(
    d: &Arc<Daemon>,
    req: Request<cri::PortForwardRequest>,
) -> Reply<cri::PortForwardResponse> {
    let dl = deadline(&req);
    let r = req.into_inner();
    call(
        "PortForward",
        r.pod_sandbox_id.clone(),
        dl,
        Verbosity::Normal,
        async {
            require_id("pod_sandbox_id", &r.pod_sandbox_id)?;
            if let Some(p) = r.port.iter().find(|p| !(1..=65535).contains(*p)) {
                return Err(Error::InvalidArgument(format!(
                    "port {p} is out of range: ports are 1 to 65535"
                )));
            }
            let id = &r.pod_sandbox_id;
            let sb = d
                .pods
                .store
                .sandbox(id)
                .ok_or_else(|| Error::NotFound(format!("pod sandbox {id} not found")))?;
            if sb.state != SandboxState::Ready {
                return Err(Error::FailedPrecondition(format!(
                    "pod sandbox {id} is not ready"
                )));
            }
            let host_network = crate::oci::namespaces::namespace_options(&sb.config())
                .is_some_and(|o| o.network == cri::NamespaceMode::Node as i32);
            // The pinned namespace; else the infra process's (host network: the host's).
            let netns = match (&sb.netns, host_network) {
                (Some(p), _) => Some(p.clone()),
                (None, true) => None,
                (None, false) if sb.infra_pid > 0 => {
                    Some(format!("/proc/{}/ns/net", sb.infra_pid).into())
                }
                (None, false) => {
                    return Err(Error::FailedPrecondition(format!(
                        "pod sandbox {id} has no network namespace"
                    )));
                }
            };
            let url = d.streaming.register_port_forward(PortForwardRequest {
                sandbox_id: id.clone(),
                netns,
            })?;
            Ok(cri::PortForwardResponse { url })
        },
    )
    .await
}

/// Attach: the container must exist (NOT_FOUND) and run (FAILED_PRECONDITION); one stream at
/// least, `tty` as the container was created, and `stdin` only for a container created with
/// `stdin` (INVALID_ARGUMENT). The session attaches to the container's shim when the client
/// connects ([`crate::stream::attach`]).
pub async fn attach(
    d: &Arc<Daemon>,
    req: Request<cri::AttachRequest>,
) -> Reply<cri::AttachResponse> {
    let dl = deadline(&req);
    let r = req.into_inner();
    call(
        "Attach",
        r.container_id.clone(),
        dl,
        Verbosity::Normal,
        async {
            require_id("container_id", &r.container_id)?;
            let id = &r.container_id;
            let config = d.pods.exec_target(id)?.config();
            if !(r.stdin || r.stdout || r.stderr) {
                return Err(Error::InvalidArgument(
                    "one of stdin, stdout or stderr must be set".into(),
                ));
            }
            if r.tty != config.tty {
                return Err(Error::InvalidArgument(format!(
                    "tty {} does not match container {id}, created with tty {}",
                    r.tty, config.tty
                )));
            }
            if r.stdin && !config.stdin {
                return Err(Error::InvalidArgument(format!(
                    "container {id} was created without stdin: cannot attach to its stdin"
                )));
            }
            let url = d.streaming.register_attach(AttachRequest {
                container_id: id.clone(),
                tty: r.tty,
                stdin: r.stdin,
                stdout: r.stdout,
                stderr: r.stderr,
            })?;
            Ok(cri::AttachResponse { url })
        },
    )
    .await
}

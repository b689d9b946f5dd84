//! Streaming (CRI RuntimeService): ExecSync runs a command to its end and answers with its
//! output; Exec, Attach and PortForward check the request and register a session with the
//! streaming server ([`crate::stream`]), answering with the URL the client connects to.

use minicri_proto::runtime::v1 as cri;
use tonic::Request;

use super::Reply;
use crate::daemon::Daemon;
use crate::error::Error;
use crate::rpc::{Verbosity, call_on};
use crate::stream::{AttachRequest, ExecRequest, PortForwardRequest};

pub(super) async fn exec_sync(
    daemon: &Daemon,
    req: Request<cri::ExecSyncRequest>,
) -> Reply<cri::ExecSyncResponse> {
    call_on(
        "ExecSync",
        Verbosity::Normal,
        req,
        ("container_id", |r| r.container_id.clone()),
        |r| async move {
            let pods = &daemon.pods;
            pods.exec_sync(&r.container_id, r.cmd, r.timeout).await
        },
    )
    .await
}

pub(super) async fn exec(
    daemon: &Daemon,
    req: Request<cri::ExecRequest>,
) -> Reply<cri::ExecResponse> {
    call_on(
        "Exec",
        Verbosity::Normal,
        req,
        ("container_id", |r| r.container_id.clone()),
        |r| async move {
            crate::pods::exec::check_cmd(&r.cmd)?;
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
            let target = daemon.pods.exec_target(&r.container_id)?;
            let url = daemon.streaming.register_exec(ExecRequest {
                container_id: r.container_id,
                sandbox_id: target.sandbox_id,
                cmd: r.cmd,
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

/// Attach: the container must exist (NOT_FOUND) and run (FAILED_PRECONDITION); one stream at
/// least, `tty` as the container was created, and `stdin` only for a container created with
/// `stdin` (INVALID_ARGUMENT). The session attaches to the container's shim when the client
/// connects ([`crate::stream::attach`]).
pub(super) async fn attach(
    daemon: &Daemon,
    req: Request<cri::AttachRequest>,
) -> Reply<cri::AttachResponse> {
    call_on(
        "Attach",
        Verbosity::Normal,
        req,
        ("container_id", |r| r.container_id.clone()),
        |r| async move {
            let id = r.container_id;
            let target = daemon.pods.exec_target(&id)?;
            let config = target.config();
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
            let url = daemon.streaming.register_attach(AttachRequest {
                container_id: id,
                sandbox_id: target.sandbox_id,
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

/// PortForward: the sandbox must exist (NOT_FOUND) and be ready (FAILED_PRECONDITION); the
/// ports, if any, must be 1 to 65535 (INVALID_ARGUMENT). The ports listed do not limit the
/// session: as with the kubelet and containerd, each forwarded connection names its port.
pub(super) async fn port_forward(
    daemon: &Daemon,
    req: Request<cri::PortForwardRequest>,
) -> Reply<cri::PortForwardResponse> {
    call_on(
        "PortForward",
        Verbosity::Normal,
        req,
        ("pod_sandbox_id", |r| r.pod_sandbox_id.clone()),
        |r| async move {
            if let Some(p) = r.port.iter().find(|p| !(1..=65535).contains(*p)) {
                return Err(Error::InvalidArgument(format!(
                    "port {p} is out of range: ports are 1 to 65535"
                )));
            }
            let netns = daemon.pods.port_forward_netns(&r.pod_sandbox_id)?;
            let url = daemon.streaming.register_port_forward(PortForwardRequest {
                sandbox_id: r.pod_sandbox_id,
                netns,
            })?;
            Ok(cri::PortForwardResponse { url })
        },
    )
    .await
}

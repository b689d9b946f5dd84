//! CRI RuntimeService: Exec, whose answer is a URL of the streaming server ([`crate::stream`]).
//! Attach and PortForward are not implemented and answer UNIMPLEMENTED (the generated stubs).
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
use crate::rpc::{Verbosity, call, deadline};
use crate::stream::ExecRequest;

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

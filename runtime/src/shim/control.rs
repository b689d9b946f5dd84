//! The shim's control socket (`<bundle>/shim.sock`, protocol in [`super`]): one short-lived
//! thread per connection answers state, wait, log reopen and attach requests.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Condvar, Mutex};

use super::attach::{Attachments, serve_session};
use super::output::{SharedLog, reopen};
use super::protocol::{ExitRecord, Request, Response};

/// What the main thread shares with the control connections.
pub(super) struct Shared {
    pub(super) shim_pid: i32,
    pub(super) init_pid: i32,
    pub(super) exited: Mutex<Option<ExitRecord>>,
    pub(super) cond: Condvar,
    pub(super) log: SharedLog,
    /// Connections waiting for the exit, answered before the shim leaves.
    pub(super) waiters: Mutex<usize>,
    pub(super) attach: Arc<Attachments>,
}

/// Accepts control connections until the listener fails.
pub(super) fn serve(listener: UnixListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let shared = shared.clone();
        std::thread::spawn(move || {
            if let Err(e) = handle(conn, &shared) {
                note!("minicri shim: control connection: {e}");
            }
        });
    }
}

fn handle(conn: UnixStream, shared: &Shared) -> std::io::Result<()> {
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let response = match serde_json::from_str::<Request>(&line) {
        Err(e) => Response::Error {
            message: format!("bad request: {e}"),
        },
        Ok(Request::State) => Response::State {
            shim_pid: shared.shim_pid,
            init_pid: shared.init_pid,
            exited: shared.exited.lock().unwrap().clone(),
        },
        Ok(Request::ReopenLog) => match reopen(&shared.log) {
            Ok(()) => Response::Ok,
            Err(message) => Response::Error { message },
        },
        Ok(Request::Attach {
            stdin,
            stdout,
            stderr,
        }) => return serve_session(conn, shared.attach.clone(), stdin, stdout, stderr),
        Ok(Request::Wait) => {
            *shared.waiters.lock().unwrap() += 1;
            let mut exited = shared.exited.lock().unwrap();
            while exited.is_none() {
                exited = shared.cond.wait(exited).unwrap();
            }
            let exit = exited.clone().expect("set");
            drop(exited);
            let r = Response::Exited { exit };
            let mut out = serde_json::to_vec(&r).map_err(std::io::Error::other)?;
            out.push(b'\n');
            let res = (&conn).write_all(&out);
            *shared.waiters.lock().unwrap() -= 1;
            return res;
        }
    };
    let mut out = serde_json::to_vec(&response).map_err(std::io::Error::other)?;
    out.push(b'\n');
    (&conn).write_all(&out)
}

//! Per-RPC instrumentation: every CRI call goes through [`call`], which applies the caller's gRPC
//! deadline, maps the outcome to a status, and logs one line (method, object, duration, code).
//!
//! Read-only calls the kubelet makes every second or so log at debug level; everything else, and
//! every failure, logs at info or above. A call whose client goes away before it finishes is logged
//! as cancelled when its future is dropped.

use std::future::Future;
use std::time::{Duration, Instant};

use tonic::{Code, Response, Status};

use crate::error::Error;

/// The deadline a client set with the `grpc-timeout` header (`<digits><unit>`, unit one of H M S m u n).
pub fn deadline<R>(req: &tonic::Request<R>) -> Option<Duration> {
    let v = req.metadata().get("grpc-timeout")?.to_str().ok()?;
    let (num, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: u64 = num.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// Most characters of a call's object (the id or reference it names) in its log line.
const MAX_LOGGED_OBJECT_CHARS: usize = 512;

/// How loudly a call is logged when it succeeds.
#[derive(Clone, Copy)]
pub enum Verbosity {
    /// Polled constantly by the kubelet: debug level.
    Poll,
    /// Changes something or is rare: info level.
    Normal,
}

struct CallLog {
    method: &'static str,
    object: String,
    start: Instant,
    deadline: Option<Instant>,
    done: bool,
}

impl Drop for CallLog {
    fn drop(&mut self) {
        if !self.done {
            let ms = format!("{:.1}", self.start.elapsed().as_secs_f64() * 1e3);
            // A client that gives up at its deadline may hang up just before our own timer fires.
            if self.deadline.is_some_and(|d| Instant::now() >= d) {
                tracing::warn!(method = self.method, object = %self.object, duration_ms = ms, code = "DeadlineExceeded", "rpc deadline passed");
            } else {
                tracing::info!(method = self.method, object = %self.object, duration_ms = ms, code = "Cancelled", "rpc abandoned by client");
            }
        }
    }
}

/// [`call`] for an RPC about one object, named by a required id field of its request: the
/// request's deadline, the id (what `id` reads) logged as the object, INVALID_ARGUMENT naming
/// `field` when it is empty, then `body` with the request's message.
pub async fn call_on<R, T, F>(
    method: &'static str,
    verbosity: Verbosity,
    req: tonic::Request<R>,
    (field, id): (&'static str, fn(&R) -> String),
    body: impl FnOnce(R) -> F,
) -> Result<Response<T>, Status>
where
    F: Future<Output = Result<T, Error>>,
{
    let dl = deadline(&req);
    let r = req.into_inner();
    let object = id(&r);
    let empty = object.is_empty();
    call(method, object, dl, verbosity, async move {
        if empty {
            return Err(Error::InvalidArgument(format!("{field} is required")));
        }
        body(r).await
    })
    .await
}

/// Runs one RPC's body under its deadline and logs it.
pub async fn call<T, F>(
    method: &'static str,
    object: impl Into<String>,
    deadline: Option<Duration>,
    verbosity: Verbosity,
    body: F,
) -> Result<Response<T>, Status>
where
    F: Future<Output = Result<T, Error>>,
{
    let start = Instant::now();
    let mut log = CallLog {
        method,
        // A client names the object (an image reference, an id): a long one is cut for the log.
        object: minicri_store::registry::bounded_to(object.into(), MAX_LOGGED_OBJECT_CHARS),
        start,
        // A client's deadline of centuries is none (`Instant` cannot hold it).
        deadline: deadline.and_then(|d| start.checked_add(d)),
        done: false,
    };
    let result = match deadline {
        Some(d) => match tokio::time::timeout(d, body).await {
            Ok(r) => r,
            Err(_) => Err(Error::DeadlineExceeded(format!(
                "{method} did not finish within the client's deadline of {d:?}"
            ))),
        },
        None => body.await,
    };
    log.done = true;
    let ms = format!("{:.1}", log.start.elapsed().as_secs_f64() * 1e3);
    let object = &log.object;
    match result {
        Ok(v) => {
            match verbosity {
                Verbosity::Poll => {
                    tracing::debug!(method, %object, duration_ms = ms, code = "OK", "rpc")
                }
                Verbosity::Normal => {
                    tracing::info!(method, %object, duration_ms = ms, code = "OK", "rpc")
                }
            }
            Ok(Response::new(v))
        }
        Err(e) => {
            let status: Status = e.into();
            let code = format!("{:?}", status.code());
            if matches!(status.code(), Code::Internal | Code::DataLoss) {
                tracing::error!(method, %object, duration_ms = ms, code, error = status.message(), "rpc");
            } else {
                tracing::warn!(method, %object, duration_ms = ms, code, error = status.message(), "rpc");
            }
            Err(status)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req_with(timeout: &str) -> tonic::Request<()> {
        let mut r = tonic::Request::new(());
        r.metadata_mut()
            .insert("grpc-timeout", timeout.parse().unwrap());
        r
    }

    #[test]
    fn parses_grpc_timeout() {
        assert_eq!(deadline(&req_with("1m")), Some(Duration::from_millis(1)));
        assert_eq!(deadline(&req_with("2S")), Some(Duration::from_secs(2)));
        assert_eq!(
            deadline(&req_with("3H")),
            Some(Duration::from_secs(3 * 3600))
        );
        assert_eq!(
            deadline(&req_with("500u")),
            Some(Duration::from_micros(500))
        );
        assert_eq!(deadline(&req_with("x")), None);
        assert_eq!(deadline(&tonic::Request::new(())), None);
    }

    #[tokio::test]
    async fn deadline_maps_to_deadline_exceeded() {
        let r: Result<Response<()>, Status> = call(
            "Slow",
            "x",
            Some(Duration::from_millis(1)),
            Verbosity::Normal,
            async {
                tokio::time::sleep(Duration::from_secs(5)).await;
                Ok(())
            },
        )
        .await;
        assert_eq!(r.unwrap_err().code(), Code::DeadlineExceeded);
    }

    /// A deadline too far to reckon (a non-conforming `grpc-timeout` of 10^16 hours) is no
    /// deadline, not a panic.
    #[tokio::test]
    async fn a_deadline_beyond_reckoning_is_none() {
        let d = deadline(&req_with("9999999999999999H")).unwrap();
        let r: Result<Response<u8>, Status> =
            call("Far", "x", Some(d), Verbosity::Normal, async { Ok(7) }).await;
        assert_eq!(r.unwrap().into_inner(), 7);
    }

    /// An empty id is refused by the field's name before the body runs; a present one reaches it.
    #[tokio::test]
    async fn call_on_requires_the_id() {
        let ran = std::sync::atomic::AtomicBool::new(false);
        let req = |id: &str| tonic::Request::new(id.to_string());
        let body = |r: String| {
            ran.store(true, std::sync::atomic::Ordering::SeqCst);
            async move { Ok(r.len()) }
        };
        let field = (
            "container_id",
            (|r: &String| r.clone()) as fn(&String) -> String,
        );
        let err = call_on("Op", Verbosity::Normal, req(""), field, body)
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert_eq!(err.message(), "container_id is required");
        assert!(!ran.load(std::sync::atomic::Ordering::SeqCst));
        let ok = call_on("Op", Verbosity::Normal, req("abc"), field, body).await;
        assert_eq!(ok.unwrap().into_inner(), 3);
        assert!(ran.load(std::sync::atomic::Ordering::SeqCst));
    }
}

//! Per-RPC instrumentation: every CRI call goes through [`call`], which applies the caller's gRPC
//! deadline, maps the outcome to a status, and logs one line (method, object, duration, code).
//!
//! Read-only calls the kubelet makes every second or so log at debug level; everything else, and
//! every failure, logs at info or above. A call whose client goes away before it finishes is logged
//! as cancelled when its future is dropped.
//!
//! The streamed lists (StreamPodSandboxes and the other `Stream*` RPCs) go through [`call`] too,
//! by [`call_batched`]: the list is made inside the call (under its deadline, logged as any call),
//! then sent as [`batches`] of at most [`MAX_BATCH_BYTES`] and [`MAX_BATCH_ITEMS`] each.

use std::future::Future;
use std::time::{Duration, Instant};

use futures::StreamExt;
use tonic::codegen::BoxStream;
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
        object: minicri_store::text::bounded_to(object.into(), MAX_LOGGED_OBJECT_CHARS),
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

/// Most encoded bytes of the items of one batch of a streamed list. A gRPC client's default
/// receive limit is 4 MiB (Go's and tonic's alike; the kubelet raises its own to 16 MiB): half of
/// it leaves room for any client. One item larger than this (none is: labels and annotations are
/// capped at 272 KiB each) is sent alone.
pub const MAX_BATCH_BYTES: usize = 2 << 20;

/// Most items of one batch of a streamed list: many small items make batches of bounded work
/// for the client to decode too.
pub const MAX_BATCH_ITEMS: usize = 1000;

/// `items` cut, in order, into batches whose encoded size (as entries of a repeated field) stays
/// within `max_bytes` and whose count within `max_items`; an item over `max_bytes` makes a batch
/// of its own. No batch is empty; no items, no batches.
pub fn batches<T: prost::Message>(
    items: Vec<T>,
    max_bytes: usize,
    max_items: usize,
) -> Vec<Vec<T>> {
    let mut out = Vec::new();
    let mut cur: Vec<T> = Vec::new();
    let mut bytes = 0;
    for item in items {
        let len = item.encoded_len();
        // The field's tag (one byte for the fields numbered below 16) and the length prefix.
        let entry = 1 + prost::length_delimiter_len(len) + len;
        if !cur.is_empty() && (bytes + entry > max_bytes || cur.len() >= max_items) {
            out.push(std::mem::take(&mut cur));
            bytes = 0;
        }
        bytes += entry;
        cur.push(item);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// [`call`] for a server-streamed list: `list` (the very function the list RPC answers with) runs
/// under the call's deadline and is logged as one call; its items are then sent in [`batches`],
/// each made into a response by `batch`.
pub async fn call_batched<T, R, F>(
    method: &'static str,
    deadline: Option<Duration>,
    verbosity: Verbosity,
    list: F,
    batch: fn(Vec<T>) -> R,
) -> Result<Response<BoxStream<R>>, Status>
where
    T: prost::Message + Send + 'static,
    R: Send + 'static,
    F: Future<Output = Result<Vec<T>, Error>>,
{
    call(method, "", deadline, verbosity, async move {
        let items = list.await?;
        let out = batches(items, MAX_BATCH_BYTES, MAX_BATCH_ITEMS);
        Ok(futures::stream::iter(out.into_iter().map(move |b| Ok(batch(b)))).boxed())
    })
    .await
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

    /// Batches keep every item in order, stay within both bounds, and an item over the byte
    /// bound travels alone.
    #[test]
    fn batches_are_bounded_by_bytes_and_count() {
        let items: Vec<String> = (0..1000).map(|i| format!("{i:04}")).collect();
        // Each entry: tag, one length byte, and the item (a `StringValue`: tag, length, four
        // bytes), eight bytes.
        let b = batches(items.clone(), 80, 1000);
        assert_eq!(b.len(), 100);
        assert!(b.iter().all(|x| x.len() == 10));
        assert_eq!(b.concat(), items);
        let b = batches(items.clone(), usize::MAX, 300);
        assert_eq!(
            b.iter().map(Vec::len).collect::<Vec<_>>(),
            vec![300, 300, 300, 100]
        );
        assert_eq!(b.concat(), items);
        let mixed = vec!["a".to_string(), "x".repeat(100), "b".to_string()];
        let b = batches(mixed.clone(), 50, 10);
        assert_eq!(b.len(), 3, "{b:?}");
        assert_eq!(b.concat(), mixed);
        assert!(batches(Vec::<String>::new(), 50, 10).is_empty());
    }

    /// A streamed list answers every item of its list, in batches, through [`call`]'s mapping
    /// of errors.
    #[tokio::test]
    async fn call_batched_streams_the_list_or_its_error() {
        let items: Vec<String> = (0..2500).map(|i| i.to_string()).collect();
        let want = items.clone();
        let r = call_batched(
            "List",
            None,
            Verbosity::Poll,
            async move { Ok(items) },
            |v| v,
        )
        .await
        .unwrap()
        .into_inner();
        let got: Vec<Vec<String>> = r.map(|b| b.unwrap()).collect().await;
        assert_eq!(got.len(), 3);
        assert_eq!(got.concat(), want);
        let err = call_batched(
            "List",
            None,
            Verbosity::Poll,
            async { Err::<Vec<String>, _>(Error::NotFound("gone".into())) },
            |v| v,
        )
        .await
        .err()
        .unwrap();
        assert_eq!(err.code(), Code::NotFound);
    }
}

//! Prometheus metrics of the pull machinery, the API-server watch and the port-forward sessions'
//! buffers, served over HTTP on a loopback address.
//!
//! Off by default; `--metrics-address 127.0.0.1:PORT` turns it on (the configuration refuses
//! other addresses: the numbers name images and nothing here authenticates the reader).
//! `GET /metrics` answers in the text exposition format (version 0.0.4); counters come from
//! [`PullCounters`], gauges from the running jobs at the moment of the scrape.

use std::convert::Infallible;
use std::fmt::Write;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use minicri_store::content::IngestUsage;
use minicri_store::{JobSnapshot, PullCounters};

use crate::daemon::Daemon;

/// What one scrape reports.
pub struct Sample<'a> {
    pub counters: &'a PullCounters,
    pub jobs: &'a [JobSnapshot],
    pub blob_transfers: usize,
    /// The transfer scheduler's lanes: name, slots, granted, waiting, revocations so far.
    pub lanes: Vec<Lane>,
    /// Partial downloads on disk (from memory: a scrape walks no directory).
    pub ingests: IngestUsage,
    /// Writes refused by the image filesystem's reserve.
    pub reserve_refusals: u64,
    pub kube_watch: KubeWatchSample,
    /// The port-forward sessions' buffered bytes (`stream.port_forward_buffer_bytes`).
    pub port_forward: minicri_codecs::budget::BudgetSample,
}

/// The API-server watch's state at the scrape.
#[derive(Debug, Default, Clone, Copy)]
pub struct KubeWatchSample {
    pub connected: bool,
    pub synced: bool,
    pub credential_reloads: u64,
    pub pods: usize,
    pub events_written: u64,
    pub events_failed: u64,
    pub events_deferred: u64,
}

/// One lane of the transfer scheduler, as scraped.
pub struct Lane {
    pub name: &'static str,
    pub snapshot: minicri_store::sched::SchedSnapshot,
    pub granted: u64,
    pub revoked: u64,
    pub struck: u64,
}

impl Lane {
    pub fn of(name: &'static str, s: &minicri_store::sched::Scheduler) -> Lane {
        Lane {
            name,
            snapshot: s.snapshot(),
            granted: s.counters().granted.load(Ordering::Relaxed),
            revoked: s.counters().revoked.load(Ordering::Relaxed),
            struck: s.counters().struck.load(Ordering::Relaxed),
        }
    }
}

fn metric(out: &mut String, name: &str, kind: &str, help: &str, lines: &[(String, u64)]) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
    for (labels, v) in lines {
        let _ = writeln!(out, "{name}{labels} {v}");
    }
}

/// The exposition text for `s`.
pub fn render(s: &Sample) -> String {
    let mut out = String::new();
    pulls(&mut out, s);
    kube_watch(&mut out, s);
    transfers(&mut out, s);
    disk(&mut out, s);
    port_forward(&mut out, s);
    out
}

/// The pull manager's counters and its running jobs.
fn pulls(out: &mut String, s: &Sample) {
    let c = s.counters;
    let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let one = |v: u64| vec![(String::new(), v)];
    metric(
        out,
        "minicri_pull_calls_total",
        "counter",
        "PullImage calls that took a reference on a pull job.",
        &one(get(&c.calls)),
    );
    metric(
        out,
        "minicri_pull_calls_joined_total",
        "counter",
        "PullImage calls that joined a pull job already running.",
        &one(get(&c.calls_joined)),
    );
    metric(
        out,
        "minicri_pull_jobs_started_total",
        "counter",
        "Pull jobs started.",
        &one(get(&c.jobs_started)),
    );
    metric(
        out,
        "minicri_pull_jobs_finished_total",
        "counter",
        "Pull jobs finished, by outcome: done (image stored), stopped (no requester left), failed.",
        &[
            ("{outcome=\"done\"}".into(), get(&c.jobs_done)),
            ("{outcome=\"stopped\"}".into(), get(&c.jobs_stopped)),
            ("{outcome=\"failed\"}".into(), get(&c.jobs_failed)),
        ],
    );
    metric(
        out,
        "minicri_pull_downloaded_bytes_total",
        "counter",
        "Bytes downloaded by finished pull jobs.",
        &one(get(&c.bytes_downloaded)),
    );
    metric(
        out,
        "minicri_pull_resumed_bytes_total",
        "counter",
        "Bytes finished pull jobs found on disk from earlier attempts and did not download again.",
        &one(get(&c.bytes_resumed)),
    );
    metric(
        out,
        "minicri_pull_refetched_bytes_total",
        "counter",
        "Bytes finished pull jobs downloaded again from byte 0 after resumed partial data failed the digest.",
        &one(get(&c.bytes_refetched)),
    );
    metric(
        out,
        "minicri_pull_references_aborted_total",
        "counter",
        "Pull references dropped by a stopped sandbox, a deleted pod, an operator or the progress watchdog.",
        &one(get(&c.references_aborted)),
    );
    metric(
        out,
        "minicri_pull_detached_total",
        "counter",
        "PullImage calls that returned after pull.detach_after while the download went on for their pod sandbox.",
        &one(get(&c.detached)),
    );
    metric(
        out,
        "minicri_pull_holds_restored_total",
        "counter",
        "Background downloads held by pod sandboxes resumed after a daemon restart.",
        &one(get(&c.holds_restored)),
    );
    metric(
        out,
        "minicri_pull_pods_deleted_total",
        "counter",
        "Pods seen deleted by the API-server watch whose pull references were dropped.",
        &one(get(&c.pods_deleted)),
    );
    metric(
        out,
        "minicri_pull_refused_total",
        "counter",
        "PullImage calls refused because their pod sandbox was stopped or their pod deleted.",
        &one(get(&c.refused)),
    );
    metric(
        out,
        "minicri_pull_jobs_active",
        "gauge",
        "Pull jobs running now.",
        &one(s.jobs.len() as u64),
    );
    metric(
        out,
        "minicri_pull_requesters_active",
        "gauge",
        "Requesters (pod sandboxes or calls) holding a reference on a running pull job.",
        &one(s.jobs.iter().map(|j| j.requesters.len() as u64).sum()),
    );
    metric(
        out,
        "minicri_pull_holds_active",
        "gauge",
        "Pod sandboxes holding a running pull job themselves (after a detached call).",
        &one(s
            .jobs
            .iter()
            .flat_map(|j| &j.requesters)
            .filter(|r| r.held_since.is_some())
            .count() as u64),
    );
    metric(
        out,
        "minicri_pull_active_done_bytes",
        "gauge",
        "Bytes on disk of the running pull jobs' blobs.",
        &one(s.jobs.iter().map(|j| j.bytes_done).sum()),
    );
    metric(
        out,
        "minicri_pull_active_total_bytes",
        "gauge",
        "Total size of the running pull jobs' blobs.",
        &one(s.jobs.iter().map(|j| j.bytes_total).sum()),
    );
}

/// The API-server watch and the pull progress events it writes.
fn kube_watch(out: &mut String, s: &Sample) {
    let one = |v: u64| vec![(String::new(), v)];
    let k = &s.kube_watch;
    metric(
        out,
        "minicri_kube_watch_connected",
        "gauge",
        "1 while the API-server watch's last request was answered, else 0.",
        &one(k.connected as u64),
    );
    metric(
        out,
        "minicri_kube_watch_synced",
        "gauge",
        "1 while the API-server watch is connected and knows every pod of the node, else 0.",
        &one(k.synced as u64),
    );
    metric(
        out,
        "minicri_kube_watch_pods",
        "gauge",
        "Pods of the node the API-server watch knows.",
        &one(k.pods as u64),
    );
    metric(
        out,
        "minicri_kube_watch_credential_reloads_total",
        "counter",
        "Times the watch reloaded its credentials after the kubeconfig or a file it names changed.",
        &one(k.credential_reloads),
    );
    metric(
        out,
        "minicri_kube_events_written_total",
        "counter",
        "Pull progress events created or updated in the API server.",
        &one(k.events_written),
    );
    metric(
        out,
        "minicri_kube_events_failed_total",
        "counter",
        "Pull progress event writes refused, failed or timed out.",
        &one(k.events_failed),
    );
    metric(
        out,
        "minicri_kube_events_deferred_total",
        "counter",
        "Pull progress event writes put off by the node-wide limit (5 per second).",
        &one(k.events_deferred),
    );
}

/// Blob downloads and the fair scheduler's lanes.
fn transfers(out: &mut String, s: &Sample) {
    let one = |v: u64| vec![(String::new(), v)];
    metric(
        out,
        "minicri_blob_transfers_active",
        "gauge",
        "Blob downloads in progress on the node (shared between jobs).",
        &one(s.blob_transfers as u64),
    );
    let per_lane = |f: &dyn Fn(&Lane) -> u64| -> Vec<(String, u64)> {
        s.lanes
            .iter()
            .map(|l| (format!("{{lane=\"{}\"}}", l.name), f(l)))
            .collect()
    };
    metric(
        out,
        "minicri_transfer_slots",
        "gauge",
        "Transfer slots of each lane of the fair scheduler (pull.max_concurrent_transfers).",
        &per_lane(&|l| l.snapshot.capacity as u64),
    );
    metric(
        out,
        "minicri_transfer_slots_in_use",
        "gauge",
        "Transfer slots held by a connection now.",
        &per_lane(&|l| l.snapshot.granted as u64),
    );
    metric(
        out,
        "minicri_transfer_waiting",
        "gauge",
        "Connections waiting for a transfer slot now.",
        &per_lane(&|l| l.snapshot.waiting as u64),
    );
    metric(
        out,
        "minicri_transfer_grants_total",
        "counter",
        "Transfer slots granted to a connection.",
        &per_lane(&|l| l.granted),
    );
    metric(
        out,
        "minicri_transfer_revocations_total",
        "counter",
        "Connections whose transfer slot was taken back for a fairer share (they resume later).",
        &per_lane(&|l| l.revoked),
    );
    metric(
        out,
        "minicri_transfer_unresumable_revocations_total",
        "counter",
        "Of those, connections that could not resume (their registry ignores Range): their bytes are fetched again from byte 0 in a free slot.",
        &per_lane(&|l| l.struck),
    );
}

/// Partial downloads on disk and the image filesystem's reserve.
fn disk(out: &mut String, s: &Sample) {
    let one = |v: u64| vec![(String::new(), v)];
    let by_state = |active: u64, idle: u64| {
        vec![
            ("{state=\"active\"}".to_string(), active),
            ("{state=\"idle\"}".to_string(), idle),
        ]
    };
    metric(
        out,
        "minicri_ingest_bytes",
        "gauge",
        "Bytes of partial downloads on disk: active (a download is writing them) or idle (kept for a resume).",
        &by_state(s.ingests.active_bytes, s.ingests.idle_bytes),
    );
    metric(
        out,
        "minicri_ingests",
        "gauge",
        "Partial downloads on disk: active (a download is writing them) or idle (kept for a resume).",
        &by_state(s.ingests.active, s.ingests.idle),
    );
    metric(
        out,
        "minicri_image_fs_reserve_refusals_total",
        "counter",
        "Downloads and unpacks stopped (or refused before their first byte) to keep the image \
         filesystem's reserve free (pull.image_fs_reserve).",
        &one(s.reserve_refusals),
    );
}

/// The port-forward sessions' shared buffer budget.
fn port_forward(out: &mut String, s: &Sample) {
    let one = |v: u64| vec![(String::new(), v)];
    let pf = &s.port_forward;
    metric(
        out,
        "minicri_port_forward_buffer_limit_bytes",
        "gauge",
        "Bytes all port-forward sessions may hold buffered together (stream.port_forward_buffer_bytes).",
        &one(pf.total as u64),
    );
    metric(
        out,
        "minicri_port_forward_buffered_bytes",
        "gauge",
        "Bytes the port-forward sessions hold buffered now, both ways.",
        &one(pf.in_use as u64),
    );
    metric(
        out,
        "minicri_port_forward_buffered_bytes_peak",
        "gauge",
        "The most bytes the port-forward sessions held buffered at once since the daemon started.",
        &one(pf.peak as u64),
    );
    metric(
        out,
        "minicri_port_forward_buffer_waiting",
        "gauge",
        "Port-forward reads waiting for room in the total now (their clients or pods are held back).",
        &one(pf.waiting as u64),
    );
}

fn respond(daemon: &Daemon, req: &Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    if req.uri().path() != "/metrics" {
        return Response::builder()
            .status(StatusCode::NOT_FOUND)
            .body(Full::new(Bytes::from_static(
                b"only /metrics is served here\n",
            )))
            .expect("static response");
    }
    let pulls = &daemon.pulls;
    let jobs = pulls.list();
    let kube = &daemon.kube;
    let text = render(&Sample {
        counters: pulls.counters(),
        jobs: &jobs,
        blob_transfers: pulls.blobs().active().len(),
        lanes: {
            let (large, small) = pulls.blobs().schedulers();
            vec![Lane::of("large", large), Lane::of("small", small)]
        },
        ingests: daemon.content.ingest_usage(),
        reserve_refusals: daemon.space.iter().map(|b| b.refusals()).sum(),
        kube_watch: KubeWatchSample {
            connected: kube.status.connected(),
            synced: kube.status.synced(),
            credential_reloads: kube.status.credential_reloads.load(Ordering::Relaxed),
            pods: kube.pods.len(),
            events_written: kube.events.written.load(Ordering::Relaxed),
            events_failed: kube.events.failed.load(Ordering::Relaxed),
            events_deferred: kube.events.deferred.load(Ordering::Relaxed),
        },
        port_forward: daemon.streaming.port_forward_budget().sample(),
    });
    Response::builder()
        .header("content-type", "text/plain; version=0.0.4; charset=utf-8")
        .body(Full::new(Bytes::from(text)))
        .expect("valid response")
}

/// Binds `addr` and serves `/metrics` until the returned task is aborted.
pub async fn spawn(
    addr: SocketAddr,
    daemon: Arc<Daemon>,
    shutdown: tokio_util::sync::CancellationToken,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("binding the metrics address {addr}: {e}"))?;
    tracing::info!(address = %listener.local_addr()?, "serving Prometheus metrics on /metrics");
    Ok(crate::httpserve::serve(
        listener,
        "metrics",
        crate::httpserve::Limits {
            max_connections: 16,
            ..crate::httpserve::DEFAULT_LIMITS
        },
        shutdown,
        move |req| {
            let resp = respond(&daemon, &req);
            async move { Ok::<_, Infallible>(resp) }
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_gauges() {
        let c = PullCounters::default();
        c.calls.store(10, Ordering::Relaxed);
        c.calls_joined.store(9, Ordering::Relaxed);
        c.jobs_done.store(1, Ordering::Relaxed);
        c.bytes_downloaded.store(1234, Ordering::Relaxed);
        let text = render(&Sample {
            counters: &c,
            jobs: &[],
            blob_transfers: 2,
            lanes: vec![],
            ingests: IngestUsage {
                active: 1,
                active_bytes: 300,
                idle: 2,
                idle_bytes: 40,
            },
            reserve_refusals: 3,
            kube_watch: KubeWatchSample {
                connected: true,
                synced: false,
                credential_reloads: 3,
                pods: 7,
                ..Default::default()
            },
            port_forward: minicri_codecs::budget::BudgetSample {
                total: 64 << 20,
                in_use: 4096,
                peak: 8192,
                waiting: 2,
            },
        });
        assert!(text.contains("\nminicri_pull_calls_total 10\n"), "{text}");
        assert!(text.contains("\nminicri_port_forward_buffer_limit_bytes 67108864\n"));
        assert!(text.contains("\nminicri_port_forward_buffered_bytes 4096\n"));
        assert!(text.contains("\nminicri_port_forward_buffered_bytes_peak 8192\n"));
        assert!(text.contains("\nminicri_port_forward_buffer_waiting 2\n"));
        assert!(text.contains("\nminicri_pull_calls_joined_total 9\n"));
        assert!(text.contains("minicri_pull_jobs_finished_total{outcome=\"done\"} 1\n"));
        assert!(text.contains("minicri_pull_jobs_finished_total{outcome=\"failed\"} 0\n"));
        assert!(text.contains("\nminicri_pull_downloaded_bytes_total 1234\n"));
        assert!(text.contains("\nminicri_blob_transfers_active 2\n"));
        assert!(text.contains("# TYPE minicri_pull_jobs_active gauge\n"));
        assert!(text.contains("\nminicri_ingest_bytes{state=\"active\"} 300\n"));
        assert!(text.contains("\nminicri_ingest_bytes{state=\"idle\"} 40\n"));
        assert!(text.contains("\nminicri_ingests{state=\"idle\"} 2\n"));
        assert!(text.contains("\nminicri_image_fs_reserve_refusals_total 3\n"));
        assert!(text.contains("\nminicri_kube_watch_connected 1\n"));
        assert!(text.contains("\nminicri_kube_watch_synced 0\n"));
        assert!(text.contains("\nminicri_kube_watch_pods 7\n"));
        assert!(text.contains("\nminicri_kube_watch_credential_reloads_total 3\n"));
        assert!(text.contains("\nminicri_kube_events_written_total 0\n"));
        // Every sample line is `name[{labels}] value`.
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let (name, v) = l.rsplit_once(' ').unwrap();
            assert!(name.starts_with("minicri_"), "{l}");
            v.parse::<u64>().unwrap();
        }
    }
}

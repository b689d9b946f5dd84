//! Owns the pull progress a pod's owner sees: while a pod's image downloads, a Kubernetes Event
//! on the pod (core/v1, reason `Pulling`, type Normal, source component `minicri`) says how far
//! it is: `Downloading image "X": 45% (460.2 MiB of 1.0 GiB) at 38.1 MiB/s, about 15s left`.
//! `kubectl describe pod` shows it beside the kubelet's own `Pulling image "X"`.
//!
//! One event per pod and download, updated in place: created once the pod's download has run for
//! [`INTERVAL`], then patched (`count`, `lastTimestamp`, `message`) at most every [`INTERVAL`], so
//! a 10-minute download costs at most 60 API writes, and a short one none. Core/v1 rather than
//! events.k8s.io/v1: the latter's update validation makes `note` immutable, so its `series`
//! could count observations but not say how far the download is; the core/v1 `count` and
//! `lastTimestamp` are what the kubelet's own repeated events use, and `kubectl describe` shows
//! them as `(x3 over 30s)`.
//!
//! Bounded: at most one write in flight per pod, each with a [`WRITE_TIMEOUT`]; node-wide a token
//! bucket ([`NODE_WRITES_PER_SECOND`], burst [`NODE_WRITE_BURST`]) of which the pods waiting
//! longest are served first; a write that finds no token is not queued but tried at the next
//! tick. Nothing is written while the watch is disconnected, and only for pods the watch knows
//! (not being deleted): static pods, whose uid the API server does not know, get none. The
//! node's credentials allow exactly this (a node may create and patch events); nothing else is
//! written to the API server.
//!
//! Progress comes from the pull manager's job snapshots: each job lists its requesters; a pod
//! with several downloads at once (a parallel puller) is reported for its oldest.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, Patch, PatchParams, PostParams};
use minicri_store::{JobSnapshot, PullManager, progress_text};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::{PodCache, WatchState};

/// A pod's progress event is written at most this often (and first after its download has run
/// this long).
pub const INTERVAL: Duration = Duration::from_secs(10);
/// Event writes per second the node makes at most, on average.
pub const NODE_WRITES_PER_SECOND: f64 = 5.0;
/// Event writes the node may make at once after a quiet spell.
pub const NODE_WRITE_BURST: f64 = 10.0;
/// How long one write may take.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the downloads are looked at.
const TICK: Duration = Duration::from_secs(1);
/// `source.component` and `reportingComponent` of the events.
pub const COMPONENT: &str = "minicri";

/// Counts of the progress events, for the metrics endpoint.
#[derive(Debug, Default)]
pub struct EventCounters {
    /// Writes (creates and patches) the API server accepted.
    pub written: AtomicU64,
    /// Writes refused, failed or timed out.
    pub failed: AtomicU64,
    /// Writes due but put off for want of a node-wide token.
    pub deferred: AtomicU64,
}

/// One pod's download now.
#[derive(Debug, Clone, PartialEq)]
struct Progress {
    uid: String,
    namespace: String,
    name: String,
    image: String,
    job: u64,
    done: u64,
    total: u64,
    /// Bytes per second now.
    rate: f64,
    /// Transfer connections it holds now.
    connections: usize,
}

impl Progress {
    fn message(&self) -> String {
        format!(
            "Downloading image \"{}\": {}",
            self.image,
            progress_text(self.done, self.total, self.rate, self.connections)
        )
    }
}

/// The downloads of the pods the watch knows (and that are not being deleted), one per pod.
fn pulling(jobs: &[JobSnapshot], pods: &PodCache) -> Vec<Progress> {
    let mut by_pod: HashMap<String, Progress> = HashMap::new();
    for job in jobs.iter().filter(|j| j.state == "downloading") {
        let downloading = || job.parts.iter().filter(|p| p.state == "downloading");
        let rate = downloading().map(|p| p.bytes_per_second).sum();
        let connections = downloading().map(|p| p.connections).sum();
        for r in &job.requesters {
            let Some(pod) = &r.requester.pod else {
                continue;
            };
            let Some(info) = pods.get(&pod.uid).filter(|p| !p.deleting) else {
                continue;
            };
            let p = Progress {
                uid: pod.uid.clone(),
                namespace: info.namespace,
                name: info.name,
                image: job.image.clone(),
                job: job.id,
                done: job.bytes_done,
                total: job.bytes_total,
                rate,
                connections,
            };
            by_pod
                .entry(p.uid.clone())
                .and_modify(|q| {
                    if p.job < q.job {
                        *q = p.clone();
                    }
                })
                .or_insert(p);
        }
    }
    let mut out: Vec<Progress> = by_pod.into_values().collect();
    out.sort_by(|a, b| a.uid.cmp(&b.uid));
    out
}

/// A pod's progress event as far as the schedule knows.
#[derive(Debug)]
struct PodEvent {
    job: u64,
    /// The event once created.
    name: Option<String>,
    count: i32,
    first: chrono::DateTime<chrono::Utc>,
    /// When the pod's download was first seen.
    since: Instant,
    last_write: Option<Instant>,
    in_flight: bool,
}

/// What one write does.
#[derive(Debug, Clone, PartialEq)]
enum Action {
    Create { name: String },
    Patch { name: String, count: i32 },
}

/// A write planned for one pod.
#[derive(Debug, Clone)]
struct Write {
    progress: Progress,
    action: Action,
    first: chrono::DateTime<chrono::Utc>,
}

/// How a write ended.
#[derive(Debug, PartialEq)]
enum Outcome {
    Created {
        name: String,
    },
    Patched {
        count: i32,
    },
    /// The event is gone (expired): the next write creates a new one.
    Gone,
    Failed,
}

/// Which pods get a write when: the per-pod interval, one write in flight per pod and the
/// node-wide token bucket.
#[derive(Debug)]
struct Schedule {
    pods: HashMap<String, PodEvent>,
    tokens: f64,
    refilled: Instant,
}

impl Schedule {
    fn new(now: Instant) -> Schedule {
        Schedule {
            pods: HashMap::new(),
            tokens: NODE_WRITE_BURST,
            refilled: now,
        }
    }

    /// The writes to make now for `pulling`; the number of due writes put off.
    fn plan(&mut self, now: Instant, pulling: &[Progress]) -> (Vec<Write>, u64) {
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.tokens = (self.tokens + elapsed * NODE_WRITES_PER_SECOND).min(NODE_WRITE_BURST);
        self.refilled = now;
        self.pods
            .retain(|uid, e| e.in_flight || pulling.iter().any(|p| &p.uid == uid));
        let mut due: Vec<&Progress> = Vec::new();
        for p in pulling {
            let e = self.pods.entry(p.uid.clone()).or_insert_with(|| PodEvent {
                job: p.job,
                name: None,
                count: 0,
                first: chrono::Utc::now(),
                since: now,
                last_write: None,
                in_flight: false,
            });
            if e.job != p.job && !e.in_flight {
                // Another download of the pod: an event of its own.
                *e = PodEvent {
                    job: p.job,
                    name: None,
                    count: 0,
                    first: chrono::Utc::now(),
                    since: now,
                    last_write: e.last_write,
                    in_flight: false,
                };
            }
            let quiet = |t: Instant| now.saturating_duration_since(t) >= INTERVAL;
            if e.job == p.job && !e.in_flight && quiet(e.since) && e.last_write.is_none_or(quiet) {
                due.push(p);
            }
        }
        // The pods waiting longest first.
        due.sort_by_key(|p| self.pods[&p.uid].last_write);
        let mut writes = Vec::new();
        let mut deferred = 0;
        for p in due {
            if self.tokens < 1.0 {
                deferred += 1;
                continue;
            }
            self.tokens -= 1.0;
            let e = self.pods.get_mut(&p.uid).expect("entered above");
            e.in_flight = true;
            e.last_write = Some(now);
            let action = match &e.name {
                Some(name) => Action::Patch {
                    name: name.clone(),
                    count: e.count + 1,
                },
                None => Action::Create {
                    name: event_name(&p.name, chrono::Utc::now()),
                },
            };
            writes.push(Write {
                progress: p.clone(),
                action,
                first: e.first,
            });
        }
        (writes, deferred)
    }

    /// A write for `uid` ended.
    fn done(&mut self, uid: &str, outcome: Outcome) {
        let Some(e) = self.pods.get_mut(uid) else {
            return;
        };
        e.in_flight = false;
        match outcome {
            Outcome::Created { name } => {
                e.name = Some(name);
                e.count = 1;
            }
            Outcome::Patched { count } => e.count = count,
            Outcome::Gone => {
                e.name = None;
                e.count = 0;
            }
            Outcome::Failed => {}
        }
    }
}

/// `<pod>.<nanoseconds in hex>`, as the kubelet names its events, within the 253 characters of
/// a name.
fn event_name(pod: &str, now: chrono::DateTime<chrono::Utc>) -> String {
    let suffix = format!(
        ".{:x}",
        now.timestamp_nanos_opt().unwrap_or_default().max(0)
    );
    let mut base = &pod[..pod.len().min(253 - suffix.len())];
    while !base.is_char_boundary(base.len()) {
        base = &base[..base.len() - 1];
    }
    format!("{}{suffix}", base.trim_end_matches(['-', '.']))
}

/// The event as first written.
fn new_event(w: &Write, name: &str, node: &str) -> Event {
    use k8s_openapi::api::core::v1::{EventSource, ObjectReference};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    let p = &w.progress;
    Event {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(p.namespace.clone()),
            ..Default::default()
        },
        involved_object: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            namespace: Some(p.namespace.clone()),
            name: Some(p.name.clone()),
            uid: Some(p.uid.clone()),
            ..Default::default()
        },
        reason: Some("Pulling".into()),
        message: Some(p.message()),
        type_: Some("Normal".into()),
        source: Some(EventSource {
            component: Some(COMPONENT.into()),
            host: Some(node.to_string()),
        }),
        reporting_component: Some(COMPONENT.into()),
        reporting_instance: Some(node.to_string()),
        first_timestamp: Some(time(w.first)),
        last_timestamp: Some(time(chrono::Utc::now())),
        count: Some(1),
        ..Default::default()
    }
}

/// A Kubernetes `Time` (whole seconds, as the API keeps them).
fn time(t: chrono::DateTime<chrono::Utc>) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Time {
    let ts = k8s_openapi::jiff::Timestamp::from_second(t.timestamp())
        .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
    k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(ts)
}

/// Makes one write.
async fn write(client: kube::Client, node: String, w: Write) -> Outcome {
    let api: Api<Event> = Api::namespaced(client, &w.progress.namespace);
    let attempt = async {
        match &w.action {
            Action::Create { name } => api
                .create(&PostParams::default(), &new_event(&w, name, &node))
                .await
                .map(|_| Outcome::Created { name: name.clone() }),
            Action::Patch { name, count } => {
                let patch = serde_json::json!({
                    "count": count,
                    "lastTimestamp": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                    "message": w.progress.message(),
                });
                match api
                    .patch(name, &PatchParams::default(), &Patch::Merge(patch))
                    .await
                {
                    Err(kube::Error::Api(s)) if s.code == 404 => Ok(Outcome::Gone),
                    r => r.map(|_| Outcome::Patched { count: *count }),
                }
            }
        }
    };
    match tokio::time::timeout(WRITE_TIMEOUT, attempt).await {
        Ok(Ok(outcome)) => outcome,
        Ok(Err(e)) => {
            warn!(pod = %format!("{}/{}", w.progress.namespace, w.progress.name), error = %e, "cannot write the pod's pull progress event");
            Outcome::Failed
        }
        Err(_) => {
            warn!(pod = %format!("{}/{}", w.progress.namespace, w.progress.name), "writing the pod's pull progress event timed out");
            Outcome::Failed
        }
    }
}

/// Writes the progress events of the pods the watch knows until `shutdown` (see the module
/// docs).
pub async fn run(pulls: Arc<PullManager>, state: Arc<WatchState>, shutdown: CancellationToken) {
    let schedule = Arc::new(Mutex::new(Schedule::new(Instant::now())));
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        if !state.status.connected() {
            continue;
        }
        let Some((client, node)) = state.connection() else {
            continue;
        };
        let now = pulling(&pulls.list(), &state.pods);
        let (writes, deferred) = schedule.lock().unwrap().plan(Instant::now(), &now);
        if deferred > 0 {
            debug!(
                deferred,
                "pull progress events put off by the node-wide write limit"
            );
            state.events.deferred.fetch_add(deferred, Ordering::Relaxed);
        }
        for w in writes {
            let (client, node, schedule, state) = (
                client.clone(),
                node.clone(),
                schedule.clone(),
                state.clone(),
            );
            tokio::spawn(async move {
                let uid = w.progress.uid.clone();
                let outcome = write(client, node, w).await;
                let counter = match outcome {
                    Outcome::Failed | Outcome::Gone => &state.events.failed,
                    _ => &state.events.written,
                };
                counter.fetch_add(1, Ordering::Relaxed);
                schedule.lock().unwrap().done(&uid, outcome);
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn progress(uid: &str, job: u64) -> Progress {
        Progress {
            uid: uid.into(),
            namespace: "ns".into(),
            name: format!("pod-{uid}"),
            image: "registry.test/big:1".into(),
            job,
            done: 460 << 20,
            total: 1 << 30,
            rate: 38.0 * 1048576.0,
            connections: 4,
        }
    }

    #[test]
    fn one_pod_gets_a_create_then_a_patch_every_interval() {
        let t0 = Instant::now();
        let mut s = Schedule::new(t0);
        let p = [progress("a", 1)];
        let mut writes: Vec<(Duration, Action)> = Vec::new();
        // A 10-minute download, looked at every second, each write answered at once.
        for sec in 0..600 {
            let now = t0 + Duration::from_secs(sec);
            let (ws, deferred) = s.plan(now, &p);
            assert_eq!(deferred, 0);
            for w in ws {
                let outcome = match &w.action {
                    Action::Create { name } => Outcome::Created { name: name.clone() },
                    Action::Patch { count, .. } => Outcome::Patched { count: *count },
                };
                writes.push((now - t0, w.action));
                s.done("a", outcome);
            }
        }
        assert_eq!(writes.len(), 59, "first at 10 s, then every 10 s");
        assert_eq!(writes[0].0, INTERVAL);
        assert!(matches!(&writes[0].1, Action::Create { name } if name.starts_with("pod-a.")));
        for (i, pair) in writes.windows(2).enumerate() {
            assert!(pair[1].0 - pair[0].0 >= INTERVAL);
            assert!(
                matches!(&pair[1].1, Action::Patch { count, .. } if *count == i as i32 + 2),
                "{pair:?}"
            );
        }
        // A download shorter than the interval costs nothing.
        let mut s = Schedule::new(t0);
        for sec in 0..9 {
            assert!(
                s.plan(t0 + Duration::from_secs(sec), &[progress("b", 2)])
                    .0
                    .is_empty()
            );
        }
    }

    #[test]
    fn one_write_in_flight_per_pod_and_a_gone_event_is_created_again() {
        let t0 = Instant::now();
        let mut s = Schedule::new(t0);
        let p = [progress("a", 1)];
        let at = |sec| t0 + Duration::from_secs(sec);
        assert!(s.plan(at(0), &p).0.is_empty(), "first seen");
        assert_eq!(s.plan(at(10), &p).0.len(), 1);
        // Unanswered: nothing more for the pod, however long.
        for sec in 11..60 {
            assert!(s.plan(at(sec), &p).0.is_empty());
        }
        s.done("a", Outcome::Created { name: "e1".into() });
        let (w, _) = s.plan(at(60), &p);
        assert_eq!(
            w[0].action,
            Action::Patch {
                name: "e1".into(),
                count: 2
            }
        );
        s.done("a", Outcome::Gone);
        let (w, _) = s.plan(at(70), &p);
        assert!(matches!(w[0].action, Action::Create { .. }), "{w:?}");
        s.done("a", Outcome::Failed);
        // Another download of the pod: a new event, after its own interval.
        let (w, _) = s.plan(at(80), &[progress("a", 2)]);
        assert!(w.is_empty());
        let (w, _) = s.plan(at(90), &[progress("a", 2)]);
        assert!(matches!(w[0].action, Action::Create { .. }), "{w:?}");
        // The pod's download ended: forgotten once its write is answered.
        s.done("a", Outcome::Failed);
        s.plan(at(91), &[]);
        assert!(s.pods.is_empty());
    }

    #[test]
    fn many_pods_share_the_node_wide_limit_fairly() {
        let t0 = Instant::now();
        let mut s = Schedule::new(t0);
        let pods: Vec<Progress> = (0..200).map(|i| progress(&format!("p{i:03}"), i)).collect();
        let mut per_second = Vec::new();
        let mut last: HashMap<String, Instant> = HashMap::new();
        for sec in 0..300 {
            let now = t0 + Duration::from_secs(sec);
            let (ws, _) = s.plan(now, &pods);
            per_second.push(ws.len());
            for w in ws {
                let uid = w.progress.uid.clone();
                if let Some(prev) = last.insert(uid.clone(), now) {
                    assert!(now - prev >= INTERVAL);
                }
                s.done(&uid, Outcome::Created { name: uid.clone() });
            }
        }
        // The burst, then at most the rate.
        assert!(per_second.iter().all(|n| *n as f64 <= NODE_WRITE_BURST));
        let total: usize = per_second.iter().sum();
        assert!(total as f64 <= NODE_WRITE_BURST + 300.0 * NODE_WRITES_PER_SECOND);
        assert!(per_second[20..].iter().all(|n| *n <= 5), "{per_second:?}");
        // Every pod got its turn.
        assert_eq!(last.len(), 200);
    }

    #[test]
    fn event_names_are_valid_names_of_at_most_253_characters() {
        let now = chrono::DateTime::from_timestamp(1_700_000_000, 5).unwrap();
        assert_eq!(event_name("web-0", now), "web-0.17979cfe362a0005");
        let long = format!("{}-x", "a".repeat(300));
        let n = event_name(&long, now);
        assert_eq!(n.len(), 253);
        let cut = format!("{}-{}", "a".repeat(235), "b".repeat(20));
        assert!(!event_name(&cut, now).contains("-."));
    }

    #[test]
    fn the_message_says_how_far_the_download_is() {
        assert_eq!(
            progress("a", 1).message(),
            "Downloading image \"registry.test/big:1\": 45% (460.0 MiB of 1.0 GiB) at 38.0 MiB/s, about 15s left"
        );
    }
}

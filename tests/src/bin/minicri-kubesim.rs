//! Owns the `minicri-kubesim` command: the tests' API server (tests/src/apiserver) and kubelet
//! simulator (tests/src/kubelet_sim.rs) as a program, for hack/demo-pull-release.sh.
//!
//! `demo` starts the API server, writes a kubeconfig for it, waits for a minicri serving on
//! `--socket` to watch it, then runs a pod whose image downloads, deletes it mid-pull
//! (`kubectl delete pod`), and runs a second pod for the same image. It prints what a user would
//! see: each pod's events as `kubectl describe pod` lists them (the kubelet's, from the
//! simulator's record of what it did, and minicri's, from the API server), how long the deletion
//! took to be acted on, and the blob bytes the registry proxy served for each pod.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use minicri_tests::apiserver::ApiServer;
use minicri_tests::kubelet_sim::{
    EventKind, KubeletSim, PodSpec, Puller, SimApi, SimConfig, SimEvent,
};

#[derive(Parser)]
#[command(
    name = "minicri-kubesim",
    about = "The tests' API server and kubelet simulator, as a program"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// A pod deleted mid-pull, then a second pod for the same image (see the module docs).
    Demo {
        /// Where to write the API server's kubeconfig (for minicri's --kube-watch-kubeconfig).
        #[arg(long)]
        kubeconfig: PathBuf,
        /// minicri's CRI socket.
        #[arg(long)]
        socket: PathBuf,
        /// The image both pods run (a large one, through a rate-limited registry).
        #[arg(long)]
        image: String,
        /// The registry proxy's stats file (`minicri-testimg proxy --stats`).
        #[arg(long)]
        proxy_stats: PathBuf,
        /// The node the pods are bound to (minicri's --kube-watch-node-name).
        #[arg(long, default_value = "node-1")]
        node: String,
        /// Seconds after the first pod's creation its deletion is asked for.
        #[arg(long, default_value_t = 15.0)]
        delete_after: f64,
    },
}

/// The blob bytes the proxy has served so far.
fn served(stats: &Path) -> Result<u64> {
    let text =
        std::fs::read_to_string(stats).with_context(|| format!("reading {}", stats.display()))?;
    text.trim()
        .strip_prefix("blob_bytes_served ")
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("{} says {text:?}", stats.display()))
}

/// `1.5 GiB`-style sizes, as minicri words them.
fn human(bytes: u64) -> String {
    minicri_store::text::human_bytes(bytes as f64)
}

/// One line of `kubectl describe pod`'s events.
struct Line {
    kind: &'static str,
    reason: String,
    from: &'static str,
    count: u64,
    first: f64,
    last: f64,
    message: String,
}

/// The pod's events: the kubelet's (what the simulator did, worded as the kubelet words it)
/// and minicri's (from the API server), in order. Times in seconds since `t0` / `wall0`.
fn describe(
    sim: &KubeletSim,
    api: &ApiServer,
    uid: &str,
    t0: Instant,
    wall0: chrono::DateTime<chrono::Utc>,
) -> Vec<Line> {
    let at = |e: &SimEvent| e.at.saturating_duration_since(t0).as_secs_f64();
    let mut lines = Vec::new();
    let mut push = |kind, reason: &str, from, t: f64, message: String| {
        lines.push(Line {
            kind,
            reason: reason.to_string(),
            from,
            count: 1,
            first: t,
            last: t,
            message,
        })
    };
    for e in sim.events(uid) {
        let t = at(&e);
        match e.kind {
            EventKind::PullQueued(image) => push(
                "Normal",
                "Pulling",
                "kubelet",
                t,
                format!("Pulling image \"{image}\""),
            ),
            EventKind::PullReturned {
                image,
                result: Ok(_),
                held,
            } => push(
                "Normal",
                "Pulled",
                "kubelet",
                t,
                format!(
                    "Successfully pulled image \"{image}\" in {:.1}s",
                    held.as_secs_f64()
                ),
            ),
            EventKind::ErrImagePull { image, message, .. } => {
                push(
                    "Warning",
                    "Failed",
                    "kubelet",
                    t,
                    format!("Failed to pull image \"{image}\": {message}"),
                );
                push(
                    "Warning",
                    "Failed",
                    "kubelet",
                    t,
                    "Error: ErrImagePull".into(),
                );
            }
            EventKind::BackOff(image) => push(
                "Normal",
                "BackOff",
                "kubelet",
                t,
                format!("Back-off pulling image \"{image}\""),
            ),
            EventKind::ContainerStarted { .. } => {
                push(
                    "Normal",
                    "Created",
                    "kubelet",
                    t,
                    "Created container c0".into(),
                );
                push(
                    "Normal",
                    "Started",
                    "kubelet",
                    t,
                    "Started container c0".into(),
                );
            }
            EventKind::DeletionNoticed => push(
                "Normal",
                "Killing",
                "kubelet",
                t,
                "Stopping the pod (its deletion)".into(),
            ),
            _ => {}
        }
    }
    let secs = |v: &serde_json::Value| {
        v.as_str()
            .and_then(|s| chrono::DateTime::parse_from_rfc3339(s).ok())
            .map(|d| (d.with_timezone(&chrono::Utc) - wall0).as_seconds_f64())
            // The API keeps whole seconds: a time in the pod's first second may read as before it.
            .map(|s| s.max(0.0))
            .unwrap_or(0.0)
    };
    for ev in api.events() {
        if ev["involvedObject"]["uid"] != uid {
            continue;
        }
        lines.push(Line {
            kind: if ev["type"] == "Warning" {
                "Warning"
            } else {
                "Normal"
            },
            reason: ev["reason"].as_str().unwrap_or("").to_string(),
            from: "minicri",
            count: ev["count"].as_u64().unwrap_or(1),
            first: secs(&ev["firstTimestamp"]),
            last: secs(&ev["lastTimestamp"]),
            message: ev["message"].as_str().unwrap_or("").to_string(),
        });
    }
    lines.sort_by(|a, b| a.first.total_cmp(&b.first));
    lines
}

fn print_events(title: &str, lines: &[Line]) {
    println!("  Events ({title}; minicri's times to the second, as the API keeps them):");
    println!(
        "    {:<8} {:<8} {:<8} {:>5} {:>8} {:>8}  Message",
        "Type", "Reason", "From", "Count", "First", "Last"
    );
    for l in lines {
        println!(
            "    {:<8} {:<8} {:<8} {:>5} {:>7.1}s {:>7.1}s  {}",
            l.kind, l.reason, l.from, l.count, l.first, l.last, l.message
        );
    }
}

/// When the first event `f` picks happened, in seconds since `t0`.
fn when(sim: &KubeletSim, uid: &str, t0: Instant, f: impl Fn(&EventKind) -> bool) -> Option<f64> {
    sim.events(uid)
        .iter()
        .find(|e| f(&e.kind))
        .map(|e| e.at.saturating_duration_since(t0).as_secs_f64())
}

async fn demo(
    kubeconfig: PathBuf,
    socket: PathBuf,
    image: String,
    stats: PathBuf,
    node: String,
    delete_after: f64,
) -> Result<()> {
    let api = Arc::new(ApiServer::start()?);
    api.write_kubeconfig_at(&kubeconfig, &minicri_tests::apiserver::KubeUser::Token)?;
    eprintln!(
        "kubesim: API server at {}, kubeconfig {}",
        api.url(),
        kubeconfig.display()
    );
    let start = Instant::now();
    while !socket.exists() || api.open_watches() == 0 {
        if start.elapsed() > Duration::from_secs(120) {
            bail!(
                "no minicri serving {} and watching {} after 120 s",
                socket.display(),
                api.url()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let channel = minicri_tests::daemon::channel_to(&socket).await?;
    // The kubelet's own settings: back-off 10 s doubling to 300 s, requeue after 10 s.
    let sim = KubeletSim::new(
        channel,
        SimConfig {
            puller: Puller::Serial,
            grace_period_secs: 0,
            api: Some(SimApi {
                server: api.clone(),
                node: node.clone(),
            }),
            ..SimConfig::default()
        },
    );
    let mut a = PodSpec::new("big-1", &[&image]);
    a.namespace = "demo".into();
    let (t0, wall0) = (Instant::now(), chrono::Utc::now());
    let before = served(&stats)?;
    sim.create_pod(a.clone());
    println!("pod demo/big-1: created, image {image}");
    tokio::time::sleep_until((t0 + Duration::from_secs_f64(delete_after)).into()).await;
    let deleted = Instant::now();
    sim.delete_pod(&a.uid);
    println!(
        "  kubectl delete pod demo/big-1 at +{:.1}s (its PullImage in flight: {})",
        deleted.duration_since(t0).as_secs_f64(),
        sim.events(&a.uid)
            .iter()
            .filter(|e| matches!(e.kind, EventKind::PullStarted(_)))
            .count()
            > sim
                .events(&a.uid)
                .iter()
                .filter(|e| matches!(e.kind, EventKind::PullReturned { .. }))
                .count()
    );
    sim.wait_gone(&a.uid, Duration::from_secs(600)).await?;
    let since = |f: &dyn Fn(&EventKind) -> bool| {
        when(&sim, &a.uid, deleted, f)
            .map(|s| format!("{s:.2}s"))
            .unwrap_or("-".into())
    };
    println!(
        "  deletion acted on: PullImage returned {} after the delete, the pod worker took it up {} \
         after, the pod was gone (sandbox stopped and removed) {} after",
        since(&|k| matches!(k, EventKind::PullReturned { .. })),
        since(&|k| *k == EventKind::DeletionNoticed),
        since(&|k| *k == EventKind::Gone),
    );
    // The proxy rewrites its stats every 200 ms, and a transfer stops within 100 ms of its last
    // reference: read them half a second after the pod was gone, then 2 s later.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let at_gone = served(&stats)?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let later = served(&stats)?;
    println!(
        "  bytes that crossed the network for it: {} (then {} in the next 2 s)",
        human(at_gone - before),
        human(later - at_gone),
    );
    print_events(
        "kubectl describe pod demo/big-1",
        &describe(&sim, &api, &a.uid, t0, wall0),
    );

    let mut b = PodSpec::new("big-2", &[&image]);
    b.namespace = "demo".into();
    let (t1, wall1) = (Instant::now(), chrono::Utc::now());
    let before = served(&stats)?;
    sim.create_pod(b.clone());
    println!();
    println!("pod demo/big-2: created, the same image");
    let running = sim.wait_running(&b.uid, Duration::from_secs(900)).await?;
    let pulls = sim
        .events(&b.uid)
        .iter()
        .filter(|e| matches!(e.kind, EventKind::PullStarted(_)))
        .count();
    println!(
        "  Running at +{:.1}s after {pulls} PullImage call(s); bytes that crossed the network \
         for it: {} (the rest was on disk from demo/big-1's download)",
        running.duration_since(t1).as_secs_f64(),
        human(served(&stats)? - before),
    );
    print_events(
        "kubectl describe pod demo/big-2",
        &describe(&sim, &api, &b.uid, t1, wall1),
    );
    let writes = api.event_writes();
    println!();
    println!(
        "API writes by minicri: {} event writes ({} refused)",
        writes.len(),
        writes.iter().filter(|w| w.status >= 300).count()
    );
    sim.shutdown().await;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Demo {
            kubeconfig,
            socket,
            image,
            proxy_stats,
            node,
            delete_after,
        } => demo(kubeconfig, socket, image, proxy_stats, node, delete_after).await,
    }
}

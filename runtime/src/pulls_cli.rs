//! `minicri pulls`: shows the daemon's pull jobs (once, or live with `--watch`) and aborts them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use minicri_proto::minicri::v1 as admin;
use minicri_proto::minicri::v1::pulls_client::PullsClient;
use minicri_store::text::human_bytes as human;
use tonic::transport::{Channel, Endpoint};

#[derive(Debug, Args)]
pub struct PullsArgs {
    /// The daemon's socket.
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/run/minicri/minicri.sock",
        global = true
    )]
    pub socket: PathBuf,

    /// Keep showing live progress bars until interrupted.
    #[arg(long)]
    pub watch: bool,

    #[command(subcommand)]
    pub command: Option<PullsCommand>,
}

#[derive(Debug, Subcommand)]
pub enum PullsCommand {
    /// Drop the references of a sandbox, a pod or an image; a download stops (keeping its
    /// partial data) when nobody else wants it.
    Abort(AbortArgs),
}

#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub struct AbortArgs {
    /// A pod sandbox id.
    #[arg(long, value_name = "ID")]
    pub sandbox: Option<String>,
    /// A pod, as NAMESPACE/NAME.
    #[arg(long, value_name = "NS/NAME")]
    pub pod: Option<String>,
    /// An image reference: every requester of its pull.
    #[arg(long, value_name = "REF")]
    pub image: Option<String>,
}

async fn connect(socket: &Path) -> anyhow::Result<PullsClient<Channel>> {
    let path = socket.to_path_buf();
    let ch = Endpoint::try_from("http://[::]:50051")?
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await
        .with_context(|| format!("connecting to minicri at {}", socket.display()))?;
    Ok(PullsClient::new(ch))
}

pub async fn run(args: PullsArgs) -> anyhow::Result<()> {
    let mut client = connect(&args.socket).await?;
    match args.command {
        Some(PullsCommand::Abort(a)) => {
            use admin::abort_pulls_request::Target;
            let target = match (a.sandbox, a.pod, a.image) {
                (Some(s), _, _) => Target::SandboxId(s),
                (_, Some(p), _) => Target::Pod(p),
                (_, _, Some(i)) => Target::Image(i),
                _ => unreachable!("clap requires one"),
            };
            let r = client
                .abort_pulls(admin::AbortPullsRequest {
                    target: Some(target),
                    reason: "aborted by operator (minicri pulls abort)".into(),
                })
                .await?
                .into_inner();
            println!("{} reference(s) dropped", r.references_dropped);
            Ok(())
        }
        None if args.watch => watch(&mut client).await,
        None => {
            let list = client
                .list_pulls(admin::ListPullsRequest {})
                .await?
                .into_inner();
            print!("{}", render(&list.jobs));
            print!("{}", render_lanes(&list.lanes));
            print!("{}", render_ingests(&list.ingests.unwrap_or_default()));
            Ok(())
        }
    }
}

fn requester(r: &admin::PullRequester) -> String {
    if r.pod_uid.is_empty() {
        return format!("call #{}", r.call_id);
    }
    let sandbox = if r.sandbox_id.is_empty() {
        String::new()
    } else {
        format!(" sandbox {}", &r.sandbox_id[..r.sandbox_id.len().min(13)])
    };
    // A sandbox holding a detached download has no call waiting: say which it is.
    let how = if r.held {
        let since = chrono::DateTime::from_timestamp_nanos(r.held_since);
        let secs = (chrono::Utc::now() - since).num_milliseconds().max(0) as f64 / 1e3;
        let calls = if r.calls > 0 {
            format!(", {} call(s) waiting", r.calls)
        } else {
            String::new()
        };
        format!(
            " [held by the sandbox for {}{calls}]",
            minicri_store::text::human_duration(secs)
        )
    } else {
        format!(" [{} call(s) waiting]", r.calls)
    };
    let priority = match r.weight.cmp(&minicri_store::sched::NORMAL_WEIGHT) {
        std::cmp::Ordering::Less if r.weight > 0 => " (pull priority low)",
        std::cmp::Ordering::Greater => " (pull priority high)",
        _ => "",
    };
    format!(
        "pod {}/{} (uid {}, attempt {}){priority}{sandbox}{how}",
        r.pod_namespace, r.pod_name, r.pod_uid, r.attempt
    )
}

/// The transfer slots of the node, one line per lane.
pub fn render_lanes(lanes: &[admin::TransferLane]) -> String {
    lanes
        .iter()
        .map(|l| {
            format!(
                "transfer slots ({}): {} of {} in use, {} connection(s) waiting\n",
                l.name, l.granted, l.slots, l.waiting
            )
        })
        .collect()
}

/// What a layer's download is doing, for people: its state, and while it downloads how many
/// connections it has (none: it waits for a transfer slot).
fn layer_state(l: &admin::LayerProgress) -> String {
    match (l.state.as_str(), l.connections) {
        ("downloading", 0) => "waiting for a transfer slot".into(),
        ("downloading", 1) => "downloading".into(),
        ("downloading", n) => format!("downloading over {n} connections"),
        (s, _) => s.into(),
    }
}

/// The plain listing of `minicri pulls`.
pub fn render(jobs: &[admin::PullJob]) -> String {
    if jobs.is_empty() {
        return "no pulls running\n".into();
    }
    let mut out = String::new();
    for j in jobs {
        let pct = if j.bytes_total > 0 {
            100.0 * j.bytes_done as f64 / j.bytes_total as f64
        } else {
            0.0
        };
        out.push_str(&format!(
            "#{} {} [{}] {} / {} ({pct:.1}%) at {}/s\n",
            j.id,
            j.image,
            j.state,
            human(j.bytes_done as f64),
            human(j.bytes_total as f64),
            human(j.bytes_per_second)
        ));
        for r in &j.requesters {
            out.push_str(&format!("    requester: {}\n", requester(r)));
        }
        for l in &j.layers {
            let resumed = if l.resumed_from > 0 {
                format!(", resumed at {}", human(l.resumed_from as f64))
            } else {
                String::new()
            };
            let from = if l.source.is_empty() {
                String::new()
            } else {
                format!(" from {}", l.source)
            };
            let again = if l.refetched > 0 {
                format!(
                    ", {} fetched again after resumed data failed the digest",
                    human(l.refetched as f64)
                )
            } else {
                String::new()
            };
            out.push_str(&format!(
                "    {} {:>11} {} / {}{resumed}{again}{from}\n",
                &l.digest[..l.digest.len().min(19)],
                layer_state(l),
                human(l.done as f64),
                human(l.size as f64)
            ));
        }
    }
    out
}

/// The line on partial downloads: what the content store's ingest area holds on disk.
pub fn render_ingests(i: &admin::IngestUsage) -> String {
    format!(
        "partial downloads on disk: {} downloading ({}), {} kept for a resume ({})\n",
        i.active,
        human(i.active_bytes as f64),
        i.idle,
        human(i.idle_bytes as f64)
    )
}

/// The message after a layer's bar: its state, the daemon's measured speed while it moves, and
/// where it resumed.
fn layer_message(l: &admin::LayerProgress) -> String {
    let mut m = layer_state(l);
    if l.state == "downloading" && l.connections > 0 && l.bytes_per_second > 0.0 {
        m.push_str(&format!(" {}/s", human(l.bytes_per_second)));
        if l.size > l.done {
            let eta = (l.size - l.done) as f64 / l.bytes_per_second;
            m.push_str(&format!(", {eta:.0}s left"));
        }
    }
    if l.resumed_from > 0 {
        m.push_str(&format!(" (resumed at {})", human(l.resumed_from as f64)));
    }
    if !l.source.is_empty() && l.state != "done" {
        m.push_str(&format!(" from {}", l.source));
    }
    m
}

fn job_header(j: &admin::PullJob) -> String {
    let who: Vec<String> = j.requesters.iter().map(requester).collect();
    format!(
        "#{} {} [{}] {} / {} at {}/s for {}",
        j.id,
        j.image,
        j.state,
        human(j.bytes_done as f64),
        human(j.bytes_total as f64),
        human(j.bytes_per_second),
        if who.is_empty() {
            "nobody (stopping)".to_string()
        } else {
            who.join(", ")
        }
    )
}

async fn watch(client: &mut PullsClient<Channel>) -> anyhow::Result<()> {
    let multi = MultiProgress::new();
    // Speeds and times come from the daemon's measurements, not from this poll loop.
    let style = ProgressStyle::with_template("{prefix:>24} [{bar:40}] {bytes}/{total_bytes} {msg}")
        .expect("valid template")
        .progress_chars("=> ");
    let mut bars: std::collections::HashMap<(u64, String), ProgressBar> = Default::default();
    let mut headers: std::collections::HashMap<u64, (ProgressBar, String)> = Default::default();
    let mut idle_said = false;
    loop {
        let jobs = tokio::select! {
            r = client.list_pulls(admin::ListPullsRequest {}) => r?.into_inner().jobs,
            _ = tokio::signal::ctrl_c() => return Ok(()),
        };
        let live: std::collections::HashSet<u64> = jobs.iter().map(|j| j.id).collect();
        headers.retain(|id, (b, image)| {
            let keep = live.contains(id);
            if !keep {
                b.finish_and_clear();
                multi
                    .println(format!("#{id} {image}: no longer running"))
                    .ok();
            }
            keep
        });
        bars.retain(|(id, _), b| {
            let keep = live.contains(id);
            if !keep {
                b.finish_and_clear();
            }
            keep
        });
        for j in &jobs {
            let (header, _) = headers.entry(j.id).or_insert_with(|| {
                let b = multi.add(ProgressBar::new_spinner());
                b.enable_steady_tick(Duration::from_millis(120));
                (b, j.image.clone())
            });
            header.set_message(job_header(j));
            for l in &j.layers {
                let bar = bars.entry((j.id, l.digest.clone())).or_insert_with(|| {
                    let b = multi.add(ProgressBar::new(l.size));
                    b.set_style(style.clone());
                    b.set_prefix(l.digest[..l.digest.len().min(19)].to_string());
                    b
                });
                bar.set_position(l.done);
                bar.set_message(layer_message(l));
            }
        }
        // Say so once per idle spell, not at every poll.
        if jobs.is_empty() && !idle_said {
            multi
                .println("no pulls running (waiting; Ctrl-C to stop)")
                .ok();
        }
        idle_said = jobs.is_empty();
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod_requester(name: &str, calls: u32, held: bool) -> admin::PullRequester {
        admin::PullRequester {
            sandbox_id: format!("{name}0123456789abcdef"),
            pod_namespace: "default".into(),
            pod_name: name.into(),
            pod_uid: format!("uid-{name}"),
            attempt: 0,
            call_id: 0,
            calls,
            held,
            held_since: if held {
                (chrono::Utc::now() - chrono::Duration::seconds(42))
                    .timestamp_nanos_opt()
                    .unwrap()
            } else {
                0
            },
            weight: minicri_store::sched::NORMAL_WEIGHT,
        }
    }

    #[test]
    fn the_listing_tells_waiting_calls_from_sandboxes_holding_a_download() {
        let job = admin::PullJob {
            id: 3,
            image: "registry.example/big:1".into(),
            key: "k".into(),
            state: "downloading".into(),
            requesters: vec![
                pod_requester("web-0", 0, true),
                pod_requester("web-1", 1, false),
                admin::PullRequester {
                    call_id: 9,
                    calls: 1,
                    ..Default::default()
                },
                admin::PullRequester {
                    weight: 2 * minicri_store::sched::NORMAL_WEIGHT,
                    ..pod_requester("db-0", 1, false)
                },
            ],
            layers: vec![
                admin::LayerProgress {
                    digest: format!("sha256:{}", "a".repeat(64)),
                    size: 100,
                    done: 10,
                    state: "downloading".into(),
                    connections: 0,
                    ..Default::default()
                },
                admin::LayerProgress {
                    digest: format!("sha256:{}", "b".repeat(64)),
                    size: 100,
                    done: 20,
                    state: "downloading".into(),
                    connections: 3,
                    refetched: 100,
                    ..Default::default()
                },
            ],
            bytes_done: 1,
            bytes_total: 2,
            bytes_per_second: 0.0,
            started_at: 0,
        };
        let out = render(&[job]);
        let ingests = render_ingests(&admin::IngestUsage {
            active: 1,
            active_bytes: 3 << 20,
            idle: 2,
            idle_bytes: 1536,
        });
        assert_eq!(
            ingests,
            "partial downloads on disk: 1 downloading (3.0 MiB), 2 kept for a resume (1.5 KiB)\n"
        );
        assert!(
            out.contains("pod default/web-0 (uid uid-web-0, attempt 0) sandbox web-001234567 [held by the sandbox for 42s]"),
            "{out}"
        );
        assert!(out.contains("pod default/web-1 (uid uid-web-1, attempt 0) sandbox web-101234567 [1 call(s) waiting]"), "{out}");
        assert!(out.contains("requester: call #9"), "{out}");
        assert!(
            out.contains("pod default/db-0 (uid uid-db-0, attempt 0) (pull priority high)"),
            "{out}"
        );
        assert!(
            out.contains("sha256:aaaaaaaaaaaa waiting for a transfer slot 10 B / 100 B"),
            "{out}"
        );
        assert!(
            out.contains("downloading over 3 connections 20 B / 100 B, 100 B fetched again after resumed data failed the digest"),
            "{out}"
        );
        let lanes = render_lanes(&[admin::TransferLane {
            name: "large blobs".into(),
            slots: 8,
            granted: 8,
            waiting: 3,
        }]);
        assert_eq!(
            lanes,
            "transfer slots (large blobs): 8 of 8 in use, 3 connection(s) waiting\n"
        );
    }
}

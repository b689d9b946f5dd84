//! Detaching PullImage calls from their downloads, so a kubelet is never held hostage.
//!
//! The kubelet calls PullImage with no deadline and never cancels it; a pod deleted meanwhile
//! stays Terminating until the call returns (kubernetes #125050). So a call made for a pod sandbox
//! minicri runs waits at most the **detach window** (`pull.detach_after`); then it fails with
//! [`StoreError::Detached`], whose message says how far the download is, and the sandbox takes
//! over the call's reference: a **hold**. The download goes on for the sandbox until the job ends
//! (the image is recorded under the names the detached calls asked for), the sandbox is stopped
//! or removed, the pod is deleted, an operator aborts it or the watchdog fires. The kubelet's next
//! PullImage for the sandbox (after its back-off) re-joins the job, and detaches again if the job
//! is still running then; at its next sync after completion, ImageStatus finds the image.
//!
//! **Per-sync budget.** One kubelet sync calls PullImage for each of the pod's images in turn
//! (and once per candidate credential), carrying on after failures, so k large images would hold
//! the pod worker k windows. The window is therefore a budget per sandbox and sync: every call of
//! the sandbox detaches at the latest `pull.detach_after` after the first call of the sync began,
//! though each call may take [`MIN_HOLD`] so that images already on disk still complete. Calls
//! of one sandbox that follow each other within [`SYNC_GAP`] (or half the window, if shorter)
//! belong to one sync; the kubelet's image back-off (10 s at least) separates its syncs' retries.
//!
//! **Holding past the window.** The runtime may install a [`DetachPolicy`]: when a call's window
//! has passed and the policy says the call may keep waiting (the runtime's API-server watch is
//! connected and follows the pod, so a deletion would release the call at once, and no other pod
//! of the node waits for an image), the call is not detached but asked about again every
//! [`HOLD_RECHECK`], and detaches at the first no. The kubelet then sees one pull that ends when
//! the image is there, instead of errors and back-offs.
//!
//! **Restarts.** A hold is written to `<holds_dir>/<hash>.json` (mode 0600: it keeps the call's
//! registry credentials, so that the download can resume without a new PullImage) and removed
//! when the hold ends. At start the daemon resumes the downloads of holds whose sandbox is still
//! ready and removes the others' files. File work runs on one writer thread, in order.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use sha2::{Digest as _, Sha256};

use crate::digest::Digest;
use crate::error::StoreError;
use crate::reference::Reference;
use crate::registry::Credentials;
use crate::text::{human_bytes, human_duration};

use super::{Job, JobRef, Joining, PodRef, PullManager, Requester};

/// Calls of one sandbox this close together belong to one kubelet sync.
pub const SYNC_GAP: Duration = Duration::from_secs(5);

/// Each call may wait this long (at most the window) even when its sync's budget is spent, so
/// that an image already on disk or a tiny one completes in the same sync.
pub const MIN_HOLD: Duration = Duration::from_secs(1);

/// How often a call held past its window asks the [`DetachPolicy`] again.
pub const HOLD_RECHECK: Duration = Duration::from_secs(1);

/// Decides whether a call whose detach window has passed may keep waiting instead of
/// detaching. The store knows nothing of the pods behind the requesters; the runtime does.
pub trait DetachPolicy: Send + Sync {
    /// Whether `requester`'s call for `reference`, past its window, may wait
    /// [`HOLD_RECHECK`] longer.
    fn may_hold_past_window(&self, requester: &Requester, reference: &Reference) -> bool;
}

/// A sandbox's hold on a job, taken over from a detached call.
pub(crate) struct Hold {
    pub(crate) since: chrono::DateTime<chrono::Utc>,
    /// The references the detached calls asked for: the image gets these names.
    pub(crate) names: BTreeSet<String>,
    creds: Credentials,
    /// The hold's file, when holds are recorded.
    file: Option<PathBuf>,
}

/// A hold as recorded on disk.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct HoldRecord {
    pub sandbox_id: String,
    pub pod: PodRef,
    /// The reference the job was started with, and the digest it resolved to.
    pub reference: String,
    pub manifest: String,
    pub names: Vec<String>,
    #[serde(default)]
    pub credentials: Credentials,
    pub detached_at: chrono::DateTime<chrono::Utc>,
}

/// Per-sandbox accounting of the current sync's held time, and the policy for calls past it.
pub(crate) struct SyncBudgets {
    window: Option<Duration>,
    map: Mutex<HashMap<String, Budget>>,
    policy: std::sync::RwLock<Option<Arc<dyn DetachPolicy>>>,
}

struct Budget {
    period_start: Instant,
    in_flight: usize,
    last_end: Instant,
}

/// One call's share of its sandbox's budget; dropping it ends the call.
pub(crate) struct BudgetCall<'a> {
    budgets: &'a SyncBudgets,
    key: String,
    deadline: Instant,
}

impl SyncBudgets {
    pub(crate) fn new(window: Option<Duration>) -> SyncBudgets {
        SyncBudgets {
            window: window.filter(|w| !w.is_zero()),
            map: Mutex::new(HashMap::new()),
            policy: std::sync::RwLock::new(None),
        }
    }

    /// Returns once `requester`'s call, whose window has passed, must detach: at once without
    /// a policy or when it says no, else at the first no of the checks every [`HOLD_RECHECK`].
    pub(crate) async fn past_window(&self, requester: &Requester, reference: &Reference) {
        let mut held = false;
        loop {
            let policy = self
                .policy
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            let Some(policy) = policy else { return };
            if !policy.may_hold_past_window(requester, reference) {
                if held {
                    tracing::info!(image = %reference, requester = %requester.key(), "PullImage held past its window may wait no longer");
                }
                return;
            }
            if !held {
                tracing::info!(image = %reference, requester = %requester.key(), "PullImage held past its window: the pod is followed in the API server");
                held = true;
            }
            tokio::time::sleep(HOLD_RECHECK).await;
        }
    }

    fn gap(window: Duration) -> Duration {
        SYNC_GAP.min(window / 2)
    }

    /// Starts a call: `None` when it never detaches (no window, or no sandbox of ours).
    pub(crate) fn start(&self, requester: &Requester) -> Option<BudgetCall<'_>> {
        let window = self.window?;
        requester.sandbox_id.as_ref()?;
        let key = requester.key();
        let now = Instant::now();
        let gap = Self::gap(window);
        let mut map = self.map.lock().unwrap();
        if map.len() > 256 {
            map.retain(|_, b| b.in_flight > 0 || now.duration_since(b.last_end) < gap);
        }
        let b = map.entry(key.clone()).or_insert(Budget {
            period_start: now,
            in_flight: 0,
            last_end: now,
        });
        if b.in_flight == 0 && now.duration_since(b.last_end) >= gap {
            b.period_start = now;
        }
        b.in_flight += 1;
        let deadline = (b.period_start + window).max(now + MIN_HOLD.min(window));
        Some(BudgetCall {
            budgets: self,
            key,
            deadline,
        })
    }
}

impl BudgetCall<'_> {
    pub(crate) fn deadline(&self) -> Instant {
        self.deadline
    }
}

impl Drop for BudgetCall<'_> {
    fn drop(&mut self) {
        let mut map = self.budgets.map.lock().unwrap();
        if let Some(b) = map.get_mut(&self.key) {
            b.in_flight -= 1;
            b.last_end = Instant::now();
        }
    }
}

/// File operations on hold records, applied in order by one thread.
enum FileOp {
    Write(PathBuf, Vec<u8>),
    Remove(PathBuf),
}

fn file_writer() -> &'static Mutex<mpsc::Sender<FileOp>> {
    static WRITER: std::sync::OnceLock<Mutex<mpsc::Sender<FileOp>>> = std::sync::OnceLock::new();
    WRITER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<FileOp>();
        std::thread::Builder::new()
            .name("minicri-holds".into())
            .spawn(move || {
                for op in rx {
                    let (path, r) = match op {
                        FileOp::Write(p, bytes) => {
                            let r = p
                                .parent()
                                .map(create_private_dir)
                                .unwrap_or(Ok(()))
                                .and_then(|()| minicri_snapshotter::write_atomic(&p, &bytes, 0o600));
                            (p, r)
                        }
                        FileOp::Remove(p) => {
                            let r = match std::fs::remove_file(&p) {
                                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
                                _ => Ok(()),
                            };
                            (p, r)
                        }
                    };
                    if let Err(e) = r {
                        tracing::warn!(file = %path.display(), error = %e, "cannot update a pull hold record");
                    }
                }
            })
            .expect("spawning the hold writer thread");
        Mutex::new(tx)
    })
}

fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
    {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

fn submit(op: FileOp) {
    let _ = file_writer().lock().unwrap().send(op);
}

/// How far a download is, for people: `45% (460.2 MiB of 1.0 GiB) at 38.1 MiB/s, about 15s
/// left` (`rate`: bytes per second now; `connections`: the transfer connections it holds now),
/// `resolving its layers` before its size is known, and `100% (1.0 GiB), unpacking` once every
/// byte is in.
pub fn progress_text(done: u64, total: u64, rate: f64, connections: usize) -> String {
    if total == 0 {
        return "resolving its layers".to_string();
    }
    if done >= total {
        return format!("100% ({}), unpacking", human_bytes(total as f64));
    }
    let pct = 100.0 * done as f64 / total as f64;
    let mut s = format!(
        "{pct:.0}% ({} of {})",
        human_bytes(done as f64),
        human_bytes(total as f64)
    );
    if rate > 0.0 {
        s.push_str(&format!(
            " at {}/s, about {} left",
            human_bytes(rate),
            human_duration(total.saturating_sub(done) as f64 / rate)
        ));
    } else if connections == 0 {
        s.push_str(", waiting for a transfer connection (the node's are shared between pods)");
    } else {
        s.push_str(", waiting for bytes");
    }
    s
}

impl PullManager {
    /// Installs the policy that lets calls wait past their detach window (see the module docs).
    pub fn set_detach_policy(&self, policy: Arc<dyn DetachPolicy>) {
        *self
            .budgets
            .policy
            .write()
            .unwrap_or_else(|p| p.into_inner()) = Some(policy);
    }

    fn hold_path(&self, requester_key: &str, job_key: &str) -> Option<PathBuf> {
        let dir = self.config.holds_dir.as_ref()?;
        let h = Sha256::digest(format!("{requester_key}|{job_key}").as_bytes());
        Some(dir.join(format!("{}.json", hex::encode(&h[..12]))))
    }

    /// The call `jref` reached its detach deadline: its sandbox takes over the reference.
    /// Returns the error for the call, or `Err(())` when the job has just ended (the caller
    /// takes its result instead).
    pub(super) fn detach(
        &self,
        job: &Arc<Job>,
        jref: &JobRef,
        reference: &Reference,
        creds: &Credentials,
    ) -> Result<StoreError, ()> {
        let sandbox = {
            let mut reqs = job.requesters.lock().unwrap();
            // Checked under the lock run_job takes the holds under, after it sends the result.
            if job.finished() {
                return Err(());
            }
            let e = reqs.get_mut(&jref.key).expect("a call's entry");
            // The sandbox was stopped (or its pod deleted) as the window closed: its reference
            // was dropped under this lock, and a hold taken now would outlive the sandbox.
            if e.abort.is_cancelled() {
                let why = e.reason.lock().unwrap().clone();
                let why = why.unwrap_or_else(|| "aborted".into());
                return Ok(StoreError::Cancelled(format!(
                    "pull of {reference} stopped: {why}"
                )));
            }
            let first = e.hold.is_none();
            let file = self.hold_path(&jref.key, &job.key);
            let hold = e.hold.get_or_insert_with(|| Hold {
                since: chrono::Utc::now(),
                names: BTreeSet::new(),
                creds: creds.clone(),
                file,
            });
            let added = hold.names.insert(reference.to_string());
            // Submitted under the lock: an abort taking this hold submits its removal only
            // after this write, so the file never outlives the hold.
            if let Some(f) = hold.file.clone().filter(|_| first || added) {
                let rec = record_of(&e.info, job, hold);
                submit(FileOp::Write(
                    f,
                    serde_json::to_vec_pretty(&rec).expect("plain data serialises"),
                ));
            }
            e.info.sandbox_id.clone().unwrap_or_default()
        };
        self.counters.detached.fetch_add(1, Ordering::Relaxed);
        let message = self.detach_message(job, reference, &sandbox);
        tracing::info!(job = job.id, image = %reference, sandbox = %sandbox, %message, "PullImage detached; the download continues for the sandbox");
        Ok(StoreError::Detached(message))
    }

    /// What the kubelet shows in the pod's events (`Failed to pull image "…": <this>`).
    fn detach_message(&self, job: &Job, reference: &Reference, sandbox: &str) -> String {
        let b = job.bytes();
        let progress = progress_text(b.done, b.total, b.rate, b.connections);
        let window = self.config.detach_after.unwrap_or_default();
        format!(
            "image {reference} is still downloading in the background: {progress}. The pod \
             starts when the download completes (minicri stops holding a pod's pull call after \
             pull.detach_after = {}; the download continues for pod sandbox {})",
            human_duration(window.as_secs_f64()),
            &sandbox[..sandbox.len().min(13)],
        )
    }

    /// A hold ended: its record goes.
    pub(super) fn end_hold(&self, hold: Hold) {
        if let Some(f) = hold.file {
            submit(FileOp::Remove(f));
        }
    }

    /// Resumes, after a restart, the downloads that sandboxes held: for every recorded hold
    /// whose sandbox `is_ready`, the job is started again (or joined) with the sandbox holding
    /// it; the other records are removed. Call once at start, inside the runtime.
    pub fn restore_holds(self: &Arc<Self>, is_ready: impl Fn(&str) -> bool) -> usize {
        let Some(dir) = self.config.holds_dir.clone() else {
            return 0;
        };
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return 0;
        };
        let mut restored = 0;
        for ent in entries.flatten() {
            let path = ent.path();
            if path.extension().and_then(|x| x.to_str()) != Some("json") {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let rec: HoldRecord = match std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
            {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(file = %path.display(), error = %e, "unreadable pull hold record removed");
                    let _ = std::fs::remove_file(&path);
                    continue;
                }
            };
            if !is_ready(&rec.sandbox_id) {
                tracing::info!(sandbox = %rec.sandbox_id, image = %rec.reference, "pod sandbox no longer ready; its background download is not resumed");
                let _ = std::fs::remove_file(&path);
                continue;
            }
            restored += 1;
            let mgr = self.clone();
            tokio::spawn(async move { mgr.resume_hold(rec, path).await });
        }
        restored
    }

    /// Restarts the job of a recorded hold, the sandbox holding it. Resolution is retried (the
    /// registry may be down as the node restarts) for as long as the progress timeout allows.
    async fn resume_hold(self: Arc<Self>, rec: HoldRecord, path: PathBuf) {
        let fail = |why: String| {
            tracing::warn!(sandbox = %rec.sandbox_id, image = %rec.reference, error = %why, "cannot resume a sandbox's background download");
            submit(FileOp::Remove(path.clone()));
        };
        let (reference, top) = match (
            Reference::parse(&rec.reference),
            Digest::parse(&rec.manifest),
        ) {
            (Ok(r), Ok(d)) => (r, d),
            _ => return fail("the record names no valid reference and digest".into()),
        };
        let requester = Requester::pod(rec.pod.clone(), Some(rec.sandbox_id.clone()));
        let give_up = Instant::now()
            + self
                .config
                .progress_timeout
                .unwrap_or(Duration::from_secs(60));
        let mut wait = Duration::from_millis(500);
        let (session, manifest) = loop {
            let pinned = match Reference::parse(&reference.with_digest(&top)) {
                Ok(r) => r,
                Err(e) => return fail(e.to_string()),
            };
            match self.resolve(&pinned, &rec.credentials).await {
                Ok(v) => break v,
                Err(e) if Instant::now() + wait < give_up => {
                    tracing::info!(image = %rec.reference, error = %e, "resolving a held pull after restart failed; retrying");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(10));
                }
                Err(e) => return fail(e.to_string()),
            }
        };
        let hold = Hold {
            since: rec.detached_at,
            names: rec.names.iter().cloned().collect(),
            creds: rec.credentials.clone(),
            file: Some(path.clone()),
        };
        let key = format!("{}|{}", top, self.config.platform);
        match self.join(
            &key,
            &reference,
            &top,
            &requester,
            Joining::Hold(Box::new(hold)),
        ) {
            Ok((job, _, created)) => {
                self.counters.holds_restored.fetch_add(1, Ordering::Relaxed);
                tracing::info!(job = job.id, sandbox = %rec.sandbox_id, image = %rec.reference, "resumed a sandbox's background download after restart");
                if created {
                    self.run_job(job, session, manifest).await;
                }
            }
            Err(e) => fail(e.to_string()),
        }
    }
}

fn record_of(info: &Requester, job: &Job, hold: &Hold) -> HoldRecord {
    HoldRecord {
        sandbox_id: info.sandbox_id.clone().unwrap_or_default(),
        pod: info.pod.clone().unwrap_or_default(),
        reference: job.reference.to_string(),
        manifest: job.top.to_string(),
        names: hold.names.iter().cloned().collect(),
        credentials: hold.creds.clone(),
        detached_at: hold.since,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox_requester(uid: &str) -> Requester {
        Requester::pod(
            PodRef {
                namespace: "ns".into(),
                name: "p".into(),
                uid: uid.into(),
                attempt: 0,
            },
            Some(format!("sb-{uid}")),
        )
    }

    #[test]
    fn no_window_or_no_sandbox_never_detaches() {
        let b = SyncBudgets::new(None);
        assert!(b.start(&sandbox_requester("a")).is_none());
        let b = SyncBudgets::new(Some(Duration::ZERO));
        assert!(b.start(&sandbox_requester("a")).is_none());
        let b = SyncBudgets::new(Some(Duration::from_secs(30)));
        assert!(b.start(&Requester::anonymous()).is_none());
        let mut no_sandbox = sandbox_requester("a");
        no_sandbox.sandbox_id = None;
        assert!(b.start(&no_sandbox).is_none());
    }

    #[test]
    fn calls_of_one_sync_share_one_window() {
        let w = Duration::from_secs(30);
        let b = SyncBudgets::new(Some(w));
        let start = Instant::now();
        let first = b.start(&sandbox_requester("a"));
        let d1 = first.as_ref().unwrap().deadline();
        assert!(d1 >= start + w && d1 <= Instant::now() + w);
        drop(first);
        // The next image of the same sync, right after: same end, not a new window.
        let second = b.start(&sandbox_requester("a")).unwrap();
        assert_eq!(second.deadline(), d1);
        // Concurrent calls (the parallel puller) share it too; another sandbox has its own.
        let third = b.start(&sandbox_requester("a")).unwrap();
        assert_eq!(third.deadline(), d1);
        let other = b.start(&sandbox_requester("b")).unwrap();
        assert!(other.deadline() > d1);
    }

    #[test]
    fn a_spent_budget_still_gives_each_call_the_minimum_hold() {
        let w = Duration::from_millis(200);
        let b = SyncBudgets::new(Some(w));
        drop(b.start(&sandbox_requester("a")));
        std::thread::sleep(Duration::from_millis(60));
        // Within the sync gap (half the window here): the budget ends 200 ms after the first
        // call began, but a call may always take min(MIN_HOLD, window).
        let now = Instant::now();
        let c = b.start(&sandbox_requester("a")).unwrap();
        assert!(c.deadline() >= now + w, "{:?}", c.deadline() - now);
    }

    #[test]
    fn a_pause_longer_than_the_gap_starts_a_new_sync() {
        let w = Duration::from_millis(400);
        let b = SyncBudgets::new(Some(w));
        let first = b.start(&sandbox_requester("a")).unwrap().deadline();
        std::thread::sleep(Duration::from_millis(250)); // > gap (200 ms), call ended at once
        let now = Instant::now();
        let next = b.start(&sandbox_requester("a")).unwrap();
        assert!(next.deadline() >= now + w);
        assert!(next.deadline() > first);
    }

    #[test]
    fn a_call_in_flight_keeps_the_sync_open() {
        let w = Duration::from_secs(4);
        let b = SyncBudgets::new(Some(w));
        let long = b.start(&sandbox_requester("a")).unwrap();
        let d = long.deadline();
        std::thread::sleep(Duration::from_millis(250));
        // Another call while the first is still held: same sync, the same end (later than
        // its own minimum hold).
        let c = b.start(&sandbox_requester("a")).unwrap();
        assert_eq!(c.deadline(), d);
    }

    /// A policy that says what a flag says, and counts the questions.
    struct Flag(
        std::sync::atomic::AtomicBool,
        std::sync::atomic::AtomicUsize,
    );

    impl DetachPolicy for Flag {
        fn may_hold_past_window(&self, _: &Requester, _: &Reference) -> bool {
            self.1.fetch_add(1, Ordering::Relaxed);
            self.0.load(Ordering::Relaxed)
        }
    }

    #[tokio::test]
    async fn a_call_past_its_window_waits_while_the_policy_says_yes_and_detaches_at_the_first_no() {
        let b = SyncBudgets::new(Some(Duration::from_secs(30)));
        let (r, reference) = (sandbox_requester("a"), Reference::parse("busybox").unwrap());
        // No policy: detach at once.
        tokio::time::timeout(Duration::from_millis(50), b.past_window(&r, &reference))
            .await
            .expect("no policy, no wait");
        let flag = Arc::new(Flag(true.into(), 0.into()));
        *b.policy.write().unwrap() = Some(flag.clone());
        let wait = b.past_window(&r, &reference);
        tokio::pin!(wait);
        assert!(
            tokio::time::timeout(Duration::from_millis(2500), &mut wait)
                .await
                .is_err(),
            "held while the policy says yes"
        );
        let asked = flag.1.load(Ordering::Relaxed);
        assert!((3..=4).contains(&asked), "asked {asked} times in 2.5 s");
        let no = Instant::now();
        flag.0.store(false, Ordering::Relaxed);
        wait.await;
        assert!(no.elapsed() <= HOLD_RECHECK + Duration::from_millis(200));
    }

    #[test]
    fn progress_reads_as_people_read_it() {
        assert_eq!(
            progress_text(460 << 20, 1 << 30, 38.0 * 1048576.0, 4),
            "45% (460.0 MiB of 1.0 GiB) at 38.0 MiB/s, about 15s left"
        );
        assert_eq!(
            progress_text(0, 10, 0.0, 1),
            "0% (0 B of 10 B), waiting for bytes"
        );
        assert_eq!(
            progress_text(0, 10, 0.0, 0),
            "0% (0 B of 10 B), waiting for a transfer connection (the node's are shared between pods)"
        );
        assert_eq!(progress_text(0, 0, 0.0, 0), "resolving its layers");
        assert_eq!(progress_text(10, 10, 0.0, 0), "100% (10 B), unpacking");
    }
}

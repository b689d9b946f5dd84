//! One simulated blob download and its connections, after `blobs.rs`'s `Transfer::worker`: each
//! connection takes leases from the real scheduler, receives bytes at its registry's rate in
//! simulated time (counting them on the lease and telling the flow what is left), and reacts to
//! revocation as the daemon does.
//!
//! The first connection learns whether the registry answers ranged requests; if it does, the
//! rest of the blob is split between the blob's connections, which start then. A revoked
//! connection gives its piece back and asks for a slot again. One that cannot resume loses its
//! bytes (the next answer starts at byte 0) and, once its flow has [`MAX_STRIKES`] strikes, the
//! download gives up. A body cut short is asked for again after a back-off, the slot kept. A
//! download ends done, given up, stalled, or stopped when no pull wants it any more.
//!
//! The pull watchdog is modelled at blob level only: a connection whose blob received nothing
//! while its connections held slots for [`PROGRESS_TIMEOUT`] in total ends the download as
//! stalled (the daemon's watchdog judges a pull's transfer time the same way, over all of its
//! blobs).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::scenario::{BlobSpec, CUT_BACKOFF, PROGRESS_TIMEOUT, RegistrySpec};
use super::world::Sim;
use crate::sched::{Flow, Lease, MAX_STRIKES};

/// How a download ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum End {
    Done,
    /// Given up with this error (too many strikes).
    GaveUp(String),
    /// Its registry sent nothing for [`PROGRESS_TIMEOUT`] of connection time.
    Stalled(String),
    /// No pull wanted it any more.
    Stopped,
}

/// A lease held by a connection: letting go of it counts as a change.
struct Held<'a>(Lease, &'a Sim);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.1.changed();
    }
}

/// One running download of a blob.
pub(super) struct Download {
    pub blob: usize,
    pub flow: Arc<Flow>,
    /// No pull wants it any more.
    pub stop: CancellationToken,
    /// Every piece is claimed: extra connections waiting for a slot give up.
    drained: CancellationToken,
    /// Whether the registry answers ranged requests, once the first answer came.
    ranged: watch::Sender<Option<bool>>,
    st: Mutex<Pieces>,
    spec: BlobSpec,
    reg: RegistrySpec,
}

struct Pieces {
    pieces: Vec<Piece>,
    /// Bytes received of the blob.
    done: u64,
    /// Connection time without a byte, since the last byte, of connections that let go.
    silent: Duration,
}

#[derive(Debug, Clone, Copy)]
struct Piece {
    pos: u64,
    end: u64,
    busy: bool,
}

/// How a connection's hold of a slot ended.
enum Run {
    /// No piece is left to claim.
    Done,
    Revoked,
}

/// What interrupted a wait while holding a slot.
enum Cut {
    Revoked,
    Stalled,
}

impl Download {
    pub fn new(blob: usize, flow: Arc<Flow>, spec: BlobSpec, reg: RegistrySpec) -> Download {
        Download {
            blob,
            flow,
            stop: CancellationToken::new(),
            drained: CancellationToken::new(),
            ranged: watch::channel(None).0,
            st: Mutex::new(Pieces {
                pieces: vec![Piece {
                    pos: 0,
                    end: spec.size,
                    busy: false,
                }],
                done: 0,
                silent: Duration::ZERO,
            }),
            spec,
            reg,
        }
    }

    pub async fn run(&self, sim: &Arc<Sim>) -> End {
        let k = self.spec.connections.max(1);
        let workers = futures::future::try_join_all((0..k).map(|i| self.worker(sim, i == 0)));
        tokio::select! {
            biased;
            _ = self.stop.cancelled() => End::Stopped,
            r = workers => match r {
                Ok(_) if self.complete() => End::Done,
                Ok(_) => End::GaveUp("every connection ended with bytes missing".into()),
                Err(e) => e,
            },
        }
    }

    fn complete(&self) -> bool {
        let st = self.st.lock().unwrap();
        st.pieces.iter().all(|p| p.pos >= p.end)
    }

    /// One connection: asks for slots until its pieces are in.
    async fn worker(&self, sim: &Arc<Sim>, first: bool) -> Result<(), End> {
        if !first {
            let mut ranged = self.ranged.subscribe();
            let works = tokio::select! {
                biased;
                _ = self.drained.cancelled() => false,
                known = ranged.wait_for(Option::is_some) => matches!(known.as_deref(), Ok(Some(true))),
            };
            if !works {
                return Ok(());
            }
        }
        let mut owes_piece = false;
        loop {
            sim.changed();
            let lease = if first || owes_piece {
                sim.sched.acquire(&self.flow).await
            } else {
                tokio::select! {
                    biased;
                    _ = self.drained.cancelled() => {
                        sim.gave_up_waiting();
                        return Ok(());
                    }
                    lease = sim.sched.acquire(&self.flow) => lease,
                }
            };
            sim.granted(self, &lease);
            let lease = Held(lease, sim);
            match self.hold(sim, &lease.0).await? {
                Run::Done => return Ok(()),
                Run::Revoked => owes_piece = true,
            }
            drop(lease);
            if !self.flow.is_resumable() && self.flow.strikes() >= MAX_STRIKES {
                return Err(End::GaveUp(format!(
                    "blob {}: its registry ignores Range requests and it was stopped {} times",
                    self.blob,
                    self.flow.strikes()
                )));
            }
        }
    }

    fn claim(&self) -> Option<usize> {
        let mut st = self.st.lock().unwrap();
        let Some(i) = st.pieces.iter().position(|p| !p.busy && p.pos < p.end) else {
            self.drained.cancel();
            return None;
        };
        st.pieces[i].busy = true;
        Some(i)
    }

    /// The answer to a request for piece `i` came.
    fn answered(&self, sim: &Sim, i: usize) {
        sim.changed();
        let mut st = self.st.lock().unwrap();
        self.flow.set_resumable(self.reg.resumable);
        if !self.reg.resumable {
            // The whole blob, from byte 0, whatever was asked for: the only request.
            st.done = 0;
            st.pieces = vec![Piece {
                pos: 0,
                end: self.spec.size,
                busy: true,
            }];
            self.ranged.send_if_modified(|r| r.replace(false).is_none());
            return;
        }
        if self.ranged.borrow().is_none() {
            // Ranges work: the rest is split between the blob's connections.
            let k = self.spec.connections.max(1) as u64;
            let Piece { pos, end, .. } = st.pieces[i];
            let step = (end - pos).div_ceil(k).max(1);
            st.pieces[i].end = (pos + step).min(end);
            let mut at = st.pieces[i].end;
            while at < end {
                let to = (at + step).min(end);
                st.pieces.push(Piece {
                    pos: at,
                    end: to,
                    busy: false,
                });
                at = to;
            }
            self.ranged.send_replace(Some(true));
        }
    }

    /// Waits `d` holding `lease`, unless it is revoked or the stall deadline comes first.
    async fn wait(&self, lease: &Lease, d: Duration, stall_at: Instant) -> Option<Cut> {
        tokio::select! {
            biased;
            _ = lease.revoked() => Some(Cut::Revoked),
            _ = tokio::time::sleep_until(stall_at) => Some(Cut::Stalled),
            _ = tokio::time::sleep(d) => None,
        }
    }

    /// Receives `n` bytes into piece `i`; whether the piece is complete.
    fn receive(&self, lease: &Lease, i: usize, n: u64) -> bool {
        let mut st = self.st.lock().unwrap();
        let p = &mut st.pieces[i];
        let n = n.min(p.end - p.pos);
        p.pos += n;
        let complete = p.pos >= p.end;
        if n > 0 {
            st.done += n;
            st.silent = Duration::ZERO;
            self.flow.set_left(self.spec.size.saturating_sub(st.done));
            lease.add_bytes(n);
        }
        complete
    }

    /// Holds `lease`: fetches pieces until none is left to claim, the slot is revoked, or the
    /// registry has been silent too long.
    async fn hold(&self, sim: &Arc<Sim>, lease: &Lease) -> Result<Run, End> {
        let Some(mut i) = self.claim() else {
            return Ok(Run::Done);
        };
        let rate = self.reg.rate;
        // Silent since, and when the silence becomes a stall.
        let mut quiet = Instant::now();
        let mut stall_at = quiet + PROGRESS_TIMEOUT.saturating_sub(self.st.lock().unwrap().silent);
        // The piece was completed by the interval a revocation interrupted.
        let mut finished = false;
        'request: loop {
            let cut = match self.wait(lease, self.reg.latency, stall_at).await {
                Some(c) => c,
                None => {
                    self.answered(sim, i);
                    let body_ends = self.reg.cut_every.map(|c| Instant::now() + c);
                    loop {
                        let Piece { pos, end, .. } = self.st.lock().unwrap().pieces[i];
                        let mut step = self.reg.chunk_every();
                        if rate > 0 {
                            let rest = Duration::from_secs_f64((end - pos) as f64 / rate as f64);
                            step = step.min(rest.max(Duration::from_millis(1)));
                        }
                        if let Some(e) = body_ends {
                            step = step.min(e.saturating_duration_since(Instant::now()));
                        }
                        let began = Instant::now();
                        if let Some(c) = self.wait(lease, step, stall_at).await {
                            // The bytes of the interrupted interval are in.
                            let got = (rate as f64 * began.elapsed().as_secs_f64()) as u64;
                            finished = self.receive(lease, i, got);
                            break c;
                        }
                        let got = (rate as f64 * step.as_secs_f64()).ceil() as u64;
                        if got > 0 {
                            quiet = Instant::now();
                            stall_at = quiet + PROGRESS_TIMEOUT;
                        }
                        if self.receive(lease, i, got) {
                            self.st.lock().unwrap().pieces[i].busy = false;
                            match self.claim() {
                                Some(j) => {
                                    i = j;
                                    continue 'request;
                                }
                                None => {
                                    self.let_go(quiet);
                                    return Ok(Run::Done);
                                }
                            }
                        }
                        if body_ends.is_some_and(|e| Instant::now() >= e) {
                            // The body was cut short: ask again after a back-off.
                            if let Some(c) = self.wait(lease, CUT_BACKOFF, stall_at).await {
                                break c;
                            }
                            continue 'request;
                        }
                    }
                }
            };
            self.st.lock().unwrap().pieces[i].busy = false;
            return match cut {
                Cut::Stalled => {
                    self.let_go(quiet);
                    Err(End::Stalled(format!(
                        "blob {}: no byte for {PROGRESS_TIMEOUT:?} of transfer time",
                        self.blob
                    )))
                }
                Cut::Revoked => {
                    sim.revoked(self, lease);
                    // The request winds down with the slot still held.
                    tokio::time::sleep(self.reg.stop_delay).await;
                    self.let_go(quiet);
                    // Its last bytes came in as it stopped: nothing is owed (blobs.rs writes
                    // a chunk received before it looks at the revocation again).
                    Ok(if finished { Run::Done } else { Run::Revoked })
                }
            };
        }
    }

    /// A connection lets go of its slot, silent since `quiet`.
    fn let_go(&self, quiet: Instant) {
        let mut st = self.st.lock().unwrap();
        st.silent += quiet.elapsed();
    }
}

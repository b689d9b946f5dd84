//! Owns how tests start the servers they stand up as separate processes (registries, caches):
//! spawned from one long-lived helper thread with `PR_SET_PDEATHSIG`, so they die with the test
//! binary even when it exits without running destructors; a free loopback port to give them;
//! and the wait until their `/v2/` answers.

use std::fs;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};

/// How long [`wait_ready`] waits for `/v2/` to answer.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

type SpawnRequest = (Command, mpsc::Sender<io::Result<Child>>);

/// Spawns `cmd` from the spawner thread, killed (SIGKILL) when the test process exits.
pub fn spawn_tied(cmd: Command) -> Result<Child> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        // PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, so children are
        // forked from this thread, which lives as long as the process does.
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        thread::Builder::new()
            .name("server-spawner".into())
            .spawn(move || {
                for (cmd, reply) in rx {
                    let _ = reply.send(spawn_here(cmd));
                }
            })
            .expect("spawning the server-spawner thread");
        Mutex::new(tx)
    });
    let program = cmd.get_program().to_string_lossy().into_owned();
    let (reply_tx, reply_rx) = mpsc::channel();
    spawner
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send((cmd, reply_tx))
        .map_err(|_| anyhow!("the server-spawner thread is gone"))?;
    reply_rx
        .recv()
        .map_err(|_| anyhow!("the server-spawner thread is gone"))?
        .with_context(|| format!("spawning {program}"))
}

fn spawn_here(mut cmd: Command) -> io::Result<Child> {
    // SAFETY: the closure only makes one async-signal-safe system call (prctl).
    unsafe {
        cmd.pre_exec(|| {
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL)
                .map_err(io::Error::from)
        });
    }
    cmd.spawn()
}

/// A loopback port that was free a moment ago, for a server a test starts with a fixed address.
/// Chosen below the kernel's ephemeral range (`ip_local_port_range`): a port from that range can
/// be handed to any outgoing connection of the tests running beside this one between the probe
/// and the server's bind (seen: a daemon's metrics address taken, "Address already in use").
pub fn free_port() -> Result<u16> {
    let ephemeral_low = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    let low = 10_000.min(ephemeral_low / 2);
    for _ in 0..200 {
        let port = rand::random_range(low..ephemeral_low);
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    let listener = TcpListener::bind("127.0.0.1:0").context("probing for a free port")?;
    Ok(listener.local_addr()?.port())
}

/// Waits until `GET /v2/` on 127.0.0.1:`port` answers 200 or 401 (400 from a TLS listener,
/// which refuses plain HTTP), or `child` (called `name` in errors, which end with `log`'s last
/// lines) exits, or time runs out.
pub fn wait_ready(child: &mut Child, name: &str, port: u16, tls: bool, log: &Path) -> Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Some(status) = child.try_wait()? {
            bail!(
                "{name} exited ({status}) before answering; its log:\n{}",
                tail(log)
            );
        }
        if let Ok(code) = probe_v2(port)
            && (code == 200 || code == 401 || (tls && code == 400))
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "{name} on 127.0.0.1:{port} did not answer /v2/ within {READY_TIMEOUT:?}; its log:\n{}",
                tail(log)
            );
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// The status code of `GET /v2/`, spoken in plain HTTP/1.1 over a std socket (works from sync
/// and async callers alike).
fn probe_v2(port: u16) -> io::Result<u16> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.set_write_timeout(Some(Duration::from_secs(2)))?;
    write!(
        stream,
        "GET /v2/ HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
    )?;
    let mut head = [0u8; 12];
    stream.read_exact(&mut head)?;
    let line = String::from_utf8_lossy(&head);
    line.get(9..12)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| io::Error::other(format!("bad status line {line:?}")))
}

/// The last 30 lines of the file at `path` (empty if it cannot be read).
pub fn tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

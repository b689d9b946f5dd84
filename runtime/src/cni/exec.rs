//! Running one CNI plugin binary (spec section 2, "Execution Protocol").
//!
//! Owns the process boundary: finding the executable named by the plugin's `type` in the bin
//! dirs, the `CNI_*` environment, the configuration on stdin, the time limit, and turning the exit
//! status and output into either the plugin's stdout or a [`CniError`] that names the plugin.
//!
//! Invariants: a plugin never outlives its time limit (its whole process group is killed, so an
//! IPAM plugin it delegated to goes too); the daemon's environment is passed on (plugins such as
//! portmap run `iptables` from `PATH`) with every `CNI_*` variable set explicitly; what a plugin
//! prints costs the daemon at most [`MAX_STDOUT`] and [`MAX_STDERR`] bytes (more stdout is an
//! error, stderr keeps its end), and its error message at most 1024 characters.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

/// Most of a plugin's stdout kept: results are a few KiB (an interface, a few addresses).
pub const MAX_STDOUT: usize = 1 << 20;
/// Most of a plugin's stderr kept (its end): only ever logged, or quoted in an error.
pub const MAX_STDERR: usize = 64 << 10;

/// Reads `r` to its end, keeping at most `max` bytes: the first ones (`tail` false, and whether
/// more came) or the last ones (`tail` true). What is over is read and dropped, so the writer
/// never blocks on a full pipe.
async fn read_bounded(
    mut r: impl AsyncRead + Unpin,
    max: usize,
    tail: bool,
) -> std::io::Result<(Vec<u8>, bool)> {
    let mut out = Vec::new();
    let mut over = false;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = r.read(&mut buf).await?;
        if n == 0 {
            return Ok((out, over));
        }
        out.extend_from_slice(&buf[..n]);
        if out.len() > max {
            over = true;
            if tail {
                out.drain(..out.len() - max);
            } else {
                out.truncate(max);
            }
        }
    }
}

use super::CniError;
use super::config::join_paths;
use super::result::PluginError;

/// `CNI_COMMAND`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Add,
    Del,
    Check,
}

impl Command {
    pub fn as_str(self) -> &'static str {
        match self {
            Command::Add => "ADD",
            Command::Del => "DEL",
            Command::Check => "CHECK",
        }
    }
}

impl std::fmt::Display for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The per-call parameters passed in the environment.
#[derive(Debug, Clone)]
pub struct Invocation<'a> {
    pub command: Command,
    /// `CNI_CONTAINERID`.
    pub container_id: &'a str,
    /// `CNI_NETNS`; empty on a DEL whose namespace is gone (the spec lets DEL run without one).
    pub netns: &'a str,
    /// `CNI_IFNAME`.
    pub if_name: &'a str,
    /// `CNI_ARGS`.
    pub args: &'a str,
}

/// Finds and runs plugin executables.
#[derive(Debug, Clone)]
pub struct PluginRunner {
    bin_dirs: Vec<PathBuf>,
    timeout: Duration,
}

impl PluginRunner {
    pub fn new(bin_dirs: Vec<PathBuf>, timeout: Duration) -> Self {
        PluginRunner { bin_dirs, timeout }
    }

    /// The first executable regular file named `plugin` in the bin dirs, in order (spec: the
    /// network's `type` is the name of the executable to invoke).
    pub fn find(&self, plugin: &str) -> Result<PathBuf, CniError> {
        for dir in &self.bin_dirs {
            let p = dir.join(plugin);
            if let Ok(md) = std::fs::metadata(&p)
                && md.is_file()
                && md.permissions().mode() & 0o111 != 0
            {
                return Ok(p);
            }
        }
        Err(CniError::PluginNotFound {
            plugin: plugin.to_string(),
            dirs: join_paths(&self.bin_dirs, ", "),
        })
    }

    /// Runs `plugin` with `config` on stdin; its stdout on success (exit 0).
    pub async fn run(
        &self,
        plugin: &str,
        inv: &Invocation<'_>,
        config: &[u8],
    ) -> Result<Vec<u8>, CniError> {
        let path = self.find(plugin)?;
        let exec_err = |source: std::io::Error| CniError::Exec {
            plugin: plugin.to_string(),
            command: inv.command,
            source,
        };
        let mut cmd = tokio::process::Command::new(&path);
        cmd.env("CNI_COMMAND", inv.command.as_str())
            .env("CNI_CONTAINERID", inv.container_id)
            .env("CNI_NETNS", inv.netns)
            .env("CNI_IFNAME", inv.if_name)
            .env("CNI_ARGS", inv.args)
            .env("CNI_PATH", join_paths(&self.bin_dirs, ":"))
            .current_dir("/")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(exec_err)?;
        let pid = child.id();
        let mut stdin = child.stdin.take().expect("stdin is piped");
        let input = config.to_vec();
        let write = async move {
            let r = stdin.write_all(&input).await;
            drop(stdin); // EOF
            r
        };
        let (stdout, stderr) = (
            child.stdout.take().expect("stdout is piped"),
            child.stderr.take().expect("stderr is piped"),
        );
        let all = async {
            let (written, out, err, status) = tokio::join!(
                write,
                read_bounded(stdout, MAX_STDOUT, false),
                read_bounded(stderr, MAX_STDERR, true),
                child.wait()
            );
            (written, out.and_then(|o| Ok((o, err?, status?))))
        };
        let (written, output) = match tokio::time::timeout(self.timeout, all).await {
            Ok(v) => v,
            Err(_) => {
                if let Some(pid) = pid {
                    let _ = nix::sys::signal::killpg(
                        nix::unistd::Pid::from_raw(pid as i32),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
                return Err(CniError::Timeout {
                    plugin: plugin.to_string(),
                    command: inv.command,
                    timeout: self.timeout,
                });
            }
        };
        let ((stdout, stdout_over), (stderr, _), status) = output.map_err(exec_err)?;
        if stdout_over {
            return Err(CniError::Plugin {
                plugin: plugin.to_string(),
                command: inv.command,
                message: format!("printed more than {MAX_STDOUT} bytes on stdout ({status})"),
                code: None,
            });
        }
        let output = std::process::Output {
            status,
            stdout,
            stderr,
        };
        if !output.stderr.is_empty() {
            tracing::debug!(plugin, command = %inv.command, stderr = %String::from_utf8_lossy(&output.stderr).trim(), "CNI plugin stderr");
        }
        if output.status.success() {
            // A plugin that exits 0 without reading all of its stdin is still a success.
            if let Err(e) = written
                && e.kind() != std::io::ErrorKind::BrokenPipe
            {
                return Err(exec_err(e));
            }
            return Ok(output.stdout);
        }
        let message = match PluginError::parse(&output.stdout) {
            Some(e) => e.to_string(),
            None => {
                let text = if output.stdout.iter().all(u8::is_ascii_whitespace) {
                    &output.stderr
                } else {
                    &output.stdout
                };
                let text = String::from_utf8_lossy(text);
                let text = text.trim();
                let mut start = text.len().saturating_sub(500);
                while !text.is_char_boundary(start) {
                    start += 1;
                }
                let tail = &text[start..];
                if tail.is_empty() {
                    format!("{} with no output", output.status)
                } else {
                    format!("{tail} ({})", output.status)
                }
            }
        };
        Err(CniError::Plugin {
            plugin: plugin.to_string(),
            command: inv.command,
            message: minicri_store::text::bounded(message),
            code: PluginError::parse(&output.stdout).map(|e| e.code),
        })
    }
}

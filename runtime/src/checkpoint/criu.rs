//! Whether CRIU can checkpoint on this host: `criu check`, run once (the first checkpoint) and
//! its answer kept for the daemon's life. A host where it fails gets CRIU's own reason in every
//! CheckpointContainer answer, and its containers are not touched.

use std::path::PathBuf;
use std::time::Duration;

use tokio::sync::OnceCell;

/// How long `criu check` may take.
const CHECK_TIMEOUT: Duration = Duration::from_secs(30);
/// Most characters of CRIU's reason quoted in an answer.
const MAX_REASON_CHARS: usize = 1024;

/// The cached outcome of `criu check`.
pub struct CriuCheck {
    binary: PathBuf,
    result: OnceCell<Result<(), String>>,
}

impl CriuCheck {
    /// `binary`: CRIU, a name on PATH (runc runs `criu` from PATH) or a path.
    pub fn new(binary: impl Into<PathBuf>) -> CriuCheck {
        CriuCheck {
            binary: binary.into(),
            result: OnceCell::new(),
        }
    }

    /// `Ok` when CRIU works here, else why not (CRIU's own error lines).
    pub async fn ready(&self) -> Result<(), String> {
        self.result
            .get_or_init(|| run_check(&self.binary))
            .await
            .clone()
    }
}

async fn run_check(binary: &std::path::Path) -> Result<(), String> {
    let mut cmd = tokio::process::Command::new(binary);
    cmd.arg("check")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    let out = match tokio::time::timeout(CHECK_TIMEOUT, cmd.output()).await {
        Err(_) => {
            return Err(format!(
                "`{} check` gave no answer within {CHECK_TIMEOUT:?}",
                binary.display()
            ));
        }
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!(
                "CRIU is not installed ({} not found)",
                binary.display()
            ));
        }
        Ok(Err(e)) => return Err(format!("running {}: {e}", binary.display())),
        Ok(Ok(out)) => out,
    };
    if out.status.success() {
        return Ok(());
    }
    let mut text = String::from_utf8_lossy(&out.stderr).into_owned();
    text.push('\n');
    text.push_str(&String::from_utf8_lossy(&out.stdout));
    Err(format!(
        "`{} check` failed ({}): {}",
        binary.display(),
        out.status,
        reason(&text)
    ))
}

/// Most bytes read from the end of a CRIU log for its reason.
const MAX_LOG_TAIL: u64 = 256 << 10;

/// CRIU's reason from its log file (`dump.log`, `restore.log`), from its last
/// [`MAX_LOG_TAIL`] bytes; `None` without a log.
pub fn log_reason(path: &std::path::Path) -> Option<String> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    f.seek(SeekFrom::Start(len.saturating_sub(MAX_LOG_TAIL)))
        .ok()?;
    let mut buf = Vec::new();
    f.take(MAX_LOG_TAIL).read_to_end(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf);
    (!text.trim().is_empty()).then(|| reason(&text))
}

/// CRIU's reason from its output or log: its `Error (file:line): message` lines, the messages
/// joined, else its last line.
pub fn reason(output: &str) -> String {
    let errors: Vec<&str> = output
        .lines()
        // Logs put a timestamp before each line: `(00.012345) Error (criu/x.c:1): ...`.
        .filter_map(|l| l.find("Error (").map(|i| &l[i + "Error (".len()..]))
        .map(|l| l.split_once("): ").map_or(l, |(_, m)| m).trim())
        .collect();
    let r = if errors.is_empty() {
        output
            .lines()
            .rev()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .unwrap_or("no output")
            .to_string()
    } else {
        errors.join("; ")
    };
    minicri_store::text::bounded_to(r, MAX_REASON_CHARS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_are_criu_error_lines() {
        let out = "Error (criu/vdso.c:381): vdso: Unexpected rt vDSO area bounds\n\
                   Error (criu/vdso.c:613): vdso: Failed to fill self vdso symtable\n\
                   Error (criu/crtools.c:260): Could not initialize kernel features detection.\n";
        assert_eq!(
            reason(out),
            "vdso: Unexpected rt vDSO area bounds; vdso: Failed to fill self vdso symtable; \
             Could not initialize kernel features detection."
        );
        assert_eq!(reason("Warn: x\nLooks bad\n\n"), "Looks bad");
        assert_eq!(reason(""), "no output");
        let d = tempfile::tempdir().unwrap();
        let log = d.path().join("restore.log");
        assert_eq!(log_reason(&log), None);
        let mut text = "(00.000001) noise\n".repeat(20_000);
        text.push_str("(00.1) Error (criu/cr-restore.c:9): Can't restore\n");
        std::fs::write(&log, text).unwrap();
        assert_eq!(log_reason(&log).unwrap(), "Can't restore");
    }

    #[tokio::test]
    async fn a_missing_criu_says_so_and_is_cached() {
        let c = CriuCheck::new("/nonexistent/criu");
        let e = c.ready().await.unwrap_err();
        assert!(
            e.contains("CRIU is not installed (/nonexistent/criu not found)"),
            "{e}"
        );
        assert_eq!(c.ready().await.unwrap_err(), e);
    }

    #[tokio::test]
    async fn a_failing_check_names_the_error_lines() {
        let d = tempfile::tempdir().unwrap();
        let bin = d.path().join("criu");
        let count = d.path().join("count");
        crate::fsutil::write_executable(
            &bin,
            &format!(
                "#!/bin/sh\necho run >> {}\necho 'Error (criu/x.c:1): kernel says no' >&2\nexit 1\n",
                count.display()
            ),
        );
        let c = CriuCheck::new(&bin);
        let e = c.ready().await.unwrap_err();
        assert!(
            e.contains("check` failed") && e.ends_with(": kernel says no"),
            "{e}"
        );
        c.ready().await.unwrap_err();
        assert_eq!(
            std::fs::read_to_string(&count).unwrap(),
            "run\n",
            "run once"
        );
    }
}

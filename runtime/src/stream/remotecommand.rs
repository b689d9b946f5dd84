//! The Kubernetes remotecommand protocol over SPDY (what `kubectl exec` and `crictl exec` speak
//! through k8s.io/client-go/tools/remotecommand): protocol versions, stream types and the
//! payload of the error stream.
//!
//! The client names the versions it speaks in `X-Stream-Protocol-Version` request headers, best
//! first; the server answers the first one it supports in the same response header (no header at
//! all means the legacy `channel.k8s.io`). The client then opens one SPDY stream per channel,
//! each with a `streamType` header: `error` always, `stdin` / `stdout` / `stderr` as requested
//! (no `stderr` with a tty) and, from v3 on with a tty, `resize`. When the command ends the
//! server closes the output streams and reports the outcome on the error stream:
//!
//! - v4 (`v4.channel.k8s.io`): a JSON `metav1.Status`, also on success; a non-zero exit is
//!   `status: Failure, reason: NonZeroExitCode` with the code as the message of a cause of
//!   reason `ExitCode`, which the client turns into an exit-code error;
//! - v1 to v3: nothing on success, else a plain-text message.

use serde_json::json;

/// `X-Stream-Protocol-Version`.
pub const PROTOCOL_HEADER: &str = "X-Stream-Protocol-Version";
/// The server's list when negotiation fails.
pub const ACCEPTED_PROTOCOLS_HEADER: &str = "X-Accepted-Stream-Protocol-Versions";
/// The SPDY stream header naming a stream's channel.
pub const STREAM_TYPE_HEADER: &str = "streamType";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Protocol {
    V1,
    V2,
    V3,
    V4,
}

/// What this server speaks, best first.
pub const SUPPORTED: [Protocol; 4] = [Protocol::V4, Protocol::V3, Protocol::V2, Protocol::V1];

impl Protocol {
    pub fn name(self) -> &'static str {
        match self {
            Protocol::V1 => "channel.k8s.io",
            Protocol::V2 => "v2.channel.k8s.io",
            Protocol::V3 => "v3.channel.k8s.io",
            Protocol::V4 => "v4.channel.k8s.io",
        }
    }

    pub fn from_name(s: &str) -> Option<Protocol> {
        SUPPORTED.into_iter().find(|p| p.name() == s)
    }
}

/// The outcome of negotiation.
#[derive(Debug, PartialEq, Eq)]
pub enum Negotiated {
    /// The client named versions and this one is the first it listed that the server speaks.
    Chosen(Protocol),
    /// The client named no version: legacy `channel.k8s.io`, and no response header.
    Legacy,
    /// None of the client's versions is supported.
    NoCommon(Vec<String>),
}

/// Picks the protocol from the values of the client's `X-Stream-Protocol-Version` headers (each
/// may also be a comma-separated list), in the client's order of preference.
pub fn negotiate<'a>(values: impl IntoIterator<Item = &'a str>) -> Negotiated {
    let offered: Vec<String> = values
        .into_iter()
        .flat_map(|v| v.split(','))
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect();
    if offered.is_empty() {
        return Negotiated::Legacy;
    }
    match offered.iter().find_map(|o| Protocol::from_name(o)) {
        Some(p) => Negotiated::Chosen(p),
        None => Negotiated::NoCommon(offered),
    }
}

/// A remotecommand channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamType {
    Error,
    Stdin,
    Stdout,
    Stderr,
    Resize,
}

impl StreamType {
    pub fn parse(s: &str) -> Option<StreamType> {
        Some(match s {
            "error" => StreamType::Error,
            "stdin" => StreamType::Stdin,
            "stdout" => StreamType::Stdout,
            "stderr" => StreamType::Stderr,
            "resize" => StreamType::Resize,
            _ => return None,
        })
    }
}

/// How an exec ended, as the error stream reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Exit code 0.
    Success,
    /// The command ran and exited non-zero (or was killed: 128 + signal).
    ExitCode(i32),
    /// The command could not be run (runtime error, container gone, …).
    Error(String),
}

/// The bytes written on the error stream for `outcome` under protocol `p` (empty: nothing).
pub fn error_stream_payload(p: Protocol, outcome: &Outcome, cmd: &[String]) -> Vec<u8> {
    let exit_message = |code: i32| {
        format!(
            "command terminated with non-zero exit code: error executing command {cmd:?}, exit code {code}"
        )
    };
    match (p, outcome) {
        (Protocol::V4, Outcome::Success) => json!({"metadata": {}, "status": "Success"}),
        (Protocol::V4, Outcome::ExitCode(code)) => json!({
            "metadata": {},
            "status": "Failure",
            "message": exit_message(*code),
            "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]},
        }),
        (Protocol::V4, Outcome::Error(m)) => json!({
            "metadata": {},
            "status": "Failure",
            "message": m,
            "reason": "InternalError",
            "details": {"causes": [{"message": m}]},
            "code": 500,
        }),
        (_, Outcome::Success) => return Vec::new(),
        (_, Outcome::ExitCode(code)) => return exit_message(*code).into_bytes(),
        (_, Outcome::Error(m)) => return m.clone().into_bytes(),
    }
    .to_string()
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiation_follows_the_clients_preference() {
        // client-go's SPDY executor offers v5 first; v5 is not spoken here.
        let offered = [
            "v5.channel.k8s.io",
            "v4.channel.k8s.io",
            "v3.channel.k8s.io",
            "v2.channel.k8s.io",
            "channel.k8s.io",
        ];
        assert_eq!(negotiate(offered), Negotiated::Chosen(Protocol::V4));
        assert_eq!(
            negotiate(["v2.channel.k8s.io, v4.channel.k8s.io"]),
            Negotiated::Chosen(Protocol::V2)
        );
        assert_eq!(negotiate([]), Negotiated::Legacy);
        assert_eq!(
            negotiate(["v9.channel.k8s.io"]),
            Negotiated::NoCommon(vec!["v9.channel.k8s.io".into()])
        );
    }

    #[test]
    fn v4_status_is_what_client_go_parses() {
        let cmd = vec!["sh".to_string(), "-c".to_string(), "exit 3".to_string()];
        let ok = error_stream_payload(Protocol::V4, &Outcome::Success, &cmd);
        assert_eq!(ok, br#"{"metadata":{},"status":"Success"}"#);
        let v: serde_json::Value = serde_json::from_slice(&error_stream_payload(
            Protocol::V4,
            &Outcome::ExitCode(3),
            &cmd,
        ))
        .unwrap();
        assert_eq!(v["status"], "Failure");
        assert_eq!(v["reason"], "NonZeroExitCode");
        // metav1.StatusCause: `Type` is serialised as "reason"; the code is parsed as a uint8.
        assert_eq!(v["details"]["causes"][0]["reason"], "ExitCode");
        assert_eq!(v["details"]["causes"][0]["message"], "3");
        let v: serde_json::Value = serde_json::from_slice(&error_stream_payload(
            Protocol::V4,
            &Outcome::Error("no such file".into()),
            &cmd,
        ))
        .unwrap();
        assert_eq!(v["status"], "Failure");
        assert_eq!(v["message"], "no such file");
        assert_ne!(v["reason"], "NonZeroExitCode");
    }

    #[test]
    fn older_versions_get_text_and_nothing_on_success() {
        assert!(error_stream_payload(Protocol::V2, &Outcome::Success, &[]).is_empty());
        let m = error_stream_payload(Protocol::V3, &Outcome::ExitCode(2), &["false".into()]);
        assert!(String::from_utf8(m).unwrap().contains("exit code 2"));
        assert_eq!(
            error_stream_payload(Protocol::V1, &Outcome::Error("boom".into()), &[]),
            b"boom"
        );
    }
}

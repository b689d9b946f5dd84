//! The Kubernetes remotecommand protocol (what `kubectl exec` and `crictl exec` speak through
//! k8s.io/client-go/tools/remotecommand): protocol versions, stream types and the payload of
//! the error stream, whatever the transport.
//!
//! Over SPDY the client names the versions it speaks in `X-Stream-Protocol-Version` request
//! headers, best first; the server answers the first one it supports in the same response
//! header (no header at all means the legacy `channel.k8s.io`). Over WebSocket the same names
//! are WebSocket subprotocols (`Sec-WebSocket-Protocol`), and v5 (`v5.channel.k8s.io`) is
//! spoken too: WebSocket has no half-close, so v5 adds one ([`CLOSE_CHANNEL`]). Over SPDY the
//! client then opens one SPDY stream per channel,
//! each with a `streamType` header: `error` always, `stdin` / `stdout` / `stderr` as requested
//! (no `stderr` with a tty) and, from v3 on with a tty, `resize`. When the command ends the
//! server closes the output streams and reports the outcome on the error stream:
//!
//! - v4 and v5: a JSON `metav1.Status`, also on success; a non-zero exit is
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
    /// v4 plus the close signal; WebSocket only (as the kubelet).
    V5,
}

/// What this server speaks over SPDY, best first.
pub const SUPPORTED: [Protocol; 4] = [Protocol::V4, Protocol::V3, Protocol::V2, Protocol::V1];
/// What this server speaks over WebSocket, best first.
pub const WS_SUPPORTED: [Protocol; 5] = [
    Protocol::V5,
    Protocol::V4,
    Protocol::V3,
    Protocol::V2,
    Protocol::V1,
];

/// The WebSocket channel of the v5 close signal: `[255, channel]` ends the client's input on
/// `channel` (e.g. 0: stdin reached its end).
pub const CLOSE_CHANNEL: u8 = 255;

impl Protocol {
    pub fn name(self) -> &'static str {
        match self {
            Protocol::V1 => "channel.k8s.io",
            Protocol::V2 => "v2.channel.k8s.io",
            Protocol::V3 => "v3.channel.k8s.io",
            Protocol::V4 => "v4.channel.k8s.io",
            Protocol::V5 => "v5.channel.k8s.io",
        }
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

/// The protocol names in the values of a request's protocol headers (each may also be a
/// comma-separated list), in the client's order of preference.
pub fn offered<'a>(values: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    values
        .into_iter()
        .flat_map(|v| v.split(','))
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
        .collect()
}

/// Picks the first of the client's `offered` protocols (in its order of preference) that is
/// one of `supported`.
pub fn negotiate(offered: Vec<String>, supported: &[Protocol]) -> Negotiated {
    if offered.is_empty() {
        return Negotiated::Legacy;
    }
    match offered
        .iter()
        .find_map(|o| supported.iter().find(|p| p.name() == o))
    {
        Some(p) => Negotiated::Chosen(*p),
        None => Negotiated::NoCommon(offered),
    }
}

/// The channels a client of `p` uses: `error` always, `stdin` / `stdout` / `stderr` as asked
/// (no `stderr` with a terminal: it is merged into stdout), and `resize` with a terminal from
/// v3 on.
pub fn streams(stdin: bool, stdout: bool, stderr: bool, tty: bool, p: Protocol) -> Vec<StreamType> {
    let mut v = vec![StreamType::Error];
    if stdin {
        v.push(StreamType::Stdin);
    }
    if stdout {
        v.push(StreamType::Stdout);
    }
    if stderr && !tty {
        v.push(StreamType::Stderr);
    }
    if tty && p >= Protocol::V3 {
        v.push(StreamType::Resize);
    }
    v
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
    /// The channel number over WebSocket.
    pub fn channel(self) -> u8 {
        match self {
            StreamType::Stdin => 0,
            StreamType::Stdout => 1,
            StreamType::Stderr => 2,
            StreamType::Error => 3,
            StreamType::Resize => 4,
        }
    }

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
    Error(Failure),
}

/// Why a session's command could not run: the backend's error, kept by kind, which becomes
/// the Kubernetes Status reason and code on the error stream (kubectl words them apart).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub kind: FailureKind,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// The container is not there (`NotFound`, 404).
    NotFound,
    /// The request cannot be served as asked: the container is not running, attach to a
    /// stdin it was created without (`BadRequest`, 400).
    BadRequest,
    /// Anything else: the runtime failed (`InternalError`, 500).
    Internal,
}

impl FailureKind {
    /// The Status `reason` and `code`.
    fn status(self) -> (&'static str, u16) {
        match self {
            FailureKind::NotFound => ("NotFound", 404),
            FailureKind::BadRequest => ("BadRequest", 400),
            FailureKind::Internal => ("InternalError", 500),
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl Failure {
    pub fn internal(message: impl Into<String>) -> Failure {
        Failure {
            kind: FailureKind::Internal,
            message: message.into(),
        }
    }
}

impl From<crate::error::Error> for Failure {
    fn from(e: crate::error::Error) -> Failure {
        use crate::error::Error as E;
        let kind = match &e {
            E::NotFound(_) => FailureKind::NotFound,
            E::InvalidArgument(_) | E::FailedPrecondition(_) => FailureKind::BadRequest,
            _ => match e.code() {
                tonic::Code::NotFound => FailureKind::NotFound,
                _ => FailureKind::Internal,
            },
        };
        Failure {
            kind,
            message: e.to_string(),
        }
    }
}

impl From<crate::oci::OciError> for Failure {
    fn from(e: crate::oci::OciError) -> Failure {
        crate::error::Error::from(e).into()
    }
}

/// The bytes written on the error stream for `outcome` under protocol `p` (empty: nothing).
pub fn error_stream_payload(p: Protocol, outcome: &Outcome, cmd: &[String]) -> Vec<u8> {
    let exit_message = |code: i32| {
        format!(
            "command terminated with non-zero exit code: error executing command {cmd:?}, exit code {code}"
        )
    };
    match (p, outcome) {
        (Protocol::V4 | Protocol::V5, Outcome::Success) => {
            json!({"metadata": {}, "status": "Success"})
        }
        (Protocol::V4 | Protocol::V5, Outcome::ExitCode(code)) => json!({
            "metadata": {},
            "status": "Failure",
            "message": exit_message(*code),
            "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]},
        }),
        (Protocol::V4 | Protocol::V5, Outcome::Error(f)) => {
            let (reason, code) = f.kind.status();
            json!({
                "metadata": {},
                "status": "Failure",
                "message": f.message,
                "reason": reason,
                "details": {"causes": [{"message": f.message}]},
                "code": code,
            })
        }
        (_, Outcome::Success) => return Vec::new(),
        (_, Outcome::ExitCode(code)) => return exit_message(*code).into_bytes(),
        (_, Outcome::Error(f)) => return f.message.clone().into_bytes(),
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
        assert_eq!(
            negotiate(super::offered(offered), &SUPPORTED),
            Negotiated::Chosen(Protocol::V4)
        );
        // Over WebSocket v5 is spoken.
        assert_eq!(
            negotiate(super::offered(offered), &WS_SUPPORTED),
            Negotiated::Chosen(Protocol::V5)
        );
        assert_eq!(
            negotiate(
                super::offered(["v2.channel.k8s.io, v4.channel.k8s.io"]),
                &SUPPORTED
            ),
            Negotiated::Chosen(Protocol::V2)
        );
        assert_eq!(
            negotiate(super::offered([]), &SUPPORTED),
            Negotiated::Legacy
        );
        assert_eq!(
            negotiate(super::offered(["v9.channel.k8s.io"]), &SUPPORTED),
            Negotiated::NoCommon(vec!["v9.channel.k8s.io".into()])
        );
        assert_eq!(
            negotiate(super::offered(["v5.channel.k8s.io"]), &SUPPORTED),
            Negotiated::NoCommon(vec!["v5.channel.k8s.io".into()]),
            "no v5 over SPDY"
        );
    }

    #[test]
    fn v4_status_is_what_client_go_parses() {
        let cmd = vec!["sh".to_string(), "-c".to_string(), "exit 3".to_string()];
        let ok = error_stream_payload(Protocol::V4, &Outcome::Success, &cmd);
        assert_eq!(ok, br#"{"metadata":{},"status":"Success"}"#);
        assert_eq!(
            error_stream_payload(Protocol::V5, &Outcome::ExitCode(3), &cmd),
            error_stream_payload(Protocol::V4, &Outcome::ExitCode(3), &cmd)
        );
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
            &Outcome::Error(Failure::internal("no such file")),
            &cmd,
        ))
        .unwrap();
        assert_eq!(v["status"], "Failure");
        assert_eq!(v["message"], "no such file");
        assert_eq!(v["reason"], "InternalError");
        assert_eq!(v["code"], 500);
    }

    /// The backend's error kinds reach the Status: a missing container is NotFound, one that
    /// is not running a BadRequest, a runtime failure an InternalError.
    #[test]
    fn failures_keep_their_kind_in_the_status() {
        use crate::error::Error;
        for (e, reason, code) in [
            (
                Error::NotFound("container c not found".into()),
                "NotFound",
                404,
            ),
            (
                Error::FailedPrecondition("container c is not running".into()),
                "BadRequest",
                400,
            ),
            (
                Error::Internal("runc exec: boom".into()),
                "InternalError",
                500,
            ),
        ] {
            let message = e.to_string();
            let payload = error_stream_payload(Protocol::V5, &Outcome::Error(e.into()), &[]);
            let v: serde_json::Value = serde_json::from_slice(&payload).unwrap();
            assert_eq!(v["reason"], reason);
            assert_eq!(v["code"], code);
            assert_eq!(v["message"], message.as_str());
        }
    }

    #[test]
    fn streams_follow_the_request() {
        use StreamType::*;
        assert_eq!(
            streams(true, true, true, false, Protocol::V4),
            [Error, Stdin, Stdout, Stderr]
        );
        assert_eq!(
            streams(true, true, true, true, Protocol::V4),
            [Error, Stdin, Stdout, Resize]
        );
        assert_eq!(
            streams(true, true, false, true, Protocol::V2),
            [Error, Stdin, Stdout]
        );
        assert_eq!(
            [Stdin, Stdout, Stderr, Error, Resize].map(StreamType::channel),
            [0, 1, 2, 3, 4]
        );
    }

    #[test]
    fn older_versions_get_text_and_nothing_on_success() {
        assert!(error_stream_payload(Protocol::V2, &Outcome::Success, &[]).is_empty());
        let m = error_stream_payload(Protocol::V3, &Outcome::ExitCode(2), &["false".into()]);
        assert!(String::from_utf8(m).unwrap().contains("exit code 2"));
        assert_eq!(
            error_stream_payload(
                Protocol::V1,
                &Outcome::Error(Failure::internal("boom")),
                &[]
            ),
            b"boom"
        );
    }
}

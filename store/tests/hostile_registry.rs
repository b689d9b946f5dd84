//! A registry (and token service) that misbehaves on purpose, served from this test on loopback
//! (real TCP servers, minicri's real registry client): oversized manifests, token responses and
//! error bodies, bytes trickled under the read timeout, answers that never come, token realms on
//! hosts the credentials were not given for, redirects to other hosts, partial answers that do
//! not start where asked, and a plain-http registry reached by name. Servers that must be on
//! another host than the node (a token realm the credentials must not reach) listen in a
//! network namespace ([`FarHost`]). docs/hardening.md says what each bound is.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use minicri_store::hosts::default_endpoint;
use minicri_store::registry::dest::Trusted;
use minicri_store::registry::{
    Credentials, FetchedManifest, MAX_EXCERPT_CHARS, MAX_MANIFEST_BYTES, MAX_TOKEN_BYTES, Registry,
    realm_may_be_asked, realm_may_get_credentials,
};
use minicri_store::{Digest, ErrorKind, Reference, RegistryHosts, StoreError};
use minicri_tests::far_host::FarHost;
use minicri_tests::tripwire::Tripwire;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One request as the fake server saw it.
#[derive(Debug, Clone)]
struct Seen {
    path: String,
    authorization: Option<String>,
    /// Every header, names lower-case.
    headers: Vec<(String, String)>,
    body: String,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// What to answer: status, extra headers, body, a pause before anything is sent, and a pause
/// between body bytes (a trickle).
#[derive(Clone)]
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// Send the body with Content-Length (else close-delimited).
    length: bool,
    delay: Option<Duration>,
    trickle: Option<Duration>,
}

impl Reply {
    fn ok(body: impl Into<Vec<u8>>) -> Reply {
        Reply {
            status: 200,
            headers: vec![],
            body: body.into(),
            length: true,
            delay: None,
            trickle: None,
        }
    }

    fn status(mut self, status: u16) -> Reply {
        self.status = status;
        self
    }

    /// One body byte every `every`.
    fn trickled(mut self, every: Duration) -> Reply {
        self.trickle = Some(every);
        self
    }

    fn header(mut self, name: &str, value: impl Into<String>) -> Reply {
        self.headers.push((name.into(), value.into()));
        self
    }
}

type Handler = Arc<dyn Fn(&Seen) -> Reply + Send + Sync>;

struct Server {
    addr: String,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Server {
    async fn start(ip: &str, handler: impl Fn(&Seen) -> Reply + Send + Sync + 'static) -> Server {
        let listener = std::net::TcpListener::bind((ip, 0)).unwrap();
        Server::start_on(listener, handler)
    }

    /// Serves `listener` (bound already: in another network namespace, say).
    fn start_on(
        listener: std::net::TcpListener,
        handler: impl Fn(&Seen) -> Reply + Send + Sync + 'static,
    ) -> Server {
        listener.set_nonblocking(true).unwrap();
        let listener = TcpListener::from_std(listener).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let handler: Handler = Arc::new(handler);
        let s = seen.clone();
        tokio::spawn(async move {
            loop {
                let Ok((conn, _)) = listener.accept().await else {
                    return;
                };
                let (h, s) = (handler.clone(), s.clone());
                tokio::spawn(async move {
                    let _ = serve(conn, h, s).await;
                });
            }
        });
        Server { addr, seen }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn port(&self) -> &str {
        self.addr.rsplit_once(':').unwrap().1
    }
}

async fn serve(
    mut conn: TcpStream,
    h: Handler,
    seen: Arc<Mutex<Vec<Seen>>>,
) -> std::io::Result<()> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let path = lines
        .next()
        .unwrap_or("")
        .split(' ')
        .nth(1)
        .unwrap_or("")
        .to_string();
    let mut authorization = None;
    let mut length = 0usize;
    let mut headers = Vec::new();
    for l in lines {
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
            match k.trim().to_ascii_lowercase().as_str() {
                "authorization" => authorization = Some(v.trim().to_string()),
                "content-length" => length = v.trim().parse().unwrap_or(0),
                _ => {}
            }
        }
    }
    let mut body = buf[head_end..].to_vec();
    while body.len() < length {
        let n = conn.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    let req = Seen {
        path,
        authorization,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    };
    seen.lock().unwrap().push(req.clone());
    let r = h(&req);
    if let Some(d) = r.delay {
        tokio::time::sleep(d).await;
    }
    let mut out = format!("HTTP/1.1 {} X\r\nConnection: close\r\n", r.status);
    for (k, v) in &r.headers {
        out.push_str(&format!("{k}: {v}\r\n"));
    }
    if r.length {
        out.push_str(&format!("Content-Length: {}\r\n", r.body.len()));
    }
    out.push_str("\r\n");
    conn.write_all(out.as_bytes()).await?;
    match r.trickle {
        None => conn.write_all(&r.body).await?,
        Some(every) => {
            for b in &r.body {
                conn.write_all(&[*b]).await?;
                tokio::time::sleep(every).await;
            }
        }
    }
    conn.shutdown().await
}

const MANIFEST: &str = r#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a","size":2},"layers":[]}"#;

fn manifest_reply() -> Reply {
    Reply::ok(MANIFEST).header("Content-Type", "application/vnd.oci.image.manifest.v1+json")
}

/// Answers the `/v2/` ping with 200 and manifests with `manifest`.
fn open_registry(manifest: impl Fn() -> Reply + Send + Sync + 'static) -> impl Fn(&Seen) -> Reply {
    move |req| {
        if req.path.contains("/manifests/") {
            manifest()
        } else {
            Reply::ok("{}")
        }
    }
}

fn reference(addr: &str) -> Reference {
    Reference::parse(&format!("{addr}/app:v1")).unwrap()
}

fn creds(addr: &str) -> Credentials {
    Credentials {
        username: "user".into(),
        password: "secret".into(),
        server_address: addr.to_string(),
        ..Default::default()
    }
}

fn identity(addr: &str) -> Credentials {
    Credentials {
        identity_token: "refresh-me".into(),
        server_address: addr.to_string(),
        ..Default::default()
    }
}

async fn fetch(
    registry: &Registry,
    addr: &str,
    c: &Credentials,
) -> Result<FetchedManifest, StoreError> {
    let r = reference(addr);
    let session = registry.session(&r, c).unwrap();
    session
        .manifest(None)
        .await
        .map_err(|e| session.fold_errors("manifest", e))
}

fn registry() -> Registry {
    Registry::new(RegistryHosts::new(None))
}

/// Runs `f`, failing the test unless it is over within `limit` (whatever it returns).
async fn within<T>(limit: Duration, f: impl Future<Output = T>) -> T {
    let start = Instant::now();
    let out = f.await;
    assert!(start.elapsed() < limit, "took {:?}", start.elapsed());
    out
}

/// An anonymous fetch with a 1 s request deadline, which must fail within 10 s as unavailable
/// because `what` took longer.
async fn fetch_past_the_deadline(addr: &str, what: &str) {
    let reg = registry().with_request_deadline(Duration::from_secs(1));
    let err = within(
        Duration::from_secs(10),
        fetch(&reg, addr, &Credentials::default()),
    )
    .await
    .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    let msg = err.to_string();
    assert!(msg.contains(&format!("{what} took longer")), "{msg}");
    assert!(msg.contains("registry.request_timeout"), "{msg}");
}

#[tokio::test]
async fn a_manifest_over_the_cap_is_refused() {
    // Padding after the JSON object is whitespace: still a valid manifest, only too large.
    let mut big = MANIFEST.as_bytes().to_vec();
    big.resize((MAX_MANIFEST_BYTES + 4096) as usize, b' ');
    for length in [true, false] {
        let body = big.clone();
        let server = Server::start(
            "127.0.0.1",
            open_registry(move || {
                let mut r = Reply::ok(body.clone());
                r.length = length;
                r
            }),
        )
        .await;
        let err = fetch(&registry(), &server.addr, &Credentials::default())
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{err}");
        assert!(err.to_string().contains("exceeds the limit"), "{err}");
    }
}

#[tokio::test]
async fn a_manifest_at_the_cap_is_fine() {
    let mut body = MANIFEST.as_bytes().to_vec();
    body.resize(MAX_MANIFEST_BYTES as usize, b' ');
    let server = Server::start("127.0.0.1", open_registry(move || Reply::ok(body.clone()))).await;
    let m = fetch(&registry(), &server.addr, &Credentials::default())
        .await
        .unwrap();
    assert_eq!(m.bytes.len() as u64, MAX_MANIFEST_BYTES);
}

#[tokio::test]
async fn a_trickled_manifest_hits_the_request_deadline() {
    // ~230 bytes at one per 200 ms: under the 30 s read timeout forever, 46 s in all.
    let server = Server::start(
        "127.0.0.1",
        open_registry(|| manifest_reply().trickled(Duration::from_millis(200))),
    )
    .await;
    fetch_past_the_deadline(&server.addr, "manifest request").await;
}

/// A registry whose challenge sends clients to the token service at `realm_ip`, which answers
/// with `token_reply`; the registry serves the manifest for `Bearer tok`.
async fn token_setup(
    realm_ip: &str,
    token_reply: impl Fn() -> Reply + Send + Sync + 'static,
) -> (Server, Server) {
    let realm = std::net::TcpListener::bind((realm_ip, 0)).unwrap();
    token_setup_on(realm, token_reply).await
}

/// [`token_setup`] with the token service on `realm`.
async fn token_setup_on(
    realm: std::net::TcpListener,
    token_reply: impl Fn() -> Reply + Send + Sync + 'static,
) -> (Server, Server) {
    let token = Server::start_on(realm, move |_| token_reply());
    let realm = format!("http://{}/token", token.addr);
    let server = Server::start("127.0.0.1", move |req| {
        if req.authorization.as_deref() != Some("Bearer tok") {
            Reply::ok("").status(401).header(
                "WWW-Authenticate",
                format!(r#"Bearer realm="{realm}",service="reg""#),
            )
        } else {
            manifest_reply()
        }
    })
    .await;
    (server, token)
}

fn good_token() -> Reply {
    Reply::ok(r#"{"token":"tok"}"#)
}

#[tokio::test]
async fn a_trickled_token_response_hits_the_request_deadline() {
    // The token request is part of the manifest request that met the challenge, and within
    // its deadline.
    let (server, _token) = token_setup("127.0.0.1", || {
        Reply::ok(format!(r#"{{"token":"tok","pad":"{}"}}"#, "x".repeat(500)))
            .trickled(Duration::from_millis(200))
    })
    .await;
    fetch_past_the_deadline(&server.addr, "manifest request").await;
}

#[tokio::test]
async fn a_blob_request_whose_answer_never_comes_hits_the_request_deadline() {
    // No header for 40 s: past the deadline, and past the 30 s read timeout too.
    let server = Server::start("127.0.0.1", |req| {
        let mut r = Reply::ok("{}");
        if req.path.contains("/blobs/") {
            r.delay = Some(Duration::from_secs(40));
        }
        r
    })
    .await;
    let reg = registry().with_request_deadline(Duration::from_secs(1));
    let session = reg
        .session(&reference(&server.addr), &Credentials::default())
        .unwrap();
    let digest = Digest::of(b"{}");
    let err = within(Duration::from_secs(10), session.blob(&digest, 0, 2, None))
        .await
        .err()
        .expect("the blob request fails");
    let err = session.fold_errors("blob", err);
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(
        err.to_string().contains("blob request took longer"),
        "{err}"
    );
}

#[tokio::test]
async fn a_huge_token_response_is_refused() {
    // Every token response (an identity-token exchange, a token bought with basic credentials,
    // an anonymous one) is read within MAX_TOKEN_BYTES, with or without a Content-Length.
    for length in [true, false] {
        let (server, token) = token_setup("127.0.0.1", move || {
            let mut r = Reply::ok(vec![b'x'; (MAX_TOKEN_BYTES * 2) as usize]);
            r.length = length;
            r
        })
        .await;
        let addr = server.addr.clone();
        for c in [identity(&addr), creds(&addr), Credentials::default()] {
            let err = fetch(&registry(), &server.addr, &c).await.unwrap_err();
            assert!(err.to_string().contains("exceeds the limit"), "{err}");
        }
        assert_eq!(token.seen().len(), 3);
    }
}

/// Pulls from a registry whose token realm listens on `realm`, once with basic credentials, once
/// with an identity token (both pulls must work: a public image still pulls anonymously); returns
/// the two requests the token service received.
async fn token_requests_with_credentials(realm: std::net::TcpListener) -> Vec<Seen> {
    let (server, token) = token_setup_on(realm, good_token).await;
    for c in [creds(&server.addr), identity(&server.addr)] {
        fetch(&registry(), &server.addr, &c).await.unwrap();
    }
    let seen = token.seen();
    assert_eq!(seen.len(), 2, "{seen:?}");
    seen
}

#[tokio::test]
async fn credentials_go_to_a_realm_on_the_registry_host() {
    let realm = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let seen = token_requests_with_credentials(realm).await;
    let basic = seen[0].authorization.as_deref();
    assert!(basic.is_some_and(|a| a.starts_with("Basic ")), "{seen:?}");
    assert!(
        seen[1].body.contains("refresh_token=refresh-me"),
        "{seen:?}"
    );
}

#[tokio::test]
async fn credentials_never_go_to_a_realm_on_another_host() {
    if minicri_tests::prereq::skip_unless_root() {
        return;
    }
    // A realm on another host than the registry's 127.0.0.1 (and not on the node: one there
    // is not asked at all): both token requests are anonymous.
    let far = FarHost::create().unwrap();
    let seen = token_requests_with_credentials(far.listen(0).unwrap()).await;
    for s in &seen {
        assert_eq!(s.authorization, None, "{seen:?}");
        assert!(
            !s.body.contains("refresh-me") && !s.path.contains("refresh-me"),
            "{seen:?}"
        );
    }
}

/// A registry that wants HTTP basic auth for everything.
fn basic_registry(req: &Seen) -> Reply {
    match &req.authorization {
        Some(a) if a.starts_with("Basic ") => manifest_reply(),
        _ => Reply::ok("")
            .status(401)
            .header("WWW-Authenticate", r#"Basic realm="reg""#),
    }
}

/// A hosts directory sending `registry` to `server_url`.
fn hosts_dir(dir: &Path, registry: &str, server_url: &str) -> RegistryHosts {
    hosts_dir_with(dir, registry, server_url, "")
}

#[tokio::test]
async fn credentials_go_over_plain_http_only_to_a_loopback_ip() {
    let server = Server::start("127.0.0.1", basic_registry).await;
    // By IP literal: plain http is the default and the credentials go.
    fetch(&registry(), &server.addr, &creds(&server.addr))
        .await
        .unwrap();
    assert!(
        server.seen().iter().any(|s| s
            .authorization
            .as_deref()
            .is_some_and(|a| a.starts_with("Basic "))),
        "{:?}",
        server.seen()
    );
    // The same server by name, configured as http:// in hosts.toml: `localhost` is a name that
    // resolves through files the runtime does not own, so the credentials stay home.
    let before = server.seen().len();
    let name = format!("localhost:{}", server.port());
    let dir = tempfile::tempdir().unwrap();
    let hosts = hosts_dir(dir.path(), &name, &format!("http://{name}"));
    let err = fetch(&Registry::new(hosts), &name, &creds(&name))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unauthenticated, "{err}");
    assert!(err.to_string().contains("credentials withheld"), "{err}");
    let after = server.seen();
    assert!(after.len() > before, "the registry was asked: {after:?}");
    assert!(
        after[before..].iter().all(|s| s.authorization.is_none()),
        "{after:?}"
    );
}

#[tokio::test]
async fn an_error_body_does_not_flood_the_error_message() {
    // A 1 MiB body of lines, escape sequences and bidirectional overrides: what reaches the
    // message is one line, its first MAX_EXCERPT_CHARS characters.
    let mut body = b"first\r\n\x1b[31mred\x1b[0m\t\xe2\x80\xaeevil\n".to_vec();
    body.resize(1 << 20, b'e');
    let server = Server::start(
        "127.0.0.1",
        open_registry(move || Reply::ok(body.clone()).status(500)),
    )
    .await;
    let err = fetch(&registry(), &server.addr, &Credentials::default())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains(": 500 Internal Server Error: first [31mred [0m evil eee"),
        "{msg}"
    );
    assert!(msg.ends_with("… (cut)"), "{msg}");
    assert!(!msg.chars().any(char::is_control), "{msg:?}");
    assert!(!msg.contains('\u{202e}'), "{msg:?}");
    let quoted = msg.split("Internal Server Error: ").nth(1).unwrap();
    assert_eq!(
        quoted.chars().count(),
        MAX_EXCERPT_CHARS + "… (cut)".chars().count(),
        "{quoted}"
    );
}

#[tokio::test]
async fn distribution_errors_are_quoted_by_code_and_message() {
    let body = format!(
        r#"{{"errors":[{{"code":"UNAVAILABLE","message":"try\nlater","detail":{{"x":"{}"}}}},{{"code":"TOOMANYREQUESTS","message":"slow down"}}]}}"#,
        "d".repeat(4000)
    );
    let server = Server::start(
        "127.0.0.1",
        open_registry(move || Reply::ok(body.clone()).status(503)),
    )
    .await;
    let err = fetch(&registry(), &server.addr, &Credentials::default())
        .await
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.ends_with(
            ": 503 Service Unavailable: UNAVAILABLE try later; TOOMANYREQUESTS slow down"
        ),
        "{msg}"
    );
}

/// A hosts directory sending `registry` to `server_url` with the top-level `extra` lines (the
/// server's own settings).
fn hosts_dir_with(dir: &Path, registry: &str, server_url: &str, extra: &str) -> RegistryHosts {
    let d = dir.join(registry);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(
        d.join("hosts.toml"),
        format!("server = \"{server_url}\"\n{extra}"),
    )
    .unwrap();
    RegistryHosts::new(Some(dir.to_path_buf()))
}

#[tokio::test]
async fn hosts_toml_headers_go_to_the_host_and_nowhere_else() {
    // The registry wants its header on every request and a bearer token from a realm on its own
    // origin; blobs are redirected to a store on another origin (another port of the registry's
    // host, which the registry named by its loopback IP may send the daemon to).
    let store = Server::start("127.0.0.1", |_| Reply::ok("{}")).await;
    let store_url = format!("http://{}/signed/blob", store.addr);
    let realm_host = Arc::new(Mutex::new(String::new()));
    let realm = realm_host.clone();
    let server = Server::start("127.0.0.1", move |req| {
        if req.header("x-mirror-key") != Some("s3cret") {
            return Reply::ok("").status(403);
        }
        if req.path.starts_with("/token") {
            return good_token();
        }
        if req.authorization.as_deref() != Some("Bearer tok") {
            let realm = format!("http://{}/token", realm.lock().unwrap());
            return Reply::ok("").status(401).header(
                "WWW-Authenticate",
                format!(r#"Bearer realm="{realm}",service="reg""#),
            );
        }
        if req.path.contains("/blobs/") {
            return Reply::ok("")
                .status(307)
                .header("Location", store_url.clone());
        }
        manifest_reply()
    })
    .await;
    *realm_host.lock().unwrap() = server.addr.clone();
    let dir = tempfile::tempdir().unwrap();
    let hosts = hosts_dir_with(
        dir.path(),
        &server.addr,
        &format!("http://{}", server.addr),
        "[header]\n  X-Mirror-Key = \"s3cret\"\n  x-two = [\"a\", \"b\"]\n",
    );
    let reg = Registry::new(hosts);
    let session = reg
        .session(&reference(&server.addr), &Credentials::default())
        .unwrap();
    session.manifest(None).await.unwrap();
    let digest = Digest::of(b"{}");
    let Ok(body) = session.blob(&digest, 0, 2, None).await else {
        panic!("the blob request failed");
    };
    assert!(!body.resumed);
    let seen = server.seen();
    // Manifest (401), token, manifest, blob (redirected): each with the header, both values of
    // the list.
    assert_eq!(seen.len(), 4, "{seen:?}");
    for s in &seen {
        assert_eq!(s.header("x-mirror-key"), Some("s3cret"), "{s:?}");
        let twos: Vec<&str> = s
            .headers
            .iter()
            .filter(|(k, _)| k == "x-two")
            .map(|(_, v)| v.as_str())
            .collect();
        assert!(twos == ["a", "b"] || twos == ["a, b"], "{s:?}");
    }
    // The store got neither the header nor the token, but kept the Range.
    let at_store = store.seen();
    assert_eq!(at_store.len(), 1, "{at_store:?}");
    assert_eq!(at_store[0].header("x-mirror-key"), None, "{at_store:?}");
    assert_eq!(at_store[0].authorization, None, "{at_store:?}");
    assert_eq!(
        at_store[0].header("range"),
        Some("bytes=0-1"),
        "{at_store:?}"
    );

    // A realm on another origin gets no header.
    let (other, token) = token_setup("127.0.0.1", good_token).await;
    let dir = tempfile::tempdir().unwrap();
    let hosts = hosts_dir_with(
        dir.path(),
        &other.addr,
        &format!("http://{}", other.addr),
        "[header]\n  x-mirror-key = \"s3cret\"\n",
    );
    fetch(&Registry::new(hosts), &other.addr, &Credentials::default())
        .await
        .unwrap();
    assert!(
        other
            .seen()
            .iter()
            .all(|s| s.header("x-mirror-key") == Some("s3cret"))
    );
    let t = token.seen();
    assert_eq!(t.len(), 1, "{t:?}");
    assert_eq!(t[0].header("x-mirror-key"), None, "{t:?}");
}

#[tokio::test]
async fn requests_refused_at_once_share_one_token() {
    // Four blob requests meet the 401 together: one token request answers them all.
    let (server, token) = token_setup("127.0.0.1", || {
        let mut r = good_token();
        r.delay = Some(Duration::from_millis(200));
        r
    })
    .await;
    let session = registry()
        .session(&reference(&server.addr), &Credentials::default())
        .unwrap();
    let digest = Digest::of(b"{}");
    let opened = futures::future::join_all((0..4).map(|_| session.blob(&digest, 0, 2, None))).await;
    assert!(opened.iter().all(Result::is_ok));
    assert_eq!(token.seen().len(), 1, "{:?}", token.seen());
    // Four refused, four retried with the token.
    assert_eq!(server.seen().len(), 8, "{:?}", server.seen());
}

#[test]
fn missing_or_bad_tls_files_are_configuration_errors_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("junk.pem"), "not a certificate").unwrap();
    for (settings, file, want) in [
        (
            "ca = \"absent-ca.pem\"\n",
            "absent-ca.pem",
            "reading CA certificate",
        ),
        (
            "client = \"absent.pem\"\n",
            "absent.pem",
            "reading client certificate",
        ),
        (
            "client = [[\"../junk.pem\", \"absent.key\"]]\n",
            "absent.key",
            "reading client key",
        ),
        (
            "client = \"../junk.pem\"\n",
            "junk.pem",
            "not a PEM certificate and private key",
        ),
    ] {
        let hosts = hosts_dir_with(dir.path(), "r.example", "https://r.example", settings);
        let err = Registry::new(hosts)
            .session(
                &Reference::parse("r.example/app:v1").unwrap(),
                &Credentials::default(),
            )
            .err()
            .expect("refused");
        // The node's own configuration is broken: not the caller's to fix.
        assert_eq!(err.kind(), ErrorKind::Internal, "{settings}: {err}");
        let msg = err.to_string();
        assert!(
            msg.contains(file) && msg.contains(want),
            "{settings}: {msg}"
        );
    }
}

#[tokio::test]
async fn a_partial_answer_that_starts_elsewhere_is_refused() {
    let server = Server::start("127.0.0.1", |req| {
        if req.path.contains("/blobs/") {
            Reply::ok("}")
                .status(206)
                .header("Content-Range", "bytes 0-1/2")
        } else {
            Reply::ok("{}")
        }
    })
    .await;
    let session = registry()
        .session(&reference(&server.addr), &Credentials::default())
        .unwrap();
    let err = session
        .blob(&Digest::of(b"{}"), 1, 1, None)
        .await
        .err()
        .expect("refused");
    let err = session.fold_errors("blob", err);
    assert!(err.to_string().contains("starting at Some(0)"), "{err}");
}

/// A registry reached over https cannot send the daemon to a plain-http token realm (a cloud's
/// metadata service, say, whose error answers a failed token request would quote), unless the
/// realm is a loopback IP literal the session trusts (a hosts.toml endpoint there); a
/// plain-http registry may, as may any https realm.
#[test]
fn plain_http_realms_are_asked_only_for_plain_http_registries() {
    let u = |s: &str| reqwest::Url::parse(s).unwrap();
    let endpoint = |host: &str, plain_http: bool| minicri_store::hosts::Endpoint {
        plain_http,
        ..default_endpoint(host)
    };
    let tls = u("https://registry.example/v2/a/manifests/1");
    let tls_trusts = Trusted::new(
        "registry.example",
        &[
            endpoint("127.0.0.1:5001", true),
            endpoint("registry.example", false),
        ],
    );
    let plain = u("http://10.0.0.5:5000/v2/a/manifests/1");
    let plain_trusts = Trusted::new("10.0.0.5:5000", &[endpoint("10.0.0.5:5000", true)]);
    let metadata = u("http://169.254.169.254/latest/meta-data/iam/security-credentials/");
    let err = realm_may_be_asked(&metadata, &tls, &tls_trusts).unwrap_err();
    assert!(
        err.contains("refusing the token realm http://169.254.169.254/"),
        "{err}"
    );
    // Its address says the most about why.
    assert!(err.contains("link-local"), "{err}");
    let err = realm_may_be_asked(&u("http://auth.example/token"), &tls, &tls_trusts).unwrap_err();
    assert!(err.contains("plain http"), "{err}");
    for refused in [
        "http://auth.example/token",
        "http://127.0.0.1:5002/token",
        "http://[::1]:5001/token",
    ] {
        realm_may_be_asked(&u(refused), &tls, &tls_trusts).unwrap_err();
    }
    realm_may_be_asked(&u("https://auth.example/token"), &tls, &tls_trusts).unwrap();
    realm_may_be_asked(&u("http://127.0.0.1:5001/token"), &tls, &tls_trusts).unwrap();
    realm_may_be_asked(&u("http://10.0.0.5:5001/token"), &plain, &plain_trusts).unwrap();
    realm_may_be_asked(&u("https://auth.example/token"), &plain, &plain_trusts).unwrap();
}

#[test]
fn realm_rules() {
    let allowed = vec!["registry-1.docker.io".to_string(), "docker.io".to_string()];
    assert!(realm_may_get_credentials(
        "https://auth.docker.io/token",
        &allowed
    ));
    assert!(
        !realm_may_get_credentials("http://auth.docker.io/token", &allowed),
        "plain http"
    );
    assert!(!realm_may_get_credentials(
        "https://evil.example/token",
        &allowed
    ));
    assert!(!realm_may_get_credentials(
        "https://docker.io.evil.example/t",
        &allowed
    ));
    let gitlab = vec!["registry.gitlab.com".to_string()];
    assert!(realm_may_get_credentials(
        "https://gitlab.com/jwt/auth",
        &gitlab
    ));
    let two = vec!["example.com:5000".to_string()];
    assert!(realm_may_get_credentials("https://example.com/token", &two));
    assert!(
        !realm_may_get_credentials("https://other.com/token", &two),
        "no bare TLD site"
    );
    let ip = vec!["127.0.0.1:5000".to_string()];
    assert!(realm_may_get_credentials(
        "http://127.0.0.1:5001/token",
        &ip
    ));
    assert!(!realm_may_get_credentials(
        "http://127.0.0.2:5001/token",
        &ip
    ));
    let name = vec!["localhost:5000".to_string()];
    assert!(
        !realm_may_get_credentials("http://localhost:5001/token", &name),
        "plain http to a name"
    );
    let v6 = vec!["[::1]:5000".to_string()];
    assert!(realm_may_get_credentials("http://[::1]:9/token", &v6));
    assert!(!realm_may_get_credentials("not a url", &ip));
    assert!(!realm_may_get_credentials("ftp://127.0.0.1/token", &ip));
}

/// Where on the node a registry may try to send the client, at `port` (and at the node's
/// address `near`): the URLs the tests below try as redirect and as realm.
fn node_targets(port: u16, near: Option<std::net::Ipv4Addr>) -> Vec<String> {
    let mut v: Vec<String> = [
        "127.0.0.1",
        "127.0.0.2",
        "localhost",
        "[::1]",
        "0.0.0.0",
        "[::ffff:127.0.0.1]",
    ]
    .iter()
    .map(|h| format!("http://{h}:{port}/x"))
    .collect();
    if let Some(ip) = near {
        v.push(format!("http://{ip}:{port}/x"));
    }
    v
}

/// A registry that redirects manifest requests to `target`, or, with `realm`, challenges every
/// request without a token with a bearer realm at `target`.
fn pointing_registry(target: Arc<Mutex<(String, bool)>>) -> impl Fn(&Seen) -> Reply {
    move |req| {
        let (to, realm) = target.lock().unwrap().clone();
        if realm && req.authorization.is_none() {
            Reply::ok("").status(401).header(
                "WWW-Authenticate",
                format!(r#"Bearer realm="{to}",service="r""#),
            )
        } else if realm {
            manifest_reply()
        } else if req.path.contains("/manifests/") {
            Reply::ok("").status(307).header("Location", to)
        } else {
            Reply::ok("{}")
        }
    }
}

/// Fetches the manifest of the image at `addr` with `reg`, `target` set to each of `targets` as
/// redirect and as realm: every one is refused with a message naming it, and none reaches the
/// node (`wire`).
async fn each_node_target_is_refused(
    reg: &Registry,
    addr: &str,
    target: &Mutex<(String, bool)>,
    targets: &[String],
    wire: &Tripwire,
) {
    for realm in [false, true] {
        for t in targets {
            *target.lock().unwrap() = (t.clone(), realm);
            let err = fetch(reg, addr, &Credentials::default()).await.unwrap_err();
            assert_eq!(err.kind(), ErrorKind::FailedPrecondition, "{t}: {err}");
            let msg = err.to_string();
            let what = if realm {
                "the token realm"
            } else {
                "the redirect to"
            };
            assert!(
                msg.contains(&format!("refusing {what} http://")),
                "{t}: {msg}"
            );
            assert!(
                msg.contains("on the node") || msg.contains("address"),
                "{t}: {msg}"
            );
        }
    }
    assert_eq!(wire.hits(), 0, "a request reached the node");
}

#[tokio::test]
async fn a_registry_elsewhere_cannot_send_the_client_to_the_node() {
    if minicri_tests::prereq::skip_unless_root() {
        return;
    }
    // A plain-http registry on another host (a network namespace), configured in hosts.toml:
    // no https-to-http rule is involved, only where the addresses are.
    let far = FarHost::create().unwrap();
    let wire = Tripwire::start();
    let target = Arc::new(Mutex::new((String::new(), false)));
    let server = Server::start_on(far.listen(0).unwrap(), pointing_registry(target.clone()));
    let dir = tempfile::tempdir().unwrap();
    let hosts = hosts_dir(dir.path(), &server.addr, &format!("http://{}", server.addr));
    let reg = Registry::new(hosts);
    let targets = node_targets(wire.port(), Some(far.near_ip()));
    each_node_target_is_refused(&reg, &server.addr, &target, &targets, &wire).await;

    // The positive control: a redirect and a realm on another host off the node are followed.
    let elsewhere = Server::start_on(far.listen(0).unwrap(), |req| {
        if req.path.starts_with("/token") {
            good_token()
        } else {
            manifest_reply()
        }
    });
    for realm in [false, true] {
        let path = if realm {
            "token"
        } else {
            "v2/app/manifests/v1"
        };
        *target.lock().unwrap() = (format!("http://{}/{path}", elsewhere.addr), realm);
        fetch(&reg, &server.addr, &Credentials::default())
            .await
            .unwrap();
    }
    assert_eq!(elsewhere.seen().len(), 2, "{:?}", elsewhere.seen());
}

#[tokio::test]
async fn a_registry_named_on_loopback_reaches_other_ports_of_its_host_only() {
    // Registry 127.0.0.1:P: another port of 127.0.0.1 is its own host (whoever names the image
    // could name that port directly); other loopback hosts and names are not.
    let wire = Tripwire::start();
    let target = Arc::new(Mutex::new((String::new(), false)));
    let server = Server::start("127.0.0.1", pointing_registry(target.clone())).await;
    let targets: Vec<String> = node_targets(wire.port(), None)
        .into_iter()
        .filter(|t| !t.starts_with("http://127.0.0.1:"))
        .collect();
    each_node_target_is_refused(&registry(), &server.addr, &target, &targets, &wire).await;
    let own = Server::start("127.0.0.1", |req| {
        if req.path.starts_with("/token") {
            good_token()
        } else {
            manifest_reply()
        }
    })
    .await;
    for realm in [false, true] {
        let path = if realm {
            "token"
        } else {
            "v2/app/manifests/v1"
        };
        *target.lock().unwrap() = (format!("http://{}/{path}", own.addr), realm);
        fetch(&registry(), &server.addr, &Credentials::default())
            .await
            .unwrap();
    }
    assert_eq!(own.seen().len(), 2, "{:?}", own.seen());
}

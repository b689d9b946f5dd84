//! A registry (and token service) that misbehaves on purpose, served from this test on loopback:
//! oversized manifests and token responses, bytes trickled under the read timeout, and token
//! realms on hosts the credentials were not given for.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use minicri_store::registry::{
    Credentials, MAX_MANIFEST_BYTES, Registry, realm_may_get_credentials,
};
use minicri_store::{ErrorKind, Reference, RegistryHosts};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One request as the fake server saw it.
#[derive(Debug, Clone)]
struct Seen {
    path: String,
    authorization: Option<String>,
    body: String,
}

/// What to answer: status, extra headers, body, and a pause between body bytes (a trickle).
#[derive(Clone)]
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// Send the body with Content-Length (else close-delimited).
    length: bool,
    trickle: Option<Duration>,
}

impl Reply {
    fn ok(body: impl Into<Vec<u8>>) -> Reply {
        Reply {
            status: 200,
            headers: vec![],
            body: body.into(),
            length: true,
            trickle: None,
        }
    }
}

type Handler = Arc<dyn Fn(&Seen) -> Reply + Send + Sync>;

struct Server {
    addr: String,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Server {
    async fn start(ip: &str, handler: impl Fn(&Seen) -> Reply + Send + Sync + 'static) -> Server {
        let listener = TcpListener::bind((ip, 0)).await.unwrap();
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
    for l in lines {
        if let Some((k, v)) = l.split_once(':') {
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
        body: String::from_utf8_lossy(&body).into_owned(),
    };
    seen.lock().unwrap().push(req.clone());
    let r = h(&req);
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
    let mut r = Reply::ok(MANIFEST);
    r.headers.push((
        "Content-Type".into(),
        "application/vnd.oci.image.manifest.v1+json".into(),
    ));
    r
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

async fn fetch(
    registry: &Registry,
    addr: &str,
    c: &Credentials,
) -> Result<minicri_store::registry::FetchedManifest, minicri_store::StoreError> {
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

#[tokio::test]
async fn manifest_over_the_cap_is_refused_while_it_is_read() {
    let big = vec![b' '; (MAX_MANIFEST_BYTES + 4096) as usize];
    for length in [true, false] {
        let body = big.clone();
        let server = Server::start("127.0.0.1", move |req| {
            if req.path.contains("/manifests/") {
                let mut r = Reply::ok(body.clone());
                r.length = length;
                r
            } else {
                Reply::ok("{}")
            }
        })
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
    // Padding after the JSON object is whitespace, still a valid manifest.
    let mut body = MANIFEST.as_bytes().to_vec();
    body.resize(MAX_MANIFEST_BYTES as usize, b' ');
    let server = Server::start("127.0.0.1", move |req| {
        if req.path.contains("/manifests/") {
            Reply::ok(body.clone())
        } else {
            Reply::ok("{}")
        }
    })
    .await;
    let m = fetch(&registry(), &server.addr, &Credentials::default())
        .await
        .unwrap();
    assert_eq!(m.bytes.len() as u64, MAX_MANIFEST_BYTES);
}

#[tokio::test]
async fn a_trickled_manifest_hits_the_request_deadline() {
    let server = Server::start("127.0.0.1", |req| {
        if req.path.contains("/manifests/") {
            let mut r = manifest_reply();
            r.trickle = Some(Duration::from_millis(200));
            r
        } else {
            Reply::ok("{}")
        }
    })
    .await;
    let reg = registry().with_request_deadline(Duration::from_secs(1));
    let start = Instant::now();
    let err = fetch(&reg, &server.addr, &Credentials::default())
        .await
        .unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(
        err.to_string().contains("registry_request_timeout"),
        "{err}"
    );
}

#[tokio::test]
async fn a_huge_token_response_is_refused() {
    let token = Server::start("127.0.0.1", |_| Reply::ok(vec![b'x'; 2 << 20])).await;
    let realm = format!("http://{}/token", token.addr);
    let server = Server::start("127.0.0.1", move |req| {
        if req.authorization.is_none() {
            let mut r = Reply::ok("");
            r.status = 401;
            r.headers.push((
                "WWW-Authenticate".into(),
                format!(r#"Bearer realm="{realm}",service="reg""#),
            ));
            r
        } else {
            manifest_reply()
        }
    })
    .await;
    let err = fetch(&registry(), &server.addr, &Credentials::default())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("exceeds the limit"), "{err}");
}

/// A registry whose challenge sends clients to the token service `realm_ip`.
async fn token_setup(realm_ip: &str) -> (Server, Server) {
    let token = Server::start(realm_ip, |_| Reply::ok(r#"{"token":"tok"}"#)).await;
    let realm = format!("http://{}/token", token.addr);
    let server = Server::start("127.0.0.1", move |req| {
        if req.authorization.as_deref() != Some("Bearer tok") {
            let mut r = Reply::ok("");
            r.status = 401;
            r.headers.push((
                "WWW-Authenticate".into(),
                format!(r#"Bearer realm="{realm}",service="reg""#),
            ));
            r
        } else {
            manifest_reply()
        }
    })
    .await;
    (server, token)
}

#[tokio::test]
async fn credentials_go_to_a_realm_on_the_registry_host() {
    let (server, token) = token_setup("127.0.0.1").await;
    fetch(&registry(), &server.addr, &creds(&server.addr))
        .await
        .unwrap();
    let seen = token.seen();
    assert_eq!(seen.len(), 1);
    assert!(
        seen[0]
            .authorization
            .as_deref()
            .is_some_and(|a| a.starts_with("Basic ")),
        "{seen:?}"
    );
}

#[tokio::test]
async fn credentials_never_go_to_a_realm_on_another_host() {
    // 127.0.0.2 is loopback too, but another host than the registry's 127.0.0.1.
    let (server, token) = token_setup("127.0.0.2").await;
    // Anonymous token: the pull still works for a public image.
    fetch(&registry(), &server.addr, &creds(&server.addr))
        .await
        .unwrap();
    let seen = token.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].authorization, None, "{seen:?}");
    // Nor an identity (refresh) token.
    let c = Credentials {
        identity_token: "refresh-me".into(),
        server_address: server.addr.clone(),
        ..Default::default()
    };
    fetch(&registry(), &server.addr, &c).await.unwrap();
    let seen = token.seen();
    assert!(
        seen.iter()
            .all(|s| !s.body.contains("refresh-me") && !s.path.contains("refresh-me")),
        "{seen:?}"
    );
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
    let v6 = vec!["[::1]:5000".to_string()];
    assert!(realm_may_get_credentials("http://[::1]:9/token", &v6));
    assert!(!realm_may_get_credentials("not a url", &ip));
    assert!(!realm_may_get_credentials("ftp://127.0.0.1/token", &ip));
}

//! Tests of the minimal test API server (`minicri_tests::apiserver`) with a plain reqwest client:
//! lists with field selectors, watch replay and live events, the 410 after a compaction,
//! bookmarks, streaming lists, timeouts, and the outage switches.

use std::time::{Duration, Instant};

use minicri_tests::apiserver::{ApiServer, ApiServerOptions};
use serde_json::Value;

fn http() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

async fn get_json(server: &ApiServer, path_and_query: &str) -> (u16, Value) {
    let resp = http()
        .get(format!("{}{path_and_query}", server.url()))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let body: Value = serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap();
    (status, body)
}

fn names(list: &Value) -> Vec<String> {
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["metadata"]["name"].as_str().unwrap().to_string())
        .collect()
}

/// Reads a watch response one event (line) at a time.
struct Watch {
    resp: reqwest::Response,
    buf: Vec<u8>,
}

#[derive(Debug)]
enum Next {
    Event(Value),
    /// The stream ended cleanly.
    End,
    /// Nothing within the wait.
    Nothing,
    /// The stream broke (connection cut).
    Broken,
}

impl Watch {
    async fn open(server: &ApiServer, query: &str) -> Watch {
        let resp = http()
            .get(format!("{}/api/v1/pods?watch=true&{query}", server.url()))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200, "watch {query}");
        Watch {
            resp,
            buf: Vec::new(),
        }
    }

    async fn next(&mut self, wait: Duration) -> Next {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if let Some(i) = self.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=i).collect();
                return Next::Event(serde_json::from_slice(&line).unwrap());
            }
            match tokio::time::timeout_at(deadline, self.resp.chunk()).await {
                Err(_) => return Next::Nothing,
                Ok(Ok(Some(chunk))) => self.buf.extend_from_slice(&chunk),
                Ok(Ok(None)) => {
                    assert!(self.buf.is_empty(), "a partial line at the end");
                    return Next::End;
                }
                Ok(Err(_)) => return Next::Broken,
            }
        }
    }

    /// The next event, which must come within 5 s.
    async fn event(&mut self) -> Value {
        match self.next(Duration::from_secs(5)).await {
            Next::Event(v) => v,
            other => panic!("expected a watch event, got {other:?}"),
        }
    }
}

fn summary(event: &Value) -> (String, String) {
    (
        event["type"].as_str().unwrap().to_string(),
        event["object"]["metadata"]["name"]
            .as_str()
            .unwrap_or("")
            .to_string(),
    )
}

fn ev(kind: &str, name: &str) -> (String, String) {
    (kind.to_string(), name.to_string())
}

#[tokio::test]
async fn list_filters_by_node_and_namespace() {
    let server = ApiServer::start().unwrap();
    server.add_pod("ns1", "a1", "uid-a1", "node-a");
    server.add_pod("ns2", "a2", "uid-a2", "node-a");
    server.add_pod("ns1", "b1", "uid-b1", "node-b");
    server.mark_deleted("uid-a2");

    let (status, list) =
        get_json(&server, "/api/v1/pods?fieldSelector=spec.nodeName%3Dnode-a").await;
    assert_eq!(status, 200);
    assert_eq!(list["kind"], "PodList");
    assert_eq!(list["apiVersion"], "v1");
    assert_eq!(
        list["metadata"]["resourceVersion"].as_str().unwrap(),
        server.resource_version().to_string()
    );
    assert_eq!(names(&list), vec!["a1", "a2"]);
    let a2 = &list["items"][1];
    assert_eq!(a2["kind"], "Pod");
    assert_eq!(a2["apiVersion"], "v1");
    assert_eq!(a2["metadata"]["uid"], "uid-a2");
    assert_eq!(a2["metadata"]["namespace"], "ns2");
    assert_eq!(a2["spec"]["nodeName"], "node-a");
    assert!(a2["spec"]["containers"][0]["name"].is_string());
    assert!(a2["metadata"]["deletionTimestamp"].is_string());
    assert!(list["items"][0]["metadata"]["deletionTimestamp"].is_null());
    assert!(list["metadata"]["continue"].is_null());

    let (_, list) = get_json(
        &server,
        "/api/v1/pods?fieldSelector=spec.nodeName%3D%3Dnode-b&limit=1",
    )
    .await;
    assert_eq!(names(&list), vec!["b1"]);
    let (_, list) = get_json(
        &server,
        "/api/v1/namespaces/ns1/pods?fieldSelector=spec.nodeName%3Dnode-a",
    )
    .await;
    assert_eq!(names(&list), vec!["a1"]);
    let (_, list) = get_json(
        &server,
        "/api/v1/pods?limit=1&resourceVersion=0&resourceVersionMatch=NotOlderThan",
    )
    .await;
    assert_eq!(names(&list), vec!["a1", "b1", "a2"], "limit is ignored");

    let (status, body) =
        get_json(&server, "/api/v1/pods?fieldSelector=status.phase%3DRunning").await;
    assert_eq!(status, 400);
    assert_eq!(body["kind"], "Status");
    assert_eq!(body["code"], 400);
    let rv = server.resource_version();
    let (status, body) =
        get_json(&server, &format!("/api/v1/pods?resourceVersion={}", rv + 5)).await;
    assert_eq!((status, body["code"].as_u64()), (504, Some(504)));
    let (status, _) = get_json(&server, "/api/v1/nodes").await;
    assert_eq!(status, 404);
    let (status, pod) = get_json(&server, "/api/v1/namespaces/ns1/pods/b1").await;
    assert_eq!(
        (status, pod["metadata"]["uid"].as_str()),
        (200, Some("uid-b1"))
    );

    assert_eq!(server.list_calls(), 6);
    assert_eq!(server.watch_calls(), 0);
    let first = &server.requests()[0];
    assert_eq!(first.path, "/api/v1/pods");
    assert_eq!(first.query, "fieldSelector=spec.nodeName%3Dnode-a");
    assert_eq!(first.status, 200);
}

#[tokio::test]
async fn watch_replays_history_then_follows_live_events_of_its_node() {
    let server = ApiServer::start().unwrap();
    server.add_pod("ns", "early", "uid-early", "node-a");
    let from = server.resource_version();
    server.add_pod("ns", "a", "uid-a", "node-a");
    server.add_pod("ns", "b", "uid-b", "node-b");
    assert!(server.mark_deleted("uid-a"));
    assert!(!server.mark_deleted("uid-a"), "marked once only");
    server.mark_deleted("uid-b");
    assert!(server.remove_pod("uid-a"));

    let mut watch = Watch::open(
        &server,
        &format!("fieldSelector=spec.nodeName%3Dnode-a&resourceVersion={from}"),
    )
    .await;
    let added = watch.event().await;
    assert_eq!(summary(&added), ev("ADDED", "a"));
    assert_eq!(added["object"]["kind"], "Pod");
    assert_eq!(
        added["object"]["metadata"]["resourceVersion"]
            .as_str()
            .unwrap(),
        (from + 1).to_string()
    );
    let modified = watch.event().await;
    assert_eq!(summary(&modified), ev("MODIFIED", "a"));
    assert!(modified["object"]["metadata"]["deletionTimestamp"].is_string());
    let deleted = watch.event().await;
    assert_eq!(summary(&deleted), ev("DELETED", "a"));
    assert_eq!(
        deleted["object"]["metadata"]["resourceVersion"]
            .as_str()
            .unwrap(),
        server.resource_version().to_string()
    );

    // Live: only node-a's pods come through.
    server.add_pod("ns", "c", "uid-c", "node-b");
    server.add_pod("ns", "d", "uid-d", "node-a");
    assert_eq!(summary(&watch.event().await), ev("ADDED", "d"));
    assert!(matches!(
        watch.next(Duration::from_millis(300)).await,
        Next::Nothing
    ));
    assert_eq!(server.open_watches(), 1);
    assert_eq!(server.watch_calls(), 1);

    // From "0": the current pods as ADDED first.
    let mut watch0 = Watch::open(
        &server,
        "fieldSelector=spec.nodeName%3Dnode-a&resourceVersion=0",
    )
    .await;
    assert_eq!(summary(&watch0.event().await), ev("ADDED", "d"));
    assert_eq!(summary(&watch0.event().await), ev("ADDED", "early"));
    assert!(matches!(
        watch0.next(Duration::from_millis(300)).await,
        Next::Nothing
    ));
}

#[tokio::test]
async fn watch_from_before_a_compaction_gets_410_expired() {
    let server = ApiServer::start().unwrap();
    server.add_pod("ns", "a", "uid-a", "node-a");
    let old = server.resource_version();
    server.add_pod("ns", "b", "uid-b", "node-a");
    server.compact();

    let mut watch = Watch::open(&server, &format!("resourceVersion={old}")).await;
    let error = watch.event().await;
    assert_eq!(error["type"], "ERROR");
    assert_eq!(error["object"]["kind"], "Status");
    assert_eq!(error["object"]["code"], 410);
    assert_eq!(error["object"]["reason"], "Expired");
    assert!(
        error["object"]["message"]
            .as_str()
            .unwrap()
            .contains("too old resource version")
    );
    assert!(matches!(
        watch.next(Duration::from_secs(2)).await,
        Next::End
    ));

    // From the current version it works, and sees what comes next.
    let now = server.resource_version();
    let mut watch = Watch::open(&server, &format!("resourceVersion={now}")).await;
    server.mark_deleted("uid-b");
    assert_eq!(summary(&watch.event().await), ev("MODIFIED", "b"));
    // Open watches go on undisturbed by a compaction, with the events they have yet to send.
    let mut behind = Watch::open(&server, &format!("resourceVersion={now}&timeoutSeconds=5")).await;
    server.mark_deleted("uid-a");
    server.compact();
    assert_eq!(summary(&behind.event().await), ev("MODIFIED", "b"));
    assert_eq!(summary(&behind.event().await), ev("MODIFIED", "a"));
}

#[tokio::test]
async fn bookmarks_carry_the_current_version_when_asked_for() {
    let server = ApiServer::start_with(ApiServerOptions {
        bookmark_interval: Duration::from_millis(200),
        ..Default::default()
    })
    .unwrap();
    server.add_pod("ns", "a", "uid-a", "node-a");
    let rv = server.resource_version();
    let mut watch = Watch::open(
        &server,
        &format!("resourceVersion={rv}&allowWatchBookmarks=true"),
    )
    .await;
    // Changes of another node move the version on: the bookmark tells.
    server.add_pod("ns", "b", "uid-b", "node-b");
    let mut quiet = Watch::open(
        &server,
        &format!(
            "resourceVersion={rv}&fieldSelector=spec.nodeName%3Dnode-a&allowWatchBookmarks=true"
        ),
    )
    .await;
    let bookmark = quiet.event().await;
    assert_eq!(bookmark["type"], "BOOKMARK");
    assert_eq!(bookmark["object"]["kind"], "Pod");
    assert_eq!(
        bookmark["object"]["metadata"]["resourceVersion"]
            .as_str()
            .unwrap(),
        server.resource_version().to_string()
    );
    assert_eq!(summary(&watch.event().await), ev("ADDED", "b"));
    assert_eq!(watch.event().await["type"], "BOOKMARK");

    // No bookmarks unless asked for.
    let mut plain = Watch::open(
        &server,
        &format!("resourceVersion={rv}&fieldSelector=spec.nodeName%3Dnode-a"),
    )
    .await;
    assert!(matches!(
        plain.next(Duration::from_millis(700)).await,
        Next::Nothing
    ));
}

#[tokio::test]
async fn streaming_list_sends_the_pods_then_an_initial_events_end_bookmark() {
    let server = ApiServer::start().unwrap();
    server.add_pod("ns", "a", "uid-a", "node-a");
    server.add_pod("ns", "b", "uid-b", "node-b");
    let mut watch = Watch::open(
        &server,
        "fieldSelector=spec.nodeName%3Dnode-a&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true&resourceVersion=",
    )
    .await;
    assert_eq!(summary(&watch.event().await), ev("ADDED", "a"));
    let end = watch.event().await;
    assert_eq!(end["type"], "BOOKMARK");
    assert_eq!(
        end["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"],
        "true"
    );
    // Without resourceVersionMatch=NotOlderThan: refused, as by the real server.
    let resp = http()
        .get(format!(
            "{}/api/v1/pods?watch=1&sendInitialEvents=true&allowWatchBookmarks=true",
            server.url()
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
}

#[tokio::test]
async fn watch_ends_at_its_timeout() {
    let server = ApiServer::start().unwrap();
    let rv = server.resource_version();
    let start = Instant::now();
    let mut watch = Watch::open(&server, &format!("resourceVersion={rv}&timeoutSeconds=1")).await;
    assert!(matches!(
        watch.next(Duration::from_secs(5)).await,
        Next::End
    ));
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "{took:?}"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(server.open_watches(), 0);
}

#[tokio::test]
async fn close_watches_ends_streams_and_stop_restart_keeps_the_state() {
    let server = ApiServer::start().unwrap();
    server.add_pod("ns", "a", "uid-a", "node-a");
    let rv = server.resource_version();

    let mut watch = Watch::open(&server, &format!("resourceVersion={rv}")).await;
    server.close_watches();
    assert!(matches!(
        watch.next(Duration::from_secs(5)).await,
        Next::End
    ));
    // New watches work after a close_watches.
    let mut watch = Watch::open(&server, &format!("resourceVersion={rv}")).await;

    let addr = server.addr();
    server.stop();
    assert!(!server.is_running());
    assert!(matches!(
        watch.next(Duration::from_secs(5)).await,
        Next::Broken | Next::End
    ));
    assert!(
        http()
            .get(format!("{}/api/v1/pods", server.url()))
            .send()
            .await
            .is_err()
    );
    server.remove_pod("uid-a");

    server.restart().unwrap();
    assert_eq!(server.addr(), addr);
    let (status, list) = get_json(&server, "/api/v1/pods").await;
    assert_eq!(status, 200);
    assert_eq!(names(&list), Vec::<String>::new());
    // The history survived: a watch resuming from before the outage sees the removal.
    let mut watch = Watch::open(&server, &format!("resourceVersion={rv}")).await;
    assert_eq!(summary(&watch.event().await), ev("DELETED", "a"));
}

#[test]
fn kubeconfig_points_at_the_server() {
    let server = ApiServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = server.write_kubeconfig(dir.path()).unwrap();
    let text = std::fs::read_to_string(path).unwrap();
    assert!(text.contains(&format!("server: {}", server.url())));
    assert!(text.contains("current-context: minicri-test"));
}

/// Sends `body` with `method` and `content_type` to `path`; the status and the JSON answer.
async fn send(
    server: &ApiServer,
    method: reqwest::Method,
    path: &str,
    content_type: &str,
    body: &Value,
) -> (u16, Value) {
    let resp = http()
        .request(method, format!("{}{path}", server.url()))
        .header("content-type", content_type)
        .body(body.to_string())
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (
        status,
        serde_json::from_slice(&resp.bytes().await.unwrap()).unwrap(),
    )
}

fn event(namespace: &str, name: &str, involved_namespace: &str) -> Value {
    serde_json::json!({
        "metadata": { "name": name, "namespace": namespace },
        "involvedObject": { "kind": "Pod", "namespace": involved_namespace, "name": "p", "uid": "uid-p" },
        "reason": "Pulling",
        "message": "1%",
        "type": "Normal",
        "count": 1,
    })
}

#[tokio::test]
async fn events_are_created_patched_and_refused_as_the_real_server_does() {
    use reqwest::Method;
    let server = ApiServer::start().unwrap();
    let json = "application/json";
    let merge = "application/merge-patch+json";
    let (status, created) = send(
        &server,
        Method::POST,
        "/api/v1/namespaces/ns/events",
        json,
        &event("ns", "e1", "ns"),
    )
    .await;
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["kind"], "Event");
    // Refused: a name taken, an object of another namespace than the path's, an involved object
    // in another namespace (legacy validation), a body that is not an object.
    let refusals = [
        (event("ns", "e1", "ns"), 409),
        (event("other", "e2", "other"), 400),
        (event("", "e3", "other"), 422),
        (serde_json::json!([1]), 400),
    ];
    for (body, code) in refusals {
        let (status, answer) = send(
            &server,
            Method::POST,
            "/api/v1/namespaces/ns/events",
            json,
            &body,
        )
        .await;
        assert_eq!(status, code, "{body} → {answer}");
        assert_eq!(answer["kind"], "Status");
    }
    // A merge patch updates in place; what would move it elsewhere is refused.
    let patch = serde_json::json!({ "count": 2, "message": "50%" });
    let (status, patched) = send(
        &server,
        Method::PATCH,
        "/api/v1/namespaces/ns/events/e1",
        merge,
        &patch,
    )
    .await;
    assert_eq!(status, 200, "{patched}");
    assert_eq!(
        (patched["count"].clone(), patched["message"].clone()),
        (2.into(), "50%".into())
    );
    assert_eq!(patched["reason"], "Pulling");
    for (path, content_type, body, code) in [
        (
            "/api/v1/namespaces/ns/events/nope",
            merge,
            patch.clone(),
            404,
        ),
        (
            "/api/v1/namespaces/ns/events/e1",
            "application/json-patch+json",
            patch.clone(),
            415,
        ),
        (
            "/api/v1/namespaces/ns/events/e1",
            merge,
            serde_json::json!({"involvedObject": {"namespace": "x"}}),
            422,
        ),
        (
            "/api/v1/namespaces/ns/events/e1",
            merge,
            serde_json::json!({"metadata": {"namespace": "x"}}),
            422,
        ),
    ] {
        let (status, answer) = send(&server, Method::PATCH, path, content_type, &body).await;
        assert_eq!(status, code, "{path} {body} → {answer}");
    }
    let (status, list) = get_json(&server, "/api/v1/namespaces/ns/events").await;
    assert_eq!(status, 200);
    assert_eq!(list["items"].as_array().unwrap().len(), 1);
    assert_eq!(list["items"][0]["message"], "50%");
    // Every write recorded, refused ones too.
    let writes = server.event_writes();
    assert_eq!(writes.len(), 10);
    assert_eq!(
        writes.iter().filter(|w| w.status < 300).count(),
        2,
        "{writes:#?}"
    );
    assert_eq!(writes[0].involved_uid.as_deref(), Some("uid-p"));
    assert_eq!(server.events().len(), 1);
}

#[tokio::test]
async fn with_tls_a_client_certificate_is_required_recorded_and_revocable() {
    use minicri_tests::apiserver::fingerprint_pem;
    use minicri_tests::pki::{TestPki, node_client_pem};
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::create(dir.path()).unwrap();
    let server = ApiServer::start_with(ApiServerOptions {
        tls: Some(pki.clone()),
        ..Default::default()
    })
    .unwrap();
    assert!(server.url().starts_with("https://127.0.0.1:"));
    let ca = reqwest::Certificate::from_pem(&std::fs::read(&pki.ca).unwrap()).unwrap();
    let client = |identity: Option<String>| {
        let mut b = reqwest::Client::builder()
            .no_proxy()
            .tls_certs_only([ca.clone()]);
        if let Some(pem) = identity {
            b = b.identity(reqwest::Identity::from_pem(pem.as_bytes()).unwrap());
        }
        b.build().unwrap()
    };
    let url = format!("{}/api/v1/pods", server.url());
    // No client certificate: the handshake fails.
    assert!(client(None).get(&url).send().await.is_err());
    let (cert, key) = node_client_pem(&pki, "system:node:n1").unwrap();
    let with_cert = client(Some(format!("{cert}{key}")));
    assert_eq!(with_cert.get(&url).send().await.unwrap().status(), 200);
    let fp = fingerprint_pem(&cert).unwrap();
    assert_eq!(
        server.requests()[0].client_cert.as_deref(),
        Some(fp.as_str())
    );
    server.revoke(&fp);
    assert_eq!(with_cert.get(&url).send().await.unwrap().status(), 401);
}

//! A sandbox stopped just as its PullImage call's detach window closes: fired many times, with the
//! stop landing at offsets around the window, against the pull manager in-process (a real
//! registry behind the fault proxy, the layer stalled so the job keeps running). Whichever comes
//! first, the stopped sandbox must hold nothing afterwards: no hold on a job, no hold file.

use std::sync::Arc;
use std::time::{Duration, Instant};

use minicri_store::pull::{PodRef, PullConfig, PullManager, Requester};
use minicri_store::{ContentStore, Credentials, ImageStore, Registry, RegistryHosts, StoreError};
use minicri_tests::images::{self, Compression};
use minicri_tests::proxy::{Proxy, Target};
use minicri_tests::registry::Registry as TestRegistry;

const WINDOW: Duration = Duration::from_millis(40);
const ROUNDS: u64 = 120;

#[tokio::test(flavor = "multi_thread")]
async fn a_stop_as_the_detach_window_closes_never_leaves_a_hold() {
    let registry = TestRegistry::start();
    let proxy = Proxy::start(&registry.addr()).expect("proxy");
    let client = images::RegistryClient::new(&registry.addr());
    let img = images::push_big_image(
        &client,
        "minicri-test/race:latest",
        1,
        2,
        Compression::None,
        61,
    )
    .await
    .expect("push");
    let layer = img.layers.last().unwrap().digest.clone();
    proxy.faults().stall_after(Target::Blob(layer), 1024);

    let dir = tempfile::tempdir().unwrap();
    let content = Arc::new(ContentStore::open(&dir.path().join("content")).unwrap());
    let images = Arc::new(ImageStore::open(dir.path(), &content).unwrap());
    let holds = dir.path().join("holds");
    let mgr = PullManager::new(
        content,
        images,
        Registry::new(RegistryHosts::new(None)),
        PullConfig {
            detach_after: Some(WINDOW),
            holds_dir: Some(holds.clone()),
            progress_timeout: None,
            ..PullConfig::default()
        },
        None,
    );
    let r = format!("{}/minicri-test/race:latest", proxy.addr());
    // A call of no pod keeps the job running between rounds.
    let anchor = {
        let (mgr, r) = (mgr.clone(), r.clone());
        tokio::spawn(async move {
            mgr.pull(&r, &Credentials::default(), Requester::anonymous())
                .await
        })
    };
    assert!(
        proxy
            .faults()
            .wait_stalled(1, Duration::from_secs(20))
            .await
    );

    let (mut detached, mut stopped) = (0, 0);
    for i in 0..ROUNDS {
        let uid = format!("uid-{i}");
        let requester = Requester::pod(
            PodRef {
                namespace: "race".into(),
                name: format!("pod-{i}"),
                uid: uid.clone(),
                attempt: 0,
            },
            Some(format!("sandbox-{i}")),
        );
        let call = {
            let (mgr, r) = (mgr.clone(), r.clone());
            tokio::spawn(async move { mgr.pull(&r, &Credentials::default(), requester).await })
        };
        // The stop lands from 10 ms before the window closes to 10 ms after (the call joins
        // the running job within a millisecond or so: a manifest request on loopback).
        let offset = Duration::from_micros(i * 20_000 / ROUNDS);
        tokio::time::sleep(WINDOW - Duration::from_millis(10) + offset).await;
        mgr.close_pod(&uid, 0, "sandbox stopped");
        match call.await.unwrap() {
            Err(StoreError::Detached(_)) => detached += 1,
            Err(StoreError::Cancelled(_) | StoreError::SandboxStopped(_)) => stopped += 1,
            // A loaded machine: the manifest did not come within the window, nothing joined.
            Err(StoreError::Unavailable { .. }) => {}
            other => panic!("round {i}: {other:?}"),
        }
        // Whatever the call got, the stopped sandbox holds nothing.
        let left: Vec<_> = mgr
            .list()
            .into_iter()
            .flat_map(|j| j.requesters)
            .filter(|q| q.requester.pod.as_ref().is_some_and(|p| p.uid == uid))
            .collect();
        assert!(
            left.is_empty(),
            "round {i}: the stopped sandbox still has {left:?}"
        );
    }
    // Both outcomes happened: the stop landed on either side of the window.
    assert!(
        detached > 0 && stopped > 0,
        "detached {detached}, stopped {stopped}"
    );
    // Hold files are written and removed in order by one thread: none is left.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let files: Vec<_> = std::fs::read_dir(&holds)
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        if files.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "hold files left: {files:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anchor.abort();
    proxy.faults().release_stall();
}

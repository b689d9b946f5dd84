//! Tests of the kubelet simulator itself against a real minicri daemon, a real registry and the
//! rate-limiting proxy: pods start and are removed, a missing image backs off as the kubelet's
//! does (with pull policy Always too, which pulls without asking ImageStatus first), the serial puller pulls one image at a time in FIFO order (also for a pod deleted while
//! queued), the parallel one does not, and a deletion is only acted on once the blocked
//! PullImage returns. Host-network sandboxes on runc: root and runc are needed.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use minicri_proto::runtime::v1 as cri;
use minicri_tests::kubelet_sim::{EventKind, KubeletSim, PodSpec, Puller, SimEvent};
use minicri_tests::sim_env::*;

#[tokio::test(flavor = "multi_thread")]
async fn pod_runs_a_present_image_is_not_pulled_and_deletion_removes_everything() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let e = env().await;
    let (img, r) = e.busybox("small").await;
    let sim = KubeletSim::for_daemon(&e.daemon, fast(Puller::Serial))
        .await
        .unwrap();

    let a = PodSpec::new("a", &[&r]);
    sim.create_pod(a.clone());
    sim.wait_running(&a.uid, LONG).await.unwrap();
    let kinds: Vec<EventKind> = sim.events(&a.uid).into_iter().map(|e| e.kind).collect();
    let sandbox = sim.sandbox_id(&a.uid).expect("a sandbox");
    let container = match &kinds[..] {
        [
            EventKind::SyncStarted,
            EventKind::SandboxReady(sb),
            EventKind::PullQueued(_),
            EventKind::PullStarted(_),
            EventKind::PullReturned {
                result: Ok(image_ref),
                ..
            },
            EventKind::ContainerStarted { id, .. },
            EventKind::Running,
        ] if *sb == sandbox && *image_ref == img.config_digest => id.clone(),
        _ => panic!("unexpected events:\n{}", sim.timeline(&a.uid)),
    };
    let listed = e.containers().await;
    let c = listed
        .iter()
        .find(|c| c.id == container)
        .expect("the container is listed");
    assert_eq!(c.pod_sandbox_id, sandbox);
    assert_eq!(c.state, cri::ContainerState::ContainerRunning as i32);
    assert_eq!(c.image_ref, img.config_digest);

    // IfNotPresent: the image is there now, so the second pod does not pull it.
    let b = PodSpec::new("b", &[&r]);
    sim.create_pod(b.clone());
    sim.wait_running(&b.uid, LONG).await.unwrap();
    first(&sim, &b.uid, "ImagePresent", |k| {
        matches!(k, EventKind::ImagePresent(_))
    });
    assert_eq!(
        count(&sim, &b.uid, |k| matches!(k, EventKind::PullQueued(_))),
        0,
        "{}",
        sim.timeline(&b.uid)
    );
    assert_eq!(e.pull_calls_logged("kubesim/small"), 1);

    sim.delete_pod(&a.uid);
    sim.wait_gone(&a.uid, LONG).await.unwrap();
    let tail: Vec<EventKind> = sim
        .events(&a.uid)
        .into_iter()
        .map(|e| e.kind)
        .skip_while(|k| *k != EventKind::DeletionRequested)
        .collect();
    assert_eq!(
        tail,
        vec![
            EventKind::DeletionRequested,
            EventKind::DeletionNoticed,
            EventKind::ContainerStopped(container.clone()),
            EventKind::SandboxStopped(sandbox.clone()),
            EventKind::ContainerRemoved(container.clone()),
            EventKind::SandboxRemoved(sandbox.clone()),
            EventKind::Gone,
        ]
    );
    assert!(!e.sandboxes().await.iter().any(|s| s.id == sandbox));
    assert!(!e.containers().await.iter().any(|c| c.id == container));
    let b_sandbox = sim.sandbox_id(&b.uid).unwrap();
    assert!(
        e.sandboxes()
            .await
            .iter()
            .any(|s| s.id == b_sandbox && s.state == cri::PodSandboxState::SandboxReady as i32),
        "the other pod is untouched"
    );

    sim.shutdown().await;
    assert!(e.sandboxes().await.is_empty());
    assert!(e.containers().await.is_empty());
    assert_eq!(e.stray_state(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread")]
async fn missing_image_gets_err_image_pull_then_doubling_back_off_and_the_loop_goes_on() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let e = env().await;
    let (_, good) = e.busybox("good").await;
    let missing = format!("{}/kubesim/missing:1", e.proxy.addr());
    let cfg = fast(Puller::Serial);
    let (base, max, requeue) = (cfg.backoff_base, cfg.backoff_max, cfg.requeue);
    let sim = KubeletSim::for_daemon(&e.daemon, cfg).await.unwrap();
    let pod = PodSpec::new("p", &[&missing, &good]);
    let uid = pod.uid.clone();
    sim.create_pod(pod);

    let is_err_pull = |k: &EventKind| matches!(k, EventKind::ErrImagePull { .. });
    sim.wait_for(&uid, LONG, "through four failed pulls", |ev| {
        (ev.iter().filter(|e| is_err_pull(&e.kind)).count() >= 4).then_some(Ok(()))
    })
    .await
    .unwrap();
    sim.delete_pod(&uid);
    sim.wait_gone(&uid, LONG).await.unwrap();
    let events = sim.events(&uid);
    let timeline = sim.timeline(&uid);

    // The failure did not stop the container loop: the second container started in sync 1.
    let started: Vec<&SimEvent> = events
        .iter()
        .filter(|e| matches!(&e.kind, EventKind::ContainerStarted { image, .. } if *image == good))
        .collect();
    assert_eq!(started.len(), 1, "{timeline}");
    assert!(!events.iter().any(|e| e.kind == EventKind::Running));

    // Every pull of the missing image failed; each failure extended the back-off, doubling
    // from the base to the max.
    let pulls: Vec<&SimEvent> = events
        .iter()
        .filter(|e| matches!(&e.kind, EventKind::PullStarted(i) if *i == missing))
        .collect();
    let returns: Vec<&SimEvent> = events
        .iter()
        .filter(|e| matches!(&e.kind, EventKind::PullReturned { image, .. } if *image == missing))
        .collect();
    let backoffs: Vec<Duration> = events
        .iter()
        .filter_map(|e| match &e.kind {
            EventKind::ErrImagePull {
                backoff, message, ..
            } => {
                assert!(!message.is_empty());
                Some(*backoff)
            }
            _ => None,
        })
        .collect();
    assert!(
        returns
            .iter()
            .all(|r| matches!(&r.kind, EventKind::PullReturned { result: Err(_), .. })),
        "{timeline}"
    );
    assert_eq!(pulls.len(), returns.len());
    assert_eq!(backoffs.len(), pulls.len(), "{timeline}");
    assert_eq!(&backoffs[..4], &[base, 2 * base, max, max], "{timeline}");

    // No PullImage while in back-off: the next pull starts no sooner than the back-off after
    // the last one returned, and within a requeue (and some scheduling slack) after it ends.
    // Syncs in between fail fast with ImagePullBackOff (not necessarily after the first pull:
    // the rest of sync 1, pulling and starting the second container, may outlast the first
    // back-off).
    for n in 0..pulls.len() - 1 {
        let gap = pulls[n + 1].at - returns[n].at;
        assert!(
            gap >= backoffs[n] && gap < backoffs[n] + requeue + Duration::from_secs(1),
            "pull {} came {gap:?} after pull {n} (back-off {:?})\n{timeline}",
            n + 1,
            backoffs[n]
        );
        let backed_off = events
            .iter()
            .filter(|e| e.at > returns[n].at && e.at < pulls[n + 1].at)
            .filter(|e| matches!(&e.kind, EventKind::BackOff(i) if *i == missing))
            .count();
        assert!(n == 0 || backed_off >= 1, "{timeline}");
    }
    // The daemon saw exactly the simulator's pulls: one of the good image, these of the missing.
    assert_eq!(e.pull_calls_logged("kubesim/missing"), pulls.len());
    assert_eq!(e.pull_calls_logged("kubesim/good"), 1);

    // An idle worker (between syncs) acts on the deletion at once.
    let requested = first(&sim, &uid, "DeletionRequested", |k| {
        *k == EventKind::DeletionRequested
    });
    let noticed = first(&sim, &uid, "DeletionNoticed", |k| {
        *k == EventKind::DeletionNoticed
    });
    assert!(
        noticed.at - requested.at < Duration::from_millis(300),
        "{timeline}"
    );
    sim.shutdown().await;
    assert!(e.sandboxes().await.is_empty());
    assert!(e.containers().await.is_empty());
    assert_eq!(e.stray_state(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread")]
async fn serial_puller_pulls_one_image_at_a_time_in_fifo_order_even_for_a_deleted_pod() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let e = env().await;
    let mut refs = Vec::new();
    for (i, name) in ["s0", "s1", "s2"].iter().enumerate() {
        refs.push(e.big(name, 4, 100 + i as u64).await.1);
    }
    // About a second per pull.
    e.proxy.faults().set_rate_limit(Some(4 * MIB));
    let sim = KubeletSim::for_daemon(&e.daemon, fast(Puller::Serial))
        .await
        .unwrap();
    let pods: Vec<PodSpec> = refs
        .iter()
        .enumerate()
        .map(|(i, r)| PodSpec::new(&format!("s{i}"), &[r]))
        .collect();
    for p in &pods {
        sim.create_pod(p.clone());
    }

    // Delete the pod whose request is still queued once another pull is under way.
    let queued = |uid: &str| {
        let ev = sim.events(uid);
        ev.iter()
            .any(|e| matches!(e.kind, EventKind::PullQueued(_)))
            && !ev.iter().any(|e| is_pull_started(&e.kind))
    };
    let start = Instant::now();
    let victim = loop {
        let ready = pods
            .iter()
            .all(|p| count(&sim, &p.uid, |k| matches!(k, EventKind::PullQueued(_))) == 1);
        if ready && let Some(p) = pods.iter().rev().find(|p| queued(&p.uid)) {
            break p.uid.clone();
        }
        assert!(start.elapsed() < LONG, "pulls never queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    sim.delete_pod(&victim);
    for p in &pods {
        if p.uid != victim {
            sim.wait_running(&p.uid, LONG).await.unwrap();
        }
    }
    sim.wait_gone(&victim, LONG).await.unwrap();

    // FIFO: pulls start in the order they were queued; serial: no two overlap.
    let mut times: Vec<(Instant, Instant, Instant, &str)> = pods
        .iter()
        .map(|p| {
            let (q, s, r) = pull_times(&sim, &p.uid);
            (q, s, r, p.uid.as_str())
        })
        .collect();
    let all = || {
        pods.iter()
            .map(|p| sim.timeline(&p.uid))
            .collect::<Vec<_>>()
            .join("\n")
    };
    times.sort_by_key(|t| t.0);
    for w in times.windows(2) {
        assert!(
            w[0].1 < w[1].1,
            "FIFO: {} then {}\n{}",
            w[0].3,
            w[1].3,
            all()
        );
        assert!(
            w[1].1 >= w[0].2,
            "{} started before {} returned\n{}",
            w[1].3,
            w[0].3,
            all()
        );
    }
    for (_, s, r, uid) in &times {
        assert!(
            *r - *s > Duration::from_millis(500),
            "{uid} pulled in {:?}",
            *r - *s
        );
    }

    // The deleted pod was pulled all the same, and its worker only acted on the deletion once
    // that pull returned.
    let pulled = first(&sim, &victim, "PullReturned", is_pull_returned);
    assert!(
        matches!(&pulled.kind, EventKind::PullReturned { result: Ok(_), .. }),
        "{}",
        sim.timeline(&victim)
    );
    let requested = first(&sim, &victim, "DeletionRequested", |k| {
        *k == EventKind::DeletionRequested
    });
    let noticed = first(&sim, &victim, "DeletionNoticed", |k| {
        *k == EventKind::DeletionNoticed
    });
    assert!(requested.at < first(&sim, &victim, "PullStarted", is_pull_started).at);
    assert!(noticed.at >= pulled.at, "{}", sim.timeline(&victim));
    // The sync ran to its end (the kubelet's container loop does not look at the deletion): the
    // container started, and only then was the deletion acted on.
    let started = first(&sim, &victim, "ContainerStarted", |k| {
        matches!(k, EventKind::ContainerStarted { .. })
    });
    assert!(noticed.at >= started.at, "{}", sim.timeline(&victim));

    sim.shutdown().await;
    assert!(e.sandboxes().await.is_empty());
    assert_eq!(e.stray_state(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread")]
async fn parallel_puller_overlaps_pulls() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let e = env().await;
    let mut refs = Vec::new();
    for (i, name) in ["p0", "p1"].iter().enumerate() {
        refs.push(e.big(name, 4, 200 + i as u64).await.1);
    }
    e.proxy.faults().set_rate_limit(Some(4 * MIB));
    let sim = KubeletSim::for_daemon(&e.daemon, fast(Puller::Parallel(2)))
        .await
        .unwrap();
    let pods: Vec<PodSpec> = refs
        .iter()
        .enumerate()
        .map(|(i, r)| PodSpec::new(&format!("p{i}"), &[r]))
        .collect();
    for p in &pods {
        sim.create_pod(p.clone());
    }
    for p in &pods {
        sim.wait_running(&p.uid, LONG).await.unwrap();
    }
    let (_, s0, r0) = pull_times(&sim, &pods[0].uid);
    let (_, s1, r1) = pull_times(&sim, &pods[1].uid);
    assert!(
        s0 < r1 && s1 < r0,
        "pulls overlap\n{}\n{}",
        sim.timeline(&pods[0].uid),
        sim.timeline(&pods[1].uid)
    );
    sim.shutdown().await;
    assert!(e.sandboxes().await.is_empty());
    assert_eq!(e.stray_state(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread")]
async fn deletion_is_acted_on_only_after_the_blocked_pull_returns() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let e = env().await;
    let (img, r) = e.big("slow", 8, 300).await;
    let layer = img.layers.last().unwrap().clone();
    // About two seconds for the layer.
    e.proxy.faults().set_rate_limit(Some(4 * MIB));
    let hook_calls = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut cfg = fast(Puller::Serial);
    cfg.on_delete = Some({
        let calls = hook_calls.clone();
        Arc::new(move |uid: &str| calls.lock().unwrap().push(uid.to_string()))
    });
    let sim = KubeletSim::for_daemon(&e.daemon, cfg).await.unwrap();
    let pod = PodSpec::new("slow", &[&r]);
    let uid = pod.uid.clone();
    sim.create_pod(pod);

    let start = Instant::now();
    while e.proxy.bytes_served(&layer.digest) < MIB {
        assert!(start.elapsed() < LONG, "the download never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    sim.delete_pod(&uid);
    assert_eq!(*hook_calls.lock().unwrap(), vec![uid.clone()]);
    sim.wait_gone(&uid, LONG).await.unwrap();
    let timeline = sim.timeline(&uid);
    eprintln!("{timeline}");

    let requested = first(&sim, &uid, "DeletionRequested", |k| {
        *k == EventKind::DeletionRequested
    });
    let pulled = first(&sim, &uid, "PullReturned", is_pull_returned);
    let noticed = first(&sim, &uid, "DeletionNoticed", |k| {
        *k == EventKind::DeletionNoticed
    });
    let stopped = first(&sim, &uid, "SandboxStopped", |k| {
        matches!(k, EventKind::SandboxStopped(_))
    });
    // Nothing told the runtime: the pull ran to completion, and the worker stayed blocked in
    // it well after the deletion.
    match &pulled.kind {
        EventKind::PullReturned {
            result: Ok(image_ref),
            ..
        } => assert_eq!(*image_ref, img.config_digest),
        _ => panic!("the pull did not succeed\n{timeline}"),
    }
    assert_eq!(e.proxy.bytes_served(&layer.digest), layer.size);
    assert!(
        pulled.at - requested.at > Duration::from_millis(500),
        "the pull returned {:?} after the deletion\n{timeline}",
        pulled.at - requested.at
    );
    assert!(noticed.at >= pulled.at, "{timeline}");
    assert!(stopped.at >= noticed.at, "{timeline}");
    // The sync went on to start the container before the deletion was acted on.
    let started = first(&sim, &uid, "ContainerStarted", |k| {
        matches!(k, EventKind::ContainerStarted { .. })
    });
    assert!(
        started.at >= pulled.at && noticed.at >= started.at,
        "{timeline}"
    );
    assert!(e.sandboxes().await.is_empty());
    sim.shutdown().await;
    assert_eq!(e.stray_state(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread")]
async fn pull_policy_always_pulls_without_image_status_and_backs_off_before_the_runtime() {
    if let Some(why) = skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let e = env().await;
    let (_, r) = e.busybox("always").await;
    let missing = format!("{}/kubesim/always-missing:1", e.proxy.addr());
    let cfg = fast(Puller::Serial);
    let base = cfg.backoff_base;
    let sim = KubeletSim::for_daemon(&e.daemon, cfg).await.unwrap();
    let a = PodSpec::new("a", &[&r]);
    sim.create_pod(a.clone());
    sim.wait_running(&a.uid, LONG).await.unwrap();

    // The image is there, yet an Always pod pulls it, and asks no ImageStatus first.
    let statuses = e.calls_logged("ImageStatus", "kubesim/always");
    assert!(
        statuses >= 1,
        "the IfNotPresent pod's ImageStatus is in the log"
    );
    let b = PodSpec::new("b", &[&r]).always();
    sim.create_pod(b.clone());
    sim.wait_running(&b.uid, LONG).await.unwrap();
    assert_eq!(
        count(&sim, &b.uid, |k| matches!(k, EventKind::ImagePresent(_))),
        0
    );
    assert_eq!(
        count(&sim, &b.uid, is_pull_started),
        1,
        "{}",
        sim.timeline(&b.uid)
    );
    assert_eq!(e.pull_calls_logged("kubesim/always"), 2);
    assert_eq!(e.calls_logged("ImageStatus", "kubesim/always"), statuses);

    // A missing image: ErrImagePull, then ImagePullBackOff without any CRI call for it.
    let c = PodSpec::new("c", &[&missing]).always();
    sim.create_pod(c.clone());
    sim.wait_for(&c.uid, LONG, "a back-off", |ev| {
        ev.iter()
            .any(|e| matches!(e.kind, EventKind::BackOff(_)))
            .then_some(Ok(()))
    })
    .await
    .unwrap();
    let events = sim.events(&c.uid);
    let err = events
        .iter()
        .find(|e| matches!(e.kind, EventKind::ErrImagePull { .. }))
        .unwrap();
    let backoff = events
        .iter()
        .find(|e| matches!(e.kind, EventKind::BackOff(_)))
        .unwrap();
    assert!(backoff.at - err.at < base, "{}", sim.timeline(&c.uid));
    assert_eq!(
        count(&sim, &c.uid, is_pull_started),
        1,
        "{}",
        sim.timeline(&c.uid)
    );
    assert_eq!(e.calls_logged("ImageStatus", "always-missing"), 0);
    sim.shutdown().await;
    assert!(e.sandboxes().await.is_empty());
    assert_eq!(e.stray_state(), Vec::<String>::new());
}

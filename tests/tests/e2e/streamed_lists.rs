//! Black-box tests of the streamed lists (CRI v0.36: StreamPodSandboxes, StreamContainers,
//! StreamImages, StreamContainerStats, StreamPodSandboxStats) against the real daemon and runc:
//! a node whose pods carry more labels and annotations than one 16 MiB message lists through the
//! streams, in batches a default gRPC client (4 MiB) can read, and each stream answers what its
//! list RPC answers under the same filter.
//!
//! Root only (they print why and pass elsewhere); see [`minicri_tests::pod_env`].

use futures::StreamExt;
use minicri_proto::runtime::v1 as cri;
use minicri_tests::pod_env::{PodEnv, host_network, pod_config, runc_skip_reason};
use minicri_tests::pod_rpc::{RuntimeClient, container_config, run_container, run_pod};
use prost::Message;

/// Bytes of the big label, and of the big annotation, of each pod: just under the per-object
/// cap (272 KiB), so that [`PODS`] of them pass 16 MiB.
const BIG: usize = 270 << 10;
/// Pods with [`BIG`] metadata: 33 x 540 KiB = 17.4 MiB.
const PODS: usize = 33;
/// What a gRPC client reads by default (Go's and tonic's): every batch must fit it.
const DEFAULT_CLIENT_LIMIT: usize = 4 << 20;

/// A host-network pod (no CNI: quick to make) with a label and an annotation of [`BIG`] bytes.
fn big_pod(env: &PodEnv, i: usize) -> cri::PodSandboxConfig {
    let mut pod = pod_config(&format!("big{i}"), env.logs.path());
    pod.labels.insert("big".into(), "l".repeat(BIG));
    pod.labels.insert("parity".into(), (i % 2).to_string());
    pod.annotations.insert("big".into(), "a".repeat(BIG));
    host_network(pod)
}

/// Every batch of a streamed answer, checked to fit a default client's limit.
async fn batches<T: Message + Default>(
    stream: Result<tonic::Response<tonic::Streaming<T>>, tonic::Status>,
) -> Vec<T> {
    let batches: Vec<T> = stream
        .expect("the stream starts")
        .into_inner()
        .map(|b| b.expect("a batch"))
        .collect()
        .await;
    for b in &batches {
        assert!(
            b.encoded_len() < DEFAULT_CLIENT_LIMIT,
            "{}",
            b.encoded_len()
        );
    }
    batches
}

async fn stream_pods(
    c: &mut RuntimeClient,
    filter: Option<cri::PodSandboxFilter>,
) -> Vec<cri::PodSandbox> {
    let r = c
        .stream_pod_sandboxes(cri::StreamPodSandboxesRequest { filter })
        .await;
    batches(r)
        .await
        .into_iter()
        .flat_map(|b| b.pod_sandboxes)
        .collect()
}

async fn list_pods(
    c: &mut RuntimeClient,
    filter: Option<cri::PodSandboxFilter>,
) -> Vec<cri::PodSandbox> {
    c.list_pod_sandbox(cri::ListPodSandboxRequest { filter })
        .await
        .expect("ListPodSandbox")
        .into_inner()
        .items
}

async fn stream_pod_stats(
    c: &mut RuntimeClient,
    filter: Option<cri::PodSandboxStatsFilter>,
) -> Vec<cri::PodSandboxStats> {
    let r = c
        .stream_pod_sandbox_stats(cri::StreamPodSandboxStatsRequest { filter })
        .await;
    batches(r)
        .await
        .into_iter()
        .flat_map(|b| b.pod_sandbox_stats)
        .collect()
}

/// The sandbox (and container) ids of stats, in order.
fn pod_stats_ids(stats: &[cri::PodSandboxStats]) -> Vec<(String, Vec<String>)> {
    stats
        .iter()
        .map(|s| {
            let id = s.attributes.as_ref().unwrap().id.clone();
            let containers = (s.linux.as_ref().unwrap().containers.iter())
                .map(|c| c.attributes.as_ref().unwrap().id.clone())
                .collect();
            (id, containers)
        })
        .collect()
}

/// A node with 33 pods of 540 KiB of labels and annotations each: ListPodSandbox (and
/// ListPodSandboxStats) cannot answer within the client's 16 MiB, StreamPodSandboxes (and
/// StreamPodSandboxStats) return every pod in batches under 4 MiB; under filters that fit one
/// message, each stream answers exactly what its list does. The node's metadata budget is raised
/// past one message for this (by default it keeps every list within one).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streams_list_past_one_message_and_match_their_lists() {
    if let Some(why) = runc_skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let env = PodEnv::with_args(&["--node-metadata-budget", "33554432"]).await;
    let image = env.pull_busybox().await;
    let mut c = env.runtime().await;
    let start = std::time::Instant::now();
    let mut ids = Vec::new();
    for i in 0..PODS {
        ids.push(run_pod(&mut c, &big_pod(&env, i)).await);
    }
    eprintln!("{PODS} pods made in {:?}", start.elapsed());
    // Two containers in the first pod, one in the second, for the container lists.
    let pod0 = big_pod(&env, 0);
    let mut containers = Vec::new();
    for (pod, cfg, name) in [
        (0, &pod0, "a"),
        (0, &pod0, "b"),
        (1, &big_pod(&env, 1), "c"),
    ] {
        let mut config = container_config(name, &image, &["sleep", "1000"]);
        config.labels.insert("name".into(), name.into());
        containers.push(run_container(&mut c, &ids[pod], cfg, config).await);
    }

    // The list is past the client's (and the kubelet's) 16 MiB.
    let err = c
        .list_pod_sandbox(cri::ListPodSandboxRequest { filter: None })
        .await
        .expect_err("a ListPodSandbox answer over 16 MiB");
    assert!(
        matches!(
            err.code(),
            tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
        ),
        "{err:?}"
    );
    let streamed = stream_pods(&mut c, None).await;
    let streamed_ids: Vec<&str> = streamed.iter().map(|p| p.id.as_str()).collect();
    assert_eq!(streamed_ids, ids, "every pod, in creation order");
    assert!(
        streamed
            .iter()
            .all(|p| p.labels["big"].len() == BIG && p.annotations["big"].len() == BIG)
    );
    let bytes: usize = streamed.iter().map(Message::encoded_len).sum();
    assert!(bytes > 16 << 20, "{bytes}");

    // Filters small enough for one message: the stream answers what the list does.
    let by_label = |k: &str, v: &str| cri::PodSandboxFilter {
        label_selector: [(k.to_string(), v.to_string())].into(),
        ..Default::default()
    };
    let filters = [
        by_label("app", "big7"),
        cri::PodSandboxFilter {
            id: ids[3][..12].to_string(),
            ..Default::default()
        },
        cri::PodSandboxFilter {
            id: ids[5].clone(),
            state: Some(cri::PodSandboxStateValue {
                state: cri::PodSandboxState::SandboxReady as i32,
            }),
            ..Default::default()
        },
        cri::PodSandboxFilter {
            state: Some(cri::PodSandboxStateValue {
                state: cri::PodSandboxState::SandboxNotready as i32,
            }),
            ..Default::default()
        },
        by_label("app", "none"),
    ];
    for f in filters {
        let listed = list_pods(&mut c, Some(f.clone())).await;
        assert_eq!(stream_pods(&mut c, Some(f.clone())).await, listed, "{f:?}");
    }
    let parity = stream_pods(&mut c, Some(by_label("parity", "1"))).await;
    assert_eq!(parity.len(), PODS / 2);

    // Pod stats: the same pods, past one message too.
    let err = c
        .list_pod_sandbox_stats(cri::ListPodSandboxStatsRequest { filter: None })
        .await
        .expect_err("a ListPodSandboxStats answer over 16 MiB");
    assert!(
        matches!(
            err.code(),
            tonic::Code::OutOfRange | tonic::Code::ResourceExhausted
        ),
        "{err:?}"
    );
    let stats = stream_pod_stats(&mut c, None).await;
    let got = pod_stats_ids(&stats);
    assert_eq!(
        got.iter().map(|(id, _)| id.clone()).collect::<Vec<_>>(),
        ids
    );
    assert_eq!(got[0].1, containers[..2].to_vec());
    assert_eq!(got[1].1, containers[2..].to_vec());
    let f = cri::PodSandboxStatsFilter {
        id: ids[1].clone(),
        ..Default::default()
    };
    let listed = c
        .list_pod_sandbox_stats(cri::ListPodSandboxStatsRequest {
            filter: Some(f.clone()),
        })
        .await
        .unwrap()
        .into_inner()
        .stats;
    // CPU and memory move between two calls: the same pods, containers and attributes.
    let streamed = stream_pod_stats(&mut c, Some(f)).await;
    assert_eq!(pod_stats_ids(&streamed), pod_stats_ids(&listed));
    assert_eq!(streamed[0].attributes, listed[0].attributes);

    // Containers and their stats, with and without filters.
    let container_filters = [
        cri::ContainerFilter::default(),
        cri::ContainerFilter {
            pod_sandbox_id: ids[0].clone(),
            ..Default::default()
        },
        cri::ContainerFilter {
            label_selector: [("name".to_string(), "c".to_string())].into(),
            ..Default::default()
        },
        cri::ContainerFilter {
            id: containers[1][..10].to_string(),
            ..Default::default()
        },
    ];
    for f in container_filters {
        let listed = c
            .list_containers(cri::ListContainersRequest {
                filter: Some(f.clone()),
            })
            .await
            .unwrap()
            .into_inner()
            .containers;
        let r = c
            .stream_containers(cri::StreamContainersRequest {
                filter: Some(f.clone()),
            })
            .await;
        let streamed: Vec<_> = batches(r)
            .await
            .into_iter()
            .flat_map(|b| b.containers)
            .collect();
        assert_eq!(streamed, listed, "{f:?}");
        assert!(!listed.is_empty(), "{f:?}");
        let sf = cri::ContainerStatsFilter {
            id: f.id.clone(),
            pod_sandbox_id: f.pod_sandbox_id.clone(),
            label_selector: f.label_selector.clone(),
        };
        let listed_stats = c
            .list_container_stats(cri::ListContainerStatsRequest {
                filter: Some(sf.clone()),
            })
            .await
            .unwrap()
            .into_inner()
            .stats;
        let r = c
            .stream_container_stats(cri::StreamContainerStatsRequest { filter: Some(sf) })
            .await;
        let streamed_stats: Vec<_> = batches(r)
            .await
            .into_iter()
            .flat_map(|b| b.container_stats)
            .collect();
        let attrs =
            |v: &[cri::ContainerStats]| v.iter().map(|s| s.attributes.clone()).collect::<Vec<_>>();
        assert_eq!(attrs(&streamed_stats), attrs(&listed_stats), "{f:?}");
        let want: Vec<_> = listed.iter().map(|c| Some(c.id.clone())).collect();
        let got: Vec<_> = (streamed_stats.iter())
            .map(|s| s.attributes.as_ref().map(|a| a.id.clone()))
            .collect();
        assert_eq!(got, want, "{f:?}");
    }

    // Images: all, one by name, an unknown one.
    let mut images = env.daemon.images().await.unwrap();
    for name in [
        String::new(),
        image.clone(),
        "unknown.example/none:1".to_string(),
    ] {
        let filter = (!name.is_empty()).then(|| cri::ImageFilter {
            image: Some(cri::ImageSpec {
                image: name.clone(),
                ..Default::default()
            }),
        });
        let listed = images
            .list_images(cri::ListImagesRequest {
                filter: filter.clone(),
            })
            .await
            .unwrap()
            .into_inner()
            .images;
        let r = images
            .stream_images(cri::StreamImagesRequest { filter })
            .await;
        let streamed: Vec<_> = batches(r)
            .await
            .into_iter()
            .flat_map(|b| b.images)
            .collect();
        assert_eq!(streamed, listed, "{name}");
        assert_eq!(listed.is_empty(), name.starts_with("unknown"), "{name}");
    }
    eprintln!("whole test took {:?}", start.elapsed());
}

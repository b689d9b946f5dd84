//! Unit tests of the checks RunPodSandbox makes before it creates anything: pod identity, label
//! and annotation sizes, port mappings, bandwidth annotations.

use super::*;

fn meta(name: &str, namespace: &str, uid: &str) -> cri::PodSandboxConfig {
    cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: name.into(),
            namespace: namespace.into(),
            uid: uid.into(),
            attempt: 0,
        }),
        ..Default::default()
    }
}

#[test]
fn pod_identity_cannot_inject_cni_args_or_collide_names() {
    validate_metadata(&meta(
        "web-0",
        "default",
        "5f0c0c1e-1c5d-4bb5-8a0e-2f8a6f2e8d01",
    ))
    .unwrap();
    for (n, ns, uid) in [
        ("web;K8S_POD_NAMESPACE=kube-system", "default", "u"),
        ("web", "default;IgnoreUnknown=0", "u"),
        ("web", "default", "u\nx"),
        ("a_b", "c", "u"),
        ("web", "../x", "u"),
    ] {
        let e = validate_metadata(&meta(n, ns, uid)).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument(ref m) if m.contains("not a Kubernetes name")),
            "{n:?} {ns:?} {uid:?}: {e:?}"
        );
    }
    let long = "a".repeat(254);
    assert!(validate_metadata(&meta(&long, "default", "u")).is_err());
}

fn invalid(config: &cri::PodSandboxConfig, want: &str) {
    match validate_metadata(config) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains(want), "{m}"),
        other => panic!("expected InvalidArgument with {want:?}, got {other:?}"),
    }
}

#[test]
fn oversized_labels_or_annotations_are_refused() {
    let mut c = meta("web", "default", "u");
    // At the API server's limit: fine.
    c.annotations
        .insert("a".into(), "x".repeat(crate::pods::MAX_METADATA_BYTES - 1));
    validate_metadata(&c).unwrap();
    c.annotations.insert("b".into(), "y".into());
    invalid(
        &c,
        &format!(
            "annotations are {} bytes",
            crate::pods::MAX_METADATA_BYTES + 2
        ),
    );
    let mut c = meta("web", "default", "u");
    for i in 0..20_000 {
        c.labels.insert(format!("label-{i}"), "value".into());
    }
    invalid(&c, "labels are");
}

#[test]
fn port_mappings_are_checked_before_anything_is_created() {
    let with = |p: cri::PortMapping| cri::PodSandboxConfig {
        port_mappings: vec![p],
        ..meta("web", "default", "u")
    };
    let good = cri::PortMapping {
        protocol: cri::Protocol::Udp as i32,
        container_port: 53,
        host_port: 5353,
        host_ip: "127.0.0.1".into(),
    };
    validate_metadata(&with(good.clone())).unwrap();
    // No host port: nothing is published, the rest is the kubelet's business.
    validate_metadata(&with(cri::PortMapping {
        host_port: 0,
        container_port: 0,
        ..good.clone()
    }))
    .unwrap();
    for (bad, want) in [
        (
            cri::PortMapping {
                host_port: 70000,
                ..good.clone()
            },
            "port_mappings[0]: host_port 70000",
        ),
        (
            cri::PortMapping {
                host_port: -1,
                ..good.clone()
            },
            "host_port -1",
        ),
        (
            cri::PortMapping {
                container_port: 0,
                ..good.clone()
            },
            "container_port 0",
        ),
        (
            cri::PortMapping {
                protocol: 9,
                ..good.clone()
            },
            "unknown protocol 9",
        ),
        (
            cri::PortMapping {
                host_ip: "localhost".into(),
                ..good.clone()
            },
            "host_ip \"localhost\"",
        ),
    ] {
        invalid(&with(bad), want);
    }
    let many = |n: usize, host_port: i32| cri::PodSandboxConfig {
        port_mappings: vec![
            cri::PortMapping {
                host_port,
                ..good.clone()
            };
            n
        ],
        ..meta("web", "default", "u")
    };
    validate_metadata(&many(MAX_HOST_PORTS, 5353)).unwrap();
    validate_metadata(&many(MAX_HOST_PORTS * 4, 0)).unwrap();
    invalid(
        &many(MAX_HOST_PORTS + 1, 5353),
        "more than 1024 publish a host port",
    );
}

/// Bandwidth annotations, read by the CNI ADD that runs beside the infra's creation, are
/// checked with the rest of the config, before anything is created.
#[test]
fn bandwidth_annotations_are_checked_before_anything_is_created() {
    let with = |v: &str| cri::PodSandboxConfig {
        annotations: [("kubernetes.io/ingress-bandwidth".to_string(), v.to_string())].into(),
        ..meta("web", "default", "u")
    };
    validate_metadata(&with("10M")).unwrap();
    invalid(&with("1x"), "kubernetes.io/ingress-bandwidth");
    invalid(&with("1"), "not between 1k and 1P");
}

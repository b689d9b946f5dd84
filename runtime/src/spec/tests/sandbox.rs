//! Unit tests of the sandbox spec and files ([`crate::spec::sandbox`]); no root needed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use minicri_proto::runtime::v1 as cri;
use oci_spec::runtime::LinuxNamespaceType;

use crate::oci::annotations::AnnotationPolicy;
use crate::oci::{CgroupDriver, HostInfo};
use crate::spec::sandbox::validate_dns_and_hostname;
use crate::spec::*;

use super::container::{mount_of, ns_of};

fn sandbox_config() -> cri::PodSandboxConfig {
    cri::PodSandboxConfig {
        hostname: "pod-a".into(),
        linux: Some(cri::LinuxPodSandboxConfig {
            cgroup_parent: "/kubepods/pod1".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[test]
fn sandbox_spec_shape() {
    let host = HostInfo {
        oom_score_adj: 0,
        cap_sys_resource: false,
        cap_last_cap: 40,
        cap_bounding: u64::MAX,
        recursive_read_only: true,
        user_namespaces: true,
        cgroup_v2: false,
        apparmor: Default::default(),
    };
    let dir = tempfile::tempdir().unwrap();
    let infra = crate::pause::prepare_infra_rootfs(
        &dir.path().join("infra"),
        &std::env::current_exe().unwrap(),
    )
    .unwrap();
    let mut sandbox = sandbox_config();
    sandbox.linux.as_mut().unwrap().sysctls =
        HashMap::from([("net.ipv4.ip_forward".to_string(), "1".to_string())]);
    let params = SandboxSpecParams {
        id: "sb1",
        config: &sandbox,
        infra: &infra,
        netns: None,
        cgroup_driver: CgroupDriver::Cgroupfs,
        host: &host,
        annotations: &NO_ANNOTATIONS,
    };
    let spec = sandbox_spec(&params).unwrap();
    let p = spec.process().as_ref().unwrap();
    assert_eq!(p.args().as_ref().unwrap(), &["/minicri", "pause"]);
    assert_eq!((p.user().uid(), p.user().gid()), (65535, 65535));
    // The infra's user: ids as anywhere else, 0 to 4294967294.
    for (user, group) in [
        (Some(4294967295), None),
        (Some(1), Some(-1)),
        (Some(-5), None),
    ] {
        let mut odd = sandbox.clone();
        odd.linux.as_mut().unwrap().security_context = Some(cri::LinuxSandboxSecurityContext {
            run_as_user: user.map(|value| cri::Int64Value { value }),
            run_as_group: group.map(|value| cri::Int64Value { value }),
            ..Default::default()
        });
        let e = sandbox_spec(&SandboxSpecParams {
            config: &odd,
            ..params
        })
        .unwrap_err();
        assert!(
            matches!(&e, OciError::InvalidArgument(m) if m.contains("out of range")),
            "{user:?} {group:?}: {e:?}"
        );
    }
    assert_eq!(
        p.oom_score_adj(),
        Some(0),
        "-998 clamped without CAP_SYS_RESOURCE"
    );
    assert_eq!(spec.hostname().as_deref(), Some("pod-a"));
    assert_eq!(spec.root().as_ref().unwrap().readonly(), Some(true));
    use LinuxNamespaceType as T;
    assert_eq!(
        ns_of(&spec),
        vec![
            (T::Mount, None),
            (T::Pid, None),
            (T::Ipc, None),
            (T::Uts, None),
            (T::Network, None)
        ]
    );
    assert_eq!(
        mount_of(&spec, "/minicri").unwrap().source().as_deref(),
        Some(infra.binary.as_path())
    );
    assert!(mount_of(&spec, "/usr/lib").is_some());
    assert_eq!(
        spec.linux().as_ref().unwrap().sysctl().as_ref().unwrap()["net.ipv4.ip_forward"],
        "1"
    );
    assert!(spec.linux().as_ref().unwrap().seccomp().is_some());
    assert_eq!(
        spec.linux().as_ref().unwrap().cgroups_path().as_deref(),
        Some(Path::new("/kubepods/pod1/sb1"))
    );
    // A given netns is joined; sysctls of namespaces the pod does not own are refused.
    let netns = PathBuf::from("/run/netns/x");
    let spec = sandbox_spec(&SandboxSpecParams {
        netns: Some(&netns),
        ..params
    })
    .unwrap();
    assert!(ns_of(&spec).contains(&(T::Network, Some(netns.clone()))));
    let mut bad = sandbox.clone();
    bad.linux.as_mut().unwrap().sysctls =
        HashMap::from([("kernel.panic".to_string(), "1".to_string())]);
    assert!(
        sandbox_spec(&SandboxSpecParams {
            config: &bad,
            ..params
        })
        .is_err()
    );
    let mut host_net = sandbox.clone();
    host_net.linux.as_mut().unwrap().security_context = Some(cri::LinuxSandboxSecurityContext {
        namespace_options: Some(cri::NamespaceOption {
            network: cri::NamespaceMode::Node as i32,
            ..Default::default()
        }),
        ..Default::default()
    });
    assert!(
        sandbox_spec(&SandboxSpecParams {
            config: &host_net,
            ..params
        })
        .is_err(),
        "net sysctl with host network"
    );
}

#[test]
fn sandbox_file_contents() {
    let dns = cri::DnsConfig {
        servers: vec!["10.0.0.10".into()],
        searches: vec!["ns.svc".into(), "svc".into()],
        options: vec!["ndots:5".into()],
    };
    assert_eq!(
        sandbox::resolv_conf(&dns),
        "search ns.svc svc\nnameserver 10.0.0.10\noptions ndots:5\n"
    );
    assert!(sandbox::hosts_file("pod-a").contains("127.0.0.1\tlocalhost\n"));
    assert!(sandbox::hosts_file("pod-a").ends_with("pod-a\n"));
}

fn userns_pod() -> cri::PodSandboxConfig {
    let mut sandbox = sandbox_config();
    let m = vec![cri::IdMapping {
        host_id: 1000,
        container_id: 0,
        length: 100_000,
    }];
    sandbox.linux.as_mut().unwrap().security_context = Some(cri::LinuxSandboxSecurityContext {
        namespace_options: Some(cri::NamespaceOption {
            userns_options: Some(cri::UserNamespace {
                mode: cri::NamespaceMode::Pod as i32,
                uids: m.clone(),
                gids: m,
            }),
            ..Default::default()
        }),
        ..Default::default()
    });
    sandbox
}

#[test]
fn sandbox_in_its_own_user_namespace() {
    let host = HostInfo::default();
    let dir = tempfile::tempdir().unwrap();
    let infra = crate::pause::prepare_infra_rootfs(
        &dir.path().join("infra"),
        &std::env::current_exe().unwrap(),
    )
    .unwrap();
    let sandbox = userns_pod();
    let params = SandboxSpecParams {
        id: "sb1",
        config: &sandbox,
        infra: &infra,
        netns: None,
        cgroup_driver: CgroupDriver::Cgroupfs,
        host: &host,
        annotations: &NO_ANNOTATIONS,
    };
    let spec = sandbox_spec(&params).unwrap();
    use LinuxNamespaceType as T;
    let ns = ns_of(&spec);
    assert!(ns.contains(&(T::User, None)), "{ns:?}");
    assert!(
        ns.contains(&(T::Network, None)),
        "the infra creates the pod's netns inside the user namespace: {ns:?}"
    );
    let l = spec.linux().as_ref().unwrap();
    for maps in [l.uid_mappings(), l.gid_mappings()] {
        let m = maps.as_ref().unwrap();
        assert_eq!(m.len(), 1);
        assert_eq!(
            (m[0].container_id(), m[0].host_id(), m[0].size()),
            (0, 1000, 100_000)
        );
    }
    let u = spec.process().as_ref().unwrap().user();
    assert_eq!(
        (u.uid(), u.gid()),
        (0, 0),
        "the namespace's root, unprivileged"
    );
    // A host-owned network namespace cannot be joined from inside the user namespace.
    let netns = PathBuf::from("/run/netns/x");
    assert!(
        sandbox_spec(&SandboxSpecParams {
            netns: Some(&netns),
            ..params
        })
        .is_err()
    );
    // Containers of the pod join it.
    let ns = SandboxNamespaces::of_infra(77, &sandbox);
    assert_eq!(ns.user, Some(PathBuf::from("/proc/77/ns/user")));
    assert_eq!(
        SandboxNamespaces::of_infra(77, &sandbox_config()).user,
        None
    );
}

static NO_ANNOTATIONS: AnnotationPolicy = AnnotationPolicy::NONE;

#[test]
fn resolv_conf_and_hostname_cannot_gain_lines() {
    let with = |hostname: &str, dns: cri::DnsConfig| cri::PodSandboxConfig {
        hostname: hostname.into(),
        dns_config: Some(dns),
        ..Default::default()
    };
    let good = cri::DnsConfig {
        servers: vec!["10.96.0.10".into(), "fd00::a".into()],
        searches: vec!["default.svc.cluster.local".into()],
        options: vec!["ndots:5".into()],
    };
    validate_dns_and_hostname(&with("web-0", good.clone())).unwrap();
    validate_dns_and_hostname(&with(&"h".repeat(64), good.clone())).unwrap();
    let bad = [
        with("web\n127.0.0.1 evil", good.clone()),
        // Longer than the kernel's HOST_NAME_MAX.
        with(&"h".repeat(65), good.clone()),
        with(
            "web",
            cri::DnsConfig {
                servers: vec!["10.0.0.1\nnameserver 6.6.6.6".into()],
                ..good.clone()
            },
        ),
        with(
            "web",
            cri::DnsConfig {
                searches: vec!["a\noptions debug".into()],
                ..good.clone()
            },
        ),
        with(
            "web",
            cri::DnsConfig {
                options: vec!["ndots:5 attempts:9".into()],
                ..good.clone()
            },
        ),
        with(
            "web",
            cri::DnsConfig {
                servers: vec!["dns.example.com".into()],
                ..good.clone()
            },
        ),
    ];
    for c in bad {
        let e = validate_dns_and_hostname(&c).unwrap_err();
        assert!(
            e.to_string().contains("must be one word") || e.to_string().contains("not an IP"),
            "{e}"
        );
    }
}

/// Sysctls are few and short: thousands of them, a name longer than any the kernel has, or a
/// value longer than the page it is written in are refused, naming the problem.
#[test]
fn sysctls_are_few_and_short() {
    use crate::spec::sandbox::{MAX_SYSCTL_NAME, MAX_SYSCTL_VALUE, MAX_SYSCTLS, validate_sysctls};
    let with = |sysctls: HashMap<String, String>| {
        let mut c = sandbox_config();
        c.linux.as_mut().unwrap().sysctls = sysctls;
        validate_sysctls(&c)
    };
    let many = |n: usize| {
        (0..n)
            .map(|i| (format!("net.ipv4.conf.x{i}.forwarding"), "1".to_string()))
            .collect::<HashMap<_, _>>()
    };
    with(many(MAX_SYSCTLS)).unwrap();
    let err = with(many(MAX_SYSCTLS + 1)).unwrap_err().to_string();
    assert!(err.contains("257 sysctls, at most 256"), "{err}");
    let name = format!("net.{}", "a".repeat(MAX_SYSCTL_NAME));
    let err = with(HashMap::from([(name, "1".into())]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("names are at most 256 bytes"), "{err}");
    let value = "1".repeat(MAX_SYSCTL_VALUE + 1);
    let err = with(HashMap::from([("net.ipv4.ip_forward".into(), value)]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("value 4097 bytes"), "{err}");
    with(HashMap::from([(
        "net.ipv4.ip_forward".into(),
        "1".repeat(MAX_SYSCTL_VALUE),
    )]))
    .unwrap();
}

//! Unit tests of the CRI → OCI mapping ([`crate::spec::container`], [`crate::spec::sandbox`]); no root needed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use minicri_proto::runtime::v1 as cri;
use oci_spec::runtime::{Capability, LinuxNamespaceType, Spec};

use crate::oci::annotations::AnnotationPolicy;
use crate::oci::{CgroupDriver, HostInfo};
use crate::spec::*;

struct Fixture {
    rootfs: tempfile::TempDir,
    image: ImageConfig,
    sandbox: cri::PodSandboxConfig,
    ns: SandboxNamespaces,
    files: SandboxFiles,
    host: HostInfo,
}

fn fixture() -> Fixture {
    let rootfs = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(rootfs.path().join("etc")).unwrap();
    std::fs::write(
        rootfs.path().join("etc/passwd"),
        "root:x:0:0::/root:/bin/sh\napp:x:1001:1002::/home/app:/bin/sh\n",
    )
    .unwrap();
    std::fs::write(
        rootfs.path().join("etc/group"),
        "root:x:0:\napp:x:1002:\nextra:x:3000:app\n",
    )
    .unwrap();
    let sandbox = cri::PodSandboxConfig {
        hostname: "pod-a".into(),
        linux: Some(cri::LinuxPodSandboxConfig {
            cgroup_parent: "/kubepods/pod1".into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let ns = SandboxNamespaces::of_infra(4242, &sandbox);
    let files = SandboxFiles {
        hostname: Some("/sb/hostname".into()),
        resolv_conf: Some("/sb/resolv.conf".into()),
        hosts: Some("/sb/hosts".into()),
        shm: Some("/sb/shm".into()),
    };
    let image = ImageConfig {
        env: vec!["PATH=/usr/bin:/bin".into(), "FOO=image".into()],
        entrypoint: vec!["/entry".into()],
        cmd: vec!["default-arg".into()],
        working_dir: "/work".into(),
        ..Default::default()
    };
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
    Fixture {
        rootfs,
        image,
        sandbox,
        ns,
        files,
        host,
    }
}

fn build(f: &Fixture, c: &cri::ContainerConfig) -> Result<Spec> {
    build_with(f, c, &NO_ANNOTATIONS)
}

/// [`build`] with an annotation allowlist.
fn build_with(
    f: &Fixture,
    c: &cri::ContainerConfig,
    annotations: &AnnotationPolicy,
) -> Result<Spec> {
    container_spec(&ContainerSpecParams {
        id: "ctr1",
        config: c,
        sandbox_config: &f.sandbox,
        image: &f.image,
        rootfs: f.rootfs.path(),
        namespaces: &f.ns,
        files: &f.files,
        target_pid_ns: None,
        cgroup_driver: CgroupDriver::Cgroupfs,
        host: &f.host,
        annotations,
        sandbox_id: "sb1",
    })
}

static NO_ANNOTATIONS: AnnotationPolicy = AnnotationPolicy::NONE;

fn with_sc(sc: cri::LinuxContainerSecurityContext) -> cri::ContainerConfig {
    cri::ContainerConfig {
        linux: Some(cri::LinuxContainerConfig {
            security_context: Some(sc),
            resources: None,
        }),
        ..Default::default()
    }
}

/// The namespaces of `spec`: (type, path to join).
pub(super) fn ns_of(spec: &Spec) -> Vec<(LinuxNamespaceType, Option<PathBuf>)> {
    spec.linux()
        .as_ref()
        .unwrap()
        .namespaces()
        .as_ref()
        .unwrap()
        .iter()
        .map(|n| (n.typ(), n.path().clone()))
        .collect()
}

/// The mount of `spec` at `dest`.
pub(super) fn mount_of<'a>(spec: &'a Spec, dest: &str) -> Option<&'a oci_spec::runtime::Mount> {
    spec.mounts()
        .as_ref()
        .unwrap()
        .iter()
        .find(|m| m.destination() == Path::new(dest))
}

#[test]
fn process_from_image_and_cri() {
    let f = fixture();
    let spec = build(&f, &cri::ContainerConfig::default()).unwrap();
    let p = spec.process().as_ref().unwrap();
    assert_eq!(p.args().as_ref().unwrap(), &["/entry", "default-arg"]);
    assert_eq!(p.cwd(), Path::new("/work"));
    assert_eq!(
        p.env().as_ref().unwrap(),
        &["HOSTNAME=pod-a", "PATH=/usr/bin:/bin", "FOO=image"]
    );
    assert_eq!((p.user().uid(), p.user().gid()), (0, 0));
    assert_eq!(spec.root().as_ref().unwrap().path(), f.rootfs.path());

    let c = cri::ContainerConfig {
        command: vec!["/bin/sh".into()],
        args: vec!["-c".into(), "true".into()],
        working_dir: "/tmp".into(),
        envs: vec![
            cri::KeyValue {
                key: "FOO".into(),
                value: b"cri".to_vec(),
            },
            cri::KeyValue {
                key: "NEW".into(),
                value: b"1".to_vec(),
            },
        ],
        ..Default::default()
    };
    let spec = build(&f, &c).unwrap();
    let p = spec.process().as_ref().unwrap();
    assert_eq!(p.args().as_ref().unwrap(), &["/bin/sh", "-c", "true"]);
    assert_eq!(p.cwd(), Path::new("/tmp"));
    assert_eq!(
        p.env().as_ref().unwrap(),
        &["HOSTNAME=pod-a", "PATH=/usr/bin:/bin", "FOO=cri", "NEW=1"]
    );
    // args alone replace Cmd but keep the Entrypoint.
    let spec = build(
        &f,
        &cri::ContainerConfig {
            args: vec!["x".into()],
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(
        spec.process().as_ref().unwrap().args().as_ref().unwrap(),
        &["/entry", "x"]
    );
    // Nothing to run.
    let mut empty = fixture();
    empty.image = ImageConfig::default();
    assert!(build(&empty, &cri::ContainerConfig::default()).is_err());
    assert_eq!(
        container::process_env("h", &[], &[]).unwrap(),
        ["HOSTNAME=h", container::DEFAULT_PATH]
    );
    assert_eq!(p.terminal(), Some(false));
}

/// Entries the OCI runtime refuses when it starts the container are refused at once, naming
/// them; an image entry without `=` unsets its name (Docker's rule), and a later one sets it again.
#[test]
fn environments_the_runtime_would_refuse_are_refused_when_created() {
    let kv = |key: &str, value: &str| cri::KeyValue {
        key: key.into(),
        value: value.as_bytes().to_vec(),
    };
    let image = |e: &[&str]| e.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        container::process_env("h", &image(&["A=1", "B=2", "A", "C=3"]), &[kv("A", "cri")])
            .unwrap(),
        ["HOSTNAME=h", "A=cri", "B=2", "C=3", container::DEFAULT_PATH]
    );
    assert_eq!(
        container::process_env("h", &image(&["A=1", "A"]), &[]).unwrap(),
        ["HOSTNAME=h", container::DEFAULT_PATH]
    );
    for bad in [&["=1"][..], &["A=\0"], &[""]] {
        let e = container::process_env("h", &image(bad), &[]).unwrap_err();
        assert!(matches!(e, OciError::InvalidArgument(_)), "{bad:?}: {e}");
    }
    // A key with `=` would name another variable ("A=B" = "v" sets A to "B=v"), or none ("=A").
    for bad in [
        kv("", "1"),
        kv("A\0", "1"),
        kv("A", "x\0y"),
        kv("=A", "1"),
        kv("A=B", "v"),
    ] {
        let e = container::process_env("h", &[], std::slice::from_ref(&bad)).unwrap_err();
        assert!(e.to_string().contains("envs[0]"), "{bad:?}: {e}");
    }
    let f = fixture();
    for config in [
        cri::ContainerConfig {
            command: vec!["sh".into(), "-c\0x".into()],
            ..Default::default()
        },
        cri::ContainerConfig {
            working_dir: "/srv\0/x".into(),
            ..Default::default()
        },
    ] {
        let e = build(&f, &config).unwrap_err();
        assert!(matches!(e, OciError::InvalidArgument(_)), "{config:?}: {e}");
        assert!(e.to_string().contains("NUL"), "{e}");
    }
}

#[test]
fn a_huge_image_env_is_merged_in_linear_time() {
    // 200,000 distinct keys (an image config near its 8 MiB cap holds more): a scan per entry
    // took minutes; the whole merge must take well under a second even in a debug build.
    let image: Vec<String> = (0..200_000).map(|i| format!("K{i}=1")).collect();
    let cri_env = vec![cri::KeyValue {
        key: "K7".into(),
        value: b"cri".to_vec(),
    }];
    let t = std::time::Instant::now();
    let env = container::process_env("h", &image, &cri_env).unwrap();
    assert!(
        t.elapsed() < std::time::Duration::from_secs(2),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(env.len(), 200_002, "HOSTNAME, the image's keys, PATH");
    assert_eq!(env[0], "HOSTNAME=h");
    assert_eq!(env[8], "K7=cri", "replaced in place");
    assert_eq!(env[200_000], "K199999=1");
}

#[test]
fn tty_containers_get_a_terminal_and_term() {
    let f = fixture();
    let tty = cri::ContainerConfig {
        tty: true,
        stdin: true,
        ..Default::default()
    };
    let spec = build(&f, &tty).unwrap();
    let p = spec.process().as_ref().unwrap();
    assert_eq!(p.terminal(), Some(true));
    assert_eq!(
        p.env().as_ref().unwrap().last().map(String::as_str),
        Some("TERM=xterm")
    );
    // A TERM of the container's own is kept.
    let own = cri::ContainerConfig {
        envs: vec![cri::KeyValue {
            key: "TERM".into(),
            value: b"vt100".to_vec(),
        }],
        ..tty
    };
    let spec = build(&f, &own).unwrap();
    let env = spec.process().as_ref().unwrap().env().clone().unwrap();
    assert_eq!(
        env.iter()
            .filter(|e| e.starts_with("TERM="))
            .collect::<Vec<_>>(),
        ["TERM=vt100"]
    );
}

#[test]
fn users() {
    let f = fixture();
    let spec = build(
        &f,
        &with_sc(cri::LinuxContainerSecurityContext {
            run_as_username: "app".into(),
            supplemental_groups: vec![5],
            ..Default::default()
        }),
    )
    .unwrap();
    let u = spec.process().as_ref().unwrap().user();
    assert_eq!(
        (u.uid(), u.gid(), u.additional_gids().clone()),
        (1001, 1002, Some(vec![1002, 3000, 5]))
    );
    let spec = build(
        &f,
        &with_sc(cri::LinuxContainerSecurityContext {
            run_as_user: Some(cri::Int64Value { value: 1001 }),
            run_as_group: Some(cri::Int64Value { value: 7 }),
            ..Default::default()
        }),
    )
    .unwrap();
    let u = spec.process().as_ref().unwrap().user();
    assert_eq!((u.uid(), u.gid()), (1001, 7));
    assert!(
        build(
            &f,
            &with_sc(cri::LinuxContainerSecurityContext {
                run_as_username: "ghost".into(),
                ..Default::default()
            })
        )
        .is_err()
    );
}

#[test]
fn namespaces_join_the_sandbox() {
    let f = fixture();
    let spec = build(&f, &cri::ContainerConfig::default()).unwrap();
    let p = |n: &str| Some(PathBuf::from(format!("/proc/4242/ns/{n}")));
    use LinuxNamespaceType as T;
    assert_eq!(
        ns_of(&spec),
        vec![
            (T::Mount, None),
            (T::Network, p("net")),
            (T::Ipc, p("ipc")),
            (T::Uts, p("uts")),
            (T::Pid, None)
        ]
    );
    let pod_pid = with_sc(cri::LinuxContainerSecurityContext {
        namespace_options: Some(cri::NamespaceOption {
            pid: cri::NamespaceMode::Pod as i32,
            ..Default::default()
        }),
        ..Default::default()
    });
    assert!(ns_of(&build(&f, &pod_pid).unwrap()).contains(&(T::Pid, p("pid"))));
    // Host network and IPC: no such namespaces, the host's /dev/shm, the host's hostname.
    let mut host = fixture();
    host.sandbox.linux.as_mut().unwrap().security_context =
        Some(cri::LinuxSandboxSecurityContext {
            namespace_options: Some(cri::NamespaceOption {
                network: cri::NamespaceMode::Node as i32,
                ipc: cri::NamespaceMode::Node as i32,
                pid: cri::NamespaceMode::Node as i32,
                ..Default::default()
            }),
            ..Default::default()
        });
    host.ns = SandboxNamespaces::of_infra(4242, &host.sandbox);
    assert_eq!(
        host.ns,
        SandboxNamespaces {
            net: None,
            ipc: None,
            uts: None,
            pid: None,
            user: None,
        }
    );
    let spec = build(&host, &cri::ContainerConfig::default()).unwrap();
    assert_eq!(ns_of(&spec), vec![(T::Mount, None), (T::Pid, None)]);
    // The host's PID namespace: for a container of a host-PID pod, and no other.
    let node_pid = with_sc(cri::LinuxContainerSecurityContext {
        namespace_options: Some(cri::NamespaceOption {
            pid: cri::NamespaceMode::Node as i32,
            ..Default::default()
        }),
        ..Default::default()
    });
    assert_eq!(
        ns_of(&build(&host, &node_pid).unwrap()),
        vec![(T::Mount, None)]
    );
    let e = build(&f, &node_pid).unwrap_err();
    assert!(
        matches!(&e, OciError::InvalidArgument(m) if m.contains("pid namespace NODE")),
        "{e:?}"
    );
    assert_eq!(
        mount_of(&spec, "/dev/shm").unwrap().source().as_deref(),
        Some(Path::new("/dev/shm"))
    );
    assert!(spec.hostname().is_none());
}

#[test]
fn mounts_and_propagation() {
    let f = fixture();
    let c = cri::ContainerConfig {
        mounts: vec![
            cri::Mount {
                container_path: "/data/sub".into(),
                host_path: "/h/sub".into(),
                readonly: true,
                ..Default::default()
            },
            cri::Mount {
                container_path: "/data".into(),
                host_path: "/h/data".into(),
                propagation: cri::MountPropagation::PropagationHostToContainer as i32,
                ..Default::default()
            },
            cri::Mount {
                container_path: "/etc/hosts".into(),
                host_path: "/kubelet/hosts".into(),
                ..Default::default()
            },
        ],
        ..Default::default()
    };
    let spec = build(&f, &c).unwrap();
    let dests: Vec<&Path> = spec
        .mounts()
        .as_ref()
        .unwrap()
        .iter()
        .map(|m| m.destination().as_path())
        .collect();
    let pos = |d: &str| dests.iter().position(|x| *x == Path::new(d)).unwrap();
    assert!(pos("/data") < pos("/data/sub"), "parents first: {dests:?}");
    assert_eq!(
        dests
            .iter()
            .filter(|d| **d == Path::new("/etc/hosts"))
            .count(),
        1,
        "CRI /etc/hosts replaces ours"
    );
    assert_eq!(
        mount_of(&spec, "/etc/hosts").unwrap().source().as_deref(),
        Some(Path::new("/kubelet/hosts"))
    );
    assert_eq!(
        mount_of(&spec, "/data/sub")
            .unwrap()
            .options()
            .as_ref()
            .unwrap(),
        &["rbind", "rprivate", "ro"]
    );
    assert_eq!(
        mount_of(&spec, "/data")
            .unwrap()
            .options()
            .as_ref()
            .unwrap(),
        &["rbind", "rslave", "rw"]
    );
    assert_eq!(
        spec.linux()
            .as_ref()
            .unwrap()
            .rootfs_propagation()
            .as_deref(),
        Some("rslave")
    );
    assert_eq!(
        mount_of(&spec, "/dev/shm").unwrap().source().as_deref(),
        Some(Path::new("/sb/shm"))
    );
    assert_eq!(
        mount_of(&spec, "/etc/resolv.conf")
            .unwrap()
            .source()
            .as_deref(),
        Some(Path::new("/sb/resolv.conf"))
    );
    assert!(
        mount_of(&spec, "/sys")
            .unwrap()
            .options()
            .as_ref()
            .unwrap()
            .contains(&"ro".to_string())
    );
    for bad in [
        cri::Mount {
            container_path: "relative".into(),
            host_path: "/x".into(),
            ..Default::default()
        },
        cri::Mount {
            container_path: "/x".into(),
            host_path: "/x".into(),
            recursive_read_only: true,
            ..Default::default()
        },
    ] {
        assert!(
            build(
                &f,
                &cri::ContainerConfig {
                    mounts: vec![bad],
                    ..Default::default()
                }
            )
            .is_err()
        );
    }
    let shared = cri::ContainerConfig {
        mounts: vec![cri::Mount {
            container_path: "/s".into(),
            host_path: "/s".into(),
            propagation: cri::MountPropagation::PropagationBidirectional as i32,
            ..Default::default()
        }],
        ..Default::default()
    };
    assert_eq!(
        build(&f, &shared)
            .unwrap()
            .linux()
            .as_ref()
            .unwrap()
            .rootfs_propagation()
            .as_deref(),
        Some("rshared")
    );
}

#[test]
fn capabilities_and_seccomp() {
    let f = fixture();
    let host = f.host;
    let set = container::capability_set(None, &host).unwrap();
    assert_eq!(set.len(), 14);
    let caps = cri::Capability {
        add_capabilities: vec!["NET_ADMIN".into()],
        drop_capabilities: vec!["CAP_KILL".into()],
        ..Default::default()
    };
    let set = container::capability_set(Some(&caps), &host).unwrap();
    assert!(set.contains(&Capability::NetAdmin) && !set.contains(&Capability::Kill));
    let caps = cri::Capability {
        add_capabilities: vec!["CHOWN".into()],
        drop_capabilities: vec!["ALL".into()],
        ..Default::default()
    };
    assert_eq!(
        container::capability_set(Some(&caps), &host).unwrap().len(),
        1
    );
    let caps = cri::Capability {
        add_capabilities: vec!["ALL".into()],
        ..Default::default()
    };
    assert_eq!(
        container::capability_set(Some(&caps), &host).unwrap().len(),
        41
    );

    let sc = |p: Option<cri::SecurityProfile>| {
        with_sc(cri::LinuxContainerSecurityContext {
            seccomp: p,
            ..Default::default()
        })
    };
    let spec = build(&f, &sc(None)).unwrap();
    assert!(
        spec.linux().as_ref().unwrap().seccomp().is_none(),
        "absent profile is unconfined"
    );
    let spec = build(&f, &sc(Some(cri::SecurityProfile::default()))).unwrap();
    assert!(
        spec.linux().as_ref().unwrap().seccomp().is_some(),
        "RuntimeDefault"
    );
    let unconfined = cri::SecurityProfile {
        profile_type: cri::security_profile::ProfileType::Unconfined as i32,
        ..Default::default()
    };
    assert!(
        build(&f, &sc(Some(unconfined)))
            .unwrap()
            .linux()
            .as_ref()
            .unwrap()
            .seccomp()
            .is_none()
    );
    let missing = cri::SecurityProfile {
        profile_type: cri::security_profile::ProfileType::Localhost as i32,
        localhost_ref: "/nonexistent.json".into(),
    };
    assert!(build(&f, &sc(Some(missing))).is_err());
}

#[test]
fn privileged_and_paths() {
    let mut f = fixture();
    let priv_sc = with_sc(cri::LinuxContainerSecurityContext {
        privileged: true,
        ..Default::default()
    });
    assert!(build(&f, &priv_sc).is_err(), "needs a privileged sandbox");
    f.sandbox.linux.as_mut().unwrap().security_context = Some(cri::LinuxSandboxSecurityContext {
        privileged: true,
        ..Default::default()
    });
    let spec = build(&f, &priv_sc).unwrap();
    let l = spec.linux().as_ref().unwrap();
    assert!(l.masked_paths().is_none() && l.readonly_paths().is_none() && l.seccomp().is_none());
    assert_eq!(
        spec.process()
            .as_ref()
            .unwrap()
            .capabilities()
            .as_ref()
            .unwrap()
            .bounding()
            .as_ref()
            .unwrap()
            .len(),
        41
    );
    assert!(
        mount_of(&spec, "/sys")
            .unwrap()
            .options()
            .as_ref()
            .unwrap()
            .contains(&"rw".to_string())
    );
    let rules = l.resources().as_ref().unwrap().devices().as_ref().unwrap();
    assert_eq!(rules.len(), 1);
    assert!(rules[0].allow());

    let f = fixture();
    let spec = build(&f, &cri::ContainerConfig::default()).unwrap();
    let l = spec.linux().as_ref().unwrap();
    assert_eq!(
        l.masked_paths().as_ref().unwrap().len(),
        defaults::DEFAULT_MASKED_PATHS.len()
    );
    let custom = with_sc(cri::LinuxContainerSecurityContext {
        masked_paths: vec!["/proc/x".into()],
        readonly_paths: vec!["/proc/y".into()],
        readonly_rootfs: true,
        no_new_privs: true,
        ..Default::default()
    });
    let spec = build(&f, &custom).unwrap();
    let l = spec.linux().as_ref().unwrap();
    assert_eq!(l.masked_paths().as_ref().unwrap(), &["/proc/x"]);
    assert_eq!(l.readonly_paths().as_ref().unwrap(), &["/proc/y"]);
    assert_eq!(spec.root().as_ref().unwrap().readonly(), Some(true));
    assert_eq!(
        spec.process().as_ref().unwrap().no_new_privileges(),
        Some(true)
    );
    assert!(
        mount_of(&spec, "/etc/hosts")
            .unwrap()
            .options()
            .as_ref()
            .unwrap()
            .contains(&"ro".to_string())
    );
}

#[test]
fn devices() {
    let f = fixture();
    let c = cri::ContainerConfig {
        devices: vec![cri::Device {
            container_path: "/dev/xnull".into(),
            host_path: "/dev/null".into(),
            permissions: "rw".into(),
        }],
        ..Default::default()
    };
    let spec = build(&f, &c).unwrap();
    let l = spec.linux().as_ref().unwrap();
    let d = &l.devices().as_ref().unwrap()[0];
    assert_eq!(
        (d.path().as_path(), d.major(), d.minor()),
        (Path::new("/dev/xnull"), 1, 3)
    );
    let last = l
        .resources()
        .as_ref()
        .unwrap()
        .devices()
        .as_ref()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert_eq!(
        (last.major(), last.minor(), last.access().as_deref()),
        (Some(1), Some(3), Some("rw"))
    );
    let bad = cri::ContainerConfig {
        devices: vec![cri::Device {
            container_path: "/dev/x".into(),
            host_path: "/dev/does-not-exist".into(),
            permissions: "rw".into(),
        }],
        ..Default::default()
    };
    assert!(build(&f, &bad).is_err());
    // What runc would refuse at start is refused here: NUL bytes, permissions beyond r, w, m.
    for (container_path, host_path, permissions, says) in [
        ("/dev/x\0", "/dev/null", "rw", "NUL"),
        ("/dev/x", "/dev/null\0", "rw", "NUL"),
        ("/dev/x", "/dev/null", "rwx", "permissions"),
    ] {
        let c = cri::ContainerConfig {
            devices: vec![cri::Device {
                container_path: container_path.into(),
                host_path: host_path.into(),
                permissions: permissions.into(),
            }],
            ..Default::default()
        };
        let e = build(&f, &c).unwrap_err();
        assert!(
            matches!(&e, OciError::InvalidArgument(m) if m.contains(says)),
            "{says}: {e:?}"
        );
    }
    for (container_path, host_path) in [("/m\0", "/h"), ("/m", "/h\0")] {
        let c = cri::ContainerConfig {
            mounts: vec![cri::Mount {
                container_path: container_path.into(),
                host_path: host_path.into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let e = build(&f, &c).unwrap_err();
        assert!(
            matches!(&e, OciError::InvalidArgument(m) if m.contains("NUL")),
            "{e:?}"
        );
        assert!(container::validate_mounts(&c.mounts, &f.host).is_err());
    }
}

/// Resource values the kernel would refuse when the runtime writes the cgroup are refused by
/// name when the spec is built (at CreateContainer and UpdateContainerResources).
#[test]
fn resources_the_kernel_would_refuse_are_refused() {
    let ok = cri::LinuxContainerResources {
        cpu_quota: -1,
        cpu_period: 1_000_000,
        cpuset_cpus: "0-3,7".into(),
        cpuset_mems: "0".into(),
        hugepage_limits: vec![cri::HugepageLimit {
            page_size: "1GB".into(),
            limit: 1 << 30,
        }],
        ..Default::default()
    };
    let host = fixture().host;
    container::linux_resources(&ok, &host).unwrap();
    type Change = fn(&mut cri::LinuxContainerResources);
    let cases: [(&str, Change); 8] = [
        ("cpu_period", |r| r.cpu_period = 999),
        ("cpu_period", |r| r.cpu_period = 1_000_001),
        ("cpu_quota", |r| r.cpu_quota = 999),
        ("cpu_quota", |r| r.cpu_quota = -2),
        ("cpuset_cpus", |r| r.cpuset_cpus = "0-".into()),
        ("cpuset_mems", |r| r.cpuset_mems = "a".into()),
        ("limit", |r| r.hugepage_limits[0].limit = u64::MAX),
        ("page_size", |r| {
            r.hugepage_limits[0].page_size = "2XB".into()
        }),
    ];
    for (field, change) in cases {
        let mut r = ok.clone();
        change(&mut r);
        let e = container::linux_resources(&r, &host).unwrap_err();
        assert!(
            matches!(&e, OciError::InvalidArgument(m) if m.contains(field)),
            "{field}: {e:?}"
        );
    }
}

#[test]
fn resources_and_oom_clamp() {
    let f = fixture();
    let c = cri::ContainerConfig {
        linux: Some(cri::LinuxContainerConfig {
            resources: Some(cri::LinuxContainerResources {
                cpu_shares: 512,
                cpu_quota: 50_000,
                cpu_period: 100_000,
                cpuset_cpus: "0".into(),
                memory_limit_in_bytes: 64 << 20,
                oom_score_adj: -500,
                hugepage_limits: vec![cri::HugepageLimit {
                    page_size: "2MB".into(),
                    limit: 4 << 20,
                }],
                unified: HashMap::from([("memory.high".to_string(), "1".to_string())]),
                ..Default::default()
            }),
            security_context: None,
        }),
        ..Default::default()
    };
    let spec = build(&f, &c).unwrap();
    let r = spec.linux().as_ref().unwrap().resources().as_ref().unwrap();
    let cpu = r.cpu().as_ref().unwrap();
    assert_eq!(
        (
            cpu.shares(),
            cpu.quota(),
            cpu.period(),
            cpu.cpus().as_deref()
        ),
        (Some(512), Some(50_000), Some(100_000), Some("0"))
    );
    let mem = r.memory().as_ref().unwrap();
    assert_eq!((mem.limit(), mem.swap()), (Some(64 << 20), Some(64 << 20)));
    assert_eq!(r.hugepage_limits().as_ref().unwrap()[0].limit(), 4 << 20);
    assert!(r.unified().is_none(), "unified is for cgroup v2 only");
    // -500 without CAP_SYS_RESOURCE from a process at 0: clamped to 0.
    assert_eq!(spec.process().as_ref().unwrap().oom_score_adj(), Some(0));
    let mut strong = fixture();
    strong.host.cap_sys_resource = true;
    strong.host.cgroup_v2 = true;
    let spec = build(&strong, &c).unwrap();
    assert_eq!(spec.process().as_ref().unwrap().oom_score_adj(), Some(-500));
    assert!(
        spec.linux()
            .as_ref()
            .unwrap()
            .resources()
            .as_ref()
            .unwrap()
            .unified()
            .is_some()
    );
    assert!(ns_of(&spec).contains(&(LinuxNamespaceType::Cgroup, None)));
    assert_eq!(
        spec.linux().as_ref().unwrap().cgroups_path().as_deref(),
        Some(Path::new("/kubepods/pod1/ctr1"))
    );
}

/// This machine's root: every capability but `CAP_SYS_RESOURCE` (24) in its bounding set.
fn host_without_sys_resource() -> HostInfo {
    HostInfo {
        cap_bounding: 0x1ff_feff_ffff,
        ..fixture().host
    }
}

#[test]
fn capabilities_follow_the_bounding_set() {
    let host = host_without_sys_resource();
    let all = cri::Capability {
        add_capabilities: vec!["ALL".into()],
        ..Default::default()
    };
    let set = container::capability_set(Some(&all), &host).unwrap();
    assert_eq!(set.len(), 40);
    assert!(!set.contains(&Capability::SysResource));
    assert!(set.contains(&Capability::SysAdmin) && set.contains(&Capability::CheckpointRestore));
    // Naming a capability the runtime cannot pass on is an error, not a runc failure later.
    let explicit = cri::Capability {
        add_capabilities: vec!["SYS_RESOURCE".into()],
        ..Default::default()
    };
    let err = container::capability_set(Some(&explicit), &host).unwrap_err();
    assert!(err.to_string().contains("SYS_RESOURCE"), "{err}");
    // Defaults the host lacks are left out quietly.
    let no_audit = HostInfo {
        cap_bounding: !(1 << 29), // CAP_AUDIT_WRITE
        ..fixture().host
    };
    let set = container::capability_set(None, &no_audit).unwrap();
    assert_eq!(set.len(), 13);
    assert!(!set.contains(&Capability::AuditWrite));
    // An older kernel knows fewer capabilities.
    let old = HostInfo {
        cap_last_cap: 37,
        ..fixture().host
    };
    assert_eq!(
        container::capability_set(Some(&all), &old).unwrap().len(),
        38
    );

    // A privileged container gets exactly what the host can give, in every set.
    let mut f = fixture();
    f.host = host;
    f.sandbox.linux.as_mut().unwrap().security_context = Some(cri::LinuxSandboxSecurityContext {
        privileged: true,
        ..Default::default()
    });
    let spec = build(
        &f,
        &with_sc(cri::LinuxContainerSecurityContext {
            privileged: true,
            ..Default::default()
        }),
    )
    .unwrap();
    let caps = spec
        .process()
        .as_ref()
        .unwrap()
        .capabilities()
        .clone()
        .unwrap();
    for set in [caps.bounding(), caps.effective(), caps.permitted()] {
        let set = set.as_ref().unwrap();
        assert_eq!(set.len(), 40);
        assert!(!set.contains(&Capability::SysResource));
    }
    assert!(caps.inheritable().as_ref().unwrap().is_empty());
}

#[test]
fn recursive_read_only_mounts() {
    let f = fixture();
    let rro = |readonly: bool, propagation: cri::MountPropagation| cri::ContainerConfig {
        mounts: vec![cri::Mount {
            container_path: "/mnt".into(),
            host_path: "/h/tree".into(),
            readonly,
            recursive_read_only: true,
            propagation: propagation as i32,
            ..Default::default()
        }],
        ..Default::default()
    };
    let spec = build(&f, &rro(true, cri::MountPropagation::PropagationPrivate)).unwrap();
    assert_eq!(
        mount_of(&spec, "/mnt").unwrap().options().as_ref().unwrap(),
        &["rbind", "rprivate", "ro", "rro"]
    );
    assert_eq!(
        spec.linux()
            .as_ref()
            .unwrap()
            .rootfs_propagation()
            .as_deref(),
        None,
        "private mounts leave the rootfs propagation to the runtime's default"
    );
    // The CRI's rules: read-only, and private propagation.
    for (readonly, prop) in [
        (false, cri::MountPropagation::PropagationPrivate),
        (true, cri::MountPropagation::PropagationHostToContainer),
        (true, cri::MountPropagation::PropagationBidirectional),
    ] {
        let err = build(&f, &rro(readonly, prop)).unwrap_err();
        assert!(err.to_string().contains("recursive_read_only"), "{err}");
    }
    // A host (kernel or OCI runtime) that cannot do it refuses instead of mounting rw below.
    let mut old = fixture();
    old.host.recursive_read_only = false;
    let err = build(&old, &rro(true, cri::MountPropagation::PropagationPrivate)).unwrap_err();
    assert!(err.to_string().contains("not supported"), "{err}");
    // Plain read-only mounts need nothing of the host.
    let ro = cri::ContainerConfig {
        mounts: vec![cri::Mount {
            container_path: "/mnt".into(),
            host_path: "/h/tree".into(),
            readonly: true,
            ..Default::default()
        }],
        ..Default::default()
    };
    assert_eq!(
        mount_of(&build(&old, &ro).unwrap(), "/mnt")
            .unwrap()
            .options()
            .as_ref()
            .unwrap(),
        &["rbind", "rprivate", "ro"]
    );
    // The same rules are checked before CreateContainer touches the host; id mappings are
    // left to the pod's user namespace (crate::spec::userns), cri_mounts refuses them.
    let bad = rro(true, cri::MountPropagation::PropagationBidirectional);
    assert!(container::validate_mounts(&bad.mounts, &f.host).is_err());
    let mapped = vec![cri::Mount {
        container_path: "/v".into(),
        host_path: "/h/v".into(),
        uid_mappings: vec![cri::IdMapping {
            host_id: 1000,
            container_id: 0,
            length: 10,
        }],
        ..Default::default()
    }];
    container::validate_mounts(&mapped, &f.host).unwrap();
    let err = container::cri_mounts(&mapped, &f.host).unwrap_err();
    assert!(err.to_string().contains("user namespace"), "{err}");
    // A mount needs a source.
    let no_source = cri::ContainerConfig {
        mounts: vec![cri::Mount {
            container_path: "/mnt".into(),
            ..Default::default()
        }],
        ..Default::default()
    };
    assert!(build(&f, &no_source).is_err());
    // Nor a relative one: the OCI runtime would resolve it inside the container's bundle.
    for rel in [".", "config.json", "a/../.."] {
        let relative = vec![cri::Mount {
            container_path: "/mnt".into(),
            host_path: rel.into(),
            ..Default::default()
        }];
        let err = container::validate_mounts(&relative, &f.host).unwrap_err();
        assert!(
            matches!(&err, crate::oci::OciError::InvalidArgument(m) if m.contains("is not absolute")),
            "{err:?}"
        );
    }
}

/// Image volumes: checked before CreateContainer mounts them (no host_path of the caller's, a
/// sub path relative and without `..`, no Bidirectional), then bound from where it mounted them,
/// read-only, nosuid and nodev, private, whatever was asked.
#[test]
fn image_volume_mounts() {
    let f = fixture();
    let image = |sub: &str| cri::Mount {
        container_path: "/models".into(),
        readonly: true,
        image: Some(cri::ImageSpec {
            image: "sha256:abc".into(),
            ..Default::default()
        }),
        image_sub_path: sub.into(),
        ..Default::default()
    };
    container::validate_mounts(&[image(""), image("a/b")], &f.host).unwrap();
    let refused = |m: cri::Mount, want: &str| {
        let err = container::validate_mounts(&[m], &f.host).unwrap_err();
        assert!(
            matches!(&err, crate::oci::OciError::InvalidArgument(msg) if msg.contains(want)),
            "{want}: {err:?}"
        );
    };
    refused(
        cri::Mount {
            host_path: "/h".into(),
            ..image("")
        },
        "both an image and a host_path",
    );
    refused(image("../up"), "'..'");
    refused(image("a/../../up"), "'..'");
    refused(image("/abs"), "not relative");
    refused(image("a\0b"), "NUL");
    refused(image(&"a/".repeat(3000)), "longer than");
    refused(
        cri::Mount {
            propagation: cri::MountPropagation::PropagationBidirectional as i32,
            ..image("")
        },
        "Bidirectional",
    );
    refused(
        cri::Mount {
            container_path: "/x".into(),
            host_path: "/h".into(),
            image_sub_path: "a".into(),
            ..Default::default()
        },
        "names no image",
    );
    let many: Vec<cri::Mount> = (0..=container::MAX_IMAGE_VOLUMES)
        .map(|n| cri::Mount {
            container_path: format!("/m{n}"),
            ..image("")
        })
        .collect();
    let err = container::validate_mounts(&many, &f.host).unwrap_err();
    assert!(err.to_string().contains("image volumes"), "{err}");

    // The spec needs the volume mounted first.
    let unprepared = cri::ContainerConfig {
        mounts: vec![image("")],
        ..Default::default()
    };
    let err = build(&f, &unprepared).unwrap_err();
    assert!(err.to_string().contains("was not mounted"), "{err}");
    // Mounted: bound read-only even if not asked, private even if asked HostToContainer.
    let prepared = cri::ContainerConfig {
        mounts: vec![cri::Mount {
            host_path: "/state/containers/c/volumes/0/image".into(),
            readonly: false,
            propagation: cri::MountPropagation::PropagationHostToContainer as i32,
            ..image("")
        }],
        ..Default::default()
    };
    let spec = build(&f, &prepared).unwrap();
    let m = mount_of(&spec, "/models").unwrap();
    assert_eq!(
        m.source().as_deref(),
        Some(Path::new("/state/containers/c/volumes/0/image"))
    );
    assert_eq!(
        m.options().as_ref().unwrap(),
        &["rbind", "rprivate", "ro", "nosuid", "nodev"]
    );
    assert_eq!(
        spec.linux()
            .as_ref()
            .unwrap()
            .rootfs_propagation()
            .as_deref(),
        None,
        "no propagation asked of the rootfs for it"
    );
}

/// Each mount costs a mount at every start (and, in a pod user namespace, one kept in the host's
/// mount namespace): a spec listing thousands is refused, naming the count.
#[test]
fn the_number_of_mounts_is_capped() {
    let f = fixture();
    let mounts = |n: usize| -> Vec<cri::Mount> {
        (0..n)
            .map(|i| cri::Mount {
                container_path: format!("/m/{i}"),
                host_path: "/tmp".into(),
                ..Default::default()
            })
            .collect()
    };
    container::validate_mounts(&mounts(container::MAX_MOUNTS), &f.host).unwrap();
    let err = container::validate_mounts(&mounts(container::MAX_MOUNTS + 1), &f.host).unwrap_err();
    assert!(
        matches!(&err, crate::oci::OciError::InvalidArgument(m) if m.contains("1025 mounts, at most 1024")),
        "{err:?}"
    );
}

#[test]
fn bidirectional_wins_over_host_to_container() {
    let f = fixture();
    let m = |path: &str, p: cri::MountPropagation| cri::Mount {
        container_path: path.into(),
        host_path: path.into(),
        propagation: p as i32,
        ..Default::default()
    };
    let c = cri::ContainerConfig {
        mounts: vec![
            m("/b", cri::MountPropagation::PropagationBidirectional),
            m("/a", cri::MountPropagation::PropagationHostToContainer),
            m("/c", cri::MountPropagation::PropagationPrivate),
        ],
        ..Default::default()
    };
    let spec = build(&f, &c).unwrap();
    assert_eq!(
        spec.linux()
            .as_ref()
            .unwrap()
            .rootfs_propagation()
            .as_deref(),
        Some("rshared")
    );
    let opts = |d: &str| mount_of(&spec, d).unwrap().options().clone().unwrap();
    assert_eq!(opts("/a"), ["rbind", "rslave", "rw"]);
    assert_eq!(opts("/b"), ["rbind", "rshared", "rw"]);
    assert_eq!(opts("/c"), ["rbind", "rprivate", "rw"]);
}

#[test]
fn supplementary_groups_hold_the_primary_gid() {
    let f = fixture();
    // run_as_user 1001 (app, primary 1002, member of extra 3000) plus a CRI group.
    let merge = with_sc(cri::LinuxContainerSecurityContext {
        run_as_user: Some(cri::Int64Value { value: 1001 }),
        supplemental_groups: vec![1234],
        ..Default::default()
    });
    let u = build(&f, &merge)
        .unwrap()
        .process()
        .clone()
        .unwrap()
        .user()
        .clone();
    assert_eq!((u.uid(), u.gid()), (1001, 1002));
    assert_eq!(
        u.additional_gids().as_deref(),
        Some(&[1002, 3000, 1234][..])
    );
    // Strict: the image's /etc/group is not consulted.
    let strict = with_sc(cri::LinuxContainerSecurityContext {
        run_as_user: Some(cri::Int64Value { value: 1001 }),
        supplemental_groups: vec![1234],
        supplemental_groups_policy: cri::SupplementalGroupsPolicy::Strict as i32,
        ..Default::default()
    });
    let u = build(&f, &strict)
        .unwrap()
        .process()
        .clone()
        .unwrap()
        .user()
        .clone();
    assert_eq!(u.additional_gids().as_deref(), Some(&[1002, 1234][..]));
    // A uid without a passwd entry: gid 0 unless run_as_group says otherwise.
    let unknown = with_sc(cri::LinuxContainerSecurityContext {
        run_as_user: Some(cri::Int64Value { value: 4321 }),
        run_as_group: Some(cri::Int64Value { value: 8765 }),
        ..Default::default()
    });
    let u = build(&f, &unknown)
        .unwrap()
        .process()
        .clone()
        .unwrap()
        .user()
        .clone();
    assert_eq!((u.uid(), u.gid()), (4321, 8765));
    assert_eq!(u.additional_gids().as_deref(), Some(&[8765][..]));
    // run_as_group alone is refused (CRI).
    let group_only = with_sc(cri::LinuxContainerSecurityContext {
        run_as_group: Some(cri::Int64Value { value: 5 }),
        ..Default::default()
    });
    assert!(build(&f, &group_only).is_err());
}

#[test]
fn oom_score_adj_is_never_below_the_daemons() {
    // This machine: no CAP_SYS_RESOURCE, the daemon at 0. Whatever is asked, nothing negative.
    let f = fixture();
    for asked in [-1000, -998, -1, 0] {
        let c = cri::ContainerConfig {
            linux: Some(cri::LinuxContainerConfig {
                resources: Some(cri::LinuxContainerResources {
                    oom_score_adj: asked,
                    ..Default::default()
                }),
                security_context: None,
            }),
            ..Default::default()
        };
        let spec = build(&f, &c).unwrap();
        assert_eq!(spec.process().as_ref().unwrap().oom_score_adj(), Some(0));
    }
}

#[test]
fn containers_join_the_pods_user_namespace() {
    let mut f = fixture();
    let m = vec![cri::IdMapping {
        host_id: 200_000,
        container_id: 0,
        length: 65_536,
    }];
    let userns = cri::NamespaceOption {
        userns_options: Some(cri::UserNamespace {
            mode: cri::NamespaceMode::Pod as i32,
            uids: m.clone(),
            gids: m,
        }),
        ..Default::default()
    };
    f.sandbox.linux.as_mut().unwrap().security_context = Some(cri::LinuxSandboxSecurityContext {
        namespace_options: Some(userns.clone()),
        ..Default::default()
    });
    f.ns = SandboxNamespaces::of_infra(4242, &f.sandbox);
    let spec = build(&f, &cri::ContainerConfig::default()).unwrap();
    assert!(ns_of(&spec).contains(&(
        LinuxNamespaceType::User,
        Some(PathBuf::from("/proc/4242/ns/user"))
    )));
    let l = spec.linux().as_ref().unwrap();
    let uid = l.uid_mappings().as_ref().unwrap();
    assert_eq!((uid[0].host_id(), uid[0].size()), (200_000, 65_536));
    assert_eq!(l.gid_mappings(), l.uid_mappings());
    // The kubelet repeats the pod's options on the container: fine; others are refused.
    let same = with_sc(cri::LinuxContainerSecurityContext {
        namespace_options: Some(userns),
        ..Default::default()
    });
    build(&f, &same).unwrap();
    let host = with_sc(cri::LinuxContainerSecurityContext {
        namespace_options: Some(cri::NamespaceOption {
            userns_options: Some(cri::UserNamespace {
                mode: cri::NamespaceMode::Node as i32,
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    });
    assert!(build(&f, &host).is_err());
    // Without a pod user namespace: no user namespace, no mappings.
    let plain = build(&fixture(), &cri::ContainerConfig::default()).unwrap();
    assert!(
        !ns_of(&plain)
            .iter()
            .any(|(t, _)| *t == LinuxNamespaceType::User)
    );
    assert!(plain.linux().as_ref().unwrap().uid_mappings().is_none());
}

#[test]
fn pod_annotations_stay_out_of_the_spec_unless_allowed() {
    let f = fixture();
    let c = cri::ContainerConfig {
        metadata: Some(cri::ContainerMetadata {
            name: "app".into(),
            attempt: 0,
        }),
        annotations: [
            ("run.oci.keep_original_groups", "1"),
            ("org.systemd.property.ExecStartPre", "/bin/sh"),
            ("io.kubernetes.cri.container-type", "sandbox"),
            ("example.com/team", "a"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect(),
        ..Default::default()
    };
    let own = |spec: &Spec| {
        let a = spec.annotations().clone().unwrap_or_default();
        assert_eq!(a["io.kubernetes.cri.container-type"], "container");
        assert_eq!(a["io.kubernetes.cri.sandbox-id"], "sb1");
        assert_eq!(a["io.kubernetes.cri.container-name"], "app");
        assert!(!a.contains_key("run.oci.keep_original_groups"));
        assert!(!a.contains_key("org.systemd.property.ExecStartPre"));
        a
    };
    let a = own(&build(&f, &c).unwrap());
    assert!(!a.contains_key("example.com/team"), "{a:?}");

    let allow = AnnotationPolicy::new(vec!["example.com/*".into()]).unwrap();
    let spec = build_with(&f, &c, &allow).unwrap();
    let a = own(&spec);
    assert_eq!(a["example.com/team"], "a");
}

#[test]
fn apparmor_profile_of_the_process() {
    use crate::oci::host::AppArmorHost;
    use crate::spec::apparmor::DEFAULT_PROFILE;
    let mut f = fixture();
    let profile = |f: &Fixture, sc: cri::LinuxContainerSecurityContext| {
        build(f, &with_sc(sc)).map(|s| s.process().as_ref().unwrap().apparmor_profile().clone())
    };
    // A host without AppArmor: no profile; a Localhost one cannot be honoured.
    assert_eq!(profile(&f, Default::default()).unwrap(), None);
    let localhost = cri::LinuxContainerSecurityContext {
        apparmor: Some(cri::SecurityProfile {
            profile_type: cri::security_profile::ProfileType::Localhost as i32,
            localhost_ref: "k8s-never-loaded".into(),
        }),
        ..Default::default()
    };
    let e = profile(&f, localhost.clone()).unwrap_err();
    assert!(matches!(e, OciError::Unsupported(_)), "{e:?}");

    f.host.apparmor = AppArmorHost {
        enabled: true,
        default_profile: true,
    };
    assert_eq!(
        profile(&f, Default::default()).unwrap().as_deref(),
        Some(DEFAULT_PROFILE)
    );
    f.sandbox.linux.as_mut().unwrap().security_context = Some(cri::LinuxSandboxSecurityContext {
        privileged: true,
        ..Default::default()
    });
    let privileged = cri::LinuxContainerSecurityContext {
        privileged: true,
        ..Default::default()
    };
    assert_eq!(profile(&f, privileged).unwrap(), None);
    // Not loaded in this kernel (none is: the build host has no AppArmor).
    let e = profile(&f, localhost).unwrap_err();
    assert!(e.to_string().contains("is not loaded"), "{e}");
}

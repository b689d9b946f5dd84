//! Unit tests of the CRI → OCI mapping ([`super::spec`], [`super::sandbox`]); no root needed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use minicri_proto::runtime::v1 as cri;
use oci_spec::runtime::{Capability, LinuxNamespaceType, Spec};

use super::*;

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
        cgroup_v2: false,
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
    })
}

fn with_sc(sc: cri::LinuxContainerSecurityContext) -> cri::ContainerConfig {
    cri::ContainerConfig {
        linux: Some(cri::LinuxContainerConfig {
            security_context: Some(sc),
            resources: None,
        }),
        ..Default::default()
    }
}

fn ns_of(spec: &Spec) -> Vec<(LinuxNamespaceType, Option<PathBuf>)> {
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

fn mount_of<'a>(spec: &'a Spec, dest: &str) -> Option<&'a oci_spec::runtime::Mount> {
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
        spec::process_env("h", &[], &[]),
        ["HOSTNAME=h", spec::DEFAULT_PATH]
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
        (1001, 1002, Some(vec![3000, 5]))
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
            pid: None
        }
    );
    let spec = build(&host, &cri::ContainerConfig::default()).unwrap();
    assert_eq!(ns_of(&spec), vec![(T::Mount, None), (T::Pid, None)]);
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
    let set = spec::capability_set(None, &host).unwrap();
    assert_eq!(set.len(), 14);
    let caps = cri::Capability {
        add_capabilities: vec!["NET_ADMIN".into()],
        drop_capabilities: vec!["CAP_KILL".into()],
        ..Default::default()
    };
    let set = spec::capability_set(Some(&caps), &host).unwrap();
    assert!(set.contains(&Capability::NetAdmin) && !set.contains(&Capability::Kill));
    let caps = cri::Capability {
        add_capabilities: vec!["CHOWN".into()],
        drop_capabilities: vec!["ALL".into()],
        ..Default::default()
    };
    assert_eq!(spec::capability_set(Some(&caps), &host).unwrap().len(), 1);
    let caps = cri::Capability {
        add_capabilities: vec!["ALL".into()],
        ..Default::default()
    };
    assert_eq!(spec::capability_set(Some(&caps), &host).unwrap().len(), 41);

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

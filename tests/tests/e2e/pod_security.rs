//! Black-box tests of what a container's security context and mounts do in the kernel: the
//! identity of its processes (run_as_user / run_as_group / run_as_username, supplemental groups
//! and their policy), capabilities (defaults, add/drop, `ALL`, privileged), a read-only rootfs
//! and read-only paths, bind mounts with private / host-to-container / bidirectional
//! propagation, recursive read-only mounts, and the OOM killer's verdict.
//!
//! Root only, with runc and Debian's CNI plugins (`pod_env::skip_reason` says why they pass
//! without running elsewhere); each test has its own daemon, registry and bridge ([`PodEnv`]).

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use minicri_proto::runtime::v1 as cri;
use minicri_tests::pod_env::{PodEnv, mounts_under, pod_config, with_busybox};
use minicri_tests::pod_rpc::{
    RuntimeClient, container_config, container_status, create_container, exec_text, in_userns,
    list_containers, pod_sandbox_status, pod_userns, run_container, run_pod, stop_and_remove_pod,
    stop_container, user_namespaces_supported,
};
use tonic::Code;

fn with_sc(
    mut c: cri::ContainerConfig,
    sc: cri::LinuxContainerSecurityContext,
) -> cri::ContainerConfig {
    c.linux
        .get_or_insert_with(Default::default)
        .security_context = Some(sc);
    c
}

fn privileged_pod(name: &str, env: &PodEnv) -> cri::PodSandboxConfig {
    let mut p = pod_config(name, env.logs.path());
    p.linux = Some(cri::LinuxPodSandboxConfig {
        security_context: Some(cri::LinuxSandboxSecurityContext {
            privileged: true,
            ..Default::default()
        }),
        ..Default::default()
    });
    p
}

/// Runs `sh -c script` in the container with a 20 s timeout: (exit code, stdout, stderr).
async fn sh(c: &mut RuntimeClient, id: &str, script: &str) -> (i32, String, String) {
    exec_text(c, id, &["sh", "-c", script], 20).await
}

/// stdout of a command that must succeed.
async fn ok(c: &mut RuntimeClient, id: &str, script: &str) -> String {
    let (code, out, err) = sh(c, id, script).await;
    assert_eq!(code, 0, "{script:?} failed: {err}");
    out
}

fn numbers(s: &str) -> BTreeSet<i64> {
    s.split_whitespace().map(|n| n.parse().unwrap()).collect()
}

/// A capability mask line (`CapEff:`, `CapBnd:`, ...) of a `/proc/<pid>/status` text.
fn cap_mask(status: &str, key: &str) -> u64 {
    let v = status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key} in {status}"));
    u64::from_str_radix(v.trim(), 16).unwrap()
}

fn bits(caps: &[u32]) -> u64 {
    caps.iter().map(|c| 1u64 << c).sum()
}

#[tokio::test(flavor = "multi_thread")]
async fn process_identity() {
    let Some((env, image, mut c)) = with_busybox().await else {
        return;
    };
    let pod = pod_config("identity", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    let sleeper = |name: &str| container_config(name, &image, &["sleep", "1000"]);

    // run_as_user + run_as_group + a supplemental group; the uid has no passwd entry.
    let id = run_container(
        &mut c,
        &sb,
        &pod,
        with_sc(
            sleeper("numeric"),
            cri::LinuxContainerSecurityContext {
                run_as_user: Some(cri::Int64Value { value: 1234 }),
                run_as_group: Some(cri::Int64Value { value: 5678 }),
                supplemental_groups: vec![4242],
                ..Default::default()
            },
        ),
    )
    .await;
    assert_eq!(ok(&mut c, &id, "id -u").await, "1234\n");
    assert_eq!(ok(&mut c, &id, "id -g").await, "5678\n");
    assert_eq!(
        numbers(&ok(&mut c, &id, "id -G").await),
        numbers("5678 4242")
    );
    // The container's first process, not only exec'd ones.
    let init = ok(&mut c, &id, "grep -E '^(Uid|Gid|Groups):' /proc/1/status").await;
    assert!(init.contains("Uid:\t1234\t1234\t1234\t1234"), "{init}");
    assert!(init.contains("Gid:\t5678\t5678\t5678\t5678"), "{init}");
    assert!(init.contains("Groups:\t4242 5678"), "{init}");
    let user = container_status(&mut c, &id)
        .await
        .user
        .unwrap()
        .linux
        .unwrap();
    assert_eq!(
        (user.uid, user.gid, user.supplemental_groups),
        (1234, 5678, vec![4242, 5678])
    );

    // run_as_username: uid and primary group from the image's /etc/passwd, and /etc/group
    // membership (minicri is also in extra, 1001).
    let id = run_container(
        &mut c,
        &sb,
        &pod,
        with_sc(
            sleeper("by-name"),
            cri::LinuxContainerSecurityContext {
                run_as_username: "minicri".into(),
                supplemental_groups: vec![4242],
                ..Default::default()
            },
        ),
    )
    .await;
    assert_eq!(ok(&mut c, &id, "id -un").await, "minicri\n");
    assert_eq!(
        numbers(&ok(&mut c, &id, "id -G").await),
        numbers("1000 1001 4242")
    );
    let user = container_status(&mut c, &id)
        .await
        .user
        .unwrap()
        .linux
        .unwrap();
    assert_eq!(
        (user.uid, user.gid, user.supplemental_groups),
        (1000, 1000, vec![1000, 1001, 4242])
    );

    // SupplementalGroupsPolicy Strict: /etc/group is not consulted.
    let id = run_container(
        &mut c,
        &sb,
        &pod,
        with_sc(
            sleeper("strict"),
            cri::LinuxContainerSecurityContext {
                run_as_user: Some(cri::Int64Value { value: 1000 }),
                supplemental_groups: vec![4242],
                supplemental_groups_policy: cri::SupplementalGroupsPolicy::Strict as i32,
                ..Default::default()
            },
        ),
    )
    .await;
    assert_eq!(
        numbers(&ok(&mut c, &id, "id -G").await),
        numbers("1000 4242")
    );

    // A user the image does not have, and run_as_group without a user: refused at create.
    for (name, sc) in [
        (
            "ghost",
            cri::LinuxContainerSecurityContext {
                run_as_username: "ghost".into(),
                ..Default::default()
            },
        ),
        (
            "group-only",
            cri::LinuxContainerSecurityContext {
                run_as_group: Some(cri::Int64Value { value: 5 }),
                ..Default::default()
            },
        ),
    ] {
        let err = create_container(&mut c, &sb, &pod, with_sc(sleeper(name), sc))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{name}: {err:?}");
    }
    stop_and_remove_pod(&mut c, &sb).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn capabilities_in_the_kernel() {
    let Some((env, image, mut c)) = with_busybox().await else {
        return;
    };
    // What the daemon itself may hand out.
    let daemon_status =
        std::fs::read_to_string(format!("/proc/{}/status", env.daemon.pid().unwrap())).unwrap();
    let host_bounding = cap_mask(&daemon_status, "CapBnd:");
    let pod = privileged_pod("caps", &env);
    let sb = run_pod(&mut c, &pod).await;
    let caps_of = |name: &str, sc: cri::LinuxContainerSecurityContext| {
        with_sc(container_config(name, &image, &["sleep", "1000"]), sc)
    };
    let cap = |add: &[&str], drop: &[&str]| cri::LinuxContainerSecurityContext {
        capabilities: Some(cri::Capability {
            add_capabilities: add.iter().map(|s| s.to_string()).collect(),
            drop_capabilities: drop.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }),
        ..Default::default()
    };
    // CHOWN DAC_OVERRIDE FOWNER FSETID KILL SETGID SETUID SETPCAP NET_BIND_SERVICE NET_RAW
    // SYS_CHROOT MKNOD AUDIT_WRITE SETFCAP
    let defaults = bits(&[0, 1, 3, 4, 5, 6, 7, 8, 10, 13, 18, 27, 29, 31]);
    let cases = [
        ("default", Default::default(), defaults),
        (
            "add-net-admin",
            cap(&["NET_ADMIN"], &["KILL"]),
            (defaults | bits(&[12])) & !bits(&[5]),
        ),
        ("drop-all", cap(&[], &["ALL"]), 0),
        ("drop-all-add-one", cap(&["CHOWN"], &["ALL"]), bits(&[0])),
        ("add-all", cap(&["ALL"], &[]), host_bounding),
        (
            "privileged",
            cri::LinuxContainerSecurityContext {
                privileged: true,
                ..Default::default()
            },
            host_bounding,
        ),
    ];
    for (name, sc, want) in cases {
        let id = run_container(&mut c, &sb, &pod, caps_of(name, sc)).await;
        let st = ok(&mut c, &id, "cat /proc/1/status").await;
        for key in ["CapEff:", "CapPrm:", "CapBnd:"] {
            assert_eq!(
                cap_mask(&st, key),
                want,
                "{name} {key} {:#x} != {want:#x}",
                cap_mask(&st, key)
            );
        }
    }
    // Ambient capabilities reach a process that is not root (the kernel raises an ambient
    // capability only if it is inheritable too).
    let mut ambient = cap(&["NET_ADMIN"], &[]);
    if let Some(c) = ambient.capabilities.as_mut() {
        c.add_ambient_capabilities = vec!["NET_ADMIN".into()];
    }
    ambient.run_as_user = Some(cri::Int64Value { value: 1000 });
    let id = run_container(&mut c, &sb, &pod, caps_of("ambient", ambient)).await;
    let st = ok(&mut c, &id, "cat /proc/1/status").await;
    assert_eq!(cap_mask(&st, "CapAmb:"), bits(&[12]), "{st}");
    assert_eq!(cap_mask(&st, "CapEff:"), bits(&[12]), "{st}");
    // The kernel enforces them: without NET_ADMIN no interface changes, with it they work.
    let weak = run_container(&mut c, &sb, &pod, caps_of("weak", cap(&[], &[]))).await;
    let (code, _, _) = sh(&mut c, &weak, "ip link set lo mtu 1400").await;
    assert_ne!(code, 0, "NET_ADMIN is not a default capability");
    let strong = run_container(
        &mut c,
        &sb,
        &pod,
        caps_of("strong", cap(&["NET_ADMIN"], &[])),
    )
    .await;
    ok(&mut c, &strong, "ip link set lo mtu 1400").await;
    // Without CHOWN, root cannot give a file away.
    let no_chown =
        run_container(&mut c, &sb, &pod, caps_of("no-chown", cap(&[], &["CHOWN"]))).await;
    let (code, _, err) = sh(&mut c, &no_chown, "touch /tmp/f && chown 1000 /tmp/f").await;
    assert_ne!(code, 0, "chown without CAP_CHOWN: {err}");
    stop_and_remove_pod(&mut c, &sb).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn read_only_rootfs_and_paths() {
    let Some((env, image, mut c)) = with_busybox().await else {
        return;
    };
    let pod = pod_config("readonly", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    let sleeper = |name: &str| container_config(name, &image, &["sleep", "1000"]);

    let ro = run_container(
        &mut c,
        &sb,
        &pod,
        with_sc(
            sleeper("ro"),
            cri::LinuxContainerSecurityContext {
                readonly_rootfs: true,
                ..Default::default()
            },
        ),
    )
    .await;
    for path in ["/file", "/tmp/file", "/etc/hosts"] {
        let (code, _, err) = sh(&mut c, &ro, &format!("touch {path}")).await;
        assert_ne!(code, 0, "{path} is writable on a read-only rootfs");
        assert!(err.contains("Read-only file system"), "{path}: {err}");
    }
    // The pod's shared memory stays writable.
    ok(&mut c, &ro, "touch /dev/shm/ok").await;

    let rw = run_container(&mut c, &sb, &pod, sleeper("rw")).await;
    ok(&mut c, &rw, "touch /file /tmp/file && echo x > /etc/hosts").await;

    // readonly_paths and masked_paths replace the defaults.
    let paths = run_container(
        &mut c,
        &sb,
        &pod,
        with_sc(
            sleeper("paths"),
            cri::LinuxContainerSecurityContext {
                readonly_paths: vec!["/tmp".into()],
                masked_paths: vec!["/etc/passwd".into()],
                ..Default::default()
            },
        ),
    )
    .await;
    let (code, _, err) = sh(&mut c, &paths, "touch /tmp/file").await;
    assert!(code != 0 && err.contains("Read-only file system"), "{err}");
    ok(&mut c, &paths, "touch /file").await;
    assert_eq!(ok(&mut c, &paths, "cat /etc/passwd").await, "");
    // By default /proc/timer_list is masked (where the kernel has it) and /proc/sys read-only.
    if Path::new("/proc/timer_list").exists() {
        assert_eq!(
            ok(&mut c, &rw, "wc -c < /proc/timer_list").await.trim(),
            "0"
        );
        assert_ne!(
            ok(&mut c, &paths, "wc -c < /proc/timer_list").await.trim(),
            "0",
            "a CRI list replaces the default one"
        );
    }
    // (Writing back the current value: harmless should the write go through.)
    let (code, _, err) = sh(
        &mut c,
        &rw,
        "v=$(cat /proc/sys/vm/swappiness) && echo $v > /proc/sys/vm/swappiness",
    )
    .await;
    assert!(code != 0 && err.contains("Read-only file system"), "{err}");
    stop_and_remove_pod(&mut c, &sb).await;
}

/// The propagation fields of the mountinfo line of `mount_point`.
fn propagation_of(mount_point: &Path) -> Option<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    info.lines()
        .rfind(|l| l.split(' ').nth(4) == Some(mount_point.to_str().unwrap()))
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let sep = f.iter().position(|x| *x == "-").unwrap();
            f[6..sep].join(" ")
        })
}

fn mount_tmpfs(at: &Path) {
    use nix::mount::{MsFlags, mount};
    std::fs::create_dir_all(at).unwrap();
    mount(
        Some("tmpfs"),
        at,
        Some("tmpfs"),
        MsFlags::empty(),
        Some("size=1m"),
    )
    .unwrap();
    mount(
        None::<&str>,
        at,
        None::<&str>,
        MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .unwrap();
}

/// Unmounts everything under a directory when dropped (also after a failed assertion).
struct HostMounts(tempfile::TempDir);

impl Drop for HostMounts {
    fn drop(&mut self) {
        // Twice: a propagated mount may sit below another.
        for _ in 0..2 {
            for m in mounts_under(self.0.path()) {
                let _ = nix::mount::umount2(m.as_str(), nix::mount::MntFlags::MNT_DETACH);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn mount_propagation() {
    let Some((env, image, mut c)) = with_busybox().await else {
        return;
    };
    let host = HostMounts(tempfile::tempdir().unwrap());
    // Each source is a private tmpfs of its own, as volumes on a host without systemd's shared
    // root are; the daemon must make the propagated ones shared.
    let src = |n: &str| host.0.path().join(n);
    for n in ["bidirectional", "host-to-container", "private"] {
        mount_tmpfs(&src(n));
        assert_eq!(propagation_of(&src(n)).as_deref(), Some(""), "{n}");
    }
    let missing = src("missing/volume");
    let pod = privileged_pod("propagation", &env);
    let sb = run_pod(&mut c, &pod).await;
    let mount = |n: &str, host_path: &Path, p: cri::MountPropagation| cri::Mount {
        container_path: format!("/{n}"),
        host_path: host_path.display().to_string(),
        propagation: p as i32,
        ..Default::default()
    };
    let mut config = with_sc(
        container_config("mounter", &image, &["sleep", "1000"]),
        cri::LinuxContainerSecurityContext {
            privileged: true,
            ..Default::default()
        },
    );
    use cri::MountPropagation::*;
    config.mounts = vec![
        mount(
            "bidirectional",
            &src("bidirectional"),
            PropagationBidirectional,
        ),
        mount(
            "host-to-container",
            &src("host-to-container"),
            PropagationHostToContainer,
        ),
        mount("private", &src("private"), PropagationPrivate),
        mount("created", &missing, PropagationPrivate),
    ];
    let id = run_container(&mut c, &sb, &pod, config).await;
    assert!(missing.is_dir(), "a missing source is created");
    for n in ["bidirectional", "host-to-container"] {
        let p = propagation_of(&src(n)).unwrap();
        assert!(p.contains("shared:"), "{n} was made shared: {p:?}");
    }
    assert_eq!(propagation_of(&src("private")).as_deref(), Some(""));
    let statuses = container_status(&mut c, &id).await.mounts;
    assert_eq!(statuses.len(), 4);
    assert_eq!(statuses[0].propagation, PropagationBidirectional as i32);

    // Host → container: a mount made on the host after the start.
    for n in ["bidirectional", "host-to-container", "private"] {
        mount_tmpfs(&src(n).join("from-host"));
        std::fs::write(src(n).join("from-host/flag"), "h").unwrap();
    }
    let seen = |n: &str| format!("cat /{n}/from-host/flag 2>/dev/null || true");
    assert_eq!(ok(&mut c, &id, &seen("bidirectional")).await, "h");
    assert_eq!(ok(&mut c, &id, &seen("host-to-container")).await, "h");
    assert_eq!(ok(&mut c, &id, &seen("private")).await, "");

    // Container → host: only bidirectional mounts carry it back.
    for n in ["bidirectional", "host-to-container", "private"] {
        ok(
            &mut c,
            &id,
            &format!("mkdir -p /{n}/from-ctr && mount -t tmpfs x /{n}/from-ctr && echo c > /{n}/from-ctr/flag"),
        )
        .await;
    }
    assert_eq!(
        std::fs::read_to_string(src("bidirectional").join("from-ctr/flag")).unwrap(),
        "c\n"
    );
    for n in ["host-to-container", "private"] {
        assert!(
            !src(n).join("from-ctr/flag").exists(),
            "{n}: the container's mount reached the host"
        );
    }
    stop_and_remove_pod(&mut c, &sb).await;
    drop(host);
}

#[tokio::test(flavor = "multi_thread")]
async fn recursive_read_only_mounts() {
    let Some((env, image, mut c)) = with_busybox().await else {
        return;
    };
    let rro_supported = c
        .status(cri::StatusRequest { verbose: false })
        .await
        .unwrap()
        .into_inner()
        .runtime_handlers
        .iter()
        .any(|h| {
            h.features
                .as_ref()
                .is_some_and(|f| f.recursive_read_only_mounts)
        });
    if !rro_supported {
        eprintln!("skipping: the runtime reports no recursive read-only mounts here");
        return;
    }
    let host = HostMounts(tempfile::tempdir().unwrap());
    let tree = host.0.path().join("tree");
    mount_tmpfs(&tree);
    mount_tmpfs(&tree.join("sub"));
    let pod = pod_config("rro", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    let mount = |dest: &str, readonly: bool, rro: bool, p: cri::MountPropagation| cri::Mount {
        container_path: dest.into(),
        host_path: tree.display().to_string(),
        readonly,
        recursive_read_only: rro,
        propagation: p as i32,
        ..Default::default()
    };
    use cri::MountPropagation::*;
    let mut config = container_config("rro", &image, &["sleep", "1000"]);
    config.mounts = vec![
        mount("/rro", true, true, PropagationPrivate),
        mount("/ro", true, false, PropagationPrivate),
    ];
    let id = run_container(&mut c, &sb, &pod, config).await;
    for path in ["/rro/x", "/rro/sub/x", "/ro/x"] {
        let (code, _, err) = sh(&mut c, &id, &format!("touch {path}")).await;
        assert!(
            code != 0 && err.contains("Read-only file system"),
            "{path}: {err}"
        );
    }
    // A plain read-only bind leaves the submount writable.
    ok(&mut c, &id, "touch /ro/sub/x").await;
    assert!(tree.join("sub/x").exists());

    // The CRI's rules: only read-only, private mounts may be recursive read-only.
    for (name, m) in [
        ("rw", mount("/m", false, true, PropagationPrivate)),
        ("slave", mount("/m", true, true, PropagationHostToContainer)),
        ("shared", mount("/m", true, true, PropagationBidirectional)),
    ] {
        let mut config = container_config(name, &image, &["sleep", "1000"]);
        config.mounts = vec![m];
        let err = create_container(&mut c, &sb, &pod, config)
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{name}: {err:?}");
    }
    // A refused request changes nothing on the host: the source was not made shared.
    assert_eq!(propagation_of(&tree).as_deref(), Some(""));
    stop_and_remove_pod(&mut c, &sb).await;
    drop(host);
}

#[tokio::test(flavor = "multi_thread")]
async fn out_of_memory_is_oomkilled() {
    let Some((env, image, mut c)) = with_busybox().await else {
        return;
    };
    let mut pod = pod_config("oom", env.logs.path());
    pod.linux = Some(cri::LinuxPodSandboxConfig {
        cgroup_parent: env.cgroup_parent(),
        ..Default::default()
    });
    let sb = run_pod(&mut c, &pod).await;
    // dd allocates its 64 MiB block and fills it from /dev/zero: beyond a 16 MiB limit.
    let mut config = container_config(
        "hog",
        &image,
        &["dd", "if=/dev/zero", "of=/dev/null", "bs=64M", "count=4"],
    );
    config.linux = Some(cri::LinuxContainerConfig {
        resources: Some(cri::LinuxContainerResources {
            memory_limit_in_bytes: 16 << 20,
            memory_swap_limit_in_bytes: 16 << 20,
            // Asked below the daemon's own: must be raised, not fail the create.
            oom_score_adj: -998,
            ..Default::default()
        }),
        security_context: None,
    });
    let id = run_container(&mut c, &sb, &pod, config).await;
    let mut st = container_status(&mut c, &id).await;
    for _ in 0..300 {
        if st.state == cri::ContainerState::ContainerExited as i32 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        st = container_status(&mut c, &id).await;
    }
    assert_eq!(st.state, cri::ContainerState::ContainerExited as i32);
    assert_eq!(
        (st.reason.as_str(), st.exit_code),
        ("OOMKilled", 137),
        "{st:?}"
    );

    // The same program within its limit completes.
    let mut fits = container_config(
        "fits",
        &image,
        &["dd", "if=/dev/zero", "of=/dev/null", "bs=1M", "count=4"],
    );
    fits.linux = Some(cri::LinuxContainerConfig {
        resources: Some(cri::LinuxContainerResources {
            memory_limit_in_bytes: 16 << 20,
            ..Default::default()
        }),
        security_context: None,
    });
    let id = run_container(&mut c, &sb, &pod, fits).await;
    let mut st = container_status(&mut c, &id).await;
    for _ in 0..300 {
        if st.state == cri::ContainerState::ContainerExited as i32 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        st = container_status(&mut c, &id).await;
    }
    assert_eq!(
        (st.reason.as_str(), st.exit_code),
        ("Completed", 0),
        "{st:?}"
    );
    stop_and_remove_pod(&mut c, &sb).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn pod_user_namespace() {
    let Some((env, image, mut c)) = with_busybox().await else {
        return;
    };
    if !user_namespaces_supported(&mut c).await {
        eprintln!("skipping: the runtime reports no user namespaces here");
        return;
    }
    const HOST_ID: u32 = 2_000_000;
    let userns = pod_userns(HOST_ID);
    let pod = in_userns(pod_config("userns", env.logs.path()), &userns);
    let sb = run_pod(&mut c, &pod).await;
    let ip = pod_sandbox_status(&mut c, &sb).await.network.unwrap().ip;
    assert!(
        !ip.is_empty(),
        "CNI attached the pod's own network namespace"
    );
    let mut config = with_sc(
        container_config("main", &image, &["sleep", "1000"]),
        cri::LinuxContainerSecurityContext {
            namespace_options: Some(userns.clone()),
            ..Default::default()
        },
    );
    // Two host directories owned by the host's root: one given with the pod's mappings, as the
    // kubelet does for such pods, one without.
    let volumes = tempfile::tempdir().unwrap();
    let maps = userns.userns_options.as_ref().unwrap();
    for (name, mapped) in [("mapped", true), ("plain", false)] {
        std::fs::create_dir(volumes.path().join(name)).unwrap();
        config.mounts.push(cri::Mount {
            container_path: format!("/{name}"),
            host_path: volumes.path().join(name).display().to_string(),
            uid_mappings: if mapped { maps.uids.clone() } else { vec![] },
            gid_mappings: if mapped { maps.gids.clone() } else { vec![] },
            ..Default::default()
        });
    }
    let id = run_container(&mut c, &sb, &pod, config).await;

    // Root inside, HOST_ID outside.
    let map = ok(&mut c, &id, "cat /proc/self/uid_map").await;
    assert_eq!(
        map.split_whitespace().collect::<Vec<_>>(),
        ["0", &HOST_ID.to_string(), "65536"]
    );
    assert_eq!(ok(&mut c, &id, "id -u").await, "0\n");
    let st = container_status(&mut c, &id).await;
    assert_eq!(st.state, cri::ContainerState::ContainerRunning as i32);
    let user = st.user.unwrap().linux.unwrap();
    assert_eq!(
        (user.uid, user.gid),
        (0, 0),
        "ids as the container sees them"
    );
    // The image's files are root's inside (idmapped layers), and root can write its rootfs.
    assert_eq!(
        ok(&mut c, &id, "stat -c %u:%g /bin/busybox /etc").await,
        "0:0\n0:0\n"
    );
    ok(
        &mut c,
        &id,
        "echo hi > /written && mkdir /etc/new && touch /etc/passwd",
    )
    .await;
    let rootfs = env.state().join("containers").join(&id).join("rootfs");
    // Its directory is private to the pod's root, who reaches the rootfs from inside.
    {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let m = std::fs::metadata(rootfs.parent().unwrap()).unwrap();
        assert_eq!((m.uid(), m.permissions().mode() & 0o777), (HOST_ID, 0o700));
    }
    let owner = |p: &str| {
        let m = std::fs::metadata(rootfs.join(p)).unwrap();
        (
            std::os::unix::fs::MetadataExt::uid(&m),
            std::os::unix::fs::MetadataExt::gid(&m),
        )
    };
    assert_eq!(owner("written"), (HOST_ID, HOST_ID), "stored with host ids");
    assert_eq!(owner("etc/new"), (HOST_ID, HOST_ID));
    assert_eq!(
        owner("bin/busybox"),
        (HOST_ID, HOST_ID),
        "as the container sees it"
    );
    // It is not the host's root: a host-owned file it is given stays read-only to it.
    let (code, _, err) = sh(&mut c, &id, "echo x >> /etc/hostname").await;
    assert_ne!(code, 0, "wrote a host root file: {err}");
    // The mapped volume is root's inside, and what root writes is the host root's.
    ok(&mut c, &id, "echo v > /mapped/file").await;
    let m = std::fs::metadata(volumes.path().join("mapped/file")).unwrap();
    assert_eq!(
        (
            std::os::unix::fs::MetadataExt::uid(&m),
            std::os::unix::fs::MetadataExt::gid(&m)
        ),
        (0, 0)
    );
    let (code, _, err) = sh(&mut c, &id, "touch /plain/file").await;
    assert!(code != 0 && err.contains("Permission denied"), "{err}");
    // The pod's network namespace is its own: the CNI address is on eth0.
    assert!(ok(&mut c, &id, "ip -4 addr show eth0").await.contains(&ip));

    stop_and_remove_pod(&mut c, &sb).await;
    // Nothing stays mounted: neither the rootfs nor its idmapped layers.
    let netns_dir = env.state().join("netns").display().to_string();
    let left: Vec<String> = mounts_under(&env.state())
        .into_iter()
        .filter(|m| *m != netns_dir)
        .collect();
    assert!(left.is_empty(), "mounts left: {left:?}");
    assert!(!env.state().join("idmap").join(&id).exists());
    assert_eq!(
        std::fs::read_to_string(volumes.path().join("mapped/file")).unwrap(),
        "v\n",
        "removing the container leaves its volumes alone"
    );
}

/// A container may join the PID namespace only of a running container of its own pod: another
/// pod's would show it that pod's processes (and, in a host-PID pod, the host's) to signal and
/// read. And a request refused for any field changes nothing on the host: the bind sources it
/// names are neither created nor made shared, since the spec is built (and checked) first.
#[tokio::test(flavor = "multi_thread")]
async fn pid_targets_stay_in_the_pod_and_refusals_leave_the_host_alone() {
    let Some((env, image, mut c)) = with_busybox().await else {
        return;
    };
    let pod_a = pod_config("target-a", env.logs.path());
    let pod_b = pod_config("target-b", env.logs.path());
    let a = run_pod(&mut c, &pod_a).await;
    let b = run_pod(&mut c, &pod_b).await;
    let first = run_container(
        &mut c,
        &a,
        &pod_a,
        container_config("first", &image, &["sleep", "1000"]),
    )
    .await;
    let joining = |name: &str| {
        with_sc(
            container_config(name, &image, &["sleep", "1000"]),
            cri::LinuxContainerSecurityContext {
                namespace_options: Some(cri::NamespaceOption {
                    pid: cri::NamespaceMode::Target as i32,
                    target_id: first.clone(),
                    ..Default::default()
                }),
                ..Default::default()
            },
        )
    };
    // In the same pod: the target's process is the namespace's init.
    let debug = run_container(&mut c, &a, &pod_a, joining("debug")).await;
    let init = ok(&mut c, &debug, "tr '\\0' ' ' < /proc/1/cmdline").await;
    assert_eq!(init.trim(), "sleep 1000");
    // From another pod: refused, naming both, and nothing is created.
    let err = create_container(&mut c, &b, &pod_b, joining("intruder"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains(&first) && err.message().contains(&a),
        "{err:?}"
    );
    let listed = list_containers(&mut c).await;
    assert!(!listed.iter().any(|x| x.pod_sandbox_id == b), "{listed:?}");
    // The host's PID namespace, asked by a container of a pod that does not share it: refused.
    let host_pid = with_sc(
        container_config("host-pid", &image, &["sleep", "1000"]),
        cri::LinuxContainerSecurityContext {
            namespace_options: Some(cri::NamespaceOption {
                pid: cri::NamespaceMode::Node as i32,
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    let err = create_container(&mut c, &b, &pod_b, host_pid)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("pid namespace NODE"), "{err:?}");
    // Created while the target ran, started after it stopped: its pid may be anyone's by then;
    // or after it was removed.
    let late = create_container(&mut c, &a, &pod_a, joining("late"))
        .await
        .unwrap();
    let later = create_container(&mut c, &a, &pod_a, joining("later"))
        .await
        .unwrap();
    stop_container(&mut c, &first, 0).await;
    let err = c
        .start_container(cri::StartContainerRequest {
            container_id: late.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("not running"), "{err:?}");
    c.remove_container(cri::RemoveContainerRequest {
        container_id: first.clone(),
    })
    .await
    .unwrap();
    let err = c
        .start_container(cri::StartContainerRequest {
            container_id: later.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("does not exist"), "{err:?}");

    // Refused late (an unknown capability), with a bidirectional volume whose source is missing
    // under a private mount.
    let host = HostMounts(tempfile::tempdir().unwrap());
    let tree = host.0.path().join("tree");
    mount_tmpfs(&tree);
    let source = tree.join("new/volume");
    let mut config = with_sc(
        container_config("refused", &image, &["sleep", "1000"]),
        cri::LinuxContainerSecurityContext {
            capabilities: Some(cri::Capability {
                add_capabilities: vec!["CAP_NO_SUCH_THING".into()],
                ..Default::default()
            }),
            ..Default::default()
        },
    );
    config.mounts = vec![cri::Mount {
        container_path: "/v".into(),
        host_path: source.display().to_string(),
        propagation: cri::MountPropagation::PropagationBidirectional as i32,
        ..Default::default()
    }];
    let err = create_container(&mut c, &b, &pod_b, config)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("CAP_NO_SUCH_THING"), "{err:?}");
    assert!(!tree.join("new").exists(), "the bind source was created");
    assert_eq!(
        propagation_of(&tree).as_deref(),
        Some(""),
        "the mount holding it was made shared"
    );
    stop_and_remove_pod(&mut c, &a).await;
    stop_and_remove_pod(&mut c, &b).await;
    drop(host);
}

/// A container may not mount (or take as a device) minicri's root, state directory or socket,
/// anything inside them or a directory holding them, however the host path reaches them (a
/// symlink here): CreateContainer refuses with INVALID_ARGUMENT naming the host path and the
/// setting, and creates nothing for it. A host path listed in `allow_own_path_mounts` (a link to
/// the state directory's network namespaces, resolved when checked) is mounted, as is a volume
/// elsewhere.
#[tokio::test(flavor = "multi_thread")]
async fn minicris_own_paths_are_refused_unless_listed() {
    if let Some(why) = minicri_tests::pod_env::skip_reason() {
        eprintln!("skipping: {why}");
        return;
    }
    let links = tempfile::tempdir().unwrap();
    let allowed = links.path().join("netns");
    let env = PodEnv::with_args(&["--allow-own-path-mount", allowed.to_str().unwrap()]).await;
    env.pull_busybox().await;
    let image = env.set.busybox_oci.reference.clone();
    let mut c = env.runtime().await;
    let (root, state, socket) = (env.daemon.root(), env.state(), env.daemon.socket());
    std::os::unix::fs::symlink(&root, links.path().join("to-root")).unwrap();
    std::os::unix::fs::symlink(state.join("netns"), &allowed).unwrap();
    let pod = pod_config("own-paths", env.logs.path());
    let sb = run_pod(&mut c, &pod).await;
    let with_mount = |name: &str, host: &Path| {
        let mut config = container_config(name, &image, &["sleep", "1000"]);
        config.mounts = vec![cri::Mount {
            container_path: "/host".into(),
            host_path: host.display().to_string(),
            readonly: true,
            ..Default::default()
        }];
        config
    };
    let not_yet = root.join("snapshots/not-yet");
    for (host, says) in [
        (root.clone(), "is minicri's root"),
        (not_yet.clone(), "is inside minicri's root"),
        (state.clone(), "is minicri's state directory"),
        (socket.clone(), "is minicri's socket"),
        (root.parent().unwrap().to_path_buf(), "holds minicri's root"),
        (
            links.path().join("to-root/content"),
            "is inside minicri's root",
        ),
    ] {
        let err = create_container(&mut c, &sb, &pod, with_mount("refused", &host))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{host:?}: {err:?}");
        let msg = err.message();
        assert!(msg.contains(says), "{host:?}: {msg}");
        assert!(msg.contains(&host.display().to_string()), "{msg}");
        assert!(msg.contains("allow_own_path_mounts"), "{msg}");
    }
    assert!(!not_yet.exists(), "the refused mount's source was created");
    let mut device = container_config("device", &image, &["sleep", "1000"]);
    device.devices = vec![cri::Device {
        container_path: "/dev/cri".into(),
        host_path: socket.display().to_string(),
        permissions: "rw".into(),
    }];
    let err = create_container(&mut c, &sb, &pod, device)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().starts_with("device \"/dev/cri\""), "{err:?}");
    assert!(list_containers(&mut c).await.is_empty());

    // The listed path, and a volume that is not minicri's: created, and the listed one is
    // what the container sees.
    let id = run_container(&mut c, &sb, &pod, with_mount("allowed", &allowed)).await;
    let netns = ok(&mut c, &id, "ls /host").await;
    let on_host: Vec<String> = std::fs::read_dir(state.join("netns"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        on_host.iter().any(|n| netns.contains(n.as_str())),
        "{netns} / {on_host:?}"
    );
    let volume = tempfile::tempdir().unwrap();
    create_container(&mut c, &sb, &pod, with_mount("volume", volume.path()))
        .await
        .unwrap();
    stop_and_remove_pod(&mut c, &sb).await;
}

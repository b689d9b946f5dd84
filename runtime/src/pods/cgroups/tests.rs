//! Unit tests of the cgroup readers: mountinfo, v1 and v2 files, paths per driver, OOM after exit.

use super::*;

fn fake_systemctl(dir: &Path, body: &str) -> PathBuf {
    let path = dir.join("systemctl");
    crate::fsutil::write_executable(&path, &format!("#!/bin/sh\n{body}\n"));
    path
}

#[test]
fn unit_result_asks_systemctl_for_the_result_property() {
    let dir = tempfile::tempdir().unwrap();
    let args = dir.path().join("args");
    let systemctl = fake_systemctl(
        dir.path(),
        &format!(
            "echo \"$@\" > {}; echo Result=oom-kill; echo LoadState=loaded",
            args.display()
        ),
    );
    let got = unit_result(&systemctl, "minicri-c1.scope", Duration::from_secs(5)).unwrap();
    assert_eq!(
        got,
        UnitResult {
            result: "oom-kill".into(),
            load_state: "loaded".into()
        }
    );
    assert_eq!(
        std::fs::read_to_string(&args).unwrap().trim(),
        "show --property=Result,LoadState -- minicri-c1.scope"
    );
    let partial = fake_systemctl(dir.path(), "echo Result=success");
    assert!(unit_result(&partial, "u.scope", Duration::from_secs(5)).is_err());
}

/// systemd is asked only under the systemd driver, only for a SIGKILL with no count read, and
/// only a loaded unit failed by an OOM kill counts.
#[test]
fn oom_after_exit_asks_systemd_only_for_an_unexplained_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let asked = dir.path().join("asked");
    let answer = dir.path().join("answer");
    let systemctl = fake_systemctl(
        dir.path(),
        &format!(
            "echo \"$@\" >> {}; cat {}",
            asked.display(),
            answer.display()
        ),
    );
    let exit = |code, oom_killed| crate::shim::ExitRecord {
        pid: 1,
        exit_code: code,
        signal: None,
        exited_at: String::new(),
        exited_at_ns: 0,
        oom_killed,
    };
    let id = "minicri-unit-test-no-such-container";
    let decide =
        |driver, e: &crate::shim::ExitRecord| oom_after_exit(&systemctl, driver, "", id, e);
    std::fs::write(&answer, "Result=oom-kill\nLoadState=loaded\n").unwrap();
    // The shim's count answers without asking.
    assert!(decide(CgroupDriver::Systemd, &exit(137, true)));
    // Not SIGKILL, or not the systemd driver: nothing to ask.
    assert!(!decide(CgroupDriver::Systemd, &exit(1, false)));
    assert!(!decide(CgroupDriver::Cgroupfs, &exit(137, false)));
    assert!(!asked.exists(), "systemd was asked");
    // A SIGKILL with no count under the systemd driver: systemd decides.
    assert!(decide(CgroupDriver::Systemd, &exit(137, false)));
    assert_eq!(
        std::fs::read_to_string(&asked).unwrap().trim(),
        format!("show --property=Result,LoadState -- minicri-{id}.scope")
    );
    std::fs::write(&answer, "Result=success\nLoadState=loaded\n").unwrap();
    assert!(!decide(CgroupDriver::Systemd, &exit(137, false)));
    // A unit systemd let go reads as success by default, whatever it was.
    std::fs::write(&answer, "Result=oom-kill\nLoadState=not-found\n").unwrap();
    assert!(!decide(CgroupDriver::Systemd, &exit(137, false)));
}

#[test]
fn unit_result_fails_on_a_failing_or_hung_systemctl() {
    let dir = tempfile::tempdir().unwrap();
    let failing = fake_systemctl(
        dir.path(),
        "echo Result=oom-kill; echo LoadState=loaded; exit 1",
    );
    assert!(unit_result(&failing, "u.scope", Duration::from_secs(5)).is_err());
    let hung = fake_systemctl(dir.path(), "exec sleep 30");
    let started = Instant::now();
    let err = unit_result(&hung, "u.scope", Duration::from_millis(300)).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let missing = dir.path().join("absent");
    assert!(unit_result(&missing, "u.scope", Duration::from_secs(5)).is_err());
}

const MOUNTINFO_HYBRID: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:9 - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime shared:12 - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

const MOUNTINFO_V2: &str = "\
22 1 0:21 / / rw - ext4 /dev/sda1 rw
30 22 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot
";

#[test]
fn hierarchies_from_mountinfo() {
    assert_eq!(
        Hierarchy::from_mountinfo(MOUNTINFO_HYBRID),
        Some(Hierarchy::V1 {
            memory: Some("/sys/fs/cgroup/memory".into()),
            cpuacct: Some("/sys/fs/cgroup/cpu,cpuacct".into()),
            pids: Some("/sys/fs/cgroup/pids".into()),
            cpu: Some("/sys/fs/cgroup/cpu,cpuacct".into()),
            cpuset: None,
        })
    );
    assert_eq!(
        Hierarchy::from_mountinfo(MOUNTINFO_V2),
        Some(Hierarchy::V2 {
            root: "/sys/fs/cgroup".into()
        })
    );
    assert_eq!(
        Hierarchy::from_mountinfo("22 1 0:21 / / rw - ext4 /dev/sda1 rw\n"),
        None
    );
}

const MEMORY_STAT_V1: &str = "\
cache 4096
rss 1048576
inactive_file 4096
pgfault 10
pgmajfault 1
hierarchical_memory_limit 268435456
hierarchical_memsw_limit 9223372036854771712
total_cache 8192
total_rss 2097152
total_pgfault 250
total_pgmajfault 3
total_inactive_anon 0
total_active_anon 2097152
total_inactive_file 8192
total_active_file 0
";

#[test]
fn memory_v1_counters() {
    let m = memory_v1(
        Some("2170880\n"),
        Some(MEMORY_STAT_V1),
        Some("9223372036854771712\n"),
    )
    .unwrap();
    assert_eq!(
        m,
        Memory {
            usage: 2_170_880,
            working_set: 2_170_880 - 8192,
            rss: 2_097_152,
            cache: 8192,
            page_faults: 250,
            major_page_faults: 3,
            // The parent's limit bounds a container without its own.
            limit: Some(268_435_456),
        }
    );
    assert_eq!(m.available(), Some(268_435_456 - (2_170_880 - 8192)));
    // Own limit lower than the hierarchy's; no total_* keys (old kernels' leaf view).
    let m = memory_v1(
        Some("100"),
        Some("rss 60\ninactive_file 200\npgfault 5\n"),
        Some("1048576"),
    )
    .unwrap();
    assert_eq!((m.working_set, m.rss, m.page_faults), (0, 60, 5));
    assert_eq!(m.limit, Some(1_048_576));
    // Unlimited everywhere.
    let m = memory_v1(Some("1"), Some(""), Some("9223372036854771712")).unwrap();
    assert_eq!((m.limit, m.available()), (None, None));
    assert_eq!(memory_v1(None, Some(MEMORY_STAT_V1), None), None);
}

const MEMORY_STAT_V2: &str = "\
anon 3145728
file 1048576
kernel 204800
inactive_anon 0
active_anon 3145728
inactive_file 1040384
active_file 8192
pgfault 1234
pgmajfault 7
";

#[test]
fn memory_v2_counters() {
    let m = memory_v2(
        Some("4395008\n"),
        Some(MEMORY_STAT_V2),
        ["max\n", "536870912\n", "1073741824\n"].into_iter(),
    )
    .unwrap();
    assert_eq!(
        m,
        Memory {
            usage: 4_395_008,
            working_set: 4_395_008 - 1_040_384,
            rss: 3_145_728,
            cache: 1_048_576,
            page_faults: 1234,
            major_page_faults: 7,
            limit: Some(536_870_912),
        }
    );
    let m = memory_v2(Some("10"), Some(MEMORY_STAT_V2), ["max"].into_iter()).unwrap();
    assert_eq!((m.working_set, m.limit), (0, None));
}

#[test]
fn cpu_counters() {
    let stat = "usage_usec 1500\nuser_usec 1000\nsystem_usec 500\nnr_periods 0\n";
    assert_eq!(cpu_v2(stat), Some(1_500_000));
    assert_eq!(cpu_v2("user_usec 3\n"), None);
    assert_eq!(parse_u64("2421425704\n"), Some(2_421_425_704));
    assert_eq!(
        keyed("oom 0\nunder_oom 0\noom_kill 2\n").get("oom_kill"),
        Some(&2)
    );
}

#[test]
fn counters_add_up() {
    let a = Counters {
        cpu_ns: Some(10),
        memory: Some(Memory {
            usage: 100,
            working_set: 80,
            rss: 50,
            cache: 20,
            page_faults: 1,
            major_page_faults: 0,
            limit: Some(1000),
        }),
        pids: Some(2),
    };
    let mut sum = Counters::default();
    assert!(sum.is_empty());
    sum.add(&a);
    sum.add(&Counters::default());
    sum.add(&a);
    assert_eq!(sum.cpu_ns, Some(20));
    assert_eq!(sum.pids, Some(4));
    let m = sum.memory.unwrap();
    assert_eq!(
        (m.usage, m.working_set, m.rss, m.limit),
        (200, 160, 100, None)
    );
}

#[test]
fn cgroup_paths_per_driver() {
    use CgroupDriver::*;
    assert_eq!(
        slice_dir("kubepods-besteffort-pod12.slice").unwrap(),
        PathBuf::from("kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod12.slice")
    );
    assert_eq!(slice_dir("-.slice").unwrap(), PathBuf::new());
    assert_eq!(slice_dir("a--b.slice"), None);
    assert_eq!(slice_dir("kubepods"), None);
    assert_eq!(
        container_cgroup(Cgroupfs, "/kubepods/pod1", "c1").unwrap(),
        PathBuf::from("kubepods/pod1/c1")
    );
    assert_eq!(
        container_cgroup(Cgroupfs, "", "c1").unwrap(),
        PathBuf::from("minicri/c1")
    );
    assert_eq!(
        container_cgroup(Systemd, "kubepods-pod1.slice", "c1").unwrap(),
        PathBuf::from("kubepods.slice/kubepods-pod1.slice/minicri-c1.scope")
    );
    assert_eq!(
        container_cgroup(Systemd, "", "c1").unwrap(),
        PathBuf::from("system.slice/minicri-c1.scope")
    );
    assert_eq!(container_cgroup(Systemd, "/kubepods", "c1"), None);
    assert_eq!(
        pod_cgroup(Cgroupfs, "/kubepods/pod1").unwrap(),
        PathBuf::from("kubepods/pod1")
    );
    assert_eq!(pod_cgroup(Cgroupfs, ""), None);
    assert_eq!(pod_cgroup(Cgroupfs, "/"), None);
    assert_eq!(pod_cgroup(Cgroupfs, "kubepods.slice"), None);
    assert_eq!(
        pod_cgroup(Systemd, "kubepods-pod1.slice").unwrap(),
        PathBuf::from("kubepods.slice/kubepods-pod1.slice")
    );
    assert_eq!(
        pod_cgroup(Systemd, "/test.slice").unwrap(),
        PathBuf::from("test.slice")
    );
}

#[test]
fn reads_a_v2_tree() {
    let d = tempfile::tempdir().unwrap();
    let pod = d.path().join("kubepods/pod1");
    let c = pod.join("c1");
    std::fs::create_dir_all(&c).unwrap();
    std::fs::write(d.path().join("kubepods/memory.max"), "max\n").unwrap();
    std::fs::write(pod.join("memory.max"), "1048576\n").unwrap();
    std::fs::write(c.join("memory.max"), "max\n").unwrap();
    std::fs::write(c.join("memory.current"), "4096\n").unwrap();
    std::fs::write(c.join("memory.stat"), "anon 4096\ninactive_file 0\n").unwrap();
    std::fs::write(c.join("cpu.stat"), "usage_usec 7\n").unwrap();
    std::fs::write(c.join("pids.current"), "3\n").unwrap();
    std::fs::write(c.join("memory.events"), "oom 1\noom_kill 1\n").unwrap();
    let h = Hierarchy::V2 {
        root: d.path().into(),
    };
    let got = h.read(Path::new("kubepods/pod1/c1"));
    assert_eq!(got.cpu_ns, Some(7000));
    assert_eq!(got.pids, Some(3));
    assert_eq!(got.memory.unwrap().limit, Some(1_048_576));
    assert_eq!(h.oom_kills(Path::new("kubepods/pod1/c1")), Some(1));
    assert!(h.read(Path::new("kubepods/pod1/gone")).is_empty());
}

#[test]
fn reads_a_v1_tree() {
    let d = tempfile::tempdir().unwrap();
    let dir = |c: &str| d.path().join(c).join("minicri/c1");
    for c in ["memory", "cpuacct", "pids"] {
        std::fs::create_dir_all(dir(c)).unwrap();
    }
    std::fs::write(dir("memory").join("memory.usage_in_bytes"), "2170880\n").unwrap();
    std::fs::write(dir("memory").join("memory.stat"), MEMORY_STAT_V1).unwrap();
    std::fs::write(dir("memory").join("memory.oom_control"), "oom_kill 0\n").unwrap();
    std::fs::write(dir("cpuacct").join("cpuacct.usage"), "123456789\n").unwrap();
    std::fs::write(dir("pids").join("pids.current"), "2\n").unwrap();
    let h = Hierarchy::V1 {
        memory: Some(d.path().join("memory")),
        cpuacct: Some(d.path().join("cpuacct")),
        pids: Some(d.path().join("pids")),
        cpu: Some(d.path().join("cpu")),
        cpuset: None,
    };
    let got = h.read(Path::new("minicri/c1"));
    assert_eq!(got.cpu_ns, Some(123_456_789));
    assert_eq!(got.pids, Some(2));
    assert_eq!(got.memory.unwrap().rss, 2_097_152);
    assert_eq!(h.oom_kills(Path::new("minicri/c1")), Some(0));
    let no_pids = Hierarchy::V1 {
        memory: Some(d.path().join("memory")),
        cpuacct: Some(d.path().join("cpuacct")),
        pids: None,
        cpu: None,
        cpuset: None,
    };
    assert_eq!(no_pids.read(Path::new("minicri/c1")).pids, None);
    // CPU limits: -1 is no quota; none at all without the controller.
    std::fs::create_dir_all(dir("cpu")).unwrap();
    std::fs::write(dir("cpu").join("cpu.shares"), "512\n").unwrap();
    std::fs::write(dir("cpu").join("cpu.cfs_quota_us"), "-1\n").unwrap();
    std::fs::write(dir("cpu").join("cpu.cfs_period_us"), "100000\n").unwrap();
    let want = CpuLimits {
        shares: Some(512),
        quota: None,
        period: Some(100_000),
    };
    assert_eq!(h.cpu_limits(Path::new("minicri/c1")), want);
    assert_eq!(
        no_pids.cpu_limits(Path::new("minicri/c1")),
        CpuLimits::default()
    );
}

/// v2 CPU limits: `cpu.weight` as shares, `cpu.max` as quota and period.
#[test]
fn reads_v2_cpu_limits() {
    let d = tempfile::tempdir().unwrap();
    let c = d.path().join("pod1");
    std::fs::create_dir_all(&c).unwrap();
    std::fs::write(c.join("cpu.weight"), "39\n").unwrap();
    std::fs::write(c.join("cpu.max"), "50000 100000\n").unwrap();
    let h = Hierarchy::V2 {
        root: d.path().into(),
    };
    let got = h.cpu_limits(Path::new("pod1"));
    assert_eq!((got.quota, got.period), (Some(50_000), Some(100_000)));
    // 1024 shares are weight 39, which reads back as 998 shares (the conversion rounds down).
    assert_eq!(weight_of_shares(1024), 39);
    assert_eq!(got.shares, Some(shares_of_weight(39)));
    assert_eq!(shares_of_weight(39), 998);
    std::fs::write(c.join("cpu.max"), "max 100000\n").unwrap();
    assert_eq!(h.cpu_limits(Path::new("pod1")).quota, None);
    assert_eq!(
        (weight_of_shares(2), weight_of_shares(262_144)),
        (1, 10_000)
    );
}

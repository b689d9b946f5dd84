//! The shim as a monitor, as root: long lines, log reopening, and surviving the process that
//! spawned it.

use crate::oci_support;

use std::io::{BufRead, BufReader};
use std::time::Duration;

use minicri::logs::Stream;
use minicri::oci::OciRuntime;
use minicri::shim::{ShimHandle, spawn_shim_blocking};
use oci_support::{
    Container, Sandbox, TestEnv, command, eventually, lines_of, require_root, sandbox_config,
};

#[tokio::test]
async fn a_mebibyte_line_is_split_into_partials() {
    require_root!();
    let env = TestEnv::new();
    let sb = Sandbox::start(&env, "long-sb", sandbox_config("long")).await;
    let script = "head -c 1048576 /dev/zero | tr '\\000' a; echo; echo short";
    let c = Container::run(&env, &sb, "long", command(&["sh", "-c", script])).await;
    assert_eq!(c.wait().await.exit_code, 0);
    let raw = std::fs::read(&c.log).unwrap();
    let entries: Vec<_> = raw
        .split_inclusive(|&b| b == b'\n')
        .map(|l| minicri::logs::parse_entry(l).unwrap())
        .collect();
    assert!(
        entries
            .iter()
            .all(|e| e.content.len() <= minicri::logs::DEFAULT_MAX_LINE)
    );
    let partials = entries.iter().filter(|e| e.partial).count();
    assert_eq!(partials, 1024 * 1024 / minicri::logs::DEFAULT_MAX_LINE - 1);
    let lines = c.lines();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0].0, Stream::Stdout);
    assert_eq!(lines[0].1.len(), 1024 * 1024);
    assert!(lines[0].1.bytes().all(|b| b == b'a'));
    assert_eq!(lines[1].1, "short");
}

fn numbers(lines: &[(Stream, String)]) -> Vec<u64> {
    lines
        .iter()
        .filter_map(|(_, l)| l.strip_prefix("line")?.parse().ok())
        .collect()
}

#[tokio::test]
async fn reopen_moves_output_to_a_new_file() {
    require_root!();
    let env = TestEnv::new();
    let sb = Sandbox::start(&env, "reopen-sb", sandbox_config("reopen")).await;
    let script =
        "i=0; while [ ! -e /tmp/stop ]; do echo line$i; i=$((i+1)); sleep 0.02; done; echo done";
    let c = Container::run(&env, &sb, "reopen", command(&["sh", "-c", script])).await;
    eventually("first lines", || numbers(&lines_of(&c.log)).len() >= 3).await;

    // What the kubelet's rotation does: rename, then ReopenContainerLog.
    let rotated = c.log.with_extension("log.1");
    std::fs::rename(&c.log, &rotated).unwrap();
    c.shim().reopen_log().await.unwrap();
    eventually("lines in the new file", || {
        numbers(&lines_of(&c.log)).len() >= 3
    })
    .await;

    // SIGUSR1 reopens too.
    let rotated2 = c.log.with_extension("log.2");
    std::fs::rename(&c.log, &rotated2).unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(c.shim().shim_pid),
        nix::sys::signal::SIGUSR1,
    )
    .unwrap();
    eventually("lines after SIGUSR1", || {
        numbers(&lines_of(&c.log)).len() >= 3
    })
    .await;

    std::fs::write(c.rootfs.join("tmp/stop"), b"").unwrap();
    assert_eq!(c.wait().await.exit_code, 0);
    let (a, b, d) = (lines_of(&rotated), lines_of(&rotated2), lines_of(&c.log));
    assert_eq!(d.last().unwrap().1, "done");
    // Nothing lost or duplicated across the three files.
    let all: Vec<u64> = [numbers(&a), numbers(&b), numbers(&d)].concat();
    assert!(!numbers(&a).is_empty() && !numbers(&b).is_empty());
    assert_eq!(all, (0..all.len() as u64).collect::<Vec<_>>());
}

/// Not a test on its own: the body of the spawner process of `the_shim_survives_its_spawner`
/// (this test binary run again with `MINICRI_OCI_SPAWNER` set). It spawns the shim, prints
/// the handle as JSON and waits to be killed.
#[test]
fn spawner_helper() {
    let Ok(args) = std::env::var("MINICRI_OCI_SPAWNER") else {
        return;
    };
    let v: serde_json::Value = serde_json::from_str(&args).unwrap();
    let s = |k: &str| v[k].as_str().unwrap().to_string();
    let runc = minicri::oci::Runc::new(s("runtime"), s("runtime_root"));
    let mut cfg = minicri::shim::ShimConfig::new(s("id"), s("bundle"), runc.command(), s("binary"));
    let log = std::path::PathBuf::from(s("log"));
    cfg.log = Some(minicri::shim::LogTarget {
        dir: log.parent().unwrap().to_path_buf(),
        path: log,
    });
    let handle = spawn_shim_blocking(&cfg).unwrap();
    println!("{}", serde_json::to_string(&handle).unwrap());
    std::io::Write::flush(&mut std::io::stdout()).unwrap();
    std::thread::sleep(Duration::from_secs(600));
}

#[tokio::test]
async fn the_shim_survives_its_spawner() {
    require_root!();
    let env = TestEnv::new();
    let sb = Sandbox::start(&env, "survive-sb", sandbox_config("survive")).await;
    // Build the bundle the usual way, but let another process spawn the shim.
    let mut c = Container::create(&env, &sb, "survive-tmp", command(&["true"])).await;
    oci_support::force_cleanup(&env.runc, &c.id, c.shim.as_ref());
    c.wait().await;
    let id = format!("{}-x", c.id);
    let bundle = c.dir.join("bundle");
    let args = serde_json::json!({
        "runtime": env.runc.binary, "runtime_root": env.runc.root, "id": id, "bundle": bundle,
        "binary": oci_support::minicri_binary(), "log": c.log,
    });
    // The container's command: wait until told, then print.
    let mut spec = oci_spec::runtime::Spec::load(bundle.join("config.json")).unwrap();
    let mut p = spec.process().clone().unwrap();
    p.set_args(Some(vec![
        "sh".into(),
        "-c".into(),
        "while [ ! -e /tmp/go ]; do sleep 0.05; done; echo survived".into(),
    ]));
    spec.set_process(Some(p));
    minicri::spec::write_bundle(&bundle, &spec).unwrap();

    // The test binary holds every integration module: the helper's name is its full path.
    let mut spawner = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "oci_shim::spawner_helper",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("MINICRI_OCI_SPAWNER", args.to_string())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut handle: Option<ShimHandle> = None;
    for line in BufReader::new(spawner.stdout.take().unwrap()).lines() {
        // The harness prints `test oci_shim::spawner_helper ... ` on the same line first.
        let line = line.unwrap();
        if let Some(Ok(h)) = line
            .find('{')
            .map(|i| serde_json::from_str::<ShimHandle>(&line[i..]))
        {
            handle = Some(h);
            break;
        }
    }
    let handle = handle.expect("the spawner reported a shim");
    c.id = id.clone();
    c.shim = Some(handle.clone());
    spawner.kill().unwrap(); // SIGKILL
    spawner.wait().unwrap();

    assert!(handle.is_alive(), "the shim outlives its spawner");
    assert_eq!(ShimHandle::load(&id, &bundle).unwrap(), handle);
    let sid = nix::unistd::getsid(Some(nix::unistd::Pid::from_raw(handle.shim_pid))).unwrap();
    assert_eq!(
        sid.as_raw(),
        handle.shim_pid,
        "the shim leads its own session"
    );
    // It holds no descriptor of the spawner beyond stdio (and its own files and pipes).
    let fds = std::fs::read_dir(format!("/proc/{}/fd", handle.shim_pid))
        .unwrap()
        .count();
    assert!(fds < 16, "{fds} descriptors");

    env.runc.start(&id).await.unwrap();
    std::fs::write(c.rootfs.join("tmp/go"), b"").unwrap();
    let exit = tokio::time::timeout(Duration::from_secs(30), handle.wait())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(exit.exit_code, 0);
    assert!(
        c.lines()
            .contains(&(Stream::Stdout, "survived".to_string())),
        "{:?}",
        c.lines()
    );
}

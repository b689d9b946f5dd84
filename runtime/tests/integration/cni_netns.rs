//! Pinned network namespaces (`minicri::netns`). Root only.

use crate::{cni_common, require_root};

use std::process::Command;

use cni_common::{ip_in, unique_hex};
use minicri::netns;

/// A temp dir used as a netns directory; its namespaces and its self-bind-mount go on drop.
struct Dir {
    tmp: tempfile::TempDir,
}

impl Dir {
    fn new() -> Dir {
        Dir {
            tmp: tempfile::tempdir().unwrap(),
        }
    }
    fn path(&self) -> std::path::PathBuf {
        self.tmp.path().join("netns")
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        if let Ok(entries) = std::fs::read_dir(self.path()) {
            for e in entries.flatten() {
                let _ = netns::remove(&e.path());
            }
        }
        let _ = netns::unmount_dir(&self.path());
    }
}

fn mountinfo_line(path: &std::path::Path) -> Option<String> {
    let target = path.to_str().unwrap();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .rev()
        .find(|l| l.split(' ').nth(4) == Some(target))
        .map(str::to_string)
}

#[test]
fn create_remove_are_clean_and_idempotent() {
    require_root!();
    let d = Dir::new();
    let name = format!("ns{}", unique_hex());
    let p = netns::create(&d.path(), &name).unwrap();
    assert_eq!(p, d.path().join(&name));
    assert!(netns::exists(&p));
    // The directory is a shared mount point; the namespace is a mount on it.
    let dir_line = mountinfo_line(&d.path()).expect("netns dir is a mount point");
    assert!(dir_line.contains("shared:"), "{dir_line}");
    assert!(
        mountinfo_line(&p)
            .expect("netns is mounted")
            .contains("nsfs")
    );

    let again = netns::create(&d.path(), &name).unwrap_err();
    assert_eq!(again.source.kind(), std::io::ErrorKind::AlreadyExists);
    assert!(
        netns::exists(&p),
        "a refused create leaves the namespace alone"
    );

    netns::remove(&p).unwrap();
    assert!(!netns::exists(&p));
    assert!(!p.exists());
    assert!(mountinfo_line(&p).is_none());
    netns::remove(&p).unwrap();
    netns::remove(&d.path().join("never-made")).unwrap();

    // A leftover plain file (crash between creating and mounting) is reused.
    std::fs::write(&p, "").unwrap();
    assert!(!netns::exists(&p));
    netns::create(&d.path(), &name).unwrap();
    assert!(netns::exists(&p));
    netns::remove(&p).unwrap();

    assert!(netns::create(&d.path(), "../escape").is_err());
    assert!(!d.tmp.path().join("escape").exists());
}

#[test]
fn a_namespace_is_isolated_with_loopback_up_and_joinable_by_path() {
    require_root!();
    let d = Dir::new();
    let p = netns::create(&d.path(), &format!("ns{}", unique_hex())).unwrap();

    let links = ip_in(&p, &["-o", "link", "show"]);
    assert_eq!(links.lines().count(), 1, "only lo: {links}");
    assert!(links.contains("lo:") && links.contains("UP"), "{links}");
    let lo = ip_in(&p, &["-o", "addr", "show", "dev", "lo"]);
    assert!(lo.contains("127.0.0.1/8"), "{lo}");

    // The calling thread did not move: it still sees the host's links.
    let host_ns = std::fs::read_link("/proc/thread-self/ns/net").unwrap();
    assert_eq!(
        std::fs::read_link("/proc/self/ns/net").unwrap(),
        host_ns,
        "the test process is still in the host namespace"
    );
    let inside = netns::run_in(&p, || {
        std::fs::read_link("/proc/thread-self/ns/net").unwrap()
    })
    .unwrap();
    assert_ne!(inside, host_ns);
    assert_eq!(
        std::fs::read_link("/proc/thread-self/ns/net").unwrap(),
        host_ns
    );

    // Another process joins it by path, as runc does.
    let out = Command::new("nsenter")
        .arg(format!("--net={}", p.display()))
        .args(["readlink", "/proc/self/ns/net"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        inside.to_string_lossy()
    );

    // Joining something that is not a namespace is refused.
    let plain = d.tmp.path().join("plain");
    std::fs::write(&plain, "").unwrap();
    assert!(netns::run_in(&plain, || ()).is_err());

    netns::remove(&p).unwrap();
    assert!(netns::run_in(&p, || ()).is_err());
}

#[test]
fn concurrent_creations_share_one_directory_mount() {
    require_root!();
    let d = Dir::new();
    let dir = d.path();
    let paths: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|i| {
                let dir = dir.clone();
                s.spawn(move || netns::create(&dir, &format!("c{i}")).unwrap())
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for p in &paths {
        assert!(netns::exists(p));
    }
    let target = dir.to_str().unwrap().to_string();
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let dir_mounts = mounts
        .lines()
        .filter(|l| l.split(' ').nth(4) == Some(target.as_str()))
        .count();
    assert_eq!(dir_mounts, 1, "one self-bind-mount of the directory");
    for p in &paths {
        netns::remove(p).unwrap();
    }
}

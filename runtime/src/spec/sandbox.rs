//! The pod sandbox: the infra process's OCI spec ([`sandbox_spec`]), the namespaces containers
//! join ([`SandboxNamespaces`]) and the files they share ([`SandboxFiles`]).
//!
//! The sandbox's network, IPC and UTS namespaces (and its PID namespace, shared by containers in
//! `POD` mode) are created by the OCI runtime for minicri's infra process (`minicri pause`, see
//! [`crate::pause`]) and held by it: containers join `/proc/<infra pid>/ns/*`. With
//! `NamespaceMode::NODE` the host's namespace is used instead (host network also means the
//! host's UTS namespace, as in the kubelet's model). A pre-created network namespace (a bind
//! mount) can be joined instead of a new one.
//!
//! Invariants of [`SandboxFiles`]: everything lives in the sandbox's directory; `shm` is a tmpfs
//! mounted there (only when the sandbox has its own IPC namespace) and [`SandboxFiles::cleanup`]
//! unmounts it; preparing again is harmless.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use minicri_proto::runtime::v1 as cri;
use oci_spec::runtime::{LinuxNamespaceType, LinuxResources, Mount, Process, Root, Spec, User};

use super::defaults::{self, bind_mount, dev_mount, linux_capabilities, proc_mount};
use super::namespaces::{namespace, namespace_options};
use super::propagation::is_mountpoint;
use super::seccomp::select_seccomp;
use super::user::id_from_i64;
use crate::oci::annotations::AnnotationPolicy;
use crate::oci::error::{OciError, Result};
use crate::oci::host::{CgroupDriver, HostInfo, cgroups_path};

/// `oom_score_adj` asked for the infra process (the kubelet's value for pause containers);
/// clamped like any other.
pub const SANDBOX_OOM_SCORE_ADJ: i64 = -998;

/// uid and gid of the infra process unless the pod asks for another.
pub const INFRA_UID: u32 = 65535;

fn mode(
    opts: Option<&cri::NamespaceOption>,
    f: impl Fn(&cri::NamespaceOption) -> i32,
) -> cri::NamespaceMode {
    opts.map(f)
        .and_then(|m| cri::NamespaceMode::try_from(m).ok())
        .unwrap_or(cri::NamespaceMode::Pod)
}

/// Namespace files a container of the sandbox joins; `None` means the host's namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SandboxNamespaces {
    pub net: Option<PathBuf>,
    pub ipc: Option<PathBuf>,
    pub uts: Option<PathBuf>,
    /// The sandbox's PID namespace, for containers in `POD` pid mode.
    pub pid: Option<PathBuf>,
    /// The pod's own user namespace ([`super::userns`]); `None`: the host's.
    pub user: Option<PathBuf>,
}

impl SandboxNamespaces {
    /// The namespaces held by the infra process `pid` under the sandbox's options.
    pub fn of_infra(pid: i32, config: &cri::PodSandboxConfig) -> Self {
        let o = namespace_options(config);
        let ns = |name: &str| Some(PathBuf::from(format!("/proc/{pid}/ns/{name}")));
        let host_net = mode(o, |o| o.network) == cri::NamespaceMode::Node;
        SandboxNamespaces {
            net: if host_net { None } else { ns("net") },
            ipc: if mode(o, |o| o.ipc) == cri::NamespaceMode::Node {
                None
            } else {
                ns("ipc")
            },
            uts: if host_net { None } else { ns("uts") },
            pid: if mode(o, |o| o.pid) == cri::NamespaceMode::Node {
                None
            } else {
                ns("pid")
            },
            user: super::userns::pod_userns(config)
                .ok()
                .flatten()
                .and_then(|_| ns("user")),
        }
    }
}

/// Files shared by the sandbox's containers (bind-mounted into each).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SandboxFiles {
    pub hostname: Option<PathBuf>,
    pub resolv_conf: Option<PathBuf>,
    pub hosts: Option<PathBuf>,
    /// A tmpfs for `/dev/shm`; `None` with host IPC (the host's `/dev/shm` is used).
    pub shm: Option<PathBuf>,
}

/// `/etc/resolv.conf` contents from the CRI DNS config.
pub fn resolv_conf(dns: &cri::DnsConfig) -> String {
    let mut s = String::new();
    if !dns.searches.is_empty() {
        s.push_str(&format!("search {}\n", dns.searches.join(" ")));
    }
    for n in &dns.servers {
        s.push_str(&format!("nameserver {n}\n"));
    }
    if !dns.options.is_empty() {
        s.push_str(&format!("options {}\n", dns.options.join(" ")));
    }
    s
}

/// `/etc/hosts` for a sandbox with its own network namespace.
pub fn hosts_file(hostname: &str) -> String {
    let mut s = String::from("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n");
    s.push_str("fe00::0\tip6-localnet\nfe00::0\tip6-mcastprefix\nfe00::1\tip6-allnodes\nfe00::2\tip6-allrouters\n");
    if !hostname.is_empty() {
        s.push_str(&format!("127.0.1.1\t{hostname}\n"));
    }
    s
}

fn write(path: &Path, contents: &[u8]) -> Result<()> {
    // Bind-mounted into containers, whose users must read them.
    minicri_snapshotter::write_atomic(path, contents, 0o644)
        .map_err(|e| OciError::io("write", path, e))
}

/// Room a sandbox's files get beyond what they hold when written: containers may write to their
/// `/etc/hosts`, `/etc/resolv.conf` and `/etc/hostname` (bind mounts of these files), and what
/// they write must not fill the filesystem of the state directory (`/run`, memory), which no
/// storage accounting of theirs sees.
pub const FILES_HEADROOM: u64 = 1 << 20;

impl SandboxFiles {
    /// Writes `hostname`, `resolv.conf` and `hosts` into `dir`, on a tmpfs of its own sized to
    /// them plus [`FILES_HEADROOM`], and mounts the shm tmpfs (`dir/shm`, 64 MiB) when the
    /// sandbox has its own IPC namespace. Host-network sandboxes get the host's hostname and
    /// `/etc/hosts`; without a DNS config, the host's resolv.conf.
    pub fn prepare(dir: &Path, config: &cri::PodSandboxConfig) -> Result<Self> {
        use nix::mount::{MsFlags, mount};
        std::fs::create_dir_all(dir).map_err(|e| OciError::io("create", dir, e))?;
        let o = namespace_options(config);
        let host_net = mode(o, |o| o.network) == cri::NamespaceMode::Node;
        let host_name = nix::unistd::gethostname()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_default();
        let hostname = if host_net || config.hostname.is_empty() {
            host_name
        } else {
            config.hostname.clone()
        };
        let files = SandboxFiles {
            hostname: Some(dir.join("hostname")),
            resolv_conf: Some(dir.join("resolv.conf")),
            hosts: Some(dir.join("hosts")),
            shm: (mode(o, |o| o.ipc) != cri::NamespaceMode::Node).then(|| dir.join("shm")),
        };
        let resolv = match &config.dns_config {
            Some(d) if !(d.servers.is_empty() && d.searches.is_empty() && d.options.is_empty()) => {
                resolv_conf(d).into_bytes()
            }
            _ => std::fs::read("/etc/resolv.conf").unwrap_or_default(),
        };
        let hosts = if host_net {
            std::fs::read("/etc/hosts").unwrap_or_default()
        } else {
            hosts_file(&hostname).into_bytes()
        };
        let hostname = format!("{hostname}\n").into_bytes();
        // The daemon runs as root; only its unit tests, with a fake runtime, do not, and they
        // cannot mount.
        if !is_mountpoint(dir) && nix::unistd::geteuid().is_root() {
            // Owned and moded as the directory was made (user namespace pods reach into it).
            use std::os::unix::fs::MetadataExt;
            let m = std::fs::metadata(dir).map_err(|e| OciError::io("stat", dir, e))?;
            let held = (hostname.len() + resolv.len() + hosts.len()) as u64;
            let size = (held + FILES_HEADROOM).div_ceil(4096) * 4096;
            let options = format!(
                "mode={:o},uid={},gid={},size={size}",
                m.mode() & 0o7777,
                m.uid(),
                m.gid()
            );
            let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
            mount(
                Some("minicri-files"),
                dir,
                Some("tmpfs"),
                flags,
                Some(options.as_str()),
            )
            .map_err(|e| OciError::io("mount a tmpfs on", dir, e.into()))?;
        }
        write(&dir.join("hostname"), &hostname)?;
        write(&dir.join("resolv.conf"), &resolv)?;
        write(&dir.join("hosts"), &hosts)?;
        if let Some(shm) = &files.shm {
            std::fs::create_dir_all(shm).map_err(|e| OciError::io("create", shm, e))?;
            if !is_mountpoint(shm) {
                let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
                mount(
                    Some("shm"),
                    shm,
                    Some("tmpfs"),
                    flags,
                    Some("mode=1777,size=65536k"),
                )
                .map_err(|e| OciError::io("mount shm tmpfs on", shm, e.into()))?;
            }
        }
        Ok(files)
    }

    /// Unmounts the shm tmpfs of a sandbox directory, then the directory's own tmpfs
    /// (idempotent; the directory is left to the caller to remove).
    pub fn cleanup(dir: &Path) -> Result<()> {
        for m in [dir.join("shm"), dir.to_path_buf()] {
            while is_mountpoint(&m) {
                nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH)
                    .map_err(|e| OciError::io("unmount", &m, e.into()))?;
            }
        }
        Ok(())
    }
}

/// Inputs of [`sandbox_spec`].
#[derive(Debug, Clone, Copy)]
pub struct SandboxSpecParams<'a> {
    pub id: &'a str,
    pub config: &'a cri::PodSandboxConfig,
    /// The infra rootfs from [`crate::pause::prepare_infra_rootfs`].
    pub infra: &'a crate::pause::InfraRootfs,
    /// Join this network namespace instead of creating one (unless the pod uses the host's).
    pub netns: Option<&'a Path>,
    pub cgroup_driver: CgroupDriver,
    pub host: &'a HostInfo,
    /// Which of the pod's annotations go into the spec.
    pub annotations: &'a AnnotationPolicy,
}

/// Checks what goes into the sandbox's resolv.conf and hosts files, one item per word or line:
/// servers are IP addresses, search domains, options and the hostname are single words without
/// control characters (a newline would add lines of the pod writer's choosing).
pub fn validate_dns_and_hostname(config: &cri::PodSandboxConfig) -> Result<()> {
    fn word(field: &str, v: &str, max: usize) -> Result<()> {
        if v.is_empty()
            || v.len() > max
            || v.chars()
                .any(|c| c.is_whitespace() || c.is_control() || c == '#')
        {
            return Err(OciError::invalid(format!(
                "{field} {v:?} must be one word of at most {max} characters without whitespace, control characters or '#'"
            )));
        }
        Ok(())
    }
    if !config.hostname.is_empty() {
        // The kernel's limit (HOST_NAME_MAX): longer failed in the OCI runtime, after CNI.
        word("hostname", &config.hostname, 64)?;
    }
    let Some(dns) = &config.dns_config else {
        return Ok(());
    };
    for s in &dns.servers {
        if s.parse::<std::net::IpAddr>().is_err() {
            return Err(OciError::invalid(format!(
                "dns_config server {s:?} is not an IP address"
            )));
        }
    }
    for s in &dns.searches {
        word("dns_config search domain", s, 253)?;
    }
    for o in &dns.options {
        word("dns_config option", o, 253)?;
    }
    if dns.servers.len() > 64 || dns.searches.len() > 64 || dns.options.len() > 64 {
        return Err(OciError::invalid(
            "dns_config has more than 64 servers, search domains or options",
        ));
    }
    Ok(())
}

/// The most sysctls a pod may set, and the longest name and value: the kernel's own names are
/// far shorter, a value is written to `/proc/sys` in one page, and Kubernetes' safe set plus an
/// administrator's allowed unsafe ones number a few dozen.
pub const MAX_SYSCTLS: usize = 256;
pub const MAX_SYSCTL_NAME: usize = 256;
pub const MAX_SYSCTL_VALUE: usize = 4096;

/// Checks that `sysctls` are few and short, namespaced, and that their namespace is the
/// sandbox's own.
pub fn validate_sysctls(config: &cri::PodSandboxConfig) -> Result<()> {
    let Some(linux) = &config.linux else {
        return Ok(());
    };
    if linux.sysctls.len() > MAX_SYSCTLS {
        return Err(OciError::invalid(format!(
            "{} sysctls, at most {MAX_SYSCTLS} are taken",
            linux.sysctls.len()
        )));
    }
    if let Some((k, v)) = linux
        .sysctls
        .iter()
        .find(|(k, v)| k.len() > MAX_SYSCTL_NAME || v.len() > MAX_SYSCTL_VALUE)
    {
        return Err(OciError::invalid(format!(
            "sysctl {:?} ({} bytes, value {} bytes): names are at most {MAX_SYSCTL_NAME} bytes, values {MAX_SYSCTL_VALUE}",
            k.chars().take(64).collect::<String>(),
            k.len(),
            v.len()
        )));
    }
    let o = namespace_options(config);
    let host_net = mode(o, |o| o.network) == cri::NamespaceMode::Node;
    let host_ipc = mode(o, |o| o.ipc) == cri::NamespaceMode::Node;
    for key in linux.sysctls.keys() {
        let k = key.replace('/', ".");
        let ipc = k.starts_with("kernel.shm")
            || k.starts_with("kernel.msg")
            || k == "kernel.sem"
            || k.starts_with("fs.mqueue.");
        let net = k.starts_with("net.");
        if net && host_net {
            return Err(OciError::invalid(format!(
                "sysctl {key} needs the pod's own network namespace"
            )));
        }
        if ipc && host_ipc {
            return Err(OciError::invalid(format!(
                "sysctl {key} needs the pod's own IPC namespace"
            )));
        }
        if !net && !ipc {
            return Err(OciError::invalid(format!("sysctl {key} is not namespaced")));
        }
    }
    Ok(())
}

/// The infra process's spec: `/minicri pause` from the read-only infra rootfs, PID 1 of the
/// sandbox's PID namespace, with new network (or `netns`), IPC and UTS namespaces unless the
/// pod uses the host's; the pod's hostname and sysctls; no capabilities, `no_new_privileges`,
/// the default seccomp profile (unless the pod's is `Unconfined` or `Localhost`), uid/gid 65535
/// unless `run_as_user`/`run_as_group` say otherwise; `oom_score_adj` -998 clamped. A pod with
/// its own user namespace ([`super::userns`]) gets it here, with its mappings, and then
/// creates its network namespace too (`netns` must be `None`); the infra runs as its root.
pub fn sandbox_spec(p: &SandboxSpecParams<'_>) -> Result<Spec> {
    validate_sysctls(p.config)?;
    let linux_cfg = p.config.linux.clone().unwrap_or_default();
    let sc = linux_cfg.security_context.clone().unwrap_or_default();
    let o = sc.namespace_options.as_ref();
    let host_net = mode(o, |o| o.network) == cri::NamespaceMode::Node;
    let userns = super::userns::pod_userns(p.config)?;
    if userns.is_some() && p.netns.is_some() {
        return Err(OciError::invalid(
            "a pod with its own user namespace creates its network namespace with it",
        ));
    }

    // In a user namespace the infra runs as its root (no capability, no host privilege): the
    // default 65535 need not be mapped.
    let default_id = if userns.is_some() { 0 } else { INFRA_UID };
    let mut user = User::default();
    let uid = match &sc.run_as_user {
        Some(v) => id_from_i64(v.value, "run_as_user")?,
        None => default_id,
    };
    let gid = match &sc.run_as_group {
        Some(v) => id_from_i64(v.value, "run_as_group")?,
        None if sc.run_as_user.is_some() => 0,
        None => default_id,
    };
    user.set_uid(uid);
    user.set_gid(gid);
    let mut process = Process::default();
    process.set_terminal(Some(false));
    process.set_args(Some(vec![
        crate::pause::INFRA_BINARY.to_string(),
        "pause".to_string(),
    ]));
    process.set_env(Some(vec!["PATH=/".to_string()]));
    process.set_cwd(PathBuf::from("/"));
    process.set_user(user);
    process.set_capabilities(Some(linux_capabilities(&HashSet::new(), &[])?));
    process.set_no_new_privileges(Some(true));
    process.set_rlimits(None);
    process.set_oom_score_adj(Some(p.host.clamp_oom_score_adj(SANDBOX_OOM_SCORE_ADJ)));

    let mut mounts: Vec<Mount> = vec![proc_mount(), dev_mount()];
    mounts.push(bind_mount(
        crate::pause::INFRA_BINARY,
        &p.infra.binary,
        &["rprivate", "ro"],
    ));
    for dir in &p.infra.lib_dirs {
        let dest = dir
            .to_str()
            .ok_or_else(|| OciError::invalid("library dir is not UTF-8"))?;
        mounts.push(bind_mount(
            dest,
            dir,
            &["rprivate", "ro", "nosuid", "nodev"],
        ));
    }

    use LinuxNamespaceType as T;
    let mut namespaces = vec![namespace(T::Mount, None)];
    if userns.is_some() {
        namespaces.push(namespace(T::User, None));
    }
    if mode(o, |o| o.pid) != cri::NamespaceMode::Node {
        namespaces.push(namespace(T::Pid, None));
    }
    if mode(o, |o| o.ipc) != cri::NamespaceMode::Node {
        namespaces.push(namespace(T::Ipc, None));
    }
    if !host_net {
        namespaces.push(namespace(T::Uts, None));
        namespaces.push(namespace(T::Network, p.netns));
    }
    if p.host.cgroup_v2 {
        namespaces.push(namespace(T::Cgroup, None));
    }

    let mut resources = LinuxResources::default();
    resources.set_devices(Some(defaults::default_device_rules()));
    let mut l = oci_spec::runtime::Linux::default();
    l.set_uid_mappings(userns.map(|u| vec![u.uid]));
    l.set_gid_mappings(userns.map(|u| vec![u.gid]));
    l.set_namespaces(Some(namespaces));
    l.set_resources(Some(resources));
    l.set_cgroups_path(Some(cgroups_path(
        p.cgroup_driver,
        &linux_cfg.cgroup_parent,
        p.id,
    )?));
    l.set_sysctl(if linux_cfg.sysctls.is_empty() {
        None
    } else {
        Some(linux_cfg.sysctls.clone().into_iter().collect())
    });
    l.set_masked_paths(Some(defaults::strings(&defaults::DEFAULT_MASKED_PATHS)));
    l.set_readonly_paths(Some(defaults::strings(&defaults::DEFAULT_READONLY_PATHS)));
    let profile = sc
        .seccomp
        .clone()
        .or_else(|| Some(cri::SecurityProfile::default()));
    #[allow(deprecated)] // the old field still names a profile when the new one is unset
    let old_path = &sc.seccomp_profile_path;
    l.set_seccomp(select_seccomp(profile.as_ref(), old_path, &HashSet::new())?);

    let mut root = Root::default();
    root.set_path(p.infra.rootfs.clone());
    root.set_readonly(Some(true));
    let mut spec = Spec::default();
    spec.set_version("1.0.2".to_string());
    spec.set_hostname(if host_net || p.config.hostname.is_empty() {
        None
    } else {
        Some(p.config.hostname.clone())
    });
    spec.set_root(Some(root));
    spec.set_process(Some(process));
    spec.set_mounts(Some(mounts));
    let md = p.config.metadata.clone().unwrap_or_default();
    spec.set_annotations(Some(p.annotations.for_spec(
        &p.config.annotations,
        &[
            ("io.kubernetes.cri.container-type", "sandbox"),
            ("io.kubernetes.cri.sandbox-id", p.id),
            ("io.kubernetes.cri.sandbox-name", &md.name),
            ("io.kubernetes.cri.sandbox-namespace", &md.namespace),
            ("io.kubernetes.cri.sandbox-uid", &md.uid),
        ],
    )));
    spec.set_linux(Some(l));
    Ok(spec)
}

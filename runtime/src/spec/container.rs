//! The OCI runtime spec of a CRI container: [`container_spec`].
//!
//! Inputs are the CRI `ContainerConfig` and `PodSandboxConfig`, the image config, the writable
//! snapshot (rootfs) and the sandbox's namespaces and shared files. The mapping follows the CRI
//! (`api.proto`) and the OCI runtime spec:
//!
//! - process: argv is `command` (else the image `Entrypoint`) followed by `args` (else, when
//!   `command` is empty, the image `Cmd`) — Docker's rule the kubelet relies on; env is
//!   `HOSTNAME`, the image's `Env`, then the CRI `envs` (later keys win), with a default `PATH`;
//!   cwd is `working_dir`, else the image's, else `/`; user and groups as in [`super::user`];
//!   with `tty`, a terminal (`process.terminal`, which the runtime hands to the shim through
//!   `--console-socket`) and `TERM=xterm` unless the env sets `TERM` ([`with_term`]);
//! - namespaces: a new mount namespace; network, IPC and UTS of the sandbox (absent, i.e. the
//!   host's, for host-network / host-IPC pods); PID per the container's `NamespaceMode`
//!   (`POD`: the sandbox's, `CONTAINER`: a new one, `NODE`: the host's, `TARGET`: another
//!   container's); a cgroup namespace on cgroup v2 hosts; the pod's user namespace, with its
//!   mappings, when it has one ([`super::userns`]);
//! - mounts: [`super::defaults::standard_mounts`], `/dev/shm` from the sandbox, the sandbox's
//!   `/etc/hostname`, `/etc/resolv.conf` and `/etc/hosts`, then the CRI mounts (bind, with
//!   `rprivate` / `rslave` / `rshared` propagation and `ro`; image volumes read-only, `nosuid`
//!   and `nodev`, from where CreateContainer mounted the image, see [`check_mount`]); a CRI
//!   mount replaces a default one at the same destination; CRI mounts are ordered parents first;
//! - security: capabilities (the 14 defaults, `add`/`drop` with `ALL`), `privileged` (every
//!   capability and host device, no masked paths, no seccomp, read-write `/sys`, and only in a
//!   privileged sandbox), seccomp ([`super::seccomp::select_seccomp`]), the AppArmor profile
//!   ([`super::apparmor::select_apparmor`]), masked and read-only paths (the CRI's lists, or
//!   the defaults when it sends none), `no_new_privs`, read-only rootfs;
//! - resources: cpu shares, quota, period, cpuset, memory limit and swap, hugepages, `unified`
//!   (cgroup v2 only); `oom_score_adj` clamped by [`HostInfo::clamp_oom_score_adj`];
//! - `linux.cgroupsPath` from the sandbox's `cgroup_parent` ([`crate::oci::host::cgroups_path`]).
//!
//! Building a spec reads the rootfs's passwd/group files, host device nodes, a `Localhost`
//! seccomp profile and the kernel's list of AppArmor profiles, and changes nothing.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use minicri_proto::runtime::v1 as cri;
use oci_spec::runtime::{
    Capability, LinuxCpu, LinuxDevice, LinuxDeviceCgroup, LinuxHugepageLimit, LinuxMemory,
    LinuxNamespace, LinuxNamespaceType, LinuxResources, Mount, Process, Root, Spec, User,
};

use super::apparmor::select_apparmor;
use super::defaults::{self, bind_mount, linux_capabilities};
use super::image_config::ImageConfig;
use super::namespaces::namespace;
use super::sandbox::{SandboxFiles, SandboxNamespaces};
use super::seccomp::select_seccomp;
use super::user::{UserRequest, resolve_user};
use super::userns::PodUserns;
use crate::oci::annotations::AnnotationPolicy;
use crate::oci::error::{OciError, Result};
use crate::oci::host::{CgroupDriver, HostInfo, cgroups_path};

pub const DEFAULT_PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Everything [`container_spec`] needs.
#[derive(Debug, Clone, Copy)]
pub struct ContainerSpecParams<'a> {
    pub id: &'a str,
    pub sandbox_id: &'a str,
    pub config: &'a cri::ContainerConfig,
    pub sandbox_config: &'a cri::PodSandboxConfig,
    pub image: &'a ImageConfig,
    /// The container's writable snapshot, mounted.
    pub rootfs: &'a Path,
    pub namespaces: &'a SandboxNamespaces,
    pub files: &'a SandboxFiles,
    /// `/proc/<pid>/ns/pid` of the target container, for `NamespaceMode::TARGET`.
    pub target_pid_ns: Option<&'a Path>,
    pub cgroup_driver: CgroupDriver,
    pub host: &'a HostInfo,
    /// Which of the container's annotations go into the spec.
    pub annotations: &'a AnnotationPolicy,
}

/// The capability set from the defaults and the CRI `add`/`drop` lists (`ALL` in `add` grants
/// every capability the host can give, `ALL` in `drop` starts from none, then adds apply; drops
/// win over adds). Defaults the host cannot give are left out; naming such a capability in
/// `add` is an error, since the OCI runtime would fail the create with a less clear one.
pub fn capability_set(
    caps: Option<&cri::Capability>,
    host: &HostInfo,
) -> Result<HashSet<Capability>> {
    let available =
        |c: &Capability| defaults::capability_number(c).is_some_and(|n| host.has_capability(n));
    let mut set: HashSet<Capability> = defaults::DEFAULT_CAPABILITIES
        .iter()
        .map(|c| defaults::parse_capability(c))
        .collect::<Result<HashSet<_>>>()?
        .into_iter()
        .filter(available)
        .collect();
    let Some(caps) = caps else { return Ok(set) };
    let is_all = |c: &String| c.eq_ignore_ascii_case("ALL");
    if caps.drop_capabilities.iter().any(is_all) {
        set.clear();
    }
    if caps.add_capabilities.iter().any(is_all) {
        set.extend(defaults::host_capabilities(host));
    }
    for c in caps.add_capabilities.iter().filter(|c| !is_all(c)) {
        let cap = defaults::parse_capability(c)?;
        if !available(&cap) {
            return Err(OciError::invalid(format!(
                "capability {c} cannot be granted: minicri does not hold it (bounding set)"
            )));
        }
        set.insert(cap);
    }
    for c in caps.drop_capabilities.iter().filter(|c| !is_all(c)) {
        set.remove(&defaults::parse_capability(c)?);
    }
    Ok(set)
}

/// What the kernel refuses when the OCI runtime writes the cgroup, refused here by name: CFS
/// periods are 1 ms to 1 s and quotas -1 (none) or at least 1 ms, in microseconds; hugepage
/// limits fit the OCI runtime's signed field and page sizes read like `2MB`; cpusets are lists
/// of numbers and ranges (`0-3,7`). Otherwise StartContainer or UpdateContainerResources failed
/// in the runtime, as INTERNAL.
fn check_resources(r: &cri::LinuxContainerResources) -> Result<()> {
    let bad = |what: String| Err(OciError::invalid(what));
    if r.cpu_period != 0 && !(1_000..=1_000_000).contains(&r.cpu_period) {
        return bad(format!(
            "cpu_period {} is not 1000 to 1000000 microseconds",
            r.cpu_period
        ));
    }
    if r.cpu_quota != 0 && r.cpu_quota != -1 && r.cpu_quota < 1_000 {
        return bad(format!(
            "cpu_quota {} is neither -1 nor at least 1000 microseconds",
            r.cpu_quota
        ));
    }
    for (field, v) in [
        ("cpuset_cpus", &r.cpuset_cpus),
        ("cpuset_mems", &r.cpuset_mems),
    ] {
        let list = |v: &str| {
            v.split(',').all(|part| {
                let mut ends = part.splitn(2, '-');
                let num = |n: Option<&str>| n.is_some_and(|n| n.parse::<u32>().is_ok());
                let first = ends.next();
                match ends.next() {
                    Some(last) => num(first) && num(Some(last)),
                    None => num(first),
                }
            })
        };
        if !v.is_empty() && (v.len() > 4096 || !list(v)) {
            return bad(format!("{field} {v:?} is not a list of numbers and ranges"));
        }
    }
    for (i, h) in r.hugepage_limits.iter().enumerate() {
        if h.limit > i64::MAX as u64 {
            return bad(format!(
                "hugepage_limits[{i}].limit {} is too large",
                h.limit
            ));
        }
        let digits = h.page_size.trim_end_matches(['K', 'M', 'G', 'B']);
        if digits.is_empty()
            || digits.len() > 20
            || !digits.bytes().all(|b| b.is_ascii_digit())
            || !matches!(&h.page_size[digits.len()..], "KB" | "MB" | "GB")
        {
            return bad(format!(
                "hugepage_limits[{i}].page_size {:?} is not a size like 2MB",
                h.page_size
            ));
        }
    }
    Ok(())
}

/// Cgroup resources from the CRI (zero means unset, as in the CRI).
pub fn linux_resources(
    r: &cri::LinuxContainerResources,
    host: &HostInfo,
) -> Result<LinuxResources> {
    check_resources(r)?;
    let mut out = LinuxResources::default();
    let mut cpu = LinuxCpu::default();
    if r.cpu_shares > 0 {
        cpu.set_shares(Some(r.cpu_shares as u64));
    }
    if r.cpu_quota != 0 {
        cpu.set_quota(Some(r.cpu_quota));
    }
    if r.cpu_period > 0 {
        cpu.set_period(Some(r.cpu_period as u64));
    }
    if !r.cpuset_cpus.is_empty() {
        cpu.set_cpus(Some(r.cpuset_cpus.clone()));
    }
    if !r.cpuset_mems.is_empty() {
        cpu.set_mems(Some(r.cpuset_mems.clone()));
    }
    if cpu != LinuxCpu::default() {
        out.set_cpu(Some(cpu));
    }
    if r.memory_limit_in_bytes > 0 {
        let mut mem = LinuxMemory::default();
        mem.set_limit(Some(r.memory_limit_in_bytes));
        // memory+swap: the CRI's swap limit when given, else equal to the limit (no swap).
        let swap = if r.memory_swap_limit_in_bytes > 0 {
            r.memory_swap_limit_in_bytes
        } else {
            r.memory_limit_in_bytes
        };
        if swap < r.memory_limit_in_bytes {
            return Err(OciError::invalid(
                "memory_swap_limit_in_bytes is below memory_limit_in_bytes",
            ));
        }
        mem.set_swap(Some(swap));
        out.set_memory(Some(mem));
    }
    if !r.hugepage_limits.is_empty() {
        let limits = r
            .hugepage_limits
            .iter()
            .map(|h| {
                let mut l = LinuxHugepageLimit::default();
                l.set_page_size(h.page_size.clone());
                l.set_limit(h.limit as i64);
                l
            })
            .collect();
        out.set_hugepage_limits(Some(limits));
    }
    if !r.unified.is_empty() && host.cgroup_v2 {
        out.set_unified(Some(r.unified.clone().into_iter().collect()));
    }
    Ok(out)
}

fn propagation(p: i32) -> Result<&'static str> {
    match cri::MountPropagation::try_from(p) {
        Ok(cri::MountPropagation::PropagationPrivate) => Ok("rprivate"),
        Ok(cri::MountPropagation::PropagationHostToContainer) => Ok("rslave"),
        Ok(cri::MountPropagation::PropagationBidirectional) => Ok("rshared"),
        Err(_) => Err(OciError::invalid(format!("unknown mount propagation {p}"))),
    }
}

/// The image a CRI mount names (`Mount.image.image`, an image volume), if any.
pub fn image_of(m: &cri::Mount) -> Option<&str> {
    m.image
        .as_ref()
        .map(|i| i.image.as_str())
        .filter(|i| !i.is_empty())
}

/// The longest `image_sub_path` taken (the kernel's `PATH_MAX`).
const MAX_SUB_PATH: usize = 4096;

/// Checks the form of an image volume's `image_sub_path` (where it leads is checked in the image
/// when the pod service mounts it): relative to the image's root and without `..`, as Kubernetes
/// validates `subPath`.
fn check_image_sub_path(m: &cri::Mount) -> Result<()> {
    let sub = &m.image_sub_path;
    let bad = |why: &str| {
        Err(OciError::invalid(format!(
            "mount {:?}: image_sub_path {sub:?} {why}",
            m.container_path
        )))
    };
    if sub.len() > MAX_SUB_PATH {
        return bad(&format!("is longer than {MAX_SUB_PATH} bytes"));
    }
    if sub.starts_with('/') {
        return bad("is not relative to the image's root");
    }
    if Path::new(sub)
        .components()
        .any(|c| c == std::path::Component::ParentDir)
    {
        return bad("has a '..' component");
    }
    Ok(())
}

/// Checks one CRI mount (everything but id mappings, see [`cri_mounts`]) and returns its OCI
/// propagation option.
///
/// `recursive_read_only` (CRI): every mount below the source is read-only too (the OCI runtime's
/// `rro` option, `mount_setattr(2)` with `AT_RECURSIVE`); it requires `readonly` and private
/// propagation, as the CRI says, and a host that can do it ([`HostInfo::recursive_read_only`]).
///
/// An image volume (`image` set) has no `host_path` of the caller's: CreateContainer mounts the
/// image and names that mount as its `host_path` (the pod service's image volumes), which is what the
/// spec binds. It is read-only and private whatever is asked: nothing is written to it and
/// nothing is ever mounted below it on the host, so there is nothing to propagate; asking for
/// `Bidirectional` is refused.
fn check_mount(m: &cri::Mount, host: &HostInfo) -> Result<&'static str> {
    if m.container_path.contains('\0')
        || m.host_path.contains('\0')
        || m.image_sub_path.contains('\0')
    {
        return Err(OciError::invalid(format!(
            "mount {:?} (host_path {:?}) holds a NUL byte",
            m.container_path, m.host_path
        )));
    }
    if !m.container_path.starts_with('/') {
        return Err(OciError::invalid(format!(
            "mount container_path {:?} is not absolute",
            m.container_path
        )));
    }
    let image = image_of(m);
    if image.is_none() && !m.image_sub_path.is_empty() {
        return Err(OciError::invalid(format!(
            "mount {:?} has an image_sub_path but names no image",
            m.container_path
        )));
    }
    if image.is_none() && m.host_path.is_empty() {
        return Err(OciError::invalid(format!(
            "mount {:?} has no host_path",
            m.container_path
        )));
    }
    // A relative source would be resolved by the OCI runtime against its working directory, the
    // container's bundle (its config.json and shim socket), and by minicri against its own.
    if !m.host_path.is_empty() && !m.host_path.starts_with('/') {
        return Err(OciError::invalid(format!(
            "mount {:?}: host_path {:?} is not absolute",
            m.container_path, m.host_path
        )));
    }
    let prop = propagation(m.propagation)?;
    if image.is_some() {
        check_image_sub_path(m)?;
        if prop == "rshared" {
            return Err(OciError::invalid(format!(
                "mount {:?}: an image volume is read-only, it cannot propagate mounts back \
                 (Bidirectional)",
                m.container_path
            )));
        }
    }
    if m.recursive_read_only {
        if !m.readonly {
            return Err(OciError::invalid(format!(
                "mount {:?}: recursive_read_only needs readonly",
                m.container_path
            )));
        }
        if prop != "rprivate" {
            return Err(OciError::invalid(format!(
                "mount {:?}: recursive_read_only needs private propagation, not {prop}",
                m.container_path
            )));
        }
        if !host.recursive_read_only {
            return Err(OciError::invalid(
                "recursive read-only mounts are not supported on this host \
                 (they need Linux >= 5.12 and an OCI runtime that knows `rro`)",
            ));
        }
    }
    Ok(if image.is_some() { "rprivate" } else { prop })
}

/// Checks the CRI mounts of a container, but for id mappings (which
/// [`super::userns::check_volume_mappings`] checks): CreateContainer calls it before it
/// prepares their sources on the host, so that a refused request changes nothing there.
pub fn validate_mounts(mounts: &[cri::Mount], host: &HostInfo) -> Result<()> {
    if mounts.len() > MAX_MOUNTS {
        return Err(OciError::invalid(format!(
            "{} mounts, at most {MAX_MOUNTS} are taken",
            mounts.len()
        )));
    }
    let images = mounts.iter().filter(|m| image_of(m).is_some()).count();
    if images > MAX_IMAGE_VOLUMES {
        return Err(OciError::invalid(format!(
            "{images} image volumes, at most {MAX_IMAGE_VOLUMES} are taken"
        )));
    }
    mounts.iter().try_for_each(|m| {
        if image_of(m).is_some() && !m.host_path.is_empty() {
            return Err(OciError::invalid(format!(
                "mount {:?} names both an image and a host_path",
                m.container_path
            )));
        }
        check_mount(m, host).map(drop)
    })
}

/// The most image volumes a container may ask for. Each is a snapshot and one or two mounts on
/// the host for the container's life (an overlay of the image's layers, which the kernel
/// stacks at most 500 deep, and the bind of its sub path); a pod's image volumes, one per
/// volume mount, stay far below it.
pub const MAX_IMAGE_VOLUMES: usize = 64;

/// The most mounts a container may ask for. Each costs the runtime a mount at every start (and a
/// lookup in the host's mount table when propagated); in a pod with its own user namespace each
/// is an idmapped mount kept in the host's mount namespace, whose size the kernel caps for
/// everybody (`fs.mount-max`). A pod's volumes, the kubelet's own files and the service account
/// token stay far below it.
pub const MAX_MOUNTS: usize = 1024;

/// The CRI mounts as OCI bind mounts, parents first, and the rootfs propagation they need
/// (`rshared` when any mount is bidirectional, else `rslave` when any is host-to-container:
/// the container's copy of the host mount must stay in the host's peer group, or become its
/// slave, for mounts to cross). Mounts still carrying id mappings are refused: the caller
/// replaces them with idmapped sources first ([`super::userns::idmapped_mounts`]).
pub fn cri_mounts(
    mounts: &[cri::Mount],
    host: &HostInfo,
) -> Result<(Vec<Mount>, Option<&'static str>)> {
    let mut out = Vec::new();
    let mut root_propagation = None;
    let mut sorted: Vec<&cri::Mount> = mounts.iter().collect();
    sorted.sort_by_key(|m| Path::new(&m.container_path).components().count());
    for m in sorted {
        let prop = check_mount(m, host)?;
        let image = image_of(m).is_some();
        if image && m.host_path.is_empty() {
            return Err(OciError::invalid(format!(
                "image volume {:?} was not mounted on the host before the spec was built",
                m.container_path
            )));
        }
        if !m.uid_mappings.is_empty() || !m.gid_mappings.is_empty() {
            return Err(OciError::invalid(format!(
                "mount {:?}: id mappings are only supported in a pod with its own user namespace",
                m.container_path
            )));
        }
        match prop {
            "rshared" => root_propagation = Some("rshared"),
            "rslave" if root_propagation.is_none() => root_propagation = Some("rslave"),
            _ => {}
        }
        let mut opts = vec![prop, if m.readonly || image { "ro" } else { "rw" }];
        if image {
            // An image's files are not the node's: no setuid programs, no device nodes.
            opts.extend(["nosuid", "nodev"]);
        }
        if m.recursive_read_only {
            opts.push("rro");
        }
        out.push(bind_mount(
            &m.container_path,
            Path::new(&m.host_path),
            &opts,
        ));
    }
    Ok((out, root_propagation))
}

/// argv per the Docker/CRI rule (see the module docs).
pub fn process_args(config: &cri::ContainerConfig, image: &ImageConfig) -> Result<Vec<String>> {
    let mut argv = if config.command.is_empty() {
        image.entrypoint.clone()
    } else {
        config.command.clone()
    };
    if !config.args.is_empty() {
        argv.extend(config.args.iter().cloned());
    } else if config.command.is_empty() {
        argv.extend(image.cmd.iter().cloned());
    }
    if argv.is_empty() {
        return Err(OciError::invalid(
            "no command specified: neither the container config nor the image has one",
        ));
    }
    if let Some(a) = argv.iter().find(|a| a.contains('\0')) {
        return Err(OciError::invalid(format!(
            "the command line holds a NUL byte, in {a:?}"
        )));
    }
    Ok(argv)
}

/// `HOSTNAME`, the image's env, the CRI env (a later key replaces an earlier one, in place).
/// An image entry without `=` unsets its name, as in Docker images. Entries the OCI runtime
/// would refuse when it starts the container (a NUL byte, an empty name) are refused here, so
/// the request fails with a status naming them rather than at StartContainer, and so are CRI
/// keys with an `=`, which would set another variable than the one named.
///
/// Keys are found through an index, not by scanning: an image config may hold hundreds of
/// thousands of entries, and a scan per entry made CreateContainer take minutes.
pub fn process_env(
    hostname: &str,
    image: &[String],
    cri_env: &[cri::KeyValue],
) -> Result<Vec<String>> {
    let mut env: Vec<Option<String>> = Vec::new();
    let mut slots: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    let mut set = |kv: String| {
        let (key, unset) = match kv.split_once('=') {
            Some((key, _)) => (key.to_string(), false),
            None => (kv.clone(), true),
        };
        let value = (!unset).then_some(kv);
        match slots.get(&key) {
            Some(&i) => env[i] = value,
            None if unset => {}
            None => {
                slots.insert(key, env.len());
                env.push(value);
            }
        }
    };
    set(format!("HOSTNAME={hostname}"));
    for e in image {
        if e.contains('\0') || e.starts_with('=') || e.is_empty() {
            return Err(OciError::invalid(format!(
                "the image's Env entry {e:?} has no name or holds a NUL byte"
            )));
        }
        set(e.clone());
    }
    for (i, kv) in cri_env.iter().enumerate() {
        let value = String::from_utf8_lossy(&kv.value);
        if kv.key.is_empty() || kv.key.contains(['\0', '=']) || value.contains('\0') {
            return Err(OciError::invalid(format!(
                "envs[{i}] (key {:?}) has an empty key, an `=` in its key or a NUL byte",
                kv.key
            )));
        }
        set(format!("{}={value}", kv.key));
    }
    let mut env: Vec<String> = env.into_iter().flatten().collect();
    if !env.iter().any(|e| e.starts_with("PATH=")) {
        env.push(DEFAULT_PATH.to_string());
    }
    Ok(env)
}

/// Adds `TERM=xterm` to a terminal process's `env` unless it sets `TERM`: programs need to know
/// what the terminal is (containerd does the same for tty containers and exec).
pub fn with_term(env: &mut Vec<String>) {
    if !env.iter().any(|e| e.starts_with("TERM=")) {
        env.push("TERM=xterm".into());
    }
}

/// The OCI spec of a container; see the module docs.
pub fn container_spec(p: &ContainerSpecParams<'_>) -> Result<Spec> {
    let c = p.config;
    let linux = c.linux.clone().unwrap_or_default();
    let sc = linux.security_context.clone().unwrap_or_default();
    let sandbox_privileged = p
        .sandbox_config
        .linux
        .as_ref()
        .and_then(|l| l.security_context.as_ref())
        .is_some_and(|s| s.privileged);
    if sc.privileged && !sandbox_privileged {
        return Err(OciError::invalid(
            "a privileged container needs a privileged sandbox",
        ));
    }
    let (process, caps) = container_process(p, &linux, &sc)?;
    let (mounts, root_propagation) = container_mounts(p, &sc)?;
    let (namespaces, userns) = container_namespaces(p, &sc)?;

    // Linux section.
    let mut resources = match &linux.resources {
        Some(r) => linux_resources(r, p.host)?,
        None => LinuxResources::default(),
    };
    let (devices, rules) = container_devices(c, &sc)?;
    resources.set_devices(Some(rules));
    let mut l = oci_spec::runtime::Linux::default();
    l.set_uid_mappings(userns.map(|u| vec![u.uid]));
    l.set_gid_mappings(userns.map(|u| vec![u.gid]));
    l.set_sysctl(None);
    l.set_namespaces(Some(namespaces));
    l.set_resources(Some(resources));
    let parent = p
        .sandbox_config
        .linux
        .as_ref()
        .map(|l| l.cgroup_parent.as_str())
        .unwrap_or("");
    l.set_cgroups_path(Some(cgroups_path(p.cgroup_driver, parent, p.id)?));
    l.set_devices(if devices.is_empty() {
        None
    } else {
        Some(devices)
    });
    l.set_rootfs_propagation(root_propagation.map(str::to_string));
    if sc.privileged {
        l.set_masked_paths(None);
        l.set_readonly_paths(None);
        l.set_seccomp(None);
    } else {
        let masked = if sc.masked_paths.is_empty() {
            defaults::strings(&defaults::DEFAULT_MASKED_PATHS)
        } else {
            sc.masked_paths.clone()
        };
        let ro = if sc.readonly_paths.is_empty() {
            defaults::strings(&defaults::DEFAULT_READONLY_PATHS)
        } else {
            sc.readonly_paths.clone()
        };
        l.set_masked_paths(Some(masked));
        l.set_readonly_paths(Some(ro));
        #[allow(deprecated)] // the old field still names a profile when the new one is unset
        let old_path = &sc.seccomp_profile_path;
        l.set_seccomp(select_seccomp(sc.seccomp.as_ref(), old_path, &caps)?);
    }

    let mut root = Root::default();
    root.set_path(p.rootfs.to_path_buf());
    root.set_readonly(Some(sc.readonly_rootfs));
    let mut spec = Spec::default();
    spec.set_version("1.0.2".to_string());
    spec.set_hostname(None);
    spec.set_root(Some(root));
    spec.set_process(Some(process));
    spec.set_mounts(Some(mounts));
    let name = c.metadata.as_ref().map_or("", |m| m.name.as_str());
    spec.set_annotations(Some(p.annotations.for_spec(
        &c.annotations,
        &[
            ("io.kubernetes.cri.container-type", "container"),
            ("io.kubernetes.cri.sandbox-id", p.sandbox_id),
            ("io.kubernetes.cri.container-name", name),
        ],
    )));
    spec.set_linux(Some(l));
    Ok(spec)
}

/// The container's process: command, environment, working directory, user, capabilities (also
/// returned: the default seccomp profile depends on them), AppArmor profile and OOM score.
fn container_process(
    p: &ContainerSpecParams<'_>,
    linux: &cri::LinuxContainerConfig,
    sc: &cri::LinuxContainerSecurityContext,
) -> Result<(Process, HashSet<Capability>)> {
    let c = p.config;
    let strict = sc.supplemental_groups_policy == cri::SupplementalGroupsPolicy::Strict as i32;
    let user = resolve_user(
        p.rootfs,
        &UserRequest {
            run_as_user: sc.run_as_user.map(|v| v.value),
            run_as_username: &sc.run_as_username,
            run_as_group: sc.run_as_group.map(|v| v.value),
            supplemental_groups: &sc.supplemental_groups,
            strict_groups: strict,
            image_user: &p.image.user,
        },
    )?;
    let mut oci_user = User::default();
    oci_user.set_uid(user.uid);
    oci_user.set_gid(user.gid);
    oci_user.set_additional_gids(if user.additional_gids.is_empty() {
        None
    } else {
        Some(user.additional_gids.clone())
    });
    let hostname = if p.namespaces.uts.is_some() {
        p.sandbox_config.hostname.clone()
    } else {
        nix::unistd::gethostname()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    let caps = if sc.privileged {
        defaults::host_capabilities(p.host).into_iter().collect()
    } else {
        capability_set(sc.capabilities.as_ref(), p.host)?
    };
    let ambient = sc
        .capabilities
        .as_ref()
        .map(|c| c.add_ambient_capabilities.clone())
        .unwrap_or_default();
    let mut process = Process::default();
    process.set_terminal(Some(c.tty));
    process.set_args(Some(process_args(c, p.image)?));
    let mut env = process_env(&hostname, &p.image.env, &c.envs)?;
    if c.tty {
        with_term(&mut env);
    }
    process.set_env(Some(env));
    let cwd = if !c.working_dir.is_empty() {
        &c.working_dir
    } else {
        &p.image.working_dir
    };
    if cwd.contains('\0') {
        return Err(OciError::invalid(format!(
            "the working directory {cwd:?} holds a NUL byte"
        )));
    }
    process.set_cwd(PathBuf::from("/").join(cwd));
    process.set_user(oci_user);
    process.set_capabilities(Some(linux_capabilities(&caps, &ambient)?));
    process.set_no_new_privileges(Some(sc.no_new_privs));
    #[allow(deprecated)] // the old field still names a profile when the new one is unset
    let old_apparmor = &sc.apparmor_profile;
    process.set_apparmor_profile(select_apparmor(
        sc.apparmor.as_ref(),
        old_apparmor,
        sc.privileged,
        p.host.apparmor,
        super::apparmor::loaded,
    )?);
    process.set_rlimits(None);
    process.set_oom_score_adj(
        linux
            .resources
            .as_ref()
            .map(|r| p.host.clamp_oom_score_adj(r.oom_score_adj)),
    );
    Ok((process, caps))
}

/// The container's mounts: the defaults (`/proc`, `/dev`, ..., the sandbox's `/dev/shm` and
/// `/etc` files) unless a CRI mount takes their destination, then the CRI mounts; and the
/// rootfs propagation the CRI mounts need.
fn container_mounts(
    p: &ContainerSpecParams<'_>,
    sc: &cri::LinuxContainerSecurityContext,
) -> Result<(Vec<Mount>, Option<&'static str>)> {
    let c = p.config;
    let (user_mounts, root_propagation) = cri_mounts(&c.mounts, p.host)?;
    let taken: HashSet<PathBuf> = user_mounts
        .iter()
        .map(|m| m.destination().clone())
        .collect();
    let mut mounts = defaults::standard_mounts(sc.privileged);
    let etc_opts: &[&str] = if sc.readonly_rootfs {
        &["rprivate", "ro"]
    } else {
        &["rprivate", "rw"]
    };
    mounts.push(match (&p.namespaces.ipc, &p.files.shm) {
        (None, _) => bind_mount("/dev/shm", Path::new("/dev/shm"), &["rprivate", "rw"]),
        (Some(_), Some(shm)) => bind_mount(
            "/dev/shm",
            shm,
            &["rprivate", "rw", "nosuid", "nodev", "noexec"],
        ),
        (Some(_), None) => defaults::private_shm(),
    });
    for (dest, src) in [
        ("/etc/hostname", &p.files.hostname),
        ("/etc/resolv.conf", &p.files.resolv_conf),
        ("/etc/hosts", &p.files.hosts),
    ] {
        if let Some(src) = src {
            mounts.push(bind_mount(dest, src, etc_opts));
        }
    }
    mounts.retain(|m| !taken.contains(m.destination()));
    mounts.extend(user_mounts);
    Ok((mounts, root_propagation))
}

/// The container's namespaces: the sandbox's network, IPC and UTS, the PID namespace its
/// options ask for (the pod's, its own, the host's in a host-PID pod, or a target container's),
/// a cgroup namespace on cgroup v2, and the pod's user namespace with its mappings (returned).
fn container_namespaces(
    p: &ContainerSpecParams<'_>,
    sc: &cri::LinuxContainerSecurityContext,
) -> Result<(Vec<LinuxNamespace>, Option<PodUserns>)> {
    let c = p.config;
    use LinuxNamespaceType as T;
    let mut namespaces = vec![namespace(T::Mount, None)];
    for (typ, path) in [
        (T::Network, &p.namespaces.net),
        (T::Ipc, &p.namespaces.ipc),
        (T::Uts, &p.namespaces.uts),
    ] {
        if let Some(path) = path {
            namespaces.push(namespace(typ, Some(path)));
        }
    }
    let pid_mode = sc
        .namespace_options
        .as_ref()
        .map_or(cri::NamespaceMode::Container as i32, |n| n.pid);
    match cri::NamespaceMode::try_from(pid_mode) {
        Ok(cri::NamespaceMode::Pod) => {
            if let Some(path) = &p.namespaces.pid {
                namespaces.push(namespace(T::Pid, Some(path)));
            }
        }
        Ok(cri::NamespaceMode::Container) => namespaces.push(namespace(T::Pid, None)),
        // The host's PID namespace only for containers of a host-PID pod: anyone else would see
        // and signal every process of the node.
        Ok(cri::NamespaceMode::Node) => {
            let pod_pid = super::namespaces::namespace_options(p.sandbox_config).map(|o| o.pid);
            if pod_pid != Some(cri::NamespaceMode::Node as i32) {
                return Err(OciError::invalid(
                    "pid namespace NODE (the host's) for a container of a pod that does not use \
                     the host's PID namespace",
                ));
            }
        }
        Ok(cri::NamespaceMode::Target) => {
            let target = p
                .target_pid_ns
                .ok_or_else(|| OciError::invalid("pid namespace TARGET without a target"))?;
            namespaces.push(namespace(T::Pid, Some(target)));
        }
        Err(_) => {
            return Err(OciError::invalid(format!(
                "unknown pid namespace mode {pid_mode}"
            )));
        }
    }
    if p.host.cgroup_v2 {
        namespaces.push(namespace(T::Cgroup, None));
    }
    // The pod's user namespace, with the same mappings (runc wants them also when joining).
    let userns = match &p.namespaces.user {
        Some(path) => {
            let u = super::userns::pod_userns(p.sandbox_config)?.ok_or_else(|| {
                OciError::invalid("the sandbox has a user namespace its config does not ask for")
            })?;
            namespaces.push(namespace(T::User, Some(path)));
            Some(u)
        }
        None => None,
    };
    super::userns::check_container(c, userns.as_ref())?;
    Ok((namespaces, userns))
}

/// The container's devices (the host's all for a privileged one, then those it asks for, the
/// last asked for at a path winning) and the device cgroup rules that allow them.
fn container_devices(
    c: &cri::ContainerConfig,
    sc: &cri::LinuxContainerSecurityContext,
) -> Result<(Vec<LinuxDevice>, Vec<LinuxDeviceCgroup>)> {
    let mut devices = Vec::new();
    let mut rules = if sc.privileged {
        defaults::allow_all_devices()
    } else {
        defaults::default_device_rules()
    };
    if sc.privileged {
        devices.extend(defaults::all_host_devices());
    }
    let mut budget = defaults::MAX_DEVICE_WALK;
    for d in &c.devices {
        if d.host_path.contains('\0') || d.container_path.contains('\0') {
            return Err(OciError::invalid(format!(
                "device {:?} (host_path {:?}) holds a NUL byte",
                d.container_path, d.host_path
            )));
        }
        if !d.permissions.chars().all(|c| matches!(c, 'r' | 'w' | 'm')) {
            return Err(OciError::invalid(format!(
                "device {:?}: permissions {:?} are not some of r, w and m",
                d.container_path, d.permissions
            )));
        }
        let found = defaults::host_devices(
            Path::new(&d.host_path),
            Path::new(&d.container_path),
            &mut budget,
        )?;
        if !sc.privileged {
            rules.extend(
                found
                    .iter()
                    .map(|dev| defaults::device_rule(dev, &d.permissions)),
            );
        }
        devices.extend(found);
    }
    // Of devices at one path the last one asked for wins, in one pass.
    let mut seen = HashSet::new();
    let mut kept: Vec<_> = devices
        .into_iter()
        .rev()
        .filter(|d| seen.insert(d.path().clone()))
        .collect();
    kept.reverse();
    let devices = kept;
    Ok((devices, rules))
}

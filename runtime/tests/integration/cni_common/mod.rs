//! Shared support of the CNI and netns tests: unique names, a per-test network (own conf dir,
//! bridge, subnet, IPAM data dir, netns dir) torn down by `Drop` even when the test fails, and
//! fake plugins written as shell scripts.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use minicri::cni::{CniManager, CniOptions, PodNetwork};
use minicri::netns;

/// Debian's plugins.
pub const SYSTEM_BIN: &str = "/usr/lib/cni";

/// Returns early (passing) from a test that needs root, saying so.
#[macro_export]
macro_rules! require_root {
    () => {
        if minicri_tests::prereq::skip_unless_root() {
            return;
        }
    };
}

/// Returns early from a test that needs Debian's CNI plugins.
#[macro_export]
macro_rules! require_plugins {
    () => {
        $crate::require_root!();
        if let Some(why) = minicri_tests::prereq::missing(
            (!std::path::Path::new($crate::cni_common::SYSTEM_BIN)
                .join("bridge")
                .exists())
            .then(|| format!("no CNI plugins in {}", $crate::cni_common::SYSTEM_BIN)),
        ) {
            eprintln!("skipping: {why}");
            return;
        }
    };
}

/// 8 hex digits unlikely to repeat across threads and concurrent test processes.
pub fn unique_hex() -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let mut x = (std::process::id() as u64) << 32
        ^ (N.fetch_add(1, Ordering::SeqCst) as u64) << 20
        ^ nanos as u64;
    // splitmix64 finaliser
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d049bb133111eb);
    x ^= x >> 31;
    format!("{:08x}", x as u32)
}

pub fn run(cmd: &str, args: &[&str]) -> std::process::Output {
    Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"))
}

pub fn stdout(cmd: &str, args: &[&str]) -> String {
    String::from_utf8_lossy(&run(cmd, args).stdout).into_owned()
}

/// A free /28 inside 10.199.0.0/16, as (network address, CIDR text); unique in this process and
/// not configured on any host interface.
pub fn free_subnet() -> (String, String) {
    static TAKEN: Mutex<Vec<u32>> = Mutex::new(Vec::new());
    let in_use = stdout("ip", &["-4", "-o", "addr", "show"]) + &stdout("ip", &["-4", "route"]);
    for _ in 0..200 {
        let idx = u32::from_str_radix(&unique_hex(), 16).unwrap() % 4096;
        let (a, b) = (idx / 16, (idx % 16) * 16);
        let net = format!("10.199.{a}.{b}");
        let mut taken = TAKEN.lock().unwrap();
        let busy = (b..b + 16).any(|h| in_use.contains(&format!("10.199.{a}.{h}/")))
            || in_use.contains(&format!("{net}/28"));
        if !taken.contains(&idx) && !busy {
            taken.push(idx);
            return (net.clone(), format!("{net}/28"));
        }
    }
    panic!("no free /28 in 10.199.0.0/16");
}

/// One test's private network world. Everything it made is removed on drop.
pub struct TestNet {
    pub tmp: tempfile::TempDir,
    pub conf_dir: PathBuf,
    pub state_dir: PathBuf,
    pub netns_dir: PathBuf,
    pub ipam_dir: PathBuf,
    pub bridge: String,
    pub network: String,
    pub subnet: String,
    /// Network address of the subnet (the gateway is .1 above it).
    pub subnet_base: String,
    netns: Mutex<Vec<PathBuf>>,
    extra_links: Mutex<Vec<String>>,
}

impl TestNet {
    pub fn new() -> TestNet {
        let tmp = tempfile::Builder::new()
            .prefix("minicri-cni")
            .tempdir()
            .unwrap();
        let root = tmp.path().to_path_buf();
        let hex = unique_hex();
        let (subnet_base, subnet) = free_subnet();
        let net = TestNet {
            conf_dir: root.join("net.d"),
            state_dir: root.join("state"),
            netns_dir: root.join("state/netns"),
            ipam_dir: root.join("ipam"),
            bridge: format!("mcri{hex}"),
            network: format!("mcrinet-{hex}"),
            subnet,
            subnet_base,
            tmp,
            netns: Mutex::new(Vec::new()),
            extra_links: Mutex::new(Vec::new()),
        };
        std::fs::create_dir_all(&net.conf_dir).unwrap();
        net
    }

    /// The bridge plugin's configuration for this test: no masquerading (no iptables), host-local
    /// with a private data dir.
    pub fn bridge_plugin(&self) -> serde_json::Value {
        serde_json::json!({
            "type": "bridge",
            "bridge": self.bridge,
            "isGateway": true,
            "ipMasq": false,
            "ipam": {
                "type": "host-local",
                "ranges": [[{ "subnet": self.subnet }]],
                "dataDir": self.ipam_dir,
            }
        })
    }

    /// Writes `<conf_dir>/<file>` with a list of `plugins`.
    pub fn write_conflist(&self, file: &str, plugins: Vec<serde_json::Value>) -> PathBuf {
        let list = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": self.network,
            "plugins": plugins,
        });
        let p = self.conf_dir.join(file);
        std::fs::write(&p, serde_json::to_vec_pretty(&list).unwrap()).unwrap();
        p
    }

    pub fn manager(&self, bin_dirs: Vec<PathBuf>) -> CniManager {
        let mut opts = CniOptions::new(vec![self.conf_dir.clone()], bin_dirs, &self.state_dir);
        opts.plugin_timeout = Duration::from_secs(20);
        CniManager::new(opts)
    }

    pub fn system_manager(&self) -> CniManager {
        self.manager(vec![PathBuf::from(SYSTEM_BIN)])
    }

    /// A new pinned netns (removed on drop) and the pod request using it.
    pub fn pod(&self) -> PodNetwork {
        let id = format!("pod{}", unique_hex());
        let path = netns::create(&self.netns_dir, &id).expect("create netns");
        self.netns.lock().unwrap().push(path.clone());
        PodNetwork {
            id,
            netns: path,
            name: "web".into(),
            namespace: "default".into(),
            uid: "uid-1".into(),
            if_name: "eth0".into(),
            ..Default::default()
        }
    }

    /// Also delete this host link on drop (e.g. an ifb the bandwidth plugin made).
    pub fn cleanup_link(&self, name: &str) {
        self.extra_links.lock().unwrap().push(name.to_string());
    }

    /// Addresses host-local has on record (its data dir holds one file per address).
    pub fn allocated_ips(&self) -> Vec<String> {
        let dir = self.ipam_dir.join(&self.network);
        let Ok(entries) = std::fs::read_dir(dir) else {
            return vec![];
        };
        entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.parse::<std::net::IpAddr>().is_ok())
            .collect()
    }
}

impl Drop for TestNet {
    fn drop(&mut self) {
        for ns in self.netns.lock().unwrap().drain(..) {
            if let Err(e) = netns::remove(&ns) {
                eprintln!("cleanup: {e}");
            }
        }
        let _ = netns::unmount_dir(&self.netns_dir);
        for link in self.extra_links.lock().unwrap().drain(..) {
            let _ = Command::new("ip").args(["link", "del", &link]).output();
        }
        // The bridge plugin leaves its bridge behind by design.
        let _ = Command::new("ip")
            .args(["link", "del", &self.bridge])
            .output();
    }
}

/// Whether a host link exists.
pub fn link_exists(name: &str) -> bool {
    run("ip", &["link", "show", "dev", name]).status.success()
}

/// Runs `ip ARGS` inside the namespace at `ns` (a child started from a thread that joined it).
pub fn ip_in(ns: &Path, args: &[&str]) -> String {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    netns::run_in(ns, move || {
        let out = Command::new("ip").args(&args).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
    })
    .unwrap()
}

/// Fake plugins: shell scripts in a temp bin dir that record each call under `rec/`.
pub struct FakePlugins {
    pub bin: PathBuf,
    pub rec: PathBuf,
}

impl FakePlugins {
    pub fn new(root: &Path) -> FakePlugins {
        let f = FakePlugins {
            bin: root.join("fakebin"),
            rec: root.join("rec"),
        };
        std::fs::create_dir_all(&f.bin).unwrap();
        std::fs::create_dir_all(&f.rec).unwrap();
        f
    }

    fn write(&self, name: &str, body: &str) {
        use std::os::unix::fs::PermissionsExt;
        let rec = self.rec.display();
        let script = format!(
            "#!/bin/sh\n\
             n=$(basename \"$0\")\n\
             echo \"$n $CNI_COMMAND\" >> {rec}/calls\n\
             cat > {rec}/$n.$CNI_COMMAND.stdin\n\
             env | grep '^CNI_' | sort > {rec}/$n.$CNI_COMMAND.env\n\
             {body}\n"
        );
        let p = self.bin.join(name);
        std::fs::write(&p, script).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    /// A plugin whose ADD prints a result with `addr` on eth0 (in `CNI_NETNS`) and MAC `mac`.
    pub fn ok(&self, name: &str, addr: &str, mac: &str) {
        self.write(
            name,
            &format!(
                "[ \"$CNI_COMMAND\" = ADD ] || exit 0\n\
                 printf '{{\"cniVersion\":\"1.0.0\",\"interfaces\":[{{\"name\":\"host0\"}},{{\"name\":\"eth0\",\"mac\":\"{mac}\",\"sandbox\":\"%s\"}}],\"ips\":[{{\"interface\":1,\"address\":\"{addr}\",\"gateway\":\"10.9.0.1\"}}],\"dns\":{{}}}}' \"$CNI_NETNS\""
            ),
        );
    }

    /// [`Self::ok`], but its DEL fails while the file `down` exists (an IPAM plugin whose
    /// daemon is not up yet).
    pub fn del_fails_while(&self, name: &str, addr: &str, mac: &str, down: &Path) {
        self.write(
            name,
            &format!(
                "if [ \"$CNI_COMMAND\" = DEL ] && [ -e {down} ]; then echo '{{\"cniVersion\":\"1.0.0\",\"code\":11,\"msg\":\"datastore unavailable\"}}'; exit 1; fi\n\
                 [ \"$CNI_COMMAND\" = ADD ] || exit 0\n\
                 printf '{{\"cniVersion\":\"1.0.0\",\"interfaces\":[{{\"name\":\"eth0\",\"mac\":\"{mac}\",\"sandbox\":\"%s\"}}],\"ips\":[{{\"interface\":0,\"address\":\"{addr}\"}}],\"dns\":{{}}}}' \"$CNI_NETNS\"",
                down = down.display()
            ),
        );
    }

    /// A plugin whose ADD fails with the spec's error object (DEL and CHECK succeed).
    pub fn fails_with_json(&self, name: &str) {
        self.write(
            name,
            "[ \"$CNI_COMMAND\" = ADD ] || exit 0\n\
             echo '{\"cniVersion\":\"1.0.0\",\"code\":7,\"msg\":\"bad bridge name\",\"details\":\"too long\"}'\n\
             exit 1",
        );
    }

    /// A plugin that dies on every command with text on stderr.
    pub fn crashes(&self, name: &str) {
        self.write(name, "echo 'panic: runtime error' >&2\nexit 2");
    }

    /// A plugin that hangs (its pid goes to `rec/<name>.pid`).
    pub fn hangs(&self, name: &str) {
        let rec = self.rec.display();
        self.write(name, &format!("echo $$ > {rec}/{name}.pid\nexec sleep 60"));
    }

    /// A plugin whose ADD succeeds but prints garbage.
    pub fn prints_garbage(&self, name: &str) {
        self.write(name, "echo 'this is not json'");
    }

    /// A plugin that prints `mib` MiB of zeros on stdout and exits 0.
    pub fn floods(&self, name: &str, mib: u64) {
        self.write(name, &format!("head -c {} /dev/zero", mib << 20));
    }

    /// A plugin that fails with a CNI error whose message is `kib` KiB long.
    pub fn fails_at_length(&self, name: &str, kib: u64) {
        self.write(
            name,
            &format!(
                "printf '{{\"cniVersion\":\"1.0.0\",\"code\":100,\"msg\":\"'; head -c {} /dev/zero | tr '\\000' m; printf '\"}}'; exit 1",
                kib << 10
            ),
        );
    }

    /// The recorded calls, `"<plugin> <COMMAND>"`, in order.
    pub fn calls(&self) -> Vec<String> {
        std::fs::read_to_string(self.rec.join("calls"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    pub fn clear_calls(&self) {
        let _ = std::fs::remove_file(self.rec.join("calls"));
    }

    /// The configuration `plugin` got on stdin for `command`, parsed.
    pub fn stdin(&self, plugin: &str, command: &str) -> serde_json::Value {
        let p = self.rec.join(format!("{plugin}.{command}.stdin"));
        serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap()
    }

    /// The `CNI_*` environment `plugin` got for `command`, as `KEY=value` lines.
    pub fn env(&self, plugin: &str, command: &str) -> String {
        std::fs::read_to_string(self.rec.join(format!("{plugin}.{command}.env"))).unwrap()
    }
}

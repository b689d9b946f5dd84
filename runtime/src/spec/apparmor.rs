//! AppArmor for containers: the profile a CRI security profile selects ([`select_apparmor`]),
//! minicri's `RuntimeDefault` profile ([`DEFAULT_PROFILE`], loaded at start by
//! [`load_default_profile`]) and what the kernel says ([`enabled`], [`loaded`]).
//!
//! The OCI runtime applies the chosen profile (`process.apparmorProfile`) as it executes the
//! container's process; `exec` copies it from the container's spec. Which profile:
//!
//! | request (new `apparmor` field, else the deprecated string) | AppArmor on | AppArmor off |
//! |---|---|---|
//! | none, unprivileged | `minicri-default` | none |
//! | none, privileged | none | none |
//! | `RuntimeDefault` (`runtime/default`) | `minicri-default` | none |
//! | `Unconfined` (`unconfined`) | none | none |
//! | `Localhost` NAME or `localhost/NAME` (`localhost/NAME`) | NAME, if loaded, else FAILED_PRECONDITION | FAILED_PRECONDITION |
//!
//! "AppArmor on" means the kernel module's `enabled` parameter says `Y`. `minicri-default` is
//! used only when it could be loaded at start (that needs `apparmor_parser`, from Debian's
//! `apparmor` package); without it, containers asking for the runtime default run without an
//! AppArmor profile, as on a host without AppArmor, and the start says so in a warning. A
//! `Localhost` profile is never loaded by minicri: the node's administrator loads it (as the
//! kubelet's documentation says), and a container naming one that is not loaded is refused
//! rather than run unconfined. The sandbox's infra process gets no profile.

use std::path::{Path, PathBuf};

use minicri_proto::runtime::v1 as cri;

use crate::oci::error::{OciError, Result};
use crate::oci::host::AppArmorHost;

/// The name of minicri's `RuntimeDefault` profile.
pub const DEFAULT_PROFILE: &str = "minicri-default";

/// minicri's `RuntimeDefault` profile: what a container's processes do (files, network, the
/// capabilities their spec grants, signals and tracing among themselves) is allowed; mounting,
/// the kernel's own knobs and secrets under /proc and /sys are not, whatever the container's
/// capabilities.
const DEFAULT_PROFILE_TEXT: &str = r#"# minicri's RuntimeDefault AppArmor profile, loaded by minicri at start.
#include <tunables/global>

profile minicri-default flags=(attach_disconnected,mediate_deleted) {
  #include <abstractions/base>

  file,
  network,
  capability,
  umount,
  signal (receive) peer=unconfined,
  signal (send, receive) peer=minicri-default,
  ptrace (trace, read, tracedby, readby) peer=minicri-default,

  deny mount,
  deny pivot_root,
  deny @{PROC}/sysrq-trigger rwklx,
  deny @{PROC}/kcore rwklx,
  deny @{PROC}/kmsg rwklx,
  deny @{PROC}/sys/kernel/** wklx,
  deny @{PROC}/sys/vm/** wklx,
  deny @{PROC}/sys/fs/** wklx,
  deny /sys/firmware/** rwklx,
  deny /sys/kernel/security/** rwklx,
  deny /sys/kernel/debug/** rwklx,
}
"#;

const PROFILES: &str = "/sys/kernel/security/apparmor/profiles";

/// Whether a profile named `name` is loaded (`/sys/kernel/security/apparmor/profiles` lists
/// `NAME (MODE)` per line).
pub fn loaded(name: &str) -> bool {
    std::fs::read_to_string(PROFILES).is_ok_and(|list| profile_listed(&list, name))
}

fn profile_listed(list: &str, name: &str) -> bool {
    list.lines()
        .any(|l| l.rsplit_once(" (").is_some_and(|(n, _)| n == name))
}

/// Loads (or replaces) [`DEFAULT_PROFILE`] with `apparmor_parser`, writing its text to
/// `dir/minicri-default` first. Slow (the parser compiles the profile): call it off the async
/// workers, once at start.
pub fn load_default_profile(dir: &Path) -> Result<()> {
    let parser = ["/sbin/apparmor_parser", "/usr/sbin/apparmor_parser"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .ok_or_else(|| {
            OciError::Unsupported(
                "apparmor_parser is not installed (Debian's apparmor package)".into(),
            )
        })?;
    std::fs::create_dir_all(dir).map_err(|e| OciError::io("create", dir, e))?;
    let file = dir.join(DEFAULT_PROFILE);
    minicri_snapshotter::write_atomic(&file, DEFAULT_PROFILE_TEXT.as_bytes(), 0o600)
        .map_err(|e| OciError::io("write", &file, e))?;
    let out = std::process::Command::new(&parser)
        .arg("-Kr")
        .arg(&file)
        .output()
        .map_err(|e| OciError::io("run", &parser, e))?;
    if !out.status.success() {
        return Err(OciError::Other(format!(
            "{} -Kr {}: {}",
            parser.display(),
            file.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// The profile for a container's process (`process.apparmorProfile`), from the CRI's `apparmor`
/// field, else its deprecated `apparmor_profile` string; `loaded` answers whether a named
/// profile is loaded ([`loaded`] on a real host). The table in the module's documentation.
pub fn select_apparmor(
    profile: Option<&cri::SecurityProfile>,
    deprecated: &str,
    privileged: bool,
    host: AppArmorHost,
    loaded: impl Fn(&str) -> bool,
) -> Result<Option<String>> {
    enum Want {
        Unspecified,
        Default,
        Unconfined,
        Localhost(String),
    }
    use cri::security_profile::ProfileType;
    let want = match profile {
        Some(p) => match ProfileType::try_from(p.profile_type) {
            Ok(ProfileType::RuntimeDefault) => Want::Default,
            Ok(ProfileType::Unconfined) => Want::Unconfined,
            // The kubelet sends `localhost/NAME`, as in the deprecated string.
            Ok(ProfileType::Localhost) => Want::Localhost(
                p.localhost_ref
                    .strip_prefix("localhost/")
                    .unwrap_or(&p.localhost_ref)
                    .to_string(),
            ),
            Err(_) => {
                return Err(OciError::invalid(format!(
                    "unknown AppArmor profile type {}",
                    p.profile_type
                )));
            }
        },
        None => match deprecated {
            "" => Want::Unspecified,
            "runtime/default" => Want::Default,
            "unconfined" => Want::Unconfined,
            other => match other.strip_prefix("localhost/") {
                Some(name) => Want::Localhost(name.to_string()),
                None => {
                    return Err(OciError::invalid(format!(
                        "apparmor_profile {other:?}: expected runtime/default, unconfined or \
                         localhost/<profile>"
                    )));
                }
            },
        },
    };
    let default = || host.default_profile.then(|| DEFAULT_PROFILE.to_string());
    Ok(match want {
        Want::Unspecified if privileged => None,
        Want::Unspecified | Want::Default => default(),
        Want::Unconfined => None,
        Want::Localhost(name) => {
            if name.is_empty() || name.contains(['\0', '\n']) {
                return Err(OciError::invalid(format!(
                    "AppArmor localhost profile {name:?}: a profile name is required"
                )));
            }
            if !host.enabled {
                return Err(OciError::Unsupported(format!(
                    "AppArmor profile {name:?} requested, but AppArmor is not enabled on this host"
                )));
            }
            if !loaded(&name) {
                return Err(OciError::Unsupported(format!(
                    "AppArmor profile {name:?} is not loaded on this host (load it with \
                     apparmor_parser first)"
                )));
            }
            Some(name)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ON: AppArmorHost = AppArmorHost {
        enabled: true,
        default_profile: true,
    };
    const OFF: AppArmorHost = AppArmorHost {
        enabled: false,
        default_profile: false,
    };

    fn p(t: cri::security_profile::ProfileType, name: &str) -> cri::SecurityProfile {
        cri::SecurityProfile {
            profile_type: t as i32,
            localhost_ref: name.into(),
        }
    }

    fn only_k8s_loaded(n: &str) -> bool {
        n == "k8s-deny-write"
    }

    #[test]
    fn the_table() {
        use cri::security_profile::ProfileType::*;
        let sel = |prof: Option<&cri::SecurityProfile>, old: &str, privileged, host| {
            select_apparmor(prof, old, privileged, host, only_k8s_loaded)
        };
        let default = Some(DEFAULT_PROFILE.to_string());
        assert_eq!(sel(None, "", false, ON).unwrap(), default);
        assert_eq!(sel(None, "", true, ON).unwrap(), None);
        assert_eq!(sel(None, "", false, OFF).unwrap(), None);
        assert_eq!(
            sel(Some(&p(RuntimeDefault, "")), "", true, ON).unwrap(),
            default
        );
        assert_eq!(sel(None, "runtime/default", false, ON).unwrap(), default);
        assert_eq!(
            sel(Some(&p(RuntimeDefault, "")), "", false, OFF).unwrap(),
            None
        );
        assert_eq!(sel(Some(&p(Unconfined, "")), "", false, ON).unwrap(), None);
        assert_eq!(sel(None, "unconfined", false, ON).unwrap(), None);
        let k8s = Some("k8s-deny-write".to_string());
        assert_eq!(
            sel(Some(&p(Localhost, "k8s-deny-write")), "", true, ON).unwrap(),
            k8s
        );
        assert_eq!(
            sel(None, "localhost/k8s-deny-write", false, ON).unwrap(),
            k8s
        );
        // What the kubelet and critest send in the new field.
        assert_eq!(
            sel(
                Some(&p(Localhost, "localhost/k8s-deny-write")),
                "",
                false,
                ON
            )
            .unwrap(),
            k8s
        );
        // The new field wins over the deprecated string.
        assert_eq!(
            sel(
                Some(&p(Unconfined, "")),
                "localhost/k8s-deny-write",
                false,
                ON
            )
            .unwrap(),
            None
        );
        // Without the default profile loaded, the runtime default is no profile.
        let no_default = AppArmorHost {
            enabled: true,
            default_profile: false,
        };
        assert_eq!(sel(None, "", false, no_default).unwrap(), None);
    }

    #[test]
    fn localhost_profiles_must_be_loaded_and_apparmor_on() {
        use cri::security_profile::ProfileType::*;
        let e = select_apparmor(
            Some(&p(Localhost, "not-there")),
            "",
            false,
            ON,
            only_k8s_loaded,
        )
        .unwrap_err();
        assert!(matches!(e, OciError::Unsupported(_)), "{e:?}");
        assert!(e.to_string().contains("\"not-there\" is not loaded"), "{e}");
        let e = select_apparmor(
            None,
            "localhost/k8s-deny-write",
            false,
            OFF,
            only_k8s_loaded,
        )
        .unwrap_err();
        assert!(e.to_string().contains("not enabled on this host"), "{e}");
        for bad in [
            select_apparmor(Some(&p(Localhost, "")), "", false, ON, |_| true),
            select_apparmor(None, "localhost/", false, ON, |_| true),
            select_apparmor(None, "docker-default", false, ON, |_| true),
            select_apparmor(
                Some(&cri::SecurityProfile {
                    profile_type: 7,
                    localhost_ref: String::new(),
                }),
                "",
                false,
                ON,
                |_| true,
            ),
        ] {
            assert!(matches!(bad, Err(OciError::InvalidArgument(_))), "{bad:?}");
        }
    }

    #[test]
    fn the_kernel_profile_list() {
        let list = "k8s-deny-write (enforce)\nminicri-default (enforce)\n/usr/bin/man (complain)\n";
        assert!(profile_listed(list, "minicri-default"));
        assert!(profile_listed(list, "/usr/bin/man"));
        assert!(!profile_listed(list, "k8s"));
        assert!(!profile_listed("", "minicri-default"));
    }
}

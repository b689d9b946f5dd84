//! Resolving the container's user and groups from the CRI security context, the image's `User`
//! and the rootfs's `/etc/passwd` and `/etc/group`.
//!
//! Precedence (CRI `LinuxContainerSecurityContext`, Docker's `User` semantics):
//! 1. `run_as_user` (uid): the primary gid is the passwd entry's, or 0 when the uid has none;
//! 2. `run_as_username`: must exist in `/etc/passwd` (a number is taken as a uid);
//! 3. the image's `User`, `user[:group]`, each part a name or a number; names must resolve;
//! 4. otherwise root (0:0).
//!
//! `run_as_group` then replaces the primary gid (only allowed together with 1 or 2, as the CRI
//! validates). Additional gids (the process's supplementary group list, `setgroups(2)`) are the
//! primary gid, the groups of `/etc/group` listing the user by name (not when the image's `User`
//! names a group explicitly, nor with the `Strict` supplemental groups policy), and the CRI
//! `supplemental_groups`, without duplicates. The primary gid is in the list so that the
//! process keeps it when it changes its effective gid, and because that is the identity the
//! CRI's `LinuxContainerUser.supplemental_groups` reports (containerd and CRI-O do the same).
//!
//! The rootfs is untrusted: files are read through [`read_in_root`], which resolves symlinks as
//! if the rootfs were `/`, so an image cannot point `/etc/passwd` at a host file.

use std::path::{Component, Path, PathBuf};

use minicri_store::manifest::{MAX_ID, parse_id};

use crate::oci::error::{OciError, Result};

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ResolvedUser {
    pub uid: u32,
    pub gid: u32,
    pub additional_gids: Vec<u32>,
    /// The passwd name, when the uid has an entry.
    pub username: Option<String>,
    /// The passwd home directory, when known.
    pub home: Option<String>,
}

/// What the CRI asks for (all optional) and the image's `User`.
#[derive(Debug, Clone, Default)]
pub struct UserRequest<'a> {
    pub run_as_user: Option<i64>,
    pub run_as_username: &'a str,
    pub run_as_group: Option<i64>,
    pub supplemental_groups: &'a [i64],
    /// `SupplementalGroupsPolicy::Strict`: no groups from `/etc/group`.
    pub strict_groups: bool,
    pub image_user: &'a str,
}

struct Passwd {
    name: String,
    uid: u32,
    gid: u32,
    home: String,
}

struct Group {
    name: String,
    gid: u32,
    members: Vec<String>,
}

fn parse_passwd(text: &str) -> Vec<Passwd> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            if f.len() < 4 {
                return None;
            }
            Some(Passwd {
                name: f[0].to_string(),
                uid: parse_id(f[2])?,
                gid: parse_id(f[3])?,
                home: f.get(5).unwrap_or(&"").to_string(),
            })
        })
        .collect()
}

fn parse_group(text: &str) -> Vec<Group> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            if f.len() < 3 {
                return None;
            }
            let members = f.get(3).map(|m| {
                m.split(',')
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect()
            });
            Some(Group {
                name: f[0].to_string(),
                gid: parse_id(f[2])?,
                members: members.unwrap_or_default(),
            })
        })
        .collect()
}

/// Resolves `path` (absolute, as seen inside the container) against `root` without leaving it:
/// `..` stops at the root and absolute symlink targets restart at the root.
pub fn resolve_in_root(root: &Path, path: &Path) -> std::io::Result<PathBuf> {
    let mut pending: Vec<std::ffi::OsString> = path
        .components()
        .rev()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n.to_os_string()),
            Component::ParentDir => Some("..".into()),
            _ => None,
        })
        .collect();
    let mut resolved: Vec<std::ffi::OsString> = Vec::new();
    let mut hops = 0;
    while let Some(part) = pending.pop() {
        if part == ".." {
            resolved.pop();
            continue;
        }
        let mut candidate = root.to_path_buf();
        candidate.extend(&resolved);
        candidate.push(&part);
        match std::fs::symlink_metadata(&candidate) {
            Ok(m) if m.file_type().is_symlink() => {
                hops += 1;
                if hops > 40 {
                    return Err(std::io::Error::other("too many levels of symbolic links"));
                }
                let target = std::fs::read_link(&candidate)?;
                if target.is_absolute() {
                    resolved.clear();
                }
                for c in target.components().rev() {
                    match c {
                        Component::Normal(n) => pending.push(n.to_os_string()),
                        Component::ParentDir => pending.push("..".into()),
                        _ => {}
                    }
                }
            }
            _ => resolved.push(part),
        }
    }
    let mut out = root.to_path_buf();
    out.extend(&resolved);
    Ok(out)
}

/// The most of `/etc/passwd` or `/etc/group` read from an image (real ones are a few KiB).
pub const MAX_ACCOUNT_FILE: u64 = 4 << 20;

/// Reads a text file of the rootfs (see [`resolve_in_root`]); `None` when it does not exist.
///
/// The image is a stranger's: the file must be a regular file (a FIFO would block the read, a
/// device such as `/dev/zero` would never end) of at most [`MAX_ACCOUNT_FILE`] bytes. It is
/// opened without following a last symlink (the path is already resolved inside the rootfs)
/// and without blocking on open.
pub fn read_in_root(root: &Path, path: &str) -> Result<Option<String>> {
    use crate::fsutil::{ReadRegularError as E, read_regular};
    let p = resolve_in_root(root, Path::new(path)).map_err(|e| match e.kind() {
        // The image's own symlinks loop: the image is at fault, not the host.
        std::io::ErrorKind::Other => OciError::invalid(format!("the image's {path}: {e}")),
        _ => OciError::io("resolve", root.join(path.trim_start_matches('/')), e),
    })?;
    match read_regular(&p, MAX_ACCOUNT_FILE, false) {
        Ok(b) => Ok(Some(String::from_utf8_lossy(&b).into_owned())),
        Err(E::Missing) => Ok(None),
        Err(E::NotRegular) => Err(OciError::invalid(format!(
            "the image's {path} is not a regular file"
        ))),
        Err(E::TooBig(n)) => Err(OciError::invalid(format!(
            "the image's {path} is {n} bytes or more, more than the {MAX_ACCOUNT_FILE} read"
        ))),
        Err(E::Io(what, e)) => Err(OciError::io(what, p, e)),
    }
}

/// A uid or gid a request gives as an integer, 0 to [`MAX_ID`]; `what` names the field.
pub fn id_from_i64(v: i64, what: &str) -> Result<u32> {
    u32::try_from(v)
        .ok()
        .filter(|n| *n <= MAX_ID)
        .ok_or_else(|| OciError::invalid(format!("{what} {v} is out of range (0 to {MAX_ID})")))
}

/// Applies the rules of the module docs.
pub fn resolve_user(rootfs: &Path, req: &UserRequest<'_>) -> Result<ResolvedUser> {
    let passwd = parse_passwd(&read_in_root(rootfs, "/etc/passwd")?.unwrap_or_default());
    let groups = parse_group(&read_in_root(rootfs, "/etc/group")?.unwrap_or_default());
    let by_uid = |uid: u32| passwd.iter().find(|p| p.uid == uid);
    let by_name = |name: &str| passwd.iter().find(|p| p.name == name);

    if req.run_as_group.is_some() && req.run_as_user.is_none() && req.run_as_username.is_empty() {
        return Err(OciError::invalid(
            "run_as_group is set without run_as_user or run_as_username",
        ));
    }
    let mut explicit_group = false;
    let (uid, mut gid, entry) = if let Some(u) = req.run_as_user {
        let uid = id_from_i64(u, "run_as_user")?;
        let e = by_uid(uid);
        (uid, e.map_or(0, |e| e.gid), e)
    } else if !req.run_as_username.is_empty() {
        user_part(req.run_as_username, &by_uid, &by_name)?
    } else if !req.image_user.is_empty() {
        let (user, group) = match req.image_user.split_once(':') {
            Some((u, g)) => (u, Some(g)),
            None => (req.image_user, None),
        };
        let (uid, mut gid, e) = user_part(user, &by_uid, &by_name)?;
        if let Some(g) = group.filter(|g| !g.is_empty()) {
            explicit_group = true;
            gid = match parse_id(g) {
                Some(n) => n,
                None if looks_numeric(g) => {
                    return Err(OciError::invalid(format!(
                        "image user group {g:?} is not a gid (0 to {MAX_ID}) nor a name"
                    )));
                }
                None => groups
                    .iter()
                    .find(|x| x.name == g)
                    .map(|x| x.gid)
                    .ok_or_else(|| {
                        OciError::invalid(format!("image user group {g:?} not found in /etc/group"))
                    })?,
            };
        }
        (uid, gid, e)
    } else {
        (0, 0, by_uid(0))
    };
    if let Some(g) = req.run_as_group {
        gid = id_from_i64(g, "run_as_group")?;
    }

    let mut additional = vec![gid];
    if let Some(e) = entry.filter(|_| !explicit_group && !req.strict_groups) {
        additional.extend(
            groups
                .iter()
                .filter(|g| g.members.contains(&e.name))
                .map(|g| g.gid),
        );
    }
    for g in req.supplemental_groups {
        additional.push(id_from_i64(*g, "supplemental group")?);
    }
    let mut seen = std::collections::HashSet::new();
    additional.retain(|g| seen.insert(*g));
    Ok(ResolvedUser {
        uid,
        gid,
        additional_gids: additional,
        username: entry.map(|e| e.name.clone()),
        home: entry.map(|e| e.home.clone()).filter(|h| !h.is_empty()),
    })
}

type Lookup<'p> = (u32, u32, Option<&'p Passwd>);

/// Whether `s` is written as an integer (`-1`, `4294967296`), whatever its range.
fn looks_numeric(s: &str) -> bool {
    let digits = s.strip_prefix('-').unwrap_or(s);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
}

fn user_part<'p>(
    user: &str,
    by_uid: &dyn Fn(u32) -> Option<&'p Passwd>,
    by_name: &dyn Fn(&str) -> Option<&'p Passwd>,
) -> Result<Lookup<'p>> {
    if let Some(uid) = parse_id(user) {
        let e = by_uid(uid);
        return Ok((uid, e.map_or(0, |e| e.gid), e));
    }
    // A number out of range is not a name: the image's /etc/passwd could give it any uid, 0
    // included, while ImageStatus (which the kubelet's runAsNonRoot check reads) showed no uid.
    if looks_numeric(user) {
        return Err(OciError::invalid(format!(
            "user {user:?} is not a uid (0 to {MAX_ID}) nor a name"
        )));
    }
    let e = by_name(user)
        .ok_or_else(|| OciError::invalid(format!("user {user:?} not found in /etc/passwd")))?;
    Ok((e.uid, e.gid, Some(e)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rootfs() -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("etc")).unwrap();
        std::fs::write(
            d.path().join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\n# comment\nwww:x:33:33:www:/var/www:/bin/false\nbob:x:1000:1000::/home/bob:/bin/sh\nbad:line\n",
        )
        .unwrap();
        std::fs::write(
            d.path().join("etc/group"),
            "root:x:0:\nwww:x:33:\nbob:x:1000:\nvideo:x:44:bob,www\naudio:x:29:bob\nstaff:x:50:\n",
        )
        .unwrap();
        d
    }

    #[test]
    fn fifo_device_and_huge_account_files_are_refused_without_blocking() {
        let d = rootfs();
        let passwd = d.path().join("etc/passwd");
        // A FIFO nobody writes: opening or reading it would block forever.
        std::fs::remove_file(&passwd).unwrap();
        nix::unistd::mkfifo(&passwd, nix::sys::stat::Mode::from_bits_truncate(0o644)).unwrap();
        let t = std::time::Instant::now();
        let e = resolve_user(d.path(), &UserRequest::default()).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        assert!(t.elapsed() < std::time::Duration::from_secs(1));
        // A symlink to a device inside the rootfs: resolved inside it, then refused.
        std::fs::remove_file(&passwd).unwrap();
        std::fs::create_dir_all(d.path().join("dev")).unwrap();
        nix::sys::stat::mknod(
            &d.path().join("dev/zero"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o666),
            nix::sys::stat::makedev(1, 5),
        )
        .unwrap();
        std::os::unix::fs::symlink("/dev/zero", &passwd).unwrap();
        let e = resolve_user(d.path(), &UserRequest::default()).unwrap_err();
        assert!(e.to_string().contains("not a regular file"), "{e}");
        // Larger than the cap (sparse: no disk used).
        std::fs::remove_file(&passwd).unwrap();
        let f = std::fs::File::create(&passwd).unwrap();
        f.set_len(MAX_ACCOUNT_FILE + 1).unwrap();
        let e = resolve_user(d.path(), &UserRequest::default()).unwrap_err();
        assert!(e.to_string().contains("more than"), "{e}");
        // At the cap it is read.
        f.set_len(MAX_ACCOUNT_FILE).unwrap();
        resolve_user(d.path(), &UserRequest::default()).unwrap();
        // A symlink loop is the image's fault: an invalid argument naming the file.
        std::fs::remove_file(&passwd).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", &passwd).unwrap();
        let e = resolve_user(d.path(), &UserRequest::default()).unwrap_err();
        assert!(
            matches!(&e, OciError::InvalidArgument(m) if m.contains("/etc/passwd")),
            "{e:?}"
        );
    }

    /// A user or group written as a number out of range is refused, not looked up as a name:
    /// the image's own /etc/passwd could make it root while ImageStatus showed no uid.
    #[test]
    fn numbers_out_of_range_are_not_names() {
        let d = rootfs();
        std::fs::write(
            d.path().join("etc/passwd"),
            "4294967296:x:0:0::/root:/bin/sh\n-1:x:0:0::/root:/bin/sh\nbob:x:1000:1000::/home/bob:/bin/sh\n",
        )
        .unwrap();
        for user in [
            "4294967296",
            "4294967295",
            "-1",
            "bob:4294967296",
            "bob:4294967295",
            "bob:-1",
        ] {
            let req = UserRequest {
                image_user: user,
                ..Default::default()
            };
            let e = resolve_user(d.path(), &req).unwrap_err();
            assert!(
                matches!(&e, OciError::InvalidArgument(m) if m.contains("nor a name")),
                "{user}: {e:?}"
            );
        }
        let req = UserRequest {
            image_user: "4294967294",
            ..Default::default()
        };
        assert_eq!(resolve_user(d.path(), &req).unwrap().uid, MAX_ID);
        // Entries of the image's account files with ids out of range are no entries.
        std::fs::write(
            d.path().join("etc/passwd"),
            "app:x:4294967295:1000::/home/app:/bin/sh\nweb:x:1000:4294967295::/:/bin/sh\n",
        )
        .unwrap();
        std::fs::write(d.path().join("etc/group"), "grp:x:4294967295:\n").unwrap();
        for user in ["app", "web", "0:grp"] {
            let req = UserRequest {
                image_user: user,
                ..Default::default()
            };
            let e = resolve_user(d.path(), &req).unwrap_err();
            assert!(
                matches!(&e, OciError::InvalidArgument(m) if m.contains("not found")),
                "{user}: {e:?}"
            );
        }
    }

    fn r(req: UserRequest<'_>) -> Result<ResolvedUser> {
        let d = rootfs();
        resolve_user(d.path(), &req)
    }

    #[test]
    fn default_is_root() {
        let u = r(UserRequest::default()).unwrap();
        assert_eq!(
            (u.uid, u.gid, u.username.as_deref(), u.home.as_deref()),
            (0, 0, Some("root"), Some("/root"))
        );
        assert_eq!(u.additional_gids, [0]);
    }

    #[test]
    fn run_as_username_with_groups() {
        let u = r(UserRequest {
            run_as_username: "bob",
            supplemental_groups: &[50, 44],
            ..Default::default()
        })
        .unwrap();
        assert_eq!((u.uid, u.gid), (1000, 1000));
        assert_eq!(u.additional_gids, [1000, 44, 29, 50]);
        let strict = r(UserRequest {
            run_as_username: "bob",
            strict_groups: true,
            supplemental_groups: &[50],
            ..Default::default()
        })
        .unwrap();
        assert_eq!(strict.additional_gids, [1000, 50]);
        assert!(
            r(UserRequest {
                run_as_username: "nobody",
                ..Default::default()
            })
            .is_err()
        );
    }

    #[test]
    fn run_as_user_and_group() {
        let u = r(UserRequest {
            run_as_user: Some(33),
            run_as_group: Some(7),
            ..Default::default()
        })
        .unwrap();
        assert_eq!((u.uid, u.gid, u.username.as_deref()), (33, 7, Some("www")));
        assert_eq!(u.additional_gids, [7, 44]);
        let unknown = r(UserRequest {
            run_as_user: Some(4242),
            image_user: "bob",
            ..Default::default()
        })
        .unwrap();
        assert_eq!(
            (unknown.uid, unknown.gid, unknown.username),
            (4242, 0, None)
        );
        assert!(
            r(UserRequest {
                run_as_group: Some(1),
                ..Default::default()
            })
            .is_err()
        );
        for id in [-1, 4294967295, 4294967296] {
            assert!(
                r(UserRequest {
                    run_as_user: Some(id),
                    ..Default::default()
                })
                .is_err(),
                "{id}"
            );
        }
    }

    #[test]
    fn image_user_forms() {
        let u = r(UserRequest {
            image_user: "www",
            ..Default::default()
        })
        .unwrap();
        assert_eq!(
            (u.uid, u.gid, u.additional_gids.clone()),
            (33, 33, vec![33, 44])
        );
        let u = r(UserRequest {
            image_user: "bob:staff",
            ..Default::default()
        })
        .unwrap();
        assert_eq!((u.uid, u.gid), (1000, 50));
        assert_eq!(
            u.additional_gids,
            [50],
            "an explicit group replaces /etc/group membership"
        );
        let u = r(UserRequest {
            image_user: "1234:5678",
            ..Default::default()
        })
        .unwrap();
        assert_eq!((u.uid, u.gid), (1234, 5678));
        assert!(
            r(UserRequest {
                image_user: "ghost",
                ..Default::default()
            })
            .is_err()
        );
        assert!(
            r(UserRequest {
                image_user: "bob:ghosts",
                ..Default::default()
            })
            .is_err()
        );
    }

    #[test]
    fn symlinks_stay_inside_the_rootfs() {
        let d = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("passwd"), "evil:x:0:0::/:/bin/sh\n").unwrap();
        std::fs::create_dir_all(d.path().join("etc")).unwrap();
        std::fs::create_dir_all(d.path().join("real")).unwrap();
        std::fs::write(d.path().join("real/passwd"), "alice:x:7:7::/:/bin/sh\n").unwrap();
        // Absolute target: resolved inside the rootfs.
        std::os::unix::fs::symlink("/real/passwd", d.path().join("etc/passwd")).unwrap();
        let u = resolve_user(
            d.path(),
            &UserRequest {
                image_user: "alice",
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(u.uid, 7);
        // `..` past the root stays at the root.
        let escape = format!("../../../../..{}", outside.path().join("passwd").display());
        std::os::unix::fs::symlink(escape, d.path().join("etc/group")).unwrap();
        assert_eq!(read_in_root(d.path(), "/etc/group").unwrap(), None);
    }
}

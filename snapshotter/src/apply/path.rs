//! Turning a tar entry's path into a place inside the snapshot, safely.
//!
//! Rules (what makes an entry "land outside the snapshot"):
//! - entry paths and hardlink targets are relative: an absolute path (other than `/`, the root
//!   itself) or any `..` component is refused;
//! - the directories above an entry may be symlinks (in this layer or a lower one) only when the link
//!   is relative and stays inside the snapshot; a symlink to an absolute path or one that climbs above
//!   the root makes the entry unsafe. Layer producers write entries at real paths, so a well-formed
//!   layer never passes through a symlink at all;
//! - the last component is never followed: an entry replaces a symlink, it does not write through it.
//!
//! Invariant: a path [`Resolver::resolve_dir`] returns consists of real directories of the view (or
//! components that do not exist yet and will be created as directories), so the kernel follows no
//! symlink when the applier later uses it.

use std::collections::{HashMap, VecDeque};
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use super::target::{NodeType, PathError, Target};

/// The cleaned relative form of an entry path: no leading `./`, no `.` or empty components.
/// The empty path is the snapshot root.
pub(crate) fn normalize(raw: &[u8]) -> Result<PathBuf, PathError> {
    // An entry naming the root itself ("/", as some image builders write it) is the snapshot root;
    // every other absolute path is refused.
    let names_root = raw.split(|b| *b == b'/').all(|c| c.is_empty() || c == b".");
    if raw.first() == Some(&b'/') && !names_root {
        return Err(PathError::Unsafe("absolute path".into()));
    }
    let mut out = PathBuf::new();
    for comp in raw.split(|b| *b == b'/') {
        match comp {
            b"" | b"." => {}
            b".." => return Err(PathError::Unsafe("path contains a `..` component".into())),
            c => out.push(OsStr::from_bytes(c)),
        }
    }
    Ok(out)
}

/// Hop limit for symlink chains, as the kernel's MAXSYMLINKS.
const MAX_HOPS: usize = 40;

/// Bytes of paths the resolver's cache may hold before it starts over: every prefix of a deep path
/// is cached, so a layer of deep paths would otherwise make it grow with the square of their depth.
const MAX_CACHE_BYTES: usize = 16 << 20;

/// Resolves entry directories against the view, caching results while the tree's shape is stable.
#[derive(Default)]
pub(crate) struct Resolver {
    cache: HashMap<PathBuf, PathBuf>,
    /// Path bytes held by `cache`, keys and values.
    cache_bytes: usize,
}

impl Resolver {
    /// Forget cached resolutions; called whenever an entry may have changed which paths are
    /// directories or symlinks (removals, whiteouts, new symlinks).
    pub(crate) fn invalidate(&mut self) {
        self.cache.clear();
        self.cache_bytes = 0;
    }

    /// Where the directory `dir` (a normalized entry directory) really is in the view.
    ///
    /// Resolves from the nearest cached ancestor (or the root) down, one component at a time, in a
    /// loop: a path's depth is bounded by the reader's path length cap, not by this thread's stack.
    pub(crate) fn resolve_dir(&mut self, t: &dyn Target, dir: &Path) -> Result<PathBuf, PathError> {
        let mut pending = Vec::new();
        let mut base = PathBuf::new();
        for a in dir.ancestors() {
            if a.as_os_str().is_empty() {
                break;
            }
            if let Some(r) = self.cache.get(a) {
                base = r.clone();
                break;
            }
            pending.push(a);
        }
        for a in pending.into_iter().rev() {
            let name = a.file_name().expect("normalized paths end in a name");
            base = follow(t, base, name, a)?;
            let bytes = a.as_os_str().len() + base.as_os_str().len();
            if self.cache_bytes + bytes > MAX_CACHE_BYTES {
                self.invalidate();
            }
            self.cache_bytes += bytes;
            self.cache.insert(a.to_path_buf(), base.clone());
        }
        Ok(base)
    }
}

/// Resolves `name` inside the real directory `cur`, following symlinks under the rules above.
fn follow(
    t: &dyn Target,
    mut cur: PathBuf,
    name: &OsStr,
    shown: &Path,
) -> Result<PathBuf, PathError> {
    let mut queue: VecDeque<OsString> = VecDeque::from([name.to_os_string()]);
    let mut hops = 0;
    let mut missing = false;
    while let Some(c) = queue.pop_front() {
        match c.as_bytes() {
            b"" | b"." => continue,
            b".." => {
                if missing {
                    return Err(PathError::Invalid(format!(
                        "symlink target under {} climbs out of a missing directory",
                        shown.display()
                    )));
                }
                if !cur.pop() {
                    return Err(PathError::Unsafe(format!(
                        "{} passes through a symlink that points above the snapshot root",
                        shown.display()
                    )));
                }
                continue;
            }
            _ => {}
        }
        let cand = cur.join(&c);
        if missing {
            cur = cand;
            continue;
        }
        match t.node(&cand)? {
            None => {
                missing = true;
                cur = cand;
            }
            Some(NodeType::Dir) => cur = cand,
            Some(NodeType::Other) => {
                return Err(PathError::Invalid(format!(
                    "{} is not a directory",
                    cand.display()
                )));
            }
            Some(NodeType::Symlink) => {
                hops += 1;
                if hops > MAX_HOPS {
                    return Err(PathError::Invalid(format!(
                        "too many levels of symlinks at {}",
                        cand.display()
                    )));
                }
                let target = t.read_link(&cand)?;
                if target.is_absolute() {
                    return Err(PathError::Unsafe(format!(
                        "{} is a symlink to the absolute path {}",
                        cand.display(),
                        target.display()
                    )));
                }
                let comps: Vec<OsString> = target
                    .as_os_str()
                    .as_bytes()
                    .split(|b| *b == b'/')
                    .map(|s| OsString::from_vec(s.to_vec()))
                    .collect();
                for comp in comps.into_iter().rev() {
                    queue.push_front(comp);
                }
            }
        }
    }
    Ok(cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalize_cleans_and_refuses() {
        assert_eq!(normalize(b"./a//b/./c").unwrap(), PathBuf::from("a/b/c"));
        assert_eq!(normalize(b"./").unwrap(), PathBuf::new());
        assert_eq!(
            normalize(b"/").unwrap(),
            PathBuf::new(),
            "the root entry some builders write"
        );
        assert_eq!(normalize(b"/./").unwrap(), PathBuf::new());
        assert!(matches!(normalize(b"/.."), Err(PathError::Unsafe(_))));
        assert!(matches!(
            normalize(b"/etc/passwd"),
            Err(PathError::Unsafe(_))
        ));
        assert!(matches!(normalize(b"a/../../b"), Err(PathError::Unsafe(_))));
        assert!(matches!(normalize(b".."), Err(PathError::Unsafe(_))));
    }
}

//! Each crate's files import one another one way only. A loop (two files each needing the
//! other's items, or a longer circle) makes every file in it a dependency of the others, so none
//! can be read, tested or moved alone; the layering docs/architecture.md states holds only while
//! there is none. This test reads the source files of every crate of the workspace and fails on
//! an import loop, naming it.
//!
//! What counts as an import of file A by file B: a path in B's code (a `use` line or a
//! path-qualified name anywhere, test modules included; comments do not count) through
//! `crate::`, `super::` or `self::` that names A's module or an item in it; an item re-exported
//! by a parent (`pub use store::ContainerRecord;` in `pods/mod.rs`) counts as the file that
//! defines it; and a path through a module a `use` line named (`channels::open` after
//! `use super::channels;`). A file's own ancestors are not imports: a parent module declares and
//! wires its children, which may use what it holds.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module path (`pods::store`; the crate root is `""`) to the file's code without comments.
type Modules = BTreeMap<String, String>;
type Graph = BTreeMap<String, BTreeSet<String>>;

/// The workspace's root (tests/ is one of its members).
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// The library crate under `src`: every `.rs` file but the binaries (`main.rs` beside a
/// `lib.rs`, `src/bin/`), which are crates of their own.
fn read_crate(src: &Path) -> Modules {
    fn walk(root: &Path, dir: &Path, out: &mut Modules) {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
            .map(|e| e.expect("a directory entry").path())
            .collect();
        entries.sort();
        for path in entries {
            let rel = path.strip_prefix(root).unwrap();
            if path.is_dir() {
                if rel != Path::new("bin") {
                    walk(root, &path, out);
                }
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") || rel == Path::new("main.rs") {
                continue;
            }
            let mut segs: Vec<String> = rel
                .with_extension("")
                .iter()
                .map(|s| s.to_string_lossy().into_owned())
                .collect();
            if matches!(segs.last().map(String::as_str), Some("mod" | "lib")) {
                segs.pop();
            }
            let code = std::fs::read_to_string(&path).expect("a source file");
            out.insert(segs.join("::"), without_comments(&code));
        }
    }
    let mut out = Modules::new();
    walk(src, src, &mut out);
    out
}

/// `code` without its `//` comments (doc comments included). A `//` right after `:` is a URL
/// in a string, not a comment.
fn without_comments(code: &str) -> String {
    code.lines()
        .map(|l| {
            let cut = l
                .match_indices("//")
                .find(|&(i, _)| !l[..i].ends_with(':'))
                .map_or(l.len(), |(i, _)| i);
            &l[..cut]
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_word(c: char) -> bool {
    c.is_alphanumeric() || c == '_' || c == ':'
}

/// The paths at the start of `s` (`a::b`, or `a::{b, c::{d, e}}` expanded), as lists of
/// segments; `x as y` keeps `x`.
fn paths_at(s: &str) -> Vec<Vec<String>> {
    let head_len = s.find(|c: char| !is_word(c)).unwrap_or(s.len());
    let head: Vec<String> = s[..head_len]
        .split("::")
        .filter(|p| !p.is_empty())
        .map(str::to_string)
        .collect();
    if !s[head_len..].starts_with('{') {
        return vec![head];
    }
    let mut items = Vec::new();
    let (mut depth, mut item) = (0, String::new());
    for c in s[head_len + 1..].chars() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(std::mem::take(&mut item));
                continue;
            }
            _ => {}
        }
        item.push(c);
    }
    items.push(item);
    items
        .iter()
        .map(|i| i.trim())
        .filter(|i| !i.is_empty())
        .flat_map(|i| {
            paths_at(i).into_iter().map(|tail| {
                let mut p = head.clone();
                p.extend(tail);
                p
            })
        })
        .collect()
}

/// Where each occurrence of `needle` (not inside a longer path or word) ends.
fn occurrences<'a>(code: &'a str, needle: &str) -> Vec<&'a str> {
    code.match_indices(needle)
        .filter(|&(i, _)| !code[..i].chars().next_back().is_some_and(is_word))
        .map(|(i, _)| &code[i + needle.len()..])
        .collect()
}

/// A crate's modules and what their `pub use` lines re-export: module to (name to the module
/// that defines it).
struct Crate {
    modules: Modules,
    reexports: BTreeMap<String, BTreeMap<String, String>>,
}

impl Crate {
    fn new(modules: Modules) -> Crate {
        let mut c = Crate {
            modules,
            reexports: BTreeMap::new(),
        };
        let mut reexports = BTreeMap::new();
        for (module, code) in &c.modules {
            let own = segments(module);
            for vis in ["pub use ", "pub(crate) use ", "pub(super) use "] {
                for rest in occurrences(code, vis) {
                    for segs in paths_at(rest) {
                        let Some((base, segs)) = c.start(&own, &segs) else {
                            continue;
                        };
                        let Some(name) = segs.last() else { continue };
                        let target = c.resolve_plain(&base, &segs).join("::");
                        if target != *module && c.modules.contains_key(&target) {
                            reexports
                                .entry(module.clone())
                                .or_insert_with(BTreeMap::new)
                                .insert(name.clone(), target);
                        }
                    }
                }
            }
        }
        c.reexports = reexports;
        c
    }

    /// Where a path written in module `own` starts (`crate::`, `super::`, `self::`, or a child
    /// module's name), and its segments after that.
    fn start(&self, own: &[String], segs: &[String]) -> Option<(Vec<String>, Vec<String>)> {
        let mut base = own.to_vec();
        let mut rest = segs;
        match rest.first().map(String::as_str) {
            Some("crate") => {
                base.clear();
                rest = &rest[1..];
            }
            Some("super" | "self") => {
                while let Some(s) = rest.first().map(String::as_str) {
                    match s {
                        "super" => base.pop(),
                        "self" => None,
                        _ => break,
                    };
                    rest = &rest[1..];
                }
            }
            Some(child) if self.modules.contains_key(&join(own, child)) => {}
            _ => return None,
        }
        Some((base, rest.to_vec()))
    }

    /// The longest module path `base` + `segs` names.
    fn resolve_plain(&self, base: &[String], segs: &[String]) -> Vec<String> {
        let mut path = base.to_vec();
        for seg in segs {
            let next = join(&path, seg);
            if !self.modules.contains_key(&next) {
                break;
            }
            path.push(seg.clone());
        }
        path
    }

    /// The module `base` + `segs` names, through re-exports to the file that defines the item.
    fn resolve(&self, base: &[String], segs: &[String]) -> String {
        let mut path = self.resolve_plain(base, segs).join("::");
        let depth = self.resolve_plain(base, segs).len() - base.len();
        if let Some(name) = segs.get(depth) {
            for _ in 0..8 {
                match self.reexports.get(&path).and_then(|r| r.get(name)) {
                    Some(defined) if *defined != path => path = defined.clone(),
                    _ => break,
                }
            }
        }
        path
    }

    /// The modules `module` imports, as this file's comment says.
    fn imports(&self, module: &str) -> BTreeSet<String> {
        let code = &self.modules[module];
        let own = segments(module);
        let mut found = BTreeSet::new();
        let mut aliases: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for needle in ["crate::", "super::", "self::"] {
            for rest in occurrences(code, needle) {
                let written = format!("{needle}{rest}");
                for segs in paths_at(&written) {
                    let Some((base, segs)) = self.start(&own, &segs) else {
                        continue;
                    };
                    let path = self.resolve_plain(&base, &segs);
                    let last = segs.last().map(String::as_str);
                    if path.len() > base.len()
                        && (last == path.last().map(String::as_str) || last == Some("self"))
                    {
                        aliases.insert(path.last().unwrap().clone(), path.clone());
                    }
                    found.insert(self.resolve(&base, &segs));
                }
            }
        }
        for (alias, path) in &aliases {
            for rest in occurrences(code, &format!("{alias}::")) {
                for segs in paths_at(rest) {
                    found.insert(self.resolve(path, &segs));
                }
            }
        }
        found
            .into_iter()
            .filter(|t| t != module && !is_ancestor(t, module))
            .collect()
    }

    fn graph(&self) -> Graph {
        self.modules
            .keys()
            .map(|m| (m.clone(), self.imports(m)))
            .collect()
    }
}

fn segments(module: &str) -> Vec<String> {
    module
        .split("::")
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

fn join(path: &[String], seg: &str) -> String {
    if path.is_empty() {
        seg.to_string()
    } else {
        format!("{}::{seg}", path.join("::"))
    }
}

/// Whether `a` is `b`'s parent, grandparent, ... (the crate root is everyone's).
fn is_ancestor(a: &str, b: &str) -> bool {
    a.is_empty() || b.starts_with(&format!("{a}::"))
}

/// One import loop, as the modules around it (the first repeated at the end), if there is any.
fn find_loop(g: &Graph) -> Option<Vec<String>> {
    fn visit(g: &Graph, m: &str, path: &mut Vec<String>, done: &mut BTreeSet<String>) -> bool {
        if let Some(i) = path.iter().position(|p| p == m) {
            path.drain(..i);
            path.push(m.to_string());
            return true;
        }
        if done.contains(m) {
            return false;
        }
        path.push(m.to_string());
        for next in g.get(m).into_iter().flatten() {
            if visit(g, next, path, done) {
                return true;
            }
        }
        path.pop();
        done.insert(m.to_string());
        false
    }
    let mut done = BTreeSet::new();
    g.keys().find_map(|m| {
        let mut path = Vec::new();
        visit(g, m, &mut path, &mut done).then_some(path)
    })
}

fn shown(module: &str) -> &str {
    if module.is_empty() { "(root)" } else { module }
}

#[test]
fn every_crates_files_import_one_another_one_way() {
    // Each crate with an edge its reading must see, or it sees nothing.
    let crates = [
        ("runtime", ("cri::image", "daemon")),
        ("store", ("pull::procedure", "blobs")),
        ("snapshotter", ("tree", "fsutil")),
        ("codecs", ("spdy::conn", "spdy::flow")),
        ("proto", ("", "")),
        ("tests", ("remotecommand", "upgrade")),
    ];
    let mut loops = Vec::new();
    for (dir, (from, to)) in crates {
        let c = Crate::new(read_crate(&workspace().join(dir).join("src")));
        let g = c.graph();
        if !from.is_empty() {
            assert!(
                g.get(from).is_some_and(|i| i.contains(to)),
                "{dir}: the reading does not see {from} import {to}: {:?}",
                g.get(from)
            );
        }
        if let Some(cycle) = find_loop(&g) {
            let shown: Vec<&str> = cycle.iter().map(|m| shown(m)).collect();
            loops.push(format!("{dir}/src: {}", shown.join(" -> ")));
        }
    }
    assert!(loops.is_empty(), "import loops:\n{}", loops.join("\n"));
}

/// Loops this reading must find, in the shapes the workspace once had.
#[test]
fn import_loops_are_found() {
    let modules = |files: &[(&str, &str)]| -> Crate {
        Crate::new(
            files
                .iter()
                .map(|(m, c)| (m.to_string(), without_comments(c)))
                .collect(),
        )
    };
    // Through a parent's re-export: checkpoint.rs needing container.rs's helper while
    // container.rs calls into checkpoint.rs.
    let pods = [
        ("", "pub mod pods;"),
        (
            "pods",
            "mod container; mod checkpoint;\npub use container::not_found;",
        ),
        (
            "pods::container",
            "fn f() { super::checkpoint::restore(); }",
        ),
        ("pods::checkpoint", "use super::not_found;"),
    ];
    let g = modules(&pods).graph();
    assert_eq!(
        g["pods::checkpoint"],
        BTreeSet::from(["pods::container".to_string()]),
        "{g:?}"
    );
    assert!(find_loop(&g).is_some());
    // Path-qualified names in code, through a crate-level path, and a module named by a use line.
    let layers = [
        (
            "config",
            "pub struct Config { n: usize }\nconst N: usize = crate::pods::LIMIT;",
        ),
        (
            "pods",
            "use crate::{config::Config, stream};\nfn f() { stream::ws::open(); }",
        ),
        ("stream", "pub mod ws;"),
        ("stream::ws", "pub fn open() {}"),
    ];
    let g = modules(&layers).graph();
    assert!(g["pods"].contains("stream::ws"), "{g:?}");
    let cycle = find_loop(&g).expect("config <-> pods");
    assert_eq!(cycle.first(), cycle.last());
    // Comments, strings' URLs and a child's use of its parent are not imports.
    let fine = [
        (
            "config",
            "// crate::pods::LIMIT\n/// [`crate::pods`]\nconst U: &str = \"http://x\";",
        ),
        ("pods", "use crate::config::Config;\nmod store;"),
        ("pods::store", "use super::Pods;\nuse crate::pods::Limit;"),
    ];
    let g = modules(&fine).graph();
    assert_eq!(g["config"], BTreeSet::new(), "{g:?}");
    assert_eq!(find_loop(&g), None, "{g:?}");
}

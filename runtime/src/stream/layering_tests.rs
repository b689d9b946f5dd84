//! The streaming modules import one another one way only: a loop (exec and attach importing
//! each other, session and `ws::channels` each needing the other's types) makes every module
//! in it a dependency of the others, so none can be read, tested or moved alone. The shared
//! types live in leaves (`backend`, `remotecommand`); `session` builds a session's channels from
//! the transports below it. This test reads the module files and fails on an import loop.
//!
//! What counts as an import: paths through `super::` and `crate::stream::` in code outside test
//! modules (comments and doc links do not count), and paths through a module such a path
//! imported by name (`ws::channels::open` after `use super::ws;`). The parent module
//! (`stream/mod.rs`, the server that wires the others) is left out: its children may use it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

type Graph = BTreeMap<String, BTreeSet<String>>;

/// The non-test module files under `dir`, by module path (`stream::ws::conn`), with their code.
fn read_modules(dir: &Path, prefix: &str, out: &mut BTreeMap<String, String>) {
    for entry in std::fs::read_dir(dir).expect("the stream module's directory") {
        let path = entry.expect("a directory entry").path();
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        if path.is_dir() {
            read_modules(&path, &format!("{prefix}::{name}"), out);
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs")
            || name == "tests"
            || name == "testing"
            || name.ends_with("_tests")
        {
            continue;
        }
        let module = if name == "mod" {
            prefix.to_string()
        } else {
            format!("{prefix}::{name}")
        };
        out.insert(
            module,
            std::fs::read_to_string(&path).expect("a module file"),
        );
    }
}

/// `code` without its inline test module (at the end, by convention) and its comments.
fn production_code(code: &str) -> String {
    let end = code
        .match_indices("#[cfg(test)]")
        .map(|(i, _)| i)
        .find(|&i| {
            let rest = code[i + "#[cfg(test)]".len()..].trim_start();
            let rest = rest.strip_prefix("pub(crate) ").unwrap_or(rest);
            rest.strip_prefix("mod ").is_some_and(|r| {
                let r = r.trim_start_matches(|c: char| c.is_alphanumeric() || c == '_');
                r.trim_start().starts_with('{')
            })
        })
        .unwrap_or(code.len());
    code[..end]
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_word(c: char) -> bool {
    c.is_alphanumeric() || c == '_' || c == ':'
}

/// The path at the start of `s` (`a::b`, or `a::{b, c::d}` expanded), as lists of segments.
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
        .map(|i| {
            let tail = i.trim().split("::").map(|p| p.trim().to_string());
            head.iter().cloned().chain(tail).collect()
        })
        .collect()
}

/// Where each occurrence of `needle` (not inside a longer path) starts its path.
fn occurrences<'a>(code: &'a str, needle: &str) -> Vec<&'a str> {
    code.match_indices(needle)
        .filter(|&(i, _)| !code[..i].chars().next_back().is_some_and(is_word))
        .map(|(i, _)| &code[i + needle.len()..])
        .collect()
}

/// The modules `module` imports, as described in this file's comment.
fn imports(module: &str, code: &str, modules: &BTreeMap<String, String>) -> BTreeSet<String> {
    let code = production_code(code);
    let own: Vec<&str> = module.split("::").collect();
    // The longest module path `base` + `segs` names.
    let resolve = |base: &[&str], segs: &[String]| -> Vec<String> {
        let mut path: Vec<String> = base.iter().map(|s| s.to_string()).collect();
        for seg in segs {
            let next = format!("{}::{seg}", path.join("::"));
            if !modules.contains_key(&next) {
                break;
            }
            path.push(seg.clone());
        }
        path
    };
    let mut found = BTreeSet::new();
    let mut aliases: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut starts: Vec<(Vec<&str>, &str)> = occurrences(&code, "crate::stream::")
        .into_iter()
        .map(|rest| (vec!["stream"], rest))
        .collect();
    for mut rest in occurrences(&code, "super::") {
        let mut up = 1;
        while let Some(r) = rest.strip_prefix("super::") {
            (up, rest) = (up + 1, r);
        }
        starts.push((own[..own.len().saturating_sub(up)].to_vec(), rest));
    }
    for (base, rest) in starts {
        for segs in paths_at(rest) {
            let path = resolve(&base, &segs);
            let last = segs.last().map(String::as_str);
            if path.len() > base.len()
                && (last == path.last().map(String::as_str) || last == Some("self"))
            {
                aliases.insert(path.last().unwrap().clone(), path.clone());
            }
            found.insert(path.join("::"));
        }
    }
    for (alias, path) in &aliases {
        let base: Vec<&str> = path.iter().map(String::as_str).collect();
        for rest in occurrences(&code, &format!("{alias}::")) {
            for segs in paths_at(rest) {
                found.insert(resolve(&base, &segs).join("::"));
            }
        }
    }
    // A module's own items and its ancestors' (the parent wires its children) are not edges.
    found
        .into_iter()
        .filter(|t| t != module && !module.starts_with(&format!("{t}::")))
        .collect()
}

fn graph(modules: &BTreeMap<String, String>) -> Graph {
    modules
        .iter()
        .map(|(m, code)| (m.clone(), imports(m, code, modules)))
        .collect()
}

/// One import loop, as the modules around it, if there is any.
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

#[test]
fn the_streaming_modules_import_one_another_one_way() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/stream");
    let mut modules = BTreeMap::new();
    read_modules(&dir, "stream", &mut modules);
    assert!(modules.contains_key("stream::ws::channels"), "{modules:?}");
    let g = graph(&modules);
    // The edges this file's reading must see, or it sees nothing.
    assert!(g["stream::exec"].contains("stream::session"), "{g:?}");
    assert!(
        g["stream::session"].contains("stream::ws::channels"),
        "{g:?}"
    );
    if let Some(cycle) = find_loop(&g) {
        panic!("an import loop: {}", cycle.join(" -> "));
    }
}

/// The shapes the streaming modules had before they were untangled are found.
#[test]
fn import_loops_are_found() {
    let modules = |files: &[(&str, &str)]| -> BTreeMap<String, String> {
        files
            .iter()
            .map(|(m, c)| (m.to_string(), c.to_string()))
            .collect()
    };
    let old = modules(&[
        ("stream", "pub mod ws;"),
        (
            "stream::exec",
            "use super::session::{self, Channels};\nfn f() -> super::attach::Attached {}",
        ),
        ("stream::attach", "use super::exec::{BoxRead, ExecBackend};"),
        (
            "stream::session",
            "use super::ws;\nenum Output { Ws(ws::channels::ChannelWriter) }",
        ),
        ("stream::ws", "pub mod channels;"),
        (
            "stream::ws::channels",
            "use super::conn;\nuse crate::stream::session::{Channels, Link};\n#[cfg(test)]\nmod tests {\n use crate::stream::exec;\n}",
        ),
    ]);
    let g = graph(&old);
    assert_eq!(
        g["stream::ws::channels"],
        BTreeSet::from(["stream::session".to_string()]),
        "test modules and unknown paths are not imports"
    );
    assert!(
        g["stream::session"].contains("stream::ws::channels"),
        "{g:?}"
    );
    let cycle = find_loop(&g).expect("the old loops");
    assert_eq!(cycle.first(), cycle.last());
    let mut untangled = old.clone();
    untangled.insert(
        "stream::attach".into(),
        "use super::backend::BoxRead;".into(),
    );
    untangled.insert("stream::exec".into(), "use super::session;".into());
    untangled.insert(
        "stream::ws::channels".into(),
        "// crate::stream::session\n".into(),
    );
    assert_eq!(find_loop(&graph(&untangled)), None);
}

//! The documentation and the messages held to the parser: every TOML snippet of the docs passes
//! `minicri config check`, and no doc or message names a key the parser refuses.
//!
//! The docs are README.md, docs/*.md and the `*.md` of each crate's directory. Their
//! ```` ```toml ```` blocks are minicri configuration files and are checked as such; a block that
//! is not one (a `hosts.toml`, an example of a refused file) says so in its fence,
//! ```` ```toml ignore ```` (a space, not a comma, so that GitHub still highlights it as TOML).
//!
//! A setting is named by its section key, `pull.detach_after`. The old names are those the parser
//! refuses at the top level ([`super::new_key_of`]): the flat keys of before sections
//! (`pull_detach_after`, `registry_config_dir`, `max_layer_bytes`, ...). In the docs, and in the
//! string literals of non-test code of runtime/, store/, snapshotter/ and codecs/ (the messages),
//! a key is refused unless:
//! - it is written `section.key`;
//! - it is a key of the section a Markdown heading above it names (`### [pull]`): a table of one
//!   section's keys under its heading;
//! - it is part of a path (`kube_watch/hold.rs`, `minicri::kube_watch`) or a field of something
//!   other than a section (`config.detach_after`);
//! - it stands alone in a string literal (`"max_layer_bytes"` is a name in code, not a message);
//! - it is in a paragraph after a `<!-- keys-check: skip (why) -->` line: the migration notes
//!   that list the old names on purpose, or another program's settings (containerd's
//!   `max_concurrent_downloads`).
//!
//! Old names without `_` (`socket`, `snapshotter`, `runtimes`) are words of prose too; they count
//! only as a table header of the flat file (`[runtimes.NAME]`). Doc comments (`///`, `//!`) name
//! struct fields and parameters by the same words as the settings, so there only the flat names
//! that are no section's key (`pull_detach_after`, `stream_address`) count.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use super::{check_file, new_key_of, sections};

/// The workspace's root (runtime/ is one of its members).
fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("runtime/ has a parent")
        .to_path_buf()
}

/// The workspace's documentation: README.md, docs/*.md and each crate's own `*.md`.
fn doc_files() -> Vec<PathBuf> {
    let root = workspace();
    let mut files = vec![root.join("README.md")];
    for dir in [
        "docs",
        "proto",
        "codecs",
        "store",
        "snapshotter",
        "runtime",
        "tests",
    ] {
        let mut md: Vec<PathBuf> = std::fs::read_dir(root.join(dir))
            .unwrap_or_else(|e| panic!("reading {dir}/: {e}"))
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "md"))
            .collect();
        md.sort();
        files.extend(md);
    }
    files
}

/// `path` relative to the workspace, for messages.
fn shown(path: &Path) -> String {
    path.strip_prefix(workspace())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// A ```` ```toml ```` block: the line of its first line of text, its text, and whether its fence
/// says `ignore`.
struct TomlBlock {
    line: usize,
    text: String,
    ignored: bool,
}

/// A Markdown line outside fenced blocks, or a line of a fenced block that is not TOML.
struct DocLine<'a> {
    number: usize,
    text: &'a str,
    /// The sections (`[pull]`) the heading above it names.
    under: Vec<String>,
    /// In a paragraph after a `<!-- keys-check: skip -->` line.
    skipped: bool,
}

/// The TOML blocks of a Markdown text, and its other lines; `sections`: the sections' names.
fn split_markdown<'a>(text: &'a str, sections: &[String]) -> (Vec<TomlBlock>, Vec<DocLine<'a>>) {
    let mut blocks = Vec::new();
    let mut lines = Vec::new();
    // In a fenced block: whether it is TOML (then the block being read).
    let mut fence: Option<Option<TomlBlock>> = None;
    let mut under = Vec::new();
    let mut skipped = false;
    for (i, line) in text.lines().enumerate() {
        let number = i + 1;
        let trimmed = line.trim();
        if let Some(open) = &mut fence {
            if trimmed.starts_with("```") {
                if let Some(block) = fence.take().flatten() {
                    blocks.push(block);
                }
            } else if let Some(block) = open {
                block.text.push_str(line);
                block.text.push('\n');
            } else {
                lines.push(DocLine {
                    number,
                    text: line,
                    under: under.clone(),
                    skipped,
                });
            }
            continue;
        }
        if let Some(info) = trimmed.strip_prefix("```") {
            let mut words = info.split_whitespace();
            fence = Some((words.next() == Some("toml")).then(|| TomlBlock {
                line: number + 1,
                text: String::new(),
                ignored: words.any(|w| w == "ignore"),
            }));
            continue;
        }
        if trimmed.starts_with("<!-- keys-check: skip") {
            skipped = true;
            continue;
        }
        if trimmed.is_empty() {
            skipped = false;
        }
        if trimmed.starts_with('#') && trimmed.trim_start_matches('#').starts_with(' ') {
            under = sections
                .iter()
                .filter(|s| trimmed.contains(&format!("[{s}]")))
                .cloned()
                .collect();
        }
        lines.push(DocLine {
            number,
            text: line,
            under: under.clone(),
            skipped,
        });
    }
    assert!(fence.is_none(), "a fenced block is not closed");
    (blocks, lines)
}

/// The names the parser refuses at the top level of a file, and the sections.
struct OldKeys {
    /// Each refused name, with the key the parser says to use.
    new: HashMap<String, String>,
    sections: Vec<String>,
}

impl OldKeys {
    /// For each key of each section: its name, its name after the section's and `_`, and its
    /// flag's name, as far as [`new_key_of`] maps them; and `runtimes`.
    fn new() -> OldKeys {
        let sections = sections();
        let mut candidates = vec!["runtimes".to_string()];
        for (name, _, cmd) in &sections {
            for arg in cmd.get_arguments() {
                let id = arg.get_id().as_str();
                candidates.push(id.to_string());
                candidates.push(format!("{name}_{id}"));
                if let Some(long) = arg.get_long() {
                    candidates.push(long.replace('-', "_"));
                }
            }
        }
        OldKeys {
            new: candidates
                .into_iter()
                .filter_map(|old| new_key_of(&old, &sections).map(|new| (old, new)))
                .collect(),
            sections: sections.iter().map(|(n, _, _)| n.to_string()).collect(),
        }
    }

    /// The old names `text` uses, each with its new key (see the module docs for what counts).
    /// `under`: the sections whose bare keys are allowed; `flat_only`: count only the flat
    /// names that are no section's key.
    fn named_in(&self, text: &str, under: &[String], flat_only: bool) -> Vec<(String, String)> {
        let (old, sections) = (&self.new, &self.sections);
        let is_word = |c: char| c.is_ascii_alphanumeric() || c == '_';
        let mut found = Vec::new();
        let mut rest = text.char_indices().peekable();
        while let Some((start, c)) = rest.next() {
            if !is_word(c) {
                continue;
            }
            let mut end = start + c.len_utf8();
            while let Some(&(i, c)) = rest.peek()
                && is_word(c)
            {
                end = i + c.len_utf8();
                rest.next();
            }
            let word = &text[start..end];
            let Some(new) = old.get(word) else {
                continue;
            };
            let (section, key) = new.split_once('.').expect("section.key");
            let (before, after) = (&text[..start], &text[end..]);
            let bare = word == key;
            // A table of the flat file (`[runtimes.NAME]`), not a section (`[snapshotter]`).
            let flat_table = before.ends_with('[')
                && (after.starts_with('.') || after.starts_with(']'))
                && !sections.iter().any(|s| s == word);
            // Without `_`, a word of prose (`the socket`, `the snapshotter`).
            let prose = !word.contains('_') && !flat_table;
            let allowed = prose
                || (flat_only && bare)
                || (bare && before.ends_with(&format!("{section}.")))
                || (bare && under.iter().any(|s| s == section))
                || before.ends_with("::")
                || after.starts_with("::")
                || before.ends_with('/')
                || after.starts_with('/')
                || after.starts_with(".rs")
                || before.strip_suffix('.').is_some_and(|b| {
                    let owner = &b[b.rfind(|c| !is_word(c)).map_or(0, |i| i + 1)..];
                    !owner.is_empty() && !sections.iter().any(|s| s == owner)
                });
            if !allowed {
                found.push((word.to_string(), new.clone()));
            }
        }
        found
    }
}

/// What of a Rust source reads as text: its string literals (escapes decoded, line
/// continuations joined) and its doc comments, each with its line and whether it is a doc
/// comment. Ends at an inline `#[cfg(test)] mod ... {`: the tests are not messages.
fn rust_texts(src: &str) -> Vec<(usize, String, bool)> {
    let mut out = Vec::new();
    let b = src.as_bytes();
    let (mut i, mut line) = (0, 1);
    while i < b.len() {
        let rest = &src[i..];
        if let Some(after) = rest.strip_prefix("#[cfg(test)]") {
            let after = after.trim_start();
            if after.starts_with("mod ")
                && after
                    .find(['{', ';'])
                    .is_some_and(|j| after.as_bytes()[j] == b'{')
            {
                break;
            }
        }
        match b[i] {
            b'\n' => {
                line += 1;
                i += 1;
            }
            b'/' if rest.starts_with("//") => {
                let end = rest.find('\n').unwrap_or(rest.len());
                if rest.starts_with("///") || rest.starts_with("//!") {
                    out.push((line, rest[3..end].to_string(), true));
                }
                i += end;
            }
            b'/' if rest.starts_with("/*") => {
                let end = rest.find("*/").map_or(rest.len(), |j| j + 2);
                line += rest[..end].matches('\n').count();
                i += end;
            }
            b'\'' => i += char_literal_len(rest),
            b'r' | b'b' if is_raw_string_start(src, i) => {
                let open = rest.find('"').unwrap();
                let hashes = &rest[rest.find('r').unwrap() + 1..open];
                let close = format!("\"{hashes}");
                let end = open + 1 + rest[open + 1..].find(&close).expect("raw string closed");
                out.push((line, rest[open + 1..end].to_string(), false));
                line += rest[..end].matches('\n').count();
                i += end + close.len();
            }
            b'"' => {
                let (text, len) = string_literal(&rest[1..]);
                out.push((line, text, false));
                line += rest[..len + 1].matches('\n').count();
                i += len + 1;
            }
            _ => i += rest.chars().next().map_or(1, char::len_utf8),
        }
    }
    out
}

/// The bytes of the char literal at the start of `s` (`'a'`, `'"'`, `'\''`, `'\u{7f}'`), or 1
/// for the quote of a lifetime or a label (`'a`, `'static`).
fn char_literal_len(s: &str) -> usize {
    if let Some(escaped) = s.strip_prefix("'\\") {
        // The escape's first character may be a quote (`'\''`): the closing one comes after.
        let first = escaped.chars().next().map_or(0, char::len_utf8);
        return escaped[first..].find('\'').map_or(1, |j| 2 + first + j + 1);
    }
    let mut chars = s[1..].chars();
    match (chars.next(), chars.next()) {
        (Some(c), Some('\'')) => 2 + c.len_utf8(),
        _ => 1,
    }
}

/// Whether a raw string (`r"`, `r#"`, `br"`) starts at byte `i` (not inside an identifier).
fn is_raw_string_start(src: &str, i: usize) -> bool {
    if i > 0 {
        let prev = src.as_bytes()[i - 1];
        if prev.is_ascii_alphanumeric() || prev == b'_' {
            return false;
        }
    }
    let rest = src[i..].strip_prefix('b').unwrap_or(&src[i..]);
    rest.strip_prefix('r')
        .is_some_and(|r| r.trim_start_matches('#').starts_with('"'))
}

/// The text of a string literal whose opening quote was just before `s`, and the bytes up to
/// and including its closing quote.
fn string_literal(s: &str) -> (String, usize) {
    let mut text = String::new();
    let mut chars = s.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return (text, i + 1),
            '\\' => match chars.next() {
                // A line continuation: the newline and the next line's indentation go.
                Some((_, '\n')) => {
                    while chars.peek().is_some_and(|&(_, c)| c.is_whitespace()) {
                        chars.next();
                    }
                }
                Some((_, 'n')) => text.push('\n'),
                Some((_, 'u')) => {
                    for (_, c) in chars.by_ref() {
                        if c == '}' {
                            break;
                        }
                    }
                    text.push(' ');
                }
                Some((_, 'x')) => {
                    chars.next();
                    chars.next();
                    text.push(' ');
                }
                Some((_, c @ ('"' | '\\' | '\''))) => text.push(c),
                Some(_) => text.push(' '),
                None => break,
            },
            c => text.push(c),
        }
    }
    panic!("a string literal is not closed");
}

/// The Rust sources whose messages users see, test files left out.
fn message_sources() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            if p.is_dir() {
                if name != "tests" {
                    walk(&p, out);
                }
            } else if name.ends_with(".rs") && name != "tests.rs" && !name.ends_with("_tests.rs") {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    for krate in ["runtime", "store", "snapshotter", "codecs"] {
        walk(&workspace().join(krate).join("src"), &mut out);
    }
    out.sort();
    out
}

/// Every ```` ```toml ```` block of the docs is a configuration file `minicri config check`
/// passes, unless its fence says `ignore`.
#[test]
fn every_toml_snippet_of_the_docs_passes_config_check() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("config.toml");
    let sections = OldKeys::new().sections;
    let (mut checked, mut failures) = (0, Vec::new());
    for doc in doc_files() {
        let text = std::fs::read_to_string(&doc).unwrap();
        for block in split_markdown(&text, &sections).0 {
            if block.ignored {
                continue;
            }
            std::fs::write(&file, &block.text).unwrap();
            checked += 1;
            if let Err(e) = check_file(&file) {
                failures.push(format!("{}:{}: {e:#}", shown(&doc), block.line));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "TOML snippets that `minicri config check` refuses (a block that is not a minicri \
         configuration file is fenced ```toml ignore):\n{}",
        failures.join("\n")
    );
    // The docs hold several configuration files; none found means the reading is broken.
    assert!(checked >= 5, "only {checked} TOML blocks checked");
}

/// No doc, message or doc comment names a setting by a key the parser refuses.
#[test]
fn no_doc_or_message_names_a_key_the_parser_refuses() {
    let old = OldKeys::new();
    // The map is the parser's: the flat names of before sections, each with its new key.
    for (name, new) in [
        ("pull_detach_after", "pull.detach_after"),
        ("registry_config_dir", "registry.config_dir"),
        ("max_layer_bytes", "snapshotter.max_layer_bytes"),
        ("stream_address", "stream.address"),
        ("cni_conf_dir", "cni.conf_dirs"),
        ("runtimes", "runtime.handlers"),
    ] {
        assert_eq!(old.new.get(name).map(String::as_str), Some(new), "{name}");
    }
    // What counts, on examples.
    let named = |text: &str, under: &[&str]| -> Vec<String> {
        let under: Vec<String> = under.iter().map(|s| s.to_string()).collect();
        old.named_in(text, &under, false)
            .into_iter()
            .map(|(w, _)| w)
            .collect()
    };
    assert_eq!(
        named("after `pull_detach_after` (30 s)", &[]),
        ["pull_detach_after"]
    );
    assert_eq!(named("`max_layer_bytes` bounds", &[]), ["max_layer_bytes"]);
    assert_eq!(named("a `[runtimes.kata]` table", &[]), ["runtimes"]);
    assert_eq!(named("`registry.detach_after`", &[]), ["detach_after"]);
    for fine in [
        "`pull.detach_after`, `snapshotter.max_layer_bytes` and `--pull-detach-after`",
        "the root, the socket and the snapshotter",
        "`kube_watch/hold.rs`, `minicri::kube_watch::tracker`, `config.detach_after`",
        "minicri_image_fs_reserve_refusals_total",
    ] {
        assert!(named(fine, &[]).is_empty(), "{fine}");
    }
    assert!(named("| `detach_after` | `--pull-detach-after` |", &["pull"]).is_empty());
    // What of a Rust source is read: literals (continuations joined) and doc comments, not the
    // tests; a quote in a char literal opens no string.
    let src = "let q = '\"'; let s = \"a \\\n      pull_detach_after\";\n/// `stream_address`\n\
               // `cni_conf_dirs`\n#[cfg(test)]\nmod tests { fn f() { \"pull_min_speed\"; } }\n";
    assert_eq!(
        rust_texts(src),
        [
            (1, "a pull_detach_after".to_string(), false),
            (3, " `stream_address`".to_string(), true)
        ]
    );

    let mut found = Vec::new();
    for doc in doc_files() {
        let text = std::fs::read_to_string(&doc).unwrap();
        for line in split_markdown(&text, &old.sections).1 {
            if line.skipped {
                continue;
            }
            for (name, new) in old.named_in(line.text, &line.under, false) {
                found.push(format!(
                    "{}:{}: `{name}` is `{new}`: {}",
                    shown(&doc),
                    line.number,
                    line.text.trim()
                ));
            }
        }
    }
    let sources = message_sources();
    assert!(sources.len() > 50, "only {} sources found", sources.len());
    for src in sources {
        let text = std::fs::read_to_string(&src).unwrap();
        for (number, piece, doc_comment) in rust_texts(&text) {
            if !doc_comment && piece.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                continue;
            }
            for (name, new) in old.named_in(&piece, &[], doc_comment) {
                found.push(format!(
                    "{}:{number}: `{name}` is `{new}`: {}",
                    shown(&src),
                    piece.split_whitespace().collect::<Vec<_>>().join(" ")
                ));
            }
        }
    }
    let found: BTreeSet<String> = found.into_iter().collect();
    assert!(
        found.is_empty(),
        "settings named by keys the parser refuses; name them `section.key` (the module docs of \
         runtime/src/config/docs_tests.rs say what else passes):\n{}",
        found.into_iter().collect::<Vec<_>>().join("\n")
    );
}

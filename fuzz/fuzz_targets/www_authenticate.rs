//! The `WWW-Authenticate` challenge parser (store/src/registry/auth.rs), which reads what any
//! registry answers with a 401: never panics on any header values; schemes and parameter names
//! come out as non-empty lower-case tokens; and a challenge written from arbitrary parts (a
//! scheme, then realm, service and scope values with quotes, backslashes, commas and spaces in
//! them, quoted as RFC 7235 quotes) parses back to exactly those parts.
#![no_main]

use libfuzzer_sys::fuzz_target;
use minicri_store::registry::auth::parse_challenges;

/// RFC 9110 token characters.
fn tchar(c: char) -> bool {
    c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c)
}

fn quoted(v: &str) -> String {
    let mut out = String::from('"');
    for c in v.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    // Any bytes as header values (one per line).
    for c in parse_challenges(text.split('\n')) {
        assert!(!c.scheme.is_empty(), "{text:?}: {c:?}");
        assert!(!c.scheme.contains([' ', ',', '=', '\t']), "{text:?}: {c:?}");
        assert_eq!(c.scheme, c.scheme.to_ascii_lowercase(), "{text:?}");
        for (k, _) in &c.params {
            assert!(!k.is_empty() && *k == k.to_ascii_lowercase(), "{text:?}: {c:?}");
        }
    }
    // The same bytes as the parts of one challenge, written and read back.
    let mut parts = text.split('\0');
    let scheme: String = parts.next().unwrap_or("").chars().filter(|c| tchar(*c)).collect();
    if scheme.is_empty() {
        return;
    }
    let values: Vec<&str> = parts.take(3).collect();
    let names = ["realm", "service", "scope"];
    let written = format!(
        "{scheme} {}",
        names
            .iter()
            .zip(&values)
            .map(|(n, v)| format!("{n}={}", quoted(v)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let parsed = parse_challenges([written.as_str()]);
    assert_eq!(parsed.len(), 1, "{written:?}: {parsed:?}");
    assert_eq!(parsed[0].scheme, scheme.to_ascii_lowercase(), "{written:?}");
    let want: Vec<(String, String)> = names
        .iter()
        .zip(&values)
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect();
    assert_eq!(parsed[0].params, want, "{written:?}");
});

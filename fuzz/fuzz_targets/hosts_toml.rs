//! hosts.toml parsing (store/src/hosts.rs): never panics; every endpoint it yields has a host,
//! plain http only where the file says `http://` (in a TOML string or key, escapes decoded) or
//! the host is a loopback IP literal, and a path prefix of whole repository components.
#![no_main]

use libfuzzer_sys::fuzz_target;
use minicri_store::hosts::{is_loopback_ip, parse_hosts_toml};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    for registry in ["docker.io", "127.0.0.1:5000", "registry.example"] {
        let Ok(endpoints) = parse_hosts_toml(text, registry, std::path::Path::new("hosts.toml"))
        else {
            continue;
        };
        for e in &endpoints {
            assert!(!e.host.is_empty(), "{text:?}: endpoint without a host");
            if e.plain_http {
                let want = format!("http://{}", e.host);
                // As written, or in a string whose escapes spell it (the oracle's own TOML parser
                // may refuse a file the typed parser accepts, e.g. an out-of-range integer in an
                // ignored key).
                let explicit = text.contains(&want)
                    || toml::from_str::<toml::Value>(text)
                        .is_ok_and(|v| strings(&v).iter().any(|s| s.starts_with(&want)));
                assert!(
                    explicit || is_loopback_ip(&e.host),
                    "{text:?}: plain http for {} without http:// in the file",
                    e.host
                );
            }
            // The API root goes into request URLs: whole, plain path components only.
            assert!(
                e.api_root.starts_with('/')
                    && e.api_root[1..].split('/').all(|c| !c.is_empty()
                        && c != "."
                        && c != ".."
                        && c.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-~".contains(&b))),
                "{text:?}: API root {:?}",
                e.api_root
            );
            // Headers were checked when the file was read (RFC 9110 field names and values:
            // no line breaks or other control characters to split a request with).
            for (name, value) in &e.headers {
                let tchar = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
                assert!(
                    !name.as_str().is_empty()
                        && name.as_str().bytes().all(tchar)
                        && value
                            .as_bytes()
                            .iter()
                            .all(|b| *b == b'\t' || (*b >= 0x20 && *b != 0x7f)),
                    "{text:?}: header {name:?}: {value:?}"
                );
            }
            let _ = e.to_string();
        }
    }
});

/// Every key and string value of a TOML document, decoded.
fn strings(v: &toml::Value) -> Vec<String> {
    match v {
        toml::Value::String(s) => vec![s.clone()],
        toml::Value::Array(a) => a.iter().flat_map(strings).collect(),
        toml::Value::Table(t) => t
            .iter()
            .flat_map(|(k, v)| std::iter::once(k.clone()).chain(strings(v)))
            .collect(),
        _ => Vec::new(),
    }
}

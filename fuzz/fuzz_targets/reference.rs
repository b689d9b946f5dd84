//! Image reference parsing (store/src/reference.rs): never panics, and a parsed reference prints
//! to a string that parses back to the same reference.
#![no_main]

use libfuzzer_sys::fuzz_target;
use minicri_store::Reference;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(r) = Reference::parse(s) {
        let printed = r.to_string();
        let again = Reference::parse(&printed)
            .unwrap_or_else(|e| panic!("{s:?} printed as {printed:?}, which does not parse: {e}"));
        assert_eq!(again, r, "{s:?} -> {printed:?}");
        let _ = r.repository();
        let _ = r.tagged();
    }
});

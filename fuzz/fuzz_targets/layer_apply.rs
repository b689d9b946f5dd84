//! Layer apply (snapshotter/src/apply/): any byte stream as an uncompressed layer, unpacked into a
//! fresh directory. Never panics, never allocates without bound (run with -malloc_limit_mb), and
//! never touches anything outside the directory: a sibling directory with a file in it must come
//! out exactly as it went in.
//!
//! Inputs of even length (every tar stream is) have the length prefixes of their PAX records and
//! their header checksums made right first ([`fix_tar`], in fuzz/harness with its tests):
//! otherwise nearly every mutation of a PAX record or a header field fails the reader's length or
//! checksum check and the fuzzer never sees what lies behind it. Inputs of odd length are
//! unpacked as they are, so bad lengths and checksums are fuzzed too.
#![no_main]

use std::os::unix::fs::MetadataExt;

use libfuzzer_sys::fuzz_target;
use minicri_fuzz_harness::fix_tar;
use minicri_snapshotter::{Options, unpack_into};

fn fingerprint(p: &std::path::Path) -> Vec<(String, u64, i64, i64, u32)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(p).expect("outside dir exists") {
        let e = e.expect("entry");
        let m = e.metadata().expect("metadata");
        out.push((
            e.file_name().to_string_lossy().into_owned(),
            m.len(),
            m.mtime(),
            m.mtime_nsec(),
            m.mode(),
        ));
    }
    let m = std::fs::symlink_metadata(p).expect("outside dir");
    out.push((".".into(), m.nlink(), m.mtime(), m.mtime_nsec(), m.mode()));
    out.sort();
    out
}

fuzz_target!(|data: &[u8]| {
    let fixed;
    let data = if data.len() % 2 == 0 {
        fixed = fix_tar(data);
        &fixed[..]
    } else {
        data
    };
    let tmp = tempfile::tempdir().expect("temp dir");
    let root = tmp.path().join("root");
    let outside = tmp.path().join("outside");
    std::fs::create_dir(&root).expect("root");
    std::fs::create_dir(&outside).expect("outside");
    std::fs::create_dir(outside.join("dir")).expect("outside/dir");
    std::fs::write(outside.join("file"), b"outside").expect("outside/file");
    let before = (fingerprint(&outside), fingerprint(&outside.join("dir")));
    let options = Options {
        max_layer_bytes: 64 << 20,
        max_layer_entries: 4096,
        ..Options::default()
    };
    let _ = unpack_into(&root, data, &options);
    let after = (fingerprint(&outside), fingerprint(&outside.join("dir")));
    assert_eq!(
        before, after,
        "the layer touched a directory outside the root"
    );
    assert_eq!(
        std::fs::read(outside.join("file")).expect("file"),
        b"outside"
    );
    let names: Vec<_> = std::fs::read_dir(tmp.path())
        .expect("tmp")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(
        names.len(),
        2,
        "the layer created {names:?} next to the root"
    );
});

//! Layer apply (snapshotter/src/apply/): any byte stream as an uncompressed layer, unpacked into a
//! fresh directory. Never panics, never allocates without bound (run with -malloc_limit_mb), and
//! never touches anything outside the directory: a sibling directory with a file in it must come
//! out exactly as it went in.
//!
//! Inputs of even length (every tar stream is) have the length prefixes of their PAX records
//! ([`fix_pax_lengths`]) and then their header checksums ([`fix_checksums`]) made right first:
//! otherwise nearly every mutation of a PAX record or a header field fails the reader's length or
//! checksum check and the fuzzer never sees what lies behind it. Inputs of odd length are
//! unpacked as they are, so bad lengths and checksums are fuzzed too.
#![no_main]

use std::os::unix::fs::MetadataExt;

use libfuzzer_sys::fuzz_target;
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

/// A tar header's numeric field, as far as walking the stream needs it: octal digits between
/// spaces and NULs, or GNU base-256 (top bit of the first byte set). None when neither.
fn field_number(b: &[u8]) -> Option<u64> {
    if b[0] & 0x80 != 0 {
        return Some(
            b[1..]
                .iter()
                .fold(0u64, |v, x| v.saturating_mul(256).saturating_add(*x as u64)),
        );
    }
    let digits: Vec<u8> = b
        .iter()
        .copied()
        .filter(|c| *c != b' ' && *c != 0)
        .collect();
    if digits.is_empty() {
        return Some(0);
    }
    digits.iter().try_fold(0u64, |v, c| {
        (b'0'..=b'7')
            .contains(c)
            .then(|| v.saturating_mul(8) + (c - b'0') as u64)
    })
}

/// Walks `data` as the reader does (a header, then its `size` bytes of data rounded up to a
/// 512-byte block; zero blocks skipped) and writes each header's checksum as a tar writer would.
fn fix_checksums(data: &mut [u8]) {
    let mut off = 0usize;
    while off + 512 <= data.len() {
        let h = &mut data[off..off + 512];
        off += 512;
        if h.iter().all(|b| *b == 0) {
            continue;
        }
        h[148..156].fill(b' ');
        let sum: u32 = h.iter().map(|b| *b as u32).sum();
        h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
        let size = field_number(&h[124..136]).unwrap_or(0);
        let Some(next) = usize::try_from(size.div_ceil(512).saturating_mul(512))
            .ok()
            .and_then(|d| off.checked_add(d))
        else {
            return;
        };
        off = next;
    }
}

/// The records of a PAX header's data with their length prefixes written as a tar writer would
/// (`<length> <key>=<value>\n`, the length counting its own digits). A line whose text before its
/// first space is not a number gets a prefix in front of the whole line. What follows the last
/// newline (NUL padding, a record cut short) stays as it is.
fn pax_records(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 16);
    let mut rest = body;
    while let Some(nl) = rest.iter().position(|b| *b == b'\n') {
        let line = &rest[..nl];
        rest = &rest[nl + 1..];
        if line.is_empty() {
            out.push(b'\n');
            continue;
        }
        let text = match line.iter().position(|b| *b == b' ') {
            Some(sp) if line[..sp].iter().all(u8::is_ascii_digit) => &line[sp + 1..],
            _ => line,
        };
        let mut n = text.len() + 2;
        while n.to_string().len() + text.len() + 2 != n {
            n = n.to_string().len() + text.len() + 2;
        }
        out.extend_from_slice(format!("{n} ").as_bytes());
        out.extend_from_slice(text);
        out.push(b'\n');
    }
    out.extend_from_slice(rest);
    out
}

/// Walks `data` as [`fix_checksums`] does and rewrites the records of each PAX header (`x`, `g`)
/// with [`pax_records`], and the header's size to match. A PAX record carries its own length, so
/// without this a mutation that adds, drops or renames a record nearly always makes the reader
/// refuse the whole header, and the fuzzer meets a new key only by turning one record into
/// another of the same length. A header whose data runs past the end of the input (an oversized
/// size field, say) and all that follows it are left as they are.
fn fix_pax_lengths(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + 512);
    let mut off = 0usize;
    while off + 512 <= data.len() {
        let h = &data[off..off + 512];
        if h.iter().all(|b| *b == 0) {
            out.extend_from_slice(h);
            off += 512;
            continue;
        }
        let Some(end) = field_number(&h[124..136])
            .and_then(|s| usize::try_from(s).ok())
            .and_then(|s| (off + 512).checked_add(s))
            .filter(|end| *end <= data.len())
        else {
            break;
        };
        let next = (off + 512 + (end - off - 512).div_ceil(512) * 512).min(data.len());
        if matches!(h[156], b'x' | b'g') {
            let records = pax_records(&data[off + 512..end]);
            let mut h = h.to_vec();
            h[124..136].copy_from_slice(format!("{:011o}\0", records.len()).as_bytes());
            out.extend_from_slice(&h);
            out.extend_from_slice(&records);
            out.resize(out.len().div_ceil(512) * 512, 0);
        } else {
            out.extend_from_slice(&data[off..next]);
        }
        off = next;
    }
    out.extend_from_slice(&data[off..]);
    out
}

fuzz_target!(|data: &[u8]| {
    let mut fixed;
    let data = if data.len() % 2 == 0 {
        fixed = fix_pax_lengths(data);
        fix_checksums(&mut fixed);
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

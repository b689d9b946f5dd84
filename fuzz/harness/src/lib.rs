//! Input fix-ups the fuzz targets (../fuzz_targets) apply to a mutated input before the code
//! under test sees it. They live in their own crate, with no libFuzzer, so `cargo test` checks
//! them against an independent tar reader (hack/fuzz-smoke.sh runs those tests first).

/// A tar header's numeric field, as far as walking the stream needs it: octal digits between
/// spaces and NULs, or GNU base-256 (top bit of the first byte set). None when neither.
pub fn field_number(b: &[u8]) -> Option<u64> {
    if b.first().is_some_and(|x| x & 0x80 != 0) {
        return Some(
            b[1..]
                .iter()
                .fold(0u64, |v, x| v.saturating_mul(256).saturating_add(*x as u64)),
        );
    }
    b.iter()
        .filter(|c| **c != b' ' && **c != 0)
        .try_fold(0u64, |v, c| {
            (b'0'..=b'7')
                .contains(c)
                .then(|| v.saturating_mul(8).saturating_add((c - b'0') as u64))
        })
}

/// The records of a PAX header's data with their length prefixes written as a tar writer would
/// (`<length> <key>=<value>\n`, the length counting its own digits). A line whose text before its
/// first space is not a number gets a prefix in front of the whole line. What follows the last
/// newline (NUL padding, a record cut short) stays as it is.
pub fn pax_records(body: &[u8]) -> Vec<u8> {
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

/// Writes a header's checksum as a tar writer would: the byte sum with the field as spaces.
fn write_checksum(h: &mut [u8]) {
    h[148..156].fill(b' ');
    let sum: u32 = h.iter().map(|b| *b as u32).sum();
    h[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
}

/// `data` walked as a tar reader walks it (a header, then its `size` bytes of data rounded up to a
/// 512-byte block; zero blocks skipped), with the records of each PAX header (`x`, `g`) rewritten
/// by [`pax_records`] and its size to match, and every header's checksum written. A PAX record
/// carries its own length and every header a checksum, so without this nearly every mutation of a
/// record or a header field makes the reader refuse the header, and the fuzzer never sees what
/// lies behind it. A size field that is not a number counts as 0; a header whose data runs past
/// the end of the input gets its checksum, and it and all that follows are otherwise left as is.
pub fn fix_tar(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + 512);
    let mut off = 0usize;
    while off + 512 <= data.len() {
        let mut h = [0u8; 512];
        h.copy_from_slice(&data[off..off + 512]);
        off += 512;
        if h.iter().all(|b| *b == 0) {
            out.extend_from_slice(&h);
            continue;
        }
        let size = field_number(&h[124..136]).unwrap_or(0);
        let Some(end) = usize::try_from(size)
            .ok()
            .and_then(|s| off.checked_add(s))
            .filter(|end| *end <= data.len())
        else {
            write_checksum(&mut h);
            out.extend_from_slice(&h);
            break;
        };
        let next = (off + (end - off).div_ceil(512) * 512).min(data.len());
        if matches!(h[156], b'x' | b'g') {
            let records = pax_records(&data[off..end]);
            h[124..136].copy_from_slice(format!("{:011o}\0", records.len()).as_bytes());
            write_checksum(&mut h);
            out.extend_from_slice(&h);
            out.extend_from_slice(&records);
            out.resize(out.len().div_ceil(512) * 512, 0);
        } else {
            write_checksum(&mut h);
            out.extend_from_slice(&h);
            out.extend_from_slice(&data[off..next]);
        }
        off = next;
    }
    out.extend_from_slice(&data[off..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// A ustar header with the checksum a tar writer gives it, then spoilt.
    fn header(kind: tar::EntryType, path: &str, size: u64) -> Vec<u8> {
        let mut h = tar::Header::new_ustar();
        h.set_path(path).unwrap();
        h.set_entry_type(kind);
        h.set_size(size);
        h.set_mode(0o644);
        h.set_cksum();
        let mut b = h.as_bytes().to_vec();
        b[148..156].copy_from_slice(b"0000001\0");
        b
    }

    fn padded(data: &[u8]) -> Vec<u8> {
        let mut v = data.to_vec();
        v.resize(data.len().div_ceil(512) * 512, 0);
        v
    }

    fn checksum_is_right(h: &[u8]) -> bool {
        let mut copy = h.to_vec();
        copy[148..156].fill(b' ');
        let sum: u64 = copy.iter().map(|b| *b as u64).sum();
        field_number(&h[148..156]) == Some(sum)
    }

    #[test]
    fn pax_records_with_wrong_lengths_and_headers_with_wrong_checksums_read_back() {
        // Record lengths as a mutation leaves them: one too short, one missing, one too long; the
        // header's size is the data's, which the records outgrow once their lengths are right.
        let body = b"3 path=a/much/longer/name\nuid=7\n99 mtime=5\n";
        let mut data = header(tar::EntryType::XHeader, "pax", body.len() as u64);
        data.extend(padded(body));
        data.extend(header(tar::EntryType::Regular, "short", 3));
        data.extend(padded(b"abc"));
        data.extend([0u8; 1024]);
        assert!(
            tar::Archive::new(&data[..])
                .entries()
                .unwrap()
                .next()
                .unwrap()
                .is_err(),
            "the unfixed stream is refused"
        );

        let fixed = fix_tar(&data);
        let mut archive = tar::Archive::new(&fixed[..]);
        let mut entries = archive.entries().unwrap();
        let mut entry = entries.next().expect("one entry").expect("it reads");
        assert_eq!(entry.path().unwrap().to_str(), Some("a/much/longer/name"));
        let pax: Vec<(String, String)> = entry
            .pax_extensions()
            .unwrap()
            .expect("PAX records")
            .map(|r| {
                let r = r.expect("a well-formed record");
                (r.key().unwrap().to_owned(), r.value().unwrap().to_owned())
            })
            .collect();
        assert_eq!(
            pax,
            [("path", "a/much/longer/name"), ("uid", "7"), ("mtime", "5")]
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
        );
        let mut content = String::new();
        entry.read_to_string(&mut content).unwrap();
        assert_eq!(content, "abc");
        assert!(entries.next().is_none());
    }

    #[test]
    fn global_pax_headers_are_rewritten_too() {
        let body = b"1 comment=x\n";
        let mut data = header(tar::EntryType::XGlobalHeader, "g", body.len() as u64);
        data.extend(padded(body));
        let fixed = fix_tar(&data);
        assert!(checksum_is_right(&fixed[..512]));
        assert_eq!(field_number(&fixed[124..136]), Some(13));
        assert_eq!(&fixed[512..525], b"13 comment=x\n");
        assert_eq!(fixed.len(), 1024);
    }

    #[test]
    fn record_lengths_count_their_own_digits() {
        for n in 0..1200 {
            let line = format!("k={}\n", "v".repeat(n));
            let out = pax_records(line.as_bytes());
            let text = String::from_utf8(out).unwrap();
            let (len, rest) = text.split_once(' ').unwrap();
            assert_eq!(len.parse::<usize>().unwrap(), text.len(), "{text:?}");
            assert_eq!(rest, line);
        }
    }

    #[test]
    fn what_follows_the_last_newline_is_kept_and_empty_lines_stay_empty() {
        assert_eq!(pax_records(b"\n5 a=b\n12 cut sh"), b"\n6 a=b\n12 cut sh");
        assert_eq!(pax_records(b"x y=z\n"), b"8 x y=z\n", "no number: prefixed");
    }

    #[test]
    fn a_header_whose_data_runs_past_the_end_gets_only_its_checksum() {
        let mut data = header(tar::EntryType::XHeader, "pax", 10_000);
        data.extend(padded(b"3 path=x\n"));
        let fixed = fix_tar(&data);
        assert!(checksum_is_right(&fixed[..512]));
        assert_eq!(fixed[..148], data[..148]);
        assert_eq!(fixed[156..], data[156..]);
    }

    #[test]
    fn a_size_that_is_no_number_counts_as_zero_and_the_walk_goes_on() {
        let mut data = header(tar::EntryType::Regular, "a", 0);
        data[124..136].copy_from_slice(b"zzzzzzzzzzz\0");
        data.extend(header(tar::EntryType::Regular, "b", 0));
        let fixed = fix_tar(&data);
        assert!(checksum_is_right(&fixed[..512]));
        assert!(checksum_is_right(&fixed[512..]));
    }

    #[test]
    fn short_inputs_and_zero_blocks_pass_unchanged() {
        assert_eq!(fix_tar(b"abc"), b"abc");
        assert_eq!(fix_tar(&[0u8; 1030]), vec![0u8; 1030]);
    }

    #[test]
    fn numeric_fields() {
        assert_eq!(field_number(b"0000644\0"), Some(0o644));
        assert_eq!(field_number(b"  12 \0"), Some(0o12));
        assert_eq!(field_number(b"\0\0\0"), Some(0));
        assert_eq!(field_number(b"0009\0"), None);
        assert_eq!(field_number(&[0x80, 0, 0, 1, 0]), Some(256));
        assert_eq!(field_number(&[0xff; 12]), Some(u64::MAX));
        assert_eq!(field_number(b"77777777777777777777777"), Some(u64::MAX));
    }
}

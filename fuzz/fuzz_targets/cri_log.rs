//! The CRI log format (minicri_codecs::crilog, codecs/src/crilog.rs): the entry parser and
//! reassembly never panic on any log bytes, and output split into entries by the line splitter
//! reassembles to the original lines.
#![no_main]

use libfuzzer_sys::fuzz_target;
use minicri_codecs::crilog as logs;

fuzz_target!(|data: &[u8]| {
    // Any bytes as a log file.
    let _ = logs::parse_entry(data);
    let _ = logs::reassemble(data);

    // The first byte picks a line limit; the rest is container output, fed in two chunks.
    let Some((&first, output)) = data.split_first() else {
        return;
    };
    let max = (first as usize % 64) + 1;
    let cut = output.len() / 2;
    let mut splitter = logs::LineSplitter::new(max);
    let mut log = Vec::new();
    let t = chrono::DateTime::from_timestamp(1_700_000_000, 123).expect("valid");
    let mut emit = |piece: &[u8], partial: bool| {
        assert!(piece.len() <= max, "piece of {} bytes over {max}", piece.len());
        assert!(!piece.contains(&b'\n'));
        logs::format_entry(&mut log, t, logs::Stream::Stdout, partial, piece);
    };
    splitter.feed(&output[..cut], &mut emit);
    splitter.feed(&output[cut..], &mut emit);
    splitter.finish(&mut emit);
    let lines = logs::reassemble(&log).expect("the writer's own log parses");
    let got: Vec<u8> = lines
        .iter()
        .flat_map(|(_, l)| l.iter().copied().chain(std::iter::once(b'\n')))
        .collect();
    let mut want = output.to_vec();
    if !want.is_empty() && !want.ends_with(b"\n") {
        want.push(b'\n');
    }
    assert_eq!(got, want);
});

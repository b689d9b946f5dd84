#!/usr/bin/env bash
# fuzz-smoke.sh - builds every cargo-fuzz target in fuzz/ and runs each for a short while
# (FUZZ_SECONDS, default 25) from its committed corpus (the named seeds and reproducers in
# fuzz/corpus/TARGET and the grown inputs in fuzz/grown/TARGET.tar.xz, unpacked to a scratch
# directory by hack/fuzz-corpus.sh), so a parser change that crashes on anything the fuzzing
# hours reached, or on what the fuzzer finds in half a minute, shows up. hack/test.sh ends with it (10 s
# each); longer runs are the same script with a larger FUZZ_SECONDS. See docs/fuzzing.md.
#
# Fails loudly when cargo-fuzz is missing (hack/install-fuzz.sh installs the pinned version).
# New inputs the fuzzer finds go to a scratch directory, not into the committed corpus, unless
# FUZZ_KEEP_DIR names a directory to keep them in (DIR/TARGET, reused by the next run: long runs).
# A target with a dictionary (fuzz/dicts/TARGET.dict: the tokens of its format) gets it.
# Usage: hack/fuzz-smoke.sh [TARGET...]   (default: every target)
set -euo pipefail
cd "$(dirname "$0")/../fuzz"

if ! command -v cargo-fuzz >/dev/null 2>&1; then
    echo "fuzz-smoke: FAILED: cargo-fuzz is not installed; run hack/install-fuzz.sh" >&2
    exit 1
fi

SECONDS_EACH="${FUZZ_SECONDS:-25}"
# cargo-fuzz passes nightly-only flags (-Z sanitizer, ...); this lets the stable toolchain take them.
export RUSTC_BOOTSTRAP=1
# Layer apply creates files, so its memory cap is the one that matters: no input may make the
# applier allocate without bound.
MALLOC_LIMIT_MB=512

mapfile -t targets < <(if [[ $# -gt 0 ]]; then printf '%s\n' "$@"; else cargo fuzz list; fi)
start=$(date +%s)
# The fix-ups the targets apply to their inputs before the code under test (fuzz/harness) have
# their own unit tests, against an independent tar reader.
cargo test -q -p minicri-fuzz-harness
cargo fuzz build -O
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
failed=()
for t in "${targets[@]}"; do
    found="${FUZZ_KEEP_DIR:-$scratch}/$t"
    mkdir -p "$found"
    dict=()
    if [[ -f dicts/$t.dict ]]; then
        dict=(-dict="dicts/$t.dict")
    fi
    corpus="$scratch/corpus/$t"
    ../hack/fuzz-corpus.sh unpack "$t" "$corpus"
    echo "fuzz-smoke: $t for ${SECONDS_EACH}s ($(ls "$corpus" | wc -l) inputs)"
    if ! cargo fuzz run -O "$t" "$found" "$corpus" -- "${dict[@]}" \
        -max_total_time="$SECONDS_EACH" -malloc_limit_mb="$MALLOC_LIMIT_MB" \
        -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
        -artifact_prefix="$scratch/$t-" >"$scratch/$t.log" 2>&1; then
        echo "fuzz-smoke: $t FAILED; its log:" >&2
        tail -n 60 "$scratch/$t.log" >&2
        mkdir -p artifacts
        cp "$scratch/$t-"* artifacts/ 2>/dev/null || true
        failed+=("$t")
    else
        grep -E "stat::number_of_executed_units|stat::peak_rss_mb" "$scratch/$t.log" | sed "s/^/fuzz-smoke: $t /"
    fi
done
echo "fuzz-smoke: ${#targets[@]} targets in $(( $(date +%s) - start ))s"
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "fuzz-smoke: FAILED: ${failed[*]} (crash inputs copied to fuzz/artifacts/)" >&2
    exit 1
fi
echo "${#targets[@]} passed, 0 failed"

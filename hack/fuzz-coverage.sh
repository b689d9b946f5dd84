#!/usr/bin/env bash
# fuzz-coverage.sh - where a fuzz target's corpus reaches: replays the corpus once (-runs=0) with
# libFuzzer's -print_coverage=1 and sums the covered edges by origin: this project's crates
# (project:store, project:runtime, ...), each dependency (crate:toml, ...), the standard library
# (std). Comparing two corpora of one target (before and after a long run) tells whether a run's
# new edges were in the project's own code or in a dependency's parser. See docs/fuzzing.md.
#
# Needs the targets built (`cargo fuzz build -O`, or a hack/fuzz-smoke.sh run) and
# llvm-symbolizer on PATH (Debian: apt-get install llvm), which names each function's source file.
# Usage: hack/fuzz-coverage.sh TARGET [CORPUS_DIR]   (default: the committed fuzz/corpus/TARGET)
#        FUZZ_COVERAGE_RAW=FILE keeps libFuzzer's per-function list in FILE.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
[[ $# -ge 1 ]] || { echo "usage: $0 TARGET [CORPUS_DIR]" >&2; exit 2; }
target=$1
corpus=$(realpath "${2:-$root/fuzz/corpus/$target}")
bin=$root/fuzz/target/x86_64-unknown-linux-gnu/release/$target
if [[ ! -x $bin ]]; then
    echo "fuzz-coverage: FAILED: $bin is not built; run (cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz build -O)" >&2
    exit 1
fi
if ! command -v llvm-symbolizer >/dev/null 2>&1; then
    echo "fuzz-coverage: FAILED: llvm-symbolizer is not on PATH (Debian: apt-get install llvm)" >&2
    exit 1
fi
raw=${FUZZ_COVERAGE_RAW:-$(mktemp)}
[[ -n ${FUZZ_COVERAGE_RAW:-} ]] || trap 'rm -f "$raw"' EXIT
# The same limits as the fuzzing runs, so every input replays as it did there.
"$bin" -runs=0 -print_coverage=1 -rss_limit_mb=2048 -malloc_limit_mb=512 -timeout=10 \
    "$corpus" >"$raw" 2>&1 || {
    echo "fuzz-coverage: FAILED: replaying $corpus; the end of its log:" >&2
    tail -n 30 "$raw" >&2
    exit 1
}
# Lines: "COVERED_FUNC: hits: H edges: C/T NAME FILE:LINE" (UNCOVERED_FUNC likewise, C = 0).
# Files inside the checkout count for the project crate they are in, whichever fuzz target
# compiled them in; others by their registry crate, or as the standard library.
grep -E '^(UN)?COVERED_FUNC' "$raw" | sort -u | awk -v root="$root/" '
{
    split($5, e, "/"); f = $NF
    if (index(f, root) == 1) {
        g = substr(f, length(root) + 1)
        sub(/^fuzz\/fuzz_targets\/\.\.\/\.\.\//, "", g)
        sub(/\/src\/.*/, "", g); sub(/\/[^\/]*\.rs:.*/, "", g)
        g = "project:" g
    } else if (f ~ /registry\/src\//) {
        g = f; sub(/.*registry\/src\/[^\/]*\//, "", g); sub(/\/.*/, "", g)
        sub(/-[0-9][0-9.]*.*$/, "", g); g = "crate:" g
    } else if (f ~ /^\/rustc\//) {
        g = "std"
    } else {
        g = "other"
    }
    cov[g] += e[1]; tot[g] += e[2]; all += e[1]
}
END {
    for (g in cov) printf "%-28s %7d of %7d edges\n", g, cov[g], tot[g]
    printf "%-28s %7d\n", "total", all
}' | sort

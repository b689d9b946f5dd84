#!/usr/bin/env bash
# fuzz-coverage.sh - where a fuzz target's corpus reaches: replays the corpus once (-runs=0) with
# libFuzzer's -print_coverage=1 and sums the covered edges by origin: this project's crates
# (project:store, project:runtime, ...), each dependency (crate:toml, ...), the standard library
# (std). Comparing two corpora of one target (before and after a long run) tells whether a run's
# new edges were in the project's own code or in a dependency's parser. See docs/fuzzing.md.
#
# Needs the targets built (`cargo fuzz build -O`, or a hack/fuzz-smoke.sh run) and
# llvm-symbolizer on PATH (Debian: apt-get install llvm), which names each function's source file.
# Usage: hack/fuzz-coverage.sh TARGET [CORPUS_DIR]   (default: the committed corpus of TARGET,
#        fuzz/corpus/TARGET and fuzz/grown/TARGET.tar.xz, see hack/fuzz-corpus.sh)
#        hack/fuzz-coverage.sh --new TARGET OLD_CORPUS NEW_CORPUS
#        FUZZ_COVERAGE_RAW=FILE keeps libFuzzer's per-function list in FILE (first form only).
#        layer_apply unpacks every input under TMPDIR: a tmpfs (TMPDIR=/dev/shm) replays it fast.
#
# The first form counts a function's edges for the file the function is in, so code a dependency
# inlines into a project function counts for the project. --new counts the edges NEW_CORPUS
# covers and OLD_CORPUS does not by the source line of each edge (libFuzzer lists a covered
# function's uncovered edges with their lines, the innermost inlined one): an edge of the http
# crate's header table inlined into a project function counts for crate:http there. A function
# NEW_CORPUS reaches for the first time has no such list; its edges count for its own file.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
usage() {
    echo "usage: $0 TARGET [CORPUS_DIR] | $0 --new TARGET OLD_CORPUS NEW_CORPUS" >&2
    exit 2
}
compare=false
if [[ ${1:-} == --new ]]; then
    [[ $# -eq 4 ]] || usage
    compare=true
    shift
fi
[[ $# -ge 1 ]] || usage
target=$1
bin=$root/fuzz/target/x86_64-unknown-linux-gnu/release/$target
if [[ ! -x $bin ]]; then
    echo "fuzz-coverage: FAILED: $bin is not built; run (cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz build -O)" >&2
    exit 1
fi
if ! command -v llvm-symbolizer >/dev/null 2>&1; then
    echo "fuzz-coverage: FAILED: llvm-symbolizer is not on PATH (Debian: apt-get install llvm)" >&2
    exit 1
fi

# replay CORPUS OUT: libFuzzer's coverage listing of CORPUS into OUT.
replay() {
    # The same limits as the fuzzing runs, so every input replays as it did there.
    "$bin" -runs=0 -print_coverage=1 -rss_limit_mb=2048 -malloc_limit_mb=512 -timeout=10 \
        "$1" >"$2" 2>&1 || {
        echo "fuzz-coverage: FAILED: replaying $1; the end of its log:" >&2
        tail -n 30 "$2" >&2
        exit 1
    }
}

# The origin of a source file, as an awk function: files inside the checkout count for the
# project crate they are in, whichever fuzz target compiled them in; others by their registry
# crate, or as the standard library.
origin='
function origin(f,    g) {
    if (index(f, root) == 1) {
        g = substr(f, length(root) + 1)
        sub(/^fuzz\/fuzz_targets\/\.\.\/\.\.\//, "", g)
        sub(/\/src\/.*/, "", g); sub(/\/[^\/]*\.rs:.*/, "", g)
        return "project:" g
    }
    if (f ~ /registry\/src\//) {
        g = f; sub(/.*registry\/src\/[^\/]*\//, "", g); sub(/\/.*/, "", g)
        sub(/-[0-9][0-9.]*.*$/, "", g); return "crate:" g
    }
    if (f ~ /^\/rustc\//) return "std"
    return "other"
}
function rel(f) { return index(f, root) == 1 ? substr(f, length(root) + 1) : f }'

if $compare; then
    old=$(mktemp) new=$(mktemp)
    trap 'rm -f "$old" "$new"' EXIT
    replay "$(realpath "$2")" "$old"
    replay "$(realpath "$3")" "$new"
    # Lines: "COVERED_FUNC: hits: H edges: C/T NAME FILE:LINE", then one "  UNCOVERED_PC: FILE:LINE"
    # per edge it missed; "UNCOVERED_FUNC: hits: 0 edges: 0/T NAME FILE:LINE".
    awk -v root="$root/" "$origin"'
    /^(UN)?COVERED_FUNC/ {
        split($5, e, "/"); fn = $0; sub(/.*edges: [0-9]+\/[0-9]+ /, "", fn)
        if (FILENAME == ARGV[1]) { oc[fn] = e[1] } else { nc[fn] = e[1]; nf[fn] = $NF }
        next
    }
    /^  UNCOVERED_PC:/ {
        g = origin($2)
        if (FILENAME == ARGV[1]) { ou[fn, g]++; ol[fn, $2]++ } else { nu[fn, g]++; nl[fn, $2]++ }
        seen[g] = 1
        if (g ~ /^project:/) lines[$2] = 1
    }
    END {
        for (fn in nc) {
            if (nc[fn] == 0) continue
            if (!(fn in oc) || oc[fn] == 0) {
                g = origin(nf[fn])
                add[g " (newly reached functions)"] += nc[fn]
                if (g ~ /^project:/) reached[sprintf("  %s: %%d edges of newly reached functions", rel(nf[fn]))] += nc[fn]
                continue
            }
            for (g in seen) {
                d = ou[fn, g] - nu[fn, g]
                if (d != 0) add[g] += d
            }
            # Which lines of the project the new edges are on, summed over the functions that
            # share a place (the copies of a generic function).
            for (l in lines) {
                d = ol[fn, l] - nl[fn, l]
                if (d != 0) moved[sprintf("  %s: %%+d (in the function at %s)", rel(l), rel(nf[fn]))] += d
            }
        }
        for (g in add) if (add[g] != 0) { printf "%-28s %+7d edges\n", g, add[g]; all += add[g] }
        printf "%-28s %+7d\n", "total", all
        for (w in reached) printf "~" w "\n", reached[w]
        for (w in moved) if (moved[w] != 0) printf "~" w "\n", moved[w]
    }' "$old" "$new" | LC_ALL=C sort | sed 's/^~//'
    exit 0
fi

raw=${FUZZ_COVERAGE_RAW:-$(mktemp)}
unpacked=$(mktemp -d)
trap 'rm -rf "$unpacked"; [[ -n ${FUZZ_COVERAGE_RAW:-} ]] || rm -f "$raw"' EXIT
if [[ -n ${2:-} ]]; then
    corpus=$(realpath "$2")
else
    # The committed corpus: the named inputs and the grown archive.
    "$root/hack/fuzz-corpus.sh" unpack "$target" "$unpacked"
    corpus=$unpacked
fi
replay "$corpus" "$raw"
# Lines: "COVERED_FUNC: hits: H edges: C/T NAME FILE:LINE" (UNCOVERED_FUNC likewise, C = 0).
grep -E '^(UN)?COVERED_FUNC' "$raw" | sort -u | awk -v root="$root/" "$origin"'
{
    split($5, e, "/"); g = origin($NF)
    cov[g] += e[1]; tot[g] += e[2]; all += e[1]
}
END {
    for (g in cov) printf "%-28s %7d of %7d edges\n", g, cov[g], tot[g]
    printf "%-28s %7d\n", "total", all
}' | sort

#!/usr/bin/env bash
# test.sh - everything the test suite needs, then the suite: installs the Debian packages the tests
# drive (hack/install-deps.sh), builds the minicri binary the black-box tests start, and runs every
# test in the workspace with cargo-nextest (cargo test if nextest is missing). Without arguments
# (the whole suite) it then fuzzes every fuzz target for FUZZ_SECONDS (10) each.
# Run as root: the tests start registries, mount overlays and run containers.
set -euo pipefail
cd "$(dirname "$0")/.."

hack/install-deps.sh
# The suite pushes and pulls GiB-sized images while the build's artefacts sit in target/: with too
# little free space, pushes fail mid-test with ENOSPC (seen in CI when a disk held 9.5 GiB). Say so
# up front instead.
need_gib="${MINICRI_TEST_MIN_FREE_GIB:-20}"
for dir in "${TMPDIR:-/tmp}" "${CARGO_TARGET_DIR:-target}"; do
    mkdir -p "$dir"
    free_gib=$(( $(df --output=avail -k "$dir" | tail -1) / 1024 / 1024 ))
    if (( free_gib < need_gib )); then
        echo "test.sh: $dir has ${free_gib} GiB free; the suite needs ${need_gib} GiB (MINICRI_TEST_MIN_FREE_GIB)" >&2
        exit 1
    fi
done
# Tests that need root, runc or the CNI plugins fail instead of skipping: a green run means
# they ran (tests/src/prereq.rs).
export MINICRI_TEST_STRICT=1
cargo build --workspace --bins
rc=0
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --no-fail-fast "$@" || rc=$?
else
    cargo test --workspace --no-fail-fast "$@" || rc=$?
fi
# The whole suite (no arguments, as CI runs it) ends with a short libFuzzer run of every fuzz
# target from its committed seeds (docs/fuzzing.md); a filtered run skips it.
if [[ $# -eq 0 ]]; then
    hack/install-fuzz.sh
    FUZZ_SECONDS="${FUZZ_SECONDS:-10}" hack/fuzz-smoke.sh || rc=$?
fi
exit "$rc"

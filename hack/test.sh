#!/usr/bin/env bash
# test.sh - everything the test suite needs, then the suite: installs the Debian packages the tests
# drive (hack/install-deps.sh), builds the minicri binary the black-box tests start, and runs every
# test in the workspace with cargo-nextest (cargo test if nextest is missing).
# Run as root: the tests start registries, mount overlays and run containers.
set -euo pipefail
cd "$(dirname "$0")/.."

hack/install-deps.sh
cargo build --workspace --bins
if cargo nextest --version >/dev/null 2>&1; then
    exec cargo nextest run --workspace --no-fail-fast "$@"
else
    exec cargo test --workspace --no-fail-fast "$@"
fi

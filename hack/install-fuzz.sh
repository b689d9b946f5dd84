#!/usr/bin/env bash
# install-fuzz.sh - installs the pinned cargo-fuzz that hack/fuzz-smoke.sh and docs/fuzzing.md use,
# from crates.io, unless that version is installed already. cargo-fuzz drives libFuzzer through
# nightly-only rustc flags; on the stable toolchain the scripts set RUSTC_BOOTSTRAP=1 for that.
set -euo pipefail

CARGO_FUZZ_VERSION=0.13.1

if command -v cargo-fuzz >/dev/null 2>&1 \
    && cargo fuzz --version 2>/dev/null | grep -q " ${CARGO_FUZZ_VERSION}\$"; then
    echo "install-fuzz: cargo-fuzz ${CARGO_FUZZ_VERSION} is installed"
    exit 0
fi
echo "install-fuzz: installing cargo-fuzz ${CARGO_FUZZ_VERSION}"
cargo install cargo-fuzz --version "${CARGO_FUZZ_VERSION}" --locked

#!/usr/bin/env bash
# Builds minicri's test images (see tests/src/images.rs) and pushes the standard set to a
# registry, e.g. one started by hack/start-registry.sh.
#
# Usage: hack/push-test-images.sh [--registry HOST:PORT] [--username U --password P]
#
# The registry defaults to 127.0.0.1:5000. Everything after the script name is passed to
# `minicri-testimg push-standard`. Set CARGO_TARGET_DIR to build elsewhere than target/.
set -euo pipefail

cd "$(dirname "$0")/.."
exec cargo run -q -p minicri-tests --bin minicri-testimg -- push-standard "$@"

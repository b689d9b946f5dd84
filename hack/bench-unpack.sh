#!/usr/bin/env bash
# Unpack benchmark: splits this machine's /usr into four gzip layers, then times
#   1. `tar -xzf` of each layer into its own directory (what an overlay layer store needs),
#   2. minicri-snapshotter's overlay backend (decompress + diff_id check + apply + commit),
#   3. minicri-snapshotter's copy backend (each layer also copies its parent's full tree first).
# The page cache is dropped before every run; the layer files are read once first so every run
# starts with the compressed input cached, as it would be when it streams in from the network.
# Needs root. Usage: [RUNS=3] [LAYER_DIR=dir] hack/bench-unpack.sh [workdir]
#   workdir (default /var/tmp/minicri-bench-unpack) is where layers are unpacked; a tmpfs such as
#   /dev/shm/x takes the disk out of the measurement. LAYER_DIR (default workdir/layers) caches the
#   generated layers between runs.
set -euo pipefail

WORK=${1:-/var/tmp/minicri-bench-unpack}
REPO=$(cd "$(dirname "$0")/.." && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$REPO/target}
LAYERS=(
  "usr/bin usr/sbin usr/libexec"
  "usr/share"
  "usr/include usr/lib/python3 usr/lib/python3.11"
  "usr/lib/x86_64-linux-gnu"
)

LAYER_DIR=${LAYER_DIR:-$WORK/layers}
mkdir -p "$LAYER_DIR"
specs=()
for i in "${!LAYERS[@]}"; do
  layer="$LAYER_DIR/layer$i.tar.gz"
  if [ ! -s "$layer" ]; then
    # shellcheck disable=SC2086
    tar -C / --numeric-owner -cf - ${LAYERS[$i]} 2>/dev/null | gzip -6 > "$layer.part" || true
    mv "$layer.part" "$layer"
  fi
  diff_id="sha256:$(gzip -dc "$layer" | sha256sum | cut -d' ' -f1)"
  specs+=("$layer=$diff_id")
done

files=0
for i in "${!LAYERS[@]}"; do
  n=$(gzip -dc "$LAYER_DIR/layer$i.tar.gz" | tar -tf - | wc -l)
  files=$((files + n))
done
echo "layers: ${#LAYERS[@]}, entries: $files, compressed: $(du -cb "$LAYER_DIR"/*.tar.gz | tail -1 | cut -f1) bytes," \
  "uncompressed: $(for f in "$LAYER_DIR"/*.tar.gz; do gzip -dc "$f" | wc -c; done | paste -sd+ | bc) bytes"

cargo build --release -q -p minicri-snapshotter --example bench-unpack
BIN="$CARGO_TARGET_DIR/release/examples/bench-unpack"

fresh() {
  rm -rf "$WORK/out"
  mkdir -p "$WORK/out"
  cat "$LAYER_DIR"/*.tar.gz > /dev/null
  sync
  echo 3 > /proc/sys/vm/drop_caches
  cat "$LAYER_DIR"/*.tar.gz > /dev/null
}

for run in $(seq "${RUNS:-3}"); do
  echo "== run $run"
  fresh
  TIMEFORMAT="tar -xzf: %R s, cpu user %U s sys %S s"
  time (
    for i in "${!LAYERS[@]}"; do
      mkdir -p "$WORK/out/$i"
      tar --numeric-owner --xattrs --xattrs-include='*' -xpzf "$LAYER_DIR/layer$i.tar.gz" -C "$WORK/out/$i"
    done
  )
  fresh
  "$BIN" overlay "$WORK/out/overlay" "${specs[@]}"
  fresh
  "$BIN" copy "$WORK/out/copy" "${specs[@]}"
done
rm -rf "$WORK/out"

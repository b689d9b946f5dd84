#!/usr/bin/env bash
# bench-pull.sh - cold-pull throughput of minicri (download, verify, unpack into overlay snapshots)
# for a 1 GiB single-layer image and an 8 x 128 MiB image from a local registry, with the daemon's
# peak RSS; when containerd is installed, the same images through containerd (`ctr images pull`,
# which also unpacks) in the same run, and the ratio.
#
# Usage (root): hack/bench-pull.sh [WORKDIR]      (default /var/tmp/minicri-bench-pull)
# Layers are random bytes, gzip-compressed by the test-image builder. Each pull starts from an
# empty root (cold: nothing cached but the registry's files in the page cache).
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-/var/tmp/minicri-bench-pull}
port=5099
reg=127.0.0.1:$port

cargo build -q --release -p minicri -p minicri-tests --bins
bin=target/release
rm -rf "$work" && mkdir -p "$work"
hack/start-registry.sh --port "$port" --dir "$work/registry" >/dev/null
trap 'hack/stop-registry.sh --dir "$work/registry" >/dev/null 2>&1 || true; pkill -f "minicri serve --root $work" || true; [ -n "${ctrd_pid:-}" ] && kill "$ctrd_pid" 2>/dev/null || true' EXIT

"$bin/minicri-testimg" push-big --registry "$reg" --name bench/one:1g --layers 1 --layer-mib 1024 --seed 11 >/dev/null
"$bin/minicri-testimg" push-big --registry "$reg" --name bench/eight:128m --layers 8 --layer-mib 128 --seed 21 >/dev/null

size_of() { # compressed bytes of an image's layers, from the registry
    local m; m=$(curl -fsS -H 'Accept: application/vnd.oci.image.manifest.v1+json' "http://$reg/v2/$1/manifests/$2")
    echo "$m" | jq '[.layers[].size] | add'
}

minicri_pull() { # image -> "seconds peak_rss_kib"
    local root="$work/minicri-root" sock="$work/minicri.sock"
    rm -rf "$root"
    "$bin/minicri" serve --root "$root" --state "$work/minicri-state" --socket "$sock" \
        --registry-config-dir "$work/none" --log-level warn 2>>"$work/minicri.log" &
    local pid=$!
    for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.05; done
    local secs; secs=$("$bin/minicri-testimg" pull --socket "$sock" "$1" | cut -f2)
    local rss; rss=$(awk '/VmHWM/ {print $2}' "/proc/$pid/status")
    kill "$pid"; wait "$pid" 2>/dev/null || true
    echo "$secs $rss"
}

containerd_pull() { # image -> seconds, through a private containerd
    local root="$work/ctrd"
    rm -rf "$root"; mkdir -p "$root"
    cat > "$root/config.toml" <<TOML
version = 2
root = "$root/root"
state = "$root/state"
[grpc]
  address = "$root/containerd.sock"
TOML
    containerd --config "$root/config.toml" >"$root/log" 2>&1 &
    ctrd_pid=$!
    for _ in $(seq 100); do [ -S "$root/containerd.sock" ] && break; sleep 0.05; done
    local start end
    start=$(date +%s.%N)
    ctr -a "$root/containerd.sock" images pull --plain-http "$1" >/dev/null
    end=$(date +%s.%N)
    kill "$ctrd_pid"; wait "$ctrd_pid" 2>/dev/null || true; ctrd_pid=
    printf '%.3f\n' "$(echo "$end - $start" | bc)"
}

printf '%-22s %10s %10s %9s %12s %12s %8s\n' image MB minicri_s MB/s peak_rss_MiB containerd_s ratio
for img in bench/one:1g bench/eight:128m; do
    repo=${img%%:*}; tag=${img##*:}
    bytes=$(size_of "$repo" "$tag")
    read -r secs rss < <(minicri_pull "$reg/$img")
    mbs=$(echo "scale=1; $bytes / 1000000 / $secs" | bc)
    ctrd="-"; ratio="-"
    if command -v containerd >/dev/null && command -v ctr >/dev/null; then
        ctrd=$(containerd_pull "$reg/$img")
        ratio=$(echo "scale=2; $ctrd / $secs" | bc)
    fi
    printf '%-22s %10.0f %10s %9s %12d %12s %8s\n' "$img" "$(echo "$bytes / 1000000" | bc)" "$secs" "$mbs" $((rss / 1024)) "$ctrd" "$ratio"
done
echo "load average during the run: $(cut -d' ' -f1-3 /proc/loadavg)"

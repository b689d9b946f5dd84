#!/usr/bin/env bash
# fleet-origin.sh - what one node's cold pull through a pull-through cache costs the origin:
# minicri against containerd 1.6 (Debian's, its CRI plugin set up as on a node), in one run,
# runtimes alternating, each pull with a fresh cache and a fresh runtime root.
#
# Usage (root): hack/fleet-origin.sh [--runs N] [--work DIR] [--cache-bin PATH]
#   --runs N         pulls per runtime (default 3)
#   --work DIR       scratch space (default /var/tmp/minicri-fleet-origin)
#   --cache-bin PATH the cache's registry binary (default Debian's docker-registry, 2.8); a
#                    build of distribution 3.x shows a cache that stores what it serves
#
# The origin is the project's registry (hack/start-registry.sh) on 127.0.0.1:5098 holding an
# image of 2 x 16 MiB incompressible layers; the cache is Debian's docker-registry in proxy mode
# on 127.0.0.1:5097, started empty for each pull; the node reaches the origin's name
# `origin.example` through hosts.toml with the cache as its mirror (the same directory for both
# runtimes). The pull is one CRI PullImage (minicri-testimg pull). Once the cache has stored
# every blob (it stores in the background after serving), the origin's blob bytes are summed
# from its access log (`http.response.written` of blob GETs) and printed as a multiple of the
# image's blob bytes, with a plain `curl` of each blob through a fresh cache as the floor no
# client can go under.
set -euo pipefail
cd "$(dirname "$0")/.."

runs=3
work=/var/tmp/minicri-fleet-origin
cache_bin=()
while [ $# -gt 0 ]; do
    case $1 in
        --runs) runs=$2; shift 2;;
        --work) work=$2; shift 2;;
        --cache-bin) cache_bin=(--bin "$2"); shift 2;;
        -h|--help) awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; exit 0;;
        *) echo "fleet-origin: unknown argument $1" >&2; exit 2;;
    esac
done
[ "$(id -u)" = 0 ] || { echo "fleet-origin: run as root" >&2; exit 1; }

hack/install-deps.sh >/dev/null
if ! command -v containerd >/dev/null; then
    echo "fleet-origin: installing Debian's containerd (the baseline)" >&2
    apt-get install -y -qq containerd >/dev/null
fi
cargo build -q --release -p minicri -p minicri-tests --bins
bin=$PWD/target/release

origin=127.0.0.1:5098
cache=127.0.0.1:5097
image=fleet/origin:1
rm -rf "$work" && mkdir -p "$work"
daemon_pid=
cleanup() {
    [ -n "$daemon_pid" ] && kill -9 "$daemon_pid" 2>/dev/null || true
    hack/stop-registry.sh --dir "$work/cache" >/dev/null 2>&1 || true
    hack/stop-registry.sh --dir "$work/origin" >/dev/null 2>&1 || true
}
trap cleanup EXIT

hack/start-registry.sh --port "${origin#*:}" --dir "$work/origin" >/dev/null
"$bin/minicri-testimg" push-big --registry "$origin" --name "$image" --layers 2 --layer-mib 16 \
    --seed 41 >/dev/null
manifest=$(curl -fsS -H 'Accept: application/vnd.oci.image.manifest.v1+json' \
    "http://$origin/v2/${image%%:*}/manifests/${image##*:}")
blobs=$(echo "$manifest" | jq -r '.config.digest, .layers[].digest')
image_bytes=$(echo "$manifest" | jq '.config.size + ([.layers[].size] | add)')

certs=$work/certs.d
mkdir -p "$certs/origin.example"
printf 'server = "http://%s"\n\n[host."http://%s"]\n  capabilities = ["pull", "resolve"]\n' \
    "$origin" "$cache" > "$certs/origin.example/hosts.toml"

start_cache() { # a fresh, empty pull-through cache of the origin
    rm -rf "$work/cache"
    hack/start-registry.sh --port "${cache#*:}" --dir "$work/cache" --proxy-remote "http://$origin" \
        "${cache_bin[@]}" >/dev/null
}

stop_cache() {
    hack/stop-registry.sh --dir "$work/cache" >/dev/null
}

wait_cached() { # until the cache holds every blob of the image
    local d hex
    for _ in $(seq 600); do
        local missing=0
        for d in $blobs; do
            hex=${d#sha256:}
            [ -s "$work/cache/storage/docker/registry/v2/blobs/sha256/${hex:0:2}/$hex/data" ] || missing=1
        done
        [ $missing = 0 ] && return 0
        sleep 0.05
    done
    echo "fleet-origin: the cache never stored the image" >&2; exit 1
}

origin_bytes() { # blob bytes the origin has written so far
    grep 'response completed' "$work/origin/registry.log" | grep 'http.request.method=GET' |
        grep -o 'http.request.uri="[^"]*/blobs/[^"]*".*http.response.written=[0-9]*' |
        sed 's/.*http.response.written=//' | awk '{s += $1} END {print s + 0}'
}

prog=fleet-origin
# shellcheck source=hack/lib/pull-runtimes.sh
source hack/lib/pull-runtimes.sh

one_pull() { # runtime -> origin bytes as a multiple of the image
    local rt=$1 before after
    start_cache
    before=$(origin_bytes)
    if [ "$rt" = curl ]; then
        for d in $blobs; do
            curl -fsS -o /dev/null "http://$cache/v2/${image%%:*}/blobs/$d"
        done
    else
        start_daemon "$rt" "$work/daemon-$rt"
        "$bin/minicri-testimg" pull --socket "$sock" "origin.example/$image" >/dev/null
        stop_daemon "$work/daemon-$rt"
    fi
    wait_cached
    sleep 1 # the origin's log line of the cache's storing fetch
    after=$(origin_bytes)
    stop_cache
    echo "scale=2; ($after - $before) / $image_bytes" | bc
}

median() { sort -g | awk '{a[NR]=$1} END {if (NR % 2) print a[(NR+1)/2]; else printf "%.2f\n", (a[NR/2]+a[NR/2+1])/2}'; }

echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "containerd: $(containerd --version)"
echo "cache: $("${cache_bin[1]:-/usr/bin/docker-registry}" --version)"
echo "image: $image_bytes bytes of blobs"
printf '%-10s %4s %s\n' runtime run "origin bytes / image"
declare -A results
for i in $(seq "$runs"); do
    order="minicri containerd curl"
    [ $((i % 2)) = 0 ] && order="containerd minicri curl"
    for rt in $order; do
        x=$(one_pull "$rt")
        results[$rt]="${results[$rt]:-} $x"
        printf '%-10s %4s %s\n' "$rt" "$i" "$x"
    done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo
echo "medians of $runs cold pulls through a fresh cache (origin blob bytes / image blob bytes):"
for rt in minicri containerd curl; do
    printf '%-10s %s\n' "$rt" "$(tr ' ' '\n' <<<"${results[$rt]}" | grep . | median)"
done

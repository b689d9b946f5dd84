#!/usr/bin/env bash
# bench-cri.sh - critest's CRI benchmarks (critest -benchmark) against minicri and containerd 1.6
# (Debian's) and, when given one, containerd 2.x, each with its CRI plugin set up as on a node, in
# one run, runtimes alternating; medians of every operation over all runs.
#
# Usage (root): hack/bench-cri.sh [--critest PATH] [--runs N] [--containerd2 PATH] [--pods N]
#                                 [--parallel N] [--images N] [--work DIR]
#   --critest PATH     critest from cri-tools (default: critest on PATH; it is not packaged by
#                      Debian: build it from cri-tools' sources, which vendor their dependencies)
#   --runs N           critest runs per runtime (default 3)
#   --containerd2 PATH a containerd 2.x binary; its containerd-shim-runc-v2 must sit beside it
#                      (default: $CONTAINERD2, else its column is skipped with a note)
#   --pods N           pod and container lifecycles per run (default 20)
#   --parallel N       of them at once (default 2)
#   --images N         image pull/status/remove lifecycles per run (default 10), one at a time
#                      (critest's samples pull and remove the same image: at once, one sample's
#                      RemoveImage races another's PullImage, and containerd 1.6 fails the pull)
#   --work DIR         scratch space (default /var/tmp/minicri-bench-cri)
#
# Each run starts the daemon afresh on an empty root on disk and an empty state directory on a
# tmpfs (a node's /run, where both keep their state by default, is one). The images are the
# project's own (pushed to the project's registry on 127.0.0.1:5098); containerd's sandbox image
# is busybox sleeping, as it has no infra process of its own. Pods get a CNI bridge (bridge,
# host-local, portmap, loopback) of their own per runtime. critest samples every operation of a
# lifecycle (pods: RunPodSandbox, PodSandboxStatus, StopPodSandbox, RemovePodSandbox; containers:
# CreateContainer, StartContainer, ContainerStatus, StopContainer, RemoveContainer; images:
# PullImage, ImageStatus, RemoveImage; ListImages); the medians (and 90th percentiles) over all
# samples of all runs are printed in milliseconds.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

critest=$(command -v critest || true)
runs=3
containerd2=${CONTAINERD2:-}
pods=20
parallel=2
nimages=10
work=/var/tmp/minicri-bench-cri
while [ $# -gt 0 ]; do
    case $1 in
        --critest) critest=$2; shift 2;;
        --runs) runs=$2; shift 2;;
        --containerd2) containerd2=$2; shift 2;;
        --pods) pods=$2; shift 2;;
        --parallel) parallel=$2; shift 2;;
        --images) nimages=$2; shift 2;;
        --work) work=$2; shift 2;;
        -h|--help) sed -n '2,28p' "$0"; exit 0;;
        *) echo "bench-cri: unknown argument $1" >&2; exit 2;;
    esac
done
[ "$(id -u)" = 0 ] || { echo "bench-cri: needs root (runs the daemons and pods)" >&2; exit 1; }
[ -n "$critest" ] && [ -x "$critest" ] || {
    echo "bench-cri: no critest (--critest PATH): build it from cri-tools (make critest)" >&2; exit 1; }
# runc, the CNI plugins, the registry and the tools the script uses (idempotent), and containerd.
hack/install-deps.sh >/dev/null
command -v containerd >/dev/null || { echo "bench-cri: installing containerd" >&2; apt-get install -y -qq containerd >/dev/null; }
cargo build -q --release -p minicri -p minicri-tests --bins

port=5098
reg=127.0.0.1:$port
bin=$repo/target/release
mkdir -p "$work"
umount -l "$work/run/state" 2>/dev/null || true
rm -rf "$work/run" && mkdir -p "$work/run"
run=$work/run
daemon_pid=
cleanup() {
    [ -n "$daemon_pid" ] && kill -9 "$daemon_pid" 2>/dev/null || true
    hack/stop-registry.sh --dir "$work/registry" >/dev/null 2>&1 || true
    umount -l "$run/state" 2>/dev/null || true
}
trap cleanup EXIT
# The daemons' state directories, as a node's /run: a tmpfs.
mkdir -p "$run/state" && mount -t tmpfs -o mode=0755 minicri-bench-state "$run/state"

hack/start-registry.sh --port "$port" --dir "$work/registry" >/dev/null
"$bin/minicri-testimg" push-standard --registry "$reg" >/dev/null
sandbox_image=$reg/minicri-test/sleeper:latest
"$bin/minicri-testimg" push-sleeper --registry "$reg" --name "${sandbox_image#"$reg"/}" >/dev/null
busybox=$reg/minicri-test/busybox:oci

certs=$run/certs.d
mkdir -p "$certs/$reg"
printf 'server = "http://%s"\n\n[host."http://%s"]\n  capabilities = ["pull", "resolve"]\n' "$reg" "$reg" > "$certs/$reg/hosts.toml"

cat > "$run/images.yaml" <<YAML
defaultTestContainerImage: $busybox
webServerTestImage: $busybox
YAML
cat > "$run/params.yaml" <<YAML
containersNumber: $pods
containersNumberParallel: $parallel
podsNumber: $pods
podsNumberParallel: $parallel
imagesNumber: $nimages
imagesNumberParallel: 1
imagePullingBenchmarkImage: $reg/minicri-test/multi:latest
imageListingBenchmarkImages:
  - $busybox
  - $reg/minicri-test/multi:latest
  - $reg/minicri-test/plain:latest
YAML

runtimes="minicri containerd"
if [ -n "$containerd2" ]; then
    runtimes="$runtimes containerd2"
else
    echo "note: no containerd 2.x given (--containerd2 PATH or \$CONTAINERD2): its column is skipped" | tee "$run/notes"
fi

cni_conf() { # runtime dir subnet-octet -> a conflist of the runtime's own
    mkdir -p "$2"
    cat > "$2/10-bench.conflist" <<JSON
{ "cniVersion": "1.0.0", "name": "bench-$1",
  "plugins": [
    { "type": "bridge", "bridge": "bench$3", "isGateway": true, "ipMasq": true,
      "ipam": { "type": "host-local", "ranges": [[{ "subnet": "10.$3.0.0/16" }]],
                "routes": [{ "dst": "0.0.0.0/0" }] } },
    { "type": "portmap", "capabilities": { "portMappings": true } },
    { "type": "loopback" } ] }
JSON
}

# shellcheck source=hack/lib/containerd-config.sh
source hack/lib/containerd-config.sh

start_daemon() { # runtime root -> sets daemon_pid and sock
    local rt=$1 root=$2 state=$run/state/$1
    rm -rf "$root" "$state" && mkdir -p "$root" "$state"
    sock=$root/cri.sock
    case $rt in
        minicri)
            cni_conf "$rt" "$root/net.d" 77
            "$bin/minicri" serve --root "$root/root" --state "$state" --socket "$sock" \
                --registry-config-dir "$certs" --cni-conf-dir "$root/net.d" --log-level warn >"$root/log" 2>&1 &
            ;;
        containerd|containerd2)
            local exe=containerd path=$PATH
            if [ "$rt" = containerd2 ]; then exe=$containerd2; path=$(dirname "$containerd2"):$PATH; fi
            cni_conf "$rt" "$root/net.d" 78
            containerd_config "$rt" "$root/root" "$state" "$sock" "$root/net.d" > "$root/config.toml"
            PATH=$path "$exe" --config "$root/config.toml" >"$root/log" 2>&1 &
            ;;
    esac
    daemon_pid=$!
    for _ in $(seq 400); do [ -S "$sock" ] && return 0; sleep 0.05; done
    echo "bench-cri: $rt did not open $sock; its log:" >&2; tail -20 "$root/log" >&2; exit 1
}

stop_daemon() { # runtime root
    local state=$run/state/$1 root=$2
    kill "$daemon_pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$daemon_pid" 2>/dev/null || break; sleep 0.05; done
    kill -9 "$daemon_pid" 2>/dev/null || true
    wait "$daemon_pid" 2>/dev/null || true
    daemon_pid=
    # containerd leaves its shims (and their pods, if any survived) behind a stop.
    pkill -9 -f "containerd-shim-runc-v2 -namespace k8s.io -address $root/" 2>/dev/null || true
    for d in "$root" "$state"; do
        awk -v r="$d/" '$2 ~ "^"r {print $2}' /proc/self/mounts | sort -r | xargs -r -n1 umount -l
        rm -rf "$d"
    done
}

bench_once() { # runtime run -> results in $run/$rt-$r/
    local rt=$1 r=$2 root=$work/daemon-$1 out=$run/$1-$2
    mkdir -p "$out"
    start_daemon "$rt" "$root"
    # The sandbox image is pulled ahead, as a node has it before its first pod.
    "$bin/minicri-testimg" pull --socket "$sock" "$sandbox_image" >/dev/null
    if ! "$critest" -benchmark --runtime-endpoint "unix://$sock" --image-endpoint "unix://$sock" \
        --benchmarking-params-file "$run/params.yaml" --test-images-file "$run/images.yaml" \
        --benchmarking-output-dir "$out" >"$out/critest.log" 2>&1; then
        echo "bench-cri: critest failed against $rt (run $r); the end of its output:" >&2
        tail -30 "$out/critest.log" >&2
        stop_daemon "$rt" "$root"; exit 1
    fi
    stop_daemon "$rt" "$root"
}

echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$run/load"
echo "containerd: $(containerd --version)"
[ -n "$containerd2" ] && echo "containerd2: $("$containerd2" --version)"
for r in $(seq "$runs"); do
    order=$runtimes
    [ $((r % 2)) = 0 ] && order=$(echo "$runtimes" | tr ' ' '\n' | tac | tr '\n' ' ')
    for rt in $order; do
        echo "run $r: $rt"
        bench_once "$rt" "$r"
    done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$run/load"

# One line per operation and runtime: the median (and the 90th percentile) of every sample of
# every run, in milliseconds.
samples() { # runtime file operation -> durations in ms, one per line
    for r in $(seq "$runs"); do
        local f=$run/$1-$r/$2
        [ -e "$f" ] || continue
        jq -r --arg op "$3" '(.operationsNames | index($op)) as $i
            | .datapoints[] | .operationsDurationsNs[$i] / 1e6' "$f"
    done
}
quantile() { sort -g | awk -v q="$1" '{a[NR]=$1} END {if (NR == 0) {print "-"; exit}
    i = q * (NR - 1) + 1; lo = int(i); hi = (lo < NR) ? lo + 1 : lo
    printf "%.1f\n", a[lo] + (i - lo) * (a[hi] - a[lo])}'; }
echo
echo "critest -benchmark: $pods pods / containers ($parallel at once), $nimages images (one at a time), $runs runs per runtime"
printf '%-18s' operation; for rt in $runtimes; do printf ' %13s %7s' "$rt p50" "p90"; done; echo
for pair in pod_benchmark_data.json:RunPodSandbox=CreatePod pod_benchmark_data.json:PodSandboxStatus=StatusPod \
    pod_benchmark_data.json:StopPodSandbox=StopPod pod_benchmark_data.json:RemovePodSandbox=RemovePod \
    container_benchmark_data.json:CreateContainer=CreateContainer container_benchmark_data.json:StartContainer=StartContainer \
    container_benchmark_data.json:ContainerStatus=StatusContainer container_benchmark_data.json:StopContainer=StopContainer \
    container_benchmark_data.json:RemoveContainer=RemoveContainer image_lifecycle_benchmark_data.json:PullImage=PullImage \
    image_lifecycle_benchmark_data.json:ImageStatus=StatusImage image_lifecycle_benchmark_data.json:RemoveImage=RemoveImage \
    image_listing_benchmark_data.json:ListImages=ListImages; do
    file=${pair%%:*} rest=${pair#*:}
    name=${rest%%=*} op=${rest#*=}
    printf '%-18s' "$name"
    for rt in $runtimes; do
        printf ' %13s %7s' "$(samples "$rt" "$file" "$op" | quantile 0.5)" "$(samples "$rt" "$file" "$op" | quantile 0.9)"
    done
    echo
done | tee "$run/medians"

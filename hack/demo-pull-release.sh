#!/usr/bin/env bash
# demo-pull-release.sh - shows, on this machine, what minicri does for a pod deleted while its
# image downloads (docs/kubelet-release.md). It starts
#   - the tests' registry (Debian's docker-registry, `minicri-testimg registry`) holding a 2 GiB
#     image of incompressible bytes, behind the tests' proxy limiting the link to 40 MiB/s
#     (`minicri-testimg proxy`, which also counts the blob bytes that cross it);
#   - the tests' API server and kubelet simulator (`minicri-kubesim demo`);
#   - minicri, watching that API server as node-1 (default detach window; pull.image_fs_reserve off,
#     see below);
# then runs pod demo/big-1 with the image, deletes it 15 s into its pull, and runs demo/big-2
# with the same image. It prints the pods' events as `kubectl describe pod` lists them, how long
# the deletion took to be acted on, and the bytes that crossed the network for each pod.
#
# Run as root on a machine set up by hack/install-deps.sh (the pods' sandboxes run on runc).
# Takes about two minutes after the build. DEMO_MIB (2048), DEMO_RATE_MIB (40) and
# DEMO_DELETE_AFTER (15) change the image size, the link rate and when the first pod is deleted.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ $EUID -ne 0 ]]; then
    echo "demo-pull-release.sh: run as root (the pods' sandboxes run on runc)" >&2
    exit 1
fi
mib="${DEMO_MIB:-2048}"
rate="${DEMO_RATE_MIB:-40}"
delete_after="${DEMO_DELETE_AFTER:-15}"

cargo build --quiet --workspace --bins
bin="${CARGO_TARGET_DIR:-target}/debug"
work="$(mktemp -d /tmp/minicri-demo.XXXXXX)"
pids=()
cleanup() {
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    # An interrupted demo leaves its pods' sandboxes: their monitors outlive minicri by design.
    if [[ -d "$work/state/runc" ]]; then
        for id in $(runc --root "$work/state/runc" list -q 2>/dev/null); do
            runc --root "$work/state/runc" delete --force "$id" >/dev/null 2>&1 || true
        done
    fi
    # ...and the monitors (minicri shim) of those sandboxes, found by their bundle under $work.
    local proc args
    for proc in /proc/[0-9]*; do
        mapfile -d '' -t args <"$proc/cmdline" 2>/dev/null || continue
        if [[ "${args[*]}" == *"--bundle $work/"* ]]; then
            kill -KILL "${proc#/proc/}" 2>/dev/null || true
        fi
    done
    # Whatever minicri left mounted under the demo's directories (its netns directory).
    grep -o " $work[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

# Waits until FILE has a first line and prints it.
first_line() {
    local file="$1" i
    for ((i = 0; i < 600; i++)); do
        if [[ -s "$file" ]]; then
            head -n1 "$file"
            return
        fi
        sleep 0.1
    done
    echo "demo-pull-release.sh: nothing in $file after 60 s" >&2
    exit 1
}

"$bin/minicri-testimg" registry >"$work/registry.out" 2>"$work/registry.err" &
pids+=($!)
registry="$(first_line "$work/registry.out")"
echo "registry $registry; pushing a ${mib} MiB image"
"$bin/minicri-testimg" push-big --registry "$registry" --name demo/big:1 --layers 1 \
    --layer-mib "$mib" --compression none --seed 42 >"$work/push.out"

"$bin/minicri-testimg" proxy --upstream "$registry" --rate-mib 1024 --link-rate-mib "$rate" \
    --stats "$work/proxy.stats" >"$work/proxy.out" 2>"$work/proxy.err" &
pids+=($!)
proxy="$(first_line "$work/proxy.out")"
first_line "$work/proxy.stats" >/dev/null
echo "proxy $proxy: ${rate} MiB/s for all blob bytes together"

"$bin/minicri-kubesim" demo --kubeconfig "$work/kubelet.conf" --socket "$work/minicri.sock" \
    --image "$proxy/demo/big:1" --proxy-stats "$work/proxy.stats" --node node-1 \
    --delete-after "$delete_after" >"$work/demo.out" 2>"$work/demo.err" &
demo=$!
pids+=("$demo")
first_line "$work/kubelet.conf" >/dev/null

mkdir -p "$work/cni"
# pull.image_fs_reserve is off: the demo's root is on this machine's disk, whose free space (shared with
# whatever else runs here) has nothing to do with the demo; the reserve would refuse the pull when
# it is under 15%.
"$bin/minicri" serve --socket "$work/minicri.sock" --root "$work/root" --state "$work/state" \
    --registry-config-dir "$work/certs.d" --cni-conf-dir "$work/cni" --image-fs-reserve 0 \
    --kube-watch-kubeconfig "$work/kubelet.conf" --kube-watch-node-name node-1 \
    >"$work/minicri.log" 2>&1 &
pids+=($!)
echo "minicri serving $work/minicri.sock, watching the API server as node-1"
echo

if ! wait "$demo"; then
    cat "$work/demo.out" "$work/demo.err" >&2
    echo "--- minicri's log:" >&2
    tail -n 50 "$work/minicri.log" >&2
    exit 1
fi
cat "$work/demo.out"
echo
echo "minicri's log about it:"
grep -E "pod deletion seen|pod deleted: its pulls|held past its window|PullImage detached|last requester gone|pull job finished" \
    "$work/minicri.log" | sed -E 's/^[0-9T:.-]+Z +//' | cut -c1-220

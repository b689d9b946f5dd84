#!/usr/bin/env bash
# bench-pull.sh - cold image pulls through the CRI, as a kubelet pulls: minicri against containerd
# 1.6 (Debian's) and, when given one, containerd 2.x, each with its CRI plugin set up as on a node
# (overlayfs snapshotter, hosts.toml for the registry), in one run, runtimes alternating.
#
# Usage (root): hack/bench-pull.sh [--runs N] [--containerd2 PATH] [--igzip] [--multipart BYTES]
#                                  [--images LIST] [--work DIR]
#   --runs N           runs per image and runtime (default 3); medians are reported
#   --containerd2 PATH a containerd 2.x binary (default: $CONTAINERD2, else skipped with a note)
#   --igzip            also run that containerd 2.x with `igzip` on PATH (runtime
#                      `containerd2igzip`; installs Debian's isal): the other containerd runtimes
#                      decompress in Go, as Debian's packages install them (no igzip, no pigz)
#   --multipart BYTES  also run that containerd 2.x with its multipart fetch on (runtime
#                      `containerd2mp`: transfer service `concurrent_layer_fetch_buffer = BYTES`
#                      and `max_concurrent_downloads = 6`, the connections minicri uses per blob)
#   --images LIST      any of: one eight usr capped (default: all four)
#   --runtimes LIST    any of: minicri containerd floor containerd2 containerd2igzip containerd2mp
#                      (default: the first three, and the containerd 2.x ones asked for)
#   --minicri-args ARGS  extra flags for `minicri serve` (word-split), to measure a setting, e.g.
#                      "--blob-connections 6"; printed with the results
#   --work DIR         scratch space (default /var/tmp/minicri-bench-pull); the generated layers
#                      of the realistic image are kept in DIR/layers between runs
#
# Images, pushed to the project's own registry (hack/start-registry.sh) on 127.0.0.1:5099:
#   one     1 GiB single layer of random bytes (incompressible), gzip
#   eight   8 x 128 MiB layers of random bytes, gzip
#   usr     realistic: four gzip layers made with GNU tar from this machine's /usr (hard links and
#           symlinks as they are) plus a fifth that deletes files of the others (whiteouts) and
#           replaces a directory (opaque), on the busybox base
#   capped  `one` through a proxy that caps each blob response at 25 MB/s (object stores and
#           CDNs cap single streams)
# Every pull is cold: a fresh root and state for the runtime (nothing of the image cached),
# `sync` and the page cache dropped, the daemon started afresh. The pull is one CRI PullImage
# (minicri-testimg pull, the project's CRI client), timed by the client; the daemon's CPU seconds
# (user + system, its waited-for children included) and peak RSS (VmHWM) are read from /proc.
# Containerd pulls in its own process through its CRI plugin, unpacking into overlayfs snapshots
# (configured by hack/lib/containerd-config.sh: version 2 for 1.6, version 3 for 2.x).
# The floor: the same work with no runtime in between, on the same run: for every layer at once,
# curl fetches the blob from the same registry, sha256sum hashes it, gzip decompresses it,
# sha256sum hashes the diff and GNU tar writes the files, then one `sync -f` (syncfs) per layer,
# the durability minicri promises; the digests and diff_ids are checked afterwards.
# Output: one line per pull, then the medians (minicri's time as a ratio to the floor's), each
# runtime's configuration, and the load average before and after.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

runs=3
containerd2=${CONTAINERD2:-}
multipart=
igzip=
minicri_args=
images="one eight usr capped"
only_runtimes=
work=/var/tmp/minicri-bench-pull
while [ $# -gt 0 ]; do
    case $1 in
        --runs) runs=$2; shift 2;;
        --containerd2) containerd2=$2; shift 2;;
        --multipart) multipart=$2; shift 2;;
        --igzip) igzip=1; shift;;
        --images) images=$2; shift 2;;
        --runtimes) only_runtimes=$2; shift 2;;
        --minicri-args) minicri_args=$2; shift 2;;
        --work) work=$2; shift 2;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0;;
        *) echo "bench-pull: unknown argument $1" >&2; exit 2;;
    esac
done
[ "$(id -u)" = 0 ] || { echo "bench-pull: needs root (drops the page cache, runs the daemons)" >&2; exit 1; }

port=5099
reg=127.0.0.1:$port
bin=$repo/target/release
# The registry, runc and the tools the script uses (idempotent; installs only what is missing).
hack/install-deps.sh >/dev/null
if ! command -v containerd >/dev/null; then
    echo "bench-pull: installing Debian's containerd (the baseline)" >&2
    apt-get install -y -qq containerd >/dev/null
fi
if [ -n "$igzip" ] && ! command -v igzip >/dev/null; then
    echo "bench-pull: installing Debian's isal (igzip, for containerd2igzip)" >&2
    apt-get install -y -qq isal >/dev/null
fi
cargo build -q --release -p minicri -p minicri-tests --bins

mkdir -p "$work"
rm -rf "$work/run" && mkdir -p "$work/run"
run=$work/run
log=$run/pulls.log
proxy_pid=
daemon_pid=
cleanup() {
    [ -n "$daemon_pid" ] && kill -9 "$daemon_pid" 2>/dev/null || true
    [ -n "$proxy_pid" ] && kill "$proxy_pid" 2>/dev/null || true
    hack/stop-registry.sh --dir "$work/registry" >/dev/null 2>&1 || true
}
trap cleanup EXIT

hack/start-registry.sh --port "$port" --dir "$work/registry" >/dev/null

# --- images -------------------------------------------------------------------------------------
push_usr() {
    local dir=$work/layers
    mkdir -p "$dir"
    local sets=("usr/bin usr/sbin usr/libexec" "usr/share" "usr/include usr/lib/python3 usr/lib/python3.11"
        "usr/lib/x86_64-linux-gnu")
    local files=()
    for i in "${!sets[@]}"; do
        local f=$dir/layer$i.tar.gz
        if [ ! -s "$f" ]; then
            # shellcheck disable=SC2086
            tar -C / --numeric-owner -cf - ${sets[$i]} 2>/dev/null | gzip -6 > "$f.part" || true
            mv "$f.part" "$f"
        fi
        files+=("$f")
    done
    # The fifth layer: whiteouts of a file and a directory of the layers below, and an opaque
    # directory that replaces one of theirs with a single file.
    local f=$dir/layer4.tar.gz
    if [ ! -s "$f" ]; then
        local stage=$dir/stage4
        rm -rf "$stage" && mkdir -p "$stage/usr/bin" "$stage/usr/share/doc" "$stage/usr/include"
        : > "$stage/usr/bin/.wh.$(ls /usr/bin | head -1)"
        : > "$stage/usr/share/.wh.man"
        : > "$stage/usr/include/.wh..wh..opq"
        echo "the opaque layer's own header" > "$stage/usr/include/only.h"
        tar -C "$stage" --numeric-owner -cf - usr | gzip -6 > "$f"
        rm -rf "$stage"
    fi
    files+=("$f")
    "$bin/minicri-testimg" push-files --registry "$reg" --name bench/usr:1 "${files[@]}" >/dev/null
}

# Only what is not in the registry yet (a registry directory kept from an earlier run has them).
have() { curl -fs -o /dev/null -H 'Accept: application/vnd.oci.image.manifest.v1+json' "http://$reg/v2/$1/manifests/$2"; }
have bench/one 1g || "$bin/minicri-testimg" push-big --registry "$reg" --name bench/one:1g --layers 1 --layer-mib 1024 --seed 11 >/dev/null
have bench/eight 128m || "$bin/minicri-testimg" push-big --registry "$reg" --name bench/eight:128m --layers 8 --layer-mib 128 --seed 21 >/dev/null
have bench/usr 1 || push_usr

# The capped view of the registry: 25 MB/s per blob response.
"$bin/minicri-testimg" proxy --upstream "$reg" --rate-mib 23.84 > "$run/proxy.addr" 2>"$run/proxy.log" &
proxy_pid=$!
for _ in $(seq 100); do [ -s "$run/proxy.addr" ] && break; sleep 0.05; done
capped=$(head -1 "$run/proxy.addr")

ref_of() { # image key -> reference
    case $1 in
        one) echo "$reg/bench/one:1g";;
        eight) echo "$reg/bench/eight:128m";;
        usr) echo "$reg/bench/usr:1";;
        capped) echo "$capped/bench/one:1g";;
    esac
}
bytes_of() { # image key -> compressed bytes of its layers
    local ref; ref=$(ref_of "$1"); ref=${ref#*/}
    curl -fsS -H 'Accept: application/vnd.oci.image.manifest.v1+json' "http://$reg/v2/${ref%%:*}/manifests/${ref##*:}" |
        jq '[.layers[].size] | add'
}

# hosts.toml as a node has them: plain HTTP for the local registry and the proxy.
certs=$run/certs.d
for h in "$reg" "$capped"; do
    mkdir -p "$certs/$h"
    printf 'server = "http://%s"\n\n[host."http://%s"]\n  capabilities = ["pull", "resolve"]\n' "$h" "$h" > "$certs/$h/hosts.toml"
done

# --- runtimes -----------------------------------------------------------------------------------
runtimes="minicri containerd floor"
if [ -n "$containerd2" ]; then
    runtimes="$runtimes containerd2"
    [ -n "$igzip" ] && runtimes="$runtimes containerd2igzip"
    [ -n "$multipart" ] && runtimes="$runtimes containerd2mp"
else
    echo "note: no containerd 2.x given (--containerd2 PATH or \$CONTAINERD2): its column is skipped" | tee "$run/notes"
fi
if [ -n "$only_runtimes" ]; then
    for rt in $only_runtimes; do
        case " $runtimes " in *" $rt "*) ;; *) echo "bench-pull: runtime $rt is not available (known: $runtimes)" >&2; exit 2;; esac
    done
    runtimes=$only_runtimes
fi

prog=bench-pull
# shellcheck source=hack/lib/pull-runtimes.sh
source hack/lib/pull-runtimes.sh

cpu_ticks() { # pid -> utime + stime + cutime + cstime, in clock ticks
    awk '{print $14 + $15 + $16 + $17}' "/proc/$1/stat"
}

# The floor's pipeline for every layer of image reference $1 at once, into $2.
floor_pull() {
    local ref=$1 dest=$2
    local host=${ref%%/*} path=${ref#*/}
    local name=${path%:*} tag=${path##*:}
    local accept='application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json'
    local manifest config
    manifest=$(curl -fsS -H "Accept: $accept" "http://$host/v2/$name/manifests/$tag")
    config=$(curl -fsS "http://$host/v2/$name/blobs/$(jq -r .config.digest <<<"$manifest")")
    local digests diffs
    mapfile -t digests < <(jq -r '.layers[].digest' <<<"$manifest")
    mapfile -t diffs < <(jq -r '.rootfs.diff_ids[]' <<<"$config")
    local pids=()
    for i in "${!digests[@]}"; do
        mkdir -p "$dest/$i"
        ( set -o pipefail
          curl -fsS "http://$host/v2/$name/blobs/${digests[$i]}" | tee >(sha256sum > "$dest/$i.blob") |
            gzip -dc | tee >(sha256sum > "$dest/$i.diff") | tar -x --numeric-owner -C "$dest/$i" -f - &&
            sync -f "$dest/$i" ) &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || { echo "floor: a layer's pipeline failed" >&2; return 1; }; done
    for i in "${!digests[@]}"; do
        for f in "$dest/$i.blob" "$dest/$i.diff"; do
            for _ in $(seq 500); do [ -s "$f" ] && break; sleep 0.01; done
        done
        [ "sha256:$(cut -d' ' -f1 "$dest/$i.blob")" = "${digests[$i]}" ] || { echo "floor: layer $i digest mismatch" >&2; return 1; }
        [ "sha256:$(cut -d' ' -f1 "$dest/$i.diff")" = "${diffs[$i]}" ] || { echo "floor: layer $i diff_id mismatch" >&2; return 1; }
    done
}
export -f floor_pull

floor_once() { # image -> "seconds cpu_seconds peak_rss_mib"
    local img=$1 root=$work/daemon-floor
    rm -rf "$root" && mkdir -p "$root"
    sync; echo 3 > /proc/sys/vm/drop_caches
    if ! /usr/bin/time -o "$root/time" -f '%e %U %S %M' bash -c 'floor_pull "$1" "$2"' floor "$(ref_of "$img")" "$root/fs" 2>"$root/err"; then
        echo "bench-pull: the floor failed for $img: $(cat "$root/err")" >&2; exit 1
    fi
    read -r secs user sys rss < "$root/time"
    rm -rf "$root"
    printf '%s %.2f %.1f\n' "$secs" "$(echo "$user + $sys" | bc -l)" "$(echo "$rss / 1024" | bc -l)"
}

pull_once() { # runtime image -> "seconds cpu_seconds peak_rss_mib"
    local rt=$1 img=$2 root=$work/daemon-$1
    if [ "$rt" = floor ]; then floor_once "$img"; return; fi
    start_daemon "$rt" "$root"
    # What the runtime ran with, printed with the results.
    if [ ! -e "$run/config-$rt" ]; then
        if [ "$rt" = minicri ]; then
            echo "minicri serve --registry-config-dir CERTS ${minicri_args:-} (embedded defaults otherwise)" > "$run/config-$rt"
        else
            { echo "# gzip decompression: $(containerd_decompressor "$rt")"
              sed "s#$root#ROOT#g; s#$certs#CERTS#g" "$root/config.toml"; } > "$run/config-$rt"
        fi
    fi
    sync; echo 3 > /proc/sys/vm/drop_caches
    local hz; hz=$(getconf CLK_TCK)
    local before; before=$(cpu_ticks "$daemon_pid")
    local out
    if ! out=$("$bin/minicri-testimg" pull --socket "$sock" "$(ref_of "$img")" 2>"$root/pull.err"); then
        echo "bench-pull: $rt failed to pull $img: $(cat "$root/pull.err")" >&2
        tail -20 "$root/log" >&2
        stop_daemon "$root"; exit 1
    fi
    local after; after=$(cpu_ticks "$daemon_pid")
    local rss; rss=$(awk '/VmHWM/ {print $2}' "/proc/$daemon_pid/status")
    stop_daemon "$root"
    printf '%s %.2f %.1f\n' "$(echo "$out" | cut -f2)" "$(echo "($after - $before) / $hz" | bc -l)" "$(echo "$rss / 1024" | bc -l)"
}

median() { sort -g | awk '{a[NR]=$1} END {if (NR % 2) print a[(NR+1)/2]; else printf "%.3f\n", (a[NR/2]+a[NR/2+1])/2}'; }

# --- the run ------------------------------------------------------------------------------------
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)" | tee "$run/load"
if [ -n "$minicri_args" ]; then echo "minicri serve flags added: $minicri_args" | tee -a "$run/load"; fi
echo "containerd: $(containerd --version)"
[ -n "$containerd2" ] && echo "containerd2: $("$containerd2" --version)"
printf '%-7s %-16s %3s %9s %8s %9s\n' image runtime run seconds cpu_s rss_MiB | tee "$log"
for img in $images; do
    for r in $(seq "$runs"); do
        # Alternate who goes first: run 1 minicri first, run 2 the others first, ...
        order=$runtimes
        [ $((r % 2)) = 0 ] && order=$(echo "$runtimes" | tr ' ' '\n' | tac | tr '\n' ' ')
        for rt in $order; do
            read -r secs cpu rss < <(pull_once "$rt" "$img")
            printf '%-7s %-16s %3d %9s %8s %9s\n' "$img" "$rt" "$r" "$secs" "$cpu" "$rss" | tee -a "$log"
        done
    done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$run/load"

echo
echo "medians of $runs cold pulls (MB/s: compressed bytes / seconds; x floor: seconds / the floor's)"
printf '%-7s %8s %-16s %9s %8s %8s %9s %8s\n' image MB runtime seconds MB/s cpu_s rss_MiB x_floor
for img in $images; do
    bytes=$(bytes_of "$img")
    sel() { awk -v i="$img" -v r="$1" -v c="$2" '$1 == i && $2 == r {print $c}' "$log"; }
    floor_s=$(sel floor 4 | median)
    for rt in $runtimes; do
        s=$(sel "$rt" 4 | median); c=$(sel "$rt" 5 | median); m=$(sel "$rt" 6 | median)
        xf=-
        case " $runtimes " in *" floor "*) xf=$(printf '%.2f' "$(echo "$s / $floor_s" | bc -l)");; esac
        printf '%-7s %8.0f %-16s %9.2f %8.1f %8.1f %9.1f %8s\n' "$img" "$(echo "$bytes / 1000000" | bc)" "$rt" "$s" \
            "$(echo "$bytes / 1000000 / $s" | bc -l)" "$c" "$m" "$xf"
    done
done
echo
for rt in $runtimes; do
    [ -e "$run/config-$rt" ] || continue
    echo "--- configuration of $rt (ROOT: its fresh root, CERTS: the hosts.toml directory) ---"
    cat "$run/config-$rt"
done

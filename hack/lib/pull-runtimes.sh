# shellcheck shell=bash
# pull-runtimes.sh - sourced by hack/bench-pull.sh and hack/fleet-origin.sh: starts and stops the
# runtimes they pull with, each set up as on a node for pulls: minicri with the hosts.toml
# directory; containerd (Debian's 1.6, or a 2.x binary) with its CRI plugin, the overlayfs
# snapshotter and the same directory as `config_path`.
#
# containerd's configuration comes from hack/lib/containerd-config.sh: version 2 for Debian's 1.6,
# version 3 for 2.x, each as a node configures it.
#
# Globals read: prog (the caller's name, for messages), bin (minicri's build directory), certs
# (the hosts.toml directory), and optionally minicri_args (extra `minicri serve` flags),
# containerd2 (a containerd 2.x binary, runtimes containerd2, containerd2mp and containerd2igzip) and
# multipart (containerd2mp's `concurrent_layer_fetch_buffer`). Sets daemon_pid and sock.
#
# Decompression: containerd pipes gzip layers through `igzip` or `unpigz` when one is on PATH,
# else decompresses in Go. Every containerd runtime here runs with CONTAINERD_DISABLE_IGZIP and
# CONTAINERD_DISABLE_PIGZ set (Go's gzip, as Debian's packages install containerd: neither tool
# is a dependency), except containerd2igzip: containerd 2.x with Debian's `igzip` (package isal),
# its fastest decompressor on this kind of machine.

# shellcheck source=hack/lib/containerd-config.sh
source "$(dirname "${BASH_SOURCE[0]}")/containerd-config.sh"

start_daemon() { # runtime root -> sets daemon_pid and sock
    local rt=$1 root=$2
    rm -rf "$root" && mkdir -p "$root"
    sock=$root/cri.sock
    case $rt in
        minicri)
            "$bin/minicri" serve --root "$root/root" --state "$root/state" --socket "$sock" \
                --registry-config-dir "$certs" --log-level warn ${minicri_args:-} >"$root/log" 2>&1 &
            ;;
        containerd|containerd2|containerd2mp|containerd2igzip)
            local exe=containerd
            [ "$rt" != containerd ] && exe=${containerd2:?}
            local decompress=(env CONTAINERD_DISABLE_IGZIP=1 CONTAINERD_DISABLE_PIGZ=1)
            [ "$rt" = containerd2igzip ] && decompress=(env CONTAINERD_DISABLE_PIGZ=1)
            containerd_config "$rt" "$root/root" "$root/state" "$sock" "$root/net.d" > "$root/config.toml"
            if [ "$rt" = containerd2mp ]; then
                printf "[plugins.'io.containerd.transfer.v1.local']\n  concurrent_layer_fetch_buffer = %s\n  max_concurrent_downloads = 6\n" \
                    "$multipart" >> "$root/config.toml"
            fi
            "${decompress[@]}" "$exe" --config "$root/config.toml" >"$root/log" 2>&1 &
            ;;
    esac
    daemon_pid=$!
    for _ in $(seq 400); do [ -S "$sock" ] && return 0; sleep 0.05; done
    echo "$prog: $rt did not open $sock; its log:" >&2; tail -20 "$root/log" >&2; exit 1
}

containerd_decompressor() { # runtime -> what decompresses its gzip layers, for the printout
    if [ "$1" = containerd2igzip ]; then
        echo "igzip ($(command -v igzip || echo 'not found: Go'))"
    else
        echo "Go's compress/gzip (CONTAINERD_DISABLE_IGZIP=1 CONTAINERD_DISABLE_PIGZ=1)"
    fi
}

stop_daemon() {
    kill "$daemon_pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$daemon_pid" 2>/dev/null || break; sleep 0.05; done
    kill -9 "$daemon_pid" 2>/dev/null || true
    wait "$daemon_pid" 2>/dev/null || true
    daemon_pid=
    # Snapshotters leave no mounts after a pull; anything under the root still mounted is a bug.
    if grep -q " $1/" /proc/self/mounts; then
        echo "$prog: mounts left under $1" >&2; grep " $1/" /proc/self/mounts >&2
        awk -v r="$1/" '$2 ~ "^"r {print $2}' /proc/self/mounts | sort -r | xargs -r -n1 umount -l
    fi
    rm -rf "$1"
}

#!/usr/bin/env bash
# Makes a fresh Debian 12 root directory to install packages into with chroot, from a cache:
# the first run debootstraps one (minbase, through apt's configured mirror, as
# hack/node-vm/build.sh does), runs `apt-get update` in it and downloads the packages named with
# --download into its apt cache, then keeps it under the cache directory; every run copies the
# cached root to TARGET. The copy starts as debootstrap left it: nothing installed beyond
# minbase, the downloaded .debs only sitting in /var/cache/apt/archives (so an install of them
# needs no network when the cache is fresh).
#
# Usage: hack/debian-root.sh [--cache DIR] [--download "PKG ..."] [--refresh] TARGET
#   --cache DIR       where the cached root lives (default /var/tmp/minicri-debian-root)
#   --download LIST   packages (and their dependencies) to download into the cached root's apt
#                     cache when it is made (default: none)
#   --refresh         make the cached root again
# Needs root. Installs debootstrap with apt-get when missing.
set -euo pipefail

cache=/var/tmp/minicri-debian-root
download=""
refresh=false
target=""
while [[ $# -gt 0 ]]; do
    case $1 in
        --cache) cache=$2; shift 2;;
        --download) download=$2; shift 2;;
        --refresh) refresh=true; shift;;
        -h|--help) sed -n '2,16p' "$0"; exit 0;;
        -*) echo "debian-root: unknown argument $1" >&2; exit 2;;
        *) target=$1; shift;;
    esac
done
[[ -n $target ]] || { echo "debian-root: no TARGET (--help)" >&2; exit 2; }
[[ $(id -u) == 0 ]] || { echo "debian-root: needs root" >&2; exit 1; }
[[ ! -e $target ]] || { echo "debian-root: $target exists" >&2; exit 1; }

root=$cache/rootfs
# What the cached root was made with: a different --download list makes it again.
stamp="bookworm minbase; downloaded: $download"
if [[ $refresh == true || ! -f $cache/made || $(cat "$cache/made") != "$stamp" ]]; then
    if ! command -v debootstrap > /dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap
    fi
    # The mirror apt uses here (deb822 or one-line sources), else Debian's.
    mirror=$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/debian.sources 2> /dev/null | head -n1)
    [[ -n $mirror ]] || mirror=$(awk '$1 == "deb" && $3 == "bookworm" {print $2; exit}' /etc/apt/sources.list 2> /dev/null)
    [[ -n $mirror ]] || mirror=http://deb.debian.org/debian
    mkdir -p "$cache"
    rm -rf "$root.tmp" "$cache/made"
    start=$(date +%s)
    echo "debian-root: debootstrap bookworm (minbase) from $mirror into $root.tmp"
    debootstrap --variant=minbase bookworm "$root.tmp" "$mirror" > "$cache/debootstrap.log" 2>&1 \
        || { tail -n 20 "$cache/debootstrap.log" >&2; exit 1; }
    # apt in the root fetches as apt does here: the same sources, and the host's Acquire
    # settings (a mirror serving an archive snapshot needs its Valid-Until check off).
    if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
        cp /etc/apt/sources.list.d/debian.sources "$root.tmp/etc/apt/sources.list.d/"
        rm -f "$root.tmp/etc/apt/sources.list"
    fi
    for f in /etc/apt/apt.conf.d/*; do
        if grep -q '^Acquire::' "$f" 2> /dev/null; then cp "$f" "$root.tmp/etc/apt/apt.conf.d/"; fi
    done
    cp /etc/resolv.conf "$root.tmp/etc/resolv.conf"
    # debootstrap's own downloads are installed: only the --download ones stay in the cache.
    chroot "$root.tmp" apt-get clean
    chroot "$root.tmp" apt-get update -qq
    if [[ -n $download ]]; then
        # shellcheck disable=SC2086 # a list of names
        chroot "$root.tmp" env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --download-only $download > /dev/null
    fi
    rm -rf "$root"
    mv "$root.tmp" "$root"
    echo "$stamp" > "$cache/made"
    echo "debian-root: made $root in $(( $(date +%s) - start )) s ($(du -sh "$root" | cut -f1))"
fi
cp -a "$root" "$target"

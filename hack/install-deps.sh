#!/usr/bin/env bash
# Installs, from Debian's archive, everything minicri's build and its tests need on the machine:
# the OCI runtimes, the CNI plugins, a local image registry and image tools, busybox-static (the
# test images are built from it), and the small tools the hack/ scripts use.
#
# Idempotent: packages that are already installed are skipped, and `apt-get update` runs only
# when at least one package is missing. Needs root (or sudo).
set -euo pipefail

PACKAGES=(
    # OCI runtimes that minicri drives.
    runc
    crun
    # CheckpointContainer and restores run runc with CRIU; the checkpoint tests exercise it (or,
    # where the host's kernel keeps CRIU from running, the refusal naming CRIU's reason).
    criu
    # CNI plugins (bridge, loopback, host-local, portmap, ...) for pod networking.
    containernetworking-plugins
    # A real registry (distribution 2.x) and image tools for the pull tests.
    docker-registry
    # A caching proxy: the fleet tests' second kind of pull-through cache (tests/src/nginx_cache.rs).
    nginx
    skopeo
    umoci
    # A static busybox: the only binary inside the test images.
    busybox-static
    # `ip` for network namespace checks in tests.
    iproute2
    # The tests' small image filesystems: ext4 images on loop devices (mkfs.ext4, resize2fs;
    # losetup, findmnt).
    e2fsprogs
    mount
    util-linux
    # `htpasswd` for registries with basic auth; curl and jq for the scripts.
    apache2-utils
    curl
    jq
    bc
    file
    # A C toolchain and pkg-config for crates with build scripts.
    gcc
    libc6-dev
    # libFuzzer (built by cargo-fuzz for the fuzz run that ends the suite) is C++.
    g++
    pkg-config
    ca-certificates
    # The Debian package (hack/package-deb.sh: dpkg-shlibdeps, objcopy) and the fresh Debian
    # root its test installs it into (hack/debian-root.sh).
    dpkg-dev
    binutils
    debootstrap
)

SUDO=()
if [[ $(id -u) -ne 0 ]]; then
    SUDO=(sudo)
fi

is_installed() {
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'
}

missing=()
for pkg in "${PACKAGES[@]}"; do
    if ! is_installed "$pkg"; then
        missing+=("$pkg")
    fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
    echo "install-deps: all ${#PACKAGES[@]} packages are already installed"
else
    echo "install-deps: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    "${SUDO[@]}" apt-get update -q
    # The packages' own services (nginx on :80, docker-registry on :5000) are not started: the
    # tests start their own, with their own configs and ports. A policy-rc.d that refuses every
    # start does that for this install only; one the machine has already is left alone.
    policy=/usr/sbin/policy-rc.d
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\n# hack/install-deps.sh: no service starts while it installs\nexit 101\n' \
            | "${SUDO[@]}" tee "$policy" >/dev/null
        "${SUDO[@]}" chmod 755 "$policy"
        trap '"${SUDO[@]}" rm -f "$policy"' EXIT
    fi
    "${SUDO[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# Debian's docker-registry package ships a service that listens on :5000 with the packaged
# config. The tests start their own registries with their own configs, so on a machine with
# systemd the packaged one is stopped and disabled to keep port 5000 free for
# hack/start-registry.sh.
if command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
    if systemctl is-enabled --quiet docker-registry 2>/dev/null \
        || systemctl is-active --quiet docker-registry 2>/dev/null; then
        echo "install-deps: disabling the packaged docker-registry service"
        "${SUDO[@]}" systemctl disable --now docker-registry || true
    fi
fi

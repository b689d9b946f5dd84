#!/usr/bin/env bash
# Boots the node VM (built by hack/node-vm/build.sh) under qemu and runs, inside it, minicri as a
# systemd service (installed from its Debian package, hack/package-deb.sh) on cgroup v2, then
# critest once per cgroup driver (systemd, cgroupfs) and the guest's own checks (stats read from
# cgroup v2 files, no container or pod cgroup left after RemovePodSandbox, containers surviving a
# restart of the service). Results go to OUT: guest.log, critest-<driver>.log and summary.txt.
# KVM is used when /dev/kvm works, else software emulation (slow: allow an hour or more).
#
# Usage: hack/node-vm/run.sh --registry-data DIR [options]
#   --registry-data DIR  a distribution registry's storage root (rootdirectory) holding the
#                        images critest pulls under their upstream paths
#                        (e2e-test-images/busybox:1.29-2 for registry.k8s.io/e2e-test-images/...);
#                        served in the guest on 127.0.0.1:5000, which minicri's hosts.toml
#                        makes the mirror of registry.k8s.io, k8s.gcr.io, gcr.io, docker.io,
#                        quay.io and public.ecr.aws
#   --critest PATH       critest (default: on PATH); --crictl PATH likewise
#   --minicri PATH       minicri's binary, packaged here (default: target/release/minicri,
#                        built if missing)
#   --deb FILE           minicri's package, instead of packaging --minicri
#   --drivers LIST       cgroup drivers to run critest with (default: "systemd cgroupfs")
#   --focus REGEX        critest's -ginkgo.focus (default: every spec)
#   --skip REGEX         critest's -ginkgo.skip (default: none)
#   --no-critest         run only the guest's own checks (pods, stats, restart, checkpoint and
#                        restore), not critest: one run under emulation in minutes, not an hour
#   --extra-debs DIR     .deb files unpacked into the guest's root before the checks
#                        (their files only, no dpkg state), for packages an image built before build.sh listed them
#                        lacks (e.g. criu and its libraries: apt-get download them here)
#   --dir DIR            the VM's image (default /var/tmp/minicri-node-vm; built if missing)
#   --out DIR            results (default DIR/results-<UTC time>)
#   --smp N --mem MIB    the guest's CPUs (default: the host's) and memory (default 4096)
#   --accel kvm|tcg      default: kvm if it works, else tcg
# Needs root.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
dir=/var/tmp/minicri-node-vm
registry_data=""
critest=$(command -v critest || true)
crictl=$(command -v crictl || true)
minicri=""
deb=""
drivers="systemd cgroupfs"
focus=""
skip=""
no_critest=0
extra_debs=""
out=""
smp=$(nproc)
mem=4096
accel=""
while [[ $# -gt 0 ]]; do
    case $1 in
        --registry-data) registry_data=$2; shift 2;;
        --critest) critest=$2; shift 2;;
        --crictl) crictl=$2; shift 2;;
        --minicri) minicri=$2; shift 2;;
        --deb) deb=$2; shift 2;;
        --drivers) drivers=$2; shift 2;;
        --focus) focus=$2; shift 2;;
        --skip) skip=$2; shift 2;;
        --no-critest) no_critest=1; shift;;
        --extra-debs) extra_debs=$2; shift 2;;
        --dir) dir=$2; shift 2;;
        --out) out=$2; shift 2;;
        --smp) smp=$2; shift 2;;
        --mem) mem=$2; shift 2;;
        --accel) accel=$2; shift 2;;
        -h|--help) sed -n '2,34p' "$0"; exit 0;;
        *) echo "node-vm: unknown argument $1" >&2; exit 2;;
    esac
done
fail() { echo "node-vm: $*" >&2; exit 1; }
[[ $(id -u) == 0 ]] || fail "needs root"
[[ -d $registry_data/docker/registry/v2 ]] || fail "--registry-data $registry_data is not a registry storage root (no docker/registry/v2)"
[[ $no_critest == 1 || -x $critest ]] || fail "no critest (--critest PATH)"
[[ -x $crictl ]] || fail "no crictl (--crictl PATH)"
if [[ -z $deb ]]; then
    if [[ -z $minicri ]]; then
        minicri=${CARGO_TARGET_DIR:-$repo/target}/release/minicri
        [[ -x $minicri ]] || (cd "$repo" && cargo build --release --bin minicri)
    fi
    [[ -x $minicri ]] || fail "$minicri is not an executable"
fi
# Installs the qemu tools when missing, and builds the image unless it exists.
"$here/build.sh" --dir "$dir"
if [[ -z $accel ]]; then
    accel=tcg
    if [[ -w /dev/kvm ]] && timeout 20 qemu-system-x86_64 -accel kvm -nodefaults -nographic -no-reboot \
        -kernel "$dir/vmlinuz" -append "panic=-1" -m 256 -serial none > /dev/null 2>&1; then
        # A guest kernel that got as far as its root-filesystem panic and rebooted (-no-reboot:
        # qemu exits 0) proves KVM works here.
        accel=kvm
    fi
fi
out=${out:-$dir/results-$(date -u +%Y%m%dT%H%M%SZ)}
share=$out/share
mkdir -p "$share/results"
if [[ -z $deb ]]; then
    "$repo/hack/package-deb.sh" --binary "$minicri" --out "$out/debs"
    deb=$(ls "$out"/debs/minicri_*.deb)
fi
install -m 0644 "$deb" "$share/"
if [[ $no_critest == 0 ]]; then install -m 0755 "$critest" "$share/critest"; fi
if [[ -n $extra_debs ]]; then
    mkdir -p "$share/extra-debs"
    cp "$extra_debs"/*.deb "$share/extra-debs/"
fi
install -m 0755 "$crictl" "$share/crictl"
install -m 0755 "$here/guest.sh" "$share/guest.sh"
cp -a "$registry_data" "$share/registry-data"
{
    printf 'DRIVERS=%q\n' "$drivers"
    printf 'FOCUS=%q\n' "$focus"
    printf 'SKIP=%q\n' "$skip"
    printf 'NO_CRITEST=%q\n' "$no_critest"
    printf 'ACCEL=%q\n' "$accel"
    printf 'MINICRI_DEB=%q\n' "$(basename "$deb")"
    printf 'MINICRI_COMMIT=%q\n' "$(git -C "$repo" describe --always --dirty 2> /dev/null || echo unknown)"
} > "$share/params.env"

# A copy-on-write overlay keeps the built image pristine for the next run.
disk=$out/disk.qcow2
qemu-img create -q -f qcow2 -F raw -b "$dir/disk.img" "$disk"
echo "node-vm: booting ($accel, $smp CPUs, $mem MiB); console in $out/console.log"
start=$(date +%s)
qemu-system-x86_64 -accel "$accel" -m "$mem" -smp "$smp" -nographic -nodefaults -no-reboot \
    -serial "file:$out/console.log" -nic none \
    -kernel "$dir/vmlinuz" -initrd "$dir/initrd.img" \
    -append "root=/dev/vda rw console=ttyS0 systemd.unified_cgroup_hierarchy=1 panic=-1" \
    -drive "file=$disk,if=virtio,format=qcow2" \
    -virtfs "local,path=$share,mount_tag=host,security_model=none,id=host"
echo "node-vm: the guest powered off after $(( $(date +%s) - start )) s"
rm -f "$disk"
cp -a "$share/results/." "$out/"
if [[ -f $out/summary.txt ]]; then
    cat "$out/summary.txt"
else
    fail "the guest wrote no summary (see $out/console.log)"
fi
grep -q '^result: ok' "$out/summary.txt"

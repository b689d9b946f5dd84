#!/usr/bin/env bash
# Builds the node VM's disk: a Debian 12 root filesystem (debootstrap through apt's configured
# mirror) with systemd as PID 1 (cgroup v2 only), Debian's kernel (AppArmor on, as on Debian and
# Ubuntu nodes), apparmor_parser and sudo (critest loads its AppArmor profiles with them), runc,
# criu (the checkpoint and restore check),
# the CNI plugins, dbus (runc's systemd cgroup driver talks to systemd over it) and
# docker-registry, written to an ext4 image without loop mounts (mke2fs -d). The kernel and initramfs are copied out beside it for
# qemu's -kernel/-initrd. The guest mounts the host directory that hack/node-vm/run.sh shares
# (9p, tag "host") at /mnt/host and runs /mnt/host/guest.sh once at boot (minicri-node-vm.service),
# which powers the machine off when it ends. The guest has no network device.
#
# Usage: hack/node-vm/build.sh [--dir DIR] [--force]
#   --dir DIR   where the image goes (default /var/tmp/minicri-node-vm)
#   --force     rebuild even if DIR/disk.img exists
# Needs root. Installs debootstrap, qemu-system-x86, qemu-utils (of one version) and e2fsprogs with
# apt-get when missing, also when the image exists.
set -euo pipefail

dir=/var/tmp/minicri-node-vm
force=false
while [[ $# -gt 0 ]]; do
    case $1 in
        --dir) dir=$2; shift 2;;
        --force) force=true; shift;;
        -h|--help) sed -n '2,14p' "$0"; exit 0;;
        *) echo "node-vm build: unknown argument $1" >&2; exit 2;;
    esac
done
[[ $(id -u) == 0 ]] || { echo "node-vm build: needs root" >&2; exit 1; }
# The tools run.sh needs too, also when the image exists (run.sh calls this script either way).
need=()
command -v debootstrap > /dev/null || need+=(debootstrap)
command -v mke2fs > /dev/null || need+=(e2fsprogs)
if ! command -v qemu-system-x86_64 > /dev/null; then
    # qemu-system-x86 and qemu-utils come from one qemu source package of one version: a newer
    # qemu-utils already there (a backport, as on this project's machines) would be removed by
    # installing Debian's qemu-system-x86, taking qemu-img with it. Both are installed at the
    # version apt picks for qemu-system-x86.
    apt-get update -qq
    version=$(apt-cache policy qemu-system-x86 | awk '/Candidate:/ {print $2}')
    need+=("qemu-system-x86=$version" "qemu-utils=$version")
elif ! command -v qemu-img > /dev/null; then
    need+=(qemu-utils)
fi
if [[ ${#need[@]} -gt 0 ]]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --allow-downgrades "${need[@]}"
fi
command -v qemu-img > /dev/null && command -v qemu-system-x86_64 > /dev/null || {
    echo "node-vm build: qemu-img or qemu-system-x86_64 is still missing after installing ${need[*]}" >&2
    exit 1
}
if [[ -f $dir/disk.img && $force == false ]]; then
    echo "node-vm build: $dir/disk.img exists (--force rebuilds)"
    exit 0
fi

# The mirror apt uses here (deb822 or one-line sources), else Debian's.
mirror=$(sed -n 's/^URIs: *\([^ ]*\).*/\1/p' /etc/apt/sources.list.d/debian.sources 2> /dev/null | head -n1)
[[ -n $mirror ]] || mirror=$(awk '$1 == "deb" && $3 == "bookworm" {print $2; exit}' /etc/apt/sources.list 2> /dev/null)
[[ -n $mirror ]] || mirror=http://deb.debian.org/debian

mkdir -p "$dir"
rootfs=$dir/rootfs
rm -rf "$rootfs" "$dir/disk.img.tmp"
packages=systemd,systemd-sysv,dbus,apparmor,sudo,udev,kmod,linux-image-amd64,initramfs-tools,runc,criu,containernetworking-plugins,docker-registry,iproute2,iptables,procps,util-linux,e2fsprogs,ca-certificates,jq
echo "node-vm build: debootstrap bookworm from $mirror into $rootfs"
debootstrap --variant=minbase --include="$packages" bookworm "$rootfs" "$mirror"

echo minicri-node > "$rootfs/etc/hostname"
printf '127.0.0.1 localhost minicri-node\n::1 localhost\n' > "$rootfs/etc/hosts"
cat > "$rootfs/etc/fstab" <<'FSTAB'
/dev/vda / ext4 rw,errors=remount-ro 0 1
host /mnt/host 9p trans=virtio,version=9p2000.L,msize=262144,nofail 0 0
FSTAB
mkdir -p "$rootfs/mnt/host"
# 9p over virtio is a module in Debian's kernel: load it before the fstab mount.
printf '9p\n9pnet_virtio\n' > "$rootfs/etc/modules-load.d/host-share.conf"
# A root shell on the serial console for someone watching; the run itself needs no login.
passwd_root=$(mktemp)
sed 's/^root:[^:]*:/root::/' "$rootfs/etc/shadow" > "$passwd_root" && cat "$passwd_root" > "$rootfs/etc/shadow" && rm -f "$passwd_root"
# docker-registry's packaged service listens everywhere with htpasswd auth; the guest script
# starts its own registry instead.
chroot "$rootfs" systemctl disable docker-registry.service > /dev/null 2>&1 || true
cat > "$rootfs/etc/systemd/system/minicri-node-vm.service" <<'UNIT'
[Unit]
Description=minicri node VM run (/mnt/host/guest.sh), then power off
After=multi-user.target mnt-host.mount
Requires=mnt-host.mount
ConditionPathExists=/mnt/host/guest.sh

[Service]
Type=oneshot
ExecStart=/bin/bash /mnt/host/guest.sh
ExecStopPost=/bin/systemctl --no-block poweroff
StandardOutput=journal+console
StandardError=journal+console
TimeoutStartSec=infinity

[Install]
WantedBy=multi-user.target
UNIT
chroot "$rootfs" systemctl enable minicri-node-vm.service > /dev/null
chroot "$rootfs" apt-get clean

kernel=$(ls "$rootfs"/boot/vmlinuz-* | sort -V | tail -n1)
initrd=$(ls "$rootfs"/boot/initrd.img-* | sort -V | tail -n1)
cp "$kernel" "$dir/vmlinuz"
cp "$initrd" "$dir/initrd.img"
echo "node-vm build: writing $dir/disk.img (ext4, 8 GiB sparse)"
mke2fs -q -t ext4 -L minicri-node -d "$rootfs" "$dir/disk.img.tmp" 8G
mv "$dir/disk.img.tmp" "$dir/disk.img"
rm -rf "$rootfs"
echo "node-vm build: done: $dir/disk.img, $dir/vmlinuz, $dir/initrd.img"

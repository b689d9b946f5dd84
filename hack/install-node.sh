#!/usr/bin/env bash
# Installs minicri as a node's container runtime: the binary in /usr/local/bin, the systemd unit
# (hack/systemd/minicri.service), the registry hosts directory /etc/minicri/certs.d and, unless a
# CNI configuration exists there already, the default bridge network (hack/install-cni-config.sh).
# minicri needs no config file (embedded defaults; /etc/minicri/config.toml is read if present).
# Then, where systemd runs the machine, enables and starts the unit.
#
# Usage: hack/install-node.sh [--binary PATH] [--root DIR]
#   --binary PATH   the minicri binary (default: target/release/minicri, built if missing)
#   --root DIR      install below DIR instead of / (packaging, tests); systemd is not touched
# Needs root for /.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
binary=""
root=""
while [[ $# -gt 0 ]]; do
    case $1 in
        --binary) binary=$2; shift 2;;
        --root) root=$2; shift 2;;
        -h|--help) sed -n '2,12p' "$0"; exit 0;;
        *) echo "install-node: unknown argument $1" >&2; exit 2;;
    esac
done
if [[ -z $binary ]]; then
    binary=$repo/target/release/minicri
    if [[ ! -x $binary ]]; then
        (cd "$repo" && cargo build --release --bin minicri)
    fi
fi
[[ -x $binary ]] || { echo "install-node: $binary is not an executable" >&2; exit 1; }

install -D -m 0755 "$binary" "$root/usr/local/bin/minicri"
install -D -m 0644 "$here/systemd/minicri.service" "$root/etc/systemd/system/minicri.service"
install -d -m 0755 "$root/etc/minicri/certs.d"
conf_dir=$root/etc/cni/net.d
if compgen -G "$conf_dir/*.conflist" > /dev/null || compgen -G "$conf_dir/*.conf" > /dev/null; then
    echo "install-node: $conf_dir has a CNI configuration; leaving it"
else
    "$here/install-cni-config.sh" "$conf_dir"
fi
echo "install-node: installed minicri under ${root:-/}"

if [[ -z $root && -d /run/systemd/system ]]; then
    systemctl daemon-reload
    systemctl enable --now minicri.service
    echo "install-node: minicri.service enabled and started; socket /run/minicri/minicri.sock"
elif [[ -z $root ]]; then
    echo "install-node: systemd does not run this machine; start minicri with: /usr/local/bin/minicri serve"
fi

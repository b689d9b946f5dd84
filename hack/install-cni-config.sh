#!/usr/bin/env bash
# Installs minicri's default CNI network for a single node: a bridge (minicri0) with host-local
# addresses from 10.88.0.0/16, masquerading for traffic leaving the node, and port mappings.
# Pods get their addresses from it; the CRI's NetworkReady condition turns true once a
# configuration exists.
#
# Usage: hack/install-cni-config.sh [CONF_DIR]      (default /etc/cni/net.d)
# An existing configuration file of the same name is left alone.
set -euo pipefail

dir=${1:-/etc/cni/net.d}
file=$dir/10-minicri-bridge.conflist
mkdir -p "$dir"
if [[ -e $file ]]; then
    echo "$file exists; leaving it"
    exit 0
fi
cat > "$file.tmp" <<'JSON'
{
  "cniVersion": "1.0.0",
  "name": "minicri",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "minicri0",
      "isGateway": true,
      "ipMasq": true,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{ "subnet": "10.88.0.0/16" }]],
        "routes": [{ "dst": "0.0.0.0/0" }]
      }
    },
    { "type": "portmap", "capabilities": { "portMappings": true } },
    { "type": "loopback" }
  ]
}
JSON
mv "$file.tmp" "$file"
echo "installed $file"

#!/usr/bin/env bash
# Builds minicri's Debian packages with dpkg-deb, offline:
# - minicri_VERSION_ARCH.deb: /usr/bin/minicri without its debug info; the systemd unit
#   (hack/systemd/minicri.service, ExecStart=/usr/bin/minicri); /etc/minicri/config.toml, a
#   conffile written by the binary itself (`minicri config default`: every key commented out at
#   its default); /etc/minicri/certs.d; the default pod network
#   (/usr/share/minicri/10-minicri-bridge.conflist, from hack/install-cni-config.sh), which the
#   postinst copies to /etc/cni/net.d only where no CNI configuration is; the maintainer scripts
#   in hack/debian/ (what they do is said at their top). Depends on runc, the CNI plugins and
#   the shared libraries the binary links (dpkg-shlibdeps).
# - minicri-dbgsym_VERSION_ARCH.deb: the debug info, /usr/lib/debug/.build-id/XX/YYYY.debug,
#   where gdb and other debuggers look it up by the binary's build id.
#
# Usage: hack/package-deb.sh [--binary PATH] [--out DIR] [--version VERSION] [--fast]
#   --binary PATH    the minicri binary (default: target/release/minicri, built when missing)
#   --out DIR        where the packages go (default: target/debian)
#   --version V      the package version (default: the workspace's, with +gitN.HASH appended in
#                    a git checkout: N commits, so later builds sort later)
#   --fast           gzip -1 instead of xz (larger packages, seconds instead of minutes: tests)
# Needs dpkg-deb, dpkg-shlibdeps (dpkg-dev), objcopy and readelf (binutils); not root.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
binary=""
out=$repo/target/debian
version=""
fast=false
while [[ $# -gt 0 ]]; do
    case $1 in
        --binary) binary=$2; shift 2;;
        --out) out=$2; shift 2;;
        --version) version=$2; shift 2;;
        --fast) fast=true; shift;;
        -h|--help) sed -n '2,21p' "$0"; exit 0;;
        *) echo "package-deb: unknown argument $1" >&2; exit 2;;
    esac
done
fail() { echo "package-deb: $*" >&2; exit 1; }
if [[ -z $binary ]]; then
    binary=${CARGO_TARGET_DIR:-$repo/target}/release/minicri
    [[ -x $binary ]] || (cd "$repo" && cargo build --release --bin minicri)
fi
[[ -x $binary ]] || fail "$binary is not an executable"
if [[ -z $version ]]; then
    version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' "$repo/Cargo.toml")
    if git -C "$repo" rev-parse --git-dir > /dev/null 2>&1; then
        version+="+git$(git -C "$repo" rev-list --count HEAD).$(git -C "$repo" rev-parse --short=8 HEAD)"
    fi
fi
[[ $version =~ ^[0-9][A-Za-z0-9.+~-]*$ ]] || fail "version $version is not a Debian version"
arch=$(dpkg --print-architecture)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pkg=$work/minicri
dbg=$work/minicri-dbgsym
mkdir -p "$pkg/DEBIAN" "$dbg/DEBIAN"

# The binary, its debug info split off and linked back by build id (and debuglink).
install -D -m 0755 "$binary" "$pkg/usr/bin/minicri"
build_id=$(readelf -n "$binary" | sed -n 's/^ *Build ID: *\([0-9a-f]*\)$/\1/p' | head -n1)
[[ ${#build_id} -gt 2 ]] || fail "$binary has no build id (the linker's --build-id)"
debug=$dbg/usr/lib/debug/.build-id/${build_id:0:2}/${build_id:2}.debug
mkdir -p "$(dirname "$debug")"
objcopy --only-keep-debug --compress-debug-sections=zlib "$binary" "$debug"
chmod 0644 "$debug"
# Debug sections go; the symbol table stays, so a panic's backtrace still names functions.
objcopy --strip-debug --remove-section=.comment \
    --add-gnu-debuglink="$debug" "$binary" "$pkg/usr/bin/minicri"
# (.debug_gdb_scripts is not debug info: a loaded section naming rustc's pretty-printers.)
if readelf -SW "$pkg/usr/bin/minicri" | grep -Eq '\.(z?debug_(info|line|abbrev|str|ranges|loc)|zdebug)'; then
    fail "the packaged binary still has debug sections"
fi

# The unit, run from /usr/bin.
unit=$pkg/lib/systemd/system/minicri.service
install -D -m 0644 "$here/systemd/minicri.service" "$unit"
sed -i 's|^ExecStart=/usr/local/bin/minicri |ExecStart=/usr/bin/minicri |' "$unit"
grep -q '^ExecStart=/usr/bin/minicri serve$' "$unit" || fail "the unit's ExecStart was not rewritten"

# The configuration, from the binary that reads it.
install -d -m 0755 "$pkg/etc/minicri/certs.d"
"$binary" config default > "$pkg/etc/minicri/config.toml"
chmod 0644 "$pkg/etc/minicri/config.toml"
echo /etc/minicri/config.toml > "$pkg/DEBIAN/conffiles"

# The default pod network, installed by the postinst where none is.
"$here/install-cni-config.sh" "$work/cni" > /dev/null
install -D -m 0644 "$work/cni/10-minicri-bridge.conflist" \
    "$pkg/usr/share/minicri/10-minicri-bridge.conflist"
conflist_sha=$(sha256sum < "$work/cni/10-minicri-bridge.conflist" | cut -d' ' -f1)

for d in "$pkg" "$dbg"; do
    name=$(basename "$d")
    install -d "$d/usr/share/doc/$name"
    printf 'minicri\n\nCopyright: the minicri authors\nLicense: Apache-2.0\n On Debian systems the license is in /usr/share/common-licenses/Apache-2.0.\n' \
        > "$d/usr/share/doc/$name/copyright"
done
install -m 0644 "$repo/README.md" "$pkg/usr/share/doc/minicri/README.md"

install -m 0755 "$here/debian/postinst" "$here/debian/prerm" "$pkg/DEBIAN/"
sed "s/@CONFLIST_SHA256@/$conflist_sha/" "$here/debian/postrm" > "$pkg/DEBIAN/postrm"
chmod 0755 "$pkg/DEBIAN/postrm"
grep -q "$conflist_sha" "$pkg/DEBIAN/postrm" || fail "the postrm did not get the network's checksum"

# Shared libraries the binary links, as Debian packages (a control file of the minimal form
# dpkg-shlibdeps reads).
mkdir -p "$work/shlibs/debian"
printf 'Source: minicri\n\nPackage: minicri\nArchitecture: any\n' > "$work/shlibs/debian/control"
shlibs=$(cd "$work/shlibs" && dpkg-shlibdeps -O "$pkg/usr/bin/minicri" 2> /dev/null \
    | sed -n 's/^shlibs:Depends=//p')
[[ -n $shlibs ]] || fail "dpkg-shlibdeps found no library dependencies"

size() { du -sk --exclude=DEBIAN "$1" | cut -f1; }
cat > "$pkg/DEBIAN/control" <<CONTROL
Package: minicri
Version: $version
Architecture: $arch
Maintainer: minicri developers <minicri@localhost>
Installed-Size: $(size "$pkg")
Depends: $shlibs, runc, containernetworking-plugins, iptables
Recommends: apparmor
Suggests: crun
Section: admin
Priority: optional
Description: Kubernetes CRI runtime
 minicri serves the Kubernetes Container Runtime Interface (CRI v1) on
 /run/minicri/minicri.sock: image pulls that are shared, resumable and released
 when the pod that asked is gone, pod sandboxes and containers on runc, CNI
 networking, exec, attach and port-forward. Point the kubelet (or crictl) at
 unix:///run/minicri/minicri.sock.
CONTROL
cat > "$dbg/DEBIAN/control" <<CONTROL
Package: minicri-dbgsym
Version: $version
Architecture: $arch
Maintainer: minicri developers <minicri@localhost>
Installed-Size: $(size "$dbg")
Depends: minicri (= $version)
Section: debug
Priority: optional
Description: debug symbols for minicri
 The debug info of /usr/bin/minicri, found by its build id.
CONTROL

for d in "$pkg" "$dbg"; do
    # Every file but the conffiles (dpkg keeps their checksums itself).
    (cd "$d" && find . \( -path ./DEBIAN -o -path ./etc \) -prune -o -type f -printf '%P\0' | sort -z \
        | xargs -0 md5sum) > "$d/DEBIAN/md5sums"
done
mkdir -p "$out"
for d in "$pkg" "$dbg"; do
    name=$(basename "$d")
    file=$out/${name}_${version}_${arch}.deb
    # The debug file is compressed already (zlib sections): xz would spend minutes for little.
    compress=(-Zxz)
    if [[ $fast == true ]]; then
        compress=(-Zgzip -z1)
    elif [[ $d == "$dbg" ]]; then
        compress=(-Znone)
    fi
    dpkg-deb --root-owner-group "${compress[@]}" --build "$d" "$file" > /dev/null
    echo "package-deb: $file ($(du -h "$file" | cut -f1))"
done

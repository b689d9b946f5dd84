# shellcheck shell=bash
# containerd-config.sh - sourced by the benchmark scripts: writes containerd's configuration as a
# node has it, with its CRI plugin: the overlayfs snapshotter, the hosts.toml directory as the
# registry's `config_path`, runc through the runc v2 shim with cgroupfs, CNI from /usr/lib/cni,
# the streaming server on loopback.
#
# containerd 1.6 reads version 2 (`io.containerd.grpc.v1.cri`). containerd 2.x is given version 3,
# its own format (the CRI split into `io.containerd.cri.v1.images` and
# `io.containerd.cri.v1.runtime`), as a 2.x node is configured, rather than a version 2 file it
# would migrate at start: the project's earlier results gave 2.x a version 2 file and measured it
# about twice as slow as 2.x set up with version 3 by someone else.
#
# Globals read: certs (the hosts.toml directory), and optionally sandbox_image (the pinned sandbox
# image, for pods).

containerd_config() { # runtime root state socket cni-conf-dir -> the configuration on stdout
    local rt=$1 root=$2 state=$3 sock=$4 netd=$5
    if [ "$rt" = containerd ]; then
        cat <<TOML
version = 2
root = "$root"
state = "$state"
[grpc]
  address = "$sock"
[ttrpc]
  address = "$sock.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  ${sandbox_image:+sandbox_image = \"$sandbox_image\"}
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  restrict_oom_score_adj = true
[plugins."io.containerd.grpc.v1.cri".containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
  SystemdCgroup = false
[plugins."io.containerd.grpc.v1.cri".cni]
  bin_dir = "/usr/lib/cni"
  conf_dir = "$netd"
[plugins."io.containerd.grpc.v1.cri".registry]
  config_path = "$certs"
TOML
    else
        cat <<TOML
version = 3
root = "$root"
state = "$state"
[grpc]
  address = "$sock"
[ttrpc]
  address = "$sock.ttrpc"
[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'
TOML
        [ -n "${sandbox_image:-}" ] && cat <<TOML
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = '$sandbox_image'
TOML
        cat <<TOML
    [plugins.'io.containerd.cri.v1.images'.registry]
      config_path = '$certs'
  [plugins.'io.containerd.cri.v1.runtime']
    enable_selinux = false
    restrict_oom_score_adj = true
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          SystemdCgroup = false
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ['/usr/lib/cni']
      conf_dir = '$netd'
  [plugins.'io.containerd.grpc.v1.cri']
    stream_server_address = '127.0.0.1'
    stream_server_port = '0'
TOML
    fi
}

//! Support for minicri's black-box tests: real registries started from Debian's `docker-registry`,
//! test images built from busybox-static and pushed over the registry HTTP API, a fault-injecting
//! registry proxy, a harness that runs the `minicri` binary on a temporary socket and root, a pod
//! test environment (daemon, images, a CNI network, cleanup) in [`pod_env`], the RuntimeService
//! calls pod tests share in [`pod_rpc`], a minimal remotecommand client (SPDY or WebSocket) for
//! the streaming server in [`remotecommand`] with the transports it uses in [`spdy`] and
//! [`websocket`] and their HTTP upgrade in [`upgrade`], what the pull tests share in [`pull_env`], a
//! kubelet simulator (pod workers, image pullers, back-off, deletion) that drives the daemon as
//! the kubelet does in [`kubelet_sim`], with the environment its tests share in [`sim_env`],
//! a minimal Kubernetes API server (pods list and watch) in [`apiserver`], an address whose
//! connections hang in [`blackhole`], an address that is not the node's in [`far_host`], a
//! listener that counts connections to the node in [`tripwire`], a daemon root on a small
//! filesystem of its own in [`small_disk`], and how tests whose prerequisites are missing skip,
//! or fail when CI must run them, in [`prereq`]. Its unit tests hold every crate's files to
//! importing one another one way (`layering`).

pub mod apiserver;
pub mod blackhole;
pub mod daemon;
pub mod far_host;
pub mod images;
pub mod kubelet_sim;
#[cfg(test)]
mod layering;
pub mod nginx_cache;
pub mod pki;
pub mod pod_env;
pub mod pod_rpc;
pub mod prereq;
pub mod proxy;
pub mod pull_env;
pub mod registry;
pub mod remotecommand;
pub mod server;
pub mod sim_env;
pub mod small_disk;
pub mod spdy;
pub mod tripwire;
pub mod upgrade;
pub mod websocket;

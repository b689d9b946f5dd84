//! Support for minicri's black-box tests: real registries started from Debian's `docker-registry`,
//! test images built from busybox-static and pushed over the registry HTTP API, a fault-injecting
//! registry proxy, a harness that runs the `minicri` binary on a temporary socket and root, a pod
//! test environment (daemon, images, a CNI network, cleanup) in [`pod_env`], the RuntimeService
//! calls pod tests share in [`pod_rpc`], and a minimal remotecommand-over-SPDY client for the
//! streaming server in [`remotecommand`], and a minimal Kubernetes API server (pods list+watch)
//! in [`apiserver`].

pub mod apiserver;
pub mod daemon;
pub mod images;
pub mod pod_env;
pub mod pod_rpc;
pub mod proxy;
pub mod registry;
pub mod remotecommand;

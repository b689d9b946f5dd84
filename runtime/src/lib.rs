//! minicri's daemon, as a library the `minicri` binary runs.
//!
//! - [`config`]: the configuration's sections (each owned by its component) merged from their
//!   defaults, the TOML file and the flags; [`config_default`]: the commented default file
//!   (`minicri config default`) and `minicri config check`;
//! - [`server`]: the unix socket, the single-instance lock, serving and shutdown;
//! - [`rpc`]: per-call deadline, logging and error-to-status mapping; [`error`]: the daemon's
//!   error type and its one mapping to a gRPC status;
//! - [`cri`]: the CRI handlers (thin);
//! - [`admin`]: minicri's admin API (pull jobs), and [`pulls_cli`], the `minicri pulls` command;
//! - [`daemon`]: the services and state the handlers share;
//! - [`cni`]: CNI networking of pod sandboxes (ADD/DEL/CHECK, config, result cache, NetworkReady);
//! - [`netns`]: persistent named network namespaces, pinned by bind mounts under `<state>/netns`;
//! - [`oci`]: the OCI runtime (runc, crun) seam, its handlers, host facts and the annotations
//!   a spec may carry; [`spec`]: OCI runtime specs built from CRI configs;
//! - [`shim`]: the per-container monitor process (`minicri shim`) and the daemon's client of it;
//! - [`logs`]: the CRI log line format (writer, splitter, parser);
//! - [`pause`]: the sandbox infra process (`minicri pause`) and its rootfs;
//! - [`pods`]: pod sandboxes and containers (records, lifecycle, exits);
//! - [`images`]: the image side as the pod service meets it ([`images::ImageAccess`]) and
//!   PullImage's requester;
//! - [`checkpoint`]: CRIU checkpoint archives and whether CRIU works here;
//! - [`metrics`]: Prometheus metrics of the pulls (loopback, off by default);
//! - [`kube_watch`]: the API-server watch of this node's pods (found from the kubelet's
//!   kubeconfig);
//! - [`fsutil`]: atomic file replacement, shared by the modules that persist state;
//! - [`httpserve`]: the accept loop, connection cap and header timeout of the HTTP servers;
//! - [`idle`]: what the daemon gives back after a burst (allocator pages, registry connections);
//! - [`ids`]: random sandbox and container ids, streaming tokens;
//! - [`sdnotify`]: readiness and stopping notifications to systemd (`Type=notify` units);
//! - [`stream`]: the streaming server behind the Exec RPC's URLs (HTTP/1.1, SPDY/3.1,
//!   remotecommand).

pub mod admin;
pub mod checkpoint;
pub mod cni;
pub mod config;
pub mod config_default;
pub mod cri;
pub mod daemon;
pub mod error;
pub mod fsutil;
pub mod httpserve;
pub mod idle;
pub mod ids;
pub mod images;
pub mod kube_watch;
pub mod logs;
pub mod metrics;
pub mod netns;
pub mod oci;
pub mod pause;
pub mod pods;
pub mod pulls_cli;
pub mod rpc;
pub mod sdnotify;
pub mod server;
pub mod shim;
pub mod spec;
pub mod stream;

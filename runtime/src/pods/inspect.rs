//! Verbose status: the `info` map of ContainerStatus and PodSandboxStatus with `verbose: true`,
//! what `crictl inspect` and `crictl inspectp` print under `.info`.
//!
//! The map has one key, `"info"`, holding a JSON object whose keys are those tools and scripts
//! read from containerd's CRI plugin (`pid`, `sandboxID`, `runtimeSpec`, `config`, …), so that
//! `crictl inspect ID | jq .info.pid` works the same. CRI configs are in the protobuf JSON
//! mapping ([`minicri_proto::to_json`]); the runtime spec is the bundle's `config.json` as
//! written. docs/inspect.md lists every key.

use serde_json::{Value, json};

use super::PodService;
use super::store::{ContainerRecord, SandboxRecord};
use crate::error::{Error, Result};

/// The key of the one entry of the verbose `info` map.
pub const INFO_KEY: &str = "info";

/// The OCI spec in `bundle`, as a JSON object; `null` when it cannot be read (e.g. removed).
fn runtime_spec(bundle: &std::path::Path) -> Value {
    minicri_store::fsutil::off_async(|| std::fs::read(bundle.join("config.json")))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null)
}

/// The container's image volumes: where each is in the container, which image (and path of
/// it), and what of the host backs it.
fn image_volumes(r: &ContainerRecord) -> Value {
    let mounts = r.config().mounts;
    let volumes = r.image_volumes.iter().map(|v| {
        let m = mounts.get(v.mount);
        json!({
            "containerPath": m.map(|m| m.container_path.as_str()),
            "image": v.image_id,
            "imageSubPath": m.map(|m| m.image_sub_path.as_str()),
            "snapshotKey": v.snapshot,
            "hostPath": v.source,
            "imageRoot": v.root,
        })
    });
    Value::Array(volumes.collect())
}

/// A CRI message in the protobuf JSON mapping.
fn cri_json<M: prost::Message>(full_name: &str, msg: &M) -> Result<Value> {
    minicri_proto::to_json(full_name, msg).map_err(Error::Internal)
}

impl PodService {
    /// The verbose info of container `id` (NOT_FOUND if unknown).
    pub fn container_info(&self, id: &str) -> Result<String> {
        Ok(self
            .container_info_of(&self.container_record(id)?)?
            .to_string())
    }

    fn container_info_of(&self, r: &ContainerRecord) -> Result<Value> {
        Ok(json!({
            "sandboxID": r.sandbox_id,
            "pid": r.pid,
            "removing": false,
            "snapshotKey": r.id,
            "snapshotter": self.images.backend(),
            "runtimeHandler": r.runtime_handler,
            "runtimeType": self.runtime(&r.runtime_handler).ok().map(|rt| rt.command().binary),
            "image": r.image,
            "imageRef": r.image_id,
            "config": cri_json("runtime.v1.ContainerConfig", &r.config())?,
            "runtimeSpec": runtime_spec(&r.bundle),
            "bundle": r.bundle,
            "rootfs": r.rootfs,
            "shimPid": r.shim.as_ref().map(|s| s.shim_pid),
            "imageVolumes": image_volumes(r),
        }))
    }

    /// The verbose info of pod sandbox `id` (NOT_FOUND if unknown).
    pub fn sandbox_info(&self, id: &str) -> Result<String> {
        Ok(self.sandbox_info_of(&self.sandbox_record(id)?)?.to_string())
    }

    fn sandbox_info_of(&self, r: &SandboxRecord) -> Result<Value> {
        let bundle = self.bundle_dir(&r.id);
        let spec = runtime_spec(&bundle);
        // No pause image: the infra is `minicri pause` on a rootfs the daemon prepares.
        let image = spec.pointer("/root/path").cloned().unwrap_or(Value::Null);
        Ok(json!({
            "pid": r.infra_pid,
            "netNamespacePath": r.netns.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
            "netNamespaceClosed": r.netns.is_none(),
            "image": image,
            "runtimeHandler": r.runtime_handler,
            "runtimeType": self.runtime(&r.runtime_handler).ok().map(|rt| rt.command().binary),
            "config": cri_json("runtime.v1.PodSandboxConfig", &r.config())?,
            "runtimeSpec": spec,
            "bundle": bundle,
            "ips": r.ips,
            "shimPid": r.shim.as_ref().map(|s| s.shim_pid),
            // What UpdatePodSandboxResources last applied (the CRI's PodSandboxStatus has no
            // field for it).
            "podResources": match PodService::applied_resources(r) {
                Some(req) => cri_json("runtime.v1.UpdatePodSandboxResourcesRequest", &req)?,
                None => Value::Null,
            },
        }))
    }
}

//! Wire types and gRPC plumbing for minicri.
//!
//! This crate owns minicri's protobuf contracts and nothing else:
//!
//! * [`runtime::v1`]: the Kubernetes Container Runtime Interface, package
//!   `runtime.v1`, wire-identical to `k8s.io/cri-api` v0.36
//!   (`proto/cri/api.proto`). It contains the prost message types, the
//!   tonic server traits and wrappers
//!   ([`runtime::v1::runtime_service_server`],
//!   [`runtime::v1::image_service_server`]) and the matching clients
//!   ([`runtime::v1::runtime_service_client`],
//!   [`runtime::v1::image_service_client`]).
//! * [`minicri::v1`]: minicri's admin API (`proto/minicri/admin.proto`): the
//!   `Pulls` service that lists and aborts pull jobs.
//! * [`MAX_MESSAGE_SIZE`]: the message size limit to configure on both ends.
//! * [`to_json`]: any message of these packages in the protobuf JSON mapping
//!   (lowerCamelCase names, enums by name, 64-bit integers as strings, bytes
//!   in base64, default values left out), from the descriptors compiled with
//!   the code.
//!
//! Code is generated at build time by `build.rs` (protox + tonic-prost-build,
//! no system `protoc`). Generated servers have default method bodies, so an
//! implementation only overrides the RPCs it supports and every other RPC
//! answers `UNIMPLEMENTED`.

/// Kubernetes CRI (`runtime.*` protobuf packages).
pub mod runtime {
    /// CRI v1 (`runtime.v1`): the API the kubelet speaks.
    pub mod v1 {
        tonic::include_proto!("runtime.v1");
    }
}

/// minicri's own API (`minicri.*` protobuf packages), served on the CRI socket.
pub mod minicri {
    /// `minicri.v1`: pull jobs (list, abort), used by `minicri pulls` (`proto/minicri/admin.proto`).
    pub mod v1 {
        tonic::include_proto!("minicri.v1");
    }
}

/// Largest gRPC message minicri sends or accepts, in bytes (16 MiB).
///
/// This is the kubelet's own CRI limit, applied in both directions; set it as
/// both the encoding and the decoding limit on every generated server and
/// client (`max_decoding_message_size` / `max_encoding_message_size`), since
/// tonic's default decoding limit (4 MiB) is smaller and large
/// `ListContainers`/`ListImages` responses would otherwise be rejected.
pub const MAX_MESSAGE_SIZE: usize = 16 * 1024 * 1024;

/// The encoded descriptor set of every `.proto` file of this crate.
static DESCRIPTORS: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/descriptors.bin"));

/// The descriptors of this crate's messages, decoded once.
pub fn descriptor_pool() -> &'static prost_reflect::DescriptorPool {
    static POOL: std::sync::OnceLock<prost_reflect::DescriptorPool> = std::sync::OnceLock::new();
    POOL.get_or_init(|| {
        prost_reflect::DescriptorPool::decode(DESCRIPTORS)
            .expect("descriptors compiled with the code")
    })
}

/// `msg`, a message of protobuf type `full_name` (e.g. `runtime.v1.ContainerConfig`), in the
/// protobuf JSON mapping. An error names an unknown type.
pub fn to_json<M: prost::Message>(full_name: &str, msg: &M) -> Result<serde_json::Value, String> {
    let desc = descriptor_pool()
        .get_message_by_name(full_name)
        .ok_or_else(|| format!("no protobuf message type {full_name}"))?;
    let dynamic = prost_reflect::DynamicMessage::decode(desc, msg.encode_to_vec().as_slice())
        .map_err(|e| format!("{full_name}: {e}"))?;
    serde_json::to_value(&dynamic).map_err(|e| format!("{full_name}: {e}"))
}

/// Hand-written `Debug` for the registry credentials message: the secret
/// fields (`debug_redact` in the proto) are never printed, only whether they
/// are set.
impl std::fmt::Debug for runtime::v1::AuthConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        fn redact(secret: &str) -> &'static str {
            if secret.is_empty() { "" } else { "<redacted>" }
        }
        f.debug_struct("AuthConfig")
            .field("username", &self.username)
            .field("password", &redact(&self.password))
            .field("auth", &redact(&self.auth))
            .field("server_address", &self.server_address)
            .field("identity_token", &redact(&self.identity_token))
            .field("registry_token", &redact(&self.registry_token))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::runtime::v1::{AuthConfig, KeyValue, PullImageRequest};
    use prost::Message;

    #[test]
    fn auth_config_debug_hides_secrets() {
        let req = PullImageRequest {
            auth: Some(AuthConfig {
                username: "alice".into(),
                password: "hunter2".into(),
                auth: "YWxpY2U6aHVudGVyMg==".into(),
                registry_token: "tok".into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let shown = format!("{req:?}");
        assert!(shown.contains("alice"));
        for secret in ["hunter2", "YWxpY2U6aHVudGVyMg==", "tok\""] {
            assert!(!shown.contains(secret), "{secret} leaked: {shown}");
        }
    }

    #[test]
    fn env_value_is_bytes_on_the_wire() {
        // KeyValue.value is `bytes` since cri-api v0.36.2; a string-typed
        // sender produces the same encoding.
        let kv = KeyValue {
            key: "A".into(),
            value: b"\xff\x00b".to_vec(),
        };
        let back = KeyValue::decode(kv.encode_to_vec().as_slice()).unwrap();
        assert_eq!(back, kv);
    }

    #[test]
    fn json_mapping_uses_camel_case_names_and_enum_names() {
        use super::runtime::v1::{
            ContainerConfig, ContainerMetadata, LinuxContainerConfig,
            LinuxContainerSecurityContext, NamespaceMode, NamespaceOption,
        };
        let c = ContainerConfig {
            metadata: Some(ContainerMetadata {
                name: "c".into(),
                attempt: 2,
            }),
            log_path: "c/0.log".into(),
            stdin_once: true,
            linux: Some(LinuxContainerConfig {
                security_context: Some(LinuxContainerSecurityContext {
                    namespace_options: Some(NamespaceOption {
                        pid: NamespaceMode::Container as i32,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let v = super::to_json("runtime.v1.ContainerConfig", &c).unwrap();
        assert_eq!(v["metadata"]["name"], "c");
        assert_eq!(v["metadata"]["attempt"], 2);
        assert_eq!(v["logPath"], "c/0.log");
        assert_eq!(v["stdinOnce"], true);
        assert_eq!(
            v["linux"]["securityContext"]["namespaceOptions"]["pid"],
            "CONTAINER"
        );
        assert!(v.get("tty").is_none(), "defaults are left out: {v}");
        assert!(super::to_json("runtime.v1.NoSuchThing", &c).is_err());
    }
}

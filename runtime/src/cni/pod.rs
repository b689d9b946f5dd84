//! What the runtime knows about a pod that CNI plugins get: identity (`CNI_ARGS`) and the
//! capability arguments (`runtimeConfig`).
//!
//! Owns the conversions from CRI types: port mappings, DNS config, and the bandwidth annotations.
//! The capability names and JSON shapes are the CNI conventions' (`portMappings`, `dns`,
//! `bandwidth`); a plugin only receives those it declares in its `capabilities`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use minicri_proto::runtime::v1 as cri;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Pod annotation holding the pod's ingress bandwidth limit (a resource quantity, bits/s).
pub const INGRESS_BANDWIDTH_ANNOTATION: &str = "kubernetes.io/ingress-bandwidth";
/// Pod annotation holding the pod's egress bandwidth limit (a resource quantity, bits/s).
pub const EGRESS_BANDWIDTH_ANNOTATION: &str = "kubernetes.io/egress-bandwidth";

/// The interface the pod's network is attached as (CNI_IFNAME), its default interface.
pub const POD_IF_NAME: &str = "eth0";

/// Everything needed to attach one pod sandbox to the network, or detach it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct PodNetwork {
    /// The sandbox id: `CNI_CONTAINERID` and `K8S_POD_INFRA_CONTAINER_ID`.
    pub id: String,
    /// The pinned network namespace (see [`crate::netns`]).
    pub netns: PathBuf,
    pub name: String,
    pub namespace: String,
    pub uid: String,
    /// `CNI_IFNAME`: `eth0` for Kubernetes pods.
    pub if_name: String,
    pub port_mappings: Vec<PortMapping>,
    pub dns: Option<DnsConfig>,
    /// The pod's annotations; the bandwidth ones are read from here.
    pub annotations: BTreeMap<String, String>,
}

/// A `portMappings` capability entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PortMapping {
    pub host_port: i32,
    pub container_port: i32,
    /// `tcp`, `udp` or `sctp` (lowercase, as the portmap plugin expects).
    pub protocol: String,
    #[serde(rename = "hostIP", default, skip_serializing_if = "String::is_empty")]
    pub host_ip: String,
}

/// A `dns` capability value.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DnsConfig {
    #[serde(default)]
    pub servers: Vec<String>,
    #[serde(default)]
    pub searches: Vec<String>,
    #[serde(default)]
    pub options: Vec<String>,
}

/// A `bandwidth` capability value: rates in bits per second, bursts in bits.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Bandwidth {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ingress_rate: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ingress_burst: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_rate: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_burst: Option<u64>,
}

/// The burst given with an annotation's rate: effectively unlimited, as the kubelet's own
/// bandwidth shaping did (the annotations carry no burst).
const UNLIMITED_BURST: u64 = i32::MAX as u64;

impl PortMapping {
    /// From a CRI port mapping; `None` when it publishes no host port (nothing for a plugin to do).
    pub fn from_cri(p: &cri::PortMapping) -> Option<PortMapping> {
        if p.host_port <= 0 {
            return None;
        }
        let protocol = match cri::Protocol::try_from(p.protocol).unwrap_or(cri::Protocol::Tcp) {
            cri::Protocol::Tcp => "tcp",
            cri::Protocol::Udp => "udp",
            cri::Protocol::Sctp => "sctp",
        };
        Some(PortMapping {
            host_port: p.host_port,
            container_port: p.container_port,
            protocol: protocol.into(),
            host_ip: p.host_ip.clone(),
        })
    }
}

impl DnsConfig {
    pub fn from_cri(d: &cri::DnsConfig) -> DnsConfig {
        DnsConfig {
            servers: d.servers.clone(),
            searches: d.searches.clone(),
            options: d.options.clone(),
        }
    }
}

impl PodNetwork {
    /// The request for a sandbox `id` pinned at `netns`, from its CRI sandbox config.
    pub fn from_sandbox_config(
        id: &str,
        netns: PathBuf,
        config: &cri::PodSandboxConfig,
    ) -> PodNetwork {
        let meta = config.metadata.clone().unwrap_or_default();
        PodNetwork {
            id: id.to_string(),
            netns,
            name: meta.name,
            namespace: meta.namespace,
            uid: meta.uid,
            if_name: POD_IF_NAME.into(),
            port_mappings: config
                .port_mappings
                .iter()
                .filter_map(PortMapping::from_cri)
                .collect(),
            dns: config.dns_config.as_ref().map(DnsConfig::from_cri),
            annotations: config
                .annotations
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        }
    }

    /// The interface name, `eth0` when unset.
    pub fn if_name(&self) -> &str {
        if self.if_name.is_empty() {
            POD_IF_NAME
        } else {
            &self.if_name
        }
    }

    /// Checks what the spec requires of the container id and interface name. The container id is
    /// also the cache file's name, so this keeps it a plain file name.
    pub fn validate(&self) -> Result<(), String> {
        let id = self.id.as_bytes();
        let ok_first = id.first().is_some_and(u8::is_ascii_alphanumeric);
        let ok_rest = id
            .iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-'));
        if !ok_first || !ok_rest {
            return Err(format!(
                "container id {:?} must be alphanumeric, then alphanumerics, '_', '.' or '-'",
                self.id
            ));
        }
        let ifn = self.if_name();
        if ifn.len() > 15
            || ifn == "."
            || ifn == ".."
            || ifn
                .chars()
                .any(|c| c == '/' || c == ':' || c.is_whitespace())
        {
            return Err(format!("interface name {ifn:?} is not a valid Linux name"));
        }
        Ok(())
    }

    /// `CNI_ARGS` (CNI conventions: `IgnoreUnknown=1` first, then the Kubernetes keys).
    pub fn cni_args(&self) -> String {
        format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={};K8S_POD_UID={}",
            self.namespace, self.name, self.id, self.uid
        )
    }

    /// The bandwidth limits from the pod's annotations, if any ([`bandwidth_of`]).
    pub fn bandwidth(&self) -> Result<Option<Bandwidth>, String> {
        bandwidth_of(|key| self.annotations.get(key).map(String::as_str))
    }

    /// Every capability argument this pod has, by capability name (CNI conventions). Each plugin
    /// gets the subset it declares.
    pub fn capability_args(&self) -> Result<Map<String, Value>, String> {
        let mut m = Map::new();
        if !self.port_mappings.is_empty() {
            m.insert("portMappings".into(), json(&self.port_mappings));
        }
        if let Some(dns) = &self.dns {
            m.insert("dns".into(), json(dns));
        }
        if let Some(bw) = self.bandwidth()? {
            m.insert("bandwidth".into(), json(&bw));
        }
        Ok(m)
    }
}

fn json<T: Serialize>(v: &T) -> Value {
    serde_json::to_value(v).expect("plain data serialises")
}

/// Parses a Kubernetes resource quantity in plain, decimal-suffix or binary-suffix form
/// (`1500`, `10M`, `2.5G`, `1Mi`), rounding up to a whole number.
pub fn parse_quantity(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, suffix) = s.split_at(split);
    let mult: u64 = match suffix {
        "" => 1,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "P" => 1_000_000_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        _ => return Err(format!("{s:?}: unknown suffix {suffix:?}")),
    };
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() && frac.is_empty() || frac.contains('.') {
        return Err(format!("{s:?} is not a quantity"));
    }
    let bad = |_| format!("{s:?} is not a quantity");
    let int: u64 = if int.is_empty() {
        0
    } else {
        int.parse().map_err(bad)?
    };
    let mut value = int
        .checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))?;
    if !frac.is_empty() {
        // frac digits d1 d2 ... : add ceil(0.d1d2... * mult), exactly, in u128.
        let digits: u128 = frac.parse().map_err(bad)?;
        let scale = 10u128
            .checked_pow(frac.len() as u32)
            .ok_or_else(|| format!("{s:?} has too many decimals"))?;
        let add = digits
            .checked_mul(mult as u128)
            .ok_or_else(|| format!("{s:?} has too many decimals"))?
            .div_ceil(scale);
        value = value
            .checked_add(add as u64)
            .ok_or_else(|| format!("{s:?} is too large"))?;
    }
    Ok(value)
}

/// The bandwidth limits a pod's annotations ask for, if any, read through `annotation`; an
/// error names the annotation whose value is not a quantity from 1k to 1P. RunPodSandbox checks
/// them before anything is created.
pub fn bandwidth_of<'a>(
    annotation: impl Fn(&str) -> Option<&'a str>,
) -> Result<Option<Bandwidth>, String> {
    let get = |key: &str| -> Result<Option<u64>, String> {
        match annotation(key) {
            None => Ok(None),
            Some(v) => {
                let bits = parse_quantity(v).map_err(|e| format!("annotation {key}: {e}"))?;
                // The kubelet's accepted range for these annotations.
                if !(1_000..=1_000_000_000_000_000).contains(&bits) {
                    return Err(format!("annotation {key}: {v:?} is not between 1k and 1P"));
                }
                Ok(Some(bits))
            }
        }
    };
    let ingress = get(INGRESS_BANDWIDTH_ANNOTATION)?;
    let egress = get(EGRESS_BANDWIDTH_ANNOTATION)?;
    if ingress.is_none() && egress.is_none() {
        return Ok(None);
    }
    Ok(Some(Bandwidth {
        ingress_rate: ingress,
        ingress_burst: ingress.map(|_| UNLIMITED_BURST),
        egress_rate: egress,
        egress_burst: egress.map(|_| UNLIMITED_BURST),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities() {
        assert_eq!(parse_quantity("1500").unwrap(), 1500);
        assert_eq!(parse_quantity("10M").unwrap(), 10_000_000);
        assert_eq!(parse_quantity("1Mi").unwrap(), 1_048_576);
        assert_eq!(parse_quantity("2.5k").unwrap(), 2500);
        assert_eq!(parse_quantity("0.5Ki").unwrap(), 512);
        assert_eq!(parse_quantity("1.0001").unwrap(), 2);
        // 38 decimals times a suffix overflowed the exact arithmetic (a panic in debug builds,
        // a wrong rate in release ones).
        assert!(parse_quantity("1.99999999999999999999999999999999999999M").is_err());
        assert_eq!(parse_quantity("0.9999999999999999999k").unwrap(), 1000);
        for bad in ["", "M", "1x", "1.2.3", "-1", "99999999999999999999"] {
            assert!(parse_quantity(bad).is_err(), "{bad:?}");
        }
    }

    fn pod() -> PodNetwork {
        PodNetwork {
            id: "abc123".into(),
            netns: "/run/minicri/netns/abc123".into(),
            name: "web".into(),
            namespace: "default".into(),
            uid: "u-1".into(),
            ..Default::default()
        }
    }

    #[test]
    fn cni_args_and_validation() {
        let p = pod();
        assert_eq!(
            p.cni_args(),
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web;K8S_POD_INFRA_CONTAINER_ID=abc123;K8S_POD_UID=u-1"
        );
        assert_eq!(p.if_name(), "eth0");
        p.validate().unwrap();
        for bad in ["", "-x", "a/b", "../x", "a b"] {
            let q = PodNetwork {
                id: bad.into(),
                ..pod()
            };
            assert!(q.validate().is_err(), "{bad:?}");
        }
        let q = PodNetwork {
            if_name: "a:b".into(),
            ..pod()
        };
        assert!(q.validate().is_err());
    }

    #[test]
    fn capability_args_from_cri() {
        let cfg = cri::PodSandboxConfig {
            metadata: Some(cri::PodSandboxMetadata {
                name: "web".into(),
                uid: "u-1".into(),
                namespace: "default".into(),
                attempt: 0,
            }),
            port_mappings: vec![
                cri::PortMapping {
                    protocol: cri::Protocol::Udp as i32,
                    container_port: 53,
                    host_port: 5353,
                    host_ip: "127.0.0.1".into(),
                },
                // No host port: not a mapping for the portmap plugin.
                cri::PortMapping {
                    protocol: cri::Protocol::Tcp as i32,
                    container_port: 80,
                    host_port: 0,
                    host_ip: String::new(),
                },
            ],
            dns_config: Some(cri::DnsConfig {
                servers: vec!["10.96.0.10".into()],
                searches: vec!["svc.cluster.local".into()],
                options: vec!["ndots:5".into()],
            }),
            annotations: [(INGRESS_BANDWIDTH_ANNOTATION.to_string(), "1M".to_string())]
                .into_iter()
                .collect(),
            ..Default::default()
        };
        let p = PodNetwork::from_sandbox_config("abc", "/n".into(), &cfg);
        assert_eq!(p.name, "web");
        let caps = Value::Object(p.capability_args().unwrap());
        assert_eq!(
            caps,
            serde_json::json!({
                "portMappings": [{"hostPort": 5353, "containerPort": 53, "protocol": "udp", "hostIP": "127.0.0.1"}],
                "dns": {"servers": ["10.96.0.10"], "searches": ["svc.cluster.local"], "options": ["ndots:5"]},
                "bandwidth": {"ingressRate": 1_000_000, "ingressBurst": i32::MAX},
            })
        );
        let mut bad = p.clone();
        bad.annotations
            .insert(EGRESS_BANDWIDTH_ANNOTATION.into(), "10".into());
        assert!(
            bad.capability_args()
                .unwrap_err()
                .contains("between 1k and 1P")
        );
    }
}

//! CNI plugin output: the ADD result and the error object.
//!
//! Owns the typed reading of a plugin's stdout. The raw JSON of a result is kept alongside the
//! typed fields, because the spec wants it passed on verbatim as the next plugin's `prevResult`
//! (unknown and version-specific fields included).
//!
//! Results of spec 0.3.0 to 1.1.0 share a shape (interfaces, ips with an `interface` index,
//! routes, dns); 0.3.x/0.4.0 add a `version` field to each IP, which is ignored here since the
//! address itself says its family.

use std::net::IpAddr;

use serde::Deserialize;
use serde_json::Value;

/// A plugin's ADD result (spec section 5, "Success").
#[derive(Debug, Clone, PartialEq)]
pub struct CniResult {
    pub cni_version: String,
    pub interfaces: Vec<Interface>,
    pub ips: Vec<IpConfig>,
    pub routes: Vec<Route>,
    pub dns: Dns,
    /// The result exactly as the plugin printed it (parsed), for `prevResult` and the cache.
    pub raw: Value,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Interface {
    pub name: String,
    #[serde(default)]
    pub mac: String,
    /// Set (netns path) for interfaces in the sandbox; empty for host interfaces.
    #[serde(default)]
    pub sandbox: String,
    #[serde(default)]
    pub mtu: Option<u32>,
}

/// One address; `interface` indexes [`CniResult::interfaces`].
#[derive(Debug, Clone, PartialEq)]
pub struct IpConfig {
    pub address: IpAddr,
    pub prefix_len: u8,
    pub gateway: Option<IpAddr>,
    pub interface: Option<usize>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Route {
    /// Destination as written (`0.0.0.0/0`).
    pub dst: String,
    pub gw: Option<IpAddr>,
}

#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Dns {
    #[serde(default)]
    pub nameservers: Vec<String>,
    #[serde(default)]
    pub domain: String,
    #[serde(default)]
    pub search: Vec<String>,
    #[serde(default)]
    pub options: Vec<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawResult {
    #[serde(default)]
    cni_version: String,
    #[serde(default)]
    interfaces: Vec<Interface>,
    #[serde(default)]
    ips: Vec<RawIp>,
    #[serde(default)]
    routes: Vec<RawRoute>,
    #[serde(default)]
    dns: Dns,
}

#[derive(Deserialize)]
struct RawIp {
    address: String,
    #[serde(default)]
    gateway: Option<String>,
    #[serde(default)]
    interface: Option<usize>,
}

#[derive(Deserialize)]
struct RawRoute {
    dst: String,
    #[serde(default)]
    gw: Option<String>,
}

/// Parses `a.b.c.d/n` or `x::y/n`.
pub fn parse_cidr(s: &str) -> Result<(IpAddr, u8), String> {
    let (addr, len) = s
        .split_once('/')
        .ok_or_else(|| format!("address {s:?} has no prefix length"))?;
    let addr: IpAddr = addr
        .parse()
        .map_err(|_| format!("address {s:?} is not an IP address"))?;
    let len: u8 = len
        .parse()
        .map_err(|_| format!("address {s:?} has a bad prefix length"))?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    if len > max {
        return Err(format!("address {s:?} has a prefix longer than {max}"));
    }
    Ok((addr, len))
}

fn parse_ip(field: &str, s: &str) -> Result<IpAddr, String> {
    s.parse()
        .map_err(|_| format!("{field} {s:?} is not an IP address"))
}

impl CniResult {
    /// Parses a result object (spec versions 0.3.0 to 1.1.0).
    pub fn from_value(raw: Value) -> Result<Self, String> {
        if !raw.is_object() {
            return Err("the result is not a JSON object".into());
        }
        let r: RawResult =
            serde_json::from_value(raw.clone()).map_err(|e| format!("bad result: {e}"))?;
        let mut ips = Vec::with_capacity(r.ips.len());
        for ip in r.ips {
            let (address, prefix_len) = parse_cidr(&ip.address)?;
            let gateway = match ip.gateway.as_deref() {
                None | Some("") => None,
                Some(g) => Some(parse_ip("gateway", g)?),
            };
            if let Some(i) = ip.interface
                && i >= r.interfaces.len()
            {
                return Err(format!(
                    "address {} names interface {i}, but there are {} interfaces",
                    ip.address,
                    r.interfaces.len()
                ));
            }
            ips.push(IpConfig {
                address,
                prefix_len,
                gateway,
                interface: ip.interface,
            });
        }
        let routes = r
            .routes
            .into_iter()
            .map(|rt| {
                let gw = match rt.gw.as_deref() {
                    None | Some("") => None,
                    Some(g) => Some(parse_ip("route gateway", g)?),
                };
                Ok(Route { dst: rt.dst, gw })
            })
            .collect::<Result<_, String>>()?;
        Ok(CniResult {
            cni_version: r.cni_version,
            interfaces: r.interfaces,
            ips,
            routes,
            dns: r.dns,
            raw,
        })
    }

    /// Parses a plugin's stdout.
    pub fn parse(stdout: &[u8]) -> Result<Self, String> {
        let v: Value = serde_json::from_slice(stdout).map_err(|e| {
            format!(
                "result is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&stdout[..stdout.len().min(200)])
            )
        })?;
        Self::from_value(v)
    }

    /// The pod's addresses: those on the sandbox interface named `if_name`, IPv4 before IPv6
    /// (the first is the primary pod IP), each family in result order. When no address names an
    /// interface (plugins may omit the index), every address counts.
    pub fn pod_ips(&self, if_name: &str) -> Vec<IpAddr> {
        let any_indexed = self.ips.iter().any(|ip| ip.interface.is_some());
        let on_pod_if = |ip: &&IpConfig| match ip.interface {
            Some(i) => self
                .interfaces
                .get(i)
                .is_some_and(|itf| itf.name == if_name && !itf.sandbox.is_empty()),
            None => !any_indexed,
        };
        let chosen: Vec<IpAddr> = self
            .ips
            .iter()
            .filter(on_pod_if)
            .map(|ip| ip.address)
            .collect();
        let (mut v4, v6): (Vec<_>, Vec<_>) = chosen.into_iter().partition(IpAddr::is_ipv4);
        v4.extend(v6);
        v4
    }
}

/// A plugin's error object (spec section 5, "Error"), printed on stdout with a non-zero exit.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
pub struct PluginError {
    #[serde(default)]
    pub code: u32,
    #[serde(default)]
    pub msg: String,
    #[serde(default)]
    pub details: String,
}

impl PluginError {
    /// Reads the error object from stdout, if that is what it holds.
    pub fn parse(stdout: &[u8]) -> Option<PluginError> {
        let v: Value = serde_json::from_slice(stdout).ok()?;
        let has_fields = v.get("code").is_some() || v.get("msg").is_some();
        if !has_fields {
            return None;
        }
        serde_json::from_value(v).ok()
    }

    /// The spec's name for a well-known code (spec section 5, "Error"); codes above 99 belong to
    /// the plugin.
    pub fn code_name(&self) -> Option<&'static str> {
        Some(match self.code {
            1 => "incompatible CNI version",
            2 => "unsupported field in network configuration",
            3 => "container unknown or does not exist",
            4 => "invalid necessary environment variables",
            5 => "I/O failure",
            6 => "failed to decode content",
            7 => "invalid network config",
            11 => "try again later",
            50 => "plugin not available",
            51 => "plugin not available, limited connectivity",
            _ => return None,
        })
    }
}

impl std::fmt::Display for PluginError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.msg)?;
        if !self.details.is_empty() {
            write!(f, ": {}", self.details)?;
        }
        write!(f, " (code {}", self.code)?;
        if let Some(n) = self.code_name() {
            write!(f, ", {n}")?;
        }
        write!(f, ")")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The shape the bridge plugin prints (spec 1.0.0): host bridge, host veth, pod eth0.
    const BRIDGE_1_0: &str = r#"{
      "cniVersion": "1.0.0",
      "interfaces": [
        {"name": "cni0", "mac": "aa:bb:cc:00:00:01"},
        {"name": "veth1234", "mac": "aa:bb:cc:00:00:02"},
        {"name": "eth0", "mac": "aa:bb:cc:00:00:03", "sandbox": "/run/netns/x"}
      ],
      "ips": [
        {"interface": 2, "address": "fd00::5/64", "gateway": "fd00::1"},
        {"interface": 2, "address": "10.1.0.5/24", "gateway": "10.1.0.1"},
        {"interface": 0, "address": "10.1.0.1/24"}
      ],
      "routes": [{"dst": "0.0.0.0/0"}, {"dst": "10.2.0.0/16", "gw": "10.1.0.254"}],
      "dns": {"nameservers": ["10.1.0.10"], "search": ["svc.local"]}
    }"#;

    #[test]
    fn parses_a_1_0_result() {
        let r = CniResult::parse(BRIDGE_1_0.as_bytes()).unwrap();
        assert_eq!(r.cni_version, "1.0.0");
        assert_eq!(r.interfaces.len(), 3);
        assert_eq!(r.interfaces[2].sandbox, "/run/netns/x");
        assert_eq!(r.ips[1].prefix_len, 24);
        assert_eq!(r.ips[1].gateway, Some("10.1.0.1".parse().unwrap()));
        assert_eq!(r.routes[1].gw, Some("10.1.0.254".parse().unwrap()));
        assert_eq!(r.dns.nameservers, ["10.1.0.10"]);
        // IPv4 first; the bridge's own address (interface 0, no sandbox) is not a pod IP.
        let ips: Vec<String> = r.pod_ips("eth0").iter().map(|i| i.to_string()).collect();
        assert_eq!(ips, ["10.1.0.5", "fd00::5"]);
        assert!(r.pod_ips("eth1").is_empty());
        assert_eq!(r.raw["interfaces"][0]["name"], "cni0");
    }

    #[test]
    fn parses_0_3_and_0_4_results() {
        let text = r#"{"cniVersion":"0.4.0","interfaces":[{"name":"eth0","sandbox":"/n"}],
            "ips":[{"version":"4","interface":0,"address":"10.0.0.2/16","gateway":"10.0.0.1"}],
            "dns":{}}"#;
        let r = CniResult::parse(text.as_bytes()).unwrap();
        assert_eq!(r.pod_ips("eth0"), ["10.0.0.2".parse::<IpAddr>().unwrap()]);
        let text = r#"{"cniVersion":"0.3.1","ips":[{"version":"4","address":"10.0.0.3/16"}]}"#;
        let r = CniResult::parse(text.as_bytes()).unwrap();
        // No interface indexes at all: every address is the pod's.
        assert_eq!(r.pod_ips("eth0"), ["10.0.0.3".parse::<IpAddr>().unwrap()]);
    }

    #[test]
    fn rejects_bad_results() {
        for (text, want) in [
            ("nope", "not JSON"),
            ("[1]", "not a JSON object"),
            (r#"{"ips":[{"address":"10.0.0.1"}]}"#, "no prefix length"),
            (r#"{"ips":[{"address":"10.0.0.1/33"}]}"#, "prefix longer"),
            (r#"{"ips":[{"address":"x/8"}]}"#, "not an IP"),
            (
                r#"{"ips":[{"address":"10.0.0.1/8","interface":1}]}"#,
                "names interface 1",
            ),
            (
                r#"{"ips":[{"address":"10.0.0.1/8","gateway":"g"}]}"#,
                "gateway",
            ),
        ] {
            let e = CniResult::parse(text.as_bytes()).unwrap_err();
            assert!(e.contains(want), "{text}: {e}");
        }
    }

    #[test]
    fn parses_plugin_errors() {
        let e = PluginError::parse(
            br#"{"cniVersion":"1.0.0","code":7,"msg":"bad subnet","details":"10.0.0.0/33"}"#,
        )
        .unwrap();
        assert_eq!(e.code, 7);
        assert_eq!(
            e.to_string(),
            "bad subnet: 10.0.0.0/33 (code 7, invalid network config)"
        );
        let e = PluginError::parse(br#"{"code":100,"msg":"custom"}"#).unwrap();
        assert_eq!(e.to_string(), "custom (code 100)");
        assert!(PluginError::parse(b"panic: oops").is_none());
        assert!(PluginError::parse(br#"{"cniVersion":"1.0.0","ips":[]}"#).is_none());
    }
}

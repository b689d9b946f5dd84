//! Where registry traffic may go on the node itself: the one place that decides whether a
//! redirect's or a token realm's destination may be one of the node's own addresses.
//!
//! A registry (or whoever answers in its place) picks the URLs of its redirects and token
//! realms. minicri sends a request there as root, from the node's network namespace, and what a
//! failed request got back reaches the pod's events. Without a rule, a registry on the internet
//! could make the node GET its own services: a cloud's metadata service on 169.254.169.254, the
//! kubelet's ports, anything listening on 127.0.0.1.
//!
//! The rule, applied to every hop of every request ([`route`], called by `http::send`):
//! - a destination is *trusted* ([`Trusted`]) when its host is the image's registry host as
//!   the reference names it, at any port (whoever names the image can name any port of that
//!   host directly: `127.0.0.1:5000/app` is a node-local registry, a normal setup), or when its
//!   host and port are those of an endpoint the registry's hosts.toml configures (server or
//!   mirror; that port only: the operator configured one service there, not the whole host).
//!   Requests to trusted destinations go out as they are;
//! - any other destination must not be on the node. An IP literal that is [`Local`] is refused
//!   before anything is sent; a name is resolved by [`GuardedResolver`], which drops the local
//!   addresses it resolves to and fails when none is left. The connection then goes only to
//!   addresses that were checked, so a name that resolves elsewhere at one look-up and to the
//!   node at the next (DNS rebinding) is caught as well.
//!
//! Local addresses ([`classify`]): loopback (`127.0.0.0/8`, `::1`); unspecified (`0.0.0.0/8`,
//! `::`: connecting to them reaches the node's own listeners on Linux); link-local
//! (`169.254.0.0/16`, where clouds serve instance metadata, and `fe80::/10`); any of these in
//! IPv4-mapped or IPv4-compatible IPv6 form (`::ffff:127.0.0.1`); and every address of every
//! interface of the node ([`node_addresses`], read with getifaddrs at most every
//! [`NODE_ADDRESSES_TTL`]).
//!
//! Not covered, and written down in docs/hardening.md: other hosts of the node's networks (pod
//! IPs, cluster IPs that are not interface addresses, private ranges), and names a proxy from
//! `HTTPS_PROXY` resolves (IP literals are still refused).

use std::collections::HashSet;
use std::net::{IpAddr, Ipv6Addr, SocketAddr, ToSocketAddrs as _};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::Url;

use crate::hosts::Endpoint;

/// How long the node's address list is reused before getifaddrs is asked again. Interfaces and
/// their addresses change rarely (a CNI bridge's first pod, a new interface), and only
/// destinations that are not trusted are checked against the list.
pub const NODE_ADDRESSES_TTL: Duration = Duration::from_secs(5);

/// Why an address is on the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Local {
    /// `127.0.0.0/8`, `::1`.
    Loopback,
    /// `0.0.0.0/8`, `::`.
    Unspecified,
    /// `169.254.0.0/16`, `fe80::/10`.
    LinkLocal,
    /// An address of one of the node's interfaces.
    Node,
}

impl std::fmt::Display for Local {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Local::Loopback => "a loopback address",
            Local::Unspecified => "an unspecified address (it reaches the node's own listeners)",
            Local::LinkLocal => "a link-local address (where clouds serve instance metadata)",
            Local::Node => "one of the node's own addresses",
        })
    }
}

/// The IPv4 address an IPv6 address carries in IPv4-mapped (`::ffff:a.b.c.d`) or deprecated
/// IPv4-compatible (`::a.b.c.d`) form. `::` and `::1` are IPv6 addresses of their own.
fn embedded_v4(ip: &Ipv6Addr) -> Option<std::net::Ipv4Addr> {
    if let Some(v4) = ip.to_ipv4_mapped() {
        return Some(v4);
    }
    let s = ip.segments();
    (s[..6] == [0; 6] && (s[6] != 0 || s[7] > 1)).then(|| ip.to_ipv4().expect("::/96"))
}

/// Whether `ip` is on the node, and why; `node` is the node's interface addresses.
pub fn classify(ip: IpAddr, node: &HashSet<IpAddr>) -> Option<Local> {
    let ip = match ip {
        IpAddr::V6(v6) => embedded_v4(&v6).map_or(ip, IpAddr::V4),
        v4 => v4,
    };
    let class = match ip {
        IpAddr::V4(v4) if v4.is_loopback() => Some(Local::Loopback),
        IpAddr::V4(v4) if v4.octets()[0] == 0 => Some(Local::Unspecified),
        IpAddr::V4(v4) if v4.is_link_local() => Some(Local::LinkLocal),
        IpAddr::V6(v6) if v6.is_loopback() => Some(Local::Loopback),
        IpAddr::V6(v6) if v6.is_unspecified() => Some(Local::Unspecified),
        IpAddr::V6(v6) if v6.is_unicast_link_local() => Some(Local::LinkLocal),
        _ => None,
    };
    class.or_else(|| node.contains(&ip).then_some(Local::Node))
}

/// The addresses of the node's interfaces (cached for [`NODE_ADDRESSES_TTL`]).
pub fn node_addresses() -> Result<Arc<HashSet<IpAddr>>, String> {
    static CACHE: Mutex<Option<(Instant, Arc<HashSet<IpAddr>>)>> = Mutex::new(None);
    let mut cache = CACHE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((at, set)) = &*cache
        && at.elapsed() < NODE_ADDRESSES_TTL
    {
        return Ok(set.clone());
    }
    let set = Arc::new(read_node_addresses()?);
    *cache = Some((Instant::now(), set.clone()));
    Ok(set)
}

fn read_node_addresses() -> Result<HashSet<IpAddr>, String> {
    let list = nix::ifaddrs::getifaddrs()
        .map_err(|e| format!("cannot list the node's addresses (getifaddrs): {e}"))?;
    Ok(list
        .filter_map(|a| a.address)
        .filter_map(|a| {
            if let Some(v4) = a.as_sockaddr_in() {
                Some(IpAddr::V4(v4.ip()))
            } else {
                a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
            }
        })
        .collect())
}

/// The host of `url` as an IP address, if it is a literal (`[v6]` without its brackets).
fn literal(url: &Url) -> Option<IpAddr> {
    let host = url.host_str()?;
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .parse()
        .ok()
}

/// `host[:port]` (or `[v6][:port]`) as a URL of `scheme` would name it: lower case, IPv4 in
/// dotted form, IPv6 in brackets, and the port (the scheme's default when none is written).
fn host_and_port(scheme: &str, authority: &str) -> Option<(String, u16)> {
    let url = Url::parse(&format!("{scheme}://{authority}/")).ok()?;
    Some((url.host_str()?.to_string(), url.port_or_known_default()?))
}

/// The destinations a pull session may send to even when they are on the node: see the module
/// docs.
#[derive(Debug, Clone)]
pub struct Trusted {
    /// The registry's host as the image reference names it, without its port.
    registry_host: Option<String>,
    /// Host and port of each configured endpoint.
    endpoints: Vec<(String, u16)>,
}

impl Trusted {
    /// The trusted destinations of a session for an image on `registry` (the reference's
    /// domain, `host[:port]`) whose endpoints are `endpoints`.
    pub fn new(registry: &str, endpoints: &[Endpoint]) -> Trusted {
        Trusted {
            registry_host: host_and_port("http", registry).map(|(host, _)| host),
            endpoints: endpoints
                .iter()
                .filter_map(|e| host_and_port(if e.plain_http { "http" } else { "https" }, &e.host))
                .collect(),
        }
    }

    /// Whether `url` goes to a trusted destination.
    pub fn allows(&self, url: &Url) -> bool {
        let Some(host) = url.host_str() else {
            return false;
        };
        if self.registry_host.as_deref() == Some(host) {
            return true;
        }
        let port = url.port_or_known_default();
        self.endpoints
            .iter()
            .any(|(h, p)| h == host && Some(*p) == port)
    }

    /// Whether `url` is a trusted loopback IP literal: the one place a registry reached over
    /// https may send the daemon to over plain http (`http::is_downgrade`).
    pub fn allows_plain_http_to(&self, url: &Url) -> bool {
        self.allows(url) && literal(url).is_some_and(|ip| ip.is_loopback())
    }
}

/// A destination refused because it is on the node. Returned by [`route`], and by
/// [`GuardedResolver`] inside the HTTP client's error, where `http::send` finds it.
#[derive(Debug, Clone)]
pub struct Refused {
    /// The host as the URL names it.
    pub host: String,
    /// Why: which local addresses it is or resolves to.
    pub reason: String,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}; a redirect or token realm may reach the node itself only at the image's \
             registry host or at a host and port its hosts.toml configures",
            self.reason
        )
    }
}

impl std::error::Error for Refused {}

/// Which HTTP client a request goes out with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// A trusted destination: the system resolver, any address.
    Direct,
    /// Any other: IP literals checked here, names resolved by [`GuardedResolver`].
    Guarded,
}

/// How a request to `url` may go out, or why it may not.
pub fn route(url: &Url, trusted: &Trusted) -> Result<Route, Refused> {
    if trusted.allows(url) {
        return Ok(Route::Direct);
    }
    let Some(ip) = literal(url) else {
        return Ok(Route::Guarded);
    };
    let host = url.host_str().unwrap_or_default().to_string();
    let node = node_addresses().map_err(|reason| Refused {
        host: host.clone(),
        reason,
    })?;
    match classify(ip, &node) {
        None => Ok(Route::Guarded),
        Some(class) => Err(Refused {
            reason: format!("{host} is {class}"),
            host,
        }),
    }
}

/// Of the addresses `name` resolved to, those not on the node; refused when none is left.
pub fn keep_remote(
    name: &str,
    addrs: Vec<SocketAddr>,
    node: &HashSet<IpAddr>,
) -> Result<Vec<SocketAddr>, Refused> {
    let (local, remote): (Vec<_>, Vec<_>) = addrs
        .into_iter()
        .partition(|a| classify(a.ip(), node).is_some());
    if !local.is_empty() {
        tracing::debug!(name, ?local, ?remote, "dropped addresses on the node");
    }
    if !remote.is_empty() {
        return Ok(remote);
    }
    let listed: Vec<String> = local
        .iter()
        .map(|a| {
            let class = classify(a.ip(), node).expect("partitioned as local");
            format!("{}: {class}", a.ip())
        })
        .collect();
    Err(Refused {
        host: name.to_string(),
        reason: if listed.is_empty() {
            format!("{name} resolves to no address")
        } else {
            format!(
                "{name} resolves only to addresses on the node ({})",
                listed.join("; ")
            )
        },
    })
}

/// The resolver of the clients that reach destinations that are not trusted: the system's
/// (getaddrinfo, on a blocking thread), without the addresses on the node.
#[derive(Debug, Default)]
pub struct GuardedResolver;

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let name = name.as_str().to_string();
        Box::pin(async move {
            let addrs = tokio::task::spawn_blocking(move || {
                // Port 0: the client puts in the URL's port.
                let addrs: Vec<SocketAddr> = (name.as_str(), 0).to_socket_addrs()?.collect();
                let node = node_addresses().map_err(|reason| Refused {
                    host: name.clone(),
                    reason,
                })?;
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(keep_remote(&name, addrs, &node)?)
            })
            .await??;
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn every_local_class_is_recognised() {
        let node: HashSet<IpAddr> = [ip("192.0.2.7"), ip("2001:db8::7")].into();
        for (addr, class) in [
            ("127.0.0.1", Local::Loopback),
            ("127.255.0.9", Local::Loopback),
            ("::1", Local::Loopback),
            ("::ffff:127.0.0.1", Local::Loopback),
            ("::127.0.0.1", Local::Loopback),
            ("0.0.0.0", Local::Unspecified),
            ("0.1.2.3", Local::Unspecified),
            ("::", Local::Unspecified),
            ("::ffff:0.0.0.0", Local::Unspecified),
            ("169.254.169.254", Local::LinkLocal),
            ("::ffff:169.254.169.254", Local::LinkLocal),
            ("fe80::1", Local::LinkLocal),
            ("febf::1", Local::LinkLocal),
            ("192.0.2.7", Local::Node),
            ("::ffff:192.0.2.7", Local::Node),
            ("2001:db8::7", Local::Node),
        ] {
            assert_eq!(classify(ip(addr), &node), Some(class), "{addr}");
        }
        for addr in [
            "192.0.2.8",
            "10.0.0.1",
            "198.18.0.2",
            "8.8.8.8",
            "169.255.0.1",
            "2001:db8::8",
            "fec0::1",
            "fd00::1",
            "::ffff:8.8.8.8",
            "64:ff9b::7f00:1",
        ] {
            assert_eq!(classify(ip(addr), &node), None, "{addr}");
        }
    }

    #[test]
    fn the_node_addresses_include_loopback_and_every_interface() {
        let node = node_addresses().unwrap();
        assert!(node.contains(&ip("127.0.0.1")), "{node:?}");
        // Every address the kernel lists for an interface (IPv6 ones in /proc/net/if_inet6).
        let inet6 = std::fs::read_to_string("/proc/net/if_inet6").unwrap_or_default();
        for line in inet6.lines() {
            let hex = line.split_whitespace().next().unwrap();
            let bits = u128::from_str_radix(hex, 16).unwrap();
            let addr = IpAddr::V6(Ipv6Addr::from(bits));
            assert!(node.contains(&addr), "{addr} missing from {node:?}");
        }
    }

    fn url(s: &str) -> Url {
        Url::parse(s).unwrap()
    }

    fn endpoint(host: &str, plain_http: bool) -> Endpoint {
        Endpoint {
            plain_http,
            ..crate::hosts::default_endpoint(host)
        }
    }

    #[test]
    fn the_registry_host_is_trusted_at_any_port_configured_endpoints_at_theirs() {
        let t = Trusted::new(
            "127.0.0.1:5000",
            &[
                endpoint("127.0.0.1:5000", true),
                endpoint("[::1]:65001", true),
                endpoint("Mirror.Example", false),
            ],
        );
        for u in [
            "http://127.0.0.1:5000/v2/",
            "http://127.0.0.1:5001/token",
            "https://127.0.0.1/x",
            "http://2130706433:9/x",
            "http://[::1]:65001/v2/",
            "https://mirror.example/v2/",
            "https://mirror.example:443/v2/",
        ] {
            assert!(t.allows(&url(u)), "{u}");
        }
        for u in [
            "http://[::1]:65002/x",
            "http://[::ffff:127.0.0.1]:5000/x",
            "http://127.0.0.2:5000/x",
            "http://localhost:5000/x",
            "http://mirror.example/x",
            "https://mirror.example:8443/x",
            "https://sub.mirror.example/x",
        ] {
            assert!(!t.allows(&url(u)), "{u}");
        }
        let hub = Trusted::new("docker.io", &[endpoint("registry-1.docker.io", false)]);
        assert!(hub.allows(&url("https://docker.io:444/x")));
        assert!(hub.allows(&url("https://registry-1.docker.io/v2/")));
        assert!(!hub.allows(&url("http://registry-1.docker.io/v2/")));
        assert!(!hub.allows(&url("https://auth.docker.io/token")));
    }

    #[test]
    fn plain_http_from_https_only_to_a_trusted_loopback_literal() {
        let t = Trusted::new(
            "r.example",
            &[
                endpoint("r.example", false),
                endpoint("127.0.0.1:65001", true),
                endpoint("10.0.0.5:5000", true),
            ],
        );
        assert!(t.allows_plain_http_to(&url("http://127.0.0.1:65001/x")));
        for u in [
            "http://127.0.0.1:65002/x",
            "http://10.0.0.5:5000/x",
            "http://r.example/x",
        ] {
            assert!(!t.allows_plain_http_to(&url(u)), "{u}");
        }
    }

    #[test]
    fn literals_on_the_node_are_refused_unless_trusted() {
        let t = Trusted::new(
            "r.example",
            &[
                endpoint("r.example", false),
                endpoint("127.0.0.1:65001", true),
            ],
        );
        assert_eq!(
            route(&url("http://127.0.0.1:65001/v2/x"), &t).unwrap(),
            Route::Direct
        );
        assert_eq!(
            route(&url("https://r.example/v2/x"), &t).unwrap(),
            Route::Direct
        );
        // Names and remote literals go out through the guarded resolver.
        for u in [
            "https://cdn.example/blob",
            "http://localhost:8080/x",
            "http://198.18.0.2/x",
            "http://[2001:db8::1]/x",
        ] {
            assert_eq!(route(&url(u), &t).unwrap(), Route::Guarded, "{u}");
        }
        for (u, why) in [
            ("http://127.0.0.1:8080/x", "127.0.0.1 is a loopback address"),
            (
                "http://127.0.0.1:65002/x",
                "127.0.0.1 is a loopback address",
            ),
            ("http://2130706433/x", "127.0.0.1 is a loopback address"),
            ("http://[::1]:8080/x", "[::1] is a loopback address"),
            (
                "http://[::ffff:127.0.0.1]:8080/x",
                "[::ffff:7f00:1] is a loopback address",
            ),
            ("http://0.0.0.0:8080/x", "0.0.0.0 is an unspecified address"),
            ("http://[::]:8080/x", "[::] is an unspecified address"),
            (
                "http://169.254.169.254/latest/meta-data/",
                "169.254.169.254 is a link-local address",
            ),
            ("http://[fe80::1]/x", "[fe80::1] is a link-local address"),
        ] {
            let refused = route(&url(u), &t).unwrap_err();
            assert!(refused.to_string().starts_with(why), "{u}: {refused}");
            assert!(refused.to_string().contains("hosts.toml"), "{u}: {refused}");
        }
        // Every address of the node's own interfaces.
        for addr in node_addresses().unwrap().iter() {
            let host = match addr {
                IpAddr::V4(v4) => v4.to_string(),
                IpAddr::V6(v6) => format!("[{v6}]"),
            };
            // A link-local address with a zone cannot be written in a URL; the class covers it.
            let Ok(u) = Url::parse(&format!("http://{host}:8080/x")) else {
                continue;
            };
            assert!(route(&u, &t).is_err(), "{u}");
        }
    }

    #[test]
    fn resolved_names_lose_their_local_addresses() {
        let node: HashSet<IpAddr> = [ip("192.0.2.7")].into();
        let sa = |s: &str| -> SocketAddr { s.parse().unwrap() };
        // A name with addresses on and off the node keeps the others.
        let kept = keep_remote(
            "mixed.example",
            vec![sa("127.0.0.1:0"), sa("198.18.0.2:0"), sa("[::1]:0")],
            &node,
        )
        .unwrap();
        assert_eq!(kept, [sa("198.18.0.2:0")]);
        // One with only local addresses (localhost, or a name rebound to the node) is refused,
        // naming each address and why.
        let refused = keep_remote(
            "rebound.example",
            vec![
                sa("127.0.0.1:0"),
                sa("169.254.169.254:0"),
                sa("192.0.2.7:0"),
            ],
            &node,
        )
        .unwrap_err();
        let msg = refused.to_string();
        for part in [
            "rebound.example resolves only to addresses on the node",
            "127.0.0.1: a loopback address",
            "169.254.169.254: a link-local address",
            "192.0.2.7: one of the node's own addresses",
        ] {
            assert!(msg.contains(part), "{msg}");
        }
        assert!(keep_remote("empty.example", vec![], &node).is_err());
    }

    #[tokio::test]
    async fn the_guarded_resolver_refuses_localhost() {
        use reqwest::dns::Resolve as _;
        let err = GuardedResolver
            .resolve("localhost".parse().unwrap())
            .await
            .err()
            .expect("localhost is refused");
        let refused = err.downcast_ref::<Refused>().expect("a Refused error");
        assert_eq!(refused.host, "localhost");
        assert!(refused.reason.contains("a loopback address"), "{refused}");
    }
}

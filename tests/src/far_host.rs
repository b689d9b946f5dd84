//! Owns [`FarHost`]: a network namespace joined to the test's by a veth pair, for a server on
//! an address that is neither loopback nor one of the node's own, which is what a registry
//! elsewhere on the network looks like to minicri (it refuses to follow a registry to the
//! node's own addresses: `store::registry::dest`).
//!
//! The far end of the pair, inside the namespace, has the far address ([`FarHost::far_ip`]);
//! sockets for it are made inside the namespace ([`FarHost::listen`]) and can then be served
//! from any thread. The near end, in the test's namespace, has the near address
//! ([`FarHost::near_ip`]): an address of one of the node's interfaces that is not loopback.
//! Both come from 198.18.0.0/15 (set aside for network tests, RFC 2544), one random /30 per
//! host. Root only; the namespace and the pair go on drop, also when a test fails.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::os::fd::AsFd as _;
use std::process::Command;

use anyhow::{Context, Result, bail};

pub struct FarHost {
    netns: String,
    near_if: String,
    near: Ipv4Addr,
    far: Ipv4Addr,
}

impl std::fmt::Debug for FarHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FarHost")
            .field("netns", &self.netns)
            .field("near", &self.near)
            .field("far", &self.far)
            .finish()
    }
}

/// Runs `ip args`, failing with its stderr.
fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("running ip (iproute2)")?;
    if !out.status.success() {
        bail!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Whether any interface of the test's namespace has an address in `net` (`a.b.c.d/len`).
fn in_use(net: &str) -> Result<bool> {
    let out = Command::new("ip")
        .args(["-o", "addr", "show", "to", net])
        .output()
        .context("running ip (iproute2)")?;
    Ok(!out.stdout.is_empty())
}

impl FarHost {
    /// Makes the namespace and the veth pair, with a /30 of 198.18.0.0/15 no interface here uses.
    pub fn create() -> Result<FarHost> {
        for _ in 0..16 {
            let block: u32 = rand::random_range(0..(1 << 15));
            let base = u32::from(Ipv4Addr::new(198, 18, 0, 0)) + block * 4;
            let (near, far) = (Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2));
            if in_use(&format!("{}/30", Ipv4Addr::from(base)))? {
                continue;
            }
            let host = FarHost {
                netns: format!("minicri-far-{block:x}-{}", std::process::id()),
                near_if: format!("mcfar{block:x}"),
                near,
                far,
            };
            host.set_up()
                .with_context(|| format!("setting up {host:?}"))?;
            return Ok(host);
        }
        bail!("no free /30 in 198.18.0.0/15 after 16 tries")
    }

    fn set_up(&self) -> Result<()> {
        let far_if = "eth0";
        let (near, far) = (format!("{}/30", self.near), format!("{}/30", self.far));
        ip(&["netns", "add", &self.netns])?;
        ip(&[
            "link",
            "add",
            &self.near_if,
            "type",
            "veth",
            "peer",
            "name",
            far_if,
            "netns",
            &self.netns,
        ])?;
        ip(&["addr", "add", &near, "dev", &self.near_if])?;
        ip(&["link", "set", &self.near_if, "up"])?;
        ip(&["-n", &self.netns, "addr", "add", &far, "dev", far_if])?;
        ip(&["-n", &self.netns, "link", "set", far_if, "up"])?;
        ip(&["-n", &self.netns, "link", "set", "lo", "up"])
    }

    /// The far end's address, inside the namespace: not loopback, not the node's.
    pub fn far_ip(&self) -> Ipv4Addr {
        self.far
    }

    /// The near end's address: one of the node's own, not loopback.
    pub fn near_ip(&self) -> Ipv4Addr {
        self.near
    }

    /// A TCP listener on the far address at `port` (0: a free one), made inside the namespace.
    pub fn listen(&self, port: u16) -> Result<TcpListener> {
        let path = format!("/run/netns/{}", self.netns);
        let addr = SocketAddr::from((self.far, port));
        // setns(2) moves only the calling thread: a thread of its own enters, binds and ends.
        std::thread::scope(|s| {
            s.spawn(|| -> Result<TcpListener> {
                let ns = std::fs::File::open(&path).with_context(|| format!("opening {path}"))?;
                nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                    .with_context(|| format!("entering {path}"))?;
                TcpListener::bind(addr).with_context(|| format!("binding {addr} in {path}"))
            })
            .join()
            .expect("the binding thread does not panic")
        })
    }
}

impl Drop for FarHost {
    fn drop(&mut self) {
        // Deleting one end of a veth pair deletes the other.
        let _ = ip(&["link", "del", &self.near_if]);
        let _ = ip(&["netns", "del", &self.netns]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read as _, Write as _};

    #[test]
    fn the_far_end_serves_the_near_end() {
        if crate::prereq::skip_unless_root() {
            return;
        }
        let host = FarHost::create().unwrap();
        let listener = host.listen(0).unwrap();
        let addr = listener.local_addr().unwrap();
        assert_eq!(addr.ip(), host.far_ip());
        let server = std::thread::spawn(move || {
            let (mut conn, peer) = listener.accept().unwrap();
            conn.write_all(b"far").unwrap();
            peer
        });
        let mut conn = std::net::TcpStream::connect(addr).unwrap();
        let mut got = String::new();
        conn.read_to_string(&mut got).unwrap();
        assert_eq!(got, "far");
        // The connection came from the near end, an address of the test's namespace.
        assert_eq!(server.join().unwrap().ip(), host.near_ip());
        let netns = format!("/run/netns/{}", host.netns);
        drop(host);
        assert!(!std::path::Path::new(&netns).exists());
    }
}

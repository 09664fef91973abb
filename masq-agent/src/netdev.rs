//! What the agent needs to know about the node's network devices, read from the kernel of the
//! network namespace the agent runs in.

use std::net::{Ipv4Addr, Ipv6Addr};

use anyhow::{Context as _, bail};

/// A device the eBPF programs attach to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    pub name: String,
    pub index: u32,
    /// The primary IPv4 address: masqueraded packets leave with it as their source.
    pub ipv4: Ipv4Addr,
    /// The first global IPv6 address, which masqueraded IPv6 packets leave with.
    pub ipv6: Option<Ipv6Addr>,
}

/// The devices that hold an IPv4 default route (`/proc/net/route`), in table order.
pub fn default_route_devices() -> anyhow::Result<Vec<String>> {
    let table = std::fs::read_to_string("/proc/net/route").context("reading /proc/net/route")?;
    let mut names: Vec<String> = Vec::new();
    for line in table.lines().skip(1) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // Iface Destination Gateway Flags RefCnt Use Metric Mask ...
        if fields.len() > 7 && fields[1] == "00000000" && fields[7] == "00000000" {
            let name = fields[0].to_string();
            if !names.contains(&name) {
                names.push(name);
            }
        }
    }
    Ok(names)
}

/// Resolves `name` to its index and primary IPv4 address.
pub fn device(name: &str) -> anyhow::Result<Device> {
    let index = nix::net::if_::if_nametoindex(name)
        .with_context(|| format!("interface {name} does not exist"))?;
    let addrs: Vec<nix::ifaddrs::InterfaceAddress> = nix::ifaddrs::getifaddrs()
        .context("getifaddrs")?
        .filter(|a| a.interface_name == name)
        .collect();
    // The first address the kernel lists is the primary one.
    let Some(ipv4) = addrs
        .iter()
        .find_map(|a| a.address?.as_sockaddr_in().map(|s| s.ip()))
    else {
        bail!("interface {name} has no IPv4 address to masquerade to");
    };
    let ipv6 = addrs
        .iter()
        .filter_map(|a| a.address?.as_sockaddr_in6().map(|s| s.ip()))
        .find(is_global_ipv6);
    Ok(Device {
        name: name.to_string(),
        index,
        ipv4,
        ipv6,
    })
}

/// An address other hosts can reply to from beyond the link: not link-local, loopback,
/// multicast or unspecified. Unique local addresses count, as they do for the kernel's
/// source address selection.
fn is_global_ipv6(addr: &Ipv6Addr) -> bool {
    !(addr.is_unspecified()
        || addr.is_loopback()
        || addr.is_multicast()
        || addr.is_unicast_link_local())
}

/// The node's ephemeral port range (`net.ipv4.ip_local_port_range`).
pub fn ephemeral_port_range() -> anyhow::Result<(u16, u16)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .context("reading net.ipv4.ip_local_port_range")?;
    let mut words = text.split_whitespace().map(str::parse::<u16>);
    match (words.next(), words.next()) {
        (Some(Ok(lo)), Some(Ok(hi))) if lo <= hi => Ok((lo, hi)),
        _ => bail!("unexpected net.ipv4.ip_local_port_range {text:?}"),
    }
}

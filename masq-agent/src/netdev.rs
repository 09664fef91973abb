//! What the agent needs to know about the node's network devices, read from the kernel of the
//! network namespace the agent runs in.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use anyhow::{Context as _, bail};

use crate::policy::{IpFamilies, IpFamily};

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

/// The devices that hold a default route, in table order: IPv4's (`/proc/net/route`), then,
/// for IPv6 among `families`, IPv6's (`/proc/net/ipv6_route`).
pub fn default_route_devices(families: IpFamilies) -> anyhow::Result<Vec<String>> {
    let mut names = ipv4_default_route_devices(&read_proc("/proc/net/route")?);
    if families.contains(IpFamily::Ipv6) {
        for name in ipv6_default_route_devices(&read_proc("/proc/net/ipv6_route")?) {
            if !names.contains(&name) {
                names.push(name);
            }
        }
    }
    Ok(names)
}

fn read_proc(path: &str) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {path}"))
}

/// A route that refuses packets (`unreachable`, `prohibit`, `blackhole`) carries none.
const RTF_REJECT: u32 = 0x0200;

/// `/proc/net/route`: Iface Destination Gateway Flags RefCnt Use Metric Mask ...
fn ipv4_default_route_devices(table: &str) -> Vec<String> {
    let routes = table.lines().skip(1).filter_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let default = fields.get(1)? == &"00000000" && fields.get(7)? == &"00000000";
        default.then_some((fields[0], fields[3]))
    });
    carrying_devices(routes)
}

/// `/proc/net/ipv6_route`: destination, its prefix length, source, its prefix length, next
/// hop, metric, refcnt, use, flags, device.
fn ipv6_default_route_devices(table: &str) -> Vec<String> {
    let routes = table.lines().filter_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let default = fields.first()?.bytes().all(|b| b == b'0') && fields.get(1)? == &"00";
        default.then_some((*fields.get(9)?, fields[8]))
    });
    carrying_devices(routes)
}

/// The devices of `(device, hex flags)` routes that carry packets, once each, in order.
fn carrying_devices<'a>(routes: impl Iterator<Item = (&'a str, &'a str)>) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for (device, flags) in routes {
        let rejects = u32::from_str_radix(flags, 16).is_ok_and(|f| f & RTF_REJECT != 0);
        if !rejects && device != LOOPBACK && !names.iter().any(|n| n == device) {
            names.push(device.to_string());
        }
    }
    names
}

/// The loopback device, which never leads off the node.
pub const LOOPBACK: &str = "lo";

/// A device as the eBPF data plane finds it when it looks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceState {
    Usable(Device),
    Missing,
    /// Masqueraded packets would have no address to leave with.
    NoIpv4Address,
}

/// Looks `name` up: its index, primary IPv4 address and oldest global IPv6 address.
pub fn device_state(name: &str) -> anyhow::Result<DeviceState> {
    let Ok(index) = nix::net::if_::if_nametoindex(name) else {
        return Ok(DeviceState::Missing);
    };
    let addrs: Vec<nix::ifaddrs::InterfaceAddress> = nix::ifaddrs::getifaddrs()
        .context("getifaddrs")?
        .filter(|a| a.interface_name == name)
        .collect();
    // The first address the kernel lists is the primary one.
    let Some(ipv4) = addrs
        .iter()
        .find_map(|a| a.address?.as_sockaddr_in().map(|s| s.ip()))
    else {
        return Ok(DeviceState::NoIpv4Address);
    };
    // The kernel lists a device's IPv6 addresses newest first: the oldest is the device's own,
    // where one added later (a chosen masquerade address, a temporary address) would come
    // and go under the flows.
    let ipv6 = addrs
        .iter()
        .filter_map(|a| a.address?.as_sockaddr_in6().map(|s| s.ip()))
        .rev()
        .find(is_global_ipv6);
    Ok(DeviceState::Usable(Device {
        name: name.to_string(),
        index,
        ipv4,
        ipv6,
    }))
}

/// Every device of the network namespace, loopback aside, with its index.
pub fn names_and_indexes() -> anyhow::Result<Vec<(String, u32)>> {
    let interfaces = nix::net::if_::if_nameindex().context("listing the network devices")?;
    Ok(interfaces
        .iter()
        .map(|i| (i.name().to_string_lossy().into_owned(), i.index()))
        .filter(|(name, _)| name != LOOPBACK)
        .collect())
}

/// Every address the node holds, on any device: those it accepts packets for and may send
/// from.
pub fn local_addresses() -> anyhow::Result<Vec<IpAddr>> {
    Ok(held_addresses()?
        .into_iter()
        .map(|(_, addr)| addr)
        .collect())
}

/// The addresses device `name` holds (none, if there is no such device).
pub fn device_addresses(name: &str) -> anyhow::Result<Vec<IpAddr>> {
    Ok(held_addresses()?
        .into_iter()
        .filter(|(device, _)| device == name)
        .map(|(_, addr)| addr)
        .collect())
}

/// Each address the network namespace's devices hold, with its device. Loopback's count (an
/// address on `lo` is a common way to hold a VIP), but not the loopback range itself, which
/// never leaves the node.
fn held_addresses() -> anyhow::Result<Vec<(String, IpAddr)>> {
    let ipv4 = nix::ifaddrs::getifaddrs()
        .context("getifaddrs")?
        .filter_map(|a| {
            let addr = a.address?.as_sockaddr_in()?.ip();
            Some((a.interface_name, IpAddr::V4(addr)))
        });
    // getifaddrs gives no IPv6 address's flags; the kernel's own list does.
    let ipv6 = match std::fs::read_to_string(IF_INET6) {
        Ok(table) => held_ipv6_addresses(&table),
        // No IPv6 in this kernel: no IPv6 address either.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {IF_INET6}")),
    };
    Ok(ipv4
        .chain(
            ipv6.into_iter()
                .map(|(device, addr)| (device, IpAddr::V6(addr))),
        )
        .filter(|(_, addr)| !addr.is_loopback())
        .collect())
}

/// The IPv6 addresses of the network namespace of the thread that reads it: a thread may have
/// entered another namespace than its process's.
const IF_INET6: &str = "/proc/thread-self/net/if_inet6";

/// `ifa_flags` bits, from include/uapi/linux/if_addr.h.
const IFA_F_OPTIMISTIC: u32 = 0x04;
const IFA_F_DADFAILED: u32 = 0x08;
const IFA_F_TENTATIVE: u32 = 0x40;

/// The addresses of `/proc/net/if_inet6` (address, index, prefix length, scope and flags in
/// hex, then the device) that the node holds: not one that failed duplicate address detection,
/// nor one still in it, which the kernel neither accepts packets for nor sends from (unless it
/// is optimistic, which it uses meanwhile).
fn held_ipv6_addresses(table: &str) -> Vec<(String, Ipv6Addr)> {
    table
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [hex, _, _, _, flags, device] = fields.as_slice() else {
                return None;
            };
            let addr = Ipv6Addr::from(u128::from_str_radix(hex, 16).ok()?);
            let flags = u32::from_str_radix(flags, 16).ok()?;
            let tentative = flags & IFA_F_TENTATIVE != 0 && flags & IFA_F_OPTIMISTIC == 0;
            let held = flags & IFA_F_DADFAILED == 0 && !tentative;
            held.then(|| (device.to_string(), addr))
        })
        .collect()
}

/// The IP address of a socket address of either family.
fn ip_of(address: &nix::sys::socket::SockaddrStorage) -> Option<IpAddr> {
    address
        .as_sockaddr_in()
        .map(|s| IpAddr::from(s.ip()))
        .or_else(|| address.as_sockaddr_in6().map(|s| IpAddr::from(s.ip())))
}

/// The device the node routes `dst` out of, and the source address the route gives, as the
/// kernel picks them for a socket of its own: a UDP socket connected to `dst` sends nothing.
/// `None` when there is no route.
pub fn route_to(dst: IpAddr) -> anyhow::Result<Option<(String, IpAddr)>> {
    let any: IpAddr = match dst {
        IpAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        IpAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    let socket = std::net::UdpSocket::bind((any, 0)).context("a socket to ask the routes")?;
    if socket.connect((dst, 9)).is_err() {
        return Ok(None);
    }
    let source = socket.local_addr()?.ip();
    let device = nix::ifaddrs::getifaddrs()
        .context("getifaddrs")?
        .find(|a| a.address.as_ref().and_then(ip_of) == Some(source))
        .map(|a| a.interface_name);
    Ok(device.map(|device| (device, source)))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_default_routes_carrying_packets_in_table_order() {
        let table = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
            up1\t00000000\t8264336C\t0003\t0\t0\t200\t00000000\t0\t0\t0\n\
            eth0\t00000000\t0A7100CB\t0003\t0\t0\t0\t00000000\t0\t0\t0\n\
            eth0\t007100CB\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
            up1\t00000000\t0A7100CB\t0003\t0\t0\t300\t00000000\t0\t0\t0\n\
            *\t00000000\t00000000\t0201\t0\t0\t400\t00000000\t0\t0\t0\n";
        assert_eq!(ipv4_default_route_devices(table), ["up1", "eth0"]);
    }

    #[test]
    fn ipv6_default_routes_leave_out_rejecting_and_loopback_routes() {
        let table = "\
20010db8000100000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001     eth0
00000000000000000000000000000000 00 00000000000000000000000000000000 00 20010db8000100000000000000000010 00000400 00000001 00000000 00000003     eth0
00000000000000000000000000000000 00 00000000000000000000000000000000 00 20010db8000400000000000000000010 00000400 00000001 00000000 00000003      up1
00000000000000000000000000000000 00 00000000000000000000000000000000 00 00000000000000000000000000000000 ffffffff 00000001 00000000 00200200       lo
00000000000000000000000000000000 00 00000000000000000000000000000000 00 00000000000000000000000000000000 00000400 00000001 00000000 00000201     eth1
";
        assert_eq!(ipv6_default_route_devices(table), ["eth0", "up1"]);
    }

    #[test]
    fn ipv6_addresses_in_duplicate_address_detection_or_failed_by_it_are_not_held() {
        let table = "\
00000000000000000000000000000001 01 80 10 80       lo
20010db8000000000000000000000007 01 80 00 80       lo
20010db8000100000000000000000001 02 40 00 80     eth0
20010db8000100000000000000000050 02 80 00 40     eth0
20010db8000100000000000000000051 02 80 00 48     eth0
20010db8000100000000000000000052 02 80 00 44     eth0
20010db8000100000000000000000053 02 80 00 4c     eth0
fe800000000000000000000000000001 02 40 20 80     eth0
";
        let held: Vec<String> = held_ipv6_addresses(table)
            .iter()
            .map(|(device, addr)| format!("{device} {addr}"))
            .collect();
        assert_eq!(
            held,
            [
                "lo ::1",
                "lo 2001:db8::7",
                "eth0 2001:db8:1::1",
                "eth0 2001:db8:1::52",
                "eth0 fe80::1",
            ],
            "tentative (::50) and failed (::51, and ::53 though optimistic) left out"
        );
    }
}

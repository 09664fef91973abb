//! What the agent needs to know about the node's network devices, read from the kernel of the
//! network namespace the agent runs in.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use anyhow::{Context as _, bail};
use netlink_packet_route::{
    AddressFamily, RouteNetlinkMessage,
    address::{AddressAttribute, AddressFlags, AddressMessage, AddressScope},
};
use netlink_sys::protocols::NETLINK_ROUTE;

use crate::{
    netlink,
    policy::{IpFamilies, IpFamily},
};

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
    let Some(addrs) = kernel_addresses(Some(index))? else {
        return Ok(DeviceState::Missing);
    };
    // The address netfilter's MASQUERADE takes for a packet to another network: a primary one
    // (the kernel lists a device's secondaries after them) of global scope; the kernel lists
    // the narrower scopes first (a 169.254 address a network manager added). Where there is
    // none, the first primary.
    let primary = |global: bool| {
        addrs.iter().find_map(|a| match a.addr {
            IpAddr::V4(addr)
                if !a.flags.contains(AddressFlags::Secondary)
                    && (!global || a.scope == AddressScope::Universe) =>
            {
                Some(addr)
            }
            _ => None,
        })
    };
    let Some(ipv4) = primary(true).or_else(|| primary(false)) else {
        return Ok(DeviceState::NoIpv4Address);
    };
    // The kernel lists a device's IPv6 addresses newest first: the oldest is the device's own,
    // where one added later (a chosen masquerade address, a temporary address) would come
    // and go under the flows.
    let ipv6 = addrs
        .iter()
        .filter_map(|a| match a.addr {
            IpAddr::V6(addr) => Some(addr),
            IpAddr::V4(_) => None,
        })
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
    Ok(held_addresses(None)?
        .unwrap_or_default()
        .into_iter()
        .map(|a| a.addr)
        .collect())
}

/// The addresses device `name` holds (none, if there is no such device).
pub fn device_addresses(name: &str) -> anyhow::Result<Vec<IpAddr>> {
    let Ok(index) = nix::net::if_::if_nametoindex(name) else {
        return Ok(Vec::new());
    };
    Ok(held_addresses(Some(index))?
        .unwrap_or_default()
        .into_iter()
        .map(|a| a.addr)
        .collect())
}

/// Each address the network namespace's devices hold, or device `index` holds. Loopback's
/// count (an address on `lo` is a common way to hold a VIP), but not the loopback range
/// itself, which never leaves the node.
fn held_addresses(index: Option<u32>) -> anyhow::Result<Option<Vec<KernelAddress>>> {
    let held = |a: &KernelAddress| a.is_held() && !a.addr.is_loopback();
    Ok(kernel_addresses(index)?.map(|all| all.into_iter().filter(held).collect()))
}

/// An address as the kernel lists it: the device that holds it, its scope and its `IFA_F_*`
/// flags.
#[derive(Debug, Clone, PartialEq, Eq)]
struct KernelAddress {
    index: u32,
    addr: IpAddr,
    scope: AddressScope,
    flags: AddressFlags,
}

impl KernelAddress {
    /// Whether the node holds the address: not one that failed duplicate address detection,
    /// nor one still in it, which the kernel neither accepts packets for nor sends from
    /// (unless it is optimistic, which it uses meanwhile). Only IPv6 addresses carry these flags:
    /// every IPv4 address is held.
    fn is_held(&self) -> bool {
        let tentative = self.flags.contains(AddressFlags::Tentative)
            && !self.flags.contains(AddressFlags::Optimistic);
        !self.flags.contains(AddressFlags::Dadfailed) && !tentative
    }

    /// The address a dump's message names, with its device and flags. An IPv4 address's own
    /// is `IFA_LOCAL` (`IFA_ADDRESS` is the peer's, on a point-to-point link); IPv6 gives
    /// `IFA_LOCAL` only beside a peer too.
    fn of(message: &AddressMessage) -> Option<KernelAddress> {
        let mut local = None;
        let mut address = None;
        let mut flags = AddressFlags::from_bits_retain(u32::from(message.header.flags.bits()));
        for attribute in &message.attributes {
            match attribute {
                AddressAttribute::Local(addr) => local = Some(*addr),
                AddressAttribute::Address(addr) => address = Some(*addr),
                // The full flags, of which the header holds the low eight bits.
                AddressAttribute::Flags(all) => flags = *all,
                _ => {}
            }
        }
        Some(KernelAddress {
            index: message.header.index,
            addr: local.or(address)?,
            scope: message.header.scope,
            flags,
        })
    }
}

/// Every IPv4 and IPv6 address of the network namespace of the calling thread (a thread may
/// have entered another namespace than its process's), or of its device `index` alone
/// (`None` if there is no such device now), in the kernel's order. A dump of addresses alone:
/// `getifaddrs` dumps every device's whole link as well, which beside a node's pods' devices
/// was most of the agent's CPU (docs/bench/profiles.md, "The idle agent").
fn kernel_addresses(index: Option<u32>) -> anyhow::Result<Option<Vec<KernelAddress>>> {
    let asked = || {
        let socket = netlink::socket(NETLINK_ROUTE)?;
        // With strict checking (Linux 4.20) the kernel dumps the one device's addresses; a
        // kernel without it dumps them all, and the index is kept below all the same.
        if index.is_some() {
            let _ = socket.set_netlink_get_strict_chk(true);
        }
        let mut addresses = dump_addresses(&socket, AddressFamily::Inet, index)?;
        match dump_addresses(&socket, AddressFamily::Inet6, index) {
            Ok(ipv6) => addresses.extend(ipv6),
            // A kernel without IPv6.
            Err(err) if err.raw_os_error() == Some(libc::EAFNOSUPPORT) => {}
            Err(err) => return Err(err),
        }
        Ok(addresses)
    };
    match asked() {
        Ok(addresses) => Ok(Some(addresses)),
        Err(err) if index.is_some() && err.raw_os_error() == Some(libc::ENODEV) => Ok(None),
        Err(err) => Err(err).context("asking the kernel for the node's addresses"),
    }
}

/// One family's addresses, of device `index` if given. By family, not both in one dump: an
/// unspecified family's dump also lists the addresses of other protocols (MCTP, Phonet),
/// which do not parse as IP addresses.
fn dump_addresses(
    socket: &netlink_sys::Socket,
    family: AddressFamily,
    index: Option<u32>,
) -> std::io::Result<Vec<KernelAddress>> {
    let mut request = AddressMessage::default();
    request.header.family = family;
    request.header.index = index.unwrap_or(0);
    let answer = netlink::dump(socket, RouteNetlinkMessage::GetAddress(request))?;
    Ok(answer
        .iter()
        .filter_map(|message| match message {
            RouteNetlinkMessage::NewAddress(address) => KernelAddress::of(address),
            _ => None,
        })
        .filter(|a| index.is_none_or(|index| a.index == index))
        .collect())
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
    let device = kernel_addresses(None)?
        .unwrap_or_default()
        .into_iter()
        .find(|a| a.addr == source)
        .and_then(|a| nix::net::if_::if_indextoname(a.index).ok())
        .map(|name| name.to_string_lossy().into_owned());
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
    use netlink_packet_route::address::AddressHeaderFlags;

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
        let held = |flags: AddressFlags| {
            KernelAddress {
                index: 2,
                addr: "2001:db8:1::1".parse().unwrap(),
                scope: AddressScope::Universe,
                flags,
            }
            .is_held()
        };
        assert!(held(AddressFlags::Permanent));
        assert!(held(AddressFlags::empty()), "learnt from the router");
        assert!(
            held(AddressFlags::Tentative | AddressFlags::Optimistic),
            "optimistic: used while in detection"
        );
        assert!(!held(AddressFlags::Tentative), "in detection");
        assert!(!held(AddressFlags::Dadfailed), "failed");
        assert!(
            !held(AddressFlags::Dadfailed | AddressFlags::Tentative | AddressFlags::Optimistic),
            "failed, though optimistic"
        );
    }

    #[test]
    fn a_dumped_address_is_its_own_local_one_and_carries_its_full_flags() {
        let message = |attributes: Vec<AddressAttribute>| {
            let mut message = AddressMessage::default();
            message.header.index = 7;
            message.header.flags = AddressHeaderFlags::Secondary;
            message.attributes = attributes;
            KernelAddress::of(&message)
        };
        let peer: IpAddr = "203.0.113.9".parse().unwrap();
        let own: IpAddr = "203.0.113.2".parse().unwrap();
        assert_eq!(
            message(vec![
                AddressAttribute::Address(peer),
                AddressAttribute::Local(own)
            ]),
            Some(KernelAddress {
                index: 7,
                addr: own,
                scope: AddressScope::Universe,
                flags: AddressFlags::Secondary,
            }),
            "a point-to-point address: the peer's is IFA_ADDRESS"
        );
        let full = AddressFlags::Permanent | AddressFlags::StablePrivacy;
        assert_eq!(
            message(vec![
                AddressAttribute::Address(own),
                AddressAttribute::Flags(full)
            ]),
            Some(KernelAddress {
                index: 7,
                addr: own,
                scope: AddressScope::Universe,
                flags: full,
            }),
            "IFA_FLAGS holds the flags past the header's eight bits"
        );
        assert_eq!(message(vec![]), None, "no address, none listed");
    }

    #[test]
    fn the_namespaces_addresses_come_from_the_kernel_loopback_among_them() {
        let all = kernel_addresses(None)
            .expect("any user may dump the addresses")
            .unwrap();
        let loopback = nix::net::if_::if_nametoindex(LOOPBACK).unwrap();
        let on_loopback = kernel_addresses(Some(loopback)).unwrap().unwrap();
        assert!(
            on_loopback.contains(&KernelAddress {
                index: loopback,
                addr: IpAddr::V4(Ipv4Addr::LOCALHOST),
                scope: AddressScope::Host,
                flags: AddressFlags::Permanent,
            }),
            "{on_loopback:?}"
        );
        assert!(
            on_loopback.iter().all(|a| a.index == loopback),
            "one device's dump holds that device's addresses alone: {on_loopback:?}"
        );
        assert!(on_loopback.iter().all(|a| all.contains(a)), "{all:?}");
        assert!(
            kernel_addresses(Some(u32::MAX)).unwrap().is_none(),
            "no such device: none, not an error"
        );
    }
}

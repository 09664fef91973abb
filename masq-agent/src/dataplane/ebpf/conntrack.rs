//! The node's own flows that conntrack knew of before the programs ran: netfilter's
//! masqueraded ones (kube-proxy's MASQUERADE, upstream's chain before the switch) and the node's
//! sockets'. The programs hold the tuple of such a flow when its next packet leaves; one that
//! sends nothing for a while would meanwhile look free to the allocator. So, when the data
//! plane starts, their tuples are held from conntrack's own table
//! (`/proc/net/nf_conntrack`, of the agent's network namespace).

use std::net::IpAddr;

use masq_ebpf::{
    Address, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP, NatEntry, NatKey, direction,
    nat_kind, tcp_seen,
};
use tracing::{info, warn};

use super::{
    expiry,
    maps::{NatTable, NatTables},
};
use crate::{netdev, policy::Policy};

/// Where the kernel lists the namespace's conntrack entries.
const CONNTRACK_TABLE: &str = "/proc/net/nf_conntrack";

/// A flow's tuple as it leaves the node: from one of the node's addresses and ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeFlow {
    pub proto: u8,
    pub node: IpAddr,
    /// The node-side port, or an echo's identifier.
    pub node_port: u16,
    pub remote: IpAddr,
    /// 0 for an echo.
    pub remote_port: u16,
    pub established: bool,
}

/// The flows of `table` (conntrack's listing) whose replies come to the node itself, on its
/// side of them: what netfilter translated to the node's address, and the node's own.
pub fn node_flows(table: &str, is_node_address: impl Fn(IpAddr) -> bool) -> Vec<NodeFlow> {
    table
        .lines()
        .filter_map(parse)
        .filter(|flow| is_node_address(flow.node))
        .collect()
}

/// One line: `ipv4 2 tcp 6 431999 ESTABLISHED src=.. dst=.. sport=.. dport=.. src=.. ...`,
/// the original direction's tuple first, then the reply's.
fn parse(line: &str) -> Option<NodeFlow> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let proto: u8 = words.get(3)?.parse().ok()?;
    let established = words.get(5) == Some(&"ESTABLISHED");
    // The reply direction's tuple: the second of each field.
    let reply = |field: &str| {
        let prefix = format!("{field}=");
        words
            .iter()
            .filter_map(|w| w.strip_prefix(prefix.as_str()))
            .nth(1)
    };
    let (remote, node) = (reply("src")?.parse().ok()?, reply("dst")?.parse().ok()?);
    let (node_port, remote_port) = match proto {
        IPPROTO_TCP | IPPROTO_UDP => (reply("dport")?.parse().ok()?, reply("sport")?.parse().ok()?),
        // An echo: its reply's identifier is the node's.
        IPPROTO_ICMP | IPPROTO_ICMPV6 => (reply("id")?.parse().ok()?, 0),
        _ => return None,
    };
    Some(NodeFlow {
        proto,
        node,
        node_port,
        remote,
        remote_port,
        established,
    })
}

/// Reads conntrack's table of this namespace; `None` where the kernel does not list it.
fn read_table() -> Option<String> {
    std::fs::read_to_string(CONNTRACK_TABLE).ok()
}

/// Holds the tuples of the node's own flows that conntrack knows of, to destinations `policy`
/// masquerades, and says how it went. Where the kernel does not list conntrack's table, such a
/// flow is held at its next packet, and a clash until then is said (`node_port_clashes`).
/// `reservable(proto, port)`: whether a node flow on that port needs holding at all.
pub fn hold_known_node_flows(
    nat: &mut NatTables,
    policy: &Policy,
    reservable: impl Fn(u8, u16) -> bool,
) {
    let Some(table) = read_table() else {
        info!("conntrack's table is not listed here: the node's own flows are held as they send");
        return;
    };
    let held = netdev::local_addresses().and_then(|addresses| {
        let flows: Vec<NodeFlow> = node_flows(&table, |addr| addresses.contains(&addr))
            .into_iter()
            .filter(|flow| !policy.exempts(flow.remote))
            .filter(|flow| reservable(flow.proto, flow.node_port))
            .collect();
        hold(nat, &flows)
    });
    match held {
        Ok(0) => {}
        Ok(flows) => info!(flows, "the node's own flows conntrack knew of are held"),
        Err(err) => warn!("holding the node's own flows conntrack knew of: {err:#}"),
    }
}

/// Holds the tuples of `flows` in the NAT tables, as the programs hold a node flow's: identity
/// entries of kind `NODE`. A tuple already held (by the programs' own flow, or by the node's
/// flow since its last packet) stays as it is. Returns how many were held.
fn hold(nat: &mut NatTables, flows: &[NodeFlow]) -> anyhow::Result<usize> {
    let now = expiry::monotonic_now_ns();
    let mut held = 0;
    for flow in flows {
        held += match (flow.node, flow.remote) {
            (IpAddr::V4(node), IpAddr::V4(remote)) => {
                hold_one(&mut nat.v4, flow, node.octets(), remote.octets(), now)?
            }
            (IpAddr::V6(node), IpAddr::V6(remote)) => {
                hold_one(&mut nat.v6, flow, node.octets(), remote.octets(), now)?
            }
            _ => 0,
        };
    }
    Ok(held)
}

fn hold_one<A>(
    nat: &mut NatTable<A>,
    flow: &NodeFlow,
    node: A,
    remote: A,
    now: u64,
) -> anyhow::Result<usize>
where
    A: Address,
    NatKey<A>: aya::Pod,
    NatEntry<A>: aya::Pod,
{
    let echo = matches!(flow.proto, IPPROTO_ICMP | IPPROTO_ICMPV6);
    let (sport, dport) = (flow.node_port.to_be(), flow.remote_port.to_be());
    let egress_key = NatKey {
        saddr: node,
        daddr: remote,
        sport,
        dport: if echo { 0 } else { dport },
        proto: flow.proto,
        direction: direction::EGRESS,
        _pad: [0; 2],
    };
    // Established flows go with the established timeout, others with the transitory one.
    let seen = match (flow.proto, flow.established) {
        (IPPROTO_TCP, true) => tcp_seen::PAST_OPENING,
        _ => 0,
    };
    let identity = |addr: A, port: u16, tcp_seen: u8| NatEntry {
        last_seen_ns: now,
        addr,
        port,
        kind: nat_kind::NODE,
        tcp_seen,
        ..NatEntry::default()
    };
    let egress = identity(
        node,
        sport,
        if flow.proto == IPPROTO_TCP {
            tcp_seen::PAST_OPENING
        } else {
            0
        },
    );
    let ingress_key = egress_key.reverse(&egress);
    let ingress = identity(node, sport, seen);
    // BPF_NOEXIST (include/uapi/linux/bpf.h): a tuple held already stays as it is.
    const BPF_NOEXIST: u64 = 1;
    if nat.insert(ingress_key, ingress, BPF_NOEXIST).is_err() {
        return Ok(0);
    }
    if nat.insert(egress_key, egress, BPF_NOEXIST).is_err() {
        let _ = nat.remove(&ingress_key);
        return Ok(0);
    }
    Ok(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "\
ipv4     2 tcp      6 431999 ESTABLISHED src=10.244.2.2 dst=203.0.113.10 sport=40000 dport=8080 src=203.0.113.10 dst=203.0.113.1 sport=8080 dport=61000 [ASSURED] mark=16384 zone=0 use=2
ipv4     2 udp      17 29 src=10.244.1.2 dst=203.0.113.10 sport=5353 dport=53 src=203.0.113.10 dst=10.244.1.2 sport=53 dport=5353 mark=0 zone=0 use=2
ipv4     2 icmp     1 29 src=203.0.113.1 dst=203.0.113.10 type=8 code=0 id=4242 src=203.0.113.10 dst=203.0.113.1 type=0 code=0 id=4242 mark=0 zone=0 use=2
ipv6     10 udp      17 29 src=2001:0db8:0001:0000:0000:0000:0000:0001 dst=2001:0db8:0001:0000:0000:0000:0000:0010 sport=33000 dport=53 src=2001:0db8:0001:0000:0000:0000:0000:0010 dst=2001:0db8:0001:0000:0000:0000:0000:0001 sport=53 dport=33000 mark=0 zone=0 use=2
ipv4     2 gre      47 179 src=10.244.1.2 dst=203.0.113.10 srckey=0x0 dstkey=0x0 src=203.0.113.10 dst=203.0.113.1 srckey=0x0 dstkey=0x0 mark=0 zone=0 use=2
";

    /// What netfilter masqueraded to the node's address and the node's own flows are the
    /// node's; a pod's flow that kept its address (the programs translate it, or none does)
    /// is not, and neither are protocols without ports.
    #[test]
    fn the_node_flows_are_read_from_conntracks_reply_tuples() {
        let node: [IpAddr; 2] = [
            "203.0.113.1".parse().unwrap(),
            "2001:db8:1::1".parse().unwrap(),
        ];
        let flows = node_flows(TABLE, |addr| node.contains(&addr));
        let remote = |a: &str| a.parse::<IpAddr>().unwrap();
        assert_eq!(
            flows,
            [
                NodeFlow {
                    proto: IPPROTO_TCP,
                    node: node[0],
                    node_port: 61000,
                    remote: remote("203.0.113.10"),
                    remote_port: 8080,
                    established: true,
                },
                NodeFlow {
                    proto: IPPROTO_ICMP,
                    node: node[0],
                    node_port: 4242,
                    remote: remote("203.0.113.10"),
                    remote_port: 0,
                    established: false,
                },
                NodeFlow {
                    proto: IPPROTO_UDP,
                    node: node[1],
                    node_port: 33000,
                    remote: remote("2001:db8:1::10"),
                    remote_port: 53,
                    established: false,
                },
            ]
        );
    }
}

//! What conntrack knows of flows the programs must not change the translation of.
//!
//! The node's own flows that conntrack knew of before the programs ran: netfilter's
//! masqueraded ones (kube-proxy's MASQUERADE, upstream's chain before the switch) and the node's
//! sockets'. The programs hold the tuple of such a flow when its next packet leaves; one that
//! sends nothing for a while would meanwhile look free to the allocator. So, when the data
//! plane starts, their tuples are held from conntrack's own table
//! (`/proc/net/nf_conntrack`, of the agent's network namespace).
//!
//! The pods' flows that a policy change would move: a flow that left with the pod's address
//! because its destination was not masqueraded must keep it when a change masquerades that
//! destination, as conntrack keeps a flow's NAT for its whole life. The programs translate after
//! netfilter, so conntrack lists every pod flow with the pod's own tuple both ways; those the
//! programs masquerade have an entry in the NAT table already. Before the change reaches the
//! programs, the others toward a destination it masquerades are kept: entries of kind
//! `PASSTHROUGH`, as for a connection opened from outside.

use std::net::IpAddr;

use masq_ebpf::{
    Address, IPPROTO_ICMP, IPPROTO_ICMPV6, IPPROTO_TCP, IPPROTO_UDP, NatEntry, NatKey, direction,
    nat_kind, packets_seen, tcp_seen,
};
use tracing::{info, warn};

use super::{
    flow_table::{self, NatTable},
    map_types::NatTables,
};
use crate::{netdev, policy::Policy};

/// Where the kernel lists the namespace's conntrack entries.
const CONNTRACK_TABLE: &str = "/proc/net/nf_conntrack";

/// A flow conntrack knows, from one end's side: the node's, or a pod's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flow {
    pub proto: u8,
    pub local: IpAddr,
    /// The local port, or an echo's identifier.
    pub local_port: u16,
    pub remote: IpAddr,
    /// 0 for an echo.
    pub remote_port: u16,
    /// TCP past its handshake.
    pub established: bool,
    /// Seen both ways again after its first exchange (conntrack's `[ASSURED]`).
    pub assured: bool,
}

/// A flow's tuple one way: `src=.. dst=.. sport=.. dport=..` (an echo's `id=` for both ports).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Tuple {
    src: IpAddr,
    dst: IpAddr,
    sport: u16,
    dport: u16,
}

/// One line: `ipv4 2 tcp 6 431999 ESTABLISHED src=.. dst=.. sport=.. dport=.. src=.. ...`:
/// the protocol, the original direction's tuple, the reply's, and the flow's state.
fn parse(line: &str) -> Option<(u8, Tuple, Tuple, bool, bool)> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let proto: u8 = words.get(3)?.parse().ok()?;
    let established = words.get(5) == Some(&"ESTABLISHED");
    let assured = words.contains(&"[ASSURED]");
    // The `n`th value of `field`: 0 the original direction's, 1 the reply's.
    let value = |field: &str, n: usize| {
        let prefix = format!("{field}=");
        words
            .iter()
            .filter_map(|w| w.strip_prefix(prefix.as_str()))
            .nth(n)
    };
    let tuple = |n: usize| -> Option<Tuple> {
        let (sport, dport) = match proto {
            IPPROTO_TCP | IPPROTO_UDP => (
                value("sport", n)?.parse().ok()?,
                value("dport", n)?.parse().ok()?,
            ),
            // An echo: both ends know it by its identifier.
            IPPROTO_ICMP | IPPROTO_ICMPV6 => {
                let id = value("id", n)?.parse().ok()?;
                (id, id)
            }
            _ => return None,
        };
        Some(Tuple {
            src: value("src", n)?.parse().ok()?,
            dst: value("dst", n)?.parse().ok()?,
            sport,
            dport,
        })
    };
    Some((proto, tuple(0)?, tuple(1)?, established, assured))
}

/// The flow from the side of the end its replies go to.
fn replied_end(proto: u8, reply: Tuple, established: bool, assured: bool) -> Flow {
    let echo = matches!(proto, IPPROTO_ICMP | IPPROTO_ICMPV6);
    Flow {
        proto,
        local: reply.dst,
        local_port: reply.dport,
        remote: reply.src,
        remote_port: if echo { 0 } else { reply.sport },
        established,
        assured,
    }
}

/// The flows of `table` (conntrack's listing) whose replies come to the node itself, on its
/// side of them: what netfilter translated to the node's address, and the node's own.
pub fn node_flows(table: &str, is_node_address: impl Fn(IpAddr) -> bool) -> Vec<Flow> {
    table
        .lines()
        .filter_map(parse)
        .map(|(proto, _, reply, established, assured)| {
            replied_end(proto, reply, established, assured)
        })
        .filter(|flow| is_node_address(flow.local))
        .collect()
}

/// The flows of `table` that neither end's netfilter translated, from an address not the
/// node's: the pods' flows, on the pod's side. Those the programs masquerade are among them.
pub fn pod_flows(table: &str, is_node_address: impl Fn(IpAddr) -> bool) -> Vec<Flow> {
    table
        .lines()
        .filter_map(parse)
        .filter(|(_, original, reply, _, _)| {
            reply.src == original.dst
                && reply.dst == original.src
                && reply.sport == original.dport
                && reply.dport == original.sport
        })
        .map(|(proto, _, reply, established, assured)| {
            replied_end(proto, reply, established, assured)
        })
        .filter(|flow| !is_node_address(flow.local))
        .collect()
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
    let held = netdev::local_addresses().map(|addresses| {
        let flows: Vec<Flow> = node_flows(&table, |addr| addresses.contains(&addr))
            .into_iter()
            .filter(|flow| !policy.exempts(flow.remote))
            .filter(|flow| reservable(flow.proto, flow.local_port))
            .collect();
        record(nat, &flows, nat_kind::NODE)
    });
    match held {
        Ok(held) => {
            if held.flows > 0 {
                info!(
                    flows = held.flows,
                    "the node's own flows conntrack knew of are held"
                );
            }
            if held.no_room > 0 {
                warn!(
                    flows = held.no_room,
                    "the NAT table is full: node flows conntrack knew of are not held; the \
                     programs hold each at its next packet, if there is room then"
                );
            }
        }
        Err(err) => warn!("holding the node's own flows conntrack knew of: {err:#}"),
    }
}

/// Keeps the pods' flows that left with their own address under `before` and that `after`
/// would masquerade: what conntrack knows of them goes into the NAT tables as flows left alone
/// (`PASSTHROUGH`), to be called before `after` reaches the programs. A flow the programs
/// masquerade has its entries already, and keeps them. Where the kernel does not list
/// conntrack's table, only TCP is kept, by the draining trie.
pub fn keep_pod_flows(nat: &mut NatTables, before: &Policy, after: &Policy) {
    let Some(table) = read_table() else {
        return;
    };
    let kept = netdev::local_addresses().map(|addresses| {
        let flows: Vec<Flow> = pod_flows(&table, |addr| addresses.contains(&addr))
            .into_iter()
            .filter(|flow| {
                before.leaves_alone(flow.local, flow.remote)
                    && !after.leaves_alone(flow.local, flow.remote)
            })
            .collect();
        record(nat, &flows, nat_kind::PASSTHROUGH)
    });
    match kept {
        Ok(kept) => {
            if kept.flows > 0 {
                info!(
                    flows = kept.flows,
                    "the pods' flows the change would masquerade keep their address, as \
                     conntrack keeps them"
                );
            }
            if kept.no_room > 0 {
                warn!(
                    flows = kept.no_room,
                    "the NAT table is full: pods' flows the change masquerades could not keep \
                     their address, and take the node's from their next packet"
                );
            }
        }
        Err(err) => warn!("keeping the pods' flows across the change: {err:#}"),
    }
}

/// What `record` did with the flows it was given.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Recorded {
    /// Recorded.
    pub flows: usize,
    /// Not recorded: the table was full.
    pub no_room: usize,
}

/// How recording one flow went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Recording {
    Recorded,
    /// Its tuple is held already, by a flow of the programs' own: it stays as it is.
    HeldAlready,
    NoRoom,
}

impl Recording {
    /// What an insert that failed with `err` says: the tuple was taken (`EEXIST`, as
    /// `BPF_NOEXIST` reports it), or the table had no room for it (`E2BIG` when full).
    fn of_insert_error(err: &aya::maps::MapError) -> Recording {
        if flow_table::exists(err) {
            Recording::HeldAlready
        } else {
            Recording::NoRoom
        }
    }
}

/// Records `flows` in the NAT tables as the programs record a flow they leave alone: identity
/// entries of `kind`. A tuple held already (by a flow of the programs' own) stays as it is.
fn record(nat: &mut NatTables, flows: &[Flow], kind: u8) -> Recorded {
    let now = flow_table::monotonic_now_ns();
    let mut recorded = Recorded::default();
    // Mapped once for all the flows, not once a flow (a hash table needs nothing).
    let unmapped = |err: &anyhow::Error| {
        warn!("the NAT slots are mapped a flow at a time: {err:#}");
    };
    let _mapped_v4 = nat.v4.keep_mapped().inspect_err(unmapped);
    let _mapped_v6 = nat.v6.keep_mapped().inspect_err(unmapped);
    for flow in flows {
        let ends = (flow.local, flow.remote);
        let recording = match ends {
            (IpAddr::V4(l), IpAddr::V4(r)) => {
                record_one(&mut nat.v4, flow, (l.octets(), r.octets()), kind, now)
            }
            (IpAddr::V6(l), IpAddr::V6(r)) => {
                record_one(&mut nat.v6, flow, (l.octets(), r.octets()), kind, now)
            }
            _ => continue,
        };
        match recording {
            Recording::Recorded => recorded.flows += 1,
            Recording::NoRoom => recorded.no_room += 1,
            Recording::HeldAlready => {}
        }
    }
    recorded
}

fn record_one<A>(
    nat: &mut NatTable<A>,
    flow: &Flow,
    (local, remote): (A, A),
    kind: u8,
    now: u64,
) -> Recording
where
    A: Address,
    NatKey<A>: aya::Pod,
    NatEntry<A>: aya::Pod,
{
    let (sport, dport) = (flow.local_port.to_be(), flow.remote_port.to_be());
    let egress_key = NatKey {
        saddr: local,
        daddr: remote,
        sport,
        dport,
        proto: flow.proto,
        direction: direction::EGRESS,
        _pad: [0; 2],
    };
    // What each half saw, as far as conntrack says: TCP past its handshake both ways goes with
    // the established timeout; a UDP or echo flow it assured, as a stream.
    let (egress_seen, ingress_seen) = match flow.proto {
        IPPROTO_TCP if flow.established => (tcp_seen::PAST_OPENING, tcp_seen::PAST_OPENING),
        IPPROTO_TCP => (tcp_seen::PAST_OPENING, 0),
        _ if flow.assured => (packets_seen::ONCE, packets_seen::ONCE | packets_seen::AGAIN),
        _ => (0, 0),
    };
    let identity = |tcp_seen: u8| NatEntry {
        last_seen_ns: now,
        addr: local,
        port: sport,
        kind,
        tcp_seen,
        ..NatEntry::default()
    };
    let egress = identity(egress_seen);
    let ingress_key = egress_key.reverse(&egress);
    let ingress = identity(ingress_seen);
    // A tuple held already stays as it is.
    if let Err(err) = nat.insert_new(&ingress_key, &ingress) {
        return Recording::of_insert_error(&err);
    }
    if let Err(err) = nat.insert_new(&egress_key, &egress) {
        let _ = nat.remove(&ingress_key);
        return Recording::of_insert_error(&err);
    }
    Recording::Recorded
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tuple another flow holds stays as it is, and is no flow lost; anything else the kernel
    /// refuses an insert for (a full table: `E2BIG`) is one the agent says it could not keep.
    #[test]
    fn an_insert_refused_for_a_held_tuple_is_not_a_full_table() {
        let refused = |errno| {
            aya::maps::MapError::SyscallError(aya::sys::SyscallError {
                call: "bpf_map_update_elem",
                io_error: std::io::Error::from_raw_os_error(errno),
            })
        };
        assert_eq!(
            Recording::of_insert_error(&refused(libc::EEXIST)),
            Recording::HeldAlready
        );
        assert_eq!(
            Recording::of_insert_error(&refused(libc::E2BIG)),
            Recording::NoRoom
        );
    }

    /// The node's addresses in `TABLE`.
    const NODE: [&str; 2] = ["203.0.113.1", "2001:db8:1::1"];

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
        let node = NODE.map(|a| a.parse::<IpAddr>().unwrap());
        let flows = node_flows(TABLE, |addr| node.contains(&addr));
        let remote = |a: &str| a.parse::<IpAddr>().unwrap();
        assert_eq!(
            flows,
            [
                Flow {
                    proto: IPPROTO_TCP,
                    local: node[0],
                    local_port: 61000,
                    remote: remote("203.0.113.10"),
                    remote_port: 8080,
                    established: true,
                    assured: true,
                },
                Flow {
                    proto: IPPROTO_ICMP,
                    local: node[0],
                    local_port: 4242,
                    remote: remote("203.0.113.10"),
                    remote_port: 0,
                    established: false,
                    assured: false,
                },
                Flow {
                    proto: IPPROTO_UDP,
                    local: node[1],
                    local_port: 33000,
                    remote: remote("2001:db8:1::10"),
                    remote_port: 53,
                    established: false,
                    assured: false,
                },
            ]
        );
    }

    /// A pod's flow is one neither end's netfilter translated, from an address not the node's:
    /// the UDP query, and not the pod's TCP flow netfilter masqueraded.
    #[test]
    fn the_pods_flows_are_those_conntrack_left_untranslated() {
        let node = NODE.map(|a| a.parse::<IpAddr>().unwrap());
        let flows = pod_flows(TABLE, |addr| node.contains(&addr));
        assert_eq!(
            flows,
            [Flow {
                proto: IPPROTO_UDP,
                local: "10.244.1.2".parse().unwrap(),
                local_port: 5353,
                remote: "203.0.113.10".parse().unwrap(),
                remote_port: 53,
                established: false,
                assured: false,
            }]
        );
    }
}

//! `masq-agent flows`: the NAT tables' flows, listed as `conntrack -L` lists its entries, from
//! the pinned maps: each flow as it left (the pod's tuple, or the node's), what the programs
//! translate it to, whose it is, its state, how long it has been idle and how long until the
//! sweep removes it. So that "which port did this pod get, and why is it still held" takes one
//! command.

use std::{fmt, net::IpAddr, path::Path, time::Duration};

use aya::Pod;
use ipnet::IpNet;
use masq_ebpf::{Address, IPPROTO_TCP, IPPROTO_UDP, NatEntry, NatKey, direction, map_names};
use serde::Serialize;

use super::{
    expiry::{self, FlowOwner, FlowState, Timeouts},
    flow_table::{Table, V4_MAPS, V6_MAPS},
    pins::Pins,
};
use crate::dataplane::nat_usage::FlowKind;

impl From<FlowOwner> for FlowKind {
    fn from(owner: FlowOwner) -> FlowKind {
        match owner {
            FlowOwner::Pod => FlowKind::Pod,
            FlowOwner::PodKept => FlowKind::Kept,
            FlowOwner::NodeTranslated | FlowOwner::NodeReserved => FlowKind::Node,
        }
    }
}

/// Which flows to list; each filter left out lets every flow through.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    /// The flow's source, as it left: a pod's address, or the node's.
    pub source: Option<IpAddr>,
    pub destination: Option<IpNet>,
    pub kind: Option<FlowKind>,
    pub proto: Option<u8>,
}

impl Filter {
    fn admits(&self, flow: &Flow) -> bool {
        self.source.is_none_or(|s| s == flow.source.addr)
            && self
                .destination
                .is_none_or(|d| d.contains(&flow.destination.addr))
            && self.kind.is_none_or(|k| k == flow.kind)
            && self.proto.is_none_or(|p| p == flow.proto)
    }
}

/// One end of a flow: an address, and a port (an echo's identifier).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Endpoint {
    pub addr: IpAddr,
    pub port: u16,
}

/// One flow of the NAT tables.
#[derive(Debug, Clone, Serialize)]
pub struct Flow {
    #[serde(skip)]
    pub proto: u8,
    #[serde(rename = "proto")]
    pub proto_name: String,
    pub kind: FlowKind,
    /// As it left: from the pod, or from the node.
    pub source: Endpoint,
    pub destination: Endpoint,
    /// What the programs give it instead of `source`; `None` when it keeps its own.
    pub translated_to: Option<Endpoint>,
    /// Its state, as conntrack classes it for its timeout (`FlowState`).
    pub state: &'static str,
    pub idle_seconds: u64,
    /// Until the sweep that follows its timeout removes it, unless a packet comes first.
    pub expires_in_seconds: u64,
}

/// The flows of both NAT tables pinned under `bpffs` that `filter` admits, with their state
/// and time left under `timeouts`, at `now_ns` (CLOCK_MONOTONIC); `None` if no eBPF data
/// plane is pinned there.
pub fn read(
    bpffs: &Path,
    filter: &Filter,
    timeouts: &Timeouts,
    now_ns: u64,
) -> anyhow::Result<Option<Vec<Flow>>> {
    let pins = Pins::new(bpffs);
    if !pins.map(map_names::NAT_V4).exists() {
        return Ok(None);
    }
    let v4 = pins.nat_halves::<[u8; 4]>(&V4_MAPS)?;
    let v6 = pins.nat_halves::<[u8; 16]>(&V6_MAPS)?;
    let mut flows: Vec<Flow> = flows_of(&v4, timeouts, now_ns)
        .into_iter()
        .chain(flows_of(&v6, timeouts, now_ns))
        .filter(|flow| filter.admits(flow))
        .collect();
    flows.sort_by_key(|f| (f.kind, f.source, f.destination, f.proto));
    Ok(Some(flows))
}

/// Every flow of `table` whose halves are both there (a half alone translates nothing).
fn flows_of<A>(table: &Table<A>, timeouts: &Timeouts, now_ns: u64) -> Vec<Flow>
where
    A: Address,
    IpAddr: From<A>,
    NatKey<A>: Pod,
{
    let halves: std::collections::HashMap<&NatKey<A>, &NatEntry<A>> =
        table.iter().map(|(k, e)| (k, e)).collect();
    table
        .iter()
        .filter(|(key, _)| key.direction == direction::EGRESS)
        .filter_map(|(key, egress)| {
            let ingress = halves.get(&key.reverse(egress))?;
            Some(flow(key, egress, ingress, timeouts, now_ns))
        })
        .collect()
}

fn flow<A>(
    key: &NatKey<A>,
    egress: &NatEntry<A>,
    ingress: &NatEntry<A>,
    timeouts: &Timeouts,
    now_ns: u64,
) -> Flow
where
    A: Address,
    IpAddr: From<A>,
{
    let endpoint = |addr: A, port: u16| Endpoint {
        addr: IpAddr::from(addr),
        port: u16::from_be(port),
    };
    let source = endpoint(key.saddr, key.sport);
    let translated = endpoint(egress.addr, egress.port);
    let state = FlowState::of(key, egress, ingress);
    let last_seen = egress.last_seen_ns.max(ingress.last_seen_ns);
    let idle = Duration::from_nanos(now_ns.saturating_sub(last_seen));
    Flow {
        proto: key.proto,
        proto_name: crate::protocols::name(key.proto),
        kind: FlowOwner::of(key, egress).into(),
        source,
        destination: endpoint(key.daddr, key.dport),
        translated_to: (translated != source).then_some(translated),
        state: state.name(),
        idle_seconds: idle.as_secs(),
        expires_in_seconds: (timeouts.of(state) + expiry::LAST_SEEN_LAG)
            .saturating_sub(idle)
            .as_secs(),
    }
}

impl Flow {
    fn is_echo(&self) -> bool {
        !matches!(self.proto, IPPROTO_TCP | IPPROTO_UDP)
    }

    fn end(&self, end: Endpoint) -> String {
        match (self.is_echo(), end.addr) {
            (true, _) => format!("{} id {}", end.addr, end.port),
            (false, IpAddr::V4(addr)) => format!("{addr}:{}", end.port),
            (false, IpAddr::V6(addr)) => format!("[{addr}]:{}", end.port),
        }
    }
}

/// One line, as `conntrack -L` gives one per entry:
/// `udp  pod  10.244.1.2:5353 -> 203.0.113.10:53 as 203.0.113.1:33000 replied idle 2s expires in 28s`.
impl fmt::Display for Flow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = self.kind;
        let destination = if self.is_echo() {
            self.destination.addr.to_string()
        } else {
            self.end(self.destination)
        };
        let translated = match self.translated_to {
            Some(to) => format!("as {}", self.end(to)),
            None => "as itself".to_string(),
        };
        write!(
            f,
            "{:<6} {kind:<4} {} -> {destination} {translated} {} idle {} expires in {}",
            self.proto_name,
            self.end(self.source),
            self.state,
            short(self.idle_seconds),
            short(self.expires_in_seconds),
        )
    }
}

/// `4d23h`, `2m5s`, `2m0s`, `12s`: the largest unit and the next, as Go's durations print
/// (so that two times read the same way whichever side of a minute they fall).
fn short(seconds: u64) -> String {
    let units = [("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)];
    let largest = units
        .iter()
        .position(|&(_, size)| seconds >= size)
        .unwrap_or(units.len() - 1);
    units[largest..]
        .iter()
        .take(2)
        .scan(seconds, |rest, &(name, size)| {
            let part = format!("{}{name}", *rest / size);
            *rest %= size;
            Some(part)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_in_their_two_largest_units() {
        assert_eq!(short(0), "0s");
        assert_eq!(short(12), "12s");
        assert_eq!(short(125), "2m5s");
        assert_eq!(short(120), "2m0s");
        assert_eq!(short(3_600), "1h0m");
        assert_eq!(short(431_999), "4d23h");
    }
}

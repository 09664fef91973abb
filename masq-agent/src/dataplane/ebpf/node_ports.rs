//! The node's own ports, which NAT never hands out (`node_ports`): those the node's sockets
//! listen on (TCP) or are bound to without a peer (UDP), and kube-proxy's NodePort range. The
//! node's flows on them then need no reservation in the NAT table: replies to connections from
//! outside to the node's services, however many, take no entry.
//!
//! Asked of the kernel's socket diagnostics (`NETLINK_SOCK_DIAG`) for the agent's namespace
//! when the programs are loaded and at every sweep: a service that starts in between has its
//! first connections' replies reserved, as before. A dump of listening TCP sockets walks the
//! listening table alone, where `/proc/net/tcp` walks every connection of every namespace on
//! the machine, a busy node's pods' included, to find them. Read from
//! `/proc/net/{tcp,tcp6,udp,udp6}` instead where the kernel has no socket diagnostics.

use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use aya::maps::{Array, MapData};
use masq_ebpf::{Address, IPPROTO_TCP, IPPROTO_UDP, NatEntry, NatKey, node_ports};
use netlink_packet_sock_diag::{
    AF_INET, AF_INET6, SockDiagMessage,
    inet::{ExtensionFlags, InetRequest, SocketId, StateFlags},
};
use netlink_sys::protocols::NETLINK_SOCK_DIAG;

use super::expiry;
use crate::{
    netlink,
    ports::{self, PortRange},
};

/// The ports the node holds, by protocol.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodePorts {
    pub tcp: BTreeSet<u16>,
    pub udp: BTreeSet<u16>,
}

/// The sockets of one protocol that hold a port for the node, as each source names them.
struct Holding {
    proto: u8,
    /// Their states, for the socket diagnostics.
    states: StateFlags,
    /// Their state's number, as `/proc/net` writes it in hex.
    proc_state: &'static str,
    /// The protocol's `/proc/net` files, both families, of the calling thread's namespace
    /// (`/proc/net` is the process's first thread's).
    proc_files: [&'static str; 2],
}

/// TCP's listening sockets, and UDP's without a peer (in `TCP_CLOSE`, as the kernel keeps an
/// unconnected UDP socket).
const HOLDING: [Holding; 2] = [
    Holding {
        proto: IPPROTO_TCP,
        states: StateFlags::LISTEN,
        proc_state: "0A",
        proc_files: ["/proc/thread-self/net/tcp", "/proc/thread-self/net/tcp6"],
    },
    Holding {
        proto: IPPROTO_UDP,
        states: StateFlags::CLOSE,
        proc_state: "07",
        proc_files: ["/proc/thread-self/net/udp", "/proc/thread-self/net/udp6"],
    },
];

impl NodePorts {
    /// What the node holds now: its listening and unconnected sockets, and `node_port_range`.
    /// From the socket diagnostics, or where the kernel has none, from `/proc/net`.
    pub fn read(node_port_range: Option<PortRange>) -> NodePorts {
        Self::from_socket_diagnostics(node_port_range).unwrap_or_else(|err| {
            tracing::debug!("socket diagnostics: {err}; reading /proc/net instead");
            Self::from_proc(node_port_range)
        })
    }

    /// `read`, from the kernel's socket diagnostics.
    pub fn from_socket_diagnostics(
        node_port_range: Option<PortRange>,
    ) -> std::io::Result<NodePorts> {
        let [tcp, udp] = HOLDING.map(|holding| diag_ports(holding.proto, &holding.states));
        Ok(NodePorts {
            tcp: tcp?,
            udp: udp?,
        }
        .with_node_port_range(node_port_range))
    }

    /// `read`, from `/proc/net` of the calling thread's namespace.
    pub fn from_proc(node_port_range: Option<PortRange>) -> NodePorts {
        let [tcp, udp] = HOLDING.map(|holding| proc_ports(holding.proc_files, holding.proc_state));
        NodePorts { tcp, udp }.with_node_port_range(node_port_range)
    }

    fn with_node_port_range(mut self, node_port_range: Option<PortRange>) -> NodePorts {
        if let Some(range) = node_port_range {
            for port in range.first..=range.last {
                self.tcp.insert(port);
                self.udp.insert(port);
            }
        }
        self
    }

    /// Whether a flow of the node's on `port` of `proto` needs its tuple held in the NAT table:
    /// NAT could hand `port` out (it is in `spans`) and the node does not hold it. The programs
    /// judge a node flow's first packet the same way (`node_port_reservable`).
    pub fn reservable(&self, spans: &[PortRange], proto: u8, port: u16) -> bool {
        let held = match proto {
            IPPROTO_TCP => self.tcp.contains(&port),
            IPPROTO_UDP => self.udp.contains(&port),
            _ => false,
        };
        !held && ports::in_spans(spans, port)
    }

    /// The map's words: a bit per port held, TCP's words, then UDP's.
    pub fn words(&self) -> Vec<u64> {
        let mut words = vec![0u64; node_ports::WORDS as usize];
        for (proto, set) in [(IPPROTO_TCP, &self.tcp), (IPPROTO_UDP, &self.udp)] {
            for &port in set {
                if let Some((word, bit)) = node_ports::slot(proto, port) {
                    words[word as usize] |= bit;
                }
            }
        }
        words
    }
}

/// The local ports of the namespace's sockets of `proto` in `states`, both families, from
/// the kernel's socket diagnostics.
fn diag_ports(proto: u8, states: &StateFlags) -> std::io::Result<BTreeSet<u16>> {
    let socket = netlink::socket(NETLINK_SOCK_DIAG)?;
    let mut ports = BTreeSet::new();
    for (family, any) in [
        (AF_INET, SocketId::new_v4()),
        (AF_INET6, SocketId::new_v6()),
    ] {
        let request = InetRequest {
            family,
            protocol: proto,
            extensions: ExtensionFlags::empty(),
            states: states.clone(),
            socket_id: any,
        };
        for answer in netlink::dump(&socket, SockDiagMessage::InetRequest(request))? {
            if let SockDiagMessage::InetResponse(response) = answer {
                ports.insert(response.header.socket_id.source_port);
            }
        }
    }
    Ok(ports)
}

/// The local ports of the sockets `files` list in `state`. A kernel without IPv6 has no tcp6:
/// nothing held there.
fn proc_ports(files: [&str; 2], state: &str) -> BTreeSet<u16> {
    files
        .iter()
        .filter_map(|file| std::fs::read_to_string(file).ok())
        .flat_map(|text| local_ports(&text, state).collect::<Vec<_>>())
        .collect()
}

/// The local ports of `/proc/net/{tcp,udp}*`'s sockets in `state`.
fn local_ports<'a>(text: &'a str, state: &'a str) -> impl Iterator<Item = u16> + 'a {
    text.lines().skip(1).filter_map(move |line| {
        let mut fields = line.split_whitespace();
        // sl, local address, remote address, state.
        let local = fields.nth(1)?;
        let socket_state = fields.nth(1)?;
        (socket_state == state)
            .then(|| local.rsplit_once(':'))
            .flatten()
            .and_then(|(_, port)| u16::from_str_radix(port, 16).ok())
    })
}

/// Makes `map` hold `ports`, writing only the words that differ from `written` (what was
/// written before, all zeros for a fresh map), which it then holds.
pub fn write(
    map: &mut Array<MapData, u64>,
    ports: &NodePorts,
    written: &mut Vec<u64>,
) -> anyhow::Result<()> {
    write_words(map, &ports.words(), written)
}

/// Makes `map` hold `words`, writing only those that differ from `written`, which then holds
/// what the map holds, a failed write's words included.
fn write_words(
    map: &mut Array<MapData, u64>,
    words: &[u64],
    written: &mut Vec<u64>,
) -> anyhow::Result<()> {
    written.resize(words.len(), 0);
    for (index, (&new, old)) in words.iter().zip(written.iter_mut()).enumerate() {
        if new != *old {
            map.set(index as u32, new, 0)?;
            *old = new;
        }
    }
    Ok(())
}

/// The programs' maps of the node's ports: `node_ports`, and which of them no NAT entry holds
/// on the node's side (`entryless_ports`).
pub struct PortMaps<'a> {
    pub held: &'a mut Array<MapData, u64>,
    pub entryless: &'a mut Array<MapData, u64>,
}

/// The node's ports as the agent wrote them into `PortMaps`.
///
/// A port's entryless bit lets the node's packets on it skip the NAT table's lookup, so it is
/// set only where no entry can hold the port: held (NAT hands it out no more) since before a
/// read of the table that found no entry on it, with `GRACE` between, as a program that judged
/// a new flow before the port was held may insert its entry just after. It is cleared before
/// the port stops being held, when NAT may hand it out again. Or outside NAT's spans, once a
/// read found no entry holding such a port (`outside_spans_entryless`): the programs make none,
/// so those bits stay, held or not.
#[derive(Debug, Default)]
pub struct HeldPorts {
    /// As last read.
    pub ports: NodePorts,
    /// `node_ports`' words as written, and when last written.
    held: Vec<u64>,
    held_at: Option<Instant>,
    /// The ports held at every write since `held_since`, an earlier write.
    held_throughout: Vec<u64>,
    held_since: Option<Instant>,
    /// `entryless_ports`' words as written.
    entryless: Vec<u64>,
    /// The bits of the ports outside NAT's spans, once no entry holds one
    /// (`outside_spans_entryless`); empty until then.
    outside_spans: Vec<u64>,
}

/// What the agent logs when the ports it found held without an entry change, with the number
/// of those inside NAT's spans.
pub const ENTRYLESS_CHANGED: &str =
    "ports the node holds without a NAT entry changed: the node's packets on them skip the lookup";

/// What the agent logs once it sets the bits of the ports outside NAT's spans
/// (`HeldPorts::outside_spans_entryless`).
pub const OUTSIDE_SPANS_ENTRYLESS: &str = "no NAT entry holds a port outside NAT's spans on the node's side: the node's packets on those ports skip the lookup";

/// How long after a port is held a read of the NAT table may find it without an entry: a
/// program that judged a new flow before may still insert its entry just after, but programs
/// run for microseconds.
pub const GRACE: Duration = Duration::from_secs(1);

impl HeldPorts {
    /// Makes the maps hold `ports`: a port no longer held loses its entryless bit first.
    pub fn hold(&mut self, maps: PortMaps, ports: NodePorts) -> anyhow::Result<()> {
        let words = ports.words();
        let entryless = either(&both(&self.entryless, &words), &self.outside_spans);
        write_words(maps.entryless, &entryless, &mut self.entryless)?;
        let (before, since) = (self.held.clone(), self.held_at);
        // The time of the attempt: a failed write may have left some of the words written.
        self.held_at = Some(Instant::now());
        self.ports = ports;
        let written = write_words(maps.held, &words, &mut self.held);
        self.held_throughout = both(&before, &self.held);
        self.held_since = since;
        written
    }

    /// After a read of the NAT tables, started at `read_at`, in which `seen` has the bit of
    /// every port an entry holds on the node's side: sets the entryless bit of every port held
    /// since `GRACE` before the read that no entry holds, and clears that of every port an entry
    /// holds. `settled`: since when no program that judges by other held ports (an earlier
    /// agent's) runs and no flow is left to carry in; `None` while some may, and no bit is set.
    pub fn mark_entryless(
        &mut self,
        map: &mut Array<MapData, u64>,
        seen: &[u64],
        read_at: Instant,
        settled: Option<Instant>,
    ) -> anyhow::Result<()> {
        let long_enough =
            |since: Option<Instant>| since.is_some_and(|at| read_at.duration_since(at) >= GRACE);
        let candidates = if long_enough(settled) && long_enough(self.held_since) {
            &self.held_throughout
        } else {
            &self.entryless
        };
        let entryless = either(&first_only(candidates, seen), &self.outside_spans);
        // The ports inside the spans: those outside are set once, and said once.
        let count = |words: &[u64]| {
            first_only(words, &self.outside_spans)
                .iter()
                .map(|w| w.count_ones())
                .sum::<u32>()
        };
        let before = count(&self.entryless);
        let written = write_words(map, &entryless, &mut self.entryless);
        let after = count(&self.entryless);
        if after != before {
            tracing::info!(ports = after, "{ENTRYLESS_CHANGED}");
        }
        written
    }

    /// From the next write of `entryless_ports` on, sets the bit of every port outside `spans`,
    /// NAT's: called once a read of the NAT tables found no entry holding such a port on the
    /// node's side while no older table's flows were left to carry in (a table reused or
    /// carried from an agent with other spans may hold some until then). The programs make no
    /// such entry, so the bits stay.
    pub fn outside_spans_entryless(&mut self, spans: &[PortRange]) {
        let outside: BTreeSet<u16> = (0..=u16::MAX)
            .filter(|&port| !ports::in_spans(spans, port))
            .collect();
        self.outside_spans = NodePorts {
            tcp: outside.clone(),
            udp: outside,
        }
        .words();
        tracing::info!("{OUTSIDE_SPANS_ENTRYLESS}");
    }

    /// Whether the ports outside NAT's spans are entryless (`outside_spans_entryless`).
    pub fn outside_spans_are_entryless(&self) -> bool {
        !self.outside_spans.is_empty()
    }

    /// Whether a flow of the node's on `port` of `proto` needs its tuple held in the NAT table
    /// (see `NodePorts::reservable`).
    pub fn reservable(&self, spans: &[PortRange], proto: u8, port: u16) -> bool {
        self.ports.reservable(spans, proto, port)
    }
}

/// The bits set in both `a` and `b`.
fn both(a: &[u64], b: &[u64]) -> Vec<u64> {
    word_by_word(a, b, |a, b| a & b)
}

/// The bits set in `a` or `b`.
fn either(a: &[u64], b: &[u64]) -> Vec<u64> {
    word_by_word(a, b, |a, b| a | b)
}

/// The bits set in `a` and not in `b`.
fn first_only(a: &[u64], b: &[u64]) -> Vec<u64> {
    word_by_word(a, b, |a, b| a & !b)
}

/// `op` over `a` and `b` word by word, a missing word taken as zero; as long as the map.
fn word_by_word(a: &[u64], b: &[u64], op: impl Fn(u64, u64) -> u64) -> Vec<u64> {
    let word = |words: &[u64], i: usize| words.get(i).copied().unwrap_or_default();
    (0..node_ports::WORDS as usize)
        .map(|i| op(word(a, i), word(b, i)))
        .collect()
}

/// What a sweep's read of the NAT tables finds of the ports entries hold on the node's side
/// (`expiry::node_side_port`).
#[derive(Debug)]
pub struct NodeSidePorts<'a> {
    spans: &'a [PortRange],
    /// Whether every such port is inside NAT's `spans`.
    pub all_in_spans: bool,
    /// A bit for each, by protocol, in `node_ports`' layout.
    pub seen: Vec<u64>,
}

impl NodeSidePorts<'_> {
    pub fn new(spans: &[PortRange]) -> NodeSidePorts<'_> {
        NodeSidePorts {
            spans,
            all_in_spans: true,
            seen: vec![0; node_ports::WORDS as usize],
        }
    }

    /// Takes in one half of a flow.
    pub fn look<A: Address>(&mut self, key: &NatKey<A>, entry: &NatEntry<A>) {
        let Some(port) = expiry::node_side_port(key, entry) else {
            return;
        };
        self.all_in_spans &= ports::in_spans(self.spans, port);
        if let Some((word, bit)) = node_ports::slot(key.proto, port) {
            self.seen[word as usize] |= bit;
        }
    }

    /// Takes in what the sweep program found: the ports in `node_ports`' layout, and how many
    /// halves hold one outside NAT's spans.
    pub fn take_swept(&mut self, words: &[u64], outside_spans: u64) {
        self.all_in_spans &= outside_spans == 0;
        for (seen, word) in self.seen.iter_mut().zip(words) {
            *seen |= word;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TCP: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:2805 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0000000000000000 100 0 0 10 0
   1: 0100007F:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2 1 0000000000000000 100 0 0 10 0
   2: 0A00000A:C350 0A000014:0050 01 00000000:00000000 00:00000000 00000000     0        0 3 1 0000000000000000 20 4 30 10 -1
";
    const TCP6: &str = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4 1 0000000000000000 100 0 0 10 0
";

    #[test]
    fn listening_sockets_of_both_families_are_read_and_connected_ones_are_not() {
        let listening = HOLDING[0].proc_state;
        let ports: Vec<u16> = local_ports(TCP, listening)
            .chain(local_ports(TCP6, listening))
            .collect();
        assert_eq!(ports, [10245, 22, 8080]);
    }

    #[test]
    fn only_a_port_nat_could_hand_out_and_the_node_does_not_hold_is_reservable() {
        let ports = NodePorts {
            tcp: BTreeSet::from([10250]),
            udp: BTreeSet::new(),
        };
        let spans = [PortRange {
            first: 1024,
            last: 32767,
        }];
        assert!(ports.reservable(&spans, IPPROTO_TCP, 20000));
        assert!(!ports.reservable(&spans, IPPROTO_TCP, 10250), "the node's");
        assert!(
            ports.reservable(&spans, IPPROTO_UDP, 10250),
            "only TCP's is held"
        );
        assert!(!ports.reservable(&spans, IPPROTO_TCP, 40000), "ephemeral");
        assert!(!ports.reservable(&spans, IPPROTO_TCP, 22), "below 1024");
    }

    #[test]
    fn each_port_sets_its_own_bit_of_its_protocols_words() {
        let ports = NodePorts {
            tcp: BTreeSet::from([22, 30080]),
            udp: BTreeSet::from([53]),
        };
        let words = ports.words();
        assert_eq!(words.len(), node_ports::WORDS as usize);
        assert_eq!(words[0], 1 << 22);
        assert_eq!(words[30080 / 64], 1 << (30080 % 64));
        let udp = node_ports::WORDS_PER_PROTOCOL as usize;
        assert_eq!(words[udp], 1 << 53);
        assert_eq!(words.iter().map(|w| w.count_ones()).sum::<u32>(), 3);
    }

    #[test]
    fn a_read_sees_the_node_side_ports_of_its_halves_and_whether_all_are_in_the_spans() {
        use masq_ebpf::{direction, nat_kind};
        let spans = [PortRange {
            first: 20_000,
            last: 29_999,
        }];
        let half = |proto, direction, dport: u16, kind| {
            let key = NatKey::<[u8; 4]> {
                proto,
                direction,
                sport: 80u16.to_be(),
                dport: dport.to_be(),
                ..NatKey::default()
            };
            let entry = NatEntry {
                kind,
                ..NatEntry::default()
            };
            (key, entry)
        };
        let mut read = NodeSidePorts::new(&spans);
        for (key, entry) in [
            half(IPPROTO_TCP, direction::INGRESS, 20_001, nat_kind::SNAT),
            // A pod's flow that keeps its address holds no port of the node's.
            half(
                IPPROTO_UDP,
                direction::INGRESS,
                40_000,
                nat_kind::PASSTHROUGH,
            ),
        ] {
            read.look(&key, &entry);
        }
        assert!(read.all_in_spans);
        let (word, bit) = node_ports::slot(IPPROTO_TCP, 20_001).unwrap();
        assert_eq!(
            read.seen[word as usize], bit,
            "the reply half's port, TCP's"
        );
        assert_eq!(read.seen.iter().map(|w| w.count_ones()).sum::<u32>(), 1);
        let (key, entry) = half(IPPROTO_UDP, direction::INGRESS, 40_000, nat_kind::SNAT);
        read.look(&key, &entry);
        assert!(
            !read.all_in_spans,
            "a reply half holds port 40 000 on the node's side"
        );
        let (word, bit) = node_ports::slot(IPPROTO_UDP, 40_000).unwrap();
        assert_eq!(read.seen[word as usize] & bit, bit);
    }

    #[test]
    fn words_combine_word_by_word_and_a_missing_word_is_zero() {
        assert_eq!(both(&[0b1100], &[0b1010])[0], 0b1000);
        assert_eq!(first_only(&[0b1100], &[0b1010])[0], 0b0100);
        let words = first_only(&[], &[u64::MAX]);
        assert_eq!(words.len(), node_ports::WORDS as usize);
        assert!(words.iter().all(|&w| w == 0));
    }
}

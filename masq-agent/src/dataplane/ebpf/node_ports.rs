//! The node's own ports, which NAT never hands out (`node_ports`): those the node's sockets
//! listen on (TCP) or are bound to without a peer (UDP), and kube-proxy's NodePort range. The
//! node's flows on them then need no reservation in the NAT table: replies to connections from
//! outside to the node's services, however many, take no entry.
//!
//! Read from the namespace's `/proc/net/{tcp,tcp6,udp,udp6}` when the programs are loaded and
//! at every sweep: a service that starts in between has its first connections' replies
//! reserved, as before.

use std::collections::BTreeSet;

use aya::maps::{Array, MapData};
use masq_ebpf::{IPPROTO_TCP, IPPROTO_UDP, node_ports};

use crate::ports::PortRange;

/// The ports the node holds, by protocol.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodePorts {
    pub tcp: BTreeSet<u16>,
    pub udp: BTreeSet<u16>,
}

/// `/proc/net/tcp`'s state of a listening socket.
const TCP_LISTEN: &str = "0A";
/// `/proc/net/udp`'s state of a socket without a peer.
const UDP_UNCONNECTED: &str = "07";

impl NodePorts {
    /// What the node holds now: its listening and unconnected sockets, and `node_port_range`.
    pub fn read(node_port_range: Option<PortRange>) -> NodePorts {
        let held = |files: [&str; 2], state: &str| -> BTreeSet<u16> {
            files
                .iter()
                // A kernel without IPv6 has no tcp6: nothing held there.
                .filter_map(|file| std::fs::read_to_string(file).ok())
                .flat_map(|text| local_ports(&text, state).collect::<Vec<_>>())
                .collect()
        };
        let mut ports = NodePorts {
            tcp: held(["/proc/net/tcp", "/proc/net/tcp6"], TCP_LISTEN),
            udp: held(["/proc/net/udp", "/proc/net/udp6"], UDP_UNCONNECTED),
        };
        if let Some(range) = node_port_range {
            for port in range.first..=range.last {
                ports.tcp.insert(port);
                ports.udp.insert(port);
            }
        }
        ports
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
        !held && spans.iter().any(|s| (s.first..=s.last).contains(&port))
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
    let words = ports.words();
    written.resize(words.len(), 0);
    for (index, (&new, old)) in words.iter().zip(written.iter_mut()).enumerate() {
        if new != *old {
            map.set(index as u32, new, 0)?;
            *old = new;
        }
    }
    Ok(())
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
        let ports: Vec<u16> = local_ports(TCP, TCP_LISTEN)
            .chain(local_ports(TCP6, TCP_LISTEN))
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
}

//! Packet fuzzing of the real programs through BPF_PROG_TEST_RUN: seeded random mutations of
//! valid frames (truncations, bogus versions, lengths, protocols and fragment fields, ICMP
//! errors quoting garbage; for IPv4, bad IHL and IP options; for IPv6, random extension-header
//! chains and fragment headers), sent out and in over a NAT table that holds live flows.
//! Every output must be a drop, the input unchanged, or a translation that changed only what a
//! translation changes, kept every checksum exactly as valid as it was, and put in the addresses
//! and ports the NAT table holds for that flow. The checks are written once over the family, as
//! the programs are, with the test bed's parsing and checksum code, nothing of the programs'.
//!
//! `cargo test` runs a short slice of each family (20 000 IPv4 and 200 000 IPv6 packets, a few
//! seconds in release). The seed fixes the frames; the NAT ports come from the kernel's random
//! numbers, so a failure prints the frames in and out. The full run:
//!
//! ```text
//! MASQ_FUZZ_SEED=1 MASQ_FUZZ_ITERATIONS=1000000 cargo test --release -p masq-integration --test packet_fuzz -- --nocapture
//! ```

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, Ipv6Addr},
    ops::Range,
};

use aya::Pod;
use ipnet::{Ipv4Net, Ipv6Net};
use masq_agent::dataplane::ebpf::{
    map_types::NatFamily,
    testbed::{TC_ACT_OK, TC_ACT_SHOT, TestBed},
};
use masq_ebpf::{NatEntry, NatKey, direction, nat_kind, program_names};
use masq_testbed::packet::*;

const GRE: u8 = 47;
/// A fresh NAT table every so many packets, so that new flows keep being translated rather than
/// dropped by a full table.
const BED_LIFETIME: u64 = 20_000;

/// splitmix64: small, seedable, and the same on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }

    fn byte(&mut self) -> u8 {
        self.next() as u8
    }

    /// One of `known`, or any byte at all.
    fn pick_or_any(&mut self, known: &[u8]) -> u8 {
        let (known, any) = (self.pick(known), self.byte());
        self.pick(&[known, any])
    }

    fn garble(&mut self, bytes: &mut [u8]) {
        for b in bytes {
            if self.below(4) == 0 {
                *b = self.byte();
            }
        }
    }
}

/// What the fuzz knows of a family beyond the layout of its frames: its test network, how the
/// NAT table holds its addresses, its ICMP errors, and the damages only its headers can take.
trait Fuzzed: FrameAddress {
    type Octets: Table;
    const NAME: &'static str;
    const NODE: Self;
    const PODS: [Self; 3];
    /// Two to masquerade toward, one in the non-masquerade ranges.
    const REMOTES: [Self; 3];
    const ROUTER: Self;
    /// Packets a plain `cargo test` sends.
    const ITERATIONS: u64;
    /// Mixed into the seed, so that each family's frames are its own for a seed.
    const STREAM: u64;
    const ETHERTYPE: u16;
    /// The errors the corpus sends, of every type that quotes a packet: type, code, rest of
    /// header.
    const ERRORS: &'static [(u8, u8, [u8; 4])];
    /// Types a mutation gives an ICMP message.
    const ICMP_TYPES: &'static [u8];
    /// Where the protocol (IPv6: the first next header) sits, and what a mutation puts there.
    const PROTOCOL: usize;
    const PROTOCOLS: &'static [u8];
    /// Where the length field sits, and where the bytes it counts begin: IPv4's total length
    /// counts the header, IPv6's payload length does not.
    const LENGTH: usize;
    const LENGTH_FROM: usize;
    /// How many damages `damage` knows.
    const DAMAGES: usize;

    fn table_octets(self) -> Self::Octets;
    fn bed() -> TestBed;
    /// A fragment other than the first, which carries no L4 header.
    fn is_later_fragment(f: &[u8], ip: usize) -> bool;
    /// `frame` with what a valid packet of the family may carry between its IP header and its
    /// upper layer: IP options, extension headers.
    fn dressed(frame: Vec<u8>, rng: &mut Rng) -> Vec<u8>;
    /// Packets of the family's own housekeeping, which the programs must leave alone.
    fn bystanders(rng: &mut Rng) -> Vec<Vec<u8>>;
    /// The family's own damage number `which` (below `DAMAGES`).
    fn damage(f: &mut Vec<u8>, which: usize, rng: &mut Rng);
}

/// A family's NAT table, read with the entry types the kernel copies.
trait Table: NatFamily {
    fn entry(bed: &TestBed, key: &NatKey<Self>) -> Option<NatEntry<Self>>;
}

impl<A: NatFamily> Table for A
where
    NatKey<A>: Pod,
    NatEntry<A>: Pod,
{
    fn entry(bed: &TestBed, key: &NatKey<A>) -> Option<NatEntry<A>> {
        bed.nat_entry(key)
    }
}

impl Fuzzed for Ipv4Addr {
    type Octets = [u8; 4];
    const NAME: &'static str = "IPv4";
    const NODE: Self = Ipv4Addr::new(203, 0, 113, 1);
    const PODS: [Self; 3] = [
        Ipv4Addr::new(10, 244, 1, 2),
        Ipv4Addr::new(10, 244, 2, 2),
        Ipv4Addr::new(10, 244, 3, 7),
    ];
    const REMOTES: [Self; 3] = [
        Ipv4Addr::new(203, 0, 113, 10),
        Ipv4Addr::new(198, 51, 100, 10),
        Ipv4Addr::new(10, 200, 0, 10),
    ];
    const ROUTER: Self = Ipv4Addr::new(203, 0, 113, 254);
    const ITERATIONS: u64 = 20_000;
    const STREAM: u64 = 0;
    const ETHERTYPE: u16 = 0x0800;
    /// Fragmentation needed, port unreachable, time exceeded, parameter problem.
    const ERRORS: &'static [(u8, u8, [u8; 4])] = &[
        (3, 4, [0, 0, 0x05, 0x78]),
        (3, 3, [0; 4]),
        (11, 0, [0; 4]),
        (12, 0, [20, 0, 0, 0]),
    ];
    const ICMP_TYPES: &'static [u8] = &[0, 3, 4, 5, 8, 11, 12];
    const PROTOCOL: usize = IP + 9;
    const PROTOCOLS: &'static [u8] = &[ICMP, TCP, UDP, GRE];
    const LENGTH: usize = IP + 2;
    const LENGTH_FROM: usize = IP;
    const DAMAGES: usize = 3;

    fn table_octets(self) -> [u8; 4] {
        self.octets()
    }

    fn bed() -> TestBed {
        let non_masq: Vec<Ipv4Net> = ["10.0.0.0/8", "169.254.0.0/16"]
            .iter()
            .map(|n| n.parse().unwrap())
            .collect();
        TestBed::new(65_536, &[(1024, 65535)], true, Self::NODE, &non_masq).expect("test bed")
    }

    fn is_later_fragment(f: &[u8], ip: usize) -> bool {
        word(f, ip + 6) & IPV4_OFFSET_MASK != 0
    }

    fn dressed(mut f: Vec<u8>, rng: &mut Rng) -> Vec<u8> {
        // Options a router passes on, the header checksum kept valid: no-ops, then the end of
        // the list.
        let words = rng.below(3);
        let mut options = vec![1; words * 4];
        if let Some(last) = options.last_mut() {
            *last = 0;
        }
        f.splice(Self::L4..Self::L4, options);
        f[IP] = 0x45 + words as u8;
        let total = word(&f, IP + 2) + 4 * words as u16;
        f[IP + 2..IP + 4].copy_from_slice(&total.to_be_bytes());
        f[IP + 10..IP + 12].copy_from_slice(&[0, 0]);
        let sum = checksum(&f[IP..Self::L4 + 4 * words]);
        f[IP + 10..IP + 12].copy_from_slice(&sum.to_be_bytes());
        f
    }

    fn bystanders(_: &mut Rng) -> Vec<Vec<u8>> {
        Vec::new()
    }

    fn damage(f: &mut Vec<u8>, which: usize, rng: &mut Rng) {
        match which {
            0 if f.len() > IP => f[IP] = (f[IP] & 0xf0) | (rng.byte() & 0x0f),
            1 if f.len() > IP + 7 => {
                f[IP + 6..IP + 8].copy_from_slice(&(rng.next() as u16).to_be_bytes());
            }
            2 if f.len() > Self::L4 => {
                // IP options, the checksum left as it was: the header grows, and what follows
                // moves back.
                let words = 1 + rng.below(10);
                let options: Vec<u8> = (0..words * 4).map(|_| rng.byte()).collect();
                f.splice(Self::L4..Self::L4, options);
                f[IP] = 0x40 | (5 + words as u8);
            }
            _ => {}
        }
    }
}

const LINK_LOCAL6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
const ALL_NODES6: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);

impl Fuzzed for Ipv6Addr {
    type Octets = [u8; 16];
    const NAME: &'static str = "IPv6";
    const NODE: Self = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 1);
    const PODS: [Self; 3] = [
        Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 2),
        Ipv6Addr::new(0xfd00, 0x10, 0x244, 2, 0, 0, 0, 2),
        Ipv6Addr::new(0xfd00, 0x10, 0x244, 3, 0, 0, 0, 7),
    ];
    const REMOTES: [Self; 3] = [
        Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x10),
        Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 0x10),
        Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x10),
    ];
    const ROUTER: Self = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0xfe);
    const ITERATIONS: u64 = 200_000;
    const STREAM: u64 = 0x6666_6666_6666_6666;
    const ETHERTYPE: u16 = ETHERTYPE_IPV6;
    const ERRORS: &'static [(u8, u8, [u8; 4])] = &[
        (ICMPV6_PACKET_TOO_BIG, 0, [0, 0, 5, 0]),
        (ICMPV6_DEST_UNREACH, 4, [0; 4]),
        (ICMPV6_DEST_UNREACH, 3, [0; 4]),
        (ICMPV6_TIME_EXCEEDED, 0, [0; 4]),
        (ICMPV6_PARAMETER_PROBLEM, 0, [0, 0, 0, 6]),
    ];
    const ICMP_TYPES: &'static [u8] = &[
        ICMPV6_DEST_UNREACH,
        ICMPV6_PACKET_TOO_BIG,
        ICMPV6_TIME_EXCEEDED,
        ICMPV6_PARAMETER_PROBLEM,
        ICMPV6_ECHO_REQUEST,
        ICMPV6_ECHO_REPLY,
        ND_ROUTER_SOLICIT,
        ND_NEIGHBOR_SOLICIT,
        ND_NEIGHBOR_ADVERT,
    ];
    const PROTOCOL: usize = IP + 6;
    /// The next-header values a chain is made of, too, valid or not.
    const PROTOCOLS: &'static [u8] = &[
        NH_HOP_BY_HOP,
        NH_ROUTING,
        NH_FRAGMENT,
        NH_AUTH,
        NH_DEST_OPTS,
        NH_NO_NEXT,
        TCP,
        UDP,
        ICMPV6,
    ];
    const LENGTH: usize = IP + 4;
    const LENGTH_FROM: usize = Self::L4;
    const DAMAGES: usize = 4;

    fn table_octets(self) -> [u8; 16] {
        self.octets()
    }

    /// The IPv4 bed with IPv6 masqueraded too, fd00::/8 and fe80::/10 left alone.
    fn bed() -> TestBed {
        let mut bed = Ipv4Addr::bed();
        let non_masq: Vec<Ipv6Net> = ["fd00::/8", "fe80::/10"]
            .iter()
            .map(|n| n.parse().unwrap())
            .collect();
        bed.enable_ipv6(Self::NODE, &non_masq)
            .expect("IPv6 enabled");
        bed
    }

    fn is_later_fragment(f: &[u8], ip: usize) -> bool {
        headers6_at(f, ip).is_some_and(|h| h.is_later_fragment())
    }

    fn dressed(frame: Vec<u8>, rng: &mut Rng) -> Vec<u8> {
        let chain: Vec<ExtHeader> = (0..rng.below(3)).map(|_| random_ext(rng, false)).collect();
        insert_ext6(&frame, &chain)
    }

    /// Neighbour discovery and MLD.
    fn bystanders(rng: &mut Rng) -> Vec<Vec<u8>> {
        let target = rng.pick(&Self::REMOTES).octets();
        let (from, kind, rest, body) = match rng.below(4) {
            0 => (LINK_LOCAL6, ND_NEIGHBOR_SOLICIT, [0; 4], &target[..]),
            1 => (Self::NODE, ND_NEIGHBOR_ADVERT, [0x20, 0, 0, 0], &target[..]),
            2 => (LINK_LOCAL6, ND_ROUTER_ADVERT, [64, 0, 7, 8], &[0; 8][..]),
            _ => {
                let report = icmp_frame(LINK_LOCAL6, ALL_NODES6, MLD_REPORT, 0, [0; 4], &target);
                let alerted = insert_ext6(&report, &[ExtHeader::router_alert()]);
                return vec![with_hop_limit6(&alerted, 1)];
            }
        };
        let message = icmp_frame(from, ALL_NODES6, kind, 0, rest, body);
        vec![with_hop_limit6(&message, 255)]
    }

    fn damage(f: &mut Vec<u8>, which: usize, rng: &mut Rng) {
        let parsed = headers6(f);
        match which {
            // A random chain behind the fixed header: up to eight headers, some malformed.
            0 if f.len() >= Self::L4 => *f = insert_ext6(f, &random_chain(rng, 8)),
            // Fragment fields: a fragment header's offset, M flag and id, or a new one.
            1 => match parsed.and_then(|h| h.fragment) {
                Some(frag) => {
                    let ExtHeader { bytes, .. } = random_fragment(rng);
                    let end = rng.pick(&[4, 8]);
                    f[frag.at + 2..frag.at + end].copy_from_slice(&bytes[2..end]);
                }
                None if f.len() >= Self::L4 => *f = insert_ext6(f, &[random_fragment(rng)]),
                None => {}
            },
            // An extension header's next-header or length field, bogus.
            2 => {
                if let Some(h) = parsed.filter(|h| !h.exts.is_empty()) {
                    let (_, at, _) = h.exts[rng.below(h.exts.len())];
                    if rng.below(2) == 0 {
                        f[at] = rng.pick_or_any(Ipv6Addr::PROTOCOLS);
                    } else {
                        f[at + 1] = rng.pick_or_any(&[0, 1, 255]);
                    }
                }
            }
            // A quote whose chain grows: extension headers inside the quoted packet.
            3 => {
                if let Some(h) = parsed.filter(|h| h.proto == ICMPV6) {
                    let inner = h.l4 + 8;
                    if f.len() >= inner + IPV6_HLEN {
                        let chain = random_chain(rng, 4);
                        let quoted = insert_ext6(&[&f[..inner - IP], &f[inner..]].concat(), &chain);
                        *f = [&f[..inner], &quoted[inner - IP..]].concat();
                    }
                }
            }
            _ => {}
        }
    }
}

/// An extension header of a random kind and length: hop-by-hop, routing, destination options
/// or authentication; with `fragments`, a fragment header too.
fn random_ext(rng: &mut Rng, fragments: bool) -> ExtHeader {
    let units = rng.below(4) as u8;
    match rng.below(if fragments { 5 } else { 4 }) {
        0 => ExtHeader::hop_by_hop(units),
        1 => ExtHeader::routing(units),
        2 => ExtHeader::destination_options(units),
        3 => ExtHeader::auth(2 * units + 2),
        _ => random_fragment(rng),
    }
}

/// A fragment header: first, later (sometimes overlapping the first), or atomic.
fn random_fragment(rng: &mut Rng) -> ExtHeader {
    let offset = match rng.below(4) {
        0 => 0,
        1 => 1 + rng.below(8) as u16,
        _ => rng.next() as u16 & 0x1fff,
    };
    let id = if rng.below(2) == 0 {
        rng.below(4) as u32
    } else {
        rng.next() as u32
    };
    ExtHeader::fragment(offset, rng.below(3) != 0, id)
}

/// A random chain of up to `max` extension headers, some malformed: bogus lengths and kinds.
fn random_chain(rng: &mut Rng, max: usize) -> Vec<ExtHeader> {
    (0..rng.below(max + 1))
        .map(|_| match rng.below(10) {
            0 => {
                let len = 8 * rng.below(4) + rng.pick(&[0, 0, 0, 2, 5]);
                let mut bytes: Vec<u8> = (0..len).map(|_| rng.byte()).collect();
                if let Some(b) = bytes.get_mut(1) {
                    *b = rng.pick_or_any(&[0, 1, 2]);
                }
                ExtHeader::raw(rng.pick_or_any(Ipv6Addr::PROTOCOLS), bytes)
            }
            _ => random_ext(rng, true),
        })
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Hook {
    Egress,
    Ingress,
}

impl Hook {
    fn direction(self) -> u8 {
        match self {
            Hook::Egress => direction::EGRESS,
            Hook::Ingress => direction::INGRESS,
        }
    }

    /// The address a translation on this hook rewrites: the source on the way out, the
    /// destination on the way in.
    fn translated<A: FrameAddress>(self) -> usize {
        match self {
            Hook::Egress => A::SRC,
            Hook::Ingress => A::DST,
        }
    }
}

/// The verdict and output frame; `None` when the kernel's test runner refuses the frame
/// itself (it wants a whole IPv4 header behind an IPv4 ethertype, for one), so that the program
/// never sees it.
fn try_run(bed: &mut TestBed, hook: Hook, frame: &[u8]) -> Option<(u32, Vec<u8>)> {
    let program = match hook {
        Hook::Egress => program_names::EGRESS,
        Hook::Ingress => program_names::INGRESS,
    };
    match bed.run(program, frame, 1) {
        Ok(run) => Some((run.verdict, run.frame)),
        Err(err) if format!("{err:#}").contains("os error 22") => None,
        Err(err) => panic!("test run: {err:#}"),
    }
}

fn run(bed: &mut TestBed, hook: Hook, frame: &[u8]) -> (u32, Vec<u8>) {
    try_run(bed, hook, frame).expect("a valid frame runs")
}

/// Valid frames, and the hook each goes through.
type Frames = Vec<(Hook, Vec<u8>)>;

/// Valid frames of every kind the programs handle, in both directions. The ingress ones answer
/// flows the egress program has just translated, so that they meet live NAT entries: replies,
/// fragmented replies, and errors quoting what left.
fn corpus<A: Fuzzed>(bed: &mut TestBed, rng: &mut Rng) -> Frames {
    let mut frames = Vec::new();
    for _ in 0..8 {
        let (pod, remote) = (rng.pick(&A::PODS), rng.pick(&A::REMOTES));
        let (sport, dport) = (1024 + rng.below(60_000) as u16, rng.pick(&[53u16, 80, 443]));
        let datagram_len = 8 + 8 * rng.below(40);
        let mut out = vec![
            tcp(pod, sport, remote, dport, SYN),
            tcp(pod, sport, remote, dport, ACK),
            A::dressed(tcp(pod, sport ^ 2, remote, dport, SYN), rng),
            udp(pod, sport, remote, dport),
            A::dressed(udp(pod, sport ^ 3, remote, dport), rng),
            ping(pod, remote, A::ECHO_REQUEST, sport),
            A::dressed(ping(pod, remote, A::ECHO_REQUEST, sport ^ 4), rng),
            frame(pod, remote, GRE, &[0u8; 8]),
            tcp(A::NODE, sport, remote, dport, SYN),
        ];
        out.extend(A::bystanders(rng));
        // A fragmented datagram, first fragment first.
        let datagram = udp_datagram(rng, (pod, sport ^ 1), (remote, dport), datagram_len);
        let id = rng.next() as u32;
        out.extend(fragments(pod, remote, UDP, &datagram, id, 48));
        for packet in out {
            frames.push((Hook::Egress, packet.clone()));
            let (verdict, left) = run(bed, Hook::Egress, &packet);
            if verdict != TC_ACT_OK || left == packet {
                continue;
            }
            let Some(p) = A::packet_at(&left, IP).filter(|_| !A::is_later_fragment(&left, IP))
            else {
                continue;
            };
            for _ in 0..2 {
                frames.push((Hook::Ingress, icmp_error(rng, (A::ROUTER, A::NODE), &left)));
            }
            let (node_port, their_port) = (word(&left, p.l4), word(&left, p.l4 + 2));
            let reply = match p.proto {
                TCP => tcp(remote, their_port, A::NODE, node_port, SYN | ACK),
                UDP if p.partial => {
                    let to = (A::NODE, node_port);
                    let reply = udp_datagram(rng, (remote, their_port), to, datagram.len());
                    for f in fragments(remote, A::NODE, UDP, &reply, rng.next() as u32, 48) {
                        frames.push((Hook::Ingress, f));
                    }
                    continue;
                }
                UDP => udp(remote, their_port, A::NODE, node_port),
                _ => ping(remote, A::NODE, A::ECHO_REPLY, word(&left, p.l4 + 4)),
            };
            let reply = A::dressed(reply, rng);
            frames.push((Hook::Ingress, reply.clone()));
            // The reply as the pod got it, and errors about it leaving: the pod's own, the
            // node's, or another pod's.
            let (_, restored) = run(bed, Hook::Ingress, &reply);
            if restored != reply {
                for from in [pod, A::NODE, rng.pick(&A::PODS)] {
                    frames.push((Hook::Egress, icmp_error(rng, (from, remote), &restored)));
                }
            }
        }
        // A connection opened from outside toward a pod, and the pod's answer.
        let inbound = tcp(remote, dport, pod, sport ^ 5, SYN);
        run(bed, Hook::Ingress, &inbound);
        frames.push((Hook::Ingress, inbound));
        frames.push((Hook::Egress, tcp(pod, sport ^ 5, remote, dport, SYN | ACK)));
        frames.extend(A::bystanders(rng).into_iter().map(|f| (Hook::Ingress, f)));
    }
    frames
}

/// A UDP datagram of `len` bytes, with its checksum over the whole of it.
fn udp_datagram<A: FrameAddress>(
    rng: &mut Rng,
    (src, sport): (A, u16),
    (dst, dport): (A, u16),
    len: usize,
) -> Vec<u8> {
    let mut d = [sport, dport, len as u16, 0]
        .iter()
        .flat_map(|w| w.to_be_bytes())
        .collect::<Vec<u8>>();
    d.extend((8..len).map(|_| rng.byte()));
    fill_checksum(src, dst, UDP, &mut d);
    d
}

/// An ICMP error from `from` to `to` about `about` (a frame), quoting all of it or a part.
fn icmp_error<A: Fuzzed>(rng: &mut Rng, (from, to): (A, A), about: &[u8]) -> Vec<u8> {
    let (kind, code, rest) = rng.pick(A::ERRORS);
    let whole = about.len() - IP;
    let part = A::IP_HLEN + rng.below(whole + 1 - A::IP_HLEN);
    let quote_len = rng.pick(&[whole, whole, (A::IP_HLEN + 8).min(whole), part]);
    icmp_frame(from, to, kind, code, rest, &about[IP..IP + quote_len])
}

/// Damages every family's frames can take; the family's own come after them.
const COMMON_DAMAGES: usize = 9;

/// One to three random damages of the kinds real networks and attackers produce.
fn mutate<A: Fuzzed>(frame: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut f = frame.to_vec();
    for _ in 0..1 + rng.below(3) {
        let packet = A::packet_at(&f, IP);
        match rng.below(COMMON_DAMAGES + A::DAMAGES) {
            0 => {
                let i = rng.below(f.len());
                f[i] = rng.byte();
            }
            // The kernel's test runner wants at least an Ethernet header.
            1 => f.truncate(IP + rng.below(f.len() - IP + 1)),
            2 if f.len() >= A::LENGTH + 2 => {
                let len = match rng.below(3) {
                    0 => 0,
                    1 => f.len().saturating_sub(A::LENGTH_FROM) as u16 ^ (1 << rng.below(12)),
                    _ => rng.next() as u16,
                };
                f[A::LENGTH..A::LENGTH + 2].copy_from_slice(&len.to_be_bytes());
            }
            3 if f.len() > A::PROTOCOL => f[A::PROTOCOL] = rng.pick_or_any(A::PROTOCOLS),
            4 if f.len() > IP => f[IP] = (rng.byte() & 0xf0) | (f[IP] & 0x0f),
            5 => f.extend((0..rng.below(64)).map(|_| rng.byte())),
            // Garbage where an ICMP error quotes a packet.
            6 => {
                let quote = packet.map_or(A::L4, |p| p.l4) + 8;
                let end = f.len().min(quote + A::IP_HLEN + 16);
                rng.garble(&mut f[quote.min(end)..end]);
            }
            7 => {
                if let Some(p) = packet.filter(|p| p.proto == A::ICMP && p.l4 < f.len()) {
                    f[p.l4] = rng.pick_or_any(A::ICMP_TYPES);
                }
            }
            // A quote cut short, or a header cut in the middle.
            8 => {
                if let Some(p) = packet {
                    let cut = rng.pick(&[p.l4 + 8, IP + A::IP_HLEN]) + rng.below(64);
                    f.truncate(cut.clamp(IP, f.len()));
                }
            }
            own if own >= COMMON_DAMAGES => A::damage(&mut f, own - COMMON_DAMAGES, rng),
            _ => {}
        }
    }
    f
}

/// What a translation was, for the figures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Translation {
    Flow,
    IcmpError,
    LaterFragment,
}

/// A 16-bit field as the NAT table stores it: the packet's bytes, in the host's order.
fn raw(f: &[u8], off: usize) -> u16 {
    u16::from_ne_bytes([f[off], f[off + 1]])
}

fn key<A: Fuzzed>(
    (saddr, daddr): (A, A),
    proto: u8,
    (sport, dport): (u16, u16),
    hook: Hook,
) -> NatKey<A::Octets> {
    NatKey {
        saddr: saddr.table_octets(),
        daddr: daddr.table_octets(),
        sport,
        dport,
        proto,
        direction: hook.direction(),
        _pad: [0; 2],
    }
}

/// The checksum residual of the upper layer at `l4` (to the end of the frame) under the
/// addresses of the IP header at `ip`: 0 when valid. A correct incremental update keeps it
/// unchanged, valid or not.
fn residual_at<A: FrameAddress>(f: &[u8], ip: usize, l4: usize, proto: u8) -> u16 {
    let (src, dst) = (A::at(f, ip + A::SRC - IP), A::at(f, ip + A::DST - IP));
    residual(src, dst, proto, &f[l4..])
}

/// The upper layer at `l4` of the packet at `ip` is exactly as valid as it was, and a UDP
/// datagram without checksum keeps none.
fn l4_checksum_kept<A: FrameAddress>(
    (input, out): (&[u8], &[u8]),
    (ip, l4, proto): (usize, usize, u8),
    what: &str,
) -> Result<(), String> {
    let csum = l4 + l4_checksum_offset(proto);
    if proto == UDP && word(input, csum) == 0 {
        if word(out, csum) != 0 {
            return Err(format!("a {what} UDP datagram without checksum got one"));
        }
    } else if residual_at::<A>(out, ip, l4, proto) != residual_at::<A>(input, ip, l4, proto) {
        return Err(format!("{what} checksum broken"));
    }
    Ok(())
}

/// The IP header at `ip` (up to `l4`) is exactly as valid as it was, in the family that has a
/// header checksum.
fn header_checksum_kept<A: FrameAddress>(input: &[u8], out: &[u8], header: Range<usize>) -> bool {
    A::IP_CHECKSUM.is_none() || checksum(&out[header.clone()]) == checksum(&input[header])
}

/// The IP header checksum field of the header at `ip`, which every address rewrite changes.
fn header_checksum_field<A: FrameAddress>(ip: usize) -> Option<Range<usize>> {
    A::IP_CHECKSUM.map(|at| range(ip + at - IP, 2))
}

/// What a translation may change, the NAT key it must follow, and where it put the entry's
/// (address, port) pairs.
struct Rewrite<A: Fuzzed> {
    allowed: Vec<Range<usize>>,
    key: NatKey<A::Octets>,
    pairs: Vec<(usize, usize)>,
}

/// Checks one translated frame against its input and the NAT table. `Err` says what is wrong.
fn check_translation<A: Fuzzed>(
    bed: &TestBed,
    hook: Hook,
    input: &[u8],
    out: &[u8],
) -> Result<Translation, String> {
    if out.len() != input.len() {
        return Err("the length changed".into());
    }
    let p = A::packet_at(input, IP)
        .filter(|_| word(input, 12) == A::ETHERTYPE)
        .ok_or_else(|| format!("translated a frame whose {} headers do not parse", A::NAME))?;
    if !header_checksum_kept::<A>(input, out, IP..p.l4) {
        return Err("IP header checksum broken".into());
    }
    if A::is_later_fragment(input, IP) {
        check_later_fragment::<A>(hook, input, out)?;
        return Ok(Translation::LaterFragment);
    }
    let quotes = |&t: &u8| A::ERRORS.iter().any(|&(kind, ..)| kind == t);
    let is_error = p.proto == A::ICMP && input.get(p.l4).is_some_and(quotes);
    let rewrite = if is_error {
        check_icmp_error(hook, input, out, &p)?
    } else {
        check_flow(hook, input, out, &p)?
    };
    for i in (0..input.len()).filter(|&i| input[i] != out[i]) {
        if !rewrite.allowed.iter().any(|r| r.contains(&i)) {
            return Err(format!("byte {i} changed, which no translation touches"));
        }
    }
    let key = rewrite.key;
    let entry = A::Octets::entry(bed, &key).ok_or_else(|| format!("no NAT entry for {key:?}"))?;
    if entry.kind != nat_kind::SNAT {
        return Err(format!("translated by a {entry:?}"));
    }
    for (addr, field) in rewrite.pairs {
        if out[range(addr, A::ADDR_LEN)] != *entry.addr.as_ref() || raw(out, field) != entry.port {
            return Err(format!(
                "the translation is not the NAT table's: {entry:?} for {key:?}"
            ));
        }
    }
    Ok(if is_error {
        Translation::IcmpError
    } else {
        Translation::Flow
    })
}

/// A TCP, UDP or echo translation: the bytes it may change, its NAT key, and where the
/// rewritten (address, port) pair is.
fn check_flow<A: Fuzzed>(
    hook: Hook,
    input: &[u8],
    out: &[u8],
    p: &IpPacket<A>,
) -> Result<Rewrite<A>, String> {
    let (proto, l4) = (p.proto, p.l4);
    let min = match proto {
        TCP => 20,
        UDP => 8,
        icmp if icmp == A::ICMP => 8,
        _ => return Err(format!("translated protocol {proto}")),
    };
    if input.len() < l4 + min {
        return Err("translated a truncated L4 header".into());
    }
    if proto == A::ICMP {
        let wanted = match hook {
            Hook::Egress => A::ECHO_REQUEST,
            Hook::Ingress => A::ECHO_REPLY,
        };
        if input[l4] != wanted {
            return Err(format!("translated ICMP type {} on {hook:?}", input[l4]));
        }
    }
    l4_checksum_kept::<A>((input, out), (IP, l4, proto), "L4")?;
    // Egress rewrites the source port (or echo id), ingress the destination's.
    let (field, ports) = if proto == A::ICMP {
        let id = raw(input, l4 + 4);
        match hook {
            Hook::Egress => (l4 + 4, (id, 0)),
            Hook::Ingress => (l4 + 4, (0, id)),
        }
    } else {
        let field = if hook == Hook::Egress { l4 } else { l4 + 2 };
        (field, (raw(input, l4), raw(input, l4 + 2)))
    };
    let addr = hook.translated::<A>();
    let csum = l4 + l4_checksum_offset(proto);
    let allowed = [range(addr, A::ADDR_LEN), range(field, 2), range(csum, 2)];
    Ok(Rewrite {
        allowed: allowed
            .into_iter()
            .chain(header_checksum_field::<A>(IP))
            .collect(),
        key: key((p.src, p.dst), proto, ports, hook),
        pairs: vec![(addr, field)],
    })
}

/// A fragment after the first carries no ports: it may only take the address its first
/// fragment took, the node's on the way out, a pod's on the way in.
fn check_later_fragment<A: Fuzzed>(hook: Hook, input: &[u8], out: &[u8]) -> Result<(), String> {
    let addr = hook.translated::<A>();
    let may_change: Vec<Range<usize>> = [range(addr, A::ADDR_LEN)]
        .into_iter()
        .chain(header_checksum_field::<A>(IP))
        .collect();
    let changed: Vec<usize> = (0..input.len()).filter(|&i| input[i] != out[i]).collect();
    if changed
        .iter()
        .any(|i| !may_change.iter().any(|r| r.contains(i)))
    {
        return Err(format!(
            "a later fragment changed beyond its address: {changed:?}"
        ));
    }
    let new = A::at(out, addr);
    let allowed = match hook {
        Hook::Egress => new == A::NODE,
        Hook::Ingress => A::PODS.contains(&new),
    };
    if !allowed {
        return Err(format!("a later fragment took {new}"));
    }
    Ok(())
}

/// An ICMP error about a translated flow, crossing `hook`: the bytes it may change, the NAT key
/// of the flow it quotes, and where the translated (address, port) pairs are.
///
/// On ingress it quotes a packet that left the node (its source was the node's), on egress a
/// reply the node restored to a pod (its destination was the pod's); the quoted echo is the
/// request or the reply accordingly. The outer address at the node's end, the destination on
/// ingress and the source on egress, becomes the one translated in the quote.
fn check_icmp_error<A: Fuzzed>(
    hook: Hook,
    input: &[u8],
    out: &[u8],
    p: &IpPacket<A>,
) -> Result<Rewrite<A>, String> {
    let inner_ip = p.l4 + 8;
    let inner = A::packet_at(input, inner_ip)
        .ok_or("translated an ICMP error whose quoted headers do not parse")?;
    if inner.src != p.dst {
        return Err("translated an error not sent to where the quoted packet came from".into());
    }
    if A::is_later_fragment(input, inner_ip) {
        return Err("translated an error quoting a later fragment".into());
    }
    if input.len() < inner.l4 + 8 {
        return Err("translated an error quoting less than 8 bytes of L4 header".into());
    }
    let (quoted_addr, port, echo, outer) = match hook {
        Hook::Ingress => (inner_ip + A::SRC - IP, 0, A::ECHO_REQUEST, A::DST),
        Hook::Egress => (inner_ip + A::DST - IP, 2, A::ECHO_REPLY, A::SRC),
    };
    let proto = inner.proto;
    let field = match proto {
        TCP | UDP => inner.l4 + port,
        icmp if icmp == A::ICMP && input[inner.l4] == echo => inner.l4 + 4,
        _ => return Err(format!("translated an error quoting protocol {proto}")),
    };
    l4_checksum_kept::<A>((input, out), (IP, p.l4, A::ICMP), "ICMP")?;
    if !header_checksum_kept::<A>(input, out, inner_ip..inner.l4) {
        return Err("quoted IP header checksum broken".into());
    }
    // The quoted L4 checksum, when the quote holds it, stays exactly as valid as it was.
    let quoted_csum = inner.l4 + l4_checksum_offset(proto);
    if quoted_csum + 2 <= input.len() {
        l4_checksum_kept::<A>((input, out), (inner_ip, inner.l4, proto), "quoted L4")?;
    }
    // The quoted packet went against `hook`: an answer to it goes with it, as this key.
    let ports = match hook {
        _ if proto != A::ICMP => (raw(input, inner.l4 + 2), raw(input, inner.l4)),
        Hook::Ingress => (0, raw(input, field)),
        Hook::Egress => (raw(input, field), 0),
    };
    let allowed = [
        range(outer, A::ADDR_LEN),
        range(p.l4 + 2, 2),
        range(quoted_addr, A::ADDR_LEN),
        range(field, 2),
        range(quoted_csum, 2),
    ];
    let header_checksums = [IP, inner_ip].map(header_checksum_field::<A>);
    Ok(Rewrite {
        allowed: allowed
            .into_iter()
            .chain(header_checksums.into_iter().flatten())
            .collect(),
        key: key((inner.dst, inner.src), proto, ports, hook),
        pairs: vec![(outer, field), (quoted_addr, field)],
    })
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// What a campaign's packets came to.
#[derive(Default)]
struct Tally {
    translated: BTreeMap<(Hook, Translation), u64>,
    unchanged: u64,
    dropped: u64,
    refused: u64,
}

impl Tally {
    fn total_translated(&self) -> u64 {
        self.translated.values().sum()
    }

    /// A fuzzer that never reaches the translations, or passes everything, proves nothing.
    fn assert_reached_everywhere(&self, iterations: u64) {
        let translated = self.total_translated();
        assert!(
            self.refused < iterations / 4,
            "{} frames the runner refused",
            self.refused
        );
        assert!(translated > iterations / 20, "only {translated} translated");
        assert!(
            self.unchanged > iterations / 20,
            "only {} left alone",
            self.unchanged
        );
    }

    /// Each kind of translation came up both ways, in a run long enough to expect it.
    fn assert_kinds_reached(&self, iterations: u64) {
        if iterations < 10_000 {
            return;
        }
        for hook in [Hook::Egress, Hook::Ingress] {
            for kind in [
                Translation::Flow,
                Translation::IcmpError,
                Translation::LaterFragment,
            ] {
                assert!(
                    self.translated.contains_key(&(hook, kind)),
                    "no {kind:?} translated on {hook:?}"
                );
            }
        }
    }
}

/// Runs `iterations` packets, each a valid frame (one in eight) or a mutation of one, and
/// panics with the seed, the iteration and both frames at the first output the check refuses.
fn run_campaign<A: Fuzzed>(seed: u64, iterations: u64) -> Tally {
    let mut rng = Rng(seed ^ A::STREAM);
    let mut tally = Tally::default();
    let mut bed = A::bed();
    let mut frames = corpus::<A>(&mut bed, &mut rng);
    for i in 0..iterations {
        if i > 0 && i % BED_LIFETIME == 0 {
            bed = A::bed();
            frames = corpus::<A>(&mut bed, &mut rng);
        }
        let (hook, valid) = frames[rng.below(frames.len())].clone();
        let input = if rng.below(8) == 0 {
            valid
        } else {
            mutate::<A>(&valid, &mut rng)
        };
        let Some((verdict, out)) = try_run(&mut bed, hook, &input) else {
            tally.refused += 1;
            continue;
        };
        match verdict {
            TC_ACT_SHOT => tally.dropped += 1,
            TC_ACT_OK if out == input => tally.unchanged += 1,
            TC_ACT_OK => match check_translation::<A>(&bed, hook, &input, &out) {
                Ok(kind) => *tally.translated.entry((hook, kind)).or_default() += 1,
                Err(what) => panic!(
                    "{}, seed {seed}, iteration {i}, {hook:?}: {what}\n in: {input:02x?}\nout: {out:02x?}",
                    A::NAME
                ),
            },
            other => panic!("seed {seed}, iteration {i}: verdict {other}"),
        }
    }
    tally
}

fn fuzz<A: Fuzzed>() {
    let seed = env_or("MASQ_FUZZ_SEED", 1);
    let iterations = env_or("MASQ_FUZZ_ITERATIONS", A::ITERATIONS);
    let started = std::time::Instant::now();
    let tally = run_campaign::<A>(seed, iterations);
    eprintln!(
        "{}, seed {seed}: {iterations} packets in {:.1?}, {} translated {:?}, {} unchanged, {} \
         dropped, {} refused by the test runner",
        A::NAME,
        started.elapsed(),
        tally.total_translated(),
        tally.translated,
        tally.unchanged,
        tally.dropped,
        tally.refused
    );
    tally.assert_reached_everywhere(iterations);
    tally.assert_kinds_reached(iterations);
}

#[test]
fn no_mutated_packet_is_mistranslated() {
    fuzz::<Ipv4Addr>();
}

#[test]
fn no_mutated_ipv6_packet_is_mistranslated() {
    fuzz::<Ipv6Addr>();
}

//! Packet fuzzing of the real programs through BPF_PROG_TEST_RUN: seeded random mutations of
//! valid frames (truncations, bad IHL, IP options, bogus lengths and fragment fields, ICMP errors
//! quoting garbage; for IPv6, random extension-header chains, fragment headers, bogus payload
//! lengths and next-header values), sent out and in over a NAT table that holds live flows.
//! Every output must be a drop, the input unchanged, or a translation that changed only what a
//! translation changes, kept every checksum exactly as valid as it was, and put in the addresses
//! and ports the NAT table holds for that flow. The checks use this file's own parsing and
//! the test bed's checksum code (over the IPv6 pseudo-header for IPv6), nothing of the programs'.
//!
//! `cargo test` runs a short slice of each family (20 000 IPv4 and 200 000 IPv6 packets, a few
//! seconds in release). The seed fixes the frames; the NAT ports come from the kernel's random
//! numbers, so a failure prints the frames in and out. The full run:
//!
//! ```text
//! MASQ_FUZZ_SEED=1 MASQ_FUZZ_ITERATIONS=1000000 cargo test --release -p masq-integration --test packet_fuzz -- --nocapture
//! ```

use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::{Ipv4Net, Ipv6Net};
use masq_agent::dataplane::ebpf::testbed::{TC_ACT_OK, TC_ACT_SHOT, TestBed};
use masq_ebpf::{
    NatEntryV4, NatEntryV6, NatKey, NatKeyV4, NatKeyV6, direction, nat_kind, program_names,
};
use masq_testbed::packet::*;

const NODE: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
const PODS: [Ipv4Addr; 3] = [
    Ipv4Addr::new(10, 244, 1, 2),
    Ipv4Addr::new(10, 244, 2, 2),
    Ipv4Addr::new(10, 244, 3, 7),
];
const REMOTES: [Ipv4Addr; 3] = [
    Ipv4Addr::new(203, 0, 113, 10),
    Ipv4Addr::new(198, 51, 100, 10),
    // In the non-masquerade CIDRs.
    Ipv4Addr::new(10, 200, 0, 10),
];
const ROUTER: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 254);
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
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Hook {
    Egress,
    Ingress,
}

fn bed() -> TestBed {
    let spans = [(1024, 65535)];
    let non_masq: Vec<Ipv4Net> = ["10.0.0.0/8", "169.254.0.0/16"]
        .iter()
        .map(|n| n.parse().unwrap())
        .collect();
    TestBed::new(65_536, &spans, true, NODE, &non_masq).expect("test bed")
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

/// Valid frames of every kind the programs handle, in both directions. The ingress ones answer
/// flows the egress program has just translated, so that they meet live NAT entries.
fn corpus(bed: &mut TestBed, rng: &mut Rng) -> Vec<(Hook, Vec<u8>)> {
    let mut frames = Vec::new();
    for _ in 0..8 {
        let (pod, remote) = (rng.pick(&PODS), rng.pick(&REMOTES));
        let (sport, dport) = (1024 + rng.below(60_000) as u16, rng.pick(&[53u16, 80, 443]));
        let out = [
            tcp(pod, sport, remote, dport, SYN),
            tcp(pod, sport, remote, dport, ACK),
            udp(pod, sport, remote, dport),
            ping(pod, remote, 8, sport),
            frame(pod, remote, GRE, &[0u8; 8]),
            tcp(NODE, sport, remote, dport, SYN),
        ];
        for packet in out {
            frames.push((Hook::Egress, packet.clone()));
            let (verdict, left) = run(bed, Hook::Egress, &packet);
            if verdict != TC_ACT_OK || left == packet {
                continue;
            }
            // The translated packet as it left: replies to it, and errors about it.
            let (node_port, their_port) = (word(&left, L4), word(&left, L4 + 2));
            let reply = match left[23] {
                TCP => tcp(remote, their_port, NODE, node_port, SYN | ACK),
                UDP => udp(remote, their_port, NODE, node_port),
                _ => ping(remote, NODE, 0, word(&left, L4 + 4)),
            };
            frames.push((Hook::Ingress, reply.clone()));
            // The reply as the pod got it, and errors about it leaving: the pod's own, or the
            // node's.
            let (_, restored) = run(bed, Hook::Ingress, &reply);
            if restored != reply {
                for from in [pod, NODE, rng.pick(&PODS)] {
                    let (kind, code, rest) = rng.pick(&ERRORS);
                    let quote_len = rng.pick(&[28usize, restored.len() - 14]);
                    let quote = &restored[IP..IP + quote_len];
                    let error = icmp_frame(from, remote, kind, code, rest, quote);
                    frames.push((Hook::Egress, error));
                }
            }
            for (kind, code) in [(3, 4), (11, 0)] {
                let quote_len = rng.pick(&[28usize, left.len() - 14]);
                let body = &left[14..14 + quote_len.min(left.len() - 14)];
                let rest = if kind == 3 {
                    [0, 0, 0x05, 0x78]
                } else {
                    [0; 4]
                };
                let error = icmp_frame(ROUTER, NODE, kind, code, rest, body);
                frames.push((Hook::Ingress, error));
            }
        }
    }
    frames
}

/// ICMP errors (type, code, rest of header): fragmentation needed, port unreachable, time
/// exceeded, parameter problem.
const ERRORS: [(u8, u8, [u8; 4]); 4] = [
    (3, 4, [0, 0, 0x05, 0x78]),
    (3, 3, [0; 4]),
    (11, 0, [0; 4]),
    (12, 0, [20, 0, 0, 0]),
];

/// One to three random damages of the kinds real networks and attackers produce.
fn mutate(frame: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut f = frame.to_vec();
    for _ in 0..1 + rng.below(3) {
        match rng.below(9) {
            0 => {
                let i = rng.below(f.len());
                f[i] = rng.byte();
            }
            // The kernel's test runner wants at least an Ethernet header.
            1 => f.truncate(14 + rng.below(f.len() - 13)),
            2 if f.len() > 14 => f[14] = (f[14] & 0xf0) | (rng.byte() & 0x0f),
            3 if f.len() > 17 => f[16..18].copy_from_slice(&(rng.next() as u16).to_be_bytes()),
            4 if f.len() > 21 => f[20..22].copy_from_slice(&(rng.next() as u16).to_be_bytes()),
            5 if f.len() > 23 => {
                let any = rng.byte();
                f[23] = rng.pick(&[ICMP, TCP, UDP, GRE, any]);
            }
            6 if f.len() > 34 => {
                // IP options: the header grows, and what follows moves back.
                let words = 1 + rng.below(10);
                let options: Vec<u8> = (0..words * 4).map(|_| rng.byte()).collect();
                f.splice(34..34, options);
                f[14] = 0x40 | (5 + words as u8);
            }
            7 => f.extend((0..rng.below(64)).map(|_| rng.byte())),
            8 if f.len() > 42 => {
                // Garbage where an ICMP error quotes a packet.
                for i in 42..f.len().min(42 + 28) {
                    if rng.below(4) == 0 {
                        f[i] = rng.byte();
                    }
                }
            }
            _ => {}
        }
    }
    f
}

fn ipv4_at(f: &[u8], off: usize) -> Ipv4Addr {
    Ipv4Addr::new(f[off], f[off + 1], f[off + 2], f[off + 3])
}

/// A 16-bit field as the NAT table stores it: the packet's bytes, in the host's order.
fn raw(f: &[u8], off: usize) -> u16 {
    u16::from_ne_bytes([f[off], f[off + 1]])
}

/// An address, and the bytes the NAT table holds it as.
trait TableAddress: Copy {
    type Octets;
    fn table_octets(self) -> Self::Octets;
}

impl TableAddress for Ipv4Addr {
    type Octets = [u8; 4];
    fn table_octets(self) -> [u8; 4] {
        self.octets()
    }
}

impl TableAddress for Ipv6Addr {
    type Octets = [u8; 16];
    fn table_octets(self) -> [u8; 16] {
        self.octets()
    }
}

fn key<A: TableAddress>(
    saddr: A,
    daddr: A,
    proto: u8,
    sport: u16,
    dport: u16,
    dir: u8,
) -> NatKey<A::Octets> {
    NatKey {
        saddr: saddr.table_octets(),
        daddr: daddr.table_octets(),
        sport,
        dport,
        proto,
        direction: dir,
        _pad: [0; 2],
    }
}

/// The checksum of `data` as it stands: 0 when valid. A correct incremental update keeps it
/// unchanged, valid or not.
fn residual(data: &[u8]) -> u16 {
    checksum(data)
}

/// The TCP or UDP checksum residual of the segment at `l4` of length `len`, under the
/// pseudo-header of the IP header at `ip`.
fn l4_residual(f: &[u8], ip: usize, l4: usize, len: usize) -> u16 {
    let pseudo = pseudo_header(ipv4_at(f, ip + 12), ipv4_at(f, ip + 16), f[ip + 9], len);
    residual(&[pseudo, f[l4..l4 + len].to_vec()].concat())
}

/// Where the L4 header starts behind the IPv4 header at `ip`, options stepped over; `None` if
/// there is no IPv4 header there.
fn ipv4_l4_offset(f: &[u8], ip: usize) -> Option<usize> {
    let version_ihl = *f.get(ip)?;
    let l4 = ip + usize::from(version_ihl & 0x0f) * 4;
    (version_ihl >> 4 == 4 && version_ihl & 0x0f >= 5 && f.len() >= l4).then_some(l4)
}

/// Where a checksum or translated field lives, for the list of bytes a translation may change.
fn span(at: usize, len: usize) -> std::ops::Range<usize> {
    at..at + len
}

fn l4_csum_offset(proto: u8) -> usize {
    match proto {
        TCP => 16,
        UDP => 6,
        _ => 2,
    }
}

/// What a translation was, for the figures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Translation {
    Flow,
    IcmpError,
    LaterFragment,
}

/// The NAT table's direction for a hook.
fn dir_of(hook: Hook) -> u8 {
    match hook {
        Hook::Egress => direction::EGRESS,
        Hook::Ingress => direction::INGRESS,
    }
}

/// Where an ICMP error's quoted packet was translated, given the hook the error crosses: on
/// ingress it quotes a packet that left the node (its source was the node's), on egress a
/// reply the node restored to a pod (its destination was the pod's). The quoted echo is the
/// request or the reply accordingly.
struct QuotedSide {
    /// Offset of the translated address within the quoted IP header.
    addr: usize,
    /// Offset of the translated port within the quoted L4 header.
    port: usize,
    /// The outer header's address at the node's end: destination on ingress, source on egress.
    outer: usize,
    echo: u8,
}

fn quoted_side(hook: Hook, addr_len: usize, icmp_echo: (u8, u8)) -> QuotedSide {
    let (saddr, daddr, outer_src, outer_dst) = if addr_len == 4 {
        (12, 16, 26, 30)
    } else {
        (8, 24, SRC6, DST6)
    };
    match hook {
        Hook::Ingress => QuotedSide {
            addr: saddr,
            port: 0,
            outer: outer_dst,
            echo: icmp_echo.0,
        },
        Hook::Egress => QuotedSide {
            addr: daddr,
            port: 2,
            outer: outer_src,
            echo: icmp_echo.1,
        },
    }
}

/// Checks one translated frame against its input and the NAT table. `Err` says what is wrong.
fn check_translation(
    bed: &TestBed,
    hook: Hook,
    input: &[u8],
    out: &[u8],
) -> Result<Translation, String> {
    if out.len() != input.len() {
        return Err("the length changed".into());
    }
    let Some(l4) = ipv4_l4_offset(input, 14) else {
        return Err("translated a frame that is not IPv4".into());
    };
    if residual(&out[14..l4]) != residual(&input[14..l4]) {
        return Err("IP header checksum broken".into());
    }
    if word(input, 20) & 0x1fff != 0 {
        check_later_fragment(hook, input, out)?;
        return Ok(Translation::LaterFragment);
    }
    let proto = input[23];
    let is_error = proto == ICMP && input.len() > l4 && matches!(input[l4], 3 | 11 | 12);
    let (allowed, entry_key, rewritten) = if is_error {
        check_icmp_error(hook, input, out, l4)?
    } else {
        let seg_len = input.len() - l4;
        let csum = l4 + l4_csum_offset(proto);
        let min = if proto == TCP { 20 } else { 8 };
        if seg_len < min {
            return Err("translated a truncated L4 header".into());
        }
        // UDP without a checksum keeps none; every other checksum stays exactly as valid.
        if proto == UDP && word(input, csum) == 0 {
            if word(out, csum) != 0 {
                return Err("a UDP datagram without checksum got one".into());
            }
        } else if proto == ICMP {
            if residual(&out[l4..]) != residual(&input[l4..]) {
                return Err("ICMP checksum broken".into());
            }
        } else if l4_residual(out, 14, l4, seg_len) != l4_residual(input, 14, l4, seg_len) {
            return Err("L4 checksum broken".into());
        }
        let (saddr, daddr) = (ipv4_at(input, 26), ipv4_at(input, 30));
        let dir = dir_of(hook);
        // Egress rewrites the source port (or echo id), ingress the destination's.
        let (field, k) = if proto == ICMP {
            let id = raw(input, l4 + 4);
            let (sport, dport) = if hook == Hook::Egress {
                (id, 0)
            } else {
                (0, id)
            };
            (l4 + 4, key(saddr, daddr, ICMP, sport, dport, dir))
        } else {
            let field = if hook == Hook::Egress { l4 } else { l4 + 2 };
            let (sport, dport) = (raw(input, l4), raw(input, l4 + 2));
            (field, key(saddr, daddr, proto, sport, dport, dir))
        };
        let addr = if hook == Hook::Egress { 26 } else { 30 };
        let allowed = vec![span(24, 2), span(addr, 4), span(field, 2), span(csum, 2)];
        (allowed, k, vec![(addr, field)])
    };
    let changed = (0..input.len()).filter(|&i| input[i] != out[i]);
    for i in changed {
        if !allowed.iter().any(|r| r.contains(&i)) {
            return Err(format!("byte {i} changed, which no translation touches"));
        }
    }
    let entry: NatEntryV4 = bed
        .nat_entry(&entry_key)
        .ok_or_else(|| format!("no NAT entry for {entry_key:?}"))?;
    for (addr, field) in rewritten {
        if out[addr..addr + 4] != entry.addr || raw(out, field) != entry.port {
            return Err(format!(
                "the translation is not the NAT table's: {entry:?} for {entry_key:?}"
            ));
        }
    }
    Ok(if is_error {
        Translation::IcmpError
    } else {
        Translation::Flow
    })
}

/// A fragment after the first carries no ports: it may only take the address its first
/// fragment took, the node's on the way out, a pod's on the way in.
fn check_later_fragment(hook: Hook, input: &[u8], out: &[u8]) -> Result<(), String> {
    let (addr, allowed): (usize, &[Ipv4Addr]) = match hook {
        Hook::Egress => (26, &[NODE]),
        Hook::Ingress => (30, &PODS),
    };
    // The header checksum covers the address.
    let may_change = |i: usize| (24..26).contains(&i) || (addr..addr + 4).contains(&i);
    let new = ipv4_at(out, addr);
    check_fragment_rewrite(input, out, may_change, &new, allowed.contains(&new))
}

/// A later fragment's rewrite: only the bytes `may_change` allows changed, and it took an
/// address (`new`) a translation may give it.
fn check_fragment_rewrite(
    input: &[u8],
    out: &[u8],
    may_change: impl Fn(usize) -> bool,
    new: &dyn std::fmt::Display,
    allowed: bool,
) -> Result<(), String> {
    let changed: Vec<usize> = (0..input.len()).filter(|&i| input[i] != out[i]).collect();
    if changed.iter().any(|&i| !may_change(i)) {
        return Err(format!(
            "a later fragment changed beyond its address: {changed:?}"
        ));
    }
    if !allowed {
        return Err(format!("a later fragment took {new}"));
    }
    Ok(())
}

/// An ICMP error about a translated flow, crossing `hook`: the bytes it may change, the NAT key
/// of the flow it quotes, and where the translated (address, port) pairs are.
#[allow(clippy::type_complexity)]
fn check_icmp_error(
    hook: Hook,
    input: &[u8],
    out: &[u8],
    l4: usize,
) -> Result<(Vec<std::ops::Range<usize>>, NatKeyV4, Vec<(usize, usize)>), String> {
    let inner = l4 + 8;
    let Some(inner_l4) = ipv4_l4_offset(input, inner).filter(|at| input.len() >= at + 8) else {
        return Err(
            "translated an ICMP error that quotes less than an IPv4 header and 8 bytes".into(),
        );
    };
    if residual(&out[l4..]) != residual(&input[l4..]) {
        return Err("ICMP checksum broken".into());
    }
    if residual(&out[inner..inner_l4]) != residual(&input[inner..inner_l4]) {
        return Err("quoted IP header checksum broken".into());
    }
    let (qsrc, qdst) = (ipv4_at(input, inner + 12), ipv4_at(input, inner + 16));
    if qsrc != ipv4_at(input, 30) {
        return Err("translated an error not sent to where the quoted packet came from".into());
    }
    let side = quoted_side(hook, 4, (8, 0));
    let proto = input[inner + 9];
    let field = match proto {
        TCP | UDP => inner_l4 + side.port,
        ICMP if input[inner_l4] == side.echo => inner_l4 + 4,
        _ => return Err("translated an error quoting an untranslatable packet".into()),
    };
    let quoted_csum = inner_l4 + l4_csum_offset(proto);
    if quoted_csum + 2 <= input.len()
        && input[quoted_csum..quoted_csum + 2] != out[quoted_csum..quoted_csum + 2]
    {
        let len = input.len() - inner_l4;
        let broken = if proto == ICMP {
            residual(&out[inner_l4..]) != residual(&input[inner_l4..])
        } else {
            l4_residual(out, inner, inner_l4, len) != l4_residual(input, inner, inner_l4, len)
        };
        if broken {
            return Err("quoted L4 checksum broken".into());
        }
    }
    // The quoted packet went against `hook`: an answer to it goes with it, as this key.
    let (sport, dport) = match (proto, hook) {
        (ICMP, Hook::Ingress) => (0, raw(input, field)),
        (ICMP, Hook::Egress) => (raw(input, field), 0),
        _ => (raw(input, inner_l4 + 2), raw(input, inner_l4)),
    };
    let k = key(qdst, qsrc, proto, sport, dport, dir_of(hook));
    let allowed = vec![
        span(24, 2),
        span(side.outer, 4),
        span(l4 + 2, 2),
        span(inner + 10, 2),
        span(inner + side.addr, 4),
        span(field, 2),
        span(quoted_csum, 2),
    ];
    // The outer address at the node's end becomes the one translated in the quote.
    if out[side.outer..side.outer + 4] != out[inner + side.addr..inner + side.addr + 4] {
        return Err("outer and quoted addresses disagree".into());
    }
    Ok((allowed, k, vec![(inner + side.addr, field)]))
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One family's fuzz campaign: a fresh bed with live flows and the valid frames over them, the
/// mutator, and the oracle, which names the kind of translation it accepted.
struct Campaign<K> {
    bed: fn() -> TestBed,
    corpus: fn(&mut TestBed, &mut Rng) -> Frames,
    mutate: fn(&[u8], &mut Rng) -> Vec<u8>,
    check: Oracle<K>,
}

/// Valid frames, and the hook each goes through.
type Frames = Vec<(Hook, Vec<u8>)>;
/// Judges a translated output: the kind of translation it is, or what is wrong with it.
type Oracle<K> = fn(&TestBed, Hook, &[u8], &[u8]) -> Result<K, String>;

/// What a campaign's packets came to.
struct Tally<K> {
    translated: std::collections::BTreeMap<(Hook, K), u64>,
    unchanged: u64,
    dropped: u64,
    refused: u64,
}

impl Tally<Translation> {
    /// Each of `kinds` of translation came up both ways, in a run long enough to expect it.
    fn assert_kinds_reached(&self, iterations: u64, kinds: &[Translation]) {
        if iterations < 10_000 {
            return;
        }
        for hook in [Hook::Egress, Hook::Ingress] {
            for kind in kinds {
                assert!(
                    self.translated.contains_key(&(hook, *kind)),
                    "no {kind:?} translated on {hook:?}"
                );
            }
        }
    }
}

impl<K> Tally<K> {
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
}

/// Runs `iterations` packets, each a valid frame (one in eight) or a mutation of one, and
/// panics with the seed, the iteration and both frames at the first output the oracle refuses.
fn run_campaign<K: Ord + Copy>(
    campaign: &Campaign<K>,
    seed: u64,
    rng: &mut Rng,
    iterations: u64,
) -> Tally<K> {
    let mut tally = Tally {
        translated: std::collections::BTreeMap::new(),
        unchanged: 0,
        dropped: 0,
        refused: 0,
    };
    let mut bed = (campaign.bed)();
    let mut frames = (campaign.corpus)(&mut bed, rng);
    for i in 0..iterations {
        if i > 0 && i % BED_LIFETIME == 0 {
            bed = (campaign.bed)();
            frames = (campaign.corpus)(&mut bed, rng);
        }
        let (hook, valid) = frames[rng.below(frames.len())].clone();
        let input = if rng.below(8) == 0 {
            valid
        } else {
            (campaign.mutate)(&valid, rng)
        };
        let Some((verdict, out)) = try_run(&mut bed, hook, &input) else {
            tally.refused += 1;
            continue;
        };
        match verdict {
            TC_ACT_SHOT => tally.dropped += 1,
            TC_ACT_OK if out == input => tally.unchanged += 1,
            TC_ACT_OK => match (campaign.check)(&bed, hook, &input, &out) {
                Ok(kind) => *tally.translated.entry((hook, kind)).or_default() += 1,
                Err(what) => panic!(
                    "seed {seed}, iteration {i}, {hook:?}: {what}\n in: {input:02x?}\nout: {out:02x?}"
                ),
            },
            other => panic!("seed {seed}, iteration {i}: verdict {other}"),
        }
    }
    tally
}

#[test]
fn no_mutated_packet_is_mistranslated() {
    let seed = env_or("MASQ_FUZZ_SEED", 1);
    let iterations = env_or("MASQ_FUZZ_ITERATIONS", 20_000);
    let campaign = Campaign {
        bed,
        corpus,
        mutate,
        check: check_translation,
    };
    let tally = run_campaign(&campaign, seed, &mut Rng(seed), iterations);
    eprintln!(
        "seed {seed}: {iterations} packets, {} translated {:?}, {} unchanged, {} dropped, {} \
         refused by the test runner",
        tally.total_translated(),
        tally.translated,
        tally.unchanged,
        tally.dropped,
        tally.refused
    );
    tally.assert_reached_everywhere(iterations);
    // Later fragments come up only where mutations make a first fragment, then a later one.
    tally.assert_kinds_reached(iterations, &[Translation::Flow, Translation::IcmpError]);
}

// ---- IPv6 -----------------------------------------------------------------------------------

const NODE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 1);
const PODS6: [Ipv6Addr; 3] = [
    Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 2),
    Ipv6Addr::new(0xfd00, 0x10, 0x244, 2, 0, 0, 0, 2),
    Ipv6Addr::new(0xfd00, 0x10, 0x244, 3, 0, 0, 0, 7),
];
const REMOTES6: [Ipv6Addr; 3] = [
    Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x10),
    Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 0x10),
    // In the non-masquerade prefixes.
    Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0x10),
];
const ROUTER6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0xfe);
const LINK_LOCAL6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
const ALL_NODES6: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
/// The next-header values a chain is made of, valid or not.
const NEXT_HEADERS: [u8; 9] = [
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

/// The IPv4 bed with IPv6 masqueraded too, fd00::/8 and fe80::/10 left alone.
fn bed6() -> TestBed {
    let mut bed = bed();
    let non_masq: Vec<Ipv6Net> = ["fd00::/8", "fe80::/10"]
        .iter()
        .map(|n| n.parse().unwrap())
        .collect();
    bed.enable_ipv6(NODE6, &non_masq).expect("IPv6 enabled");
    bed
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
                let kind = rng.pick(&NEXT_HEADERS);
                let any = rng.byte();
                let len = 8 * rng.below(4) + rng.pick(&[0, 0, 0, 2, 5]);
                let mut bytes: Vec<u8> = (0..len).map(|_| rng.byte()).collect();
                if let Some(b) = bytes.get_mut(1) {
                    *b = rng.pick(&[0, 1, 2, any]);
                }
                ExtHeader::raw(rng.pick(&[kind, any]), bytes)
            }
            _ => random_ext(rng, true),
        })
        .collect()
}

/// A UDP datagram of `len` bytes, with its checksum over the whole of it.
fn udp6_datagram(
    rng: &mut Rng,
    src: Ipv6Addr,
    sport: u16,
    dst: Ipv6Addr,
    dport: u16,
    len: usize,
) -> Vec<u8> {
    let mut d = Vec::new();
    d.extend(sport.to_be_bytes());
    d.extend(dport.to_be_bytes());
    d.extend((len as u16).to_be_bytes());
    d.extend([0, 0]);
    d.extend((8..len).map(|_| rng.byte()));
    fill_checksum(src, dst, UDP, &mut d);
    d
}

/// An ICMPv6 error from `from` to `to` about `left` (a frame), quoting all of it or a part.
fn error6(rng: &mut Rng, (from, to): (Ipv6Addr, Ipv6Addr), left: &[u8]) -> Vec<u8> {
    let (kind, code, rest) = rng.pick(&[
        (ICMPV6_PACKET_TOO_BIG, 0, [0, 0, 5, 0]),
        (ICMPV6_DEST_UNREACH, 4, [0; 4]),
        (ICMPV6_DEST_UNREACH, 3, [0; 4]),
        (ICMPV6_TIME_EXCEEDED, 0, [0; 4]),
        (ICMPV6_PARAMETER_PROBLEM, 0, [0, 0, 0, 6]),
    ]);
    let whole = left.len() - IP;
    let part = 40 + rng.below(whole - 39);
    let quote_len = rng.pick(&[whole, whole, 48.min(whole), part]);
    icmp_frame(from, to, kind, code, rest, &left[IP..IP + quote_len])
}

/// Neighbour discovery and MLD, which the programs must leave alone.
fn nd_and_mld6(rng: &mut Rng) -> Vec<u8> {
    let target = rng.pick(&REMOTES6).octets().to_vec();
    match rng.below(4) {
        0 => with_hop_limit6(
            &icmp_frame(
                LINK_LOCAL6,
                ALL_NODES6,
                ND_NEIGHBOR_SOLICIT,
                0,
                [0; 4],
                &target,
            ),
            255,
        ),
        1 => with_hop_limit6(
            &icmp_frame(
                NODE6,
                ALL_NODES6,
                ND_NEIGHBOR_ADVERT,
                0,
                [0x20, 0, 0, 0],
                &target,
            ),
            255,
        ),
        2 => with_hop_limit6(
            &icmp_frame(
                LINK_LOCAL6,
                ALL_NODES6,
                ND_ROUTER_ADVERT,
                0,
                [64, 0, 7, 8],
                &[0; 8],
            ),
            255,
        ),
        _ => {
            let report = icmp_frame(LINK_LOCAL6, ALL_NODES6, MLD_REPORT, 0, [0; 4], &target);
            with_hop_limit6(&insert_ext6(&report, &[ExtHeader::router_alert()]), 1)
        }
    }
}

/// Valid IPv6 frames of every kind, in both directions, over the flows the egress program
/// has just translated: replies, fragmented replies and errors quoting what left.
fn corpus6(bed: &mut TestBed, rng: &mut Rng) -> Vec<(Hook, Vec<u8>)> {
    let mut frames = Vec::new();
    for _ in 0..8 {
        let (pod, remote) = (rng.pick(&PODS6), rng.pick(&REMOTES6));
        let (sport, dport) = (1024 + rng.below(60_000) as u16, rng.pick(&[53u16, 80, 443]));
        let chain: Vec<ExtHeader> = (0..rng.below(3)).map(|_| random_ext(rng, false)).collect();
        let id = rng.next() as u32;
        let len = 8 + 8 * rng.below(40);
        let datagram = udp6_datagram(rng, pod, sport ^ 1, remote, dport, len);
        let mut out = vec![
            tcp(pod, sport, remote, dport, SYN),
            tcp(pod, sport, remote, dport, ACK),
            insert_ext6(&tcp(pod, sport ^ 2, remote, dport, SYN), &chain),
            udp(pod, sport, remote, dport),
            insert_ext6(&udp(pod, sport ^ 3, remote, dport), &chain),
            ping(pod, remote, ICMPV6_ECHO_REQUEST, sport),
            insert_ext6(&ping(pod, remote, ICMPV6_ECHO_REQUEST, sport ^ 4), &chain),
            frame(pod, remote, 47, &[0u8; 8]),
            tcp(NODE6, sport, remote, dport, SYN),
            nd_and_mld6(rng),
        ];
        // A fragmented datagram, first fragment first.
        out.extend(fragments(pod, remote, UDP, &datagram, id, 48));
        for packet in out {
            frames.push((Hook::Egress, packet.clone()));
            let (verdict, left) = run(bed, Hook::Egress, &packet);
            if verdict != TC_ACT_OK || left == packet {
                continue;
            }
            let Some(h) = headers6(&left) else { continue };
            if h.is_later_fragment() {
                continue;
            }
            let (node_port, their_port) = (word(&left, h.l4), word(&left, h.l4 + 2));
            for _ in 0..2 {
                frames.push((Hook::Ingress, error6(rng, (ROUTER6, NODE6), &left)));
            }
            let back_chain: Vec<ExtHeader> =
                (0..rng.below(3)).map(|_| random_ext(rng, false)).collect();
            let reply = match h.proto {
                TCP => insert_ext6(
                    &tcp(remote, their_port, NODE6, node_port, SYN | ACK),
                    &back_chain,
                ),
                UDP if h.fragment.is_some() => {
                    let reply =
                        udp6_datagram(rng, remote, their_port, NODE6, node_port, datagram.len());
                    for f in fragments(remote, NODE6, UDP, &reply, rng.next() as u32, 48) {
                        frames.push((Hook::Ingress, f));
                    }
                    continue;
                }
                UDP => insert_ext6(&udp(remote, their_port, NODE6, node_port), &back_chain),
                _ => ping(remote, NODE6, ICMPV6_ECHO_REPLY, word(&left, h.l4 + 4)),
            };
            frames.push((Hook::Ingress, reply.clone()));
            // The reply as the pod got it, and errors about it leaving: the pod's own, or the
            // node's.
            let (_, restored) = run(bed, Hook::Ingress, &reply);
            if restored != reply {
                for from in [pod, NODE6] {
                    frames.push((Hook::Egress, error6(rng, (from, remote), &restored)));
                }
            }
        }
        // A connection opened from outside toward a pod, and the pod's answer.
        let inbound = tcp(remote, dport, pod, sport ^ 5, SYN);
        run(bed, Hook::Ingress, &inbound);
        frames.push((Hook::Ingress, inbound));
        frames.push((Hook::Egress, tcp(pod, sport ^ 5, remote, dport, SYN | ACK)));
        frames.push((Hook::Ingress, nd_and_mld6(rng)));
    }
    frames
}

/// One to three random damages, IPv6 flavoured.
fn mutate6(frame: &[u8], rng: &mut Rng) -> Vec<u8> {
    let mut f = frame.to_vec();
    for _ in 0..1 + rng.below(3) {
        let parsed = headers6(&f);
        match rng.below(13) {
            0 => {
                let i = rng.below(f.len());
                f[i] = rng.byte();
            }
            1 => f.truncate(14 + rng.below(f.len() - 13)),
            // A bogus payload length.
            2 if f.len() >= IP + 6 => {
                let len = match rng.below(3) {
                    0 => 0,
                    1 => f.len().saturating_sub(L4_6) as u16 ^ (1 << rng.below(12)),
                    _ => rng.next() as u16,
                };
                f[IP + 4..IP + 6].copy_from_slice(&len.to_be_bytes());
            }
            // A bogus or changed first next header.
            3 if f.len() > IP + 6 => {
                let any = rng.byte();
                let known = rng.pick(&NEXT_HEADERS);
                f[IP + 6] = rng.pick(&[known, any]);
            }
            // A random chain behind the fixed header: up to eight headers, some malformed.
            4 if f.len() >= L4_6 => {
                let chain = random_chain(rng, 8);
                f = insert_ext6(&f, &chain);
            }
            5 if f.len() > IP => f[IP] = (rng.byte() & 0xf0) | (f[IP] & 0x0f),
            // Fragment fields: a fragment header's offset, M flag and id, or a new one.
            6 => match parsed.as_ref().and_then(|h| h.fragment) {
                Some(frag) => {
                    let ExtHeader { bytes, .. } = random_fragment(rng);
                    let keep_id = rng.below(2) == 0;
                    let end = if keep_id { 4 } else { 8 };
                    f[frag.at + 2..frag.at + end].copy_from_slice(&bytes[2..end]);
                }
                None if f.len() >= L4_6 => f = insert_ext6(&f, &[random_fragment(rng)]),
                None => {}
            },
            7 => f.extend((0..rng.below(64)).map(|_| rng.byte())),
            // Garbage where an ICMPv6 error quotes a packet.
            8 => {
                if let Some(h) = &parsed {
                    for i in h.l4 + 8..f.len().min(h.l4 + 8 + 56) {
                        if rng.below(4) == 0 {
                            f[i] = rng.byte();
                        }
                    }
                }
            }
            // Another ICMPv6 type.
            9 => {
                if let Some(h) = parsed
                    .as_ref()
                    .filter(|h| h.proto == ICMPV6 && h.l4 < f.len())
                {
                    let any = rng.byte();
                    f[h.l4] = rng.pick(&[1, 2, 3, 4, 128, 129, 133, 135, 136, any]);
                }
            }
            // An extension header's next-header or length field, bogus.
            10 => {
                if let Some(h) = parsed.as_ref().filter(|h| !h.exts.is_empty()) {
                    let (_, at, _) = h.exts[rng.below(h.exts.len())];
                    let any = rng.byte();
                    if rng.below(2) == 0 {
                        let known = rng.pick(&NEXT_HEADERS);
                        f[at] = rng.pick(&[known, any]);
                    } else {
                        f[at + 1] = rng.pick(&[0, 1, 255, any]);
                    }
                }
            }
            // A quote cut short, or a chain cut in the middle.
            11 => {
                if let Some(h) = &parsed {
                    let cut = rng.pick(&[h.l4 + 8, h.ip + IPV6_HLEN]) + rng.below(64);
                    f.truncate(cut.clamp(14, f.len()));
                }
            }
            // A quote whose chain grows: extension headers inside the quoted packet.
            12 => {
                if let Some(h) = parsed.as_ref().filter(|h| h.proto == ICMPV6) {
                    let inner = h.l4 + 8;
                    if f.len() >= inner + IPV6_HLEN {
                        let chain = random_chain(rng, 4);
                        let quoted = insert_ext6(&[&f[..inner - IP], &f[inner..]].concat(), &chain);
                        f = [&f[..inner], &quoted[inner - IP..]].concat();
                    }
                }
            }
            _ => {}
        }
    }
    f
}

/// Checks one translated IPv6 frame against its input and the NAT table, with this file's
/// own walk of the header chains. `Err` says what is wrong.
fn check_translation6(
    bed: &TestBed,
    hook: Hook,
    input: &[u8],
    out: &[u8],
) -> Result<Translation, String> {
    if out.len() != input.len() {
        return Err("the length changed".into());
    }
    let h = headers6(input).ok_or("translated a frame whose IPv6 header chain does not parse")?;
    if h.is_later_fragment() {
        check_later_fragment6(hook, input, out)?;
        return Ok(Translation::LaterFragment);
    }
    let is_error = h.proto == ICMPV6
        && input.len() > h.l4
        && (ICMPV6_DEST_UNREACH..=ICMPV6_PARAMETER_PROBLEM).contains(&input[h.l4]);
    let (allowed, entry_key, rewritten) = if is_error {
        check_icmp_error6(hook, input, out, &h)?
    } else {
        check_flow6(hook, input, out, &h)?
    };
    for i in (0..input.len()).filter(|&i| input[i] != out[i]) {
        if !allowed.iter().any(|r| r.contains(&i)) {
            return Err(format!("byte {i} changed, which no translation touches"));
        }
    }
    let entry: NatEntryV6 = bed
        .nat_entry(&entry_key)
        .ok_or_else(|| format!("no NAT entry for {entry_key:?}"))?;
    if entry.kind != nat_kind::SNAT {
        return Err(format!("translated by a {entry:?}"));
    }
    for (addr, field) in rewritten {
        if out[addr..addr + 16] != entry.addr || raw(out, field) != entry.port {
            return Err(format!(
                "the translation is not the NAT table's: {entry:?} for {entry_key:?}"
            ));
        }
    }
    Ok(if is_error {
        Translation::IcmpError
    } else {
        Translation::Flow
    })
}

/// The checksum residual of the upper layer at `l4` (to the end of the frame) under the
/// pseudo-header of the IPv6 header at `ip`: a correct translation leaves it as it was.
fn residual6_at(f: &[u8], ip: usize, l4: usize, proto: u8) -> u16 {
    masq_testbed::packet::residual(addr6_at(f, ip + 8), addr6_at(f, ip + 24), proto, &f[l4..])
}

/// The bytes a TCP, UDP or echo translation may change, its NAT key, and where the rewritten
/// (address, port) pair is.
#[allow(clippy::type_complexity)]
fn check_flow6(
    hook: Hook,
    input: &[u8],
    out: &[u8],
    h: &Headers6,
) -> Result<(Vec<std::ops::Range<usize>>, NatKeyV6, Vec<(usize, usize)>), String> {
    let (proto, l4) = (h.proto, h.l4);
    let min = match proto {
        TCP => 20,
        UDP | ICMPV6 => 8,
        _ => return Err(format!("translated protocol {proto}")),
    };
    if input.len() < l4 + min {
        return Err("translated a truncated L4 header".into());
    }
    if proto == ICMPV6 {
        let wanted = match hook {
            Hook::Egress => ICMPV6_ECHO_REQUEST,
            Hook::Ingress => ICMPV6_ECHO_REPLY,
        };
        if input[l4] != wanted {
            return Err(format!("translated ICMPv6 type {} on {hook:?}", input[l4]));
        }
    }
    let csum = l4 + l4_checksum_offset(proto);
    if proto == UDP && word(input, csum) == 0 {
        if word(out, csum) != 0 {
            return Err("a UDP datagram without checksum got one".into());
        }
    } else if residual6_at(out, IP, l4, proto) != residual6_at(input, IP, l4, proto) {
        return Err("L4 checksum broken".into());
    }
    let dir = match hook {
        Hook::Egress => direction::EGRESS,
        Hook::Ingress => direction::INGRESS,
    };
    let (field, sport, dport) = if proto == ICMPV6 {
        let id = raw(input, l4 + 4);
        match hook {
            Hook::Egress => (l4 + 4, id, 0),
            Hook::Ingress => (l4 + 4, 0, id),
        }
    } else {
        let field = if hook == Hook::Egress { l4 } else { l4 + 2 };
        (field, raw(input, l4), raw(input, l4 + 2))
    };
    let k = key(h.src, h.dst, proto, sport, dport, dir);
    let addr = if hook == Hook::Egress { SRC6 } else { DST6 };
    let allowed = vec![span(addr, 16), span(field, 2), span(csum, 2)];
    Ok((allowed, k, vec![(addr, field)]))
}

/// An IPv6 fragment after the first carries no ports: it may only take the address its first
/// fragment took, the node's on the way out, a pod's on the way in.
fn check_later_fragment6(hook: Hook, input: &[u8], out: &[u8]) -> Result<(), String> {
    let (addr, allowed): (usize, &[Ipv6Addr]) = match hook {
        Hook::Egress => (SRC6, &[NODE6]),
        Hook::Ingress => (DST6, &PODS6),
    };
    let new = addr6_at(out, addr);
    let may_change = |i: usize| (addr..addr + 16).contains(&i);
    check_fragment_rewrite(input, out, may_change, &new, allowed.contains(&new))
}

/// An ICMPv6 error about a translated flow, crossing `hook`: the bytes it may change, the NAT
/// key of the flow it quotes, and where the translated (address, port) pairs are.
#[allow(clippy::type_complexity)]
fn check_icmp_error6(
    hook: Hook,
    input: &[u8],
    out: &[u8],
    h: &Headers6,
) -> Result<(Vec<std::ops::Range<usize>>, NatKeyV6, Vec<(usize, usize)>), String> {
    let inner = headers6_at(input, h.l4 + 8)
        .ok_or("translated an ICMPv6 error whose quoted header chain does not parse")?;
    if inner.src != h.dst {
        return Err("translated an error not sent to where the quoted packet came from".into());
    }
    if inner.is_later_fragment() {
        return Err("translated an error quoting a later fragment".into());
    }
    if input.len() < inner.l4 + 8 {
        return Err("translated an error quoting less than 8 bytes of L4 header".into());
    }
    let side = quoted_side(hook, 16, (ICMPV6_ECHO_REQUEST, ICMPV6_ECHO_REPLY));
    let proto = inner.proto;
    let field = match proto {
        TCP | UDP => inner.l4 + side.port,
        ICMPV6 if input[inner.l4] == side.echo => inner.l4 + 4,
        _ => return Err(format!("translated an error quoting protocol {proto}")),
    };
    if residual6_at(out, IP, h.l4, ICMPV6) != residual6_at(input, IP, h.l4, ICMPV6) {
        return Err("ICMPv6 checksum broken".into());
    }
    // The quoted L4 checksum, when the quote holds it, stays exactly as valid as it was.
    let quoted_csum = inner.l4 + l4_checksum_offset(proto);
    if quoted_csum + 2 <= input.len() {
        if proto == UDP && word(input, quoted_csum) == 0 {
            if word(out, quoted_csum) != 0 {
                return Err("a quoted UDP datagram without checksum got one".into());
            }
        } else if residual6_at(out, inner.ip, inner.l4, proto)
            != residual6_at(input, inner.ip, inner.l4, proto)
        {
            return Err("quoted L4 checksum broken".into());
        }
    }
    // The quoted packet went against `hook`: an answer to it goes with it, as this key.
    let (sport, dport) = match (proto, hook) {
        (ICMPV6, Hook::Ingress) => (0, raw(input, field)),
        (ICMPV6, Hook::Egress) => (raw(input, field), 0),
        _ => (raw(input, inner.l4 + 2), raw(input, inner.l4)),
    };
    let k = key(inner.dst, inner.src, proto, sport, dport, dir_of(hook));
    let quoted_addr = inner.ip + side.addr;
    let allowed = vec![
        span(side.outer, 16),
        span(h.l4 + 2, 2),
        span(quoted_addr, 16),
        span(field, 2),
        span(quoted_csum, 2),
    ];
    // The outer address at the node's end becomes the one translated in the quote.
    Ok((allowed, k, vec![(side.outer, field), (quoted_addr, field)]))
}

#[test]
fn no_mutated_ipv6_packet_is_mistranslated() {
    let seed = env_or("MASQ_FUZZ_SEED", 1);
    let iterations = env_or("MASQ_FUZZ_ITERATIONS", 200_000);
    let campaign = Campaign {
        bed: bed6,
        corpus: corpus6,
        mutate: mutate6,
        check: check_translation6,
    };
    let started = std::time::Instant::now();
    // Its own stream, so that the IPv4 run's figures stay what they were for a seed.
    let tally = run_campaign(
        &campaign,
        seed,
        &mut Rng(seed ^ 0x6666_6666_6666_6666),
        iterations,
    );
    let translated = &tally.translated;
    eprintln!(
        "IPv6, seed {seed}: {iterations} packets in {:.1?}, {} translated {translated:?}, {} \
         unchanged, {} dropped, {} refused by the test runner",
        started.elapsed(),
        tally.total_translated(),
        tally.unchanged,
        tally.dropped,
        tally.refused
    );
    tally.assert_reached_everywhere(iterations);
    tally.assert_kinds_reached(
        iterations,
        &[
            Translation::Flow,
            Translation::IcmpError,
            Translation::LaterFragment,
        ],
    );
}

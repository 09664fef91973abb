//! Packet fuzzing of the real programs through BPF_PROG_TEST_RUN: seeded random mutations of
//! valid frames (truncations, bad IHL, IP options, bogus lengths and fragment fields, ICMP errors
//! quoting garbage), sent out and in over a NAT table that holds live flows. Every output must be
//! a drop, the input unchanged, or a translation that changed only what a translation changes,
//! kept every checksum exactly as valid as it was, and put in the addresses and ports the NAT
//! table holds for that flow. The checks use this file's own parsing and xtask's checksum code,
//! nothing of the programs'.
//!
//! `cargo test` runs a short slice. The full run, reproducible from its seed:
//!
//! ```text
//! MASQ_FUZZ_SEED=1 MASQ_FUZZ_ITERATIONS=1000000 cargo test --release --test packet_fuzz -- --nocapture
//! ```

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;
use masq_agent::{dataplane::ebpf::testbed::TestBed, ports::PortRange};
use masq_ebpf::{NatEntryV4, NatKeyV4, direction, program_names};
use xtask::packet::*;

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
const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hook {
    Egress,
    Ingress,
}

fn bed() -> TestBed {
    let spans = [PortRange {
        first: 1024,
        last: 65535,
    }];
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
            frame(pod, remote, ICMP, &echo(8, sport)),
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
                _ => frame(remote, NODE, ICMP, &echo(0, word(&left, L4 + 4))),
            };
            frames.push((Hook::Ingress, reply));
            for (kind, code) in [(3, 4), (11, 0)] {
                let quote_len = rng.pick(&[28usize, left.len() - 14]);
                let body = &left[14..14 + quote_len.min(left.len() - 14)];
                let rest = if kind == 3 {
                    [0, 0, 0x05, 0x78]
                } else {
                    [0; 4]
                };
                let error = icmp_message(kind, code, rest, body);
                frames.push((Hook::Ingress, frame(ROUTER, NODE, ICMP, &error)));
            }
        }
    }
    frames
}

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

fn key(saddr: Ipv4Addr, daddr: Ipv4Addr, proto: u8, sport: u16, dport: u16, dir: u8) -> NatKeyV4 {
    NatKeyV4 {
        saddr: saddr.octets(),
        daddr: daddr.octets(),
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

/// Checks one translated frame against its input and the NAT table. `Err` says what is wrong.
fn check_translation(bed: &TestBed, hook: Hook, input: &[u8], out: &[u8]) -> Result<(), String> {
    if out.len() != input.len() {
        return Err("the length changed".into());
    }
    if word(input, 12) != 0x0800 || input.len() < 34 || input[14] != 0x45 {
        return Err("translated a frame that is not option-less IPv4".into());
    }
    if residual(&out[14..34]) != residual(&input[14..34]) {
        return Err("IP header checksum broken".into());
    }
    if word(input, 20) & 0x1fff != 0 {
        return check_later_fragment(hook, input, out);
    }
    let proto = input[23];
    let is_error = hook == Hook::Ingress && proto == ICMP && matches!(input[34], 3 | 11);
    let (allowed, entry_key, rewritten) = if is_error {
        check_icmp_error(input, out)?
    } else {
        let seg_len = input.len() - L4;
        let csum = L4 + l4_csum_offset(proto);
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
            if residual(&out[L4..]) != residual(&input[L4..]) {
                return Err("ICMP checksum broken".into());
            }
        } else if l4_residual(out, 14, L4, seg_len) != l4_residual(input, 14, L4, seg_len) {
            return Err("L4 checksum broken".into());
        }
        let (saddr, daddr) = (ipv4_at(input, 26), ipv4_at(input, 30));
        let dir = match hook {
            Hook::Egress => direction::EGRESS,
            Hook::Ingress => direction::INGRESS,
        };
        // Egress rewrites the source port (or echo id), ingress the destination's.
        let (field, k) = if proto == ICMP {
            let id = raw(input, L4 + 4);
            let (sport, dport) = if hook == Hook::Egress {
                (id, 0)
            } else {
                (0, id)
            };
            (L4 + 4, key(saddr, daddr, ICMP, sport, dport, dir))
        } else {
            let field = if hook == Hook::Egress { L4 } else { L4 + 2 };
            let (sport, dport) = (raw(input, L4), raw(input, L4 + 2));
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
    Ok(())
}

/// A fragment after the first carries no ports: it may only take the address its first
/// fragment took, the node's on the way out, a pod's on the way in.
fn check_later_fragment(hook: Hook, input: &[u8], out: &[u8]) -> Result<(), String> {
    let (addr, allowed): (usize, &[Ipv4Addr]) = match hook {
        Hook::Egress => (26, &[NODE]),
        Hook::Ingress => (30, &PODS),
    };
    let changed: Vec<usize> = (0..input.len()).filter(|&i| input[i] != out[i]).collect();
    if changed
        .iter()
        .any(|&i| !(24..26).contains(&i) && !(addr..addr + 4).contains(&i))
    {
        return Err(format!(
            "a later fragment changed beyond its address: {changed:?}"
        ));
    }
    let new = ipv4_at(out, addr);
    if !allowed.contains(&new) {
        return Err(format!("a later fragment took {new}"));
    }
    Ok(())
}

/// An ICMP error about a translated flow: the bytes it may change, the NAT key of the flow it
/// quotes, and where the restored (address, port) pairs are.
#[allow(clippy::type_complexity)]
fn check_icmp_error(
    input: &[u8],
    out: &[u8],
) -> Result<(Vec<std::ops::Range<usize>>, NatKeyV4, Vec<(usize, usize)>), String> {
    let inner = L4 + 8;
    let inner_l4 = inner + 20;
    if input.len() < inner_l4 + 8 || input[inner] != 0x45 {
        return Err(
            "translated an ICMP error that quotes less than an option-less IPv4 header and 8 bytes"
                .into(),
        );
    }
    if residual(&out[L4..]) != residual(&input[L4..]) {
        return Err("ICMP checksum broken".into());
    }
    if residual(&out[inner..inner_l4]) != residual(&input[inner..inner_l4]) {
        return Err("quoted IP header checksum broken".into());
    }
    let proto = input[inner + 9];
    let (sport_off, field) = match proto {
        TCP | UDP => (inner_l4, inner_l4),
        ICMP => (inner_l4 + 4, inner_l4 + 4),
        _ => return Err("translated an error quoting an untranslatable protocol".into()),
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
    // The quoted packet left the node; a reply to it would come in as this key.
    let (qsrc, qdst) = (ipv4_at(input, inner + 12), ipv4_at(input, inner + 16));
    let k = match proto {
        ICMP => key(
            qdst,
            qsrc,
            ICMP,
            0,
            raw(input, sport_off),
            direction::INGRESS,
        ),
        _ => key(
            qdst,
            qsrc,
            proto,
            raw(input, inner_l4 + 2),
            raw(input, sport_off),
            direction::INGRESS,
        ),
    };
    let allowed = vec![
        span(24, 2),
        span(30, 4),
        span(L4 + 2, 2),
        span(inner + 10, 2),
        span(inner + 12, 4),
        span(field, 2),
        span(quoted_csum, 2),
    ];
    // The outer destination becomes the pod's address; the quoted source address and port too.
    let outer_pod = ipv4_at(out, 30);
    if outer_pod != ipv4_at(out, inner + 12) {
        return Err("outer destination and quoted source disagree".into());
    }
    Ok((allowed, k, vec![(inner + 12, field)]))
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn no_mutated_packet_is_mistranslated() {
    let seed = env_or("MASQ_FUZZ_SEED", 1);
    let iterations = env_or("MASQ_FUZZ_ITERATIONS", 20_000);
    let mut rng = Rng(seed);
    let (mut translated, mut dropped, mut unchanged, mut refused) = (0u64, 0u64, 0u64, 0u64);
    let mut bed = bed();
    let mut frames = corpus(&mut bed, &mut rng);
    for i in 0..iterations {
        if i > 0 && i % BED_LIFETIME == 0 {
            bed = self::bed();
            frames = corpus(&mut bed, &mut rng);
        }
        let (hook, valid) = frames[rng.below(frames.len())].clone();
        let input = if rng.below(8) == 0 {
            valid
        } else {
            mutate(&valid, &mut rng)
        };
        let Some((verdict, out)) = try_run(&mut bed, hook, &input) else {
            refused += 1;
            continue;
        };
        match verdict {
            TC_ACT_SHOT => dropped += 1,
            TC_ACT_OK if out == input => unchanged += 1,
            TC_ACT_OK => {
                if let Err(what) = check_translation(&bed, hook, &input, &out) {
                    panic!(
                        "seed {seed}, iteration {i}, {hook:?}: {what}\n in: {input:02x?}\nout: {out:02x?}"
                    );
                }
                translated += 1;
            }
            other => panic!("seed {seed}, iteration {i}: verdict {other}"),
        }
    }
    eprintln!(
        "seed {seed}: {iterations} packets, {translated} translated, {unchanged} unchanged, \
         {dropped} dropped, {refused} refused by the test runner"
    );
    assert!(
        refused < iterations / 4,
        "{refused} frames the runner refused"
    );
    // A fuzzer that never reaches the translations proves nothing about them.
    assert!(translated > iterations / 20, "only {translated} translated");
    assert!(unchanged > iterations / 20, "only {unchanged} left alone");
}

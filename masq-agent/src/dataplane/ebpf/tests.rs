//! Packet tests of the real object through BPF_PROG_TEST_RUN: crafted frames in, every rewritten
//! byte and every checksum checked with this file's own checksum code, which shares nothing with
//! the programs' incremental updates.

use std::{net::Ipv4Addr, time::Duration};

use aya::{
    Ebpf, EbpfLoader,
    maps::{HashMap as BpfHashMap, MapData, PerCpuArray},
    programs::{TestRun, TestRunOptions},
};
use masq_ebpf::{Counter, NatEntryV4, NatKeyV4, direction, map_names, nat_kind, program_names};

use super::*;

const NODE: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 2);
const POD2: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 2);
const REMOTE: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
const REMOTE2: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);
const ROUTER: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 254);
/// BPF_PROG_TEST_RUN runs tc programs on the loopback device.
const TEST_RUN_IFINDEX: u32 = 1;
const TC_ACT_OK: u32 = 0;
const TC_ACT_SHOT: u32 = 2;
const TCP: u8 = 6;
const UDP: u8 = 17;
const ICMP: u8 = 1;

// ---- an independent checksum and packet builder --------------------------------------------

fn ones_sum(data: &[u8]) -> u32 {
    data.chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum()
}

fn checksum(data: &[u8]) -> u16 {
    let mut sum = ones_sum(data);
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

fn pseudo_header(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, len: usize) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend(src.octets());
    p.extend(dst.octets());
    p.extend([0, proto]);
    p.extend((len as u16).to_be_bytes());
    p
}

/// An option-less IPv4 header with a correct checksum.
fn ipv4_header(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, payload_len: usize, frag: u16) -> Vec<u8> {
    let mut h = vec![0x45, 0];
    h.extend(((20 + payload_len) as u16).to_be_bytes());
    h.extend(0x1234u16.to_be_bytes());
    h.extend(frag.to_be_bytes());
    h.extend([64, proto, 0, 0]);
    h.extend(src.octets());
    h.extend(dst.octets());
    let c = checksum(&h);
    h[10..12].copy_from_slice(&c.to_be_bytes());
    h
}

/// A TCP or UDP segment (8-byte UDP header, 20-byte TCP header) with a payload and a correct
/// checksum over the pseudo-header.
fn l4_segment(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    proto: u8,
    sport: u16,
    dport: u16,
    flags: u8,
) -> Vec<u8> {
    let payload = b"masq-agent test payload";
    let mut s = Vec::new();
    s.extend(sport.to_be_bytes());
    s.extend(dport.to_be_bytes());
    if proto == TCP {
        s.extend(1000u32.to_be_bytes());
        s.extend(0u32.to_be_bytes());
        s.extend([0x50, flags, 0xff, 0xff, 0, 0, 0, 0]);
    } else {
        s.extend(((8 + payload.len()) as u16).to_be_bytes());
        s.extend([0, 0]);
    }
    s.extend(payload);
    let c = checksum(&[pseudo_header(src, dst, proto, s.len()), s.clone()].concat());
    let off = if proto == TCP { 16 } else { 6 };
    s[off..off + 2].copy_from_slice(&c.to_be_bytes());
    s
}

fn icmp_message(kind: u8, code: u8, rest: [u8; 4], body: &[u8]) -> Vec<u8> {
    let mut m = vec![kind, code, 0, 0];
    m.extend(rest);
    m.extend(body);
    let c = checksum(&m);
    m[2..4].copy_from_slice(&c.to_be_bytes());
    m
}

fn echo(kind: u8, id: u16) -> Vec<u8> {
    let [a, b] = id.to_be_bytes();
    icmp_message(kind, 0, [a, b, 0, 1], b"ping payload")
}

fn frame(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, l4: &[u8]) -> Vec<u8> {
    frame_with_frag(src, dst, proto, l4, 0)
}

fn frame_with_frag(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, l4: &[u8], frag: u16) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x08, 0x00];
    f.extend(ipv4_header(src, dst, proto, l4.len(), frag));
    f.extend(l4);
    f
}

fn tcp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16, flags: u8) -> Vec<u8> {
    frame(
        src,
        dst,
        TCP,
        &l4_segment(src, dst, TCP, sport, dport, flags),
    )
}

fn udp(src: Ipv4Addr, sport: u16, dst: Ipv4Addr, dport: u16) -> Vec<u8> {
    frame(src, dst, UDP, &l4_segment(src, dst, UDP, sport, dport, 0))
}

const SYN: u8 = 0x02;
const ACK: u8 = 0x10;

// ---- reading frames back -------------------------------------------------------------------

fn src(f: &[u8]) -> Ipv4Addr {
    Ipv4Addr::new(f[26], f[27], f[28], f[29])
}

fn dst(f: &[u8]) -> Ipv4Addr {
    Ipv4Addr::new(f[30], f[31], f[32], f[33])
}

fn word(f: &[u8], off: usize) -> u16 {
    u16::from_be_bytes([f[off], f[off + 1]])
}

const L4: usize = 34;

/// Checks every checksum in a frame from scratch: IP header, and TCP, UDP or ICMP.
fn assert_checksums(f: &[u8]) {
    assert_eq!(checksum(&f[14..34]), 0, "IPv4 header checksum");
    let l4 = &f[L4..];
    match f[23] {
        TCP => assert_eq!(
            checksum(&[pseudo_header(src(f), dst(f), TCP, l4.len()), l4.to_vec()].concat()),
            0,
            "TCP checksum"
        ),
        UDP if word(f, L4 + 6) != 0 => assert_eq!(
            checksum(&[pseudo_header(src(f), dst(f), UDP, l4.len()), l4.to_vec()].concat()),
            0,
            "UDP checksum"
        ),
        ICMP => assert_eq!(checksum(l4), 0, "ICMP checksum"),
        _ => {}
    }
}

/// The byte offsets at which two frames differ.
fn diff(a: &[u8], b: &[u8]) -> Vec<usize> {
    assert_eq!(a.len(), b.len(), "frame length changed");
    (0..a.len()).filter(|i| a[*i] != b[*i]).collect()
}

// ---- the harness: the real object, fresh (unpinned) maps -----------------------------------

struct Harness {
    ebpf: Ebpf,
}

impl Harness {
    fn new(spans: &[(u16, u16)], random_fully: bool) -> Harness {
        let mut ebpf = EbpfLoader::new()
            .map_max_entries(map_names::NAT_V4, 1024)
            .load(OBJECT)
            .unwrap();
        for name in [program_names::EGRESS, program_names::INGRESS] {
            classifier(&mut ebpf, name).unwrap().load().unwrap();
        }
        let spans: Vec<PortRange> = spans
            .iter()
            .map(|(first, last)| PortRange {
                first: *first,
                last: *last,
            })
            .collect();
        write_settings(&mut ebpf, &spans, random_fully).unwrap();
        let lo = Device {
            name: "lo".into(),
            index: TEST_RUN_IFINDEX,
            ipv4: NODE,
        };
        write_interfaces(&mut ebpf, &[lo]).unwrap();
        let policy: Vec<Ipv4Net> = ["169.254.0.0/16", "10.0.0.0/8"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        sync_trie(&mut ebpf, map_names::NON_MASQ_V4, &v4_keys(&policy)).unwrap();
        Harness { ebpf }
    }

    /// Applies a new non-masquerade policy the way the data plane does.
    fn set_policy(&mut self, cidrs: &[&str]) {
        let policy: Vec<Ipv4Net> = cidrs.iter().map(|s| s.parse().unwrap()).collect();
        let keys = v4_keys(&policy);
        let (_, removed) = sync_trie(&mut self.ebpf, map_names::NON_MASQ_V4, &keys).unwrap();
        sync_draining(&mut self.ebpf, &removed, &keys, expiry::monotonic_now_ns()).unwrap();
    }

    fn default() -> Harness {
        Harness::new(&[(1024, 32767), (61000, 65535)], true)
    }

    fn run(&mut self, program: &str, input: &[u8]) -> (u32, Vec<u8>) {
        let prog = classifier(&mut self.ebpf, program).unwrap();
        let mut out = vec![0u8; input.len() + 256];
        let result = prog
            .test_run(TestRunOptions {
                data_in: Some(input),
                data_out: Some(&mut out),
                ..TestRunOptions::new()
            })
            .unwrap();
        out.truncate(result.data_size_out as usize);
        (result.return_value, out)
    }

    fn egress(&mut self, input: &[u8]) -> (u32, Vec<u8>) {
        self.run(program_names::EGRESS, input)
    }

    fn ingress(&mut self, input: &[u8]) -> (u32, Vec<u8>) {
        self.run(program_names::INGRESS, input)
    }

    fn counter(&self, c: Counter) -> u64 {
        let map: PerCpuArray<&MapData, u64> =
            PerCpuArray::try_from(self.ebpf.map(map_names::COUNTERS).unwrap()).unwrap();
        map.get(&(c as u32), 0).unwrap().iter().sum()
    }

    fn nat(&self) -> Vec<(NatKeyV4, NatEntryV4)> {
        let map: BpfHashMap<&MapData, NatKeyV4, NatEntryV4> =
            BpfHashMap::try_from(self.ebpf.map(map_names::NAT_V4).unwrap()).unwrap();
        map.iter().map(Result::unwrap).collect()
    }
}

/// Egress translation of a TCP or UDP packet: only the source address, source port and the
/// checksums may change, to the node's address and a port from the spans.
fn assert_masqueraded(input: &[u8], out: &[u8], proto: u8) -> u16 {
    assert_eq!(src(out), NODE);
    assert_eq!(dst(out), dst(input));
    assert_checksums(out);
    let csum = L4 + if proto == TCP { 16 } else { 6 };
    for i in diff(input, out) {
        assert!(
            (24..30).contains(&i) || (L4..L4 + 2).contains(&i) || (csum..csum + 2).contains(&i),
            "byte {i} changed"
        );
    }
    word(out, L4)
}

// ---- the tests ------------------------------------------------------------------------------

#[test]
fn tcp_egress_then_reply_ingress() {
    let mut h = Harness::default();
    let syn = tcp(POD, 40000, REMOTE, 80, SYN);
    let (verdict, out) = h.egress(&syn);
    assert_eq!(verdict, TC_ACT_OK);
    let port = assert_masqueraded(&syn, &out, TCP);
    assert!(
        (1024..=32767).contains(&port) || (61000..=65535).contains(&port),
        "{port}"
    );

    // Later packets of the flow keep the same translation.
    let ack = tcp(POD, 40000, REMOTE, 80, ACK);
    let (_, out2) = h.egress(&ack);
    assert_eq!(assert_masqueraded(&ack, &out2, TCP), port);

    let reply = tcp(REMOTE, 80, NODE, port, SYN | ACK);
    let (verdict, back) = h.ingress(&reply);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(dst(&back), POD);
    assert_eq!(word(&back, L4 + 2), 40000);
    assert_eq!(src(&back), REMOTE);
    assert_checksums(&back);
    for i in diff(&reply, &back) {
        assert!(
            (24..26).contains(&i)
                || (30..34).contains(&i)
                || (L4 + 2..L4 + 4).contains(&i)
                || (L4 + 16..L4 + 18).contains(&i),
            "byte {i}"
        );
    }
    assert_eq!(h.counter(Counter::Masqueraded), 2);
    assert_eq!(h.counter(Counter::ReverseTranslated), 1);

    let nat = h.nat();
    assert_eq!(nat.len(), 2, "one entry per direction");
    let (egress_key, egress) = nat
        .iter()
        .find(|(k, _)| k.direction == direction::EGRESS)
        .unwrap();
    assert_eq!(Ipv4Addr::from(egress_key.saddr), POD);
    assert_eq!(Ipv4Addr::from(egress.addr), NODE);
    assert_eq!(u16::from_be(egress.port), port);
    assert_eq!(egress.kind, nat_kind::SNAT);
    assert!(egress.last_seen_ns > 0);
    assert_ne!(egress.tcp_seen, 0, "TCP progress recorded");
}

#[test]
fn udp_with_and_without_checksum() {
    let mut h = Harness::default();
    let dgram = udp(POD, 5353, REMOTE, 53);
    let (_, out) = h.egress(&dgram);
    let port = assert_masqueraded(&dgram, &out, UDP);
    assert_ne!(word(&out, L4 + 6), 0);

    let mut no_csum = udp(POD, 5354, REMOTE, 53);
    no_csum[L4 + 6..L4 + 8].copy_from_slice(&[0, 0]);
    let (_, out) = h.egress(&no_csum);
    assert_masqueraded(&no_csum, &out, UDP);
    assert_eq!(word(&out, L4 + 6), 0, "a zero UDP checksum stays zero");

    let reply = udp(REMOTE, 53, NODE, port);
    let (_, back) = h.ingress(&reply);
    assert_eq!((dst(&back), word(&back, L4 + 2)), (POD, 5353));
    assert_checksums(&back);
}

#[test]
fn icmp_echo_gets_an_identifier_and_its_reply_is_restored() {
    let mut h = Harness::default();
    let request = frame(POD, REMOTE, ICMP, &echo(8, 0x4242));
    let (verdict, out) = h.egress(&request);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(src(&out), NODE);
    assert_checksums(&out);
    let id = word(&out, L4 + 4);
    for i in diff(&request, &out) {
        assert!(
            (24..30).contains(&i) || (L4 + 2..L4 + 6).contains(&i),
            "byte {i}"
        );
    }

    let reply = frame(REMOTE, NODE, ICMP, &echo(0, id));
    let (_, back) = h.ingress(&reply);
    assert_eq!(dst(&back), POD);
    assert_eq!(word(&back, L4 + 4), 0x4242);
    assert_checksums(&back);
}

/// An ICMP error from a router about `quoted`, a packet as it left the node.
fn icmp_error(kind: u8, code: u8, quoted: &[u8], quote_len: usize) -> Vec<u8> {
    let body = &quoted[14..14 + quote_len];
    let rest = if kind == 3 && code == 4 {
        [0, 0, 0x05, 0x78]
    } else {
        [0; 4]
    };
    frame(ROUTER, NODE, ICMP, &icmp_message(kind, code, rest, body))
}

/// Checks a translated ICMP error: outer destination, quoted source address and port restored,
/// with the outer IP, ICMP, quoted IP and (when quoted in full) quoted L4 checksums all valid.
fn assert_icmp_error_restored(back: &[u8], pod_port: u16, quoted_l4_checksum: Option<(u8, usize)>) {
    assert_eq!(dst(back), POD);
    assert_checksums(back);
    let inner = L4 + 8;
    assert_eq!(
        checksum(&back[inner..inner + 20]),
        0,
        "quoted IPv4 header checksum"
    );
    assert_eq!(
        Ipv4Addr::new(
            back[inner + 12],
            back[inner + 13],
            back[inner + 14],
            back[inner + 15]
        ),
        POD
    );
    assert_eq!(word(back, inner + 20), pod_port, "quoted source port");
    if let Some((proto, len)) = quoted_l4_checksum {
        let seg = &back[inner + 20..inner + 20 + len];
        let qsrc = POD;
        let qdst = Ipv4Addr::new(
            back[inner + 16],
            back[inner + 17],
            back[inner + 18],
            back[inner + 19],
        );
        assert_eq!(
            checksum(&[pseudo_header(qsrc, qdst, proto, len), seg.to_vec()].concat()),
            0,
            "quoted L4 checksum"
        );
    }
}

#[test]
fn icmp_errors_about_tcp_and_udp_flows_are_translated_inside_and_out() {
    let mut h = Harness::default();
    let syn = tcp(POD, 40001, REMOTE, 443, SYN);
    let (_, tcp_out) = h.egress(&syn);
    let dgram = udp(POD, 40002, REMOTE2, 53);
    let (_, udp_out) = h.egress(&dgram);
    let tcp_len = tcp_out.len() - L4;
    let udp_len = udp_out.len() - L4;

    // Fragmentation needed, quoting the whole TCP segment.
    let (verdict, back) = h.ingress(&icmp_error(3, 4, &tcp_out, 20 + tcp_len));
    assert_eq!(verdict, TC_ACT_OK);
    assert_icmp_error_restored(&back, 40001, Some((TCP, tcp_len)));
    // The MTU the router reported is untouched.
    assert_eq!(word(&back, L4 + 6), 0x0578);

    // Time exceeded, quoting the whole UDP datagram.
    let (_, back) = h.ingress(&icmp_error(11, 0, &udp_out, 20 + udp_len));
    assert_icmp_error_restored(&back, 40002, Some((UDP, udp_len)));

    // Port unreachable, quoting only 8 bytes of TCP (RFC 792's minimum): no TCP checksum to fix.
    let (_, back) = h.ingress(&icmp_error(3, 3, &tcp_out, 28));
    assert_icmp_error_restored(&back, 40001, None);

    assert_eq!(h.counter(Counter::IcmpErrorTranslated), 3);
}

#[test]
fn icmp_error_about_a_ping_is_translated() {
    let mut h = Harness::default();
    let (_, out) = h.egress(&frame(POD, REMOTE, ICMP, &echo(8, 7)));
    let quoted_len = out.len() - 14;
    let (_, back) = h.ingress(&icmp_error(11, 0, &out, quoted_len));
    assert_eq!(dst(&back), POD);
    assert_checksums(&back);
    let inner = L4 + 8;
    assert_eq!(checksum(&back[inner..inner + 20]), 0);
    assert_eq!(
        word(&back, inner + 24),
        7,
        "quoted echo identifier restored"
    );
    assert_eq!(checksum(&back[inner + 20..]), 0, "quoted ICMP checksum");
}

#[test]
fn icmp_error_about_an_unknown_flow_passes_untouched() {
    let mut h = Harness::default();
    let stray = tcp(NODE, 33333, REMOTE, 443, SYN);
    let error = icmp_error(3, 3, &stray, 28);
    let (verdict, out) = h.ingress(&error);
    assert_eq!((verdict, out), (TC_ACT_OK, error));
    assert_eq!(h.counter(Counter::IcmpErrorTranslated), 0);
}

#[test]
fn exempt_destinations_and_the_nodes_own_traffic_pass_untouched() {
    let mut h = Harness::default();
    for (packet, counter) in [
        (
            tcp(POD, 1000, Ipv4Addr::new(10, 96, 0, 1), 443, SYN),
            Counter::NotMasqNonMasqDestination,
        ),
        (
            udp(POD, 1000, Ipv4Addr::new(169, 254, 169, 254), 80),
            Counter::NotMasqNonMasqDestination,
        ),
        (
            tcp(NODE, 1000, REMOTE, 443, SYN),
            Counter::NotMasqNodeSource,
        ),
        (
            frame(POD, REMOTE, 47, b"GRE payload, left to the chain"),
            Counter::NotMasqOtherProtocol,
        ),
        (
            frame(POD, REMOTE, ICMP, &echo(0, 9)),
            Counter::NotMasqIcmpOther,
        ),
    ] {
        let before = h.counter(counter);
        let (verdict, out) = h.egress(&packet);
        assert_eq!((verdict, &out), (TC_ACT_OK, &packet));
        assert_eq!(h.counter(counter), before + 1, "{counter:?}");
    }
    assert!(h.nat().is_empty());
}

#[test]
fn odd_and_truncated_packets_pass_unmodified() {
    let mut h = Harness::default();
    let good = tcp(POD, 1000, REMOTE, 443, SYN);
    // IP options: IHL 6, with a NOP option word.
    let mut options = good[..34].to_vec();
    options[14] = 0x46;
    options.extend([1, 1, 1, 0]);
    options.extend(&good[34..]);
    // An IHL below the minimum, a TCP header cut short, a UDP header cut short, an ARP frame,
    // an IPv6 frame. (The kernel's test runner refuses IP frames shorter than an IP header.)
    let mut bad_ihl = good.clone();
    bad_ihl[14] = 0x44;
    let short_tcp = good[..40].to_vec();
    let short_udp = udp(POD, 1000, REMOTE, 53)[..38].to_vec();
    let mut arp = good.clone();
    arp[12..14].copy_from_slice(&[0x08, 0x06]);
    let mut ipv6 = good.clone();
    ipv6[12..14].copy_from_slice(&[0x86, 0xdd]);
    for packet in [options, bad_ihl, short_tcp, short_udp, arp, ipv6] {
        for program in [program_names::EGRESS, program_names::INGRESS] {
            let (verdict, out) = h.run(program, &packet);
            assert_eq!(
                (verdict, &out),
                (TC_ACT_OK, &packet),
                "{program} {packet:02x?}"
            );
        }
    }
    assert!(h.nat().is_empty());
}

#[test]
fn two_pods_with_one_source_port_get_different_nat_ports() {
    let mut h = Harness::default();
    let (_, a) = h.egress(&tcp(POD, 50000, REMOTE, 80, SYN));
    let (_, b) = h.egress(&tcp(POD2, 50000, REMOTE, 80, SYN));
    assert_eq!((src(&a), src(&b)), (NODE, NODE));
    assert_ne!(word(&a, L4), word(&b, L4));
    let (_, back_b) = h.ingress(&tcp(REMOTE, 80, NODE, word(&b, L4), SYN | ACK));
    assert_eq!(dst(&back_b), POD2);
}

#[test]
fn without_random_fully_the_pods_port_is_kept_when_free() {
    let mut h = Harness::new(&[(1024, 65535)], false);
    let (_, a) = h.egress(&tcp(POD, 45000, REMOTE, 80, SYN));
    assert_eq!(word(&a, L4), 45000);
    // Same port from another pod to the same server: taken, so the next one is used.
    let (_, b) = h.egress(&tcp(POD2, 45000, REMOTE, 80, SYN));
    assert_eq!(word(&b, L4), 45001);
}

#[test]
fn exhausted_ports_drop_and_count_never_mistranslate() {
    let mut h = Harness::new(&[(5000, 5000)], true);
    let (verdict, a) = h.egress(&udp(POD, 1111, REMOTE, 53));
    assert_eq!((verdict, word(&a, L4)), (TC_ACT_OK, 5000));
    // The only port is taken for this server: the next flow is dropped.
    let second = udp(POD2, 2222, REMOTE, 53);
    let (verdict, _) = h.egress(&second);
    assert_eq!(verdict, TC_ACT_SHOT);
    assert_eq!(h.counter(Counter::DropPortsExhausted), 1);
    assert_eq!(h.counter(Counter::AllocationFailed), 1);
    // Another server can still use the same port.
    let (verdict, c) = h.egress(&udp(POD2, 2222, REMOTE2, 53));
    assert_eq!((verdict, word(&c, L4)), (TC_ACT_OK, 5000));
    assert_eq!(h.nat().len(), 4, "no half-created flow was left behind");
    // The first flow is unaffected.
    let (_, back) = h.ingress(&udp(REMOTE, 53, NODE, 5000));
    assert_eq!((dst(&back), word(&back, L4 + 2)), (POD, 1111));
}

#[test]
fn connections_opened_from_outside_keep_the_pods_address() {
    let mut h = Harness::default();
    let syn = tcp(REMOTE, 5555, POD, 8080, SYN);
    let (verdict, out) = h.ingress(&syn);
    assert_eq!((verdict, &out), (TC_ACT_OK, &syn));
    assert_eq!(h.counter(Counter::InboundTracked), 1);
    let syn_ack = tcp(POD, 8080, REMOTE, 5555, SYN | ACK);
    let (verdict, out) = h.egress(&syn_ack);
    assert_eq!(
        (verdict, &out),
        (TC_ACT_OK, &syn_ack),
        "the pod's reply keeps its address"
    );
    assert_eq!(h.counter(Counter::NotMasqInbound), 1);
    assert!(h.nat().iter().all(|(_, e)| e.kind == nat_kind::PASSTHROUGH));
    // The pod's own new connection to the same server is still masqueraded.
    let (_, out) = h.egress(&tcp(POD, 40000, REMOTE, 5555, SYN));
    assert_eq!(src(&out), NODE);
}

#[test]
fn later_fragments_are_dropped_not_sent_with_the_pods_address() {
    let mut h = Harness::default();
    let later = frame_with_frag(POD, REMOTE, UDP, b"the middle of a datagram", 0x00b9);
    let (verdict, _) = h.egress(&later);
    assert_eq!(verdict, TC_ACT_SHOT);
    assert_eq!(h.counter(Counter::DropFragment), 1);
}

#[test]
fn nothing_is_translated_before_the_agent_configures_ports() {
    let mut ebpf = EbpfLoader::new()
        .map_max_entries(map_names::NAT_V4, 16)
        .load(OBJECT)
        .unwrap();
    classifier(&mut ebpf, program_names::EGRESS)
        .unwrap()
        .load()
        .unwrap();
    let mut h = Harness { ebpf };
    let packet = tcp(POD, 1000, REMOTE, 443, SYN);
    let (verdict, out) = h.egress(&packet);
    assert_eq!((verdict, out), (TC_ACT_OK, packet));
    assert_eq!(h.counter(Counter::NotInspected), 1);
}

#[test]
fn a_full_nat_table_drops_new_flows_and_keeps_live_ones() {
    let mut ebpf = EbpfLoader::new()
        .map_max_entries(map_names::NAT_V4, 4)
        .load(OBJECT)
        .unwrap();
    for name in [program_names::EGRESS, program_names::INGRESS] {
        classifier(&mut ebpf, name).unwrap().load().unwrap();
    }
    write_settings(
        &mut ebpf,
        &[PortRange {
            first: 1024,
            last: 65535,
        }],
        true,
    )
    .unwrap();
    let lo = Device {
        name: "lo".into(),
        index: TEST_RUN_IFINDEX,
        ipv4: NODE,
    };
    write_interfaces(&mut ebpf, &[lo]).unwrap();
    let mut h = Harness { ebpf };
    let (_, a) = h.egress(&udp(POD, 1001, REMOTE, 53));
    let (_, b) = h.egress(&udp(POD, 1002, REMOTE, 53));
    assert_eq!(h.nat().len(), 4, "two flows fill a four-entry table");
    let (verdict, _) = h.egress(&udp(POD, 1003, REMOTE, 53));
    assert_eq!(verdict, TC_ACT_SHOT, "a third flow is dropped");
    assert_eq!(h.counter(Counter::DropNatTableFull), 1);
    assert_eq!(h.nat().len(), 4, "and leaves nothing behind");
    for (out, pod_port) in [(a, 1001), (b, 1002)] {
        let (verdict, again) = h.egress(&udp(POD, pod_port, REMOTE, 53));
        assert_eq!(
            (verdict, word(&again, L4)),
            (TC_ACT_OK, word(&out, L4)),
            "live flows keep their port"
        );
        let (_, back) = h.ingress(&udp(REMOTE, 53, NODE, word(&out, L4)));
        assert_eq!((dst(&back), word(&back, L4 + 2)), (POD, pod_port));
    }
}

#[test]
fn expiry_removes_both_halves_of_idle_flows_only() {
    let mut h = Harness::default();
    h.egress(&udp(POD, 2001, REMOTE, 53));
    let (_, tcp_out) = h.egress(&tcp(POD, 2002, REMOTE, 443, SYN));
    // The TCP flow completes its handshake both ways: established.
    h.ingress(&tcp(REMOTE, 443, NODE, word(&tcp_out, L4), SYN | ACK));
    h.egress(&tcp(POD, 2002, REMOTE, 443, ACK));
    h.ingress(&tcp(REMOTE, 443, NODE, word(&tcp_out, L4), ACK));
    // A half-open TCP flow: SYN only.
    h.egress(&tcp(POD, 2003, REMOTE, 443, SYN));
    assert_eq!(h.nat().len(), 6);

    let timeouts = Timeouts::default();
    let newest = h.nat().iter().map(|(_, e)| e.last_seen_ns).max().unwrap();
    let run = |h: &mut Harness, after: Duration| {
        let mut nat: BpfHashMap<&mut MapData, NatKeyV4, NatEntryV4> =
            BpfHashMap::try_from(h.ebpf.map_mut(map_names::NAT_V4).unwrap()).unwrap();
        expiry::expire(&mut nat, &timeouts, newest + after.as_nanos() as u64)
    };
    let flows = |h: &Harness| {
        let mut ports: Vec<u16> = h
            .nat()
            .iter()
            .filter(|(k, _)| k.direction == direction::EGRESS)
            .map(|(k, _)| u16::from_be(k.sport))
            .collect();
        ports.sort();
        ports
    };
    assert_eq!(run(&mut h, Duration::from_secs(30)).flows_expired, 0);
    assert_eq!(flows(&h), [2001, 2002, 2003]);
    // Past the transitory timeout: the half-open flow goes, both halves.
    run(&mut h, timeouts.tcp_transitory + Duration::from_secs(1));
    assert_eq!(flows(&h), [2001, 2002]);
    // Past UDP's: the UDP flow goes; the established TCP flow stays for hours.
    run(&mut h, timeouts.udp + Duration::from_secs(1));
    assert_eq!(flows(&h), [2002]);
    assert_eq!(h.nat().len(), 2, "no half of an expired flow is left");
    run(&mut h, timeouts.tcp_established + Duration::from_secs(1));
    assert!(h.nat().is_empty());
}

#[test]
fn an_orphaned_reply_half_is_removed() {
    let mut h = Harness::default();
    h.egress(&udp(POD, 3001, REMOTE, 53));
    let egress_key = h
        .nat()
        .into_iter()
        .find(|(k, _)| k.direction == direction::EGRESS)
        .unwrap()
        .0;
    let newest = h.nat()[0].1.last_seen_ns;
    let mut nat: BpfHashMap<&mut MapData, NatKeyV4, NatEntryV4> =
        BpfHashMap::try_from(h.ebpf.map_mut(map_names::NAT_V4).unwrap()).unwrap();
    nat.remove(&egress_key).unwrap();
    let timeouts = Timeouts::default();
    let run = expiry::expire(
        &mut nat,
        &timeouts,
        newest + (timeouts.orphan + Duration::from_secs(1)).as_nanos() as u64,
    );
    assert_eq!(run.orphans_removed, 1);
    assert!(h.nat().is_empty());
}

#[test]
fn a_policy_change_affects_new_flows_only() {
    let mut h = Harness::default();
    // A masqueraded connection, then its destination becomes non-masquerade.
    let (_, before) = h.egress(&tcp(POD, 4001, REMOTE, 443, SYN));
    h.set_policy(&["169.254.0.0/16", "10.0.0.0/8", "203.0.113.0/24"]);
    let (_, after) = h.egress(&tcp(POD, 4001, REMOTE, 443, ACK));
    assert_eq!(
        (src(&after), word(&after, L4)),
        (NODE, word(&before, L4)),
        "keeps its translation"
    );
    let fresh = tcp(POD, 4002, REMOTE, 443, SYN);
    assert_eq!(
        h.egress(&fresh).1,
        fresh,
        "a new connection is not masqueraded"
    );

    // An unmasqueraded connection, then its destination leaves the non-masquerade CIDRs.
    let established = tcp(POD, 4003, REMOTE2, 443, ACK);
    h.set_policy(&["169.254.0.0/16", "10.0.0.0/8", "198.51.100.0/24"]);
    assert_eq!(h.egress(&established).1, established);
    h.set_policy(&["169.254.0.0/16", "10.0.0.0/8"]);
    assert_eq!(
        h.egress(&established).1,
        established,
        "stays unmasqueraded while draining"
    );
    let (_, again) = h.egress(&tcp(POD, 4003, REMOTE2, 443, ACK | 0x01));
    assert_eq!(src(&again), POD, "through to its FIN");
    let (_, new) = h.egress(&tcp(POD, 4004, REMOTE2, 443, SYN));
    assert_eq!(src(&new), NODE, "a new connection is masqueraded");
    // Re-adding the prefix ends the draining.
    h.set_policy(&["169.254.0.0/16", "10.0.0.0/8", "198.51.100.0/24"]);
    let draining: LpmTrie<&MapData, [u8; 4], u32> =
        LpmTrie::try_from(h.ebpf.map(map_names::DRAINING_V4).unwrap()).unwrap();
    let keys: Vec<(u32, [u8; 4])> = draining
        .keys()
        .map(|k| k.map(|k| (k.prefix_len(), k.data())).unwrap())
        .collect();
    assert_eq!(
        keys,
        [(24, [203, 0, 113, 0])],
        "only the prefix still out of the policy drains"
    );
}

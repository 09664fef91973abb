//! Packet tests of the real object through BPF_PROG_TEST_RUN: crafted frames in, every rewritten
//! byte and every checksum checked with this file's own checksum code, which shares nothing with
//! the programs' incremental updates.

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    time::Duration,
};

use masq_ebpf::{Counter, direction, nat_kind, program_names, tcp_seen};
use masq_testbed::packet::*;

use aya::maps::IterableMap as _;
use ipnet::Ipv4Net;
use masq_agent::dataplane::{
    NatUsage,
    ebpf::{
        batch,
        expiry::{self, Timeouts},
        testbed::{self, TC_ACT_OK, TC_ACT_SHOT, TestBed},
    },
};

const NODE: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
const POD: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 2);
const POD2: Ipv4Addr = Ipv4Addr::new(10, 244, 2, 2);
const REMOTE: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
const REMOTE2: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);
const ROUTER: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 254);

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

// ---- the harness: the real object, fresh (unpinned) maps -----------------------------------

type Harness = TestBed;

fn nets(list: &[&str]) -> Vec<Ipv4Net> {
    list.iter().map(|s| s.parse().unwrap()).collect()
}

fn harness(port_spans: &[(u16, u16)], random_fully: bool) -> Harness {
    TestBed::new(
        1024,
        port_spans,
        random_fully,
        NODE,
        &nets(&["169.254.0.0/16", "10.0.0.0/8"]),
    )
    .unwrap()
}

fn default_harness() -> Harness {
    harness(&[(1024, 32767), (61000, 65535)], true)
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
    let mut h = default_harness();
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
    let mut h = default_harness();
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
    let mut h = default_harness();
    let request = ping(POD, REMOTE, 8, 0x4242);
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

    let reply = ping(REMOTE, NODE, 0, id);
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
    icmp_frame(ROUTER, NODE, kind, code, rest, body)
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
    let mut h = default_harness();
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
    let mut h = default_harness();
    let (_, out) = h.egress(&ping(POD, REMOTE, 8, 7));
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
    let mut h = default_harness();
    let stray = tcp(NODE, 33333, REMOTE, 443, SYN);
    let error = icmp_error(3, 3, &stray, 28);
    let (verdict, out) = h.ingress(&error);
    assert_eq!((verdict, out), (TC_ACT_OK, error));
    assert_eq!(h.counter(Counter::IcmpErrorTranslated), 0);
}

/// An ICMP error from `from` to `to`, quoting the first `quote_len` bytes of the IP packet in
/// `quoted` (a frame).
fn icmp_error_from(
    (from, to): (Ipv4Addr, Ipv4Addr),
    (kind, code, rest): (u8, u8, [u8; 4]),
    quoted: &[u8],
    quote_len: usize,
) -> Vec<u8> {
    let body = &quoted[14..14 + quote_len];
    icmp_frame(from, to, kind, code, rest, body)
}

/// The same, to where the quoted packet came from, as errors go.
fn icmp_error_about(
    from: Ipv4Addr,
    kind: (u8, u8, [u8; 4]),
    quoted: &[u8],
    quote_len: usize,
) -> Vec<u8> {
    icmp_error_from((from, src(quoted)), kind, quoted, quote_len)
}

/// The residual of the L4 checksum of the IP packet at `ip` in `f`, computed from scratch over
/// its pseudo-header (ICMP has none): 0 when it is right.
fn l4_residual_at(f: &[u8], ip: usize) -> u16 {
    let header = &f[ip..ip + 20];
    let seg = &f[ip + 20..];
    let at = |o: usize| Ipv4Addr::new(header[o], header[o + 1], header[o + 2], header[o + 3]);
    match header[9] {
        ICMP => checksum(seg),
        proto => checksum(
            &[
                pseudo_header(at(12), at(16), proto, seg.len()),
                seg.to_vec(),
            ]
            .concat(),
        ),
    }
}

const FRAG_NEEDED_1400: (u8, u8, [u8; 4]) = (3, 4, [0, 0, 0x05, 0x78]);
const PORT_UNREACHABLE: (u8, u8, [u8; 4]) = (3, 3, [0; 4]);
const TTL_EXCEEDED: (u8, u8, [u8; 4]) = (11, 0, [0; 4]);
const PARAMETER_PROBLEM: (u8, u8, [u8; 4]) = (12, 0, [20, 0, 0, 0]);
/// The pod's gateway on the node: a source a node's error may take.
const POD_GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 244, 1, 1);

/// Where the checksums of an ICMP error's headers sit: the outer IP header, the ICMP message,
/// the quoted IP header, and the quoted L4 header's when the quote holds it.
fn error_checksums(error: &[u8], quoted_proto: u8) -> Vec<usize> {
    let inner = L4 + 8;
    let quoted_l4 = inner + 20;
    let quoted_csum = quoted_l4
        + match quoted_proto {
            TCP => 16,
            UDP => 6,
            _ => 2,
        };
    [24, L4 + 2, inner + 10, quoted_csum]
        .into_iter()
        .filter(|&c| c + 2 <= error.len())
        .collect()
}

/// ICMP errors leaving the node about replies it restored to a pod, as conntrack translates a
/// RELATED error: the quoted packet becomes the reply as it arrived (to the node's address and
/// NAT port), and the outer source the node's address. Each is compared with the frame the
/// outside host must receive, built from scratch.
#[test]
fn egress_icmp_errors_about_masqueraded_flows_are_translated_as_conntrack_does() {
    let mut h = default_harness();
    let tcp_flow = h.answered(&tcp(POD, 40001, REMOTE, 443, SYN), |left| {
        tcp(REMOTE, 443, NODE, word(left, L4), SYN | ACK)
    });
    let udp_flow = h.answered(&udp(POD, 40002, REMOTE2, 53), |left| {
        udp(REMOTE2, 53, NODE, word(left, L4))
    });
    let zero_udp_flow = h.answered(&udp(POD, 40003, REMOTE2, 53), |left| {
        let mut reply = udp(REMOTE2, 53, NODE, word(left, L4));
        reply[L4 + 6..L4 + 8].copy_from_slice(&[0, 0]);
        reply
    });
    let echo_flow = h.answered(&ping(POD, REMOTE, 8, 0x4242), |left| {
        ping(REMOTE, NODE, 0, word(left, L4 + 4))
    });
    let whole = |f: &testbed::Answered| f.restored.len() - 14;
    let cases = [
        (
            "the node's fragmentation needed about a TCP reply, quoted whole",
            NODE,
            FRAG_NEEDED_1400,
            &tcp_flow,
            whole(&tcp_flow),
        ),
        (
            "the node's time exceeded from the pods' gateway, 8 bytes of TCP quoted",
            POD_GATEWAY,
            TTL_EXCEEDED,
            &tcp_flow,
            28,
        ),
        (
            "the pod's port unreachable about a UDP reply, quoted whole",
            POD,
            PORT_UNREACHABLE,
            &udp_flow,
            whole(&udp_flow),
        ),
        (
            "the pod's port unreachable about a UDP reply without a checksum",
            POD,
            PORT_UNREACHABLE,
            &zero_udp_flow,
            whole(&zero_udp_flow),
        ),
        (
            "the pod's parameter problem about an echo reply, quoted whole",
            POD,
            PARAMETER_PROBLEM,
            &echo_flow,
            whole(&echo_flow),
        ),
    ];
    for (n, (what, from, kind, flow, quote_len)) in cases.into_iter().enumerate() {
        let error = icmp_error_about(from, kind, &flow.restored, quote_len);
        assert_checksums(&error);
        let (verdict, out) = h.egress(&error);
        assert_eq!(verdict, TC_ACT_OK, "{what}");
        let expected = icmp_error_about(NODE, kind, &flow.arrived, quote_len);
        assert_frame(&out, &expected, &error_checksums(&out, flow.arrived[23]));
        assert_checksums(&out);
        let inner = L4 + 8;
        assert_eq!(
            checksum(&out[inner..inner + 20]),
            0,
            "{what}: quoted header"
        );
        let quoted_csum = *error_checksums(&out, flow.arrived[23]).last().unwrap();
        if flow.arrived[23] == UDP && word(&flow.arrived, L4 + 6) == 0 {
            assert_eq!(
                word(&out, quoted_csum),
                0,
                "{what}: no UDP checksum stays none"
            );
        } else if quote_len == whole(flow) {
            assert_eq!(l4_residual_at(&out, inner), 0, "{what}: quoted L4 checksum");
        }
        assert_eq!(
            h.counter(Counter::IcmpErrorMasqueraded),
            n as u64 + 1,
            "{what}"
        );
    }
    assert_eq!(h.counter(Counter::NotMasqIcmpOther), 0);
}

/// Errors that are about no masqueraded flow, or not addressed to where the quoted packet came
/// from, leave as they are, as conntrack leaves them.
#[test]
fn egress_icmp_errors_about_no_masqueraded_flow_pass_untouched() {
    let mut h = default_harness();
    let flow = h.answered(&udp(POD, 40010, REMOTE, 53), |left| {
        udp(REMOTE, 53, NODE, word(left, L4))
    });
    // A connection opened from outside keeps the pod's address, and so do errors about it.
    h.ingress(&tcp(REMOTE, 5555, POD, 8080, SYN));
    let inbound = tcp(REMOTE, 5555, POD, 8080, ACK);
    let whole = flow.restored.len() - 14;
    let misaddressed = icmp_error_from((POD, REMOTE2), PORT_UNREACHABLE, &flow.restored, whole);
    let short_quote = icmp_error_about(POD, PORT_UNREACHABLE, &flow.restored, 27);
    for (what, error) in [
        (
            "about a flow never seen",
            icmp_error_about(POD, PORT_UNREACHABLE, &udp(REMOTE, 53, POD, 40011), 28),
        ),
        (
            "about a connection from outside",
            icmp_error_about(POD, PORT_UNREACHABLE, &inbound, 28),
        ),
        ("to another host than the quoted source", misaddressed),
        ("quoting less than 8 bytes of UDP", short_quote),
        (
            "quoting an echo request, which no masqueraded echo flow received",
            icmp_error_about(POD, PARAMETER_PROBLEM, &ping(REMOTE, POD, 8, 40010), 28),
        ),
    ] {
        assert_checksums(&error);
        let (verdict, out) = h.egress(&error);
        assert_eq!((verdict, &out), (TC_ACT_OK, &error), "{what}");
    }
    assert_eq!(h.counter(Counter::IcmpErrorMasqueraded), 0);
    assert_eq!(h.counter(Counter::NotMasqIcmpOther), 5);
}

#[test]
fn exempt_destinations_and_the_nodes_own_traffic_pass_untouched() {
    let mut h = default_harness();
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
        (ping(POD, REMOTE, 0, 9), Counter::NotMasqIcmpOther),
    ] {
        let before = h.counter(counter);
        let (verdict, out) = h.egress(&packet);
        assert_eq!((verdict, &out), (TC_ACT_OK, &packet));
        assert_eq!(h.counter(counter), before + 1, "{counter:?}");
    }
    // Only the node's flow is remembered, as one of the node's own that nothing translates.
    let nat = h.nat();
    assert_eq!(nat.len(), 2, "{nat:?}");
    assert!(nat.iter().all(|(_, e)| e.kind == nat_kind::NODE), "{nat:?}");
}

/// `frame` with a word of IP options (three NOPs and an end of list), its header checksum
/// made right again.
fn with_ip_options(frame: &[u8]) -> Vec<u8> {
    let mut f = frame[..L4].to_vec();
    f[14] = 0x46;
    let total = word(&f, 16) + 4;
    f[16..18].copy_from_slice(&total.to_be_bytes());
    f.extend([1, 1, 1, 0]);
    f[24..26].copy_from_slice(&[0, 0]);
    let c = checksum(&f[14..38]);
    f[24..26].copy_from_slice(&c.to_be_bytes());
    f.extend(&frame[L4..]);
    f
}

/// IP options are stepped over, as the chain's protocol match does: left alone, the packet
/// would leave with the pod's address.
#[test]
fn a_packet_with_ip_options_is_translated_past_them() {
    let mut h = default_harness();
    let syn = with_ip_options(&tcp(POD, 1000, REMOTE, 443, SYN));
    assert_eq!(checksum(&syn[14..38]), 0);
    let (verdict, out) = h.egress(&syn);
    assert_eq!(verdict, TC_ACT_OK);
    let l4 = L4 + 4;
    assert_eq!(src(&out), NODE);
    assert_eq!(
        checksum(&out[14..38]),
        0,
        "IPv4 header checksum, options included"
    );
    let segment = &out[l4..];
    assert_eq!(
        checksum(
            &[
                pseudo_header(NODE, REMOTE, TCP, segment.len()),
                segment.to_vec()
            ]
            .concat()
        ),
        0,
        "TCP checksum"
    );
    for i in diff(&syn, &out) {
        assert!(
            (24..30).contains(&i) || (l4..l4 + 2).contains(&i) || (l4 + 16..l4 + 18).contains(&i),
            "byte {i} changed"
        );
    }
    let port = word(&out, l4);
    let reply = with_ip_options(&tcp(REMOTE, 443, NODE, port, SYN | ACK));
    let (verdict, back) = h.ingress(&reply);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!((dst(&back), word(&back, l4 + 2)), (POD, 1000));
    assert_eq!(checksum(&back[14..38]), 0);
    let segment = &back[l4..];
    assert_eq!(
        checksum(
            &[
                pseudo_header(REMOTE, POD, TCP, segment.len()),
                segment.to_vec()
            ]
            .concat()
        ),
        0,
        "the reply's TCP checksum"
    );
}

#[test]
fn odd_and_truncated_packets_pass_unmodified() {
    let mut h = default_harness();
    let good = tcp(POD, 1000, REMOTE, 443, SYN);
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
    for packet in [bad_ihl, short_tcp, short_udp, arp, ipv6] {
        for program in [program_names::EGRESS, program_names::INGRESS] {
            let run = h.run(program, &packet, 1).unwrap();
            let (verdict, out) = (run.verdict, run.frame);
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
    let mut h = default_harness();
    let (_, a) = h.egress(&tcp(POD, 50000, REMOTE, 80, SYN));
    let (_, b) = h.egress(&tcp(POD2, 50000, REMOTE, 80, SYN));
    assert_eq!((src(&a), src(&b)), (NODE, NODE));
    assert_ne!(word(&a, L4), word(&b, L4));
    let (_, back_b) = h.ingress(&tcp(REMOTE, 80, NODE, word(&b, L4), SYN | ACK));
    assert_eq!(dst(&back_b), POD2);
}

#[test]
fn without_random_fully_the_pods_port_is_kept_when_free() {
    let mut h = harness(&[(1024, 65535)], false);
    let (_, a) = h.egress(&tcp(POD, 45000, REMOTE, 80, SYN));
    assert_eq!(word(&a, L4), 45000);
    // Same port from another pod to the same server: taken, so the next one is used.
    let (_, b) = h.egress(&tcp(POD2, 45000, REMOTE, 80, SYN));
    assert_eq!(word(&b, L4), 45001);
}

#[test]
fn exhausted_ports_drop_and_count_never_mistranslate() {
    let mut h = harness(&[(5000, 5000)], true);
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

/// The node's own flows share the node's address with masqueraded ones: its sockets, and the
/// flows netfilter masquerades (kube-proxy's MASQUERADE). A port a masqueraded flow holds is
/// never handed to the node's flow with the same tuple, and the other way round: no reply ever
/// reaches the wrong flow.
#[test]
fn the_nodes_own_flows_and_masqueraded_ones_never_share_a_tuple() {
    let mut h = default_harness();
    // A pod's flow holds node port P toward REMOTE:8080.
    let (_, out) = h.egress(&tcp(POD, 40000, REMOTE, 8080, SYN));
    let held = word(&out, L4);
    // A node socket bound to P connects to REMOTE:8080: as conntrack resolves a clash, its
    // flow is given another port, and only that.
    let node_syn = tcp(NODE, held, REMOTE, 8080, SYN);
    let (verdict, left) = h.egress(&node_syn);
    assert_eq!(verdict, TC_ACT_OK);
    let other = word(&left, L4);
    assert_ne!(other, held);
    assert_frame(&left, &tcp(NODE, other, REMOTE, 8080, SYN), &[24, L4 + 16]);
    assert_eq!(h.counter(Counter::NodePortClash), 1);
    // Each reply reaches its own flow: the node socket's at P, the pod's at 40000.
    let (_, back) = h.ingress(&tcp(REMOTE, 8080, NODE, other, SYN | ACK));
    assert_frame(
        &back,
        &tcp(REMOTE, 8080, NODE, held, SYN | ACK),
        &[24, L4 + 16],
    );
    let (_, back) = h.ingress(&tcp(REMOTE, 8080, NODE, held, SYN | ACK));
    assert_frame(
        &back,
        &tcp(REMOTE, 8080, POD, 40000, SYN | ACK),
        &[24, L4 + 16],
    );
}

/// A flow netfilter masqueraded (it leaves with the node's address already) holds its port:
/// with one port to hand out, a pod's flow to the same destination gets none rather than the
/// netfilter flow's, whose replies pass on to netfilter untouched.
#[test]
fn a_port_netfilter_uses_is_never_handed_to_a_masqueraded_flow() {
    let mut h = harness(&[(5000, 5000)], true);
    let netfilters = udp(NODE, 5000, REMOTE, 53);
    assert_eq!(h.egress(&netfilters), (TC_ACT_OK, netfilters.clone()));
    let (verdict, _) = h.egress(&udp(POD, 1111, REMOTE, 53));
    assert_eq!(verdict, TC_ACT_SHOT, "no port left but netfilter's");
    assert_eq!(h.counter(Counter::DropPortsExhausted), 1);
    let reply = udp(REMOTE, 53, NODE, 5000);
    assert_eq!(
        h.ingress(&reply),
        (TC_ACT_OK, reply.clone()),
        "netfilter's reply"
    );
    // The same port toward another destination is free.
    let (verdict, out) = h.egress(&udp(POD, 1111, REMOTE2, 53));
    assert_eq!((verdict, word(&out, L4)), (TC_ACT_OK, 5000));
    let usage = expiry::usage(&h.nat());
    assert_eq!((usage.masqueraded_flows, usage.node_flows), (1, 1));
}

#[test]
fn connections_opened_from_outside_keep_the_pods_address() {
    let mut h = default_harness();
    // Stray segments open nothing: only a SYN starts a connection.
    for stray in [ACK, SYN | ACK, 0x04] {
        h.ingress(&tcp(REMOTE, 5555, POD, 8080, stray));
    }
    assert_eq!(h.counter(Counter::InboundTracked), 0);
    assert!(h.nat().is_empty());
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
fn later_fragments_without_their_first_are_dropped_not_sent_with_the_pods_address() {
    let mut h = default_harness();
    let later = frame_with_frag(POD, REMOTE, UDP, b"the middle of a datagram", 0x00b9);
    let (verdict, _) = h.egress(&later);
    assert_eq!(verdict, TC_ACT_SHOT);
    assert_eq!(h.counter(Counter::DropFragment), 1);
    // On ingress one passes untouched: it may be the node's own.
    let stray = frame_with_frag(REMOTE, NODE, UDP, b"the middle of a datagram", 0x00b9);
    assert_eq!(h.ingress(&stray), (TC_ACT_OK, stray));
}

/// A fragmented datagram out and its fragmented reply back: the first fragments are translated
/// as any packet of their flow, and the later ones, which carry no ports, take the same
/// addresses, with valid IP header checksums and their payload untouched.
#[test]
fn later_fragments_follow_their_first() {
    let mut h = default_harness();
    const MORE: u16 = 0x2000;
    let first = frame_with_frag(
        POD,
        REMOTE,
        UDP,
        &l4_segment(POD, REMOTE, UDP, 3000, 53, 0),
        MORE,
    );
    let (verdict, out) = h.egress(&first);
    assert_eq!((verdict, src(&out)), (TC_ACT_OK, NODE));
    let node_port = word(&out, L4);
    let later = frame_with_frag(POD, REMOTE, UDP, b"the rest of the datagram", 0x00b9);
    let (verdict, out) = h.egress(&later);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        diff(&later, &out),
        (24..30).collect::<Vec<_>>(),
        "checksum and source only"
    );
    assert_eq!(src(&out), NODE);
    assert_eq!(checksum(&out[14..34]), 0, "IPv4 header checksum");

    let reply_first = frame_with_frag(
        REMOTE,
        NODE,
        UDP,
        &l4_segment(REMOTE, NODE, UDP, 53, node_port, 0),
        MORE,
    );
    let (verdict, back) = h.ingress(&reply_first);
    assert_eq!(
        (verdict, dst(&back), word(&back, L4 + 2)),
        (TC_ACT_OK, POD, 3000)
    );
    let reply_later = frame_with_frag(REMOTE, NODE, UDP, b"and the rest of the reply", 0x00b9);
    let (verdict, back) = h.ingress(&reply_later);
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(dst(&back), POD);
    assert_eq!(
        diff(&reply_later, &back),
        [24, 25, 30, 31, 32, 33],
        "checksum and destination only"
    );
    assert_eq!(checksum(&back[14..34]), 0, "IPv4 header checksum");
}

#[test]
fn nothing_is_translated_before_the_agent_configures_ports() {
    let mut h = TestBed::unconfigured(16).unwrap();
    let packet = tcp(POD, 1000, REMOTE, 443, SYN);
    let (verdict, out) = h.egress(&packet);
    assert_eq!((verdict, out), (TC_ACT_OK, packet));
    assert_eq!(h.counter(Counter::NotInspected), 1);
}

#[test]
fn a_full_nat_table_drops_new_flows_and_keeps_live_ones() {
    let mut h = TestBed::new(4, &([(1024, 65535)]), true, NODE, &[]).unwrap();
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
    let mut h = default_harness();
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
    let run = |h: &mut Harness, after: Duration| sweep_after(h, after);
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
    assert_eq!(run(&mut h, Duration::from_secs(30)).expired_flows, 0);
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

/// The sweep judges IPv6 flows as it does IPv4 ones, in their own table.
#[test]
fn expiry_sweeps_the_ipv6_table_too() {
    let pod: Ipv6Addr = "fd00:10:244:1::2".parse().unwrap();
    let remote: Ipv6Addr = "2001:db8:1::10".parse().unwrap();
    let node: Ipv6Addr = "2001:db8:1::1".parse().unwrap();
    let mut h = default_harness();
    h.enable_ipv6(node, &["fd00::/8".parse().unwrap()]).unwrap();
    h.egress(&udp(pod, 2001, remote, 53));
    let (_, syn) = h.egress(&tcp(pod, 2002, remote, 443, SYN));
    let nat_port = word(&syn, L4_6);
    h.ingress(&tcp(remote, 443, node, nat_port, SYN | ACK));
    h.egress(&tcp(pod, 2002, remote, 443, ACK));
    assert_eq!(h.nat_v6().len(), 4);
    assert!(h.nat().is_empty(), "the IPv4 table holds no IPv6 flow");

    let timeouts = Timeouts::default();
    let newest = h
        .nat_v6()
        .iter()
        .map(|(_, e)| e.last_seen_ns)
        .max()
        .unwrap();
    let at = |after: Duration| newest + after.as_nanos() as u64;
    let run = expiry::expire::<[u8; 16]>(
        &h.maps.nat.v6,
        &timeouts,
        at(timeouts.udp + Duration::from_secs(1)),
    )
    .unwrap();
    assert_eq!((run.masqueraded_flows, run.expired_flows), (2, 1));
    let left: Vec<u16> = h
        .nat_v6()
        .iter()
        .filter(|(k, _)| k.direction == direction::EGRESS)
        .map(|(k, _)| u16::from_be(k.sport))
        .collect();
    assert_eq!(
        left,
        [2002],
        "the established TCP flow stays; UDP went, both halves"
    );
    assert_eq!(h.nat_v6().len(), 2);
    assert_eq!(
        expiry::forget_address::<[u8; 16]>(&h.maps.nat.v6, node.octets()).unwrap(),
        1,
        "the flow on the node's old address is forgotten"
    );
    assert!(h.nat_v6().is_empty());
}

/// The agent's sweep of the IPv4 NAT table, `idle` after the newest entry's last packet.
fn sweep_after(h: &Harness, idle: Duration) -> NatUsage {
    let newest = h.nat().iter().map(|(_, e)| e.last_seen_ns).max().unwrap();
    expiry::expire::<[u8; 4]>(
        &h.maps.nat.v4,
        &Timeouts::default(),
        newest + idle.as_nanos() as u64,
    )
    .unwrap()
}

/// One TCP connection from `POD` to `REMOTE:443` through the harness, segment by segment, with
/// sequence numbers chosen by the test.
struct Connection {
    pod_port: u16,
    node_port: u16,
}

impl Connection {
    /// Opens it with the pod's SYN (sequence `isn`, so its next is `isn + 1`).
    fn open(h: &mut Harness, pod_port: u16, isn: u32) -> Connection {
        let syn = Tcp {
            sport: pod_port,
            dport: 443,
            flags: SYN,
            seq: isn,
            payload: &[],
            ..Tcp::default()
        };
        let (verdict, out) = h.egress(&syn.frame(POD, REMOTE));
        assert_eq!((verdict, src(&out)), (TC_ACT_OK, NODE));
        Connection {
            pod_port,
            node_port: word(&out, L4),
        }
    }

    /// A segment from the pod, as it left the node.
    fn pod_sends(&self, h: &mut Harness, flags: u8, seq: u32, ack: u32, payload: &[u8]) -> Vec<u8> {
        let segment = Tcp {
            sport: self.pod_port,
            dport: 443,
            flags,
            seq,
            ack,
            payload,
        };
        let (verdict, out) = h.egress(&segment.frame(POD, REMOTE));
        assert_eq!((verdict, src(&out)), (TC_ACT_OK, NODE));
        out
    }

    /// A segment from the outside host, as the pod got it.
    fn remote_sends(
        &self,
        h: &mut Harness,
        flags: u8,
        seq: u32,
        ack: u32,
        payload: &[u8],
    ) -> Vec<u8> {
        let segment = Tcp {
            sport: 443,
            dport: self.node_port,
            flags,
            seq,
            ack,
            payload,
        };
        let (verdict, back) = h.ingress(&segment.frame(REMOTE, NODE));
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!((dst(&back), word(&back, L4 + 2)), (POD, self.pod_port));
        back
    }

    /// Whether either half of the flow took an RST.
    fn reset(&self, h: &Harness) -> bool {
        h.nat()
            .iter()
            .filter(|(k, e)| {
                (k.direction == direction::EGRESS && u16::from_be(k.sport) == self.pod_port)
                    || (k.direction == direction::INGRESS && e.port == self.pod_port.to_be())
            })
            .any(|(_, e)| e.tcp_seen & tcp_seen::RESET != 0)
    }
}

/// An RST ends a flow only when the end it is sent to would accept it (RFC 5961 §3, as
/// conntrack judges): its sequence number is the receiver's next expected one. A blind RST, out
/// of the window or in it but not exact, passes on (the pod's kernel answers or ignores it)
/// and leaves the flow's state as it was; an exact one, or one right behind the sender's own
/// data, ends it.
#[test]
fn only_an_acceptable_rst_ends_a_flow() {
    let mut h = default_harness();
    let c = Connection::open(&mut h, 40100, 1000);
    c.remote_sends(&mut h, SYN | ACK, 5000, 1001, &[]);
    c.pod_sends(&mut h, ACK, 1001, 5001, &[]);
    c.remote_sends(&mut h, ACK, 5001, 1001, &[0x61; 100]);
    c.pod_sends(&mut h, ACK, 1001, 5101, &[]);
    for (n, blind) in [
        5101 + 1_000_000,
        5100,
        5101 + 10,
        5101u32.wrapping_sub(1 << 31),
    ]
    .into_iter()
    .enumerate()
    {
        c.remote_sends(&mut h, RST, blind, 0, &[]);
        assert!(
            !c.reset(&h),
            "an RST at {blind}, expected 5101, ended the flow"
        );
        assert_eq!(h.counter(Counter::TcpRstNotAcceptable), n as u64 + 1);
    }
    c.remote_sends(&mut h, RST | ACK, 5101, 1001, &[]);
    assert!(c.reset(&h), "the exact RST ends the flow");

    // An RST right behind data the pod has not acknowledged yet follows the sender's own
    // segment: the pod takes the data, then the RST.
    let c = Connection::open(&mut h, 40101, 2000);
    c.remote_sends(&mut h, SYN | ACK, 7000, 2001, &[]);
    c.pod_sends(&mut h, ACK, 2001, 7001, &[]);
    c.remote_sends(&mut h, ACK | 0x08, 7001, 2001, &[0x62; 50]);
    c.remote_sends(&mut h, RST, 7051, 0, &[]);
    assert!(
        c.reset(&h),
        "an RST right behind the sender's data ends the flow"
    );

    // Before the pod's SYN is answered, an RST must acknowledge it.
    let c = Connection::open(&mut h, 40102, 3000);
    c.remote_sends(&mut h, RST | ACK, 0, 9999, &[]);
    assert!(!c.reset(&h), "an RST acknowledging another SYN");
    c.remote_sends(&mut h, RST | ACK, 0, 3001, &[]);
    assert!(c.reset(&h), "the refusal of the pod's SYN ends the flow");

    // The pod's own RST, at its next sequence number, ends its flow too.
    let c = Connection::open(&mut h, 40103, 4000);
    c.remote_sends(&mut h, SYN | ACK, 8000, 4001, &[]);
    c.pod_sends(&mut h, ACK, 4001, 8001, &[0x63; 10]);
    c.pod_sends(&mut h, RST, 4011, 0, &[]);
    assert!(c.reset(&h), "the pod's RST ends its flow");
    assert_eq!(h.counter(Counter::TcpRstNotAcceptable), 5);
}

/// A blind RST leaves the flow to expire as an established one, not ten seconds after it.
#[test]
fn a_flow_that_ignored_a_blind_rst_outlives_the_reset_timeout() {
    let mut h = default_harness();
    let c = Connection::open(&mut h, 40200, 1000);
    c.remote_sends(&mut h, SYN | ACK, 5000, 1001, &[]);
    c.pod_sends(&mut h, ACK, 1001, 5001, &[]);
    c.remote_sends(&mut h, RST, 5001 + 1_000_000, 0, &[]);
    let run = sweep_after(
        &h,
        Timeouts::default().tcp_transitory + Duration::from_secs(1),
    );
    assert_eq!(run.expired_flows, 0, "established: kept for hours");
    assert_eq!(h.nat().len(), 2);
}

/// Established means both directions seen: a pod's lone ACK to a host that never answers, or
/// a SYN, holds its port only for the transitory timeout.
#[test]
fn a_flow_no_reply_crossed_is_not_established() {
    let mut h = default_harness();
    h.egress(&tcp(POD, 40300, REMOTE, 443, ACK));
    h.egress(&tcp(POD, 40301, REMOTE, 443, SYN));
    let (_, answered) = h.egress(&tcp(POD, 40302, REMOTE, 443, SYN));
    h.ingress(&tcp(REMOTE, 443, NODE, word(&answered, L4), SYN | ACK));
    h.egress(&tcp(POD, 40302, REMOTE, 443, ACK));
    let unseen: Vec<u8> = h
        .nat()
        .iter()
        .filter(|(k, _)| k.direction == direction::INGRESS && k.sport == 443u16.to_be())
        .map(|(_, e)| e.tcp_seen)
        .collect();
    assert_eq!(unseen.iter().filter(|&&s| s == 0).count(), 2, "{unseen:?}");

    let run = sweep_after(
        &h,
        Timeouts::default().tcp_transitory + Duration::from_secs(1),
    );
    assert_eq!(run.expired_flows, 2, "the lone ACK's flow and the SYN's");
    let left: Vec<u16> = h
        .nat()
        .iter()
        .filter(|(k, _)| k.direction == direction::EGRESS)
        .map(|(k, _)| u16::from_be(k.sport))
        .collect();
    assert_eq!(left, [40302], "the flow a reply crossed stays");
}

#[test]
fn an_orphaned_reply_half_is_removed() {
    let mut h = default_harness();
    h.egress(&udp(POD, 3001, REMOTE, 53));
    let egress_key = h
        .nat()
        .into_iter()
        .find(|(k, _)| k.direction == direction::EGRESS)
        .unwrap()
        .0;
    let newest = h.nat()[0].1.last_seen_ns;
    h.maps.nat.v4.remove(&egress_key).unwrap();
    let timeouts = Timeouts::default();
    let run = expiry::expire::<[u8; 4]>(
        &h.maps.nat.v4,
        &timeouts,
        newest + (timeouts.orphan + Duration::from_secs(1)).as_nanos() as u64,
    )
    .unwrap();
    assert_eq!(run.orphans_removed, 1);
    assert!(h.nat().is_empty());
}

#[test]
fn a_policy_change_affects_new_flows_only() {
    let mut h = default_harness();
    // A masqueraded connection, then its destination becomes non-masquerade.
    let (_, before) = h.egress(&tcp(POD, 4001, REMOTE, 443, SYN));
    h.set_policy(&nets(&["169.254.0.0/16", "10.0.0.0/8", "203.0.113.0/24"]))
        .unwrap();
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
    h.set_policy(&nets(&["169.254.0.0/16", "10.0.0.0/8", "198.51.100.0/24"]))
        .unwrap();
    assert_eq!(h.egress(&established).1, established);
    h.set_policy(&nets(&["169.254.0.0/16", "10.0.0.0/8"]))
        .unwrap();
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
    h.set_policy(&nets(&["169.254.0.0/16", "10.0.0.0/8", "198.51.100.0/24"]))
        .unwrap();
    let keys: Vec<(u32, [u8; 4])> = h
        .maps
        .policy
        .v4
        .draining
        .keys()
        .map(|k| k.map(|k| (k.prefix_len(), k.data())).unwrap())
        .collect();
    assert_eq!(
        keys,
        [(24, [203, 0, 113, 0])],
        "only the prefix still out of the policy drains"
    );
}

#[test]
fn the_sweep_reads_and_prunes_a_large_table_in_batches() {
    let mut h = TestBed::new(
        16_384,
        &([(1024, 65535)]),
        true,
        NODE,
        &nets(&["10.0.0.0/8"]),
    )
    .unwrap();
    // More entries than one batch call carries, so the kernel's cursor is followed.
    let keys: Vec<_> = (0..10_000u32)
        .map(|i| {
            let [a, b, c, d] = i.to_be_bytes();
            masq_ebpf::NatKeyV4 {
                saddr: [10, a, b, c],
                daddr: [203, 0, 113, d],
                sport: 1000,
                dport: 80,
                proto: 6,
                direction: direction::INGRESS,
                _pad: [0; 2],
            }
        })
        .collect();
    {
        let nat = &mut h.maps.nat.v4;
        for key in &keys {
            nat.insert(key, masq_ebpf::NatEntryV4::default(), 0)
                .unwrap();
        }
    }
    let read: Vec<(masq_ebpf::NatKeyV4, masq_ebpf::NatEntryV4)> =
        batch::lookup_all(h.maps.nat.v4.map()).unwrap();
    assert_eq!(read.len(), keys.len());
    let mut read_keys: Vec<_> = read.iter().map(|(k, _)| *k).collect();
    read_keys.sort_by_key(|k| (k.saddr, k.daddr));
    assert!(read_keys == keys, "every key read back, once");

    // Half the keys, with some already gone in between: those are skipped, not fatal.
    let mut doomed: Vec<_> = keys[..5_000].to_vec();
    doomed.insert(100, keys[9_999]);
    h.maps.nat.v4.remove(&keys[9_999]).unwrap();
    doomed.insert(4_000, keys[9_999]);
    let deleted = batch::delete_all(h.maps.nat.v4.map(), &doomed).unwrap();
    assert_eq!(deleted, 5_000);
    assert_eq!(h.nat().len(), keys.len() - 5_001);
}

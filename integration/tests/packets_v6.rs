//! IPv6 packet tests of the real object through BPF_PROG_TEST_RUN, in the style of `tests`:
//! crafted frames in, and every output compared byte for byte with the frame the translation
//! should produce, built from scratch (checksums included) by the test bed's packet code, which
//! shares nothing with the programs' incremental checksum updates. Each test also lists the
//! bytes a translation may touch, and verifies the checksums it can from scratch over the IPv6
//! pseudo-header.

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    ops::Range,
};

use ipnet::{Ipv4Net, Ipv6Net};
use masq_ebpf::{Counter, NatEntry, NatKey, direction, nat_kind};
use masq_testbed::packet::*;

use masq_agent::dataplane::ebpf::testbed::{Answered, TC_ACT_OK, TC_ACT_SHOT, TestBed};

const NODE_V4: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
const NODE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 1);
const POD6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 2);
const POD6_2: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 2, 0, 0, 0, 2);
const REMOTE6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x10);
/// A server in another prefix, for policy changes that must not touch `REMOTE6`.
const REMOTE6_2: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 0x10);
const ROUTER6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0xfe);
/// A service address inside fd00::/8, a non-masquerade prefix.
const SERVICE6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 1);
const NODE_LL: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
const ROUTER_LL: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0xfe);
const HOST_LL: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0x200, 0xff, 0xfe00, 2);
const ALL_NODES: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
const ALL_ROUTERS: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 2);
const ALL_MLDV2_ROUTERS: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 0x16);

const SPANS: [(u16, u16); 2] = [(1024, 32767), (61000, 65535)];

fn nets6(list: &[&str]) -> Vec<Ipv6Net> {
    list.iter().map(|s| s.parse().unwrap()).collect()
}

/// The policy of these tests: the pods' ULA and link-local addresses are not masqueraded.
const POLICY: [&str; 2] = ["fd00::/8", "fe80::/10"];

/// The real object with fresh maps, IPv4 configured as the agent would, and IPv6 enabled.
fn harness() -> TestBed {
    let mut bed = bare_harness();
    bed.enable_ipv6(NODE6, &nets6(&POLICY)).unwrap();
    bed
}

/// The same without `enable_ipv6`: the agent runs without `--enable-ipv6`.
fn bare_harness() -> TestBed {
    let v4: Vec<Ipv4Net> = vec!["10.0.0.0/8".parse().unwrap()];
    TestBed::new(1024, &SPANS, true, NODE_V4, &v4).unwrap()
}

fn in_spans(port: u16) -> bool {
    SPANS.iter().any(|&(a, b)| (a..=b).contains(&port))
}

fn key6(
    saddr: Ipv6Addr,
    daddr: Ipv6Addr,
    proto: u8,
    sport: u16,
    dport: u16,
    dir: u8,
) -> NatKey<[u8; 16]> {
    NatKey {
        saddr: saddr.octets(),
        daddr: daddr.octets(),
        sport: sport.to_be(),
        dport: dport.to_be(),
        proto,
        direction: dir,
        _pad: [0; 2],
    }
}

/// The entry under `key`: an SNAT entry to (`addr`, `port`).
fn assert_snat_entry(h: &TestBed, key: &NatKey<[u8; 16]>, addr: Ipv6Addr, port: u16) {
    let entry: NatEntry<[u8; 16]> = h
        .nat_entry(key)
        .unwrap_or_else(|| panic!("no NAT entry for {key:?}"));
    assert_eq!(Ipv6Addr::from(entry.addr), addr, "{key:?}");
    assert_eq!(u16::from_be(entry.port), port, "{key:?}");
    assert_eq!(entry.kind, nat_kind::SNAT, "{key:?}");
    assert!(entry.last_seen_ns > 0, "{key:?}");
}

/// The source address, source port and TCP or UDP checksum of a frame whose upper layer starts
/// at `l4`: what an egress translation may change.
fn egress_fields(l4: usize, proto: u8) -> [Range<usize>; 3] {
    let csum = l4 + l4_checksum_offset(proto);
    [range(SRC6, 16), range(l4, 2), range(csum, 2)]
}

/// The destination address, destination port and checksum: what an ingress translation may
/// change.
fn ingress_fields(l4: usize, proto: u8) -> [Range<usize>; 3] {
    let csum = l4 + l4_checksum_offset(proto);
    [range(DST6, 16), range(l4 + 2, 2), range(csum, 2)]
}

// ---- a. TCP ---------------------------------------------------------------------------------

#[test]
fn v6_tcp_syn_egress_then_syn_ack_ingress() {
    let mut h = harness();
    let syn = tcp(POD6, 40000, REMOTE6, 80, SYN);
    assert!(checksums_ok::<Ipv6Addr>(&syn));
    let (verdict, out) = h.egress(&syn);
    assert_eq!(verdict, TC_ACT_OK);
    let port = word(&out, L4_6);
    assert!(in_spans(port), "NAT port {port} outside the spans");
    assert_changed_within(&syn, &out, &egress_fields(L4_6, TCP));
    assert_frame(&out, &tcp(NODE6, port, REMOTE6, 80, SYN), &[L4_6 + 16]);
    assert!(
        checksums_ok::<Ipv6Addr>(&out),
        "TCP checksum over the new pseudo-header"
    );

    // Later packets of the flow keep the translation.
    let ack = tcp(POD6, 40000, REMOTE6, 80, ACK);
    let (verdict, out) = h.egress(&ack);
    assert_eq!(verdict, TC_ACT_OK);
    assert_frame(&out, &tcp(NODE6, port, REMOTE6, 80, ACK), &[L4_6 + 16]);

    let reply = tcp(REMOTE6, 80, NODE6, port, SYN | ACK);
    let (verdict, back) = h.ingress(&reply);
    assert_eq!(verdict, TC_ACT_OK);
    assert_changed_within(&reply, &back, &ingress_fields(L4_6, TCP));
    assert_frame(
        &back,
        &tcp(REMOTE6, 80, POD6, 40000, SYN | ACK),
        &[L4_6 + 16],
    );
    assert!(checksums_ok::<Ipv6Addr>(&back));

    assert_eq!(h.counter(Counter::Masqueraded), 2);
    assert_eq!(h.counter(Counter::ReverseTranslated), 1);
    let nat = h.nat_v6();
    assert_eq!(nat.len(), 2, "one entry per direction: {nat:?}");
    let egress_key = key6(POD6, REMOTE6, TCP, 40000, 80, direction::EGRESS);
    assert_snat_entry(&h, &egress_key, NODE6, port);
    let ingress_key = key6(REMOTE6, NODE6, TCP, 80, port, direction::INGRESS);
    assert_snat_entry(&h, &ingress_key, POD6, 40000);
    let egress = h.nat_entry(&egress_key).unwrap();
    assert_ne!(egress.tcp_seen, 0, "TCP progress recorded");
    assert!(h.nat().is_empty(), "nothing in the IPv4 table");
}

// ---- b. UDP ---------------------------------------------------------------------------------

#[test]
fn v6_udp_both_ways_and_two_pods_with_one_port_get_different_nat_ports() {
    let mut h = harness();
    let mut ports = Vec::new();
    for pod in [POD6, POD6_2] {
        let dgram = udp(pod, 5353, REMOTE6, 53);
        let (verdict, out) = h.egress(&dgram);
        assert_eq!(verdict, TC_ACT_OK);
        let port = word(&out, L4_6);
        assert!(in_spans(port), "{port}");
        assert_changed_within(&dgram, &out, &egress_fields(L4_6, UDP));
        assert_frame(&out, &udp(NODE6, port, REMOTE6, 53), &[L4_6 + 6]);
        assert!(checksums_ok::<Ipv6Addr>(&out));
        ports.push(port);
    }
    assert_ne!(ports[0], ports[1], "one NAT port for two flows");

    // The second pod's reply first, then the first's: each goes back to its own pod.
    for (pod, port) in [(POD6_2, ports[1]), (POD6, ports[0])] {
        let reply = udp(REMOTE6, 53, NODE6, port);
        let (verdict, back) = h.ingress(&reply);
        assert_eq!(verdict, TC_ACT_OK);
        assert_changed_within(&reply, &back, &ingress_fields(L4_6, UDP));
        assert_frame(&back, &udp(REMOTE6, 53, pod, 5353), &[L4_6 + 6]);
        assert!(checksums_ok::<Ipv6Addr>(&back));
        let key = key6(REMOTE6, NODE6, UDP, 53, port, direction::INGRESS);
        assert_snat_entry(&h, &key, pod, 5353);
    }
    assert_eq!(h.nat_v6().len(), 4);
    assert_eq!(h.counter(Counter::Masqueraded), 2);
    assert_eq!(h.counter(Counter::ReverseTranslated), 2);
}

// ---- c. ICMPv6 echo -------------------------------------------------------------------------

#[test]
fn v6_echo_request_gets_an_identifier_and_its_reply_is_restored() {
    let mut h = harness();
    let request = ping(POD6, REMOTE6, ICMPV6_ECHO_REQUEST, 0x4242);
    assert!(checksums_ok::<Ipv6Addr>(&request));
    let (verdict, out) = h.egress(&request);
    assert_eq!(verdict, TC_ACT_OK);
    let id = word(&out, L4_6 + 4);
    assert!(in_spans(id), "identifier {id}");
    // The source, the checksum and the identifier; type, code and sequence stay.
    assert_changed_within(&request, &out, &[range(SRC6, 16), range(L4_6 + 2, 4)]);
    // The checksum covers the pseudo-header: a from-scratch ICMPv6 checksum over the new source.
    assert_frame(
        &out,
        &ping(NODE6, REMOTE6, ICMPV6_ECHO_REQUEST, id),
        &[L4_6 + 2],
    );
    assert!(checksums_ok::<Ipv6Addr>(&out));
    let egress_key = key6(POD6, REMOTE6, ICMPV6, 0x4242, 0, direction::EGRESS);
    assert_snat_entry(&h, &egress_key, NODE6, id);
    let ingress_key = key6(REMOTE6, NODE6, ICMPV6, 0, id, direction::INGRESS);
    assert_snat_entry(&h, &ingress_key, POD6, 0x4242);

    let reply = ping(REMOTE6, NODE6, ICMPV6_ECHO_REPLY, id);
    let (verdict, back) = h.ingress(&reply);
    assert_eq!(verdict, TC_ACT_OK);
    assert_changed_within(&reply, &back, &[range(DST6, 16), range(L4_6 + 2, 4)]);
    assert_frame(
        &back,
        &ping(REMOTE6, POD6, ICMPV6_ECHO_REPLY, 0x4242),
        &[L4_6 + 2],
    );
    assert!(checksums_ok::<Ipv6Addr>(&back));
    assert_eq!(h.counter(Counter::ReverseTranslated), 1);
}

// ---- d. ICMPv6 errors -----------------------------------------------------------------------

/// An ICMPv6 error from `ROUTER6` to `to`, quoting the first `quote_len` bytes of the IPv6
/// packet in `quoted` (a frame).
fn icmp6_error(
    kind: u8,
    code: u8,
    rest: [u8; 4],
    to: Ipv6Addr,
    quoted: &[u8],
    quote_len: usize,
) -> Vec<u8> {
    icmp_frame(ROUTER6, to, kind, code, rest, &quoted[IP..IP + quote_len])
}

const MTU_1280: [u8; 4] = [0, 0, 0x05, 0x00];

/// One case of `v6_icmp_errors_about_masqueraded_flows_are_translated_inside_and_out`.
struct ErrorCase {
    what: &'static str,
    kind: u8,
    code: u8,
    rest: [u8; 4],
    /// The packet as the pod sent it, and as it left the node.
    sent: Vec<u8>,
    left: Vec<u8>,
    quote_len: usize,
    /// Whether the quote holds the whole upper layer, so that its checksum verifies.
    whole: bool,
}

#[test]
fn v6_icmp_errors_about_masqueraded_flows_are_translated_inside_and_out() {
    let mut h = harness();
    let mut flow = |sent: Vec<u8>| {
        let (verdict, left) = h.egress(&sent);
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(src6(&left), NODE6);
        (sent, left)
    };
    let (tcp_sent, tcp_left) = flow(tcp(POD6, 40001, REMOTE6, 443, SYN));
    let (udp_sent, udp_left) = flow(udp(POD6, 40002, REMOTE6_2, 53));
    let (ping_sent, ping_left) = flow(ping(POD6, REMOTE6, ICMPV6_ECHO_REQUEST, 7));
    // A big segment, of which a packet-too-big quotes only what fits in 1280 bytes.
    let big_payload = vec![0x5a; 1400];
    let big_segment = |src: Ipv6Addr, port: u16| {
        let mut seg = l4_segment(src, REMOTE6, TCP, port, 443, ACK)[..20].to_vec();
        seg.extend(&big_payload);
        fill_checksum(src, REMOTE6, TCP, &mut seg);
        frame(src, REMOTE6, TCP, &seg)
    };
    let (big_sent, big_left) = flow(big_segment(POD6, 40003));
    assert_frame(
        &big_left,
        &big_segment(NODE6, word(&big_left, L4_6)),
        &[L4_6 + 16],
    );
    // A segment behind a destination options header: the quote's chain is walked too.
    let with_opts = |f: Vec<u8>| insert_ext6(&f, &[ExtHeader::destination_options(1)]);
    let (opts_sent, opts_left) = flow(with_opts(tcp(POD6, 40004, REMOTE6, 443, SYN)));
    assert_eq!(l4_offset6(&opts_left), Some(L4_6 + 16));

    let whole = |f: &[u8]| f.len() - IP;
    let cases = [
        ErrorCase {
            what: "packet too big, quoting the whole TCP SYN",
            kind: ICMPV6_PACKET_TOO_BIG,
            code: 0,
            rest: MTU_1280,
            quote_len: whole(&tcp_left),
            whole: true,
            sent: tcp_sent.clone(),
            left: tcp_left.clone(),
        },
        ErrorCase {
            what: "destination unreachable (port), quoting the whole UDP datagram",
            kind: ICMPV6_DEST_UNREACH,
            code: 4,
            rest: [0; 4],
            quote_len: whole(&udp_left),
            whole: true,
            sent: udp_sent.clone(),
            left: udp_left.clone(),
        },
        ErrorCase {
            what: "time exceeded, quoting the whole echo request",
            kind: ICMPV6_TIME_EXCEEDED,
            code: 0,
            rest: [0; 4],
            quote_len: whole(&ping_left),
            whole: true,
            sent: ping_sent.clone(),
            left: ping_left.clone(),
        },
        ErrorCase {
            what: "destination unreachable (address), quoting 8 bytes of TCP: no checksum",
            kind: ICMPV6_DEST_UNREACH,
            code: 3,
            rest: [0; 4],
            quote_len: 48,
            whole: false,
            sent: tcp_sent.clone(),
            left: tcp_left.clone(),
        },
        ErrorCase {
            what: "time exceeded, quoting the UDP header alone, checksum included",
            kind: ICMPV6_TIME_EXCEEDED,
            code: 1,
            rest: [0; 4],
            quote_len: 48,
            whole: false,
            sent: udp_sent.clone(),
            left: udp_left.clone(),
        },
        ErrorCase {
            what: "time exceeded, quoting 8 bytes of the echo request",
            kind: ICMPV6_TIME_EXCEEDED,
            code: 0,
            rest: [0; 4],
            quote_len: 48,
            whole: false,
            sent: ping_sent.clone(),
            left: ping_left.clone(),
        },
        ErrorCase {
            what: "packet too big, quoting the first 1232 bytes of a 1460-byte packet",
            kind: ICMPV6_PACKET_TOO_BIG,
            code: 0,
            rest: MTU_1280,
            quote_len: 1280 - 48,
            whole: false,
            sent: big_sent.clone(),
            left: big_left.clone(),
        },
        ErrorCase {
            what: "parameter problem, quoting a TCP SYN behind destination options",
            kind: ICMPV6_PARAMETER_PROBLEM,
            code: 1,
            rest: [0, 0, 0, 40],
            quote_len: whole(&opts_left),
            whole: true,
            sent: opts_sent.clone(),
            left: opts_left.clone(),
        },
    ];
    for (n, case) in cases.iter().enumerate() {
        let what = case.what;
        let error = icmp6_error(
            case.kind,
            case.code,
            case.rest,
            NODE6,
            &case.left,
            case.quote_len,
        );
        assert!(
            checksums_ok::<Ipv6Addr>(&error),
            "{what}: the error as built"
        );
        let (verdict, back) = h.ingress(&error);
        assert_eq!(verdict, TC_ACT_OK, "{what}");
        assert_eq!(
            h.counter(Counter::IcmpErrorTranslated),
            n as u64 + 1,
            "{what}"
        );

        // What the pod should see: the same error, to the pod, about the packet as it sent it.
        let expected = icmp6_error(
            case.kind,
            case.code,
            case.rest,
            POD6,
            &case.sent,
            case.quote_len,
        );
        let inner = L4_6 + 8;
        let quote = headers6_at(&back, inner).expect("the quote parses");
        let quoted_csum = quote.l4 + l4_checksum_offset(quote.proto);
        let quoted_word = if quote.proto == ICMPV6 {
            quote.l4 + 4
        } else {
            quote.l4
        };
        assert_changed_within(
            &error,
            &back,
            &[
                range(DST6, 16),
                range(L4_6 + 2, 2),
                range(inner + 8, 16),
                range(quoted_word, 2),
                range(quoted_csum, 2),
            ],
        );
        let csums: Vec<usize> = [L4_6 + 2, quoted_csum]
            .into_iter()
            .filter(|&c| c + 2 <= back.len())
            .collect();
        assert_frame(&back, &expected, &csums);
        assert_eq!(dst6(&back), POD6, "{what}: outer destination");
        assert_eq!(quote.src, POD6, "{what}: quoted source");
        assert!(
            checksums_ok::<Ipv6Addr>(&back),
            "{what}: outer ICMPv6 checksum"
        );
        assert_eq!(
            &back[L4_6 + 4..L4_6 + 8],
            case.rest,
            "{what}: MTU or pointer"
        );
        if case.whole {
            assert!(
                segment_checksum_ok(&back, &quote.packet()),
                "{what}: quoted L4 checksum"
            );
        }
    }

    // An error about a flow the node never translated passes untouched.
    let stray = tcp(NODE6, 33333, REMOTE6, 443, SYN);
    let error = icmp6_error(ICMPV6_DEST_UNREACH, 4, [0; 4], NODE6, &stray, 48);
    assert_eq!(h.ingress(&error), (TC_ACT_OK, error));
    // So does one about a translated flow's packet that is not addressed to the quoted source.
    let misaddressed = icmp6_error(
        ICMPV6_PACKET_TOO_BIG,
        0,
        MTU_1280,
        REMOTE6_2,
        &tcp_left,
        whole(&tcp_left),
    );
    assert_eq!(h.ingress(&misaddressed), (TC_ACT_OK, misaddressed));
    assert_eq!(h.counter(Counter::IcmpErrorTranslated), cases.len() as u64);
}

/// An ICMPv6 error from `from` to `to`, quoting the first `quote_len` bytes of the IPv6 packet
/// in `quoted` (a frame).
fn icmp6_error_from(
    (from, to): (Ipv6Addr, Ipv6Addr),
    (kind, code, rest): (u8, u8, [u8; 4]),
    quoted: &[u8],
    quote_len: usize,
) -> Vec<u8> {
    icmp_frame(from, to, kind, code, rest, &quoted[IP..IP + quote_len])
}

/// A pods' gateway on the node: a source a node's error may take.
const POD_GATEWAY6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 1);

/// ICMPv6 errors leaving the node about replies it restored to a pod, as conntrack translates
/// a RELATED error: the quoted packet becomes the reply as it arrived (to the node's address
/// and NAT port) and the outer source the node's address, with the ICMPv6 checksum over the new
/// pseudo-header. Each is compared with the frame the outside host must receive, built from
/// scratch.
#[test]
fn v6_egress_icmp_errors_about_masqueraded_flows_are_translated_as_conntrack_does() {
    let mut h = harness();
    let tcp_flow = h.answered(&tcp(POD6, 40001, REMOTE6, 443, SYN), |left| {
        tcp(REMOTE6, 443, NODE6, word(left, L4_6), SYN | ACK)
    });
    let udp_flow = h.answered(&udp(POD6, 40002, REMOTE6_2, 53), |left| {
        udp(REMOTE6_2, 53, NODE6, word(left, L4_6))
    });
    let echo_flow = h.answered(&ping(POD6, REMOTE6, ICMPV6_ECHO_REQUEST, 0x4242), |left| {
        ping(REMOTE6, NODE6, ICMPV6_ECHO_REPLY, word(left, L4_6 + 4))
    });
    let whole = |f: &Answered| f.restored.len() - IP;
    let cases = [
        (
            "the node's packet too big about a TCP reply, quoted whole",
            NODE6,
            (ICMPV6_PACKET_TOO_BIG, 0, MTU_1280),
            &tcp_flow,
            whole(&tcp_flow),
        ),
        (
            "the node's time exceeded from the pods' gateway, 8 bytes of TCP quoted",
            POD_GATEWAY6,
            (ICMPV6_TIME_EXCEEDED, 0, [0; 4]),
            &tcp_flow,
            48,
        ),
        (
            "the pod's port unreachable about a UDP reply, quoted whole",
            POD6,
            (ICMPV6_DEST_UNREACH, 4, [0; 4]),
            &udp_flow,
            whole(&udp_flow),
        ),
        (
            "the pod's parameter problem about an echo reply, quoted whole",
            POD6,
            (ICMPV6_PARAMETER_PROBLEM, 0, [0, 0, 0, 6]),
            &echo_flow,
            whole(&echo_flow),
        ),
    ];
    for (n, (what, from, kind, flow, quote_len)) in cases.into_iter().enumerate() {
        let error = icmp6_error_from((from, src6(&flow.arrived)), kind, &flow.restored, quote_len);
        assert!(
            checksums_ok::<Ipv6Addr>(&error),
            "{what}: the error as built"
        );
        let (verdict, out) = h.egress(&error);
        assert_eq!(verdict, TC_ACT_OK, "{what}");
        let expected =
            icmp6_error_from((NODE6, src6(&flow.arrived)), kind, &flow.arrived, quote_len);
        let quote = headers6_at(&out, L4_6 + 8).expect("the quote parses");
        let quoted_csum = quote.l4 + l4_checksum_offset(quote.proto);
        let csums: Vec<usize> = [L4_6 + 2, quoted_csum]
            .into_iter()
            .filter(|&c| c + 2 <= out.len())
            .collect();
        assert_frame(&out, &expected, &csums);
        assert!(
            checksums_ok::<Ipv6Addr>(&out),
            "{what}: ICMPv6 checksum from scratch"
        );
        assert_eq!(quote.dst, NODE6, "{what}: quoted destination");
        if quote_len == whole(flow) {
            assert!(
                segment_checksum_ok(&out, &quote.packet()),
                "{what}: quoted checksum"
            );
        }
        assert_eq!(
            h.counter(Counter::IcmpErrorMasqueraded),
            n as u64 + 1,
            "{what}"
        );
    }

    // Errors about no masqueraded flow, or to another host than the quoted source, pass.
    let never_seen = udp(REMOTE6, 53, POD6, 40011);
    let unknown = icmp6_error_from(
        (POD6, REMOTE6),
        (ICMPV6_DEST_UNREACH, 4, [0; 4]),
        &never_seen,
        48,
    );
    let misaddressed = icmp6_error_from(
        (POD6, REMOTE6),
        (ICMPV6_DEST_UNREACH, 4, [0; 4]),
        &udp_flow.restored,
        whole(&udp_flow),
    );
    for error in [unknown, misaddressed] {
        assert_eq!(h.egress(&error), (TC_ACT_OK, error));
    }
    assert_eq!(h.counter(Counter::IcmpErrorMasqueraded), cases.len() as u64);
    assert_eq!(h.counter(Counter::NotMasqIcmpOther), 2);
}

// ---- e. neighbour discovery and MLD ---------------------------------------------------------

/// A link-layer address option (RFC 4861 §4.6.1): source (1) or target (2).
fn lla_option(kind: u8, mac: [u8; 6]) -> Vec<u8> {
    [vec![kind, 1], mac.to_vec()].concat()
}

/// The solicited-node multicast address of `addr` (RFC 4291 §2.7.1).
fn solicited_node(addr: Ipv6Addr) -> Ipv6Addr {
    let o = addr.octets();
    Ipv6Addr::from([
        0xff, 0x02, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0xff, o[13], o[14], o[15],
    ])
}

/// Neighbour discovery (hop limit 255) and MLD (hop limit 1, behind a hop-by-hop router alert)
/// messages, with link-local, unspecified, multicast and global addresses.
fn nd_and_mld() -> Vec<(&'static str, Vec<u8>)> {
    let mac = [0x02, 0, 0, 0, 0, 2];
    let nd = |src, dst, kind, rest, body: Vec<u8>| {
        with_hop_limit6(&icmp_frame(src, dst, kind, 0, rest, &body), 255)
    };
    let target = |addr: Ipv6Addr, option: Vec<u8>| [addr.octets().to_vec(), option].concat();
    let mut prefix_info = vec![3, 4, 64, 0xc0];
    prefix_info.extend(86_400u32.to_be_bytes());
    prefix_info.extend(14_400u32.to_be_bytes());
    prefix_info.extend([0; 4]);
    prefix_info.extend(Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0).octets());
    let ra_body = [vec![0; 8], lla_option(1, mac), prefix_info].concat();
    let mld = |src, dst, kind, rest, body: Vec<u8>| {
        let f = icmp_frame(src, dst, kind, 0, rest, &body);
        with_hop_limit6(&insert_ext6(&f, &[ExtHeader::router_alert()]), 1)
    };
    let group = solicited_node(NODE6);
    let mut mld2_record = vec![4, 0, 0, 0];
    mld2_record.extend(group.octets());
    vec![
        (
            "router solicitation",
            nd(
                HOST_LL,
                ALL_ROUTERS,
                ND_ROUTER_SOLICIT,
                [0; 4],
                lla_option(1, mac),
            ),
        ),
        (
            "router advertisement",
            nd(
                ROUTER_LL,
                ALL_NODES,
                ND_ROUTER_ADVERT,
                [64, 0, 0x07, 0x08],
                ra_body,
            ),
        ),
        (
            "neighbour solicitation, link-local",
            nd(
                NODE_LL,
                solicited_node(ROUTER_LL),
                ND_NEIGHBOR_SOLICIT,
                [0; 4],
                target(ROUTER_LL, lla_option(1, mac)),
            ),
        ),
        (
            "neighbour solicitation, global",
            nd(
                NODE6,
                solicited_node(REMOTE6),
                ND_NEIGHBOR_SOLICIT,
                [0; 4],
                target(REMOTE6, lla_option(1, mac)),
            ),
        ),
        (
            "neighbour solicitation, duplicate address detection",
            nd(
                Ipv6Addr::UNSPECIFIED,
                solicited_node(NODE6),
                ND_NEIGHBOR_SOLICIT,
                [0; 4],
                target(NODE6, vec![]),
            ),
        ),
        (
            "neighbour advertisement, solicited",
            nd(
                ROUTER_LL,
                NODE_LL,
                ND_NEIGHBOR_ADVERT,
                [0xe0, 0, 0, 0],
                target(ROUTER_LL, lla_option(2, mac)),
            ),
        ),
        (
            "neighbour advertisement, global, to a global address",
            nd(
                REMOTE6,
                NODE6,
                ND_NEIGHBOR_ADVERT,
                [0x60, 0, 0, 0],
                target(REMOTE6, lla_option(2, mac)),
            ),
        ),
        (
            "neighbour advertisement, unsolicited",
            nd(
                HOST_LL,
                ALL_NODES,
                ND_NEIGHBOR_ADVERT,
                [0x20, 0, 0, 0],
                target(HOST_LL, lla_option(2, mac)),
            ),
        ),
        (
            "MLD query",
            mld(
                ROUTER_LL,
                ALL_NODES,
                MLD_QUERY,
                [0x27, 0x10, 0, 0],
                Ipv6Addr::UNSPECIFIED.octets().to_vec(),
            ),
        ),
        (
            "MLDv1 report",
            mld(NODE_LL, group, MLD_REPORT, [0; 4], group.octets().to_vec()),
        ),
        (
            "MLDv1 done",
            mld(
                NODE_LL,
                ALL_ROUTERS,
                MLD_DONE,
                [0; 4],
                group.octets().to_vec(),
            ),
        ),
        (
            "MLDv2 report",
            mld(
                NODE_LL,
                ALL_MLDV2_ROUTERS,
                MLD2_REPORT,
                [0, 0, 0, 1],
                mld2_record,
            ),
        ),
    ]
}

#[test]
fn v6_neighbour_discovery_and_mld_pass_untouched_both_ways() {
    let mut h = harness();
    // A live flow, so that the programs have NAT state to (not) apply.
    h.egress(&tcp(POD6, 40000, REMOTE6, 80, SYN));
    let messages = nd_and_mld();
    for (what, packet) in &messages {
        assert!(checksums_ok::<Ipv6Addr>(packet), "{what}: as built");
        let before = h.counter(Counter::NotMasqIcmpOther);
        assert_eq!(
            h.egress(packet),
            (TC_ACT_OK, packet.clone()),
            "{what}: egress"
        );
        assert_eq!(
            h.counter(Counter::NotMasqIcmpOther),
            before + 1,
            "{what}: counted as other ICMPv6"
        );
        assert_eq!(
            h.ingress(packet),
            (TC_ACT_OK, packet.clone()),
            "{what}: ingress"
        );
    }
    assert_eq!(h.nat_v6().len(), 2, "only the TCP flow's entries");
    assert_eq!(h.counter(Counter::ReverseTranslated), 0);
    assert_eq!(h.counter(Counter::IcmpErrorTranslated), 0);
    assert_eq!(h.counter(Counter::InboundTracked), 0);
}

// ---- f. policy ------------------------------------------------------------------------------

#[test]
fn v6_non_masquerade_destinations_and_the_nodes_own_traffic_pass_untouched() {
    let mut h = harness();
    let link_local = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0x42);
    for (what, packet, counter) in [
        (
            "TCP to a service in fd00::/8",
            tcp(POD6, 1000, SERVICE6, 443, SYN),
            Counter::NotMasqNonMasqDestination,
        ),
        (
            "UDP to a pod in fd00::/8",
            udp(POD6, 1000, POD6_2, 53),
            Counter::NotMasqNonMasqDestination,
        ),
        (
            "ping to a pod in fd00::/8",
            ping(POD6, POD6_2, ICMPV6_ECHO_REQUEST, 5),
            Counter::NotMasqNonMasqDestination,
        ),
        (
            "UDP to a link-local address",
            udp(POD6, 1000, link_local, 53),
            Counter::NotMasqNonMasqDestination,
        ),
        (
            "TCP from the node",
            tcp(NODE6, 1000, REMOTE6, 443, SYN),
            Counter::NotMasqNodeSource,
        ),
        (
            "UDP from the node",
            udp(NODE6, 1000, REMOTE6, 53),
            Counter::NotMasqNodeSource,
        ),
        (
            "ping from the node",
            ping(NODE6, REMOTE6, ICMPV6_ECHO_REQUEST, 5),
            Counter::NotMasqNodeSource,
        ),
        (
            "GRE, left to the chain",
            frame(POD6, REMOTE6, 47, b"GRE payload, left to the chain"),
            Counter::NotMasqOtherProtocol,
        ),
        (
            "an echo reply",
            ping(POD6, REMOTE6, ICMPV6_ECHO_REPLY, 5),
            Counter::NotMasqIcmpOther,
        ),
    ] {
        let before = h.counter(counter);
        assert_eq!(h.egress(&packet), (TC_ACT_OK, packet.clone()), "{what}");
        assert_eq!(h.counter(counter), before + 1, "{what}: {counter:?}");
    }
    // Only the node's three flows are remembered, as its own that nothing translates.
    let nat = h.nat_v6();
    assert_eq!(nat.len(), 6, "{nat:?}");
    assert!(nat.iter().all(|(_, e)| e.kind == nat_kind::NODE), "{nat:?}");
    assert_eq!(h.counter(Counter::Masqueraded), 0);
}

#[test]
fn v6_a_policy_change_affects_new_flows_only() {
    let mut h = harness();
    // A masqueraded connection, then its destination becomes non-masquerade.
    let (_, before) = h.egress(&tcp(POD6, 4001, REMOTE6, 443, SYN));
    let port = word(&before, L4_6);
    assert_eq!(src6(&before), NODE6);
    h.set_policy_v6(&nets6(&["fd00::/8", "fe80::/10", "2001:db8:1::/64"]))
        .unwrap();
    let ack = tcp(POD6, 4001, REMOTE6, 443, ACK);
    let (verdict, after) = h.egress(&ack);
    assert_eq!(verdict, TC_ACT_OK);
    assert_frame(&after, &tcp(NODE6, port, REMOTE6, 443, ACK), &[L4_6 + 16]);
    let reply = tcp(REMOTE6, 443, NODE6, port, ACK);
    let (_, back) = h.ingress(&reply);
    assert_frame(&back, &tcp(REMOTE6, 443, POD6, 4001, ACK), &[L4_6 + 16]);
    let fresh = tcp(POD6, 4002, REMOTE6, 443, SYN);
    assert_eq!(
        h.egress(&fresh),
        (TC_ACT_OK, fresh),
        "a new connection is not masqueraded"
    );
    let fresh_udp = udp(POD6, 4002, REMOTE6, 53);
    assert_eq!(h.egress(&fresh_udp), (TC_ACT_OK, fresh_udp));

    // An unmasqueraded connection, then its destination leaves the non-masquerade prefixes.
    let established = tcp(POD6, 4003, REMOTE6_2, 443, ACK);
    h.set_policy_v6(&nets6(&["fd00::/8", "fe80::/10", "2001:db8:2::/64"]))
        .unwrap();
    assert_eq!(h.egress(&established), (TC_ACT_OK, established.clone()));
    h.set_policy_v6(&nets6(&POLICY)).unwrap();
    let inbound = h.counter(Counter::NotMasqInbound);
    assert_eq!(
        h.egress(&established),
        (TC_ACT_OK, established.clone()),
        "stays unmasqueraded while its prefix drains"
    );
    assert_eq!(h.counter(Counter::NotMasqInbound), inbound + 1);
    let fin = tcp(POD6, 4003, REMOTE6_2, 443, ACK | 0x01);
    assert_eq!(h.egress(&fin), (TC_ACT_OK, fin), "through to its FIN");
    let (verdict, new) = h.egress(&tcp(POD6, 4004, REMOTE6_2, 443, SYN));
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(src6(&new), NODE6, "a new connection is masqueraded");
    assert!(checksums_ok::<Ipv6Addr>(&new));
    // And so are the flows to the prefix that was never exempt.
    let (_, other) = h.egress(&udp(POD6, 4005, REMOTE6_2, 53));
    assert_eq!(src6(&other), NODE6);
}

// ---- g. extension headers -------------------------------------------------------------------

#[test]
fn v6_tcp_behind_extension_headers_is_translated_at_the_right_offsets() {
    let mut h = harness();
    let exts = [ExtHeader::hop_by_hop(0), ExtHeader::destination_options(1)];
    let syn = insert_ext6(&tcp(POD6, 40010, REMOTE6, 80, SYN), &exts);
    let l4 = l4_offset6(&syn).unwrap();
    assert_eq!(l4, L4_6 + 8 + 16);
    assert!(checksums_ok::<Ipv6Addr>(&syn));
    let (verdict, out) = h.egress(&syn);
    assert_eq!(verdict, TC_ACT_OK);
    let port = word(&out, l4);
    assert!(in_spans(port));
    assert_changed_within(&syn, &out, &egress_fields(l4, TCP));
    let expected = insert_ext6(&tcp(NODE6, port, REMOTE6, 80, SYN), &exts);
    assert_frame(&out, &expected, &[l4 + 16]);
    assert!(checksums_ok::<Ipv6Addr>(&out));

    // The reply behind a routing header and destination options: another chain, another offset.
    let back_exts = [ExtHeader::routing(2), ExtHeader::destination_options(0)];
    let reply = insert_ext6(&tcp(REMOTE6, 80, NODE6, port, SYN | ACK), &back_exts);
    let l4 = l4_offset6(&reply).unwrap();
    assert_eq!(l4, L4_6 + 24 + 8);
    let (verdict, back) = h.ingress(&reply);
    assert_eq!(verdict, TC_ACT_OK);
    assert_changed_within(&reply, &back, &ingress_fields(l4, TCP));
    let expected = insert_ext6(&tcp(REMOTE6, 80, POD6, 40010, SYN | ACK), &back_exts);
    assert_frame(&back, &expected, &[l4 + 16]);
    assert!(checksums_ok::<Ipv6Addr>(&back));

    // An echo request behind hop-by-hop options, and an atomic fragment (offset 0, no more
    // fragments, RFC 6946) of a UDP datagram: whole packets, translated as such.
    let hbh = [ExtHeader::hop_by_hop(2)];
    let request = insert_ext6(&ping(POD6, REMOTE6, ICMPV6_ECHO_REQUEST, 99), &hbh);
    let l4 = L4_6 + 24;
    let (_, out) = h.egress(&request);
    let id = word(&out, l4 + 4);
    assert_changed_within(&request, &out, &[range(SRC6, 16), range(l4 + 2, 4)]);
    let expected = insert_ext6(&ping(NODE6, REMOTE6, ICMPV6_ECHO_REQUEST, id), &hbh);
    assert_frame(&out, &expected, &[l4 + 2]);
    let atomic = [ExtHeader::fragment(0, false, 0x0a0b_0c0d)];
    let dgram = insert_ext6(&udp(POD6, 6000, REMOTE6, 53), &atomic);
    let l4 = L4_6 + 8;
    let (_, out) = h.egress(&dgram);
    let port = word(&out, l4);
    assert_changed_within(&dgram, &out, &egress_fields(l4, UDP));
    let expected = insert_ext6(&udp(NODE6, port, REMOTE6, 53), &atomic);
    assert_frame(&out, &expected, &[l4 + 6]);
    assert!(checksums_ok::<Ipv6Addr>(&out));
}

/// A chain of `n` extension headers of every kind but the fragment header.
fn long_chain(n: usize) -> Vec<ExtHeader> {
    (0..n)
        .map(|i| match i % 3 {
            0 if i == 0 => ExtHeader::hop_by_hop(0),
            0 | 1 => ExtHeader::destination_options((i % 2) as u8),
            _ => ExtHeader::routing(1),
        })
        .collect()
}

#[test]
fn v6_six_extension_headers_are_walked_and_seven_are_dropped_toward_the_outside() {
    let mut h = harness();
    // Six: still translated.
    let six = long_chain(6);
    let syn = insert_ext6(&tcp(POD6, 40020, REMOTE6, 80, SYN), &six);
    let l4 = l4_offset6(&syn).unwrap();
    let (verdict, out) = h.egress(&syn);
    assert_eq!(verdict, TC_ACT_OK);
    let port = word(&out, l4);
    assert_changed_within(&syn, &out, &egress_fields(l4, TCP));
    assert_frame(
        &out,
        &insert_ext6(&tcp(NODE6, port, REMOTE6, 80, SYN), &six),
        &[l4 + 16],
    );

    // Seven: past what is walked. Out to a masqueraded destination they are dropped, not left
    // to the chain (whose protocol match walks any chain and would let them out with the
    // pod's address); to a non-masquerade one, or from the node, they pass untouched.
    let seven = long_chain(7);
    let dropped = h.counter(Counter::DropExtensionHeaders);
    for packet in [
        insert_ext6(&tcp(POD6, 40020, REMOTE6, 80, ACK), &seven),
        insert_ext6(&tcp(POD6, 40021, REMOTE6, 80, SYN), &seven),
        insert_ext6(&udp(POD6, 40022, REMOTE6, 53), &seven),
        insert_ext6(&ping(POD6, REMOTE6, ICMPV6_ECHO_REQUEST, 3), &seven),
    ] {
        assert!(checksums_ok::<Ipv6Addr>(&packet));
        assert_eq!(h.egress(&packet).0, TC_ACT_SHOT);
    }
    assert_eq!(h.counter(Counter::DropExtensionHeaders), dropped + 4);
    let cluster = "fd00:200::10".parse().unwrap();
    for packet in [
        insert_ext6(&tcp(POD6, 40023, cluster, 80, SYN), &seven),
        insert_ext6(&tcp(NODE6, 40024, REMOTE6, 80, SYN), &seven),
    ] {
        assert_eq!(h.egress(&packet), (TC_ACT_OK, packet.clone()));
    }
    let reply = insert_ext6(&tcp(REMOTE6, 80, NODE6, port, ACK), &seven);
    assert_eq!(h.ingress(&reply), (TC_ACT_OK, reply.clone()));
    assert_eq!(h.nat_v6().len(), 2, "only the six-header flow");
}

// ---- h. fragments ---------------------------------------------------------------------------

/// A UDP datagram of 8 + 88 bytes from `src`, with its checksum over the whole of it.
fn long_udp(src: Ipv6Addr, sport: u16, dst: Ipv6Addr, dport: u16) -> Vec<u8> {
    let mut d = Vec::new();
    d.extend(sport.to_be_bytes());
    d.extend(dport.to_be_bytes());
    d.extend(96u16.to_be_bytes());
    d.extend([0, 0]);
    d.extend((0..88).map(|i| i as u8 ^ 0xa5));
    fill_checksum(src, dst, UDP, &mut d);
    d
}

/// Checks a first fragment's translation: the UDP checksum, over a whole datagram that is not
/// in this frame, moved by exactly what the rewritten address and port add up to; and the
/// datagram, put back together with the rest of it, verifies from scratch.
fn assert_first_fragment_checksum(
    input: &[u8],
    out: &[u8],
    l4: usize,
    fields: [Range<usize>; 2],
    rest: &[u8],
) {
    let csum = l4 + 6;
    let old: Vec<u8> = fields
        .iter()
        .flat_map(|r| input[r.clone()].to_vec())
        .collect();
    let new: Vec<u8> = fields
        .iter()
        .flat_map(|r| out[r.clone()].to_vec())
        .collect();
    let adjusted = checksum_adjusted(word(input, csum), &old, &new);
    assert!(
        same_checksum(word(out, csum), adjusted),
        "UDP checksum {:#06x}, the translation's delta makes it {adjusted:#06x}",
        word(out, csum)
    );
    let datagram = [&out[l4..], rest].concat();
    assert_eq!(
        residual(src6(out), dst6(out), UDP, &datagram),
        0,
        "the reassembled datagram's checksum"
    );
}

#[test]
fn v6_later_fragments_follow_their_first_both_ways() {
    let mut h = harness();
    let id = 0xdead_beef;
    let datagram = long_udp(POD6, 3000, REMOTE6, 53);
    let frags = fragments(POD6, REMOTE6, UDP, &datagram, id, 48);
    assert_eq!(frags.len(), 2);
    let (first, later) = (&frags[0], &frags[1]);
    let l4 = L4_6 + 8;
    assert!(headers6(first).unwrap().fragment.unwrap().more);
    assert_eq!(headers6(later).unwrap().fragment.unwrap().offset, 6);

    let (verdict, out) = h.egress(first);
    assert_eq!(verdict, TC_ACT_OK);
    let port = word(&out, l4);
    assert!(in_spans(port));
    assert_eq!(src6(&out), NODE6);
    assert_changed_within(first, &out, &egress_fields(l4, UDP));
    assert_first_fragment_checksum(
        first,
        &out,
        l4,
        [range(SRC6, 16), range(l4, 2)],
        &datagram[48..],
    );
    let translated = long_udp(NODE6, port, REMOTE6, 53);
    let expected = fragments(NODE6, REMOTE6, UDP, &translated, id, 48);
    assert_frame(&out, &expected[0], &[l4 + 6]);

    let (verdict, out) = h.egress(later);
    assert_eq!(verdict, TC_ACT_OK);
    assert_changed_within(later, &out, &[range(SRC6, 16)]);
    assert_eq!(out, expected[1], "only the source address changes");
    assert_eq!(h.counter(Counter::Masqueraded), 2);

    // A later fragment of a datagram whose first fragment never went through: dropped, not
    // sent with the pod's address.
    let stray = fragments(POD6, REMOTE6, UDP, &datagram, id ^ 1, 48);
    assert_eq!(h.egress(&stray[1]).0, TC_ACT_SHOT);
    assert_eq!(h.counter(Counter::DropFragment), 1);
    // The same id from another pod, or to another server, is another datagram.
    let other_pod = fragments(POD6_2, REMOTE6, UDP, &datagram, id, 48);
    assert_eq!(h.egress(&other_pod[1]).0, TC_ACT_SHOT);
    let other_server = fragments(POD6, REMOTE6_2, UDP, &datagram, id, 48);
    assert_eq!(h.egress(&other_server[1]).0, TC_ACT_SHOT);
    assert_eq!(h.counter(Counter::DropFragment), 3);
    // The node's own fragments, and fragments to exempt destinations, pass.
    let own = fragments(NODE6, REMOTE6, UDP, &datagram, id ^ 2, 48);
    assert_eq!(h.egress(&own[1]), (TC_ACT_OK, own[1].clone()));
    let exempt = fragments(POD6, SERVICE6, UDP, &datagram, id ^ 3, 48);
    assert_eq!(h.egress(&exempt[1]), (TC_ACT_OK, exempt[1].clone()));
    assert_eq!(h.counter(Counter::DropFragment), 3);

    // The reply, fragmented too: its first fragment is translated as any packet of the flow,
    // and the later ones take the same destination.
    let reply_id = 0x0102_0304;
    let reply = long_udp(REMOTE6, 53, NODE6, port);
    let back_frags = fragments(REMOTE6, NODE6, UDP, &reply, reply_id, 48);
    let (verdict, back) = h.ingress(&back_frags[0]);
    assert_eq!(verdict, TC_ACT_OK);
    assert_changed_within(&back_frags[0], &back, &ingress_fields(l4, UDP));
    assert_first_fragment_checksum(
        &back_frags[0],
        &back,
        l4,
        [range(DST6, 16), range(l4 + 2, 2)],
        &reply[48..],
    );
    let restored = long_udp(REMOTE6, 53, POD6, 3000);
    let expected = fragments(REMOTE6, POD6, UDP, &restored, reply_id, 48);
    assert_frame(&back, &expected[0], &[l4 + 6]);
    let (verdict, back) = h.ingress(&back_frags[1]);
    assert_eq!(verdict, TC_ACT_OK);
    assert_changed_within(&back_frags[1], &back, &[range(DST6, 16)]);
    assert_eq!(back, expected[1], "only the destination address changes");
    assert_eq!(h.counter(Counter::ReverseTranslated), 2);

    // On ingress a later fragment of no known datagram passes untouched: it may be the node's.
    let unknown = fragments(REMOTE6, NODE6, UDP, &reply, reply_id ^ 1, 48);
    assert_eq!(h.ingress(&unknown[1]), (TC_ACT_OK, unknown[1].clone()));
}

/// A ping too big for the path, fragmented: its first fragment carries the echo header, whose
/// checksum (over the pseudo-header and the whole message) moves by exactly the translation;
/// the later fragment takes the node's address, and the fragmented reply comes back whole.
#[test]
fn v6_a_fragmented_ping_is_translated_and_its_fragmented_reply_restored() {
    let mut h = harness();
    let body: Vec<u8> = (0..200u8).collect();
    let id = 0x0bad_cafe;
    let message = |src, dst, kind, ident: u16| {
        let [a, b] = ident.to_be_bytes();
        icmp_message(src, dst, kind, 0, [a, b, 0, 9], &body)
    };
    let request = message(POD6, REMOTE6, ICMPV6_ECHO_REQUEST, 0x7777);
    let frags = fragments(POD6, REMOTE6, ICMPV6, &request, id, 104);
    assert_eq!(frags.len(), 2);
    let l4 = L4_6 + 8;
    let (verdict, first) = h.egress(&frags[0]);
    assert_eq!(verdict, TC_ACT_OK);
    let ident = word(&first, l4 + 4);
    assert!(in_spans(ident));
    assert_changed_within(&frags[0], &first, &[range(SRC6, 16), range(l4 + 2, 4)]);
    let sent = message(NODE6, REMOTE6, ICMPV6_ECHO_REQUEST, ident);
    let expected = fragments(NODE6, REMOTE6, ICMPV6, &sent, id, 104);
    assert_frame(&first, &expected[0], &[l4 + 2]);
    let whole = [&first[l4..], &request[104..]].concat();
    assert_eq!(residual(NODE6, REMOTE6, ICMPV6, &whole), 0, "reassembled");
    let (verdict, later) = h.egress(&frags[1]);
    assert_eq!((verdict, &later), (TC_ACT_OK, &expected[1]));

    let reply = message(REMOTE6, NODE6, ICMPV6_ECHO_REPLY, ident);
    let back_frags = fragments(REMOTE6, NODE6, ICMPV6, &reply, id, 104);
    let restored = message(REMOTE6, POD6, ICMPV6_ECHO_REPLY, 0x7777);
    let expected = fragments(REMOTE6, POD6, ICMPV6, &restored, id, 104);
    let (verdict, back) = h.ingress(&back_frags[0]);
    assert_eq!(verdict, TC_ACT_OK);
    assert_changed_within(&back_frags[0], &back, &[range(DST6, 16), range(l4 + 2, 4)]);
    assert_frame(&back, &expected[0], &[l4 + 2]);
    let (verdict, back) = h.ingress(&back_frags[1]);
    assert_eq!((verdict, &back), (TC_ACT_OK, &expected[1]));
    assert_eq!(h.counter(Counter::Masqueraded), 2);
    assert_eq!(h.counter(Counter::ReverseTranslated), 2);
}

// ---- beyond the list: inbound connections, exhaustion ---------------------------------------

#[test]
fn v6_connections_opened_from_outside_keep_the_pods_address() {
    let mut h = harness();
    // Stray segments open nothing: only a SYN starts a connection.
    for stray in [ACK, SYN | ACK, 0x04] {
        h.ingress(&tcp(REMOTE6, 5555, POD6, 8080, stray));
    }
    // Nor does anything sent to multicast or link-local addresses.
    h.ingress(&udp(REMOTE6, 5555, ALL_NODES, 8080));
    h.ingress(&udp(REMOTE6, 5555, HOST_LL, 8080));
    assert_eq!(h.counter(Counter::InboundTracked), 0);
    assert!(h.nat_v6().is_empty(), "{:?}", h.nat_v6());

    let syn = tcp(REMOTE6, 5555, POD6, 8080, SYN);
    assert_eq!(h.ingress(&syn), (TC_ACT_OK, syn));
    assert_eq!(h.counter(Counter::InboundTracked), 1);
    let syn_ack = tcp(POD6, 8080, REMOTE6, 5555, SYN | ACK);
    assert_eq!(
        h.egress(&syn_ack),
        (TC_ACT_OK, syn_ack),
        "the pod's reply keeps its address"
    );
    assert_eq!(h.counter(Counter::NotMasqInbound), 1);
    let nat = h.nat_v6();
    assert_eq!(nat.len(), 2);
    assert!(nat.iter().all(|(_, e)| e.kind == nat_kind::PASSTHROUGH));
    // The pod's own new connection to the same server is still masqueraded.
    let (_, out) = h.egress(&tcp(POD6, 40000, REMOTE6, 5555, SYN));
    assert_eq!(src6(&out), NODE6);
    assert!(checksums_ok::<Ipv6Addr>(&out));
}

#[test]
fn v6_exhausted_ports_and_a_full_table_drop_new_flows_and_keep_live_ones() {
    let v4: Vec<Ipv4Net> = vec![];
    let mut h = TestBed::new(1024, &([(5000, 5000)]), true, NODE_V4, &v4).unwrap();
    h.enable_ipv6(NODE6, &nets6(&POLICY)).unwrap();
    let (verdict, a) = h.egress(&udp(POD6, 1111, REMOTE6, 53));
    assert_eq!((verdict, word(&a, L4_6)), (TC_ACT_OK, 5000));
    let (verdict, _) = h.egress(&udp(POD6_2, 2222, REMOTE6, 53));
    assert_eq!(
        verdict, TC_ACT_SHOT,
        "the only port is taken for this server"
    );
    assert_eq!(h.counter(Counter::DropPortsExhausted), 1);
    assert_eq!(h.counter(Counter::AllocationFailed), 1);
    let (verdict, c) = h.egress(&udp(POD6_2, 2222, REMOTE6_2, 53));
    assert_eq!((verdict, word(&c, L4_6)), (TC_ACT_OK, 5000));
    assert_eq!(h.nat_v6().len(), 4, "no half-created flow left behind");
    let (_, back) = h.ingress(&udp(REMOTE6, 53, NODE6, 5000));
    assert_frame(&back, &udp(REMOTE6, 53, POD6, 1111), &[L4_6 + 6]);

    // Four entries: two flows fill the table.
    let mut h = TestBed::new(4, &([(1024, 65535)]), true, NODE_V4, &v4).unwrap();
    h.enable_ipv6(NODE6, &nets6(&POLICY)).unwrap();
    let (_, a) = h.egress(&udp(POD6, 1001, REMOTE6, 53));
    let (_, b) = h.egress(&udp(POD6, 1002, REMOTE6, 53));
    assert_eq!(h.nat_v6().len(), 4);
    let (verdict, _) = h.egress(&udp(POD6, 1003, REMOTE6, 53));
    assert_eq!(verdict, TC_ACT_SHOT);
    assert_eq!(h.counter(Counter::DropNatTableFull), 1);
    assert_eq!(h.nat_v6().len(), 4, "and leaves nothing behind");
    for (out, pod_port) in [(a, 1001), (b, 1002)] {
        let port = word(&out, L4_6);
        let (verdict, again) = h.egress(&udp(POD6, pod_port, REMOTE6, 53));
        assert_eq!((verdict, word(&again, L4_6)), (TC_ACT_OK, port));
        let (_, back) = h.ingress(&udp(REMOTE6, 53, NODE6, port));
        assert_frame(&back, &udp(REMOTE6, 53, POD6, pod_port), &[L4_6 + 6]);
    }
}

// ---- i. IPv6 not enabled --------------------------------------------------------------------

/// As for IPv4: the node's own flows and masqueraded ones never share a tuple on the node's
/// address; a node flow that would is given another port.
#[test]
fn v6_the_nodes_own_flows_and_masqueraded_ones_never_share_a_tuple() {
    let mut h = harness();
    let (_, out) = h.egress(&udp(POD6, 40000, REMOTE6, 8080));
    let held = word(&out, L4_6);
    let (verdict, left) = h.egress(&udp(NODE6, held, REMOTE6, 8080));
    assert_eq!(verdict, TC_ACT_OK);
    let other = word(&left, L4_6);
    assert_ne!(other, held);
    assert_frame(&left, &udp(NODE6, other, REMOTE6, 8080), &[L4_6 + 6]);
    assert_eq!(h.counter(Counter::NodePortClash), 1);
    let (_, back) = h.ingress(&udp(REMOTE6, 8080, NODE6, other));
    assert_frame(&back, &udp(REMOTE6, 8080, NODE6, held), &[L4_6 + 6]);
    let (_, back) = h.ingress(&udp(REMOTE6, 8080, NODE6, held));
    assert_frame(&back, &udp(REMOTE6, 8080, POD6, 40000), &[L4_6 + 6]);
    // A node flow that clashes with nothing keeps its port, and its tuple is held.
    let free = udp(NODE6, 33333, REMOTE6, 8080);
    assert_eq!(h.egress(&free), (TC_ACT_OK, free.clone()));
    assert!(
        h.nat_v6()
            .iter()
            .any(|(k, e)| e.kind == nat_kind::NODE && k.sport == 33333u16.to_be())
    );
}

#[test]
fn v6_without_enable_ipv6_nothing_is_translated() {
    let mut h = bare_harness();
    let datagram = long_udp(POD6, 3000, REMOTE6, 53);
    let frags = fragments(POD6, REMOTE6, UDP, &datagram, 7, 48);
    let egress = [
        tcp(POD6, 40000, REMOTE6, 80, SYN),
        udp(POD6, 40000, REMOTE6, 53),
        ping(POD6, REMOTE6, ICMPV6_ECHO_REQUEST, 1),
        frags[0].clone(),
        frags[1].clone(),
    ];
    for (n, packet) in egress.iter().enumerate() {
        assert_eq!(h.egress(packet), (TC_ACT_OK, packet.clone()), "egress {n}");
        assert_eq!(h.counter(Counter::NotInspected), n as u64 + 1, "egress {n}");
    }
    let ingress = [
        tcp(REMOTE6, 80, NODE6, 40000, SYN | ACK),
        // A connection opened from outside toward a pod opens no flow either.
        tcp(REMOTE6, 5555, POD6, 8080, SYN),
        udp(REMOTE6, 53, POD6, 40000),
        ping(REMOTE6, NODE6, ICMPV6_ECHO_REPLY, 1),
        icmp6_error(
            ICMPV6_PACKET_TOO_BIG,
            0,
            MTU_1280,
            NODE6,
            &tcp(NODE6, 40000, REMOTE6, 80, SYN),
            60,
        ),
    ];
    for (n, packet) in ingress.iter().enumerate() {
        assert_eq!(
            h.ingress(packet),
            (TC_ACT_OK, packet.clone()),
            "ingress {n}"
        );
    }
    assert!(h.nat_v6().is_empty(), "{:?}", h.nat_v6());
    assert_eq!(h.counter(Counter::InboundTracked), 0);
    for counter in Counter::ALL {
        if counter != Counter::NotInspected {
            assert_eq!(h.counter(counter), 0, "{counter:?}");
        }
    }
    // IPv4 is translated as ever.
    let (_, out) = h.egress(&tcp(
        Ipv4Addr::new(10, 244, 1, 2),
        40000,
        Ipv4Addr::new(203, 0, 113, 10),
        80,
        SYN,
    ));
    assert_eq!(src(&out), NODE_V4);
}

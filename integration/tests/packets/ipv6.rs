//! What only IPv6 has: neighbour discovery and MLD, extension header chains, and the switch
//! that turns it on.

use std::net::{Ipv4Addr, Ipv6Addr};

use masq_agent::dataplane::ebpf::testbed::{TC_ACT_OK, TC_ACT_SHOT, TestBed};
use masq_ebpf::{Counter, verdict_slot};
use masq_testbed::packet::*;

use crate::{family::*, fragments::long_udp};

const NODE: Ipv6Addr = <Ipv6Addr as HarnessFamily>::NODE;
const POD: Ipv6Addr = <Ipv6Addr as HarnessFamily>::POD;
const REMOTE: Ipv6Addr = <Ipv6Addr as HarnessFamily>::REMOTE;
const HOST_LL: Ipv6Addr = <Ipv6Addr as HarnessFamily>::LINK_LOCAL;
const ALL_NODES: Ipv6Addr = <Ipv6Addr as HarnessFamily>::ALL_NODES;
const NODE_LL: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 1);
const ROUTER_LL: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0xfe);
const ALL_ROUTERS: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 2);
const ALL_MLDV2_ROUTERS: Ipv6Addr = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 0x16);

/// The test bed as the agent sets it up without `--enable-ipv6`: IPv4 only.
fn without_enable_ipv6() -> TestBed {
    let policy = nets::<Ipv4Addr>(<Ipv4Addr as HarnessFamily>::POLICY);
    TestBed::new(
        1024,
        &SPANS,
        true,
        <Ipv4Addr as HarnessFamily>::NODE,
        &policy,
    )
    .unwrap()
}

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
    let group = solicited_node(NODE);
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
                NODE,
                solicited_node(REMOTE),
                ND_NEIGHBOR_SOLICIT,
                [0; 4],
                target(REMOTE, lla_option(1, mac)),
            ),
        ),
        (
            "neighbour solicitation, duplicate address detection",
            nd(
                Ipv6Addr::UNSPECIFIED,
                solicited_node(NODE),
                ND_NEIGHBOR_SOLICIT,
                [0; 4],
                target(NODE, vec![]),
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
                REMOTE,
                NODE,
                ND_NEIGHBOR_ADVERT,
                [0x60, 0, 0, 0],
                target(REMOTE, lla_option(2, mac)),
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
fn neighbour_discovery_and_mld_pass_untouched_both_ways() {
    let mut h = harness::<Ipv6Addr>();
    // A live flow, so that the programs have NAT state to (not) apply.
    h.egress(&tcp(POD, 40000, REMOTE, 80, SYN));
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

/// Two destinations of one hash share a slot of the programs' verdict cache and its tag, which
/// holds 32 bits of the hash where IPv4's holds the whole address: the address the slot holds
/// beside it tells them apart, and each gets its own verdict, however they take turns in the
/// slot. The second destination is made from the first through the hash's inverse: a 64-bit
/// collision, which no search would find.
#[test]
fn destinations_that_share_a_verdict_slot_and_its_tag_each_get_their_own_verdict() {
    let kept = <Ipv6Addr as HarnessFamily>::SERVICE;
    let masqueraded = same_hash_in(kept, Ipv6Addr::new(0x2001, 0xdb8, 9, 0, 0, 0, 0, 0));
    assert!(
        masqueraded.segments()[..4] == [0x2001, 0xdb8, 9, 0],
        "{masqueraded}"
    );
    let (a, b) = (kept.octets(), masqueraded.octets());
    assert_eq!(verdict_slot::hash_v6(a), verdict_slot::hash_v6(b));
    assert_eq!(verdict_slot::index_v6(a), verdict_slot::index_v6(b));
    assert_eq!(verdict_slot::tag_v6(a, 1), verdict_slot::tag_v6(b, 1));

    let mut h = harness::<Ipv6Addr>();
    for turn in 0..3 {
        let to_kept = udp(POD, 5000 + turn, kept, 53);
        assert_eq!(
            h.egress(&to_kept),
            (TC_ACT_OK, to_kept.clone()),
            "turn {turn}: {kept} keeps the pod's address"
        );
        let (verdict, out) = h.egress(&udp(POD, 6000 + turn, masqueraded, 53));
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(
            Ipv6Addr::at(&out, Ipv6Addr::SRC),
            NODE,
            "turn {turn}: {masqueraded} is masqueraded"
        );
    }
}

/// An address in the /64 of `prefix` whose `verdict_slot::hash_v6` is `addr`'s: the hash mixes
/// the address's halves, each times an odd multiplier, with xor before its finish, so the
/// low half that gives `prefix`'s high half the same mix is found by the low multiplier's
/// inverse.
fn same_hash_in(addr: Ipv6Addr, prefix: Ipv6Addr) -> Ipv6Addr {
    use verdict_slot::{HASH_HIGH, HASH_LOW};
    let halves = |addr: Ipv6Addr| {
        let o = addr.octets();
        let half = |at: usize| u64::from_ne_bytes(o[at..at + 8].try_into().unwrap());
        (half(0), half(8))
    };
    let (high, low) = halves(addr);
    let mixed = high.wrapping_mul(HASH_HIGH) ^ low.wrapping_mul(HASH_LOW);
    let (prefix_high, _) = halves(prefix);
    // Newton's iteration: each step doubles the bits of the inverse an odd number's square
    // already gives three of.
    let mut inverse = HASH_LOW;
    for _ in 0..5 {
        inverse = inverse.wrapping_mul(2u64.wrapping_sub(HASH_LOW.wrapping_mul(inverse)));
    }
    assert_eq!(HASH_LOW.wrapping_mul(inverse), 1);
    let other_low = (mixed ^ prefix_high.wrapping_mul(HASH_HIGH)).wrapping_mul(inverse);
    let mut octets = [0; 16];
    octets[..8].copy_from_slice(&prefix_high.to_ne_bytes());
    octets[8..].copy_from_slice(&other_low.to_ne_bytes());
    Ipv6Addr::from(octets)
}

#[test]
fn tcp_behind_extension_headers_is_translated_at_the_right_offsets() {
    let mut h = harness::<Ipv6Addr>();
    let exts = [ExtHeader::hop_by_hop(0), ExtHeader::destination_options(1)];
    let syn = insert_ext6(&tcp(POD, 40010, REMOTE, 80, SYN), &exts);
    let l4 = l4_offset6(&syn).unwrap();
    assert_eq!(l4, L4_6 + 8 + 16);
    assert!(checksums_ok::<Ipv6Addr>(&syn));
    let (verdict, out) = h.egress(&syn);
    assert_eq!(verdict, TC_ACT_OK);
    let port = word(&out, l4);
    assert!(in_spans(port));
    assert_changed_within(&syn, &out, &egress_fields::<Ipv6Addr>(l4, TCP));
    let expected = insert_ext6(&tcp(NODE, port, REMOTE, 80, SYN), &exts);
    assert_frame(&out, &expected, &[l4 + 16]);
    assert!(checksums_ok::<Ipv6Addr>(&out));

    // The reply behind a routing header and destination options: another chain, another offset.
    let back_exts = [ExtHeader::routing(2), ExtHeader::destination_options(0)];
    let reply = insert_ext6(&tcp(REMOTE, 80, NODE, port, SYN | ACK), &back_exts);
    let l4 = l4_offset6(&reply).unwrap();
    assert_eq!(l4, L4_6 + 24 + 8);
    let (verdict, back) = h.ingress(&reply);
    assert_eq!(verdict, TC_ACT_OK);
    assert_changed_within(&reply, &back, &ingress_fields::<Ipv6Addr>(l4, TCP));
    let expected = insert_ext6(&tcp(REMOTE, 80, POD, 40010, SYN | ACK), &back_exts);
    assert_frame(&back, &expected, &[l4 + 16]);
    assert!(checksums_ok::<Ipv6Addr>(&back));

    // An echo request behind hop-by-hop options, and an atomic fragment (offset 0, no more
    // fragments, RFC 6946) of a UDP datagram: whole packets, translated as such.
    let hbh = [ExtHeader::hop_by_hop(2)];
    let request = insert_ext6(&ping(POD, REMOTE, ICMPV6_ECHO_REQUEST, 99), &hbh);
    let l4 = L4_6 + 24;
    let (_, out) = h.egress(&request);
    let id = word(&out, l4 + 4);
    assert_changed_within(&request, &out, &[range(SRC6, 16), range(l4 + 2, 4)]);
    let expected = insert_ext6(&ping(NODE, REMOTE, ICMPV6_ECHO_REQUEST, id), &hbh);
    assert_frame(&out, &expected, &[l4 + 2]);
    let atomic = [ExtHeader::fragment(0, false, 0x0a0b_0c0d)];
    let dgram = insert_ext6(&udp(POD, 6000, REMOTE, 53), &atomic);
    let l4 = L4_6 + 8;
    let (_, out) = h.egress(&dgram);
    let port = word(&out, l4);
    assert_changed_within(&dgram, &out, &egress_fields::<Ipv6Addr>(l4, UDP));
    let expected = insert_ext6(&udp(NODE, port, REMOTE, 53), &atomic);
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
fn six_extension_headers_are_walked_and_seven_are_dropped_toward_the_outside() {
    let mut h = harness::<Ipv6Addr>();
    // Six: still translated.
    let six = long_chain(6);
    let syn = insert_ext6(&tcp(POD, 40020, REMOTE, 80, SYN), &six);
    let l4 = l4_offset6(&syn).unwrap();
    let (verdict, out) = h.egress(&syn);
    assert_eq!(verdict, TC_ACT_OK);
    let port = word(&out, l4);
    assert_changed_within(&syn, &out, &egress_fields::<Ipv6Addr>(l4, TCP));
    assert_frame(
        &out,
        &insert_ext6(&tcp(NODE, port, REMOTE, 80, SYN), &six),
        &[l4 + 16],
    );

    // Seven: past what is walked. Out to a masqueraded destination they are dropped, not left
    // to the chain (whose protocol match walks any chain and would let them out with the
    // pod's address); to a non-masquerade one, or from the node, they pass untouched.
    let seven = long_chain(7);
    let dropped = h.counter(Counter::DropExtensionHeaders);
    for packet in [
        insert_ext6(&tcp(POD, 40020, REMOTE, 80, ACK), &seven),
        insert_ext6(&tcp(POD, 40021, REMOTE, 80, SYN), &seven),
        insert_ext6(&udp(POD, 40022, REMOTE, 53), &seven),
        insert_ext6(&ping(POD, REMOTE, ICMPV6_ECHO_REQUEST, 3), &seven),
    ] {
        assert!(checksums_ok::<Ipv6Addr>(&packet));
        assert_eq!(h.egress(&packet).0, TC_ACT_SHOT);
    }
    assert_eq!(h.counter(Counter::DropExtensionHeaders), dropped + 4);
    let cluster = "fd00:200::10".parse().unwrap();
    for packet in [
        insert_ext6(&tcp(POD, 40023, cluster, 80, SYN), &seven),
        insert_ext6(&tcp(NODE, 40024, REMOTE, 80, SYN), &seven),
    ] {
        assert_eq!(h.egress(&packet), (TC_ACT_OK, packet.clone()));
    }
    let reply = insert_ext6(&tcp(REMOTE, 80, NODE, port, ACK), &seven);
    assert_eq!(h.ingress(&reply), (TC_ACT_OK, reply.clone()));
    assert_eq!(h.nat_v6().len(), 2, "only the six-header flow");
}

#[test]
fn without_enable_ipv6_nothing_is_translated() {
    let mut h = without_enable_ipv6();
    let datagram = long_udp(POD, 3000, REMOTE, 53);
    let frags = fragments(POD, REMOTE, UDP, &datagram, 7, 48);
    let egress = [
        tcp(POD, 40000, REMOTE, 80, SYN),
        udp(POD, 40000, REMOTE, 53),
        ping(POD, REMOTE, ICMPV6_ECHO_REQUEST, 1),
        frags[0].clone(),
        frags[1].clone(),
    ];
    for (n, packet) in egress.iter().enumerate() {
        assert_eq!(h.egress(packet), (TC_ACT_OK, packet.clone()), "egress {n}");
        assert_eq!(h.counter(Counter::NotInspected), n as u64 + 1, "egress {n}");
    }
    let ingress = [
        tcp(REMOTE, 80, NODE, 40000, SYN | ACK),
        // A connection opened from outside toward a pod opens no flow either.
        tcp(REMOTE, 5555, POD, 8080, SYN),
        udp(REMOTE, 53, POD, 40000),
        ping(REMOTE, NODE, ICMPV6_ECHO_REPLY, 1),
        icmp_error(
            (<Ipv6Addr as HarnessFamily>::ROUTER, NODE),
            <Ipv6Addr as HarnessFamily>::TOO_BIG,
            &tcp(NODE, 40000, REMOTE, 80, SYN),
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
    assert_eq!(src(&out), <Ipv4Addr as HarnessFamily>::NODE);
}

use std::net::{Ipv4Addr, Ipv6Addr};

use super::*;

const A: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x244, 1, 0, 0, 0, 2);
const B: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x10);

#[test]
fn ipv6_checksums_match_known_answers() {
    // Both checked with `tcpdump -vv`, which verifies them with code of its own.
    assert_eq!(word(&tcp(A, 40000, B, 80, SYN), L4_6 + 16), 0x46ec);
    let f = tcp(A, 40000, B, 80, SYN);
    assert!(checksums_ok::<Ipv6Addr>(&f));
    for i in L4_6..f.len() {
        let mut broken = f.clone();
        broken[i] ^= 0x01;
        assert!(
            !checksums_ok::<Ipv6Addr>(&broken),
            "a flipped bit at {i} goes unnoticed"
        );
    }
    // The pseudo-header counts: another address breaks the checksum.
    let mut moved = f.clone();
    moved[SRC6 + 15] ^= 1;
    assert!(!checksums_ok::<Ipv6Addr>(&moved));
    assert!(checksums_ok::<Ipv6Addr>(&udp(A, 1, B, 2)));
    assert!(checksums_ok::<Ipv6Addr>(&ping(
        A,
        B,
        ICMPV6_ECHO_REQUEST,
        7
    )));
}

#[test]
fn ipv4_checksums_are_checked_from_scratch() {
    let (a, b) = (Ipv4Addr::new(10, 244, 1, 2), Ipv4Addr::new(203, 0, 113, 10));
    for f in [
        tcp(a, 40000, b, 80, SYN),
        udp(a, 1, b, 2),
        ping(a, b, Ipv4Addr::ECHO_REQUEST, 7),
    ] {
        assert!(checksums_ok::<Ipv4Addr>(&f));
        for i in IP..f.len() {
            let mut broken = f.clone();
            broken[i] ^= 0x01;
            assert!(
                !checksums_ok::<Ipv4Addr>(&broken),
                "a flipped bit at {i} goes unnoticed"
            );
        }
    }
    let mut no_checksum = udp(a, 1, b, 2);
    no_checksum[L4 + 6..L4 + 8].copy_from_slice(&[0, 0]);
    assert!(checksums_ok::<Ipv4Addr>(&no_checksum), "UDP's 0 is none");
}

#[test]
fn ipv4_fragments_carry_offsets_flags_and_id() {
    let (a, b) = (Ipv4Addr::new(10, 244, 1, 2), Ipv4Addr::new(203, 0, 113, 10));
    let datagram: Vec<u8> = (0..100u8).collect();
    let frags = fragments(a, b, UDP, &datagram, 0x0102_0304, 48);
    let fields: Vec<(u16, u16, bool)> = frags
        .iter()
        .map(|f| {
            let p = Ipv4Addr::packet_at(f, IP).unwrap();
            assert!(Ipv4Addr::header_checksum_ok(f, IP));
            assert_eq!((p.src, p.dst, p.proto, p.l4), (a, b, UDP, L4));
            (word(f, IP + 4), word(f, IP + 6), p.partial)
        })
        .collect();
    assert_eq!(
        fields,
        [
            (0x0304, 0x2000, true),
            (0x0304, 0x2006, true),
            (0x0304, 12, true)
        ]
    );
    let whole: Vec<u8> = frags.iter().flat_map(|f| f[L4..].to_vec()).collect();
    assert_eq!(whole, datagram);
}

#[test]
fn extension_headers_are_chained_and_walked() {
    let exts = [
        ExtHeader::hop_by_hop(0),
        ExtHeader::routing(2),
        ExtHeader::destination_options(1),
        ExtHeader::auth(4),
    ];
    assert_eq!(
        exts.iter().map(ExtHeader::len).collect::<Vec<_>>(),
        [8, 24, 16, 24]
    );
    let f = insert_ext6(&tcp(A, 1, B, 2, SYN), &exts);
    assert_eq!(word(&f, IP + 4) as usize, f.len() - L4_6, "payload length");
    let h = headers6(&f).unwrap();
    assert_eq!((h.proto, h.l4), (TCP, L4_6 + 72));
    assert_eq!(
        h.exts,
        [
            (NH_HOP_BY_HOP, 54, 8),
            (NH_ROUTING, 62, 24),
            (NH_DEST_OPTS, 86, 16),
            (NH_AUTH, 102, 24)
        ]
    );
    assert!(
        checksums_ok::<Ipv6Addr>(&f),
        "extension headers are outside the checksum"
    );
    assert_eq!(f, frame6_ext(A, B, &exts, TCP, &f[h.l4..]));
    // Cut in the middle of the chain: no upper layer to find.
    assert_eq!(headers6(&f[..70]), None);
}

#[test]
fn fragments_carry_offsets_flags_and_id() {
    let datagram: Vec<u8> = (0..100u8).collect();
    let frags = fragments(A, B, UDP, &datagram, 0x0102_0304, 48);
    assert_eq!(frags.len(), 3);
    let fields: Vec<Frag6> = frags
        .iter()
        .map(|f| headers6(f).unwrap().fragment.unwrap())
        .collect();
    assert_eq!(
        fields
            .iter()
            .map(|f| (f.offset, f.more, f.id))
            .collect::<Vec<_>>(),
        [
            (0, true, 0x0102_0304),
            (6, true, 0x0102_0304),
            (12, false, 0x0102_0304)
        ]
    );
    assert_eq!(&frags[1][L4_6..L4_6 + 8], [UDP, 0, 0, 0x31, 1, 2, 3, 4]);
    let later = headers6(&frags[2]).unwrap();
    assert!(later.is_later_fragment() && later.is_partial());
    assert_eq!((later.proto, later.l4), (UDP, L4_6 + 8));
    assert!(
        !checksums_ok::<Ipv6Addr>(&frags[0]),
        "a fragment cannot be checked alone"
    );
}

#[test]
fn checksum_adjustment_matches_a_recomputation() {
    let f = udp(A, 1000, B, 53);
    let mut g = udp(B, 2000, B, 53);
    g[SRC6..SRC6 + 16].copy_from_slice(&B.octets());
    let old: Vec<u8> = [&f[SRC6..SRC6 + 16], &f[L4_6..L4_6 + 2]].concat();
    let new: Vec<u8> = [&g[SRC6..SRC6 + 16], &g[L4_6..L4_6 + 2]].concat();
    let adjusted = checksum_adjusted(word(&f, L4_6 + 6), &old, &new);
    assert!(same_checksum(adjusted, word(&g, L4_6 + 6)));
    assert!(same_checksum(0, 0xffff) && !same_checksum(1, 0xfffe));
}

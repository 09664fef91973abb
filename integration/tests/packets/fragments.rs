//! Fragmented datagrams, in both families: a first fragment is translated as any packet of its
//! flow, and the later ones, which carry no ports, take the addresses their first took.

use std::ops::Range;

use masq_agent::dataplane::ebpf::testbed::{TC_ACT_OK, TC_ACT_SHOT};
use masq_ebpf::Counter;
use masq_testbed::packet::*;

use crate::family::*;

in_both_families!(
    later_fragments_follow_their_first_both_ways,
    a_fragmented_ping_is_translated_and_its_fragmented_reply_restored,
);

/// A UDP datagram of 8 + 88 bytes, with its checksum over the whole of it.
pub fn long_udp<F: HarnessFamily>(src: F, sport: u16, dst: F, dport: u16) -> Vec<u8> {
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
fn assert_first_fragment_checksum<F: HarnessFamily>(
    input: &[u8],
    out: &[u8],
    l4: usize,
    fields: [Range<usize>; 2],
    rest: &[u8],
) {
    let csum = l4 + 6;
    let bytes =
        |f: &[u8]| -> Vec<u8> { fields.iter().flat_map(|r| f[r.clone()].to_vec()).collect() };
    let adjusted = checksum_adjusted(word(input, csum), &bytes(input), &bytes(out));
    assert!(
        same_checksum(word(out, csum), adjusted),
        "UDP checksum {:#06x}, the translation's delta makes it {adjusted:#06x}",
        word(out, csum)
    );
    let datagram = [&out[l4..], rest].concat();
    assert_eq!(
        residual(F::at(out, F::SRC), F::at(out, F::DST), UDP, &datagram),
        0,
        "the reassembled datagram's checksum"
    );
}

fn later_fragments_follow_their_first_both_ways<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let id = 0xdead_beef;
    let datagram = long_udp(F::POD, 3000, F::REMOTE, 53);
    let frags = fragments(F::POD, F::REMOTE, UDP, &datagram, id, 48);
    assert_eq!(frags.len(), 2);
    let (first, later) = (&frags[0], &frags[1]);
    let l4 = F::packet_at(first, IP).unwrap().l4;
    assert!(F::packet_at(later, IP).unwrap().partial);

    let (verdict, out) = h.egress(first);
    assert_eq!(verdict, TC_ACT_OK);
    let port = word(&out, l4);
    assert!(in_spans(port));
    assert_eq!(F::at(&out, F::SRC), F::NODE);
    assert_changed_within(first, &out, &egress_fields::<F>(l4, UDP));
    let (src, sport) = (range(F::SRC, F::ADDR_LEN), range(l4, 2));
    assert_first_fragment_checksum::<F>(first, &out, l4, [src, sport], &datagram[48..]);
    let translated = long_udp(F::NODE, port, F::REMOTE, 53);
    let expected = fragments(F::NODE, F::REMOTE, UDP, &translated, id, 48);
    assert_frame(&out, &expected[0], &checksums::<F>(l4 + 6));

    let (verdict, out) = h.egress(later);
    assert_eq!(verdict, TC_ACT_OK);
    assert_changed_within(later, &out, &address_fields::<F>(F::SRC));
    assert_eq!(out, expected[1], "only the source address changes");
    assert_eq!(h.counter(Counter::Masqueraded), 2);

    // A later fragment of a datagram whose first fragment never went through: dropped, not
    // sent with the pod's address.
    let stray = fragments(F::POD, F::REMOTE, UDP, &datagram, id ^ 1, 48);
    assert_eq!(h.egress(&stray[1]).0, TC_ACT_SHOT);
    assert_eq!(h.counter(Counter::DropFragment), 1);
    // The same id from another pod, or to another server, is another datagram.
    let other_pod = fragments(F::POD2, F::REMOTE, UDP, &datagram, id, 48);
    assert_eq!(h.egress(&other_pod[1]).0, TC_ACT_SHOT);
    let other_server = fragments(F::POD, F::REMOTE2, UDP, &datagram, id, 48);
    assert_eq!(h.egress(&other_server[1]).0, TC_ACT_SHOT);
    assert_eq!(h.counter(Counter::DropFragment), 3);
    // The node's own fragments, and fragments to exempt destinations, pass.
    let own = fragments(F::NODE, F::REMOTE, UDP, &datagram, id ^ 2, 48);
    assert_eq!(h.egress(&own[1]), (TC_ACT_OK, own[1].clone()));
    let exempt = fragments(F::POD, F::SERVICE, UDP, &datagram, id ^ 3, 48);
    assert_eq!(h.egress(&exempt[1]), (TC_ACT_OK, exempt[1].clone()));
    assert_eq!(h.counter(Counter::DropFragment), 3);

    // The reply, fragmented too: its first fragment is translated as any packet of the flow,
    // and the later ones take the same destination.
    let reply_id = 0x0102_0304;
    let reply = long_udp(F::REMOTE, 53, F::NODE, port);
    let back_frags = fragments(F::REMOTE, F::NODE, UDP, &reply, reply_id, 48);
    let (verdict, back) = h.ingress(&back_frags[0]);
    assert_eq!(verdict, TC_ACT_OK);
    assert_changed_within(&back_frags[0], &back, &ingress_fields::<F>(l4, UDP));
    let (dst, dport) = (range(F::DST, F::ADDR_LEN), range(l4 + 2, 2));
    assert_first_fragment_checksum::<F>(&back_frags[0], &back, l4, [dst, dport], &reply[48..]);
    let restored = long_udp(F::REMOTE, 53, F::POD, 3000);
    let expected = fragments(F::REMOTE, F::POD, UDP, &restored, reply_id, 48);
    assert_frame(&back, &expected[0], &checksums::<F>(l4 + 6));
    let (verdict, back) = h.ingress(&back_frags[1]);
    assert_eq!(verdict, TC_ACT_OK);
    assert_changed_within(&back_frags[1], &back, &address_fields::<F>(F::DST));
    assert_eq!(back, expected[1], "only the destination address changes");
    assert_eq!(h.counter(Counter::ReverseTranslated), 2);

    // On ingress a later fragment of no known datagram passes untouched: it may be the node's.
    let unknown = fragments(F::REMOTE, F::NODE, UDP, &reply, reply_id ^ 1, 48);
    assert_eq!(h.ingress(&unknown[1]), (TC_ACT_OK, unknown[1].clone()));
}

/// A ping too big for the path, fragmented: its first fragment carries the echo header, whose
/// checksum (over the whole message) moves by exactly the translation; the later fragment takes
/// the node's address, and the fragmented reply comes back whole.
fn a_fragmented_ping_is_translated_and_its_fragmented_reply_restored<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let body: Vec<u8> = (0..200u8).collect();
    let id = 0x0bad_cafe;
    let message = |src, dst, kind, ident: u16| {
        let [a, b] = ident.to_be_bytes();
        icmp_message(src, dst, kind, 0, [a, b, 0, 9], &body)
    };
    let request = message(F::POD, F::REMOTE, F::ECHO_REQUEST, 0x7777);
    let frags = fragments(F::POD, F::REMOTE, F::ICMP, &request, id, 104);
    assert_eq!(frags.len(), 2);
    let l4 = F::packet_at(&frags[0], IP).unwrap().l4;
    let echo_checksums = checksums::<F>(l4 + 2);
    let (verdict, first) = h.egress(&frags[0]);
    assert_eq!(verdict, TC_ACT_OK);
    let ident = word(&first, l4 + 4);
    assert!(in_spans(ident));
    let mut fields = address_fields::<F>(F::SRC);
    fields.push(range(l4 + 2, 4));
    assert_changed_within(&frags[0], &first, &fields);
    let sent = message(F::NODE, F::REMOTE, F::ECHO_REQUEST, ident);
    let expected = fragments(F::NODE, F::REMOTE, F::ICMP, &sent, id, 104);
    assert_frame(&first, &expected[0], &echo_checksums);
    let whole = [&first[l4..], &request[104..]].concat();
    assert_eq!(
        residual(F::NODE, F::REMOTE, F::ICMP, &whole),
        0,
        "reassembled"
    );
    let (verdict, later) = h.egress(&frags[1]);
    assert_eq!((verdict, &later), (TC_ACT_OK, &expected[1]));

    let reply = message(F::REMOTE, F::NODE, F::ECHO_REPLY, ident);
    let back_frags = fragments(F::REMOTE, F::NODE, F::ICMP, &reply, id, 104);
    let restored = message(F::REMOTE, F::POD, F::ECHO_REPLY, 0x7777);
    let expected = fragments(F::REMOTE, F::POD, F::ICMP, &restored, id, 104);
    let (verdict, back) = h.ingress(&back_frags[0]);
    assert_eq!(verdict, TC_ACT_OK);
    let mut fields = address_fields::<F>(F::DST);
    fields.push(range(l4 + 2, 4));
    assert_changed_within(&back_frags[0], &back, &fields);
    assert_frame(&back, &expected[0], &echo_checksums);
    let (verdict, back) = h.ingress(&back_frags[1]);
    assert_eq!((verdict, &back), (TC_ACT_OK, &expected[1]));
    assert_eq!(h.counter(Counter::Masqueraded), 2);
    assert_eq!(h.counter(Counter::ReverseTranslated), 2);
}

//! What only IPv4 has: UDP without a checksum, and headers that lie about their length.

use std::net::Ipv4Addr;

use masq_agent::dataplane::ebpf::testbed::{TC_ACT_OK, TestBed};
use masq_ebpf::{Counter, NatEntryV4, NatKeyV4, direction, program_names};
use masq_testbed::packet::*;

use crate::{family::*, flows::flow_last_seen_at};

const NODE: Ipv4Addr = <Ipv4Addr as HarnessFamily>::NODE;
const POD: Ipv4Addr = <Ipv4Addr as HarnessFamily>::POD;
const REMOTE: Ipv4Addr = <Ipv4Addr as HarnessFamily>::REMOTE;

/// `f` with its UDP checksum made 0: "none", which IPv4 allows.
fn without_udp_checksum(mut f: Vec<u8>) -> Vec<u8> {
    f[L4 + 6..L4 + 8].copy_from_slice(&[0, 0]);
    f
}

#[test]
fn a_udp_datagram_without_a_checksum_keeps_none() {
    let mut h = harness::<Ipv4Addr>();
    let dgram = without_udp_checksum(udp(POD, 5354, REMOTE, 53));
    let (verdict, out) = h.egress(&dgram);
    assert_eq!(verdict, TC_ACT_OK);
    let port = word(&out, L4);
    assert_changed_within(&dgram, &out, &egress_fields::<Ipv4Addr>(L4, UDP));
    let expected = without_udp_checksum(udp(NODE, port, REMOTE, 53));
    assert_eq!(out, expected, "a zero UDP checksum stays zero");

    let reply = without_udp_checksum(udp(REMOTE, 53, NODE, port));
    let (_, back) = h.ingress(&reply);
    let restored = without_udp_checksum(udp(REMOTE, 53, POD, 5354));
    assert_eq!(back, restored);
}

/// An error about a UDP reply that came without a checksum leaves quoting it as it arrived:
/// still without one.
#[test]
fn an_egress_icmp_error_about_a_udp_reply_without_a_checksum_keeps_none() {
    let mut h = harness::<Ipv4Addr>();
    let flow = h.answered(&udp(POD, 40003, REMOTE, 53), |left| {
        without_udp_checksum(udp(REMOTE, 53, NODE, word(left, L4)))
    });
    let unreachable = <Ipv4Addr as HarnessFamily>::PORT_UNREACHABLE;
    let quote_len = flow.restored.len() - IP;
    let error = icmp_error((POD, REMOTE), unreachable, &flow.restored, quote_len);
    let (verdict, out) = h.egress(&error);
    assert_eq!(verdict, TC_ACT_OK);
    let expected = icmp_error((NODE, REMOTE), unreachable, &flow.arrived, quote_len);
    assert_frame(&out, &expected, &error_checksums::<Ipv4Addr>(&out));
    assert!(checksums_ok::<Ipv4Addr>(&out));
    let quoted_udp_checksum = L4 + 8 + 20 + 6;
    assert_eq!(
        word(&out, quoted_udp_checksum),
        0,
        "no UDP checksum stays none"
    );
    assert_eq!(h.counter(Counter::IcmpErrorMasqueraded), 1);
}

#[test]
fn odd_and_truncated_packets_pass_unmodified() {
    let mut h = harness::<Ipv4Addr>();
    let good = tcp(POD, 1000, REMOTE, 443, SYN);
    // An IHL below the minimum, a TCP header cut short, a UDP header cut short, an ARP frame,
    // an IPv6 frame. (The kernel's test runner refuses IP frames shorter than an IP header.)
    let mut bad_ihl = good.clone();
    bad_ihl[IP] = 0x44;
    let short_tcp = good[..40].to_vec();
    let short_udp = udp(POD, 1000, REMOTE, 53)[..38].to_vec();
    let mut arp = good.clone();
    arp[12..14].copy_from_slice(&[0x08, 0x06]);
    let mut ipv6 = good.clone();
    ipv6[12..14].copy_from_slice(&ETHERTYPE_IPV6.to_be_bytes());
    for packet in [bad_ihl, short_tcp, short_udp, arp, ipv6] {
        for program in [program_names::EGRESS, program_names::INGRESS] {
            let run = h.run(program, &packet, 1).unwrap();
            assert_eq!(
                (run.verdict, &run.frame),
                (TC_ACT_OK, &packet),
                "{program} {packet:02x?}"
            );
        }
    }
    assert!(h.nat().is_empty());
}

/// The agent reads and prunes a large table whole (a hash table with batch commands, the slot
/// table through its mapping); the table is family-blind, so one family shows it.
#[test]
fn the_sweep_reads_and_prunes_a_large_table_whole() {
    let mut h = <Ipv4Addr as HarnessFamily>::bed(16_384, &[(1024, 65535)], true);
    // More entries than one batch call carries, so that the kernel's cursor is followed.
    let keys: Vec<NatKeyV4> = (0..10_000u32)
        .map(|i| {
            let [a, b, c, d] = i.to_be_bytes();
            NatKeyV4 {
                saddr: [10, a, b, c],
                daddr: [203, 0, 113, d],
                sport: 1000,
                dport: 80,
                proto: TCP,
                direction: direction::INGRESS,
                _pad: [0; 2],
            }
        })
        .collect();
    for key in &keys {
        h.maps.nat.v4.write(key, &NatEntryV4::default()).unwrap();
    }
    let read: Vec<(NatKeyV4, NatEntryV4)> = h.maps.nat.v4.read_all().unwrap();
    assert_eq!(read.len(), keys.len());
    let mut read_keys: Vec<_> = read.iter().map(|(k, _)| *k).collect();
    read_keys.sort_by_key(|k| (k.saddr, k.daddr));
    assert!(read_keys == keys, "every key read back, once");

    // Half the keys, with some already gone in between: those are skipped, not fatal.
    let mut doomed: Vec<_> = keys[..5_000].to_vec();
    doomed.insert(100, keys[9_999]);
    h.maps.nat.v4.remove(&keys[9_999]).unwrap();
    doomed.insert(4_000, keys[9_999]);
    let deleted = h.maps.nat.v4.remove_all(&doomed).unwrap();
    assert_eq!(deleted, 5_000);
    assert_eq!(h.nat().len(), keys.len() - 5_001);
}

/// Each slot table has a seed of its own, at random and never the unseeded hash's 0, and the
/// programs place each half where the agent, by the same seed, looks for it.
#[test]
fn each_slot_table_has_a_seed_of_its_own_which_the_programs_and_the_agent_share() {
    let seeds: Vec<u64> = (0..2)
        .map(|_| {
            TestBed::in_table(true, || {
                let mut h = harness::<Ipv4Addr>();
                for port in 5000..5064 {
                    let (verdict, _) = h.egress(&udp(POD, port, REMOTE, 53));
                    assert_eq!(verdict, TC_ACT_OK);
                }
                let halves = h.maps.nat.v4.read_all().unwrap();
                assert_eq!(halves.len(), 2 * 64);
                for (key, entry) in &halves {
                    assert_eq!(h.maps.nat.v4.get(key).as_ref(), Some(entry), "{key:?}");
                }
                h.maps.nat.v4.slot_seed().unwrap()
            })
        })
        .collect();
    assert!(seeds.iter().all(|&seed| seed != 0), "{seeds:x?}");
    assert_ne!(seeds[0], seeds[1]);
}

/// A slot table made as the agent makes it, for 4 096 halves, has room to spare in buckets of
/// no power of two, which keys find by another reduction of their hash: it takes every flow it
/// was made for without a drop, the programs place each half where the agent looks for it, and
/// each reply finds its flow.
#[test]
fn a_table_the_agent_makes_holds_every_flow_it_was_made_for_without_a_drop() {
    const HALVES: u32 = 4096;
    let bed = TestBed::in_table(true, || TestBed::like_the_agents(HALVES, 0)).unwrap();
    let mut h = Ipv4Addr::configure(bed, &[(1024, 65535)], true);
    let buckets = masq_ebpf::slot_table::buckets_for(HALVES);
    assert!(!buckets.is_power_of_two(), "{buckets}");
    let mut replies = Vec::new();
    for n in 0..HALVES / 2 {
        let (pod_port, remote_port) = (10_000 + (n % 5000) as u16, 53 + (n / 5000) as u16);
        let (verdict, out) = h.egress(&udp(POD, pod_port, REMOTE, remote_port));
        assert_eq!((verdict, src(&out)), (TC_ACT_OK, NODE), "flow {n}");
        replies.push((udp(REMOTE, remote_port, NODE, word(&out, L4)), pod_port));
    }
    assert_eq!(h.counter(Counter::NatEarlyDropped), 0);
    assert_eq!(h.counter(Counter::DropNatTableFull), 0);
    let halves = h.maps.nat.v4.read_all().unwrap();
    assert_eq!(halves.len(), HALVES as usize);
    for (key, entry) in &halves {
        assert_eq!(h.maps.nat.v4.get(key).as_ref(), Some(entry), "{key:?}");
    }
    for (reply, pod_port) in replies {
        let (verdict, back) = h.ingress(&reply);
        assert_eq!(
            (verdict, dst(&back), word(&back, L4 + 2)),
            (TC_ACT_OK, POD, pod_port)
        );
    }
}

/// The programs stamp a flow by the kernel's tick count, which the loader measured: a tick a
/// kernel may have, and a stamp within a tick before CLOCK_MONOTONIC, as the kernel's coarse
/// clock would give it. The agent's check of the tick at each sweep finds it where it was.
#[test]
fn flows_are_stamped_by_the_kernels_tick_within_a_tick_of_the_clock() {
    use masq_agent::dataplane::ebpf::flow_table::monotonic_now_ns;
    let mut h = harness::<Ipv4Addr>();
    let clock = h.tick_clock().expect("the tick measured");
    assert!(
        [100, 250, 300, 1000]
            .map(|hz| 1_000_000_000 / hz)
            .contains(&clock.tick_ns),
        "{clock:?}"
    );
    let before = monotonic_now_ns();
    let (verdict, _) = h.egress(&udp(POD, 5000, REMOTE, 53));
    let after = monotonic_now_ns();
    assert_eq!(verdict, TC_ACT_OK);
    let halves = h.maps.nat.v4.read_all().unwrap();
    assert_eq!(halves.len(), 2);
    for (key, entry) in halves {
        let stamp = entry.last_seen_ns;
        assert!(
            before.saturating_sub(clock.tick_ns) <= stamp && stamp <= after,
            "{key:?}: stamped {stamp}, CLOCK_MONOTONIC {before}..{after}"
        );
    }
    h.keep_the_tick().unwrap();
    assert_eq!(h.tick_clock(), Some(clock));
}

/// A datagram from outside to the limited broadcast reaches no pod: it opens no flow, as
/// multicast and link-local destinations open none in either family.
#[test]
fn a_datagram_to_the_limited_broadcast_opens_no_flow() {
    let mut h = harness::<Ipv4Addr>();
    let broadcast = udp(REMOTE, 68, Ipv4Addr::BROADCAST, 67);
    assert_eq!(h.ingress(&broadcast), (TC_ACT_OK, broadcast.clone()));
    assert_eq!(h.counter(Counter::InboundTracked), 0);
    assert!(h.nat().is_empty());
    // A unicast datagram to a pod opens one, which is what the above would have done.
    h.ingress(&udp(REMOTE, 68, POD, 67));
    assert_eq!(h.counter(Counter::InboundTracked), 1);
}

/// A connection from outside into a full slot table needs room for two halves, each in two
/// buckets of its own, which may meet. Here the ingress half's first bucket is one of the
/// egress half's; the flow idle longest has a half in the ingress half's other bucket, the next
/// one a half in the bucket they share, and neither has its other half where the connection
/// could use it. The first drop makes room for the ingress half, the second, in the shared
/// bucket, for the egress half: the connection gets it only if the ingress half keeps the room
/// of the first drop meanwhile. Given back between the drops, it would take the shared bucket's
/// room, the first of its two, and the connection would be refused after two drops.
#[test]
fn a_connection_from_outside_whose_halves_buckets_meet_takes_two_drops_in_a_full_slot_table() {
    const SLOTS: u32 = 32;
    let bed = TestBed::in_table(true, || TestBed::unconfigured_in(SLOTS, true)).unwrap();
    let mut h = Ipv4Addr::configure(bed, &[(1024, 65535)], true);
    let buckets = SLOTS / masq_ebpf::slot_table::BUCKET_SLOTS;
    for pod_port in 20_000.. {
        if h.nat().len() == SLOTS as usize {
            break;
        }
        assert!(pod_port < 30_000, "the table fills");
        let (verdict, _) = h.egress(&udp(POD, pod_port, REMOTE, 53));
        assert_eq!(verdict, TC_ACT_OK);
    }
    let seed = h.maps.nat.v4.slot_seed().unwrap();
    let place = |key: &NatKeyV4| masq_ebpf::slot_table::Place::of(key, buckets, seed).buckets;
    let table = &h.maps.nat.v4;
    // Each flow by its egress key, with the buckets its two halves are in.
    let flows: Vec<(NatKeyV4, [u32; 2])> = h
        .nat()
        .into_iter()
        .filter(|(key, _)| key.direction == direction::EGRESS)
        .map(|(key, entry)| {
            let held = |key: &NatKeyV4| table.bucket_of(key).expect("held");
            (key, [held(&key), held(&key.reverse(&entry))])
        })
        .collect();
    let with_halves_in = |a: u32, b: u32| {
        flows
            .iter()
            .find(|(_, held)| *held == [a, b] || *held == [b, a])
            .map(|(key, _)| *key)
    };
    let (client_port, halves, idle_longest, idle_next) = (10_000..20_000)
        .find_map(|client_port| {
            let ingress = key((REMOTE, client_port), (POD, 8080), TCP, direction::INGRESS);
            let egress = key((POD, 8080), (REMOTE, client_port), TCP, direction::EGRESS);
            let ([shared, own], egress_buckets) = (place(&ingress), place(&egress));
            if !egress_buckets.contains(&shared) || egress_buckets.contains(&own) {
                return None;
            }
            let egress_own = egress_buckets[0] + egress_buckets[1] - shared;
            let rest = (0..buckets).find(|b| ![shared, own, egress_own].contains(b))?;
            Some((
                client_port,
                [ingress, egress],
                with_halves_in(own, rest)?,
                with_halves_in(shared, rest)?,
            ))
        })
        .expect("a connection and two flows placed so");
    let newest = h.nat().iter().map(|(_, e)| e.last_seen_ns).max().unwrap();
    let second = 1_000_000_000;
    // Idle 9 s and 5 s, within UDP's 30 s: flows a full table may drop, not flows that are over.
    for (flow, idle) in [(idle_longest, 9 * second), (idle_next, 5 * second)] {
        flow_last_seen_at::<Ipv4Addr>(&mut h, &flow, newest - idle);
    }
    let syn = tcp(REMOTE, client_port, POD, 8080, SYN);
    assert_eq!(h.ingress(&syn), (TC_ACT_OK, syn));
    assert_eq!(h.counter(Counter::InboundTracked), 1);
    assert_eq!(h.counter(Counter::DropNatTableFull), 0);
    let after = h.nat();
    let held = |key: &NatKeyV4| after.iter().any(|(k, _)| k == key);
    assert!(!held(&idle_longest) && !held(&idle_next), "the two dropped");
    assert_eq!(after.len(), SLOTS as usize - 2, "two flows for one");
    for half in halves {
        assert!(held(&half), "the connection's half {half:?}");
    }
}

//! The programs' index of the IPv4 policy trie: its answers are the trie's, for policies that
//! nest and cut exceptions into each other; the programs take them only while the index holds
//! the generation in force; a policy the index has no room for is answered by the trie where
//! it does not fit; a change of one prefix rewrites a few chunks.

use std::net::Ipv4Addr;

use aya::maps::lpm_trie::Key;
use ipnet::Ipv4Net;
use masq_agent::dataplane::ebpf::testbed::{TC_ACT_OK, TestBed};
use masq_ebpf::{PolicyEntry, prefix_action};
use masq_testbed::{packet::*, prefixes::XorShift};

use crate::family::*;

const NODE: Ipv4Addr = <Ipv4Addr as HarnessFamily>::NODE;
const POD: Ipv4Addr = <Ipv4Addr as HarnessFamily>::POD;

/// Random 32-bit numbers, the same on every run.
struct Rng(XorShift);

impl Rng {
    fn next(&mut self) -> u32 {
        (self.0.next_u64() >> 11) as u32
    }
}

/// A policy of `count` prefixes of every length from 8 on, most inside 100.64.0.0/10 so that
/// they nest, a quarter of them exceptions; each once.
fn nesting_policy(rng: &mut Rng, count: usize) -> (Vec<Ipv4Net>, Vec<Ipv4Net>) {
    let (mut non_masq, mut exceptions) = (Vec::new(), Vec::new());
    let mut seen = std::collections::HashSet::new();
    while non_masq.len() + exceptions.len() < count {
        let len = 8 + (rng.next() % 25) as u8;
        let addr = Ipv4Addr::from(0x6440_0000 | (rng.next() & 0x003f_ffff));
        let net = Ipv4Net::new(addr, len).unwrap().trunc();
        if !seen.insert(net) {
            continue;
        }
        if rng.next().is_multiple_of(4) {
            exceptions.push(net);
        } else {
            non_masq.push(net);
        }
    }
    (non_masq, exceptions)
}

/// Whether the longest of the prefixes that hold `addr` keeps the pod's address, by trying
/// them all: shares nothing with the index or the trie.
fn keeps_address(policy: &(Vec<Ipv4Net>, Vec<Ipv4Net>), addr: Ipv4Addr) -> bool {
    let kept = policy.0.iter().map(|n| (n, true));
    let cut = policy.1.iter().map(|n| (n, false));
    kept.chain(cut)
        .filter(|(n, _)| n.contains(&addr))
        .max_by_key(|(n, _)| n.prefix_len())
        .is_some_and(|(_, keeps)| keeps)
}

/// Sends a datagram of its own from the pod to `addr`: whether it left with the pod's address.
fn left_with_the_pod_s_address(h: &mut TestBed, addr: Ipv4Addr, sport: u16) -> bool {
    let (verdict, out) = h.egress(&udp(POD, sport, addr, 53));
    assert_eq!(verdict, TC_ACT_OK, "{addr}");
    let source = src(&out);
    assert!(source == POD || source == NODE, "{addr}: {source}");
    source == POD
}

/// The addresses at and around each prefix's ends, and one inside.
fn probes(rng: &mut Rng, nets: &[Ipv4Net]) -> Vec<Ipv4Addr> {
    nets.iter()
        .flat_map(|net| {
            let (first, last) = (u32::from(net.network()), u32::from(net.broadcast()));
            let inside = first + rng.next() % (last - first).saturating_add(1).max(1);
            [
                first.wrapping_sub(1),
                first,
                inside,
                last,
                last.wrapping_add(1),
            ]
        })
        .map(Ipv4Addr::from)
        .collect()
}

fn set(h: &mut TestBed, policy: &(Vec<Ipv4Net>, Vec<Ipv4Net>)) {
    set_policy::<Ipv4Addr>(h, &policy.0, &policy.1);
}

#[test]
fn the_index_answers_each_destination_as_its_longest_prefix_does() {
    let mut rng = Rng(XorShift(0x9e37_79b9_7f4a_7c15));
    let mut h = Ipv4Addr::bed(1 << 14, &SPANS, true);
    let mut policy = nesting_policy(&mut rng, 150);
    set(&mut h, &policy);
    let written = h.maps.policy.index_v4.last_write();
    assert!(written.chunks_written > 20, "{written:?}");
    assert_eq!(written.left_to_the_trie, 0);
    let all: Vec<Ipv4Net> = policy.0.iter().chain(&policy.1).copied().collect();
    let mut sport = 1024;
    for addr in probes(&mut rng, &all) {
        sport += 1;
        let left = left_with_the_pod_s_address(&mut h, addr, sport);
        assert_eq!(left, keeps_address(&policy, addr), "{addr}");
    }

    // One more exception, deep in the policy: a few chunks change, and its answers with them.
    let deep = Ipv4Net::new(Ipv4Addr::new(100, 70, 3, 4), 31).unwrap();
    policy.1.push(deep);
    set(&mut h, &policy);
    let written = h.maps.policy.index_v4.last_write();
    assert!(
        (1..20).contains(&written.chunks_written),
        "a top-level chunk and those under its /16: {written:?}"
    );
    for addr in probes(&mut rng, &[deep]) {
        sport += 1;
        let left = left_with_the_pod_s_address(&mut h, addr, sport);
        assert_eq!(left, keeps_address(&policy, addr), "{addr}");
    }
}

/// A prefix written to the trie behind the agent's back changes nothing while the index holds
/// the generation in force, and everything once the generation moves on, as every change the
/// agent makes moves it.
#[test]
fn the_programs_take_the_index_s_answer_only_while_it_holds_the_generation_in_force() {
    let mut h = harness::<Ipv4Addr>();
    let inside = Ipv4Addr::new(10, 96, 0, 10);
    assert!(left_with_the_pod_s_address(&mut h, inside, 1000));
    let exception = PolicyEntry {
        action: prefix_action::MASQUERADE,
        ..PolicyEntry::default()
    };
    let key = Key::new(16, [10, 96, 0, 0]);
    h.maps
        .policy
        .v4
        .non_masq
        .insert(&key, exception, 0)
        .unwrap();
    assert!(
        left_with_the_pod_s_address(&mut h, inside, 1001),
        "the index answered, not the trie"
    );
    h.maps.policy.word.next_generation().unwrap();
    assert!(
        !left_with_the_pod_s_address(&mut h, inside, 1002),
        "the trie answered, once the index was stale"
    );
}

/// Host prefixes each under a /16 of its own take a chunk a level each: more than the index of
/// a bed sized for a small policy has room for. The index leaves the largest parts to the trie,
/// and every destination is answered right.
#[test]
fn a_policy_the_index_has_no_room_for_is_answered_by_the_trie_where_it_does_not_fit() {
    let mut rng = Rng(XorShift(0x2545_f491_4f6c_dd1d));
    let mut h = harness::<Ipv4Addr>();
    let hosts: Vec<Ipv4Net> = (0..400u32)
        .map(|i| {
            let addr = 0x6440_0000 + (i << 16) + (rng.next() & 0xffff);
            Ipv4Net::new(Ipv4Addr::from(addr), 32).unwrap()
        })
        .collect();
    let policy = (hosts.clone(), Vec::new());
    set(&mut h, &policy);
    let written = h.maps.policy.index_v4.last_write();
    assert!(written.left_to_the_trie > 0, "{written:?}");
    assert!(written.left_to_the_trie < hosts.len(), "{written:?}");
    let mut sport = 1024;
    for (i, addr) in probes(&mut rng, &hosts).into_iter().enumerate() {
        // Every host, and some of the neighbours, which take a flow each.
        if i % 5 != 1 && i % 25 != 0 {
            continue;
        }
        sport += 1;
        let left = left_with_the_pod_s_address(&mut h, addr, sport);
        assert_eq!(left, keeps_address(&policy, addr), "{addr}");
    }
}

//! The programs' index of the IPv4 policy trie: its answers are the trie's, for policies that
//! nest and cut exceptions into each other; the programs take them only while the index holds
//! the generation in force; a policy the index has no room for is answered by the trie where
//! it does not fit; a change of one prefix rewrites a few chunks; changes that come faster than
//! the index is written are answered right throughout, and the index catches up.

use std::net::Ipv4Addr;

use aya::maps::lpm_trie::Key;
use ipnet::Ipv4Net;
use masq_agent::{
    dataplane::ebpf::testbed::{TC_ACT_OK, TestBed},
    policy::Policy,
};
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
    let written = h.maps.policy.index_settled();
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
    let written = h.maps.policy.index_settled();
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
    let written = h.maps.policy.index_settled();
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

/// Changes synced one right after another, faster than the index's thread writes them (none
/// waits for it): every packet is answered by the policy in force, by the index or the trie,
/// and once the thread has caught up, the index holds the last policy and answers with the
/// generation in force: a prefix written to the trie behind the agent's back changes nothing.
#[test]
fn the_index_catches_up_with_changes_that_come_faster_than_it_is_written() {
    let mut rng = Rng(XorShift(0x5851_f42d_4c95_7f2d));
    let mut h = Ipv4Addr::bed(1 << 14, &SPANS, true);
    let mut policy = nesting_policy(&mut rng, 400);
    set(&mut h, &policy);
    let mut sport = 1024;
    for round in 0..12u32 {
        // A /28 of its own each round, kept and then cut out in turn, under a /16 of its own.
        let net = Ipv4Net::new(Ipv4Addr::from(0xc612_0000 | (round << 8)), 28).unwrap();
        match round % 2 {
            0 => policy.0.push(net),
            _ => policy.1.push(net),
        }
        let in_force = Policy {
            non_masq_v4: policy.0.clone(),
            masq_v4: policy.1.clone(),
            non_masq_v6: None,
            masq_v6: Vec::new(),
            ipv6_switched_off: false,
            non_masq_src_v4: Vec::new(),
            masq_src_v4: Vec::new(),
            non_masq_src_v6: Vec::new(),
            masq_src_v6: Vec::new(),
            masquerade_address_v4: None,
            masquerade_address_v6: None,
        };
        let maps = &mut h.maps;
        maps.policy.sync(&in_force, &mut maps.settings).unwrap();
        for addr in probes(&mut rng, &[net]) {
            sport += 1;
            let left = left_with_the_pod_s_address(&mut h, addr, sport);
            assert_eq!(left, keeps_address(&policy, addr), "round {round}: {addr}");
        }
    }
    let written = h.maps.policy.index_settled();
    assert_eq!(written.left_to_the_trie, 0, "{written:?}");
    let all: Vec<Ipv4Net> = policy.0.iter().chain(&policy.1).copied().collect();
    let addrs = probes(&mut rng, &all);
    for &addr in &addrs {
        sport += 1;
        let left = left_with_the_pod_s_address(&mut h, addr, sport);
        assert_eq!(left, keeps_address(&policy, addr), "{addr}");
    }
    // Behind the agent's back, a host prefix masquerading each of fifty destinations the
    // policy keeps: the index, stamped with the generation in force, still answers.
    let kept: Vec<Ipv4Addr> = addrs
        .into_iter()
        .filter(|&a| keeps_address(&policy, a))
        .take(50)
        .collect();
    assert_eq!(kept.len(), 50);
    let masquerade = PolicyEntry {
        action: prefix_action::MASQUERADE,
        ..PolicyEntry::default()
    };
    for addr in &kept {
        let trie = &mut h.maps.policy.v4.non_masq;
        trie.insert(&Key::new(32, addr.octets()), masquerade, 0)
            .unwrap();
    }
    for addr in kept {
        sport += 1;
        assert!(
            left_with_the_pod_s_address(&mut h, addr, sport),
            "{addr}: the trie answered, not the index"
        );
    }
}

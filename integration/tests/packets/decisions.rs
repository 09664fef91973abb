//! Which policy entry decided what: each entry counts the packets of no known flow it decides
//! (a masqueraded flow once, at its first packet; a flow that keeps its address at every
//! packet), through policy changes, as the agent's `status` and metrics read it.

use std::net::IpAddr;

use ipnet::IpNet;
use masq_agent::{
    dataplane::ebpf::testbed::TC_ACT_OK,
    policy::{Action, Rules},
};
use masq_ebpf::{Counter, sources_decided};
use masq_testbed::packet::*;

use crate::family::*;

in_both_families!(
    each_policy_entry_counts_the_decisions_it_takes,
    an_entry_that_changes_action_is_counted_from_zero,
    the_counts_read_in_batches_and_slot_by_slot_agree,
    a_source_left_alone_keeps_the_address_and_counts_for_its_entry,
);

/// The entry of the test bed's policy that holds `addr`.
fn entry_of<F: HarnessFamily>(addr: F) -> IpNet {
    let addr: IpAddr = addr.into();
    nets::<F>(F::POLICY)
        .into_iter()
        .map(Into::into)
        .find(|net: &IpNet| net.contains(&addr))
        .expect("an entry of the test bed's policy")
}

/// `addr` as a prefix of its own.
fn host<F: HarnessFamily>(addr: F) -> F::Net {
    format!("{addr}/{}", F::ADDR_LEN * 8).parse().unwrap()
}

fn each_policy_entry_counts_the_decisions_it_takes<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let service = entry_of::<F>(F::SERVICE);
    assert_eq!(h.decisions_of(service), Some(Some(0)));
    assert_eq!(h.decided_by_default(), 0);

    // A masqueraded flow is decided once, by no entry: its NAT entry carries the rest.
    let syn = tcp(F::POD, 40000, F::REMOTE, 80, SYN);
    assert_eq!(F::at(&h.egress(&syn).1, F::SRC), F::NODE);
    h.egress(&tcp(F::POD, 40000, F::REMOTE, 80, ACK));
    assert_eq!(h.decided_by_default(), 1);

    // A flow that keeps its address is decided at every packet; the second one comes from
    // IPv4's index or IPv6's verdict cache, which must carry the entry too.
    let to_service = udp(F::POD, 5353, F::SERVICE, 53);
    for _ in 0..2 {
        assert_eq!(h.egress(&to_service), (TC_ACT_OK, to_service.clone()));
    }
    assert_eq!(h.decisions_of(service), Some(Some(2)));

    // The node's own packets are not the policy's to decide.
    h.egress(&udp(F::NODE, 5353, F::SERVICE, 53));
    h.egress(&udp(F::NODE, 5354, F::REMOTE, 53));
    assert_eq!(h.decisions_of(service), Some(Some(2)));
    assert_eq!(h.decided_by_default(), 1);

    // An exception added inside a new prefix: the entries that stay keep their counts, and the
    // new ones count from zero.
    let exception = host(F::REMOTE);
    set_policy::<F>(&mut h, &policy_with(F::REMOTE_NET), &[exception]);
    assert_eq!(h.decisions_of(service), Some(Some(2)));
    assert_eq!(h.decisions_of(exception.into()), Some(Some(0)));
    let new = udp(F::POD, 4101, F::REMOTE, 53);
    assert_eq!(F::at(&h.egress(&new).1, F::SRC), F::NODE);
    assert_eq!(h.decisions_of(exception.into()), Some(Some(1)));
    let kept = udp(F::POD, 4102, F::ROUTER, 53);
    assert_eq!(h.egress(&kept), (TC_ACT_OK, kept.clone()));
    let (len, network) = F::REMOTE_NET;
    let remote_net: IpNet = format!("{network}/{len}").parse().unwrap();
    assert_eq!(h.decisions_of(remote_net), Some(Some(1)));
    assert_eq!(h.decided_by_default(), 1, "no decision was the default's");
}

fn an_entry_that_changes_action_is_counted_from_zero<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let remote = host(F::REMOTE);
    set_policy::<F>(&mut h, &nets::<F>(F::POLICY), &[remote]);
    let packet = udp(F::POD, 4000, F::REMOTE, 53);
    h.egress(&packet);
    assert_eq!(h.decisions_of(remote.into()), Some(Some(1)));

    let mut policy = nets::<F>(F::POLICY);
    policy.push(remote);
    set_policy::<F>(&mut h, &policy, &[]);
    assert_eq!(
        h.decisions_of(remote.into()),
        Some(Some(0)),
        "a non-masquerade entry now: another entry than the exception"
    );
    let fresh = udp(F::POD, 4001, F::REMOTE, 53);
    assert_eq!(h.egress(&fresh), (TC_ACT_OK, fresh.clone()));
    assert_eq!(h.decisions_of(remote.into()), Some(Some(1)));
}

/// Past the counters' slots, entries go uncounted, and still decide; once slots are free again,
/// the next sync gives them one.
#[test]
fn entries_past_the_counters_go_uncounted_and_still_decide() {
    use std::net::Ipv4Addr;

    use masq_agent::dataplane::ebpf::prefixes;
    use masq_ebpf::decision_slot;

    let mut h = harness::<Ipv4Addr>();
    let slots = h.maps.policy.decisions.len();
    let hosts = |n: u32| -> Vec<ipnet::Ipv4Net> {
        // 100.64.0.0/10, as far as it goes: not a prefix of the test bed's.
        (0..n)
            .map(|i| ipnet::Ipv4Net::new(Ipv4Addr::from(0x6440_0000 + i), 32).unwrap())
            .collect()
    };
    let uncounted = |h: &masq_agent::dataplane::ebpf::testbed::TestBed| {
        prefixes::entries(&h.maps.policy.v4.non_masq)
            .values()
            .filter(|e| e.counted_in == decision_slot::UNCOUNTED)
            .count()
    };
    let many = hosts(slots + 50);
    set_policy::<Ipv4Addr>(&mut h, &many, &[]);
    // Every slot but the default's counts an entry; the harness's own entries held theirs
    // until the writes were done.
    let harness_entries = <Ipv4Addr as HarnessFamily>::POLICY.len();
    assert_eq!(uncounted(&h), 51 + harness_entries);
    let last = *many.last().unwrap();
    let packet = udp(<Ipv4Addr as HarnessFamily>::POD, 4000, last.addr(), 53);
    assert_eq!(h.egress(&packet), (TC_ACT_OK, packet.clone()), "still kept");

    // Removals come after the writes of a sync: the slots they free serve the next one.
    let fewer = &many[100..];
    set_policy::<Ipv4Addr>(&mut h, fewer, &[]);
    assert_eq!(uncounted(&h), 51, "the harness's entries' slots were given");
    set_policy::<Ipv4Addr>(&mut h, fewer, &[]);
    assert_eq!(uncounted(&h), 0, "every entry left has a slot");
    assert_eq!(h.decisions_of(last.into()), Some(Some(0)));
    h.egress(&packet);
    assert_eq!(h.decisions_of(last.into()), Some(Some(1)));
}

/// Kernels before 5.13 read per-CPU arrays only slot by slot: the agent's fallback reads what
/// the batch command reads.
fn the_counts_read_in_batches_and_slot_by_slot_agree<F: HarnessFamily>() {
    let mut h = harness::<F>();
    h.egress(&tcp(F::POD, 40000, F::REMOTE, 80, SYN));
    for _ in 0..3 {
        h.egress(&udp(F::POD, 5353, F::SERVICE, 53));
    }
    let (batched, by_slot) = h.decisions_both_ways();
    assert_eq!(batched, by_slot);
    assert!(batched.iter().sum::<u64>() >= 4, "{batched:?}");
}

/// A pod's source left alone keeps its address toward a destination the policy masquerades,
/// counted for the source entry at every packet, while another pod is masqueraded. The source
/// trie is asked only while the family's bit of `sources_decided` is set.
fn a_source_left_alone_keeps_the_address_and_counts_for_its_entry<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let alone: IpNet = host::<F>(F::POD).into();
    let rules: Rules = vec![(alone, Action::NonMasquerade)];
    let maps = &mut h.maps;
    let changed = maps
        .policy
        .set_source_rules(F::POLICY_FAMILY, &rules, &mut maps.settings);
    assert!(changed.unwrap());
    let to_remote = udp(F::POD, 5353, F::REMOTE, 53);
    for _ in 0..2 {
        assert_eq!(h.egress(&to_remote), (TC_ACT_OK, to_remote.clone()));
    }
    assert_eq!(h.counter(Counter::NotMasqNonMasqSource), 2);
    assert_eq!(h.decisions_of(alone), Some(Some(2)));
    let other = udp(F::POD2, 5353, F::REMOTE, 53);
    assert_eq!(
        F::at(&h.egress(&other).1, F::SRC),
        F::NODE,
        "another pod is masqueraded"
    );

    // The entry stays, the bit goes: the trie is not asked, and a new flow is masqueraded.
    let mut settings = h.maps.settings.get(&0, 0).unwrap();
    settings.sources_decided &= !(sources_decided::V4 | sources_decided::V6);
    h.maps.settings.set(0, settings, 0).unwrap();
    let new_flow = udp(F::POD, 5354, F::REMOTE, 53);
    assert_eq!(F::at(&h.egress(&new_flow).1, F::SRC), F::NODE);
    assert_eq!(h.counter(Counter::NotMasqNonMasqSource), 2);
}

//! Flows that outlive their policy: once the agent finds that no flow's entry leads toward a
//! destination the policy leaves alone, packets to and from such destinations skip the NAT
//! table;
//! a change to the policy makes every packet look its flow up again, until the flows it
//! stranded are gone.

use masq_agent::dataplane::ebpf::testbed::TC_ACT_OK;
use masq_ebpf::{Counter, direction};
use masq_testbed::packet::*;

use crate::family::*;

in_both_families!(
    packets_left_alone_skip_the_table_once_no_flow_outlived_the_policy,
    a_policy_change_looks_every_packet_up_until_its_strays_are_gone,
);

/// A masqueraded flow to the remote, its first packet sent: the key of its egress half.
fn masqueraded_flow<F: HarnessFamily>(h: &mut masq_agent::dataplane::ebpf::testbed::TestBed) {
    let syn = tcp(F::POD, 40000, F::REMOTE, 80, SYN);
    assert_eq!(F::at(&h.egress(&syn).1, F::SRC), F::NODE);
}

fn packets_left_alone_skip_the_table_once_no_flow_outlived_the_policy<F: HarnessFamily>() {
    let mut h = harness::<F>();
    masqueraded_flow::<F>(&mut h);
    assert!(
        !h.maps.policy.word.strays_cleared().unwrap(),
        "set by the policy"
    );
    assert!(h.clear_strays().unwrap(), "the only flow is masqueraded");
    assert!(h.maps.policy.word.strays_cleared().unwrap());

    // Left alone and counted as before, the pod's packets for their entry, the node's not.
    let to_service = udp(F::POD, 5353, F::SERVICE, 53);
    for _ in 0..2 {
        assert_eq!(h.egress(&to_service), (TC_ACT_OK, to_service.clone()));
    }
    let node_s = udp(F::NODE, 5353, F::SERVICE, 53);
    assert_eq!(h.egress(&node_s), (TC_ACT_OK, node_s.clone()));
    let service = nets::<F>(F::POLICY)
        .into_iter()
        .map(Into::into)
        .find(|net: &ipnet::IpNet| net.contains(&F::SERVICE.into()))
        .unwrap();
    assert_eq!(h.decisions_of(service), Some(Some(2)));
    // The masqueraded flow goes on, both ways.
    let ack = tcp(F::POD, 40000, F::REMOTE, 80, ACK);
    let (_, out) = h.egress(&ack);
    assert_eq!(F::at(&out, F::SRC), F::NODE);
    let reply = tcp(F::REMOTE, 80, F::NODE, word(&out, F::L4), ACK);
    assert_eq!(F::at(&h.ingress(&reply).1, F::DST), F::POD);
    // A connection from a remote end the policy masquerades, toward a pod (an address the
    // policy leaves alone, as the cluster's are), is remembered, so that the pod's replies keep
    // its address: the source decides, not the destination.
    let syn = tcp(F::REMOTE, 5555, F::POD, 8080, SYN);
    assert_eq!(h.ingress(&syn), (TC_ACT_OK, syn));
    assert_eq!(h.counter(Counter::InboundTracked), 1);
    let syn_ack = tcp(F::POD, 8080, F::REMOTE, 5555, SYN | ACK);
    assert_eq!(h.egress(&syn_ack), (TC_ACT_OK, syn_ack));

    // An entry toward the service, which no program writes while the flag is set: the table
    // is not looked at.
    let flow = key::<F>((F::POD, 40000), (F::REMOTE, 80), TCP, direction::EGRESS);
    let snat = F::nat_entry(&h, &flow).unwrap();
    let stray = key::<F>((F::POD, 5353), (F::SERVICE, 53), UDP, direction::EGRESS);
    F::plant(&mut h, &stray, snat);
    assert_eq!(h.egress(&to_service), (TC_ACT_OK, to_service.clone()));
    // Nor is it for a packet from the service to a pod (another node's pod connecting, or a
    // pod's flow to the service coming back), though a half planted under its tuple would
    // send it to another pod.
    let back = udp(F::SERVICE, 53, F::POD, 5353);
    let back_key = key::<F>((F::SERVICE, 53), (F::POD, 5353), UDP, direction::INGRESS);
    F::plant(
        &mut h,
        &back_key,
        masq_ebpf::NatEntry {
            addr: F::POD2.octets(),
            ..snat
        },
    );
    assert_eq!(h.ingress(&back), (TC_ACT_OK, back.clone()));

    // Unsure again, the programs look them up; and a check finds the flow.
    h.maps.policy.lower_strays_cleared().unwrap();
    assert_eq!(F::at(&h.egress(&to_service).1, F::SRC), F::NODE);
    assert_eq!(F::at(&h.ingress(&back).1, F::DST), F::POD2);
    assert!(!h.clear_strays().unwrap());
    F::remove(&mut h, &stray);
    F::remove(&mut h, &back_key);
    assert!(h.clear_strays().unwrap());
}

fn a_policy_change_looks_every_packet_up_until_its_strays_are_gone<F: HarnessFamily>() {
    let mut h = harness::<F>();
    masqueraded_flow::<F>(&mut h);
    assert!(h.clear_strays().unwrap());

    // The remote's prefix joins the policy: the flow to it is a stray, and stays masqueraded.
    set_policy::<F>(&mut h, &policy_with(F::REMOTE_NET), &[]);
    assert!(
        !h.maps.policy.word.strays_cleared().unwrap(),
        "cleared by the change"
    );
    let ack = tcp(F::POD, 40000, F::REMOTE, 80, ACK);
    assert_eq!(F::at(&h.egress(&ack).1, F::SRC), F::NODE);
    assert!(!h.clear_strays().unwrap(), "the flow outlived its policy");
    assert_eq!(F::at(&h.egress(&ack).1, F::SRC), F::NODE);
    let new = udp(F::POD, 4000, F::REMOTE, 53);
    assert_eq!(
        h.egress(&new),
        (TC_ACT_OK, new.clone()),
        "a new flow keeps its address"
    );

    // A change that decides nothing anew leaves the flag alone.
    let flow = key::<F>((F::POD, 40000), (F::REMOTE, 80), TCP, direction::EGRESS);
    let reply_half = F::nat(&h)
        .into_iter()
        .find(|(k, e)| k.direction == direction::INGRESS && e.addr == flow.saddr)
        .unwrap()
        .0;
    F::remove(&mut h, &flow);
    F::remove(&mut h, &reply_half);
    assert!(h.clear_strays().unwrap(), "the stray is gone");
    set_policy::<F>(&mut h, &policy_with(F::REMOTE_NET), &[]);
    assert!(
        h.maps.policy.word.strays_cleared().unwrap(),
        "the same policy again"
    );
    assert_eq!(
        h.egress(&ack),
        (TC_ACT_OK, ack.clone()),
        "no entry: left alone"
    );
}

/// An agent killed between its write to the trie and its move of the generation leaves the
/// verdicts cached before the write standing. The next agent's start moves the generation on,
/// so that no new flow is masqueraded by a stale verdict toward a destination the trie now
/// leaves alone: such a flow would stray, its later packets (another CPU's, or once the slot
/// is reused) skipping the table.
#[test]
fn a_restart_after_a_killed_sync_judges_no_flow_by_a_stale_verdict() {
    use std::net::Ipv4Addr;

    type V4 = Ipv4Addr;
    let mut h = harness::<V4>();
    masqueraded_flow::<V4>(&mut h);
    for (key, _) in <V4 as HarnessFamily>::nat(&h) {
        <V4 as HarnessFamily>::remove(&mut h, &key);
    }
    // The killed agent: the remote's prefix written, the generation as the verdict found it.
    let generation = h.maps.policy.word.0.get(&0, 0).unwrap();
    set_policy::<V4>(&mut h, &policy_with(<V4 as HarnessFamily>::REMOTE_NET), &[]);
    h.maps.policy.word.0.set(0, generation, 0).unwrap();

    // The next agent: its first apply, which finds the trie as the file wants it.
    h.maps.policy.lower_strays_cleared().unwrap();
    h.maps.policy.verify_next_sync();
    set_policy::<V4>(&mut h, &policy_with(<V4 as HarnessFamily>::REMOTE_NET), &[]);
    assert!(h.clear_strays().unwrap());

    let syn = tcp(V4::POD, 40001, V4::REMOTE, 80, SYN);
    assert_eq!(
        h.egress(&syn),
        (TC_ACT_OK, syn.clone()),
        "judged by the trie"
    );
    assert!(<V4 as HarnessFamily>::nat(&h).is_empty(), "no flow strays");
}

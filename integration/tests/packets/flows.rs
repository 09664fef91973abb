//! Flows out and their replies back: TCP, UDP and echo, ports, what is left alone, and policy
//! changes, in both families.

use masq_agent::dataplane::ebpf::{
    expiry,
    node_ports::{self, HeldPorts, NodePorts},
    testbed::{TC_ACT_OK, TC_ACT_SHOT, TestBed},
};
use masq_ebpf::{Counter, EARLY_DROP_PROBES, NatKey, direction, nat_kind};
use masq_testbed::packet::*;
use std::collections::HashSet;

use crate::{family::*, flow_state::Connection};

in_both_families!(
    tcp_egress_then_reply_ingress,
    udp_both_ways_and_two_pods_with_one_port_get_different_nat_ports,
    echo_request_gets_an_identifier_and_its_reply_is_restored,
    two_pods_with_one_source_port_get_different_nat_ports,
    without_random_fully_the_pods_port_is_kept_when_free,
    exhausted_ports_drop_and_count_never_mistranslate,
    a_full_nat_table_drops_early_what_conntrack_would_and_never_an_assured_flow,
    a_full_nat_table_drops_a_closing_connection_and_never_an_open_one,
    a_flow_made_in_the_room_of_another_cpus_drop_takes_its_slot,
    a_full_table_drops_the_flow_idle_longest_and_spares_a_handshake,
    a_full_table_takes_a_flow_that_is_over_before_any_other,
    a_full_table_takes_a_finished_connection_before_a_flow_idle_longer,
    a_sweep_under_pressure_points_the_drop_sample_at_what_a_full_table_may_drop,
    every_sweep_of_a_table_left_under_pressure_points_its_sample_again,
    a_flow_made_after_an_early_drop_searches_its_port_again,
    a_large_full_table_makes_room_for_each_new_flow_where_its_halves_go,
    a_full_table_gives_up_the_nodes_flows_for_a_pods_whatever_their_state,
    the_nodes_own_flows_and_masqueraded_ones_never_share_a_tuple,
    a_nodes_flow_that_clashes_in_a_full_table_makes_room_and_moves,
    the_nodes_own_ports_are_never_handed_out_and_take_no_entry,
    a_port_netfilter_uses_is_never_handed_to_a_masqueraded_flow,
    exempt_destinations_and_the_nodes_own_traffic_pass_untouched,
    connections_opened_from_outside_keep_the_pods_address,
    a_packet_behind_optional_ip_headers_is_translated_past_them,
    a_policy_change_affects_new_flows_only,
    a_draining_connection_keeps_its_address_in_a_full_table,
    an_exception_inside_a_non_masquerade_prefix_is_masqueraded,
    nothing_is_translated_before_the_agent_configures_ports,
    replies_outside_the_spans_are_looked_up_until_no_flow_holds_such_a_port,
    a_held_port_skips_the_lookup_only_once_held_a_while_without_a_flow,
    two_cpus_making_the_same_flows_at_once_make_each_once_with_one_port,
    two_cpus_remembering_the_same_node_flows_at_once_leave_each_its_port,
    a_nodes_flow_found_half_remembered_is_left_as_it_is_and_not_moved_off_itself,
);

fn tcp_egress_then_reply_ingress<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let syn = tcp(F::POD, 40000, F::REMOTE, 80, SYN);
    assert!(checksums_ok::<F>(&syn));
    let (verdict, out) = h.egress(&syn);
    assert_eq!(verdict, TC_ACT_OK);
    let port = word(&out, F::L4);
    assert!(in_spans(port), "NAT port {port} outside the spans");
    assert_changed_within(&syn, &out, &egress_fields::<F>(F::L4, TCP));
    let tcp_checksums = checksums::<F>(F::L4 + 16);
    assert_frame(
        &out,
        &tcp(F::NODE, port, F::REMOTE, 80, SYN),
        &tcp_checksums,
    );
    assert!(checksums_ok::<F>(&out), "checksums over the new addresses");

    // Later packets of the flow keep the translation.
    let (verdict, out) = h.egress(&tcp(F::POD, 40000, F::REMOTE, 80, ACK));
    assert_eq!(verdict, TC_ACT_OK);
    assert_frame(
        &out,
        &tcp(F::NODE, port, F::REMOTE, 80, ACK),
        &tcp_checksums,
    );

    let reply = tcp(F::REMOTE, 80, F::NODE, port, SYN | ACK);
    let (verdict, back) = h.ingress(&reply);
    assert_eq!(verdict, TC_ACT_OK);
    assert_changed_within(&reply, &back, &ingress_fields::<F>(F::L4, TCP));
    let restored = tcp(F::REMOTE, 80, F::POD, 40000, SYN | ACK);
    assert_frame(&back, &restored, &tcp_checksums);
    assert!(checksums_ok::<F>(&back));

    assert_eq!(h.counter(Counter::Masqueraded), 2);
    assert_eq!(h.counter(Counter::ReverseTranslated), 1);
    let nat = F::nat(&h);
    assert_eq!(nat.len(), 2, "one entry per direction: {nat:?}");
    let egress_key = key((F::POD, 40000), (F::REMOTE, 80), TCP, direction::EGRESS);
    assert_snat_entry(&h, &egress_key, F::NODE, port);
    let ingress_key = key((F::REMOTE, 80), (F::NODE, port), TCP, direction::INGRESS);
    assert_snat_entry(&h, &ingress_key, F::POD, 40000);
    let egress = F::nat_entry(&h, &egress_key).unwrap();
    assert_ne!(egress.tcp_seen, 0, "TCP progress recorded");
    assert_eq!(F::other_family_entries(&h), 0, "nothing in the other table");
}

fn udp_both_ways_and_two_pods_with_one_port_get_different_nat_ports<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let udp_checksums = checksums::<F>(F::L4 + 6);
    let mut ports = Vec::new();
    for pod in [F::POD, F::POD2] {
        let dgram = udp(pod, 5353, F::REMOTE, 53);
        let (verdict, out) = h.egress(&dgram);
        assert_eq!(verdict, TC_ACT_OK);
        let port = word(&out, F::L4);
        assert!(in_spans(port), "{port}");
        assert_changed_within(&dgram, &out, &egress_fields::<F>(F::L4, UDP));
        assert_frame(&out, &udp(F::NODE, port, F::REMOTE, 53), &udp_checksums);
        assert!(checksums_ok::<F>(&out));
        ports.push(port);
    }
    assert_ne!(ports[0], ports[1], "one NAT port for two flows");

    // The second pod's reply first, then the first's: each goes back to its own pod.
    for (pod, port) in [(F::POD2, ports[1]), (F::POD, ports[0])] {
        let reply = udp(F::REMOTE, 53, F::NODE, port);
        let (verdict, back) = h.ingress(&reply);
        assert_eq!(verdict, TC_ACT_OK);
        assert_changed_within(&reply, &back, &ingress_fields::<F>(F::L4, UDP));
        assert_frame(&back, &udp(F::REMOTE, 53, pod, 5353), &udp_checksums);
        assert!(checksums_ok::<F>(&back));
        let key = key((F::REMOTE, 53), (F::NODE, port), UDP, direction::INGRESS);
        assert_snat_entry(&h, &key, pod, 5353);
    }
    assert_eq!(F::nat(&h).len(), 4);
    assert_eq!(h.counter(Counter::Masqueraded), 2);
    assert_eq!(h.counter(Counter::ReverseTranslated), 2);
}

fn echo_request_gets_an_identifier_and_its_reply_is_restored<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let request = ping(F::POD, F::REMOTE, F::ECHO_REQUEST, 0x4242);
    let (verdict, out) = h.egress(&request);
    assert_eq!(verdict, TC_ACT_OK);
    let id = word(&out, F::L4 + 4);
    assert!(in_spans(id), "identifier {id}");
    // The source, the checksums and the identifier; type, code and sequence stay.
    let mut fields = address_fields::<F>(F::SRC);
    fields.push(range(F::L4 + 2, 4));
    assert_changed_within(&request, &out, &fields);
    let echo_checksums = checksums::<F>(F::L4 + 2);
    let expected = ping(F::NODE, F::REMOTE, F::ECHO_REQUEST, id);
    assert_frame(&out, &expected, &echo_checksums);
    assert!(checksums_ok::<F>(&out));
    let egress_key = key((F::POD, 0x4242), (F::REMOTE, 0), F::ICMP, direction::EGRESS);
    assert_snat_entry(&h, &egress_key, F::NODE, id);
    let ingress_key = key((F::REMOTE, 0), (F::NODE, id), F::ICMP, direction::INGRESS);
    assert_snat_entry(&h, &ingress_key, F::POD, 0x4242);

    let reply = ping(F::REMOTE, F::NODE, F::ECHO_REPLY, id);
    let (verdict, back) = h.ingress(&reply);
    assert_eq!(verdict, TC_ACT_OK);
    let mut fields = address_fields::<F>(F::DST);
    fields.push(range(F::L4 + 2, 4));
    assert_changed_within(&reply, &back, &fields);
    let restored = ping(F::REMOTE, F::POD, F::ECHO_REPLY, 0x4242);
    assert_frame(&back, &restored, &echo_checksums);
    assert!(checksums_ok::<F>(&back));
    assert_eq!(h.counter(Counter::ReverseTranslated), 1);
}

fn two_pods_with_one_source_port_get_different_nat_ports<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let (_, a) = h.egress(&tcp(F::POD, 50000, F::REMOTE, 80, SYN));
    let (_, b) = h.egress(&tcp(F::POD2, 50000, F::REMOTE, 80, SYN));
    assert_eq!((F::at(&a, F::SRC), F::at(&b, F::SRC)), (F::NODE, F::NODE));
    assert_ne!(word(&a, F::L4), word(&b, F::L4));
    let reply = tcp(F::REMOTE, 80, F::NODE, word(&b, F::L4), SYN | ACK);
    let (_, back) = h.ingress(&reply);
    assert_eq!(F::at(&back, F::DST), F::POD2);
}

fn without_random_fully_the_pods_port_is_kept_when_free<F: HarnessFamily>() {
    let mut h = F::bed(1024, &[(1024, 65535)], false);
    let (_, a) = h.egress(&tcp(F::POD, 45000, F::REMOTE, 80, SYN));
    assert_eq!(word(&a, F::L4), 45000);
    // Same port from another pod to the same server: taken, so the next one is used.
    let (_, b) = h.egress(&tcp(F::POD2, 45000, F::REMOTE, 80, SYN));
    assert_eq!(word(&b, F::L4), 45001);
}

fn exhausted_ports_drop_and_count_never_mistranslate<F: HarnessFamily>() {
    let mut h = F::bed(1024, &[(5000, 5000)], true);
    let (verdict, a) = h.egress(&udp(F::POD, 1111, F::REMOTE, 53));
    assert_eq!((verdict, word(&a, F::L4)), (TC_ACT_OK, 5000));
    let (verdict, _) = h.egress(&udp(F::POD2, 2222, F::REMOTE, 53));
    assert_eq!(
        verdict, TC_ACT_SHOT,
        "the only port is taken for this server"
    );
    assert_eq!(h.counter(Counter::DropPortsExhausted), 1);
    assert_eq!(h.counter(Counter::AllocationFailed), 1);
    // Another server can still use the same port.
    let (verdict, c) = h.egress(&udp(F::POD2, 2222, F::REMOTE2, 53));
    assert_eq!((verdict, word(&c, F::L4)), (TC_ACT_OK, 5000));
    assert_eq!(F::nat(&h).len(), 4, "no half-created flow was left behind");
    // The first flow is unaffected.
    let (_, back) = h.ingress(&udp(F::REMOTE, 53, F::NODE, 5000));
    let restored = udp(F::REMOTE, 53, F::POD, 1111);
    assert_frame(&back, &restored, &checksums::<F>(F::L4 + 6));
}

/// A full table drops early what conntrack would (a flow never answered, or not past its first
/// exchange) to make room for a new one; a table full of assured flows drops the new flow
/// instead, and every live flow keeps its port both ways.
fn a_full_nat_table_drops_early_what_conntrack_would_and_never_an_assured_flow<F: HarnessFamily>() {
    let mut h = F::bed(4, &[(1024, 65535)], true);
    // A stream, seen both ways again after its first exchange: assured.
    let stream = |h: &mut TestBed, pod_port: u16| {
        let mut node_port = 0;
        for _ in 0..3 {
            let (_, out) = h.egress(&udp(F::POD, pod_port, F::REMOTE, 53));
            node_port = word(&out, F::L4);
            h.ingress(&udp(F::REMOTE, 53, F::NODE, node_port));
        }
        node_port
    };
    let a = stream(&mut h, 1001);
    h.egress(&udp(F::POD, 1002, F::REMOTE, 53));
    assert_eq!(F::nat(&h).len(), 4, "two flows fill a four-entry table");
    let unanswered = egress_key::<F>(&h, 1002);
    let (verdict, _) = h.egress(&udp(F::POD, 1003, F::REMOTE, 53));
    assert_eq!(verdict, TC_ACT_OK, "the unanswered flow makes room");
    assert_eq!(h.counter(Counter::NatEarlyDropped), 1);
    assert_eq!(pod_ports::<F>(&h), [1001, 1003]);
    // The slot table looks at the new flow's buckets, and keeps no sample.
    if F::has_drop_sample(&h) {
        let made = egress_key::<F>(&h, 1003);
        let sample = F::drop_sample(&h);
        assert_eq!(
            (
                sample.iter().filter(|k| **k == made).count(),
                sample.contains(&unanswered)
            ),
            (1, false),
            "the new flow takes the dropped flow's slot, and no other: {sample:?}"
        );
    }
    let c = stream(&mut h, 1003);
    let (verdict, _) = h.egress(&udp(F::POD, 1004, F::REMOTE, 53));
    assert_eq!(
        verdict, TC_ACT_SHOT,
        "no assured flow is dropped: the new one is"
    );
    assert_eq!(h.counter(Counter::DropNatTableFull), 1);
    assert_eq!(F::nat(&h).len(), 4, "and leaves nothing behind");
    for (port, pod_port) in [(a, 1001), (c, 1003)] {
        let (verdict, again) = h.egress(&udp(F::POD, pod_port, F::REMOTE, 53));
        assert_eq!(
            (verdict, word(&again, F::L4)),
            (TC_ACT_OK, port),
            "live flows keep their port"
        );
        let (_, back) = h.ingress(&udp(F::REMOTE, 53, F::NODE, port));
        let restored = udp(F::REMOTE, 53, F::POD, pod_port);
        assert_frame(&back, &restored, &checksums::<F>(F::L4 + 6));
    }
}

/// CPUs that find a table full at once can have one's new flow take the room another's drop
/// made, and the dropper drop another flow: the first drop's slot of the drop sample must not
/// be left pointing at a flow that is gone, or a churn on several CPUs leaves a sample with
/// nothing to drop (see `early_drop::remember`). A drop names its slot until a new flow takes it.
/// Replayed one step at a time, another CPU's drop as it leaves the maps.
fn a_flow_made_in_the_room_of_another_cpus_drop_takes_its_slot<F: HarnessFamily>() {
    let mut h = F::bed_in_hash_table(4, &[(1024, 65535)], true);
    h.egress(&udp(F::POD, 1001, F::REMOTE, 53));
    h.egress(&udp(F::POD, 1002, F::REMOTE, 53));
    assert_eq!(F::drop_vacancy(&h), None);
    // Another CPU named the slot of flow 1002 and removed the flow, both halves.
    let gone = egress_key::<F>(&h, 1002);
    let slot = F::drop_sample(&h).iter().position(|k| *k == gone).unwrap() as u32;
    let reply = gone.reverse(&F::nat_entry(&h, &gone).unwrap());
    F::set_drop_vacancy(&mut h, Some(slot));
    F::remove(&mut h, &gone);
    F::remove(&mut h, &reply);
    // A new flow takes the room before that CPU's own does, and the slot with it.
    let (verdict, _) = h.egress(&udp(F::POD, 1003, F::REMOTE, 53));
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(h.counter(Counter::NatEarlyDropped), 0, "there was room");
    let sample = F::drop_sample(&h);
    assert_eq!(
        sample[slot as usize],
        egress_key::<F>(&h, 1003),
        "{sample:?}"
    );
    assert_eq!(F::drop_vacancy(&h), None, "taken");

    // A drop whose own flow takes the room withdraws the slot it named.
    let (verdict, _) = h.egress(&udp(F::POD, 1004, F::REMOTE, 53));
    assert_eq!(
        (verdict, h.counter(Counter::NatEarlyDropped)),
        (TC_ACT_OK, 1)
    );
    assert_eq!(F::drop_vacancy(&h), None, "withdrawn");
    // One named and not taken yet stays named through other drops: the flow that takes its
    // room is still to come. (Named past the sample's end, so that no drop here frees it.)
    let elsewhere = F::drop_sample(&h).len() as u32;
    F::set_drop_vacancy(&mut h, Some(elsewhere));
    let (verdict, _) = h.egress(&udp(F::POD, 1005, F::REMOTE, 53));
    assert_eq!(
        (verdict, h.counter(Counter::NatEarlyDropped)),
        (TC_ACT_OK, 2)
    );
    assert_eq!(F::drop_vacancy(&h), Some(elsewhere));
    assert_eq!(pod_ports::<F>(&h).len(), 2);
}

/// A TCP connection that is closing makes room in a full table, as conntrack's collector drops
/// such entries from a table past 95 % full; an open one never does, however many new flows
/// come.
fn a_full_nat_table_drops_a_closing_connection_and_never_an_open_one<F: HarnessFamily>() {
    let mut h = F::bed(4, &[(1024, 65535)], true);
    let open = connect::<F>(&mut h, 2001);
    let closing = connect::<F>(&mut h, 2002);
    h.egress(&tcp(F::POD, 2002, F::REMOTE, 80, FIN | ACK));
    h.ingress(&tcp(F::REMOTE, 80, F::NODE, closing, FIN | ACK));
    assert_eq!(
        F::nat(&h).len(),
        4,
        "two connections fill a four-entry table"
    );
    let (verdict, _) = h.egress(&udp(F::POD, 2003, F::REMOTE, 53));
    assert_eq!(verdict, TC_ACT_OK, "the closing connection makes room");
    assert_eq!(h.counter(Counter::NatEarlyDropped), 1);
    assert_eq!(pod_ports::<F>(&h), [2001, 2003]);
    let (verdict, _) = h.egress(&udp(F::POD, 2004, F::REMOTE, 53));
    assert_eq!(verdict, TC_ACT_OK, "the unanswered datagram makes room");
    assert_eq!(pod_ports::<F>(&h), [2001, 2004]);
    let (_, back) = h.ingress(&tcp(F::REMOTE, 80, F::NODE, open, ACK));
    assert_frame(
        &back,
        &tcp(F::REMOTE, 80, F::POD, 2001, ACK),
        &checksums::<F>(F::L4 + 16),
    );
}

/// The egress key of the pod's flow from `pod_port`.
fn egress_key<F: HarnessFamily>(h: &TestBed, pod_port: u16) -> NatKey<F::Octets> {
    F::nat(h)
        .into_iter()
        .map(|(key, _)| key)
        .find(|k| k.direction == direction::EGRESS && u16::from_be(k.sport) == pod_port)
        .expect("the pod's flow is in the table")
}

/// A pod's TCP connection to the remote's port 80, through its handshake both ways; the
/// node's port it got.
fn connect<F: HarnessFamily>(h: &mut TestBed, pod_port: u16) -> u16 {
    let (_, syn) = h.egress(&tcp(F::POD, pod_port, F::REMOTE, 80, SYN));
    let port = word(&syn, F::L4);
    h.ingress(&tcp(F::REMOTE, 80, F::NODE, port, SYN | ACK));
    h.egress(&tcp(F::POD, pod_port, F::REMOTE, 80, ACK));
    h.ingress(&tcp(F::REMOTE, 80, F::NODE, port, ACK));
    port
}

/// New flows write random slots of the drop sample, so it forgets flows; a sweep that leaves
/// the table three quarters full or more points its slots at the table's flows, each once (the
/// one a full table may drop among the rest), and the next new flow that finds the table full
/// drops that one.
fn a_sweep_under_pressure_points_the_drop_sample_at_what_a_full_table_may_drop<F: HarnessFamily>() {
    let mut h = F::bed_in_hash_table(8, &[(1024, 65535)], true);
    for pod_port in [3001, 3002, 3003] {
        connect::<F>(&mut h, pod_port);
    }
    h.egress(&udp(F::POD, 3004, F::REMOTE, 53));
    let table = F::nat(&h);
    assert_eq!(table.len(), 8, "the table is full");
    let unanswered = egress_key::<F>(&h, 3004);
    let newest = table.iter().map(|(_, e)| e.last_seen_ns).max().unwrap();
    let run = F::expire(&mut h, &expiry::Timeouts::default(), newest);
    assert_eq!(run.expired_flows, 0);
    let sample = F::drop_sample(&h);
    let flows = [3001, 3002, 3003, 3004].map(|pod_port| egress_key::<F>(&h, pod_port));
    assert_eq!(sample.len(), flows.len());
    let sampled: std::collections::HashSet<_> = sample.iter().collect();
    assert_eq!(
        sampled,
        flows.iter().collect(),
        "every flow once, {unanswered:?} among them"
    );
    let (verdict, _) = h.egress(&tcp(F::POD, 3005, F::REMOTE, 80, SYN));
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(pod_ports::<F>(&h), [3001, 3002, 3003, 3005]);
}

/// A table that stays under pressure has its drop sample pointed by every sweep, however much
/// of it new flows overwrote since (here all of it): by the sweep that finds it so, and by
/// those after it, which the sweep program points in its one walk, where it also removes flows
/// that are over and points none of them. Of 32 slots, every 16 in a row hold one of the flows
/// a full table may drop, all of which fit; each flow is in one slot. Then a full table finds
/// one to drop for a new flow, and never an open connection.
fn every_sweep_of_a_table_left_under_pressure_points_its_sample_again<F: HarnessFamily>() {
    let mut h = F::bed_in_hash_table(64, &[(1024, 65535)], true);
    let open: Vec<u16> = (3001..3021).collect();
    let unanswered: Vec<u16> = (4001..4009).collect();
    for &pod_port in &open {
        connect::<F>(&mut h, pod_port);
    }
    for &pod_port in &unanswered {
        h.egress(&udp(F::POD, pod_port, F::REMOTE, 53));
    }
    assert_eq!(F::nat(&h).len(), 56, "past three quarters of 64 entries");
    let key_of = |h: &TestBed, ports: &[u16]| -> HashSet<_> {
        ports.iter().map(|&p| egress_key::<F>(h, p)).collect()
    };
    let (mut droppable, mut flows) = (key_of(&h, &unanswered), key_of(&h, &open));
    flows.extend(droppable.iter().copied());
    let newest = F::nat(&h)
        .iter()
        .map(|(_, e)| e.last_seen_ns)
        .max()
        .unwrap();
    // Two unanswered queries, idle past UDP's 30 s by the third sweep, go at that sweep; the
    // table, at 48 entries, stays under pressure.
    let over = key_of(&h, &unanswered[..2]);
    let later = newest + 60_000_000_000;
    for key in &over {
        flow_last_seen_at::<F>(&mut h, key, newest - 1);
    }
    let sweeps = [
        ("the sweep that finds it so", newest, 0),
        ("a sweep of a table left so", newest, 0),
        ("a sweep that also removes flows", later, over.len()),
    ];
    for (sweep, now, expired) in sweeps {
        if expired > 0 {
            flows.retain(|key| !over.contains(key));
            droppable.retain(|key| !over.contains(key));
            // The flows left were seen just before the sweep; those over were not.
            for key in &flows {
                flow_last_seen_at::<F>(&mut h, key, now);
            }
        }
        F::forget_drop_sample(&h);
        let run = F::expire(&mut h, &expiry::Timeouts::default(), now);
        assert_eq!(run.expired_flows, expired, "{sweep}");
        let sample = F::drop_sample(&h);
        assert_eq!(sample.len(), 32);
        if expired > 0 {
            assert!(
                !sample.iter().any(|key| over.contains(key)),
                "{sweep}: a flow removed is pointed at: {sample:?}"
            );
        }
        let held: Vec<_> = sample.iter().filter(|key| flows.contains(key)).collect();
        assert_eq!(
            held.len(),
            flows.len(),
            "{sweep}: every flow, once: {sample:?}"
        );
        assert_eq!(
            held.iter().collect::<HashSet<_>>().len(),
            flows.len(),
            "{sweep}"
        );
        for first in 0..sample.len() {
            let looked_at = (first..first + EARLY_DROP_PROBES as usize).map(|s| &sample[s % 32]);
            assert!(
                looked_at.clone().any(|key| droppable.contains(key)),
                "{sweep}: 16 slots from {first} hold a flow a full table may drop"
            );
        }
    }
    for pod_port in 5001..5007 {
        h.egress(&udp(F::POD, pod_port, F::REMOTE, 53));
    }
    assert_eq!(F::nat(&h).len(), 64, "the table is full");
    let (verdict, _) = h.egress(&tcp(F::POD, 6001, F::REMOTE, 80, SYN));
    assert_eq!(verdict, TC_ACT_OK, "a full table found a flow to drop");
    let left: HashSet<u16> = pod_ports::<F>(&h).into_iter().collect();
    assert!(left.contains(&6001));
    assert!(
        open.iter().all(|port| left.contains(port)),
        "no open connection dropped"
    );
}

/// Of the flows a full table may drop, it drops the one idle longest, so that a flow just made
/// (a pod's connection in its handshake, say) outlives a churn as long as older flows it may
/// drop are in the slots it looks at. Ages are written into the table; a sweep under pressure
/// points every slot at the four flows, all of which the 16 slots looked at cover.
fn a_full_table_drops_the_flow_idle_longest_and_spares_a_handshake<F: HarnessFamily>() {
    let mut h = F::bed(8, &[(1024, 65535)], true);
    for pod_port in [3001, 3002, 3003] {
        h.egress(&udp(F::POD, pod_port, F::REMOTE, 53));
    }
    h.egress(&tcp(F::POD, 3004, F::REMOTE, 80, SYN));
    let table = F::nat(&h);
    assert_eq!(table.len(), 8, "the table is full");
    let newest = table.iter().map(|(_, e)| e.last_seen_ns).max().unwrap();
    // Idle 5 s and 9 s (within UDP's 30 s), both halves; the rest as they were made.
    let second = 1_000_000_000;
    for (pod_port, idle) in [(3001, 5 * second), (3003, 9 * second)] {
        last_seen_at::<F>(&mut h, pod_port, newest - idle);
    }
    assert_eq!(
        F::expire(&mut h, &expiry::Timeouts::default(), newest).expired_flows,
        0
    );
    for (new_port, dropped) in [(3005, 3003), (3006, 3001)] {
        let (verdict, _) = h.egress(&udp(F::POD, new_port, F::REMOTE, 53));
        assert_eq!(verdict, TC_ACT_OK);
        let left = pod_ports::<F>(&h);
        assert!(!left.contains(&dropped), "{dropped} idle longest: {left:?}");
        assert!(left.contains(&3004), "the handshake goes on: {left:?}");
    }
    assert_eq!(h.counter(Counter::NatEarlyDropped), 2);
}

/// A flow that is over (idle past its timeout) is gone for conntrack, and the next sweep would
/// remove it: a full table takes it for a new flow before any other, ahead of a flow it may
/// drop that was idle longer; once none is over, the one idle longest as before. Between
/// sweeps, as here, a table that fills holds such flows. Ages are written into the table after
/// a sweep under pressure pointed every slot of the sample at the four flows.
fn a_full_table_takes_a_flow_that_is_over_before_any_other<F: HarnessFamily>() {
    let mut h = F::bed(8, &[(1024, 65535)], true);
    // An assured stream, which no full table drops while it is live.
    for _ in 0..3 {
        let (_, out) = h.egress(&udp(F::POD, 5001, F::REMOTE, 53));
        h.ingress(&udp(F::REMOTE, 53, F::NODE, word(&out, F::L4)));
    }
    h.egress(&udp(F::POD, 5002, F::REMOTE, 53));
    h.egress(&tcp(F::POD, 5003, F::REMOTE, 80, SYN));
    h.egress(&udp(F::POD, 5004, F::REMOTE, 53));
    let newest = point_the_sample_at_a_full_table::<F>(&mut h);
    // The datagram never answered, idle 40 s: over (UDP's timeout is 30 s). The SYN never
    // answered, idle 100 s: not over (120 s), and idle longer.
    let second = 1_000_000_000;
    for (pod_port, idle) in [(5002, 40 * second), (5003, 100 * second)] {
        last_seen_at::<F>(&mut h, pod_port, newest - idle);
    }
    new_flows_take::<F>(&mut h, &[(5005, 5002), (5006, 5003)]);
    // Over, an assured flow goes too, ahead of the flows a full table may drop: it is no
    // longer live.
    last_seen_at::<F>(&mut h, 5001, newest - 200 * second);
    new_flows_take::<F>(&mut h, &[(5007, 5001)]);
    assert_eq!(h.counter(Counter::NatEarlyDropped), 3);
}

/// A connection that nothing more may cross (reset, here by the pod) is finished: a full table
/// takes it as soon as it finds it, as conntrack drops such a flow first, ahead of a flow it
/// may drop that was idle longer (a query unanswered for 20 s, within its 30 s); then that one.
fn a_full_table_takes_a_finished_connection_before_a_flow_idle_longer<F: HarnessFamily>() {
    let mut h = F::bed(8, &[(1024, 65535)], true);
    h.egress(&udp(F::POD, 5001, F::REMOTE, 53));
    connect::<F>(&mut h, 5002);
    let reset = Connection::<F>::open(&mut h, 5003, 1000);
    reset.remote_sends(&mut h, SYN | ACK, 5000, 1001, &[]);
    reset.pod_sends(&mut h, ACK, 1001, 5001, &[]);
    reset.pod_sends(&mut h, RST, 1001, 0, &[]);
    h.egress(&udp(F::POD, 5004, F::REMOTE, 53));
    let newest = point_the_sample_at_a_full_table::<F>(&mut h);
    last_seen_at::<F>(&mut h, 5001, newest - 20 * 1_000_000_000);
    new_flows_take::<F>(&mut h, &[(5005, 5003), (5006, 5001)]);
    assert_eq!(h.counter(Counter::NatEarlyDropped), 2);
}

/// Sweeps the table of four flows, which they fill, when its newest packet was seen: none is
/// over, and the sweep under pressure points every slot of the drop sample at them. Says that
/// time.
fn point_the_sample_at_a_full_table<F: HarnessFamily>(h: &mut TestBed) -> u64 {
    let table = F::nat(h);
    assert_eq!(table.len(), 8, "the table is full");
    let newest = table.iter().map(|(_, e)| e.last_seen_ns).max().unwrap();
    let run = F::expire(h, &expiry::Timeouts::default(), newest);
    assert_eq!(run.expired_flows, 0);
    newest
}

/// Each pod's new flow, a query from `new_port`, finds the table full and takes the room of
/// the pod's flow from `dropped`, and no other.
fn new_flows_take<F: HarnessFamily>(h: &mut TestBed, drops: &[(u16, u16)]) {
    for &(new_port, dropped) in drops {
        let before = pod_ports::<F>(h);
        let (verdict, _) = h.egress(&udp(F::POD, new_port, F::REMOTE, 53));
        assert_eq!(verdict, TC_ACT_OK);
        let mut expected: Vec<u16> = before.into_iter().filter(|&p| p != dropped).collect();
        expected.push(new_port);
        expected.sort();
        assert_eq!(pod_ports::<F>(h), expected, "{dropped} went for {new_port}");
    }
}

/// Writes `last_seen_ns` into both halves of the pod's flow from `pod_port`, as if neither had
/// seen a packet since.
fn last_seen_at<F: HarnessFamily>(h: &mut TestBed, pod_port: u16, last_seen_ns: u64) {
    let key = egress_key::<F>(h, pod_port);
    flow_last_seen_at::<F>(h, &key, last_seen_ns);
}

/// Writes `last_seen_ns` into both halves of the flow whose egress half is `key`.
pub(crate) fn flow_last_seen_at<F: HarnessFamily>(
    h: &mut TestBed,
    key: &NatKey<F::Octets>,
    last_seen_ns: u64,
) {
    let mut egress = F::nat_entry(h, key).unwrap();
    let reply_key = key.reverse(&egress);
    let mut reply = F::nat_entry(h, &reply_key).unwrap();
    egress.last_seen_ns = last_seen_ns;
    reply.last_seen_ns = last_seen_ns;
    F::plant(h, key, egress);
    F::plant(h, &reply_key, reply);
}

/// A new flow that early drop made room for searches for its port again, as any new flow does:
/// the port its first search found no room for may be one the node holds (asked only once a
/// port is reserved), and the port of the flow dropped is free only toward that flow's own
/// destination. Here the node holds the port tried first, and the flow dropped held, toward
/// another server, the port a live flow holds toward this one: the new flow gets the one
/// port left, and no flow but the one dropped is lost.
fn a_flow_made_after_an_early_drop_searches_its_port_again<F: HarnessFamily>() {
    let mut h = F::bed(4, &[(5000, 5002)], false);
    // Without --random-fully the pod's own port is tried first.
    for _ in 0..2 {
        h.egress(&udp(F::POD, 5000, F::REMOTE, 53));
        h.ingress(&udp(F::REMOTE, 53, F::NODE, 5000));
    }
    let (_, out) = h.egress(&udp(F::POD, 5000, F::REMOTE2, 53));
    assert_eq!(word(&out, F::L4), 5000, "free toward the other server");
    h.hold_node_ports(&NodePorts {
        tcp: [].into(),
        udp: [5002].into(),
    });
    let (verdict, out) = h.egress(&udp(F::POD, 5002, F::REMOTE, 53));
    assert_eq!(
        (verdict, word(&out, F::L4)),
        (TC_ACT_OK, 5001),
        "neither the node's 5002 nor 5000, which the live flow holds toward this server"
    );
    assert_eq!(h.counter(Counter::NatEarlyDropped), 1);
    assert_eq!(h.counter(Counter::DropNatTableFull), 0);
    assert_eq!(pod_ports::<F>(&h), [5000, 5002]);
    for (port, pod_port) in [(5001, 5002), (5000, 5000)] {
        let (_, back) = h.ingress(&udp(F::REMOTE, 53, F::NODE, port));
        assert_frame(
            &back,
            &udp(F::REMOTE, 53, F::POD, pod_port),
            &checksums::<F>(F::L4 + 6),
        );
    }
}

/// A table of many buckets, full of flows it may drop, makes room for every new flow, and
/// drops no more for it than its two halves need: in the slot table, room is in a half's own
/// buckets, so the drop must be where the half found none, and the search after it must try
/// there (a drop anywhere else, or a search of other random ports, would drop a flow in every
/// round, and then the new one). The table stays nearly as full as it was. So for connections
/// opened from outside.
fn a_large_full_table_makes_room_for_each_new_flow_where_its_halves_go<F: HarnessFamily>() {
    const HALVES: u32 = 4096;
    let mut h = F::bed(HALVES, &[(1024, 65535)], true);
    let mut pod_port = 20_000;
    let mut new_flow = |h: &mut TestBed| {
        let (verdict, _) = h.egress(&udp(F::POD, pod_port, F::REMOTE, 53));
        assert_eq!(verdict, TC_ACT_OK, "the flow from {pod_port} is made");
        pod_port += 1;
    };
    // Until the drops have emptied no bucket the slot table fills last: full everywhere.
    while h.counter(Counter::NatEarlyDropped) < u64::from(HALVES) / 2 {
        new_flow(&mut h);
    }
    let (before, made) = (h.counter(Counter::NatEarlyDropped), 300);
    for _ in 0..made {
        new_flow(&mut h);
    }
    let drops = h.counter(Counter::NatEarlyDropped) - before;
    assert!(
        drops <= 2 * made,
        "{drops} flows dropped for {made} made in a full table"
    );
    assert_eq!(h.counter(Counter::DropNatTableFull), 0);
    let flows = pod_ports::<F>(&h).len() as u32;
    assert!(
        flows >= HALVES / 2 * 8 / 10,
        "{flows} flows left of the {HALVES} halves' room"
    );
    // Connections opened from outside to a pod are remembered too, whichever of their two
    // halves found no room: untracked, the pod's replies would leave masqueraded.
    let (before, opened) = (h.counter(Counter::NatEarlyDropped), 300);
    for client_port in 0..opened {
        let syn = tcp(F::REMOTE, 10_000 + client_port, F::POD, 8080, SYN);
        assert_eq!(h.ingress(&syn), (TC_ACT_OK, syn), "from {client_port}");
    }
    assert_eq!(h.counter(Counter::InboundTracked), u64::from(opened));
    assert!(h.counter(Counter::NatEarlyDropped) - before <= 2 * u64::from(opened));
    assert_eq!(h.counter(Counter::DropNatTableFull), 0);
}

/// The node's flows on ports NAT hands out (netfilter's, or a daemon's) hold their tuple in the
/// table; a full table gives them up for a pod's new flow, however established: the node's next
/// packet passes on as it was, and a reservation is all it loses.
fn a_full_table_gives_up_the_nodes_flows_for_a_pods_whatever_their_state<F: HarnessFamily>() {
    let mut h = F::bed(4, &[(5000, 5001)], true);
    for port in [5000, 5001] {
        for (dir, packet) in [
            (direction::EGRESS, tcp(F::NODE, port, F::REMOTE, 80, SYN)),
            (
                direction::INGRESS,
                tcp(F::REMOTE, 80, F::NODE, port, SYN | ACK),
            ),
            (direction::EGRESS, tcp(F::NODE, port, F::REMOTE, 80, ACK)),
            (direction::INGRESS, tcp(F::REMOTE, 80, F::NODE, port, ACK)),
        ] {
            let run = if dir == direction::EGRESS {
                h.egress(&packet)
            } else {
                h.ingress(&packet)
            };
            assert_eq!(run, (TC_ACT_OK, packet), "the node's own, untouched");
        }
    }
    assert_eq!(
        F::nat(&h).len(),
        4,
        "two established node flows fill the table"
    );
    let (verdict, out) = h.egress(&udp(F::POD, 1111, F::REMOTE, 53));
    assert_eq!(verdict, TC_ACT_OK, "a node flow makes room");
    assert_eq!(h.counter(Counter::NatNodeFlowDropped), 1);
    assert_eq!(h.counter(Counter::NatEarlyDropped), 0);
    let port = word(&out, F::L4);
    assert_frame(
        &out,
        &udp(F::NODE, port, F::REMOTE, 53),
        &checksums::<F>(F::L4 + 6),
    );
    for node_port in [5000, 5001] {
        let segment = tcp(F::NODE, node_port, F::REMOTE, 80, ACK);
        assert_eq!(h.egress(&segment), (TC_ACT_OK, segment.clone()));
    }
}

/// The node's own flows share the node's address with masqueraded ones: its sockets, and the
/// flows netfilter masquerades (kube-proxy's MASQUERADE). A port a masqueraded flow holds is
/// never handed to the node's flow with the same tuple, and the other way round: no reply ever
/// reaches the wrong flow.
fn the_nodes_own_flows_and_masqueraded_ones_never_share_a_tuple<F: HarnessFamily>() {
    let mut h = harness::<F>();
    for (n, proto) in [TCP, UDP].into_iter().enumerate() {
        let (open, answer) = if proto == TCP {
            (SYN, SYN | ACK)
        } else {
            (0, 0)
        };
        let packet = |src, sport, dst, dport, flags| {
            frame(
                src,
                dst,
                proto,
                &l4_segment(src, dst, proto, sport, dport, flags),
            )
        };
        let sums = checksums::<F>(F::L4 + l4_checksum_offset(proto));
        // A pod's flow holds node port P toward REMOTE:8080.
        let (_, out) = h.egress(&packet(F::POD, 40000, F::REMOTE, 8080, open));
        let held = word(&out, F::L4);
        // A node socket bound to P sends to REMOTE:8080: as conntrack resolves a clash, its
        // flow is given another port, and only that.
        let (verdict, left) = h.egress(&packet(F::NODE, held, F::REMOTE, 8080, open));
        assert_eq!(verdict, TC_ACT_OK);
        let other = word(&left, F::L4);
        assert_ne!(other, held);
        assert_frame(&left, &packet(F::NODE, other, F::REMOTE, 8080, open), &sums);
        assert_eq!(h.counter(Counter::NodePortClash), n as u64 + 1);
        // Each reply reaches its own flow: the node socket's at P, the pod's at 40000.
        let (_, back) = h.ingress(&packet(F::REMOTE, 8080, F::NODE, other, answer));
        assert_frame(
            &back,
            &packet(F::REMOTE, 8080, F::NODE, held, answer),
            &sums,
        );
        let (_, back) = h.ingress(&packet(F::REMOTE, 8080, F::NODE, held, answer));
        assert_frame(
            &back,
            &packet(F::REMOTE, 8080, F::POD, 40000, answer),
            &sums,
        );
        // A node flow that clashes with nothing keeps its port, and its tuple is held.
        let free = packet(F::NODE, 22222, F::REMOTE, 8080, open);
        assert_eq!(h.egress(&free), (TC_ACT_OK, free.clone()));
        let held_by_node = |h: &TestBed, port: u16| {
            F::nat(h).iter().any(|(k, e)| {
                e.kind == nat_kind::NODE && k.proto == proto && k.sport == port.to_be()
            })
        };
        assert!(held_by_node(&h, 22222));
        // One on a port NAT never hands out (the node's ephemeral range) needs no holding.
        assert!(!in_spans(33333));
        let ephemeral = packet(F::NODE, 33333, F::REMOTE, 8080, open);
        assert_eq!(h.egress(&ephemeral), (TC_ACT_OK, ephemeral.clone()));
        assert!(
            !held_by_node(&h, 33333),
            "no entry for a port NAT never gives"
        );
    }
}

/// A node's flow that clashes with a pod's flow's port in a full table makes room as a pod's
/// new flow does, and moves to another port: counted as a clash, as where the table has room.
fn a_nodes_flow_that_clashes_in_a_full_table_makes_room_and_moves<F: HarnessFamily>() {
    let mut h = F::bed(4, &[(5000, 5001)], true);
    // A pod's stream, assured, holds one port toward REMOTE:53; an unanswered query to
    // another server fills the table.
    let mut held = 0;
    for _ in 0..3 {
        let (_, out) = h.egress(&udp(F::POD, 1001, F::REMOTE, 53));
        held = word(&out, F::L4);
        h.ingress(&udp(F::REMOTE, 53, F::NODE, held));
    }
    h.egress(&udp(F::POD, 1002, F::REMOTE2, 53));
    assert_eq!(F::nat(&h).len(), 4, "two flows fill a four-entry table");
    let other = if held == 5000 { 5001 } else { 5000 };
    // A node socket bound to the stream's port sends to REMOTE:53.
    let (verdict, out) = h.egress(&udp(F::NODE, held, F::REMOTE, 53));
    assert_eq!(verdict, TC_ACT_OK);
    assert_frame(
        &out,
        &udp(F::NODE, other, F::REMOTE, 53),
        &checksums::<F>(F::L4 + 6),
    );
    assert_eq!(
        (
            h.counter(Counter::NatEarlyDropped),
            h.counter(Counter::NodePortClash)
        ),
        (1, 1)
    );
    let (_, back) = h.ingress(&udp(F::REMOTE, 53, F::NODE, held));
    assert_frame(
        &back,
        &udp(F::REMOTE, 53, F::POD, 1001),
        &checksums::<F>(F::L4 + 6),
    );
}

/// The ports the node holds for its listening sockets and NodePorts, by protocol, are never
/// handed to a masqueraded flow, and the node's flows on them (replies to connections from
/// outside) take no entry; a TCP reset of the node's takes none either.
fn the_nodes_own_ports_are_never_handed_out_and_take_no_entry<F: HarnessFamily>() {
    let mut h = F::bed(1024, &[(5000, 5001)], false);
    h.hold_node_ports(&NodePorts {
        tcp: [5000].into(),
        udp: [].into(),
    });
    // Without --random-fully the pod's own port is tried first: 5000 is the node's.
    let (verdict, out) = h.egress(&tcp(F::POD, 5000, F::REMOTE, 80, SYN));
    assert_eq!((verdict, word(&out, F::L4)), (TC_ACT_OK, 5001));
    let (verdict, _) = h.egress(&tcp(F::POD, 5002, F::REMOTE, 80, SYN));
    assert_eq!(verdict, TC_ACT_SHOT, "the only other port is the node's");
    // UDP's 5000 is not the node's.
    let (verdict, out) = h.egress(&udp(F::POD, 5000, F::REMOTE, 53));
    assert_eq!((verdict, word(&out, F::L4)), (TC_ACT_OK, 5000));
    let before = F::nat(&h).len();
    // A node service on 5000 answers a client, and resets another's connection on 5001.
    let answer = tcp(F::NODE, 5000, F::REMOTE2, 40000, SYN | ACK);
    assert_eq!(h.egress(&answer), (TC_ACT_OK, answer.clone()));
    let reset = tcp(F::NODE, 5001, F::REMOTE2, 40001, RST | ACK);
    assert_eq!(h.egress(&reset), (TC_ACT_OK, reset.clone()));
    assert_eq!(F::nat(&h).len(), before, "neither takes an entry");
}

/// A flow netfilter masqueraded (it leaves with the node's address already) holds its port:
/// with one port to hand out, a pod's flow to the same destination gets none rather than the
/// netfilter flow's, whose replies pass on to netfilter untouched.
fn a_port_netfilter_uses_is_never_handed_to_a_masqueraded_flow<F: HarnessFamily>() {
    let mut h = F::bed(1024, &[(5000, 5000)], true);
    let netfilters = udp(F::NODE, 5000, F::REMOTE, 53);
    assert_eq!(h.egress(&netfilters), (TC_ACT_OK, netfilters.clone()));
    let (verdict, _) = h.egress(&udp(F::POD, 1111, F::REMOTE, 53));
    assert_eq!(verdict, TC_ACT_SHOT, "no port left but netfilter's");
    assert_eq!(h.counter(Counter::DropPortsExhausted), 1);
    let reply = udp(F::REMOTE, 53, F::NODE, 5000);
    assert_eq!(
        h.ingress(&reply),
        (TC_ACT_OK, reply.clone()),
        "netfilter's reply"
    );
    // The same port toward another destination is free.
    let (verdict, out) = h.egress(&udp(F::POD, 1111, F::REMOTE2, 53));
    assert_eq!((verdict, word(&out, F::L4)), (TC_ACT_OK, 5000));
    let usage = expiry::usage(&F::nat(&h));
    assert_eq!((usage.pod_flows, usage.node_flows), (1, 1));
}

fn exempt_destinations_and_the_nodes_own_traffic_pass_untouched<F: HarnessFamily>() {
    let mut h = harness::<F>();
    // Every protocol the programs translate, from `src` to `dst`.
    let each_protocol = |src, dst| {
        [
            tcp(src, 1000, dst, 443, SYN),
            udp(src, 1000, dst, 53),
            ping(src, dst, F::ECHO_REQUEST, 5),
        ]
    };
    let mut cases = Vec::new();
    for dst in [F::SERVICE, F::POD2, F::LINK_LOCAL] {
        let exempt = Counter::NotMasqNonMasqDestination;
        cases.extend(each_protocol(F::POD, dst).map(|p| (format!("to {dst}"), p, exempt)));
    }
    let from_node = each_protocol(F::NODE, F::REMOTE);
    cases.extend(from_node.map(|p| ("from the node".into(), p, Counter::NotMasqNodeSource)));
    cases.push((
        "GRE, left to the chain".into(),
        frame(F::POD, F::REMOTE, 47, b"GRE payload, left to the chain"),
        Counter::NotMasqOtherProtocol,
    ));
    cases.push((
        "an echo reply".into(),
        ping(F::POD, F::REMOTE, F::ECHO_REPLY, 5),
        Counter::NotMasqIcmpOther,
    ));
    for (what, packet, counter) in cases {
        let before = h.counter(counter);
        assert_eq!(h.egress(&packet), (TC_ACT_OK, packet.clone()), "{what}");
        assert_eq!(h.counter(counter), before + 1, "{what}: {counter:?}");
    }
    // Nothing is remembered: the node's flows are on ports NAT never hands out (below 1024).
    let nat = F::nat(&h);
    assert!(nat.is_empty(), "{nat:?}");
    assert_eq!(h.counter(Counter::Masqueraded), 0);
}

fn connections_opened_from_outside_keep_the_pods_address<F: HarnessFamily>() {
    let mut h = harness::<F>();
    // Stray segments open nothing: only a SYN starts a connection.
    for stray in [ACK, SYN | ACK, RST] {
        h.ingress(&tcp(F::REMOTE, 5555, F::POD, 8080, stray));
    }
    // Nor does anything sent to multicast or link-local addresses.
    h.ingress(&udp(F::REMOTE, 5555, F::ALL_NODES, 8080));
    h.ingress(&udp(F::REMOTE, 5555, F::LINK_LOCAL, 8080));
    assert_eq!(h.counter(Counter::InboundTracked), 0);
    assert!(F::nat(&h).is_empty(), "{:?}", F::nat(&h));

    let syn = tcp(F::REMOTE, 5555, F::POD, 8080, SYN);
    assert_eq!(h.ingress(&syn), (TC_ACT_OK, syn));
    assert_eq!(h.counter(Counter::InboundTracked), 1);
    let syn_ack = tcp(F::POD, 8080, F::REMOTE, 5555, SYN | ACK);
    assert_eq!(
        h.egress(&syn_ack),
        (TC_ACT_OK, syn_ack),
        "the pod's reply keeps its address"
    );
    assert_eq!(h.counter(Counter::NotMasqInbound), 1);
    let nat = F::nat(&h);
    assert_eq!(nat.len(), 2);
    assert!(nat.iter().all(|(_, e)| e.kind == nat_kind::PASSTHROUGH));
    // The pod's own new connection to the same server is still masqueraded.
    let (_, out) = h.egress(&tcp(F::POD, 40000, F::REMOTE, 5555, SYN));
    assert_eq!(F::at(&out, F::SRC), F::NODE);
    assert!(checksums_ok::<F>(&out));
}

/// IPv4 options and IPv6 extension headers are stepped over, as the chain's protocol match
/// steps over them: left alone, the packet would leave with the pod's address.
fn a_packet_behind_optional_ip_headers_is_translated_past_them<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let syn = F::with_header_options(&tcp(F::POD, 1000, F::REMOTE, 443, SYN));
    let l4 = F::packet_at(&syn, IP).unwrap().l4;
    assert!(l4 > F::L4 && checksums_ok::<F>(&syn));
    let (verdict, out) = h.egress(&syn);
    assert_eq!(verdict, TC_ACT_OK);
    let port = word(&out, l4);
    assert_changed_within(&syn, &out, &egress_fields::<F>(l4, TCP));
    let expected = F::with_header_options(&tcp(F::NODE, port, F::REMOTE, 443, SYN));
    assert_frame(&out, &expected, &checksums::<F>(l4 + 16));
    assert!(checksums_ok::<F>(&out), "checksums, options included");

    let reply = F::with_header_options(&tcp(F::REMOTE, 443, F::NODE, port, SYN | ACK));
    let (verdict, back) = h.ingress(&reply);
    assert_eq!(verdict, TC_ACT_OK);
    assert_changed_within(&reply, &back, &ingress_fields::<F>(l4, TCP));
    let restored = F::with_header_options(&tcp(F::REMOTE, 443, F::POD, 1000, SYN | ACK));
    assert_frame(&back, &restored, &checksums::<F>(l4 + 16));
    assert!(checksums_ok::<F>(&back), "the reply's checksums");
}

fn a_policy_change_affects_new_flows_only<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let tcp_checksums = checksums::<F>(F::L4 + 16);
    // A masqueraded connection, then its destination becomes non-masquerade.
    let (_, before) = h.egress(&tcp(F::POD, 4001, F::REMOTE, 443, SYN));
    let port = word(&before, F::L4);
    assert_eq!(F::at(&before, F::SRC), F::NODE);
    set_policy::<F>(&mut h, &policy_with(F::REMOTE_NET), &[]);
    let (verdict, after) = h.egress(&tcp(F::POD, 4001, F::REMOTE, 443, ACK));
    assert_eq!(verdict, TC_ACT_OK);
    let kept = tcp(F::NODE, port, F::REMOTE, 443, ACK);
    assert_frame(&after, &kept, &tcp_checksums);
    let (_, back) = h.ingress(&tcp(F::REMOTE, 443, F::NODE, port, ACK));
    let restored = tcp(F::REMOTE, 443, F::POD, 4001, ACK);
    assert_frame(&back, &restored, &tcp_checksums);
    let fresh = tcp(F::POD, 4002, F::REMOTE, 443, SYN);
    assert_eq!(
        h.egress(&fresh),
        (TC_ACT_OK, fresh),
        "a new connection is not masqueraded"
    );
    let fresh_udp = udp(F::POD, 4002, F::REMOTE, 53);
    assert_eq!(h.egress(&fresh_udp), (TC_ACT_OK, fresh_udp));

    // An unmasqueraded connection, then its destination leaves the non-masquerade prefixes.
    let established = tcp(F::POD, 4003, F::REMOTE2, 443, ACK);
    set_policy::<F>(&mut h, &policy_with(F::REMOTE2_NET), &[]);
    assert_eq!(h.egress(&established), (TC_ACT_OK, established.clone()));
    set_policy::<F>(&mut h, &nets::<F>(F::POLICY), &[]);
    let inbound = h.counter(Counter::NotMasqInbound);
    assert_eq!(
        h.egress(&established),
        (TC_ACT_OK, established.clone()),
        "stays unmasqueraded while its prefix drains"
    );
    assert_eq!(h.counter(Counter::NotMasqInbound), inbound + 1);
    let fin = tcp(F::POD, 4003, F::REMOTE2, 443, ACK | FIN);
    assert_eq!(h.egress(&fin), (TC_ACT_OK, fin), "through to its FIN");
    let (verdict, new) = h.egress(&tcp(F::POD, 4004, F::REMOTE2, 443, SYN));
    assert_eq!(verdict, TC_ACT_OK);
    assert_eq!(
        F::at(&new, F::SRC),
        F::NODE,
        "a new connection is masqueraded"
    );
    assert!(checksums_ok::<F>(&new));

    // Re-adding the prefix ends its draining; the other one still drains.
    set_policy::<F>(&mut h, &policy_with(F::REMOTE2_NET), &[]);
    assert_eq!(
        F::draining(&h),
        [F::REMOTE_NET],
        "only the prefix still out of the policy drains"
    );
}

/// A TCP connection that started unmasqueraded keeps its address while its destination's
/// prefix drains, also where the table is full: left alone without an entry, as the draining
/// trie leaves it for as long as an established connection lives, where translating it in
/// mid-stream, with room an early drop made, would break it (conntrack never moves a live
/// flow) and cost a pod's flow.
fn a_draining_connection_keeps_its_address_in_a_full_table<F: HarnessFamily>() {
    let mut h = F::bed(8, &[(1024, 65535)], true);
    set_policy::<F>(&mut h, &policy_with(F::REMOTE2_NET), &[]);
    let established = tcp(F::POD, 4003, F::REMOTE2, 443, ACK);
    assert_eq!(h.egress(&established), (TC_ACT_OK, established.clone()));
    for pod_port in 5001..5005 {
        let (verdict, _) = h.egress(&udp(F::POD, pod_port, F::REMOTE, 53));
        assert_eq!(verdict, TC_ACT_OK);
    }
    assert_eq!(F::nat(&h).len(), 8, "the table is full");
    set_policy::<F>(&mut h, &nets::<F>(F::POLICY), &[]);
    for _ in 0..2 {
        assert_eq!(
            h.egress(&established),
            (TC_ACT_OK, established.clone()),
            "stays unmasqueraded while its prefix drains"
        );
    }
    let (_, back) = h.ingress(&tcp(F::REMOTE2, 443, F::POD, 4003, ACK));
    assert_eq!(back, tcp(F::REMOTE2, 443, F::POD, 4003, ACK));
    assert_eq!(h.counter(Counter::NatEarlyDropped), 0);
    assert_eq!(pod_ports::<F>(&h), [5001, 5002, 5003, 5004]);
}

/// An exception (`masqueradeCIDRs`) inside a non-masquerade prefix: the longest prefix
/// decides, so traffic to the exception is masqueraded and the rest of the prefix keeps the
/// pod's address. A connection that started unmasqueraded toward what became an exception
/// keeps its address while the exception drains; with the exception gone, the prefix keeps
/// addresses again.
fn an_exception_inside_a_non_masquerade_prefix_is_masqueraded<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let prefix = policy_with(F::REMOTE_NET);
    let host: F::Net = format!("{}/{}", F::REMOTE, F::ADDR_LEN * 8)
        .parse()
        .unwrap();
    set_policy::<F>(&mut h, &prefix, &[]);
    let established = tcp(F::POD, 4100, F::REMOTE, 443, ACK);
    assert_eq!(h.egress(&established), (TC_ACT_OK, established.clone()));

    set_policy::<F>(&mut h, &prefix, &[host]);
    assert_eq!(
        h.egress(&established),
        (TC_ACT_OK, established.clone()),
        "a connection that started unmasqueraded keeps its address"
    );
    assert_eq!(F::draining(&h), [(F::ADDR_LEN as u32 * 8, F::REMOTE)]);
    for new in [
        tcp(F::POD, 4101, F::REMOTE, 443, SYN),
        udp(F::POD, 4101, F::REMOTE, 53),
        ping(F::POD, F::REMOTE, F::ECHO_REQUEST, 4101),
    ] {
        let (verdict, out) = h.egress(&new);
        assert_eq!(verdict, TC_ACT_OK);
        assert_eq!(
            F::at(&out, F::SRC),
            F::NODE,
            "to the exception: masqueraded"
        );
        assert!(checksums_ok::<F>(&out));
    }
    let elsewhere = udp(F::POD, 4102, F::ROUTER, 53);
    assert_eq!(
        h.egress(&elsewhere),
        (TC_ACT_OK, elsewhere.clone()),
        "the rest of the prefix keeps the pod's address"
    );

    set_policy::<F>(&mut h, &prefix, &[]);
    let fresh = tcp(F::POD, 4103, F::REMOTE, 443, SYN);
    assert_eq!(
        h.egress(&fresh),
        (TC_ACT_OK, fresh),
        "the exception is gone"
    );
    assert!(F::draining(&h).is_empty(), "and drains no more");
}

fn nothing_is_translated_before_the_agent_configures_ports<F: HarnessFamily>() {
    let mut h = TestBed::unconfigured(16).unwrap();
    let packet = tcp(F::POD, 1000, F::REMOTE, 443, SYN);
    let (verdict, out) = h.egress(&packet);
    assert_eq!((verdict, out), (TC_ACT_OK, packet));
    assert_eq!(h.counter(Counter::NotInspected), 1);
}

/// A table reused or carried from an agent with other spans may hold a flow whose port on the
/// node is outside this agent's spans. Until the agent sets the entryless bits of the ports
/// outside the spans, which it does only once no flow holds such a port, replies to the node on
/// a port outside the spans are looked up and reach the pod; once set, they pass as the node's
/// own, unlooked-up.
fn replies_outside_the_spans_are_looked_up_until_no_flow_holds_such_a_port<F: HarnessFamily>() {
    let mut h = F::bed(64, &[(1024, 32767)], false);
    h.egress(&udp(F::POD, 30000, F::REMOTE, 53));
    // The flow as an agent whose spans held 45678 left it.
    let key = egress_key::<F>(&h, 30000);
    let mut egress = F::nat_entry(&h, &key).unwrap();
    let reply = F::nat_entry(&h, &key.reverse(&egress)).unwrap();
    F::remove(&mut h, &key.reverse(&egress));
    egress.port = 45678u16.to_be();
    let reply_key = key.reverse(&egress);
    F::plant(&mut h, &key, egress);
    F::plant(&mut h, &reply_key, reply);
    assert_eq!(
        expiry::node_side_port(&reply_key, &reply),
        Some(45678),
        "the port the agent finds outside the spans"
    );
    assert_eq!(expiry::node_side_port(&key, &egress), None, "a pod's");

    let answer = udp(F::REMOTE, 53, F::NODE, 45678);
    let looked_up = |h: &mut TestBed| {
        let (verdict, back) = h.ingress(&answer);
        assert_eq!(verdict, TC_ACT_OK);
        F::at(&back, F::DST) == F::POD
    };
    assert!(looked_up(&mut h), "looked up, and back to the pod");
    let spans = [masq_agent::ports::PortRange {
        first: 1024,
        last: 32767,
    }];
    let mut held = HeldPorts::default();
    held.hold(h.port_maps(), NodePorts::default()).unwrap();
    let seen = h.node_side_ports(&spans);
    let mark = |h: &mut TestBed, held: &mut HeldPorts| {
        let now = std::time::Instant::now();
        held.mark_entryless(&mut h.maps.entryless_ports, &seen, now, None)
            .unwrap();
    };
    mark(&mut h, &mut held);
    assert!(
        looked_up(&mut h),
        "still looked up: the agent has not found the ports outside the spans without entries"
    );
    held.outside_spans_entryless(&spans);
    mark(&mut h, &mut held);
    assert_eq!(
        h.ingress(&answer),
        (TC_ACT_OK, answer.clone()),
        "the node's own port, as the programs take it once its bit is set"
    );
    held.hold(h.port_maps(), NodePorts::default()).unwrap();
    assert_eq!(
        h.ingress(&answer),
        (TC_ACT_OK, answer.clone()),
        "the bits outside the spans outlast a new reading of the node's ports"
    );
}

/// A port the node holds inside NAT's spans (a service's: 10250) may have been given to a
/// masqueraded flow before the node held it. The agent sets its entryless bit, with which the
/// node's packets on it skip the NAT table's lookup, only from a read of the table that found
/// no flow on it, `GRACE` after the port was held; and clears it as the node stops holding the
/// port. Each step is shown by a flow planted where the agent found none, as no program would:
/// a reply looked up reaches the pod, one that skips the lookup does not.
fn a_held_port_skips_the_lookup_only_once_held_a_while_without_a_flow<F: HarnessFamily>() {
    let spans = [(1024, 32767)];
    let mut h = F::bed(64, &spans, false);
    h.egress(&udp(F::POD, 10250, F::REMOTE, 53));
    let key = egress_key::<F>(&h, 10250);
    let egress = F::nat_entry(&h, &key).unwrap();
    assert_eq!(u16::from_be(egress.port), 10250, "the pod's port, kept");
    let (reply_key, reply) = (
        key.reverse(&egress),
        F::nat_entry(&h, &key.reverse(&egress)),
    );
    let reply = reply.unwrap();
    let answer = udp(F::REMOTE, 53, F::NODE, 10250);
    let looked_up = |h: &mut TestBed| {
        let (verdict, back) = h.ingress(&answer);
        assert_eq!(verdict, TC_ACT_OK);
        F::at(&back, F::DST) == F::POD
    };
    let (span_ranges, settled) = (
        spans.map(|(first, last)| masq_agent::ports::PortRange { first, last }),
        Some(std::time::Instant::now()),
    );
    let service = NodePorts {
        udp: [10250].into(),
        ..NodePorts::default()
    };
    let mut held = HeldPorts::default();
    held.hold(h.port_maps(), service.clone()).unwrap();
    held.hold(h.port_maps(), service.clone()).unwrap();
    let (now, later) = (
        std::time::Instant::now(),
        std::time::Instant::now() + 2 * node_ports::GRACE,
    );
    let mut mark = |h: &mut TestBed, read_at, settled| {
        let seen = h.node_side_ports(&span_ranges);
        held.mark_entryless(&mut h.maps.entryless_ports, &seen, read_at, settled)
            .unwrap();
    };

    mark(&mut h, later, settled);
    assert!(
        looked_up(&mut h),
        "a flow holds the port: its replies are looked up"
    );
    let (remove, plant) = (
        |h: &mut TestBed| {
            F::remove(h, &key);
            F::remove(h, &reply_key);
        },
        |h: &mut TestBed| {
            F::plant(h, &key, egress);
            F::plant(h, &reply_key, reply);
        },
    );
    remove(&mut h);
    for (read_at, settled, why) in [
        (
            now,
            settled,
            "a read less than GRACE after the port was held",
        ),
        (
            later,
            None,
            "a read while an earlier agent's programs may run",
        ),
    ] {
        mark(&mut h, read_at, settled);
        plant(&mut h);
        assert!(looked_up(&mut h), "no bit from {why}");
        remove(&mut h);
    }
    mark(&mut h, later, settled);
    plant(&mut h);
    assert!(
        !looked_up(&mut h),
        "held a while, no flow on it: the node's port skips the lookup"
    );
    held.hold(h.port_maps(), NodePorts::default()).unwrap();
    assert!(
        looked_up(&mut h),
        "no longer held, NAT may hand it out again: looked up at once"
    );
}

/// Both CPUs send the same first packets of many flows, in the same order, at once: each flow is
/// made once, whichever CPU makes it, and the other CPU's packet takes its translation (an insert
/// that finds a half being written, or held, takes it as the other CPU's flow), so that the
/// table holds two halves a flow and no port serves two flows.
fn two_cpus_making_the_same_flows_at_once_make_each_once_with_one_port<F: HarnessFamily>() {
    const FLOWS: u16 = 400;
    let cpus = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .clamp(1, 2);
    let mut h = roomy_bed::<F>(FLOWS);
    let frames: Vec<Vec<u8>> = (0..FLOWS)
        .map(|n| tcp(F::POD, 20000 + n, F::REMOTE, 443, SYN))
        .collect();
    let runs = h.egress_on_cpus(&frames, cpus);
    for (n, frame) in frames.iter().enumerate() {
        let ports: HashSet<u16> = runs
            .iter()
            .map(|cpu| {
                let (verdict, out) = &cpu[n];
                assert_eq!(*verdict, TC_ACT_OK, "flow {n}");
                assert!(checksums_ok::<F>(out), "flow {n}");
                assert_changed_within(frame, out, &egress_fields::<F>(F::L4, TCP));
                word(out, F::L4)
            })
            .collect();
        assert_eq!(ports.len(), 1, "flow {n} left with {ports:?}");
    }
    let table = F::nat(&h);
    let keys: HashSet<_> = table.iter().map(|(key, _)| *key).collect();
    assert_eq!(keys.len(), table.len(), "a key held twice");
    assert_eq!(table.len(), 2 * usize::from(FLOWS), "two halves a flow");
    let ports: HashSet<u16> = table
        .iter()
        .filter(|(key, _)| key.direction == direction::EGRESS)
        .map(|(_, entry)| entry.port)
        .collect();
    assert_eq!(ports.len(), usize::from(FLOWS), "one port a flow");
}

/// Both CPUs send the same first datagrams of many of the node's own flows, on ports NAT
/// hands out, at once: whichever CPU remembers a flow, the other finds the flow's own halves
/// where it would have put them, and not a masqueraded flow's that holds the tuple, so that
/// neither moves the node's flow to another port as it would off a clash.
fn two_cpus_remembering_the_same_node_flows_at_once_leave_each_its_port<F: HarnessFamily>() {
    const FLOWS: u16 = 400;
    let first_port = SPANS[0].0;
    let cpus = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .clamp(1, 2);
    let mut h = roomy_bed::<F>(FLOWS);
    let frames: Vec<Vec<u8>> = (0..FLOWS)
        .map(|n| udp(F::NODE, first_port + n, F::REMOTE, 53))
        .collect();
    assert!(frames.iter().all(|frame| in_spans(word(frame, F::L4))));
    let runs = h.egress_on_cpus(&frames, cpus);
    for (n, frame) in frames.iter().enumerate() {
        for cpu in &runs {
            let (verdict, out) = &cpu[n];
            assert_eq!(*verdict, TC_ACT_OK, "flow {n}");
            assert_eq!(out, frame, "flow {n} left as it was");
        }
    }
    assert_eq!(h.counter(Counter::NodePortClash), 0);
    assert_eq!(
        F::nat(&h).len(),
        2 * usize::from(FLOWS),
        "two halves a flow"
    );
}

/// A CPU remembering one of the node's flows puts its reply half in before its egress half.
/// Another CPU that sees the flow's first packet between the two finds that half on the
/// node's tuple: it is the flow's own, not a masqueraded flow's, and the packet leaves as it
/// is, where a clash would move the node's flow to another port. The flow is made whole: a
/// half kept alone (through an early drop) is no flow's until it is.
fn a_nodes_flow_found_half_remembered_is_left_as_it_is_and_not_moved_off_itself<
    F: HarnessFamily,
>() {
    let mut h = harness::<F>();
    let port = SPANS[0].0 + 7;
    let datagram = udp(F::NODE, port, F::REMOTE, 53);
    assert_eq!(h.egress(&datagram), (TC_ACT_OK, datagram.clone()));
    let egress_key = key((F::NODE, port), (F::REMOTE, 53), UDP, direction::EGRESS);
    assert!(F::nat_entry(&h, &egress_key).is_some(), "remembered");
    F::remove(&mut h, &egress_key);
    assert_eq!(
        h.egress(&datagram),
        (TC_ACT_OK, datagram.clone()),
        "left as it is"
    );
    assert_eq!(h.counter(Counter::NodePortClash), 0);
    assert!(F::nat_entry(&h, &egress_key).is_some(), "made whole");
}

/// The default bed's spans, its table large enough that `flows` flows fill it to two fifths:
/// past three quarters, the slot table finds some halves' two buckets full, and a race would
/// not be told from a table that is full.
fn roomy_bed<F: HarnessFamily>(flows: u16) -> TestBed {
    F::bed(5 * u32::from(flows), &SPANS, true)
}

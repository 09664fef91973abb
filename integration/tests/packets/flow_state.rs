//! What a flow's entries remember, and when the agent's sweep removes them, in both families:
//! TCP's progress (which RST ends a flow, when a flow is established) and the timeouts.

use std::time::Duration;

use masq_agent::dataplane::{
    NatUsage,
    ebpf::{
        expiry::{self, FlowState, Timeouts},
        testbed::{TC_ACT_OK, TestBed},
    },
};
use masq_ebpf::{Counter, direction, tcp_seen};
use masq_testbed::packet::*;

use crate::family::*;

in_both_families!(
    expiry_removes_both_halves_of_idle_flows_only,
    only_an_acceptable_rst_ends_a_flow,
    a_flow_that_ignored_a_blind_rst_outlives_the_reset_timeout,
    blind_data_places_no_rst_behind_it,
    a_blind_fin_does_not_close_a_connection,
    a_flow_no_reply_crossed_is_not_established,
    an_orphaned_reply_half_is_removed,
    udp_and_echo_expire_as_conntrack_times_them,
    tcp_closes_expire_as_conntrack_times_each_state,
    a_syn_sent_again_finds_its_flow,
    a_syn_reopens_a_finished_connection,
    a_syn_from_outside_reopens_a_finished_inbound_connection,
    a_sweep_counts_once_a_half_its_walk_steps_onto_after_removing_it,
    a_table_that_holds_nothing_is_not_walked,
);

/// The agent's sweep of the family's NAT table, `idle` after the newest entry's last packet.
fn sweep_after<F: HarnessFamily>(h: &mut TestBed, idle: Duration) -> NatUsage {
    let newest = F::nat(h).iter().map(|(_, e)| e.last_seen_ns).max().unwrap();
    F::expire(h, &Timeouts::default(), newest + idle.as_nanos() as u64)
}

/// Idle long enough to be past `timeout`: by more than a last packet's time may lag it, and a
/// second.
fn past(timeout: Duration) -> Duration {
    timeout + expiry::LAST_SEEN_LAG + Duration::from_secs(1)
}

/// The same sweep, `idle` after the oldest entry's last packet: no entry has been idle longer.
/// (The packets of one test may fall on different ticks of the clock on a loaded machine.)
fn sweep_after_the_oldest<F: HarnessFamily>(h: &mut TestBed, idle: Duration) -> NatUsage {
    let oldest = F::nat(h).iter().map(|(_, e)| e.last_seen_ns).min().unwrap();
    F::expire(h, &Timeouts::default(), oldest + idle.as_nanos() as u64)
}

fn expiry_removes_both_halves_of_idle_flows_only<F: HarnessFamily>() {
    let mut h = harness::<F>();
    h.egress(&udp(F::POD, 2001, F::REMOTE, 53));
    let (_, tcp_out) = h.egress(&tcp(F::POD, 2002, F::REMOTE, 443, SYN));
    // The TCP flow completes its handshake both ways: established.
    let node_port = word(&tcp_out, F::L4);
    h.ingress(&tcp(F::REMOTE, 443, F::NODE, node_port, SYN | ACK));
    h.egress(&tcp(F::POD, 2002, F::REMOTE, 443, ACK));
    h.ingress(&tcp(F::REMOTE, 443, F::NODE, node_port, ACK));
    // A half-open TCP flow: SYN only.
    h.egress(&tcp(F::POD, 2003, F::REMOTE, 443, SYN));
    assert_eq!(F::nat(&h).len(), 6);
    assert_eq!(F::other_family_entries(&h), 0, "the other table holds none");

    let timeouts = Timeouts::default();
    // Never early: a last packet's time may lag it by up to LAST_SEEN_LAG, so a flow idle
    // that much past its timeout, by the time the table holds, may not be past it yet.
    assert_eq!(
        sweep_after_the_oldest::<F>(&mut h, timeouts.udp + expiry::LAST_SEEN_LAG).expired_flows,
        0
    );
    assert_eq!(pod_ports::<F>(&h), [2001, 2002, 2003]);
    // Past UDP's: the UDP flow no reply crossed goes, both halves.
    let run = sweep_after::<F>(&mut h, past(timeouts.udp));
    assert_eq!((run.pod_flows, run.expired_flows), (3, 1));
    assert_eq!(pod_ports::<F>(&h), [2002, 2003]);
    // Past a SYN's: the half-open flow goes; the established one stays for days.
    sweep_after::<F>(&mut h, past(timeouts.tcp_syn_sent));
    assert_eq!(pod_ports::<F>(&h), [2002]);
    assert_eq!(F::nat(&h).len(), 2, "no half of an expired flow is left");
    sweep_after::<F>(&mut h, past(timeouts.tcp_established));
    assert!(F::nat(&h).is_empty());

    // A flow on an address the node no longer has is forgotten at once.
    h.egress(&udp(F::POD, 2004, F::REMOTE, 53));
    assert_eq!(F::forget_address(&h, F::NODE), 1);
    assert!(F::nat(&h).is_empty());
}

/// One TCP connection from `POD` to `REMOTE:443` through the harness, segment by segment, with
/// sequence numbers chosen by the test.
pub(crate) struct Connection<F> {
    pod_port: u16,
    node_port: u16,
    family: std::marker::PhantomData<F>,
}

impl<F: HarnessFamily> Connection<F> {
    /// Opens it with the pod's SYN (sequence `isn`, so its next is `isn + 1`).
    pub(crate) fn open(h: &mut TestBed, pod_port: u16, isn: u32) -> Self {
        let syn = Tcp {
            sport: pod_port,
            dport: 443,
            flags: SYN,
            seq: isn,
            payload: &[],
            ..Tcp::default()
        };
        let (verdict, out) = h.egress(&syn.frame(F::POD, F::REMOTE));
        assert_eq!((verdict, F::at(&out, F::SRC)), (TC_ACT_OK, F::NODE));
        Connection {
            pod_port,
            node_port: word(&out, F::L4),
            family: std::marker::PhantomData,
        }
    }

    /// A connection through its handshake: the pod's ISN 1000, the remote's 5000.
    pub(crate) fn established(h: &mut TestBed, pod_port: u16) -> Self {
        let c = Connection::open(h, pod_port, 1000);
        c.remote_sends(h, SYN | ACK, 5000, 1001, &[]);
        c.pod_sends(h, ACK, 1001, 5001, &[]);
        c
    }

    /// A segment from the pod, as it left the node.
    pub(crate) fn pod_sends(&self, h: &mut TestBed, flags: u8, seq: u32, ack: u32, payload: &[u8]) {
        let segment = Tcp {
            sport: self.pod_port,
            dport: 443,
            flags,
            seq,
            ack,
            payload,
        };
        let (verdict, out) = h.egress(&segment.frame(F::POD, F::REMOTE));
        assert_eq!((verdict, F::at(&out, F::SRC)), (TC_ACT_OK, F::NODE));
    }

    /// A segment from the outside host, which must reach the pod.
    pub(crate) fn remote_sends(
        &self,
        h: &mut TestBed,
        flags: u8,
        seq: u32,
        ack: u32,
        payload: &[u8],
    ) {
        let segment = Tcp {
            sport: 443,
            dport: self.node_port,
            flags,
            seq,
            ack,
            payload,
        };
        let (verdict, back) = h.ingress(&segment.frame(F::REMOTE, F::NODE));
        assert_eq!(verdict, TC_ACT_OK);
        let delivered = (F::at(&back, F::DST), word(&back, F::L4 + 2));
        assert_eq!(delivered, (F::POD, self.pod_port));
    }

    /// Where the flow is in its life, as the agent's sweep judges it.
    fn state(&self, h: &TestBed) -> FlowState {
        let table = F::nat(h);
        let (key, egress) = table
            .iter()
            .find(|(k, _)| {
                k.direction == direction::EGRESS && u16::from_be(k.sport) == self.pod_port
            })
            .expect("the flow's egress half");
        let ingress = F::nat_entry(h, &key.reverse(egress)).expect("its reply half");
        FlowState::of(key, egress, &ingress)
    }

    /// Whether either half of the flow took an RST.
    fn reset(&self, h: &TestBed) -> bool {
        F::nat(h)
            .iter()
            .filter(|(k, e)| {
                (k.direction == direction::EGRESS && u16::from_be(k.sport) == self.pod_port)
                    || (k.direction == direction::INGRESS && e.port == self.pod_port.to_be())
            })
            .any(|(_, e)| e.tcp_seen & tcp_seen::RESET != 0)
    }
}

/// An RST ends a flow only when the end it is sent to would accept it (RFC 5961 §3, as
/// conntrack judges): its sequence number is the receiver's next expected one. A blind RST, out
/// of the window or in it but not exact, passes on (the pod's kernel answers or ignores it)
/// and leaves the flow's state as it was; an exact one, or one right behind the sender's own
/// data, ends it.
fn only_an_acceptable_rst_ends_a_flow<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let c = Connection::<F>::open(&mut h, 40100, 1000);
    c.remote_sends(&mut h, SYN | ACK, 5000, 1001, &[]);
    c.pod_sends(&mut h, ACK, 1001, 5001, &[]);
    c.remote_sends(&mut h, ACK, 5001, 1001, &[0x61; 100]);
    c.pod_sends(&mut h, ACK, 1001, 5101, &[]);
    let blind = [
        5101 + 1_000_000,
        5100,
        5101 + 10,
        5101u32.wrapping_sub(1 << 31),
    ];
    for (n, seq) in blind.into_iter().enumerate() {
        c.remote_sends(&mut h, RST, seq, 0, &[]);
        assert!(
            !c.reset(&h),
            "an RST at {seq}, expected 5101, ended the flow"
        );
        assert_eq!(h.counter(Counter::TcpRstNotAcceptable), n as u64 + 1);
    }
    c.remote_sends(&mut h, RST | ACK, 5101, 1001, &[]);
    assert!(c.reset(&h), "the exact RST ends the flow");

    // An RST right behind data the pod has not acknowledged yet follows the sender's own
    // segment: the pod takes the data, then the RST.
    let c = Connection::<F>::open(&mut h, 40101, 2000);
    c.remote_sends(&mut h, SYN | ACK, 7000, 2001, &[]);
    c.pod_sends(&mut h, ACK, 2001, 7001, &[]);
    c.remote_sends(&mut h, ACK | PSH, 7001, 2001, &[0x62; 50]);
    c.remote_sends(&mut h, RST, 7051, 0, &[]);
    assert!(
        c.reset(&h),
        "an RST right behind the sender's data ends the flow"
    );

    // Before the pod's SYN is answered, an RST must acknowledge it.
    let c = Connection::<F>::open(&mut h, 40102, 3000);
    c.remote_sends(&mut h, RST | ACK, 0, 9999, &[]);
    assert!(!c.reset(&h), "an RST acknowledging another SYN");
    c.remote_sends(&mut h, RST | ACK, 0, 3001, &[]);
    assert!(c.reset(&h), "the refusal of the pod's SYN ends the flow");

    // The pod's own RST, at its next sequence number, ends its flow too.
    let c = Connection::<F>::open(&mut h, 40103, 4000);
    c.remote_sends(&mut h, SYN | ACK, 8000, 4001, &[]);
    c.pod_sends(&mut h, ACK, 4001, 8001, &[0x63; 10]);
    c.pod_sends(&mut h, RST, 4011, 0, &[]);
    assert!(c.reset(&h), "the pod's RST ends its flow");
    assert_eq!(h.counter(Counter::TcpRstNotAcceptable), 5);

    // The pod's RST elsewhere is judged as the remote would: at what the remote acknowledged
    // (its data past that lost), and nowhere else.
    let c = Connection::<F>::open(&mut h, 40109, 6000);
    c.remote_sends(&mut h, SYN | ACK, 9000, 6001, &[]);
    c.pod_sends(&mut h, ACK, 6001, 9001, &[0x66; 20]);
    c.remote_sends(&mut h, ACK, 9001, 6011, &[]);
    c.pod_sends(&mut h, RST, 6015, 0, &[]);
    assert!(!c.reset(&h), "the pod's RST at neither number");
    assert_eq!(h.counter(Counter::TcpRstNotAcceptable), 6);
    c.pod_sends(&mut h, RST, 6011, 0, &[]);
    assert!(c.reset(&h), "the pod's RST at what the remote acknowledged");
    assert_eq!(h.counter(Counter::TcpRstNotAcceptable), 6);
}

/// A blind sender cannot place an acceptable RST by sending data first: the remote's next
/// sequence number follows any segment, and an RST right behind the sender's own segment is
/// accepted, but only where that segment ends within reach of what the pod acknowledged (16
/// MiB). Further ahead, the two packets pass and the flow keeps its state; near,
/// as a real sender's data lies, the RST ends it. The pod's own RST behind its data counts
/// whatever a blind ACK made of what the remote acknowledged.
fn blind_data_places_no_rst_behind_it<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let cases = [
        (40104, 5001u32.wrapping_add(1 << 30), false),
        (40105, 5001 + (1 << 25), false),
        (40106, 5001 + (1 << 20), true),
    ];
    for (pod_port, data_seq, ends) in cases {
        let c = Connection::<F>::established(&mut h, pod_port);
        c.remote_sends(&mut h, ACK, data_seq, 1001, &[0x64; 10]);
        c.remote_sends(&mut h, RST, data_seq.wrapping_add(10), 0, &[]);
        assert_eq!(
            c.reset(&h),
            ends,
            "data at {data_seq}, then an RST behind it"
        );
    }
    assert_eq!(h.counter(Counter::TcpRstNotAcceptable), 2);
    let c = Connection::<F>::established(&mut h, 40108);
    c.remote_sends(&mut h, ACK, 5001, 1001u32.wrapping_add(1 << 30), &[]);
    c.pod_sends(&mut h, ACK, 1001, 5001, &[0x65; 10]);
    c.pod_sends(&mut h, RST, 1011, 0, &[]);
    assert!(c.reset(&h), "the pod's RST behind its own data");
    assert_eq!(h.counter(Counter::TcpRstNotAcceptable), 2);
}

/// A FIN from outside closes its half only near what the pod acknowledged (16 MiB): a blind
/// one, at any other number, passes on and the connection stays established, with its
/// timeout, where a closing state's would let the sweep end it after two idle minutes.
fn a_blind_fin_does_not_close_a_connection<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let c = Connection::<F>::established(&mut h, 40107);
    for blind in [5001u32.wrapping_add(1 << 30), 5001u32.wrapping_sub(1 << 25)] {
        c.remote_sends(&mut h, FIN | ACK, blind, 1001, &[]);
        assert_eq!(c.state(&h), FlowState::Established, "a FIN at {blind}");
    }
    assert_eq!(h.counter(Counter::TcpFinNotAcceptable), 2);
    c.remote_sends(&mut h, FIN | ACK, 5001, 1001, &[]);
    assert_ne!(c.state(&h), FlowState::Established, "the remote's own FIN");
    assert_eq!(h.counter(Counter::TcpFinNotAcceptable), 2);
}

/// A pod's SYN goes to a new flow's steps without a lookup. One sent again, or a connection
/// opened again on a tuple whose flow the table still holds, finds that flow where a new one's
/// halves would go: it keeps the flow's port, leaves no other reserved, and moves the flow on
/// as a packet that looked it up would.
fn a_syn_sent_again_finds_its_flow<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let first = Connection::<F>::open(&mut h, 40400, 1000);
    let again = Connection::<F>::open(&mut h, 40400, 1000);
    assert_eq!(again.node_port, first.node_port, "the flow's port");
    assert_eq!(F::nat(&h).len(), 2, "no other port left reserved");
    first.remote_sends(&mut h, RST | ACK, 0, 1001, &[]);
    assert!(first.reset(&h), "refused");
    let reopened = Connection::<F>::open(&mut h, 40400, 900_000);
    assert_eq!(reopened.node_port, first.node_port, "the flow's port");
    assert_eq!(F::nat(&h).len(), 2, "no other port left reserved");
    let next_seq = F::nat(&h)
        .iter()
        .find(|(k, _)| k.direction == direction::EGRESS)
        .map(|(_, e)| e.tcp_next_seq);
    assert_eq!(next_seq, Some(900_001), "the SYN moved the flow's half on");
    assert_eq!(h.counter(Counter::NodePortClash), 0);
    assert_eq!(
        h.decided_by_default(),
        1,
        "the policy's decision counted once"
    );
}

/// A SYN on the tuple of a connection that is over (reset, or closed both ways) opens a new
/// connection there, as conntrack reopens one (a client reusing its port): the flow keeps its
/// port but none of the old connection's state, which would have the new one expire ten
/// seconds after its last packet and go first from a full table, however long it lives. A SYN
/// on a connection that is not over changes nothing.
fn a_syn_reopens_a_finished_connection<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let reset = Connection::<F>::established(&mut h, 40410);
    reset.remote_sends(&mut h, RST, 5001, 0, &[]);
    let closed = Connection::<F>::established(&mut h, 40411);
    closed.pod_sends(&mut h, FIN | ACK, 1001, 5001, &[]);
    closed.remote_sends(&mut h, FIN | ACK, 5001, 1002, &[]);
    closed.pod_sends(&mut h, ACK, 1002, 5002, &[]);
    assert_eq!(
        [reset.state(&h), closed.state(&h)],
        [FlowState::Reset, FlowState::TimeWait]
    );
    for old in [reset, closed] {
        let new = Connection::<F>::open(&mut h, old.pod_port, 700_000);
        assert_eq!(new.node_port, old.node_port, "the flow's port");
        assert_eq!(new.state(&h), FlowState::SynSent, "a new connection");
        new.remote_sends(&mut h, SYN | ACK, 9000, 700_001, &[]);
        new.pod_sends(&mut h, ACK, 700_001, 9001, &[]);
        assert_eq!(new.state(&h), FlowState::Established);
    }
    assert_eq!(h.counter(Counter::TcpReopened), 2);
    let run = sweep_after::<F>(&mut h, past(Timeouts::default().tcp_time_wait));
    assert_eq!(run.expired_flows, 0, "established again: kept for days");

    let live = Connection::<F>::established(&mut h, 40412);
    live.pod_sends(&mut h, SYN, 1000, 0, &[]);
    live.remote_sends(&mut h, SYN, 5000, 0, &[]);
    assert_eq!(
        live.state(&h),
        FlowState::Established,
        "not over: no reopening"
    );
    assert_eq!(h.counter(Counter::TcpReopened), 2);

    // Only the end that opened the connection reopens it: not the remote end of a pod's
    // connection (conntrack: invalid), nor a SYN that carries a FIN or an RST too.
    let reset = Connection::<F>::established(&mut h, 40413);
    reset.remote_sends(&mut h, RST, 5001, 0, &[]);
    reset.remote_sends(&mut h, SYN, 80_000, 0, &[]);
    reset.pod_sends(&mut h, SYN | FIN, 600_000, 0, &[]);
    reset.pod_sends(&mut h, SYN | RST, 600_000, 0, &[]);
    assert_eq!(reset.state(&h), FlowState::Reset);
    assert_eq!(h.counter(Counter::TcpReopened), 2);
}

/// The same for a connection opened from outside toward a pod's own address: the client's SYN
/// on the tuple of one that was reset opens a new one, which keeps the pod's address.
fn a_syn_from_outside_reopens_a_finished_inbound_connection<F: HarnessFamily>() {
    let mut h = harness::<F>();
    // Both ways pass unchanged: the pod keeps its own address.
    let send = |h: &mut TestBed, from_remote: bool, flags: u8, seq: u32, ack: u32| {
        let (sport, dport, src, dst) = if from_remote {
            (5555, 8080, F::REMOTE, F::POD)
        } else {
            (8080, 5555, F::POD, F::REMOTE)
        };
        let segment = Tcp {
            sport,
            dport,
            flags,
            seq,
            ack,
            payload: &[],
        };
        let frame = segment.frame(src, dst);
        let passed = if from_remote {
            h.ingress(&frame)
        } else {
            h.egress(&frame)
        };
        assert_eq!(passed, (TC_ACT_OK, frame));
    };
    let state = |h: &TestBed| {
        let table = F::nat(h);
        let (key, egress) = table
            .iter()
            .find(|(k, _)| k.direction == direction::EGRESS && u16::from_be(k.sport) == 8080)
            .expect("the flow's pod-side half");
        let ingress = F::nat_entry(h, &key.reverse(egress)).expect("its other half");
        FlowState::of(key, egress, &ingress)
    };
    send(&mut h, true, SYN, 100, 0);
    send(&mut h, false, SYN | ACK, 500, 101);
    send(&mut h, true, ACK, 101, 501);
    send(&mut h, true, RST, 101, 0);
    assert_eq!(state(&h), FlowState::Reset);
    send(&mut h, true, SYN, 90_000, 0);
    assert_eq!(state(&h), FlowState::SynSent, "a new connection");
    send(&mut h, false, SYN | ACK, 7000, 90_001);
    send(&mut h, true, ACK, 90_001, 7001);
    assert_eq!(state(&h), FlowState::Established);
    assert_eq!(h.counter(Counter::TcpReopened), 1);
    assert_eq!(F::nat(&h).len(), 2);
}

/// A blind RST leaves the flow to expire as an established one, not ten seconds after it.
fn a_flow_that_ignored_a_blind_rst_outlives_the_reset_timeout<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let c = Connection::<F>::open(&mut h, 40200, 1000);
    c.remote_sends(&mut h, SYN | ACK, 5000, 1001, &[]);
    c.pod_sends(&mut h, ACK, 1001, 5001, &[]);
    c.remote_sends(&mut h, RST, 5001 + 1_000_000, 0, &[]);
    let run = sweep_after::<F>(&mut h, past(Timeouts::default().tcp_syn_sent));
    assert_eq!(run.expired_flows, 0, "established: kept for hours");
    assert_eq!(F::nat(&h).len(), 2);
}

/// Established means both directions seen: a pod's lone ACK to a host that never answers, or
/// a SYN, holds its port only as long as conntrack keeps a SYN unanswered.
fn a_flow_no_reply_crossed_is_not_established<F: HarnessFamily>() {
    let mut h = harness::<F>();
    h.egress(&tcp(F::POD, 40300, F::REMOTE, 443, ACK));
    h.egress(&tcp(F::POD, 40301, F::REMOTE, 443, SYN));
    let (_, answered) = h.egress(&tcp(F::POD, 40302, F::REMOTE, 443, SYN));
    let node_port = word(&answered, F::L4);
    h.ingress(&tcp(F::REMOTE, 443, F::NODE, node_port, SYN | ACK));
    h.egress(&tcp(F::POD, 40302, F::REMOTE, 443, ACK));
    let unseen: Vec<u8> = F::nat(&h)
        .iter()
        .filter(|(k, _)| k.direction == direction::INGRESS && k.sport == 443u16.to_be())
        .map(|(_, e)| e.tcp_seen)
        .collect();
    assert_eq!(unseen.iter().filter(|&&s| s == 0).count(), 2, "{unseen:?}");

    let run = sweep_after::<F>(&mut h, past(Timeouts::default().tcp_syn_sent));
    assert_eq!(run.expired_flows, 2, "the lone ACK's flow and the SYN's");
    assert_eq!(
        pod_ports::<F>(&h),
        [40302],
        "the flow a reply crossed stays"
    );
}

fn an_orphaned_reply_half_is_removed<F: HarnessFamily>() {
    let mut h = harness::<F>();
    h.egress(&udp(F::POD, 3001, F::REMOTE, 53));
    let nat = F::nat(&h);
    let (egress_key, egress) = nat
        .iter()
        .find(|(k, _)| k.direction == direction::EGRESS)
        .unwrap();
    F::remove(&mut h, egress_key);
    let timeouts = Timeouts::default();
    let later = past(timeouts.orphan).as_nanos() as u64;
    let run = F::expire(&mut h, &timeouts, egress.last_seen_ns + later);
    assert_eq!(run.orphans_removed, 1);
    assert!(F::nat(&h).is_empty());
}

/// UDP as conntrack times it: a flow never answered, or answered once (a DNS query), goes
/// after 30 s; one that goes on both ways after its first exchange is a stream, kept 120 s.
/// An echo goes after 30 s.
fn udp_and_echo_expire_as_conntrack_times_them<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let timeouts = Timeouts::default();
    let exchange = |h: &mut TestBed, pod_port: u16, queries: usize, answers: usize| {
        let mut node_port = 0;
        for _ in 0..queries {
            let (_, out) = h.egress(&udp(F::POD, pod_port, F::REMOTE, 53));
            node_port = word(&out, F::L4);
        }
        for _ in 0..answers {
            h.ingress(&udp(F::REMOTE, 53, F::NODE, node_port));
        }
    };
    exchange(&mut h, 4001, 1, 0);
    exchange(&mut h, 4002, 1, 1);
    exchange(&mut h, 4003, 2, 1);
    exchange(&mut h, 4004, 3, 3);
    h.egress(&ping(F::POD, F::REMOTE, F::ECHO_REQUEST, 7));
    sweep_after::<F>(&mut h, past(timeouts.udp));
    assert_eq!(pod_ports::<F>(&h), [4004], "only the stream is left");
    sweep_after::<F>(&mut h, past(timeouts.udp_stream));
    assert!(F::nat(&h).is_empty());
}

/// A closing connection is timed by the state conntrack has it in, from the FINs and their
/// acknowledgments the programs saw: a FIN unanswered is `FIN_WAIT` (120 s), a FIN acknowledged
/// with the other end still open `CLOSE_WAIT` (60 s), FINs both ways acknowledged `TIME_WAIT`
/// (120 s), and FINs both ways with the later unacknowledged `LAST_ACK`, kept as long as
/// `TIME_WAIT` since conntrack moves on at any ACK.
fn tcp_closes_expire_as_conntrack_times_each_state<F: HarnessFamily>() {
    let mut h = harness::<F>();
    let established = |h: &mut TestBed, pod_port: u16| {
        let c = Connection::<F>::open(h, pod_port, 1000);
        c.remote_sends(h, SYN | ACK, 5000, 1001, &[]);
        c.pod_sends(h, ACK, 1001, 5001, &[]);
        c
    };
    let fin_wait = established(&mut h, 41001);
    fin_wait.pod_sends(&mut h, FIN | ACK, 1001, 5001, &[]);
    let close_wait = established(&mut h, 41002);
    close_wait.pod_sends(&mut h, FIN | ACK, 1001, 5001, &[]);
    close_wait.remote_sends(&mut h, ACK, 5001, 1002, &[]);
    // The outside host closes first, and the pod's data crosses its FIN.
    let closed_by_remote = established(&mut h, 41003);
    closed_by_remote.remote_sends(&mut h, FIN | ACK, 5001, 1001, &[]);
    closed_by_remote.pod_sends(&mut h, ACK | PSH, 1001, 5002, &[0x64; 10]);
    let time_wait = established(&mut h, 41004);
    time_wait.pod_sends(&mut h, FIN | ACK, 1001, 5001, &[]);
    time_wait.remote_sends(&mut h, FIN | ACK, 5001, 1002, &[]);
    time_wait.pod_sends(&mut h, ACK, 1002, 5002, &[]);
    let last_ack = established(&mut h, 41005);
    last_ack.pod_sends(&mut h, FIN | ACK, 1001, 5001, &[]);
    last_ack.remote_sends(&mut h, FIN | ACK, 5001, 1002, &[]);

    let states = [
        &fin_wait,
        &close_wait,
        &closed_by_remote,
        &time_wait,
        &last_ack,
    ]
    .map(|c| c.state(&h));
    use FlowState::*;
    assert_eq!(states, [FinWait, CloseWait, CloseWait, TimeWait, LastAck]);

    let timeouts = Timeouts::default();
    assert_eq!(
        sweep_after_the_oldest::<F>(&mut h, timeouts.tcp_close_wait + expiry::LAST_SEEN_LAG)
            .expired_flows,
        0,
        "never early"
    );
    let run = sweep_after::<F>(&mut h, past(timeouts.tcp_close_wait));
    assert_eq!(run.expired_flows, 2, "the two in CLOSE_WAIT");
    assert_eq!(pod_ports::<F>(&h), [41001, 41004, 41005]);
    sweep_after::<F>(
        &mut h,
        past(timeouts.tcp_last_ack.max(timeouts.tcp_time_wait)),
    );
    assert!(F::nat(&h).is_empty());
}

/// The kernel's walk of a hash table steps from a half to the next one in its bucket as the
/// bucket was before the sweep saw the first: where a flow's two halves share a bucket, the
/// sweep that removes the flow at its first half steps onto the second, gone. It counts that
/// half once, as a read of the table does (`F::expire` compares them), and removes it once.
/// In a four-entry table (four buckets) a flow's halves share one a quarter of the time: 64
/// sweeps of two flows each all miss that once in some ten billion runs.
fn a_sweep_counts_once_a_half_its_walk_steps_onto_after_removing_it<F: HarnessFamily>() {
    let mut h = F::bed(4, &[(1024, 65535)], true);
    for round in 0..64 {
        for pod_port in [2001 + 2 * round, 2002 + 2 * round] {
            h.egress(&udp(F::POD, pod_port, F::REMOTE, 53));
        }
        assert_eq!(F::nat(&h).len(), 4);
        let usage = sweep_after::<F>(&mut h, past(Timeouts::default().udp));
        assert_eq!((usage.entries, usage.expired_flows), (4, 2), "{usage:?}");
        assert!(F::nat(&h).is_empty());
    }
}

/// A sweep of an empty table reads its first key and stops: the walk of its buckets is what an
/// idle agent spent most of its CPU on. The sweep program clears its report before each walk,
/// so a report left as the last walk wrote it says that none ran.
fn a_table_that_holds_nothing_is_not_walked<F: HarnessFamily>() {
    let mut h = harness::<F>();
    h.egress(&udp(F::POD, 2001, F::REMOTE, 53));
    let usage = sweep_after::<F>(&mut h, past(Timeouts::default().udp));
    assert_eq!((usage.entries, usage.expired_flows), (2, 1), "{usage:?}");
    assert!(F::nat(&h).is_empty());
    let walked = F::sweep_report(&h);
    let usage = F::expire(&mut h, &Timeouts::default(), u64::MAX / 2);
    assert_eq!(usage, NatUsage::default(), "an empty table: nothing found");
    assert_eq!(
        F::sweep_report(&h).entries,
        walked.entries,
        "the sweep program did not run over the empty table"
    );
    // Once a flow is made, the next sweep walks the table again.
    h.egress(&udp(F::POD, 2002, F::REMOTE, 53));
    let usage = sweep_after::<F>(&mut h, Duration::ZERO);
    assert_eq!((usage.entries, usage.expired_flows), (2, 0), "{usage:?}");
}

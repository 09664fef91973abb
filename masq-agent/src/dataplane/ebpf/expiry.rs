//! Expiry of NAT table entries. The data path records when each half of a flow last saw a
//! packet and how far a TCP connection got; here both halves of a flow are judged together and
//! removed together.

use std::{
    hash::BuildHasher as _,
    time::{Duration, Instant},
};

use hashbrown::HashTable;

use aya::Pod;
pub use masq_ebpf::flows::{FlowOwner, FlowState, node_side_port};
use masq_ebpf::{
    Address, NatEntry, NatKey, SweepOrder, direction, flows::idle_past, may_drop_from_full_table,
    nat_kind,
};

use super::{drop_sample, flow_table::NatTable, map_types::DropSample};
use crate::dataplane::nat_usage::NatUsage;

/// How often the NAT tables are swept for idle flows; upkeep runs more often than that, to
/// catch a changed address or a detached program quickly.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(masq_ebpf::NAT_SWEEP_INTERVAL_SECS);

/// When a sweep is due: at once, then every `SWEEP_INTERVAL`.
#[derive(Debug, Default)]
pub struct SweepClock {
    last: Option<Instant>,
}

impl SweepClock {
    /// Whether a sweep is due now; if so, the next is due `SWEEP_INTERVAL` from now.
    pub fn due(&mut self) -> bool {
        if self
            .last
            .is_some_and(|last| last.elapsed() < SWEEP_INTERVAL)
        {
            return false;
        }
        self.last = Some(Instant::now());
        true
    }
}

/// How long a flow may stay idle, by protocol and state: conntrack's classes, with the node's
/// own values where it lists them (`/proc/sys/net/netfilter/nf_conntrack_*timeout*`), so that
/// a flow stays in the NAT table as long as conntrack keeps its entry, and no longer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// A SYN sent, no answer yet (`SYN_SENT`).
    pub tcp_syn_sent: Duration,
    /// A SYN answered, the handshake not done (`SYN_RECV`).
    pub tcp_syn_recv: Duration,
    pub tcp_established: Duration,
    /// A FIN one way, not acknowledged yet (`FIN_WAIT`).
    pub tcp_fin_wait: Duration,
    /// A FIN one way, acknowledged; the other end has not closed (`CLOSE_WAIT`).
    pub tcp_close_wait: Duration,
    /// FINs both ways, the later not acknowledged yet (`LAST_ACK`).
    pub tcp_last_ack: Duration,
    /// FINs both ways, each acknowledged (`TIME_WAIT`).
    pub tcp_time_wait: Duration,
    /// An acceptable RST (`CLOSE`): over, and gone quickly so that churn does not fill the
    /// table.
    pub tcp_reset: Duration,
    /// UDP never answered, or answered once.
    pub udp: Duration,
    /// UDP seen both ways again after its first exchange: a stream.
    pub udp_stream: Duration,
    pub icmp: Duration,
    /// A reply-direction half without its egress half: left by an allocation that lost a race,
    /// or by a crash between the two inserts.
    pub orphan: Duration,
}

impl Default for Timeouts {
    /// Conntrack's defaults.
    fn default() -> Self {
        let secs = Duration::from_secs;
        Timeouts {
            tcp_syn_sent: secs(120),
            tcp_syn_recv: secs(60),
            tcp_established: secs(432_000),
            tcp_fin_wait: secs(120),
            tcp_close_wait: secs(60),
            tcp_last_ack: secs(30),
            tcp_time_wait: secs(120),
            tcp_reset: secs(10),
            udp: secs(30),
            udp_stream: secs(120),
            icmp: secs(30),
            orphan: secs(10),
        }
    }
}

/// Where the node's conntrack lists its timeouts.
pub const CONNTRACK_SYSCTLS: &str = "/proc/sys/net/netfilter";

impl Timeouts {
    /// Conntrack's timeouts as the node sets them under `dir` (`CONNTRACK_SYSCTLS`); its
    /// defaults for those it does not list (conntrack not loaded yet, say).
    pub fn of_conntrack(dir: &std::path::Path) -> Timeouts {
        let read = |name: &str, default: Duration| {
            std::fs::read_to_string(dir.join(name))
                .ok()
                .and_then(|text| text.trim().parse().ok())
                .map_or(default, Duration::from_secs)
        };
        let d = Timeouts::default();
        Timeouts {
            tcp_syn_sent: read("nf_conntrack_tcp_timeout_syn_sent", d.tcp_syn_sent),
            tcp_syn_recv: read("nf_conntrack_tcp_timeout_syn_recv", d.tcp_syn_recv),
            tcp_established: read("nf_conntrack_tcp_timeout_established", d.tcp_established),
            tcp_fin_wait: read("nf_conntrack_tcp_timeout_fin_wait", d.tcp_fin_wait),
            tcp_close_wait: read("nf_conntrack_tcp_timeout_close_wait", d.tcp_close_wait),
            tcp_last_ack: read("nf_conntrack_tcp_timeout_last_ack", d.tcp_last_ack),
            tcp_time_wait: read("nf_conntrack_tcp_timeout_time_wait", d.tcp_time_wait),
            tcp_reset: read("nf_conntrack_tcp_timeout_close", d.tcp_reset),
            udp: read("nf_conntrack_udp_timeout", d.udp),
            udp_stream: read("nf_conntrack_udp_timeout_stream", d.udp_stream),
            icmp: read("nf_conntrack_icmp_timeout", d.icmp),
            orphan: d.orphan,
        }
    }

    /// How long conntrack keeps an idle flow in `state`.
    pub fn of(&self, state: FlowState) -> Duration {
        match state {
            FlowState::SynSent => self.tcp_syn_sent,
            FlowState::SynRecv => self.tcp_syn_recv,
            FlowState::Established => self.tcp_established,
            FlowState::FinWait => self.tcp_fin_wait,
            FlowState::CloseWait => self.tcp_close_wait,
            // Conntrack moves on to TIME_WAIT at any ACK after the later FIN, and an ACK of an
            // earlier segment that crosses the FIN looks here like one before it: the flow may
            // be in TIME_WAIT for conntrack already, and must not go before it.
            FlowState::LastAck => self.tcp_last_ack.max(self.tcp_time_wait),
            FlowState::TimeWait => self.tcp_time_wait,
            FlowState::Reset => self.tcp_reset,
            FlowState::Unreplied | FlowState::Replied => self.udp,
            FlowState::Stream => self.udp_stream,
            FlowState::Echo => self.icmp,
        }
    }

    /// What a sweep at `now_ns` takes for over: a flow idle past its timeout, and the lag of
    /// its halves' clocks (`LAST_SEEN_LAG`); the same rules in userspace and in the kernel.
    pub fn sweep_order(&self, now_ns: u64) -> SweepOrder {
        let limit = |timeout: Duration| (timeout + LAST_SEEN_LAG).as_nanos() as u64;
        SweepOrder::new(
            now_ns,
            FlowState::ALL.map(|state| limit(self.of(state))),
            limit(self.orphan),
        )
    }
}

/// What `entries` hold: entries, and flows by kind (each flow has one egress half).
pub fn usage<A: Address>(entries: &[(NatKey<A>, NatEntry<A>)]) -> NatUsage {
    let mut usage = NatUsage {
        entries: entries.len(),
        ..NatUsage::default()
    };
    for (key, entry) in entries {
        if key.direction == direction::EGRESS {
            let owner = FlowOwner::of(key, entry);
            match owner {
                FlowOwner::Pod => usage.pod_flows += 1,
                FlowOwner::PodKept => usage.kept_flows += 1,
                FlowOwner::NodeTranslated | FlowOwner::NodeReserved => usage.node_flows += 1,
            }
            if owner.translated() {
                usage.translated_flows += 1;
            }
        }
    }
    usage
}

/// How many flows of `entries` the programs translate to each node address.
pub fn translated_by_address<A: Address + Ord>(
    entries: &[(NatKey<A>, NatEntry<A>)],
) -> std::collections::BTreeMap<A, usize> {
    let mut counts = std::collections::BTreeMap::new();
    for (key, entry) in entries {
        if key.direction == direction::EGRESS && entry.kind == nat_kind::SNAT {
            *counts.entry(entry.addr).or_default() += 1;
        }
    }
    counts
}

/// Removes every flow idle for longer than its timeout, both halves together, and reports
/// what the table held before. `now_ns` is read before the table: a flow idle past its timeout
/// then is over, as conntrack's entry is over then, whatever comes after. Conntrack never brings
/// an expired entry back for a late packet, but starts a new one; so a packet that reaches a
/// flow between the read and its removal is one conntrack would have started anew too, and the
/// flow goes without a second look (which cost a system call per half: most of a sweep under
/// churn, where most flows a sweep finds are over).
///
/// A table left under pressure (`UNDER_PRESSURE_PERCENT` full or more) gets its drop
/// `sample`, if given, pointed at its flows, as `SamplePointing` places them: new flows write
/// random slots, so between sweeps a sample forgets flows (and never had those the agent wrote
/// into the table), and a full table that looks at 16 slots could miss the droppable flows it
/// holds. Right after such a sweep every 16 slots in a row hold one a full table may drop,
/// while the table holds one for every 16 slots of the sample, and the other slots as many of
/// the flows as they have room for.
pub fn expire<A>(
    nat: &NatTable<A>,
    sample: Option<&DropSample<A>>,
    timeouts: &Timeouts,
    now_ns: u64,
) -> anyhow::Result<NatUsage>
where
    A: Address,
    NatKey<A>: Pod,
    NatEntry<A>: Pod,
{
    expire_seeing(nat, sample, timeouts, now_ns, |_, _| {})
}

/// `expire`, which also shows `seen` every entry the table held when read, those it then
/// removes included: what else the agent asks of the whole table is asked of the read the
/// sweep makes anyway.
pub fn expire_seeing<A>(
    nat: &NatTable<A>,
    sample: Option<&DropSample<A>>,
    timeouts: &Timeouts,
    now_ns: u64,
    mut seen: impl FnMut(&NatKey<A>, &NatEntry<A>),
) -> anyhow::Result<NatUsage>
where
    A: Address,
    NatKey<A>: Pod,
    NatEntry<A>: Pod,
{
    let entries = nat.read_all()?;
    entries.iter().for_each(|(key, entry)| seen(key, entry));
    let mut run = usage(&entries);
    // Asked only where there is a sample to point.
    let pressure = sample.map(|_| pressure_at(nat)).transpose()?;
    let pressed = |entries: usize| pressure.is_some_and(|pressure| entries >= pressure);
    let over = over(&entries, timeouts, now_ns, pressed(run.entries));
    run.orphans_removed = nat.remove_all(&over.orphans)?;
    run.expired_flows = nat.remove_all(&over.flows)? / 2;
    let left = run.entries - over.flows.len() - over.orphans.len();
    if let Some(sample) = sample.filter(|_| pressed(left)) {
        let pointed = drop_sample::point_at(sample, &over.droppable, &over.undroppable)?;
        tracing::debug!(
            left,
            slots_written = pointed,
            "NAT table under pressure: drop sample pointed"
        );
    }
    Ok(run)
}

/// How many entries put `nat` under pressure: `UNDER_PRESSURE_PERCENT` of its capacity.
pub fn pressure_at<A>(nat: &NatTable<A>) -> anyhow::Result<usize>
where
    A: Address,
    NatKey<A>: Pod,
    NatEntry<A>: Pod,
{
    Ok((nat.capacity()? * UNDER_PRESSURE_PERCENT).div_ceil(100))
}

/// How full a table left by a sweep is when the sweep points its drop sample at what a full
/// table may drop: well before it is full, so that the first new flow that finds it full
/// already finds one.
pub const UNDER_PRESSURE_PERCENT: usize = 75;

/// The keys of what a sweep removes, and of what a full table may drop.
#[derive(Debug, Default)]
struct Over<A> {
    /// Both halves of each flow idle past its timeout.
    flows: Vec<NatKey<A>>,
    /// Halves without their other half, idle past theirs.
    orphans: Vec<NatKey<A>>,
    /// The egress halves of the flows left that a full table may drop
    /// (`may_drop_from_full_table`), when asked for.
    droppable: Vec<NatKey<A>>,
    /// The egress halves of the other flows left, when asked for.
    undroppable: Vec<NatKey<A>>,
}

/// How far a half's `last_seen_ns` may lag its last packet (the programs refresh it at most
/// every `LAST_SEEN_REFRESH_NS`): a flow is over once idle this much past its timeout, never
/// before.
pub const LAST_SEEN_LAG: Duration = Duration::from_nanos(masq_ebpf::LAST_SEEN_REFRESH_NS);

/// What of `entries` was over at `now_ns`, and, if `find_droppable`, which of the rest a full
/// table may drop and which not.
fn over<A: Address>(
    entries: &[(NatKey<A>, NatEntry<A>)],
    timeouts: &Timeouts,
    now_ns: u64,
    find_droppable: bool,
) -> Over<A> {
    let order = timeouts.sweep_order(now_ns);
    let past = |last_seen_ns: u64, limit_ns: u64| idle_past(now_ns, last_seen_ns, limit_ns);
    // Each egress half finds its reply half by key. Up to half a million entries every ten
    // seconds: the reply halves are indexed by their place in `entries`, four bytes each, so
    // that the index stays in the caches where copies of the halves would not, and hashed with
    // foldhash, whose per-process random seed still keeps an outside host that picks its ports
    // from aiming at collisions.
    let hasher = foldhash::fast::RandomState::default();
    let hash = |key: &NatKey<A>| hasher.hash_one(key);
    let key_at = |index: &u32| &entries[*index as usize].0;
    let mut replies: HashTable<u32> = HashTable::with_capacity(entries.len() / 2);
    for (index, (key, _)) in entries.iter().enumerate() {
        if key.direction == direction::INGRESS {
            replies.insert_unique(hash(key), index as u32, |index| hash(key_at(index)));
        }
    }
    let egress = entries
        .iter()
        .filter(|(key, _)| key.direction != direction::INGRESS);
    let mut over = Over::default();
    for (key, entry) in egress {
        let reply_key = key.reverse(entry);
        let paired = replies
            .find_entry(hash(&reply_key), |index| *key_at(index) == reply_key)
            .ok()
            .map(|found| &entries[found.remove().0 as usize].1);
        match paired {
            Some(reply) => {
                let last = entry.last_seen_ns.max(reply.last_seen_ns);
                if past(last, order.limit(FlowState::of(key, entry, reply))) {
                    over.flows.extend([*key, reply_key]);
                } else if find_droppable {
                    let may_drop = may_drop_from_full_table(
                        entry.kind,
                        key.proto,
                        entry.tcp_seen,
                        reply.tcp_seen,
                    );
                    let list = if may_drop {
                        &mut over.droppable
                    } else {
                        &mut over.undroppable
                    };
                    list.push(*key);
                }
            }
            // An egress half alone cannot translate replies; let it go with its timeout.
            None => {
                if past(
                    entry.last_seen_ns,
                    order.limit(FlowState::of(key, entry, entry)),
                ) {
                    over.orphans.push(*key);
                }
            }
        }
    }
    // The reply halves no egress half claimed.
    for index in replies {
        let (key, reply) = &entries[index as usize];
        if past(reply.last_seen_ns, order.orphan_limit_ns) {
            over.orphans.push(*key);
        }
    }
    over
}

/// The keys a sweep at `now_ns` removes from a table that holds `entries`: both halves of each
/// flow that is over, and each half alone past its timeout. For the tests that hold the sweep
/// program to the same rules.
pub fn removed_by_sweep<A: Address>(
    entries: &[(NatKey<A>, NatEntry<A>)],
    timeouts: &Timeouts,
    now_ns: u64,
) -> Vec<NatKey<A>> {
    let Over { flows, orphans, .. } = over(entries, timeouts, now_ns, false);
    flows.into_iter().chain(orphans).collect()
}

/// Removes every flow on the node address `addr` (masqueraded to it, or the node's own from
/// it), both halves; returns how many.
pub fn forget_address<A>(nat: &NatTable<A>, addr: A) -> anyhow::Result<usize>
where
    A: Address,
    NatKey<A>: Pod,
    NatEntry<A>: Pod,
{
    let table = nat.read_all()?;
    let doomed: Vec<NatKey<A>> = table
        .iter()
        .filter(|(key, entry)| {
            // Masqueraded to the address, or the node's own flows from it.
            key.direction == direction::EGRESS
                && (entry.kind == nat_kind::SNAT && entry.addr == addr
                    || entry.kind == nat_kind::NODE && key.saddr == addr)
        })
        .flat_map(|(key, entry)| [*key, key.reverse(entry)])
        .collect();
    Ok(nat.remove_all(&doomed)? / 2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use masq_ebpf::{IPPROTO_TCP, tcp_seen};

    #[test]
    fn conntracks_own_values_are_taken_and_its_defaults_stand_in_for_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        for (name, value) in [
            ("nf_conntrack_udp_timeout", "10\n"),
            ("nf_conntrack_tcp_timeout_established", "7200\n"),
            ("nf_conntrack_tcp_timeout_close_wait", "300\n"),
        ] {
            std::fs::write(dir.path().join(name), value).unwrap();
        }
        let timeouts = Timeouts::of_conntrack(dir.path());
        let secs = Duration::from_secs;
        assert_eq!(timeouts.udp, secs(10));
        assert_eq!(timeouts.tcp_established, secs(7200));
        assert_eq!(timeouts.tcp_close_wait, secs(300));
        assert_eq!(timeouts.tcp_fin_wait, Timeouts::default().tcp_fin_wait);
        assert_eq!(timeouts.udp_stream, Timeouts::default().udp_stream);
        assert_eq!(
            Timeouts::of_conntrack(std::path::Path::new("/nonexistent")),
            Timeouts::default()
        );
    }

    /// A TCP half that sent up to `next_seq` (a FIN, when `fin`) and acknowledged `max_ack`.
    fn half(fin: bool, next_seq: u32, max_ack: u32) -> NatEntry<[u8; 4]> {
        let fin = if fin { tcp_seen::CLOSING } else { 0 };
        NatEntry {
            tcp_seen: tcp_seen::PAST_OPENING | tcp_seen::SEQ | tcp_seen::ACKED | fin,
            tcp_next_seq: next_seq,
            tcp_max_ack: max_ack,
            ..NatEntry::default()
        }
    }

    #[test]
    fn a_closing_connection_is_in_conntracks_state_once_its_fins_are_acknowledged() {
        let key = NatKey::<[u8; 4]> {
            proto: IPPROTO_TCP,
            ..NatKey::default()
        };
        // Halves an older agent made, without sequence numbers, are taken at their longest.
        let unnumbered = |mut half: NatEntry<[u8; 4]>| {
            half.tcp_seen &= !tcp_seen::SEQ;
            half
        };
        // The pod's FIN ends its data at 1001; the outside host's own data ends at 5001.
        let cases = [
            (
                half(true, 1001, 5001),
                half(false, 5001, 1000),
                FlowState::FinWait,
            ),
            (
                half(true, 1001, 5001),
                half(false, 5001, 1001),
                FlowState::CloseWait,
            ),
            // Acknowledged past the wrap of the sequence space.
            (
                half(true, u32::MAX, 5001),
                half(false, 5001, 3),
                FlowState::CloseWait,
            ),
            // The outside host closed first; the pod acknowledged.
            (
                half(false, 1001, 5001),
                half(true, 5001, 1001),
                FlowState::CloseWait,
            ),
            // FINs both ways: the later acknowledged, or not.
            (
                half(true, 1001, 5001),
                half(true, 5001, 1001),
                FlowState::TimeWait,
            ),
            (
                half(true, 1001, 5000),
                half(true, 5001, 1001),
                FlowState::LastAck,
            ),
            (
                half(true, 1001, 5000),
                half(true, 5001, 1000),
                FlowState::LastAck,
            ),
            (
                unnumbered(half(true, 1001, 5001)),
                half(false, 5001, 1001),
                FlowState::FinWait,
            ),
        ];
        for (egress, ingress, expected) in cases {
            assert_eq!(
                FlowState::of(&key, &egress, &ingress),
                expected,
                "{egress:?} {ingress:?}"
            );
        }
    }

    #[test]
    fn last_ack_is_kept_as_long_as_time_wait_would_be() {
        let timeouts = Timeouts::default();
        assert_eq!(timeouts.of(FlowState::LastAck), timeouts.tcp_time_wait);
        assert_eq!(timeouts.of(FlowState::CloseWait), Duration::from_secs(60));
    }
}

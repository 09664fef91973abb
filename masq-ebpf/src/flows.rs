//! What a flow in the NAT table is, and when it is over: judged the same by the agent's sweep
//! in userspace and by the sweep program in the kernel (`SweepOrder`, `SweepReport`).

use crate::{
    Address, EARLY_DROP_PROBES, IPPROTO_TCP, IPPROTO_UDP, NatEntry, NatKey, direction, nat_kind,
    node_ports, packets_seen, tcp_seen,
};

/// Where a flow is in its life, as conntrack classes it for its timeout.
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlowState {
    /// TCP: a SYN sent, no answer yet (or a lone segment no reply crossed).
    SynSent,
    /// TCP: a SYN answered, the handshake not done.
    SynRecv,
    /// TCP: a segment past the handshake's first step seen both ways.
    Established,
    /// TCP: a FIN one way, not acknowledged yet (or not known to be: a half without sequence
    /// numbers).
    FinWait,
    /// TCP: a FIN one way, acknowledged; the other end has not closed.
    CloseWait,
    /// TCP: FINs both ways, not both acknowledged.
    LastAck,
    /// TCP: FINs both ways, each acknowledged.
    TimeWait,
    /// TCP: an acceptable RST seen.
    Reset,
    /// UDP never answered.
    Unreplied,
    /// UDP answered, but not seen both ways again: a single exchange, as a DNS query.
    Replied,
    /// UDP seen both ways again after its first exchange.
    Stream,
    /// ICMP echo.
    Echo,
}

impl FlowState {
    /// Every state, in the order of their discriminants (`SweepOrder::idle_limits_ns`).
    pub const ALL: [FlowState; 12] = [
        FlowState::SynSent,
        FlowState::SynRecv,
        FlowState::Established,
        FlowState::FinWait,
        FlowState::CloseWait,
        FlowState::LastAck,
        FlowState::TimeWait,
        FlowState::Reset,
        FlowState::Unreplied,
        FlowState::Replied,
        FlowState::Stream,
        FlowState::Echo,
    ];

    /// Of the flow whose halves are `egress` and `ingress` (the reply's).
    #[inline(always)]
    pub fn of<A: Address>(key: &NatKey<A>, egress: &NatEntry<A>, ingress: &NatEntry<A>) -> Self {
        match key.proto {
            IPPROTO_TCP => {
                let seen = egress.tcp_seen | ingress.tcp_seen;
                let both_ways = egress.tcp_seen != 0 && ingress.tcp_seen != 0;
                if seen & tcp_seen::RESET != 0 {
                    FlowState::Reset
                } else if seen & tcp_seen::CLOSING != 0 {
                    FlowState::closing(egress, ingress)
                } else if both_ways && seen & tcp_seen::PAST_OPENING != 0 {
                    FlowState::Established
                } else if both_ways {
                    FlowState::SynRecv
                } else {
                    FlowState::SynSent
                }
            }
            IPPROTO_UDP => {
                // Each half counts its packets after the flow's first: the reply half's first
                // is the first answer.
                if egress.tcp_seen & packets_seen::ONCE != 0
                    && ingress.tcp_seen & packets_seen::AGAIN != 0
                {
                    FlowState::Stream
                } else if ingress.tcp_seen & packets_seen::ONCE != 0 {
                    FlowState::Replied
                } else {
                    FlowState::Unreplied
                }
            }
            _ => FlowState::Echo,
        }
    }

    /// Of a TCP flow that sent a FIN one way or both, as conntrack's state machine has it by the
    /// time the FINs are acknowledged. Where conntrack moves on at any ACK, this waits for the
    /// one that acknowledges the FIN: a state whose timeout is never shorter than conntrack's.
    #[inline(always)]
    fn closing<A: Address>(egress: &NatEntry<A>, ingress: &NatEntry<A>) -> Self {
        let closed = |half: &NatEntry<A>| half.tcp_seen & tcp_seen::CLOSING != 0;
        let acknowledged =
            |fin: &NatEntry<A>, other: &NatEntry<A>| closed(fin) && fin_acknowledged(fin, other);
        match (closed(egress), closed(ingress)) {
            (true, true) if acknowledged(egress, ingress) && acknowledged(ingress, egress) => {
                FlowState::TimeWait
            }
            (true, true) => FlowState::LastAck,
            _ if acknowledged(egress, ingress) || acknowledged(ingress, egress) => {
                FlowState::CloseWait
            }
            _ => FlowState::FinWait,
        }
    }

    /// Whether nothing more may cross a flow in this state: a TCP connection reset, or closed
    /// both ways and both FINs acknowledged. Conntrack keeps such a flow for stray segments
    /// only (10 s after an RST, TIME_WAIT's 120 s), and drops it first from a full table, as
    /// does `early_drop`.
    pub const fn done(self) -> bool {
        matches!(self, FlowState::Reset | FlowState::TimeWait)
    }

    /// Its name, as `masq-agent flows` shows it.
    pub fn name(self) -> &'static str {
        match self {
            FlowState::SynSent => "syn_sent",
            FlowState::SynRecv => "syn_recv",
            FlowState::Established => "established",
            FlowState::FinWait => "fin_wait",
            FlowState::CloseWait => "close_wait",
            FlowState::LastAck => "last_ack",
            FlowState::TimeWait => "time_wait",
            FlowState::Reset => "reset",
            FlowState::Unreplied => "unreplied",
            FlowState::Replied => "replied",
            FlowState::Stream => "stream",
            FlowState::Echo => "echo",
        }
    }
}

/// Whether `other` acknowledged everything `sent` sent, its FIN included: the FIN counts in
/// `tcp_next_seq`. Halves without sequence numbers (an older agent's) never say so.
#[inline(always)]
fn fin_acknowledged<A: Address>(sent: &NatEntry<A>, other: &NatEntry<A>) -> bool {
    sent.tcp_seen & tcp_seen::SEQ != 0
        && other.tcp_seen & tcp_seen::ACKED != 0
        && (other.tcp_max_ack.wrapping_sub(sent.tcp_next_seq) as i32) >= 0
}

/// Whose a flow is, and what the programs do with it; in the order a smaller table takes
/// them when a table is replaced.
#[repr(u8)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum FlowOwner {
    /// A pod's, masqueraded.
    Pod,
    /// A pod's, left its own address: a connection opened from outside, or one that started
    /// unmasqueraded before a policy change (`PASSTHROUGH`).
    PodKept,
    /// The node's own, translated to another port of its address for a clash.
    NodeTranslated,
    /// The node's own, held to reserve its tuple (`NODE`), which its next packet makes again.
    NodeReserved,
}

impl FlowOwner {
    /// Every owner, in the order of their discriminants (`SweepReport::flows`).
    pub const ALL: [FlowOwner; 4] = [
        FlowOwner::Pod,
        FlowOwner::PodKept,
        FlowOwner::NodeTranslated,
        FlowOwner::NodeReserved,
    ];

    /// Of the flow whose egress half is `entry`, keyed `key`.
    #[inline(always)]
    pub fn of<A: Address>(key: &NatKey<A>, entry: &NatEntry<A>) -> FlowOwner {
        match entry.kind {
            nat_kind::PASSTHROUGH => FlowOwner::PodKept,
            nat_kind::NODE => FlowOwner::NodeReserved,
            _ if entry.addr == key.saddr => FlowOwner::NodeTranslated,
            _ => FlowOwner::Pod,
        }
    }

    /// Whether the programs translate its packets: those flows need the programs to go on.
    pub const fn translated(self) -> bool {
        matches!(self, FlowOwner::Pod | FlowOwner::NodeTranslated)
    }
}

/// The port a half holds on the node's side, if it holds one there (host byte order): a reply
/// half's destination port (the port a masqueraded flow was given, or a node flow's own), and a
/// node flow's egress half's source port. A flow that keeps a pod's address holds none.
#[inline(always)]
pub fn node_side_port<A: Address>(key: &NatKey<A>, entry: &NatEntry<A>) -> Option<u16> {
    if entry.kind == nat_kind::PASSTHROUGH {
        return None;
    }
    if key.direction == direction::INGRESS {
        return Some(u16::from_be(key.dport));
    }
    match FlowOwner::of(key, entry) {
        FlowOwner::NodeTranslated | FlowOwner::NodeReserved => Some(u16::from_be(key.sport)),
        FlowOwner::Pod | FlowOwner::PodKept => None,
    }
}

/// Whether a half last seen at `last_seen_ns` has been idle past `limit_ns` at `now_ns`.
#[inline(always)]
pub const fn idle_past(now_ns: u64, last_seen_ns: u64, limit_ns: u64) -> bool {
    now_ns.saturating_sub(last_seen_ns) > limit_ns
}

/// What the agent asks of the sweep program (`map_names::SWEEP_ORDER`): which flows are over.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SweepOrder {
    /// CLOCK_MONOTONIC, read before the sweep: a flow idle past its limit then is over.
    pub now_ns: u64,
    /// How long a flow may stay idle, by `FlowState`: its timeout, and the lag of the halves'
    /// clocks.
    pub idle_limits_ns: [u64; FlowState::ALL.len()],
    /// The same for a reply half without its egress half.
    pub orphan_limit_ns: u64,
    /// The least of all the limits above: a half idle no longer is not over, whatever its
    /// other half says, and its other half is not looked up.
    pub shortest_limit_ns: u64,
    /// Non-zero: the table is under pressure, and the sweep points the drop sample's slots at
    /// the flows it leaves (`SamplePointing`).
    pub point_drop_sample: u64,
}

impl SweepOrder {
    pub fn new(
        now_ns: u64,
        idle_limits_ns: [u64; FlowState::ALL.len()],
        orphan_limit_ns: u64,
    ) -> SweepOrder {
        SweepOrder {
            now_ns,
            idle_limits_ns,
            orphan_limit_ns,
            shortest_limit_ns: idle_limits_ns.into_iter().fold(orphan_limit_ns, u64::min),
            point_drop_sample: 0,
        }
    }

    /// The same order, which also points the drop sample at the flows the sweep leaves.
    pub fn pointing_the_drop_sample(self) -> SweepOrder {
        SweepOrder {
            point_drop_sample: 1,
            ..self
        }
    }

    /// The limit of a flow in `state`.
    #[inline(always)]
    pub fn limit(&self, state: FlowState) -> u64 {
        // The index is a discriminant of `FlowState`, every one of which has a limit.
        self.idle_limits_ns
            .get(state as usize)
            .copied()
            .unwrap_or(u64::MAX)
    }
}

/// What the sweep program found and did in one family's table (`map_names::SWEEP_REPORT`, at
/// the family's index, `sweep_report::V4` or `V6`). The agent zeroes it before each run.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SweepReport {
    /// Halves the sweep found, removed or not: what a read of the table finds.
    pub entries: u64,
    /// Halves the sweep removed.
    pub halves_removed: u64,
    /// Flows found, by `FlowOwner` (each flow has one egress half).
    pub flows: [u64; FlowOwner::ALL.len()],
    /// Flows over, both halves removed.
    pub expired_flows: u64,
    /// Halves without their other half removed.
    pub orphans_removed: u64,
    /// Halves found that hold a port on the node's side outside NAT's spans.
    pub ports_outside_spans: u64,
    /// The ports the halves found hold on the node's side, laid out as `node_ports::slot`
    /// says.
    pub node_side_ports: [u64; node_ports::WORDS as usize],
    /// The flows the sweep pointed the drop sample at, if asked to.
    pub pointed: SamplePointing,
}

impl SweepReport {
    /// Halves the table held after the sweep.
    pub const fn entries_left(&self) -> u64 {
        self.entries.saturating_sub(self.halves_removed)
    }
}

impl Default for SweepReport {
    fn default() -> Self {
        SweepReport {
            entries: 0,
            halves_removed: 0,
            flows: [0; FlowOwner::ALL.len()],
            expired_flows: 0,
            orphans_removed: 0,
            ports_outside_spans: 0,
            node_side_ports: [0; node_ports::WORDS as usize],
            pointed: SamplePointing::default(),
        }
    }
}

/// Where a sweep that leaves a table under pressure points the drop sample's slots, flow by
/// flow as it finds them, in whatever order: every `EARLY_DROP_PROBES`-th slot is reserved for
/// a flow a full table may drop (`may_drop_from_full_table`), so that any `EARLY_DROP_PROBES`
/// slots in a row, which a full table looks at, hold one once the table has as many such flows
/// as there are reserved slots; the other slots take the flows it may not drop (which may close
/// later and become droppable), from the first, and the droppable flows beyond the reserved
/// slots, from the last, which may take the place of a flow it may not drop. Slots not pointed
/// keep what the programs wrote. The kernel's walk and the agent's list place flows alike,
/// without knowing beforehand how many of each there are; a flow the walk meets twice (it may
/// revisit an element when others are removed) may take two slots.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SamplePointing {
    /// Flows a full table may drop, placed or not.
    pub droppable: u32,
    /// Flows it may not drop, placed.
    pub undroppable: u32,
}

impl SamplePointing {
    /// The slots of a sample of `slots` reserved for droppable flows, one in every
    /// `EARLY_DROP_PROBES` (or one, in a smaller sample): 0, `EARLY_DROP_PROBES`, and so on.
    #[inline(always)]
    pub const fn reserved_slots(slots: u32) -> u32 {
        let reserved = slots / EARLY_DROP_PROBES;
        if reserved == 0 { 1 } else { reserved }
    }

    /// The slot of a sample of `slots` (a power of two, as `drop_sample_slots` makes it) for
    /// the next flow, which a full table may drop or not; none once the slots for it are
    /// taken.
    #[inline(always)]
    pub fn place(&mut self, slots: u32, droppable: bool) -> Option<u32> {
        if slots == 0 {
            return None;
        }
        let reserved = Self::reserved_slots(slots);
        let stride = slots / reserved;
        let others = slots - reserved;
        // The `nth` of the other slots, skipping the reserved ones.
        let other = |nth: u32| nth + nth.checked_div(stride - 1).unwrap_or(0) + 1;
        if droppable {
            let nth = self.droppable;
            self.droppable += 1;
            if nth < reserved {
                return Some(nth * stride);
            }
            let beyond = nth - reserved;
            (beyond < others).then(|| other(others - 1 - beyond))
        } else {
            let beyond = self.droppable.saturating_sub(reserved);
            if self.undroppable + beyond >= others {
                return None;
            }
            self.undroppable += 1;
            Some(other(self.undroppable - 1))
        }
    }
}

/// Each family's slot of the map `nat_sweep_report` (`map_names::SWEEP_REPORT`).
pub mod sweep_report {
    pub const V4: u32 = 0;
    pub const V6: u32 = 1;
}

//! The NAT sweep in the kernel: the agent runs `masq_sweep` through BPF_PROG_TEST_RUN every
//! sweep interval, over a frame whose EtherType names the family, where the kernel has
//! `bpf_for_each_map_elem` (5.13). The table is judged where it lies, with the rules the
//! agent's own sweep uses (`masq_ebpf::flows`), instead of being copied out whole.
//!
//! One walk, in which each half is judged as it is visited, whichever of a flow's two comes
//! first. A half idle no longer than the shortest timeout belongs to a flow that is not over,
//! whatever its other half says: it costs a visit, and no lookup. Otherwise its other half is
//! looked up and the flow judged by both; a flow over loses both halves at once, while both
//! are in the cache. The walk steps onto the other half all the same where it came next in
//! the bucket (the kernel takes the next element before it calls for the current one), and
//! finds it alone: a half alone looks itself up, and one gone is passed over. Each half is
//! counted once, with the port it holds on the node's side: as it is visited, or as its flow
//! is removed, so that the report says what a read of the table says. Both halves reach the
//! same verdict on their flow, so the one visited second finds what the first left. A removed
//! element goes back to the table's free list, and a new flow the data path makes during the
//! walk may take it at once, into another bucket: the walk may then skip or revisit a few
//! halves; a flow skipped is judged at the next sweep, and one revisited is judged again by
//! the same rules.
//!
//! A table under pressure also has its drop sample pointed at the flows the walk leaves
//! (`SweepOrder::point_drop_sample`): each egress half left looks its reply half up, to tell
//! whether a full table may drop the flow, and takes the slot `SamplePointing` gives it. The
//! agent once read the whole table out for this, which cost it more than the walk.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    macros::classifier,
    programs::TcContext,
};
use masq_ebpf::{
    FlowOwner, FlowState, NatEntry, NatKey, SweepOrder, SweepReport, direction,
    flows::{idle_past, node_side_port},
    may_drop_from_full_table, node_ports,
};

use crate::{
    family::{Family, V4, V6},
    flow_table, maps, parse, ports,
};

#[classifier]
pub fn masq_sweep(ctx: TcContext) -> i32 {
    let swept = match parse::ethertype(&ctx) {
        Some(parse::ETH_P_IP) => sweep::<V4>(),
        Some(parse::ETH_P_IPV6) => sweep::<V6>(),
        _ => false,
    };
    if swept { TC_ACT_OK } else { TC_ACT_SHOT }
}

/// Sweeps one family's table; false if the order or the report is missing.
#[inline(never)]
fn sweep<F: Family>() -> bool {
    if order().is_none() || report::<F>().is_none() {
        return false;
    }
    flow_table::walk::<F, Judge>();
    true
}

#[inline(always)]
fn order() -> Option<&'static SweepOrder> {
    maps::SWEEP_ORDER.get(0)
}

#[inline(always)]
fn report<F: Family>() -> Option<&'static mut SweepReport> {
    let report = maps::SWEEP_REPORT.get_ptr_mut(F::SWEEP_REPORT)?;
    // SAFETY: only this program writes the report, and the agent runs it once at a time.
    Some(unsafe { &mut *report })
}

/// What the walk does with each half in the table: counts it, and points the drop sample at its
/// flow if ordered to, unless it judges its flow over and removes it, or finds it gone already.
struct Judge;

impl<F: Family> flow_table::Visit<F> for Judge {
    #[inline(never)]
    fn visit(key: &NatKey<F::Addr>, entry: &NatEntry<F::Addr>) -> i64 {
        judge::<F>(key, entry)
    }

    #[inline(always)]
    fn before_buckets(first: u32) {
        (F::SWEEP_AHEAD)(first);
    }

    #[inline(always)]
    fn looks_up_other_half(key: &NatKey<F::Addr>, entry: &NatEntry<F::Addr>) -> bool {
        order().is_some_and(|order| may_be_over(order, entry) || points_sample_at(order, key))
    }
}

#[inline(always)]
fn judge<F: Family>(key: &NatKey<F::Addr>, entry: &NatEntry<F::Addr>) -> i64 {
    let (Some(order), Some(report)) = (order(), report::<F>()) else {
        return 1;
    };
    if may_be_over(order, entry) && remove_if_over::<F>(order, report, key, entry) {
        return 0;
    }
    count(report, key, entry);
    if points_sample_at(order, key) {
        point_at::<F>(report, key, entry);
    }
    0
}

/// Whether the flow of a half may be over, and its other half must be looked up to tell: a
/// half idle no longer than the shortest timeout belongs to a flow that is not.
#[inline(always)]
fn may_be_over<A: masq_ebpf::Address>(order: &SweepOrder, entry: &NatEntry<A>) -> bool {
    idle_past(order.now_ns, entry.last_seen_ns, order.shortest_limit_ns)
}

/// Whether the walk points the drop sample at the flow of a half it leaves: at its egress
/// half, where ordered to.
#[inline(always)]
fn points_sample_at<A: masq_ebpf::Address>(order: &SweepOrder, key: &NatKey<A>) -> bool {
    order.point_drop_sample != 0 && key.direction == direction::EGRESS
}

/// `flow_table::read_ahead` for the sweep, each family's a global function.
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn masq_sweep_ahead_v4(first: u32) -> i64 {
    flow_table::read_ahead::<V4, Judge>(first);
    0
}

#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn masq_sweep_ahead_v6(first: u32) -> i64 {
    flow_table::read_ahead::<V6, Judge>(first);
    0
}

/// Points a slot of the drop sample at a flow the sweep leaves, by its egress half, where
/// `SamplePointing` places it; as the agent's sweep in userspace points it, a flow without its
/// reply half is not one a full table drops, and gets none.
#[inline(always)]
fn point_at<F: Family>(report: &mut SweepReport, key: &NatKey<F::Addr>, entry: &NatEntry<F::Addr>) {
    // SAFETY: the reply half is only read.
    let Some(reply) = (unsafe { flow_table::read::<F>(&key.reverse(entry)) }) else {
        return;
    };
    let droppable = may_drop_from_full_table(entry.kind, key.proto, entry.tcp_seen, reply.tcp_seen);
    let Some(slot) = report.pointed.place(F::drop_sample_slots(), droppable) else {
        return;
    };
    if let Some(sampled) = F::drop_sample().get_ptr_mut(slot) {
        // SAFETY: a map value, written whole. A new flow that writes the slot at once leaves
        // one of the two flows out of the sample, as `early_drop::remember` says.
        unsafe { *sampled = *key };
    }
}

/// Looks up the other half of a half that may be over and judges the flow by both; removes
/// what is over, counted as found, and says whether the half is gone (removed now, or
/// before the walk reached it).
#[inline(always)]
fn remove_if_over<F: Family>(
    order: &SweepOrder,
    report: &mut SweepReport,
    key: &NatKey<F::Addr>,
    entry: &NatEntry<F::Addr>,
) -> bool {
    // Removal takes keys off the stack, not out of the element being removed.
    let key = *key;
    let other_key = key.reverse(entry);
    // SAFETY: the other half is only read, and copied before anything is removed.
    let other = unsafe { flow_table::read::<F>(&other_key) }.copied();
    // A flow is paired from its egress half, as the agent's own sweep pairs them: a reply half
    // that its egress half does not name is alone.
    let other =
        other.filter(|other| key.direction == direction::EGRESS || other_key.reverse(other) == key);
    let Some(other) = other else {
        // The half after one whose flow the walk just removed, in the same bucket: the kernel
        // steps onto it as it found the bucket, though it is gone now (or its key is another
        // element's, made since). Counted and removed with its flow already; only a half
        // alone looks itself up, to tell.
        // SAFETY: the pointer is only compared.
        if unsafe { flow_table::read::<F>(&key) }.is_none_or(|held| !core::ptr::eq(held, entry)) {
            return true;
        }
        let limit = if key.direction == direction::EGRESS {
            // An egress half alone cannot translate replies; let it go with its timeout.
            order.limit(FlowState::of(&key, entry, entry))
        } else {
            order.orphan_limit_ns
        };
        if !idle_past(order.now_ns, entry.last_seen_ns, limit) {
            return false;
        }
        count(report, &key, entry);
        if flow_table::remove::<F>(&key).is_ok() {
            report.halves_removed += 1;
            report.orphans_removed += 1;
        }
        return true;
    };
    let ((egress_key, egress), reply) = if key.direction == direction::EGRESS {
        ((&key, entry), &other)
    } else {
        ((&other_key, &other), entry)
    };
    let last_seen_ns = egress.last_seen_ns.max(reply.last_seen_ns);
    let limit = order.limit(FlowState::of(egress_key, egress, reply));
    if !idle_past(order.now_ns, last_seen_ns, limit) {
        return false;
    }
    count(report, &key, entry);
    count(report, &other_key, &other);
    if flow_table::remove::<F>(&other_key).is_ok() {
        report.halves_removed += 1;
    }
    if flow_table::remove::<F>(&key).is_ok() {
        report.halves_removed += 1;
        report.expired_flows += 1;
    }
    true
}

/// Counts a half as found: toward the table's halves, its flow's owner if it is the egress
/// half, and the port it holds on the node's side.
#[inline(always)]
fn count<A: masq_ebpf::Address>(report: &mut SweepReport, key: &NatKey<A>, entry: &NatEntry<A>) {
    report.entries += 1;
    if key.direction == direction::EGRESS
        && let Some(flows) = report.flows.get_mut(FlowOwner::of(key, entry) as usize)
    {
        *flows += 1;
    }
    if let Some(port) = node_side_port(key, entry) {
        let in_spans = maps::settings().is_some_and(|s| ports::in_spans(s, port.to_be()));
        if !in_spans {
            report.ports_outside_spans += 1;
        }
        if let Some((word, bit)) = node_ports::slot(key.proto, port)
            && let Some(word) = report.node_side_ports.get_mut(word as usize)
        {
            *word |= bit;
        }
    }
}

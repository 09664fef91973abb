//! The NAT sweep in the kernel: the agent runs `masq_sweep` through BPF_PROG_TEST_RUN every
//! sweep interval, over a frame whose EtherType names the family, where the kernel has
//! `bpf_for_each_map_elem` (5.13). The table is judged where it lies, with the rules the
//! agent's own sweep uses (`masq_ebpf::flows`), instead of being copied out whole: a flow whose
//! egress half saw a packet within the shortest timeout costs a visit and no lookup.
//!
//! Two walks: the first removes what is over, the second counts what is left. Removing
//! elements during a walk may make it skip or revisit a few (a removed element goes back to
//! the table's free list and may be reused at once); a flow skipped is judged at the next
//! sweep, and one revisited is judged again by the same rules.

use core::ffi::c_void;

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_SHOT},
    helpers::generated::bpf_for_each_map_elem,
    macros::classifier,
    programs::TcContext,
};
use masq_ebpf::{
    FlowOwner, FlowState, NatEntry, NatKey, SweepOrder, SweepReport, direction,
    flows::{idle_past, node_side_port},
    node_ports,
};

use crate::{
    family::{Family, V4, V6},
    maps::{self, NatTable},
    parse, ports,
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
    walk(F::nat(), judge::<F>);
    walk(F::nat(), count::<F>);
    true
}

/// What `bpf_for_each_map_elem` calls for each element of a NAT table: its key, its value, and
/// the walk's context, unused here. Returns 0 to go on, 1 to stop.
type Visit<A> = extern "C" fn(*mut c_void, *const NatKey<A>, *const NatEntry<A>, *mut u64) -> i64;

#[inline(always)]
fn walk<A>(table: &'static NatTable<A>, visit: Visit<A>)
where
    A: masq_ebpf::Address,
{
    // The helper wants a context on the stack, even where the callback needs none.
    let mut unused = 0u64;
    // SAFETY: `table` is a hash map the object declares, and `visit` a static function of the
    // signature the helper calls, which the verifier checks against the map's key and value.
    unsafe {
        bpf_for_each_map_elem(
            core::ptr::from_ref(table).cast_mut().cast(),
            visit as *mut c_void,
            core::ptr::from_mut(&mut unused).cast(),
            0,
        );
    }
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

/// The first walk: removes each flow that is over, both halves, judged from its egress half,
/// and each half left alone past its timeout.
extern "C" fn judge<F: Family>(
    _table: *mut c_void,
    key: *const NatKey<F::Addr>,
    entry: *const NatEntry<F::Addr>,
    _unused: *mut u64,
) -> i64 {
    let (Some(order), Some(report)) = (order(), report::<F>()) else {
        return 1;
    };
    // SAFETY: the helper passes the element's key and value, valid for the call; the value is
    // only read.
    let (key, entry) = unsafe { (&*key, &*entry) };
    if key.direction == direction::EGRESS {
        judge_flow::<F>(order, report, key, entry);
    } else {
        judge_reply::<F>(order, report, key, entry);
    }
    0
}

#[inline(always)]
fn judge_flow<F: Family>(
    order: &SweepOrder,
    report: &mut SweepReport,
    key: &NatKey<F::Addr>,
    entry: &NatEntry<F::Addr>,
) {
    // No timeout is shorter: the flow is not over, whatever its reply half says.
    if !idle_past(order.now_ns, entry.last_seen_ns, order.shortest_limit_ns) {
        return;
    }
    // Removal takes keys off the stack, not out of the element being removed.
    let key = *key;
    let reply_key = key.reverse(entry);
    let owner = FlowOwner::of(&key, entry);
    // SAFETY: the reply half is only read.
    match unsafe { F::nat().get(reply_key) } {
        Some(reply) => {
            let last_seen_ns = entry.last_seen_ns.max(reply.last_seen_ns);
            let limit = order.limit(FlowState::of(&key, entry, reply));
            if idle_past(order.now_ns, last_seen_ns, limit) {
                if F::nat().remove(reply_key).is_ok() {
                    report.halves_removed += 1;
                }
                if F::nat().remove(key).is_ok() {
                    report.halves_removed += 1;
                    report.expired_flows += 1;
                    count_removed(report, owner);
                }
            }
        }
        // An egress half alone cannot translate replies; let it go with its timeout.
        None => {
            let limit = order.limit(FlowState::of(&key, entry, entry));
            if idle_past(order.now_ns, entry.last_seen_ns, limit) && F::nat().remove(key).is_ok() {
                report.halves_removed += 1;
                report.orphans_removed += 1;
                count_removed(report, owner);
            }
        }
    }
}

/// A reply half is judged with its flow, from the egress half, unless it has none.
#[inline(always)]
fn judge_reply<F: Family>(
    order: &SweepOrder,
    report: &mut SweepReport,
    key: &NatKey<F::Addr>,
    entry: &NatEntry<F::Addr>,
) {
    if !idle_past(order.now_ns, entry.last_seen_ns, order.orphan_limit_ns) {
        return;
    }
    let key = *key;
    // SAFETY: the egress half is only looked for.
    if unsafe { F::nat().get(key.reverse(entry)) }.is_some() {
        return;
    }
    if F::nat().remove(key).is_ok() {
        report.halves_removed += 1;
        report.orphans_removed += 1;
    }
}

#[inline(always)]
fn count_removed(report: &mut SweepReport, owner: FlowOwner) {
    if let Some(flows) = report.flows_removed.get_mut(owner as usize) {
        *flows += 1;
    }
}

/// The second walk: counts what is left, and the ports it holds on the node's side.
extern "C" fn count<F: Family>(
    _table: *mut c_void,
    key: *const NatKey<F::Addr>,
    entry: *const NatEntry<F::Addr>,
    _unused: *mut u64,
) -> i64 {
    let Some(report) = report::<F>() else {
        return 1;
    };
    // SAFETY: as in `judge`.
    let (key, entry) = unsafe { (&*key, &*entry) };
    report.entries_left += 1;
    if key.direction == direction::EGRESS
        && let Some(flows) = report
            .flows_left
            .get_mut(FlowOwner::of(key, entry) as usize)
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
    0
}

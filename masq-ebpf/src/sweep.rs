//! The NAT sweep in the kernel: the agent runs `masq_sweep` through BPF_PROG_TEST_RUN every
//! sweep interval, over a frame whose EtherType names the family, where the kernel has
//! `bpf_for_each_map_elem` (5.13). The table is judged where it lies, with the rules the
//! agent's own sweep uses (`masq_ebpf::flows`), instead of being copied out whole: a flow whose
//! egress half saw a packet within the shortest timeout costs a visit and no lookup.
//!
//! One walk of the table: each half is counted as it is found, with the port it holds on the
//! node's side, so that the report says what a read of the table says, and is then judged.
//! A flow over is listed (`Family::sweep_doomed`, by its egress key) and both its halves are
//! removed after the walk: removed at once, its reply half might not have been visited yet,
//! and would go uncounted, or its egress half might be missed by a reply half visited later,
//! which would take itself for an orphan. A half alone past its timeout is removed as it is
//! visited. Removing elements during a walk may make it skip or revisit a few (a removed
//! element goes back to the table's free list and may be reused at once); a flow skipped is
//! judged at the next sweep, and one revisited is judged again by the same rules.

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
    maps, parse, ports,
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
    let mut walk = Walk::default();
    for_each(F::nat(), judge::<F>, &mut walk);
    for_each(F::sweep_doomed(), remove_doomed::<F>, &mut walk);
    true
}

/// What the walk carries from element to element: how many reply halves it listed.
#[derive(Default)]
struct Walk {
    doomed: u32,
}

/// What `bpf_for_each_map_elem` calls for each element of a map: the map, the element's key
/// and value, and the walk. Returns 0 to go on, 1 to stop.
type Visit<K, V> = extern "C" fn(*mut c_void, *const K, *const V, *mut Walk) -> i64;

#[inline(always)]
fn for_each<M, K, V>(map: &'static M, visit: Visit<K, V>, walk: &mut Walk) {
    // SAFETY: `map` is a map the object declares, and `visit` a static function of the
    // signature the helper calls, which the verifier checks against the map's key and value;
    // `walk` lives on this stack for the whole call.
    unsafe {
        bpf_for_each_map_elem(
            core::ptr::from_ref(map).cast_mut().cast(),
            visit as *mut c_void,
            core::ptr::from_mut(walk).cast(),
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

/// Counts each half found, and removes each flow that is over, judged from its egress half,
/// and each half left alone past its timeout.
extern "C" fn judge<F: Family>(
    _table: *mut c_void,
    key: *const NatKey<F::Addr>,
    entry: *const NatEntry<F::Addr>,
    walk: *mut Walk,
) -> i64 {
    let (Some(order), Some(report)) = (order(), report::<F>()) else {
        return 1;
    };
    // SAFETY: the helper passes the element's key and value, valid for the call, which are
    // only read, and the walk `sweep` passed, which nothing else holds meanwhile.
    let (key, entry, walk) = unsafe { (&*key, &*entry, &mut *walk) };
    count(report, key, entry);
    if key.direction == direction::EGRESS {
        judge_flow::<F>(order, report, walk, key, entry);
    } else {
        judge_reply::<F>(order, report, key, entry);
    }
    0
}

#[inline(always)]
fn judge_flow<F: Family>(
    order: &SweepOrder,
    report: &mut SweepReport,
    walk: &mut Walk,
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
    // SAFETY: the reply half is only read.
    match unsafe { F::nat().get(reply_key) } {
        Some(reply) => {
            let last_seen_ns = entry.last_seen_ns.max(reply.last_seen_ns);
            let limit = order.limit(FlowState::of(&key, entry, reply));
            if idle_past(order.now_ns, last_seen_ns, limit) {
                doom::<F>(report, walk, key, reply_key);
            }
        }
        // An egress half alone cannot translate replies; let it go with its timeout.
        None => {
            let limit = order.limit(FlowState::of(&key, entry, entry));
            if idle_past(order.now_ns, entry.last_seen_ns, limit) && F::nat().remove(key).is_ok() {
                report.halves_removed += 1;
                report.orphans_removed += 1;
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

/// Lists a flow over, by its egress key, for removal after the walk; removes it at once if the
/// list is full, which only a walk that revisits elements can make it.
#[inline(always)]
fn doom<F: Family>(
    report: &mut SweepReport,
    walk: &mut Walk,
    key: NatKey<F::Addr>,
    reply_key: NatKey<F::Addr>,
) {
    match F::sweep_doomed().get_ptr_mut(walk.doomed) {
        Some(slot) => {
            // SAFETY: only this program writes the list, and the agent runs it once at a time.
            unsafe { *slot = key };
            walk.doomed += 1;
        }
        None => remove_flow::<F>(report, key, reply_key),
    }
}

/// Removes both halves of a flow over.
#[inline(always)]
fn remove_flow<F: Family>(
    report: &mut SweepReport,
    key: NatKey<F::Addr>,
    reply_key: NatKey<F::Addr>,
) {
    if F::nat().remove(reply_key).is_ok() {
        report.halves_removed += 1;
    }
    if F::nat().remove(key).is_ok() {
        report.halves_removed += 1;
        report.expired_flows += 1;
    }
}

/// What `bpf_for_each_map_elem` calls for each slot of the list of flows over: removes the
/// ones the walk listed, and stops after them.
extern "C" fn remove_doomed<F: Family>(
    _list: *mut c_void,
    slot: *const u32,
    key: *const NatKey<F::Addr>,
    walk: *mut Walk,
) -> i64 {
    // SAFETY: the helper passes the slot's index and value, valid for the call, and the walk
    // `sweep` passed; all are only read.
    let (slot, walk) = unsafe { (*slot, &*walk) };
    let Some(report) = report::<F>().filter(|_| slot < walk.doomed) else {
        return 1;
    };
    // Removal takes keys off the stack, not out of a map's value.
    // SAFETY: as above.
    let key = unsafe { *key };
    // SAFETY: the egress half is only read, for its reply half's key.
    if let Some(entry) = unsafe { F::nat().get(key) } {
        let reply_key = key.reverse(entry);
        remove_flow::<F>(report, key, reply_key);
    }
    0
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

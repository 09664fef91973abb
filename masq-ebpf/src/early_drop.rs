//! Early drop: what a full NAT table gives up for a new flow, as conntrack's early drop does.
//! The programs cannot walk a BPF hash table's buckets, so every new flow writes its key into
//! a slot of the drop sample (`remember`), and a full table looks at 16 slots of it for the
//! flow to drop (`early_drop`), in a global BPF function of each family.

use aya_ebpf::helpers::bpf_get_prandom_u32;
use masq_ebpf::{
    Address, Counter, EARLY_DROP_PROBES, FlowState, NatKey, drop_vacancy, flows::idle_past,
    may_drop_from_full_table, nat_kind, slot_table::BUCKET_SLOTS,
};

use crate::{clock::now_ns, family::Family, flow_table, maps};

// The slot table's early drop looks at both of a key's buckets, as many slots as a look at the
// drop sample.
const _: () = assert!(EARLY_DROP_PROBES == 2 * BUCKET_SLOTS);

/// Where a flow just made goes in the drop sample, where a full table may find it: a random
/// slot (`RANDOM`), or the slot of the flow `early_drop` dropped to make room for it
/// (`freed`). One register, as a step's argument must be. CPUs that write one slot at once
/// race harmlessly: the sample loses a flow (which expires as any other), or holds a key torn
/// by two writers, which is no flow's.
///
/// A flow made without dropping one (`RANDOM`) may have taken the room another CPU's drop
/// made, between its removal of a flow and its own insert: that CPU then drops another flow,
/// and the first's slot would point at a flow that is gone. Under a churn of new flows on
/// several CPUs such slots pile up until a sweep, and a table full of flows it may drop finds
/// none in its sample (measured: 4 threads of unanswered queries into a 64-flow table left 14
/// of 64 slots pointing at a flow, and refused up to 283 new flows in half a second). So a drop
/// names its slot in `maps::DROP_VACANCY` before it removes the flow, and a flow made without
/// a drop takes the named slot rather than a random one.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub struct SampleSlot(EarlyDrop);

impl SampleSlot {
    pub const RANDOM: SampleSlot = SampleSlot(EarlyDrop::NOTHING_DROPPED);

    #[inline(always)]
    pub fn freed(room: EarlyDrop) -> SampleSlot {
        SampleSlot(room)
    }
}

/// Writes a flow just made, by its egress key, into the drop sample, once: a freed slot, or the
/// vacant one a drop named, or a random one.
#[inline(always)]
pub fn remember<F: Family>(slot: SampleSlot, egress_key: &NatKey<F::Addr>) {
    // The slot table's early drop looks at the new flow's own buckets, not at a sample.
    if F::in_slot_table() {
        return;
    }
    let slot = if slot.0 == EarlyDrop::NOTHING_DROPPED {
        take_vacancy::<F>().unwrap_or_else(|| {
            // SAFETY: the helper has no preconditions.
            let random = unsafe { bpf_get_prandom_u32() };
            random & (F::drop_sample_slots() - 1)
        })
    } else {
        let freed = slot.0.slot();
        withdraw_vacancy::<F>(freed);
        freed
    };
    if let Some(sampled) = F::drop_sample().get_ptr_mut(slot) {
        // SAFETY: a map value, written whole; see `SampleSlot` for other CPUs.
        unsafe { *sampled = *egress_key };
    }
}

/// What `early_drop` says: `NOTHING_DROPPED`, or the slot of the drop sample the flow it
/// dropped held. One `i64`, as a register carries it back from a BPF function.
///
/// Not the port the dropped flow held: it is free only toward that flow's destination, and a
/// new flow toward another may find it taken there. The room a drop makes is what a new flow
/// needs; its port comes from a search, as any new flow's does (`nat::claim_port`).
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub struct EarlyDrop(i64);

impl EarlyDrop {
    /// No flow was dropped: none in the slots looked at could be, or the one chosen was gone,
    /// or no longer one to drop, by the time it was to be removed (another CPU took it). The
    /// caller may look again, at other slots.
    pub const NOTHING_DROPPED: EarlyDrop = EarlyDrop(-1);

    /// Whether a flow was dropped: the table had room for one more, until another CPU's new
    /// flow takes it.
    #[inline(always)]
    pub fn dropped(self) -> bool {
        self.0 >= 0
    }

    /// The slot of the drop sample the dropped flow held.
    #[inline(always)]
    fn slot(self) -> u32 {
        self.0 as u32
    }
}

/// The table is full: looks at `EARLY_DROP_PROBES` slots of the drop sample in a row, from a
/// random one, for the flow to drop, both halves: of those it may drop, the one idle longest.
/// (Flows take random slots, so slots in a row are a random sample too; a sample that small is
/// seen whole.) A flow of the node's own (`NODE`), a reservation its next packet makes again,
/// may go whatever its state; any other only if conntrack would drop it from a full table
/// (`can_drop_early`: never answered, not past its first exchange, or a TCP connection closing
/// or reset). An assured flow of a pod's is never dropped. Idle longest, not the first found:
/// a flow just made, a pod's connection in its handshake say, goes only when every other flow
/// it may drop in the slots is as young, where conntrack drops whichever it finds first.
///
/// But a flow that is finished goes as soon as it is found, and the slots after it are not
/// looked at: one that is over, whatever its state (idle past its timeout, by the limits the
/// agent gave its sweep, `SweepOrder`), which conntrack counts as gone already and the next
/// sweep would remove; or a TCP connection that nothing more may cross (`FlowState::done`:
/// reset, or closed both ways), which conntrack keeps only to absorb stray segments. A table
/// that a churn of connections fills is full of these (a flow reset stays until the sweep
/// after its 10 s), and each slot looked at costs a new flow three cold reads (its slot and
/// both halves): looking at all 16 cost a full table's new flow 7–10 µs more than one with
/// room, taking the first finished one 2–3 µs (docs/bench/profiles.md). Until the agent has
/// given an order, no flow is over.
///
/// Says `NOTHING_DROPPED` (also when another CPU removed the flow first), or the slot the flow
/// dropped held, for the new flow once it is made (`SampleSlot::freed`).
///
/// Where the halves are in the slot table, room for a half is in its key's buckets only: the
/// slots looked at are the two buckets' of the half this CPU last found no room for
/// (`PortRequest::no_room_for`; 16, as many as a sample's look), and not the drop sample,
/// which the slot table never fills.
#[inline(always)]
pub fn early_drop<F: Family>() -> EarlyDrop {
    // The clock is read here, by the program, and handed to the global functions: none of
    // them reads it. A kernel walks global functions before the program (5.10 does), and one
    // without the clock the agent chose would refuse the first that reads it, in a log that
    // shows only that function's few instructions instead of the program's path.
    EarlyDrop((F::EARLY_DROP)(now_ns()))
}

/// `early_drop`'s body, run by each family's global BPF function (`masq_early_drop_v4` and
/// `_v6`): the verifier walks a global function once, on its own, where it walks a static one
/// again at every call, in every state its caller reaches it with. Each slot's flow is ranked
/// by another (`masq_drop_rank_v4` and `_v6`), for the same reason: judged inline, the states
/// its branches leave (what state a flow is in, whether it is finished) multiplied through the
/// 16 probes, and the verifier processed 96 000 more instructions a program (562 000 in all
/// with the agent's order read as an `Option`).
#[inline(always)]
fn early_drop_global<F: Family>(now: u64) -> i64 {
    // SAFETY: the helper has no preconditions.
    let first = unsafe { bpf_get_prandom_u32() };
    // The first slot of each of the buckets that must make room, in the slot table.
    let buckets = if F::in_slot_table() {
        flow_table::slots_without_room::<F>()
    } else {
        [0; 2]
    };
    // The slot of the flow to take so far, and its rank.
    let (mut chosen_slot, mut chosen) = (NO_SLOT, Rank::LOWEST_PRIORITY);
    for probe in 0..EARLY_DROP_PROBES {
        let slot = if F::in_slot_table() {
            let bucket = if probe < BUCKET_SLOTS {
                buckets[0]
            } else {
                buckets[1]
            };
            bucket + probe % BUCKET_SLOTS
        } else {
            first.wrapping_add(probe) & (F::drop_sample_slots() - 1)
        };
        let rank = Rank((F::DROP_RANK)(slot, now));
        if rank.to_drop() && rank.0 < chosen.0 {
            (chosen_slot, chosen) = (slot, rank);
            if rank.finished() {
                break;
            }
        }
    }
    if chosen_slot == NO_SLOT {
        return EarlyDrop::NOTHING_DROPPED.0;
    }
    (F::DROP_RANKED)(chosen_slot, chosen.0, now)
}

/// The rank of the flow in the drop sample's `slot`, at `now_ns`, the body of each family's
/// `masq_drop_rank_v4` and `_v6`.
#[inline(always)]
fn drop_rank_global<F: Family>(slot: u32, now_ns: u64) -> i64 {
    SampledFlow::<F::Addr>::default()
        .look_at::<F>(slot, now_ns)
        .0
}

/// Drops the flow in the drop sample's `slot` if it is still the one ranked `rank`, the body of
/// each family's `masq_drop_ranked_v4` and `_v6`: a function of its own, beside the ranking,
/// so that the stack holds one flow's keys at a time (`early_drop_global` calls both).
#[inline(always)]
fn drop_ranked_global<F: Family>(slot: u32, rank: i64, now_ns: u64) -> i64 {
    SampledFlow::<F::Addr>::default()
        .drop_in::<F>(slot, Rank(rank), now_ns)
        .0
}

/// No slot of the drop sample: more than any sample has.
const NO_SLOT: u32 = u32::MAX;

/// How a full table ranks a flow of the drop sample, the lowest taken first: a flow that is
/// finished, then one it may drop, each the one idle longest first; or `NOT_TO_DROP`. One
/// `i64`, as a register carries it back from a BPF function: the later of the halves' last
/// packets' times (CLOCK_MONOTONIC, which reaches bit 62 after 146 years), with `LIVE` set for
/// a flow not finished. Two ranks of one slot are one flow's, unless another flow was made
/// there within the nanosecond of the first one's last packet.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
struct Rank(i64);

impl Rank {
    const NOT_TO_DROP: Rank = Rank(-1);
    /// Above any flow's rank.
    const LOWEST_PRIORITY: Rank = Rank(i64::MAX);
    const LIVE: i64 = 1 << 62;

    #[inline(always)]
    fn of(last_seen_ns: u64, finished: bool) -> Rank {
        let time = (last_seen_ns & (Rank::LIVE as u64 - 1)) as i64;
        Rank(if finished { time } else { time | Rank::LIVE })
    }

    #[inline(always)]
    fn to_drop(self) -> bool {
        self.0 >= 0
    }

    #[inline(always)]
    fn finished(self) -> bool {
        self.to_drop() && self.0 & Rank::LIVE == 0
    }
}

/// Whether a flow in `state`, last seen at `last_seen_ns`, is over at `now_ns`, by the limits
/// of the agent's sweep order. No limit of an order the agent wrote is zero: before it writes
/// one, no flow is over.
#[inline(always)]
fn is_over(state: FlowState, last_seen_ns: u64, now_ns: u64) -> bool {
    let Some(order) = maps::SWEEP_ORDER.get(0) else {
        return false;
    };
    let limit = order.limit(state);
    limit != 0 && idle_past(now_ns, last_seen_ns, limit)
}

/// A flow of the drop sample, as `early_drop` looks at it: its halves' keys, and what it
/// needs of its egress half once the flow is gone.
#[derive(Default)]
struct SampledFlow<A: Address> {
    key: NatKey<A>,
    reply_key: NatKey<A>,
    kind: u8,
}

impl<A: Address + 'static> SampledFlow<A> {
    /// Reads the flow the drop sample's `slot` points at (in the slot table, the flow whose half
    /// its slot `slot` holds), and ranks it: `NOT_TO_DROP` unless it is in the table, and is
    /// finished or a full table may drop it (see `early_drop`).
    #[inline(always)]
    fn look_at<F: Family<Addr = A>>(&mut self, slot: u32, now_ns: u64) -> Rank {
        if F::in_slot_table() {
            if !flow_table::flow_of_slot::<F>(slot, &mut self.key) {
                return Rank::NOT_TO_DROP;
            }
        } else {
            let Some(sampled) = F::drop_sample().get_ptr(slot) else {
                return Rank::NOT_TO_DROP;
            };
            // SAFETY: a map value, copied: another CPU may write a flow of its own into the
            // slot while this one looks, and the flow judged is the one to remove.
            self.key = unsafe { *sampled };
        }
        let Some(egress) = flow_table::find::<F>(&self.key) else {
            return Rank::NOT_TO_DROP;
        };
        // SAFETY: map value pointer from a successful lookup; its fields are copied out.
        unsafe {
            let entry = &*egress;
            self.reply_key = self.key.reverse(entry);
            self.kind = entry.kind;
        }
        let Some(reply) = flow_table::find::<F>(&self.reply_key) else {
            return Rank::NOT_TO_DROP;
        };
        // SAFETY: map value pointers from successful lookups, read only.
        let (egress, reply) = unsafe { (&*egress, &*reply) };
        let last_seen = egress.last_seen_ns.max(reply.last_seen_ns);
        let state = FlowState::of(&self.key, egress, reply);
        let finished = state.done() || is_over(state, last_seen, now_ns);
        if finished
            || may_drop_from_full_table(self.kind, self.key.proto, egress.tcp_seen, reply.tcp_seen)
        {
            Rank::of(last_seen, finished)
        } else {
            Rank::NOT_TO_DROP
        }
    }

    /// Drops the flow in the drop sample's `slot`, both halves, if it is still the one ranked
    /// `rank`: another CPU may have taken the flow, or the flow may have been answered, since.
    #[inline(always)]
    fn drop_in<F: Family<Addr = A>>(&mut self, slot: u32, rank: Rank, now_ns: u64) -> EarlyDrop {
        // Another CPU may have dropped the flow and written its own new flow into the slot
        // since, which must not go in its place.
        if self.look_at::<F>(slot, now_ns) != rank {
            return EarlyDrop::NOTHING_DROPPED;
        }
        if !F::in_slot_table() {
            vacate::<F>(slot);
        }
        if flow_table::remove::<F>(&self.key).is_err() {
            return EarlyDrop::NOTHING_DROPPED;
        }
        let _ = flow_table::remove::<F>(&self.reply_key);
        maps::count(if self.kind == nat_kind::NODE {
            // The node's flow goes on without its reservation.
            Counter::NatNodeFlowDropped
        } else {
            Counter::NatEarlyDropped
        });
        EarlyDrop(i64::from(slot))
    }
}

/// Names `slot` of the drop sample as the one whose flow is going, for whichever new flow
/// takes the room (`remember`).
#[inline(always)]
fn vacate<F: Family>(slot: u32) {
    if let Some(vacant) = maps::DROP_VACANCY.get_ptr_mut(F::DROP_VACANCY) {
        // SAFETY: a map value, read and written whole.
        unsafe {
            if *vacant == drop_vacancy::NONE {
                *vacant = drop_vacancy::naming(slot);
            }
        }
    }
}

/// The slot a drop named, if any, taken so that no other new flow is written there. Two CPUs
/// may take one vacancy: the later write to the slot wins, and the sample loses the other's
/// flow, as in `SampleSlot`.
#[inline(always)]
fn take_vacancy<F: Family>() -> Option<u32> {
    let vacant = maps::DROP_VACANCY.get_ptr_mut(F::DROP_VACANCY)?;
    // SAFETY: a map value, read and written whole.
    unsafe {
        let slot = drop_vacancy::named(*vacant)?;
        *vacant = drop_vacancy::NONE;
        Some(slot)
    }
}

/// The drop that named `slot` made its flow there itself: the vacancy is filled.
#[inline(always)]
fn withdraw_vacancy<F: Family>(slot: u32) {
    if let Some(vacant) = maps::DROP_VACANCY.get_ptr_mut(F::DROP_VACANCY) {
        // SAFETY: a map value, read and written whole.
        unsafe {
            if *vacant == drop_vacancy::naming(slot) {
                *vacant = drop_vacancy::NONE;
            }
        }
    }
}

/// `early_drop` for IPv4, a global BPF function (`early_drop_global`).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn masq_early_drop_v4(now_ns: u64) -> i64 {
    early_drop_global::<crate::family::V4>(now_ns)
}

/// The rank of a flow of the IPv4 drop sample, a global BPF function (`drop_rank_global`).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn masq_drop_rank_v4(slot: u32, now_ns: u64) -> i64 {
    drop_rank_global::<crate::family::V4>(slot, now_ns)
}

/// The rank of a flow of the IPv6 drop sample, a global BPF function (`drop_rank_global`).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn masq_drop_rank_v6(slot: u32, now_ns: u64) -> i64 {
    drop_rank_global::<crate::family::V6>(slot, now_ns)
}

/// Drops a ranked flow of the IPv4 drop sample, a global BPF function (`drop_ranked_global`).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn masq_drop_ranked_v4(slot: u32, rank: i64, now_ns: u64) -> i64 {
    drop_ranked_global::<crate::family::V4>(slot, rank, now_ns)
}

/// Drops a ranked flow of the IPv6 drop sample, a global BPF function (`drop_ranked_global`).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn masq_drop_ranked_v6(slot: u32, rank: i64, now_ns: u64) -> i64 {
    drop_ranked_global::<crate::family::V6>(slot, rank, now_ns)
}

/// `early_drop` for IPv6, a global BPF function (`early_drop_global`).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn masq_early_drop_v6(now_ns: u64) -> i64 {
    early_drop_global::<crate::family::V6>(now_ns)
}

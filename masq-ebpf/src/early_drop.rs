//! Early drop: what a full NAT table gives up for a new flow, as conntrack's early drop does.
//! The programs cannot walk a BPF hash table's buckets, so every new flow writes its key into
//! a slot of the drop sample (`remember`), and a full table looks at 16 slots of it for the
//! flow to drop (`early_drop`), in a global BPF function of each family.

use aya_ebpf::helpers::bpf_get_prandom_u32;
use masq_ebpf::{
    Address, Counter, EARLY_DROP_PROBES, NatKey, drop_vacancy, may_drop_from_full_table, nat_kind,
};

use crate::{family::Family, maps, nat::lookup};

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
/// Says `NOTHING_DROPPED` (also when another CPU removed the flow first), or the slot the flow
/// dropped held, for the new flow once it is made (`SampleSlot::freed`).
#[inline(always)]
pub fn early_drop<F: Family>() -> EarlyDrop {
    EarlyDrop((F::EARLY_DROP)())
}

/// `early_drop`'s body, run by each family's global BPF function (`masq_early_drop_v4` and
/// `_v6`): the verifier walks a global function once, on its own, where it walks a static one
/// again at every call, in every state its caller reaches it with.
#[inline(always)]
fn early_drop_global<F: Family>() -> i64 {
    // SAFETY: the helper has no preconditions.
    let first = unsafe { bpf_get_prandom_u32() };
    // The flow looked at, overwritten by each look: the frame holds these two keys and no
    // more, which keeps it in the verifier's 512 bytes of stack.
    let mut flow = SampledFlow::default();
    // The slot of the flow idle longest so far, and its last packet's time.
    let (mut oldest_slot, mut oldest_seen) = (NO_SLOT, u64::MAX);
    for probe in 0..EARLY_DROP_PROBES {
        let slot = first.wrapping_add(probe) & (F::drop_sample_slots() - 1);
        if let Some(last_seen) = flow.look_at::<F>(slot)
            && last_seen < oldest_seen
        {
            (oldest_slot, oldest_seen) = (slot, last_seen);
        }
    }
    if oldest_slot == NO_SLOT {
        return EarlyDrop::NOTHING_DROPPED.0;
    }
    flow.drop_in::<F>(oldest_slot, oldest_seen).0
}

/// No slot of the drop sample: more than any sample has.
const NO_SLOT: u32 = u32::MAX;

/// A flow of the drop sample, as `early_drop` looks at it: its halves' keys, and what it
/// needs of its egress half once the flow is gone.
#[derive(Default)]
struct SampledFlow<A: Address> {
    key: NatKey<A>,
    reply_key: NatKey<A>,
    kind: u8,
}

impl<A: Address + 'static> SampledFlow<A> {
    /// Reads the flow the drop sample's `slot` points at. If it is in the table and a full
    /// table may drop it (see `early_drop`): the later of its halves' last packets' times.
    #[inline(always)]
    fn look_at<F: Family<Addr = A>>(&mut self, slot: u32) -> Option<u64> {
        let sampled = F::drop_sample().get_ptr(slot)?;
        // SAFETY: a map value, copied: another CPU may write a flow of its own into the slot
        // while this one looks, and the flow judged is the one to remove.
        self.key = unsafe { *sampled };
        let egress = lookup::<F>(&self.key)?;
        // SAFETY: map value pointer from a successful lookup; its fields are copied out.
        unsafe {
            let entry = &*egress;
            self.reply_key = self.key.reverse(entry);
            self.kind = entry.kind;
        }
        let reply = lookup::<F>(&self.reply_key)?;
        // SAFETY: map value pointers from successful lookups, read only.
        let (egress, reply) = unsafe { (&*egress, &*reply) };
        let may_drop =
            may_drop_from_full_table(self.kind, self.key.proto, egress.tcp_seen, reply.tcp_seen);
        may_drop.then_some(egress.last_seen_ns.max(reply.last_seen_ns))
    }

    /// Drops the flow in the drop sample's `slot`, both halves, if it is still the one looked
    /// at (its last packet at `last_seen`) and still one to drop: another CPU may have taken
    /// the flow, or the flow may have been answered, since.
    #[inline(always)]
    fn drop_in<F: Family<Addr = A>>(&mut self, slot: u32, last_seen: u64) -> EarlyDrop {
        // The flow judged, by the time of its last packet: another CPU may have dropped it
        // and written its own new flow into the slot since, which must not go in its place.
        if self.look_at::<F>(slot) != Some(last_seen) {
            return EarlyDrop::NOTHING_DROPPED;
        }
        vacate::<F>(slot);
        if F::nat().remove(self.key).is_err() {
            return EarlyDrop::NOTHING_DROPPED;
        }
        let _ = F::nat().remove(self.reply_key);
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
pub extern "C" fn masq_early_drop_v4() -> i64 {
    early_drop_global::<crate::family::V4>()
}

/// `early_drop` for IPv6, a global BPF function (`early_drop_global`).
#[unsafe(no_mangle)]
#[inline(never)]
pub extern "C" fn masq_early_drop_v6() -> i64 {
    early_drop_global::<crate::family::V6>()
}

//! The maps the programs share with the agent. Names match `masq_ebpf::map_names`.

use crate::parse::Packet;
use aya_ebpf::{
    btf_maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray},
    macros::btf_map,
};
use masq_ebpf::{
    Address, COUNTER_SLOTS, Counter, FRAGMENTS_MAX_ENTRIES, FragmentKey,
    INTERFACES_BY_IFINDEX_ENTRIES, INTERFACES_MAX_ENTRIES, IndexedInterface, Interface,
    NAT_DEFAULT_ENTRIES, NON_MASQ_CACHE_SLOTS, NON_MASQ_CACHE_SLOTS_V6, NON_MASQ_MAX_ENTRIES,
    NatEntry, NatKey, PolicyEntry, Settings, SweepOrder, SweepReport, decision_slot, node_ports,
    policy_index, policy_word, slot_table::Slot, verdict_slot,
};

/// A family's NAT table: both halves of every translated flow. A plain (not LRU) hash: when it
/// is full, new flows are dropped and counted, and no live flow is ever evicted. The agent sets
/// the size at load time.
pub type NatTable<A> = HashMap<NatKey<A>, NatEntry<A>, { NAT_DEFAULT_ENTRIES as usize }>;
/// `BPF_F_MMAPABLE` (include/uapi/linux/bpf.h): the array's values start on a page, so that
/// each slot is its own cache line (otherwise they start 312 bytes in, and straddle two), and
/// the agent may map them.
const BPF_F_MMAPABLE: usize = 1 << 10;
/// A family's slot table (`masq_ebpf::slot_table`): its slots, and a word per bucket. The agent
/// sets the sizes (one entry each where the halves are in the hash table).
pub type SlotArray<A> = Array<Slot<A>, 1, BPF_F_MMAPABLE>;
pub type SlotWords = Array<u64, 1, BPF_F_MMAPABLE>;
/// What the first fragment of each datagram in flight became: the address its later fragments
/// take.
pub type FragmentTable<A> = LruHashMap<FragmentKey<A>, A, { FRAGMENTS_MAX_ENTRIES as usize }>;
/// A sample of a NAT table's flows by egress key (`drop_sample_slots`), for all CPUs, so that a
/// CPU that finds the table full finds the flows the others made. The agent sets the size.
pub type DropSample<A> = Array<NatKey<A>, 1>;
/// Prefixes recently removed from a non-masquerade trie, with the time of their removal.
pub type DrainingTrie<A> = LpmTrie<A, u32, { NON_MASQ_MAX_ENTRIES as usize }>;
/// A family's policy: each prefix with its action and the slot that counts its decisions.
pub type PolicyTrie<A> = LpmTrie<A, PolicyEntry, { NON_MASQ_MAX_ENTRIES as usize }>;

#[btf_map(name = "non_masq_v4")]
pub static NON_MASQ_V4: PolicyTrie<[u8; 4]> = LpmTrie::new();

#[btf_map(name = "non_masq_v6")]
pub static NON_MASQ_V6: PolicyTrie<[u8; 16]> = LpmTrie::new();

#[btf_map(name = "non_masq_src_v4")]
pub static NON_MASQ_SRC_V4: PolicyTrie<[u8; 4]> = LpmTrie::new();

#[btf_map(name = "non_masq_src_v6")]
pub static NON_MASQ_SRC_V6: PolicyTrie<[u8; 16]> = LpmTrie::new();

/// The size here is the least the agent gives it; it sets the size when it loads the object.
#[btf_map(name = "policy_decisions")]
pub static DECISIONS: PerCpuArray<u64, { decision_slot::AT_LEAST as usize }> = PerCpuArray::new();

#[btf_map(name = "policy_generation")]
pub static POLICY_GENERATION: Array<u32, 1> = Array::new();

#[btf_map(name = "non_masq_cache_v4")]
pub static NON_MASQ_CACHE_V4: PerCpuArray<verdict_slot::Slot, { NON_MASQ_CACHE_SLOTS as usize }> =
    PerCpuArray::new();

#[btf_map(name = "non_masq_v6_cache")]
pub static NON_MASQ_CACHE_V6: PerCpuArray<
    verdict_slot::SlotV6,
    { NON_MASQ_CACHE_SLOTS_V6 as usize },
> = PerCpuArray::new();

/// The size here is the least the agent gives it; it sets the size when it loads the object.
#[btf_map(name = "non_masq_index_v4")]
pub static NON_MASQ_INDEX_V4: Array<
    policy_index::Chunk,
    { (policy_index::FIRST_CHUNK + policy_index::CHUNKS_AT_LEAST) as usize },
> = Array::new();

#[btf_map(name = "non_masq_draining_v4")]
pub static DRAINING_V4: DrainingTrie<[u8; 4]> = LpmTrie::new();

#[btf_map(name = "non_masq_draining_v6")]
pub static DRAINING_V6: DrainingTrie<[u8; 16]> = LpmTrie::new();

#[btf_map(name = "nat_v4")]
pub static NAT_V4: NatTable<[u8; 4]> = HashMap::new();

#[btf_map(name = "nat_v6")]
pub static NAT_V6: NatTable<[u8; 16]> = HashMap::new();

#[btf_map(name = "nat_slots_v4")]
pub static NAT_SLOTS_V4: SlotArray<[u8; 4]> = Array::new();

#[btf_map(name = "nat_slot_words_v4")]
pub static NAT_SLOT_WORDS_V4: SlotWords = Array::new();

#[btf_map(name = "nat_slots_v6")]
pub static NAT_SLOTS_V6: SlotArray<[u8; 16]> = Array::new();

#[btf_map(name = "nat_slot_words_v6")]
pub static NAT_SLOT_WORDS_V6: SlotWords = Array::new();

/// `global_names::SLOT_BUCKETS_V4` and `_V6`, as the agent sets them.
#[unsafe(no_mangle)]
pub static MASQ_SLOT_BUCKETS_V4: u32 = 2;
#[unsafe(no_mangle)]
pub static MASQ_SLOT_BUCKETS_V6: u32 = 2;

/// `global_names::SLOT_SEED_V4` and `_V6`, as the agent sets them.
#[unsafe(no_mangle)]
pub static MASQ_SLOT_SEED_V4: u64 = 0;
#[unsafe(no_mangle)]
pub static MASQ_SLOT_SEED_V6: u64 = 0;

/// `global_names::STORES_IN_ORDER`, as the agent sets it: 0 (a locked instruction, right on
/// every CPU) unless it says otherwise.
#[unsafe(no_mangle)]
static MASQ_STORES_IN_ORDER: u8 = 0;

/// Whether the CPU makes stores seen in the order they were made (`global_names::
/// STORES_IN_ORDER`).
#[inline(always)]
pub fn stores_in_order() -> bool {
    // SAFETY: a read of a global, volatile so that the compiler keeps it for the verifier to
    // read as the constant the agent set.
    unsafe { core::ptr::read_volatile(&MASQ_STORES_IN_ORDER) != 0 }
}

/// Whether the halves are in the slot table: in the object built with it, always; in the one
/// built without, never, and it holds no slot operation for an older kernel to refuse.
#[inline(always)]
pub const fn in_slot_table() -> bool {
    cfg!(feature = "slot-table")
}

#[btf_map(name = "nat_fragments_v4")]
pub static FRAGMENTS_V4: FragmentTable<[u8; 4]> = LruHashMap::new();

#[btf_map(name = "nat_fragments_v6")]
pub static FRAGMENTS_V6: FragmentTable<[u8; 16]> = LruHashMap::new();

#[btf_map(name = "interfaces")]
pub static INTERFACES: HashMap<u32, Interface, { INTERFACES_MAX_ENTRIES as usize }> =
    HashMap::new();

#[btf_map(name = "interfaces_by_ifindex")]
pub static INTERFACES_BY_IFINDEX: Array<
    IndexedInterface,
    { INTERFACES_BY_IFINDEX_ENTRIES as usize },
> = Array::new();

#[btf_map(name = "settings")]
pub static SETTINGS: Array<Settings, 1> = Array::new();

/// `global_names::DROP_SAMPLE_SLOTS_V4` and `_V6`: the agent sets them to the samples' sizes.
#[unsafe(no_mangle)]
pub static MASQ_DROP_SAMPLE_SLOTS_V4: u32 = 1;
#[unsafe(no_mangle)]
pub static MASQ_DROP_SAMPLE_SLOTS_V6: u32 = 1;

/// One of the globals here, as the agent set it.
#[inline(always)]
pub fn set_by_agent<T: Copy>(global: &'static T) -> T {
    // SAFETY: a read of a global, volatile so that the compiler keeps it for the verifier to
    // read as the constant the agent set.
    unsafe { core::ptr::read_volatile(global) }
}

#[btf_map(name = "nat_drop_sample_v4")]
pub static DROP_SAMPLE_V4: DropSample<[u8; 4]> = Array::new();

#[btf_map(name = "nat_drop_sample_v6")]
pub static DROP_SAMPLE_V6: DropSample<[u8; 16]> = Array::new();

/// Per family (`masq_ebpf::drop_vacancy`), the slot of the drop sample whose flow a full table
/// dropped and no new flow took yet, plus one (0: none): see `early_drop::remember`.
#[btf_map(name = "nat_drop_vacancy")]
pub static DROP_VACANCY: Array<u32, 2> = Array::new();

/// What `nat::request_port` hands its family's global BPF function, which takes no pointer
/// before Linux 5.12, and what it gets back: this CPU's slot. Not pinned.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct PortRequest<A: Address> {
    pub egress_key: NatKey<A>,
    /// The egress half of the flow; the function writes the port into it.
    pub egress: NatEntry<A>,
    /// Where `verifier::forget_in` writes a value and reads it back.
    pub unknown: u32,
    /// The half the slot table last had no room for on this CPU (`flow_table::insert_new`):
    /// a table of the programs' own has room for a half only in its key's buckets, so that is
    /// where a full table's early drop makes room, and, where it was a reply half of the flow
    /// searched for, its port is the one the search tries first.
    pub no_room_for: NatKey<A>,
}

pub type PortRequests<A> = PerCpuArray<PortRequest<A>, 1>;

#[btf_map(name = "nat_port_request_v4")]
pub static PORT_REQUEST_V4: PortRequests<[u8; 4]> = PerCpuArray::new();

#[btf_map(name = "nat_port_request_v6")]
pub static PORT_REQUEST_V6: PortRequests<[u8; 16]> = PerCpuArray::new();

/// Where `parse::masq_walk_ipv6` leaves the IPv6 packet it parsed, this CPU's slot. Not pinned.
#[btf_map(name = "ipv6_walk")]
pub static IPV6_WALK: PerCpuArray<Packet<[u8; 16]>, 1> = PerCpuArray::new();

/// A bit per port of each protocol with ports, laid out as `node_ports::slot` says.
pub type PortBits = Array<u64, { node_ports::WORDS as usize }>;

#[btf_map(name = "node_ports")]
pub static NODE_PORTS: PortBits = Array::new();

#[btf_map(name = "entryless_ports")]
pub static ENTRYLESS_PORTS: PortBits = Array::new();

#[btf_map(name = "nat_sweep_order")]
pub static SWEEP_ORDER: Array<SweepOrder, 1> = Array::new();

#[btf_map(name = "nat_sweep_report")]
pub static SWEEP_REPORT: Array<SweepReport, 2> = Array::new();

#[btf_map(name = "counters")]
pub static COUNTERS: PerCpuArray<u64, { COUNTER_SLOTS as usize }> = PerCpuArray::new();

#[inline(always)]
pub fn count(counter: Counter) {
    match COUNTERS.get_ptr_mut(counter as u32) {
        // Per-CPU slot: no other writer can race this increment.
        Some(slot) => unsafe { *slot += 1 },
        None => crate::hint::cold_path(),
    }
}

/// Whether the agent found no flow entry toward a destination the policy leaves alone, since
/// the policy last changed (see `policy_word::STRAYS_CLEARED`).
#[inline(always)]
pub fn strays_cleared() -> bool {
    POLICY_GENERATION
        .get(0)
        .is_some_and(|word| policy_word::strays_cleared(*word))
}

#[inline(always)]
pub fn settings() -> Option<&'static Settings> {
    SETTINGS.get(0)
}

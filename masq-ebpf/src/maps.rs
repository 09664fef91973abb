//! The maps the programs share with the agent. Names match `masq_ebpf::map_names`.

use aya_ebpf::{
    btf_maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray},
    macros::btf_map,
};
use masq_ebpf::{
    COUNTER_SLOTS, Counter, FRAGMENTS_MAX_ENTRIES, FragmentKeyV4, INTERFACES_MAX_ENTRIES,
    InterfaceV4, NAT_DEFAULT_ENTRIES, NON_MASQ_CACHE_SLOTS, NON_MASQ_MAX_ENTRIES, NatEntryV4,
    NatKeyV4, NonMasqValue, Settings,
};

#[btf_map(name = "non_masq_v4")]
pub static NON_MASQ_V4: LpmTrie<[u8; 4], NonMasqValue, { NON_MASQ_MAX_ENTRIES as usize }> =
    LpmTrie::new();

#[btf_map(name = "non_masq_v6")]
pub static NON_MASQ_V6: LpmTrie<[u8; 16], NonMasqValue, { NON_MASQ_MAX_ENTRIES as usize }> =
    LpmTrie::new();

#[btf_map(name = "policy_generation")]
pub static POLICY_GENERATION: Array<u32, 1> = Array::new();

#[btf_map(name = "non_masq_cache_v4")]
pub static NON_MASQ_CACHE_V4: PerCpuArray<u64, { NON_MASQ_CACHE_SLOTS as usize }> =
    PerCpuArray::new();

#[btf_map(name = "non_masq_draining_v4")]
pub static DRAINING_V4: LpmTrie<[u8; 4], u32, { NON_MASQ_MAX_ENTRIES as usize }> = LpmTrie::new();

/// Both halves of every translated flow. A plain (not LRU) hash: when it is full, new flows are
/// dropped and counted, and no live flow is ever evicted. The agent sets the size at load time.
#[btf_map(name = "nat_v4")]
pub static NAT_V4: HashMap<NatKeyV4, NatEntryV4, { NAT_DEFAULT_ENTRIES as usize }> = HashMap::new();

/// What the first fragment of a datagram became: the address its later fragments take.
#[btf_map(name = "nat_fragments_v4")]
pub static FRAGMENTS_V4: LruHashMap<FragmentKeyV4, [u8; 4], { FRAGMENTS_MAX_ENTRIES as usize }> =
    LruHashMap::new();

#[btf_map(name = "interfaces")]
pub static INTERFACES: HashMap<u32, InterfaceV4, { INTERFACES_MAX_ENTRIES as usize }> =
    HashMap::new();

#[btf_map(name = "settings")]
pub static SETTINGS: Array<Settings, 1> = Array::new();

#[btf_map(name = "counters")]
pub static COUNTERS: PerCpuArray<u64, { COUNTER_SLOTS as usize }> = PerCpuArray::new();

#[inline(always)]
pub fn count(counter: Counter) {
    if let Some(slot) = COUNTERS.get_ptr_mut(counter as u32) {
        // Per-CPU slot: no other writer can race this increment.
        unsafe { *slot += 1 };
    }
}

#[inline(always)]
pub fn settings() -> Option<&'static Settings> {
    SETTINGS.get(0)
}

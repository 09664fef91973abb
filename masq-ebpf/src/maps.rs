//! The maps the programs share with the agent. Names match `masq_ebpf::map_names`.

use aya_ebpf::{
    btf_maps::{LpmTrie, PerCpuArray},
    macros::btf_map,
};
use masq_ebpf::{COUNTER_SLOTS, Counter, NON_MASQ_MAX_ENTRIES, NonMasqValue};

#[btf_map(name = "non_masq_v4")]
pub static NON_MASQ_V4: LpmTrie<[u8; 4], NonMasqValue, { NON_MASQ_MAX_ENTRIES as usize }> =
    LpmTrie::new();

#[btf_map(name = "non_masq_v6")]
pub static NON_MASQ_V6: LpmTrie<[u8; 16], NonMasqValue, { NON_MASQ_MAX_ENTRIES as usize }> =
    LpmTrie::new();

#[btf_map(name = "counters")]
pub static COUNTERS: PerCpuArray<u64, { COUNTER_SLOTS as usize }> = PerCpuArray::new();

#[inline(always)]
pub fn count(counter: Counter) {
    if let Some(slot) = COUNTERS.get_ptr_mut(counter as u32) {
        // Per-CPU slot: no other writer can race this increment.
        unsafe { *slot += 1 };
    }
}

//! The policy as the data path sees it: is a destination in the non-masquerade CIDRs, or in
//! the ones recently removed from them?
//!
//! The non-masquerade answer is cached per CPU, per destination, for the current policy
//! generation: a trie of 100 000 prefixes is twenty-odd nodes deep, while the cache is one
//! array slot. The agent bumps the generation after every change to the trie, which makes every
//! cached answer stale at once.

use aya_ebpf::btf_maps::lpm_trie::Key;
use masq_ebpf::verdict_slot;

use crate::maps;

#[inline(always)]
fn in_non_masq_trie(addr: [u8; 4]) -> bool {
    maps::NON_MASQ_V4.get(&Key::new(32, addr)).is_some()
}

#[inline(always)]
pub fn is_non_masq_destination(addr: [u8; 4]) -> bool {
    let generation =
        maps::POLICY_GENERATION.get(0).copied().unwrap_or(0) & verdict_slot::GENERATION_MASK;
    let slot = maps::NON_MASQ_CACHE_V4.get_ptr_mut(verdict_slot::index(addr));
    let (Some(slot), true) = (slot, generation != 0) else {
        return in_non_masq_trie(addr);
    };
    let tag = verdict_slot::tag(addr, generation);
    // SAFETY: a per-CPU slot, read and written whole.
    let cached = unsafe { *slot };
    if cached & !1 == tag {
        return cached & 1 == 1;
    }
    let verdict = in_non_masq_trie(addr);
    // SAFETY: as above.
    unsafe { *slot = tag | u64::from(verdict) };
    verdict
}

#[inline(always)]
pub fn is_draining_destination(addr: [u8; 4]) -> bool {
    maps::DRAINING_V4.get(&Key::new(32, addr)).is_some()
}

//! The policy as the data path sees it: does a destination's longest prefix in the policy trie
//! keep the pod's address, and is it in a prefix recently taken out of that?
//!
//! The IPv4 non-masquerade answer is cached per CPU, per destination, for the current policy
//! generation: a trie of 100 000 prefixes is twenty-odd nodes deep, while the cache is one
//! array slot. The agent bumps the generation after every change to the trie, which makes every
//! cached answer stale at once. IPv6 asks its trie every time: a slot packs a whole IPv4
//! address with its verdict into one word, read and written whole, and an IPv6 address does
//! not fit.

use aya_ebpf::btf_maps::{LpmTrie, lpm_trie::Key};
use masq_ebpf::{Address, PrefixAction, prefix_action, verdict_slot};

use crate::maps;

/// Whether the trie holds a prefix of `addr`.
#[inline(always)]
pub fn in_trie<A: Address, V, const M: usize>(trie: &LpmTrie<A, V, M>, addr: A) -> bool {
    trie.get(&Key::new(A::BITS, addr)).is_some()
}

/// Whether the longest prefix of `addr` in the policy trie keeps the pod's address. No prefix,
/// or an exception (`masqueradeCIDRs`), means masquerade.
#[inline(always)]
pub fn keeps_address<A: Address, const M: usize>(
    trie: &LpmTrie<A, PrefixAction, M>,
    addr: A,
) -> bool {
    trie.get(&Key::new(A::BITS, addr)) == Some(&prefix_action::NON_MASQUERADE)
}

#[inline(always)]
pub fn is_non_masq_destination_v4(addr: [u8; 4]) -> bool {
    let generation =
        maps::POLICY_GENERATION.get(0).copied().unwrap_or(0) & verdict_slot::GENERATION_MASK;
    let slot = maps::NON_MASQ_CACHE_V4.get_ptr_mut(verdict_slot::index(addr));
    let (Some(slot), true) = (slot, generation != 0) else {
        return keeps_address(&maps::NON_MASQ_V4, addr);
    };
    let tag = verdict_slot::tag(addr, generation);
    // SAFETY: a per-CPU slot, read and written whole.
    let cached = unsafe { *slot };
    if cached & !1 == tag {
        return cached & 1 == 1;
    }
    let verdict = keeps_address(&maps::NON_MASQ_V4, addr);
    // SAFETY: as above.
    unsafe { *slot = tag | u64::from(verdict) };
    verdict
}

//! The policy as the data path sees it: does a destination's longest prefix in the policy trie
//! keep the pod's address, which entry said so, and is it in a prefix recently taken out of
//! that? Each decision about a packet of no known flow is counted for the entry that took it.
//!
//! The IPv4 answer is cached per CPU, per destination, for the current policy generation: a
//! trie of 100 000 prefixes is twenty-odd nodes deep, while the cache is one array slot. The
//! agent bumps the generation after every change to the trie, which makes every cached answer
//! stale at once. IPv6 asks its trie every time: a slot's tag packs a whole IPv4 address with
//! its verdict into one word, read and written whole, and an IPv6 address does not fit.

use aya_ebpf::btf_maps::{LpmTrie, lpm_trie::Key};
use masq_ebpf::{Address, Decision, PolicyEntry, verdict_slot};

use crate::{hint, maps};

/// Whether the trie holds a prefix of `addr`.
#[inline(always)]
pub fn in_trie<A: Address, V, const M: usize>(trie: &LpmTrie<A, V, M>, addr: A) -> bool {
    trie.get(&Key::new(A::BITS, addr)).is_some()
}

/// What the longest prefix of `addr` in the policy trie decides. No prefix, or an exception
/// (`masqueradeCIDRs`), means masquerade.
#[inline(always)]
pub fn decide<A: Address, const M: usize>(trie: &LpmTrie<A, PolicyEntry, M>, addr: A) -> Decision {
    Decision::of(trie.get(&Key::new(A::BITS, addr)))
}

#[inline(always)]
pub fn decide_v4(addr: [u8; 4]) -> Decision {
    let generation =
        maps::POLICY_GENERATION.get(0).copied().unwrap_or(0) & verdict_slot::GENERATION_MASK;
    let slot = maps::NON_MASQ_CACHE_V4.get_ptr_mut(verdict_slot::index(addr));
    let (Some(slot), true) = (slot, generation != 0) else {
        hint::cold_path();
        return decide(&maps::NON_MASQ_V4, addr);
    };
    let tag = verdict_slot::tag(addr, generation);
    // SAFETY: a per-CPU slot; its tag is read and written whole.
    let cached = unsafe { (*slot).tag };
    if hint::likely(cached & !1 == tag) {
        return Decision {
            keeps_address: cached & 1 == 1,
            // SAFETY: as above; the slot is read apart from the tag (see `verdict_slot`).
            counted_in: unsafe { (*slot).counted_in },
        };
    }
    let decision = decide(&maps::NON_MASQ_V4, addr);
    // SAFETY: as above.
    unsafe {
        (*slot).counted_in = decision.counted_in;
        (*slot).tag = tag | u64::from(decision.keeps_address);
    }
    decision
}

/// Counts a decision in the slot of the entry that took it, on this CPU.
#[inline(always)]
pub fn count(decision: Decision) {
    if let Some(slot) = maps::DECISIONS.get_ptr_mut(decision.counted_in) {
        // SAFETY: a per-CPU slot: no other writer can race this increment.
        unsafe { *slot += 1 };
    }
}

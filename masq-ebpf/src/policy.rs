//! The policy as the data path sees it: does a destination's longest prefix in the policy trie
//! keep the pod's address, which entry said so, and is it in a prefix recently taken out of
//! that? Each decision about a packet of no known flow is counted for the entry that took it.
//!
//! The IPv4 answer comes from the trie's index (`masq_ebpf::policy_index`) while it holds the
//! policy in force: at most five array reads, where a trie of 100 000 prefixes is twenty-odd
//! nodes deep. Where it does not (the agent is writing it, or it had no room for a part of the
//! policy), the answer is cached per CPU, per destination, for the current policy generation:
//! one array slot. The agent bumps the generation after every change to the trie, which makes
//! the index and every cached answer stale at once. IPv6 asks its trie every time: a slot's tag
//! packs a whole IPv4 address with its verdict into one word, read and written whole, and an
//! IPv6 address does not fit.

use aya_ebpf::btf_maps::{LpmTrie, lpm_trie::Key};
use masq_ebpf::{Address, Decision, PolicyEntry, policy_index, verdict_slot};

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
    if let Some(word) = indexed_verdict(u32::from_be_bytes(addr), generation) {
        return Decision {
            keeps_address: word & policy_index::KEEPS_ADDRESS != 0,
            counted_in: word & policy_index::COUNTED_IN,
        };
    }
    hint::cold_path();
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

/// The index's verdict word for `addr`, if the index holds the policy of `generation` and has
/// the chunks that decide `addr`.
#[inline(always)]
fn indexed_verdict(addr: u32, generation: u32) -> Option<u32> {
    let index = &maps::NON_MASQ_INDEX_V4;
    if index.get(policy_index::STAMP_CHUNK)?[0] != policy_index::stamp(generation) {
        return None;
    }
    let (chunk, at) = policy_index::top(addr);
    let mut word = index.get(chunk)?[at];
    for level in 0..policy_index::LEVELS {
        if word & policy_index::CHILD == 0 {
            return Some(word);
        }
        word = index.get(word & !policy_index::CHILD)?[policy_index::word_below(addr, level)];
    }
    (word & policy_index::CHILD == 0).then_some(word)
}

/// Counts a decision in the slot of the entry that took it, on this CPU.
#[inline(always)]
pub fn count(decision: Decision) {
    if let Some(slot) = maps::DECISIONS.get_ptr_mut(decision.counted_in) {
        // SAFETY: a per-CPU slot: no other writer can race this increment.
        unsafe { *slot += 1 };
    }
}

//! The policy as the data path sees it: does a destination's longest prefix in the policy trie
//! keep the pod's address, which entry said so, and is it in a prefix recently taken out of
//! that? Each decision about a packet of no known flow is counted for the entry that took it.
//!
//! The IPv4 answer comes from the trie's index (`masq_ebpf::policy_index`) while it holds the
//! policy in force: at most five array reads, where a trie of 100 000 prefixes is twenty-odd
//! nodes deep. Where it does not (the agent is writing it, or it had no room for a part of the
//! policy), the answer is cached per CPU, per destination, for the current policy generation:
//! one array slot. The agent bumps the generation after every change to the trie, which makes
//! the index and every cached answer stale at once. IPv6 has no index, and its cache holds the
//! address beside the tag, which an IPv6 address does not fit.

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
    let generation = generation();
    if let Some(word) = indexed_verdict(u32::from_be_bytes(addr), generation) {
        return Decision {
            keeps_address: word & policy_index::KEEPS_ADDRESS != 0,
            counted_in: word & policy_index::COUNTED_IN,
        };
    }
    hint::cold_path();
    let slot = maps::NON_MASQ_CACHE_V4.get_ptr_mut(verdict_slot::index(addr));
    decide_cached(&maps::NON_MASQ_V4, slot, addr, generation)
}

/// IPv6 has no index: the cache answers for the destinations this CPU saw last, the packets
/// of a known flow among them, which would otherwise walk the trie each (60–70 ns more a
/// packet at 100 000 prefixes than at 4, docs/bench/profiles.md).
#[inline(always)]
pub fn decide_v6(addr: &[u8; 16]) -> Decision {
    let packed = masq_decide_v6(addr);
    Decision {
        keeps_address: packed >> 32 != 0,
        counted_in: packed as u32,
    }
}

/// `decide_v6` in a frame of its own, as IPv6's steps are (`Family::OWN_FRAMES`): inlined, the
/// slot, the address and its tag, live across the trie's lookup, took 32 bytes more of the
/// frame of `egress<V6>`, whose chain of frames fills the verifier's 512 bytes on 6.1. The
/// decision comes back packed in the one register a BPF function returns. (The address passed
/// in two registers instead, so that it is not read a byte at a time, measured no cheaper.)
#[inline(never)]
fn masq_decide_v6(addr: &[u8; 16]) -> u64 {
    let slot = maps::NON_MASQ_CACHE_V6.get_ptr_mut(verdict_slot::index_v6(*addr));
    let decision = decide_cached(&maps::NON_MASQ_V6, slot, *addr, generation());
    (u64::from(decision.keeps_address) << 32) | u64::from(decision.counted_in)
}

/// The policy generation in force, which a cached verdict must have been taken under.
#[inline(always)]
fn generation() -> u32 {
    maps::POLICY_GENERATION.get(0).copied().unwrap_or(0) & verdict_slot::GENERATION_MASK
}

/// A slot of a family's verdict cache (`masq_ebpf::verdict_slot`): the verdict's tag says for
/// which destination and generation it holds which verdict, with the destination whole or,
/// where it does not fit, beside it.
trait VerdictSlot<A>: 'static {
    /// The tag of `addr`'s verdict under `generation`, without the verdict's bit.
    fn tag_for(addr: A, generation: u32) -> u64;
    fn verdict(&mut self) -> &mut verdict_slot::Slot;
    /// Whether the slot holds `addr`, of those that share its tag.
    fn holds(&self, addr: &A) -> bool;
    fn hold(&mut self, addr: A);
}

impl VerdictSlot<[u8; 4]> for verdict_slot::Slot {
    #[inline(always)]
    fn tag_for(addr: [u8; 4], generation: u32) -> u64 {
        verdict_slot::tag(addr, generation)
    }
    #[inline(always)]
    fn verdict(&mut self) -> &mut verdict_slot::Slot {
        self
    }
    /// The tag holds the whole address.
    #[inline(always)]
    fn holds(&self, _: &[u8; 4]) -> bool {
        true
    }
    #[inline(always)]
    fn hold(&mut self, _: [u8; 4]) {}
}

impl VerdictSlot<[u8; 16]> for verdict_slot::SlotV6 {
    #[inline(always)]
    fn tag_for(addr: [u8; 16], generation: u32) -> u64 {
        verdict_slot::tag_v6(addr, generation)
    }
    #[inline(always)]
    fn verdict(&mut self) -> &mut verdict_slot::Slot {
        &mut self.verdict
    }
    #[inline(always)]
    fn holds(&self, addr: &[u8; 16]) -> bool {
        self.addr == *addr
    }
    #[inline(always)]
    fn hold(&mut self, addr: [u8; 16]) {
        self.addr = addr;
    }
}

/// What the trie decides of `addr`, answered by this CPU's cache `slot` where it holds the
/// verdict of `generation` for `addr`, and asked of the trie, and kept there, where it does
/// not. Generation 0, no policy yet, is never cached.
#[inline(always)]
fn decide_cached<A: Address, S: VerdictSlot<A>, const M: usize>(
    trie: &LpmTrie<A, PolicyEntry, M>,
    slot: Option<*mut S>,
    addr: A,
    generation: u32,
) -> Decision {
    let (Some(slot), true) = (slot, generation != 0) else {
        hint::cold_path();
        return decide(trie, addr);
    };
    // SAFETY: a slot of a per-CPU array, which no other CPU touches; its tag is read and
    // written whole, and written last.
    let slot = unsafe { &mut *slot };
    let tag = S::tag_for(addr, generation);
    let cached = slot.verdict().tag;
    if hint::likely(cached & !1 == tag && slot.holds(&addr)) {
        return Decision {
            keeps_address: cached & 1 == 1,
            counted_in: slot.verdict().counted_in,
        };
    }
    let decision = decide(trie, addr);
    slot.hold(addr);
    let verdict = slot.verdict();
    verdict.counted_in = decision.counted_in;
    verdict.tag = tag | u64::from(decision.keeps_address);
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

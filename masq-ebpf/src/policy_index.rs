//! The index of `non_masq_v4` (`map_names::NON_MASQ_INDEX_V4`): the trie's answer for every
//! IPv4 destination, laid out as a multibit trie with each answer pushed down to the words it
//! covers, so that the programs decide a destination in at most five array reads whatever the
//! policy's size, where the kernel's trie of 100 000 prefixes walks some twenty nodes, each its
//! own allocation (docs/bench/profiles.md, "The uncached lookup at 100 000 prefixes"). The
//! agent builds it from the trie it wrote; the trie stays the truth, which the programs ask
//! whenever the index cannot answer.
//!
//! The array's elements are chunks of `CHUNK_WORDS` words, a cache line each. The first
//! `TOP_CHUNKS` hold the top level, a word per value of a destination's first `TOP_BITS` bits;
//! below, each chunk decides `STRIDE` more bits, for at most `LEVELS` levels. A word is either
//! a verdict (`verdict`) or the number of the chunk that decides the next bits (`CHILD`).
//!
//! The `STAMP_CHUNK`'s first word says which policy generation the index holds (`stamp`): the
//! programs read the index only while it is the generation in force, so that every change the
//! agent makes to the trie, which moves the generation on, sends them to the trie until the
//! agent has written the index again. Not pinned: each program object has its own, which a
//! restarted agent's change of the pinned trie makes stale at once.

use crate::policy_word::GENERATION_MASK;

/// Destination bits a chunk below the top decides.
pub const STRIDE: u32 = 4;
/// Words in a chunk: one per value of its bits.
pub const CHUNK_WORDS: usize = 1 << STRIDE;
/// One element of the array.
pub type Chunk = [u32; CHUNK_WORDS];
/// Destination bits the top level decides.
pub const TOP_BITS: u32 = 16;
/// The chunks that hold the top level, at the start of the array.
pub const TOP_CHUNKS: u32 = 1 << (TOP_BITS - STRIDE);
/// The chunk whose first word is the stamp.
pub const STAMP_CHUNK: u32 = TOP_CHUNKS;
/// The first chunk below the top level.
pub const FIRST_CHUNK: u32 = STAMP_CHUNK + 1;
/// Levels of chunks below the top: every bit of an IPv4 address is decided by the last.
pub const LEVELS: u32 = (32 - TOP_BITS) / STRIDE;
/// The fewest chunks below the top the agent gives the array: room for any policy of
/// upstream's default `cidrLimit`.
pub const CHUNKS_AT_LEAST: u32 = 1024;

/// Set in a word that names the chunk deciding the next bits (in the bits below).
pub const CHILD: u32 = 1 << 31;
/// Set in a verdict that keeps the pod's address.
pub const KEEPS_ADDRESS: u32 = 1 << 30;
/// A verdict's bits that hold the slot of `policy_decisions` counting its entry. A slot past
/// them (`decision_slot::UNCOUNTED`) is held as all of them set, which is no slot either.
pub const COUNTED_IN: u32 = KEEPS_ADDRESS - 1;
/// A word that sends the programs to the trie: it names a chunk no array holds. The agent
/// writes it where the array has no room for a part of the policy.
pub const ASK_THE_TRIE: u32 = u32::MAX;
/// Set in every stamp, so that the array as the kernel makes it, all zeros, holds none.
pub const STAMPED: u32 = 1 << 31;

/// The verdict word of an entry.
#[inline(always)]
pub const fn verdict(keeps_address: bool, counted_in: u32) -> u32 {
    let keeps = if keeps_address { KEEPS_ADDRESS } else { 0 };
    let counted_in = if counted_in > COUNTED_IN {
        COUNTED_IN
    } else {
        counted_in
    };
    keeps | counted_in
}

/// The stamp of an index that holds the policy of `generation`.
#[inline(always)]
pub const fn stamp(generation: u32) -> u32 {
    STAMPED | (generation & GENERATION_MASK)
}

/// The top-level chunk and word that decide `addr`.
#[inline(always)]
pub const fn top(addr: u32) -> (u32, usize) {
    let bits = addr >> (32 - TOP_BITS);
    (bits >> STRIDE, (bits as usize) & (CHUNK_WORDS - 1))
}

/// The word of a chunk at `level` below the top (0 first) that decides `addr`.
#[inline(always)]
pub const fn word_below(addr: u32, level: u32) -> usize {
    ((addr >> (32 - TOP_BITS - STRIDE * (level + 1))) as usize) & (CHUNK_WORDS - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_levels_decide_every_bit_once() {
        assert_eq!(TOP_BITS + LEVELS * STRIDE, 32);
        let addr = 0x0a60_1234;
        assert_eq!(top(addr), (0x0a6, 0x0));
        let nibbles: [usize; LEVELS as usize] =
            core::array::from_fn(|l| word_below(addr, l as u32));
        assert_eq!(nibbles, [1, 2, 3, 4]);
    }

    #[test]
    fn a_verdict_keeps_its_slot_and_never_names_a_chunk() {
        assert_eq!(verdict(true, 7), KEEPS_ADDRESS | 7);
        assert_eq!(verdict(false, u32::MAX) & CHILD, 0);
        assert_eq!(verdict(false, u32::MAX), COUNTED_IN);
        assert_eq!(stamp(0) & STAMPED, STAMPED);
        assert_ne!(stamp(5), 0);
    }
}

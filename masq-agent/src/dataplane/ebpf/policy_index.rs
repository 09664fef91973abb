//! The programs' index of the IPv4 policy trie (`masq_ebpf::policy_index`), built from what the
//! trie holds after every change to it.
//!
//! A change moves the policy generation on before the index is written, so from then on every
//! program run asks the trie; the agent waits for the runs that may still read the index
//! (`wait_for_program_runs`), rewrites the chunks that change, waits again, and only then
//! stamps the index with the generation. So no run reads a chunk while it changes, and a run
//! that takes the index's answer takes the trie's.
//!
//! A chunk keeps its number while its place in the index does, so that a change of one prefix
//! rewrites a few chunks, not the index. Where the array has no room for every chunk (the
//! policy outgrew what the agent sized it for when it started), the largest parts below the top
//! level are left to the trie (`ASK_THE_TRIE`), so that as many destinations as fit are
//! answered by the index, and every one is answered right.

use std::collections::{BTreeMap, HashMap};

use aya::maps::{Array, IterableMap as _, MapData};
use masq_ebpf::{
    PolicyEntry,
    policy_index::{
        ASK_THE_TRIE, CHILD, CHUNK_WORDS, Chunk, FIRST_CHUNK, LEVELS, STAMP_CHUNK, STRIDE,
        TOP_BITS, stamp, verdict,
    },
    prefix_action,
};

use super::{batch, interfaces::wait_for_program_runs, prefixes::Prefix};

/// A chunk's place below the top level: its level (0 first), and the destination bits above
/// it (`TOP_BITS + STRIDE × level` of them).
type Place = (u32, u32);

/// The place of the chunk a word at `at` of the chunk at `place` leads to; `place` `None` is
/// the top level.
fn child_of(place: Option<Place>, at: u32) -> Place {
    match place {
        None => (0, at),
        Some((level, bits)) => (level + 1, (bits << STRIDE) | at),
    }
}

/// The index as built from the trie's entries, before its chunks have numbers: a word that
/// leads below is `CHILD` alone, the chunk it leads to being found by place.
struct Built {
    top: Vec<u32>,
    below: HashMap<Place, Chunk>,
}

impl Built {
    /// The index of `entries`: each prefix's verdict written over every word it covers, the
    /// shorter prefixes first, so that a longer one's verdict stands where both cover a word.
    fn of(entries: &BTreeMap<Prefix<4>, PolicyEntry>) -> Built {
        let mut built = Built {
            top: vec![verdict(false, masq_ebpf::decision_slot::BY_DEFAULT); 1 << TOP_BITS],
            below: HashMap::new(),
        };
        let mut by_length: Vec<(&Prefix<4>, &PolicyEntry)> = entries.iter().collect();
        by_length.sort_by_key(|((len, _), _)| *len);
        for ((len, data), entry) in by_length {
            let keeps = entry.action == prefix_action::NON_MASQUERADE;
            built.cover(
                *len,
                u32::from_be_bytes(*data),
                verdict(keeps, entry.counted_in),
            );
        }
        built
    }

    /// Writes `word` over the words a prefix covers, making the chunks it needs below.
    /// The shorter prefixes come first, so a chunk made below a word takes the word's verdict
    /// into each of its words, and no word a prefix covers leads below yet.
    fn cover(&mut self, len: u32, addr: u32, word: u32) {
        let len = len.min(32);
        let addr = if len == 0 {
            0
        } else {
            addr & (u32::MAX << (32 - len))
        };
        let mut place: Option<Place> = None;
        let mut decided = TOP_BITS;
        loop {
            let at = (addr >> (32 - decided)) & ((1 << (decided - place_bits(place))) - 1);
            if len <= decided {
                let span = 1u32 << (decided - len);
                let first = at & !(span - 1);
                let words = self.words(place);
                for w in &mut words[first as usize..(first + span) as usize] {
                    *w = word;
                }
                return;
            }
            let child = child_of(place, at);
            let words = self.words(place);
            let above = words[at as usize];
            if above & CHILD == 0 {
                words[at as usize] = CHILD;
                self.below.insert(child, [above; CHUNK_WORDS]);
            }
            place = Some(child);
            decided += STRIDE;
        }
    }

    fn words(&mut self, place: Option<Place>) -> &mut [u32] {
        match place {
            None => &mut self.top,
            Some(place) => self
                .below
                .get_mut(&place)
                .expect("made before it is reached"),
        }
    }
}

/// The destination bits decided above the words of the chunk at `place`.
fn place_bits(place: Option<Place>) -> u32 {
    match place {
        None => 0,
        Some((level, _)) => TOP_BITS + STRIDE * level,
    }
}

/// The index's array, and what this agent wrote to it.
pub struct PolicyIndex {
    array: Array<MapData, Chunk>,
    /// The chunks below the top level the array has room for.
    room: u32,
    /// The array's chunks as written, by number; `None` where a write failed, and the array
    /// may hold anything.
    written: Option<Vec<Chunk>>,
    /// The number of each place's chunk, as written.
    numbers: HashMap<Place, u32>,
    /// Whether the chunks hold the trie's policy as last written (`write`).
    holds_the_trie: bool,
    /// The stamp as written; `None` where a write failed.
    stamped: Option<u32>,
    /// What the last write did.
    last_write: IndexWrite,
}

/// What a write of the index did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexWrite {
    /// Chunks rewritten.
    pub chunks_written: usize,
    /// Top-level words left to the trie, for want of room below them.
    pub left_to_the_trie: usize,
}

impl PolicyIndex {
    pub fn new(array: Array<MapData, Chunk>) -> PolicyIndex {
        let room = array.len().saturating_sub(FIRST_CHUNK);
        PolicyIndex {
            array,
            room,
            written: Some(vec![[0; CHUNK_WORDS]; FIRST_CHUNK as usize]),
            numbers: HashMap::new(),
            holds_the_trie: false,
            stamped: None,
            last_write: IndexWrite::default(),
        }
    }

    /// Says that the trie changed, or may have: the index no longer holds it.
    pub fn trie_changed(&mut self) {
        self.holds_the_trie = false;
    }

    /// What the last write of the chunks did.
    pub fn last_write(&self) -> IndexWrite {
        self.last_write
    }

    /// Whether the index holds what the trie holds, as last written: a new generation needs
    /// only a new stamp.
    pub fn holds_the_trie(&self) -> bool {
        self.holds_the_trie
    }

    /// Stamps the index with `generation`, after writing it from `entries`, what the trie
    /// holds, unless it already holds them.
    pub fn refresh(
        &mut self,
        entries: &BTreeMap<Prefix<4>, PolicyEntry>,
        generation: u32,
    ) -> anyhow::Result<()> {
        if !self.holds_the_trie {
            self.last_write = self.write(entries)?;
            self.holds_the_trie = true;
        }
        self.stamp(generation)
    }

    /// Says the index holds the policy of `generation`.
    pub fn stamp(&mut self, generation: u32) -> anyhow::Result<()> {
        self.set_stamp(stamp(generation))
    }

    fn set_stamp(&mut self, stamp: u32) -> anyhow::Result<()> {
        if self.stamped != Some(stamp) {
            self.stamped = None;
            self.array.set(STAMP_CHUNK, stamp_chunk(stamp), 0)?;
            self.stamped = Some(stamp);
        }
        Ok(())
    }

    /// Writes the chunks that differ from the index of `entries`, between waits for the
    /// program runs that may read them.
    fn write(&mut self, entries: &BTreeMap<Prefix<4>, PolicyEntry>) -> anyhow::Result<IndexWrite> {
        let built = Built::of(entries);
        let left = self.left_to_the_trie(&built);
        let numbers = self.number(&built, &left);
        let mut chunks: Vec<(u32, Chunk)> = Vec::new();
        for (i, top) in built.top.chunks(CHUNK_WORDS).enumerate() {
            let mut chunk: Chunk = top.try_into().expect("whole chunks");
            for (at, word) in chunk.iter_mut().enumerate() {
                let top_word = (i * CHUNK_WORDS + at) as u32;
                if left.contains_key(&top_word) {
                    *word = ASK_THE_TRIE;
                } else {
                    *word = numbered(*word, None, top_word, &numbers);
                }
            }
            chunks.push((i as u32, chunk));
        }
        for (place, chunk) in &built.below {
            let Some(&number) = numbers.get(place) else {
                continue;
            };
            let mut chunk = *chunk;
            for (at, word) in chunk.iter_mut().enumerate() {
                *word = numbered(*word, Some(*place), at as u32, &numbers);
            }
            chunks.push((number, chunk));
        }
        // Taken out while the array changes: a write that fails leaves it `None`.
        let mut written = self.written.take().unwrap_or_default();
        chunks.retain(|(number, chunk)| written.get(*number as usize) != Some(chunk));
        chunks.sort_unstable_by_key(|(number, _)| *number);
        let done = IndexWrite {
            chunks_written: chunks.len(),
            left_to_the_trie: left.len(),
        };
        if !chunks.is_empty() {
            let (slots, values): (Vec<u32>, Vec<Chunk>) = chunks.iter().copied().unzip();
            // Whatever moved the generation on, no run takes the index's answer from here.
            self.set_stamp(0)?;
            wait_for_program_runs();
            batch::update_array(self.array.map(), &slots, &values)?;
            wait_for_program_runs();
            for (number, chunk) in chunks {
                let number = number as usize;
                if written.len() <= number {
                    written.resize(number + 1, [0; CHUNK_WORDS]);
                }
                written[number] = chunk;
            }
        }
        self.written = Some(written);
        self.numbers = numbers;
        if done.left_to_the_trie > 0 {
            tracing::warn!(
                left = done.left_to_the_trie,
                room = self.room,
                "the policy index has no room for all of the IPv4 policy: destinations under \
                 some /16s are looked up in the trie, which is slower; a restart sizes the index \
                 for the policy"
            );
        }
        Ok(done)
    }

    /// The top-level words whose chunks below are left out for want of room, with how many
    /// chunks each has below: the largest first, until the rest fit.
    fn left_to_the_trie(&self, built: &Built) -> HashMap<u32, u32> {
        let mut below_top: HashMap<u32, u32> = HashMap::new();
        for (level, bits) in built.below.keys() {
            *below_top.entry(bits >> (STRIDE * level)).or_default() += 1;
        }
        let mut left = HashMap::new();
        let mut needed = built.below.len() as u64;
        if needed <= u64::from(self.room) {
            return left;
        }
        let mut largest: Vec<(u32, u32)> = below_top.into_iter().collect();
        largest.sort_unstable_by_key(|&(top, count)| (std::cmp::Reverse(count), top));
        for (top, count) in largest {
            if needed <= u64::from(self.room) {
                break;
            }
            needed -= u64::from(count);
            left.insert(top, count);
        }
        left
    }

    /// A number for each chunk below the top not left to the trie: the one it had where its
    /// place had a chunk before, the lowest free one otherwise.
    fn number(&self, built: &Built, left: &HashMap<u32, u32>) -> HashMap<Place, u32> {
        let kept = |(level, bits): &Place| !left.contains_key(&(bits >> (STRIDE * level)));
        let mut numbers: HashMap<Place, u32> = HashMap::new();
        let mut taken = vec![false; self.room as usize];
        for place in built.below.keys().filter(|p| kept(p)) {
            if let Some(&number) = self.numbers.get(place) {
                numbers.insert(*place, number);
                taken[(number - FIRST_CHUNK) as usize] = true;
            }
        }
        let mut free = taken
            .iter()
            .enumerate()
            .filter(|(_, taken)| !**taken)
            .map(|(i, _)| FIRST_CHUNK + i as u32);
        let mut new: Vec<Place> = built
            .below
            .keys()
            .filter(|p| kept(p) && !numbers.contains_key(*p))
            .copied()
            .collect();
        new.sort_unstable();
        for place in new {
            let number = free
                .next()
                .expect("left_to_the_trie left room for every chunk");
            numbers.insert(place, number);
        }
        numbers
    }
}

/// `word` of the chunk at `place` (the top level for `None`), at `at`, with the number of the
/// chunk it leads to, if it leads below.
fn numbered(word: u32, place: Option<Place>, at: u32, numbers: &HashMap<Place, u32>) -> u32 {
    if word & CHILD == 0 {
        return word;
    }
    CHILD | numbers[&child_of(place, at)]
}

fn stamp_chunk(stamp: u32) -> Chunk {
    let mut chunk = [0; CHUNK_WORDS];
    chunk[0] = stamp;
    chunk
}

/// The chunks the agent gives an index for a policy of `entries` prefixes: room below the top
/// level for any policy of that many, since a prefix makes at most one chunk a level (a
/// policy's prefixes share most of theirs: 100 000 random ones make 1.6 each), and never less
/// than `CHUNKS_AT_LEAST`. A chunk is 64 bytes of kernel memory.
pub fn chunks_for(entries: usize) -> u32 {
    let entries = u32::try_from(entries).unwrap_or(u32::MAX);
    let room = entries
        .min(masq_ebpf::NON_MASQ_MAX_ENTRIES)
        .saturating_mul(LEVELS)
        .max(masq_ebpf::policy_index::CHUNKS_AT_LEAST);
    FIRST_CHUNK + room
}

#[cfg(test)]
mod tests {
    use super::*;
    use masq_ebpf::policy_index::{COUNTED_IN, KEEPS_ADDRESS, top, word_below};
    use masq_testbed::prefixes::XorShift;

    /// The longest prefix of `addr` among `entries`, found by trying every length: shares
    /// nothing with the index.
    fn longest(entries: &BTreeMap<Prefix<4>, PolicyEntry>, addr: u32) -> Option<PolicyEntry> {
        (0..=32u32).rev().find_map(|len| {
            let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
            entries.get(&(len, (addr & mask).to_be_bytes())).copied()
        })
    }

    /// What a walk of the built index (numbered as `numbers`) says of `addr`.
    fn walk(chunks: &HashMap<u32, Chunk>, addr: u32) -> u32 {
        let (chunk, at) = top(addr);
        let mut word = chunks[&chunk][at];
        for level in 0..LEVELS {
            if word & CHILD == 0 {
                break;
            }
            word = chunks[&(word & !CHILD)][word_below(addr, level)];
        }
        word
    }

    struct Rng(XorShift);
    impl Rng {
        fn next(&mut self) -> u32 {
            (self.0.next_u64() >> 16) as u32
        }
    }

    fn random_policy(rng: &mut Rng, count: usize) -> BTreeMap<Prefix<4>, PolicyEntry> {
        (0..count)
            .map(|i| {
                let len = rng.next() % 33;
                let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
                // Most prefixes near a few others, so that they nest.
                let addr = (0x0a00_0000 | (rng.next() & 0x00ff_ffff)) & mask;
                let action = if rng.next().is_multiple_of(4) {
                    prefix_action::MASQUERADE
                } else {
                    prefix_action::NON_MASQUERADE
                };
                let entry = PolicyEntry {
                    counted_in: i as u32 + 1,
                    action,
                    ..PolicyEntry::default()
                };
                ((len, addr.to_be_bytes()), entry)
            })
            .collect()
    }

    fn materialized(built: &Built, numbers: &HashMap<Place, u32>) -> HashMap<u32, Chunk> {
        let mut chunks = HashMap::new();
        for (i, top) in built.top.chunks(CHUNK_WORDS).enumerate() {
            let mut chunk: Chunk = top.try_into().unwrap();
            for (at, w) in chunk.iter_mut().enumerate() {
                *w = numbered(*w, None, (i * CHUNK_WORDS + at) as u32, numbers);
            }
            chunks.insert(i as u32, chunk);
        }
        for (place, chunk) in &built.below {
            let mut chunk = *chunk;
            for (at, w) in chunk.iter_mut().enumerate() {
                *w = numbered(*w, Some(*place), at as u32, numbers);
            }
            chunks.insert(numbers[place], chunk);
        }
        chunks
    }

    #[test]
    fn the_index_answers_as_the_longest_prefix_does() {
        let mut rng = Rng(XorShift(0x2545_f491_4f6c_dd1d));
        for count in [0, 1, 5, 60, 600] {
            let entries = random_policy(&mut rng, count);
            let built = Built::of(&entries);
            let numbers: HashMap<Place, u32> = built
                .below
                .keys()
                .enumerate()
                .map(|(i, p)| (*p, FIRST_CHUNK + i as u32))
                .collect();
            let chunks = materialized(&built, &numbers);
            // Every prefix's edges and a random address inside, and random addresses.
            let mut addrs: Vec<u32> = (0..2000).map(|_| rng.next()).collect();
            for &(len, data) in entries.keys() {
                let first = u32::from_be_bytes(data);
                let last = first
                    | if len == 0 {
                        u32::MAX
                    } else {
                        !(u32::MAX << (32 - len))
                    };
                addrs.extend([first, last, first.wrapping_sub(1), last.wrapping_add(1)]);
                addrs.push(first | (rng.next() & (last - first)));
            }
            for addr in addrs {
                let want = match longest(&entries, addr) {
                    None => 0,
                    Some(e) => {
                        let keeps = e.action == prefix_action::NON_MASQUERADE;
                        (if keeps { KEEPS_ADDRESS } else { 0 }) | e.counted_in
                    }
                };
                let got = walk(&chunks, addr);
                assert_eq!(got & CHILD, 0, "{addr:#x}: the walk ends on a verdict");
                assert_eq!(got, want, "{count} prefixes, {addr:#x}");
                assert!(got & COUNTED_IN == want & COUNTED_IN);
            }
        }
    }

    #[test]
    fn a_host_prefix_takes_a_chunk_a_level_and_a_wide_one_none() {
        let entry = PolicyEntry::default();
        let entries = BTreeMap::from([((32, [10, 96, 1, 2]), entry), ((8, [10, 0, 0, 0]), entry)]);
        let built = Built::of(&entries);
        assert_eq!(built.below.len(), LEVELS as usize);
        let wide = BTreeMap::from([((12, [172, 16, 0, 0]), entry)]);
        assert!(Built::of(&wide).below.is_empty());
    }
}

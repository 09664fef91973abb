//! The programs' index of the IPv4 policy trie (`masq_ebpf::policy_index`), built from what the
//! trie holds after every change to it, on a thread of its own (`index_writer`).
//!
//! A change moves the policy generation on before the index is written, so from then on every
//! program run asks the trie; the agent takes the stamp away, waits for the runs that may still
//! read the index (`wait_for_program_runs`), rewrites the chunks that change, waits again where
//! a CPU may make its loads out of order, and only then stamps the index with the generation.
//! So no run reads a chunk while it changes, and a run that takes the index's answer takes the
//! trie's.
//!
//! The index is built a /16 at a time: a prefix of 16 bits or fewer is written over top-level
//! words, and each /16 that holds longer ones has the chunks below its word (a `Group`). A
//! chunk keeps its number while its place does, and a /16 whose prefixes did not change keeps
//! its chunks as written, so that a change of one prefix rewrites a few chunks, and the agent
//! never holds the whole index in its memory: 100 000 prefixes make 10 MiB of chunks. Where the
//! array has no room for every chunk (the policy outgrew what the agent sized it for when it
//! started), the /16s with the most chunks are left to the trie (`ASK_THE_TRIE`), so that as
//! many destinations as fit are answered by the index, and every one is answered right.

use std::collections::{BTreeMap, HashMap, HashSet};

use aya::maps::{Array, IterableMap as _, MapData};
use masq_ebpf::{
    PolicyEntry,
    decision_slot::BY_DEFAULT,
    policy_index::{
        ASK_THE_TRIE, CHILD, CHUNK_WORDS, CHUNKS_AT_LEAST, Chunk, FIRST_CHUNK, LEVELS, STAMP_CHUNK,
        STRIDE, TOP_BITS, stamp, verdict,
    },
    prefix_action,
};

use super::{
    batch,
    interfaces::{MEMORY_IN_ORDER, wait_for_program_runs},
    prefixes::Prefix,
};

/// A chunk's place below the top level: its level (0 first), and the destination bits above
/// its words (`TOP_BITS + STRIDE × level` of them).
type Place = (u32, u32);

/// The /16 a chunk at `place` is under.
fn top_of((level, bits): Place) -> u32 {
    bits >> (STRIDE * level)
}

/// A prefix longer than the top level's bits: the /16 it is under first, so that sorted, each
/// /16's come together, shorter before longer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Deep {
    top: u32,
    len: u32,
    addr: u32,
    verdict: u32,
}

impl Deep {
    /// The places of the chunks the prefix's words are in: one a level down to its last bit.
    fn places(self) -> impl Iterator<Item = Place> {
        let levels = (self.len - TOP_BITS).div_ceil(STRIDE);
        (0..levels).map(move |level| (level, self.addr >> (32 - TOP_BITS - STRIDE * level)))
    }
}

/// The policy as the index lays it out: the top level's verdicts, and the longer prefixes.
struct Layout {
    /// A word per /16: the verdict of its longest prefix of 16 bits or fewer.
    top: Vec<u32>,
    /// Sorted.
    deep: Vec<Deep>,
}

impl Layout {
    fn of(entries: &BTreeMap<Prefix<4>, PolicyEntry>) -> Layout {
        let mut top = vec![verdict(false, BY_DEFAULT); 1 << TOP_BITS];
        let mut deep = Vec::new();
        let mut shallow = Vec::new();
        for (&(len, data), entry) in entries {
            let len = len.min(32);
            let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
            let addr = u32::from_be_bytes(data) & mask;
            let keeps = entry.action == prefix_action::NON_MASQUERADE;
            let verdict = verdict(keeps, entry.counted_in);
            if len <= TOP_BITS {
                shallow.push((len, addr, verdict));
            } else {
                let top = addr >> (32 - TOP_BITS);
                deep.push(Deep {
                    top,
                    len,
                    addr,
                    verdict,
                });
            }
        }
        // Shorter first, so that a longer prefix's verdict stands where both cover a word.
        shallow.sort_unstable_by_key(|&(len, _, _)| len);
        for (len, addr, verdict) in shallow {
            let first = (addr >> (32 - TOP_BITS)) as usize;
            top[first..first + (1 << (TOP_BITS - len))].fill(verdict);
        }
        deep.sort_unstable();
        Layout { top, deep }
    }

    /// Each /16's longer prefixes, with the /16.
    fn groups(&self) -> impl Iterator<Item = (u32, &[Deep])> {
        self.deep
            .chunk_by(|a, b| a.top == b.top)
            .map(|group| (group[0].top, group))
    }

    /// The places of every chunk below the top level, sorted, each once.
    fn places(&self) -> Vec<Place> {
        let mut places: Vec<Place> = self.deep.iter().flat_map(|d| d.places()).collect();
        places.sort_unstable();
        places.dedup();
        places
    }
}

/// The chunks below one /16's word, as built from its prefixes before they have numbers: a
/// word that leads below is `CHILD` alone, the chunk it leads to being found by place.
struct Group {
    below: HashMap<Place, Chunk>,
}

impl Group {
    /// The chunks of the /16 `top`, whose prefixes of 16 bits or fewer decide `base`, and whose
    /// longer ones are `deep`, shorter first: each one's verdict written over every word it
    /// covers, a chunk made below a word taking the word's verdict into each of its words.
    fn of(top: u32, base: u32, deep: &[Deep]) -> Group {
        let mut group = Group {
            below: HashMap::from([((0, top), [base; CHUNK_WORDS])]),
        };
        for prefix in deep {
            group.cover(prefix);
        }
        group
    }

    fn cover(&mut self, prefix: &Deep) {
        let mut place = (0, prefix.top);
        loop {
            let decided = TOP_BITS + STRIDE * (place.0 + 1);
            let at = ((prefix.addr >> (32 - decided)) as usize) & (CHUNK_WORDS - 1);
            let words = self
                .below
                .get_mut(&place)
                .expect("made before it is reached");
            if prefix.len <= decided {
                let span = 1usize << (decided - prefix.len);
                let first = at & !(span - 1);
                // No word covered leads below: a chunk there would be a longer prefix's,
                // and the longer come later.
                words[first..first + span].fill(prefix.verdict);
                return;
            }
            let above = words[at];
            let child = (place.0 + 1, (place.1 << STRIDE) | at as u32);
            if above & CHILD == 0 {
                words[at] = CHILD;
                self.below.insert(child, [above; CHUNK_WORDS]);
            }
            place = child;
        }
    }

    /// The chunks with the numbers of the chunks their words lead to.
    fn numbered<'a>(&'a self, numbers: &'a Numbers) -> impl Iterator<Item = (u32, Chunk)> + 'a {
        self.below.iter().map(|(&(level, bits), chunk)| {
            let mut chunk = *chunk;
            for (at, word) in chunk.iter_mut().enumerate() {
                if *word & CHILD != 0 {
                    let below = (level + 1, (bits << STRIDE) | at as u32);
                    *word = CHILD | numbers.get(&below).expect("numbered with its /16");
                }
            }
            let number = numbers.get(&(level, bits)).expect("numbered with its /16");
            (number, chunk)
        })
    }
}

/// What the array holds, as this agent wrote it.
struct Written {
    /// The number of each place's chunk.
    numbers: Numbers,
    /// The layout the chunks were written from.
    layout: Layout,
    /// The top level's words as written.
    top: Vec<u32>,
}

/// The index's layout and numbers for a policy, before anything is written.
struct Plan {
    layout: Layout,
    numbers: Numbers,
    /// The /16s whose chunks are left to the trie for want of room.
    left: HashSet<u32>,
    /// The top level's words.
    top: Vec<u32>,
}

impl Plan {
    /// The plan for `entries` in an array with `room` chunks below the top, numbering the
    /// chunks whose places `written` has as it did.
    fn of(
        entries: &BTreeMap<Prefix<4>, PolicyEntry>,
        room: u32,
        written: Option<&Written>,
    ) -> Plan {
        let layout = Layout::of(entries);
        let places = layout.places();
        let left = left_to_the_trie(&places, room);
        let kept: Vec<Place> = places
            .into_iter()
            .filter(|p| !left.contains(&top_of(*p)))
            .collect();
        let numbers = Numbers::of(&kept, room, written.map(|w| &w.numbers));
        let mut top = layout.top.clone();
        for (group, _) in layout.groups() {
            top[group as usize] = match numbers.get(&(0, group)) {
                Some(number) => CHILD | number,
                None => ASK_THE_TRIE,
            };
        }
        Plan {
            layout,
            numbers,
            left,
            top,
        }
    }

    /// Gives `write` every chunk whose content differs from what `written` says the array
    /// holds: every one, without it.
    fn changes(
        &self,
        written: Option<&Written>,
        write: &mut dyn FnMut(u32, Chunk) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        for (group, deep) in self.layout.groups() {
            if self.left.contains(&group) {
                continue;
            }
            let base = self.layout.top[group as usize];
            let unchanged = written.is_some_and(|w| {
                w.layout.top[group as usize] == base
                    && w.layout.deep_of(group) == deep
                    && w.top[group as usize] == self.top[group as usize]
            });
            if unchanged {
                continue;
            }
            for (number, chunk) in Group::of(group, base, deep).numbered(&self.numbers) {
                write(number, chunk)?;
            }
        }
        for (i, words) in self.top.chunks(CHUNK_WORDS).enumerate() {
            let at = i * CHUNK_WORDS..(i + 1) * CHUNK_WORDS;
            if written.is_none_or(|w| w.top[at] != *words) {
                write(i as u32, words.try_into().expect("whole chunks"))?;
            }
        }
        Ok(())
    }
}

impl Layout {
    /// The longer prefixes under the /16 `top`.
    fn deep_of(&self, top: u32) -> &[Deep] {
        let first = self.deep.partition_point(|d| d.top < top);
        let end = self.deep.partition_point(|d| d.top <= top);
        &self.deep[first..end]
    }
}

/// The /16s whose chunks below are left out for want of room: those with the most chunks
/// first, until the rest fit.
fn left_to_the_trie(places: &[Place], room: u32) -> HashSet<u32> {
    let mut left = HashSet::new();
    let mut needed = places.len() as u64;
    if needed <= u64::from(room) {
        return left;
    }
    let mut per_top: HashMap<u32, u64> = HashMap::new();
    for place in places {
        *per_top.entry(top_of(*place)).or_default() += 1;
    }
    let mut largest: Vec<(u32, u64)> = per_top.into_iter().collect();
    largest.sort_unstable_by_key(|&(top, count)| (std::cmp::Reverse(count), top));
    for (top, count) in largest {
        if needed <= u64::from(room) {
            break;
        }
        needed -= count;
        left.insert(top);
    }
    left
}

/// Each chunk's number, by its place, sorted: found by a binary search, and carried from one
/// write to the next by a merge of two sorted lists, where hashing 140 000 places (100 000
/// prefixes) took most of a change's time.
struct Numbers(Vec<(Place, u32)>);

impl Numbers {
    fn get(&self, place: &Place) -> Option<u32> {
        let at = self.0.binary_search_by_key(place, |(p, _)| *p).ok()?;
        Some(self.0[at].1)
    }

    /// A number for each of `places` (sorted): the one it had in `before`, the lowest free
    /// one otherwise.
    fn of(places: &[Place], room: u32, before: Option<&Numbers>) -> Numbers {
        let mut kept: Vec<Option<u32>> = vec![None; places.len()];
        let mut taken = vec![false; room as usize];
        if let Some(before) = before {
            let mut earlier = before.0.iter().peekable();
            for (place, kept) in places.iter().zip(&mut kept) {
                while earlier.next_if(|(p, _)| p < place).is_some() {}
                if let Some((_, number)) = earlier.next_if(|(p, _)| p == place) {
                    *kept = Some(*number);
                    taken[(number - FIRST_CHUNK) as usize] = true;
                }
            }
        }
        let mut free = (0..room).filter(|&i| !taken[i as usize]);
        let numbers = places.iter().zip(kept).map(|(place, kept)| {
            let number = kept.unwrap_or_else(|| {
                let free = free
                    .next()
                    .expect("left_to_the_trie left room for every chunk");
                FIRST_CHUNK + free
            });
            (*place, number)
        });
        Numbers(numbers.collect())
    }
}

/// The index's array, and what this agent wrote to it.
pub struct PolicyIndex {
    array: Array<MapData, Chunk>,
    /// The chunks below the top level the array has room for.
    room: u32,
    /// What the array holds; `None` before the first write, and where a write failed and the
    /// array may hold anything.
    written: Option<Written>,
    /// Whether the chunks hold the trie's policy: then a new generation needs only a stamp.
    holds_the_trie: bool,
    /// The stamp as written; `None` where a write of it failed.
    stamped: Option<u32>,
    /// What the last write of the chunks did.
    last_write: IndexWrite,
}

/// What a write of the index did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexWrite {
    /// Chunks rewritten.
    pub chunks_written: usize,
    /// /16s whose destinations are left to the trie, for want of room below them.
    pub left_to_the_trie: usize,
}

/// Chunks a system call writes.
const WRITES_AT_ONCE: usize = 4096;

impl PolicyIndex {
    pub fn new(array: Array<MapData, Chunk>) -> PolicyIndex {
        let room = array.len().saturating_sub(FIRST_CHUNK);
        PolicyIndex {
            array,
            room,
            written: None,
            holds_the_trie: false,
            stamped: None,
            last_write: IndexWrite::default(),
        }
    }

    /// What the last write of the chunks did.
    pub fn last_write(&self) -> IndexWrite {
        self.last_write
    }

    /// Whether the index holds what the trie held when it was last written: a new generation
    /// needs only a new stamp.
    pub fn holds_the_trie(&self) -> bool {
        self.holds_the_trie
    }

    /// Writes the index from `entries`, what the trie holds, and stamps it with `generation`.
    pub fn refresh(
        &mut self,
        entries: &BTreeMap<Prefix<4>, PolicyEntry>,
        generation: u32,
    ) -> anyhow::Result<()> {
        self.holds_the_trie = false;
        self.last_write = self.write(entries)?;
        self.holds_the_trie = true;
        self.stamp(generation)
    }

    /// Says the index holds the policy of `generation`.
    pub fn stamp(&mut self, generation: u32) -> anyhow::Result<()> {
        self.set_stamp(stamp(generation))
    }

    fn set_stamp(&mut self, stamp: u32) -> anyhow::Result<()> {
        if self.stamped != Some(stamp) {
            self.stamped = None;
            let mut chunk = [0; CHUNK_WORDS];
            chunk[0] = stamp;
            self.array.set(STAMP_CHUNK, chunk, 0)?;
            self.stamped = Some(stamp);
        }
        Ok(())
    }

    /// Writes the chunks that differ from the index of `entries`, between waits for the
    /// program runs that may read them.
    fn write(&mut self, entries: &BTreeMap<Prefix<4>, PolicyEntry>) -> anyhow::Result<IndexWrite> {
        // Taken out while the array changes: a write that fails leaves it `None`.
        let written = self.written.take();
        let plan = Plan::of(entries, self.room, written.as_ref());
        let mut pending: Vec<(u32, Chunk)> = Vec::new();
        let mut chunks_written = 0;
        plan.changes(written.as_ref(), &mut |number, chunk| {
            pending.push((number, chunk));
            if pending.len() == WRITES_AT_ONCE {
                chunks_written += self.flush(&mut pending, chunks_written == 0)?;
            }
            Ok(())
        })?;
        chunks_written += self.flush(&mut pending, chunks_written == 0)?;
        // A run that reads the stamp that follows reads every chunk written before it where
        // loads are made in order; elsewhere one might read a chunk first, so no run that
        // started before the writes ended may see the stamp.
        if chunks_written > 0 && !MEMORY_IN_ORDER {
            wait_for_program_runs();
        }
        let done = IndexWrite {
            chunks_written,
            left_to_the_trie: plan.left.len(),
        };
        if done.left_to_the_trie > 0 {
            tracing::warn!(
                left = done.left_to_the_trie,
                room = self.room,
                "the policy index has no room for all of the IPv4 policy: destinations under \
                 these /16s are looked up in the trie, more slowly; a restart sizes the index \
                 for the policy"
            );
        }
        self.written = Some(Written {
            numbers: plan.numbers,
            layout: plan.layout,
            top: plan.top,
        });
        Ok(done)
    }

    /// Writes `pending` and empties it; before the first write, takes the stamp away and waits
    /// for the program runs that may have seen it. Returns how many chunks it wrote.
    fn flush(&mut self, pending: &mut Vec<(u32, Chunk)>, first: bool) -> anyhow::Result<usize> {
        if pending.is_empty() {
            return Ok(0);
        }
        if first {
            // Whatever moved the generation on, no run takes the index's answer from here.
            self.set_stamp(0)?;
            wait_for_program_runs();
        }
        let (slots, values): (Vec<u32>, Vec<Chunk>) = pending.drain(..).unzip();
        batch::update_array(self.array.map(), &slots, &values)?;
        Ok(slots.len())
    }
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
        .max(CHUNKS_AT_LEAST);
    FIRST_CHUNK + room
}

#[cfg(test)]
mod tests {
    use super::*;
    use masq_ebpf::policy_index::{KEEPS_ADDRESS, top, word_below};
    use masq_testbed::prefixes::XorShift;

    /// The verdict word of the longest prefix of `addr` among `entries`, found by trying every
    /// length: shares nothing with the index.
    fn longest(entries: &BTreeMap<Prefix<4>, PolicyEntry>, addr: u32) -> u32 {
        let entry = (0..=32u32).rev().find_map(|len| {
            let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
            entries.get(&(len, (addr & mask).to_be_bytes())).copied()
        });
        match entry {
            None => 0,
            Some(e) => {
                let keeps = e.action == prefix_action::NON_MASQUERADE;
                (if keeps { KEEPS_ADDRESS } else { 0 }) | e.counted_in
            }
        }
    }

    /// An array as the writes left it, walked as the programs walk it; `None` where a word
    /// sends the walk to the trie.
    fn walk(array: &HashMap<u32, Chunk>, addr: u32) -> Option<u32> {
        let (chunk, at) = top(addr);
        let mut word = array[&chunk][at];
        for level in 0..LEVELS {
            if word & CHILD == 0 {
                break;
            }
            word = array.get(&(word & !CHILD))?[word_below(addr, level)];
        }
        assert_eq!(word & CHILD, 0, "{addr:#x}: the walk ends on a verdict");
        Some(word)
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

    /// An index in memory: the array, and what a writer knows of it.
    struct Fake {
        array: HashMap<u32, Chunk>,
        written: Option<Written>,
        room: u32,
    }

    impl Fake {
        fn new(room: u32) -> Fake {
            Fake {
                array: HashMap::new(),
                written: None,
                room,
            }
        }

        /// Writes the index of `entries` as `PolicyIndex::write` does; returns the chunks
        /// written and the /16s left to the trie.
        fn write(&mut self, entries: &BTreeMap<Prefix<4>, PolicyEntry>) -> (usize, usize) {
            let plan = Plan::of(entries, self.room, self.written.as_ref());
            let mut count = 0;
            plan.changes(self.written.as_ref(), &mut |number, chunk| {
                assert!(number < FIRST_CHUNK + self.room, "{number}");
                self.array.insert(number, chunk);
                count += 1;
                Ok(())
            })
            .unwrap();
            let left = plan.left.len();
            self.written = Some(Written {
                numbers: plan.numbers,
                layout: plan.layout,
                top: plan.top,
            });
            (count, left)
        }

        /// Checks every prefix's edges, a random address inside each, and random addresses;
        /// returns how many the trie was left to answer.
        fn check(&self, rng: &mut Rng, entries: &BTreeMap<Prefix<4>, PolicyEntry>) -> usize {
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
            let mut to_the_trie = 0;
            for addr in addrs {
                match walk(&self.array, addr) {
                    Some(word) => assert_eq!(word, longest(entries, addr), "{addr:#x}"),
                    None => to_the_trie += 1,
                }
            }
            to_the_trie
        }
    }

    #[test]
    fn the_index_answers_as_the_longest_prefix_does() {
        let mut rng = Rng(XorShift(0x2545_f491_4f6c_dd1d));
        for count in [0, 1, 5, 60, 600] {
            let entries = random_policy(&mut rng, count);
            let mut fake = Fake::new(chunks_for(count) - FIRST_CHUNK);
            fake.write(&entries);
            assert_eq!(fake.check(&mut rng, &entries), 0, "{count} prefixes");
        }
    }

    /// Each change rewrites only what it changes, and leaves the array answering as the new
    /// policy does, what it kept included.
    #[test]
    fn a_change_rewrites_the_chunks_it_changes_and_no_more() {
        let mut rng = Rng(XorShift(0x9e37_79b9_7f4a_7c15));
        let mut entries = random_policy(&mut rng, 400);
        let mut fake = Fake::new(chunks_for(400) - FIRST_CHUNK);
        let (first, _) = fake.write(&entries);
        assert!(first > 4096, "the top level and the chunks below: {first}");
        assert_eq!(fake.write(&entries), (0, 0), "nothing changed");
        for _ in 0..30 {
            // A longer prefix in, another out: the chunks of their two /16s change, and the
            // top-level chunks over them.
            let (mut prefix, entry) = random_policy(&mut rng, 1).into_iter().next().unwrap();
            prefix.0 = 17 + prefix.0 % 16;
            let mask = u32::MAX << (32 - prefix.0);
            prefix.1 = (u32::from_be_bytes(prefix.1) & mask).to_be_bytes();
            let deep = entries.keys().filter(|(len, _)| *len > TOP_BITS).count();
            let removed = *entries
                .keys()
                .filter(|(len, _)| *len > TOP_BITS)
                .nth(rng.next() as usize % deep)
                .unwrap();
            entries.insert(prefix, entry);
            entries.remove(&removed);
            let layout = Layout::of(&entries);
            let tops = [prefix, removed].map(|(_, data)| u32::from_be_bytes(data) >> 16);
            let under = |t: u32| layout.places().iter().filter(|p| top_of(**p) == t).count();
            let (written, _) = fake.write(&entries);
            assert!(written <= 2 + under(tops[0]) + under(tops[1]), "{written}");
            assert!(written >= 1);
            assert_eq!(fake.check(&mut rng, &entries), 0);
        }
    }

    /// Host prefixes each under a /16 of its own need a chunk a level each; an array with
    /// room for a third of them leaves the rest to the trie, and what it answers is right.
    #[test]
    fn a_policy_larger_than_the_array_leaves_the_rest_to_the_trie() {
        let mut rng = Rng(XorShift(0x1234_5678_9abc_def1));
        let entries: BTreeMap<Prefix<4>, PolicyEntry> = (0..300u32)
            .map(|i| {
                let addr = (i << 16) | (rng.next() & 0xffff);
                ((32, addr.to_be_bytes()), PolicyEntry::default())
            })
            .collect();
        let mut fake = Fake::new(400);
        let (_, left) = fake.write(&entries);
        assert_eq!(left, 200, "four chunks each: 100 fit");
        assert!(fake.check(&mut rng, &entries) > 0);
        // Grown room: every /16 comes back.
        fake.room = 1200;
        let (_, left) = fake.write(&entries);
        assert_eq!(left, 0);
        assert_eq!(fake.check(&mut rng, &entries), 0);
    }

    #[test]
    fn a_host_prefix_takes_a_chunk_a_level_and_a_wide_one_none() {
        let entry = PolicyEntry::default();
        let entries = BTreeMap::from([((32, [10, 96, 1, 2]), entry), ((8, [10, 0, 0, 0]), entry)]);
        assert_eq!(Layout::of(&entries).places().len(), LEVELS as usize);
        let wide = BTreeMap::from([((12, [172, 16, 0, 0]), entry)]);
        assert!(Layout::of(&wide).places().is_empty());
    }
}

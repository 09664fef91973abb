//! The slot table: where a family's NAT halves are kept on kernels with BPF atomics on map
//! values (Linux 5.12), in place of a kernel hash table (docs/bench/profiles.md, "The first
//! packet"). Both sides read and write it by these rules: the programs through masq-ebpf's
//! `flow_table`, the agent through its `flow_table::NatTable`.
//!
//! Halves live in an array of slots, a cache line each (`Slot`), in buckets of `BUCKET_SLOTS`.
//! A second array holds one word per bucket, a byte per slot (`slot_byte`): free, being
//! written, or held, with a tag made from the key's hash. The words are an eighth of a byte per
//! slot bit, small enough to stay in the caches, so that a lookup reads one word and then only
//! the slots whose tag matches: one cold line per half, where a hash table element is a bucket
//! head and an element. A key may go in either of two buckets (`Place`), the emptier, which
//! keeps the table usable to some 75 % full; the agent makes it larger than the halves it is
//! asked to hold (`buckets_for`).
//!
//! The word after the last bucket's is the table's seed, which every key's hash takes in: made
//! at random when the agent creates the table, and kept with it. Without it, anyone could
//! reckon which keys share a bucket, and send packets whose flows take all of a bucket's slots
//! (`seed_at`).

use crate::{Address, NatEntry, NatKey};

/// Slots in a bucket: one byte each of its word.
pub const BUCKET_SLOTS: u32 = 8;

/// A slot's byte in its bucket's word.
pub mod slot_byte {
    /// The slot holds nothing.
    pub const FREE: u8 = 0;
    /// Set once the slot's key and entry are written whole; clear while they are being
    /// written. The low bits are the key's tag either way, so that an insert of another key
    /// is not held up by a slot being written.
    pub const HELD: u8 = 0x80;
    /// The tag's bits: never all clear, so that a tagged byte is never `FREE`.
    pub const TAG: u8 = 0x7f;
    /// Held without a tag: a slot taken out of use, which no key's lookup or insert ever
    /// matches, no removal frees, and no walk visits (`limit`).
    pub const BLOCKED: u8 = HELD;
}

/// One half: its key and entry, alone on a cache line (two for IPv6).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Slot<A: Address> {
    pub key: NatKey<A>,
    pub entry: NatEntry<A>,
}

/// Where a key may be: its two buckets, and the tag its slot's byte carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place {
    pub buckets: [u32; 2],
    pub tag: u8,
}

impl Place {
    /// The place of `key` in a table of `buckets` buckets (an even number, at least two) whose
    /// seed is `seed`. Each half of the hash picks a bucket: by its low bits where the buckets
    /// are a power of two, as every table was placed before tables took any even number
    /// (`buckets_for`), so that such a table pinned then is read as it was written; by
    /// multiplying and keeping the top bits otherwise, where a division would take several
    /// times as long. The programs take `buckets` from a read-only global, so the verifier follows
    /// only the branch their table's size takes.
    #[inline(always)]
    pub fn of<A: Address>(key: &NatKey<A>, buckets: u32, seed: u64) -> Place {
        let hash = hash(key, seed);
        let in_table = |half: u32| {
            if buckets & buckets.wrapping_sub(1) == 0 {
                half & (buckets - 1)
            } else {
                ((u64::from(half) * u64::from(buckets)) >> 32) as u32
            }
        };
        let first = in_table(hash as u32);
        let mut second = in_table((hash >> 32) as u32);
        if second == first {
            second = first ^ 1;
        }
        Place {
            buckets: [first, second],
            tag: tag(hash),
        }
    }
}

/// The tag of a key whose hash is `hash`, evenly over 1..=127: the top bits of the hash mixed
/// once more, since the buckets take its low bits of either half, which a large table's
/// buckets widen into the bits the tag would otherwise share.
#[inline(always)]
const fn tag(hash: u64) -> u8 {
    let bits = hash.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 48;
    ((bits * slot_byte::TAG as u64) >> 16) as u8 + 1
}

/// A 64-bit hash of every field of `key`, in a table whose seed is `seed`: each of its words,
/// with the seed, multiplied by a constant of its own, then the products folded and finished,
/// so that both halves of the result (the two buckets) and its top bits (the tag) depend on
/// all of them. The products do not wait on each other, as a chain of mixes would: a CPU makes
/// them at once (a lookup hashes its key on every packet). The seed goes in before the
/// products, whose carries mix it with the key's bits: keys whose words fold to the same value
/// under one seed do not under another. A seed of 0 hashes as tables made before seeds did.
#[inline(always)]
pub fn hash<A: Address>(key: &NatKey<A>, seed: u64) -> u64 {
    let mut folded = 0u64;
    for (at, multiplier) in WORD_MULTIPLIERS.iter().enumerate().take(key_words::<A>()) {
        folded ^= (key_word(key, at) ^ seed).wrapping_mul(*multiplier);
    }
    finish(folded)
}

/// Where a table of `buckets` buckets keeps its seed: the word after the last bucket's. A table
/// whose words are `buckets` alone (made before seeds) has none, and hashes with 0.
#[inline(always)]
pub const fn seed_at(buckets: u32) -> u32 {
    buckets
}

/// How many words a table of `buckets` buckets takes: the buckets', and its seed.
#[inline(always)]
pub const fn words_for(buckets: u32) -> u32 {
    seed_at(buckets) + 1
}

/// The buckets of a table of `words` words, and whether one of them is its seed: a power of
/// two of words is a table made before seeds, an even number and one a seeded table; any
/// other count is no slot table.
pub const fn buckets_in(words: u32) -> Option<(u32, bool)> {
    if words >= 2 && words.is_power_of_two() {
        Some((words, false))
    } else if words >= 3 && words % 2 == 1 {
        Some((words - 1, true))
    } else {
        None
    }
}

/// How full a table the agent makes is when it holds the halves it was made for: five slots
/// in eight. A half may go in two buckets only, so a table refuses some halves before it is
/// full, where both of theirs are; made this much larger than asked, it almost never does
/// below the size asked. Simulated with random keys, removed one at random for each made
/// (two buckets of 8, the emptier taken): at 62.5 % full 0.004 % of new halves find both
/// their buckets full, at 67 % 0.035 %, at 75 % 0.75 %.
pub const FULL_AT_SIZE_ASKED: (u32, u32) = (5, 8);

/// The halves a table of `buckets` is made to hold (`FULL_AT_SIZE_ASKED` of its slots): what
/// the agent says it holds, its capacity, which is the size it was asked for, rounded up to its
/// buckets. It may hold more.
pub const fn rated_halves(buckets: u32) -> u64 {
    let (held, of) = FULL_AT_SIZE_ASKED;
    buckets as u64 * BUCKET_SLOTS as u64 * held as u64 / of as u64
}

/// The buckets of a table made for `halves` halves: room for them at `FULL_AT_SIZE_ASKED`, in
/// an even number of buckets (a key whose two buckets would be one takes its neighbour as
/// well), two at least.
pub const fn buckets_for(halves: u32) -> u32 {
    let (held, of) = FULL_AT_SIZE_ASKED;
    let slots = (halves as u64 * of as u64).div_ceil(held as u64);
    let buckets = slots.div_ceil(BUCKET_SLOTS as u64);
    let even = buckets + buckets % 2;
    // Fits: `u32::MAX` halves take under 2^30 buckets.
    if even < 2 { 2 } else { even as u32 }
}

/// One odd constant for each word of the largest key (IPv6's five), with their bits spread.
const WORD_MULTIPLIERS: [u64; 5] = [
    0x9e37_79b9_7f4a_7c15,
    0xbf58_476d_1ce4_e5b9,
    0xd6e8_feb8_6659_fd93,
    0xa076_1d64_78bd_642f,
    0xe703_7ed1_a0b4_28db,
];

/// How many u64s make a key: every byte of them a field's or its `_pad`, which is always zero.
#[inline(always)]
const fn key_words<A: Address>() -> usize {
    const {
        assert!(size_of::<NatKey<A>>().is_multiple_of(8) && align_of::<NatKey<A>>() >= 4);
        assert!(size_of::<NatKey<A>>() / 8 <= WORD_MULTIPLIERS.len());
    };
    size_of::<NatKey<A>>() / 8
}

/// The u64 `at` (below `key_words`) of `key`, read as the two u32s its alignment allows. The
/// sizes are constants, so the callers' loops unroll, and their bounds fold away.
#[inline(always)]
fn key_word<A: Address>(key: &NatKey<A>, at: usize) -> u64 {
    let halves = core::ptr::from_ref(key).cast::<u32>();
    // SAFETY: within the key, and aligned, as `key_words` asserts.
    let (low, high) = unsafe { (halves.add(at * 2).read(), halves.add(at * 2 + 1).read()) };
    u64::from(low) | u64::from(high) << 32
}

#[inline(always)]
const fn finish(mut hash: u64) -> u64 {
    hash ^= hash >> 32;
    hash = hash.wrapping_mul(0x94d0_49bb_1331_11eb);
    hash ^ hash >> 29
}

const LOW_BITS: u64 = 0x7f7f_7f7f_7f7f_7f7f;
const ONES: u64 = 0x0101_0101_0101_0101;

/// The bytes of `word` equal to `byte`, as a mask with the top bit of each such byte set. Exact:
/// the carry of one byte never reaches the next.
#[inline(always)]
pub const fn bytes_equal(word: u64, byte: u8) -> u64 {
    let diff = word ^ ONES.wrapping_mul(byte as u64);
    !((diff & LOW_BITS).wrapping_add(LOW_BITS) | diff | LOW_BITS)
}

/// The bytes of `word` that carry `tag`, held or being written.
#[inline(always)]
pub const fn bytes_tagged(word: u64, tag: u8) -> u64 {
    bytes_equal(word & LOW_BITS, tag)
}

/// The slot of the lowest byte a mask of `bytes_equal` names, if any.
#[inline(always)]
pub const fn first_slot(mask: u64) -> Option<u32> {
    if mask == 0 {
        return None;
    }
    Some(lowest_slot(mask))
}

/// `first_slot` without its test of an empty mask, for which it says slot 0. Without a branch
/// or a table: the lowest set bit, shifted to the bottom of its byte, is 1 << 8i, and
/// multiplies a constant whose byte k is 7 - k into one whose top byte is i.
#[inline(always)]
const fn lowest_slot(mask: u64) -> u32 {
    let lowest = (mask & mask.wrapping_neg()) >> 7;
    (lowest.wrapping_mul(0x0001_0203_0405_0607) >> 56) as u32
}

/// How many bytes a mask of `bytes_equal` names.
#[inline(always)]
pub const fn slots_named(mask: u64) -> u32 {
    mask.count_ones()
}

/// `byte` in the place of slot `slot`'s byte of a word.
#[inline(always)]
pub const fn at_slot(byte: u8, slot: u32) -> u64 {
    (byte as u64) << (slot * 8)
}

/// How one side reaches a table's words and slots: the programs through map lookups and BPF
/// atomics, the agent through its mapping of the arrays. Everything else about the table is
/// the same on both sides, and written once, below.
pub trait SlotMemory<A: Address> {
    /// Buckets in the table: an even number, at least two.
    fn buckets(&self) -> u32;
    /// CLOCK_MONOTONIC, in nanoseconds, as a wait for another CPU's claim reads it
    /// (`decided`).
    fn now_ns(&self) -> u64;
    /// The table's seed (`seed_at`).
    fn seed(&self) -> u64;
    fn word(&self, bucket: u32) -> Option<*mut u64>;
    /// Slot `index` (below `BUCKET_SLOTS`) of `bucket`.
    fn slot(&self, bucket: u32, index: u32) -> Option<*mut Slot<A>>;
    /// Replaces the word `old` with `new` if it is still `old`, as one locked instruction;
    /// whether it was.
    ///
    /// # Safety
    /// `word` is one `word` gave.
    unsafe fn exchange(&self, word: *mut u64, old: u64, new: u64) -> bool;
    /// Flips `bits` of the word, as one locked instruction.
    ///
    /// # Safety
    /// As for `exchange`.
    unsafe fn flip(&self, word: *mut u64, bits: u64);
    /// Sets the byte of slot `index` (below `BUCKET_SLOTS`), being written with `tag`, to held
    /// (`slot_byte::HELD | tag`), as a release: seen by no CPU before the slot's writes. No
    /// other CPU changes a byte being written, and each of their changes to the word is a
    /// compare-and-exchange of all of it, which fails if it read the word before this.
    ///
    /// # Safety
    /// As for `exchange`.
    unsafe fn publish(&self, word: *mut u64, index: u32, tag: u8);
}

/// Why a half could not be made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// A half of that key is held; or one of its tag was still being written when the wait
    /// for it ran out (`CLAIM_DECIDED_WITHIN_NS`), perhaps the same key on another CPU. Its
    /// callers take it as another CPU's flow.
    Exists,
    /// Neither bucket has a free slot; or every attempt (`CLAIM_ATTEMPTS`) saw the words
    /// change under it, or waited for another CPU's claim, and none made the half.
    Full,
}

/// Times an insert tries to claim a slot against other CPUs' claims in the same buckets
/// before it gives up as if the table were full: each failed try saw another CPU's change, or
/// waited for another CPU's claim of its tag to be decided (`decided`).
pub const CLAIM_ATTEMPTS: u32 = 4;

/// The word as it is now. A plain load: the BPF target has no atomic load below ISA v4, and an
/// aligned u64 is never read torn.
#[inline(always)]
fn load(word: *mut u64) -> u64 {
    // SAFETY: `SlotMemory` hands out valid, aligned words.
    unsafe { core::ptr::read_volatile(word) }
}

/// The slot of `bucket` whose byte in `word` says it holds `key`, and its index.
#[inline(always)]
fn held_in<A: Address, M: SlotMemory<A>>(
    memory: &M,
    bucket: u32,
    word: u64,
    tag: u8,
    key: &NatKey<A>,
) -> Option<(u32, *mut Slot<A>)> {
    let mut held = bytes_equal(word, slot_byte::HELD | tag);
    // One turn a slot whose tag matches (other keys share a tag one time in 127), under a
    // constant bound. Each turn clears the lowest such byte: the verifier learns nothing of
    // the mask's bits from it, so the turns' states match and it walks them once, where a
    // test of each slot's bit would make it walk every combination.
    for _ in 0..BUCKET_SLOTS {
        let index = first_slot(held)?;
        held &= held - 1;
        let slot = memory.slot(bucket, index)?;
        // SAFETY: `SlotMemory` hands out valid slots; the key is only compared.
        if same_key(unsafe { &(*slot).key }, key) {
            return Some((index, slot));
        }
    }
    None
}

/// Whether `a` and `b` are the same key, by one test of all their bits at once: `==` tests
/// each field in turn, and every field that differs is a path the verifier walks to the next
/// slot on its own, which it multiplies by the slots and the buckets.
#[inline(always)]
pub fn same_key<A: Address>(a: &NatKey<A>, b: &NatKey<A>) -> bool {
    let mut differ = 0;
    for at in 0..key_words::<A>() {
        differ |= key_word(a, at) ^ key_word(b, at);
    }
    differ == 0
}

/// The slot that holds `key`, if one does.
#[inline(always)]
pub fn find<A: Address, M: SlotMemory<A>>(memory: &M, key: &NatKey<A>) -> Option<*mut Slot<A>> {
    look_up(memory, key).map(|(_, slot)| slot)
}

/// The slot that holds `key`, if one does, and its number in the table (bucket times
/// `BUCKET_SLOTS`, plus its index).
#[inline(always)]
pub fn look_up<A: Address, M: SlotMemory<A>>(
    memory: &M,
    key: &NatKey<A>,
) -> Option<(u32, *mut Slot<A>)> {
    let place = Place::of(key, memory.buckets(), memory.seed());
    for bucket in place.buckets {
        let word = load(memory.word(bucket)?);
        if let Some((index, slot)) = held_in(memory, bucket, word, place.tag, key) {
            return Some((bucket * BUCKET_SLOTS + index, slot));
        }
    }
    None
}

/// Reads the lines a look-up of `key` would read, without a branch on anything read: both
/// buckets' words, and the slot of the first byte held with the key's tag in whichever of the
/// two has one (slot 0 of the second bucket if neither does); the number of that slot. A
/// look-up branches on each word and slot as it reads them, and where a line is cold the CPU
/// cannot tell which way until it comes: a run of look-ups waits for their lines one after
/// the other, where a run of these has several in flight at once. The reads are volatile, so
/// that they are made though their values go unused.
#[inline(always)]
pub fn read_ahead<A: Address, M: SlotMemory<A>>(memory: &M, key: &NatKey<A>) -> u32 {
    let place = Place::of(key, memory.buckets(), memory.seed());
    let [first, second] = place.buckets;
    let (Some(first_word), Some(second_word)) = (memory.word(first), memory.word(second)) else {
        return 0;
    };
    let held = slot_byte::HELD | place.tag;
    let first_tagged = bytes_equal(load(first_word), held);
    let second_tagged = bytes_equal(load(second_word), held);
    // All ones where the first bucket has such a byte, none where not: by arithmetic, as a
    // test would be a branch.
    let in_first = 0u64.wrapping_sub((first_tagged | first_tagged.wrapping_neg()) >> 63);
    let bucket = second ^ ((first ^ second) & in_first as u32);
    let tagged = second_tagged ^ ((first_tagged ^ second_tagged) & in_first);
    let index = lowest_slot(tagged) % BUCKET_SLOTS;
    if let Some(slot) = memory.slot(bucket, index) {
        // SAFETY: a valid slot of the memory, only read.
        unsafe { core::ptr::read_volatile(&raw const (*slot).entry.last_seen_ns) };
    }
    bucket * BUCKET_SLOTS + index
}

/// Slot `number` (bucket times `BUCKET_SLOTS`, plus its index), if its byte says it holds a
/// half. Another CPU may free the slot and write another half there while its caller reads
/// it: what it reads may then be torn, a key no half has, which it must find nowhere.
#[inline(always)]
pub fn held_at<A: Address, M: SlotMemory<A>>(memory: &M, number: u32) -> Option<*mut Slot<A>> {
    let (bucket, index) = (number / BUCKET_SLOTS, number % BUCKET_SLOTS);
    let word = load(memory.word(bucket)?);
    if held_slots(word) & at_slot(slot_byte::HELD, index) == 0 {
        return None;
    }
    memory.slot(bucket, index)
}

/// Makes the half of `key` in the emptier of its buckets, if neither holds it: claims a free
/// byte (writes its tag without `HELD`), writes the slot, and publishes it (sets `HELD`). Of
/// two CPUs that claim the same key in its two buckets at once, at least one sees the other's
/// claim when it reads the other bucket again after its own (both are locked instructions,
/// full barriers, before either reads), and the claim in the lower-numbered bucket stands
/// (`outlasts`); the other yields, and says `Exists` once the rival is published. Where the
/// rival was another key's of the same tag, or a wait for another CPU runs out (`decided`),
/// `Exists` is said of a key none may hold, and its callers look before they take it for
/// another CPU's flow. Never is a key made twice.
#[inline(always)]
pub fn insert_new<A: Address, M: SlotMemory<A>>(
    memory: &M,
    key: &NatKey<A>,
    entry: &NatEntry<A>,
) -> Result<(), Refused> {
    let place = Place::of(key, memory.buckets(), memory.seed());
    let [first_bucket, second_bucket] = place.buckets;
    let (Some(first), Some(second)) = (memory.word(first_bucket), memory.word(second_bucket))
    else {
        return Err(Refused::Full);
    };
    'attempts: for _ in 0..CLAIM_ATTEMPTS {
        let (first_seen, second_seen) = (load(first), load(second));
        for (bucket, word, seen) in [
            (first_bucket, first, first_seen),
            (second_bucket, second, second_seen),
        ] {
            // A half of the key's tag being written may be this very key's, another CPU's
            // flow, which its caller could not find yet: wait until it is published or given
            // back, and look again.
            let being_written = bytes_equal(seen, place.tag);
            if being_written != 0 {
                if decided(memory, word, being_written, place.tag).is_none() {
                    return Err(Refused::Exists);
                }
                continue 'attempts;
            }
            if held_in(memory, bucket, seen, place.tag, key).is_some() {
                return Err(Refused::Exists);
            }
        }
        // The emptier bucket, chosen by value, not by index: an array indexed by a value
        // would live in the frame, and the deepest chain of frames has no room for it.
        let first_free = bytes_equal(first_seen, slot_byte::FREE);
        let second_free = bytes_equal(second_seen, slot_byte::FREE);
        let (bucket, word, seen, free, other, other_seen) =
            if slots_named(second_free) > slots_named(first_free) {
                (
                    second_bucket,
                    second,
                    second_seen,
                    second_free,
                    first,
                    first_seen,
                )
            } else {
                (
                    first_bucket,
                    first,
                    first_seen,
                    first_free,
                    second,
                    second_seen,
                )
            };
        let Some(index) = first_slot(free) else {
            return Err(Refused::Full);
        };
        let claim = at_slot(place.tag, index);
        // SAFETY (here and below): both words are the memory's own.
        if !unsafe { memory.exchange(word, seen, seen | claim) } {
            continue;
        }
        let rival = bytes_tagged(load(other), place.tag) & !bytes_tagged(other_seen, place.tag);
        let lower = bucket == first_bucket.min(second_bucket);
        if rival != 0 && !outlasts(memory, other, rival, place.tag, lower) {
            unsafe { memory.flip(word, claim) };
            // The rival is most likely this very key's, another CPU's, which its caller is to
            // find: it publishes now that this claim is gone, if it had not. (If it was another
            // key's, or is given back, the caller finds nothing, and may try again: to try
            // again here would keep more of this frame's values through the wait's calls than
            // the deepest chain of frames has room for.)
            let _ = decided(memory, other, rival, place.tag);
            return Err(Refused::Exists);
        }
        let Some(slot) = memory.slot(bucket, index) else {
            unsafe { memory.flip(word, claim) };
            return Err(Refused::Full);
        };
        // SAFETY: the slot is this CPU's from its claim to its publish, which no write before
        // it passes.
        unsafe {
            core::ptr::copy_nonoverlapping(key, &raw mut (*slot).key, 1);
            core::ptr::copy_nonoverlapping(entry, &raw mut (*slot).entry, 1);
        }
        unsafe { memory.publish(word, index, place.tag) };
        return Ok(());
    }
    Err(Refused::Full)
}

/// How long a CPU waits for another's claim of a tag in a key's buckets to be decided
/// (`decided`): published, or given back. Between its claim and its publish a CPU writes one
/// slot, some tens of nanoseconds; a program in softirq is held up meanwhile only by an
/// interrupt, but the agent's thread may be preempted there, a virtual CPU stalled, and
/// softirq preempted on PREEMPT_RT. Past the wait the insert goes on without the claim's
/// outcome (`insert_new`).
pub const CLAIM_DECIDED_WITHIN_NS: u64 = 5_000;

/// Turns of that wait at most, each a load of the word and a reading of the clock: a bound
/// the verifier can walk (it walks every turn, some 50 000 instructions in all for the
/// insert's waits). The wait ends at whichever comes first: at 20 ns a reading, or more, the
/// time; where the clock is read in 10 ns, after some 2.5 µs.
const WAIT_TURNS: u32 = 256;

/// The word at `word` once none of its bytes `pending` (a mask of `bytes_equal`) carries `tag`
/// without `HELD`: the claims there were published or given back. `None` if one still stands
/// after `CLAIM_DECIDED_WITHIN_NS`. A count of loads would be no time at all where the word
/// stays in this CPU's cache: the clock between them is the wait.
#[inline(always)]
fn decided<A: Address, M: SlotMemory<A>>(
    memory: &M,
    word: *mut u64,
    pending: u64,
    tag: u8,
) -> Option<u64> {
    let since = memory.now_ns();
    for _ in 0..WAIT_TURNS {
        let now = load(word);
        if bytes_equal(now, tag) & pending == 0 {
            return Some(now);
        }
        if memory.now_ns().wrapping_sub(since) > CLAIM_DECIDED_WITHIN_NS {
            break;
        }
    }
    None
}

/// Whether a claim of a key in one of its buckets outlasts a rival claim of its tag made
/// meanwhile in the key's other bucket, whose word is `other` (`rival`: its bytes, as
/// `bytes_equal` names them). A claim in the higher-numbered bucket yields to one in the lower
/// as soon as it sees it. So a claim in the lower (`in_lower_bucket`) waits for the rival to
/// decide (`decided`): its byte gone (it saw this claim and yielded: this one stands) or held
/// (it had seen nothing and published: this one yields, as it does if the wait runs out).
/// Both yielding, as two CPUs making one flow at once would otherwise each see the other's
/// claim and do, none would make it. Which waits goes by the buckets' numbers, not by which
/// of its key's two each is, so that claims of two keys of one tag whose buckets are each
/// other's never wait on each other.
#[inline(always)]
fn outlasts<A: Address, M: SlotMemory<A>>(
    memory: &M,
    other: *mut u64,
    rival: u64,
    tag: u8,
    in_lower_bucket: bool,
) -> bool {
    if !in_lower_bucket {
        return false;
    }
    decided(memory, other, rival, tag)
        .is_some_and(|now| bytes_equal(now, slot_byte::HELD | tag) & rival == 0)
}

/// Frees the slot that holds `key`, by a compare-and-exchange that expects its byte held by the
/// key's tag, so that of two CPUs that remove the same half one does, and the other is told it
/// was gone; whether this one did. The slot is found once: a retry (another CPU changed another
/// byte of the word meanwhile) checks only that its byte is still the key's, which keeps the
/// verifier's walk of it short.
#[inline(always)]
pub fn remove<A: Address, M: SlotMemory<A>>(memory: &M, key: &NatKey<A>) -> bool {
    let place = Place::of(key, memory.buckets(), memory.seed());
    for bucket in place.buckets {
        let Some(word) = memory.word(bucket) else {
            return false;
        };
        let Some((index, _)) = held_in(memory, bucket, load(word), place.tag, key) else {
            continue;
        };
        let byte = at_slot(0xff, index);
        let held = at_slot(slot_byte::HELD | place.tag, index);
        for _ in 0..CLAIM_ATTEMPTS {
            let before = load(word);
            if before & byte != held {
                return false;
            }
            // SAFETY: a word the memory gave.
            if unsafe { memory.exchange(word, before, before & !byte) } {
                return true;
            }
        }
        return false;
    }
    false
}

/// The slots of a bucket whose word is `word` that hold a half, as a mask of `bytes_equal`'s
/// kind: held, and not blocked.
#[inline(always)]
pub const fn held_slots(word: u64) -> u64 {
    word & ONES.wrapping_mul(slot_byte::HELD as u64) & !bytes_equal(word, slot_byte::BLOCKED)
}

/// The word of an empty bucket whose slots from `usable` on are blocked: so that a table of
/// whole buckets holds no more halves than it was asked to, as a hash table of that many
/// entries would (the tests' small tables).
#[inline(always)]
pub const fn blocked_from(usable: u32) -> u64 {
    let mut word = 0;
    let mut index = usable;
    while index < BUCKET_SLOTS {
        word |= at_slot(slot_byte::BLOCKED, index);
        index += 1;
    }
    word
}

/// A table in this process's memory (the agent's mapping of the arrays, or a test's own), reached
/// with the host's atomics.
#[cfg(not(target_arch = "bpf"))]
pub struct Mapped<A: Address> {
    words: *mut u64,
    slots: *mut Slot<A>,
    buckets: u32,
    seed: u64,
    /// CLOCK_MONOTONIC in nanoseconds, which this crate has no means of its own to read.
    clock: fn() -> u64,
}

#[cfg(not(target_arch = "bpf"))]
impl<A: Address> Mapped<A> {
    /// A table whose seed is `seed`, whose waits read `clock` (CLOCK_MONOTONIC, in
    /// nanoseconds).
    ///
    /// # Safety
    /// `words` must point to `buckets` aligned words and `slots` to `buckets * BUCKET_SLOTS`
    /// slots, valid while the `Mapped` lives, and changed by others only by these rules.
    pub unsafe fn new(
        words: *mut u64,
        slots: *mut Slot<A>,
        buckets: u32,
        seed: u64,
        clock: fn() -> u64,
    ) -> Mapped<A> {
        Mapped {
            words,
            slots,
            buckets,
            seed,
            clock,
        }
    }
}

#[cfg(not(target_arch = "bpf"))]
impl<A: Address> SlotMemory<A> for Mapped<A> {
    fn buckets(&self) -> u32 {
        self.buckets
    }

    fn now_ns(&self) -> u64 {
        (self.clock)()
    }

    fn seed(&self) -> u64 {
        self.seed
    }

    fn word(&self, bucket: u32) -> Option<*mut u64> {
        // SAFETY: within the words `new` was given.
        (bucket < self.buckets).then(|| unsafe { self.words.add(bucket as usize) })
    }

    fn slot(&self, bucket: u32, index: u32) -> Option<*mut Slot<A>> {
        let at = bucket as usize * BUCKET_SLOTS as usize + index as usize;
        // SAFETY: within the slots `new` was given.
        (bucket < self.buckets && index < BUCKET_SLOTS).then(|| unsafe { self.slots.add(at) })
    }

    unsafe fn exchange(&self, word: *mut u64, old: u64, new: u64) -> bool {
        use core::sync::atomic::{AtomicU64, Ordering};
        // SAFETY: an aligned word of the table (as the caller promises), which everyone changes
        // atomically.
        let word = unsafe { AtomicU64::from_ptr(word) };
        word.compare_exchange(old, new, Ordering::SeqCst, Ordering::Relaxed)
            .is_ok()
    }

    unsafe fn flip(&self, word: *mut u64, bits: u64) {
        use core::sync::atomic::{AtomicU64, Ordering};
        // SAFETY: as in `exchange`.
        unsafe { AtomicU64::from_ptr(word) }.fetch_xor(bits, Ordering::SeqCst);
    }

    unsafe fn publish(&self, word: *mut u64, index: u32, _tag: u8) {
        // The agent's inserts (a carry, an import) are not its hot path: the flip of the held
        // bit is a release on every CPU, and one size of access to the word, as Rust asks.
        // SAFETY: as the caller promises.
        unsafe { self.flip(word, at_slot(slot_byte::HELD, index)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blocked_slot_is_neither_held_nor_free_nor_any_keys() {
        let word = blocked_from(6) | at_slot(slot_byte::HELD | 9, 1);
        assert_eq!(held_slots(word), at_slot(0x80, 1));
        assert_eq!(slots_named(bytes_equal(word, slot_byte::FREE)), 5);
        for tag in 1..=slot_byte::TAG {
            assert_eq!(bytes_tagged(word, tag) & !at_slot(0x80, 1), 0, "tag {tag}");
        }
        assert_eq!(blocked_from(BUCKET_SLOTS), 0);
    }
    use crate::{NatKeyV4, NatKeyV6, direction};

    const SEED: u64 = 0x0123_4567_89ab_cdef;

    #[test]
    fn keys_that_share_both_buckets_under_one_seed_do_not_under_another() {
        // What an attacker who knew the seed would send: keys that differ in their ports
        // alone, both of whose buckets are among the first four, three times as many as they
        // hold. Found for seed 0, the unseeded hash anyone can reckon.
        let buckets = 1u32 << 14;
        let in_victims = |place: &Place| place.buckets.iter().all(|&bucket| bucket < 4);
        let crafted: Vec<NatKeyV4> = (0..u32::MAX)
            .map(|n| NatKey {
                sport: n as u16,
                dport: (n >> 16) as u16,
                ..key_v4(0)
            })
            .filter(|key| in_victims(&Place::of(key, buckets, 0)))
            .take(3 * BUCKET_SLOTS as usize)
            .collect();
        assert_eq!(crafted.len(), 3 * BUCKET_SLOTS as usize);
        for seed in [SEED, 1, u64::MAX] {
            let still = crafted
                .iter()
                .filter(|key| in_victims(&Place::of(*key, buckets, seed)))
                .count();
            assert!(
                still <= 1,
                "seed {seed:#x}: {still} keys still in the four buckets"
            );
        }
    }

    #[test]
    fn a_table_of_a_power_of_two_words_has_no_seed_and_one_more_word_is_its_seed() {
        assert_eq!(buckets_in(words_for(1 << 10)), Some((1 << 10, true)));
        assert_eq!(seed_at(1 << 10), 1 << 10);
        assert_eq!(buckets_in(1 << 10), Some((1 << 10, false)));
        assert_eq!(buckets_in(3), Some((2, true)));
        for words in [0, 1, 6, 1000, (1 << 10) + 2] {
            assert_eq!(buckets_in(words), None, "{words}");
        }
    }

    fn key_v4(n: u32) -> NatKeyV4 {
        NatKey {
            saddr: [10, 0, (n >> 8) as u8, n as u8],
            daddr: [203, 0, 113, 7],
            sport: (n >> 16) as u16 ^ 0x1234,
            dport: 443u16.to_be(),
            proto: 6,
            direction: direction::EGRESS,
            _pad: [0; 2],
        }
    }

    #[test]
    fn bytes_equal_names_exactly_the_equal_bytes() {
        for byte in 0..=255u8 {
            for other in [0u8, 1, 0x7f, 0x80, 0x81, 0xfe, 0xff, byte ^ 1, byte ^ 0x80] {
                let word =
                    u64::from_le_bytes([other, byte, other, other, byte, other, other, byte]);
                let mask = bytes_equal(word, byte);
                for slot in 0..8 {
                    let named = mask & at_slot(0x80, slot) != 0;
                    assert_eq!(
                        named,
                        word.to_le_bytes()[slot as usize] == byte,
                        "{word:#x} {byte:#x}"
                    );
                }
                assert_eq!(mask & !ONES.wrapping_mul(0x80), 0);
            }
        }
    }

    #[test]
    fn a_tag_is_found_held_or_being_written_and_never_as_free() {
        let word = at_slot(slot_byte::HELD | 5, 2) | at_slot(5, 6) | at_slot(7, 3);
        let mask = bytes_tagged(word, 5);
        assert_eq!(slots_named(mask), 2);
        assert_eq!(first_slot(mask), Some(2));
        assert_eq!(first_slot(mask & !at_slot(0x80, 2)), Some(6));
        assert_eq!(first_slot(bytes_equal(word, slot_byte::FREE)), Some(0));
        assert_eq!(slots_named(bytes_equal(word, slot_byte::FREE)), 5);
        assert_eq!(first_slot(0), None);
    }

    #[test]
    fn a_table_made_for_some_halves_holds_them_five_slots_in_eight_in_an_even_number_of_buckets() {
        for halves in [1, 4, 16, 17, 1000, 4096, 524_288, 16_777_216, u32::MAX] {
            let buckets = buckets_for(halves);
            assert!(
                buckets >= 2 && buckets.is_multiple_of(2),
                "{halves}: {buckets}"
            );
            let slots = u64::from(buckets) * u64::from(BUCKET_SLOTS);
            assert!(
                slots * 5 >= u64::from(halves) * 8,
                "{halves}: {slots} slots"
            );
            assert!(
                slots * 5 < u64::from(halves) * 8 + 5 * 2 * u64::from(BUCKET_SLOTS),
                "{halves}: {slots} slots, more than the two buckets' rounding"
            );
            assert_eq!(buckets_in(words_for(buckets)), Some((buckets, true)));
            let rated = rated_halves(buckets);
            assert!(
                (u64::from(halves)..u64::from(halves) + 2 * 5).contains(&rated),
                "{halves}: rated {rated}"
            );
        }
        assert_eq!(buckets_for(524_288), 104_858);
    }

    #[test]
    fn a_table_of_any_even_size_spreads_its_keys_over_all_its_buckets() {
        for buckets in [6u32, 1000, 104_858] {
            let mut held = vec![0u32; buckets as usize];
            let keys = 64 * buckets;
            for n in 0..keys {
                let place = Place::of(&key_v4(n), buckets, SEED);
                assert_ne!(place.buckets[0], place.buckets[1]);
                for bucket in place.buckets {
                    held[bucket as usize] += 1;
                }
            }
            // 128 picks a bucket on average; a bucket the reduction skewed would take far
            // fewer or far more.
            let (least, most) = (held.iter().min().unwrap(), held.iter().max().unwrap());
            assert!(*least > 64 && *most < 200, "{buckets}: {least}..{most}");
        }
    }

    #[test]
    fn a_table_of_a_power_of_two_buckets_places_keys_by_the_hashs_low_bits_as_before() {
        for n in 0..10_000 {
            let key = key_v4(n);
            let hash = hash(&key, SEED);
            let place = Place::of(&key, 1 << 16, SEED);
            assert_eq!(place.buckets[0], hash as u32 & 0xffff);
            let second = (hash >> 32) as u32 & 0xffff;
            if second != place.buckets[0] {
                assert_eq!(place.buckets[1], second);
            }
        }
    }

    #[test]
    fn a_place_has_two_buckets_and_a_tag_that_is_never_free_nor_held() {
        for n in 0..100_000 {
            let place = Place::of(&key_v4(n), 1 << 16, SEED);
            assert_ne!(place.buckets[0], place.buckets[1]);
            assert!(place.buckets.iter().all(|&bucket| bucket < 1 << 16));
            assert!((1..=slot_byte::TAG).contains(&place.tag), "{place:?}");
        }
        // With two buckets, a key whose hash picks one bucket twice gets the other as well.
        let place = Place::of(&NatKeyV6::default(), 2, SEED);
        assert_eq!(place.buckets[0] ^ place.buckets[1], 1);
    }

    #[test]
    fn every_field_of_a_key_moves_its_hash() {
        let key = key_v4(7);
        let changed = [
            NatKey {
                saddr: [10, 0, 0, 8],
                ..key
            },
            NatKey {
                daddr: [203, 0, 113, 8],
                ..key
            },
            NatKey {
                sport: key.sport ^ 1,
                ..key
            },
            NatKey {
                dport: key.dport ^ 1,
                ..key
            },
            NatKey { proto: 17, ..key },
            NatKey {
                direction: direction::INGRESS,
                ..key
            },
        ];
        for other in changed {
            assert_ne!(hash(&other, SEED), hash(&key, SEED), "{other:?}");
        }
    }

    #[test]
    fn keys_that_differ_in_a_port_spread_over_the_buckets_and_tags() {
        // A pod's connections to one server differ in their source port alone.
        let buckets = 1u32 << 12;
        let keys = 8 * buckets;
        let mut load = vec![0u32; buckets as usize];
        let mut tags = [0u32; 128];
        for port in 0..keys {
            let key = NatKey {
                sport: port as u16,
                saddr: [10, 0, 0, (port >> 16) as u8],
                ..key_v4(0)
            };
            let place = Place::of(&key, buckets, SEED);
            load[place.buckets[0] as usize] += 1;
            tags[place.tag as usize] += 1;
        }
        // Eight a bucket on average; a fair hash stays well under three times that.
        assert!(load.iter().all(|&n| n < 24), "{:?}", load.iter().max());
        let mean = keys / 127;
        assert!(
            tags[1..].iter().all(|&n| n > mean / 2 && n < mean * 2),
            "{tags:?}"
        );
    }

    /// A table of `buckets` buckets on the heap, and its memory.
    struct Heap {
        words: Vec<u64>,
        slots: Vec<Slot<[u8; 4]>>,
    }

    impl Heap {
        fn new(buckets: u32) -> Heap {
            Heap {
                words: vec![0; buckets as usize],
                slots: vec![Slot::default(); (buckets * BUCKET_SLOTS) as usize],
            }
        }

        fn memory(&mut self) -> Mapped<[u8; 4]> {
            let buckets = self.words.len() as u32;
            // SAFETY: both vectors live as long as the test uses the memory, at their sizes.
            unsafe {
                Mapped::new(
                    self.words.as_mut_ptr(),
                    self.slots.as_mut_ptr(),
                    buckets,
                    SEED,
                    since_the_first_reading,
                )
            }
        }
    }

    /// A monotonic clock, in nanoseconds, for tables of the heap.
    fn since_the_first_reading() -> u64 {
        static FIRST: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
        FIRST
            .get_or_init(std::time::Instant::now)
            .elapsed()
            .as_nanos() as u64
    }

    fn entry(port: u16) -> NatEntry<[u8; 4]> {
        NatEntry {
            last_seen_ns: 1,
            addr: [192, 0, 2, 1],
            port,
            ..NatEntry::default()
        }
    }

    #[test]
    fn a_half_made_is_found_refused_again_and_gone_once_removed() {
        let mut heap = Heap::new(1 << 10);
        let memory = heap.memory();
        for n in 0..4_000 {
            assert_eq!(insert_new(&memory, &key_v4(n), &entry(n as u16)), Ok(()));
        }
        for n in 0..4_000 {
            let slot = find(&memory, &key_v4(n)).expect("made");
            // SAFETY: a slot of the heap table.
            assert_eq!(unsafe { (*slot).entry.port }, n as u16);
            assert_eq!(
                insert_new(&memory, &key_v4(n), &entry(0)),
                Err(Refused::Exists)
            );
        }
        assert!(find(&memory, &key_v4(4_000)).is_none());
        for n in (0..4_000).step_by(2) {
            assert!(remove(&memory, &key_v4(n)));
            assert!(!remove(&memory, &key_v4(n)), "removed twice");
        }
        for n in 0..4_000 {
            assert_eq!(find(&memory, &key_v4(n)).is_some(), n % 2 == 1);
        }
        let held: u32 = heap
            .words
            .iter()
            .map(|&word| slots_named(held_slots(word)))
            .sum();
        assert_eq!(held, 2_000);
    }

    #[test]
    fn reading_ahead_reads_the_slot_a_look_up_finds_unless_another_key_shares_its_tag() {
        let mut heap = Heap::new(1 << 9);
        let memory = heap.memory();
        let keys: Vec<NatKeyV4> = (0..2_400).map(key_v4).collect();
        for (n, key) in keys.iter().enumerate() {
            assert_eq!(insert_new(&memory, key, &entry(n as u16)), Ok(()));
        }
        let place = |key: &NatKeyV4| Place::of(key, 1 << 9, SEED);
        let mut alone = 0;
        for key in &keys {
            let (number, _) = look_up(&memory, key).expect("made");
            // Another key held in either of this one's buckets with the same tag: then the
            // slot read ahead may be that key's.
            let shares_its_tag = keys.iter().any(|other| {
                other != key
                    && place(other).tag == place(key).tag
                    && look_up(&memory, other)
                        .is_some_and(|(at, _)| place(key).buckets.contains(&(at / BUCKET_SLOTS)))
            });
            if !shares_its_tag {
                alone += 1;
                assert_eq!(read_ahead(&memory, key), number);
            }
        }
        // Some 6 % of keys share a tag with another in their buckets, at this fill.
        assert!(alone > 2_100, "{alone} of 2 400 keys alone with their tags");
        // A key no slot holds reads within the table all the same.
        assert!(read_ahead(&memory, &key_v4(5_000)) < (1 << 9) * BUCKET_SLOTS);
    }

    #[test]
    fn a_table_refuses_as_full_only_when_both_buckets_are() {
        let buckets = 1 << 8;
        let mut heap = Heap::new(buckets);
        let memory = heap.memory();
        let slots = buckets * BUCKET_SLOTS;
        let made = (0..slots)
            .filter(|&n| insert_new(&memory, &key_v4(n), &entry(1)) == Ok(()))
            .count() as u32;
        // Two choices of eight slots fill most of the table before the first refusal.
        assert!(made > slots * 3 / 4, "{made} of {slots}");
        let refused = insert_new(&memory, &key_v4(slots + 1), &entry(1));
        let place = Place::of(&key_v4(slots + 1), buckets, SEED);
        let full = place
            .buckets
            .iter()
            .all(|&b| bytes_equal(heap.words[b as usize], 0) == 0);
        assert_eq!(refused == Err(Refused::Full), full);
    }

    /// A table of the heap whose clock, 100 ns a reading, stands for another CPU: at its
    /// `at`th reading `then` decides that CPU's claim. `after_claim` runs after each claim
    /// this side makes, where another CPU's may come in between.
    struct OtherCpu<'a> {
        table: Mapped<[u8; 4]>,
        readings: core::cell::Cell<u32>,
        at: u32,
        then: &'a dyn Fn(&Mapped<[u8; 4]>),
        after_claim: &'a dyn Fn(&Mapped<[u8; 4]>),
    }

    impl SlotMemory<[u8; 4]> for OtherCpu<'_> {
        fn buckets(&self) -> u32 {
            self.table.buckets()
        }
        fn now_ns(&self) -> u64 {
            let reading = self.readings.get() + 1;
            self.readings.set(reading);
            if reading == self.at {
                (self.then)(&self.table);
            }
            u64::from(reading) * 100
        }
        fn seed(&self) -> u64 {
            self.table.seed()
        }
        fn word(&self, bucket: u32) -> Option<*mut u64> {
            self.table.word(bucket)
        }
        fn slot(&self, bucket: u32, index: u32) -> Option<*mut Slot<[u8; 4]>> {
            self.table.slot(bucket, index)
        }
        unsafe fn exchange(&self, word: *mut u64, old: u64, new: u64) -> bool {
            // SAFETY: as the caller promises.
            let claimed = unsafe { self.table.exchange(word, old, new) };
            if claimed {
                (self.after_claim)(&self.table);
            }
            claimed
        }
        unsafe fn flip(&self, word: *mut u64, bits: u64) {
            // SAFETY: as the caller promises.
            unsafe { self.table.flip(word, bits) }
        }
        unsafe fn publish(&self, word: *mut u64, index: u32, tag: u8) {
            // SAFETY: as the caller promises.
            unsafe { self.table.publish(word, index, tag) }
        }
    }

    const NEVER: u32 = u32::MAX;

    /// The first key from `key_v4(n)` on, whose first bucket, in the tests' tables of 64, is
    /// the lower of its two: where a claim waits for a rival (`outlasts`), and which an
    /// insert into two empty buckets takes.
    fn key_with_its_lower_bucket_first(n: u32) -> NatKeyV4 {
        (n..)
            .map(key_v4)
            .find(|key| {
                let [first, second] = Place::of(key, 1 << 6, SEED).buckets;
                first < second
            })
            .expect("half of all keys")
    }

    /// A case of another CPU's claim: what it is, the reading of the clock at which the other
    /// CPU decides it, how (given the table, the key and the claim's bucket), what the insert
    /// says, and the port of the half then found.
    type Case = (
        &'static str,
        u32,
        fn(&Mapped<[u8; 4]>, &NatKeyV4, u32),
        Result<(), Refused>,
        Option<u16>,
    );

    /// The three ways another CPU's claim may go, each named as a test tells it: published at
    /// the clock's reading `at` (this side's insert says `Exists`, and the other CPU's port
    /// 1111 is found), given back then (this side makes its half, of port 2222), or never
    /// decided (`Exists`, and no half).
    fn outcomes(
        at: u32,
        [published_case, given_back_case, never_case]: [&'static str; 3],
    ) -> [Case; 3] {
        [
            (
                published_case,
                at,
                |t, k, b| published(t, k, b, 1111),
                Err(Refused::Exists),
                Some(1111),
            ),
            (
                given_back_case,
                at,
                |t, _, b| given_back(t, b),
                Ok(()),
                Some(2222),
            ),
            (never_case, NEVER, |_, _, _| {}, Err(Refused::Exists), None),
        ]
    }

    /// The other CPU's claim of `key` in slot 0 of `bucket`: its byte, tagged, not held.
    fn claim_of(table: &Mapped<[u8; 4]>, key: &NatKeyV4, bucket: u32) {
        let tag = Place::of(key, table.buckets(), table.seed()).tag;
        // SAFETY: a word of the table.
        unsafe { *table.word(bucket).unwrap() |= at_slot(tag, 0) };
    }

    /// The other CPU's claim of `key` in slot 0 of `bucket` published, its half's port `port`.
    fn published(table: &Mapped<[u8; 4]>, key: &NatKeyV4, bucket: u32, port: u16) {
        let slot = table.slot(bucket, 0).unwrap();
        // SAFETY: a slot and a word of the table, which nothing else reads meanwhile.
        unsafe {
            *slot = Slot {
                key: *key,
                entry: entry(port),
            };
            *table.word(bucket).unwrap() |= at_slot(slot_byte::HELD, 0);
        }
    }

    /// The other CPU's claim in slot 0 of `bucket` given back.
    fn given_back(table: &Mapped<[u8; 4]>, bucket: u32) {
        // SAFETY: a word of the table.
        unsafe { *table.word(bucket).unwrap() &= !at_slot(0xff, 0) };
    }

    fn port_of(memory: &impl SlotMemory<[u8; 4]>, key: &NatKeyV4) -> Option<u16> {
        // SAFETY: a slot of the heap table.
        find(memory, key).map(|slot| unsafe { (*slot).entry.port })
    }

    #[test]
    fn an_insert_that_finds_its_key_being_written_waits_until_it_is_decided() {
        let key = key_v4(7);
        let first = |table: &Mapped<[u8; 4]>| Place::of(&key, table.buckets(), SEED).buckets[0];
        let cases = outcomes(
            3,
            [
                "published: the other CPU's half is found",
                "given back: this side makes the half",
                "never decided: taken as another's after the wait",
            ],
        );
        for (case, at, decide, made, port) in cases {
            let mut heap = Heap::new(1 << 6);
            let table = heap.memory();
            claim_of(&table, &key, first(&table));
            let memory = OtherCpu {
                table,
                readings: Default::default(),
                at,
                then: &|table| decide(table, &key, first(table)),
                after_claim: &|_| {},
            };
            assert_eq!(insert_new(&memory, &key, &entry(2222)), made, "{case}");
            assert_eq!(port_of(&memory, &key), port, "{case}");
            let waited = u64::from(memory.readings.get()) * 100;
            if at == NEVER {
                assert!(waited > CLAIM_DECIDED_WITHIN_NS, "{case}: {waited} ns");
            } else {
                assert_eq!(memory.readings.get(), at, "{case}: read on once decided");
            }
        }
    }

    #[test]
    fn a_claim_in_a_keys_lower_bucket_waits_for_a_rival_in_its_higher_to_decide() {
        let key = key_with_its_lower_bucket_first(9);
        let place = |table: &Mapped<[u8; 4]>| Place::of(&key, table.buckets(), SEED).buckets;
        let cases = outcomes(
            2,
            [
                "the rival published first: this claim yields to it",
                "the rival yields: this claim stands",
                "the rival never decides: this claim yields",
            ],
        );
        for (case, at, decide, made, port) in cases {
            let mut heap = Heap::new(1 << 6);
            let memory = OtherCpu {
                table: heap.memory(),
                readings: Default::default(),
                at,
                then: &|table| decide(table, &key, place(table)[1]),
                after_claim: &|table| claim_of(table, &key, place(table)[1]),
            };
            assert_eq!(insert_new(&memory, &key, &entry(2222)), made, "{case}");
            assert_eq!(port_of(&memory, &key), port, "{case}");
            let first = load(memory.word(place(&memory.table)[0]).unwrap());
            assert_eq!(
                held_slots(first) != 0,
                made.is_ok(),
                "{case}: this side's claim published, or given back"
            );
        }
    }

    #[test]
    fn a_claim_in_a_keys_higher_bucket_yields_to_a_rival_in_its_lower_and_waits_to_find_it() {
        let key = key_with_its_lower_bucket_first(11);
        let mut heap = Heap::new(1 << 6);
        let table = heap.memory();
        let place = Place::of(&key, table.buckets(), SEED);
        let [first, second] = place.buckets;
        // Another key's half in the lower bucket, so that this side claims in the higher.
        let another_tag = place.tag % slot_byte::TAG + 1;
        // SAFETY: a word of the table.
        unsafe { *table.word(first).unwrap() |= at_slot(slot_byte::HELD | another_tag, 3) };
        let memory = OtherCpu {
            table,
            readings: Default::default(),
            at: 2,
            then: &|table| published(table, &key, first, 1111),
            after_claim: &|table| claim_of(table, &key, first),
        };
        assert_eq!(
            insert_new(&memory, &key, &entry(2222)),
            Err(Refused::Exists)
        );
        assert_eq!(port_of(&memory, &key), Some(1111), "the rival's, published");
        let second_word = load(memory.word(second).unwrap());
        assert_eq!(second_word, 0, "this side's claim given back");
    }

    #[test]
    fn two_threads_making_the_same_keys_make_each_once() {
        use std::sync::Barrier;
        let mut heap = Heap::new(1 << 12);
        let memory = heap.memory();
        // The heap outlives the threads, which the scope joins.
        struct Shared(Mapped<[u8; 4]>);
        // SAFETY: the memory is changed by the table's rules alone, which are for many CPUs.
        unsafe impl Sync for Shared {}
        impl Shared {
            fn table(&self) -> &Mapped<[u8; 4]> {
                &self.0
            }
        }
        let shared = Shared(memory);
        let keys = 20_000u32;
        let barrier = Barrier::new(2);
        let made: Vec<Vec<u32>> = std::thread::scope(|scope| {
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    scope.spawn(|| {
                        barrier.wait();
                        (0..keys)
                            .filter(|&n| {
                                insert_new(shared.table(), &key_v4(n), &entry(1)) == Ok(())
                            })
                            .collect()
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        });
        let mut all: Vec<u32> = made.concat();
        all.sort_unstable();
        let before = all.len();
        all.dedup();
        assert_eq!(all.len(), before, "a key made twice");
        for n in 0..keys {
            let found = find(shared.table(), &key_v4(n)).is_some();
            assert_eq!(found, all.binary_search(&n).is_ok(), "key {n}");
        }
        assert!(
            all.len() > keys as usize * 98 / 100,
            "{} of {keys} made",
            all.len()
        );
        for &word in &heap.words {
            let free = slots_named(bytes_equal(word, slot_byte::FREE));
            assert_eq!(
                free + slots_named(held_slots(word)),
                BUCKET_SLOTS,
                "a claim left in {word:#x}"
            );
        }
    }
}

//! Where the halves of the NAT table's flows are kept: the one place the programs find, make,
//! remove and walk them. Each family's halves are in its slot table (`masq_ebpf::slot_table`)
//! in the object built with it (`maps::in_slot_table`, a constant), for kernels with BPF
//! atomics on map values (5.12); otherwise, elements of a kernel hash table keyed by `NatKey`
//! (`nat_v4`, `nat_v6`).

use core::{
    ffi::c_void,
    intrinsics::{AtomicOrdering, atomic_cxchg, atomic_xor},
    marker::PhantomData,
};

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_ktime_get_ns, generated::bpf_for_each_map_elem},
};
use masq_ebpf::{
    NatEntry, NatKey, direction,
    slot_table::{self, BUCKET_SLOTS, Refused, Slot, SlotMemory, at_slot, held_slots, slot_byte},
};

use crate::{family::Family, maps};

/// Why a half could not be made: the table holds a half of that key (`exists`), another
/// flow's or the same flow's made first; or there is no room for it. The hash table's own
/// error code, as its helper gives it.
pub struct InsertError(i32);

const EEXIST: i32 = -17;
const E2BIG: i32 = -7;
const ENOENT: i32 = -2;

impl InsertError {
    #[inline(always)]
    pub fn exists(&self) -> bool {
        self.0 == EEXIST
    }
}

/// The family's slot table, as the maps reach it.
struct MapSlots<F>(PhantomData<F>);

impl<F: Family> SlotMemory<F::Addr> for MapSlots<F> {
    #[inline(always)]
    fn buckets(&self) -> u32 {
        F::slot_buckets()
    }

    /// The precise clock, whichever the flows are stamped with: the coarse one moves a tick at
    /// a time, hundreds of times the wait.
    #[inline(always)]
    fn now_ns(&self) -> u64 {
        // SAFETY: the helper has no preconditions.
        unsafe { bpf_ktime_get_ns() }
    }

    /// The agent's global, which it also keeps in the table: the global is on a line every
    /// packet reads, where the table's own word would be a line, and a page, more for a cold
    /// packet's lookup.
    #[inline(always)]
    fn seed(&self) -> u64 {
        F::slot_seed()
    }

    #[inline(always)]
    fn word(&self, bucket: u32) -> Option<*mut u64> {
        F::slot_words().get_ptr_mut(bucket)
    }

    #[inline(always)]
    fn slot(&self, bucket: u32, index: u32) -> Option<*mut Slot<F::Addr>> {
        F::slots().get_ptr_mut(bucket.wrapping_mul(BUCKET_SLOTS).wrapping_add(index))
    }

    #[inline(always)]
    unsafe fn exchange(&self, word: *mut u64, old: u64, new: u64) -> bool {
        // SAFETY: a map value's aligned u64, which both sides change by locked instructions.
        unsafe {
            atomic_cxchg::<u64, { AtomicOrdering::SeqCst }, { AtomicOrdering::Relaxed }>(
                word, old, new,
            )
        }
        .1
    }

    #[inline(always)]
    unsafe fn flip(&self, word: *mut u64, bits: u64) {
        // SAFETY: as in `exchange`.
        unsafe {
            atomic_xor::<u64, u64, { AtomicOrdering::SeqCst }>(word, bits);
        }
    }

    /// A plain store of the byte where the CPU's stores are seen in order (x86), where it is
    /// a release: the locked xor elsewhere waits for the slot's line, which the insert has just
    /// written and most often had to fetch, and so held each new flow's packet up by two
    /// misses (docs/bench/profiles.md, "The first packet").
    #[inline(always)]
    unsafe fn publish(&self, word: *mut u64, index: u32, tag: u8) {
        if maps::stores_in_order() {
            // The index masked for the verifier, which knows no bound of it; the bytes of a
            // word are its slots' from the least significant, the first in memory (bpfel).
            let byte = unsafe { word.cast::<u8>().add((index % BUCKET_SLOTS) as usize) };
            // SAFETY: a byte of a map value's word, which only this CPU changes meanwhile.
            unsafe { core::ptr::write_volatile(byte, slot_byte::HELD | tag) };
        } else {
            // SAFETY: as the caller promises.
            unsafe { self.flip(word, at_slot(slot_byte::HELD, index)) };
        }
    }
}

#[inline(always)]
fn slots<F: Family>() -> MapSlots<F> {
    MapSlots(PhantomData)
}

/// The half of `key`, written in place by whoever holds it: the data path's updates of a half
/// race benignly, each writing what a recent packet saw.
#[inline(always)]
pub fn find<F: Family>(key: &NatKey<F::Addr>) -> Option<*mut NatEntry<F::Addr>> {
    if F::in_slot_table() {
        return find_slot::<F>(key);
    }
    F::nat().get_ptr_mut(key)
}

/// What the family's global lookup says of a key no slot holds.
const NOT_HELD: i64 = -1;

/// The first slots of the two buckets a full slot table looks at to make room: those of the
/// half this CPU last found no room for (`PortRequest::no_room_for`), numbered as
/// `flow_of_slot` takes them.
#[inline(always)]
pub fn slots_without_room<F: Family>() -> [u32; 2] {
    let Some(request) = F::port_request().get_ptr(0) else {
        return [0; 2];
    };
    let memory = slots::<F>();
    // SAFETY: this CPU's slot of a per-CPU map; the key is only hashed.
    slot_table::Place::of(
        unsafe { &(*request).no_room_for },
        memory.buckets(),
        memory.seed(),
    )
    .buckets
    .map(|bucket| bucket.wrapping_mul(BUCKET_SLOTS))
}

/// Notes that the slot table had no room for `key`, for this CPU's early drop to make some,
/// and its next port search to try first (`PortRequest::no_room_for`).
#[inline(always)]
fn note_no_room<F: Family>(key: &NatKey<F::Addr>) {
    if let Some(request) = F::port_request().get_ptr_mut(0) {
        // SAFETY: this CPU's slot of a per-CPU map; a tc program runs to its end on one CPU.
        unsafe { (*request).no_room_for = *key };
    }
}

/// Writes into `key` the egress key of the flow whose half slot `number` of the slot table
/// holds, and says whether it holds one. The key is copied whole, by plain loads of the
/// slot's aligned words, and turned round in place where the half is a reply's: volatile
/// copies of the key and entry went a byte at a time, each byte its own spilled register, and
/// took the frame of IPv6's early drop past the verifier's 512 bytes. Another CPU's change
/// may tear the copy into a key no flow has.
#[inline(always)]
pub fn flow_of_slot<F: Family>(number: u32, key: &mut NatKey<F::Addr>) -> bool {
    let Some(slot) = slot_table::held_at(&slots::<F>(), number) else {
        return false;
    };
    // SAFETY: a slot of the map, which another CPU may write meanwhile (see above).
    unsafe {
        *key = core::ptr::read(&raw const (*slot).key);
        if key.direction != direction::EGRESS {
            // The reply half's remote end is the flow's destination, and its entry holds the
            // pod's end.
            (key.daddr, key.dport) = (key.saddr, key.sport);
            key.saddr = core::ptr::read(&raw const (*slot).entry.addr);
            key.sport = core::ptr::read(&raw const (*slot).entry.port);
            key.direction = direction::EGRESS;
        }
    }
    true
}

/// A lookup is the family's global function, which the verifier walks once, where a static
/// one it would walk whole at every lookup on every path (some hundreds of instructions each,
/// where the hash table's helper is one), past its million. It says the slot's number, or
/// `NOT_HELD`.
#[inline(always)]
fn find_slot<F: Family>(key: &NatKey<F::Addr>) -> Option<*mut NatEntry<F::Addr>> {
    let number = (F::FIND_SLOT)(key);
    let slot = F::slots().get_ptr_mut(u32::try_from(number).ok()?)?;
    // SAFETY: a slot of the map; its entry is a field of it.
    Some(unsafe { &raw mut (*slot).entry })
}

// The slot table's operations are global functions, each verified once on its own (their
// pointer arguments need Linux 5.12, as their atomics do). Each is written once, here; the
// family's are named below. The verifier takes a global function's pointer for one that may be
// null (6.8), so each is tested: `nonnull` makes of it the reference its callers passed.
macro_rules! slot_operations {
    ($family:ty, $find:ident, $insert:ident, $remove:ident) => {
        /// `slot_table::look_up` for the family: the slot's number, or `NOT_HELD`.
        #[unsafe(no_mangle)]
        #[inline(never)]
        pub extern "C" fn $find(key: *const NatKey<<$family as Family>::Addr>) -> i64 {
            nonnull(key)
                .and_then(|key| slot_table::look_up(&slots::<$family>(), key))
                .map_or(NOT_HELD, |(number, _)| i64::from(number))
        }

        /// `slot_table::insert_new` for the family: 0, or the hash table's error code for the
        /// refusal.
        #[unsafe(no_mangle)]
        #[inline(never)]
        pub extern "C" fn $insert(
            key: *const NatKey<<$family as Family>::Addr>,
            entry: *const NatEntry<<$family as Family>::Addr>,
        ) -> i32 {
            let (Some(key), Some(entry)) = (nonnull(key), nonnull(entry)) else {
                return E2BIG;
            };
            match slot_table::insert_new(&slots::<$family>(), key, entry) {
                Ok(()) => 0,
                Err(Refused::Exists) => EEXIST,
                Err(Refused::Full) => E2BIG,
            }
        }

        /// `slot_table::remove` for the family: 0, or the hash table's error code for a half
        /// it did not hold.
        #[unsafe(no_mangle)]
        #[inline(never)]
        pub extern "C" fn $remove(key: *const NatKey<<$family as Family>::Addr>) -> i32 {
            let Some(key) = nonnull(key) else {
                return ENOENT;
            };
            if slot_table::remove(&slots::<$family>(), key) {
                0
            } else {
                ENOENT
            }
        }
    };
}

/// The reference a caller passed as `pointer`.
#[inline(always)]
fn nonnull<T>(pointer: *const T) -> Option<&'static T> {
    // SAFETY: the callers pass references, valid for the call.
    unsafe { pointer.as_ref() }
}

slot_operations!(
    crate::family::V4,
    masq_find_slot_v4,
    masq_insert_slot_v4,
    masq_remove_slot_v4
);
slot_operations!(
    crate::family::V6,
    masq_find_slot_v6,
    masq_insert_slot_v6,
    masq_remove_slot_v6
);

/// The half of `key`, to read only.
///
/// # Safety
/// Another CPU may update or remove the half meanwhile: what is read must be copied before
/// anything is removed, or only compared.
#[inline(always)]
pub unsafe fn read<F: Family>(key: &NatKey<F::Addr>) -> Option<&'static NatEntry<F::Addr>> {
    if F::in_slot_table() {
        // SAFETY: as the caller promises; the map lives as long as the program.
        return find::<F>(key).map(|entry| unsafe { &*entry });
    }
    // SAFETY: as the caller promises.
    unsafe { F::nat().get(key) }
}

/// Makes the half of `key` if the table holds none: of two CPUs that make the same key at
/// once, at most one does, and the other is told it `exists`; that is how two flows never get
/// one port.
#[inline(always)]
pub fn insert_new<F: Family>(
    key: &NatKey<F::Addr>,
    entry: &NatEntry<F::Addr>,
) -> Result<(), InsertError> {
    if F::in_slot_table() {
        // A refusal for want of room is noted here, and not in the global function, whose
        // frame, in the deepest chain, would spill the key's pointer past 6.1's 512 bytes.
        return match (F::INSERT_SLOT)(key, entry) {
            0 => Ok(()),
            E2BIG => {
                note_no_room::<F>(key);
                Err(InsertError(E2BIG))
            }
            code => Err(InsertError(code)),
        };
    }
    // By reference: copies for the helper would take the callers' frames past the verifier's
    // limit.
    F::nat()
        .insert(key, entry, BPF_NOEXIST as u64)
        .map_err(InsertError)
}

/// Removes the half of `key`; an error if the table no longer held it: another CPU, or the
/// sweep, removed it first. (The hash table's helper's result as it is: made into a `bool`, or
/// an error of another type, where most callers ignore it, it costs `masq_reserve_port_v6` 16
/// bytes of stack.)
#[inline(always)]
pub fn remove<F: Family>(key: &NatKey<F::Addr>) -> Result<(), i32> {
    if F::in_slot_table() {
        return match (F::REMOVE_SLOT)(key) {
            0 => Ok(()),
            code => Err(code),
        };
    }
    F::nat().remove(key)
}

/// What `walk` does with each half: 0 to go on, 1 to stop. The key and entry are valid for the
/// call; the entry may be compared by address with what `read` gives for the key.
pub trait Visit<F: Family> {
    fn visit(key: &NatKey<F::Addr>, entry: &NatEntry<F::Addr>) -> i64;

    /// Whether `visit` looks up the other half of this one; if so, the slot table's walk reads
    /// its lines ahead of the visit (`read_ahead`).
    fn looks_up_other_half(_key: &NatKey<F::Addr>, _entry: &NatEntry<F::Addr>) -> bool {
        false
    }

    /// Called by the slot table's walk before it visits bucket `first` and the
    /// `READ_AHEAD_BUCKETS - 1` after it. Where `visit` looks other halves up, a global function
    /// that calls `read_ahead`: the verifier walks it once, where inline it walked it at every
    /// bucket (the sweep program's instructions from some 160 000 to 570 000).
    fn before_buckets(_first: u32) {}
}

/// Buckets whose halves' other halves the slot table's walk reads ahead together
/// (`read_ahead`): eight and sixteen read as fast in `sweep_bench`, four slower.
pub const READ_AHEAD_BUCKETS: u32 = 8;

/// Calls `V::visit` for each half the table holds (`bpf_for_each_map_elem`, Linux 5.13: over the
/// hash table's elements, or over the slot table's words and the slots they hold). Halves removed
/// or made during the walk may be skipped or visited twice: a removed element or slot may be
/// taken again at once, elsewhere.
#[inline(always)]
pub fn walk<F: Family, V: Visit<F>>() {
    // The helper wants a context on the stack, even where the callback needs none.
    let mut unused = 0u64;
    let (map, callback): (*const c_void, *mut c_void) = if F::in_slot_table() {
        (
            core::ptr::from_ref(F::slot_words()).cast(),
            visit_bucket::<F, V> as *mut c_void,
        )
    } else {
        (
            core::ptr::from_ref(F::nat()).cast(),
            visit_element::<F, V> as *mut c_void,
        )
    };
    // SAFETY: both maps are the object's own, and each callback a static function of the
    // signature the helper calls for its map, which the verifier checks against the map's key
    // and value.
    unsafe {
        bpf_for_each_map_elem(
            map.cast_mut(),
            callback,
            core::ptr::from_mut(&mut unused).cast(),
            0,
        );
    }
}

/// The hash table's callback: each element is a half.
extern "C" fn visit_element<F: Family, V: Visit<F>>(
    _table: *mut c_void,
    key: *const NatKey<F::Addr>,
    entry: *const NatEntry<F::Addr>,
    _unused: *mut u64,
) -> i64 {
    // SAFETY: the helper passes the element's key and value, valid for the call.
    V::visit(unsafe { &*key }, unsafe { &*entry })
}

/// The slot table's callback: each word is a bucket, whose held slots are halves.
extern "C" fn visit_bucket<F: Family, V: Visit<F>>(
    _words: *mut c_void,
    bucket: *const u32,
    word: *const u64,
    _unused: *mut u64,
) -> i64 {
    // SAFETY: the helper passes the element's index and value, valid for the call.
    let (bucket, word) = unsafe { (*bucket, core::ptr::read_volatile(word)) };
    // The word after the buckets' is the seed.
    if bucket >= F::slot_buckets() {
        return 0;
    }
    let memory = slots::<F>();
    if bucket % READ_AHEAD_BUCKETS == 0 {
        V::before_buckets(bucket);
    }
    let held = held_slots(word);
    for index in 0..BUCKET_SLOTS {
        if held & at_slot(0x80, index) == 0 {
            continue;
        }
        let Some(slot) = memory.slot(bucket, index) else {
            return 1;
        };
        // SAFETY: a slot of the map, valid as long as the program.
        let (key, entry) = unsafe { (&(*slot).key, &(*slot).entry) };
        if V::visit(key, entry) != 0 {
            return 1;
        }
    }
    0
}

/// Reads the lines of the other half of each half in `READ_AHEAD_BUCKETS` buckets from `first`
/// that `V::visit` looks up (`slot_table::read_ahead`), so that they come in together, where
/// the visits' look-ups, one after the other, would each wait for its own. The other halves
/// lie anywhere in the table, most often in memory: some 180 ns a line here, and misses that
/// do not wait on each other overlap (docs/bench/profiles.md, "Pages or lines"). A sweep that
/// removes every flow it meets took 300 ns a flow, and takes 170 (`sweep_bench`).
#[inline(always)]
pub fn read_ahead<F: Family, V: Visit<F>>(first: u32) {
    let memory = slots::<F>();
    // Counted from 0 for the verifier, which knows nothing of `first`.
    for ahead in 0..READ_AHEAD_BUCKETS {
        let bucket = first.wrapping_add(ahead);
        if bucket >= F::slot_buckets() {
            return;
        }
        let Some(word) = memory.word(bucket) else {
            return;
        };
        // SAFETY: a word of the map, read as `visit_bucket` reads it.
        let mut held = held_slots(unsafe { core::ptr::read_volatile(word) });
        // One turn a held slot, as `slot_table::held_in` turns: the verifier's states of
        // each turn match.
        for _ in 0..BUCKET_SLOTS {
            let Some(index) = slot_table::first_slot(held) else {
                break;
            };
            held &= held - 1;
            let Some(slot) = memory.slot(bucket, index) else {
                return;
            };
            // SAFETY: a slot of the map, only read; the visit looks the other half up again.
            let (key, entry) = unsafe { (&(*slot).key, &(*slot).entry) };
            if V::looks_up_other_half(key, entry) {
                slot_table::read_ahead(&memory, &key.reverse(entry));
            }
        }
    }
}

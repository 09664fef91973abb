//! A family's NAT table as the agent reads and writes it: both halves of every flow the
//! programs know, where the programs keep them (masq-ebpf's `flow_table`): the slot table
//! (`masq_ebpf::slot_table`), which the agent maps into its memory and changes by the same
//! rules as the programs, or a kernel hash table keyed by `NatKey`. The one place the agent
//! touches a half; and the clock its entries are stamped by.

use std::{
    num::NonZeroUsize,
    os::fd::AsFd,
    ptr::NonNull,
    sync::{Arc, Mutex},
};

use anyhow::Context as _;
use aya::{
    Pod,
    maps::{Array, HashMap as BpfHashMap, IterableMap as _, Map, MapData, MapError},
};
use masq_ebpf::{
    Address, NatEntry, NatKey, map_names,
    slot_table::{self, BUCKET_SLOTS, Mapped, Refused, Slot, SlotMemory, at_slot, held_slots},
};
use nix::sys::mman::{MapFlags, ProtFlags, mmap, munmap};

use super::batch;

/// The maps a family's NAT table may be kept in, by their names: the hash table, and the slot
/// table's slots and words.
pub struct TableMaps {
    pub hash: &'static str,
    pub slots: &'static str,
    pub words: &'static str,
}

pub const V4_MAPS: TableMaps = TableMaps {
    hash: map_names::NAT_V4,
    slots: map_names::NAT_SLOTS_V4,
    words: map_names::NAT_SLOT_WORDS_V4,
};

pub const V6_MAPS: TableMaps = TableMaps {
    hash: map_names::NAT_V6,
    slots: map_names::NAT_SLOTS_V6,
    words: map_names::NAT_SLOT_WORDS_V6,
};

/// A family's NAT table, entry by entry.
pub type Table<A> = Vec<(NatKey<A>, NatEntry<A>)>;

/// A family's NAT table.
pub struct NatTable<A: Address> {
    kind: Kind<A>,
}

enum Kind<A: Address> {
    Hash(BpfHashMap<MapData, NatKey<A>, NatEntry<A>>),
    Slots(SlotTable<A>),
}

/// The slot table's two arrays, which the agent maps into its memory only while it uses them:
/// the kernel maps every page of a BPF array at `mmap`, and the slots (32 MiB at the default
/// size) would count as the agent's own memory for as long as they are mapped.
struct SlotTable<A: Address> {
    slots: MapData,
    words: Array<MapData, u64>,
    buckets: u32,
    /// Whether the word after the buckets' is the table's seed (`slot_table::seed_at`); a
    /// table pinned before seeds has none.
    seeded: bool,
    /// The mapping `NatTable::keep_mapped` holds for a run of operations; without one, each
    /// operation maps the arrays for itself.
    kept: KeptMapping<A>,
}

/// Where a slot table's kept mapping is, shared with the guard that keeps it.
type KeptMapping<A> = Arc<Mutex<Kept<A>>>;

/// Whether a run of operations keeps the slot table mapped (`NatTable::keep_mapped`).
enum Kept<A: Address> {
    /// No: each operation maps the table for itself.
    No,
    /// Yes, from the first operation that maps it: a run that has nothing to do maps nothing.
    Wanted,
    Mapped(Arc<MappedSlots<A>>),
}

/// Both arrays mapped shared, and the table as `slot_table` reaches it through them.
struct MappedSlots<A: Address> {
    _slots: Mapping,
    _words: Mapping,
    memory: Mapped<A>,
}

/// A shared mapping of an array map's values.
struct Mapping {
    at: NonNull<std::ffi::c_void>,
    len: NonZeroUsize,
}

impl Mapping {
    fn of(map: &MapData, len: usize, what: &str) -> anyhow::Result<Mapping> {
        let len = NonZeroUsize::new(len).with_context(|| format!("{what}: an empty array"))?;
        // SAFETY: a fresh shared mapping of the map's values, which the kernel keeps valid
        // while mapped; nothing else in this process is placed there.
        let at = unsafe {
            mmap(
                None,
                len,
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_SHARED,
                map.fd().as_fd(),
                0,
            )
        }
        .with_context(|| format!("mapping {what}"))?;
        Ok(Mapping { at, len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping `of` made, used no more.
        let _ = unsafe { munmap(self.at, self.len.get()) };
    }
}

// SAFETY: the slot table is shared with the kernel's CPUs already, and changed by rules made for
// many writers; the agent's threads are more of them.
unsafe impl<A: Address> Send for MappedSlots<A> {}
unsafe impl<A: Address> Sync for MappedSlots<A> {}

impl<A> NatTable<A>
where
    A: Address,
    NatKey<A>: Pod,
    NatEntry<A>: Pod,
{
    /// The family's table, from its maps: the slot table where the agent sized it for the
    /// halves (more than one entry), the hash table otherwise.
    pub fn from_maps(hash: Map, slot_table: Option<(Map, Map)>) -> anyhow::Result<NatTable<A>> {
        if let Some((slots, words)) = slot_table
            && let Some(table) = NatTable::from_slot_maps(slots, words)?
        {
            return Ok(table);
        }
        Ok(NatTable {
            kind: Kind::Hash(BpfHashMap::try_from(hash)?),
        })
    }

    /// The slot table in `slots` and `words`; `None` where the agent sized it to one entry,
    /// unused.
    pub fn from_slot_maps(slots: Map, words: Map) -> anyhow::Result<Option<NatTable<A>>> {
        let words: Array<MapData, u64> = Array::try_from(words)?;
        if words.len() <= 1 {
            return Ok(None);
        }
        let Some((buckets, seeded)) = slot_table::buckets_in(words.len()) else {
            anyhow::bail!(
                "a slot table of {} words: not an even number of buckets and its seed, nor a power of two of buckets",
                words.len()
            );
        };
        // Its values are read and written through the mapping alone, field by field: the
        // slot's own padding (it is a cache line) is never copied.
        let Map::Array(slots) = slots else {
            anyhow::bail!("the NAT slots are not an array");
        };
        let info = slots.info()?;
        if info.value_size() as usize != size_of::<Slot<A>>()
            || info.max_entries() != buckets * BUCKET_SLOTS
        {
            anyhow::bail!(
                "a slot table of {} slots of {} bytes in {buckets} buckets: not {BUCKET_SLOTS} slots of {} a bucket",
                info.max_entries(),
                info.value_size(),
                size_of::<Slot<A>>()
            );
        }
        Ok(Some(NatTable {
            kind: Kind::Slots(SlotTable {
                slots,
                words,
                buckets,
                seeded,
                kept: Arc::new(Mutex::new(Kept::No)),
            }),
        }))
    }

    /// Keeps the slot table mapped until the guard drops, for a run of operations that would
    /// otherwise map it each (the carry's, flow by flow); a hash table needs nothing.
    pub fn keep_mapped(&self) -> anyhow::Result<KeptMapped<A>> {
        // (A `Result`, for whatever keeping may come to need: mapping happens at first use.)
        let Kind::Slots(table) = &self.kind else {
            return Ok(KeptMapped { kept: None });
        };
        *table.kept.lock().expect("no holder panics") = Kept::Wanted;
        Ok(KeptMapped {
            kept: Some(Arc::clone(&table.kept)),
        })
    }

    /// Every half: read whole with batch commands from a hash table; copied slot by slot from
    /// the slot table's held slots.
    pub fn read_all(&self) -> anyhow::Result<Table<A>> {
        match &self.kind {
            Kind::Hash(map) => batch::lookup_all(map.map()).context("reading the NAT table"),
            Kind::Slots(table) => table.held(),
        }
    }

    /// Whether the table holds no half: the kernel finds a hash table's first key by reading
    /// the bucket heads alone, in about a tenth of the time a sweep's walk of the same empty
    /// buckets takes (see docs/bench/profiles.md, "The idle agent"); the slot table's words are
    /// read in the agent's memory.
    pub fn holds_nothing(&self) -> anyhow::Result<bool> {
        match &self.kind {
            Kind::Hash(map) => match map.keys().next() {
                None => Ok(true),
                Some(Ok(_)) => Ok(false),
                Some(Err(err)) => Err(err).context("looking for the NAT table's first entry"),
            },
            Kind::Slots(table) => table.holds_nothing(),
        }
    }

    /// Keeps `seed`, the one the programs were given, in a slot table (`SlotTable::keep_seed`),
    /// before any half goes in; a hash table's is the kernel's.
    pub fn keep_seed(&self, seed: u64) -> anyhow::Result<()> {
        match &self.kind {
            Kind::Hash(_) => Ok(()),
            Kind::Slots(table) => table.keep_seed(seed),
        }
    }

    /// The slot table's seed: 0 where it has none, or is a hash table.
    pub fn slot_seed(&self) -> anyhow::Result<u64> {
        match &self.kind {
            Kind::Hash(_) => Ok(0),
            Kind::Slots(table) => Ok(table.seed_in(&table.mapped_words()?)),
        }
    }

    /// How many halves the table is made to hold: the hash table's entries, and no more; the
    /// slot table's rating (`slot_table::rated_halves`, the size the agent was asked for),
    /// and up to 8/5 of it.
    pub fn capacity(&self) -> anyhow::Result<usize> {
        Ok(match &self.kind {
            Kind::Hash(map) => map.map().info()?.max_entries() as usize,
            Kind::Slots(table) => slot_table::rated_halves(table.buckets) as usize,
        })
    }

    /// The half of `key`, if the table holds it.
    pub fn get(&self, key: &NatKey<A>) -> Option<NatEntry<A>> {
        match &self.kind {
            Kind::Hash(map) => map.get(key, 0).ok(),
            Kind::Slots(table) => {
                let mapped = table.mapped().ok()?;
                // SAFETY: a slot of the mapping, copied out while it is mapped.
                slot_table::find(&mapped.memory, key)
                    .map(|slot| unsafe { std::ptr::read_volatile(slot).entry })
            }
        }
    }

    /// The bucket of the slot table that holds the half of `key`, if it holds it: for tests
    /// that need to know where halves meet. `None` in a hash table.
    #[cfg(feature = "testbed")]
    pub fn bucket_of(&self, key: &NatKey<A>) -> Option<u32> {
        let Kind::Slots(table) = &self.kind else {
            return None;
        };
        let mapped = table.mapped().ok()?;
        slot_table::look_up(&mapped.memory, key).map(|(number, _)| number / BUCKET_SLOTS)
    }

    /// Makes the half of `key` if the table holds none; `exists` says which refusal it was.
    pub fn insert_new(&mut self, key: &NatKey<A>, entry: &NatEntry<A>) -> Result<(), MapError> {
        match &mut self.kind {
            Kind::Hash(map) => map.insert(key, entry, BPF_NOEXIST),
            Kind::Slots(table) => {
                let mapped = table.mapped().map_err(unmapped)?;
                slot_table::insert_new(&mapped.memory, key, entry).map_err(|refused| {
                    syscall_error(match refused {
                        Refused::Exists => libc::EEXIST,
                        Refused::Full => libc::E2BIG,
                    })
                })
            }
        }
    }

    /// Writes `entry` under `key`, over whatever the table held: as no program would, for
    /// tests that plant a state.
    pub fn write(&mut self, key: &NatKey<A>, entry: &NatEntry<A>) -> Result<(), MapError> {
        match &mut self.kind {
            Kind::Hash(map) => map.insert(key, entry, 0),
            Kind::Slots(table) => {
                let mapped = table.mapped().map_err(unmapped)?;
                let Some(slot) = slot_table::find(&mapped.memory, key) else {
                    return self.insert_new(key, entry);
                };
                // SAFETY: a slot of the mapping, written while it is mapped; a test's write
                // races nothing it cares for.
                unsafe { std::ptr::write_volatile(&raw mut (*slot).entry, *entry) };
                Ok(())
            }
        }
    }

    /// Removes the half of `key`.
    pub fn remove(&mut self, key: &NatKey<A>) -> Result<(), MapError> {
        match &mut self.kind {
            Kind::Hash(map) => map.remove(key),
            Kind::Slots(table) => {
                let mapped = table.mapped().map_err(unmapped)?;
                match slot_table::remove(&mapped.memory, key) {
                    true => Ok(()),
                    false => Err(syscall_error(libc::ENOENT)),
                }
            }
        }
    }

    /// Removes the halves of `keys`; returns how many the table held.
    pub fn remove_all(&self, keys: &[NatKey<A>]) -> anyhow::Result<usize> {
        match &self.kind {
            Kind::Hash(map) => {
                batch::delete_all(map.map(), keys).context("removing from the NAT table")
            }
            Kind::Slots(table) => {
                let mapped = table.mapped()?;
                Ok(keys
                    .iter()
                    .filter(|key| slot_table::remove(&mapped.memory, key))
                    .count())
            }
        }
    }

    /// Makes a slot table hold no more than `halves`, as a hash table of that many entries
    /// would: the slots past them are blocked (`slot_table::blocked_from`), as evenly over the
    /// buckets as they go, in every bucket that holds nothing (all of a new table's, and a
    /// bucket that the programs claim a slot of meanwhile is left as they made it). For the
    /// tests' tables, which must be full at the size they ask: the agent's own hold more than
    /// asked (`slot_table::buckets_for`), and block none (an agent before that blocked some,
    /// which the programs and the walks still pass over). A hash table needs nothing.
    #[cfg(feature = "testbed")]
    pub fn limit_to(&self, halves: u32) -> anyhow::Result<()> {
        let Kind::Slots(table) = &self.kind else {
            return Ok(());
        };
        let buckets = table.buckets;
        if halves >= buckets * BUCKET_SLOTS {
            return Ok(());
        }
        let mapped = table.mapped()?;
        for bucket in 0..buckets {
            let usable = halves / buckets + u32::from(bucket < halves % buckets);
            let word = mapped
                .memory
                .word(bucket)
                .context("a bucket past the table")?;
            // SAFETY: a word of the mapping, changed as the programs change it.
            unsafe {
                mapped
                    .memory
                    .exchange(word, 0, slot_table::blocked_from(usable))
            };
        }
        Ok(())
    }

    /// Whether a full table looks at a drop sample for flows to drop: the hash table does; the
    /// slot table looks at the new half's own buckets, and its family's sample goes unused.
    pub fn has_drop_sample(&self) -> bool {
        matches!(self.kind, Kind::Hash(_))
    }

    /// The hash table's map, where the halves are kept there: for the batch commands' own tests.
    pub fn hash_map(&self) -> Option<&MapData> {
        match &self.kind {
            Kind::Hash(map) => Some(map.map()),
            Kind::Slots(_) => None,
        }
    }
}

impl<A: Address> SlotTable<A> {
    /// The arrays mapped: the mapping kept for a run of operations, or one of this call's own.
    fn mapped(&self) -> anyhow::Result<Arc<MappedSlots<A>>> {
        let mut kept = self.kept.lock().expect("no holder panics");
        if let Kept::Mapped(mapped) = &*kept {
            return Ok(Arc::clone(mapped));
        }
        let mapped = Arc::new(self.map()?);
        if matches!(*kept, Kept::Wanted) {
            *kept = Kept::Mapped(Arc::clone(&mapped));
        }
        Ok(mapped)
    }

    /// Both arrays, mapped afresh.
    fn map(&self) -> anyhow::Result<MappedSlots<A>> {
        let slots = Mapping::of(
            &self.slots,
            page_multiple(self.buckets as usize * BUCKET_SLOTS as usize * size_of::<Slot<A>>()),
            "the NAT slots",
        )?;
        let words = self.mapped_words()?;
        let seed = self.seed_in(&words);
        // SAFETY: both mappings hold the arrays whole, aligned to a page, for as long as the
        // `MappedSlots` that owns them lives.
        let memory = unsafe {
            Mapped::new(
                words.at.as_ptr().cast(),
                slots.at.as_ptr().cast(),
                self.buckets,
                seed,
                monotonic_now_ns,
            )
        };
        Ok(MappedSlots {
            _slots: slots,
            _words: words,
            memory,
        })
    }

    fn mapped_words(&self) -> anyhow::Result<Mapping> {
        let words = match self.seeded {
            true => slot_table::words_for(self.buckets),
            false => self.buckets,
        };
        Mapping::of(
            self.words.map(),
            page_multiple(words as usize * size_of::<u64>()),
            "the NAT slot words",
        )
    }

    /// Where the seed is in a mapping of the words, if the table has one.
    fn seed_word(&self, words: &Mapping) -> Option<*mut u64> {
        // SAFETY: within the mapping, which holds the seed's word where the table has one.
        self.seeded.then(|| unsafe {
            words
                .at
                .as_ptr()
                .cast::<u64>()
                .add(slot_table::seed_at(self.buckets) as usize)
        })
    }

    /// The table's seed, from a mapping of its words: 0 where it has none.
    fn seed_in(&self, words: &Mapping) -> u64 {
        // SAFETY: a word of the mapping, which only `keep_seed` writes, before the table is used.
        self.seed_word(words)
            .map_or(0, |seed| unsafe { std::ptr::read_volatile(seed) })
    }

    /// Writes `seed` into a new table, which holds nothing yet, where its programs read it
    /// from a global: the table keeps it for the next agent, its own reads, and bpftool. A
    /// table that has a seed must have that one: its halves were placed by it.
    fn keep_seed(&self, seed: u64) -> anyhow::Result<()> {
        let words = self.mapped_words()?;
        let Some(word) = self.seed_word(&words) else {
            anyhow::ensure!(
                seed == 0,
                "a slot table from before seeds, for programs seeded"
            );
            return Ok(());
        };
        let kept = self.seed_in(&words);
        if kept == seed {
            return Ok(());
        }
        anyhow::ensure!(
            kept == 0 && self.holds_nothing()?,
            "the table's halves were placed by seed {kept:#x}, and the programs were given \
             {seed:#x}"
        );
        // SAFETY: as in `seed_in`.
        unsafe { std::ptr::write_volatile(word, seed) };
        Ok(())
    }

    /// Read in place, to the first word that holds a half: a copy of every word (512 KiB at
    /// the default size) was 3 % of the agent's CPU under churn, where a table is seldom empty.
    fn holds_nothing(&self) -> anyhow::Result<bool> {
        let mapping = self.mapped_words()?;
        let words: *const u64 = mapping.at.as_ptr().cast();
        Ok((0..self.buckets as usize).all(|bucket| {
            // SAFETY: within the mapping, which holds every word; read as the programs read it.
            held_slots(unsafe { std::ptr::read_volatile(words.add(bucket)) }) == 0
        }))
    }

    /// Each held slot's key and entry, copied. The slots are not mapped where the words say
    /// none is held.
    fn held(&self) -> anyhow::Result<Table<A>> {
        if self.holds_nothing()? {
            return Ok(Vec::new());
        }
        let mapped = self.mapped()?;
        let memory = &mapped.memory;
        let mut held = Vec::new();
        for bucket in 0..self.buckets {
            let Some(word) = memory.word(bucket) else {
                continue;
            };
            // SAFETY: a word of the mapping, read as the programs read it.
            let word = unsafe { std::ptr::read_volatile(word) };
            for index in 0..BUCKET_SLOTS {
                if held_slots(word) & at_slot(0x80, index) == 0 {
                    continue;
                }
                if let Some(slot) = memory.slot(bucket, index) {
                    // SAFETY: a slot of the mapping, copied out while it is mapped.
                    let slot = unsafe { std::ptr::read_volatile(slot) };
                    held.push((slot.key, slot.entry));
                }
            }
        }
        Ok(held)
    }
}

/// Keeps a slot table mapped (`NatTable::keep_mapped`) until it drops.
pub struct KeptMapped<A: Address> {
    kept: Option<KeptMapping<A>>,
}

impl<A: Address> Drop for KeptMapped<A> {
    fn drop(&mut self) {
        if let Some(kept) = &self.kept {
            *kept.lock().expect("no holder panics") = Kept::No;
        }
    }
}

/// `len` rounded up to whole pages, as a mapping takes them.
fn page_multiple(len: usize) -> usize {
    // SAFETY: no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
    len.next_multiple_of(page)
}

/// A failure to map the slot table, as an error of the hash table's commands.
fn unmapped(err: anyhow::Error) -> MapError {
    MapError::SyscallError(aya::sys::SyscallError {
        call: "mmap",
        io_error: std::io::Error::other(format!("{err:#}")),
    })
}

// BPF_NOEXIST (include/uapi/linux/bpf.h): a half the table holds stays as it is.
const BPF_NOEXIST: u64 = 1;

/// An error as the hash table's commands give it, for refusals the slot table makes itself.
fn syscall_error(errno: i32) -> MapError {
    MapError::SyscallError(aya::sys::SyscallError {
        call: "slot table",
        io_error: std::io::Error::from_raw_os_error(errno),
    })
}

/// Whether an insert's refusal says the table holds a half of that key already (as opposed
/// to no room, or another failure).
pub fn exists(err: &MapError) -> bool {
    matches!(
        err,
        MapError::SyscallError(aya::sys::SyscallError { io_error, .. })
            if io_error.raw_os_error() == Some(libc::EEXIST)
    )
}

/// CLOCK_MONOTONIC, the clock the programs stamp entries with (`bpf_ktime_get_coarse_ns`, or
/// before 5.11 `bpf_ktime_get_ns`: the same clock).
pub fn monotonic_now_ns() -> u64 {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .expect("CLOCK_MONOTONIC is always available");
    now.tv_sec() as u64 * 1_000_000_000 + now.tv_nsec() as u64
}

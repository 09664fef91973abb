//! A family's NAT table as the agent reads and writes it: both halves of every flow the
//! programs know, where the programs keep them (masq-ebpf's `flow_table`), a kernel hash table
//! keyed by `NatKey`. The one place the agent touches a half, so that what holds them can
//! change behind it.

use anyhow::Context as _;
use aya::{
    Pod,
    maps::{HashMap as BpfHashMap, IterableMap as _, Map, MapData, MapError},
};
use masq_ebpf::{Address, NatEntry, NatKey};

use super::batch;

/// A family's NAT table, entry by entry.
pub type Table<A> = Vec<(NatKey<A>, NatEntry<A>)>;

/// A family's NAT table.
pub struct NatTable<A: Address> {
    map: BpfHashMap<MapData, NatKey<A>, NatEntry<A>>,
}

/// A map of another kind or layout is refused, as `map_types::typed` says.
impl<A> TryFrom<Map> for NatTable<A>
where
    A: Address,
    NatKey<A>: Pod,
    NatEntry<A>: Pod,
{
    type Error = MapError;

    fn try_from(map: Map) -> Result<Self, MapError> {
        Ok(NatTable {
            map: BpfHashMap::try_from(map)?,
        })
    }
}

// BPF_NOEXIST (include/uapi/linux/bpf.h): a half the table holds stays as it is.
const BPF_NOEXIST: u64 = 1;

impl<A> NatTable<A>
where
    A: Address,
    NatKey<A>: Pod,
    NatEntry<A>: Pod,
{
    /// Every half, read whole with batch commands.
    pub fn read_all(&self) -> anyhow::Result<Table<A>> {
        batch::lookup_all(self.map.map()).context("reading the NAT table")
    }

    /// Whether the table holds no half: the kernel finds a hash table's first key by reading
    /// the bucket heads alone, in about a tenth of the time a sweep's walk of the same empty
    /// buckets takes (see docs/bench/profiles.md, "The idle agent").
    pub fn holds_nothing(&self) -> anyhow::Result<bool> {
        match self.map.keys().next() {
            None => Ok(true),
            Some(Ok(_)) => Ok(false),
            Some(Err(err)) => Err(err).context("looking for the NAT table's first entry"),
        }
    }

    /// How many halves the table has room for.
    pub fn capacity(&self) -> anyhow::Result<usize> {
        Ok(self.map.map().info()?.max_entries() as usize)
    }

    /// The half of `key`, if the table holds it.
    pub fn get(&self, key: &NatKey<A>) -> Option<NatEntry<A>> {
        self.map.get(key, 0).ok()
    }

    /// Makes the half of `key` if the table holds none; `exists` says which refusal it was.
    pub fn insert_new(&mut self, key: &NatKey<A>, entry: &NatEntry<A>) -> Result<(), MapError> {
        self.map.insert(key, entry, BPF_NOEXIST)
    }

    /// Writes `entry` under `key`, over whatever the table held: as no program would, for
    /// tests that plant a state.
    pub fn write(&mut self, key: &NatKey<A>, entry: &NatEntry<A>) -> Result<(), MapError> {
        self.map.insert(key, entry, 0)
    }

    /// Removes the half of `key`.
    pub fn remove(&mut self, key: &NatKey<A>) -> Result<(), MapError> {
        self.map.remove(key)
    }

    /// Removes the halves of `keys`, with batch commands; returns how many the table held.
    pub fn remove_all(&self, keys: &[NatKey<A>]) -> anyhow::Result<usize> {
        batch::delete_all(self.map.map(), keys).context("removing from the NAT table")
    }

    /// The map itself, for what takes any map: its pin, the sweep program's file descriptor,
    /// the batch commands' own tests.
    pub fn map(&self) -> &MapData {
        self.map.map()
    }
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

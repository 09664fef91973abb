//! Carrying the flows of a pinned NAT table that this build cannot reuse as it is (an older
//! agent's entry layout, another `--nat-capacity`, or the halves moving between the hash table
//! and the slot table) into the new table, so that an upgrade or a resize breaks no connection.
//!
//! The old table is opened before its pin is replaced, and stays alive as long as it is held
//! open here (and as long as the old programs, still attached, use it). Its flows are copied
//! into the new table once the new object is loaded, and once more after the new programs took
//! over the links: the flows the old programs created in between are carried too. Nothing is
//! overwritten: a flow the new programs already hold keeps the new entry.

use std::collections::HashMap;

use aya::{Pod, maps::MapData};
use masq_ebpf::{Address, Counter, NatEntry, NatKey, map_names};
use tracing::{info, warn};

use super::{
    batch,
    expiry::FlowOwner,
    flow_table::{NatTable, TableMaps, V4_MAPS, V6_MAPS},
    map_types::{Counters, NatFamily},
    maps::Maps,
    pins::Pins,
};

/// A NAT table entry as agents wrote it before entries recorded TCP sequence numbers: a
/// historical layout, read only here.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct EntryWithoutSequence<A: Address> {
    last_seen_ns: u64,
    addr: A,
    port: u16,
    kind: u8,
    tcp_seen: u8,
    _pad: A::EntryPad,
}

// SAFETY: #[repr(C)] plain data, every byte of it a field or declared padding.
unsafe impl Pod for EntryWithoutSequence<[u8; 4]> {}
// SAFETY: as above.
unsafe impl Pod for EntryWithoutSequence<[u8; 16]> {}

impl<A: Address> EntryWithoutSequence<A> {
    /// The entry as this build keeps it. Its TCP flags carry no `tcp_seen::SEQ`, so the data
    /// path takes the first segments' sequence numbers as they come.
    fn current(self) -> NatEntry<A> {
        NatEntry {
            last_seen_ns: self.last_seen_ns,
            addr: self.addr,
            port: self.port,
            kind: self.kind,
            tcp_seen: self.tcp_seen,
            tcp_next_seq: 0,
            tcp_max_ack: 0,
            _pad: A::EntryPad::default(),
        }
    }
}

/// How an old table's entries are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// This build's: only the capacity differs.
    Current,
    WithoutSequence,
}

/// One old table, held open.
struct Old {
    name: &'static str,
    source: Source,
}

/// Where an old table's halves are.
enum Source {
    /// A hash table, pinned as the `Old`'s name.
    Hash {
        map: MapData,
        layout: Layout,
    },
    /// A slot table, whose maps are pinned under its family's `TableMaps`' other names.
    SlotsV4(NatTable<[u8; 4]>),
    SlotsV6(NatTable<[u8; 16]>),
}

/// The old NAT tables whose flows are being carried into the new ones.
#[derive(Default)]
pub struct Carried {
    tables: Vec<Old>,
}

impl Carried {
    /// Opens every pinned NAT table that the new tables will replace (its layout or capacity
    /// differs from `capacity(name)`), before their pins are replaced. A table of a layout
    /// this build does not know is left to be replaced, and said so.
    pub fn open(pins: &Pins, capacity: impl Fn(&str) -> u32) -> Carried {
        let mut tables = Vec::new();
        let slot_tables = [
            open_slot_table(pins, &V4_MAPS, &capacity).map(Source::SlotsV4),
            open_slot_table(pins, &V6_MAPS, &capacity).map(Source::SlotsV6),
        ];
        for (maps, source) in [&V4_MAPS, &V6_MAPS].into_iter().zip(slot_tables) {
            if let Some(source) = source {
                tables.push(Old {
                    name: maps.hash,
                    source,
                });
            }
        }
        for name in [map_names::NAT_V4, map_names::NAT_V6] {
            let path = pins.map(name);
            if !path.exists() {
                continue;
            }
            let opened = MapData::from_pin(&path)
                .map_err(anyhow::Error::from)
                .and_then(|map| Ok((map.info()?, map)));
            let (info, map) = match opened {
                Ok(opened) => opened,
                Err(err) => {
                    warn!(map = name, "cannot open the pinned NAT table: {err:#}");
                    continue;
                }
            };
            let value_size = info.value_size() as usize;
            let v6 = name == map_names::NAT_V6;
            let layout = match (v6, value_size) {
                (false, n) if n == size_of::<NatEntry<[u8; 4]>>() => Layout::Current,
                (true, n) if n == size_of::<NatEntry<[u8; 16]>>() => Layout::Current,
                (false, n) if n == size_of::<EntryWithoutSequence<[u8; 4]>>() => {
                    Layout::WithoutSequence
                }
                (true, n) if n == size_of::<EntryWithoutSequence<[u8; 16]>>() => {
                    Layout::WithoutSequence
                }
                _ => {
                    warn!(
                        map = name,
                        value_size, "a pinned NAT table of an unknown layout: its flows are lost"
                    );
                    continue;
                }
            };
            if layout == Layout::Current && info.max_entries() == capacity(name) {
                continue;
            }
            tables.push(Old {
                name,
                source: Source::Hash { map, layout },
            });
        }
        Carried { tables }
    }

    /// Copies the old tables' flows into `maps`' tables, and says how many were carried. A
    /// table that cannot be read loses its flows, which is said too; the data plane goes on.
    /// Pins each old table again where its pin was taken away, after a failed load: the next
    /// attempt carries its flows.
    pub fn pin_again(&mut self, pins: &Pins) {
        for old in &mut self.tables {
            let Source::Hash { map, .. } = &mut old.source else {
                // The slot table's maps are replaced only once a load succeeds.
                continue;
            };
            let path = pins.map(old.name);
            if !path.exists()
                && let Err(err) = map.pin(&path)
            {
                warn!(map = old.name, "cannot pin the old NAT table again: {err}");
            }
        }
    }

    pub fn copy_into(&self, maps: &mut Maps) {
        for old in &self.tables {
            let copied = match &old.source {
                Source::SlotsV4(table) => table
                    .read_all()
                    .and_then(|halves| copy_entries(halves.into_iter().collect(), maps)),
                Source::SlotsV6(table) => table
                    .read_all()
                    .and_then(|halves| copy_entries(halves.into_iter().collect(), maps)),
                Source::Hash { map, layout } if old.name == map_names::NAT_V6 => {
                    hash_entries::<[u8; 16]>(map, *layout)
                        .and_then(|entries| copy_entries(entries, maps))
                }
                Source::Hash { map, layout } => hash_entries::<[u8; 4]>(map, *layout)
                    .and_then(|entries| copy_entries(entries, maps)),
            };
            let outcome = match copied {
                Ok(outcome) => outcome,
                Err(err) => {
                    warn!(map = old.name, "the old table's flows are lost: {err:#}");
                    continue;
                }
            };
            if outcome.carried + outcome.left_out > 0 {
                info!(
                    map = old.name,
                    flows = outcome.carried,
                    "flows carried into the new NAT table"
                );
            }
            if outcome.left_out > 0 {
                warn!(
                    map = old.name,
                    flows = outcome.left_out,
                    "flows that did not fit into the new NAT table are lost"
                );
                if let Err(err) = count(
                    &mut maps.counters,
                    Counter::NatFlowsNotCarried,
                    outcome.left_out,
                ) {
                    warn!("cannot count the flows left out: {err:#}");
                }
            }
        }
    }
}

/// Adds `n` to one of the programs' counters, in the first CPU's slot (they are summed).
fn count(counters: &mut Counters, counter: Counter, n: usize) -> anyhow::Result<()> {
    let mut values: Vec<u64> = counters.get(&(counter as u32), 0)?.to_vec();
    values[0] += n as u64;
    counters.set(
        counter as u32,
        aya::maps::PerCpuValues::try_from(values)?,
        0,
    )?;
    Ok(())
}

/// What one copy did.
struct Outcome {
    carried: usize,
    left_out: usize,
}

/// The family's slot table an earlier agent pinned in its `maps`, if the new tables replace
/// it: it held halves (more than one bucket) and the new one is another size, or none
/// (`capacity` of its words).
fn open_slot_table<A>(
    pins: &Pins,
    maps: &TableMaps,
    capacity: &impl Fn(&str) -> u32,
) -> Option<NatTable<A>>
where
    A: Address,
    NatKey<A>: Pod,
    NatEntry<A>: Pod,
{
    if !(pins.map(maps.slots).exists() && pins.map(maps.words).exists()) {
        return None;
    }
    let opened = (|| {
        let (slots, words) = (pins.open_map(maps.slots)?, pins.open_map(maps.words)?);
        let buckets = words_of(&words)?;
        if buckets == capacity(maps.words) {
            return Ok(None);
        }
        NatTable::<A>::from_slot_maps(slots, words)
    })();
    match opened {
        Ok(table) => table,
        Err(err) => {
            warn!(
                map = maps.slots,
                "cannot open the pinned slot table: {err:#}"
            );
            None
        }
    }
}

/// The entries of a pinned array map.
fn words_of(map: &aya::maps::Map) -> anyhow::Result<u32> {
    let aya::maps::Map::Array(data) = map else {
        anyhow::bail!("the NAT slot words are not an array");
    };
    Ok(data.info()?.max_entries())
}

/// The halves of an old hash table, as this build keeps them.
fn hash_entries<A>(map: &MapData, layout: Layout) -> anyhow::Result<HashMap<NatKey<A>, NatEntry<A>>>
where
    A: NatFamily,
    NatKey<A>: Pod,
    NatEntry<A>: Pod,
    EntryWithoutSequence<A>: Pod,
{
    Ok(match layout {
        Layout::Current => batch::lookup_all::<NatKey<A>, NatEntry<A>>(map)?
            .into_iter()
            .collect(),
        Layout::WithoutSequence => batch::lookup_all::<NatKey<A>, EntryWithoutSequence<A>>(map)?
            .into_iter()
            .map(|(key, entry)| (key, entry.current()))
            .collect(),
    })
}

/// Makes `entries`' flows in `maps`' table of their family.
fn copy_entries<A>(
    entries: HashMap<NatKey<A>, NatEntry<A>>,
    maps: &mut Maps,
) -> anyhow::Result<Outcome>
where
    A: NatFamily,
    NatKey<A>: Pod,
    NatEntry<A>: Pod,
{
    let new: &mut NatTable<A> = A::table_mut(&mut maps.nat);
    // Mapped once for all the flows, not once a flow (a hash table needs nothing).
    let _mapped = new.keep_mapped()?;
    let mut outcome = Outcome {
        carried: 0,
        left_out: 0,
    };
    // Flow by flow, both halves or neither: half a flow translates one way only.
    type Flow<'a, A> = (&'a NatKey<A>, &'a NatEntry<A>, NatKey<A>, &'a NatEntry<A>);
    let mut flows: Vec<Flow<A>> = entries
        .iter()
        .filter(|(k, _)| k.direction == masq_ebpf::direction::EGRESS)
        .filter_map(|(key, entry)| {
            let partner_key = key.reverse(entry);
            let partner = entries.get(&partner_key)?;
            Some((key, entry, partner_key, partner))
        })
        .collect();
    // A smaller table takes the pods' flows first, and the node's reservations last (see
    // `FlowOwner`); of each, the flows seen last first.
    flows.sort_by_key(|(key, entry, _, partner)| {
        let last_seen = entry.last_seen_ns.max(partner.last_seen_ns);
        (FlowOwner::of(key, entry), std::cmp::Reverse(last_seen))
    });
    for (key, entry, partner_key, partner) in flows {
        if new.get(key).is_some() || new.get(&partner_key).is_some() {
            continue;
        }
        if new.insert_new(key, entry).is_err() {
            outcome.left_out += 1;
            continue;
        }
        if new.insert_new(&partner_key, partner).is_err() {
            let _ = new.remove(key);
            outcome.left_out += 1;
            continue;
        }
        outcome.carried += 1;
    }
    Ok(outcome)
}

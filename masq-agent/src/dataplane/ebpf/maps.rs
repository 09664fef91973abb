//! Every map the agent uses, taken out of the loaded object once and typed (see `map_types`),
//! so that a missing map or a layout this build does not expect fails the load, not a sync
//! later on; past the load no code names a map to reach it.

use anyhow::Context as _;
use aya::{
    Ebpf,
    maps::{Array, Map, MapData, MapError},
};
use masq_ebpf::{Settings, map_names};

use super::{
    flow_table::{NatTable, TableMaps, V4_MAPS, V6_MAPS},
    index_writer::IndexWriter,
    map_types::{Counters, DropSamples, Interfaces, NatTables, SweepMaps, typed},
    policy_index::PolicyIndex,
    policy_word::PolicyWord,
    tries::{FamilyTries, PolicyMaps},
};

/// Every map the agent uses. The programs' own caches (verdicts, fragments) stay in the object.
pub struct Maps {
    pub policy: PolicyMaps,
    pub nat: NatTables,
    pub interfaces: Interfaces,
    pub settings: Array<MapData, Settings>,
    pub counters: Counters,
    /// The node's own ports, which NAT never hands out (see `node_ports`).
    pub node_ports: Array<MapData, u64>,
    /// The ports on which no NAT entry is on the node's side (see
    /// `masq_ebpf::map_names::ENTRYLESS_PORTS`).
    pub entryless_ports: Array<MapData, u64>,
    pub drop_samples: DropSamples,
    /// The sweep program's order and report, whether or not the program is loaded.
    pub sweep: SweepMaps,
}

impl Maps {
    /// Takes the maps out of `ebpf`. Its programs must be loaded already: the kernel resolves
    /// their references to the maps through the descriptors the loader opened.
    /// `reused_decisions`: the decision counters are an earlier agent's.
    pub fn take_from(ebpf: &mut Ebpf, reused_decisions: bool) -> anyhow::Result<Maps> {
        Ok(Maps {
            policy: PolicyMaps::new(
                (
                    FamilyTries::new(
                        take(ebpf, map_names::NON_MASQ_V4)?,
                        Some(take(ebpf, map_names::DRAINING_V4)?),
                    ),
                    FamilyTries::new(
                        take(ebpf, map_names::NON_MASQ_V6)?,
                        Some(take(ebpf, map_names::DRAINING_V6)?),
                    ),
                ),
                (
                    FamilyTries::new(take(ebpf, map_names::NON_MASQ_SRC_V4)?, None),
                    FamilyTries::new(take(ebpf, map_names::NON_MASQ_SRC_V6)?, None),
                ),
                PolicyWord(take(ebpf, map_names::POLICY_GENERATION)?),
                IndexWriter::spawn(PolicyIndex::new(take(ebpf, map_names::NON_MASQ_INDEX_V4)?))?,
                take(ebpf, map_names::DECISIONS)?,
                reused_decisions,
            ),
            nat: NatTables {
                v4: nat_table(ebpf, &V4_MAPS)?,
                v6: nat_table(ebpf, &V6_MAPS)?,
            },
            interfaces: Interfaces {
                table: take(ebpf, map_names::INTERFACES)?,
                by_ifindex: take(ebpf, map_names::INTERFACES_BY_IFINDEX)?,
            },
            settings: take(ebpf, map_names::SETTINGS)?,
            counters: take(ebpf, map_names::COUNTERS)?,
            node_ports: take(ebpf, map_names::NODE_PORTS)?,
            entryless_ports: take(ebpf, map_names::ENTRYLESS_PORTS)?,
            drop_samples: DropSamples {
                v4: take(ebpf, map_names::DROP_SAMPLE_V4)?,
                v6: take(ebpf, map_names::DROP_SAMPLE_V6)?,
                vacancies: take(ebpf, map_names::DROP_VACANCY)?,
            },
            sweep: SweepMaps {
                order: take(ebpf, map_names::SWEEP_ORDER)?,
                reports: take(ebpf, map_names::SWEEP_REPORT)?,
            },
        })
    }
}

fn take<M: TryFrom<Map, Error = MapError>>(ebpf: &mut Ebpf, name: &str) -> anyhow::Result<M> {
    typed(untyped(ebpf, name)?, name)
}

fn untyped(ebpf: &mut Ebpf, name: &str) -> anyhow::Result<Map> {
    ebpf.take_map(name)
        .with_context(|| format!("map {name} missing from the object"))
}

/// A family's NAT table, in whichever of its maps the agent sized for it.
fn nat_table<A>(ebpf: &mut Ebpf, maps: &TableMaps) -> anyhow::Result<NatTable<A>>
where
    A: masq_ebpf::Address,
    masq_ebpf::NatKey<A>: aya::Pod,
    masq_ebpf::NatEntry<A>: aya::Pod,
{
    let slot_table = (untyped(ebpf, maps.slots)?, untyped(ebpf, maps.words)?);
    NatTable::from_maps(untyped(ebpf, maps.hash)?, Some(slot_table))
        .with_context(|| format!("the NAT table of {}", maps.hash))
}

//! The maps the agent shares with the programs, taken out of the loaded object once and typed,
//! so that a missing map or a layout this build does not expect fails the load, not a sync
//! later on; past the load no code names a map to reach it.

use anyhow::Context as _;
use aya::{
    Ebpf,
    maps::{Array, HashMap as BpfHashMap, Map, MapData, MapError, PerCpuArray},
};
use masq_ebpf::{Address, Counter, Interface, NatEntry, NatKey, Settings, map_names};

use super::tries::{FamilyTries, PolicyMaps};

/// A family's NAT table: both halves of every flow the programs know.
pub type NatTable<A> = BpfHashMap<MapData, NatKey<A>, NatEntry<A>>;

/// The programs' packet counters, a slot per `Counter`, per CPU.
pub type Counters = PerCpuArray<MapData, u64>;

/// The interfaces the programs translate on, by ifindex, with the addresses they give.
pub type Interfaces = BpfHashMap<MapData, u32, Interface>;

/// Both families' NAT tables.
pub struct NatTables {
    pub v4: NatTable<[u8; 4]>,
    pub v6: NatTable<[u8; 16]>,
}

/// A family's drop sample: egress keys of the NAT table's flows, at random slots, where a full
/// table looks for flows to drop (`masq_ebpf::drop_sample_slots`).
pub type DropSample<A> = Array<MapData, NatKey<A>>;

/// Both families' drop samples.
pub struct DropSamples {
    pub v4: DropSample<[u8; 4]>,
    pub v6: DropSample<[u8; 16]>,
}

/// Picks a family's NAT table by its address type, for code written once over both families.
pub trait NatFamily: Address {
    fn table(tables: &NatTables) -> &NatTable<Self>;
    fn table_mut(tables: &mut NatTables) -> &mut NatTable<Self>;
}

impl NatFamily for [u8; 4] {
    fn table(tables: &NatTables) -> &NatTable<Self> {
        &tables.v4
    }
    fn table_mut(tables: &mut NatTables) -> &mut NatTable<Self> {
        &mut tables.v4
    }
}

impl NatFamily for [u8; 16] {
    fn table(tables: &NatTables) -> &NatTable<Self> {
        &tables.v6
    }
    fn table_mut(tables: &mut NatTables) -> &mut NatTable<Self> {
        &mut tables.v6
    }
}

/// Every map the agent uses. The programs' own caches (verdicts, fragments) stay in the object.
pub struct Maps {
    pub policy: PolicyMaps,
    pub nat: NatTables,
    pub interfaces: Interfaces,
    pub settings: Array<MapData, Settings>,
    pub counters: Counters,
    /// The node's own ports, which NAT never hands out (see `node_ports`).
    pub node_ports: Array<MapData, u64>,
    pub drop_samples: DropSamples,
}

impl Maps {
    /// Takes the maps out of `ebpf`. Its programs must be loaded already: the kernel resolves
    /// their references to the maps through the descriptors the loader opened.
    /// `reused_decisions`: the decision counters are an earlier agent's.
    pub fn take_from(ebpf: &mut Ebpf, reused_decisions: bool) -> anyhow::Result<Maps> {
        Ok(Maps {
            policy: PolicyMaps::new(
                FamilyTries::new(
                    take(ebpf, map_names::NON_MASQ_V4)?,
                    take(ebpf, map_names::DRAINING_V4)?,
                ),
                FamilyTries::new(
                    take(ebpf, map_names::NON_MASQ_V6)?,
                    take(ebpf, map_names::DRAINING_V6)?,
                ),
                take(ebpf, map_names::POLICY_GENERATION)?,
                take(ebpf, map_names::DECISIONS)?,
                reused_decisions,
            ),
            nat: NatTables {
                v4: take(ebpf, map_names::NAT_V4)?,
                v6: take(ebpf, map_names::NAT_V6)?,
            },
            interfaces: take(ebpf, map_names::INTERFACES)?,
            settings: take(ebpf, map_names::SETTINGS)?,
            counters: take(ebpf, map_names::COUNTERS)?,
            node_ports: take(ebpf, map_names::NODE_PORTS)?,
            drop_samples: DropSamples {
                v4: take(ebpf, map_names::DROP_SAMPLE_V4)?,
                v6: take(ebpf, map_names::DROP_SAMPLE_V6)?,
            },
        })
    }
}

fn take<M: TryFrom<Map, Error = MapError>>(ebpf: &mut Ebpf, name: &str) -> anyhow::Result<M> {
    let map = ebpf
        .take_map(name)
        .with_context(|| format!("map {name} missing from the object"))?;
    typed(map, name)
}

/// A counter's total over the CPUs; 0 for a slot the map lacks (an older agent's).
pub fn counter_total(counters: &Counters, counter: Counter) -> u64 {
    counters
        .get(&(counter as u32), 0)
        .map_or(0, |per_cpu| per_cpu.iter().sum())
}

/// `map` as the type the agent reads it with, if its kind and layout are that type's.
pub(super) fn typed<M: TryFrom<Map, Error = MapError>>(map: Map, name: &str) -> anyhow::Result<M> {
    M::try_from(map).with_context(|| format!("map {name}"))
}

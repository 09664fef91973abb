//! The types the agent reads the programs' maps with: a layout this build does not expect fails
//! when the map is taken (see `maps`).

use anyhow::Context as _;
use aya::maps::{Array, HashMap as BpfHashMap, Map, MapData, MapError, PerCpuArray};
use masq_ebpf::{Address, Counter, IndexedInterface, Interface, NatKey, SweepOrder, SweepReport};

use super::flow_table::NatTable;

/// The programs' packet counters, a slot per `Counter`, per CPU.
pub type Counters = PerCpuArray<MapData, u64>;

/// The interfaces the programs translate on, by ifindex, with the addresses they give: all of
/// them, pinned.
pub type InterfaceTable = BpfHashMap<MapData, u32, Interface>;

/// Both maps the programs find a device's addresses in (`interfaces`).
pub struct Interfaces {
    pub table: InterfaceTable,
    /// Those of the small ifindexes again, which the programs read first
    /// (`masq_ebpf::map_names::INTERFACES_BY_IFINDEX`).
    pub by_ifindex: Array<MapData, IndexedInterface>,
}

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
    /// Per family (`masq_ebpf::drop_vacancy`), the slot a drop freed and no new flow took yet,
    /// plus one: the programs' own, which the agent leaves alone (the packet tests read it).
    pub vacancies: Array<MapData, u32>,
}

/// The sweep program's maps: what the agent asks of it, and what it found per family.
pub struct SweepMaps {
    pub order: Array<MapData, SweepOrder>,
    pub reports: Array<MapData, SweepReport>,
}

/// Picks a family's NAT table by its address type, for code written once over both families.
pub trait NatFamily: Address {
    fn table(tables: &NatTables) -> &NatTable<Self>;
    fn table_mut(tables: &mut NatTables) -> &mut NatTable<Self>;
    fn drop_sample(samples: &DropSamples) -> &DropSample<Self>
    where
        NatKey<Self>: aya::Pod;
    /// The family's slot of `DropSamples::vacancies`.
    const DROP_VACANCY: u32;
    /// The family's slot of the sweep program's report.
    const SWEEP_REPORT: u32;
    /// The EtherType of the family's packets.
    const ETHERTYPE: u16;
}

impl NatFamily for [u8; 4] {
    fn table(tables: &NatTables) -> &NatTable<Self> {
        &tables.v4
    }
    fn table_mut(tables: &mut NatTables) -> &mut NatTable<Self> {
        &mut tables.v4
    }
    fn drop_sample(samples: &DropSamples) -> &DropSample<Self> {
        &samples.v4
    }
    const DROP_VACANCY: u32 = masq_ebpf::drop_vacancy::V4;
    const SWEEP_REPORT: u32 = masq_ebpf::sweep_report::V4;
    const ETHERTYPE: u16 = masq_ebpf::ETH_P_IP;
}

impl NatFamily for [u8; 16] {
    fn table(tables: &NatTables) -> &NatTable<Self> {
        &tables.v6
    }
    fn table_mut(tables: &mut NatTables) -> &mut NatTable<Self> {
        &mut tables.v6
    }
    fn drop_sample(samples: &DropSamples) -> &DropSample<Self> {
        &samples.v6
    }
    const DROP_VACANCY: u32 = masq_ebpf::drop_vacancy::V6;
    const SWEEP_REPORT: u32 = masq_ebpf::sweep_report::V6;
    const ETHERTYPE: u16 = masq_ebpf::ETH_P_IPV6;
}

/// A counter's total over the CPUs; 0 for a slot the map lacks (an older agent's).
pub fn counter_total(counters: &Counters, counter: Counter) -> u64 {
    counters
        .get(&(counter as u32), 0)
        .map_or(0, |per_cpu| per_cpu.iter().sum())
}

/// What a full NAT table dropped or refused so far, both families (`FULL_TABLE_COUNTERS`).
pub fn full_table_drops(counters: &Counters) -> u64 {
    masq_ebpf::FULL_TABLE_COUNTERS
        .into_iter()
        .map(|counter| counter_total(counters, counter))
        .sum()
}

/// `map` as the type the agent reads it with, if its kind and layout are that type's.
pub fn typed<M: TryFrom<Map, Error = MapError>>(map: Map, name: &str) -> anyhow::Result<M> {
    M::try_from(map).with_context(|| format!("map {name}"))
}

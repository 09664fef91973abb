//! The drop samples, where a full NAT table finds flows to drop early
//! (`masq_ebpf::drop_sample_slots`). The programs write each new flow into a random slot; the
//! samples belong to the loaded object and start empty, so the agent writes the flows the
//! tables already hold (an earlier agent's, or carried) when it loads the programs. Without
//! that, the flows of a table that was full before a restart could not be dropped.

use aya::{Pod, maps::IterableMap as _};
use masq_ebpf::{Address, NatEntry, NatKey, direction};

use super::{
    batch,
    map_types::{self, DropSample, NatTable},
    maps::Maps,
};

/// Writes every flow of both NAT tables into its family's sample; says how many.
pub fn fill(maps: &Maps) -> anyhow::Result<usize> {
    let samples = &maps.drop_samples;
    Ok(fill_family(&maps.nat.v4, &samples.v4)? + fill_family(&maps.nat.v6, &samples.v6)?)
}

fn fill_family<A: Address>(table: &NatTable<A>, sample: &DropSample<A>) -> anyhow::Result<usize>
where
    NatKey<A>: Pod,
    NatEntry<A>: Pod,
{
    let entries = map_types::read_table(table)?;
    let slots = sample.len() as usize;
    let flows: Vec<NatKey<A>> = entries
        .into_iter()
        .filter(|(key, _)| key.direction == direction::EGRESS)
        .map(|(key, _)| key)
        .take(slots)
        .collect();
    batch::fill_array(sample.map(), &flows)?;
    Ok(flows.len())
}

/// Points every slot of `sample` at one of `droppable` (egress keys of flows a full table may
/// drop), in turn; leaves it as it is when there is none. Says how many slots it wrote.
pub fn point_at<A: Address>(
    sample: &DropSample<A>,
    droppable: &[NatKey<A>],
) -> anyhow::Result<usize>
where
    NatKey<A>: Pod,
{
    if droppable.is_empty() {
        return Ok(0);
    }
    let keys: Vec<NatKey<A>> = droppable
        .iter()
        .cycle()
        .take(sample.len() as usize)
        .copied()
        .collect();
    batch::fill_array(sample.map(), &keys)?;
    Ok(keys.len())
}

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

/// Points the slots of `sample` at the flows a table under pressure holds: the egress keys of
/// those a full table may drop (`droppable`) spread evenly among those of the others (`kept`,
/// which may close later and become droppable then), each once (`spread`). Slots past the
/// table's flows keep what the programs wrote. Says how many slots it wrote.
pub fn point_at<A: Address>(
    sample: &DropSample<A>,
    droppable: &[NatKey<A>],
    kept: &[NatKey<A>],
) -> anyhow::Result<usize>
where
    NatKey<A>: Pod,
{
    let keys = spread(droppable, kept, sample.len() as usize);
    batch::fill_array(sample.map(), &keys)?;
    Ok(keys.len())
}

/// Up to `slots` of `droppable` and `kept`, each once, droppable first if there are more:
/// the droppable ones evenly spaced, so that every `EARLY_DROP_PROBES` slots in a row that a
/// full table looks at hold one while there are a sixteenth as many as slots. (Repeating the
/// droppable ones over every slot, as the agent once did, left the slots of each but one
/// pointing at nothing once it was dropped.)
fn spread<K: Copy>(droppable: &[K], kept: &[K], slots: usize) -> Vec<K> {
    let len = slots.min(droppable.len() + kept.len());
    let placing = droppable.len().min(len);
    let (mut droppable, mut kept) = (droppable.iter(), kept.iter());
    let mut placed = 0;
    (0..len)
        .filter_map(|slot| {
            // How many droppable flows the slots up to this one hold, spread evenly.
            if placed < (slot + 1) * placing / len {
                placed += 1;
                droppable.next()
            } else {
                kept.next()
            }
        })
        .copied()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::spread;
    use masq_ebpf::EARLY_DROP_PROBES;

    const PROBES: usize = EARLY_DROP_PROBES as usize;

    /// Droppable flows as negative numbers, the others as positive.
    fn sample(droppable: usize, kept: usize, slots: usize) -> Vec<i64> {
        let droppable: Vec<i64> = (1..=droppable as i64).map(|i| -i).collect();
        let kept: Vec<i64> = (1..=kept as i64).collect();
        spread(&droppable, &kept, slots)
    }

    #[test]
    fn every_run_of_the_slots_looked_at_holds_a_droppable_flow() {
        for slots in [64, 1024] {
            for droppable in slots / PROBES..slots {
                let keys = sample(droppable, slots, slots);
                assert_eq!(keys.len(), slots);
                for first in 0..slots {
                    let looked_at = (first..first + PROBES).map(|slot| keys[slot % slots]);
                    assert!(
                        looked_at.clone().any(|k| k < 0),
                        "{droppable} droppable in {slots} slots, from slot {first}"
                    );
                }
            }
        }
    }

    #[test]
    fn each_flow_goes_in_once_droppable_ones_first() {
        for (droppable, kept, slots) in [(3, 5, 64), (0, 70, 64), (70, 5, 64), (10, 60, 64)] {
            let keys = sample(droppable, kept, slots);
            assert_eq!(keys.len(), slots.min(droppable + kept));
            let mut distinct = keys.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct.len(), keys.len(), "{keys:?}");
            let placed = keys.iter().filter(|k| **k < 0).count();
            assert_eq!(placed, droppable.min(slots), "{keys:?}");
        }
    }
}

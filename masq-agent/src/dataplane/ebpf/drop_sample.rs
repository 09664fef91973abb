//! The drop samples, where a full NAT table finds flows to drop early
//! (`masq_ebpf::drop_sample_slots`). The programs write each new flow into a random slot; the
//! samples belong to the loaded object and start empty, so the agent writes the flows the
//! tables already hold (an earlier agent's, or carried) when it loads the programs. Without
//! that, the flows of a table that was full before a restart could not be dropped.

use aya::{Pod, maps::IterableMap as _};
use masq_ebpf::{Address, NatEntry, NatKey, SamplePointing, direction};

use super::{batch, flow_table::NatTable, map_types::DropSample, maps::Maps};

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
    if !table.has_drop_sample() {
        return Ok(0);
    }
    let entries = table.read_all()?;
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

/// Points the slots of `sample` at the flows a table under pressure holds, where
/// `SamplePointing` places them, as the sweep program does as it walks the table: the egress
/// keys of those a full table may drop (`droppable`) and of the others (`undroppable`, which
/// may close later and become droppable then), each once. Slots not pointed keep what the
/// programs wrote. Says how many slots it wrote.
pub fn point_at<A: Address>(
    sample: &DropSample<A>,
    droppable: &[NatKey<A>],
    undroppable: &[NatKey<A>],
) -> anyhow::Result<usize>
where
    NatKey<A>: Pod,
{
    let (slots, keys) = placed(droppable, undroppable, sample.len());
    batch::update_array(sample.map(), &slots, &keys)?;
    Ok(keys.len())
}

/// The slots of a sample of `slots` that `droppable` and `undroppable` take, droppable first
/// (so that none is put in a slot and then displaced), with their keys.
fn placed<K: Copy>(droppable: &[K], undroppable: &[K], slots: u32) -> (Vec<u32>, Vec<K>) {
    debug_assert!(slots.is_power_of_two(), "drop_sample_slots makes {slots}");
    let mut pointing = SamplePointing::default();
    let flows =
        (droppable.iter().map(|key| (true, key))).chain(undroppable.iter().map(|key| (false, key)));
    flows
        .filter_map(|(may_drop, key)| Some((pointing.place(slots, may_drop)?, *key)))
        .unzip()
}

#[cfg(test)]
mod tests {
    use super::placed;
    use masq_ebpf::{EARLY_DROP_PROBES, SamplePointing};

    const PROBES: usize = EARLY_DROP_PROBES as usize;

    /// A sample of `slots` after flows were placed in `order` (true for one a full table may
    /// drop), as the sweep program's walk meets them: droppable flows as negative numbers,
    /// the others as positive, an empty slot as 0.
    fn walked(order: &[bool], slots: usize) -> Vec<i64> {
        let mut sample = vec![0; slots];
        let mut pointing = SamplePointing::default();
        let (mut droppable, mut undroppable) = (0, 0);
        for &may_drop in order {
            let flow = if may_drop {
                droppable += 1;
                -droppable
            } else {
                undroppable += 1;
                undroppable
            };
            if let Some(slot) = pointing.place(slots as u32, may_drop) {
                sample[slot as usize] = flow;
            }
        }
        sample
    }

    /// Orders of `droppable` and `undroppable` flows a walk may meet them in: all droppable
    /// first, last, interleaved, and scattered.
    fn orders(droppable: usize, undroppable: usize) -> Vec<Vec<bool>> {
        let total = droppable + undroppable;
        let first: Vec<bool> = (0..total).map(|i| i < droppable).collect();
        let last: Vec<bool> = (0..total).map(|i| i >= undroppable).collect();
        let mut scattered = first.clone();
        let mut state = 0x9e37_79b9_u64;
        for i in (1..total).rev() {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            scattered.swap(i, (state >> 33) as usize % (i + 1));
        }
        let spread: Vec<bool> = (0..total)
            .map(|i| (i + 1) * droppable / total > i * droppable / total)
            .collect();
        vec![first, last, scattered, spread]
    }

    fn reserved(slots: usize) -> usize {
        SamplePointing::reserved_slots(slots as u32) as usize
    }

    #[test]
    fn every_run_of_the_slots_looked_at_holds_a_droppable_flow() {
        for slots in [1, 4, 16, 64, 1024] {
            let looked_at = PROBES.min(slots);
            for droppable in [reserved(slots), slots / 4, slots, 2 * slots] {
                for order in orders(droppable.max(1), 2 * slots) {
                    let sample = walked(&order, slots);
                    for first in 0..slots {
                        assert!(
                            (first..first + looked_at).any(|slot| sample[slot % slots] < 0),
                            "{droppable} droppable in {slots} slots, from slot {first}: {sample:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn each_flow_goes_in_once_and_droppable_ones_are_never_displaced() {
        for slots in [1, 4, 16, 64, 1024] {
            for droppable in [0, 1, slots / 32, slots / 2, slots, 3 * slots / 2] {
                for undroppable in [0, 3, slots / 2, slots, 2 * slots] {
                    for order in orders(droppable, undroppable) {
                        let sample = walked(&order, slots);
                        let held: Vec<i64> = sample.iter().copied().filter(|f| *f != 0).collect();
                        let mut distinct = held.clone();
                        distinct.sort();
                        distinct.dedup();
                        assert_eq!(distinct.len(), held.len(), "{sample:?}");
                        let droppable_held = held.iter().filter(|f| **f < 0).count();
                        assert_eq!(droppable_held, droppable.min(slots), "{sample:?}");
                        // Every slot is pointed once the droppable flows fill those reserved for
                        // them, or there are flows enough to fill the rest.
                        let reserved = reserved(slots);
                        let others = slots - reserved;
                        let expected = droppable.min(reserved)
                            + others.min(droppable.saturating_sub(reserved) + undroppable);
                        assert_eq!(
                            held.len(),
                            expected,
                            "{droppable}+{undroppable}: {sample:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_agent_places_a_list_as_the_walk_would_place_it_droppable_first() {
        let droppable: Vec<i64> = (1..=10).map(|i| -i).collect();
        let undroppable: Vec<i64> = (1..=100).collect();
        let (slots, keys) = placed(&droppable, &undroppable, 64);
        let mut sample = vec![0; 64];
        for (slot, key) in slots.iter().zip(&keys) {
            sample[*slot as usize] = *key;
        }
        let order: Vec<bool> = (0..110).map(|i| i < 10).collect();
        assert_eq!(sample, walked(&order, 64));
        assert_eq!(keys.len(), 64);
    }
}

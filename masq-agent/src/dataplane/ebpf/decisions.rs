//! Which slot of `policy_decisions` counts which policy entry. Each prefix of the policy tries
//! keeps its slot as long as it keeps its action, so that its count grows across policy
//! changes; a slot given back is zeroed before it counts for another entry.
//!
//! A slot given back may still be counted in for a moment: a program that looked the removed
//! entry up (or found it in its verdict cache, until the generation moves) counts after the
//! trie changed. So slots are zeroed when given again, not when given back, and slots never
//! used since the array was made, which are zero, go first.

use aya::maps::{IterableMap as _, MapData, PerCpuArray, PerCpuValues};
use ipnet::IpNet;
use masq_ebpf::{PolicyEntry, PrefixAction, decision_slot, map_names, prefix_action};
use serde::Serialize;

use super::{batch, pins::Pins, policy_word::PolicyWord, prefixes};
use crate::policy::{Action, IpFamily, Policy};

/// The per-CPU decision counters, a slot per policy entry.
pub type DecisionCounters = PerCpuArray<MapData, u64>;

/// The slots no entry holds.
#[derive(Debug)]
pub struct DecisionSlots {
    capacity: u32,
    /// Slots known to be zero: never counted in since the array was made. Taken from the end,
    /// lowest first.
    clean: Vec<u32>,
    /// Slots that may hold counts: given back in this run, or left free by an earlier agent.
    used: Vec<u32>,
}

impl DecisionSlots {
    /// The slots of an array of `capacity` that `held` (the slots the tries' entries hold) do
    /// not; zero unless `reused` (pinned by an earlier agent).
    pub fn free_besides(capacity: u32, held: impl IntoIterator<Item = u32>, reused: bool) -> Self {
        let mut taken = vec![false; capacity as usize];
        for slot in held {
            if let Some(t) = taken.get_mut(slot as usize) {
                *t = true;
            }
        }
        // The default's slot is never an entry's.
        taken[decision_slot::BY_DEFAULT as usize] = true;
        let free: Vec<u32> = (0..capacity)
            .rev()
            .filter(|s| !taken[*s as usize])
            .collect();
        let (clean, used) = if reused {
            (Vec::new(), free)
        } else {
            (free, Vec::new())
        };
        DecisionSlots {
            capacity,
            clean,
            used,
        }
    }

    /// Whether `slot` is one an entry may hold: neither the default's nor past the array.
    pub fn is_an_entry_s(&self, slot: u32) -> bool {
        slot != decision_slot::BY_DEFAULT && slot < self.capacity
    }

    pub fn any_free(&self) -> bool {
        !self.clean.is_empty() || !self.used.is_empty()
    }

    /// A slot for a new entry, at zero; `decision_slot::UNCOUNTED` when none is left.
    pub fn take(&mut self, counters: &mut DecisionCounters) -> anyhow::Result<u32> {
        if let Some(slot) = self.clean.pop() {
            return Ok(slot);
        }
        let Some(slot) = self.used.pop() else {
            return Ok(decision_slot::UNCOUNTED);
        };
        if let Err(err) = zero(counters, slot) {
            self.used.push(slot);
            return Err(err);
        }
        Ok(slot)
    }

    /// `slot` is no longer an entry's.
    pub fn give_back(&mut self, slot: u32) {
        if self.is_an_entry_s(slot) {
            self.used.push(slot);
        }
    }
}

/// The counters pinned under `pins`; `None` if none are (an agent from before they were).
pub fn open_pinned(pins: &Pins) -> anyhow::Result<Option<DecisionCounters>> {
    if !pins.map(map_names::DECISIONS).exists() {
        return Ok(None);
    }
    pins.open(map_names::DECISIONS).map(Some)
}

/// The decisions counted in `slot`, summed over the CPUs; `None` for an entry without a slot.
pub fn count(counters: &DecisionCounters, slot: u32) -> anyhow::Result<Option<u64>> {
    if slot >= counters.len() {
        return Ok(None);
    }
    let per_cpu = counters.get(&slot, 0)?;
    Ok(Some(
        per_cpu.iter().fold(0u64, |sum, n| sum.wrapping_add(*n)),
    ))
}

/// Every slot's decisions, summed over the CPUs, by slot.
pub fn counts(counters: &DecisionCounters) -> anyhow::Result<Vec<u64>> {
    Ok(batch::per_cpu_totals(counters.map())?)
}

/// One policy entry and the decisions it took.
#[derive(Debug, Clone, Serialize)]
pub struct EntryDecisions {
    pub prefix: IpNet,
    /// A source entry (`nonMasqueradeSrcCIDRs`, `masqueradeSrcCIDRs`), not a destination's.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub source: bool,
    pub action: Action,
    /// `None` when the counters had no slot for it.
    pub decisions: Option<u64>,
}

/// An entry as `status` names it: a source entry says so, as the same prefix may be both.
impl std::fmt::Display for EntryDecisions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.source {
            write!(f, "source {}", self.prefix)
        } else {
            write!(f, "{}", self.prefix)
        }
    }
}

/// The decisions taken, by action; masquerade counts those no entry took.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DecisionTotals {
    pub masquerade: u64,
    pub non_masquerade: u64,
}

impl DecisionTotals {
    /// The totals of `counts` (by slot) for `entries`, each a slot and its entry's action.
    pub fn of(counts: &[u64], entries: impl Iterator<Item = (u32, PrefixAction)>) -> Self {
        let at = |slot: u32| counts.get(slot as usize).copied().unwrap_or(0);
        let mut totals = DecisionTotals {
            masquerade: at(decision_slot::BY_DEFAULT),
            non_masquerade: 0,
        };
        for (slot, action) in entries {
            let total = match action {
                prefix_action::NON_MASQUERADE => &mut totals.non_masquerade,
                _ => &mut totals.masquerade,
            };
            *total += at(slot);
        }
        totals
    }
}

/// What each counted slot's entry does, as of one policy generation: the metrics turn the
/// counts into totals per action with it, and read the tries again only once the generation
/// moves, which it does at every change to them.
#[derive(Debug, Default)]
pub struct SlotActions {
    generation: Option<u32>,
    actions: Vec<(u32, PrefixAction)>,
}

impl SlotActions {
    /// The totals per action of the counters pinned under `pins`; `None` if none are.
    pub fn totals(&mut self, pins: &Pins) -> anyhow::Result<Option<DecisionTotals>> {
        let Some(counters) = open_pinned(pins)? else {
            return Ok(None);
        };
        let generation = PolicyWord(pins.open(map_names::POLICY_GENERATION)?).generation()?;
        if self.generation != Some(generation) {
            self.actions = slot_actions(&TrieEntries::read(pins)?).collect();
            self.generation = Some(generation);
        }
        let counts = counts(&counters)?;
        Ok(Some(DecisionTotals::of(
            &counts,
            self.actions.iter().copied(),
        )))
    }
}

/// Every entry of the policy tries, both families', the destinations' and the sources'.
#[derive(Debug, Default)]
pub struct TrieEntries {
    pub destinations: Vec<(IpNet, PolicyEntry)>,
    pub sources: Vec<(IpNet, PolicyEntry)>,
}

impl TrieEntries {
    /// The tries pinned under `pins`; an agent from before source entries pinned no source
    /// tries.
    pub fn read(pins: &Pins) -> anyhow::Result<TrieEntries> {
        fn both(pins: &Pins, (v4, v6): (&str, &str)) -> anyhow::Result<Vec<(IpNet, PolicyEntry)>> {
            if !pins.map(v4).exists() {
                return Ok(Vec::new());
            }
            let v4 = prefixes::entries::<4>(&pins.open(v4)?);
            let v6 = prefixes::entries::<16>(&pins.open(v6)?);
            let v4 = v4.into_iter().map(|(p, e)| (prefixes::net(p), e));
            let v6 = v6.into_iter().map(|(p, e)| (prefixes::net(p), e));
            Ok(v4.chain(v6).collect())
        }
        Ok(TrieEntries {
            destinations: both(pins, (map_names::NON_MASQ_V4, map_names::NON_MASQ_V6))?,
            sources: both(
                pins,
                (map_names::NON_MASQ_SRC_V4, map_names::NON_MASQ_SRC_V6),
            )?,
        })
    }

    /// Each entry with whether it is a source's.
    fn all(&self) -> impl Iterator<Item = (&(IpNet, PolicyEntry), bool)> {
        let destinations = self.destinations.iter().map(|e| (e, false));
        destinations.chain(self.sources.iter().map(|e| (e, true)))
    }

    /// The policy the tries hold, as the programs decide by it: what an earlier agent left
    /// them, for the first change this agent makes to compare with. IPv6 with no entry reads
    /// as left alone; a flow that was masqueraded holds its NAT entries whatever this says.
    pub fn as_policy(&self) -> Policy {
        // One list's prefixes with `action`, by family.
        let split = |side, action| {
            let (mut v4, mut v6) = (Vec::new(), Vec::new());
            let both = [IpFamily::Ipv4, IpFamily::Ipv6].map(|f| self.with_action(side, f, action));
            for net in both.into_iter().flatten() {
                match net {
                    IpNet::V4(net) => v4.push(net),
                    IpNet::V6(net) => v6.push(net),
                }
            }
            (v4, v6)
        };
        let (non_masq, masq) = (prefix_action::NON_MASQUERADE, prefix_action::MASQUERADE);
        let (non_masq_v4, non_masq_v6) = split(Side::Destinations, non_masq);
        let (masq_v4, masq_v6) = split(Side::Destinations, masq);
        let (non_masq_src_v4, non_masq_src_v6) = split(Side::Sources, non_masq);
        let (masq_src_v4, masq_src_v6) = split(Side::Sources, masq);
        Policy {
            non_masq_v4,
            non_masq_v6: (!non_masq_v6.is_empty()).then_some(non_masq_v6),
            masq_v4,
            masq_v6,
            ipv6_switched_off: false,
            non_masq_src_v4,
            masq_src_v4,
            non_masq_src_v6,
            masq_src_v6,
            masquerade_address_v4: None,
            masquerade_address_v6: None,
        }
    }

    /// The prefixes of `family` in the destinations' or the sources' entries, with `action`.
    pub fn with_action(&self, side: Side, family: IpFamily, action: PrefixAction) -> Vec<IpNet> {
        let list = match side {
            Side::Destinations => &self.destinations,
            Side::Sources => &self.sources,
        };
        let of_family = |net: &IpNet| match net {
            IpNet::V4(_) => family == IpFamily::Ipv4,
            IpNet::V6(_) => family == IpFamily::Ipv6,
        };
        list.iter()
            .filter(|(net, entry)| entry.action == action && of_family(net))
            .map(|(net, _)| *net)
            .collect()
    }
}

/// Which of a packet's addresses a policy entry is matched against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Destinations,
    Sources,
}

/// Each entry's slot and action.
fn slot_actions(entries: &TrieEntries) -> impl Iterator<Item = (u32, PrefixAction)> + '_ {
    entries
        .all()
        .map(|((_, entry), _)| (entry.counted_in, entry.action))
}

/// What each entry of the policy tries decided, as the counters say.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyDecisions {
    /// The counters' slots: entries past them go uncounted.
    pub slots: u32,
    /// Decisions no entry took: masqueraded by default.
    pub by_default: u64,
    pub totals: DecisionTotals,
    /// Every entry, busiest first.
    pub entries: Vec<EntryDecisions>,
}

impl PolicyDecisions {
    /// The decisions of every entry of the tries, from `counts` (by slot).
    pub fn of(slots: u32, counts: &[u64], tries: &TrieEntries) -> PolicyDecisions {
        let decisions = |entry: &PolicyEntry| {
            let slot = entry.counted_in as usize;
            (entry.counted_in < slots).then(|| counts.get(slot).copied().unwrap_or(0))
        };
        let mut entries: Vec<EntryDecisions> = tries
            .all()
            .map(|((prefix, entry), source)| EntryDecisions {
                prefix: *prefix,
                source,
                action: prefixes::action_of(entry.action),
                decisions: decisions(entry),
            })
            .collect();
        entries.sort_by_key(|e| std::cmp::Reverse(e.decisions));
        PolicyDecisions {
            slots,
            by_default: counts
                .get(decision_slot::BY_DEFAULT as usize)
                .copied()
                .unwrap_or(0),
            totals: DecisionTotals::of(counts, slot_actions(tries)),
            entries,
        }
    }

    /// The entries that never decided anything since they were counted.
    pub fn never_matched(&self) -> impl Iterator<Item = &EntryDecisions> {
        self.entries.iter().filter(|e| e.decisions == Some(0))
    }

    pub fn uncounted(&self) -> impl Iterator<Item = &EntryDecisions> {
        self.entries.iter().filter(|e| e.decisions.is_none())
    }
}

/// How many entries `status` names in each of its lists.
const LISTED: usize = 5;

impl std::fmt::Display for PolicyDecisions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "  policy decisions about packets of no known flow: {} masquerade ({} by no \
             entry), {} non-masquerade",
            self.totals.masquerade, self.by_default, self.totals.non_masquerade
        )?;
        let busiest: Vec<_> = self
            .entries
            .iter()
            .filter(|e| e.decisions.is_some_and(|n| n > 0))
            .take(LISTED)
            .collect();
        for e in busiest {
            let n = e.decisions.unwrap_or(0);
            writeln!(f, "  busiest: {e} ({}): {n}", e.action)?;
        }
        list(f, "never matched", self.never_matched())?;
        let uncounted = list(f, "uncounted", self.uncounted())?;
        if uncounted > 0 {
            writeln!(
                f,
                "  ({uncounted} entries past the {} counter slots sized at the agent's start: \
                 a restart counts them)",
                self.slots
            )?;
        }
        Ok(())
    }
}

/// Writes the first of `entries` on one line headed `what`; returns how many there are.
fn list<'a>(
    f: &mut std::fmt::Formatter<'_>,
    what: &str,
    entries: impl Iterator<Item = &'a EntryDecisions>,
) -> Result<usize, std::fmt::Error> {
    let all: Vec<String> = entries.map(ToString::to_string).collect();
    if all.is_empty() {
        return Ok(0);
    }
    let shown = all[..all.len().min(LISTED)].join(", ");
    let more = match all.len().saturating_sub(LISTED) {
        0 => String::new(),
        n => format!(" and {n} more"),
    };
    writeln!(f, "  {what}: {shown}{more}")?;
    Ok(all.len())
}

/// Reads what each entry of the tries pinned under `pins` decided; `None` if no counters are
/// pinned.
pub fn read(pins: &Pins, tries: &TrieEntries) -> anyhow::Result<Option<PolicyDecisions>> {
    let Some(counters) = open_pinned(pins)? else {
        return Ok(None);
    };
    let counts = counts(&counters)?;
    Ok(Some(PolicyDecisions::of(counters.len(), &counts, tries)))
}

fn zero(counters: &mut DecisionCounters, slot: u32) -> anyhow::Result<()> {
    let cpus = aya::util::nr_cpus().map_err(|(_, err)| err)?;
    let zeros = PerCpuValues::try_from(vec![0u64; cpus])?;
    counters.set(slot, zeros, 0)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_slots_are_those_no_entry_holds_nor_the_default_lowest_first() {
        let mut slots = DecisionSlots::free_besides(6, [2, 4, 99], false);
        assert_eq!(slots.clean, [5, 3, 1]);
        assert!(slots.used.is_empty());
        assert!(!slots.is_an_entry_s(decision_slot::BY_DEFAULT));
        assert!(!slots.is_an_entry_s(6));
        assert!(slots.is_an_entry_s(5));
        slots.give_back(4);
        slots.give_back(decision_slot::UNCOUNTED);
        slots.give_back(99);
        assert_eq!(slots.used, [4]);
    }

    #[test]
    fn status_names_a_source_entry_as_one() {
        let entry = |source, decisions| EntryDecisions {
            prefix: "10.244.0.0/16".parse().unwrap(),
            source,
            action: Action::NonMasquerade,
            decisions: Some(decisions),
        };
        let decisions = PolicyDecisions {
            slots: 8,
            by_default: 0,
            totals: DecisionTotals::default(),
            entries: vec![entry(true, 3), entry(false, 0)],
        };
        let text = decisions.to_string();
        assert!(
            text.contains("  busiest: source 10.244.0.0/16 (non-masquerade): 3\n"),
            "{text}"
        );
        assert!(text.contains("  never matched: 10.244.0.0/16\n"), "{text}");
    }

    #[test]
    fn an_earlier_agent_s_free_slots_may_hold_counts() {
        let slots = DecisionSlots::free_besides(4, [1], true);
        assert!(slots.clean.is_empty());
        assert_eq!(slots.used, [3, 2]);
    }
}

//! The policy as the programs read it: per family, the policy trie they look destinations up
//! in (each prefix with its action: the longest prefix of a destination decides it), and the
//! trie of prefixes that stopped keeping the pod's address lately, toward which TCP connections
//! that started unmasqueraded stay so until they may have gone idle; and the generation that
//! invalidates the programs' cached verdicts whenever a trie changes, so that no new flow is
//! judged by a policy no longer in force. Each entry also names the slot that counts its
//! decisions (see `decisions`).

use std::{
    collections::BTreeMap,
    net::IpAddr,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use aya::maps::{Array, LpmTrie, MapData, lpm_trie::Key};
use ipnet::IpNet;
use masq_ebpf::{PolicyEntry, PrefixAction, decision_slot, prefix_action};

use super::{
    decisions::{DecisionCounters, DecisionSlots},
    expiry,
};
use crate::{
    dataplane::walk_sorted,
    policy::{Action, IpFamily, Policy, Rules},
};

/// An LPM trie key as plain data: prefix length in bits, then the address bytes.
pub type Prefix<const N: usize> = (u32, [u8; N]);

/// A family's policy trie.
pub type PolicyTrie<const N: usize> = LpmTrie<MapData, [u8; N], PolicyEntry>;

/// One family's tries.
pub struct FamilyTries<const N: usize> {
    /// The policy's prefixes, each with its action and the slot counting its decisions.
    pub non_masq: PolicyTrie<N>,
    /// The prefixes that stopped keeping the pod's address, with when (seconds of
    /// CLOCK_MONOTONIC).
    pub draining: LpmTrie<MapData, [u8; N], u32>,
    /// What the policy trie holds, as this agent last read or wrote it; `None` when it must be
    /// read again. A trie of 100 000 prefixes takes 200 000 system calls to read.
    pub installed: Option<BTreeMap<Prefix<N>, PolicyEntry>>,
}

impl<const N: usize> FamilyTries<N> {
    pub fn new(
        non_masq: PolicyTrie<N>,
        draining: LpmTrie<MapData, [u8; N], u32>,
    ) -> FamilyTries<N> {
        FamilyTries {
            non_masq,
            draining,
            installed: None,
        }
    }

    /// What the policy trie holds: as last known, or read from the kernel.
    fn current(&mut self) -> BTreeMap<Prefix<N>, PolicyEntry> {
        self.installed
            .take()
            .unwrap_or_else(|| entries(&self.non_masq))
    }
}

/// What a policy change does to the draining trie.
struct DrainingChange<const N: usize> {
    /// Prefixes whose destinations kept the pod's address and no longer do: non-masquerade
    /// prefixes removed, and exceptions that cut into a prefix that kept it.
    start: Vec<Prefix<N>>,
    /// Exceptions that are gone: their destinations are decided as before they came.
    end: Vec<Prefix<N>>,
}

impl<const N: usize> DrainingChange<N> {
    fn between(
        current: &BTreeMap<Prefix<N>, PolicyEntry>,
        difference: &Difference<N>,
    ) -> DrainingChange<N> {
        let removed_with = |value| {
            difference
                .removed
                .iter()
                .filter(move |(_, entry)| entry.action == value)
                .map(|(prefix, _)| *prefix)
        };
        let new_exceptions = difference
            .written
            .iter()
            .filter(|(prefix, action, before)| {
                *action == prefix_action::MASQUERADE
                    && before.map(|e| e.action) != Some(prefix_action::MASQUERADE)
                    && longest_match(current, *prefix).map(|e| e.action)
                        == Some(prefix_action::NON_MASQUERADE)
            })
            .map(|(prefix, _, _)| *prefix);
        DrainingChange {
            start: removed_with(prefix_action::NON_MASQUERADE)
                .chain(new_exceptions)
                .collect(),
            end: removed_with(prefix_action::MASQUERADE).collect(),
        }
    }
}

/// How the policy trie, which holds `current`, must change to hold `desired`: found in one
/// walk over both, which are sorted alike. A trie of 100 000 prefixes is compared in a few
/// milliseconds, where looking each prefix up in the other map took tens.
struct Difference<const N: usize> {
    /// Prefixes to write: new ones, those whose action changes, and those that keep their
    /// action but need a slot; each with what it held before, if anything.
    written: Vec<(Prefix<N>, PrefixAction, Option<PolicyEntry>)>,
    /// Prefixes to take out, with what they held.
    removed: Vec<(Prefix<N>, PolicyEntry)>,
}

impl<const N: usize> Difference<N> {
    fn between(
        current: &BTreeMap<Prefix<N>, PolicyEntry>,
        desired: &BTreeMap<Prefix<N>, PrefixAction>,
        keeps_slot: impl Fn(&PolicyEntry) -> bool,
    ) -> Difference<N> {
        let mut difference = Difference {
            written: Vec::new(),
            removed: Vec::new(),
        };
        walk_sorted(current, desired, |prefix, entry, action| {
            match (entry, action) {
                (Some(entry), Some(action)) if entry.action == *action && keeps_slot(entry) => {}
                (before, Some(action)) => {
                    difference.written.push((*prefix, *action, before.copied()))
                }
                (Some(entry), None) => difference.removed.push((*prefix, *entry)),
                (None, None) => {}
            }
        });
        difference
    }
}

/// The value of the longest prefix in `entries` that holds all of `prefix` (itself included),
/// as the trie would answer for its addresses.
fn longest_match<const N: usize, V: Copy>(
    entries: &BTreeMap<Prefix<N>, V>,
    (len, data): Prefix<N>,
) -> Option<V> {
    (0..=len).rev().find_map(|shorter| {
        let mut network = data;
        for (i, byte) in network.iter_mut().enumerate() {
            let kept = shorter.saturating_sub(8 * i as u32).min(8);
            *byte &= !(0xffu8.checked_shr(kept).unwrap_or(0));
        }
        entries.get(&(shorter, network)).copied()
    })
}

/// The trie's value for an action.
pub fn action_value(action: Action) -> PrefixAction {
    match action {
        Action::NonMasquerade => prefix_action::NON_MASQUERADE,
        Action::Masquerade => prefix_action::MASQUERADE,
    }
}

/// A family's rules as trie entries; the rules of the other family are left out.
fn trie_entries<const N: usize>(rules: &Rules) -> BTreeMap<Prefix<N>, PrefixAction> {
    rules
        .iter()
        .filter_map(|(net, action)| {
            let octets: [u8; N] = match net.network() {
                IpAddr::V4(addr) => addr.octets().as_slice().try_into().ok()?,
                IpAddr::V6(addr) => addr.octets().as_slice().try_into().ok()?,
            };
            Some(((u32::from(net.prefix_len()), octets), action_value(*action)))
        })
        .collect()
}

/// The maps that hold the policy.
pub struct PolicyMaps {
    pub v4: FamilyTries<4>,
    pub v6: FamilyTries<16>,
    /// What the programs tag their cached verdicts with.
    pub generation: Array<MapData, u32>,
    /// Per CPU, the decisions each entry took, in its slot.
    pub decisions: DecisionCounters,
    slots: DecisionSlots,
    /// What the agent knows of flows that outlived the policy (see `strays`).
    pub strays: StrayWatch,
}

/// When a flow's entry may last have come to lead toward a destination the policy leaves alone,
/// and whether the NAT tables were checked since.
pub struct StrayWatch {
    pub possible_since: Instant,
    pub checked: bool,
}

impl StrayWatch {
    /// Clears `policy_word::STRAYS_CLEARED`, so that the programs look every packet up again,
    /// and moves the generation on with it: a verdict cached before may come from a trie that
    /// changed since without a move (an agent killed between the two), and would go on
    /// judging new flows by it.
    fn lower(&mut self, generation: &mut Array<MapData, u32>) -> anyhow::Result<()> {
        next_generation(generation)?;
        self.possible_since = Instant::now();
        self.checked = false;
        Ok(())
    }
}

impl PolicyMaps {
    /// The policy maps, their entries' slots as the tries hold them; `reused_decisions` says
    /// whether `decisions` is an earlier agent's, whose free slots may hold counts.
    pub fn new(
        mut v4: FamilyTries<4>,
        mut v6: FamilyTries<16>,
        generation: Array<MapData, u32>,
        decisions: DecisionCounters,
        reused_decisions: bool,
    ) -> PolicyMaps {
        let (held_v4, held_v6) = (v4.current(), v6.current());
        let held = held_v4.values().chain(held_v6.values());
        let held = held.map(|entry| entry.counted_in);
        let slots = DecisionSlots::free_besides(decisions.len(), held, reused_decisions);
        (v4.installed, v6.installed) = (Some(held_v4), Some(held_v6));
        PolicyMaps {
            v4,
            v6,
            generation,
            decisions,
            slots,
            strays: StrayWatch {
                possible_since: Instant::now(),
                checked: false,
            },
        }
    }

    /// Whether the programs skip the NAT table toward destinations the policy leaves alone.
    pub fn strays_cleared(&self) -> anyhow::Result<bool> {
        let word = self.generation.get(&0, 0)?;
        Ok(masq_ebpf::policy_word::strays_cleared(word))
    }

    /// Says that a flow's entry may lead toward a destination the policy leaves alone.
    pub fn lower_strays_cleared(&mut self) -> anyhow::Result<()> {
        self.strays.lower(&mut self.generation)
    }

    /// Says that no flow's entry does, as a check found.
    pub fn raise_strays_cleared(&mut self) -> anyhow::Result<()> {
        let word = self.generation.get(&0, 0)?;
        self.generation
            .set(0, word | masq_ebpf::policy_word::STRAYS_CLEARED, 0)?;
        Ok(())
    }

    /// Makes the tries hold `policy`'s prefixes. Returns whether anything changed.
    pub fn sync(&mut self, policy: &Policy) -> anyhow::Result<bool> {
        let v4 = policy.rules(IpFamily::Ipv4).unwrap_or_default();
        let mut changed = self.set_rules(IpFamily::Ipv4, &v4)?;
        if let Some(v6) = policy.rules(IpFamily::Ipv6) {
            changed |= self.set_rules(IpFamily::Ipv6, &v6)?;
        }
        Ok(changed)
    }

    /// Makes one family's trie hold `rules`. Returns whether it changed.
    pub fn set_rules(&mut self, family: IpFamily, rules: &Rules) -> anyhow::Result<bool> {
        let mut counting = Counting {
            slots: &mut self.slots,
            counters: &mut self.decisions,
        };
        match family {
            IpFamily::Ipv4 => self.v4.sync(
                trie_entries(rules),
                &mut self.generation,
                &mut self.strays,
                &mut counting,
            ),
            IpFamily::Ipv6 => self.v6.sync(
                trie_entries(rules),
                &mut self.generation,
                &mut self.strays,
                &mut counting,
            ),
        }
    }

    /// Makes one family's trie hold `nets`, all non-masquerade. Returns whether it changed.
    pub fn set_non_masq<N: Into<IpNet> + Copy>(
        &mut self,
        family: IpFamily,
        nets: &[N],
    ) -> anyhow::Result<bool> {
        let rules: Rules = nets
            .iter()
            .map(|&n| (n.into(), Action::NonMasquerade))
            .collect();
        self.set_rules(family, &rules)
    }

    /// Ends the draining of prefixes removed longer ago than `drain`.
    pub fn expire_draining(&mut self, drain: Duration, now_ns: u64) -> anyhow::Result<()> {
        self.v4.expire_draining(drain, now_ns)?;
        self.v6.expire_draining(drain, now_ns)
    }

    /// The next sync reads the tries back from the kernel, and writes whatever differs.
    pub fn verify_next_sync(&mut self) {
        self.v4.installed = None;
        self.v6.installed = None;
    }
}

/// What a sync wrote to a policy trie, and took out of it.
struct Written<const N: usize> {
    entries: Vec<(Prefix<N>, PolicyEntry)>,
    removed: Vec<Prefix<N>>,
}

impl<const N: usize> Written<N> {
    fn changed(&self) -> bool {
        !self.entries.is_empty() || !self.removed.is_empty()
    }
}

/// The decision counters and their free slots, as a sync hands slots out and takes them back.
struct Counting<'a> {
    slots: &'a mut DecisionSlots,
    counters: &'a mut DecisionCounters,
}

impl Counting<'_> {
    /// Whether `entry` keeps its slot: one of the array's, or none while none is free.
    fn keeps_slot(&self, entry: &PolicyEntry) -> bool {
        self.slots.is_an_entry_s(entry.counted_in)
            || (entry.counted_in == decision_slot::UNCOUNTED && !self.slots.any_free())
    }
}

impl<const N: usize> FamilyTries<N> {
    /// Makes the policy trie hold `desired` (prefix lengths and network addresses, with their
    /// actions), draining the prefixes that stop keeping the pod's address, and moves the policy
    /// generation on, so that the programs' cached verdicts go stale. Returns whether the trie
    /// changed.
    ///
    /// A prefix starts draining before the trie changes, so that no packet of a connection
    /// that started unmasqueraded ever meets the new policy undrained; it stops draining only
    /// after the trie changed.
    fn sync(
        &mut self,
        desired: BTreeMap<Prefix<N>, PrefixAction>,
        generation: &mut Array<MapData, u32>,
        strays: &mut StrayWatch,
        counting: &mut Counting,
    ) -> anyhow::Result<bool> {
        let mut current = self.current();
        let difference = Difference::between(&current, &desired, |e| counting.keeps_slot(e));
        if !difference.written.is_empty() || !difference.removed.is_empty() {
            // Before the trie changes: a flow's entry may lead toward a destination it now
            // leaves alone, and the programs must look every packet up again.
            strays.lower(generation)?;
        }
        let change = DrainingChange::between(&current, &difference);
        let now = seconds(expiry::monotonic_now_ns());
        for (len, data) in &change.start {
            self.draining.insert(&Key::new(*len, *data), now, 0)?;
        }
        let synced = self.write_policy(&current, difference, counting);
        // Even a sync that failed half-way may have changed the trie: no cached verdict survives
        // it, and the trie is read again next time.
        if !matches!(&synced, Ok(written) if !written.changed()) {
            next_generation(generation)?;
        }
        let written = synced?;
        let changed = written.changed();
        for prefix in &written.removed {
            current.remove(prefix);
        }
        current.extend(written.entries);
        self.installed = Some(current);
        self.end_draining(&change, &desired)?;
        Ok(changed)
    }

    /// Makes the policy trie, which holds `current`, hold exactly `desired`: longer prefixes
    /// before shorter ones, so that an exception is in place before the prefix it cuts into, and
    /// every write before any removal, so that a prefix that stays is never missing, not even
    /// for a moment. A prefix that keeps its action keeps its slot; a new one, or one whose
    /// action changed, is counted from zero. A failed write rolls back what this call wrote.
    /// Returns what it wrote.
    fn write_policy(
        &mut self,
        current: &BTreeMap<Prefix<N>, PolicyEntry>,
        difference: Difference<N>,
        counting: &mut Counting,
    ) -> anyhow::Result<Written<N>> {
        let trie = &mut self.non_masq;
        let mut writes = difference.written;
        writes.sort_by_key(|((len, _), _, _)| std::cmp::Reverse(*len));
        let mut written: Vec<(Prefix<N>, PolicyEntry)> = Vec::new();
        // The slots of entries overwritten: given back once every write is done, so that none
        // counts for another entry in this sync.
        let mut replaced = Vec::new();
        let mut uncounted = 0;
        for (prefix @ (len, data), action, before) in writes {
            let written_now = counting
                .slots
                .take(counting.counters)
                .and_then(|counted_in| {
                    let entry = PolicyEntry {
                        counted_in,
                        action,
                        ..PolicyEntry::default()
                    };
                    // Still no slot for an entry that had none: nothing to write.
                    if before == Some(entry) {
                        return Ok(None);
                    }
                    match trie.insert(&Key::new(len, data), entry, 0) {
                        Ok(()) => Ok(Some(entry)),
                        Err(err) => {
                            counting.slots.give_back(counted_in);
                            Err(err).context("writing a prefix to the policy trie")
                        }
                    }
                });
            match written_now {
                Ok(Some(entry)) => {
                    uncounted += usize::from(entry.counted_in == decision_slot::UNCOUNTED);
                    replaced.extend(before.map(|b| b.counted_in));
                    written.push((prefix, entry));
                }
                Ok(None) => {}
                Err(err) => {
                    roll_back(trie, current, &written, counting.slots);
                    return Err(err);
                }
            }
        }
        for slot in replaced {
            counting.slots.give_back(slot);
        }
        let mut removed = Vec::new();
        for ((len, data), entry) in difference.removed {
            trie.remove(&Key::new(len, data))
                .context("removing a prefix from the policy trie")?;
            counting.slots.give_back(entry.counted_in);
            removed.push((len, data));
        }
        if uncounted > 0 {
            tracing::warn!(
                uncounted,
                slots = counting.counters.len(),
                "policy entries whose decisions go uncounted: the counters were sized for the \
                 policy the agent started with; a restart sizes them for this one"
            );
        }
        Ok(Written {
            entries: written,
            removed,
        })
    }

    /// Ends the draining of the prefixes that keep the pod's address again, and of the
    /// exceptions that are gone: their destinations are decided as before they came.
    fn end_draining(
        &mut self,
        change: &DrainingChange<N>,
        policy: &BTreeMap<Prefix<N>, PrefixAction>,
    ) -> anyhow::Result<()> {
        let back: Vec<Key<[u8; N]>> = self
            .draining
            .keys()
            .filter_map(Result::ok)
            .filter(|k| {
                let prefix = (k.prefix_len(), k.data());
                policy.get(&prefix) == Some(&prefix_action::NON_MASQUERADE)
                    || change.end.contains(&prefix)
            })
            .collect();
        for key in back {
            self.draining.remove(&key)?;
        }
        Ok(())
    }

    fn expire_draining(&mut self, drain: Duration, now_ns: u64) -> anyhow::Result<()> {
        let done: Vec<Key<[u8; N]>> = self
            .draining
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, since)| {
                u64::from(seconds(now_ns).saturating_sub(*since)) > drain.as_secs()
            })
            .map(|(key, _)| key)
            .collect();
        for key in done {
            self.draining.remove(&key)?;
        }
        Ok(())
    }
}

/// Puts back what a failed sync `written` over `current`, and gives back the slots it took.
fn roll_back<const N: usize>(
    trie: &mut PolicyTrie<N>,
    current: &BTreeMap<Prefix<N>, PolicyEntry>,
    written: &[(Prefix<N>, PolicyEntry)],
    slots: &mut DecisionSlots,
) {
    for (prefix @ (len, data), entry) in written {
        let key = Key::new(*len, *data);
        let _ = match current.get(prefix) {
            Some(before) => trie.insert(&key, before, 0),
            None => trie.remove(&key),
        };
        slots.give_back(entry.counted_in);
    }
}

fn next_generation(generation: &mut Array<MapData, u32>) -> anyhow::Result<()> {
    let current = generation.get(&0, 0)?;
    generation.set(0, masq_ebpf::verdict_slot::next(current), 0)?;
    Ok(())
}

/// The prefixes the policy trie holds, with their entries.
pub fn entries<const N: usize>(trie: &PolicyTrie<N>) -> BTreeMap<Prefix<N>, PolicyEntry> {
    trie.iter()
        .filter_map(Result::ok)
        .map(|(k, entry)| ((k.prefix_len(), k.data()), entry))
        .collect()
}

/// A prefix as the config writes it.
pub fn written<const N: usize>((len, data): Prefix<N>) -> String
where
    IpAddr: From<[u8; N]>,
{
    format!("{}/{len}", IpAddr::from(data))
}

fn seconds(ns: u64) -> u32 {
    (ns / 1_000_000_000) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(list: &[(&str, Action)]) -> BTreeMap<Prefix<4>, PrefixAction> {
        let rules: Rules = list.iter().map(|(n, a)| (n.parse().unwrap(), *a)).collect();
        trie_entries(&rules)
    }

    fn prefix(net: &str) -> Prefix<4> {
        let net: ipnet::Ipv4Net = net.parse().unwrap();
        (u32::from(net.prefix_len()), net.network().octets())
    }

    const KEEP: Action = Action::NonMasquerade;
    const MASQ: Action = Action::Masquerade;

    #[test]
    fn the_longest_match_of_a_prefix_is_the_trie_s_answer() {
        let e = entries(&[("10.0.0.0/8", KEEP), ("10.100.0.0/16", MASQ)]);
        let at = |net| longest_match(&e, prefix(net));
        assert_eq!(at("10.100.10.0/24"), Some(prefix_action::MASQUERADE));
        assert_eq!(at("10.1.0.0/24"), Some(prefix_action::NON_MASQUERADE));
        assert_eq!(at("10.0.0.0/8"), Some(prefix_action::NON_MASQUERADE));
        assert_eq!(at("11.0.0.0/24"), None);
        assert_eq!(at("10.100.0.0/15"), Some(prefix_action::NON_MASQUERADE));
    }

    #[test]
    fn only_destinations_that_kept_their_address_drain() {
        let current: BTreeMap<Prefix<4>, PolicyEntry> = entries(&[
            ("10.0.0.0/8", KEEP),
            ("192.168.0.0/16", KEEP),
            ("10.9.0.0/16", MASQ),
        ])
        .into_iter()
        .enumerate()
        .map(|(slot, (prefix, action))| {
            let entry = PolicyEntry {
                counted_in: slot as u32 + 1,
                action,
                ..PolicyEntry::default()
            };
            (prefix, entry)
        })
        .collect();
        let desired = entries(&[
            ("10.0.0.0/8", KEEP),
            // An exception inside a prefix that kept addresses: drains.
            ("10.100.10.0/24", MASQ),
            // One where nothing kept them: does not.
            ("203.0.113.0/24", MASQ),
        ]);
        let change = |current: &BTreeMap<Prefix<4>, PolicyEntry>| {
            let difference = Difference::between(current, &desired, |_| true);
            DrainingChange::between(current, &difference)
        };
        let changed = change(&current);
        assert_eq!(
            changed.start,
            [prefix("192.168.0.0/16"), prefix("10.100.10.0/24")]
        );
        assert_eq!(changed.end, [prefix("10.9.0.0/16")]);
        // A prefix and its exception added together: nothing kept the exception's addresses.
        let changed = change(&BTreeMap::new());
        assert!(changed.start.is_empty() && changed.end.is_empty());
    }

    #[test]
    fn the_difference_is_found_in_one_walk() {
        let entry = |counted_in, action| PolicyEntry {
            counted_in,
            action,
            ..PolicyEntry::default()
        };
        let (keep, masq) = (prefix_action::NON_MASQUERADE, prefix_action::MASQUERADE);
        let current: BTreeMap<Prefix<4>, PolicyEntry> = [
            (prefix("10.0.0.0/8"), entry(1, keep)),
            (prefix("10.9.0.0/16"), entry(2, masq)),
            (
                prefix("172.16.0.0/12"),
                entry(decision_slot::UNCOUNTED, keep),
            ),
            (prefix("192.168.0.0/16"), entry(3, keep)),
        ]
        .into();
        let desired = entries(&[
            ("10.0.0.0/8", KEEP),
            ("10.9.0.0/16", KEEP),
            ("172.16.0.0/12", KEEP),
            ("198.18.0.0/15", KEEP),
        ]);
        let keeps_slot = |e: &PolicyEntry| e.counted_in != decision_slot::UNCOUNTED;
        let difference = Difference::between(&current, &desired, keeps_slot);
        assert_eq!(
            difference.written,
            [
                // In the maps' order, shorter prefixes first. It keeps its action, but has no
                // slot.
                (
                    prefix("172.16.0.0/12"),
                    keep,
                    Some(entry(decision_slot::UNCOUNTED, keep))
                ),
                (prefix("198.18.0.0/15"), keep, None),
                // Its action changes.
                (prefix("10.9.0.0/16"), keep, Some(entry(2, masq))),
            ]
        );
        assert_eq!(
            difference.removed,
            [(prefix("192.168.0.0/16"), entry(3, keep))]
        );
    }
}

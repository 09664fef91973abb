//! What a policy change writes to a family's tries, found before anything is written: the
//! prefixes written and removed (`Difference`), and the prefixes that start or end draining
//! (`DrainingChange`).

use std::collections::BTreeMap;

use masq_ebpf::{PolicyEntry, PrefixAction, prefix_action};

use super::prefixes::Prefix;
use crate::dataplane::sorted::walk_sorted;

/// What a policy change does to the draining trie.
pub struct DrainingChange<const N: usize> {
    /// Prefixes whose destinations kept the pod's address and no longer do: non-masquerade
    /// prefixes removed, and exceptions that cut into a prefix that kept it.
    pub start: Vec<Prefix<N>>,
    /// Exceptions that are gone: their destinations are decided as before they came.
    pub end: Vec<Prefix<N>>,
}

impl<const N: usize> DrainingChange<N> {
    pub fn between(
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
pub struct Difference<const N: usize> {
    /// Prefixes to write: new ones, those whose action changes, and those that keep their
    /// action but need a slot; each with what it held before, if anything.
    pub written: Vec<(Prefix<N>, PrefixAction, Option<PolicyEntry>)>,
    /// Prefixes to take out, with what they held.
    pub removed: Vec<(Prefix<N>, PolicyEntry)>,
}

impl<const N: usize> Difference<N> {
    pub fn between(
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

#[cfg(test)]
mod tests {
    use masq_ebpf::{PolicyEntry, decision_slot};

    use super::*;
    use crate::policy::{Action, Rules};

    fn entries(list: &[(&str, Action)]) -> BTreeMap<Prefix<4>, PrefixAction> {
        let rules: Rules = list.iter().map(|(n, a)| (n.parse().unwrap(), *a)).collect();
        super::super::prefixes::trie_entries(&rules)
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

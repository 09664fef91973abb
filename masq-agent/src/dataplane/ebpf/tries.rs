//! The policy as the programs read it: per family, the policy trie they look destinations up
//! in (each prefix with its action: the longest prefix of a destination decides it), and the
//! trie of prefixes that stopped keeping the pod's address lately, toward which TCP connections
//! that started unmasqueraded stay so until they may have gone idle; and the generation that
//! invalidates the programs' cached verdicts whenever a trie changes, so that no new flow is
//! judged by a policy no longer in force.

use std::{collections::BTreeMap, net::IpAddr, time::Duration};

use anyhow::Context as _;
use aya::maps::{Array, LpmTrie, MapData, lpm_trie::Key};
use ipnet::{Ipv4Net, Ipv6Net};
use masq_ebpf::{PrefixAction, prefix_action};

use super::expiry;
use crate::policy::{Action, IpFamily, Policy, Rules};

/// An LPM trie key as plain data: prefix length in bits, then the address bytes.
pub type Prefix<const N: usize> = (u32, [u8; N]);

/// One family's tries.
pub struct FamilyTries<const N: usize> {
    /// The policy's prefixes, each with its action.
    pub non_masq: LpmTrie<MapData, [u8; N], PrefixAction>,
    /// The prefixes that stopped keeping the pod's address, with when (seconds of
    /// CLOCK_MONOTONIC).
    pub draining: LpmTrie<MapData, [u8; N], u32>,
}

/// What a policy change does to the draining trie.
struct DrainingChange<const N: usize> {
    /// Prefixes that kept the pod's address and no longer do: removed, or made exceptions;
    /// and new exceptions, under which destinations may have kept their address by a shorter
    /// prefix.
    start: Vec<Prefix<N>>,
    /// Exceptions that are gone: their destinations are decided as before they came.
    end: Vec<Prefix<N>>,
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
}

impl PolicyMaps {
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
        match family {
            IpFamily::Ipv4 => self.v4.sync(trie_entries(rules), &mut self.generation),
            IpFamily::Ipv6 => self.v6.sync(trie_entries(rules), &mut self.generation),
        }
    }

    /// Makes the IPv4 trie hold `nets`, all non-masquerade. Returns whether it changed.
    pub fn set_v4(&mut self, nets: &[Ipv4Net]) -> anyhow::Result<bool> {
        let rules: Rules = nets
            .iter()
            .map(|&n| (n.into(), Action::NonMasquerade))
            .collect();
        self.set_rules(IpFamily::Ipv4, &rules)
    }

    /// The same for IPv6.
    pub fn set_v6(&mut self, nets: &[Ipv6Net]) -> anyhow::Result<bool> {
        let rules: Rules = nets
            .iter()
            .map(|&n| (n.into(), Action::NonMasquerade))
            .collect();
        self.set_rules(IpFamily::Ipv6, &rules)
    }

    /// Ends the draining of prefixes removed longer ago than `drain`.
    pub fn expire_draining(&mut self, drain: Duration, now_ns: u64) -> anyhow::Result<()> {
        self.v4.expire_draining(drain, now_ns)?;
        self.v6.expire_draining(drain, now_ns)
    }
}

impl<const N: usize> FamilyTries<N> {
    /// Makes the policy trie hold `desired` (prefix lengths and network addresses, with their
    /// actions), starts draining the prefixes that stopped keeping the pod's address, and moves
    /// the policy generation on, so that the programs' cached verdicts go stale. Returns whether
    /// the trie changed.
    fn sync(
        &mut self,
        desired: BTreeMap<Prefix<N>, PrefixAction>,
        generation: &mut Array<MapData, u32>,
    ) -> anyhow::Result<bool> {
        let synced = self.sync_policy(&desired);
        // Even a sync that failed half-way may have changed the trie: no cached verdict survives it.
        if !matches!(synced, Ok((false, _))) {
            next_generation(generation)?;
        }
        let (changed, draining) = synced?;
        self.sync_draining(&draining, &desired, expiry::monotonic_now_ns())?;
        Ok(changed)
    }

    /// Makes the policy trie hold exactly `desired`, adding and updating before removing, so
    /// that a prefix that stays is never missing, not even for a moment. A failed write rolls
    /// back what this call wrote, so the previous policy stays whole. Returns whether anything
    /// changed, and what changes for the draining trie.
    fn sync_policy(
        &mut self,
        desired: &BTreeMap<Prefix<N>, PrefixAction>,
    ) -> anyhow::Result<(bool, DrainingChange<N>)> {
        let trie = &mut self.non_masq;
        let current = entries(trie);
        let mut written: Vec<(Prefix<N>, Option<PrefixAction>)> = Vec::new();
        for (prefix, action) in desired {
            let before = current.get(prefix).copied();
            if before == Some(*action) {
                continue;
            }
            let (len, data) = *prefix;
            if let Err(err) = trie.insert(&Key::new(len, data), action, 0) {
                for ((len, data), before) in &written {
                    let key = Key::new(*len, *data);
                    let _ = match before {
                        Some(value) => trie.insert(&key, value, 0),
                        None => trie.remove(&key),
                    };
                }
                return Err(err).context("writing a prefix to the policy trie");
            }
            written.push((*prefix, before));
        }
        let removed: Vec<(Prefix<N>, PrefixAction)> = current
            .iter()
            .filter(|(prefix, _)| !desired.contains_key(prefix))
            .map(|(prefix, action)| (*prefix, *action))
            .collect();
        for ((len, data), _) in &removed {
            trie.remove(&Key::new(*len, *data))
                .context("removing a prefix from the policy trie")?;
        }
        let kept_address = |action: Option<PrefixAction>| {
            action.is_none_or(|a| a == prefix_action::NON_MASQUERADE)
        };
        let removed_with = |value| {
            removed
                .iter()
                .filter(move |(_, action)| *action == value)
                .map(|(prefix, _)| *prefix)
        };
        let start = removed_with(prefix_action::NON_MASQUERADE)
            .chain(
                written
                    .iter()
                    .filter(|(prefix, before)| {
                        desired[prefix] == prefix_action::MASQUERADE && kept_address(*before)
                    })
                    .map(|(prefix, _)| *prefix),
            )
            .collect();
        let end = removed_with(prefix_action::MASQUERADE).collect();
        let changed = !written.is_empty() || !removed.is_empty();
        Ok((changed, DrainingChange { start, end }))
    }

    /// Keeps prefixes that stopped keeping the pod's address in the draining trie for as long
    /// as a TCP connection may stay idle, so that connections that started unmasqueraded keep
    /// their addresses; a prefix that keeps the address again, or an exception that is gone,
    /// stops draining.
    fn sync_draining(
        &mut self,
        change: &DrainingChange<N>,
        policy: &BTreeMap<Prefix<N>, PrefixAction>,
        now_ns: u64,
    ) -> anyhow::Result<()> {
        for (len, data) in &change.start {
            self.draining
                .insert(&Key::new(*len, *data), seconds(now_ns), 0)?;
        }
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

fn next_generation(generation: &mut Array<MapData, u32>) -> anyhow::Result<()> {
    let current = generation.get(&0, 0)?;
    generation.set(0, masq_ebpf::verdict_slot::next(current), 0)?;
    Ok(())
}

/// The prefixes the policy trie holds, with their actions.
pub fn entries<const N: usize>(
    trie: &LpmTrie<MapData, [u8; N], PrefixAction>,
) -> BTreeMap<Prefix<N>, PrefixAction> {
    trie.iter()
        .filter_map(Result::ok)
        .map(|(k, action)| ((k.prefix_len(), k.data()), action))
        .collect()
}

fn seconds(ns: u64) -> u32 {
    (ns / 1_000_000_000) as u32
}

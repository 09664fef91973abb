//! The policy as the programs read it: per family, the non-masquerade trie they look
//! destinations up in, and the trie of prefixes removed lately, toward which TCP connections
//! that started unmasqueraded stay so until they may have gone idle; and the generation that
//! invalidates the programs' cached verdicts whenever a trie changes, so that no new flow is
//! judged by a policy no longer in force.

use std::{collections::BTreeSet, time::Duration};

use anyhow::Context as _;
use aya::maps::{Array, LpmTrie, MapData, lpm_trie::Key};
use ipnet::{Ipv4Net, Ipv6Net};
use masq_ebpf::NON_MASQ_PRESENT;

use super::expiry;
use crate::policy::Policy;

/// An LPM trie key as plain data: prefix length in bits, then the address bytes.
pub type Prefix<const N: usize> = (u32, [u8; N]);

/// One family's tries.
pub struct FamilyTries<const N: usize> {
    /// The non-masquerade prefixes.
    pub non_masq: LpmTrie<MapData, [u8; N], u8>,
    /// The prefixes removed from `non_masq`, with when (seconds of CLOCK_MONOTONIC).
    pub draining: LpmTrie<MapData, [u8; N], u32>,
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
        let mut changed = self.set_v4(&policy.non_masq_v4)?;
        if let Some(v6) = &policy.non_masq_v6 {
            changed |= self.set_v6(v6)?;
        }
        Ok(changed)
    }

    /// Makes the IPv4 trie hold `nets`. Returns whether it changed.
    pub fn set_v4(&mut self, nets: &[Ipv4Net]) -> anyhow::Result<bool> {
        let desired = nets.iter().map(|n| (n.prefix_len(), n.network().octets()));
        self.v4.sync(desired, &mut self.generation)
    }

    /// Makes the IPv6 trie hold `nets`. Returns whether it changed.
    pub fn set_v6(&mut self, nets: &[Ipv6Net]) -> anyhow::Result<bool> {
        let desired = nets.iter().map(|n| (n.prefix_len(), n.network().octets()));
        self.v6.sync(desired, &mut self.generation)
    }

    /// Ends the draining of prefixes removed longer ago than `drain`.
    pub fn expire_draining(&mut self, drain: Duration, now_ns: u64) -> anyhow::Result<()> {
        self.v4.expire_draining(drain, now_ns)?;
        self.v6.expire_draining(drain, now_ns)
    }
}

impl<const N: usize> FamilyTries<N> {
    /// Makes the non-masquerade trie hold `desired` (prefix lengths and network addresses),
    /// starts the removed prefixes draining, and moves the policy generation on, so that the
    /// programs' cached verdicts go stale. Returns whether the trie changed.
    fn sync(
        &mut self,
        desired: impl Iterator<Item = (u8, [u8; N])>,
        generation: &mut Array<MapData, u32>,
    ) -> anyhow::Result<bool> {
        let desired: BTreeSet<Prefix<N>> =
            desired.map(|(len, addr)| (u32::from(len), addr)).collect();
        let synced = self.sync_non_masq(&desired);
        // Even a sync that failed half-way may have changed the trie: no cached verdict survives it.
        if !matches!(synced, Ok((false, _))) {
            next_generation(generation)?;
        }
        let (changed, removed) = synced?;
        self.sync_draining(&removed, &desired, expiry::monotonic_now_ns())?;
        Ok(changed)
    }

    /// Makes the non-masquerade trie hold exactly `desired`, adding before removing so that a
    /// prefix that stays is never missing, not even for a moment. A failed insert rolls back
    /// what this call added, so the previous policy stays whole. Returns whether anything
    /// changed, and what was removed.
    fn sync_non_masq(
        &mut self,
        desired: &BTreeSet<Prefix<N>>,
    ) -> anyhow::Result<(bool, Vec<Prefix<N>>)> {
        let trie = &mut self.non_masq;
        let current = prefixes(trie);
        let mut added = Vec::new();
        for (len, data) in desired.difference(&current) {
            let key = Key::new(*len, *data);
            if let Err(err) = trie.insert(&key, NON_MASQ_PRESENT, 0) {
                for key in &added {
                    let _ = trie.remove(key);
                }
                return Err(err).context("adding a prefix to the non-masquerade trie");
            }
            added.push(key);
        }
        let removed: Vec<Prefix<N>> = current.difference(desired).copied().collect();
        for (len, data) in &removed {
            trie.remove(&Key::new(*len, *data))
                .context("removing a prefix from the non-masquerade trie")?;
        }
        Ok((!added.is_empty() || !removed.is_empty(), removed))
    }

    /// Keeps prefixes that left the non-masquerade CIDRs in the draining trie for as long as a
    /// TCP connection may stay idle, so that connections that started unmasqueraded keep their
    /// addresses; a prefix that comes back stops draining.
    fn sync_draining(
        &mut self,
        removed: &[Prefix<N>],
        policy: &BTreeSet<Prefix<N>>,
        now_ns: u64,
    ) -> anyhow::Result<()> {
        for (len, data) in removed {
            self.draining
                .insert(&Key::new(*len, *data), seconds(now_ns), 0)?;
        }
        let back: Vec<Key<[u8; N]>> = self
            .draining
            .keys()
            .filter_map(Result::ok)
            .filter(|k| policy.contains(&(k.prefix_len(), k.data())))
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

/// The prefixes `trie` holds, in order.
pub fn prefixes<const N: usize, V: aya::Pod>(
    trie: &LpmTrie<MapData, [u8; N], V>,
) -> BTreeSet<Prefix<N>> {
    trie.keys()
        .filter_map(Result::ok)
        .map(|k| (k.prefix_len(), k.data()))
        .collect()
}

fn seconds(ns: u64) -> u32 {
    (ns / 1_000_000_000) as u32
}

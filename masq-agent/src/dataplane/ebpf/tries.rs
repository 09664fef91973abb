//! The policy as the programs read it: per family, the policy trie they look destinations up
//! in (each prefix with its action: the longest prefix of a destination decides it), and the
//! trie of prefixes that stopped keeping the pod's address lately, toward which TCP connections
//! that started unmasqueraded stay so until they may have gone idle. Every change moves the
//! policy generation on (see `policy_word`), so that no new flow is judged by a policy no longer
//! in force. Each entry also names the slot that counts its decisions (see `decisions`). What a
//! change writes is found in `trie_diff`.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use anyhow::Context as _;
use aya::maps::{Array, LpmTrie, MapData, lpm_trie::Key};
use ipnet::IpNet;
use masq_ebpf::{
    PolicyEntry, PrefixAction, Settings, decision_slot, prefix_action, sources_decided,
};

use super::{
    decisions::{DecisionCounters, DecisionSlots, Side},
    flow_table,
    index_writer::IndexWriter,
    map_types::NatTables,
    policy_index::IndexWrite,
    policy_word::PolicyWord,
    prefixes::{self, PolicyTrie, Prefix},
    strays::StrayWatch,
    trie_diff::{Difference, DrainingChange},
};
use crate::policy::{Action, IpFamily, Policy, Rules};

/// One family's tries.
pub struct FamilyTries<const N: usize> {
    /// The policy's prefixes, each with its action and the slot counting its decisions.
    pub non_masq: PolicyTrie<N>,
    /// The prefixes that stopped keeping the pod's address, with when (seconds of
    /// CLOCK_MONOTONIC); `None` for the source trie, whose changes conntrack's record of live
    /// flows covers (see `conntrack::keep_pod_flows`).
    pub draining: Option<LpmTrie<MapData, [u8; N], u32>>,
    /// What the policy trie holds, as this agent last read or wrote it; `None` when it must be
    /// read again. A trie of 100 000 prefixes takes 200 000 system calls to read. Shared with
    /// the thread that writes the index, which lets go of it once written.
    pub installed: Option<Arc<BTreeMap<Prefix<N>, PolicyEntry>>>,
}

impl<const N: usize> FamilyTries<N> {
    pub fn new(
        non_masq: PolicyTrie<N>,
        draining: Option<LpmTrie<MapData, [u8; N], u32>>,
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
            .map(Arc::unwrap_or_clone)
            .unwrap_or_else(|| prefixes::entries(&self.non_masq))
    }

    /// What the policy trie holds, to share.
    fn shared(&mut self) -> Arc<BTreeMap<Prefix<N>, PolicyEntry>> {
        let shared = match self.installed.take() {
            Some(installed) => installed,
            None => Arc::new(prefixes::entries(&self.non_masq)),
        };
        self.installed = Some(Arc::clone(&shared));
        shared
    }
}

/// The maps that hold the policy.
pub struct PolicyMaps {
    pub v4: FamilyTries<4>,
    pub v6: FamilyTries<16>,
    /// The source entries (`nonMasqueradeSrcCIDRs`, `masqueradeSrcCIDRs`).
    pub src_v4: FamilyTries<4>,
    pub src_v6: FamilyTries<16>,
    /// What the programs tag their cached verdicts with, and whether strays are cleared.
    pub word: PolicyWord,
    /// The thread that writes the programs' index of `v4`'s policy trie.
    pub index_v4: IndexWriter,
    /// Per CPU, the decisions each entry took, in its slot.
    pub decisions: DecisionCounters,
    slots: DecisionSlots,
    /// What the agent knows of flows that outlived the policy (see `strays`).
    pub strays: StrayWatch,
}

impl PolicyMaps {
    /// The policy maps, their entries' slots as the tries hold them; `reused_decisions` says
    /// whether `decisions` is an earlier agent's, whose free slots may hold counts.
    pub fn new(
        (mut v4, mut v6): (FamilyTries<4>, FamilyTries<16>),
        (mut src_v4, mut src_v6): (FamilyTries<4>, FamilyTries<16>),
        word: PolicyWord,
        index_v4: IndexWriter,
        decisions: DecisionCounters,
        reused_decisions: bool,
    ) -> PolicyMaps {
        let (held_v4, held_v6) = (v4.current(), v6.current());
        let (held_src_v4, held_src_v6) = (src_v4.current(), src_v6.current());
        let held = held_v4.values().chain(held_v6.values());
        let held = held.chain(held_src_v4.values()).chain(held_src_v6.values());
        let held = held.map(|entry| entry.counted_in);
        let slots = DecisionSlots::free_besides(decisions.len(), held, reused_decisions);
        (v4.installed, v6.installed) = (Some(Arc::new(held_v4)), Some(Arc::new(held_v6)));
        (src_v4.installed, src_v6.installed) =
            (Some(Arc::new(held_src_v4)), Some(Arc::new(held_src_v6)));
        PolicyMaps {
            v4,
            v6,
            src_v4,
            src_v6,
            word,
            index_v4,
            decisions,
            slots,
            strays: StrayWatch::default(),
        }
    }

    /// Whether the programs skip the NAT table toward destinations the policy leaves alone,
    /// after a check of `nat` if one is due (see `StrayWatch::check`).
    pub fn check_strays(&mut self, nat: &NatTables, grace: Duration) -> anyhow::Result<bool> {
        let tries = (&self.v4.non_masq, &self.v6.non_masq);
        self.strays.check(&mut self.word, nat, tries, grace)
    }

    /// Says that a flow's entry may lead toward a destination the policy leaves alone.
    pub fn lower_strays_cleared(&mut self) -> anyhow::Result<()> {
        let lowered = self.strays.lower(&mut self.word);
        self.refresh_index();
        lowered
    }

    /// Hands the thread that writes the programs' index of the IPv4 policy trie the generation
    /// in force, and what the trie holds where the index may not hold it: the thread writes it
    /// and stamps it with the generation, while the programs ask the trie. Where the generation
    /// cannot be read, the programs ask the trie until the next change: a warning, not an error
    /// of the policy.
    fn refresh_index(&mut self) {
        match self.word.generation() {
            Ok(generation) => {
                let entries = self.index_v4.wants_entries().then(|| self.v4.shared());
                self.index_v4.hand_over(generation, entries);
            }
            Err(err) => tracing::warn!(
                "the programs look IPv4 destinations up in the policy trie, not its index, \
                 until the next change: {err:#}"
            ),
        }
    }

    /// Waits until the programs' index of the IPv4 policy trie is written as last handed over,
    /// and returns what its last write of the chunks did.
    pub fn index_settled(&self) -> IndexWrite {
        self.index_v4.settled()
    }

    /// Makes the tries hold `policy`'s prefixes, destinations and sources; `settings` says
    /// which families have source entries. Returns whether anything changed. The index of the
    /// IPv4 trie follows on its own thread (`refresh_index`): the programs ask the trie until
    /// it is written.
    pub fn sync(&mut self, policy: &Policy, settings: &mut SettingsMap) -> anyhow::Result<bool> {
        let synced = self.sync_unstamped(policy, settings);
        self.refresh_index();
        synced
    }

    fn sync_unstamped(
        &mut self,
        policy: &Policy,
        settings: &mut SettingsMap,
    ) -> anyhow::Result<bool> {
        let v4 = policy.rules(IpFamily::Ipv4).unwrap_or_default();
        let mut changed = self.sync_family(IpFamily::Ipv4, &v4, Side::Destinations)?;
        if let Some(v6) = policy.rules(IpFamily::Ipv6) {
            changed |= self.sync_family(IpFamily::Ipv6, &v6, Side::Destinations)?;
        }
        for family in [IpFamily::Ipv4, IpFamily::Ipv6] {
            let rules = policy.source_rules(family);
            changed |= self.sync_source_rules(family, &rules, settings)?;
        }
        Ok(changed)
    }

    /// Makes one family's trie hold `rules`, and waits until the index holds it too, so that
    /// a test or a benchmark knows which answers the programs: the index, wherever it has room.
    /// Returns whether the trie changed.
    pub fn set_rules(&mut self, family: IpFamily, rules: &Rules) -> anyhow::Result<bool> {
        let synced = self.sync_family(family, rules, Side::Destinations);
        self.refresh_index();
        self.index_settled();
        synced
    }

    /// Makes one family's source trie hold `rules`, and waits until the index is stamped with
    /// the generation that moves on with it. Returns whether the trie changed.
    pub fn set_source_rules(
        &mut self,
        family: IpFamily,
        rules: &Rules,
        settings: &mut SettingsMap,
    ) -> anyhow::Result<bool> {
        let synced = self.sync_source_rules(family, rules, settings);
        self.refresh_index();
        self.index_settled();
        synced
    }

    /// Makes one family's source trie hold `rules`. The programs look it up only while the
    /// family's bit of `Settings::sources_decided` is set: set once the trie holds the entries,
    /// cleared before the last goes. Returns whether the trie changed.
    fn sync_source_rules(
        &mut self,
        family: IpFamily,
        rules: &Rules,
        settings: &mut SettingsMap,
    ) -> anyhow::Result<bool> {
        let bit = match family {
            IpFamily::Ipv4 => sources_decided::V4,
            IpFamily::Ipv6 => sources_decided::V6,
        };
        if rules.is_empty() {
            write_sources_decided(settings, bit, false)?;
        }
        let changed = self.sync_family(family, rules, Side::Sources)?;
        if !rules.is_empty() {
            write_sources_decided(settings, bit, true)?;
        }
        Ok(changed)
    }

    /// Makes one family's trie of `side` hold `rules`, their entries counted in the one set of
    /// decision slots.
    fn sync_family(&mut self, family: IpFamily, rules: &Rules, side: Side) -> anyhow::Result<bool> {
        let mut counting = Counting {
            slots: &mut self.slots,
            counters: &mut self.decisions,
        };
        let (word, strays) = (&mut self.word, &mut self.strays);
        match family {
            IpFamily::Ipv4 => {
                let tries = match side {
                    Side::Destinations => &mut self.v4,
                    Side::Sources => &mut self.src_v4,
                };
                let synced = tries.sync(prefixes::trie_entries(rules), word, strays, &mut counting);
                if side == Side::Destinations && !matches!(synced, Ok(false)) {
                    self.index_v4.trie_changed();
                }
                synced
            }
            IpFamily::Ipv6 => {
                let tries = match side {
                    Side::Destinations => &mut self.v6,
                    Side::Sources => &mut self.src_v6,
                };
                tries.sync(prefixes::trie_entries(rules), word, strays, &mut counting)
            }
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
        self.src_v4.installed = None;
        self.src_v6.installed = None;
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
        word: &mut PolicyWord,
        strays: &mut StrayWatch,
        counting: &mut Counting,
    ) -> anyhow::Result<bool> {
        let mut current = self.current();
        let difference = Difference::between(&current, &desired, |e| counting.keeps_slot(e));
        if !difference.written.is_empty() || !difference.removed.is_empty() {
            // Before the trie changes: a flow's entry may lead toward a destination it now
            // leaves alone, and the programs must look every packet up again.
            strays.lower(word)?;
        }
        let change = DrainingChange::between(&current, &difference);
        let now = prefixes::seconds(flow_table::monotonic_now_ns());
        if let Some(draining) = &mut self.draining {
            for (len, data) in &change.start {
                draining.insert(&Key::new(*len, *data), now, 0)?;
            }
        }
        let synced = self.write_policy(&current, difference, counting);
        // Even a sync that failed half-way may have changed the trie: no cached verdict survives
        // it, and the trie is read again next time.
        if !matches!(&synced, Ok(written) if !written.changed()) {
            word.next_generation()?;
        }
        let written = synced?;
        let changed = written.changed();
        for prefix in &written.removed {
            current.remove(prefix);
        }
        current.extend(written.entries);
        self.installed = Some(Arc::new(current));
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
        let Some(draining) = &mut self.draining else {
            return Ok(());
        };
        let back: Vec<Key<[u8; N]>> = draining
            .keys()
            .filter_map(Result::ok)
            .filter(|k| {
                let prefix = (k.prefix_len(), k.data());
                policy.get(&prefix) == Some(&prefix_action::NON_MASQUERADE)
                    || change.end.contains(&prefix)
            })
            .collect();
        for key in back {
            draining.remove(&key)?;
        }
        Ok(())
    }

    fn expire_draining(&mut self, drain: Duration, now_ns: u64) -> anyhow::Result<()> {
        let Some(draining) = &mut self.draining else {
            return Ok(());
        };
        let done: Vec<Key<[u8; N]>> = draining
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, since)| {
                u64::from(prefixes::seconds(now_ns).saturating_sub(*since)) > drain.as_secs()
            })
            .map(|(key, _)| key)
            .collect();
        for key in done {
            draining.remove(&key)?;
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

/// The `settings` array, whose one slot holds the programs' translation settings.
pub type SettingsMap = Array<MapData, Settings>;

/// Sets or clears `bit` of `Settings::sources_decided`, leaving the rest as it is.
fn write_sources_decided(settings: &mut SettingsMap, bit: u32, on: bool) -> anyhow::Result<()> {
    let mut current = settings.get(&0, 0)?;
    let word = if on {
        current.sources_decided | bit
    } else {
        current.sources_decided & !bit
    };
    if word != current.sources_decided {
        current.sources_decided = word;
        settings.set(0, current, 0)?;
    }
    Ok(())
}

//! Expiry of NAT table entries. The data path records when each half of a flow last saw a
//! packet and how far a TCP connection got; here both halves of a flow are judged together and
//! removed together.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use anyhow::Context as _;

use aya::Pod;
use aya::maps::IterableMap as _;
use masq_ebpf::{
    Address, IPPROTO_TCP, IPPROTO_UDP, NatEntry, NatKey, direction, nat_kind, tcp_seen,
};

use super::{batch, maps::NatTable};
use crate::dataplane::NatUsage;

/// How often the NAT tables are swept for idle flows; upkeep runs more often than that, to
/// catch a changed address or a detached program quickly.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(10);

/// When a sweep is due: at once, then every `SWEEP_INTERVAL`.
#[derive(Debug, Default)]
pub struct SweepClock {
    last: Option<Instant>,
}

impl SweepClock {
    /// Whether a sweep is due now; if so, the next is due `SWEEP_INTERVAL` from now.
    pub fn due(&mut self) -> bool {
        if self
            .last
            .is_some_and(|last| last.elapsed() < SWEEP_INTERVAL)
        {
            return false;
        }
        self.last = Some(Instant::now());
        true
    }
}

/// How long a flow may stay idle, by protocol and state.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    pub tcp_established: Duration,
    /// Half-open (no reply yet) and closing (FIN seen) TCP connections.
    pub tcp_transitory: Duration,
    /// TCP connections that saw a reset: over, as conntrack's CLOSE state says, and gone
    /// quickly so that connection churn does not fill the table.
    pub tcp_reset: Duration,
    pub udp: Duration,
    pub icmp: Duration,
    /// A reply-direction half without its egress half: left by an allocation that lost a race,
    /// or by a crash between the two inserts.
    pub orphan: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            tcp_established: Duration::from_secs(2 * 3600),
            tcp_transitory: Duration::from_secs(60),
            tcp_reset: Duration::from_secs(10),
            udp: Duration::from_secs(120),
            icmp: Duration::from_secs(60),
            orphan: Duration::from_secs(10),
        }
    }
}

impl Timeouts {
    fn for_flow<A: Address>(
        &self,
        key: &NatKey<A>,
        egress: &NatEntry<A>,
        ingress: &NatEntry<A>,
    ) -> Duration {
        match key.proto {
            IPPROTO_TCP => {
                let seen = egress.tcp_seen | ingress.tcp_seen;
                if seen & tcp_seen::RESET != 0 {
                    return self.tcp_reset;
                }
                let closing = seen & tcp_seen::CLOSING != 0;
                let both_ways = egress.tcp_seen != 0 && ingress.tcp_seen != 0;
                if !closing && both_ways && seen & tcp_seen::PAST_OPENING != 0 {
                    self.tcp_established
                } else {
                    self.tcp_transitory
                }
            }
            IPPROTO_UDP => self.udp,
            _ => self.icmp,
        }
    }
}

/// CLOCK_MONOTONIC, the clock the programs stamp entries with (`bpf_ktime_get_coarse_ns`, or
/// before 5.11 `bpf_ktime_get_ns`: the same clock).
pub fn monotonic_now_ns() -> u64 {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .expect("CLOCK_MONOTONIC is always available");
    now.tv_sec() as u64 * 1_000_000_000 + now.tv_nsec() as u64
}

/// A family's NAT table, entry by entry.
pub type Table<A> = Vec<(NatKey<A>, NatEntry<A>)>;

/// A NAT table's entries, read whole with batch commands.
pub fn read_table<A>(nat: &NatTable<A>) -> anyhow::Result<Table<A>>
where
    A: Address,
    NatKey<A>: Pod,
    NatEntry<A>: Pod,
{
    batch::lookup_all(nat.map()).context("reading the NAT table")
}

/// What `entries` hold: entries, and flows by kind (each flow has one egress half).
pub fn usage<A: Address>(entries: &[(NatKey<A>, NatEntry<A>)]) -> NatUsage {
    let mut usage = NatUsage {
        entries: entries.len(),
        ..NatUsage::default()
    };
    for (key, entry) in entries {
        if key.direction == direction::EGRESS {
            if entry.kind == nat_kind::SNAT {
                usage.translated_flows += 1;
            }
            match entry.kind {
                nat_kind::PASSTHROUGH => usage.inbound_flows += 1,
                nat_kind::NODE => usage.node_flows += 1,
                // Translated to another port only, for a clash: the node's own.
                _ if entry.addr == key.saddr => usage.node_flows += 1,
                _ => usage.masqueraded_flows += 1,
            }
        }
    }
    usage
}

/// How many flows of `entries` the programs translate to each node address.
pub fn translated_by_address<A: Address + Ord>(
    entries: &[(NatKey<A>, NatEntry<A>)],
) -> std::collections::BTreeMap<A, usize> {
    let mut counts = std::collections::BTreeMap::new();
    for (key, entry) in entries {
        if key.direction == direction::EGRESS && entry.kind == nat_kind::SNAT {
            *counts.entry(entry.addr).or_default() += 1;
        }
    }
    counts
}

/// Removes every flow idle for longer than its timeout, both halves together, and reports
/// what the table held before.
pub fn expire<A>(nat: &NatTable<A>, timeouts: &Timeouts, now_ns: u64) -> anyhow::Result<NatUsage>
where
    A: Address,
    NatKey<A>: Pod,
    NatEntry<A>: Pod,
{
    let entries = read_table(nat)?;
    let mut run = usage(&entries);
    // Up to half a million entries every ten seconds: sized at once, and hashed with foldhash,
    // whose per-process random seed still keeps an outside host that picks its ports from
    // aiming at collisions. Against SipHash, a sweep of 239 000 entries took 113 ms, not 145.
    let mut table: HashMap<NatKey<A>, NatEntry<A>, foldhash::fast::RandomState> =
        HashMap::with_capacity_and_hasher(entries.len(), Default::default());
    table.extend(entries);
    let idle =
        |entry: &NatEntry<A>| Duration::from_nanos(now_ns.saturating_sub(entry.last_seen_ns));
    let (mut orphans, mut flows) = (Vec::new(), Vec::new());
    for (key, entry) in &table {
        let partner_key = key.reverse(entry);
        let partner = table.get(&partner_key);
        if key.direction == direction::INGRESS {
            if partner.is_none() && idle(entry) > timeouts.orphan {
                orphans.push(*key);
            }
            continue;
        }
        let Some(ingress) = partner else {
            // An egress half alone cannot translate replies; let it go with its timeout.
            if idle(entry) > timeouts.for_flow(key, entry, entry) {
                orphans.push(*key);
            }
            continue;
        };
        let last = entry.last_seen_ns.max(ingress.last_seen_ns);
        let timeout = timeouts.for_flow(key, entry, ingress);
        if Duration::from_nanos(now_ns.saturating_sub(last)) <= timeout {
            continue;
        }
        // The data path may have refreshed the flow since the snapshot: look again.
        let fresh = |k: &NatKey<A>| nat.get(k, 0).map(|e| e.last_seen_ns).unwrap_or(0);
        if Duration::from_nanos(now_ns.saturating_sub(fresh(key).max(fresh(&partner_key))))
            <= timeout
        {
            continue;
        }
        flows.extend([*key, partner_key]);
    }
    run.orphans_removed = prune(nat, &orphans)?;
    run.expired_flows = prune(nat, &flows)? / 2;
    Ok(run)
}

/// Removes every flow on the node address `addr` (masqueraded to it, or the node's own from
/// it), both halves; returns how many.
pub fn forget_address<A>(nat: &NatTable<A>, addr: A) -> anyhow::Result<usize>
where
    A: Address,
    NatKey<A>: Pod,
    NatEntry<A>: Pod,
{
    let table = read_table(nat)?;
    let doomed: Vec<NatKey<A>> = table
        .iter()
        .filter(|(key, entry)| {
            // Masqueraded to the address, or the node's own flows from it.
            key.direction == direction::EGRESS
                && (entry.kind == nat_kind::SNAT && entry.addr == addr
                    || entry.kind == nat_kind::NODE && key.saddr == addr)
        })
        .flat_map(|(key, entry)| [*key, key.reverse(entry)])
        .collect();
    Ok(prune(nat, &doomed)? / 2)
}

/// Deletes `keys` from `nat`; returns how many were there.
fn prune<A>(nat: &NatTable<A>, keys: &[NatKey<A>]) -> anyhow::Result<usize>
where
    A: Address,
    NatKey<A>: Pod,
    NatEntry<A>: Pod,
{
    batch::delete_all(nat.map(), keys).context("pruning the NAT table")
}

//! What the eBPF data plane is built from: the flags, and what the node says.

use std::path::PathBuf;

use masq_ebpf::NAT_DEFAULT_ENTRIES;

use super::devices::Selection;
use crate::{
    policy::{IpFamilies, IpFamily, MasqueradeOptions},
    ports::PortRange,
};

/// What the eBPF data plane needs from the flags and the node.
#[derive(Debug, Clone)]
pub struct EbpfOptions {
    pub bpffs: PathBuf,
    pub devices: Selection,
    pub nat_capacity: u32,
    pub port_spans: Vec<PortRange>,
    pub random_fully: bool,
    pub masquerade: MasqueradeOptions,
    /// The families the programs masquerade: IPv6 too with `--enable-ipv6`.
    pub families: IpFamilies,
    /// The entries of the policy the agent starts with, in both families' tries: the decision
    /// counters are sized for it.
    pub policy_entries: usize,
    /// kube-proxy's NodePort range, which NAT leaves to the node.
    pub node_port_range: Option<PortRange>,
}

impl EbpfOptions {
    pub const DEFAULT_NAT_CAPACITY: u32 = NAT_DEFAULT_ENTRIES;

    /// The size of `nat_v6`: a table that is never used takes one entry, not megabytes.
    pub fn nat_v6_capacity(&self) -> u32 {
        self.for_ipv6(self.nat_capacity)
    }

    /// The size of a map only IPv6's packets use: `entries`, or one (the kernel makes no map of
    /// none) where the programs translate no IPv6.
    pub fn for_ipv6(&self, entries: u32) -> u32 {
        if self.families.contains(IpFamily::Ipv6) {
            entries
        } else {
            1
        }
    }
}

/// The slots of `policy_decisions` for a starting policy of `entries` entries: one per entry
/// and for the default, with a quarter more for the policy to grow into, in whole thousands of
/// slots. Each slot takes eight bytes per CPU, so the array is sized by the policy, not by the
/// tries' capacity: entries past it go uncounted until the agent restarts.
pub fn decision_slots(entries: usize) -> u32 {
    const STEP: u32 = masq_ebpf::decision_slot::AT_LEAST;
    let entries = u32::try_from(entries).unwrap_or(u32::MAX);
    let wanted = entries.saturating_add(entries / 4).saturating_add(1);
    wanted
        .div_ceil(STEP)
        .saturating_mul(STEP)
        .clamp(STEP, 2 * masq_ebpf::NON_MASQ_MAX_ENTRIES + STEP)
}

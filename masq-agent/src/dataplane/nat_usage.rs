//! What the NAT tables hold, as an upkeep run finds them: the data planes that have tables
//! report it, `status` shows it and the metrics count it.

use std::collections::BTreeMap;

use crate::policy::IpFamily;

/// What one NAT upkeep run found in one family's table and removed from it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NatUsage {
    pub entries: usize,
    /// The pods' flows masqueraded.
    pub pod_flows: usize,
    /// The pods' flows that keep their address: opened from outside, or kept across a policy
    /// change.
    pub kept_flows: usize,
    /// Flows of the node's own address, held so that no masqueraded flow is given their tuple
    /// (those translated to another port for a clash included).
    pub node_flows: usize,
    /// Flows the programs translate (masqueraded ones, and node flows given another port):
    /// those that need the programs to go on.
    pub translated_flows: usize,
    pub expired_flows: usize,
    pub orphans_removed: usize,
}

impl NatUsage {
    /// The entries the run left: those it found, less the halves it removed.
    pub fn entries_left(&self) -> usize {
        self.entries
            .saturating_sub(2 * self.expired_flows + self.orphans_removed)
    }
}

/// What one NAT upkeep run found, table by table: the tables of the families in use (a family
/// that is off has none). Each family has a table of its own, and a pod's new flow is refused
/// when its own family's is full, so their entries are never added up: a full IPv4 table
/// beside an empty IPv6 one would read half full.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatSweep {
    pub tables: BTreeMap<IpFamily, NatUsage>,
}

impl NatSweep {
    /// The sweep of both families' tables, `v4` and `v6`, of which those `in_use` are kept.
    pub fn of_tables_in_use(
        v4: NatUsage,
        v6: NatUsage,
        in_use: impl Fn(IpFamily) -> bool,
    ) -> NatSweep {
        let tables = [(IpFamily::Ipv4, v4), (IpFamily::Ipv6, v6)]
            .into_iter()
            .filter(|(family, _)| in_use(*family))
            .collect();
        NatSweep { tables }
    }

    /// Idle flows removed from all the tables: removals, which add up, unlike entries.
    pub fn expired_flows(&self) -> usize {
        self.tables.values().map(|usage| usage.expired_flows).sum()
    }
}

/// Whose a flow is, as `status`, the metrics' `kind` label and `masq-agent flows --kind` name
/// it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, clap::ValueEnum)]
pub enum FlowKind {
    /// A pod's, masqueraded.
    Pod,
    /// A pod's that keeps its address: opened from outside, or kept across a policy change.
    Kept,
    /// The node's own: its tuple held, or translated to another port for a clash.
    Node,
}

impl FlowKind {
    /// Its one spelling, which clap's `--kind` takes from the variant's name too.
    pub fn label(self) -> &'static str {
        match self {
            FlowKind::Pod => "pod",
            FlowKind::Kept => "kept",
            FlowKind::Node => "node",
        }
    }
}

spelled_by_label!(FlowKind);

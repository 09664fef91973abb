//! Data planes make the kernel enforce a `Policy`. Two implement the same small interface:
//! `ebpf` (tc programs and LPM maps) and `iptables` (upstream's reference chain). Nothing outside
//! this module knows which one is running.

pub mod chosen_address;
pub mod coverage;
pub mod ebpf;
pub mod iptables;
pub mod state;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{
    netdev,
    policy::{IpFamily, Policy},
};

/// Which mechanism enforces the policy. Its one spelling, `label`, is what the status text,
/// the JSON, the state file and the metrics all say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Ebpf,
    Iptables,
    /// The full iptables chain, because the eBPF data plane could not run.
    IptablesFallback,
}

impl Mode {
    pub const ALL: [Mode; 3] = [Mode::Ebpf, Mode::Iptables, Mode::IptablesFallback];

    pub fn label(self) -> &'static str {
        match self {
            Mode::Ebpf => "ebpf",
            Mode::Iptables => "iptables",
            Mode::IptablesFallback => "iptables-fallback",
        }
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

impl Serialize for Mode {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.label())
    }
}

impl<'de> Deserialize<'de> for Mode {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Mode, D::Error> {
        let label = String::deserialize(deserializer)?;
        Mode::ALL
            .into_iter()
            .find(|mode| mode.label() == label)
            .ok_or_else(|| serde::de::Error::custom(format!("no data plane is called {label}")))
    }
}

/// What an `apply` changed in the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyOutcome {
    /// The kernel already matched the policy.
    Unchanged,
    /// A new policy was installed.
    Applied,
    /// The policy was unchanged, but someone had altered the kernel state; it was put back.
    Repaired,
}

/// Walks two sequences sorted alike by key, calling `each` once for every key: with its value
/// in `old`, in `new`, or both. The data planes compare what they installed with what they
/// want this way, in one pass and without an index of either.
pub fn walk_sorted<K: Ord, A, B>(
    old: impl IntoIterator<Item = (K, A)>,
    new: impl IntoIterator<Item = (K, B)>,
    mut each: impl FnMut(K, Option<A>, Option<B>),
) {
    let (mut old, mut new) = (old.into_iter().peekable(), new.into_iter().peekable());
    loop {
        let order = match (old.peek(), new.peek()) {
            (Some((o, _)), Some((n, _))) => o.cmp(n),
            (Some(_), None) => std::cmp::Ordering::Less,
            (None, Some(_)) => std::cmp::Ordering::Greater,
            (None, None) => return,
        };
        match order {
            std::cmp::Ordering::Less => {
                if let Some((key, value)) = old.next() {
                    each(key, Some(value), None);
                }
            }
            std::cmp::Ordering::Greater => {
                if let Some((key, value)) = new.next() {
                    each(key, None, Some(value));
                }
            }
            std::cmp::Ordering::Equal => {
                if let (Some((key, a)), Some((_, b))) = (old.next(), new.next()) {
                    each(key, Some(a), Some(b));
                }
            }
        }
    }
}

pub trait DataPlane {
    fn mode(&self) -> Mode;

    /// The chosen masquerade addresses in force (`masqueradeAddress`): those the node holds.
    fn masquerade_addresses(&self) -> chosen_address::ChosenAddresses {
        chosen_address::ChosenAddresses::default()
    }

    /// Why this data plane runs instead of the one asked for, if it does.
    fn mode_reason(&self) -> Option<String> {
        None
    }

    /// Makes the kernel match `policy`. On error, whatever was in force before stays in force.
    /// A change is applied as the difference from what this data plane knows it installed.
    fn apply(&mut self, policy: &Policy) -> anyhow::Result<ApplyOutcome>;

    /// The next `apply` reads back everything it installed from the kernel, rather than trust
    /// its own record of it, and installs whatever differs: the agent asks at every resync, so
    /// that whatever someone else changed is repaired.
    fn verify_next_apply(&mut self) {}

    /// Periodic upkeep between applies: puts back programs someone detached, and expires
    /// idle NAT entries. Returns what the NAT tables hold, for data planes that have them.
    fn maintain(&mut self) -> anyhow::Result<Option<NatSweep>> {
        Ok(None)
    }

    /// The agent exits, and leaves what this data plane installed in force for the agent that
    /// comes next.
    fn leave(&mut self) {}

    /// Reads back what is installed.
    fn status(&self) -> anyhow::Result<Status>;

    /// Removes everything this data plane installed.
    fn cleanup(&mut self) -> anyhow::Result<()>;
}

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

/// What is installed, as read back from the kernel.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// `None` when nothing is installed.
    pub mode: Option<Mode>,
    /// Why the running agent uses this mode, when it fell back.
    pub mode_reason: Option<String>,
    pub chains: Vec<iptables::ChainStatus>,
    pub ebpf: Option<ebpf::status::EbpfStatus>,
    /// What masquerades what leaves each device of the node, loopback aside.
    pub devices: Vec<coverage::DeviceCoverage>,
    /// While another data plane is in force, the flows an eBPF data plane still translates:
    /// its programs and pins go when none is left.
    pub draining_flows: Option<usize>,
    /// What `status` cannot tell from what is installed, or what is left of an agent that no
    /// longer runs.
    pub notes: Vec<String>,
}

/// What is installed, read back from the kernel: the chains, the eBPF objects pinned under
/// `bpffs` if given, and what that makes of each device.
fn read_back(chain: &str, bpffs: Option<&std::path::Path>) -> anyhow::Result<Status> {
    let chains = iptables::read_chains(chain)?;
    let ebpf = bpffs.map(ebpf::status::read_status).transpose()?.flatten();
    let attached = ebpf.as_ref().is_some_and(|e| !e.attachments.is_empty());
    let installed = chains.iter().find(|c| c.installed);
    let mode = if attached || installed.is_some_and(|c| !c.ebpf_protocols_returned.is_empty()) {
        Some(Mode::Ebpf)
    } else {
        installed.map(|_| Mode::Iptables)
    };
    let devices = coverage::of_devices(&netdev::names_and_indexes()?, &chains, ebpf.as_ref());
    Ok(Status {
        mode,
        mode_reason: None,
        chains,
        ebpf,
        devices,
        draining_flows: None,
        notes: Vec::new(),
    })
}

/// Reads back whatever the agent installed, for `masq-agent status` in a separate process.
pub fn inspect(chain: &str, bpffs: &std::path::Path) -> anyhow::Result<Status> {
    let mut status = read_back(chain, Some(bpffs))?;
    match state::read_last(bpffs) {
        Some((record, state::Liveness::Running)) => {
            status.mode = Some(record.mode);
            status.mode_reason = record.reason;
        }
        // What an agent that exited left, or one whose pid means nothing here: its record says
        // why, where the kernel still holds what it says.
        Some((record, liveness)) if status.mode.is_some() => {
            if agrees(record.mode, status.mode) {
                status.mode = Some(record.mode);
                status.mode_reason = record.reason;
            }
            status.notes.push(match liveness {
                state::Liveness::Exited => format!(
                    "no agent runs: the one that installed this (pid {}, {}) has exited",
                    record.pid, record.mode
                ),
                _ => format!(
                    "the agent that installed this ({}) has pid {} in another pid namespace \
                     (its container's, or the node's): whether it still runs cannot be told \
                     from here",
                    record.mode, record.pid
                ),
            });
        }
        _ => {}
    }
    if status.mode == Some(Mode::Ebpf) && status.ebpf.is_none() {
        status.notes.push(format!(
            "the chain leaves traffic to eBPF programs, but nothing is pinned under {}: the \
             agent runs with another --bpffs, or its programs are gone; what the devices say \
             of eBPF cannot be told from here",
            bpffs.display()
        ));
    }
    status.draining_flows = status
        .ebpf
        .as_ref()
        .filter(|_| status.mode != Some(Mode::Ebpf))
        .map(|ebpf| ebpf.translated_flows());
    Ok(status)
}

/// Whether what is installed (`installed`, read back from the kernel) is what an agent of
/// `recorded` mode installs.
fn agrees(recorded: Mode, installed: Option<Mode>) -> bool {
    matches!(
        (recorded, installed),
        (Mode::Ebpf, Some(Mode::Ebpf))
            | (
                Mode::Iptables | Mode::IptablesFallback,
                Some(Mode::Iptables)
            )
    )
}

/// What `cleanup` found and removed.
#[derive(Debug)]
pub struct Cleaned {
    pub bpffs: std::path::PathBuf,
    pub chain: String,
    pub ebpf: ebpf::cleanup::Removed,
    /// The families whose chain (or a jump to it) was there.
    pub chains: Vec<IpFamily>,
}

/// Removes everything either data plane installed, and says what it found.
pub fn cleanup_all(chain: &str, bpffs: &std::path::Path) -> anyhow::Result<Cleaned> {
    state::remove(bpffs);
    let ebpf = ebpf::cleanup::cleanup(bpffs)?;
    let chains = iptables::cleanup(chain)?;
    Ok(Cleaned {
        bpffs: bpffs.to_path_buf(),
        chain: chain.to_string(),
        ebpf,
        chains,
    })
}

impl std::fmt::Display for Cleaned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut removed = Vec::new();
        if !self.ebpf.attachments.is_empty() {
            removed.push(format!(
                "the eBPF programs from {}",
                self.ebpf.attachments.join(", ")
            ));
        }
        if !self.ebpf.maps.is_empty() {
            removed.push(format!(
                "{} pinned maps under {}",
                self.ebpf.maps.len(),
                self.bpffs.display()
            ));
        }
        for family in &self.chains {
            let tool = match family {
                IpFamily::Ipv4 => "iptables",
                IpFamily::Ipv6 => "ip6tables",
            };
            removed.push(format!(
                "{tool} chain {} with its POSTROUTING jump",
                self.chain
            ));
        }
        if removed.is_empty() {
            writeln!(
                f,
                "nothing to remove: no programs of the agent's on this node's devices, nothing \
                 pinned under {}, no chain {}",
                self.bpffs.display(),
                self.chain
            )
        } else {
            writeln!(f, "removed {}", removed.join("; "))
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.mode, &self.mode_reason) {
            (Some(mode), Some(reason)) => writeln!(f, "data plane: {mode}, because {reason}")?,
            (Some(mode), None) => writeln!(f, "data plane: {mode}")?,
            (None, _) => writeln!(f, "data plane: none installed")?,
        }
        for note in &self.notes {
            writeln!(f, "  note: {note}")?;
        }
        if !self.devices.is_empty() {
            writeln!(f, "devices (what masquerades traffic leaving each):")?;
            for device in &self.devices {
                write!(f, "{device}")?;
            }
        }
        if let Some(flows) = self.draining_flows {
            writeln!(
                f,
                "eBPF data plane draining: {flows} translated flows left; its programs and pins go when none is left"
            )?;
        }
        if let Some(ebpf) = &self.ebpf {
            write!(f, "{ebpf}")?;
        }
        for chain in &self.chains {
            write!(f, "{chain}")?;
        }
        Ok(())
    }
}

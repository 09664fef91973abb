//! The eBPF data plane as read back from bpffs, for `masq-agent status` and the metrics, from
//! another process than the agent's: so it opens the pinned maps rather than the agent's, and
//! reads what an agent of another version left as long as the layout matches.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use aya::programs::links::{FdLink, PinnedLink};
use ipnet::IpNet;
use masq_ebpf::{COUNTER_SLOTS, Counter, map_names, prefix_action};
use serde::Serialize;

use super::{
    attach,
    decisions::{self, PolicyDecisions, Side, TrieEntries},
    expiry,
    flow_table::{V4_MAPS, V6_MAPS},
    hook::Hook,
    map_types::{Counters, InterfaceTable, counter_total},
    pins::Pins,
    policy_word::PolicyWord,
    tc_filters,
};
use crate::{dataplane::nat_usage::NatUsage, policy::IpFamily};

/// One attachment, as read back from its pinned link.
#[derive(Debug, Clone, Serialize)]
pub struct AttachmentStatus {
    pub device: String,
    pub hook: Hook,
    /// The TCX link; none for a clsact filter (kernels before 6.6), which has no link.
    pub link_id: Option<u32>,
    pub program_id: u32,
    /// Whether the program runs at the device's hook: not once the device is gone.
    pub running: bool,
}

/// The eBPF data plane as read back from bpffs.
#[derive(Debug, Clone, Serialize)]
pub struct EbpfStatus {
    pub bpffs: PathBuf,
    pub attachments: Vec<AttachmentStatus>,
    pub interfaces: BTreeMap<u32, Ipv4Addr>,
    /// The interfaces that masquerade IPv6, and their addresses.
    pub interfaces_v6: BTreeMap<u32, Ipv6Addr>,
    /// The chosen masquerade addresses the programs give pods' new flows (`masqueradeAddress`
    /// while the node holds it).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub chosen_addresses: Vec<IpAddr>,
    pub non_masquerade_v4: Vec<IpNet>,
    pub non_masquerade_v6: Vec<IpNet>,
    /// The exceptions (`masqueradeCIDRs`), where there are any.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub masquerade_v4: Vec<IpNet>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub masquerade_v6: Vec<IpNet>,
    /// The source entries, both families, where there are any.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub non_masquerade_src: Vec<IpNet>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub masquerade_src: Vec<IpNet>,
    /// The NAT table of each family in use (`nat_capacities`).
    pub nat: BTreeMap<IpFamily, NatTableStatus>,
    /// The flows the programs translate, by the node address they are translated to.
    pub translated_by_address: BTreeMap<IpAddr, usize>,
    /// No flow outlived the policy: packets toward destinations it leaves alone skip the NAT
    /// table (see `strays`).
    pub strays_cleared: bool,
    /// The programs' index of the IPv4 policy trie, as each egress program holds it.
    pub policy_index_v4: Vec<PolicyIndexStatus>,
    pub counters: BTreeMap<&'static str, u64>,
    /// What each policy entry decided; absent where an older agent pinned no counters.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decisions: Option<PolicyDecisions>,
}

/// The programs' index of the IPv4 policy trie (`non_masq_index_v4`) as one program holds it:
/// each program object has its own, not pinned, found through the program's maps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PolicyIndexStatus {
    pub program_id: u32,
    /// Whether it holds the policy in force (its stamp is the generation in force), so that the
    /// program takes its answers; otherwise the program asks the trie, as while the agent
    /// writes it after a change.
    pub in_force: bool,
    /// The /16s whose destinations the program looks up in the trie, more slowly, for want of
    /// room in the index: the policy outgrew what the agent sized it for when it started.
    pub left_to_the_trie: usize,
}

/// One family's NAT table: how full it is, and whose its flows are. A pod's new flow is
/// refused when its own family's table is full, so each table's fullness is its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct NatTableStatus {
    /// Two per flow, one per direction.
    pub entries: usize,
    pub capacity: u32,
    /// `entries` of `capacity` in whole percent, rounded up: a table with one entry in it is
    /// not "0% full".
    pub percent_full: u64,
    /// Flows by whose they are (`FlowOwner`): the pods' masqueraded; the pods' that keep their
    /// address (opened from outside, or kept across a policy change); the node's own, whose
    /// tuple the table holds.
    pub pod_flows: usize,
    pub kept_flows: usize,
    pub node_flows: usize,
    /// Flows the programs translate: those that need them to go on.
    pub translated_flows: usize,
}

impl NatTableStatus {
    /// A table of `capacity` entries that holds `usage`.
    pub fn new(usage: &NatUsage, capacity: u32) -> NatTableStatus {
        NatTableStatus {
            entries: usage.entries,
            capacity,
            percent_full: (usage.entries as u64 * 100).div_ceil(u64::from(capacity.max(1))),
            pod_flows: usage.pod_flows,
            kept_flows: usage.kept_flows,
            node_flows: usage.node_flows,
            translated_flows: usage.translated_flows,
        }
    }
}

impl EbpfStatus {
    /// The flows the programs translate, in every family's table: while they last, the
    /// programs must stay.
    pub fn translated_flows(&self) -> usize {
        self.nat.values().map(|table| table.translated_flows).sum()
    }

    /// Whether the programs translate `family` leaving by `device`: they run at both its
    /// hooks, with its address in the `interfaces` map.
    pub fn translates(&self, device: &str, index: u32, family: IpFamily) -> bool {
        let runs = |hook: Hook| {
            self.attachments
                .iter()
                .any(|a| a.device == device && a.hook == hook && a.running)
        };
        let attached = Hook::BOTH.into_iter().all(runs);
        let addressed = match family {
            IpFamily::Ipv4 => self.interfaces.contains_key(&index),
            IpFamily::Ipv6 => self.interfaces_v6.contains_key(&index),
        };
        attached && addressed
    }

    /// The flows the programs on `device` (ifindex `index`) translate, if they run there: while
    /// the chain no longer returns the device's traffic to them, these drain.
    pub fn flows_through(&self, device: &str, index: u32) -> Option<usize> {
        let runs = self
            .attachments
            .iter()
            .any(|a| a.device == device && a.running);
        let addresses = [
            self.interfaces.get(&index).map(|a| IpAddr::from(*a)),
            self.interfaces_v6.get(&index).map(|a| IpAddr::from(*a)),
        ];
        runs.then(|| {
            addresses
                .into_iter()
                .flatten()
                .filter_map(|a| self.translated_by_address.get(&a))
                .sum()
        })
    }
}

/// Reads the data plane's state from `bpffs`; `None` if nothing is pinned there.
pub fn read_status(bpffs: &Path) -> anyhow::Result<Option<EbpfStatus>> {
    let pins = Pins::new(bpffs);
    if !pins.map(map_names::NAT_V4).exists() {
        return Ok(None);
    }
    let tries = TrieEntries::read(&pins)?;
    let destinations = |family, action| tries.with_action(Side::Destinations, family, action);
    let sources = |action| {
        [IpFamily::Ipv4, IpFamily::Ipv6]
            .into_iter()
            .flat_map(|family| tries.with_action(Side::Sources, family, action))
            .collect()
    };
    let table_v4 = pins.nat_halves::<[u8; 4]>(&V4_MAPS)?;
    let table_v6 = pins.nat_halves::<[u8; 16]>(&V6_MAPS)?;
    let translated_by_address = expiry::translated_by_address(&table_v4)
        .into_iter()
        .map(|(addr, flows)| (IpAddr::from(addr), flows))
        .chain(
            expiry::translated_by_address(&table_v6)
                .into_iter()
                .map(|(addr, flows)| (IpAddr::from(addr), flows)),
        )
        .collect();
    let decisions = decisions::read(&pins, &tries)?;
    let interfaces: InterfaceTable = pins.open(map_names::INTERFACES)?;
    let generation = PolicyWord(pins.open(map_names::POLICY_GENERATION)?);
    let attachments = read_attachments(&pins);
    let policy_index_v4 = read_policy_indexes(&attachments, generation.generation()?);
    let kernel = read_kernel_counters(bpffs)?.context("the counters map is not pinned")?;
    let nat = kernel
        .nat_capacities
        .iter()
        .map(|(family, capacity)| {
            let usage = match family {
                IpFamily::Ipv4 => expiry::usage(&table_v4),
                IpFamily::Ipv6 => expiry::usage(&table_v6),
            };
            (*family, NatTableStatus::new(&usage, *capacity))
        })
        .collect();
    let counters = kernel
        .packets
        .iter()
        .map(|(counter, total)| (counter.name(), *total))
        .collect();
    Ok(Some(EbpfStatus {
        bpffs: bpffs.to_path_buf(),
        attachments,
        interfaces: interfaces
            .iter()
            .filter_map(Result::ok)
            .map(|(index, iface)| (index, Ipv4Addr::from(iface.ipv4)))
            .collect(),
        interfaces_v6: interfaces
            .iter()
            .filter_map(Result::ok)
            .filter(|(_, iface)| iface.ipv6 != [0; 16])
            .map(|(index, iface)| (index, Ipv6Addr::from(iface.ipv6)))
            .collect(),
        chosen_addresses: {
            let mut chosen: Vec<IpAddr> = interfaces
                .iter()
                .filter_map(Result::ok)
                .flat_map(|(_, iface)| {
                    let v4 = (iface.masquerade_ipv4 != [0; 4])
                        .then(|| IpAddr::from(iface.masquerade_ipv4));
                    let v6 = (iface.masquerade_ipv6 != [0; 16])
                        .then(|| IpAddr::from(iface.masquerade_ipv6));
                    v4.into_iter().chain(v6)
                })
                .collect();
            chosen.sort();
            chosen.dedup();
            chosen
        },
        non_masquerade_v4: destinations(IpFamily::Ipv4, prefix_action::NON_MASQUERADE),
        non_masquerade_v6: destinations(IpFamily::Ipv6, prefix_action::NON_MASQUERADE),
        masquerade_v4: destinations(IpFamily::Ipv4, prefix_action::MASQUERADE),
        masquerade_v6: destinations(IpFamily::Ipv6, prefix_action::MASQUERADE),
        non_masquerade_src: sources(prefix_action::NON_MASQUERADE),
        masquerade_src: sources(prefix_action::MASQUERADE),
        nat,
        translated_by_address,
        strays_cleared: generation.strays_cleared()?,
        policy_index_v4,
        counters,
        decisions,
    }))
}

/// The index of the IPv4 policy trie of each egress program attached, as it holds the policy
/// of `generation`. A program whose index cannot be read (an older agent's, without one) is
/// left out.
fn read_policy_indexes(
    attachments: &[AttachmentStatus],
    generation: u32,
) -> Vec<PolicyIndexStatus> {
    let mut programs: Vec<u32> = attachments
        .iter()
        .filter(|a| a.hook == Hook::Egress)
        .map(|a| a.program_id)
        .collect();
    programs.sort_unstable();
    programs.dedup();
    programs
        .into_iter()
        .filter_map(|program_id| {
            read_policy_index(program_id, generation)
                .inspect_err(|err| {
                    tracing::debug!("the policy index of program {program_id}: {err:#}")
                })
                .ok()
        })
        .collect()
}

fn read_policy_index(program_id: u32, generation: u32) -> anyhow::Result<PolicyIndexStatus> {
    use aya::{
        maps::{MapData, MapInfo},
        programs::loaded_programs,
    };
    use masq_ebpf::policy_index::{ASK_THE_TRIE, Chunk, STAMP_CHUNK, TOP_CHUNKS, stamp};
    let program = loaded_programs()
        .filter_map(Result::ok)
        .find(|p| p.id() == program_id)
        .context("no such program")?;
    let name = map_names::as_the_kernel_keeps(map_names::NON_MASQ_INDEX_V4);
    let index = program
        .map_ids()?
        .unwrap_or_default()
        .into_iter()
        .find(|&id| MapInfo::from_id(id).is_ok_and(|m| m.name_as_str() == Some(name)))
        .context("the program has no policy index")?;
    // The top level and the stamp after it, read in batches (two calls), where a lookup each
    // took 4 097.
    let head: Vec<Chunk> =
        super::batch::array_head(&MapData::from_id(index)?, STAMP_CHUNK as usize + 1)?;
    let (Some(stamp_chunk), Some(top)) = (
        head.get(STAMP_CHUNK as usize),
        head.get(..TOP_CHUNKS as usize),
    ) else {
        anyhow::bail!(
            "the policy index holds {} chunks, fewer than its top level",
            head.len()
        );
    };
    let left_to_the_trie = top.iter().flatten().filter(|&&w| w == ASK_THE_TRIE).count();
    Ok(PolicyIndexStatus {
        program_id,
        in_force: stamp_chunk[0] == stamp(generation),
        left_to_the_trie,
    })
}

/// The programs' packet counters (summed over CPUs) and the NAT tables' capacities.
pub struct KernelCounters {
    pub packets: Vec<(Counter, u64)>,
    pub nat_capacities: BTreeMap<IpFamily, u32>,
}

/// Reads the counters from the maps pinned in `bpffs`; `None` if nothing is pinned there.
/// Cheap enough for every metrics scrape: it reads no table, only the counters.
pub fn read_kernel_counters(bpffs: &Path) -> anyhow::Result<Option<KernelCounters>> {
    let pins = Pins::new(bpffs);
    if !pins.map(map_names::COUNTERS).exists() {
        return Ok(None);
    }
    let nat_capacities = nat_capacities(&pins)?;
    let counters: Counters = pins.open(map_names::COUNTERS)?;
    let packets = Counter::ALL
        .iter()
        .filter(|c| (**c as u32) < COUNTER_SLOTS)
        .map(|c| (*c, counter_total(&counters, *c)))
        .collect();
    Ok(Some(KernelCounters {
        packets,
        nat_capacities,
    }))
}

/// The capacity in entries of each family's NAT table pinned under `pins`, for the families
/// in use: `nat_v6` takes a single entry while IPv6 is off, and an agent from before IPv6
/// pinned none, so neither has a table to fill.
pub(super) fn nat_capacities(pins: &Pins) -> anyhow::Result<BTreeMap<IpFamily, u32>> {
    let mut capacities = BTreeMap::new();
    let v4 = pins.nat_table::<[u8; 4]>(&V4_MAPS)?;
    let v6 = pins.nat_table::<[u8; 16]>(&V6_MAPS)?;
    for (family, capacity) in [
        (
            IpFamily::Ipv4,
            v4.map(|table| table.capacity()).transpose()?,
        ),
        (
            IpFamily::Ipv6,
            v6.map(|table| table.capacity()).transpose()?,
        ),
    ] {
        if let Some(capacity) = capacity.filter(|&capacity| capacity > 1) {
            capacities.insert(family, u32::try_from(capacity).unwrap_or(u32::MAX));
        }
    }
    Ok(capacities)
}

impl std::fmt::Display for EbpfStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "eBPF objects pinned under {}", self.bpffs.display())?;
        for a in &self.attachments {
            let how = match a.link_id {
                Some(link) => format!("link {link}"),
                None => format!(
                    "clsact filter pref {} handle {:#x}",
                    attach::NETLINK_PRIORITY,
                    attach::NETLINK_HANDLE
                ),
            };
            writeln!(
                f,
                "  attached: {} {} ({how}, program {})",
                a.device,
                a.hook.name(),
                a.program_id
            )?;
        }
        let v4 = self.interfaces.iter().map(|(i, a)| (i, IpAddr::from(*a)));
        let v6 = self
            .interfaces_v6
            .iter()
            .map(|(i, a)| (i, IpAddr::from(*a)));
        for (index, addr) in v4.chain(v6) {
            writeln!(f, "  masquerades to {addr} on ifindex {index}")?;
        }
        for addr in &self.chosen_addresses {
            writeln!(f, "  pods' flows masquerade to the chosen address {addr}")?;
        }
        for prefix in self.non_masquerade_v4.iter().chain(&self.non_masquerade_v6) {
            writeln!(f, "  not masqueraded: {prefix}")?;
        }
        for prefix in self.masquerade_v4.iter().chain(&self.masquerade_v6) {
            writeln!(f, "  masqueraded although inside what is not: {prefix}")?;
        }
        for prefix in &self.non_masquerade_src {
            writeln!(f, "  from a source not masqueraded: {prefix}")?;
        }
        for prefix in &self.masquerade_src {
            writeln!(
                f,
                "  from a source masqueraded although inside what is not: {prefix}"
            )?;
        }
        for (family, table) in &self.nat {
            writeln!(
                f,
                "  NAT table {}: {} of {} entries ({}% full): {} pod flows masqueraded, {} kept, {} the node's",
                family.label(),
                table.entries,
                table.capacity,
                table.percent_full,
                table.pod_flows,
                table.kept_flows,
                table.node_flows,
            )?;
        }
        if self.strays_cleared {
            writeln!(f, "  packets left alone skip the NAT table")?;
        } else {
            writeln!(
                f,
                "  packets left alone are looked up in the NAT table: flows may have outlived \
                 the last change to the policy"
            )?;
        }
        for index in &self.policy_index_v4 {
            let program = index.program_id;
            match (index.in_force, index.left_to_the_trie) {
                (false, _) => writeln!(
                    f,
                    "  program {program} asks the IPv4 policy trie: its index does not hold the \
                     policy in force (yet)"
                )?,
                (true, 0) => writeln!(
                    f,
                    "  program {program} decides IPv4 destinations by the policy trie's index"
                )?,
                (true, left) => writeln!(
                    f,
                    "  program {program} decides IPv4 destinations by the policy trie's index, \
                     but under {left} /16s by the trie, for want of room (a restart sizes the \
                     index for the policy)"
                )?,
            }
        }
        for (name, value) in &self.counters {
            writeln!(f, "  {name}: {value}")?;
        }
        if let Some(decisions) = &self.decisions {
            write!(f, "{decisions}")?;
        }
        Ok(())
    }
}

/// Both kinds of attachment: the agent that made them may have run with other settings than
/// this process (`MASQ_AGENT_TC_NETLINK`), and a kernel upgraded under pinned links keeps none.
fn read_attachments(pins: &Pins) -> Vec<AttachmentStatus> {
    let mut out = read_links(pins);
    out.extend(read_filters());
    out.sort_by(|a, b| (&a.device, a.hook).cmp(&(&b.device, b.hook)));
    out
}

/// The TCX links pinned under `pins`.
fn read_links(pins: &Pins) -> Vec<AttachmentStatus> {
    pins.links()
        .into_iter()
        .filter_map(|(device, hook, path)| {
            let link: FdLink = PinnedLink::from_pin(path).ok()?.into();
            let info = link.info().ok()?;
            Some(AttachmentStatus {
                running: attach::runs(info.program_id(), &device, hook).unwrap_or(false),
                device,
                hook,
                link_id: Some(info.id()),
                program_id: info.program_id(),
            })
        })
        .collect()
}

/// The clsact filters of the programs on the node's devices, where there is no TCX.
fn read_filters() -> Vec<AttachmentStatus> {
    let devices = crate::netdev::names_and_indexes().unwrap_or_default();
    devices
        .iter()
        .flat_map(|(device, _)| {
            Hook::BOTH.into_iter().flat_map(move |hook| {
                tc_filters::list(device, hook)
                    .unwrap_or_default()
                    .into_iter()
                    .filter(move |f| f.name == hook.program())
                    .map(move |f| AttachmentStatus {
                        device: device.clone(),
                        hook,
                        link_id: None,
                        program_id: f.program_id,
                        running: true,
                    })
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dual-stack node's status with `nat` its tables and nothing else.
    fn with_tables(nat: BTreeMap<IpFamily, NatTableStatus>) -> EbpfStatus {
        EbpfStatus {
            bpffs: PathBuf::from("/sys/fs/bpf/ip-masq-agent"),
            attachments: Vec::new(),
            interfaces: BTreeMap::new(),
            interfaces_v6: BTreeMap::new(),
            chosen_addresses: Vec::new(),
            non_masquerade_v4: Vec::new(),
            non_masquerade_v6: Vec::new(),
            masquerade_v4: Vec::new(),
            masquerade_v6: Vec::new(),
            non_masquerade_src: Vec::new(),
            masquerade_src: Vec::new(),
            nat,
            translated_by_address: BTreeMap::new(),
            strays_cleared: true,
            policy_index_v4: Vec::new(),
            counters: BTreeMap::new(),
            decisions: None,
        }
    }

    #[test]
    fn status_says_whether_each_program_takes_its_index_s_answers() {
        let mut status = with_tables(BTreeMap::new());
        let index = |program_id, in_force, left_to_the_trie| PolicyIndexStatus {
            program_id,
            in_force,
            left_to_the_trie,
        };
        status.policy_index_v4 = vec![index(7, true, 0), index(8, false, 0), index(9, true, 3)];
        let text = status.to_string();
        let lines: Vec<&str> = text.lines().filter(|l| l.contains("program ")).collect();
        assert_eq!(
            lines,
            [
                "  program 7 decides IPv4 destinations by the policy trie's index",
                "  program 8 asks the IPv4 policy trie: its index does not hold the policy in \
                 force (yet)",
                "  program 9 decides IPv4 destinations by the policy trie's index, but under 3 \
                 /16s by the trie, for want of room (a restart sizes the index for the policy)",
            ]
        );
    }

    #[test]
    fn a_full_table_reads_full_whatever_the_other_familys_holds() {
        let full = NatUsage {
            entries: 128,
            pod_flows: 63,
            node_flows: 1,
            translated_flows: 63,
            ..NatUsage::default()
        };
        let ipv4 = NatTableStatus::new(&full, 128);
        let ipv6 = NatTableStatus::new(&NatUsage::default(), 128);
        assert_eq!((ipv4.percent_full, ipv6.percent_full), (100, 0));
        let one = NatUsage {
            entries: 1,
            ..NatUsage::default()
        };
        assert_eq!(NatTableStatus::new(&one, 524_288).percent_full, 1);
        assert_eq!(
            NatTableStatus::new(&NatUsage::default(), 0).percent_full,
            0,
            "no table, no division by zero"
        );

        let status = with_tables(BTreeMap::from([
            (IpFamily::Ipv4, ipv4),
            (IpFamily::Ipv6, ipv6),
        ]));
        let text = status.to_string();
        for line in [
            "  NAT table ipv4: 128 of 128 entries (100% full): 63 pod flows masqueraded, 0 kept, 1 the node's",
            "  NAT table ipv6: 0 of 128 entries (0% full): 0 pod flows masqueraded, 0 kept, 0 the node's",
        ] {
            assert!(text.lines().any(|l| l == line), "{line:?} in:\n{text}");
        }
        let json = serde_json::to_value(&status).unwrap();
        assert_eq!(json["nat"]["ipv4"]["entries"], 128, "{json:#}");
        assert_eq!(json["nat"]["ipv4"]["capacity"], 128, "{json:#}");
        assert_eq!(json["nat"]["ipv4"]["percent_full"], 100, "{json:#}");
        assert_eq!(json["nat"]["ipv4"]["pod_flows"], 63, "{json:#}");
        assert_eq!(json["nat"]["ipv6"]["percent_full"], 0, "{json:#}");
        assert_eq!(status.translated_flows(), 63);
    }
}

//! `masq-agent explain`: what happens to a packet from a pod to a destination, and why. The
//! config's answer comes with the entry that decides it (prefix, list, file and line); where a
//! data plane is installed on this node, the live maps and chain are asked about the same
//! packet, and every answer must be the config's.

use std::{fmt, net::IpAddr, path::Path};

use aya::maps::lpm_trie::Key;
use ipnet::IpNet;
use masq_ebpf::{IPPROTO_ICMP, IPPROTO_ICMPV6, PolicyEntry, map_names};
use serde::Serialize;

use crate::{
    config::{self, CidrList, ConfigOptions, Loaded},
    dataplane::{
        chosen_address::{self, ChosenAddresses},
        ebpf::{decisions, pins::Pins, prefixes},
        iptables::{self, ChainVerdict},
    },
    netdev,
    policy::{Action, IpFamily, LINK_LOCAL_V4, LINK_LOCAL_V6, Policy},
};

/// The list name of the implicit link-local entry.
const LINK_LOCAL: &str = "link-local";

/// The packet asked about.
#[derive(Debug, Clone, Serialize)]
pub struct Packet {
    pub destination: IpAddr,
    /// A pod's address; the node's own addresses are never masqueraded.
    pub source: Option<IpAddr>,
    /// IANA protocol number.
    pub protocol: u8,
    pub port: Option<u16>,
}

/// What happens to the packet, by the config, and what the node's data planes say.
#[derive(Debug, Clone, Serialize)]
pub struct Explanation {
    pub packet: Packet,
    pub decision: Decision,
    /// Why: the deciding entry, or `None` when no entry holds the destination.
    pub entry: Option<DecidingEntry>,
    /// The source entry that holds the packet's source, where `--src` names one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_entry: Option<DecidingEntry>,
    /// The device the packet leaves by, and the address it is masqueraded to there.
    pub leaves_by: Option<String>,
    pub masqueraded_to: Option<IpAddr>,
    /// The address the config chooses to masquerade to, when the node does not hold it and
    /// the packet takes the device's instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chosen_not_held: Option<IpAddr>,
    /// What each installed data plane says for the same packet.
    pub installed: Vec<LiveAnswer>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Decision {
    Masquerade,
    KeepsAddress,
    /// A family the agent does not handle (IPv6 without `--enable-ipv6`).
    LeftAlone,
    /// The source is the node's own address.
    NodeSource,
    /// The destination is the node itself: the packet never leaves.
    Local,
}

#[derive(Debug, Clone, Serialize)]
pub struct DecidingEntry {
    pub prefix: IpNet,
    /// `nonMasqueradeCIDRs`, `masqueradeCIDRs`, or `link-local` (the implicit entry).
    pub list: &'static str,
    /// The file that lists it (`None`: the defaults, or the implicit link-local entry).
    pub file: Option<String>,
    pub line: Option<usize>,
}

#[derive(Debug, Clone, Serialize)]
pub struct LiveAnswer {
    /// What was asked: `the eBPF maps` or `the iptables chain`.
    pub source: &'static str,
    pub decision: Decision,
    /// How it got there, in a few words.
    pub detail: String,
    /// The eBPF maps: the packets of no known flow that the deciding entry (or, with none, the
    /// default) decided, where the counters have a slot for it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub decisions: Option<u64>,
}

impl Explanation {
    /// The answers that disagree with the config's.
    pub fn disagreements(&self) -> Vec<&LiveAnswer> {
        self.installed
            .iter()
            .filter(|a| a.decision != self.decision)
            .collect()
    }
}

/// Explains `packet` under the config at `config_path`, asking the data planes installed with
/// chain `chain` and pins under `bpffs`.
pub fn explain(
    mut packet: Packet,
    loaded: &Loaded,
    opts: &ConfigOptions,
    chain: &str,
    bpffs: &Path,
) -> anyhow::Result<Explanation> {
    // IPv6 as the file has it, `enableIPv6` over the flag, as the agent reads it: the place
    // of an IPv6 entry is found only where IPv6 is on.
    let families = opts.families.as_the_file_says(loaded.config.enable_ipv6);
    let opts = &ConfigOptions { families, ..*opts };
    let policy = Policy::from_config(&loaded.config, families);
    let dst = packet.destination;
    // `--proto icmp` toward an IPv6 address means ICMPv6.
    if dst.is_ipv6() && packet.protocol == IPPROTO_ICMP {
        packet.protocol = IPPROTO_ICMPV6;
    }
    let family = match dst {
        IpAddr::V4(_) => IpFamily::Ipv4,
        IpAddr::V6(_) => IpFamily::Ipv6,
    };
    let local = netdev::local_addresses()?;
    let node_source = packet.source.is_some_and(|src| local.contains(&src));
    let to_the_node = dst.is_loopback() || local.contains(&dst);
    let (action, prefix) = policy.decide(dst);
    // A pod's source: masqueraded only when the source lists say so too.
    let by_source = packet
        .source
        .filter(|_| !node_source)
        .map(|src| policy.decide_source(src));
    let source_keeps = matches!(by_source, Some((Action::NonMasquerade, _)));
    let decision = if policy.rules(family).is_none() {
        Decision::LeftAlone
    } else if to_the_node {
        Decision::Local
    } else if node_source {
        Decision::NodeSource
    } else {
        match (action, source_keeps) {
            (Action::Masquerade, false) => Decision::Masquerade,
            _ => Decision::KeepsAddress,
        }
    };
    let list = |action| match action {
        Action::Masquerade => CidrList::Masquerade,
        Action::NonMasquerade => CidrList::NonMasquerade,
    };
    let entry = prefix.map(|prefix| deciding_entry(loaded, opts, prefix, list(action)));
    let source_entry = by_source.and_then(|(action, prefix)| {
        let list = match action {
            Action::Masquerade => CidrList::MasqueradeSrc,
            Action::NonMasquerade => CidrList::NonMasqueradeSrc,
        };
        prefix.map(|prefix| deciding_entry(loaded, opts, prefix, list))
    });
    let route = netdev::route_to(dst)?;
    let leaves_by = route.as_ref().map(|(device, _)| device.clone());
    // The chosen masquerade address while the node holds it, else the device's.
    let chosen = ChosenAddresses::held(&policy, &local).of(family);
    let masqueraded_to = match (&route, decision) {
        (Some((device, source)), Decision::Masquerade) => {
            chosen.or(node_address(device, family)?).or(Some(*source))
        }
        _ => None,
    };
    let chosen_not_held =
        chosen_address::not_held(&policy, &local, family).filter(|_| masqueraded_to.is_some());
    let mut installed = Vec::new();
    if matches!(decision, Decision::Masquerade | Decision::KeepsAddress) {
        let device = leaves_by.as_deref().unwrap_or_default();
        match ask_chain(family, chain, &packet, device)? {
            // What the chain leaves to the programs, the programs decide, if they are there.
            Some((answer, true)) => {
                installed.push(ask_programs(bpffs, packet.source, dst)?.unwrap_or(answer))
            }
            Some((answer, false)) => installed.push(answer),
            None => installed.extend(ask_programs(bpffs, packet.source, dst)?),
        }
    }
    Ok(Explanation {
        packet,
        decision,
        entry,
        source_entry,
        leaves_by,
        masqueraded_to,
        chosen_not_held,
        installed,
    })
}

/// Where the deciding entry comes from.
fn deciding_entry(
    loaded: &Loaded,
    opts: &ConfigOptions,
    prefix: IpNet,
    list: CidrList,
) -> DecidingEntry {
    let listed = loaded.config.list(list);
    let implicit_link_local = !listed.contains(&prefix)
        && (prefix == LINK_LOCAL_V4.into() || prefix == LINK_LOCAL_V6.into());
    let place = loaded.files.iter().find_map(|file| {
        let text = std::fs::read(file).ok()?;
        let line = config::cidr_line(&text, opts, list, prefix)?;
        Some((file.display().to_string(), line))
    });
    DecidingEntry {
        prefix,
        list: if implicit_link_local {
            "link-local"
        } else {
            list.key()
        },
        file: place.as_ref().map(|(file, _)| file.clone()),
        line: place.map(|(_, line)| line),
    }
}

/// The address the data plane gives masqueraded packets on `device`.
fn node_address(device: &str, family: IpFamily) -> anyhow::Result<Option<IpAddr>> {
    Ok(match netdev::device_state(device)? {
        netdev::DeviceState::Usable(d) => match family {
            IpFamily::Ipv4 => Some(d.ipv4.into()),
            IpFamily::Ipv6 => d.ipv6.map(IpAddr::from),
        },
        _ => None,
    })
}

/// What the installed chain does with the packet, and whether it leaves it to the eBPF
/// programs; `None` if no chain is installed.
fn ask_chain(
    family: IpFamily,
    chain: &str,
    packet: &Packet,
    device: &str,
) -> anyhow::Result<Option<(LiveAnswer, bool)>> {
    let verdict = iptables::chain_verdict(
        family,
        chain,
        (packet.source, packet.destination),
        packet.protocol,
        device,
    )?;
    Ok(verdict.map(|verdict| {
        let (decision, detail) = match verdict {
            ChainVerdict::Masquerades => (Decision::Masquerade, "masquerades it"),
            ChainVerdict::KeepsAddress => (Decision::KeepsAddress, "returns it"),
            ChainVerdict::LeftToPrograms => {
                (Decision::KeepsAddress, "returns it for the eBPF programs")
            }
            ChainVerdict::NotJumpedTo => (
                Decision::KeepsAddress,
                "is not jumped to from POSTROUTING: nothing in it applies",
            ),
        };
        let answer = LiveAnswer {
            source: "the iptables chain",
            decision,
            detail: format!("chain {chain} {detail}"),
            decisions: None,
        };
        (answer, verdict == ChainVerdict::LeftToPrograms)
    }))
}

/// What the pinned policy trie says for `dst`, if the eBPF data plane is installed, with the
/// decisions its counters hold for the deciding entry (or for the default).
fn ask_programs(
    bpffs: &Path,
    src: Option<IpAddr>,
    dst: IpAddr,
) -> anyhow::Result<Option<LiveAnswer>> {
    let pins = Pins::new(bpffs);
    if let Some(answer) = src
        .map(|src| ask_source_trie(&pins, src, dst))
        .transpose()?
        .flatten()
    {
        return Ok(Some(answer));
    }
    let name = match dst {
        IpAddr::V4(_) => map_names::NON_MASQ_V4,
        IpAddr::V6(_) => map_names::NON_MASQ_V6,
    };
    if !pins.map(name).exists() {
        return Ok(None);
    }
    let entry = match dst {
        IpAddr::V4(addr) => longest::<4>(&pins.open(name)?, addr.octets()),
        IpAddr::V6(addr) => longest::<16>(&pins.open(name)?, addr.octets()),
    };
    let live = masq_ebpf::Decision::of(entry.as_ref());
    let decision = match live.keeps_address {
        true => Decision::KeepsAddress,
        false => Decision::Masquerade,
    };
    let detail = match entry {
        None => format!("no prefix of {dst} in {name}"),
        Some(_) if live.keeps_address => {
            format!("the longest prefix of {dst} in {name} keeps the pod's address")
        }
        Some(_) => format!("the longest prefix of {dst} in {name} masquerades"),
    };
    let decisions = match decisions::open_pinned(&pins)? {
        Some(counters) => decisions::count(&counters, live.counted_in)?,
        None => None,
    };
    Ok(Some(LiveAnswer {
        source: "the eBPF maps",
        decision,
        detail,
        decisions,
    }))
}

/// What the programs' source trie says of `src`, where it leaves the pod's address alone
/// toward `dst` (as the programs ask it only of a flow the destination masquerades, an answer
/// toward a destination left alone is the destination trie's).
fn ask_source_trie(pins: &Pins, src: IpAddr, dst: IpAddr) -> anyhow::Result<Option<LiveAnswer>> {
    let name = match src {
        IpAddr::V4(_) => map_names::NON_MASQ_SRC_V4,
        IpAddr::V6(_) => map_names::NON_MASQ_SRC_V6,
    };
    if !pins.map(name).exists() {
        return Ok(None);
    }
    let destination = match dst {
        IpAddr::V4(addr) => longest::<4>(&pins.open(map_names::NON_MASQ_V4)?, addr.octets()),
        IpAddr::V6(addr) => longest::<16>(&pins.open(map_names::NON_MASQ_V6)?, addr.octets()),
    };
    if masq_ebpf::Decision::of(destination.as_ref()).keeps_address {
        return Ok(None);
    }
    let entry = match src {
        IpAddr::V4(addr) => longest::<4>(&pins.open(name)?, addr.octets()),
        IpAddr::V6(addr) => longest::<16>(&pins.open(name)?, addr.octets()),
    };
    let Some(entry) = entry.filter(|e| e.action == masq_ebpf::prefix_action::NON_MASQUERADE) else {
        return Ok(None);
    };
    let decisions = match decisions::open_pinned(pins)? {
        Some(counters) => decisions::count(&counters, entry.counted_in)?,
        None => None,
    };
    Ok(Some(LiveAnswer {
        source: "the eBPF maps",
        decision: Decision::KeepsAddress,
        detail: format!("the longest prefix of {src} in {name} keeps the pod's address"),
        decisions,
    }))
}

/// The entry of the longest prefix of `addr` in `trie`.
fn longest<const N: usize>(trie: &prefixes::PolicyTrie<N>, addr: [u8; N]) -> Option<PolicyEntry> {
    trie.get(&Key::new(8 * N as u32, addr), 0).ok()
}

impl fmt::Display for Decision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Decision::Masquerade => "masqueraded",
            Decision::KeepsAddress => "not masqueraded: it keeps the pod's address",
            Decision::LeftAlone => "left alone: the agent handles IPv6 only with --enable-ipv6",
            Decision::NodeSource => "not masqueraded: the source is the node's own address",
            Decision::Local => "not masqueraded: the destination is the node itself",
        })
    }
}

impl fmt::Display for DecidingEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.list, &self.file, self.line) {
            (LINK_LOCAL, ..) => write!(
                f,
                "{}: link-local, which keeps the pod's address unless masqLinkLocal (IPv6: \
                 masqLinkLocalIPv6) says otherwise",
                self.prefix
            ),
            (list, Some(file), Some(line)) => {
                write!(f, "{} in {list} ({file}, line {line})", self.prefix)
            }
            (list, Some(file), None) => write!(f, "{} in {list} ({file})", self.prefix),
            (list, None, _) => write!(f, "{} in the default {list}", self.prefix),
        }
    }
}

impl fmt::Display for Explanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.packet;
        let from = p.source.map_or("a pod".to_string(), |s| s.to_string());
        let port = p.port.map_or(String::new(), |port| format!(" port {port}"));
        let protocol = crate::protocols::name(p.protocol);
        writeln!(f, "{from} -> {}{port}, {protocol}", p.destination)?;
        match (self.decision, &self.masqueraded_to, &self.leaves_by) {
            (Decision::Masquerade, Some(addr), Some(dev)) => {
                writeln!(f, "  masqueraded to {addr}, leaving by {dev}")?
            }
            (decision, _, _) => writeln!(f, "  {decision}")?,
        }
        if let Some(addr) = self.chosen_not_held {
            writeln!(
                f,
                "  not to {addr}, the chosen address: the node does not hold it"
            )?;
        }
        match (&self.entry, self.decision) {
            (_, Decision::LeftAlone | Decision::NodeSource | Decision::Local) => {}
            (Some(entry), _) => writeln!(f, "  because: {entry}")?,
            (None, _) => writeln!(
                f,
                "  because: no entry holds it, and what none holds is masqueraded"
            )?,
        }
        if let Some(entry) = &self.source_entry {
            writeln!(f, "  its source: {entry}")?;
        }
        for answer in &self.installed {
            let agrees = if answer.decision == self.decision {
                "agrees"
            } else {
                "DISAGREES"
            };
            writeln!(f, "  {}: {agrees}: {}", answer.source, answer.detail)?;
            if let Some(n) = answer.decisions {
                writeln!(f, "    which decided {n} packets of no known flow so far")?;
            }
        }
        let asked = matches!(self.decision, Decision::Masquerade | Decision::KeepsAddress);
        if self.installed.is_empty() && asked {
            writeln!(f, "  no data plane is installed on this node")?;
        }
        Ok(())
    }
}

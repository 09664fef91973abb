//! The chain read back from the kernel, as `iptables -S` lists it: what `status` shows, and
//! what tells the agent that someone else changed the chain.

use std::net::IpAddr;

use anyhow::Context as _;
use ipnet::IpNet;
use serde::Serialize;

use super::{
    command::{Iptables, available_families, binary},
    ipset,
};
use crate::{policy::IpFamily, protocols::Protocol};

fn push_new<T: PartialEq>(list: &mut Vec<T>, item: T) {
    if !list.contains(&item) {
        list.push(item);
    }
}

/// iptables' `-o` wildcard: a name ending in `+` matches every name it begins.
const ANY_DEVICE: &str = "+";

/// Whether `-o pattern` matches `device`.
pub(super) fn device_matches(pattern: &str, device: &str) -> bool {
    match pattern.strip_suffix(ANY_DEVICE) {
        Some(prefix) => device.starts_with(prefix),
        None => device == pattern,
    }
}

/// A destination as `iptables -S` (`-d`) or `ipset list` writes it: a prefix, or an address
/// alone.
pub(super) fn destination(written: &str) -> anyhow::Result<IpNet> {
    written
        .parse::<IpNet>()
        .or_else(|_| written.parse::<std::net::IpAddr>().map(IpNet::from))
        .with_context(|| format!("not a destination: {written}"))
}

/// The word after `flag` among a rule's `words`, as `iptables -S` lists it.
pub(super) fn flag_value<'a>(words: &[&'a str], flag: &str) -> Option<&'a str> {
    let at = words.iter().position(|w| *w == flag)?;
    words.get(at + 1).copied()
}

/// The address of SNAT's `--to-source`: `A`, `A:PORTS`, or IPv6's `[A]:PORTS`.
pub(super) fn snat_address(to_source: &str) -> Option<IpAddr> {
    if let Some(bracketed) = to_source.strip_prefix('[') {
        return bracketed.split_once(']')?.0.parse().ok();
    }
    to_source.parse().ok().or_else(|| {
        let (address, _ports) = to_source.rsplit_once(':')?;
        address.parse().ok()
    })
}

/// A rule's `--match-set NAME src|dst`: the set, and whether it matches on the source.
pub(super) fn set_match<'a>(words: &[&'a str]) -> Option<(&'a str, bool)> {
    let at = words.iter().position(|w| *w == "--match-set")?;
    Some((words.get(at + 1)?, words.get(at + 2) == Some(&"src")))
}

/// One family's chain, as read back from the kernel.
#[derive(Debug, Clone, Serialize)]
pub struct ChainStatus {
    pub family: IpFamily,
    pub chain: String,
    pub installed: bool,
    pub jump_installed: bool,
    /// Protocols that return early because the eBPF programs translate them.
    pub ebpf_protocols_returned: Vec<Protocol>,
    /// The devices (as `-o` names them) by which those protocols return early.
    pub ebpf_devices_returned: Vec<String>,
    pub non_masquerade: Vec<IpNet>,
    /// The masqueradeCIDRs entries, where there are any.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub masquerade_exceptions: Vec<IpNet>,
    /// The sources left alone, and the exceptions to them, where there are any.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub non_masquerade_src: Vec<IpNet>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub masquerade_src_exceptions: Vec<IpNet>,
    pub masquerade_rules: usize,
    /// The chosen address the masquerade rules SNAT to (`masqueradeAddress`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub snat_to: Option<IpAddr>,
}

impl ChainStatus {
    /// The chain as `iptables -S` lists it (`None`: not installed), with the members of the set
    /// it matches on from `set_members`.
    pub(super) fn read(
        family: IpFamily,
        chain: &str,
        listing: Option<&str>,
        set_members: impl Fn(&str) -> anyhow::Result<Vec<String>>,
    ) -> anyhow::Result<ChainStatus> {
        let mut status = ChainStatus {
            family,
            chain: chain.to_string(),
            installed: listing.is_some(),
            jump_installed: false,
            ebpf_protocols_returned: Vec::new(),
            ebpf_devices_returned: Vec::new(),
            non_masquerade: Vec::new(),
            masquerade_exceptions: Vec::new(),
            non_masquerade_src: Vec::new(),
            masquerade_src_exceptions: Vec::new(),
            masquerade_rules: 0,
            snat_to: None,
        };
        for line in listing.unwrap_or_default().lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            let after = |flag: &str| flag_value(&words, flag).map(String::from);
            if line.contains("-j MASQUERADE") || line.contains("-j SNAT") {
                status.masquerade_rules += 1;
                if let Some(to) = after("--to-source") {
                    let address = snat_address(&to)
                        .with_context(|| format!("--to-source {to} names no address"))?;
                    status.snat_to = Some(address);
                }
                if let Some(dst) = after("-d") {
                    push_new(&mut status.masquerade_exceptions, destination(&dst)?);
                }
            } else if let Some((set, by_source)) = set_match(&words) {
                let (kept, excepted) = if by_source {
                    (
                        &mut status.non_masquerade_src,
                        &mut status.masquerade_src_exceptions,
                    )
                } else {
                    (
                        &mut status.non_masquerade,
                        &mut status.masquerade_exceptions,
                    )
                };
                for member in set_members(set)? {
                    match member.strip_suffix(&format!(" {}", ipset::NOMATCH)) {
                        Some(exception) => excepted.push(destination(exception)?),
                        None => kept.push(destination(&member)?),
                    }
                }
            } else if let Some(dst) = after("-d") {
                status.non_masquerade.push(destination(&dst)?);
            } else if let Some(proto) = after("-p") {
                let proto = Protocol::parse(&proto)
                    .with_context(|| format!("the chain returns a protocol not known: {proto}"))?;
                // A rule without `-o` (an agent before per-device rules) returns every device.
                let device = after("-o").unwrap_or_else(|| ANY_DEVICE.to_string());
                push_new(&mut status.ebpf_protocols_returned, proto);
                push_new(&mut status.ebpf_devices_returned, device);
            }
        }
        Ok(status)
    }

    /// Whether the chain returns the TCP, UDP and ICMP leaving by `device` to the eBPF
    /// programs, masquerading none of it.
    pub fn returns_to_programs(&self, device: &str) -> bool {
        self.ebpf_devices_returned
            .iter()
            .any(|pattern| device_matches(pattern, device))
    }

    /// Whether packets leaving the node go through this chain at all.
    pub fn in_force(&self) -> bool {
        self.installed && self.jump_installed
    }
}

impl std::fmt::Display for ChainStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let family = binary(self.family);
        if !self.installed {
            return writeln!(f, "{family} nat chain {}: not installed", self.chain);
        }
        writeln!(
            f,
            "{family} nat chain {}: {} non-masquerade rules, {} MASQUERADE rules, POSTROUTING jump {}",
            self.chain,
            self.non_masquerade.len(),
            self.masquerade_rules,
            if self.jump_installed {
                "present"
            } else {
                "MISSING"
            }
        )?;
        if !self.ebpf_protocols_returned.is_empty() {
            let protocols: Vec<String> = self
                .ebpf_protocols_returned
                .iter()
                .map(Protocol::to_string)
                .collect();
            writeln!(
                f,
                "  left to eBPF: {} leaving by {}",
                protocols.join(", "),
                self.ebpf_devices_returned.join(", ")
            )?;
        }
        if let Some(to) = &self.snat_to {
            writeln!(f, "  masquerades to the chosen address {to}")?;
        }
        for cidr in &self.masquerade_exceptions {
            writeln!(f, "  masqueraded although inside what is not: {cidr}")?;
        }
        for cidr in &self.non_masquerade {
            writeln!(f, "  not masqueraded: {cidr}")?;
        }
        for cidr in &self.masquerade_src_exceptions {
            writeln!(
                f,
                "  from a source masqueraded although inside what is not: {cidr}"
            )?;
        }
        for cidr in &self.non_masquerade_src {
            writeln!(f, "  from a source not masqueraded: {cidr}")?;
        }
        Ok(())
    }
}

/// Reads the chains back from the kernel, for any process (the daemon or `status`).
pub fn read_chains(chain: &str) -> anyhow::Result<Vec<ChainStatus>> {
    available_families()
        .into_iter()
        .map(|family| chain_status(&Iptables { family }, chain))
        .collect()
}

/// One family's chain and its jump, as the kernel holds them now.
fn chain_status(iptables: &Iptables, chain: &str) -> anyhow::Result<ChainStatus> {
    let listing = iptables.list_chain(chain)?;
    let mut status = ChainStatus::read(iptables.family, chain, listing.as_deref(), ipset::members)?;
    status.jump_installed = iptables.jump_present(chain)?;
    Ok(status)
}

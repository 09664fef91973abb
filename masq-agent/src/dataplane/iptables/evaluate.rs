//! What the installed chain does with one packet, followed rule by rule as the kernel would:
//! the chain's half of `explain`.

use anyhow::bail;
use serde::Serialize;

use super::{
    command::Iptables,
    ipset,
    readback::{destination, device_matches, flag_value, set_match},
    render::SOURCE_ON_THE_DEVICE,
};
use crate::policy::IpFamily;

/// What the installed chain does with a packet, found rule by rule as the kernel would.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ChainVerdict {
    /// A rule returns it unmasqueraded (or the chain ends).
    KeepsAddress,
    Masquerades,
    /// It returns at once, for the eBPF programs on its device to translate.
    LeftToPrograms,
    /// No POSTROUTING rule jumps to the chain: nothing in it applies.
    NotJumpedTo,
}

/// What chain `chain` of `family` does with a packet of `protocol` (IANA number) to `dst`
/// leaving by `device`; `None` if the chain is not installed.
pub fn chain_verdict(
    family: IpFamily,
    chain: &str,
    (src, dst): (Option<std::net::IpAddr>, std::net::IpAddr),
    protocol: u8,
    device: &str,
) -> anyhow::Result<Option<ChainVerdict>> {
    let iptables = Iptables { family };
    let Some(listing) = iptables.list_chain(chain)? else {
        return Ok(None);
    };
    if !iptables.jump_present(chain)? {
        return Ok(Some(ChainVerdict::NotJumpedTo));
    }
    let device_addresses = crate::netdev::device_addresses(device)?;
    let packet = Packet {
        src,
        dst,
        protocol,
        device,
        src_on_device: src.is_some_and(|src| device_addresses.contains(&src)),
    };
    evaluate(&listing, &packet, ipset::contains).map(Some)
}

/// A packet as the chain's matches see it.
pub(super) struct Packet<'a> {
    /// Unknown, it is held by no source entry.
    pub(super) src: Option<std::net::IpAddr>,
    pub(super) dst: std::net::IpAddr,
    pub(super) protocol: u8,
    pub(super) device: &'a str,
    /// Whether the source is an address of `device`: the node's own traffic from it.
    pub(super) src_on_device: bool,
}

/// Whether a rule uses only what the agent's own chains use, which `evaluate` follows: no
/// negation, no source match, and no match module but comment, set, statistic (which picks
/// among masquerade rules, all of which masquerade) and addrtype as `SOURCE_ON_THE_DEVICE`.
fn understood(line: &str, words: &[&str]) -> bool {
    let mut modules = words
        .windows(2)
        .filter(|pair| pair[0] == "-m")
        .map(|pair| pair[1]);
    !words
        .iter()
        .any(|w| matches!(*w, "!" | "-s" | "--source" | "-i" | "-g" | "--goto"))
        && modules.all(|m| match m {
            "comment" | "set" | "statistic" => true,
            "addrtype" => line.contains(SOURCE_ON_THE_DEVICE),
            _ => false,
        })
}

/// The verdict of the first rule of `listing` (as `iptables -S` prints the chain) that
/// `packet` matches; `in_set` answers `--match-set`.
pub(super) fn evaluate(
    listing: &str,
    packet: &Packet,
    in_set: impl Fn(&str, std::net::IpAddr) -> anyhow::Result<bool>,
) -> anyhow::Result<ChainVerdict> {
    for line in listing.lines().filter(|l| l.starts_with("-A ")) {
        let words: Vec<&str> = line.split_whitespace().collect();
        if !understood(line, &words) {
            bail!("the chain holds a rule this reading cannot follow: {line}");
        }
        let after = |flag: &str| flag_value(&words, flag);
        let on_device = after("-o").is_none_or(|o| device_matches(o, packet.device));
        let protocol_matches =
            after("-p").is_none_or(|p| crate::protocols::number(p) == Some(packet.protocol));
        let dst_matches =
            after("-d").is_none_or(|d| destination(d).is_ok_and(|net| net.contains(&packet.dst)));
        let src_matches = !line.contains(SOURCE_ON_THE_DEVICE) || packet.src_on_device;
        if !(on_device && protocol_matches && dst_matches && src_matches) {
            continue;
        }
        if let Some((set, by_source)) = set_match(&words) {
            let addr = if by_source {
                packet.src
            } else {
                Some(packet.dst)
            };
            if !addr.map_or(Ok(false), |addr| in_set(set, addr))? {
                continue;
            }
        }
        return Ok(match after("-j") {
            Some("MASQUERADE" | "SNAT") => ChainVerdict::Masquerades,
            _ if after("-o").is_some() => ChainVerdict::LeftToPrograms,
            _ => ChainVerdict::KeepsAddress,
        });
    }
    Ok(ChainVerdict::KeepsAddress)
}

//! The chain as text: upstream's `nat` chain, byte for byte, as iptables-restore reads it, and
//! the rule that jumps to it from POSTROUTING.

use std::net::IpAddr;

use super::{command::Capabilities, ipset};
use crate::policy::{Action, IpFamily, MasqueradeOptions, Policy, Rules};

const NON_MASQ_COMMENT: &str =
    r#"-m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE""#;
const MASQ_COMMENT: &str = r#"-m comment --comment "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in chain)""#;
const MASQ_EXCEPTION_COMMENT: &str = r#"-m comment --comment "ip-masq-agent: traffic to a masqueradeCIDRs entry is subject to MASQUERADE""#;
const SWITCHED_OFF_COMMENT: &str = r#"-m comment --comment "ip-masq-agent: IPv6 switched off by the config; what is open stays translated""#;
const NON_MASQ_SRC_COMMENT: &str = r#"-m comment --comment "ip-masq-agent: traffic from a nonMasqueradeSrcCIDRs source is not subject to MASQUERADE""#;
const NODE_SOURCE_COMMENT: &str = r#"-m comment --comment "ip-masq-agent: node traffic from an address of the outgoing device is not subject to SNAT""#;
/// The match of packets whose source is an address of the device they leave by: the node's
/// own traffic, as the eBPF programs tell it apart.
pub(super) const SOURCE_ON_THE_DEVICE: &str = "-m addrtype --src-type LOCAL --limit-iface-out";
const EBPF_RETURN_COMMENT: &str =
    r#"-m comment --comment "ip-masq-agent: translated by the eBPF data plane""#;
/// MASQUERADE's `--to-ports` applies to these protocols, one rule per range each.
const PORT_MAPPED_PROTOCOLS: [&str; 3] = ["tcp", "udp", "sctp"];

/// Which chain body to install.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChainVariant {
    /// Upstream's chain: masquerades everything not exempted.
    Full,
    /// The same chain, but what the eBPF programs translate returns first when it leaves by a
    /// device that carries them, so the chain handles the other protocols (SCTP, GRE, ...) and
    /// whatever leaves by other devices.
    OutsideEbpf {
        /// Never empty: see `beside_programs`.
        devices: Vec<String>,
    },
}

impl ChainVariant {
    /// The chain beside programs on `devices`: upstream's when there are none, as then nothing
    /// is left to the programs.
    pub fn beside_programs(devices: Vec<String>) -> ChainVariant {
        if devices.is_empty() {
            ChainVariant::Full
        } else {
            ChainVariant::OutsideEbpf { devices }
        }
    }
}

/// The protocols the eBPF programs translate, as the family's iptables names them.
fn ebpf_protocols(family: IpFamily) -> [&'static str; 3] {
    let icmp = match family {
        IpFamily::Ipv4 => "icmp",
        IpFamily::Ipv6 => "ipv6-icmp",
    };
    ["tcp", "udp", icmp]
}

/// A family's entries in rule order, so that the first rule a destination matches is the one
/// that decides it; `None` when the policy leaves the family alone. Without exceptions that is
/// upstream's order; with them, longest prefix first.
fn rules_in_chain_order(family: IpFamily, policy: &Policy) -> Option<Rules> {
    let mut rules = policy.rules(family)?;
    if rules
        .iter()
        .any(|(_, action)| *action == Action::Masquerade)
    {
        rules.sort_by_key(|(net, _)| std::cmp::Reverse(net.prefix_len()));
    }
    Some(rules)
}

/// The members of the set that stands for a family's entries beside the programs: `hash:net`
/// matches the longest prefix it holds, and an exception is a `nomatch` entry, so the set gives
/// the same answer as the trie. The set holds no /0, which two /1 halves stand for; an entry
/// for one of those /1s is the longer prefix, and takes its half's place.
pub fn set_members(rules: &Rules) -> Vec<ipset::Member> {
    // Of the entries for one prefix, the one sorted last holds: a rule over a /0's half, of two
    // rules the later one, and of two /0s' halves the earlier one's. Sorting (rather than
    // hashing) 100 000 entries takes half the time, and the set wants them sorted anyway; on a
    // key of plain integers, computed once, where comparing the prefixes themselves took twice
    // as long again.
    let mut ranked: Vec<(MemberOrder, ipnet::IpNet, Action)> = Vec::with_capacity(rules.len());
    for (i, &(net, action)) in rules.iter().enumerate() {
        match net.prefix_len() {
            0 => ranked.extend(
                (net.subnets(1).expect("a /0 splits in two"))
                    .map(|half| (member_order(half, false, i), half, action)),
            ),
            _ => ranked.push((member_order(net, true, i), net, action)),
        }
    }
    ranked.sort_unstable_by_key(|&(order, _, _)| order);
    let mut members: Vec<ipset::Member> = Vec::with_capacity(ranked.len());
    for (_, net, action) in ranked {
        let member = ipset::Member {
            net,
            nomatch: action == Action::Masquerade,
        };
        match members.last_mut() {
            Some(last) if last.net == net => *last = member,
            _ => members.push(member),
        }
    }
    members
}

/// Where a set's entry sorts: IPv4 before IPv6, then as the prefixes sort (address, then
/// length), then as the rule ranks (`member_order`).
type MemberOrder = (bool, u128, u64);

/// The order of the entry for `net` from the rule at `index`, which `written` says was written
/// as it stands (not a /0's half): of one prefix's entries, a half first, then by index, the
/// later ones after a written one's and the earlier ones after a half's.
fn member_order(net: ipnet::IpNet, written: bool, index: usize) -> MemberOrder {
    let (v6, addr) = match net {
        ipnet::IpNet::V4(n) => (false, u128::from(u32::from(n.addr()))),
        ipnet::IpNet::V6(n) => (true, u128::from(n.addr())),
    };
    let index = u32::try_from(index).expect("fewer rules than 2^32");
    let rank = match written {
        true => index,
        false => u32::MAX - index,
    };
    let tail = u64::from(net.prefix_len()) << 33 | u64::from(written) << 32 | u64::from(rank);
    (v6, addr, tail)
}

/// The iptables-restore input for one family, or `None` when the policy leaves that family
/// alone (IPv6 not enabled).
pub fn render(
    family: IpFamily,
    policy: &Policy,
    opts: &MasqueradeOptions,
    caps: Capabilities,
    variant: &ChainVariant,
    to_source: Option<IpAddr>,
) -> Option<String> {
    let rules = rules_in_chain_order(family, policy)?;
    let chain = &opts.chain;
    let mut lines = vec!["*nat".to_string(), format!(":{chain} - [0:0]")];
    if let ChainVariant::OutsideEbpf { devices } = variant {
        for device in devices {
            for proto in ebpf_protocols(family) {
                lines.push(format!(
                    "-A {chain} {EBPF_RETURN_COMMENT} -o {device} -p {proto} -j RETURN"
                ));
            }
        }
    }
    // MASQUERADE leaves the node's own traffic from the device's address with that address;
    // SNAT to a chosen address would move it, where the programs leave it alone. Without a
    // chosen address the chain stays upstream's, byte for byte.
    if to_source.is_some() {
        lines.push(format!(
            "-A {chain} {NODE_SOURCE_COMMENT} {SOURCE_ON_THE_DEVICE} -j RETURN"
        ));
    }
    // Sources the policy leaves alone return before any destination is looked at; the set
    // holds the exceptions as `nomatch`, so that their longest prefix decides as the programs'
    // trie does. Without source entries the chain is upstream's, byte for byte.
    if !policy.source_rules(family).is_empty() {
        let set = ipset::source_name(chain, family);
        lines.push(format!(
            "-A {chain} {NON_MASQ_SRC_COMMENT} -m set --match-set {set} src -j RETURN"
        ));
    }
    let random_fully = if opts.random_fully && caps.random_fully {
        " --random-fully"
    } else {
        ""
    };
    // MASQUERADE takes the outgoing device's address; SNAT the chosen one, while the node holds
    // it (`masqueradeAddress`), its ports in the address when `--to-ports` limits them.
    let snat = |addr: IpAddr, ports: Option<&str>| match (addr, ports) {
        (addr, None) => format!("-j SNAT --to-source {addr}{random_fully}"),
        (IpAddr::V4(addr), Some(range)) => {
            format!("-j SNAT --to-source {addr}:{range}{random_fully}")
        }
        (IpAddr::V6(addr), Some(range)) => {
            format!("-j SNAT --to-source [{addr}]:{range}{random_fully}")
        }
    };
    // The rules that masquerade what reaches them: to `dst` only, or (last) everything.
    let masquerade_rules = |dst: Option<&str>| {
        let (comment, dst) = match dst {
            Some(cidr) => (MASQ_EXCEPTION_COMMENT, format!(" -d {cidr}")),
            None => (MASQ_COMMENT, String::new()),
        };
        let mut rules = Vec::new();
        if let Some(ports) = &opts.to_ports {
            for proto in PORT_MAPPED_PROTOCOLS {
                for (range, probability) in ports.sequential_probabilities() {
                    let statistic = probability
                        .map(|p| format!(" -m statistic --mode random --probability {p}"))
                        .unwrap_or_default();
                    // Upstream's MASQUERADE rules name the protocol after the target, which
                    // MASQUERADE allows; SNAT reads its ports as it parses `--to-source`, and
                    // refuses them unless `-p` came first.
                    rules.push(match to_source {
                        None => format!(
                            "-A {chain} {comment}{dst} -j MASQUERADE{random_fully} -p {proto}{statistic} --to-ports {range}"
                        ),
                        Some(addr) => format!(
                            "-A {chain} {comment}{dst} -p {proto}{statistic} {}",
                            snat(addr, Some(&range.to_string()))
                        ),
                    });
                }
            }
        }
        rules.push(match to_source {
            None => format!("-A {chain} {comment}{dst} -j MASQUERADE{random_fully}"),
            Some(addr) => format!("-A {chain} {comment}{dst} {}", snat(addr, None)),
        });
        rules
    };
    match variant {
        ChainVariant::Full => {
            for (cidr, action) in rules {
                match action {
                    Action::NonMasquerade => {
                        lines.push(format!("-A {chain} {NON_MASQ_COMMENT} -d {cidr} -j RETURN"));
                    }
                    Action::Masquerade => lines.extend(masquerade_rules(Some(&cidr.to_string()))),
                }
            }
        }
        ChainVariant::OutsideEbpf { .. } => {
            let set = ipset::name(chain, family);
            lines.push(format!(
                "-A {chain} {NON_MASQ_COMMENT} -m set --match-set {set} dst -j RETURN"
            ));
        }
    }
    lines.extend(masquerade_rules(None));
    lines.push("COMMIT".to_string());
    let mut text = lines.join("\n");
    text.push('\n');
    Some(text)
}

/// The chain for IPv6 switched off by the file: it masquerades nothing, and keeps conntrack's
/// IPv6 hooks (see `IptablesDataPlane::switched_off`).
pub fn render_switched_off(chain: &str) -> String {
    format!(
        "*nat\n:{chain} - [0:0]\n-A {chain} {SWITCHED_OFF_COMMENT} -m conntrack --ctstate SNAT -j RETURN\nCOMMIT\n"
    )
}

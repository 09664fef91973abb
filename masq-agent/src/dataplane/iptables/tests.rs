//! Golden tests: the iptables-restore input must be byte-identical to upstream's.

use super::{
    Capabilities, ChainStatus, ChainVariant, ChainVerdict,
    command::{jump_rule, parse_version},
    evaluate::{Packet, evaluate},
    render, set_members,
};
use crate::{
    config::Config,
    policy::{Action, IpFamilies, IpFamily, MasqueradeOptions, Policy},
    ports::PortRanges,
};

const RET: &str =
    r#"-m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE""#;
const MASQ: &str = r#"-m comment --comment "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in chain)""#;

fn opts(random_fully: bool, to_ports: Option<&str>) -> MasqueradeOptions {
    MasqueradeOptions {
        chain: "IP-MASQ-AGENT".into(),
        random_fully,
        to_ports: to_ports.map(|p| PortRanges::parse_flag(p).unwrap()),
    }
}

fn policy(cidrs: &[&str], masq_ll: bool, masq_ll6: bool) -> Policy {
    let config = Config {
        non_masquerade_cidrs: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
        masquerade_cidrs: vec![],
        non_masquerade_src_cidrs: vec![],
        masquerade_src_cidrs: vec![],
        masquerade_address: None,
        masquerade_address_ipv6: None,
        cidr_limit: 64,
        masq_link_local: masq_ll,
        masq_link_local_ipv6: masq_ll6,
        resync_interval: std::time::Duration::from_secs(60),
        enable_ipv6: None,
    };
    Policy::from_config(&config, IpFamilies::DUAL_STACK)
}

const MODERN: Capabilities = Capabilities { random_fully: true };

fn full(family: IpFamily, policy: &Policy, random_fully: bool) -> String {
    render(
        family,
        policy,
        &opts(random_fully, None),
        MODERN,
        &ChainVariant::Full,
        None,
    )
    .unwrap()
}

/// Builds the expected text by hand from upstream's rule shapes.
fn expected(exempt: &[&str], random_fully: bool) -> String {
    let mut s = String::from("*nat\n:IP-MASQ-AGENT - [0:0]\n");
    for cidr in exempt {
        s += &format!("-A IP-MASQ-AGENT {RET} -d {cidr} -j RETURN\n");
    }
    let rf = if random_fully { " --random-fully" } else { "" };
    s += &format!("-A IP-MASQ-AGENT {MASQ} -j MASQUERADE{rf}\nCOMMIT\n");
    s
}

const DEFAULTS: [&str; 3] = ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"];
const RESERVED: [&str; 11] = [
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "192.0.0.0/24",
    "192.0.2.0/24",
    "192.88.99.0/24",
    "198.18.0.0/15",
    "198.51.100.0/24",
    "203.0.113.0/24",
    "240.0.0.0/4",
];

#[test]
fn default_config_matches_the_documented_text_exactly() {
    let text = full(IpFamily::Ipv4, &policy(&DEFAULTS, false, false), true);
    assert_eq!(
        text,
        r#"*nat
:IP-MASQ-AGENT - [0:0]
-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" -d 169.254.0.0/16 -j RETURN
-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" -d 10.0.0.0/8 -j RETURN
-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" -d 172.16.0.0/12 -j RETURN
-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" -d 192.168.0.0/16 -j RETURN
-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in chain)" -j MASQUERADE --random-fully
COMMIT
"#
    );
}

#[test]
fn configs_crossed_with_random_fully() {
    for rf in [true, false] {
        let cases: Vec<(&str, Policy, Vec<&str>, Vec<&str>)> = vec![
            (
                "default",
                policy(&DEFAULTS, false, false),
                [&["169.254.0.0/16"][..], &DEFAULTS].concat(),
                vec!["fe80::/10"],
            ),
            (
                "empty",
                policy(&[], false, false),
                vec!["169.254.0.0/16"],
                vec!["fe80::/10"],
            ),
            (
                "11 reserved ranges",
                policy(&RESERVED, false, false),
                [&["169.254.0.0/16"][..], &RESERVED].concat(),
                vec!["fe80::/10"],
            ),
            (
                "mixed v4/v6",
                policy(
                    &["10.244.0.0/16", "fc00::/7", "10.0.0.0/8", "2001:db8::/32"],
                    false,
                    false,
                ),
                vec!["169.254.0.0/16", "10.244.0.0/16", "10.0.0.0/8"],
                vec!["fe80::/10", "fc00::/7", "2001:db8::/32"],
            ),
            (
                "masqLinkLocal",
                policy(&["10.0.0.0/8", "fc00::/7"], true, false),
                vec!["10.0.0.0/8"],
                vec!["fe80::/10", "fc00::/7"],
            ),
            (
                "masqLinkLocalIPv6",
                policy(&["10.0.0.0/8", "fc00::/7"], false, true),
                vec!["169.254.0.0/16", "10.0.0.0/8"],
                vec!["fc00::/7"],
            ),
        ];
        for (name, policy, v4, v6) in cases {
            assert_eq!(
                full(IpFamily::Ipv4, &policy, rf),
                expected(&v4, rf),
                "{name} v4 rf={rf}"
            );
            assert_eq!(
                full(IpFamily::Ipv6, &policy, rf),
                expected(&v6, rf),
                "{name} v6 rf={rf}"
            );
        }
    }
}

#[test]
fn old_iptables_gets_no_random_fully() {
    let old = Capabilities {
        random_fully: false,
    };
    let p = policy(&DEFAULTS, false, false);
    let text = render(
        IpFamily::Ipv4,
        &p,
        &opts(true, None),
        old,
        &ChainVariant::Full,
        None,
    )
    .unwrap();
    assert_eq!(
        text,
        expected(&[&["169.254.0.0/16"][..], &DEFAULTS].concat(), false)
    );
}

#[test]
fn ipv6_disabled_renders_nothing_for_ipv6() {
    let config = Config {
        non_masquerade_cidrs: vec![],
        masquerade_cidrs: vec![],
        non_masquerade_src_cidrs: vec![],
        masquerade_src_cidrs: vec![],
        masquerade_address: None,
        masquerade_address_ipv6: None,
        cidr_limit: 64,
        masq_link_local: false,
        masq_link_local_ipv6: false,
        resync_interval: std::time::Duration::from_secs(60),
        enable_ipv6: None,
    };
    let p = Policy::from_config(&config, IpFamilies::IPV4);
    assert!(
        render(
            IpFamily::Ipv6,
            &p,
            &opts(true, None),
            MODERN,
            &ChainVariant::Full,
            None
        )
        .is_none()
    );
}

#[test]
fn chain_name_follows_the_flag() {
    let mut o = opts(false, None);
    o.chain = "CUSTOM".into();
    let text = render(
        IpFamily::Ipv4,
        &policy(&[], true, true),
        &o,
        MODERN,
        &ChainVariant::Full,
        None,
    )
    .unwrap();
    assert_eq!(
        text,
        format!("*nat\n:CUSTOM - [0:0]\n-A CUSTOM {MASQ} -j MASQUERADE\nCOMMIT\n")
    );
    let jump = jump_rule("CUSTOM");
    assert!(jump[3].ends_with("to our custom CUSTOM chain"), "{jump:?}");
    assert_eq!(jump.last().unwrap(), "CUSTOM");
}

/// The MASQUERADE lines that `--to-ports` adds, in order, without the chain prefix.
fn port_rules(to_ports: &str, random_fully: bool) -> Vec<String> {
    port_rules_to(to_ports, random_fully, None)
}

/// The masquerade lines with `--to-ports`, to `to_source` where a chosen address is in force.
fn port_rules_to(
    to_ports: &str,
    random_fully: bool,
    to_source: Option<std::net::IpAddr>,
) -> Vec<String> {
    let text = render(
        IpFamily::Ipv4,
        &policy(&[], true, true),
        &opts(random_fully, Some(to_ports)),
        MODERN,
        &ChainVariant::Full,
        to_source,
    )
    .unwrap();
    let prefix = format!("-A IP-MASQ-AGENT {MASQ} ");
    text.lines()
        .filter_map(|l| l.strip_prefix(&prefix).map(String::from))
        .collect()
}

#[test]
fn to_ports_single_range() {
    let mut want = Vec::new();
    for proto in ["tcp", "udp", "sctp"] {
        want.push(format!(
            "-j MASQUERADE --random-fully -p {proto} --to-ports 1024-29999"
        ));
    }
    want.push("-j MASQUERADE --random-fully".to_string());
    assert_eq!(port_rules("1024-29999", true), want);
}

#[test]
fn to_ports_two_ranges() {
    let mut want = Vec::new();
    for proto in ["tcp", "udp", "sctp"] {
        want.push(format!("-j MASQUERADE --random-fully -p {proto} -m statistic --mode random --probability 0.469292562840114 --to-ports 1024-29999"));
        want.push(format!(
            "-j MASQUERADE --random-fully -p {proto} --to-ports 32768-65535"
        ));
    }
    want.push("-j MASQUERADE --random-fully".to_string());
    assert_eq!(port_rules("1024-29999,32768-65535", true), want);
}

#[test]
fn to_ports_three_ranges() {
    // 28976, 16384 and 4536 ports: 28976/49896 first, then 16384/20920 of the rest.
    let mut want = Vec::new();
    for proto in ["tcp", "udp", "sctp"] {
        want.push(format!("-j MASQUERADE -p {proto} -m statistic --mode random --probability 0.5807279140612474 --to-ports 1024-29999"));
        want.push(format!("-j MASQUERADE -p {proto} -m statistic --mode random --probability 0.7831739961759082 --to-ports 32768-49151"));
        want.push(format!("-j MASQUERADE -p {proto} --to-ports 61000-65535"));
    }
    want.push("-j MASQUERADE".to_string());
    assert_eq!(
        port_rules("1024-29999,32768-49151,61000-65535", false),
        want
    );
}

#[test]
fn to_ports_single_ports() {
    let mut want = Vec::new();
    for proto in ["tcp", "udp", "sctp"] {
        want.push(format!("-j MASQUERADE --random-fully -p {proto} -m statistic --mode random --probability 0.5 --to-ports 1024"));
        want.push(format!(
            "-j MASQUERADE --random-fully -p {proto} --to-ports 65535"
        ));
    }
    want.push("-j MASQUERADE --random-fully".to_string());
    assert_eq!(port_rules("1024,65535", true), want);
}

const EBPF: &str = r#"-m comment --comment "ip-masq-agent: translated by the eBPF data plane""#;

fn beside_programs(family: IpFamily, policy: &Policy, devices: &[&str]) -> String {
    let devices = devices.iter().map(|d| d.to_string()).collect();
    render(
        family,
        policy,
        &opts(true, None),
        MODERN,
        &ChainVariant::beside_programs(devices),
        None,
    )
    .unwrap()
}

#[test]
fn ebpf_variant_returns_translated_protocols_by_the_devices_with_programs_first() {
    let p = policy(&["10.0.0.0/8", "fc00::/7"], false, false);
    assert_eq!(
        beside_programs(IpFamily::Ipv4, &p, &["eth0", "up1"]),
        format!(
            "*nat\n:IP-MASQ-AGENT - [0:0]\n\
             -A IP-MASQ-AGENT {EBPF} -o eth0 -p tcp -j RETURN\n\
             -A IP-MASQ-AGENT {EBPF} -o eth0 -p udp -j RETURN\n\
             -A IP-MASQ-AGENT {EBPF} -o eth0 -p icmp -j RETURN\n\
             -A IP-MASQ-AGENT {EBPF} -o up1 -p tcp -j RETURN\n\
             -A IP-MASQ-AGENT {EBPF} -o up1 -p udp -j RETURN\n\
             -A IP-MASQ-AGENT {EBPF} -o up1 -p icmp -j RETURN\n\
             -A IP-MASQ-AGENT {RET} -m set --match-set IP-MASQ-AGENT-v4 dst -j RETURN\n\
             -A IP-MASQ-AGENT {MASQ} -j MASQUERADE --random-fully\n\
             COMMIT\n"
        )
    );
    assert_eq!(
        beside_programs(IpFamily::Ipv6, &p, &["eth0"]),
        format!(
            "*nat\n:IP-MASQ-AGENT - [0:0]\n\
             -A IP-MASQ-AGENT {EBPF} -o eth0 -p tcp -j RETURN\n\
             -A IP-MASQ-AGENT {EBPF} -o eth0 -p udp -j RETURN\n\
             -A IP-MASQ-AGENT {EBPF} -o eth0 -p ipv6-icmp -j RETURN\n\
             -A IP-MASQ-AGENT {RET} -m set --match-set IP-MASQ-AGENT-v6 dst -j RETURN\n\
             -A IP-MASQ-AGENT {MASQ} -j MASQUERADE --random-fully\n\
             COMMIT\n"
        )
    );
    assert_eq!(members(&p, IpFamily::Ipv6), ["fc00::/7", "fe80::/10"]);
}

#[test]
fn ebpf_variant_keeps_the_masquerade_rules_of_to_ports() {
    let p = policy(&DEFAULTS, false, false);
    let o = opts(true, Some("1024-29999"));
    let variant = ChainVariant::beside_programs(vec!["eth0".into()]);
    let reduced = render(IpFamily::Ipv4, &p, &o, MODERN, &variant, None).unwrap();
    let full = render(IpFamily::Ipv4, &p, &o, MODERN, &ChainVariant::Full, None).unwrap();
    let masquerades = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| l.contains("-j MASQUERADE"))
            .map(String::from)
            .collect()
    };
    assert_eq!(masquerades(&reduced), masquerades(&full));
    assert_eq!(masquerades(&reduced).len(), 4);
}

#[test]
fn without_a_device_carrying_programs_the_chain_is_upstream_s_byte_for_byte() {
    let p = policy(&DEFAULTS, false, false);
    for family in [IpFamily::Ipv4, IpFamily::Ipv6] {
        assert_eq!(
            ChainVariant::beside_programs(Vec::new()),
            ChainVariant::Full
        );
        assert_eq!(beside_programs(family, &p, &[]), full(family, &p, true));
    }
    assert_eq!(
        full(IpFamily::Ipv4, &p, true),
        expected(&[&["169.254.0.0/16"][..], &DEFAULTS].concat(), true),
        "the iptables data plane's chain is upstream's"
    );
}

/// `iptables -S` of the chain beside programs on eth0 and up1.
const LISTED: &str = r#"-N IP-MASQ-AGENT
-A IP-MASQ-AGENT -o eth0 -p tcp -m comment --comment "ip-masq-agent: translated by the eBPF data plane" -j RETURN
-A IP-MASQ-AGENT -o eth0 -p udp -m comment --comment "ip-masq-agent: translated by the eBPF data plane" -j RETURN
-A IP-MASQ-AGENT -o eth0 -p icmp -m comment --comment "ip-masq-agent: translated by the eBPF data plane" -j RETURN
-A IP-MASQ-AGENT -o up1 -p tcp -m comment --comment "ip-masq-agent: translated by the eBPF data plane" -j RETURN
-A IP-MASQ-AGENT -o up1 -p udp -m comment --comment "ip-masq-agent: translated by the eBPF data plane" -j RETURN
-A IP-MASQ-AGENT -o up1 -p icmp -m comment --comment "ip-masq-agent: translated by the eBPF data plane" -j RETURN
-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" -m set --match-set IP-MASQ-AGENT-v4 dst -j RETURN
-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in chain)" -j MASQUERADE --random-fully
"#;

fn read_listing(listing: &str) -> ChainStatus {
    let members = |set: &str| -> anyhow::Result<Vec<String>> {
        assert_eq!(set, "IP-MASQ-AGENT-v4");
        Ok(vec!["10.0.0.0/8".into()])
    };
    ChainStatus::read(IpFamily::Ipv4, "IP-MASQ-AGENT", Some(listing), members).unwrap()
}

#[test]
fn the_devices_returned_to_the_programs_are_read_back_from_the_chain() {
    let status = read_listing(LISTED);
    let protocols: Vec<String> = status
        .ebpf_protocols_returned
        .iter()
        .map(|p| p.to_string())
        .collect();
    assert_eq!(protocols, ["tcp", "udp", "icmp"]);
    assert_eq!(status.ebpf_devices_returned, ["eth0", "up1"]);
    assert_eq!(status.non_masquerade, nets(&["10.0.0.0/8"]));
    assert_eq!(status.masquerade_rules, 1);
    assert!(status.returns_to_programs("eth0") && status.returns_to_programs("up1"));
    assert!(!status.returns_to_programs("up10") && !status.returns_to_programs("eth"));
}

#[test]
fn a_chain_without_device_rules_returns_every_device() {
    let old = LISTED.replace(" -o eth0", "").replace(" -o up1", "");
    let status = read_listing(&old);
    assert_eq!(status.ebpf_devices_returned, ["+"]);
    assert!(status.returns_to_programs("eth0") && status.returns_to_programs("anything"));
    let wildcard = LISTED.replace(" -o up1", " -o up+");
    let status = read_listing(&wildcard);
    assert!(status.returns_to_programs("up1") && status.returns_to_programs("up7"));
    assert!(!status.returns_to_programs("eth1"));
}

#[test]
fn upstream_s_chain_returns_no_device() {
    let text = full(IpFamily::Ipv4, &policy(&DEFAULTS, false, false), true);
    let listed: String = text
        .lines()
        .filter(|l| l.starts_with("-A"))
        .map(|l| format!("{l}\n"))
        .collect();
    let status = read_listing(&listed);
    assert!(status.ebpf_devices_returned.is_empty());
    assert!(!status.returns_to_programs("eth0"));
    assert_eq!(status.non_masquerade.len(), 4);
}

#[test]
fn version_parsing() {
    assert_eq!(
        parse_version("iptables v1.8.9 (nf_tables)\n"),
        Some((1, 8, 9))
    );
    assert_eq!(parse_version("iptables v1.6.1"), Some((1, 6, 1)));
    assert_eq!(parse_version("iptables v1.8"), Some((1, 8, 0)));
    assert_eq!(parse_version("garbage"), None);
}

// ---- masqueradeCIDRs: the first rule a destination matches is its longest prefix ----------

const EXCEPTION: &str = r#"-m comment --comment "ip-masq-agent: traffic to a masqueradeCIDRs entry is subject to MASQUERADE""#;

fn with_exceptions(cidrs: &[&str], exceptions: &[&str]) -> Policy {
    let config = Config {
        non_masquerade_cidrs: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
        masquerade_cidrs: exceptions.iter().map(|c| c.parse().unwrap()).collect(),
        non_masquerade_src_cidrs: vec![],
        masquerade_src_cidrs: vec![],
        masquerade_address: None,
        masquerade_address_ipv6: None,
        cidr_limit: 64,
        masq_link_local: false,
        masq_link_local_ipv6: false,
        resync_interval: std::time::Duration::from_secs(60),
        enable_ipv6: None,
    };
    Policy::from_config(&config, IpFamilies::DUAL_STACK)
}

#[test]
fn exceptions_put_the_rules_in_longest_prefix_order() {
    let p = with_exceptions(
        &["10.0.0.0/8", "10.100.0.0/16", "0.0.0.0/0"],
        &["10.100.10.0/24", "169.254.169.254/32"],
    );
    assert_eq!(
        full(IpFamily::Ipv4, &p, true),
        format!(
            "*nat\n:IP-MASQ-AGENT - [0:0]\n\
             -A IP-MASQ-AGENT {EXCEPTION} -d 169.254.169.254/32 -j MASQUERADE --random-fully\n\
             -A IP-MASQ-AGENT {EXCEPTION} -d 10.100.10.0/24 -j MASQUERADE --random-fully\n\
             -A IP-MASQ-AGENT {RET} -d 169.254.0.0/16 -j RETURN\n\
             -A IP-MASQ-AGENT {RET} -d 10.100.0.0/16 -j RETURN\n\
             -A IP-MASQ-AGENT {RET} -d 10.0.0.0/8 -j RETURN\n\
             -A IP-MASQ-AGENT {RET} -d 0.0.0.0/0 -j RETURN\n\
             -A IP-MASQ-AGENT {MASQ} -j MASQUERADE --random-fully\n\
             COMMIT\n"
        )
    );
    // Exceptions of one family leave the other's chain as upstream's.
    let v6 = full(IpFamily::Ipv6, &p, true);
    assert_eq!(v6, full(IpFamily::Ipv6, &policy(&[], false, false), true));
}

#[test]
fn an_exception_masquerades_as_the_last_rule_does_ports_and_all() {
    let p = with_exceptions(&["10.0.0.0/8"], &["10.100.10.0/24"]);
    let text = render(
        IpFamily::Ipv4,
        &p,
        &opts(false, Some("1024-29999")),
        MODERN,
        &ChainVariant::Full,
        None,
    )
    .unwrap();
    let masquerades = |comment: &str, dst: &str| -> Vec<String> {
        let prefix = format!("-A IP-MASQ-AGENT {comment}{dst} ");
        text.lines()
            .filter_map(|l| l.strip_prefix(&prefix).map(String::from))
            .collect()
    };
    let exception = masquerades(EXCEPTION, " -d 10.100.10.0/24");
    assert_eq!(exception.len(), 4, "{text}");
    assert_eq!(exception, masquerades(MASQ, ""));
}

/// The members of `p`'s set for `family`, as `ipset` writes them.
fn members(p: &Policy, family: IpFamily) -> Vec<String> {
    let members = set_members(&p.rules(family).unwrap());
    members.iter().map(ToString::to_string).collect()
}

#[test]
fn the_set_beside_the_programs_gives_the_longest_prefix_too() {
    let p = with_exceptions(
        &["10.0.0.0/8", "0.0.0.0/0", "::/0"],
        &["10.100.10.0/24", "fd00:1::/64"],
    );
    assert_eq!(
        members(&p, IpFamily::Ipv4),
        [
            "0.0.0.0/1",
            "10.0.0.0/8",
            "10.100.10.0/24 nomatch",
            "128.0.0.0/1",
            "169.254.0.0/16",
        ]
    );
    // A /1 entry is longer than the /0 its half stands for: its action holds, whichever list
    // each is in, and the set holds each net once.
    let one_half = with_exceptions(&["0.0.0.0/1"], &["0.0.0.0/0"]);
    assert_eq!(
        members(&one_half, IpFamily::Ipv4),
        ["0.0.0.0/1", "128.0.0.0/1 nomatch", "169.254.0.0/16"]
    );
    let other_half = with_exceptions(&["0.0.0.0/0"], &["0.0.0.0/1"]);
    assert_eq!(
        members(&other_half, IpFamily::Ipv4),
        ["0.0.0.0/1 nomatch", "128.0.0.0/1", "169.254.0.0/16"]
    );
    assert_eq!(
        members(&p, IpFamily::Ipv6),
        ["::/1", "8000::/1", "fd00:1::/64 nomatch", "fe80::/10"]
    );
    // The chain beside the programs is the same one rule on the set.
    assert_eq!(
        beside_programs(IpFamily::Ipv4, &p, &["eth0"]),
        beside_programs(IpFamily::Ipv4, &policy(&DEFAULTS, false, false), &["eth0"])
    );
}

#[test]
fn of_the_entries_for_one_prefix_the_set_keeps_the_one_that_decides() {
    let net = |s: &str| s.parse::<ipnet::IpNet>().unwrap();
    // A later entry over an earlier one; of two /0s, the first one's halves.
    let rules = vec![
        (net("0.0.0.0/0"), Action::NonMasquerade),
        (net("10.0.0.0/8"), Action::NonMasquerade),
        (net("0.0.0.0/0"), Action::Masquerade),
        (net("10.0.0.0/8"), Action::Masquerade),
    ];
    let members: Vec<String> = set_members(&rules)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(members, ["0.0.0.0/1", "10.0.0.0/8 nomatch", "128.0.0.0/1"]);
    // A rule for a /0's half, earlier or later, over the half.
    let rules = vec![
        (net("128.0.0.0/1"), Action::Masquerade),
        (net("0.0.0.0/0"), Action::NonMasquerade),
        (net("0.0.0.0/1"), Action::Masquerade),
    ];
    let members: Vec<String> = set_members(&rules)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(members, ["0.0.0.0/1 nomatch", "128.0.0.0/1 nomatch"]);
}

#[test]
fn exceptions_are_read_back_from_the_chain_and_the_set() {
    let p = with_exceptions(&["10.0.0.0/8"], &["10.100.10.0/24"]);
    let listed: String = full(IpFamily::Ipv4, &p, true)
        .lines()
        .filter(|l| l.starts_with("-A"))
        .map(|l| format!("{l}\n"))
        .collect();
    let status = read_listing(&listed);
    assert_eq!(status.masquerade_exceptions, nets(&["10.100.10.0/24"]));
    assert_eq!(
        status.non_masquerade,
        nets(&["169.254.0.0/16", "10.0.0.0/8"])
    );
    let members = |_: &str| -> anyhow::Result<Vec<String>> {
        Ok(vec!["10.0.0.0/8".into(), "10.100.10.0/24 nomatch".into()])
    };
    let status = ChainStatus::read(IpFamily::Ipv4, "IP-MASQ-AGENT", Some(LISTED), members).unwrap();
    assert_eq!(status.non_masquerade, nets(&["10.0.0.0/8"]));
    assert_eq!(status.masquerade_exceptions, nets(&["10.100.10.0/24"]));
}

// ---- asking the chain what it does with a packet ------------------------------------------

fn verdict(text: &str, dst: &str, protocol: u8, device: &str, set_holds: bool) -> ChainVerdict {
    let packet = Packet {
        src: None,
        dst: dst.parse().unwrap(),
        protocol,
        device,
        src_on_device: false,
    };
    evaluate(text, &packet, |set, addr| {
        assert_eq!(set, "IP-MASQ-AGENT-v4");
        assert_eq!(addr, packet.dst);
        Ok(set_holds)
    })
    .unwrap()
}

/// A TCP packet to the outside host leaving by eth0, from `src` (`None`: not known).
fn tcp_to_outside(src: Option<&str>) -> Packet<'static> {
    Packet {
        src: src.map(|s| s.parse().unwrap()),
        dst: "203.0.113.9".parse().unwrap(),
        protocol: 6,
        device: "eth0",
        src_on_device: false,
    }
}

#[test]
fn the_chain_is_asked_rule_by_rule_as_the_kernel_would() {
    let p = with_exceptions(&["10.0.0.0/8"], &["10.100.10.0/24"]);
    let full = full(IpFamily::Ipv4, &p, true);
    use ChainVerdict::*;
    assert_eq!(verdict(&full, "10.100.10.7", 6, "eth0", false), Masquerades);
    assert_eq!(verdict(&full, "10.1.2.3", 17, "eth0", false), KeepsAddress);
    assert_eq!(
        verdict(&full, "169.254.1.1", 6, "eth0", false),
        KeepsAddress
    );
    assert_eq!(
        verdict(&full, "203.0.113.9", 47, "eth0", false),
        Masquerades
    );

    let beside = beside_programs(IpFamily::Ipv4, &p, &["eth0", "up+"]);
    assert_eq!(
        verdict(&beside, "203.0.113.9", 6, "eth0", false),
        LeftToPrograms
    );
    assert_eq!(
        verdict(&beside, "203.0.113.9", 1, "up7", false),
        LeftToPrograms
    );
    assert_eq!(
        verdict(&beside, "203.0.113.9", 6, "eth1", false),
        Masquerades
    );
    assert_eq!(verdict(&beside, "10.1.2.3", 6, "eth1", true), KeepsAddress);
    assert_eq!(verdict(&beside, "10.1.2.3", 47, "eth0", true), KeepsAddress);
    assert_eq!(
        verdict(&beside, "10.100.10.7", 47, "eth0", false),
        Masquerades
    );
}

#[test]
fn a_rule_the_reading_cannot_follow_is_an_error_not_a_guess() {
    let packet = tcp_to_outside(None);
    for rule in [
        "-A IP-MASQ-AGENT ! -d 10.0.0.0/8 -j MASQUERADE",
        "-A IP-MASQ-AGENT -s 10.244.0.0/16 -j RETURN",
        "-A IP-MASQ-AGENT -m mark --mark 0x4000 -j RETURN",
    ] {
        let err = evaluate(rule, &packet, |_, _| Ok(false)).unwrap_err();
        assert!(err.to_string().contains("cannot follow"), "{rule}: {err}");
    }
}

/// Prefixes as the chain's status holds them.
fn nets(written: &[&str]) -> Vec<ipnet::IpNet> {
    written.iter().map(|net| net.parse().unwrap()).collect()
}

// ---- sources left alone ---------------------------------------------------------------------

const SRC_RET: &str = r#"-m comment --comment "ip-masq-agent: traffic from a nonMasqueradeSrcCIDRs source is not subject to MASQUERADE""#;

/// The default policy, with every IPv4 source left alone but the pods' own.
fn pods_only() -> Policy {
    let mut p = policy(&["10.0.0.0/8"], false, false);
    p.non_masq_src_v4 = vec!["0.0.0.0/0".parse().unwrap()];
    p.masq_src_v4 = vec!["10.244.0.0/16".parse().unwrap()];
    p
}

#[test]
fn sources_left_alone_return_first_and_the_rest_is_upstream_s_chain() {
    let with_sources = full(IpFamily::Ipv4, &pods_only(), true);
    let mut lines: Vec<&str> = with_sources.lines().collect();
    let source_rule =
        format!("-A IP-MASQ-AGENT {SRC_RET} -m set --match-set IP-MASQ-AGENT-s4 src -j RETURN");
    assert_eq!(lines.remove(2), source_rule);
    let upstream = full(IpFamily::Ipv4, &policy(&["10.0.0.0/8"], false, false), true);
    assert_eq!(lines.join("\n") + "\n", upstream);
    // No source entry for IPv6: its chain is upstream's.
    let v6 = full(IpFamily::Ipv6, &pods_only(), true);
    assert!(!v6.contains("--match-set"), "{v6}");
}

#[test]
fn the_source_set_gives_the_longest_prefix_its_say() {
    let members: Vec<String> = set_members(&pods_only().source_rules(IpFamily::Ipv4))
        .iter()
        .map(ToString::to_string)
        .collect();
    // The /0 as its two halves, and the pods' prefix as the exception it is.
    assert_eq!(
        members,
        ["0.0.0.0/1", "10.244.0.0/16 nomatch", "128.0.0.0/1"]
    );
}

#[test]
fn the_chain_asks_the_source_set_about_the_source() {
    let text = full(IpFamily::Ipv4, &pods_only(), true);
    let ask = |src: Option<&str>, in_source_set: bool| {
        let packet = tcp_to_outside(src);
        evaluate(&text, &packet, |set, addr| {
            assert_eq!(set, "IP-MASQ-AGENT-s4");
            assert_eq!(Some(addr), packet.src);
            Ok(in_source_set)
        })
        .unwrap()
    };
    assert_eq!(ask(Some("192.168.7.7"), true), ChainVerdict::KeepsAddress);
    assert_eq!(ask(Some("10.244.1.2"), false), ChainVerdict::Masquerades);
    assert_eq!(
        ask(None, true),
        ChainVerdict::Masquerades,
        "no source, no source entry"
    );
}

#[test]
fn the_source_lists_are_read_back_from_their_set() {
    let listing = format!(
        "-N IP-MASQ-AGENT\n-A IP-MASQ-AGENT {SRC_RET} -m set --match-set IP-MASQ-AGENT-s4 src -j RETURN\n\
         -A IP-MASQ-AGENT {RET} -d 10.0.0.0/8 -j RETURN\n-A IP-MASQ-AGENT {MASQ} -j MASQUERADE\n"
    );
    let members = |set: &str| {
        assert_eq!(set, "IP-MASQ-AGENT-s4");
        Ok(vec![
            "0.0.0.0/1".into(),
            "10.244.0.0/16 nomatch".into(),
            "128.0.0.0/1".into(),
        ])
    };
    let status =
        ChainStatus::read(IpFamily::Ipv4, "IP-MASQ-AGENT", Some(&listing), members).unwrap();
    assert_eq!(status.non_masquerade, nets(&["10.0.0.0/8"]));
    assert_eq!(
        status.non_masquerade_src,
        nets(&["0.0.0.0/1", "128.0.0.0/1"])
    );
    assert_eq!(status.masquerade_src_exceptions, nets(&["10.244.0.0/16"]));
    assert!(
        status
            .to_string()
            .contains("from a source not masqueraded: 0.0.0.0/1")
    );
}

// ---- a chosen masquerade address --------------------------------------------------------

#[test]
fn a_chosen_address_held_by_the_node_is_snat_to_it_keeping_random_fully_and_ports() {
    let p = policy(&["10.0.0.0/8"], false, false);
    let chosen: std::net::IpAddr = "198.51.100.7".parse().unwrap();
    let text = |to_ports: Option<&str>| {
        render(
            IpFamily::Ipv4,
            &p,
            &opts(true, to_ports),
            MODERN,
            &ChainVariant::Full,
            Some(chosen),
        )
        .unwrap()
    };
    let plain = text(None);
    assert!(
        plain.contains(&format!(
            "-A IP-MASQ-AGENT {MASQ} -j SNAT --to-source 198.51.100.7 --random-fully\n"
        )),
        "{plain}"
    );
    assert!(!plain.contains("MASQUERADE --"), "{plain}");
    // SNAT takes its ports only from a rule whose protocol comes before the target.
    let statistic = "-m statistic --mode random --probability 0.469292562840114";
    let to = "-j SNAT --to-source 198.51.100.7";
    assert_eq!(
        port_rules_to("1024-29999,32768-65535", true, Some(chosen)),
        [
            format!("-p tcp {statistic} {to}:1024-29999 --random-fully"),
            format!("-p tcp {to}:32768-65535 --random-fully"),
            format!("-p udp {statistic} {to}:1024-29999 --random-fully"),
            format!("-p udp {to}:32768-65535 --random-fully"),
            format!("-p sctp {statistic} {to}:1024-29999 --random-fully"),
            format!("-p sctp {to}:32768-65535 --random-fully"),
            format!("{to} --random-fully"),
        ]
    );
    // What the chain does with it, and what is read back of it.
    let packet = tcp_to_outside(None);
    let listed = plain.replace("*nat\n", "").replace("COMMIT\n", "");
    assert_eq!(
        evaluate(&listed, &packet, |_, _| Ok(false)).unwrap(),
        ChainVerdict::Masquerades
    );
    let status = ChainStatus::read(IpFamily::Ipv4, "IP-MASQ-AGENT", Some(&listed), |_| {
        Ok(Vec::new())
    })
    .unwrap();
    assert_eq!(status.masquerade_rules, 1);
}

/// `iptables -S` of a chain that SNATs to a chosen address with `--to-ports` of two ranges (TCP
/// alone shown), as iptables lists it: the protocol first, the options of SNAT last.
const LISTED_SNAT: &str = r#"-N IP-MASQ-AGENT
-A IP-MASQ-AGENT -d 10.0.0.0/8 -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" -j RETURN
-A IP-MASQ-AGENT -p tcp -m comment --comment "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in chain)" -m statistic --mode random --probability 0.46929256284 -j SNAT --to-source 198.51.100.7:1024-29999 --random-fully
-A IP-MASQ-AGENT -p tcp -m comment --comment "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in chain)" -j SNAT --to-source 198.51.100.7:32768-65535 --random-fully
-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in chain)" -j SNAT --to-source 198.51.100.7 --random-fully
"#;

#[test]
fn a_chain_snat_to_a_chosen_address_with_ports_is_read_back_and_followed() {
    let status = ChainStatus::read(IpFamily::Ipv4, "IP-MASQ-AGENT", Some(LISTED_SNAT), |_| {
        Ok(Vec::new())
    })
    .unwrap();
    assert_eq!(status.masquerade_rules, 3);
    assert_eq!(status.snat_to, Some("198.51.100.7".parse().unwrap()));
    assert_eq!(status.non_masquerade, nets(&["10.0.0.0/8"]));
    assert!(status.ebpf_protocols_returned.is_empty(), "{status:?}");
    use ChainVerdict::*;
    for protocol in [6, 17, 47] {
        assert_eq!(
            verdict(LISTED_SNAT, "203.0.113.9", protocol, "eth0", false),
            Masquerades
        );
    }
    assert_eq!(
        verdict(LISTED_SNAT, "10.1.2.3", 6, "eth0", false),
        KeepsAddress
    );
}

/// What the chain beside the programs and the full chain hold before any masquerade rule, with
/// a chosen address: the node's own traffic from the device's address returns.
#[test]
fn with_a_chosen_address_the_nodes_traffic_from_the_devices_address_returns_first() {
    let p = with_exceptions(&["10.0.0.0/8"], &["10.100.10.0/24"]);
    let node_rule = r#"-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: node traffic from an address of the outgoing device is not subject to SNAT" -m addrtype --src-type LOCAL --limit-iface-out -j RETURN"#;
    for variant in [
        ChainVariant::Full,
        ChainVariant::beside_programs(vec!["eth0".into()]),
    ] {
        let text = |to_source| {
            render(
                IpFamily::Ipv4,
                &p,
                &opts(true, None),
                MODERN,
                &variant,
                to_source,
            )
            .unwrap()
        };
        let snat = text(Some("198.51.100.7".parse().unwrap()));
        let lines: Vec<&str> = snat.lines().collect();
        let node = lines.iter().position(|l| *l == node_rule);
        let first_masquerade = lines.iter().position(|l| l.contains("-j SNAT"));
        assert!(
            node.is_some() && node < first_masquerade,
            "{variant:?}:\n{snat}"
        );
        assert!(!text(None).contains("addrtype"), "{variant:?}");
    }
}

#[test]
fn the_nodes_traffic_from_the_devices_address_is_left_alone_by_the_chain() {
    // As `iptables -S` lists the full chain with a chosen address.
    let listed = format!(
        "-N IP-MASQ-AGENT\n\
         -A IP-MASQ-AGENT -m comment --comment \"ip-masq-agent: node traffic from an address of the outgoing device is not subject to SNAT\" -m addrtype --src-type LOCAL --limit-iface-out -j RETURN\n\
         -A IP-MASQ-AGENT -d 10.0.0.0/8 {RET} -j RETURN\n\
         -A IP-MASQ-AGENT {MASQ} -j SNAT --to-source 198.51.100.7 --random-fully\n"
    );
    let ask = |src: &str, src_on_device| {
        let packet = Packet {
            src_on_device,
            ..tcp_to_outside(Some(src))
        };
        evaluate(&listed, &packet, |_, _| Ok(false)).unwrap()
    };
    assert_eq!(ask("203.0.113.1", true), ChainVerdict::KeepsAddress);
    assert_eq!(ask("10.244.1.2", false), ChainVerdict::Masquerades);
    let status = ChainStatus::read(IpFamily::Ipv4, "IP-MASQ-AGENT", Some(&listed), |_| {
        Ok(Vec::new())
    })
    .unwrap();
    assert_eq!(
        (status.non_masquerade, status.masquerade_rules),
        (nets(&["10.0.0.0/8"]), 1)
    );
    // Any other use of addrtype is not the agent's, and not followed.
    let other = listed.replace("--src-type LOCAL --limit-iface-out", "--dst-type LOCAL");
    let packet = tcp_to_outside(None);
    assert!(evaluate(&other, &packet, |_, _| Ok(false)).is_err());
}

#[test]
fn snat_s_to_source_is_read_as_its_address_with_or_without_ports() {
    use super::readback::snat_address;
    let address = |text: &str| text.parse::<std::net::IpAddr>().ok();
    for (to_source, expect) in [
        ("198.51.100.7", "198.51.100.7"),
        ("198.51.100.7:1024-29999", "198.51.100.7"),
        ("2001:db8::7", "2001:db8::7"),
        ("[2001:db8::7]:1024-29999", "2001:db8::7"),
    ] {
        assert_eq!(snat_address(to_source), address(expect), "{to_source}");
    }
    assert_eq!(snat_address("not-an-address"), None);
}

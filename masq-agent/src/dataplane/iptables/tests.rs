//! Golden tests: the iptables-restore input must be byte-identical to upstream's.

use super::*;
use crate::{config::Config, ports::PortRanges};

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
        cidr_limit: 64,
        masq_link_local: masq_ll,
        masq_link_local_ipv6: masq_ll6,
        resync_interval: std::time::Duration::from_secs(60),
    };
    Policy::from_config(&config, true)
}

const MODERN: Capabilities = Capabilities { random_fully: true };

fn full(family: IpFamily, policy: &Policy, random_fully: bool) -> String {
    render(
        family,
        policy,
        &opts(random_fully, None),
        MODERN,
        ChainVariant::Full,
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
        ChainVariant::Full,
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
        cidr_limit: 64,
        masq_link_local: false,
        masq_link_local_ipv6: false,
        resync_interval: std::time::Duration::from_secs(60),
    };
    let p = Policy::from_config(&config, false);
    assert!(
        render(
            IpFamily::Ipv6,
            &p,
            &opts(true, None),
            MODERN,
            ChainVariant::Full
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
        ChainVariant::Full,
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
    let text = render(
        IpFamily::Ipv4,
        &policy(&[], true, true),
        &opts(random_fully, Some(to_ports)),
        MODERN,
        ChainVariant::Full,
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

#[test]
fn ebpf_variant_returns_translated_protocols_first_and_matches_cidrs_through_a_set() {
    let p = policy(&["10.0.0.0/8", "fc00::/7"], false, false);
    let v4 = render(
        IpFamily::Ipv4,
        &p,
        &opts(true, None),
        MODERN,
        ChainVariant::OutsideEbpf,
    )
    .unwrap();
    let ebpf = r#"-m comment --comment "ip-masq-agent: translated by the eBPF data plane""#;
    assert_eq!(
        v4,
        format!(
            "*nat\n:IP-MASQ-AGENT - [0:0]\n\
             -A IP-MASQ-AGENT {ebpf} -p tcp -j RETURN\n\
             -A IP-MASQ-AGENT {ebpf} -p udp -j RETURN\n\
             -A IP-MASQ-AGENT {ebpf} -p icmp -j RETURN\n\
             -A IP-MASQ-AGENT {RET} -m set --match-set IP-MASQ-AGENT-v4 dst -j RETURN\n\
             -A IP-MASQ-AGENT {MASQ} -j MASQUERADE --random-fully\n\
             COMMIT\n"
        )
    );
    let v6 = render(
        IpFamily::Ipv6,
        &p,
        &opts(true, None),
        MODERN,
        ChainVariant::OutsideEbpf,
    )
    .unwrap();
    assert_eq!(
        v6,
        format!(
            "*nat\n:IP-MASQ-AGENT - [0:0]\n\
             -A IP-MASQ-AGENT {ebpf} -p tcp -j RETURN\n\
             -A IP-MASQ-AGENT {ebpf} -p udp -j RETURN\n\
             -A IP-MASQ-AGENT {ebpf} -p ipv6-icmp -j RETURN\n\
             -A IP-MASQ-AGENT {RET} -m set --match-set IP-MASQ-AGENT-v6 dst -j RETURN\n\
             -A IP-MASQ-AGENT {MASQ} -j MASQUERADE --random-fully\n\
             COMMIT\n"
        )
    );
    assert_eq!(
        exempt(IpFamily::Ipv6, &p).unwrap(),
        ["fe80::/10", "fc00::/7"]
    );
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

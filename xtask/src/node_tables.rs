//! What the benchmark's node holds in netfilter besides the data plane under test: conntrack,
//! as on every node, and on a realistic node kube-proxy's nat table (iptables mode), whose
//! hooks and linear service list every new connection pays for in a cluster.

use std::net::IpAddr;

use masq_testbed::topology;

/// ClusterIP services in kube-proxy's table: a mid-sized cluster's.
pub const KUBE_PROXY_SERVICES: usize = 1_000;
/// Where the services' ClusterIPs live; the benchmark's traffic never goes there.
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
/// IPv6's, where the node holds IPv6 tables (`Family::V6`).
pub const SERVICE_CIDR_V6: &str = "fd00:96::/112";
/// kube-proxy's mark for traffic it masquerades itself.
const MASQ_MARK: &str = "0x4000";
/// kube-proxy's chain that masquerades what it marked; the first jump in nat POSTROUTING.
pub const KUBE_POSTROUTING: &str = "KUBE-POSTROUTING";

/// What a mode finds on the node before its data plane starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Node {
    /// Conntrack only: no nat table at all.
    Bare,
    /// Conntrack and kube-proxy's nat table.
    KubeProxy,
}

/// Which of the node's tables: iptables' or ip6tables'.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    /// The tables of a node that runs IPv4 alone.
    pub const IPV4: &'static [Family] = &[Family::V4];
    /// The tables of a dual-stack node.
    pub const BOTH: &'static [Family] = &[Family::V4, Family::V6];

    /// The command of this family's tables in `backend` (`nft` or `legacy`), with `suffix`
    /// (`""`, `-restore`, `-save`).
    pub fn command(self, backend: &str, suffix: &str) -> String {
        let family = match self {
            Family::V4 => "iptables",
            Family::V6 => "ip6tables",
        };
        topology::iptables_command(family, backend, suffix)
    }

    /// The pods' CIDR, which kube-proxy tells its own traffic by.
    pub fn pod_cidr(self) -> &'static str {
        match self {
            Family::V4 => topology::POD_PREFIX,
            Family::V6 => topology::POD_PREFIX_V6,
        }
    }

    /// The node's address on its uplink, which the outside host reaches it at.
    pub fn node_uplink(self) -> IpAddr {
        match self {
            Family::V4 => topology::NODE_UPLINK.into(),
            Family::V6 => topology::NODE_UPLINK_V6.into(),
        }
    }

    /// The ClusterIP of service `i`.
    fn service_ip(self, i: usize) -> String {
        match self {
            Family::V4 => format!("10.96.{}.{}", i / 250, i % 250 + 1),
            Family::V6 => format!("fd00:96::{:x}", i + 1),
        }
    }

    /// `addr` as a prefix of itself alone, as `iptables-save` prints a match of it.
    fn host(self, addr: &str) -> String {
        match self {
            Family::V4 => format!("{addr}/32"),
            Family::V6 => format!("{addr}/128"),
        }
    }

    /// An endpoint pod of service `i`, off the benchmark's pods.
    fn endpoint_ip(self, i: usize) -> String {
        match self {
            Family::V4 => format!("10.244.{}.{}", 128 + i / 250, i % 250 + 1),
            Family::V6 => format!("fd00:10:244:{:x}::{:x}", 0x100 + i / 250, i % 250 + 1),
        }
    }

    /// `endpoint`, with `port`, as DNAT's `--to-destination` takes it.
    fn with_port(self, endpoint: &str, port: u16) -> String {
        match self {
            Family::V4 => format!("{endpoint}:{port}"),
            Family::V6 => format!("[{endpoint}]:{port}"),
        }
    }
}

impl Node {
    /// The restore input (for `--noflush`) of `family`'s tables that sets the node up.
    pub fn rules(self, family: Family) -> String {
        // Conntrack runs on every real node; a rule that needs it makes sure it runs here.
        let mut rules =
            "*filter\n-A FORWARD -m conntrack --ctstate INVALID -j DROP\nCOMMIT\n".to_string();
        if self == Node::KubeProxy {
            rules += &kube_proxy_nat(KUBE_PROXY_SERVICES, family);
        }
        rules
    }

    /// What the report says the node held.
    pub fn describe(self) -> String {
        match self {
            Node::Bare => "conntrack only, no nat table".into(),
            Node::KubeProxy => format!(
                "kube-proxy's nat table: {KUBE_PROXY_SERVICES} ClusterIP services in {SERVICE_CIDR} (a linear KUBE-SERVICES list of `-d VIP -p tcp --dport` matches, jumped to from PREROUTING and OUTPUT, each to a KUBE-SVC and a KUBE-SEP chain that DNATs), KUBE-MARK-MASQ, and {KUBE_POSTROUTING} (mark check, MASQUERADE --random-fully) first in POSTROUTING; on a node that runs IPv6 too, the same in ip6tables, its services in {SERVICE_CIDR_V6}"
            ),
        }
    }
}

/// The iptables-restore input that empties the tables `Node::rules` and a data plane write:
/// iptables-nft deletes the tables, hooks and all; iptables-legacy keeps its tables, empty.
pub const EMPTY_TABLES: &str = "*nat\nCOMMIT\n*filter\nCOMMIT\n";

/// kube-proxy's nat table (iptables mode) of `family` for `services` ClusterIP services of one
/// endpoint each, as `iptables-save` prints it, rule for rule in kube-proxy's order.
fn kube_proxy_nat(services: usize, family: Family) -> String {
    let mut chains = vec![
        "KUBE-SERVICES".to_string(),
        "KUBE-NODEPORTS".into(),
        "KUBE-MARK-MASQ".into(),
        KUBE_POSTROUTING.into(),
    ];
    let mut rules = vec![
        "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES".into(),
        "-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES".into(),
        format!(
            "-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j {KUBE_POSTROUTING}"
        ),
        format!("-A KUBE-MARK-MASQ -j MARK --or-mark {MASQ_MARK}"),
        format!("-A {KUBE_POSTROUTING} -m mark ! --mark {MASQ_MARK}/{MASQ_MARK} -j RETURN"),
        format!("-A {KUBE_POSTROUTING} -j MARK --xor-mark {MASQ_MARK}"),
        format!(
            "-A {KUBE_POSTROUTING} -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully"
        ),
    ];
    for i in 0..services {
        let (vip, endpoint) = (family.service_ip(i), family.endpoint_ip(i));
        let (vip_host, endpoint_host) = (family.host(&vip), family.host(&endpoint));
        let pods = family.pod_cidr();
        let (svc, sep) = (
            format!("KUBE-SVC-BENCH{i:04}"),
            format!("KUBE-SEP-BENCH{i:04}"),
        );
        let name = format!("bench/svc-{i}:http");
        rules.extend([
            format!(
                "-A KUBE-SERVICES -d {vip_host} -p tcp -m comment --comment \"{name} cluster IP\" -m tcp --dport 80 -j {svc}"
            ),
            format!(
                "-A {svc} ! -s {pods} -d {vip_host} -p tcp -m comment --comment \"{name} cluster IP\" -m tcp --dport 80 -j KUBE-MARK-MASQ"
            ),
            format!(
                "-A {svc} -m comment --comment \"{name} -> {}\" -j {sep}",
                family.with_port(&endpoint, 8080)
            ),
            format!("-A {sep} -s {endpoint_host} -m comment --comment \"{name}\" -j KUBE-MARK-MASQ"),
            format!(
                "-A {sep} -p tcp -m comment --comment \"{name}\" -m tcp -j DNAT --to-destination {}",
                family.with_port(&endpoint, 8080)
            ),
        ]);
        chains.extend([svc, sep]);
    }
    rules.push(
        "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"
            .into(),
    );
    let mut text = "*nat\n".to_string();
    for chain in chains {
        text += &format!(":{chain} - [0:0]\n");
    }
    for rule in rules {
        text += &rule;
        text.push('\n');
    }
    text + "COMMIT\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each service's VIP in `rules`' KUBE-SERVICES, which ends with the NodePorts rule.
    fn service_vips(rules: &str) -> std::collections::BTreeSet<&str> {
        let service_rules: Vec<&str> = rules
            .lines()
            .filter(|l| l.starts_with("-A KUBE-SERVICES"))
            .collect();
        assert_eq!(service_rules.len(), KUBE_PROXY_SERVICES + 1);
        assert!(service_rules.last().unwrap().contains("KUBE-NODEPORTS"));
        let vips: std::collections::BTreeSet<&str> = service_rules
            .iter()
            .filter_map(|l| l.split_once(" -d ")?.1.split_whitespace().next())
            .collect();
        assert_eq!(vips.len(), KUBE_PROXY_SERVICES, "a VIP each");
        vips
    }

    #[test]
    fn kube_proxys_table_walks_every_service_before_the_nodeports_rule() {
        let rules = Node::KubeProxy.rules(Family::V4);
        assert!(
            service_vips(&rules)
                .iter()
                .all(|v| v.starts_with("10.96.") && v.ends_with("/32"))
        );
    }

    #[test]
    fn kube_proxys_ipv6_table_is_the_same_walk_in_ipv6_addresses() {
        let rules = Node::KubeProxy.rules(Family::V6);
        let vips = service_vips(&rules);
        let services: ipnet::Ipv6Net = SERVICE_CIDR_V6.parse().unwrap();
        assert!(vips.iter().all(|v| {
            let vip: ipnet::Ipv6Net = v.parse().unwrap();
            vip.prefix_len() == 128 && services.contains(&vip)
        }));
        let dnat: Vec<&str> = rules
            .lines()
            .filter_map(|l| l.split_once("--to-destination ").map(|(_, to)| to))
            .collect();
        assert_eq!(dnat.len(), KUBE_PROXY_SERVICES);
        let pods: ipnet::Ipv6Net = masq_testbed::topology::POD_PREFIX_V6.parse().unwrap();
        assert!(dnat.iter().all(|to| {
            let endpoint: std::net::SocketAddrV6 = to.parse().unwrap();
            pods.contains(endpoint.ip()) && endpoint.port() == 8080
        }));
        assert!(!rules.contains("10.244."), "{rules}");
    }

    #[test]
    fn kube_postrouting_is_the_first_postrouting_jump() {
        let rules = Node::KubeProxy.rules(Family::V4);
        let first = rules.lines().find(|l| l.starts_with("-A POSTROUTING"));
        assert!(first.unwrap().ends_with(&format!("-j {KUBE_POSTROUTING}")));
    }

    #[test]
    fn a_bare_node_has_no_nat_table() {
        for family in [Family::V4, Family::V6] {
            assert!(!Node::Bare.rules(family).contains("*nat"));
            assert!(Node::Bare.rules(family).contains("conntrack"));
        }
    }
}

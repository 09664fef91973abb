//! What the benchmark's node holds in netfilter besides the data plane under test: conntrack,
//! as on every node, and on a realistic node kube-proxy's nat table (iptables mode), whose
//! hooks and linear service list every new connection pays for in a cluster.

/// ClusterIP services in kube-proxy's table: a mid-sized cluster's.
pub const KUBE_PROXY_SERVICES: usize = 1_000;
/// Where the services' ClusterIPs live; the benchmark's traffic never goes there.
pub const SERVICE_CIDR: &str = "10.96.0.0/16";
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

impl Node {
    /// The iptables-restore input (for `--noflush`) that sets the node up.
    pub fn rules(self) -> String {
        // Conntrack runs on every real node; a rule that needs it makes sure it runs here.
        let mut rules =
            "*filter\n-A FORWARD -m conntrack --ctstate INVALID -j DROP\nCOMMIT\n".to_string();
        if self == Node::KubeProxy {
            rules += &kube_proxy_nat(KUBE_PROXY_SERVICES);
        }
        rules
    }

    /// What the report says the node held.
    pub fn describe(self) -> String {
        match self {
            Node::Bare => "conntrack only, no nat table".into(),
            Node::KubeProxy => format!(
                "kube-proxy's nat table: {KUBE_PROXY_SERVICES} ClusterIP services in {SERVICE_CIDR} (a linear KUBE-SERVICES list of `-d VIP -p tcp --dport` matches, jumped to from PREROUTING and OUTPUT, each to a KUBE-SVC and a KUBE-SEP chain that DNATs), KUBE-MARK-MASQ, and {KUBE_POSTROUTING} (mark check, MASQUERADE --random-fully) first in POSTROUTING"
            ),
        }
    }
}

/// The iptables-restore input that empties the tables `Node::rules` and a data plane write:
/// iptables-nft deletes the tables, hooks and all; iptables-legacy keeps its tables, empty.
pub const EMPTY_TABLES: &str = "*nat\nCOMMIT\n*filter\nCOMMIT\n";

/// The ClusterIP of service `i`.
fn service_ip(i: usize) -> String {
    format!("10.96.{}.{}", i / 250, i % 250 + 1)
}

/// An endpoint pod of service `i`, off the benchmark's pod.
fn endpoint_ip(i: usize) -> String {
    format!("10.244.{}.{}", 128 + i / 250, i % 250 + 1)
}

/// kube-proxy's nat table (iptables mode) for `services` ClusterIP services of one endpoint
/// each, as `iptables-save` prints it, rule for rule in kube-proxy's order.
fn kube_proxy_nat(services: usize) -> String {
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
        let (vip, endpoint) = (service_ip(i), endpoint_ip(i));
        let (svc, sep) = (
            format!("KUBE-SVC-BENCH{i:04}"),
            format!("KUBE-SEP-BENCH{i:04}"),
        );
        let name = format!("bench/svc-{i}:http");
        rules.extend([
            format!(
                "-A KUBE-SERVICES -d {vip}/32 -p tcp -m comment --comment \"{name} cluster IP\" -m tcp --dport 80 -j {svc}"
            ),
            format!(
                "-A {svc} ! -s 10.244.0.0/16 -d {vip}/32 -p tcp -m comment --comment \"{name} cluster IP\" -m tcp --dport 80 -j KUBE-MARK-MASQ"
            ),
            format!("-A {svc} -m comment --comment \"{name} -> {endpoint}:8080\" -j {sep}"),
            format!("-A {sep} -s {endpoint}/32 -m comment --comment \"{name}\" -j KUBE-MARK-MASQ"),
            format!(
                "-A {sep} -p tcp -m comment --comment \"{name}\" -m tcp -j DNAT --to-destination {endpoint}:8080"
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

    #[test]
    fn kube_proxys_table_walks_every_service_before_the_nodeports_rule() {
        let rules = Node::KubeProxy.rules();
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
        assert!(
            vips.iter()
                .all(|v| v.starts_with("10.96.") && v.ends_with("/32"))
        );
    }

    #[test]
    fn kube_postrouting_is_the_first_postrouting_jump() {
        let rules = Node::KubeProxy.rules();
        let first = rules.lines().find(|l| l.starts_with("-A POSTROUTING"));
        assert!(first.unwrap().ends_with(&format!("-j {KUBE_POSTROUTING}")));
    }

    #[test]
    fn a_bare_node_has_no_nat_table() {
        assert!(!Node::Bare.rules().contains("*nat"));
        assert!(Node::Bare.rules().contains("conntrack"));
    }
}

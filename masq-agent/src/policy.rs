//! The policy: what the kernel must do, derived from the config and the flags. Both data planes
//! enforce exactly this and nothing else.

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::{config::Config, ports::PortRanges};

/// Link-local destinations are never masqueraded unless the config says so.
pub const LINK_LOCAL_V4: Ipv4Net = match Ipv4Net::new(std::net::Ipv4Addr::new(169, 254, 0, 0), 16) {
    Ok(net) => net,
    Err(_) => panic!("valid prefix"),
};
pub const LINK_LOCAL_V6: Ipv6Net =
    match Ipv6Net::new(std::net::Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0), 10) {
        Ok(net) => net,
        Err(_) => panic!("valid prefix"),
    };

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum IpFamily {
    Ipv4,
    Ipv6,
}

/// Destinations that keep the pod's source address, per family, in upstream's rule order:
/// link-local first (unless masqueraded), then the configured CIDRs in file order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub non_masq_v4: Vec<Ipv4Net>,
    /// `None` when IPv6 is not enabled: the agent then leaves IPv6 alone entirely.
    pub non_masq_v6: Option<Vec<Ipv6Net>>,
}

impl Policy {
    /// Whether traffic to `addr` keeps its source address.
    pub fn exempts(&self, addr: std::net::IpAddr) -> bool {
        match addr {
            std::net::IpAddr::V4(a) => self.non_masq_v4.iter().any(|n| n.contains(&a)),
            std::net::IpAddr::V6(a) => self.non_masq_v6.iter().flatten().any(|n| n.contains(&a)),
        }
    }

    pub fn from_config(config: &Config, enable_ipv6: bool) -> Policy {
        let mut non_masq_v4 = Vec::new();
        let mut non_masq_v6 = Vec::new();
        if !config.masq_link_local {
            non_masq_v4.push(LINK_LOCAL_V4);
        }
        if !config.masq_link_local_ipv6 {
            non_masq_v6.push(LINK_LOCAL_V6);
        }
        for cidr in &config.non_masquerade_cidrs {
            match cidr {
                IpNet::V4(net) => non_masq_v4.push(*net),
                IpNet::V6(net) => non_masq_v6.push(*net),
            }
        }
        Policy {
            non_masq_v4,
            non_masq_v6: enable_ipv6.then_some(non_masq_v6),
        }
    }
}

/// How masqueraded traffic is translated; fixed for the agent's lifetime by its flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MasqueradeOptions {
    pub chain: String,
    pub random_fully: bool,
    pub to_ports: Option<PortRanges>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, ConfigOptions};

    fn config(cidrs: &[&str], masq_ll: bool, masq_ll6: bool) -> Config {
        Config {
            non_masquerade_cidrs: cidrs.iter().map(|c| c.parse().unwrap()).collect(),
            masq_link_local: masq_ll,
            masq_link_local_ipv6: masq_ll6,
            ..Config::defaults(&ConfigOptions {
                nomasq_all_reserved_ranges: false,
                enable_ipv6: true,
            })
        }
    }

    #[test]
    fn link_local_first_then_config_order_per_family() {
        let c = config(&["10.0.0.0/8", "fc00::/7", "192.168.0.0/16"], false, false);
        let p = Policy::from_config(&c, true);
        let v4: Vec<String> = p.non_masq_v4.iter().map(|n| n.to_string()).collect();
        assert_eq!(v4, ["169.254.0.0/16", "10.0.0.0/8", "192.168.0.0/16"]);
        let v6: Vec<String> = p
            .non_masq_v6
            .unwrap()
            .iter()
            .map(|n| n.to_string())
            .collect();
        assert_eq!(v6, ["fe80::/10", "fc00::/7"]);
    }

    #[test]
    fn masq_link_local_drops_the_link_local_prefix() {
        let p = Policy::from_config(&config(&["10.0.0.0/8"], true, true), true);
        assert_eq!(p.non_masq_v4, ["10.0.0.0/8".parse::<Ipv4Net>().unwrap()]);
        assert_eq!(p.non_masq_v6, Some(vec![]));
    }

    #[test]
    fn ipv6_disabled_leaves_ipv6_alone() {
        let p = Policy::from_config(&config(&["10.0.0.0/8"], false, false), false);
        assert_eq!(p.non_masq_v6, None);
    }

    #[test]
    fn duplicates_are_kept_as_upstream_does() {
        let p = Policy::from_config(&config(&["10.0.0.0/8", "10.0.0.0/8"], true, true), false);
        assert_eq!(p.non_masq_v4.len(), 2);
    }
}

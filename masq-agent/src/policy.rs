//! The policy: what the kernel must do, derived from the config and the flags. Both data planes
//! enforce exactly this and nothing else.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

pub use crate::families::{IpFamilies, IpFamily};
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

/// What happens to traffic to a destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// The pod's address is kept.
    NonMasquerade,
    Masquerade,
}

impl Action {
    /// Its one spelling: `status`, its JSON, `explain` and the metrics' `action` label.
    pub fn label(self) -> &'static str {
        match self {
            Action::NonMasquerade => "non-masquerade",
            Action::Masquerade => "masquerade",
        }
    }
}

spelled_by_label!(Action);

/// The entries that decide a family's destinations, each with its action.
pub type Rules = Vec<(IpNet, Action)>;

/// Destinations that keep the pod's source address, per family, in upstream's rule order:
/// link-local first (unless masqueraded), then the configured CIDRs in file order; and the
/// exceptions to them. Every destination is decided by the longest prefix that holds it; a
/// destination no prefix holds is masqueraded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    pub non_masq_v4: Vec<Ipv4Net>,
    /// `None` when IPv6 is not enabled: the agent then leaves IPv6 alone entirely.
    pub non_masq_v6: Option<Vec<Ipv6Net>>,
    /// Destinations masqueraded although a shorter prefix above keeps the pod's address.
    pub masq_v4: Vec<Ipv4Net>,
    /// The same for IPv6; empty when IPv6 is not enabled.
    pub masq_v6: Vec<Ipv6Net>,
    /// The file says `enableIPv6: false`: IPv6 is not merely left alone, it must not be
    /// masqueraded by what this agent installed.
    pub ipv6_switched_off: bool,
    /// Sources whose traffic keeps its address whatever the destination, and the exceptions
    /// to them, decided by the longest prefix as destinations are; a source no prefix holds is
    /// masqueraded as its destination says. Empty unless the file sets them; IPv6's empty
    /// while IPv6 is not enabled.
    pub non_masq_src_v4: Vec<Ipv4Net>,
    pub masq_src_v4: Vec<Ipv4Net>,
    pub non_masq_src_v6: Vec<Ipv6Net>,
    pub masq_src_v6: Vec<Ipv6Net>,
    /// The address masqueraded traffic takes instead of the device's, while the node holds it
    /// (`masqueradeAddress`, `masqueradeAddressIPv6`); IPv6's is `None` while IPv6 is off.
    pub masquerade_address_v4: Option<Ipv4Addr>,
    pub masquerade_address_v6: Option<Ipv6Addr>,
}

impl Policy {
    /// Whether some destination that `self` leaves alone, `after` masquerades: a prefix
    /// dropped from the non-masquerade lists, or an exception added. (It may say so of a
    /// change that moves nothing, as one that only splits a prefix; never the other way.)
    pub fn may_masquerade_more(&self, after: &Policy) -> bool {
        // Policies run to hundreds of thousands of prefixes, and a change to a file mostly adds
        // or removes a few and leaves the rest in their order: one walk along both lists
        // answers those. A prefix the walk misses is looked for in the whole of `to`; only
        // a list reordered needs a set.
        fn dropped<T: Eq + std::hash::Hash>(from: &[T], to: &[T]) -> bool {
            let mut rest = to.iter();
            let Some(missed) = from.iter().find(|p| !rest.any(|q| q == *p)) else {
                return false;
            };
            if !to.contains(missed) {
                return true;
            }
            let to: std::collections::HashSet<&T> = to.iter().collect();
            from.iter().any(|p| !to.contains(p))
        }
        fn v6(p: &Policy) -> &[Ipv6Net] {
            p.non_masq_v6.as_deref().unwrap_or_default()
        }
        dropped(&self.non_masq_v4, &after.non_masq_v4)
            || dropped(v6(self), v6(after))
            || dropped(&after.masq_v4, &self.masq_v4)
            || dropped(&after.masq_v6, &self.masq_v6)
            || dropped(&self.non_masq_src_v4, &after.non_masq_src_v4)
            || dropped(&self.non_masq_src_v6, &after.non_masq_src_v6)
            || dropped(&after.masq_src_v4, &self.masq_src_v4)
            || dropped(&after.masq_src_v6, &self.masq_src_v6)
    }

    /// Whether traffic from `src` to `dst` keeps its source address: its destination, or its
    /// source, says so.
    pub fn leaves_alone(&self, src: IpAddr, dst: IpAddr) -> bool {
        self.exempts(dst) || self.decide_source(src).0 == Action::NonMasquerade
    }

    /// What the source lists say of traffic from `addr`, and the entry that decides it
    /// (`None`: no entry holds it, and the destination decides).
    pub fn decide_source(&self, addr: IpAddr) -> (Action, Option<IpNet>) {
        // Walked in place, as `decide` walks: this runs for every flow conntrack knows.
        let into = |n: &Ipv4Net| IpNet::from(*n);
        let into_v6 = |n: &Ipv6Net| IpNet::from(*n);
        match addr {
            IpAddr::V4(_) => longest(
                addr,
                &mut self.non_masq_src_v4.iter().map(into),
                &mut self.masq_src_v4.iter().map(into),
            ),
            IpAddr::V6(_) => longest(
                addr,
                &mut self.non_masq_src_v6.iter().map(into_v6),
                &mut self.masq_src_v6.iter().map(into_v6),
            ),
        }
    }

    /// The address `family`'s masqueraded traffic takes, where the file names one.
    pub fn masquerade_address(&self, family: IpFamily) -> Option<IpAddr> {
        match family {
            IpFamily::Ipv4 => self.masquerade_address_v4.map(IpAddr::V4),
            IpFamily::Ipv6 => self.masquerade_address_v6.map(IpAddr::V6),
        }
    }

    /// A family's source entries, the non-masquerade ones first, then the exceptions; empty
    /// when the file sets none.
    pub fn source_rules(&self, family: IpFamily) -> Rules {
        let (non_masq, masq) = match family {
            IpFamily::Ipv4 => (nets(&self.non_masq_src_v4), nets(&self.masq_src_v4)),
            IpFamily::Ipv6 => (nets(&self.non_masq_src_v6), nets(&self.masq_src_v6)),
        };
        let with = |nets: Vec<IpNet>, action| nets.into_iter().map(move |n| (n, action));
        with(non_masq, Action::NonMasquerade)
            .chain(with(masq, Action::Masquerade))
            .collect()
    }

    /// Whether traffic to `addr` keeps its source address.
    pub fn exempts(&self, addr: IpAddr) -> bool {
        self.decide(addr).0 == Action::NonMasquerade
    }

    /// What happens to traffic to `addr`, and the entry that decides it (`None`: no entry
    /// holds it, and it is masqueraded). An address of a family the policy leaves alone is
    /// decided by no entry.
    pub fn decide(&self, addr: IpAddr) -> (Action, Option<IpNet>) {
        let family = match addr {
            IpAddr::V4(_) => IpFamily::Ipv4,
            IpAddr::V6(_) => IpFamily::Ipv6,
        };
        // Walked in place, not through `rules`: this runs for every flow conntrack knows at
        // start, and a copy of 100 000 entries each time would cost more than the walk.
        let into = |n: &Ipv4Net| IpNet::from(*n);
        let into_v6 = |n: &Ipv6Net| IpNet::from(*n);
        match (family, &self.non_masq_v6) {
            (IpFamily::Ipv4, _) => longest(
                addr,
                &mut self.non_masq_v4.iter().map(into),
                &mut self.masq_v4.iter().map(into),
            ),
            (IpFamily::Ipv6, Some(non_masq_v6)) => longest(
                addr,
                &mut non_masq_v6.iter().map(into_v6),
                &mut self.masq_v6.iter().map(into_v6),
            ),
            (IpFamily::Ipv6, None) => (Action::Masquerade, None),
        }
    }

    /// A family's entries: the non-masquerade ones in rule order, then the exceptions; `None`
    /// when the policy leaves the family alone.
    pub fn rules(&self, family: IpFamily) -> Option<Rules> {
        let with = |nets: Vec<IpNet>, action| nets.into_iter().map(move |n| (n, action));
        let (non_masq, masq): (Vec<IpNet>, Vec<IpNet>) = match family {
            IpFamily::Ipv4 => (
                self.non_masq_v4.iter().map(|&n| n.into()).collect(),
                self.masq_v4.iter().map(|&n| n.into()).collect(),
            ),
            IpFamily::Ipv6 => (
                self.non_masq_v6
                    .as_ref()?
                    .iter()
                    .map(|&n| n.into())
                    .collect(),
                self.masq_v6.iter().map(|&n| n.into()).collect(),
            ),
        };
        Some(
            with(non_masq, Action::NonMasquerade)
                .chain(with(masq, Action::Masquerade))
                .collect(),
        )
    }

    /// The policy `config` asks for, with IPv6 masqueraded if the file's `enableIPv6` (or, when
    /// the file does not say, the `families` of the flag) says so.
    pub fn from_config(config: &Config, families: IpFamilies) -> Policy {
        let enable_ipv6 = families
            .as_the_file_says(config.enable_ipv6)
            .contains(IpFamily::Ipv6);
        let (mut non_masq_v4, mut non_masq_v6) = (Vec::new(), Vec::new());
        let (mut masq_v4, mut masq_v6) = (Vec::new(), Vec::new());
        for cidr in &config.masquerade_cidrs {
            match cidr {
                IpNet::V4(net) => masq_v4.push(*net),
                IpNet::V6(net) => masq_v6.push(*net),
            }
        }
        // Link-local is an entry like any other, but implicit: an exception for exactly it
        // is the same as masqLinkLocal.
        if !config.masq_link_local && !masq_v4.contains(&LINK_LOCAL_V4) {
            non_masq_v4.push(LINK_LOCAL_V4);
        }
        if !config.masq_link_local_ipv6 && !masq_v6.contains(&LINK_LOCAL_V6) {
            non_masq_v6.push(LINK_LOCAL_V6);
        }
        for cidr in &config.non_masquerade_cidrs {
            match cidr {
                IpNet::V4(net) => non_masq_v4.push(*net),
                IpNet::V6(net) => non_masq_v6.push(*net),
            }
        }
        if !enable_ipv6 {
            masq_v6.clear();
        }
        let by_family = |cidrs: &[IpNet]| {
            let mut split = (Vec::new(), Vec::new());
            for cidr in cidrs {
                match cidr {
                    IpNet::V4(net) => split.0.push(*net),
                    IpNet::V6(net) if enable_ipv6 => split.1.push(*net),
                    IpNet::V6(_) => {}
                }
            }
            split
        };
        let (non_masq_src_v4, non_masq_src_v6) = by_family(&config.non_masquerade_src_cidrs);
        let (masq_src_v4, masq_src_v6) = by_family(&config.masquerade_src_cidrs);
        Policy {
            non_masq_v4,
            non_masq_v6: enable_ipv6.then_some(non_masq_v6),
            masq_v4,
            masq_v6,
            ipv6_switched_off: config.enable_ipv6 == Some(false),
            non_masq_src_v4,
            masq_src_v4,
            non_masq_src_v6,
            masq_src_v6,
            masquerade_address_v4: config.masquerade_address,
            masquerade_address_v6: config.masquerade_address_ipv6.filter(|_| enable_ipv6),
        }
    }
}

/// `nets` as prefixes of either family.
fn nets<N: Copy + Into<IpNet>>(nets: &[N]) -> Vec<IpNet> {
    nets.iter().map(|&n| n.into()).collect()
}

/// What the longest prefix holding `addr` says, among `non_masq` and `masq`, and which it is;
/// masquerade when none holds it. No prefix is in both lists (the config refuses it).
fn longest(
    addr: IpAddr,
    non_masq: &mut dyn Iterator<Item = IpNet>,
    masq: &mut dyn Iterator<Item = IpNet>,
) -> (Action, Option<IpNet>) {
    let holding = |nets: &mut dyn Iterator<Item = IpNet>, action| {
        nets.filter(|net| net.contains(&addr))
            .max_by_key(IpNet::prefix_len)
            .map(|net| (net, action))
    };
    [
        holding(non_masq, Action::NonMasquerade),
        holding(masq, Action::Masquerade),
    ]
    .into_iter()
    .flatten()
    .max_by_key(|(net, _)| net.prefix_len())
    .map_or((Action::Masquerade, None), |(net, action)| {
        (action, Some(net))
    })
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
            masquerade_cidrs: vec![],
            non_masquerade_src_cidrs: vec![],
            masquerade_src_cidrs: vec![],
            masquerade_address: None,
            masquerade_address_ipv6: None,
            masq_link_local: masq_ll,
            masq_link_local_ipv6: masq_ll6,
            ..Config::defaults(&ConfigOptions {
                nomasq_all_reserved_ranges: false,
                families: IpFamilies::DUAL_STACK,
            })
        }
    }

    #[test]
    fn a_familys_label_is_how_json_spells_it() {
        for family in [IpFamily::Ipv4, IpFamily::Ipv6] {
            assert_eq!(serde_json::to_value(family).unwrap(), family.label());
        }
    }

    #[test]
    fn link_local_first_then_config_order_per_family() {
        let c = config(&["10.0.0.0/8", "fc00::/7", "192.168.0.0/16"], false, false);
        let p = Policy::from_config(&c, IpFamilies::DUAL_STACK);
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
        let p = Policy::from_config(&config(&["10.0.0.0/8"], true, true), IpFamilies::DUAL_STACK);
        assert_eq!(p.non_masq_v4, ["10.0.0.0/8".parse::<Ipv4Net>().unwrap()]);
        assert_eq!(p.non_masq_v6, Some(vec![]));
    }

    #[test]
    fn ipv6_disabled_leaves_ipv6_alone() {
        let p = Policy::from_config(&config(&["10.0.0.0/8"], false, false), IpFamilies::IPV4);
        assert_eq!(p.non_masq_v6, None);
    }

    #[test]
    fn duplicates_are_kept_as_upstream_does() {
        let p = Policy::from_config(
            &config(&["10.0.0.0/8", "10.0.0.0/8"], true, true),
            IpFamilies::IPV4,
        );
        assert_eq!(p.non_masq_v4.len(), 2);
    }

    fn with_exceptions(cidrs: &[&str], exceptions: &[&str], masq_ll: bool) -> Policy {
        let config = Config {
            masquerade_cidrs: exceptions.iter().map(|c| c.parse().unwrap()).collect(),
            non_masquerade_src_cidrs: vec![],
            masquerade_src_cidrs: vec![],
            masquerade_address: None,
            masquerade_address_ipv6: None,
            ..config(cidrs, masq_ll, masq_ll)
        };
        Policy::from_config(&config, IpFamilies::DUAL_STACK)
    }

    fn decided(p: &Policy, addr: &str) -> (Action, Option<String>) {
        let (action, entry) = p.decide(addr.parse().unwrap());
        (action, entry.map(|n| n.to_string()))
    }

    #[test]
    fn the_longest_prefix_decides() {
        let p = with_exceptions(
            &["10.0.0.0/8", "fd00::/8"],
            &["10.100.10.0/24", "fd00:1::/64"],
            false,
        );
        let keep = Action::NonMasquerade;
        let masq = Action::Masquerade;
        assert_eq!(decided(&p, "10.1.2.3"), (keep, Some("10.0.0.0/8".into())));
        assert_eq!(
            decided(&p, "10.100.10.7"),
            (masq, Some("10.100.10.0/24".into()))
        );
        assert_eq!(
            decided(&p, "10.100.11.7"),
            (keep, Some("10.0.0.0/8".into()))
        );
        assert_eq!(decided(&p, "fd00:1::5"), (masq, Some("fd00:1::/64".into())));
        assert_eq!(decided(&p, "fd00:2::5"), (keep, Some("fd00::/8".into())));
        assert_eq!(
            decided(&p, "203.0.113.9"),
            (masq, None),
            "no entry: the default"
        );
        assert!(p.exempts("10.1.2.3".parse().unwrap()));
        assert!(!p.exempts("10.100.10.7".parse().unwrap()));
    }

    #[test]
    fn an_allow_list_is_everything_exempt_but_its_exceptions() {
        let p = with_exceptions(&["0.0.0.0/0"], &["203.0.113.0/24"], false);
        assert_eq!(decided(&p, "198.51.100.1").0, Action::NonMasquerade);
        assert_eq!(decided(&p, "203.0.113.9").0, Action::Masquerade);
    }

    #[test]
    fn an_exception_inside_link_local_and_one_for_all_of_it() {
        let p = with_exceptions(&["10.0.0.0/8"], &["169.254.169.254/32"], false);
        assert_eq!(decided(&p, "169.254.169.254").0, Action::Masquerade);
        assert_eq!(
            decided(&p, "169.254.1.1"),
            (Action::NonMasquerade, Some("169.254.0.0/16".into()))
        );
        // An exception for exactly link-local takes the implicit entry's place.
        let p = with_exceptions(&["10.0.0.0/8"], &["169.254.0.0/16", "fe80::/10"], false);
        assert_eq!(p.non_masq_v4, ["10.0.0.0/8".parse::<Ipv4Net>().unwrap()]);
        assert_eq!(p.non_masq_v6, Some(vec![]));
        assert_eq!(decided(&p, "169.254.1.1").0, Action::Masquerade);
        assert_eq!(decided(&p, "fe80::1").0, Action::Masquerade);
    }

    #[test]
    fn ipv6_exceptions_wait_for_ipv6() {
        let config = Config {
            masquerade_cidrs: vec!["fd00:1::/64".parse().unwrap()],
            non_masquerade_src_cidrs: vec![],
            masquerade_src_cidrs: vec![],
            masquerade_address: None,
            masquerade_address_ipv6: None,
            ..config(&["fd00::/8"], false, false)
        };
        let p = Policy::from_config(&config, IpFamilies::IPV4);
        assert_eq!(p.rules(IpFamily::Ipv6), None);
        assert!(p.masq_v6.is_empty());
    }

    /// A change may masquerade more when it drops a prefix that kept addresses, or adds an
    /// exception, link-local's included; not when it adds a prefix or drops an exception.
    #[test]
    fn a_change_that_may_masquerade_more_is_told_apart() {
        let base = with_exceptions(&["10.0.0.0/8", "fc00::/7"], &["10.1.0.0/16"], false);
        let more = |after: &Policy| base.may_masquerade_more(after);
        assert!(more(&with_exceptions(
            &["fc00::/7"],
            &["10.1.0.0/16"],
            false
        )));
        assert!(more(&with_exceptions(
            &["10.0.0.0/8"],
            &["10.1.0.0/16"],
            false
        )));
        let exceptions = ["10.1.0.0/16", "10.2.0.0/16"];
        assert!(more(&with_exceptions(
            &["10.0.0.0/8", "fc00::/7"],
            &exceptions,
            false
        )));
        assert!(more(&with_exceptions(
            &["10.0.0.0/8", "fc00::/7"],
            &["10.1.0.0/16"],
            true
        )));
        assert!(!more(&base));
        let wider = ["10.0.0.0/8", "fc00::/7", "192.168.0.0/16"];
        assert!(!more(&with_exceptions(&wider, &["10.1.0.0/16"], false)));
        assert!(!more(&with_exceptions(
            &["10.0.0.0/8", "fc00::/7"],
            &[],
            false
        )));
    }

    /// The lists are compared as sets, whatever their order: a prefix moved is not dropped.
    #[test]
    fn a_prefix_moved_in_the_list_is_not_dropped() {
        let (a, b, c, d) = (
            "10.0.0.0/8",
            "172.16.0.0/12",
            "192.168.0.0/16",
            "100.64.0.0/10",
        );
        let list = |nets: &[&str]| with_exceptions(nets, &[], false);
        let base = list(&[a, b, c]);
        assert!(!base.may_masquerade_more(&list(&[c, b, a])));
        assert!(!base.may_masquerade_more(&list(&[a, d, b, c])));
        assert!(!base.may_masquerade_more(&list(&[b, c, a, a])));
        assert!(base.may_masquerade_more(&list(&[a, c])));
        assert!(base.may_masquerade_more(&list(&[c, a, d])));
        // The walk passes `a` to find `b`, and misses `b` where `to` holds it: it is the
        // last, `c`, that is gone.
        assert!(base.may_masquerade_more(&list(&[b, a])));
    }

    #[test]
    fn a_packet_is_masqueraded_only_when_its_source_and_its_destination_say_so() {
        let mut c = config(&["10.0.0.0/8"], false, false);
        c.non_masquerade_src_cidrs =
            vec!["0.0.0.0/0".parse().unwrap(), "fd00::/8".parse().unwrap()];
        c.masquerade_src_cidrs = vec!["10.244.0.0/16".parse().unwrap()];
        let p = Policy::from_config(&c, IpFamilies::DUAL_STACK);
        let addr = |s: &str| s.parse::<IpAddr>().unwrap();
        let outside = addr("203.0.113.9");
        assert!(
            !p.leaves_alone(addr("10.244.1.2"), outside),
            "a pod, to the outside"
        );
        assert!(
            p.leaves_alone(addr("10.244.1.2"), addr("10.1.2.3")),
            "to a kept destination"
        );
        assert!(
            p.leaves_alone(addr("192.168.3.4"), outside),
            "a source left alone"
        );
        assert_eq!(
            p.decide_source(addr("10.244.1.2")),
            (Action::Masquerade, Some("10.244.0.0/16".parse().unwrap()))
        );
        assert_eq!(p.source_rules(IpFamily::Ipv6).len(), 1);
        // Without IPv6, its source entries go with it.
        let p4 = Policy::from_config(&c, IpFamilies::IPV4);
        assert!(p4.source_rules(IpFamily::Ipv6).is_empty());
        assert_eq!(p4.source_rules(IpFamily::Ipv4).len(), 2);
        // A source entry dropped, or an exception added, may masquerade more.
        let mut fewer = c.clone();
        fewer.non_masquerade_src_cidrs.truncate(0);
        let fewer = Policy::from_config(&fewer, IpFamilies::DUAL_STACK);
        assert!(p.may_masquerade_more(&fewer) && !fewer.may_masquerade_more(&p));
    }
}

//! Which devices carry the programs: those `--interface` names, or else those holding a default
//! route, followed while the agent runs as they appear, change and vanish. The chain returns a
//! family's TCP, UDP and ICMP to the programs only where they leave by a device that carries
//! them with an address of that family to give; whatever leaves by another device, the chain
//! masquerades, as upstream's would.

use std::collections::BTreeMap;

use tracing::{info, warn};

use crate::{
    dataplane::iptables::render::ChainVariant,
    netdev::{self, Device, DeviceState},
    policy::{IpFamilies, IpFamily},
};

/// Which devices should carry the programs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Selection {
    /// `--interface`: these, whenever they exist.
    Named(Vec<String>),
    /// The devices holding a default route of one of `families`. A device that loses its
    /// route, like one no longer named, keeps the programs while the flows they translate
    /// through it drain.
    DefaultRoutes { families: IpFamilies },
}

impl Selection {
    pub fn new(interfaces: &[String], families: IpFamilies) -> Selection {
        if interfaces.is_empty() {
            Selection::DefaultRoutes { families }
        } else {
            let mut names = Vec::new();
            merge(&mut names, interfaces);
            Selection::Named(names)
        }
    }

    /// The devices selected now.
    pub fn followed(&self) -> anyhow::Result<Vec<String>> {
        match self {
            Selection::Named(names) => Ok(names.clone()),
            Selection::DefaultRoutes { families } => netdev::default_route_devices(*families),
        }
    }

    fn why_no_device(&self) -> &'static str {
        match self {
            Selection::Named(_) => "no --interface device exists with an IPv4 address",
            Selection::DefaultRoutes { .. } => {
                "no default route leaves by a device with an IPv4 address, and no --interface"
            }
        }
    }
}

/// Appends the names of `more` that `names` lacks, in order.
pub fn merge(names: &mut Vec<String>, more: &[String]) {
    for name in more {
        if !names.contains(name) {
            names.push(name.clone());
        }
    }
}

/// Each of `names`, as the kernel has it now.
pub fn states(names: &[String]) -> anyhow::Result<Vec<(String, DeviceState)>> {
    names
        .iter()
        .map(|name| Ok((name.clone(), netdev::device_state(name)?)))
        .collect()
}

/// The devices of `states` that can carry the programs.
pub fn usable(states: &[(String, DeviceState)]) -> Vec<Device> {
    states
        .iter()
        .filter_map(|(_, state)| match state {
            DeviceState::Usable(device) => Some(device.clone()),
            _ => None,
        })
        .collect()
}

/// The devices by which the chain returns each family's TCP, UDP and ICMP to the programs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Returned {
    ipv4: Vec<String>,
    ipv6: Vec<String>,
}

impl Returned {
    /// For programs on `devices`: IPv4 by every one; IPv6, if among `families`, by those with
    /// a global IPv6 address to give.
    pub fn by(devices: &[Device], families: IpFamilies) -> Returned {
        Returned {
            ipv4: devices.iter().map(|d| d.name.clone()).collect(),
            ipv6: devices
                .iter()
                .filter(|d| families.contains(IpFamily::Ipv6) && d.ipv6.is_some())
                .map(|d| d.name.clone())
                .collect(),
        }
    }

    /// What both return.
    pub fn common(&self, other: &Returned) -> Returned {
        let both = |mine: &[String], theirs: &[String]| {
            mine.iter()
                .filter(|name| theirs.contains(name))
                .cloned()
                .collect()
        };
        Returned {
            ipv4: both(&self.ipv4, &other.ipv4),
            ipv6: both(&self.ipv6, &other.ipv6),
        }
    }

    /// The chain that returns this for `family`.
    pub fn variant(&self, family: IpFamily) -> ChainVariant {
        ChainVariant::beside_programs(match family {
            IpFamily::Ipv4 => self.ipv4.clone(),
            IpFamily::Ipv6 => self.ipv6.clone(),
        })
    }
}

/// What the chain returns to programs on the devices `selection` picks now: what a data plane
/// starting now would install.
pub fn returned_now(selection: &Selection, families: IpFamilies) -> anyhow::Result<Returned> {
    let states = states(&selection.followed()?)?;
    Ok(Returned::by(&usable(&states), families))
}

/// What was last said about the followed devices, so that each change is logged once.
#[derive(Debug, Default)]
pub struct Notes {
    devices: BTreeMap<String, Note>,
    no_device: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Note {
    Carrying { has_global_ipv6: bool },
    Missing,
    NoIpv4Address,
}

impl Notes {
    /// Logs what changed in `states`, and that no device carries the programs when none does.
    pub fn report(
        &mut self,
        selection: &Selection,
        states: &[(String, DeviceState)],
        families: IpFamilies,
    ) {
        let mut now = BTreeMap::new();
        for (device, state) in states {
            let note = match state {
                DeviceState::Usable(d) => Note::Carrying {
                    has_global_ipv6: d.ipv6.is_some(),
                },
                DeviceState::Missing => Note::Missing,
                DeviceState::NoIpv4Address => Note::NoIpv4Address,
            };
            if self.devices.get(device) != Some(&note) {
                say(device, note, families);
            }
            now.insert(device.clone(), note);
        }
        self.devices = now;
        let no_device = usable(states).is_empty();
        if no_device && !self.no_device {
            warn!(
                "no device carries the eBPF programs ({}): the iptables chain masquerades all traffic until one does",
                selection.why_no_device()
            );
        }
        self.no_device = no_device;
    }
}

fn say(device: &str, note: Note, families: IpFamilies) {
    match note {
        Note::Missing => {
            info!(
                device,
                "device absent: nothing leaves by it until it appears"
            )
        }
        Note::NoIpv4Address => warn!(
            device,
            "device has no IPv4 address, so no programs: the iptables chain masquerades what leaves it"
        ),
        Note::Carrying {
            has_global_ipv6: false,
        } if families.contains(IpFamily::Ipv6) => warn!(
            device,
            "device has no global IPv6 address: ip6tables masquerades the IPv6 that leaves it"
        ),
        Note::Carrying { .. } => {}
    }
}

#[cfg(test)]
mod tests {
    use std::net::{Ipv4Addr, Ipv6Addr};

    use super::*;

    fn device(name: &str, ipv6: bool) -> Device {
        Device {
            name: name.into(),
            index: 7,
            ipv4: Ipv4Addr::new(203, 0, 113, 1),
            ipv6: ipv6.then_some(Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 1)),
        }
    }

    #[test]
    fn ipv6_returns_only_by_devices_with_an_ipv6_address_when_enabled() {
        let devices = [device("eth0", true), device("up1", false)];
        let both = Returned::by(&devices, IpFamilies::DUAL_STACK);
        assert_eq!(
            both.variant(IpFamily::Ipv4),
            ChainVariant::OutsideEbpf {
                devices: vec!["eth0".into(), "up1".into()]
            }
        );
        assert_eq!(
            both.variant(IpFamily::Ipv6),
            ChainVariant::OutsideEbpf {
                devices: vec!["eth0".into()]
            }
        );
        let v4_only = Returned::by(&devices, IpFamilies::IPV4);
        assert_eq!(v4_only.variant(IpFamily::Ipv6), ChainVariant::Full);
    }

    #[test]
    fn no_device_means_upstream_s_chain() {
        let none = Returned::by(&[], IpFamilies::DUAL_STACK);
        assert_eq!(none.variant(IpFamily::Ipv4), ChainVariant::Full);
        assert_eq!(none.variant(IpFamily::Ipv6), ChainVariant::Full);
    }

    #[test]
    fn common_keeps_what_both_return_in_the_first_s_order() {
        let before = [device("eth0", true), device("up1", true)];
        let before = Returned::by(&before, IpFamilies::DUAL_STACK);
        let after = [device("up1", false), device("eth0", true)];
        let after = Returned::by(&after, IpFamilies::DUAL_STACK);
        let kept = before.common(&after);
        assert_eq!(kept.ipv4, ["eth0", "up1"]);
        assert_eq!(kept.ipv6, ["eth0"]);
    }

    #[test]
    fn named_interfaces_are_followed_as_named() {
        let named = Selection::new(
            &["eth0".into(), "up1".into(), "eth0".into()],
            IpFamilies::DUAL_STACK,
        );
        assert_eq!(named.followed().unwrap(), ["eth0", "up1"]);
        assert_eq!(
            Selection::new(&[], IpFamilies::DUAL_STACK),
            Selection::DefaultRoutes {
                families: IpFamilies::DUAL_STACK
            }
        );
    }
}

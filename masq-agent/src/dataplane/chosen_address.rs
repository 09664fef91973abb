//! The address masqueraded traffic takes when the file names one (`masqueradeAddress`,
//! `masqueradeAddressIPv6`): used only while the node holds it, on any device, so that replies
//! come back; until then, and once it goes, the outgoing device's own address, as without the
//! key. New flows follow within a tick of the change; a flow keeps the address it started with.
//! The alternative, dropping masqueraded traffic while the address is missing (as Cilium's
//! egress gateway does), would cut every pod off from outside over a missing address.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use tracing::{info, warn};

use crate::{
    netdev,
    policy::{IpFamily, Policy},
};

/// The chosen addresses in force, per family: `None` where the file names none, or the node
/// does not hold it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChosenAddresses {
    pub v4: Option<Ipv4Addr>,
    pub v6: Option<Ipv6Addr>,
}

impl ChosenAddresses {
    /// Of `policy`'s chosen addresses, those among `held`.
    pub fn held(policy: &Policy, held: &[IpAddr]) -> ChosenAddresses {
        let held_v4 = |addr: &Ipv4Addr| held.contains(&IpAddr::V4(*addr));
        let held_v6 = |addr: &Ipv6Addr| held.contains(&IpAddr::V6(*addr));
        ChosenAddresses {
            v4: policy.masquerade_address_v4.filter(held_v4),
            v6: policy.masquerade_address_v6.filter(held_v6),
        }
    }

    pub fn of(&self, family: IpFamily) -> Option<IpAddr> {
        match family {
            IpFamily::Ipv4 => self.v4.map(IpAddr::V4),
            IpFamily::Ipv6 => self.v6.map(IpAddr::V6),
        }
    }
}

/// The address `policy` chooses for `family` while the node, holding `held`, does not hold
/// it: masqueraded traffic then takes the device's address.
pub fn not_held(policy: &Policy, held: &[IpAddr], family: IpFamily) -> Option<IpAddr> {
    policy
        .masquerade_address(family)
        .filter(|_| ChosenAddresses::held(policy, held).of(family).is_none())
}

/// What `status` says of each chosen address the node does not hold.
pub fn not_held_notes(policy: &Policy, held: &[IpAddr]) -> Vec<String> {
    [IpFamily::Ipv4, IpFamily::Ipv6]
        .into_iter()
        .filter_map(|family| not_held(policy, held, family))
        .map(|addr| {
            format!(
                "the config chooses {addr} to masquerade to, but the node does not hold it: \
                 masqueraded traffic takes the outgoing device's address until it does"
            )
        })
        .collect()
}

/// Which chosen addresses are in force, followed as the config and the node's addresses
/// change, each change said once.
#[derive(Debug, Default)]
pub struct ChosenAddressWatch {
    pub in_force: ChosenAddresses,
    /// Per family (IPv4, IPv6), the address the config chose and whether the node held it, at
    /// the last look; `None` before the first.
    seen: Option<[Option<(IpAddr, bool)>; 2]>,
}

/// What changed for one family's chosen address, said once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChosenAddressChange {
    /// The node holds the address the config chooses: masqueraded traffic takes it.
    Taken(IpAddr),
    /// The config chooses an address the node does not hold: the device's it is, meanwhile.
    NotHeld(IpAddr),
    /// The config chooses no address any more, where it chose this one.
    Dropped(IpAddr),
}

impl ChosenAddressChange {
    fn log(self) {
        match self {
            ChosenAddressChange::Taken(addr) => {
                info!(%addr, "masqueraded traffic takes the chosen address, which the node holds")
            }
            ChosenAddressChange::NotHeld(addr) => warn!(
                %addr,
                "the node does not hold the chosen masquerade address: masqueraded traffic \
                 takes the outgoing device's address until it does"
            ),
            ChosenAddressChange::Dropped(addr) => info!(
                %addr,
                "the config chooses no masquerade address any more: masqueraded traffic takes \
                 the outgoing device's address"
            ),
        }
    }
}

impl ChosenAddressWatch {
    /// Looks at the node's addresses again for `policy`, and says what changed.
    pub fn follow(&mut self, policy: &Policy) -> anyhow::Result<()> {
        // Most configs choose none, and then the node's addresses, a dump of every device's
        // each second, have nothing to say.
        let chooses = IpFamily::ALL
            .into_iter()
            .any(|family| policy.masquerade_address(family).is_some());
        let held = if chooses {
            netdev::local_addresses()?
        } else {
            Vec::new()
        };
        for change in self.look(policy, &held) {
            change.log();
        }
        Ok(())
    }

    /// Takes in force what `policy` chooses of `held`, and returns what changed since the last
    /// look, in what the config chooses or in whether the node holds it: one change per family
    /// at most, however often it is asked.
    fn look(&mut self, policy: &Policy, held: &[IpAddr]) -> Vec<ChosenAddressChange> {
        let families = [IpFamily::Ipv4, IpFamily::Ipv6];
        let now = families.map(|family| {
            policy
                .masquerade_address(family)
                .map(|addr| (addr, held.contains(&addr)))
        });
        let before = self.seen.replace(now).unwrap_or_default();
        self.in_force = ChosenAddresses::held(policy, held);
        before
            .into_iter()
            .zip(now)
            .filter(|(before, now)| before != now)
            .filter_map(|(before, now)| match (before, now) {
                (_, Some((addr, true))) => Some(ChosenAddressChange::Taken(addr)),
                (_, Some((addr, false))) => Some(ChosenAddressChange::NotHeld(addr)),
                (Some((addr, _)), None) => Some(ChosenAddressChange::Dropped(addr)),
                (None, None) => None,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        config::{Config, ConfigOptions},
        policy::IpFamilies,
    };

    #[test]
    fn a_chosen_address_is_in_force_only_while_the_node_holds_it() {
        let mut config = Config::defaults(&ConfigOptions::default());
        config.masquerade_address = Some("198.51.100.7".parse().unwrap());
        let policy = Policy::from_config(&config, IpFamilies::IPV4);
        let held: IpAddr = "198.51.100.7".parse().unwrap();
        let other: IpAddr = "203.0.113.1".parse().unwrap();
        assert_eq!(
            ChosenAddresses::held(&policy, &[other, held]).v4,
            Some("198.51.100.7".parse().unwrap())
        );
        assert_eq!(
            ChosenAddresses::held(&policy, &[other]),
            ChosenAddresses::default()
        );
        assert_eq!(not_held(&policy, &[other, held], IpFamily::Ipv4), None);
        assert_eq!(
            not_held(&policy, &[other], IpFamily::Ipv4),
            Some(held),
            "configured, not held"
        );
        assert!(not_held_notes(&policy, &[other, held]).is_empty());
        let notes = not_held_notes(&policy, &[other]);
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].contains("198.51.100.7"), "{notes:?}");
        let without = Policy::from_config(
            &Config::defaults(&ConfigOptions::default()),
            IpFamilies::IPV4,
        );
        assert!(not_held_notes(&without, &[other]).is_empty(), "none chosen");
    }

    #[test]
    fn each_change_of_the_chosen_address_or_of_its_holding_is_said_once() {
        use ChosenAddressChange::*;
        let ip = |text: &str| -> IpAddr { text.parse().unwrap() };
        let (a, b, a6) = ("198.51.100.7", "198.51.100.8", "2001:db8::7");
        let device = ip("203.0.113.1");
        let choosing = |v4: Option<&str>, v6: Option<&str>| {
            let mut config = Config::defaults(&ConfigOptions::default());
            config.masquerade_address = v4.map(|addr| addr.parse().unwrap());
            config.masquerade_address_ipv6 = v6.map(|addr| addr.parse().unwrap());
            Policy::from_config(&config, IpFamilies::DUAL_STACK)
        };
        let mut watch = ChosenAddressWatch::default();
        let mut look = |v4, v6, held: &[IpAddr]| watch.look(&choosing(v4, v6), held);
        assert_eq!(look(None, None, &[device]), [], "none chosen");
        // A live edit of the config chooses an address the node does not hold, then another.
        assert_eq!(look(Some(a), None, &[device]), [NotHeld(ip(a))]);
        assert_eq!(look(Some(a), None, &[device]), []);
        assert_eq!(look(Some(b), None, &[device]), [NotHeld(ip(b))]);
        // The node's addresses change, but not whether it holds the chosen one.
        assert_eq!(look(Some(b), None, &[device, ip(a)]), []);
        // The node gains it, loses it; the config switches to one it holds, then drops it.
        assert_eq!(look(Some(b), None, &[device, ip(b)]), [Taken(ip(b))]);
        assert_eq!(look(Some(b), None, &[device, ip(a)]), [NotHeld(ip(b))]);
        assert_eq!(look(Some(a), None, &[device, ip(a)]), [Taken(ip(a))]);
        assert_eq!(look(None, None, &[device, ip(a)]), [Dropped(ip(a))]);
        // Each family for itself.
        assert_eq!(
            look(Some(a), Some(a6), &[device, ip(a)]),
            [Taken(ip(a)), NotHeld(ip(a6))]
        );
        assert_eq!(look(Some(a), Some(a6), &[ip(a), ip(a6)]), [Taken(ip(a6))]);
        assert_eq!(watch.in_force.of(IpFamily::Ipv6), Some(ip(a6)));
    }
}

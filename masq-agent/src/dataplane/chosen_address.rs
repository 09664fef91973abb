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

/// Which chosen addresses are in force, followed as the node's addresses change, each change
/// logged once.
#[derive(Debug, Default)]
pub struct ChosenAddressWatch {
    pub in_force: ChosenAddresses,
    /// Whether the node's addresses were looked at yet: the first look says what it found.
    looked: bool,
}

impl ChosenAddressWatch {
    /// Looks at the node's addresses again for `policy`, and says what changed.
    pub fn follow(&mut self, policy: &Policy) -> anyhow::Result<()> {
        let now = ChosenAddresses::held(policy, &netdev::local_addresses()?);
        let first = !std::mem::replace(&mut self.looked, true);
        if now == self.in_force && !first {
            return Ok(());
        }
        for family in [IpFamily::Ipv4, IpFamily::Ipv6] {
            let (before, after) = (self.in_force.of(family), now.of(family));
            match (before, after, policy.masquerade_address(family)) {
                (_, Some(addr), _) if before != after || first => {
                    info!(%addr, "masqueraded traffic takes the chosen address, which the node holds")
                }
                (_, None, Some(addr)) if before.is_some() || first => warn!(
                    %addr,
                    "the node does not hold the chosen masquerade address: masqueraded traffic \
                     takes the outgoing device's address until it does"
                ),
                _ => {}
            }
        }
        self.in_force = now;
        Ok(())
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
}

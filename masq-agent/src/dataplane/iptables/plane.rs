//! The iptables data plane: both families' chains (and, beside the eBPF programs, their sets)
//! kept equal to the policy, re-applied only where they differ.

use std::collections::HashMap;

use anyhow::Context as _;

use super::{
    command::{Capabilities, Iptables, available_families},
    ipset,
    render::{ChainVariant, render, render_switched_off, set_members},
};
use crate::{
    dataplane::{
        chosen_address::{ChosenAddressWatch, ChosenAddresses},
        interface::{ApplyOutcome, DataPlane},
        mode::Mode,
        nat_usage::NatSweep,
        status::{self, Status},
    },
    policy::{IpFamily, MasqueradeOptions, Policy},
};

/// What was last installed for one family, to make re-applying an unchanged policy cheap.
struct Installed {
    rendered: String,
    /// The sets the chain matches on, each with its members: the destinations beside the eBPF
    /// programs, and the sources when the policy has source entries.
    sets: Vec<(String, Vec<ipset::Member>)>,
    /// `iptables -S` of the chain right after installing it; any difference later means someone
    /// else changed it.
    listing: String,
}

pub struct IptablesDataPlane {
    opts: MasqueradeOptions,
    /// The chain each family gets.
    variants: HashMap<IpFamily, ChainVariant>,
    mode: Mode,
    reason: Option<String>,
    /// Probed once: the iptables binaries do not change under a running agent.
    caps: HashMap<IpFamily, Capabilities>,
    installed: HashMap<IpFamily, Installed>,
    /// The next apply reads the chain and the set back rather than trust `installed`: at every
    /// resync, and after an apply that failed midway.
    verify: bool,
    /// The chosen masquerade addresses in force (`masqueradeAddress`), and the policy last
    /// applied, to apply again when one comes or goes.
    chosen: ChosenAddressWatch,
    applied: Option<Policy>,
    /// The chosen addresses the chain was last rendered with.
    rendered_chosen: ChosenAddresses,
}

impl Installed {
    /// The members installed in the set called `name`.
    fn set(&self, name: &str) -> Option<&Vec<ipset::Member>> {
        self.sets
            .iter()
            .find(|(installed, _)| installed == name)
            .map(|(_, members)| members)
    }
}

impl IptablesDataPlane {
    pub fn new(opts: MasqueradeOptions, variant: ChainVariant, mode: Mode) -> Self {
        IptablesDataPlane {
            opts,
            variants: [IpFamily::Ipv4, IpFamily::Ipv6]
                .into_iter()
                .map(|f| (f, variant.clone()))
                .collect(),
            mode,
            reason: None,
            caps: [IpFamily::Ipv4, IpFamily::Ipv6]
                .into_iter()
                .map(|f| (f, Capabilities::detect(f)))
                .collect(),
            installed: HashMap::new(),
            verify: true,
            chosen: ChosenAddressWatch::default(),
            applied: None,
            rendered_chosen: ChosenAddresses::default(),
        }
    }

    /// Gives `family` the `variant` chain from the next apply on.
    pub fn set_variant(&mut self, family: IpFamily, variant: ChainVariant) {
        self.variants.insert(family, variant);
    }

    /// The full chain, standing in for the eBPF data plane, which could not run because of
    /// `reason`.
    pub fn fallback(opts: MasqueradeOptions, reason: String) -> Self {
        IptablesDataPlane {
            reason: Some(reason),
            ..Self::new(opts, ChainVariant::Full, Mode::IptablesFallback)
        }
    }

    /// Looks at the node's addresses again for `policy`'s chosen masquerade addresses (the
    /// eBPF data plane asks this chain's watch too, so that each change is said once); the
    /// next apply or upkeep renders what is in force.
    pub fn follow_chosen(&mut self, policy: &Policy) -> anyhow::Result<()> {
        self.chosen.follow(policy)
    }

    pub fn chain(&self) -> &str {
        &self.opts.chain
    }

    /// For IPv6 switched off by the file (`enableIPv6: false`), a chain that masquerades
    /// nothing. Its one rule matches on conntrack's state: on a node where nothing else
    /// uses IPv6 connection tracking, the last MASQUERADE rule gone would take conntrack's
    /// IPv6 hooks with it, and the connections already translated would stop being
    /// translated back. `None` when the family is merely left alone, as upstream leaves it.
    fn switched_off(&self, family: IpFamily, policy: &Policy) -> Option<String> {
        // Asked on every apply while IPv6 is off, which is most nodes: only a switch the file
        // makes is worth a look at the kernel's chain.
        if family != IpFamily::Ipv6 || !policy.ipv6_switched_off {
            return None;
        }
        let chain = &self.opts.chain;
        let ours = self.installed.contains_key(&family)
            || (Iptables { family })
                .list_chain(chain)
                .ok()??
                .contains("-A ");
        ours.then(|| render_switched_off(chain))
    }

    /// Both families' chains and sets made to match `policy`.
    fn apply_families(&mut self, policy: &Policy) -> anyhow::Result<ApplyOutcome> {
        let mut outcome = ApplyOutcome::Unchanged;
        for (family, caps) in [IpFamily::Ipv4, IpFamily::Ipv6].map(|f| (f, self.caps[&f])) {
            let variant = &self.variants[&family];
            let to_source = self.chosen.in_force.of(family);
            let rendered = render(family, policy, &self.opts, caps, variant, to_source)
                .or_else(|| self.switched_off(family, policy));
            let Some(rendered) = rendered else {
                continue;
            };
            let chain = &self.opts.chain;
            let mut sets = Vec::new();
            if matches!(variant, ChainVariant::OutsideEbpf { .. })
                && let Some(rules) = policy.rules(family)
            {
                sets.push((ipset::name(chain, family), set_members(&rules)));
            }
            let sources = policy.source_rules(family);
            if !sources.is_empty() {
                sets.push((ipset::source_name(chain, family), set_members(&sources)));
            }
            match self.apply_family(family, rendered, sets)? {
                ApplyOutcome::Unchanged => {}
                changed => outcome = changed,
            }
        }
        self.rendered_chosen = self.chosen.in_force;
        Ok(outcome)
    }

    /// One family's chain and the sets it matches on (`sets`: each set's name and members).
    fn apply_family(
        &mut self,
        family: IpFamily,
        rendered: String,
        sets: Vec<(String, Vec<ipset::Member>)>,
    ) -> anyhow::Result<ApplyOutcome> {
        let ipt = Iptables { family };
        let chain = &self.opts.chain;
        let previous = self.installed.get(&family);
        // Listing a chain of 100 000 rules takes seconds: only one that should not change is,
        // and only when verifying; each look costs a process or two.
        let chain_intact = match previous {
            Some(prev) if prev.rendered == rendered => {
                !self.verify
                    || (ipt.list_chain(chain)?.as_deref() == Some(prev.listing.as_str())
                        && ipt.jump_present(chain)?)
            }
            _ => false,
        };
        // The members each live set holds, as far as the agent can tell without listing them:
        // those it installed, if it has as many.
        let mut live_sets = Vec::new();
        for (name, _) in &sets {
            let installed = previous.and_then(|prev| prev.set(name));
            let live = match installed {
                Some(members) if !self.verify || ipset::len(name)? == Some(members.len()) => {
                    Some(members)
                }
                _ => None,
            };
            live_sets.push(live);
        }
        let sets_intact = sets
            .iter()
            .zip(&live_sets)
            .all(|((_, members), live)| *live == Some(members));
        let unused_sets: Vec<String> = previous
            .map(|prev| prev.sets.iter().map(|(name, _)| name.clone()))
            .into_iter()
            .flatten()
            .filter(|name| !sets.iter().any(|(wanted, _)| wanted == name))
            .collect();
        if chain_intact && sets_intact && unused_sets.is_empty() {
            return Ok(ApplyOutcome::Unchanged);
        }
        let outcome = match previous {
            Some(prev) if prev.rendered == rendered && prev.sets == sets => ApplyOutcome::Repaired,
            _ => ApplyOutcome::Applied,
        };
        // The sets before the chain that matches on them; the chain before the jump to it, so
        // there is no moment with a jump to an empty chain; a set the chain no longer matches
        // on goes once the chain is in.
        for ((name, members), live) in sets.iter().zip(&live_sets) {
            match live {
                Some(live) if *live == members => {}
                Some(live) => ipset::update(name, live, members)?,
                None => ipset::sync(name, family, members)?,
            }
        }
        let listing = match previous {
            Some(prev) if chain_intact => prev.listing.clone(),
            _ => {
                ipt.restore(&rendered)?;
                ipt.ensure_jump(chain)?;
                ipt.list_chain(chain)?
                    .context("chain vanished right after it was installed")?
            }
        };
        for name in unused_sets {
            ipset::destroy(&name)?;
        }
        self.installed.insert(
            family,
            Installed {
                rendered,
                sets,
                listing,
            },
        );
        Ok(outcome)
    }
}

impl DataPlane for IptablesDataPlane {
    fn mode(&self) -> Mode {
        self.mode
    }

    fn masquerade_addresses(&self) -> ChosenAddresses {
        self.chosen.in_force
    }

    fn mode_reason(&self) -> Option<String> {
        self.reason.clone()
    }

    fn apply(&mut self, policy: &Policy) -> anyhow::Result<ApplyOutcome> {
        self.follow_chosen(policy)?;
        let applied = self.apply_families(policy);
        self.applied = Some(policy.clone());
        // What a failed apply left behind is not known.
        self.verify = applied.is_err();
        applied
    }

    fn verify_next_apply(&mut self) {
        self.verify = true;
    }

    /// Applies the last policy again when a chosen masquerade address came or went.
    fn maintain(&mut self) -> anyhow::Result<Option<NatSweep>> {
        if let Some(policy) = self.applied.take() {
            // What is in force may have changed since the chain was rendered, whoever looked.
            let followed = self.follow_chosen(&policy).and_then(|()| {
                match self.chosen.in_force == self.rendered_chosen {
                    true => Ok(()),
                    false => self.apply_families(&policy).map(drop),
                }
            });
            self.applied = Some(policy);
            followed?;
        }
        Ok(None)
    }

    fn status(&self) -> anyhow::Result<Status> {
        let mut status = status::read_back(&self.opts.chain, None)?;
        if status.mode.is_some() {
            status.mode = Some(self.mode);
            status.mode_reason = self.reason.clone();
        }
        Ok(status)
    }

    fn cleanup(&mut self) -> anyhow::Result<()> {
        self.installed.clear();
        cleanup(&self.opts.chain).map(drop)
    }
}

/// Removes the chain of every family and its jumps; returns the families it was found in.
pub fn cleanup(chain: &str) -> anyhow::Result<Vec<IpFamily>> {
    let mut found = Vec::new();
    for family in available_families() {
        let removed = (Iptables { family }).remove(chain)?;
        // The chain matches its CIDRs through sets (the destinations beside the eBPF programs,
        // the sources): they go with it.
        ipset::destroy(&ipset::name(chain, family))?;
        ipset::destroy(&ipset::source_name(chain, family))?;
        if removed {
            found.push(family);
        }
    }
    Ok(found)
}

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
    dataplane::{ApplyOutcome, DataPlane, Mode, Status},
    policy::{IpFamily, MasqueradeOptions, Policy},
};

/// What was last installed for one family, to make re-applying an unchanged policy cheap.
struct Installed {
    rendered: String,
    /// The members of the chain's set, for the chain beside the eBPF programs.
    set: Option<Vec<ipset::Member>>,
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
            let rendered = render(family, policy, &self.opts, caps, variant)
                .or_else(|| self.switched_off(family, policy));
            let Some(rendered) = rendered else {
                continue;
            };
            let set = matches!(variant, ChainVariant::OutsideEbpf { .. })
                .then(|| policy.rules(family).as_ref().map(set_members))
                .flatten();
            match self.apply_family(family, rendered, set)? {
                ApplyOutcome::Unchanged => {}
                changed => outcome = changed,
            }
        }
        Ok(outcome)
    }

    fn apply_family(
        &mut self,
        family: IpFamily,
        rendered: String,
        set: Option<Vec<ipset::Member>>,
    ) -> anyhow::Result<ApplyOutcome> {
        let ipt = Iptables { family };
        let chain = &self.opts.chain;
        let set_name = ipset::name(chain, family);
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
        // The members the live set holds, as far as the agent can tell without listing them:
        // those it installed, if it has as many.
        let live_set = match previous.and_then(|prev| prev.set.as_ref()) {
            Some(members) if !self.verify || ipset::len(&set_name)? == Some(members.len()) => {
                Some(members)
            }
            _ => None,
        };
        let set_intact = set.is_none() || (live_set.is_some() && live_set == set.as_ref());
        if chain_intact && set_intact {
            return Ok(ApplyOutcome::Unchanged);
        }
        let outcome = match previous {
            Some(prev) if prev.rendered == rendered && prev.set == set => ApplyOutcome::Repaired,
            _ => ApplyOutcome::Applied,
        };
        // The set before the chain that matches on it; the chain before the jump to it, so there
        // is no moment with a jump to an empty chain.
        if let Some(members) = &set
            && !set_intact
        {
            match live_set {
                Some(live) => ipset::update(&set_name, live, members)?,
                None => ipset::sync(&set_name, family, members)?,
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
        self.installed.insert(
            family,
            Installed {
                rendered,
                set,
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

    fn mode_reason(&self) -> Option<String> {
        self.reason.clone()
    }

    fn apply(&mut self, policy: &Policy) -> anyhow::Result<ApplyOutcome> {
        let applied = self.apply_families(policy);
        // What a failed apply left behind is not known.
        self.verify = applied.is_err();
        applied
    }

    fn verify_next_apply(&mut self) {
        self.verify = true;
    }

    fn status(&self) -> anyhow::Result<Status> {
        let mut status = crate::dataplane::read_back(&self.opts.chain, None)?;
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
        // The eBPF data plane's chain matches its CIDRs through a set; it goes with the chain.
        ipset::destroy(&ipset::name(chain, family))?;
        if removed {
            found.push(family);
        }
    }
    Ok(found)
}

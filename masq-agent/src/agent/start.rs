//! What the agent starts with: its flags turned into the options of the config, the policy and
//! the data plane; the data plane the flags ask for built, or the chain it falls back to; and the
//! mode it runs in recorded for `status` in another process.

use std::path::Path;

use tracing::{info, warn};

use crate::{
    cli::{ChainFlags, ConfigFlags, DataplaneKind, Flags, MasqueradeFlags},
    config::{self, ConfigOptions},
    dataplane::{
        DataPlane, Mode,
        ebpf::{self, EbpfOptions, devices::Selection, leftovers::Leftovers},
        iptables::{ChainVariant, IptablesDataPlane},
        state,
    },
    netdev,
    policy::{IpFamilies, IpFamily, MasqueradeOptions, Policy},
    ports,
    privileges::{self, Effective},
};

pub fn masquerade_options(chain: &ChainFlags, masquerade: &MasqueradeFlags) -> MasqueradeOptions {
    MasqueradeOptions {
        chain: chain.masq_chain.clone(),
        random_fully: masquerade.random_fully,
        to_ports: masquerade.to_ports.clone(),
    }
}

/// The flags that shape the policy, as the running agent records them.
pub fn policy_flags(flags: &Flags) -> state::PolicyFlags {
    state::PolicyFlags {
        config: flags.config.path.clone(),
        masq_chain: flags.chain.masq_chain.clone(),
        nomasq_all_reserved_ranges: flags.config.nomasq_all_reserved_ranges,
        enable_ipv6: flags.config.enable_ipv6,
    }
}

pub fn config_options(config: &ConfigFlags) -> ConfigOptions {
    ConfigOptions {
        nomasq_all_reserved_ranges: config.nomasq_all_reserved_ranges,
        families: config.families(),
    }
}

/// What the agent starts from: the flags, with `--enable-ipv6` as the config file's
/// `enableIPv6` says when it says (the eBPF data plane sizes its IPv6 NAT table when it loads),
/// and the number of policy entries the file asks for (it sizes the decision counters). A
/// file that cannot be read leaves the flag as it is, and counts no entry.
pub struct Start {
    pub flags: Flags,
    pub policy_entries: usize,
}

impl Start {
    pub fn from_the_file(flags: &Flags) -> Start {
        let mut flags = flags.clone();
        let mut policy_entries = 0;
        let config = &mut flags.config;
        if let Ok(loaded) = config::load(&config.path, &config_options(config)) {
            let families = config
                .families()
                .as_the_file_says(loaded.config.enable_ipv6);
            config.enable_ipv6 = families.contains(IpFamily::Ipv6);
            let policy = Policy::from_config(&loaded.config, families);
            policy_entries = [IpFamily::Ipv4, IpFamily::Ipv6]
                .into_iter()
                .map(|family| {
                    let destinations = policy.rules(family).map_or(0, |rules| rules.len());
                    destinations + policy.source_rules(family).len()
                })
                .sum();
        }
        Start {
            flags,
            policy_entries,
        }
    }
}

/// Builds the data plane the flags ask for, falling back to the full iptables chain when the
/// eBPF one cannot run and the flags allow it.
pub fn build_dataplane(start: &Start) -> anyhow::Result<Box<dyn DataPlane>> {
    let flags = &start.flags;
    let opts = masquerade_options(&flags.chain, &flags.masquerade);
    let capabilities = Effective::of_this_process().ok();
    if let Some(missing) = capabilities.map(|c| c.missing(&privileges::FOR_THE_CHAIN))
        && !missing.is_empty()
    {
        anyhow::bail!(
            "the process lacks {}, which iptables, ip6tables and ipset need: add {} to the \
             container's capabilities (deploy/daemonset.yaml lists what the agent needs)",
            privileges::listed(&missing),
            if missing.len() == 1 { "it" } else { "them" }
        );
    }
    match flags.masquerade.dataplane {
        DataplaneKind::Iptables => Ok(Box::new(IptablesDataPlane::new(
            opts,
            ChainVariant::Full,
            Mode::Iptables,
        ))),
        DataplaneKind::Ebpf => {
            match ebpf_options(start, capabilities).and_then(|o| ebpf::new(&o)) {
                Ok(plane) => Ok(Box::new(plane)),
                Err(why) if flags.daemon.fallback_to_iptables => Ok(fallback(opts, &why)),
                Err(why) => Err(anyhow::Error::from(why).context("--fallback-to-iptables=false")),
            }
        }
    }
}

pub(super) fn fallback(opts: MasqueradeOptions, why: &ebpf::Unavailable) -> Box<dyn DataPlane> {
    warn!("falling back to the full iptables chain: {why}");
    Box::new(IptablesDataPlane::fallback(opts, why.to_string()))
}

/// The devices the eBPF programs go on: each `--interface`, or else those of the default routes.
pub fn device_selection(masquerade: &MasqueradeFlags, families: IpFamilies) -> Selection {
    Selection::new(&masquerade.interfaces, families)
}

/// The eBPF data plane's options; without the node's ephemeral port range, the programs would
/// not know which ports are free for NAT, so the data plane cannot run.
/// `capabilities`: the process's, when they could be read.
fn ebpf_options(
    start: &Start,
    capabilities: Option<Effective>,
) -> Result<EbpfOptions, ebpf::Unavailable> {
    let flags = &start.flags;
    if let Some(missing) = capabilities.map(Effective::missing_for_the_programs)
        && !missing.is_empty()
    {
        return Err(ebpf::Unavailable(anyhow::anyhow!(
            "the process lacks {}, which loading the programs and their maps needs (or \
             CAP_SYS_ADMIN, on kernels before 5.8)",
            privileges::listed(&missing)
        )));
    }
    let ephemeral = netdev::ephemeral_port_range().map_err(ebpf::Unavailable)?;
    Ok(EbpfOptions {
        bpffs: flags.pins.bpffs.clone(),
        devices: device_selection(&flags.masquerade, flags.config.families()),
        nat_capacity: flags.daemon.nat_capacity.saturating_mul(2),
        port_spans: ports::nat_port_spans(flags.masquerade.to_ports.as_ref(), ephemeral),
        random_fully: flags.masquerade.random_fully,
        masquerade: masquerade_options(&flags.chain, &flags.masquerade),
        families: flags.config.families(),
        policy_entries: start.policy_entries,
        node_port_range: flags.daemon.node_port_range.0,
    })
}

/// What an eBPF data plane left under `bpffs`, to drain while the data plane in force (`mode`)
/// is another.
pub(super) fn leftovers_beside(mode: Mode, bpffs: &Path) -> Option<Leftovers> {
    let found = (mode != Mode::Ebpf)
        .then(|| Leftovers::find(bpffs))
        .flatten();
    if found.is_some() {
        info!(
            "the eBPF data plane's programs stay until the flows they translate end; their \
             tables are swept meanwhile"
        );
    }
    found
}

pub(super) fn record_mode(bpffs: &Path, dataplane: &dyn DataPlane, flags: &state::PolicyFlags) {
    if let Err(err) = state::record(
        bpffs,
        dataplane.mode(),
        dataplane.mode_reason(),
        flags.clone(),
    ) {
        warn!("cannot record the data plane mode for `status`: {err}");
    }
}

//! The eBPF data plane itself: what it holds, how it is built, and the DataPlane interface
//! over the programs, the maps and the reduced chain beside them.

use super::{
    attach::Attachment,
    carry::Carried,
    clashes::Clashes,
    cleanup, conntrack, decisions,
    devices::{Notes, Returned, Selection},
    expiry,
    expiry::{SweepClock, Timeouts},
    flow_table,
    hook::Hook,
    kernel_sweep, load,
    load::{Loaded, Programs},
    maps::Maps,
    node_ports,
    options::EbpfOptions,
    pins::Pins,
    strays,
};
use crate::dataplane::{
    chosen_address::ChosenAddresses,
    interface::{ApplyOutcome, DataPlane},
    iptables::{plane::IptablesDataPlane, render::ChainVariant},
    mode::Mode,
    nat_usage::NatSweep,
    status::{Status, read_back},
};
use crate::{
    netdev::Device,
    policy::{IpFamilies, IpFamily, Policy},
    ports::PortRange,
};

/// The eBPF data plane cannot run here: what it needs from the node cannot be read, its object
/// does not load, or a program cannot be attached to a device it should run on. Those paths
/// return it, and no other: the agent falls back to iptables on it (if allowed to), and on
/// nothing else. `maintain` meets it when a program cannot be attached again; the fallback
/// then comes with the next sync, whose `apply` meets it too.
#[derive(Debug, thiserror::Error)]
#[error("eBPF data plane unavailable: {0:#}")]
pub struct Unavailable(pub anyhow::Error);

pub struct EbpfDataPlane {
    pub(super) programs: Programs,
    pub(super) maps: Maps,
    pub(super) pins: Pins,
    pub(super) families: IpFamilies,
    /// The chosen masquerade addresses the `interfaces` map holds (`masqueradeAddress`), as
    /// the chain's watch found them.
    pub(super) chosen_written: ChosenAddresses,
    pub(super) selection: Selection,
    /// The devices carrying the programs, as last looked up.
    pub(super) devices: Vec<Device>,
    /// Devices no longer selected (no longer named, or without their default route), whose
    /// programs stay, but out of the chain's early returns, while the flows they translate
    /// through them drain: released once none is left, or once the device is gone.
    pub(super) draining: Vec<Device>,
    /// Devices an earlier agent left programs on: taken over, or released, at the first apply.
    pub(super) inherited: Vec<String>,
    pub(super) notes: Notes,
    pub(super) attachments: Vec<(String, Hook, Attachment)>,
    pub(super) chain: IptablesDataPlane,
    /// What the chain returns to the programs, as last installed.
    pub(super) returned: Returned,
    pub(super) timeouts: Timeouts,
    pub(super) applied: Option<Policy>,
    pub(super) sweeps: SweepClock,
    /// The old NAT tables whose flows are carried into the new ones, held until the first
    /// apply has taken the links over from the old programs.
    pub(super) carried: Carried,
    pub(super) clashes: Clashes,
    /// IPv6 was turned on by the config after the programs were loaded without it.
    ipv6_by_the_chain: bool,
    pub(super) node_port_range: Option<PortRange>,
    /// The node's ports as last read and written.
    pub(super) node_ports: node_ports::HeldPorts,
    /// When the first apply took the links over from an earlier agent's programs and carried
    /// its flows in.
    pub(super) settled: Option<std::time::Instant>,
    /// The ports NAT hands out.
    pub(super) port_spans: Vec<PortRange>,
}

/// Loads the embedded object, reusing the maps an earlier agent pinned when their layout
/// matches. Nothing is attached until the first `apply`, so that the programs never run with
/// empty non-masquerade tries.
pub fn new(opts: &EbpfOptions) -> Result<EbpfDataPlane, Unavailable> {
    let pins = Pins::new(&opts.bpffs);
    let Loaded {
        programs,
        maps,
        carried,
    } = load::load_pinned(opts, &pins).map_err(Unavailable)?;
    let mut plane = EbpfDataPlane {
        programs,
        clashes: Clashes::since(&maps.counters),
        maps,
        inherited: pins.linked_devices(),
        pins,
        families: opts.families,
        chosen_written: ChosenAddresses::default(),
        selection: opts.devices.clone(),
        devices: Vec::new(),
        draining: Vec::new(),
        notes: Notes::default(),
        attachments: Vec::new(),
        // Until programs run somewhere, the chain leaves nothing to them.
        chain: IptablesDataPlane::new(opts.masquerade.clone(), ChainVariant::Full, Mode::Ebpf),
        returned: Returned::default(),
        timeouts: Timeouts::of_conntrack(std::path::Path::new(expiry::CONNTRACK_SYSCTLS)),
        applied: None,
        sweeps: SweepClock::default(),
        carried,
        ipv6_by_the_chain: false,
        node_port_range: opts.node_port_range,
        node_ports: node_ports::HeldPorts::default(),
        settled: None,
        port_spans: opts.port_spans.clone(),
    };
    // Before any program runs: none may hand out a port of the node's, and a full table may
    // tell a flow that is over.
    plane.hold_node_ports().map_err(Unavailable)?;
    kernel_sweep::give_limits(&mut plane.maps.sweep, &plane.timeouts).map_err(Unavailable)?;
    Ok(plane)
}

impl EbpfDataPlane {
    /// Writes the ports the node holds now into `node_ports`.
    fn hold_node_ports(&mut self) -> anyhow::Result<()> {
        let maps = node_ports::PortMaps {
            held: &mut self.maps.node_ports,
            entryless: &mut self.maps.entryless_ports,
        };
        let ports = node_ports::NodePorts::read(self.node_port_range);
        self.node_ports.hold(maps, ports)
    }

    /// What the programs enforce of `policy`. IPv6 is the programs' only when they were loaded
    /// for it (the NAT table is sized then). Turned on by the config since, the chain beside
    /// the programs masquerades it, in full, until the agent restarts. Turned off since, no
    /// new IPv6 flow is masqueraded (one prefix, ::/0, keeps every address), while the flows
    /// already translated go on until they end.
    fn for_the_programs<'a>(&mut self, policy: &'a Policy) -> std::borrow::Cow<'a, Policy> {
        match (
            self.families.contains(IpFamily::Ipv6),
            policy.non_masq_v6.is_some(),
        ) {
            (true, false) => std::borrow::Cow::Owned(Policy {
                non_masq_v6: Some(vec![ipnet::Ipv6Net::default()]),
                masq_v6: Vec::new(),
                ..policy.clone()
            }),
            (false, true) => {
                if !self.ipv6_by_the_chain {
                    tracing::warn!(
                        "IPv6 is enabled by the config file, but the programs were loaded \
                         without it: the ip6tables chain masquerades IPv6 until the agent \
                         restarts"
                    );
                    self.ipv6_by_the_chain = true;
                }
                std::borrow::Cow::Borrowed(policy)
            }
            _ => std::borrow::Cow::Borrowed(policy),
        }
    }
}

impl DataPlane for EbpfDataPlane {
    fn mode(&self) -> Mode {
        Mode::Ebpf
    }

    fn masquerade_addresses(&self) -> ChosenAddresses {
        self.chosen_written
    }

    fn apply(&mut self, policy: &Policy) -> anyhow::Result<ApplyOutcome> {
        let first = self.applied.is_none();
        if first {
            // An earlier agent's flows, carried over or held from conntrack below, were judged
            // by a policy this agent does not know.
            self.maps.policy.lower_strays_cleared()?;
        }
        let for_the_programs = self.for_the_programs(policy);
        // What the programs decided by until now: this agent's last policy, or, at its first
        // apply, the one an earlier agent left in the pinned tries (a change made while no
        // agent ran moves no live flow either).
        let applied = self.applied.take();
        let left_in_the_tries = match applied {
            Some(_) => None,
            None => decisions::TrieEntries::read(&self.pins)
                .inspect_err(|err| {
                    tracing::warn!(
                        "reading the policy an earlier agent left, to keep the flows it left \
                         alone: {err:#}"
                    )
                })
                .ok()
                .filter(|tries| !tries.destinations.is_empty())
                .map(|tries| tries.as_policy()),
        };
        let programs_before = match (&applied, &left_in_the_tries) {
            (Some(before), _) => Some(self.for_the_programs(before)),
            (None, Some(left)) => Some(std::borrow::Cow::Borrowed(left)),
            (None, None) => None,
        };
        if let Some(before) = &programs_before
            && before.may_masquerade_more(&for_the_programs)
        {
            conntrack::keep_pod_flows(&mut self.maps.nat, before, &for_the_programs);
        }
        drop(programs_before);
        self.applied = applied;
        let changed = self
            .maps
            .policy
            .sync(&for_the_programs, &mut self.maps.settings)?;
        if first {
            // The programs' policy: flows it leaves alone would only stray.
            let (ports, spans) = (&self.node_ports, &self.port_spans);
            conntrack::hold_known_node_flows(
                &mut self.maps.nat,
                &for_the_programs,
                |proto, port| ports.reservable(spans, proto, port),
            );
        }
        let followed = self.follow_devices(policy)?;
        // The old programs have handed over their links: what they created meanwhile too.
        std::mem::take(&mut self.carried).copy_into(&mut self.maps);
        // The reduced chain goes in only once the programs run, so that no new flow is left
        // untranslated in between.
        let chain = self.chain.apply(policy)?;
        if first {
            self.settled = Some(std::time::Instant::now());
        }
        self.applied = Some(policy.clone());
        Ok(if first || changed || followed.devices_changed {
            ApplyOutcome::Applied
        } else if followed.reattached || chain != ApplyOutcome::Unchanged {
            ApplyOutcome::Repaired
        } else {
            ApplyOutcome::Unchanged
        })
    }

    fn verify_next_apply(&mut self) {
        self.maps.policy.verify_next_sync();
        self.chain.verify_next_apply();
    }

    fn maintain(&mut self) -> anyhow::Result<Option<NatSweep>> {
        // Nothing is attached before the first apply has filled the non-masquerade tries.
        if let Some(policy) = self.applied.take() {
            let followed = self.follow_devices(&policy);
            self.applied = Some(policy);
            followed?;
        }
        // The chain beside the programs follows a chosen masquerade address too.
        self.chain.maintain()?;
        let sweep = self.sweeps.due();
        // After a change, as soon as the grace allows; then with the sweeps.
        if !self.maps.policy.strays.checked || sweep {
            self.maps
                .policy
                .check_strays(&self.maps.nat, strays::GRACE)?;
        }
        if !sweep {
            return Ok(None);
        }
        self.hold_node_ports()?;
        if let Err(err) = self.programs.keep_the_tick() {
            tracing::warn!("the programs' tick could not be checked: {err:#}");
        }
        let now = flow_table::monotonic_now_ns();
        let drain = self.timeouts.tcp_established;
        self.maps.policy.expire_draining(drain, now)?;
        let (nat, samples) = (&self.maps.nat, &self.maps.drop_samples);
        // The ports entries hold on the node's side, asked of the sweep.
        let mut node_side = node_ports::NodeSidePorts::new(&self.port_spans);
        let read_at = std::time::Instant::now();
        let timeouts = &self.timeouts;
        let mut kernel = self.programs.kernel_sweep(&mut self.maps.sweep);
        let v4 = kernel_sweep::sweep(
            kernel.as_mut(),
            &nat.v4,
            Some(&samples.v4),
            timeouts,
            now,
            &mut node_side,
        )?;
        let v6 = kernel_sweep::sweep(
            kernel.as_mut(),
            &nat.v6,
            Some(&samples.v6),
            timeouts,
            now,
            &mut node_side,
        )?;
        if [v4, v6]
            .iter()
            .any(|run| run.expired_flows + run.orphans_removed > 0)
        {
            tracing::debug!(?v4, ?v6, "expired NAT entries");
        }
        let run = NatSweep::of_tables_in_use(v4, v6, |family| self.families.contains(family));
        let node_ports::NodeSidePorts {
            all_in_spans, seen, ..
        } = node_side;
        // Until the programs have taken over and the flows are carried in, a carried flow may
        // still bring a port outside the spans.
        if all_in_spans && self.settled.is_some() && !self.node_ports.outside_spans_are_entryless()
        {
            self.node_ports.outside_spans_entryless(&self.port_spans);
        }
        self.node_ports.mark_entryless(
            &mut self.maps.entryless_ports,
            &seen,
            read_at,
            self.settled,
        )?;
        self.release_drained()?;
        self.clashes.say_new(&self.maps.counters);
        Ok(Some(run))
    }

    /// The agent that comes next, of whatever version, may change the tries before it knows
    /// of flows that outlived its policy: until one checks, packets are looked up again.
    fn leave(&mut self) {
        if let Err(err) = self.maps.policy.lower_strays_cleared() {
            tracing::warn!("leaving the NAT table looked up for every packet: {err:#}");
        }
    }

    fn status(&self) -> anyhow::Result<Status> {
        let mut status = read_back(self.chain.chain(), Some(&self.pins.dir))?;
        status.mode = Some(Mode::Ebpf);
        Ok(status)
    }

    fn cleanup(&mut self) -> anyhow::Result<()> {
        self.attachments.clear();
        cleanup::cleanup(&self.pins.dir)?;
        self.chain.cleanup()
    }
}

//! The NAT sweep in the kernel: the sweep program (masq-ebpf's `sweep`) judges each family's
//! table where it lies, with the rules of `expiry`, where the kernel has
//! `bpf_for_each_map_elem` (5.13). Reading the whole table out every sweep cost the agent most
//! of its CPU under churn; the program touches only what may be over, and, for a table under
//! pressure, points its drop sample as it walks. Elsewhere the agent sweeps in userspace
//! (`expiry::expire_seeing`).

use anyhow::{Context as _, bail};
use aya::{
    Pod,
    programs::{SchedClassifier, TestRun as _, TestRunOptions},
};
use masq_ebpf::{ETH_HLEN, FlowOwner, NatEntry, NatKey, SweepReport, program_names};

use super::{
    expiry::{self, Timeouts},
    flow_table,
    flow_table::NatTable,
    map_types::{DropSample, NatFamily, SweepMaps},
    node_ports::NodeSidePorts,
};
use crate::dataplane::nat_usage::NatUsage;

/// Set to `0` to sweep in userspace where the kernel could sweep (`1` to insist, which fails
/// the load where it cannot): for the tests of both ways.
pub const KERNEL_SWEEP_ENV: &str = "MASQ_AGENT_KERNEL_SWEEP";

/// Where the agent sweeps, as the kernel and the environment have it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sweeper {
    Userspace,
    /// In the kernel; in userspace if the kernel refuses the program.
    Kernel,
    /// In the kernel, or not at all: the environment insists.
    KernelOnly,
}

impl Sweeper {
    pub fn chosen() -> Sweeper {
        match std::env::var(KERNEL_SWEEP_ENV).as_deref() {
            Ok("1") => Sweeper::KernelOnly,
            Ok("0") => Sweeper::Userspace,
            _ if program_names::missing_helper(program_names::SWEEP).is_none() => Sweeper::Kernel,
            _ => Sweeper::Userspace,
        }
    }
}

/// Sweeps family `A`'s table as of `now_ns`: what it held and removed, as `expiry::expire`
/// reports it, and the ports the flows left hold on the node's side, into `node_side`. With
/// `kernel` where it is loaded, in userspace otherwise; a table that holds nothing is not
/// walked at all (`NatTable::holds_nothing`): the table of a family no pod uses, or every table
/// of an idle node.
///
/// A table under pressure also gets its drop sample pointed at its flows, if `sample` is
/// given, by the program as it walks the table: while the last sweep left the table under
/// pressure, by every sweep; and by a second walk after a sweep that finds it so.
pub fn sweep<A>(
    kernel: Option<&mut KernelSweep<'_>>,
    nat: &NatTable<A>,
    sample: Option<&DropSample<A>>,
    timeouts: &Timeouts,
    now_ns: u64,
    node_side: &mut NodeSidePorts,
) -> anyhow::Result<NatUsage>
where
    A: NatFamily,
    NatKey<A>: Pod,
    NatEntry<A>: Pod,
{
    // No walk is spent on pointing a sample the table does not look at.
    let sample = sample.filter(|_| nat.has_drop_sample());
    // Where the kernel cannot say, the table is walked: no sweep may be missed for it.
    let empty = nat.holds_nothing().unwrap_or_else(|err| {
        tracing::warn!("{err:#}");
        false
    });
    if empty {
        if let Some(kernel) = kernel {
            kernel.pressed.0[A::SWEEP_REPORT as usize] = false;
        }
        return Ok(NatUsage::default());
    }
    let walked = kernel.map(|kernel| {
        let point = kernel.pressed.0[A::SWEEP_REPORT as usize] && sample.is_some();
        kernel
            .run::<A>(timeouts, now_ns, point)
            .map(|report| (kernel, point, report))
    });
    let (kernel, point, report) = match walked {
        Some(Ok(walked)) => walked,
        failed => {
            if let Some(Err(err)) = failed {
                // No sweep may be missed for it: the table would fill.
                tracing::warn!("sweeping the NAT table in userspace this time: {err:#}");
            }
            return expiry::expire_seeing(nat, sample, timeouts, now_ns, |key, entry| {
                node_side.look(key, entry)
            });
        }
    };
    node_side.take_swept(&report.node_side_ports, report.ports_outside_spans);
    let mut usage = usage(&report);
    let left = report.entries_left() as usize;
    let pressed = left >= expiry::pressure_at(nat)?;
    kernel.pressed.0[A::SWEEP_REPORT as usize] = pressed;
    let mut pointed = point.then_some(report.pointed);
    if pressed && !point && sample.is_some() {
        // The sweep is done: a failed second walk leaves the sample to the next sweep's
        // one walk, which points it, as the table is left pressed.
        match kernel.run::<A>(timeouts, now_ns, true) {
            Ok(again) => {
                usage.expired_flows += again.expired_flows as usize;
                usage.orphans_removed += again.orphans_removed as usize;
                pointed = Some(again.pointed);
            }
            Err(err) => tracing::warn!("pointing the NAT table's drop sample: {err:#}"),
        }
    }
    if let Some(pointed) = pointed.filter(|_| pressed) {
        tracing::debug!(
            left,
            droppable = pointed.droppable,
            undroppable_placed = pointed.undroppable,
            "NAT table under pressure: drop sample pointed in the walk"
        );
    }
    Ok(usage)
}

/// Gives the programs the limits a flow is over by before any sweep runs: early drop takes a
/// full table's flow that is over before any other (masq-ebpf's `early_drop`), and reads them
/// from the sweep's order, which a kernel without the sweep program never gets from a sweep.
/// Each sweep in the kernel writes the order again, with its own time.
pub fn give_limits(maps: &mut SweepMaps, timeouts: &Timeouts) -> anyhow::Result<()> {
    maps.order
        .set(0, timeouts.sweep_order(flow_table::monotonic_now_ns()), 0)
        .context("giving the programs the flows' timeouts")
}

/// Per family, by its slot in the sweep's reports: whether its last sweep left its table under
/// pressure (`expiry::UNDER_PRESSURE_PERCENT`), so that the next points its drop sample in its
/// one walk.
#[derive(Default)]
pub struct LeftPressed([bool; 2]);

/// The loaded sweep program, with its maps.
pub struct KernelSweep<'a> {
    pub program: &'a mut SchedClassifier,
    pub maps: &'a mut SweepMaps,
    pub pressed: &'a mut LeftPressed,
}

impl KernelSweep<'_> {
    /// One run of the program over family `A`'s table: its report.
    /// `point_drop_sample`: the walk also points the drop sample at the flows it leaves
    /// (`SweepOrder::point_drop_sample`).
    pub fn run<A: NatFamily>(
        &mut self,
        timeouts: &Timeouts,
        now_ns: u64,
        point_drop_sample: bool,
    ) -> anyhow::Result<SweepReport> {
        let maps = &mut *self.maps;
        let order = timeouts.sweep_order(now_ns);
        let order = if point_drop_sample {
            order.pointing_the_drop_sample()
        } else {
            order
        };
        maps.order.set(0, order, 0).context("ordering the sweep")?;
        maps.reports
            .set(A::SWEEP_REPORT, SweepReport::default(), 0)
            .context("clearing the sweep's report")?;
        let run = self
            .program
            .test_run(TestRunOptions {
                data_in: Some(&frame(A::ETHERTYPE)),
                repeat: 1,
                ..TestRunOptions::new()
            })
            .context("running the sweep program")?;
        if run.return_value != 0 {
            bail!("the sweep program found no order or report to fill");
        }
        maps.reports
            .get(&A::SWEEP_REPORT, 0)
            .context("reading the sweep's report")
    }
}

/// A frame whose EtherType names the family to sweep: an Ethernet header, and room for the
/// family's header, which the kernel's test runner wants before it runs the program. The clock
/// probe reads none of it (`tick_clock`).
pub(super) fn frame(ethertype: u16) -> Vec<u8> {
    const LARGEST_IP_HEADER: usize = 40;
    let mut frame = vec![0; ETH_HLEN + LARGEST_IP_HEADER];
    frame[ETH_HLEN - 2..ETH_HLEN].copy_from_slice(&ethertype.to_be_bytes());
    frame
}

/// What the table held before the sweep, and what it removed, from the program's report.
fn usage(report: &SweepReport) -> NatUsage {
    let flows = |owner: FlowOwner| report.flows[owner as usize] as usize;
    NatUsage {
        entries: report.entries as usize,
        pod_flows: flows(FlowOwner::Pod),
        kept_flows: flows(FlowOwner::PodKept),
        node_flows: flows(FlowOwner::NodeTranslated) + flows(FlowOwner::NodeReserved),
        translated_flows: FlowOwner::ALL
            .into_iter()
            .filter(|owner| owner.translated())
            .map(flows)
            .sum(),
        expired_flows: report.expired_flows as usize,
        orphans_removed: report.orphans_removed as usize,
    }
}

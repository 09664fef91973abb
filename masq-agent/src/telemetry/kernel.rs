//! The eBPF data plane's own counters, read from the pinned maps at each scrape: the packet
//! counters, the NAT tables' capacities, and the policy's decisions per action. A read that fails,
//! or finds nothing pinned while the eBPF data plane is in force, is counted and logged: an
//! alert on these series must fire, not go quiet.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use masq_ebpf::Counter;
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
};

use crate::{
    dataplane::ebpf,
    policy::{Action, IpFamily},
};

/// The eBPF programs' per-CPU packet counters, summed, the NAT tables' capacities and the
/// decisions per action, read from the pinned maps at each scrape. Absent while another data
/// plane is in force.
#[derive(Debug)]
pub struct KernelCounters {
    bpffs: PathBuf,
    /// Whether the eBPF data plane is in force: then its counters must be there.
    ebpf_in_force: Arc<AtomicBool>,
    slot_actions: Mutex<ebpf::decisions::SlotActions>,
    read_errors: AtomicU64,
    /// The last failure logged: each is logged once when it starts, not at every scrape.
    last_error: Mutex<Option<String>>,
}

impl KernelCounters {
    pub fn new(bpffs: PathBuf, ebpf_in_force: Arc<AtomicBool>) -> KernelCounters {
        KernelCounters {
            bpffs,
            ebpf_in_force,
            slot_actions: Mutex::default(),
            read_errors: AtomicU64::new(0),
            last_error: Mutex::default(),
        }
    }

    /// What reading `what` gave: the value, or, having counted and logged why not, `None`.
    fn read<T>(&self, what: &str, read: anyhow::Result<Option<T>>) -> Option<T> {
        let failure = match read {
            Ok(Some(value)) => return Some(value),
            Ok(None) if !self.ebpf_in_force.load(Ordering::Relaxed) => return None,
            Ok(None) => format!(
                "reading {what}: the eBPF data plane is in force, but nothing is pinned under {}",
                self.bpffs.display()
            ),
            Err(err) => format!("reading {what}: {err:#}"),
        };
        self.read_errors.fetch_add(1, Ordering::Relaxed);
        let mut last = self.last_error.lock().unwrap_or_else(|e| e.into_inner());
        if last.as_deref() != Some(failure.as_str()) {
            tracing::warn!("{failure}; masq_agent_ebpf_counter_read_errors_total counts each");
            *last = Some(failure);
        }
        None
    }
}

/// Where each kernel counter is reported: metric name, help, and its label, if any, as the
/// counters' declaration in masq-ebpf says.
fn series(
    counter: Counter,
) -> (
    &'static str,
    &'static str,
    Option<(&'static str, &'static str)>,
) {
    let (metric, label) = counter.series();
    (metric.name, metric.help, label)
}

impl Collector for KernelCounters {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let counters = ebpf::status::read_kernel_counters(&self.bpffs);
        if let Some(counters) = self.read("the eBPF counters", counters) {
            encode_packets(&counters, &mut encoder)?;
        }
        let pins = ebpf::pins::Pins::new(&self.bpffs);
        let totals = match self.slot_actions.lock() {
            Ok(mut actions) => actions.totals(&pins),
            Err(_) => Ok(None),
        };
        if let Some(totals) = self.read("the decision counters", totals) {
            encode_decisions(totals, &mut encoder)?;
        }
        let errors = ConstCounter::new(self.read_errors.load(Ordering::Relaxed));
        errors.encode(encoder.encode_descriptor(
            "ebpf_counter_read_errors",
            "Scrapes that could not read the eBPF data plane's pinned counters while it was in force, or found them unreadable (the agent logs why)",
            None,
            errors.metric_type(),
        )?)
    }
}

/// The packet counters, and the NAT tables' capacities.
fn encode_packets(
    counters: &ebpf::status::KernelCounters,
    encoder: &mut DescriptorEncoder,
) -> Result<(), std::fmt::Error> {
    // One descriptor per metric, then each of its series.
    let mut names: Vec<&'static str> = Vec::new();
    for (counter, _) in &counters.packets {
        let (name, _, _) = series(*counter);
        if !names.contains(&name) {
            names.push(name);
        }
    }
    for name in names {
        let members: Vec<_> = counters
            .packets
            .iter()
            .filter(|(c, _)| series(*c).0 == name)
            .collect();
        let Some((first, _)) = members.first() else {
            continue;
        };
        let help = series(*first).1;
        let metric = ConstCounter::new(0u64);
        let mut family = encoder.encode_descriptor(name, help, None, metric.metric_type())?;
        for (counter, total) in members {
            match series(*counter).2 {
                Some(label) => {
                    ConstCounter::new(*total).encode(family.encode_family(&[label])?)?;
                }
                // A metric without labels has this one series.
                None => {
                    ConstCounter::new(*total).encode(family)?;
                    break;
                }
            }
        }
    }
    encode_nat_capacities(&counters.nat_capacities, encoder)
}

/// The capacity of each family's NAT table in use, a series each: a pod's new flow is refused
/// when its own family's table is full. A family that is off has no series.
fn encode_nat_capacities(
    capacities: &BTreeMap<IpFamily, u32>,
    encoder: &mut DescriptorEncoder,
) -> Result<(), std::fmt::Error> {
    let metric = ConstGauge::new(0i64);
    let mut family = encoder.encode_descriptor(
        "nat_capacity_entries",
        "Entries each address family's NAT table holds (two per flow)",
        None,
        metric.metric_type(),
    )?;
    for (ip_family, capacity) in capacities {
        let label = [("family", ip_family.label())];
        ConstGauge::new(i64::from(*capacity)).encode(family.encode_family(&label)?)?;
    }
    Ok(())
}

/// The policy's decisions per action: per prefix, 100 000 prefixes would be as many series;
/// `masq-agent status` names the busiest.
fn encode_decisions(
    totals: ebpf::decisions::DecisionTotals,
    encoder: &mut DescriptorEncoder,
) -> Result<(), std::fmt::Error> {
    let metric = ConstCounter::new(0u64);
    let mut family = encoder.encode_descriptor(
        "policy_decisions",
        "Packets of no known flow the policy decided, by action: a masqueraded flow once, a flow that keeps its address at every packet",
        None,
        metric.metric_type(),
    )?;
    for (action, total) in [
        (Action::Masquerade, totals.masquerade),
        (Action::NonMasquerade, totals.non_masquerade),
    ] {
        ConstCounter::new(total).encode(family.encode_family(&[("action", action.label())])?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use prometheus_client::registry::Registry;

    use super::*;

    /// The capacities as a scrape shows them.
    #[derive(Debug)]
    struct Capacities(BTreeMap<IpFamily, u32>);

    impl Collector for Capacities {
        fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
            encode_nat_capacities(&self.0, &mut encoder)
        }
    }

    fn scrape(capacities: &[(IpFamily, u32)]) -> String {
        let mut registry = Registry::default();
        let capacities = Capacities(capacities.iter().copied().collect());
        registry.register_collector(Box::new(capacities));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    }

    #[test]
    fn each_familys_nat_capacity_is_a_series_of_its_own() {
        let dual_stack = scrape(&[(IpFamily::Ipv4, 128), (IpFamily::Ipv6, 256)]);
        for series in [
            "nat_capacity_entries{family=\"ipv4\"} 128",
            "nat_capacity_entries{family=\"ipv6\"} 256",
        ] {
            assert!(dual_stack.lines().any(|l| l == series), "{dual_stack}");
        }
        let ipv4_only = scrape(&[(IpFamily::Ipv4, 128)]);
        assert!(!ipv4_only.contains("ipv6"), "IPv6 off: {ipv4_only}");
    }

    #[test]
    fn every_kernel_counter_has_a_series_of_its_own() {
        let mut seen = std::collections::HashSet::new();
        for counter in Counter::ALL {
            let (name, _, label) = series(counter);
            assert!(
                seen.insert((name, label)),
                "{counter:?} shares {name} {label:?}"
            );
        }
    }
}

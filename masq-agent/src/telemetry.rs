//! What the agent tells operators: Prometheus metrics, liveness and readiness, served on
//! `--metrics-addr` from a thread of its own, so that a sync loop stuck in a system call is
//! reported as stuck rather than as a probe that times out.
//!
//! The sync loop records what it does in `Telemetry` (atomics and prometheus-client metrics);
//! the packet counters are read from the pinned per-CPU map at scrape time.

mod http;

use std::{
    path::PathBuf,
    sync::{
        Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use masq_ebpf::{Counter, prefix_action};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric as _},
    metrics::{
        counter::{ConstCounter, Counter as PromCounter},
        family::Family,
        gauge::{ConstGauge, Gauge},
    },
    registry::Registry,
};

use crate::dataplane::{Mode, NatUsage, ebpf};

pub use http::serve;

/// The sync loop wakes every second for upkeep, and the longest apply (100 000 prefixes) takes
/// about a second: a loop silent for this long is stuck.
pub const STUCK_AFTER: Duration = Duration::from_secs(60);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FamilyLabel {
    family: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModeLabel {
    mode: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VersionLabel {
    version: &'static str,
}

/// How one sync ended, as the reload counter labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReloadResult {
    Success,
    Invalid,
    ApplyFailed,
}

impl ReloadResult {
    fn label(self) -> &'static str {
        match self {
            ReloadResult::Success => "success",
            ReloadResult::Invalid => "invalid",
            ReloadResult::ApplyFailed => "apply_failed",
        }
    }
}

pub struct Telemetry {
    registry: Registry,
    reloads: Family<ResultLabel, PromCounter>,
    last_success: Gauge<f64, AtomicU64>,
    prefixes: Family<FamilyLabel, Gauge>,
    mode: Family<ModeLabel, Gauge>,
    fallbacks: PromCounter,
    gc_runs: PromCounter,
    gc_expired: PromCounter,
    nat_entries: Gauge,
    nat_flows: Family<KindLabel, Gauge>,
    health: Health,
}

impl Telemetry {
    /// `bpffs` is where the eBPF data plane pins its counters, read at each scrape.
    pub fn new(bpffs: PathBuf) -> Telemetry {
        let mut registry = Registry::with_prefix("masq_agent");
        let reloads = Family::<ResultLabel, PromCounter>::default();
        registry.register(
            "config_reloads",
            "Syncs of the config file into the data plane, by result",
            reloads.clone(),
        );
        let last_success = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "last_successful_sync_timestamp_seconds",
            "When the data plane last matched a valid config (Unix time)",
            last_success.clone(),
        );
        let prefixes = Family::<FamilyLabel, Gauge>::default();
        registry.register(
            "non_masquerade_prefixes",
            "Prefixes in force that are not masqueraded, by address family",
            prefixes.clone(),
        );
        let mode = Family::<ModeLabel, Gauge>::default();
        registry.register(
            "dataplane_mode",
            "The data plane in use (1) and the others (0)",
            mode.clone(),
        );
        let fallbacks = PromCounter::default();
        registry.register(
            "fallback_events",
            "Times the agent fell back from eBPF to the full iptables chain",
            fallbacks.clone(),
        );
        let gc_runs = PromCounter::default();
        registry.register(
            "nat_gc_runs",
            "Sweeps of the NAT table for idle flows",
            gc_runs.clone(),
        );
        let gc_expired = PromCounter::default();
        registry.register(
            "nat_gc_expired_flows",
            "Idle flows the sweeps removed",
            gc_expired.clone(),
        );
        let nat_entries = Gauge::default();
        registry.register(
            "nat_entries",
            "Entries in the NAT table at the last sweep (two per flow)",
            nat_entries.clone(),
        );
        let nat_flows = Family::<KindLabel, Gauge>::default();
        registry.register(
            "nat_flows",
            "Flows in the NAT table at the last sweep: masqueraded, or opened from outside toward a pod",
            nat_flows.clone(),
        );
        let build_info = Family::<VersionLabel, Gauge>::default();
        build_info
            .get_or_create(&VersionLabel {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        registry.register("build_info", "The agent's version", build_info);
        registry.register_collector(Box::new(KernelCounters {
            bpffs,
            slot_actions: Mutex::default(),
        }));
        Telemetry {
            registry,
            reloads,
            last_success,
            prefixes,
            mode,
            fallbacks,
            gc_runs,
            gc_expired,
            nat_entries,
            nat_flows,
            health: Health::new(),
        }
    }

    /// Records the end of one sync; `prefixes` are the (v4, v6) counts in force after it.
    pub fn synced(&self, result: ReloadResult, prefixes: Option<(usize, usize)>) {
        self.reloads
            .get_or_create(&ResultLabel {
                result: result.label(),
            })
            .inc();
        if result == ReloadResult::Success {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default();
            self.last_success.set(now.as_secs_f64());
            self.health.ready.store(true, Ordering::Relaxed);
        }
        if let Some((v4, v6)) = prefixes {
            for (family, count) in [("ipv4", v4), ("ipv6", v6)] {
                self.prefixes
                    .get_or_create(&FamilyLabel { family })
                    .set(count as i64);
            }
        }
    }

    /// Records the data plane in use; `fell_back` when it replaced the eBPF one.
    pub fn mode(&self, mode: Mode, fell_back: bool) {
        for candidate in [Mode::Ebpf, Mode::Iptables, Mode::IptablesFallback] {
            self.mode
                .get_or_create(&ModeLabel {
                    mode: candidate.label(),
                })
                .set(i64::from(candidate == mode));
        }
        if fell_back {
            self.fallbacks.inc();
        }
    }

    pub fn nat_swept(&self, usage: NatUsage) {
        self.gc_runs.inc();
        self.gc_expired.inc_by(usage.expired_flows as u64);
        self.nat_entries.set(usage.entries as i64);
        for (kind, flows) in [
            ("masqueraded", usage.masqueraded_flows),
            ("inbound", usage.inbound_flows),
            ("node", usage.node_flows),
        ] {
            self.nat_flows
                .get_or_create(&KindLabel { kind })
                .set(flows as i64);
        }
    }

    /// Records that the sync loop is alive.
    pub fn heartbeat(&self) {
        self.health.beat();
    }

    /// Records how the data plane's last `check` went: `None` if well, otherwise why not.
    pub fn dataplane_checked(&self, check: Check, problem: Option<String>) {
        let slot = match check {
            Check::Apply => &self.health.apply_problem,
            Check::Upkeep => &self.health.upkeep_problem,
        };
        *slot.lock().unwrap_or_else(|e| e.into_inner()) = problem;
    }

    /// `None` when live; otherwise why not.
    pub fn liveness_problem(&self) -> Option<String> {
        self.liveness_problem_at(Instant::now())
    }

    fn liveness_problem_at(&self, now: Instant) -> Option<String> {
        let silent = self.health.since_beat(now);
        if silent > STUCK_AFTER {
            return Some(format!(
                "the sync loop has not run for {}s",
                silent.as_secs()
            ));
        }
        [&self.health.apply_problem, &self.health.upkeep_problem]
            .iter()
            .find_map(|slot| slot.lock().unwrap_or_else(|e| e.into_inner()).clone())
    }

    pub fn is_ready(&self) -> bool {
        self.health.ready.load(Ordering::Relaxed)
    }

    /// The metrics in the OpenMetrics text format.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(err) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!("encoding metrics: {err}");
        }
        out
    }
}

struct Health {
    started: Instant,
    /// Milliseconds after `started` of the last heartbeat.
    last_beat_ms: AtomicU64,
    ready: AtomicBool,
    apply_problem: Mutex<Option<String>>,
    upkeep_problem: Mutex<Option<String>>,
}

/// The two ways the sync loop finds out whether the data plane is in place: applying the
/// policy, and the periodic upkeep (which puts back detached programs). Each clears only its
/// own finding, so that one going well does not hide the other failing.
#[derive(Debug, Clone, Copy)]
pub enum Check {
    Apply,
    Upkeep,
}

impl Health {
    fn new() -> Health {
        Health {
            started: Instant::now(),
            last_beat_ms: AtomicU64::new(0),
            ready: AtomicBool::new(false),
            apply_problem: Mutex::new(None),
            upkeep_problem: Mutex::new(None),
        }
    }

    fn beat(&self) {
        let now = self.started.elapsed().as_millis() as u64;
        self.last_beat_ms.store(now, Ordering::Relaxed);
    }

    fn since_beat(&self, now: Instant) -> Duration {
        let last = Duration::from_millis(self.last_beat_ms.load(Ordering::Relaxed));
        now.saturating_duration_since(self.started)
            .saturating_sub(last)
    }
}

/// The eBPF programs' per-CPU packet counters, summed, and the NAT table's capacity, read from
/// the pinned maps at each scrape. Absent when the eBPF data plane is not in use.
#[derive(Debug)]
struct KernelCounters {
    bpffs: PathBuf,
    slot_actions: Mutex<ebpf::decisions::SlotActions>,
}

/// Where each kernel counter is reported: metric name, help, and its label, if any.
fn series(
    counter: Counter,
) -> (
    &'static str,
    &'static str,
    Option<(&'static str, &'static str)>,
) {
    const NOT_MASQUERADED: &str = "packets_not_masqueraded";
    const NOT_MASQUERADED_HELP: &str = "Egress packets left with their source address, by reason";
    const DROPPED: &str = "packets_dropped";
    const DROPPED_HELP: &str = "Packets the data plane dropped, by reason";
    const REVERSED: &str = "packets_reverse_translated";
    const REVERSED_HELP: &str = "Ingress packets given back the pod's address, by kind";
    match counter {
        Counter::Masqueraded => (
            "packets_masqueraded",
            "Egress packets whose source became the node's address",
            None,
        ),
        Counter::NotMasqNonMasqDestination => (
            NOT_MASQUERADED,
            NOT_MASQUERADED_HELP,
            Some(("reason", "non_masq_destination")),
        ),
        Counter::NotMasqNodeSource => (
            NOT_MASQUERADED,
            NOT_MASQUERADED_HELP,
            Some(("reason", "node_source")),
        ),
        Counter::NotMasqOtherProtocol => (
            NOT_MASQUERADED,
            NOT_MASQUERADED_HELP,
            Some(("reason", "other_protocol")),
        ),
        Counter::NotMasqInbound => (
            NOT_MASQUERADED,
            NOT_MASQUERADED_HELP,
            Some(("reason", "inbound_connection")),
        ),
        Counter::NotMasqIcmpOther => (
            NOT_MASQUERADED,
            NOT_MASQUERADED_HELP,
            Some(("reason", "icmp_other")),
        ),
        Counter::ReverseTranslated => (REVERSED, REVERSED_HELP, Some(("kind", "reply"))),
        Counter::IcmpErrorTranslated => (REVERSED, REVERSED_HELP, Some(("kind", "icmp_error"))),
        Counter::IcmpErrorMasqueraded => (
            "icmp_errors_masqueraded",
            "Egress ICMP errors about masqueraded flows, translated inside and out as conntrack translates a related error",
            None,
        ),
        Counter::NodePortClash => (
            "node_port_clashes",
            "Flows of the node's own address (its sockets, or netfilter's NAT) whose tuple a masqueraded flow held: given another port, as conntrack resolves a clash",
            None,
        ),
        Counter::NatFlowsNotCarried => (
            "nat_flows_not_carried",
            "Flows of a replaced NAT table (an upgrade, another --nat-capacity) that did not fit into the new one",
            None,
        ),
        Counter::TcpRstNotAcceptable => (
            "tcp_resets_not_acceptable",
            "TCP RSTs whose sequence number the receiving end would not accept; the flow keeps its state",
            None,
        ),
        Counter::InboundTracked => (
            "inbound_connections_tracked",
            "Connections opened from outside toward a pod, first seen",
            None,
        ),
        Counter::AllocationFailed => (
            "nat_allocation_failures",
            "New flows for which no free NAT port was found",
            None,
        ),
        Counter::DropPortsExhausted => (DROPPED, DROPPED_HELP, Some(("reason", "ports_exhausted"))),
        Counter::DropNatTableFull => (DROPPED, DROPPED_HELP, Some(("reason", "nat_table_full"))),
        Counter::DropFragment => (DROPPED, DROPPED_HELP, Some(("reason", "fragment"))),
        Counter::DropRewriteFailed => (DROPPED, DROPPED_HELP, Some(("reason", "rewrite_failed"))),
        Counter::DropExtensionHeaders => {
            (DROPPED, DROPPED_HELP, Some(("reason", "extension_headers")))
        }
        Counter::NotInspected => (
            "packets_not_inspected",
            "Packets the programs passed without a look: not IP, malformed, or before the agent configured them",
            None,
        ),
    }
}

impl Collector for KernelCounters {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let counters = match ebpf::status::read_kernel_counters(&self.bpffs) {
            Ok(Some(counters)) => counters,
            Ok(None) => return Ok(()),
            Err(err) => {
                tracing::debug!("reading the eBPF counters: {err:#}");
                return Ok(());
            }
        };
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
        let capacity = ConstGauge::new(i64::from(counters.nat_capacity));
        capacity.encode(encoder.encode_descriptor(
            "nat_capacity_entries",
            "Entries the NAT table holds (two per flow)",
            None,
            capacity.metric_type(),
        )?)?;
        self.encode_decisions(&mut encoder)
    }
}

impl KernelCounters {
    /// The policy's decisions per action: per prefix, 100 000 prefixes would be as many
    /// series; `masq-agent status` names the busiest.
    fn encode_decisions(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let pins = ebpf::pins::Pins::new(&self.bpffs);
        let totals = match self.slot_actions.lock() {
            Ok(mut actions) => actions.totals(&pins),
            Err(_) => return Ok(()),
        };
        let totals = match totals {
            Ok(Some(totals)) => totals,
            Ok(None) => return Ok(()),
            Err(err) => {
                tracing::debug!("reading the decision counters: {err:#}");
                return Ok(());
            }
        };
        let metric = ConstCounter::new(0u64);
        let mut family = encoder.encode_descriptor(
            "policy_decisions",
            "Packets of no known flow the policy decided, by action: a masqueraded flow once, a flow that keeps its address at every packet",
            None,
            metric.metric_type(),
        )?;
        let name = ebpf::decisions::action_name;
        for (action, total) in [
            (name(prefix_action::MASQUERADE), totals.masquerade),
            (name(prefix_action::NON_MASQUERADE), totals.non_masquerade),
        ] {
            ConstCounter::new(total).encode(family.encode_family(&[("action", action)])?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn telemetry() -> Telemetry {
        Telemetry::new(PathBuf::from("/nonexistent/masq-agent-test"))
    }

    /// The value of the series whose line starts with `series` (name and labels).
    fn value(metrics: &str, series: &str) -> Option<f64> {
        metrics.lines().find_map(|line| {
            let rest = line.strip_prefix(series)?.strip_prefix(' ')?;
            rest.parse().ok()
        })
    }

    #[test]
    fn sync_results_are_counted_by_result_with_the_prefixes_in_force() {
        let t = telemetry();
        t.synced(ReloadResult::Success, Some((3, 1)));
        t.synced(ReloadResult::Invalid, Some((3, 1)));
        t.synced(ReloadResult::Invalid, Some((3, 1)));
        let m = t.encode();
        let reloads = |result: &str| {
            value(
                &m,
                &format!("masq_agent_config_reloads_total{{result=\"{result}\"}}"),
            )
        };
        assert_eq!(reloads("success"), Some(1.0));
        assert_eq!(reloads("invalid"), Some(2.0));
        assert_eq!(reloads("apply_failed"), None);
        assert_eq!(
            value(&m, "masq_agent_non_masquerade_prefixes{family=\"ipv4\"}"),
            Some(3.0)
        );
        assert_eq!(
            value(&m, "masq_agent_non_masquerade_prefixes{family=\"ipv6\"}"),
            Some(1.0)
        );
        let last = value(&m, "masq_agent_last_successful_sync_timestamp_seconds").unwrap();
        assert!(last > 1.7e9, "a Unix time, not {last}");
    }

    #[test]
    fn readiness_waits_for_the_first_successful_sync() {
        let t = telemetry();
        assert!(!t.is_ready());
        t.synced(ReloadResult::Invalid, None);
        assert!(!t.is_ready());
        t.synced(ReloadResult::Success, Some((1, 0)));
        assert!(t.is_ready());
        t.synced(ReloadResult::ApplyFailed, Some((1, 0)));
        assert!(t.is_ready(), "readiness is about having synced once");
    }

    #[test]
    fn a_silent_loop_or_a_data_plane_problem_fails_liveness() {
        let t = telemetry();
        t.heartbeat();
        let now = Instant::now();
        assert_eq!(t.liveness_problem_at(now), None);
        let later = now + STUCK_AFTER + Duration::from_secs(1);
        let problem = t.liveness_problem_at(later).expect("stuck");
        assert!(problem.contains("sync loop"), "{problem}");

        t.dataplane_checked(Check::Upkeep, Some("eth0 is gone".into()));
        assert_eq!(t.liveness_problem_at(now).as_deref(), Some("eth0 is gone"));
        t.dataplane_checked(Check::Apply, None);
        assert_eq!(
            t.liveness_problem_at(now).as_deref(),
            Some("eth0 is gone"),
            "a good apply does not hide a failed upkeep"
        );
        t.dataplane_checked(Check::Upkeep, None);
        assert_eq!(t.liveness_problem_at(now), None);
    }

    #[test]
    fn the_mode_gauge_marks_one_mode_and_fallbacks_are_counted() {
        let t = telemetry();
        t.mode(Mode::Ebpf, false);
        t.mode(Mode::IptablesFallback, true);
        let m = t.encode();
        let mode = |name: &str| value(&m, &format!("masq_agent_dataplane_mode{{mode=\"{name}\"}}"));
        assert_eq!(mode("ebpf"), Some(0.0));
        assert_eq!(mode("iptables"), Some(0.0));
        assert_eq!(mode("iptables-fallback"), Some(1.0));
        assert_eq!(value(&m, "masq_agent_fallback_events_total"), Some(1.0));
        let version = format!(
            "masq_agent_build_info{{version=\"{}\"}}",
            env!("CARGO_PKG_VERSION")
        );
        assert_eq!(value(&m, &version), Some(1.0));
    }

    #[test]
    fn nat_sweeps_set_the_table_gauges_and_add_up_expiries() {
        let t = telemetry();
        let usage = NatUsage {
            entries: 10,
            masqueraded_flows: 4,
            inbound_flows: 1,
            node_flows: 3,
            translated_flows: 4,
            expired_flows: 2,
            orphans_removed: 0,
        };
        t.nat_swept(usage);
        t.nat_swept(NatUsage {
            expired_flows: 3,
            ..usage
        });
        let m = t.encode();
        assert_eq!(value(&m, "masq_agent_nat_gc_runs_total"), Some(2.0));
        assert_eq!(
            value(&m, "masq_agent_nat_gc_expired_flows_total"),
            Some(5.0)
        );
        assert_eq!(value(&m, "masq_agent_nat_entries"), Some(10.0));
        assert_eq!(
            value(&m, "masq_agent_nat_flows{kind=\"masqueraded\"}"),
            Some(4.0)
        );
        assert_eq!(
            value(&m, "masq_agent_nat_flows{kind=\"inbound\"}"),
            Some(1.0)
        );
        assert_eq!(value(&m, "masq_agent_nat_flows{kind=\"node\"}"), Some(3.0));
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

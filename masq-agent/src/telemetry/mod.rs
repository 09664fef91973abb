//! What the agent tells operators: Prometheus metrics, liveness and readiness, served on
//! `--metrics-addr` from a thread of its own, so that a sync loop stuck in a system call is
//! reported as stuck rather than as a probe that times out.
//!
//! The sync loop records what it does in `Telemetry` (atomics and prometheus-client metrics);
//! the eBPF data plane's counters (`kernel`) and the process's (`process`) are read at scrape
//! time.

mod http;
mod kernel;
mod process;

use std::{
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{
        counter::Counter as PromCounter, family::Family, gauge::Gauge, histogram::Histogram,
    },
    registry::{Registry, Unit},
};

use self::{kernel::KernelCounters, process::ProcessMetrics};
use crate::{
    dataplane::{FlowKind, Mode, NatSweep},
    policy::IpFamily,
};

pub use http::{Answers, Endpoints, serve};

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
struct FamilyKindLabel {
    family: &'static str,
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
    nat_entries: Family<FamilyLabel, Gauge>,
    nat_flows: Family<FamilyKindLabel, Gauge>,
    apply_duration: Histogram,
    masquerade_address_in_use: Family<FamilyLabel, Gauge>,
    /// Whether the eBPF data plane is in force, for the collector of its counters.
    ebpf_in_force: Arc<AtomicBool>,
    health: Health,
}

/// Seconds: an unchanged policy applies in a millisecond or so, 100 000 prefixes in about one
/// second.
const APPLY_BUCKETS: [f64; 11] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

impl Telemetry {
    /// `bpffs` is where the eBPF data plane pins its counters, read at each scrape.
    pub fn new(bpffs: PathBuf) -> Telemetry {
        // The process metrics under their usual names; the agent's own under its prefix.
        let mut root = Registry::default();
        root.register_collector(Box::new(ProcessMetrics));
        let registry = root.sub_registry_with_prefix("masq_agent");
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
        let nat_entries = Family::<FamilyLabel, Gauge>::default();
        registry.register(
            "nat_entries",
            "Entries in each address family's NAT table at the last sweep (two per flow)",
            nat_entries.clone(),
        );
        let nat_flows = Family::<FamilyKindLabel, Gauge>::default();
        registry.register(
            "nat_flows",
            "Flows in each address family's NAT table at the last sweep, by kind: the pods' masqueraded, the pods' that keep their address, the node's own",
            nat_flows.clone(),
        );
        let build_info = Family::<VersionLabel, Gauge>::default();
        build_info
            .get_or_create(&VersionLabel {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        registry.register("build_info", "The agent's version", build_info);
        let apply_duration = Histogram::new(APPLY_BUCKETS);
        registry.register_with_unit(
            "apply_duration",
            "How long applying the policy to the data plane took, at each sync",
            Unit::Seconds,
            apply_duration.clone(),
        );
        let masquerade_address_in_use = Family::<FamilyLabel, Gauge>::default();
        registry.register(
            "masquerade_address_in_use",
            "By address family: 1 while masqueraded traffic takes the chosen masqueradeAddress, 0 while it takes the outgoing device's (no address named, or the node does not hold it)",
            masquerade_address_in_use.clone(),
        );
        for family in IpFamily::ALL {
            masquerade_address_in_use
                .get_or_create(&FamilyLabel {
                    family: family.label(),
                })
                .set(0);
        }
        let ebpf_in_force = Arc::new(AtomicBool::new(false));
        registry.register_collector(Box::new(KernelCounters::new(bpffs, ebpf_in_force.clone())));
        Telemetry {
            registry: root,
            apply_duration,
            ebpf_in_force,
            reloads,
            last_success,
            prefixes,
            mode,
            fallbacks,
            gc_runs,
            gc_expired,
            nat_entries,
            nat_flows,
            masquerade_address_in_use,
            health: Health::new(),
        }
    }

    /// Records whether `family`'s masqueraded traffic takes a chosen masquerade address.
    pub fn masquerade_address(&self, family: IpFamily, in_use: bool) {
        self.masquerade_address_in_use
            .get_or_create(&FamilyLabel {
                family: family.label(),
            })
            .set(i64::from(in_use));
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
            for (family, count) in [(IpFamily::Ipv4, v4), (IpFamily::Ipv6, v6)] {
                self.prefixes
                    .get_or_create(&FamilyLabel {
                        family: family.label(),
                    })
                    .set(count as i64);
            }
        }
    }

    /// Records how long one apply took, whatever came of it.
    pub fn applied(&self, took: Duration) {
        self.apply_duration.observe(took.as_secs_f64());
    }

    /// Records the data plane put in force: a fallback is counted as one.
    pub fn mode(&self, mode: Mode) {
        self.ebpf_in_force
            .store(mode == Mode::Ebpf, Ordering::Relaxed);
        for candidate in Mode::ALL {
            self.mode
                .get_or_create(&ModeLabel {
                    mode: candidate.label(),
                })
                .set(i64::from(candidate == mode));
        }
        if mode == Mode::IptablesFallback {
            self.fallbacks.inc();
        }
    }

    /// Records a sweep of the NAT tables: each family's table has series of its own, as a
    /// pod's new flow is refused when its own family's is full.
    pub fn nat_swept(&self, sweep: &NatSweep) {
        self.gc_runs.inc();
        self.gc_expired.inc_by(sweep.expired_flows() as u64);
        for (family, usage) in &sweep.tables {
            let family = family.label();
            self.nat_entries
                .get_or_create(&FamilyLabel { family })
                .set(usage.entries as i64);
            for (kind, flows) in [
                (FlowKind::Pod, usage.pod_flows),
                (FlowKind::Kept, usage.kept_flows),
                (FlowKind::Node, usage.node_flows),
            ] {
                let kind = kind.label();
                self.nat_flows
                    .get_or_create(&FamilyKindLabel { family, kind })
                    .set(flows as i64);
            }
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
}

impl Answers for Telemetry {
    /// The metrics in the OpenMetrics text format.
    fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(err) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::warn!("encoding metrics: {err}");
        }
        out
    }

    /// `None` when live; otherwise why not.
    fn liveness_problem(&self) -> Option<String> {
        self.liveness_problem_at(Instant::now())
    }

    fn is_ready(&self) -> bool {
        self.health.ready.load(Ordering::Relaxed)
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
    fn applies_are_timed_in_a_histogram() {
        let t = telemetry();
        t.applied(Duration::from_millis(3));
        t.applied(Duration::from_millis(700));
        let m = t.encode();
        let bucket = |le: &str| {
            value(
                &m,
                &format!("masq_agent_apply_duration_seconds_bucket{{le=\"{le}\"}}"),
            )
        };
        assert_eq!(bucket("0.0025"), Some(0.0));
        assert_eq!(bucket("0.005"), Some(1.0));
        assert_eq!(bucket("1.0"), Some(2.0));
        assert_eq!(
            value(&m, "masq_agent_apply_duration_seconds_count"),
            Some(2.0)
        );
    }

    #[test]
    fn the_process_metrics_have_their_usual_names() {
        let m = telemetry().encode();
        for series in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_virtual_memory_bytes",
            "process_start_time_seconds",
            "process_open_fds",
            "process_max_fds",
        ] {
            assert!(value(&m, series).is_some(), "{series} in:\n{m}");
        }
    }

    #[test]
    fn unreadable_ebpf_counters_are_counted_while_the_ebpf_data_plane_is_in_force() {
        let t = telemetry();
        let errors = |m: &str| value(m, "masq_agent_ebpf_counter_read_errors_total");
        t.mode(Mode::Iptables);
        assert_eq!(errors(&t.encode()), Some(0.0), "nothing to read: no error");
        t.mode(Mode::Ebpf);
        let m = t.encode();
        assert_eq!(
            errors(&m),
            Some(2.0),
            "the packet and decision counters: {m}"
        );
        assert!(value(&m, "masq_agent_packets_masqueraded_total").is_none());
        assert_eq!(
            errors(&t.encode()),
            Some(4.0),
            "every scrape that fails counts"
        );
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
    fn the_masquerade_address_gauge_says_whether_the_chosen_address_is_taken() {
        let t = telemetry();
        let series =
            |family: &str| format!("masq_agent_masquerade_address_in_use{{family=\"{family}\"}}");
        assert_eq!(
            value(&t.encode(), &series("ipv6")),
            Some(0.0),
            "from the start"
        );
        t.masquerade_address(IpFamily::Ipv4, true);
        assert_eq!(value(&t.encode(), &series("ipv4")), Some(1.0));
        t.masquerade_address(IpFamily::Ipv4, false);
        assert_eq!(value(&t.encode(), &series("ipv4")), Some(0.0));
    }

    #[test]
    fn the_mode_gauge_marks_one_mode_and_fallbacks_are_counted() {
        let t = telemetry();
        t.mode(Mode::Ebpf);
        t.mode(Mode::IptablesFallback);
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
    fn nat_sweeps_set_each_familys_table_gauges_and_add_up_expiries() {
        use crate::{dataplane::NatUsage, policy::IpFamily};

        let t = telemetry();
        // IPv4's table full (64 flows of a 128-entry table), IPv6's empty.
        let full = NatUsage {
            entries: 128,
            pod_flows: 60,
            kept_flows: 1,
            node_flows: 3,
            translated_flows: 60,
            expired_flows: 2,
            orphans_removed: 0,
        };
        let empty = NatUsage {
            expired_flows: 1,
            ..NatUsage::default()
        };
        let sweep = NatSweep::of_tables_in_use(full, empty, |_| true);
        t.nat_swept(&sweep);
        t.nat_swept(&sweep);
        let m = t.encode();
        assert_eq!(value(&m, "masq_agent_nat_gc_runs_total"), Some(2.0));
        assert_eq!(
            value(&m, "masq_agent_nat_gc_expired_flows_total"),
            Some(6.0)
        );
        let entries = |family: &str| {
            value(
                &m,
                &format!("masq_agent_nat_entries{{family=\"{family}\"}}"),
            )
        };
        assert_eq!(entries("ipv4"), Some(128.0), "{m}");
        assert_eq!(entries("ipv6"), Some(0.0), "{m}");
        assert!(
            value(&m, "masq_agent_nat_entries").is_none(),
            "no series over both families: {m}"
        );
        let flows = |family: &str, kind: &str| {
            let series = format!("masq_agent_nat_flows{{family=\"{family}\",kind=\"{kind}\"}}");
            value(&m, &series)
        };
        assert_eq!(flows("ipv4", "pod"), Some(60.0));
        assert_eq!(flows("ipv4", "kept"), Some(1.0));
        assert_eq!(flows("ipv4", "node"), Some(3.0));
        assert_eq!(flows("ipv6", "pod"), Some(0.0));

        // A family that is off has no series.
        let t = telemetry();
        t.nat_swept(&NatSweep::of_tables_in_use(full, empty, |family| {
            family == IpFamily::Ipv4
        }));
        let m = t.encode();
        let ipv6_nat = |line: &&str| line.starts_with("masq_agent_nat_") && line.contains("ipv6");
        assert_eq!(m.lines().find(ipv6_nat), None, "{m}");
    }
}

//! What `cargo xtask bench` measures and what it measured: the command line, the plan it makes
//! of it, the modes, metrics and load shapes, and the samples, which `bench` takes and `report`
//! writes out.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use masq_testbed::load::{Shape, Tuples};
use serde::Serialize;

use crate::node_tables::{Family, Node};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, PartialOrd, Ord, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// No NAT on a node without kube-proxy's table: the ceiling of earlier reports.
    NoNatBare,
    /// No NAT on a realistic node: the ceiling every NAT mode is compared against.
    NoNat,
    IptablesNft,
    IptablesLegacy,
    Ebpf,
    /// The eBPF data plane on a node whose tables (kube-proxy's, and the agent's reduced
    /// chain) are in the legacy backend: what `IptablesLegacy` is measured against.
    EbpfLegacy,
    /// The eBPF data plane with the halves in the kernel's hash tables
    /// (`MASQ_AGENT_SLOT_TABLE=0`), as a kernel before 5.12 keeps them, where `Ebpf` keeps them
    /// in the slot table: measured only when named (`--modes`), against `Ebpf`.
    EbpfHashTable,
}

impl Mode {
    pub const ALL: [Mode; 6] = [
        Mode::NoNatBare,
        Mode::NoNat,
        Mode::IptablesNft,
        Mode::IptablesLegacy,
        Mode::Ebpf,
        Mode::EbpfLegacy,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mode::NoNatBare => "no NAT, bare node",
            Mode::NoNat => "no NAT",
            Mode::IptablesNft => "iptables (nft)",
            Mode::IptablesLegacy => "iptables (legacy)",
            Mode::Ebpf => "ebpf",
            Mode::EbpfLegacy => "ebpf (legacy node)",
            Mode::EbpfHashTable => "ebpf (hash table)",
        }
    }

    /// Whether the eBPF programs translate in this mode.
    pub fn is_ebpf(self) -> bool {
        matches!(self, Mode::Ebpf | Mode::EbpfLegacy | Mode::EbpfHashTable)
    }

    /// What the mode's agent finds in its environment besides `PATH`.
    pub fn agent_env(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Mode::EbpfHashTable => &[("MASQ_AGENT_SLOT_TABLE", "0")],
            _ => &[],
        }
    }

    /// The iptables mode of the same backend, which an eBPF mode is measured against fairly:
    /// the node's own tables cost the same in both.
    pub fn same_backend_iptables(self) -> Mode {
        match self.backend() {
            "legacy" => Mode::IptablesLegacy,
            _ => Mode::IptablesNft,
        }
    }

    /// iptables chains of 100 000 rules are past what the comparison needs to show.
    pub fn runs_at(self, cidrs: usize) -> bool {
        cidrs <= 10_000 || !self.runs_iptables_chain()
    }

    pub fn runs_iptables_chain(self) -> bool {
        matches!(self, Mode::IptablesNft | Mode::IptablesLegacy)
    }

    /// Whether an agent masquerades in this mode; without one, the outside host routes back.
    pub fn masquerades(self) -> bool {
        !matches!(self, Mode::NoNatBare | Mode::NoNat)
    }

    /// What the node holds besides the data plane under test.
    pub fn node(self) -> Node {
        match self {
            Mode::NoNatBare => Node::Bare,
            _ => Node::KubeProxy,
        }
    }

    /// The iptables backend of everything this mode writes, node tables included: one
    /// namespace never holds both backends' tables.
    pub fn backend(self) -> &'static str {
        match self {
            Mode::IptablesLegacy | Mode::EbpfLegacy => "legacy",
            _ => "nft",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, PartialOrd, Ord, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    NewConnections,
    Transactions,
    Throughput,
    UdpNewFlows,
    NodeOutboundConnections,
    NodeInboundConnections,
    NewConnectionsV6,
    UdpNewFlowsV6,
    ClusterConnections,
    ClusterTransactions,
}

impl Metric {
    pub const ALL: [Metric; 10] = [
        Metric::NewConnections,
        Metric::Transactions,
        Metric::Throughput,
        Metric::UdpNewFlows,
        Metric::NodeOutboundConnections,
        Metric::NodeInboundConnections,
        Metric::NewConnectionsV6,
        Metric::UdpNewFlowsV6,
        Metric::ClusterConnections,
        Metric::ClusterTransactions,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Metric::NewConnections => "new TCP connections/s",
            Metric::Transactions => "TCP transactions/s",
            Metric::Throughput => "TCP bulk Gbit/s",
            Metric::UdpNewFlows => "UDP new flows/s",
            Metric::NodeOutboundConnections => "node's own new TCP connections/s, outbound",
            Metric::NodeInboundConnections => "new TCP connections/s to a node server, inbound",
            Metric::NewConnectionsV6 => "new TCP connections/s over IPv6",
            Metric::UdpNewFlowsV6 => "UDP new flows/s over IPv6",
            Metric::ClusterConnections => "new TCP connections/s to the cluster",
            Metric::ClusterTransactions => "TCP transactions/s to the cluster",
        }
    }

    pub fn traffic(self) -> Traffic {
        match self {
            Metric::NodeOutboundConnections => Traffic::NodeToOutside,
            Metric::NodeInboundConnections => Traffic::OutsideToNode,
            Metric::NewConnectionsV6 | Metric::UdpNewFlowsV6 => Traffic::PodToOutsideV6,
            Metric::ClusterConnections | Metric::ClusterTransactions => Traffic::PodToCluster,
            _ => Traffic::PodToOutside,
        }
    }
}

/// Where a metric's clients run, and whose servers they connect to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Traffic {
    /// A pod's clients to the outside host's servers: what the agent is there to masquerade.
    PodToOutside,
    /// The node's own clients, from its ephemeral ports, to the outside host's servers.
    NodeToOutside,
    /// The outside host's clients to servers in the node's namespace, on its uplink address.
    OutsideToNode,
    /// A pod's clients to the outside host's servers over IPv6.
    PodToOutsideV6,
    /// A pod's clients to servers at a cluster address, inside the non-masquerade CIDRs: most
    /// of a node's pod traffic, which no mode translates.
    PodToCluster,
}

impl Traffic {
    pub const ALL: [Traffic; 5] = [
        Traffic::PodToOutside,
        Traffic::NodeToOutside,
        Traffic::OutsideToNode,
        Traffic::PodToOutsideV6,
        Traffic::PodToCluster,
    ];

    /// Whether it is a pod's traffic, which the agent is there to masquerade or to leave
    /// alone as its policy says.
    pub fn is_pods(self) -> bool {
        matches!(
            self,
            Traffic::PodToOutside | Traffic::PodToOutsideV6 | Traffic::PodToCluster
        )
    }

    /// The family of its addresses.
    pub fn family(self) -> Family {
        match self {
            Traffic::PodToOutsideV6 => Family::V6,
            _ => Family::V4,
        }
    }

    /// Whether each new connection leaves by the uplink through nat POSTROUTING, whose jump to
    /// the agent's chain then counts it. A reply to a connection from outside is no new
    /// connection there.
    pub fn leaves_through_postrouting(self) -> bool {
        self != Traffic::OutsideToNode
    }

    /// Whether it is measured at every size of the plan, or only at the smallest, to keep the
    /// run short: what a larger policy costs shows in the pods' figures.
    pub fn at_every_size(self) -> bool {
        self == Traffic::PodToOutside
    }

    /// What the report says of it: who talks to whom, and what each data plane does with it.
    pub fn describe(self) -> &'static str {
        match self {
            Traffic::PodToOutside => {
                "clients in a pod, servers on the outside host: the node forwards the traffic, and every NAT mode masquerades it"
            }
            Traffic::NodeToOutside => {
                "clients in the node's own namespace, from its ephemeral ports, servers on the outside host: in the iptables modes the chain MASQUERADEs each connection (to a random port, `--random-fully`); in the eBPF modes the programs leave it its address and port, and hold no entry for it, its port being outside NAT's spans"
            }
            Traffic::OutsideToNode => {
                "clients on the outside host, servers in the node's own namespace on its uplink address: no mode translates them, and in the eBPF modes the programs hold no entry for them, their ports being ones the node listens on"
            }
            Traffic::PodToOutsideV6 => {
                "clients in a pod, servers on the outside host, over IPv6: as the pods' IPv4 traffic, with the agent's IPv6 (`--enable-ipv6`: ip6tables' chain, or the programs' IPv6 maps, whose NAT table is the slot table as IPv4's is) and kube-proxy's table written into ip6tables too"
            }
            Traffic::PodToCluster => {
                "clients in a pod, servers on the outside host at a cluster address (inside the non-masquerade CIDRs), over TCP: no mode translates it; in the iptables modes each connection's first packet walks the chain to its non-masquerade rule, and in the eBPF modes the programs decide every packet both ways and leave it alone without a NAT lookup"
            }
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub mode: Mode,
    pub shape: Shape,
    pub cidrs: usize,
    pub metric: Metric,
    pub round: usize,
    pub value: f64,
    /// What one operation (a connection, a transaction, a flow) cost while it was measured.
    pub cost: Cost,
}

/// CPU time per operation of a measurement, in nanoseconds: the eBPF programs' (from the
/// kernel's BPF run-time statistics, in the eBPF modes), and the agent's (all its threads).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Cost {
    pub programs_ns: Option<f64>,
    pub agent_ns: Option<f64>,
}

/// One line of the sweep benchmark's output: what a sweep of a NAT table holding `flows` costs
/// when none of them is over (the first sweep of the table, and the one after it, which finds
/// it as the first left it), and when all of them are, swept by `sweeper` (`kernel`: the sweep
/// program; `userspace`: a read of the whole table).
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct SweepCase {
    pub flows: usize,
    pub sweeper: String,
    pub none_expired_ms: f64,
    pub none_expired_again_ms: f64,
    pub all_expired_ms: f64,
}

/// One line of the node-ports benchmark's output: what reading the ports the node holds costs,
/// at every sweep, from the kernel's socket diagnostics and from `/proc/net`, while another
/// namespace on the machine holds `connections_elsewhere` connections.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct NodePortsCase {
    pub connections_elsewhere: usize,
    pub diagnostics_ms: f64,
    pub proc_ms: f64,
}

/// The rate of the churn the agent's CPU is measured under: the target's (issue 27), so that
/// a fast machine's figure and a slow one's compare. A machine that cannot reach it runs flat
/// out, and the report says the rate it reached.
pub const CHURN_RATE: f64 = 17_500.0;

/// The agent under a sustained churn of new connections, over a window that holds several of
/// its NAT table's sweeps.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Churn {
    pub error: Option<String>,
    pub tuples: Tuples,
    pub seconds: f64,
    pub connections_per_second: f64,
    /// The agent's CPU time over the window, as a share of the whole machine's.
    pub agent_cpu_percent: f64,
    pub agent_ns_per_connection: f64,
    pub programs_ns_per_connection: f64,
    /// The agent's peak RSS by the end of the window, its sweeps having read a table the
    /// churn keeps near full.
    pub agent_peak_rss_mib: f64,
    /// How full the IPv4 NAT table was at the end: entries, of its capacity.
    pub nat_entries: u64,
    pub nat_capacity: u64,
    /// Over the window: connections whose SYN reopened a flow a RST had closed (no new flow),
    /// flows a full table dropped early to make room, and new flows' packets it refused.
    pub flows_reopened: u64,
    pub flows_dropped_early: u64,
    pub packets_refused: u64,
}

impl Churn {
    /// Whether the machine kept up with `CHURN_RATE`, within what pacing loses.
    pub fn reached_the_rate(&self) -> bool {
        self.connections_per_second >= 0.95 * CHURN_RATE
    }

    /// The agent's CPU at `CHURN_RATE`, as a share of the machine: as measured where the machine
    /// kept up; otherwise each connection at what it cost at the rate the machine reached. A
    /// machine that falls short must not meet the target by opening fewer connections.
    pub fn agent_cpu_percent_at_the_rate(&self) -> Option<f64> {
        if self.error.is_some() || self.connections_per_second <= 0.0 {
            return None;
        }
        Some(if self.reached_the_rate() {
            self.agent_cpu_percent
        } else {
            self.agent_cpu_percent * CHURN_RATE / self.connections_per_second
        })
    }
}

/// One line of the data-path benchmark's output.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct DatapathCase {
    pub case: String,
    pub prefixes: usize,
    pub ns_per_packet: f64,
    pub samples: Vec<f64>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ControlPlane {
    /// Why the control-plane measurements could not all be made, if they could not.
    pub error: Option<String>,
    /// The size of the large policy the figures below were measured with.
    pub prefixes: usize,
    pub apply_cold_ms: f64,
    /// The same size of policy, a quarter of it exceptions (`masqueradeCIDRs`).
    pub apply_cold_with_exceptions_ms: f64,
    pub apply_one_change_ms: f64,
    pub iptables_restore_ms: BTreeMap<usize, f64>,
    pub config_change_to_map_ms: Vec<f64>,
    pub rss_mib: f64,
    pub idle_cpu_percent: f64,
    pub idle_seconds: u64,
    /// The devices the node had for its pods while the idle CPU was measured.
    pub idle_pod_devices: usize,
}

#[derive(clap::Args)]
pub struct Options {
    /// A reduced run, one round of every step (some seven minutes on the 2-CPU machines).
    #[arg(long)]
    pub quick: bool,
    /// Only the end-to-end part: no data path in isolation, no control plane.
    #[arg(long)]
    pub end_to_end_only: bool,
    /// Measure end to end at these numbers of CIDRs instead (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub sizes: Vec<usize>,
    /// Rounds of interleaved modes, instead of the plan's.
    #[arg(long)]
    pub rounds: Option<usize>,
    /// Measure end to end only these modes (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub modes: Vec<Mode>,
    /// Measure end to end only in these load shapes (comma-separated: pinned, unpinned).
    #[arg(long, value_delimiter = ',', value_parser = Shape::from_key)]
    pub shapes: Vec<Shape>,
    /// Measure end to end only these metrics (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub metrics: Vec<Metric>,
    /// Seconds per end-to-end measurement, instead of the plan's: long enough to profile one
    /// mode with `perf record -a` while it runs (see docs/bench/profiles.md).
    #[arg(long)]
    pub seconds: Option<f64>,
    /// Only the one-prefix change to the large policy in a running agent, and the ConfigMap
    /// swaps to a small one, printed and not reported: the quick loop for working on those
    /// figures (about a minute).
    #[arg(long)]
    pub one_change_only: bool,
    /// Only the agent under a churn of new connections (a minute, or `--seconds`), printed and
    /// not reported: the quick loop for working on the sweep's cost.
    #[arg(long, conflicts_with = "one_change_only")]
    pub churn_only: bool,
    /// With `--one-change-only` or `--churn-only`: measure this agent binary instead of the one
    /// just built, to compare a change with its baseline in the same sitting.
    #[arg(long)]
    pub agent: Option<PathBuf>,
}

impl Options {
    /// A full run is the one the README shows; any other writes to target/bench.
    pub fn is_full(&self) -> bool {
        !self.quick
            && !self.end_to_end_only
            && !self.one_change_only
            && !self.churn_only
            && self.agent.is_none()
            && self.sizes.is_empty()
            && self.rounds.is_none()
            && self.modes.is_empty()
            && self.shapes.is_empty()
            && self.metrics.is_empty()
            && self.seconds.is_none()
    }

    /// The command line that reproduces this run.
    pub fn command(&self) -> String {
        let mut command = "cargo xtask bench".to_string();
        if self.quick {
            command += " --quick";
        }
        if self.end_to_end_only {
            command += " --end-to-end-only";
        }
        if self.one_change_only {
            command += " --one-change-only";
        }
        if self.churn_only {
            command += " --churn-only";
        }
        if !self.sizes.is_empty() {
            let sizes: Vec<String> = self.sizes.iter().map(usize::to_string).collect();
            command += &format!(" --sizes {}", sizes.join(","));
        }
        if let Some(rounds) = self.rounds {
            command += &format!(" --rounds {rounds}");
        }
        if !self.modes.is_empty() {
            command += &format!(" --modes {}", value_names(&self.modes));
        }
        if !self.shapes.is_empty() {
            let shapes: Vec<&str> = self.shapes.iter().map(|s| s.key()).collect();
            command += &format!(" --shapes {}", shapes.join(","));
        }
        if !self.metrics.is_empty() {
            command += &format!(" --metrics {}", value_names(&self.metrics));
        }
        if let Some(seconds) = self.seconds {
            command += &format!(" --seconds {seconds}");
        }
        command
    }
}

/// `values` as the command line names them, comma-separated.
fn value_names<T: clap::ValueEnum>(values: &[T]) -> String {
    let names: Vec<String> = values
        .iter()
        .filter_map(|v| Some(v.to_possible_value()?.get_name().to_string()))
        .collect();
    names.join(",")
}

/// The cargo profile whose binaries a run measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Profile {
    /// Optimised, as a node runs the agent: the figures a report gives.
    Release,
    /// What `cargo xtask test` builds: after it, nothing new to build; figures of no worth.
    Dev,
}

impl Profile {
    /// Its directory under target/.
    pub fn dir(self) -> &'static str {
        match self {
            Profile::Release => "release",
            Profile::Dev => "debug",
        }
    }

    /// cargo's arguments that build the binaries a run needs: the agent's and the examples'
    /// with the testbed feature. The dev profile's are built as `cargo test --workspace`
    /// builds them (its units exactly), so that after the tests nothing is built again; a
    /// build of the agent's package alone resolves other features, and builds it all again
    /// (some three minutes).
    pub fn build_args(self) -> &'static [&'static str] {
        match self {
            Profile::Release => &[
                "build",
                "--release",
                "--package",
                "masq-agent",
                "--features",
                "testbed",
                "--bins",
                "--examples",
            ],
            Profile::Dev => &["test", "--workspace", "--no-run"],
        }
    }
}

pub struct Plan {
    pub command: String,
    /// Whose binaries are measured.
    pub profile: Profile,
    pub sizes: Vec<usize>,
    pub rounds: usize,
    pub seconds: Duration,
    /// The window after each measured one, in the eBPF modes, that reads what the programs cost
    /// with the kernel's run-time statistics on (`bench::programs_cost`).
    pub cost_window: Duration,
    pub modes: Vec<Mode>,
    pub shapes: Vec<Shape>,
    pub metrics: Vec<Metric>,
    /// The pause between putting a mode in force and measuring it.
    pub settle: Duration,
    /// Single runs per data-path measurement.
    pub runs: u32,
    /// The large policy of the control-plane measurements.
    pub large: usize,
    /// How long the agent's idle CPU use is measured.
    pub idle: Duration,
    /// How long the agent is measured under a churn of new connections.
    pub churn: Duration,
}

impl Plan {
    pub fn new(options: &Options) -> Plan {
        let command = options.command();
        let mut plan = if options.quick {
            Plan {
                command,
                // One round of every step with the binaries the tests built: the quick run is
                // there so that the benchmark's code cannot rot (CI runs it after the tests),
                // not for figures.
                profile: Profile::Dev,
                sizes: vec![4, 10_000],
                rounds: 1,
                seconds: Duration::from_millis(400),
                cost_window: Duration::from_millis(300),
                modes: Mode::ALL.to_vec(),
                shapes: Shape::ALL.to_vec(),
                metrics: Metric::ALL.to_vec(),
                settle: Duration::from_millis(500),
                runs: 20_000,
                large: 20_000,
                idle: Duration::from_secs(10),
                // Long enough for sweeps that find flows over (a reset's 10 s, and the lag).
                churn: Duration::from_secs(30),
            }
        } else {
            Plan {
                command,
                profile: Profile::Release,
                sizes: vec![4, 10_000, 100_000],
                // Twice the measurements of a run of one shape and four modes: five rounds of
                // 1.5 s, and in the eBPF modes a window of the programs' cost after each, keep
                // the whole run some forty minutes, the node's own connections and the pods'
                // IPv6 traffic (at the smallest size alone) adding some three each.
                rounds: 5,
                seconds: Duration::from_millis(1500),
                // Some 15 000 connections a window: the cost per connection to a few ns.
                cost_window: Duration::from_millis(500),
                modes: Mode::ALL.to_vec(),
                shapes: Shape::ALL.to_vec(),
                metrics: Metric::ALL.to_vec(),
                // What the kernel does after a large apply (freeing what the old policy held,
                // RCU callbacks) is the control plane's cost, measured apart: let it settle.
                settle: Duration::from_secs(2),
                // A new-flow case's runs fill the table from the half the spread case holds to
                // some 60 %: the first packet into a half-full table, as the target has it, short
                // of the three quarters past which the slot table's halves begin to find both
                // their buckets full and make room by early drops, which the case refuses to time.
                runs: 30_000,
                large: 100_000,
                idle: Duration::from_secs(60),
                // Six of the NAT table's sweeps.
                churn: Duration::from_secs(60),
            }
        };
        if !options.sizes.is_empty() {
            plan.sizes = options.sizes.clone();
        }
        if let Some(rounds) = options.rounds {
            plan.rounds = rounds;
        }
        if !options.modes.is_empty() {
            plan.modes = options.modes.clone();
        }
        if !options.shapes.is_empty() {
            plan.shapes = options.shapes.clone();
        }
        if !options.metrics.is_empty() {
            plan.metrics = options.metrics.clone();
        }
        if let Some(seconds) = options.seconds {
            plan.seconds = Duration::from_secs_f64(seconds);
            if options.churn_only {
                plan.churn = plan.seconds;
            }
        }
        plan
    }

    /// The size the traffic that is not measured at every size is measured at (see
    /// `Traffic::at_every_size`).
    pub fn smallest_size(&self) -> Option<usize> {
        self.sizes.iter().copied().min()
    }

    /// Whether `metric` is measured at `cidrs`.
    pub fn measures(&self, metric: Metric, cidrs: usize) -> bool {
        metric.traffic().at_every_size() || self.smallest_size() == Some(cidrs)
    }

    /// The plan's metrics measured at `cidrs`, in the plan's order.
    pub fn metrics_at(&self, cidrs: usize) -> Vec<Metric> {
        let measured = |metric: &&Metric| self.measures(**metric, cidrs);
        self.metrics.iter().filter(measured).copied().collect()
    }

    /// The plan's sizes at which `metric` is measured, in the plan's order.
    pub fn sizes_of(&self, metric: Metric) -> Vec<usize> {
        let measured = |cidrs: &&usize| self.measures(metric, **cidrs);
        self.sizes.iter().filter(measured).copied().collect()
    }
}

pub fn median(mut values: Vec<f64>) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    Some(values[values.len() / 2])
}

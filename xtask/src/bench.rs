//! `cargo xtask bench`: the data path in isolation, end to end in namespaces against the
//! iptables chain and against no NAT at all, in two load shapes, and the control plane. Modes
//! run interleaved (A B C A B C ...) and every figure that matters is a ratio within one run.
//! One job, running the benchmark: what it measures is in `bench_plan`, what it says in
//! `report`.

use std::{
    collections::BTreeMap,
    net::{IpAddr, Ipv4Addr},
    path::{Path, PathBuf},
    process::{Command, Output},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use masq_ebpf::Counter;
use masq_testbed::{
    keeps_address_v4,
    kubelet::ConfigMapVolume,
    load::{Load, Servers, Shape, Tuples},
    netns, prefixes,
    topology::{self, Process, Topology},
    wait_for_long, workspace_root, write_config,
};

use crate::{
    bench_plan::{
        CHURN_RATE, Churn, ControlPlane, Cost, DatapathCase, Metric, Mode, NodePortsCase, Options,
        Plan, Sample, SweepCase, Traffic, median,
    },
    cost_meter::{self, Meter, Reading, RunTimeStats},
    node_tables::{self, Family, KUBE_POSTROUTING, Node},
    report, step,
    sweep_watch::{AGENT_METRICS, SweepWatch},
};

pub fn run(options: &Options) -> anyhow::Result<()> {
    let plan = Plan::new(options);
    let started = Instant::now();
    step("cargo", plan.profile.build_args())?;
    let root = workspace_root();
    let built = root.join("target").join(plan.profile.dir());
    let agent = built.join("masq-agent");
    if options.agent.is_some() && !options.one_change_only && !options.churn_only {
        bail!("--agent measures one part alone: add --one-change-only or --churn-only");
    }
    let agent = options.agent.clone().unwrap_or(agent);
    if options.one_change_only {
        return one_change_only(&agent, &plan);
    }
    if options.churn_only {
        for tuples in Tuples::ALL {
            let churn = churn(&agent, &plan, tuples)?;
            println!(
                "churn of {:.0} new connections/s over {} for {:.0} s: agent {:.3} % of the \
                 machine, {:.0} ns a connection, peak RSS {:.1} MiB; programs {:.0} ns a \
                 connection; NAT table {} of {} entries; flows reopened {}, dropped early {}, \
                 packets refused {}",
                churn.connections_per_second,
                tuples.name(),
                churn.seconds,
                churn.agent_cpu_percent,
                churn.agent_ns_per_connection,
                churn.agent_peak_rss_mib,
                churn.programs_ns_per_connection,
                churn.nat_entries,
                churn.nat_capacity,
                churn.flows_reopened,
                churn.flows_dropped_early,
                churn.packets_refused,
            );
        }
        return Ok(());
    }

    let datapath = if options.end_to_end_only {
        Vec::new()
    } else {
        eprintln!("xtask: bench: the data path in isolation (BPF_PROG_TEST_RUN)");
        datapath(&built.join("examples/datapath_bench"), &plan)?
    };
    let datapath_cold = if options.end_to_end_only {
        Vec::new()
    } else {
        eprintln!("xtask: bench: the data path with the branch predictors cold");
        kept_on_failure(
            "the cold data path",
            || datapath_cold(&built.join("examples/datapath_bench"), &plan),
            |_| Vec::new(),
        )
    };
    let sweeps = if options.end_to_end_only {
        Vec::new()
    } else {
        eprintln!("xtask: bench: the NAT table's sweep");
        in_rounds::<SweepCase>(&built.join("examples/sweep_bench"), &plan)?
    };
    let node_ports = if options.end_to_end_only {
        Vec::new()
    } else {
        eprintln!("xtask: bench: reading the ports the node holds");
        in_rounds::<NodePortsCase>(&built.join("examples/node_ports_bench"), &plan)?
    };
    eprintln!("xtask: bench: end to end in namespaces");
    let samples = end_to_end(&agent, &plan)?;
    let churns: Vec<Churn> = match options.end_to_end_only {
        true => Vec::new(),
        false => Tuples::ALL
            .into_iter()
            .map(|tuples| {
                eprintln!(
                    "xtask: bench: the agent under a churn of new connections over {}",
                    tuples.name()
                );
                kept_on_failure(
                    "churn",
                    || churn(&agent, &plan, tuples),
                    |error| Churn {
                        error: Some(error),
                        tuples,
                        ..Churn::default()
                    },
                )
            })
            .collect(),
    };
    let control = (!options.end_to_end_only).then(|| {
        eprintln!("xtask: bench: the control plane");
        kept_on_failure(
            "control plane",
            || control_plane(&agent, &plan),
            |error| ControlPlane {
                error: Some(error),
                ..ControlPlane::default()
            },
        )
    });

    // The verifier's figures: the running kernel's, and in a full run the VMs' too. A failure
    // here must not throw away the figures measured above either.
    let budget = if options.is_full() {
        crate::budget::everywhere()
    } else {
        crate::budget::here()
    }
    .unwrap_or_else(|err| {
        eprintln!("xtask: bench: the verifier's budget failed: {err:#}");
        Vec::new()
    });
    if options.is_full() && !budget.is_empty() {
        // The report is written whole below; the docs keep the table between their markers.
        crate::doc_sections::update_section(
            &root.join("docs/install.md"),
            "budget",
            &crate::verifier_figures::section(&budget),
        )?;
    }

    let out_dir = if options.is_full() {
        root.join("docs/bench")
    } else {
        root.join("target/bench")
    };
    let readme = options.is_full().then(|| root.join("README.md"));
    report::write(
        &out_dir,
        readme.as_deref(),
        &plan,
        &report::Measured {
            datapath: &datapath,
            datapath_cold: &datapath_cold,
            sweeps: &sweeps,
            node_ports: &node_ports,
            samples: &samples,
            control: control.as_ref(),
            churns: &churns,
            budget: &budget,
        },
        started.elapsed(),
    )
}

/// One part of the run: a failure becomes its figures' error (`failed`), so that it does not
/// throw away what the parts before it measured.
fn kept_on_failure<T>(
    part: &str,
    measure: impl FnOnce() -> anyhow::Result<T>,
    failed: impl FnOnce(String) -> T,
) -> T {
    measure().unwrap_or_else(|err| {
        eprintln!("xtask: bench: {part} failed: {err:#}");
        failed(format!("{err:#}"))
    })
}

/// Every case at every size, the branch predictors warm (one case's runs one after the other).
fn datapath(binary: &Path, plan: &Plan) -> anyhow::Result<Vec<DatapathCase>> {
    datapath_runs(binary, plan, &["--sizes", "4,10000,100000"])
}

/// The cases a packet of a known flow, a first packet and a packet left alone take, at the
/// smallest size, each run after code that empties the CPU's branch predictors, as a packet's
/// trip down the network stack does end to end (docs/bench/profiles.md, "A run end to end,
/// cold"); and the runner's floor, measured so too.
fn datapath_cold(binary: &Path, plan: &Plan) -> anyhow::Result<Vec<DatapathCase>> {
    let cases = report::COLD_CASES.join(",");
    let kib = report::COLD_PREDICTORS_KIB.to_string();
    let size = report::COLD_PREFIXES.to_string();
    datapath_runs(
        binary,
        plan,
        &[
            "--sizes",
            &size,
            "--cases",
            &cases,
            "--cold-predictors",
            &kib,
        ],
    )
}

/// `datapath_bench` with the plan's runs a case and rounds, and `args`.
fn datapath_runs(binary: &Path, plan: &Plan, args: &[&str]) -> anyhow::Result<Vec<DatapathCase>> {
    let runs = plan.runs.to_string();
    let rounds = plan.rounds.to_string();
    let mut all = vec!["--runs", &runs, "--rounds", &rounds];
    all.extend_from_slice(args);
    json_lines(binary, &all)
}

/// Runs a benchmark binary that takes only the plan's rounds.
fn in_rounds<T: serde::de::DeserializeOwned>(binary: &Path, plan: &Plan) -> anyhow::Result<Vec<T>> {
    let rounds = plan.rounds.to_string();
    json_lines(binary, &["--rounds", &rounds])
}

/// Runs a benchmark binary and reads the JSON line it prints per case.
fn json_lines<T: serde::de::DeserializeOwned>(
    binary: &Path,
    args: &[&str],
) -> anyhow::Result<Vec<T>> {
    let name = binary.file_name().unwrap_or_default().to_string_lossy();
    let out = Command::new(binary)
        .args(args)
        .output()
        .with_context(|| format!("running {name}"))?;
    if !out.status.success() {
        bail!("{name}: {}", String::from_utf8_lossy(&out.stderr));
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).with_context(|| format!("{name} line {l:?}")))
        .collect()
}

/// The namespace test bed, set up for load: servers on the outside host and in the node, and one
/// `iptables` directory per backend for the agent's PATH. Each mode finds its node's tables
/// (`Node`) written when it starts, and leaves none behind.
pub struct Bed {
    pub topo: Topology,
    _outside_servers: Servers,
    /// Listening before any agent starts, as a node's services are: the eBPF data plane reads
    /// the ports the node listens on when it loads, and its NAT never hands them out.
    _node_servers: Servers,
    agent: PathBuf,
    pub config: PathBuf,
    /// The families whose tables the node holds, and whose traffic its agent translates
    /// (IPv6's with `--enable-ipv6`).
    families: &'static [Family],
}

impl Bed {
    /// A bed with `pods` pod namespaces, whose node holds `families`' tables.
    pub fn new(agent: &Path, pods: usize, families: &'static [Family]) -> anyhow::Result<Bed> {
        let topo = Topology::new(pods)?;
        let outside_servers = Servers::start(&topo.ext)?;
        let node_servers = Servers::start(&topo.node)?;
        let config_dir = topo.path("config");
        std::fs::create_dir_all(&config_dir)?;
        Ok(Bed {
            config: config_dir.join("ip-masq-agent"),
            topo,
            _outside_servers: outside_servers,
            _node_servers: node_servers,
            agent: agent.to_path_buf(),
            families,
        })
    }

    /// A load of `traffic`'s clients against its servers, laid out as `shape`, for `duration`.
    pub fn load(&self, traffic: Traffic, shape: Shape, duration: Duration) -> Load<'_> {
        let (ns, server): (_, IpAddr) = match traffic {
            Traffic::PodToOutside => (&self.topo.pods[0], topology::EXT_ADDR.into()),
            Traffic::NodeToOutside => (&self.topo.node, topology::EXT_ADDR.into()),
            Traffic::OutsideToNode => (&self.topo.ext, topology::NODE_UPLINK.into()),
            Traffic::PodToOutsideV6 => (&self.topo.pods[0], topology::EXT_ADDR_V6.into()),
            Traffic::PodToCluster => (&self.topo.pods[0], topology::CLUSTER_LOCAL_ADDR.into()),
        };
        Load {
            ns,
            server,
            shape,
            duration,
            pace: None,
            tuples: Tuples::default(),
        }
    }

    pub fn path_env(&self, backend: &str) -> String {
        self.topo
            .path_with_iptables(backend)
            .expect("a directory in the topology's own scratch space")
    }

    pub fn agent_args(&self, mode: Mode) -> Vec<String> {
        let mut args = vec![
            format!("--config={}", self.config.display()),
            format!("--bpffs={}", self.topo.bpffs.display()),
            "--log-format=json".to_string(),
            format!("--metrics-addr={AGENT_METRICS}"),
        ];
        args.push(match mode.is_ebpf() {
            true => "--dataplane=ebpf".into(),
            false => "--dataplane=iptables".into(),
        });
        if mode.is_ebpf() {
            args.extend([
                "--fallback-to-iptables=false".into(),
                "--interface=eth0".into(),
            ]);
        }
        if self.runs_ipv6() {
            args.push("--enable-ipv6".into());
        }
        args
    }

    /// Whether the node holds IPv6's tables and its agent translates IPv6.
    fn runs_ipv6(&self) -> bool {
        self.families.contains(&Family::V6)
    }

    /// A config file of a policy of `cidrs` prefixes in each of the node's families.
    pub fn policy(&self, cidrs: usize) -> String {
        match self.runs_ipv6() {
            true => prefixes::config_both_families(cidrs),
            false => prefixes::config(cidrs),
        }
    }

    /// Feeds `rules` to the node's restore of `family`'s tables in `mode`'s backend.
    fn restore(
        &self,
        mode: Mode,
        family: Family,
        flags: &[&str],
        rules: &str,
    ) -> anyhow::Result<()> {
        let restore = family.command(mode.backend(), "-restore");
        let mut child = self
            .topo
            .node_command(&restore)
            .args(flags)
            .args(["-w", "5"])
            .stdin(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        std::io::Write::write_all(&mut child.stdin.take().context("stdin")?, rules.as_bytes())?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!("{restore}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }

    /// Puts `mode` in force for a policy of `cidrs` prefixes, and returns the running agent.
    pub fn activate(&self, mode: Mode, cidrs: usize) -> anyhow::Result<Option<Process>> {
        // The outside host's route back to the pods, over the node: without NAT, the pods'
        // own addresses come back that way; with it, nothing but the node's address may.
        let ext_route = |family: Family, op: &str| {
            let (pods, node) = (family.pod_cidr(), family.node_uplink().to_string());
            netns::run(
                "ip",
                &[
                    "-n",
                    self.topo.ext.as_str(),
                    "route",
                    op,
                    pods,
                    "via",
                    &node,
                ],
            )
        };
        self.prepare_node(mode)?;
        if !mode.masquerades() {
            for &family in self.families {
                ext_route(family, "replace")?;
            }
            return Ok(None);
        }
        for &family in self.families {
            match ext_route(family, "del") {
                Err(err) if !format!("{err:#}").contains("No such process") => return Err(err),
                _ => {}
            }
        }
        let args = self.agent_args(mode);
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let path = self.path_env(mode.backend());
        let mut env = vec![("PATH", path.as_str())];
        env.extend_from_slice(mode.agent_env());
        let agent = self
            .topo
            .spawn_in_node(&self.agent, &refs, &env, "agent.log")?;
        let ready = wait_for_long(Duration::from_secs(120), || {
            Ok(agent.log_text().contains("policy applied"))
        });
        ready.with_context(|| {
            format!(
                "{} never applied {cidrs} prefixes:\n{}",
                mode.name(),
                agent.log_text()
            )
        })?;
        Ok(Some(agent))
    }

    fn deactivate(&self, mode: Mode, agent: Option<Process>) -> anyhow::Result<()> {
        if let Some(mut agent) = agent {
            agent.stop(libc::SIGTERM)?;
        }
        // The next mode starts from an empty connection table: a stale entry from this one
        // (say, an unmasqueraded UDP flow from the no-NAT mode) would otherwise steer its flows.
        self.topo.node_run("conntrack", &["-F"])?;
        if mode.masquerades() {
            let bpffs = format!("--bpffs={}", self.topo.bpffs.display());
            self.run_agent(mode, "cleanup", &["cleanup", &bpffs])?;
        }
        for &family in self.families {
            self.restore(mode, family, &[], node_tables::EMPTY_TABLES)?;
        }
        Ok(())
    }

    /// What to read of `mode`'s data plane while it is measured: the programs the agent
    /// attached in an eBPF mode, and the agent itself.
    fn meter(&self, mode: Mode, agent: Option<&Process>) -> anyhow::Result<Meter> {
        let Some(agent) = agent else {
            return Ok(Meter::none());
        };
        let status = self.agent_status(mode)?;
        Ok(Meter::of_agent(&status, agent.child.id()))
    }

    /// The running agent's `status --json`.
    fn agent_status(&self, mode: Mode) -> anyhow::Result<serde_json::Value> {
        let bpffs = format!("--bpffs={}", self.topo.bpffs.display());
        let out = self.run_agent(mode, "status", &["status", "--json", &bpffs])?;
        serde_json::from_slice(&out.stdout).context("the agent's status")
    }

    /// Runs the agent binary in the node with `args`, on `mode`'s iptables backend, to
    /// completion; fails with what it said on stderr, `what` naming the run.
    fn run_agent(&self, mode: Mode, what: &str, args: &[&str]) -> anyhow::Result<Output> {
        let out = self
            .topo
            .node_command(self.agent.to_str().context("path")?)
            .args(args)
            .env("PATH", self.path_env(mode.backend()))
            .envs(mode.agent_env().iter().copied())
            .output()?;
        if !out.status.success() {
            bail!("{what}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(out)
    }

    /// Writes the tables `mode`'s node holds besides its data plane (see `Node`) into tables
    /// that hold nothing yet. As on a real node, kube-proxy's rules are there before the agent
    /// starts.
    pub fn prepare_node(&self, mode: Mode) -> anyhow::Result<()> {
        for &family in self.families {
            self.restore(mode, family, &["--noflush"], &mode.node().rules(family))?;
        }
        Ok(())
    }

    /// Fails unless the node's nat POSTROUTING is what `mode` needs, in each family's tables:
    /// kube-proxy's jump first on a kube-proxy node, and the agent's chain reached by the
    /// traffic of `measured` of that family (an agent's jump that nothing reaches would leave
    /// its masquerading untested).
    fn check_postrouting(&self, mode: Mode, measured: &[Metric]) -> anyhow::Result<()> {
        let kube_proxy_first = mode.node() == Node::KubeProxy;
        for &family in self.families {
            let reaches_chain = mode.masquerades()
                && measured.iter().any(|metric| {
                    metric.traffic().family() == family
                        && metric.traffic().leaves_through_postrouting()
                });
            if !kube_proxy_first && !reaches_chain {
                // Nothing to check, and listing would make the nat table a bare node lacks.
                continue;
            }
            let iptables = family.command(mode.backend(), "");
            let listing = self.topo.node_run(
                &iptables,
                &[
                    "-w",
                    "5",
                    "-t",
                    "nat",
                    "-L",
                    "POSTROUTING",
                    "-n",
                    "-v",
                    "-x",
                ],
            )?;
            let rules = packets_and_targets(&listing);
            if kube_proxy_first && rules.first().map(|r| r.1) != Some(KUBE_POSTROUTING) {
                bail!(
                    "{}: {KUBE_POSTROUTING} is not the first jump in {iptables}'s POSTROUTING:\n{listing}",
                    mode.name()
                );
            }
            if reaches_chain
                && !rules
                    .iter()
                    .any(|&(packets, target)| target == CHAIN && packets > 0)
            {
                bail!(
                    "{}: no packet reached the agent's chain {CHAIN} in {iptables}:\n{listing}",
                    mode.name()
                );
            }
        }
        Ok(())
    }
}

fn end_to_end(agent: &Path, plan: &Plan) -> anyhow::Result<Vec<Sample>> {
    // A bed per iptables backend: iptables-legacy's tables, once made, stay in their namespace
    // (empty, hooks and all), and would weigh on every mode after them.
    // Each node runs both families whatever the metrics, so that an IPv4 figure is measured on
    // the same node whether the run measures IPv6's or not.
    let mut beds = BTreeMap::new();
    for mode in &plan.modes {
        if !beds.contains_key(mode.backend()) {
            beds.insert(mode.backend(), Bed::new(agent, 1, Family::BOTH)?);
        }
    }
    let mut samples = Vec::new();
    for &cidrs in &plan.sizes {
        for bed in beds.values() {
            write_config(&bed.config, &bed.policy(cidrs))?;
        }
        let modes: Vec<Mode> = plan
            .modes
            .iter()
            .copied()
            .filter(|m| m.runs_at(cidrs))
            .collect();
        let metrics = plan.metrics_at(cidrs);
        if metrics.is_empty() {
            continue;
        }
        for round in 0..plan.rounds {
            // Shapes outside modes: the modes a ratio compares run close together.
            for &shape in &plan.shapes {
                for &mode in &modes {
                    eprintln!(
                        "xtask: bench: {cidrs} CIDRs, round {}, {}, {}",
                        round + 1,
                        shape.name(),
                        mode.name()
                    );
                    let bed = &beds[mode.backend()];
                    // Each shape starts its own agent, with an empty NAT table, as each mode
                    // starts from an empty connection table.
                    let activated = Instant::now();
                    let agent = bed.activate(mode, cidrs)?;
                    if mode.is_ebpf() && metrics.contains(&Metric::NodeInboundConnections) {
                        settle_node_services(bed, mode)?;
                    }
                    std::thread::sleep(plan.settle);
                    let sweeps = mode
                        .is_ebpf()
                        .then(|| SweepWatch::since(activated, plan.seconds + WINDOW_SETUP))
                        .flatten();
                    let measured = bed
                        .meter(mode, agent.as_ref())
                        .and_then(|meter| {
                            measure(bed, &metrics, shape, plan, &meter, sweeps.as_ref())
                        })
                        .and_then(|measured| {
                            bed.check_postrouting(mode, &metrics).map(|()| measured)
                        });
                    bed.deactivate(mode, agent)?;
                    for (metric, value, cost) in measured? {
                        samples.push(Sample {
                            mode,
                            shape,
                            cidrs,
                            metric,
                            round,
                            value,
                            cost,
                        });
                    }
                }
            }
        }
    }
    Ok(samples)
}

/// Waits until the eBPF data plane's agent has found the node servers' ports without NAT
/// entries (`map_names::ENTRYLESS_PORTS`, which its programs use and it does not pin), as on a
/// node whose services and agent have run a while: at its second sweep after it starts, some
/// ten seconds in (`HeldPorts::mark_entryless`). Until then connections to them are looked up
/// in the NAT table.
fn settle_node_services(bed: &Bed, mode: Mode) -> anyhow::Result<()> {
    let status = bed.agent_status(mode)?;
    let program = status["ebpf"]["attachments"][0]["program_id"]
        .as_u64()
        .context("the agent attached no program")?;
    let map = masq_testbed::program_map_id(program as u32, masq_ebpf::map_names::ENTRYLESS_PORTS)?
        .context("the agent's programs use no map of the node's entryless ports")?;
    let ports = masq_testbed::load::new_connection_ports()?;
    wait_for_long(Duration::from_secs(60), || {
        masq_testbed::port_bits_set(map, masq_ebpf::IPPROTO_TCP, &ports)
    })
    .context("the agent never found the node servers' ports without NAT entries")
}

/// The agent's CPU under a sustained churn of new connections over `tuples`, on the eBPF data
/// plane at 4 CIDRs, over a window that holds several of the NAT table's sweeps: the sweep's
/// cost grows with the table, which the churn keeps full of closing flows. What a full table
/// did meanwhile is read from the programs' counters.
fn churn(agent: &Path, plan: &Plan, tuples: Tuples) -> anyhow::Result<Churn> {
    // On for the whole churn, which measures costs and no rate to compare.
    let _stats = RunTimeStats::enable()?;
    let bed = Bed::new(agent, 1, Family::IPV4)?;
    let _fresh_servers = match tuples {
        Tuples::Fresh => Some(Servers::start_fresh(&bed.topo.ext)?),
        Tuples::Recurring => None,
    };
    write_config(&bed.config, &prefixes::config(4))?;
    let daemon = bed.activate(Mode::Ebpf, 4)?.context("agent")?;
    let measured = (|| {
        std::thread::sleep(plan.settle);
        let meter = bed.meter(Mode::Ebpf, Some(&daemon))?;
        let counted_before = bed.agent_status(Mode::Ebpf)?;
        let before = meter.read()?;
        let rate = Load {
            pace: Some(CHURN_RATE),
            tuples,
            ..bed.load(Traffic::PodToOutside, Shape::Unpinned, plan.churn)
        }
        .new_connections()?;
        let after = meter.read()?;
        let cost = meter.cost(before, after, rate * plan.churn.as_secs_f64());
        let status = bed.agent_status(Mode::Ebpf)?;
        let table = &status["ebpf"]["nat"]["ipv4"];
        let count = |field: &str| {
            table[field]
                .as_u64()
                .with_context(|| format!("no NAT table {field} in the agent's status"))
        };
        let counted = |counters: &[Counter]| -> anyhow::Result<u64> {
            counters.iter().try_fold(0, |sum, counter| {
                let of = |status: &serde_json::Value| {
                    status["ebpf"]["counters"][counter.name()]
                        .as_u64()
                        .with_context(|| {
                            format!("no counter {} in the agent's status", counter.name())
                        })
                };
                Ok(sum + of(&status)?.saturating_sub(of(&counted_before)?))
            })
        };
        Ok(Churn {
            error: None,
            tuples,
            seconds: plan.churn.as_secs_f64(),
            connections_per_second: rate,
            agent_cpu_percent: Meter::agent_share(before, after),
            agent_ns_per_connection: cost.agent_ns.unwrap_or_default(),
            programs_ns_per_connection: cost.programs_ns.unwrap_or_default(),
            agent_peak_rss_mib: proc_status_kib(daemon.child.id(), "VmHWM")? / 1024.0,
            nat_entries: count("entries")?,
            nat_capacity: count("capacity")?,
            flows_reopened: counted(&[Counter::TcpReopened])?,
            flows_dropped_early: counted(&[Counter::NatEarlyDropped, Counter::NatNodeFlowDropped])?,
            packets_refused: counted(&[Counter::DropNatTableFull])?,
        })
    })();
    bed.deactivate(Mode::Ebpf, Some(daemon))?;
    measured
}

/// Each of `metrics` in turn: its rate, and what each operation cost the programs and the agent
/// (none for the bulk transfer, which has no operations to count).
fn measure(
    bed: &Bed,
    metrics: &[Metric],
    shape: Shape,
    plan: &Plan,
    meter: &Meter,
    sweeps: Option<&SweepWatch>,
) -> anyhow::Result<Vec<(Metric, f64, Cost)>> {
    let measured = metrics
        .iter()
        .map(|&metric| {
            let agent = meter.agent_only();
            let (value, before, after) = window(bed, metric, shape, plan.seconds, &agent, sweeps)?;
            let cost = match metric {
                Metric::Throughput => Cost::default(),
                _ => Cost {
                    programs_ns: meter
                        .reads_programs()
                        .then(|| programs_cost(bed, metric, shape, plan, meter, sweeps))
                        .transpose()?,
                    ..agent.cost(before, after, value * plan.seconds.as_secs_f64())
                },
            };
            Ok((metric, value, cost))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    // The outside host only answers a pod's translated traffic (or, without NAT, over its route
    // back), and the node and the outside host answer each other over the uplink: nothing
    // measured means nothing came back.
    if let Some((metric, ..)) = measured.iter().find(|(_, value, _)| *value <= 0.0) {
        bail!("no {} at all: the replies never came back", metric.name());
    }
    Ok(measured)
}

/// `metric`'s load in `shape` for `duration`, started where no sweep of the NAT table falls in
/// it: its rate (Gbit/s for the bulk transfer, operations a second otherwise), and `meter` read
/// right before and after it. Read after the wait for a sweep to pass, which is the agent's
/// busiest moment.
fn window(
    bed: &Bed,
    metric: Metric,
    shape: Shape,
    duration: Duration,
    meter: &Meter,
    sweeps: Option<&SweepWatch>,
) -> anyhow::Result<(f64, Reading, Reading)> {
    let load = bed.load(metric.traffic(), shape, duration);
    if let Some(sweeps) = sweeps {
        sweeps.clear(&bed.topo)?;
    }
    let before = meter.read()?;
    let value = match metric {
        Metric::NewConnections
        | Metric::NodeOutboundConnections
        | Metric::NodeInboundConnections
        | Metric::NewConnectionsV6
        | Metric::ClusterConnections => load.new_connections()?,
        Metric::Transactions | Metric::ClusterTransactions => load.transactions()?,
        Metric::Throughput => load.throughput()? / 1e9,
        Metric::UdpNewFlows | Metric::UdpNewFlowsV6 => load.udp_new_flows()?,
    };
    Ok((value, before, meter.read()?))
}

/// What each operation of `metric` cost the programs, in ns: their run time over a window of its
/// own, right after the measured one, with the kernel's run-time statistics on only there. The
/// measured window runs without them, as a node does (`RunTimeStats` says what they cost).
fn programs_cost(
    bed: &Bed,
    metric: Metric,
    shape: Shape,
    plan: &Plan,
    meter: &Meter,
    sweeps: Option<&SweepWatch>,
) -> anyhow::Result<f64> {
    let _stats = RunTimeStats::enable()?;
    let (value, before, after) = window(bed, metric, shape, plan.cost_window, meter, sweeps)?;
    meter
        .cost(before, after, value * plan.cost_window.as_secs_f64())
        .programs_ns
        .context("no programs' run time to read")
}

/// What a window of measurement takes besides its load: the load's processes starting and
/// ending, the readings on either side.
const WINDOW_SETUP: Duration = Duration::from_secs(1);

/// Each rule's packet count and target, in order, from `iptables -L CHAIN -n -v -x`.
fn packets_and_targets(listing: &str) -> Vec<(u64, &str)> {
    // After the chain's and the header's lines: pkts bytes target ...
    listing
        .lines()
        .skip(2)
        .filter_map(|l| {
            let mut words = l.split_whitespace();
            let packets = words.next()?.parse().ok()?;
            Some((packets, words.nth(1)?))
        })
        .collect()
}

/// Milliseconds the agent reported for applying its policy, from its JSON log.
fn apply_ms(log: &str) -> Option<f64> {
    log.lines()
        .rev()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["fields"]["message"] == "policy applied")
        .find_map(|v| v["fields"]["apply_ms"].as_f64())
}

fn control_plane(agent: &Path, plan: &Plan) -> anyhow::Result<ControlPlane> {
    let bed = Bed::new(agent, 1, Family::IPV4)?;
    let mut cp = ControlPlane::default();
    let run_once = |extra: &[&str]| -> anyhow::Result<String> {
        let mut args = bed.agent_args(Mode::Ebpf);
        args.push("--once".into());
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = bed.run_agent(Mode::Ebpf, "--once", &args)?;
        Ok(String::from_utf8_lossy(&out.stderr).into_owned())
    };

    // Every figure on the node the end-to-end modes run on, kube-proxy's table and all: an
    // iptables-restore reads the tables it writes into.
    let fresh_node = || -> anyhow::Result<()> {
        bed.deactivate(Mode::Ebpf, None)?;
        bed.prepare_node(Mode::Ebpf)
    };
    // The large policy from cold, non-masquerade only and then of both actions (a quarter of
    // it exceptions), each after a cleanup; then a one-prefix change on top.
    cp.prefixes = plan.large;
    let cold = |config: &str| -> anyhow::Result<f64> {
        fresh_node()?;
        write_config(&bed.config, config)?;
        apply_ms(&run_once(&[])?).context("no apply time logged")
    };
    // Interleaved, three of each: the kernel frees the policy before last meanwhile, and
    // whichever came second would pay for it.
    let plain = prefixes::config(plan.large);
    let policy = prefixes::config_with_exceptions(plan.large);
    let (mut plain_ms, mut exceptions_ms) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        plain_ms.push(cold(&plain)?);
        exceptions_ms.push(cold(&policy)?);
    }
    cp.apply_cold_ms = median(plain_ms).unwrap_or_default();
    cp.apply_cold_with_exceptions_ms = median(exceptions_ms).unwrap_or_default();
    fresh_node()?;

    // The same sizes through iptables-restore, as upstream's chain.
    for cidrs in [10_000usize, plan.large] {
        write_config(&bed.config, &prefixes::config(cidrs))?;
        let rendered = bed
            .topo
            .node_command(agent.to_str().context("path")?)
            .args([
                "render-iptables",
                "--dataplane=iptables",
                &format!("--config={}", bed.config.display()),
            ])
            .output()?;
        let file = bed.topo.path("chain.rules");
        std::fs::write(&file, &rendered.stdout)?;
        let started = Instant::now();
        let status = bed
            .topo
            .node_command("sh")
            .args([
                "-c",
                &format!("iptables-nft-restore --noflush -w 5 < {}", file.display()),
            ])
            .status()?;
        if !status.success() {
            bail!("iptables-restore of {cidrs} rules failed");
        }
        cp.iptables_restore_ms
            .insert(cidrs, started.elapsed().as_secs_f64() * 1e3);
        bed.topo
            .node_run("iptables-nft", &["-t", "nat", "-F", CHAIN])?;
        bed.topo
            .node_run("iptables-nft", &["-t", "nat", "-X", CHAIN])?;
    }

    cp.config_change_to_map_ms = config_change_latency(&bed)?;

    // Memory and idle CPU of a daemon holding the large policy, on a node with its pods'
    // devices: the agent's upkeep reads the node's devices and addresses every second.
    add_pod_devices(&bed, IDLE_POD_DEVICE_PAIRS)?;
    cp.idle_pod_devices = 2 * IDLE_POD_DEVICE_PAIRS;
    write_config(&bed.config, &prefixes::config(plan.large))?;
    let daemon = bed.activate(Mode::Ebpf, plan.large)?.context("agent")?;
    let pid = daemon.child.id();
    cp.rss_mib = proc_status_kib(pid, "VmHWM")? / 1024.0;
    cp.idle_seconds = plan.idle.as_secs();
    let before = cost_meter::cpu_ns(pid)?;
    std::thread::sleep(plan.idle);
    let used = cost_meter::cpu_ns(pid)?.saturating_sub(before);
    // Of one CPU.
    cp.idle_cpu_percent = used as f64 / plan.idle.as_nanos() as f64 * 100.0;
    cp.apply_one_change_ms =
        median(one_change_latency(&bed, &prefixes::config(plan.large))?).unwrap_or_default();
    bed.deactivate(Mode::Ebpf, Some(daemon))?;
    Ok(cp)
}

/// The devices of a node's pods that the idle agent is measured beside, in veth pairs with
/// both ends on the node (this kernel may have no dummy devices): a hundred, as a node's
/// usual hundred or so pods have one host-side device each.
const IDLE_POD_DEVICE_PAIRS: usize = 50;

/// Gives the node `pairs` veth pairs that stand in for its pods' devices (up, with their IPv6
/// link-local addresses), in one `ip -batch`.
fn add_pod_devices(bed: &Bed, pairs: usize) -> anyhow::Result<()> {
    let batch: String = (0..pairs)
        .map(|i| {
            format!(
                "link add idlepod{i} type veth peer name idlepeer{i}\n\
                 link set idlepod{i} up\nlink set idlepeer{i} up\n"
            )
        })
        .collect();
    let file = bed.topo.path("pod-devices.batch");
    std::fs::write(&file, batch)?;
    bed.topo
        .node_run("ip", &["-batch", file.to_str().context("path")?])?;
    Ok(())
}

/// `--one-change-only`: the daemon holding the large policy and the one-prefix changes to it,
/// then the ConfigMap swaps to a small policy.
fn one_change_only(agent: &Path, plan: &Plan) -> anyhow::Result<()> {
    let bed = Bed::new(agent, 1, Family::IPV4)?;
    let policy = prefixes::config(plan.large);
    write_config(&bed.config, &policy)?;
    let daemon = bed.activate(Mode::Ebpf, plan.large)?.context("agent")?;
    eprintln!(
        "xtask: bench: agent {} holds {} prefixes",
        daemon.child.id(),
        plan.large
    );
    // The agent's CPU over the changes says less about the machine's moment than their
    // latency, which an A/B of two agents wants.
    let cpu_before = cost_meter::cpu_ns(daemon.child.id())?;
    let latencies = one_change_latency(&bed, &policy);
    let cpu_used = cost_meter::cpu_ns(daemon.child.id())?.saturating_sub(cpu_before);
    bed.deactivate(Mode::Ebpf, Some(daemon))?;
    let latencies = latencies?;
    let rounded: Vec<String> = latencies.iter().map(|ms| format!("{ms:.1}")).collect();
    println!(
        "one-prefix change to {}: median {:.1} ms of [{}]; the agent's CPU {:.1} ms a change",
        plan.large,
        median(latencies.clone()).unwrap_or_default(),
        rounded.join(", "),
        cpu_used as f64 / 1e6 / latencies.len() as f64
    );
    let swaps = config_change_latency(&bed)?;
    let rounded: Vec<String> = swaps.iter().map(|ms| format!("{ms:.1}")).collect();
    println!(
        "ConfigMap swap to map updated, 4 prefixes: median {:.1} ms of [{}]",
        median(swaps.clone()).unwrap_or_default(),
        rounded.join(", ")
    );
    Ok(())
}

/// The agent's default chain, and the IPv4 set beside the programs it names after it.
const CHAIN: &str = "IP-MASQ-AGENT";
const SET_V4: &str = "IP-MASQ-AGENT-v4";

/// A one-prefix change to the running agent's large `policy`, in and out five times each,
/// timed from the file's swap until both the trie and the set beside the programs agree.
fn one_change_latency(bed: &Bed, policy: &str) -> anyhow::Result<Vec<f64>> {
    let map = bed.topo.bpffs.join(masq_ebpf::map_names::NON_MASQ_V4);
    // An address no prefix of the large policy covers.
    let probe = topology::FAR_ADDR;
    let in_set = || -> anyhow::Result<bool> {
        let tested = bed
            .topo
            .node_command("ipset")
            .args(["test", SET_V4, &probe.to_string()])
            .output()?;
        Ok(tested.status.success())
    };
    let mut latencies = Vec::new();
    for round in 0..10 {
        let added = round % 2 == 0;
        let text = match added {
            true => format!("{policy}  - {probe}/32\n"),
            false => policy.to_string(),
        };
        let ms = ms_until(
            || write_config(&bed.config, &text),
            || Ok(keeps_address_v4(&map, probe)? == added && in_set()? == added),
        );
        latencies.push(
            ms.with_context(|| format!("change {round} never reached the trie and the set"))?,
        );
    }
    Ok(latencies)
}

/// Twenty ConfigMap updates the way kubelet makes them (a new timestamped directory, then an
/// atomic swap of the `..data` symlink), each timed until its new prefix is in the map.
fn config_change_latency(bed: &Bed) -> anyhow::Result<Vec<f64>> {
    let base = "resyncInterval: 60s\nnonMasqueradeCIDRs:\n  - 10.0.0.0/8\n";
    let mut volume = ConfigMapVolume::create(&bed.topo.path("kubelet"), "ip-masq-agent", base)?;
    let mut args = bed.agent_args(Mode::Ebpf);
    args[0] = format!("--config={}", volume.file().display());
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let path = bed.path_env("nft");
    let agent =
        bed.topo
            .spawn_in_node(&bed.agent, &refs, &[("PATH", &path)], "kubelet-agent.log")?;
    wait_for_long(Duration::from_secs(30), || {
        Ok(agent.log_text().contains("policy applied"))
    })?;
    let map = bed.topo.bpffs.join(masq_ebpf::map_names::NON_MASQ_V4);
    let mut latencies = Vec::new();
    for n in 1..=20u8 {
        let ms = ms_until(
            || volume.update(&format!("{base}  - 198.18.{n}.0/24\n")),
            || keeps_address_v4(&map, Ipv4Addr::new(198, 18, n, 0)),
        );
        latencies.push(ms.with_context(|| format!("change {n} never reached the map"))?);
    }
    bed.deactivate(Mode::Ebpf, Some(agent))?;
    Ok(latencies)
}

/// Milliseconds from making `change` until `reached` (polled) says it took effect; an error
/// after ten seconds.
fn ms_until(
    change: impl FnOnce() -> anyhow::Result<()>,
    reached: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    change()?;
    wait_for_long(Duration::from_secs(10), reached)?;
    Ok(started.elapsed().as_secs_f64() * 1e3)
}

pub fn proc_status_kib(pid: u32, field: &str) -> anyhow::Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .with_context(|| format!("{field} of {pid}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn postrouting_is_read_rule_by_rule_with_its_counters() {
        let listing = "Chain POSTROUTING (policy ACCEPT 12 packets, 720 bytes)
    pkts      bytes target     prot opt in     out     source               destination
       0        0 KUBE-POSTROUTING  all  --  *      *       0.0.0.0/0            0.0.0.0/0            /* kubernetes postrouting rules */
    4711   282660 IP-MASQ-AGENT  all  --  *      *       0.0.0.0/0            0.0.0.0/0            /* ip-masq-agent: ensure nat POSTROUTING directs all non-LOCAL destination traffic to our custom IP-MASQ-AGENT chain */ ADDRTYPE match dst-type !LOCAL
";
        assert_eq!(
            packets_and_targets(listing),
            [(0, KUBE_POSTROUTING), (4711, CHAIN)]
        );
    }

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        options: Options,
    }

    #[test]
    fn the_command_line_names_the_shapes_it_was_given() {
        use clap::Parser as _;
        let cli = Cli::parse_from([
            "bench",
            "--shapes",
            "unpinned",
            "--modes",
            "no-nat-bare,ebpf",
        ]);
        assert_eq!(cli.options.shapes, [Shape::Unpinned]);
        assert!(!cli.options.is_full());
        assert_eq!(
            cli.options.command(),
            "cargo xtask bench --modes no-nat-bare,ebpf --shapes unpinned"
        );
        assert!(Cli::try_parse_from(["bench", "--shapes", "pinned-lanes"]).is_err());
    }

    #[test]
    fn a_pods_ipv6_traffic_is_measured_at_the_smallest_size_alone_through_ipv6s_chain() {
        use clap::Parser as _;
        let cli = Cli::parse_from([
            "bench",
            "--sizes",
            "10000,4",
            "--metrics",
            "new-connections,new-connections-v6,udp-new-flows-v6",
        ]);
        let plan = Plan::new(&cli.options);
        assert_eq!(plan.metrics_at(10_000), [Metric::NewConnections]);
        assert_eq!(plan.sizes_of(Metric::UdpNewFlowsV6), [4]);
        for metric in [Metric::NewConnectionsV6, Metric::UdpNewFlowsV6] {
            let traffic = metric.traffic();
            assert_eq!(traffic.family(), Family::V6);
            assert!(traffic.is_pods() && traffic.leaves_through_postrouting());
        }
        assert_eq!(Metric::NewConnections.traffic().family(), Family::V4);
    }

    #[test]
    fn the_nodes_own_connections_are_measured_at_the_smallest_size_alone() {
        use clap::Parser as _;
        let cli = Cli::parse_from([
            "bench",
            "--sizes",
            "10000,4",
            "--metrics",
            "new-connections,node-outbound-connections,node-inbound-connections",
        ]);
        assert_eq!(
            cli.options.command(),
            "cargo xtask bench --sizes 10000,4 --metrics new-connections,node-outbound-connections,node-inbound-connections"
        );
        let plan = Plan::new(&cli.options);
        assert_eq!(plan.metrics_at(10_000), [Metric::NewConnections]);
        assert_eq!(
            plan.metrics_at(4),
            [
                Metric::NewConnections,
                Metric::NodeOutboundConnections,
                Metric::NodeInboundConnections
            ]
        );
        assert_eq!(plan.sizes_of(Metric::NodeInboundConnections), [4]);
        assert_eq!(plan.sizes_of(Metric::NewConnections), [10_000, 4]);
        // Only what leaves by the uplink passes the jump to the agent's chain.
        assert!(
            Metric::NodeOutboundConnections
                .traffic()
                .leaves_through_postrouting()
        );
        assert!(
            !Metric::NodeInboundConnections
                .traffic()
                .leaves_through_postrouting()
        );
    }
}

//! What the data plane spends while the benchmark measures it: the eBPF programs' run time, from
//! the kernel's BPF run-time statistics, and the agent's CPU time, from the scheduler's account
//! of each of its threads. Read before and after a measurement, the difference divided by the
//! operations measured is a cost per operation, taken from the run itself rather than from a
//! profile.

use std::{os::fd::OwnedFd, time::Instant};

use anyhow::Context as _;
use masq_testbed::netns;

use crate::bench_plan::Cost;

/// The kernel's BPF run-time statistics, on while this lives (`BPF_ENABLE_STATS`): unlike the
/// `kernel.bpf_stats_enabled` sysctl, it leaves the machine's setting alone, and turns the
/// statistics off again when the benchmark exits, however it exits.
///
/// They are not free: each run of a program reads the clock twice and adds to its counters,
/// some 40 ns a packet in BPF_PROG_TEST_RUN here (`datapath_bench` with them on and off), which
/// a node runs without. So the rates are measured with them off, and the programs' cost in a
/// window of its own (`bench::programs_cost`).
pub struct RunTimeStats(#[allow(dead_code)] OwnedFd);

impl RunTimeStats {
    pub fn enable() -> anyhow::Result<RunTimeStats> {
        aya::sys::enable_stats(aya::sys::Stats::RunTime)
            .map(RunTimeStats)
            .context("turning on the kernel's BPF run-time statistics")
    }
}

/// The counters at one moment.
#[derive(Debug, Clone, Copy)]
pub struct Reading {
    at: Instant,
    programs_ns: u64,
    agent_ns: u64,
}

/// What to read: the programs the agent attached (none without eBPF) and the agent's process
/// (none without an agent).
pub struct Meter {
    programs: Vec<u32>,
    agent: Option<u32>,
}

impl Meter {
    /// For the agent `pid`, whose `status --json` is `status`: the programs it attached, if
    /// any.
    pub fn of_agent(status: &serde_json::Value, pid: u32) -> Meter {
        let programs = status["ebpf"]["attachments"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a["program_id"].as_u64())
            .map(|id| id as u32)
            .collect();
        Meter {
            programs,
            agent: Some(pid),
        }
    }

    /// Nothing to read: a mode without an agent.
    pub fn none() -> Meter {
        Meter {
            programs: Vec::new(),
            agent: None,
        }
    }

    pub fn read(&self) -> anyhow::Result<Reading> {
        let mut programs_ns = 0;
        for id in &self.programs {
            let shown = netns::run(
                "bpftool",
                &["prog", "show", "id", &id.to_string(), "--json"],
            )?;
            let info: serde_json::Value = serde_json::from_str(&shown)?;
            // Absent until the program has run with the statistics on.
            programs_ns += info["run_time_ns"].as_u64().unwrap_or(0);
        }
        let agent_ns = match self.agent {
            Some(pid) => cpu_ns(pid)?,
            None => 0,
        };
        Ok(Reading {
            at: Instant::now(),
            programs_ns,
            agent_ns,
        })
    }

    /// Whether there are programs to read: their cost needs a window with the statistics on.
    pub fn reads_programs(&self) -> bool {
        !self.programs.is_empty()
    }

    /// The agent alone, for a window whose programs run with the statistics off: their run
    /// time does not move there, and reading it would only spend `bpftool` calls.
    pub fn agent_only(&self) -> Meter {
        Meter {
            programs: Vec::new(),
            agent: self.agent,
        }
    }

    /// The cost of each of `operations` done between `before` and `after`: the programs' is
    /// only what ran with the statistics on (`RunTimeStats`).
    pub fn cost(&self, before: Reading, after: Reading, operations: f64) -> Cost {
        let per_op = |ns: u64| ns as f64 / operations.max(1.0);
        Cost {
            programs_ns: (!self.programs.is_empty())
                .then(|| per_op(after.programs_ns.saturating_sub(before.programs_ns))),
            agent_ns: self
                .agent
                .map(|_| per_op(after.agent_ns.saturating_sub(before.agent_ns))),
        }
    }

    /// The agent's CPU time between `before` and `after`, as a share of the whole machine's
    /// (every CPU) in percent.
    pub fn agent_share(before: Reading, after: Reading) -> f64 {
        let wall = after.at.duration_since(before.at).as_nanos() as f64;
        let cpus = std::thread::available_parallelism().map_or(1, usize::from) as f64;
        100.0 * after.agent_ns.saturating_sub(before.agent_ns) as f64 / (wall * cpus)
    }
}

/// The CPU time of every thread of process `pid`, in nanoseconds: the first field of each
/// thread's `schedstat`, the scheduler's own account, which is exact where `stat`'s ticks are
/// ten milliseconds coarse. The agent's threads live as long as it does (one runtime thread,
/// the HTTP server's, the file watcher's), so none of its time leaves with a thread.
pub fn cpu_ns(pid: u32) -> anyhow::Result<u64> {
    let tasks = format!("/proc/{pid}/task");
    let mut total = 0;
    for task in std::fs::read_dir(&tasks).with_context(|| format!("reading {tasks}"))? {
        let path = task?.path().join("schedstat");
        // A thread that ended since the listing has nothing more to add.
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        total += text
            .split_whitespace()
            .next()
            .and_then(|ns| ns.parse::<u64>().ok())
            .with_context(|| format!("{}: {text:?}", path.display()))?;
    }
    Ok(total)
}

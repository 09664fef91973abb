//! Windows of measurement that fall between the eBPF agent's sweeps of its NAT table.
//!
//! A sweep reads the whole table at once, every ten seconds: a burst of some tens to hundreds
//! of milliseconds of the agent's CPU that, inside a window of a few seconds, would weigh
//! several times its share of the time, on the agent's cost per operation and on what the data
//! path gets of the machine. The churn measurement is the one that holds several sweeps and
//! reports their cost; the other windows are started where no sweep can start before they end.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use masq_testbed::{probe, topology::Topology};

/// Where the bench's agents serve their metrics, in the node's namespace.
pub const AGENT_METRICS: &str = "127.0.0.1:9830";

/// The agent's count of its sweeps (`docs/operations.md`).
const SWEEPS_METRIC: &str = "masq_agent_nat_gc_runs_total";

/// Sweeps start no closer together than this, the first as the agent starts.
const INTERVAL: Duration = Duration::from_secs(masq_ebpf::NAT_SWEEP_INTERVAL_SECS);

/// The sweeps of an eBPF agent, for windows of one length.
pub struct SweepWatch {
    /// No sooner than the agent was spawned.
    started: Instant,
    window: Duration,
}

impl SweepWatch {
    /// For an agent spawned no sooner than `started`, and windows of `window`; none where such
    /// a window cannot fall between two sweeps.
    pub fn since(started: Instant, window: Duration) -> Option<SweepWatch> {
        if window + Duration::from_secs(1) >= INTERVAL {
            eprintln!(
                "xtask: bench: windows of {window:?} hold sweeps of the NAT table, {INTERVAL:?} apart"
            );
            return None;
        }
        Some(SweepWatch { started, window })
    }

    /// Returns once a window from now ends before the agent's next sweep can start: at once,
    /// or once the sweep due first has ended. With `n` sweeps done, the next starts `n`
    /// intervals after the agent's start at the soonest, and none is under way before then.
    /// (The count also takes the sweeps of an earlier data plane's tables being drained, which
    /// the bench's nodes, cleaned between modes, never hold.)
    pub fn clear(&self, topo: &Topology) -> anyhow::Result<()> {
        let give_up = Instant::now() + 3 * INTERVAL;
        let mut done = sweeps(topo)?;
        loop {
            let next_at_soonest = self.started + INTERVAL * u32::try_from(done)?;
            if Instant::now() + self.window < next_at_soonest {
                return Ok(());
            }
            let seen = done;
            while done == seen {
                anyhow::ensure!(
                    Instant::now() < give_up,
                    "the agent swept its NAT table {done} times and no more"
                );
                std::thread::sleep(Duration::from_millis(50));
                done = sweeps(topo)?;
            }
        }
    }
}

/// How many sweeps the agent in `topo`'s node has done, from its metrics.
fn sweeps(topo: &Topology) -> anyhow::Result<u64> {
    let server: SocketAddr = AGENT_METRICS.parse()?;
    let (status, body) = probe::http_get(&topo.node, server, "/metrics")?;
    anyhow::ensure!(status == 200, "the agent's metrics: HTTP {status}");
    let sweeps = probe::metric(&body, SWEEPS_METRIC)
        .with_context(|| format!("no {SWEEPS_METRIC} in the agent's metrics"))?;
    Ok(sweeps as u64)
}

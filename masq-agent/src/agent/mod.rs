//! The sync loop: read the config, derive the policy, make the data plane enforce it. Re-sync
//! when the config directory changes and every `resyncInterval`.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use notify::{EventKind, RecursiveMode, Watcher as _};
use tokio::{
    signal::unix::{SignalKind, signal},
    sync::mpsc,
    time::{Instant, sleep, sleep_until},
};
use tracing::{error, info, warn};

use crate::{
    cli::Flags,
    config::{self, ConfigOptions, ConfigSource},
    dataplane::{
        ApplyOutcome, DataPlane,
        ebpf::{
            self,
            leftovers::{Drain, Leftovers},
        },
        state,
    },
    policy::{IpFamilies, IpFamily, MasqueradeOptions, Policy},
    telemetry::{Check, ReloadResult, Telemetry},
};

/// How long to wait after a change in the config directory before reading it, so that the
/// several events of one kubelet symlink swap or editor save, which come within a millisecond
/// or two, produce one sync. A read in the middle of a swap still sees a whole file: the old
/// one, until the `..data` symlink is renamed, then the new one, and its events sync again.
const DEBOUNCE: Duration = Duration::from_millis(5);
/// How often the data plane's upkeep runs: a changed address or a detached program is found
/// within this; the data plane sweeps its NAT table less often.
const MAINTENANCE_INTERVAL: Duration = Duration::from_secs(1);

mod start;

pub use start::{
    Start, build_dataplane, config_options, device_selection, masquerade_options, policy_flags,
};
use start::{fallback, leftovers_beside, record_mode};

/// The exceptions (`masqueradeCIDRs`) of both families.
fn exceptions(policy: &Policy) -> Vec<ipnet::IpNet> {
    let v4 = policy.masq_v4.iter().map(|&n| ipnet::IpNet::from(n));
    v4.chain(policy.masq_v6.iter().map(|&n| n.into())).collect()
}

/// A prefix list for a log line: in full when short, counted when long.
fn summarize<T: std::fmt::Display>(prefixes: &[T]) -> String {
    const IN_FULL: usize = 16;
    if prefixes.len() <= IN_FULL {
        let list: Vec<String> = prefixes.iter().map(ToString::to_string).collect();
        format!("[{}]", list.join(", "))
    } else {
        format!("{} prefixes", prefixes.len())
    }
}

/// Logs a recurring message once, and again only when it changes.
#[derive(Default)]
struct OnceLogger {
    last: Option<String>,
}

impl OnceLogger {
    /// Returns true if `message` differs from the last one reported.
    fn is_new(&mut self, message: &str) -> bool {
        if self.last.as_deref() == Some(message) {
            return false;
        }
        self.last = Some(message.to_string());
        true
    }

    /// Returns true if there was a problem before, now cleared.
    fn clear(&mut self) -> bool {
        self.last.take().is_some()
    }
}

/// Result of one sync.
#[derive(Debug, PartialEq, Eq)]
pub enum SyncResult {
    /// The config was valid and the data plane enforces it.
    Synced(ApplyOutcome),
    /// The config was invalid; the last good policy (if any) is still enforced.
    ConfigRejected,
    /// The data plane could not apply the policy.
    ApplyFailed,
}

pub struct Agent {
    bpffs: PathBuf,
    /// What `explain` in another process needs to know of this agent.
    policy_flags: state::PolicyFlags,
    /// Where to fall back to when the eBPF data plane stops working; `None` when not allowed.
    fallback: Option<MasqueradeOptions>,
    config_path: PathBuf,
    config_opts: ConfigOptions,
    /// The families of the flag; the file's `enableIPv6` may say otherwise.
    families: IpFamilies,
    dataplane: Box<dyn DataPlane>,
    last_good: Option<Policy>,
    resync_interval: Duration,
    config_problem: OnceLogger,
    config_notices: OnceLogger,
    apply_problem: OnceLogger,
    upkeep_problem: OnceLogger,
    telemetry: Arc<Telemetry>,
    /// What an eBPF data plane left running while another one is in force: drained, then
    /// removed.
    leftovers: Option<Leftovers>,
    drain_problem: OnceLogger,
}

impl Agent {
    pub fn new(flags: &Flags, dataplane: Box<dyn DataPlane>, telemetry: Arc<Telemetry>) -> Agent {
        let policy_flags = policy_flags(flags);
        record_mode(&flags.pins.bpffs, dataplane.as_ref(), &policy_flags);
        let mode = dataplane.mode();
        telemetry.mode(mode);
        Agent {
            bpffs: flags.pins.bpffs.clone(),
            policy_flags,
            fallback: flags
                .daemon
                .fallback_to_iptables
                .then(|| masquerade_options(&flags.chain, &flags.masquerade)),
            config_path: flags.config.path.clone(),
            config_opts: config_options(&flags.config),
            families: flags.config.families(),
            dataplane,
            last_good: None,
            resync_interval: Duration::from_secs(60),
            config_problem: OnceLogger::default(),
            config_notices: OnceLogger::default(),
            apply_problem: OnceLogger::default(),
            upkeep_problem: OnceLogger::default(),
            telemetry,
            leftovers: leftovers_beside(mode, &flags.pins.bpffs),
            drain_problem: OnceLogger::default(),
        }
    }

    /// Records that the sync loop is alive, for `/healthz`.
    pub fn heartbeat(&self) {
        self.telemetry.heartbeat();
    }

    pub fn resync_interval(&self) -> Duration {
        self.resync_interval
    }

    /// Exits, leaving the data plane in force for the next agent.
    pub fn leave(&mut self, why: &str) {
        self.dataplane.leave();
        info!("{why}: exiting, data plane left in place");
    }

    /// Periodic upkeep of the data plane (re-attachment, NAT expiry).
    pub fn maintain(&mut self) {
        match self.dataplane.maintain() {
            Ok(sweep) => {
                if let Some(sweep) = sweep {
                    self.telemetry.nat_swept(&sweep);
                }
                self.record_check(Check::Upkeep, None);
            }
            Err(err) => self.record_check(Check::Upkeep, Some(&err)),
        }
        let in_force = self.dataplane.masquerade_addresses();
        for family in IpFamily::ALL {
            let in_use = in_force.of(family).is_some();
            self.telemetry.masquerade_address(family, in_use);
        }
        self.drain_leftovers();
    }

    /// Sweeps what an eBPF data plane left, and forgets it once it removed itself. A failure
    /// is said and tried again at the next upkeep: the data plane in force is not affected.
    fn drain_leftovers(&mut self) {
        let Some(leftovers) = &mut self.leftovers else {
            return;
        };
        match leftovers.maintain() {
            Ok(Drain::Draining(sweep)) => {
                if let Some(sweep) = sweep {
                    self.telemetry.nat_swept(&sweep);
                }
            }
            Ok(Drain::Done) => self.leftovers = None,
            Err(err) => {
                let message = format!("{err:#}");
                if self.drain_problem.is_new(&message) {
                    warn!("draining the eBPF data plane's flows failed: {message}");
                }
            }
        }
    }

    /// Logs a data-plane problem once per change, and its end, and tells liveness about it.
    fn record_check(&mut self, check: Check, problem: Option<&anyhow::Error>) {
        let (logger, failed, recovered) = match check {
            Check::Apply => (
                &mut self.apply_problem,
                "error syncing masquerade rules",
                "data plane recovered",
            ),
            Check::Upkeep => (
                &mut self.upkeep_problem,
                "data plane upkeep failed",
                "data plane upkeep recovered",
            ),
        };
        let problem = problem.map(|err| format!("{failed}: {err:#}"));
        match &problem {
            Some(message) if logger.is_new(message) => error!("{message}"),
            None if logger.clear() => info!("{recovered}"),
            _ => {}
        }
        self.telemetry.dataplane_checked(check, problem);
    }

    /// Re-reads the config and makes the data plane enforce it. An invalid config keeps the last
    /// good policy in force, and that policy is still re-applied, so that drift is repaired.
    pub fn sync(&mut self) -> SyncResult {
        let result = self.sync_once();
        let reload = match result {
            SyncResult::Synced(_) => ReloadResult::Success,
            SyncResult::ConfigRejected => ReloadResult::Invalid,
            SyncResult::ApplyFailed => ReloadResult::ApplyFailed,
        };
        let prefixes = self.last_good.as_ref().map(|p| {
            let v6 = p.non_masq_v6.as_ref().map_or(0, Vec::len);
            (p.non_masq_v4.len(), v6)
        });
        self.telemetry.synced(reload, prefixes);
        result
    }

    fn sync_once(&mut self) -> SyncResult {
        let fresh = self.read_policy();
        let Some(policy) = fresh.clone().or_else(|| self.last_good.clone()) else {
            return SyncResult::ConfigRejected;
        };
        let started = std::time::Instant::now();
        let mut applied = self.dataplane.apply(&policy);
        if let Err(err) = &applied
            && let Some(why) = err.downcast_ref::<ebpf::Unavailable>()
            && let Some(opts) = self.fallback.take()
        {
            self.dataplane = fallback(opts, why);
            self.leftovers = leftovers_beside(self.dataplane.mode(), &self.bpffs);
            record_mode(&self.bpffs, self.dataplane.as_ref(), &self.policy_flags);
            self.telemetry.mode(self.dataplane.mode());
            applied = self.dataplane.apply(&policy);
        }
        self.telemetry.applied(started.elapsed());
        match applied {
            Ok(outcome) => {
                self.record_check(Check::Apply, None);
                match outcome {
                    ApplyOutcome::Applied => info!(
                        mode = %self.dataplane.mode(),
                        apply_ms = started.elapsed().as_secs_f64() * 1e3,
                        non_masq_v4 = %summarize(&policy.non_masq_v4),
                        non_masq_v6 = %policy.non_masq_v6.as_deref().map_or("disabled".into(), summarize),
                        masquerade_exceptions = %summarize(&exceptions(&policy)),
                        "policy applied"
                    ),
                    ApplyOutcome::Repaired => {
                        warn!("data plane was altered by someone else; restored the policy")
                    }
                    ApplyOutcome::Unchanged => {}
                }
                if fresh.is_some() {
                    self.last_good = Some(policy);
                    SyncResult::Synced(outcome)
                } else {
                    SyncResult::ConfigRejected
                }
            }
            Err(err) => {
                self.record_check(Check::Apply, Some(&err));
                SyncResult::ApplyFailed
            }
        }
    }

    fn read_policy(&mut self) -> Option<Policy> {
        match config::load(&self.config_path, &self.config_opts) {
            Ok(loaded) => {
                if self.config_problem.clear() {
                    info!("config is valid again");
                }
                let missing = matches!(loaded.source, ConfigSource::Missing);
                let mut notices = loaded.warnings.join("\n");
                if missing {
                    notices.push_str("\nmissing");
                }
                if notices.is_empty() {
                    self.config_notices.clear();
                } else if self.config_notices.is_new(&notices) {
                    for w in &loaded.warnings {
                        warn!("{w}");
                    }
                    if missing {
                        info!(path = %self.config_path.display(), "no config file, using defaults");
                    }
                }
                self.resync_interval = loaded.config.resync_interval;
                Some(Policy::from_config(&loaded.config, self.families))
            }
            Err(err) => {
                let message = err.to_string();
                if self.config_problem.is_new(&message) {
                    error!("invalid config, keeping the last good policy: {message}");
                }
                None
            }
        }
    }
}

/// Watches the directory holding the config file, or the config directory itself. Kubelet
/// updates a ConfigMap volume by swapping a symlink in that directory, so watching the file
/// itself would miss updates.
fn watch_config_dir(
    config_path: &Path,
    changed: mpsc::UnboundedSender<()>,
) -> notify::Result<notify::RecommendedWatcher> {
    let dir = match config_path.parent() {
        _ if config_path.is_dir() => config_path.to_path_buf(),
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        // Our own reads of the file show up as access events; they must not trigger a sync.
        if let Ok(event) = event
            && !matches!(event.kind, EventKind::Access(_))
        {
            let _ = changed.send(());
        }
    })?;
    watcher.watch(&dir, RecursiveMode::NonRecursive)?;
    Ok(watcher)
}

/// How long to wait before retrying a failed apply: one second, doubling each time, up to the
/// resync interval.
#[derive(Debug, Default)]
struct Backoff {
    failures: u32,
}

impl Backoff {
    const FIRST: Duration = Duration::from_secs(1);

    fn next(&mut self, ceiling: Duration) -> Duration {
        let wait = Self::FIRST.saturating_mul(1 << self.failures.min(16));
        self.failures += 1;
        wait.min(ceiling)
    }
}

/// Runs the daemon until SIGTERM or SIGINT, which leave the data plane in place, as upstream
/// does, so that traffic keeps flowing while the agent restarts.
pub async fn run(mut agent: Agent, config_path: PathBuf) -> anyhow::Result<()> {
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let (changed_tx, mut changed_rx) = mpsc::unbounded_channel();
    let mut watcher = None;
    let mut maintenance = tokio::time::interval(MAINTENANCE_INTERVAL);
    maintenance.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sync_due = true;
    // A resync (not a change of the file) checks what is installed against the kernel.
    let mut resync = true;
    let mut next_tick = Instant::now();
    let mut retry = Backoff::default();
    loop {
        agent.heartbeat();
        if watcher.is_none() {
            match watch_config_dir(&config_path, changed_tx.clone()) {
                Ok(w) => watcher = Some(w),
                Err(err) => warn!(
                    "cannot watch the config directory ({err}); relying on the resync interval"
                ),
            }
        }
        if sync_due {
            if resync {
                agent.dataplane.verify_next_apply();
            }
            let wait = match agent.sync() {
                // A held xtables lock or a busy kernel passes: try again soon, then less often.
                SyncResult::ApplyFailed => retry.next(agent.resync_interval()),
                _ => {
                    retry = Backoff::default();
                    agent.resync_interval()
                }
            };
            next_tick = Instant::now() + wait;
        }
        sync_due = true;
        resync = false;
        tokio::select! {
            _ = sigterm.recv() => { agent.leave("SIGTERM"); return Ok(()); }
            _ = sigint.recv() => { agent.leave("SIGINT"); return Ok(()); }
            Some(()) = changed_rx.recv() => {
                sleep(DEBOUNCE).await;
                while changed_rx.try_recv().is_ok() {}
            }
            _ = maintenance.tick() => {
                agent.maintain();
                sync_due = false;
            }
            _ = sleep_until(next_tick) => resync = true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_applies_are_retried_sooner_than_the_resync_then_less_and_less_often() {
        let mut retry = Backoff::default();
        let ceiling = Duration::from_secs(60);
        let waits: Vec<u64> = (0..8).map(|_| retry.next(ceiling).as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(
            Backoff::default().next(Duration::from_millis(500)),
            Duration::from_millis(500),
            "never later than the resync interval"
        );
        let mut long = Backoff { failures: 1000 };
        assert_eq!(
            long.next(ceiling),
            ceiling,
            "no overflow after many failures"
        );
    }
}

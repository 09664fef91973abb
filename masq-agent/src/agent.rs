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
    cli::{ChainFlags, ConfigFlags, DataplaneKind, Flags, MasqueradeFlags},
    config::{self, ConfigOptions, ConfigSource},
    dataplane::{
        ApplyOutcome, DataPlane, Mode,
        ebpf::{
            self, EbpfOptions,
            devices::Selection,
            leftovers::{Drain, Leftovers},
        },
        iptables::{ChainVariant, IptablesDataPlane},
        state,
    },
    netdev,
    policy::{IpFamilies, IpFamily, MasqueradeOptions, Policy},
    ports,
    privileges::{self, Effective},
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

pub fn masquerade_options(chain: &ChainFlags, masquerade: &MasqueradeFlags) -> MasqueradeOptions {
    MasqueradeOptions {
        chain: chain.masq_chain.clone(),
        random_fully: masquerade.random_fully,
        to_ports: masquerade.to_ports.clone(),
    }
}

/// The flags that shape the policy, as the running agent records them.
pub fn policy_flags(flags: &Flags) -> state::PolicyFlags {
    state::PolicyFlags {
        config: flags.config.path.clone(),
        masq_chain: flags.chain.masq_chain.clone(),
        nomasq_all_reserved_ranges: flags.config.nomasq_all_reserved_ranges,
        enable_ipv6: flags.config.enable_ipv6,
    }
}

pub fn config_options(config: &ConfigFlags) -> ConfigOptions {
    ConfigOptions {
        nomasq_all_reserved_ranges: config.nomasq_all_reserved_ranges,
        enable_ipv6: config.enable_ipv6,
    }
}

/// What the agent starts from: the flags, with `--enable-ipv6` as the config file's
/// `enableIPv6` says when it says (the eBPF data plane sizes its IPv6 NAT table when it loads),
/// and the number of policy entries the file asks for (it sizes the decision counters). A
/// file that cannot be read leaves the flag as it is, and counts no entry.
pub struct Start {
    pub flags: Flags,
    pub policy_entries: usize,
}

impl Start {
    pub fn from_the_file(flags: &Flags) -> Start {
        let mut flags = flags.clone();
        let mut policy_entries = 0;
        let config = &mut flags.config;
        if let Ok(loaded) = config::load(&config.path, &config_options(config)) {
            let families = config.families().as_the_file_says(&loaded.config);
            config.enable_ipv6 = families.contains(IpFamily::Ipv6);
            let policy = Policy::from_config(&loaded.config, families);
            policy_entries = [IpFamily::Ipv4, IpFamily::Ipv6]
                .into_iter()
                .map(|family| {
                    let destinations = policy.rules(family).map_or(0, |rules| rules.len());
                    destinations + policy.source_rules(family).len()
                })
                .sum();
        }
        Start {
            flags,
            policy_entries,
        }
    }
}

/// Builds the data plane the flags ask for, falling back to the full iptables chain when the
/// eBPF one cannot run and the flags allow it.
pub fn build_dataplane(start: &Start) -> anyhow::Result<Box<dyn DataPlane>> {
    let flags = &start.flags;
    let opts = masquerade_options(&flags.chain, &flags.masquerade);
    let capabilities = Effective::of_this_process().ok();
    if let Some(missing) = capabilities.map(|c| c.missing(&privileges::FOR_THE_CHAIN))
        && !missing.is_empty()
    {
        anyhow::bail!(
            "the process lacks {}, which iptables, ip6tables and ipset need: add {} to the \
             container's capabilities (deploy/daemonset.yaml lists what the agent needs)",
            privileges::listed(&missing),
            if missing.len() == 1 { "it" } else { "them" }
        );
    }
    match flags.masquerade.dataplane {
        DataplaneKind::Iptables => Ok(Box::new(IptablesDataPlane::new(
            opts,
            ChainVariant::Full,
            Mode::Iptables,
        ))),
        DataplaneKind::Ebpf => {
            match ebpf_options(start, capabilities).and_then(|o| ebpf::new(&o)) {
                Ok(plane) => Ok(Box::new(plane)),
                Err(why) if flags.daemon.fallback_to_iptables => Ok(fallback(opts, &why)),
                Err(why) => Err(anyhow::Error::from(why).context("--fallback-to-iptables=false")),
            }
        }
    }
}

fn fallback(opts: MasqueradeOptions, why: &ebpf::Unavailable) -> Box<dyn DataPlane> {
    warn!("falling back to the full iptables chain: {why}");
    Box::new(IptablesDataPlane::fallback(opts, why.to_string()))
}

/// The devices the eBPF programs go on: each `--interface`, or else those of the default routes.
pub fn device_selection(masquerade: &MasqueradeFlags, families: IpFamilies) -> Selection {
    Selection::new(&masquerade.interfaces, families)
}

/// The eBPF data plane's options; without the node's ephemeral port range, the programs would
/// not know which ports are free for NAT, so the data plane cannot run.
/// `capabilities`: the process's, when they could be read.
fn ebpf_options(
    start: &Start,
    capabilities: Option<Effective>,
) -> Result<EbpfOptions, ebpf::Unavailable> {
    let flags = &start.flags;
    if let Some(missing) = capabilities.map(Effective::missing_for_the_programs)
        && !missing.is_empty()
    {
        return Err(ebpf::Unavailable(anyhow::anyhow!(
            "the process lacks {}, which loading the programs and their maps needs (or \
             CAP_SYS_ADMIN, on kernels before 5.8)",
            privileges::listed(&missing)
        )));
    }
    let ephemeral = netdev::ephemeral_port_range().map_err(ebpf::Unavailable)?;
    Ok(EbpfOptions {
        bpffs: flags.pins.bpffs.clone(),
        devices: device_selection(&flags.masquerade, flags.config.families()),
        nat_capacity: flags.daemon.nat_capacity.saturating_mul(2),
        port_spans: ports::nat_port_spans(flags.masquerade.to_ports.as_ref(), ephemeral),
        random_fully: flags.masquerade.random_fully,
        masquerade: masquerade_options(&flags.chain, &flags.masquerade),
        families: flags.config.families(),
        policy_entries: start.policy_entries,
        node_port_range: flags.daemon.node_port_range.0,
    })
}

/// What an eBPF data plane left under `bpffs`, to drain while the data plane in force (`mode`)
/// is another.
fn leftovers_beside(mode: Mode, bpffs: &Path) -> Option<Leftovers> {
    let found = (mode != Mode::Ebpf)
        .then(|| Leftovers::find(bpffs))
        .flatten();
    if found.is_some() {
        info!(
            "the eBPF data plane's programs stay until the flows they translate end; their \
             tables are swept meanwhile"
        );
    }
    found
}

fn record_mode(bpffs: &Path, dataplane: &dyn DataPlane, flags: &state::PolicyFlags) {
    if let Err(err) = state::record(
        bpffs,
        dataplane.mode(),
        dataplane.mode_reason(),
        flags.clone(),
    ) {
        warn!("cannot record the data plane mode for `status`: {err}");
    }
}

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
        for (family, label) in [(IpFamily::Ipv4, "ipv4"), (IpFamily::Ipv6, "ipv6")] {
            let in_use = in_force.of(family).is_some();
            self.telemetry.masquerade_address(label, in_use);
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

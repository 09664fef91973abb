//! `masq-agent`: the daemon (no subcommand) and its subcommands, `check-config`,
//! `render-iptables`, `status`, `explain` and `cleanup`. Flags are read as upstream reads its
//! own; the work is the library's.

use std::{io::IsTerminal as _, process::ExitCode, sync::Arc};

use clap::{ArgMatches, parser::ValueSource};
use masq_agent::{
    agent::{self, Agent},
    cli::{
        ChainFlags, Cli, Command, ConfigFlags, DataplaneKind, Flags, LogFlags, LogFormat,
        MasqueradeFlags, PinFlags, klog,
    },
    config::{self, ConfigSource},
    dataplane::{
        self,
        chosen_address::{self, ChosenAddresses},
        ebpf::{devices, expiry, flow_table, flows},
        iptables::{self, Capabilities, ChainVariant},
    },
    explain, netdev,
    policy::{IpFamily, Policy},
    telemetry::{self, Telemetry},
};
use tracing::{error, warn};

fn main() -> ExitCode {
    // A usage error exits 2, as clap's and Go's flag package's do; help and version exit 0.
    let (cli, matches) = Cli::parse_args(std::env::args()).unwrap_or_else(|err| err.exit());
    init_logging(&cli.flags.logging);
    let ignored = klog::ignored_given(&matches);
    if !ignored.is_empty() {
        warn!(
            "klog flags ignored: {} (masq-agent logs to stderr only, at the verbosity -v or \
             RUST_LOG sets)",
            ignored.join(", ")
        );
    }
    if cli.command.is_some() {
        // A command's output piped into `head` ends quietly where the reader stops, as other
        // command-line tools' do; the daemon keeps Rust's default, which ignores the signal.
        // SAFETY: restoring a signal's default disposition, before any other thread exists.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let result = match cli.command {
        None => run_daemon(&cli.flags),
        Some(Command::CheckConfig { config }) => check_config(&config),
        Some(Command::RenderIptables {
            family,
            config,
            chain,
            masquerade,
        }) => {
            // The chain the eBPF data plane installs is shown only on request, so that plain
            // `render-iptables` prints upstream's chain, as upstream would apply it.
            let beside_programs = given_on_command_line(&matches, "dataplane")
                && masquerade.dataplane == DataplaneKind::Ebpf;
            chain_variant(&config, &masquerade, family, beside_programs)
                .and_then(|variant| render_iptables(&config, &chain, &masquerade, family, &variant))
        }
        Some(Command::Status {
            report,
            chain,
            pins,
        }) => {
            let (config, chain) = as_the_running_agent(cli.flags.config, chain, &pins, &matches);
            status(&config, &chain, &pins, report.json)
        }
        Some(Command::Explain {
            destination,
            src,
            proto,
            port,
            report,
            config,
            chain,
            pins,
        }) => {
            let packet = explain::Packet {
                destination,
                source: src,
                protocol: proto,
                port,
            };
            let (config, chain) = as_the_running_agent(config, chain, &pins, &matches);
            explain(&config, &chain, &pins, packet, report.json)
        }
        Some(Command::Cleanup { chain, pins }) => cleanup(&chain, &pins),
        Some(Command::Flows {
            pod,
            destination,
            kind,
            proto,
            report,
            pins,
        }) => {
            let filter = flows::Filter {
                source: pod,
                destination,
                kind,
                proto,
            };
            list_flows(&filter, &pins, report.json)
        }
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            error!("{err:#}");
            ExitCode::from(1)
        }
    }
}

/// Logs to stderr at the level `-v` asks for, unless RUST_LOG says otherwise.
fn init_logging(logging: &LogFlags) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(logging.level().as_str()));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match logging.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn run_daemon(flags: &Flags) -> anyhow::Result<ExitCode> {
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        ?flags,
        "masq-agent starting"
    );
    let telemetry = Arc::new(Telemetry::new(flags.pins.bpffs.clone()));
    for (addr, endpoints) in telemetry::Endpoints::listeners(&flags.daemon) {
        telemetry::serve(addr, endpoints, telemetry.clone())?;
    }
    let dataplane = agent::build_dataplane(&agent::Start::from_the_file(flags))?;
    let mut agent = Agent::new(flags, dataplane, telemetry);
    if flags.daemon.once {
        return Ok(match agent.sync() {
            agent::SyncResult::Synced(_) => ExitCode::SUCCESS,
            _ => ExitCode::from(1),
        });
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(agent::run(agent, flags.config.path.clone()))?;
    Ok(ExitCode::SUCCESS)
}

/// The config file, for a command that reads it once; on a file the agent would refuse, the
/// exit code, having said why.
fn load_config(config: &ConfigFlags) -> Result<config::Loaded, ExitCode> {
    config::load(&config.path, &agent::config_options(config)).map_err(|err| {
        eprintln!("error: {err}");
        ExitCode::from(1)
    })
}

fn check_config(config: &ConfigFlags) -> anyhow::Result<ExitCode> {
    let loaded = match load_config(config) {
        Ok(loaded) => loaded,
        Err(code) => return Ok(code),
    };
    // Upstream runs on its defaults without a file; a mistyped path is worth a word.
    if loaded.source == ConfigSource::Missing && !config.path.is_dir() {
        eprintln!("no file at {}: the defaults apply", config.path.display());
    }
    for warning in &loaded.warnings {
        eprintln!("warning: {warning}");
    }
    if let Some(enable) = loaded.config.enable_ipv6 {
        eprintln!(
            "enableIPv6: {enable}, from the config file (over --enable-ipv6={})",
            config.enable_ipv6
        );
    }
    if loaded.source == ConfigSource::Directory {
        let files: Vec<String> = loaded
            .files
            .iter()
            .map(|f| f.display().to_string())
            .collect();
        eprintln!("merged {} files: {}", files.len(), files.join(", "));
    }
    println!(
        "{}",
        serde_json::to_string_pretty(&loaded.config.to_upstream_json())?
    );
    Ok(ExitCode::SUCCESS)
}

/// Whether `--<id>` was given, before or after the subcommand.
fn given_on_command_line(matches: &ArgMatches, id: &str) -> bool {
    let explicit = |m: &ArgMatches| m.value_source(id) == Some(ValueSource::CommandLine);
    explicit(matches) || matches.subcommand().is_some_and(|(_, sub)| explicit(sub))
}

/// Upstream's chain, or the eBPF data plane's for the devices it would put its programs on now.
fn chain_variant(
    config: &ConfigFlags,
    masquerade: &MasqueradeFlags,
    family: IpFamily,
    beside_programs: bool,
) -> anyhow::Result<ChainVariant> {
    if !beside_programs {
        return Ok(ChainVariant::Full);
    }
    let selection = agent::device_selection(masquerade, config.families());
    let returned = devices::returned_now(&selection, config.families())?;
    Ok(returned.variant(family))
}

fn render_iptables(
    config: &ConfigFlags,
    chain: &ChainFlags,
    masquerade: &MasqueradeFlags,
    family: IpFamily,
    variant: &ChainVariant,
) -> anyhow::Result<ExitCode> {
    let loaded = match load_config(config) {
        Ok(loaded) => loaded,
        Err(code) => return Ok(code),
    };
    let policy = Policy::from_config(&loaded.config, config.families());
    let Some(text) = iptables::render(
        family,
        &policy,
        &agent::masquerade_options(chain, masquerade),
        Capabilities::detect(family),
        variant,
        // What the agent would install now: the chosen address only if the node holds it.
        ChosenAddresses::held(&policy, &netdev::local_addresses()?).of(family),
    ) else {
        // The file is fine: the command line asked for what it does not enable, a usage error.
        eprintln!(
            "error: --family ipv6 needs IPv6 enabled: pass --enable-ipv6, or set enableIPv6 \
             in the config file"
        );
        return Ok(ExitCode::from(2));
    };
    print!("{text}");
    Ok(ExitCode::SUCCESS)
}

fn status(
    config: &ConfigFlags,
    chain: &ChainFlags,
    pins: &PinFlags,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let mut status = dataplane::inspect(&chain.masq_chain, &pins.bpffs)?;
    // A chosen address the node does not hold is the config's and the node's to tell, not
    // what is installed: the programs and the chain then hold the device's address.
    if let Ok(loaded) = config::load(&config.path, &agent::config_options(config)) {
        // The file's enableIPv6 over the flag, as the agent reads it.
        let policy = Policy::from_config(&loaded.config, config.families());
        status.notes.extend(chosen_address::not_held_notes(
            &policy,
            &netdev::local_addresses()?,
        ));
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print!("{status}");
    }
    Ok(ExitCode::SUCCESS)
}

fn list_flows(filter: &flows::Filter, pins: &PinFlags, json: bool) -> anyhow::Result<ExitCode> {
    // The node's conntrack timeouts, as the agent reads them.
    let timeouts = expiry::Timeouts::of_conntrack(std::path::Path::new(expiry::CONNTRACK_SYSCTLS));
    let now = flow_table::monotonic_now_ns();
    let Some(flows) = flows::read(&pins.bpffs, filter, &timeouts, now)? else {
        anyhow::bail!(
            "no eBPF data plane is pinned under {}: with the iptables data plane, conntrack \
             holds the flows (conntrack -L)",
            pins.bpffs.display()
        );
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&flows)?);
    } else {
        for flow in &flows {
            println!("{flow}");
        }
        let plural = if flows.len() == 1 { "" } else { "s" };
        println!("{} flow{plural}", flows.len());
    }
    Ok(ExitCode::SUCCESS)
}

/// The config and chain flags, with the running agent's where the command line does not give
/// them: `explain` answers for the agent running here, as `kubectl exec` runs it without the
/// daemon's arguments.
fn as_the_running_agent(
    mut config: ConfigFlags,
    mut chain: ChainFlags,
    pins: &PinFlags,
    matches: &ArgMatches,
) -> (ConfigFlags, ChainFlags) {
    let Some(agent) = dataplane::state::read(&pins.bpffs).and_then(|r| r.flags) else {
        return (config, chain);
    };
    let given = |id: &str| given_on_command_line(matches, id);
    if !given("config") {
        config.path = agent.config;
    }
    if !given("masq_chain") {
        chain.masq_chain = agent.masq_chain;
    }
    if !given("nomasq_all_reserved_ranges") {
        config.nomasq_all_reserved_ranges = agent.nomasq_all_reserved_ranges;
    }
    if !given("enable_ipv6") {
        config.enable_ipv6 = agent.enable_ipv6;
    }
    (config, chain)
}

fn explain(
    config: &ConfigFlags,
    chain: &ChainFlags,
    pins: &PinFlags,
    packet: explain::Packet,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let loaded = match load_config(config) {
        Ok(loaded) => loaded,
        Err(code) => return Ok(code),
    };
    let opts = agent::config_options(config);
    let explanation = explain::explain(packet, &loaded, &opts, &chain.masq_chain, &pins.bpffs)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&explanation)?);
    } else {
        print!("{explanation}");
    }
    let disagreements = explanation.disagreements();
    for answer in &disagreements {
        eprintln!(
            "error: {} disagree with the config: {}",
            answer.source, answer.detail
        );
    }
    Ok(if disagreements.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn cleanup(chain: &ChainFlags, pins: &PinFlags) -> anyhow::Result<ExitCode> {
    let cleaned = dataplane::cleanup_all(&chain.masq_chain, &pins.bpffs)?;
    print!("{cleaned}");
    Ok(ExitCode::SUCCESS)
}

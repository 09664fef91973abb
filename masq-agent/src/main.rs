//! `masq-agent`: the daemon (no subcommand) and its subcommands, `check-config`,
//! `render-iptables`, `status` and `cleanup`. Flags are read as upstream reads its own; the work
//! is the library's.

use std::{io::IsTerminal as _, process::ExitCode, sync::Arc};

use clap::{ArgMatches, CommandFactory as _, FromArgMatches as _, parser::ValueSource};
use masq_agent::{
    agent::{self, Agent},
    cli::{Cli, Command, DataplaneKind, Flags, LogFormat, normalize_go_flags},
    config::{self, ConfigSource},
    dataplane::{
        self,
        ebpf::devices,
        iptables::{self, Capabilities, ChainVariant},
    },
    explain,
    policy::{IpFamily, Policy},
    telemetry::{self, Telemetry},
};
use tracing::error;

fn main() -> ExitCode {
    let parsed = Cli::command()
        .try_get_matches_from(normalize_go_flags(std::env::args()))
        .and_then(|matches| Ok((Cli::from_arg_matches(&matches)?, matches)));
    let (cli, matches) = match parsed {
        Ok(parsed) => parsed,
        Err(err) => {
            let _ = err.print();
            // Help and version are not errors; anything else, including an invalid
            // --to-ports, is a configuration error and exits 1.
            return if err.use_stderr() {
                ExitCode::from(1)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    init_logging(cli.flags.log_format);
    let result = match cli.command {
        None => run_daemon(&cli.flags),
        Some(Command::CheckConfig) => check_config(&cli.flags),
        Some(Command::RenderIptables { family }) => {
            // The chain the eBPF data plane installs is shown only on request, so that plain
            // `render-iptables` prints upstream's chain, as upstream would apply it.
            let beside_programs = given_on_command_line(&matches, "dataplane")
                && cli.flags.dataplane == DataplaneKind::Ebpf;
            chain_variant(&cli.flags, family, beside_programs)
                .and_then(|variant| render_iptables(&cli.flags, family, &variant))
        }
        Some(Command::Status { json }) => status(&cli.flags, json),
        Some(Command::Explain {
            destination,
            src,
            proto,
            port,
            json,
        }) => {
            let packet = explain::Packet {
                destination,
                source: src,
                protocol: proto,
                port,
            };
            explain(&as_the_running_agent(&cli.flags, &matches), packet, json)
        }
        Some(Command::Cleanup) => cleanup(&cli.flags),
    };
    match result {
        Ok(code) => code,
        Err(err) => {
            error!("{err:#}");
            ExitCode::from(1)
        }
    }
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
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
    let telemetry = Arc::new(Telemetry::new(flags.bpffs.clone()));
    if let Some(addr) = flags.metrics_addr {
        telemetry::serve(addr, telemetry.clone())?;
    }
    let dataplane = agent::build_dataplane(&agent::Start::from_the_file(flags))?;
    let mut agent = Agent::new(flags, dataplane, telemetry);
    if flags.once {
        return Ok(match agent.sync() {
            agent::SyncResult::Synced(_) => ExitCode::SUCCESS,
            _ => ExitCode::from(1),
        });
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(agent::run(agent, flags.config.clone()))?;
    Ok(ExitCode::SUCCESS)
}

fn check_config(flags: &Flags) -> anyhow::Result<ExitCode> {
    match config::load(&flags.config, &agent::config_options(flags)) {
        Ok(loaded) => {
            for warning in &loaded.warnings {
                eprintln!("warning: {warning}");
            }
            if let Some(enable) = loaded.config.enable_ipv6 {
                eprintln!(
                    "enableIPv6: {enable}, from the config file (over --enable-ipv6={})",
                    flags.enable_ipv6
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
        Err(err) => {
            eprintln!("error: {err}");
            Ok(ExitCode::from(1))
        }
    }
}

/// Whether `--<id>` was given, before or after the subcommand.
fn given_on_command_line(matches: &ArgMatches, id: &str) -> bool {
    let explicit = |m: &ArgMatches| m.value_source(id) == Some(ValueSource::CommandLine);
    explicit(matches) || matches.subcommand().is_some_and(|(_, sub)| explicit(sub))
}

/// Upstream's chain, or the eBPF data plane's for the devices it would put its programs on now.
fn chain_variant(
    flags: &Flags,
    family: IpFamily,
    beside_programs: bool,
) -> anyhow::Result<ChainVariant> {
    if !beside_programs {
        return Ok(ChainVariant::Full);
    }
    let returned = devices::returned_now(&agent::device_selection(flags), flags.enable_ipv6)?;
    Ok(returned.variant(family))
}

fn render_iptables(
    flags: &Flags,
    family: IpFamily,
    variant: &ChainVariant,
) -> anyhow::Result<ExitCode> {
    let loaded = match config::load(&flags.config, &agent::config_options(flags)) {
        Ok(loaded) => loaded,
        Err(err) => {
            eprintln!("error: {err}");
            return Ok(ExitCode::from(1));
        }
    };
    let policy = Policy::from_config(&loaded.config, flags.enable_ipv6);
    let Some(text) = iptables::render(
        family,
        &policy,
        &agent::masquerade_options(flags),
        Capabilities::detect(family),
        variant,
    ) else {
        eprintln!("error: IPv6 is not enabled; pass --enable-ipv6 to render the ip6tables chain");
        return Ok(ExitCode::from(1));
    };
    print!("{text}");
    Ok(ExitCode::SUCCESS)
}

fn status(flags: &Flags, json: bool) -> anyhow::Result<ExitCode> {
    let status = dataplane::inspect(&flags.masq_chain, &flags.bpffs)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print!("{status}");
    }
    Ok(ExitCode::SUCCESS)
}

/// `flags`, with the running agent's config, chain and policy flags where the command line does
/// not give them: `explain` answers for the agent running here, as `kubectl exec` runs it
/// without the daemon's arguments.
fn as_the_running_agent(flags: &Flags, matches: &ArgMatches) -> Flags {
    let mut flags = flags.clone();
    let Some(agent) = dataplane::state::read(&flags.bpffs).and_then(|r| r.flags) else {
        return flags;
    };
    let given = |id: &str| given_on_command_line(matches, id);
    if !given("config") {
        flags.config = agent.config;
    }
    if !given("masq_chain") {
        flags.masq_chain = agent.masq_chain;
    }
    if !given("nomasq_all_reserved_ranges") {
        flags.nomasq_all_reserved_ranges = agent.nomasq_all_reserved_ranges;
    }
    if !given("enable_ipv6") {
        flags.enable_ipv6 = agent.enable_ipv6;
    }
    flags
}

fn explain(flags: &Flags, packet: explain::Packet, json: bool) -> anyhow::Result<ExitCode> {
    let opts = agent::config_options(flags);
    let loaded = match config::load(&flags.config, &opts) {
        Ok(loaded) => loaded,
        Err(err) => {
            eprintln!("error: {err}");
            return Ok(ExitCode::from(1));
        }
    };
    let explanation = explain::explain(packet, &loaded, &opts, &flags.masq_chain, &flags.bpffs)?;
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

fn cleanup(flags: &Flags) -> anyhow::Result<ExitCode> {
    dataplane::cleanup_all(&flags.masq_chain, &flags.bpffs)?;
    eprintln!(
        "removed the eBPF programs and pins under {}, and chain {} with its POSTROUTING jump",
        flags.bpffs.display(),
        flags.masq_chain
    );
    Ok(ExitCode::SUCCESS)
}

//! The command line: upstream's flags with upstream's names, defaults and Go-style booleans, plus
//! masq-agent's own flags and subcommands.

pub mod klog;

use std::{net::SocketAddr, path::PathBuf};

use clap::{
    Arg, ArgMatches, Args, CommandFactory as _, FromArgMatches as _, Parser, Subcommand, ValueEnum,
};

use crate::{
    config::parse_go_bool,
    policy::{IpFamilies, IpFamily},
    ports::PortRanges,
};

#[derive(Debug, Parser)]
#[command(
    name = "masq-agent",
    version,
    about = "Masquerades pod traffic leaving the node, except to non-masquerade CIDRs \
             (a drop-in replacement for ip-masq-agent with an eBPF data plane)."
)]
pub struct Cli {
    #[command(flatten)]
    pub flags: Flags,
    #[command(subcommand)]
    pub command: Option<Command>,
}

impl Cli {
    /// The command line: the derived one, with klog's flags. A subcommand takes every flag of
    /// the agent, before or after its name, since scripts give it the DaemonSet's flags; but its
    /// help lists only the flags it declares, and the logging flags, which every command uses.
    /// clap copies each global flag, visible, into every subcommand that lacks it: a hidden
    /// copy, added here first, takes the place of each flag a subcommand does not declare.
    pub fn command_line() -> clap::Command {
        let cli = Cli::command().args(klog::args());
        let logging = LogFlags::augment_args(clap::Command::new("logging"));
        let is_logging = |flag: &Arg| logging.get_arguments().any(|l| l.get_id() == flag.get_id());
        let hidden: Vec<Arg> = cli
            .get_arguments()
            .filter(|flag| !is_logging(flag))
            .map(|flag| flag.clone().hide(true))
            .collect();
        cli.mut_subcommands(|sub| {
            let undeclared: Vec<Arg> = hidden
                .iter()
                .filter(|flag| sub.get_arguments().all(|own| own.get_id() != flag.get_id()))
                .cloned()
                .collect();
            sub.args(undeclared)
        })
    }

    /// Parses the command line, Go's single-dash flags too; the matches say which flags were
    /// given.
    pub fn parse_args(
        args: impl IntoIterator<Item = String>,
    ) -> Result<(Cli, ArgMatches), clap::Error> {
        let matches = Cli::command_line().try_get_matches_from(normalize_go_flags(args))?;
        Ok((Cli::from_arg_matches(&matches)?, matches))
    }
}

/// Each subcommand flattens the groups of flags it uses, so that its help lists them.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Parse and validate the config file, then print the effective config as JSON.
    CheckConfig {
        #[command(flatten)]
        config: ConfigFlags,
    },
    /// Print the iptables-restore input that the data plane applies.
    RenderIptables {
        /// The chain of which family: ipv4 for iptables, ipv6 for ip6tables.
        #[arg(long, value_enum, default_value_t = IpFamily::Ipv4)]
        family: IpFamily,
        #[command(flatten)]
        config: ConfigFlags,
        #[command(flatten)]
        chain: ChainFlags,
        #[command(flatten)]
        masquerade: MasqueradeFlags,
    },
    /// Show what is installed: data plane, chain, prefixes, counters.
    Status {
        #[command(flatten)]
        report: ReportFlags,
        #[command(flatten)]
        chain: ChainFlags,
        #[command(flatten)]
        pins: PinFlags,
    },
    /// Remove everything the agent installed.
    Cleanup {
        #[command(flatten)]
        chain: ChainFlags,
        #[command(flatten)]
        pins: PinFlags,
    },
    /// List the NAT table's flows, as `conntrack -L` lists its entries: each as it left, what
    /// it is translated to, whose it is, its state, how long it has been idle, and when it
    /// expires. The eBPF data plane's only: the chain's flows are conntrack's.
    Flows {
        /// Only the flows from this address: a pod's (or the node's, for its own).
        #[arg(long, visible_alias = "source", value_name = "ADDRESS")]
        pod: Option<std::net::IpAddr>,
        /// Only the flows to this address, or into this prefix.
        #[arg(long, value_name = "ADDRESS|PREFIX", value_parser = parse_destination)]
        destination: Option<ipnet::IpNet>,
        /// Only the flows of this kind.
        #[arg(long, value_enum)]
        kind: Option<crate::dataplane::FlowKind>,
        /// Only the flows of this protocol: tcp, udp, icmp, or a protocol number.
        #[arg(long, value_parser = parse_protocol)]
        proto: Option<u8>,
        #[command(flatten)]
        report: ReportFlags,
        #[command(flatten)]
        pins: PinFlags,
    },
    /// Explain what happens to a packet from a pod to DESTINATION, and why; where a data plane
    /// is installed, check that it does the same (exit 1 if it does not).
    Explain {
        /// The packet's destination address.
        destination: std::net::IpAddr,
        /// The packet's source: a pod's address (the node's own are never masqueraded).
        #[arg(long)]
        src: Option<std::net::IpAddr>,
        /// The protocol: tcp, udp, icmp, or a protocol number.
        #[arg(long, default_value = "tcp", value_parser = parse_protocol)]
        proto: u8,
        /// The destination port (it does not change the decision).
        #[arg(long)]
        port: Option<u16>,
        #[command(flatten)]
        report: ReportFlags,
        #[command(flatten)]
        config: ConfigFlags,
        #[command(flatten)]
        chain: ChainFlags,
        #[command(flatten)]
        pins: PinFlags,
    },
}

/// A destination as `flows --destination` takes it: a prefix, or one address.
fn parse_destination(s: &str) -> Result<ipnet::IpNet, String> {
    s.parse::<ipnet::IpNet>()
        .or_else(|_| s.parse::<std::net::IpAddr>().map(ipnet::IpNet::from))
        .map_err(|_| format!("{s:?} is neither an address nor a prefix"))
}

/// A protocol by name or number, as `--proto` takes it.
fn parse_protocol(s: &str) -> Result<u8, String> {
    crate::protocols::number(s)
        .ok_or_else(|| format!("{s:?} is not tcp, udp, icmp or a protocol number"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DataplaneKind {
    Ebpf,
    Iptables,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// The agent's flags, in groups by what uses them. Each flag is global, so that its value,
/// given before or after a subcommand, reaches the subcommand's copy of its group.
#[derive(Debug, Clone, Args)]
pub struct Flags {
    #[command(flatten)]
    pub config: ConfigFlags,
    #[command(flatten)]
    pub chain: ChainFlags,
    #[command(flatten)]
    pub masquerade: MasqueradeFlags,
    #[command(flatten)]
    pub pins: PinFlags,
    #[command(flatten)]
    pub daemon: DaemonFlags,
    #[command(flatten)]
    pub logging: LogFlags,
}

/// The config file, and the flags that change how it reads.
#[derive(Debug, Clone, Args)]
pub struct ConfigFlags {
    /// The ConfigMap file (YAML or JSON), or a directory of ip-masq* files.
    #[arg(
        id = "config",
        long = "config",
        value_name = "PATH",
        global = true,
        default_value = "/etc/config/ip-masq-agent"
    )]
    pub path: PathBuf,

    /// Whether to disable masquerade for all IPv4 ranges reserved by RFCs.
    #[arg(long, global = true, default_value = "false", num_args = 0..=1,
          require_equals = true, default_missing_value = "true", value_name = "BOOL",
          value_parser = parse_go_bool)]
    pub nomasq_all_reserved_ranges: bool,

    /// Whether to enable IPv6.
    #[arg(long, global = true, default_value = "false", num_args = 0..=1,
          require_equals = true, default_missing_value = "true", value_name = "BOOL",
          value_parser = parse_go_bool)]
    pub enable_ipv6: bool,
}

impl ConfigFlags {
    /// The families `--enable-ipv6` asks for.
    pub fn families(&self) -> IpFamilies {
        IpFamilies::with_ipv6(self.enable_ipv6)
    }
}

/// The nat chain the agent owns.
#[derive(Debug, Clone, Args)]
pub struct ChainFlags {
    /// Name of nat chain for iptables masquerade rules.
    #[arg(long, global = true, value_name = "NAME", default_value = "IP-MASQ-AGENT",
          value_parser = parse_chain_name)]
    pub masq_chain: String,
}

/// How masqueraded traffic is translated, and by which data plane on which devices.
#[derive(Debug, Clone, Args)]
pub struct MasqueradeFlags {
    /// Which data plane enforces the policy.
    #[arg(long, global = true, value_enum, default_value_t = DataplaneKind::Ebpf)]
    pub dataplane: DataplaneKind,

    /// Interface to attach to (repeatable). Default: the devices that hold a default route,
    /// followed as routes change. Traffic leaving by other devices is masqueraded by the chain.
    #[arg(long = "interface", value_name = "IF", global = true)]
    pub interfaces: Vec<String>,

    /// Whether to add --random-fully to the masquerade rule.
    #[arg(long, global = true, default_value = "true", num_args = 0..=1,
          require_equals = true, default_missing_value = "true", value_name = "BOOL",
          value_parser = parse_go_bool)]
    pub random_fully: bool,

    /// Port ranges to masquerade to, e.g. 1024-29999,32768-65535.
    #[arg(long, global = true, value_name = "RANGES", value_parser = PortRanges::parse_flag)]
    pub to_ports: Option<PortRanges>,
}

/// Where the eBPF data plane's maps and links are pinned.
#[derive(Debug, Clone, Args)]
pub struct PinFlags {
    /// Directory under the BPF filesystem where maps and links are pinned.
    #[arg(
        long,
        global = true,
        value_name = "DIR",
        default_value = "/sys/fs/bpf/ip-masq-agent"
    )]
    pub bpffs: PathBuf,
}

/// What only the running agent uses.
#[derive(Debug, Clone, Args)]
pub struct DaemonFlags {
    /// Fall back to the full iptables chain when the eBPF data plane cannot run.
    #[arg(long, global = true, default_value = "true", num_args = 0..=1,
          require_equals = true, default_missing_value = "true", value_name = "BOOL",
          value_parser = parse_go_bool)]
    pub fallback_to_iptables: bool,

    /// Flows the eBPF NAT table holds (two entries each; the slot table has room for 8/5
    /// of them); when full, new flows are dropped and counted while existing ones keep working.
    #[arg(long, global = true, value_name = "FLOWS", default_value_t = 262_144,
          value_parser = clap::value_parser!(u32).range(1..=8_388_608))]
    pub nat_capacity: u32,

    /// The cluster's NodePort range (the API server's service-node-port-range), or none: the
    /// eBPF data plane never gives these ports to masqueraded flows, nor those the node's
    /// sockets listen on, so that the node's replies on them need no NAT entry.
    #[arg(long, global = true, value_name = "RANGE", default_value = "30000-32767",
          value_parser = crate::ports::parse_node_port_range)]
    pub node_port_range: crate::ports::NodePortRange,

    /// Address to serve metrics and health endpoints on: ADDR:PORT, or :PORT for every
    /// address, as Go's listeners take it.
    #[arg(long, global = true, value_name = "ADDR:PORT", value_parser = parse_listen_addr)]
    pub metrics_addr: Option<SocketAddr>,

    /// Address to serve /healthz and /readyz on instead of --metrics-addr, which then serves
    /// /metrics alone: 127.0.0.1:PORT keeps them off the network (kubelet's probes can name
    /// the host).
    #[arg(long, global = true, value_name = "ADDR:PORT", value_parser = parse_listen_addr)]
    pub health_addr: Option<SocketAddr>,

    /// Sync once, leave the data plane in place, and exit.
    #[arg(long, global = true)]
    pub once: bool,
}

/// How every command logs: to stderr, in this format, at this verbosity.
#[derive(Debug, Clone, Args)]
pub struct LogFlags {
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Log verbosity, as klog's: up to 3 logs info and above, 4 debug, 5 and more trace.
    /// RUST_LOG, when set, decides instead.
    #[arg(short = 'v', long = "v", value_name = "N", global = true)]
    pub verbosity: Option<i32>,
}

impl LogFlags {
    /// The least level logged for `-v`, read as Kubernetes' logging conventions read it: up to
    /// 3 is what an operator wants to see, 4 is debugging, 5 tracing.
    pub fn level(&self) -> tracing::Level {
        match self.verbosity.unwrap_or(0) {
            ..=3 => tracing::Level::INFO,
            4 => tracing::Level::DEBUG,
            _ => tracing::Level::TRACE,
        }
    }
}

/// How a report is printed.
#[derive(Debug, Clone, Args)]
pub struct ReportFlags {
    /// Print JSON, for scripts, instead of text.
    #[arg(long)]
    pub json: bool,
}

/// An address to listen on, as Go's listeners take it: `ADDR:PORT`, or `:PORT` for every
/// address of both families (`[::]`, which takes IPv4 too).
fn parse_listen_addr(s: &str) -> Result<SocketAddr, String> {
    match s.strip_prefix(':') {
        Some(port) => port
            .parse()
            .map(|port| SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port)))
            .map_err(|_| format!("{s:?} is not :PORT")),
        None => s
            .parse()
            .map_err(|_| format!("{s:?} is not ADDR:PORT or :PORT")),
    }
}

/// iptables limits chain names to 28 characters and treats a leading dash as an option.
fn parse_chain_name(s: &str) -> Result<String, String> {
    const MAX_CHAIN_NAME: usize = 28;
    if s.is_empty() || s.len() > MAX_CHAIN_NAME {
        return Err(format!(
            "chain name {s:?} must be 1 to {MAX_CHAIN_NAME} characters"
        ));
    }
    if s.starts_with('-') || !s.chars().all(|c| c.is_ascii_graphic()) {
        return Err(format!(
            "chain name {s:?} must be printable ASCII without spaces, not starting with '-'"
        ));
    }
    Ok(s.to_string())
}

/// Go's flag package accepts `-flag` as well as `--flag`; rewrite the single-dash long form so
/// that manifests written for upstream keep working.
fn normalize_go_flags(args: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut out = Vec::new();
    let mut after_double_dash = false;
    for arg in args {
        let single_dash_long = !after_double_dash
            && arg.len() > 2
            && arg.starts_with('-')
            && !arg.starts_with("--")
            && arg[1..]
                .chars()
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic());
        if arg == "--" {
            after_double_dash = true;
        }
        out.push(if single_dash_long {
            format!("-{arg}")
        } else {
            arg
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        let argv = std::iter::once("masq-agent")
            .chain(args.iter().copied())
            .map(String::from);
        Cli::parse_args(argv).map(|(cli, _)| cli)
    }

    #[test]
    fn upstream_defaults() {
        let cli = parse(&[]).unwrap();
        let f = cli.flags;
        assert_eq!(f.chain.masq_chain, "IP-MASQ-AGENT");
        assert!(!f.config.nomasq_all_reserved_ranges);
        assert!(!f.config.enable_ipv6);
        assert!(f.masquerade.random_fully);
        assert!(f.masquerade.to_ports.is_none());
        assert_eq!(f.config.path, PathBuf::from("/etc/config/ip-masq-agent"));
        assert_eq!(f.masquerade.dataplane, DataplaneKind::Ebpf);
        assert!(f.daemon.fallback_to_iptables);
        assert!(f.masquerade.interfaces.is_empty());
        assert_eq!(f.pins.bpffs, PathBuf::from("/sys/fs/bpf/ip-masq-agent"));
        assert!(!f.daemon.once);
        assert_eq!(f.daemon.nat_capacity, 262_144);
        assert_eq!(f.logging.level(), tracing::Level::INFO);
        assert!(cli.command.is_none());
    }

    #[test]
    fn go_style_booleans() {
        let f = parse(&[
            "--random-fully=false",
            "--enable-ipv6",
            "--nomasq-all-reserved-ranges=T",
        ])
        .unwrap()
        .flags;
        assert!(!f.masquerade.random_fully);
        assert!(f.config.enable_ipv6);
        assert!(f.config.nomasq_all_reserved_ranges);
        let f = parse(&["--random-fully=0", "--fallback-to-iptables=False"])
            .unwrap()
            .flags;
        assert!(!f.masquerade.random_fully);
        assert!(!f.daemon.fallback_to_iptables);
        assert!(parse(&["--random-fully=nope"]).is_err());
    }

    #[test]
    fn single_dash_long_flags_like_go() {
        let f = parse(&["-masq-chain=CUSTOM", "-enable-ipv6", "-v=4"])
            .unwrap()
            .flags;
        assert_eq!(f.chain.masq_chain, "CUSTOM");
        assert!(f.config.enable_ipv6);
        assert_eq!(f.logging.verbosity, Some(4));
    }

    #[test]
    fn flags_apply_to_subcommands_in_any_position() {
        let cli = parse(&["render-iptables", "--family", "ipv6", "--masq-chain", "X"]).unwrap();
        assert_eq!(cli.flags.chain.masq_chain, "X");
        let Some(Command::RenderIptables { family, chain, .. }) = cli.command else {
            panic!("{:?}", cli.command);
        };
        assert_eq!(family, IpFamily::Ipv6);
        assert_eq!(chain.masq_chain, "X");
        let cli = parse(&["--bpffs=/tmp/b", "status", "--json"]).unwrap();
        let Some(Command::Status { report, pins, .. }) = cli.command else {
            panic!("{:?}", cli.command);
        };
        assert!(report.json);
        assert_eq!(pins.bpffs, PathBuf::from("/tmp/b"));
        // A flag that does not affect the subcommand is taken all the same, in either place.
        assert!(parse(&["--once", "status", "--config=/tmp/c"]).is_ok());
    }

    #[test]
    fn repeatable_interface() {
        let f = parse(&["--interface", "eth0", "--interface=eth1"])
            .unwrap()
            .flags;
        assert_eq!(f.masquerade.interfaces, ["eth0", "eth1"]);
    }

    #[test]
    fn invalid_to_ports_is_a_usage_error() {
        let err = parse(&["--to-ports", "2000-1000"]).unwrap_err();
        assert!(err.to_string().contains("2000-1000"), "{err}");
        assert_eq!(err.exit_code(), 2);
    }

    #[test]
    fn chain_name_limits() {
        assert!(parse(&["--masq-chain", &"A".repeat(28)]).is_ok());
        assert!(parse(&["--masq-chain", &"A".repeat(29)]).is_err());
        assert!(parse(&["--masq-chain=has space"]).is_err());
    }

    #[test]
    fn metrics_addr_as_go_listeners_take_it() {
        let addr = |s: &str| {
            parse(&["--metrics-addr", s])
                .map(|cli| cli.flags.daemon.metrics_addr.unwrap().to_string())
                .map_err(|err| err.to_string())
        };
        assert_eq!(addr(":9830").unwrap(), "[::]:9830");
        for explicit in ["0.0.0.0:9830", "127.0.0.1:9830", "[::]:9830", "[::1]:9830"] {
            assert_eq!(addr(explicit).unwrap(), explicit);
        }
        for wrong in ["9830", ":", ":http", "localhost:9830", "0.0.0.0:99999"] {
            assert!(addr(wrong).is_err(), "{wrong}");
        }
    }

    #[test]
    fn every_option_a_help_shows_says_what_it_does() {
        let mut cli = Cli::command_line();
        cli.build();
        for command in std::iter::once(&cli).chain(cli.get_subcommands()) {
            for arg in command.get_arguments().filter(|arg| !arg.is_hide_set()) {
                assert!(
                    arg.get_help().is_some(),
                    "{} {}",
                    command.get_name(),
                    arg.get_id()
                );
            }
        }
    }

    #[test]
    fn v_sets_the_level_as_kubernetes_logging_conventions_read_it() {
        let level = |v: &str| parse(&[v]).unwrap().flags.logging.level();
        for (v, want) in [
            ("-v=0", tracing::Level::INFO),
            ("-v=2", tracing::Level::INFO),
            ("-v=3", tracing::Level::INFO),
            ("-v=4", tracing::Level::DEBUG),
            ("-v=5", tracing::Level::TRACE),
            ("-v=10", tracing::Level::TRACE),
        ] {
            assert_eq!(level(v), want, "{v}");
        }
        // Go's forms: -v N, -v=N, --v N, --v=N; a value that is not a number is refused.
        for args in [&["-v", "4"][..], &["-v=4"], &["--v", "4"], &["--v=4"]] {
            assert_eq!(
                parse(args).unwrap().flags.logging.verbosity,
                Some(4),
                "{args:?}"
            );
        }
        assert!(parse(&["-v=high"]).is_err());
    }
}

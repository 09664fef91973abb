//! The command line: upstream's flags with upstream's names, defaults and Go-style booleans, plus
//! masq-agent's own flags and subcommands.

use std::{net::SocketAddr, path::PathBuf};

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::{policy::IpFamily, ports::PortRanges};

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

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Parse and validate the config file, then print the effective config as JSON.
    CheckConfig,
    /// Print the iptables-restore input that the data plane applies.
    RenderIptables {
        #[arg(long, value_enum, default_value_t = IpFamily::Ipv4)]
        family: IpFamily,
    },
    /// Show what is installed: data plane, chain, prefixes, counters.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Remove everything the agent installed.
    Cleanup,
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
        #[arg(long)]
        json: bool,
    },
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

/// Flags shared by the daemon and every subcommand.
#[derive(Debug, Clone, Args)]
pub struct Flags {
    /// Name of nat chain for iptables masquerade rules.
    #[arg(long, global = true, default_value = "IP-MASQ-AGENT", value_parser = parse_chain_name)]
    pub masq_chain: String,

    /// Whether to disable masquerade for all IPv4 ranges reserved by RFCs.
    #[arg(long, global = true, default_value = "false", num_args = 0..=1,
          require_equals = true, default_missing_value = "true", value_parser = parse_go_bool)]
    pub nomasq_all_reserved_ranges: bool,

    /// Whether to enable IPv6.
    #[arg(long, global = true, default_value = "false", num_args = 0..=1,
          require_equals = true, default_missing_value = "true", value_parser = parse_go_bool)]
    pub enable_ipv6: bool,

    /// Whether to add --random-fully to the masquerade rule.
    #[arg(long, global = true, default_value = "true", num_args = 0..=1,
          require_equals = true, default_missing_value = "true", value_parser = parse_go_bool)]
    pub random_fully: bool,

    /// Port ranges to masquerade to, e.g. 1024-29999,32768-65535.
    #[arg(long, global = true, value_parser = PortRanges::parse_flag)]
    pub to_ports: Option<PortRanges>,

    /// The ConfigMap file (YAML or JSON).
    #[arg(long, global = true, default_value = "/etc/config/ip-masq-agent")]
    pub config: PathBuf,

    /// Which data plane enforces the policy.
    #[arg(long, global = true, value_enum, default_value_t = DataplaneKind::Ebpf)]
    pub dataplane: DataplaneKind,

    /// Fall back to the full iptables chain when the eBPF data plane cannot run.
    #[arg(long, global = true, default_value = "true", num_args = 0..=1,
          require_equals = true, default_missing_value = "true", value_parser = parse_go_bool)]
    pub fallback_to_iptables: bool,

    /// Interface to attach to (repeatable). Default: the devices that hold a default route,
    /// followed as routes change. Traffic leaving by other devices is masqueraded by the chain.
    #[arg(long = "interface", global = true)]
    pub interfaces: Vec<String>,

    /// Directory under the BPF filesystem where maps and links are pinned.
    #[arg(long, global = true, default_value = "/sys/fs/bpf/ip-masq-agent")]
    pub bpffs: PathBuf,

    /// Flows the eBPF NAT table holds (two entries each); when full, new flows are dropped
    /// and counted while existing ones keep working.
    #[arg(long, global = true, default_value_t = 262_144, value_parser = clap::value_parser!(u32).range(1..=8_388_608))]
    pub nat_capacity: u32,

    /// Address to serve metrics and health endpoints on.
    #[arg(long, global = true)]
    pub metrics_addr: Option<SocketAddr>,

    /// Sync once, leave the data plane in place, and exit.
    #[arg(long, global = true)]
    pub once: bool,

    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Accepted for compatibility with upstream's glog flags; use RUST_LOG to set verbosity.
    #[arg(long = "v", global = true, hide = true)]
    pub glog_verbosity: Option<String>,

    /// Accepted for compatibility with upstream's glog flags.
    #[arg(long, global = true, hide = true, num_args = 0..=1, require_equals = true,
          default_missing_value = "true", value_parser = parse_go_bool)]
    pub logtostderr: Option<bool>,
}

/// Parses a boolean the way Go's `strconv.ParseBool` (and so upstream's flags) does.
pub fn parse_go_bool(s: &str) -> Result<bool, String> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        _ => Err(format!("invalid boolean value {s:?}")),
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
pub fn normalize_go_flags(args: impl IntoIterator<Item = String>) -> Vec<String> {
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
        Cli::try_parse_from(normalize_go_flags(argv))
    }

    #[test]
    fn upstream_defaults() {
        let cli = parse(&[]).unwrap();
        let f = cli.flags;
        assert_eq!(f.masq_chain, "IP-MASQ-AGENT");
        assert!(!f.nomasq_all_reserved_ranges);
        assert!(!f.enable_ipv6);
        assert!(f.random_fully);
        assert!(f.to_ports.is_none());
        assert_eq!(f.config, PathBuf::from("/etc/config/ip-masq-agent"));
        assert_eq!(f.dataplane, DataplaneKind::Ebpf);
        assert!(f.fallback_to_iptables);
        assert!(f.interfaces.is_empty());
        assert_eq!(f.bpffs, PathBuf::from("/sys/fs/bpf/ip-masq-agent"));
        assert!(!f.once);
        assert_eq!(f.nat_capacity, 262_144);
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
        assert!(!f.random_fully);
        assert!(f.enable_ipv6);
        assert!(f.nomasq_all_reserved_ranges);
        let f = parse(&["--random-fully=0", "--fallback-to-iptables=False"])
            .unwrap()
            .flags;
        assert!(!f.random_fully);
        assert!(!f.fallback_to_iptables);
        assert!(parse(&["--random-fully=nope"]).is_err());
    }

    #[test]
    fn single_dash_long_flags_like_go() {
        let f = parse(&["-masq-chain=CUSTOM", "-enable-ipv6", "-v=2"])
            .unwrap()
            .flags;
        assert_eq!(f.masq_chain, "CUSTOM");
        assert!(f.enable_ipv6);
        assert_eq!(f.glog_verbosity.as_deref(), Some("2"));
    }

    #[test]
    fn flags_apply_to_subcommands_in_any_position() {
        let cli = parse(&["render-iptables", "--family", "ipv6", "--masq-chain", "X"]).unwrap();
        assert_eq!(cli.flags.masq_chain, "X");
        assert!(matches!(
            cli.command,
            Some(Command::RenderIptables {
                family: IpFamily::Ipv6
            })
        ));
        let cli = parse(&["--config=/tmp/c", "status", "--json"]).unwrap();
        assert_eq!(cli.flags.config, PathBuf::from("/tmp/c"));
        assert!(matches!(cli.command, Some(Command::Status { json: true })));
    }

    #[test]
    fn repeatable_interface() {
        let f = parse(&["--interface", "eth0", "--interface=eth1"])
            .unwrap()
            .flags;
        assert_eq!(f.interfaces, ["eth0", "eth1"]);
    }

    #[test]
    fn invalid_to_ports_is_a_usage_error() {
        let err = parse(&["--to-ports", "2000-1000"]).unwrap_err();
        assert!(err.to_string().contains("2000-1000"), "{err}");
    }

    #[test]
    fn chain_name_limits() {
        assert!(parse(&["--masq-chain", &"A".repeat(28)]).is_ok());
        assert!(parse(&["--masq-chain", &"A".repeat(29)]).is_err());
        assert!(parse(&["--masq-chain=has space"]).is_err());
    }
}

//! What the config says, once read: the options that change how it is read, the effective
//! config, where it came from, and why a file was rejected.

use std::fmt;
use std::net::Ipv4Addr;
use std::time::Duration;

use ipnet::{IpNet, Ipv4Net};

use super::{
    decode::{CidrList, Field},
    go_format::format_go_duration,
};
use crate::families::IpFamilies;

/// Command-line flags that change how the config file is read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConfigOptions {
    /// `--nomasq-all-reserved-ranges`: the default CIDR list covers all reserved IPv4 ranges.
    pub nomasq_all_reserved_ranges: bool,
    /// `--enable-ipv6`: IPv6 CIDRs are allowed in the list.
    pub families: IpFamilies,
}

/// The effective configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Destinations that are not masqueraded, in file order, duplicates kept.
    pub non_masquerade_cidrs: Vec<IpNet>,
    /// Destinations that are masqueraded although a shorter prefix of `non_masquerade_cidrs`
    /// (or link-local) holds them: every destination is decided by its longest prefix.
    pub masquerade_cidrs: Vec<IpNet>,
    /// Sources whose traffic is never masqueraded, and the exceptions to them; a source no
    /// prefix holds is masqueraded as the destination says. Empty unless the file sets them.
    pub non_masquerade_src_cidrs: Vec<IpNet>,
    pub masquerade_src_cidrs: Vec<IpNet>,
    /// The address masqueraded traffic takes instead of the device's, per family, while the
    /// node holds it (`masqueradeAddress`, `masqueradeAddressIPv6`).
    pub masquerade_address: Option<Ipv4Addr>,
    pub masquerade_address_ipv6: Option<std::net::Ipv6Addr>,
    pub cidr_limit: i64,
    pub masq_link_local: bool,
    pub masq_link_local_ipv6: bool,
    /// Always positive: a non-positive value from the file is replaced by one second.
    pub resync_interval: Duration,
    /// `enableIPv6`, when the file sets it: it overrides `--enable-ipv6`.
    pub enable_ipv6: Option<bool>,
}

pub(super) const DEFAULT_CIDR_LIMIT: i64 = 64;
pub(super) const DEFAULT_RESYNC_INTERVAL: Duration = Duration::from_secs(60);
/// Stands in for a non-positive resyncInterval, which makes upstream's sync loop spin.
pub(super) const MIN_RESYNC_INTERVAL: Duration = Duration::from_secs(1);

pub(super) const fn v4net(a: u8, b: u8, c: u8, d: u8, prefix: u8) -> IpNet {
    IpNet::V4(Ipv4Net::new_assert(Ipv4Addr::new(a, b, c, d), prefix))
}

/// RFC 1918: upstream's default list.
pub(super) const PRIVATE_RANGES: [IpNet; 3] = [
    v4net(10, 0, 0, 0, 8),
    v4net(172, 16, 0, 0, 12),
    v4net(192, 168, 0, 0, 16),
];

/// Added after [`PRIVATE_RANGES`] by `--nomasq-all-reserved-ranges`, in upstream's order.
pub(super) const OTHER_RESERVED_RANGES: [IpNet; 8] = [
    v4net(100, 64, 0, 0, 10),
    v4net(192, 0, 0, 0, 24),
    v4net(192, 0, 2, 0, 24),
    v4net(192, 88, 99, 0, 24),
    v4net(198, 18, 0, 0, 15),
    v4net(198, 51, 100, 0, 24),
    v4net(203, 0, 113, 0, 24),
    v4net(240, 0, 0, 0, 4),
];

impl Config {
    /// The configuration used when the file is missing, and for the keys it leaves out.
    pub fn defaults(opts: &ConfigOptions) -> Config {
        let mut cidrs = PRIVATE_RANGES.to_vec();
        if opts.nomasq_all_reserved_ranges {
            cidrs.extend(OTHER_RESERVED_RANGES);
        }
        Config {
            non_masquerade_cidrs: cidrs,
            masquerade_cidrs: Vec::new(),
            non_masquerade_src_cidrs: Vec::new(),
            masquerade_src_cidrs: Vec::new(),
            masquerade_address: None,
            masquerade_address_ipv6: None,
            cidr_limit: DEFAULT_CIDR_LIMIT,
            masq_link_local: false,
            masq_link_local_ipv6: false,
            resync_interval: DEFAULT_RESYNC_INTERVAL,
            enable_ipv6: None,
        }
    }

    /// The prefixes of `list`.
    pub fn list(&self, list: CidrList) -> &Vec<IpNet> {
        match list {
            CidrList::NonMasquerade => &self.non_masquerade_cidrs,
            CidrList::Masquerade => &self.masquerade_cidrs,
            CidrList::NonMasqueradeSrc => &self.non_masquerade_src_cidrs,
            CidrList::MasqueradeSrc => &self.masquerade_src_cidrs,
        }
    }

    /// The configuration under upstream's key names, e.g. for logging it the way upstream does.
    /// The keys upstream does not have appear only when they are set.
    pub fn to_upstream_json(&self) -> serde_json::Value {
        let strings =
            |cidrs: &[IpNet]| -> Vec<String> { cidrs.iter().map(ToString::to_string).collect() };
        let mut json = serde_json::Map::new();
        let mut set = |field: Field, value: serde_json::Value| {
            json.insert(field.name().to_string(), value);
        };
        set(Field::Cidrs, strings(&self.non_masquerade_cidrs).into());
        set(Field::CidrLimit, self.cidr_limit.into());
        set(Field::MasqLinkLocal, self.masq_link_local.into());
        set(Field::MasqLinkLocalIpv6, self.masq_link_local_ipv6.into());
        set(
            Field::ResyncInterval,
            format_go_duration(self.resync_interval).into(),
        );
        for (list, cidrs) in [
            (CidrList::Masquerade, &self.masquerade_cidrs),
            (CidrList::NonMasqueradeSrc, &self.non_masquerade_src_cidrs),
            (CidrList::MasqueradeSrc, &self.masquerade_src_cidrs),
        ] {
            if !cidrs.is_empty() {
                set(list.field(), strings(cidrs).into());
            }
        }
        if let Some(addr) = self.masquerade_address {
            set(Field::MasqAddress, addr.to_string().into());
        }
        if let Some(addr) = self.masquerade_address_ipv6 {
            set(Field::MasqAddressIpv6, addr.to_string().into());
        }
        if let Some(enable) = self.enable_ipv6 {
            set(Field::EnableIpv6, enable.into());
        }
        serde_json::Value::Object(json)
    }
}

/// Where a [`Loaded`] configuration came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigSource {
    /// Read from the file (which may have been empty).
    File,
    /// The file did not exist (or the directory held no config file), so the defaults are in
    /// use.
    Missing,
    /// Merged from the files of a directory, which `Loaded::files` names.
    Directory,
}

/// A configuration that was accepted, with what is worth telling the operator about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loaded {
    pub config: Config,
    pub warnings: Vec<String>,
    pub source: ConfigSource,
    /// The files read, in the order they were merged.
    pub files: Vec<std::path::PathBuf>,
}

/// Whether a file is read on its own or as one of a directory's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Standing {
    Alone,
    InDirectory,
}

/// The keys a file sets whose defaults matter when files are merged.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Explicit {
    pub(super) non_masquerade_cidrs: bool,
    pub(super) resync_interval: bool,
}

/// Why a config file was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The file, as named to [`load`] or [`parse`].
    pub origin: String,
    /// 1-based; only set when the line is known for sure.
    pub line: Option<usize>,
    pub message: String,
}

impl ConfigError {
    pub(super) fn new(origin: &str, line: Option<usize>, message: String) -> ConfigError {
        ConfigError {
            origin: origin.to_owned(),
            line,
            message,
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}: line {line}: {}", self.origin, self.message),
            None => write!(f, "{}: {}", self.origin, self.message),
        }
    }
}

impl std::error::Error for ConfigError {}

/// The largest config file read. A ConfigMap holds at most 1 MiB; a file given some other way
/// may be larger (100 000 CIDRs take about 2 MiB), but a file of this size is a mistake, and
/// reading it whole would only cost memory.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

//! The agent's config file, read the way the upstream ip-masq-agent (Go) reads it, so that an
//! existing ConfigMap keeps its meaning.
//!
//! Upstream turns the file into JSON (YAML 1.1 rules, go-yaml v2) and decodes that with Go's
//! encoding/json. We don't go through JSON text: both formats are read into a small [`Node`]
//! tree, YAML input gets the YAML 1.1 scalar rules serde_yaml (YAML 1.2) lacks, and the tree is
//! decoded with encoding/json's rules: keys match case-insensitively, `null` leaves a field
//! alone, unknown keys are skipped, and the first type error wins. Error texts are upstream's,
//! with the file name and, where it can be found for sure, the line.

use std::fmt;
use std::net::Ipv4Addr;
use std::path::Path;
use std::time::Duration;

use ipnet::{IpNet, Ipv4Net};

use crate::families::IpFamilies;

mod decode;
mod directory;
mod go_format;
mod locate;
mod node;
mod plain_yaml;
mod tree;
mod validate;

pub use self::directory::FILE_PREFIX;
pub use self::go_format::{format_go_duration, parse_go_bool, parse_go_duration};
use self::{
    decode::{Field, decode},
    locate::locate,
    tree::read_tree,
    validate::{build_config, check_cidr},
};

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
        let mut json = serde_json::json!({
            "nonMasqueradeCIDRs": strings(&self.non_masquerade_cidrs),
            "cidrLimit": self.cidr_limit,
            "masqLinkLocal": self.masq_link_local,
            "masqLinkLocalIPv6": self.masq_link_local_ipv6,
            "resyncInterval": format_go_duration(self.resync_interval),
        });
        for (list, cidrs) in [
            (CidrList::Masquerade, &self.masquerade_cidrs),
            (CidrList::NonMasqueradeSrc, &self.non_masquerade_src_cidrs),
            (CidrList::MasqueradeSrc, &self.masquerade_src_cidrs),
        ] {
            if !cidrs.is_empty() {
                json[list.key()] = strings(cidrs).into();
            }
        }
        if let Some(addr) = self.masquerade_address {
            json["masqueradeAddress"] = addr.to_string().into();
        }
        if let Some(addr) = self.masquerade_address_ipv6 {
            json["masqueradeAddressIPv6"] = addr.to_string().into();
        }
        if let Some(enable) = self.enable_ipv6 {
            json["enableIPv6"] = enable.into();
        }
        json
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

/// Reads and checks the config file. A file that does not exist means the defaults, as
/// upstream; any other read error (permissions, ...) is an error. A directory is read as
/// several files, merged: see [`directory`].
pub fn load(path: &Path, opts: &ConfigOptions) -> Result<Loaded, ConfigError> {
    if path.is_dir() {
        return directory::load(path, opts);
    }
    let origin = path.display().to_string();
    match read_bounded(path) {
        Ok(text) => parse(&text, &origin, opts).map(|loaded| Loaded {
            files: vec![path.to_path_buf()],
            ..loaded
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Loaded {
            config: Config::defaults(opts),
            warnings: Vec::new(),
            source: ConfigSource::Missing,
            files: Vec::new(),
        }),
        Err(e) => Err(unreadable(&origin, e)),
    }
}

fn unreadable(origin: &str, e: std::io::Error) -> ConfigError {
    ConfigError::new(origin, None, format!("cannot read the config file: {e}"))
}

/// Reads `path`, but never more than `MAX_CONFIG_BYTES`, even if the file grows meanwhile.
pub(super) fn read_bounded(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read as _;

    let file = std::fs::File::open(path)?;
    let mut text = Vec::new();
    file.take(MAX_CONFIG_BYTES + 1).read_to_end(&mut text)?;
    if text.len() as u64 > MAX_CONFIG_BYTES {
        return Err(std::io::Error::other(format!(
            "larger than {} MiB",
            MAX_CONFIG_BYTES >> 20
        )));
    }
    Ok(text)
}

/// Checks config file contents; `origin` names the file in messages.
pub fn parse(text: &[u8], origin: &str, opts: &ConfigOptions) -> Result<Loaded, ConfigError> {
    parse_with_keys(text, origin, opts, Standing::Alone).map(|(loaded, _)| loaded)
}

/// `parse`, and which keys the file sets.
pub(super) fn parse_with_keys(
    text: &[u8],
    origin: &str,
    opts: &ConfigOptions,
    standing: Standing,
) -> Result<(Loaded, Explicit), ConfigError> {
    let mut warnings = Vec::new();
    let (root, format) = read_tree(text, origin, &mut warnings)?;
    let mut explicit = Explicit::default();
    let checked = decode(&root, format, origin, &mut warnings).and_then(|fields| {
        explicit = Explicit {
            non_masquerade_cidrs: fields.cidrs.is_some(),
            resync_interval: fields.resync_interval.is_some(),
        };
        build_config(&fields, opts, standing, &mut warnings)
    });
    match checked {
        Ok(config) => Ok((
            Loaded {
                config,
                warnings,
                source: ConfigSource::File,
                files: Vec::new(),
            },
            explicit,
        )),
        Err(problem) => {
            let line_of = |anchor| locate(text, &root, format, anchor);
            let line = problem.anchor.and_then(line_of);
            let mut message = problem.message;
            if let Some((what, also)) = problem.also {
                match line_of(also) {
                    Some(n) => message.push_str(&format!("; {what} has it at line {n}")),
                    None => message.push_str(&format!("; {what} has it too")),
                }
            }
            Err(ConfigError::new(origin, line, message))
        }
    }
}

/// Which list of the config an entry is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CidrList {
    NonMasquerade,
    Masquerade,
    NonMasqueradeSrc,
    MasqueradeSrc,
}

impl CidrList {
    /// The key, as the file writes it.
    pub fn key(self) -> &'static str {
        self.field().name()
    }

    fn field(self) -> Field {
        match self {
            CidrList::NonMasquerade => Field::Cidrs,
            CidrList::Masquerade => Field::MasqCidrs,
            CidrList::NonMasqueradeSrc => Field::SrcCidrs,
            CidrList::MasqueradeSrc => Field::MasqSrcCidrs,
        }
    }

    pub const ALL: [CidrList; 4] = [
        CidrList::NonMasquerade,
        CidrList::Masquerade,
        CidrList::NonMasqueradeSrc,
        CidrList::MasqueradeSrc,
    ];

    /// The list of exceptions to this one's prefixes.
    pub fn exceptions(self) -> CidrList {
        match self {
            CidrList::NonMasquerade | CidrList::Masquerade => CidrList::Masquerade,
            CidrList::NonMasqueradeSrc | CidrList::MasqueradeSrc => CidrList::MasqueradeSrc,
        }
    }

    /// What the list's prefixes hold: destinations, or sources.
    pub fn holds(self) -> &'static str {
        match self {
            CidrList::NonMasquerade | CidrList::Masquerade => "destination",
            CidrList::NonMasqueradeSrc | CidrList::MasqueradeSrc => "source",
        }
    }
}

/// The line of the valid config `text` on which `list` holds `net` (as written in any form Go
/// reads as that prefix), where it can be found for sure. Looked for only when asked: an error
/// about two files, or `explain`.
pub fn cidr_line(text: &[u8], opts: &ConfigOptions, list: CidrList, net: IpNet) -> Option<usize> {
    let (root, format) = read_tree(text, "", &mut Vec::new()).ok()?;
    let fields = decode(&root, format, "", &mut Vec::new()).ok()?;
    let items = fields.list(list).clone()?;
    let item = items
        .value
        .into_iter()
        .flatten()
        .find(|item| check_cidr(Some(item), opts).is_ok_and(|n| n == net))?;
    locate(text, &root, format, item)
}

/// The line of the valid config `text` that sets the address key `field`, where it can be found
/// for sure: for an error about two files.
fn address_line(text: &[u8], field: Field) -> Option<usize> {
    let (root, format) = read_tree(text, "", &mut Vec::new()).ok()?;
    let fields = decode(&root, format, "", &mut Vec::new()).ok()?;
    locate(text, &root, format, fields.address(field)?.key)
}

#[cfg(test)]
mod tests;

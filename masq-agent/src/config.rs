//! The agent's config file, read the way the upstream ip-masq-agent (Go) reads it, so that an
//! existing ConfigMap keeps its meaning.
//!
//! Upstream turns the file into JSON (YAML 1.1 rules, go-yaml v2) and decodes that with Go's
//! encoding/json. We don't go through JSON text: both formats are read into a small [`Node`]
//! tree, YAML input gets the YAML 1.1 scalar rules serde_yaml (YAML 1.2) lacks, and the tree is
//! decoded with encoding/json's rules: keys match case-insensitively, `null` leaves a field
//! alone, unknown keys are skipped, and the first type error wins. Error texts are upstream's,
//! with the file name and, where it can be found for sure, the line.

use std::collections::{HashMap, HashSet};
use std::fmt::{self, Write as _};
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::time::Duration;

use ipnet::{IpNet, Ipv4Net};
use serde::de::{self, Deserialize, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess};

/// Command-line flags that change how the config file is read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConfigOptions {
    /// `--nomasq-all-reserved-ranges`: the default CIDR list covers all reserved IPv4 ranges.
    pub nomasq_all_reserved_ranges: bool,
    /// `--enable-ipv6`: IPv6 CIDRs are allowed in the list.
    pub enable_ipv6: bool,
}

/// The effective configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Destinations that are not masqueraded, in file order, duplicates kept.
    pub non_masquerade_cidrs: Vec<IpNet>,
    pub cidr_limit: i64,
    pub masq_link_local: bool,
    pub masq_link_local_ipv6: bool,
    /// Always positive: a non-positive value from the file is replaced by one second.
    pub resync_interval: Duration,
}

const DEFAULT_CIDR_LIMIT: i64 = 64;
const DEFAULT_RESYNC_INTERVAL: Duration = Duration::from_secs(60);
/// Stands in for a non-positive resyncInterval, which makes upstream's sync loop spin.
const MIN_RESYNC_INTERVAL: Duration = Duration::from_secs(1);

const fn v4net(a: u8, b: u8, c: u8, d: u8, prefix: u8) -> IpNet {
    IpNet::V4(Ipv4Net::new_assert(Ipv4Addr::new(a, b, c, d), prefix))
}

/// RFC 1918: upstream's default list.
const PRIVATE_RANGES: [IpNet; 3] = [
    v4net(10, 0, 0, 0, 8),
    v4net(172, 16, 0, 0, 12),
    v4net(192, 168, 0, 0, 16),
];

/// Added after [`PRIVATE_RANGES`] by `--nomasq-all-reserved-ranges`, in upstream's order.
const OTHER_RESERVED_RANGES: [IpNet; 8] = [
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
            cidr_limit: DEFAULT_CIDR_LIMIT,
            masq_link_local: false,
            masq_link_local_ipv6: false,
            resync_interval: DEFAULT_RESYNC_INTERVAL,
        }
    }

    /// The configuration under upstream's key names, e.g. for logging it the way upstream does.
    pub fn to_upstream_json(&self) -> serde_json::Value {
        let cidrs: Vec<String> = self
            .non_masquerade_cidrs
            .iter()
            .map(ToString::to_string)
            .collect();
        serde_json::json!({
            "nonMasqueradeCIDRs": cidrs,
            "cidrLimit": self.cidr_limit,
            "masqLinkLocal": self.masq_link_local,
            "masqLinkLocalIPv6": self.masq_link_local_ipv6,
            "resyncInterval": format_go_duration(self.resync_interval),
        })
    }
}

/// Where a [`Loaded`] configuration came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigSource {
    /// Read from the file (which may have been empty).
    File,
    /// The file did not exist, so the defaults are in use.
    Missing,
}

/// A configuration that was accepted, with what is worth telling the operator about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loaded {
    pub config: Config,
    pub warnings: Vec<String>,
    pub source: ConfigSource,
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
    fn new(origin: &str, line: Option<usize>, message: String) -> ConfigError {
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
/// upstream; any other read error (permissions, a directory, ...) is an error.
pub fn load(path: &Path, opts: &ConfigOptions) -> Result<Loaded, ConfigError> {
    let origin = path.display().to_string();
    match read_bounded(path) {
        Ok(text) => parse(&text, &origin, opts),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Loaded {
            config: Config::defaults(opts),
            warnings: Vec::new(),
            source: ConfigSource::Missing,
        }),
        Err(e) => Err(ConfigError::new(
            &origin,
            None,
            format!("cannot read the config file: {e}"),
        )),
    }
}

/// Reads `path`, but never more than `MAX_CONFIG_BYTES`, even if the file grows meanwhile.
fn read_bounded(path: &Path) -> std::io::Result<Vec<u8>> {
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
    let mut warnings = Vec::new();
    let (root, format) = read_tree(text, origin, &mut warnings)?;
    let checked = decode(&root, format, origin, &mut warnings)
        .and_then(|fields| build_config(&fields, opts, &mut warnings));
    match checked {
        Ok(config) => Ok(Loaded {
            config,
            warnings,
            source: ConfigSource::File,
        }),
        Err(problem) => {
            let line = problem
                .anchor
                .and_then(|anchor| locate(text, &root, format, anchor));
            Err(ConfigError::new(origin, line, problem.message))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Reading the file into a tree

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    Json,
    Yaml,
}

/// A parsed YAML or JSON value. Unlike serde_json's and serde_yaml's own values, a mapping
/// keeps its keys in file order and keeps repeated keys, as Go's decoder sees them.
#[derive(Debug, Clone, PartialEq)]
enum Node {
    Null,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    Seq(Vec<Node>),
    Map(Vec<(String, Node)>),
}

impl Node {
    /// The JSON type name Go's decoder uses in its errors.
    fn go_kind(&self) -> &'static str {
        match self {
            Node::Null => "null",
            Node::Bool(_) => "bool",
            Node::Int(_) | Node::Float(_) => "number",
            Node::Str(_) => "string",
            Node::Seq(_) => "array",
            Node::Map(_) => "object",
        }
    }
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Node, D::Error> {
        deserializer.deserialize_any(NodeVisitor)
    }
}

struct NodeVisitor;

impl<'de> de::Visitor<'de> for NodeVisitor {
    type Value = Node;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML or JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Node, E> {
        Ok(Node::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Node, E> {
        Ok(Node::Int(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Node, E> {
        Ok(Node::Int(v.into()))
    }

    fn visit_i128<E>(self, v: i128) -> Result<Node, E> {
        Ok(Node::Int(v))
    }

    fn visit_u128<E>(self, v: u128) -> Result<Node, E> {
        // Past i128 the exact value no longer matters: it is out of range for every field.
        Ok(i128::try_from(v).map_or(Node::Float(v as f64), Node::Int))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Node, E> {
        Ok(Node::Float(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Node, E> {
        Ok(Node::Str(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Node, E> {
        Ok(Node::Str(v))
    }

    fn visit_unit<E>(self) -> Result<Node, E> {
        Ok(Node::Null)
    }

    fn visit_none<E>(self) -> Result<Node, E> {
        Ok(Node::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Node, D::Error> {
        Node::deserialize(deserializer)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Node::Seq(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node, A::Error> {
        let mut entries = Vec::new();
        while let Some(key) = map.next_key::<Node>()? {
            let key = key_string(key).map_err(de::Error::custom)?;
            entries.push((key, map.next_value()?));
        }
        Ok(Node::Map(entries))
    }

    /// serde_yaml hands over a YAML value with a custom tag (`!foo bar`) as an enum; like
    /// go-yaml we look through the tag.
    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<Node, A::Error> {
        let (_tag, value): (String, _) = data.variant()?;
        value.newtype_variant()
    }
}

/// Scalar YAML keys become strings, as they do in upstream's YAML-to-JSON step.
fn key_string(key: Node) -> Result<String, String> {
    match key {
        Node::Str(s) => Ok(s),
        Node::Bool(b) => Ok(b.to_string()),
        Node::Int(n) => Ok(n.to_string()),
        Node::Float(f) => Ok(f.to_string()),
        other => Err(format!("unsupported map key of type {}", other.go_kind())),
    }
}

/// Like upstream (k8s.io/apimachinery's yaml.ToJSON), a file is JSON if it starts with `{`.
fn looks_like_json(text: &[u8]) -> bool {
    String::from_utf8_lossy(text).trim_start().starts_with('{')
}

fn read_tree(
    text: &[u8],
    origin: &str,
    warnings: &mut Vec<String>,
) -> Result<(Node, Format), ConfigError> {
    if looks_like_json(text) {
        let root = serde_json::from_slice(text).map_err(|e| json_syntax_error(&e, origin))?;
        return Ok((root, Format::Json));
    }
    // libyaml rejects a tab where a line's indentation would be, even on a blank line; a
    // file of nothing but blanks still means "no settings".
    if text.iter().all(u8::is_ascii_whitespace) {
        return Ok((Node::Null, Format::Yaml));
    }
    if flow_nesting_exceeds(text, MAX_FLOW_NESTING) {
        let message = format!("invalid YAML: nested more than {MAX_FLOW_NESTING} levels deep");
        return Err(ConfigError::new(origin, None, message));
    }
    let mut root = read_yaml(text, origin, warnings)?;
    resolve_yaml11_scalars(&mut root);
    if let Node::Map(entries) = &mut root {
        apply_merge_keys(entries).map_err(|m| ConfigError::new(origin, None, m))?;
    }
    reject_non_finite(&root).map_err(|m| ConfigError::new(origin, None, m))?;
    Ok((root, Format::Yaml))
}

fn json_syntax_error(e: &serde_json::Error, origin: &str) -> ConfigError {
    // serde_json ends its message with the position; we give the line our own way.
    let message = e.to_string();
    let position = format!(" at line {} column {}", e.line(), e.column());
    let message = match message.strip_suffix(&position) {
        Some(head) => format!("invalid JSON: {head} at column {}", e.column()),
        None => format!("invalid JSON: {message}"),
    };
    ConfigError::new(origin, (e.line() > 0).then_some(e.line()), message)
}

/// serde_yaml refuses more than 128 levels anyway, but only after libyaml has parsed the whole
/// document, which takes time quadratic in the depth (minutes for a 1 MiB file of `[`).
const MAX_FLOW_NESTING: usize = 1000;

/// Whether `[`/`{` nest deeper than `limit`. Brackets in quotes and comments count too: telling
/// those apart is the parser's job, and a real config has nowhere near a thousand of them.
fn flow_nesting_exceeds(text: &[u8], limit: usize) -> bool {
    let mut depth = 0usize;
    for &c in text {
        match c {
            b'[' | b'{' => {
                depth += 1;
                if depth > limit {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    false
}

/// Reads the first YAML document only, as go-yaml's Unmarshal does.
fn read_yaml(text: &[u8], origin: &str, warnings: &mut Vec<String>) -> Result<Node, ConfigError> {
    let mut documents = serde_yaml::Deserializer::from_slice(text);
    let root = match documents.next() {
        Some(document) => Node::deserialize(document).map_err(|e| yaml_syntax_error(&e, origin))?,
        None => Node::Null,
    };
    // A stray trailing `---` is harmless; anything more is probably a mistake.
    if let Some(document) = documents.next()
        && !matches!(Node::deserialize(document), Ok(Node::Null))
    {
        warnings.push(format!(
            "{origin} holds more than one YAML document: only the first is used"
        ));
    }
    Ok(root)
}

fn yaml_syntax_error(e: &serde_yaml::Error, origin: &str) -> ConfigError {
    let message = e.to_string();
    let Some(location) = e.location() else {
        return ConfigError::new(origin, None, format!("invalid YAML: {message}"));
    };
    let position = format!(" at line {} column {}", location.line(), location.column());
    let message = message.replacen(&position, &format!(" at column {}", location.column()), 1);
    ConfigError::new(
        origin,
        Some(location.line()),
        format!("invalid YAML: {message}"),
    )
}

// ---------------------------------------------------------------------------------------------
// YAML 1.1, as go-yaml v2 reads it

/// Plain scalars that YAML 1.1 (upstream) reads as booleans but YAML 1.2 (serde_yaml) reads as
/// strings. `true`/`false` and their capitalised forms are booleans to both.
const YAML11_TRUE: [&str; 8] = ["y", "Y", "yes", "Yes", "YES", "on", "On", "ON"];
const YAML11_FALSE: [&str; 8] = ["n", "N", "no", "No", "NO", "off", "Off", "OFF"];

/// Gives string values the type go-yaml v2 would have given them. serde_yaml does not say
/// whether a scalar was quoted; a string that serde_yaml would have read as a number must
/// have been quoted and stays a string, but a quoted `"yes"` or `"010"` is taken as plain.
fn resolve_yaml11_scalars(node: &mut Node) {
    match node {
        Node::Str(s) => {
            if let Some(resolved) = yaml11_scalar(s) {
                *node = resolved;
            }
        }
        Node::Seq(items) => items.iter_mut().for_each(resolve_yaml11_scalars),
        Node::Map(entries) => entries
            .iter_mut()
            .for_each(|(_, value)| resolve_yaml11_scalars(value)),
        _ => {}
    }
}

fn yaml11_scalar(s: &str) -> Option<Node> {
    if YAML11_TRUE.contains(&s) {
        return Some(Node::Bool(true));
    }
    if YAML11_FALSE.contains(&s) {
        return Some(Node::Bool(false));
    }
    if !s.starts_with(|c: char| c.is_ascii_digit() || matches!(c, '+' | '-' | '.')) {
        return None;
    }
    // go-yaml drops every underscore before trying the number forms.
    let plain: String = s.chars().filter(|&c| c != '_').collect();
    let number = match go_parse_int_base0(&plain) {
        Some(n) => Node::Int(n),
        None if is_yaml11_float(&plain) => Node::Float(plain.parse::<f64>().ok()?),
        None => return None,
    };
    // Such a string has only digits, signs, dots and letters, so it is safe to read as YAML.
    let plain_in_yaml12 = serde_yaml::from_str::<serde_yaml::Value>(s);
    if matches!(plain_in_yaml12, Ok(serde_yaml::Value::Number(_))) {
        return None;
    }
    match number {
        // Go's ParseFloat fails on overflow, and go-yaml then keeps the string.
        Node::Float(f) if !f.is_finite() => None,
        number => Some(number),
    }
}

/// Go's `strconv.ParseInt(s, 0, 64)`, falling back to `ParseUint(s, 0, 64)` as go-yaml does:
/// `0x`, `0o`, `0b` prefixes, and a leading `0` meaning octal (`010` is 8).
fn go_parse_int_base0(s: &str) -> Option<i128> {
    let (sign, body) = match s.as_bytes().first() {
        Some(b'-') => (Some(true), &s[1..]),
        Some(b'+') => (Some(false), &s[1..]),
        _ => (None, s),
    };
    let (radix, digits) = match body.get(..2) {
        Some("0x" | "0X") => (16, &body[2..]),
        Some("0o" | "0O") => (8, &body[2..]),
        Some("0b" | "0B") => (2, &body[2..]),
        _ if body.len() > 1 && body.starts_with('0') => (8, &body[1..]),
        _ => (10, body),
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    let magnitude = i128::try_from(u128::from_str_radix(digits, radix).ok()?).ok()?;
    let value = if sign == Some(true) {
        -magnitude
    } else {
        magnitude
    };
    let fits_int64 = i64::try_from(value).is_ok();
    let fits_uint64 = sign.is_none() && u64::try_from(value).is_ok();
    (fits_int64 || fits_uint64).then_some(value)
}

/// go-yaml's `^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$`.
fn is_yaml11_float(s: &str) -> bool {
    let s = s.strip_prefix(['+', '-']).unwrap_or(s);
    let (mantissa, exponent) = match s.find(['e', 'E']) {
        Some(i) => (&s[..i], Some(&s[i + 1..])),
        None => (s, None),
    };
    let all_digits = |t: &str| t.bytes().all(|b| b.is_ascii_digit());
    let mantissa_ok = match mantissa.split_once('.') {
        Some(("", frac)) => !frac.is_empty() && all_digits(frac),
        Some((whole, frac)) => all_digits(whole) && all_digits(frac),
        None => !mantissa.is_empty() && all_digits(mantissa),
    };
    let exponent_ok = exponent.is_none_or(|e| {
        let digits = e.strip_prefix(['+', '-']).unwrap_or(e);
        !digits.is_empty() && all_digits(digits)
    });
    mantissa_ok && exponent_ok
}

/// Applies `<<` merge keys at the top level the way go-yaml v2 does: the merged entries take
/// the place of the `<<` key, so later keys override them and they override earlier ones.
fn apply_merge_keys(entries: &mut Vec<(String, Node)>) -> Result<(), String> {
    if !entries.iter().any(|(key, _)| key == "<<") {
        return Ok(());
    }
    let mut merged = Vec::with_capacity(entries.len());
    for (key, value) in std::mem::take(entries) {
        if key != "<<" {
            merged.push((key, value));
            continue;
        }
        match value {
            Node::Map(mut inner) => {
                apply_merge_keys(&mut inner)?;
                merged.extend(inner);
            }
            // Earlier maps in the list take precedence, so they go in last.
            Node::Seq(maps) => {
                for map in maps.into_iter().rev() {
                    let Node::Map(mut inner) = map else {
                        return Err(MERGE_ERROR.to_owned());
                    };
                    apply_merge_keys(&mut inner)?;
                    merged.extend(inner);
                }
            }
            _ => return Err(MERGE_ERROR.to_owned()),
        }
    }
    *entries = merged;
    Ok(())
}

const MERGE_ERROR: &str = "map merge requires map or sequence of maps as the value";

/// Upstream's YAML-to-JSON step fails on `.inf` and `.nan`, anywhere in the file.
fn reject_non_finite(node: &Node) -> Result<(), String> {
    match node {
        Node::Float(f) if f.is_nan() => Err("json: unsupported value: NaN".to_owned()),
        Node::Float(f) if f.is_infinite() => {
            let sign = if *f > 0.0 { '+' } else { '-' };
            Err(format!("json: unsupported value: {sign}Inf"))
        }
        Node::Seq(items) => items.iter().try_for_each(reject_non_finite),
        Node::Map(entries) => entries
            .iter()
            .try_for_each(|(_, value)| reject_non_finite(value)),
        _ => Ok(()),
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding with Go's encoding/json rules

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Cidrs,
    CidrLimit,
    MasqLinkLocal,
    MasqLinkLocalIpv6,
    ResyncInterval,
}

impl Field {
    const ALL: [Field; 5] = [
        Field::Cidrs,
        Field::CidrLimit,
        Field::MasqLinkLocal,
        Field::MasqLinkLocalIpv6,
        Field::ResyncInterval,
    ];

    /// The key, as upstream's struct tags spell it.
    fn name(self) -> &'static str {
        match self {
            Field::Cidrs => "nonMasqueradeCIDRs",
            Field::CidrLimit => "cidrLimit",
            Field::MasqLinkLocal => "masqLinkLocal",
            Field::MasqLinkLocalIpv6 => "masqLinkLocalIPv6",
            Field::ResyncInterval => "resyncInterval",
        }
    }

    /// The Go type of upstream's struct field, for error messages.
    fn go_type(self) -> &'static str {
        match self {
            Field::Cidrs => "[]string",
            Field::CidrLimit => "int",
            Field::MasqLinkLocal | Field::MasqLinkLocalIpv6 => "bool",
            Field::ResyncInterval => "Duration",
        }
    }

    fn for_key(key: &str) -> Option<Field> {
        let folded = go_fold(key);
        Field::ALL
            .into_iter()
            .find(|field| go_fold(field.name()) == folded)
    }
}

/// Go's encoding/json key folding (`unicode.ToUpper(unicode.ToLower(r))`), under which
/// `NONMASQUERADECIDRS` and even `nonMasqueradeCIDRſ` name the same field.
fn go_fold(s: &str) -> String {
    fn single(mut chars: impl Iterator<Item = char>) -> Option<char> {
        let c = chars.next()?;
        chars.next().is_none().then_some(c)
    }
    s.chars()
        .map(|c| {
            let lower = single(c.to_lowercase()).unwrap_or(c);
            single(lower.to_uppercase()).unwrap_or(lower)
        })
        .collect()
}

/// An error on its way out, with the key or string value whose line it concerns. The anchor
/// points into the parsed tree, so that repeated text can be told apart.
#[derive(Debug)]
struct Problem<'a> {
    message: String,
    anchor: Option<&'a String>,
}

impl<'a> Problem<'a> {
    fn new(message: String, anchor: Option<&'a String>) -> Problem<'a> {
        Problem { message, anchor }
    }
}

/// A value from the file, with the key that set it.
#[derive(Debug, Clone)]
struct Setting<'a, T> {
    value: T,
    key: &'a String,
}

/// What the file sets; `None` keeps the default.
#[derive(Debug, Default)]
struct FileFields<'a> {
    /// A `null` list item decodes to "" in Go; it is `None` here.
    cidrs: Option<Setting<'a, Vec<Option<&'a String>>>>,
    cidr_limit: Option<Setting<'a, i64>>,
    masq_link_local: Option<bool>,
    masq_link_local_ipv6: Option<bool>,
    /// Nanoseconds.
    resync_interval: Option<Setting<'a, i128>>,
}

/// How decoding one value went wrong. Go's decoder notes a type mismatch and carries on (the
/// first one is reported), but stops at once when a custom decoder (Duration) fails.
enum DecodeError<'a> {
    Type(Problem<'a>),
    Fatal(Problem<'a>),
}

fn decode<'a>(
    root: &'a Node,
    format: Format,
    origin: &str,
    warnings: &mut Vec<String>,
) -> Result<FileFields<'a>, Problem<'a>> {
    let entries = match root {
        // An empty or comment-only file.
        Node::Null => return Ok(FileFields::default()),
        Node::Map(entries) => entries,
        other => {
            return Err(Problem::new(
                format!(
                    "json: cannot unmarshal {} into Go value of type MasqConfig \
                     (the file must be a mapping of keys to values)",
                    other.go_kind()
                ),
                None,
            ));
        }
    };
    warn_about_keys(entries, origin, warnings);
    let mut fields = FileFields::default();
    let mut first_type_error = None;
    for (key, value) in effective_entries(entries, format) {
        let Some(field) = Field::for_key(key) else {
            continue;
        };
        match fields.set(field, key, value, format) {
            Ok(()) => {}
            Err(DecodeError::Type(problem)) => {
                first_type_error.get_or_insert(problem);
            }
            Err(DecodeError::Fatal(problem)) => return Err(problem),
        }
    }
    match first_type_error {
        Some(problem) => Err(problem),
        None => Ok(fields),
    }
}

/// The entries Go's decoder gets to see. go-yaml builds a map first, so of a key written twice
/// in YAML only the last value is decoded; JSON goes straight to the decoder, every value.
fn effective_entries(entries: &[(String, Node)], format: Format) -> Vec<&(String, Node)> {
    if format == Format::Json {
        return entries.iter().collect();
    }
    let last_index: HashMap<&str, usize> = entries
        .iter()
        .enumerate()
        .map(|(i, (key, _))| (key.as_str(), i))
        .collect();
    entries
        .iter()
        .enumerate()
        .filter(|&(i, (key, _))| last_index.get(key.as_str()) == Some(&i))
        .map(|(_, entry)| entry)
        .collect()
}

impl<'a> FileFields<'a> {
    fn set(
        &mut self,
        field: Field,
        key: &'a String,
        value: &'a Node,
        format: Format,
    ) -> Result<(), DecodeError<'a>> {
        let type_error = |what: String| {
            DecodeError::Type(Problem::new(
                format!(
                    "json: cannot unmarshal {what} into Go struct field MasqConfig.{} of type {}",
                    field.name(),
                    field.go_type()
                ),
                Some(key),
            ))
        };
        match field {
            Field::Cidrs => {
                if let Some(list) = decode_cidr_list(key, value)? {
                    self.cidrs = Some(Setting { value: list, key });
                }
            }
            Field::CidrLimit => {
                if let Some(limit) = decode_int(value, format).map_err(type_error)? {
                    self.cidr_limit = Some(Setting { value: limit, key });
                }
            }
            Field::MasqLinkLocal | Field::MasqLinkLocalIpv6 => {
                let slot = if field == Field::MasqLinkLocal {
                    &mut self.masq_link_local
                } else {
                    &mut self.masq_link_local_ipv6
                };
                match value {
                    Node::Null => {}
                    Node::Bool(b) => *slot = Some(*b),
                    other => return Err(type_error(other.go_kind().to_owned())),
                }
            }
            Field::ResyncInterval => {
                let nanos = decode_duration(value, format)
                    .map_err(|message| DecodeError::Fatal(Problem::new(message, Some(key))))?;
                self.resync_interval = Some(Setting { value: nanos, key });
            }
        }
        Ok(())
    }
}

/// `None` leaves the list alone; `null` and `[]` both mean an empty list.
fn decode_cidr_list<'a>(
    key: &'a String,
    value: &'a Node,
) -> Result<Option<Vec<Option<&'a String>>>, DecodeError<'a>> {
    let type_error = |what: &str, go_type: &str| {
        DecodeError::Type(Problem::new(
            format!(
                "json: cannot unmarshal {what} into Go struct field MasqConfig.{} of type {go_type}",
                Field::Cidrs.name()
            ),
            Some(key),
        ))
    };
    let items = match value {
        Node::Null => return Ok(Some(Vec::new())),
        Node::Seq(items) => items,
        other => return Err(type_error(other.go_kind(), "[]string")),
    };
    items
        .iter()
        .map(|item| match item {
            Node::Str(s) => Ok(Some(s)),
            Node::Null => Ok(None),
            other => Err(type_error(other.go_kind(), "string")),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// `Err` holds what Go's message says was found, e.g. `number 64.5`.
fn decode_int(value: &Node, format: Format) -> Result<Option<i64>, String> {
    match value {
        Node::Null => Ok(None),
        Node::Int(n) => i64::try_from(*n)
            .map(Some)
            .map_err(|_| format!("number {n}")),
        // Upstream's YAML-to-JSON step writes a whole float such as 64.0 as "64", which then
        // decodes as an int; in a JSON file 64.0 stays a float and is rejected.
        Node::Float(f) => match (format, whole_i64(*f)) {
            (Format::Yaml, Some(n)) => Ok(Some(n)),
            _ => Err(format!("number {}", float_text(*f, format))),
        },
        other => Err(other.go_kind().to_owned()),
    }
}

fn whole_i64(f: f64) -> Option<i64> {
    const TWO_POW_63: f64 = 9_223_372_036_854_775_808.0;
    (f.is_finite() && f.fract() == 0.0 && (-TWO_POW_63..TWO_POW_63).contains(&f))
        .then_some(f as i64)
}

/// Upstream's Duration decoder: a string in time.ParseDuration syntax, and nothing else.
fn decode_duration(value: &Node, format: Format) -> Result<i128, String> {
    match value {
        Node::Str(s) => parse_go_duration(s),
        other => Err(format!(
            "expected string value for unmarshal to field of type Duration, got {}",
            go_quote(&json_text(other, format))
        )),
    }
}

/// Compact JSON for a value, as upstream's Duration decoder quotes it.
fn json_text(node: &Node, format: Format) -> String {
    match node {
        Node::Null => "null".to_owned(),
        Node::Bool(b) => b.to_string(),
        Node::Int(n) => n.to_string(),
        Node::Float(f) => float_text(*f, format),
        Node::Str(s) => serde_json::Value::from(s.as_str()).to_string(),
        Node::Seq(items) => {
            let items: Vec<String> = items.iter().map(|item| json_text(item, format)).collect();
            format!("[{}]", items.join(","))
        }
        Node::Map(entries) => {
            let entries: Vec<String> = entries
                .iter()
                .map(|(key, value)| {
                    let key = serde_json::Value::from(key.as_str());
                    format!("{key}:{}", json_text(value, format))
                })
                .collect();
            format!("{{{}}}", entries.join(","))
        }
    }
}

/// A float as Go's message would show it: for YAML, as Go's JSON encoder writes it; for JSON Go
/// quotes the literal, which we no longer have, so the shortest form stands in.
fn float_text(f: f64, format: Format) -> String {
    match format {
        Format::Yaml => go_json_float(f),
        Format::Json => format!("{f:?}"),
    }
}

/// Go's encoding/json float64 format: plain decimals between 1e-6 and 1e21, else `1e+21`.
fn go_json_float(f: f64) -> String {
    let abs = f.abs();
    if abs == 0.0 || (1e-6..1e21).contains(&abs) {
        return f.to_string();
    }
    let text = format!("{f:e}");
    match text.split_once('e') {
        Some((mantissa, exponent)) if !exponent.starts_with('-') => {
            format!("{mantissa}e+{exponent}")
        }
        _ => text,
    }
}

// ---------------------------------------------------------------------------------------------
// Warnings about keys

/// Below this (normalized Damerau-Levenshtein) similarity no key is suggested.
const SUGGESTION_THRESHOLD: f64 = 0.7;

fn warn_about_keys(entries: &[(String, Node)], origin: &str, warnings: &mut Vec<String>) {
    let mut unknown: Vec<&str> = Vec::new();
    let mut seen_unknown = HashSet::new();
    let mut counts = [0usize; Field::ALL.len()];
    for (key, _) in entries {
        match Field::for_key(key) {
            Some(field) => counts[field as usize] += 1,
            None if seen_unknown.insert(key.as_str()) => unknown.push(key),
            None => {}
        }
    }
    for key in unknown {
        let quoted = go_quote(key);
        warnings.push(match suggest_key(key) {
            Some(name) => {
                format!("unknown key {quoted} in {origin}: ignored; did you mean {name}?")
            }
            None => format!("unknown key {quoted} in {origin}: ignored"),
        });
    }
    for field in Field::ALL {
        let count = counts[field as usize];
        if count > 1 {
            warnings.push(format!(
                "{} is set {count} times in {origin}: the last one is used",
                field.name()
            ));
        }
    }
}

/// The known key an unknown one was probably meant to be, if any is close enough. Case,
/// dashes and underscores are ignored (`non-masquerade-cidrs` is a plain mix-up).
fn suggest_key(key: &str) -> Option<&'static str> {
    let normalize = |s: &str| -> String {
        s.chars()
            .filter(|c| !matches!(c, '-' | '_' | ' '))
            .flat_map(char::to_lowercase)
            .collect()
    };
    let key = normalize(key);
    Field::ALL
        .into_iter()
        .map(|field| {
            let score = strsim::normalized_damerau_levenshtein(&key, &normalize(field.name()));
            (field.name(), score)
        })
        .filter(|(_, score)| *score >= SUGGESTION_THRESHOLD)
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(name, _)| name)
}

// ---------------------------------------------------------------------------------------------
// Checking the values, in upstream's order

fn build_config<'a>(
    fields: &FileFields<'a>,
    opts: &ConfigOptions,
    warnings: &mut Vec<String>,
) -> Result<Config, Problem<'a>> {
    let defaults = Config::defaults(opts);
    let cidr_limit = fields
        .cidr_limit
        .as_ref()
        .map_or(defaults.cidr_limit, |s| s.value);
    check_cidr_count(fields, defaults.non_masquerade_cidrs.len(), cidr_limit)?;
    let non_masquerade_cidrs = match &fields.cidrs {
        Some(list) => list
            .value
            .iter()
            .map(|item| check_cidr(*item, opts))
            .collect::<Result<_, _>>()?,
        None => defaults.non_masquerade_cidrs,
    };
    let resync_interval = match &fields.resync_interval {
        None => defaults.resync_interval,
        Some(setting) => match u64::try_from(setting.value) {
            Ok(nanos) if nanos > 0 => Duration::from_nanos(nanos),
            _ => {
                warnings.push(format!(
                    "resyncInterval {} is not positive; using {}",
                    format_go_nanos(setting.value),
                    format_go_duration(MIN_RESYNC_INTERVAL)
                ));
                MIN_RESYNC_INTERVAL
            }
        },
    };
    Ok(Config {
        non_masquerade_cidrs,
        cidr_limit,
        masq_link_local: fields.masq_link_local.unwrap_or(defaults.masq_link_local),
        masq_link_local_ipv6: fields
            .masq_link_local_ipv6
            .unwrap_or(defaults.masq_link_local_ipv6),
        resync_interval,
    })
}

/// Upstream checks the count before the CIDRs themselves, and also against the default list
/// when the file only lowers cidrLimit.
fn check_cidr_count<'a>(
    fields: &FileFields<'a>,
    default_count: usize,
    limit: i64,
) -> Result<(), Problem<'a>> {
    let count = fields
        .cidrs
        .as_ref()
        .map_or(default_count, |s| s.value.len());
    if i64::try_from(count).is_ok_and(|n| n <= limit) {
        return Ok(());
    }
    let anchor = fields
        .cidrs
        .as_ref()
        .map(|s| s.key)
        .or_else(|| fields.cidr_limit.as_ref().map(|s| s.key));
    Err(Problem::new(
        format!(
            "the daemon can only accept up to {limit} CIDRs (excluding link-local), \
             but got {count} CIDRs (excluding link local)"
        ),
        anchor,
    ))
}

fn check_cidr<'a>(item: Option<&'a String>, opts: &ConfigOptions) -> Result<IpNet, Problem<'a>> {
    let text = item.map_or("", String::as_str);
    let problem = |message: String| Problem::new(message, item);
    let net = parse_go_cidr(text).ok_or_else(|| {
        problem(format!(
            "CIDR {} could not be parsed, invalid CIDR address: {text}",
            go_quote(text)
        ))
    })?;
    let network = net.network();
    if net.addr() != network {
        return Err(problem(format!(
            "CIDR {} is not aligned to a CIDR block, ip: {} network: {}",
            go_quote(text),
            go_quote(&go_ip_string(net.addr())),
            go_quote(&go_net_string(network, net.prefix_len()))
        )));
    }
    let as_go_sees_it = ipv4_mapped_as_ipv4(net);
    if as_go_sees_it.addr().is_ipv6() && !opts.enable_ipv6 {
        return Err(problem(format!(
            "ipv6 is not enabled, but ipv6 cidr {text} provided. \
             Enable ipv6 using --enable-ipv6 agent flag"
        )));
    }
    Ok(as_go_sees_it)
}

/// Go's `net.ParseCIDR`: the `/len` is required, the length may have leading zeros, and the
/// address is strict (no zones, no leading zeros in IPv4 octets), as Rust's parser is too.
fn parse_go_cidr(s: &str) -> Option<IpNet> {
    let (addr, len) = s.split_once('/')?;
    let ip: IpAddr = addr.parse().ok()?;
    if len.is_empty() || !len.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let digits = len.trim_start_matches('0');
    let prefix = if digits.is_empty() {
        0
    } else {
        digits.parse::<u8>().ok()?
    };
    IpNet::new(ip, prefix).ok()
}

/// Go treats an aligned IPv4-mapped CIDR such as `::ffff:10.0.0.0/104` as the IPv4 one it
/// covers (`10.0.0.0/8`), both when checking for IPv6 and when matching addresses.
fn ipv4_mapped_as_ipv4(net: IpNet) -> IpNet {
    if let IpNet::V6(v6) = net
        && let Some(v4) = v6.addr().to_ipv4_mapped()
        && let Some(prefix) = v6.prefix_len().checked_sub(96)
        && let Ok(v4net) = Ipv4Net::new(v4, prefix)
    {
        return IpNet::V4(v4net);
    }
    net
}

/// An address as Go prints it: IPv4-mapped IPv6 addresses in dotted form.
fn go_ip_string(ip: IpAddr) -> String {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.to_string(),
            None => v6.to_string(),
        },
        IpAddr::V4(v4) => v4.to_string(),
    }
}

/// A network as Go's `IPNet.String` prints it: an IPv4-mapped one as the IPv4 network.
fn go_net_string(network: IpAddr, prefix: u8) -> String {
    if let IpAddr::V6(v6) = network
        && let Some(v4) = v6.to_ipv4_mapped()
        && let Some(v4_prefix) = prefix.checked_sub(96)
    {
        return format!("{v4}/{v4_prefix}");
    }
    format!("{network}/{prefix}")
}

// ---------------------------------------------------------------------------------------------
// Finding the line an error is about

/// The line of `target` (a key or string value inside `root`), or `None` when the text does not
/// show it unambiguously. The text must hold `target` exactly as often as the tree does; then
/// the n-th occurrence in the tree is the n-th in the text.
fn locate(text: &[u8], root: &Node, format: Format, target: &String) -> Option<usize> {
    let text = std::str::from_utf8(text).ok()?;
    // Line breaks to YAML's parser, but not to ours.
    if text.contains(['\u{85}', '\u{2028}', '\u{2029}']) {
        return None;
    }
    let mut in_tree = Vec::new();
    collect_equal_strings(root, target, &mut in_tree);
    let nth = in_tree.iter().position(|s| std::ptr::eq(*s, target))?;
    let in_text = token_lines(text, target, format);
    if in_text.len() != in_tree.len() {
        return None;
    }
    in_text.get(nth).copied()
}

fn collect_equal_strings<'a>(node: &'a Node, target: &str, found: &mut Vec<&'a String>) {
    match node {
        Node::Str(s) if s == target => found.push(s),
        Node::Seq(items) => items
            .iter()
            .for_each(|item| collect_equal_strings(item, target, found)),
        Node::Map(entries) => {
            for (key, value) in entries {
                if key == target {
                    found.push(key);
                }
                collect_equal_strings(value, target, found);
            }
        }
        _ => {}
    }
}

/// 1-based line numbers of each place `token` stands on its own (not inside a longer scalar),
/// YAML comments left out.
fn token_lines(text: &str, token: &str, format: Format) -> Vec<usize> {
    if token.is_empty() {
        return Vec::new();
    }
    let is_before = |c: char| c.is_whitespace() || matches!(c, '"' | '\'' | ',' | '[' | '{');
    let is_after = |c: char| c.is_whitespace() || matches!(c, '"' | '\'' | ',' | ']' | '}' | ':');
    let text = text.replace("\r\n", "\n").replace('\r', "\n");
    let mut lines = Vec::new();
    for (index, line) in text.split('\n').enumerate() {
        let line = match format {
            Format::Yaml => strip_yaml_comment(line),
            Format::Json => line,
        };
        for (start, _) in line.match_indices(token) {
            let before_ok = line[..start].chars().next_back().is_none_or(is_before);
            let after_ok = line[start + token.len()..]
                .chars()
                .next()
                .is_none_or(is_after);
            if before_ok && after_ok {
                lines.push(index + 1);
            }
        }
    }
    lines
}

/// Drops a `#` comment. A `#` inside quotes is cut too; that only makes a count disagree, and
/// then no line is given.
fn strip_yaml_comment(line: &str) -> &str {
    let mut previous_is_space = true;
    for (i, c) in line.char_indices() {
        if c == '#' && previous_is_space {
            return &line[..i];
        }
        previous_is_space = c.is_whitespace();
    }
    line
}

// ---------------------------------------------------------------------------------------------
// Go's time.Duration syntax

const NANOS_PER_SECOND: u128 = 1_000_000_000;

/// Go's `time.ParseDuration`: `[-+]?([0-9]*(\.[0-9]*)?[a-z]+)+`, e.g. `1m30s`, `1.5h`, `-1s`,
/// or `0` alone. Returns signed nanoseconds within Go's int64 range; the error text is Go's.
pub fn parse_go_duration(s: &str) -> Result<i128, String> {
    let invalid = || format!("time: invalid duration {}", go_time_quote(s));
    let (negative, mut rest) = match s.as_bytes() {
        [b'-', tail @ ..] => (true, tail),
        [b'+', tail @ ..] => (false, tail),
        all => (false, all),
    };
    if rest == b"0" {
        return Ok(0);
    }
    if rest.is_empty() {
        return Err(invalid());
    }
    let mut total: u128 = 0;
    while let Some(&first) = rest.first() {
        if !(first == b'.' || first.is_ascii_digit()) {
            return Err(invalid());
        }
        let (whole, whole_digits, after) = leading_int(rest).ok_or_else(invalid)?;
        rest = after;
        let (mut fraction, mut scale, mut fraction_digits) = (0, 1.0, 0);
        if let [b'.', after @ ..] = rest {
            (fraction, scale, fraction_digits, rest) = leading_fraction(after);
        }
        if whole_digits == 0 && fraction_digits == 0 {
            return Err(invalid());
        }
        let unit_len = rest
            .iter()
            .position(|&c| c == b'.' || c.is_ascii_digit())
            .unwrap_or(rest.len());
        if unit_len == 0 {
            return Err(format!(
                "time: missing unit in duration {}",
                go_time_quote(s)
            ));
        }
        let (unit, after) = rest.split_at(unit_len);
        rest = after;
        let unit_nanos = unit_nanos(unit).ok_or_else(|| {
            format!(
                "time: unknown unit {} in duration {}",
                go_time_quote(&String::from_utf8_lossy(unit)),
                go_time_quote(s)
            )
        })?;
        total += u128::from(whole) * u128::from(unit_nanos);
        if fraction > 0 {
            // Computed in float64 like Go, so that results agree to the nanosecond.
            total += (fraction as f64 * (unit_nanos as f64 / scale)) as u128;
        }
        // Go's limit: |d| <= 2^63 here, and d <= 2^63-1 once the sign is applied.
        if total > 1 << 63 {
            return Err(invalid());
        }
    }
    let magnitude = i128::try_from(total).map_err(|_| invalid())?;
    if negative {
        Ok(-magnitude)
    } else if magnitude > i128::from(i64::MAX) {
        Err(invalid())
    } else {
        Ok(magnitude)
    }
}

fn unit_nanos(unit: &[u8]) -> Option<u64> {
    match unit {
        b"ns" => Some(1),
        // The second and third are the micro sign U+00B5 and the Greek mu U+03BC.
        b"us" | b"\xc2\xb5s" | b"\xce\xbcs" => Some(1_000),
        b"ms" => Some(1_000_000),
        b"s" => Some(1_000_000_000),
        b"m" => Some(60_000_000_000),
        b"h" => Some(3_600_000_000_000),
        _ => None,
    }
}

/// Go's `leadingInt`: the leading digits, their count and the rest; `None` past 2^63.
fn leading_int(s: &[u8]) -> Option<(u64, usize, &[u8])> {
    let digits = s.iter().take_while(|c| c.is_ascii_digit()).count();
    let mut value: u64 = 0;
    for &c in &s[..digits] {
        value = value.checked_mul(10)?.checked_add(u64::from(c - b'0'))?;
        if value > 1 << 63 {
            return None;
        }
    }
    Some((value, digits, &s[digits..]))
}

/// Go's `leadingFraction`: digits after the point, as a value and a power-of-ten scale. Digits
/// past u64's precision are consumed but ignored.
fn leading_fraction(s: &[u8]) -> (u64, f64, usize, &[u8]) {
    let digits = s.iter().take_while(|c| c.is_ascii_digit()).count();
    let (mut value, mut scale) = (0u64, 1.0f64);
    let mut overflow = false;
    for &c in &s[..digits] {
        if overflow {
            continue;
        }
        match value
            .checked_mul(10)
            .and_then(|v| v.checked_add(u64::from(c - b'0')))
        {
            Some(next) if next <= 1 << 63 => {
                value = next;
                scale *= 10.0;
            }
            _ => overflow = true,
        }
    }
    (value, scale, digits, &s[digits..])
}

/// Go's `time.Duration.String()`: `1m0s`, `1h30m0s`, `1.5s`, `500ms`, `2µs`, `0s`.
pub fn format_go_duration(d: Duration) -> String {
    format_go_nanos(i128::try_from(d.as_nanos()).unwrap_or(i128::MAX))
}

fn format_go_nanos(nanos: i128) -> String {
    let magnitude = nanos.unsigned_abs();
    if magnitude == 0 {
        return "0s".to_owned();
    }
    let sign = if nanos < 0 { "-" } else { "" };
    if magnitude < NANOS_PER_SECOND {
        // Below a second Go switches to the largest unit that keeps a whole part.
        let (decimals, unit) = match magnitude {
            0..1_000 => (0, "ns"),
            1_000..1_000_000 => (3, "µs"),
            _ => (6, "ms"),
        };
        let (whole, fraction) = split_decimals(magnitude, decimals);
        return format!("{sign}{whole}{fraction}{unit}");
    }
    let (seconds, fraction) = split_decimals(magnitude, 9);
    let (minutes, seconds) = (seconds / 60, seconds % 60);
    let (hours, minutes) = (minutes / 60, minutes % 60);
    match (hours, minutes) {
        (0, 0) => format!("{sign}{seconds}{fraction}s"),
        (0, _) => format!("{sign}{minutes}m{seconds}{fraction}s"),
        _ => format!("{sign}{hours}h{minutes}m{seconds}{fraction}s"),
    }
}

/// Splits `value` into its whole part and `.fraction` (trailing zeros dropped, empty if zero),
/// where the last `decimals` digits are the fraction.
fn split_decimals(value: u128, decimals: u32) -> (u128, String) {
    let divisor = 10u128.pow(decimals);
    let (whole, fraction) = (value / divisor, value % divisor);
    if fraction == 0 {
        return (whole, String::new());
    }
    let digits = format!("{fraction:0width$}", width = decimals as usize);
    (whole, format!(".{}", digits.trim_end_matches('0')))
}

// ---------------------------------------------------------------------------------------------
// Go's quoting

/// Go's `%q` / `strconv.Quote`, close enough for messages.
fn go_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\x07' => out.push_str("\\a"),
            '\x08' => out.push_str("\\b"),
            '\x0c' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\x0b' => out.push_str("\\v"),
            c if c.is_ascii_control() => {
                let _ = write!(out, "\\x{:02x}", u32::from(c));
            }
            c if c.is_control() || (c.is_whitespace() && c != ' ') || c == '\u{feff}' => {
                let code = u32::from(c);
                let _ = if code > 0xffff {
                    write!(out, "\\U{code:08x}")
                } else {
                    write!(out, "\\u{code:04x}")
                };
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The quoting of Go's time package: bytes outside printable ASCII as `\xNN`.
fn go_time_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        if (' '..='\x7f').contains(&c) {
            if c == '"' || c == '\\' {
                out.push('\\');
            }
            out.push(c);
        } else {
            let mut bytes = [0; 4];
            for b in c.encode_utf8(&mut bytes).bytes() {
                let _ = write!(out, "\\x{b:02x}");
            }
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const V4_ONLY: ConfigOptions = ConfigOptions {
        nomasq_all_reserved_ranges: false,
        enable_ipv6: false,
    };
    const WITH_V6: ConfigOptions = ConfigOptions {
        nomasq_all_reserved_ranges: false,
        enable_ipv6: true,
    };
    const ORIGIN: &str = "/etc/config/ip-masq-agent";

    fn net(s: &str) -> IpNet {
        s.parse().expect("test CIDR")
    }

    fn nets(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|s| net(s)).collect()
    }

    fn accept_with(text: &str, opts: &ConfigOptions) -> Loaded {
        match parse(text.as_bytes(), ORIGIN, opts) {
            Ok(loaded) => loaded,
            Err(e) => panic!("rejected {text:?}: {e}"),
        }
    }

    fn accept(text: &str) -> Loaded {
        accept_with(text, &V4_ONLY)
    }

    fn config(text: &str) -> Config {
        let loaded = accept(text);
        assert_eq!(loaded.source, ConfigSource::File);
        loaded.config
    }

    fn reject_with(text: &str, opts: &ConfigOptions) -> ConfigError {
        match parse(text.as_bytes(), ORIGIN, opts) {
            Ok(loaded) => panic!("accepted {text:?}: {loaded:?}"),
            Err(e) => {
                assert_eq!(e.origin, ORIGIN);
                e
            }
        }
    }

    fn reject(text: &str) -> ConfigError {
        reject_with(text, &V4_ONLY)
    }

    fn defaults() -> Config {
        Config::defaults(&V4_ONLY)
    }

    // --- upstream's YAML cases ---

    #[test]
    fn yaml_with_all_keys() {
        let expected = Config {
            non_masquerade_cidrs: nets(&["172.16.0.0/12", "10.0.0.0/8"]),
            cidr_limit: 64,
            masq_link_local: true,
            masq_link_local_ipv6: false,
            resync_interval: Duration::from_secs(5),
        };
        let flow = "nonMasqueradeCIDRs: [172.16.0.0/12, 10.0.0.0/8]\n\
                    cidrLimit: 64\nmasqLinkLocal: true\nresyncInterval: 5s\n";
        assert_eq!(config(flow), expected);
        let block = "nonMasqueradeCIDRs:\n  - 172.16.0.0/12\n  - 10.0.0.0/8\n\
                     cidrLimit: 64\nmasqLinkLocal: true\nresyncInterval: 5s\n";
        assert_eq!(config(block), expected);
    }

    #[test]
    fn yaml_with_only_the_cidr_list() {
        let expected = Config {
            non_masquerade_cidrs: nets(&["192.168.0.0/16"]),
            ..defaults()
        };
        assert_eq!(config("nonMasqueradeCIDRs: [192.168.0.0/16]"), expected);
    }

    #[test]
    fn yaml_with_only_masq_link_local() {
        let expected = Config {
            masq_link_local: true,
            ..defaults()
        };
        assert_eq!(config("masqLinkLocal: true"), expected);
    }

    #[test]
    fn yaml_with_only_masq_link_local_ipv6() {
        let expected = Config {
            masq_link_local_ipv6: true,
            ..defaults()
        };
        assert_eq!(config("masqLinkLocalIPv6: true"), expected);
    }

    #[test]
    fn yaml_with_only_resync_interval() {
        let expected = Config {
            resync_interval: Duration::from_secs(300),
            ..defaults()
        };
        assert_eq!(config("resyncInterval: 5m"), expected);
    }

    #[test]
    fn invalid_yaml_is_rejected_with_its_line() {
        let e = reject("*");
        assert_eq!(e.line, Some(1));
        assert!(e.message.starts_with("invalid YAML: "), "{e}");
        assert!(e.message.contains("alias"), "{e}");
        assert!(!e.message.contains("at line"), "position given twice: {e}");

        let e = reject("cidrLimit: 3\nnonMasqueradeCIDRs: [10.0.0.0/8\nmasqLinkLocal: true\n");
        assert!(e.line.is_some_and(|line| line >= 2), "{e}");
        assert!(
            e.to_string().starts_with(&format!("{ORIGIN}: line ")),
            "{e}"
        );
    }

    // --- upstream's JSON cases ---

    #[test]
    fn json_with_all_keys() {
        let text = r#"{"nonMasqueradeCIDRs": ["172.16.0.0/12", "10.0.0.0/8"], "cidrLimit": 64,
                       "masqLinkLocal": true, "masqLinkLocalIPv6": true, "resyncInterval": "5s"}"#;
        let expected = Config {
            non_masquerade_cidrs: nets(&["172.16.0.0/12", "10.0.0.0/8"]),
            cidr_limit: 64,
            masq_link_local: true,
            masq_link_local_ipv6: true,
            resync_interval: Duration::from_secs(5),
        };
        assert_eq!(config(text), expected);
    }

    #[test]
    fn json_with_single_keys() {
        assert_eq!(
            config(r#"{"nonMasqueradeCIDRs": ["192.168.0.0/16"]}"#),
            Config {
                non_masquerade_cidrs: nets(&["192.168.0.0/16"]),
                ..defaults()
            }
        );
        assert_eq!(
            config(r#"{"masqLinkLocal": true}"#),
            Config {
                masq_link_local: true,
                ..defaults()
            }
        );
        assert_eq!(
            config(r#"{"resyncInterval": "5m"}"#),
            Config {
                resync_interval: Duration::from_secs(300),
                ..defaults()
            }
        );
        assert_eq!(config("  \n {}"), defaults());
    }

    #[test]
    fn invalid_json_is_rejected_with_line_and_column() {
        let e = reject("{*");
        assert_eq!(e.line, Some(1));
        assert_eq!(e.message, "invalid JSON: key must be a string at column 2");
        assert_eq!(
            e.to_string(),
            format!("{ORIGIN}: line 1: invalid JSON: key must be a string at column 2")
        );

        let e = reject("{\n  \"cidrLimit\": 5,\n}\n");
        assert_eq!(e.line, Some(3));
        assert!(e.message.contains("trailing comma"), "{e}");
    }

    #[test]
    fn json_unicode_escapes_are_decoded() {
        let c = config(r#"{"resyncInterval": "\u0035s"}"#);
        assert_eq!(c.resync_interval, Duration::from_secs(5));
        let c = config(r#"{"\u006dasqLinkLocal": true}"#);
        assert!(c.masq_link_local);
    }

    // --- missing and empty files ---

    #[test]
    fn missing_file_means_defaults() {
        let dir = tempfile::tempdir().expect("tempdir");
        let opts = ConfigOptions {
            nomasq_all_reserved_ranges: true,
            enable_ipv6: false,
        };
        let loaded = load(&dir.path().join("absent"), &opts).expect("defaults");
        assert_eq!(loaded.source, ConfigSource::Missing);
        assert_eq!(loaded.config, Config::defaults(&opts));
        assert!(loaded.warnings.is_empty());
    }

    #[test]
    fn existing_file_is_read() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("config");
        std::fs::write(&path, "cidrLimit: 3\nmasqLinkLocal: yes\n").expect("write");
        let loaded = load(&path, &V4_ONLY).expect("valid");
        assert_eq!(loaded.source, ConfigSource::File);
        assert_eq!(loaded.config.cidr_limit, 3);
        assert!(loaded.config.masq_link_local);
    }

    #[test]
    fn errors_from_load_name_the_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("config");
        std::fs::write(&path, "cidrLimit: [").expect("write");
        let e = load(&path, &V4_ONLY).expect_err("invalid");
        assert_eq!(e.origin, path.display().to_string());
        assert!(e.to_string().starts_with(&path.display().to_string()));
    }

    #[test]
    fn a_directory_is_an_error_not_defaults() {
        let dir = tempfile::tempdir().expect("tempdir");
        let e = load(dir.path(), &V4_ONLY).expect_err("directory");
        assert_eq!(e.origin, dir.path().display().to_string());
        assert_eq!(e.line, None);
        assert!(
            e.message.starts_with("cannot read the config file: "),
            "{e}"
        );
    }

    #[test]
    fn empty_whitespace_and_comment_only_files_mean_defaults() {
        for text in [
            "",
            "   \n\t\n",
            "# nothing here\n  # still nothing\n",
            "---\n",
            "~\n",
        ] {
            let loaded = accept(text);
            assert_eq!(loaded.config, defaults(), "{text:?}");
            assert_eq!(loaded.source, ConfigSource::File);
            assert!(
                loaded.warnings.is_empty(),
                "{text:?}: {:?}",
                loaded.warnings
            );
        }
    }

    #[test]
    fn a_top_level_value_that_is_not_a_mapping_is_rejected() {
        for (text, kind) in [
            ("- 10.0.0.0/8\n", "array"),
            ("hello", "string"),
            ("5", "number"),
        ] {
            let e = reject(text);
            assert!(
                e.message.starts_with(&format!(
                    "json: cannot unmarshal {kind} into Go value of type MasqConfig"
                )),
                "{e}"
            );
        }
    }

    // --- CIDR rules ---

    #[test]
    fn ipv6_cidrs_need_enable_ipv6() {
        let text = "nonMasqueradeCIDRs: [10.0.0.0/8, fc00::/7]";
        let loaded = accept_with(text, &WITH_V6);
        assert_eq!(
            loaded.config.non_masquerade_cidrs,
            nets(&["10.0.0.0/8", "fc00::/7"])
        );

        let e = reject_with(text, &V4_ONLY);
        assert_eq!(
            e.message,
            "ipv6 is not enabled, but ipv6 cidr fc00::/7 provided. \
             Enable ipv6 using --enable-ipv6 agent flag"
        );
        assert_eq!(e.line, Some(1));
    }

    #[test]
    fn the_ipv6_message_shows_the_cidr_as_written() {
        let e = reject(r#"{"nonMasqueradeCIDRs": ["FC00:0::/7"]}"#);
        assert!(e.message.contains("ipv6 cidr FC00:0::/7 provided"), "{e}");
    }

    #[test]
    fn ipv4_mapped_cidrs_are_ipv4_as_in_go() {
        let c = config(r#"{"nonMasqueradeCIDRs": ["::ffff:10.0.0.0/104"]}"#);
        assert_eq!(c.non_masquerade_cidrs, nets(&["10.0.0.0/8"]));
        let e = reject(r#"{"nonMasqueradeCIDRs": ["::ffff:10.0.0.1/104"]}"#);
        assert_eq!(
            e.message,
            r#"CIDR "::ffff:10.0.0.1/104" is not aligned to a CIDR block, ip: "10.0.0.1" network: "10.0.0.0/8""#
        );
    }

    #[test]
    fn unaligned_cidr_is_rejected() {
        let e = reject("nonMasqueradeCIDRs: [10.0.0.1/8]");
        assert_eq!(
            e.message,
            r#"CIDR "10.0.0.1/8" is not aligned to a CIDR block, ip: "10.0.0.1" network: "10.0.0.0/8""#
        );
        let e = reject_with("nonMasqueradeCIDRs: [\"fc00::1/7\"]", &WITH_V6);
        assert_eq!(
            e.message,
            r#"CIDR "fc00::1/7" is not aligned to a CIDR block, ip: "fc00::1" network: "fc00::/7""#
        );
    }

    #[test]
    fn unparsable_cidrs_are_rejected() {
        let e = reject("nonMasqueradeCIDRs: [abcdefg]");
        assert_eq!(
            e.message,
            r#"CIDR "abcdefg" could not be parsed, invalid CIDR address: abcdefg"#
        );
        for bad in [
            "10.256.0.0/16",
            "10.0.0.0",
            "10.0.0.0/33",
            "010.0.0.0/8",
            "10.0.0.0/",
            "10.0.0.0/+8",
            "10.0.0.0/8/8",
            "10.0.0/8",
            " 10.0.0.0/8",
            "fe80::%eth0/64",
            "fc00::/129",
            "",
        ] {
            let text = format!(r#"{{"nonMasqueradeCIDRs": [{}]}}"#, serde_json::json!(bad));
            let e = reject_with(&text, &WITH_V6);
            assert_eq!(
                e.message,
                format!(
                    "CIDR {} could not be parsed, invalid CIDR address: {bad}",
                    go_quote(bad)
                )
            );
        }
    }

    #[test]
    fn prefix_lengths_may_have_leading_zeros_as_in_go() {
        let c = config("nonMasqueradeCIDRs: [10.0.0.0/08, 0.0.0.0/0]");
        assert_eq!(c.non_masquerade_cidrs, nets(&["10.0.0.0/8", "0.0.0.0/0"]));
    }

    #[test]
    fn a_null_list_item_is_an_empty_cidr() {
        let e = reject(r#"{"nonMasqueradeCIDRs": ["10.0.0.0/8", null]}"#);
        assert_eq!(
            e.message,
            r#"CIDR "" could not be parsed, invalid CIDR address: "#
        );
    }

    #[test]
    fn cidr_limit_is_checked_before_the_cidrs() {
        let list = |n: usize| -> String {
            let items: Vec<String> = (0..n).map(|i| format!("\"10.{i}.0.0/16\"")).collect();
            items.join(", ")
        };
        let c = config(&format!("nonMasqueradeCIDRs: [{}]", list(64)));
        assert_eq!(c.non_masquerade_cidrs.len(), 64);

        let e = reject(&format!("nonMasqueradeCIDRs: [{}, bogus]", list(64)));
        assert_eq!(
            e.message,
            "the daemon can only accept up to 64 CIDRs (excluding link-local), \
             but got 65 CIDRs (excluding link local)"
        );
        assert_eq!(e.line, Some(1));
    }

    #[test]
    fn custom_cidr_limit() {
        let c = config("cidrLimit: 100\nnonMasqueradeCIDRs: [10.0.0.0/8, 10.0.0.0/8]");
        assert_eq!(c.cidr_limit, 100);

        let e = reject("cidrLimit: 1\nnonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]");
        assert_eq!(
            e.message,
            "the daemon can only accept up to 1 CIDRs (excluding link-local), \
             but got 2 CIDRs (excluding link local)"
        );
        assert_eq!(e.line, Some(2));

        // Upstream also holds the default list to a lowered limit.
        let e = reject("# the limit alone\ncidrLimit: 2\n");
        assert!(e.message.contains("up to 2 CIDRs") && e.message.contains("got 3"));
        assert_eq!(e.line, Some(2));

        // And a negative limit rejects even an empty list, like upstream.
        let e = reject("cidrLimit: -1\nnonMasqueradeCIDRs: []");
        assert!(e.message.contains("up to -1 CIDRs"), "{e}");
    }

    #[test]
    fn empty_cidr_list_means_masquerade_everything() {
        for text in [
            "nonMasqueradeCIDRs:",
            "nonMasqueradeCIDRs:\n",
            "nonMasqueradeCIDRs: []",
            "nonMasqueradeCIDRs: ~",
            r#"{"nonMasqueradeCIDRs": null}"#,
            r#"{"nonMasqueradeCIDRs": []}"#,
        ] {
            let c = config(text);
            assert!(c.non_masquerade_cidrs.is_empty(), "{text:?}");
            assert!(!c.masq_link_local, "{text:?}");
        }
    }

    #[test]
    fn all_reserved_ranges_default() {
        let opts = ConfigOptions {
            nomasq_all_reserved_ranges: true,
            enable_ipv6: false,
        };
        let expected = nets(&[
            "10.0.0.0/8",
            "172.16.0.0/12",
            "192.168.0.0/16",
            "100.64.0.0/10",
            "192.0.0.0/24",
            "192.0.2.0/24",
            "192.88.99.0/24",
            "198.18.0.0/15",
            "198.51.100.0/24",
            "203.0.113.0/24",
            "240.0.0.0/4",
        ]);
        assert_eq!(Config::defaults(&opts).non_masquerade_cidrs, expected);
        let loaded = accept_with("masqLinkLocal: true", &opts);
        assert_eq!(loaded.config.non_masquerade_cidrs, expected);
        assert_eq!(
            defaults().non_masquerade_cidrs,
            nets(&["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"])
        );
    }

    #[test]
    fn duplicate_cidrs_are_kept() {
        let c = config("nonMasqueradeCIDRs: [10.0.0.0/8, 10.0.0.0/8, 192.168.0.0/16]");
        assert_eq!(
            c.non_masquerade_cidrs,
            nets(&["10.0.0.0/8", "10.0.0.0/8", "192.168.0.0/16"])
        );
    }

    // --- keys ---

    #[test]
    fn keys_match_case_insensitively() {
        let loaded = accept(
            "NONMASQUERADECIDRS: [10.0.0.0/8]\ncidrlimit: 5\n\
             MasqLinkLocal: true\nmasqlinklocalipv6: true\nRESYNCINTERVAL: 2s\n",
        );
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
        assert_eq!(
            loaded.config,
            Config {
                non_masquerade_cidrs: nets(&["10.0.0.0/8"]),
                cidr_limit: 5,
                masq_link_local: true,
                masq_link_local_ipv6: true,
                resync_interval: Duration::from_secs(2),
            }
        );
        // Go folds Unicode too: the Kelvin sign is a K, the long s an S.
        assert!(config("masqLin\u{212a}Local: true").masq_link_local);
        assert_eq!(
            config("nonMasqueradeCIDR\u{17f}: []").non_masquerade_cidrs,
            vec![]
        );
    }

    #[test]
    fn of_two_keys_for_one_field_the_last_wins() {
        let loaded =
            accept("nonMasqueradeCIDRs: [10.0.0.0/8]\nNONMASQUERADECIDRS: [192.168.0.0/16]");
        assert_eq!(
            loaded.config.non_masquerade_cidrs,
            nets(&["192.168.0.0/16"])
        );
        assert_eq!(
            loaded.warnings,
            vec![format!(
                "nonMasqueradeCIDRs is set 2 times in {ORIGIN}: the last one is used"
            )]
        );
        let c = config(r#"{"cidrLimit": 5, "cidrLimit": 7}"#);
        assert_eq!(c.cidr_limit, 7);
    }

    #[test]
    fn a_yaml_key_written_twice_keeps_only_its_last_value() {
        // go-yaml builds a map first, so the first value is never decoded.
        let c = config("masqLinkLocal: 5\nmasqLinkLocal: true\n");
        assert!(c.masq_link_local);
        // Go's JSON decoder sees both, and the first one's type error counts.
        let e = reject(r#"{"masqLinkLocal": 5, "masqLinkLocal": true}"#);
        assert!(e.message.contains("of type bool"), "{e}");
    }

    #[test]
    fn unknown_keys_are_ignored_with_a_warning() {
        let loaded = accept("nonMasqueradeCIDR: [1.2.3.0/24]\nfoo: 1\nresync-interval: 5s\n");
        assert_eq!(loaded.config, defaults());
        assert_eq!(
            loaded.warnings,
            vec![
                format!(
                    "unknown key \"nonMasqueradeCIDR\" in {ORIGIN}: ignored; \
                     did you mean nonMasqueradeCIDRs?"
                ),
                format!("unknown key \"foo\" in {ORIGIN}: ignored"),
                format!(
                    "unknown key \"resync-interval\" in {ORIGIN}: ignored; \
                     did you mean resyncInterval?"
                ),
            ]
        );
    }

    #[test]
    fn suggestions_pick_the_closest_key() {
        assert_eq!(suggest_key("masqLinkLocalV6"), Some("masqLinkLocalIPv6"));
        assert_eq!(suggest_key("masq_link_local"), Some("masqLinkLocal"));
        assert_eq!(suggest_key("cidrlimt"), Some("cidrLimit"));
        assert_eq!(
            suggest_key("nonMasqueradeCIRDs"),
            Some("nonMasqueradeCIDRs")
        );
        assert_eq!(suggest_key("apiVersion"), None);
        assert_eq!(suggest_key("x"), None);
    }

    // --- values ---

    #[test]
    fn yaml_11_booleans_are_accepted_in_yaml() {
        for (word, value) in [
            ("y", true),
            ("Y", true),
            ("yes", true),
            ("Yes", true),
            ("YES", true),
            ("on", true),
            ("On", true),
            ("ON", true),
            ("true", true),
            ("True", true),
            ("TRUE", true),
            ("n", false),
            ("N", false),
            ("no", false),
            ("No", false),
            ("NO", false),
            ("off", false),
            ("Off", false),
            ("OFF", false),
            ("false", false),
            ("False", false),
            ("FALSE", false),
        ] {
            let c = config(&format!("masqLinkLocal: {word}\nmasqLinkLocalIPv6: {word}"));
            assert_eq!(c.masq_link_local, value, "{word}");
            assert_eq!(c.masq_link_local_ipv6, value, "{word}");
        }
    }

    #[test]
    fn yaml_11_booleans_are_strings_in_json_and_in_quotes() {
        let e = reject(r#"{"masqLinkLocal": "yes"}"#);
        assert_eq!(
            e.message,
            "json: cannot unmarshal string into Go struct field MasqConfig.masqLinkLocal of type bool"
        );
        let e = reject("masqLinkLocal: \"true\"");
        assert!(e.message.contains("cannot unmarshal string"), "{e}");
        // A YAML 1.1 boolean where a string belongs is a type error, as upstream.
        let e = reject("nonMasqueradeCIDRs: [10.0.0.0/8, no]");
        assert_eq!(
            e.message,
            "json: cannot unmarshal bool into Go struct field MasqConfig.nonMasqueradeCIDRs of type string"
        );
    }

    #[test]
    fn yaml_11_numbers() {
        assert_eq!(config("cidrLimit: 010").cidr_limit, 8);
        assert_eq!(config("cidrLimit: 1_000").cidr_limit, 1000);
        assert_eq!(config("cidrLimit: 0x40").cidr_limit, 64);
        assert_eq!(config("cidrLimit: 0b111").cidr_limit, 7);
        // A whole float becomes an int on upstream's way through JSON ...
        assert_eq!(config("cidrLimit: 64.0").cidr_limit, 64);
        assert_eq!(config("cidrLimit: 1e2").cidr_limit, 100);
        // ... but not in a JSON file.
        let e = reject(r#"{"cidrLimit": 64.0}"#);
        assert_eq!(
            e.message,
            "json: cannot unmarshal number 64.0 into Go struct field MasqConfig.cidrLimit of type int"
        );
    }

    #[test]
    fn non_finite_yaml_floats_are_rejected_like_upstream() {
        let e = reject("somethingElse: .inf\n");
        assert_eq!(e.message, "json: unsupported value: +Inf");
        let e = reject("cidrLimit: .nan\n");
        assert_eq!(e.message, "json: unsupported value: NaN");
    }

    #[test]
    fn non_positive_resync_interval_is_replaced_by_one_second() {
        for (text, shown) in [
            ("resyncInterval: -5s", "-5s"),
            ("resyncInterval: 0s", "0s"),
            ("resyncInterval: \"0\"", "0s"),
            (r#"{"resyncInterval": "-1m30s"}"#, "-1m30s"),
        ] {
            let loaded = accept(text);
            assert_eq!(
                loaded.config.resync_interval,
                Duration::from_secs(1),
                "{text}"
            );
            assert_eq!(
                loaded.warnings,
                vec![format!("resyncInterval {shown} is not positive; using 1s")]
            );
        }
    }

    #[test]
    fn wrong_types_are_rejected_with_go_messages() {
        let field = |name: &str, what: &str, go_type: &str| {
            format!(
                "json: cannot unmarshal {what} into Go struct field MasqConfig.{name} of type {go_type}"
            )
        };
        let cases = [
            ("masqLinkLocal: 1", field("masqLinkLocal", "number", "bool")),
            (
                "masqLinkLocalIPv6: [true]",
                field("masqLinkLocalIPv6", "array", "bool"),
            ),
            (
                "nonMasqueradeCIDRs: 10.0.0.0/8",
                field("nonMasqueradeCIDRs", "string", "[]string"),
            ),
            (
                "nonMasqueradeCIDRs: {a: b}",
                field("nonMasqueradeCIDRs", "object", "[]string"),
            ),
            (
                "nonMasqueradeCIDRs: [10.0.0.0/8, 10]",
                field("nonMasqueradeCIDRs", "number", "string"),
            ),
            (
                "nonMasqueradeCIDRs: [[10.0.0.0/8]]",
                field("nonMasqueradeCIDRs", "array", "string"),
            ),
            ("cidrLimit: 64.5", field("cidrLimit", "number 64.5", "int")),
            (
                "cidrLimit: 99999999999999999999",
                field("cidrLimit", "number 99999999999999999999", "int"),
            ),
            ("cidrLimit: \"64\"", field("cidrLimit", "string", "int")),
            ("cidrLimit: true", field("cidrLimit", "bool", "int")),
            (
                r#"{"cidrLimit": 9223372036854775808}"#,
                field("cidrLimit", "number 9223372036854775808", "int"),
            ),
            (
                "resyncInterval: 60",
                r#"expected string value for unmarshal to field of type Duration, got "60""#
                    .to_owned(),
            ),
            (
                "resyncInterval: [5s]",
                r#"expected string value for unmarshal to field of type Duration, got "[\"5s\"]""#
                    .to_owned(),
            ),
            (
                "resyncInterval:",
                r#"expected string value for unmarshal to field of type Duration, got "null""#
                    .to_owned(),
            ),
            (
                r#"{"resyncInterval": null}"#,
                r#"expected string value for unmarshal to field of type Duration, got "null""#
                    .to_owned(),
            ),
            (
                "resyncInterval: abc",
                r#"time: invalid duration "abc""#.to_owned(),
            ),
            (
                "resyncInterval: \"5\"",
                r#"time: missing unit in duration "5""#.to_owned(),
            ),
            (
                "resyncInterval: 5d",
                r#"time: unknown unit "d" in duration "5d""#.to_owned(),
            ),
        ];
        for (text, message) in cases {
            let e = reject(text);
            assert_eq!(e.message, message, "{text}");
            assert_eq!(e.line, Some(1), "{text}");
        }
    }

    #[test]
    fn null_leaves_bool_and_int_fields_alone() {
        let c = config("cidrLimit: null\nmasqLinkLocal:\nmasqLinkLocalIPv6: ~\n");
        assert_eq!(c, defaults());
        let c = config(r#"{"cidrLimit": null, "masqLinkLocal": null}"#);
        assert_eq!(c, defaults());
    }

    #[test]
    fn a_duration_error_outranks_an_earlier_type_error() {
        // Go's decoder stops at a failing custom decoder but only notes type mismatches.
        let e = reject(r#"{"masqLinkLocal": 1, "resyncInterval": "abc"}"#);
        assert_eq!(e.message, r#"time: invalid duration "abc""#);
        let e = reject(r#"{"masqLinkLocal": 1, "cidrLimit": "x"}"#);
        assert!(e.message.contains("masqLinkLocal"), "{e}");
    }

    // --- lines in messages ---

    #[test]
    fn a_bad_cidr_is_reported_with_file_and_line() {
        let text = "nonMasqueradeCIDRs:\n  - 192.168.0.0/16\n  - 10.0.0.1/8\nmasqLinkLocal: true\n";
        let e = reject(text);
        assert_eq!(e.line, Some(3));
        assert_eq!(
            e.to_string(),
            format!(
                "{ORIGIN}: line 3: CIDR \"10.0.0.1/8\" is not aligned to a CIDR block, \
                 ip: \"10.0.0.1\" network: \"10.0.0.0/8\""
            )
        );
    }

    #[test]
    fn lines_are_found_past_comments_and_repeats() {
        // The same text in a comment and under an unknown key does not mislead.
        let text = "# 10.0.0.1/8 is wrong\nnotes: [10.0.0.1/8]\nnonMasqueradeCIDRs:\n\
                    - 10.0.0.0/8\n- 10.0.0.1/8\n";
        assert_eq!(reject(text).line, Some(5));
        // JSON spread over lines: the key's line for a type error.
        let text = "{\n  \"cidrLimit\": 5,\n  \"masqLinkLocal\": \"no\"\n}";
        assert_eq!(reject(text).line, Some(3));
        // CRLF line ends.
        let text = "cidrLimit: 5\r\nnonMasqueradeCIDRs:\r\n- abc\r\n";
        assert_eq!(reject(text).line, Some(3));
    }

    #[test]
    fn no_line_rather_than_a_wrong_one() {
        // The bad value also stands inside a longer string: the count disagrees.
        let text = "note: \"see 10.0.0.1/8\"\nnonMasqueradeCIDRs: [\"10.0.0.1/8\"]\n";
        let e = reject(text);
        assert!(e.message.contains("not aligned"), "{e}");
        // Written escaped in JSON, the key can't be found as text.
        let e = reject("{\n\"\\u006dasqLinkLocal\": 3}");
        assert!(e.message.contains("masqLinkLocal"), "{e}");
        assert_eq!(e.line, None);
        // An empty CIDR (from null) has no text to find.
        let e = reject("nonMasqueradeCIDRs:\n- 10.0.0.0/8\n- null\n");
        assert_eq!(e.line, None);
        assert_eq!(e.to_string(), format!("{ORIGIN}: {}", e.message));
    }

    // --- other YAML features ---

    #[test]
    fn only_the_first_yaml_document_counts() {
        let loaded = accept("cidrLimit: 5\n---\ncidrLimit: [\n");
        assert_eq!(loaded.config.cidr_limit, 5);
        assert_eq!(
            loaded.warnings,
            vec![format!(
                "{ORIGIN} holds more than one YAML document: only the first is used"
            )]
        );
        assert!(accept("cidrLimit: 5\n---\n").warnings.is_empty());
    }

    #[test]
    fn yaml_anchors_tags_and_merge_keys() {
        let c = config(
            "base: &base\n  masqLinkLocal: true\n  cidrLimit: 5\n\
             <<: *base\ncidrLimit: 7\nnonMasqueradeCIDRs: &l [10.0.0.0/8]\n",
        );
        assert!(c.masq_link_local);
        assert_eq!(c.cidr_limit, 7);
        assert_eq!(c.non_masquerade_cidrs, nets(&["10.0.0.0/8"]));
        assert_eq!(config("cidrLimit: !!int \"9\"").cidr_limit, 9);
        assert!(config("masqLinkLocal: !custom true").masq_link_local);
        let e = reject("<<: 5\n");
        assert_eq!(e.message, MERGE_ERROR);
    }

    #[test]
    fn hostile_input_is_rejected_without_panicking() {
        let deep = format!("a: {}", "[".repeat(100_000));
        assert_eq!(
            reject(&deep).message,
            "invalid YAML: nested more than 1000 levels deep"
        );
        let deep = format!("a: {}", "[".repeat(500));
        assert!(reject(&deep).message.contains("recursion limit"));
        let deep = format!("{{\"a\": {}", "[".repeat(100_000));
        assert!(reject(&deep).message.contains("recursion limit"));
        let mut laughs = String::from("a: &a [x, x, x, x, x, x, x, x, x]\n");
        for (name, prev) in ["b", "c", "d", "e", "f", "g", "h", "i"]
            .iter()
            .zip("abcdefgh".chars())
        {
            let refs = vec![format!("*{prev}"); 9].join(", ");
            laughs.push_str(&format!("{name}: &{name} [{refs}]\n"));
        }
        assert!(parse(laughs.as_bytes(), ORIGIN, &V4_ONLY).is_err());
        assert!(parse(b"\xff\xfe\x00{", ORIGIN, &V4_ONLY).is_err());
        assert!(parse(b"{\"a\": \"\xff\"}", ORIGIN, &V4_ONLY).is_err());
        let e = reject(&format!("resyncInterval: {}h", "9".repeat(5000)));
        assert!(e.message.starts_with("time: invalid duration"), "{e}");
        let many = format!(
            "nonMasqueradeCIDRs: [{}]",
            vec!["10.0.0.0/8"; 100_000].join(",")
        );
        assert!(reject(&many).message.contains("got 100000 CIDRs"));
        let e = reject("? [a, b]\n: c\n");
        assert!(e.message.contains("unsupported map key"), "{e}");
    }

    // --- output ---

    #[test]
    fn upstream_json_uses_upstream_keys() {
        let c = Config {
            non_masquerade_cidrs: nets(&["10.0.0.0/8", "fc00::/7"]),
            cidr_limit: 10,
            masq_link_local: true,
            masq_link_local_ipv6: false,
            resync_interval: Duration::from_secs(90),
        };
        assert_eq!(
            c.to_upstream_json(),
            serde_json::json!({
                "nonMasqueradeCIDRs": ["10.0.0.0/8", "fc00::/7"],
                "cidrLimit": 10,
                "masqLinkLocal": true,
                "masqLinkLocalIPv6": false,
                "resyncInterval": "1m30s",
            })
        );
        assert_eq!(defaults().to_upstream_json()["resyncInterval"], "1m0s");
    }

    // --- Go durations ---

    #[test]
    fn go_duration_formatting() {
        let ms = Duration::from_millis;
        for (d, text) in [
            (Duration::from_secs(60), "1m0s"),
            (Duration::from_secs(90), "1m30s"),
            (Duration::from_secs(5), "5s"),
            (ms(500), "500ms"),
            (Duration::from_secs(5400), "1h30m0s"),
            (ms(1500), "1.5s"),
            (Duration::ZERO, "0s"),
            (Duration::from_micros(2), "2µs"),
            (Duration::from_nanos(1), "1ns"),
            (Duration::from_nanos(1_500), "1.5µs"),
            (Duration::from_nanos(3_600_000_000_001), "1h0m0.000000001s"),
            (Duration::from_secs(100 * 3600), "100h0m0s"),
        ] {
            assert_eq!(format_go_duration(d), text);
        }
        assert_eq!(format_go_nanos(-1_500_000_000), "-1.5s");
        assert_eq!(
            format_go_nanos(i128::from(i64::MIN)),
            "-2562047h47m16.854775808s"
        );
    }

    #[test]
    fn go_duration_parsing() {
        const S: i128 = 1_000_000_000;
        for (text, nanos) in [
            ("5s", 5 * S),
            ("1m30s", 90 * S),
            ("500ms", S / 2),
            ("-1s", -S),
            ("+1s", S),
            ("0", 0),
            ("-0", 0),
            ("1.5h", 5400 * S),
            (".5s", S / 2),
            ("1.s", S),
            ("1h2m3s4ms5us6ns", 3_723_004_005_006),
            ("2µs", 2000),
            ("2μs", 2000),
            ("3ns", 3),
            ("1.0000000001s", S),
            ("9223372036854775807ns", i128::from(i64::MAX)),
            ("-9223372036854775808ns", i128::from(i64::MIN)),
            ("2562047h47m16.854775807s", i128::from(i64::MAX)),
        ] {
            assert_eq!(parse_go_duration(text), Ok(nanos), "{text}");
        }
        for (text, message) in [
            ("", r#"time: invalid duration """#),
            ("abc", r#"time: invalid duration "abc""#),
            ("-", r#"time: invalid duration "-""#),
            (".s", r#"time: invalid duration ".s""#),
            ("5", r#"time: missing unit in duration "5""#),
            ("00", r#"time: missing unit in duration "00""#),
            ("1s5", r#"time: missing unit in duration "1s5""#),
            ("5 s", r#"time: unknown unit " s" in duration "5 s""#),
            ("5S", r#"time: unknown unit "S" in duration "5S""#),
            (
                "1é",
                r#"time: unknown unit "\xc3\xa9" in duration "1\xc3\xa9""#,
            ),
            (
                "9223372036854775808ns",
                r#"time: invalid duration "9223372036854775808ns""#,
            ),
            ("2562048h", r#"time: invalid duration "2562048h""#),
            (
                "9223372036854775808ns9223372036854775808ns",
                r#"time: invalid duration "9223372036854775808ns9223372036854775808ns""#,
            ),
            (
                "99999999999999999999s",
                r#"time: invalid duration "99999999999999999999s""#,
            ),
        ] {
            assert_eq!(parse_go_duration(text), Err(message.to_owned()), "{text}");
        }
    }

    #[test]
    fn go_duration_round_trips() {
        for nanos in [
            0u64,
            1,
            999,
            1_000,
            1_500,
            999_999,
            1_000_000,
            500_000_000,
            1_000_000_000,
            1_500_000_000,
            59_999_999_999,
            60_000_000_000,
            90_000_000_000,
            3_599_999_999_999,
            5_400_000_000_000,
            86_400_000_000_123,
            i64::MAX as u64,
        ] {
            let d = Duration::from_nanos(nanos);
            let text = format_go_duration(d);
            assert_eq!(parse_go_duration(&text), Ok(i128::from(nanos)), "{text}");
        }
        for nanos in [-1i128, -1_500, -90_000_000_000, i128::from(i64::MIN)] {
            assert_eq!(parse_go_duration(&format_go_nanos(nanos)), Ok(nanos));
        }
    }

    // --- helpers with Go behaviour of their own ---

    #[test]
    fn go_quoting() {
        assert_eq!(go_quote("a\"b\\c\n\u{1}é"), r#""a\"b\\c\n\x01é""#);
        assert_eq!(go_time_quote("a\"µ\n"), r#""a\"\xc2\xb5\x0a""#);
    }

    #[test]
    fn go_json_float_text() {
        assert_eq!(go_json_float(64.5), "64.5");
        assert_eq!(go_json_float(64.0), "64");
        assert_eq!(go_json_float(1e20), "100000000000000000000");
        assert_eq!(go_json_float(1e21), "1e+21");
        assert_eq!(go_json_float(1e-7), "1e-7");
        assert_eq!(go_json_float(-0.0), "-0");
    }
}

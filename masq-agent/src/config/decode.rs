//! Decoding the tree with Go's encoding/json rules, as upstream decodes its JSON, and the
//! warnings about keys it would silently skip.

use std::collections::{HashMap, HashSet};

use super::{
    go_format::{go_quote, parse_go_duration},
    node::{Format, Node},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Field {
    Cidrs,
    MasqCidrs,
    SrcCidrs,
    MasqSrcCidrs,
    MasqAddress,
    MasqAddressIpv6,
    CidrLimit,
    MasqLinkLocal,
    MasqLinkLocalIpv6,
    ResyncInterval,
    EnableIpv6,
}

impl Field {
    pub(super) const ALL: [Field; 11] = [
        Field::Cidrs,
        Field::MasqCidrs,
        Field::SrcCidrs,
        Field::MasqSrcCidrs,
        Field::MasqAddress,
        Field::MasqAddressIpv6,
        Field::CidrLimit,
        Field::MasqLinkLocal,
        Field::MasqLinkLocalIpv6,
        Field::ResyncInterval,
        Field::EnableIpv6,
    ];

    /// The key, as upstream's struct tags spell it.
    pub(super) fn name(self) -> &'static str {
        match self {
            Field::Cidrs => "nonMasqueradeCIDRs",
            Field::MasqCidrs => "masqueradeCIDRs",
            Field::SrcCidrs => "nonMasqueradeSrcCIDRs",
            Field::MasqSrcCidrs => "masqueradeSrcCIDRs",
            Field::MasqAddress => "masqueradeAddress",
            Field::MasqAddressIpv6 => "masqueradeAddressIPv6",
            Field::CidrLimit => "cidrLimit",
            Field::MasqLinkLocal => "masqLinkLocal",
            Field::MasqLinkLocalIpv6 => "masqLinkLocalIPv6",
            Field::ResyncInterval => "resyncInterval",
            Field::EnableIpv6 => "enableIPv6",
        }
    }

    /// The Go type of upstream's struct field, for error messages.
    pub(super) fn go_type(self) -> &'static str {
        match self {
            Field::Cidrs | Field::MasqCidrs | Field::SrcCidrs | Field::MasqSrcCidrs => "[]string",
            Field::MasqAddress | Field::MasqAddressIpv6 => "string",
            Field::CidrLimit => "int",
            Field::MasqLinkLocal | Field::MasqLinkLocalIpv6 | Field::EnableIpv6 => "bool",
            Field::ResyncInterval => "Duration",
        }
    }

    pub(super) fn for_key(key: &str) -> Option<Field> {
        let folded = go_fold(key);
        Field::ALL
            .into_iter()
            .find(|field| go_fold(field.name()) == folded)
    }
}

/// Go's encoding/json key folding (`unicode.ToUpper(unicode.ToLower(r))`), under which
/// `NONMASQUERADECIDRS` and even `nonMasqueradeCIDRſ` name the same field.
pub(super) fn go_fold(s: &str) -> String {
    pub(super) fn single(mut chars: impl Iterator<Item = char>) -> Option<char> {
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
pub(super) struct Problem<'a> {
    pub(super) message: String,
    pub(super) anchor: Option<&'a String>,
    /// Another place the error is about, named in the message with its line: what the value
    /// at `anchor` clashes with.
    pub(super) also: Option<(&'static str, &'a String)>,
}

impl<'a> Problem<'a> {
    pub(super) fn new(message: String, anchor: Option<&'a String>) -> Problem<'a> {
        Problem {
            message,
            anchor,
            also: None,
        }
    }
}

/// A value from the file, with the key that set it.
#[derive(Debug, Clone)]
pub(super) struct Setting<'a, T> {
    pub(super) value: T,
    pub(super) key: &'a String,
}

/// A CIDR list as written: each item's text, `None` for a `null` item.
pub(super) type CidrItems<'a> = Vec<Option<&'a String>>;

/// What the file sets; `None` keeps the default.
#[derive(Debug, Default)]
pub(super) struct FileFields<'a> {
    /// A `null` list item decodes to "" in Go; it is `None` here.
    pub(super) cidrs: Option<Setting<'a, CidrItems<'a>>>,
    pub(super) masq_cidrs: Option<Setting<'a, CidrItems<'a>>>,
    /// Sources left alone, and the exceptions to them.
    pub(super) src_cidrs: Option<Setting<'a, CidrItems<'a>>>,
    pub(super) masq_src_cidrs: Option<Setting<'a, CidrItems<'a>>>,
    /// The addresses masqueraded traffic takes instead of the device's, as written.
    pub(super) masq_address: Option<Setting<'a, &'a String>>,
    pub(super) masq_address_ipv6: Option<Setting<'a, &'a String>>,
    pub(super) cidr_limit: Option<Setting<'a, i64>>,
    pub(super) masq_link_local: Option<bool>,
    pub(super) masq_link_local_ipv6: Option<bool>,
    pub(super) enable_ipv6: Option<bool>,
    /// Nanoseconds.
    pub(super) resync_interval: Option<Setting<'a, i128>>,
}

/// How decoding one value went wrong. Go's decoder notes a type mismatch and carries on (the
/// first one is reported), but stops at once when a custom decoder (Duration) fails.
pub(super) enum DecodeError<'a> {
    Type(Problem<'a>),
    Fatal(Problem<'a>),
}

pub(super) fn decode<'a>(
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
pub(super) fn effective_entries(
    entries: &[(String, Node)],
    format: Format,
) -> Vec<&(String, Node)> {
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
    /// What the file sets of `list`.
    pub(super) fn list(&self, list: CidrList) -> &Option<Setting<'a, CidrItems<'a>>> {
        match list {
            CidrList::NonMasquerade => &self.cidrs,
            CidrList::Masquerade => &self.masq_cidrs,
            CidrList::NonMasqueradeSrc => &self.src_cidrs,
            CidrList::MasqueradeSrc => &self.masq_src_cidrs,
        }
    }

    /// The setting of an address key (`masqueradeAddress`, `masqueradeAddressIPv6`); `None`
    /// for any other field.
    pub(super) fn address(&self, field: Field) -> Option<&Setting<'a, &'a String>> {
        match field {
            Field::MasqAddress => self.masq_address.as_ref(),
            Field::MasqAddressIpv6 => self.masq_address_ipv6.as_ref(),
            _ => None,
        }
    }

    pub(super) fn set(
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
            Field::Cidrs | Field::MasqCidrs | Field::SrcCidrs | Field::MasqSrcCidrs => {
                if let Some(list) = decode_cidr_list(field, key, value)? {
                    let slot = match field {
                        Field::Cidrs => &mut self.cidrs,
                        Field::MasqCidrs => &mut self.masq_cidrs,
                        Field::SrcCidrs => &mut self.src_cidrs,
                        _ => &mut self.masq_src_cidrs,
                    };
                    *slot = Some(Setting { value: list, key });
                }
            }
            Field::MasqAddress | Field::MasqAddressIpv6 => {
                let slot = match field {
                    Field::MasqAddress => &mut self.masq_address,
                    _ => &mut self.masq_address_ipv6,
                };
                match value {
                    Node::Null => {}
                    Node::Str(text) => *slot = Some(Setting { value: text, key }),
                    other => return Err(type_error(other.go_kind().to_owned())),
                }
            }
            Field::CidrLimit => {
                if let Some(limit) = decode_int(value, format).map_err(type_error)? {
                    self.cidr_limit = Some(Setting { value: limit, key });
                }
            }
            Field::MasqLinkLocal | Field::MasqLinkLocalIpv6 | Field::EnableIpv6 => {
                let slot = match field {
                    Field::MasqLinkLocal => &mut self.masq_link_local,
                    Field::MasqLinkLocalIpv6 => &mut self.masq_link_local_ipv6,
                    _ => &mut self.enable_ipv6,
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
pub(super) fn decode_cidr_list<'a>(
    field: Field,
    key: &'a String,
    value: &'a Node,
) -> Result<Option<CidrItems<'a>>, DecodeError<'a>> {
    let type_error = |what: &str, go_type: &str| {
        DecodeError::Type(Problem::new(
            format!(
                "json: cannot unmarshal {what} into Go struct field MasqConfig.{} of type {go_type}",
                field.name()
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
pub(super) fn decode_int(value: &Node, format: Format) -> Result<Option<i64>, String> {
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

pub(super) fn whole_i64(f: f64) -> Option<i64> {
    pub(super) const TWO_POW_63: f64 = 9_223_372_036_854_775_808.0;
    (f.is_finite() && f.fract() == 0.0 && (-TWO_POW_63..TWO_POW_63).contains(&f))
        .then_some(f as i64)
}

/// Upstream's Duration decoder: a string in time.ParseDuration syntax, and nothing else.
pub(super) fn decode_duration(value: &Node, format: Format) -> Result<i128, String> {
    match value {
        Node::Str(s) => parse_go_duration(s),
        other => Err(format!(
            "expected string value for unmarshal to field of type Duration, got {}",
            go_quote(&json_text(other, format))
        )),
    }
}

/// Compact JSON for a value, as upstream's Duration decoder quotes it.
pub(super) fn json_text(node: &Node, format: Format) -> String {
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
pub(super) fn float_text(f: f64, format: Format) -> String {
    match format {
        Format::Yaml => go_json_float(f),
        Format::Json => format!("{f:?}"),
    }
}

/// Go's encoding/json float64 format: plain decimals between 1e-6 and 1e21, else `1e+21`.
pub(super) fn go_json_float(f: f64) -> String {
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
pub(super) const SUGGESTION_THRESHOLD: f64 = 0.7;

pub(super) fn warn_about_keys(
    entries: &[(String, Node)],
    origin: &str,
    warnings: &mut Vec<String>,
) {
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
pub(super) fn suggest_key(key: &str) -> Option<&'static str> {
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

    pub(super) fn field(self) -> Field {
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

#[cfg(test)]
mod tests {
    use super::*;

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

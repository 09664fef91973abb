//! The small tree a config file is read into, whichever reader reads it, and how its scalars
//! read under YAML 1.1 (go-yaml v2), as upstream's YAML-to-JSON step makes them.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Format {
    Json,
    Yaml,
}

/// A parsed YAML or JSON value. Unlike serde_json's and serde_yaml's own values, a mapping
/// keeps its keys in file order and keeps repeated keys, as Go's decoder sees them.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Node {
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
    pub(super) fn go_kind(&self) -> &'static str {
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

pub(super) struct NodeVisitor;

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
pub(super) fn key_string(key: Node) -> Result<String, String> {
    match key {
        Node::Str(s) => Ok(s),
        Node::Bool(b) => Ok(b.to_string()),
        Node::Int(n) => Ok(n.to_string()),
        Node::Float(f) => Ok(f.to_string()),
        other => Err(format!("unsupported map key of type {}", other.go_kind())),
    }
}

// ---------------------------------------------------------------------------------------------
// YAML 1.1 scalars, as go-yaml v2 reads them

/// Plain scalars that YAML 1.1 (upstream) reads as booleans but YAML 1.2 (serde_yaml) reads as
/// strings. `true`/`false` and their capitalised forms are booleans to both.
pub(super) const YAML11_TRUE: [&str; 8] = ["y", "Y", "yes", "Yes", "YES", "on", "On", "ON"];
pub(super) const YAML11_FALSE: [&str; 8] = ["n", "N", "no", "No", "NO", "off", "Off", "OFF"];

/// What a plain scalar is under YAML 1.1: a boolean, an integer, a float, or (`None`) a string.
pub(super) fn yaml11_scalar(s: &str) -> Option<Node> {
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
pub(super) fn go_parse_int_base0(s: &str) -> Option<i128> {
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
pub(super) fn is_yaml11_float(s: &str) -> bool {
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

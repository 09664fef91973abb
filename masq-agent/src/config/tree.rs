//! Reading the file into its tree (`node`): JSON, the fast reader for plain lists
//! (`plain_yaml`), or the full YAML parser with the YAML 1.1 rules (go-yaml v2) that serde_yaml
//! (YAML 1.2) lacks applied to each plain scalar.

use serde::Deserialize as _;
use yaml_rust2::parser::{Event, Parser};
use yaml_rust2::scanner::{Marker, TScalarStyle};

use super::{
    model::ConfigError,
    node::{Format, Node, yaml11_scalar},
    plain_yaml,
};

/// Like upstream (k8s.io/apimachinery's yaml.ToJSON), a file is JSON if it starts with `{`.
pub(super) fn looks_like_json(text: &[u8]) -> bool {
    String::from_utf8_lossy(text).trim_start().starts_with('{')
}

pub(super) fn read_tree(
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
    let mut root = match plain_yaml::read(text) {
        Some(root) => root,
        None => read_yaml11(text, origin, warnings)?,
    };
    if let Node::Map(entries) = &mut root {
        apply_merge_keys(entries).map_err(|m| ConfigError::new(origin, None, m))?;
    }
    reject_non_finite(&root).map_err(|m| ConfigError::new(origin, None, m))?;
    Ok((root, Format::Yaml))
}

/// The first YAML document by the full parser, its scalars as YAML 1.1 reads them (go-yaml v2).
pub(super) fn read_yaml11(
    text: &[u8],
    origin: &str,
    warnings: &mut Vec<String>,
) -> Result<Node, ConfigError> {
    if flow_nesting_exceeds(text, MAX_FLOW_NESTING) {
        let message = format!("invalid YAML: nested more than {MAX_FLOW_NESTING} levels deep");
        return Err(ConfigError::new(origin, None, message));
    }
    let mut root = read_yaml(text, origin, warnings)?;
    let scalars = scalar_count(&root);
    let plain = match only_plain_scalars(text) {
        // No second parse: it is half the time a 100 000-entry file takes to read.
        true => None,
        false => plain_scalars(text, scalars).filter(|plain| plain.len() == scalars),
    };
    match plain {
        Some(plain) => resolve_yaml11_scalars(&mut root, &mut plain.into_iter()),
        // Every scalar is plain; or the event parser disagrees with libyaml about this text,
        // and reading every scalar as plain is right for all but quoted look-alikes of
        // booleans and numbers.
        None => resolve_yaml11_scalars(&mut root, &mut std::iter::repeat(true)),
    }
    Ok(root)
}

pub(super) fn json_syntax_error(e: &serde_json::Error, origin: &str) -> ConfigError {
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
pub(super) const MAX_FLOW_NESTING: usize = 1000;

/// Whether `[`/`{` nest deeper than `limit`. Brackets in quotes and comments count too: telling
/// those apart is the parser's job, and a real config has nowhere near a thousand of them.
pub(super) fn flow_nesting_exceeds(text: &[u8], limit: usize) -> bool {
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
pub(super) fn read_yaml(
    text: &[u8],
    origin: &str,
    warnings: &mut Vec<String>,
) -> Result<Node, ConfigError> {
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

pub(super) fn yaml_syntax_error(e: &serde_yaml::Error, origin: &str) -> ConfigError {
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

/// Gives plain scalars the type go-yaml v2 would have given them; quoted and block scalars
/// stay strings, as go-yaml resolves only plain ones. `plain` says, for each scalar of the tree
/// in document order (keys included), whether it was written plain.
pub(super) fn resolve_yaml11_scalars(node: &mut Node, plain: &mut impl Iterator<Item = bool>) {
    match node {
        Node::Seq(items) => items
            .iter_mut()
            .for_each(|item| resolve_yaml11_scalars(item, plain)),
        Node::Map(entries) => {
            for (_, value) in entries.iter_mut() {
                // Keys stay strings whatever their style.
                plain.next();
                resolve_yaml11_scalars(value, plain);
            }
        }
        Node::Str(s) => {
            if plain.next() == Some(true)
                && let Some(resolved) = yaml11_scalar(s)
            {
                *node = resolved;
            }
        }
        _ => {
            plain.next();
        }
    }
}

/// How many scalars (keys included) the tree holds: one per scalar event serde_yaml read.
pub(super) fn scalar_count(node: &Node) -> usize {
    match node {
        Node::Seq(items) => items.iter().map(scalar_count).sum(),
        Node::Map(entries) => entries.iter().map(|(_, v)| 1 + scalar_count(v)).sum(),
        _ => 1,
    }
}

/// The events of the first YAML document, as yaml-rust2 reads them (serde_yaml tells neither a
/// scalar's style nor its position); `None` when the text is not UTF-8 or the parser fails.
pub(super) fn first_document_events(text: &[u8]) -> Option<Vec<(Event, Marker)>> {
    let mut parser = Parser::new_from_str(std::str::from_utf8(text).ok()?);
    let mut events = Vec::new();
    loop {
        let (event, marker) = parser.next_token().ok()?;
        if matches!(event, Event::DocumentEnd | Event::StreamEnd) {
            return Some(events);
        }
        events.push((event, marker));
    }
}

/// Whether every scalar of `text` is plain and untagged, as it is when nothing in it could open
/// a quoted scalar (`'`, `"`), a block scalar (`|`, `>`) or a tag (`!`): anywhere, comments
/// included, so that a text that has one takes the event parser's word for each scalar.
pub(super) fn only_plain_scalars(text: &[u8]) -> bool {
    !text
        .iter()
        .any(|b| matches!(b, b'\'' | b'"' | b'|' | b'>' | b'!'))
}

/// Whether each scalar of the first document was written plain and untagged, in the order
/// serde_yaml hands scalars to `NodeVisitor`: document order, keys included, aliases expanded.
/// `None` when the events cannot be read or the expansion passes `limit` (serde_yaml, which has
/// read the text already, bounds what aliases may expand to).
pub(super) fn plain_scalars(text: &[u8], limit: usize) -> Option<Vec<bool>> {
    let mut plain = Vec::new();
    // Where each anchored node's scalars lie in `plain`, for its aliases to repeat.
    let mut anchored = std::collections::HashMap::new();
    // Collections still open: their anchor and where their scalars begin.
    let mut open = Vec::new();
    for (event, _) in first_document_events(text)? {
        match event {
            Event::Scalar(_, style, anchor, tag) => {
                if anchor != 0 {
                    anchored.insert(anchor, plain.len()..plain.len() + 1);
                }
                plain.push(style == TScalarStyle::Plain && tag.is_none());
            }
            Event::SequenceStart(anchor, _) | Event::MappingStart(anchor, _) => {
                open.push((anchor, plain.len()));
            }
            Event::SequenceEnd | Event::MappingEnd => {
                let (anchor, start) = open.pop()?;
                if anchor != 0 {
                    anchored.insert(anchor, start..plain.len());
                }
            }
            Event::Alias(anchor) => {
                let range = anchored.get(&anchor)?.clone();
                if plain.len() + range.len() > limit {
                    return None;
                }
                plain.extend_from_within(range);
            }
            _ => {}
        }
        if plain.len() > limit {
            return None;
        }
    }
    Some(plain)
}

/// Applies `<<` merge keys at the top level the way go-yaml v2 does: the merged entries take
/// the place of the `<<` key, so later keys override them and they override earlier ones.
pub(super) fn apply_merge_keys(entries: &mut Vec<(String, Node)>) -> Result<(), String> {
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

pub(super) const MERGE_ERROR: &str = "map merge requires map or sequence of maps as the value";

/// Upstream's YAML-to-JSON step fails on `.inf` and `.nan`, anywhere in the file.
pub(super) fn reject_non_finite(node: &Node) -> Result<(), String> {
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

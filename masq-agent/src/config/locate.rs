//! Finding the line of the file an error is about, where it can be found for sure.

use yaml_rust2::parser::Event;

use super::{
    node::{Format, Node},
    tree::first_document_events,
};

/// The line of `target` (a key or string value inside `root`), or `None` when the text does not
/// show it unambiguously. The text must hold `target` exactly as often as the tree does; then
/// the n-th occurrence in the tree is the n-th in the text.
pub(super) fn locate(text: &[u8], root: &Node, format: Format, target: &String) -> Option<usize> {
    let text = std::str::from_utf8(text).ok()?;
    // Line breaks to YAML's parser, but not to ours.
    if text.contains(['\u{85}', '\u{2028}', '\u{2029}']) {
        return None;
    }
    let mut in_tree = Vec::new();
    collect_equal_strings(root, target, &mut in_tree);
    let nth = in_tree.iter().position(|s| std::ptr::eq(*s, target))?;
    let in_text = match format {
        Format::Yaml => scalar_lines(text, target)?,
        Format::Json => token_lines(text, target),
    };
    if in_text.len() != in_tree.len() {
        return None;
    }
    in_text.get(nth).copied()
}

pub(super) fn collect_equal_strings<'a>(node: &'a Node, target: &str, found: &mut Vec<&'a String>) {
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

/// 1-based lines of each YAML scalar (key or value) whose value is `target`, as the event
/// parser reads them: quoting, escapes, block scalars and comments need no guessing. `None` when
/// the parser does not read the text.
pub(super) fn scalar_lines(text: &str, target: &str) -> Option<Vec<usize>> {
    let events = first_document_events(text.as_bytes())?;
    let lines = events
        .into_iter()
        .filter_map(|(event, marker)| match event {
            Event::Scalar(value, ..) if value == target => Some(marker.line()),
            _ => None,
        });
    Some(lines.collect())
}

/// 1-based line numbers of each place `token` stands on its own in JSON text (not inside a
/// longer string).
pub(super) fn token_lines(text: &str, token: &str) -> Vec<usize> {
    if token.is_empty() {
        return Vec::new();
    }
    let is_before = |c: char| c.is_whitespace() || matches!(c, '"' | ',' | '[' | '{');
    let is_after = |c: char| c.is_whitespace() || matches!(c, '"' | ',' | ']' | '}' | ':');
    let text = text.replace("\r\n", "\n").replace('\r', "\n");
    let mut lines = Vec::new();
    for (index, line) in text.split('\n').enumerate() {
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

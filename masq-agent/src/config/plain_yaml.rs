//! A fast reading of the one shape large config files have: a top-level block mapping whose
//! values are plain scalars or block sequences of plain scalars, such as 100 000 lines of
//! `  - 10.1.2.0/24`. libyaml takes about a microsecond a line; this takes a few nanoseconds.
//! Whatever is not plainly of that shape (quotes, flow collections, anchors, tags, documents,
//! tabs, multi-line scalars, comments after a value, non-ASCII text...) is left to the full
//! parser: `None` means "not sure", never "invalid". Where it answers, its tree is the one the
//! full parser and the YAML 1.1 rules make of the same text, which the tests hold it to.
use super::node::{Node, key_string, yaml11_scalar};

/// More scalars than this that need resolving (see [`resolve_plain`]) and the full parser is
/// the faster one.
const MAX_RESOLVED_SCALARS: usize = 64;

/// The tree of `text`, when it has the simple shape; `None` otherwise.
pub(super) fn read(text: &[u8]) -> Option<Node> {
    if !text
        .iter()
        .all(|&b| b == b'\n' || (b' '..=b'~').contains(&b))
    {
        return None;
    }
    // Only printable ASCII and newlines, checked above.
    let text = std::str::from_utf8(text).ok()?;
    let mut resolver = Resolver {
        left: MAX_RESOLVED_SCALARS,
    };
    let mut entries: Vec<(String, Node)> = Vec::new();
    // The sequence being read, and its items' indentation once its first item set it.
    let mut sequence: Option<(Vec<Node>, Option<usize>)> = None;
    for line in text.lines() {
        let content = line.trim_start_matches(' ');
        if content.is_empty() || content.starts_with('#') {
            continue;
        }
        let indent = line.len() - content.len();
        if let Some(item) = content.strip_prefix('-')
            && let Some((items, item_indent)) = &mut sequence
        {
            if *item_indent.get_or_insert(indent) != indent || !item.starts_with(' ') {
                return None;
            }
            items.push(resolver.scalar(plain_scalar(item)?)?);
            continue;
        }
        // Anything else that is not a new top-level key (a continuation line, a nested
        // mapping) is beyond this reader.
        if indent != 0 {
            return None;
        }
        if let Some((items, Some(_))) = sequence.take() {
            entries.last_mut()?.1 = Node::Seq(items);
        }
        let (key, value) = content.split_once(':')?;
        if !key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            return None;
        }
        let key = key_string(resolver.yaml12(key)?).ok()?;
        if value.trim_end_matches(' ').is_empty() {
            // A null, unless sequence items follow.
            sequence = Some((Vec::new(), None));
            entries.push((key, Node::Null));
        } else if value.starts_with(' ') {
            entries.push((key, resolver.scalar(plain_scalar(value)?)?));
        } else {
            return None;
        }
    }
    if let Some((items, Some(_))) = sequence {
        entries.last_mut()?.1 = Node::Seq(items);
    }
    // A file of comments only is a null document, which the full reader handles.
    (!entries.is_empty()).then_some(Node::Map(entries))
}

/// The plain scalar that `rest` (what follows `- ` or `key: `) holds, when it is one of a few
/// characters that can mean nothing else: no quotes, indicators, spaces within, or comments;
/// not starting like a document marker, nor ending with `:` (which would make it a key).
fn plain_scalar(rest: &str) -> Option<&str> {
    let scalar = rest.trim_matches(' ');
    let mut bytes = scalar.bytes();
    let first = bytes.next()?;
    let second = bytes.next();
    // An indicator may start a plain scalar when what follows cannot make it one: `-1`, `.5`,
    // `+.5`, `::1/128`; not `- `, `...` or `:x`.
    let starts_well = first.is_ascii_alphanumeric()
        || second.is_some_and(|second| match first {
            b'.' => second.is_ascii_alphanumeric(),
            b'+' | b'-' => second.is_ascii_alphanumeric() || second == b'.',
            b':' => second == b':',
            _ => false,
        });
    let allowed =
        |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'/' | b':' | b'_' | b'+' | b'-');
    (starts_well && scalar.bytes().all(allowed) && !scalar.ends_with(':')).then_some(scalar)
}

/// What plain scalars mean, as the full reader gives them meaning.
struct Resolver {
    /// How many more scalars may need serde_yaml's resolution.
    left: usize,
}

impl Resolver {
    /// The node a plain, untagged value is: serde_yaml's (YAML 1.2) reading, then go-yaml v2's
    /// (YAML 1.1), as [`resolve_yaml11_scalars`] gives it. A scalar with a `/` (every CIDR) is
    /// a string to both: no null, boolean or number has one.
    fn scalar(&mut self, scalar: &str) -> Option<Node> {
        if scalar.contains('/') {
            return Some(Node::Str(scalar.to_owned()));
        }
        match self.yaml12(scalar)? {
            Node::Str(s) => Some(yaml11_scalar(&s).unwrap_or(Node::Str(s))),
            scalar => Some(scalar),
        }
    }

    /// serde_yaml's reading alone, which is all a key gets.
    fn yaml12(&mut self, scalar: &str) -> Option<Node> {
        self.left = self.left.checked_sub(1)?;
        match serde_yaml::from_str::<Node>(scalar).ok()? {
            Node::Seq(_) | Node::Map(_) => None,
            scalar => Some(scalar),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::config::tree::read_yaml11;

    /// The full reader's tree, as `read_tree` made it before this reader.
    fn full(text: &str) -> Option<Node> {
        let mut warnings = Vec::new();
        let tree = read_yaml11(text.as_bytes(), "", &mut warnings).ok()?;
        warnings.is_empty().then_some(tree)
    }

    /// Node's own equality says NaN differs from itself.
    fn same(a: &Node, b: &Node) -> bool {
        format!("{a:?}") == format!("{b:?}")
    }

    #[test]
    fn the_shapes_of_real_files_are_read_as_the_full_reader_reads_them() {
        let texts = [
            "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - fd00::/8\ncidrLimit: 80\n",
            "# comment\nresyncInterval: 60s\nmasqLinkLocal: yes\nnonMasqueradeCIDRs:\n- 10.0.0.0/8\n",
            "cidrLimit: 0x10\nmasqLinkLocalIPv6: off\nenableIPv6: True\nnonMasqueradeCIDRs:\n",
            "nonMasqueradeCIDRs:\n    # a comment\n    - 10.0.0.0/8   \n\n    - 1.2.3.4/32",
            "cidrLimit: 010\nresyncInterval: 1_000\nx: .inf\ny: -1e3\nz: Null\nw: null\n",
            "nonMasqueradeCIDRs: 10.0.0.0/8\nmasqueradeCIDRs:\ncidrLimit: +.5\n",
            "a: b:c\nnonMasqueradeCIDRs:\n  - ::ffff:10.0.0.0/104\n  - y\n  - 123\n",
            "true: 1\n123: x\nnonMasqueradeCIDRs: []\n",
        ];
        for text in texts {
            let fast = read(text.as_bytes());
            match (fast, full(text)) {
                (Some(fast), Some(full)) => assert!(same(&fast, &full), "{text:?}"),
                (None, _) => assert!(text.contains('['), "not read: {text:?}"),
                (Some(fast), None) => {
                    panic!("{text:?}: read as {fast:?}, rejected by the full reader")
                }
            }
        }
    }

    #[test]
    fn what_it_is_unsure_of_is_left_to_the_full_reader() {
        let texts = [
            "a: 'quoted'\n",
            "a: [1]\n",
            "a:\n  b: c\n",
            "a: b\n  c\n",
            "a:\n  - b\n  c\n",
            "a:\n  - b\n   - c\n",
            "a: b # comment\n",
            "a:\tb\n",
            "a: b\r\n",
            "---\na: b\n",
            "a: &x b\n",
            "a:\n  - b:\n",
            "a:\n  - - b\n",
            "a:\n  -\n",
            "a:b\n",
            "a: b\n---\nc: d\n",
            "# only a comment\n",
            "a: ...\n",
            "a: -\n",
            "null: x\n",
            "\u{e9}: b\n",
        ];
        for text in texts {
            assert_eq!(read(text.as_bytes()), None, "{text:?}");
        }
    }

    #[test]
    fn many_scalars_to_resolve_are_left_to_the_full_reader() {
        let mut text = "nonMasqueradeCIDRs:\n".to_owned();
        for n in 0..=MAX_RESOLVED_SCALARS {
            text.push_str(&format!("  - {n}\n"));
        }
        assert_eq!(read(text.as_bytes()), None);
    }

    fn line() -> impl Strategy<Value = String> {
        let scalar = prop::sample::select(vec![
            "10.0.0.0/8",
            "fd00::/8",
            "::1/128",
            "yes",
            "Off",
            "y",
            "0x1F",
            "0o17",
            "0b11",
            "010",
            "1_000",
            "60s",
            "1h30m",
            ".inf",
            "-.inf",
            ".nan",
            "-1",
            "+1",
            "1e3",
            "1.5",
            "+.5",
            "~",
            "null",
            "Null",
            "true",
            "FALSE",
            "a:b",
            "a/b",
            "x",
            "-x",
            "-.5",
            ".x",
            "1:20",
            "9223372036854775808",
            "18446744073709551616",
            "0.",
            "1e",
            "_1",
            "198.51.100.7",
            "2001:db8::7",
        ]);
        let key = prop::sample::select(vec![
            "nonMasqueradeCIDRs",
            "masqueradeCIDRs",
            "nonMasqueradeSrcCIDRs",
            "masqueradeSrcCIDRs",
            "masqueradeAddress",
            "masqueradeAddressIPv6",
            "cidrLimit",
            "masqLinkLocal",
            "a",
            "true",
            "null",
            "123",
            "0x10",
            "y",
            "on",
            "1e3",
            "_",
            "a_b",
        ]);
        let indent = prop::sample::select(vec!["", " ", "  ", "    "]);
        let spaces = prop::sample::select(vec!["", " ", "  "]);
        (0..6usize, key, scalar, indent, spaces).prop_map(|(shape, key, scalar, indent, spaces)| {
            match shape {
                0 => format!("{key}:{spaces}"),
                1 => format!("{key}: {scalar}{spaces}"),
                2 => format!("{indent}- {scalar}{spaces}"),
                3 => format!("{indent}# {scalar}"),
                4 => spaces.to_owned(),
                _ => format!("{indent}{scalar}"),
            }
        })
    }

    proptest! {
        #[test]
        fn whatever_it_reads_the_full_reader_reads_alike(
            lines in prop::collection::vec(line(), 1..12),
            newline_at_end in any::<bool>(),
        ) {
            let mut text = lines.join("\n");
            if newline_at_end {
                text.push('\n');
            }
            if let Some(fast) = read(text.as_bytes()) {
                let full = full(&text);
                prop_assert!(
                    full.as_ref().is_some_and(|full| same(&fast, full)),
                    "{text:?}: {fast:?} against {full:?}"
                );
            }
        }
    }
}

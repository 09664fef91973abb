//! Reading the operator docs: the commands in their code blocks with the sample output shown
//! under each, the rows of their tables, and the comparison of sample output with real output.

use std::path::{Path, PathBuf};

/// The files whose commands are exercised: the README and every page under docs/.
pub fn doc_files(root: &Path) -> Vec<PathBuf> {
    let mut files = vec![
        root.join("README.md"),
        root.join("deploy/helm/masq-agent/README.md"),
    ];
    let mut pages: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .flatten()
        .map(|entry| entry.path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    pages.sort();
    files.extend(pages);
    files
}

/// A command shown in the docs, as an operator would type it.
#[derive(Debug, Clone)]
pub struct DocCommand {
    /// `file:line`, for messages.
    pub place: String,
    pub text: String,
    /// The lines shown under the command in a ```console block.
    pub sample: Vec<String>,
}

/// Blocks whose every line is a command, without output.
const SCRIPT_LANGUAGES: [&str; 3] = ["sh", "bash", "shell"];

/// Every command in the fenced code blocks of `text`: the `$ ` lines of ```console blocks, and
/// every line of ```sh blocks. A `$ ` line in any other block is an error, so that a command
/// cannot hide from the test in a block it does not read.
pub fn commands(file: &str, text: &str) -> Result<Vec<DocCommand>, String> {
    let mut found: Vec<DocCommand> = Vec::new();
    let mut fence: Option<&str> = None;
    // A block indented under a list item: its lines lose the fence's indentation.
    let mut indent = 0;
    // Whether the open console block has shown a command yet: output lines belong to it.
    let mut block_has_command = false;
    let mut lines = text.lines().enumerate();
    while let Some((index, line)) = lines.next() {
        let place = format!("{file}:{}", index + 1);
        let Some(language) = fence else {
            fence = line.trim_start().strip_prefix("```").map(str::trim);
            indent = line.len() - line.trim_start_matches(' ').len();
            block_has_command = false;
            continue;
        };
        let unindented = line.len() - line.trim_start_matches(' ').len();
        let line = &line[unindented.min(indent)..];
        if line.trim_start().starts_with("```") {
            fence = None;
            continue;
        }
        let prompted = line.strip_prefix("$ ");
        let command = match language {
            "console" => match prompted {
                Some(command) => command,
                None if block_has_command => {
                    if let Some(last) = found.last_mut() {
                        last.sample.push(line.to_string());
                    }
                    continue;
                }
                None if line.trim().is_empty() => continue,
                None => return Err(format!("{place}: output before any `$ ` command")),
            },
            language if SCRIPT_LANGUAGES.contains(&language) => match prompted {
                None => line,
                Some(_) => {
                    return Err(format!(
                        "{place}: a `$ ` prompt in a ```{language} block; use ```console"
                    ));
                }
            },
            language => match prompted {
                None => continue,
                Some(_) => {
                    return Err(format!(
                        "{place}: a command in a ```{language} block; commands go in ```console blocks"
                    ));
                }
            },
        };
        let mut command = command.to_string();
        // A trailing backslash continues the command on the next line.
        while let Some(head) = command.strip_suffix('\\') {
            let (_, next) = lines
                .next()
                .ok_or_else(|| format!("{place}: the command ends in a backslash"))?;
            command = format!("{} {}", head.trim_end(), next.trim());
        }
        if command.trim().is_empty() || command.trim_start().starts_with('#') {
            continue;
        }
        block_has_command = true;
        found.push(DocCommand {
            place,
            text: command,
            sample: Vec::new(),
        });
    }
    match fence {
        Some(language) => Err(format!("{file}: a ```{language} block is never closed")),
        None => Ok(found),
    }
}

/// Splits a command line into words the way a POSIX shell does for simple commands: quotes,
/// backslash escapes and `#` comments. Pipes, redirections, substitutions and variables are
/// refused: each command must stand alone so that it can be run as written.
pub fn words(line: &str) -> Result<Vec<String>, String> {
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => words.extend(word.take()),
            '#' if word.is_none() => break,
            '\'' => {
                let text = word.get_or_insert_default();
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => text.push(c),
                        None => return Err(format!("unclosed quote in {line:?}")),
                    }
                }
            }
            '"' => {
                let text = word.get_or_insert_default();
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => text.extend(chars.next()),
                        Some('$' | '`') => return Err(format!("substitution in {line:?}")),
                        Some(c) => text.push(c),
                        None => return Err(format!("unclosed quote in {line:?}")),
                    }
                }
            }
            '\\' => word.get_or_insert_default().extend(chars.next()),
            '|' | '>' | '<' | ';' | '&' | '$' | '`' | '(' | ')' => {
                return Err(format!(
                    "{line:?} uses {c:?}: pipes, redirections, lists, substitutions and \
                     variables are not exercised; show each command alone"
                ));
            }
            c => word.get_or_insert_default().push(c),
        }
    }
    words.extend(word);
    Ok(words)
}

/// The cells of every table row in `text` (header and separator rows included), trimmed, with
/// `\|` read as a `|` inside a cell.
pub fn table_rows(text: &str) -> Vec<Vec<String>> {
    text.lines()
        .filter_map(|line| line.trim().strip_prefix('|')?.strip_suffix('|'))
        .map(|row| {
            let mut cells = vec![String::new()];
            let mut chars = row.chars().peekable();
            while let Some(c) = chars.next() {
                let cell = cells.last_mut().expect("a row has a cell");
                match c {
                    '\\' if chars.next_if_eq(&'|').is_some() => cell.push('|'),
                    '|' => cells.push(String::new()),
                    c => cell.push(c),
                }
            }
            cells.iter().map(|cell| cell.trim().to_string()).collect()
        })
        .collect()
}

/// A cell that is one code span, without its backticks.
pub fn code_span(cell: &str) -> Option<&str> {
    cell.strip_prefix('`')?
        .strip_suffix('`')
        .filter(|inner| !inner.contains('`'))
}

/// A line as the comparison sees it: every number (a run of hex digits holding a decimal digit,
/// so ids, counters, addresses, tags and times) reads `N`, and blanks are collapsed. What is
/// left is the part of a sample that must not drift.
pub fn shape(line: &str) -> String {
    let mut out = String::new();
    let mut run = String::new();
    let flush = |run: &mut String, out: &mut String| {
        if run.chars().any(|c| c.is_ascii_digit()) {
            out.push('N');
        } else {
            out.push_str(run);
        }
        run.clear();
    };
    for c in line
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .chars()
    {
        if c.is_ascii_hexdigit() {
            run.push(c);
        } else {
            flush(&mut run, &mut out);
            out.push(c);
        }
    }
    flush(&mut run, &mut out);
    out
}

/// The first sample line that the output does not show, in order; `None` when it shows them
/// all. Blank lines and `...` in a sample stand for whatever the sample leaves out.
pub fn first_unmatched<'a>(sample: &'a [String], output: &str) -> Option<&'a str> {
    let mut actual = output.lines().map(shape);
    sample
        .iter()
        .filter(|line| !line.trim().is_empty() && line.trim() != "...")
        .find(|line| {
            let wanted = shape(line);
            !actual.any(|got| got == wanted)
        })
        .map(String::as_str)
}

/// The first output line that a complete sample (one without `...`) does not show; `None` when
/// the sample shows them all, or leaves some out on purpose.
pub fn first_unshown<'a>(sample: &[String], output: &'a str) -> Option<&'a str> {
    if sample.iter().any(|line| line.trim() == "...") {
        return None;
    }
    let shown: Vec<String> = sample.iter().map(|line| shape(line)).collect();
    output
        .lines()
        .filter(|line| !line.trim().is_empty())
        .find(|line| !shown.contains(&shape(line)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_complete_sample_shows_every_line_and_one_with_an_ellipsis_need_not() {
        let sample: Vec<String> = ["a 1", "c 3"].map(String::from).to_vec();
        assert_eq!(first_unshown(&sample, "a 10\nc 30\n"), None);
        assert_eq!(first_unshown(&sample, "a 10\nb 2\nc 30\n"), Some("b 2"));
        let elided: Vec<String> = ["a 1", "...", "c 3"].map(String::from).to_vec();
        assert_eq!(first_unshown(&elided, "a 10\nb 2\nc 30\n"), None);
    }

    #[test]
    fn console_blocks_give_commands_with_their_output() {
        let text = "intro\n```console\n$ bpftool net show dev eth0\ntc:\n\n$ masq-agent \\\n  status\n```\n\
                    1. a step\n   ```console\n   $ ip route\n     default\n   ```\n\
                    ```sh\ncargo xtask demo   # the demo\n\n```\n```text\nnot a command\n```\n";
        let found = commands("x.md", text).unwrap();
        let texts: Vec<&str> = found.iter().map(|c| c.text.as_str()).collect();
        assert_eq!(
            texts,
            [
                "bpftool net show dev eth0",
                "masq-agent status",
                "ip route",
                "cargo xtask demo   # the demo"
            ]
        );
        assert_eq!(found[2].sample, ["  default"]);
        assert_eq!(found[0].sample, ["tc:", ""]);
        assert_eq!(found[0].place, "x.md:3");
        assert!(found[3].sample.is_empty());
    }

    #[test]
    fn commands_outside_console_and_sh_blocks_are_refused() {
        let err = commands("x.md", "```text\n$ bpftool map show\n```\n").unwrap_err();
        assert!(err.contains("x.md:2"), "{err}");
        assert!(commands("x.md", "```console\n$ ip route\n").is_err());
    }

    #[test]
    fn words_follow_the_shell() {
        assert_eq!(
            words(r#"kubectl exec -- masq-agent "a b" 'c d' e\ f  # comment"#).unwrap(),
            ["kubectl", "exec", "--", "masq-agent", "a b", "c d", "e f"]
        );
        for refused in [
            "curl -s http://x | grep y",
            "a > b",
            "echo $HOME",
            "a; b",
            "echo \"$(id)\"",
            "echo 'open",
        ] {
            assert!(words(refused).is_err(), "{refused}");
        }
    }

    #[test]
    fn samples_match_on_shape_in_order() {
        assert_eq!(
            shape("eth0(2)  tcx/egress masq_egress prog_id 31 link_id 7"),
            "ethN(N) tcx/egress masq_egress prog_id N link_id N"
        );
        assert_eq!(shape("tag 5f3ad6e3a2b1c0d9 gpl"), "tag N gpl");
        let sample: Vec<String> = ["a 1", "...", "c 3"].map(String::from).to_vec();
        assert_eq!(first_unmatched(&sample, "a 10\nb 2\nc 30\n"), None);
        assert_eq!(first_unmatched(&sample, "c 3\na 1\n"), Some("c 3"));
        assert_eq!(first_unmatched(&sample, "a 1\nc three\n"), Some("c 3"));
    }

    #[test]
    fn table_cells_and_code_spans() {
        let rows = table_rows("| a | `b: [1]` |\n|---|---|\nnot a row\n| `x\\|y` | z |\n");
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[2], ["`x|y`", "z"]);
        assert_eq!(code_span(&rows[0][1]), Some("b: [1]"));
        assert_eq!(code_span("plain"), None);
    }
}

//! docs/architecture.md's "Where the code lives" is the one description of the code's layout:
//! it must name every source file of the tree, no more, and every method of the `DataPlane`
//! interface.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
};

const SECTION: &str = "## Where the code lives";

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("masq-agent sits in the workspace")
        .to_path_buf()
}

/// The section's text, up to the next section.
fn section() -> String {
    let doc = std::fs::read_to_string(workspace_root().join("docs/architecture.md")).unwrap();
    let start = doc.find(SECTION).expect("architecture.md has the section");
    let rest = &doc[start + SECTION.len()..];
    let end = rest.find("\n## ").unwrap_or(rest.len());
    rest[..end].to_string()
}

/// The files the section's list names: a crate's directory at the start of a line, then its
/// files indented below it, each the first word of its line.
fn listed() -> BTreeSet<String> {
    let section = section();
    let block = section
        .split("```text\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("the section lists the files in a text block");
    let mut files = BTreeSet::new();
    let mut dir = String::new();
    for line in block.lines().filter(|l| !l.trim().is_empty()) {
        let first = line.split_whitespace().next().unwrap_or_default();
        if line.starts_with(' ') {
            assert!(!dir.is_empty(), "a file before any directory: {line}");
            assert!(
                files.insert(format!("{dir}{first}")),
                "{dir}{first} is listed twice"
            );
        } else {
            assert!(first.ends_with('/'), "a directory line ends in /: {line}");
            dir = first.to_string();
        }
    }
    files
}

/// Every Rust source file of the workspace, relative to its root.
fn in_tree() -> BTreeSet<String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeSet<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if name.starts_with('.') || name == "target" {
                continue;
            }
            if path.is_dir() {
                walk(root, &path, out);
            } else if name.ends_with(".rs") {
                let relative = path.strip_prefix(root).unwrap();
                out.insert(relative.to_string_lossy().to_string());
            }
        }
    }
    let root = workspace_root();
    let mut files = BTreeSet::new();
    walk(&root, &root, &mut files);
    files
}

#[test]
fn the_layout_names_every_source_file_and_no_other() {
    let (listed, tree) = (listed(), in_tree());
    let unlisted: Vec<&String> = tree.difference(&listed).collect();
    let gone: Vec<&String> = listed.difference(&tree).collect();
    assert!(
        unlisted.is_empty() && gone.is_empty(),
        "docs/architecture.md, \"{SECTION}\": not listed {unlisted:?}; listed but not in the tree {gone:?}"
    );
}

#[test]
fn the_layout_names_every_method_of_the_data_plane_interface() {
    let source =
        std::fs::read_to_string(workspace_root().join("masq-agent/src/dataplane/interface.rs"))
            .unwrap();
    let start = source
        .find("pub trait DataPlane")
        .expect("dataplane/interface.rs declares the interface");
    let body = &source[start..start + source[start..].find("\n}\n").unwrap()];
    let methods: Vec<&str> = body
        .lines()
        .filter_map(|l| l.trim().strip_prefix("fn "))
        .map(|l| l.split(['(', '<']).next().unwrap())
        .collect();
    assert!(methods.len() >= 4, "the interface's methods: {methods:?}");
    let section = section();
    for method in methods {
        assert!(
            section.contains(&format!("`{method}`")),
            "\"{SECTION}\" does not name DataPlane::{method}"
        );
    }
}

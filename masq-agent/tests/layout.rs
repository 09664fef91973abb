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

/// The modules of masq-agent's library, by path (`crate::dataplane::ebpf`), with their files.
fn agent_modules() -> std::collections::BTreeMap<String, PathBuf> {
    let src = workspace_root().join("masq-agent/src");
    let mut modules = std::collections::BTreeMap::new();
    let mut dirs = vec![src.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            let relative = path.strip_prefix(&src).unwrap().with_extension("");
            let mut parts: Vec<String> = relative
                .iter()
                .map(|p| p.to_string_lossy().to_string())
                .collect();
            // Test modules and the binary's root are not the library's.
            if parts.last().is_some_and(|p| p == "tests") || parts == ["main"] {
                continue;
            }
            if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
                parts.pop();
            }
            modules.insert(
                std::iter::once("crate".to_string())
                    .chain(parts)
                    .collect::<Vec<_>>()
                    .join("::"),
                path,
            );
        }
    }
    modules
}

/// The modules one file's code names: through `use`, and through paths that start at `crate`,
/// `super` or `self`, each taken as deep as it names a module. `#[cfg(test)]` items left out.
struct Imports<'a> {
    module: &'a str,
    modules: &'a std::collections::BTreeMap<String, PathBuf>,
    found: BTreeSet<String>,
}

impl Imports<'_> {
    fn resolve(&mut self, segments: &[String]) {
        let mut at: Vec<&str> = self.module.split("::").collect();
        let mut rest = segments;
        match rest.first().map(String::as_str) {
            Some("crate") => {
                at = vec!["crate"];
                rest = &rest[1..];
            }
            Some("self") => rest = &rest[1..],
            Some("super") => {}
            _ => return,
        }
        while rest.first().is_some_and(|s| s == "super") {
            at.pop();
            rest = &rest[1..];
        }
        let mut deepest = at.join("::");
        for segment in rest {
            let deeper = format!("{deepest}::{segment}");
            if !self.modules.contains_key(&deeper) {
                break;
            }
            deepest = deeper;
        }
        self.found.insert(deepest);
    }

    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(path) => {
                prefix.push(path.ident.to_string());
                self.use_tree(prefix, &path.tree);
                prefix.pop();
            }
            syn::UseTree::Name(name) => {
                prefix.push(name.ident.to_string());
                self.resolve(&prefix.clone());
                prefix.pop();
            }
            syn::UseTree::Rename(rename) => {
                prefix.push(rename.ident.to_string());
                self.resolve(&prefix.clone());
                prefix.pop();
            }
            syn::UseTree::Glob(_) => self.resolve(&prefix.clone()),
            syn::UseTree::Group(group) => {
                for tree in &group.items {
                    self.use_tree(prefix, tree);
                }
            }
        }
    }
}

fn is_test_only(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|attr| {
        attr.path().is_ident("cfg")
            && attr
                .parse_args::<syn::Meta>()
                .is_ok_and(|meta| meta.path().is_ident("test"))
    })
}

impl<'ast> syn::visit::Visit<'ast> for Imports<'_> {
    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        if !is_test_only(&item.attrs) {
            self.use_tree(&mut Vec::new(), &item.tree);
        }
    }

    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        if !is_test_only(&item.attrs) {
            syn::visit::visit_item_mod(self, item);
        }
    }

    fn visit_item_fn(&mut self, item: &'ast syn::ItemFn) {
        if !is_test_only(&item.attrs) {
            syn::visit::visit_item_fn(self, item);
        }
    }

    /// `pub(super)` says who may use an item, not what it uses.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}

    fn visit_path(&mut self, path: &'ast syn::Path) {
        let segments: Vec<String> = path.segments.iter().map(|s| s.ident.to_string()).collect();
        self.resolve(&segments);
        syn::visit::visit_path(self, path);
    }
}

/// What each of masq-agent's modules imports of the others. A `mod.rs` that declares its
/// files and re-exports them depends on them; a file that imports through its directory's
/// `mod.rs` depends on that.
fn agent_imports() -> std::collections::BTreeMap<String, BTreeSet<String>> {
    let modules = agent_modules();
    modules
        .iter()
        .map(|(module, path)| {
            let file = syn::parse_file(&std::fs::read_to_string(path).unwrap())
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            let mut imports = Imports {
                module,
                modules: &modules,
                found: BTreeSet::new(),
            };
            syn::visit::Visit::visit_file(&mut imports, &file);
            // A directory's declared files, and the paths it names from them (`load::x`).
            for item in &file.items {
                if let syn::Item::Mod(declared) = item
                    && !is_test_only(&declared.attrs)
                {
                    imports
                        .found
                        .insert(format!("{module}::{}", declared.ident));
                }
            }
            let mut found = imports.found;
            found.retain(|m| m != module && modules.contains_key(m));
            (module.clone(), found)
        })
        .collect()
}

#[test]
fn no_module_of_the_agent_imports_what_imports_it() {
    let imports = agent_imports();
    // Depth-first, with the path walked so far: a module met again on it closes a circle.
    fn walk<'a>(
        module: &'a str,
        imports: &'a std::collections::BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<&'a str>,
        done: &mut BTreeSet<&'a str>,
        circles: &mut Vec<String>,
    ) {
        if let Some(at) = path.iter().position(|m| *m == module) {
            circles.push(format!("{} -> {module}", path[at..].join(" -> ")));
            return;
        }
        if !done.insert(module) {
            return;
        }
        path.push(module);
        for next in &imports[module] {
            walk(next, imports, path, done, circles);
        }
        path.pop();
    }
    let (mut done, mut circles) = (BTreeSet::new(), Vec::new());
    for module in imports.keys() {
        walk(module, &imports, &mut Vec::new(), &mut done, &mut circles);
    }
    assert!(
        circles.is_empty(),
        "import circles (CONTRIBUTING.md: a file imports what sits below it):\n{}",
        circles.join("\n")
    );
    // The check sees imports at all: the agent's root reaches its modules.
    assert!(imports["crate::dataplane::ebpf"].contains("crate::dataplane::ebpf::load"));
    assert!(imports["crate::dataplane::ebpf::load"].contains("crate::dataplane::ebpf::maps"));
}

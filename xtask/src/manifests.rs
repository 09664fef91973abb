//! Validates the Kubernetes manifests in deploy/ against the API's OpenAPI schemas, strictly (an
//! unknown or misspelled field fails), with `kubernetes-validate` from PyPI. It is installed
//! into a venv under target/ on first use, and found there afterwards.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use masq_testbed::{netns, workspace_root};

use crate::step;

const PACKAGE: &str = "kubernetes-validate";
/// Pinned, so that a new schema release cannot fail a build that changed nothing. Its schemas
/// default to the Kubernetes release of the same minor version.
const VERSION: &str = "1.37.0";

pub fn validate() -> anyhow::Result<()> {
    let validator = install()?;
    let manifests = manifests(&workspace_root().join("deploy"))?;
    let mut args = vec!["--strict".to_string()];
    args.extend(manifests.iter().map(|m| m.display().to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    step(validator.to_str().context("venv path")?, &args)
}

/// The validator's path, installed first if it is missing or another version.
fn install() -> anyhow::Result<PathBuf> {
    let venv = workspace_root().join("target/venv");
    let validator = venv.join("bin").join(PACKAGE);
    if netns::run(validator.to_str().context("venv path")?, &["--version"])
        .is_ok_and(|v| v.trim() == VERSION)
    {
        return Ok(validator);
    }
    eprintln!(
        "xtask: installing {PACKAGE} {VERSION} into {}",
        venv.display()
    );
    // Debian's interpreter, whose venv module setup installs (python3-venv).
    step(
        "/usr/bin/python3",
        &["-m", "venv", venv.to_str().context("venv path")?],
    )?;
    step(
        venv.join("bin/pip").to_str().context("venv path")?,
        &[
            "install",
            "--quiet",
            "--disable-pip-version-check",
            &format!("{PACKAGE}=={VERSION}"),
        ],
    )?;
    Ok(validator)
}

/// Every Kubernetes object file in `dir`: the YAML files, less kustomization.yaml, which is
/// kustomize's input rather than an API object.
fn manifests(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.ends_with(".yaml") && name != "kustomization.yaml" {
            found.push(path);
        }
    }
    found.sort();
    anyhow::ensure!(!found.is_empty(), "no manifests in {}", dir.display());
    Ok(found)
}

//! Validates the Kubernetes manifests in deploy/ against the API's OpenAPI schemas, strictly (an
//! unknown or misspelled field fails), with `kubernetes-validate` from PyPI. It is installed
//! into a venv under target/ on first use, and found there afterwards.
//!
//! Validated: every object file under deploy/, components included; the default install with
//! each component added, as `kubectl kustomize` builds it; and the Helm chart as `helm template`
//! renders it with each values file under its ci/ directory (its defaults among them).

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use masq_testbed::{deploy, netns, workspace_root};

use crate::{install_kit::python_venv, step};

const PACKAGE: &str = "kubernetes-validate";
/// Pinned, so that a new schema release cannot fail a build that changed nothing. Its schemas
/// default to the Kubernetes release of the same minor version.
const VERSION: &str = "1.37.0";

/// Kinds the validator has no schema for (it only warns about them), each with where its
/// fields are checked instead. Any other kind without a schema fails the validation.
const CHECKED_ELSEWHERE: &[(&str, &str)] = &[
    (
        "PodMonitor",
        "a Prometheus Operator CRD: masq-agent/tests/deploy.rs checks the fields it uses",
    ),
    (
        "PrometheusRule",
        "a Prometheus Operator CRD: masq-agent/tests/deploy.rs checks the fields it uses",
    ),
    (
        "ServiceMonitor",
        "a Prometheus Operator CRD: integration/tests/manifests.rs checks the fields it uses",
    ),
];

pub fn validate() -> anyhow::Result<()> {
    let validator = install()?;
    let mut manifests = Vec::new();
    manifests_under(&workspace_root().join("deploy"), &mut manifests)?;
    anyhow::ensure!(!manifests.is_empty(), "no manifests in deploy/");
    manifests.sort();
    manifests.extend(builds()?);
    let mut args = vec!["--strict".to_string()];
    args.extend(manifests.iter().map(|m| m.display().to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let program = validator.to_str().context("venv path")?;
    eprintln!("xtask: $ {program} {}", args.join(" "));
    let out = std::process::Command::new(program)
        .args(&args)
        .output()
        .with_context(|| format!("running {program}"))?;
    let report = String::from_utf8_lossy(&out.stdout);
    print!("{report}");
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    anyhow::ensure!(out.status.success(), "{PACKAGE} failed: {}", out.status);
    let unvalidated: std::collections::BTreeSet<&str> = report
        .lines()
        .filter_map(|line| line.split_once("Couldn't find schema for kind "))
        .filter_map(|(_, rest)| rest.split_whitespace().next())
        .collect();
    for kind in unvalidated {
        match CHECKED_ELSEWHERE.iter().find(|(k, _)| *k == kind) {
            Some((_, instead)) => eprintln!("xtask: {kind} has no schema here; {instead}"),
            None => anyhow::bail!("{kind}: {PACKAGE} has no schema to validate it against"),
        }
    }
    Ok(())
}

/// What kustomize and Helm build from deploy/, written under target/manifests/ for the
/// validator: the default install with each component added, and the chart with each values
/// file under its ci/ (the defaults among them).
fn builds() -> anyhow::Result<Vec<PathBuf>> {
    let dir = workspace_root().join("target/manifests");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut builds = Vec::new();
    for component in deploy::component_names() {
        let objects = deploy::kustomize(&[&component])?;
        builds.push((format!("with-{component}.yaml"), objects));
    }
    for (name, values) in deploy::chart_values_files() {
        let objects = deploy::helm_template(&["--values", values.to_str().context("path")?])?;
        builds.push((format!("helm-{name}"), objects));
    }
    let mut files = Vec::new();
    for (name, objects) in builds {
        let mut text = String::new();
        for object in objects {
            text.push_str("---\n");
            text.push_str(&serde_yaml::to_string(&object)?);
        }
        let file = dir.join(name);
        std::fs::write(&file, text).with_context(|| format!("writing {}", file.display()))?;
        files.push(file);
    }
    Ok(files)
}

/// Writes the files of deploy/ that are the chart's renders (`deploy::RENDERED`).
pub fn render() -> anyhow::Result<()> {
    for rendered in deploy::RENDERED {
        let path = rendered.path();
        std::fs::write(&path, rendered.render()?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("xtask: wrote {}", path.display());
    }
    Ok(())
}

/// The validator's path, installed first if it is missing or another version.
fn install() -> anyhow::Result<PathBuf> {
    let venv = python_venv()?;
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

/// Every Kubernetes object file under `dir`: the YAML files, less the kustomization.yaml files,
/// which are kustomize's input rather than API objects, and the Helm chart, whose files are
/// templates and values.
fn manifests_under(dir: &Path, found: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if path.is_dir() && name == "helm" {
            continue;
        }
        if path.is_dir() {
            manifests_under(&path, found)?;
        } else if name.ends_with(".yaml") && name != "kustomization.yaml" {
            found.push(path);
        }
    }
    Ok(())
}

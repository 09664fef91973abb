//! `cargo xtask budget`: what the verifier spends on each program, the instructions it
//! processed and the deepest chain of calls' stack, against its limits; on the running kernel,
//! and (`--vms`) on the VMs' kernels, whose figures it writes into the docs (see
//! `verifier_figures`).

use std::path::Path;

use anyhow::bail;
use masq_testbed::{verifier::StackRule, workspace_root};

use crate::{
    doc_sections,
    verifier_figures::{
        ProgramFigures, built_object, describe, figures, kernel_release, measure_here, section,
    },
};

/// The figures of the running kernel and of each VM's, the programs loaded in each.
pub fn everywhere(object: &Path) -> anyhow::Result<Vec<ProgramFigures>> {
    let (mut all, frames) = measure_here(object)?;
    for (release, said) in crate::vm::verifier_said(object)? {
        all.extend(figures(&release, &said, &frames));
    }
    Ok(all)
}

/// `as_release`: count the stack as that kernel would, rather than the running one.
/// `vms`: also boot the VMs' kernels, and write the figures into docs/install.md.
pub fn run(json: bool, tree: bool, as_release: Option<&str>, vms: bool) -> anyhow::Result<()> {
    if vms {
        crate::vm_kit::setup()?;
        crate::step("cargo", &["build", "--quiet", "--package", "masq-agent"])?;
        let figures = everywhere(&built_object()?)?;
        print!("{}", describe(&figures));
        for doc in ["docs/install.md", "docs/bench/report.md"] {
            doc_sections::update_section(
                &workspace_root().join(doc),
                "budget",
                &section(&figures),
            )?;
        }
        if figures.iter().any(|f| f.error.is_some()) {
            bail!("a kernel's verifier refused a program");
        }
        return Ok(());
    }
    crate::step("cargo", &["build", "--quiet", "--package", "masq-agent"])?;
    let object = built_object()?;
    let (mut figures, frames) = measure_here(&object)?;
    let release = match as_release {
        Some(release) => release.to_string(),
        None => kernel_release()?,
    };
    if as_release.is_some() {
        figures = self::figures(&release, &frames, &frames);
    }
    if tree {
        let rule = StackRule::for_release(&release);
        for budget in &frames {
            print!("{}", budget.tree(rule));
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&figures)?);
    } else {
        print!("{}", describe(&figures));
    }
    if figures.iter().any(|f| f.error.is_some()) {
        bail!("the verifier rejected a program");
    }
    Ok(())
}

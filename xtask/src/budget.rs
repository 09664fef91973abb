//! `cargo xtask budget`: what the verifier spends on each program, the instructions it
//! processed and the deepest chain of calls' stack, against its limits; on the running kernel,
//! and (`--vms`) on the VMs' kernels, whose figures it writes into the docs (see
//! `verifier_figures`).

use anyhow::bail;
use masq_testbed::{verifier::StackRule, workspace_root};

use crate::{
    doc_sections,
    verifier_figures::{
        BuiltObject, ProgramFigures, describe, figures, kernel_release, measure_here, section,
    },
};

/// The figures of both objects on the running kernel and on each VM's, the programs loaded
/// in each; the slot table's not on kernels without its atomics.
pub fn everywhere() -> anyhow::Result<Vec<ProgramFigures>> {
    let mut all = Vec::new();
    for object in BuiltObject::both()? {
        let (here, frames) = measure_here(&object.path)?;
        all.extend(object.named(here));
        for (release, said) in crate::vm::verifier_said(&object.path, object.slot_table)? {
            all.extend(match said {
                Some(said) => object.named(figures(&release, &said, &frames)),
                None => object.too_old(&release, &frames),
            });
        }
    }
    Ok(all)
}

/// The figures of both objects on the running kernel.
pub fn here() -> anyhow::Result<Vec<ProgramFigures>> {
    let mut all = Vec::new();
    for object in BuiltObject::both()? {
        all.extend(object.named(measure_here(&object.path)?.0));
    }
    Ok(all)
}

/// `as_release`: count the stack as that kernel would, rather than the running one.
/// `vms`: also boot the VMs' kernels, and write the figures into docs/install.md.
pub fn run(json: bool, tree: bool, as_release: Option<&str>, vms: bool) -> anyhow::Result<()> {
    if vms {
        crate::vm_kit::setup()?;
        crate::step("cargo", &["build", "--quiet", "--package", "masq-agent"])?;
        let figures = everywhere()?;
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
    let release = match as_release {
        Some(release) => release.to_string(),
        None => kernel_release()?,
    };
    let mut all = Vec::new();
    for object in BuiltObject::both()? {
        let (mut figures, frames) = measure_here(&object.path)?;
        if as_release.is_some() {
            figures = self::figures(&release, &frames, &frames);
        }
        if tree {
            let rule = StackRule::for_release(&release);
            for budget in &frames {
                print!("{}", budget.tree(rule));
            }
        }
        all.extend(object.named(figures));
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&all)?);
    } else {
        print!("{}", describe(&all));
    }
    if all.iter().any(|f| f.error.is_some()) {
        bail!("the verifier rejected a program");
    }
    Ok(())
}

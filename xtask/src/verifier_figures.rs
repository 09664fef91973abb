//! The verifier's figures for each program, as the report and the docs give them: what it
//! processed and the deepest chain's stack, measured on the running kernel or said by a VM's.
//! The frames come from the verbose log on the running kernel: they are the program's, the
//! same on every kernel, and only their rounding differs (`StackRule`). The instructions
//! processed are each kernel's own.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use masq_testbed::{
    verifier::{self, Budget, PROCESSED_LIMIT, SLOT_TABLE_PROGRAM, STACK_LIMIT, StackRule},
    workspace_root,
};
use serde::{Deserialize, Serialize};

use crate::doc_sections;

/// One program's budget on one kernel, as the report and the docs give it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ProgramFigures {
    pub kernel: String,
    pub program: String,
    pub processed: Option<u64>,
    /// The deepest chain's stack as the kernel rounds its frames.
    pub stack: Option<u32>,
    /// That chain, each function with what it counts for.
    pub chain: Option<String>,
    pub error: Option<String>,
    /// Why it was not loaded, where the agent does without it.
    #[serde(default)]
    pub not_loaded: Option<String>,
}

/// The release of the running kernel.
pub fn kernel_release() -> anyhow::Result<String> {
    Ok(std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .context("reading the kernel release")?
        .trim()
        .to_string())
}

/// The figures of kernel `release`: what its verifier said (`said`: at least the instructions
/// processed, or the error), with the stack of the programs' `frames` as it rounds them.
pub fn figures(release: &str, said: &[Budget], frames: &[Budget]) -> Vec<ProgramFigures> {
    let rule = StackRule::for_release(release);
    said.iter()
        .map(|budget| {
            let framed = frames
                .iter()
                .find(|f| f.program == budget.program && !f.functions.is_empty())
                .or(Some(budget).filter(|b| !b.functions.is_empty()));
            let deepest = framed.and_then(|f| Some((f, f.deepest(rule)?)));
            ProgramFigures {
                kernel: release.to_string(),
                program: budget.program.clone(),
                processed: budget.processed,
                stack: deepest.as_ref().map(|(_, chain)| chain.bytes),
                chain: deepest.as_ref().map(|(f, chain)| f.describe(chain, rule)),
                error: budget.error.clone(),
                not_loaded: budget.not_loaded.clone(),
            }
        })
        .collect()
}

/// The object masq-agent's build script left, the newest of the workspace's builds.
pub fn built_object() -> anyhow::Result<PathBuf> {
    let target = workspace_root().join("target");
    let mut newest: Option<(std::time::SystemTime, PathBuf)> = None;
    for profile in std::fs::read_dir(&target).context("reading target/")? {
        let build = profile?.path().join("build");
        let Ok(entries) = std::fs::read_dir(&build) else {
            continue;
        };
        for entry in entries.flatten() {
            let object = entry.path().join("out/masq");
            let is_agents = entry
                .file_name()
                .to_string_lossy()
                .starts_with("masq-agent-");
            if let (true, Ok(meta)) = (is_agents, std::fs::metadata(&object)) {
                let modified = meta.modified()?;
                if newest.as_ref().is_none_or(|(t, _)| modified > *t) {
                    newest = Some((modified, object));
                }
            }
        }
    }
    match newest {
        Some((_, object)) => Ok(object),
        None => bail!("no eBPF object built yet: run `cargo test --workspace --no-run`"),
    }
}

/// One of the two objects masq-agent's build script leaves: the programs with the hash table
/// (`load::OBJECT`), and with the slot table (`load::SLOT_TABLE_OBJECT`, beside it in
/// `slot-table/`), which needs BPF atomics on map values (Linux 5.12).
pub struct BuiltObject {
    pub path: PathBuf,
    pub slot_table: bool,
}

impl BuiltObject {
    /// The objects of the newest build (`built_object`).
    pub fn both() -> anyhow::Result<[BuiltObject; 2]> {
        let path = built_object()?;
        let slot_table = path.with_file_name("slot-table").join("masq");
        Ok([
            BuiltObject {
                path,
                slot_table: false,
            },
            BuiltObject {
                path: slot_table,
                slot_table: true,
            },
        ])
    }

    /// Its figures, each program named for the object (`masq_egress (slot table)`).
    pub fn named(&self, mut figures: Vec<ProgramFigures>) -> Vec<ProgramFigures> {
        if self.slot_table {
            for f in &mut figures {
                f.program.push_str(SLOT_TABLE_PROGRAM);
            }
        }
        figures
    }

    /// Its figures on the kernel of `release`, which is too old to load it: the stack of the
    /// programs' `frames` as it would round them, each marked why not loaded.
    pub fn too_old(&self, release: &str, frames: &[Budget]) -> Vec<ProgramFigures> {
        let mut figures = figures(release, frames, frames);
        for f in &mut figures {
            f.processed = None;
            f.not_loaded = Some(
                "not loaded: the slot table needs Linux 5.12; the agent loads the hash table's \
                 object there"
                    .to_string(),
            );
        }
        self.named(figures)
    }
}

/// The figures as a Markdown table, for the report and the docs.
pub fn table(figures: &[ProgramFigures]) -> String {
    let mut out = format!(
        "| program | kernel | instructions processed (of {PROCESSED_LIMIT}) | combined stack (of \
         {STACK_LIMIT} bytes) | the deepest chain of calls, each frame as the kernel counts it |\n\
         |---|---|---:|---:|---|\n"
    );
    for f in figures {
        let processed = match (&f.error, &f.not_loaded, f.processed) {
            (Some(error), _, _) => format!("refused: {error}"),
            (None, Some(why), _) => why.clone(),
            (None, None, Some(processed)) => processed.to_string(),
            (None, None, None) => "not reported before 5.16".to_string(),
        };
        let stack = f.stack.map_or("?".to_string(), |s| s.to_string());
        let chain = f
            .chain
            .as_deref()
            .map_or(String::new(), |chain| format!("`{chain}`"));
        out.push_str(&format!(
            "| {} | {} | {processed} | {stack} | {chain} |\n",
            f.program, f.kernel
        ));
    }
    out
}

/// The figures as lines for a terminal.
pub fn describe(figures: &[ProgramFigures]) -> String {
    let mut out = String::new();
    for f in figures {
        let verdict = match (&f.error, &f.not_loaded) {
            (Some(error), _) => format!("REJECTED ({error})"),
            (None, Some(why)) => {
                out.push_str(&format!("{} on {}: {why}\n", f.program, f.kernel));
                continue;
            }
            (None, None) => "accepted".to_string(),
        };
        let processed = f.processed.map_or(
            "instructions processed not reported (kernels report them from 5.16)".to_string(),
            |p| format!("{p} of {PROCESSED_LIMIT} instructions processed"),
        );
        out.push_str(&format!(
            "{} on {}: {verdict}; {processed}",
            f.program, f.kernel
        ));
        if let (Some(stack), Some(chain)) = (f.stack, &f.chain) {
            out.push_str(&format!("; stack {stack} of {STACK_LIMIT}: {chain}"));
        }
        out.push('\n');
    }
    out
}

/// Measures `object` on the running kernel: its figures, and the frames (the same on every
/// kernel) for other kernels' figures.
pub fn measure_here(object: &Path) -> anyhow::Result<(Vec<ProgramFigures>, Vec<Budget>)> {
    let frames = verifier::measure(object)?;
    Ok((figures(&kernel_release()?, &frames, &frames), frames))
}

/// What a reader of the docs reads of the budget: the table, and where it came from.
pub fn section(figures: &[ProgramFigures]) -> String {
    format!(
        "Measured {} with `cargo xtask budget --vms` (also part of `cargo xtask bench`); the \
         stack of each frame is the same on every kernel, and each kernel rounds it its own \
         way.\n\n{}",
        doc_sections::today(),
        table(figures)
    )
}

//! `cargo xtask budget`: what the verifier of the running kernel spends on each program, the
//! instructions it processed and the deepest chain of calls' stack, against its limits.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, bail};
use masq_testbed::{
    verifier::{self, Budget, PROCESSED_LIMIT, STACK_LIMIT, StackRule},
    workspace_root,
};
use serde::Serialize;

/// One program's budget on one kernel, as the report and the docs give it.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct ProgramFigures {
    pub kernel: String,
    pub program: String,
    pub processed: Option<u64>,
    /// The deepest chain's stack under the kernel's own rounding.
    pub stack: Option<u32>,
    /// The same under the rounding of kernels before 6.9, which is what an older kernel would
    /// count: the frames are the program's, whatever the kernel.
    pub stack_before_6_9: Option<u32>,
    /// That chain, each function with what it counts for.
    pub chain: Option<String>,
    pub error: Option<String>,
}

/// The release of the running kernel.
pub fn kernel_release() -> anyhow::Result<String> {
    Ok(std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .context("reading the kernel release")?
        .trim()
        .to_string())
}

/// Measures the object the agent embeds, on the running kernel.
pub fn measure(object: &Path) -> anyhow::Result<Vec<ProgramFigures>> {
    let kernel = kernel_release()?;
    let rule = StackRule::for_release(&kernel);
    let budgets = verifier::measure(object)?;
    Ok(budgets
        .iter()
        .map(|budget| figures(&kernel, rule, budget))
        .collect())
}

fn figures(kernel: &str, rule: StackRule, budget: &Budget) -> ProgramFigures {
    let deepest = budget.deepest(rule);
    ProgramFigures {
        kernel: kernel.to_string(),
        program: budget.program.clone(),
        processed: budget.processed,
        stack: deepest.as_ref().map(|chain| chain.bytes),
        stack_before_6_9: budget
            .deepest(StackRule::Rounded32)
            .map(|chain| chain.bytes),
        chain: deepest.as_ref().map(|chain| budget.describe(chain, rule)),
        error: budget.error.clone(),
    }
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
        None => bail!("no eBPF object built yet: run `cargo build -p masq-agent`"),
    }
}

/// The figures as lines for a terminal or a report.
pub fn describe(figures: &[ProgramFigures]) -> String {
    let mut out = String::new();
    for f in figures {
        let processed = f
            .processed
            .map_or("?".to_string(), |p| format!("{p} of {PROCESSED_LIMIT}"));
        let stack = f
            .stack
            .map_or("?".to_string(), |s| format!("{s} of {STACK_LIMIT}"));
        let old = f
            .stack_before_6_9
            .map_or("?".to_string(), |s| format!("{s}"));
        out.push_str(&format!(
            "{} on {}: {}; instructions processed {processed}; stack {stack} ({old} as kernels \
             before 6.9 count it): {}\n",
            f.program,
            f.kernel,
            f.error
                .as_deref()
                .map_or("accepted".to_string(), |e| format!("REJECTED ({e})")),
            f.chain.as_deref().unwrap_or("?"),
        ));
    }
    out
}

pub fn run(json: bool, tree: bool) -> anyhow::Result<()> {
    crate::step("cargo", &["build", "--quiet", "--package", "masq-agent"])?;
    let object = built_object()?;
    if tree {
        let rule = StackRule::for_release(&kernel_release()?);
        for budget in verifier::measure(&object)? {
            print!("{}", budget.tree(rule));
        }
    }
    let figures = measure(&object)?;
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

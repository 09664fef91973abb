//! `cargo xtask setup | demo | test | bench | validate-manifests`.

mod bench;
mod budget;
mod demo;
mod manifests;
mod node_tables;
mod report;
mod setup;
mod soak;
mod vm;

use std::process::{Command, ExitCode};

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "masq-agent developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install missing prerequisites (apt packages, rust-src, bpf-linker).
    Setup,
    /// Build, then show masq-agent at work on a self-made namespace topology.
    Demo,
    /// Run the whole suite: formatting, lints, unit and integration tests.
    Test {
        /// Extra arguments for `cargo test` (e.g. a test name filter).
        #[arg(trailing_var_arg = true)]
        cargo_test_args: Vec<String>,
    },
    /// Measure the eBPF data plane against the iptables chain and against no NAT.
    Bench(bench::Options),
    /// Many concurrent flows from many pods through the eBPF data plane for minutes, with the
    /// agent's memory and the NAT table sampled as they run.
    Soak(soak::Options),
    /// One pod's flows of a soak run (started by `soak`).
    #[command(hide = true)]
    SoakPod(soak::PodOptions),
    /// Validate the Kubernetes manifests in deploy/ against the API's schemas.
    ValidateManifests,
    /// Only the last step of `test`: the end-to-end cases on Debian 12's Linux 6.1 kernels,
    /// booted in qemu.
    Vm,
    /// The VM's side of `vm` (started by `vm` inside the VM).
    #[command(hide = true)]
    VmGuest {
        #[arg(long)]
        out: std::path::PathBuf,
        #[arg(long)]
        test_binary: std::path::PathBuf,
        #[arg(long)]
        object: std::path::PathBuf,
        cases: Vec<String>,
    },
    /// What the running kernel's verifier spends on each program: instructions processed and
    /// the deepest chain of calls' stack, against its limits.
    Budget {
        /// Print JSON instead of lines.
        #[arg(long)]
        json: bool,
        /// Also print each program's calls as a tree, with every function's frame.
        #[arg(long)]
        tree: bool,
    },
}

fn main() -> ExitCode {
    let result = match Cli::parse().task {
        Task::Setup => setup::run(),
        Task::Demo => setup::run().and_then(|()| demo::run()),
        Task::Test { cargo_test_args } => setup::run().and_then(|()| test(&cargo_test_args)),
        Task::Bench(options) => setup::run().and_then(|()| bench::run(&options)),
        Task::Soak(options) => setup::run().and_then(|()| soak::run(&options)),
        Task::SoakPod(options) => soak::run_pod(&options),
        Task::ValidateManifests => setup::run().and_then(|()| manifests::validate()),
        Task::Budget { json, tree } => budget::run(json, tree),
        Task::Vm => setup::run().and_then(|()| vm_cases()),
        Task::VmGuest {
            out,
            test_binary,
            object,
            cases,
        } => vm::guest(&out, &test_binary, &object, &cases),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("xtask: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Runs `program args...` with inherited output; fails if it fails.
pub fn step(program: &str, args: &[&str]) -> anyhow::Result<()> {
    eprintln!("xtask: $ {program} {}", args.join(" "));
    let status = Command::new(program)
        .args(args)
        .status()
        .with_context(|| format!("running {program}"))?;
    if !status.success() {
        bail!("{program} {} failed: {status}", args.join(" "));
    }
    Ok(())
}

fn test(cargo_test_args: &[String]) -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the integration tests create network namespaces and load eBPF: run as root");
    }
    step("cargo", &["fmt", "--all", "--check"])?;
    step(
        "cargo",
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
    )?;
    step(
        "cargo",
        &[
            "+nightly",
            "clippy",
            "--package",
            "masq-ebpf",
            "--target",
            "bpfel-unknown-none",
            "-Z",
            "build-std=core",
            "--",
            "-D",
            "warnings",
        ],
    )?;
    manifests::validate()?;
    let mut args = vec!["test", "--workspace"];
    args.extend(cargo_test_args.iter().map(String::as_str));
    step("cargo", &args)?;
    vm_cases()
}

/// Builds the end-to-end test binary, and runs its VM cases on Linux 6.1.
fn vm_cases() -> anyhow::Result<()> {
    let out = Command::new("cargo")
        .args([
            "test",
            "--package",
            "masq-integration",
            "--test",
            "dataplanes",
            "--no-run",
            "--message-format=json",
        ])
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("building the end-to-end tests")?;
    if !out.status.success() {
        bail!("building the end-to-end tests failed");
    }
    let binary = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .find_map(|message| {
            (message["target"]["name"] == "dataplanes")
                .then(|| message["executable"].as_str().map(String::from))
                .flatten()
        })
        .context("cargo named no dataplanes test binary")?;
    // The agent's binary, which the cases run, is built beside them.
    step("cargo", &["build", "--quiet", "--package", "masq-agent"])?;
    vm::run(std::path::Path::new(&binary))
}

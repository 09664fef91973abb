//! The developer tasks: `cargo xtask --help` lists them; the README says which to run when.

mod bench;
mod bench_plan;
mod bpf_lines;
mod budget;
mod cost_meter;
mod demo;
mod doc_sections;
mod install_kit;
mod kube_tools;
mod manifests;
mod node_tables;
mod report;
mod setup;
mod soak;
mod sweep_watch;
mod verifier_figures;
mod vm;
mod vm_kit;

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
    /// Install missing prerequisites (apt packages, rust-src, bpf-linker, helm and kubectl).
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
    Bench(bench_plan::Options),
    /// Where the loaded programs' run time goes, by line of their source: samples the machine
    /// with perf while a workload runs (start it first).
    BpfLines(bpf_lines::Options),
    /// Many concurrent flows from many pods through the eBPF data plane for minutes, with the
    /// agent's memory and the NAT table sampled as they run.
    Soak(soak::Options),
    /// One pod's flows of a soak run (started by `soak`).
    #[command(hide = true)]
    SoakPod(soak::PodOptions),
    /// Validate the Kubernetes manifests in deploy/ against the API's schemas.
    ValidateManifests,
    /// Write the object files of deploy/ that are the Helm chart's renders (daemonset.yaml,
    /// uninstall.yaml, the podmonitor and alerts components' objects).
    RenderManifests,
    /// Only the last step of `test`: the end-to-end cases on Debian 12's Linux 6.1 kernels,
    /// booted in qemu.
    Vm,
    /// The VM's side of `vm` (started by `vm` inside the VM).
    #[command(hide = true)]
    VmGuest {
        #[arg(long)]
        out: std::path::PathBuf,
        #[arg(long)]
        object: std::path::PathBuf,
        /// A test binary and the cases of it to run: `BINARY=CASE,CASE`.
        #[arg(long = "run")]
        runs: Vec<String>,
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
        /// Count the stack as the kernel of this release would (e.g. 6.1.0): the frames are
        /// the same on every kernel, only their rounding differs. The instructions processed
        /// stay the running kernel's.
        #[arg(long)]
        r#as: Option<String>,
        /// Also boot the VMs' kernels (Linux 6.1, 5.10) and load the programs there, and write
        /// every kernel's figures into docs/install.md and the benchmark report.
        #[arg(long)]
        vms: bool,
    },
}

fn main() -> ExitCode {
    let result = match Cli::parse().task {
        Task::Setup => setup::run().and_then(|()| vm_kit::setup()),
        Task::Demo => setup::run().and_then(|()| demo::run()),
        Task::Test { cargo_test_args } => setup::run()
            .and_then(|()| vm_kit::setup())
            .and_then(|()| test(&cargo_test_args)),
        Task::Bench(options) => setup::run()
            .and_then(|()| vm_kit::setup())
            .and_then(|()| bench::run(&options)),
        Task::BpfLines(options) => bpf_lines::run(&options),
        Task::Soak(options) => setup::run().and_then(|()| soak::run(&options)),
        Task::SoakPod(options) => soak::run_pod(&options),
        Task::ValidateManifests => setup::run().and_then(|()| manifests::validate()),
        Task::RenderManifests => manifests::render(),
        Task::Budget {
            json,
            tree,
            r#as,
            vms,
        } => budget::run(json, tree, r#as.as_deref(), vms),
        Task::Vm => setup::run()
            .and_then(|()| vm_kit::setup())
            .and_then(|()| vm_cases()),
        Task::VmGuest { out, object, runs } => vm::guest(&out, &object, &runs),
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
    run_step(Command::new(program).args(args))
}

/// Runs `command` with inherited output, printed first with the environment it sets; fails if
/// it fails.
fn run_step(command: &mut Command) -> anyhow::Result<()> {
    let set = command
        .get_envs()
        .filter_map(|(key, value)| Some(format!("{}={}", key.display(), value?.display())));
    let words = std::iter::once(command.get_program())
        .chain(command.get_args())
        .map(|word| word.display().to_string());
    let line = set.chain(words).collect::<Vec<_>>().join(" ");
    eprintln!("xtask: $ {line}");
    let status = command
        .status()
        .with_context(|| format!("running {line}"))?;
    if !status.success() {
        bail!("{line} failed: {status}");
    }
    Ok(())
}

/// The fewest tests of a binary `cargo xtask test` runs at once (the harness's own default is
/// one a CPU), unless `RUST_TEST_THREADS` is set: the end-to-end tests wait on agents,
/// namespaces and the kernel more than they compute, and four at a time take some 40 % less
/// time than two on the 2-CPU machines (the dataplanes suite 230-250 s against 420).
const TEST_THREADS_AT_LEAST: usize = 4;

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
    // Both objects' programs: without the slot table, and with it.
    for features in ["", "slot-table"] {
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
                "--features",
                features,
                "--",
                "-D",
                "warnings",
            ],
        )?;
    }
    manifests::validate()?;
    let mut tests = Command::new("cargo");
    tests.args(["test", "--workspace"]).args(cargo_test_args);
    if std::env::var_os("RUST_TEST_THREADS").is_none() {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        tests.env(
            "RUST_TEST_THREADS",
            cpus.max(TEST_THREADS_AT_LEAST).to_string(),
        );
    }
    run_step(&mut tests)?;
    vm_cases()
}

/// Builds the test binaries the VMs run, and runs their cases on the older kernels. They are
/// built as `cargo test --workspace` built them: every library, binary and test target of the
/// workspace (`--test '*'` takes those `test = false` keeps from a plain run too). A build of
/// their targets alone resolves the proc macros' dependencies otherwise, and builds some forty
/// crates and the agent again (a minute and a half of every CI run). The agent's binary, which
/// the cases run, is built for masq-agent's own tests, which `--test '*'` takes (`--bins`
/// builds the binaries' unit tests): checked here, so that its absence fails on the host.
fn vm_cases() -> anyhow::Result<()> {
    let targets = vm::targets();
    let out = Command::new("cargo")
        .args([
            "test",
            "--workspace",
            "--no-run",
            "--message-format=json",
            "--lib",
            "--bins",
            "--test",
            "*",
        ])
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("building the end-to-end tests")?;
    if !out.status.success() {
        bail!("building the end-to-end tests failed");
    }
    let messages: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect();
    let agent_built = messages.iter().any(|message| {
        message["target"]["name"] == "masq-agent"
            && message["target"]["kind"][0] == "bin"
            && message["profile"]["test"] == false
            && message["executable"].is_string()
    });
    if !agent_built {
        bail!("the build made no masq-agent binary, which the VMs' cases run");
    }
    let binaries: Vec<(String, std::path::PathBuf)> = messages
        .iter()
        .filter_map(|message| {
            let name = message["target"]["name"].as_str()?;
            let executable = message["executable"].as_str()?;
            targets
                .contains(&name)
                .then(|| (name.to_string(), executable.into()))
        })
        .collect();
    vm::run(&binaries)
}

//! The kernels operators run, booted in qemu with the host's root shared read-only
//! (virtme-ng): Debian 12's Linux 6.1, generic and cloud, and Debian 11's 5.10 run sets of the
//! end-to-end cases of `integration/tests/` on the real programs and the real tools. This
//! machine's KVM cannot run a stock kernel, so qemu emulates the CPU: the cases run some ten
//! times slower than on the host, and each set is chosen to cover what the programs do on that
//! kernel, not everything.
//!
//! The kernels and the tools that boot them are `vm_kit`'s.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use serde::{Deserialize, Serialize};

use masq_testbed::verifier::{self, Budget};

use crate::{
    verifier_figures,
    vm_kit::{Flavour, Kernel, cargo_bin, kernel, venv_bin, vng},
};

/// What each VM may take before it is stopped and the step fails: the largest set takes about
/// two minutes on an emulated CPU, and took five to seven before the verifier's work halved.
/// (The VMs run one after another: at once, each agent's start took over 50 s, as the emulated
/// CPUs only share the machine's.)
const VM_TIMEOUT: Duration = Duration::from_secs(600);
/// How many times longer the cases' waits may last in a VM than on the host: the emulated CPU
/// runs the agent's start (the verifier's pass over the programs, above all) some ten times
/// slower, and a wait sized for the host ran out there. Five ran out too, on a day the machine
/// itself ran the whole 5.10 VM 2.4 times slower than the day before (161 s against 67): an
/// IPv6 agent that attached its programs 25 s after it started had not applied its policy 25 s
/// later.
const GUEST_SLOWDOWN: u32 = 10;
/// How many cases a VM runs at once, one per emulated CPU: a case waits on the agent's start,
/// which is the verifier's pass on one CPU, so two run in little more than the time of one
/// (the 10 cases of the generic 6.1, measured on programs the verifier took twice as long
/// over: 290 s one at a time, 160–190 s two at a time; three at a time on two cores took no
/// less).
const GUEST_WORKERS: usize = 2;

/// A test binary of `integration/tests/` and the cases of it a VM runs.
pub struct Suite {
    pub target: &'static str,
    /// None named: every case of the binary.
    pub cases: &'static [&'static str],
}

/// What a VM of each kernel runs.
impl Flavour {
    /// What it runs: the whole set on the generic 6.1; on the cloud kernel, which differs in
    /// drivers and options and not in its verifier, what loads, attaches and translates each
    /// family; on 5.10, that, and what an operator reads when the kernel refuses the programs
    /// or their maps. The three take about four minutes, of the five the VM step may.
    fn suites(self) -> &'static [Suite] {
        match self {
            Flavour::Generic61 => &[Suite {
                target: "dataplanes",
                cases: CASES,
            }],
            Flavour::Cloud61 => &[Suite {
                target: "dataplanes",
                cases: TRANSLATING_CASES,
            }],
            Flavour::Generic510 => &[
                Suite {
                    target: "dataplanes",
                    cases: TRANSLATING_CASES,
                },
                Suite {
                    target: "refused",
                    cases: &[],
                },
            ],
        }
    }
}

/// The cases of `integration/tests/dataplanes/` that run in the VMs, by their test names.
const CASES: &[&str] = &[
    // TCP, UDP and ping masqueraded with their replies; a destination that keeps its address.
    "basics::ebpf::masquerades_outside_traffic_only::ipv4",
    // The same over IPv6, with the rest of IPv6 left to the chain.
    "basics::ebpf::masquerades_outside_traffic_only::ipv6",
    // A pod's own ICMP error about a masqueraded flow, translated on its way out.
    "icmp_and_fragments::ebpf::a_pods_icmp_error_reaches_the_outside_host::ipv4",
    // The agent killed and restarted in the middle of a transfer.
    "restarts::ebpf::a_killed_agent_does_not_break_a_transfer::ipv4",
    // An ICMP error from the path about a masqueraded flow, translated on its way in.
    "icmp_and_fragments::ebpf::path_mtu_discovery_works_through_the_translation::ipv4",
    // Fragments follow their first fragment's translation, both ways.
    "icmp_and_fragments::ebpf::fragmented_datagrams_arrive_whole_both_ways::ipv4",
    // Port ownership: a node socket on a port a masqueraded flow holds.
    "kube_proxy::ebpf::a_node_socket_on_a_port_the_programs_hold::ipv4",
    // An upgrade of the pinned programs carries the flows of the older NAT table.
    "restarts::ebpf::an_upgrade_carries_the_flows_of_an_older_nat_table",
    // Where eBPF cannot run: the chain takes over, or, without the fallback, a clean refusal.
    "ebpf_lifecycle::ebpf::falls_back_to_iptables_when_ebpf_cannot_run",
    // The clsact filters of kernels without TCX: replaced in place through a restart with no
    // packet leaking, put back when removed, listed by `status`.
    "ebpf_lifecycle::ebpf::netlink_filters_are_replaced_in_place_and_put_back",
];

/// The first of `CASES`: what loads, attaches and translates each family.
const TRANSLATING_CASES: &[&str] = CASES.split_at(2).0;

/// Every test target some VM runs.
pub fn targets() -> Vec<&'static str> {
    let mut targets: Vec<&str> = Flavour::ALL
        .iter()
        .flat_map(|f| f.suites().iter().map(|s| s.target))
        .collect();
    targets.sort();
    targets.dedup();
    targets
}

/// What a guest leaves in its output directory for the host.
#[derive(Debug, Serialize, Deserialize)]
pub struct GuestReport {
    pub kernel: String,
    /// What the verifier said of each program when the guest loaded them.
    pub verifier: Vec<Budget>,
    pub verifier_error: Option<String>,
    /// Each case run.
    pub runs: Vec<CaseRun>,
    pub seconds: f64,
}

/// One case run in the guest, and what it took.
#[derive(Debug, Serialize, Deserialize)]
pub struct CaseRun {
    pub binary: String,
    pub case: String,
    pub code: Option<i32>,
    pub seconds: f64,
}

impl GuestReport {
    fn passed(&self) -> bool {
        self.runs.iter().all(|run| run.code == Some(0))
    }

    /// What each case took, slowest first: where the VM step's minutes go.
    fn timings(&self) -> String {
        let mut runs: Vec<&CaseRun> = self.runs.iter().collect();
        runs.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
        runs.iter()
            .map(|run| format!("  {:>5.1} s  {}\n", run.seconds, run.case))
            .collect()
    }
}

const REPORT: &str = "report.json";
const TEST_LOG: &str = "tests.log";

/// Boots each flavour and runs its suites on the built test binaries (`binaries`: each test
/// target's executable), one VM after the other. Fails if a VM cannot start, a case fails, or
/// the verifier refuses a program.
pub fn run(binaries: &[(String, PathBuf)]) -> anyhow::Result<()> {
    let xtask = std::env::current_exe().context("finding xtask's own binary")?;
    let object = verifier_figures::built_object()?;
    // The frames, for the stack as each kernel counts it, from the host's verbose log.
    let (host, frames) = verifier_figures::measure_here(&object)?;
    print!("{}", verifier_figures::describe(&host));
    check_cases_exist(binaries)?;
    let mut failures = Vec::new();
    for flavour in Flavour::ALL {
        let kernel = kernel(flavour)?;
        let started = Instant::now();
        let mut runs = Vec::new();
        let mut cases = 0;
        for suite in flavour.suites() {
            let (_, binary) = binaries
                .iter()
                .find(|(target, _)| target == suite.target)
                .with_context(|| format!("the {} test binary was not built", suite.target))?;
            // Named one by one, so that the guest runs them side by side: a suite that names
            // none is all of its binary's.
            let named: Vec<String> = match suite.cases {
                [] => tests_of(binary)?.into_iter().collect(),
                listed => listed.iter().map(|case| case.to_string()).collect(),
            };
            cases += named.len();
            runs.push(format!("{}={}", binary.display(), named.join(",")));
        }
        eprintln!(
            "xtask: vm: booting {} under qemu (emulated CPU) for {cases} cases",
            kernel.release
        );
        match boot(&kernel, &xtask, &object, &runs) {
            Ok(report) => {
                let figures = verifier_figures::figures(&report.kernel, &report.verifier, &frames);
                print!("{}", verifier_figures::describe(&figures));
                if let Some(err) = &report.verifier_error {
                    failures.push(format!("{}: loading the programs: {err}", kernel.release));
                }
                if figures.iter().any(|f| f.error.is_some()) {
                    failures.push(format!(
                        "{}: the verifier refused a program",
                        kernel.release
                    ));
                }
                if !report.passed() {
                    failures.push(format!("{}: end-to-end cases failed", kernel.release));
                }
                eprint!(
                    "xtask: vm: {} done in {:.0} s (in the guest {:.0} s), its cases:\n{}",
                    kernel.release,
                    started.elapsed().as_secs_f64(),
                    report.seconds,
                    report.timings()
                );
            }
            Err(err) => failures.push(format!("{}: {err:#}", kernel.release)),
        }
    }
    if !failures.is_empty() {
        bail!("in the VMs:\n  {}", failures.join("\n  "));
    }
    Ok(())
}

/// Fails when a case the VMs are to run is not a test of its binary: `--exact` with a name
/// that matches nothing runs no test and passes, so a renamed case would leave the VMs quietly.
fn check_cases_exist(binaries: &[(String, PathBuf)]) -> anyhow::Result<()> {
    for (target, binary) in binaries {
        let tests = tests_of(binary)?;
        let unknown: Vec<&str> = Flavour::ALL
            .iter()
            .flat_map(|f| f.suites())
            .filter(|suite| suite.target == target)
            .flat_map(|suite| suite.cases.iter().copied())
            .filter(|case| !tests.contains(*case))
            .collect();
        if !unknown.is_empty() {
            bail!(
                "the VMs' cases name no test of {target}: {} (renamed? update vm::CASES)",
                unknown.join(", ")
            );
        }
    }
    Ok(())
}

/// The names of the tests of a test binary.
fn tests_of(binary: &Path) -> anyhow::Result<BTreeSet<String>> {
    let listed = Command::new(binary)
        .args(["--list", "--format", "terse"])
        .output()
        .with_context(|| format!("listing the tests of {}", binary.display()))?;
    Ok(String::from_utf8_lossy(&listed.stdout)
        .lines()
        .filter_map(|line| line.strip_suffix(": test"))
        .map(str::to_string)
        .collect())
}

/// What each VM's kernel said of the programs when it loaded them, by release; no case runs.
/// An object that `needs_atomics` (BPF atomics on map values, Linux 5.12) is not loaded on a
/// kernel without them: `None`.
pub fn verifier_said(
    object: &Path,
    needs_atomics: bool,
) -> anyhow::Result<Vec<(String, Option<Vec<Budget>>)>> {
    let xtask = std::env::current_exe().context("finding xtask's own binary")?;
    let mut said = Vec::new();
    for flavour in Flavour::ALL {
        let kernel = kernel(flavour)?;
        if needs_atomics && !flavour.has_bpf_atomics() {
            said.push((kernel.release, None));
            continue;
        }
        eprintln!("xtask: vm: booting {} to load the programs", kernel.release);
        let report = boot(&kernel, &xtask, object, &[])?;
        if let Some(err) = report.verifier_error {
            bail!("{}: loading the programs: {err}", kernel.release);
        }
        said.push((report.kernel, Some(report.verifier)));
    }
    Ok(said)
}

/// Boots `kernel` with xtask's guest side as the command, and reads what it reported. `runs`:
/// `BINARY=CASE,CASE` for each suite, every case named.
fn boot(
    kernel: &Kernel,
    xtask: &Path,
    object: &Path,
    runs: &[String],
) -> anyhow::Result<GuestReport> {
    let out = masq_testbed::workspace_root()
        .join("target/vm")
        .join(&kernel.release);
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out)?;
    let mut guest = vec![
        xtask.to_string_lossy().to_string(),
        "vm-guest".into(),
        "--out".into(),
        out.to_string_lossy().to_string(),
        "--object".into(),
        object.to_string_lossy().to_string(),
    ];
    for run in runs {
        guest.extend(["--run".to_string(), run.clone()]);
    }
    // vng runs virtme-run, its sibling in the venv, by name: the venv's bin comes first.
    let path = format!(
        "{}:{}:{}",
        venv_bin().display(),
        cargo_bin().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut vm = Command::new(vng())
        .arg("--run")
        .arg(&kernel.vmlinuz)
        .args([
            "--disable-kvm",
            "--cpus",
            "2",
            "--memory",
            "2G",
            "--verbose",
        ])
        .arg(format!("--rwdir={}", out.display()))
        .arg("--exec")
        .arg(guest.join(" "))
        // virtiofsd from cargo first: the one qemu's package ships takes other arguments.
        .env("PATH", path)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(out.join("console.log"))?)
        .stderr(std::fs::File::create(out.join("vng.log"))?)
        .spawn()
        .context("starting virtme-ng")?;
    let started = Instant::now();
    let status = loop {
        if let Some(status) = vm.try_wait()? {
            break Some(status);
        }
        if started.elapsed() > VM_TIMEOUT {
            let _ = vm.kill();
            let _ = vm.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let tail = |name: &str, lines: usize| tail_of(&out.join(name), lines);
    let report: Option<GuestReport> = std::fs::read(out.join(REPORT))
        .ok()
        .and_then(|bytes| serde_json::from_slice(&bytes).ok());
    let Some(report) = report else {
        let why = match status {
            None => format!("the VM ran past {} s and was stopped", VM_TIMEOUT.as_secs()),
            Some(status) => format!("the VM ended ({status}) without a report"),
        };
        bail!(
            "{why}\n--- virtme-ng ---\n{}\n--- console ---\n{}\n--- cases ---\n{}",
            tail("vng.log", 40),
            tail("console.log", 40),
            tail(TEST_LOG, 40)
        );
    };
    if !report.passed() {
        eprintln!(
            "--- cases on {} ---\n{}",
            kernel.release,
            tail(TEST_LOG, 200)
        );
    }
    Ok(report)
}

fn tail_of(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The guest side, run by the VM as its command: loads the programs as they are, to read what
/// the verifier said of them, runs each suite (`BINARY=CASE,CASE`), and leaves the report in
/// `out` (shared read-write with the host).
pub fn guest(out: &Path, object: &Path, runs: &[String]) -> anyhow::Result<()> {
    let started = Instant::now();
    let kernel = verifier_figures::kernel_release()?;
    let cases: Vec<(&str, &str)> = runs
        .iter()
        .flat_map(|run| {
            let (binary, named) = run.split_once('=').unwrap_or((run, ""));
            named
                .split(',')
                .filter(|case| !case.is_empty())
                .map(move |case| (binary, case))
        })
        .collect();
    let next = AtomicUsize::new(0);
    let done: Mutex<Vec<(usize, anyhow::Result<CaseRun>)>> = Mutex::default();
    let loaded = std::thread::scope(|scope| {
        let loaded = scope.spawn(|| verifier::load_quick(object));
        for _ in 0..GUEST_WORKERS {
            scope.spawn(|| {
                loop {
                    let index = next.fetch_add(1, Ordering::Relaxed);
                    let Some((binary, case)) = cases.get(index) else {
                        break;
                    };
                    let run = run_case(&out.join(format!("case-{index}.log")), binary, case);
                    done.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push((index, run));
                }
            });
        }
        loaded.join()
    });
    let (said, verifier_error) = match loaded {
        Ok(Ok(said)) => (said, None),
        Ok(Err(err)) => (Vec::new(), Some(format!("{err:#}"))),
        Err(_) => (
            Vec::new(),
            Some("loading the programs panicked".to_string()),
        ),
    };
    let mut done = done.into_inner().unwrap_or_else(|e| e.into_inner());
    done.sort_by_key(|(index, _)| *index);
    // The cases' output in their order, as one run would have printed it.
    let mut log = std::fs::File::create(out.join(TEST_LOG))?;
    let mut case_runs = Vec::new();
    for (index, run) in done {
        let case_log = out.join(format!("case-{index}.log"));
        if let Ok(mut text) = std::fs::File::open(&case_log) {
            std::io::copy(&mut text, &mut log)?;
        }
        let _ = std::fs::remove_file(case_log);
        case_runs.push(run?);
    }
    let report = GuestReport {
        kernel,
        verifier: said,
        verifier_error,
        runs: case_runs,
        seconds: started.elapsed().as_secs_f64(),
    };
    std::fs::write(out.join(REPORT), serde_json::to_vec_pretty(&report)?)?;
    Ok(())
}

/// Runs one case of `binary`, its output into `log`.
fn run_case(log: &Path, binary: &str, case: &str) -> anyhow::Result<CaseRun> {
    let log = std::fs::File::create(log)?;
    let started = Instant::now();
    let status = Command::new(binary)
        .args(["--test-threads", "1", "--exact", case])
        .env(masq_testbed::SLOWDOWN_ENV, GUEST_SLOWDOWN.to_string())
        .current_dir(masq_testbed::workspace_root().join("integration"))
        .stdout(log.try_clone()?)
        .stderr(log)
        .status()
        .with_context(|| format!("running {binary}"))?;
    Ok(CaseRun {
        binary: binary.to_string(),
        case: case.to_string(),
        code: status.code(),
        seconds: started.elapsed().as_secs_f64(),
    })
}

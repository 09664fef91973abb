//! The kernels operators run, booted in qemu: Debian 12's Linux 6.1, generic and cloud, with
//! the host's root shared read-only (virtme-ng), run a set of the end-to-end cases of
//! `integration/tests/dataplanes.rs` on the real programs and the real tools. This machine's
//! KVM cannot run a stock kernel, so qemu emulates the CPU: the cases run some ten times slower
//! than on the host, and the set is chosen to cover what the programs do, not everything.
//!
//! The kernels come from Debian's archive (`apt-get download`, unpacked with `dpkg-deb -x`,
//! never installed into /boot) and are kept in a cache directory across runs.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use serde::{Deserialize, Serialize};

use masq_testbed::verifier::{self, Budget};

use crate::budget;

/// virtme-ng, which boots a kernel on a copy-on-write view of this machine's root.
const VIRTME_NG: &str = "virtme-ng==1.42";
/// The cloud kernel has no 9p: the root is shared over virtio-fs, served by this.
const VIRTIOFSD_VERSION: &str = "1.14.0";
/// What each VM may take before it is stopped and the step fails.
const VM_TIMEOUT: Duration = Duration::from_secs(420);

/// A Debian 12 kernel flavour the step boots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavour {
    Generic,
    Cloud,
}

impl Flavour {
    const ALL: [Flavour; 2] = [Flavour::Generic, Flavour::Cloud];

    /// The tail of the package name and of the release: `6.1.0-50-<suffix>`.
    fn suffix(self) -> &'static str {
        match self {
            Flavour::Generic => "amd64",
            Flavour::Cloud => "cloud-amd64",
        }
    }

    fn package(self, abi: u32) -> String {
        format!("linux-image-6.1.0-{abi}-{}-unsigned", self.suffix())
    }

    /// The cases it runs: the whole set on the generic kernel; on the cloud kernel, which
    /// differs in its drivers and options and not in its verifier, the ones that load, attach
    /// and translate each family, and the restart.
    fn cases(self) -> &'static [&'static str] {
        match self {
            Flavour::Generic => CASES,
            Flavour::Cloud => &CASES[..4],
        }
    }
}

/// The cases of `integration/tests/dataplanes.rs` that run in the VMs, by their test names.
const CASES: &[&str] = &[
    // TCP, UDP and ping masqueraded with their replies; a destination that keeps its address.
    "ebpf::masquerades_outside_traffic_only",
    // The same over IPv6, with the rest of IPv6 left to the chain.
    "ebpf::ipv6_masquerades_outside_traffic_only",
    // A pod's own ICMP error about a masqueraded flow, translated on its way out.
    "ebpf::a_pods_icmp_error_reaches_the_outside_host::ipv4",
    // The agent killed and restarted in the middle of a transfer.
    "ebpf::a_killed_agent_does_not_break_a_transfer",
    // An ICMP error from the path about a masqueraded flow, translated on its way in.
    "ebpf::path_mtu_discovery_works_through_the_translation",
    // Fragments follow their first fragment's translation, both ways.
    "ebpf::fragmented_datagrams_arrive_whole_both_ways",
    // Port ownership: a node socket on a port a masqueraded flow holds.
    "ebpf::a_node_socket_on_a_port_the_programs_hold::ipv4",
    // An upgrade of the pinned programs carries the flows of the older NAT table.
    "ebpf::an_upgrade_carries_the_flows_of_an_older_nat_table",
    // Where eBPF cannot run: the chain takes over, or, without the fallback, a clean refusal.
    "ebpf::falls_back_to_iptables_when_ebpf_cannot_run",
];

/// What a guest leaves in its output directory for the host.
#[derive(Debug, Serialize, Deserialize)]
pub struct GuestReport {
    pub kernel: String,
    /// What the verifier said of each program when the guest loaded them.
    pub verifier: Vec<Budget>,
    pub verifier_error: Option<String>,
    /// The test binary's exit code.
    pub tests_exit_code: Option<i32>,
    pub seconds: f64,
}

const REPORT: &str = "report.json";
const TEST_LOG: &str = "tests.log";

/// The cache of unpacked kernels and of virtme-ng's environment, kept across runs and
/// checkouts.
fn cache_dir() -> PathBuf {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(|| PathBuf::from("/var/cache"));
    base.join("masq-agent")
}

fn vng() -> PathBuf {
    cache_dir().join("virtme-ng/bin/vng")
}

fn cargo_bin() -> PathBuf {
    std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .unwrap_or_default()
        .join("bin")
}

/// Installs what the VM step needs, where missing: virtme-ng in a venv of its own, virtiofsd,
/// and the kernels. The Debian packages (qemu, kmod, busybox) come with the others.
pub fn setup() -> anyhow::Result<()> {
    if !vng().exists() {
        let venv = cache_dir().join("virtme-ng");
        eprintln!("xtask: setup: installing {VIRTME_NG} in {}", venv.display());
        crate::step("python3", &["-m", "venv", &venv.to_string_lossy()])?;
        let pip = venv.join("bin/pip");
        crate::step(
            &pip.to_string_lossy(),
            &[
                "install",
                "--quiet",
                "--disable-pip-version-check",
                VIRTME_NG,
            ],
        )?;
    }
    let installed = Command::new(cargo_bin().join("virtiofsd"))
        .arg("--version")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(VIRTIOFSD_VERSION));
    if !installed {
        eprintln!("xtask: setup: building virtiofsd {VIRTIOFSD_VERSION} (about two minutes)");
        crate::step(
            "cargo",
            &[
                "install",
                "--quiet",
                "--locked",
                "virtiofsd",
                "--version",
                VIRTIOFSD_VERSION,
            ],
        )?;
    }
    for flavour in Flavour::ALL {
        kernel(flavour)?;
    }
    eprintln!("xtask: setup: virtme-ng, virtiofsd and the 6.1 kernels present");
    Ok(())
}

/// A kernel unpacked in the cache: its image and its release (`uname -r`).
pub struct Kernel {
    pub flavour: Flavour,
    pub vmlinuz: PathBuf,
    pub release: String,
}

/// The flavour's kernel, unpacked in the cache: the one already there, or the newest 6.1 ABI
/// the archive has, downloaded.
fn kernel(flavour: Flavour) -> anyhow::Result<Kernel> {
    let dir = cache_dir().join("kernels");
    if let Some(kernel) = cached_kernel(&dir, flavour) {
        return Ok(kernel);
    }
    let abi = newest_abi()?;
    let package = flavour.package(abi);
    std::fs::create_dir_all(&dir)?;
    eprintln!("xtask: setup: downloading {package}");
    let download = dir.join("download");
    let _ = std::fs::remove_dir_all(&download);
    std::fs::create_dir_all(&download)?;
    let out = Command::new("apt-get")
        .args(["download", "-qq", &package])
        .current_dir(&download)
        .output()
        .context("running apt-get download")?;
    if !out.status.success() {
        bail!(
            "apt-get download {package} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let deb = std::fs::read_dir(&download)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .with_context(|| format!("apt-get download left no .deb for {package}"))?;
    let unpacking = dir.join(format!("{package}.partial"));
    let _ = std::fs::remove_dir_all(&unpacking);
    crate::step(
        "dpkg-deb",
        &["-x", &deb.to_string_lossy(), &unpacking.to_string_lossy()],
    )?;
    std::fs::rename(&unpacking, dir.join(&package))?;
    let _ = std::fs::remove_dir_all(&download);
    cached_kernel(&dir, flavour).with_context(|| format!("{package} holds no kernel image"))
}

fn cached_kernel(dir: &Path, flavour: Flavour) -> Option<Kernel> {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_string_lossy().to_string();
            let abi = name
                .strip_prefix("linux-image-6.1.0-")?
                .strip_suffix(&format!("-{}-unsigned", flavour.suffix()))?
                .parse()
                .ok()?;
            Some((abi, entry.path()))
        })
        .collect();
    found.sort();
    let (abi, path) = found.pop()?;
    let release = format!("6.1.0-{abi}-{}", flavour.suffix());
    let vmlinuz = path.join(format!("boot/vmlinuz-{release}"));
    vmlinuz.exists().then_some(Kernel {
        flavour,
        vmlinuz,
        release,
    })
}

/// The newest 6.1 ABI that the archive has in both flavours; the package lists are refreshed
/// once if they have none.
fn newest_abi() -> anyhow::Result<u32> {
    for refreshed in [false, true] {
        if refreshed {
            crate::step("apt-get", &["update", "-qq"])?;
        }
        let list = |flavour: Flavour| -> anyhow::Result<Vec<u32>> {
            let pattern = format!(
                r"^linux-image-6\.1\.0-[0-9]+-{}-unsigned$",
                flavour.suffix()
            );
            let out = Command::new("apt-cache")
                .args(["search", "--names-only", &pattern])
                .output()
                .context("running apt-cache")?;
            Ok(String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter_map(|l| {
                    l.split_whitespace()
                        .next()?
                        .strip_prefix("linux-image-6.1.0-")?
                        .split('-')
                        .next()?
                        .parse()
                        .ok()
                })
                .collect())
        };
        let cloud = list(Flavour::Cloud)?;
        if let Some(abi) = list(Flavour::Generic)?
            .into_iter()
            .filter(|abi| cloud.contains(abi))
            .max()
        {
            return Ok(abi);
        }
    }
    bail!("the package archive has no Debian 12 6.1 kernel (linux-image-6.1.0-N-amd64-unsigned)")
}

/// Boots each flavour and runs its cases on `test_binary` (the built `dataplanes` test), one VM
/// after the other. Fails if a VM cannot start, a case fails, or the verifier rejects a program.
pub fn run(test_binary: &Path) -> anyhow::Result<()> {
    let xtask = std::env::current_exe().context("finding xtask's own binary")?;
    let object = budget::built_object()?;
    // The frames, for the stack as each kernel counts it, from the host's verbose log.
    let (host, frames) = budget::measure_here(&object)?;
    print!("{}", budget::describe(&host));
    let mut failures = Vec::new();
    for flavour in Flavour::ALL {
        let kernel = kernel(flavour)?;
        let started = Instant::now();
        eprintln!(
            "xtask: vm: booting {} under qemu (emulated CPU) for {} cases",
            kernel.release,
            flavour.cases().len()
        );
        match boot(&kernel, &xtask, test_binary, &object) {
            Ok(report) => {
                let figures = budget::figures(&report.kernel, &report.verifier, &frames);
                print!("{}", budget::describe(&figures));
                if let Some(err) = &report.verifier_error {
                    failures.push(format!("{}: loading the programs: {err}", kernel.release));
                }
                if figures.iter().any(|f| f.error.is_some()) {
                    failures.push(format!(
                        "{}: the verifier rejected a program",
                        kernel.release
                    ));
                }
                if report.tests_exit_code != Some(0) {
                    failures.push(format!("{}: end-to-end cases failed", kernel.release));
                }
                eprintln!(
                    "xtask: vm: {} done in {:.0} s (cases {:.0} s)",
                    kernel.release,
                    started.elapsed().as_secs_f64(),
                    report.seconds
                );
            }
            Err(err) => failures.push(format!("{}: {err:#}", kernel.release)),
        }
    }
    if !failures.is_empty() {
        bail!("on Linux 6.1:\n  {}", failures.join("\n  "));
    }
    Ok(())
}

/// Boots `kernel` with xtask's guest side as the command, and reads what it reported.
fn boot(
    kernel: &Kernel,
    xtask: &Path,
    test_binary: &Path,
    object: &Path,
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
        "--test-binary".into(),
        test_binary.to_string_lossy().to_string(),
        "--object".into(),
        object.to_string_lossy().to_string(),
    ];
    guest.extend(kernel.flavour.cases().iter().map(|c| c.to_string()));
    let console = out.join("console.log");
    let path = format!(
        "{}:{}",
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
        .stdout(std::fs::File::create(&console)?)
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
    let tail = |name: &str| tail_of(&out.join(name), 40);
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
            tail("vng.log"),
            tail("console.log"),
            tail(TEST_LOG)
        );
    };
    if report.tests_exit_code != Some(0) {
        eprintln!(
            "--- cases on {} ---\n{}",
            kernel.release,
            tail_of(&out.join(TEST_LOG), 200)
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
/// the verifier said of them, runs the cases, and leaves the report in `out` (shared
/// read-write with the host).
pub fn guest(
    out: &Path,
    test_binary: &Path,
    object: &Path,
    cases: &[String],
) -> anyhow::Result<()> {
    let started = Instant::now();
    let kernel = budget::kernel_release()?;
    let (said, verifier_error) = match verifier::load_quick(object) {
        Ok(said) => (said, None),
        Err(err) => (Vec::new(), Some(format!("{err:#}"))),
    };
    let log = std::fs::File::create(out.join(TEST_LOG))?;
    let status = Command::new(test_binary)
        .args(["--exact", "--test-threads", "1"])
        .args(cases)
        .current_dir(masq_testbed::workspace_root().join("integration"))
        .stdout(log.try_clone()?)
        .stderr(log)
        .status()
        .with_context(|| format!("running {}", test_binary.display()))?;
    let report = GuestReport {
        kernel,
        verifier: said,
        verifier_error,
        tests_exit_code: status.code(),
        seconds: started.elapsed().as_secs_f64(),
    };
    std::fs::write(out.join(REPORT), serde_json::to_vec_pretty(&report)?)?;
    Ok(())
}

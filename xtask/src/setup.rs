//! Installs what the build and the tests need, idempotently: each check is cheap, and only what
//! is missing gets installed.

use std::process::Command;

use anyhow::{Context as _, bail};

use masq_testbed::netns;

use crate::step;

/// Debian packages: LLVM 22 for bpf-linker, the networking tools the tests drive (curl for the
/// docs' commands), and Python's venv for the manifest validator.
const APT_PACKAGES: &[&str] = &[
    "llvm-22-dev",
    "libpolly-22-dev",
    "zlib1g-dev",
    "libzstd-dev",
    "iproute2",
    "iptables",
    "ipset",
    "bpftool",
    "ethtool",
    "tcpdump",
    "conntrack",
    "curl",
    "iputils-ping",
    "procps",
    "util-linux",
    "python3",
    "python3-venv",
    // The older kernels booted by the test command's last step: qemu, what virtme-ng builds
    // their initramfs with, and xz for the archive's package index.
    "qemu-system-x86",
    "kmod",
    "busybox-static",
    "xz-utils",
    // virtiofsd, built by `cargo install` for the cloud kernel, links against these two.
    "libseccomp-dev",
    "libcap-ng-dev",
];
const NIGHTLY: &str = "nightly";
/// Pinned, and built against the LLVM that matches nightly's rustc (LLVM 22).
const BPF_LINKER_VERSION: &str = "0.13.0";

pub fn run() -> anyhow::Result<()> {
    apt_packages()?;
    toolchain_components()?;
    bpf_linker()?;
    crate::kube_tools::ensure()?;
    eprintln!("xtask: setup: all prerequisites present");
    Ok(())
}

fn apt_packages() -> anyhow::Result<()> {
    let missing: Vec<&str> = APT_PACKAGES
        .iter()
        .copied()
        .filter(|p| !dpkg_installed(p))
        .collect();
    if missing.is_empty() {
        eprintln!("xtask: setup: apt packages present");
        return Ok(());
    }
    eprintln!("xtask: setup: installing {}", missing.join(" "));
    let update = Command::new("apt-get")
        .args(["update", "-qq"])
        .output()
        .context("running apt-get update")?;
    if !update.status.success() {
        bail!(
            "apt-get update failed: {}",
            String::from_utf8_lossy(&update.stderr)
        );
    }
    let mut args = vec!["install", "-y", "-qq", "--no-install-recommends"];
    args.extend(&missing);
    // apt's progress output is long; show it only when the install fails.
    let out = Command::new("apt-get")
        .args(&args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .output()
        .context("running apt-get")?;
    if !out.status.success() {
        bail!(
            "apt-get install {} failed:\n{}{}",
            missing.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

fn dpkg_installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
}

fn toolchain_components() -> anyhow::Result<()> {
    let toolchains = netns::run("rustup", &["toolchain", "list"])?;
    if !toolchains.lines().any(|l| l.starts_with(NIGHTLY)) {
        eprintln!("xtask: setup: installing the {NIGHTLY} toolchain");
        step(
            "rustup",
            &["toolchain", "install", NIGHTLY, "--profile", "minimal"],
        )?;
    }
    // rust-src builds core for the BPF target; clippy lints the eBPF crate there.
    components(NIGHTLY, &["rust-src", "clippy"])?;
    // The default toolchain formats and lints everything else.
    components("stable", &["rustfmt", "clippy"])
}

/// Adds whichever of `wanted` the toolchain lacks.
fn components(toolchain: &str, wanted: &[&str]) -> anyhow::Result<()> {
    let installed = netns::run(
        "rustup",
        &["component", "list", "--installed", "--toolchain", toolchain],
    )?;
    for component in wanted {
        if installed.lines().any(|l| l.starts_with(component)) {
            continue;
        }
        eprintln!("xtask: setup: adding {component} to {toolchain}");
        step(
            "rustup",
            &["component", "add", component, "--toolchain", toolchain],
        )?;
    }
    eprintln!("xtask: setup: {toolchain} has {}", wanted.join(", "));
    Ok(())
}

fn bpf_linker() -> anyhow::Result<()> {
    if let Ok(version) = netns::run("bpf-linker", &["--version"])
        && version.contains(BPF_LINKER_VERSION)
    {
        eprintln!("xtask: setup: bpf-linker {BPF_LINKER_VERSION} present");
        return Ok(());
    }
    eprintln!(
        "xtask: setup: building bpf-linker {BPF_LINKER_VERSION} against LLVM 22 (about a minute)"
    );
    let status = Command::new("cargo")
        .args([
            "install",
            "bpf-linker",
            "--version",
            BPF_LINKER_VERSION,
            "--locked",
            "--no-default-features",
            "--features",
            "llvm-22",
        ])
        .env("LLVM_PREFIX", "/usr/lib/llvm-22")
        .status()
        .context("running cargo install")?;
    if !status.success() {
        bail!("cargo install bpf-linker failed");
    }
    Ok(())
}

//! Running commands and threads inside network namespaces.

use std::{
    fs::File,
    os::fd::AsRawFd as _,
    process::{Command, Output},
};

use anyhow::{Context as _, bail};

/// Runs a command to completion; fails with what it printed if it exits non-zero (some tools,
/// `helm lint` among them, say what is wrong on stdout).
pub fn run(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program}"))?;
    check(program, args, out)
}

fn check(program: &str, args: &[&str], out: Output) -> anyhow::Result<String> {
    if !out.status.success() {
        bail!(
            "{program} {} failed ({}): {}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A command that runs inside namespace `ns` without `ip netns exec`, which would remount /sys
/// and hide bpffs.
pub fn command_in(ns: &str, program: &str) -> Command {
    let mut cmd = Command::new("nsenter");
    cmd.arg(format!("--net=/run/netns/{ns}"))
        .arg("--")
        .arg(program);
    cmd
}

/// Runs a command inside namespace `ns` to completion.
pub fn run_in(ns: &str, program: &str, args: &[&str]) -> anyhow::Result<String> {
    let out = command_in(ns, program)
        .args(args)
        .output()
        .with_context(|| format!("running {program} in {ns}"))?;
    check(program, args, out)
}

/// Moves the calling thread into namespace `ns`. Sockets it opens afterwards live there.
pub fn enter(ns: &str) -> anyhow::Result<()> {
    let file = File::open(format!("/run/netns/{ns}")).with_context(|| format!("netns {ns}"))?;
    // SAFETY: setns on a valid fd affects only the calling thread's network namespace.
    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        bail!("setns({ns}): {}", std::io::Error::last_os_error());
    }
    Ok(())
}

/// Runs `f` on a fresh thread inside namespace `ns` and returns its result.
pub fn within<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> anyhow::Result<T> + Send + 'static,
) -> anyhow::Result<T> {
    let ns = ns.to_string();
    std::thread::spawn(move || {
        enter(&ns)?;
        f()
    })
    .join()
    .map_err(|_| anyhow::anyhow!("thread in {ns} panicked", ns = "netns"))?
}

pub fn is_process_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

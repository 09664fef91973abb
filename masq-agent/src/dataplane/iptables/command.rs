//! Running the iptables binaries: one family's iptables, always waiting for the xtables lock,
//! and what the installed version can do.

use std::process::{Command, Stdio};

use anyhow::{Context as _, bail};

use crate::policy::IpFamily;

/// Seconds to wait for the xtables lock, as upstream does.
const XTABLES_WAIT_SECS: &str = "5";
/// What the installed iptables can do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// `--random-fully` needs iptables >= 1.6.2.
    pub random_fully: bool,
}

impl Capabilities {
    /// Probes `iptables --version`. Without iptables we assume a modern one, so that
    /// `render-iptables` still shows what a current node would get.
    pub fn detect(family: IpFamily) -> Capabilities {
        let version = Command::new(binary(family))
            .arg("--version")
            .output()
            .ok()
            .and_then(|out| parse_version(&String::from_utf8_lossy(&out.stdout)));
        Capabilities {
            random_fully: version.is_none_or(|v| v >= (1, 6, 2)),
        }
    }
}

/// Parses `iptables v1.8.9 (nf_tables)` into `(1, 8, 9)`.
pub(super) fn parse_version(text: &str) -> Option<(u32, u32, u32)> {
    let v = text.split_whitespace().find_map(|w| w.strip_prefix('v'))?;
    let mut parts = v.split('.').map(|p| p.parse::<u32>().ok());
    Some((
        parts.next()??,
        parts.next()??,
        parts.next().flatten().unwrap_or(0),
    ))
}

/// The iptables binary of `family`, as commands and messages name it.
pub(in crate::dataplane) fn binary(family: IpFamily) -> &'static str {
    match family {
        IpFamily::Ipv4 => "iptables",
        IpFamily::Ipv6 => "ip6tables",
    }
}

fn restore_binary(family: IpFamily) -> &'static str {
    match family {
        IpFamily::Ipv4 => "iptables-restore",
        IpFamily::Ipv6 => "ip6tables-restore",
    }
}

/// Runs `program args...` with `input` on its standard input (iptables-restore, ipset restore);
/// fails with what the program said on stderr.
pub(super) fn run_with_input(program: &str, args: &[&str], input: &str) -> anyhow::Result<()> {
    use std::{
        io::Write as _,
        process::{Command, Stdio},
    };

    use anyhow::Context as _;

    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {program}"))?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(input.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        anyhow::bail!(
            "{program} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Runs iptables for one family, always waiting for the xtables lock.
pub(super) struct Iptables {
    pub(super) family: IpFamily,
}

impl Iptables {
    fn run(&self, args: &[&str]) -> anyhow::Result<String> {
        let bin = binary(self.family);
        let out = Command::new(bin)
            .args(["-w", XTABLES_WAIT_SECS])
            .args(args)
            .output()
            .with_context(|| format!("running {bin}"))?;
        if !out.status.success() {
            bail!(
                "{bin} {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `true` when the command succeeds, `false` when iptables says no; used for `-C`. A
    /// resource problem (iptables' exit code 4: not root, no nat table) is an error, not a no.
    fn check(&self, args: &[&str]) -> anyhow::Result<bool> {
        const RESOURCE_PROBLEM: i32 = 4;
        let bin = binary(self.family);
        let out = Command::new(bin)
            .args(["-w", XTABLES_WAIT_SECS])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running {bin}"))?;
        if out.status.code() == Some(RESOURCE_PROBLEM) {
            bail!(
                "{bin} {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(out.status.success())
    }

    pub(super) fn restore(&self, input: &str) -> anyhow::Result<()> {
        run_with_input(
            restore_binary(self.family),
            &["--noflush", "-w", XTABLES_WAIT_SECS],
            input,
        )
    }

    fn jump_args<'a>(op: &'a str, jump: &'a [String]) -> Vec<&'a str> {
        let mut args = vec!["-t", "nat", op, "POSTROUTING"];
        args.extend(jump.iter().map(String::as_str));
        args
    }

    pub(super) fn jump_present(&self, chain: &str) -> anyhow::Result<bool> {
        self.check(&Self::jump_args("-C", &jump_rule(chain)))
    }

    pub(super) fn ensure_jump(&self, chain: &str) -> anyhow::Result<()> {
        if !self.jump_present(chain)? {
            self.run(&Self::jump_args("-A", &jump_rule(chain)))?;
        }
        Ok(())
    }

    /// The chain as iptables lists it, or `None` if it does not exist.
    pub(super) fn list_chain(&self, chain: &str) -> anyhow::Result<Option<String>> {
        if !self.check(&["-t", "nat", "-S", chain])? {
            return Ok(None);
        }
        self.run(&["-t", "nat", "-S", chain]).map(Some)
    }

    /// Removes the chain and every jump to it; says whether the chain was there.
    pub(super) fn remove(&self, chain: &str) -> anyhow::Result<bool> {
        let jump = jump_rule(chain);
        // `-D` removes one copy per call; a bounded loop also removes duplicates others added.
        let mut jumps = 0;
        for _ in 0..64 {
            if !self.check(&Self::jump_args("-D", &jump))? {
                break;
            }
            jumps += 1;
        }
        let present = self.list_chain(chain)?.is_some();
        if present {
            self.run(&["-t", "nat", "-F", chain])?;
            self.run(&["-t", "nat", "-X", chain])?;
        }
        Ok(present || jumps > 0)
    }
}

/// The rule that sends non-local traffic from POSTROUTING into our chain, as argv words.
pub fn jump_rule(chain: &str) -> Vec<String> {
    let comment = format!(
        "ip-masq-agent: ensure nat POSTROUTING directs all non-LOCAL destination traffic to our custom {chain} chain"
    );
    [
        "-m",
        "comment",
        "--comment",
        &comment,
        "-m",
        "addrtype",
        "!",
        "--dst-type",
        "LOCAL",
        "-j",
        chain,
    ]
    .map(String::from)
    .to_vec()
}

/// Families whose iptables is installed on this node.
pub(super) fn available_families() -> Vec<IpFamily> {
    [IpFamily::Ipv4, IpFamily::Ipv6]
        .into_iter()
        .filter(|f| Command::new(binary(*f)).arg("--version").output().is_ok())
        .collect()
}

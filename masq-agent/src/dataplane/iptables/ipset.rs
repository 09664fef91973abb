//! The non-masquerade CIDRs as an ipset (`hash:net`), for the chain that stands beside the eBPF
//! programs: one rule then matches any number of prefixes, and reading the chain back (which
//! costs seconds for a chain of 100 000 rules) stays cheap.

use std::{fmt::Write as _, process::Command};

use anyhow::{Context as _, bail};
use ipnet::IpNet;

use crate::policy::IpFamily;

/// What marks an entry whose prefix is not to match: a longer prefix inside a shorter one that
/// does.
pub const NOMATCH: &str = "nomatch";

/// `<chain>-v4` or `<chain>-v6`: within ipset's 31 characters, as chain names have at most 28.
pub fn name(chain: &str, family: IpFamily) -> String {
    match family {
        IpFamily::Ipv4 => format!("{chain}-v4"),
        IpFamily::Ipv6 => format!("{chain}-v6"),
    }
}

/// `<chain>-s4` or `<chain>-s6`: the sources the chain leaves alone, by the longest prefix.
pub fn source_name(chain: &str, family: IpFamily) -> String {
    match family {
        IpFamily::Ipv4 => format!("{chain}-s4"),
        IpFamily::Ipv6 => format!("{chain}-s6"),
    }
}

/// One entry of a set: a prefix, and whether it is a `nomatch` one. Ordered by prefix, so that
/// two sorted sets are compared in one walk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Member {
    pub net: IpNet,
    pub nomatch: bool,
}

impl std::fmt::Display for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.nomatch {
            true => write!(f, "{} {NOMATCH}", self.net),
            false => write!(f, "{}", self.net),
        }
    }
}

/// Makes the set hold exactly `members`, atomically: a new set is filled, then swapped in.
pub fn sync(name: &str, family: IpFamily, members: &[Member]) -> anyhow::Result<()> {
    let family = match family {
        IpFamily::Ipv4 => "inet",
        IpFamily::Ipv6 => "inet6",
    };
    let maxelem = (members.len() * 2).max(65_536);
    let tmp = format!("{}-", &name[..name.len().min(30)]);
    // A leftover from an interrupted sync would clash with the new one's parameters.
    let _ = Command::new("ipset").args(["destroy", &tmp]).output();
    let mut input = format!("create {tmp} hash:net family {family} maxelem {maxelem}\n");
    for member in members {
        let _ = writeln!(input, "add {tmp} {member} -exist");
    }
    // The live set keeps whatever size it was made with: swapping only needs the same type.
    if len(name)?.is_none() {
        let _ = writeln!(
            input,
            "create {name} hash:net family {family} maxelem {maxelem}"
        );
    }
    let _ = writeln!(input, "swap {tmp} {name}\ndestroy {tmp}");
    super::command::run_with_input("ipset", &["restore"], &input)
}

/// Makes the set, which holds `installed`, hold `members` (both sorted), by their difference:
/// filling a set of 100 000 prefixes anew takes a tenth of a second, one change a
/// millisecond. New entries, and those whose `nomatch` changes (`-exist` re-adds them with the
/// new flag), go before any removal, as the policy trie's writes do, so that a prefix that
/// stays is never missing.
pub fn update<'a>(
    name: &str,
    installed: &'a [Member],
    members: &'a [Member],
) -> anyhow::Result<()> {
    let (mut adds, mut dels) = (String::new(), String::new());
    let by_net = |members: &'a [Member]| members.iter().map(|m| (m.net, m.nomatch));
    crate::dataplane::sorted::walk_sorted(
        by_net(installed),
        by_net(members),
        |net, old, new| match (old, new) {
            (Some(was), Some(is)) if was == is => {}
            (_, Some(nomatch)) => {
                let _ = writeln!(adds, "add {name} {} -exist", Member { net, nomatch });
            }
            (_, None) => {
                let _ = writeln!(dels, "del {name} {net} -exist");
            }
        },
    );
    adds.push_str(&dels);
    if adds.is_empty() {
        return Ok(());
    }
    super::command::run_with_input("ipset", &["restore"], &adds)
}

/// How many entries the set holds, or `None` if it does not exist.
pub fn len(name: &str) -> anyhow::Result<Option<usize>> {
    let out = Command::new("ipset")
        .args(["list", "-terse", name])
        .output()
        .context("running ipset")?;
    if !out.status.success() {
        return Ok(None);
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("Number of entries:"))
        .and_then(|n| n.trim().parse().ok()))
}

/// Whether `addr` matches the set as the kernel matches it: by the longest prefix that holds
/// it, a `nomatch` entry not matching.
pub fn contains(name: &str, addr: std::net::IpAddr) -> anyhow::Result<bool> {
    let out = Command::new("ipset")
        .args(["test", name, &addr.to_string()])
        .output()
        .context("running ipset")?;
    let said = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        return Ok(true);
    }
    if said.contains("is NOT in set") {
        return Ok(false);
    }
    bail!("ipset test {name} {addr}: {}", said.trim())
}

/// The set's members, sorted.
pub fn members(name: &str) -> anyhow::Result<Vec<String>> {
    let out = Command::new("ipset")
        .args(["list", name])
        .output()
        .context("running ipset")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut members: Vec<String> = text
        .lines()
        .skip_while(|l| !l.starts_with("Members:"))
        .skip(1)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect();
    members.sort();
    Ok(members)
}

/// Removes the set if it exists.
pub fn destroy(name: &str) -> anyhow::Result<()> {
    if len(name)?.is_some() {
        let out = Command::new("ipset").args(["destroy", name]).output()?;
        if !out.status.success() {
            bail!(
                "ipset destroy {name}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
    }
    Ok(())
}

//! The capabilities the agent needs, checked before it starts, so that a container given too
//! few says which one it lacks instead of failing deep inside a system call with EPERM. The
//! DaemonSet grants exactly these (deploy/daemonset.yaml); a test runs the agent with only the
//! manifest's set, and with each one removed.

use std::fmt;

/// A Linux capability the agent uses, by its number in `linux/capability.h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capability {
    /// tc (TCX links and clsact filters), iptables' and ipset's netlink, conntrack dumps.
    NetAdmin = 12,
    /// The raw sockets iptables-legacy and ipset open.
    NetRaw = 13,
    /// Everything below, on kernels before 5.8; the agent never needs it on later ones, where
    /// only mounting a missing BPF filesystem would (the DaemonSet's init container does that).
    SysAdmin = 21,
    /// Loading programs that read packets and the kernel's clock (kernels from 5.8).
    Perfmon = 38,
    /// Creating maps and loading programs (kernels from 5.8).
    Bpf = 39,
}

impl Capability {
    /// The name the container runtime and `capsh` know it by.
    pub fn name(self) -> &'static str {
        match self {
            Capability::NetAdmin => "CAP_NET_ADMIN",
            Capability::NetRaw => "CAP_NET_RAW",
            Capability::SysAdmin => "CAP_SYS_ADMIN",
            Capability::Perfmon => "CAP_PERFMON",
            Capability::Bpf => "CAP_BPF",
        }
    }
}

impl fmt::Display for Capability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What every data plane needs: iptables, ip6tables and ipset.
pub const FOR_THE_CHAIN: [Capability; 2] = [Capability::NetAdmin, Capability::NetRaw];
/// What the eBPF data plane needs beyond the chain's (or CAP_SYS_ADMIN in their place).
pub const FOR_THE_PROGRAMS: [Capability; 2] = [Capability::Bpf, Capability::Perfmon];

/// The process's effective capabilities, as the kernel reports them.
#[derive(Debug, Clone, Copy)]
pub struct Effective(u64);

impl Effective {
    pub fn of_this_process() -> anyhow::Result<Effective> {
        let status = std::fs::read_to_string("/proc/self/status")?;
        Effective::from_status(&status)
    }

    /// From the text of `/proc/PID/status`, whose `CapEff` line is the mask in hex.
    pub fn from_status(status: &str) -> anyhow::Result<Effective> {
        let hex = status
            .lines()
            .find_map(|line| line.strip_prefix("CapEff:"))
            .ok_or_else(|| anyhow::anyhow!("no CapEff line in /proc/self/status"))?;
        Ok(Effective(u64::from_str_radix(hex.trim(), 16)?))
    }

    pub fn has(self, capability: Capability) -> bool {
        self.0 & (1 << capability as u64) != 0
    }

    /// Those of `needed` the process lacks.
    pub fn missing(self, needed: &[Capability]) -> Vec<Capability> {
        needed.iter().copied().filter(|c| !self.has(*c)).collect()
    }

    /// Those of `FOR_THE_PROGRAMS` the process lacks; none where it has CAP_SYS_ADMIN, which
    /// stands for them all.
    pub fn missing_for_the_programs(self) -> Vec<Capability> {
        if self.has(Capability::SysAdmin) {
            return Vec::new();
        }
        self.missing(&FOR_THE_PROGRAMS)
    }
}

/// `missing` as a list for a message: "CAP_BPF and CAP_PERFMON".
pub fn listed(missing: &[Capability]) -> String {
    let names: Vec<&str> = missing.iter().map(|c| c.name()).collect();
    match names.split_last() {
        Some((last, [])) => last.to_string(),
        Some((last, rest)) => format!("{} and {last}", rest.join(", ")),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A container given BPF, PERFMON, NET_ADMIN and NET_RAW, as `capsh --decode` reads it.
    const MANIFEST_S: &str = "Name:\tmasq-agent\nCapInh:\t0000000000000000\n\
                              CapEff:\t000000c000003000\nCapBnd:\t000000c000003000\n";

    #[test]
    fn reads_the_effective_set_and_names_what_is_missing() {
        let caps = Effective::from_status(MANIFEST_S).unwrap();
        assert!(caps.missing(&FOR_THE_CHAIN).is_empty());
        assert!(caps.missing_for_the_programs().is_empty());
        assert!(!caps.has(Capability::SysAdmin));

        let without_bpf = Effective::from_status("CapEff:\t0000004000003000\n").unwrap();
        assert_eq!(without_bpf.missing_for_the_programs(), [Capability::Bpf]);
        let only_sys_admin = Effective::from_status("CapEff:\t0000000000203000\n").unwrap();
        assert!(only_sys_admin.missing_for_the_programs().is_empty());
        let none = Effective::from_status("CapEff:\t0000000000000000\n").unwrap();
        assert_eq!(
            listed(&none.missing(&FOR_THE_CHAIN)),
            "CAP_NET_ADMIN and CAP_NET_RAW"
        );
        assert!(Effective::from_status("Name:\tx\n").is_err());
    }
}

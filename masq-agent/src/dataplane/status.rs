//! What is installed, read back from the kernel whichever data plane installed it: for the
//! running agent's own `status`, and for `masq-agent status` in another process.

use serde::Serialize;

use super::{
    coverage,
    ebpf::status::{EbpfStatus, read_status},
    iptables::readback::{ChainStatus, read_chains},
    mode::Mode,
    state,
};
use crate::netdev;

/// What is installed, as read back from the kernel.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    /// `None` when nothing is installed.
    pub mode: Option<Mode>,
    /// Why the running agent uses this mode, when it fell back.
    pub mode_reason: Option<String>,
    pub chains: Vec<ChainStatus>,
    pub ebpf: Option<EbpfStatus>,
    /// What masquerades what leaves each device of the node, loopback aside.
    pub devices: Vec<coverage::DeviceCoverage>,
    /// While another data plane is in force, the flows an eBPF data plane still translates:
    /// its programs and pins go when none is left.
    pub draining_flows: Option<usize>,
    /// What `status` cannot tell from what is installed, or what is left of an agent that no
    /// longer runs.
    pub notes: Vec<String>,
}

/// What is installed, read back from the kernel: the chains, the eBPF objects pinned under
/// `bpffs` if given, and what that makes of each device.
pub(super) fn read_back(chain: &str, bpffs: Option<&std::path::Path>) -> anyhow::Result<Status> {
    let chains = read_chains(chain)?;
    let ebpf = bpffs.map(read_status).transpose()?.flatten();
    let attached = ebpf.as_ref().is_some_and(|e| !e.attachments.is_empty());
    let installed = chains.iter().find(|c| c.installed);
    let mode = if attached || installed.is_some_and(|c| !c.ebpf_protocols_returned.is_empty()) {
        Some(Mode::Ebpf)
    } else {
        installed.map(|_| Mode::Iptables)
    };
    let devices = coverage::of_devices(&netdev::names_and_indexes()?, &chains, ebpf.as_ref());
    Ok(Status {
        mode,
        mode_reason: None,
        chains,
        ebpf,
        devices,
        draining_flows: None,
        notes: Vec::new(),
    })
}

/// Reads back whatever the agent installed, for `masq-agent status` in a separate process.
pub fn inspect(chain: &str, bpffs: &std::path::Path) -> anyhow::Result<Status> {
    let mut status = read_back(chain, Some(bpffs))?;
    match state::read_last(bpffs) {
        Some((record, state::Liveness::Running)) => {
            status.mode = Some(record.mode);
            status.mode_reason = record.reason;
        }
        // What an agent that exited left, or one whose pid means nothing here: its record says
        // why, where the kernel still holds what it says.
        Some((record, liveness)) if status.mode.is_some() => {
            if agrees(record.mode, status.mode) {
                status.mode = Some(record.mode);
                status.mode_reason = record.reason;
            }
            status.notes.push(match liveness {
                state::Liveness::Exited => format!(
                    "no agent runs: the one that installed this (pid {}, {}) has exited",
                    record.pid, record.mode
                ),
                _ => format!(
                    "the agent that installed this ({}) has pid {} in another pid namespace \
                     (its container's, or the node's): whether it still runs cannot be told \
                     from here",
                    record.mode, record.pid
                ),
            });
        }
        _ => {}
    }
    if status.mode == Some(Mode::Ebpf) && status.ebpf.is_none() {
        status.notes.push(format!(
            "the chain leaves traffic to eBPF programs, but nothing is pinned under {}: the \
             agent runs with another --bpffs, or its programs are gone; what the devices say \
             of eBPF cannot be told from here",
            bpffs.display()
        ));
    }
    status.draining_flows = status
        .ebpf
        .as_ref()
        .filter(|_| status.mode != Some(Mode::Ebpf))
        .map(|ebpf| ebpf.translated_flows());
    Ok(status)
}

/// Whether what is installed (`installed`, read back from the kernel) is what an agent of
/// `recorded` mode installs.
fn agrees(recorded: Mode, installed: Option<Mode>) -> bool {
    matches!(
        (recorded, installed),
        (Mode::Ebpf, Some(Mode::Ebpf))
            | (
                Mode::Iptables | Mode::IptablesFallback,
                Some(Mode::Iptables)
            )
    )
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.mode, &self.mode_reason) {
            (Some(mode), Some(reason)) => writeln!(f, "data plane: {mode}, because {reason}")?,
            (Some(mode), None) => writeln!(f, "data plane: {mode}")?,
            (None, _) => writeln!(f, "data plane: none installed")?,
        }
        for note in &self.notes {
            writeln!(f, "  note: {note}")?;
        }
        if !self.devices.is_empty() {
            writeln!(f, "devices (what masquerades traffic leaving each):")?;
            for device in &self.devices {
                write!(f, "{device}")?;
            }
        }
        if let Some(flows) = self.draining_flows {
            writeln!(
                f,
                "eBPF data plane draining: {flows} translated flows left; its programs and pins go when none is left"
            )?;
        }
        if let Some(ebpf) = &self.ebpf {
            write!(f, "{ebpf}")?;
        }
        for chain in &self.chains {
            write!(f, "{chain}")?;
        }
        Ok(())
    }
}

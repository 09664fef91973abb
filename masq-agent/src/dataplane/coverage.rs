//! Which data plane masquerades what leaves each device, worked out from what was read back:
//! the eBPF programs only where the chain returns the device's traffic to them and they run
//! there with an address to give; the chain wherever it does not return it.

use serde::Serialize;

use super::{ebpf::status::EbpfStatus, iptables::readback::ChainStatus};
use crate::policy::IpFamily;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Coverage {
    /// The programs translate it: the chain returns it to them, and they run on the device
    /// with its address in the `interfaces` map.
    Ebpf,
    /// The chain masquerades it.
    Iptables,
    /// Nothing does: no chain is in force for the family, or the chain returns the traffic to
    /// programs that do not translate it.
    None,
    /// The chain returns the traffic to programs whose pins `status` did not find (another
    /// `--bpffs`, or the programs gone): whether they translate it cannot be told.
    Unknown,
}

impl std::fmt::Display for Coverage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Coverage::Ebpf => "ebpf",
            Coverage::Iptables => "iptables",
            Coverage::None => "none",
            Coverage::Unknown => "unknown",
        })
    }
}

/// One device of the node, and what masquerades each family leaving by it.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceCoverage {
    pub device: String,
    pub index: u32,
    pub ipv4: Coverage,
    pub ipv6: Coverage,
    /// For a device the chain covers while the programs still run on it (no longer selected):
    /// the flows they translate through it, which drain before they are taken off.
    pub draining_flows: Option<usize>,
}

impl std::fmt::Display for DeviceCoverage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "  {}: ipv4 {}, ipv6 {}",
            self.device, self.ipv4, self.ipv6
        )?;
        match self.draining_flows {
            Some(flows) => writeln!(f, " (programs draining: {flows} translated flows left)"),
            None => writeln!(f),
        }
    }
}

/// What masquerades what leaves each of `devices` (name and index).
pub fn of_devices(
    devices: &[(String, u32)],
    chains: &[ChainStatus],
    ebpf: Option<&EbpfStatus>,
) -> Vec<DeviceCoverage> {
    devices
        .iter()
        .map(|(device, index)| {
            let covered = |family| coverage(family, device, *index, chains, ebpf);
            let (ipv4, ipv6) = (covered(IpFamily::Ipv4), covered(IpFamily::Ipv6));
            let returned = ipv4 == Coverage::Ebpf || ipv6 == Coverage::Ebpf;
            DeviceCoverage {
                device: device.clone(),
                index: *index,
                ipv4,
                ipv6,
                draining_flows: ebpf
                    .filter(|_| !returned)
                    .and_then(|e| e.flows_through(device, *index)),
            }
        })
        .collect()
}

fn coverage(
    family: IpFamily,
    device: &str,
    index: u32,
    chains: &[ChainStatus],
    ebpf: Option<&EbpfStatus>,
) -> Coverage {
    let Some(chain) = chains.iter().find(|c| c.family == family && c.in_force()) else {
        return Coverage::None;
    };
    match ebpf {
        _ if !chain.returns_to_programs(device) => Coverage::Iptables,
        None => Coverage::Unknown,
        Some(e) if e.translates(device, index, family) => Coverage::Ebpf,
        Some(_) => Coverage::None,
    }
}
